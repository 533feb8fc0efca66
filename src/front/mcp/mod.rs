//! The per-agent MCP server (SPEC §7, §8.1): `handoffs mcp --agent ID` over stdio, with rmcp.
//!
//! The identity is fixed when the process starts: every tool acts as that agent, no tool takes
//! a sender, and a call whose arguments try to name one (`from`, `sender`, `as`, `agent`, …) is
//! refused before anything else is looked at. Tools only write to the database; the engine
//! delivers.
//!
//! Arguments are taken as a raw JSON object and checked here (identity first, then the typed
//! shape, then the service's own bounds), so any malformed call, missing, oversize or wrongly
//! typed, becomes a tool error with one clear sentence, never a protocol failure or a crash.
//! The input schemas that `tools/list` shows are generated from the same typed structs.

pub mod transport;

use crate::context::Library;
use crate::service::ledger::{Ledger, find_root};
use crate::service::{Outcome, Service, ServiceError};
use crate::store::{MessageRow, Store};
use rmcp::handler::server::common::{schema_for_empty_input, schema_for_input};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    JsonObject, ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
    ToolAnnotations,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler};
use schemars::JsonSchema;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// Longest `wait_for_messages` (seconds).
pub const WAIT_MAX_SECONDS: u64 = 50;

/// Argument names that would name an acting agent. Compared after lower-casing and dropping
/// everything but letters and digits, so `fromAgent`, `from_agent` and `From-Agent` all match.
const IDENTITY_KEYS: &[&str] = &[
    "from",
    "sender",
    "as",
    "agent",
    "agentid",
    "asagent",
    "fromagent",
    "fromid",
    "senderid",
    "senderagent",
    "actor",
    "actingagent",
    "actas",
    "author",
    "onbehalfof",
    "identity",
    "caller",
    "user",
    "self",
    "me",
    "whoami",
    "impersonate",
    "myself",
    "by",
    "owner",
    "principal",
    "agentname",
    "userid",
    "username",
];

fn identity_key(key: &str) -> bool {
    let norm: String = key
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_lowercase())
        .collect();
    IDENTITY_KEYS.contains(&norm.as_str())
        || IDENTITY_PREFIXES.iter().any(|p| norm.starts_with(p))
        || IDENTITY_SUFFIXES.iter().any(|p| norm.ends_with(p))
}

/// Any argument name that starts with one of these names an actor (`from_agent_id`,
/// `sender_name`, `on_behalf`, …); no tool has an argument like that.
const IDENTITY_PREFIXES: &[&str] = &[
    "from",
    "sender",
    "sentby",
    "author",
    "onbehalf",
    "impersonat",
    "actas",
    "actingas",
    "runas",
    "requester",
    "requestor",
    "caller",
];
const IDENTITY_SUFFIXES: &[&str] = &["sender", "author", "identity"];

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
struct WaitArgs {
    /// Seconds to wait for a new unread message (1–50, default 30).
    timeout_seconds: Option<u64>,
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

fn schema<T: JsonSchema + 'static>() -> Arc<JsonObject> {
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<NoArgs>() {
        return schema_for_empty_input();
    }
    schema_for_input::<T>().unwrap_or_else(|_| schema_for_empty_input())
}

fn tool<T: JsonSchema + 'static>(
    name: &'static str,
    title: &str,
    kind: Kind,
    about: &'static str,
) -> Tool {
    let annotations = ToolAnnotations::with_title(title)
        .read_only(matches!(kind, Kind::Read))
        .destructive(false)
        .idempotent(!matches!(kind, Kind::Write))
        .open_world(false);
    Tool::new(name, about, schema::<T>())
        .with_title(title)
        .with_annotations(annotations)
}

