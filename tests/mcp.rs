//! The MCP server in process, through rmcp's own client over an in-memory pipe: the tools and
//! their schemas, sending as one agent and reading as another, the identity guard, bad input on
//! every tool, and the workspace lease under a race.

mod common;

use handoffs::front::mcp::McpServer;
use rmcp::model::{CallToolRequestParams, CallToolResult, JsonObject};
use rmcp::service::RunningService;
use rmcp::{RoleClient, ServiceExt};
use serde_json::{Value, json};
use std::path::Path;

type Client = RunningService<RoleClient, ()>;

async fn connect(server: McpServer) -> Client {
    let (client_io, server_io) = tokio::io::duplex(1 << 20);
    tokio::spawn(async move {
        if let Ok(running) = server.serve(server_io).await {
            let _ = running.waiting().await;
        }
    });
    ().serve(client_io).await.expect("client connects")
}

fn server(w: &common::World, agent: &str, root: &Path, library: Option<&Path>) -> McpServer {
    McpServer::new(&w.db, agent, library)
        .expect("server starts")
        .with_ledger_root(root.to_owned())
}

async fn call(c: &Client, tool: &str, args: Value) -> CallToolResult {
    let obj: JsonObject = serde_json::from_value(args).expect("object");
    c.call_tool(CallToolRequestParams::new(tool.to_owned()).with_arguments(obj))
        .await
        .expect("a tool call always gets a result")
}

fn ok(r: &CallToolResult) -> Value {
    assert_eq!(r.is_error, Some(false), "tool error: {r:?}");
    r.structured_content.clone().expect("structured result")
}

fn err_text(r: &CallToolResult) -> String {
    assert_eq!(r.is_error, Some(true), "expected a tool error, got {r:?}");
    serde_json::to_string(&r.content).unwrap_or_default()
}

