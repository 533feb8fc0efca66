//! The codex adapter (SPEC §4), run under `handoffs supervise` like an argv command (so its
//! outcome is recorded durably and survives an engine restart). When the Codex daemon serves
//! the thread (the session a person has open, see [`daemon`]) the supervisor writes through
//! the daemon's socket; otherwise it runs one `codex app-server` of its own over stdio. Either
//! way it resumes the thread and writes through the thread's queue (`thread/queue/add`,
//! `clientUserMessageId` = the request id), which starts the message as a turn of its own
//! once any running turn ends; never `turn/start`, which Codex folds into a running turn. The
//! turn whose user message carries our id ends with `turn/completed` (`completed | failed |
//! interrupted`); a turn without progress past the agent's timeout is interrupted and counts
//! as errored.
//!
//! Activity: a thread nobody holds is idle (our app-server will hold it); one the daemon
//! serves is as its `Thread.status` says (`active`: busy); one held by any other process
//! (`codex --no-daemon`, an IDE: its writer lock `$CODEX_HOME/thread-writer-locks/<thread>.lock`
//! is taken) is busy with that reason, since `thread/resume` would answer "already has an
//! active writer".
//!
//! History: the rollout file `sessions/YYYY/MM/DD/rollout-…-<thread>.jsonl` records each user
//! message's `client_id` with its turn, and each turn's end (`task_complete`, `turn_aborted`).
//! In the daemon a turn (or a queued message) outlives the supervisor that wrote it: a run
//! whose supervisor is gone is over only when the rollout or the daemon says so.

pub mod daemon;

use super::Host;
use super::command;
use super::{Write, doctor};
use crate::store::{AgentRow, RunRow, millis};
use model::states::TurnFailure;
use model::{Activity, Observed, ScanResult, TurnId, WriteOutcome};
use serde_json::{Value, json};
use std::cell::RefCell;
use std::io::BufRead as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The thread a supervised Codex turn writes to.
#[derive(Debug, Clone)]
pub struct Thread {
    pub id: String,
    /// `home` as registered; otherwise `$CODEX_HOME`, else `~/.codex`.
    pub home: Option<PathBuf>,
    /// The `approvals` setting: `Some(true)` accept, `Some(false)` decline. Unset, our own
    /// app-server declines (nobody else is there to answer), and through the daemon the
    /// person's open session is left to answer (the run says it waits for them).
    pub approvals: Option<bool>,
}

/// What a supervised Codex write tells its run record as it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Said<'a> {
    /// Codex took the message (the receipt).
    Written,
    /// The turn waits for a person (an approval, an answer), or no longer does (`None`).
    Waiting(Option<&'a str>),
}

fn setting<'a>(agent: &'a AgentRow, key: &str) -> Option<&'a str> {
    agent.settings.get(key).and_then(Value::as_str)
}

/// The Codex home a thread lives in.
pub fn home(configured: Option<&Path>) -> Option<PathBuf> {
    configured
        .map(Path::to_owned)
        .or_else(|| std::env::var_os("CODEX_HOME").map(PathBuf::from))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".codex")))
}

fn thread_of(agent: &AgentRow) -> Thread {
    Thread {
        id: agent.endpoint.clone(),
        home: setting(agent, "home").map(PathBuf::from),
        approvals: match setting(agent, "approvals") {
            Some("accept") => Some(true),
            Some("decline") => Some(false),
            _ => None,
        },
    }
}

pub fn check_settings(settings: &Value) -> Result<(), String> {
    for key in ["binary", "home"] {
        if let Some(v) = settings.get(key)
            && v.as_str().is_none_or(str::is_empty)
        {
            return Err(format!("{key} must be a non-empty string"));
        }
    }
    if let Some(t) = settings.get("timeout") {
        match t.as_u64() {
            Some(s) if (1..=7 * 86_400).contains(&s) => {}
            _ => return Err("timeout must be whole seconds from 1 to 604800".to_owned()),
        }
    }
    if let Some(a) = settings.get("approvals")
        && !matches!(a.as_str(), Some("accept" | "decline"))
    {
        return Err("approvals must be accept or decline".to_owned());
    }
    Ok(())
}

// ----- who holds a thread ---------------------------------------------------------------------

/// The processes holding an OS lock on `path` (flock or POSIX), from `/proc/locks`; none
/// when the file does not exist. `Err` when nobody can tell (no `/proc/locks`).
pub fn lock_holders_checked(path: &Path) -> Result<Vec<i32>, String> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    // /proc/locks names a file "MAJOR:MINOR:INODE", the device numbers in hex.
    let dev = meta.dev();
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let id = format!("{major:02x}:{minor:02x}:{}", meta.ino());
    // The kernel writes /proc/locks a page per read, walking its lock list by position: a
    // lock taken or released elsewhere between two pages (SQLite does so all the time) can
    // shift the list and skip a line (or show one twice). A holder is never invented, only
    // missed, so a look that finds nobody is read again, up to 20 times in all (five missed
    // a held lock once in 500 looks under four threads' churn, in CI).
    for _ in 0..20 {
        let locks = std::fs::read_to_string("/proc/locks")
            .map_err(|e| format!("cannot read /proc/locks: {e}"))?;
        let pids = holders_in(&locks, &id);
        if !pids.is_empty() {
            return Ok(pids);
        }
    }
    Ok(Vec::new())
}

/// The pids holding the lock on the file `id` (`MAJOR:MINOR:INODE`) in /proc/locks' text.
fn holders_in(locks: &str, id: &str) -> Vec<i32> {
    let mut pids = Vec::new();
    for line in locks.lines() {
        // "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF" (a "->" marks a waiter).
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.get(1) == Some(&"->") {
            continue;
        }
        let (Some(pid), Some(file)) = (
            fields.get(4).and_then(|p| p.parse::<i32>().ok()),
            fields.get(5),
        ) else {
            continue;
        };
        if *file == id {
            pids.push(pid);
        }
    }
    // The same shift can also show a line twice.
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// The file whose lock says which Codex process writes to `thread` (Codex's own).
pub fn writer_lock(home: &Path, thread: &str) -> PathBuf {
    home.join("thread-writer-locks")
        .join(format!("{thread}.lock"))
}

// ----- the supervised turn --------------------------------------------------------------------

/// Pipes for the app-server, and the home the agent was registered with.
pub fn prepare_command(cmd: &mut tokio::process::Command, thread: &Thread) {
    cmd.stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped());
    if let Some(home) = &thread.home {
        cmd.env("CODEX_HOME", home);
    }
}

/// Marks an error the app-server answered (it read the request and said no), as opposed to
/// one where it is not known what became of the request.
const ANSWERED: &str = "codex answered: ";

/// How long one request to the app-server may wait for its answer.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// JSON-RPC to an app-server (no `"jsonrpc"` field, as Codex speaks it): lines over its
/// stdio, or WebSocket text frames over the daemon's socket.
pub(crate) struct Rpc {
    link: Link,
    next_id: i64,
    log: Option<std::fs::File>,
    /// Notifications read while waiting for an answer, not yet handled.
    pending: std::collections::VecDeque<Value>,
    /// The Codex version, once `initialize` has answered.
    version: Option<String>,
}

/// How messages travel to and from the app-server.
enum Link {
    /// Our own `codex app-server`: one JSON message a line on its stdin and stdout.
    Pipe {
        stdin: Option<tokio::process::ChildStdin>,
        lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    },
    /// The Codex daemon's control socket: one JSON message a WebSocket text frame.
    Socket(Box<daemon::Socket>),
    Closed,
}

impl Rpc {
    fn pipe(
        stdin: tokio::process::ChildStdin,
        stdout: tokio::process::ChildStdout,
        log: Option<std::fs::File>,
    ) -> Rpc {
        use tokio::io::AsyncBufReadExt as _;
        Rpc::new(
            Link::Pipe {
                stdin: Some(stdin),
                lines: tokio::io::BufReader::new(stdout).lines(),
            },
            log,
        )
    }

    fn new(link: Link, log: Option<std::fs::File>) -> Rpc {
        Rpc {
            link,
            next_id: 0,
            log,
            pending: std::collections::VecDeque::new(),
            version: None,
        }
    }

    /// Whether this talks to the daemon (the session a person has open).
    fn through_daemon(&self) -> bool {
        matches!(self.link, Link::Socket(_))
    }

