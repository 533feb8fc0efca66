//! Agent tokens for remote MCP (`handoffs agent token ID`): one bearer token per agent, shown
//! once and stored only as its SHA-256 hash, so a copy of the database lets nobody act as an
//! agent. A fast hash is enough: a token is 256 random bits, never a password a person chose.

use super::{Result, Service, ServiceError, check_agent_id, millis};
use crate::store::TokenOwner;
use sha2::{Digest, Sha256};

/// What a token starts with, so a leaked one is easy to recognise (and to search logs for).
pub const TOKEN_PREFIX: &str = "hat_";
/// The longest a token may be given to last: ten years, in minutes.
pub const TTL_MAX_MINUTES: f64 = 10.0 * 366.0 * 24.0 * 60.0;
/// How long a token lasts when no expiry is given: 30 days, in minutes.
pub const TTL_DEFAULT_MINUTES: f64 = 30.0 * 24.0 * 60.0;

/// A token just issued: the secret itself, shown this once.
#[derive(Clone, Debug, serde::Serialize)]
pub struct IssuedToken {
    pub agent: String,
    pub token: String,
    pub created_at: i64,
    /// Milliseconds since the epoch; none: it never expires.
    pub expires_at: Option<i64>,
    /// True when it replaced an earlier token (which no longer works).
    pub rotated: bool,
}

/// What is known of an agent's token without its secret (`agent token ID --show`).
#[derive(Clone, Debug, serde::Serialize)]
pub struct TokenInfo {
    pub agent: String,
    /// True when the agent has a token (expired or not).
    pub token: bool,
    pub created_at: Option<i64>,
    pub expires_at: Option<i64>,
    pub expired: bool,
}

/// Why a presented token does not name an agent: each its own sentence, never the secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenRefusal {
    /// No token, or not shaped like one.
    Malformed,
    /// No agent holds this token (never issued, rotated away, revoked, or its agent removed).
    Unknown,
    /// The token's time is up.
    Expired { agent: String, at: i64 },
}

impl std::fmt::Display for TokenRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenRefusal::Malformed => write!(
                f,
                "give the agent's token as `Authorization: Bearer {TOKEN_PREFIX}…` (`handoffs agent token ID` issues one)"
            ),
            TokenRefusal::Unknown => write!(
                f,
                "unknown token: it was never issued, or was rotated or revoked (`handoffs agent token ID` issues a new one)"
            ),
            TokenRefusal::Expired { agent, at } => write!(
                f,
                "the token of agent {agent} expired at {} (`handoffs agent token {agent}` issues a new one)",
                crate::text::when(*at)
            ),
        }
    }
}

/// The stored form of `token` (also what tells one issued token from the next).
pub fn hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.trim().as_bytes()))
}

impl Service {
    /// Issues `agent` a new token, replacing any earlier one; it lasts `ttl_minutes` (none:
    /// never expires).
    pub fn issue_agent_token(
        &mut self,
        agent: &str,
        ttl_minutes: Option<f64>,
    ) -> Result<IssuedToken> {
        check_agent_id(agent)?;
        if let Some(m) = ttl_minutes
            && !(m.is_finite() && m > 0.0 && m <= TTL_MAX_MINUTES)
        {
            return Err(ServiceError::Usage(format!(
                "--expires-minutes must be more than 0 and at most {TTL_MAX_MINUTES} (ten years)"
            )));
        }
        let mut secret = [0u8; 32];
        rand::Rng::fill(&mut rand::rng(), &mut secret);
        let token = format!("{TOKEN_PREFIX}{}", hex::encode(secret));
        let now = millis(self.now());
        // Whole milliseconds, at least one.
        #[allow(clippy::cast_possible_truncation)]
        let expires_at = ttl_minutes.map(|m| now + ((m * 60_000.0).round() as i64).max(1));
        let stored = hash(&token);
        let rotated = self.store.write(|tx| {
            if tx.agent(agent)?.is_none() {
                return Err(ServiceError::NotFound(format!(
                    "unknown agent {agent:?}; register it with `handoffs agent add {agent} --provider …`"
                )));
            }
            let rotated = tx.set_agent_token(agent, &stored, now, expires_at)?;
            let what = if rotated { "rotated" } else { "issued" };
            tx.event(now, None, "agent", &format!("agent {agent}: token {what}"))?;
            Ok(rotated)
        })?;
        Ok(IssuedToken {
            agent: agent.to_owned(),
            token,
            created_at: now,
            expires_at,
            rotated,
        })
    }

