//! The live page and the HTTP API (SPEC §6): axum on loopback.
//!
//! - One background thread owns a reader connection and rebuilds a **snapshot** (the status
//!   JSON and the Prometheus text) when the database changes (`data_version`, looked at every
//!   100 ms) or every 2 s (relative times, the engine's pulse). `/api/status`, `/metrics` and
//!   the server-sent-events stream serve that snapshot, so a request never touches SQLite and
//!   the cost of a status request does not grow with the number of deliveries.
//! - Writes (`POST /api/send`) and event queries go through one shared service connection on
//!   the blocking pool.
//! - Safety: a `Host` that is not loopback is refused (DNS rebinding) unless the public demo
//!   is on; a send needs `X-Handoffs-Token` equal to the token file (constant-time compare)
//!   and a JSON body under 1 MiB; every error is `{"error": "..."}` with its 4xx. The page
//!   puts message text into the DOM only as text, and is served with a CSP that runs only its
//!   own inline script (by hash).

mod render;

pub use render::build;
use render::plain_event;

use crate::service::status::{Attention, Board, ChainInFlight, median};
use crate::service::{DeliveryView, Service, ServiceError};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use model::StateKind;
use serde::Deserialize;
use serde_json::{Value, json};
use std::convert::Infallible;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// The page: one self-contained file, compiled into the binary.
pub const PAGE: &str = include_str!("../../web/page.html");
/// Largest request body: room for a message of 200,000 characters however JSON escapes them
/// (up to 12 bytes for a character outside the BMP written as `\uXXXX\uXXXX`).
pub const BODY_LIMIT: usize = 4 << 20;
/// Longest a request may take to arrive and be answered (the event stream excepted: its
/// response starts at once).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Shortest token the server accepts (init writes 64 hex digits).
const TOKEN_MIN: usize = 16;
const SNAPSHOT_POLL: Duration = Duration::from_millis(100);
const SNAPSHOT_REFRESH: Duration = Duration::from_secs(2);
const LIST_LIMIT: i64 = 50;
const TIMING_SAMPLES: i64 = 200;

/// The page's Content-Security-Policy: nothing from elsewhere, and only the page's own inline
/// script by its hash, so a handler or script smuggled into the DOM would not run either.
fn csp(page: &str) -> String {
    use base64::Engine as _;
    use sha2::Digest as _;
    let script = page
        .split_once("<script>")
        .and_then(|(_, rest)| rest.split_once("</script>"))
        .map_or("", |(s, _)| s);
    let hash = base64::engine::general_purpose::STANDARD.encode(sha2::Sha256::digest(script));
    format!(
        "default-src 'none'; script-src 'sha256-{hash}'; style-src 'unsafe-inline'; \
         connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
         frame-ancestors 'none'"
    )
}

/// How the server behaves.
#[derive(Clone, Debug, Default)]
pub struct WebOptions {
    /// Serve any Host, refuse sends, and show plain state sentences instead of adapter errors.
    pub public_demo: bool,
    /// Host names (or `name:port`) answered besides loopback (`serve --allow-host`).
    pub allowed_hosts: Vec<String>,
    /// Peer addresses whose connections count as this machine's for the page and its API,
    /// besides loopback (`--allow-peer`: the gateway a container's published port forwards
    /// from).
    pub allowed_peers: Vec<std::net::IpAddr>,
    /// Answer remote MCP at `/mcp` (off for the public demo, which answers any Host).
    pub remote_mcp: bool,
    /// The context library remote MCP sessions serve (`serve --context-library`).
    pub context_library: Option<std::path::PathBuf>,
}

impl WebOptions {
    /// True for a Host (or Origin host) this server answers to: loopback, or one allowed by
    /// name (with any port) or by `name:port`.
    pub fn host_allowed(&self, host: &str) -> bool {
        loopback_host(host) || self.remote_host(host)
    }

    /// True for a peer the page and its API answer: loopback, or an address given with
    /// `--allow-peer` (an IPv4 peer seen by an IPv6 socket compares as IPv4).
    pub fn local_peer(&self, ip: std::net::IpAddr) -> bool {
        let ip = ip.to_canonical();
        ip.is_loopback() || self.allowed_peers.iter().any(|a| a.to_canonical() == ip)
    }

