//! Deliveries: enrolment, the due query, records decoded through their shape check.

use super::{Delivery, OptionalExtension, Result, StateKind, StoreError, Tx, params};

/// A stored delivery: the model's record plus the engine's schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct DeliveryRow {
    pub message_id: String,
    pub recipient: String,
    pub record: Delivery,
    pub due_at: Option<i64>,
    pub updated_at: i64,
}

pub(super) fn decode_delivery(
    message_id: String,
    recipient: String,
    json: &str,
    due_at: Option<i64>,
    updated_at: i64,
) -> Result<DeliveryRow> {
    let bad = |detail: String| StoreError::BadRecord {
        message: message_id.clone(),
        detail,
    };
    let record: Delivery = serde_json::from_str(json).map_err(|e| bad(e.to_string()))?;
    // Read back, a record must still be one `step` could have made: a row edited by hand or
    // damaged is a clear error naming it, never a wrong state acted on.
    record.check_shape().map_err(|e| bad(e.to_string()))?;
    if record.core().message().as_str() != message_id {
        return Err(bad(format!(
            "its record belongs to message {}",
            record.core().message()
        )));
    }
    if record.core().target().agent.as_str() != recipient {
        return Err(bad(format!(
            "its record is addressed to {}, its row to {recipient}",
            record.core().target().agent
        )));
    }
    Ok(DeliveryRow {
        message_id,
        recipient,
        record,
        due_at,
        updated_at,
    })
}

pub(super) fn class_of(kind: StateKind) -> &'static str {
    match kind.class() {
        model::Class::Pending => "pending",
        model::Class::Active => "active",
        model::Class::Terminal => "terminal",
    }
}

/// A delivery's resends of either kind (its `resends` column).
fn resends_of(record: &Delivery) -> u32 {
    record.core().error_resends() + record.core().interrupt_resends()
}

/// Of the deliveries queued for one recipient, how many the engine looks at (and a
/// delivery that stops holding its recipient wakes): the head of the queue.
pub const QUEUE_HEADS: i64 = 2;

/// The recipients with pending deliveries, as a `WITH` clause (`pending(recipient)`): a skip
/// scan that jumps from one recipient to the next in the `deliveries_pending` index, so it
/// costs the number of recipients, not of pending deliveries (`SELECT DISTINCT` read every
/// one of 10,000 queued rows on each look of the engine).
macro_rules! pending_recipients {
    () => {
        "WITH RECURSIVE pending(recipient) AS (
        SELECT min(recipient) FROM deliveries WHERE class = 'pending'
        UNION ALL
        SELECT (SELECT min(d.recipient) FROM deliveries d
                WHERE d.class = 'pending' AND d.recipient > p.recipient)
        FROM pending p WHERE p.recipient IS NOT NULL)"
    };
}

/// The recipients an engine may not serve: leased by another live engine (unexpired at `?NOW`),
/// or bound to another machine than the engine's (`?HOST`). Spelled with fixed parameter
/// numbers by each query below: `?N` now, `?E` the engine, `?H` its host.
macro_rules! not_elsewhere {
    ($col:literal, $now:literal, $engine:literal, $host:literal) => {
        concat!(
            " AND ",
            $col,
            " NOT IN (SELECT agent FROM live_leases WHERE engine <> ",
            $engine,
            " AND expires_at > ",
            $now,
            ")",
            " AND ",
            $col,
            " NOT IN (SELECT id FROM agents WHERE host IS NOT NULL AND host <> ",
            $host,
            ")"
        )
    };
}

/// A recipient's due deliveries other than queued ones (uses `deliveries_recipient_due`).
pub(super) const DUE_FOR_SQL: &str = concat!(
    "SELECT message_id, CASE class WHEN 'active' THEN 0 ELSE 1 END, seq FROM deliveries
             WHERE recipient = ?1 AND due_at <= ?2 AND due_at IS NOT NULL
               AND state NOT IN ",
    queued!(),
    "
             ORDER BY due_at LIMIT 64"
);

/// Due deliveries other than queued ones (uses `deliveries_due`), of recipients the engine
/// `?3` on host `?4` may serve.
pub(super) const DUE_SQL: &str = concat!(
    "SELECT message_id, CASE class WHEN 'active' THEN 0 ELSE 1 END, seq, recipient
             FROM deliveries
             WHERE due_at <= ?1 AND due_at IS NOT NULL
               AND state NOT IN ",
    queued!(),
    not_elsewhere!("recipient", "?1", "?3", "?4"),
    "
             ORDER BY due_at LIMIT ?2"
);

