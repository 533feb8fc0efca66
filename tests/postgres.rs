//! What only the PostgreSQL backend has: its schema kept beside SQLite's, engines on several
//! machines sharing one database (one delivers, the others stand by and take over when it
//! dies), and an engine whose session is gone writing nothing more. These run whichever side
//! of the test matrix is on, against the server `HANDOFFS_TEST_POSTGRES` names.

mod common;

use common::{World, assert_one_run_per_request, kill9};
use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// Every table and its columns, in the database at `db` (either backend).
fn columns(db: &std::path::Path) -> BTreeMap<String, Vec<String>> {
    let rows = if common::is_postgres(db) {
        common::sql_rows(
            db,
            "SELECT table_name || '.' || column_name FROM information_schema.columns
             WHERE table_schema = current_schema() AND table_name <> 'handoffs_meta'
             ORDER BY 1",
        )
    } else {
        common::sql_rows(
            db,
            "SELECT m.name || '.' || p.name FROM sqlite_master m, pragma_table_info(m.name) p
             WHERE m.type = 'table' AND m.name NOT LIKE 'sqlite_%' ORDER BY 1",
        )
    };
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for r in rows {
        let (table, column) = r.split_once('.').expect("table.column");
        out.entry(table.to_owned())
            .or_default()
            .push(column.to_owned());
    }
    out
}

#[test]
fn both_backends_hold_the_same_tables_and_columns() {
    let Some(admin) = common::postgres_or_skip("schema parity") else {
        return;
    };
    let pg = World::on_postgres(&admin);
    let dir = tempfile::tempdir().unwrap();
    let lite = dir.path().join("h.sqlite3");
    let out = pg
        .cmd()
        .env("HANDOFFS_DB", &lite)
        .arg("init")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let (a, b) = (columns(&lite), columns(&pg.db));
    assert!(a.len() > 20, "{a:?}");
    for (table, cols) in &a {
        let mut x = cols.clone();
        let mut y = b.get(table).cloned().unwrap_or_default();
        x.sort();
        y.sort();
        assert_eq!(x, y, "table {table}: SQLite's columns, PostgreSQL's");
    }
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "the same tables"
    );
}

/// An engine on this world's database with its log in `name`.
fn engine(w: &World, name: &str) -> common::Engine {
    let log = std::fs::File::create(w.dir.path().join(name)).unwrap();
    common::Engine(
        w.cmd()
            .args(["run", "--interval", "0.2"])
            .env("HANDOFFS_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn engine"),
    )
}

fn log_of(w: &World, name: &str) -> String {
    std::fs::read_to_string(w.dir.path().join(name)).unwrap_or_default()
}

/// Waits until `done()`, at most `limit`; panics with `what` and both engines' logs.
fn wait_until(w: &World, limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < limit,
            "{what} within {limit:?}\nengine a: {}\nengine b: {}",
            log_of(w, "a.log"),
            log_of(w, "b.log")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn returned(w: &World, id: &str) -> bool {
    w.json(&["status", id])["state"] == "RETURNED"
}

/// A world on PostgreSQL with a demo sender and an HTTP recipient that checks G8.
fn team(admin: &str) -> World {
    let w = World::on_postgres(admin);
    w.ok(&["agent", "add", "lead", "--provider", "demo"]);
    w.add_http_agent("dev");
    w
}

/// A second engine ("b"), once it says it stands by.
fn standby(w: &World) -> common::Engine {
    let b = engine(w, "b.log");
    wait_until(w, Duration::from_secs(10), "engine b standing by", || {
        log_of(w, "b.log").contains("standing by")
    });
    b
}

/// Sends `text` from lead to dev; the message id.
fn send(w: &World, text: &str) -> String {
    w.json(&["send", "lead", "dev", text])["message"]["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Two machines' engines on one database: one delivers, the other stands by; SIGKILL the
/// one delivering, and the other takes over within a bound; what was sent before and after
/// is delivered once each, and never before its reservation was committed (G8).
#[test]
fn a_standby_engine_takes_over_when_the_delivering_one_is_killed() {
    let Some(admin) = common::postgres_or_skip("engine failover") else {
        return;
    };
    let w = team(&admin);
    let mut a = engine(&w, "a.log");
    let first = send(&w, "first");
    wait_until(
        &w,
        Duration::from_secs(20),
        "the first handoff delivered",
        || returned(&w, &first),
    );
    let _b = standby(&w);
    let second = send(&w, "second");
    wait_until(
        &w,
        Duration::from_secs(20),
        "the second handoff delivered",
        || returned(&w, &second),
    );
    kill9(&mut a);
    let killed = Instant::now();
    let third = send(&w, "third");
    wait_until(
        &w,
        Duration::from_secs(15),
        "the standby engine took over and delivered the third handoff",
        || returned(&w, &third),
    );
    eprintln!("failover: delivered {:?} after the kill", killed.elapsed());
    assert!(log_of(&w, "b.log").contains("engine started"));
    let runs = w.runs();
    assert_one_run_per_request(&runs);
    assert_eq!(runs.len(), 3, "{runs:?}");
}

/// The engine's session is ended under it (a network cut, an administrator): its lock goes
/// with it, and the engine that lost its session stops delivering (a new session would not
/// hold the lock: it would write beside the new holder) and stands by again. Whichever
/// engine takes the lock next, exactly one delivers: the handoff sent after the cut runs
/// once.
#[test]
fn an_engine_whose_session_ended_stops_and_one_engine_takes_over() {
    let Some(admin) = common::postgres_or_skip("a lost engine session") else {
        return;
    };
    let w = team(&admin);
    let _a = engine(&w, "a.log");
    wait_until(&w, Duration::from_secs(10), "engine a started", || {
        log_of(&w, "a.log").contains("engine started")
    });
    let _b = standby(&w);
    // The session holding the engine lock, ended by the server.
    let ended = common::sql_rows(
        &w.db,
        "SELECT pg_terminate_backend(pid) FROM pg_locks
         WHERE locktype = 'advisory' AND classid = 1213089862 AND objid = 2 AND granted
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    );
    assert_eq!(
        ended,
        vec!["t".to_owned()],
        "one session held the engine lock"
    );
    wait_until(
        &w,
        Duration::from_secs(10),
        "engine a stopped delivering",
        || log_of(&w, "a.log").contains("the session that held the engine lock is gone"),
    );
    wait_until(&w, Duration::from_secs(10), "an engine took over", || {
        log_of(&w, "b.log").contains("engine started")
            || log_of(&w, "a.log").matches("engine started").count() == 2
    });
    let sent = send(&w, "after the cut");
    wait_until(&w, Duration::from_secs(20), "the handoff delivered", || {
        returned(&w, &sent)
    });
    std::thread::sleep(Duration::from_secs(1));
    let runs = w.runs();
    assert_one_run_per_request(&runs);
    assert_eq!(runs.len(), 1, "{runs:?}");
    let delivering = usize::from(log_of(&w, "b.log").contains("engine started"))
        + log_of(&w, "a.log").matches("engine started").count()
        - 1;
    assert_eq!(delivering, 1, "one engine holds the lock after the cut");
}
