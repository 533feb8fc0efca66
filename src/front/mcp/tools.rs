//! The tools, one table entry each: name, title, annotations, the argument type (whose schema
//! `tools/list` shows as `inputSchema`), the shape of the structured result (`outputSchema`),
//! and the handler. Adding a tool is adding one entry and its handler; nothing else names it.

use super::{McpServer, ToolError, ToolResult, message_of, summary_of};
use crate::service::Outcome;
use rmcp::handler::server::common::{schema_for_empty_input, schema_for_input};
use rmcp::model::{JsonObject, Tool, ToolAnnotations};
use schemars::JsonSchema;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use std::sync::{Arc, OnceLock};

// ----- tool arguments (their schemas are what tools/list shows) -----

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct SendArgs {
    /// The recipient agent's id.
    to: String,
    /// The message (at most 200,000 characters).
    message: String,
    /// A title makes the handoff work, with a contract: accept, return, close.
    title: Option<String>,
    /// Minutes until the work is due (1–43,200; only with a title).
    due_minutes: Option<i64>,
    /// Idempotency key: repeating a send with the same key returns the first message.
    key: Option<String>,
    /// Continue the chain of this message (one you sent or received; id or a unique prefix
    /// of at least 6 characters). Without it, a send during your turn continues that turn's
    /// chain, and any other starts one.
    parent: Option<String>,
    /// A new chain's budget, only for a send that starts one: hops and any units of your
    /// own, e.g. "hops=20,tokens=200000,usd=5".
    budget: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct FanOutArgs {
    /// The agents to split the work to (1 to 64, each once): each gets its own child work.
    to: Vec<String>,
    /// The message each child carries (at most 200,000 characters).
    message: String,
    /// The work's title.
    title: String,
    /// "all" (the default): joined when every child has returned; "quorum:K": when the
    /// first K have.
    join: Option<String>,
    /// Joined at the latest this many minutes after the send (0.1 to 43,200), flagged
    /// partial when returns are missing.
    deadline_minutes: Option<f64>,
    /// Cancel the children still unanswered when the fan-out is joined.
    cancel_rest: Option<bool>,
    /// Minutes until each child's work is due (1–43,200).
    due_minutes: Option<i64>,
    /// Idempotency key: repeating a fan-out with the same key returns the first one.
    key: Option<String>,
    /// Continue the chain of this message (as send_handoff's parent).
    parent: Option<String>,
    /// A new chain's budget, only for a fan-out that starts one (as send_handoff's).
    budget: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct SpendArgs {
    /// What your turn spent, by unit, e.g. {"tokens": 1200, "usd": 0.04} (at most six
    /// decimals).
    units: std::collections::BTreeMap<String, f64>,
    /// The chain of this message (one you sent or received) instead of the one your turn
    /// works in.
    parent: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct CancelChainArgs {
    /// The chain's id, or the id (or a unique prefix) of any of its messages. Only a chain
    /// you started can be cancelled.
    id: String,
    /// Why, for the agents told.
    note: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ArtifactArgs {
    /// The artifact's id, as the message's marker names it.
    id: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct PublishArgs {
    /// The topic's name.
    topic: String,
    /// The post (at most 200,000 characters).
    message: String,
    /// Idempotency key: publishing again with the same key returns the first post.
    key: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct SubscribeArgs {
    /// The topic's name.
    topic: String,
    /// Start at the oldest retained post instead of the newest (default false).
    history: Option<bool>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct TopicArgs {
    /// The topic's name.
    topic: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ReadTopicArgs {
    /// The topic's name.
    topic: String,
    /// Replay from this position instead of reading on from your cursor (the cursor only
    /// ever moves on).
    from: Option<i64>,
    /// At most this many posts (1–1,000, default 50).
    limit: Option<i64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct InboxArgs {
    /// Only unread messages (default true).
    unread_only: Option<bool>,
    /// At most this many (1–500, default 50).
    limit: Option<i64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct TraceArgs {
    /// Any message of the chain (one you sent or received, or of a chain you took part
    /// in): its id or a unique prefix of at least 6 characters.
    id: String,
    /// "mermaid" (the default: a sequence diagram), "jsonl" (one JSON object per event) or
    /// "otel" (OTLP/JSON spans).
    format: Option<String>,
    /// How many events at most (1 to 100,000; default 10,000).
    limit: Option<i64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ContextGetArgs {
    /// A record's id (or its file, relative to the library).
    id: Option<String>,
    /// A keyed entry of the shared corpus (instead of id): a copy with its version.
    key: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ContextPutArgs {
    /// The entry's key (1 to 200 characters on one line).
    key: String,
    /// What to write: a string (lww), a string or an array of strings to add (set), a
    /// number (max), or a string to append (log).
    value: Value,
    /// A new entry's merge rule: "lww" (the default: last writer wins), "set" (union),
    /// "max", or "log" (append-only); an existing entry keeps its own.
    rule: Option<String>,
    /// lww only: the version you read (context_get); a write on a stale version is refused
    /// as a conflict instead of overwriting.
    version: Option<u64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct IdArgs {
    /// A message id, or a unique prefix of at least 6 characters.
    id: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ReturnArgs {
    /// The work's message id.
    id: String,
    /// What was done (at most 4,000 characters).
    summary: String,
    /// Evidence: commits, test output, links.
    evidence: Option<String>,
    /// Return it as blocked instead of done.
    blocked: Option<bool>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct CloseArgs {
    /// The work's message id.
    id: String,
    /// accepted, revision or blocked.
    outcome: String,
    note: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct StatusArgs {
    /// A delivery (message) id; without it, the overview.
    id: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct WaitArgs {
    /// Seconds to wait for a new unread message (1–50, default 30).
    pub timeout_seconds: Option<u64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct CreateTaskArgs {
    title: String,
    /// What done looks like.
    goal: String,
    constraints: Option<String>,
    /// Queue the brief for this agent only (default: anyone).
    target_agent: Option<String>,
    /// How many times the task may be passed on (0–16, default 4).
    handoff_cap: Option<i64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ClaimArgs {
    task_id: String,
    /// Lease length in minutes (1–1440, default 90).
    lease_minutes: Option<i64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct RenewArgs {
    task_id: String,
    /// The token claim_handoff returned (default: the one this server holds).
    lease_token: Option<String>,
    lease_minutes: Option<i64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct PassArgs {
    task_id: String,
    lease_token: Option<String>,
    /// What was done so far.
    summary: String,
    /// What the next agent should do first.
    next_action: String,
    /// Files changed (merged into the task's set).
    changed_files: Option<Vec<String>>,
    /// The agent the brief is queued for.
    target_agent: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct CompleteArgs {
    task_id: String,
    lease_token: Option<String>,
    summary: Option<String>,
    changed_files: Option<Vec<String>>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct TaskIdArgs {
    task_id: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ListTasksArgs {
    /// queued, claimed, needs_human or done.
    state: Option<String>,
    limit: Option<i64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct BriefArgs {
    /// Longest brief in characters (200–20,000, default 2,048).
    max_chars: Option<usize>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct SearchArgs {
    query: String,
    limit: Option<usize>,
    include_superseded: Option<bool>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct RecordArgs {
    title: String,
    /// Markdown.
    body: String,
    tags: Option<Vec<String>>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct SupersedeArgs {
    /// The record to replace.
    id: String,
    body: String,
    title: Option<String>,
    tags: Option<Vec<String>>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct NoArgs {}

/// How a tool behaves, for its annotations.
#[derive(Clone, Copy)]
enum Kind {
    /// Reads only.
    Read,
    /// Writes; repeating it changes nothing more.
    Idempotent,
    /// Writes something new each time.
    Write,
}

type Handler = Box<dyn Fn(&McpServer, &JsonObject) -> ToolResult + Send + Sync>;

/// How a tool runs.
pub(super) enum Run {
    /// On the blocking pool, in one go.
    Now(Handler),
    /// `wait_for_messages`: waits on the session's runtime, cancellable.
    Wait,
}

/// One tool.
pub(super) struct ToolDef {
    pub name: &'static str,
    /// Offered only with a context library (`--context-library`).
    pub library: bool,
    pub run: Run,
    /// What `tools/list` shows.
    pub tool: Tool,
}

fn input_schema<T: JsonSchema + 'static>() -> Arc<JsonObject> {
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<NoArgs>() {
        return schema_for_empty_input();
    }
    schema_for_input::<T>().unwrap_or_else(|_| schema_for_empty_input())
}

/// The arguments of `tool`, typed; any other shape is one clear sentence.
pub(super) fn args<T: DeserializeOwned>(tool: &str, raw: &JsonObject) -> Result<T, ToolError> {
    serde_json::from_value(Value::Object(raw.clone()))
        .map_err(|e| ToolError(format!("invalid arguments for {tool}: {e}")))
}

/// A table entry: the tool `name` with arguments `A`, run by `handler` as this server's agent.
fn entry<A: DeserializeOwned + JsonSchema + 'static>(
    name: &'static str,
    title: &'static str,
    kind: Kind,
    about: &'static str,
    output: Value,
    handler: fn(&McpServer, &str, &A) -> ToolResult,
) -> ToolDef {
    let run = Run::Now(Box::new(move |server: &McpServer, raw: &JsonObject| {
        let a: A = args(name, raw)?;
        handler(server, server.agent(), &a)
    }));
    described::<A>(name, title, kind, about, output, run)
}

fn described<A: JsonSchema + 'static>(
    name: &'static str,
    title: &'static str,
    kind: Kind,
    about: &'static str,
    output: Value,
    run: Run,
) -> ToolDef {
    let annotations = ToolAnnotations::with_title(title)
        .read_only(matches!(kind, Kind::Read))
        .destructive(false)
        .idempotent(!matches!(kind, Kind::Write))
        .open_world(false);
    let output = match output {
        Value::Object(o) => Arc::new(o),
        _ => Arc::new(JsonObject::new()),
    };
    ToolDef {
        name,
        library: false,
        run,
        tool: Tool::new(name, about, input_schema::<A>())
            .with_title(title)
            .with_annotations(annotations)
            .with_raw_output_schema(output),
    }
}

// ----- the shapes of structured results (outputSchema) -----

/// An object with these properties, of which `required` must be present. Every result may
/// also carry `warnings` (the ledger's, for this call).
fn object(properties: &[(&str, Value)], required: &[&str]) -> Value {
    let mut props: serde_json::Map<String, Value> = properties
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.clone()))
        .collect();
    props.insert("warnings".to_owned(), array(string()));
    json!({ "type": "object", "properties": props, "required": required })
}

fn string() -> Value {
    json!({ "type": "string" })
}

fn maybe(ty: &str) -> Value {
    json!({ "type": [ty, "null"] })
}

fn of_type(ty: &str) -> Value {
    json!({ "type": ty })
}

fn array(items: Value) -> Value {
    let mut a = json!({ "type": "array" });
    a["items"] = items;
    a
}

/// A message as `inbox` lists it.
fn message_summary() -> Value {
    object(
        &[
            ("id", string()),
            ("from", string()),
            ("kind", string()),
            ("title", maybe("string")),
            ("preview", string()),
            ("created_at", of_type("integer")),
            ("read", of_type("boolean")),
        ],
        &["id", "from", "kind", "preview", "created_at", "read"],
    )
}

/// Every tool, in the order `tools/list` shows them.
pub(super) fn table() -> &'static [ToolDef] {
    static TABLE: OnceLock<Vec<ToolDef>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut all = message_tools();
        all.extend(chain_tools());
        all.extend(topic_tools());
        all.extend(task_tools());
        all.extend(context_tools());
        all
    })
}

/// Broadcast topics (SPEC §8.2): you publish, subscribe and read as yourself; and the whole
/// text of a summary a card carries in part.
fn topic_tools() -> Vec<ToolDef> {
    use Kind::{Idempotent, Read, Write};
    vec![
        entry::<ArtifactArgs>(
            "get_artifact",
            "Get an artifact",
            Read,
            "The whole text of a summary a message carries only in part (its marker names the \
             id); only the message's sender and recipient may fetch it.",
            object(
                &[
                    ("id", string()),
                    ("kind", string()),
                    ("sender", string()),
                    ("recipient", string()),
                    ("body", string()),
                    ("created_at", of_type("integer")),
                ],
                &["id", "kind", "body"],
            ),
            |s, me, a| {
                let art = s.service().artifact_get(&a.id, Some(me))?;
                Ok(serde_json::to_value(art).unwrap_or_default())
            },
        ),
        entry::<NoArgs>(
            "list_topics",
            "List topics",
            Read,
            "The topics, with their subscribers and how many posts each keeps.",
            object(&[("topics", array(of_type("object")))], &["topics"]),
            |s, _, _| Ok(json!({ "topics": s.service().topic_list()? })),
        ),
        entry::<SubscribeArgs>(
            "subscribe",
            "Subscribe to a topic",
            Idempotent,
            "Subscribe to a topic: each later post reaches your inbox once, as a notification \
             (never a turn). Read on with read_topic; history=true starts at the oldest post kept.",
            object(
                &[
                    ("topic", string()),
                    ("agent", string()),
                    ("cursor", of_type("integer")),
                    ("new", of_type("boolean")),
                ],
                &["topic", "agent", "cursor", "new"],
            ),
            |s, me, a| {
                let r = s
                    .service()
                    .topic_subscribe(&a.topic, me, a.history.unwrap_or(false))?;
                Ok(serde_json::to_value(r).unwrap_or_default())
            },
        ),
        entry::<TopicArgs>(
            "unsubscribe",
            "Unsubscribe from a topic",
            Idempotent,
            "Stop being told of a topic's posts.",
            object(
                &[
                    ("topic", string()),
                    ("agent", string()),
                    ("removed", of_type("boolean")),
                ],
                &["topic", "agent", "removed"],
            ),
            |s, me, a| {
                let r = s.service().topic_unsubscribe(&a.topic, me)?;
                Ok(serde_json::to_value(r).unwrap_or_default())
            },
        ),
        entry::<PublishArgs>(
            "publish",
            "Publish on a topic",
            Write,
            "Publish a post on a topic, as yourself: every current subscriber gets it in their \
             inbox exactly once, as a notification (it wakes nobody and transfers no work).",
            object(
                &[
                    ("topic", string()),
                    ("position", of_type("integer")),
                    ("publisher", string()),
                    ("notified", array(string())),
                    ("messages", array(string())),
                    ("repeated", of_type("boolean")),
                ],
                &["topic", "position", "publisher", "notified", "repeated"],
            ),
            |s, me, a| {
                let p = s
                    .service()
                    .topic_publish(&a.topic, me, &a.message, a.key.as_deref())?;
                Ok(serde_json::to_value(p).unwrap_or_default())
            },
        ),
        entry::<ReadTopicArgs>(
            "read_topic",
            "Read a topic",
            Write,
            "The posts after your cursor (which moves on to the last one returned), or a replay \
             `from` a position. `skipped` counts positions no longer kept; `more` says more follow.",
            object(
                &[
                    ("topic", string()),
                    ("agent", string()),
                    ("posts", array(of_type("object"))),
                    ("cursor", of_type("integer")),
                    ("skipped", of_type("integer")),
                    ("more", of_type("boolean")),
                ],
                &["topic", "posts", "cursor", "skipped", "more"],
            ),
            |s, me, a| {
                let r = s
                    .service()
                    .topic_read(&a.topic, me, a.from, a.limit.unwrap_or(50))?;
                Ok(serde_json::to_value(r).unwrap_or_default())
            },
        ),
    ]
}

/// Handoffs, work contracts and delivery status.
/// Chains (SPEC §8.2).
fn chain_tools() -> Vec<ToolDef> {
    use Kind::Write;
    vec![
        entry::<SpendArgs>(
            "spend_budget",
            "Spend from your chain's budget",
            Write,
            "Record what your turn spent (tokens, dollars, any unit the chain's budget names) \
             against the budget of the chain you work in, all or nothing. A spend past a \
             limit is refused and stops the chain until a person resumes it; its origin is \
             told.",
            object(
                &[
                    ("chain_id", string()),
                    ("message_id", string()),
                    ("state", string()),
                    ("units", of_type("object")),
                    ("hops", of_type("integer")),
                    ("hop_budget", of_type("integer")),
                ],
                &["chain_id", "message_id", "state", "units"],
            ),
            spend_budget,
        ),
        entry::<CancelChainArgs>(
            "cancel_chain",
            "Cancel a chain",
            Write,
            "Cancel a chain you started and everything pending in it: nothing more of it is \
             written, its open work is closed as cancelled, turns under way run on (their \
             returns are recorded as late), and each affected agent is told once.",
            object(
                &[
                    ("chain_id", string()),
                    ("cancelled", array(string())),
                    ("marked", array(string())),
                    ("closed_work", array(string())),
                    ("notified", array(string())),
                ],
                &["chain_id", "cancelled", "marked", "closed_work", "notified"],
            ),
            cancel_chain,
        ),
    ]
}

fn message_tools() -> Vec<ToolDef> {
    use Kind::{Idempotent, Read, Write};
    let work = || object(&[("work", of_type("object"))], &["work"]);
    vec![
        entry::<SendArgs>(
            "send_handoff",
            "Send a handoff",
            Write,
            "Send a handoff to another agent; it becomes exactly one new turn in their session. \
             With a title it is work (accept, return, close). You always send as yourself.",
            object(
                &[
                    ("id", string()),
                    ("to", string()),
                    ("kind", string()),
                    ("created", of_type("boolean")),
                    ("delivery_state", maybe("string")),
                    ("chain_id", string()),
                    ("hop", of_type("integer")),
                    ("warning", string()),
                ],
                &[
                    "id",
                    "to",
                    "kind",
                    "created",
                    "delivery_state",
                    "chain_id",
                    "hop",
                ],
            ),
            send_handoff,
        ),
        fan_out_entry(),
        fanout_status_entry(),
        trace_entry(),
        entry::<InboxArgs>(
            "inbox",
            "Inbox",
            Read,
            "Your messages, newest first (unread only unless unread_only is false).",
            object(&[("messages", array(message_summary()))], &["messages"]),
            inbox,
        ),
        entry::<IdArgs>(
            "read_message",
            "Read a message",
            Idempotent,
            "A message in full; marks it read when it is yours.",
            object(
                &[
                    ("id", string()),
                    ("from", string()),
                    ("to", string()),
                    ("kind", string()),
                    ("title", maybe("string")),
                    ("body", string()),
                    ("work_id", maybe("string")),
                    ("created_at", of_type("integer")),
                    ("read_at", maybe("integer")),
                ],
                &["id", "from", "to", "kind", "body", "created_at"],
            ),
            read_message,
        ),
        entry::<IdArgs>(
            "accept_work",
            "Accept work",
            Idempotent,
            "Accept work given to you.",
            work(),
            accept_work,
        ),
        return_entry(),
        entry::<CloseArgs>(
            "close_work",
            "Close work",
            Idempotent,
            "Close work you gave: accepted, revision or blocked.",
            work(),
            close_work,
        ),
        entry::<StatusArgs>(
            "handoff_status",
            "Delivery status",
            Read,
            "One delivery with its history, or the overview: in flight, needs attention, recent.",
            {
                let mut o = object(
                    &[
                        ("delivery", of_type("object")),
                        ("overview", of_type("object")),
                        ("waiting_for_engine", array(of_type("object"))),
                    ],
                    &[],
                );
                o["anyOf"] = json!([{ "required": ["delivery"] }, { "required": ["overview"] }]);
                o
            },
            |s, _, a| {
                if let Some(id) = &a.id {
                    return Ok(json!({ "delivery": s.service().delivery(id)? }));
                }
                let mut service = s.service();
                Ok(json!({
                    "overview": service.overview(20)?,
                    "waiting_for_engine": service.waiting_for_engine(20)?,
                }))
            },
        ),
        entry::<NoArgs>(
            "list_agents",
            "List agents",
            Read,
            "The registered agents you can hand off to.",
            object(
                &[("you", string()), ("agents", array(of_type("object")))],
                &["you", "agents"],
            ),
            list_agents,
        ),
        described::<WaitArgs>(
            "wait_for_messages",
            "Wait for messages",
            Read,
            "Wait (at most 50 s) until you have an unread message, or the chain of the turn you \
             are working on is cancelled or stopped by its budget; returns at once if so already. \
             `woke` says which: message, chain_cancelled, budget_spent (its chain's budget ran out), chain_stopped (its depth limit) or timeout.",
            object(
                &[
                    ("timed_out", of_type("boolean")),
                    ("woke", string()),
                    ("messages", array(message_summary())),
                    ("chain", of_type("object")),
                ],
                &["timed_out", "woke", "messages"],
            ),
            Run::Wait,
        ),
    ]
}

/// The workspace's task ledger.
fn task_tools() -> Vec<ToolDef> {
    use Kind::{Idempotent, Read, Write};
    let task = || object(&[("task", of_type("object"))], &["task"]);
    vec![
        entry::<CreateTaskArgs>(
            "create_handoff",
            "Create a task brief",
            Write,
            "Create a task brief in this workspace's ledger, with a finite handoff budget.",
            task(),
            create_handoff,
        ),
        entry::<ClaimArgs>(
            "claim_handoff",
            "Claim a task",
            Write,
            "Take the workspace's one writer lease for a task (default 90 minutes). Returns the lease token.",
            object(
                &[("task", of_type("object")), ("lease", of_type("object"))],
                &["task", "lease"],
            ),
            claim_handoff,
        ),
        entry::<RenewArgs>(
            "renew_handoff",
            "Renew a lease",
            Idempotent,
            "Extend your lease on a task.",
            object(&[("lease", of_type("object"))], &["lease"]),
            renew_handoff,
        ),
        entry::<PassArgs>(
            "pass_handoff",
            "Pass a task on",
            Write,
            "Record your summary, next action and changed files, release the lease and queue the task for another agent; spends one handoff.",
            object(
                &[
                    ("task", of_type("object")),
                    ("handoffs_left", of_type("integer")),
                    ("notice", json!({ "type": ["object", "string"] })),
                ],
                &["task", "handoffs_left", "notice"],
            ),
            pass_handoff,
        ),
        entry::<CompleteArgs>(
            "complete_handoff",
            "Complete a task",
            Idempotent,
            "Mark your task done and release the lease.",
            task(),
            complete_handoff,
        ),
        entry::<TaskIdArgs>(
            "show_handoff",
            "Show a task",
            Read,
            "A task brief with its history.",
            object(
                &[
                    ("task", of_type("object")),
                    ("events", array(of_type("object"))),
                    ("lease", maybe("object")),
                ],
                &["task", "events", "lease"],
            ),
            |s, _, a| {
                let d = s.with_ledger(|l| l.show(&a.task_id))?;
                Ok(serde_json::to_value(&d).unwrap_or_default())
            },
        ),
        entry::<ListTasksArgs>(
            "list_handoffs",
            "List tasks",
            Read,
            "Task briefs in this workspace, newest first.",
            object(&[("tasks", array(of_type("object")))], &["tasks"]),
            |s, _, a| {
                let t = s.with_ledger(|l| l.list(a.state.as_deref(), a.limit.unwrap_or(50)))?;
                Ok(json!({ "tasks": t }))
            },
        ),
    ]
}

/// The project memory (only with `--context-library`).
fn context_tools() -> Vec<ToolDef> {
    let mut tools = context_entries();
    for t in &mut tools {
        t.library = true;
    }
    tools
}

fn context_entries() -> Vec<ToolDef> {
    use Kind::{Read, Write};
    let record = || object(&[("record", of_type("object"))], &["record"]);
    vec![
        entry::<BriefArgs>(
            "context_brief",
            "Project memory brief",
            Read,
            "A bounded brief of the project's current memory records.",
            object(
                &[
                    ("text", string()),
                    ("included", of_type("integer")),
                    ("omitted", of_type("integer")),
                    ("truncated", of_type("boolean")),
                ],
                &["text", "included", "omitted", "truncated"],
            ),
            |s, _, a| {
                let b = s
                    .library()?
                    .brief(a.max_chars.unwrap_or(crate::context::BRIEF_DEFAULT))?;
                Ok(serde_json::to_value(&b).unwrap_or_default())
            },
        ),
        entry::<SearchArgs>(
            "context_search",
            "Search project memory",
            Read,
            "Records matching every word of the query, best first.",
            object(&[("hits", array(of_type("object")))], &["hits"]),
            |s, _, a| {
                let hits = s.library()?.search(
                    &a.query,
                    a.limit.unwrap_or(10),
                    a.include_superseded.unwrap_or(false),
                )?;
                Ok(json!({ "hits": hits }))
            },
        ),
        entry::<ContextGetArgs>(
            "context_get",
            "Get a memory record or corpus entry",
            Read,
            "One record in full (id), or a copy of a keyed corpus entry with its version (key).",
            object(
                &[("record", of_type("object")), ("entry", of_type("object"))],
                &[],
            ),
            |s, _, a| match (&a.id, &a.key) {
                (Some(id), None) => Ok(json!({ "record": s.library()?.get(id)? })),
                (None, Some(key)) => Ok(json!({ "entry": s.library()?.corpus_get(key)? })),
                _ => Err(ToolError(
                    "give either id (a record) or key (a corpus entry)".to_owned(),
                )),
            },
        ),
        entry::<ContextPutArgs>(
            "context_put",
            "Write a corpus entry",
            Write,
            "Write a keyed entry of the shared corpus, merged by its rule (lww, set, max, log); \
             concurrent writers never lose an update, and a lww write on a stale version is \
             refused as a conflict.",
            object(
                &[
                    ("entry", of_type("object")),
                    ("changed", of_type("boolean")),
                ],
                &["entry", "changed"],
            ),
            |s, me, a| {
                let rule = a
                    .rule
                    .as_deref()
                    .map(str::parse::<crate::context::Rule>)
                    .transpose()?;
                let put = s
                    .library()?
                    .corpus_put(me, &a.key, &a.value, rule, a.version)?;
                Ok(serde_json::to_value(&put).unwrap_or_default())
            },
        ),
        entry::<NoArgs>(
            "context_keys",
            "List corpus entries",
            Read,
            "Every keyed entry of the shared corpus: key, rule, version, last writer.",
            object(&[("entries", array(of_type("object")))], &["entries"]),
            |s, _, _| Ok(json!({ "entries": s.library()?.corpus_list()? })),
        ),
        entry::<RecordArgs>(
            "context_record",
            "Record project memory",
            Write,
            "Add a Markdown record, authored by you.",
            record(),
            |s, me, a| {
                let r = s.library()?.record(
                    me,
                    &a.title,
                    &a.body,
                    a.tags.as_deref().unwrap_or(&[]),
                    None,
                )?;
                Ok(json!({ "record": r }))
            },
        ),
        entry::<SupersedeArgs>(
            "context_supersede",
            "Supersede a memory record",
            Write,
            "Replace a record with a new one; the old one stays, marked superseded.",
            record(),
            |s, me, a| {
                let r = s.library()?.supersede(
                    me,
                    &a.id,
                    a.title.as_deref(),
                    &a.body,
                    a.tags.as_deref(),
                )?;
                Ok(json!({ "record": r }))
            },
        ),
        entry::<NoArgs>(
            "context_status",
            "Project memory status",
            Read,
            "How many records, by whom, how recent.",
            object(
                &[
                    ("dir", string()),
                    ("records", of_type("integer")),
                    ("current", of_type("integer")),
                    ("superseded", of_type("integer")),
                    ("authors", array(string())),
                    ("newest", maybe("string")),
                    ("bytes", of_type("integer")),
                ],
                &["records", "current", "superseded"],
            ),
            |s, _, _| Ok(serde_json::to_value(s.library()?.status()?).unwrap_or_default()),
        ),
    ]
}

// ----- handlers -----

fn send_handoff(s: &McpServer, me: &str, a: &SendArgs) -> ToolResult {
    // The MCP session is the agent's own: its rules (service::Session) name the chain.
    let lineage = s.session().lineage(a.parent.clone(), a.budget.clone());
    let sent = s.service().send_as(
        me,
        &a.to,
        &a.message,
        a.title.as_deref(),
        a.due_minutes,
        a.key.as_deref(),
        &lineage,
    )?;
    let mut v = json!({
        "id": sent.message.id,
        "to": sent.message.recipient,
        "kind": sent.message.kind,
        "created": sent.created,
        "delivery_state": sent.delivery_state,
        "chain_id": sent.message.chain_id,
        "hop": sent.message.hop,
    });
    if let Some(w) = s.engine_warning() {
        v["warning"] = json!(w);
    }
    Ok(v)
}

/// `return_work`: for a fan-out's child, the combined return it joined, or none.
fn return_entry() -> ToolDef {
    use Kind::Idempotent;
    entry::<ReturnArgs>(
        "return_work",
        "Return work",
        Idempotent,
        "Return work to its sender with a summary (or as blocked).",
        object(
            &[
                ("work", of_type("object")),
                ("return_message_id", maybe("string")),
                ("fanout", maybe("object")),
            ],
            &["work", "return_message_id"],
        ),
        return_work,
    )
}

/// `fanout_status`: a fan-out the agent sent or is a child of, and how far it got.
fn fanout_status_entry() -> ToolDef {
    entry::<IdArgs>(
        "fanout_status",
        "Fan-out status",
        Kind::Read,
        "A fan-out you sent or are part of (its id, or any child's id): its join rule, \
         deadline and state, each child's work state, who answered and who answered late.",
        object(
            &[
                ("fanout", of_type("object")),
                ("children", array(of_type("object"))),
                ("answered", of_type("integer")),
            ],
            &["fanout", "children", "answered"],
        ),
        |s, me, a| {
            let v = s.service().fanout_show_for(me, &a.id)?;
            Ok(serde_json::to_value(&v).unwrap_or_default())
        },
    )
}

/// `trace_chain`: the trace of a chain the agent took part in.
fn trace_entry() -> ToolDef {
    entry::<TraceArgs>(
        "trace_chain",
        "Trace a chain",
        Kind::Read,
        "Every send, state change, write, return, close and spend of a chain you took part \
         in, in one order: a Mermaid sequence diagram, JSON lines, or OTLP/JSON spans.",
        object(
            &[
                ("chain_id", maybe("string")),
                ("events", of_type("integer")),
                ("format", string()),
                ("text", string()),
            ],
            &["chain_id", "events", "format", "text"],
        ),
        trace_chain,
    )
}

/// `fan_out`: one piece of work to several agents, joined into one return.
fn fan_out_entry() -> ToolDef {
    use Kind::Write;
    entry::<FanOutArgs>(
        "fan_out",
        "Fan work out",
        Write,
        "Split one piece of work to several agents at once (each gets its own work item, a \
         turn). You get ONE combined return when all of them (join \"all\") or the first K \
         (\"quorum:K\") have returned, or at the deadline, flagged partial; later returns \
         are recorded as late and told to you.",
        object(
            &[
                ("fanout_id", string()),
                ("join", string()),
                ("deadline_at", maybe("integer")),
                ("created", of_type("boolean")),
                (
                    "children",
                    array(object(
                        &[
                            ("id", string()),
                            ("to", string()),
                            ("delivery_state", maybe("string")),
                        ],
                        &["id", "to", "delivery_state"],
                    )),
                ),
                ("chain_id", maybe("string")),
                ("warning", string()),
            ],
            &[
                "fanout_id",
                "join",
                "deadline_at",
                "created",
                "children",
                "chain_id",
            ],
        ),
        fan_out,
    )
}

fn fan_out(s: &McpServer, me: &str, a: &FanOutArgs) -> ToolResult {
    let lineage = s.session().lineage(a.parent.clone(), a.budget.clone());
    let done = s.service().fan_out(&crate::service::FanOut {
        from: me,
        to: &a.to,
        body: &a.message,
        title: &a.title,
        join: a.join.as_deref(),
        deadline_minutes: a.deadline_minutes,
        cancel_rest: a.cancel_rest.unwrap_or(false),
        due_minutes: a.due_minutes,
        key: a.key.as_deref(),
        lineage: &lineage,
    })?;
    let f = &done.fanout;
    let mut v = json!({
        "fanout_id": f.id,
        "join": if f.join_rule == "all" { "all".to_owned() } else { format!("quorum:{}", f.quorum) },
        "deadline_at": f.deadline_at,
        "created": done.created,
        "children": done.children.iter().map(|c| json!({
            "id": c.message.id,
            "to": c.message.recipient,
            "delivery_state": c.delivery_state,
        })).collect::<Vec<_>>(),
        "chain_id": done.children.first().map(|c| c.message.chain_id.clone()),
    });
    if let Some(w) = s.engine_warning() {
        v["warning"] = json!(w);
    }
    Ok(v)
}

fn trace_chain(s: &McpServer, me: &str, a: &TraceArgs) -> ToolResult {
    use crate::service::trace;
    let format = a.format.as_deref().unwrap_or("mermaid");
    if !["mermaid", "jsonl", "otel"].contains(&format) {
        return Err(ToolError(format!(
            "unknown format {format:?}: use mermaid, jsonl or otel"
        )));
    }
    let rows = s
        .service()
        .trace_for(me, &a.id, a.limit.unwrap_or(10_000))?;
    let text = match format {
        "jsonl" => trace::jsonl(&rows),
        "otel" => serde_json::to_string(&trace::otel(&rows)).unwrap_or_default(),
        _ => trace::mermaid(&rows),
    };
    Ok(json!({
        "chain_id": rows.first().and_then(|r| r.chain_id.clone()),
        "events": rows.len(),
        "format": format,
        "text": text,
    }))
}

fn spend_budget(s: &McpServer, me: &str, a: &SpendArgs) -> ToolResult {
    if a.units.is_empty() {
        return Err(ToolError(
            "units is empty: give what was spent, e.g. {\"tokens\": 1200}".to_owned(),
        ));
    }
    let units = model::chain::units_from_numbers(a.units.iter().map(|(u, n)| (u.as_str(), *n)))
        .map_err(ToolError)?;
    let lineage = s.session().lineage(a.parent.clone(), None);
    let spent = s.service().chain_spend(me, &units, &lineage)?;
    Ok(json!({
        "chain_id": spent.chain.id,
        "message_id": spent.message,
        "state": spent.chain.state,
        "units": spent.chain.units,
        "hops": spent.chain.hops,
        "hop_budget": spent.chain.hop_budget,
    }))
}

fn cancel_chain(s: &McpServer, me: &str, a: &CancelChainArgs) -> ToolResult {
    let c = s
        .service()
        .chain_cancel(&a.id, Some(me), a.note.as_deref())?;
    Ok(json!({
        "chain_id": c.chain.id,
        "cancelled": c.cancelled,
        "marked": c.marked,
        "closed_work": c.closed_work,
        "notified": c.notified,
    }))
}

fn inbox(s: &McpServer, me: &str, a: &InboxArgs) -> ToolResult {
    let limit = a.limit.unwrap_or(50);
    if !(1..=500).contains(&limit) {
        return Err(ToolError("limit must be 1 to 500".to_owned()));
    }
    let all = !a.unread_only.unwrap_or(true);
    let msgs = s.service().inbox(me, all, limit)?;
    Ok(json!({ "messages": msgs.iter().map(summary_of).collect::<Vec<_>>() }))
}

fn accept_work(s: &McpServer, me: &str, a: &IdArgs) -> ToolResult {
    let w = s.service().accept(&a.id, me)?;
    s.session().take_up(&w.id);
    Ok(json!({ "work": w }))
}

fn read_message(s: &McpServer, me: &str, a: &IdArgs) -> ToolResult {
    let m = s.service().read(&a.id, me)?;
    s.session().read(me, &m);
    Ok(message_of(&m))
}

fn return_work(s: &McpServer, me: &str, a: &ReturnArgs) -> ToolResult {
    let r = s.service().return_work(
        &a.id,
        me,
        &a.summary,
        a.evidence.as_deref(),
        a.blocked.unwrap_or(false),
    )?;
    Ok(json!({
        "work": r.work,
        "return_message_id": r.message.map(|m| m.id),
        "fanout": r.fanout,
    }))
}

fn close_work(s: &McpServer, me: &str, a: &CloseArgs) -> ToolResult {
    let outcome: Outcome = a.outcome.parse().map_err(ToolError)?;
    let w = s.service().close(&a.id, me, outcome, a.note.as_deref())?;
    Ok(json!({ "work": w }))
}

fn list_agents(s: &McpServer, me: &str, _: &NoArgs) -> ToolResult {
    let agents = s.service().agents()?;
    Ok(json!({
        "you": me,
        "agents": agents.iter().map(|a| json!({
            "id": a.id, "name": a.name, "provider": a.provider, "you": a.id == me,
        })).collect::<Vec<_>>(),
    }))
}

fn create_handoff(s: &McpServer, me: &str, a: &CreateTaskArgs) -> ToolResult {
    if let Some(t) = &a.target_agent {
        s.service().check_registered(t)?;
    }
    let t = s.with_ledger(|l| {
        l.create(
            me,
            &a.title,
            &a.goal,
            a.constraints.as_deref(),
            a.target_agent.as_deref(),
            a.handoff_cap,
        )
    })?;
    Ok(json!({ "task": t }))
}

fn claim_handoff(s: &McpServer, me: &str, a: &ClaimArgs) -> ToolResult {
    let c = s.with_ledger(|l| l.claim(me, &a.task_id, a.lease_minutes))?;
    s.remember_lease(&c.task.id, &c.lease.token);
    Ok(serde_json::to_value(&c).unwrap_or_default())
}

fn renew_handoff(s: &McpServer, me: &str, a: &RenewArgs) -> ToolResult {
    let token = s.token(&a.task_id, a.lease_token.clone())?;
    let l = s.with_ledger(|l| l.renew(me, &a.task_id, &token, a.lease_minutes))?;
    Ok(json!({ "lease": l }))
}

fn pass_handoff(s: &McpServer, me: &str, a: &PassArgs) -> ToolResult {
    let token = s.token(&a.task_id, a.lease_token.clone())?;
    let pass = crate::service::tasks::Pass {
        task_id: &a.task_id,
        token: &token,
        summary: &a.summary,
        next_action: &a.next_action,
        changed_files: a.changed_files.as_deref().unwrap_or(&[]),
        target: &a.target_agent,
    };
    let mut service = s.service();
    let p =
        s.with_ledger(|l| crate::service::tasks::pass_task(Some(&mut service), l, me, &pass))?;
    Ok(serde_json::to_value(&p).unwrap_or_default())
}

fn complete_handoff(s: &McpServer, me: &str, a: &CompleteArgs) -> ToolResult {
    let token = s.token(&a.task_id, a.lease_token.clone())?;
    let t = s.with_ledger(|l| {
        l.complete(
            me,
            &a.task_id,
            &token,
            a.summary.as_deref(),
            a.changed_files.as_deref().unwrap_or(&[]),
        )
    })?;
    Ok(json!({ "task": t }))
}
