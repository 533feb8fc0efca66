//! `handoffs serve` and `handoffs demo` as real processes: a busy port, a client that never
//! finishes its request, signals, and the demo's temporary data.

mod common;

use std::io::Write as _;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn signal(child: &Child, sig: nix::sys::signal::Signal) {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    nix::sys::signal::kill(pid, sig).expect("signal");
}

/// Waits for the child to exit (at most `limit`); kills it and fails otherwise.
fn exit_within(child: &mut Child, limit: Duration) -> Option<i32> {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status.code();
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_busy_port_given_explicitly_is_an_error_and_nothing_is_delivered() {
    let w = common::World::new();
    w.ok(&["agent", "add", "a", "--provider", "demo"]);
    w.ok(&["agent", "add", "b", "--provider", "demo"]);
    w.ok(&["send", "a", "b", "hello"]);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port().to_string();
    let out = w.run(&["serve", "--port", &port]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot listen"), "{err}");
    // The engine never started: the handoff is still waiting.
    let status = w.json(&["status"]);
    assert!(
        status["in_flight"].as_array().is_some_and(Vec::is_empty),
        "{status}"
    );
    assert!(status["engine"].is_null(), "{status}");
}

#[test]
fn a_client_that_never_finishes_its_request_does_not_keep_serve_running() {
    let w = common::World::new();
    let mut cmd = w.cmd();
    cmd.args(["serve", "--port", "0"]);
    let (mut child, url) = common::start_serving(cmd);
    let addr = url.trim_start_matches("http://");
    let mut stalled = std::net::TcpStream::connect(addr).expect("connect");
    // One client stops in the middle of its headers, another in the middle of its body.
    stalled
        .write_all(b"POST /api/send HTTP/1.1\r\nHost: loca")
        .expect("write");
    let mut slow_body = std::net::TcpStream::connect(addr).expect("connect");
    slow_body
        .write_all(
            b"POST /api/send HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n{\"fr",
        )
        .expect("write");
    std::thread::sleep(Duration::from_millis(300));
    signal(&child, nix::sys::signal::Signal::SIGINT);
    // The server gives open connections 3 s, then stops.
    assert_eq!(exit_within(&mut child, Duration::from_secs(8)), Some(130));
    drop((stalled, slow_body));
}

#[test]
fn the_demo_deletes_its_data_on_sigterm_too() {
    let tmp = tempfile::tempdir().expect("tmp");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_handoffs"));
    cmd.args(["demo", "--port", "0", "--speed", "4"])
        .env("TMPDIR", tmp.path())
        .stdin(Stdio::null());
    let (mut child, url) = common::start_serving(cmd);
    let folders = || {
        std::fs::read_dir(tmp.path())
            .expect("tmp")
            .filter_map(Result::ok)
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("handoffs-demo-")
            })
            .count()
    };
    assert_eq!(
        folders(),
        1,
        "the demo keeps its data in one folder ({url})"
    );
    signal(&child, nix::sys::signal::Signal::SIGTERM);
    let code = exit_within(&mut child, Duration::from_secs(20));
    assert_eq!(folders(), 0, "the demo's folder is gone");
    assert_eq!(
        code,
        Some(143),
        "SIGTERM ends it with 143, as a shell reports it"
    );
}

/// `handoffs run` stops on SIGTERM (what a service manager sends) as on Ctrl+C: it ends by
/// itself with 143, its engine lock let go, rather than being killed by the signal; SIGHUP
/// leaves it running.
#[test]
fn run_stops_on_sigterm_with_143_and_outlives_sighup() {
    let w = common::World::new();
    w.ok(&["agent", "add", "a", "--provider", "demo"]);
    let mut child = w
        .cmd()
        .args(["run", "--interval", "0.2"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run");
    // Running once its first pass is reported.
    let started = Instant::now();
    while w.json(&["status"])["engine_reported_at"].is_null() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the engine never reported"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // A hang-up (the terminal of `nohup handoffs run &` closing) neither kills nor stops it.
    signal(&child, nix::sys::signal::Signal::SIGHUP);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        child.try_wait().expect("wait").is_none(),
        "run outlives SIGHUP"
    );
    signal(&child, nix::sys::signal::Signal::SIGTERM);
    let code = exit_within(&mut child, Duration::from_secs(20));
    assert_eq!(code, Some(143), "run ends by itself with 143 on SIGTERM");
    let tick = w.json(&["tick"]);
    assert!(
        tick.get("skipped").is_none(),
        "the engine lock was let go: {tick}"
    );
}
