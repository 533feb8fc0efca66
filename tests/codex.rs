//! The codex adapter against the real Codex CLI, offline: a loopback mock of the Responses API
//! (`tests/mocks/mock_responses.py`), a temporary `CODEX_HOME` whose config points at it, and a
//! thread created by `codex app-server` itself. Each case is a handoff to that thread through a
//! real engine.
//!
//! The CLI is found through `HANDOFFS_CODEX_BIN`, `.ci/node/node_modules/.bin/codex` (what
//! `.ci/run` installs) or `PATH`. Without it a case says so and passes, except under `CI=true`,
//! where a missing CLI fails it.

mod common;

use common::*;
use handoffs::adapter::codex::Found;
use handoffs::store::Store;
use serde_json::{Value, json};
use std::io::{BufRead as _, Write as _};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

/// A `codex app-server` driven from the test (the person's own process), in its own process
/// group so the npm launcher's native child goes with it.
struct AppServer {
    child: Child,
    stdin: Option<ChildStdin>,
    rx: Receiver<Value>,
    next: i64,
    seen: Vec<Value>,
}

impl Drop for AppServer {
    fn drop(&mut self) {
        self.stop();
    }
}

impl AppServer {
    fn start(binary: &Path, env: &[(String, String)], cwd: &Path) -> AppServer {
        let mut child = Command::new(binary)
            .arg("app-server")
            .current_dir(cwd)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("codex app-server runs");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Ok(v) = serde_json::from_str::<Value>(&line)
                    && tx.send(v).is_err()
                {
                    break;
                }
            }
        });
        let stdin = child.stdin.take();
        let mut a = AppServer {
            child,
            stdin,
            rx,
            next: 0,
            seen: Vec::new(),
        };
        a.call(
            "initialize",
            &json!({"clientInfo": {"name": "test", "version": "0"},
                   "capabilities": {"experimentalApi": true}}),
        )
        .expect("initialize");
        a.send(&json!({"method": "initialized"}));
        a
    }

    fn send(&mut self, v: &Value) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{v}").unwrap();
        stdin.flush().unwrap();
    }

    fn call(&mut self, method: &str, params: &Value) -> Result<Value, String> {
        self.next += 1;
        let id = self.next;
        self.send(&json!({"id": id, "method": method, "params": params}));
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let msg = self
                .rx
                .recv_timeout(left)
                .map_err(|_| format!("no answer to {method}"))?;
            if msg.get("id").and_then(Value::as_i64) == Some(id) && msg.get("method").is_none() {
                if let Some(e) = msg.get("error") {
                    return Err(e.to_string());
                }
                return Ok(msg["result"].clone());
            }
            self.seen.push(msg);
        }
    }

    /// Waits for a notification `pred` accepts (looking at those already seen first).
    fn wait_for(&mut self, pred: impl Fn(&Value) -> bool, limit: Duration) -> Value {
        if let Some(i) = self.seen.iter().position(&pred) {
            return self.seen.remove(i);
        }
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let msg = self
                .rx
                .recv_timeout(left)
                .expect("the notification came in time");
            if pred(&msg) {
                return msg;
            }
            self.seen.push(msg);
        }
    }

    fn stop(&mut self) {
        self.stdin = None;
        let pid = i32::try_from(self.child.id()).unwrap();
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = self.child.wait();
    }
}

/// A Codex thread of its own, registered as agent `cx`, and the world around it.
struct Codex {
    w: World,
    mock: MockModel,
    binary: PathBuf,
    home: PathBuf,
    folder: PathBuf,
    thread: String,
    env: Vec<(String, String)>,
}

