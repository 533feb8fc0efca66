//! `handoffs serve` (the engine and the live page over one database) and `handoffs demo` (the
//! same over a temporary database with four simulated agents handing work around).
//!
//! The engine runs on its own thread (it is a single-threaded, `!Send` loop over one SQLite
//! connection); the page runs on a small multi-threaded runtime. Ctrl+C stops both: the
//! engine gets its usual grace for running jobs, and the demo deletes its data.

use crate::engine::{Engine, EngineError};
use crate::front::web::{self, WebOptions};
use crate::service::{Outcome, Service, ServiceError};
use serde_json::json;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How `serve` or `demo` ended.
#[derive(Debug)]
pub enum Ended {
    /// Ctrl+C.
    Interrupted,
}

fn refused(m: impl Into<String>) -> ServiceError {
    ServiceError::Refused(m.into())
}

/// Why the engine stopped on its own, if it did.
type Failure = Arc<Mutex<Option<String>>>;

/// How `serve` or `demo` ended: the server's own failure, else the engine's, else a signal.
fn ended(result: Result<(), ServiceError>, failure: &Failure) -> Result<Ended, ServiceError> {
    result?;
    match failure
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take()
    {
        Some(e) => Err(refused(e)),
        None => Ok(Ended::Interrupted),
    }
}

/// Starts the engine on its own thread (it is built there: it is not `Send`); it stops when
/// `stop` is cancelled. `None` when another engine already delivers for this database. An
/// engine on SQLite that stops on its own (its database gone) records why in `failure` and
/// stops the rest too; one on PostgreSQL starts again on a new session instead, as `run` does
/// (`engine::restarts`), while the page goes on.
fn engine_thread(
    db: &Path,
    policy: Option<model::Policy>,
    stop: CancellationToken,
    failure: Failure,
) -> Result<Option<std::thread::JoinHandle<()>>, ServiceError> {
    let lease_ms = crate::service::leases::lease_ms_from_env().map_err(ServiceError::Usage)?;
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<bool, ServiceError>>();
    let db = db.to_owned();
    let handle = std::thread::Builder::new()
        .name("handoffs-engine".to_owned())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(refused(format!("the engine cannot start: {e}"))));
                    return;
                }
            };
            let start = || {
                Service::open(&db)
                    .map_err(ServiceError::from)
                    .and_then(|service| match Engine::new(service, false) {
                        Ok(e) => Ok(Some(e.with_lease_ms(lease_ms))),
                        Err(EngineError::Busy) => Ok(None),
                        Err(e) => Err(refused(e.to_string())),
                    })
                    .map(|engine| {
                        engine.map(|e| match policy.clone() {
                            Some(p) => e.with_policy(p),
                            None => e,
                        })
                    })
            };
            let mut engine = match start() {
                Ok(Some(e)) => e,
                Ok(None) => {
                    let _ = ready_tx.send(Ok(false));
                    return;
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let _ = ready_tx.send(Ok(true));
            let again = crate::service::is_postgres_url(&db);
            let mut restarts = crate::engine::restarts::Restarts::default();
            loop {
                let started = std::time::Instant::now();
                let ran =
                    rt.block_on(engine.run(Duration::from_secs(5), stop.clone().cancelled_owned()));
                let failed = match ran {
                    Ok(()) => return,
                    Err(e) if !again => {
                        *failure
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e);
                        stop.cancel();
                        return;
                    }
                    // Stopped (Ctrl+C) while its last flush failed: nothing starts again.
                    Err(_) if stop.is_cancelled() => return,
                    Err(e) => e,
                };
                drop(engine);
                // A failed start after the pause counts as a failure right after a start, so
                // a server that stays away is retried at a growing pause, not every second.
                let (mut said, mut ran) = (failed, started.elapsed());
                engine = loop {
                    let pause = restarts.after(ran);
                    ran = Duration::ZERO;
                    eprintln!(
                        "handoffs: {said}; the engine starts again on a new session in {} s",
                        pause.as_secs()
                    );
                    let stopped = rt.block_on(async {
                        tokio::select! {
                            () = stop.cancelled() => true,
                            () = tokio::time::sleep(pause) => false,
                        }
                    });
                    if stopped {
                        return;
                    }
                    match start() {
                        Ok(Some(e)) => break e,
                        Ok(None) => "another engine holds this database".clone_into(&mut said),
                        Err(e) => said = e.to_string(),
                    }
                };
            }
        })
        .map_err(|e| refused(format!("cannot start the engine: {e}")))?;
    match ready_rx.recv() {
        Ok(Ok(true)) => Ok(Some(handle)),
        Ok(Ok(false)) => {
            let _ = handle.join();
            eprintln!(
                "handoffs: another engine is delivering for this database; this page only shows what it does"
            );
            Ok(None)
        }
        Ok(Err(e)) => {
            let _ = handle.join();
            Err(e)
        }
        Err(_) => Err(refused("the engine thread ended before it started")),
    }
}

