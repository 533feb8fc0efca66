//! Remote MCP (`handoffs serve`'s `/mcp`, Streamable HTTP) as a real process: two agents with
//! their own tokens hand work to each other; the token fixes the identity (a spoofing argument,
//! another agent's session, a wrong, rotated, revoked or expired token are all refused), and
//! the page's Host and Origin checks apply.

mod common;

use serde_json::{Value, json};
use std::process::Child;
use std::time::Duration;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

struct Serving {
    child: Child,
    url: String,
}

impl Serving {
    /// The port `serve` chose.
    fn port(&self) -> &str {
        self.url
            .rsplit(':')
            .next()
            .and_then(|p| p.split('/').next())
            .expect("port")
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(w: &common::World, extra: &[&str]) -> Serving {
    let mut cmd = w.cmd();
    cmd.args(["serve", "--port", "0"]).args(extra);
    let (child, url) = common::start_serving(cmd);
    Serving {
        child,
        url: format!("{url}/mcp"),
    }
}

fn token(w: &common::World, args: &[&str]) -> String {
    let mut all = vec!["agent", "token"];
    all.extend_from_slice(args);
    let t = w.ok(&all).trim().to_owned();
    assert!(t.starts_with("hat_") && t.len() == 68, "{t:?}");
    t
}

/// What one POST to /mcp came back with.
struct Reply {
    status: u16,
    headers: reqwest::header::HeaderMap,
    /// The JSON-RPC response (from the JSON body or the event stream), if any.
    message: Option<Value>,
    text: String,
}

impl Reply {
    fn session(&self) -> String {
        self.headers
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_else(|| panic!("no session id: {} {}", self.status, self.text))
            .to_owned()
    }

    /// The text of a tools/call result, and whether it is an error.
    fn tool(&self) -> (String, bool) {
        let m = self
            .message
            .as_ref()
            .unwrap_or_else(|| panic!("no message: {} {}", self.status, self.text));
        let result = &m["result"];
        let text = result["content"][0]["text"]
            .as_str()
            .unwrap_or_else(|| panic!("no tool text in {m}"))
            .to_owned();
        (text, result["isError"].as_bool().unwrap_or(false))
    }
}

struct Client {
    http: reqwest::Client,
    url: String,
}

impl Client {
    async fn post(&self, headers: &[(&str, &str)], body: &Value) -> Reply {
        let mut req = self
            .http
            .post(&self.url)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(body.to_string());
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let res = req.send().await.expect("request");
        let status = res.status().as_u16();
        let headers = res.headers().clone();
        // Read the event stream only until the answer arrives: the stream may stay open.
        let mut text = String::new();
        let mut message = None;
        let mut res = res;
        while let Ok(Some(chunk)) = tokio::time::timeout(Duration::from_secs(20), res.chunk())
            .await
            .expect("answer in time")
        {
            text.push_str(&String::from_utf8_lossy(&chunk));
            message = answer(&text, body.get("id"));
            if message.is_some() {
                break;
            }
        }
        Reply {
            status,
            headers,
            message,
            text,
        }
    }

    async fn call(
        &self,
        token: &str,
        session: &str,
        id: i64,
        method: &str,
        params: Value,
    ) -> Reply {
        let auth = format!("Bearer {token}");
        self.post(
            &[
                ("authorization", &auth),
                ("mcp-session-id", session),
                ("mcp-protocol-version", "2025-06-18"),
            ],
            &json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}),
        )
        .await
    }

    /// Calls the tool `name` with `arguments` in `session`.
    async fn tool(
        &self,
        token: &str,
        session: &str,
        id: i64,
        name: &str,
        arguments: Value,
    ) -> Reply {
        let params = json!({"name": name, "arguments": arguments});
        self.call(token, session, id, "tools/call", params).await
    }

    /// Opens a session as the token's agent; returns its id.
    async fn open(&self, token: &str) -> String {
        let auth = format!("Bearer {token}");
        let init = self
            .post(
                &[("authorization", &auth)],
                &json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                    "protocolVersion": "2025-06-18", "capabilities": {},
                    "clientInfo": {"name": "remote-test", "version": "1"}}}),
            )
            .await;
        assert_eq!(init.status, 200, "{}", init.text);
        let session = init.session();
        let done = self
            .post(
                &[
                    ("authorization", &auth),
                    ("mcp-session-id", &session),
                    ("mcp-protocol-version", "2025-06-18"),
                ],
                &json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
            )
            .await;
        assert_eq!(done.status, 202, "{}", done.text);
        session
    }
}

