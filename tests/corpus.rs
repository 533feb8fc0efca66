//! The shared corpus (SPEC §8.2), as real processes: eight `handoffs mcp` servers on one
//! context library write the same keys at once; set-union loses no member, the append-only
//! log no entry, max keeps the largest, and of eight last-writer-wins writes on version 0
//! exactly one wins while seven are told of the conflict.

mod common;

use serde_json::{Value, json};
use std::io::{BufRead as _, Write as _};
use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

const PROCESSES: usize = 8;
const WRITES: usize = 25;

/// One MCP server as a process, its answers read on a thread.
struct Server {
    child: Child,
    answers: Receiver<Value>,
}

fn start(w: &common::World, agent: &str, lib: &Path) -> Server {
    let mut child = w
        .cmd()
        .args(["mcp", "--agent", agent, "--context-library"])
        .arg(lib)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let (tx, answers) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in stdout.lines().map_while(Result::ok) {
            let _ = tx.send(serde_json::from_str::<Value>(&l).expect("every answer is JSON"));
        }
    });
    let mut s = Server { child, answers };
    s.send(&[
        json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "corpus", "version": "1"}}}),
        json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
    ]);
    s.collect(1);
    s
}

impl Server {
    fn send(&mut self, lines: &[Value]) {
        let stdin = self.child.stdin.as_mut().unwrap();
        for l in lines {
            writeln!(stdin, "{l}").unwrap();
        }
        stdin.flush().unwrap();
    }

    /// The next `n` answers, by id.
    fn collect(&self, n: usize) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut out = Vec::new();
        while out.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            out.push(
                self.answers
                    .recv_timeout(left)
                    .unwrap_or_else(|_| panic!("corpus: {} of {n} answers in 60 s", out.len())),
            );
        }
        out.sort_by_key(|a| a["id"].as_i64());
        out
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn call(id: usize, tool: &str, args: &Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
           "params": {"name": tool, "arguments": args}})
}

fn put(id: usize, args: &Value) -> Value {
    call(id, "context_put", args)
}

/// The structured result of an answer, or its error text.
fn result(a: &Value) -> Result<Value, String> {
    let r = &a["result"];
    if r["isError"] == true {
        return Err(r["content"][0]["text"].as_str().unwrap_or("").to_owned());
    }
    r.get("structuredContent")
        .cloned()
        .ok_or_else(|| format!("no result: {a}"))
}

#[test]
fn eight_processes_writing_at_once_lose_no_update() {
    let w = common::World::new();
    let lib = w.dir.path().join("memory");
    std::fs::create_dir_all(&lib).unwrap();
    let names: Vec<String> = (0..PROCESSES).map(|p| format!("agent{p}")).collect();
    for n in &names {
        w.ok(&["agent", "add", n, "--provider", "demo"]);
    }
    let mut servers: Vec<Server> = names.iter().map(|n| start(&w, n, &lib)).collect();
    // Every process: one claim on version 0, then its members, its log entries and its
    // numbers, all sent at once; the eight processes at the same time.
    for (p, s) in servers.iter_mut().enumerate() {
        let mut lines = vec![put(
            1,
            &json!({"key": "claim", "value": format!("agent{p}"), "version": 0}),
        )];
        for i in 0..WRITES {
            let id = 10 + 3 * i;
            lines.push(put(
                id,
                &json!({"key": "seen", "value": format!("m-{p}-{i}"), "rule": "set"}),
            ));
            lines.push(put(
                id + 1,
                &json!({"key": "notes", "value": format!("p{p} #{i}"), "rule": "log"}),
            ));
            lines.push(put(
                id + 2,
                &json!({"key": "best", "value": p * 100 + i, "rule": "max"}),
            ));
        }
        s.send(&lines);
    }
    let mut claims_won = 0;
    let mut conflicts = 0;
    for s in &servers {
        let answers = s.collect(1 + 3 * WRITES);
        for a in &answers {
            match (a["id"].as_i64(), result(a)) {
                (Some(1), Ok(_)) => claims_won += 1,
                (Some(1), Err(e)) if e.starts_with("conflict: key \"claim\" is at version 1") => {
                    conflicts += 1;
                }
                (_, Ok(_)) => {}
                (id, Err(e)) => panic!("corpus: write {id:?} failed: {e}"),
            }
        }
    }
    let reader = &mut servers[0];
    reader.send(&[
        call(500, "context_get", &json!({"key": "seen"})),
        call(501, "context_get", &json!({"key": "notes"})),
        call(502, "context_get", &json!({"key": "best"})),
        call(503, "context_get", &json!({"key": "claim"})),
    ]);
    let got: Vec<Value> = reader
        .collect(4)
        .iter()
        .map(|a| result(a).unwrap()["entry"].clone())
        .collect();
    let members = got[0]["value"].as_array().unwrap().len();
    assert_eq!(
        members,
        PROCESSES * WRITES,
        "corpus: set-union from {PROCESSES} processes lost {} of {} members",
        PROCESSES * WRITES - members.min(PROCESSES * WRITES),
        PROCESSES * WRITES
    );
    assert_eq!(got[0]["version"], PROCESSES * WRITES);
    let entries = got[1]["value"].as_array().unwrap();
    assert_eq!(
        entries.len(),
        PROCESSES * WRITES,
        "corpus: the log lost {} entries",
        PROCESSES * WRITES - entries.len().min(PROCESSES * WRITES)
    );
    for p in 0..PROCESSES {
        // A server runs its calls side by side, so a writer's own entries may interleave.
        let mine: std::collections::BTreeSet<&str> = entries
            .iter()
            .filter(|e| e["by"] == format!("agent{p}"))
            .map(|e| e["text"].as_str().unwrap())
            .collect();
        let expected: Vec<String> = (0..WRITES).map(|i| format!("p{p} #{i}")).collect();
        assert!(
            mine.len() == WRITES && expected.iter().all(|e| mine.contains(e.as_str())),
            "each writer's entries, by their writer: {mine:?}"
        );
    }
    assert_eq!(got[2]["value"], (PROCESSES - 1) * 100 + WRITES - 1);
    assert_eq!(
        (claims_won, conflicts),
        (1, PROCESSES - 1),
        "corpus: {claims_won} of {PROCESSES} last-writer-wins writes on version 0 won"
    );
    assert_eq!(got[3]["version"], 1);
}

