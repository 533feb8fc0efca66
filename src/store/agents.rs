//! Agents and the connections between them.

use super::{OptionalExtension, Result, Tx, Value, params};

/// A registered agent.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct AgentRow {
    pub id: String,
    pub name: String,
    pub provider: String,
    pub endpoint: String,
    pub cwd: String,
    pub settings: Value,
    pub created_at: i64,
    pub updated_at: i64,
    /// The machine whose engine alone serves it (a command, Codex or Claude Code agent on a
    /// shared PostgreSQL database), if it is bound to one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

impl AgentRow {
    /// The settings that address this agent (`model::ROUTE_SETTINGS`), each as JSON text: the
    /// part of its destination that lives in its settings (G1).
    pub fn route(&self) -> std::collections::BTreeMap<String, String> {
        route_of(&self.settings)
    }

    /// This agent as the adapters must address it for a delivery frozen to `target`: the
    /// provider, endpoint and route of the target (where the delivery was queued for), the
    /// rest (folder, timeouts) as registered now. While the destination is unchanged this is
    /// the row itself; after a change, observation and history scans still go where the write
    /// went, and a write can only go there (G1).
    #[must_use]
    pub fn at_target(&self, target: &model::Target) -> AgentRow {
        let mut row = self.clone();
        target.provider.as_str().clone_into(&mut row.provider);
        row.endpoint.clone_from(&target.endpoint);
        if let Some(obj) = row.settings.as_object_mut() {
            for key in model::ROUTE_SETTINGS {
                match target.route.get(*key) {
                    Some(text) => {
                        let value = serde_json::from_str(text).unwrap_or(Value::Null);
                        obj.insert((*key).to_owned(), value);
                    }
                    None => {
                        obj.remove(*key);
                    }
                }
            }
        }
        row
    }
}

pub(super) fn route_of(settings: &Value) -> std::collections::BTreeMap<String, String> {
    model::ROUTE_SETTINGS
        .iter()
        .filter_map(|k| Some(((*k).to_owned(), settings.get(*k)?.to_string())))
        .collect()
}

pub(super) fn agent_from(r: &super::sql::Row<'_, '_>) -> rusqlite::Result<AgentRow> {
    let settings: String = r.get(5)?;
    Ok(AgentRow {
        id: r.get(0)?,
        name: r.get(1)?,
        provider: r.get(2)?,
        endpoint: r.get(3)?,
        cwd: r.get(4)?,
        settings: serde_json::from_str(&settings).unwrap_or(Value::Null),
        created_at: r.get(6)?,
        updated_at: r.get(7)?,
        host: r.get(8)?,
    })
}

pub(super) const AGENT_COLS: &str =
    "id, name, provider, endpoint, cwd, settings, created_at, updated_at, host";

impl Tx<'_> {
    pub fn agent(&self, id: &str) -> Result<Option<AgentRow>> {
        self.remembered(
            |m| &mut m.agents,
            id.to_owned(),
            || {
                Ok(self
                    .tx
                    .prepare_cached(&format!("SELECT {AGENT_COLS} FROM agents WHERE id = ?1"))?
                    .query_row([id], agent_from)
                    .optional()?)
            },
        )
    }

    pub fn agents(&self) -> Result<Vec<AgentRow>> {
        let mut st = self
            .tx
            .prepare_cached(&format!("SELECT {AGENT_COLS} FROM agents ORDER BY id"))?;
        let rows = st.query_map([], agent_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    pub fn upsert_agent(&self, a: &AgentRow) -> Result<()> {
        self.exec(
            "INSERT INTO agents (id, name, provider, endpoint, cwd, settings, created_at, updated_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
             ON CONFLICT (id) DO UPDATE SET name = excluded.name, provider = excluded.provider,
               endpoint = excluded.endpoint, cwd = excluded.cwd, settings = excluded.settings,
               updated_at = excluded.updated_at",
            params![
                a.id,
                a.name,
                a.provider,
                a.endpoint,
                a.cwd,
                a.settings.to_string(),
                a.created_at,
                a.updated_at
            ],
        )?;
        Ok(())
    }

    pub fn remove_agent(&self, id: &str) -> Result<bool> {
        self.remove_agent_token(id)?;
        Ok(self.exec("DELETE FROM agents WHERE id = ?1", [id])? > 0)
    }

    /// The explicit connection row for from→to, if any.
    pub fn connection(&self, from: &str, to: &str) -> Result<Option<bool>> {
        self.remembered(
            |m| &mut m.connections,
            (from.to_owned(), to.to_owned()),
            || {
                Ok(self
                    .tx
                    .prepare_cached(
                        "SELECT allowed FROM connections WHERE from_agent = ?1 AND to_agent = ?2",
                    )?
                    .query_row([from, to], |r| r.get(0))
                    .optional()?)
            },
        )
    }

    pub fn set_connection(&self, from: &str, to: &str, allowed: bool) -> Result<()> {
        self.exec(
            "INSERT INTO connections (from_agent, to_agent, allowed) VALUES (?1, ?2, ?3)
             ON CONFLICT (from_agent, to_agent) DO UPDATE SET allowed = excluded.allowed",
            params![from, to, allowed],
        )?;
        Ok(())
    }

    pub fn connections(&self) -> Result<Vec<(String, String, bool)>> {
        let mut st = self.tx.prepare_cached(
            "SELECT from_agent, to_agent, allowed FROM connections ORDER BY from_agent, to_agent",
        )?;
        let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }
}