fn handoff_tools() -> Vec<Tool> {
    use Kind::{Idempotent, Read, Write};
    vec![
        tool::<SendArgs>(
            "send_handoff",
            "Send a handoff",
            Write,
            "Send a handoff to another agent; it becomes exactly one new turn in their session. \
             With a title it is work (accept, return, close). You always send as yourself.",
        ),
        tool::<InboxArgs>(
            "inbox",
            "Inbox",
            Read,
            "Your messages, newest first (unread only unless unread_only is false).",
        ),
        tool::<IdArgs>(
            "read_message",
            "Read a message",
            Idempotent,
            "A message in full; marks it read when it is yours.",
        ),
        tool::<IdArgs>(
            "accept_work",
            "Accept work",
            Idempotent,
            "Accept work given to you.",
        ),
        tool::<ReturnArgs>(
            "return_work",
            "Return work",
            Idempotent,
            "Return work to its sender with a summary (or as blocked).",
        ),
        tool::<CloseArgs>(
            "close_work",
            "Close work",
            Idempotent,
            "Close work you gave: accepted, revision or blocked.",
        ),
        tool::<StatusArgs>(
            "handoff_status",
            "Delivery status",
            Read,
            "One delivery with its history, or the overview: in flight, needs attention, recent.",
        ),
        tool::<NoArgs>(
            "list_agents",
            "List agents",
            Read,
            "The registered agents you can hand off to.",
        ),
        tool::<WaitArgs>(
            "wait_for_messages",
            "Wait for messages",
            Read,
            "Wait (at most 50 s) until you have an unread message; returns at once if you already do.",
        ),
        tool::<CreateTaskArgs>(
            "create_handoff",
            "Create a task brief",
            Write,
            "Create a task brief in this workspace's ledger, with a finite handoff budget.",
        ),
        tool::<ClaimArgs>(
            "claim_handoff",
            "Claim a task",
            Write,
            "Take the workspace's one writer lease for a task (default 90 minutes). Returns the lease token.",
        ),
        tool::<RenewArgs>(
            "renew_handoff",
            "Renew a lease",
            Idempotent,
            "Extend your lease on a task.",
        ),
        tool::<PassArgs>(
            "pass_handoff",
            "Pass a task on",
            Write,
            "Record your summary, next action and changed files, release the lease and queue the task for another agent; spends one handoff.",
        ),
        tool::<CompleteArgs>(
            "complete_handoff",
            "Complete a task",
            Idempotent,
            "Mark your task done and release the lease.",
        ),
        tool::<TaskIdArgs>(
            "show_handoff",
            "Show a task",
            Read,
            "A task brief with its history.",
        ),
        tool::<ListTasksArgs>(
            "list_handoffs",
            "List tasks",
            Read,
            "Task briefs in this workspace, newest first.",
        ),
    ]
}

fn context_tools() -> Vec<Tool> {
    use Kind::{Read, Write};
    vec![
        tool::<BriefArgs>(
            "context_brief",
            "Project memory brief",
            Read,
            "A bounded brief of the project's current memory records.",
        ),
        tool::<SearchArgs>(
            "context_search",
            "Search project memory",
            Read,
            "Records matching every word of the query, best first.",
        ),
        tool::<IdArgs>(
            "context_get",
            "Get a memory record",
            Read,
            "One record in full.",
        ),
        tool::<RecordArgs>(
            "context_record",
            "Record project memory",
            Write,
            "Add a Markdown record, authored by you.",
        ),
        tool::<SupersedeArgs>(
            "context_supersede",
            "Supersede a memory record",
            Write,
            "Replace a record with a new one; the old one stays, marked superseded.",
        ),
        tool::<NoArgs>(
            "context_status",
            "Project memory status",
            Read,
            "How many records, by whom, how recent.",
        ),
    ]
}

/// A tool's failure: one sentence for the model.
struct ToolError(String);

impl From<ServiceError> for ToolError {
    fn from(e: ServiceError) -> Self {
        ToolError(e.to_string())
    }
}

type ToolResult = Result<Value, ToolError>;

fn args<T: DeserializeOwned>(tool: &str, raw: &JsonObject) -> Result<T, ToolError> {
    serde_json::from_value(Value::Object(raw.clone()))
        .map_err(|e| ToolError(format!("invalid arguments for {tool}: {e}")))
}

/// The server for one agent.
#[derive(Clone)]
pub struct McpServer {
    inner: Arc<Inner>,
    /// Declares the Claude channel capability (`handoffs mcp --channels`).
    channels: bool,
}

