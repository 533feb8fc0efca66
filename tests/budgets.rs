//! A chain's own budget units (SPEC §8.2), as real processes: `send --budget` gives a new
//! chain its limits, a turn spends from it (`chain spend` inside its run), a spend past a
//! limit is refused and stops the chain with one notification to its origin and wakes the
//! turn's wait, eight processes spending at once never pass the limit together, a person's
//! resume lifts it, and bad input is a usage error.

mod common;

use common::World;
use serde_json::Value;
use std::time::{Duration, Instant};

fn id_of(sent: &Value) -> String {
    sent["message"]["id"].as_str().unwrap().to_owned()
}

fn notifications(c: &Value) -> Vec<Value> {
    c["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["intent"] == "notification")
        .cloned()
        .collect()
}

/// b's turn spends 60 of its chain's 100 tokens, then 50 more: the second is refused, the
/// chain stops (`needs_human`), lead is told once, and b's wait wakes saying the budget is
/// spent. The chain's tree shows what the turn spent; a person's resume adds to it.
#[test]
fn a_turn_spends_from_its_chain_until_the_budget_stops_it() {
    let w = World::new();
    w.ok(&["agent", "add", "lead", "--provider", "demo"]);
    let woke = w.dir.path().join("woke.json");
    let codes = w.dir.path().join("codes");
    let b = w.dir.path().join("b.sh");
    std::fs::write(
        &b,
        format!(
            "#!/bin/sh\n{bin} chain spend tokens=60,usd=0.37 --as b; echo \"first $?\" >> {codes}\n\
             {bin} chain spend tokens=50 --as b; echo \"second $?\" >> {codes}\n\
             {bin} --json wait --as b --timeout-seconds 20 > {woke}.tmp && mv {woke}.tmp {woke}\n",
            bin = env!("CARGO_BIN_EXE_handoffs"),
            codes = codes.display(),
            woke = woke.display(),
        ),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&b, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    w.add_command_agent("b", &b);
    let root = id_of(&w.json(&[
        "send",
        "lead",
        "b",
        "build it within budget",
        "--title",
        "Build",
        "--budget",
        "hops=3,tokens=100,usd=5",
    ]));
    let _engine = w.spawn_engine();
    let start = Instant::now();
    while !woke.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(40),
            "b's turn never finished its wait; codes: {:?}",
            std::fs::read_to_string(&codes).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        std::fs::read_to_string(&codes).unwrap(),
        "first 0\nsecond 1\n"
    );
    let waited: Value = serde_json::from_str(&std::fs::read_to_string(&woke).unwrap()).unwrap();
    assert_eq!(waited["woke"], "budget_spent", "{waited}");
    let c = w.json(&["chain", "show", &root]);
    assert_eq!(c["chain"]["state"], "needs_human", "{c}");
    assert_eq!(c["chain"]["hop_budget"], 3);
    assert_eq!(c["chain"]["units"]["tokens"]["limit"], 100);
    assert_eq!(
        c["chain"]["units"]["tokens"]["spent"], 60,
        "nothing of the refused spend"
    );
    assert_eq!(c["chain"]["units"]["usd"]["spent"], 0.37);
    assert!(
        c["chain"]["stopped_reason"]
            .as_str()
            .unwrap()
            .contains("budget tokens=100 spent: 60 used, 50 more asked"),
        "{c}"
    );
    let told = notifications(&c);
    assert_eq!(told.len(), 1, "{c:#}");
    assert_eq!(told[0]["recipient"], "lead");
    assert_eq!(c["messages"][0]["spent"]["tokens"], 60, "{c}");
    let tree = w.ok(&["chain", "show", &root]);
    assert!(
        tree.contains("tokens 60/100") && tree.contains("(spent tokens 60, usd 0.37)"),
        "{tree}"
    );
    // A person adds 50: 90 are left to spend, and the chain is open again.
    let resumed = w.json(&["chain", "resume", &root, "--add", "tokens=50"]);
    assert_eq!(resumed["state"], "open");
    assert_eq!(resumed["units"]["tokens"]["limit"], 150);
    let again = w.run(&[
        "chain",
        "spend",
        "tokens=90",
        "--as",
        "b",
        "--parent",
        &root,
    ]);
    assert_eq!(
        again.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
}

/// Eight processes spend 30 tokens each from a budget of 100 at once: exactly three pass,
/// the other five are refused, the chain stops once and its origin is told once.
#[test]
fn eight_processes_spending_at_once_never_pass_the_limit_together() {
    let w = World::new();
    for a in ["a", "b"] {
        w.ok(&["agent", "add", a, "--provider", "demo"]);
    }
    let root = id_of(&w.json(&["send", "a", "b", "root", "--budget", "tokens=100"]));
    let children: Vec<_> = (0..8)
        .map(|_| {
            w.cmd()
                .args([
                    "chain",
                    "spend",
                    "tokens=30",
                    "--as",
                    "b",
                    "--parent",
                    &root,
                ])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let codes: Vec<Option<i32>> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap().status.code())
        .collect();
    let passed = codes.iter().filter(|c| **c == Some(0)).count();
    assert!(
        passed <= 3,
        "chains: {passed} spends of 30 passed a budget of 100 together: {codes:?}"
    );
    assert_eq!(passed, 3, "{codes:?}");
    assert_eq!(
        codes.iter().filter(|c| **c == Some(1)).count(),
        5,
        "{codes:?}"
    );
    let c = w.json(&["chain", "show", &root]);
    assert_eq!(c["chain"]["units"]["tokens"]["spent"], 90, "{c}");
    assert_eq!(c["chain"]["state"], "needs_human");
    assert_eq!(notifications(&c).len(), 1, "{c:#}");
}

/// Bad budgets and spends are usage errors (exit 2) that change nothing; a spend outside any
/// chain, or by an agent that is not in it, is refused.
#[test]
fn bad_budgets_and_spends_are_usage_errors() {
    let w = World::new();
    for a in ["a", "b", "c"] {
        w.ok(&["agent", "add", a, "--provider", "demo"]);
    }
    let root = id_of(&w.json(&["send", "a", "b", "root", "--budget", "tokens=10"]));
    for bad in [
        vec!["send", "a", "b", "x", "--budget", "tokens=-1"],
        vec!["send", "a", "b", "x", "--budget", "tokens"],
        vec!["send", "a", "b", "x", "--budget", "hops=1.5"],
        vec!["send", "a", "b", "x", "--budget", "9lives=1"],
        vec!["send", "a", "b", "x", "--budget", "depth=3"],
        vec![
            "send", "b", "a", "x", "--budget", "tokens=5", "--parent", &root,
        ],
        vec![
            "chain",
            "spend",
            "tokens=abc",
            "--as",
            "b",
            "--parent",
            &root,
        ],
        vec![
            "chain",
            "spend",
            "tokens=0.1234567",
            "--as",
            "b",
            "--parent",
            &root,
        ],
        vec!["chain", "spend", "hops=1", "--as", "b", "--parent", &root],
        vec!["chain", "spend", "", "--as", "b", "--parent", &root],
        vec!["chain", "resume", &root, "--add", "tokens=0"],
    ] {
        let out = w.run(&bad);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{bad:?}: {err}");
    }
    let out = w.run(&["chain", "spend", "tokens=1", "--as", "b"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("working in no chain"));
    let out = w.run(&["chain", "spend", "tokens=1", "--as", "c", "--parent", &root]);
    assert_eq!(out.status.code(), Some(1), "c is not in the chain");
    let c = w.json(&["chain", "show", &root]);
    assert_eq!(c["chain"]["units"]["tokens"]["spent"], 0, "{c}");
    assert_eq!(c["chain"]["state"], "open");
    assert_eq!(c["messages"].as_array().map(Vec::len), Some(1));
}