impl Codex {
    fn new(timeout_secs: Option<u64>) -> Option<Codex> {
        let binary = cli_or_skip("codex", "HANDOFFS_CODEX_BIN")?;
        let w = World::new();
        let mock = MockModel::start("mock_responses.py", w.dir.path());
        let home = w.dir.path().join("codex-home");
        let folder = w.dir.path().join("work");
        for d in [&home, &folder] {
            std::fs::create_dir_all(d).unwrap();
        }
        let config = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mocks/config.example.toml"),
        )
        .unwrap()
        .replace("PORT", &mock.port.to_string());
        std::fs::write(home.join("config.toml"), config).unwrap();
        let env: Vec<(String, String)> = vec![
            ("CODEX_HOME".to_owned(), home.display().to_string()),
            ("HOME".to_owned(), w.dir.path().display().to_string()),
        ];
        // The person's thread: started by Codex, with one turn.
        let mut person = AppServer::start(&binary, &env, &folder);
        let started = person
            .call(
                "thread/start",
                &json!({"cwd": folder, "approvalPolicy": "never", "sandbox": "read-only"}),
            )
            .expect("thread/start");
        let thread = started["thread"]["id"].as_str().unwrap().to_owned();
        person
            .call(
                "turn/start",
                &json!({"threadId": thread, "input": [{"type": "text", "text": "the person's first prompt"}]}),
            )
            .expect("turn/start");
        person.wait_for(|m| m["method"] == "turn/completed", Duration::from_secs(60));
        drop(person);
        let c = Codex {
            w,
            mock,
            binary,
            home,
            folder,
            thread,
            env,
        };
        c.w.ok(&["agent", "add", "planner", "--provider", "demo"]);
        let mut args: Vec<String> = [
            "agent",
            "add",
            "cx",
            "--provider",
            "codex",
            "--endpoint",
            &c.thread,
            "--cwd",
            &c.folder.display().to_string(),
            "--set",
            &format!("binary={}", c.binary.display()),
            "--set",
            &format!("home={}", c.home.display()),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        if let Some(t) = timeout_secs {
            args.extend(["--set".to_owned(), format!("timeout={t}")]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        c.w.ok(&args);
        Some(c)
    }

    fn engine(&self) -> Engine {
        self.w.spawn_engine_env(&self.env)
    }

    fn send(&self, text: &str, title: Option<&str>) -> String {
        let mut args = vec!["send", "planner", "cx", text];
        if let Some(t) = title {
            args.extend(["--title", t]);
        }
        self.w.json(&args)["message"]["id"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    fn state(&self, id: &str) -> String {
        self.w.json(&["status", id])["state"]
            .as_str()
            .unwrap_or("?")
            .to_owned()
    }

    fn wait_state(&self, id: &str, states: &[&str], limit: Duration) -> String {
        let start = Instant::now();
        loop {
            let s = self.state(id);
            if states.contains(&s.as_str()) {
                return s;
            }
            assert!(
                start.elapsed() <= limit,
                "{id} is {s}, not {states:?}, after {limit:?}\n{}\n{}",
                self.w.ok(&["status", id]),
                self.w.unsettled_report()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn runs(&self, id: &str) -> Vec<(String, Option<handoffs::store::RunRow>)> {
        let mut store = Store::open(&self.w.db).unwrap();
        store
            .read(|tx| -> handoffs::store::Result<_> {
                let d = tx.delivery(id)?.expect("a delivery");
                let core = d.record.core();
                let mut ids: Vec<String> = core
                    .earlier_request_ids()
                    .iter()
                    .map(|r| r.as_str().to_owned())
                    .collect();
                ids.push(core.request_id().as_str().to_owned());
                let mut out = Vec::new();
                for r in ids {
                    let run = tx.run(&r)?;
                    out.push((r, run));
                }
                Ok(out)
            })
            .unwrap()
    }

    fn find(&self, request: &str) -> Found {
        handoffs::adapter::codex::find(&self.home, &self.thread, request).unwrap()
    }

    /// The turn each user message carrying a client id of ours went into (from the rollout).
    fn turn_of(&self, request: &str) -> Option<String> {
        let path =
            handoffs::adapter::doctor::find_rollout(&self.home.join("sessions"), &self.thread)?;
        let text = std::fs::read_to_string(path).ok()?;
        text.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| {
                v["type"] == "event_msg"
                    && v["payload"]["type"] == "item_completed"
                    && v["payload"]["item"]["client_id"] == request
            })
            .and_then(|v| v["payload"]["turn_id"].as_str().map(str::to_owned))
    }
}

#[test]
fn a_handoff_becomes_one_turn_in_the_thread() {
    let Some(c) = Codex::new(None) else { return };
    let _engine = c.engine();
    let id = c.send("please review the parser", None);
    c.wait_state(&id, &["RETURNED"], Duration::from_secs(90));
    let runs = c.runs(&id);
    assert_eq!(runs.len(), 1, "one write: {runs:?}");
    let run = runs[0].1.clone().unwrap();
    assert_eq!(run.outcome.as_deref(), Some("returned"), "{run:?}");
    // The receipt names the Codex version.
    assert!(
        run.detail.as_deref().unwrap_or("").starts_with("codex 0."),
        "{run:?}"
    );
    assert_eq!(c.find(&runs[0].0), Found::Completed);
}

/// G3 against the real CLI: a second handoff while the first one's slow turn runs becomes a
/// turn of its own, after the first, never folded into it.
#[test]
fn a_second_handoff_during_a_slow_turn_is_its_own_turn() {
    let Some(c) = Codex::new(None) else { return };
    let _engine = c.engine();
    let first = c.send("[delay=10] a slow first handoff", None);
    c.wait_state(&first, &["RUNNING", "ACCEPTED"], Duration::from_secs(60));
    let second = c.send("a second handoff", None);
    c.wait_state(&first, &["RETURNED"], Duration::from_secs(90));
    c.wait_state(&second, &["RETURNED"], Duration::from_secs(90));
    let a = c.runs(&first)[0].0.clone();
    let b = c.runs(&second)[0].0.clone();
    let (ta, tb) = (c.turn_of(&a), c.turn_of(&b));
    assert!(ta.is_some() && tb.is_some(), "both in the rollout");
    assert_ne!(
        ta, tb,
        "G3: the second handoff was folded into the first one's running turn"
    );
    assert_eq!(c.find(&a), Found::Completed);
    assert_eq!(c.find(&b), Found::Completed);
}

/// The person's own Codex holds the thread: the handoff waits with that reason, and goes out
/// as one turn once the person's process is gone.
#[test]
fn a_thread_held_by_another_codex_waits_with_that_reason() {
    let Some(c) = Codex::new(None) else { return };
    let mut person = AppServer::start(&c.binary, &c.env, &c.folder);
    person
        .call(
            "thread/resume",
            &json!({"threadId": c.thread, "excludeTurns": true}),
        )
        .expect("the person resumes the thread");
    let _engine = c.engine();
    let id = c.send("for the held thread", None);
    let start = Instant::now();
    let mut reason = String::new();
    let mut held = false;
    while start.elapsed() < Duration::from_secs(30) {
        reason = c.w.ok(&["status", &id]);
        held = c.state(&id) == "BUSY" && reason.contains("open in another Codex process");
        if held {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Held back: BUSY with the reason, and no write tried (a write into a held thread is
    // refused by Codex at best, and folded into the person's turn through a shared process).
    let tried = c.runs(&id)[0].1.is_some();
    assert!(
        held && !tried,
        "G3: the handoff was not held back while another Codex process held the thread: {reason}\n{}",
        c.w.ok(&["status", &id])
    );
    person.stop();
    c.wait_state(&id, &["RETURNED"], Duration::from_secs(90));
    assert_eq!(c.runs(&id).len(), 1);
}

/// A model that never answers: the turn makes no progress past the agent's timeout, is
/// interrupted and counts as errored; the resends are bounded and the handoff ends FAILED.
#[test]
fn a_model_that_never_answers_is_interrupted_at_the_timeout_and_resent_within_bounds() {
    let Some(c) = Codex::new(Some(4)) else { return };
    c.mock.set(&json!({"mode": "hang"}));
    let _engine = c.engine();
    let id = c.send("to a model that hangs", Some("hang"));
    c.wait_state(&id, &["FAILED"], Duration::from_secs(120));
    let runs = c.runs(&id);
    assert_eq!(runs.len(), 3, "the write and two error resends: {runs:?}");
    for (r, run) in &runs {
        let run = run.as_ref().unwrap();
        assert_eq!(run.outcome.as_deref(), Some("errored"), "{r}: {run:?}");
        assert!(
            run.detail
                .as_deref()
                .unwrap_or("")
                .contains("no progress in 4s"),
            "{run:?}"
        );
        assert_eq!(c.find(r), Found::Aborted, "{r}");
    }
}

/// A turn killed mid-way (its app-server dies) is interrupted; after the wait one resend goes
/// out, with a new request id, and its turn completes.
#[test]
fn a_turn_killed_mid_way_is_resent_once_after_the_wait() {
    let Some(c) = Codex::new(None) else { return };
    c.mock.set(&json!({"delay": 60}));
    let _engine = c.engine();
    let id = c.send("a turn that will be killed", Some("killed work"));
    c.wait_state(&id, &["RUNNING", "ACCEPTED"], Duration::from_secs(60));
    let (first, run) = c.runs(&id)[0].clone();
    let pid = run.unwrap().pid.expect("the run's pid (the app-server)");
    // The turn is under way: its user message is in the rollout.
    let start = Instant::now();
    while c.turn_of(&first).is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the turn never began"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    c.mock.set(&json!({"delay": 0}));
    nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    c.wait_state(&id, &["RETURNED"], Duration::from_secs(90));
    let runs = c.runs(&id);
    assert_eq!(runs.len(), 2, "one resend: {runs:?}");
    assert_eq!(
        runs[0].1.as_ref().unwrap().outcome.as_deref(),
        Some("interrupted")
    );
    assert_eq!(
        runs[1].1.as_ref().unwrap().outcome.as_deref(),
        Some("returned")
    );
    assert_eq!(c.find(&runs[1].0), Found::Completed);
    assert_ne!(c.turn_of(&runs[0].0), c.turn_of(&runs[1].0));
}
