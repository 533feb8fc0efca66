//! What only the PostgreSQL backend has: its schema kept beside SQLite's, and engines on
//! several machines sharing one database: each recipient served by one engine at a time
//! under a lease, engines killed alternately (nothing lost or doubled, every recipient
//! served again within a bound), an engine paused past its lease writing nothing (fencing),
//! each machine's local agents served by its own engine, and an engine whose session is
//! gone starting again. These run whichever side
//! of the test matrix is on, against the server `HANDOFFS_TEST_POSTGRES` names.

mod common;

use common::{World, assert_one_run_per_request, kill9};
use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// The cases whose pauses and leases are timed run one at a time (cargo runs a test binary's
/// cases two at a time on two cores; a SIGSTOP case beside the kill case would starve both).
fn timing() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Every table and its columns, in the database at `db` (either backend).
fn columns(db: &std::path::Path) -> BTreeMap<String, Vec<String>> {
    let rows = if common::is_postgres(db) {
        common::sql_rows(
            db,
            "SELECT c.table_name || '.' || c.column_name FROM information_schema.columns c
             JOIN information_schema.tables t
               ON t.table_schema = c.table_schema AND t.table_name = c.table_name
             WHERE c.table_schema = current_schema() AND c.table_name <> 'handoffs_meta'
               AND t.table_type = 'BASE TABLE'
             ORDER BY 1",
        )
    } else {
        common::sql_rows(
            db,
            "SELECT m.name || '.' || p.name FROM sqlite_master m, pragma_table_info(m.name) p
             WHERE m.type = 'table' AND m.name NOT LIKE 'sqlite_%' ORDER BY 1",
        )
    };
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for r in rows {
        let (table, column) = r.split_once('.').expect("table.column");
        out.entry(table.to_owned())
            .or_default()
            .push(column.to_owned());
    }
    out
}

#[test]
fn both_backends_hold_the_same_tables_and_columns() {
    let Some(admin) = common::postgres_or_skip("schema parity") else {
        return;
    };
    let pg = World::on_postgres(&admin);
    let dir = tempfile::tempdir().unwrap();
    let lite = dir.path().join("h.sqlite3");
    let out = pg
        .cmd()
        .env("HANDOFFS_DB", &lite)
        .arg("init")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let (a, b) = (columns(&lite), columns(&pg.db));
    assert!(a.len() > 20, "{a:?}");
    for (table, cols) in &a {
        let mut x = cols.clone();
        let mut y = b.get(table).cloned().unwrap_or_default();
        x.sort();
        y.sort();
        assert_eq!(x, y, "table {table}: SQLite's columns, PostgreSQL's");
    }
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "the same tables"
    );
}

/// An engine on this world's database with its log in `name`.
fn engine(w: &World, name: &str) -> common::Engine {
    engine_with(w, name, &[])
}

/// The `run` an engine of these cases is.
const RUN: [&str; 3] = ["run", "--interval", "0.2"];

/// An engine with `env` besides the world's, its log appended to `name`.
fn engine_with(w: &World, name: &str, env: &[(&str, &str)]) -> common::Engine {
    process_with(w, name, &RUN, env)
}

