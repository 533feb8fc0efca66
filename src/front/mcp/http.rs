//! Remote MCP (SPEC §7): `handoffs serve` answers MCP over Streamable HTTP at `/mcp` for agents
//! on other machines, with rmcp's server transport.
//!
//! - Every request carries `Authorization: Bearer <token>`; the token (issued by `handoffs
//!   agent token ID`, stored hashed) names the agent, and that fixes the session's identity
//!   exactly as `--agent` does on stdio: tools take no sender, and an argument that tries to
//!   name one is refused by the same check.
//! - Each agent has its own rmcp service and session manager: a session opened with one
//!   agent's token is unknown to every other agent's, so presenting another agent's session id
//!   with your own token finds nothing (404), and a token never reaches a session it did not
//!   open.
//! - The page's Host check applies (loopback, or a name given with `serve --allow-host`), and a
//!   browser's `Origin`, when present, must name an allowed host too. rmcp's own Host list is
//!   off because that check is the router's.

use super::McpServer;
use crate::service::Service;
use crate::service::tokens::{self, TokenRefusal};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use serde_json::json;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

type AgentService = StreamableHttpService<McpServer, LocalSessionManager>;

/// Open sessions one agent may hold at once. A session holds a database connection until it
/// is closed (DELETE) or idle for rmcp's 5 minutes; past this a new `initialize` is refused
/// (429), so clients that never close cannot use up the server's files.
pub const SESSIONS_PER_AGENT: usize = 16;

/// How often the sessions of revoked or expired tokens are looked for and ended.
pub const SWEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// One agent's rmcp service, for the token that made it.
struct AgentEntry {
    /// The stored hash of the token whose requests it serves: a rotation makes a new one.
    token_hash: String,
    /// When that token was issued: an older one never replaces a newer one.
    issued_at: i64,
    served: Served,
    /// Ends this agent's sessions (when its token is rotated, or the server stops).
    stop: tokio_util::sync::CancellationToken,
}

/// What answers one agent's requests.
#[derive(Clone)]
struct Served {
    service: AgentService,
    sessions: Arc<LocalSessionManager>,
    /// Requests without a session (an `initialize` on its way to be a session) in flight.
    opening: Arc<std::sync::atomic::AtomicUsize>,
    /// Orders the check of the session cap with the count of those in flight.
    gate: Arc<tokio::sync::Mutex<()>>,
}

/// One request without a session counted in flight until dropped.
struct Opening(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Opening {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Served {
    /// Counts a request that may open a session, or None when the agent's open sessions and
    /// those on their way already reach `SESSIONS_PER_AGENT`.
    async fn open(&self) -> Option<Opening> {
        use std::sync::atomic::Ordering;
        let _gate = self.gate.lock().await;
        let open = self.sessions.sessions.read().await.len();
        if open + self.opening.load(Ordering::SeqCst) >= SESSIONS_PER_AGENT {
            return None;
        }
        self.opening.fetch_add(1, Ordering::SeqCst);
        Some(Opening(self.opening.clone()))
    }
}

/// The remote MCP endpoint of one `serve`.
pub struct Remote {
    db: PathBuf,
    library: Option<PathBuf>,
    /// Looks tokens up (on the blocking pool).
    service: Arc<Mutex<Service>>,
    agents: Mutex<HashMap<String, AgentEntry>>,
    /// Ends every session when the server stops.
    stop: tokio_util::sync::CancellationToken,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote")
            .field("db", &self.db)
            .finish_non_exhaustive()
    }
}

/// The JSON-RPC error MCP clients show for a refusal made before any session (id null: the
/// request was not read).
fn json_rpc_error(status: StatusCode, message: &str) -> Response {
    let body = json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32001, "message": message}});
    (status, axum::Json(body)).into_response()
}

