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
    /// A write of bytes to the database's WAL file (a commit's frames) ended.
    WalWrite,
    /// A sync of the WAL file that began at line `began` returned 0: it covers every WAL
    /// write that had ended before `began`, and only those.
    WalSync { began: usize },
    /// A write reached the recipient: bytes sent to its port, or an `execve` of `what`.
    Effect(String),
}

/// Reads strace's output (`-f -yy -qq`): one event per line that concerns the database's WAL
/// (`wal`, its path as the kernel names it) or a write to the recipient, with its line
/// number. A call split across lines (`<unfinished ...>` / `resumed>`) counts as strictly as
/// the order allows: a WAL write where it ended, a sync from where it began until it
/// returned, an effect where it began.
fn events(trace: &str, wal: &str, port: u16, programs: &[&str]) -> Vec<(usize, Seen)> {
    let on_wal = format!("<{wal}>");
    let to_port = format!(":{port}]>");
    let is_sync_call = |l: &str| l.contains("fdatasync(") || l.contains("fsync(");
    let is_write_call = |l: &str| l.contains("pwrite64(") || l.contains(" write(");
    // By pid: a sync of the WAL (with the line it began on) or a WAL write that has not
    // returned yet.
    let mut syncing = std::collections::HashMap::new();
    let mut writing = std::collections::HashSet::new();
    let mut out = Vec::new();
    for (i, line) in trace.lines().enumerate() {
        let line_no = i + 1;
        let pid = line.split_whitespace().next().unwrap_or("").to_owned();
        let wal = line.contains(&on_wal);
        let unfinished = line.contains("<unfinished");
        let returned_0 = line.trim_end().ends_with("= 0");
        if line.contains("resumed>") {
            if line.contains("sync resumed") {
                if let Some(began) = syncing.remove(&pid)
                    && returned_0
                {
                    out.push((line_no, Seen::WalSync { began }));
                }
            } else if (line.contains("write64 resumed") || line.contains("write resumed"))
                && writing.remove(&pid)
            {
                out.push((line_no, Seen::WalWrite));
            }
        } else if is_sync_call(line) && wal {
            if unfinished {
                syncing.insert(pid, line_no);
            } else if returned_0 {
                out.push((line_no, Seen::WalSync { began: line_no }));
            }
        } else if is_write_call(line) && wal {
            if unfinished {
                writing.insert(pid);
            } else {
                out.push((line_no, Seen::WalWrite));
            }
        } else if line.contains(&to_port)
            && ["write(", "writev(", "sendto(", "sendmsg("]
                .iter()
                .any(|c| line.contains(c))
        {
            out.push((line_no, Seen::Effect(format!("bytes to port {port}"))));
        } else if line.contains("execve(")
            && let Some(p) = programs.iter().find(|p| line.contains(*p))
        {
            out.push((line_no, Seen::Effect(format!("execve of {p}"))));
        }
    }
    out
}

/// The property: at every effect, the last WAL write ended before a sync of the WAL began
/// that had returned by then; and a WAL write came before (the commit that reserved the
/// write: a trace without one does not show the WAL at all). Returns the number of effects
/// checked, or what broke the property.
fn check_synced_before_effects(
    trace: &str,
    wal: &str,
    port: u16,
    programs: &[&str],
) -> Result<usize, String> {
    let mut last_write: Option<usize> = None;
    // The latest beginning of a sync that has returned.
    let mut covered_upto: Option<usize> = None;
    let mut effects = 0;
    for (line, seen) in events(trace, wal, port, programs) {
        match seen {
            Seen::WalWrite => last_write = Some(line),
            Seen::WalSync { began } => covered_upto = covered_upto.max(Some(began)),
            Seen::Effect(what) => {
                effects += 1;
                let Some(w) = last_write else {
                    return Err(format!(
                        "the trace shows no write to {wal} before the write to the recipient \
                         ({what}, trace line {line}): it cannot show that the reservation was \
                         synced"
                    ));
                };
                if covered_upto.is_none_or(|s| s < w) {
                    return Err(format!(
                        "durability: a write reached the recipient ({what}, trace line {line}) \
                         while the WAL held commits not yet on disk (last WAL write ended at \
                         line {w}, the last sync that returned began at line {}): the \
                         reservation was not synced before the effect",
                        covered_upto.map_or_else(|| "none".to_owned(), |s| s.to_string()),
                    ));
                }
            }
        }
    }
    Ok(effects)
}