/// `handoffs ARGS` (an engine, or `serve` with its own) with `env` besides the world's, its
/// log appended to `name`.
fn process_with(w: &World, name: &str, args: &[&str], env: &[(&str, &str)]) -> common::Engine {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(w.dir.path().join(name))
        .unwrap();
    let mut cmd = w.cmd();
    cmd.args(args)
        .env("HANDOFFS_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log);
    for (k, v) in env {
        cmd.env(k, v);
    }
    common::Engine(cmd.spawn().expect("spawn engine"))
}

/// The recipient leases as stored: recipient → (engine, fence, expires at).
fn leases(w: &World) -> BTreeMap<String, (String, i64, i64)> {
    common::sql_rows(
        &w.db,
        "SELECT agent || ' ' || engine || ' ' || fence || ' ' || expires_at FROM recipient_leases",
    )
    .into_iter()
    .map(|r| {
        let p: Vec<&str> = r.split(' ').collect();
        (
            p[0].to_owned(),
            (
                p[1].to_owned(),
                p[2].parse().unwrap(),
                p[3].parse().unwrap(),
            ),
        )
    })
    .collect()
}

/// Whether `dev`'s lease passed from the engine with pid `from` (at token `fence`) to another.
fn taken_over(w: &World, fence: i64, from: u32) -> bool {
    leases(w)
        .get("dev")
        .is_some_and(|(e, f, _)| *f > fence && !is_pid(e, from))
}

/// Milliseconds since the epoch.
fn now_ms() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

/// Whether the engine id `engine` (machine/pid/random) is the process `pid`'s.
fn is_pid(engine: &str, pid: u32) -> bool {
    engine.split('/').nth(1) == Some(pid.to_string().as_str())
}

fn log_of(w: &World, name: &str) -> String {
    std::fs::read_to_string(w.dir.path().join(name)).unwrap_or_default()
}

/// Waits until `done()`, at most `limit`; panics with `what` and both engines' logs.
fn wait_until(w: &World, limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < limit,
            "{what} within {limit:?}\nengine a: {}\nengine b: {}",
            log_of(w, "a.log"),
            log_of(w, "b.log")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn returned(w: &World, id: &str) -> bool {
    w.json(&["status", id])["state"] == "RETURNED"
}

/// A world on PostgreSQL with a demo sender and an HTTP recipient that checks G8.
fn team(admin: &str) -> World {
    let w = World::on_postgres(admin);
    w.ok(&["agent", "add", "lead", "--provider", "demo"]);
    w.add_http_agent("dev");
    w
}

/// Sends `text` from lead to dev; the message id.
fn send(w: &World, text: &str) -> String {
    w.json(&["send", "lead", "dev", text])["message"]["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Every engine's session is ended under it (a network cut, a server restart, an
/// administrator): each opens a new one and goes on, or, when the cut took a commit with it,
/// starts again on a new session. The handoff sent after the cut runs once.
#[test]
fn engines_whose_sessions_ended_go_on_and_deliver_once() {
    let Some(admin) = common::postgres_or_skip("lost engine sessions") else {
        return;
    };
    let w = team(&admin);
    let mut a = engine(&w, "a.log");
    let mut b = engine(&w, "b.log");
    let first = send(&w, "before the cut");
    wait_until(
        &w,
        Duration::from_secs(20),
        "the first handoff delivered",
        || returned(&w, &first),
    );
    let ended = common::sql_rows(
        &w.db,
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()) AS cut",
    );
    assert_ne!(
        ended,
        vec!["0".to_owned()],
        "the engines' sessions were ended"
    );
    let sent = send(&w, "after the cut");
    wait_until(&w, Duration::from_secs(20), "the handoff delivered", || {
        returned(&w, &sent)
    });
    std::thread::sleep(Duration::from_secs(1));
    let runs = w.runs();
    assert_one_run_per_request(&runs);
    assert_eq!(runs.len(), 2, "{runs:?}");
    for (name, e) in [("a", &mut a), ("b", &mut b)] {
        assert!(
            e.0.try_wait().unwrap().is_none(),
            "engine {name} still runs: {}",
            log_of(&w, &format!("{name}.log"))
        );
    }
}

/// The world's database out of reach until dropped: closed to new sessions and every
/// session of it ended (from the server's own database: a database cannot close itself).
struct ServerAway {
    admin: String,
    name: String,
}

fn server_away(admin: &str, w: &World) -> ServerAway {
    let name = common::sql_rows(&w.db, "SELECT current_database()").remove(0);
    common::sql_rows(
        std::path::Path::new(admin),
        &format!(
            "ALTER DATABASE \"{name}\" ALLOW_CONNECTIONS false;
             SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"
        ),
    );
    ServerAway {
        admin: admin.to_owned(),
        name,
    }
}

impl Drop for ServerAway {
    fn drop(&mut self) {
        common::sql_rows(
            std::path::Path::new(&self.admin),
            &format!("ALTER DATABASE \"{}\" ALLOW_CONNECTIONS true", self.name),
        );
    }
}

/// `serve` and `demo` started while their server turns sessions away (compose.yaml starts
/// them beside it; a server restarting) wait for it, saying so once, and come up when it
/// answers, as `run` does: both exited at once before. What no wait changes is said at once:
/// a wrong flag (exit 2), a login the server refuses (a database that does not exist; `run`
/// waited for it forever before).
#[test]
fn serve_and_demo_wait_for_a_server_that_does_not_answer_yet() {
    let Some(admin) = common::postgres_or_skip("serve and demo waiting for their server") else {
        return;
    };
    let w = team(&admin);
    let away = server_away(&admin, &w);
    // Their stdout too: where they say they are up.
    let spawn = |log: &str, args: &[&str]| {
        let out = std::fs::File::create(w.dir.path().join(log)).unwrap();
        let mut cmd = w.cmd();
        cmd.args(args).stdout(out.try_clone().unwrap()).stderr(out);
        common::Engine(cmd.spawn().expect("spawn"))
    };
    // A wrong flag is said at once, server or not.
    let flag = w
        .cmd()
        .args(["serve", "--port", "0", "--tls-cert", "/nonexistent.pem"])
        .args(["--tls-key", "/nonexistent.key"])
        .output()
        .unwrap();
    assert_eq!(
        flag.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&flag.stderr)
    );
    let mut serve = spawn("serve.log", &["serve", "--port", "0"]);
    let mut demo = spawn("demo.log", &["demo", "--port", "0"]);
    for (log, p) in [("serve.log", &mut serve), ("demo.log", &mut demo)] {
        wait_until(
            &w,
            Duration::from_secs(30),
            &format!("{log}: waits"),
            || log_of(&w, log).contains("trying again every second"),
        );
        assert!(
            p.0.try_wait().unwrap().is_none(),
            "{log}: exited while its server was away: {}",
            log_of(&w, log)
        );
    }
    std::thread::sleep(Duration::from_secs(2));
    for log in ["serve.log", "demo.log"] {
        assert_eq!(
            log_of(&w, log).matches("trying again").count(),
            1,
            "{log}: said once: {}",
            log_of(&w, log)
        );
    }
    // A server that refuses the login for good (here: no such database) is said at once,
    // not waited for.
    let mut gone = url::Url::parse(&w.db.to_string_lossy()).unwrap();
    gone.set_path("/no_such_database");
    for args in [
        &["serve", "--port", "0"][..],
        &["demo", "--port", "0"],
        &["run"],
    ] {
        let said = w.dir.path().join("refused.log");
        let mut p = common::Engine(
            w.cmd()
                .env("HANDOFFS_DB", gone.as_str())
                .args(args)
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&said).unwrap())
                .spawn()
                .unwrap(),
        );
        let t0 = Instant::now();
        let status = loop {
            if let Some(status) = p.0.try_wait().unwrap() {
                break status;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(15),
                "{args:?}: still waiting for a database that does not exist: {}",
                std::fs::read_to_string(&said).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let said = std::fs::read_to_string(&said).unwrap_or_default();
        assert_eq!(status.code(), Some(1), "{args:?}: {said}");
        assert!(
            said.contains("does not exist") && !said.contains("trying again"),
            "{args:?}: {said}"
        );
    }
    drop(away);
    for (log, up) in [
        ("serve.log", "handoffs: serving http://"),
        ("demo.log", "handoffs demo: open http://"),
    ] {
        let t0 = Instant::now();
        while !log_of(&w, log).contains(up) {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "{log}: not up 30 s after its server came back: {}",
                log_of(&w, log)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A `run` whose server goes out of reach for a while (its sessions ended, its database
/// closed to new ones) goes on trying, says so without flooding its log (each distinct error
/// once a window, the same ones again once every 10 s: it logged every error of every pass,
/// about five lines a second, before), and delivers again once the server is back.
#[test]
fn a_run_rides_out_a_server_away_and_says_so_quietly() {
    let Some(admin) = common::postgres_or_skip("a server away for a while") else {
        return;
    };
    let w = team(&admin);
    let _a = engine(&w, "a.log");
    let first = send(&w, "before the server went away");
    wait_until(&w, Duration::from_secs(20), "the handoff delivered", || {
        returned(&w, &first)
    });
    let away = server_away(&admin, &w);
    std::thread::sleep(Duration::from_secs(6));
    drop(away);
    let log = log_of(&w, "a.log");
    let said = log.matches("engine pass").count();
    assert!(said > 0, "the engine said the server was away: {log}");
    assert!(
        said <= 6,
        "the engine said the same errors {said} times in 6 s: {log}"
    );
    let second = send(&w, "after the server came back");
    wait_until(
        &w,
        Duration::from_secs(30),
        "the handoff delivered after the server came back",
        || returned(&w, &second),
    );
}

/// Sends `text` from lead to dev through the database URL `db` (its own TLS settings), and
/// waits until the engine running has returned it.
fn sent_and_returned(w: &World, db: &str, text: &str) {
    let sent = w
        .cmd()
        .env("HANDOFFS_DB", db)
        .args(["send", "lead", "dev", text, "--json"])
        .output()
        .unwrap();
    assert!(sent.status.success(), "{sent:?}");
    let id = serde_json::from_slice::<serde_json::Value>(&sent.stdout).unwrap()["message"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    wait_until(w, Duration::from_secs(20), "the handoff delivered", || {
        returned(w, &id)
    });
}

/// TLS to the server: with `sslmode=require` and `sslrootcert` (the test server's own CA,
/// which .ci/run makes) the CLI and an engine work over encrypted sessions only, a handoff
/// goes through, and the server's certificate is checked: without the CA it is refused, by
/// name. With no `sslmode` a session is not encrypted, as before TLS was supported.
#[test]
fn sslmode_require_encrypts_every_session_and_checks_the_servers_certificate() {
    let Some(admin) = common::postgres_or_skip("TLS to the server") else {
        return;
    };
    let Some(ca) = std::env::var_os("HANDOFFS_TEST_POSTGRES_CA") else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "the test server offers no TLS (CI=true): start it with ssl on and set HANDOFFS_TEST_POSTGRES_CA to its CA, as .ci/run does"
        );
        eprintln!("skipped: no HANDOFFS_TEST_POSTGRES_CA (the test server's CA)");
        return;
    };
    let w = team(&admin);
    let plain = w.db.to_string_lossy().into_owned();
    let sep = if plain.contains('?') { '&' } else { '?' };
    let tls = format!(
        "{plain}{sep}sslmode=require&sslrootcert={}",
        ca.to_string_lossy()
    );
    let refused = w
        .cmd()
        .env("HANDOFFS_DB", format!("{plain}{sep}sslmode=require"))
        .args(["agent", "list"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&refused.stderr).into_owned();
    assert_eq!(refused.status.code(), Some(1), "{said}");
    assert!(said.contains("invalid peer certificate"), "{said}");
    let _a = process_with(&w, "a.log", &RUN, &[("HANDOFFS_DB", &tls)]);
    sent_and_returned(&w, &tls, "over TLS");
    let sessions = |ssl: bool| {
        common::sql_rows(
            &w.db,
            &format!(
                "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a ON a.pid = s.pid
                 WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
                   AND a.backend_type = 'client backend' AND s.ssl = {ssl}"
            ),
        )
        .remove(0)
    };
    assert_ne!(sessions(true), "0", "the engine's sessions are encrypted");
    assert_eq!(
        sessions(false),
        "0",
        "no session of the engine is in clear: {}",
        log_of(&w, "a.log")
    );
}

/// A role that logs in by certificate only (pg_hba's `cert` method, as .ci/run sets up for
/// `handoffs_cert`): with `sslcert`/`sslkey` in the URL an engine and a sender work on the
/// shared database, and the server saw that certificate on every session of theirs; without
/// it the server turns them away and the error says so; a key others may read is refused by
/// name before any connection.
#[test]
fn a_client_certificate_logs_in_a_role_that_takes_nothing_else() {
    let Some(admin) = common::postgres_or_skip("client certificates") else {
        return;
    };
    let files = ["CA", "CLIENT_CERT", "CLIENT_KEY"]
        .map(|what| std::env::var(format!("HANDOFFS_TEST_POSTGRES_{what}")).ok());
    let [Some(ca), Some(cert), Some(key)] = files else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "the test server takes no client certificate (CI=true): set HANDOFFS_TEST_POSTGRES_CA, _CLIENT_CERT and _CLIENT_KEY, and let the role handoffs_cert log in by `cert` only, as .ci/run does"
        );
        eprintln!("skipped: no HANDOFFS_TEST_POSTGRES_CLIENT_CERT/_KEY (a client certificate)");
        return;
    };
    common::sql_rows(
        std::path::Path::new(&admin),
        "DO $$ BEGIN CREATE ROLE handoffs_cert LOGIN SUPERUSER; \
         EXCEPTION WHEN duplicate_object THEN NULL; END $$",
    );
    let w = team(&admin);
    let mut url = url::Url::parse(&w.db.to_string_lossy()).unwrap();
    url.set_username("handoffs_cert").unwrap();
    let base = format!("{url}?sslmode=require&sslrootcert={ca}");
    let with_cert = format!("{base}&sslcert={cert}&sslkey={key}");
    let as_cert =
        |db: &str, args: &[&str]| w.cmd().env("HANDOFFS_DB", db).args(args).output().unwrap();

    let bare = as_cert(&base, &["agent", "list"]);
    let said = String::from_utf8_lossy(&bare.stderr).into_owned();
    assert_eq!(bare.status.code(), Some(1), "{said}");
    assert!(
        said.contains("certificate"),
        "the refusal names the missing certificate: {said}"
    );
    assert_eq!(said.trim().lines().count(), 1, "one line: {said}");

    let open_key = w.dir.path().join("open.key");
    std::fs::copy(&key, &open_key).unwrap();
    std::fs::set_permissions(
        &open_key,
        <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o644),
    )
    .unwrap();
    let open = as_cert(
        &format!("{base}&sslcert={cert}&sslkey={}", open_key.display()),
        &["agent", "list"],
    );
    let said = String::from_utf8_lossy(&open.stderr).into_owned();
    assert_eq!(open.status.code(), Some(1), "{said}");
    assert!(said.contains("may read it"), "{said}");

    let _a = process_with(&w, "a.log", &RUN, &[("HANDOFFS_DB", &with_cert)]);
    sent_and_returned(&w, &with_cert, "by certificate");
    let dns = common::sql_rows(
        &w.db,
        "SELECT coalesce(s.client_dn, '(none)') FROM pg_stat_ssl s \
         JOIN pg_stat_activity a ON a.pid = s.pid \
         WHERE a.datname = current_database() AND a.usename = 'handoffs_cert'",
    );
    assert!(
        !dns.is_empty(),
        "the engine holds sessions as handoffs_cert: {}",
        log_of(&w, "a.log")
    );
    assert!(
        dns.iter().all(|dn| dn == "/CN=handoffs_cert"),
        "every session of the engine showed the certificate: {dns:?}"
    );
}

/// A `tick` on a shared database renews the leases of the recipients it serves while its
/// jobs last, as `run` does: its write waits 3 s on a slow recipient, three times the 1 s
/// lease, and all that while the lease stays the tick's, its expiry ahead of the clock (so
/// no other engine may take the recipient), until the tick ends and lets it go.
#[test]
fn a_tick_keeps_its_leases_while_its_writes_last() {
    let Some(admin) = common::postgres_or_skip("a tick's leases") else {
        return;
    };
    let _one = timing();
    let w = World::on_postgres(&admin);
    w.ok(&["agent", "add", "lead", "--provider", "demo"]);
    let posts = w.dir.path().join("posts.log");
    let url = common::http_recipient_taking(posts.clone(), None, Duration::from_secs(3));
    w.register_http_agent("dev", &url);
    let id = send(&w, "slow to accept");
    let mut tick = w
        .cmd()
        .args(["tick"])
        .env("HANDOFFS_LEASE_MS", "1000")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(w.dir.path().join("a.log")).unwrap())
        .spawn()
        .expect("spawn tick");
    let started = Instant::now();
    let mut seen = 0;
    while tick.try_wait().unwrap().is_none() {
        // A lease let go keeps its row (and token), expiring at 0.
        if let Some((engine, _, expires)) = leases(&w).get("dev").filter(|l| l.2 != 0) {
            let now = now_ms();
            assert!(
                *expires > now,
                "dev's lease (engine {engine}) expired {} ms ago while the tick still served it, {:?} into the tick",
                now - expires,
                started.elapsed()
            );
            seen += 1;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the tick ended within 30 s: {}",
            log_of(&w, "a.log")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(tick.wait().unwrap().success(), "{}", log_of(&w, "a.log"));
    assert!(
        seen >= 20,
        "the tick's lease was seen while its 3 s write lasted ({seen} looks)"
    );
    let written = std::fs::read_to_string(&posts).unwrap_or_default();
    assert!(written.contains("start "), "{id} was written: {written}");
    assert_eq!(
        leases(&w).get("dev").map(|l| l.2),
        Some(0),
        "the tick let its lease go"
    );
}

/// Recipients with a delivery not yet settled (queued, waiting, in a turn, uncertain).
fn unsettled_recipients(w: &World) -> Vec<String> {
    common::sql_rows(
        &w.db,
        "SELECT DISTINCT recipient FROM deliveries WHERE class IN ('pending', 'active') ORDER BY 1",
    )
}

/// Two machines' engines on one database, each recipient served by one of them at a time:
/// the engines are SIGKILLed alternately while handoffs flow to four HTTP recipients that
/// take 100 ms to accept (each killed engine is replaced at once, as a service manager would).
/// No handoff is lost or doubled: each is written once, never before its reservation was
/// committed (G2, G8), or, cut off by a kill before the recipient took it, proven never
/// delivered and released (G5); and after each kill
/// every recipient the killed engine held with work left is served by another engine
/// within the bound (the lease, 5 s here, and 5 s).
#[test]
fn two_engines_killed_alternately_lose_nothing_and_double_nothing() {
    let Some(admin) = common::postgres_or_skip("two engines killed alternately") else {
        return;
    };
    let w = World::on_postgres(&admin);
    w.ok(&["agent", "add", "lead", "--provider", "demo"]);
    let recipients = ["dev1", "dev2", "dev3", "dev4"];
    for r in recipients {
        let url = common::http_recipient_taking(
            w.log.clone(),
            Some(w.db.clone()),
            Duration::from_millis(100),
        );
        w.register_http_agent(r, &url);
    }
    let _one_at_a_time = timing();
    let lease = [("HANDOFFS_LEASE_MS", "5000")];
    let bound = Duration::from_secs(10);
    let mut engines = [
        engine_with(&w, "a.log", &lease),
        engine_with(&w, "b.log", &lease),
    ];
    let mut sent = Vec::new();
    let mut slowest = Duration::ZERO;
    let mut served_by = std::collections::BTreeSet::new();
    let mut takeovers = 0;
    for round in 0..8_usize {
        for i in 0..12 {
            let to = recipients[i % recipients.len()];
            let out = w.json(&["send", "lead", to, &format!("round {round} handoff {i}")]);
            sent.push(out["message"]["id"].as_str().unwrap().to_owned());
        }
        std::thread::sleep(Duration::from_millis(100 * (round as u64 % 3)));
        let victim = round % 2;
        let pid = engines[victim].0.id();
        let before = leases(&w);
        let busy = unsettled_recipients(&w);
        for (engine, _, _) in before.values() {
            served_by.insert(engine.split('/').nth(1).unwrap_or_default().to_owned());
        }
        kill9(&mut engines[victim]);
        let killed = Instant::now();
        let name = if victim == 0 { "a.log" } else { "b.log" };
        engines[victim] = engine_with(&w, name, &lease);
        // What the killed engine held, with work left: served again by another engine.
        let held: Vec<(String, i64)> = before
            .iter()
            .filter(|(r, (engine, _, expires))| {
                is_pid(engine, pid) && *expires > now_ms() && busy.contains(r)
            })
            .map(|(r, (_, fence, _))| (r.clone(), *fence))
            .collect();
        takeovers += held.len();
        for (r, fence) in held {
            wait_until(
                &w,
                bound,
                &format!(
                    "round {round}: {r}, held by the killed engine (fence {fence}), served again"
                ),
                || {
                    !unsettled_recipients(&w).contains(&r)
                        || leases(&w)
                            .get(&r)
                            .is_some_and(|(e, f, x)| !is_pid(e, pid) && *f > fence && *x > now_ms())
                },
            );
            slowest = slowest.max(killed.elapsed());
        }
    }
    // Settled: delivered, or (a write cut off by a kill before the recipient took it) proven
    // never delivered by history scans and released. Nothing is pending or in flight.
    let total = i64::try_from(sent.len()).unwrap();
    w.wait_for(Duration::from_secs(60), |c| {
        c.get("RETURNED").copied().unwrap_or(0) + c.get("CANCELLED").copied().unwrap_or(0) == total
    });
    let counts = w.counts();
    assert_eq!(
        counts.values().sum::<i64>(),
        total,
        "no delivery lost: {counts:?}"
    );
    eprintln!(
        "two engines, 8 kills: {total} handoffs, {counts:?}, {takeovers} recipients taken over, slowest {slowest:?} (bound {bound:?})"
    );
    assert!(
        takeovers >= 4,
        "the kills hit engines serving recipients with work left ({takeovers} times)"
    );
    let runs = w.runs();
    assert_one_run_per_request(&runs);
    let returned = counts.get("RETURNED").copied().unwrap_or(0);
    assert_eq!(
        usize::try_from(returned).unwrap(),
        runs.len(),
        "every write the recipients took belongs to a RETURNED delivery, and a CANCELLED one never reached them: {counts:?}"
    );
    assert!(
        returned * 10 >= total * 8,
        "most handoffs delivered: {counts:?}"
    );
    let log = std::fs::read_to_string(&w.log).unwrap_or_default();
    assert!(
        !log.contains("unreserved"),
        "a write arrived before its reservation was committed (G8):\n{log}"
    );
    assert!(
        served_by.len() >= 2,
        "both engines held leases at some point: {served_by:?}"
    );
    // Each write carries its engine's lease token: per recipient, in the order the writes
    // arrived, the tokens never go down (no engine wrote under a lease that had moved on).
    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    let mut tokens = 0;
    for line in log.lines() {
        if let ["fence", agent, fence] = line.split_whitespace().collect::<Vec<_>>()[..] {
            let fence: i64 = fence.parse().unwrap();
            let before = last.insert(agent.to_owned(), fence).unwrap_or(0);
            assert!(
                fence >= before,
                "a write to {agent} under lease token {fence} arrived after one under {before}"
            );
            tokens += 1;
        }
    }
    assert_eq!(tokens, runs.len(), "every write carried its lease token");
}

/// Fencing: engine a reserves a write, and is paused (SIGSTOP) at the send boundary's look,
/// past its lease. Engine b takes the recipient's lease (its token one higher) and holds
/// the next handoff (the recipient answers it busy). Engine a, resumed, finds its lease gone:
/// its next step is refused in the step's own transaction (its reservation stays as it was,
/// never issued: provably unsent), and it writes nothing. With the step's check removed
/// (`no_step_fence`) it commits the send boundary (its write check still stops the write).
#[test]
fn a_paused_engine_writes_nothing_after_its_lease_moved() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
    let Some(admin) = common::postgres_or_skip("fencing a paused engine") else {
        return;
    };
    let _one_at_a_time = timing();
    let w = World::on_postgres(&admin);
    w.ok(&["agent", "add", "lead", "--provider", "demo"]);
    let paused = Arc::new(AtomicU32::new(0));
    let looks = Arc::new(AtomicUsize::new(0));
    let (p, l) = (paused.clone(), looks.clone());
    let activity = axum::Router::new().route(
        "/activity",
        axum::routing::get(move || {
            let (p, l) = (p.clone(), l.clone());
            async move {
                // Engine a's first look lets it reserve; at its second (the send
                // boundary's) it is paused before it hears "idle". Every later look (engine
                // b's) finds the session busy, so b writes nothing either.
                match l.fetch_add(1, Ordering::SeqCst) {
                    0 => r#"{"status":"idle"}"#,
                    1 => {
                        let pid = p.load(Ordering::SeqCst);
                        nix::sys::signal::kill(
                            nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
                            nix::sys::signal::Signal::SIGSTOP,
                        )
                        .unwrap();
                        r#"{"status":"idle"}"#
                    }
                    _ => r#"{"status":"busy"}"#,
                }
            }
        }),
    );
    let (url, posts) = recording_recipient(activity);
    w.ok(&[
        "agent",
        "add",
        "dev",
        "--provider",
        "command",
        "--set",
        &format!("url={url}"),
        "--set",
        &format!("activity_url={url}activity"),
        "--set",
        &format!("status_url={url}status/{{request_id}}"),
    ]);
    // SPEC's own timings: the reservation engine a leaves behind is not due again within the
    // test, so only the lease decides who may act on it.
    let env = [("HANDOFFS_LEASE_MS", "2000"), ("HANDOFFS_POLICY", "{}")];
    let mut a = engine_with(&w, "a.log", &env);
    paused.store(a.0.id(), Ordering::SeqCst);
    let first = send(&w, "first");
    wait_until(
        &w,
        Duration::from_secs(20),
        "engine a paused at the send boundary",
        || looks.load(Ordering::SeqCst) >= 2,
    );
    let fence_a = leases(&w)["dev"].1;
    assert_eq!(
        w.json(&["status", &first])["state"],
        "SENDING",
        "engine a reserved the write before its pause"
    );
    // Past a's lease: engine b takes the recipient for the next handoff.
    std::thread::sleep(Duration::from_millis(2_500));
    let _b = engine_with(&w, "b.log", &env);
    let second = send(&w, "second");
    wait_until(
        &w,
        Duration::from_secs(20),
        "engine b took the lease",
        || taken_over(&w, fence_a, a.0.id()),
    );
    // Engine b steps the second handoff under its lease (its look finds dev busy).
    std::thread::sleep(Duration::from_secs(1));
    let fence_b = leases(&w)["dev"].1;
    let row = || {
        common::sql_rows(
            &w.db,
            &format!(
                "SELECT updated_at || ' ' || record FROM deliveries WHERE message_id = {}",
                common::sql_text(&first)
            ),
        )
    };
    let before = row();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(a.0.id()).unwrap()),
        nix::sys::signal::Signal::SIGCONT,
    )
    .unwrap();
    // Whatever engine a does once resumed shows: its refusal, a step, or a write.
    wait_until(
        &w,
        Duration::from_secs(30),
        "engine a acted after its resume",
        || {
            log_of(&w, "a.log").contains("no longer holds the lease on dev")
                || row() != before
                || !posts.lock().unwrap().is_empty()
        },
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        row(),
        before,
        "engine a, paused past its lease (fence {fence_a}), committed a step after engine b took it (fence {fence_b})"
    );
    let writes = posts.lock().unwrap().clone();
    assert!(
        writes.is_empty(),
        "engine a, paused past its lease (fence {fence_a}), wrote after engine b took it (fence {fence_b}): {writes:?}\nengine a: {}",
        log_of(&w, "a.log")
    );
    assert!(
        log_of(&w, "a.log").contains("no longer holds the lease on dev"),
        "engine a said why it wrote nothing: {}",
        log_of(&w, "a.log")
    );
    assert_eq!(w.json(&["status", &first])["state"], "SENDING");
    assert_ne!(w.json(&["status", &second])["state"], "ACCEPTED");
    let stored = common::sql_rows(
        &w.db,
        &format!(
            "SELECT fence FROM deliveries WHERE message_id = {}",
            common::sql_text(&first)
        ),
    );
    assert_eq!(
        stored,
        vec![fence_a.to_string()],
        "the reservation carries a's token"
    );
    kill9(&mut a);
}

/// A recipient that records every POST (its body), knows of no earlier write, and answers
/// `extra`'s routes besides; its URL and what it recorded.
fn recording_recipient(
    extra: axum::Router,
) -> (
    String,
    std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>,
) {
    let posts: std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>> = std::sync::Arc::default();
    let written = posts.clone();
    let app = axum::Router::new()
        .route(
            "/",
            axum::routing::post(move |body: axum::Json<serde_json::Value>| {
                let written = written.clone();
                async move {
                    written.lock().unwrap().push(body.0);
                    "{}"
                }
            }),
        )
        .route(
            "/status/{request_id}",
            axum::routing::get(|| async { (axum::http::StatusCode::NOT_FOUND, "{}") }),
        )
        .merge(extra);
    (common::serve(app), posts)
}

/// A case with engine a held at a test-only hold (`planted-bugs` builds): on a fresh
/// PostgreSQL database, `lead` (demo) and `dev`, an HTTP recipient that records every write;
/// engine a started with `env` and `hold_var` naming a folder of its own. `None` when no
/// server is given (the case is skipped). One at a time with the other timed cases.
#[cfg(feature = "planted-bugs")]
struct HeldCase {
    w: World,
    posts: std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>,
    hold: tempfile::TempDir,
    a: common::Engine,
    /// Last, so it is let go last.
    _one_at_a_time: std::sync::MutexGuard<'static, ()>,
}

#[cfg(feature = "planted-bugs")]
fn held_case(case: &str, env: &[(&str, &str)], hold_var: &str) -> Option<HeldCase> {
    held_case_of(case, &RUN, env, hold_var)
}

/// [`held_case`] with `handoffs ARGS` as process a.
#[cfg(feature = "planted-bugs")]
fn held_case_of(
    case: &str,
    args: &[&str],
    env: &[(&str, &str)],
    hold_var: &str,
) -> Option<HeldCase> {
    let admin = common::postgres_or_skip(case)?;
    let one_at_a_time = timing();
    let w = World::on_postgres(&admin);
    w.ok(&["agent", "add", "lead", "--provider", "demo"]);
    let (url, posts) = recording_recipient(axum::Router::new());
    w.register_http_agent("dev", &url);
    let hold = tempfile::tempdir().unwrap();
    let mut held_env = env.to_vec();
    held_env.push((hold_var, hold.path().to_str().unwrap()));
    let a = process_with(&w, "a.log", args, &held_env);
    Some(HeldCase {
        w,
        posts,
        hold,
        a,
        _one_at_a_time: one_at_a_time,
    })
}

/// Fencing at the write: engine a commits a write's reservation and send boundary (the
/// write is issued) and is paused with SIGSTOP right before it goes out, past its lease;
/// engine b takes the recipient. Resumed, a finds by its own clocks that its lease is no
/// longer its own, writes nothing and says so (the write is withheld, queued again, and engine b
/// delivers it at once instead of finding it UNCERTAIN a minute later). With that check
/// removed (`no_write_fence`) it writes. Needs the test-only hold of
/// `planted-bugs` builds (`HANDOFFS_TEST_HOLD_ENGINE_WRITE`), so .ci/run runs it there.
#[cfg(feature = "planted-bugs")]
#[test]
fn a_paused_engine_whose_write_was_issued_writes_nothing_after_its_lease_moved() {
    let env = [("HANDOFFS_LEASE_MS", "2000"), ("HANDOFFS_POLICY", "{}")];
    let Some(HeldCase {
        w,
        posts,
        hold,
        mut a,
        _one_at_a_time: _serial,
    }) = held_case(
        "fencing a paused engine at the write",
        &env,
        "HANDOFFS_TEST_HOLD_ENGINE_WRITE",
    )
    else {
        return;
    };
    let pid = nix::unistd::Pid::from_raw(i32::try_from(a.0.id()).unwrap());
    let first = send(&w, "first");
    wait_until(&w, Duration::from_secs(20), "engine a at its write", || {
        hold.path().join("ready").exists()
    });
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    std::fs::write(hold.path().join("go"), "").unwrap();
    let fence_a = leases(&w)["dev"].1;
    assert_eq!(w.json(&["status", &first])["state"], "SENDING");
    std::thread::sleep(Duration::from_millis(2_500));
    let _b = engine_with(&w, "b.log", &env);
    let _second = send(&w, "second");
    wait_until(
        &w,
        Duration::from_secs(20),
        "engine b took the lease",
        || taken_over(&w, fence_a, a.0.id()),
    );
    std::thread::sleep(Duration::from_secs(1));
    let fence_b = leases(&w)["dev"].1;
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    // Whatever engine a does once resumed shows: its refusal or a write.
    wait_until(
        &w,
        Duration::from_secs(30),
        "engine a acted after its resume",
        || {
            log_of(&w, "a.log").contains("no longer holds the lease on dev")
                || !posts.lock().unwrap().is_empty()
        },
    );
    withheld_then_delivered_by_b(
        &w,
        &posts,
        &first,
        (fence_a, fence_b),
        "paused after issuing its write past its lease",
        "it",
    );
    kill9(&mut a);
}

/// Fencing when a session is cut: engine a has issued a write (held right before its
/// write-time check) when its server session ends (`pg_terminate_backend`, as a network fault
/// or a server restart would end it). Engine b takes the recipient at once (the lease names a
/// session that is gone), long before the lease would expire, so engine a still has time by
/// its own clock; released, it reads the lease in the database, writes nothing and withholds
/// the write, which engine b then delivers. Without
/// that read (the check of its own deadline alone), it wrote: the model checker's
/// counterexample (`model/tests/fencing.rs`), here with real processes. Needs the test-only
/// hold of `planted-bugs` builds (`HANDOFFS_TEST_HOLD_ENGINE_WRITE`).
#[cfg(feature = "planted-bugs")]
#[test]
fn an_engine_whose_session_was_cut_writes_nothing_after_another_took_its_recipient() {
    // The default lease (20 s): engine a's own deadline holds throughout the case.
    let env = [("HANDOFFS_POLICY", "{}")];
    let Some(HeldCase {
        w,
        posts,
        hold,
        mut a,
        _one_at_a_time: _serial,
    }) = held_case(
        "fencing an engine whose session was cut",
        &env,
        "HANDOFFS_TEST_HOLD_ENGINE_WRITE",
    )
    else {
        return;
    };
    let first = send(&w, "first");
    wait_until(&w, Duration::from_secs(20), "engine a at its write", || {
        hold.path().join("ready").exists()
    });
    let fence_a = leases(&w)["dev"].1;
    let ended = common::sql_rows(
        &w.db,
        "SELECT pg_terminate_backend(session::int)::text FROM recipient_leases WHERE agent = 'dev'",
    );
    assert_eq!(ended, ["true"], "engine a's session ended");
    let _b = engine_with(&w, "b.log", &env);
    let _second = send(&w, "second");
    wait_until(
        &w,
        Duration::from_secs(20),
        "engine b took the recipient at once",
        || taken_over(&w, fence_a, a.0.id()),
    );
    let fence_b = leases(&w)["dev"].1;
    std::fs::write(hold.path().join("go"), "").unwrap();
    wait_until(
        &w,
        Duration::from_secs(30),
        "engine a acted after its release",
        || {
            let log = log_of(&w, "a.log");
            log.contains("no longer holds the lease on dev")
                || log.contains("cannot read its lease on dev")
                || log.contains("lost the connection to PostgreSQL")
                || !posts.lock().unwrap().is_empty()
        },
    );
    withheld_then_delivered_by_b(
        &w,
        &posts,
        &first,
        (fence_a, fence_b),
        "whose session was cut",
        "its recipient",
    );
    kill9(&mut a);
}

/// A `run` whose engine failed (its session ended inside a write transaction, held there by
/// the test-only hold) while its server went out of reach (its database closed to new
/// sessions) waits to start again, saying so, and stops at once when asked, as it does while
/// it delivers: SIGTERM, as a service manager asks, ends it with 143 and "stopped". The waits
/// were plain sleeps: the process died of the signal instead (no exit code, no word).
#[cfg(feature = "planted-bugs")]
#[test]
fn a_run_waiting_for_its_server_stops_when_asked() {
    let Some(HeldCase {
        w,
        hold,
        mut a,
        _one_at_a_time: _serial,
        ..
    }) = held_case(
        "a run waiting for its server",
        &[("HANDOFFS_POLICY", "{}")],
        "HANDOFFS_TEST_HOLD_IN_WRITE",
    )
    else {
        return;
    };
    let admin = common::postgres_or_skip("a run waiting for its server").unwrap();
    wait_until(
        &w,
        Duration::from_secs(20),
        "engine a inside a write transaction",
        || hold.path().join("ready").exists(),
    );
    let away = server_away(&admin, &w);
    std::fs::write(hold.path().join("go"), "").unwrap();
    wait_until(
        &w,
        Duration::from_secs(30),
        "engine a waits to start again",
        || log_of(&w, "a.log").contains("trying again every second"),
    );
    let pid = nix::unistd::Pid::from_raw(i32::try_from(a.0.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let asked = Instant::now();
    let stopped = loop {
        if let Some(status) = a.0.try_wait().unwrap() {
            break Some(status);
        }
        if asked.elapsed() > Duration::from_secs(10) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    drop(away);
    let status = stopped.unwrap_or_else(|| {
        panic!(
            "a run waiting for its server went on for 10 s after SIGTERM: {}",
            log_of(&w, "a.log")
        )
    });
    assert_eq!(
        status.code(),
        Some(143),
        "stopped by SIGTERM: {}",
        log_of(&w, "a.log")
    );
}

/// Engine a, fenced at its write of `first` (reserved under `fence_a`), wrote nothing and said
/// so: the write is queued again at once and engine b (its token `fence_b`) delivers it, once,
/// instead of finding it UNCERTAIN when the sending timeout runs out. Every write the
/// recipient saw carries engine b's token; a write of engine a fails with "engine a, `how`
/// (fence …), wrote after engine b took `what`".
#[cfg(feature = "planted-bugs")]
fn withheld_then_delivered_by_b(
    w: &World,
    posts: &std::sync::Mutex<Vec<serde_json::Value>>,
    first: &str,
    (fence_a, fence_b): (i64, i64),
    how: &str,
    what: &str,
) {
    let of_first = |writes: &[serde_json::Value]| {
        writes
            .iter()
            .filter(|p| p["text"].as_str().is_some_and(|t| t.contains("first")))
            .count()
    };
    wait_until(
        w,
        Duration::from_secs(30),
        "engine b delivered the handoff engine a withheld",
        || of_first(&posts.lock().unwrap()) > 0,
    );
    std::thread::sleep(Duration::from_secs(1));
    let writes = posts.lock().unwrap().clone();
    assert!(
        writes.iter().all(|p| p["fence"] == fence_b),
        "engine a, {how} (fence {fence_a}), wrote after engine b took {what} (fence {fence_b}): {writes:?}\nengine a: {}",
        log_of(w, "a.log")
    );
    assert_eq!(
        of_first(&writes),
        1,
        "the withheld handoff was written once: {writes:?}"
    );
    let log = log_of(w, "a.log");
    assert!(
        (log.contains("no longer holds the lease on dev")
            || log.contains("cannot read its lease on dev"))
            && log.contains("write withheld"),
        "engine a said why it wrote nothing, and recorded it: {log}"
    );
    assert_ne!(
        w.json(&["status", first])["state"],
        "SENDING",
        "the withheld write was not left SENDING"
    );
}

/// An engine stopped inside a write transaction (SIGSTOP, a suspended laptop) holds the
/// writers' lock: the server ends its session after `IDLE_IN_TRANSACTION_MS` (10 s), so a
/// `send` and the other engine go on instead of waiting for as long as it stays stopped.
/// Resumed, the stopped engine finds its session gone, connects anew and goes on; nothing is
/// written twice. Needs the test-only hold of `planted-bugs` builds
/// (`HANDOFFS_TEST_HOLD_IN_WRITE`), so .ci/run runs it there.
#[cfg(feature = "planted-bugs")]
#[test]
fn an_engine_stopped_inside_a_write_transaction_holds_up_the_others_only_briefly() {
    let env = [("HANDOFFS_LEASE_MS", "2000"), ("HANDOFFS_POLICY", "{}")];
    let Some(HeldCase {
        w,
        posts,
        hold,
        mut a,
        _one_at_a_time: _serial,
    }) = held_case(
        "an engine stopped inside a transaction",
        &env,
        "HANDOFFS_TEST_HOLD_IN_WRITE",
    )
    else {
        return;
    };
    let pid = nix::unistd::Pid::from_raw(i32::try_from(a.0.id()).unwrap());
    wait_until(
        &w,
        Duration::from_secs(20),
        "engine a inside a write transaction",
        || hold.path().join("ready").exists(),
    );
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    std::fs::write(hold.path().join("go"), "").unwrap();
    let _b = engine_with(&w, "b.log", &env);
    let started = std::time::Instant::now();
    let out = w
        .cmd()
        .args(["send", "lead", "dev", "while a is stopped", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "send waited on the stopped engine's transaction and gave up after {:?}: {}",
        started.elapsed(),
        String::from_utf8_lossy(&out.stderr)
    );
    let id = serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["message"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    wait_until(
        &w,
        Duration::from_secs(25),
        "engine b delivered while engine a stayed stopped",
        || !posts.lock().unwrap().is_empty(),
    );
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    // Resumed, engine a finds its session ended and starts again on a new one.
    wait_until(
        &w,
        Duration::from_secs(30),
        "engine a started again",
        || log_of(&w, "a.log").matches("engine started").count() >= 2,
    );
    std::thread::sleep(Duration::from_secs(2));
    let log = log_of(&w, "a.log");
    assert!(
        log.contains("idle-in-transaction timeout"),
        "engine a was stopped by the server's timeout: {log}"
    );
    assert_eq!(
        posts.lock().unwrap().len(),
        1,
        "{id} written once, by engine b"
    );
    assert_eq!(w.json(&["status", &id])["state"], "ACCEPTED");
    assert!(
        a.0.try_wait().unwrap().is_none(),
        "engine a went on after its session was ended: {log}"
    );
    kill9(&mut a);
}

/// `serve` on a shared database whose engine fails (stopped inside a write transaction
/// while its session was cut, so its commit is lost) starts its engine again on a new
/// session, as `run` does, while the page goes on; the handoff sent afterwards is delivered
/// once. Without the restart `serve` ends with its engine's failure. Needs the test-only hold
/// of `planted-bugs` builds (`HANDOFFS_TEST_HOLD_IN_WRITE`), so .ci/run runs it there.
#[cfg(feature = "planted-bugs")]
#[test]
fn a_served_engine_that_failed_starts_again_on_a_new_session() {
    let Some(HeldCase {
        w,
        posts,
        hold,
        a: mut serve,
        _one_at_a_time: _serial,
    }) = held_case_of(
        "serve's engine starting again",
        &["serve", "--port", "0"],
        &[("HANDOFFS_LEASE_MS", "2000")],
        "HANDOFFS_TEST_HOLD_IN_WRITE",
    )
    else {
        return;
    };
    wait_until(
        &w,
        Duration::from_secs(20),
        "serve's engine inside a write transaction",
        || hold.path().join("ready").exists(),
    );
    common::sql_rows(
        &w.db,
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()) AS cut",
    );
    std::fs::write(hold.path().join("go"), "").unwrap();
    wait_until(&w, Duration::from_secs(20), "serve's engine failed", || {
        assert!(
            serve.0.try_wait().unwrap().is_none(),
            "serve ended with its engine: {}",
            log_of(&w, "a.log")
        );
        log_of(&w, "a.log").contains("the engine starts again on a new session")
    });
    let sent = send(&w, "after serve's engine failed");
    wait_until(&w, Duration::from_secs(30), "the handoff delivered", || {
        !posts.lock().unwrap().is_empty()
    });
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(posts.lock().unwrap().len(), 1, "{sent} written once");
    assert!(
        serve.0.try_wait().unwrap().is_none(),
        "serve still runs: {}",
        log_of(&w, "a.log")
    );
    kill9(&mut serve);
}

/// Two machines' worth of agents: each machine's engine (its own host name and state folder)
/// runs the commands of the agents registered on it, and HTTP agents are served by either.
/// Work handed from an agent on one machine to an agent on the other runs there.
#[test]
fn each_machine_runs_its_own_agents_commands() {
    let Some(admin) = common::postgres_or_skip("agents on two machines") else {
        return;
    };
    let w = World::on_postgres(&admin);
    let script = w.dir.path().join("agent.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\necho \"$1 $HANDOFFS_HOST\" >> {}\n",
            w.dir.path().join("hosts.log").display()
        ),
    )
    .unwrap();
    let mut perms = std::fs::metadata(&script).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&script, perms).unwrap();
    let command = format!("command=[\"{}\",\"{{request_id}}\"]", script.display());
    for (agent, host) in [("one", "machine-1"), ("two", "machine-2")] {
        let out = w
            .cmd()
            .env("HANDOFFS_HOST", host)
            .args([
                "agent",
                "add",
                agent,
                "--provider",
                "command",
                "--set",
                &command,
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    }
    let states = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let _e1 = engine_with(
        &w,
        "a.log",
        &[
            ("HANDOFFS_HOST", "machine-1"),
            ("HANDOFFS_STATE_DIR", states[0].path().to_str().unwrap()),
        ],
    );
    let e2 = engine_with(
        &w,
        "b.log",
        &[
            ("HANDOFFS_HOST", "machine-2"),
            ("HANDOFFS_STATE_DIR", states[1].path().to_str().unwrap()),
        ],
    );
    let mut sent = Vec::new();
    for i in 0..6 {
        let (from, to) = if i % 2 == 0 {
            ("one", "two")
        } else {
            ("two", "one")
        };
        let out = w.json(&["send", from, to, &format!("handoff {i}")]);
        sent.push((out["message"]["id"].as_str().unwrap().to_owned(), to));
    }
    let hosts_log = w.dir.path().join("hosts.log");
    wait_until(
        &w,
        Duration::from_secs(30),
        "every handoff's command ran",
        || {
            std::fs::read_to_string(&hosts_log)
                .unwrap_or_default()
                .lines()
                .count()
                >= sent.len()
        },
    );
    std::thread::sleep(Duration::from_millis(500));
    let lines = std::fs::read_to_string(&hosts_log).unwrap();
    assert_eq!(lines.lines().count(), sent.len(), "each ran once:\n{lines}");
    for (id, to) in &sent {
        let request = w.json(&["status", id])["request_id"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let want = if *to == "one" {
            "machine-1"
        } else {
            "machine-2"
        };
        assert!(
            lines.contains(&format!("{request} {want}")),
            "the handoff to {to} ran on {want}:\n{lines}"
        );
    }
    // Machine 2's engine gone, a handoff to its agent waits, and `status` says why: no engine
    // serves `two`, whose engine would run on machine-2 (after its ten seconds' grace).
    drop(e2);
    let waiting = w.json(&["send", "one", "two", "while machine-2 is down"]);
    let waiting = waiting["message"]["id"].as_str().unwrap().to_owned();
    let said = "no engine serves two: it is served only on machine-2";
    wait_until(
        &w,
        Duration::from_secs(30),
        "status says no engine serves two",
        || String::from_utf8_lossy(&w.run(&["status"]).stdout).contains(said),
    );
    let overview = w.json(&["status", "--json"]);
    assert_eq!(
        overview["unserved"],
        serde_json::json!([{"agent": "two", "host": "machine-2"}]),
        "{overview}"
    );
    assert_eq!(w.json(&["status", &waiting])["state"], "WAITING");
}

/// Issue 17's "Done when" without Docker, as DEPLOY.md's "Two machines" tells it: each
/// machine its own working folder, state folder and host name, its own `init` (the second
/// finds the database there and makes only its own token) and its own engine; one agent
/// registered on each. The lead's work reaches planner on machine 1; planner's turn hands
/// work on to builder from inside itself (a child in the lead's chain); builder's turn, on
/// machine 2 in machine 2's folder, returns it; the return comes back to planner on
/// machine 1 as a new turn, which closes it accepted. Each turn runs once, on its machine.
#[test]
fn two_machines_agents_hand_work_to_each_other_through_one_database() {
    let Some(admin) = common::postgres_or_skip("two machines' agents") else {
        return;
    };
    let w = World::on_postgres(&admin);
    w.ok(&["agent", "add", "lead", "--provider", "demo"]);
    let bin = env!("CARGO_BIN_EXE_handoffs");
    let turns = w.dir.path().join("turns.log");
    let machines: Vec<(String, std::path::PathBuf, std::path::PathBuf)> = (1..=2)
        .map(|n| {
            let folder = w.dir.path().join(format!("machine-{n}"));
            let state = folder.join("state");
            std::fs::create_dir_all(&state).unwrap();
            (format!("machine-{n}"), folder, state)
        })
        .collect();
    let on = |(host, folder, state): &(String, std::path::PathBuf, std::path::PathBuf),
              args: &[&str]| {
        let out = w
            .cmd()
            .current_dir(folder)
            .env("HANDOFFS_HOST", host)
            .env("HANDOFFS_STATE_DIR", state)
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?} on {host}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // Each turn notes where it ran, then acts on its card as an agent would.
    let script = |name: &str, act: &str| {
        let path = w.dir.path().join(name);
        std::fs::write(
            &path,
            format!(
                "#!/bin/sh\necho \"$HANDOFFS_AGENT $HANDOFFS_HOST $(pwd) $(head -1 \"$1\")\" >> {}\n{act}\n",
                turns.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(
            &path,
            <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o755),
        )
        .unwrap();
        format!("command=[\"{}\",\"{{text_file}}\"]", path.display())
    };
    let planner = script(
        "planner.sh",
        &format!(
            "if grep -q '^Work from lead' \"$1\"; then\n  {bin} send planner builder 'Write the parser' --title 'Parser' || exit 1\n\
             else\n  id=$(sed -n 's/.*close_work id=\\([0-9a-f]*\\)).*/\\1/p' \"$1\")\n  {bin} close \"$id\" accepted || exit 1\nfi"
        ),
    );
    let builder = script(
        "builder.sh",
        &format!(
            "id=$(sed -n 's/.*return_work id=\\([0-9a-f]*\\)).*/\\1/p' \"$1\")\n{bin} return \"$id\" --summary 'parser written' || exit 1"
        ),
    );
    let first = on(&machines[0], &["init"]);
    let second = on(&machines[1], &["init"]);
    assert!(first.contains("is ready (a new token in"), "{first}");
    assert!(second.contains("is ready (a new token in"), "{second}");
    for ((agent, command), machine) in [("planner", &planner), ("builder", &builder)]
        .into_iter()
        .zip(&machines)
    {
        let cwd = machine.1.to_str().unwrap();
        on(
            machine,
            &[
                "agent",
                "add",
                agent,
                "--provider",
                "command",
                "--cwd",
                cwd,
                "--set",
                command,
            ],
        );
    }
    let _engines: Vec<common::Engine> = machines
        .iter()
        .map(|(host, folder, state)| {
            let log = std::fs::File::create(w.dir.path().join(format!("{host}.log"))).unwrap();
            let mut cmd = w.cmd();
            cmd.current_dir(folder)
                .env("HANDOFFS_HOST", host)
                .env("HANDOFFS_STATE_DIR", state)
                .env("HANDOFFS_LOG", "info")
                .args(RUN)
                .stdout(Stdio::null())
                .stderr(log);
            common::Engine(cmd.spawn().expect("spawn engine"))
        })
        .collect();
    let work = w.json(&[
        "send",
        "lead",
        "planner",
        "Plan the parser",
        "--title",
        "Plan",
    ]);
    let work = work["message"]["id"].as_str().unwrap().to_owned();
    let closed = || {
        common::sql_rows(
            &w.db,
            "SELECT count(*) FROM work WHERE state = 'closed' AND title = 'Parser'",
        ) == ["1"]
    };
    wait_until(
        &w,
        Duration::from_secs(30),
        "planner closed builder's work",
        closed,
    );
    std::thread::sleep(Duration::from_millis(500));
    let lines = std::fs::read_to_string(&turns).unwrap();
    let (m1, m2) = (machines[0].1.display(), machines[1].1.display());
    let want = [
        format!("planner machine-1 {m1} Work from lead: Plan"),
        format!("builder machine-2 {m2} Work from planner: Parser"),
        format!("planner machine-1 {m1} returned: Parser from builder"),
    ];
    assert_eq!(
        lines.lines().collect::<Vec<_>>(),
        want,
        "each turn once, on its machine, in its folder:\n{lines}{}{}",
        log_of(&w, "machine-1.log"),
        log_of(&w, "machine-2.log")
    );
    let child = w.json(&["status", &work]);
    assert_eq!(child["state"], "RETURNED", "{child}");
}

/// `demo` on a PostgreSQL database plays its team there, beside another machine's engine
/// (compose.yaml's `team`), and keeps it when stopped.
#[test]
fn the_demo_plays_its_team_on_a_shared_database_and_keeps_it() {
    let Some(admin) = common::postgres_or_skip("the demo on a shared database") else {
        return;
    };
    let w = World::on_postgres(&admin);
    let log = std::fs::File::create(w.dir.path().join("demo.log")).unwrap();
    let mut demo = common::Engine(
        w.cmd()
            .args(["demo", "--port", "0", "--speed", "8"])
            .env("HANDOFFS_STATE_DIR", w.dir.path().join("team"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let state = tempfile::tempdir().unwrap();
    let _other = engine_with(
        &w,
        "a.log",
        &[
            ("HANDOFFS_HOST", "machine-a"),
            ("HANDOFFS_STATE_DIR", state.path().to_str().unwrap()),
        ],
    );
    wait_until(
        &w,
        Duration::from_secs(60),
        "the team's work returned",
        || w.counts().get("RETURNED").copied().unwrap_or(0) >= 4,
    );
    assert!(
        log_of(&w, "demo.log").contains("its team and their work stay in the database"),
        "{}",
        log_of(&w, "demo.log")
    );
    kill9(&mut demo);
    let agents = w.json(&["agent", "list"]);
    assert_eq!(agents.as_array().map(Vec::len), Some(4), "{agents}");
    assert!(w.counts().get("RETURNED").copied().unwrap_or(0) >= 4);
}
