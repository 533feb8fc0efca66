//! Durable before the effect (issue 14): the engine's system calls, traced with `strace -f`,
//! show that whenever a write reaches a recipient (the request's bytes on the recipient's
//! socket, or the `execve` of a run's supervisor and of its command), everything the
//! database's WAL had been given was already on stable storage: the commit that reserved the
//! write, and anything before it, had been `fdatasync`ed. One recipient, so that no other
//! recipient's commits interleave between a reservation and its write.
//!
//! The check fails with its own message when the engine skips that sync (the planted bug
//! `no_sync_before_write`, `.ci/run`).

mod common;

use common::World;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// `strace` (`HANDOFFS_STRACE_BIN`, else `PATH`), or `None` (skipped, and said) when it is
/// missing, except under `CI=true`.
fn strace() -> Option<PathBuf> {
    common::cli_or_skip("strace", "HANDOFFS_STRACE_BIN")
}

/// One event of the trace that matters here.
#[derive(Debug, PartialEq)]
enum Seen {
    /// Bytes written to the WAL file (a commit's frames).
    WalWrite,
    /// The WAL file synced (the call returned 0).
    WalSync,
    /// A write reached the recipient: bytes sent to its port, or an `execve` of `what`.
    Effect(String),
}

/// Reads strace's output (`-f -yy -qq`): one event per line that concerns the WAL or a
/// write to the recipient, with its line number. A call split across lines
/// (`<unfinished ...>` / `resumed>`) counts where it matters most strictly: a sync when it
/// returned, a WAL write and an effect when they began.
fn events(trace: &str, port: u16, programs: &[&str]) -> Vec<(usize, Seen)> {
    let to_port = format!(":{port}]>");
    let is_sync_call = |l: &str| l.contains("fdatasync(") || l.contains("fsync(");
    // Pids whose sync of the WAL began on an earlier line and has not returned yet.
    let mut syncing = std::collections::HashSet::new();
    let mut out = Vec::new();
    for (i, line) in trace.lines().enumerate() {
        let line_no = i + 1;
        let pid = line.split_whitespace().next().unwrap_or("").to_owned();
        let wal = line.contains("-wal>");
        let returned_0 = line.trim_end().ends_with("= 0");
        if is_sync_call(line) && wal && line.contains("<unfinished") {
            syncing.insert(pid);
        } else if is_sync_call(line) && wal {
            if returned_0 {
                out.push((line_no, Seen::WalSync));
            }
        } else if line.contains("resumed>") && line.contains("sync resumed") {
            if syncing.remove(&pid) && returned_0 {
                out.push((line_no, Seen::WalSync));
            }
        } else if wal && (line.contains("pwrite64(") || line.contains(" write(")) {
            out.push((line_no, Seen::WalWrite));
        } else if line.contains(&to_port)
            && ["write(", "writev(", "sendto(", "sendmsg("]
                .iter()
                .any(|c| line.contains(c))
            && !line.contains("resumed>")
        {
            out.push((line_no, Seen::Effect(format!("bytes to port {port}"))));
        } else if line.contains("execve(")
            && !line.contains("resumed>")
            && let Some(p) = programs.iter().find(|p| line.contains(*p))
        {
            out.push((line_no, Seen::Effect(format!("execve of {p}"))));
        }
    }
    out
}

/// The property: at every effect, no WAL write is newer than the last WAL sync, and at
/// least one sync came before. Returns the number of effects checked.
fn check_synced_before_effects(trace: &str, port: u16, programs: &[&str]) -> usize {
    let mut last_write: Option<usize> = None;
    let mut last_sync: Option<usize> = None;
    let mut effects = 0;
    for (line, seen) in events(trace, port, programs) {
        match seen {
            Seen::WalWrite => last_write = Some(line),
            Seen::WalSync => last_sync = Some(line),
            Seen::Effect(what) => {
                effects += 1;
                let synced = match (last_write, last_sync) {
                    (Some(w), Some(s)) => s > w,
                    (None, _) => true,
                    (Some(_), None) => false,
                };
                assert!(
                    synced,
                    "durability: a write reached the recipient ({what}, trace line {line}) while \
                     the WAL held commits not yet on disk (last WAL write at line {}, last WAL \
                     sync at line {}): the reservation was not synced before the effect",
                    last_write.unwrap_or(0),
                    last_sync.map_or_else(|| "none".to_owned(), |s| s.to_string()),
                );
            }
        }
    }
    effects
}