    /// True for a Host named by `--allow-host` (an entry without a port matches any port,
    /// `name:port` only that port; names compare without case or a trailing dot).
    pub fn remote_host(&self, host: &str) -> bool {
        let (name, port) = split_authority(host);
        self.allowed_hosts.iter().any(|a| {
            let (a_name, a_port) = split_authority(a);
            a_name == name && (a_port.is_none() || a_port == port)
        })
    }
}

/// A `host[:port]` authority as (lower-cased name without a trailing dot, port). An IPv6
/// address keeps its brackets.
fn split_authority(host: &str) -> (String, Option<&str>) {
    let (name, port) = if host.starts_with('[') {
        match host.split_once(']') {
            Some((h, rest)) => (&host[..=h.len()], rest.strip_prefix(':')),
            None => (host, None),
        }
    } else {
        match host.rsplit_once(':') {
            // `name:` (an empty port, which RFC 3986 allows) is the name alone.
            Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => {
                (h, Some(p).filter(|p| !p.is_empty()))
            }
            _ => (host, None),
        }
    };
    (name.trim_end_matches('.').to_ascii_lowercase(), port)
}

/// Checks one `--allow-host` entry: a DNS name or an IP address (IPv6 in brackets), with an
/// optional port; no wildcards, paths, user parts or schemes.
pub fn check_allowed_host(entry: &str) -> Result<(), String> {
    let (name, port) = split_authority(entry);
    let bad = |why: &str| {
        Err(format!(
            "--allow-host {entry:?} is not a host name ({why}; give one name, or name:port, each time)"
        ))
    };
    if let Some(p) = port
        && p.parse::<u16>().is_err()
    {
        return bad("the port is not a number from 0 to 65535");
    }
    if let Some(inner) = name.strip_prefix('[') {
        return match inner
            .strip_suffix(']')
            .map(str::parse::<std::net::Ipv6Addr>)
        {
            Some(Ok(_)) => Ok(()),
            _ => bad("not an IPv6 address in brackets"),
        };
    }
    if name.contains(':') {
        return bad("an IPv6 address goes in brackets, e.g. [2001:db8::1]");
    }
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if name.is_empty() || name.len() > 253 || !name.split('.').all(label_ok) {
        return bad("letters, digits, hyphens and dots only; no wildcards");
    }
    Ok(())
}

/// The address a connection came from, as the server's listeners (plain or TLS) give it.
#[derive(Clone, Copy, Debug)]
pub struct Peer(pub std::net::SocketAddr);

/// The plain listener: TCP with `TCP_NODELAY` set on each connection ([`nodelay`]).
#[derive(Debug)]
pub struct PlainListener(pub tokio::net::TcpListener);

/// Sends small writes at once. Without it an event stream's answer (an MCP tool call's, sent
/// as several small writes) waits for the client's delayed ACK: 40 ms a call on Linux.
pub fn nodelay(stream: &mut tokio::net::TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "TCP_NODELAY not set");
    }
}

impl axum::serve::Listener for PlainListener {
    type Io = tokio::net::TcpStream;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.0.accept().await {
                Ok((mut stream, addr)) => {
                    nodelay(&mut stream);
                    return (stream, addr);
                }
                // The client gave up before it was accepted: nothing to wait for.
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::ConnectionReset
                    ) => {}
                Err(e) => {
                    // Out of file descriptors and the like: wait rather than spin.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.0.local_addr()
    }
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, PlainListener>>
    for Peer
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, PlainListener>) -> Self {
        Peer(*stream.remote_addr())
    }
}

impl
    axum::extract::connect_info::Connected<
        axum::serve::IncomingStream<'_, crate::front::tls::TlsListener>,
    > for Peer
{
    fn connect_info(
        stream: axum::serve::IncomingStream<'_, crate::front::tls::TlsListener>,
    ) -> Self {
        Peer(*stream.remote_addr())
    }
}

/// What a request from an `--allow-host` name may reach: remote MCP and the health check.
/// The page and its API answer loopback names only: they show every message and need no
/// token to read.
fn remote_route(path: &str) -> bool {
    path == "/mcp" || path == "/healthz" || crate::planted(crate::Plant::RemotePageOpen)
}