fn world() -> (common::World, std::path::PathBuf) {
    let w = common::World::new();
    for a in ["alice", "bob"] {
        w.ok(&["agent", "add", a, "--provider", "demo"]);
    }
    let root = w.dir.path().join("project");
    std::fs::create_dir_all(root.join(".git")).expect("project");
    (w, root)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_as_one_agent_read_as_another_and_never_as_anyone_else() {
    let (w, root) = world();
    let lib = w.dir.path().join("memory");
    std::fs::create_dir_all(&lib).expect("library");
    let alice = connect(server(&w, "alice", &root, Some(&lib))).await;
    let bob = connect(server(&w, "bob", &root, None)).await;

    let tools = alice.list_all_tools().await.expect("tools");
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    for t in [
        "send_handoff",
        "inbox",
        "read_message",
        "accept_work",
        "return_work",
        "close_work",
        "handoff_status",
        "list_agents",
        "wait_for_messages",
        "create_handoff",
        "claim_handoff",
        "renew_handoff",
        "pass_handoff",
        "complete_handoff",
        "show_handoff",
        "list_handoffs",
        "context_brief",
        "context_search",
        "context_get",
        "context_record",
        "context_supersede",
        "context_status",
    ] {
        assert!(names.contains(&t), "{t} missing from {names:?}");
    }
    let inbox = tools.iter().find(|t| t.name == "inbox").expect("inbox");
    assert_eq!(
        inbox.annotations.as_ref().and_then(|a| a.read_only_hint),
        Some(true)
    );
    let send = tools
        .iter()
        .find(|t| t.name == "send_handoff")
        .expect("send");
    assert_eq!(send.input_schema["type"], json!("object"));
    assert!(send.input_schema["properties"].get("from").is_none());
    // Bob's server has no context library, so no context tools.
    let bob_tools = bob.list_all_tools().await.expect("tools");
    assert!(bob_tools.iter().all(|t| !t.name.starts_with("context_")));

    let sent = ok(&call(
        &alice,
        "send_handoff",
        json!({"to": "bob", "message": "Please review PR 7", "title": "Review"}),
    )
    .await);
    assert_eq!(sent["created"], json!(true));
    assert!(
        sent["warning"]
            .as_str()
            .is_some_and(|w| w.contains("engine")),
        "{sent}"
    );
    let id = sent["id"].as_str().expect("id").to_owned();
    let inbox = ok(&call(&bob, "inbox", json!({})).await);
    assert_eq!(inbox["messages"][0]["id"], json!(id));
    assert_eq!(inbox["messages"][0]["from"], json!("alice"));
    let read = ok(&call(&bob, "read_message", json!({"id": &id[..8]})).await);
    assert_eq!(read["body"], json!("Please review PR 7"));
    ok(&call(&bob, "accept_work", json!({"id": id})).await);
    let err = err_text(&call(&alice, "return_work", json!({"id": id, "summary": "x"})).await);
    assert!(err.contains("bob"), "{err}");
    ok(&call(&bob, "return_work", json!({"id": id, "summary": "LGTM"})).await);
    ok(&call(
        &alice,
        "close_work",
        json!({"id": id, "outcome": "accepted"}),
    )
    .await);

    // The identity guard: every spelling of a sender is refused, and nothing is stored.
    for key in [
        "from",
        "sender",
        "as",
        "agent",
        "fromAgent",
        "from_agent",
        "Sender-Id",
        "actor",
        "sender_name",
        "agent_name",
        "on_behalf",
        "by",
        "requester",
        "userId",
        "myself",
    ] {
        let mut args = json!({"to": "alice", "message": "spoofed"});
        args[key] = json!("alice");
        let err = err_text(&call(&bob, "send_handoff", args).await);
        assert!(err.contains("acts only as bob"), "{key}: {err}");
    }
    let err = err_text(
        &call(
            &alice,
            "context_record",
            json!({"title": "t", "body": "b", "author": "bob"}),
        )
        .await,
    );
    assert!(err.contains("acts only as alice"), "{err}");
    let inbox = ok(&call(&alice, "inbox", json!({"unread_only": false})).await);
    assert!(
        inbox["messages"]
            .as_array()
            .expect("list")
            .iter()
            .all(|m| m["preview"] != json!("spoofed")),
        "{inbox}"
    );

    // Project memory is authored by the server's agent.
    let rec = ok(&call(
        &alice,
        "context_record",
        json!({"title": "Flaky test", "body": "login fails under load"}),
    )
    .await);
    assert_eq!(rec["record"]["author"], json!("alice"));
    let hits = ok(&call(&alice, "context_search", json!({"query": "LOGIN"})).await);
    assert_eq!(hits["hits"].as_array().map(Vec::len), Some(1));
    let file = std::fs::read_to_string(lib.join(rec["record"]["file"].as_str().expect("file")))
        .expect("file");
    assert!(file.contains("author: alice"), "{file}");

    alice.cancel().await.ok();
    bob.cancel().await.ok();
}

/// Arguments that break each property of a tool's input schema in turn.
fn bad_arguments(schema: &JsonObject) -> Vec<Value> {
    let mut out = vec![json!({}), json!({"no_such_argument": 1})];
    let props = schema
        .get("properties")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let mut valid = json!({});
    for (k, p) in &props {
        let ty = p.get("type").cloned().unwrap_or(Value::Null);
        valid[k] = if ty.to_string().contains("string") {
            json!("abcdef")
        } else {
            json!(1)
        };
    }
    for (k, p) in &props {
        let ty = p.get("type").map(Value::to_string).unwrap_or_default();
        let mut wrong = valid.clone();
        wrong[k] = if ty.contains("string") {
            json!(12)
        } else {
            json!("twelve")
        };
        out.push(wrong);
        let mut nested = valid.clone();
        nested[k] = json!({"deep": [1, 2, {"x": null}]});
        out.push(nested);
        if ty.contains("string") || ty.contains("array") {
            let mut big = valid.clone();
            big[k] = if ty.contains("array") {
                json!(vec!["x".repeat(2_000); 2_000])
            } else {
                json!("x".repeat(300_000))
            };
            out.push(big);
        }
        let mut negative = valid.clone();
        if !ty.contains("string") {
            negative[k] = json!(-99_999_999_999i64);
            out.push(negative);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_tool_answers_bad_input_with_a_tool_error() {
    let (w, root) = world();
    let lib = w.dir.path().join("memory");
    std::fs::create_dir_all(&lib).expect("library");
    let alice = connect(server(&w, "alice", &root, Some(&lib))).await;
    let tools = alice.list_all_tools().await.expect("tools");
    let mut calls = 0;
    for t in &tools {
        if t.name == "wait_for_messages" {
            // Bounded by its own timeout; checked below with a short one.
            continue;
        }
        for args in bad_arguments(&t.input_schema) {
            let r = call(&alice, &t.name, args.clone()).await;
            calls += 1;
            // list_agents and context_status take nothing, so {} is valid for them; the others
            // must refuse what breaks their schema.
            let empty_ok = args == json!({})
                && [
                    "list_agents",
                    "list_topics",
                    "context_status",
                    "context_keys",
                    "inbox",
                    "list_handoffs",
                    "handoff_status",
                    "context_brief",
                ]
                .contains(&t.name.as_ref());
            if !empty_ok {
                assert_eq!(r.is_error, Some(true), "{} {args:.200}: {r:?}", t.name);
            }
        }
    }
    let r = call(&alice, "wait_for_messages", json!({"timeout_seconds": 51})).await;
    err_text(&r);
    let r = call(
        &alice,
        "wait_for_messages",
        json!({"timeout_seconds": "soon"}),
    )
    .await;
    err_text(&r);
    let r = call(&alice, "no_such_tool", json!({})).await;
    err_text(&r);
    assert!(calls > 100, "{calls}");
    // Still serving.
    assert!(!alice.list_all_tools().await.expect("tools").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_writer_lease_per_workspace_under_a_race() {
    let (w, root) = world();
    let alice = connect(server(&w, "alice", &root, None)).await;
    let bob = connect(server(&w, "bob", &root, None)).await;
    for round in 0..10 {
        let t1 = ok(&call(&alice, "create_handoff", json!({"title": "A", "goal": "a"})).await);
        let t2 = ok(&call(&alice, "create_handoff", json!({"title": "B", "goal": "b"})).await);
        let (ra, rb) = tokio::join!(
            call(
                &alice,
                "claim_handoff",
                json!({"task_id": t1["task"]["id"]})
            ),
            call(&bob, "claim_handoff", json!({"task_id": t2["task"]["id"]})),
        );
        let winners = [&ra, &rb]
            .iter()
            .filter(|r| r.is_error == Some(false))
            .count();
        assert_eq!(winners, 1, "round {round}: {ra:?} {rb:?}");
        let (winner, task) = if ra.is_error == Some(false) {
            (&alice, &t1)
        } else {
            (&bob, &t2)
        };
        // The server remembers its token; completing frees the workspace.
        ok(&call(
            winner,
            "complete_handoff",
            json!({"task_id": task["task"]["id"]}),
        )
        .await);
    }
    // A brief is only ever queued for a registered agent.
    let t = ok(&call(&alice, "create_handoff", json!({"title": "C", "goal": "c"})).await);
    let err = err_text(
        &call(
            &alice,
            "create_handoff",
            json!({"title": "D", "goal": "d", "target_agent": "bbo"}),
        )
        .await,
    );
    assert!(err.contains("unknown agent"), "{err}");
    ok(&call(&alice, "claim_handoff", json!({"task_id": t["task"]["id"]})).await);
    let err = err_text(
        &call(
            &alice,
            "pass_handoff",
            json!({"task_id": t["task"]["id"], "summary": "s",
            "next_action": "n", "target_agent": "bbo"}),
        )
        .await,
    );
    assert!(err.contains("unknown agent"), "{err}");
    let shown = ok(&call(&alice, "show_handoff", json!({"task_id": t["task"]["id"]})).await);
    assert_eq!(
        shown["task"]["handoffs_used"],
        json!(0),
        "a refused pass spends nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_for_messages_returns_when_mail_arrives() {
    let (w, root) = world();
    let bob = connect(server(&w, "bob", &root, None)).await;
    let r = ok(&call(&bob, "wait_for_messages", json!({"timeout_seconds": 1})).await);
    assert_eq!(r["timed_out"], json!(true));
    let db = w.db.clone();
    let sender = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(500));
        let mut s = handoffs::service::Service::new(handoffs::store::Store::open(&db).expect("db"));
        s.send("alice", "bob", "wake up", None, None, None)
            .expect("send");
    });
    let started = std::time::Instant::now();
    let r = ok(&call(&bob, "wait_for_messages", json!({"timeout_seconds": 20})).await);
    sender.join().expect("sender");
    assert_eq!(r["timed_out"], json!(false), "{r}");
    assert_eq!(r["messages"][0]["preview"], json!("wake up"));
    // Woken by the file watch, not by the 2 s fallback tick.
    assert!(
        started.elapsed() < std::time::Duration::from_millis(1_900),
        "{:?}",
        started.elapsed()
    );
}

/// Random lines into the real server over stdio (seeded, so a failure replays): junk, JSON
/// that is not an object, requests with bad `params`, unknown methods, tool calls with random
/// arguments, notifications. Every request with an id gets exactly one answer with that id
/// (a client never waits forever), every line that is not JSON gets a `-32700`, and a
/// notification is never answered.
#[test]
fn random_lines_get_one_answer_per_request_with_an_id() {
    use rand::{Rng, SeedableRng};
    use std::io::{BufRead, Write};
    let (w, _root) = world();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(
        std::env::var("HANDOFFS_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(13),
    );
    let methods = [
        "tools/list",
        "tools/call",
        "ping",
        "frobnicate",
        "resources/list",
        "prompts/list",
        "initialize",
    ];
    let params = [
        json!(5),
        json!("x"),
        json!([1]),
        json!(true),
        Value::Null,
        json!({}),
        json!({"name": "inbox", "arguments": {}}),
        json!({"name": "send_handoff", "arguments": {"to": "bob", "message": "hi"}}),
        json!({"name": "send_handoff", "arguments": {"to": 3}}),
        json!({"name": "nope"}),
        json!({"name": 5}),
    ];
    let mut lines = vec![
        json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "random", "version": "1"}}})
        .to_string(),
        json!({"jsonrpc": "2.0", "method": "notifications/initialized"}).to_string(),
    ];
    let mut ids = Vec::new();
    let mut junk = 0;
    for n in 1..=400_i64 {
        let line = match rng.random_range(0..10) {
            0 => {
                junk += 1;
                let len = rng.random_range(1..40);
                let s: String = (0..len)
                    .map(|_| char::from(rng.random_range(b'!'..=b'~')))
                    .filter(|c| *c != '{' && *c != '[' && *c != '"' && !c.is_ascii_digit())
                    .collect();
                if s.is_empty() || s == "true" || s == "null" || s == "false" {
                    junk -= 1;
                    continue;
                }
                format!("x{s}")
            }
            1 => {
                // A notification: never answered.
                let p = &params[rng.random_range(0..params.len())];
                json!({"jsonrpc": "2.0", "method": "notifications/x", "params": p}).to_string()
            }
            _ => {
                let id = if rng.random_bool(0.5) {
                    json!(n)
                } else {
                    json!(format!("r{n}"))
                };
                ids.push(id.clone());
                let m = methods[rng.random_range(0..methods.len())];
                let mut req = json!({"jsonrpc": "2.0", "id": id, "method": m});
                if rng.random_bool(0.8) {
                    req["params"] = params[rng.random_range(0..params.len())].clone();
                }
                req.to_string()
            }
        };
        lines.push(line);
    }
    let mut child = w
        .cmd()
        .args(["mcp", "--agent", "alice"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in stdout.lines().map_while(Result::ok) {
            let _ = tx.send(serde_json::from_str::<Value>(&l).expect("every answer is JSON"));
        }
    });
    for l in &lines {
        writeln!(stdin, "{l}").unwrap();
    }
    stdin.flush().unwrap();
    // As many answers as requests with an id and junk lines; then a moment for any extra
    // answer (to a notification, twice to one id) to show.
    let expected = ids.len() + 1 + junk;
    let mut answers = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while answers.len() < expected {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(a) => answers.push(a),
            Err(_) => break,
        }
    }
    while let Ok(a) = rx.recv_timeout(std::time::Duration::from_millis(500)) {
        answers.push(a);
    }
    drop(stdin);
    let _ = child.wait();
    let mut by_id = std::collections::HashMap::<String, usize>::new();
    let mut parse_errors = 0;
    for a in &answers {
        if a["id"].is_null() {
            assert_eq!(a["error"]["code"], -32700, "an answer without an id: {a}");
            parse_errors += 1;
        } else {
            *by_id.entry(a["id"].to_string()).or_default() += 1;
        }
    }
    let unanswered: Vec<&Value> = ids
        .iter()
        .filter(|id| by_id.get(&id.to_string()).copied().unwrap_or(0) != 1)
        .collect();
    assert!(
        unanswered.is_empty(),
        "requests not answered exactly once: {unanswered:?} ({} of {})",
        unanswered.len(),
        ids.len()
    );
    assert_eq!(
        by_id.len(),
        ids.len() + 1,
        "answers to ids never sent (or to a notification)"
    );
    assert_eq!(parse_errors, junk, "one -32700 per line that is not JSON");
}

