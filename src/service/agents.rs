//! Agents: registration (and what a re-registration leaves queued, G1), connections, doctor.

use super::{
    AgentRow, ID_CHARS_MAX, Result, Service, ServiceError, Value, check_agent_id, check_len, json,
    millis, parse_provider, target_of, usage,
};

/// What `add_agent` did: the agent as stored, and (G1) the open deliveries that stay with
/// the destination they were queued for because this registration changed it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AgentAdded {
    #[serde(flatten)]
    pub agent: AgentRow,
    pub updated: bool,
    /// What changed in the destination of those deliveries (`url`, `endpoint`, …).
    pub destination_changed: Vec<String>,
    /// Pending deliveries queued for the old destination: they become UNAVAILABLE.
    pub stranded_deliveries: usize,
    /// What the destination checks found wrong (the registration stands; SPEC §5 `doctor`);
    /// filled from [`Service::destination_problems`] by a front that prints them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

impl AgentAdded {
    /// One line for a person.
    pub fn sentence(&self) -> String {
        let a = &self.agent;
        let verb = if self.updated {
            "updated"
        } else {
            "registered"
        };
        let mut line = format!("{} ({}) {verb}", a.id, a.provider);
        if self.stranded_deliveries > 0 {
            let n = self.stranded_deliveries;
            line.push_str(&format!(
                "; its destination changed ({}): {n} open {} queued for the old destination {} UNAVAILABLE, never redirected (register it as it was, or `handoffs release` {})",
                self.destination_changed.join(", "),
                if n == 1 { "delivery" } else { "deliveries" },
                if n == 1 { "stays" } else { "stay" },
                if n == 1 { "it" } else { "them" },
            ));
        }
        line
    }
}

/// Whether `agent`'s adapter runs on the machine it was registered on: a command run as argv,
/// a Codex app-server, a Claude Code session (an HTTP agent and a demo one live elsewhere).
fn machine_bound(agent: &AgentRow) -> bool {
    match agent.provider.as_str() {
        "command" => agent.settings.get("command").is_some(),
        "demo" => false,
        _ => true,
    }
}

impl Service {
    pub fn add_agent(
        &mut self,
        id: &str,
        provider: Option<&str>,
        name: Option<&str>,
        endpoint: Option<&str>,
        cwd: Option<&str>,
        settings: &[(String, Value)],
    ) -> Result<AgentAdded> {
        check_agent_id(id)?;
        if id == super::SYSTEM_SENDER {
            return usage(format!(
                "{id:?} is the sender of what handoffs itself tells agents: pick another id"
            ));
        }
        let provider = provider.map(parse_provider).transpose()?;
        if let Some(n) = name {
            check_len("name", n, ID_CHARS_MAX)?;
        }
        for v in [endpoint, cwd].into_iter().flatten() {
            check_len("endpoint/cwd", v, 4_096)?;
        }
        let now = millis(self.now());
        let shared = self.store.is_postgres();
        self.store.write(|tx| {
            let existing = tx.agent(id)?;
            let provider = match (provider, &existing) {
                (Some(p), _) => p,
                (None, Some(a)) => parse_provider(&a.provider)?,
                (None, None) => {
                    return usage(format!(
                        "agent {id} is new: say which adapter delivers to it with --provider demo|command|codex|claude-code"
                    ));
                }
            };
            let mut merged = existing
                .as_ref()
                .map(|a| a.settings.clone())
                .filter(Value::is_object)
                .unwrap_or_else(|| json!({}));
            for (k, v) in settings {
                if let Some(obj) = merged.as_object_mut() {
                    if v.is_null() {
                        obj.remove(k);
                    } else {
                        obj.insert(k.clone(), v.clone());
                    }
                }
            }
            crate::adapter::check_settings(provider, &merged).map_err(ServiceError::Usage)?;
            if let Some(e) = endpoint {
                crate::adapter::check_endpoint(provider, e).map_err(ServiceError::Usage)?;
            }
            let row = AgentRow {
                id: id.to_owned(),
                name: name
                    .map(str::to_owned)
                    .or_else(|| existing.as_ref().map(|a| a.name.clone()))
                    .unwrap_or_else(|| id.to_owned()),
                provider: provider.as_str().to_owned(),
                endpoint: endpoint
                    .map(str::to_owned)
                    .or_else(|| existing.as_ref().map(|a| a.endpoint.clone()))
                    .unwrap_or_default(),
                cwd: cwd
                    .map(str::to_owned)
                    .or_else(|| existing.as_ref().map(|a| a.cwd.clone()))
                    .unwrap_or_default(),
                settings: merged,
                created_at: existing.as_ref().map_or(now, |a| a.created_at),
                updated_at: now,
                host: None,
            };
            tx.upsert_agent(&row)?;
            // G1: queued deliveries keep the destination they were queued for.
            let mut changed = Vec::new();
            let mut stranded = 0;
            let old = existing.as_ref().and_then(target_of);
            let moved = match (&old, target_of(&row)) {
                (Some(old), Some(new)) if !old.same_destination(&new) => Some(new),
                _ => None,
            };
            // On a database several machines share, an adapter that runs on its machine (a
            // command, Codex, Claude Code) is served only by an engine on the machine it was
            // registered on; it stays bound there until its destination changes (an update
            // from another machine, a changed setting, does not move it).
            let mut row = row;
            row.host = if shared && machine_bound(&row) {
                match &existing {
                    Some(a) if moved.is_none() && a.host.is_some() => a.host.clone(),
                    _ => Some(super::leases::this_host()),
                }
            } else {
                None
            };
            tx.set_agent_host(id, row.host.as_deref())?;
            if let Some(new) = moved {
                for d in tx.pending_for(id)? {
                    let c = d.record.core().target().changes(&new);
                    if !c.is_empty() {
                        stranded += 1;
                        for k in c {
                            if !changed.contains(&k) {
                                changed.push(k);
                            }
                        }
                    }
                }
            }
            let added = AgentAdded {
                agent: row,
                updated: existing.is_some(),
                destination_changed: changed,
                stranded_deliveries: stranded,
                warnings: Vec::new(),
            };
            tx.event(now, None, "agent", &format!("agent {}", added.sentence()))?;
            // A registration change is a fact the next pass must see at once (a destination
            // restored, or changed away).
            tx.wake_recipient(id, now)?;
            Ok(added)
        })
    }

