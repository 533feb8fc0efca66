//! The claude-code adapter (SPEC §4): one headless `claude -p --resume SESSION` per write, run
//! under `handoffs supervise` like an argv command, so its outcome is recorded durably and
//! survives an engine restart. The user message carries `uuid` = the request id; Claude writes
//! it verbatim into the session's transcript and skips a uuid it already has.
//!
//! What a live session looks like: `$CLAUDE_CONFIG_DIR/sessions/<pid>.json` names the session
//! of every running Claude process (the interactive one also says `idle`/`busy`); a killed
//! process leaves its file behind, so the pid (and its start time) is checked. Two processes
//! resuming one session fork its transcript silently, so a write never goes beside a live
//! process of the session, and one lock per session (in a folder shared by every database of
//! this user) keeps two of our own writes apart.
//!
//! History: `projects/<real folder, every character but letters and digits as '-'>/<session>.jsonl`.
//! A request is found by its uuid; its reply is an assistant entry below it (through
//! attachments and system entries, by `parentUuid`), before the next prompt.

use super::Host;
use super::command;
use super::{Write, doctor};
use crate::store::{AgentRow, RunRow, millis};
use model::states::TurnFailure;
use model::{Activity, Observed, ScanResult, TurnId, WriteOutcome};
use serde_json::{Value, json};
use std::cell::RefCell;
use std::fs::File;
use std::io::BufRead as _;
use std::path::{Path, PathBuf};

/// The session a supervised Claude turn resumes.
#[derive(Debug, Clone)]
pub struct Session {
    pub id: String,
    /// `config_dir` as registered; otherwise Claude's own default applies.
    pub config_dir: Option<PathBuf>,
}

fn setting<'a>(agent: &'a AgentRow, key: &str) -> Option<&'a str> {
    agent.settings.get(key).and_then(Value::as_str)
}

/// The Claude configuration folder an agent's sessions live in: its `config_dir` setting,
/// else `$CLAUDE_CONFIG_DIR`, else `~/.claude`.
pub fn config_dir(configured: Option<&Path>) -> Option<PathBuf> {
    configured
        .map(Path::to_owned)
        .or_else(|| std::env::var_os("CLAUDE_CONFIG_DIR").map(PathBuf::from))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".claude")))
}

fn session_of(agent: &AgentRow) -> Session {
    Session {
        id: agent.endpoint.clone(),
        config_dir: setting(agent, "config_dir").map(PathBuf::from),
    }
}

pub fn check_settings(settings: &Value) -> Result<(), String> {
    for key in ["binary", "config_dir"] {
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
    Ok(())
}

/// `claude -p --resume SESSION`, speaking stream-json both ways.
fn argv(agent: &AgentRow) -> Vec<String> {
    let binary = setting(agent, "binary").unwrap_or("claude");
    [
        binary,
        "-p",
        "--resume",
        &agent.endpoint,
        "--input-format",
        "stream-json",
        "--output-format",
        "stream-json",
        "--replay-user-messages",
        "--verbose",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

// ----- who holds a session -----------------------------------------------------------------

/// A live Claude process that has the session open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub pid: i32,
    /// `cli` for the interactive program, `sdk-cli` for `claude -p`.
    pub entrypoint: String,
    /// The interactive program's `idle` / `busy` / `waiting`.
    pub status: Option<String>,
}

impl Holder {
    fn describe(&self, session: &str) -> String {
        if self.entrypoint == "cli" {
            let status = self.status.as_deref().unwrap_or("status unknown");
            format!(
                "session {session} is open in an interactive session (pid {}, {status})",
                self.pid
            )
        } else {
            format!(
                "another claude process has session {session} open (pid {})",
                self.pid
            )
        }
    }
}

/// Whether `pid` is alive (`kill(pid, 0)`) and, when `proc_start` is given and `/proc` can
/// tell, is still the process that wrote the entry (field 22 of `/proc/<pid>/stat`; a reused
/// pid has another). Where `/proc` cannot tell, a live pid counts as the holder.
fn alive(pid: i32, proc_start: Option<&str>) -> bool {
    use nix::errno::Errno;
    if pid <= 0 {
        return false;
    }
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) {
        Ok(()) | Err(Errno::EPERM) => {}
        Err(_) => return false,
    }
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return true;
    };
    // The command name (field 2) may hold spaces and parentheses: count after the last ')'.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    // fields[0] is field 3 (state); field 22 is fields[19].
    if fields.first().is_some_and(|s| *s == "Z" || *s == "X") {
        return false;
    }
    match (proc_start, fields.get(19)) {
        (Some(start), Some(f)) => *f == start,
        _ => true,
    }
}