struct Inner {
    agent: String,
    db: PathBuf,
    service: Mutex<Service>,
    ledger: Mutex<Option<Ledger>>,
    /// The project root, or why there is none.
    ledger_root: Result<PathBuf, String>,
    /// Lease tokens this server obtained, by task, so an agent need not repeat them.
    tokens: Mutex<HashMap<String, String>>,
    library: Option<Library>,
    tools: OnceLock<Vec<Tool>>,
    changes: OnceLock<Option<Watch>>,
    /// Ledger warnings gathered during the current call.
    warnings: Mutex<Vec<String>>,
    /// Until when the engine counts as running (ms), from its last report read.
    engine_alive_until: std::sync::atomic::AtomicI64,
    /// The last "no engine" warning, and until when it holds (ms).
    engine_quiet: Mutex<Option<(i64, String)>>,
}

/// A file watch on the database's folder: any commit by any process touches the WAL file.
struct Watch {
    rx: tokio::sync::watch::Receiver<u64>,
    _watcher: notify::RecommendedWatcher,
}

impl std::fmt::Debug for McpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpServer")
            .field("agent", &self.inner.agent)
            .finish_non_exhaustive()
    }
}

impl McpServer {
    /// A server acting as `agent` over the database at `db`. The agent must be registered.
    pub fn new(
        db: &Path,
        agent: &str,
        context_library: Option<&Path>,
    ) -> Result<McpServer, ServiceError> {
        crate::service::check_agent_id(agent)?;
        let mut service = Service::new(Store::open(db)?);
        if !service.agents()?.iter().any(|a| a.id == agent) {
            return Err(ServiceError::NotFound(format!(
                "unknown agent {agent:?}; register it with `handoffs agent add {agent} --provider …`"
            )));
        }
        if let Some(dir) = context_library
            && !dir.is_dir()
        {
            return Err(ServiceError::Usage(format!(
                "--context-library {} is not a folder (create it first)",
                dir.display()
            )));
        }
        let library = context_library.map(Library::open).transpose()?;
        let ledger_root = std::env::current_dir()
            .map_err(|e| format!("no current folder: {e}"))
            .and_then(|d| find_root(&d).map_err(|e| e.to_string()));
        Ok(McpServer {
            inner: Arc::new(Inner {
                agent: agent.to_owned(),
                db: service.store.path().to_owned(),
                service: Mutex::new(service),
                ledger: Mutex::new(None),
                ledger_root,
                tokens: Mutex::new(HashMap::new()),
                library,
                tools: OnceLock::new(),
                changes: OnceLock::new(),
                warnings: Mutex::new(Vec::new()),
                engine_alive_until: std::sync::atomic::AtomicI64::new(0),
                engine_quiet: Mutex::new(None),
            }),
            channels: false,
        })
    }

