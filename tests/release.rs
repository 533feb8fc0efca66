//! G5 (honest release) and liveness as real processes: a write whose outcome nobody can tell
//! (the recipient answers 500 without taking it) leaves the delivery UNCERTAIN; the engine
//! scans the recipient's history until enough complete scans, far enough apart, found
//! nothing, and only then cancels. The recipient, an HTTP agent served here, keeps its own
//! log of every history query it answered, so the test judges the release from the
//! recipient's side, not from the engine's record.

mod common;

use common::{FAST_POLICY, World};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One history query the recipient answered: when, in which round of queries, and whether
/// it said "not found" (a complete answer) or could not answer (503, an incomplete scan).
#[derive(Clone, Debug)]
struct Answer {
    at: Instant,
    round: usize,
    not_found: bool,
}

/// Queries closer together than this belong to one round (one look by the engine, which may
/// ask more than once); the test policy keeps scans at least 300 ms apart.
const SAME_ROUND: Duration = Duration::from_millis(150);

#[derive(Default)]
struct Recipient {
    /// The request id of each write, in order.
    writes: Vec<String>,
    answers: Vec<Answer>,
}

impl Recipient {
    /// G2 and G4, judged as the writes arrive: one write, answered 500, and nothing after it
    /// (no second write of the request id, no resend of an UNCERTAIN delivery).
    fn judge(&self) {
        if let [first, rest @ ..] = self.writes.as_slice() {
            assert!(
                !rest.contains(first),
                "G2: request {first} was written {} times (one write per attempt)",
                1 + rest.iter().filter(|r| *r == first).count()
            );
            assert!(
                rest.is_empty(),
                "G4: a write of unknown outcome was resent as {} (an UNCERTAIN delivery is never resent)",
                rest[0]
            );
        }
    }
}

/// Serves the command adapter's HTTP protocol: every write is answered 500 before it is
/// taken (so its outcome is unknown), and the history queries of round `n` (from 1) are
/// answered 503 when `unanswerable(n)`, else 404 ("no such request": a complete scan that
/// found nothing).
fn failing_recipient(unanswerable: fn(usize) -> bool) -> (String, Arc<Mutex<Recipient>>) {
    let state: Arc<Mutex<Recipient>> = Arc::default();
    let s = state.clone();
    let write = s.clone();
    let status = s.clone();
    let app = axum::Router::new()
        .route(
            "/",
            axum::routing::post(move |body: axum::Json<serde_json::Value>| {
                let req = body["request_id"].as_str().unwrap_or("?").to_owned();
                write.lock().unwrap().writes.push(req);
                async { (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "{}") }
            }),
        )
        .route(
            "/status/{request_id}",
            axum::routing::get(move || {
                let mut s = status.lock().unwrap();
                let at = Instant::now();
                let round = match s.answers.last() {
                    Some(last) if at - last.at < SAME_ROUND => last.round,
                    Some(last) => last.round + 1,
                    None => 1,
                };
                let not_found = !unanswerable(round);
                s.answers.push(Answer {
                    at,
                    round,
                    not_found,
                });
                async move {
                    if not_found {
                        (axum::http::StatusCode::NOT_FOUND, "{}")
                    } else {
                        (axum::http::StatusCode::SERVICE_UNAVAILABLE, "{}")
                    }
                }
            }),
        );
    (common::serve(app), state)
}

/// The history scan bounds the test's engine runs with (the plant runs set their own).
fn policy() -> serde_json::Value {
    let text = std::env::var("HANDOFFS_TEST_POLICY").unwrap_or_else(|_| FAST_POLICY.to_owned());
    serde_json::from_str(&text).expect("the test policy is JSON")
}