/// The live processes the registry names for `session`. A registry that cannot be read, or
/// an entry that stays unreadable, is an error: the session may be held, nobody can tell.
pub fn live_holders(config: &Path, session: &str) -> Result<Vec<Holder>, String> {
    let dir = config.join("sessions");
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("cannot read {}: {e}", dir.display())),
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        // A file being rewritten may be half there: read it again once before giving up.
        let read = || {
            std::fs::read_to_string(&path)
                .ok()
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        };
        let v = match read().or_else(|| {
            std::thread::sleep(std::time::Duration::from_millis(20));
            read()
        }) {
            Some(v) => v,
            // Gone meanwhile: its process ended.
            None if !path.exists() => continue,
            None => return Err(format!("cannot read the session entry {}", path.display())),
        };
        if v.get("sessionId").and_then(Value::as_str) != Some(session) {
            continue;
        }
        let pid = v
            .get("pid")
            .and_then(Value::as_i64)
            .and_then(|p| i32::try_from(p).ok())
            .unwrap_or(0);
        let proc_start = v.get("procStart").and_then(Value::as_str);
        if alive(pid, proc_start) {
            out.push(Holder {
                pid,
                entrypoint: v
                    .get("entrypoint")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned(),
                status: v.get("status").and_then(Value::as_str).map(str::to_owned),
            });
        }
    }
    out.sort_by_key(|h| h.pid);
    Ok(out)
}

/// The folder of session locks: in the Claude configuration folder the session lives in, so
/// every process that could resume the session (any engine, any database, whatever its
/// `$TMPDIR`) sees the same lock. Private to its owner, and refused when someone else owns it
/// or others may write it.
fn locks_dir(config: &Path) -> Result<PathBuf, String> {
    use std::os::unix::fs::DirBuilderExt as _;
    let dir = locks_dir_of(config);
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
    }
    private_dir(&dir)?;
    Ok(dir)
}

fn locks_dir_of(config: &Path) -> PathBuf {
    config.join("handoffs-locks")
}

/// Refuses a lock folder someone else owns or others may write.
fn private_dir(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt as _;
    let uid = nix::unistd::getuid();
    let meta = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if !meta.is_dir() || meta.uid() != uid.as_raw() || meta.mode() & 0o077 != 0 {
        return Err(format!(
            "{} is not a private folder of this user: session locks are not taken there",
            dir.display()
        ));
    }
    Ok(())
}

fn session_lock_path(config: &Path, session: &str) -> Result<PathBuf, String> {
    Ok(locks_dir(config)?.join(lock_name(session)))
}

fn lock_name(session: &str) -> String {
    let safe: String = session
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("claude-{safe}.lock")
}

fn open_session_lock(config: &Path, session: &str) -> Result<File, String> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let path = session_lock_path(config, session)?;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW);
    opts.open(&path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))
}

/// Whether one of our writes holds the session's lock right now (read from `/proc/locks`,
/// never by taking the lock, so a write starting at this moment is not turned away). No lock
/// folder yet: nobody holds a lock. `Err`: nobody can tell (a lock folder that is not
/// private, an unreadable `/proc/locks`), and no write could take the lock either.
fn session_locked(config: &Path, session: &str) -> Result<bool, String> {
    let dir = locks_dir_of(config);
    if !dir.exists() {
        return Ok(false);
    }
    private_dir(&dir)?;
    Ok(!super::codex::lock_holders_checked(&dir.join(lock_name(session)))?.is_empty())
}

/// Why a session could not be taken for a turn: nothing was written either way.
#[derive(Debug)]
pub enum NotClaimed {
    /// Another process has the session now (it took it after the engine's look): the
    /// delivery waits, as for a busy recipient.
    Held(String),
    /// The session cannot be taken at all (no lock folder, no config, an unreadable
    /// registry): a refusal.
    Refused(String),
}

/// Takes the session for one turn, at the moment of writing: its lock, and no live process of
/// it. The lock is held until the returned file is dropped. `Err` says why nothing is written.
pub fn claim(_db: &Path, session: &Session) -> Result<File, NotClaimed> {
    let config = config_dir(session.config_dir.as_deref()).ok_or_else(|| {
        NotClaimed::Refused(
            "no Claude config folder: set config_dir, or CLAUDE_CONFIG_DIR".to_owned(),
        )
    })?;
    let lock = open_session_lock(&config, &session.id).map_err(NotClaimed::Refused)?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            return Err(NotClaimed::Held(format!(
                "another delivery is resuming session {} right now",
                session.id
            )));
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(NotClaimed::Refused(format!("cannot lock the session: {e}")));
        }
    }
    // The planted naive adapter resumes whatever holds the session.
    if crate::planted(crate::Plant::ResumeBesideLive) {
        return Ok(lock);
    }
    match live_holders(&config, &session.id)
        .map_err(NotClaimed::Refused)?
        .first()
    {
        Some(h) => Err(NotClaimed::Held(h.describe(&session.id))),
        None => Ok(lock),
    }
}

