//! The history: one row per thing that happened.

use super::{Result, Tx, params};

/// One line of the event timeline.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct EventRow {
    pub seq: i64,
    pub at: i64,
    pub message_id: Option<String>,
    pub kind: String,
    pub detail: String,
}

pub(super) fn event_from(r: &super::sql::Row<'_, '_>) -> rusqlite::Result<EventRow> {
    Ok(EventRow {
        seq: r.get(0)?,
        at: r.get(1)?,
        message_id: r.get(2)?,
        kind: r.get(3)?,
        detail: r.get(4)?,
    })
}

impl Tx<'_> {
    pub fn event(&self, at: i64, message_id: Option<&str>, kind: &str, detail: &str) -> Result<()> {
        self.tx
            .prepare_cached(
                "INSERT INTO events (at, message_id, kind, detail) VALUES (?1, ?2, ?3, ?4)",
            )?
            .execute(params![at, message_id, kind, detail])?;
        Ok(())
    }

    pub fn events_for(&self, message_id: &str) -> Result<Vec<EventRow>> {
        let mut st = self.tx.prepare_cached(
            "SELECT seq, at, message_id, kind, detail FROM events WHERE message_id = ?1 ORDER BY seq",
        )?;
        let rows = st.query_map([message_id], event_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    pub fn events_after(&self, after: i64, limit: i64) -> Result<Vec<EventRow>> {
        let mut st = self.tx.prepare_cached(
            "SELECT seq, at, message_id, kind, detail FROM events WHERE seq > ?1 ORDER BY seq LIMIT ?2",
        )?;
        let rows = st.query_map([after, limit], event_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }
}

/// One line of the global trace: an event with the message it is about.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TraceRow {
    pub seq: i64,
    pub at: i64,
    pub kind: String,
    pub detail: String,
    pub message_id: Option<String>,
    pub chain_id: Option<String>,
    pub parent_id: Option<String>,
    pub sender: Option<String>,
    pub recipient: Option<String>,
    pub title: Option<String>,
    /// `handoff` or `notification`, with the message.
    pub intent: Option<String>,
    /// The message's first 80 characters.
    pub preview: Option<String>,
}

impl Tx<'_> {
    /// Events in their one global order (their sequence) from `after_seq` on, published at
    /// `since` or later, of chain `chain` only when given; at most `limit`.
    pub fn trace(
        &self,
        chain: Option<&str>,
        since: i64,
        after_seq: i64,
        limit: i64,
    ) -> Result<Vec<TraceRow>> {
        let mut st = self.tx.prepare_cached(
            "SELECT e.seq, e.at, e.kind, e.detail, e.message_id,
                    coalesce(m.chain_id, m.id), m.parent_id, m.sender, m.recipient, m.title,
                    m.intent, substr(m.body, 1, 80)
             FROM events e LEFT JOIN messages m ON m.id = e.message_id
             WHERE e.seq > ?1 AND e.at >= ?2
               AND (CAST(?3 AS TEXT) IS NULL OR coalesce(m.chain_id, m.id) = ?3)
             ORDER BY e.seq LIMIT ?4",
        )?;
        let rows = st.query_map(params![after_seq, since, chain, limit], |r| {
            Ok(TraceRow {
                seq: r.get(0)?,
                at: r.get(1)?,
                kind: r.get(2)?,
                detail: r.get(3)?,
                message_id: r.get(4)?,
                chain_id: r.get(5)?,
                parent_id: r.get(6)?,
                sender: r.get(7)?,
                recipient: r.get(8)?,
                title: r.get(9)?,
                intent: r.get(10)?,
                preview: r.get(11)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }
}
