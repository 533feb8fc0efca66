//! Helpers for the real-process tests: a private database folder, the built binary, a
//! recipient script that logs every run, and readers for what it logged.
#![allow(dead_code)]

use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub struct World {
    pub dir: tempfile::TempDir,
    pub db: PathBuf,
    pub log: PathBuf,
}

/// Short bounds so crash recovery takes seconds, not minutes.
pub const FAST_POLICY: &str = r#"{"sending_timeout_ms": 1500, "unobserved_limit_ms": 5000,
    "interrupt_resend_wait_ms": 500, "history_scan_interval_ms": 300, "history_scan_span_ms": 600}"#;

/// The backend matrix: with `HANDOFFS_TEST_BACKEND=postgres`, every [`World`] runs on a fresh
/// PostgreSQL database of its own (on the server `HANDOFFS_TEST_POSTGRES` names: a URL of a
/// database the tests may create databases from) instead of a SQLite file. The cases that
/// are about SQLite's file itself (its sync, its modes, a deleted file) say so
/// ([`sqlite_file_case`]).
pub fn postgres() -> Option<String> {
    let on = std::env::var("HANDOFFS_TEST_BACKEND").is_ok_and(|b| b == "postgres");
    on.then(|| {
        postgres_server().unwrap_or_else(|| {
            panic!("HANDOFFS_TEST_BACKEND=postgres needs HANDOFFS_TEST_POSTGRES (a server's URL)")
        })
    })
}

/// The PostgreSQL server the tests may use (`HANDOFFS_TEST_POSTGRES`), if any.
pub fn postgres_server() -> Option<String> {
    std::env::var("HANDOFFS_TEST_POSTGRES")
        .ok()
        .filter(|s| !s.is_empty())
}

/// The server for a case that needs PostgreSQL whichever side of the matrix runs: `None`
/// (the case is skipped, and says so) without one, except under `CI=true`, where a missing
/// server fails the case.
pub fn postgres_or_skip(case: &str) -> Option<String> {
    let found = postgres_server();
    if found.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{case}: HANDOFFS_TEST_POSTGRES is not set, and CI=true needs a PostgreSQL server"
        );
        eprintln!("{case}: skipped (set HANDOFFS_TEST_POSTGRES to a server's URL)");
    }
    found
}

/// A fresh, empty PostgreSQL database beside the one at `admin`; its URL. (On a thread of
/// its own: the synchronous client must not run on a thread that drives a Tokio runtime.)
pub fn fresh_postgres(admin: &str) -> String {
    let name = format!("t_{}", uuid::Uuid::new_v4().simple());
    let (owned, created) = (admin.to_owned(), name.clone());
    std::thread::spawn(move || {
        let admin = owned;
        let mut client = ::postgres::Client::connect(&admin, ::postgres::NoTls)
            .unwrap_or_else(|e| panic!("HANDOFFS_TEST_POSTGRES: cannot connect to {admin}: {e}"));
        client
            .batch_execute(&format!("CREATE DATABASE {created}"))
            .unwrap_or_else(|e| panic!("cannot create database {created}: {e}"));
    })
    .join()
    .expect("create a PostgreSQL database");
    let mut url = url::Url::parse(admin).expect("HANDOFFS_TEST_POSTGRES is a URL");
    url.set_path(&format!("/{name}"));
    url.to_string()
}

/// Whether `db` is a PostgreSQL URL (this case runs on the PostgreSQL side of the matrix).
pub fn is_postgres(db: &Path) -> bool {
    db.to_string_lossy().starts_with("postgres")
}

/// For a case about SQLite's file itself (its modes, its sync, a damaged or locked file):
/// `true`, after saying so, when the matrix runs on PostgreSQL, where there is no file.
pub fn sqlite_file_case(what: &str) -> bool {
    if postgres().is_some() {
        eprintln!("SQLite-only case ({what}): the PostgreSQL side of the matrix has no file");
        return true;
    }
    false
}