// ----- the supervised turn -------------------------------------------------------------------

/// Pipes for the turn, and the configuration folder the agent was registered with.
pub fn prepare_command(cmd: &mut tokio::process::Command, session: &Session) {
    cmd.stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        // The prompt is in the transcript before the model is asked (history scans rely on it).
        .env("CLAUDE_CODE_EAGER_FLUSH", "1");
    if let Some(dir) = &session.config_dir {
        cmd.env("CLAUDE_CONFIG_DIR", dir);
    }
}

/// Test builds only (`planted-bugs`): `HANDOFFS_TEST_SUPERVISOR_DIES_AFTER_WRITE=1` kills the
/// supervisor right after it gave Claude the message, before the turn reports its start: the
/// answer to the write is lost, and Claude goes on alone.
fn supervisor_dies_after_write() -> bool {
    cfg!(feature = "planted-bugs")
        && std::env::var_os("HANDOFFS_TEST_SUPERVISOR_DIES_AFTER_WRITE").is_some()
}

/// What one `claude -p` run said.
#[derive(Debug, Default)]
pub struct Turn {
    /// The `system/init` line: the turn began.
    pub started: bool,
    /// Our message echoed back (`--replay-user-messages`).
    pub replayed: bool,
    /// The one `result` line.
    pub result: Option<Value>,
    /// The exit code, or the signal that ended it.
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub error: Option<String>,
}

/// Writes the message (one stream-json line, uuid = request id), closes stdin, and reads every
/// line Claude prints until it exits; each line is kept in the run's log.
pub async fn converse(
    child: &mut tokio::process::Child,
    text: &str,
    request_id: &str,
    log: &Path,
    began: &mut dyn FnMut(),
) -> Turn {
    use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _};
    let mut turn = Turn::default();
    let line = json!({
        "type": "user",
        "message": {"role": "user", "content": text},
        "uuid": request_id,
    });
    if let Some(mut stdin) = child.stdin.take() {
        let mut bytes = line.to_string().into_bytes();
        bytes.push(b'\n');
        if let Err(e) = stdin.write_all(&bytes).await {
            turn.error = Some(format!("could not write the message: {e}"));
        }
        drop(stdin);
    }
    if supervisor_dies_after_write() {
        // As a SIGKILL would leave it: the message given, the start never reported.
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    }
    let mut kept = std::fs::OpenOptions::new().append(true).open(log).ok();
    if let Some(stdout) = child.stdout.take() {
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        while let Ok(Some(l)) = lines.next_line().await {
            if let Some(f) = kept.as_mut() {
                use std::io::Write as _;
                let _ = writeln!(f, "{l}");
            }
            let Ok(v) = serde_json::from_str::<Value>(&l) else {
                continue;
            };
            match (
                v.get("type").and_then(Value::as_str),
                v.get("subtype").and_then(Value::as_str),
            ) {
                (Some("system"), Some("init")) => {
                    if !turn.started {
                        began();
                    }
                    turn.started = true;
                }
                (Some("user"), _) if v.get("uuid").and_then(Value::as_str) == Some(request_id) => {
                    turn.replayed = true;
                }
                (Some("result"), _) => turn.result = Some(v),
                _ => {}
            }
        }
    }
    match child.wait().await {
        Ok(status) => {
            use std::os::unix::process::ExitStatusExt as _;
            turn.code = status.code();
            turn.signal = status.signal();
        }
        Err(e) => turn.error = Some(format!("wait failed: {e}")),
    }
    turn
}