/// The JSON-RPC response with `id` in a body that is JSON or an event stream.
fn answer(text: &str, id: Option<&Value>) -> Option<Value> {
    let id = id?;
    if let Ok(v) = serde_json::from_str::<Value>(text.trim()) {
        return (v.get("id") == Some(id)).then_some(v);
    }
    text.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
        .find(|v| v.get("id") == Some(id))
}

/// Opens the session's event stream (GET /mcp).
async fn listen(c: &Client, token: &str, session: String) -> reqwest::Response {
    let res = c
        .http
        .get(&c.url)
        .header("authorization", format!("Bearer {token}"))
        .header("mcp-session-id", session)
        .header("mcp-protocol-version", "2025-06-18")
        .header("accept", "text/event-stream")
        .send()
        .await
        .expect("stream");
    assert_eq!(res.status(), 200);
    res
}

/// True when the stream ends (end of body, or the connection closed) within `secs`.
async fn ends_within(mut res: reqwest::Response, secs: u64) -> bool {
    tokio::time::timeout(Duration::from_secs(secs), async {
        while let Ok(Some(_)) = res.chunk().await {}
    })
    .await
    .is_ok()
}

fn world() -> common::World {
    let w = common::World::new();
    w.ok(&["agent", "add", "alice", "--provider", "demo"]);
    w.ok(&["agent", "add", "bob", "--provider", "demo"]);
    w
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_remote_agents_hand_work_to_each_other_each_as_its_token_says() {
    let w = world();
    let (ta, tb) = (token(&w, &["alice"]), token(&w, &["bob"]));
    let s = serve(&w, &[]);
    let c = Client {
        http: reqwest::Client::new(),
        url: s.url.clone(),
    };
    let (sa, sb) = (c.open(&ta).await, c.open(&tb).await);
    assert_ne!(sa, sb);

    let sent = c
        .tool(
            &ta,
            &sa,
            1,
            "send_handoff",
            json!({
            "to": "bob", "message": "please review the parser", "title": "Review"}),
        )
        .await;
    let (text, is_error) = sent.tool();
    assert!(!is_error, "{text}");

    let inbox = c.tool(&tb, &sb, 2, "inbox", json!({})).await;
    let (text, is_error) = inbox.tool();
    assert!(!is_error, "{text}");
    let listed: Value = serde_json::from_str(&text).expect("inbox JSON");
    let first = &listed["messages"][0];
    assert_eq!(first["from"], "alice", "{listed}");
    assert_eq!(first["title"], "Review", "{listed}");
    let message = first["id"].as_str().expect("id").to_owned();

    // Bob answers through his own session: the return goes back as his.
    let accepted = c
        .tool(&tb, &sb, 3, "accept_work", json!({"id": message}))
        .await;
    assert!(!accepted.tool().1, "{}", accepted.tool().0);
    let returned = c
        .tool(
            &tb,
            &sb,
            4,
            "return_work",
            json!({
            "id": message, "summary": "looks right"}),
        )
        .await;
    assert!(!returned.tool().1, "{}", returned.tool().0);
    let back = w.json(&["inbox", "alice"]);
    let back = back.as_array().expect("inbox list");
    assert!(
        back.iter()
            .any(|m| m["sender"] == "bob" && m["kind"] == "return"),
        "{back:?}"
    );

    // A spoofing argument is refused before anything else, as on stdio.
    let spoof = c
        .tool(
            &ta,
            &sa,
            5,
            "send_handoff",
            json!({
            "to": "bob", "message": "from bob, honest", "from": "bob"}),
        )
        .await;
    let (text, is_error) = spoof.tool();
    assert!(is_error && text.contains("acts only as alice"), "{text}");

    // Alice's token on Bob's session finds no session: the token never reaches a session it
    // did not open.
    let stolen = c.tool(&ta, &sb, 6, "inbox", json!({})).await;
    assert_eq!(
        stolen.status, 404,
        "remote MCP: alice's token reached bob's session ({})",
        stolen.text
    );
    assert!(stolen.message.is_none(), "{}", stolen.text);

    // What Bob received came from Alice alone: one handoff, none "from bob".
    let bob = w.json(&["inbox", "bob"]);
    let bob = bob.as_array().expect("inbox list");
    assert_eq!(bob.len(), 1, "{bob:?}");
    assert_eq!(bob[0]["sender"], "alice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_missing_rotated_revoked_and_expired_tokens_are_refused() {
    let w = world();
    let ta = token(&w, &["alice"]);
    let s = serve(&w, &[]);
    let c = Client {
        http: reqwest::Client::new(),
        url: s.url.clone(),
    };
    // A token for 6 s: it works at once (its time is minutes, not seconds), and the stream
    // it opened ends once it has expired (the sweep, every 5 s).
    let short = token(&w, &["bob", "--expires-minutes", "0.1"]);
    let short_session = c.open(&short).await;
    let short_stream = listen(&c, &short, short_session).await;
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "remote-test", "version": "1"}}});
    let refused = |r: &Reply, says: &str| {
        assert_eq!(r.status, 401, "{}", r.text);
        assert!(r.text.contains(says), "{says:?} not in {}", r.text);
        assert!(
            r.headers
                .get("www-authenticate")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("Bearer")),
            "{:?}",
            r.headers
        );
    };
    refused(&c.post(&[], &init).await, "Authorization: Bearer");
    let basic = c
        .post(&[("authorization", "Basic YWxpY2U6eA==")], &init)
        .await;
    refused(&basic, "Authorization: Bearer");
    let wrong = format!("Bearer hat_{}", "0".repeat(64));
    refused(
        &c.post(&[("authorization", &wrong)], &init).await,
        "unknown token",
    );

    // Expired: the short token's stream ends, and the token is refused.
    assert!(
        ends_within(short_stream, 20).await,
        "remote MCP: an expired token's stream was still open 20 s later"
    );
    let expired = c
        .post(&[("authorization", &format!("Bearer {short}"))], &init)
        .await;
    assert_eq!(
        expired.status, 401,
        "remote MCP: an expired token was taken ({})",
        expired.text
    );
    refused(&expired, "expired");
    // doctor names it, and fails.
    let doctor = w.run(&["doctor"]);
    let said = String::from_utf8_lossy(&doctor.stdout).into_owned();
    assert_eq!(doctor.status.code(), Some(1), "{said}");
    assert!(said.contains("remote MCP token expired"), "{said}");

    // A rotation: the old token is refused at once, and the sessions it opened end with it
    // (a leaked token's sessions must not outlive it), so the new token opens its own.
    let sa = c.open(&ta).await;
    let rotated = token(&w, &["alice"]);
    let inbox = json!({});
    let old = c.tool(&ta, &sa, 1, "inbox", inbox.clone()).await;
    refused(&old, "unknown token");
    let ended = c.tool(&rotated, &sa, 2, "inbox", inbox.clone()).await;
    assert_eq!(ended.status, 404, "{}", ended.text);
    let sa = c.open(&rotated).await;
    let fresh = c.tool(&rotated, &sa, 2, "inbox", inbox).await;
    assert!(!fresh.tool().1, "{}", fresh.text);
    w.ok(&["agent", "token", "alice", "--revoke"]);
    let revoked = c.tool(&rotated, &sa, 3, "inbox", json!({})).await;
    refused(&revoked, "unknown token");
    // Nothing was sent by any refused request.
    assert_eq!(w.json(&["inbox", "bob"]).as_array().map(Vec::len), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_and_origin_checks_apply_to_mcp() {
    let w = world();
    let ta = token(&w, &["alice"]);
    let auth = format!("Bearer {ta}");
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "remote-test", "version": "1"}}});
    let http = reqwest::Client::new();

    let plain = serve(&w, &[]);
    let c = Client {
        http: http.clone(),
        url: plain.url.clone(),
    };
    let port = plain.port();
    let named = format!("agents.example:{port}");
    let r = c
        .post(&[("authorization", &auth), ("host", &named)], &init)
        .await;
    assert_eq!(r.status, 403, "{}", r.text);
    let r = c
        .post(
            &[("authorization", &auth), ("origin", "https://evil.example")],
            &init,
        )
        .await;
    assert_eq!(r.status, 403, "{}", r.text);
    assert!(r.text.contains("Origin"), "{}", r.text);
    let r = c
        .post(
            &[
                ("authorization", &auth),
                ("origin", &format!("http://localhost:{port}")),
            ],
            &init,
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    drop(plain);

    // With --allow-host, that name is answered (the page's check, with one more name).
    let open = serve(&w, &["--allow-host", "agents.example"]);
    let c = Client {
        http,
        url: open.url.clone(),
    };
    let port = open.port();
    let named = format!("agents.example:{port}");
    let r = c
        .post(
            &[
                ("authorization", &auth),
                ("host", &named),
                ("origin", &format!("https://{named}")),
            ],
            &init,
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let r = c
        .post(
            &[
                ("authorization", &auth),
                ("host", &format!("other.example:{port}")),
            ],
            &init,
        )
        .await;
    assert_eq!(r.status, 403, "{}", r.text);
    // The same name with a trailing dot, or in capitals, is the same host.
    for host in [
        format!("agents.example.:{port}"),
        format!("AGENTS.example:{port}"),
    ] {
        let r = c
            .post(&[("authorization", &auth), ("host", &host)], &init)
            .await;
        assert_eq!(r.status, 200, "{host}: {}", r.text);
    }
    // Under an --allow-host name only /mcp and /healthz answer: the page and its API (which
    // show every message without a token) stay on localhost.
    let base = open.url.trim_end_matches("/mcp").to_owned();
    let get = |path: &str, host: String| {
        let http = c.http.clone();
        let url = format!("{base}{path}");
        async move {
            http.get(url)
                .header("host", host)
                .send()
                .await
                .expect("request")
                .status()
                .as_u16()
        }
    };
    for path in ["/", "/api/status", "/api/events", "/metrics"] {
        assert_eq!(
            get(path, named.clone()).await,
            403,
            "remote MCP: {path} answered under the --allow-host name {named}"
        );
        assert_eq!(
            get(path, format!("localhost:{port}")).await,
            200,
            "{path} on localhost"
        );
    }
    assert_eq!(get("/api/stream", named.clone()).await, 403);
    assert_eq!(get("/healthz", named.clone()).await, 200);
}

#[test]
fn token_commands_check_their_input() {
    let w = world();
    let out = w.run(&["agent", "token", "nobody"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown agent"));
    for bad in ["0", "-5", "nan", "1e12"] {
        let out = w.run(&["agent", "token", "alice", "--expires-minutes", bad]);
        assert_eq!(out.status.code(), Some(2), "{bad}: {out:?}");
    }
    let out = w.run(&["agent", "token", "alice", "--never-expires", "--revoke"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    for bad in [
        "a/b",
        "",
        "*.example",
        "2001:db8::1",
        "[zz]",
        "host:99999",
        "user@host",
        "a b",
    ] {
        let out = w.run(&["serve", "--allow-host", bad]);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("--allow-host"),
            "{out:?}"
        );
    }
    let none = w.json(&["agent", "token", "alice", "--show"]);
    assert_eq!(none["token"], false, "{none}");
    let t = w.json(&["agent", "token", "alice", "--never-expires"]);
    assert!(t["expires_at"].is_null() && t["agent"] == "alice", "{t}");
    // --show tells that there is one, never the token itself.
    let shown = w.ok(&["--json", "agent", "token", "alice", "--show"]);
    assert!(
        shown.contains("\"token\": true") || shown.contains("\"token\":true"),
        "{shown}"
    );
    assert!(!shown.contains("hat_"), "{shown}");
    assert!(
        w.ok(&["agent", "token", "alice", "--show"])
            .contains("never expires")
    );
    let out = w.run(&["agent", "token", "alice", "--show", "--revoke"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    // Removing the agent takes its token with it.
    w.ok(&["agent", "remove", "alice"]);
    w.ok(&["agent", "add", "alice", "--provider", "demo"]);
    let again = w.json(&["agent", "token", "alice"]);
    assert_eq!(again["rotated"], false, "{again}");
}

/// `serve --tls-cert/--tls-key`: the same endpoint over HTTPS, a client that trusts the
/// certificate opens a session, and plain HTTP to that port gets no answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_answers_over_tls_with_the_certificate_it_was_given() {
    let w = world();
    let ta = token(&w, &["alice"]);
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).expect("cert");
    let dir = w.dir.path().to_owned();
    let (cert_file, key_file) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert_file, cert.cert.pem()).expect("write cert");
    std::fs::write(&key_file, cert.signing_key.serialize_pem()).expect("write key");
    let mut cmd = w.cmd();
    cmd.args(["serve", "--port", "0", "--tls-cert"])
        .arg(&cert_file)
        .arg("--tls-key")
        .arg(&key_file);
    let (child, url) = common::start_serving(cmd);
    let s = Serving {
        child,
        url: format!("{url}/mcp"),
    };
    assert!(s.url.starts_with("https://127.0.0.1:"), "{}", s.url);
    let port = s.port();
    let trusted = reqwest::Client::builder()
        .add_root_certificate(
            reqwest::Certificate::from_pem(cert.cert.pem().as_bytes()).expect("pem"),
        )
        .build()
        .expect("client");
    let c = Client {
        http: trusted,
        url: format!("https://localhost:{port}/mcp"),
    };
    // A client that connects and never speaks TLS holds up nobody.
    let silent = tokio::net::TcpStream::connect(format!("127.0.0.1:{port}"))
        .await
        .expect("connect");
    let session = c.open(&ta).await;
    drop(silent);
    let inbox = c.tool(&ta, &session, 1, "inbox", json!({})).await;
    assert!(!inbox.tool().1, "{}", inbox.text);
    // Without the token, HTTPS changes nothing about the refusal.
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "remote-test", "version": "1"}}});
    assert_eq!(c.post(&[], &init).await.status, 401);
    // Plain HTTP to the TLS port is not served.
    let plain = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{port}/mcp"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(
        plain.is_err() || !plain.as_ref().is_ok_and(|r| r.status().is_success()),
        "{plain:?}"
    );
    drop(s);

    // A key that is not the certificate's, a missing file, one flag alone: usage errors.
    let other = rcgen::generate_simple_self_signed(vec!["other".to_owned()]).expect("cert");
    let other_key = dir.join("other.pem");
    std::fs::write(&other_key, other.signing_key.serialize_pem()).expect("write key");
    let cert_arg = cert_file.to_str().expect("utf-8");
    for (args, says) in [
        (
            vec![
                "--tls-cert",
                cert_arg,
                "--tls-key",
                other_key.to_str().expect("utf-8"),
            ],
            "do not make a usable pair",
        ),
        (
            vec!["--tls-cert", "/nonexistent/cert.pem", "--tls-key", cert_arg],
            "--tls-cert /nonexistent/cert.pem",
        ),
        (
            vec!["--tls-cert", cert_arg, "--tls-key", cert_arg],
            "--tls-key",
        ),
        (vec!["--tls-cert", cert_arg], "--tls-key"),
    ] {
        let mut all = vec!["serve", "--port", "0"];
        all.extend(args);
        let out = w.run(&all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{all:?}: {err}");
        assert!(err.contains(says), "{says:?} not in {err}");
    }
}

