//! The command adapter (SPEC §4): either an argv list run once per turn, never through a
//! shell, or an HTTP endpoint that takes one POST per turn.
//!
//! argv mode: each turn runs under `handoffs supervise`, a small detached process that records
//! the run in the `runs` table *before* it starts the command (a request id already there is
//! never run again), waits for it (killing its whole process group after `timeout`), and
//! records its outcome. The supervisor holds an exclusive lock on `<db>.runs/<request>.lock`
//! for its whole life, so anyone can tell a live run from one whose supervisor vanished. If
//! the supervisor vanished while its command still runs (the command has its own process
//! group and outlives it), the run still counts as running: the recipient is busy until the
//! command ends, and past its timeout the engine kills the group. A run that ended without
//! its supervisor is reported as interrupted, never guessed finished. The `runs` table is the
//! recipient's history: a scan of it is always complete.

use super::Host;
use super::http::HttpError;
use super::{Adapters, Write};
use crate::store::{AgentRow, RunRow, Store, millis, sibling};
use model::states::TurnFailure;
use model::{Activity, Observed, RequestId, ScanResult, TurnId, WriteOutcome};
use serde_json::{Value, json};
use std::cell::RefCell;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub const HTTP_TIMEOUT_SECS: u64 = 30;
/// How long one HTTP exchange with an agent may take.
const HTTP_TIMEOUT: Duration = Duration::from_secs(HTTP_TIMEOUT_SECS);
pub const RUN_TIMEOUT_SECS_DEFAULT: u64 = 3_600;
/// How long the engine waits for a supervisor to report that the command started, and how
/// long at most while the supervisor is alive (it may wait out another process's lock).
const START_WAIT: Duration = Duration::from_secs(10);
const START_WAIT_MAX: Duration = Duration::from_secs(60);