/// The run's outcome (`returned`, `errored`, `interrupted`, `refused`) from what Claude said.
pub fn outcome(
    session: &Session,
    cwd: &str,
    request_id: &str,
    turn: &Turn,
) -> (Option<i64>, String, Option<String>) {
    let code = turn.code.map(i64::from);
    if let Some(r) = &turn.result {
        let is_error = r.get("is_error").and_then(Value::as_bool).unwrap_or(true);
        if !is_error {
            return (code, "returned".to_owned(), None);
        }
        let errors: Vec<&str> = r
            .get("errors")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if errors.iter().any(|e| e.contains("No conversation found")) {
            // Nothing was written: the session is not in this folder.
            return (
                code,
                "refused".to_owned(),
                Some(format!(
                    "no conversation {} in {cwd} (a session resumes only in its own folder)",
                    session.id
                )),
            );
        }
        if r.get("terminal_reason").and_then(Value::as_str) == Some("aborted_streaming") {
            return (
                code,
                "interrupted".to_owned(),
                Some("the turn was interrupted".to_owned()),
            );
        }
        let text = r
            .get("result")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .or_else(|| errors.first().map(|e| (*e).to_owned()))
            .unwrap_or_else(|| "an error".to_owned());
        return (code, "errored".to_owned(), Some(preview(&text)));
    }
    if turn.replayed && !turn.started && turn.code == Some(0) {
        // Claude skipped a uuid its transcript already has: this request was written before.
        // What became of it is in the transcript.
        return match transcript_of(session, cwd).map(|p| find(&p, request_id)) {
            Some(Ok(Found::Reply)) => (
                code,
                "returned".to_owned(),
                Some("written before; its reply is in the transcript".to_owned()),
            ),
            Some(Ok(Found::ApiError(e))) => (code, "errored".to_owned(), Some(preview(&e))),
            _ => (
                code,
                "interrupted".to_owned(),
                Some("written before, without a reply".to_owned()),
            ),
        };
    }
    if !turn.started {
        // It ended before the turn began (a bad flag, a broken configuration, not logged
        // in): nothing was written; what it said is in the run's log.
        let how = match (turn.signal, turn.code) {
            (Some(sig), _) => format!("was killed by signal {sig}"),
            (None, Some(c)) => format!("exited with {c}"),
            (None, None) => "ended".to_owned(),
        };
        return (
            code,
            "refused".to_owned(),
            Some(turn.error.clone().unwrap_or_else(|| {
                format!("claude {how} before the turn began (its output is in the run's log)")
            })),
        );
    }
    // Killed (SIGKILL), or ended by a signal it handled (143 after SIGTERM): interrupted.
    if let Some(sig) = turn
        .signal
        .or_else(|| turn.code.filter(|c| *c > 128).map(|c| c - 128))
    {
        return (
            code,
            "interrupted".to_owned(),
            Some(format!("claude was stopped by signal {sig}")),
        );
    }
    (
        code,
        "errored".to_owned(),
        Some(match (&turn.error, turn.code) {
            (Some(e), _) => e.clone(),
            (None, Some(c)) => format!("claude exited with {c} without a result"),
            (None, None) => "claude ended without a result".to_owned(),
        }),
    )
}

fn preview(text: &str) -> String {
    crate::text::one_line(text, 200)
}

// ----- the transcript ------------------------------------------------------------------------

/// What the transcript says of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// No entry with its uuid.
    Absent,
    /// The prompt is there and an assistant answered it.
    Reply,
    /// The prompt is there and the API failed (Claude wrote its error as the answer).
    ApiError(String),
    /// The prompt is there, with no answer (yet, or ever).
    NoReply,
}

/// The session's transcript file.
pub(crate) fn transcript_path(session: &Session, cwd: &str) -> Option<PathBuf> {
    transcript_of(session, cwd)
}

fn transcript_of(session: &Session, cwd: &str) -> Option<PathBuf> {
    let config = config_dir(session.config_dir.as_deref())?;
    Some(doctor::transcript_path(
        &config,
        Path::new(cwd),
        &session.id,
    ))
}

