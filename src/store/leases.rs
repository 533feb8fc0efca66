//! Recipient leases (issue 17): each recipient is served by at most one engine at a time. An
//! engine takes a recipient's lease before it steps any of its deliveries, renews it while it
//! serves it, and lets it go when it stops. A lease carries a fencing token (`fence`) that
//! grows by one each time the lease passes to another engine; every step an engine commits
//! for a recipient checks, in the step's own transaction, that the lease is still its own
//! with the token it took, and a reservation records the token it was made under. So an
//! engine that was paused past its lease cannot commit anything for that recipient once
//! another engine took it.
//!
//! Times are milliseconds of the engines' clocks: a lease that has expired by the taker's
//! clock may be taken, so an engine whose clock runs ahead takes leases early. That costs
//! the engine that lost it its recipient; the token check of every step and the read of the
//! lease right before every write do not depend on any clock, which leaves only the moment
//! between that read and the write (`model/tests/fencing.rs` checks it with clocks apart,
//! read and write one step). Keep clocks close (NTP). The rules these statements follow are
//! `model::lease`'s.

use super::{OptionalExtension, Result, Tx, params};

/// 13 → 14: recipient leases; each agent's machine (`agents.host`, for adapters that run
/// there) and the fencing token a delivery's reservation was made under
/// (`deliveries.fence`), both added by `Store::migrate` where missing.
/// `live_leases` holds the leases whose engine may still be alive: on PostgreSQL those whose
/// session (`session`, its server process) is still connected, so a killed engine's
/// recipients are taken over at once, while a paused one's (its session still open) wait for
/// the lease to expire. SQLite has the table and the view for one schema on both, and no
/// leases: one engine per file, under the file's lock.
pub(super) const SCHEMA: &str = r"
CREATE TABLE IF NOT EXISTS recipient_leases (
    agent TEXT PRIMARY KEY,
    engine TEXT NOT NULL,
    fence INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    session INTEGER
);
CREATE VIEW IF NOT EXISTS live_leases AS
    SELECT agent, engine, fence, expires_at FROM recipient_leases;
";

/// The columns migration 14 adds: table, column, type.
pub(super) const COLUMNS_14: [(&str, &str, &str); 2] = [
    ("agents", "host", "TEXT"),
    ("deliveries", "fence", "INTEGER"),
];

/// One recipient's lease as stored.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LeaseRow {
    pub agent: String,
    pub engine: String,
    pub fence: i64,
    pub expires_at: i64,
}

