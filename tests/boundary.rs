//! G3 at the send boundary, as real processes: a person starts a turn right after the engine's
//! first look at the recipient (between its reservation and its write). The engine looks again
//! at the boundary and waits; the write goes out only once the person's turn is over. The
//! recipient, an HTTP agent served here, logs any write that arrives during that turn.

mod common;

use common::World;
use serde_json::Value;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The recipient's memory: whether the person's turn runs, and what arrived during it.
#[derive(Default)]
struct Session {
    person_typing: bool,
    looks: usize,
    /// The last activity answer could not be read (503).
    unreadable: bool,
    interrupted: Vec<String>,
    blind: Vec<String>,
    taken: Vec<String>,
}

/// Serves the command adapter's HTTP protocol: the first activity answer is "idle", and a
/// person starts a turn right after it; the turn ends only once the engine has been told
/// "busy" `busy_looks` times, so the outcome never depends on timing.
fn racing_recipient(busy_looks: usize) -> (String, Arc<Mutex<Session>>) {
    recipient(0, busy_looks)
}

/// The first `unreadable_looks` activity answers are 503 (the activity cannot be verified);
/// after them, as `racing_recipient` with `busy_looks` (0: never busy).
fn recipient(unreadable_looks: usize, busy_looks: usize) -> (String, Arc<Mutex<Session>>) {
    let session: Arc<Mutex<Session>> = Arc::default();
    let s = session.clone();
    let activity = s.clone();
    let write = s.clone();
    let status = s.clone();
    let app = axum::Router::new()
        .route(
            "/activity",
            axum::routing::get(move || {
                let mut s = activity.lock().unwrap();
                s.looks += 1;
                if s.looks <= unreadable_looks {
                    s.unreadable = true;
                    return std::future::ready((
                        axum::http::StatusCode::SERVICE_UNAVAILABLE,
                        axum::Json(serde_json::json!({})),
                    ));
                }
                s.unreadable = false;
                let look = s.looks - unreadable_looks;
                let busy = s.person_typing;
                if look == 1 && busy_looks > 0 {
                    // Answer idle, then a person starts typing.
                    s.person_typing = true;
                } else if look > busy_looks {
                    // Told busy enough times: the person's turn ends after this answer.
                    s.person_typing = false;
                }
                let status = if busy { "busy" } else { "idle" };
                std::future::ready((
                    axum::http::StatusCode::OK,
                    axum::Json(serde_json::json!({ "status": status })),
                ))
            }),
        )
        .route(
            "/",
            axum::routing::post(move |body: axum::Json<Value>| {
                let mut s = write.lock().unwrap();
                let req = body["request_id"].as_str().unwrap_or("?").to_owned();
                if s.person_typing {
                    s.interrupted.push(req.clone());
                }
                if s.unreadable {
                    s.blind.push(req.clone());
                }
                s.taken.push(req);
                async move { "{}" }
            }),
        )
        .route(
            "/status/{request_id}",
            axum::routing::get(
                move |axum::extract::Path(req): axum::extract::Path<String>| {
                    let known = status.lock().unwrap().taken.contains(&req);
                    async move {
                        if known {
                            (axum::http::StatusCode::OK, r#"{"status":"returned"}"#)
                        } else {
                            (axum::http::StatusCode::NOT_FOUND, "{}")
                        }
                    }
                },
            ),
        );
    (common::serve(app), session)
}

/// Registers `bob` as an HTTP agent at `url` (with its activity and status URLs) and sends
/// him `text` from `alice`; returns the message id.
fn send_to(w: &World, url: &str, text: &str) -> String {
    w.ok(&[
        "agent",
        "add",
        "bob",
        "--provider",
        "command",
        "--set",
        &format!("url={url}"),
        "--set",
        &format!("activity_url={url}activity"),
        "--set",
        &format!("status_url={url}status/{{request_id}}"),
    ]);
    let sent = w.json(&["send", "alice", "bob", text]);
    sent["message"]["id"].as_str().unwrap().to_owned()
}

#[test]
fn a_turn_that_starts_after_the_first_look_makes_the_write_wait() {
    let w = World::new();
    w.ok(&["agent", "add", "alice", "--provider", "demo"]);
    let (url, session) = racing_recipient(3);
    let id = send_to(&w, &url, "after the person's turn, please");
    let _engine = w.spawn_engine();
    w.wait_for(Duration::from_secs(20), |c| c.get("RETURNED") == Some(&1));
    let s = session.lock().unwrap();
    assert!(
        s.interrupted.is_empty(),
        "G3: the write {:?} arrived during the person's turn, which the recipient had reported busy at the send boundary",
        s.interrupted
    );
    assert_eq!(s.taken.len(), 1, "one write");
    assert!(s.looks >= 2, "the engine looked again at the send boundary");
    let history = w.ok(&["status", &id]);
    assert!(
        history.contains("BUSY"),
        "the delivery waited while the person's turn ran:\n{history}"
    );
}

#[test]
fn nothing_is_written_while_the_activity_cannot_be_verified() {
    let w = World::new();
    w.ok(&["agent", "add", "alice", "--provider", "demo"]);
    // Two unreadable answers: the first look and the send boundary's look would both be
    // blind for an engine that took them for idle.
    let (url, session) = recipient(2, 0);
    let id = send_to(&w, &url, "once you can tell you are free");
    let _engine = w.spawn_engine();
    w.wait_for(Duration::from_secs(30), |c| c.get("RETURNED") == Some(&1));
    let s = session.lock().unwrap();
    assert!(
        s.blind.is_empty(),
        "G3: nothing is written while the activity is unknown: {:?} arrived right after an unreadable answer",
        s.blind
    );
    assert_eq!(s.taken.len(), 1, "one write");
    let history = w.ok(&["status", &id]);
    assert!(
        history.contains("UNAVAILABLE"),
        "the delivery waited while the activity could not be verified:\n{history}"
    );
}

/// A recipient whose app checks its session as it writes, and finds it busy three times (a
/// turn began after the engine's look: 423 Locked, nothing written), then takes the write.
/// A busy recipient is waited for: no such answer counts as a refusal (two refusals would end
/// the handoff FAILED, never delivered), and the same request id goes out each time.
#[test]
fn a_recipient_busy_at_the_write_is_waited_for_not_refused() {
    #[derive(Default)]
    struct Writes {
        posts: Vec<String>,
        taken: Vec<String>,
    }
    let writes: Arc<Mutex<Writes>> = Arc::default();
    let post = writes.clone();
    let status = writes.clone();
    let app = axum::Router::new()
        .route(
            "/",
            axum::routing::post(move |body: axum::Json<Value>| {
                let mut s = post.lock().unwrap();
                let req = body["request_id"].as_str().unwrap_or("?").to_owned();
                s.posts.push(req.clone());
                let answer = if s.posts.len() <= 3 {
                    (
                        axum::http::StatusCode::LOCKED,
                        r#"{"error":"a turn is running"}"#,
                    )
                } else {
                    s.taken.push(req);
                    (axum::http::StatusCode::OK, "{}")
                };
                async move { answer }
            }),
        )
        .route(
            "/status/{request_id}",
            axum::routing::get(
                move |axum::extract::Path(req): axum::extract::Path<String>| {
                    let known = status.lock().unwrap().taken.contains(&req);
                    async move {
                        if known {
                            (axum::http::StatusCode::OK, r#"{"status":"returned"}"#)
                        } else {
                            (axum::http::StatusCode::NOT_FOUND, "{}")
                        }
                    }
                },
            ),
        );
    let url = common::serve(app);
    let w = World::new();
    w.ok(&["agent", "add", "alice", "--provider", "demo"]);
    w.ok(&[
        "agent",
        "add",
        "bob",
        "--provider",
        "command",
        "--set",
        &format!("url={url}"),
        "--set",
        &format!("status_url={url}status/{{request_id}}"),
    ]);
    let sent = w.json(&["send", "alice", "bob", "when your turn is over"]);
    let id = sent["message"]["id"].as_str().unwrap().to_owned();
    let _engine = w.spawn_engine();
    w.wait_for(Duration::from_secs(30), |c| {
        c.get("RETURNED") == Some(&1) || c.get("FAILED") == Some(&1)
    });
    let history = w.ok(&["status", &id]);
    assert!(
        w.counts().get("RETURNED") == Some(&1),
        "G3: a recipient busy at the write was not waited for (its 423 answers were taken for refusals):\n{history}"
    );
    let s = writes.lock().unwrap();
    assert_eq!(
        s.posts.len(),
        4,
        "three turned away, then taken: {:?}",
        s.posts
    );
    assert!(
        s.posts.iter().all(|r| *r == s.posts[0]),
        "nothing was written, so the same request id each time: {:?}",
        s.posts
    );
    assert!(
        history.contains("busy at the write") && history.contains("a turn is running"),
        "the delivery said why it waited:\n{history}"
    );
    assert!(
        !history.contains("OWNER_REJECTED"),
        "no refusal was counted:\n{history}"
    );
}

/// An app that stays busy at the write (423 every time, with no activity URL, so every look
/// says idle) is written at on a growing backoff, never in a loop: a handful of tries in 8 s
/// (0.5, 1, 2, 4 s apart), the delivery BUSY all along and never a refusal.
#[test]
fn a_recipient_that_stays_busy_at_the_write_is_tried_on_a_growing_backoff() {
    let posts: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = posts.clone();
    let app = axum::Router::new().route(
        "/",
        axum::routing::post(move |body: axum::Json<Value>| {
            seen.lock()
                .unwrap()
                .push(body["request_id"].as_str().unwrap_or("?").to_owned());
            async move { (axum::http::StatusCode::LOCKED, r#"{"error":"a long turn"}"#) }
        }),
    );
    let url = common::serve(app);
    let w = World::new();
    w.ok(&["agent", "add", "alice", "--provider", "demo"]);
    w.ok(&[
        "agent",
        "add",
        "bob",
        "--provider",
        "command",
        "--set",
        &format!("url={url}"),
    ]);
    let id = w.json(&["send", "alice", "bob", "whenever you can"])["message"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let _engine = w.spawn_engine();
    std::thread::sleep(Duration::from_secs(8));
    let n = posts.lock().unwrap().len();
    assert!(
        (2..=7).contains(&n),
        "G3: a recipient busy at the write was written at {n} times in 8 s (a loop, or never)"
    );
    let status = w.json(&["status", &id]);
    assert_eq!(status["state"], "BUSY", "{status}");
    assert!(w.ok(&["status", &id]).contains("times in a row"));
}

/// The engine stalls right after its send boundary's look said idle, before its write (held
/// there, as a stopped process or a suspended machine would be), and a person starts a turn
/// meanwhile. Its look gone stale, the engine looks again before writing, finds the session
/// busy, and writes nothing until the person's turn is over. Needs the test-only hold of
/// `planted-bugs` builds (`HANDOFFS_TEST_HOLD_ENGINE_WRITE`), so .ci/run runs it there.
#[cfg(feature = "planted-bugs")]
#[test]
fn an_engine_that_stalls_between_its_look_and_its_write_looks_again() {
    let w = World::new();
    w.ok(&["agent", "add", "alice", "--provider", "demo"]);
    let (url, session) = recipient(0, 0);
    let id = send_to(&w, &url, "when you are free");
    let hold = tempfile::tempdir().unwrap();
    let _engine = w.spawn_engine_env(&[(
        "HANDOFFS_TEST_HOLD_ENGINE_WRITE".to_owned(),
        hold.path().to_str().unwrap().to_owned(),
    )]);
    let ready = hold.path().join("ready");
    let until = std::time::Instant::now() + Duration::from_secs(20);
    while !ready.exists() {
        assert!(
            std::time::Instant::now() < until,
            "the engine reached its write"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let looks = {
        let mut s = session.lock().unwrap();
        s.person_typing = true;
        s.looks
    };
    // Past the freshness of a look (2 s), then the engine goes on.
    std::thread::sleep(Duration::from_millis(2_500));
    std::fs::write(hold.path().join("go"), "").unwrap();
    // Whatever the engine does next shows: a write, or the write turned away.
    let until = std::time::Instant::now() + Duration::from_secs(20);
    while session.lock().unwrap().taken.is_empty()
        && !w
            .ok(&["status", &id])
            .contains("the engine stalled since its last look")
    {
        assert!(
            std::time::Instant::now() < until,
            "the engine neither wrote nor turned its write away in 20 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    {
        let s = session.lock().unwrap();
        assert!(
            s.looks > looks,
            "G3: the engine looked again after its stall"
        );
        assert!(
            s.taken.is_empty(),
            "G3: the write {:?} went out on a look taken before the stall, into the person's turn",
            s.taken
        );
    }
    session.lock().unwrap().person_typing = false;
    w.wait_for(Duration::from_secs(20), |c| c.get("RETURNED") == Some(&1));
    let s = session.lock().unwrap();
    assert!(s.interrupted.is_empty(), "{:?}", s.interrupted);
    assert_eq!(
        s.taken.len(),
        1,
        "one write, once the person's turn was over"
    );
}
