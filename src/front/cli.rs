//! The command line (SPEC §5): clap definitions, one service call per command, text or JSON
//! output, and `exit_code_of`, the one place errors become exit codes.

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

/// Exactly-once delivery of handoffs between AI coding agents.
#[derive(Debug, Parser)]
#[command(name = "handoffs", version, about, max_term_width = 100)]
pub struct Cli {
    /// The database [env: HANDOFFS_DB] [default: ./.handoffs/handoffs.sqlite3]
    #[arg(long, global = true, value_name = "PATH")]
    pub db: Option<PathBuf>,
    /// Print one JSON document instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// How log lines on stderr look: text for people, json (one object per line) for a log
    /// collector; which ones appear is set by RUST_LOG (or HANDOFFS_LOG), warn by default.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

/// How log lines look (`--log-format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create the database (idempotent) and its token file.
    Init,
    /// Register, list or remove agents.
    #[command(subcommand)]
    Agent(AgentCmd),
    /// Allow the directed connection FROM → TO.
    Allow {
        /// The sending agent.
        from: String,
        /// The receiving agent.
        to: String,
    },
    /// Block the directed connection FROM → TO.
    Block {
        /// The sending agent.
        from: String,
        /// The receiving agent.
        to: String,
    },
    /// Show or set configuration: enabled, enabledAfter, connections, outageGuard.
    Config {
        /// enabled, enabledAfter, connections or outageGuard; none: show them all.
        key: Option<String>,
        /// The new value: true/false; a time or `now`; open/explicit; null,
        /// {"preset": NAME} (openai, openai-codex, codex, anthropic, anthropic-claude-code,
        /// claude-code, github) or {"url": …, "components": […]}. None: show the key.
        value: Option<String>,
    },
    /// Send a handoff (with --title: work) from one agent to another.
    Send(SendArgs),
    /// List an agent's messages (unread unless --all).
    Inbox {
        /// Whose inbox.
        agent: String,
        /// Read messages too.
        #[arg(long)]
        all: bool,
        /// At most this many, newest first (1 to 10000).
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// Show a message in full; marks it read when you are its recipient.
    Read {
        /// The message (a unique prefix of 6 or more characters will do).
        id: String,
        #[command(flatten)]
        actor: Actor,
    },
    /// Accept work given to you.
    Accept {
        /// The work message (a unique prefix will do).
        id: String,
        #[command(flatten)]
        actor: Actor,
    },
    /// Return work to its sender with a summary (or --blocked).
    Return {
        /// The work message (a unique prefix will do).
        id: String,
        #[command(flatten)]
        actor: Actor,
        /// What was done (or, with --blocked, what stands in the way).
        #[arg(long)]
        summary: String,
        /// Where to see it: a path, a commit, a link.
        #[arg(long)]
        evidence: Option<String>,
        /// Return it as blocked rather than done.
        #[arg(long)]
        blocked: bool,
    },
    /// Close work you gave: accepted, revision or blocked.
    Close {
        /// The work message (a unique prefix will do).
        id: String,
        #[command(flatten)]
        actor: Actor,
        /// accepted, revision or blocked.
        #[arg(value_parser = parse_outcome)]
        outcome: Outcome,
        /// A word for the one who did the work.
        #[arg(long)]
        note: Option<String>,
    },
    /// Overview (in flight, needs attention, recent), or one delivery with its history.
    Status {
        /// One delivery or message (a unique prefix will do); none: the overview.
        id: Option<String>,
    },
    /// Run one engine pass and print its report.
    Tick,
    /// Run the engine until Ctrl+C.
    Run {
        /// Longest sleep between passes, in seconds (new work wakes it at once).
        #[arg(long, default_value_t = 5.0)]
        interval: f64,
    },
    /// The engine and the live page (http://127.0.0.1:8765/ by default) until Ctrl+C.
    Serve {
        /// The address to listen on; anything but loopback makes the page reachable from the
        /// network.
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// The port [default: 8765, or a free one when that is taken]; 0: any free one.
        #[arg(long)]
        port: Option<u16>,
        /// Answer any Host, refuse sends, and show plain state sentences.
        #[arg(long)]
        public_demo: bool,
    },
    /// Cancel one stuck delivery; never resends.
    Release {
        /// The delivery or its message (a unique prefix will do).
        id: String,
        /// Why, for the history (e.g. "I saw the turn run").
        #[arg(long)]
        note: Option<String>,
    },
    /// Stdio MCP server acting as one agent (its identity is fixed for the whole session).
    Mcp {
        /// The agent this server acts as, for its whole session.
        #[arg(long)]
        agent: String,
        /// A folder of Markdown files served as project memory (context_* tools).
        #[arg(long, value_name = "DIR")]
        context_library: Option<PathBuf>,
        /// Be a Claude Code channel (research preview): push each handoff for this agent into
        /// the interactive Claude session that started this server, as a new prompt.
        #[arg(long)]
        channels: bool,
    },
    /// The workspace's task ledger: briefs, the one writer lease, the handoff budget.
    #[command(subcommand)]
    Task(TaskCmd),
    /// Four simulated agents handing work around on a live page; temporary data, deleted on
    /// Ctrl+C.
    Demo {
        /// The port [default: 8765, or a free one when that is taken]; 0: any free one.
        #[arg(long)]
        port: Option<u16>,
        /// The address to listen on.
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// How fast the demo agents work (1 = turns of 4 to 7 seconds).
        #[arg(long, default_value_t = 1.0)]
        speed: f64,
        /// Answer any Host, refuse sends, and show plain state sentences.
        #[arg(long)]
        public_demo: bool,
    },
    /// Runs the real engine against simulated agents with the faults one seed draws, and
    /// judges every guarantee (same seed, same bytes).
    Sim {
        /// The seed to run (default 1).
        #[arg(long, conflicts_with = "seeds")]
        seed: Option<u64>,
        /// A sweep, like 1..200 (both ends included): one line per failure and a summary.
        #[arg(long)]
        seeds: Option<String>,
        /// Print the run's trace: virtual time, host, event.
        #[arg(long, conflicts_with = "seeds")]
        trace: bool,
    },
    /// Checks every agent's destination (binary and version, session or thread, folder, URL)
    /// and the database: one line per finding; exit 1 when something is wrong.
    Doctor,
    /// Prints the shell completion script for SHELL (e.g. `handoffs completions bash >
    /// ~/.local/share/bash-completion/completions/handoffs`).
    Completions {
        /// bash, elvish, fish, powershell or zsh.
        shell: clap_complete::Shell,
    },
    /// Runs one command turn for the engine (internal).
    #[command(hide = true)]
    Supervise(SuperviseArgs),
}

#[derive(Debug, Args)]
pub struct Actor {
    /// The acting agent [env: HANDOFFS_AGENT]
    #[arg(
        long = "as",
        value_name = "AGENT",
        env = "HANDOFFS_AGENT",
        hide_env = true
    )]
    pub as_agent: String,
}