/// CLI `task pass` and MCP `pass_handoff` are one operation: the same registration check,
/// the same ledger record and the same handoff telling the next agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_pass_on_the_cli_and_over_mcp_do_the_same() {
    let (w, root) = world();
    let cli = |args: &[&str]| -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let out = w.cmd().current_dir(&root).args(&all).output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    // Over MCP.
    let alice = connect(server(&w, "alice", &root, None)).await;
    let t = ok(&call(
        &alice,
        "create_handoff",
        json!({"title": "Over MCP", "goal": "g"}),
    )
    .await);
    let mcp_task = t["task"]["id"].as_str().unwrap().to_owned();
    ok(&call(&alice, "claim_handoff", json!({"task_id": mcp_task})).await);
    let refused = err_text(
        &call(
            &alice,
            "pass_handoff",
            json!({"task_id": mcp_task, "summary": "s", "next_action": "n", "target_agent": "nobody"}),
        )
        .await,
    );
    let by_mcp = ok(&call(
        &alice,
        "pass_handoff",
        json!({"task_id": mcp_task, "summary": "s", "next_action": "review it", "target_agent": "bob"}),
    )
    .await);
    // On the command line.
    let t = cli(&[
        "task",
        "create",
        "--as",
        "alice",
        "--title",
        "On the CLI",
        "--goal",
        "g",
    ]);
    let cli_task = t["id"]
        .as_str()
        .or(t["task"]["id"].as_str())
        .unwrap()
        .to_owned();
    let claimed = cli(&["task", "claim", &cli_task, "--as", "alice"]);
    let token = claimed["lease"]["token"].as_str().unwrap().to_owned();
    let out = w
        .cmd()
        .current_dir(&root)
        .args([
            "task",
            "pass",
            &cli_task,
            "--as",
            "alice",
            "--token",
            &token,
            "--summary",
            "s",
            "--next",
            "n",
            "--to",
            "nobody",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let cli_refused = String::from_utf8_lossy(&out.stderr).into_owned();
    let by_cli = cli(&[
        "task",
        "pass",
        &cli_task,
        "--as",
        "alice",
        "--token",
        &token,
        "--summary",
        "s",
        "--next",
        "review it",
        "--to",
        "bob",
    ]);
    // The same refusal, the same record, the same notification.
    assert!(
        refused.contains("unknown agent \\\"nobody\\\""),
        "{refused}"
    );
    assert!(
        cli_refused.contains("unknown agent \"nobody\""),
        "{cli_refused}"
    );
    let keys = |v: &Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
    assert_eq!(keys(&by_mcp), keys(&by_cli));
    for v in [&by_mcp, &by_cli] {
        assert_eq!(v["task"]["state"], "queued", "{v}");
        assert_eq!(v["task"]["target_agent"], "bob", "{v}");
        assert!(v["notice"]["message_id"].is_string(), "{v}");
    }
    let inbox = cli(&["inbox", "bob"]);
    let texts: Vec<String> = inbox
        .as_array()
        .or(inbox["messages"].as_array())
        .unwrap()
        .iter()
        .map(|m| {
            m["body"]
                .as_str()
                .unwrap()
                .replace(&mcp_task, "ID")
                .replace(&cli_task, "ID")
                .replace("Over MCP", "TITLE")
                .replace("On the CLI", "TITLE")
        })
        .collect();
    assert_eq!(texts.len(), 2, "{inbox}");
    assert_eq!(texts[0], texts[1]);
}

/// A client that writes its last lines and closes its side at once still reads every answer,
/// to the bad lines as to a last request without a newline.
#[test]
fn answers_outlive_the_end_of_input() {
    use std::io::Write;
    let (w, _root) = world();
    for _ in 0..5 {
        let mut child = w
            .cmd()
            .args(["mcp", "--agent", "alice"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "eof", "version": "1"}}});
        write!(
            stdin,
            "{init}\n{}\nnot json\n{}\n{}",
            json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
            json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": 5}),
            json!({"jsonrpc": "2.0", "id": 8, "method": "ping", "params": null}),
        )
        .unwrap();
        drop(stdin);
        let out = child.wait_with_output().unwrap();
        let answers: Vec<Value> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let ids: Vec<&Value> = answers.iter().map(|a| &a["id"]).collect();
        for id in [json!(0), Value::Null, json!(7), json!(8)] {
            assert!(ids.contains(&&id), "no answer for id {id}: {answers:?}");
        }
    }
}

