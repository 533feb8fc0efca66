//! The command line as clap reads it: every command, argument and option, each with its help line.

use super::{Args, Outcome, Parser, PathBuf, Subcommand, Value};

/// Exactly-once delivery of handoffs between AI coding agents.
#[derive(Debug, Parser)]
#[command(name = "handoffs", version, about, max_term_width = 100)]
pub struct Cli {
    /// The database: a SQLite file's path, or a postgres:// URL for PostgreSQL [env:
    /// HANDOFFS_DB] [default: ./.handoffs/handoffs.sqlite3]
    #[arg(long, global = true, value_name = "PATH|URL")]
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
    /// Show or set configuration: enabled, enabledAfter, connections, outageGuard,
    /// chainHopBudget, chainDepthLimit, summaryCap, topicSubscribersMax.
    Config {
        /// enabled, enabledAfter, connections, outageGuard, chainHopBudget,
        /// chainDepthLimit, summaryCap or topicSubscribersMax; none: show them all.
        key: Option<String>,
        /// The new value: true/false; a time or `now`; open/explicit; null,
        /// {"preset": NAME} (openai, openai-codex, codex, anthropic, anthropic-claude-code,
        /// claude-code, github) or {"url": …, "components": […]}; a new chain's hop budget
        /// (0 to 100000, default 16) or depth limit (0 to 1000, default 8); how many bytes of a
        /// summary a card carries (256 to 65536, default 2048); how many subscribers a topic
        /// may have (1 to 10000, default 1000). None: show the key.
        value: Option<String>,
    },
    /// Send a handoff (with --title: work) from one agent to another.
    Send(SendArgs),
    /// Wait until the agent has an unread message, or the chain of the turn it is working on
    /// is cancelled or stopped by its budget, or the timeout; says which.
    Wait {
        #[command(flatten)]
        actor: Actor,
        /// At most this many seconds (1 to 3600).
        #[arg(long, default_value_t = 30)]
        timeout_seconds: u64,
        /// Wake on a stop or cancel of the turn's chain only if it happened at or after this
        /// moment (ms since the epoch): pass the `updated_at` of the chain a wait reported,
        /// plus one, so a loop of waits is not woken by the same stop again.
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i64).range(0..))]
        since: i64,
    },
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
    Serve(ServeArgs),
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
    /// Chains of handoffs (who sent what to whom, from which turn), their budgets and stops.
    #[command(subcommand)]
    Chain(ChainCmd),
    /// Dead letters: what could not be delivered, and why; replay one as a new message, or
    /// drop it.
    #[command(subcommand)]
    Dead(DeadCmd),
    /// Broadcast topics: a publish reaches each subscriber's inbox once, as a notification;
    /// each subscriber reads on from its own cursor, or replays from a retained position.
    #[command(subcommand)]
    Topic(TopicCmd),
    /// The shared corpus of a context library: keyed entries, each merged by its rule
    /// (lww, set, max, log), so writers at once never lose an update.
    #[command(subcommand)]
    Context(ContextCmd),
    /// Artifacts: the whole text of a summary its card carries only in part.
    #[command(subcommand)]
    Artifact(ArtifactCmd),
    /// Fan-outs: one piece of work split to several agents (`send --to A,B,…`).
    #[command(subcommand)]
    Fanout(FanoutCmd),
    /// The global trace: every send, state change, write, return, close, publish and spend,
    /// in one order.
    Trace {
        /// Only this chain (its id, or the id or a unique prefix of any of its messages).
        #[arg(long, value_name = "ID")]
        chain: Option<String>,
        /// Only events at or after this time (RFC 3339, or milliseconds since the epoch).
        #[arg(long, value_name = "TIME")]
        since: Option<String>,
        /// jsonl: one JSON object per event; otel: OTLP/JSON spans, one trace per chain;
        /// mermaid: a sequence diagram.
        #[arg(long, value_enum, default_value_t = TraceFormat::Jsonl)]
        format: TraceFormat,
        /// At most this many events (1 to 100000).
        #[arg(long, default_value_t = 10_000)]
        limit: i64,
    },
    /// Four simulated agents handing work around on a live page; temporary data, deleted on
    /// Ctrl+C (on a PostgreSQL --db, played and kept there).
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
        /// An IP address whose connections the page and its API answer as this machine's
        /// (the gateway a container's published port forwards from); repeat it for several.
        #[arg(long, value_name = "IP", conflicts_with = "public_demo")]
        allow_peer: Vec<std::net::IpAddr>,
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
        /// Engines sharing the database: 1, or 2 under recipient leases, each stalling now
        /// and then right before a write (fencing, issue 17).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=2))]
        engines: u8,
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
    /// Issue (or rotate) the agent's bearer token for remote MCP (`serve`'s /mcp); it is shown
    /// once and stored only hashed. The token fixes the identity as `mcp --agent` does.
    Token {
        /// The agent's id.
        id: String,
        /// How long the token lasts, in minutes [default: 43200, thirty days].
        #[arg(long, conflicts_with_all = ["never_expires", "revoke"])]
        expires_minutes: Option<f64>,
        /// The token never expires (rotate or revoke it by hand).
        #[arg(long, conflicts_with = "revoke")]
        never_expires: bool,
        /// Revoke the agent's token instead: remote sessions that present it are refused.
        #[arg(long)]
        revoke: bool,
        /// Say whether the agent has a token and until when it holds (never the token).
        #[arg(long, conflicts_with_all = ["expires_minutes", "never_expires", "revoke"])]
        show: bool,
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

/// `serve`'s options.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The address to listen on; anything but loopback makes the page reachable from the
    /// network.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// The port [default: 8765, or a free one when that is taken]; 0: any free one.
    #[arg(long)]
    pub port: Option<u16>,
    /// Answer any Host, refuse sends, and show plain state sentences.
    #[arg(long, conflicts_with_all = ["allow_host", "context_library"])]
    pub public_demo: bool,
    /// A host name (or name:port) remote agents reach /mcp under (the page stays on
    /// localhost); repeat it for several.
    #[arg(long, value_name = "NAME")]
    pub allow_host: Vec<String>,
    /// An IP address whose connections the page and its API answer as this machine's (the
    /// gateway a container's published port forwards from); repeat it for several.
    #[arg(long, value_name = "IP", conflicts_with = "public_demo")]
    pub allow_peer: Vec<std::net::IpAddr>,
    /// A folder of Markdown files served as project memory to remote MCP sessions.
    #[arg(long, value_name = "DIR")]
    pub context_library: Option<PathBuf>,
    /// Serve HTTPS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct SendArgs {
    /// The sending agent.
    pub from: String,
    /// The receiving agent (with --to, the message).
    pub to: String,
    /// The message, or - to read it from stdin (with --to, left out).
    pub message: Option<String>,
    /// Fan the work out to these agents (comma-separated): one child each, joined into ONE
    /// combined return (needs --title).
    #[arg(long = "to", value_name = "A,B,…")]
    pub fan_to: Option<String>,
    /// Fan-out: joined when `all` children have returned (the default) or the first K
    /// (`quorum:K`).
    #[arg(long, value_name = "all|quorum:K")]
    pub join: Option<String>,
    /// Fan-out: joined at the latest this many minutes after the send (fractions allowed,
    /// at least 0.1), flagged partial when returns are missing.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub deadline_minutes: Option<f64>,
    /// Fan-out: cancel the children still unanswered when it is joined.
    #[arg(long)]
    pub cancel_rest: bool,
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
    /// Continue the chain of this message (id or unique prefix), which the sender sent or
    /// received. Without it, a send from a turn handoffs started continues that turn's chain
    /// (the `HANDOFFS_REQUEST_ID` every command, Claude Code and Codex turn is given, or the
    /// request id an HTTP recipient's write carried); any other send, or one with `--budget`,
    /// starts one.
    #[arg(long, value_name = "ID")]
    pub parent: Option<String>,
    /// A new chain's budget: its hops and any units of your own, e.g.
    /// `hops=20,tokens=200000,usd=5` (spent from inside its turns with `chain spend`).
    /// Only for a send that starts a chain.
    #[arg(long, value_name = "hops=N,UNIT=N")]
    pub budget: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum DeadCmd {
    /// The newest dead letters (open ones unless --all).
    List {
        /// Replayed and dropped ones too.
        #[arg(long)]
        all: bool,
        /// How many at most (1 to 10000).
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// One dead letter in full.
    Show {
        /// Its id, or a unique prefix of at least 6 characters.
        id: String,
    },
    /// Send it again as a new message (new id, same chain, linked to the dead one), once.
    Replay {
        /// Its id, or a unique prefix of at least 6 characters.
        id: String,
        /// To this agent instead of its recipient.
        #[arg(long, value_name = "AGENT")]
        to: Option<String>,
    },
    /// Drop it: nobody will send it.
    Drop {
        /// Its id, or a unique prefix of at least 6 characters.
        id: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TraceFormat {
    Jsonl,
    Otel,
    Mermaid,
}

#[derive(Debug, Subcommand)]
pub enum ContextCmd {
    /// A copy of an entry, with its version, rule and last writer.
    Get {
        /// The entry's key.
        key: String,
        /// The context library's folder (as `mcp --context-library`).
        #[arg(long, value_name = "DIR")]
        library: PathBuf,
    },
    /// Write an entry, merged by its rule: lww (the text; with --version, the version read),
    /// set (each VALUE a member), max (a number), log (an entry appended).
    Put {
        /// The entry's key.
        key: String,
        /// The value: one text (lww, log), one number (max), or members (set).
        #[arg(required = true)]
        values: Vec<String>,
        #[command(flatten)]
        actor: Actor,
        /// A new entry's rule: lww (default), set, max or log.
        #[arg(long)]
        rule: Option<String>,
        /// lww only: the version read; a stale one is refused as a conflict.
        #[arg(long)]
        version: Option<u64>,
        /// The context library's folder (as `mcp --context-library`).
        #[arg(long, value_name = "DIR")]
        library: PathBuf,
    },
    /// Every entry: key, rule, version, last writer.
    Keys {
        /// The context library's folder (as `mcp --context-library`).
        #[arg(long, value_name = "DIR")]
        library: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
pub enum FanoutCmd {
    /// A fan-out, its join rule and state, and each child's work and answer.
    Show {
        /// The fan-out's id, or the id (or a unique prefix) of any of its children.
        id: String,
    },
    /// The fan-outs still waiting for their join.
    List {
        /// How many at most (1 to 10000).
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
}

#[derive(Debug, Subcommand)]
pub enum ArtifactCmd {
    /// Print an artifact's whole text.
    Get {
        /// Its id, as the card's marker names it.
        id: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum TopicCmd {
    /// Create a topic (or set the retention of one that exists).
    Create {
        /// Its name (letters, digits, `.`, `_`, `-`).
        name: String,
        /// Keep at most this many posts readable (1 to 100000) [default: 1000].
        #[arg(long)]
        keep: Option<i64>,
        /// Keep a post readable this many minutes (1 to 525600) [default: 10080, a week].
        #[arg(long)]
        keep_minutes: Option<i64>,
    },
    /// The topics, with their subscribers and what they keep.
    List,
    /// Subscribe an agent: it is told of every later post, and reads on from here.
    Subscribe {
        /// The topic.
        name: String,
        /// The subscribing agent.
        agent: String,
        /// Start at the oldest retained post instead of the newest.
        #[arg(long)]
        history: bool,
    },
    /// Unsubscribe an agent.
    Unsubscribe {
        /// The topic.
        name: String,
        /// The agent that leaves it.
        agent: String,
    },
    /// Publish a post: each current subscriber gets one inbox notification (never a turn).
    Publish {
        /// The topic.
        name: String,
        /// The publishing agent.
        from: String,
        /// The post, or - to read it from stdin.
        message: String,
        /// Idempotency key: publishing again with the same key returns the first post.
        #[arg(long)]
        key: Option<String>,
    },
    /// Read the posts after an agent's cursor (moving it on), or replay from a position.
    Read {
        /// The topic.
        name: String,
        /// The reading agent (its cursor).
        agent: String,
        /// Replay from this position (the cursor only ever moves on).
        #[arg(long, value_name = "POSITION")]
        from: Option<i64>,
        /// At most this many posts (1 to 1000).
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
}

#[derive(Debug, Subcommand)]
pub enum ChainCmd {
    /// A chain as a tree: who sent what to whom, each delivery's state, its budget.
    Show {
        /// The chain's id, or the id (or a unique prefix) of any of its messages.
        id: String,
    },
    /// The newest chains, stopped ones first.
    List {
        /// How many at most (1 to 10000).
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// Cancel a chain and everything pending in it: nothing more of it is written, its open
    /// work is closed as cancelled, turns under way run on (their returns recorded as late),
    /// and each affected agent is told once.
    Cancel {
        /// The chain's id, or the id (or a unique prefix) of any of its messages.
        id: String,
        /// Why, for the agents told.
        #[arg(long)]
        note: Option<String>,
    },
    /// Lift a stopped chain: add to its hop budget, a unit of its budget or its depth limit.
    Resume {
        /// The chain's id, or the id (or a unique prefix) of any of its messages.
        id: String,
        /// What to add, e.g. `hops=8`, `tokens=50000` or `hops=8,depth=2`.
        #[arg(long, value_name = "UNIT=N")]
        add: String,
    },
    /// Spend from the budget of the chain a turn works in, all or nothing: a spend past a
    /// limit is refused and stops the chain until a person resumes it.
    Spend {
        /// What was spent, e.g. `tokens=1200,usd=0.04`.
        units: String,
        /// The agent spending; inside its turn, the run's `HANDOFFS_REQUEST_ID` names the
        /// chain.
        #[arg(long = "as", value_name = "AGENT")]
        agent: String,
        /// The chain of this message (id or unique prefix), which the agent sent or received,
        /// instead of its turn's.
        #[arg(long, value_name = "ID")]
        parent: Option<String>,
    },
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
    /// How to answer the Codex turn's approval requests; unset, our own app-server declines
    /// them and the daemon leaves them to the person's open session.
    #[arg(long, requires = "codex_thread", value_parser = ["accept", "decline"])]
    pub codex_approvals: Option<String>,
    #[arg(last = true, required = true)]
    pub argv: Vec<String>,
}

pub(super) fn parse_setting(s: &str) -> Result<(String, Value), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("expected KEY=VALUE, got {s:?}"))?;
    if k.is_empty() {
        return Err("the setting's key is empty".to_owned());
    }
    let value = serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.to_owned()));
    Ok((k.to_owned(), value))
}

pub(super) fn parse_outcome(s: &str) -> Result<Outcome, String> {
    s.parse()
}
