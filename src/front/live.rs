//! `handoffs serve` (the engine and the live page over one database) and `handoffs demo` (the
//! same over a temporary database with four simulated agents handing work around).
//!
//! The engine runs on its own thread (it is a single-threaded, `!Send` loop over one SQLite
//! connection); the page runs on a small multi-threaded runtime. Ctrl+C stops both: the
//! engine gets its usual grace for running jobs, and the demo deletes its data.

use crate::engine::{Engine, EngineError};
use crate::front::web::{self, WebOptions};
use crate::service::{Outcome, Service, ServiceError};
use crate::store::Store;
use serde_json::json;
use std::io::Write as _;
use std::path::{Path, PathBuf};
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

/// Starts the engine on its own thread (it is built there: it is not `Send`); it stops when
/// `stop` is cancelled. `None` when another engine already delivers for this database.
fn engine_thread(
    db: &Path,
    policy: Option<model::Policy>,
    stop: CancellationToken,
) -> Result<Option<std::thread::JoinHandle<()>>, ServiceError> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<bool, ServiceError>>();
    let db = db.to_owned();
    let handle = std::thread::Builder::new()
        .name("handoffs-engine".to_owned())
        .spawn(move || {
            let started = Store::open(&db)
                .map_err(ServiceError::from)
                .and_then(|store| match Engine::new(Service::new(store), false) {
                    Ok(e) => Ok(Some(e)),
                    Err(EngineError::Busy) => Ok(None),
                    Err(e) => Err(refused(e.to_string())),
                });
            let engine = match started {
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
            let mut engine = match policy {
                Some(p) => engine.with_policy(p),
                None => engine,
            };
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
            let _ = ready_tx.send(Ok(true));
            if let Err(e) = rt.block_on(engine.run(Duration::from_secs(5), stop.cancelled_owned()))
            {
                eprintln!("handoffs: the engine stopped: {e}");
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
    std::fs::read_to_string(crate::store::token_path(db))
        .map(|t| t.trim().to_owned())
        .unwrap_or_default()
}

fn warn_if_public(host: &str, public_demo: bool) {
    let loopback = host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if !loopback && !public_demo {
        eprintln!(
            "handoffs: warning: listening on {host}: the page is reachable from the network (the \
             Host check still refuses names other than localhost, and sending needs the token)"
        );
    }
}

/// Serves the page (and the engine, unless `engine` is false) until Ctrl+C or `stop`.
fn run_web(
    db: &Path,
    host: &str,
    port: u16,
    options: WebOptions,
    stop: &CancellationToken,
    announce: impl FnOnce(std::net::SocketAddr) + Send,
) -> Result<(), ServiceError> {
    let rt = web_runtime()?;
    let ctrl_c = stop.clone();
    rt.spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            ctrl_c.cancel();
        }
    });
    let db = db.to_owned();
    let host = host.to_owned();
    let s = stop.clone();
    let out = rt.block_on(async move {
        let listener = match tokio::net::TcpListener::bind((host.as_str(), port)).await {
            Ok(l) => l,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && port != 0 => {
                eprintln!("handoffs: port {port} is in use; using a free one");
                tokio::net::TcpListener::bind((host.as_str(), 0))
                    .await
                    .map_err(|e| refused(format!("cannot listen on {host}: {e}")))?
            }
            Err(e) => return Err(refused(format!("cannot listen on {host}:{port}: {e}"))),
        };
        let addr = listener.local_addr().map_err(|e| refused(e.to_string()))?;
        let snaps = web::snapshots(&db, &options)?;
        let app = web::router(&db, &snaps, options, s.clone())?;
        announce(addr);
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { s.cancelled().await })
            .await
            .map_err(|e| refused(format!("the web server stopped: {e}")))?;
        drop(snaps);
        Ok(())
    });
    stop.cancel();
    rt.shutdown_timeout(Duration::from_secs(2));
    out
}