/// Open sessions per agent are bounded (a client that never closes cannot use up the server's
/// files), closing one makes room, and rmcp's plain-text refusals come back as JSON-RPC errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_bounded_per_agent_and_refusals_are_json() {
    let w = world();
    let (ta, tb) = (token(&w, &["alice"]), token(&w, &["bob"]));
    let s = serve(&w, &[]);
    let c = Client {
        http: reqwest::Client::new(),
        url: s.url.clone(),
    };
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "remote-test", "version": "1"}}});
    let auth = format!("Bearer {ta}");
    // 32 initializes at once, each holding back its body's last byte until all 32 are in:
    // no more than 16 become sessions, the rest are refused 429.
    let addr = c
        .url
        .trim_start_matches("http://")
        .trim_end_matches("/mcp")
        .to_owned();
    let body = init.to_string();
    let mut held = Vec::new();
    for _ in 0..32 {
        let mut conn = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        let head = format!(
            "POST /mcp HTTP/1.1\r\nhost: {addr}\r\nauthorization: {auth}\r\ncontent-type: application/json\r\naccept: application/json, text/event-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{}",
            body.len(),
            &body[..body.len() - 1]
        );
        conn.write_all(head.as_bytes()).await.expect("write");
        held.push(conn);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut racing = tokio::task::JoinSet::new();
    for mut conn in held {
        racing.spawn(async move {
            conn.write_all(b"}").await.expect("write");
            let mut head = vec![0_u8; 4096];
            let mut got = 0;
            // The status line and headers; an event stream may stay open after them.
            while !head[..got].windows(4).any(|w| w == b"\r\n\r\n") {
                let n = tokio::time::timeout(Duration::from_secs(20), conn.read(&mut head[got..]))
                    .await
                    .expect("an answer in time")
                    .expect("read");
                assert!(n > 0, "closed before the headers");
                got += n;
            }
            let text = String::from_utf8_lossy(&head[..got]).into_owned();
            let session = text.lines().find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("mcp-session-id:")
                    .map(|v| v.trim().to_owned())
            });
            (text[9..12].parse::<u16>().expect("status"), session, text)
        });
    }
    let mut open = Vec::new();
    while let Some(done) = racing.join_next().await {
        let (status, session, text) = done.expect("task");
        match status {
            200 => open.push(session.expect("a session id")),
            429 => {}
            other => panic!("{other}: {text}"),
        }
    }
    assert!(
        open.len() <= 16,
        "remote MCP: {} sessions opened at once past the cap of 16",
        open.len()
    );
    // Openings counted in flight may have refused a few more than needed: fill up to 16.
    while open.len() < 16 {
        open.push(c.open(&ta).await);
    }
    let full = c.post(&[("authorization", &auth)], &init).await;
    assert_eq!(full.status, 429, "{}", full.text);
    assert!(full.text.contains("16 open sessions"), "{}", full.text);
    // Another agent is not held up by alice's sessions.
    c.open(&tb).await;
    // Closing one makes room; closing it again finds no session.
    let close = |session: String| {
        let http = c.http.clone();
        let (url, auth) = (c.url.clone(), auth.clone());
        async move {
            http.delete(url)
                .header("authorization", auth)
                .header("mcp-session-id", session)
                .header("mcp-protocol-version", "2025-06-18")
                .send()
                .await
                .expect("delete")
                .status()
                .as_u16()
        }
    };
    assert_eq!(close(open[0].clone()).await, 204);
    assert_eq!(close(open[0].clone()).await, 404);
    c.open(&ta).await;

    // A body that is not JSON: refused with a JSON-RPC error body, not plain text.
    let bad = c
        .http
        .post(&c.url)
        .header("authorization", &auth)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body("{not json")
        .send()
        .await
        .expect("request");
    let status = bad.status().as_u16();
    let body: Value = bad.json().await.expect("a JSON body");
    assert!((400..500).contains(&status), "{status} {body}");
    assert!(body["error"]["message"].is_string(), "{body}");
}

/// A revoked token's open event stream ends within the sweep (5 s), while another agent's
/// stays open: a token that no longer holds leaves nothing listening.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_tokens_open_stream_ends_and_others_stay() {
    let w = world();
    let (ta, tb) = (token(&w, &["alice"]), token(&w, &["bob"]));
    let s = serve(&w, &[]);
    let c = Client {
        http: reqwest::Client::new(),
        url: s.url.clone(),
    };
    let alice = listen(&c, &ta, c.open(&ta).await).await;
    let bob = listen(&c, &tb, c.open(&tb).await).await;
    w.ok(&["agent", "token", "alice", "--revoke"]);
    // Alice's stream ends (end of body or a closed connection) well within 15 s; Bob's,
    // whose token holds, does not end in the next 2 s.
    assert!(
        ends_within(alice, 15).await,
        "the revoked token's stream was still open after 15 s"
    );
    assert!(
        !ends_within(bob, 2).await,
        "bob's stream ended although his token holds"
    );
}