pub fn check_settings(settings: &Value) -> Result<(), String> {
    let command = settings.get("command");
    let url = settings.get("url");
    match (command, url) {
        (None, None) => {
            return Err(
                "a command agent needs --set command='[\"prog\",\"arg\"]' or --set url=http://…"
                    .to_owned(),
            );
        }
        (Some(_), Some(_)) => return Err("set either command or url, not both".to_owned()),
        (Some(c), None) => {
            let ok = c
                .as_array()
                .is_some_and(|a| !a.is_empty() && a.iter().all(Value::is_string));
            if !ok {
                return Err(
                    "command must be a JSON list of strings, like [\"prog\",\"{text_file}\"]"
                        .to_owned(),
                );
            }
        }
        (None, Some(u)) => check_url("url", u)?,
    }
    for key in ["status_url", "activity_url"] {
        if let Some(u) = settings.get(key) {
            check_url(key, u)?;
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

fn check_url(key: &str, v: &Value) -> Result<(), String> {
    let s = v
        .as_str()
        .ok_or_else(|| format!("{key} must be a string"))?;
    let parsed = reqwest::Url::parse(&s.replace("{request_id}", "x"))
        .map_err(|e| format!("{key} is not a URL: {e}"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(format!("{key} must be http or https"));
    }
    Ok(())
}

fn argv(agent: &AgentRow) -> Option<Vec<String>> {
    agent.settings.get("command")?.as_array().map(|a| {
        a.iter()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect()
    })
}

fn url(agent: &AgentRow, key: &str) -> Option<String> {
    agent.settings.get(key)?.as_str().map(str::to_owned)
}

/// The folder of run files: `<db>.runs/` (0700).
pub fn runs_dir(db: &Path) -> PathBuf {
    sibling(db, ".runs")
}

pub(crate) fn lock_path(db: &Path, request_id: &str) -> PathBuf {
    runs_dir(db).join(format!("{request_id}.lock"))
}

/// Whether the supervisor of `request_id` is alive (it holds the run's lock).
pub(crate) fn supervisor_alive(db: &Path, request_id: &str) -> bool {
    let Ok(file) = File::open(lock_path(db, request_id)) else {
        return false;
    };
    match file.try_lock() {
        Ok(()) => {
            let _ = file.unlock();
            false
        }
        Err(std::fs::TryLockError::WouldBlock) => true,
        Err(std::fs::TryLockError::Error(_)) => false,
    }
}

/// The processes that belong to a run: every live process whose environment carries its
/// `HANDOFFS_REQUEST_ID` (the command and anything it started, whoever their parent is now;
/// a reused pid does not carry it). Read from /proc, so only on Linux; elsewhere none.
pub fn marked_processes(request_id: &str) -> Vec<i32> {
    let marker = format!("HANDOFFS_REQUEST_ID={request_id}");
    let me = std::process::id();
    let mut pids = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for entry in entries.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if u32::try_from(pid).is_ok_and(|p| p == me) {
            continue;
        }
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if environ
            .split(|b| *b == 0)
            .any(|var| var == marker.as_bytes())
        {
            pids.push(pid);
        }
    }
    pids
}

/// Whether a run without a row may still appear: its supervisor is alive (starting), or a
/// process of this request runs.
pub(crate) fn run_may_start(db: &Path, request_id: &str) -> bool {
    supervisor_alive(db, request_id) || !marked_processes(request_id).is_empty()
}

/// What is left of a run whose supervisor is gone.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Orphan {
    /// Nothing runs any more.
    Gone,
    /// Its command (or what it started) still runs: the turn is not over.
    Running,
    /// It ran past its end time and was killed now.
    KilledAtTimeout,
}

pub(crate) fn orphan(run: &RunRow, now: i64) -> Orphan {
    let pids = marked_processes(&run.request_id);
    if pids.is_empty() {
        return Orphan::Gone;
    }
    if run.ends_at.is_some_and(|end| now > end) {
        for pid in pids {
            kill_group(pid);
        }
        return Orphan::KilledAtTimeout;
    }
    Orphan::Running
}

/// Kills a process's whole group (a command leads its own group), and the process itself.
pub(crate) fn kill_group(pid: i32) {
    use nix::sys::signal::{Signal, kill, killpg};
    use nix::unistd::{Pid, getpgid};
    let pid = Pid::from_raw(pid);
    if let Ok(group) = getpgid(Some(pid))
        && group.as_raw() > 1
        && group != getpgid(None).unwrap_or(Pid::from_raw(0))
    {
        let _ = killpg(group, Signal::SIGKILL);
    }
    let _ = kill(pid, Signal::SIGKILL);
}

/// Whether an open run is still going: its supervisor holds the lock, or its command outlived
/// it. A run that is over without its supervisor is recorded (interrupted, or errored when
/// it had to be killed at its timeout).
fn still_running(store: &mut Store, db: &Path, run: &RunRow, now: i64) -> bool {
    still_running_or(store, db, run, now, |_| {
        (
            "interrupted".to_owned(),
            "the supervisor vanished before the command ended".to_owned(),
        )
    })
}

/// [`still_running`], where `gone` decides the outcome of a run that is over without its
/// supervisor (an adapter with a history of its own can tell a finished turn from a killed one).
pub(crate) fn still_running_or(
    store: &mut Store,
    db: &Path,
    run: &RunRow,
    now: i64,
    gone: impl FnOnce(&RunRow) -> (String, String),
) -> bool {
    if supervisor_alive(db, &run.request_id) {
        return true;
    }
    match orphan(run, now) {
        Orphan::Running => true,
        Orphan::Gone => {
            let (outcome, detail) = gone(run);
            let _ = store.finish_run(&run.request_id, now, None, &outcome, Some(&detail));
            false
        }
        Orphan::KilledAtTimeout => {
            let _ = store.finish_run(
                &run.request_id,
                now,
                None,
                "errored",
                Some("killed after its timeout; its supervisor was gone"),
            );
            false
        }
    }
}

/// A run's outcome when its write was turned away because the session was busy at that
/// moment (another process took it after the engine's look): nothing was written, and the
/// delivery waits; unlike "refused", it is no refusal (SPEC §2.2 step 10).
pub(crate) const HELD: &str = "held";

/// Whether a run's outcome says nothing was written ("refused" or "held").
pub(crate) fn wrote_nothing(outcome: Option<&str>) -> bool {
    matches!(outcome, Some("refused" | HELD))
}

pub(crate) fn observed_of(run: &RunRow, alive: bool) -> Observed {
    let turn = TurnId::new(&run.request_id);
    match run.outcome.as_deref() {
        None if alive => Observed::Running { turn },
        None | Some("interrupted") => Observed::Failed {
            turn,
            failure: TurnFailure::Interrupted,
            turn_open: false,
        },
        Some("returned") => Observed::Returned { turn },
        Some("refused" | HELD) => Observed::NotFound,
        Some(_) => Observed::Failed {
            turn,
            failure: TurnFailure::Errored,
            turn_open: false,
        },
    }
}

/// HTTP mode without an `activity_url`: idle, known without a request.
pub fn activity_without_io(agent: &AgentRow) -> Option<Activity> {
    (argv(agent).is_none() && url(agent, "activity_url").is_none()).then_some(Activity::Idle)
}

pub async fn activity(
    adapters: &Adapters,
    service: &RefCell<dyn Host>,
    agent: &AgentRow,
) -> Activity {
    if argv(agent).is_none() {
        let Some(u) = url(agent, "activity_url") else {
            return Activity::Idle;
        };
        return match adapters.http.get(&u, HTTP_TIMEOUT).await {
            Ok(r) if r.is_success() => match r.json() {
                Ok(v) => match v.get("status").and_then(Value::as_str) {
                    Some("idle" | "finished" | "stopped" | "failed") => Activity::Idle,
                    Some("busy" | "running") => Activity::Busy {
                        turn: v.get("turn_id").and_then(Value::as_str).map(TurnId::new),
                        detail: None,
                    },
                    _ => Activity::Unknown {
                        detail: format!("activity_url answered {v}"),
                    },
                },
                Err(e) => Activity::Unknown {
                    detail: format!("activity_url: {e}"),
                },
            },
            Ok(r) => Activity::Unknown {
                detail: format!("activity_url answered {}", r.status),
            },
            Err(e) => Activity::Unknown {
                detail: format!("activity_url: {e}"),
            },
        };
    }
    // From here on nothing awaits: the service stays borrowed.
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
        if still_running(service.runs(), &db, &run, now) {
            return Activity::Busy {
                turn: Some(TurnId::new(&run.request_id)),
                detail: None,
            };
        }
    }
    Activity::Idle
}

pub async fn start(
    adapters: &Adapters,
    service: &RefCell<dyn Host>,
    w: &Write<'_>,
) -> WriteOutcome {
    if let Some(argv) = argv(w.agent) {
        return start_argv(service, w, argv).await;
    }
    let Some(u) = url(w.agent, "url") else {
        return WriteOutcome::Refused {
            detail: "the agent has neither command nor url".to_owned(),
        };
    };
    let mut body = json!({"request_id": w.request_id, "text": w.text, "agent": w.agent.id});
    if let Some(fence) = w.fence {
        body["fence"] = json!(fence);
    }
    match adapters.http.post(&u, &body, HTTP_TIMEOUT).await {
        Ok(r) if r.is_success() => {
            // 2xx is acceptance of this request id (SPEC §4); a body may name the turn.
            let v: Value = r.json().unwrap_or(Value::Null);
            let turn = v
                .get("turn_id")
                .and_then(Value::as_str)
                .unwrap_or(w.request_id)
                .to_owned();
            let echoed = v
                .get("request_id")
                .and_then(Value::as_str)
                .unwrap_or(w.request_id);
            WriteOutcome::Receipt {
                turn: TurnId::new(turn),
                request_id: Some(RequestId::new(echoed)),
            }
        }
        // 423 Locked: the session was busy as the write arrived (a turn began, another
        // client holds it); nothing was written, and the delivery waits (SPEC §4).
        Ok(r) if r.status == 423 => WriteOutcome::Busy {
            detail: format!("the agent answered 423{}", reason_of(&r)),
        },
        Ok(r) if r.is_client_error() => WriteOutcome::Refused {
            detail: format!("the agent answered {}{}", r.status, reason_of(&r)),
        },
        Ok(r) => WriteOutcome::Failed {
            detail: format!("the agent answered {}", r.status),
        },
        Err(e @ HttpError::Connect(_)) => WriteOutcome::Refused {
            detail: e.to_string(),
        },
        Err(HttpError::Timeout) => WriteOutcome::TimedOut,
        Err(HttpError::Other(e)) => WriteOutcome::Failed { detail: e },
    }
}

/// The reason an agent gave with its answer (a JSON body's `error`, cut short), for the
/// delivery's detail: `" (…)"`, or nothing.
fn reason_of(r: &super::http::Reply) -> String {
    r.json()
        .ok()
        .and_then(|v| {
            v.get("error")
                .and_then(Value::as_str)
                .map(|e| crate::text::one_line(e, 120))
        })
        .map(|e| format!(" ({e})"))
        .unwrap_or_default()
}

async fn start_argv(service: &RefCell<dyn Host>, w: &Write<'_>, argv: Vec<String>) -> WriteOutcome {
    start_supervised(service, w, argv, &[]).await
}

/// Writes one turn through `handoffs supervise` running `argv`; `extra` are more of the
/// supervisor's own flags (how to speak to the program).
pub(crate) async fn start_supervised(
    service: &RefCell<dyn Host>,
    w: &Write<'_>,
    argv: Vec<String>,
    extra: &[String],
) -> WriteOutcome {
    let dir = runs_dir(w.db);
    if let Err(e) = ensure_private_dir(&dir) {
        return WriteOutcome::Refused { detail: e };
    }
    // A refused run's supervisor writes its row before it removes the run's files and lets
    // go of its lock: the retry (same request id) waits for it to finish, or its supervisor
    // would find the lock held and take it for a live run, or lose its card to the cleanup.
    let waited_from = std::time::Instant::now();
    while supervisor_alive(w.db, w.request_id)
        && !crate::planted(crate::Plant::RetryBesideSupervisor)
    {
        if waited_from.elapsed() > START_WAIT {
            return WriteOutcome::Refused {
                detail: "an earlier supervisor of this request still runs".to_owned(),
            };
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let text_file = dir.join(format!("{}.txt", w.request_id));
    if let Err(e) = write_private(&text_file, w.text) {
        return WriteOutcome::Refused { detail: e };
    }
    let sup_log = dir.join(format!("{}.sup.log", w.request_id));
    let mut cmd = match supervisor_command(w, &argv, extra, &text_file, &sup_log) {
        Ok(cmd) => cmd,
        Err(detail) => return WriteOutcome::Refused { detail },
    };
    // A refused or held run never ran: its row goes, so the retry (same request id) runs.
    if let Err(e) = service.borrow_mut().runs().forget_refused_run(w.request_id) {
        return WriteOutcome::Refused {
            detail: e.to_string(),
        };
    }
    let child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_file(&text_file);
            let _ = std::fs::remove_file(&sup_log);
            return WriteOutcome::Refused {
                detail: format!("could not start the supervisor: {e}"),
            };
        }
    };
    receipt(service, w, child, &sup_log).await
}

/// Waits for the supervisor of `w` to record that the command started (a receipt), was
/// refused, or died first (reaping it in the background so it never lingers as a zombie).
async fn receipt(
    service: &RefCell<dyn Host>,
    w: &Write<'_>,
    mut child: std::process::Child,
    sup_log: &Path,
) -> WriteOutcome {
    // Reap the supervisor in the background so it never lingers as a zombie, and say when it
    // is gone: gone without a row means it never started the command.
    let (exited_tx, exited) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let code = child.wait().ok().and_then(|s| s.code());
        let _ = exited_tx.send(code);
    });
    let started = std::time::Instant::now();
    let mut gone: Option<Option<i32>> = None;
    loop {
        let found = service.borrow_mut().runs().run(w.request_id);
        match found {
            Ok(Some(run)) if run.outcome.as_deref() == Some("refused") => {
                return WriteOutcome::Refused {
                    detail: run
                        .detail
                        .unwrap_or_else(|| "the command could not start".to_owned()),
                };
            }
            Ok(Some(run)) if run.outcome.as_deref() == Some(HELD) => {
                return WriteOutcome::Busy {
                    detail: run
                        .detail
                        .unwrap_or_else(|| "the session was taken".to_owned()),
                };
            }
            // Recorded and started (or recorded earlier: a request id runs once).
            Ok(Some(run)) if run.pid.is_some() || run.outcome.is_some() => {
                return WriteOutcome::Receipt {
                    turn: TurnId::new(&run.request_id),
                    request_id: Some(RequestId::new(&run.request_id)),
                };
            }
            Ok(None) if gone.is_some() => {
                // Read after it was gone: it never recorded the run, so nothing ran.
                let code = gone
                    .flatten()
                    .map_or("a signal".to_owned(), |c| c.to_string());
                return WriteOutcome::Refused {
                    detail: format!(
                        "the supervisor ended ({code}) before starting the command; see {}",
                        sup_log.display()
                    ),
                };
            }
            Ok(_) => {}
            Err(e) => {
                return WriteOutcome::Failed {
                    detail: e.to_string(),
                };
            }
        }
        if gone.is_some() {
            // Recorded but gone before it noted the start: the command may run.
            return WriteOutcome::Failed {
                detail: "the supervisor ended without saying whether the write started".to_owned(),
            };
        }
        if let Ok(code) = exited.try_recv() {
            gone = Some(code);
            continue;
        }
        // A live supervisor may be waiting for the database; give it up to START_WAIT_MAX.
        let waited = started.elapsed();
        if waited > START_WAIT_MAX || (waited > START_WAIT && !supervisor_alive(w.db, w.request_id))
        {
            return WriteOutcome::Failed {
                detail: "the supervisor did not report the start in time".to_owned(),
            };
        }
        // Quick at first (a command starts in milliseconds), then gently (Claude and Codex
        // take a second or two, and need the CPU more than this loop does).
        let pause = u64::try_from(waited.as_millis() / 50)
            .unwrap_or(20)
            .clamp(1, 20);
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
}

