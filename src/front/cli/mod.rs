//! The command line (SPEC §5): `run`, one service call per command (the clap definitions are
//! in `args.rs`), text or JSON output, and `exit_code_of`, the one place errors become exit
//! codes.

mod args;
mod engine;
mod status;
mod task;

pub use args::{Actor, AgentCmd, Cli, Command, LogFormat, SendArgs, SuperviseArgs, TaskCmd};
use engine::{engine_cmd, policy_from_env, sim_cmd};
use status::status;
use task::task;

use crate::adapter::command::Supervise;
use crate::engine::{Engine, EngineError};
use crate::service::{Outcome, Service, ServiceError};
use crate::service::{StoreError, token_path};
use clap::{Args, Parser, Subcommand};
use serde::Serialize;
use serde_json::{Value, json};
use std::io::Read as _;
use std::path::PathBuf;
use std::time::Duration;

const DEFAULT_DB: &str = "./.handoffs/handoffs.sqlite3";

/// A failure of a command, with its exit code.
#[derive(Debug)]
pub struct Failure {
    pub code: u8,
    pub message: String,
}

impl From<ServiceError> for Failure {
    fn from(e: ServiceError) -> Self {
        Failure {
            code: exit_code_of(&e),
            message: e.to_string(),
        }
    }
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        Failure::from(ServiceError::Store(e))
    }
}

/// The one place a service error becomes an exit code (SPEC §5).
pub fn exit_code_of(e: &ServiceError) -> u8 {
    match e {
        ServiceError::Usage(_) => 2,
        ServiceError::Refused(_) | ServiceError::NotFound(_) | ServiceError::Store(_) => 1,
    }
}

fn usage(message: impl Into<String>) -> Failure {
    Failure {
        code: 2,
        message: message.into(),
    }
}

/// The database path: --db, else $HANDOFFS_DB, else the default.
pub fn db_path(cli: &Cli) -> PathBuf {
    cli.db
        .clone()
        .or_else(|| {
            std::env::var_os("HANDOFFS_DB")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        })
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DB))
}

fn open(cli: &Cli) -> Result<Service, Failure> {
    Ok(Service::open(&db_path(cli))?)
}

/// Prints `value` as JSON, or `text` for people.
fn emit<T: Serialize>(cli: &Cli, value: &T, text: impl FnOnce() -> String) {
    if cli.json {
        out(&serde_json::to_string_pretty(value).unwrap_or_default());
    } else {
        let t = text();
        if !t.is_empty() {
            out(t.trim_end());
        }
    }
}

/// Prints one line on stdout. A reader that went away (`handoffs status | head -1`) ends
/// the process quietly, as SIGPIPE would, instead of a panic.
fn out(line: &str) {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = writeln!(stdout, "{line}").and_then(|()| stdout.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(141);
        }
        eprintln!("handoffs: cannot write to stdout: {e}");
        std::process::exit(1);
    }
}

use crate::text::when;

use crate::text::{one_line, short};

