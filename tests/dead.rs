//! Dead letters (SPEC §8.2), as real processes: every reason can be produced, is listed with
//! its reason, and is replayed once as a new message (new id, same chain, linked to the dead
//! one), never as a resend of its request id.

mod common;

use common::World;
use serde_json::Value;
use std::time::Duration;

fn open_letters(w: &World) -> Vec<Value> {
    w.json(&["dead", "list"]).as_array().unwrap().clone()
}

/// The one open dead letter with `reason`.
fn letter(w: &World, reason: &str) -> Value {
    let found: Vec<Value> = open_letters(w)
        .into_iter()
        .filter(|d| d["reason"] == reason)
        .collect();
    assert_eq!(found.len(), 1, "one {reason} letter: {found:#?}");
    found[0].clone()
}

/// Replays `d` (to `to`, if given) and shows that a second replay is refused.
fn replay_once(w: &World, d: &Value, to: Option<&str>) -> Value {
    let id = d["id"].as_str().unwrap();
    let mut args = vec!["dead", "replay", id];
    if let Some(t) = to {
        args.extend(["--to", t]);
    }
    let r = w.json(&args);
    let new = r["sent"]["message"].clone();
    assert_ne!(Some(new["id"].as_str().unwrap()), d["message_id"].as_str());
    assert_eq!(r["dead_letter"]["replayed_as"], new["id"]);
    let again = w.run(&args);
    assert_eq!(
        again.status.code(),
        Some(1),
        "a dead letter is replayed once"
    );
    assert!(String::from_utf8_lossy(&again.stderr).contains("already replayed"));
    assert!(
        open_letters(w).iter().all(|o| o["id"] != d["id"]),
        "no longer open"
    );
    new
}

