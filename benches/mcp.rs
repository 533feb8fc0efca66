//! The MCP server's costs (docs/PERFORMANCE.md): over stdio (`handoffs mcp`) and over
//! Streamable HTTP (`serve`'s `/mcp`, with a bearer token).
//! Run: `cargo build --release && cargo bench --bench mcp`.
//!
//! A bench binary: the figures are across a process boundary (spawn → `initialize` reply,
//! `tools/call` round trips over the server's stdio), so they are measured here directly,
//! with medians and percentiles, rather than through criterion's in-process loop.

#![allow(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::many_single_char_names
)]

mod common;

use common::bin;
use handoffs::service::ledger::Ledger;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

fn pct(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn summary(name: &str, mut ms: Vec<f64>) {
    ms.sort_by(f64::total_cmp);
    println!(
        "{name:<44} median {:>8.3} ms   p99 {:>8.3} ms   (n = {})",
        pct(&ms, 0.5),
        pct(&ms, 0.99),
        ms.len()
    );
}

struct Server {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    next: u64,
}

const INIT: &str = r#"{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"bench","version":"1"}}}"#;

fn spawn(db: &Path, root: &Path, agent: &str) -> Server {
    let mut child = Command::new(bin())
        .args(["mcp", "--agent", agent])
        .env("HANDOFFS_DB", db)
        .env("HANDOFFS_ROOT", root)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdin = child.stdin.take().unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    Server {
        child,
        stdin,
        stdout,
        next: 1,
    }
}

impl Server {
    fn line(&mut self, s: &str) {
        self.stdin.write_all(s.as_bytes()).unwrap();
        self.stdin.write_all(b"\n").unwrap();
        self.stdin.flush().unwrap();
    }

    fn reply(&mut self) -> Value {
        let mut buf = String::new();
        self.stdout.read_line(&mut buf).unwrap();
        serde_json::from_str(&buf).unwrap()
    }

    fn call(&mut self, tool: &str, args: &Value) -> Value {
        self.next += 1;
        let req = json!({"jsonrpc": "2.0", "id": self.next, "method": "tools/call",
            "params": {"name": tool, "arguments": args}});
        self.line(&req.to_string());
        let r = self.reply();
        assert_eq!(r["result"]["isError"], json!(false), "{r}");
        r
    }

    fn stop(mut self) {
        drop(self.stdin);
        let _ = self.child.wait();
    }
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("h.sqlite3");
    let root = dir.path().join("project");
    std::fs::create_dir_all(&root).unwrap();
    let h = |args: &[&str]| {
        let ok = Command::new(bin())
            .args(args)
            .env("HANDOFFS_DB", &db)
            .stdout(Stdio::null())
            .status()
            .unwrap()
            .success();
        assert!(ok, "{args:?}");
    };
    h(&["init"]);
    h(&["agent", "add", "alice", "--provider", "demo"]);
    h(&["agent", "add", "bob", "--provider", "demo"]);

    // Spawn → initialize reply (the process start, opening the database, the handshake).
    let mut starts = Vec::new();
    for _ in 0..100 {
        let t = Instant::now();
        let mut s = spawn(&db, &root, "alice");
        s.line(INIT);
        let r = s.reply();
        starts.push(t.elapsed().as_secs_f64() * 1e3);
        assert!(
            r["result"]["serverInfo"]["name"] == json!("handoffs"),
            "{r}"
        );
        s.stop();
    }
    summary("spawn → initialize reply", starts);

    // tools/call round trips over stdio, one client at a time.
    let mut s = spawn(&db, &root, "alice");
    s.line(INIT);
    s.reply();
    s.line(r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#);
    for (tool, args) in [
        ("list_agents", json!({})),
        ("inbox", json!({"limit": 20})),
        ("send_handoff", json!({"to": "bob"})),
    ] {
        // Each send carries a new message (a repeated one would take the duplicate path).
        let with = |i: usize| {
            let mut a = args.clone();
            if tool == "send_handoff" {
                a["message"] = json!(format!("bench handoff {i}"));
            }
            a
        };
        for i in 0..200 {
            s.call(tool, &with(i));
        }
        let mut ms = Vec::new();
        for i in 200..2_200 {
            let a = with(i);
            let t = Instant::now();
            s.call(tool, &a);
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        summary(&format!("tools/call {tool}"), ms);
    }
    s.stop();

    remote(&db, dir.path());

    // 1,000 ledger cycles in process: create, claim (the workspace lease), pass.
    let lroot = dir.path().join("ledger");
    std::fs::create_dir_all(&lroot).unwrap();
    let mut l = Ledger::open_root(&lroot).unwrap();
    let mut per = Vec::new();
    let t = Instant::now();
    for i in 0..1_000 {
        let c = Instant::now();
        let task = l
            .create("alice", &format!("task {i}"), "goal", None, None, None)
            .unwrap();
        let claim = l.claim("alice", &task.id, None).unwrap();
        l.pass(
            "alice",
            &task.id,
            &claim.lease.token,
            "did a part",
            "do the rest",
            &["src/a.rs".to_owned()],
            "bob",
        )
        .unwrap();
        per.push(c.elapsed().as_secs_f64() * 1e3);
    }
    let total = t.elapsed().as_secs_f64();
    summary("ledger create+claim+pass cycle", per);
    println!("{:<44} {total:.3} s for 1,000 cycles", "ledger total");
}

/// One POST to `/mcp`: the JSON-RPC answer (from a JSON body or the event stream) and the
/// session id header, if any.
async fn post(
    http: &reqwest::Client,
    url: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> (Option<Value>, Option<String>) {
    let mut req = http
        .post(url)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(body.to_string());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let mut res = req.send().await.unwrap();
    let session = res
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let Some(id) = body.get("id") else {
        return (None, session);
    };
    let mut text = String::new();
    while let Some(chunk) = res.chunk().await.unwrap() {
        text.push_str(&String::from_utf8_lossy(&chunk));
        let found = text
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .chain(std::iter::once(text.as_str()))
            .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
            .find(|v| v.get("id") == Some(id));
        if found.is_some() {
            return (found, session);
        }
    }
    (None, session)
}

/// Remote MCP: `serve --port 0`, a token for alice, then sessions and tool calls over HTTP
/// on loopback (no TLS), one request at a time.
fn remote(db: &Path, dir: &Path) {
    let out = Command::new(bin())
        .args(["agent", "token", "alice"])
        .env("HANDOFFS_DB", db)
        .stderr(Stdio::null())
        .output()
        .unwrap();
    let auth = format!("Bearer {}", String::from_utf8_lossy(&out.stdout).trim());
    let (mut child, base) = common::serve(db, dir);
    let url = format!("{base}/mcp");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let http = reqwest::Client::new();
        let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "bench", "version": "1"}}});
        let open = || async {
            let (_, session) = post(&http, &url, &[("authorization", &auth)], &init).await;
            let session = session.unwrap();
            let hs = [
                ("authorization", auth.as_str()),
                ("mcp-session-id", session.as_str()),
                ("mcp-protocol-version", "2025-06-18"),
            ];
            post(
                &http,
                &url,
                &hs,
                &json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
            )
            .await;
            session
        };
        // A session's life: initialize, initialized, DELETE (the cap is 16 at once).
        let mut opens = Vec::new();
        for _ in 0..100 {
            let t = Instant::now();
            let session = open().await;
            opens.push(t.elapsed().as_secs_f64() * 1e3);
            http.delete(&url)
                .header("authorization", &auth)
                .header("mcp-session-id", &session)
                .send()
                .await
                .unwrap();
        }
        summary("HTTP initialize + initialized (a session)", opens);
        let session = open().await;
        let hs = [
            ("authorization", auth.as_str()),
            ("mcp-session-id", session.as_str()),
            ("mcp-protocol-version", "2025-06-18"),
        ];
        for (tool, args) in [
            ("list_agents", json!({})),
            ("inbox", json!({"limit": 20})),
            ("send_handoff", json!({"to": "bob"})),
        ] {
            let mut ms = Vec::new();
            for i in 0..2_200 {
                let mut a = args.clone();
                if tool == "send_handoff" {
                    a["message"] = json!(format!("remote bench handoff {i}"));
                }
                let call = json!({"jsonrpc": "2.0", "id": i + 1, "method": "tools/call",
                    "params": {"name": tool, "arguments": a}});
                let t = Instant::now();
                let (answer, _) = post(&http, &url, &hs, &call).await;
                let took = t.elapsed().as_secs_f64() * 1e3;
                let answer = answer.unwrap();
                assert!(answer["result"]["isError"] != json!(true), "{answer}");
                if i >= 200 {
                    ms.push(took);
                }
            }
            summary(&format!("HTTP tools/call {tool}"), ms);
        }
    });
    let _ = child.kill();
    let _ = child.wait();
}
