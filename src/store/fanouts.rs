//! Fan-outs (SPEC §8.2): one piece of work split to several agents, joined when all (or a
//! quorum of) its children have returned, or at its deadline; which child answered, when,
//! and whether after the join.

use super::{OptionalExtension, Result, Tx, params};

/// A fan-out: its rule, its deadline and whether (and how) it was joined.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct FanoutRow {
    pub id: String,
    pub sender: String,
    pub title: String,
    /// How many children there are.
    pub children: i64,
    /// How many returns join it (all of them for a join, K for a quorum).
    pub quorum: i64,
    /// `all` or `quorum`.
    pub join_rule: String,
    pub deadline_at: Option<i64>,
    /// Whether the children still unanswered are cancelled when the quorum is reached.
    pub cancel_rest: bool,
    /// `waiting`, `complete`, `partial` (the deadline cut it) or `cancelled` (its chain was).
    pub state: String,
    /// The one combined return, once joined.
    pub combined_id: Option<String>,
    pub idem_key: Option<String>,
    pub created_at: i64,
    pub joined_at: Option<i64>,
}

/// One child of a fan-out: its work message, its recipient, and when it answered.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct FanoutChildRow {
    pub fanout_id: String,
    pub message_id: String,
    pub recipient: String,
    pub position: i64,
    pub answered_at: Option<i64>,
    /// Answered after the fan-out was joined: recorded, told to the sender, not combined.
    pub late: bool,
}

/// The schema of fan-outs (migration 12).
pub(super) const SCHEMA: &str = r"
CREATE TABLE IF NOT EXISTS fanouts (
    id TEXT PRIMARY KEY,
    sender TEXT NOT NULL,
    title TEXT NOT NULL,
    children INTEGER NOT NULL CHECK (children >= 1),
    quorum INTEGER NOT NULL CHECK (quorum >= 1 AND quorum <= children),
    join_rule TEXT NOT NULL CHECK (join_rule IN ('all', 'quorum')),
    deadline_at INTEGER,
    cancel_rest INTEGER NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('waiting', 'complete', 'partial', 'cancelled')),
    combined_id TEXT,
    idem_key TEXT,
    created_at INTEGER NOT NULL,
    joined_at INTEGER
);
CREATE UNIQUE INDEX IF NOT EXISTS fanouts_key ON fanouts (sender, idem_key)
    WHERE idem_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS fanouts_waiting ON fanouts (deadline_at)
    WHERE state = 'waiting';
CREATE TABLE IF NOT EXISTS fanout_children (
    message_id TEXT PRIMARY KEY,
    fanout_id TEXT NOT NULL REFERENCES fanouts (id),
    recipient TEXT NOT NULL,
    position INTEGER NOT NULL,
    answered_at INTEGER,
    late INTEGER NOT NULL DEFAULT 0,
    UNIQUE (fanout_id, position)
);
";

const FANOUT_COLS: &str = "id, sender, title, children, quorum, join_rule, deadline_at, \
                           cancel_rest, state, combined_id, idem_key, created_at, joined_at";
const CHILD_COLS: &str = "fanout_id, message_id, recipient, position, answered_at, late";

fn fanout_from(r: &super::sql::Row<'_, '_>) -> rusqlite::Result<FanoutRow> {
    Ok(FanoutRow {
        id: r.get(0)?,
        sender: r.get(1)?,
        title: r.get(2)?,
        children: r.get(3)?,
        quorum: r.get(4)?,
        join_rule: r.get(5)?,
        deadline_at: r.get(6)?,
        cancel_rest: r.get(7)?,
        state: r.get(8)?,
        combined_id: r.get(9)?,
        idem_key: r.get(10)?,
        created_at: r.get(11)?,
        joined_at: r.get(12)?,
    })
}

fn child_from(r: &super::sql::Row<'_, '_>) -> rusqlite::Result<FanoutChildRow> {
    Ok(FanoutChildRow {
        fanout_id: r.get(0)?,
        message_id: r.get(1)?,
        recipient: r.get(2)?,
        position: r.get(3)?,
        answered_at: r.get(4)?,
        late: r.get(5)?,
    })
}

