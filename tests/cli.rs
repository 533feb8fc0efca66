//! Bad input everywhere on the command line: one clear line on stderr, the right exit code,
//! nothing written half-way, never a panic.

mod common;

use common::World;
use std::process::Command;

fn stderr_line(out: &std::process::Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "panic: {err}");
    assert!(!err.contains("RUST_BACKTRACE"), "backtrace hint: {err}");
    err
}

fn assert_fails(w: &World, args: &[&str], code: i32, needle: &str) {
    let out = w.run(args);
    let err = stderr_line(&out);
    assert_eq!(out.status.code(), Some(code), "handoffs {args:?}: {err}");
    assert!(
        err.contains(needle),
        "handoffs {args:?}: expected {needle:?} in {err:?}"
    );
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err:?}");
}

fn two_agents() -> World {
    let w = World::new();
    w.ok(&["agent", "add", "a", "--provider", "demo"]);
    w.ok(&["agent", "add", "b", "--provider", "demo"]);
    w
}

#[test]
fn usage_errors_exit_2() {
    let w = two_agents();
    assert_fails(&w, &["frobnicate"], 2, "unrecognized subcommand");
    assert_fails(
        &w,
        &["send", "a", "b", "hi", "--bogus"],
        2,
        "unexpected argument",
    );
    assert_fails(&w, &["send", "a"], 2, "required");
    assert_fails(
        &w,
        &["send", "a", "b", "hi", "--due-minutes", "5"],
        2,
        "needs --title",
    );
    assert_fails(
        &w,
        &["send", "a", "b", "hi", "--title", "t", "--due-minutes", "0"],
        2,
        "1 to 43200",
    );
    assert_fails(
        &w,
        &["send", "a", "b", "hi", "--title", "t", "--due-minutes", "x"],
        2,
        "invalid value",
    );
    assert_fails(&w, &["send", "a b", "b", "hi"], 2, "invalid agent id");
    assert_fails(
        &w,
        &["agent", "add", "x", "--provider", "nope"],
        2,
        "unknown provider",
    );
    assert_fails(
        &w,
        &[
            "agent",
            "add",
            "x",
            "--provider",
            "command",
            "--set",
            "command=[bad",
        ],
        2,
        "command must be a JSON list",
    );
    assert_fails(
        &w,
        &[
            "agent",
            "add",
            "x",
            "--provider",
            "command",
            "--set",
            "novalue",
        ],
        2,
        "KEY=VALUE",
    );
    assert_fails(&w, &["config", "colour", "red"], 2, "unknown config key");
    assert_fails(
        &w,
        &["config", "outageGuard", "{not json"],
        2,
        "outageGuard takes JSON",
    );
    assert_fails(&w, &["config", "enabled", "maybe"], 2, "true or false");
    assert_fails(&w, &["run", "--interval", "0"], 2, "--interval");
    assert_fails(
        &w,
        &["serve", "--allow-peer", "gateway"],
        2,
        "invalid value 'gateway' for '--allow-peer <IP>'",
    );
    assert_fails(
        &w,
        &["demo", "--allow-peer", "10.0.0.1", "--public-demo"],
        2,
        "cannot be used with",
    );
    assert_fails(&w, &["read", "abc", "--as", "b"], 2, "too short");
    // A PostgreSQL URL the driver cannot take is a usage error, its password never shown.
    let bad_port = ["--db", "postgres://u:hunter2@db:notaport/team", "status"];
    assert_fails(&w, &bad_port, 2, "is not a PostgreSQL URL the driver takes");
    assert!(!stderr_line(&w.run(&bad_port)).contains("hunter2"));
    assert_fails(
        &w,
        &[
            "--db",
            "postgres://db/team?no_such_option=1",
            "agent",
            "list",
        ],
        2,
        "is not a PostgreSQL URL",
    );
    assert_fails(&w, &["read", "abcdef"], 2, "--as");
    // Through stdin: an oversize message (too long for argv), and one with a NUL character
    // (argv cannot hold one; PostgreSQL cannot store one, so neither backend takes it).
    let send_stdin = |body: &[u8]| {
        let mut child = w
            .cmd()
            .args(["send", "a", "b", "-"])
            .stdin(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        {
            use std::io::Write as _;
            let _ = child.stdin.take().unwrap().write_all(body);
        }
        child.wait_with_output().unwrap()
    };
    let out = send_stdin("x".repeat(200_001).as_bytes());
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr_line(&out).contains("the limit is 200000"));
    let out = send_stdin(b"before\0after");
    assert_eq!(out.status.code(), Some(2), "{}", stderr_line(&out));
    assert!(
        stderr_line(&out).contains("the message contains a NUL character"),
        "{}",
        stderr_line(&out)
    );

    assert_fails(
        &w,
        &["send", "a", "b", "hi", "--title", &"t".repeat(201)],
        2,
        "the limit is 200",
    );
    // Nothing was stored by any of them.
    assert_eq!(
        w.json(&["inbox", "b", "--all"]).as_array().unwrap().len(),
        0
    );
    assert_eq!(w.json(&["agent", "list"]).as_array().unwrap().len(), 2);
}