fn web_runtime() -> Result<tokio::runtime::Runtime, ServiceError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| refused(format!("cannot start the runtime: {e}")))
}

fn token_of(db: &Path) -> String {
    std::fs::read_to_string(crate::service::token_path(db))
        .map(|t| t.trim().to_owned())
        .unwrap_or_default()
}

fn warn_if_public(
    host: &str,
    public_demo: bool,
    allow_hosts: bool,
    https: bool,
    allowed_peers: &[std::net::IpAddr],
) {
    let loopback = host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if !loopback && !public_demo {
        if allow_hosts {
            let clear = if https {
                ""
            } else {
                "; without --tls-cert/--tls-key the agents' tokens cross the network in clear \
                 text unless a TLS proxy is in front (docs/MCP.md)"
            };
            eprintln!(
                "handoffs: warning: listening on {host}: /mcp is reachable from the network under \
                 the --allow-host names, for agents with a token (the page stays on localhost){clear}"
            );
        } else {
            eprintln!(
                "handoffs: warning: listening on {host}: other machines reach only /healthz (the \
                 page answers this machine; remote agents need --allow-host NAME for /mcp)"
            );
        }
    }
    if !allowed_peers.is_empty() {
        let peers: Vec<String> = allowed_peers.iter().map(ToString::to_string).collect();
        eprintln!(
            "handoffs: the page and its API answer connections from {} as this machine's \
             (--allow-peer): publish the port on this machine's loopback only",
            peers.join(", ")
        );
    }
}

/// The port when none is given; if it is taken, a free one is used instead.
pub const DEFAULT_PORT: u16 = 8765;
/// The exit code the signal that stopped the server asks for (128 + its number: 130 for
/// Ctrl+C, 143 for SIGTERM, 129 for SIGHUP), as a shell reports a process it killed.
static STOPPED_BY: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(130);

/// The exit code for the way `serve` or `demo` was stopped.
pub fn stop_code() -> u8 {
    STOPPED_BY.load(std::sync::atomic::Ordering::Relaxed)
}

/// Waits for Ctrl+C or SIGTERM, and SIGHUP when `hangup` (`serve` and `demo` belong to a
/// terminal; `run` may be started with `nohup` and must outlive it); returns the exit code
/// that says which (130, 143, 129).
pub async fn stop_signal(hangup: bool) -> u8 {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            // Taken either way: once tokio handles SIGHUP, a hang-up no longer kills the
            // process; only `hangup` makes it a reason to stop.
            let mut hup = signal(SignalKind::hangup()).ok().filter(|_| hangup);
            let hung_up = async {
                match hup.as_mut() {
                    Some(h) => h.recv().await,
                    None => std::future::pending().await,
                }
            };
            return tokio::select! {
                _ = tokio::signal::ctrl_c() => 130,
                _ = term.recv() => 143,
                _ = hung_up => 129,
            };
        }
    }
    let _ = tokio::signal::ctrl_c().await;
    130
}

/// How long open connections get to finish once the server is asked to stop.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);

/// Where and how the page listens.
struct Listen<'a> {
    host: &'a str,
    port: Option<u16>,
    /// HTTPS with this configuration (`serve --tls-cert/--tls-key`).
    tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
}