/// Runs the command; `Err` carries the exit code and the one line to print.
pub fn run(cli: &Cli) -> Result<(), Failure> {
    match &cli.command {
        Command::Init => {
            let path = db_path(cli);
            let (_, created) = Service::init(&path)?;
            let token = token_path(&path);
            emit(
                cli,
                &json!({"db": path, "token_file": token, "created": created}),
                || {
                    if created {
                        format!("created {} (token in {})", path.display(), token.display())
                    } else {
                        format!("{} is ready", path.display())
                    }
                },
            );
            Ok(())
        }
        Command::Agent(cmd) => agent(cli, cmd),
        Command::Allow { from, to } | Command::Block { from, to } => {
            let allowed = matches!(cli.command, Command::Allow { .. });
            let mut s = open(cli)?;
            s.set_connection(from, to, allowed)?;
            let verb = if allowed { "allowed" } else { "blocked" };
            emit(
                cli,
                &json!({"from": from, "to": to, "allowed": allowed}),
                || format!("{from} → {to} {verb}"),
            );
            Ok(())
        }
        Command::Config { key, value } => config_cmd(cli, key.as_deref(), value.as_deref()),
        Command::Send(a) => send_cmd(cli, a),
        Command::Inbox { agent, all, limit } => inbox_cmd(cli, agent, *all, *limit),
        Command::Read { id, actor } => read_cmd(cli, id, &actor.as_agent),
        Command::Accept { id, actor } => {
            let mut s = open(cli)?;
            let w = s.accept(id, &actor.as_agent)?;
            emit(cli, &w, || format!("{} accepted", short(&w.id)));
            Ok(())
        }
        Command::Return {
            id,
            actor,
            summary,
            evidence,
            blocked,
        } => {
            let mut s = open(cli)?;
            let (w, ret) =
                s.return_work(id, &actor.as_agent, summary, evidence.as_deref(), *blocked)?;
            emit(cli, &json!({"work": w, "return_message": ret}), || {
                format!(
                    "{} {}; return {} sent to {}",
                    short(&w.id),
                    w.state,
                    short(&ret.id),
                    w.sender
                )
            });
            Ok(())
        }
        Command::Close {
            id,
            actor,
            outcome,
            note,
        } => {
            let mut s = open(cli)?;
            let w = s.close(id, &actor.as_agent, *outcome, note.as_deref())?;
            emit(cli, &w, || {
                format!("{} closed: {}", short(&w.id), outcome.as_str())
            });
            Ok(())
        }
        Command::Status { id } => status(cli, id.as_deref()),
        Command::Doctor => doctor_cmd(cli),
        Command::Release { id, note } => {
            let mut s = open(cli)?;
            let v = s.release(id, note.as_deref())?;
            emit(cli, &v, || {
                format!("{} {}: {}", short(&v.id), v.state, v.detail)
            });
            Ok(())
        }
        Command::Tick => engine_cmd(cli, None),
        Command::Completions { shell } => {
            use clap::CommandFactory;
            let mut script = Vec::new();
            clap_complete::generate(*shell, &mut Cli::command(), "handoffs", &mut script);
            out(String::from_utf8_lossy(&script).trim_end());
            Ok(())
        }
        Command::Run { interval } => {
            if !(interval.is_finite() && *interval > 0.0 && *interval <= 3_600.0) {
                return Err(usage(
                    "--interval must be more than 0 and at most 3600 seconds",
                ));
            }
            engine_cmd(cli, Some(Duration::from_secs_f64(*interval)))
        }
        Command::Serve {
            host,
            port,
            public_demo,
        } => {
            let policy = if std::env::var_os("HANDOFFS_POLICY").is_some() {
                Some(policy_from_env()?)
            } else {
                None
            };
            crate::front::live::serve(&db_path(cli), host, *port, *public_demo, policy)?;
            Err(Failure {
                code: crate::front::live::stop_code(),
                message: String::new(),
            })
        }
        Command::Mcp {
            agent,
            context_library,
            channels,
        } => Ok(crate::front::mcp::serve_stdio(
            &db_path(cli),
            agent,
            context_library.as_deref(),
            *channels,
        )?),
        Command::Task(cmd) => task(cli, cmd),
        Command::Demo {
            port,
            host,
            speed,
            public_demo,
        } => {
            crate::front::live::demo(host, *port, *speed, *public_demo)?;
            Err(Failure {
                code: crate::front::live::stop_code(),
                message: String::new(),
            })
        }
        Command::Sim { seed, seeds, trace } => sim_cmd(cli, *seed, seeds.as_deref(), *trace),
        Command::Supervise(a) => supervise_cmd(cli, a),
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, Failure> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure {
            code: 1,
            message: format!("cannot start the runtime: {e}"),
        })
}

fn agent(cli: &Cli, cmd: &AgentCmd) -> Result<(), Failure> {
    let mut s = open(cli)?;
    match cmd {
        AgentCmd::Add {
            id,
            provider,
            name,
            endpoint,
            cwd,
            settings,
        } => {
            let mut a = s.add_agent(
                id,
                provider.as_deref(),
                name.as_deref(),
                endpoint.as_deref(),
                cwd.as_deref(),
                settings,
            )?;
            a.warnings = Service::destination_problems(&a.agent);
            emit(cli, &a, || a.sentence());
            for w in &a.warnings {
                eprintln!("handoffs: warning: {} {w}", a.agent.id);
            }
        }
        AgentCmd::List => {
            let agents = s.agents()?;
            emit(cli, &agents, || {
                if agents.is_empty() {
                    return "no agents; add one with `handoffs agent add ID --provider P`"
                        .to_owned();
                }
                agents
                    .iter()
                    .map(|a| format!("{}  {}  {}  {}", a.id, a.provider, a.endpoint, a.settings))
                    .collect::<Vec<_>>()
                    .join("\n")
            });
        }
        AgentCmd::Remove { id } => {
            s.remove_agent(id)?;
            emit(cli, &json!({"removed": id}), || format!("{id} removed"));
        }
    }
    Ok(())
}

fn config_cmd(cli: &Cli, key: Option<&str>, value: Option<&str>) -> Result<(), Failure> {
    let mut s = open(cli)?;
    match (key, value) {
        (None, _) => {
            let all = s.config()?;
            let map: serde_json::Map<String, Value> = all.iter().cloned().collect();
            emit(cli, &map, || {
                let mut out = String::new();
                for (k, v) in &all {
                    out.push_str(&format!("{k} = {v}\n"));
                }
                out
            });
        }
        (Some(k), None) => {
            let v = s.config_get(k)?;
            emit(cli, &json!({ k.to_owned(): v }), || v.to_string());
        }
        (Some(k), Some(v)) => {
            let v = s.config_set(k, v)?;
            emit(cli, &json!({ k.to_owned(): v }), || format!("{k} = {v}"));
        }
    }
    Ok(())
}