/// Searches a transcript for `request_id`. An unreadable transcript is an error (the search is
/// not complete); a missing one holds nothing.
pub fn find(path: &Path, request_id: &str) -> Result<Found, String> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Found::Absent),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let mut below: std::collections::HashSet<String> = std::collections::HashSet::new();
    let mut found = false;
    // By bytes: one line that is not UTF-8 is skipped, not the end of the search.
    let needle = request_id.as_bytes();
    for line in std::io::BufReader::new(file).split(b'\n') {
        let line = line.map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        // Cheap first: most lines are not about our request.
        if !found && !line.windows(needle.len().max(1)).any(|w| w == needle) {
            continue;
        }
        let Ok(v) = serde_json::from_slice::<Value>(&line) else {
            continue;
        };
        let kind = v.get("type").and_then(Value::as_str).unwrap_or("");
        let uuid = v.get("uuid").and_then(Value::as_str).unwrap_or("");
        if !found {
            // Our prompt: the user entry we wrote with the request id as its uuid, or a card
            // pushed through a channel, which names the request id in its text.
            if kind == "user" && (uuid == request_id || prompt_names(&v, request_id)) {
                found = true;
                below.insert(uuid.to_owned());
            }
            continue;
        }
        let parent = v.get("parentUuid").and_then(Value::as_str).unwrap_or("");
        if !below.contains(parent) {
            continue;
        }
        match kind {
            "assistant" => {
                let api_error = v
                    .get("isApiErrorMessage")
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                let text = v["message"]["content"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|b| b.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join(" ");
                if api_error {
                    return Ok(Found::ApiError(text));
                }
                // A later resume answers a prompt left without a reply for the model with a
                // synthetic "No response requested.": that is not a reply (and a real one
                // may still follow on another branch of a forked transcript).
                if v["message"]["model"].as_str() == Some("<synthetic>") {
                    continue;
                }
                // A tool call is the middle of the turn, not its answer: the turn goes on
                // below it (the tool's result, the next assistant entry).
                let calls_a_tool = v["message"]["stop_reason"] == "tool_use"
                    || v["message"]["content"].as_array().is_some_and(|a| {
                        a.iter()
                            .any(|b| b.get("type").and_then(Value::as_str) == Some("tool_use"))
                    });
                if calls_a_tool {
                    below.insert(uuid.to_owned());
                    continue;
                }
                return Ok(Found::Reply);
            }
            // A prompt below ours is not part of our turn.
            "user" if v.get("toolUseResult").is_none() && !is_tool_result(&v) => {}
            _ => {
                below.insert(uuid.to_owned());
            }
        }
    }
    Ok(if found { Found::NoReply } else { Found::Absent })
}

/// Whether a user entry's text (not a tool's result) names `request_id`.
fn prompt_names(v: &Value, request_id: &str) -> bool {
    if v.get("toolUseResult").is_some() || is_tool_result(v) {
        return false;
    }
    let content = &v["message"]["content"];
    content.as_str().is_some_and(|t| t.contains(request_id))
        || content.as_array().is_some_and(|a| {
            a.iter().any(|b| {
                b.get("text")
                    .and_then(Value::as_str)
                    .is_some_and(|t| t.contains(request_id))
            })
        })
}

