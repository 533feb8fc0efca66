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