    /// Revokes `agent`'s token; true when it had one.
    pub fn revoke_agent_token(&mut self, agent: &str) -> Result<bool> {
        check_agent_id(agent)?;
        let now = millis(self.now());
        self.store.write(|tx| {
            if tx.agent(agent)?.is_none() {
                return Err(ServiceError::NotFound(format!("unknown agent {agent:?}")));
            }
            let had = tx.remove_agent_token(agent)?;
            if had {
                tx.event(now, None, "agent", &format!("agent {agent}: token revoked"))?;
            }
            Ok(had)
        })
    }

    /// Whether `agent` has a token, when it was issued and until when it holds (never the
    /// secret, which is not stored).
    pub fn agent_token_info(&mut self, agent: &str) -> Result<TokenInfo> {
        check_agent_id(agent)?;
        let now = millis(self.now());
        self.store.read(|tx| {
            if tx.agent(agent)?.is_none() {
                return Err(ServiceError::NotFound(format!("unknown agent {agent:?}")));
            }
            let held = tx.agent_token(agent)?;
            Ok(TokenInfo {
                agent: agent.to_owned(),
                token: held.is_some(),
                created_at: held.as_ref().map(|t| t.created_at),
                expires_at: held.as_ref().and_then(|t| t.expires_at),
                expired: held.is_some_and(|t| expired(&t, now)),
            })
        })
    }

    /// True while the token stored as `stored` (see [`hash`]) is issued and unexpired: what
    /// keeps the remote sessions it opened alive.
    pub fn token_holds(&mut self, stored: &str) -> Result<bool> {
        let now = millis(self.now());
        let owner = self.store.read(|tx| tx.token_owner(stored))?;
        Ok(owner.is_some_and(|o| !expired(&o, now)))
    }

    /// The stored record of a presented token (its agent, when it was issued, until when),
    /// or why it names no agent.
    pub fn token_holder(
        &mut self,
        token: &str,
    ) -> Result<std::result::Result<TokenOwner, TokenRefusal>> {
        let token = token.trim();
        if !well_formed(token) {
            return Ok(Err(TokenRefusal::Malformed));
        }
        let stored = hash(token);
        let now = millis(self.now());
        let owner = self.store.read(|tx| tx.token_owner(&stored))?;
        Ok(match owner {
            None => Err(TokenRefusal::Unknown),
            Some(o) if expired(&o, now) && !crate::planted(crate::Plant::TokenExpiryIgnored) => {
                Err(TokenRefusal::Expired {
                    agent: o.agent,
                    at: o.expires_at.unwrap_or(now),
                })
            }
            Some(o) => Ok(o),
        })
    }
}

/// True once a token's time is up (at its expiry instant, not after it); the one rule for the
/// refusal, the sweep and `--show`.
fn expired(t: &TokenOwner, now: i64) -> bool {
    t.expires_at.is_some_and(|at| at <= now)
}

/// True for a token of the shape `agent token` issues (`hat_` and 64 hex digits): anything
/// else is refused before the database is asked.
pub fn well_formed(token: &str) -> bool {
    token
        .trim()
        .strip_prefix(TOKEN_PREFIX)
        .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_hashed_rotated_and_expire() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("h.db");
        let mut s = Service::init(&db).unwrap().0;
        s.add_agent("alice", Some("demo"), None, None, None, &[])
            .unwrap();
        assert!(matches!(
            s.issue_agent_token("nobody", None),
            Err(ServiceError::NotFound(_))
        ));
        let first = s.issue_agent_token("alice", None).unwrap();
        assert!(!first.rotated && first.expires_at.is_none());
        assert_eq!(
            s.token_holder(&first.token).unwrap().map(|o| o.agent),
            Ok("alice".to_owned())
        );
        let second = s.issue_agent_token("alice", Some(60.0)).unwrap();
        assert!(second.rotated);
        assert_eq!(
            s.token_holder(&first.token).unwrap().map(|o| o.agent),
            Err(TokenRefusal::Unknown)
        );
        assert_eq!(
            s.token_holder(&second.token).unwrap().map(|o| o.agent),
            Ok("alice".to_owned())
        );
        assert_eq!(
            s.token_holder("hat_zz").unwrap().map(|o| o.agent),
            Err(TokenRefusal::Malformed)
        );
        assert!(s.revoke_agent_token("alice").unwrap());
        assert_eq!(
            s.token_holder(&second.token).unwrap().map(|o| o.agent),
            Err(TokenRefusal::Unknown)
        );
        // The secret itself is in none of the database's files.
        drop(s);
        for entry in std::fs::read_dir(dir.path()).unwrap() {
            let bytes = std::fs::read(entry.unwrap().path()).unwrap();
            for t in [&first.token, &second.token] {
                let secret = &t.as_bytes()[TOKEN_PREFIX.len()..];
                assert!(!bytes.windows(secret.len()).any(|w| w == secret));
            }
        }
    }
}