#[test]
fn refusals_exit_1_with_one_line() {
    let w = two_agents();
    assert_fails(
        &w,
        &["send", "a", "ghost", "hi"],
        1,
        "unknown agent \"ghost\"",
    );
    assert_fails(&w, &["send", "a", "a", "hi"], 1, "never sends to itself");
    w.ok(&["block", "a", "b"]);
    assert_fails(&w, &["send", "a", "b", "hi"], 1, "not allowed");
    w.ok(&["allow", "a", "b"]);
    let sent = w.json(&["send", "a", "b", "do it", "--title", "Task"]);
    let id = sent["message"]["id"].as_str().unwrap().to_owned();
    assert_fails(
        &w,
        &["return", &id, "--as", "a", "--summary", "done"],
        1,
        "only b can return",
    );
    w.ok(&["return", &id, "--as", "b", "--summary", "done"]);
    assert_fails(
        &w,
        &["return", &id, "--as", "b", "--summary", "again"],
        1,
        "already returned",
    );
    assert_fails(
        &w,
        &["close", &id, "--as", "b", "accepted"],
        1,
        "only the sender",
    );
    w.ok(&["close", &id, "--as", "a", "accepted"]);
    assert_fails(
        &w,
        &["close", &id, "--as", "a", "accepted"],
        1,
        "already closed",
    );
    assert_fails(&w, &["release", "ffffffffffff"], 1, "no delivery");
    assert_eq!(
        w.json(&["inbox", "b", "--all"]).as_array().unwrap().len(),
        1
    );
    assert_eq!(
        w.json(&["inbox", "a", "--all"]).as_array().unwrap().len(),
        1,
        "one return"
    );
}