/// 401 for a missing or unusable token, with the `WWW-Authenticate` challenge (RFC 6750).
fn unauthorized(refusal: &TokenRefusal) -> Response {
    let mut res = json_rpc_error(StatusCode::UNAUTHORIZED, &refusal.to_string());
    let challenge = match refusal {
        TokenRefusal::Malformed => "Bearer realm=\"handoffs\"",
        TokenRefusal::Unknown | TokenRefusal::Expired { .. } => {
            "Bearer realm=\"handoffs\", error=\"invalid_token\""
        }
    };
    res.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static(challenge),
    );
    res
}

/// The token of a request: one `Authorization: Bearer …` header (the scheme in any case).
fn bearer(headers: &axum::http::HeaderMap) -> Option<&str> {
    let mut all = headers.get_all(header::AUTHORIZATION).iter();
    let value = all.next()?.to_str().ok()?;
    if all.next().is_some() {
        return None;
    }
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// rmcp answers some refusals (a body that is not JSON, a missing session id) in plain text:
/// give them the JSON-RPC error body every other refusal has, with the same status.
async fn as_json_error(res: Response) -> Response {
    let status = res.status();
    let json = res
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || json {
        return res;
    }
    let (parts, body) = res.into_parts();
    let text = axum::body::to_bytes(body, 4096)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_owned())
        .unwrap_or_default();
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("refused").to_owned()
    } else {
        text
    };
    let mut res = json_rpc_error(status, &message);
    // Keep what rmcp said besides the body (`Allow` on a 405, say).
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            res.headers_mut().insert(name.clone(), value.clone());
        }
    }
    res
}

impl Remote {
    pub fn new(
        db: PathBuf,
        library: Option<PathBuf>,
        stop: tokio_util::sync::CancellationToken,
    ) -> Result<Remote, crate::service::ServiceError> {
        super::check_library(library.as_deref())?;
        let service = Service::open(&db)?;
        Ok(Remote {
            db,
            library,
            service: Arc::new(Mutex::new(service)),
            agents: Mutex::new(HashMap::new()),
            stop,
        })
    }

    /// Ends, every `SWEEP_EVERY`, the sessions of tokens that no longer hold (revoked,
    /// expired, or their agent removed), open event streams included: a request with such a
    /// token is refused at once, and what it left open ends within the sweep.
    pub async fn sweep(self: Arc<Self>) {
        loop {
            tokio::select! {
                () = self.stop.cancelled() => return,
                () = tokio::time::sleep(SWEEP_EVERY) => {}
            }
            let held: Vec<String> = self
                .agents
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .values()
                .map(|e| e.token_hash.clone())
                .collect();
            if held.is_empty() {
                continue;
            }
            let service = self.service.clone();
            let gone = tokio::task::spawn_blocking(move || {
                let mut service = service
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                held.into_iter()
                    .filter(|h| matches!(service.token_holds(h), Ok(false)))
                    .collect::<Vec<_>>()
            })
            .await
            .unwrap_or_default();
            let mut agents = self
                .agents
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            agents.retain(|agent, e| {
                let keep = !gone.contains(&e.token_hash);
                if !keep {
                    tracing::info!(%agent, "remote MCP: the token no longer holds; its sessions end");
                    e.stop.cancel();
                }
                keep
            });
        }
    }

    /// What serves `agent`'s sessions opened with the token stored as `token_hash`, issued
    /// at `issued_at`. A newer token (a rotation) ends the sessions the old one opened, open
    /// event streams included; None for a token older than the one already serving (a
    /// request that was checked just before a rotation and arrives after it).
    fn service_for(&self, agent: &str, token_hash: &str, issued_at: i64) -> Option<Served> {
        let mut agents = self
            .agents
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(old) = agents.get(agent)
            && old.token_hash != token_hash
        {
            if old.issued_at > issued_at {
                return None;
            }
            old.stop.cancel();
            agents.remove(agent);
        }
        let entry = agents.entry(agent.to_owned()).or_insert_with(|| {
            let (db, library, who) = (self.db.clone(), self.library.clone(), agent.to_owned());
            let stop = self.stop.child_token();
            let config = StreamableHttpServerConfig::default()
                .disable_allowed_hosts()
                .with_cancellation_token(stop.clone());
            let sessions = Arc::new(LocalSessionManager::default());
            let service = StreamableHttpService::new(
                move || {
                    McpServer::new(&db, &who, library.as_deref())
                        .map_err(|e| std::io::Error::other(e.to_string()))
                },
                sessions.clone(),
                config,
            );
            AgentEntry {
                token_hash: token_hash.to_owned(),
                issued_at,
                served: Served {
                    service,
                    sessions,
                    opening: Arc::default(),
                    gate: Arc::default(),
                },
                stop,
            }
        });
        Some(entry.served.clone())
    }