/// The supervisor's command line: this very binary, `supervise` with the write's facts, in
/// its own process group, its stderr in `<request>.sup.log`.
fn supervisor_command(
    w: &Write<'_>,
    argv: &[String],
    extra: &[String],
    text_file: &Path,
    sup_log: &Path,
) -> Result<std::process::Command, String> {
    let timeout = w
        .agent
        .settings
        .get("timeout")
        .and_then(Value::as_u64)
        .unwrap_or(RUN_TIMEOUT_SECS_DEFAULT);
    // This very binary: on Linux through /proc/self/exe, which still runs after the file
    // was replaced (an upgrade while the engine runs), where its path would name the new
    // binary, or nothing in between.
    let this = std::path::Path::new("/proc/self/exe");
    let exe = if this.exists() {
        this.to_path_buf()
    } else {
        std::env::current_exe().map_err(|e| e.to_string())?
    };
    let mut cmd = std::process::Command::new(exe);
    // A PostgreSQL URL may hold a password: through the environment, which only this user
    // can read, never on the command line, which every user's `ps` shows.
    if crate::store::pg::is_url(w.db) {
        cmd.env("HANDOFFS_DB", w.db);
    } else {
        cmd.arg("--db").arg(w.db);
    }
    cmd.arg("supervise")
        .arg("--request-id")
        .arg(w.request_id)
        .arg("--message")
        .arg(&w.message.id)
        .arg("--agent")
        .arg(&w.agent.id)
        .arg("--timeout")
        .arg(timeout.to_string())
        .arg("--text-file")
        .arg(text_file)
        .arg("--endpoint")
        .arg(&w.agent.endpoint)
        .arg("--cwd")
        .arg(&w.agent.cwd)
        .args(extra)
        .arg("--")
        .args(argv)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null());
    // What the supervisor itself says goes to `<request>.sup.log` (removed when empty).
    match create_private(sup_log) {
        Ok(f) => cmd.stderr(f),
        Err(_) => cmd.stderr(std::process::Stdio::null()),
    };
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0);
        // Its command line names it `handoffs` (`ps -f`, `pgrep -f handoffs`), not
        // /proc/self/exe; the kernel's short name (`ps -o comm`) stays `exe`.
        cmd.arg0("handoffs");
    }
    Ok(cmd)
}

