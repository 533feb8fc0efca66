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

impl Service {
    /// The trace of the chain of message `given`, for `agent` (an MCP session's): only a
    /// chain it took part in (it sent or received one of its messages).
    pub fn trace_for(&mut self, agent: &str, given: &str, limit: i64) -> Result<Vec<TraceRow>> {
        super::check_agent_id(agent)?;
        // One answer for a message that does not exist and a chain the agent is not in: an
        // agent learns nothing of others' ids.
        let outside = || {
            ServiceError::Refused(format!(
                "{agent} took no part in the chain of {given}: an agent traces only its own chains"
            ))
        };
        let id = match self.resolve(IdTable::Messages, given) {
            Ok(id) => id,
            Err(ServiceError::NotFound(_)) => return Err(outside()),
            Err(e) => return Err(e),
        };
        let part = self.store.read(|tx| {
            let m = tx
                .message(&id)?
                .ok_or_else(|| ServiceError::NotFound(format!("no message {given:?}")))?;
            let chain = if m.chain_id.is_empty() {
                m.id
            } else {
                m.chain_id
            };
            Ok::<_, ServiceError>(
                tx.chain_messages(&chain)?
                    .iter()
                    .any(|c| c.sender == agent || c.recipient == agent),
            )
        })?;
        if !part {
            return Err(outside());
        }
        self.trace(Some(&id), None, limit)
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

/// The trace as OTLP/JSON (an `ExportTraceServiceRequest`, the official protobuf types and
/// their JSON encoding): one trace per chain (its id, 16 bytes), one span per message (the
/// first 8 bytes of its id) from its first event to its last, whose parent is the span of
/// the message whose turn sent it, and each event a span event. Events about no message
/// (configuration, registrations) are not spans.
pub fn otel(
    rows: &[TraceRow],
) -> opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::common::v1::InstrumentationScope;
    use opentelemetry_proto::tonic::resource::v1::Resource;
    use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span, span};
    let mut spans: Vec<Span> = Vec::new();
    let mut index: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for r in rows {
        let (Some(m), Some(chain)) = (r.message_id.as_deref(), r.chain_id.as_deref()) else {
            continue;
        };
        let ns = u64::try_from(r.at).unwrap_or(0).saturating_mul(1_000_000);
        let i = *index.entry(m).or_insert_with(|| {
            let mut attributes = vec![kv("handoffs.message_id", m)];
            for (k, v) in [
                ("handoffs.sender", &r.sender),
                ("handoffs.recipient", &r.recipient),
                ("handoffs.intent", &r.intent),
            ] {
                if let Some(v) = v {
                    attributes.push(kv(k, v));
                }
            }
            spans.push(Span {
                trace_id: id_bytes(chain, 16),
                span_id: id_bytes(m, 8),
                parent_span_id: r
                    .parent_id
                    .as_deref()
                    .map(|p| id_bytes(p, 8))
                    .unwrap_or_default(),
                name: r
                    .title
                    .clone()
                    .or_else(|| r.preview.as_deref().map(label))
                    .unwrap_or_else(|| "handoff".to_owned()),
                kind: span::SpanKind::Internal as i32,
                start_time_unix_nano: ns,
                end_time_unix_nano: ns,
                attributes,
                ..Span::default()
            });
            spans.len() - 1
        });
        let s = &mut spans[i];
        s.end_time_unix_nano = s.end_time_unix_nano.max(ns);
        s.events.push(span::Event {
            time_unix_nano: ns,
            name: r.kind.clone(),
            attributes: vec![kv("detail", &r.detail), kv("seq", &r.seq.to_string())],
            dropped_attributes_count: 0,
        });
    }
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource {
                attributes: vec![kv("service.name", "handoffs")],
                ..Resource::default()
            }),
            scope_spans: vec![ScopeSpans {
                scope: Some(InstrumentationScope {
                    name: "handoffs".to_owned(),
                    version: env!("CARGO_PKG_VERSION").to_owned(),
                    ..InstrumentationScope::default()
                }),
                spans,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
    }
}

fn kv(key: &str, value: &str) -> opentelemetry_proto::tonic::common::v1::KeyValue {
    use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(value.to_owned())),
        }),
        ..KeyValue::default()
    }
}

/// `n` bytes of an id: its leading hexadecimal digits (ids are 32 of them), or, for an id
/// that is not hex, the first bytes of its SHA-256.
fn id_bytes(id: &str, n: usize) -> Vec<u8> {
    if let Some(Ok(b)) = id.get(..2 * n).map(hex::decode) {
        b
    } else {
        use sha2::Digest as _;
        sha2::Sha256::digest(id.as_bytes())[..n].to_vec()
    }
}
