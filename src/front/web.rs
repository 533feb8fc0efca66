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

use crate::service::{DeliveryView, Service, ServiceError};
use crate::store::{Store, WorkRow, millis};
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
pub const PAGE: &str = include_str!("../web/page.html");
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
    let mut service = Service::new(Store::open(db)?);
    let first = build(&mut service, options)?;
    let (tx, rx) = watch::channel(Arc::new(first));
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let options = options.clone();
    std::thread::Builder::new()
        .name("handoffs-snapshot".to_owned())
        .spawn(move || {
            let mut seen = service.store.data_version().unwrap_or(0);
            let mut built = Instant::now();
            let mut cost = Duration::ZERO;
            while !flag.load(Ordering::SeqCst) && !tx.is_closed() {
                std::thread::sleep(SNAPSHOT_POLL);
                let version = service.store.data_version().unwrap_or(seen);
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
    let service = Service::new(Store::open(db)?);
    let token_file = crate::store::token_path(service.store.path());
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
    let state = Arc::new(AppState {
        snapshot: snapshots.rx.clone(),
        service: Mutex::new(service),
        token,
        options,
        stop,
    });
    let guarded = state.clone();
    Ok(Router::new()
        .route("/", get(page))
        .route("/api/status", get(status))
        .route("/api/events", get(events))
        .route("/api/stream", get(stream))
        .route("/api/send", post(send))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
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
        .with_state(state))
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, axum::Json(json!({ "error": message.into() }))).into_response()
}

fn service_error(e: &ServiceError) -> Response {
    let status = match e {
        ServiceError::Usage(_) => StatusCode::BAD_REQUEST,
        ServiceError::NotFound(_) => StatusCode::NOT_FOUND,
        ServiceError::Refused(_) => StatusCode::CONFLICT,
        ServiceError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    error(status, e.to_string())
}

/// True for a `Host` header naming this machine: localhost, 127.0.0.0/8 or ::1, any port.
pub fn loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        host.rsplit_once(':').map_or(host, |(h, port)| {
            if port.chars().all(|c| c.is_ascii_digit()) {
                h
            } else {
                host
            }
        })
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
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
        if !named.is_some_and(loopback_host) || !host.is_none_or(loopback_host) {
            return error(
                StatusCode::FORBIDDEN,
                "this server answers only to localhost (the Host header is not loopback)",
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
struct SendBody {
    from: String,
    to: String,
    message: String,
    title: Option<String>,
    key: Option<String>,
    due_minutes: Option<i64>,
}

async fn send(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    if s.options.public_demo {
        return error(StatusCode::FORBIDDEN, "sending is off in the public demo");
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
        return error(
            StatusCode::UNAUTHORIZED,
            "X-Handoffs-Token is missing or wrong (it is the content of the database's .token file)",
        );
    }
    let json_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !json_type {
        return error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "send a JSON body with Content-Type: application/json",
        );
    }
    let bytes = match body {
        Ok(b) => b,
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body is larger than {BODY_LIMIT} bytes"),
            );
        }
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    let req: SendBody = match serde_json::from_slice(&bytes) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("bad JSON body: {e}")),
    };
    let state = s.clone();
    let out = tokio::task::spawn_blocking(move || {
        let mut svc = state
            .service
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        svc.send(
            &req.from,
            &req.to,
            &req.message,
            req.title.as_deref(),
            req.due_minutes,
            req.key.as_deref(),
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
                })),
            )
                .into_response()
        }
        Ok(Err(e)) => service_error(&e),
        Err(_) => error(StatusCode::INTERNAL_SERVER_ERROR, "the send stopped"),
    }
}

// ----- the snapshot -----

/// Why a person should look, in plain words (the page shows the adapter's detail beside it,
/// outside the public demo).
fn attention_reason(d: &DeliveryView) -> String {
    match d.state {
        StateKind::Uncertain => format!(
            "Nobody can tell whether this reached {}; it will not be resent on its own. Check \
             their session, then release it (`handoffs release {}`).",
            d.to,
            &d.id[..d.id.len().min(8)]
        ),
        StateKind::Unavailable => format!("{} could not be reached; it will be retried.", d.to),
        StateKind::Held => format!(
            "Held: the connection {} → {} is blocked, or delivery is paused.",
            d.from, d.to
        ),
        StateKind::OwnerRejected => format!("{} refused the turn.", d.to),
        _ => format!("{} needs a look.", d.state.as_str()),
    }
}