/// Binds, builds the page, then starts the engine (`start`) so that nothing is delivered by a
/// server that could not start, announces the address, and serves until Ctrl+C, SIGTERM,
/// SIGHUP or `stop`. Returns the engine's thread.
fn run_web(
    db: &Path,
    Listen { host, port, tls }: Listen<'_>,
    options: WebOptions,
    stop: &CancellationToken,
    start: impl FnOnce() -> Result<Option<std::thread::JoinHandle<()>>, ServiceError>,
    announce: impl FnOnce(std::net::SocketAddr),
) -> (
    Option<std::thread::JoinHandle<()>>,
    Result<(), ServiceError>,
) {
    let rt = match web_runtime() {
        Ok(rt) => rt,
        Err(e) => return (None, Err(e)),
    };
    let signals = stop.clone();
    rt.spawn(async move {
        STOPPED_BY.store(
            stop_signal(true).await,
            std::sync::atomic::Ordering::Relaxed,
        );
        signals.cancel();
    });
    let db = db.to_owned();
    let host = host.to_owned();
    let s = stop.clone();
    let mut engine = None;
    let out =
        rt.block_on(async {
            let listener =
                match tokio::net::TcpListener::bind((host.as_str(), port.unwrap_or(DEFAULT_PORT)))
                    .await
                {
                    Ok(l) => l,
                    Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && port.is_none() => {
                        eprintln!("handoffs: port {DEFAULT_PORT} is in use; using a free one");
                        tokio::net::TcpListener::bind((host.as_str(), 0))
                            .await
                            .map_err(|e| refused(format!("cannot listen on {host}: {e}")))?
                    }
                    Err(e) => {
                        return Err(refused(format!(
                            "cannot listen on {host}:{}: {e}",
                            port.unwrap_or(DEFAULT_PORT)
                        )));
                    }
                };
            let addr = listener.local_addr().map_err(|e| refused(e.to_string()))?;
            let snaps = web::snapshots(&db, &options)?;
            let app = web::router(&db, &snaps, options, s.clone())?;
            engine = start()?;
            announce(addr);
            match tls {
                Some(config) => {
                    let listener = crate::front::tls::TlsListener::new(listener, config, s.clone())
                        .map_err(|e| refused(e.to_string()))?;
                    serve_until(listener, app, &s).await?;
                }
                None => serve_until(web::PlainListener(listener), app, &s).await?,
            }
            drop(snaps);
            Ok(())
        });
    stop.cancel();
    rt.shutdown_timeout(Duration::from_secs(1));
    (engine, out)
}

/// Serves `app` on `listener` until `stop`, then gives open connections `SHUTDOWN_GRACE`.
async fn serve_until<L>(
    listener: L,
    app: axum::Router,
    stop: &CancellationToken,
) -> Result<(), ServiceError>
where
    L: axum::serve::Listener<Addr = std::net::SocketAddr>,
    web::Peer: for<'a> axum::extract::connect_info::Connected<axum::serve::IncomingStream<'a, L>>,
{
    let app = app.into_make_service_with_connect_info::<web::Peer>();
    let server = axum::serve(listener, app).with_graceful_shutdown({
        let s = stop.clone();
        async move { s.cancelled().await }
    });
    // A client that never finishes its request must not keep the server from stopping.
    let forced = async {
        stop.cancelled().await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        served = server => served.map_err(|e| refused(format!("the web server stopped: {e}")))?,
        () = forced => {}
    }
    Ok(())
}

/// Prints the start-up lines in one write: a reader that takes the first line and closes
/// the pipe (`serve | head -1`) must not make a later line fail, and nothing here may panic.
fn announce_lines(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes());
    let _ = out.flush();
}

fn url_for(addr: std::net::SocketAddr, token: Option<&str>, https: bool) -> String {
    let host = if addr.ip().is_unspecified() {
        "127.0.0.1".to_owned()
    } else if addr.is_ipv6() {
        format!("[{}]", addr.ip())
    } else {
        addr.ip().to_string()
    };
    let scheme = if https { "https" } else { "http" };
    match token {
        Some(t) => format!("{scheme}://{host}:{}/#token={t}", addr.port()),
        None => format!("{scheme}://{host}:{}/", addr.port()),
    }
}

