//! Claude Code channels at the protocol level (SPEC §4): the session is open in a person's
//! interactive Claude (a live registry entry, `entrypoint: cli`), and that Claude started
//! `handoffs mcp --agent cc --channels`. Here the test process plays that Claude: it writes the
//! registry entry under its own pid, starts the real binary as its MCP server, and speaks MCP
//! to it with rmcp's client. Channels need a claude.ai login, so the real CLI cannot be driven
//! through them offline; what the test checks is the contract: the capability, one
//! `notifications/claude/channel` per handoff carrying the card and its request id, nothing
//! pushed while the session is busy, and the turn observed through the transcript.

mod common;

use common::*;
use rmcp::model::CustomNotification;
use rmcp::service::{NotificationContext, RunningService};
use rmcp::{ClientHandler, RoleClient, ServiceExt as _};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

const SESSION: &str = "5c0f6a52-3a59-4c1e-9e0e-0c2d5e7d1a11";

/// The client side of the person's Claude: every custom notification it receives.
#[derive(Clone)]
struct Claude {
    seen: mpsc::UnboundedSender<CustomNotification>,
}

impl ClientHandler for Claude {
    async fn on_custom_notification(
        &self,
        notification: CustomNotification,
        _context: NotificationContext<RoleClient>,
    ) {
        let _ = self.seen.send(notification);
    }
}

struct Person {
    w: World,
    config: PathBuf,
    folder: PathBuf,
}

impl Person {
    fn new() -> Person {
        let w = World::new();
        let config = w.dir.path().join("claude");
        let folder = w.dir.path().join("work");
        for d in [config.join("sessions"), folder.clone()] {
            std::fs::create_dir_all(d).unwrap();
        }
        w.ok(&["agent", "add", "planner", "--provider", "demo"]);
        w.ok(&[
            "agent",
            "add",
            "cc",
            "--provider",
            "claude-code",
            "--endpoint",
            SESSION,
            "--cwd",
            &folder.display().to_string(),
            "--set",
            &format!("config_dir={}", config.display()),
        ]);
        let p = Person { w, config, folder };
        p.registry("idle");
        p
    }