    /// What the destination checks find wrong with `agent` now (they run `--version` and
    /// open a connection: call this outside a transaction). A registration stands either way.
    pub fn destination_problems(agent: &AgentRow) -> Vec<String> {
        crate::adapter::doctor::check(agent)
            .into_iter()
            .filter(|f| !f.ok)
            .map(|f| f.text)
            .collect()
    }

    /// Every agent's destination checks, then the database's (SPEC §5 `doctor`).
    pub fn doctor(&mut self) -> Result<Vec<crate::adapter::doctor::Finding>> {
        use crate::adapter::doctor::Finding;
        let agents = self.agents()?;
        let mut out: Vec<Finding> = agents
            .iter()
            .flat_map(crate::adapter::doctor::check)
            .collect();
        let path = self.store.path().to_owned();
        let db = |ok: bool, text: String| Finding {
            agent: String::new(),
            ok,
            text,
        };
        let check: String = self
            .store
            .read(|tx: &crate::store::Tx<'_>| tx.quick_check())
            .unwrap_or_else(|e: crate::store::StoreError| e.to_string());
        let shown = crate::store::shown(&path);
        out.push(if check == "ok" {
            db(true, format!("database {shown}: integrity ok"))
        } else {
            db(false, format!("database {shown}: {check}"))
        });
        // Remote MCP tokens: one that has expired locks its agent out of /mcp.
        for agent in &agents {
            let t = self.agent_token_info(&agent.id)?;
            if let (true, Some(at)) = (t.token, t.expires_at) {
                let when = crate::text::when(at);
                out.push(Finding {
                    agent: agent.id.clone(),
                    ok: !t.expired,
                    text: if t.expired {
                        format!(
                            "its remote MCP token expired {when}; `handoffs agent token {}` issues a new one",
                            agent.id
                        )
                    } else {
                        format!("its remote MCP token holds until {when}")
                    },
                });
            }
        }
        let token = crate::store::token_path(&path);
        // A PostgreSQL database has no file here: only this machine's token file.
        let file = (!self.store.is_postgres()).then(|| path.clone());
        for file in file.into_iter().chain([token]) {
            match crate::store::mode_of(&file) {
                Some(mode) if mode.trailing_zeros() >= 6 => {
                    out.push(db(
                        true,
                        format!("{} is private ({mode:o})", file.display()),
                    ));
                }
                Some(mode) => out.push(db(
                    false,
                    format!(
                        "{} is readable by others ({mode:o}); chmod 600 it",
                        file.display()
                    ),
                )),
                None => out.push(db(false, format!("{} is missing", file.display()))),
            }
        }
        Ok(out)
    }

    pub fn agents(&mut self) -> Result<Vec<AgentRow>> {
        self.store.read(|tx| Ok(tx.agents()?))
    }

    pub fn remove_agent(&mut self, id: &str) -> Result<()> {
        check_agent_id(id)?;
        let now = millis(self.now());
        self.store.write(|tx| {
            if !tx.remove_agent(id)? {
                return Err(ServiceError::NotFound(format!("unknown agent {id:?}")));
            }
            // Its subscriptions go with it: an agent added later under the same id starts
            // afresh, never from a cursor of posts it was not told of.
            tx.unsubscribe_everywhere(id)?;
            tx.event(now, None, "agent", &format!("agent {id} removed"))?;
            Ok(())
        })
    }

    pub fn set_connection(&mut self, from: &str, to: &str, allowed: bool) -> Result<()> {
        check_agent_id(from)?;
        check_agent_id(to)?;
        if from == to {
            return usage("an agent never sends to itself");
        }
        let now = millis(self.now());
        self.store.write(|tx| {
            tx.set_connection(from, to, allowed)?;
            let verb = if allowed { "allowed" } else { "blocked" };
            tx.event(now, None, "connection", &format!("{from} → {to} {verb}"))?;
            // Held deliveries on this pair are looked at again at once.
            tx.wake_recipient(to, now)?;
            Ok(())
        })
    }
}

impl Service {
    /// Agent `id` as registered now (exact id), if it is.
    pub fn agent(&mut self, id: &str) -> Result<Option<AgentRow>> {
        Ok(self.store.read(|tx| tx.agent(id))?)
    }
}