fn is_tool_result(v: &Value) -> bool {
    v["message"]["content"].as_array().is_some_and(|a| {
        a.iter()
            .any(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"))
    })
}

/// What the transcript says of a run whose supervisor and process are both gone.
fn gone_outcome(session: &Session, cwd: &str, run: &RunRow) -> (String, String) {
    let found = transcript_of(session, cwd).map(|p| find(&p, &run.request_id));
    if run.pid.is_none() && matches!(found, Some(Ok(Found::Absent))) {
        // Gone before the turn began, and the prompt is not in the transcript.
        return (
            "refused".to_owned(),
            "its supervisor was gone before the turn began; nothing was written".to_owned(),
        );
    }
    match found {
        Some(Ok(Found::Reply)) => (
            "returned".to_owned(),
            "its supervisor was gone; the reply is in the transcript".to_owned(),
        ),
        Some(Ok(Found::ApiError(e))) => ("errored".to_owned(), preview(&e)),
        _ => (
            "interrupted".to_owned(),
            "its supervisor was gone and the transcript has no reply".to_owned(),
        ),
    }
}

/// Whether an open run still goes: a channel card by the channel's rules, a headless resume
/// by its supervisor, else by the transcript. A run that is over is recorded.
fn still_going(
    store: &mut crate::store::Store,
    db: &Path,
    session: &Session,
    cwd: &str,
    run: &RunRow,
    now: i64,
) -> bool {
    super::channel::still_going(store, db, session, cwd, run, now).unwrap_or_else(|| {
        command::still_running_or(store, db, run, now, |r| gone_outcome(session, cwd, r))
    })
}

fn observed_of_found(found: &Found, turn: TurnId, live: bool) -> Observed {
    match found {
        Found::Absent => Observed::NotFound,
        Found::Reply => Observed::Returned { turn },
        Found::ApiError(_) => Observed::Failed {
            turn,
            failure: TurnFailure::Errored,
            turn_open: false,
        },
        Found::NoReply if live => Observed::Running { turn },
        Found::NoReply => Observed::Failed {
            turn,
            failure: TurnFailure::Interrupted,
            turn_open: false,
        },
    }
}

// ----- the four questions --------------------------------------------------------------------

pub fn activity(service: &RefCell<dyn Host>, agent: &AgentRow) -> Activity {
    let session = session_of(agent);
    let mut service = service.borrow_mut();
    let db = service.db().to_owned();
    let now = millis(service.now());
    let open = match service.runs().open_runs_for(&agent.id) {
        Ok(runs) => runs,
        Err(e) => {
            return Activity::Unknown {
                detail: e.to_string(),
            };
        }
    };
    for run in open {
        if still_going(service.runs(), &db, &session, &agent.cwd, &run, now) {
            return Activity::Busy {
                turn: Some(TurnId::new(&run.request_id)),
                detail: None,
            };
        }
    }
    if session.id.is_empty() {
        return Activity::Unknown {
            detail: "no session id: register the Claude session with --endpoint".to_owned(),
        };
    }
    if agent.cwd.is_empty() || !Path::new(&agent.cwd).is_dir() {
        return Activity::Unknown {
            detail: format!(
                "the session's folder {:?} is not there (a session resumes only in its own folder)",
                agent.cwd
            ),
        };
    }
    let Some(config) = config_dir(session.config_dir.as_deref()) else {
        return Activity::Unknown {
            detail: "no Claude config folder: set config_dir, or CLAUDE_CONFIG_DIR".to_owned(),
        };
    };
    match session_locked(&config, &session.id) {
        Ok(false) => {}
        Ok(true) => {
            return Activity::Busy {
                turn: None,
                detail: Some(format!(
                    "another delivery is resuming session {}",
                    session.id
                )),
            };
        }
        Err(detail) => return Activity::Unknown { detail },
    }
    if crate::planted(crate::Plant::ResumeBesideLive) {
        return Activity::Idle;
    }
    match live_holders(&config, &session.id) {
        Ok(holders) => match holders.first() {
            // The person's interactive session, with a handoffs channel open in it: written
            // to (through the channel) when it says it is idle.
            Some(h) if holders.len() == 1 && h.entrypoint == "cli" => {
                if super::channel::live_channel(service.runs(), &db, agent, &holders).is_none() {
                    return Activity::Busy {
                        turn: None,
                        detail: Some(format!(
                            "{}; no handoffs channel is open in it (start its `handoffs mcp` with --channels)",
                            h.describe(&session.id)
                        )),
                    };
                }
                if h.status.as_deref() == Some("idle") {
                    Activity::Idle
                } else {
                    Activity::Busy {
                        turn: None,
                        detail: Some(h.describe(&session.id)),
                    }
                }
            }
            Some(h) => Activity::Busy {
                turn: None,
                detail: Some(h.describe(&session.id)),
            },
            None => Activity::Idle,
        },
        Err(detail) => Activity::Unknown { detail },
    }
}

/// Why the interactive Claude `claude_pid` holding the agent's session is not idle now, if
/// its registry entry says so (a channel card it did not take: it turned busy meanwhile).
pub(crate) fn holder_busy(agent: &AgentRow, claude_pid: i64) -> Option<String> {
    let session = session_of(agent);
    let config = config_dir(session.config_dir.as_deref())?;
    let holders = live_holders(&config, &session.id).ok()?;
    holders
        .iter()
        .find(|h| i64::from(h.pid) == claude_pid)
        .filter(|h| h.status.as_deref().is_some_and(|s| s != "idle"))
        .map(|h| h.describe(&session.id))
}

/// The channel to write through: the session is open in one interactive Claude process with
/// a live handoffs channel in it. `Err` when it is so open but not idle now (the send
/// boundary's re-check: nothing is written).
fn channel_now(
    service: &RefCell<dyn Host>,
    agent: &AgentRow,
    session: &Session,
) -> Result<Option<crate::store::ChannelRow>, String> {
    let Some(config) = config_dir(session.config_dir.as_deref()) else {
        return Ok(None);
    };
    let Ok(holders) = live_holders(&config, &session.id) else {
        return Ok(None);
    };
    if holders.len() != 1 {
        return Ok(None);
    }
    let mut s = service.borrow_mut();
    let db = s.db().to_owned();
    match super::channel::live_channel(s.runs(), &db, agent, &holders) {
        Some((c, h)) if h.status.as_deref() == Some("idle") => Ok(Some(c)),
        Some((_, h)) => Err(h.describe(&session.id)),
        None => Ok(None),
    }
}

pub async fn start(service: &RefCell<dyn Host>, w: &Write<'_>) -> WriteOutcome {
    if w.agent.endpoint.is_empty() {
        return WriteOutcome::Refused {
            detail: "no session id: register the Claude session with --endpoint".to_owned(),
        };
    }
    if w.agent.cwd.is_empty() {
        return WriteOutcome::Refused {
            detail: "no folder: a Claude session resumes only in its own folder (--cwd)".to_owned(),
        };
    }
    let session = session_of(w.agent);
    if !crate::planted(crate::Plant::ResumeBesideLive) {
        match channel_now(service, w.agent, &session) {
            Ok(Some(channel)) => return super::channel::write(service, w, &channel).await,
            // The person's session is busy now (it was idle at the engine's look): wait.
            Err(detail) => return WriteOutcome::Busy { detail },
            Ok(None) => {}
        }
    }
    let mut extra = vec!["--claude-session".to_owned(), session.id.clone()];
    if let Some(dir) = &session.config_dir {
        extra.push("--claude-config-dir".to_owned());
        extra.push(dir.to_string_lossy().into_owned());
    }
    command::start_supervised(service, w, argv(w.agent), &extra).await
}

/// The run's record first (complete for every write of ours), then the transcript.
pub fn observe(service: &RefCell<dyn Host>, agent: &AgentRow, request_id: &str) -> Observed {
    let session = session_of(agent);
    let mut service = service.borrow_mut();
    let db = service.db().to_owned();
    let now = millis(service.now());
    let turn = TurnId::new(request_id);
    match service.runs().run(request_id) {
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
            if still_going(service.runs(), &db, &session, &agent.cwd, &run, now) {
                return command::observed_of(&run, true);
            }
            match service.runs().run(request_id) {
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
        Ok(None) => match transcript_of(&session, &agent.cwd).map(|p| find(&p, request_id)) {
            Some(Ok(found)) => observed_of_found(&found, turn, false),
            Some(Err(detail)) => Observed::Unreachable { detail },
            None => Observed::Unreachable {
                detail: "no Claude config folder".to_owned(),
            },
        },
        Err(e) => Observed::Unreachable {
            detail: e.to_string(),
        },
    }
}

pub fn scan(service: &RefCell<dyn Host>, agent: &AgentRow, request_id: &str) -> ScanResult {
    let refused_or_none = {
        let mut s = service.borrow_mut();
        match s.runs().run(request_id) {
            Ok(Some(run)) => super::command::wrote_nothing(run.outcome.as_deref()),
            Ok(None) => true,
            Err(_) => return ScanResult::NothingFound { complete: false },
        }
    };
    if !refused_or_none {
        return match observe(service, agent, request_id) {
            Observed::Unreachable { .. } => ScanResult::NothingFound { complete: false },
            observed => ScanResult::Found { observed },
        };
    }
    let db = service.borrow().db().to_owned();
    if command::run_may_start(&db, request_id) {
        return ScanResult::NothingFound { complete: false };
    }
    let session = session_of(agent);
    match transcript_of(&session, &agent.cwd).map(|p| find(&p, request_id)) {
        Some(Ok(Found::Absent)) => ScanResult::NothingFound { complete: true },
        Some(Ok(found)) => ScanResult::Found {
            observed: observed_of_found(&found, TurnId::new(request_id), false),
        },
        _ => ScanResult::NothingFound { complete: false },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, lines: &[Value]) -> PathBuf {
        let p = dir.join("t.jsonl");
        let text: Vec<String> = lines.iter().map(Value::to_string).collect();
        std::fs::write(&p, text.join("\n") + "\n").unwrap();
        p
    }

    #[test]
    fn a_reply_is_found_below_its_prompt_through_attachments() {
        let d = tempfile::tempdir().unwrap();
        let p = write(
            d.path(),
            &[
                json!({"type":"user","uuid":"a","parentUuid":null,"message":{"content":"x"}}),
                json!({"type":"user","uuid":"req-1","parentUuid":"a","message":{"content":"hi"}}),
                json!({"type":"attachment","uuid":"att","parentUuid":"req-1"}),
                json!({"type":"assistant","uuid":"r","parentUuid":"att","message":{"model":"m","content":[{"type":"text","text":"ok"}]}}),
            ],
        );
        assert_eq!(find(&p, "req-1").unwrap(), Found::Reply);
        assert_eq!(find(&p, "req-2").unwrap(), Found::Absent);
        assert_eq!(
            find(&d.path().join("none.jsonl"), "req-1").unwrap(),
            Found::Absent
        );
    }

    #[test]
    fn a_prompt_without_a_reply_or_with_a_synthetic_one_has_none() {
        let d = tempfile::tempdir().unwrap();
        let p = write(
            d.path(),
            &[
                json!({"type":"user","uuid":"req-1","parentUuid":null,"message":{"content":"hi"}}),
                json!({"type":"assistant","uuid":"s","parentUuid":"req-1","message":{"model":"<synthetic>","content":[{"type":"text","text":"No response requested."}]}}),
                json!({"type":"user","uuid":"req-2","parentUuid":"s","message":{"content":"next"}}),
                json!({"type":"assistant","uuid":"e","parentUuid":"req-2","isApiErrorMessage":true,"message":{"model":"<synthetic>","content":[{"type":"text","text":"API Error: 500"}]}}),
                json!({"type":"user","uuid":"req-3","parentUuid":"e","message":{"content":"last"}}),
            ],
        );
        assert_eq!(find(&p, "req-1").unwrap(), Found::NoReply);
        assert_eq!(
            find(&p, "req-2").unwrap(),
            Found::ApiError("API Error: 500".to_owned())
        );
        assert_eq!(find(&p, "req-3").unwrap(), Found::NoReply);
    }

    #[test]
    fn a_turn_cut_after_a_tool_call_has_no_reply_yet() {
        let d = tempfile::tempdir().unwrap();
        let p = write(
            d.path(),
            &[
                json!({"type":"user","uuid":"req-1","parentUuid":null,"message":{"content":"hi"}}),
                json!({"type":"assistant","uuid":"t","parentUuid":"req-1","message":{"model":"m","stop_reason":"tool_use","content":[{"type":"text","text":"let me look"},{"type":"tool_use","id":"tu","name":"Read","input":{}}]}}),
                json!({"type":"user","uuid":"tr","parentUuid":"t","message":{"content":[{"type":"tool_result","tool_use_id":"tu","content":"x"}]}}),
            ],
        );
        assert_eq!(find(&p, "req-1").unwrap(), Found::NoReply);
        let mut text = std::fs::read_to_string(&p).unwrap();
        text.push_str(
            &(json!({"type":"assistant","uuid":"a","parentUuid":"tr","message":{"model":"m","stop_reason":"end_turn","content":[{"type":"text","text":"done"}]}})
                .to_string()
                + "\n"),
        );
        std::fs::write(&p, text).unwrap();
        assert_eq!(find(&p, "req-1").unwrap(), Found::Reply);
    }

    #[test]
    fn a_forked_transcript_keeps_each_reply_with_its_prompt() {
        let d = tempfile::tempdir().unwrap();
        let p = write(
            d.path(),
            &[
                json!({"type":"user","uuid":"A","parentUuid":"leaf","message":{"content":"a"}}),
                json!({"type":"user","uuid":"B","parentUuid":"leaf","message":{"content":"b"}}),
                json!({"type":"assistant","uuid":"rb","parentUuid":"B","message":{"model":"m","content":[]}}),
                // A resume beside A's live turn: a synthetic answer below A, then A's real one.
                json!({"type":"user","uuid":"C","parentUuid":"leaf2","message":{"content":"c"}}),
                json!({"type":"assistant","uuid":"sc","parentUuid":"C","message":{"model":"<synthetic>","content":[]}}),
                json!({"type":"user","uuid":"D","parentUuid":"sc","message":{"content":"d"}}),
                json!({"type":"assistant","uuid":"rc","parentUuid":"C","message":{"model":"m","content":[]}}),
            ],
        );
        assert_eq!(find(&p, "A").unwrap(), Found::NoReply);
        assert_eq!(find(&p, "B").unwrap(), Found::Reply);
        assert_eq!(find(&p, "C").unwrap(), Found::Reply);
        assert_eq!(find(&p, "D").unwrap(), Found::NoReply);
    }

    #[test]
    fn a_dead_or_reused_pid_holds_nothing() {
        let d = tempfile::tempdir().unwrap();
        let sessions = d.path().join("sessions");
        std::fs::create_dir_all(&sessions).unwrap();
        let me = std::process::id();
        std::fs::write(
            sessions.join("1.json"),
            json!({"pid": me, "sessionId": "S", "entrypoint": "cli", "status": "idle"}).to_string(),
        )
        .unwrap();
        std::fs::write(
            sessions.join("2.json"),
            json!({"pid": me, "sessionId": "S", "procStart": "1", "entrypoint": "sdk-cli"})
                .to_string(),
        )
        .unwrap();
        std::fs::write(
            sessions.join("3.json"),
            json!({"pid": 999_999_999, "sessionId": "S"}).to_string(),
        )
        .unwrap();
        let holders = live_holders(d.path(), "S").unwrap();
        assert_eq!(holders.len(), 1, "{holders:?}");
        assert_eq!(holders[0].entrypoint, "cli");
        assert!(live_holders(d.path(), "other").unwrap().is_empty());
        assert!(
            live_holders(&d.path().join("nothing"), "S")
                .unwrap()
                .is_empty()
        );
    }
}