fn plain_event(kind: &str) -> &'static str {
    match kind {
        "sent" => "a handoff was sent",
        "delivery" => "a delivery changed state",
        "work" => "work moved on",
        "read" => "a message was read",
        "release" => "a person released a delivery",
        "reminder" => "an overdue reminder was sent",
        _ => "something changed",
    }
}

fn preview(body: &str) -> String {
    let flat: String = body.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() > 140 {
        format!("{}…", flat.chars().take(140).collect::<String>())
    } else {
        flat
    }
}

fn plain_detail(state: StateKind) -> &'static str {
    match state {
        StateKind::Waiting => "queued for its turn",
        StateKind::Busy => "waiting for the recipient to finish its current turn",
        StateKind::Sending => "being written into the recipient's session",
        StateKind::Accepted | StateKind::Running => "the recipient is working on it",
        StateKind::Returned => "the recipient's turn finished",
        StateKind::Acknowledged => "done",
        StateKind::Cancelled => "released by a person",
        StateKind::Failed => "could not be delivered",
        StateKind::Duplicate => "the same message was already on its way",
        _ => "",
    }
}

fn median(v: &mut [i64]) -> Option<i64> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    Some(v[v.len() / 2])
}

/// Histogram buckets for delivery times, in seconds.
const BUCKETS_S: [f64; 9] = [
    1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3_600.0, 14_400.0, 86_400.0,
];

fn histogram(out: &mut String, name: &str, help: &str, samples_ms: &[i64]) {
    out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
    for b in BUCKETS_S {
        #[allow(clippy::cast_precision_loss)]
        let n = samples_ms
            .iter()
            .filter(|&&ms| (ms as f64) / 1000.0 <= b)
            .count();
        out.push_str(&format!("{name}_bucket{{le=\"{b}\"}} {n}\n"));
    }
    #[allow(clippy::cast_precision_loss)]
    // `+ 0.0`: an empty sum of floats is -0.0, which would print as "-0".
    let sum: f64 = samples_ms.iter().map(|&ms| ms as f64 / 1000.0).sum::<f64>() + 0.0;
    out.push_str(&format!(
        "{name}_bucket{{le=\"+Inf\"}} {n}\n{name}_sum {sum}\n{name}_count {n}\n",
        n = samples_ms.len()
    ));
}

/// What `build` reads in one transaction.
struct Read {
    queued: Vec<DeliveryView>,
    busy: Vec<(String, i64)>,
    unreachable: Vec<(String, i64)>,
    held: Vec<(String, i64)>,
    work_counts: crate::store::WorkCounts,
    open_work: Vec<WorkRow>,
    overdue_work: Vec<WorkRow>,
    timings: Vec<crate::store::WorkTimes>,
    totals: (i64, i64),
    last_seq: i64,
    bodies: std::collections::HashMap<String, String>,
}