    async fn send(&mut self, msg: &Value) -> Result<(), String> {
        use tokio::io::AsyncWriteExt as _;
        match &mut self.link {
            Link::Pipe { stdin, .. } => {
                let stdin = stdin.as_mut().ok_or("stdin closed")?;
                let mut bytes = msg.to_string().into_bytes();
                bytes.push(b'\n');
                stdin
                    .write_all(&bytes)
                    .await
                    .map_err(|e| format!("the app-server stopped reading: {e}"))
            }
            Link::Socket(ws) => daemon::send(ws, msg).await,
            Link::Closed => Err("the connection is closed".to_owned()),
        }
    }

    /// The next message from the app-server; `None` when it closed its output.
    async fn read(&mut self) -> Option<Value> {
        loop {
            let line = match &mut self.link {
                Link::Pipe { lines, .. } => lines.next_line().await.ok()??,
                Link::Socket(ws) => daemon::read(ws).await?,
                Link::Closed => return None,
            };
            if let Some(f) = self.log.as_mut() {
                use std::io::Write as _;
                let _ = writeln!(f, "{line}");
            }
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                return Some(v);
            }
        }
    }

    /// Ends the conversation: closing its stdin ends our own app-server (which frees the
    /// thread's writer lock); the daemon only loses one client.
    async fn close(&mut self) {
        if let Link::Socket(ws) = &mut self.link {
            daemon::close(ws).await;
        }
        self.link = Link::Closed;
    }

    /// `initialize` and `initialized`, once; the Codex version it reports.
    async fn hello(&mut self) -> Result<String, String> {
        if let Some(v) = &self.version {
            return Ok(v.clone());
        }
        let hello = json!({
            "clientInfo": {"name": "handoffs", "title": "handoffs", "version": env!("CARGO_PKG_VERSION")},
            "capabilities": {"experimentalApi": true},
        });
        let r = self.call("initialize", hello).await?;
        let version = r
            .get("userAgent")
            .and_then(Value::as_str)
            .and_then(|ua| ua.split_whitespace().next())
            .and_then(|first| first.rsplit('/').next())
            .unwrap_or("unknown")
            .to_owned();
        self.send(&json!({"method": "initialized"})).await?;
        self.version = Some(version.clone());
        Ok(version)
    }

    /// One request and its answer, within [`CALL_TIMEOUT`]: an app-server that stops
    /// answering never holds a write (and its recipient) for longer.
    async fn call(&mut self, method: &str, params: Value) -> Result<Value, String> {
        match tokio::time::timeout(CALL_TIMEOUT, self.call_unbounded(method, params)).await {
            Ok(answer) => answer,
            Err(_) => Err(format!(
                "the app-server did not answer {method} in {}s",
                CALL_TIMEOUT.as_secs()
            )),
        }
    }

    /// [`Rpc::call`] within `limit`.
    async fn call_within(
        &mut self,
        limit: Duration,
        method: &str,
        params: Value,
    ) -> Result<Value, String> {
        match tokio::time::timeout(limit, self.call_unbounded(method, params)).await {
            Ok(answer) => answer,
            Err(_) => Err(format!("no answer to {method} in {}s", limit.as_secs())),
        }
    }

    async fn call_unbounded(&mut self, method: &str, params: Value) -> Result<Value, String> {
        self.next_id += 1;
        let id = self.next_id;
        self.send(&json!({"id": id, "method": method, "params": params}))
            .await?;
        loop {
            let msg = self
                .read()
                .await
                .ok_or_else(|| format!("the app-server exited before answering {method}"))?;
            if msg.get("id").and_then(Value::as_i64) == Some(id) && msg.get("method").is_none() {
                if let Some(e) = msg.get("error") {
                    return Err(format!(
                        "{ANSWERED}{}",
                        e.get("message")
                            .and_then(Value::as_str)
                            .unwrap_or("an error")
                    ));
                }
                return Ok(msg.get("result").cloned().unwrap_or(Value::Null));
            }
            self.pending.push_back(msg);
        }
    }

    async fn next(&mut self) -> Option<Value> {
        match self.pending.pop_front() {
            Some(v) => Some(v),
            None => self.read().await,
        }
    }

    /// Answers a request from our own app-server, so a turn never stalls waiting for a person
    /// who is not there: approvals accepted or declined as the agent is set, questions and
    /// elicitations declined, anything else refused as not supported.
    async fn answer(&mut self, request: &Value, accept: bool) {
        let Some(id) = request.get("id").cloned() else {
            return;
        };
        let method = request["method"].as_str().unwrap_or("");
        let _ = self.send(&answer_to(&id, method, accept)).await;
    }
}

/// Whether a request from Codex asks to approve a command, a file change or a permission.
fn is_approval(method: &str) -> bool {
    matches!(
        method,
        "item/commandExecution/requestApproval"
            | "item/fileChange/requestApproval"
            | "item/permissions/requestApproval"
            | "applyPatchApproval"
            | "execCommandApproval"
    )
}

/// The answer to one request from the app-server (see [`Rpc::answer`]).
fn answer_to(id: &Value, method: &str, accept: bool) -> Value {
    let result = match method {
        "item/commandExecution/requestApproval" | "item/fileChange/requestApproval" => {
            json!({"decision": if accept { "accept" } else { "decline" }})
        }
        "applyPatchApproval" | "execCommandApproval" => {
            json!({"decision": if accept { "approved" } else { "denied" }})
        }
        "item/permissions/requestApproval" => json!({"permissions": {}, "scope": "turn"}),
        "mcpServer/elicitation/request" => json!({"action": "decline"}),
        "item/tool/requestUserInput" => json!({"answers": {}}),
        _ => {
            return json!({"id": id, "error": {"code": -32601,
                "message": format!("{method} is not supported by handoffs")}});
        }
    };
    json!({"id": id, "result": result})
}

/// Test builds only (`planted-bugs`): with `HANDOFFS_TEST_HOLD_WRITE=DIR` the supervisor says
/// `DIR/ready` just before it writes and waits for `DIR/go`, so a test can start a person's
/// turn in the moment between the engine's last look and the write. Elsewhere: nothing.
async fn hold_before_write(request_id: &str) {
    hold_at("HANDOFFS_TEST_HOLD_WRITE", request_id).await;
}

/// The same before the supervisor opens the thread or takes the Claude session
/// (`HANDOFFS_TEST_HOLD_OPEN=DIR`), so a test can let another process take it in that moment.
pub(crate) async fn hold_before_open(request_id: &str) {
    hold_at("HANDOFFS_TEST_HOLD_OPEN", request_id).await;
}

/// Test builds only (`planted-bugs`): with `var=DIR` set, says `DIR/ready` (holding
/// `request_id`) and waits for `DIR/go`, at most a minute. Elsewhere: nothing.
/// `HANDOFFS_TEST_HOLD_ENGINE_WRITE` holds the engine between the commit that issued a write
/// and its lease check before the write.
pub(crate) async fn hold_at(var: &str, request_id: &str) {
    if !cfg!(feature = "planted-bugs") {
        return;
    }
    let Some(dir) = std::env::var_os(var).map(PathBuf::from) else {
        return;
    };
    let _ = std::fs::write(dir.join("ready"), request_id);
    let until = tokio::time::Instant::now() + Duration::from_secs(60);
    while !dir.join("go").exists() && tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Test builds only (`planted-bugs`): `HANDOFFS_TEST_LOSE_ANSWER=1` sends the write and
/// never reads its answer, as when the connection drops right after the request went out.
fn lose_the_answer() -> bool {
    cfg!(feature = "planted-bugs") && std::env::var_os("HANDOFFS_TEST_LOSE_ANSWER").is_some()
}

/// What one supervised Codex write came to, through our own app-server (`child`):
/// `(outcome, detail)`.
pub async fn converse(
    child: &mut tokio::process::Child,
    thread: &Thread,
    text: &str,
    request_id: &str,
    log: &Path,
    said: &mut dyn FnMut(Said<'_>),
    fresh: &Fresh<'_>,
) -> (String, Option<String>) {
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        return (
            "refused".to_owned(),
            Some("no pipes to the app-server".to_owned()),
        );
    };
    let mut rpc = Rpc::pipe(stdin, stdout, open_log(log));
    let (outcome, detail) = talk(&mut rpc, thread, text, request_id, fresh.no_progress, said).await;
    rpc.close().await;
    if tokio::time::timeout(Duration::from_secs(5), child.wait())
        .await
        .is_err()
    {
        if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
            command::kill_group(pid);
        }
        let _ = child.wait().await;
    }
    if outcome != MAYBE_QUEUED {
        return (outcome, detail);
    }
    // The message may wait in Codex's queue (which keeps it on disk and would run it later,
    // beside any resend): take it out through a fresh app-server before saying anything.
    let taken_out = match own_app_server(fresh, thread).await {
        Ok(mut server) => {
            let r = remove_queued(&mut server.rpc, thread, request_id).await;
            server.stop().await;
            r
        }
        Err(e) => Err(e),
    };
    maybe_queued_outcome(detail, taken_out)
}

