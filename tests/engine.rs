//! The engine in-process, with an injected clock: due reminders (G7), the backlog pace, and a
//! delivery to an HTTP recipient in two steps, its queue in order.

use handoffs::engine::Engine;
use handoffs::service::Service;
use handoffs::store::Store;
use model::Millis;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

fn service_at(dir: &tempfile::TempDir, clock: Arc<AtomicU64>) -> Service {
    let db = dir.path().join("h.sqlite3");
    let (store, _) = Store::init(&db).unwrap();
    Service::with_clock(
        store,
        Arc::new(move || Millis(clock.load(Ordering::SeqCst))),
    )
}

/// Serves `app` on a loopback port, for as long as the test runs; its base URL.
async fn serve_app(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    base
}

/// A service with `lead` (demo) and `dev`, a command agent over HTTP whose `url` is
/// `{base}/turn`, with `settings` (URLs under `base`) besides.
fn with_http_dev(
    dir: &tempfile::TempDir,
    clock: Arc<AtomicU64>,
    base: &str,
    settings: &[(&str, &str)],
) -> Service {
    let mut s = service_at(dir, clock);
    s.add_agent("lead", Some("demo"), None, None, None, &[])
        .unwrap();
    let mut all = vec![("url".to_owned(), serde_json::json!(format!("{base}/turn")))];
    for (k, path) in settings {
        all.push(((*k).to_owned(), serde_json::json!(format!("{base}{path}"))));
    }
    s.add_agent("dev", Some("command"), None, None, None, &all)
        .unwrap();
    s
}

#[tokio::test]
async fn overdue_work_reminds_its_sender_exactly_once_without_waking_anyone() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(AtomicU64::new(1_800_000_000_000));
    let mut s = service_at(&dir, clock.clone());
    s.add_agent("lead", Some("demo"), None, None, None, &[])
        .unwrap();
    s.add_agent(
        "dev",
        Some("demo"),
        None,
        None,
        None,
        &[("turn_seconds".into(), serde_json::json!(80_000))],
    )
    .unwrap();
    let sent = s
        .send("lead", "dev", "ship it", Some("Ship"), Some(5), None)
        .unwrap();
    let mut engine = Engine::new(s, false).unwrap();
    // A planted bug reaches this in-process engine the way HANDOFFS_POLICY reaches a process.
    if let Ok(p) = std::env::var("HANDOFFS_TEST_POLICY") {
        engine = engine.with_policy(serde_json::from_str(&p).expect("HANDOFFS_TEST_POLICY"));
    }
    engine.pass().await;
    clock.fetch_add(4 * 60_000, Ordering::SeqCst);
    assert_eq!(engine.pass().await.reminders, 0, "not due yet");
    clock.fetch_add(2 * 60_000, Ordering::SeqCst);
    assert_eq!(
        engine.pass().await.reminders,
        1,
        "G7: overdue work reminds its sender once, at its due time"
    );
    clock.fetch_add(60 * 60_000, Ordering::SeqCst);
    assert_eq!(engine.pass().await.reminders, 0, "exactly once");
    let inbox = engine.service().inbox("lead", true, 10).unwrap();
    assert_eq!(inbox.len(), 1);
    assert_eq!(
        inbox[0].intent, "notification",
        "a reminder never starts a turn"
    );
    assert_eq!(inbox[0].work_id.as_deref(), Some(sent.message.id.as_str()));
    let overview = engine.service().overview(10).unwrap();
    let lead_deliveries = overview
        .in_flight
        .iter()
        .chain(&overview.needs_attention)
        .chain(&overview.recent)
        .filter(|d| d.to == "lead")
        .count();
    assert_eq!(lead_deliveries, 0, "no delivery for a notification");
}