#[test]
fn a_missing_garbage_or_read_only_database_is_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_handoffs");
    let missing = dir.path().join("none.sqlite3");
    let out = Command::new(bin)
        .arg("--db")
        .arg(&missing)
        .args(["agent", "list"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr_line(&out).contains("handoffs init"));
    assert!(!missing.exists(), "only init creates a database");

    let garbage = dir.path().join("garbage.sqlite3");
    std::fs::write(&garbage, vec![0x42u8; 8192]).unwrap();
    let out = Command::new(bin)
        .arg("--db")
        .arg(&garbage)
        .args(["agent", "list"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = stderr_line(&out);
    assert!(
        err.contains("corrupt") || err.contains("not a handoffs database"),
        "{err}"
    );
    assert_eq!(err.trim_end().lines().count(), 1);

    let foreign = dir.path().join("foreign.sqlite3");
    let conn = foreign_sqlite(&foreign);
    assert!(conn, "made a foreign sqlite file");
    let out = Command::new(bin)
        .arg("--db")
        .arg(&foreign)
        .args(["agent", "list"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr_line(&out).contains("not a handoffs database"));
}

#[test]
fn a_locked_database_fails_with_one_line_and_writes_nothing() {
    let w = World::new();
    w.ok(&["agent", "add", "a", "--provider", "demo"]);
    let holder = common::WriteLockHolder::take(&w.db);
    let out = w
        .cmd()
        .env("HANDOFFS_BUSY_TIMEOUT_MS", "200")
        .args(["agent", "add", "b", "--provider", "demo"])
        .output()
        .unwrap();
    let err = stderr_line(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("locked"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    drop(holder);
    let agents = w.json(&["agent", "list"]);
    assert_eq!(
        agents.as_array().unwrap().len(),
        1,
        "nothing written half-way"
    );
}

/// Makes an SQLite database that is not ours (one foreign table).
fn foreign_sqlite(path: &std::path::Path) -> bool {
    rusqlite::Connection::open(path)
        .and_then(|c| c.execute_batch("CREATE TABLE t (x)"))
        .is_ok()
}

#[test]
fn init_is_idempotent_and_private() {
    let w = World::new();
    let again = w.ok(&["init"]);
    assert!(again.contains("is ready"));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let token = handoffs::store::token_path(&w.db);
        // On PostgreSQL there is no database file: this machine's token lives in its state
        // folder, private as the database file's folder is.
        let file = if common::is_postgres(&w.db) {
            token.clone()
        } else {
            w.db.clone()
        };
        assert_eq!(mode(&file), 0o600);
        assert_eq!(mode(file.parent().unwrap()), 0o700);
        assert_eq!(mode(&token), 0o600);
        assert_eq!(std::fs::read_to_string(&token).unwrap().len(), 64);
    }
}

#[test]
fn ids_resolve_by_a_unique_prefix_of_six() {
    let w = two_agents();
    let sent = w.json(&["send", "a", "b", "hello there"]);
    let id = sent["message"]["id"].as_str().unwrap().to_owned();
    let m = w.json(&["read", &id[..6], "--as", "b"]);
    assert_eq!(m["id"], id.as_str());
    assert!(m["read_at"].is_i64(), "read by its recipient");
    assert_eq!(w.json(&["inbox", "b"]).as_array().unwrap().len(), 0);
    let d = w.json(&["status", &id[..8]]);
    assert_eq!(d["state"], "WAITING");
}

#[test]
fn a_message_can_come_from_stdin_and_help_works_everywhere() {
    use std::io::Write as _;
    let w = two_agents();
    let mut child = w
        .cmd()
        .args(["--json", "send", "a", "b", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"from stdin\nline two")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["message"]["body"], "from stdin\nline two");
    for cmd in [
        "init", "agent", "allow", "block", "config", "send", "inbox", "read", "accept", "return",
        "close", "status", "tick", "run", "serve", "release", "mcp", "demo", "sim",
    ] {
        let out = w.run(&[cmd, "--help"]);
        assert!(out.status.success(), "{cmd} --help");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("Usage"),
            "{cmd} --help"
        );
    }
    assert!(w.ok(&["--version"]).starts_with("handoffs "));
}

#[test]
fn config_json_shows_every_key_and_status_of_an_undelivered_message_says_why() {
    let w = World::new();
    let all = w.json(&["config"]);
    for key in ["enabled", "enabledAfter", "connections", "outageGuard"] {
        assert!(all.get(key).is_some(), "{key} missing from {all}");
    }
    assert_eq!(all["enabled"], true);
    w.ok(&["agent", "add", "a", "--provider", "demo"]);
    w.ok(&["agent", "add", "b", "--provider", "demo"]);
    // Delivery enabled only from a future moment: a message sent now is never enrolled.
    w.ok(&["config", "enabledAfter", "4102444800000"]);
    let sent = w.json(&["send", "a", "b", "before delivery starts"]);
    assert_eq!(sent["delivery_state"], serde_json::Value::Null);
    let id = sent["message"]["id"].as_str().unwrap().to_owned();
    let out = w.run(&["status", &id]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("has no delivery"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

#[test]
#[allow(clippy::many_single_char_names)]
fn the_task_ledger_on_the_command_line() {
    let w = two_agents();
    let root = w.dir.path().join("project");
    std::fs::create_dir_all(&root).expect("root");
    let run = |args: &[&str]| {
        let out = w
            .cmd()
            .env("HANDOFFS_ROOT", &root)
            .args(args)
            .output()
            .expect("run");
        let err = stderr_line(&out);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            err,
        )
    };
    let json = |args: &[&str]| -> serde_json::Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let (code, out, err) = run(&all);
        assert_eq!(code, Some(0), "{args:?}: {err}");
        serde_json::from_str(&out).expect("JSON")
    };
    let t = json(&[
        "task",
        "create",
        "--as",
        "a",
        "--title",
        "Fix",
        "--goal",
        "Fix the test",
        "--cap",
        "1",
    ]);
    let id = t["id"].as_str().expect("id").to_owned();
    let c = json(&["task", "claim", &id[..8], "--as", "a"]);
    let token = c["lease"]["token"].as_str().expect("token").to_owned();
    // One writer: b cannot claim anything while a holds the lease.
    let other = json(&[
        "task",
        "create",
        "--as",
        "b",
        "--title",
        "Docs",
        "--goal",
        "Write docs",
    ]);
    let (code, _, err) = run(&[
        "task",
        "claim",
        other["id"].as_str().expect("id"),
        "--as",
        "b",
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("leased by a"), "{err}");
    let (code, _, err) = run(&["task", "renew", &id, "--as", "a", "--token", "nope"]);
    assert_eq!(code, Some(1), "{err}");
    let p = json(&[
        "task",
        "pass",
        &id,
        "--as",
        "a",
        "--token",
        &token,
        "--summary",
        "half",
        "--next",
        "finish",
        "--file",
        "b.rs",
        "--file",
        "a.rs",
        "--file",
        "b.rs",
        "--to",
        "b",
    ]);
    assert_eq!(
        p["task"]["changed_files"],
        serde_json::json!(["a.rs", "b.rs"])
    );
    let c = json(&["task", "claim", &id, "--as", "b"]);
    let token = c["lease"]["token"].as_str().expect("token").to_owned();
    let (code, _, err) = run(&[
        "task",
        "pass",
        &id,
        "--as",
        "b",
        "--token",
        &token,
        "--summary",
        "more",
        "--next",
        "x",
        "--to",
        "a",
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("budget"), "{err}");
    let shown = json(&["task", "show", &id]);
    assert_eq!(shown["task"]["state"], "needs_human");
    let kinds: Vec<&str> = shown["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["kind"].as_str())
        .collect();
    assert_eq!(
        kinds,
        ["created", "claimed", "passed", "claimed", "needs_human"]
    );
    let r = json(&["task", "resume", &id, "--add", "2"]);
    assert_eq!(
        (r["state"].as_str(), r["handoff_cap"].as_i64()),
        (Some("queued"), Some(3))
    );
    assert_eq!(
        json(&["task", "list", "--state", "queued"])
            .as_array()
            .map(Vec::len),
        Some(2)
    );
    // Usage errors exit 2; a missing root is one clear line.
    for bad in [
        vec!["task", "list", "--state", "lost"],
        vec![
            "task", "create", "--as", "a", "--title", "T", "--goal", "G", "--cap", "17",
        ],
        vec!["task", "resume", &id, "--add", "0"],
        vec!["task", "claim", "abc", "--as", "a"],
        vec!["task", "claim", &id, "--as", "a", "--minutes", "0"],
    ] {
        let (code, _, err) = run(&bad);
        assert_eq!(code, Some(2), "{bad:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    }
    let out = w
        .cmd()
        .env_remove("HANDOFFS_ROOT")
        .current_dir(w.dir.path())
        .args(["task", "list"])
        .output()
        .expect("run");
    let err = stderr_line(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("HANDOFFS_ROOT"), "{err}");
    // Agents must be registered in the database at hand.
    let (code, _, err) = run(&[
        "task", "create", "--as", "a", "--title", "T", "--goal", "G", "--for", "bbo",
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("unknown agent"), "{err}");
    // The state folder keeps itself out of git, and its files are private.
    let gi = std::fs::read_to_string(root.join(".handoffs/.gitignore")).expect("gitignore");
    assert!(gi.lines().any(|l| l.trim() == "*"));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(root.join(".handoffs/ledger.sqlite3"))
            .expect("ledger")
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "{mode:o}");
    }
}

#[test]
fn handoffs_policy_may_shorten_timings_but_never_raise_limits_and_status_says_so() {
    let w = two_agents();
    for (policy, needle) in [
        (
            r#"{"error_resends_max": 5}"#,
            "error_resends_max may not be raised above SPEC's 2",
        ),
        (
            r#"{"refusal_retries_max": 3}"#,
            "refusal_retries_max may not be raised",
        ),
        (
            r#"{"history_scans_min": 1}"#,
            "history_scans_min may not be lowered",
        ),
        (
            r#"{"sending_timeout_ms": 600000}"#,
            "sending_timeout_ms may only be shortened",
        ),
        (
            r#"{"bogus_ms": 5}"#,
            "HANDOFFS_POLICY is not a valid policy",
        ),
        ("not json", "HANDOFFS_POLICY is not a valid policy"),
    ] {
        let out = w
            .cmd()
            .env("HANDOFFS_POLICY", policy)
            .arg("tick")
            .output()
            .unwrap();
        let err = stderr_line(&out);
        assert_eq!(out.status.code(), Some(2), "{policy}: {err}");
        assert!(
            err.contains(needle),
            "{policy}: expected {needle:?} in {err:?}"
        );
    }
    // World::cmd shortens the timings (FAST_POLICY): status names each difference.
    w.ok(&["tick"]);
    let text = w.ok(&["status"]);
    assert!(
        text.contains("timings differ from SPEC")
            && text.contains("sending_timeout_ms 1500 (SPEC 60000)"),
        "{text}"
    );
    let json = w.json(&["status"]);
    assert!(
        json["engine_policy_differs"]
            .as_array()
            .is_some_and(|a| !a.is_empty()),
        "{json}"
    );
    let out = w
        .cmd()
        .env_remove("HANDOFFS_POLICY")
        .arg("tick")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text =
        String::from_utf8_lossy(&w.cmd().arg("status").output().unwrap().stdout).into_owned();
    assert!(!text.contains("timings differ"), "SPEC's timings: {text}");
}

/// `handoffs completions SHELL` prints a script the shell accepts, naming the commands; an
/// unknown shell is a usage error.
#[test]
fn completions_are_printed_for_each_shell() {
    let w = World::new();
    let bash = w.ok(&["completions", "bash"]);
    assert!(bash.contains("handoffs__subcmd__task") && bash.contains("complete -F _handoffs"));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("handoffs.bash");
    std::fs::write(&file, &bash).unwrap();
    let check = Command::new("bash").arg("-n").arg(&file).output().unwrap();
    assert!(check.status.success(), "bash -n: {check:?}");
    for shell in ["zsh", "fish", "elvish", "powershell"] {
        assert!(w.ok(&["completions", shell]).contains("release"), "{shell}");
    }
    assert_fails(&w, &["completions", "tcsh"], 2, "possible values");
}

/// The outage presets take the product names users already have in their configs.
#[test]
fn outage_presets_take_the_product_names() {
    let w = World::new();
    for name in [
        "openai",
        "openai-codex",
        "codex",
        "anthropic",
        "claude-code",
        "github",
    ] {
        w.ok(&[
            "config",
            "outageGuard",
            &format!("{{\"preset\": \"{name}\"}}"),
        ]);
    }
    assert_fails(
        &w,
        &["config", "outageGuard", "{\"preset\": \"nope\"}"],
        2,
        "openai-codex",
    );
}

/// `status` says when no engine runs: never one, or one that stopped reporting (the same
/// rule the page and the MCP server use).
#[test]
fn status_says_when_the_engine_is_not_running() {
    let w = two_agents();
    w.ok(&["send", "a", "b", "hello"]);
    let out = w.ok(&["status"]);
    assert!(out.contains("queued (1)"), "{out}");
    assert!(out.contains("engine: no pass yet"), "{out}");
    let mut store = handoffs::store::Store::open(&w.db).unwrap();
    let long_ago = handoffs::store::millis(handoffs::clock::now()) - 10 * 60 * 1000;
    store
        .write(|tx| tx.save_report(long_ago, &serde_json::json!({})))
        .unwrap();
    let out = w.ok(&["status"]);
    assert!(out.contains("engine: not running (last pass"), "{out}");
    w.ok(&["tick"]);
    let out = w.ok(&["status"]);
    assert!(out.contains("was a one-shot `tick`"), "{out}");
    let _engine = w.spawn_engine();
    let start = std::time::Instant::now();
    loop {
        let out = w.ok(&["status"]);
        if out.contains("engine: last pass") && !out.contains("one-shot") {
            break;
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(20),
            "a running engine is not shown as running: {out}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// A delivery row damaged by hand is read back as a clear error naming it, never acted on as
/// some other state: the engine goes on with the others.
#[test]
fn a_damaged_delivery_record_is_named_and_never_acted_on() {
    let w = two_agents();
    w.ok(&["agent", "add", "c", "--provider", "demo"]);
    let sent = w.json(&["send", "a", "b", "one"]);
    let bad = sent["message"]["id"].as_str().unwrap().to_owned();
    let sent = w.json(&["send", "a", "c", "two"]);
    let good = sent["message"]["id"].as_str().unwrap().to_owned();
    let q = |sql: String| common::sql_rows(&w.db, &sql);
    let record = q(format!(
        "SELECT record FROM deliveries WHERE message_id = {}",
        common::sql_text(&bad)
    ))
    .remove(0);
    let mut record: serde_json::Value = serde_json::from_str(&record).unwrap();
    record["core"]["earlier_request_ids"] = serde_json::json!(["x"]);
    q(format!(
        "UPDATE deliveries SET record = {} WHERE message_id = {}",
        common::sql_text(&record.to_string()),
        common::sql_text(&bad)
    ));
    assert_fails(
        &w,
        &["status", &bad],
        1,
        &format!("stored record for {bad} is invalid"),
    );
    // The overview still shows everything else, and names the damaged row.
    let out = w.ok(&["status"]);
    assert!(out.contains("damaged (1)") && out.contains(&bad), "{out}");
    assert!(out.contains(&good[..8]), "{out}");
    let tick = w.run(&["tick"]);
    assert!(tick.status.success());
    assert!(String::from_utf8_lossy(&tick.stdout).contains(&format!("{bad}: stored record")));
    assert_eq!(w.json(&["status", &good])["state"], "ACCEPTED");
}

/// What the engine does is visible as tracing events: RUST_LOG picks them, `--log-format
/// json` makes each line one JSON object, with the delivery's span.
#[test]
fn the_engine_logs_each_delivery_step_as_json_when_asked() {
    let w = common::World::new();
    w.ok(&["agent", "add", "alice", "--provider", "demo"]);
    w.ok(&["agent", "add", "bob", "--provider", "demo"]);
    w.ok(&["send", "alice", "bob", "hello"]);
    let out = w
        .cmd()
        .env("RUST_LOG", "info")
        .env_remove("HANDOFFS_LOG")
        .args(["--log-format", "json", "tick"])
        .output()
        .expect("tick");
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<serde_json::Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let moved: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l["fields"]["message"] == "delivery moved")
        .collect();
    assert!(!moved.is_empty(), "no step logged: {stderr}");
    for m in &moved {
        assert_eq!(m["fields"]["recipient"], "bob", "{m}");
        assert_eq!(m["span"]["name"], "delivery", "{m}");
    }
    assert!(
        moved.iter().any(|m| m["fields"]["to"] == "SENDING"),
        "the reservation is logged: {stderr}"
    );
    // Text by default, and nothing below a warning without RUST_LOG.
    let quiet = w
        .cmd()
        .env_remove("RUST_LOG")
        .env_remove("HANDOFFS_LOG")
        .args(["send", "alice", "bob", "again"])
        .output()
        .expect("send");
    assert!(quiet.status.success());
    assert!(
        quiet.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&quiet.stderr)
    );
    let bad = w.run(&["--log-format", "xml", "status"]);
    assert_eq!(bad.status.code(), Some(2));
}
