//! `agent add` warns about a destination it can tell is wrong (the registration stands), and
//! `handoffs doctor` checks every agent's destination and the database (SPEC §5).

mod common;

use common::World;
use std::io::Read as _;
use std::os::unix::fs::PermissionsExt;
use std::process::Stdio;

/// A fake executable that prints `version` for `--version`.
fn fake_binary(w: &World, name: &str, version: &str) -> String {
    let path = w.dir.path().join(name);
    std::fs::write(&path, format!("#!/bin/sh\necho '{version}'\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path.display().to_string()
}

#[test]
fn agent_add_warns_about_what_it_can_tell_is_wrong_and_registers_anyway() {
    let w = World::new();
    let missing = w.dir.path().join("no-such-codex");
    let out = w
        .cmd()
        .args([
            "agent",
            "add",
            "cx",
            "--provider",
            "codex",
            "--endpoint",
            "0199-thread",
            "--set",
            &format!("binary={}", missing.display()),
            "--set",
            &format!("home={}", w.dir.path().display()),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "registered anyway");
    let stderr = String::from_utf8_lossy(&out.stderr);
    for expected in [
        "handoffs: warning: cx",
        "no-such-codex is not an executable file, nor found on PATH",
        "thread 0199-thread not found under",
    ] {
        assert!(stderr.contains(expected), "{expected:?} in:\n{stderr}");
    }
    let agents = w.json(&["agent", "list"]);
    assert!(agents.to_string().contains("\"cx\""), "{agents}");
}

#[test]
fn doctor_finds_the_binary_the_thread_and_the_session() {
    let w = World::new();
    let home = w.dir.path().join("codex-home");
    let day = home.join("sessions/2026/12/02");
    std::fs::create_dir_all(&day).unwrap();
    std::fs::write(
        day.join("rollout-2026-12-02T01-00-00-0199-abc.jsonl"),
        "{}\n",
    )
    .unwrap();
    let codex = fake_binary(&w, "codex", "codex-cli 0.171.0");
    w.ok(&[
        "agent",
        "add",
        "cx",
        "--provider",
        "codex",
        "--endpoint",
        "0199-abc",
        "--set",
        &format!("binary={codex}"),
        "--set",
        &format!("home={}", home.display()),
    ]);
    let config = w.dir.path().join("claude-config");
    let folder = w.dir.path().join("my project");
    std::fs::create_dir_all(&folder).unwrap();
    let real = std::fs::canonicalize(&folder).unwrap();
    let mangled: String = real
        .to_string_lossy()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    std::fs::create_dir_all(config.join("projects").join(&mangled)).unwrap();
    std::fs::write(
        config.join("projects").join(&mangled).join("sess-1.jsonl"),
        "{}\n",
    )
    .unwrap();
    let claude = fake_binary(&w, "claude", "2.1.197 (Claude Code)");
    w.ok(&[
        "agent",
        "add",
        "cc",
        "--provider",
        "claude-code",
        "--endpoint",
        "sess-1",
        "--cwd",
        &folder.display().to_string(),
        "--set",
        &format!("binary={claude}"),
        "--set",
        &format!("config_dir={}", config.display()),
    ]);
    let out = w.run(&["doctor"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    for expected in [
        "ok      cx: ",
        "is codex-cli 0.171.0",
        "thread 0199-abc found",
        "is 2.1.197 (Claude Code)",
        "session sess-1 found",
        "integrity ok",
        ".token is private (600)",
    ] {
        assert!(stdout.contains(expected), "{expected:?} in:\n{stdout}");
    }
    if !common::is_postgres(&w.db) {
        assert!(stdout.contains("h.sqlite3 is private (600)"), "{stdout}");
    }
    assert!(!stdout.contains("PROBLEM"), "{stdout}");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn doctor_is_content_with_a_healthy_world_and_names_a_readable_database() {
    let w = World::new();
    w.ok(&["agent", "add", "alice", "--provider", "demo"]);
    let out = w.run(&["doctor"]);
    assert!(out.status.success(), "{out:?}");
    let findings = w.json(&["doctor"]);
    assert!(
        findings.as_array().unwrap().iter().all(|f| f["ok"] == true),
        "{findings}"
    );
    // The file whose mode is checked: the database's, or on PostgreSQL this machine's token.
    let file = if common::is_postgres(&w.db) {
        handoffs::store::token_path(&w.db)
    } else {
        w.db.clone()
    };
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = w.run(&["doctor"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("is readable by others (644); chmod 600 it"),
        "{out:?}"
    );
}

#[test]
fn a_reader_that_goes_away_ends_the_output_quietly() {
    let w = World::new();
    // More than a pipe holds (64 KiB), so the writer is still writing when the reader goes.
    let note = format!("note={}", "x".repeat(100_000));
    w.ok(&["agent", "add", "a", "--provider", "demo", "--set", &note]);
    let mut child = w
        .cmd()
        .args(["--json", "agent", "list"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read one byte, then close the pipe while the rest is still being written.
    let mut stdout = child.stdout.take().unwrap();
    let mut one = [0u8; 1];
    stdout.read_exact(&mut one).unwrap();
    drop(stdout);
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(!stderr.contains("panicked"), "no panic:\n{stderr}");
    assert_eq!(status.code(), Some(141), "ended as SIGPIPE would: {stderr}");
}
