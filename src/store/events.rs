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

pub(super) fn event_from(r: &rusqlite::Row<'_>) -> rusqlite::Result<EventRow> {
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
