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
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, Instant};

/// A `codex app-server` driven from the test (the person's own process), in its own process
/// group so the npm launcher's native child goes with it; or a client of the Codex daemon's
/// socket (the person's session there).
struct AppServer {
    child: Option<Child>,
    out: Out,
    rx: Receiver<Value>,
    next: i64,
    seen: Vec<Value>,
}

/// Where requests go.
enum Out {
    Pipe(Option<ChildStdin>),
    /// To the thread that owns the WebSocket.
    Socket(Option<Sender<Value>>),
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
        AppServer::introduced(Some(child), Out::Pipe(stdin), rx)
    }

    /// A client of the daemon listening on `socket`: WebSocket text frames over the Unix
    /// socket, read and written by a thread of its own.
    fn connect(socket: &Path) -> AppServer {
        use tokio_tungstenite::tungstenite::{self, Message};
        let stream = std::os::unix::net::UnixStream::connect(socket).expect("the daemon's socket");
        stream
            .set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let (mut ws, _) =
            tungstenite::client::client("ws://localhost/", stream).expect("a WebSocket handshake");
        let (tx, rx) = channel::<Value>();
        let (out_tx, out_rx) = channel::<Value>();
        std::thread::spawn(move || {
            loop {
                loop {
                    match out_rx.try_recv() {
                        Ok(v) => {
                            if ws.send(Message::text(v.to_string())).is_err() {
                                return;
                            }
                        }
                        Err(std::sync::mpsc::TryRecvError::Empty) => break,
                        Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                            let _ = ws.close(None);
                            let _ = ws.flush();
                            return;
                        }
                    }
                }
                match ws.read() {
                    Ok(Message::Text(t)) => {
                        if let Ok(v) = serde_json::from_str::<Value>(t.as_str())
                            && tx.send(v).is_err()
                        {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(tungstenite::Error::Io(e))
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) => {}
                    Err(_) => return,
                }
            }
        });
        AppServer::introduced(None, Out::Socket(Some(out_tx)), rx)
    }

    fn introduced(child: Option<Child>, out: Out, rx: Receiver<Value>) -> AppServer {
        let mut a = AppServer {
            child,
            out,
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
        match &mut self.out {
            Out::Pipe(stdin) => {
                let stdin = stdin.as_mut().unwrap();
                writeln!(stdin, "{v}").unwrap();
                stdin.flush().unwrap();
            }
            Out::Socket(tx) => tx.as_ref().unwrap().send(v.clone()).unwrap(),
        }
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
        match &mut self.out {
            Out::Pipe(stdin) => *stdin = None,
            Out::Socket(tx) => *tx = None,
        }
        if let Some(child) = self.child.as_mut() {
            kill_group_of(child);
        }
    }
}

fn kill_group_of(child: &mut Child) {
    let pid = i32::try_from(child.id()).unwrap();
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    let _ = child.wait();
}

/// A Codex daemon of the test's own: `codex app-server --listen unix://`, the server `codex
/// app-server daemon start` runs and the interactive `codex` connects to, listening on the
/// home's control socket.
struct Daemon {
    child: Child,
    socket: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        kill_group_of(&mut self.child);
    }
}

impl Daemon {
    /// A daemon with the person's client connected and the thread open in it.
    fn with_person(c: &Codex) -> (Daemon, AppServer) {
        Daemon::with_person_asking(c, None)
    }

    /// The person's session, opened with `approval_policy` (e.g. "untrusted": every command
    /// of a turn asks the person first).
    fn with_person_asking(c: &Codex, approval_policy: Option<&str>) -> (Daemon, AppServer) {
        let daemon = Daemon::start(c);
        let mut person = AppServer::connect(&daemon.socket);
        let mut params = json!({"threadId": c.thread, "excludeTurns": true});
        if let Some(policy) = approval_policy {
            params["approvalPolicy"] = json!(policy);
        }
        person
            .call("thread/resume", &params)
            .expect("the person opens the thread in the daemon");
        (daemon, person)
    }