/// [`converse`] through the Codex daemon, which serves the thread (the session a person has
/// open): the same write, turn and timeout, and nothing of the daemon's is stopped after it.
pub(crate) async fn converse_daemon(
    mut rpc: Rpc,
    thread: &Thread,
    text: &str,
    request_id: &str,
    log: &Path,
    said: &mut dyn FnMut(Said<'_>),
    no_progress: Duration,
) -> (String, Option<String>) {
    rpc.log = open_log(log);
    let (outcome, detail) = talk(&mut rpc, thread, text, request_id, no_progress, said).await;
    rpc.close().await;
    if outcome != MAYBE_QUEUED {
        return (outcome, detail);
    }
    let home = home(thread.home.as_deref());
    let taken_out = match home.as_deref().map(daemon::connect) {
        Some(connecting) => match connecting.await {
            Ok(Some(mut rpc)) => {
                let r = remove_queued(&mut rpc, thread, request_id).await;
                rpc.close().await;
                r
            }
            Ok(None) => Err("the Codex daemon is gone".to_owned()),
            Err(e) => Err(e),
        },
        None => Err("no Codex home".to_owned()),
    };
    maybe_queued_outcome(detail, taken_out)
}

fn open_log(log: &Path) -> Option<std::fs::File> {
    std::fs::OpenOptions::new().append(true).open(log).ok()
}

/// A write that may wait in the thread's queue, once we tried to take it out: errored (a
/// bounded resend) only when it was there and is gone now, unstarted. Otherwise it may have
/// started (through the daemon a queued message starts within milliseconds): the run is left
/// open, and the rollout and the daemon settle it (`standing`), never a resend beside it.
fn maybe_queued_outcome(
    detail: Option<String>,
    taken_out: Result<bool, String>,
) -> (String, Option<String>) {
    let detail = detail.unwrap_or_default();
    match taken_out {
        Ok(true) => (
            "errored".to_owned(),
            Some(format!(
                "{detail}; the message was taken out of the queue unstarted"
            )),
        ),
        Ok(false) => (
            LEAVE_OPEN.to_owned(),
            Some(format!(
                "{detail}; the message is not in the queue: it may have started"
            )),
        ),
        Err(e) => (
            LEAVE_OPEN.to_owned(),
            Some(format!(
                "{detail}; it may still wait in Codex's queue ({e})"
            )),
        ),
    }
}

/// An outcome the supervisor does not record: nobody can say yet how the write ended, so the
/// run stays open for `standing` to judge from the rollout and the daemon.
pub(crate) const LEAVE_OPEN: &str = "open";

/// An outcome `talk` leaves to `converse`: the message may be in the thread's queue.
const MAYBE_QUEUED: &str = "maybe-queued";

/// How the app-server was started (its program, arguments and folder: another like it can
/// be), and how long a turn may go without progress.
#[derive(Debug)]
pub struct Fresh<'a> {
    pub argv: &'a [String],
    pub cwd: &'a str,
    pub no_progress: Duration,
}

/// An app-server of our own for looking into a thread's queue: introduced, but the thread is
/// never loaded (`thread/resume` would start what is queued). Its process group is killed if
/// it is dropped before it was stopped (a probe that ran out of time).
struct OwnServer {
    child: tokio::process::Child,
    rpc: Rpc,
    stopped: bool,
}

impl OwnServer {
    async fn stop(mut self) {
        self.rpc.close().await;
        stop(&mut self.child).await;
        self.stopped = true;
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        if !self.stopped
            && let Some(pid) = self.child.id().and_then(|p| i32::try_from(p).ok())
        {
            command::kill_group(pid);
        }
    }
}

async fn own_app_server(fresh: &Fresh<'_>, thread: &Thread) -> Result<OwnServer, String> {
    let (program, args) = fresh.argv.split_first().ok_or("no program")?;
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .kill_on_drop(true);
    if let Some(home) = &thread.home {
        cmd.env("CODEX_HOME", home);
    }
    if !fresh.cwd.is_empty() {
        cmd.current_dir(fresh.cwd);
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {program}: {e}"))?;
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        stop(&mut child).await;
        return Err("no pipes".to_owned());
    };
    let mut server = OwnServer {
        child,
        rpc: Rpc::pipe(stdin, stdout, None),
        stopped: false,
    };
    match server.rpc.hello().await {
        Ok(_) => Ok(server),
        Err(e) => {
            server.stop().await;
            Err(e)
        }
    }
}

/// Lets an app-server of ours end (its stdin is closed), or kills its group after 5 s.
async fn stop(child: &mut tokio::process::Child) {
    if tokio::time::timeout(Duration::from_secs(5), child.wait())
        .await
        .is_err()
    {
        if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
            command::kill_group(pid);
        }
        let _ = child.wait().await;
    }
}

/// Deletes every queued item of the thread that carries `request_id`: whether one was there
/// (and is deleted now); `Err` when that could not be done.
async fn remove_queued(rpc: &mut Rpc, thread: &Thread, request_id: &str) -> Result<bool, String> {
    rpc.hello().await?;
    // Every page: an item past the first must not pass for gone.
    let mut items = Vec::new();
    let mut cursor = Value::Null;
    for _ in 0..1_000 {
        let page = rpc
            .call(
                "thread/queue/list",
                json!({"threadId": thread.id, "cursor": cursor, "limit": 100}),
            )
            .await?;
        items.extend(page["data"].as_array().into_iter().flatten().cloned());
        match &page["nextCursor"] {
            Value::String(c) if !c.is_empty() && Value::String(c.clone()) != cursor => {
                cursor = Value::String(c.clone());
            }
            Value::String(c) if !c.is_empty() => {
                return Err("thread/queue/list repeated its cursor".to_owned());
            }
            _ => {
                cursor = Value::Null;
                break;
            }
        }
    }
    if !cursor.is_null() {
        return Err("thread/queue/list did not end".to_owned());
    }
    let mut deleted = false;
    for item in &items {
        if item["clientUserMessageId"] == request_id
            && let Some(id) = item["id"].as_str()
        {
            // `deleted: false`: it left the queue between the list and the delete (it may
            // be starting).
            let answer = rpc
                .call(
                    "thread/queue/delete",
                    json!({"threadId": thread.id, "queuedSubmissionId": id}),
                )
                .await?;
            deleted |= answer["deleted"] == true;
        }
    }
    Ok(deleted)
}