/// Every tool declares the shape of its structured result (`outputSchema`), and every result
/// it gives, in a session that calls each tool once, matches that declaration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_result_matches_its_tools_output_schema() {
    let (w, root) = world();
    let lib = w.dir.path().join("memory");
    std::fs::create_dir_all(&lib).expect("library");
    let alice = connect(server(&w, "alice", &root, Some(&lib))).await;
    let bob = connect(server(&w, "bob", &root, None)).await;
    let mut schemas = std::collections::HashMap::new();
    for t in alice.list_all_tools().await.expect("tools") {
        let schema = t
            .output_schema
            .clone()
            .unwrap_or_else(|| panic!("{} declares no outputSchema", t.name));
        assert_eq!(schema.get("type"), Some(&json!("object")), "{}", t.name);
        let validator = jsonschema::validator_for(&Value::Object((*schema).clone()))
            .unwrap_or_else(|e| panic!("{}'s outputSchema is not a schema: {e}", t.name));
        let required: Vec<String> = schema
            .get("required")
            .and_then(Value::as_array)
            .map(|r| {
                r.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        schemas.insert(t.name.to_string(), (validator, required));
    }
    let mut checked = std::collections::BTreeSet::new();
    let mut check = |tool: &str, r: &CallToolResult| -> Value {
        let v = ok(r);
        let (validator, required) = schemas.get(tool).expect("a listed tool");
        let problems: Vec<String> = validator.iter_errors(&v).map(|e| e.to_string()).collect();
        assert!(
            problems.is_empty(),
            "{tool} returned {v:#} against its outputSchema: {problems:?}"
        );
        // The check bites: the same result without its first required property fails it.
        if let Some(key) = required.first() {
            let mut broken = v.clone();
            broken.as_object_mut().expect("an object").remove(key);
            assert!(
                !validator.is_valid(&broken),
                "{tool} without {key} still passes"
            );
        }
        checked.insert(tool.to_owned());
        v
    };
    let sent = check(
        "send_handoff",
        &call(
            &alice,
            "send_handoff",
            json!({"to": "bob", "message": "do it", "title": "t"}),
        )
        .await,
    );
    let id = sent["id"].as_str().expect("id").to_owned();
    check("inbox", &call(&bob, "inbox", json!({})).await);
    check(
        "read_message",
        &call(&bob, "read_message", json!({"id": id})).await,
    );
    check(
        "accept_work",
        &call(&bob, "accept_work", json!({"id": id})).await,
    );
    check(
        "return_work",
        &call(&bob, "return_work", json!({"id": id, "summary": "done"})).await,
    );
    check(
        "close_work",
        &call(
            &alice,
            "close_work",
            json!({"id": id, "outcome": "accepted"}),
        )
        .await,
    );
    let plan = check(
        "send_handoff",
        &call(
            &alice,
            "send_handoff",
            json!({"to": "bob", "message": "a plan to drop", "budget": "tokens=10"}),
        )
        .await,
    );
    assert_eq!(plan["hop"], 0, "a chain of its own: {plan}");
    // bob spends from the plan's budget (naming its message: no turn of his runs here).
    let spent = check(
        "spend_budget",
        &call(
            &bob,
            "spend_budget",
            json!({"units": {"tokens": 4, "usd": 0.25}, "parent": plan["id"]}),
        )
        .await,
    );
    assert_eq!(spent["units"]["tokens"]["spent"], 4, "{spent}");
    assert_eq!(spent["units"]["usd"]["spent"], 0.25, "{spent}");
    let over = err_text(
        &call(
            &bob,
            "spend_budget",
            json!({"units": {"tokens": 7}, "parent": plan["id"]}),
        )
        .await,
    );
    assert!(
        over.contains("budget tokens=10 spent: 4 used, 7 more asked"),
        "{over}"
    );
    // Only the chain's origin cancels it, whoever a tool's arguments name.
    let spoof = err_text(&call(&bob, "cancel_chain", json!({"id": plan["id"]})).await);
    assert!(spoof.contains("only the chain's origin (alice)"), "{spoof}");
    let cancelled = check(
        "cancel_chain",
        &call(
            &alice,
            "cancel_chain",
            json!({"id": plan["id"], "note": "dropped"}),
        )
        .await,
    );
    assert_eq!(cancelled["cancelled"], json!([plan["id"]]), "{cancelled}");
    check(
        "handoff_status",
        &call(&alice, "handoff_status", json!({"id": id})).await,
    );
    check(
        "handoff_status",
        &call(&alice, "handoff_status", json!({})).await,
    );
    check("list_agents", &call(&alice, "list_agents", json!({})).await);
    check(
        "wait_for_messages",
        &call(&alice, "wait_for_messages", json!({"timeout_seconds": 1})).await,
    );
    let task = check(
        "create_handoff",
        &call(
            &alice,
            "create_handoff",
            json!({"title": "brief", "goal": "g"}),
        )
        .await,
    );
    let task_id = task["task"]["id"].as_str().expect("task id").to_owned();
    check(
        "claim_handoff",
        &call(&alice, "claim_handoff", json!({"task_id": task_id})).await,
    );
    check(
        "renew_handoff",
        &call(&alice, "renew_handoff", json!({"task_id": task_id})).await,
    );
    check(
        "pass_handoff",
        &call(
            &alice,
            "pass_handoff",
            json!({"task_id": task_id, "summary": "s", "next_action": "n", "target_agent": "bob"}),
        )
        .await,
    );
    check(
        "claim_handoff",
        &call(&bob, "claim_handoff", json!({"task_id": task_id})).await,
    );
    check(
        "complete_handoff",
        &call(&bob, "complete_handoff", json!({"task_id": task_id})).await,
    );
    check(
        "show_handoff",
        &call(&alice, "show_handoff", json!({"task_id": task_id})).await,
    );
    check(
        "list_handoffs",
        &call(&alice, "list_handoffs", json!({})).await,
    );
    let rec = check(
        "context_record",
        &call(
            &alice,
            "context_record",
            json!({"title": "Layout", "body": "tests live in tests/"}),
        )
        .await,
    );
    let rec_id = rec["record"]["id"].as_str().expect("record id").to_owned();
    check(
        "context_get",
        &call(&alice, "context_get", json!({"id": rec_id})).await,
    );
    check(
        "context_search",
        &call(&alice, "context_search", json!({"query": "tests"})).await,
    );
    check(
        "context_supersede",
        &call(
            &alice,
            "context_supersede",
            json!({"id": rec_id, "body": "tests live in tests/ and sim/"}),
        )
        .await,
    );
    check(
        "context_brief",
        &call(&alice, "context_brief", json!({})).await,
    );
    check(
        "context_status",
        &call(&alice, "context_status", json!({})).await,
    );
    // The shared corpus: a keyed entry, its version, a stale write refused.
    let bob_lib = connect(server(&w, "bob", &root, Some(&lib))).await;
    let put = check(
        "context_put",
        &call(&alice, "context_put", json!({"key": "plan", "value": "v1"})).await,
    );
    assert_eq!(put["entry"]["version"], 1, "{put}");
    assert_eq!(put["entry"]["writer"], "alice", "{put}");
    let got = ok(&call(&bob_lib, "context_get", json!({"key": "plan"})).await);
    assert_eq!(got["entry"]["value"], "v1", "{got}");
    ok(&call(
        &bob_lib,
        "context_put",
        json!({"key": "plan", "value": "v2", "version": 1}),
    )
    .await);
    let stale = err_text(
        &call(
            &alice,
            "context_put",
            json!({"key": "plan", "value": "v3", "version": 1}),
        )
        .await,
    );
    assert!(
        stale.contains("conflict: key \\\"plan\\\" is at version 2, written by bob"),
        "{stale}"
    );
    let keys = check(
        "context_keys",
        &call(&alice, "context_keys", json!({})).await,
    );
    assert_eq!(keys["entries"][0]["key"], "plan", "{keys}");
    // Topics: alice subscribes, bob publishes as himself (no argument names anyone else),
    // alice is told once in her inbox and reads the post from her cursor.
    w.ok(&["topic", "create", "news"]);
    let sub = check(
        "subscribe",
        &call(&alice, "subscribe", json!({"topic": "news"})).await,
    );
    assert_eq!(
        (&sub["agent"], &sub["new"]),
        (&json!("alice"), &json!(true))
    );
    let spoof = err_text(
        &call(
            &bob,
            "publish",
            json!({"topic": "news", "message": "hi", "from": "alice"}),
        )
        .await,
    );
    assert!(spoof.contains("this server acts only as bob"), "{spoof}");
    let published = check(
        "publish",
        &call(
            &bob,
            "publish",
            json!({"topic": "news", "message": "build is green"}),
        )
        .await,
    );
    assert_eq!(published["publisher"], "bob", "{published}");
    assert_eq!(published["position"], 1, "{published}");
    assert_eq!(published["notified"], json!(["alice"]), "{published}");
    let listed_topics = check("list_topics", &call(&alice, "list_topics", json!({})).await);
    assert_eq!(
        listed_topics["topics"][0]["subscribers"],
        json!(["alice"]),
        "{listed_topics}"
    );
    let inbox = ok(&call(&alice, "inbox", json!({"limit": 500})).await);
    let told: Vec<&Value> = inbox["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["title"] == "news #1")
        .collect();
    assert_eq!(told.len(), 1, "{inbox}");
    assert_eq!(told[0]["from"], "bob");
    let read = check(
        "read_topic",
        &call(&alice, "read_topic", json!({"topic": "news"})).await,
    );
    assert_eq!(read["posts"][0]["body"], "build is green", "{read}");
    assert_eq!((&read["cursor"], &read["skipped"]), (&json!(1), &json!(0)));
    let again = ok(&call(&alice, "read_topic", json!({"topic": "news"})).await);
    assert_eq!(again["posts"], json!([]), "{again}");
    // A long return summary: the card carries the cap and a marker; the whole text is an
    // artifact the card's two agents fetch.
    let long = "all tests pass; ".repeat(200);
    let work = ok(&call(
        &alice,
        "send_handoff",
        json!({"to": "bob", "message": "audit it", "title": "audit"}),
    )
    .await);
    let returned = ok(&call(
        &bob,
        "return_work",
        json!({"id": work["id"], "summary": long}),
    )
    .await);
    let card = ok(&call(
        &alice,
        "read_message",
        json!({"id": returned["return_message_id"]}),
    )
    .await);
    let body = card["body"].as_str().expect("a body");
    assert!(body.len() < 2_048 + 200, "{} bytes: {body}", body.len());
    let artifact = body
        .split("handoffs artifact get ")
        .nth(1)
        .and_then(|r| r.split('`').next())
        .unwrap_or_else(|| panic!("no artifact named in {body}"));
    let fetched = check(
        "get_artifact",
        &call(&alice, "get_artifact", json!({"id": artifact})).await,
    );
    assert_eq!(fetched["body"], long.as_str(), "{fetched}");
    ok(&call(&bob, "get_artifact", json!({"id": artifact})).await);
    let gone = check(
        "unsubscribe",
        &call(&alice, "unsubscribe", json!({"topic": "news"})).await,
    );
    assert_eq!(gone["removed"], true, "{gone}");
    // A fan-out from alice to bob and carol, joined on the first return: one combined
    // return reaches alice; carol's later return is recorded late. Nobody names a sender.
    let spoof = err_text(
        &call(
            &bob,
            "fan_out",
            json!({"to": ["carol"], "message": "m", "title": "t", "sender": "alice"}),
        )
        .await,
    );
    assert!(spoof.contains("this server acts only as bob"), "{spoof}");
    w.ok(&["agent", "add", "carol", "--provider", "demo"]);
    let fan = check(
        "fan_out",
        &call(
            &alice,
            "fan_out",
            json!({"to": ["bob", "carol"], "message": "review it", "title": "review",
                   "join": "quorum:1", "deadline_minutes": 30}),
        )
        .await,
    );
    assert_eq!(
        (&fan["join"], &fan["created"]),
        (&json!("quorum:1"), &json!(true))
    );
    let kids = fan["children"].as_array().expect("children");
    assert_eq!(kids.len(), 2, "{fan}");
    let carol = connect(server(&w, "carol", &root, None)).await;
    let first = ok(&call(
        &bob,
        "return_work",
        json!({"id": kids[0]["id"], "summary": "fine"}),
    )
    .await);
    assert_eq!(first["fanout"]["state"], "complete", "{first}");
    let late = ok(&call(
        &carol,
        "return_work",
        json!({"id": kids[1]["id"], "summary": "also fine"}),
    )
    .await);
    assert_eq!(late["fanout"]["state"], "complete", "{late}");
    assert_ne!(late["return_message_id"], first["return_message_id"]);
    let inbox = ok(&call(&alice, "inbox", json!({"limit": 500})).await);
    let joined: Vec<&Value> = inbox["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["title"] == "joined (1/2): review")
        .collect();
    assert_eq!(joined.len(), 1, "one combined return: {inbox}");
    let status = check(
        "fanout_status",
        &call(&carol, "fanout_status", json!({"id": fan["fanout_id"]})).await,
    );
    assert_eq!(status["fanout"]["state"], "complete", "{status}");
    assert_eq!(status["children"][1]["late"], true, "{status}");
    // The fan-out's chain as a diagram, for an agent that took part in it; nobody else.
    let traced = check(
        "trace_chain",
        &call(&bob, "trace_chain", json!({"id": kids[0]["id"]})).await,
    );
    let diagram = traced["text"].as_str().expect("text");
    assert!(
        diagram.starts_with("sequenceDiagram")
            && diagram.contains(" as bob")
            && diagram.contains(": review ("),
        "{diagram}"
    );
    let jsonl = ok(&call(
        &alice,
        "trace_chain",
        json!({"id": kids[0]["id"], "format": "jsonl"}),
    )
    .await);
    assert!(jsonl["events"].as_i64().unwrap() > 3, "{jsonl}");
    w.ok(&["agent", "add", "dave", "--provider", "demo"]);
    let dave = connect(server(&w, "dave", &root, None)).await;
    let outsider = err_text(&call(&dave, "trace_chain", json!({"id": kids[0]["id"]})).await);
    assert!(
        outsider.contains("dave took no part in the chain"),
        "{outsider}"
    );
    let outsider = err_text(&call(&dave, "fanout_status", json!({"id": fan["fanout_id"]})).await);
    assert!(
        outsider.contains("dave is neither the sender nor a child"),
        "{outsider}"
    );
    let listed: std::collections::BTreeSet<String> = alice
        .list_all_tools()
        .await
        .expect("tools")
        .into_iter()
        .map(|t| t.name.to_string())
        .collect();
    assert_eq!(checked, listed, "every tool's result is checked");
}

/// A refusal names the tool's own fields, never the CLI's flags.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_name_the_tools_fields_not_cli_flags() {
    let (w, root) = world();
    let alice = connect(server(&w, "alice", &root, None)).await;
    for (args, field) in [
        (
            json!({"to": "bob", "message": "m", "due_minutes": 5}),
            "due_minutes",
        ),
        (
            json!({"to": "bob", "message": "m", "title": "t", "due_minutes": 0}),
            "due_minutes",
        ),
    ] {
        let text = err_text(&call(&alice, "send_handoff", args.clone()).await);
        assert!(text.contains(field), "{args}: {text}");
        assert!(!text.contains("--"), "{args} names a CLI flag: {text}");
    }
}

/// Two MCP agents play ping-pong: each waits for the handoff (`wait_for_messages`), reads it
/// and answers it with one to the other, naming no parent: the session's read handoff is the
/// parent, so the answers continue the chain until its hop budget stops them: exactly the
/// budget's continuations, the next send refused, the chain in `needs_human`, one
/// notification in the origin's inbox however often they try again, and the session's wait
/// tells the stop once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_mcp_agents_ping_pong_until_the_budget_stops_them() {
    let (w, root) = world();
    let agents = [
        ("alice", connect(server(&w, "alice", &root, None)).await),
        ("bob", connect(server(&w, "bob", &root, None)).await),
    ];
    let budget = 4;
    let first = ok(&call(
        &agents[0].1,
        "send_handoff",
        json!({"to": "bob", "message": "serve", "budget": format!("hops={budget}")}),
    )
    .await);
    let chain = first["chain_id"].as_str().expect("chain").to_owned();
    let mut last = first["id"].as_str().expect("id").to_owned();
    let mut turn = 1; // bob answers first
    let mut passed = 0;
    let refusal = loop {
        let (me, client) = (&agents[turn].0, &agents[turn].1);
        let other = agents[1 - turn].0;
        let woke = ok(&call(client, "wait_for_messages", json!({"timeout_seconds": 10})).await);
        assert_eq!(woke["timed_out"], json!(false), "{me}: {woke}");
        assert!(
            woke["messages"]
                .as_array()
                .is_some_and(|l| l.iter().any(|m| m["id"] == last.as_str())),
            "{me} woke for the handoff: {woke}"
        );
        ok(&call(client, "read_message", json!({"id": last})).await);
        let r = call(
            client,
            "send_handoff",
            json!({"to": other, "message": format!("return {passed}")}),
        )
        .await;
        if r.is_error == Some(true) {
            break err_text(&r);
        }
        let sent = ok(&r);
        passed += 1;
        assert_eq!(sent["chain_id"], json!(chain), "{sent}");
        assert_eq!(sent["hop"], json!(passed), "{sent}");
        last = sent["id"].as_str().expect("id").to_owned();
        turn = 1 - turn;
        if passed > budget + 2 {
            break String::new();
        }
    };
    assert_eq!(
        passed, budget,
        "chains: the MCP ping-pong ran past its hop budget of {budget}"
    );
    assert!(
        refusal.contains(&format!("hop budget {budget} spent")),
        "{refusal}"
    );
    // Trying again is refused too, and tells nobody again.
    let (_, client) = &agents[turn];
    let again = call(
        client,
        "send_handoff",
        json!({"to": agents[1 - turn].0, "message": "once more"}),
    )
    .await;
    assert!(err_text(&again).contains("waits for a person"), "{again:?}");
    // The session's wait says once that the chain of its work is spent, then waits for
    // mail: an agent that loops on it does not spin.
    let told = ok(&call(client, "wait_for_messages", json!({"timeout_seconds": 5})).await);
    assert_eq!(told["woke"], "budget_spent", "{told}");
    let quiet = ok(&call(client, "wait_for_messages", json!({"timeout_seconds": 1})).await);
    assert_eq!(quiet["woke"], "timeout", "{quiet}");
    // A send with a budget of its own starts a new chain, whatever the session read.
    let fresh = ok(&call(
        client,
        "send_handoff",
        json!({"to": agents[1 - turn].0, "message": "a new plan", "budget": "hops=1"}),
    )
    .await);
    assert_eq!(fresh["hop"], 0, "{fresh}");
    assert_eq!(fresh["chain_id"], fresh["id"], "{fresh}");
    // Units are names, never text that smuggles in another unit.
    let smuggled = call(
        client,
        "spend_budget",
        json!({"units": {"tokens=1,usd": 2}, "parent": fresh["id"]}),
    )
    .await;
    assert!(
        err_text(&smuggled).contains("not a unit name"),
        "{smuggled:?}"
    );
    let c = w.json(&["chain", "show", &chain]);
    assert_eq!(c["chain"]["state"], "needs_human", "{c}");
    assert_eq!(c["chain"]["hops"], json!(budget), "{c}");
    let inbox = ok(&call(&agents[0].1, "inbox", json!({"unread_only": false})).await);
    let stops: Vec<&Value> = inbox["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["title"].as_str().is_some_and(|t| t.contains("stopped")))
        .collect();
    assert_eq!(stops.len(), 1, "one notification to the origin: {inbox}");
    assert_eq!(
        stops[0]["from"], "handoffs",
        "told by handoffs itself: {inbox}"
    );
}