/// What an **accepted** write became, known without asking: in HTTP mode without a
/// `status_url`, a POST answered 2xx counts as returned at once (SPEC §4). Only for a write
/// whose 2xx was received: of a write whose reply was lost nothing can be learned this way.
pub fn observe_without_io(agent: &AgentRow, request_id: &str) -> Option<Observed> {
    (argv(agent).is_none() && url(agent, "status_url").is_none()).then(|| Observed::Returned {
        turn: TurnId::new(request_id),
    })
}

pub async fn observe(
    adapters: &Adapters,
    service: &RefCell<dyn Host>,
    agent: &AgentRow,
    request_id: &str,
) -> Observed {
    if argv(agent).is_some() {
        // Nothing awaits in argv mode: the service stays borrowed.
        let mut service = service.borrow_mut();
        let db = service.db().to_owned();
        let now = millis(service.now());
        return match service.runs().run(request_id) {
            Ok(Some(run)) => {
                if run.outcome.is_some() {
                    return observed_of(&run, false);
                }
                if still_running(service.runs(), &db, &run, now) {
                    return observed_of(&run, true);
                }
                // Over: recorded by its supervisor meanwhile, or by us just now.
                match service.runs().run(request_id) {
                    Ok(Some(fresh)) => observed_of(&fresh, false),
                    Ok(None) => Observed::NotFound,
                    Err(e) => Observed::Unreachable {
                        detail: e.to_string(),
                    },
                }
            }
            // No row: a supervisor that is still starting (or a command of ours still
            // running) means the answer is not known yet.
            Ok(None) if run_may_start(&db, request_id) => Observed::Unreachable {
                detail: "the run's supervisor is starting".to_owned(),
            },
            Ok(None) => Observed::NotFound,
            Err(e) => Observed::Unreachable {
                detail: e.to_string(),
            },
        };
    }
    let Some(status_url) = url(agent, "status_url") else {
        // Without a status URL only an accepted POST has an outcome (returned at once, SPEC
        // §4; the engine takes it from `observe_without_io`). Of a write whose reply was lost
        // (UNCERTAIN) nothing can be learned: a person's release decides (G5).
        return Observed::Unreachable {
            detail: "no status_url: whether a write whose reply was lost arrived cannot be asked"
                .to_owned(),
        };
    };
    http_status(adapters, &status_url, request_id).await
}

