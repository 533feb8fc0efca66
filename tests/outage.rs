//! G6 (outages hold) as real processes: the provider's status page, served here, reports a
//! major outage; the engine holds the handoff without spending an attempt, and delivers it
//! once the page is green again (after the guard's cache lets it see so). The recipient, an
//! HTTP agent served here too, notes any write that arrives while the page is red.

mod common;

use common::World;
use serde_json::{Value, json};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Default)]
struct Provider {
    /// The status page reports an outage.
    red: AtomicBool,
    /// Request ids written while the page was red.
    during_outage: Mutex<Vec<String>>,
    taken: Mutex<Vec<String>>,
    page_reads: Mutex<usize>,
}

/// Serves a Statuspage-style `summary.json` and an HTTP agent (idle; every write a turn that
/// returns at once); returns the base URL.
fn provider(p: &Arc<Provider>) -> String {
    let page = p.clone();
    let write = p.clone();
    let status = p.clone();
    let app = axum::Router::new()
        .route(
            "/summary.json",
            axum::routing::get(move || {
                *page.page_reads.lock().unwrap() += 1;
                let (indicator, description) = if page.red.load(Ordering::SeqCst) {
                    ("major", "Major outage of the agents' API")
                } else {
                    ("none", "All systems operational")
                };
                std::future::ready(axum::Json(json!({
                    "status": {"indicator": indicator, "description": description},
                    "components": [],
                })))
            }),
        )
        .route(
            "/activity",
            axum::routing::get(|| async { axum::Json(json!({"status": "idle"})) }),
        )
        .route(
            "/",
            axum::routing::post(move |body: axum::Json<Value>| {
                let req = body["request_id"].as_str().unwrap_or("?").to_owned();
                if write.red.load(Ordering::SeqCst) {
                    write.during_outage.lock().unwrap().push(req.clone());
                }
                write.taken.lock().unwrap().push(req);
                async { "{}" }
            }),
        )
        .route(
            "/status/{request_id}",
            axum::routing::get(
                move |axum::extract::Path(req): axum::extract::Path<String>| {
                    let known = status.taken.lock().unwrap().contains(&req);
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
    common::serve(app)
}

#[test]
fn an_outage_holds_the_handoff_until_the_status_page_is_green() {
    let w = World::new();
    let p = Arc::new(Provider::default());
    p.red.store(true, Ordering::SeqCst);
    let url = provider(&p);
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
        &format!("activity_url={url}activity"),
        "--set",
        &format!("status_url={url}status/{{request_id}}"),
    ]);
    w.ok(&[
        "config",
        "outageGuard",
        &json!({ "url": format!("{url}summary.json") }).to_string(),
    ]);
    let sent = w.json(&["send", "alice", "bob", "when the provider is back"]);
    let id = sent["message"]["id"].as_str().unwrap().to_owned();
    let _engine = w.spawn_engine();

    // The outage lasts a few of the engine's passes.
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(4) {
        let taken = p.taken.lock().unwrap().clone();
        assert!(
            taken.is_empty(),
            "G6: {taken:?} was written while the status page reported an outage"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        *p.page_reads.lock().unwrap() >= 1,
        "the guard read the status page"
    );
    let history = w.ok(&["status", &id]);
    // SPEC §2.1: an outage waits in WAITING, with the reason in the detail.
    assert!(
        history.contains("WAITING") && history.contains("provider outage"),
        "the delivery waits for the outage, saying why:\n{history}"
    );
    p.red.store(false, Ordering::SeqCst);

    // Green again: delivered once the guard's cached verdict (a minute) has expired.
    w.wait_for(Duration::from_secs(90), |c| c.get("RETURNED") == Some(&1));
    let during = p.during_outage.lock().unwrap().clone();
    assert!(
        during.is_empty(),
        "G6: {during:?} was written while the status page reported an outage"
    );
    let history = w.ok(&["status", &id]);
    assert!(
        history.contains("attempt 1 is reserved") && !history.contains("attempt 2"),
        "the outage spent no attempt:\n{history}"
    );
}

#[test]
fn a_pause_and_a_block_hold_the_handoff_until_lifted() {
    for (hold, lift) in [
        (
            ["config", "enabled", "false"],
            ["config", "enabled", "true"],
        ),
        (["block", "alice", "bob"], ["allow", "alice", "bob"]),
    ] {
        let w = World::new();
        w.ok(&["agent", "add", "alice", "--provider", "demo"]);
        let script = w.script("rcpt.sh", 0, 0);
        w.add_command_agent("bob", &script);
        // A send on a blocked pair is refused, so the block comes once the handoff is
        // queued; a pause may come before or after. The engine starts with the hold on.
        let sent = w.json(&["send", "alice", "bob", "wait for it"]);
        let id = sent["message"]["id"].as_str().unwrap().to_owned();
        w.ok(&hold);
        let _engine = w.spawn_engine();
        std::thread::sleep(Duration::from_secs(2));
        let history = w.ok(&["status", &id]);
        assert!(
            w.runs().is_empty(),
            "held: nothing runs while {hold:?} holds the handoff:\n{history}"
        );
        assert!(history.contains("HELD"), "{hold:?} holds it:\n{history}");
        w.ok(&lift);
        w.wait_for(Duration::from_secs(20), |c| c.get("RETURNED") == Some(&1));
        assert_eq!(w.runs().len(), 1, "delivered once, after {lift:?}");
    }
}
