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

pub mod http;
mod tools;
pub mod transport;

use crate::context::Library;
use crate::service::MessageRow;
use crate::service::ledger::{Ledger, find_root};
use crate::service::{Service, ServiceError};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    JsonObject, ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde_json::{Value, json};
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

/// A tool's failure: one sentence for the model.
struct ToolError(String);

impl From<ServiceError> for ToolError {
    fn from(e: ServiceError) -> Self {
        ToolError(e.to_string())
    }
}

type ToolResult = Result<Value, ToolError>;

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
    library: Option<Library>,
    tools: OnceLock<Vec<Tool>>,
    changes: OnceLock<Option<crate::service::Changes>>,
    /// Ledger warnings gathered during the current call.
    warnings: Mutex<Vec<String>>,
    /// The engine's last verdict (a warning, or none when it is delivering) and until when it
    /// holds (ms).
    engine_verdict: Mutex<Option<(i64, Option<String>)>>,
    /// What the service keeps for this agent's session: the handoff it took up, its lease
    /// tokens, the chain stops its waits reported.
    session: Mutex<crate::service::Session>,
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
        let mut service = Service::open(db)?;
        if !service.agents()?.iter().any(|a| a.id == agent) {
            return Err(ServiceError::NotFound(format!(
                "unknown agent {agent:?}; register it with `handoffs agent add {agent} --provider …`"
            )));
        }
        check_library(context_library)?;
        let library = context_library.map(Library::open).transpose()?;
        let ledger_root = std::env::current_dir()
            .map_err(|e| format!("no current folder: {e}"))
            .and_then(|d| find_root(&d).map_err(|e| e.to_string()));
        Ok(McpServer {
            inner: Arc::new(Inner {
                agent: agent.to_owned(),
                db: service.db_path().to_owned(),
                service: Mutex::new(service),
                ledger: Mutex::new(None),
                ledger_root,
                library,
                tools: OnceLock::new(),
                changes: OnceLock::new(),
                warnings: Mutex::new(Vec::new()),
                engine_verdict: Mutex::new(None),
                session: Mutex::new(crate::service::Session::new()),
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
            tools::table()
                .iter()
                .filter(|d| !d.library || self.inner.library.is_some())
                .map(|d| d.tool.clone())
                .collect()
        })
    }

    /// What is kept for this session (its rules are `service::Session`'s).
    pub(crate) fn session(&self) -> std::sync::MutexGuard<'_, crate::service::Session> {
        self.inner
            .session
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The handoff this session last took up, if any.
    pub(crate) fn session_work(&self) -> Option<String> {
        self.session().taken_up().map(str::to_owned)
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

    fn library(&self) -> Result<&Library, ToolError> {
        self.inner.library.as_ref().ok_or_else(|| {
            ToolError("no context library: start the server with --context-library DIR".to_owned())
        })
    }

    /// Keeps the lease token a claim returned, so later calls on the task need not repeat it.
    fn remember_lease(&self, task_id: &str, token: &str) {
        self.session().keep_lease(task_id, token);
    }

    /// The token a call gave, else the one this session holds for the task.
    fn token(&self, task_id: &str, given: Option<String>) -> Result<String, ToolError> {
        if let Some(t) = given {
            return Ok(t);
        }
        self.session()
            .lease_token(task_id)
            .map(str::to_owned)
            .ok_or_else(|| {
                ToolError(format!(
                    "give lease_token: this session holds no lease on task {task_id} alone (claim_handoff returns one)"
                ))
            })
    }

    /// A warning when no engine is delivering: sends are stored, but nothing moves. The
    /// verdict is the service's, kept until it may change (`EngineHealth::holds_until`).
    fn engine_warning(&self) -> Option<String> {
        let now = crate::clock::now_ms();
        let mut verdict = self
            .inner
            .engine_verdict
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((until, warning)) = verdict.as_ref()
            && now <= *until
        {
            return warning.clone();
        }
        let health = self
            .service()
            .engine_health()
            .unwrap_or(crate::service::EngineHealth::Never);
        let warning = health.warning(now);
        *verdict = Some((health.holds_until(now), warning.clone()));
        warning
    }

    /// Runs one tool call. Public so the in-process tests and the bench can call it directly.
    pub async fn call(
        &self,
        name: &str,
        raw: &JsonObject,
        ct: &tokio_util::sync::CancellationToken,
    ) -> CallToolResult {
        use tracing::Instrument as _;
        let span = tracing::info_span!("tool", name, agent = %self.inner.agent);
        self.call_in_span(name, raw, ct).instrument(span).await
    }

    async fn call_in_span(
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
        let Some(def) = tools::table().iter().find(|d| d.name == name) else {
            return error(format!("no tool named {name:?}; tools/list names them"));
        };
        let out = if matches!(def.run, tools::Run::Wait) {
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
            Ok(v) => {
                tracing::info!("tool call answered");
                CallToolResult::structured(v)
            }
            Err(ToolError(m)) => {
                tracing::info!(error = %m, "tool call refused");
                error(m)
            }
        }
    }

    /// The tool's handler, with the ledger's warnings of this call added to its result.
    fn call_collecting_warnings(&self, name: &str, raw: &JsonObject) -> ToolResult {
        let lock = || {
            self.inner
                .warnings
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        lock().clear();
        let out = match tools::table()
            .iter()
            .find(|d| d.name == name)
            .map(|d| &d.run)
        {
            Some(tools::Run::Now(handler)) => handler(self, raw),
            _ => Err(ToolError(format!(
                "no tool named {name:?}; tools/list names them"
            ))),
        };
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

    async fn wait(&self, raw: &JsonObject, ct: &tokio_util::sync::CancellationToken) -> ToolResult {
        let a: tools::WaitArgs = tools::args("wait_for_messages", raw)?;
        let secs = a.timeout_seconds.unwrap_or(30);
        if !(1..=WAIT_MAX_SECONDS).contains(&secs) {
            return Err(ToolError(format!(
                "timeout_seconds must be 1 to {WAIT_MAX_SECONDS}"
            )));
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
        let session = self.session_work();
        let since = self.session().chain_seen();
        let woken = crate::service::changes::wait_until(
            || {
                self.service()
                    .wake_look(&self.inner.agent, session.as_deref(), since)
            },
            self.watch(),
            deadline,
            ct.cancelled(),
        )
        .await?;
        if ct.is_cancelled() {
            return Err(ToolError("cancelled".to_owned()));
        }
        Ok(match woken {
            None => json!({ "timed_out": true, "woke": "timeout", "messages": [] }),
            Some(w) => {
                let mut v = json!({
                    "timed_out": false,
                    "woke": w.woke,
                    "messages": w.messages.iter().map(summary_of).collect::<Vec<_>>(),
                });
                if let Some(c) = &w.chain {
                    self.session().saw_chain(c.updated_at);
                    v["chain"] = json!({
                        "id": c.id, "state": c.state, "reason": c.stopped_reason,
                        "hops": c.hops, "hop_budget": c.hop_budget,
                    });
                }
                v
            }
        })
    }

    fn watch(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.inner
            .changes
            .get_or_init(|| crate::service::Changes::watch(&self.inner.db))
            .as_ref()
            .map(crate::service::Changes::subscribe)
    }
}

fn error(message: String) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(message)])
}

fn preview(body: &str) -> String {
    crate::text::one_line(body, 200)
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
                 accept_work / return_work with the message id in `message` when it is work."
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
        server.channels = true;
        Some(crate::adapter::channel::Listener::open(db, agent).map_err(ServiceError::Refused)?)
    } else {
        None
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ServiceError::Refused(format!("cannot start the runtime: {e}")))?;
    rt.block_on(async move {
        let running = start(server, tokio::io::stdin(), tokio::io::stdout()).await?;
        if let Some(mut listener) = listener {
            let peer = running.peer().clone();
            let pushing = tokio::spawn(async move {
                loop {
                    listener.refresh();
                    for (content, meta) in listener.take() {
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
                            listener.close();
                            return;
                        }
                    }
                    if peer.is_transport_closed() {
                        listener.close();
                        return;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(250)).await;
                }
            });
            let _ = running.waiting().await;
            pushing.abort();
            crate::adapter::channel::Listener::close_for_this_process(db);
            return Ok(());
        }
        let _ = running.waiting().await;
        Ok(())
    })
}