/// Runs `handoffs tick` under strace until `done()` or 30 ticks; returns the whole trace.
fn traced_ticks(w: &World, strace: &Path, mut done: impl FnMut() -> bool) -> String {
    let mut all = String::new();
    let start = Instant::now();
    for n in 0..30 {
        if done() {
            break;
        }
        let out = w.dir.path().join(format!("trace.{n}"));
        let status = Command::new(strace)
            .args(["-f", "-yy", "-qq", "-s", "16", "-o"])
            .arg(&out)
            .args([
                "-e",
                "trace=fsync,fdatasync,pwrite64,write,writev,sendto,sendmsg,execve",
            ])
            .arg(env!("CARGO_BIN_EXE_handoffs"))
            .arg("tick")
            .envs(
                w.cmd()
                    .get_envs()
                    .filter_map(|(k, v)| v.map(|v| (k.to_owned(), v.to_owned()))),
            )
            .env("HANDOFFS_LOG", "warn")
            .status()
            .expect("run strace");
        assert!(status.success(), "strace handoffs tick failed: {status:?}");
        all.push_str(&std::fs::read_to_string(&out).expect("trace file"));
        // Supervised runs end on their own; give them a moment before the next tick.
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        done(),
        "not delivered within 30 ticks ({:?})",
        start.elapsed()
    );
    all
}

fn starts(w: &World) -> usize {
    std::fs::read_to_string(&w.log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("start "))
        .count()
}

fn port_of(url: &str) -> u16 {
    url.trim_end_matches('/')
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("a port in the URL")
}

/// HTTP mode: each POST's bytes leave only after the reservation's commit is on disk.
#[test]
fn every_http_write_follows_the_sync_of_its_reservation() {
    let Some(strace) = strace() else { return };
    let w = World::new();
    let url = common::http_recipient(w.log.clone(), None);
    // No status URL: the only traffic to the recipient's port is the writes themselves.
    w.ok(&[
        "agent",
        "add",
        "bob",
        "--provider",
        "command",
        "--set",
        &format!("url={url}"),
    ]);
    w.ok(&["agent", "add", "alice", "--provider", "demo"]);
    for i in 0..5 {
        w.ok(&["send", "alice", "bob", &format!("note {i}")]);
    }
    let trace = traced_ticks(&w, &strace, || starts(&w) >= 5);
    let checked = check_synced_before_effects(&trace, port_of(&url), &[]);
    assert!(
        checked >= 5,
        "the trace shows {checked} writes to the recipient, not 5"
    );
    assert_eq!(starts(&w), 5, "one write per handoff");
}

/// argv mode: the supervisor, and the command it runs, start only after the reservation's
/// commit (and the supervisor's record of the run) is on disk.
#[test]
fn every_argv_run_starts_after_the_sync_of_its_reservation() {
    let Some(strace) = strace() else { return };
    let w = World::new();
    let script = w.script("recipient.sh", 0, 0);
    w.add_command_agent("bob", &script);
    w.ok(&["agent", "add", "alice", "--provider", "demo"]);
    for i in 0..3 {
        w.ok(&["send", "alice", "bob", &format!("note {i}")]);
    }
    let script_name = script.display().to_string();
    let trace = traced_ticks(&w, &strace, || {
        std::fs::read_to_string(&w.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("end "))
            .count()
            >= 3
    });
    let checked = check_synced_before_effects(&trace, 0, &["\"supervise\"", &script_name]);
    assert!(
        checked >= 6,
        "the trace shows {checked} supervisor and command starts, not 6"
    );
}

/// The check itself: a trace whose effect follows an unsynced WAL write fails it, with the
/// check's own message; a synced one passes.
#[test]
#[should_panic(expected = "while the WAL held commits not yet on disk")]
fn the_check_fails_on_a_write_before_the_sync() {
    let trace = "\
10 pwrite64(5</d/h.sqlite3-wal>, \"x\"..., 4120, 0) = 4120
10 fdatasync(5</d/h.sqlite3-wal>) = 0
10 pwrite64(5</d/h.sqlite3-wal>, \"x\"..., 4120, 4120) = 4120
10 sendto(9<TCP:[127.0.0.1:5000->127.0.0.1:7000]>, \"POST\"..., 100, MSG_NOSIGNAL, NULL, 0) = 100
";
    check_synced_before_effects(trace, 7000, &[]);
}

#[test]
fn the_check_passes_a_write_after_the_sync() {
    let trace = "\
10 pwrite64(5</d/h.sqlite3-wal>, \"x\"..., 4120, 0) = 4120
10 fdatasync(5</d/h.sqlite3-wal> <unfinished ...>
11 write(2<pipe:[1]>, \"log\", 3) = 3
10 <... fdatasync resumed>) = 0
10 sendto(9<TCP:[127.0.0.1:5000->127.0.0.1:7000]>, \"POST\"..., 100, MSG_NOSIGNAL, NULL, 0) = 100
";
    assert_eq!(check_synced_before_effects(trace, 7000, &[]), 1);
}