/// The WAL of the world's database as the kernel names it in a trace.
fn wal_of(w: &World) -> String {
    let db = std::fs::canonicalize(&w.db).expect("the database exists");
    format!("{}-wal", db.display())
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
    if common::sqlite_file_case("the order of SQLite's WAL syncs and the effects") {
        return;
    }
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
    let checked = check_synced_before_effects(&trace, &wal_of(&w), port_of(&url), &[])
        .unwrap_or_else(|e| panic!("{e}"));
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
    if common::sqlite_file_case("the order of SQLite's WAL syncs and the effects") {
        return;
    }
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
    let checked =
        check_synced_before_effects(&trace, &wal_of(&w), 0, &["\"supervise\"", &script_name])
            .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        checked >= 6,
        "the trace shows {checked} supervisor and command starts, not 6"
    );
}

/// The check itself: a trace whose effect follows an unsynced WAL write fails it, with the
/// check's own message; so does one whose sync began before the WAL write ended, and one
/// with no WAL write at all; a synced one passes.
#[test]
fn the_check_fails_on_a_write_before_the_sync() {
    let wal = "/d/h.sqlite3-wal";
    let unsynced = "\
10 pwrite64(5</d/h.sqlite3-wal>, \"x\"..., 4120, 0) = 4120
10 fdatasync(5</d/h.sqlite3-wal>) = 0
10 pwrite64(5</d/h.sqlite3-wal>, \"x\"..., 4120, 4120) = 4120
10 sendto(9<TCP:[127.0.0.1:5000->127.0.0.1:7000]>, \"POST\"..., 100, MSG_NOSIGNAL, NULL, 0) = 100
";
    let e = check_synced_before_effects(unsynced, wal, 7000, &[]).unwrap_err();
    assert!(
        e.contains("while the WAL held commits not yet on disk"),
        "{e}"
    );
    // The sync began while the write was still going on: it need not cover it.
    let overlapping = "\
10 pwrite64(5</d/h.sqlite3-wal>, \"x\"..., 4120, 0 <unfinished ...>
11 fdatasync(5</d/h.sqlite3-wal> <unfinished ...>
10 <... pwrite64 resumed>) = 4120
11 <... fdatasync resumed>) = 0
10 sendto(9<TCP:[127.0.0.1:5000->127.0.0.1:7000]>, \"POST\"..., 100, MSG_NOSIGNAL, NULL, 0) = 100
";
    let e = check_synced_before_effects(overlapping, wal, 7000, &[]).unwrap_err();
    assert!(
        e.contains("while the WAL held commits not yet on disk"),
        "{e}"
    );
    // Another database's WAL is not this one's.
    let elsewhere = "\
10 pwrite64(5</d/other.sqlite3-wal>, \"x\"..., 4120, 0) = 4120
10 fdatasync(5</d/other.sqlite3-wal>) = 0
10 sendto(9<TCP:[127.0.0.1:5000->127.0.0.1:7000]>, \"POST\"..., 100, MSG_NOSIGNAL, NULL, 0) = 100
";
    let e = check_synced_before_effects(elsewhere, wal, 7000, &[]).unwrap_err();
    assert!(e.contains("the trace shows no write to"), "{e}");
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
    assert_eq!(
        check_synced_before_effects(trace, "/d/h.sqlite3-wal", 7000, &[]),
        Ok(1)
    );
}
