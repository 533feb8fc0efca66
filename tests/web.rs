//! The page and the HTTP API in process: status codes, the Host check, the token, body
//! limits, JSON errors, the public demo, and the page's text-only path from JSON to the DOM.

mod common;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use handoffs::front::web::{self, PAGE, WebOptions, loopback_host};
use http_body_util::BodyExt as _;
use serde_json::{Value, json};
use tower::ServiceExt as _;

struct App {
    world: common::World,
    router: Router,
    token: String,
    _snaps: web::Snapshots,
}

fn app(public_demo: bool) -> App {
    app_with(WebOptions {
        public_demo,
        remote_mcp: true,
        ..WebOptions::default()
    })
}

fn app_with(options: WebOptions) -> App {
    let world = common::World::new();
    for a in ["planner", "writer"] {
        world.ok(&["agent", "add", a, "--provider", "demo"]);
    }
    let snaps = web::snapshots(&world.db, &options).expect("snapshots");
    let router = web::router(
        &world.db,
        &snaps,
        options,
        tokio_util::sync::CancellationToken::new(),
    )
    .expect("router");
    let token = std::fs::read_to_string(handoffs::store::token_path(&world.db))
        .expect("token")
        .trim()
        .to_owned();
    App {
        world,
        router,
        token,
        _snaps: snaps,
    }
}