fn send_cmd(cli: &Cli, a: &SendArgs) -> Result<(), Failure> {
    // The service checks these for every front, naming its API's fields; here they are
    // said in this front's words, its flags.
    match (a.due_minutes, &a.title) {
        (Some(_), None) => {
            return Err(usage(
                "--due-minutes needs --title (only work has a due time)",
            ));
        }
        (Some(m), _) if !(1..=crate::service::DUE_MINUTES_MAX).contains(&m) => {
            return Err(usage(format!(
                "--due-minutes must be 1 to {}",
                crate::service::DUE_MINUTES_MAX
            )));
        }
        _ => {}
    }
    let body = if a.message == "-" {
        let mut buf = String::new();
        std::io::stdin()
            .take(4 * 1024 * 1024)
            .read_to_string(&mut buf)
            .map_err(|e| usage(format!("cannot read the message from stdin: {e}")))?;
        buf
    } else {
        a.message.clone()
    };
    let mut s = open(cli)?;
    let sent = s.send(
        &a.from,
        &a.to,
        &body,
        a.title.as_deref(),
        a.due_minutes,
        a.key.as_deref(),
    )?;
    emit(cli, &sent, || {
        let state = sent
            .delivery_state
            .map_or_else(|| "not enrolled".to_owned(), |k| k.to_string());
        if sent.created {
            format!("{} {} → {} ({state})", sent.message.id, a.from, a.to)
        } else {
            format!("{} already sent with this key ({state})", sent.message.id)
        }
    });
    Ok(())
}

fn inbox_cmd(cli: &Cli, agent: &str, all: bool, limit: i64) -> Result<(), Failure> {
    if !(1..=crate::service::LIST_LIMIT_MAX).contains(&limit) {
        return Err(usage("--limit must be 1 to 10000"));
    }
    let mut s = open(cli)?;
    let msgs = s.inbox(agent, all, limit)?;
    emit(cli, &msgs, || {
        if msgs.is_empty() {
            return format!(
                "no {}messages for {agent}",
                if all { "" } else { "unread " }
            );
        }
        msgs.iter()
            .map(|m| {
                let mark = if m.read_at.is_some() { " " } else { "*" };
                let what = m.title.clone().unwrap_or_else(|| one_line(&m.body, 60));
                format!(
                    "{mark} {}  {}  from {}  {}",
                    short(&m.id),
                    when(m.created_at),
                    m.sender,
                    what
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    });
    Ok(())
}

fn read_cmd(cli: &Cli, id: &str, reader: &str) -> Result<(), Failure> {
    let mut s = open(cli)?;
    let m = s.read(id, reader)?;
    emit(cli, &m, || {
        let mut out = format!(
            "id: {}\nfrom: {}\nto: {}\nsent: {}\n",
            m.id,
            m.sender,
            m.recipient,
            when(m.created_at)
        );
        if let Some(t) = &m.title {
            out.push_str(&format!("title: {t}\n"));
        }
        out.push('\n');
        out.push_str(&m.body);
        out
    });
    Ok(())
}

fn doctor_cmd(cli: &Cli) -> Result<(), Failure> {
    let mut s = open(cli)?;
    let findings = s.doctor()?;
    emit(cli, &findings, || {
        findings
            .iter()
            .map(|f| {
                let mark = if f.ok { "ok     " } else { "PROBLEM" };
                if f.agent.is_empty() {
                    format!("{mark} {}\n", f.text)
                } else {
                    format!("{mark} {}: {}\n", f.agent, f.text)
                }
            })
            .collect()
    });
    match findings.iter().filter(|f| !f.ok).count() {
        0 => Ok(()),
        n => Err(Failure {
            code: 1,
            message: format!(
                "doctor: {n} {} found",
                if n == 1 { "problem" } else { "problems" }
            ),
        }),
    }
}

fn supervise_cmd(cli: &Cli, a: &SuperviseArgs) -> Result<(), Failure> {
    let sup = Supervise {
        db: db_path(cli),
        request_id: a.request_id.clone(),
        message: a.message.clone(),
        agent: a.agent.clone(),
        timeout_secs: a.timeout,
        text_file: a.text_file.clone(),
        endpoint: a.endpoint.clone(),
        cwd: a.cwd.clone(),
        argv: a.argv.clone(),
        codex: a
            .codex_thread
            .as_ref()
            .map(|id| crate::adapter::codex::Thread {
                id: id.clone(),
                home: a.codex_home.clone(),
                accept_approvals: a.codex_accept_approvals,
            }),
        claude: a
            .claude_session
            .as_ref()
            .map(|id| crate::adapter::claude::Session {
                id: id.clone(),
                config_dir: a.claude_config_dir.clone(),
            }),
    };
    let rt = runtime()?;
    let code = rt.block_on(crate::adapter::command::supervise(sup));
    if code == 0 {
        Ok(())
    } else {
        Err(Failure {
            code: u8::try_from(code).unwrap_or(1),
            message: "supervise failed".to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::CommandFactory;

    /// Every argument and option of every visible command says what it is for.
    #[test]
    fn every_argument_has_a_help_line() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if arg.is_hide_set() || id == "help" || id == "version" {
                    continue;
                }
                if arg.get_help().is_none() {
                    missing.push(format!("{path} {id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                if !sub.is_hide_set() && sub.get_name() != "help" {
                    walk(sub, &format!("{path} {}", sub.get_name()), missing);
                }
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "handoffs", &mut missing);
        assert!(missing.is_empty(), "no help line: {missing:#?}");
    }
}
