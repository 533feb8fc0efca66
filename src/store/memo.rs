//! Rows read once per transaction: the agents, messages, settings, connections and chains an
//! engine's steps ask for again and again (a delivery's three steps read its recipient and
//! message about ten times, most inside one batched transaction).
//!
//! Sound because a write transaction is the only writer while it is open (SQLite's write
//! lock; PostgreSQL's writer lock, `pg_schema::WRITE_BEGIN`) and a read transaction is a
//! snapshot: no other process changes these rows between the first read and the end of the
//! transaction. What this connection writes itself forgets every remembered row (every
//! statement of a `Tx` passes `TxConn::prepare_cached`, which asks [`forgets`]), as does every
//! transaction boundary and every step undone (`Store::control`). Written by hand, on purpose: a generic cache
//! crate knows nothing of transaction boundaries, which are the whole of its correctness.

use super::{AgentRow, ChainRow, MessageRow};
use serde_json::Value;
use std::collections::HashMap;

/// What this transaction has read so far, by key (`None`: read and absent).
#[derive(Debug, Default)]
pub(super) struct Memo {
    pub agents: HashMap<String, Option<AgentRow>>,
    pub messages: HashMap<String, Option<MessageRow>>,
    pub config: HashMap<String, Option<Value>>,
    pub connections: HashMap<(String, String), Option<bool>>,
    pub chain_of_message: HashMap<String, Option<ChainRow>>,
}

impl Memo {
    pub fn clear(&mut self) {
        // Only when something is there: the common case (nothing read yet) allocates
        // nothing and frees nothing.
        if !self.is_empty() {
            *self = Memo::default();
        }
    }

    fn is_empty(&self) -> bool {
        self.agents.is_empty()
            && self.messages.is_empty()
            && self.config.is_empty()
            && self.connections.is_empty()
            && self.chain_of_message.is_empty()
    }
}

/// Whether statement `sql` may change a remembered row. Only the delivery steps' own
/// statements (their delivery row, their event lines, a new delivery, and on PostgreSQL the
/// lease renewal each step's fencing check makes: no remembered table, no trigger) are known
/// not to: every other write forgets what was read, which costs a re-read at worst.
pub(super) fn forgets(sql: &str) -> bool {
    const KEEPS: [&str; 5] = [
        "UPDATE deliveries SET",
        "INSERT INTO events ",
        "INSERT INTO deliveries ",
        "UPDATE recipient_leases SET",
        "SELECT ",
    ];
    let sql = sql.trim_start();
    !KEEPS.iter().any(|k| sql.starts_with(k))
}

#[cfg(test)]
mod tests {
    use super::forgets;

    #[test]
    fn only_the_steps_own_statements_keep_what_was_read() {
        assert!(!forgets(
            "UPDATE deliveries SET state = ?2 WHERE message_id = ?1"
        ));
        assert!(!forgets("\n  INSERT INTO events (at) VALUES (?1)"));
        assert!(!forgets("SELECT value FROM config WHERE key = ?1"));
        // A step's fencing check renews its lease: no remembered table.
        assert!(!forgets(
            "UPDATE recipient_leases SET expires_at = ?4, session = ?5 WHERE agent = ?1"
        ));
        for sql in [
            "UPDATE agents SET settings = ?2",
            "INSERT INTO config (key, value) VALUES (?1, ?2)",
            "UPDATE messages SET read_at = ?2",
            "DELETE FROM connections",
            "INSERT INTO chains (id) VALUES (?1)",
            "UPDATE leases SET fence = fence + 1 RETURNING fence",
            "WITH x AS (SELECT 1) UPDATE chains SET state = 'cancelled'",
        ] {
            assert!(forgets(sql), "{sql}");
        }
    }
}