    fn start(c: &Codex) -> Daemon {
        let child = Command::new(&c.binary)
            .args(["app-server", "--listen", "unix://"])
            .current_dir(&c.folder)
            .envs(c.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("the Codex daemon runs");
        let socket = handoffs::adapter::codex::daemon::socket_path(&c.home);
        let d = Daemon { child, socket };
        let start = Instant::now();
        while std::os::unix::net::UnixStream::connect(&d.socket).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the daemon never listened on {}",
                d.socket.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        d
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
    /// The engine's folder of run files: beside a SQLite database; for PostgreSQL, in the
    /// state folder of the engine's `HOME` (this test gives it the world's folder).
    fn runs_dir(&self) -> std::path::PathBuf {
        let dir = handoffs::adapter::command::runs_dir(&self.w.db);
        if !common::is_postgres(&self.w.db) {
            return dir;
        }
        let name = dir.file_name().expect("a runs folder").to_owned();
        self.w.dir.path().join(".local/state/handoffs").join(name)
    }

    /// Waits until a process holds the thread's writer lock: Codex may take it a moment
    /// after it answers `thread/resume`, and an engine that looks before then rightly finds
    /// the thread free.
    fn wait_held(&self) {
        let lock = handoffs::adapter::codex::writer_lock(&self.home, &self.thread);
        let start = Instant::now();
        while handoffs::adapter::codex::lock_holders_checked(&lock)
            .unwrap_or_default()
            .is_empty()
        {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "nobody took the writer lock {} of the resumed thread",
                lock.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

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
    c.wait_held();
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
        let Some(run) = run.as_ref() else {
            panic!(
                "{r} has no run row; what its supervisor said: {:?}\n{}",
                std::fs::read_to_string(c.runs_dir().join(format!("{r}.sup.log"))),
                c.w.ok(&["status", &id])
            );
        };
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

/// Waits until the status of the delivery says BUSY with `reason` in it; false after `limit`.
fn busy_with(c: &Codex, id: &str, reason: &str, limit: Duration) -> (bool, String) {
    let start = Instant::now();
    loop {
        let status = c.w.ok(&["status", id]);
        if c.state(id) == "BUSY" && status.contains(reason) {
            return (true, status);
        }
        if start.elapsed() > limit {
            return (false, status);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The person's session runs in the Codex daemon (as the interactive `codex` does by
/// default): the handoff goes through the daemon's socket into that session as one new turn,
/// which the person's client sees start and complete with the handoff's request id.
#[test]
fn a_handoff_reaches_the_persons_session_through_the_codex_daemon() {
    let Some(c) = Codex::new(None) else { return };
    let (_daemon, mut person) = Daemon::with_person(&c);
    let doctor = c.w.run(&["doctor"]);
    let said = String::from_utf8_lossy(&doctor.stdout);
    assert!(said.contains("is open in the Codex daemon"), "{said}");
    let _engine = c.engine();
    let id = c.send("into the person's open session", None);
    c.wait_state(&id, &["RETURNED"], Duration::from_secs(90));
    let runs = c.runs(&id);
    assert_eq!(runs.len(), 1, "one write: {runs:?}");
    let (request, run) = (runs[0].0.clone(), runs[0].1.clone().unwrap());
    assert_eq!(run.outcome.as_deref(), Some("returned"), "{run:?}");
    assert!(
        run.detail
            .as_deref()
            .unwrap_or("")
            .contains("through the Codex daemon"),
        "the write went through the daemon: {run:?}"
    );
    // The person's own client saw the handoff arrive as a turn of its own, and end.
    let started = person.wait_for(
        |m| {
            m["method"] == "item/started"
                && m["params"]["item"]["type"] == "userMessage"
                && m["params"]["item"]["clientId"] == request.as_str()
        },
        Duration::from_secs(30),
    );
    let turn = started["params"]["turnId"].as_str().unwrap().to_owned();
    person.wait_for(
        |m| m["method"] == "turn/completed" && m["params"]["turn"]["id"] == turn.as_str(),
        Duration::from_secs(30),
    );
    assert_eq!(c.find(&request), Found::Completed);
    // The daemon still serves the person's thread.
    let loaded = person.call("thread/loaded/list", &json!({})).unwrap();
    assert!(
        loaded["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t == c.thread.as_str()),
        "{loaded}"
    );
}

/// G3 through the daemon: while the person's own turn runs in their session, the handoff
/// waits BUSY with that reason and nothing is written; after the turn it goes out as a turn
/// of its own, never folded into the person's.
#[test]
fn a_handoff_waits_while_the_persons_codex_turn_runs() {
    let Some(c) = Codex::new(None) else { return };
    let (_daemon, mut person) = Daemon::with_person(&c);
    let started = person
        .call(
            "turn/start",
            &json!({"threadId": c.thread, "input": [{"type": "text", "text": "[delay=12] the person's slow prompt"}]}),
        )
        .expect("the person's turn starts");
    let persons_turn = started["turn"]["id"].as_str().unwrap().to_owned();
    let _engine = c.engine();
    let id = c.send("while the person works", None);
    let (held, status) = busy_with(
        &c,
        &id,
        "a turn is running in the Codex session",
        Duration::from_secs(8),
    );
    let tried = c.runs(&id)[0].1.is_some();
    assert!(
        held && !tried,
        "G3: the handoff was not held back while the person's Codex turn ran: {status}"
    );
    person.wait_for(
        |m| m["method"] == "turn/completed" && m["params"]["turn"]["id"] == persons_turn.as_str(),
        Duration::from_secs(60),
    );
    c.wait_state(&id, &["RETURNED"], Duration::from_secs(90));
    let runs = c.runs(&id);
    assert_eq!(runs.len(), 1, "one write: {runs:?}");
    let ours = c.turn_of(&runs[0].0);
    assert!(ours.is_some(), "the handoff is in the rollout");
    assert_ne!(
        ours.as_deref(),
        Some(persons_turn.as_str()),
        "G3: the handoff was folded into the person's running turn"
    );
    assert_eq!(c.find(&runs[0].0), Found::Completed);
}

/// In the daemon a turn outlives the supervisor that wrote it: a supervisor killed mid-turn
/// leaves the turn running in the person's session, and the engine waits for it to end
/// (RETURNED from the rollout) instead of calling it interrupted and resending beside it.
#[test]
fn a_turn_in_the_daemon_outlives_its_killed_supervisor_and_is_not_resent() {
    let Some(c) = Codex::new(None) else { return };
    let (_daemon, _person) = Daemon::with_person(&c);
    let _engine = c.engine();
    let id = c.send("[delay=8] a slow handoff", None);
    c.wait_state(&id, &["RUNNING", "ACCEPTED"], Duration::from_secs(60));
    let (request, _) = c.runs(&id)[0].clone();
    let start = Instant::now();
    while c.turn_of(&request).is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the turn never began"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let sups = supervisors(&c.w.db);
    assert_eq!(sups.len(), 1, "one supervisor: {sups:?}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(sups[0]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    c.wait_state(
        &id,
        &["RETURNED", "FAILED", "CANCELLED"],
        Duration::from_secs(90),
    );
    let runs = c.runs(&id);
    assert_eq!(
        runs.len(),
        1,
        "G2: a turn still running in the daemon was resent: {runs:?}"
    );
    let run = runs[0].1.clone().unwrap();
    assert_eq!(run.outcome.as_deref(), Some("returned"), "{run:?}");
    // Settled from the daemon's own list of the thread's turns (full view), not by a guess.
    assert!(
        run.detail
            .as_deref()
            .unwrap_or("")
            .contains("the daemon's list of turns shows the turn completed"),
        "{run:?}"
    );
    assert_eq!(c.find(&request), Found::Completed);
}

/// G3 at the send boundary, against the real CLI: the person's turn starts in the moment
/// between the engine's last look (idle) and the write. Written through Codex's queue the
/// handoff waits for that turn and becomes its own; a bare `turn/start` (the planted
/// `turn_start_only`, whose looks are right) would fold it into the person's turn. The
/// supervisor is held just before its write (`HANDOFFS_TEST_HOLD_WRITE`, test builds only).
#[cfg(feature = "planted-bugs")]
#[test]
fn a_person_turn_that_starts_between_the_look_and_the_write_is_never_folded_into() {
    let Some(c) = Codex::new(None) else { return };
    let (_daemon, mut person) = Daemon::with_person(&c);
    let hold = c.w.dir.path().join("hold");
    std::fs::create_dir_all(&hold).unwrap();
    let mut env = c.env.clone();
    env.push((
        "HANDOFFS_TEST_HOLD_WRITE".to_owned(),
        hold.display().to_string(),
    ));
    let _engine = c.w.spawn_engine_env(&env);
    let id = c.send("written at the wrong moment", None);
    let start = Instant::now();
    while !hold.join("ready").exists() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the write never came\n{}",
            c.w.unsettled_report()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The engine looked (idle) and is about to write: now the person starts typing.
    let started = person
        .call(
            "turn/start",
            &json!({"threadId": c.thread, "input": [{"type": "text", "text": "[delay=6] the person's prompt"}]}),
        )
        .expect("the person's turn starts");
    let persons_turn = started["turn"]["id"].as_str().unwrap().to_owned();
    person.wait_for(
        |m| m["method"] == "turn/started" && m["params"]["turn"]["id"] == persons_turn.as_str(),
        Duration::from_secs(30),
    );
    std::fs::write(hold.join("go"), "").unwrap();
    c.wait_state(&id, &["RETURNED", "FAILED"], Duration::from_secs(90));
    let runs = c.runs(&id);
    let ours = c.turn_of(&runs[0].0);
    assert_ne!(
        ours.as_deref(),
        Some(persons_turn.as_str()),
        "G3: the handoff was folded into the person's turn that began between the look and the write"
    );
    assert_eq!(c.state(&id), "RETURNED");
    assert_eq!(runs.len(), 1, "{runs:?}");
}

/// The person's own Codex takes the thread between the engine's look (idle, nobody holds it)
/// and the write: Codex answers "active writer", nothing is written, and the handoff waits
/// as for a busy recipient; that is no refusal (two would end it FAILED, never delivered).
/// Once the person's process is gone it goes out as one turn, with the same request id. The
/// supervisor is held just before it opens the thread (`HANDOFFS_TEST_HOLD_OPEN`, test builds
/// only).
#[cfg(feature = "planted-bugs")]
#[test]
fn a_thread_taken_between_the_look_and_the_write_waits_and_is_no_refusal() {
    let Some(c) = Codex::new(None) else { return };
    let hold = c.w.dir.path().join("hold-open");
    std::fs::create_dir_all(&hold).unwrap();
    let mut env = c.env.clone();
    env.push((
        "HANDOFFS_TEST_HOLD_OPEN".to_owned(),
        hold.display().to_string(),
    ));
    let _engine = c.w.spawn_engine_env(&env);
    let id = c.send("for the thread taken at the last moment", None);
    let start = Instant::now();
    while !hold.join("ready").exists() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the write never came\n{}",
            c.w.unsettled_report()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The engine looked (nobody held the thread) and is about to write: the person opens it.
    let mut person = AppServer::start(&c.binary, &c.env, &c.folder);
    person
        .call(
            "thread/resume",
            &json!({"threadId": c.thread, "excludeTurns": true}),
        )
        .expect("the person resumes the thread");
    std::fs::write(hold.join("go"), "").unwrap();
    let start = Instant::now();
    let mut history = String::new();
    while start.elapsed() < Duration::from_secs(30) {
        history = c.w.ok(&["status", &id]);
        if history.contains("busy at the write") || history.contains("OWNER_REJECTED") {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        history.contains("busy at the write") && !history.contains("OWNER_REJECTED"),
        "G3: a thread taken at the write was counted as a refusal, not waited for:\n{history}"
    );
    assert_eq!(c.state(&id), "BUSY", "{history}");
    person.stop();
    c.wait_state(&id, &["RETURNED"], Duration::from_secs(90));
    let runs = c.runs(&id);
    assert_eq!(
        runs.len(),
        1,
        "one request id: nothing was written the first time"
    );
    assert_eq!(c.find(&runs[0].0), Found::Completed);
}

/// A lost answer (the request went out, its answer never came back): nobody can tell whether
/// the message started, so the write is not called errored and resent; the delivery is
/// UNCERTAIN, and the rollout shows its turn ran: RETURNED, one write. Through the daemon the
/// message starts within milliseconds, so it is already out of the queue when the supervisor
/// looks (`HANDOFFS_TEST_LOSE_ANSWER`, test builds only).
#[cfg(feature = "planted-bugs")]
#[test]
fn a_lost_answer_is_settled_from_the_rollout_and_nothing_is_resent() {
    let Some(c) = Codex::new(None) else { return };
    let (_daemon, _person) = Daemon::with_person(&c);
    let mut env = c.env.clone();
    env.push(("HANDOFFS_TEST_LOSE_ANSWER".to_owned(), "1".to_owned()));
    let _engine = c.w.spawn_engine_env(&env);
    let id = c.send("[delay=2] an answer that gets lost", None);
    c.wait_state(
        &id,
        &["RETURNED", "FAILED", "CANCELLED"],
        Duration::from_secs(90),
    );
    let runs = c.runs(&id);
    assert_eq!(
        runs.len(),
        1,
        "G2: a write whose answer was lost was resent: {runs:?}"
    );
    assert_eq!(
        c.state(&id),
        "RETURNED",
        "{}\n{runs:?}",
        c.w.ok(&["status", &id])
    );
    assert_eq!(c.find(&runs[0].0), Found::Completed);
    let events = c.w.ok(&["status", &id]);
    assert!(events.contains("UNCERTAIN"), "{events}");
}

/// A turn through the daemon that needs an approval, with no `approvals` setting: the
/// person's open session answers it, and meanwhile the delivery says that it waits for them
/// (not only RUNNING). Once they answer, the turn ends and the note is gone.
#[test]
fn a_turn_waiting_for_the_persons_approval_says_so_and_goes_on_once_answered() {
    let Some(c) = Codex::new(None) else { return };
    let (_daemon, mut person) = Daemon::with_person_asking(&c, Some("untrusted"));
    let _engine = c.engine();
    let id = c.send(
        "[tool=touch made-by-tool] a handoff that runs a command",
        None,
    );
    let asked = person.wait_for(
        |m| m["method"] == "item/commandExecution/requestApproval",
        Duration::from_secs(60),
    );
    let start = Instant::now();
    loop {
        let status = c.w.ok(&["status", &id]);
        if status.contains("waiting for an approval in the person's Codex session") {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the delivery never said it waits for the person's approval:\n{status}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    person.send(&json!({"id": asked["id"], "result": {"decision": "accept"}}));
    c.wait_state(&id, &["RETURNED"], Duration::from_secs(60));
    assert!(
        c.folder.join("made-by-tool").exists(),
        "the person's approval let the command run"
    );
    let status = c.w.ok(&["status", &id]);
    assert!(!status.contains("waiting for an approval"), "{status}");
    assert_eq!(c.runs(&id).len(), 1);
}

/// With `approvals=accept` or `decline` set, the supervisor answers the turn's approval
/// requests in the daemon too: nobody needs to be at the session, and the turn never stalls
/// to its timeout (without the answer it does: the person's client here never answers).
#[test]
fn approvals_set_on_the_agent_are_answered_through_the_daemon() {
    for (setting, file) in [
        ("accept", "accepted-by-agent"),
        ("decline", "declined-by-agent"),
    ] {
        let Some(c) = Codex::new(None) else { return };
        let (_daemon, _person) = Daemon::with_person_asking(&c, Some("untrusted"));
        c.w.ok(&[
            "agent",
            "add",
            "cx",
            "--set",
            &format!("approvals={setting}"),
        ]);
        let _engine = c.engine();
        let id = c.send(
            &format!("[tool=touch {file}] a handoff that runs a command"),
            None,
        );
        c.wait_state(&id, &["RETURNED"], Duration::from_secs(60));
        let runs = c.runs(&id);
        assert_eq!(runs.len(), 1, "{runs:?}");
        assert_eq!(
            runs[0].1.as_ref().unwrap().outcome.as_deref(),
            Some("returned")
        );
        let log = std::fs::read_to_string(c.runs_dir().join(format!("{}.log", runs[0].0)))
            .unwrap_or_default();
        assert!(
            log.contains("item/commandExecution/requestApproval"),
            "Codex asked for no approval: {log}"
        );
        assert_eq!(
            c.folder.join(file).exists(),
            setting == "accept",
            "approvals={setting} was not the answer Codex got"
        );
    }
}