/// Builds the status document and the metrics text in one read.
pub fn build(svc: &mut Service, options: &WebOptions) -> Result<Snapshot, ServiceError> {
    use StateKind::{
        Accepted, Busy, Held, OwnerRejected, Running, Sending, Unavailable, Uncertain, Waiting,
    };
    let public = options.public_demo;
    let now = millis(svc.now());
    let overview = svc.overview(LIST_LIMIT)?;
    let agents = svc.agents()?;
    let read = svc.store.read(|tx| {
        // Waiting and busy deliveries are in flight too: on their way, not yet written.
        let queued = overview.queued.clone();
        let busy = tx.count_by_recipient(&[Sending, Accepted, Running])?;
        let unreachable = tx.count_by_recipient(&[Unavailable])?;
        let held = tx.count_by_recipient(&[Held])?;
        let work_counts = tx.work_counts(now)?;
        let open_work = tx.newest_open_work(None, 100)?;
        let overdue_work = tx.newest_open_work(Some(now), LIST_LIMIT)?;
        // Every piece of work: the metrics' histograms count all of it (so they only grow),
        // the page's chart shows the newest.
        let timings = tx.work_timings(i64::MAX)?;
        let totals = tx.delivery_totals()?;
        let last_seq = tx.last_event_seq()?;
        let mut bodies = std::collections::HashMap::new();
        for d in overview
            .in_flight
            .iter()
            .chain(&queued)
            .chain(&overview.needs_attention)
            .chain(&overview.recent)
        {
            if let Some(m) = tx.message(&d.id)? {
                bodies.insert(d.id.clone(), preview(&m.body));
            }
        }
        Ok::<_, ServiceError>(Read {
            queued,
            busy,
            unreachable,
            held,
            work_counts,
            open_work,
            overdue_work,
            timings,
            totals,
            last_seq,
            bodies,
        })
    })?;
    let Read {
        queued,
        busy,
        unreachable,
        held,
        work_counts: (open_total, overdue_total, open_by_agent),
        open_work,
        overdue_work,
        timings,
        totals,
        last_seq,
        bodies,
    } = read;
    let delivery = |d: &DeliveryView, reason: bool| -> Value {
        let mut v = json!({
            "id": d.id, "from": d.from, "to": d.to, "title": d.title,
            "preview": bodies.get(&d.id).cloned().unwrap_or_default(),
            "state": d.state, "attempts": d.attempts,
            "detail": if public { plain_detail(d.state).to_owned() } else { d.detail.clone() },
            "enrolled_at": d.enrolled_at, "updated_at": d.updated_at,
        });
        if reason {
            v["reason"] = json!(attention_reason(d));
        }
        v
    };
    let overdue = |w: &WorkRow| w.due_at.is_some_and(|d| d <= now) && w.state.is_open();
    let mut needs: Vec<Value> = overview
        .needs_attention
        .iter()
        .map(|d| delivery(d, true))
        .collect();
    for w in &overdue_work {
        let late = (now - w.due_at.unwrap_or(now)) / 60_000;
        let since = if late < 1 {
            "is now overdue".to_owned()
        } else {
            format!("was due {late} min ago")
        };
        needs.push(json!({
            "id": w.id, "from": w.sender, "to": w.recipient, "title": w.title,
            "preview": "", "state": "OVERDUE", "attempts": 0, "detail": "",
            "reason": format!("Work \"{}\" for {} {since} and is still {}.",
                w.title, w.recipient, w.state),
            "enrolled_at": w.created_at, "updated_at": w.updated_at,
        }));
    }
    let mut send_to_accept: Vec<i64> = Vec::new();
    let mut accept_to_return: Vec<i64> = Vec::new();
    // Oldest first, so the newest samples are last.
    for (sent, accepted, returned) in timings.iter().rev() {
        if let Some(a) = accepted {
            send_to_accept.push(a - sent);
            if let Some(r) = returned {
                accept_to_return.push(r - a);
            }
        }
    }
    let engine_alive = crate::service::engine_alive(
        overview.engine_reported_at.zip(overview.engine.as_ref()),
        now,
    );
    let counts: serde_json::Map<String, Value> = overview
        .counts
        .iter()
        .map(|(k, n)| (k.clone(), json!(n)))
        .collect();
    let agent_list: Vec<Value> = agents
        .iter()
        .map(|a| {
            let of = |list: &[(String, i64)]| {
                list.iter().find(|(r, _)| r == &a.id).map_or(0, |(_, n)| *n)
            };
            let in_flight = of(&busy);
            let state = if of(&unreachable) > 0 {
                "unreachable"
            } else if of(&held) > 0 {
                "held"
            } else if in_flight > 0 {
                "busy"
            } else {
                "idle"
            };
            json!({
                "id": a.id, "name": a.name, "provider": a.provider,
                "in_flight": in_flight, "open_work": of(&open_by_agent),
                "state": state,
            })
        })
        .collect();
    let count_of = |states: &[StateKind]| -> i64 {
        overview
            .counts
            .iter()
            .filter(|(k, _)| states.iter().any(|s| s.as_str() == k))
            .map(|(_, n)| n)
            .sum()
    };
    let tail = |v: &[i64]| -> Vec<i64> {
        let n = usize::try_from(TIMING_SAMPLES).unwrap_or(200);
        v[v.len().saturating_sub(n)..].to_vec()
    };
    let status = json!({
        "generated_at": now,
        "public_demo": public,
        "can_send": !public,
        "engine": {
            "alive": engine_alive,
            "reported_at": overview.engine_reported_at,
            "report": if public { Value::Null } else { overview.engine.clone().unwrap_or(Value::Null) },
        },
        "counts": counts,
        "in_flight": overview.in_flight.iter().chain(&queued).map(|d| delivery(d, false)).collect::<Vec<_>>(),
        "needs_attention": needs,
        "recent": overview.recent.iter().map(|d| delivery(d, false)).collect::<Vec<_>>(),
        "agents": agent_list,
        "totals": {
            "in_flight": count_of(&[Waiting, Busy, Sending, Accepted, Running]),
            "needs_attention": count_of(&[Uncertain, Unavailable, Held, OwnerRejected]) + overdue_total,
            "open_work": open_total,
            "overdue": overdue_total,
        },
        "open_work": open_work.iter().map(|w| json!({
            "id": w.id, "sender": w.sender, "recipient": w.recipient, "title": w.title,
            "state": w.state, "due_at": w.due_at, "overdue": overdue(w),
            "summary": w.summary, "created_at": w.created_at, "updated_at": w.updated_at,
        })).collect::<Vec<_>>(),
        "timings": {
            "send_to_accept_ms": tail(&send_to_accept),
            "accept_to_return_ms": tail(&accept_to_return),
            "send_to_accept_p50_ms": median(&mut send_to_accept.clone()),
            "accept_to_return_p50_ms": median(&mut accept_to_return.clone()),
        },
        "last_event_id": last_seq,
    });
    let mut m = String::new();
    m.push_str(
        "# HELP handoffs_deliveries Deliveries by state.\n# TYPE handoffs_deliveries gauge\n",
    );
    for (state, n) in &overview.counts {
        m.push_str(&format!("handoffs_deliveries{{state=\"{state}\"}} {n}\n"));
    }
    m.push_str(&format!(
        "# HELP handoffs_delivery_attempts_total Writes into recipients' sessions, over all deliveries.\n\
         # TYPE handoffs_delivery_attempts_total counter\nhandoffs_delivery_attempts_total {}\n\
         # HELP handoffs_delivery_resends_total Bounded resends (after an error or an interrupted turn).\n\
         # TYPE handoffs_delivery_resends_total counter\nhandoffs_delivery_resends_total {}\n",
        totals.0, totals.1
    ));
    m.push_str(&format!(
        "# HELP handoffs_open_work Work not yet closed.\n# TYPE handoffs_open_work gauge\nhandoffs_open_work {open_total}\n"
    ));
    histogram(
        &mut m,
        "handoffs_send_to_accept_seconds",
        "Time from sending work to its acceptance.",
        &send_to_accept,
    );
    histogram(
        &mut m,
        "handoffs_accept_to_return_seconds",
        "Time from accepting work to returning it.",
        &accept_to_return,
    );
    let pass_ms = overview
        .engine
        .as_ref()
        .and_then(|r| r.get("pass_ms_max"))
        .and_then(Value::as_f64);
    m.push_str("# HELP handoffs_engine_pass_duration_seconds The longest engine pass (housekeeping, the due query, starting jobs) in its last report.\n# TYPE handoffs_engine_pass_duration_seconds gauge\n");
    m.push_str(&format!(
        "handoffs_engine_pass_duration_seconds {}\n",
        pass_ms.map_or("NaN".to_owned(), |ms| (ms / 1000.0).to_string())
    ));
    m.push_str(&format!(
        "# HELP handoffs_engine_up Whether an engine reported in the last 2 minutes.\n# TYPE handoffs_engine_up gauge\nhandoffs_engine_up {}\n",
        u8::from(engine_alive)
    ));
    let content = {
        use std::hash::{Hash as _, Hasher as _};
        let mut steady = status.clone();
        steady["generated_at"] = Value::Null;
        steady["engine"] = json!({ "alive": engine_alive });
        let mut h = std::collections::hash_map::DefaultHasher::new();
        steady.to_string().hash(&mut h);
        h.finish()
    };
    Ok(Snapshot {
        content,
        status: Bytes::from(serde_json::to_vec(&status).unwrap_or_default()),
        metrics: m,
        engine_alive,
    })
}
