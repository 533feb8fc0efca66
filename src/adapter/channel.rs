//! Claude Code channels (SPEC §4, research preview): a `handoffs mcp --agent ID --channels`
//! server that Claude Code started inside a person's interactive session declares the
//! experimental `claude/channel` capability and pushes each card it is given as a
//! `notifications/claude/channel` event, which Claude shows in that session as a new prompt.
//! This is how a handoff reaches a session that is open interactively, where a headless
//! `--resume` beside it would fork the transcript.
//!
//! Both halves meet in the database. The listener registers itself (`channels`: its pid, the
//! session its parent Claude process has open, that process's pid) and holds a lock file for
//! as long as it lives. A write to the session is a run (as for every Claude write) plus a
//! card (`channel_pushes`) addressed to a live listener; the listener takes the card in a
//! commit (which records the receipt) before it sends a byte, so a card is pushed at most
//! once, and a card nobody took can be taken back: then nothing was written. The turn is
//! observed through the transcript (the prompt that names the request id, and the reply
//! below it).

use super::Host;
use super::claude::{self, Found, Holder, Session};
use super::command;
use crate::store::{AgentRow, ChannelRow, PushRow, RunRow, Store, millis};
use model::{RequestId, TurnId, WriteOutcome};
use serde_json::{Value, json};
use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The notification method Claude Code listens for.
pub const METHOD: &str = "notifications/claude/channel";

/// How long a write waits for the listener to take its card.
const TAKE_WAIT: Duration = Duration::from_secs(10);

/// How long after it was queued a card nobody took is taken back, whoever looks.
const UNTAKEN_LIMIT_MS: i64 = 30_000;

/// How long after a push an idle session may go without the card's prompt in its transcript
/// before the card counts as never shown.
const NOT_SHOWN_MS: i64 = 120_000;

fn lock_name(pid: i64) -> String {
    format!("channel-{pid}")
}

/// Whether the listener `pid` is alive (it holds its lock file).
pub fn listener_alive(db: &Path, pid: i64) -> bool {
    command::supervisor_alive(db, &lock_name(pid))
}

/// A live listener in an interactive Claude process that holds the session: the channel a
/// card for this agent goes through, and that holder.
pub fn live_channel(
    store: &mut Store,
    db: &Path,
    agent: &AgentRow,
    holders: &[Holder],
) -> Option<(ChannelRow, Holder)> {
    let channels = store.channels_for(&agent.id, &agent.endpoint).ok()?;
    channels.into_iter().find_map(|c| {
        let holder = holders
            .iter()
            .find(|h| i64::from(h.pid) == c.claude_pid && h.entrypoint == "cli")?;
        listener_alive(db, c.pid).then(|| (c, holder.clone()))
    })
}