async fn http_status(adapters: &Adapters, status_url: &str, request_id: &str) -> Observed {
    let u = status_url.replace("{request_id}", request_id);
    let turn = TurnId::new(request_id);
    match adapters.http.get(&u, HTTP_TIMEOUT).await {
        Ok(r) if r.status == 404 => Observed::NotFound,
        Ok(r) if r.is_success() => match r.json() {
            Ok(v) => match v.get("status").and_then(Value::as_str) {
                Some("accepted") => Observed::Accepted { turn },
                Some("running") => Observed::Running { turn },
                Some("returned") => Observed::Returned { turn },
                Some("failed") => Observed::Failed {
                    turn,
                    failure: TurnFailure::Errored,
                    turn_open: false,
                },
                Some("stopped") => Observed::Failed {
                    turn,
                    failure: TurnFailure::Interrupted,
                    turn_open: false,
                },
                _ => Observed::Unreachable {
                    detail: format!("status_url answered {v}"),
                },
            },
            Err(e) => Observed::Unreachable {
                detail: format!("status_url: {e}"),
            },
        },
        Ok(r) => Observed::Unreachable {
            detail: format!("status_url answered {}", r.status),
        },
        Err(e) => Observed::Unreachable {
            detail: format!("status_url: {e}"),
        },
    }
}

pub async fn scan(
    adapters: &Adapters,
    service: &RefCell<dyn Host>,
    agent: &AgentRow,
    request_id: &str,
) -> ScanResult {
    if argv(agent).is_some() {
        let mut service = service.borrow_mut();
        let db = service.db().to_owned();
        let now = millis(service.now());
        return match service.runs().run(request_id) {
            Ok(Some(run)) if !wrote_nothing(run.outcome.as_deref()) => {
                let alive = run.outcome.is_none() && still_running(service.runs(), &db, &run, now);
                let run = if alive {
                    run
                } else {
                    // Read again: the outcome may have been recorded since.
                    match service.runs().run(request_id) {
                        Ok(Some(fresh)) => fresh,
                        _ => return ScanResult::NothingFound { complete: false },
                    }
                };
                ScanResult::Found {
                    observed: observed_of(&run, alive),
                }
            }
            // Refused, or never recorded: complete only when no supervisor or command of
            // this request can still record it.
            Ok(_) if run_may_start(&db, request_id) => ScanResult::NothingFound { complete: false },
            Ok(_) => ScanResult::NothingFound { complete: true },
            Err(_) => ScanResult::NothingFound { complete: false },
        };
    }
    match url(agent, "status_url") {
        Some(status_url) => match http_status(adapters, &status_url, request_id).await {
            Observed::NotFound => ScanResult::NothingFound { complete: true },
            Observed::Unreachable { .. } => ScanResult::NothingFound { complete: false },
            observed => ScanResult::Found { observed },
        },
        None => ScanResult::NothingFound { complete: false },
    }
}