/// What the snapshot thread publishes.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub status: Bytes,
    /// A hash of what the status says, leaving out when it was made and the engine's pulse.
    pub content: u64,
    pub metrics: String,
    pub engine_alive: bool,
}

struct AppState {
    snapshot: watch::Receiver<Arc<Snapshot>>,
    service: Mutex<Service>,
    token: Vec<u8>,
    options: WebOptions,
    /// Ends the event streams when the server shuts down.
    stop: tokio_util::sync::CancellationToken,
    /// Remote MCP at `/mcp`, when on.
    remote: Option<Arc<crate::front::mcp::http::Remote>>,
}

/// A running snapshot thread; dropping it stops the thread.
#[derive(Debug)]
pub struct Snapshots {
    rx: watch::Receiver<Arc<Snapshot>>,
    stop: Arc<AtomicBool>,
}

impl Drop for Snapshots {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Starts the snapshot thread over the database at `db`.
pub fn snapshots(db: &Path, options: &WebOptions) -> Result<Snapshots, ServiceError> {
    let mut service = Service::open(db)?;
    let first = build(&mut service, options)?;
    let (tx, rx) = watch::channel(Arc::new(first));
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let options = options.clone();
    std::thread::Builder::new()
        .name("handoffs-snapshot".to_owned())
        .spawn(move || {
            let mut seen = service.data_version().unwrap_or(0);
            let mut built = Instant::now();
            let mut cost = Duration::ZERO;
            while !flag.load(Ordering::SeqCst) && !tx.is_closed() {
                std::thread::sleep(SNAPSHOT_POLL);
                let version = service.data_version().unwrap_or(seen);
                let since = built.elapsed();
                // Rebuilt on change, but never more often than five times its own cost (a
                // big database under a busy engine costs this thread at most a fifth of a
                // core), and every 2 s regardless.
                if (version == seen || since < cost * 5) && since < SNAPSHOT_REFRESH {
                    continue;
                }
                seen = version;
                built = Instant::now();
                let result = build(&mut service, &options);
                cost = built.elapsed();
                match result {
                    Ok(s) => {
                        let _ = tx.send(Arc::new(s));
                    }
                    Err(e) => tracing::warn!(error = %e, "status snapshot"),
                }
            }
        })
        .map_err(|e| ServiceError::Refused(format!("cannot start the status thread: {e}")))?;
    Ok(Snapshots { rx, stop })
}

/// The router over the database at `db`, fed by `snapshots`.
pub fn router(
    db: &Path,
    snapshots: &Snapshots,
    options: WebOptions,
    stop: tokio_util::sync::CancellationToken,
) -> Result<Router, ServiceError> {
    let service = Service::open(db)?;
    let token_file = crate::service::token_path(service.db_path());
    let token = std::fs::read_to_string(&token_file)
        .map(|t| t.trim().as_bytes().to_vec())
        .map_err(|e| {
            ServiceError::Refused(format!(
                "cannot read the token file {} (run `handoffs init`): {e}",
                token_file.display()
            ))
        })?;
    if token.len() < TOKEN_MIN {
        return Err(ServiceError::Refused(format!(
            "the token file {} is empty or too short: `handoffs init` writes a new one",
            token_file.display()
        )));
    }
    let remote = if options.remote_mcp && !options.public_demo {
        let remote = Arc::new(crate::front::mcp::http::Remote::new(
            service.db_path().to_owned(),
            options.context_library.clone(),
            stop.clone(),
        )?);
        let rt = tokio::runtime::Handle::try_current().map_err(|_| {
            ServiceError::Refused("remote MCP starts only inside the server's runtime".into())
        })?;
        rt.spawn(remote.clone().sweep());
        Some(remote)
    } else {
        None
    };
    let state = Arc::new(AppState {
        snapshot: snapshots.rx.clone(),
        service: Mutex::new(service),
        token,
        options,
        stop,
        remote,
    });
    let guarded = state.clone();
    Ok(Router::new()
        .route("/", get(page))
        .route("/api/status", get(status))
        .route("/api/events", get(events))
        .route("/api/trace", get(trace))
        .route("/api/stream", get(stream))
        .route("/api/send", post(send))
        .route("/api/spend", post(spend))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/mcp", axum::routing::any(mcp))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such page") })
        .method_not_allowed_fallback(|| async {
            error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed here")
        })
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            REQUEST_TIMEOUT,
        ))
        .layer(axum::middleware::from_fn(move |req, next| {
            host_check(guarded.clone(), req, next)
        }))
        // Outermost: a span per request (method, path) with its response and latency at
        // info level, refused Hosts and timeouts included; a 5xx is a warning.
        .layer(
            tower_http::trace::TraceLayer::new_for_http()
                .make_span_with(
                    tower_http::trace::DefaultMakeSpan::new().level(tracing::Level::INFO),
                )
                .on_response(
                    tower_http::trace::DefaultOnResponse::new().level(tracing::Level::INFO),
                )
                .on_failure(tower_http::trace::DefaultOnFailure::new().level(tracing::Level::WARN)),
        )
        .with_state(state))
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, axum::Json(json!({ "error": message.into() }))).into_response()
}