#[derive(Debug, Subcommand)]
pub enum AgentCmd {
    /// Register or update an agent.
    Add {
        /// The agent's id (letters, digits, `.`, `_`, `-`).
        id: String,
        /// demo, command, codex or claude-code; needed for a new agent only.
        #[arg(long)]
        provider: Option<String>,
        /// A display name.
        #[arg(long)]
        name: Option<String>,
        /// Where its turns go: the Codex thread id, the Claude session id; for a command
        /// agent, what `{endpoint}` in its command stands for.
        #[arg(long)]
        endpoint: Option<String>,
        /// The folder its turns run in.
        #[arg(long)]
        cwd: Option<String>,
        /// Adapter setting; VALUE is JSON when it parses, text otherwise.
        #[arg(long = "set", value_name = "KEY=VALUE", value_parser = parse_setting)]
        settings: Vec<(String, Value)>,
    },
    /// List agents.
    List,
    /// Remove an agent.
    Remove {
        /// The agent's id.
        id: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum TaskCmd {
    /// Create a task brief (queued).
    Create {
        #[command(flatten)]
        actor: Actor,
        /// A short title.
        #[arg(long)]
        title: String,
        /// What done looks like.
        #[arg(long)]
        goal: String,
        /// What must not change, or must hold.
        #[arg(long)]
        constraints: Option<String>,
        /// Queue it for this agent only.
        #[arg(long = "for", value_name = "AGENT")]
        target: Option<String>,
        /// The handoff budget, 0–16.
        #[arg(long, default_value_t = crate::service::ledger::HANDOFF_CAP_DEFAULT)]
        cap: i64,
    },
    /// Take the workspace's writer lease for a task; prints the lease token.
    Claim {
        /// The task (a unique prefix will do).
        id: String,
        #[command(flatten)]
        actor: Actor,
        /// How long the lease lasts, in minutes.
        #[arg(long)]
        minutes: Option<i64>,
    },
    /// Extend your lease.
    Renew {
        /// The task (a unique prefix will do).
        id: String,
        #[command(flatten)]
        actor: Actor,
        /// The lease token `task claim` printed.
        #[arg(long)]
        token: String,
        /// The lease's new length from now, in minutes.
        #[arg(long)]
        minutes: Option<i64>,
    },
    /// Record your progress, release the lease and queue the task for another agent.
    Pass {
        /// The task (a unique prefix will do).
        id: String,
        #[command(flatten)]
        actor: Actor,
        /// The lease token `task claim` printed.
        #[arg(long)]
        token: String,
        /// What you did.
        #[arg(long)]
        summary: String,
        /// What the next agent should do first.
        #[arg(long = "next")]
        next_action: String,
        /// A changed file (repeatable; merged into the task's set).
        #[arg(long = "file")]
        files: Vec<String>,
        /// The agent that takes it over (it is told with a handoff).
        #[arg(long = "to", value_name = "AGENT")]
        target: String,
    },
    /// Mark your task done and release the lease.
    Complete {
        /// The task (a unique prefix will do).
        id: String,
        #[command(flatten)]
        actor: Actor,
        /// The lease token `task claim` printed.
        #[arg(long)]
        token: String,
        /// What was done.
        #[arg(long)]
        summary: Option<String>,
        /// A changed file (repeatable; merged into the task's set).
        #[arg(long = "file")]
        files: Vec<String>,
    },
    /// A task with its history.
    Show {
        /// The task (a unique prefix will do).
        id: String,
    },
    /// Tasks, newest first.
    List {
        /// Only tasks in this state: queued, claimed, needs_human or done.
        #[arg(long)]
        state: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// A person adds handoffs to a task's budget (and releases it from needs_human).
    Resume {
        /// The task (a unique prefix will do).
        id: String,
        /// Handoffs to add to its budget.
        #[arg(long, default_value_t = 1)]
        add: i64,
        /// Queue it for this agent from now on.
        #[arg(long = "for", value_name = "AGENT", conflicts_with = "anyone")]
        target: Option<String>,
        /// Queue it for any agent from now on.
        #[arg(long)]
        anyone: bool,
        /// Who is resuming it, for the history.
        #[arg(long, default_value = "person")]
        by: String,
    },
}

#[derive(Debug, Args)]
pub struct SendArgs {
    /// The sending agent.
    pub from: String,
    /// The receiving agent.
    pub to: String,
    /// The message, or - to read it from stdin.
    pub message: String,
    /// Make it work with this title: the recipient accepts and returns it.
    #[arg(long)]
    pub title: Option<String>,
    /// Work only: remind the sender if it is not returned within this many minutes (1 to
    /// 43200).
    #[arg(long)]
    pub due_minutes: Option<i64>,
    /// Idempotency key: a repeated send with the same key returns the first message.
    #[arg(long)]
    pub key: Option<String>,
}

#[derive(Debug, Args)]
pub struct SuperviseArgs {
    #[arg(long)]
    pub request_id: String,
    #[arg(long)]
    pub message: String,
    #[arg(long)]
    pub agent: String,
    #[arg(long)]
    pub timeout: u64,
    #[arg(long)]
    pub text_file: PathBuf,
    #[arg(long, default_value = "")]
    pub endpoint: String,
    #[arg(long, default_value = "")]
    pub cwd: String,
    /// A Claude Code turn: the session `argv` resumes (spoken to in stream-json).
    #[arg(long)]
    pub claude_session: Option<String>,
    #[arg(long, requires = "claude_session")]
    pub claude_config_dir: Option<PathBuf>,
    /// A Codex turn: the thread `argv` (`codex app-server`) writes to.
    #[arg(long, conflicts_with = "claude_session")]
    pub codex_thread: Option<String>,
    #[arg(long, requires = "codex_thread")]
    pub codex_home: Option<PathBuf>,
    /// Accept the approval requests of the Codex turn (else they are declined).
    #[arg(long, requires = "codex_thread")]
    pub codex_accept_approvals: bool,
    #[arg(last = true, required = true)]
    pub argv: Vec<String>,
}

fn parse_setting(s: &str) -> Result<(String, Value), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("expected KEY=VALUE, got {s:?}"))?;
    if k.is_empty() {
        return Err("the setting's key is empty".to_owned());
    }
    let value = serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.to_owned()));
    Ok((k.to_owned(), value))
}