pub(crate) fn ensure_private_dir(dir: &Path) -> Result<(), String> {
    if !dir.exists() {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
        }
    }
    Ok(())
}

fn write_private(path: &Path, text: &str) -> Result<(), String> {
    use std::io::Write as _;
    create_private(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// The arguments of `handoffs supervise` (spawned by the engine, not typed by people).
#[derive(Debug, Clone)]
pub struct Supervise {
    pub db: PathBuf,
    pub request_id: String,
    pub message: String,
    pub agent: String,
    pub timeout_secs: u64,
    pub text_file: PathBuf,
    pub endpoint: String,
    pub cwd: String,
    pub argv: Vec<String>,
    /// A Claude Code turn: `argv` is `claude -p --resume …`, spoken to in stream-json.
    pub claude: Option<super::claude::Session>,
    /// A Codex turn: `argv` is `codex app-server`, spoken to in JSON-RPC.
    pub codex: Option<super::codex::Thread>,
}

fn fill(arg: &str, s: &Supervise) -> String {
    arg.replace("{text_file}", &s.text_file.to_string_lossy())
        .replace("{request_id}", &s.request_id)
        .replace("{endpoint}", &s.endpoint)
        .replace("{cwd}", &s.cwd)
}

/// Runs one command turn to its end and records the outcome durably. Returns the exit code
/// the supervisor itself should end with.
pub async fn supervise(s: Supervise) -> i32 {
    let lock_file = lock_path(&s.db, &s.request_id);
    let Ok(lock) = create_private(&lock_file) else {
        eprintln!("cannot create {}", lock_file.display());
        return 1;
    };
    match lock.try_lock() {
        Ok(()) => {}
        // Another supervisor of this request is alive: it is the run.
        Err(std::fs::TryLockError::WouldBlock) => return 0,
        Err(std::fs::TryLockError::Error(e)) => {
            eprintln!("cannot lock {}: {e}", lock_file.display());
            return 1;
        }
    }
    let mut store = match Store::open(&s.db) {
        Ok(store) => store,
        Err(e) => {
            eprintln!("{e}");
            return 1;
        }
    };
    let now = || millis(crate::clock::now());
    let argv: Vec<String> = s.argv.iter().map(|a| fill(a, &s)).collect();
    let Some((program, args)) = argv.split_first() else {
        return 2;
    };
    let started_at = now();
    let timeout_ms = i64::try_from(s.timeout_secs.saturating_mul(1_000)).unwrap_or(i64::MAX);
    let row = RunRow {
        request_id: s.request_id.clone(),
        message_id: s.message.clone(),
        agent: s.agent.clone(),
        pid: None,
        started_at,
        ends_at: Some(started_at.saturating_add(timeout_ms)),
        ended_at: None,
        exit_code: None,
        outcome: None,
        detail: None,
    };
    // Recorded before it starts, and on stable storage: a supervisor killed (or a machine
    // that lost power) right after the start still leaves a row, and a request id that is
    // already there is never run a second time. What the supervisor notes afterwards (the
    // receipt, the outcome) is committed lazily: the engine syncs the WAL, and with it those
    // notes, before anything it does on them leaves the database; a note a power cut takes
    // back leaves a run nobody can tell about, which the engine treats as such.
    if let Err(e) = store.commit_lazily() {
        eprintln!("{e}");
        let _ = std::fs::remove_file(&lock_file);
        return 1;
    }
    if let Err(e) = store.insert_run(&row) {
        eprintln!("request {} is not run again: {e}", s.request_id);
        let _ = std::fs::remove_file(&lock_file);
        return 0;
    }
    if let Err(e) = store.sync_upto(store.changes_so_far()) {
        refuse(
            &mut store,
            &s,
            &format!("the run's record is not on disk: {e}"),
        );
        let _ = std::fs::remove_file(&lock_file);
        return 0;
    }
    let log = runs_dir(&s.db).join(format!("{}.log", s.request_id));
    // A Claude session is resumed by one process at a time: the session's lock for as long
    // as the turn runs, and no live process of the session beside it (two resumes fork the
    // transcript silently). Nothing is written without both: a session another process has
    // now is busy at the write (the delivery waits), anything else a refusal.
    if s.claude.is_some() {
        super::codex::hold_before_open(&s.request_id).await;
    }
    let _session_lock = match &s.claude {
        Some(c) => match super::claude::claim(&s.db, c) {
            Ok(lock) => Some(lock),
            Err(super::claude::NotClaimed::Held(detail)) => {
                finish_unwritten(&mut store, &s, HELD, &detail);
                cleanup(&s, &lock_file, &log);
                return 0;
            }
            Err(super::claude::NotClaimed::Refused(detail)) => {
                refuse(&mut store, &s, &detail);
                cleanup(&s, &lock_file, &log);
                return 0;
            }
        },
        None => None,
    };
    // A thread the Codex daemon serves is open in a person's session: the write goes through
    // the daemon's socket, into that session (our own app-server would only be told that the
    // thread "already has an active writer").
    if let Some(t) = &s.codex
        && let Some(home) = super::codex::home(t.home.as_deref())
        && let Ok(Some(rpc)) = super::codex::daemon::serving(&home, &t.id).await
    {
        through_daemon(&s, &mut store, rpc, t, &log).await;
        cleanup(&s, &lock_file, &log);
        drop(lock);
        return 0;
    }
    // A card the supervisor speaks itself (Claude, Codex) is read before anything starts:
    // an unreadable one is refused, never written as an empty prompt.
    let card = if s.codex.is_some() || s.claude.is_some() {
        match std::fs::read_to_string(&s.text_file) {
            Ok(t) => t,
            Err(e) => {
                let detail = format!("cannot read the card {}: {e}", s.text_file.display());
                refuse(&mut store, &s, &detail);
                cleanup(&s, &lock_file, &log);
                return 0;
            }
        }
    } else {
        String::new()
    };
    let mut child = match command_for(&s, program, args, &log).spawn() {
        Ok(c) => c,
        Err(e) => {
            refuse(&mut store, &s, &format!("could not start {program}: {e}"));
            cleanup(&s, &lock_file, &log);
            return 0;
        }
    };
    let (code, outcome, detail) = watch_turn(&s, &mut store, &mut child, &card, &argv, &log).await;
    record(
        &mut store,
        &s.request_id,
        now(),
        code,
        &outcome,
        detail.as_deref(),
    );
    cleanup(&s, &lock_file, &log);
    drop(lock);
    0
}

/// Records on the run what its write said as it went: the receipt (the pid, when there is
/// one) or what the turn waits for.
fn note_said(store: &mut Store, request_id: &str, pid: Option<i64>, said: super::codex::Said<'_>) {
    match said {
        super::codex::Said::Written => {
            if let Some(pid) = pid {
                let _ = store.set_run_pid(request_id, pid);
            }
        }
        super::codex::Said::Waiting(note) => {
            let _ = store.set_run_note(request_id, note);
        }
    }
}

/// Records that the write was refused: nothing was written.
fn refuse(store: &mut Store, s: &Supervise, detail: &str) {
    finish_unwritten(store, s, "refused", detail);
}

/// Records that nothing was written, and why (`outcome`: "refused" or [`HELD`]).
fn finish_unwritten(store: &mut Store, s: &Supervise, outcome: &str, detail: &str) {
    let now = millis(crate::clock::now());
    let _ = store.finish_run(&s.request_id, now, None, outcome, Some(detail));
}

/// The write into a thread the Codex daemon serves, watched to its end.
async fn through_daemon(
    s: &Supervise,
    store: &mut Store,
    rpc: super::codex::Rpc,
    t: &super::codex::Thread,
    log: &Path,
) {
    let _ = create_private(log);
    let Ok(text) = std::fs::read_to_string(&s.text_file) else {
        refuse(
            store,
            s,
            &format!("cannot read the card {}", s.text_file.display()),
        );
        return;
    };
    // The receipt: the supervisor itself, which watches the turn in the daemon.
    let me = i64::from(std::process::id());
    let (outcome, detail) = super::codex::converse_daemon(
        rpc,
        t,
        &text,
        &s.request_id,
        log,
        &mut |said| note_said(store, &s.request_id, Some(me), said),
        Duration::from_secs(s.timeout_secs),
    )
    .await;
    record(
        store,
        &s.request_id,
        millis(crate::clock::now()),
        None,
        &outcome,
        detail.as_deref(),
    );
}

/// The command of a supervised run: no shell, its own process group, the handoff's facts in
/// its environment, its output in the run's log.
fn command_for(
    s: &Supervise,
    program: &str,
    args: &[String],
    log: &Path,
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .env("HANDOFFS_TEXT_FILE", &s.text_file)
        .env("HANDOFFS_REQUEST_ID", &s.request_id)
        .env("HANDOFFS_AGENT_ID", &s.agent)
        .env("HANDOFFS_AGENT", &s.agent)
        .env("HANDOFFS_ENDPOINT", &s.endpoint)
        .env("HANDOFFS_DB", &s.db)
        .stdin(std::process::Stdio::null())
        // Its own process group: a timeout kills everything the command started.
        .process_group(0)
        .kill_on_drop(false);
    if let Some(c) = &s.claude {
        super::claude::prepare_command(&mut cmd, c);
    }
    if let Some(t) = &s.codex {
        super::codex::prepare_command(&mut cmd, t);
    }
    if !s.cwd.is_empty() {
        cmd.current_dir(&s.cwd);
    }
    if let Ok(f) = create_private(log)
        && let Ok(g) = f.try_clone()
    {
        if s.claude.is_none() && s.codex.is_none() {
            cmd.stdout(f);
            cmd.stderr(g);
        } else if let Ok(a) = std::fs::OpenOptions::new().append(true).open(log) {
            // The supervisor appends the program's stdout lines itself: its stderr appends
            // too, so neither overwrites the other.
            cmd.stderr(a);
        }
    }
    cmd
}

/// Waits for the turn of a started run: the program's exit (argv mode), or the conversation
/// with Codex or Claude; the pid is recorded as the receipt when the write was taken.
async fn watch_turn(
    s: &Supervise,
    store: &mut Store,
    child: &mut tokio::process::Child,
    card: &str,
    argv: &[String],
    log: &Path,
) -> (Option<i64>, String, Option<String>) {
    let pid = child.id().and_then(|p| i32::try_from(p).ok());
    // The pid is the receipt the engine waits for: for a Codex write it is recorded once the
    // app-server took the message, for a Claude one once the turn began, so a thread held
    // elsewhere or a session not found is a refusal, not a turn.
    let mut record =
        |said: super::codex::Said<'_>| note_said(store, &s.request_id, pid.map(i64::from), said);
    if s.codex.is_none() && s.claude.is_none() {
        record(super::codex::Said::Written);
    }
    let timeout = Duration::from_secs(s.timeout_secs);
    match (&s.claude, &s.codex) {
        (None, Some(t)) => {
            // The agent's timeout bounds a turn without progress; the app-server lives on
            // as long as its turn makes some.
            let text = card.to_owned();
            let (outcome, detail) = super::codex::converse(
                child,
                t,
                &text,
                &s.request_id,
                log,
                &mut record,
                &super::codex::Fresh {
                    argv,
                    cwd: &s.cwd,
                    no_progress: timeout,
                },
            )
            .await;
            (None, outcome, detail)
        }
        (Some(c), _) => {
            let text = card.to_owned();
            let mut began = || record(super::codex::Said::Written);
            let talk = super::claude::converse(child, &text, &s.request_id, log, &mut began);
            if let Ok(turn) = tokio::time::timeout(timeout, talk).await {
                super::claude::outcome(c, &s.cwd, &s.request_id, &turn)
            } else {
                if let Some(pid) = pid {
                    kill_group(pid);
                }
                let _ = child.wait().await;
                (
                    None,
                    "errored".to_owned(),
                    Some(format!("killed after the {}s timeout", s.timeout_secs)),
                )
            }
        }
        (None, None) => match tokio::time::timeout(timeout, child.wait()).await {
            Ok(Ok(status)) => match status.code() {
                Some(0) => (Some(0), "returned".to_owned(), None),
                Some(c) => (
                    Some(i64::from(c)),
                    "errored".to_owned(),
                    Some(format!("exited with {c}")),
                ),
                None => (
                    None,
                    "errored".to_owned(),
                    Some("killed by a signal".to_owned()),
                ),
            },
            Ok(Err(e)) => (
                None,
                "errored".to_owned(),
                Some(format!("wait failed: {e}")),
            ),
            Err(_) => {
                if let Some(pid) = pid {
                    kill_group(pid);
                }
                let _ = child.wait().await;
                (
                    None,
                    "errored".to_owned(),
                    Some(format!("killed after the {}s timeout", s.timeout_secs)),
                )
            }
        },
    }
}

/// Records how a supervised run ended; a Codex run nobody can tell about yet is only marked
/// left open (the adapter settles it later from the rollout and the daemon).
fn record(
    store: &mut Store,
    request_id: &str,
    at: i64,
    code: Option<i64>,
    outcome: &str,
    detail: Option<&str>,
) {
    if outcome == super::codex::LEAVE_OPEN {
        let _ = store.leave_run_open(request_id, at);
        if let Some(d) = detail {
            eprintln!("request {request_id}: left open: {d}");
        }
    } else {
        let _ = store.finish_run(request_id, at, code, outcome, detail);
    }
}

/// Removes a finished run's files: its text, its lock (the outcome is recorded, so nobody
/// needs to ask the lock any more) and its log when the command printed nothing.
fn cleanup(s: &Supervise, lock_file: &Path, log: &Path) {
    linger_before_cleanup();
    let _ = std::fs::remove_file(&s.text_file);
    let sup_log = runs_dir(&s.db).join(format!("{}.sup.log", s.request_id));
    for file in [log, sup_log.as_path()] {
        if std::fs::metadata(file).is_ok_and(|m| m.len() == 0) {
            let _ = std::fs::remove_file(file);
        }
    }
    // Last: once the lock file is gone, a retry of this request may start and write its files.
    let _ = std::fs::remove_file(lock_file);
}

/// Test builds only (`planted-bugs`): `HANDOFFS_TEST_SLOW_CLEANUP=MS` keeps a supervisor
/// that has recorded its run from cleaning up for MS milliseconds, as a loaded machine may.
fn linger_before_cleanup() {
    if !cfg!(feature = "planted-bugs") {
        return;
    }
    if let Some(ms) = std::env::var("HANDOFFS_TEST_SLOW_CLEANUP")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        std::thread::sleep(Duration::from_millis(ms));
    }
}

/// Creates (or truncates) a file only its owner can read.
pub(crate) fn create_private(path: &Path) -> std::io::Result<File> {
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    opts.open(path)
}
