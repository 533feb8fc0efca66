//! Any byte string, cut into lines, sent to the MCP server's dispatch (the server
//! `handoffs mcp` runs, over an in-memory pipe instead of stdio): never a panic, every output
//! line is one JSON-RPC message, every request with an id gets an answer with that id (a
//! client never waits forever), and no id is answered more often than messages carry it. The
//! harness acts as a client: it waits for its answers before it closes the session.
//! Run from the repository root, on a copy of the seeds (libFuzzer adds to its corpus folder):
//! `cp -r fuzz/seeds/mcp_lines /tmp/c && cargo fuzz run --dev -s none --features mcp mcp_lines /tmp/c --
//! -dict=fuzz/mcp_lines.dict` (works on stable; `.ci/run` runs it for a minute).
//! Virtual time: a `wait_for_messages` in the input ends at once.
#![no_main]

use handoffs::front::mcp::{McpServer, serve_lines};
use handoffs::service::Service;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

/// A database with the agent the server acts as and one peer, a ledger root and a context
/// library, in a temporary folder kept for the whole run.
struct World {
    _dir: tempfile::TempDir,
    db: PathBuf,
    root: PathBuf,
    library: PathBuf,
}

fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let db = dir.path().join("handoffs.db");
        let (mut svc, _) = Service::init(&db).expect("a new database");
        for id in ["fuzzer", "peer"] {
            svc.add_agent(id, Some("demo"), None, None, None, &[])
                .expect("an agent");
        }
        let root = dir.path().join("project");
        let library = dir.path().join("library");
        std::fs::create_dir_all(&root).expect("a project root");
        std::fs::create_dir_all(&library).expect("a library");
        World {
            _dir: dir,
            db,
            root,
            library,
        }
    })
}

/// An id as a key: a number with an integer value counts as that integer (rmcp reads `1.0`
/// and `1e0` as the id 1, and answers with `1`); any other number or string as written.
fn key(id: &Value) -> String {
    match id.as_f64() {
        // An integral float well inside i64: the integer it names.
        Some(f) if id.as_i64().is_none() && f.fract() == 0.0 && f.abs() < 9.0e15 => {
            format!("{}", f as i64)
        }
        _ => id.to_string(),
    }
}

/// A line as a JSON object, without the `\r` and byte-order mark the server also strips.
fn object_of(line: &[u8]) -> Option<serde_json::Map<String, Value>> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let line = line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line);
    match serde_json::from_slice(line).ok()? {
        Value::Object(o) => Some(o),
        _ => None,
    }
}

/// The id a line's message carries, when it is one a client can match (a string or a
/// number), with whether the message is a request (it names a method) or something else an
/// answer may go to (neither a method nor a result nor an error: an invalid request).
fn id_of(line: &[u8]) -> Option<(String, bool)> {
    let object = object_of(line)?;
    let id = object
        .get("id")
        .filter(|i| i.is_string() || i.is_number())?;
    let request = object.get("method").is_some_and(Value::is_string);
    let answerable = request || !(object.contains_key("result") || object.contains_key("error"));
    answerable.then(|| (key(id), request))
}

/// The request a line cancels (`notifications/cancelled`): MCP lets the server drop its answer.
fn cancelled_by(line: &[u8]) -> Option<String> {
    let object = object_of(line)?;
    if object.get("method")? != "notifications/cancelled" {
        return None;
    }
    object.get("params")?.get("requestId").map(key)
}

fuzz_target!(|data: &[u8]| {
    let w = world();
    // What the input asks for: per id, how many requests carry it, and how many messages
    // carry it at all (an invalid request may be answered with its id).
    let mut requests: BTreeMap<String, usize> = BTreeMap::new();
    let mut carriers: BTreeMap<String, usize> = BTreeMap::new();
    let mut cancelled = std::collections::BTreeSet::new();
    for line in data.split(|b| *b == b'\n') {
        cancelled.extend(cancelled_by(line));
        if let Some((id, request)) = id_of(line) {
            *carriers.entry(id.clone()).or_default() += 1;
            if request {
                *requests.entry(id).or_default() += 1;
            }
        }
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a runtime");
    let output = runtime.block_on(async {
        let server = McpServer::new(&w.db, "fuzzer", Some(&w.library))
            .expect("the server opens")
            .with_ledger_root(w.root.clone());
        let (mut client, server_in) = tokio::io::duplex(1 << 16);
        let (server_out, answers) = tokio::io::duplex(1 << 16);
        let serving = tokio::spawn(serve_lines(server, server_in, server_out));
        // Every line ends with a newline, as a client writes them: a last line without one
        // is read only at the end of input (tests/mcp.rs covers that on its own).
        let mut input = data.to_vec();
        if input.last().is_some_and(|b| *b != b'\n') {
            input.push(b'\n');
        }
        let feeding = tokio::spawn(async move {
            let _ = client.write_all(&input).await;
            client
        });
        // As a client does: wait for the answers to its requests (an hour of virtual time at
        // most: every wait of the server is shorter), then close the session.
        let mut out = Vec::new();
        let mut answers = BufReader::new(answers);
        let mut open: BTreeMap<String, usize> = requests.clone();
        open.retain(|id, _| !cancelled.contains(id));
        let _ = tokio::time::timeout(Duration::from_secs(3600), async {
            while !open.is_empty() {
                let mut line = Vec::new();
                if answers.read_until(b'\n', &mut line).await.unwrap_or(0) == 0 {
                    return;
                }
                if let Some(id) = serde_json::from_slice::<Value>(&line)
                    .ok()
                    .filter(|m| m.get("method").is_none())
                    .and_then(|m| m.get("id").cloned())
                {
                    open.remove(&key(&id));
                }
                out.extend_from_slice(&line);
            }
        })
        .await;
        let mut client = feeding.await.expect("the input is written");
        let _ = client.shutdown().await;
        answers.read_to_end(&mut out).await.expect("the answers");
        let _ = serving.await.expect("the server never panics");
        out
    });
    let mut answered: BTreeMap<String, usize> = BTreeMap::new();
    for line in output.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        let message: Value = serde_json::from_slice(line).unwrap_or_else(|e| {
            panic!(
                "an output line is not JSON ({e}): {:?}",
                String::from_utf8_lossy(line)
            )
        });
        assert!(
            message.get("jsonrpc") == Some(&Value::from("2.0")),
            "an output line is not JSON-RPC 2.0: {message}"
        );
        // Requests and notifications of the server's own carry a method.
        if message.get("method").is_some() {
            continue;
        }
        let id = message
            .get("id")
            .expect("an answer carries an id (null for none)");
        if !id.is_null() {
            *answered.entry(key(id)).or_default() += 1;
        }
    }
    // A client may not reuse an id within a session (MCP); if it does, one answer is all it
    // can match, and it must get that one. A request the client cancelled may go unanswered.
    for (id, n) in requests.iter().filter(|(id, _)| !cancelled.contains(*id)) {
        let got = answered.get(id).copied().unwrap_or(0);
        assert!(got >= 1, "{n} request(s) with id {id} got {got} answer(s)");
    }
    for (id, got) in &answered {
        let most = carriers.get(id).copied().unwrap_or(0);
        assert!(
            *got <= most,
            "id {id} was answered {got} time(s), but only {most} message(s) carry it"
        );
    }
});
