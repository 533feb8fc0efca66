//! Fan-out (SPEC §8.2), as real processes: one piece of work split to several agents in one
//! transaction, joined once into ONE combined return when all (or the first K) of its
//! children have returned, or at its deadline (flagged partial); later returns recorded as
//! late and told to the sender; the rest cancelled on request; two returns at the same
//! moment from two processes join it exactly once, in 100 of 100 runs.

mod common;

use common::World;
use serde_json::Value;
use std::process::Stdio;
use std::time::{Duration, Instant};

fn with_agents(ids: &[&str]) -> World {
    let w = World::new();
    for id in ids {
        w.ok(&["agent", "add", id, "--provider", "demo"]);
    }
    w
}

/// `send lead --to TO MESSAGE --title T EXTRA… --json`, asserted to succeed.
fn fan_out(w: &World, to: &str, title: &str, extra: &[&str]) -> Value {
    let mut args = vec![
        "send",
        "lead",
        "--to",
        to,
        "check the diff",
        "--title",
        title,
    ];
    args.extend_from_slice(extra);
    w.json(&args)
}

/// Each child's message id, by recipient, in the order given.
fn children(f: &Value) -> Vec<(String, String)> {
    f["children"]
        .as_array()
        .expect("children is an array")
        .iter()
        .map(|c| {
            (
                c["message"]["recipient"].as_str().unwrap().to_owned(),
                c["message"]["id"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn child(f: &Value, to: &str) -> String {
    children(f)
        .into_iter()
        .find(|(r, _)| r == to)
        .unwrap_or_else(|| panic!("no child for {to}: {f:#}"))
        .1
}

fn ret(w: &World, id: &str, actor: &str, summary: &str) -> Value {
    w.json(&["return", id, "--as", actor, "--summary", summary])
}

/// The lead's inbox (all of it), as (title, intent, body).
fn lead_inbox(w: &World) -> Vec<(String, String, String)> {
    w.json(&["inbox", "lead", "--all", "--limit", "1000"])
        .as_array()
        .expect("the inbox is an array")
        .iter()
        .map(|m| {
            (
                m["title"].as_str().unwrap_or("").to_owned(),
                m["intent"].as_str().unwrap().to_owned(),
                m["body"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn show(w: &World, id: &str) -> Value {
    w.json(&["fanout", "show", id])
}

#[test]
fn the_first_k_returns_join_it_once_and_stragglers_are_recorded_late() {
    let w = with_agents(&["lead", "a", "b", "c"]);
    let f = fan_out(&w, "a,b,c", "Review PR 12", &["--join", "quorum:2"]);
    assert_eq!(f["created"], true);
    assert_eq!(f["fanout"]["state"], "waiting");
    assert_eq!(f["fanout"]["quorum"], 2);
    let kids = children(&f);
    assert_eq!(
        kids.iter().map(|(r, _)| r.as_str()).collect::<Vec<_>>(),
        ["a", "b", "c"]
    );
    // One chain: the later children sit beside the first.
    let chain = f["children"][0]["message"]["chain_id"].clone();
    for c in f["children"].as_array().unwrap() {
        assert_eq!(c["message"]["chain_id"], chain, "one chain: {f:#}");
        assert_eq!(c["message"]["kind"], "work");
        assert_eq!(c["delivery_state"], "WAITING", "each child is a delivery");
    }

    let r = ret(&w, &child(&f, "a"), "a", "LGTM from a");
    assert_eq!(r["fanout"]["state"], "waiting", "1 of the 2 needed: {r:#}");
    assert!(r["return_message"].is_null(), "no return of its own: {r:#}");
    assert!(
        lead_inbox(&w).is_empty(),
        "nothing reaches the lead before the join: {:?}",
        lead_inbox(&w)
    );

    let r = ret(&w, &child(&f, "b"), "b", "one nit from b");
    assert_eq!(r["fanout"]["state"], "complete", "{r:#}");
    let combined = r["return_message"]["id"].as_str().unwrap().to_owned();
    assert_eq!(r["fanout"]["combined_id"], combined.as_str());
    assert_eq!(
        r["return_message"]["intent"], "handoff",
        "a turn for the lead"
    );
    assert_eq!(r["return_message"]["recipient"], "lead");
    let body = r["return_message"]["body"].as_str().unwrap();
    assert!(body.contains("2 of 3 answered"), "{body}");
    assert!(
        body.contains("LGTM from a") && body.contains("one nit from b"),
        "{body}"
    );
    assert!(body.contains("Not answered: c"), "{body}");

    // The straggler: recorded, told to the lead as a notification, never combined again.
    let r = ret(&w, &child(&f, "c"), "c", "late thoughts from c");
    assert_eq!(r["work"]["state"], "returned");
    assert_eq!(r["work"]["summary"], "late thoughts from c");
    assert_eq!(r["return_message"]["intent"], "notification", "{r:#}");
    assert_eq!(r["fanout"]["combined_id"], combined.as_str());
    let again = w.run(&["return", &child(&f, "c"), "--as", "c", "--summary", "again"]);
    assert_eq!(again.status.code(), Some(1), "a second return is refused");

    let inbox = lead_inbox(&w);
    let joined: Vec<_> = inbox
        .iter()
        .filter(|(t, ..)| t.starts_with("joined"))
        .collect();
    assert_eq!(joined.len(), 1, "one combined return: {inbox:?}");
    assert_eq!(joined[0].0, "joined (2/3): Review PR 12");
    let late: Vec<_> = inbox
        .iter()
        .filter(|(t, i, _)| t == "returned late: Review PR 12" && i == "notification")
        .collect();
    assert_eq!(late.len(), 1, "the late return is told once: {inbox:?}");
    assert!(late[0].2.contains("late thoughts from c"));
    assert_eq!(inbox.len(), 2, "nothing else: {inbox:?}");

    let v = show(&w, &child(&f, "c"));
    assert_eq!(v["fanout"]["state"], "complete");
    assert_eq!(v["answered"], 2);
    let late: Vec<bool> = v["children"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["late"].as_bool().unwrap())
        .collect();
    assert_eq!(late, [false, false, true], "{v:#}");

    // The combined return is an ordinary delivery: the engine carries it, once.
    w.ok(&["tick"]);
    let states = w.states();
    assert!(
        states.contains_key(&combined),
        "the combined return is enrolled: {states:?}"
    );
}

#[test]
fn a_deadline_with_no_returns_joins_a_flagged_empty_combination() {
    let w = with_agents(&["lead"]);
    // Demo agents whose turns outlast the test: nobody returns.
    for id in ["a", "b"] {
        w.ok(&[
            "agent",
            "add",
            id,
            "--provider",
            "demo",
            "--set",
            "turn_seconds=80000",
        ]);
    }
    // The engine waits 30 s between looks unless something is due: it must keep the
    // deadline itself.
    let log = std::fs::File::create(w.dir.path().join("engine.log")).unwrap();
    let _engine = common::Engine(
        w.cmd()
            .args(["run", "--interval", "30"])
            .env("HANDOFFS_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    std::thread::sleep(Duration::from_millis(500));
    let f = fan_out(&w, "a,b", "Survey", &["--deadline-minutes", "0.1"]);
    let sent = Instant::now();
    let id = f["fanout"]["id"].as_str().unwrap().to_owned();
    let partial = loop {
        let found: Vec<_> = lead_inbox(&w)
            .into_iter()
            .filter(|(t, ..)| t.starts_with("partial"))
            .collect();
        if !found.is_empty() {
            break found;
        }
        assert!(
            sent.elapsed() < Duration::from_secs(20),
            "fan-out: no partial join 20 s after a 6 s deadline: {:#}",
            show(&w, &id)
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let took = sent.elapsed();
    assert!(
        took >= Duration::from_secs(5),
        "joined before its deadline: {took:?}"
    );
    assert_eq!(partial.len(), 1, "{partial:?}");
    let (title, intent, body) = &partial[0];
    assert_eq!(title, "partial (0/2): Survey");
    assert_eq!(intent, "handoff");
    assert!(
        body.contains("PARTIAL") && body.contains("0 of 2 answered"),
        "{body}"
    );
    assert!(
        body.contains("Not answered: a (") && body.contains(", b ("),
        "{body}"
    );
    let v = show(&w, &id);
    assert_eq!(v["fanout"]["state"], "partial");
    assert_eq!(v["answered"], 0);
    // A return after it: late, kept, told.
    let r = ret(&w, &child(&f, "a"), "a", "sorry, late");
    assert_eq!(r["return_message"]["intent"], "notification", "{r:#}");
    assert!(show(&w, &id)["children"][0]["late"].as_bool().unwrap());
}

#[test]
fn cancel_rest_cancels_the_children_still_unanswered_at_the_join() {
    let w = with_agents(&["lead", "a", "b"]);
    let f = fan_out(
        &w,
        "a,b",
        "Find the bug",
        &["--join", "quorum:1", "--cancel-rest"],
    );
    let r = ret(&w, &child(&f, "a"), "a", "found it");
    assert_eq!(r["fanout"]["state"], "complete");
    let bs = child(&f, "b");
    let states = w.states();
    assert_eq!(states[&bs], "CANCELLED", "b's pending delivery: {states:?}");
    let v = show(&w, &bs);
    assert_eq!(v["children"][1]["work_state"], "closed");
    let told = w.json(&["inbox", "b", "--limit", "100"]);
    let told: Vec<&Value> = told
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["title"] == "cancelled: Find the bug")
        .collect();
    assert_eq!(told.len(), 1, "b is told once");
    assert_eq!(told[0]["intent"], "notification");
    // b answers anyway: recorded late, not lost.
    let r = ret(&w, &bs, "b", "also found it");
    assert_eq!(r["work"]["state"], "closed");
    assert_eq!(r["work"]["summary"], "also found it");
    assert_eq!(r["return_message"]["intent"], "notification");
}

#[test]
fn a_fan_out_is_refused_whole_when_one_child_cannot_be_sent() {
    let w = with_agents(&["lead", "a", "b"]);
    w.ok(&["config", "connections", "explicit"]);
    w.ok(&["allow", "lead", "a"]);
    let out = w.run(&["send", "lead", "--to", "a,b", "x", "--title", "t", "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("lead → b is not allowed"), "{err}");
    assert!(
        w.json(&["inbox", "a", "--all"])
            .as_array()
            .unwrap()
            .is_empty(),
        "nothing written for a either"
    );
    assert!(w.json(&["fanout", "list"]).as_array().unwrap().is_empty());
    // Bad input: one line, exit 2.
    for (args, says) in [
        (
            vec!["send", "lead", "--to", "a,a", "x", "--title", "t"],
            "named twice",
        ),
        (
            vec!["send", "lead", "--to", "a,b", "x"],
            "give it a --title",
        ),
        (
            vec![
                "send", "lead", "--to", "a,b", "x", "--title", "t", "--join", "quorum:3",
            ],
            "quorum:3 is not a number of children from 1 to 2",
        ),
        (
            vec![
                "send", "lead", "--to", "a,b", "x", "--title", "t", "--join", "most",
            ],
            "unknown join",
        ),
        (
            vec![
                "send",
                "lead",
                "--to",
                "a,b",
                "x",
                "--title",
                "t",
                "--deadline-minutes",
                "0",
            ],
            "the deadline must be",
        ),
        (
            vec!["send", "lead", "--to", "a,b", "x", "y", "--title", "t"],
            "give FROM and the message only",
        ),
        (vec!["send", "lead", "a", "x", "--join", "all"], "--to A,B"),
    ] {
        let out = w.run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

#[test]
fn a_repeated_key_returns_the_first_fan_out() {
    let w = with_agents(&["lead", "a", "b"]);
    let first = fan_out(&w, "a,b", "t", &["--key", "k1"]);
    let again = fan_out(&w, "a,b", "t", &["--key", "k1"]);
    assert_eq!(again["created"], false);
    assert_eq!(again["fanout"]["id"], first["fanout"]["id"]);
    let other = w.run(&[
        "send",
        "lead",
        "--to",
        "b,a",
        "check the diff",
        "--title",
        "t",
        "--key",
        "k1",
    ]);
    assert_eq!(other.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&other.stderr).contains("already used for a different fan-out")
    );
    assert_eq!(w.json(&["inbox", "a"]).as_array().unwrap().len(), 1);
}

/// Two children return at the same moment from two processes; the join happens exactly
/// once (quorum:1 — both returns would join it; all — only the later may). 100 runs.
#[test]
fn two_returns_at_the_same_moment_join_it_exactly_once_in_100_runs() {
    let w = with_agents(&["lead", "a", "b"]);
    let mut joins = 0;
    for run in 0..120 {
        // 100 quorum races (both returns would join it), then 20 of join all (only the
        // later may).
        let join = if run < 100 { "quorum:1" } else { "all" };
        let f = fan_out(&w, "a,b", &format!("race {run}"), &["--join", join]);
        let spawn = |who: &str| {
            w.cmd()
                .args([
                    "--json",
                    "return",
                    &child(&f, who),
                    "--as",
                    who,
                    "--summary",
                ])
                .arg(format!("{who} in run {run}"))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        };
        let (pa, pb) = (spawn("a"), spawn("b"));
        let outs = [
            pa.wait_with_output().unwrap(),
            pb.wait_with_output().unwrap(),
        ];
        let mut combined = Vec::new();
        for o in &outs {
            assert!(
                o.status.success(),
                "run {run}: a return failed: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            let v: Value = serde_json::from_slice(&o.stdout).unwrap();
            if let Some(m) = v["return_message"].as_object()
                && m["intent"] == "handoff"
            {
                combined.push(m["id"].as_str().unwrap().to_owned());
            }
        }
        let v = show(&w, &child(&f, "a"));
        let title = format!("race {run}");
        let in_inbox = lead_inbox(&w)
            .into_iter()
            .filter(|(t, i, _)| i == "handoff" && t.ends_with(&format!("): {title}")))
            .count();
        assert!(
            combined.len() == 1 && in_inbox == 1,
            "fan-out: run {run} ({join}) joined {} times ({in_inbox} combined returns in the \
             lead's inbox): {v:#}",
            combined.len()
        );
        assert_eq!(v["fanout"]["state"], "complete");
        assert_eq!(v["fanout"]["combined_id"], combined[0].as_str());
        joins += 1;
    }
    assert_eq!(joins, 120);
}

/// Past its deadline a fan-out is joined partial at the next return, engine or no engine:
/// that return is late.
#[test]
fn a_return_after_the_deadline_finds_it_joined_partial_without_an_engine() {
    let w = with_agents(&["lead", "a", "b"]);
    let f = fan_out(
        &w,
        "a,b",
        "Late",
        &["--deadline-minutes", "0.1", "--cancel-rest"],
    );
    std::thread::sleep(Duration::from_millis(6_300));
    let r = ret(&w, &child(&f, "a"), "a", "too late");
    assert_eq!(r["fanout"]["state"], "partial", "{r:#}");
    assert_eq!(r["return_message"]["intent"], "notification", "late: {r:#}");
    // Cancel-rest cancels the part still out (b's), never the one coming back (a's).
    let told = |who: &str| {
        w.json(&["inbox", who, "--limit", "100"])
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["title"] == "cancelled: Late")
            .count()
    };
    assert_eq!((told("a"), told("b")), (0, 1));
    let inbox = lead_inbox(&w);
    assert!(
        inbox
            .iter()
            .any(|(t, i, _)| t == "partial (0/2): Late" && i == "handoff"),
        "{inbox:?}"
    );
}

/// Closing a child before it answered can leave a join-all unable to complete: it is joined
/// partial at once, saying why; a dead child replayed is waited for as the child.
#[test]
fn a_child_closed_unanswered_or_replayed_after_dying_is_accounted_for() {
    let w = with_agents(&["lead", "a", "b", "c"]);
    let f = fan_out(&w, "a,b", "Both", &[]);
    ret(&w, &child(&f, "a"), "a", "done");
    w.ok(&["close", &child(&f, "b"), "blocked", "--as", "lead"]);
    let v = show(&w, &child(&f, "a"));
    assert_eq!(v["fanout"]["state"], "partial", "{v:#}");
    let inbox = lead_inbox(&w);
    let (_, _, body) = inbox
        .iter()
        .find(|(t, ..)| t == "partial (1/2): Both")
        .unwrap_or_else(|| panic!("no partial join: {inbox:?}"));
    assert!(body.contains("can no longer reach its quorum"), "{body}");

    // A child whose recipient is removed dies; its replay to another agent is the child now.
    let f = fan_out(&w, "a,b", "Replayed", &["--join", "all"]);
    w.ok(&["agent", "remove", "b"]);
    w.ok(&["tick"]);
    let dead = w.json(&["dead", "list"]);
    let letter = dead
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["message_id"] == child(&f, "b").as_str())
        .unwrap_or_else(|| panic!("no dead letter for b's child: {dead:#}"))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let replay = w.json(&["dead", "replay", &letter, "--to", "c"]);
    let new_id = replay["sent"]["message"]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("{replay:#}"))
        .to_owned();
    ret(&w, &child(&f, "a"), "a", "mine");
    let r = ret(&w, &new_id, "c", "the replayed part");
    assert_eq!(r["fanout"]["state"], "complete", "{r:#}");
    let body = r["return_message"]["body"].as_str().unwrap();
    assert!(
        body.contains("the replayed part") && body.contains("## c "),
        "{body}"
    );
}

/// A fan-out is one hop of its chain however wide; `fanout show` takes the short id the
/// commands print; a repeated key must ask the very same (deadline and cancel-rest too).
#[test]
fn a_wide_fan_out_spends_one_hop_and_its_short_id_and_key_work() {
    let w = with_agents(&["lead"]);
    let names: Vec<String> = (0..20).map(|i| format!("w{i}")).collect();
    for n in &names {
        w.ok(&["agent", "add", n, "--provider", "demo"]);
    }
    let f = fan_out(
        &w,
        &names.join(","),
        "Wide",
        &["--join", "quorum:3", "--key", "k"],
    );
    assert_eq!(f["fanout"]["children"], 20);
    let chain = w.json(&["chain", "show", &child(&f, "w0")]);
    assert_eq!(
        chain["chain"]["hops"], 0,
        "a new chain's fan-out: {chain:#}"
    );
    let id = f["fanout"]["id"].as_str().unwrap();
    assert_eq!(show(&w, &id[..8])["fanout"]["id"], id);
    for extra in [
        vec!["--join", "quorum:3", "--key", "k", "--cancel-rest"],
        vec![
            "--join",
            "quorum:3",
            "--key",
            "k",
            "--deadline-minutes",
            "5",
        ],
    ] {
        let joined = names.join(",");
        let mut args = vec!["send", "lead", "--to", &joined, "check the diff"];
        args.extend(["--title", "Wide"]);
        args.extend(extra.iter().copied());
        let out = w.run(&args);
        assert_eq!(out.status.code(), Some(1), "{extra:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("already used for a different fan-out"),
            "{extra:?}"
        );
    }
    let neg = w.run(&[
        "send",
        "lead",
        "--to",
        "w0,w1",
        "x",
        "--title",
        "t",
        "--deadline-minutes",
        "-1",
    ]);
    assert_eq!(neg.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&neg.stderr).contains("the deadline must be"));
}

/// A blocked answer is shown but is no return: it counts toward no quorum, and when too few
/// children are left to reach it the fan-out is joined partial. A fan-out its chain's budget
/// cannot take stops the chain and tells its origin, as any send past the budget does.
#[test]
fn a_blocked_answer_counts_toward_no_quorum_and_a_chain_past_its_budget_stops() {
    let w = with_agents(&["lead", "a", "b"]);
    let f = fan_out(&w, "a,b", "Fix", &["--join", "quorum:1"]);
    let r = w.json(&[
        "return",
        &child(&f, "a"),
        "--as",
        "a",
        "--summary",
        "stuck",
        "--blocked",
    ]);
    assert_eq!(
        r["fanout"]["state"], "waiting",
        "a blocked answer joins nothing: {r:#}"
    );
    let r = ret(&w, &child(&f, "b"), "b", "fixed");
    assert_eq!(r["fanout"]["state"], "complete", "{r:#}");
    let f = fan_out(&w, "a,b", "Both", &[]);
    let r = w.json(&[
        "return",
        &child(&f, "a"),
        "--as",
        "a",
        "--summary",
        "stuck",
        "--blocked",
    ]);
    assert_eq!(
        r["fanout"]["state"], "partial",
        "all can no longer return: {r:#}"
    );

    // A chain with no hop left: a's fan-out in it is refused, and the chain stops.
    let root = w.json(&["send", "lead", "a", "start", "--budget", "hops=0"]);
    let root = root["message"]["id"].as_str().unwrap().to_owned();
    let out = w.run(&[
        "send", "a", "--to", "lead,b", "more", "--title", "More", "--parent", &root,
    ]);
    assert_eq!(out.status.code(), Some(1));
    let chain = w.json(&["chain", "show", &root]);
    assert_eq!(chain["chain"]["state"], "needs_human", "{chain:#}");
    assert!(
        lead_inbox(&w)
            .iter()
            .any(|(t, i, _)| t.starts_with("chain ")
                && t.ends_with(" stopped")
                && i == "notification"),
        "the origin is told: {:?}",
        lead_inbox(&w)
    );
}