    /// Uses `root` as the project root of the ledger (instead of the one found from the
    /// current folder).
    #[must_use]
    pub fn with_ledger_root(mut self, root: PathBuf) -> McpServer {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.ledger_root = Ok(root);
        }
        self
    }

    pub fn agent(&self) -> &str {
        &self.inner.agent
    }

    /// Every tool this server offers.
    pub fn tools(&self) -> &[Tool] {
        self.inner.tools.get_or_init(|| {
            let mut t = handoff_tools();
            if self.inner.library.is_some() {
                t.extend(context_tools());
            }
            t
        })
    }

    fn service(&self) -> std::sync::MutexGuard<'_, Service> {
        self.inner
            .service
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn with_ledger<T>(
        &self,
        f: impl FnOnce(&mut Ledger) -> Result<T, ServiceError>,
    ) -> Result<T, ToolError> {
        let mut guard = self
            .inner
            .ledger
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if guard.is_none() {
            let root = self.inner.ledger_root.clone().map_err(ToolError)?;
            *guard = Some(Ledger::open_root(&root)?);
        }
        let ledger = guard
            .as_mut()
            .ok_or_else(|| ToolError("no ledger".to_owned()))?;
        let out = f(ledger);
        self.inner
            .warnings
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend(ledger.take_warnings());
        Ok(out?)
    }

    /// `id` must be a registered agent.
    fn registered(&self, id: &str) -> Result<(), ToolError> {
        let agents = self.service().agents()?;
        if agents.iter().any(|a| a.id == id) {
            Ok(())
        } else {
            Err(ToolError(format!(
                "unknown agent {id:?}; list_agents names the registered ones"
            )))
        }
    }

    fn library(&self) -> Result<&Library, ToolError> {
        self.inner.library.as_ref().ok_or_else(|| {
            ToolError("no context library: start the server with --context-library DIR".to_owned())
        })
    }

    fn token(&self, task_id: &str, given: Option<String>) -> Result<String, ToolError> {
        if let Some(t) = given {
            return Ok(t);
        }
        let tokens = self
            .inner
            .tokens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        tokens
            .iter()
            .find(|(k, _)| k.starts_with(task_id))
            .map(|(_, v)| v.clone())
            .ok_or_else(|| {
                ToolError(format!(
                    "give lease_token: this server holds no lease on task {task_id} (claim_handoff returns one)"
                ))
            })
    }

    /// A warning when no engine has reported recently: sends are stored, but nothing moves.
    fn engine_warning(&self) -> Option<String> {
        use std::sync::atomic::Ordering;
        let now = crate::store::millis(crate::clock::now());
        // An engine that reported at `at` counts as running until `at` + 2 minutes: no need
        // to read its report again before then.
        if now <= self.inner.engine_alive_until.load(Ordering::Relaxed) {
            return None;
        }
        // No engine: an engine reports once a second, so a verdict of "quiet" holds for one.
        {
            let quiet = self
                .inner
                .engine_quiet
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some((until, warning)) = quiet.as_ref()
                && now <= *until
            {
                return Some(warning.clone());
            }
        }
        let report = self.service().engine_report().ok().flatten();
        let alive = crate::service::engine_alive(report.as_ref().map(|(at, r)| (*at, r)), now);
        let reported = report.map(|(at, _)| at);
        match reported {
            Some(at) if alive => {
                self.inner
                    .engine_alive_until
                    .store(at + crate::service::ENGINE_QUIET_MS, Ordering::Relaxed);
                None
            }
            reported => {
                let warning = match reported {
                    Some(at) if now - at <= crate::service::ENGINE_QUIET_MS => "the last engine pass was a one-shot `handoffs tick`: the handoff is stored, but nothing is delivered until `handoffs run` (or `serve`, or another `tick`) runs on this database".to_owned(),
                    Some(at) => format!(
                        "no engine has reported for {} minutes: the handoff is stored, but nothing is being delivered until `handoffs run` (or `serve`) runs on this database",
                        (now - at) / 60_000
                    ),
                    None => "no engine has ever run on this database: the handoff is stored, but nothing is delivered until `handoffs run` (or `serve`) runs on it".to_owned(),
                };
                *self
                    .inner
                    .engine_quiet
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) =
                    Some((now + 1_000, warning.clone()));
                Some(warning)
            }
        }
    }

    /// Runs one tool call. Public so the in-process tests and the bench can call it directly.
    pub async fn call(
        &self,
        name: &str,
        raw: &JsonObject,
        ct: &tokio_util::sync::CancellationToken,
    ) -> CallToolResult {
        if let Some(key) = raw.keys().find(|k| identity_key(k)) {
            #[cfg(feature = "planted-bugs")]
            let guarded = !crate::planted(crate::Plant::McpSpoof);
            #[cfg(not(feature = "planted-bugs"))]
            let guarded = true;
            if guarded {
                return error(format!(
                    "this server acts only as {agent}: `{key}` is not an argument; every call is made as {agent}",
                    agent = self.inner.agent
                ));
            }
        }
        #[cfg(feature = "planted-bugs")]
        let raw = &{
            let mut r = raw.clone();
            r.retain(|k, _| !identity_key(k));
            r
        };
        let out = if name == "wait_for_messages" {
            self.wait(raw, ct).await
        } else {
            // On the blocking pool: a database locked by another process (SQLite waits up to
            // its busy timeout) holds up this call, not the session; and a bug that panics
            // becomes this call's error instead of a request never answered.
            let this = self.clone();
            let tool = name.to_owned();
            let raw = raw.clone();
            tokio::task::spawn_blocking(move || this.call_collecting_warnings(&tool, &raw))
                .await
                .unwrap_or_else(|e| {
                    tracing::error!(error = %e, "tool call failed");
                    Err(ToolError(format!(
                        "internal error in {name}; the server keeps running"
                    )))
                })
        };
        match out {
            Ok(v) => CallToolResult::structured(v),
            Err(ToolError(m)) => error(m),
        }
    }

    /// `call_sync`, with the ledger's warnings of this call added to its result.
    fn call_collecting_warnings(&self, name: &str, raw: &JsonObject) -> ToolResult {
        let lock = || {
            self.inner
                .warnings
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        lock().clear();
        let out = self.call_sync(name, raw);
        let warnings = std::mem::take(&mut *lock());
        out.map(|mut v| {
            if !warnings.is_empty() && v.is_object() {
                let mut all: Vec<Value> = v
                    .get("warnings")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default();
                for w in warnings {
                    if !all.contains(&json!(w)) {
                        all.push(json!(w));
                    }
                }
                v["warnings"] = json!(all);
            }
            v
        })
    }

    fn call_sync(&self, name: &str, raw: &JsonObject) -> ToolResult {
        let me = self.inner.agent.as_str();
        match name {
            "send_handoff" => {
                let a: SendArgs = args(name, raw)?;
                let sent = self.service().send(
                    me,
                    &a.to,
                    &a.message,
                    a.title.as_deref(),
                    a.due_minutes,
                    a.key.as_deref(),
                )?;
                let mut v = json!({
                    "id": sent.message.id,
                    "to": sent.message.recipient,
                    "kind": sent.message.kind,
                    "created": sent.created,
                    "delivery_state": sent.delivery_state,
                });
                if let Some(w) = self.engine_warning() {
                    v["warning"] = json!(w);
                }
                Ok(v)
            }
            "inbox" => {
                let a: InboxArgs = args(name, raw)?;
                let limit = a.limit.unwrap_or(50);
                if !(1..=500).contains(&limit) {
                    return Err(ToolError("limit must be 1 to 500".to_owned()));
                }
                let all = !a.unread_only.unwrap_or(true);
                let msgs = self.service().inbox(me, all, limit)?;
                Ok(json!({ "messages": msgs.iter().map(summary_of).collect::<Vec<_>>() }))
            }
            "read_message" => {
                let a: IdArgs = args(name, raw)?;
                let m = self.service().read(&a.id, me)?;
                Ok(message_of(&m))
            }
            "accept_work" => {
                let a: IdArgs = args(name, raw)?;
                Ok(json!({ "work": self.service().accept(&a.id, me)? }))
            }
            "return_work" => {
                let a: ReturnArgs = args(name, raw)?;
                let (w, ret) = self.service().return_work(
                    &a.id,
                    me,
                    &a.summary,
                    a.evidence.as_deref(),
                    a.blocked.unwrap_or(false),
                )?;
                Ok(json!({ "work": w, "return_message_id": ret.id }))
            }
            "close_work" => {
                let a: CloseArgs = args(name, raw)?;
                let outcome: Outcome = a.outcome.parse().map_err(ToolError)?;
                let w = self
                    .service()
                    .close(&a.id, me, outcome, a.note.as_deref())?;
                Ok(json!({ "work": w }))
            }
            "handoff_status" => {
                let a: StatusArgs = args(name, raw)?;
                match a.id {
                    Some(id) => Ok(json!({ "delivery": self.service().delivery(&id)? })),
                    None => Ok(json!({ "overview": self.service().overview(20)? })),
                }
            }
            "list_agents" => {
                let _: NoArgs = args(name, raw)?;
                let agents = self.service().agents()?;
                Ok(json!({
                    "you": me,
                    "agents": agents.iter().map(|a| json!({
                        "id": a.id, "name": a.name, "provider": a.provider, "you": a.id == me,
                    })).collect::<Vec<_>>(),
                }))
            }
            "create_handoff" => {
                let a: CreateTaskArgs = args(name, raw)?;
                if let Some(t) = &a.target_agent {
                    self.registered(t)?;
                }
                let t = self.with_ledger(|l| {
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
            "claim_handoff" => {
                let a: ClaimArgs = args(name, raw)?;
                let c = self.with_ledger(|l| l.claim(me, &a.task_id, a.lease_minutes))?;
                self.inner
                    .tokens
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .insert(c.task.id.clone(), c.lease.token.clone());
                Ok(serde_json::to_value(&c).unwrap_or_default())
            }
            "renew_handoff" => {
                let a: RenewArgs = args(name, raw)?;
                let token = self.token(&a.task_id, a.lease_token)?;
                let l = self.with_ledger(|l| l.renew(me, &a.task_id, &token, a.lease_minutes))?;
                Ok(json!({ "lease": l }))
            }
            "pass_handoff" => {
                let a: PassArgs = args(name, raw)?;
                let token = self.token(&a.task_id, a.lease_token)?;
                let pass = crate::service::tasks::Pass {
                    task_id: &a.task_id,
                    token: &token,
                    summary: &a.summary,
                    next_action: &a.next_action,
                    changed_files: a.changed_files.as_deref().unwrap_or(&[]),
                    target: &a.target_agent,
                };
                let mut service = self.service();
                let p = self.with_ledger(|l| {
                    crate::service::tasks::pass_task(Some(&mut service), l, me, &pass)
                })?;
                Ok(serde_json::to_value(&p).unwrap_or_default())
            }
            "complete_handoff" => {
                let a: CompleteArgs = args(name, raw)?;
                let token = self.token(&a.task_id, a.lease_token)?;
                let t = self.with_ledger(|l| {
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
            "show_handoff" => {
                let a: TaskIdArgs = args(name, raw)?;
                let d = self.with_ledger(|l| l.show(&a.task_id))?;
                Ok(serde_json::to_value(&d).unwrap_or_default())
            }
            "list_handoffs" => {
                let a: ListTasksArgs = args(name, raw)?;
                let t = self.with_ledger(|l| l.list(a.state.as_deref(), a.limit.unwrap_or(50)))?;
                Ok(json!({ "tasks": t }))
            }
            "context_brief" => {
                let a: BriefArgs = args(name, raw)?;
                let b = self
                    .library()?
                    .brief(a.max_chars.unwrap_or(crate::context::BRIEF_DEFAULT))?;
                Ok(serde_json::to_value(&b).unwrap_or_default())
            }
            "context_search" => {
                let a: SearchArgs = args(name, raw)?;
                let hits = self.library()?.search(
                    &a.query,
                    a.limit.unwrap_or(10),
                    a.include_superseded.unwrap_or(false),
                )?;
                Ok(json!({ "hits": hits }))
            }
            "context_get" => {
                let a: IdArgs = args(name, raw)?;
                Ok(json!({ "record": self.library()?.get(&a.id)? }))
            }
            "context_record" => {
                let a: RecordArgs = args(name, raw)?;
                let r = self.library()?.record(
                    me,
                    &a.title,
                    &a.body,
                    a.tags.as_deref().unwrap_or(&[]),
                    None,
                )?;
                Ok(json!({ "record": r }))
            }
            "context_supersede" => {
                let a: SupersedeArgs = args(name, raw)?;
                let r = self.library()?.supersede(
                    me,
                    &a.id,
                    a.title.as_deref(),
                    &a.body,
                    a.tags.as_deref(),
                )?;
                Ok(json!({ "record": r }))
            }
            "context_status" => {
                let _: NoArgs = args(name, raw)?;
                Ok(serde_json::to_value(self.library()?.status()?).unwrap_or_default())
            }
            other => Err(ToolError(format!(
                "no tool named {other:?}; tools/list names them"
            ))),
        }
    }

    async fn wait(&self, raw: &JsonObject, ct: &tokio_util::sync::CancellationToken) -> ToolResult {
        let a: WaitArgs = args("wait_for_messages", raw)?;
        let secs = a.timeout_seconds.unwrap_or(30);
        if !(1..=WAIT_MAX_SECONDS).contains(&secs) {
            return Err(ToolError(format!(
                "timeout_seconds must be 1 to {WAIT_MAX_SECONDS}"
            )));
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
        let mut rx = self.watch();
        // After a file event, look again a little later too: a commit becomes visible through
        // the shared-memory index, which raises no event of its own, just after the last WAL
        // write that did.
        let mut recheck: Option<tokio::time::Instant> = None;
        loop {
            let unread = self.service().inbox(&self.inner.agent, false, 50)?;
            if !unread.is_empty() {
                return Ok(json!({
                    "timed_out": false,
                    "messages": unread.iter().map(summary_of).collect::<Vec<_>>(),
                }));
            }
            // Wake on a change to the database's files (then once more shortly after), else
            // at the latest every 2 s (a file system that sends no events), else at the
            // deadline.
            let now = tokio::time::Instant::now();
            let next = recheck
                .take()
                .filter(|r| *r > now)
                .unwrap_or(now + Duration::from_secs(2))
                .min(deadline);
            tokio::select! {
                biased;
                () = ct.cancelled() => return Err(ToolError("cancelled".to_owned())),
                () = tokio::time::sleep_until(deadline) => {
                    return Ok(json!({ "timed_out": true, "messages": [] }));
                }
                changed = async {
                    match rx.as_mut() {
                        Some(r) => r.changed().await.is_ok(),
                        None => std::future::pending().await,
                    }
                } => {
                    if !changed {
                        rx = None;
                    }
                    // Let a burst of writes (one commit) settle into one look.
                    tokio::time::sleep(Duration::from_millis(15)).await;
                    if let Some(r) = rx.as_mut() {
                        r.borrow_and_update();
                    }
                    recheck = Some(tokio::time::Instant::now() + Duration::from_millis(60));
                }
                () = tokio::time::sleep_until(next) => {}
            }
        }
    }

    fn watch(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.inner
            .changes
            .get_or_init(|| {
                use notify::Watcher as _;
                let (tx, rx) = tokio::sync::watch::channel(0u64);
                let db = self.inner.db.clone();
                let name = db.file_name()?.to_string_lossy().into_owned();
                let mut watcher =
                    notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
                        if let Ok(ev) = ev
                            && ev.paths.iter().any(|p| {
                                p.file_name()
                                    .is_some_and(|f| f.to_string_lossy().starts_with(&name))
                            })
                        {
                            tx.send_modify(|n| *n += 1);
                        }
                    })
                    .ok()?;
                watcher
                    .watch(db.parent()?, notify::RecursiveMode::NonRecursive)
                    .ok()?;
                Some(Watch {
                    rx,
                    _watcher: watcher,
                })
            })
            .as_ref()
            .map(|w| w.rx.clone())
    }
}

fn error(message: String) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(message)])
}

fn preview(body: &str) -> String {
    let flat: String = body.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() > 200 {
        format!("{}…", flat.chars().take(200).collect::<String>())
    } else {
        flat
    }
}

fn summary_of(m: &MessageRow) -> Value {
    json!({
        "id": m.id,
        "from": m.sender,
        "kind": m.kind,
        "title": m.title,
        "preview": preview(&m.body),
        "created_at": m.created_at,
        "read": m.read_at.is_some(),
    })
}

fn message_of(m: &MessageRow) -> Value {
    json!({
        "id": m.id,
        "from": m.sender,
        "to": m.recipient,
        "kind": m.kind,
        "title": m.title,
        "body": m.body,
        "work_id": m.work_id,
        "created_at": m.created_at,
        "read_at": m.read_at,
    })
}

impl ServerHandler for McpServer {
    fn get_info(&self) -> ServerConfig {
        let mut caps = ServerCapabilities::builder().enable_tools().build();
        if self.channels {
            // Claude Code's channel contract (research preview): this capability makes it
            // listen for `notifications/claude/channel`.
            caps.experimental = Some(
                [("claude/channel".to_owned(), rmcp::model::JsonObject::new())]
                    .into_iter()
                    .collect(),
            );
        }
        let mut info = ServerConfig::new(caps).with_server_info(
            Implementation::new("handoffs", env!("CARGO_PKG_VERSION")).with_title("handoffs"),
        );
        info = info.with_instructions(format!(
            "You are agent {agent}. send_handoff gives another agent a new turn (a title makes it \
             work: they accept, return, and you close). inbox, read_message and \
             wait_for_messages show what was sent to you. The *_handoff tools share task briefs \
             in this workspace: claim before you write, pass with a summary when you stop.{channel}",
            agent = self.inner.agent,
            channel = if self.channels {
                " Handoffs for you also arrive as <channel> events from this server: each is \
                 a new task from the agent named in `from`; do it as its own turn, and use \
                 accept_handoff / return_handoff with the message id in `message` when it is work."
            } else {
                ""
            }
        ));
        info
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(self.tools().to_vec()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.tools().iter().find(|t| t.name == name).cloned()
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        if !self.tools().iter().any(|t| t.name == request.name) {
            return Ok(CallToolResponse::Complete(error(format!(
                "no tool named {:?}; tools/list names them",
                request.name
            ))));
        }
        let raw = request.arguments.unwrap_or_default();
        Ok(CallToolResponse::Complete(
            self.call(&request.name, &raw, &context.ct).await,
        ))
    }
}

/// `handoffs mcp --agent ID`: serves until the client closes stdin.
pub fn serve_stdio(
    db: &Path,
    agent: &str,
    context_library: Option<&Path>,
    channels: bool,
) -> Result<(), ServiceError> {
    let mut server = McpServer::new(db, agent, context_library)?;
    let listener = if channels {
        let row = Store::open(db)
            .and_then(|mut s| s.read(|tx| tx.agent(agent)))
            .map_err(|e| ServiceError::Refused(e.to_string()))?
            .ok_or_else(|| ServiceError::Refused(format!("unknown agent {agent:?}")))?;
        server.channels = true;
        Some(crate::adapter::channel::Listener::open(db, &row).map_err(ServiceError::Refused)?)
    } else {
        None
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ServiceError::Refused(format!("cannot start the runtime: {e}")))?;
    rt.block_on(async move {
        use rmcp::ServiceExt as _;
        let stdio = transport::Lines::new(tokio::io::stdin(), tokio::io::stdout());
        let running = server
            .serve(Opening {
                inner: stdio,
                open: false,
            })
            .await
            .map_err(|e| {
                ServiceError::Refused(format!("MCP session ended before it began: {e}"))
            })?;
        if let Some(mut listener) = listener {
            let peer = running.peer().clone();
            let listener_db = db.to_owned();
            let pushing = tokio::spawn(async move {
                let Ok(mut store) = Store::open(&listener_db) else {
                    return;
                };
                loop {
                    listener.refresh(&mut store);
                    for (content, meta) in listener.take(&mut store) {
                        // Taken (and recorded) before it is sent: pushed at most once.
                        let note = rmcp::model::CustomNotification::new(
                            crate::adapter::channel::METHOD,
                            Some(serde_json::json!({"content": content, "meta": meta})),
                        );
                        if peer
                            .send_notification(rmcp::model::ServerNotification::CustomNotification(
                                note,
                            ))
                            .await
                            .is_err()
                        {
                            listener.close(&mut store);
                            return;
                        }
                    }
                    if peer.is_transport_closed() {
                        listener.close(&mut store);
                        return;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(250)).await;
                }
            });
            let _ = running.waiting().await;
            pushing.abort();
            if let Ok(mut store) = Store::open(db) {
                let _ = store.write(|tx| tx.close_channel(i64::from(std::process::id())));
            }
            return Ok(());
        }
        let _ = running.waiting().await;
        Ok(())
    })
}

/// The stdio transport, minus what a client may send before its session opens: a notification
/// (or a stray response) that arrives before `initialize` or the first complete stateless
/// request is dropped, where rmcp would end the session over it.
struct Opening<T> {
    inner: T,
    open: bool,
}

impl<T> rmcp::transport::Transport<RoleServer> for Opening<T>
where
    T: rmcp::transport::Transport<RoleServer>,
{
    type Error = T::Error;

    fn send(
        &mut self,
        item: rmcp::service::TxJsonRpcMessage<RoleServer>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        self.inner.send(item)
    }

    async fn receive(&mut self) -> Option<rmcp::service::RxJsonRpcMessage<RoleServer>> {
        loop {
            let message = self.inner.receive().await?;
            if self.open {
                return Some(message);
            }
            if let rmcp::model::JsonRpcMessage::Request(r) = &message {
                use rmcp::model::{ClientRequest, GetMeta as _, ProtocolVersion};
                self.open = matches!(r.request, ClientRequest::InitializeRequest(_))
                    || (!matches!(r.request, ClientRequest::DiscoverRequest(_))
                        && r.request
                            .get_meta()
                            .missing_required_keys(&ProtocolVersion::V_2026_07_28)
                            .is_empty());
                return Some(message);
            }
            tracing::debug!("dropped a message sent before the session opened");
        }
    }

    fn close(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.inner.close()
    }
}