async fn talk(
    rpc: &mut Rpc,
    thread: &Thread,
    text: &str,
    request_id: &str,
    no_progress: Duration,
    said: &mut dyn FnMut(Said<'_>),
) -> (String, Option<String>) {
    hold_before_open(request_id).await;
    let version = match open_thread(rpc, thread).await {
        Ok(v) => v,
        Err(ended) => return ended,
    };
    let queued_id = match queue_message(rpc, thread, text, request_id).await {
        Ok(id) => id,
        Err(ended) => return ended,
    };
    said(Said::Written);
    follow_turn(
        rpc,
        thread,
        request_id,
        &version,
        queued_id.as_ref(),
        no_progress,
        said,
    )
    .await
}

/// Opens the conversation: the app-server's (or daemon's) version, and the thread resumed.
/// An error is the run's end: nothing was written.
async fn open_thread(rpc: &mut Rpc, thread: &Thread) -> Result<String, (String, Option<String>)> {
    let refused = |d: String| Err(("refused".to_owned(), Some(d)));
    let version = match rpc.hello().await {
        Ok(v) => v,
        Err(e) if rpc.through_daemon() => {
            return refused(format!("the Codex daemon did not answer: {e}"));
        }
        Err(e) => return refused(format!("codex app-server did not start: {e}")),
    };
    if let Err(e) = rpc
        .call(
            "thread/resume",
            json!({"threadId": thread.id, "excludeTurns": true}),
        )
        .await
    {
        // Nothing was written. A thread another process took since the engine's look waits
        // (busy at the write, no refusal); a thread that is not there is refused.
        if e.contains("active writer") {
            return Err((
                super::command::HELD.to_owned(),
                Some(format!(
                    "thread {} is open in another Codex process ({e})",
                    thread.id
                )),
            ));
        }
        return refused(format!("codex could not resume thread {}: {e}", thread.id));
    }
    Ok(if rpc.through_daemon() {
        format!("{version} (through the Codex daemon)")
    } else {
        version
    })
}

/// Queues the card as the thread's next user message (`thread/queue/add`): the queued
/// submission's id, or how the run ended (refused: not queued; maybe queued: no answer).
async fn queue_message(
    rpc: &mut Rpc,
    thread: &Thread,
    text: &str,
    request_id: &str,
) -> Result<Option<String>, (String, Option<String>)> {
    let input = json!([{"type": "text", "text": text}]);
    hold_before_write(request_id).await;
    if lose_the_answer() {
        // Test builds only: the write goes out, Codex acts on it (its turn begins), and the
        // answer is never read.
        let _ = rpc
            .send(&json!({"id": -1, "method": "thread/queue/add",
                "params": {"threadId": thread.id, "input": input, "clientUserMessageId": request_id}}))
            .await;
        let began = async {
            while let Some(m) = rpc.read().await {
                if m["method"] == "item/started" && m["params"]["item"]["clientId"] == request_id {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(30), began).await;
        return Err((
            MAYBE_QUEUED.to_owned(),
            Some("the answer to thread/queue/add was lost".to_owned()),
        ));
    }
    let queued = if crate::planted(crate::Plant::TurnStartCodex)
        || crate::planted(crate::Plant::TurnStartOnly)
    {
        // The planted naive adapter: a bare turn/start, folded into whatever turn runs.
        rpc.call(
            "turn/start",
            json!({"threadId": thread.id, "input": input, "clientUserMessageId": request_id}),
        )
        .await
    } else {
        rpc.call(
            "thread/queue/add",
            json!({"threadId": thread.id, "input": input, "clientUserMessageId": request_id}),
        )
        .await
    };
    match queued {
        Ok(r) => Ok(r["queuedSubmission"]["id"].as_str().map(str::to_owned)),
        // Answered with an error: nothing was queued. Another process took the thread: busy
        // at the write; anything else: a refusal.
        Err(e) if e.starts_with(ANSWERED) && e.contains("active writer") => Err((
            super::command::HELD.to_owned(),
            Some(format!(
                "thread {} is open in another Codex process ({e})",
                thread.id
            )),
        )),
        Err(e) if e.starts_with(ANSWERED) => Err((
            "refused".to_owned(),
            Some(format!("codex did not queue the message: {e}")),
        )),
        // Sent, and no answer: it may be in the queue.
        Err(e) => Err((MAYBE_QUEUED.to_owned(), Some(e))),
    }
}

/// Follows the queued message to its turn's end: starts the queue after an interruption
/// paused it, answers the app-server's requests, and gives up after `no_progress` without any.
async fn follow_turn(
    rpc: &mut Rpc,
    thread: &Thread,
    request_id: &str,
    version: &str,
    queued_id: Option<&String>,
    no_progress: Duration,
    said: &mut dyn FnMut(Said<'_>),
) -> (String, Option<String>) {
    let mut turn: Option<String> = None;
    let mut waiting = false;
    // Approval requests asked before our turn's id was known (see below).
    let mut early: Vec<Value> = Vec::new();
    let mut nudged = false;
    let started = tokio::time::Instant::now();
    let mut last_progress = started;
    // Absolute deadlines: traffic about other threads (the daemon tells every client) must
    // not put them off.
    let mut look_at = started + Duration::from_secs(3);
    loop {
        let deadline = if turn.is_none() && !nudged {
            look_at
        } else {
            last_progress + no_progress
        };
        let msg = match tokio::time::timeout_at(deadline, rpc.next()).await {
            Ok(Some(m)) => m,
            Ok(None) if rpc.through_daemon() => {
                // Our connection is gone, not the daemon's turn: the rollout and the daemon
                // tell later how it ended.
                return (
                    LEAVE_OPEN.to_owned(),
                    Some("the connection to the Codex daemon closed".to_owned()),
                );
            }
            Ok(None) if turn.is_none() => {
                return (
                    MAYBE_QUEUED.to_owned(),
                    Some("the app-server exited before the message's turn began".to_owned()),
                );
            }
            Ok(None) => {
                return (
                    "interrupted".to_owned(),
                    Some("the app-server exited during the turn".to_owned()),
                );
            }
            Err(_) if turn.is_none() && !nudged => {
                // After an interrupted turn Codex pauses its queue: start our item, but only
                // on an idle thread (a turn still running ends first, then the queue moves).
                let idle = rpc
                    .call("thread/read", json!({"threadId": thread.id}))
                    .await
                    .is_ok_and(|r| {
                        let status = &r["thread"]["status"]["type"];
                        status == "idle" || status == "systemError"
                    });
                if !idle {
                    if started.elapsed() > no_progress {
                        nudged = true;
                        last_progress = started;
                    }
                    look_at = tokio::time::Instant::now() + Duration::from_secs(3);
                    continue;
                }
                nudged = true;
                if let Some(q) = queued_id {
                    let _ = rpc
                        .call(
                            "thread/queue/start",
                            json!({"threadId": thread.id, "queuedSubmissionId": q}),
                        )
                        .await;
                }
                last_progress = tokio::time::Instant::now();
                continue;
            }
            Err(_) => return give_up(rpc, thread, request_id, turn.as_deref(), no_progress).await,
        };
        let method = msg.get("method").and_then(Value::as_str).unwrap_or("");
        if msg.get("id").is_some() && !method.is_empty() {
            answer_request(rpc, thread, turn.as_deref(), msg, &mut early).await;
            continue;
        }
        let params = msg.get("params").cloned().unwrap_or(Value::Null);
        if params
            .get("threadId")
            .and_then(Value::as_str)
            .is_some_and(|t| t != thread.id)
        {
            continue;
        }
        let turn_id = params
            .get("turnId")
            .and_then(Value::as_str)
            .or_else(|| params["turn"]["id"].as_str())
            .map(str::to_owned);
        if method == "thread/status/changed" && turn.is_some() {
            let note = waiting_note(&params, rpc.through_daemon() && thread.approvals.is_none());
            if note.is_some() || waiting {
                said(Said::Waiting(note));
                waiting = note.is_some();
            }
        }
        match method {
            "item/started" | "item/completed"
                if params["item"]["type"] == "userMessage"
                    && params["item"]["clientId"] == request_id =>
            {
                turn = turn_id;
                last_progress = tokio::time::Instant::now();
                if let (Some(t), Some(accept)) = (&turn, thread.approvals) {
                    for asked in std::mem::take(&mut early) {
                        if asked["params"]["turnId"] == t.as_str() {
                            rpc.answer(&asked, accept).await;
                        }
                    }
                }
            }
            "turn/completed" if turn.is_some() && turn_id == turn => {
                let status = params["turn"]["status"].as_str().unwrap_or("");
                let error = params["turn"]["error"]["message"]
                    .as_str()
                    .map(str::to_owned);
                let id = turn.clone().unwrap_or_default();
                return turn_ended(version, &id, status, error);
            }
            _ if turn.is_some() && turn_id == turn && method != "error" => {
                last_progress = tokio::time::Instant::now();
            }
            _ => {}
        }
    }
}

/// Answers a request from Codex during our write. Our own app-server has only us to answer:
/// as the agent is set, else declined. Through the daemon the person's open session answers,
/// unless the agent's `approvals` setting says how; then only our turn's approvals are
/// answered, and one asked before we knew our turn's id (`turn` `None`) waits in `early` until
/// we do (the person may answer it meanwhile). A request unanswered past the timeout
/// interrupts the turn.
async fn answer_request(
    rpc: &mut Rpc,
    thread: &Thread,
    turn: Option<&str>,
    msg: Value,
    early: &mut Vec<Value>,
) {
    let method = msg["method"].as_str().unwrap_or("");
    if !rpc.through_daemon() {
        rpc.answer(&msg, thread.approvals.unwrap_or(false)).await;
    } else if let Some(accept) = thread.approvals
        && is_approval(method)
        && msg["params"]["threadId"] == thread.id.as_str()
    {
        match turn {
            Some(t) if msg["params"]["turnId"] == t => rpc.answer(&msg, accept).await,
            Some(_) => {}
            None => early.push(msg),
        }
    }
}

/// What a `thread/status/changed` says our turn waits for, if anything; `person`: the
/// approvals are the person's to answer (through the daemon, with no `approvals` setting).
fn waiting_note(params: &Value, person: bool) -> Option<&'static str> {
    let flags = params["status"]["activeFlags"].as_array();
    let flag = |f: &str| flags.is_some_and(|a| a.iter().any(|v| v == f));
    if flag("waitingOnApproval") {
        Some(if person {
            "waiting for an approval in the person's Codex session"
        } else {
            "waiting for an approval"
        })
    } else if flag("waitingOnUserInput") {
        Some("waiting for the person's answer in the Codex session")
    } else {
        None
    }
}

/// No progress for `no_progress`: a running turn is interrupted (an errored run, resent
/// within bounds); a message that never started is taken out of the queue when it can be.
async fn give_up(
    rpc: &mut Rpc,
    thread: &Thread,
    request_id: &str,
    turn: Option<&str>,
    no_progress: Duration,
) -> (String, Option<String>) {
    let secs = no_progress.as_secs();
    // Which Codex it was, as in every run's record (`initialize` answered before any turn).
    let codex = rpc
        .version
        .as_ref()
        .map(|v| format!("codex {v}: "))
        .unwrap_or_default();
    if let Some(t) = turn {
        let _ = rpc
            .call(
                "turn/interrupt",
                json!({"threadId": thread.id, "turnId": t}),
            )
            .await;
        // Let Codex end the turn (and write it down) before we go.
        let ended = async {
            while let Some(m) = rpc.next().await {
                if m["method"] == "turn/completed" && m["params"]["turn"]["id"] == t {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(10), ended).await;
        return (
            "errored".to_owned(),
            Some(format!(
                "{codex}no progress in {secs}s; the turn was interrupted"
            )),
        );
    }
    // Never started: take it out of the queue, so it cannot run later.
    match remove_queued(rpc, thread, request_id).await {
        // Nothing ran, but the engine has its receipt: an errored write (a
        // bounded resend), never a refusal after a receipt.
        Ok(true) => (
            "errored".to_owned(),
            Some(format!(
                "{codex}the queued message did not start in {secs}s and was taken out of the queue"
            )),
        ),
        Ok(false) => (
            LEAVE_OPEN.to_owned(),
            Some(format!(
                "{codex}the message was not seen to start in {secs}s and is no longer queued"
            )),
        ),
        Err(e) => (
            LEAVE_OPEN.to_owned(),
            Some(format!(
                "{codex}the message did not start in {secs}s and could not be taken out of the queue ({e})"
            )),
        ),
    }
}

/// How a turn that completed ended, in the run's terms.
fn turn_ended(
    version: &str,
    id: &str,
    status: &str,
    error: Option<String>,
) -> (String, Option<String>) {
    match status {
        "completed" => (
            "returned".to_owned(),
            Some(format!("codex {version}: turn {id} completed")),
        ),
        "interrupted" => (
            "interrupted".to_owned(),
            Some(format!("codex {version}: turn {id} was interrupted")),
        ),
        _ => (
            "errored".to_owned(),
            Some(format!(
                "codex {version}: turn {id} failed: {}",
                error.unwrap_or_else(|| status.to_owned())
            )),
        ),
    }
}

// ----- the rollout ----------------------------------------------------------------------------

/// What the rollout says of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    Absent,
    /// Its turn completed.
    Completed,
    /// Its turn was interrupted.
    Aborted,
    /// Its turn has not ended (yet, or ever).
    Open,
}

/// Searches a thread's rollout for the user message whose `client_id` is `request_id`.
pub fn find(home: &Path, thread: &str, request_id: &str) -> Result<Found, String> {
    find_turn(home, thread, request_id).map(|(found, _)| found)
}

/// [`find`], with the id of the turn the message went into.
pub fn find_turn(
    home: &Path,
    thread: &str,
    request_id: &str,
) -> Result<(Found, Option<String>), String> {
    let Some(path) = doctor::find_rollout(&home.join("sessions"), thread) else {
        return Ok((Found::Absent, None));
    };
    let file =
        std::fs::File::open(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut turn: Option<String> = None;
    // By bytes: one line that is not UTF-8 is skipped, not the end of the search.
    for line in std::io::BufReader::new(file).split(b'\n') {
        let line = line.map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let Ok(v) = serde_json::from_slice::<Value>(&line) else {
            continue;
        };
        if v["type"] != "event_msg" {
            continue;
        }
        let p = &v["payload"];
        match (p["type"].as_str(), &turn) {
            (Some("item_completed"), None) if p["item"]["client_id"] == request_id => {
                turn = p["turn_id"].as_str().map(str::to_owned);
            }
            (Some("task_complete"), Some(t)) if p["turn_id"].as_str() == Some(t) => {
                return Ok((Found::Completed, turn));
            }
            (Some("turn_aborted"), Some(t)) if p["turn_id"].as_str().is_none_or(|x| x == t) => {
                return Ok((Found::Aborted, turn));
            }
            _ => {}
        }
    }
    Ok(if turn.is_some() {
        (Found::Open, turn)
    } else {
        (Found::Absent, None)
    })
}

fn rollout_find(thread: &Thread, request_id: &str) -> Result<Found, String> {
    rollout_find_turn(thread, request_id).map(|(found, _)| found)
}

fn rollout_find_turn(thread: &Thread, request_id: &str) -> Result<(Found, Option<String>), String> {
    let home = home(thread.home.as_deref()).ok_or("no Codex home")?;
    find_turn(&home, &thread.id, request_id)
}

/// Where an open run stands.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Standing {
    /// Its supervisor, its app-server or its turn lives on.
    Going,
    /// Over (and now recorded): outcome and why.
    Over(String, String),
    /// Nobody can tell how its write ended: it stays open, its delivery is not observable,
    /// and only a person (honest release) or a later answer ends it. Never a resend.
    Unknown(String),
}

/// How often an orphaned run is probed (each probe may ask the daemon or start an
/// app-server); between probes its last standing holds.
const PROBE_EVERY: Duration = Duration::from_secs(15);

/// The last probe of each orphaned run (this process's memory: a restarted engine probes
/// again at once).
static PROBED: std::sync::Mutex<
    Option<std::collections::HashMap<String, (std::time::Instant, Standing)>>,
> = std::sync::Mutex::new(None);

/// Where an open run stands: its supervisor lives, its own app-server does, or its turn runs
/// on (or its message waits) in the Codex daemon, which outlives a supervisor. A run that is
/// over is recorded.
async fn standing(service: &RefCell<dyn Host>, agent: &AgentRow, run: &RunRow) -> Standing {
    let (db, now, marks) = {
        let mut s = service.borrow_mut();
        let marks = s.runs().run_marks(&run.request_id);
        (s.db().to_owned(), millis(s.now()), marks)
    };
    let marks = match marks {
        Ok(m) => m,
        Err(e) => return Standing::Unknown(e.to_string()),
    };
    if command::supervisor_alive(&db, &run.request_id) {
        return Standing::Going;
    }
    if run.outcome.is_none() && run.detail.is_some() {
        // What the turn waited for was its supervisor's to say; nobody watches it now.
        let _ = service
            .borrow_mut()
            .runs()
            .set_run_note(&run.request_id, None);
    }
    let judged = match command::orphan(run, now) {
        command::Orphan::Running => return Standing::Going,
        command::Orphan::KilledAtTimeout => Judged::Over(
            "errored".to_owned(),
            "killed after its timeout; its supervisor was gone".to_owned(),
        ),
        command::Orphan::Gone => {
            let cached = PROBED.lock().ok().and_then(|m| {
                m.as_ref()?
                    .get(&run.request_id)
                    .filter(|(at, _)| at.elapsed() < PROBE_EVERY)
                    .map(|(_, st)| st.clone())
            });
            if let Some(st) = cached {
                return st;
            }
            let argv = [
                setting(agent, "binary").unwrap_or("codex").to_owned(),
                "app-server".to_owned(),
            ];
            let own = Fresh {
                argv: &argv,
                cwd: &agent.cwd,
                no_progress: Duration::ZERO,
            };
            let gone = Gone {
                thread: &thread_of(agent),
                own: &own,
                run,
                now,
                left_open_at: marks.0,
            };
            gone.judge().await
        }
    };
    let standing = match judged {
        Judged::Going => Standing::Going,
        Judged::Unknown(why) => Standing::Unknown(why),
        Judged::Over(o, d) => Standing::Over(o, d),
        // Seen nowhere: never started, once two looks at least NEVER_RAN_AFTER apart agree
        // (a message leaves the queue before its turn is written down).
        Judged::Missing => match marks.1 {
            Some(since) if now.saturating_sub(since) >= NEVER_RAN_AFTER_MS => Standing::Over(
                "interrupted".to_owned(),
                "its supervisor was gone; the message was neither queued, nor running, nor in the rollout in two looks 30 s apart".to_owned(),
            ),
            Some(_) => Standing::Going,
            None => {
                let _ = service
                    .borrow_mut()
                    .runs()
                    .mark_run_missing(&run.request_id, now);
                Standing::Going
            }
        },
    };
    if let Ok(mut m) = PROBED.lock() {
        let m = m.get_or_insert_with(Default::default);
        m.retain(|_, (at, _)| at.elapsed() < PROBE_EVERY);
        if !matches!(standing, Standing::Over(..)) {
            m.insert(
                run.request_id.clone(),
                (std::time::Instant::now(), standing.clone()),
            );
        }
    }
    if let Standing::Over(outcome, detail) = &standing {
        let _ = service.borrow_mut().runs().finish_run(
            &run.request_id,
            now,
            None,
            outcome,
            Some(detail),
        );
    }
    standing
}

/// What one look at an orphaned run found.
enum Judged {
    Going,
    Over(String, String),
    Unknown(String),
    /// Neither queued, nor running, nor in the rollout, on a thread nobody is busy with.
    Missing,
}

/// How long two looks that see a message nowhere must be apart before it counts as never
/// started.
const NEVER_RAN_AFTER_MS: i64 = 30_000;

/// How long the questions about an orphaned run may take, all told.
const ORPHAN_PROBE: Duration = Duration::from_secs(20);

/// A run whose supervisor and app-server are gone, and what is known about it.
struct Gone<'a> {
    thread: &'a Thread,
    /// How an app-server of our own is started (to look into the thread's queue).
    own: &'a Fresh<'a>,
    run: &'a RunRow,
    now: i64,
    left_open_at: Option<i64>,
}

impl Gone<'_> {
    /// One look: the rollout, then the daemon when it serves the thread (there the turn, or
    /// the queued message, lives on), else the thread's writer lock and its queue on disk.
    /// Whatever cannot be told stays unknown: never an outcome that resends beside a message
    /// that may still run.
    async fn judge(&self) -> Judged {
        let (thread, run, now) = (self.thread, self.run, self.now);
        // The agent's timeout, counted from the last sign of life (the write, the supervisor
        // leaving it open, the rollout's last change), bounds a turn still running.
        let timeout = run
            .ends_at
            .map_or(3_600_000, |end| end.saturating_sub(run.started_at));
        let last_sign = run
            .started_at
            .max(self.left_open_at.unwrap_or(0))
            .max(rollout_modified_ms(thread).unwrap_or(0));
        let past_timeout = now > last_sign.saturating_add(timeout);
        let Some(home) = home(thread.home.as_deref()) else {
            return Judged::Unknown("no Codex home".to_owned());
        };
        let look = tokio::time::timeout(ORPHAN_PROBE, async {
            if let Some(mut rpc) = daemon::serving(&home, &thread.id).await? {
                let v = self.ask_daemon(&mut rpc, past_timeout).await;
                rpc.close().await;
                v
            } else {
                let (found, _) = rollout_find_turn(thread, &run.request_id)?;
                match Self::ended_in_rollout(&found) {
                    Some(judged) => Ok(judged),
                    None => self.ask_lock_and_queue(&home, found).await,
                }
            }
        })
        .await;
        match look {
            Ok(Ok(j)) => j,
            Ok(Err(e)) => Judged::Unknown(e),
            Err(_) => Judged::Unknown(format!(
                "no answer about the thread in {}s",
                ORPHAN_PROBE.as_secs()
            )),
        }
    }

    /// A turn the rollout shows ended.
    fn ended_in_rollout(found: &Found) -> Option<Judged> {
        match found {
            Found::Completed => Some(Judged::Over(
                "returned".to_owned(),
                "its supervisor was gone; the rollout shows the turn completed".to_owned(),
            )),
            Found::Aborted => Some(Judged::Over(
                "interrupted".to_owned(),
                "its supervisor was gone; the rollout shows the turn interrupted".to_owned(),
            )),
            Found::Open | Found::Absent => None,
        }
    }

    /// The daemon serves the thread: its own list of the thread's turns (full view) says
    /// whether our message's turn ended, and how; a turn still running is waited for (and
    /// interrupted past the timeout). A message it does not list yet is looked for in the
    /// rollout, then as [`Gone::ask_daemon_unlisted`] says.
    async fn ask_daemon(&self, rpc: &mut Rpc, past_timeout: bool) -> Result<Judged, String> {
        let (thread, run) = (self.thread, self.run);
        // A list the daemon cannot give (a thread not yet materialized, an error) is no
        // verdict: the rollout and the daemon's status and queue are asked as before.
        let listed = daemon::listed_turn(rpc, &thread.id, &run.request_id)
            .await
            .unwrap_or_else(|e| {
                tracing::debug!(error = %e, "thread/turns/list");
                None
            });
        let said = |status: &str| {
            format!("its supervisor was gone; the daemon's list of turns shows the turn {status}")
        };
        match listed {
            Some((_, status)) if status == "completed" => {
                return Ok(Judged::Over("returned".to_owned(), said("completed")));
            }
            Some((_, status)) if status == "interrupted" => {
                return Ok(Judged::Over("interrupted".to_owned(), said("interrupted")));
            }
            // As a turn that ends failed while its supervisor watches (`turn_ended`).
            Some((_, status)) if status == "failed" => {
                return Ok(Judged::Over("errored".to_owned(), said("failed")));
            }
            Some((turn, _)) => {
                // Listed as running: the daemon's status says whether it still is (and the
                // agent's timeout bounds it), as for a turn the rollout shows open.
                return self
                    .ask_daemon_unlisted(rpc, Found::Open, Some(&turn), past_timeout)
                    .await;
            }
            None => {}
        }
        let (found, turn) = rollout_find_turn(thread, &run.request_id)?;
        if let Some(judged) = Self::ended_in_rollout(&found) {
            return Ok(judged);
        }
        self.ask_daemon_unlisted(rpc, found, turn.as_deref(), past_timeout)
            .await
    }

    async fn ask_daemon_unlisted(
        &self,
        rpc: &mut Rpc,
        found: Found,
        turn: Option<&str>,
        past_timeout: bool,
    ) -> Result<Judged, String> {
        let (thread, run) = (self.thread, self.run);
        if found == Found::Open {
            let (status, _) = daemon::status(rpc, &thread.id).await?;
            if status != "active" {
                // The turn ended; the rollout read after that says how.
                return Ok(match rollout_find(thread, &run.request_id) {
                    Ok(Found::Completed) => Judged::Over(
                        "returned".to_owned(),
                        "its supervisor was gone; the rollout shows the turn completed".to_owned(),
                    ),
                    Err(e) => Judged::Unknown(e),
                    Ok(_) => Judged::Over(
                        "interrupted".to_owned(),
                        "its supervisor was gone and its turn ended without completing".to_owned(),
                    ),
                });
            }
            // Its turn runs on in the daemon: the agent's timeout still bounds it (Codex
            // refuses to interrupt a turn that is not the running one).
            if past_timeout && let Some(t) = turn {
                rpc.call_within(
                    daemon::PROBE_TIMEOUT,
                    "turn/interrupt",
                    json!({"threadId": thread.id, "turnId": t}),
                )
                .await?;
                return Ok(Judged::Over(
                    "errored".to_owned(),
                    "interrupted after its timeout without progress; its supervisor was gone"
                        .to_owned(),
                ));
            }
            return Ok(Judged::Going);
        }
        // Never seen to start. Still queued: taken out (never run beside a resend). Else it
        // may be starting; the queue first, then the status, then the rollout.
        if remove_queued(rpc, thread, &run.request_id).await? {
            return Ok(Judged::Over(
                "errored".to_owned(),
                "its supervisor was gone; the message was taken out of the queue unstarted"
                    .to_owned(),
            ));
        }
        let (status, _) = daemon::status(rpc, &thread.id).await?;
        Ok(match rollout_find(thread, &run.request_id) {
            Ok(Found::Absent) if status == "active" => Judged::Going,
            Ok(Found::Absent) => Judged::Missing,
            Ok(_) => Judged::Going,
            Err(e) => Judged::Unknown(e),
        })
    }

    /// No daemon serves the thread. Held by another process: that one may run (or have run)
    /// our message, and nobody else can tell. Held by nobody: a turn that began died with our
    /// app-server, and a message never seen to start is looked for in the thread's queue on
    /// disk, through an app-server of our own that does not load the thread (loading it would
    /// start what is queued).
    async fn ask_lock_and_queue(&self, home: &Path, found: Found) -> Result<Judged, String> {
        let (thread, run) = (self.thread, self.run);
        let holders = lock_holders_checked(&writer_lock(home, &thread.id))?;
        if let Some(pid) = holders.first() {
            return Ok(Judged::Unknown(format!(
                "thread {} is open in Codex process {pid}, which may run the message",
                thread.id
            )));
        }
        if found == Found::Open {
            return Ok(Judged::Over(
                "interrupted".to_owned(),
                "its supervisor and its app-server were gone before the turn ended".to_owned(),
            ));
        }
        let mut server = own_app_server(self.own, thread).await?;
        let removed = remove_queued(&mut server.rpc, thread, &run.request_id).await;
        server.stop().await;
        if removed? {
            return Ok(Judged::Over(
                "errored".to_owned(),
                "its supervisor was gone; the message was taken out of the queue unstarted"
                    .to_owned(),
            ));
        }
        Ok(match rollout_find(thread, &run.request_id) {
            Ok(Found::Absent) => Judged::Missing,
            Ok(_) => Judged::Going,
            Err(e) => Judged::Unknown(e),
        })
    }
}

/// When the thread's rollout last changed (a running turn writes to it as it goes).
fn rollout_modified_ms(thread: &Thread) -> Option<i64> {
    let home = home(thread.home.as_deref())?;
    let path = doctor::find_rollout(&home.join("sessions"), &thread.id)?;
    let modified = std::fs::metadata(path).ok()?.modified().ok()?;
    let ms = modified
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_millis();
    i64::try_from(ms).ok()
}

/// What a rollout's record of a message (with no run of ours that knows more) says. A turn
/// the rollout shows open is interrupted only when no process holds the thread: while one
/// does (its own Codex, the daemon, an IDE), that turn may still be running, and a resend
/// beside it would be a second turn at once; nobody can tell, so nothing is guessed.
fn observed_of_found(found: &Found, turn: TurnId, thread: &Thread) -> Observed {
    let interrupted = |turn| Observed::Failed {
        turn,
        failure: TurnFailure::Interrupted,
        turn_open: false,
    };
    match found {
        Found::Absent => Observed::NotFound,
        Found::Completed => Observed::Returned { turn },
        Found::Aborted => interrupted(turn),
        Found::Open => {
            let held = home(thread.home.as_deref())
                .map(|h| lock_holders_checked(&writer_lock(&h, &thread.id)));
            match held {
                Some(Ok(pids)) if pids.is_empty() => interrupted(turn),
                Some(Ok(pids)) => Observed::Unreachable {
                    detail: format!(
                        "its turn has not ended in the rollout, and Codex process {} holds \
                         the thread: it may still be running",
                        pids[0]
                    ),
                },
                Some(Err(e)) => Observed::Unreachable {
                    detail: format!(
                        "its turn has not ended in the rollout, and who holds the thread is \
                         not known ({e})"
                    ),
                },
                None => Observed::Unreachable {
                    detail: "its turn has not ended in the rollout, and Codex's home is not \
                             known"
                        .to_owned(),
                },
            }
        }
    }
}

// ----- the four questions ---------------------------------------------------------------------

pub async fn activity(service: &RefCell<dyn Host>, agent: &AgentRow) -> Activity {
    let thread = thread_of(agent);
    let open = match service.borrow_mut().runs().open_runs_for(&agent.id) {
        Ok(runs) => runs,
        Err(e) => {
            return Activity::Unknown {
                detail: e.to_string(),
            };
        }
    };
    for run in open {
        match standing(service, agent, &run).await {
            Standing::Going => {
                return Activity::Busy {
                    turn: Some(TurnId::new(&run.request_id)),
                    detail: None,
                };
            }
            Standing::Unknown(why) => {
                // Its delivery still holds the recipient: busy. Released by a person (SPEC
                // §2.4, which frees the recipient): the checks below still keep a write out
                // of a thread that is open elsewhere or running.
                let held = service
                    .borrow_mut()
                    .runs()
                    .delivery_is_active(&run.message_id)
                    .unwrap_or(false);
                if held {
                    return Activity::Busy {
                        turn: Some(TurnId::new(&run.request_id)),
                        detail: Some(why),
                    };
                }
            }
            Standing::Over(..) => {}
        }
    }
    if thread.id.is_empty() {
        return Activity::Unknown {
            detail: "no thread id: register the Codex thread with --endpoint".to_owned(),
        };
    }
    if crate::planted(crate::Plant::TurnStartCodex) {
        return Activity::Idle;
    }
    let Some(home) = home(thread.home.as_deref()) else {
        return Activity::Unknown {
            detail: "no Codex home: set home, or CODEX_HOME".to_owned(),
        };
    };
    let holder = match lock_holders_checked(&writer_lock(&home, &thread.id)) {
        Ok(pids) => match pids.first() {
            Some(pid) => *pid,
            // Nobody has the thread open: our own app-server will.
            None => return Activity::Idle,
        },
        Err(detail) => return Activity::Unknown { detail },
    };
    let held = format!(
        "thread {} is open in another Codex process (pid {holder} holds its writer lock)",
        thread.id
    );
    // Held: by the daemon (a person's session, which we can write to when it is idle), or by
    // a process of its own (which nobody else can write to).
    let mut rpc = match daemon::serving(&home, &thread.id).await {
        Ok(Some(rpc)) => rpc,
        Ok(None) => {
            return Activity::Busy {
                turn: None,
                detail: Some(held),
            };
        }
        Err(e) => {
            return Activity::Busy {
                turn: None,
                detail: Some(format!("{held}; {e}")),
            };
        }
    };
    let status = daemon::status(&mut rpc, &thread.id).await;
    rpc.close().await;
    match status {
        // `systemError` stays on a thread after a failed turn until the next one starts: no
        // turn is running.
        Ok((kind, _)) if kind == "idle" || kind == "systemError" => Activity::Idle,
        Ok((kind, flags)) if kind == "active" => Activity::Busy {
            turn: None,
            detail: Some(if flags.is_empty() {
                format!(
                    "a turn is running in the Codex session of thread {}",
                    thread.id
                )
            } else {
                format!(
                    "the Codex session of thread {} is waiting ({})",
                    thread.id,
                    flags.join(", ")
                )
            }),
        },
        Ok((kind, _)) => Activity::Unknown {
            detail: format!("the Codex daemon reports thread {} as {kind}", thread.id),
        },
        Err(e) => Activity::Unknown {
            detail: format!(
                "the Codex daemon did not say how thread {} is: {e}",
                thread.id
            ),
        },
    }
}

pub async fn start(service: &RefCell<dyn Host>, w: &Write<'_>) -> WriteOutcome {
    if w.agent.endpoint.is_empty() {
        return WriteOutcome::Refused {
            detail: "no thread id: register the Codex thread with --endpoint".to_owned(),
        };
    }
    let thread = thread_of(w.agent);
    let mut extra = vec!["--codex-thread".to_owned(), thread.id.clone()];
    if let Some(home) = &thread.home {
        extra.push("--codex-home".to_owned());
        extra.push(home.to_string_lossy().into_owned());
    }
    if let Some(accept) = thread.approvals {
        extra.push("--codex-approvals".to_owned());
        extra.push(if accept { "accept" } else { "decline" }.to_owned());
    }
    let binary = setting(w.agent, "binary").unwrap_or("codex").to_owned();
    let argv = vec![binary, "app-server".to_owned()];
    command::start_supervised(service, w, argv, &extra).await
}

pub async fn observe(service: &RefCell<dyn Host>, agent: &AgentRow, request_id: &str) -> Observed {
    let thread = thread_of(agent);
    let db = service.borrow().db().to_owned();
    let run = service.borrow_mut().runs().run(request_id);
    match run {
        Ok(Some(run)) => {
            if run.outcome.is_some() {
                return command::observed_of(&run, false);
            }
            if run.pid.is_none() && command::supervisor_alive(&db, request_id) {
                // Its supervisor has not written yet (the receipt comes with the write).
                return Observed::Unreachable {
                    detail: "the write is starting".to_owned(),
                };
            }
            match standing(service, agent, &run).await {
                Standing::Going => return command::observed_of(&run, true),
                // Nobody can tell: not observable (never a guess that resends).
                Standing::Unknown(detail) => return Observed::Unreachable { detail },
                Standing::Over(..) => {}
            }
            let fresh = service.borrow_mut().runs().run(request_id);
            match fresh {
                Ok(Some(fresh)) => command::observed_of(&fresh, false),
                Ok(None) => Observed::NotFound,
                Err(e) => Observed::Unreachable {
                    detail: e.to_string(),
                },
            }
        }
        Ok(None) if command::run_may_start(&db, request_id) => Observed::Unreachable {
            detail: "the run's supervisor is starting".to_owned(),
        },
        Ok(None) => match rollout_find(&thread, request_id) {
            Ok(found) => observed_of_found(&found, TurnId::new(request_id), &thread),
            Err(detail) => Observed::Unreachable { detail },
        },
        Err(e) => Observed::Unreachable {
            detail: e.to_string(),
        },
    }
}

pub async fn scan(service: &RefCell<dyn Host>, agent: &AgentRow, request_id: &str) -> ScanResult {
    let refused_or_none = {
        let mut s = service.borrow_mut();
        match s.runs().run(request_id) {
            Ok(Some(run)) => super::command::wrote_nothing(run.outcome.as_deref()),
            Ok(None) => true,
            Err(_) => return ScanResult::NothingFound { complete: false },
        }
    };
    if !refused_or_none {
        return match observe(service, agent, request_id).await {
            Observed::Unreachable { .. } => ScanResult::NothingFound { complete: false },
            observed => ScanResult::Found { observed },
        };
    }
    let db = service.borrow().db().to_owned();
    if command::run_may_start(&db, request_id) {
        return ScanResult::NothingFound { complete: false };
    }
    let thread = thread_of(agent);
    match rollout_find(&thread, request_id) {
        Ok(Found::Absent) => ScanResult::NothingFound { complete: true },
        Ok(found) => match observed_of_found(&found, TurnId::new(request_id), &thread) {
            // An open turn nobody can judge: the scan is not complete, never a guess.
            Observed::Unreachable { .. } => ScanResult::NothingFound { complete: false },
            observed => ScanResult::Found { observed },
        },
        Err(_) => ScanResult::NothingFound { complete: false },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lock held throughout is found at every look, however many other locks are taken
    /// and released meanwhile (read in pieces, `/proc/locks` skipped it now and then).
    #[test]
    fn a_held_lock_is_found_while_other_locks_churn() {
        let d = tempfile::tempdir().unwrap();
        let held = d.path().join("held.lock");
        let file = std::fs::File::create(&held).unwrap();
        file.try_lock().unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let churn: Vec<_> = (0..4)
            .map(|t| {
                let (dir, stop) = (d.path().to_owned(), stop.clone());
                std::thread::spawn(move || {
                    let files: Vec<std::fs::File> = (0..40)
                        .map(|i| std::fs::File::create(dir.join(format!("c{t}-{i}"))).unwrap())
                        .collect();
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        for f in &files {
                            let _ = f.try_lock();
                        }
                        for f in &files {
                            let _ = f.unlock();
                        }
                    }
                })
            })
            .collect();
        let missed = (0..500)
            .filter(|_| lock_holders_checked(&held).unwrap().is_empty())
            .count();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for c in churn {
            c.join().unwrap();
        }
        assert_eq!(
            missed, 0,
            "the held lock was missed in {missed} of 500 looks"
        );
    }

    #[test]
    fn an_open_turn_is_interrupted_only_while_nobody_holds_the_thread() {
        let d = tempfile::tempdir().unwrap();
        let thread = Thread {
            id: "T".to_owned(),
            home: Some(d.path().to_owned()),
            approvals: None,
        };
        let turn = || TurnId::new("r1");
        let interrupted = |o: &Observed| {
            matches!(
                o,
                Observed::Failed {
                    failure: TurnFailure::Interrupted,
                    ..
                }
            )
        };
        assert!(interrupted(&observed_of_found(
            &Found::Open,
            turn(),
            &thread
        )));
        assert!(interrupted(&observed_of_found(
            &Found::Aborted,
            turn(),
            &thread
        )));
        // A Codex process (here: this one) holds the thread's writer lock: its turn may
        // still run, so nothing is guessed.
        let lock = writer_lock(d.path(), "T");
        std::fs::create_dir_all(lock.parent().unwrap()).unwrap();
        let file = std::fs::File::create(&lock).unwrap();
        file.try_lock().unwrap();
        let held = observed_of_found(&Found::Open, turn(), &thread);
        assert!(
            matches!(&held, Observed::Unreachable { detail } if detail.contains("holds the thread")),
            "{held:?}"
        );
        // A turn the rollout shows ended is judged as it ended, held or not.
        assert!(interrupted(&observed_of_found(
            &Found::Aborted,
            turn(),
            &thread
        )));
        assert!(matches!(
            observed_of_found(&Found::Completed, turn(), &thread),
            Observed::Returned { .. }
        ));
    }

    #[test]
    fn the_rollout_tells_a_completed_turn_from_an_aborted_and_an_open_one() {
        let d = tempfile::tempdir().unwrap();
        let day = d.path().join("sessions/2026/12/02");
        std::fs::create_dir_all(&day).unwrap();
        let lines = [
            json!({"type":"event_msg","payload":{"type":"item_completed","turn_id":"T1","item":{"type":"UserMessage","client_id":"r1"}}}),
            json!({"type":"event_msg","payload":{"type":"task_complete","turn_id":"T1"}}),
            json!({"type":"event_msg","payload":{"type":"item_completed","turn_id":"T2","item":{"type":"UserMessage","client_id":"r2"}}}),
            json!({"type":"event_msg","payload":{"type":"turn_aborted","turn_id":"T2","reason":"interrupted"}}),
            json!({"type":"event_msg","payload":{"type":"item_completed","turn_id":"T3","item":{"type":"UserMessage","client_id":"r3"}}}),
        ];
        let text: Vec<String> = lines.iter().map(Value::to_string).collect();
        std::fs::write(
            day.join("rollout-2026-12-02T01-00-00-TH.jsonl"),
            text.join("\n"),
        )
        .unwrap();
        assert_eq!(find(d.path(), "TH", "r1").unwrap(), Found::Completed);
        assert_eq!(find(d.path(), "TH", "r2").unwrap(), Found::Aborted);
        assert_eq!(find(d.path(), "TH", "r3").unwrap(), Found::Open);
        assert_eq!(find(d.path(), "TH", "r4").unwrap(), Found::Absent);
        assert_eq!(find(d.path(), "other", "r1").unwrap(), Found::Absent);
    }

    #[test]
    fn each_request_from_the_app_server_gets_the_answer_its_method_takes() {
        let a = |m: &str, accept: bool| answer_to(&json!(7), m, accept);
        assert_eq!(
            a("item/commandExecution/requestApproval", false)["result"]["decision"],
            "decline"
        );
        assert_eq!(
            a("item/fileChange/requestApproval", true)["result"]["decision"],
            "accept"
        );
        assert_eq!(
            a("execCommandApproval", false)["result"]["decision"],
            "denied"
        );
        assert_eq!(
            a("applyPatchApproval", true)["result"]["decision"],
            "approved"
        );
        assert_eq!(
            a("mcpServer/elicitation/request", true)["result"]["action"],
            "decline"
        );
        assert_eq!(a("item/tool/call", true)["error"]["code"], -32601);
        assert_eq!(a("item/tool/call", true)["id"], 7);
    }

    #[test]
    fn a_lock_nobody_holds_has_no_holder() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.lock");
        let f = std::fs::File::create(&p).unwrap();
        assert!(lock_holders_checked(&p).unwrap().is_empty());
        f.lock().unwrap();
        assert_eq!(
            lock_holders_checked(&p).unwrap(),
            vec![i32::try_from(std::process::id()).unwrap()]
        );
        f.unlock().unwrap();
        assert!(lock_holders_checked(&p).unwrap().is_empty());
        assert!(
            lock_holders_checked(&d.path().join("none.lock"))
                .unwrap()
                .is_empty()
        );
    }
}