fn parse_outcome(s: &str) -> Result<Outcome, String> {
    s.parse()
}

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

/// The engine's policy: the default, or `HANDOFFS_POLICY` (JSON, any subset of the bounds),
/// which may shorten SPEC §2's timings but never raise its limits (`check_against_spec`).
fn policy_from_env() -> Result<model::Policy, Failure> {
    match std::env::var_os("HANDOFFS_POLICY") {
        None => Ok(model::Policy::default()),
        Some(raw) => {
            let policy: model::Policy = serde_json::from_str(&raw.to_string_lossy())
                .map_err(|e| usage(format!("HANDOFFS_POLICY is not a valid policy: {e}")))?;
            policy
                .check_against_spec()
                .map_err(|e| usage(format!("HANDOFFS_POLICY: {e}")))?;
            Ok(policy)
        }
    }
}

/// `handoffs sim`: runs before any runtime exists (a turmoil simulation builds its own).
fn sim_cmd(cli: &Cli, seed: Option<u64>, seeds: Option<&str>, trace: bool) -> Result<(), Failure> {
    let policy = policy_from_env()?;
    // A planted bug replays only in a build that has it.
    let replay_env = std::env::var("HANDOFFS_POLICY")
        .map(|p| {
            let build = if p.contains("planted_bug") {
                "(a build with --features planted-bugs) "
            } else {
                ""
            };
            format!("{build}HANDOFFS_POLICY='{p}' ")
        })
        .unwrap_or_default();
    let failed = |seeds: &[u64]| Failure {
        code: 1,
        message: format!(
            "guarantees failed for seed{} {}",
            if seeds.len() == 1 { "" } else { "s" },
            seeds
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    if let Some(range) = seeds {
        let (a, b) = range
            .split_once("..")
            .and_then(|(a, b)| Some((a.trim().parse::<u64>().ok()?, b.trim().parse::<u64>().ok()?)))
            .filter(|(a, b)| a <= b)
            .ok_or_else(|| {
                usage(format!(
                    "--seeds takes FROM..TO, like 1..200 (got {range:?})"
                ))
            })?;
        let started = std::time::Instant::now();
        let sweep = crate::simulate::sweep(a, b, &policy, |o| {
            if !o.ok {
                if cli.json {
                    out(&json!({"seed": o.seed, "ok": false, "report": o.text}).to_string());
                } else {
                    eprintln!(
                        "seed {} FAILED; replay: {replay_env}handoffs sim --seed {} --trace",
                        o.seed, o.seed
                    );
                }
            }
        })
        .map_err(|message| Failure { code: 1, message })?;
        let wall = started.elapsed();
        let hours = sweep.virtual_time.as_secs_f64() / 3_600.0;
        emit(
            cli,
            &json!({
                "runs": sweep.runs,
                "virtual_hours": hours,
                "wall_seconds": wall.as_secs_f64(),
                "failures": sweep.failures,
                "exercised": sweep.exercised.iter().map(|(k, runs, total)| {
                    json!({"check": k, "runs": runs, "checks": total})
                }).collect::<Vec<_>>(),
            }),
            || {
                format!(
                    "{}{} runs, {hours:.1} virtual hours in {:.1} s of wall time ({:.0}× faster, {:.2} s a run), {} failed",
                    sweep.exercised_lines(),
                    sweep.runs,
                    wall.as_secs_f64(),
                    sweep.virtual_time.as_secs_f64() / wall.as_secs_f64().max(1e-9),
                    wall.as_secs_f64()
                        / f64::from(u32::try_from(sweep.runs.max(1)).unwrap_or(u32::MAX)),
                    sweep.failures.len()
                )
            },
        );
        return if sweep.failures.is_empty() {
            Ok(())
        } else {
            Err(failed(&sweep.failures))
        };
    }
    let seed = seed.unwrap_or(1);
    let outcome = crate::simulate::run(seed, trace, &policy)
        .map_err(|message| Failure { code: 1, message })?;
    let mut text = outcome.text.clone();
    if !outcome.ok && !replay_env.is_empty() {
        text.push_str(&format!(
            "replay this policy with: {replay_env}handoffs sim --seed {seed} --trace\n"
        ));
    }
    emit(
        cli,
        &json!({"seed": seed, "ok": outcome.ok, "virtual_ms": outcome.virtual_time.as_millis(), "report": text}),
        || text.clone(),
    );
    if outcome.ok {
        Ok(())
    } else {
        Err(failed(&[seed]))
    }
}

fn task(cli: &Cli, cmd: &TaskCmd) -> Result<(), Failure> {
    use crate::service::ledger::{Ledger, find_root};
    let cwd = std::env::current_dir().map_err(|e| usage(format!("no current folder: {e}")))?;
    let mut l = Ledger::open_root(&find_root(&cwd)?)?;
    // With a delivery database at hand, agents named here must be registered there.
    let mut svc = open(cli).ok();
    let mut known = |id: &str| -> Result<(), Failure> {
        match svc.as_mut() {
            Some(s) => Ok(s.check_registered(id)?),
            None => Ok(()),
        }
    };
    let line = task_line;
    match cmd {
        TaskCmd::Create {
            actor,
            title,
            goal,
            constraints,
            target,
            cap,
        } => {
            known(&actor.as_agent)?;
            if let Some(t) = target {
                known(t)?;
            }
            let t = l.create(
                &actor.as_agent,
                title,
                goal,
                constraints.as_deref(),
                target.as_deref(),
                Some(*cap),
            )?;
            emit(cli, &t, || format!("created {}", line(&t)));
        }
        TaskCmd::Claim { id, actor, minutes } => {
            known(&actor.as_agent)?;
            let c = l.claim(&actor.as_agent, id, *minutes)?;
            // The claim's own list holds the sweep's warning too.
            let _ = l.take_warnings();
            for w in &c.warnings {
                eprintln!("handoffs: warning: {w}");
            }
            emit(cli, &c, || {
                format!(
                    "claimed {}\nlease token: {}\nuntil {}",
                    line(&c.task),
                    c.lease.token,
                    when(c.lease.expires_at)
                )
            });
        }
        TaskCmd::Renew {
            id,
            actor,
            token,
            minutes,
        } => {
            let lease = l.renew(&actor.as_agent, id, token, *minutes)?;
            emit(cli, &lease, || {
                format!("lease until {}", when(lease.expires_at))
            });
        }
        TaskCmd::Pass {
            id,
            actor,
            token,
            summary,
            next_action,
            files,
            target,
        } => {
            let pass = crate::service::tasks::Pass {
                task_id: id,
                token,
                summary,
                next_action,
                changed_files: files,
                target,
            };
            let p = crate::service::tasks::pass_task(svc.as_mut(), &mut l, &actor.as_agent, &pass)?;
            emit(cli, &p, || {
                let told = p
                    .notice
                    .get("message_id")
                    .and_then(Value::as_str)
                    .map_or_else(
                        || format!("; {}", p.notice.as_str().unwrap_or_default()),
                        |m| format!("; told with message {}", short(m)),
                    );
                format!(
                    "passed to {target}: {} ({} handoffs left){told}",
                    line(&p.passed.task),
                    p.passed.handoffs_left
                )
            });
        }
        TaskCmd::Complete {
            id,
            actor,
            token,
            summary,
            files,
        } => {
            let t = l.complete(&actor.as_agent, id, token, summary.as_deref(), files)?;
            emit(cli, &t, || format!("done {}", line(&t)));
        }
        TaskCmd::Show { id } => {
            let d = l.show(id)?;
            emit(cli, &d, || task_detail_text(&d));
        }
        TaskCmd::List { state, limit } => {
            let ts = l.list(state.as_deref(), *limit)?;
            emit(cli, &ts, || {
                if ts.is_empty() {
                    "no tasks".to_owned()
                } else {
                    ts.iter().map(|t| line(t) + "\n").collect()
                }
            });
        }
        TaskCmd::Resume {
            id,
            add,
            target,
            anyone,
            by,
        } => {
            if let Some(t) = target {
                known(t)?;
            }
            let target = if *anyone { Some("") } else { target.as_deref() };
            let t = l.resume(by, id, *add, target)?;
            emit(cli, &t, || format!("resumed {}", line(&t)));
        }
    }
    for w in l.take_warnings() {
        eprintln!("handoffs: warning: {w}");
    }
    Ok(())
}

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

/// `status` without an id: the overview and the handoffs no engine has taken up yet.
#[derive(Serialize)]
struct StatusOut<'a> {
    #[serde(flatten)]
    overview: &'a crate::service::Overview,
    waiting_for_engine: &'a [crate::service::Unenrolled],
}

fn status(cli: &Cli, id: Option<&str>) -> Result<(), Failure> {
    let mut s = open(cli)?;
    if let Some(id) = id {
        let d = s.delivery(id)?;
        emit(cli, &d, || {
            let v = &d.delivery;
            let mut out = format!(
                "{} {} → {}  {}\n{}\nattempts: {}  request: {}\n",
                v.id, v.from, v.to, v.state, v.detail, v.attempts, v.request_id
            );
            if !v.earlier_request_ids.is_empty() {
                out.push_str(&format!(
                    "earlier requests: {}\n",
                    v.earlier_request_ids.join(", ")
                ));
            }
            out.push_str("history:\n");
            for e in &d.events {
                out.push_str(&format!("  {}  {}  {}\n", when(e.at), e.kind, e.detail));
            }
            out
        });
        return Ok(());
    }
    let o = s.overview(20)?;
    let waiting = s.waiting_for_engine(20)?;
    let status = StatusOut {
        overview: &o,
        waiting_for_engine: &waiting,
    };
    emit(cli, &status, || {
        let mut out = String::new();
        let section = |out: &mut String, title: &str, items: &[crate::service::DeliveryView]| {
            out.push_str(&format!("{title} ({})\n", items.len()));
            for v in items {
                out.push_str(&format!(
                    "  {}  {} → {}  {}  {}\n",
                    short(&v.id),
                    v.from,
                    v.to,
                    v.state,
                    one_line(&v.detail, 90)
                ));
            }
        };
        if !waiting.is_empty() {
            out.push_str(&format!(
                "waiting for an engine ({}){}\n",
                waiting.len(),
                if o.engine_reported_at.is_none() {
                    ": start one with `handoffs run` or `handoffs tick`"
                } else {
                    ""
                }
            ));
            for m in &waiting {
                out.push_str(&format!(
                    "  {}  {} → {}  {}\n",
                    short(&m.id),
                    m.from,
                    m.to,
                    one_line(m.title.as_deref().unwrap_or(&m.preview), 90)
                ));
            }
        }
        section(&mut out, "queued", &o.queued);
        section(&mut out, "in flight", &o.in_flight);
        section(&mut out, "needs attention", &o.needs_attention);
        if !o.damaged.is_empty() {
            out.push_str(&format!(
                "damaged ({}): never acted on; repair or restore the database\n",
                o.damaged.len()
            ));
            for d in &o.damaged {
                out.push_str(&format!("  {d}\n"));
            }
        }
        if !o.overdue_work.is_empty() {
            out.push_str(&format!("overdue work ({})\n", o.overdue_work.len()));
            for w in &o.overdue_work {
                out.push_str(&format!(
                    "  {}  {} → {}  {}\n",
                    short(&w.id),
                    w.sender,
                    w.recipient,
                    w.title
                ));
            }
        }
        section(&mut out, "recent", &o.recent);
        match o.engine_health {
            crate::service::EngineHealth::Running { reported_at } => {
                out.push_str(&format!("engine: last pass {}\n", when(reported_at)));
            }
            crate::service::EngineHealth::OneShot { reported_at } => out.push_str(&format!(
                "engine: last pass {} was a one-shot `tick`; nothing is delivered until `handoffs run` or `serve` runs\n",
                when(reported_at)
            )),
            crate::service::EngineHealth::Quiet { reported_at } => out.push_str(&format!(
                "engine: not running (last pass {}); nothing is delivered until `handoffs run` or `serve` runs\n",
                when(reported_at)
            )),
            crate::service::EngineHealth::Never => out.push_str(
                "engine: no pass yet; start one with `handoffs run` or `handoffs tick`\n",
            ),
        }
        if !o.engine_policy_differs.is_empty() {
            out.push_str(&format!(
                "engine: timings differ from SPEC (HANDOFFS_POLICY): {}\n",
                o.engine_policy_differs.join(", ")
            ));
        }
        out
    });
    Ok(())
}

fn engine_cmd(cli: &Cli, interval: Option<Duration>) -> Result<(), Failure> {
    let service = open(cli)?;
    let mut engine = match Engine::new(service, interval.is_none()) {
        Ok(e) => e,
        Err(EngineError::Busy) => {
            let msg = "another engine is delivering for this database; this pass is skipped";
            if interval.is_some() {
                // A long-running engine that stays away says so where a log catches it.
                eprintln!("handoffs: {msg}");
            }
            emit(cli, &json!({"skipped": msg}), || msg.to_owned());
            return Ok(());
        }
        Err(e) => {
            return Err(Failure {
                code: 1,
                message: e.to_string(),
            });
        }
    };
    if std::env::var_os("HANDOFFS_POLICY").is_some() {
        // Shorter bounds for tests and drills, e.g. {"sending_timeout_ms": 1000}.
        engine = engine.with_policy(policy_from_env()?);
    }
    let rt = runtime()?;
    match interval {
        None => {
            let report = rt.block_on(engine.pass());
            emit(cli, &report, || {
                let mut out = format!(
                    "pass: looked at {}, moved {}, wrote {}, enrolled {}, reminders {}, {} ms",
                    report.looked_at,
                    report.moved,
                    report.writes,
                    report.enrolled,
                    report.reminders,
                    report.took_ms
                );
                for e in &report.errors {
                    out.push_str(&format!("\nerror: {e}"));
                }
                out
            });
            Ok(())
        }
        Some(interval) => {
            // Ctrl+C and SIGTERM (a service manager) stop it alike: no new job, running ones
            // get their grace; the exit code says which signal it was. SIGHUP does not: an
            // engine started with `nohup` outlives its terminal.
            let stopped_by = std::sync::Arc::new(std::sync::atomic::AtomicU8::new(0));
            let code = stopped_by.clone();
            tracing::info!(pid = std::process::id(), "engine started");
            rt.block_on(engine.run(interval, async move {
                let signal = crate::front::live::stop_signal(false).await;
                code.store(signal, std::sync::atomic::Ordering::SeqCst);
            }))
            .map_err(|message| Failure { code: 1, message })?;
            match stopped_by.load(std::sync::atomic::Ordering::SeqCst) {
                0 => Ok(()),
                code => Err(Failure {
                    code,
                    message: "stopped".to_owned(),
                }),
            }
        }
    }
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
    if !(1..=10_000).contains(&limit) {
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

/// One line per task: id, state, title, budget, owner, target.
fn task_line(t: &crate::service::ledger::Task) -> String {
    format!(
        "{}  {:<11} {}  (budget {}/{}{}{})",
        short(&t.id),
        t.state,
        one_line(&t.title, 60),
        t.handoffs_used,
        t.handoff_cap,
        t.owner
            .as_deref()
            .map(|o| format!(", owner {o}"))
            .unwrap_or_default(),
        t.target_agent
            .as_deref()
            .map(|o| format!(", for {o}"))
            .unwrap_or_default(),
    )
}

/// `task show`: the brief, its lease and its history.
fn task_detail_text(d: &crate::service::ledger::TaskDetail) -> String {
    let line = task_line;
    let t = &d.task;
    let mut out = format!("{}\ngoal: {}\n", line(t), t.goal);
    if let Some(c) = &t.constraints {
        out.push_str(&format!("constraints: {c}\n"));
    }
    if let Some(s) = &t.summary {
        out.push_str(&format!("summary: {s}\n"));
    }
    if let Some(n) = &t.next_action {
        out.push_str(&format!("next: {n}\n"));
    }
    if !t.changed_files.is_empty() {
        out.push_str(&format!("changed: {}\n", t.changed_files.join(", ")));
    }
    if let Some(lease) = &d.lease {
        out.push_str(&format!(
            "lease: {} until {}\n",
            lease.holder,
            when(lease.expires_at)
        ));
    }
    for e in &d.events {
        out.push_str(&format!(
            "{}  {:<13} {}  {}\n",
            when(e.at),
            e.kind,
            e.actor,
            e.detail
        ));
    }
    out
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