async fn request(
    app: &App,
    method: &str,
    uri: &str,
    host: Option<&str>,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> (StatusCode, Vec<u8>, axum::http::HeaderMap) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(h) = host {
        req = req.header("host", h);
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let res = app
        .router
        .clone()
        .oneshot(req.body(Body::from(body)).expect("request"))
        .await
        .expect("response");
    let status = res.status();
    let headers = res.headers().clone();
    let bytes = res.into_body().collect().await.expect("body").to_bytes();
    (status, bytes.to_vec(), headers)
}

async fn get(app: &App, uri: &str) -> (StatusCode, Value) {
    let (s, b, _) = request(app, "GET", uri, Some("127.0.0.1:8765"), &[], vec![]).await;
    (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

async fn send(app: &App, token: Option<&str>, body: &Value) -> (StatusCode, Value) {
    let mut headers = vec![("content-type", "application/json")];
    if let Some(t) = token {
        headers.push(("x-handoffs-token", t));
    }
    let (s, b, _) = request(
        app,
        "POST",
        "/api/send",
        Some("localhost:8765"),
        &headers,
        serde_json::to_vec(body).expect("json"),
    )
    .await;
    (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

fn is_error(v: &Value) -> bool {
    v["error"].as_str().is_some_and(|e| !e.is_empty())
}

#[test]
fn only_loopback_hosts_pass() {
    for ok in [
        "localhost",
        "localhost:8765",
        "127.0.0.1",
        "127.0.0.1:80",
        "127.1.2.3:9",
        "[::1]:8765",
        "[::1]",
        "LOCALHOST.",
        "app.localhost:3000",
    ] {
        assert!(loopback_host(ok), "{ok}");
    }
    for bad in [
        "evil.com",
        "localhost.evil.com",
        "127.0.0.1.nip.io",
        "10.0.0.1:8765",
        "[::2]:80",
        "",
        "0.0.0.0:8765",
        "localhost:80@evil.com",
    ] {
        assert!(!loopback_host(bad), "{bad}");
    }
}

#[test]
fn the_page_puts_text_into_the_dom_only_as_text() {
    for sink in [
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
        "new Function",
    ] {
        assert!(!PAGE.contains(sink), "the page uses {sink}");
    }
    // The one place text enters the DOM (the planted XSS bug replaces exactly this).
    assert_eq!(
        PAGE.matches("document.createTextNode(String(k))").count(),
        1
    );
    for external in [
        "src=\"http",
        "href=\"http",
        "url(http",
        "@import",
        "fetch('http",
        "fetch(\"http",
    ] {
        assert!(
            !PAGE.contains(external),
            "the page loads something from elsewhere: {external}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_status_codes_and_json_errors() {
    let app = app(false);
    let (s, body, headers) = request(&app, "GET", "/", Some("localhost:8765"), &[], vec![]).await;
    assert_eq!(s, StatusCode::OK);
    assert!(String::from_utf8_lossy(&body).contains("<title>handoffs</title>"));
    let csp = headers["content-security-policy"].to_str().expect("csp");
    assert!(csp.contains("default-src 'none'") && csp.contains("connect-src 'self'"));
    assert!(
        csp.contains("script-src 'sha256-") && !csp.contains("script-src 'unsafe-inline'"),
        "{csp}"
    );
    assert_eq!(headers["x-content-type-options"], "nosniff");

    // DNS rebinding: any Host that is not loopback is refused, on every route.
    for uri in ["/", "/api/status", "/api/send", "/metrics", "/nope"] {
        let (s, b, _) = request(&app, "GET", uri, Some("evil.example:8765"), &[], vec![]).await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{uri}");
        assert!(is_error(&serde_json::from_slice(&b).expect("json")));
    }
    let (s, _, _) = request(&app, "GET", "/", None, &[], vec![]).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "no Host at all");
    // An absolute request target names the host, and wins over the header.
    let (s, _, _) = request(
        &app,
        "GET",
        "http://evil.example/api/status",
        Some("localhost"),
        &[],
        vec![],
    )
    .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "absolute-form target");
    let (s, _, _) = request(
        &app,
        "GET",
        "http://localhost:8765/api/status",
        Some("localhost:8765"),
        &[],
        vec![],
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (s, _, _) = request(
        &app,
        "GET",
        "/",
        Some("localhost"),
        &[("host", "evil.example")],
        vec![],
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "two Host headers");

    let (s, v) = get(&app, "/api/status").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["agents"].as_array().map(Vec::len), Some(2));
    for total in ["in_flight", "needs_attention", "open_work", "overdue"] {
        assert!(v["totals"][total].is_i64(), "totals.{total}: {v}");
    }
    assert_eq!(v["can_send"], json!(true));
    let (s, v) = get(&app, "/healthz").await;
    assert_eq!((s, v["ok"].clone()), (StatusCode::OK, json!(true)));
    let (s, b, h) = request(&app, "GET", "/metrics", Some("localhost"), &[], vec![]).await;
    assert_eq!(s, StatusCode::OK);
    assert!(
        h["content-type"]
            .to_str()
            .expect("type")
            .starts_with("text/plain")
    );
    let text = String::from_utf8_lossy(&b);
    for name in [
        "handoffs_deliveries",
        "handoffs_delivery_attempts_total",
        "handoffs_send_to_accept_seconds_bucket",
        "handoffs_engine_pass_duration_seconds",
    ] {
        assert!(text.contains(name), "{name} missing:\n{text}");
    }
    assert!(!text.contains(" -0\n"), "a negative zero:\n{text}");
    let (s, v) = get(&app, "/nope").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(is_error(&v));
    let (s, v) = get(&app, "/api/send").await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
    assert!(is_error(&v));
    for bad in [
        "after=-1",
        "after=abc",
        "limit=999999",
        "after=1e3",
        "limit=0",
    ] {
        let (s, v) = get(&app, &format!("/api/events?{bad}")).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}");
        assert!(is_error(&v));
    }
    let (s, v) = get(&app, "/api/events?after=0&limit=2").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["events"].as_array().map(Vec::len), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sending_needs_the_token_and_a_good_body() {
    let app = app(false);
    let good = json!({"from": "planner", "to": "writer", "message": "<script>alert(1)</script>",
        "title": "<img src=x onerror=alert(1)>"});
    let (s, v) = send(&app, None, &good).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert!(is_error(&v));
    let wrong = format!("{}x", &app.token[..app.token.len() - 1]);
    assert_eq!(
        send(&app, Some(&wrong), &good).await.0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        send(&app, Some(""), &good).await.0,
        StatusCode::UNAUTHORIZED
    );
    let long = format!("{}0", app.token);
    assert_eq!(
        send(&app, Some(&long), &good).await.0,
        StatusCode::UNAUTHORIZED
    );

    let token = app.token.clone();
    let (s, v) = send(&app, Some(&token), &good).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["id"].as_str().expect("id").to_owned();

    // Wrong content type, malformed JSON, unknown fields, wrong types, bounds, unknown agent.
    let (s, b, _) = request(
        &app,
        "POST",
        "/api/send",
        Some("localhost"),
        &[("x-handoffs-token", &token), ("content-type", "text/plain")],
        b"{}".to_vec(),
    )
    .await;
    assert_eq!(s, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert!(is_error(&serde_json::from_slice(&b).expect("json")));
    let (s, _, _) = request(
        &app,
        "POST",
        "/api/send",
        Some("localhost"),
        &[
            ("x-handoffs-token", &token),
            ("content-type", "application/jsonfoo"),
        ],
        serde_json::to_vec(&good).expect("json"),
    )
    .await;
    assert_eq!(s, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    // The longest message the spec allows fits however JSON escapes it.
    let widest = json!({"from": "planner", "to": "writer", "message": "\u{1F600}".repeat(200_000)});
    let escaped = serde_json::to_string(&widest)
        .expect("json")
        .replace('\u{1F600}', "\\ud83d\\ude00");
    let (s, b, _) = request(
        &app,
        "POST",
        "/api/send",
        Some("localhost"),
        &[
            ("x-handoffs-token", &token),
            ("content-type", "application/json; charset=utf-8"),
        ],
        escaped.into_bytes(),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{}", String::from_utf8_lossy(&b));
    let (s, b, _) = request(
        &app,
        "POST",
        "/api/send",
        Some("localhost"),
        &[
            ("x-handoffs-token", &token),
            ("content-type", "application/json"),
        ],
        b"{\"from\": ".to_vec(),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(is_error(&serde_json::from_slice(&b).expect("json")));
    for (body, want) in [
        (
            json!({"from": "planner", "to": "writer"}),
            StatusCode::BAD_REQUEST,
        ),
        (
            json!({"from": "planner", "to": "writer", "message": 5}),
            StatusCode::BAD_REQUEST,
        ),
        (
            json!({"from": "planner", "to": "writer", "message": "x", "as": "writer"}),
            StatusCode::BAD_REQUEST,
        ),
        (
            json!({"from": "planner", "to": "writer", "message": "x".repeat(200_001)}),
            StatusCode::BAD_REQUEST,
        ),
        (
            json!({"from": "planner", "to": "writer", "message": "x", "title": "t", "due_minutes": 0}),
            StatusCode::BAD_REQUEST,
        ),
        (
            json!({"from": "planner", "to": "nobody", "message": "x"}),
            StatusCode::NOT_FOUND,
        ),
        (
            json!({"from": "planner", "to": "planner", "message": "x"}),
            StatusCode::CONFLICT,
        ),
    ] {
        let (s, v) = send(&app, Some(&token), &body).await;
        assert_eq!(s, want, "{body:.120}: {v}");
        assert!(is_error(&v), "{v}");
    }
    // Over the body limit: 413 with a JSON error, nothing stored.
    let big = json!({"from": "planner", "to": "writer", "message": "y".repeat(web::BODY_LIMIT)});
    let (s, v) = send(&app, Some(&token), &big).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(is_error(&v));
    // A repeated key returns the first message.
    let keyed = json!({"from": "planner", "to": "writer", "message": "m", "key": "k1"});
    assert_eq!(
        send(&app, Some(&token), &keyed).await.0,
        StatusCode::CREATED
    );
    let (s, v) = send(&app, Some(&token), &keyed).await;
    assert_eq!((s, v["created"].clone()), (StatusCode::OK, json!(false)));

    // The payload reaches the status JSON verbatim, as data (the page renders it as text).
    let mut seen = false;
    for _ in 0..50 {
        let (_, v) = get(&app, "/api/status").await;
        let text = v.to_string();
        if text.contains(&id) {
            assert!(text.contains("<img src=x onerror=alert(1)>"), "{text:.400}");
            seen = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(seen, "the snapshot never showed the new delivery");
    let inbox = app.world.json(&["inbox", "writer", "--all"]);
    assert_eq!(inbox.as_array().map(Vec::len), Some(3), "{inbox}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_public_demo_serves_any_host_and_never_sends() {
    let app = app(true);
    let (s, _, _) = request(
        &app,
        "GET",
        "/api/status",
        Some("demo.example.com"),
        &[],
        vec![],
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let token = app.token.clone();
    let (s, v) = send(
        &app,
        Some(&token),
        &json!({"from": "planner", "to": "writer", "message": "x"}),
    )
    .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    assert!(is_error(&v));
    let (_, v) = get(&app, "/api/status").await;
    assert_eq!(v["can_send"], json!(false));
    assert_eq!(v["engine"]["report"], Value::Null);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_token_file_is_refused_and_init_replaces_it() {
    let w = common::World::new();
    let token = handoffs::store::token_path(&w.db);
    std::fs::write(&token, "").expect("empty token");
    let snaps = web::snapshots(&w.db, &WebOptions::default()).expect("snapshots");
    let err = web::router(
        &w.db,
        &snaps,
        WebOptions::default(),
        tokio_util::sync::CancellationToken::new(),
    )
    .expect_err("an empty token is refused")
    .to_string();
    assert!(err.contains("empty or too short"), "{err}");
    w.ok(&["init"]);
    assert!(std::fs::read_to_string(&token).expect("token").trim().len() >= 32);
}

/// A chain stopped by its hop budget needs a person: the page lists it under "needs
/// attention" with the reason and the command that lifts it, and counts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_chain_shows_under_needs_attention() {
    let app = app(false);
    let w = &app.world;
    w.ok(&["config", "chainHopBudget", "0"]);
    let root = w.json(&["send", "planner", "writer", "draft it"])["message"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let out = w.run(&["send", "writer", "planner", "and back", "--parent", &root]);
    assert_eq!(out.status.code(), Some(1));
    let mut found = Value::Null;
    for _ in 0..50 {
        let (_, v) = get(&app, "/api/status").await;
        if let Some(c) = v["needs_attention"]
            .as_array()
            .and_then(|a| a.iter().find(|d| d["state"] == "CHAIN_STOPPED"))
        {
            found = c.clone();
            assert!(v["totals"]["needs_attention"].as_i64() >= Some(1), "{v}");
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(found["id"], json!(root), "{found}");
    let reason = found["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("hop budget 0 spent") && reason.contains("chain resume"),
        "{reason}"
    );
    // The refused send is a dead letter: counted by reason on the page and in /metrics.
    let (_, v) = get(&app, "/api/status").await;
    assert_eq!(v["dead_letters"]["counts"]["chain_stopped"], 1, "{v}");
    assert_eq!(v["dead_letters"]["newest"][0]["from"], "writer");
    let (s, body, _) = request(&app, "GET", "/metrics", Some("127.0.0.1:8765"), &[], vec![]).await;
    assert_eq!(s, StatusCode::OK);
    let text = String::from_utf8_lossy(&body);
    assert!(
        text.contains("handoffs_dead_letters{reason=\"chain_stopped\"} 1")
            && text.contains("handoffs_dead_letters{reason=\"topology\"} 0"),
        "{text}"
    );
}

/// The chains in flight show in `/api/status` (and so on the page): a chain with a delivery
/// on its way, with its hops, depth limit and what each unit spent of its limit; a chain
/// stopped for a person with its state. A chain with nothing on its way is not listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chains_in_flight_show_with_their_budgets() {
    let app = app(false);
    let w = &app.world;
    let id = |v: Value| v["message"]["id"].as_str().unwrap().to_owned();
    let root = id(w.json(&[
        "send",
        "planner",
        "writer",
        "draft it",
        "--budget",
        "hops=3,tokens=1000",
    ]));
    w.ok(&[
        "chain",
        "spend",
        "tokens=250",
        "--as",
        "writer",
        "--parent",
        &root,
    ]);
    // An answer over HTTP names its parent and continues the chain: one hop of its budget.
    let token = app.token.clone();
    let (st, v) = send(
        &app,
        Some(&token),
        &json!({"from": "writer", "to": "planner", "message": "a question", "parent": root}),
    )
    .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    assert_eq!(
        (
            v["chain_id"].as_str(),
            v["parent_id"].as_str(),
            v["hop"].as_i64()
        ),
        (Some(root.as_str()), Some(root.as_str()), Some(1)),
        "{v}"
    );
    // A request id that names no turn of the sender's starts nothing but a chain of its own.
    let (st, v) = send(
        &app,
        Some(&token),
        &json!({"from": "writer", "to": "planner", "message": "unrelated", "request_id": "nope"}),
    )
    .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    assert_eq!(v["hop"], 0, "{v}");
    assert_eq!(v["chain_id"], v["id"], "{v}");
    w.ok(&["chain", "cancel", v["id"].as_str().unwrap()]);
    // Cancelled before anything was written: nothing of it is on its way any more.
    let gone = id(w.json(&["send", "planner", "writer", "never mind"]));
    w.ok(&["chain", "cancel", &gone]);
    // Stopped last: a snapshot that shows it stopped has seen everything before.
    let stopped = id(w.json(&["send", "planner", "writer", "other", "--budget", "tokens=1"]));
    let out = w.run(&[
        "chain", "spend", "tokens=2", "--as", "writer", "--parent", &stopped,
    ]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let mut chains = Vec::new();
    for _ in 0..50 {
        let (_, v) = get(&app, "/api/status").await;
        chains = v["chains"].as_array().cloned().unwrap_or_default();
        // The snapshot is rebuilt after the commands: wait for one that has seen them all.
        if chains.len() == 2 && chains[0]["state"] == "needs_human" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(chains.len(), 2, "{chains:?}");
    assert!(chains.iter().all(|c| c["id"] != json!(gone)), "{chains:?}");
    // The stopped chain first, then the chain with deliveries on their way.
    assert_eq!(chains[0]["id"], json!(stopped), "{chains:?}");
    assert_eq!(chains[0]["state"], "needs_human");
    assert!(
        chains[0]["stopped_reason"]
            .as_str()
            .is_some_and(|r| r.contains("tokens")),
        "{chains:?}"
    );
    let c = &chains[1];
    assert_eq!(c["id"], json!(root), "{c}");
    assert_eq!(c["state"], "open");
    assert_eq!(
        (c["hops"].as_i64(), c["hop_budget"].as_i64()),
        (Some(1), Some(3)),
        "{c}"
    );
    assert_eq!(
        c["units"]["tokens"],
        json!({"spent": 250, "limit": 1000}),
        "{c}"
    );
    assert_eq!(c["origin"], "planner");
    assert_eq!(c["first"], "draft it");

    // A send over HTTP starts its chain with a budget too (`send --budget`).
    let tok = Some(app.token.as_str());
    let body = |budget: Value| json!({"from": "planner", "to": "writer", "message": "m", "budget": budget});
    let (s, v) = send(&app, tok, &body(json!({"hops": 2, "tokens": 5}))).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let shown = w.json(&["chain", "show", v["id"].as_str().unwrap()]);
    assert_eq!(shown["chain"]["hop_budget"], 2, "{shown}");
    assert_eq!(shown["chain"]["units"]["tokens"]["limit"], 5, "{shown}");
    for bad in [
        json!({"hops": 0.5}),
        json!({}),
        json!({"tokens": -1}),
        json!("tokens=5"),
    ] {
        let (s, v) = send(&app, tok, &body(bad.clone())).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}: {v}");
        assert!(is_error(&v), "{v}");
    }
}

/// `POST /api/spend` spends from a chain's budget like `chain spend`: the token is needed,
/// a spend past the limit is 409 and stops the chain, bad bodies are 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spend_over_http_needs_the_token_and_stops_at_the_limit() {
    let app = app(false);
    let w = &app.world;
    let root =
        w.json(&["send", "planner", "writer", "draft it", "--budget", "usd=1"])["message"]["id"]
            .as_str()
            .unwrap()
            .to_owned();
    let post = |token: Option<String>, body: Value| {
        let app = &app;
        async move {
            let mut headers = vec![("content-type", "application/json")];
            let t = token.unwrap_or_default();
            if !t.is_empty() {
                headers.push(("x-handoffs-token", t.as_str()));
            }
            let (s, b, _) = request(
                app,
                "POST",
                "/api/spend",
                Some("127.0.0.1:8765"),
                &headers,
                serde_json::to_vec(&body).expect("json"),
            )
            .await;
            (
                s,
                serde_json::from_slice::<Value>(&b).unwrap_or(Value::Null),
            )
        }
    };
    let body = json!({"agent": "writer", "units": {"usd": 0.6}, "parent": root});
    let (s, v) = post(None, body.clone()).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "{v}");
    let (s, v) = post(Some(app.token.clone()), body.clone()).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["chain"]["units"]["usd"]["spent"], 0.6, "{v}");
    let (s, v) = post(Some(app.token.clone()), body.clone()).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("budget usd=1 spent: 0.6 used, 0.6 more asked")),
        "{v}"
    );
    // A request id that names no run of the agent's is refused, never charged to whatever
    // the agent happens to work on.
    let (s, v) = post(
        Some(app.token.clone()),
        json!({"agent": "writer", "units": {"usd": 0.1}, "request_id": "nope"}),
    )
    .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("working in no chain")),
        "{v}"
    );
    for bad in [
        json!({"agent": "writer", "units": {"tokens=1,usd": 2}, "parent": root}),
        json!({"agent": "writer", "units": {"usd": -1}, "parent": root}),
        json!({"agent": "writer", "units": "usd=1", "parent": root}),
        json!({"agent": "writer", "units": {"usd": 1}, "from": "x"}),
    ] {
        let (s, v) = post(Some(app.token.clone()), bad.clone()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}: {v}");
        assert!(is_error(&v), "{v}");
    }
    let c = w.json(&["chain", "show", &root]);
    assert_eq!(c["chain"]["state"], "needs_human", "{c}");
    assert_eq!(c["chain"]["units"]["usd"]["spent"], 0.6, "{c}");
}

/// Topics show in `/api/status` (and so on the page) with their posts and subscribers, and
/// `/metrics` counts every publish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_show_with_their_subscribers_and_publishes_are_counted() {
    let app = app(false);
    let w = &app.world;
    w.ok(&["topic", "create", "builds", "--keep", "2"]);
    w.ok(&["topic", "subscribe", "builds", "writer"]);
    for text in ["red", "green", "green again"] {
        w.ok(&["topic", "publish", "builds", "planner", text]);
    }
    let mut topic = Value::Null;
    for _ in 0..50 {
        let (_, v) = get(&app, "/api/status").await;
        if v["topics"][0]["last_position"] == 3 {
            topic = v["topics"][0].clone();
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(topic["name"], "builds", "{topic}");
    assert_eq!(topic["retained"], 2, "{topic}");
    assert_eq!(topic["subscribers"], json!(["writer"]), "{topic}");
    let (s, body, _) = request(&app, "GET", "/metrics", Some("127.0.0.1:8765"), &[], vec![]).await;
    assert_eq!(s, StatusCode::OK);
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("handoffs_topic_publishes_total 3"), "{text}");
}

/// A chain's trace over HTTP, what the page's chains link to: a Mermaid diagram by default,
/// JSON lines or OTLP/JSON on request; a missing or unknown chain and a bad format are JSON
/// errors; the public demo has none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chains_trace_is_served_as_a_diagram() {
    let site = app(false);
    let w = &site.world;
    let root =
        w.json(&["send", "planner", "writer", "draft it", "--title", "draft"])["message"]["id"]
            .as_str()
            .unwrap()
            .to_owned();
    let at = |q: &str| format!("/api/trace?{q}");
    let (s, body, h) = request(
        &site,
        "GET",
        &at(&format!("chain={root}")),
        Some("127.0.0.1:8765"),
        &[],
        vec![],
    )
    .await;
    let text = String::from_utf8_lossy(&body);
    assert_eq!(s, StatusCode::OK, "{text}");
    assert!(
        h[axum::http::header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    assert!(
        text.starts_with("sequenceDiagram\n") && text.contains("->>") && text.contains("draft"),
        "{text}"
    );
    let (s, v) = get(&site, &at(&format!("chain={root}&format=otel"))).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        v["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"],
        json!(root),
        "{v}"
    );
    for (q, code) in [
        ("format=mermaid", StatusCode::BAD_REQUEST),
        (
            &*format!("chain={root}&format=xml"),
            StatusCode::BAD_REQUEST,
        ),
        ("chain=ffffffffffff", StatusCode::NOT_FOUND),
    ] {
        let (s, v) = get(&site, &at(q)).await;
        assert_eq!(s, code, "{q}: {v}");
        assert!(is_error(&v), "{q}: {v}");
    }
    let public = app(true);
    let (s, _) = get(&public, &at(&format!("chain={root}"))).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

/// Fan-outs waiting for their join show in `/api/status` (and so on the page) with who they
/// wait on, and `/metrics` counts joins complete and partial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fan_outs_waiting_show_and_joins_are_counted() {
    let app = app(false);
    let w = &app.world;
    w.ok(&["agent", "add", "reviewer", "--provider", "demo"]);
    let first = w.json(&[
        "send",
        "planner",
        "--to",
        "writer,reviewer",
        "look",
        "--title",
        "look",
        "--join",
        "quorum:1",
    ]);
    // Over HTTP: `to` as a list is a fan-out (with the token, as any send).
    let (code, v) = send(
        &app,
        Some(&app.token),
        &json!({"from": "planner", "to": ["writer", "reviewer"], "message": "wait",
                "title": "wait"}),
    )
    .await;
    assert_eq!(code, StatusCode::CREATED, "{v}");
    assert_eq!(v["children"].as_array().map(Vec::len), Some(2), "{v}");
    for bad in [
        json!({"from": "planner", "to": ["writer", "reviewer"], "message": "m"}),
        json!({"from": "planner", "to": ["writer", "writer"], "message": "m", "title": "t"}),
        json!({"from": "planner", "to": ["writer"], "message": "m", "title": "t", "join": "most"}),
        json!({"from": "planner", "to": 3, "message": "m"}),
    ] {
        let (code, v) = send(&app, Some(&app.token), &bad).await;
        assert_eq!(code, StatusCode::BAD_REQUEST, "{bad}: {v}");
        assert!(is_error(&v), "{v}");
    }
    let (code, _) = send(
        &app,
        None,
        &json!({"from": "planner", "to": ["writer", "reviewer"], "message": "m", "title": "t"}),
    )
    .await;
    assert_eq!(code, StatusCode::UNAUTHORIZED);
    let done = first["children"][0]["message"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    w.ok(&["return", &done, "--as", "writer", "--summary", "ok"]);
    // The snapshot behind /api/status is rebuilt when the database changes (or every 2 s):
    // one built between the two sends shows "look" alone, so the loop waits for the state
    // after the return (at most 5 s), not for any single fan-out.
    let mut shown = Value::Null;
    for _ in 0..50 {
        let (_, v) = get(&app, "/api/status").await;
        if v["fanouts"].as_array().is_some_and(|f| f.len() == 1) {
            shown = v["fanouts"][0].clone();
            if shown["title"] == "wait" {
                break;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(shown["title"], "wait", "{shown}");
    assert_eq!(shown["answered"], 0, "{shown}");
    assert_eq!(
        shown["waiting_on"],
        json!(["writer", "reviewer"]),
        "{shown}"
    );
    let (s, body, _) = request(&app, "GET", "/metrics", Some("127.0.0.1:8765"), &[], vec![]).await;
    assert_eq!(s, StatusCode::OK);
    let text = String::from_utf8_lossy(&body);
    assert!(
        text.contains("handoffs_fanout_joins_total{result=\"complete\"} 1")
            && text.contains("handoffs_fanout_joins_total{result=\"partial\"} 0"),
        "{text}"
    );
}

/// The status of a GET of `uri` with `Host: localhost:8765` from the peer `ip`.
async fn get_from(a: &App, ip: impl Into<std::net::IpAddr>, uri: &str) -> StatusCode {
    let mut req = Request::builder()
        .method("GET")
        .uri(uri)
        .header("host", "localhost:8765")
        .body(Body::empty())
        .expect("request");
    req.extensions_mut()
        .insert(axum::extract::ConnectInfo(web::Peer(
            std::net::SocketAddr::from((ip.into(), 40000)),
        )));
    a.router
        .clone()
        .oneshot(req)
        .await
        .expect("response")
        .status()
}

/// The page and its API answer only this machine, whatever Host a client sends: a peer on
/// the network that claims `Host: localhost` is refused; /healthz and /mcp (with its own
/// token check) are the routes another machine may reach.
#[tokio::test]
async fn the_page_answers_only_peers_on_this_machine() {
    let a = app(false);
    let from = |ip: [u8; 4], uri: &'static str| get_from(&a, ip, uri);
    for uri in ["/", "/api/status", "/api/events", "/metrics"] {
        assert_eq!(
            from([192, 0, 2, 2], uri).await,
            StatusCode::FORBIDDEN,
            "the page answered a peer at 192.0.2.2 on {uri}"
        );
        assert_eq!(from([127, 0, 0, 1], uri).await, StatusCode::OK, "{uri}");
    }
    assert_eq!(from([192, 0, 2, 2], "/healthz").await, StatusCode::OK);
    // /mcp is reached, and refuses for want of a token, not for the peer.
    assert_eq!(from([192, 0, 2, 2], "/mcp").await, StatusCode::UNAUTHORIZED);
}

/// `--allow-peer IP` (a container's published port, whose connections arrive from the
/// bridge's gateway): that address reaches the page and its API, in its IPv4 form or mapped
/// into IPv6; any other peer (another container on the same network) is still refused.
#[tokio::test]
async fn an_allowed_peer_reaches_the_page_and_no_other() {
    let gateway = std::net::Ipv4Addr::new(172, 31, 87, 1);
    let a = app_with(WebOptions {
        allowed_peers: vec![gateway.into()],
        remote_mcp: true,
        ..WebOptions::default()
    });
    for uri in ["/", "/api/status", "/metrics"] {
        assert_eq!(get_from(&a, gateway, uri).await, StatusCode::OK, "{uri}");
        assert_eq!(
            get_from(&a, gateway.to_ipv6_mapped(), uri).await,
            StatusCode::OK,
            "{uri} from the gateway's IPv6-mapped form"
        );
        assert_eq!(
            get_from(&a, std::net::Ipv4Addr::new(172, 31, 87, 3), uri).await,
            StatusCode::FORBIDDEN,
            "the page answered another container on {uri}"
        );
    }
    // The Host check still applies to an allowed peer.
    let mut req = Request::builder()
        .method("GET")
        .uri("/api/status")
        .header("host", "172.31.87.2:8765")
        .body(Body::empty())
        .expect("request");
    req.extensions_mut()
        .insert(axum::extract::ConnectInfo(web::Peer(
            std::net::SocketAddr::from((gateway, 40000)),
        )));
    let status = a
        .router
        .clone()
        .oneshot(req)
        .await
        .expect("response")
        .status();
    assert_eq!(status, StatusCode::FORBIDDEN, "a Host that is not loopback");
}