/// Writes one card through `channel`: a run and its card in one commit, then the listener's
/// take (the receipt). A card not taken in time is taken back: a refusal, nothing written.
pub async fn write(
    service: &RefCell<dyn Host>,
    w: &super::Write<'_>,
    channel: &ChannelRow,
) -> WriteOutcome {
    super::codex::hold_before_open(w.request_id).await;
    let (db, now) = {
        let s = service.borrow();
        (s.db().to_owned(), millis(s.now()))
    };
    let timeout_ms = i64::try_from(
        w.agent
            .settings
            .get("timeout")
            .and_then(Value::as_u64)
            .unwrap_or(command::RUN_TIMEOUT_SECS_DEFAULT)
            .saturating_mul(1_000),
    )
    .unwrap_or(i64::MAX);
    let run = RunRow {
        request_id: w.request_id.to_owned(),
        message_id: w.message.id.clone(),
        agent: w.agent.id.clone(),
        pid: None,
        started_at: now,
        ends_at: Some(now.saturating_add(timeout_ms)),
        ended_at: None,
        exit_code: None,
        outcome: None,
        detail: None,
    };
    let meta = json!({
        "request_id": w.request_id,
        "message": w.message.id,
        "from": w.message.sender,
        "kind": w.message.kind,
    });
    let push = PushRow {
        request_id: w.request_id.to_owned(),
        listener: channel.pid,
        session: channel.session.clone(),
        claude_pid: channel.claude_pid,
        content: w.text.to_owned(),
        meta: meta.to_string(),
        created_at: now,
        pushed_at: None,
    };
    // A retry after a refusal keeps its request id: the refused run (nothing was written)
    // makes way for it.
    let queued = service.borrow_mut().runs().queue_push(&run, &push);
    if let Err(e) = queued {
        return WriteOutcome::Refused {
            detail: format!("the card was not queued for the channel: {e}"),
        };
    }
    let started = tokio::time::Instant::now();
    loop {
        let taken = service
            .borrow_mut()
            .runs()
            .push(w.request_id)
            .map(|p| p.and_then(|p| p.pushed_at));
        match taken {
            Ok(Some(_)) => {
                return WriteOutcome::Receipt {
                    turn: TurnId::new(w.request_id),
                    request_id: Some(RequestId::new(w.request_id)),
                };
            }
            Ok(None) => {}
            Err(e) => {
                return WriteOutcome::Failed {
                    detail: e.to_string(),
                };
            }
        }
        if started.elapsed() > TAKE_WAIT || !listener_alive(&db, channel.pid) {
            // Its Claude turned busy after the engine's look: busy at the write, no refusal.
            let busy = listener_alive(&db, channel.pid)
                .then(|| claude::holder_busy(w.agent, channel.claude_pid))
                .flatten();
            return take_back(service, w.request_id, channel.pid, busy.as_deref());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Takes back a card its listener did not take: a refusal (nothing written), or busy at the
/// write when its Claude turned busy meanwhile (`busy`); a receipt when it was taken meanwhile.
fn take_back(
    service: &RefCell<dyn Host>,
    request_id: &str,
    listener: i64,
    busy: Option<&str>,
) -> WriteOutcome {
    let mut s = service.borrow_mut();
    let now = millis(s.now());
    let detail = match &busy {
        Some(why) => format!("{why}; the card was taken back, nothing was written"),
        None => format!(
            "the channel (handoffs mcp, pid {listener}) did not take the card; nothing was written"
        ),
    };
    let outcome = if busy.is_some() {
        command::HELD
    } else {
        "refused"
    };
    let withdrawn = s
        .runs()
        .withdraw_push_and_finish(request_id, now, outcome, &detail);
    match withdrawn {
        Ok(true) if busy.is_some() => WriteOutcome::Busy { detail },
        Ok(true) => WriteOutcome::Refused { detail },
        // Not there to take back: taken (a receipt), or taken back by another look (refused).
        Ok(false) => match s.runs().push(request_id) {
            Ok(Some(p)) if p.pushed_at.is_some() => WriteOutcome::Receipt {
                turn: TurnId::new(request_id),
                request_id: Some(RequestId::new(request_id)),
            },
            Ok(_) => WriteOutcome::Refused { detail },
            Err(e) => WriteOutcome::Failed {
                detail: e.to_string(),
            },
        },
        Err(e) => WriteOutcome::Failed {
            detail: e.to_string(),
        },
    }
}

/// Where a channel run stands when nobody watches it: `None` while it is not over (the card
/// waits for a live listener, or its turn has no reply yet in a live session), else its
/// outcome and why. A card nobody can take any more is taken back.
pub fn run_over(
    store: &mut Store,
    db: &Path,
    session: &Session,
    cwd: &str,
    run: &RunRow,
    push: &PushRow,
    now: i64,
) -> Option<(String, String)> {
    if push.pushed_at.is_none() {
        // Not taken yet: the write takes it back after TAKE_WAIT; an engine that died before
        // that leaves it to this look, once the listener had its time.
        let waited = now.saturating_sub(push.created_at) > UNTAKEN_LIMIT_MS;
        if listener_alive(db, push.listener) && !waited {
            return None;
        }
        if store.withdraw_push(&push.request_id).unwrap_or(false) {
            return Some((
                "refused".to_owned(),
                "the channel closed before it took the card; nothing was written".to_owned(),
            ));
        }
    }
    let found = claude::transcript_path(session, cwd).map(|p| claude::find(&p, &run.request_id));
    // The Claude process the card went to, while it still has the session open (a registry
    // nobody can read says nothing: it counts as open).
    let holders = claude::config_dir(session.config_dir.as_deref())
        .map(|config| claude::live_holders(&config, &session.id));
    let holder = match &holders {
        Some(Ok(hs)) => hs
            .iter()
            .find(|h| i64::from(h.pid) == push.claude_pid)
            .cloned(),
        Some(Err(_)) => Some(Holder {
            pid: i32::try_from(push.claude_pid).unwrap_or(0),
            entrypoint: "cli".to_owned(),
            status: None,
        }),
        None => None,
    };
    let busy = holder
        .as_ref()
        .is_some_and(|h| h.status.as_deref() != Some("idle"));
    match found {
        // A reply, and the session is done with the turn (a text before a tool call is the
        // middle of the turn, and the interactive session says busy until it ends).
        Some(Ok(Found::Reply)) if !busy => {
            return Some((
                "returned".to_owned(),
                "the reply is in the session's transcript".to_owned(),
            ));
        }
        Some(Ok(Found::ApiError(e))) if !busy => return Some(("errored".to_owned(), e)),
        _ => {}
    }
    if run.ends_at.is_some_and(|end| now > end) {
        return Some((
            "errored".to_owned(),
            "no reply in the session within the agent's timeout (the person's session was left alone)"
                .to_owned(),
        ));
    }
    let Some(holder) = holder else {
        return Some((
            "interrupted".to_owned(),
            "the interactive session closed before its reply".to_owned(),
        ));
    };
    // Pushed, but Claude never showed it (channels off, no claude.ai login, or a Claude
    // started without --dangerously-load-development-channels): no prompt names the request
    // while the session sits idle.
    // A transcript nobody can read says nothing either way; one that changed lately may be
    // about to show it (Claude shows a card once the person's turn ends).
    let quiet = claude::transcript_path(session, cwd)
        .and_then(|p| std::fs::metadata(p).ok())
        .and_then(|m| m.modified().ok())
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .and_then(|d| i64::try_from(d.as_millis()).ok())
        .is_none_or(|changed| now > changed.saturating_add(NOT_SHOWN_MS));
    let not_shown = matches!(found, Some(Ok(Found::Absent))) && quiet;
    if not_shown
        && holder.status.as_deref() == Some("idle")
        && push
            .pushed_at
            .is_some_and(|at| now > at.saturating_add(NOT_SHOWN_MS))
    {
        return Some((
            "errored".to_owned(),
            format!(
                "Claude did not show the card within {}s (is the session started with channels enabled?)",
                NOT_SHOWN_MS / 1_000
            ),
        ));
    }
    None
}

/// Whether an open run is a channel write still going; `None` when it is not a channel write
/// (the supervised path judges it). A channel write that is over is recorded.
pub fn still_going(
    store: &mut Store,
    db: &Path,
    session: &Session,
    cwd: &str,
    run: &RunRow,
    now: i64,
) -> Option<bool> {
    let push = store.push(&run.request_id).ok().flatten()?;
    match run_over(store, db, session, cwd, run, &push, now) {
        None => Some(true),
        Some((outcome, detail)) => {
            let _ = store.finish_run(&run.request_id, now, None, &outcome, Some(&detail));
            Some(false)
        }
    }
}

// ----- the listener (inside `handoffs mcp --channels`) -------------------------------------

/// The listener's side: registered for the session its parent Claude process has open, and
/// holding its lock file while it lives.
#[derive(Debug)]
pub struct Listener {
    db: PathBuf,
    agent: String,
    pid: i64,
    parent: i32,
    config: Option<PathBuf>,
    session: Option<String>,
    store: Store,
    _lock: std::fs::File,
}

impl Listener {
    /// Takes the listener's lock for `agent`; the session is looked up (and registered) by
    /// `refresh`.
    pub fn open(db: &Path, agent: &str) -> Result<Listener, String> {
        let mut store = Store::open(db).map_err(|e| e.to_string())?;
        let agent = store
            .registered_agent(agent)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("unknown agent {agent:?}"))?;
        let agent = &agent;
        let pid = i64::from(std::process::id());
        command::ensure_private_dir(&command::runs_dir(db))?;
        let path = command::lock_path(db, &lock_name(pid));
        let lock = command::create_private(&path)
            .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        lock.try_lock()
            .map_err(|e| format!("cannot lock {}: {e}", path.display()))?;
        Ok(Listener {
            db: db.to_owned(),
            agent: agent.id.clone(),
            pid,
            parent: nix::unistd::getppid().as_raw(),
            config: claude::config_dir(
                agent
                    .settings
                    .get("config_dir")
                    .and_then(Value::as_str)
                    .map(Path::new),
            ),
            session: None,
            store,
            _lock: lock,
        })
    }

    /// Registers (again) the session the parent Claude process has open now: the registry
    /// entry `sessions/<parent pid>.json` names it (and changes on `/resume` or `/clear`).
    pub fn refresh(&mut self) {
        let session = self.parent_entry().map(|(s, _)| s);
        if session.is_none() || session == self.session {
            return;
        }
        let row = ChannelRow {
            pid: self.pid,
            agent: self.agent.clone(),
            session: session.clone().unwrap_or_default(),
            claude_pid: i64::from(self.parent),
            opened_at: millis(crate::clock::now()),
        };
        if self.store.open_channel(&row).is_ok() {
            self.session = session;
        }
    }

    /// The parent Claude's registry entry now: its session and status.
    fn parent_entry(&self) -> Option<(String, Option<String>)> {
        let config = self.config.as_ref()?;
        let entry = config
            .join("sessions")
            .join(format!("{}.json", self.parent));
        let v = std::fs::read_to_string(entry)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())?;
        let session = v.get("sessionId").and_then(Value::as_str)?.to_owned();
        let status = v.get("status").and_then(Value::as_str).map(str::to_owned);
        Some((session, status))
    }

    /// The cards to push now, each taken (committed) before it is returned: only cards for
    /// the session the parent Claude has open, and only while it says it is idle (a card
    /// that cannot go now is left for the engine to take back).
    pub fn take(&mut self) -> Vec<(String, Value)> {
        let Some((session, Some(status))) = self.parent_entry() else {
            return Vec::new();
        };
        if status != "idle" {
            return Vec::new();
        }
        let Ok(waiting) = self.store.waiting_pushes(self.pid) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for p in waiting.into_iter().filter(|p| p.session == session) {
            let now = millis(crate::clock::now());
            if self
                .store
                .take_push(&p.request_id, self.pid, now)
                .unwrap_or(false)
            {
                let meta = serde_json::from_str::<Value>(&p.meta).unwrap_or(Value::Null);
                out.push((p.content, meta));
            }
        }
        out
    }

    /// Closes this process's channel: pushes wait for the engine to take them back.
    pub fn close(&mut self) {
        let _ = self.store.close_channel(self.pid);
    }

    /// Closes the channel of this process on `db` (its listener may be gone).
    pub fn close_for_this_process(db: &Path) {
        if let Ok(mut store) = Store::open(db) {
            let _ = store.close_channel(i64::from(std::process::id()));
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(command::lock_path(&self.db, &lock_name(self.pid)));
    }
}