/// `handoffs serve`: the engine and the page over `db`, until Ctrl+C (or SIGTERM, SIGHUP).
pub fn serve(
    db: &Path,
    host: &str,
    port: Option<u16>,
    options: WebOptions,
    tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
    policy: Option<model::Policy>,
) -> Result<Ended, ServiceError> {
    for entry in &options.allowed_hosts {
        web::check_allowed_host(entry).map_err(ServiceError::Usage)?;
    }
    let https = tls.is_some();
    let public_demo = options.public_demo;
    let allow_hosts = !options.allowed_hosts.is_empty();
    let peers = options.allowed_peers.clone();
    Service::open(db)?;
    let stop = CancellationToken::new();
    let failure: Failure = Arc::default();
    let token = token_of(db);
    let (engine, result) = run_web(
        db,
        Listen { host, port, tls },
        options,
        &stop,
        || engine_thread(db, policy, stop.clone(), failure.clone()),
        |addr| {
            warn_if_public(host, public_demo, allow_hosts, https, &peers);
            if public_demo {
                eprintln!(
                    "handoffs: warning: --public-demo on a real database shows its handoffs to \
                     anyone who can reach this address, under any host name"
                );
            }
            let url = url_for(addr, (!public_demo).then_some(token.as_str()), https);
            let mut said = format!("handoffs: serving {url}\n");
            if !public_demo {
                let base = url_for(addr, None, https);
                said.push_str(&format!(
                    "handoffs: remote MCP at {base}mcp (each agent with its token: handoffs agent token ID)\n"
                ));
            }
            announce_lines(&said);
        },
    );
    stop.cancel();
    if let Some(h) = engine {
        let _ = h.join();
    }
    ended(result, &failure)
}

// ----- the demo -----

const AGENTS: [(&str, &str); 4] = [
    ("planner", "Planner"),
    ("engineer", "Engineer"),
    ("reviewer", "Reviewer"),
    ("writer", "Writer"),
];

const TOPICS: [&str; 12] = [
    "login rate limiting",
    "CSV export",
    "dark mode",
    "search by tag",
    "password reset email",
    "audit log",
    "faster cold start",
    "webhooks retry",
    "team invitations",
    "billing page",
    "offline drafts",
    "API pagination",
];

/// The next step of a topic after `from` → `to` work closes: who gives what to whom.
fn next_step(to: &str, topic: &str) -> (String, String, String) {
    match to {
        "engineer" => (
            "engineer".into(),
            "reviewer".into(),
            format!("Review: {topic}"),
        ),
        "reviewer" => (
            "reviewer".into(),
            "writer".into(),
            format!("Release notes: {topic}"),
        ),
        "writer" => (
            "writer".into(),
            "planner".into(),
            format!("Plan the follow-up to {topic}"),
        ),
        _ => (
            "planner".into(),
            "engineer".into(),
            format!("Build: {topic}"),
        ),
    }
}

fn topic_of(title: &str) -> String {
    title
        .split_once(": ")
        .map(|(_, t)| t)
        .or_else(|| title.strip_prefix("Plan the follow-up to "))
        .unwrap_or(title)
        .to_owned()
}

/// One round of the demo's people: close returned work, pass each topic on, keep a few
/// topics going. Returns how many things it did.
fn demo_round(svc: &mut Service, next_topic: &mut usize) -> Result<usize, ServiceError> {
    let work = svc.open_work(1_000)?;
    let mut did = 0;
    for w in work.iter().filter(|w| w.state.is_returned()) {
        let outcome = if w.state == model::work::WorkState::Blocked {
            Outcome::Blocked
        } else {
            Outcome::Accepted
        };
        svc.close(&w.id, &w.sender, outcome, Some("thanks, looks good"))?;
        did += 1;
        let topic = topic_of(&w.title);
        let (from, to, title) = if w.recipient == "planner" {
            // The chain is complete: the planner starts a new topic.
            let t = TOPICS[*next_topic % TOPICS.len()];
            *next_topic += 1;
            next_step("planner", t)
        } else {
            next_step(&w.recipient, &topic)
        };
        let body = format!(
            "{title}. Context: this continues \"{}\" ({} finished it). Please return it with a short summary.",
            w.title, w.recipient
        );
        svc.send(&from, &to, &body, Some(&title), Some(30), None)?;
        did += 1;
    }
    let open = work.iter().filter(|w| w.state.is_open()).count();
    if open < 3 {
        let t = TOPICS[*next_topic % TOPICS.len()];
        *next_topic += 1;
        let (from, to, title) = next_step("planner", t);
        svc.send(
            &from,
            &to,
            &format!("{title}. Acceptance: tests pass and the reviewer signs off."),
            Some(&title),
            Some(20),
            None,
        )?;
        did += 1;
    }
    Ok(did)
}