fn url_for(addr: std::net::SocketAddr, token: Option<&str>) -> String {
    let host = if addr.ip().is_unspecified() {
        "127.0.0.1".to_owned()
    } else if addr.is_ipv6() {
        format!("[{}]", addr.ip())
    } else {
        addr.ip().to_string()
    };
    match token {
        Some(t) => format!("http://{host}:{}/#token={t}", addr.port()),
        None => format!("http://{host}:{}/", addr.port()),
    }
}

/// `handoffs serve`: the engine and the page over `db`, until Ctrl+C.
pub fn serve(
    db: &Path,
    host: &str,
    port: u16,
    public_demo: bool,
    policy: Option<model::Policy>,
) -> Result<Ended, ServiceError> {
    Store::open(db)?;
    warn_if_public(host, public_demo);
    let stop = CancellationToken::new();
    let engine = engine_thread(db, policy, stop.clone())?;
    let token = token_of(db);
    let result = run_web(db, host, port, WebOptions { public_demo }, &stop, |addr| {
        let url = url_for(addr, (!public_demo).then_some(token.as_str()));
        println!("handoffs: serving {url}");
        let _ = std::io::stdout().flush();
    });
    stop.cancel();
    if let Some(h) = engine {
        let _ = h.join();
    }
    result.map(|()| Ended::Interrupted)
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
    let work = svc.store.read(|tx| tx.open_work(1_000))?;
    let mut did = 0;
    for w in work
        .iter()
        .filter(|w| matches!(w.state.as_str(), "returned" | "blocked"))
    {
        let outcome = if w.state == "blocked" {
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
    let open = work
        .iter()
        .filter(|w| matches!(w.state.as_str(), "assigned" | "accepted"))
        .count();
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
/// that plays the people. Ctrl+C stops everything and deletes the data.
pub fn demo(host: &str, port: u16, speed: f64, public_demo: bool) -> Result<Ended, ServiceError> {
    if !(speed > 0.0 && speed <= 100.0) {
        return Err(ServiceError::Usage(
            "--speed must be above 0 and at most 100".to_owned(),
        ));
    }
    let dir = tempfile::Builder::new()
        .prefix("handoffs-demo-")
        .tempdir()
        .map_err(|e| refused(format!("cannot make a temporary folder: {e}")))?;
    let db: PathBuf = dir.path().join("demo.sqlite3");
    let (store, _) = Store::init(&db)?;
    let mut svc = Service::new(store);
    for (i, (id, name)) in AGENTS.iter().enumerate() {
        // Turns of 4 to 7 seconds at speed 1, so the page shows work in every state.
        #[allow(clippy::cast_precision_loss)]
        let turn = 4.0 + i as f64;
        let settings = vec![
            ("turn_seconds".to_owned(), json!(turn)),
            ("speed".to_owned(), json!(speed)),
        ];
        svc.add_agent(id, "demo", Some(name), None, None, &settings)?;
    }
    warn_if_public(host, public_demo);
    let stop = CancellationToken::new();
    let engine = engine_thread(&db, None, stop.clone())?;
    let driver_stop = stop.clone();
    let every = Duration::from_secs_f64((1.5 / speed).clamp(0.05, 10.0));
    let driver = std::thread::Builder::new()
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
        .map_err(|e| refused(format!("cannot start the demo: {e}")))?;
    let token = token_of(&db);
    let result = run_web(&db, host, port, WebOptions { public_demo }, &stop, |addr| {
        let url = url_for(addr, (!public_demo).then_some(token.as_str()));
        println!("handoffs demo: open {url}");
        println!(
            "four demo agents (Planner, Engineer, Reviewer, Writer) are handing work around; Ctrl+C stops the demo and deletes its data"
        );
        let _ = std::io::stdout().flush();
    });
    stop.cancel();
    let _ = driver.join();
    if let Some(h) = engine {
        let _ = h.join();
    }
    drop(dir);
    result.map(|()| Ended::Interrupted)
}