impl Tx<'_> {
    pub fn insert_fanout(&self, f: &FanoutRow) -> Result<()> {
        self.exec(
            &format!(
                "INSERT INTO fanouts ({FANOUT_COLS})
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)"
            ),
            params![
                f.id,
                f.sender,
                f.title,
                f.children,
                f.quorum,
                f.join_rule,
                f.deadline_at,
                f.cancel_rest,
                f.state,
                f.combined_id,
                f.idem_key,
                f.created_at,
                f.joined_at
            ],
        )?;
        Ok(())
    }

    /// Keeps what a join changes: its state, its combined return and when.
    pub fn update_fanout(&self, f: &FanoutRow) -> Result<()> {
        self.exec(
            "UPDATE fanouts SET state = ?2, combined_id = ?3, joined_at = ?4 WHERE id = ?1",
            params![f.id, f.state, f.combined_id, f.joined_at],
        )?;
        Ok(())
    }

    pub fn fanout(&self, id: &str) -> Result<Option<FanoutRow>> {
        Ok(self
            .tx
            .prepare_cached(&format!("SELECT {FANOUT_COLS} FROM fanouts WHERE id = ?1"))?
            .query_row([id], fanout_from)
            .optional()?)
    }

    pub fn fanout_by_key(&self, sender: &str, key: &str) -> Result<Option<FanoutRow>> {
        Ok(self
            .tx
            .prepare_cached(&format!(
                "SELECT {FANOUT_COLS} FROM fanouts WHERE sender = ?1 AND idem_key = ?2"
            ))?
            .query_row([sender, key], fanout_from)
            .optional()?)
    }

    pub fn insert_fanout_child(&self, c: &FanoutChildRow) -> Result<()> {
        self.exec(
            &format!("INSERT INTO fanout_children ({CHILD_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6)"),
            params![
                c.fanout_id,
                c.message_id,
                c.recipient,
                c.position,
                c.answered_at,
                c.late
            ],
        )?;
        Ok(())
    }

    /// The fan-out child carried by message `id`, if it is one.
    pub fn fanout_child(&self, id: &str) -> Result<Option<FanoutChildRow>> {
        Ok(self
            .tx
            .prepare_cached(&format!(
                "SELECT {CHILD_COLS} FROM fanout_children WHERE message_id = ?1"
            ))?
            .query_row([id], child_from)
            .optional()?)
    }

    /// A fan-out's children in the order they were named.
    pub fn fanout_children(&self, fanout: &str) -> Result<Vec<FanoutChildRow>> {
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {CHILD_COLS} FROM fanout_children WHERE fanout_id = ?1 ORDER BY position"
        ))?;
        let rows = st.query_map([fanout], child_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Records that child `message` answered at `at` (late: after the join).
    pub fn answer_fanout_child(&self, message: &str, at: i64, late: bool) -> Result<()> {
        self.exec(
            "UPDATE fanout_children SET answered_at = ?2, late = ?3
             WHERE message_id = ?1 AND answered_at IS NULL",
            params![message, at, late],
        )?;
        Ok(())
    }

    /// A dead child replayed as message `new` (to `recipient`): the fan-out waits for it.
    pub fn relink_fanout_child(&self, old: &str, new: &str, recipient: &str) -> Result<()> {
        self.exec(
            "UPDATE fanout_children SET message_id = ?2, recipient = ?3
             WHERE message_id = ?1 AND answered_at IS NULL",
            params![old, new, recipient],
        )?;
        Ok(())
    }

    /// The ids of fan-outs that start with `prefix`, at most two.
    pub fn fanout_ids_with_prefix(&self, prefix: &str) -> Result<Vec<String>> {
        // Ids are lower-case; SQLite's LIKE ignores case and PostgreSQL's does not: an id typed
        // in capitals resolves on both.
        let escaped = prefix
            .to_ascii_lowercase()
            .replace('\\', "\\\\")
            .replace('%', "\\%")
            .replace('_', "\\_");
        let mut st = self.tx.prepare_cached(
            "SELECT id FROM fanouts WHERE id LIKE ?1 ESCAPE '\\' ORDER BY id LIMIT 2",
        )?;
        let rows = st.query_map([format!("{escaped}%")], |r| r.get(0))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Waiting fan-outs whose deadline has passed at `now`, the oldest deadline first.
    pub fn fanouts_past_deadline(&self, now: i64, limit: i64) -> Result<Vec<FanoutRow>> {
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {FANOUT_COLS} FROM fanouts
             WHERE state = 'waiting' AND deadline_at IS NOT NULL AND deadline_at <= ?1
             ORDER BY deadline_at LIMIT ?2"
        ))?;
        let rows = st.query_map(params![now, limit], fanout_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// The soonest deadline of a fan-out still waiting for its join.
    pub fn next_fanout_deadline(&self) -> Result<Option<i64>> {
        Ok(self
            .tx
            .prepare_cached(
                "SELECT min(deadline_at) FROM fanouts
                 WHERE state = 'waiting' AND deadline_at IS NOT NULL",
            )?
            .query_row([], |r| r.get(0))?)
    }

    /// Fan-outs still waiting for their join, the newest first.
    pub fn fanouts_waiting(&self, limit: i64) -> Result<Vec<FanoutRow>> {
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {FANOUT_COLS} FROM fanouts WHERE state = 'waiting'
             ORDER BY created_at DESC, id LIMIT ?1"
        ))?;
        let rows = st.query_map([limit], fanout_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// How many fan-outs were joined complete, and how many partial (their deadline cut
    /// them).
    pub fn fanout_joins(&self) -> Result<(i64, i64)> {
        Ok(self
            .tx
            .prepare_cached(
                "SELECT coalesce(sum(CASE WHEN state = 'complete' THEN 1 ELSE 0 END), 0),
                        coalesce(sum(CASE WHEN state = 'partial' THEN 1 ELSE 0 END), 0)
                 FROM fanouts",
            )?
            .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))?)
    }
}