    /// The interactive Claude's registry entry: this test process, with the session open.
    fn registry(&self, status: &str) {
        let me = std::process::id();
        let entry = json!({"pid": me, "sessionId": SESSION, "cwd": self.folder,
                           "kind": "interactive", "entrypoint": "cli", "status": status});
        let path = self.config.join("sessions").join(format!("{me}.json"));
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, entry.to_string()).unwrap();
        std::fs::rename(tmp, path).unwrap();
    }

    /// What Claude writes when a pushed card becomes a turn: the prompt naming the request
    /// id, and the reply below it.
    fn transcript_turn(&self, request_id: &str, text: &str) {
        let path = handoffs::adapter::doctor::transcript_path(&self.config, &self.folder, SESSION);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let prompt = json!({"type": "user", "uuid": format!("u-{request_id}"), "parentUuid": null,
            "sessionId": SESSION,
            "message": {"role": "user", "content": format!(
                "<channel source=\"handoffs\" request_id=\"{request_id}\" from=\"planner\">{text}</channel>")}});
        let reply = json!({"type": "assistant", "uuid": format!("a-{request_id}"),
            "parentUuid": format!("u-{request_id}"), "sessionId": SESSION,
            "message": {"role": "assistant", "model": "claude", "stop_reason": "end_turn",
                        "content": [{"type": "text", "text": "done"}]}});
        let mut old = std::fs::read_to_string(&path).unwrap_or_default();
        old.push_str(&format!("{prompt}\n{reply}\n"));
        std::fs::write(&path, old).unwrap();
    }

    fn send(&self, text: &str) -> String {
        self.w.json(&["send", "planner", "cc", text])["message"]["id"]
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

    async fn wait_state(&self, id: &str, states: &[&str], limit: Duration) -> String {
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
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `handoffs mcp --agent cc --channels`, started by this process (its parent, as Claude
    /// would be), spoken to over its stdio.
    async fn channel(
        &self,
    ) -> (
        RunningService<RoleClient, Claude>,
        mpsc::UnboundedReceiver<CustomNotification>,
        tokio::process::Child,
    ) {
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_handoffs"))
            .arg("--db")
            .arg(&self.w.db)
            .args(["mcp", "--agent", "cc", "--channels"])
            .current_dir(&self.folder)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("handoffs mcp starts");
        let io = (child.stdout.take().unwrap(), child.stdin.take().unwrap());
        let (tx, rx) = mpsc::unbounded_channel();
        let client = Claude { seen: tx }
            .serve(io)
            .await
            .expect("the MCP session opens");
        (client, rx, child)
    }
}

async fn next_card(
    rx: &mut mpsc::UnboundedReceiver<CustomNotification>,
    limit: Duration,
) -> Option<CustomNotification> {
    tokio::time::timeout(limit, rx.recv()).await.ok().flatten()
}

fn runs_of(db: &Path, message: &str) -> Vec<handoffs::store::RunRow> {
    let mut store = handoffs::store::Store::open(db).unwrap();
    store
        .read(|tx| -> handoffs::store::Result<_> {
            let d = tx.delivery(message)?.expect("a delivery");
            let core = d.record.core();
            let mut ids: Vec<String> = core
                .earlier_request_ids()
                .iter()
                .map(|r| r.as_str().to_owned())
                .collect();
            ids.push(core.request_id().as_str().to_owned());
            let mut out = Vec::new();
            for r in ids {
                if let Some(run) = tx.run(&r)? {
                    out.push(run);
                }
            }
            Ok(out)
        })
        .unwrap()
}

/// One handoff → one `notifications/claude/channel` event with the card and its request id;
/// the turn is seen through the transcript, and the delivery ends RETURNED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_is_pushed_into_the_interactive_session_as_one_channel_event() {
    let p = Person::new();
    let (client, mut cards, _child) = p.channel().await;
    let caps = client
        .peer_info()
        .expect("the server introduced itself")
        .capabilities
        .clone();
    assert!(
        caps.experimental
            .as_ref()
            .is_some_and(|e| e.contains_key("claude/channel")),
        "the server declares claude/channel: {caps:?}"
    );
    let _engine = p.w.spawn_engine();
    let id = p.send("please review the parser");
    let card = next_card(&mut cards, Duration::from_secs(30))
        .await
        .expect("a channel event within 30 s");
    assert_eq!(card.method, "notifications/claude/channel");
    let params = card.params.clone().unwrap_or(Value::Null);
    assert!(
        params["content"]
            .as_str()
            .is_some_and(|c| c.contains("please review the parser")),
        "{params}"
    );
    assert_eq!(params["meta"]["from"], "planner", "{params}");
    assert_eq!(params["meta"]["message"], id.as_str(), "{params}");
    let request = params["meta"]["request_id"].as_str().unwrap().to_owned();
    p.wait_state(&id, &["ACCEPTED", "RUNNING"], Duration::from_secs(10))
        .await;
    p.transcript_turn(&request, "please review the parser");
    p.wait_state(&id, &["RETURNED"], Duration::from_secs(30))
        .await;
    let runs = runs_of(&p.w.db, &id);
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(runs[0].request_id, request);
    assert_eq!(runs[0].outcome.as_deref(), Some("returned"), "{runs:?}");
    // One event for one handoff.
    assert!(
        next_card(&mut cards, Duration::from_secs(2))
            .await
            .is_none(),
        "a second event for the same handoff"
    );
}

/// G3 through a channel: while the interactive session says busy nothing is pushed, and the
/// delivery waits BUSY with that reason; once it says idle, the card goes out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_pushed_while_the_interactive_session_is_busy() {
    let p = Person::new();
    p.registry("busy");
    let (_client, mut cards, _child) = p.channel().await;
    let _engine = p.w.spawn_engine();
    let id = p.send("while the person types");
    let start = Instant::now();
    let mut status = String::new();
    while start.elapsed() < Duration::from_secs(15) {
        status = p.w.ok(&["status", &id]);
        if p.state(&id) == "BUSY" && status.contains("interactive session") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        status.contains("busy")
            && next_card(&mut cards, Duration::from_secs(2))
                .await
                .is_none(),
        "G3: a card was pushed into a busy interactive session: {status}"
    );
    p.registry("idle");
    let card = next_card(&mut cards, Duration::from_secs(30))
        .await
        .expect("pushed once the session is idle");
    let request = card.params.unwrap()["meta"]["request_id"]
        .as_str()
        .unwrap()
        .to_owned();
    p.transcript_turn(&request, "while the person types");
    p.wait_state(&id, &["RETURNED"], Duration::from_secs(30))
        .await;
}

/// Without a channel in it, an interactive session is never resumed beside: the delivery
/// waits, and says how to open a channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interactive_session_without_a_channel_waits_with_the_way_to_open_one() {
    let p = Person::new();
    let _engine = p.w.spawn_engine();
    let id = p.send("for a session without a channel");
    p.wait_state(&id, &["BUSY"], Duration::from_secs(15)).await;
    let status = p.w.ok(&["status", &id]);
    assert!(status.contains("--channels"), "{status}");
    assert!(runs_of(&p.w.db, &id).is_empty(), "nothing was run");
}

