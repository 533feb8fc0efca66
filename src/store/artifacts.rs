//! Artifacts (SPEC §8.2 bounded summaries): the full text of a summary a card carries only
//! in part, kept for the two agents the card is between, fetched on demand.

use super::{OptionalExtension, Result, Tx, params};

/// One artifact.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ArtifactRow {
    pub id: String,
    /// What it is the full text of: `return` (a return's summary and evidence) or `pass`
    /// (a task pass's next action).
    pub kind: String,
    /// The card's sender and recipient: the agents who may fetch it.
    pub sender: String,
    pub recipient: String,
    pub body: String,
    pub created_at: i64,
}

/// The schema of artifacts (migration 11; `Store::migrate` adds each topic post's hash).
pub(super) const SCHEMA: &str = r"
CREATE TABLE IF NOT EXISTS artifacts (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    sender TEXT NOT NULL,
    recipient TEXT NOT NULL,
    body TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
";

impl Tx<'_> {
    pub fn insert_artifact(&self, a: &ArtifactRow) -> Result<()> {
        self.exec(
            "INSERT INTO artifacts (id, kind, sender, recipient, body, created_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![a.id, a.kind, a.sender, a.recipient, a.body, a.created_at],
        )?;
        Ok(())
    }

    pub fn artifact(&self, id: &str) -> Result<Option<ArtifactRow>> {
        Ok(self
            .tx
            .prepare_cached(
                "SELECT id, kind, sender, recipient, body, created_at FROM artifacts WHERE id = ?1",
            )?
            .query_row([id], |r| {
                Ok(ArtifactRow {
                    id: r.get(0)?,
                    kind: r.get(1)?,
                    sender: r.get(2)?,
                    recipient: r.get(3)?,
                    body: r.get(4)?,
                    created_at: r.get(5)?,
                })
            })
            .optional()?)
    }
}
