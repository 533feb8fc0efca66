//! The global trace (SPEC §8.2): every send, delivery state change, write, return, close,
//! publish and budget spend in one order (the event sequence), as JSON lines or a Mermaid
//! sequence diagram, for the whole history or one chain.

use super::{IdTable, Result, Service, ServiceError, usage};
use crate::store::TraceRow;

/// The most events one trace prints.
pub const TRACE_LIMIT_MAX: i64 = 100_000;

impl Service {
    /// The events of chain `chain` (its id, or the id or a unique prefix of any of its
    /// messages), or of everything, from `since` (ms since the epoch) on, in their order.
    pub fn trace(
        &mut self,
        chain: Option<&str>,
        since: Option<i64>,
        limit: i64,
    ) -> Result<Vec<TraceRow>> {
        if !(1..=TRACE_LIMIT_MAX).contains(&limit) {
            return usage(format!("--limit must be 1 to {TRACE_LIMIT_MAX}"));
        }
        let chain = match chain {
            None => None,
            Some(given) => {
                let id = self.resolve(IdTable::Messages, given)?;
                let m = self.store.read(|tx| {
                    tx.message(&id)?
                        .ok_or_else(|| ServiceError::NotFound(format!("no message {given:?}")))
                })?;
                Some(if m.chain_id.is_empty() {
                    m.id
                } else {
                    m.chain_id
                })
            }
        };
        self.store
            .read(|tx| Ok(tx.trace(chain.as_deref(), since.unwrap_or(0), 0, limit)?))
    }
}

/// One JSON object per line, in the trace's order.
pub fn jsonl(rows: &[TraceRow]) -> String {
    rows.iter()
        .map(|r| serde_json::to_string(r).unwrap_or_default() + "\n")
        .collect()
}

/// Text a Mermaid message or note can carry: one line, none of the characters that end a
/// statement or start an entity, at most 80 characters.
fn label(s: &str) -> String {
    let one: String = s
        .chars()
        .map(|c| match c {
            '\n' | '\r' | '\t' => ' ',
            ';' => ',',
            '#' => '№',
            '<' => '‹',
            '>' => '›',
            c => c,
        })
        .collect();
    let one = one.trim();
    if one.chars().count() > 80 {
        format!("{}…", one.chars().take(79).collect::<String>())
    } else {
        one.to_owned()
    }
}

/// A Mermaid sequence diagram: each agent a participant (in the order they appear), each
/// handoff an arrow from its sender to its recipient (a notification a dashed one), each
/// state change and other event a note over the recipient.
pub fn mermaid(rows: &[TraceRow]) -> String {
    let mut agents: Vec<&str> = Vec::new();
    for r in rows {
        for a in [r.sender.as_deref(), r.recipient.as_deref()]
            .into_iter()
            .flatten()
        {
            if !agents.contains(&a) {
                agents.push(a);
            }
        }
    }
    let alias = |a: &str| {
        agents
            .iter()
            .position(|x| *x == a)
            .map_or_else(String::new, |i| format!("a{i}"))
    };
    let mut out = String::from("sequenceDiagram\n");
    for (i, a) in agents.iter().enumerate() {
        out.push_str(&format!("    participant a{i} as {}\n", label(a)));
    }
    for r in rows {
        let (Some(from), Some(to)) = (r.sender.as_deref(), r.recipient.as_deref()) else {
            continue;
        };
        let what = label(r.title.as_deref().or(r.preview.as_deref()).unwrap_or(""));
        match r.kind.as_str() {
            "sent" => {
                let arrow = if r.intent.as_deref() == Some("notification") {
                    "--)"
                } else {
                    "->>"
                };
                out.push_str(&format!(
                    "    {}{arrow}{}: {what} ({})\n",
                    alias(from),
                    alias(to),
                    short(r.message_id.as_deref())
                ));
            }
            _ => out.push_str(&format!(
                "    Note over {}: {} {}: {}\n",
                alias(to),
                short(r.message_id.as_deref()),
                label(&r.kind),
                label(&r.detail)
            )),
        }
    }
    out
}

fn short(id: Option<&str>) -> String {
    id.map_or_else(String::new, |i| i.chars().take(8).collect())
}
