//! Messages: sending, inboxes, reads, id prefixes.

use super::{IdTable, OptionalExtension, Result, Tx, params};

/// A stored message.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MessageRow {
    pub id: String,
    pub sender: String,
    pub recipient: String,
    pub body: String,
    pub body_hash: String,
    /// `handoff` (should become a turn) or `notification` (inbox only).
    pub intent: String,
    /// `plain`, `work`, `return` or `reminder`.
    pub kind: String,
    pub title: Option<String>,
    pub work_id: Option<String>,
    pub idem_key: Option<String>,
    pub created_at: i64,
    pub read_at: Option<i64>,
    /// Its chain (SPEC §8.2): the id of the chain's first message.
    pub chain_id: String,
    /// The message whose turn sent it (`None` for a chain's first message).
    pub parent_id: Option<String>,
    /// Its depth in the chain (0 for the first message).
    pub hop: i64,
}

pub(super) fn message_from(r: &super::sql::Row<'_, '_>) -> rusqlite::Result<MessageRow> {
    Ok(MessageRow {
        id: r.get(0)?,
        sender: r.get(1)?,
        recipient: r.get(2)?,
        body: r.get(3)?,
        body_hash: r.get(4)?,
        intent: r.get(5)?,
        kind: r.get(6)?,
        title: r.get(7)?,
        work_id: r.get(8)?,
        idem_key: r.get(9)?,
        created_at: r.get(10)?,
        read_at: r.get(11)?,
        chain_id: r.get::<Option<String>>(12)?.unwrap_or_default(),
        parent_id: r.get(13)?,
        hop: r.get(14)?,
    })
}

pub(super) const MESSAGE_COLS: &str = "id, sender, recipient, body, body_hash, intent, kind, title, work_id, idem_key, created_at, read_at, chain_id, parent_id, hop";

impl Tx<'_> {
    pub fn insert_message(&self, m: &MessageRow) -> Result<()> {
        self.exec(
            &format!("INSERT INTO messages ({MESSAGE_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)"),
            params![
                m.id, m.sender, m.recipient, m.body, m.body_hash, m.intent, m.kind, m.title,
                m.work_id, m.idem_key, m.created_at, m.read_at, m.chain_id, m.parent_id, m.hop
            ],
        )?;
        Ok(())
    }

    pub fn message(&self, id: &str) -> Result<Option<MessageRow>> {
        self.remembered(
            |m| &mut m.messages,
            id.to_owned(),
            || {
                Ok(self
                    .tx
                    .prepare_cached(&format!(
                        "SELECT {MESSAGE_COLS} FROM messages WHERE id = ?1"
                    ))?
                    .query_row([id], message_from)
                    .optional()?)
            },
        )
    }

    pub fn message_by_key(&self, sender: &str, key: &str) -> Result<Option<MessageRow>> {
        Ok(self
            .tx
            .prepare_cached(&format!(
                "SELECT {MESSAGE_COLS} FROM messages WHERE sender = ?1 AND idem_key = ?2"
            ))?
            .query_row([sender, key], message_from)
            .optional()?)
    }

    /// Ids in `table` starting with `prefix` (at most 2, enough to tell unique from ambiguous).
    pub fn ids_with_prefix(&self, table: IdTable, prefix: &str) -> Result<Vec<String>> {
        let (t, col) = match table {
            IdTable::Messages => ("messages", "id"),
            IdTable::Deliveries => ("deliveries", "message_id"),
        };
        // Ids are lower-case; SQLite's LIKE ignores case and PostgreSQL's does not: an id typed
        // in capitals resolves on both.
        let escaped = prefix
            .to_ascii_lowercase()
            .replace('\\', "\\\\")
            .replace('%', "\\%")
            .replace('_', "\\_");
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {col} FROM {t} WHERE {col} LIKE ?1 ESCAPE '\\' ORDER BY {col} LIMIT 2"
        ))?;
        let rows = st.query_map([format!("{escaped}%")], |r| r.get(0))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    pub fn mark_read(&self, id: &str, at: i64) -> Result<bool> {
        Ok(self.exec(
            "UPDATE messages SET read_at = ?2 WHERE id = ?1 AND read_at IS NULL",
            params![id, at],
        )? > 0)
    }

    /// `agent`'s messages, newest first: all of them, or the unread ones (a handoff of a
    /// cancelled chain is no news: its cancel's notification is).
    pub fn inbox(&self, agent: &str, all: bool, limit: i64) -> Result<Vec<MessageRow>> {
        let filter = if all {
            ""
        } else {
            "AND read_at IS NULL AND NOT (intent = 'handoff' AND EXISTS (SELECT 1 FROM chains c
                 WHERE c.id = messages.chain_id AND c.state = 'cancelled'))"
        };
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {MESSAGE_COLS} FROM messages WHERE recipient = ?1 {filter}
             ORDER BY seq DESC LIMIT ?2"
        ))?;
        let rows = st.query_map(params![agent, limit], message_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Unread handoffs, created at or after `after`, to a registered agent, without a
    /// delivery yet (SPEC §2.1), oldest first.
    pub fn unenrolled(&self, after: i64, limit: i64) -> Result<Vec<MessageRow>> {
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {} FROM messages m
             WHERE m.intent = 'handoff' AND m.read_at IS NULL AND m.created_at >= ?1
               AND EXISTS (SELECT 1 FROM agents a WHERE a.id = m.recipient)
               AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.message_id = m.id)
             ORDER BY m.seq LIMIT ?2",
            MESSAGE_COLS
                .split(", ")
                .map(|c| format!("m.{c}"))
                .collect::<Vec<_>>()
                .join(", ")
        ))?;
        let rows = st.query_map(params![after, limit], message_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// A live (pending or active) plain handoff with the same sender, recipient and body.
    pub fn live_identical(&self, m: &MessageRow) -> Result<Option<String>> {
        Ok(self
            .tx
            .prepare_cached(
                "SELECT d.message_id FROM deliveries d JOIN messages m ON m.id = d.message_id
                 WHERE m.sender = ?1 AND m.recipient = ?2 AND m.body_hash = ?3 AND m.kind = 'plain'
                   AND d.class IN ('pending', 'active') AND m.id != ?4
                 ORDER BY m.seq LIMIT 1",
            )?
            .query_row(params![m.sender, m.recipient, m.body_hash, m.id], |r| {
                r.get(0)
            })
            .optional()?)
    }
}
