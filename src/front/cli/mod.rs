//! The command line (SPEC §5): `run`, one service call per command (the clap definitions are
//! in `args.rs`), text or JSON output, and `exit_code_of`, the one place errors become exit
//! codes.

mod args;
mod engine;
mod status;
mod task;

pub use args::{
    Actor, AgentCmd, Cli, Command, LogFormat, SendArgs, ServeArgs, SuperviseArgs, TaskCmd,
};
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
        ServiceError::Refused(_)
        | ServiceError::NotFound(_)
        | ServiceError::Fenced(_)
        | ServiceError::Store(_) => 1,
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
    crate::service::check_db_url(&db_path(cli)).map_err(usage)?;
    match &cli.command {
        Command::Init => {
            let path = db_path(cli);
            let (_, created) = Service::init(&path)?;
            let token = token_path(&path);
            let db = crate::service::shown(&path);
            emit(
                cli,
                &json!({
                    "db": db,
                    "token_file": token,
                    "created": created.database,
                    "token_created": created.token,
                }),
                || match (created.database, created.token) {
                    (true, _) => format!("created {db} (token in {})", token.display()),
                    (false, true) => {
                        format!("{db} is ready (a new token in {})", token.display())
                    }
                    (false, false) => format!("{db} is ready"),
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
        Command::Wait {
            actor,
            timeout_seconds: t,
            since,
        } => wait_cmd(cli, &actor.as_agent, *t, *since),
        Command::Read { id, actor } => read_cmd(cli, id, &actor.as_agent),
        Command::Accept { id, actor } => accept_cmd(cli, id, &actor.as_agent),
        Command::Return {
            id,
            actor,
            summary,
            evidence,
            blocked,
        } => return_cmd(
            cli,
            id,
            &actor.as_agent,
            (summary, evidence.as_deref()),
            *blocked,
        ),
        Command::Close {
            id,
            actor,
            outcome,
            note,
        } => close_cmd(cli, id, &actor.as_agent, *outcome, note.as_deref()),
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
        Command::Serve(args) => {
            serve(cli, args)?;
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
        Command::Chain(cmd) => chain_cmd(cli, cmd),
        Command::Dead(cmd) => dead_cmd(cli, cmd),
        Command::Topic(cmd) => topic_cmd(cli, cmd),
        Command::Trace {
            chain,
            since,
            format,
            limit,
        } => trace_cmd(cli, chain.as_deref(), since.as_deref(), *format, *limit),
        Command::Fanout(c) => fanout_cmd(cli, c),
        Command::Context(c) => context_cmd(cli, c),
        Command::Artifact(args::ArtifactCmd::Get { id }) => {
            let a = open(cli)?.artifact_get(id, None)?;
            emit(cli, &a, || a.body.clone());
            Ok(())
        }
        Command::Demo {
            port,
            host,
            speed,
            public_demo,
            allow_peer,
        } => demo_cmd(cli, host, *port, *speed, *public_demo, allow_peer),
        Command::Sim {
            seed,
            seeds,
            trace,
            engines,
        } => sim_cmd(cli, *seed, seeds.as_deref(), *trace, usize::from(*engines)),
        Command::Supervise(a) => supervise_cmd(cli, a),
    }
}

/// `demo`: on a PostgreSQL database the demo plays its team there, beside the engines of
/// other machines (compose.yaml), once its server answers; otherwise on a temporary SQLite
/// file.
fn demo_cmd(
    cli: &Cli,
    host: &str,
    port: Option<u16>,
    speed: f64,
    public_demo: bool,
    allow_peer: &[std::net::IpAddr],
) -> Result<(), Failure> {
    let db = db_path(cli);
    let shared = crate::service::is_postgres_url(&db).then_some(db.as_path());
    crate::front::live::check_speed(speed)?;
    // Its server may still be starting (compose.yaml starts them together).
    engine::wait_for_server(cli, true, || crate::service::server_answers(&db))?;
    crate::front::live::demo(host, port, speed, public_demo, allow_peer, shared)?;
    Err(Failure {
        code: crate::front::live::stop_code(),
        message: String::new(),
    })
}

fn return_cmd(
    cli: &Cli,
    id: &str,
    actor: &str,
    (summary, evidence): (&str, Option<&str>),
    blocked: bool,
) -> Result<(), Failure> {
    let r = open(cli)?.return_work(id, actor, summary, evidence, blocked)?;
    emit(
        cli,
        &json!({"work": r.work, "return_message": r.message, "fanout": r.fanout}),
        || {
            let work = &r.work;
            let head = format!("{} {}", short(&work.id), work.state);
            match (&r.fanout, &r.message) {
                (Some(fan), Some(msg)) if fan.combined_id.as_ref() == Some(&msg.id) => format!(
                    "{head}; fan-out {} joined: combined return {} sent to {}",
                    short(&fan.id),
                    short(&msg.id),
                    fan.sender
                ),
                (Some(fan), Some(_)) => format!(
                    "{head} late: fan-out {} was already joined {}; {} is told",
                    short(&fan.id),
                    fan.state,
                    fan.sender
                ),
                (Some(fan), None) => format!(
                    "{head}; fan-out {} waits for its join ({})",
                    short(&fan.id),
                    if fan.join_rule == "all" {
                        format!("all {}", fan.children)
                    } else {
                        format!("quorum {} of {}", fan.quorum, fan.children)
                    }
                ),
                (None, Some(msg)) => {
                    format!("{head}; return {} sent to {}", short(&msg.id), work.sender)
                }
                (None, None) => head,
            }
        },
    );
    Ok(())
}

fn close_cmd(
    cli: &Cli,
    id: &str,
    actor: &str,
    outcome: Outcome,
    note: Option<&str>,
) -> Result<(), Failure> {
    let mut s = open(cli)?;
    let w = s.close(id, actor, outcome, note)?;
    emit(cli, &w, || {
        format!("{} closed: {}", short(&w.id), outcome.as_str())
    });
    Ok(())
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

/// `serve`: the engine and the page (with remote MCP) until Ctrl+C.
fn serve(cli: &Cli, args: &ServeArgs) -> Result<(), Failure> {
    let options = crate::front::web::WebOptions {
        public_demo: args.public_demo,
        allowed_hosts: args.allow_host.clone(),
        allowed_peers: args.allow_peer.clone(),
        remote_mcp: true,
        context_library: args.context_library.clone(),
    };
    let tls = args
        .tls_cert
        .clone()
        .zip(args.tls_key.clone())
        .map(|(cert, key)| crate::front::tls::TlsFiles { cert, key });
    let policy = if std::env::var_os("HANDOFFS_POLICY").is_some() {
        Some(policy_from_env()?)
    } else {
        None
    };
    // Its arguments first (a wrong one is exit 2 at once), then the database: a PostgreSQL
    // server (and its schema) is waited for as `run` waits.
    for entry in &args.allow_host {
        crate::front::web::check_allowed_host(entry).map_err(usage)?;
    }
    let tls = tls
        .as_ref()
        .map(crate::front::tls::TlsFiles::load)
        .transpose()?;
    drop(engine::open_or_wait(cli, true)?);
    crate::front::live::serve(&db_path(cli), &args.host, args.port, options, tls, policy)?;
    Ok(())
}

/// `agent token ID`: issue (rotate), revoke, or show an agent's bearer token for remote MCP.
fn agent_token(
    cli: &Cli,
    s: &mut Service,
    id: &str,
    expires_minutes: Option<f64>,
    never_expires: bool,
    revoke: bool,
    show: bool,
) -> Result<(), Failure> {
    if show {
        let t = s.agent_token_info(id)?;
        emit(cli, &t, || match (t.token, t.expires_at) {
            (false, _) => format!("{id} has no token (`handoffs agent token {id}` issues one)"),
            (true, None) => format!("{id} has a token that never expires"),
            (true, Some(at)) if t.expired => {
                format!("{id}'s token expired {}", crate::text::when(at))
            }
            (true, Some(at)) => format!("{id} has a token until {}", crate::text::when(at)),
        });
        return Ok(());
    }
    if revoke {
        let had = s.revoke_agent_token(id)?;
        emit(cli, &json!({"agent": id, "revoked": had}), || {
            if had {
                format!("{id}: token revoked")
            } else {
                format!("{id} had no token")
            }
        });
        return Ok(());
    }
    let ttl = if never_expires {
        None
    } else {
        Some(expires_minutes.unwrap_or(crate::service::tokens::TTL_DEFAULT_MINUTES))
    };
    let t = s.issue_agent_token(id, ttl)?;
    if !cli.json {
        // The token alone on stdout (`TOKEN=$(handoffs agent token ID)`); the rest is for the
        // person.
        let until = t.expires_at.map_or("never expires".to_owned(), |at| {
            format!("expires {}", crate::text::when(at))
        });
        let was = if t.rotated {
            "; the old one no longer works"
        } else {
            ""
        };
        eprintln!("handoffs: agent {id}'s token for serve's /mcp, shown once; {until}{was}");
    }
    emit(cli, &t, || t.token.clone());
    Ok(())
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
                    .map(|a| {
                        let host = a
                            .host
                            .as_ref()
                            .map_or_else(String::new, |h| format!("  (on {h})"));
                        format!(
                            "{}  {}  {}  {}{host}",
                            a.id, a.provider, a.endpoint, a.settings
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            });
        }
        AgentCmd::Remove { id } => {
            s.remove_agent(id)?;
            emit(cli, &json!({"removed": id}), || format!("{id} removed"));
        }
        AgentCmd::Token {
            id,
            expires_minutes,
            never_expires,
            revoke,
            show,
        } => agent_token(
            cli,
            &mut s,
            id,
            *expires_minutes,
            *never_expires,
            *revoke,
            *show,
        )?,
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

/// A send from inside a supervised turn (its run's `HANDOFFS_REQUEST_ID`) continues that
/// turn's chain; a person's send starts one, unless --parent names it.
fn lineage_of(a: &SendArgs) -> crate::service::Lineage {
    let request_id = std::env::var("HANDOFFS_REQUEST_ID")
        .ok()
        .filter(|r| !r.is_empty());
    crate::service::Lineage {
        parent: a.parent.clone(),
        in_turn: request_id.is_some(),
        request_id,
        budget: a.budget.clone(),
        session: None,
    }
}

/// `send FROM --to A,B,… MESSAGE --title T [--join …] [--deadline-minutes N]`: a fan-out.
fn fan_out_cmd(cli: &Cli, a: &SendArgs) -> Result<(), Failure> {
    let Some(list) = &a.fan_to else {
        return Err(usage(
            "--join, --deadline-minutes and --cancel-rest are for a fan-out: name its agents \
             with --to A,B,…",
        ));
    };
    if a.message.is_some() {
        return Err(usage(
            "with --to the agents are named there: give FROM and the message only",
        ));
    }
    let Some(title) = &a.title else {
        return Err(usage("a fan-out splits work: give it a --title"));
    };
    let to: Vec<String> = list.split(',').map(|t| t.trim().to_owned()).collect();
    let body = message_arg(&a.to)?;
    let mut s = open(cli)?;
    let lineage = lineage_of(a);
    s.set_policy(policy_from_env()?);
    let done = s.fan_out(&crate::service::FanOut {
        from: &a.from,
        to: &to,
        body: &body,
        title,
        join: a.join.as_deref(),
        deadline_minutes: a.deadline_minutes,
        cancel_rest: a.cancel_rest,
        due_minutes: a.due_minutes,
        key: a.key.as_deref(),
        lineage: &lineage,
    })?;
    emit(cli, &done, || {
        let kids: Vec<String> = done
            .children
            .iter()
            .map(|c| format!("{} → {}", c.message.id, c.message.recipient))
            .collect();
        let f = &done.fanout;
        let rule = if f.join_rule == "all" {
            format!("join all {}", f.children)
        } else {
            format!("quorum {} of {}", f.quorum, f.children)
        };
        let deadline = f
            .deadline_at
            .map(|d| format!(", deadline {}", crate::text::when(d)))
            .unwrap_or_default();
        let again = if done.created {
            ""
        } else {
            " (already sent with this key)"
        };
        format!(
            "fan-out {} ({rule}{deadline}){again}\n{}",
            f.id,
            kids.join("\n")
        )
    });
    Ok(())
}

/// `context get|put|keys`: the shared corpus of a context library.
fn context_cmd(cli: &Cli, c: &args::ContextCmd) -> Result<(), Failure> {
    use crate::context::{Library, Rule};
    match c {
        args::ContextCmd::Get { key, library } => {
            let e = Library::open_existing(library)?.corpus_get(key)?;
            emit(cli, &e, || {
                format!(
                    "{} ({}, version {}, by {} at {})\n{}",
                    e.key,
                    e.rule.as_str(),
                    e.version,
                    e.writer,
                    e.updated,
                    serde_json::to_string_pretty(&e.value).unwrap_or_default()
                )
            });
        }
        args::ContextCmd::Put {
            key,
            values,
            actor,
            rule,
            version,
            library,
        } => {
            crate::service::check_agent_id(&actor.as_agent)?;
            let lib = Library::open(library)?;
            let given = rule.as_deref().map(str::parse::<Rule>).transpose()?;
            let value = crate::context::value_from_text(lib.corpus_rule(key, given)?, values)?;
            let put = lib.corpus_put(&actor.as_agent, key, &value, given, *version)?;
            emit(cli, &put, || {
                format!(
                    "{} version {}{}",
                    put.entry.key,
                    put.entry.version,
                    if put.changed { "" } else { " (unchanged)" }
                )
            });
        }
        args::ContextCmd::Keys { library } => {
            let keys = Library::open_existing(library)?.corpus_list()?;
            emit(cli, &keys, || {
                keys.iter()
                    .map(|e| {
                        format!(
                            "{}\t{}\tversion {}\tby {}",
                            e.key,
                            e.rule.as_str(),
                            e.version,
                            e.writer
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            });
        }
    }
    Ok(())
}

fn fanout_cmd(cli: &Cli, c: &args::FanoutCmd) -> Result<(), Failure> {
    let mut s = open(cli)?;
    let views = match c {
        args::FanoutCmd::Show { id } => vec![s.fanout_show(id)?],
        args::FanoutCmd::List { limit } => {
            if !(1..=crate::service::LIST_LIMIT_MAX).contains(limit) {
                return Err(usage("--limit must be 1 to 10000"));
            }
            s.fanouts_waiting(*limit)?
        }
    };
    let text = || {
        let mut out = Vec::new();
        for v in &views {
            let f = &v.fanout;
            out.push(format!(
                "fan-out {} by {}: {} — {} ({} of {} answered, {} needed){}",
                f.id,
                f.sender,
                f.title,
                f.state,
                v.answered,
                f.children,
                f.quorum,
                f.combined_id
                    .as_ref()
                    .map(|m| format!("; combined return {}", short(m)))
                    .unwrap_or_default()
            ));
            for k in &v.children {
                out.push(format!(
                    "  {} {} {}{}",
                    short(&k.message_id),
                    k.recipient,
                    k.work_state.as_deref().unwrap_or("?"),
                    if k.late { " (late)" } else { "" }
                ));
            }
        }
        if out.is_empty() {
            "no fan-out waits for its join".to_owned()
        } else {
            out.join("\n")
        }
    };
    match c {
        args::FanoutCmd::Show { .. } => emit(cli, &views[0], text),
        args::FanoutCmd::List { .. } => emit(cli, &views, text),
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
    let fan_out =
        a.fan_to.is_some() || a.join.is_some() || a.deadline_minutes.is_some() || a.cancel_rest;
    if fan_out {
        return fan_out_cmd(cli, a);
    }
    let Some(message) = &a.message else {
        return Err(usage("give the message (or - to read it from stdin)"));
    };
    let body = message_arg(message)?;
    let mut s = open(cli)?;
    let lineage = lineage_of(a);
    s.set_policy(policy_from_env()?);
    let sent = s.send_as(
        &a.from,
        &a.to,
        &body,
        a.title.as_deref(),
        a.due_minutes,
        a.key.as_deref(),
        &lineage,
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

fn chain_cmd(cli: &Cli, cmd: &args::ChainCmd) -> Result<(), Failure> {
    let mut s = open(cli)?;
    match cmd {
        args::ChainCmd::Show { id } => {
            let view = s.chain_show(id)?;
            emit(cli, &view, || chain_text(&view));
        }
        args::ChainCmd::List { limit } => {
            if !(1..=crate::service::LIST_LIMIT_MAX).contains(limit) {
                return Err(usage("--limit must be 1 to 10000"));
            }
            let chains = s.chain_list(*limit)?;
            emit(cli, &chains, || {
                if chains.is_empty() {
                    return "no chains".to_owned();
                }
                chains
                    .iter()
                    .map(|c| {
                        format!(
                            "{}  {}  {}/{} hops, depth limit {}, from {}{}",
                            c.id,
                            c.state,
                            c.hops,
                            c.hop_budget,
                            c.depth_limit,
                            c.origin,
                            c.stopped_reason
                                .as_deref()
                                .map(|r| format!(": {}", crate::text::one_line(r, 200)))
                                .unwrap_or_default()
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            });
        }
        args::ChainCmd::Cancel { id, note } => {
            s.set_policy(policy_from_env()?);
            let c = s.chain_cancel(id, None, note.as_deref())?;
            emit(cli, &c, || {
                format!(
                    "chain {} cancelled: {} deliveries cancelled, {} turns under way marked, {} work closed; told: {}",
                    c.chain.id,
                    c.cancelled.len(),
                    c.marked.len(),
                    c.closed_work.len(),
                    if c.notified.is_empty() {
                        "nobody".to_owned()
                    } else {
                        c.notified.join(", ")
                    }
                )
            });
        }
        args::ChainCmd::Resume { id, add } => {
            let c = s.chain_resume(id, add)?;
            emit(cli, &c, || {
                format!(
                    "chain {} open again: {}/{} hops, depth limit {}{}",
                    c.id,
                    c.hops,
                    c.hop_budget,
                    c.depth_limit,
                    units_text(&c.units)
                )
            });
        }
        args::ChainCmd::Spend {
            units,
            agent,
            parent,
        } => {
            s.set_policy(policy_from_env()?);
            let request_id = std::env::var("HANDOFFS_REQUEST_ID")
                .ok()
                .filter(|r| !r.is_empty());
            let lineage = crate::service::Lineage {
                parent: parent.clone(),
                in_turn: request_id.is_some(),
                request_id,
                budget: None,
                session: None,
            };
            let spent = s.chain_spend(agent, units, &lineage)?;
            emit(cli, &spent, || {
                format!(
                    "spent {units} in chain {}:{}",
                    spent.chain.id,
                    units_text(&spent.chain.units)
                )
            });
        }
    }
    Ok(())
}

fn dead_cmd(cli: &Cli, cmd: &args::DeadCmd) -> Result<(), Failure> {
    let line = |d: &crate::service::DeadLetterRow| {
        let what = d
            .title
            .clone()
            .unwrap_or_else(|| crate::text::one_line(&d.body, 60));
        let fate = match (&d.replayed_as, d.dropped_at) {
            (Some(m), _) => format!(" (replayed as {})", short(m)),
            (None, Some(_)) => " (dropped)".to_owned(),
            (None, None) => String::new(),
        };
        format!(
            "{}  {}  {} → {}  {what}: {}{fate}",
            d.id, d.reason, d.sender, d.recipient, d.detail
        )
    };
    let mut s = open(cli)?;
    match cmd {
        args::DeadCmd::List { all, limit } => {
            if !(1..=crate::service::LIST_LIMIT_MAX).contains(limit) {
                return Err(usage("--limit must be 1 to 10000"));
            }
            let list = s.dead_list(*all, *limit)?;
            emit(cli, &list, || {
                if list.is_empty() {
                    return "no dead letters".to_owned();
                }
                list.iter().map(line).collect::<Vec<_>>().join("\n")
            });
        }
        args::DeadCmd::Show { id } => {
            let d = s.dead_show(id)?;
            emit(cli, &d, || format!("{}\n\n{}", line(&d), d.body));
        }
        args::DeadCmd::Replay { id, to } => {
            let r = s.dead_replay(id, to.as_deref())?;
            emit(cli, &r, || {
                format!(
                    "dead letter {} replayed as {} {} → {}",
                    r.dead_letter.id,
                    r.sent.message.id,
                    r.sent.message.sender,
                    r.sent.message.recipient
                )
            });
        }
        args::DeadCmd::Drop { id } => {
            let d = s.dead_drop(id)?;
            emit(cli, &d, || format!("dead letter {} dropped", d.id));
        }
    }
    Ok(())
}

fn trace_cmd(
    cli: &Cli,
    chain: Option<&str>,
    since: Option<&str>,
    format: args::TraceFormat,
    limit: i64,
) -> Result<(), Failure> {
    let since = since.map(parse_time).transpose()?;
    let rows = open(cli)?.trace(chain, since, limit)?;
    let text = match format {
        args::TraceFormat::Jsonl => crate::service::trace::jsonl(&rows),
        args::TraceFormat::Mermaid => crate::service::trace::mermaid(&rows),
        args::TraceFormat::Otel => {
            serde_json::to_string(&crate::service::trace::otel(&rows)).unwrap_or_default() + "\n"
        }
    };
    print!("{text}");
    Ok(())
}

/// A message argument: the text itself, or `-` for stdin (at most 4 MiB).
fn message_arg(message: &str) -> Result<String, Failure> {
    if message != "-" {
        return Ok(message.to_owned());
    }
    let mut buf = String::new();
    std::io::stdin()
        .take(4 * 1024 * 1024)
        .read_to_string(&mut buf)
        .map_err(|e| usage(format!("cannot read the message from stdin: {e}")))?;
    Ok(buf)
}

/// A time given as RFC 3339 or as milliseconds since the epoch.
fn parse_time(raw: &str) -> Result<i64, Failure> {
    crate::service::config::instant(raw).ok_or_else(|| {
        usage(format!(
            "--since takes a time like 2026-12-01T12:00:00Z or milliseconds since the epoch, not {raw:?}"
        ))
    })
}

fn topic_cmd(cli: &Cli, cmd: &args::TopicCmd) -> Result<(), Failure> {
    use args::TopicCmd;
    let mut s = open(cli)?;
    match cmd {
        TopicCmd::Create {
            name,
            keep,
            keep_minutes,
        } => {
            let c = s.topic_create(name, *keep, *keep_minutes, None)?;
            emit(cli, &c, || {
                format!(
                    "topic {} {} (keeps {} posts, {} minutes)",
                    c.topic.name,
                    if c.created { "created" } else { "exists" },
                    c.topic.keep_count,
                    c.topic.keep_minutes
                )
            });
        }
        TopicCmd::List => {
            let list = s.topic_list()?;
            emit(cli, &list, || {
                if list.is_empty() {
                    return "no topics".to_owned();
                }
                list.iter()
                    .map(|t| {
                        format!(
                            "{}  #{} ({} kept)  subscribers: {}",
                            t.name,
                            t.last_position,
                            t.retained,
                            if t.subscribers.is_empty() {
                                "none".to_owned()
                            } else {
                                t.subscribers.join(", ")
                            }
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            });
        }
        TopicCmd::Subscribe {
            name,
            agent,
            history,
        } => {
            let r = s.topic_subscribe(name, agent, *history)?;
            emit(cli, &r, || {
                format!(
                    "{} {} {} (read from #{})",
                    r.agent,
                    if r.new {
                        "subscribed to"
                    } else {
                        "already subscribes to"
                    },
                    r.topic,
                    r.cursor + 1
                )
            });
        }
        TopicCmd::Unsubscribe { name, agent } => {
            let r = s.topic_unsubscribe(name, agent)?;
            emit(cli, &r, || {
                if r.removed {
                    format!("{} unsubscribed from {}", r.agent, r.topic)
                } else {
                    format!("{} did not subscribe to {}", r.agent, r.topic)
                }
            });
        }
        TopicCmd::Publish {
            name,
            from,
            message,
            key,
        } => {
            let body = message_arg(message)?;
            s.set_policy(policy_from_env()?);
            let p = s.topic_publish(name, from, &body, key.as_deref())?;
            emit(cli, &p, || {
                format!(
                    "{} #{} {}; told {}",
                    p.topic,
                    p.position,
                    if p.repeated {
                        "published before (same key)"
                    } else {
                        "published"
                    },
                    if p.notified.is_empty() {
                        "nobody".to_owned()
                    } else {
                        p.notified.join(", ")
                    }
                )
            });
        }
        TopicCmd::Read {
            name,
            agent,
            from,
            limit,
        } => {
            let r = s.topic_read(name, agent, *from, *limit)?;
            emit(cli, &r, || {
                let mut out: Vec<String> = r
                    .posts
                    .iter()
                    .map(|p| format!("#{} {}: {}", p.position, p.publisher, p.body))
                    .collect();
                if r.skipped > 0 {
                    out.insert(0, format!("({} older posts are no longer kept)", r.skipped));
                }
                if r.posts.is_empty() {
                    out.push(format!("nothing new on {}", r.topic));
                }
                if r.more {
                    out.push("(more follow: read again)".to_owned());
                }
                out.join("\n")
            });
        }
    }
    Ok(())
}

/// A chain as an indented tree (each message below its parent).
/// A chain's own units as text: ` tokens 1200/200000, usd 0.3` (spent/limit).
fn units_text(units: &model::chain::Budget) -> String {
    units
        .lines
        .iter()
        .map(|(unit, l)| match l.limit {
            Some(limit) => format!(" {unit} {}/{limit}", l.spent),
            None => format!(" {unit} {}", l.spent),
        })
        .collect::<Vec<_>>()
        .join(",")
}

fn chain_text(view: &crate::service::ChainView) -> String {
    fn line(m: &crate::service::chains::ChainMessage, depth: usize) -> String {
        let what = m
            .message
            .title
            .clone()
            .unwrap_or_else(|| crate::text::one_line(&m.message.body, 60));
        let state = m
            .delivery_state
            .map_or_else(|| m.message.intent.clone(), |k| k.to_string());
        let spent: Vec<String> = m.spent.iter().map(|(u, n)| format!("{u} {n}")).collect();
        let spent = if spent.is_empty() {
            String::new()
        } else {
            format!("  (spent {})", spent.join(", "))
        };
        format!(
            "\n{}{} {} → {} [{state}] {what}{spent}",
            "  ".repeat(depth),
            short(&m.message.id),
            m.message.sender,
            m.message.recipient,
        )
    }
    fn below(view: &crate::service::ChainView, parent: &str, depth: usize, out: &mut String) {
        for m in view
            .messages
            .iter()
            .filter(|m| m.message.parent_id.as_deref() == Some(parent))
        {
            out.push_str(&line(m, depth));
            below(view, &m.message.id, depth + 1, out);
        }
    }
    let c = &view.chain;
    let mut out = format!(
        "chain {}  {}  {}/{} hops, depth limit {},{} from {}",
        c.id,
        c.state,
        c.hops,
        c.hop_budget,
        c.depth_limit,
        units_text(&c.units),
        c.origin
    );
    if let Some(r) = &c.stopped_reason {
        out.push_str(&format!("\nstopped: {r}"));
    }
    // The first message has no parent in the chain (an older one may name one outside it).
    let ids: std::collections::HashSet<&str> = view
        .messages
        .iter()
        .map(|m| m.message.id.as_str())
        .collect();
    for m in view.messages.iter().filter(|m| {
        m.message
            .parent_id
            .as_deref()
            .is_none_or(|p| !ids.contains(p))
    }) {
        out.push_str(&line(m, 0));
        below(view, &m.message.id, 1, &mut out);
    }
    out
}

fn accept_cmd(cli: &Cli, id: &str, actor: &str) -> Result<(), Failure> {
    let mut s = open(cli)?;
    let w = s.accept(id, actor)?;
    emit(cli, &w, || format!("{} accepted", short(&w.id)));
    Ok(())
}

/// The one wait (SPEC §8.2): mail, the cancel or stop of the chain of the agent's turn, or
/// the timeout, whichever comes first.
fn wait_cmd(cli: &Cli, agent: &str, secs: u64, since: i64) -> Result<(), Failure> {
    if !(1..=3_600).contains(&secs) {
        return Err(usage("--timeout-seconds must be 1 to 3600"));
    }
    let db = db_path(cli);
    let mut s = open(cli)?;
    if !s.agents()?.iter().any(|a| a.id == agent) {
        return Err(ServiceError::NotFound(format!(
            "unknown agent {agent:?}: no agent of that id is registered"
        ))
        .into());
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure {
            code: 1,
            message: format!("cannot start the wait: {e}"),
        })?;
    let changes = crate::service::Changes::watch(&db);
    // Inside a turn (a command's program, with the turn's request id), the turn's message is
    // known from its run even before the engine has seen the turn start.
    let turn = std::env::var("HANDOFFS_REQUEST_ID")
        .ok()
        .filter(|r| !r.is_empty())
        .and_then(|r| s.message_of_turn(agent, &r).ok().flatten());
    // One process, one wait: a chain stopped or cancelled since `since` (any time, by
    // default) is news.
    let woken = rt.block_on(crate::service::changes::wait_until(
        || s.wake_look(agent, turn.as_deref(), since),
        changes.as_ref().map(crate::service::Changes::subscribe),
        tokio::time::Instant::now() + std::time::Duration::from_secs(secs),
        std::future::pending(),
    ))?;
    let value = match &woken {
        None => json!({"woke": "timeout", "messages": []}),
        Some(w) => serde_json::to_value(w).unwrap_or_default(),
    };
    emit(cli, &value, || match &woken {
        None => "woke: timeout".to_owned(),
        Some(w) => {
            let mut t = format!("woke: {} ({} unread)", w.woke, w.messages.len());
            if let Some(c) = &w.chain {
                t.push_str(&format!(
                    "\nchain {} {}: {}",
                    c.id,
                    c.state,
                    c.stopped_reason.as_deref().unwrap_or("")
                ));
            }
            t
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
                approvals: a.codex_approvals.as_deref().map(|a| a == "accept"),
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