/// The same corpus from the command line: put, get, keys; a stale write and bad input are
/// one line each, with the right exit code.
#[test]
fn the_cli_writes_and_reads_the_same_corpus() {
    let w = common::World::new();
    let lib = w.dir.path().join("memory");
    let libs = lib.to_str().unwrap();
    w.ok(&[
        "context",
        "put",
        "seen",
        "a",
        "b",
        "--rule",
        "set",
        "--as",
        "alice",
        "--library",
        libs,
    ]);
    let p = w.json(&[
        "context",
        "put",
        "seen",
        "b",
        "c",
        "--as",
        "bob",
        "--library",
        libs,
    ]);
    assert_eq!(
        (&p["changed"], &p["entry"]["version"]),
        (&json!(true), &json!(2))
    );
    let e = w.json(&["context", "get", "seen", "--library", libs]);
    assert_eq!(e["value"], json!(["a", "b", "c"]));
    assert_eq!(e["writer"], "bob");
    w.ok(&[
        "context",
        "put",
        "best",
        "3",
        "--rule",
        "max",
        "--as",
        "a",
        "--library",
        libs,
    ]);
    w.ok(&[
        "context",
        "put",
        "best",
        "2.5",
        "--as",
        "b",
        "--library",
        libs,
    ]);
    assert_eq!(
        w.json(&["context", "get", "best", "--library", libs])["value"],
        3
    );
    w.ok(&[
        "context",
        "put",
        "plan",
        "v1",
        "--as",
        "a",
        "--library",
        libs,
    ]);
    let stale = w.run(&[
        "context",
        "put",
        "plan",
        "v2",
        "--version",
        "0",
        "--as",
        "b",
        "--library",
        libs,
    ]);
    assert_eq!(stale.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&stale.stderr).contains("conflict: key \"plan\" is at version 1")
    );
    let keys = w.json(&["context", "keys", "--library", libs]);
    let names: Vec<&str> = keys
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["key"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["best", "plan", "seen"]);
    for (args, code) in [
        (
            vec!["context", "put", "k", "x", "--rule", "union", "--as", "a"],
            2,
        ),
        (vec!["context", "put", "best", "high", "--as", "a"], 2),
        (vec!["context", "put", "plan", "x", "y", "--as", "a"], 2),
        (vec!["context", "get", "nothing"], 1),
        (
            vec!["context", "put", "seen", "z", "--version", "3", "--as", "a"],
            2,
        ),
    ] {
        let mut all = args.clone();
        all.extend(["--library", libs]);
        let out = w.run(&all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{all:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{all:?}: {err}");
    }
    // A reader never creates a mistyped library.
    let typo = w.dir.path().join("typo").join("deep");
    let out = w.run(&["context", "keys", "--library", typo.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(!typo.exists(), "context keys created {}", typo.display());
}