    /// Answers one request to `/mcp`: the token names the agent, then that agent's rmcp
    /// service answers.
    pub async fn handle(
        self: Arc<Self>,
        origin_allowed: bool,
        req: axum::extract::Request,
    ) -> Response {
        if !origin_allowed {
            return json_rpc_error(
                StatusCode::FORBIDDEN,
                "this server answers MCP only to its own origins (the Origin header names another host)",
            );
        }
        let Some(token) = bearer(req.headers())
            .filter(|t| tokens::well_formed(t))
            .map(str::to_owned)
        else {
            return unauthorized(&TokenRefusal::Malformed);
        };
        let token_hash = tokens::hash(&token);
        let service = self.service.clone();
        let found = tokio::task::spawn_blocking(move || {
            service
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .token_holder(&token)
        })
        .await;
        let holder = match found {
            Ok(Ok(Ok(holder))) => holder,
            Ok(Ok(Err(refusal))) => {
                tracing::info!(%refusal, "remote MCP: token refused");
                return unauthorized(&refusal);
            }
            Ok(Err(e)) => return json_rpc_error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
            Err(e) => {
                return json_rpc_error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    &format!("the token lookup failed: {e}"),
                );
            }
        };
        let agent = holder.agent;
        tracing::debug!(%agent, "remote MCP request");
        let Some(served) = self.service_for(&agent, &token_hash, holder.created_at) else {
            return unauthorized(&TokenRefusal::Unknown);
        };
        let session = req
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .map(|v| rmcp::transport::streamable_http_server::SessionId::from(v.to_owned()));
        let method = req.method().clone();
        let mut service = served.service.clone();
        let mut opening = None;
        match &session {
            None if method == axum::http::Method::POST => match served.open().await {
                Some(o) => opening = Some(o),
                None => {
                    return json_rpc_error(
                        StatusCode::TOO_MANY_REQUESTS,
                        &format!(
                            "agent {agent} has {SESSIONS_PER_AGENT} open sessions, the most it may hold: close one (DELETE /mcp) or let one idle out (5 minutes)"
                        ),
                    );
                }
            },
            Some(id) if !served.sessions.sessions.read().await.contains_key(id) => {
                if crate::planted(crate::Plant::RemoteSharedSessions) {
                    service = self.anyones_session(id).await.unwrap_or(service);
                } else if method == axum::http::Method::DELETE {
                    return json_rpc_error(StatusCode::NOT_FOUND, "no such session");
                }
            }
            _ => {}
        }
        let res = service.handle(req).await.map(axum::body::Body::new);
        drop(opening);
        let mut res = as_json_error(res).await;
        // rmcp answers a session's end with 202 and no body; clients (the Python SDK among
        // them) expect 200 or 204 there and warn otherwise.
        if method == axum::http::Method::DELETE && res.status() == StatusCode::ACCEPTED {
            *res.status_mut() = StatusCode::NO_CONTENT;
        }
        res
    }

    /// The planted `remote_shared_sessions`: the service of whichever agent holds `id`.
    async fn anyones_session(
        &self,
        id: &rmcp::transport::streamable_http_server::SessionId,
    ) -> Option<AgentService> {
        let all: Vec<Served> = self
            .agents
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .map(|e| e.served.clone())
            .collect();
        for other in all {
            if other.sessions.sessions.read().await.contains_key(id) {
                return Some(other.service);
            }
        }
        None
    }
}