#[tokio::test]
async fn a_recipient_with_a_long_queue_drains_at_the_pace_of_its_turns() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(AtomicU64::new(1_800_000_000_000));
    let mut s = service_at(&dir, clock.clone());
    s.add_agent("lead", Some("demo"), None, None, None, &[])
        .unwrap();
    s.add_agent(
        "dev",
        Some("demo"),
        None,
        None,
        None,
        &[("turn_seconds".into(), serde_json::json!(1))],
    )
    .unwrap();
    for i in 0..200 {
        s.send("lead", "dev", &format!("item {i}"), None, None, None)
            .unwrap();
    }
    let mut engine = Engine::new(s, false).unwrap();
    let mut passes = 0;
    let mut events_before = 0;
    loop {
        let r = engine.pass().await;
        passes += 1;
        let counts = engine.service().overview(1).unwrap().counts;
        let returned = counts
            .iter()
            .find(|(s, _)| s == "RETURNED")
            .map_or(0, |c| c.1);
        if returned == 200 {
            break;
        }
        assert!(
            passes < 2_000,
            "stuck after {passes} passes: {counts:?} {r:?}"
        );
        // One simulated second per pass: each turn takes one second.
        clock.fetch_add(1_000, Ordering::SeqCst);
        if passes == 50 {
            events_before = engine.service().events_after(0, 1_000_000).unwrap().len();
        }
    }
    // Two passes per turn at most (write, then observe); a queued row gains no event per pass.
    assert!(
        passes <= 2 * 200 + 5,
        "{passes} passes for 200 one-second turns"
    );
    let events = engine.service().events_after(0, 1_000_000).unwrap().len();
    assert!(
        events < 200 * 8,
        "{events} events for 200 deliveries (linear, not quadratic)"
    );
    assert!(events_before > 0);
}

/// A sync of the WAL that fails stops the engine before the write, for good: after an
/// `fdatasync` error the kernel may have dropped the dirty pages, so a later sync that
/// succeeds proves nothing, and no write may go out on it.
#[tokio::test]
async fn a_failed_sync_stops_the_engine_before_any_write() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(AtomicU64::new(1_800_000_000_000));
    let mut s = service_at(&dir, clock.clone());
    s.add_agent("lead", Some("demo"), None, None, None, &[])
        .unwrap();
    for a in ["dev", "dev2"] {
        s.add_agent(a, Some("demo"), None, None, None, &[]).unwrap();
    }
    s.send("lead", "dev", "ship it", None, None, None).unwrap();
    let mut engine = Engine::new(s, false).unwrap();
    // The WAL's name now leads nowhere (a link to itself); SQLite keeps the file it opened.
    let wal = dir.path().join("h.sqlite3-wal");
    std::fs::remove_file(&wal).unwrap();
    std::os::unix::fs::symlink(&wal, &wal).unwrap();
    let r = engine.pass().await;
    assert_eq!(r.writes, 0, "no write after a failed sync: {r:?}");
    assert!(
        r.errors.iter().any(|e| e.contains("could not be synced")),
        "{r:?}"
    );
    // A later sync would now succeed, having made nothing durable: it must not be trusted,
    // not even for a handoff sent since.
    std::fs::remove_file(&wal).unwrap();
    std::fs::File::create(&wal).unwrap();
    engine
        .service()
        .send("lead", "dev2", "and this", None, None, None)
        .unwrap();
    clock.fetch_add(120_000, Ordering::SeqCst);
    let r = engine.pass().await;
    assert_eq!(r.writes, 0, "nor on a later pass: {r:?}");
    // Nor is anything more committed toward a write: the new handoff is still queued, not
    // reserved (a reservation whose write never goes out would hold its recipient).
    let overview = engine.service().overview(10).unwrap();
    let to_dev2: Vec<_> = overview
        .queued
        .iter()
        .chain(&overview.in_flight)
        .filter(|d| d.to == "dev2")
        .map(|d| d.state)
        .collect();
    assert_eq!(to_dev2, vec![model::StateKind::Waiting], "{overview:?}");
    let stopped = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        engine.run(std::time::Duration::from_millis(20), std::future::pending()),
    )
    .await
    .expect("the engine stops by itself");
    assert!(
        stopped.as_ref().is_err_and(|e| e.contains("sync")),
        "{stopped:?}"
    );
}

