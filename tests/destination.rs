//! G1 as real processes: a delivery goes only to the destination frozen when it was queued.
//! Re-registering the recipient at another URL makes its queued handoff UNAVAILABLE (never
//! redirected), and `agent add` says so.

mod common;

use common::{World, http_recipient};

fn runs_in(log: &std::path::Path) -> usize {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    if let Some(l) = text.lines().find(|l| l.starts_with("unreserved ")) {
        panic!("G8: a write reached the recipient before its reservation was committed: {l}");
    }
    text.lines().filter(|l| l.starts_with("start ")).count()
}

#[test]
fn a_queued_handoff_is_never_redirected_to_a_new_url() {
    let w = World::new();
    w.ok(&["agent", "add", "alice", "--provider", "demo"]);
    let log_a = w.dir.path().join("a.log");
    let log_b = w.dir.path().join("b.log");
    let url_a = http_recipient(log_a.clone(), Some(w.db.clone()));
    let url_b = http_recipient(log_b.clone(), Some(w.db.clone()));
    w.register_http_agent("bob", &url_a);
    let sent = w.json(&["send", "alice", "bob", "for the session at A"]);
    let id = sent["message"]["id"]
        .as_str()
        .expect("message id")
        .to_owned();

    // The same agent id, now addressed at B: the handoff queued for A must not go to B.
    let said = w.register_http_agent("bob", &url_b);
    assert!(
        said.contains("1 open delivery") && said.contains("UNAVAILABLE"),
        "agent add says that an open delivery will not follow the new destination: {said:?}"
    );
    w.ok(&["tick"]);
    assert_eq!(
        runs_in(&log_b),
        0,
        "G1: the handoff queued for A was written to B"
    );
    assert_eq!(
        runs_in(&log_a),
        0,
        "nothing is written while the destination differs"
    );
    let status = w.json(&["status", &id]);
    assert_eq!(status["state"], "UNAVAILABLE", "{status}");
    let detail = status["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("url") && detail.contains("nothing is redirected"),
        "the reason names what changed: {detail:?}"
    );

    // A moved folder alone is not a new destination; going back to A delivers there, once.
    w.register_http_agent("bob", &url_a);
    w.ok(&["agent", "add", "bob", "--cwd", "/tmp/elsewhere"]);
    w.ok(&["tick"]);
    w.ok(&["tick"]);
    assert_eq!(runs_in(&log_b), 0, "G1: B never receives it");
    assert_eq!(runs_in(&log_a), 1, "delivered once at A");
    assert_eq!(w.json(&["status", &id])["state"], "RETURNED");
}

#[test]
fn a_new_command_is_a_new_destination() {
    let w = World::new();
    w.ok(&["agent", "add", "alice", "--provider", "demo"]);
    let first = w.script("first.sh", 0, 0);
    let second = w.script("second.sh", 0, 0);
    w.add_command_agent("bob", &first);
    let sent = w.json(&["send", "alice", "bob", "for the first command"]);
    let id = sent["message"]["id"].as_str().unwrap().to_owned();
    w.add_command_agent("bob", &second);
    w.ok(&["tick"]);
    let state = w.json(&["status", &id])["state"].clone();
    assert_eq!(
        state, "UNAVAILABLE",
        "G1: the queued handoff went to the new command"
    );
    assert!(
        w.runs().is_empty(),
        "G1: the queued handoff ran the new command"
    );
}

#[test]
fn an_upgraded_database_freezes_the_route_its_queued_deliveries_were_sent_for() {
    if common::sqlite_file_case("a SQLite database of schema 2 migrated") {
        return;
    }
    let w = World::new();
    w.ok(&["agent", "add", "alice", "--provider", "demo"]);
    let log_a = w.dir.path().join("a.log");
    let url_a = http_recipient(log_a.clone(), Some(w.db.clone()));
    w.register_http_agent("bob", &url_a);
    let sent = w.json(&["send", "alice", "bob", "queued before the upgrade"]);
    let id = sent["message"]["id"].as_str().unwrap().to_owned();
    // Make it a version-2 database: records without a route.
    {
        let conn = rusqlite::Connection::open(&w.db).unwrap();
        conn.execute_batch(
            "UPDATE deliveries SET record = json_remove(record, '$.core.target.route');
             PRAGMA user_version = 2;",
        )
        .unwrap();
    }
    {
        let conn = rusqlite::Connection::open(&w.db).unwrap();
        let stripped: Option<String> = conn
            .query_row(
                "SELECT json_extract(record, '$.core.target.route') FROM deliveries",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(stripped, None, "the test made an old record");
    }
    let status = w.json(&["status", &id]);
    let route = &status["record"]["core"]["target"]["route"];
    assert_eq!(
        route["url"].as_str(),
        Some(format!("{url_a:?}").as_str()),
        "the migration froze the route the agent had: {status}"
    );
    w.ok(&["tick"]);
    w.ok(&["tick"]);
    assert_eq!(w.json(&["status", &id])["state"], "RETURNED");
    assert_eq!(runs_in(&log_a), 1);
}
