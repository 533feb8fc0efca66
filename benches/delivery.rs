//! Throughput and latency of handoffs on this machine (docs/PERFORMANCE.md).
//! Run: `cargo bench --bench delivery` (builds the release binary first).
//!
//! A bench binary rather than criterion: most figures are end to end across processes
//! (a `handoffs run` engine, `handoffs send` processes, recipient programs), measured once
//! per run with medians and percentiles computed here.

// Figures are small counts and milliseconds: the float casts cannot lose anything here.
#![allow(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_possible_wrap,
    clippy::many_single_char_names
)]

use handoffs::service::Service;
use handoffs::store::Store;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The binary cargo built for this bench (the same profile and target folder).
fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_handoffs"))
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// With `HANDOFFS_BENCH_POSTGRES` (the URL of a database on a PostgreSQL server the bench may
/// create databases from), each figure runs on a fresh PostgreSQL database instead of a
/// SQLite file (docs/PERFORMANCE.md puts both side by side).
fn postgres() -> Option<String> {
    std::env::var("HANDOFFS_BENCH_POSTGRES")
        .ok()
        .filter(|s| !s.is_empty())
}

fn fresh(dir: &Path, name: &str) -> (PathBuf, Service) {
    fresh_on(dir, name, postgres().as_deref())
}

/// Which backend a figure ran on, for its line.
fn backend_name(pg: Option<&str>) -> &'static str {
    if pg.is_some() { "PostgreSQL" } else { "SQLite" }
}

/// A fresh database: a SQLite file under `dir`, or with `pg` (a server's URL) a new
/// PostgreSQL database on that server.
fn fresh_on(dir: &Path, name: &str, pg: Option<&str>) -> (PathBuf, Service) {
    let db = match pg {
        Some(admin) => {
            let db = format!("bench_{}", uuid::Uuid::new_v4().simple());
            let mut c = postgres::Client::connect(admin, postgres::NoTls).unwrap();
            c.batch_execute(&format!("CREATE DATABASE {db}")).unwrap();
            let mut url = url::Url::parse(admin).unwrap();
            url.set_path(&format!("/{db}"));
            PathBuf::from(url.to_string())
        }
        None => dir.join(name).join("h.sqlite3"),
    };
    let (store, _) = Store::init(&db).unwrap();
    (db, Service::new(store))
}