/// A busy recipient is asked once per look at its queue, not once per queued delivery (issue
/// 14: no idle cost): two handoffs queued behind a turn cost one activity request a pass.
#[tokio::test]
async fn a_busy_recipient_is_asked_once_per_look_not_once_per_queued_handoff() {
    let asked = Arc::new(AtomicU64::new(0));
    let counter = asked.clone();
    let app = axum::Router::new().route(
        "/activity",
        axum::routing::get(move || {
            counter.fetch_add(1, Ordering::SeqCst);
            async { r#"{"status":"busy"}"# }
        }),
    );
    let base = serve_app(app).await;
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(AtomicU64::new(1_800_000_000_000));
    let mut s = with_http_dev(&dir, clock.clone(), &base, &[("activity_url", "/activity")]);
    for i in 0..3 {
        s.send("lead", "dev", &format!("item {i}"), None, None, None)
            .unwrap();
    }
    let mut engine = Engine::new(s, false).unwrap();
    for look in 1..=3 {
        let r = engine.pass().await;
        assert_eq!(r.writes, 0, "{r:?}");
        assert_eq!(r.looked_at, 2, "the queue's two heads: {r:?}");
        assert_eq!(
            asked.load(Ordering::SeqCst),
            look,
            "one activity request per look at the busy recipient's queue"
        );
        clock.fetch_add(60_000, Ordering::SeqCst);
    }
}

/// A write to an HTTP recipient without a status URL whose reply was lost (a 5xx) is
/// UNCERTAIN, and stays so however often it is looked at: nothing can tell whether it
/// landed, so it is never taken as returned (G5: a person releases it).
#[tokio::test]
async fn a_lost_reply_without_a_status_url_is_never_taken_as_returned() {
    let app = axum::Router::new().route(
        "/turn",
        axum::routing::post(|| async { (axum::http::StatusCode::BAD_GATEWAY, "lost") }),
    );
    let base = serve_app(app).await;
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(AtomicU64::new(1_800_000_000_000));
    let mut s = with_http_dev(&dir, clock.clone(), &base, &[]);
    s.send("lead", "dev", "ship it", None, None, None).unwrap();
    let mut engine = Engine::new(s, false).unwrap();
    let state = |engine: &Engine| {
        let o = engine.service().overview(10).unwrap();
        o.needs_attention
            .iter()
            .chain(&o.in_flight)
            .chain(&o.recent)
            .chain(&o.queued)
            .map(|d| d.state)
            .collect::<Vec<_>>()
    };
    assert_eq!(engine.pass().await.writes, 1);
    assert_eq!(state(&engine), vec![model::StateKind::Uncertain]);
    for _ in 0..20 {
        clock.fetch_add(60_000, Ordering::SeqCst);
        let r = engine.pass().await;
        assert_eq!(r.writes, 0, "never written again: {r:?}");
    }
    assert_eq!(state(&engine), vec![model::StateKind::Uncertain]);
}

/// A write accepted by an HTTP recipient without a status URL is a whole turn: its result's
/// own transaction observes it, so the delivery is RETURNED before the next queued handoff's
/// pass looks for an earlier active one. That pass then reserves at once: no handoff goes
/// BUSY behind a turn that is already over, and the writes go out in the order sent.
#[tokio::test]
async fn an_accepted_http_write_returns_in_its_own_step_and_the_queue_goes_on_in_order() {
    let posts = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let seen = posts.clone();
    let app = axum::Router::new().route(
        "/turn",
        axum::routing::post(move |body: axum::Json<serde_json::Value>| {
            let text = body["text"].as_str().unwrap_or_default().to_owned();
            seen.lock().unwrap().push(text);
            async { "{}" }
        }),
    );
    let base = serve_app(app).await;
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(AtomicU64::new(1_800_000_000_000));
    let mut s = with_http_dev(&dir, clock.clone(), &base, &[]);
    let ids: Vec<String> = (0..3)
        .map(|i| {
            s.send("lead", "dev", &format!("item {i}"), None, None, None)
                .unwrap()
                .message
                .id
        })
        .collect();
    let mut engine = Engine::new(s, false).unwrap();
    for _ in 0..10 {
        engine.pass().await;
        if posts.lock().unwrap().len() == 3 {
            break;
        }
        clock.fetch_add(1_000, Ordering::SeqCst);
    }
    let posts = posts.lock().unwrap().clone();
    assert_eq!(posts.len(), 3, "three writes: {posts:?}");
    for (i, text) in posts.iter().enumerate() {
        assert!(
            text.contains(&format!("item {i}")),
            "written in the order sent: {posts:?}"
        );
    }
    let events = engine.service().events_after(0, 1_000).unwrap();
    for id in &ids {
        let moves: Vec<&str> = events
            .iter()
            .filter(|e| e.message_id.as_deref() == Some(id.as_str()) && e.kind == "state")
            .map(|e| e.detail.split(':').next().unwrap_or_default())
            .collect();
        assert_eq!(
            moves,
            [
                "WAITING → SENDING",
                "SENDING → ACCEPTED",
                "ACCEPTED → RETURNED"
            ],
            "handoff {id}: no BUSY detour behind a turn already over"
        );
        // Returned in the step that recorded the acceptance: its line comes right after,
        // before any other delivery's.
        let accepted = events
            .iter()
            .position(|e| {
                e.message_id.as_deref() == Some(id.as_str())
                    && e.detail.starts_with("SENDING → ACCEPTED")
            })
            .unwrap();
        assert!(
            events[accepted + 1].message_id.as_deref() == Some(id.as_str())
                && events[accepted + 1]
                    .detail
                    .starts_with("ACCEPTED → RETURNED"),
            "handoff {id}: returned in the write result's own step: {:?}",
            &events[accepted..]
        );
    }
}
