//! Dead letters (SPEC §8.2): what could not be delivered, with its reason, until a person
//! replays it as a new message or drops it.

use super::{OptionalExtension, Result, Tx, params};

/// One dead letter.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct DeadLetterRow {
    pub id: String,
    /// The stored message that could not be delivered; `None` for a send refused before
    /// anything was stored.
    pub message_id: Option<String>,
    pub sender: String,
    pub recipient: String,
    pub body: String,
    pub title: Option<String>,
    /// `unknown_recipient`, `topology`, `failed`, `destination_changed` or `chain_stopped`.
    pub reason: String,
    pub detail: String,
    pub chain_id: Option<String>,
    pub parent_id: Option<String>,
    pub created_at: i64,
    /// The new message a person replayed it as.
    pub replayed_as: Option<String>,
    pub replayed_at: Option<i64>,
    pub dropped_at: Option<i64>,
}

const DEAD_COLS: &str = "id, message_id, sender, recipient, body, title, reason, detail, chain_id, \
     parent_id, created_at, replayed_as, replayed_at, dropped_at";

fn dead_from(r: &super::sql::Row<'_, '_>) -> rusqlite::Result<DeadLetterRow> {
    Ok(DeadLetterRow {
        id: r.get(0)?,
        message_id: r.get(1)?,
        sender: r.get(2)?,
        recipient: r.get(3)?,
        body: r.get(4)?,
        title: r.get(5)?,
        reason: r.get(6)?,
        detail: r.get(7)?,
        chain_id: r.get(8)?,
        parent_id: r.get(9)?,
        created_at: r.get(10)?,
        replayed_as: r.get(11)?,
        replayed_at: r.get(12)?,
        dropped_at: r.get(13)?,
    })
}

impl Tx<'_> {
    /// Keeps a dead letter; for a stored message, replaces the open one it may have (a
    /// delivery that failed after it was unavailable keeps one letter, with the newest reason).
    pub fn put_dead_letter(&self, d: &DeadLetterRow) -> Result<()> {
        if let Some(m) = &d.message_id {
            self.exec(
                "DELETE FROM dead_letters WHERE message_id = ?1
                   AND replayed_as IS NULL AND dropped_at IS NULL",
                [m],
            )?;
        }
        self.exec(
            &format!(
                "INSERT INTO dead_letters ({DEAD_COLS})
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)
                 ON CONFLICT DO NOTHING"
            ),
            params![
                d.id,
                d.message_id,
                d.sender,
                d.recipient,
                d.body,
                d.title,
                d.reason,
                d.detail,
                d.chain_id,
                d.parent_id,
                d.created_at,
                d.replayed_as,
                d.replayed_at,
                d.dropped_at
            ],
        )?;
        Ok(())
    }

    /// Whether an open letter of a refused send with this sender, recipient, body and chain
    /// is kept already (a turn's retries of one refused send keep one letter).
    pub fn open_refused_letter(
        &self,
        sender: &str,
        recipient: &str,
        body: &str,
        chain: Option<&str>,
    ) -> Result<bool> {
        Ok(self
            .tx
            .prepare_cached(
                "SELECT EXISTS (SELECT 1 FROM dead_letters WHERE message_id IS NULL
                   AND sender = ?1 AND recipient = ?2 AND body = ?3 AND chain_id IS NOT DISTINCT FROM ?4
                   AND replayed_as IS NULL AND dropped_at IS NULL)",
            )?
            .query_row(params![sender, recipient, body, chain], |r| r.get(0))?)
    }

    /// Takes back the open dead letter of message `id` (its delivery recovered).
    pub fn revive_dead_letter(&self, message_id: &str) -> Result<()> {
        self.exec(
            "DELETE FROM dead_letters WHERE message_id = ?1
               AND replayed_as IS NULL AND dropped_at IS NULL",
            [message_id],
        )?;
        Ok(())
    }

    pub fn dead_letter(&self, id: &str) -> Result<Option<DeadLetterRow>> {
        Ok(self
            .tx
            .prepare_cached(&format!(
                "SELECT {DEAD_COLS} FROM dead_letters WHERE id = ?1"
            ))?
            .query_row([id], dead_from)
            .optional()?)
    }

    /// Dead letters with `id` as their id's prefix (at most 2).
    pub fn dead_letter_ids(&self, prefix: &str) -> Result<Vec<String>> {
        let mut st = self.tx.prepare_cached(
            "SELECT id FROM dead_letters WHERE id >= ?1 AND id < ?2 ORDER BY id LIMIT 2",
        )?;
        let rows = st.query_map([prefix, &format!("{prefix}\u{10FFFF}")], |r| r.get(0))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// The newest dead letters first; only the open ones (neither replayed nor dropped)
    /// unless `all`.
    pub fn dead_letters(&self, all: bool, limit: i64) -> Result<Vec<DeadLetterRow>> {
        let filter = if all {
            ""
        } else {
            "WHERE replayed_as IS NULL AND dropped_at IS NULL"
        };
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {DEAD_COLS} FROM dead_letters {filter} ORDER BY created_at DESC, id LIMIT ?1"
        ))?;
        let rows = st.query_map([limit], dead_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Open dead letters by reason.
    pub fn dead_letter_counts(&self) -> Result<Vec<(String, i64)>> {
        let mut st = self.tx.prepare_cached(
            "SELECT reason, count(*) FROM dead_letters
             WHERE replayed_as IS NULL AND dropped_at IS NULL GROUP BY reason ORDER BY reason",
        )?;
        let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    pub fn mark_dead_letter(&self, id: &str, replayed_as: Option<&str>, at: i64) -> Result<bool> {
        let n = match replayed_as {
            Some(m) => self.exec(
                "UPDATE dead_letters SET replayed_as = ?2, replayed_at = ?3
                 WHERE id = ?1 AND replayed_as IS NULL AND dropped_at IS NULL",
                params![id, m, at],
            )?,
            None => self.exec(
                "UPDATE dead_letters SET dropped_at = ?2
                 WHERE id = ?1 AND replayed_as IS NULL AND dropped_at IS NULL",
                params![id, at],
            )?,
        };
        Ok(n == 1)
    }
}