/// Sends one handoff to a recipient that fails its write, runs an engine until the delivery
/// is CANCELLED, and returns the recipient's history answers given before the cancel.
fn cancelled_after(unanswerable: fn(usize) -> bool) -> Vec<Answer> {
    let w = World::new();
    w.ok(&["agent", "add", "alice", "--provider", "demo"]);
    let (url, recipient) = failing_recipient(unanswerable);
    w.register_http_agent("bob", &url);
    w.ok(&["send", "alice", "bob", "did this land?"]);
    let _engine = w.spawn_engine();
    // Liveness: with the recipient reachable, an UNCERTAIN delivery must keep being scanned
    // until it settles; a delivery nobody looks at again stays UNCERTAIN and fails here.
    w.wait_for(Duration::from_secs(20), |c| {
        recipient.lock().unwrap().judge();
        c.get("CANCELLED") == Some(&1)
    });
    let cancelled_at = Instant::now();
    let s = recipient.lock().unwrap();
    s.judge();
    assert_eq!(s.writes.len(), 1, "one write, answered 500");
    s.answers
        .iter()
        .filter(|a| a.at <= cancelled_at)
        .cloned()
        .collect()
}

/// G5, judged from the recipient's log: at least SPEC's number of rounds in which every
/// query was answered "not found", the first and the last at least the policy's span apart.
fn assert_honest(answers: &[Answer]) {
    let p = policy();
    let scans_min = usize::try_from(p["history_scans_min"].as_u64().unwrap_or(3)).unwrap();
    let span = Duration::from_millis(p["history_scan_span_ms"].as_u64().unwrap_or(3_600_000));
    let mut complete: Vec<&Answer> = Vec::new();
    for a in answers {
        let whole = answers
            .iter()
            .filter(|b| b.round == a.round)
            .all(|b| b.not_found);
        if whole && complete.last().is_none_or(|c| c.round != a.round) {
            complete.push(a);
        }
    }
    let rounds: Vec<(usize, bool)> = answers.iter().map(|a| (a.round, a.not_found)).collect();
    assert!(
        complete.len() >= scans_min,
        "G5: cancelled after only {} complete history scans (SPEC asks {scans_min}); the recipient's (round, not found) answers: {rounds:?}",
        complete.len()
    );
    let first_to_last = complete[complete.len() - 1].at - complete[0].at;
    assert!(
        first_to_last >= span,
        "G5: cancelled after complete scans spanning only {first_to_last:?} (at least {span:?})"
    );
}

#[test]
fn an_unknown_write_is_cancelled_only_after_enough_complete_scans() {
    let answers = cancelled_after(|_| false);
    assert_honest(&answers);
}

#[test]
fn an_incomplete_scan_between_two_complete_ones_does_not_count() {
    // The second round cannot be answered: the first and third complete scans span the
    // policy's hour already, so only their number holds the cancel back.
    let answers = cancelled_after(|round| round == 2);
    assert!(
        answers.iter().any(|a| !a.not_found),
        "the recipient answered one query 503 before the cancel: {answers:?}"
    );
    assert_honest(&answers);
}

/// A write in flight is judged by SPEC's sending timeout when a person releases it, even
/// when the engine runs a drill policy that gives up on a write sooner: the engine's job is
/// still waiting for the write's answer, and freeing the recipient now would let a second
/// write reach it while the first may still land (G3).
#[test]
fn a_release_never_frees_a_recipient_under_a_write_in_flight() {
    let w = World::new();
    w.ok(&["agent", "add", "alice", "--provider", "demo"]);
    let app = axum::Router::new().route(
        "/",
        axum::routing::post(|| async {
            tokio::time::sleep(Duration::from_secs(25)).await;
            "{}"
        }),
    );
    let url = common::serve(app);
    w.register_http_agent("bob", &url);
    let sent = w.json(&["send", "alice", "bob", "a write that hangs"]);
    let id = sent["message"]["id"].as_str().unwrap().to_owned();
    let _engine = w.spawn_engine();
    let start = Instant::now();
    while w.json(&["status", &id])["state"] != "SENDING" {
        assert!(start.elapsed() < Duration::from_secs(20), "never SENDING");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Past the drill policy's 1.5 s sending timeout, well within SPEC's 60 s.
    std::thread::sleep(Duration::from_millis(2_500));
    let out = w.run(&["release", &id]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "G3: a release freed the recipient while its write was in flight: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("the write is in flight"));
}
