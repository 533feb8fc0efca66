//! Batched steps on both backends: an engine's steps share one write transaction, each a
//! savepoint in it. A step that fails is undone alone, the others commit together at the
//! flush, and no other connection sees any of them before. (On PostgreSQL a finished step's
//! `RELEASE SAVEPOINT` goes out with the next step's `SAVEPOINT`; this is what must still
//! hold.) On PostgreSQL when a server is given.

mod common;

use handoffs::store::{Store, StoreError};
use serde_json::{Value, json};

#[test]
fn batched_steps_keep_the_good_ones_and_undo_a_failed_one_alone() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = dir.path().join("h.sqlite3");
    steps_hold(&sqlite);
    if let Some(admin) = common::postgres_or_skip("batched steps on PostgreSQL") {
        steps_hold(&std::path::PathBuf::from(common::fresh_postgres(&admin)));
    }
}

fn config(s: &mut Store, k: &str) -> Option<Value> {
    s.read(|tx| tx.config(k)).unwrap()
}

fn steps_hold(db: &std::path::Path) {
    let (mut store, _) = Store::init(db).unwrap();
    let mut other = Store::open(db).unwrap();
    let set = |s: &mut Store, k: &str, v: i64| s.write(|tx| tx.set_config(k, &json!(v)));
    let failing = |s: &mut Store, k: &str, v: i64| -> Result<(), StoreError> {
        s.write(|tx| {
            tx.set_config(k, &json!(v))?;
            // The step's own write is visible inside it before it fails.
            assert_eq!(tx.config(k)?, Some(json!(v)));
            Err(StoreError::Sqlite("this step fails".to_owned()))
        })
    };
    store.batch_steps(true).unwrap();
    set(&mut store, "a", 1).unwrap();
    assert!(failing(&mut store, "b", 2).is_err());
    set(&mut store, "c", 3).unwrap();
    // Two failures in a row, then a good step, then a failure right before the flush.
    assert!(failing(&mut store, "a", 10).is_err());
    assert!(failing(&mut store, "c", 30).is_err());
    set(&mut store, "d", 4).unwrap();
    // A step that rewrites an earlier step's row, then one that fails on the same row.
    set(&mut store, "d", 5).unwrap();
    assert!(failing(&mut store, "d", 50).is_err());
    // Inside the batch, its own steps are seen, the failed ones not.
    assert_eq!(config(&mut store, "a"), Some(json!(1)));
    assert_eq!(config(&mut store, "b"), None);
    assert_eq!(config(&mut store, "d"), Some(json!(5)));
    for k in ["a", "c", "d"] {
        assert_eq!(config(&mut other, k), None, "{k}: not before the flush");
    }
    store.batch_steps(false).unwrap();
    for (k, v) in [("a", Some(1)), ("b", None), ("c", Some(3)), ("d", Some(5))] {
        assert_eq!(config(&mut other, k), v.map(|v| json!(v)), "{k}");
    }
    // A batch that ends on a failed step commits the good ones before it.
    store.batch_steps(true).unwrap();
    set(&mut store, "e", 6).unwrap();
    assert!(failing(&mut store, "f", 7).is_err());
    store.batch_steps(false).unwrap();
    assert_eq!(config(&mut other, "e"), Some(json!(6)));
    assert_eq!(config(&mut other, "f"), None);
    // And the connection goes on with transactions of its own.
    set(&mut store, "g", 8).unwrap();
    assert_eq!(config(&mut other, "g"), Some(json!(8)));
}

/// On PostgreSQL a step's `SAVEPOINT` (and the release of the step before, held back) goes
/// out with the step's first statement. When that held control fails, the step's undo must
/// not run `ROLLBACK TO SAVEPOINT`: the newest savepoint of that name is then the earlier
/// step's, still open, and rolling back to it would silently undo a step its caller was told
/// succeeded. The undo fails instead (the batch is then rolled back whole, and reported lost).
#[test]
fn a_failed_held_savepoint_never_undoes_the_step_before() {
    use handoffs::store::pg::PgSession;
    use handoffs::store::sql::Val;
    let Some(admin) = common::postgres_or_skip("held savepoints on PostgreSQL") else {
        return;
    };
    let url = common::fresh_postgres(&admin);
    let s = PgSession::connect(&url).unwrap();
    s.batch("CREATE TABLE t (x int)").unwrap();
    let insert = "INSERT INTO t VALUES (?1)";
    // Both ways a held statement goes out: with a statement the session has prepared
    // (pipelined in one write), and on its own before one it prepares first.
    for (round, prepared) in [(0, true), (1, false)] {
        let failing = if prepared {
            insert.to_owned()
        } else {
            format!("INSERT INTO t VALUES (?1 + {round})")
        };
        s.begin("BEGIN").unwrap();
        s.hold("SAVEPOINT step");
        s.execute(insert, vec![Val::Int(1)]).unwrap();
        // The first step's release is held back; the next step's control fails (no such
        // savepoint), and with it that step's first statement.
        s.hold("RELEASE SAVEPOINT nothing_of_that_name; SAVEPOINT step");
        let e = s.execute(&failing, vec![Val::Int(2)]).unwrap_err();
        assert!(e.to_string().contains("nothing_of_that_name"), "{e}");
        let undo = s.undo("ROLLBACK TO SAVEPOINT step; RELEASE SAVEPOINT step");
        assert!(
            undo.is_err(),
            "round {round}: the undo rolled back to the first step's savepoint"
        );
        // The commit of what is left fails, and leaves the session outside any transaction.
        assert!(s.commit("NOTIFY handoffs; COMMIT").is_err());
        assert_eq!(
            s.query("SELECT count(*) FROM t", vec![]).unwrap(),
            vec![vec![Val::Int(0)]]
        );
    }
    // The session goes on, and so do undos.
    s.begin("BEGIN").unwrap();
    s.hold("SAVEPOINT step");
    s.execute(insert, vec![Val::Int(3)]).unwrap();
    s.undo("ROLLBACK TO SAVEPOINT step; RELEASE SAVEPOINT step")
        .unwrap();
    s.hold("SAVEPOINT step");
    s.execute(insert, vec![Val::Int(4)]).unwrap();
    s.commit("COMMIT").unwrap();
    assert_eq!(
        s.query("SELECT x FROM t", vec![]).unwrap(),
        vec![vec![Val::Int(4)]]
    );
}