/// Serves MCP over a pair of byte streams, one JSON-RPC message per line, until the input
/// ends and every answer is written: what `handoffs mcp` does over stdio, and what the fuzz
/// target (`fuzz/fuzz_targets/mcp_lines.rs`) drives in memory.
pub async fn serve_lines<R, W>(server: McpServer, read: R, write: W) -> Result<(), ServiceError>
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
    W: tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let running = start(server, read, write).await?;
    let _ = running.waiting().await;
    Ok(())
}

/// Opens the MCP session over `read` and `write` (the handshake included).
async fn start<R, W>(
    server: McpServer,
    read: R,
    write: W,
) -> Result<rmcp::service::RunningService<RoleServer, McpServer>, ServiceError>
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
    W: tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use rmcp::ServiceExt as _;
    server
        .serve(Opening {
            inner: transport::Lines::new(read, write),
            open: false,
        })
        .await
        .map_err(|e| ServiceError::Refused(format!("MCP session ended before it began: {e}")))
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

/// `--context-library DIR` must name an existing folder (stdio and remote MCP alike).
pub(crate) fn check_library(dir: Option<&Path>) -> Result<(), ServiceError> {
    match dir {
        Some(dir) if !dir.is_dir() => Err(ServiceError::Usage(format!(
            "--context-library {} is not a folder (create it first)",
            dir.display()
        ))),
        _ => Ok(()),
    }
}