fn service_error(e: &ServiceError) -> Response {
    let status = match e {
        ServiceError::Usage(_) => StatusCode::BAD_REQUEST,
        ServiceError::NotFound(_) => StatusCode::NOT_FOUND,
        ServiceError::Refused(_) | ServiceError::Fenced(_) => StatusCode::CONFLICT,
        ServiceError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    error(status, e.to_string())
}

/// True for a `Host` header naming this machine: localhost, 127.0.0.0/8 or ::1, any port.
pub fn loopback_host(host: &str) -> bool {
    let (name, _) = split_authority(host);
    let name = name
        .strip_prefix('[')
        .map_or(name.as_str(), |n| n.strip_suffix(']').unwrap_or(n));
    name == "localhost"
        || name.ends_with(".localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

async fn host_check(
    state: Arc<AppState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if !state.options.public_demo && !crate::planted(crate::Plant::WebHost) {
        if req.headers().get_all(header::HOST).iter().count() > 1 {
            return error(StatusCode::BAD_REQUEST, "more than one Host header");
        }
        let host = req
            .headers()
            .get(header::HOST)
            .and_then(|h| h.to_str().ok());
        // An absolute request target names the host too, and wins over the header.
        let target = req
            .uri()
            .authority()
            .map(axum::http::uri::Authority::as_str);
        let named = target.or(host);
        // An --allow-host name reaches /mcp and /healthz; every other route is loopback's,
        // by the peer's address too (a client that is not a browser may send any Host). A
        // request without a peer address is one made in process.
        let remote_ok = remote_route(req.uri().path());
        let peer = req
            .extensions()
            .get::<axum::extract::ConnectInfo<Peer>>()
            .map(|c| c.0.0.ip());
        if !remote_ok
            && peer.is_some_and(|ip| !state.options.local_peer(ip))
            && !crate::planted(crate::Plant::RemotePageOpen)
        {
            return error(
                StatusCode::FORBIDDEN,
                "the page and its API answer only this machine (remote agents use /mcp)",
            );
        }
        let allowed = |h: &str| loopback_host(h) || (remote_ok && state.options.remote_host(h));
        if !named.is_some_and(allowed) || !host.is_none_or(allowed) {
            let remote = [named, host]
                .into_iter()
                .flatten()
                .any(|h| state.options.remote_host(h));
            return error(
                StatusCode::FORBIDDEN,
                if remote {
                    "an --allow-host name reaches only /mcp and /healthz; the page and its API answer on localhost"
                } else if state.options.allowed_hosts.is_empty() {
                    "this server answers only to localhost (the Host header is not loopback)"
                } else {
                    "this server answers only to localhost and its --allow-host names (the Host header is neither)"
                },
            );
        }
    }
    let mut res = next.run(req).await;
    let h = res.headers_mut();
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    res
}

/// `/mcp`: remote MCP for agents with a token (off in the public demo).
async fn mcp(State(state): State<Arc<AppState>>, req: axum::extract::Request) -> Response {
    let Some(remote) = state.remote.clone() else {
        return error(
            StatusCode::NOT_FOUND,
            "remote MCP is off here (only `handoffs serve` offers it, without --public-demo)",
        );
    };
    // A browser names the page that sent the request: it must be one of this server's hosts.
    let origin_allowed = req.headers().get_all(header::ORIGIN).iter().all(|o| {
        o.to_str().ok().is_some_and(|o| {
            o.split_once("://")
                .is_some_and(|(_, authority)| state.options.host_allowed(authority))
        })
    });
    remote.handle(origin_allowed, req).await
}

async fn page() -> Response {
    static POLICY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let (page, policy) = if crate::planted(crate::Plant::WebXss) {
        // The planted bug: message text reaches the DOM as HTML.
        let page = PAGE.replace(
            "document.createTextNode(String(k))",
            "(function(s){var t=document.createElement('span');t.innerHTML=s;return t})(String(k))",
        );
        let policy = csp(&page);
        (page, policy)
    } else {
        (PAGE.to_owned(), POLICY.get_or_init(|| csp(PAGE)).clone())
    };
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8".to_owned()),
            (header::CONTENT_SECURITY_POLICY, policy),
            (header::CACHE_CONTROL, "no-cache".to_owned()),
        ],
        page,
    )
        .into_response()
}

async fn status(State(s): State<Arc<AppState>>) -> Response {
    let body = s.snapshot.borrow().status.clone();
    (
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    let body = s.snapshot.borrow().metrics.clone();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

async fn healthz(State(s): State<Arc<AppState>>) -> Response {
    let alive = s.snapshot.borrow().engine_alive;
    axum::Json(json!({ "ok": true, "engine_alive": alive })).into_response()
}

/// Shortest gap between two events of one stream: a busy engine changes the database many
/// times a second, and a page that re-renders that often cannot be read.
const STREAM_GAP: Duration = Duration::from_secs(1);
/// An unchanged status is still sent this often (times on the page move on).
const STREAM_REFRESH: Duration = Duration::from_secs(15);

async fn stream(State(s): State<Arc<AppState>>) -> Response {
    struct Stream {
        rx: watch::Receiver<Arc<Snapshot>>,
        sent: Option<(u64, tokio::time::Instant)>,
    }
    let stop = s.stop.clone();
    let start = Stream {
        rx: s.snapshot.clone(),
        sent: None,
    };
    let events = futures_util::stream::unfold(start, move |mut st| {
        let stop = stop.clone();
        async move {
            loop {
                if let Some((content, at)) = st.sent {
                    tokio::select! {
                        () = stop.cancelled() => return None,
                        () = tokio::time::sleep_until(at + STREAM_GAP) => {}
                    }
                    let refresh = at + STREAM_REFRESH;
                    if st.rx.borrow_and_update().content == content {
                        tokio::select! {
                            () = stop.cancelled() => return None,
                            changed = st.rx.changed() => if changed.is_err() { return None; },
                            () = tokio::time::sleep_until(refresh) => {}
                        }
                        if st.rx.borrow_and_update().content == content
                            && tokio::time::Instant::now() < refresh
                        {
                            continue;
                        }
                    }
                }
                let snap = st.rx.borrow_and_update().clone();
                st.sent = Some((snap.content, tokio::time::Instant::now()));
                let data = String::from_utf8_lossy(&snap.status).into_owned();
                return Some((
                    Ok::<_, Infallible>(Event::default().event("status").data(data)),
                    st,
                ));
            }
        }
    });
    let mut res = Sse::new(events)
        .keep_alive(
            KeepAlive::new()
                .interval(Duration::from_secs(15))
                .text("ping"),
        )
        .into_response();
    res.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    res
}

fn query_param(raw: Option<&str>, key: &str) -> Option<String> {
    url::form_urlencoded::parse(raw.unwrap_or("").as_bytes())
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.into_owned())
}

/// The trace of one chain (`?chain=ID`, required) as `format` = mermaid (default, text),
/// jsonl or otel (JSON): what the page's chains link to.
async fn trace(State(s): State<Arc<AppState>>, RawQuery(q): RawQuery) -> Response {
    if s.options.public_demo {
        return error(StatusCode::NOT_FOUND, "the public demo shows no trace");
    }
    let Some(chain) = query_param(q.as_deref(), "chain") else {
        return error(StatusCode::BAD_REQUEST, "chain is required: ?chain=ID");
    };
    let format = query_param(q.as_deref(), "format").unwrap_or_else(|| "mermaid".to_owned());
    if !["mermaid", "jsonl", "otel"].contains(&format.as_str()) {
        return error(StatusCode::BAD_REQUEST, "format is mermaid, jsonl or otel");
    }
    let state = s.clone();
    let out = tokio::task::spawn_blocking(move || {
        let mut svc = state
            .service
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        svc.trace(Some(&chain), None, crate::service::trace::TRACE_LIMIT_MAX)
    })
    .await;
    match out {
        Ok(Ok(rows)) => {
            use crate::service::trace;
            let (kind, body) = match format.as_str() {
                "jsonl" => ("application/x-ndjson", trace::jsonl(&rows)),
                "otel" => (
                    "application/json",
                    serde_json::to_string(&trace::otel(&rows)).unwrap_or_default(),
                ),
                _ => ("text/plain; charset=utf-8", trace::mermaid(&rows)),
            };
            ([(header::CONTENT_TYPE, kind)], body).into_response()
        }
        Ok(Err(e)) => service_error(&e),
        Err(_) => error(StatusCode::INTERNAL_SERVER_ERROR, "the trace stopped"),
    }
}

async fn events(State(s): State<Arc<AppState>>, RawQuery(q): RawQuery) -> Response {
    let parse = |key: &str, default: i64, max: i64| -> Result<i64, String> {
        match query_param(q.as_deref(), key) {
            None => Ok(default),
            Some(v) => match v.parse::<i64>() {
                Ok(n) if (0..=max).contains(&n) => Ok(n),
                _ => Err(format!("{key} must be a whole number from 0 to {max}")),
            },
        }
    };
    let (after, limit) = match (parse("after", 0, i64::MAX), parse("limit", 500, 5_000)) {
        (Ok(_), Ok(0)) => {
            return error(StatusCode::BAD_REQUEST, "limit must be 1 to 5000");
        }
        (Ok(a), Ok(l)) => (a, l),
        (Err(m), _) | (_, Err(m)) => return error(StatusCode::BAD_REQUEST, m),
    };
    let state = s.clone();
    let out = tokio::task::spawn_blocking(move || {
        let mut svc = state
            .service
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        svc.events_after(after, limit)
    })
    .await;
    match out {
        Ok(Ok(events)) => {
            let mut list: Vec<Value> = events
                .iter()
                .map(|e| serde_json::to_value(e).unwrap_or(Value::Null))
                .collect();
            if s.options.public_demo {
                for e in &mut list {
                    e["detail"] = json!(plain_event(e["kind"].as_str().unwrap_or("")));
                }
            }
            let next = events.last().map_or(after, |e| e.seq);
            axum::Json(json!({ "events": list, "next_after": next })).into_response()
        }
        Ok(Err(e)) => service_error(&e),
        Err(_) => error(StatusCode::INTERNAL_SERVER_ERROR, "the query stopped"),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SpendBody {
    /// The agent whose turn spent it.
    agent: String,
    /// Unit → amount, e.g. {"tokens": 1200, "usd": 0.04}.
    units: std::collections::BTreeMap<String, f64>,
    /// The turn's request id (`HANDOFFS_REQUEST_ID`), naming the chain.
    request_id: Option<String>,
    /// Or a message of the chain the agent sent or received.
    parent: Option<String>,
}

/// `POST /api/spend`: a turn's spend from its chain's budget (SPEC §8.2), for a program that
/// reports its costs over HTTP. 200 with the chain, 409 when refused (the chain stopped).
async fn spend(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let req: SpendBody = match checked_body(&s, "spending", &headers, body) {
        Ok(r) => r,
        Err(refused) => return refused,
    };
    let units = match units_text(&req.units) {
        Ok(u) => u,
        Err(refused) => return refused,
    };
    let state = s.clone();
    let out = tokio::task::spawn_blocking(move || {
        let mut svc = state
            .service
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // A request id names a run of the agent's, or nothing: it never falls back to
        // whatever the agent happens to be working on.
        let lineage = crate::service::Lineage {
            parent: req.parent.clone(),
            request_id: req.request_id.clone(),
            ..Default::default()
        };
        svc.chain_spend(&req.agent, &units, &lineage)
    })
    .await;
    match out {
        Ok(Ok(spent)) => (StatusCode::OK, axum::Json(json!(spent))).into_response(),
        Ok(Err(e)) => service_error(&e),
        Err(_) => error(StatusCode::INTERNAL_SERVER_ERROR, "the spend stopped"),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SendBody {
    from: String,
    /// One agent, or several: a fan-out of work (SPEC §8.2), which needs a title.
    to: Recipients,
    message: String,
    /// Fan-out: `all` (the default) or `quorum:K`.
    join: Option<String>,
    /// Fan-out: joined at the latest this many minutes after the send (partial).
    deadline_minutes: Option<f64>,
    /// Fan-out: cancel the children still unanswered when it is joined.
    cancel_rest: Option<bool>,
    title: Option<String>,
    key: Option<String>,
    due_minutes: Option<i64>,
    /// The budget of the chain this send starts: unit → limit, e.g. {"hops": 6,
    /// "tokens": 200000} (`send --budget`).
    budget: Option<std::collections::BTreeMap<String, f64>>,
    /// Continue the chain of this message, which the sender sent or received (`--parent`).
    parent: Option<String>,
    /// The turn the send comes from (`HANDOFFS_REQUEST_ID`, or the `request_id` of the write
    /// an HTTP recipient received): its chain is continued. It names a turn of the sender's,
    /// or nothing: it never falls back to whatever the sender happens to be working on.
    request_id: Option<String>,
}

/// `to`: one agent, or a list (a fan-out).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Recipients {
    One(String),
    Many(Vec<String>),
}

/// Units as the service reads them (`tokens=1200,usd=0.04`), or the 400 that refuses them.
#[expect(
    clippy::result_large_err,
    reason = "the refusal is the handler's response itself, built once per refused request"
)]
fn units_text(units: &std::collections::BTreeMap<String, f64>) -> Result<String, Response> {
    model::chain::units_from_numbers(units.iter().map(|(u, n)| (u.as_str(), *n)))
        .map_err(|e| error(StatusCode::BAD_REQUEST, e))
}

/// A write's JSON body, once its token and content type are right: otherwise the response
/// that refuses it. `what` names the write for the public demo's refusal.
#[expect(
    clippy::result_large_err,
    reason = "the refusal is the handler's response itself, built once per refused request"
)]
fn checked_body<T: serde::de::DeserializeOwned>(
    s: &AppState,
    what: &str,
    headers: &HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<T, Response> {
    if s.options.public_demo {
        return Err(error(
            StatusCode::FORBIDDEN,
            format!("{what} is off in the public demo"),
        ));
    }
    let given = headers
        .get("x-handoffs-token")
        .map(HeaderValue::as_bytes)
        .unwrap_or_default();
    let same_len = given.len() == s.token.len();
    // Compared in constant time; the length of the token is not a secret.
    let equal: bool = if same_len {
        subtle::ConstantTimeEq::ct_eq(given, s.token.as_slice()).into()
    } else {
        false
    };
    if !equal && !crate::planted(crate::Plant::WebToken) {
        return Err(error(
            StatusCode::UNAUTHORIZED,
            "X-Handoffs-Token is missing or wrong (it is the content of the database's .token file)",
        ));
    }
    let json_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !json_type {
        return Err(error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "send a JSON body with Content-Type: application/json",
        ));
    }
    let bytes = match body {
        Ok(b) => b,
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return Err(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body is larger than {BODY_LIMIT} bytes"),
            ));
        }
        Err(e) => return Err(error(StatusCode::BAD_REQUEST, e.body_text())),
    };
    serde_json::from_slice(&bytes)
        .map_err(|e| error(StatusCode::BAD_REQUEST, format!("bad JSON body: {e}")))
}

