//! Bounded summaries (SPEC §8.2) as real processes: a return's card carries at most the cap of
//! its summary (2 KiB by default, `config summaryCap`), cut on a character boundary with a
//! marker naming an artifact; `handoffs artifact get` prints the whole text; bad ids fail
//! with one line and the right exit code.

mod common;

use common::World;

/// The card's text after its head, and the artifact its marker names (if cut).
fn card_of(w: &World, return_id: &str) -> (String, Option<String>) {
    let m = w.json(&["read", return_id, "--as", "lead"]);
    let body = m["message"]["body"]
        .as_str()
        .or_else(|| m["body"].as_str())
        .unwrap_or_else(|| panic!("no body in {m}"))
        .to_owned();
    let artifact = body
        .split("handoffs artifact get ")
        .nth(1)
        .and_then(|r| r.split('`').next())
        .map(str::to_owned);
    (body, artifact)
}

fn returned(w: &World, title: &str, summary: &str) -> String {
    let sent = w.json(&["send", "lead", "dev", "do it", "--title", title]);
    let id = sent["message"]["id"].as_str().unwrap().to_owned();
    let r = w.json(&["return", &id, "--as", "dev", "--summary", summary]);
    r["return_message"]["id"].as_str().unwrap().to_owned()
}

#[test]
fn a_long_summary_reaches_its_card_capped_and_whole_as_an_artifact() {
    let w = World::new();
    for a in ["lead", "dev"] {
        w.ok(&["agent", "add", a, "--provider", "demo"]);
    }
    // 2,047 ASCII bytes, then three-byte characters: the cap (2,048) falls inside one.
    let summary = format!("{}{}", "s".repeat(2_047), "€".repeat(1_000));
    let ret = returned(&w, "long", &summary);
    let (body, artifact) = card_of(&w, &ret);
    let head = "Work returned: long\n\n";
    let kept = body
        .strip_prefix(head)
        .and_then(|b| b.split("\n[… cut: ").next())
        .unwrap_or_else(|| panic!("no marker in {body}"));
    assert_eq!(
        kept,
        "s".repeat(2_047),
        "cut before the character that crosses 2 KiB"
    );
    assert!(
        body.contains("[… cut: 1000 more characters."),
        "the marker says how much was cut: {body}"
    );
    let artifact = artifact.expect("the marker names an artifact");
    assert_eq!(
        w.ok(&["artifact", "get", &artifact]),
        format!("{summary}\n")
    );
    // A configured cap; a summary within it is carried whole, with no marker.
    w.ok(&["config", "summaryCap", "300"]);
    let ret = returned(&w, "short", &"x".repeat(300));
    let (body, artifact) = card_of(&w, &ret);
    assert_eq!(body, format!("Work returned: short\n\n{}", "x".repeat(300)));
    assert_eq!(artifact, None);
    let ret = returned(&w, "over", &"y".repeat(301));
    let (body, artifact) = card_of(&w, &ret);
    assert!(
        body.starts_with(&format!(
            "Work returned: over\n\n{}\n[… cut: 1 more characters.",
            "y".repeat(300)
        )),
        "{body}"
    );
    assert!(artifact.is_some());
}

#[test]
fn bad_artifact_ids_and_caps_fail_with_one_line() {
    let w = World::new();
    for (args, code) in [
        (vec!["artifact", "get", "not-hex!"], 2),
        (
            vec!["artifact", "get", "0123456789abcdef0123456789abcdef"],
            1,
        ),
        (vec!["config", "summaryCap", "10"], 2),
        (vec!["config", "summaryCap", "65537"], 2),
        (vec!["config", "summaryCap", "lots"], 2),
    ] {
        let out = w.run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// A task pass tells the next agent with a card that carries the pass summary within the
/// cap; the whole summary is an artifact (and stays in the ledger's brief).
#[test]
fn a_pass_summary_reaches_its_card_capped_and_whole_as_an_artifact() {
    let w = World::new();
    for a in ["alice", "bob"] {
        w.ok(&["agent", "add", a, "--provider", "demo"]);
    }
    let root = w.dir.path().join("project");
    std::fs::create_dir_all(root.join(".git")).unwrap();
    let run = |args: &[&str]| -> serde_json::Value {
        let out = w
            .cmd()
            .current_dir(&root)
            .arg("--json")
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let t = run(&[
        "task", "create", "--as", "alice", "--title", "Port", "--goal", "g",
    ]);
    let task = t["id"]
        .as_str()
        .or(t["task"]["id"].as_str())
        .unwrap()
        .to_owned();
    let claimed = run(&["task", "claim", &task, "--as", "alice"]);
    let token = claimed["lease"]["token"].as_str().unwrap().to_owned();
    let summary = format!("{}{}", "p".repeat(2_000), "ü".repeat(1_500));
    let passed = run(&[
        "task",
        "pass",
        &task,
        "--as",
        "alice",
        "--token",
        &token,
        "--summary",
        &summary,
        "--next",
        "review it",
        "--to",
        "bob",
    ]);
    let id = passed["notice"]["message_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no message: {passed}"))
        .to_owned();
    let m = w.json(&["read", &id, "--as", "bob"]);
    let body = m["body"]
        .as_str()
        .or(m["message"]["body"].as_str())
        .unwrap();
    let (shown, marker) = body
        .split_once("\n[… cut: ")
        .unwrap_or_else(|| panic!("no marker in the pass card: {body}"));
    let shown = shown
        .split("Summary of the pass:\n")
        .nth(1)
        .expect("the card shows the summary");
    assert!(shown.len() <= 2_048, "{} bytes shown", shown.len());
    assert!(summary.starts_with(shown));
    let artifact = marker
        .split("handoffs artifact get ")
        .nth(1)
        .and_then(|r| r.split('`').next())
        .expect("the artifact's id");
    assert_eq!(w.ok(&["artifact", "get", artifact]).trim_end(), summary);
}

/// A fan-out's combined return is capped too: its answers together past the cap are cut,
/// and the whole combination is an artifact.
#[test]
fn a_fan_out_combination_is_capped_and_whole_as_an_artifact() {
    let w = World::new();
    for a in ["lead", "a", "b"] {
        w.ok(&["agent", "add", a, "--provider", "demo"]);
    }
    w.ok(&["config", "summaryCap", "256"]);
    let f = w.json(&["send", "lead", "--to", "a,b", "look", "--title", "look"]);
    let mut last = serde_json::Value::Null;
    for (i, who) in ["a", "b"].iter().enumerate() {
        let child = f["children"][i]["message"]["id"].as_str().unwrap();
        last = w.json(&[
            "return",
            child,
            "--as",
            who,
            "--summary",
            &"x".repeat(1_000),
        ]);
    }
    let body = last["return_message"]["body"].as_str().unwrap();
    let (shown, marker) = body.split_once("\n[… cut: ").expect("cut");
    assert!(shown.len() <= 256, "{} bytes shown", shown.len());
    let artifact = marker
        .split("handoffs artifact get ")
        .nth(1)
        .and_then(|r| r.split('`').next())
        .expect("the artifact's id");
    let whole = w.ok(&["artifact", "get", artifact]);
    assert_eq!(whole.matches(&"x".repeat(1_000)).count(), 2, "{whole}");
}
