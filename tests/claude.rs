//! The claude-code adapter against the real Claude Code CLI, offline: a loopback mock of the
//! Messages API (`tests/mocks/mock_messages.py`), `CLAUDE_CONFIG_DIR` and `HOME` in a
//! temporary folder, and a session created by the CLI itself. Each case is a handoff to that
//! session through a real engine.
//!
//! The CLI is found through `HANDOFFS_CLAUDE_BIN`, `.ci/node/node_modules/.bin/claude` (what
//! `.ci/run` installs) or `PATH`. Without it a case says so and passes, except under `CI=true`,
//! where a missing CLI fails it.

mod common;

use common::*;
use handoffs::store::Store;
use serde_json::{Value, json};
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A Claude session of its own, registered as agent `cc`, and the world around it.
struct Claude {
    w: World,
    mock: MockModel,
    binary: PathBuf,
    config: PathBuf,
    folder: PathBuf,
    session: String,
    env: Vec<(String, String)>,
}

impl Claude {
    fn new() -> Option<Claude> {
        let binary = cli_or_skip("claude", "HANDOFFS_CLAUDE_BIN")?;
        let w = World::new();
        let mock = MockModel::start("mock_messages.py", w.dir.path());
        let home = w.dir.path().join("home");
        let config = w.dir.path().join("claude-config");
        let folder = w.dir.path().join("my project");
        for d in [&home, &config, &folder] {
            std::fs::create_dir_all(d).unwrap();
        }
        let env: Vec<(String, String)> = [
            ("HOME", home.display().to_string()),
            ("CLAUDE_CONFIG_DIR", config.display().to_string()),
            (
                "ANTHROPIC_BASE_URL",
                format!("http://127.0.0.1:{}", mock.port),
            ),
            ("ANTHROPIC_API_KEY", "dummy".to_owned()),
            ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1".to_owned()),
            ("DISABLE_AUTOUPDATER", "1".to_owned()),
            ("CLAUDE_CODE_MAX_RETRIES", "0".to_owned()),
            ("CLAUDE_CODE_EAGER_FLUSH", "1".to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        let session = handoffs::clock::new_id();
        let session = format!(
            "{}-{}-{}-{}-{}",
            &session[0..8],
            &session[8..12],
            &session[12..16],
            &session[16..20],
            &session[20..32]
        );
        let c = Claude {
            w,
            mock,
            binary,
            config,
            folder,
            session,
            env,
        };
        // The person's session: created by the CLI, with one turn.
        let out = c
            .person_turn("the person's first prompt")
            .wait_with_output()
            .unwrap();
        assert!(
            out.status.success(),
            "creating the session failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        c.w.ok(&["agent", "add", "planner", "--provider", "demo"]);
        c.w.ok(&[
            "agent",
            "add",
            "cc",
            "--provider",
            "claude-code",
            "--endpoint",
            &c.session,
            "--cwd",
            &c.folder.display().to_string(),
            "--set",
            &format!("binary={}", c.binary.display()),
            "--set",
            &format!("config_dir={}", c.config.display()),
        ]);
        Some(c)
    }

    /// A turn the person starts themselves (`--session-id` the first time, `--resume` after).
    fn person_turn(&self, text: &str) -> Child {
        let transcript = self.transcript();
        let mut cmd = Command::new(&self.binary);
        cmd.arg("-p");
        if transcript.exists() {
            cmd.args(["--resume", &self.session]);
        } else {
            cmd.args(["--session-id", &self.session]);
        }
        cmd.args([
            "--input-format",
            "stream-json",
            "--output-format",
            "stream-json",
            "--replay-user-messages",
            "--verbose",
        ])
        .current_dir(&self.folder)
        .envs(self.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("claude runs");
        let line = json!({"type": "user", "message": {"role": "user", "content": text}});
        let mut stdin = child.stdin.take().unwrap();
        writeln!(stdin, "{line}").unwrap();
        drop(stdin);
        child
    }

    fn engine(&self) -> Engine {
        self.w.spawn_engine_env(&self.env)
    }

    /// How many model calls (POST /v1/messages) the mock has answered.
    fn message_posts(&self) -> i64 {
        self.mock.call("GET", "/_mock/requests", None)["message_posts"]
            .as_i64()
            .unwrap_or(-1)
    }

    fn transcript(&self) -> PathBuf {
        handoffs::adapter::doctor::transcript_path(&self.config, &self.folder, &self.session)
    }

    fn entries(&self) -> Vec<Value> {
        std::fs::read_to_string(self.transcript())
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Sends a handoff from `planner` (as work when `title` is given); returns its id.
    fn send(&self, text: &str, title: Option<&str>) -> String {
        let mut args = vec!["send", "planner", "cc", text];
        if let Some(t) = title {
            args.extend(["--title", t]);
        }
        let out = self.w.json(&args);
        out["message"]["id"].as_str().unwrap().to_owned()
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

    /// Every request id written for `id`, first to last, with its run.
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

    /// The transcript's user entries carrying `uuid`.
    fn prompts(&self, uuid: &str) -> Vec<Value> {
        self.entries()
            .into_iter()
            .filter(|e| e["type"] == "user" && e["uuid"] == uuid)
            .collect()
    }

    fn find(&self, uuid: &str) -> handoffs::adapter::claude::Found {
        handoffs::adapter::claude::find(&self.transcript(), uuid).unwrap()
    }
}

use handoffs::adapter::claude::Found;

#[test]
fn a_handoff_becomes_one_turn_in_the_session() {
    let Some(c) = Claude::new() else { return };
    let posts = c.message_posts();
    let _engine = c.engine();
    let id = c.send("please review the parser", None);
    c.wait_state(&id, &["RETURNED"], Duration::from_secs(60));
    let runs = c.runs(&id);
    assert_eq!(runs.len(), 1, "one write: {runs:?}");
    let (request, run) = &runs[0];
    assert_eq!(run.as_ref().unwrap().outcome.as_deref(), Some("returned"));
    let prompts = c.prompts(request);
    assert_eq!(prompts.len(), 1, "one prompt with the request id");
    let text = prompts[0]["message"]["content"].to_string();
    assert!(text.contains("please review the parser"), "{text}");
    assert_eq!(c.find(request), Found::Reply);
    assert_eq!(c.message_posts(), posts + 1, "one model call");
}

/// G3 against the real CLI: a handoff that arrives while the person's own turn runs waits for
/// it and becomes a turn of its own below the person's reply; resuming beside the live
/// process would fork the transcript.
#[test]
fn a_handoff_during_the_persons_turn_waits_and_is_its_own_turn() {
    let Some(c) = Claude::new() else { return };
    c.mock.set(&json!({"delay": 12}));
    let person = c.person_turn("the person's slow question");
    // The person's process is live (its registry entry is there) before the handoff is sent.
    let start = Instant::now();
    while !c
        .entries()
        .iter()
        .any(|e| e["type"] == "user" && e["message"]["content"] == "the person's slow question")
    {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the person's turn never began"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let _engine = c.engine();
    let id = c.send("a handoff while the person works", None);
    c.wait_state(
        &id,
        &["BUSY", "RUNNING", "RETURNED"],
        Duration::from_secs(30),
    );
    let reason = c.w.ok(&["status", &id]);
    let out = person.wait_with_output().unwrap();
    assert!(out.status.success());
    c.mock.set(&json!({"delay": 0}));
    c.wait_state(&id, &["RETURNED"], Duration::from_secs(60));
    let runs = c.runs(&id);
    let (request, _) = &runs[0];
    let ours = c.prompts(request);
    assert_eq!(ours.len(), 1, "one prompt");
    // Its parent must be the person's real reply: beside the live process, Claude would
    // have put it below the person's unanswered prompt (with a synthetic answer) or beside it.
    let entries = c.entries();
    let parent = ours[0]["parentUuid"].as_str().unwrap_or("");
    let parent_entry = entries.iter().find(|e| e["uuid"] == parent);
    let persons_reply = parent_entry
        .is_some_and(|e| e["type"] == "assistant" && e["message"]["model"] != "<synthetic>")
        || parent_entry.is_some_and(|e| e["type"] != "user" && e["type"] != "assistant");
    let person_prompt = entries
        .iter()
        .find(|e| e["type"] == "user" && e["message"]["content"] == "the person's slow question")
        .unwrap();
    let person_found =
        handoffs::adapter::claude::find(&c.transcript(), person_prompt["uuid"].as_str().unwrap())
            .unwrap();
    assert!(
        persons_reply && person_found == Found::Reply,
        "G3: the handoff was resumed beside the person's live turn (the transcript forked): \
         its parent is {parent_entry:?}; the person's prompt: {person_found:?}; status while \
         waiting: {reason}"
    );
    assert_eq!(c.find(request), Found::Reply);
    assert!(
        reason.contains("another claude process has session"),
        "it waited with the reason: {reason}"
    );
}

#[test]
fn two_handoffs_in_a_row_are_two_turns_one_after_the_other() {
    let Some(c) = Claude::new() else { return };
    c.mock.set(&json!({"delay": 8}));
    let _engine = c.engine();
    let first = c.send("first handoff", None);
    c.wait_state(&first, &["RUNNING", "ACCEPTED"], Duration::from_secs(30));
    let second = c.send("second handoff", None);
    c.wait_state(&first, &["RETURNED"], Duration::from_secs(60));
    c.wait_state(&second, &["RETURNED"], Duration::from_secs(60));
    let a = c.runs(&first)[0].1.clone().unwrap();
    let b = c.runs(&second)[0].1.clone().unwrap();
    assert!(
        a.ended_at.unwrap() <= b.started_at,
        "G3: the second turn began before the first ended: {a:?} {b:?}"
    );
    assert_eq!(c.find(&a.request_id), Found::Reply);
    assert_eq!(c.find(&b.request_id), Found::Reply);
    let second_prompt = &c.prompts(&b.request_id)[0];
    assert_ne!(
        second_prompt["parentUuid"],
        Value::String(a.request_id.clone()),
        "the second handoff is not folded below the first prompt"
    );
}

#[test]
fn a_session_open_in_an_interactive_session_waits_with_that_reason() {
    let Some(c) = Claude::new() else { return };
    // What the interactive program leaves in the registry while it runs.
    let mut holder = Command::new("sleep").arg("60").spawn().unwrap();
    let sessions = c.config.join("sessions");
    std::fs::create_dir_all(&sessions).unwrap();
    let entry = sessions.join(format!("{}.json", holder.id()));
    std::fs::write(
        &entry,
        json!({"pid": holder.id(), "sessionId": c.session, "cwd": c.folder, "kind": "interactive",
               "entrypoint": "cli", "status": "idle"})
        .to_string(),
    )
    .unwrap();
    let posts = c.message_posts();
    let _engine = c.engine();
    let id = c.send("for the open session", None);
    c.wait_state(&id, &["BUSY"], Duration::from_secs(30));
    std::thread::sleep(Duration::from_secs(2));
    let status = c.w.ok(&["status", &id]);
    assert!(
        status.contains("open in an interactive session"),
        "{status}"
    );
    assert_eq!(c.state(&id), "BUSY");
    assert_eq!(c.message_posts(), posts, "nothing reached the model");
    // The person closes it (a killed program leaves its entry: the dead pid frees it).
    holder.kill().unwrap();
    holder.wait().unwrap();
    c.wait_state(&id, &["RETURNED"], Duration::from_secs(60));
    assert_eq!(c.runs(&id).len(), 1);
}

/// Another Claude process takes the session between the engine's look (nobody held it) and
/// the write: nothing is written, and the handoff waits as for a busy recipient; that is no
/// refusal (two would end it FAILED, never delivered). Once that process is gone it goes out
/// as one turn, with the same request id. The supervisor is held just before it takes the
/// session (`HANDOFFS_TEST_HOLD_OPEN`, test builds only).
#[cfg(feature = "planted-bugs")]
#[test]
fn a_session_taken_between_the_look_and_the_write_waits_and_is_no_refusal() {
    let Some(c) = Claude::new() else { return };
    let hold = c.w.dir.path().join("hold-open");
    std::fs::create_dir_all(&hold).unwrap();
    let mut env = c.env.clone();
    env.push((
        "HANDOFFS_TEST_HOLD_OPEN".to_owned(),
        hold.display().to_string(),
    ));
    let _engine = c.w.spawn_engine_env(&env);
    let id = c.send("for the session taken at the last moment", None);
    let start = Instant::now();
    while !hold.join("ready").exists() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the write never came\n{}",
            c.w.unsettled_report()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The engine looked (nobody held the session) and is about to write: a headless Claude
    // of someone else's takes it (what it leaves in the registry while it runs).
    let mut holder = Command::new("sleep").arg("60").spawn().unwrap();
    let sessions = c.config.join("sessions");
    std::fs::create_dir_all(&sessions).unwrap();
    std::fs::write(
        sessions.join(format!("{}.json", holder.id())),
        json!({"pid": holder.id(), "sessionId": c.session, "cwd": c.folder, "kind": "sdk-cli",
               "entrypoint": "sdk-cli"})
        .to_string(),
    )
    .unwrap();
    let posts = c.message_posts();
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
        "G3: a session taken at the write was counted as a refusal, not waited for:\n{history}"
    );
    assert_eq!(c.state(&id), "BUSY", "{history}");
    assert_eq!(c.message_posts(), posts, "nothing reached the model");
    holder.kill().unwrap();
    holder.wait().unwrap();
    c.wait_state(&id, &["RETURNED"], Duration::from_secs(60));
    let runs = c.runs(&id);
    assert_eq!(
        runs.len(),
        1,
        "one request id: nothing was written the first time"
    );
    assert_eq!(c.find(&runs[0].0), Found::Reply);
}

/// A turn killed mid-way is interrupted; after the wait one resend goes out, with a new
/// request id, and the resend's turn returns.
#[test]
fn a_turn_killed_mid_way_is_resent_once_after_the_wait() {
    let Some(c) = Claude::new() else { return };
    c.mock.set(&json!({"mode": "hang"}));
    let _engine = c.engine();
    let id = c.send("a turn that will be killed", Some("killed work"));
    c.wait_state(&id, &["RUNNING", "ACCEPTED"], Duration::from_secs(30));
    // Wait for the prompt to be in the transcript, then kill the claude process.
    let (first, run) = c.runs(&id)[0].clone();
    let pid = run.unwrap().pid.expect("the run's pid");
    let start = Instant::now();
    while c.prompts(&first).is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the prompt never arrived"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    c.mock.set(&json!({"mode": "ok"}));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    c.wait_state(&id, &["RETURNED"], Duration::from_secs(60));
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
    assert_eq!(c.find(&runs[0].0), Found::NoReply);
    assert_eq!(c.find(&runs[1].0), Found::Reply);
}

/// The process that would report the reply is lost (its supervisor is killed mid-turn): the
/// reply is found in the transcript, and nothing is resent.
#[test]
fn a_lost_report_is_found_in_the_transcript_and_nothing_is_resent() {
    let Some(c) = Claude::new() else { return };
    c.mock.set(&json!({"delay": 10}));
    let _engine = c.engine();
    let id = c.send("a reply nobody reports", Some("lost report"));
    c.wait_state(&id, &["RUNNING", "ACCEPTED"], Duration::from_secs(30));
    let (request, _) = c.runs(&id)[0].clone();
    let supervisor = supervisor_of(&request).expect("the run's supervisor");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(supervisor),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    c.wait_state(&id, &["RETURNED"], Duration::from_secs(60));
    let runs = c.runs(&id);
    assert_eq!(runs.len(), 1, "nothing resent: {runs:?}");
    let run = runs[0].1.clone().unwrap();
    assert_eq!(run.outcome.as_deref(), Some("returned"), "{run:?}");
    assert!(
        run.detail
            .as_deref()
            .unwrap_or("")
            .contains("reply is in the transcript"),
        "{run:?}"
    );
    assert_eq!(c.prompts(&request).len(), 1);
}

/// A lost answer: the supervisor dies right after it gave Claude the message, before the
/// turn reported its start (`HANDOFFS_TEST_SUPERVISOR_DIES_AFTER_WRITE`, test builds only).
/// Nobody can tell whether the message was taken, so the write is not called refused and
/// written again: the delivery is UNCERTAIN, the Claude process goes on by itself, and a
/// history scan of the transcript finds its reply: RETURNED, one prompt, one model call.
#[cfg(feature = "planted-bugs")]
#[test]
fn a_lost_answer_is_uncertain_and_settled_from_the_transcript_without_a_resend() {
    let Some(c) = Claude::new() else { return };
    c.mock.set(&json!({"delay": 3}));
    let posts = c.message_posts();
    let mut env = c.env.clone();
    env.push((
        "HANDOFFS_TEST_SUPERVISOR_DIES_AFTER_WRITE".to_owned(),
        "1".to_owned(),
    ));
    let _engine = c.w.spawn_engine_env(&env);
    let id = c.send("an answer that gets lost", Some("lost answer"));
    c.wait_state(
        &id,
        &["RETURNED", "FAILED", "CANCELLED"],
        Duration::from_secs(90),
    );
    let events = c.w.ok(&["status", &id]);
    let runs = c.runs(&id);
    assert_eq!(
        runs.len(),
        1,
        "G2: a write whose answer was lost was written again: {runs:?}\n{events}"
    );
    let (request, run) = runs[0].clone();
    assert_eq!(
        c.prompts(&request).len(),
        1,
        "G2: the message reached the session twice\n{events}"
    );
    assert_eq!(
        c.message_posts(),
        posts + 1,
        "G2: the message was written twice (two turns asked the model)\n{events}"
    );
    assert_eq!(c.state(&id), "RETURNED", "{events}\n{run:?}");
    assert!(
        events.contains("UNCERTAIN"),
        "the lost answer must make the delivery UNCERTAIN first: {events}"
    );
    assert_eq!(c.find(&request), Found::Reply);
    let run = run.unwrap();
    assert!(
        run.detail.as_deref().unwrap_or("").contains("transcript"),
        "settled from the transcript: {run:?}"
    );
}

/// An unreachable model: each turn errors; the resends are bounded and the handoff ends FAILED.
#[test]
fn an_unreachable_model_errors_and_the_resends_are_bounded() {
    let Some(c) = Claude::new() else { return };
    c.mock.set(&json!({"mode": "error500"}));
    let posts = c.message_posts();
    let _engine = c.engine();
    let id = c.send("to a model that is down", Some("down"));
    c.wait_state(&id, &["FAILED"], Duration::from_secs(90));
    std::thread::sleep(Duration::from_secs(2));
    let runs = c.runs(&id);
    // One write and SPEC's two error resends, each a turn of its own, then no more.
    assert_eq!(runs.len(), 3, "{runs:?}");
    for (r, run) in &runs {
        assert_eq!(
            run.as_ref().unwrap().outcome.as_deref(),
            Some("errored"),
            "{r}"
        );
        assert!(matches!(c.find(r), Found::ApiError(_)), "{r}");
    }
    assert_eq!(c.message_posts(), posts + 3);
    assert_eq!(c.state(&id), "FAILED");
}

/// A model that never answers: Claude waits on it for many minutes, so each turn is killed at
/// the agent's timeout (and everything it started with it), counts as errored, and the
/// resends are bounded: one write and SPEC's two error resends, then FAILED.
#[test]
fn a_model_that_never_answers_is_killed_at_the_timeout_and_the_resends_are_bounded() {
    let Some(c) = Claude::new() else { return };
    c.w.ok(&["agent", "add", "cc", "--set", "timeout=3"]);
    c.mock.set(&json!({"mode": "hang"}));
    let _engine = c.engine();
    let id = c.send("to a model that never answers", Some("silent"));
    c.wait_state(&id, &["FAILED"], Duration::from_secs(120));
    let runs = c.runs(&id);
    assert_eq!(runs.len(), 3, "one write and two error resends: {runs:?}");
    for (request, run) in &runs {
        let run = run.as_ref().unwrap();
        assert_eq!(
            run.outcome.as_deref(),
            Some("errored"),
            "{request}: {run:?}"
        );
        assert!(
            run.detail
                .as_deref()
                .unwrap_or("")
                .contains("after the 3s timeout"),
            "{request}: killed at the timeout: {run:?}"
        );
        assert_eq!(c.prompts(request).len(), 1, "{request}");
        // Killed with everything it started: no Claude process of the run is left.
        assert!(
            handoffs::adapter::command::marked_processes(request).is_empty(),
            "{request}: processes left after the timeout: {:?}",
            handoffs::adapter::command::marked_processes(request)
        );
    }
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(c.runs(&id).len(), 3, "no resend after FAILED");
    assert_eq!(c.state(&id), "FAILED");
}

/// The pid of the `handoffs supervise` process of `request`, from /proc.
fn supervisor_of(request: &str) -> Option<i32> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if args.iter().any(|a| *a == b"supervise")
            && args
                .windows(2)
                .any(|w| w[0] == b"--request-id" && w[1] == request.as_bytes())
        {
            return Some(pid);
        }
    }
    None
}