impl Tx<'_> {
    /// Takes (or keeps) `agent`'s lease for `engine` (on this transaction's server session)
    /// until `expires_at`, if it is free, expired at `now`, its engine's session is gone, or
    /// it is already `engine`'s: the lease's fencing token, or `None` when another engine
    /// holds it. The token grows by one whenever the lease passes to another engine.
    pub fn take_lease(
        &self,
        agent: &str,
        engine: &str,
        now: i64,
        expires_at: i64,
    ) -> Result<Option<i64>> {
        let session = self.tx.session_pid();
        Ok(self
            .row(
                "INSERT INTO recipient_leases (agent, engine, fence, expires_at, session)
                 VALUES (?1, ?2, 1, ?3, ?5)
                 ON CONFLICT (agent) DO UPDATE SET
                   fence = recipient_leases.fence
                     + CASE WHEN recipient_leases.engine = excluded.engine THEN 0 ELSE 1 END,
                   engine = excluded.engine,
                   expires_at = excluded.expires_at,
                   session = excluded.session
                 WHERE recipient_leases.engine = excluded.engine
                    OR recipient_leases.expires_at <= ?4
                    OR recipient_leases.agent NOT IN (SELECT agent FROM live_leases)
                 RETURNING fence",
                params![agent, engine, expires_at, now, session],
                |r| r.get(0),
            )
            .optional()?)
    }

    /// Extends every lease `engine` holds to `expires_at`, under this transaction's server
    /// session: the recipients and tokens it still holds. A lease that expired with nobody
    /// taking it is still `engine`'s (taking it would have named another engine); one it let
    /// go (`expires_at` 0) is not renewed.
    pub fn renew_leases(&self, engine: &str, expires_at: i64) -> Result<Vec<(String, i64)>> {
        let session = self.tx.session_pid();
        let mut st = self.tx.prepare_cached(
            "UPDATE recipient_leases SET expires_at = ?2, session = ?3
             WHERE engine = ?1 AND expires_at > 0
             RETURNING agent, fence",
        )?;
        let rows = st.query_map(params![engine, expires_at, session], |r| {
            Ok((r.get::<String>(0)?, r.get::<i64>(1)?))
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Lets `agent`'s lease go, if `engine` holds it (another engine may take it at once).
    pub fn release_lease(&self, agent: &str, engine: &str) -> Result<()> {
        self.exec(
            "UPDATE recipient_leases SET expires_at = 0 WHERE agent = ?1 AND engine = ?2",
            params![agent, engine],
        )?;
        Ok(())
    }

    /// Lets every lease of `engine` go (an engine that stops).
    pub fn release_leases(&self, engine: &str) -> Result<()> {
        self.exec(
            "UPDATE recipient_leases SET expires_at = 0 WHERE engine = ?1",
            [engine],
        )?;
        Ok(())
    }

    /// The fencing check of every step an engine commits: whether `engine` still holds
    /// `agent`'s lease with the token `fence` (expired or not: nobody took it meanwhile, or
    /// the token would have grown); if so, the lease is extended to `expires_at` in the same
    /// transaction, so the step's own commit is the engine's latest renewal.
    pub fn hold_lease(
        &self,
        agent: &str,
        engine: &str,
        fence: i64,
        expires_at: i64,
    ) -> Result<bool> {
        let session = self.tx.session_pid();
        Ok(self.exec(
            "UPDATE recipient_leases SET expires_at = ?4, session = ?5
             WHERE agent = ?1 AND engine = ?2 AND fence = ?3",
            params![agent, engine, fence, expires_at, session],
        )? == 1)
    }

    /// Records the fencing token a delivery's reservation was made under.
    pub fn set_delivery_fence(&self, id: &str, fence: i64) -> Result<()> {
        self.exec(
            "UPDATE deliveries SET fence = ?2 WHERE message_id = ?1",
            params![id, fence],
        )?;
        Ok(())
    }

    /// What the check before a write reads, in one statement: the fencing token delivery
    /// `id`'s latest reservation was made under, if any, and `agent`'s lease
    /// ([`Tx::lease_of`]).
    pub fn fence_and_lease(
        &self,
        id: &str,
        agent: &str,
    ) -> Result<(Option<i64>, Option<LeaseRow>)> {
        Ok(self.row(
            "SELECT d.fence, l.agent, l.engine, l.fence, l.expires_at
               FROM (SELECT 1 AS one) AS one
               LEFT JOIN deliveries d ON d.message_id = ?1
               LEFT JOIN recipient_leases l ON l.agent = ?2",
            params![id, agent],
            |r| {
                let lease = match r.get::<Option<String>>(1)? {
                    Some(agent) => Some(LeaseRow {
                        agent,
                        engine: r.get(2)?,
                        fence: r.get(3)?,
                        expires_at: r.get(4)?,
                    }),
                    None => None,
                };
                Ok((r.get::<Option<i64>>(0)?, lease))
            },
        )?)
    }

    /// `agent`'s lease as stored now, if it ever had one.
    pub fn lease_of(&self, agent: &str) -> Result<Option<LeaseRow>> {
        Ok(self
            .row(
                "SELECT agent, engine, fence, expires_at FROM recipient_leases WHERE agent = ?1",
                params![agent],
                |r| {
                    Ok(LeaseRow {
                        agent: r.get(0)?,
                        engine: r.get(1)?,
                        fence: r.get(2)?,
                        expires_at: r.get(3)?,
                    })
                },
            )
            .optional()?)
    }

    /// Every recipient lease, by recipient.
    pub fn leases(&self) -> Result<Vec<LeaseRow>> {
        let mut st = self.tx.prepare_cached(
            "SELECT agent, engine, fence, expires_at FROM recipient_leases ORDER BY agent",
        )?;
        let rows = st.query_map([], |r| {
            Ok(LeaseRow {
                agent: r.get(0)?,
                engine: r.get(1)?,
                fence: r.get(2)?,
                expires_at: r.get(3)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Sets the machine an agent's adapter runs on (`None`: any engine may serve it).
    pub fn set_agent_host(&self, agent: &str, host: Option<&str>) -> Result<()> {
        self.exec(
            "UPDATE agents SET host = ?2 WHERE id = ?1",
            params![agent, host],
        )?;
        Ok(())
    }
}