/// `handoffs demo`: a temporary database, four demo agents, the engine, the page, and a driver
/// that plays the people. Ctrl+C stops everything and deletes the data. With `shared` (a
/// PostgreSQL database) the team plays there instead, created if need be and kept: engines
/// of other machines deliver beside the demo's own.
/// `demo --speed`: a usage error outside its bounds.
pub fn check_speed(speed: f64) -> Result<(), ServiceError> {
    if (SPEED_MIN..=SPEED_MAX).contains(&speed) {
        Ok(())
    } else {
        Err(ServiceError::Usage(format!(
            "--speed must be {SPEED_MIN} to {SPEED_MAX}"
        )))
    }
}

pub fn demo(
    host: &str,
    port: Option<u16>,
    speed: f64,
    public_demo: bool,
    allowed_peers: &[std::net::IpAddr],
    shared: Option<&Path>,
) -> Result<Ended, ServiceError> {
    check_speed(speed)?;
    let dir = tempfile::Builder::new()
        .prefix("handoffs-demo-")
        .tempdir()
        .map_err(|e| refused(format!("cannot make a temporary folder: {e}")))?;
    let db: PathBuf = shared.map_or_else(|| dir.path().join("demo.sqlite3"), Path::to_owned);
    let (mut svc, _) = Service::init(&db)?;
    for (i, (id, name)) in AGENTS.iter().enumerate() {
        // Turns of 4 to 7 seconds at speed 1, so the page shows work in every state.
        #[allow(clippy::cast_precision_loss)]
        let turn = 4.0 + i as f64;
        let settings = vec![
            ("turn_seconds".to_owned(), json!(turn)),
            ("speed".to_owned(), json!(speed)),
        ];
        svc.add_agent(id, Some("demo"), Some(name), None, None, &settings)?;
    }
    let stop = CancellationToken::new();
    let failure: Failure = Arc::default();
    let driver_stop = stop.clone();
    let every = Duration::from_secs_f64((1.5 / speed).clamp(0.05, 10.0));
    let token = token_of(&db);
    let mut driver = None;
    let (engine, result) = run_web(
        &db,
        Listen {
            host,
            port,
            tls: None,
        },
        WebOptions {
            public_demo,
            allowed_peers: allowed_peers.to_vec(),
            ..WebOptions::default()
        },
        &stop,
        || {
            let engine = engine_thread(&db, None, stop.clone(), failure.clone())?;
            driver = Some(
                std::thread::Builder::new()
                    .name("handoffs-demo".to_owned())
                    .spawn(move || {
                        let mut next_topic = 0;
                        while !driver_stop.is_cancelled() {
                            if let Err(e) = demo_round(&mut svc, &mut next_topic) {
                                tracing::debug!(error = %e, "demo round");
                            }
                            std::thread::sleep(every);
                        }
                    })
                    .map_err(|e| refused(format!("cannot start the demo: {e}")))?,
            );
            Ok(engine)
        },
        |addr| {
            warn_if_public(host, public_demo, false, false, allowed_peers);
            let url = url_for(addr, (!public_demo).then_some(token.as_str()), false);
            let end = if shared.is_some() {
                "Ctrl+C stops the demo; its team and their work stay in the database"
            } else {
                "Ctrl+C stops the demo and deletes its data"
            };
            announce_lines(&format!(
                "handoffs demo: open {url}\nfour demo agents (Planner, Engineer, Reviewer, Writer) are handing work around; {end}\n"
            ));
        },
    );
    stop.cancel();
    if let Some(d) = driver {
        let _ = d.join();
    }
    if let Some(h) = engine {
        let _ = h.join();
    }
    drop(dir);
    ended(result, &failure)
}

/// The demo's speed range: 1 is turns of 4 to 7 seconds.
pub const SPEED_MIN: f64 = 0.05;
pub const SPEED_MAX: f64 = 100.0;
