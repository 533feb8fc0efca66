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
use crate::service::{Service, tokens::TokenRefusal};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use serde_json::json;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

type AgentService = StreamableHttpService<McpServer, LocalSessionManager>;

/// The remote MCP endpoint of one `serve`.
pub struct Remote {
    db: PathBuf,
    library: Option<PathBuf>,
    /// Looks tokens up (on the blocking pool).
    service: Arc<Mutex<Service>>,
    agents: Mutex<HashMap<String, AgentService>>,
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

/// A refusal before any MCP session: the HTTP status, and a JSON-RPC error (id null, as the
/// request was not read) that MCP clients show as the call's error.
fn refuse(status: StatusCode, message: &str) -> Response {
    let body = json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32001, "message": message}});
    let mut res = (status, axum::Json(body)).into_response();
    if status == StatusCode::UNAUTHORIZED {
        let value = if message.starts_with("give ") {
            "Bearer realm=\"handoffs\"".to_owned()
        } else {
            "Bearer realm=\"handoffs\", error=\"invalid_token\"".to_owned()
        };
        if let Ok(v) = HeaderValue::from_str(&value) {
            res.headers_mut().insert(header::WWW_AUTHENTICATE, v);
        }
    }
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

impl Remote {
    pub fn new(
        db: PathBuf,
        library: Option<PathBuf>,
        stop: tokio_util::sync::CancellationToken,
    ) -> Result<Remote, crate::service::ServiceError> {
        if let Some(dir) = &library
            && !dir.is_dir()
        {
            return Err(crate::service::ServiceError::Usage(format!(
                "--context-library {} is not a folder (create it first)",
                dir.display()
            )));
        }
        let service = Service::open(&db)?;
        Ok(Remote {
            db,
            library,
            service: Arc::new(Mutex::new(service)),
            agents: Mutex::new(HashMap::new()),
            stop,
        })
    }

    /// The rmcp service that serves `agent`'s sessions, made on first use.
    fn service_for(&self, agent: &str) -> AgentService {
        let mut agents = self
            .agents
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        agents
            .entry(agent.to_owned())
            .or_insert_with(|| {
                let (db, library, who) = (self.db.clone(), self.library.clone(), agent.to_owned());
                let config = StreamableHttpServerConfig::default()
                    .disable_allowed_hosts()
                    .with_cancellation_token(self.stop.child_token());
                StreamableHttpService::new(
                    move || {
                        McpServer::new(&db, &who, library.as_deref())
                            .map_err(|e| std::io::Error::other(e.to_string()))
                    },
                    Arc::new(LocalSessionManager::default()),
                    config,
                )
            })
            .clone()
    }

    /// Answers one request to `/mcp`: the token names the agent, then that agent's rmcp
    /// service answers.
    pub async fn handle(
        self: Arc<Self>,
        origin_allowed: bool,
        req: axum::extract::Request,
    ) -> Response {
        if !origin_allowed {
            return refuse(
                StatusCode::FORBIDDEN,
                "this server answers MCP only to its own origins (the Origin header names another host)",
            );
        }
        let Some(token) = bearer(req.headers()).map(str::to_owned) else {
            return refuse(
                StatusCode::UNAUTHORIZED,
                &TokenRefusal::Malformed.to_string(),
            );
        };
        let service = self.service.clone();
        let found = tokio::task::spawn_blocking(move || {
            service
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .agent_for_token(&token)
        })
        .await;
        let agent = match found {
            Ok(Ok(Ok(agent))) => agent,
            Ok(Ok(Err(refusal))) => {
                tracing::info!(%refusal, "remote MCP: token refused");
                return refuse(StatusCode::UNAUTHORIZED, &refusal.to_string());
            }
            Ok(Err(e)) => return refuse(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
            Err(e) => {
                return refuse(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    &format!("the token lookup failed: {e}"),
                );
            }
        };
        tracing::debug!(%agent, "remote MCP request");
        let ending = req.method() == axum::http::Method::DELETE;
        let service = self.service_for(&agent);
        let mut res = service.handle(req).await.map(axum::body::Body::new);
        // rmcp answers a session's end with 202 and no body; clients (the Python SDK among
        // them) expect 200 or 204 there and warn otherwise.
        if ending && res.status() == StatusCode::ACCEPTED {
            *res.status_mut() = StatusCode::NO_CONTENT;
        }
        res
    }
}
