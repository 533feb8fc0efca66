//! Agent tokens (remote MCP, SPEC §7): one bearer token per agent, stored only as its SHA-256
//! hash, with an optional expiry. The token fixes the identity of a remote MCP session exactly
//! as `--agent` does on stdio.

use super::{OptionalExtension, Result, Tx, params};

/// 12 → 13: each agent's token hash, when it was issued and until when it holds.
pub(super) const SCHEMA: &str = r"
CREATE TABLE IF NOT EXISTS agent_tokens (
    agent TEXT PRIMARY KEY,
    hash TEXT NOT NULL UNIQUE,
    created_at INTEGER NOT NULL,
    expires_at INTEGER
);
";

/// Whose token a hash is, and until when it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenOwner {
    pub agent: String,
    pub created_at: i64,
    pub expires_at: Option<i64>,
}

impl Tx<'_> {
    /// Stores `hash` as `agent`'s one token, replacing (rotating) any earlier one; true when
    /// there was one.
    pub fn set_agent_token(
        &self,
        agent: &str,
        hash: &str,
        now: i64,
        expires_at: Option<i64>,
    ) -> Result<bool> {
        let had = self.remove_agent_token(agent)?;
        self.exec(
            "INSERT INTO agent_tokens (agent, hash, created_at, expires_at) VALUES (?1, ?2, ?3, ?4)",
            params![agent, hash, now, expires_at],
        )?;
        Ok(had)
    }

    /// Drops `agent`'s token; true when it had one.
    pub fn remove_agent_token(&self, agent: &str) -> Result<bool> {
        Ok(self.exec("DELETE FROM agent_tokens WHERE agent = ?1", [agent])? > 0)
    }

    /// The agent whose token hashes to `hash`, if any.
    pub fn token_owner(&self, hash: &str) -> Result<Option<TokenOwner>> {
        self.token_where("hash", hash)
    }

    /// `agent`'s token, as stored (no secret: the hash's owner and times).
    pub fn agent_token(&self, agent: &str) -> Result<Option<TokenOwner>> {
        self.token_where("agent", agent)
    }

    /// The token row whose `column` (`hash` or `agent`, both unique) is `value`.
    fn token_where(&self, column: &'static str, value: &str) -> Result<Option<TokenOwner>> {
        let sql =
            format!("SELECT agent, created_at, expires_at FROM agent_tokens WHERE {column} = ?1");
        Ok(self
            .row(&sql, [value], |r| {
                Ok(TokenOwner {
                    agent: r.get(0)?,
                    created_at: r.get(1)?,
                    expires_at: r.get(2)?,
                })
            })
            .optional()?)
    }
}