async fn send(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let req: SendBody = match checked_body(&s, "sending", &headers, body) {
        Ok(r) => r,
        Err(refused) => return refused,
    };
    let budget = match req.budget.as_ref().map(units_text).transpose() {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    let plain = req.join.is_none() && req.deadline_minutes.is_none() && req.cancel_rest.is_none();
    let to = match &req.to {
        Recipients::One(one) if plain => one.clone(),
        Recipients::One(one) => {
            let many = vec![one.clone()];
            return fan_out(s, req.with_recipients(many), budget).await;
        }
        Recipients::Many(_) => return fan_out(s, req, budget).await,
    };
    let state = s.clone();
    let out = tokio::task::spawn_blocking(move || {
        let mut svc = state
            .service
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let lineage = crate::service::Lineage {
            budget,
            parent: req.parent.clone(),
            request_id: req.request_id.clone(),
            ..Default::default()
        };
        svc.send_as(
            &req.from,
            &to,
            &req.message,
            req.title.as_deref(),
            req.due_minutes,
            req.key.as_deref(),
            &lineage,
        )
    })
    .await;
    match out {
        Ok(Ok(sent)) => {
            let code = if sent.created {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            (
                code,
                axum::Json(json!({
                    "id": sent.message.id,
                    "created": sent.created,
                    "delivery_state": sent.delivery_state,
                    "chain_id": sent.message.chain_id,
                    "parent_id": sent.message.parent_id,
                    "hop": sent.message.hop,
                })),
            )
                .into_response()
        }
        Ok(Err(e)) => service_error(&e),
        Err(_) => error(StatusCode::INTERNAL_SERVER_ERROR, "the send stopped"),
    }
}

impl SendBody {
    fn with_recipients(mut self, to: Vec<String>) -> SendBody {
        self.to = Recipients::Many(to);
        self
    }
}

/// `POST /api/send` with several recipients (or a join): one fan-out of work.
async fn fan_out(s: Arc<AppState>, req: SendBody, budget: Option<String>) -> Response {
    let Recipients::Many(to) = req.to else {
        return error(
            StatusCode::BAD_REQUEST,
            "a fan-out names its agents in a list",
        );
    };
    let Some(title) = req.title else {
        return error(
            StatusCode::BAD_REQUEST,
            "a fan-out splits work: give it a title",
        );
    };
    let out = tokio::task::spawn_blocking(move || {
        let mut svc = s
            .service
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let lineage = crate::service::Lineage {
            budget,
            parent: req.parent.clone(),
            request_id: req.request_id.clone(),
            ..Default::default()
        };
        svc.fan_out(&crate::service::FanOut {
            from: &req.from,
            to: &to,
            body: &req.message,
            title: &title,
            join: req.join.as_deref(),
            deadline_minutes: req.deadline_minutes,
            cancel_rest: req.cancel_rest.unwrap_or(false),
            due_minutes: req.due_minutes,
            key: req.key.as_deref(),
            lineage: &lineage,
        })
    })
    .await;
    match out {
        Ok(Ok(done)) => {
            let code = if done.created {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            (
                code,
                axum::Json(json!({
                    "id": done.fanout.id,
                    "created": done.created,
                    "children": done.children.iter().map(|c| json!({
                        "id": c.message.id, "to": c.message.recipient,
                        "delivery_state": c.delivery_state,
                    })).collect::<Vec<_>>(),
                })),
            )
                .into_response()
        }
        Ok(Err(e)) => service_error(&e),
        Err(_) => error(StatusCode::INTERNAL_SERVER_ERROR, "the send stopped"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_host_entries_are_checked_and_matched_by_name_and_port() {
        for good in [
            "agents.example",
            "agents.example:8443",
            "10.0.0.7",
            "[2001:db8::1]:9",
            "a-b.c",
        ] {
            assert!(check_allowed_host(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "*.example",
            "2001:db8::1",
            "[zz]",
            "h:99999",
            "u@h",
            "a b",
            "-a.b",
            "a..b",
        ] {
            assert!(check_allowed_host(bad).is_err(), "{bad:?}");
        }
        let o = WebOptions {
            allowed_hosts: vec![
                "Agents.Example".into(),
                "pinned.example:8443".into(),
                "[::2]".into(),
            ],
            ..WebOptions::default()
        };
        for yes in [
            "agents.example",
            "agents.example:1",
            "AGENTS.example.:9",
            "pinned.example:8443",
            "[::2]:80",
        ] {
            assert!(o.remote_host(yes), "{yes}");
        }
        for no in [
            "pinned.example",
            "pinned.example:443",
            "other.example",
            "agents.example.evil",
            "[::3]",
        ] {
            assert!(!o.remote_host(no), "{no}");
        }
        assert!(o.host_allowed("localhost:1") && !o.remote_host("localhost:1"));
    }
}
