//! The global trace (SPEC §8.2) as real processes: one order over every process's events,
//! a chain's own events only with `--chain`, `--since`, JSON lines that parse, and the Mermaid
//! diagram of a three-agent chain against a snapshot.

mod common;

use common::World;
use serde_json::Value;

/// `text` with every id (runs of 8 or more hex digits) replaced by `<idN>`, numbered by first
/// appearance, so a snapshot holds across runs.
fn normalized(text: &str) -> String {
    let mut seen: Vec<String> = Vec::new();
    let mut out = String::new();
    let mut run = String::new();
    let flush = |run: &mut String, out: &mut String, seen: &mut Vec<String>| {
        if run.len() >= 8 {
            let key = run[..8].to_owned();
            let n = seen.iter().position(|s| *s == key).unwrap_or_else(|| {
                seen.push(key);
                seen.len() - 1
            });
            out.push_str(&format!("<id{n}>"));
        } else {
            out.push_str(run);
        }
        run.clear();
    };
    for c in text.chars() {
        if c.is_ascii_hexdigit() && (c.is_ascii_digit() || c.is_ascii_lowercase()) {
            run.push(c);
        } else {
            flush(&mut run, &mut out, &mut seen);
            out.push(c);
        }
    }
    flush(&mut run, &mut out, &mut seen);
    out
}

fn id_of(v: &Value) -> String {
    v["message"]["id"].as_str().unwrap().to_owned()
}

/// lead gives dev work; dev, working on it, gives qa work in the same chain; qa returns it,
/// then dev returns lead's. An unrelated send between other agents is in no chain of theirs.
fn three_agent_chain(w: &World) -> String {
    for a in ["lead", "dev", "qa", "other"] {
        w.ok(&["agent", "add", a, "--provider", "demo"]);
    }
    let root = id_of(&w.json(&[
        "send",
        "lead",
        "dev",
        "build the parser",
        "--title",
        "parser",
    ]));
    let child = id_of(&w.json(&[
        "send",
        "dev",
        "qa",
        "test the parser",
        "--title",
        "tests",
        "--parent",
        &root,
    ]));
    w.ok(&["send", "other", "lead", "unrelated"]);
    w.ok(&["return", &child, "--as", "qa", "--summary", "12 tests pass"]);
    w.ok(&["return", &root, "--as", "dev", "--summary", "parser done"]);
    root
}

#[test]
fn a_three_agent_chain_as_a_mermaid_diagram() {
    let w = World::new();
    let root = three_agent_chain(&w);
    let diagram = w.ok(&["trace", "--chain", &root[..8], "--format", "mermaid"]);
    assert!(
        !diagram.contains("other"),
        "another chain leaked in:\n{diagram}"
    );
    insta::assert_snapshot!(normalized(&diagram));
}

#[test]
fn json_lines_in_one_order_filtered_by_chain_and_time() {
    let w = World::new();
    let root = three_agent_chain(&w);
    let all: Vec<Value> = w
        .ok(&["trace"])
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let seqs: Vec<i64> = all.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert!(
        seqs.windows(2).all(|p| p[0] < p[1]),
        "one rising order: {seqs:?}"
    );
    let kinds: Vec<&str> = all.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    for k in ["agent", "sent", "delivery", "work"] {
        assert!(kinds.contains(&k), "no {k} event in {kinds:?}");
    }
    let chain: Vec<Value> = w
        .ok(&["trace", "--chain", &root])
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(!chain.is_empty());
    assert!(
        chain.iter().all(|e| e["chain_id"] == root.as_str()),
        "only the chain's events"
    );
    // Three sends in the chain: the work, the child work and the two returns.
    let sent = chain.iter().filter(|e| e["kind"] == "sent").count();
    assert_eq!(sent, 4, "{chain:#?}");
    // --since after everything: nothing; --since 0: everything.
    assert_eq!(w.ok(&["trace", "--since", "2999-01-01T00:00:00Z"]), "");
    assert_eq!(w.ok(&["trace", "--since", "0"]).lines().count(), all.len());
    for (args, code) in [
        (vec!["trace", "--since", "yesterday"], 2),
        (vec!["trace", "--format", "xml"], 2),
        (vec!["trace", "--limit", "0"], 2),
        (vec!["trace", "--chain", "ffffffffffff"], 1),
    ] {
        let out = w.run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// OTLP/JSON: it parses back into the official types; one trace (the chain's id) holds one
/// span per message, each child's parent span the span of the message it continues.
#[test]
fn otel_json_parses_with_its_parent_links_intact() {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    let w = World::new();
    let root = three_agent_chain(&w);
    let text = w.ok(&["trace", "--chain", &root, "--format", "otel"]);
    let raw: Value = serde_json::from_str(&text).expect("JSON");
    let span0 = &raw["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
    assert_eq!(span0["traceId"], root.as_str(), "{span0:#}");
    assert!(
        span0["startTimeUnixNano"].is_string(),
        "OTLP/JSON writes 64-bit integers as strings"
    );
    let req: ExportTraceServiceRequest = serde_json::from_str(&text).expect("OTLP/JSON");
    let spans = &req.resource_spans[0].scope_spans[0].spans;
    assert_eq!(
        spans.len(),
        4,
        "four messages: the work, the child work and two returns"
    );
    let by_message: std::collections::HashMap<
        String,
        &opentelemetry_proto::tonic::trace::v1::Span,
    > = spans.iter().map(|s| (hex::encode(&s.span_id), s)).collect();
    assert!(
        spans.iter().all(|s| hex::encode(&s.trace_id) == root),
        "one trace: the chain"
    );
    // Each message's parent, from the JSON lines, is its span's parent.
    let mut linked = 0;
    for line in w.ok(&["trace", "--chain", &root]).lines() {
        let e: Value = serde_json::from_str(line).unwrap();
        let (Some(m), Some(p)) = (e["message_id"].as_str(), e["parent_id"].as_str()) else {
            continue;
        };
        let span = by_message[&m[..16]];
        assert_eq!(hex::encode(&span.parent_span_id), p[..16], "{m}'s parent");
        assert!(
            by_message.contains_key(&p[..16]),
            "its parent is a span of the trace"
        );
        linked += 1;
    }
    assert!(linked >= 3, "{linked} events carried a parent");
    let root_span = by_message[&root[..16]];
    assert!(root_span.parent_span_id.is_empty());
    assert!(root_span.end_time_unix_nano >= root_span.start_time_unix_nano);
    assert!(!root_span.events.is_empty());
}