fn engine(db: &Path) -> Child {
    Command::new(bin())
        .args(["--db"])
        .arg(db)
        .args(["run", "--interval", "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn stop(mut c: Child) {
    let _ = c.kill();
    let _ = c.wait();
}

/// How many deliveries returned: one indexed count, so that watching costs the engine
/// next to nothing (the full overview would).
fn returned(store: &mut Store) -> i64 {
    store
        .read(|tx: &handoffs::store::Tx<'_>| tx.count_by_state())
        .unwrap()
        .into_iter()
        .find(|(state, _)| state == "RETURNED")
        .map_or(0, |(_, n)| n)
}

fn wait_returned(s: &mut Service, n: i64, limit: Duration) -> Duration {
    let t = Instant::now();
    let mut store = Store::open(s.db_path()).unwrap();
    while returned(&mut store) < n {
        assert!(
            t.elapsed() < limit,
            "only {} of {n} returned after {limit:?}",
            returned(&mut store)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    t.elapsed()
}

/// A no-op HTTP recipient: 200 for every POST, recording arrival times by request id.
fn noop_server() -> (String, Arc<Mutex<HashMap<String, Instant>>>) {
    let seen: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let seen2 = seen.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let app = axum::Router::new().route(
                "/",
                axum::routing::post(move |body: axum::Json<serde_json::Value>| {
                    let seen = seen2.clone();
                    async move {
                        if let Some(r) = body.get("request_id").and_then(|v| v.as_str()) {
                            seen.lock().unwrap().insert(r.to_owned(), Instant::now());
                        }
                        "{}"
                    }
                }),
            );
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    let addr = rx.recv().unwrap();
    (format!("http://{addr}/"), seen)
}

fn rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The figures, by name: `cargo bench --bench delivery -- NAME…` runs only those;
/// `-- --quick` runs the CI guard (the raw commit rates and HTTP to 8 recipients) and fails
/// when HTTP throughput falls below half its documented ratio to raw durable commits.
/// `compare` (SQLite and PostgreSQL side by side) runs only when named.
const SECTIONS: &[&str] = &[
    "raw", "lib", "cli", "argv", "http", "engines", "failover", "backlog", "latency", "idle",
    "rss", "compare",
];

/// Half the documented ratio of HTTP deliveries/s (8 recipients) to raw durable (FULL)
/// commits/s on the same disk (docs/PERFORMANCE.md: 1,754 against 15,079, 0.116): the CI
/// guard fails below it. Both are measured in the same run, so a slower disk or machine
/// moves the floor with it (a fixed 600/s failed within 12 % on a disk a third as fast),
/// while a regression of the engine does not. A guard against large regressions, not a
/// timing test. Kept at half the lowest documented ratio (0.116, on the fastest disk seen):
/// the engine is CPU-bound, so on a disk whose syncs are quicker the ratio falls without any
/// regression (0.47 at 7,352 raw FULL commits/s, 2026-12-07).
const HTTP_FLOOR_RATIO: f64 = 0.058;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let named: Vec<&str> = args
        .iter()
        .filter(|a| !a.starts_with("--"))
        .map(String::as_str)
        .collect();
    for n in &named {
        assert!(
            SECTIONS.contains(n),
            "no section {n:?}; the sections: {SECTIONS:?}"
        );
    }
    let wanted = |name: &str| {
        if quick {
            name == "raw" || name == "http"
        } else {
            named.is_empty() || named.contains(&name)
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    println!("| figure | value |\n|---|---|");
    let mut full_rate = None;
    if wanted("raw") {
        full_rate = Some(raw(d));
    }
    if wanted("lib") {
        lib(d);
    }
    if wanted("cli") {
        cli(d);
    }
    if wanted("argv") {
        argv(d);
    }
    let (url, seen) = noop_server();
    if wanted("http") {
        let rate = http(d, &url, 8, 4_000, full_rate);
        let floor = HTTP_FLOOR_RATIO * full_rate.unwrap_or(0.0);
        if quick && rate < floor {
            eprintln!(
                "deliveries/s, HTTP mode to 8 recipients: {rate:.0}, below the floor of \
                 {floor:.0} ({HTTP_FLOOR_RATIO}× the raw FULL commit rate on this disk, half \
                 the documented ratio)"
            );
            std::process::exit(1);
        }
    }
    if wanted("engines") {
        for k in [1, 2, 4] {
            engines(d, &url, k);
        }
    }
    if wanted("failover") {
        failover(d, &url);
    }
    // Only when named: it repeats `lib`, `engines` and `failover` on both backends.
    if named.contains(&"compare") {
        compare(d, &url);
    }
    if wanted("backlog") {
        http(d, &url, 1, 10_000, full_rate);
    }
    if wanted("latency") {
        latency(d, &url, &seen);
    }
    if wanted("idle") {
        idle(d);
    }
    if wanted("rss") {
        rss(d);
    }
}

/// The raw SQLite commit rate on this disk (the physical floor of a durable step); returns
/// the FULL rate.
fn raw(d: &Path) -> f64 {
    let mut full = 0.0;
    for sync in ["NORMAL", "FULL"] {
        let c = rusqlite::Connection::open(d.join(format!("raw-{sync}.db"))).unwrap();
        c.execute_batch(&format!(
            "PRAGMA journal_mode=WAL; PRAGMA synchronous={sync}; CREATE TABLE t (x)"
        ))
        .unwrap();
        let n = 3_000;
        let t = Instant::now();
        for i in 0..n {
            c.execute("INSERT INTO t VALUES (?1)", [i]).unwrap();
        }
        let rate = f64::from(n) / t.elapsed().as_secs_f64();
        println!("| raw SQLite single-row commits/s, WAL + synchronous={sync} | {rate:.0} |");
        full = rate;
    }
    full
}

/// Sends through the library.
fn lib(d: &Path) {
    lib_on(d, postgres().as_deref(), 5_000);
}

/// `n` sends through the library on SQLite, or with `pg` on a new PostgreSQL database;
/// returns sends/s.
fn lib_on(d: &Path, pg: Option<&str>, n: u32) -> f64 {
    let side = if pg.is_some() { "pg" } else { "lite" };
    let (_, mut s) = fresh_on(d, &format!("lib-{side}"), pg);
    s.add_agent("a", Some("demo"), None, None, None, &[])
        .unwrap();
    s.add_agent("b", Some("demo"), None, None, None, &[])
        .unwrap();
    let t = Instant::now();
    for i in 0..n {
        s.send("a", "b", &format!("message {i}"), None, None, None)
            .unwrap();
    }
    let lib_rate = f64::from(n) / t.elapsed().as_secs_f64();
    println!(
        "| sends/s through the library (send + enrol, one durable transaction each; {n} sends; {}) | {lib_rate:.0} |",
        backend_name(pg)
    );
    lib_rate
}

/// Issue 17's figures side by side in one run (needs `HANDOFFS_BENCH_POSTGRES`): sends/s
/// through the library, and deliveries/s of a backlog of 2,000 to 8 HTTP no-op recipients
/// drained by 1, 2 and 4 engines, on SQLite and on PostgreSQL alternately (each figure on a
/// fresh database), then the failover time on PostgreSQL; a summary row for each pair.
fn compare(d: &Path, url: &str) {
    let Some(pg) = postgres() else {
        println!("| SQLite and PostgreSQL side by side | (needs HANDOFFS_BENCH_POSTGRES) |");
        return;
    };
    let mut pairs = vec![(
        "sends/s through the library (2,000 sends)".to_owned(),
        lib_on(d, None, 2_000),
        lib_on(d, Some(&pg), 2_000),
    )];
    for k in [1, 2, 4] {
        pairs.push((
            format!("deliveries/s, {k} engine(s), 2,000 to 8 HTTP recipients"),
            engines_on(d, url, k, None),
            engines_on(d, url, k, Some(&pg)),
        ));
    }
    for (what, lite, pg) in pairs {
        println!(
            "| side by side: {what}, SQLite / PostgreSQL | {lite:.0} / {pg:.0} ({:.1}×) |",
            lite / pg
        );
    }
    failover(d, url);
}

/// One `handoffs send` process.
fn cli(d: &Path) {
    let (db, _) = fresh(d, "cli");
    let run = |args: &[&str]| {
        let ok = Command::new(bin())
            .arg("--db")
            .arg(&db)
            .args(args)
            .stdout(Stdio::null())
            .status()
            .unwrap()
            .success();
        assert!(ok, "{args:?}");
    };
    run(&["agent", "add", "a", "--provider", "demo"]);
    run(&["agent", "add", "b", "--provider", "demo"]);
    let mut times = Vec::new();
    for i in 0..300 {
        let t = Instant::now();
        run(&["send", "a", "b", &format!("cli {i}")]);
        times.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    times.sort_by(f64::total_cmp);
    println!(
        "| one `handoffs send` process, median / p99 (ms) | {:.2} / {:.2} |",
        pct(&times, 0.5),
        pct(&times, 0.99)
    );
    println!(
        "| sends/s through the CLI (sequential processes) | {:.0} |",
        1000.0 / pct(&times, 0.5)
    );
}

/// Deliveries end to end, argv mode with /bin/true.
fn argv(d: &Path) {
    for recipients in [1usize, 8] {
        let (db, mut s) = fresh(d, &format!("argv{recipients}"));
        s.add_agent("lead", Some("demo"), None, None, None, &[])
            .unwrap();
        for r in 0..recipients {
            s.add_agent(
                &format!("r{r}"),
                Some("command"),
                None,
                None,
                None,
                &[("command".into(), serde_json::json!(["/bin/true"]))],
            )
            .unwrap();
        }
        let n = 600;
        let e = engine(&db);
        std::thread::sleep(Duration::from_millis(300));
        let t0 = Instant::now();
        for i in 0..n {
            s.send(
                "lead",
                &format!("r{}", i % recipients),
                &format!("job {i}"),
                None,
                None,
                None,
            )
            .unwrap();
        }
        wait_returned(&mut s, n as i64, Duration::from_secs(300));
        let total = t0.elapsed();
        stop(e);
        println!(
            "| deliveries/s, argv mode (`/bin/true`), {recipients} recipient(s), {n} handoffs | {:.0} |",
            n as f64 / total.as_secs_f64()
        );
    }
}

/// Deliveries end to end, HTTP mode against a local no-op server: a backlog of `n` to
/// `recipients`, drained by a fresh engine. Returns deliveries/s.
fn http(d: &Path, url: &str, recipients: usize, n: usize, full_rate: Option<f64>) -> f64 {
    let (db, mut s) = backlog(d, &format!("http{recipients}-{n}"), url, recipients, n);
    let t0 = Instant::now();
    let e = engine(&db);
    wait_returned(&mut s, n as i64, Duration::from_secs(300));
    let total = t0.elapsed();
    let cpu_ms = cpu_ticks(e.id()) as f64 * 10.0;
    stop(e);
    let rate = n as f64 / total.as_secs_f64();
    let ratio = full_rate.map_or_else(String::new, |f| {
        format!(", {:.2}× the raw FULL commit rate", rate / f)
    });
    println!(
        "| deliveries/s, HTTP mode, backlog of {n} to {recipients} recipient(s) (drained in {:.2} s{ratio}; the engine's CPU {:.0} µs a delivery) | {rate:.0} |",
        total.as_secs_f64(),
        cpu_ms * 1000.0 / n as f64,
    );
    rate
}

/// A database with a demo sender and `recipients` HTTP recipients at `url`, and `n` handoffs
/// sent to them round robin (before any engine runs).
fn backlog(d: &Path, name: &str, url: &str, recipients: usize, n: usize) -> (PathBuf, Service) {
    backlog_on(d, name, url, recipients, n, postgres().as_deref())
}

/// [`backlog`] on SQLite, or with `pg` on a new database of that PostgreSQL server.
fn backlog_on(
    d: &Path,
    name: &str,
    url: &str,
    recipients: usize,
    n: usize,
    pg: Option<&str>,
) -> (PathBuf, Service) {
    let (db, mut s) = fresh_on(d, name, pg);
    s.add_agent("lead", Some("demo"), None, None, None, &[])
        .unwrap();
    for r in 0..recipients {
        s.add_agent(
            &format!("r{r}"),
            Some("command"),
            None,
            None,
            None,
            &[("url".into(), serde_json::json!(url))],
        )
        .unwrap();
    }
    for i in 0..n {
        s.send(
            "lead",
            &format!("r{}", i % recipients),
            &format!("job {i}"),
            None,
            None,
            None,
        )
        .unwrap();
    }
    (db, s)
}

/// Deliveries/s of a backlog of 2,000 to 8 HTTP recipients drained by `k` engines at once
/// (on SQLite only one delivers: the others find the file's engine lock taken and skip).
fn engines(d: &Path, url: &str, k: usize) -> f64 {
    engines_on(d, url, k, postgres().as_deref())
}

/// [`engines`] on SQLite, or with `pg` on a new database of that PostgreSQL server; returns
/// deliveries/s.
fn engines_on(d: &Path, url: &str, k: usize, pg: Option<&str>) -> f64 {
    let n = 2_000;
    let side = if pg.is_some() { "pg" } else { "lite" };
    let (db, mut s) = backlog_on(d, &format!("engines{k}-{side}"), url, 8, n, pg);
    let t0 = Instant::now();
    let running: Vec<Child> = (0..k).map(|_| engine(&db)).collect();
    wait_returned(&mut s, n as i64, Duration::from_secs(600));
    let total = t0.elapsed();
    let cpu: u64 = running.iter().map(|e| cpu_ticks(e.id())).sum();
    for e in running {
        stop(e);
    }
    println!(
        "| deliveries/s, {k} engine(s) at once, backlog of {n} to 8 HTTP recipients ({}; drained in {:.2} s; the engines' CPU {:.0} µs a delivery) | {:.0} |",
        backend_name(pg),
        total.as_secs_f64(),
        cpu as f64 * 10.0 * 1000.0 / n as f64,
        n as f64 / total.as_secs_f64()
    );
    n as f64 / total.as_secs_f64()
}

/// The recipient leases as stored: recipient, engine, expiry.
fn leases(s: &mut Service) -> Vec<(String, String, i64)> {
    s.leases()
        .unwrap()
        .into_iter()
        .map(|l| (l.agent, l.engine, l.expires_at))
        .collect()
}

/// Failover after a kill (PostgreSQL): engine a, then b, drain a backlog to 8 HTTP
/// recipients; a is SIGKILLed, and the time until every recipient it held is held by b is
/// taken, five times.
fn failover(d: &Path, url: &str) {
    if postgres().is_none() {
        println!("| failover after a kill | (PostgreSQL only: HANDOFFS_BENCH_POSTGRES) |");
        return;
    }
    let mut times = Vec::new();
    for round in 0..5 {
        let (db, mut s) = backlog(d, &format!("failover{round}"), url, 8, 3_000);
        let mut a = engine(&db);
        let pid = a.id().to_string();
        let of_a = |s: &mut Service| -> Vec<String> {
            let now = handoffs::store::millis(s.now());
            leases(s)
                .into_iter()
                // Recipients only: housekeeping's lease (`~housekeeping`) is tried for at
                // most once a quarter lease, and is not a delivery's.
                .filter(|(r, e, x)| {
                    !r.starts_with('~') && e.split('/').nth(1) == Some(pid.as_str()) && *x > now
                })
                .map(|(r, _, _)| r)
                .collect()
        };
        let t = Instant::now();
        while of_a(&mut s).is_empty() {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "engine a took no lease"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // Engine b starts once a serves recipients, and both deliver for a moment.
        let b = engine(&db);
        std::thread::sleep(Duration::from_millis(500));
        let held = of_a(&mut s);
        let _ = a.kill();
        let killed = Instant::now();
        let _ = a.wait();
        loop {
            let now = handoffs::store::millis(s.now());
            let all = leases(&mut s);
            let moved = held.iter().all(|r| {
                all.iter().any(|(x, e, until)| {
                    x == r && e.split('/').nth(1) != Some(pid.as_str()) && *until > now
                })
            });
            if moved {
                break;
            }
            assert!(killed.elapsed() < Duration::from_secs(60), "no failover");
            std::thread::sleep(Duration::from_millis(2));
        }
        times.push(killed.elapsed().as_secs_f64() * 1000.0);
        stop(b);
    }
    times.sort_by(f64::total_cmp);
    println!(
        "| failover after a SIGKILL: every recipient the killed engine held taken by the other, median of 5 (max {:.0} ms) | {:.0} ms |",
        times[times.len() - 1],
        pct(&times, 0.5)
    );
}

/// Latency from send to the adapter's write, idle engine.
fn latency(d: &Path, url: &str, seen: &Mutex<HashMap<String, Instant>>) {
    let (db, mut s) = fresh(d, "latency");
    s.add_agent("lead", Some("demo"), None, None, None, &[])
        .unwrap();
    s.add_agent(
        "r",
        Some("command"),
        None,
        None,
        None,
        &[("url".into(), serde_json::json!(url))],
    )
    .unwrap();
    let e = engine(&db);
    std::thread::sleep(Duration::from_millis(500));
    let mut lat = Vec::new();
    for i in 0..300 {
        let t = Instant::now();
        let sent = s
            .send("lead", "r", &format!("ping {i}"), None, None, None)
            .unwrap();
        let request = s.delivery(&sent.message.id).unwrap().delivery.request_id;
        let arrived = loop {
            if let Some(at) = seen.lock().unwrap().get(&request) {
                break *at;
            }
            std::thread::sleep(Duration::from_micros(200));
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "no write for {request}"
            );
        };
        lat.push(arrived.duration_since(t).as_secs_f64() * 1000.0);
        // Let the engine go idle again before the next one.
        std::thread::sleep(Duration::from_millis(20));
    }
    stop(e);
    lat.sort_by(f64::total_cmp);
    println!(
        "| send → adapter write, idle engine, median / p99 (ms) | {:.2} / {:.2} |",
        pct(&lat, 0.5),
        pct(&lat, 0.99)
    );
}

/// A recipient whose activity URL always answers busy: deliveries to it wait in its queue.
fn busy_server() -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let app = axum::Router::new().route(
                "/activity",
                axum::routing::get(|| async { r#"{"status":"busy"}"# }),
            );
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    format!("http://{}/", rx.recv().unwrap())
}

/// The CPU time (user + system) a process has used so far, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the name.
    let get = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    get(11) + get(12)
}

/// Idle cost: `handoffs serve` (engine and page) with 10,000 deliveries queued behind busy
/// recipients (10 recipients, 1,000 each), CPU over 60 s from `/proc/PID/stat`.
fn idle(d: &Path) {
    let (db, mut s) = fresh(d, "idle");
    let busy = busy_server();
    s.add_agent("lead", Some("demo"), None, None, None, &[])
        .unwrap();
    let recipients = 10;
    for r in 0..recipients {
        s.add_agent(
            &format!("r{r}"),
            Some("command"),
            None,
            None,
            None,
            &[
                ("url".into(), serde_json::json!(format!("{busy}turn"))),
                (
                    "activity_url".into(),
                    serde_json::json!(format!("{busy}activity")),
                ),
            ],
        )
        .unwrap();
    }
    for i in 0..10_000 {
        s.send(
            "lead",
            &format!("r{}", i % recipients),
            &format!("queued {i}"),
            None,
            None,
            None,
        )
        .unwrap();
    }
    let e = Command::new(bin())
        .arg("--db")
        .arg(&db)
        .args(["serve", "--port", "0"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Let it find every queue busy first.
    std::thread::sleep(Duration::from_secs(10));
    let hz = 100.0; // USER_HZ on Linux
    let before = cpu_ticks(e.id());
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs(60));
    let used = (cpu_ticks(e.id()) - before) as f64 / hz;
    let share = used / t.elapsed().as_secs_f64() * 100.0;
    stop(e);
    println!(
        "| idle CPU of `serve`, 10,000 deliveries queued behind 10 busy recipients, over 60 s | {share:.2} % of a core |"
    );
}

/// Engine RSS with 100,000 open deliveries (paused, so every one stays open).
fn rss(d: &Path) {
    let (db, mut s) = fresh(d, "rss");
    s.add_agent("lead", Some("demo"), None, None, None, &[])
        .unwrap();
    s.add_agent("r", Some("demo"), None, None, None, &[])
        .unwrap();
    s.config_set("enabled", "false").unwrap();
    for i in 0..100_000 {
        s.send("lead", "r", &format!("open {i}"), None, None, None)
            .unwrap();
    }
    let e = engine(&db);
    std::thread::sleep(Duration::from_secs(5));
    let kb = rss_kb(e.id());
    stop(e);
    println!(
        "| engine RSS with 100,000 open (HELD) deliveries | {:.1} MB |",
        kb as f64 / 1024.0
    );
}