#[test]
fn an_unknown_recipient_and_a_refused_connection_are_kept_and_replayed_once() {
    let w = World::new();
    for a in ["a", "b"] {
        w.ok(&["agent", "add", a, "--provider", "demo"]);
    }
    let out = w.run(&["send", "a", "ghost", "for nobody yet"]);
    assert_eq!(out.status.code(), Some(1));
    let d = letter(&w, "unknown_recipient");
    assert_eq!(
        d["message_id"],
        Value::Null,
        "nothing was stored but the letter"
    );
    w.ok(&["agent", "add", "ghost", "--provider", "demo"]);
    let new = replay_once(&w, &d, None);
    assert_eq!(new["recipient"], "ghost");
    assert_eq!(new["body"], "for nobody yet");

    w.ok(&["block", "a", "b"]);
    let out = w.run(&["send", "a", "b", "over a closed line"]);
    assert_eq!(out.status.code(), Some(1));
    let d = letter(&w, "topology");
    // Still blocked: the replay is refused and the letter stays.
    let out = w.run(&["dead", "replay", d["id"].as_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not allowed"));
    assert_eq!(letter(&w, "topology")["id"], d["id"]);
    w.ok(&["allow", "a", "b"]);
    let new = replay_once(&w, &d, None);
    assert_eq!(new["recipient"], "b");
    // Dropped letters are gone from the open list, and cannot be replayed.
    let out = w.run(&["send", "a", "ghost2", "x"]);
    assert_eq!(out.status.code(), Some(1));
    let d = letter(&w, "unknown_recipient");
    w.ok(&["dead", "drop", d["id"].as_str().unwrap()]);
    assert!(open_letters(&w).is_empty());
    let out = w.run(&["dead", "replay", d["id"].as_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn a_handoff_failed_for_good_is_kept_and_replayed_to_another_agent() {
    let w = World::new();
    w.ok(&["agent", "add", "a", "--provider", "demo"]);
    let failing = w.script("fails.sh", 0, 1);
    w.add_command_agent("b", &failing);
    let works = w.script("works.sh", 0, 0);
    w.add_command_agent("c", &works);
    let sent = w.json(&["send", "a", "b", "this will fail"]);
    let id = sent["message"]["id"].as_str().unwrap().to_owned();
    let _engine = w.spawn_engine();
    w.wait_for(Duration::from_secs(30), |c| c.get("FAILED") == Some(&1));
    // FAILED with a resend still planned is not dead; wait for the final one.
    let start = std::time::Instant::now();
    let d = loop {
        if let Some(d) = open_letters(&w)
            .into_iter()
            .find(|d| d["reason"] == "failed")
        {
            break d;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "dead letters: a handoff FAILED for good was not kept: {}",
            w.ok(&["status", &id])
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(d["message_id"], Value::String(id.clone()));
    let new = replay_once(&w, &d, Some("c"));
    assert_eq!(new["recipient"], "c");
    assert_eq!(
        new["parent_id"],
        Value::String(id.clone()),
        "linked to the dead one"
    );
    assert_eq!(new["chain_id"], Value::String(id.clone()), "in its chain");
    let new_id = new["id"].as_str().unwrap().to_owned();
    w.wait_for(Duration::from_secs(30), |c| c.get("RETURNED") == Some(&1));
    assert_eq!(w.states()[&new_id], "RETURNED");
    // Never a resend of the dead one's request ids: c's run is the new message's own.
    let runs = std::fs::read_to_string(&w.log).unwrap();
    assert_eq!(
        runs.lines().filter(|l| l.ends_with(" c")).count(),
        2,
        "{runs}"
    );
}

#[test]
fn a_moved_or_removed_recipient_is_kept_and_the_replay_cancels_the_waiting_delivery() {
    let w = World::new();
    w.ok(&["agent", "add", "a", "--provider", "demo"]);
    let script = w.script("b.sh", 0, 0);
    w.add_command_agent("b", &script);
    let first = w.json(&["send", "a", "b", "queued for the old b"])["message"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    // Re-registered elsewhere while queued: UNAVAILABLE, never redirected.
    let other = w.script("b2.sh", 0, 0);
    w.add_command_agent("b", &other);
    w.ok(&["tick"]);
    assert_eq!(w.states()[&first], "UNAVAILABLE");
    let d = letter(&w, "destination_changed");
    let new = replay_once(&w, &d, None);
    assert_eq!(
        w.states()[&first],
        "CANCELLED",
        "only the new message can land"
    );
    let new_id = new["id"].as_str().unwrap().to_owned();

    // Removed while queued.
    let second = w.json(&["send", "a", "b", "for a b about to go"])["message"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    w.ok(&["agent", "remove", "b"]);
    w.ok(&["tick"]);
    assert_eq!(w.states()[&second], "UNAVAILABLE");
    // Both b's queued messages (the replay too) are kept, each with the reason.
    let kept: Vec<Value> = open_letters(&w)
        .into_iter()
        .filter(|d| d["reason"] == "unknown_recipient")
        .collect();
    assert_eq!(kept.len(), 2, "{kept:#?}");
    let d = kept
        .into_iter()
        .find(|d| d["message_id"] == Value::String(second.clone()))
        .expect("the removed recipient's letter");
    w.ok(&["agent", "add", "a2", "--provider", "demo"]);
    let out = w.run(&["dead", "replay", d["id"].as_str().unwrap()]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "b is gone: the replay is refused"
    );
    w.add_command_agent("b", &other);
    replay_once(&w, &d, None);
    assert_eq!(w.states()[&second], "CANCELLED");
    assert!(w.states().contains_key(&new_id));
}

#[test]
fn a_send_into_a_stopped_chain_is_kept_and_replayed_once_the_chain_is_lifted() {
    let w = World::new();
    for a in ["a", "b"] {
        w.ok(&["agent", "add", a, "--provider", "demo"]);
    }
    w.ok(&["config", "chainHopBudget", "0"]);
    let root = w.json(&["send", "a", "b", "root"])["message"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let out = w.run(&["send", "b", "a", "one hop too many", "--parent", &root]);
    assert_eq!(out.status.code(), Some(1));
    let d = letter(&w, "chain_stopped");
    assert_eq!(d["chain_id"], Value::String(root.clone()));
    let out = w.run(&["dead", "replay", d["id"].as_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "still stopped");
    w.ok(&["chain", "resume", &root, "--add", "hops=1"]);
    let new = replay_once(&w, &d, None);
    assert_eq!(new["chain_id"], Value::String(root.clone()));
    assert_eq!(new["parent_id"], Value::String(root));
    assert_eq!(new["hop"], 1);
}

/// A replay that its chain's budget refuses stops the chain as any send would (its origin
/// told once), so the refusal's advice holds: a resume lifts it, and the replay then goes.
#[test]
fn a_replay_refused_by_its_chain_stops_it_and_a_resume_lets_it_go() {
    let w = World::new();
    for a in ["a", "b"] {
        w.ok(&["agent", "add", a, "--provider", "demo"]);
    }
    let root = w.json(&["send", "a", "b", "root", "--budget", "hops=0"])["message"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    w.ok(&["block", "b", "a"]);
    let out = w.run(&["send", "b", "a", "an answer", "--parent", &root]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let d = letter(&w, "topology");
    w.ok(&["allow", "b", "a"]);
    let out = w.run(&["dead", "replay", d["id"].as_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("resume"),
        "{out:?}"
    );
    let c = w.json(&["chain", "show", &root]);
    assert_eq!(c["chain"]["state"], "needs_human", "{c:#}");
    let told = c["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["intent"] == "notification" && m["recipient"] == "a")
        .count();
    assert_eq!(told, 1, "the origin is told once: {c:#}");
    assert_eq!(open_letters(&w).len(), 1, "the letter stays, no second one");
    w.ok(&["chain", "resume", &root, "--add", "hops=1"]);
    let new = replay_once(&w, &d, None);
    assert_eq!(new["hop"], 1);
}