/// The channel closes (the person quits Claude) after taking a card and before a reply: the
/// turn is over, interrupted, and not lost: one resend goes out after the wait, through the
/// next channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_card_whose_session_closed_before_its_reply_is_interrupted() {
    let p = Person::new();
    let (client, mut cards, child) = p.channel().await;
    let _engine = p.w.spawn_engine();
    let id = p.send("the person will quit");
    next_card(&mut cards, Duration::from_secs(30))
        .await
        .expect("pushed");
    // The person quits: Claude ends its MCP server and its registry entry goes.
    drop(client);
    drop(child);
    std::fs::remove_file(
        p.config
            .join("sessions")
            .join(format!("{}.json", std::process::id())),
    )
    .unwrap();
    let start = Instant::now();
    loop {
        let runs = runs_of(&p.w.db, &id);
        if runs.first().is_some_and(|r| r.outcome.is_some()) {
            assert_eq!(runs[0].outcome.as_deref(), Some("interrupted"), "{runs:?}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the closed session's turn was never settled: {runs:?}\n{}",
            p.w.unsettled_report()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The MCP server alone goes (a `/mcp` reconnect, a restart) while Claude and its turn go
/// on: the card's turn is not over, nothing is resent, and the reply makes it RETURNED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_that_closes_while_its_session_goes_on_leaves_the_turn_running() {
    let p = Person::new();
    let (client, mut cards, child) = p.channel().await;
    let _engine = p.w.spawn_engine();
    let id = p.send("the server will restart");
    let card = next_card(&mut cards, Duration::from_secs(30))
        .await
        .expect("pushed");
    let request = card.params.unwrap()["meta"]["request_id"]
        .as_str()
        .unwrap()
        .to_owned();
    drop(client);
    drop(child);
    // Claude (this process) still has the session open; its turn runs on.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let runs = runs_of(&p.w.db, &id);
    assert!(
        runs.len() == 1 && runs[0].outcome.is_none(),
        "G2: the turn was judged over when only its channel closed: {runs:?}"
    );
    p.transcript_turn(&request, "the server will restart");
    p.wait_state(&id, &["RETURNED"], Duration::from_secs(30))
        .await;
    assert_eq!(runs_of(&p.w.db, &id).len(), 1);
}

/// The person's session turns busy between the engine's look (idle) and the take: the
/// listener does not take the card, and it is taken back as busy at the write, which waits
/// and is no refusal (two would end it FAILED, never delivered); once idle, the card goes out.
/// The engine is held just before it queues the card (`HANDOFFS_TEST_HOLD_OPEN`, test builds).
#[cfg(feature = "planted-bugs")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_turns_busy_before_the_take_waits_and_is_no_refusal() {
    let p = Person::new();
    let (_client, mut cards, _child) = p.channel().await;
    let hold = p.w.dir.path().join("hold-open");
    std::fs::create_dir_all(&hold).unwrap();
    let _engine = p.w.spawn_engine_env(&[(
        "HANDOFFS_TEST_HOLD_OPEN".to_owned(),
        hold.display().to_string(),
    )]);
    let id = p.send("at the wrong moment");
    let start = Instant::now();
    while !hold.join("ready").exists() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the write never came"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    p.registry("busy");
    std::fs::write(hold.join("go"), "").unwrap();
    let start = Instant::now();
    let mut history = String::new();
    while start.elapsed() < Duration::from_secs(30) {
        history = p.w.ok(&["status", &id]);
        if history.contains("busy at the write") || history.contains("OWNER_REJECTED") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        history.contains("busy at the write") && !history.contains("OWNER_REJECTED"),
        "G3: a card not taken because the session turned busy was counted as a refusal:\n{history}"
    );
    assert!(
        next_card(&mut cards, Duration::from_millis(200))
            .await
            .is_none(),
        "nothing pushed while busy"
    );
    p.registry("idle");
    let card = next_card(&mut cards, Duration::from_secs(30))
        .await
        .expect("pushed once the session is idle");
    let request = card.params.unwrap()["meta"]["request_id"]
        .as_str()
        .unwrap()
        .to_owned();
    p.transcript_turn(&request, "at the wrong moment");
    p.wait_state(&id, &["RETURNED"], Duration::from_secs(30))
        .await;
}