/// Runs `sql` (no parameters) on the database at `db`, whichever backend it is; the first
/// column of each row it returns, as text. For the few cases that look underneath (a row
/// damaged by hand, orphans a killed process may have left).
pub fn sql_rows(db: &Path, sql: &str) -> Vec<String> {
    if is_postgres(db) {
        let (url, sql) = (db.to_string_lossy().into_owned(), sql.to_owned());
        return std::thread::spawn(move || {
            let mut client = ::postgres::Client::connect(&url, ::postgres::NoTls).unwrap();
            client
                .simple_query(&sql)
                .unwrap_or_else(|e| panic!("{sql}: {e}"))
                .into_iter()
                .filter_map(|m| match m {
                    ::postgres::SimpleQueryMessage::Row(r) => {
                        Some(r.get(0).unwrap_or_default().to_owned())
                    }
                    _ => None,
                })
                .collect()
        })
        .join()
        .expect("query PostgreSQL");
    }
    let conn = rusqlite::Connection::open(db).unwrap();
    let _ = conn.busy_timeout(Duration::from_secs(5));
    let mut st = conn.prepare(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
    if st.column_count() == 0 {
        drop(st);
        conn.execute_batch(sql)
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        return Vec::new();
    }
    st.query_map([], |r| {
        Ok(match r.get_ref(0)? {
            rusqlite::types::ValueRef::Null => String::new(),
            rusqlite::types::ValueRef::Integer(i) => i.to_string(),
            rusqlite::types::ValueRef::Real(f) => f.to_string(),
            rusqlite::types::ValueRef::Text(t) | rusqlite::types::ValueRef::Blob(t) => {
                String::from_utf8_lossy(t).into_owned()
            }
        })
    })
    .unwrap()
    .collect::<Result<_, _>>()
    .unwrap()
}

/// `text` as an SQL string literal (both backends spell it the same).
pub fn sql_text(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// Holds the database's write lock from another connection until dropped (SQLite's
/// `BEGIN EXCLUSIVE`; on PostgreSQL the advisory lock every writer queues on).
pub struct WriteLockHolder {
    release: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl WriteLockHolder {
    pub fn take(db: &Path) -> WriteLockHolder {
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let (held, taken) = std::sync::mpsc::channel::<()>();
        let db = db.to_owned();
        let thread = std::thread::spawn(move || {
            if is_postgres(&db) {
                let mut c =
                    ::postgres::Client::connect(&db.to_string_lossy(), ::postgres::NoTls).unwrap();
                c.batch_execute("BEGIN; SELECT pg_advisory_xact_lock(1213089862, 1)")
                    .unwrap();
                held.send(()).unwrap();
                let _ = wait.recv();
                c.batch_execute("ROLLBACK").unwrap();
            } else {
                let c = rusqlite::Connection::open(&db).unwrap();
                c.execute_batch("BEGIN EXCLUSIVE").unwrap();
                held.send(()).unwrap();
                let _ = wait.recv();
                c.execute_batch("ROLLBACK").unwrap();
            }
        });
        taken.recv().expect("the write lock is taken");
        WriteLockHolder {
            release: Some(release),
            thread: Some(thread),
        }
    }
}

impl Drop for WriteLockHolder {
    fn drop(&mut self) {
        drop(self.release.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A PostgreSQL world's database is dropped with it, and this machine's token file for it
/// (kept in the user's state folder, where the test process finds it too) removed.
impl Drop for World {
    fn drop(&mut self) {
        if !is_postgres(&self.db) {
            return;
        }
        let _ = std::fs::remove_file(handoffs::store::token_path(&self.db));
        let (Some(admin), Some(name)) = (postgres_server(), self.db.file_name()) else {
            return;
        };
        let name = name.to_string_lossy().into_owned();
        let _ = std::thread::spawn(move || {
            if let Ok(mut c) = ::postgres::Client::connect(&admin, ::postgres::NoTls) {
                let _ = c.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"));
            }
        })
        .join();
    }
}

impl World {
    pub fn new() -> World {
        World::with_db(postgres().map(|admin| fresh_postgres(&admin)))
    }

    /// A world on a fresh PostgreSQL database of the server at `admin`, whichever side of
    /// the matrix runs.
    pub fn on_postgres(admin: &str) -> World {
        World::with_db(Some(fresh_postgres(admin)))
    }

    fn with_db(url: Option<String>) -> World {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = match url {
            Some(url) => PathBuf::from(url),
            None => dir.path().join("state").join("h.sqlite3"),
        };
        let log = dir.path().join("runs.log");
        let w = World { dir, db, log };
        w.ok(&["init"]);
        w
    }

    pub fn cmd(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_handoffs"));
        c.env("HANDOFFS_DB", &self.db)
            .env_remove("HANDOFFS_AGENT")
            .env(
                "HANDOFFS_POLICY",
                std::env::var("HANDOFFS_TEST_POLICY").unwrap_or_else(|_| FAST_POLICY.to_owned()),
            )
            .stdin(Stdio::null());
        c
    }

    pub fn run(&self, args: &[&str]) -> Output {
        self.cmd().args(args).output().expect("run handoffs")
    }

    /// Runs and asserts success; returns stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "handoffs {args:?} failed ({:?}): {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn json(&self, args: &[&str]) -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        serde_json::from_str(&self.ok(&all)).expect("JSON output")
    }

    /// A recipient script: logs `start <request> <ns>` and `end <request> <ns>`, sleeps
    /// `sleep_ms`, and exits with `code`.
    pub fn script(&self, name: &str, sleep_ms: u64, code: i32) -> PathBuf {
        let path = self.dir.path().join(name);
        let log = self.log.display();
        let sleep = if sleep_ms > 0 {
            format!("sleep {}.{:03}", sleep_ms / 1000, sleep_ms % 1000)
        } else {
            String::new()
        };
        std::fs::write(
            &path,
            format!(
                "#!/bin/sh\necho \"start $HANDOFFS_REQUEST_ID $(date +%s%N) $HANDOFFS_AGENT\" >> {log}\n\
                 test -f \"$HANDOFFS_TEXT_FILE\" || echo \"missing-text $HANDOFFS_REQUEST_ID\" >> {log}\n\
                 {sleep}\necho \"end $HANDOFFS_REQUEST_ID $(date +%s%N) $HANDOFFS_AGENT\" >> {log}\nexit {code}\n"
            ),
        )
        .expect("write script");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        path
    }

    /// A recipient in the command adapter's HTTP mode, served from this test process: every
    /// POST is a whole turn, logged as a `start`/`end` pair in the same run log as the
    /// scripts (a request id POSTed twice shows as two runs); its status URL answers
    /// `returned` for a request id it took and 404 for one it never saw.
    pub fn add_http_agent(&self, id: &str) {
        let url = http_recipient(self.log.clone(), Some(self.db.clone()));
        self.register_http_agent(id, &url);
    }

    /// Registers (or re-registers) `id` as an HTTP command agent at `url` (from
    /// [`http_recipient`]), with its status URL beside it; returns what `agent add` printed.
    pub fn register_http_agent(&self, id: &str, url: &str) -> String {
        self.ok(&[
            "agent",
            "add",
            id,
            "--provider",
            "command",
            "--set",
            &format!("url={url}"),
            "--set",
            &format!("status_url={url}status/{{request_id}}"),
        ])
    }

    pub fn add_command_agent(&self, id: &str, script: &Path) {
        let command = format!("command=[\"{}\",\"{{request_id}}\"]", script.display());
        self.ok(&[
            "agent",
            "add",
            id,
            "--provider",
            "command",
            "--set",
            &command,
        ]);
    }

    pub fn spawn_engine(&self) -> Engine {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("engine.log"))
            .expect("engine log");
        self.cmd()
            .args(["run", "--interval", "0.2"])
            .env("HANDOFFS_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map(Engine)
            .expect("spawn engine")
    }

    /// An engine whose processes (supervisors, the programs they run) also get `env`.
    pub fn spawn_engine_env(&self, env: &[(String, String)]) -> Engine {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("engine.log"))
            .expect("engine log");
        self.cmd()
            .args(["run", "--interval", "0.2"])
            .env("HANDOFFS_LOG", "info")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map(Engine)
            .expect("spawn engine")
    }

    /// Deliveries by id → state.
    pub fn states(&self) -> BTreeMap<String, String> {
        let o = self.json(&["status"]);
        let mut out = BTreeMap::new();
        for section in ["in_flight", "needs_attention", "recent"] {
            for d in o[section].as_array().into_iter().flatten() {
                out.insert(
                    d["id"].as_str().unwrap().to_owned(),
                    d["state"].as_str().unwrap().to_owned(),
                );
            }
        }
        out
    }

    pub fn counts(&self) -> BTreeMap<String, i64> {
        let o = self.json(&["status"]);
        o["counts"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| (p[0].as_str().unwrap().to_owned(), p[1].as_i64().unwrap()))
            .collect()
    }

    /// Waits until `done(counts)` holds; panics after `limit`.
    pub fn wait_for(&self, limit: Duration, mut done: impl FnMut(&BTreeMap<String, i64>) -> bool) {
        let start = Instant::now();
        loop {
            let counts = self.counts();
            if done(&counts) {
                return;
            }
            if start.elapsed() >= limit {
                let attention = self.json(&["status"])["needs_attention"].clone();
                let detail = attention
                    .as_array()
                    .and_then(|a| a.first())
                    .and_then(|d| d["id"].as_str())
                    .map(|id| self.ok(&["status", id]))
                    .unwrap_or_default();
                let engine_log =
                    std::fs::read_to_string(self.dir.path().join("engine.log")).unwrap_or_default();
                let engine_tail: Vec<&str> = engine_log.lines().rev().take(8).collect();
                eprintln!("engine log tail: {engine_tail:#?}");
                let runs = std::fs::read_to_string(&self.log).unwrap_or_default();
                let tail: Vec<&str> = runs.lines().rev().take(6).collect();
                if let Ok(keep) = std::env::var("HANDOFFS_KEEP_FAILED") {
                    let _ = std::process::Command::new("cp")
                        .arg("-r")
                        .arg(self.dir.path())
                        .arg(&keep)
                        .status();
                }
                // A violation the recipients logged comes first: a stall it led to is its
                // consequence (this panics with the violation's own message).
                let _ = self.runs();
                let unsettled = self.unsettled_report();
                panic!(
                    "not settled after {limit:?}: {counts:?}\n{detail}\nlast runs: {tail:?}\n{unsettled}"
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// What a stuck run needs to be understood without a rerun: every delivery that is not
    /// settled (its record, when it is due, its last events), every open run of a command
    /// recipient, the run files left, and the processes still alive.
    pub fn unsettled_report(&self) -> String {
        use handoffs::store::Store;
        use model::StateKind::*;
        use std::fmt::Write as _;
        let mut out = String::new();
        let now = handoffs::store::millis(handoffs::clock::now());
        let Ok(mut store) = Store::open(&self.db) else {
            return "(the database cannot be opened)".to_owned();
        };
        let report = store.read(|tx| -> handoffs::store::Result<()> {
            // The rows a stall is about first: not merely queued.
            let mut rows = tx.deliveries_in(&[Busy, Held, Unavailable, OwnerRejected], 50)?;
            rows.extend(tx.deliveries_in(&[Sending, Accepted, Running, Uncertain, Failed], 50)?);
            rows.extend(tx.deliveries_in(&[Waiting], 50)?);
            for row in rows.iter().take(12) {
                let _ = writeln!(
                    out,
                    "delivery {} to {}: {} {} (request {}, due in {:?} ms, updated {} ms ago)",
                    row.message_id,
                    row.recipient,
                    row.record.kind().as_str(),
                    row.record.detail(),
                    row.record.core().request_id(),
                    row.due_at.map(|d| d - now),
                    now - row.updated_at
                );
                for e in tx.events_for(&row.message_id)?.iter().rev().take(8) {
                    let _ = writeln!(out, "  {} ms ago {}: {}", now - e.at, e.kind, e.detail);
                }
            }
            if let Some((at, report)) = tx.report()? {
                let _ = writeln!(out, "engine report {} ms ago: {report}", now - at);
            }
            for agent in tx.agents()? {
                for run in tx.open_runs_for(&agent.id)? {
                    let _ = writeln!(out, "open run: {run:?}");
                }
            }
            Ok(())
        });
        if let Err(e) = report {
            let _ = writeln!(out, "(reading the database failed: {e})");
        }
        let runs_dir = handoffs::store::sibling(&self.db, ".runs");
        if let Ok(entries) = std::fs::read_dir(&runs_dir) {
            let names: Vec<String> = entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            let _ = writeln!(out, "run files: {names:?}");
        }
        // Where each live engine is, thread by thread: a stuck engine says why here.
        if let Ok(pgrep) = Command::new("pgrep").args(["-f", "handoffs run"]).output() {
            for pid in String::from_utf8_lossy(&pgrep.stdout).split_whitespace() {
                let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
                    .map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
                    .unwrap_or_default();
                for task in tasks {
                    let read = |f: &str| {
                        std::fs::read_to_string(task.join(f))
                            .unwrap_or_default()
                            .trim()
                            .to_owned()
                    };
                    let _ = writeln!(
                        out,
                        "engine {pid} task {}: wchan {} syscall {} stat {}",
                        task.display(),
                        read("wchan"),
                        read("syscall"),
                        read("stat")
                    );
                }
                if let Ok(gdb) = Command::new("timeout")
                    .args([
                        "20",
                        "gdb",
                        "-p",
                        pid,
                        "-batch",
                        "-ex",
                        "thread apply all bt 30",
                    ])
                    .output()
                {
                    for line in String::from_utf8_lossy(&gdb.stdout)
                        .lines()
                        .filter(|l| l.starts_with('#') || l.starts_with("Thread"))
                        .take(120)
                    {
                        let _ = writeln!(out, "gdb {pid}: {line}");
                    }
                }
            }
        }
        if let Ok(ps) = Command::new("ps")
            .args(["-eo", "pid,ppid,pgid,stat,etime,args"])
            .output()
        {
            for line in String::from_utf8_lossy(&ps.stdout).lines() {
                if line.contains("handoffs") || line.contains("rcpt") || line.contains("sleep") {
                    let _ = writeln!(out, "ps: {line}");
                }
            }
        }
        out
    }

    /// The runs the recipient script logged: request id → (start ns, end ns).
    pub fn runs(&self) -> Vec<Run> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let mut runs: Vec<Run> = Vec::new();
        for line in text.lines() {
            let parts: Vec<&str> = line.split_whitespace().collect();
            match parts.as_slice() {
                ["start", req, ns, agent] => runs.push(Run {
                    request_id: (*req).to_owned(),
                    agent: (*agent).to_owned(),
                    start: ns.parse().unwrap(),
                    end: None,
                }),
                ["end", req, ns, _] => {
                    if let Some(r) = runs
                        .iter_mut()
                        .rev()
                        .find(|r| r.request_id == *req && r.end.is_none())
                    {
                        r.end = Some(ns.parse().unwrap());
                    }
                }
                ["missing-text", req] => panic!("run {req} had no text file"),
                // The lease token an HTTP write carried (tests/postgres.rs reads them).
                ["fence", _, _] => {}
                ["unreserved", req] => panic!(
                    "G8: request {req} reached the recipient before its reservation was committed"
                ),
                _ => panic!("unexpected log line {line:?}"),
            }
        }
        runs
    }
}

#[derive(Debug, Clone)]
pub struct Run {
    pub request_id: String,
    pub agent: String,
    pub start: u128,
    pub end: Option<u128>,
}

/// G2: at most one run per request id.
pub fn assert_one_run_per_request(runs: &[Run]) {
    let mut seen = std::collections::BTreeSet::new();
    for r in runs {
        assert!(
            seen.insert(&r.request_id),
            "request {} ran twice",
            r.request_id
        );
    }
}

/// G3: runs to one recipient never overlap.
pub fn assert_no_overlap(runs: &[Run]) {
    let mut by_agent: BTreeMap<&str, Vec<&Run>> = BTreeMap::new();
    for r in runs {
        by_agent.entry(&r.agent).or_default().push(r);
    }
    for (agent, mut rs) in by_agent {
        rs.sort_by_key(|r| r.start);
        for pair in rs.windows(2) {
            let end = pair[0].end.unwrap_or(u128::MAX);
            assert!(
                end <= pair[1].start,
                "runs to {agent} overlap: {} ended at {end}, {} started at {}",
                pair[0].request_id,
                pair[1].request_id,
                pair[1].start
            );
        }
    }
}

/// A running engine process, killed (SIGKILL) when dropped, so a failing test never leaves
/// one behind.
pub struct Engine(pub Child);

impl Drop for Engine {
    fn drop(&mut self) {
        kill9(self);
    }
}

pub fn kill9(engine: &mut Engine) {
    // SIGKILL: std's kill() sends SIGKILL on Unix.
    let _ = engine.0.kill();
    let _ = engine.0.wait();
}

/// Whether the database at `db` holds, right now, a committed reservation of `request_id`
/// with its write issued: what a recipient can check as a write arrives (G8).
pub fn reservation_committed(db: &Path, request_id: &str) -> bool {
    if is_postgres(db) {
        return reservation_committed_pg(db, request_id);
    }
    let Ok(conn) =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
    else {
        return false;
    };
    let _ = conn.busy_timeout(Duration::from_secs(5));
    // Reserved: the current request id, SENDING with the write issued or past it (a write
    // delayed on the way may arrive after the engine gave up on it), or an earlier one.
    let n: i64 = conn
        .query_row(
            "SELECT count(*) FROM deliveries WHERE
               (json_extract(record, '$.core.request_id') = ?1 AND (
                  (state = 'SENDING' AND json_extract(record, '$.issued_at') IS NOT NULL)
                  OR state IN ('UNCERTAIN', 'ACCEPTED', 'RUNNING', 'RETURNED', 'FAILED',
                               'CANCELLED', 'ACKNOWLEDGED')))
               OR EXISTS (SELECT 1 FROM json_each(record, '$.core.earlier_request_ids')
                          WHERE value = ?1)",
            [request_id],
            |r| r.get(0),
        )
        .unwrap_or_else(|e| panic!("the recipient could not read the database: {e}"));
    n > 0
}

/// [`reservation_committed`] on PostgreSQL: the same question in its JSON operators, on a
/// session of its own (from a plain thread: the recipient answers inside a runtime).
fn reservation_committed_pg(db: &Path, request_id: &str) -> bool {
    let (url, req) = (db.to_string_lossy().into_owned(), request_id.to_owned());
    std::thread::spawn(move || {
        let mut client = ::postgres::Client::connect(&url, ::postgres::NoTls)
            .unwrap_or_else(|e| panic!("the recipient could not reach the database: {e}"));
        let row = client
            .query_one(
                "SELECT count(*) FROM deliveries WHERE
                   (CAST(record AS jsonb) #>> '{core,request_id}' = $1 AND (
                      (state = 'SENDING' AND CAST(record AS jsonb) -> 'issued_at' IS NOT NULL
                         AND CAST(record AS jsonb) -> 'issued_at' <> 'null'::jsonb)
                      OR state IN ('UNCERTAIN', 'ACCEPTED', 'RUNNING', 'RETURNED', 'FAILED',
                                   'CANCELLED', 'ACKNOWLEDGED')))
                   OR CAST(record AS jsonb) #> '{core,earlier_request_ids}' ? $1",
                &[&req],
            )
            .unwrap_or_else(|e| panic!("the recipient could not read the database: {e}"));
        row.get::<_, i64>(0) > 0
    })
    .join()
    .expect("look up a reservation")
}

/// Serves POSTs on a loopback port until the test process ends, logging each to `log`;
/// returns the URL. With `db`, each POST first looks up its reservation in that database
/// file and logs `unreserved <request>` when none is committed (G8).
pub fn http_recipient(log: PathBuf, db: Option<PathBuf>) -> String {
    http_recipient_taking(log, db, Duration::ZERO)
}

/// [`http_recipient`] whose every POST takes `delay` before it answers (a recipient that is
/// slow to accept, so work is still queued when an engine is killed).
pub fn http_recipient_taking(log: PathBuf, db: Option<PathBuf>, delay: Duration) -> String {
    use std::io::Write as _;
    let log = std::sync::Arc::new(std::sync::Mutex::new(log));
    let seen: std::sync::Arc<std::sync::Mutex<std::collections::HashSet<String>>> =
        std::sync::Arc::default();
    let seen2 = seen.clone();
    let app = axum::Router::new()
        .route(
            "/",
            axum::routing::post(move |body: axum::Json<Value>| {
                let log = log.clone();
                let seen = seen.clone();
                let db = db.clone();
                async move {
                    tokio::time::sleep(delay).await;
                    let req = body["request_id"].as_str().unwrap_or("?").to_owned();
                    let reserved = db
                        .as_deref()
                        .is_none_or(|db| reservation_committed(db, &req));
                    seen.lock().unwrap().insert(req.clone());
                    let agent = body["agent"].as_str().unwrap_or("?").to_owned();
                    let ns = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .unwrap()
                        .as_nanos();
                    let path = log.lock().unwrap();
                    let mut f = std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(&*path)
                        .unwrap();
                    // One write of the whole text: the scripts append to the same
                    // log, and O_APPEND keeps only single writes whole.
                    let mut text = String::new();
                    if !reserved {
                        text.push_str(&format!("unreserved {req}\n"));
                    }
                    if let Some(fence) = body["fence"].as_i64() {
                        text.push_str(&format!("fence {agent} {fence}\n"));
                    }
                    text.push_str(&format!(
                        "start {req} {ns} {agent}\nend {req} {ns} {agent}\n"
                    ));
                    f.write_all(text.as_bytes()).unwrap();
                    "{}"
                }
            }),
        )
        .route(
            "/status/{request_id}",
            axum::routing::get(
                move |axum::extract::Path(req): axum::extract::Path<String>| {
                    let known = seen2.lock().unwrap().contains(&req);
                    async move {
                        if known {
                            (axum::http::StatusCode::OK, r#"{"status":"returned"}"#)
                        } else {
                            (axum::http::StatusCode::NOT_FOUND, "{}")
                        }
                    }
                },
            ),
        );
    serve(app)
}

/// Serves `app` on a loopback port, from a thread of its own, until the test process ends;
/// returns its base URL (`http://127.0.0.1:PORT/`).
pub fn serve(app: axum::Router) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    let addr = rx.recv().expect("server address");
    format!("http://{addr}/")
}

/// Starts `cmd`, reads stdout until a line with the URL, returns (child, base URL).
pub fn start_serving(mut cmd: Command) -> (Child, String) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("read");
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://") || w.starts_with("https://"))
        .unwrap_or_else(|| panic!("no URL in {line:?}"))
        .split('#')
        .next()
        .expect("url")
        .trim_end_matches('/')
        .to_owned();
    // Keep draining stdout so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in out.lines() {});
    (child, url)
}

/// The pids of this database's run supervisors (`handoffs supervise`), from /proc.
pub fn supervisors(db: &Path) -> Vec<i32> {
    let db = std::fs::canonicalize(db).unwrap_or_else(|_| db.to_owned());
    let needle = db.to_string_lossy().into_owned();
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        // On PostgreSQL the database's URL travels in the environment, not the arguments.
        let ours = if is_postgres(&db) {
            std::fs::read(entry.path().join("environ")).is_ok_and(|env| {
                env.split(|b| *b == 0)
                    .any(|v| v == format!("HANDOFFS_DB={needle}").as_bytes())
            })
        } else {
            args.contains(&needle)
        };
        if args.iter().any(|a| a == "supervise") && ours {
            pids.push(pid);
        }
    }
    pids
}

/// A real agent CLI (`claude`, `codex`): `$env_var`, else what `.ci/run` installs in
/// `.ci/node`, else `PATH`. `None` (the case is skipped, and says so) when it is missing,
/// except under `CI=true`, where a missing CLI fails the case.
pub fn cli_or_skip(name: &str, env_var: &str) -> Option<PathBuf> {
    let found = std::env::var_os(env_var).map(PathBuf::from).or_else(|| {
        let ci = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(".ci/node/node_modules/.bin")
            .join(name);
        if ci.exists() {
            return Some(ci);
        }
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "the {name} CLI is not installed (CI=true): run .ci/run, or set {env_var}"
        );
        eprintln!("skipped: the {name} CLI is not installed (set {env_var})");
    }
    found
}

/// A loopback mock model (`tests/mocks/<script>`, Python), killed when dropped.
pub struct MockModel {
    child: Child,
    pub port: u16,
}

impl Drop for MockModel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl MockModel {
    pub fn start(script: &str, dir: &Path) -> MockModel {
        let port_file = dir.join("mock.port");
        let script = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/mocks")
            .join(script);
        let child = Command::new("python3")
            .arg(script)
            .args(["--port", "0", "--port-file"])
            .arg(&port_file)
            .arg("--log")
            .arg(dir.join("mock.jsonl"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 runs the mock model");
        // Owned at once, so a mock that never says its port is still killed and reaped.
        let mut mock = MockModel { child, port: 0 };
        let start = Instant::now();
        loop {
            if let Ok(text) = std::fs::read_to_string(&port_file)
                && let Ok(port) = text.trim().parse()
            {
                mock.port = port;
                return mock;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "the mock model did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// One HTTP exchange with the mock; the answer's JSON body.
    pub fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        use std::io::{Read as _, Write as _};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).expect("mock");
        let body = body.map(Value::to_string).unwrap_or_default();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        let json = out.split("\r\n\r\n").nth(1).unwrap_or("null");
        serde_json::from_str(json).unwrap_or(Value::Null)
    }

    /// Changes how the mock answers (`{"mode": …, "delay": seconds}`).
    pub fn set(&self, config: &Value) {
        self.call("POST", "/_mock/config", Some(config));
    }
}