/// The earliest due time the engine `?3` on host `?4` looks at, as of `?2` (uses
/// `deliveries_due`).
pub(super) const NEXT_DUE_SQL: &str = concat!(
    pending_recipients!(),
    " SELECT min(due_at) FROM (
               SELECT due_at FROM deliveries
               WHERE due_at IS NOT NULL AND state NOT IN ",
    queued!(),
    not_elsewhere!("recipient", "?2", "?3", "?4"),
    "
               UNION ALL
               SELECT (SELECT min(due_at) FROM (
                         SELECT due_at FROM deliveries d
                         WHERE d.class = 'pending' AND d.recipient = r.recipient
                           AND d.state IN ",
    queued!(),
    "
                         ORDER BY d.seq LIMIT ?1) AS head)
               FROM pending r WHERE r.recipient IS NOT NULL",
    not_elsewhere!("r.recipient", "?2", "?3", "?4"),
    "
             ) AS due"
);

impl Tx<'_> {
    pub fn insert_delivery(&self, d: &DeliveryRow, seq_of_message: &str) -> Result<()> {
        let json =
            serde_json::to_string(&d.record).map_err(|e| StoreError::Sqlite(e.to_string()))?;
        let kind = d.record.kind();
        self.exec(
            "INSERT INTO deliveries (message_id, seq, recipient, state, class, record, due_at, updated_at,
                                     attempts, resends)
             VALUES (?1, (SELECT seq FROM messages WHERE id = ?2), ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
            params![
                d.message_id,
                seq_of_message,
                d.recipient,
                kind.as_str(),
                class_of(kind),
                json,
                d.due_at,
                d.updated_at,
                d.record.core().attempts(),
                resends_of(&d.record)
            ],
        )?;
        Ok(())
    }

    pub fn delivery(&self, message_id: &str) -> Result<Option<DeliveryRow>> {
        let row: Option<(String, String, String, Option<i64>, i64)> = self
            .tx
            .prepare_cached(
                "SELECT message_id, recipient, record, due_at, updated_at FROM deliveries WHERE message_id = ?1",
            )?
            .query_row([message_id], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
            })
            .optional()?;
        row.map(|(message_id, recipient, json, due_at, updated_at)| {
            decode_delivery(message_id, recipient, &json, due_at, updated_at)
        })
        .transpose()
    }

    pub fn save_delivery(
        &self,
        message_id: &str,
        record: &Delivery,
        due_at: Option<i64>,
        now: i64,
    ) -> Result<()> {
        let json = serde_json::to_string(record).map_err(|e| StoreError::Sqlite(e.to_string()))?;
        let kind = record.kind();
        self.exec(
            "UPDATE deliveries SET state = ?2, class = ?3, record = ?4, due_at = ?5, updated_at = ?6,
                attempts = ?7, resends = ?8
             WHERE message_id = ?1",
            params![
                message_id,
                kind.as_str(),
                class_of(kind),
                json,
                due_at,
                now,
                record.core().attempts(),
                resends_of(record)
            ],
        )?;
        Ok(())
    }

    pub fn set_due(&self, message_id: &str, due_at: Option<i64>) -> Result<()> {
        self.exec(
            "UPDATE deliveries SET due_at = ?2 WHERE message_id = ?1",
            params![message_id, due_at],
        )?;
        Ok(())
    }

    /// Makes every pending delivery to `recipient` due now (its earlier delivery settled).
    pub fn wake_recipient(&self, recipient: &str, now: i64) -> Result<()> {
        self.exec(
            "UPDATE deliveries SET due_at = ?2 WHERE recipient = ?1 AND class = 'pending'
               AND (due_at IS NULL OR due_at > ?2)",
            params![recipient, now],
        )?;
        Ok(())
    }

    /// Makes the head of `recipient`'s queue due at `now`: its first `heads` queued
    /// deliveries, the only ones the engine looks at (a delivery stopped holding the
    /// recipient). Unlike [`Tx::wake_recipient`] it costs the same however long the queue.
    pub fn wake_queue(&self, recipient: &str, now: i64, heads: i64) -> Result<()> {
        self.exec(
            concat!(
                "UPDATE deliveries SET due_at = ?2 WHERE message_id IN (
                 SELECT message_id FROM deliveries
                 WHERE class = 'pending' AND recipient = ?1
                   AND state IN ",
                queued!(),
                "
                 ORDER BY seq LIMIT ?3)
               AND (due_at IS NULL OR due_at > ?2)"
            ),
            params![recipient, now, heads],
        )?;
        Ok(())
    }

    /// Makes every pending delivery due at `now` (a change of `enabled` or `connections`).
    pub fn wake_pending(&self, now: i64) -> Result<()> {
        self.exec(
            "UPDATE deliveries SET due_at = ?1 WHERE class = 'pending'
               AND (due_at IS NULL OR due_at > ?1)",
            params![now],
        )?;
        Ok(())
    }

    /// Another active delivery to `recipient`, if any.
    pub fn active_for(&self, recipient: &str, except: &str) -> Result<Option<String>> {
        Ok(self
            .tx
            .prepare_cached(
                "SELECT message_id FROM deliveries WHERE recipient = ?1 AND class = 'active'
                   AND message_id != ?2 LIMIT 1",
            )?
            .query_row([recipient, except], |r| r.get(0))
            .optional()?)
    }

    /// The due deliveries of one recipient, in the order of [`Tx::due`].
    pub fn due_for(&self, recipient: &str, now: i64, per_recipient: i64) -> Result<Vec<String>> {
        let mut out: Vec<(i64, i64, String)> = Vec::new();
        let mut others = self.tx.prepare_cached(DUE_FOR_SQL)?;
        for row in others.query_map(params![recipient, now], |r| {
            Ok((r.get(1)?, r.get(2)?, r.get(0)?))
        })? {
            out.push(row?);
        }
        let mut heads = self.tx.prepare_cached(concat!(
            "SELECT message_id, seq, due_at FROM deliveries
             WHERE class = 'pending' AND recipient = ?1
               AND state IN ",
            queued!(),
            "
             ORDER BY seq LIMIT ?2"
        ))?;
        for row in heads.query_map(params![recipient, per_recipient], |row| {
            Ok((
                row.get::<String>(0)?,
                row.get::<i64>(1)?,
                row.get::<Option<i64>>(2)?,
            ))
        })? {
            let (id, seq, due) = row?;
            if due.is_some_and(|d| d <= now) {
                out.push((1, seq, id));
            }
        }
        out.sort();
        Ok(out.into_iter().map(|(_, _, id)| id).collect())
    }

    /// Due deliveries for one pass, active ones first, then oldest first. Of the deliveries
    /// queued to take a turn (WAITING, BUSY, OWNER_REJECTED) only the oldest few per
    /// recipient are looked at, so a long queue is not re-examined row by row.
    /// Recipients leased by another engine than `engine`, or bound to another machine than
    /// `host`, are left out.
    pub fn due(
        &self,
        now: i64,
        per_recipient: i64,
        limit: i64,
        (engine, host): (&str, &str),
    ) -> Result<Vec<(String, String)>> {
        let mut out: Vec<(i64, i64, String, String)> = Vec::new();
        let mut others = self.tx.prepare_cached(DUE_SQL)?;
        for row in others.query_map(params![now, limit, engine, host], |r| {
            Ok((r.get(1)?, r.get(2)?, r.get(0)?, r.get(3)?))
        })? {
            out.push(row?);
        }
        let mut recipients = self.tx.prepare_cached(concat!(
            pending_recipients!(),
            " SELECT recipient FROM pending WHERE recipient IS NOT NULL",
            not_elsewhere!("recipient", "?1", "?2", "?3")
        ))?;
        let recipients: Vec<String> = recipients
            .query_map(params![now, engine, host], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()?;
        let mut heads = self.tx.prepare_cached(concat!(
            "SELECT message_id, seq, due_at FROM deliveries
             WHERE class = 'pending' AND recipient = ?1
               AND state IN ",
            queued!(),
            "
             ORDER BY seq LIMIT ?2"
        ))?;
        for r in recipients {
            for row in heads.query_map(params![r, per_recipient], |row| {
                Ok((
                    row.get::<String>(0)?,
                    row.get::<i64>(1)?,
                    row.get::<Option<i64>>(2)?,
                ))
            })? {
                let (id, seq, due) = row?;
                if due.is_some_and(|d| d <= now) {
                    out.push((1, seq, id, r.clone()));
                }
            }
        }
        out.sort();
        out.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        Ok(out.into_iter().map(|(_, _, id, r)| (id, r)).collect())
    }

    /// The earliest due time among the deliveries `due` would look at (for the engine's
    /// sleep): queued rows behind the first `per_recipient` of their recipient do not count.
    /// Recipients `due` leaves out at `now` do not count.
    pub fn next_due(
        &self,
        per_recipient: i64,
        now: i64,
        (engine, host): (&str, &str),
    ) -> Result<Option<i64>> {
        Ok(self
            .tx
            .prepare_cached(NEXT_DUE_SQL)?
            .query_row(params![per_recipient, now, engine, host], |r| r.get(0))?)
    }

    /// The pending deliveries to `recipient` (queued, busy, held, unavailable, refused once),
    /// oldest first.
    pub fn pending_for(&self, recipient: &str) -> Result<Vec<DeliveryRow>> {
        let mut st = self.tx.prepare_cached(
            "SELECT message_id, recipient, record, due_at, updated_at FROM deliveries
             WHERE class = 'pending' AND recipient = ?1 ORDER BY seq",
        )?;
        let rows = st.query_map([recipient], |r| {
            Ok((
                r.get::<String>(0)?,
                r.get::<String>(1)?,
                r.get::<String>(2)?,
                r.get::<Option<i64>>(3)?,
                r.get::<i64>(4)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (message_id, recipient, json, due_at, updated_at) = row?;
            out.push(decode_delivery(
                message_id, recipient, &json, due_at, updated_at,
            )?);
        }
        Ok(out)
    }

    /// Deliveries by state, newest change first.
    pub fn deliveries_in(&self, states: &[StateKind], limit: i64) -> Result<Vec<DeliveryRow>> {
        let (rows, damaged) = self.deliveries_or_damaged_in(states, limit)?;
        match damaged.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(rows),
        }
    }

    /// As [`Tx::deliveries_in`], with the rows that cannot be read back set apart (each
    /// error names its row), so one damaged row does not hide the others.
    pub fn deliveries_or_damaged_in(
        &self,
        states: &[StateKind],
        limit: i64,
    ) -> Result<(Vec<DeliveryRow>, Vec<StoreError>)> {
        if states.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        // The newest of each state straight from the `deliveries_state` index (state,
        // updated_at, seq), then merged: the cost is the number of states times `limit`,
        // however many deliveries have settled over the years.
        let mut st = self.tx.prepare_cached(
            "SELECT message_id, recipient, record, due_at, updated_at, seq FROM deliveries
             WHERE state = ?1 ORDER BY updated_at DESC, seq DESC LIMIT ?2",
        )?;
        let mut found = Vec::new();
        for state in states {
            let rows = st.query_map(params![state.as_str(), limit], |r| {
                Ok((
                    r.get::<i64>(4)?,
                    r.get::<i64>(5)?,
                    r.get::<String>(0)?,
                    r.get::<String>(1)?,
                    r.get::<String>(2)?,
                    r.get::<Option<i64>>(3)?,
                ))
            })?;
            for row in rows {
                found.push(row?);
            }
        }
        found.sort_by_key(|f| std::cmp::Reverse((f.0, f.1)));
        // A negative limit is no limit, as in SQLite.
        found.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        let mut out = Vec::new();
        let mut damaged = Vec::new();
        for (upd, _, m, rcpt, json, due) in found {
            match decode_delivery(m, rcpt, &json, due, upd) {
                Ok(d) => out.push(d),
                Err(e @ StoreError::BadRecord { .. }) => damaged.push(e),
                Err(e) => return Err(e),
            }
        }
        Ok((out, damaged))
    }

    pub fn count_by_state(&self) -> Result<Vec<(String, i64)>> {
        let mut st = self
            .tx
            .prepare_cached("SELECT state, n FROM delivery_counts WHERE n > 0 ORDER BY state")?;
        let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Deliveries per recipient in the given states.
    pub fn count_by_recipient(&self, states: &[StateKind]) -> Result<Vec<(String, i64)>> {
        let list = states
            .iter()
            .map(|s| format!("'{}'", s.as_str()))
            .collect::<Vec<_>>()
            .join(", ");
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT recipient, count(*) FROM deliveries WHERE state IN ({list}) GROUP BY recipient"
        ))?;
        let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// All deliveries' write attempts and resends (for /metrics).
    pub fn delivery_totals(&self) -> Result<(i64, i64)> {
        Ok(self
            .tx
            .prepare_cached(
                "SELECT coalesce(sum(attempts), 0), coalesce(sum(resends), 0)
                 FROM delivery_counts",
            )?
            .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))?)
    }

    /// The newest event's sequence number (0: none).
    pub fn last_event_seq(&self) -> Result<i64> {
        Ok(self
            .tx
            .prepare_cached("SELECT coalesce(max(seq), 0) FROM events")?
            .query_row([], |r| r.get(0))?)
    }
}
