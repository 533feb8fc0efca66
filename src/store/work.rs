//! Work contracts and their reminders.

use super::{OPEN_WORK, OptionalExtension, Result, Tx, WorkState, params};

/// A work contract.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct WorkRow {
    pub id: String,
    pub sender: String,
    pub recipient: String,
    pub title: String,
    pub state: WorkState,
    pub due_at: Option<i64>,
    pub reminded_at: Option<i64>,
    pub summary: Option<String>,
    pub evidence: Option<String>,
    pub outcome: Option<String>,
    pub note: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
}

pub(super) fn work_from(r: &super::sql::Row<'_, '_>) -> rusqlite::Result<WorkRow> {
    Ok(WorkRow {
        id: r.get(0)?,
        sender: r.get(1)?,
        recipient: r.get(2)?,
        title: r.get(3)?,
        state: {
            let text: String = r.get(4)?;
            text.parse().map_err(|e: String| {
                rusqlite::Error::FromSqlConversionFailure(4, rusqlite::types::Type::Text, e.into())
            })?
        },
        due_at: r.get(5)?,
        reminded_at: r.get(6)?,
        summary: r.get(7)?,
        evidence: r.get(8)?,
        outcome: r.get(9)?,
        note: r.get(10)?,
        created_at: r.get(11)?,
        updated_at: r.get(12)?,
    })
}

pub(super) const WORK_COLS: &str = "id, sender, recipient, title, state, due_at, reminded_at, summary, evidence, outcome, note, created_at, updated_at";

/// Open work: in all, overdue, and per recipient.
pub type WorkCounts = (i64, i64, Vec<(String, i64)>);

/// When one piece of work was sent, accepted and returned (ms).
pub type WorkTimes = (i64, Option<i64>, Option<i64>);

impl Tx<'_> {
    pub fn insert_work(&self, w: &WorkRow) -> Result<()> {
        self.exec(
            &format!("INSERT INTO work ({WORK_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)"),
            params![
                w.id, w.sender, w.recipient, w.title, w.state.as_str(), w.due_at, w.reminded_at, w.summary,
                w.evidence, w.outcome, w.note, w.created_at, w.updated_at
            ],
        )?;
        Ok(())
    }

    pub fn work(&self, id: &str) -> Result<Option<WorkRow>> {
        Ok(self
            .tx
            .prepare_cached(&format!("SELECT {WORK_COLS} FROM work WHERE id = ?1"))?
            .query_row([id], work_from)
            .optional()?)
    }

    pub fn update_work(&self, w: &WorkRow) -> Result<()> {
        self.exec(
            "UPDATE work SET state = ?2, reminded_at = ?3, summary = ?4, evidence = ?5,
               outcome = ?6, note = ?7, updated_at = ?8 WHERE id = ?1",
            params![
                w.id,
                w.state.as_str(),
                w.reminded_at,
                w.summary,
                w.evidence,
                w.outcome,
                w.note,
                w.updated_at
            ],
        )?;
        Ok(())
    }

    pub fn open_work(&self, limit: i64) -> Result<Vec<WorkRow>> {
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {WORK_COLS} FROM work WHERE state != 'closed' ORDER BY created_at LIMIT ?1"
        ))?;
        let rows = st.query_map([limit], work_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Work past its due time, not returned, not yet reminded.
    pub fn overdue_unreminded(&self, now: i64) -> Result<Vec<WorkRow>> {
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {WORK_COLS} FROM work
             WHERE due_at IS NOT NULL AND due_at <= ?1 AND reminded_at IS NULL
               AND {OPEN_WORK} ORDER BY due_at"
        ))?;
        let rows = st.query_map([now], work_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// When the next reminder falls due: the earliest due time of open, unreminded work.
    pub fn next_reminder_at(&self) -> Result<Option<i64>> {
        Ok(self
            .tx
            .prepare_cached(&format!(
                "SELECT min(due_at) FROM work
                 WHERE due_at IS NOT NULL AND reminded_at IS NULL AND {OPEN_WORK}"
            ))?
            .query_row([], |r| r.get(0))?)
    }

    /// Recent work, newest change first: when each was sent, accepted and returned.
    pub fn work_timings(&self, limit: i64) -> Result<Vec<WorkTimes>> {
        let mut st = self.tx.prepare_cached(
            "SELECT w.created_at,
               (SELECT min(e.at) FROM events e WHERE e.message_id = w.id AND e.kind = 'work'
                  AND e.detail LIKE 'accepted by %'),
               (SELECT min(e.at) FROM events e WHERE e.message_id = w.id AND e.kind = 'work'
                  AND (e.detail LIKE 'returned by %' OR e.detail LIKE 'blocked by %'))
             FROM work w ORDER BY w.updated_at DESC LIMIT ?1",
        )?;
        let rows = st.query_map([limit], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Open work (not closed): how much in all, how much overdue at `now`, and how much per
    /// recipient.
    pub fn work_counts(&self, now: i64) -> Result<WorkCounts> {
        let (open, overdue) = self
            .tx
            .prepare_cached(&format!(
                "SELECT count(*),
                    coalesce(sum(CASE WHEN {OPEN_WORK} AND due_at IS NOT NULL AND due_at <= ?1
                                 THEN 1 ELSE 0 END), 0)
             FROM work WHERE state != 'closed'"
            ))?
            .query_row([now], |r| Ok((r.get(0)?, r.get(1)?)))?;
        let mut st = self.tx.prepare_cached(
            "SELECT recipient, count(*) FROM work WHERE state != 'closed' GROUP BY recipient",
        )?;
        let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok((open, overdue, rows.collect::<rusqlite::Result<_>>()?))
    }

    /// The newest open work first (`overdue_at`: only work overdue at that time).
    pub fn newest_open_work(&self, overdue_at: Option<i64>, limit: i64) -> Result<Vec<WorkRow>> {
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {WORK_COLS} FROM work WHERE state != 'closed'
               AND (CAST(?1 AS BIGINT) IS NULL OR ({OPEN_WORK} AND due_at IS NOT NULL AND due_at <= ?1))
             ORDER BY created_at DESC LIMIT ?2"
        ))?;
        let rows = st.query_map(params![overdue_at, limit], work_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }
}
