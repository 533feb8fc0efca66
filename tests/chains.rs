//! Chains that cannot run away (SPEC §8.2), as real processes: lineage from the turn a send
//! comes from, the hop budget and the depth limit that stop a chain in `needs_human` with one
//! notification to its origin, concurrent spends, and a person's resume.

mod common;

use common::{World, serve};
use serde_json::Value;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

fn id_of(sent: &Value) -> String {
    sent["message"]["id"].as_str().unwrap().to_owned()
}

/// The chain of message `id`: its row and its messages.
fn chain(w: &World, id: &str) -> Value {
    w.json(&["chain", "show", id])
}

/// The notifications in chain `c` (never turns).
fn notifications(c: &Value) -> Vec<Value> {
    c["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["intent"] == "notification")
        .cloned()
        .collect()
}

fn handoffs(c: &Value) -> usize {
    c["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["intent"] == "handoff")
        .count()
}

/// Two agents that answer every handoff with one to the other, from inside their turn (the
/// command adapter runs `handoffs send`, which finds its turn through `HANDOFFS_REQUEST_ID`;
/// each body names its turn, so none is a duplicate of one still running),
/// until the chain's hop budget stops them: exactly the budget's continuations, the chain in
/// `needs_human`, one notification to the origin, and the refused turn's resends refused too.
#[test]
fn a_ping_pong_stops_at_exactly_its_hop_budget() {
    let w = World::new();
    let bin = env!("CARGO_BIN_EXE_handoffs");
    for (me, other) in [("a", "b"), ("b", "a")] {
        let command = serde_json::to_string(&[
            bin,
            "send",
            me,
            other,
            &format!("ping from {me} in turn {{request_id}}"),
        ])
        .unwrap();
        w.ok(&[
            "agent",
            "add",
            me,
            "--provider",
            "command",
            "--set",
            &format!("command={command}"),
        ]);
    }
    let budget = 5;
    w.ok(&["config", "chainHopBudget", &budget.to_string()]);
    let root = id_of(&w.json(&["send", "b", "a", "start the rally"]));
    let _engine = w.spawn_engine();
    let start = Instant::now();
    let mut c = chain(&w, &root);
    loop {
        let hops = c["chain"]["hops"].as_i64().unwrap();
        let stopped = c["chain"]["state"] == "needs_human";
        let settled = c["messages"].as_array().unwrap().iter().all(|m| {
            m["intent"] != "handoff"
                || m["delivery_state"] == "RETURNED"
                || m["delivery_state"] == "FAILED"
        });
        if (stopped && settled) || hops > budget + 2 || start.elapsed() > Duration::from_secs(60) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        c = chain(&w, &root);
    }
    assert_eq!(
        c["chain"]["hops"].as_i64().unwrap(),
        budget,
        "chains: the ping-pong ran past its hop budget of {budget}: {}",
        w.ok(&["chain", "show", &root])
    );
    assert_eq!(c["chain"]["state"], "needs_human", "{c:#}");
    assert_eq!(
        handoffs(&c),
        1 + usize::try_from(budget).unwrap(),
        "the first handoff and {budget} more"
    );
    let notes = notifications(&c);
    assert_eq!(notes.len(), 1, "one notification to the origin: {notes:#?}");
    assert_eq!(notes[0]["recipient"], "b", "the origin is told");
    assert!(
        c["chain"]["stopped_reason"]
            .as_str()
            .unwrap()
            .contains("hop budget 5 spent"),
        "{c:#}"
    );
    // Each continuation is one hop below the message whose turn sent it.
    let by_id: std::collections::HashMap<&str, &Value> = c["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap(), m))
        .collect();
    for m in c["messages"].as_array().unwrap() {
        if m["intent"] == "notification" {
            assert_eq!(m["sender"], "handoffs", "told by handoffs itself: {m:#}");
            continue;
        }
        if let Some(p) = m["parent_id"].as_str() {
            assert_eq!(
                m["hop"].as_i64(),
                by_id[p]["hop"].as_i64().map(|h| h + 1),
                "{m:#}"
            );
            assert_eq!(
                m["sender"], by_id[p]["recipient"],
                "sent from the parent's turn: {m:#}"
            );
        }
    }
    // Nobody can register as the one that tells.
    let out = w.run(&["agent", "add", "handoffs", "--provider", "demo"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    // The inbox of the origin shows it, and it never became a turn.
    let inbox = w.ok(&["inbox", "b"]);
    assert!(inbox.contains("stopped"), "{inbox}");
    // A person lifts it: the rally goes on for the hops added.
    w.ok(&["chain", "resume", &root, "--add", "hops=2"]);
    let last = c["messages"]
        .as_array()
        .unwrap()
        .iter()
        .rfind(|m| m["intent"] == "handoff")
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let to = if c["messages"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["id"] == last.as_str() && m["recipient"] == "a")
    {
        ("a", "b")
    } else {
        ("b", "a")
    };
    w.ok(&[
        "send",
        to.0,
        to.1,
        "after the person looked",
        "--parent",
        &last,
    ]);
    // The engine still runs: the person's send is one of the two hops added, the reply to
    // it the other, and then the chain stops again.
    let start = Instant::now();
    let mut c = chain(&w, &root);
    while !(c["chain"]["state"] == "needs_human"
        && c["chain"]["hops"].as_i64().unwrap() >= budget + 2)
        && start.elapsed() < Duration::from_secs(60)
    {
        std::thread::sleep(Duration::from_millis(100));
        c = chain(&w, &root);
    }
    std::thread::sleep(Duration::from_millis(500));
    let c = chain(&w, &root);
    assert_eq!(
        c["chain"]["hops"].as_i64().unwrap(),
        budget + 2,
        "chains: the resumed rally ran past the two hops added: {}",
        w.ok(&["chain", "show", &root])
    );
    assert_eq!(c["chain"]["state"], "needs_human", "{c:#}");
}

/// An HTTP recipient's turn is named by the `request_id` of the write it received: a send
/// with that id (`HANDOFFS_REQUEST_ID`) continues the chain of that handoff, even once the
/// turn has returned; an id that is not the sender's starts a chain of its own.
#[test]
fn a_send_naming_an_http_turns_request_id_continues_its_chain() {
    let w = World::new();
    w.ok(&["agent", "add", "lead", "--provider", "demo"]);
    w.ok(&["agent", "add", "c", "--provider", "demo"]);
    w.add_http_agent("b");
    let root = id_of(&w.json(&["send", "lead", "b", "look at the parser"]));
    // The turn ends (RETURNED), so no turn of b's is under way to fall back on.
    for _ in 0..50 {
        w.ok(&["tick"]);
        if w.states().get(&root).map(String::as_str) == Some("RETURNED") {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(w.states()[&root], "RETURNED");
    let log = std::fs::read_to_string(&w.log).unwrap();
    let request = log
        .lines()
        .find_map(|l| l.strip_prefix("start "))
        .and_then(|l| l.split(' ').next())
        .unwrap_or_else(|| panic!("b never received the write: {log}"))
        .to_owned();
    let send_in_turn = |from: &str, request: &str| {
        let out = w
            .cmd()
            .args(["--json", "send", from, "c", "from the turn"])
            .env("HANDOFFS_REQUEST_ID", request)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    };
    let child = send_in_turn("b", &request);
    assert_eq!(
        child["message"]["parent_id"].as_str(),
        Some(root.as_str()),
        "the write's request id names b's turn on {root}: {child:#}"
    );
    assert_eq!(child["message"]["hop"], 1, "{child:#}");
    assert_eq!(child["message"]["chain_id"].as_str(), Some(root.as_str()));
    // A budget from inside the turn starts a chain of its own (no parent named).
    let out = w
        .cmd()
        .args([
            "--json",
            "send",
            "b",
            "c",
            "a side quest",
            "--budget",
            "hops=3",
        ])
        .env("HANDOFFS_REQUEST_ID", &request)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let own: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(own["message"]["parent_id"].is_null(), "{own:#}");
    assert_eq!(own["message"]["hop"], 0, "{own:#}");
    // The same id from an agent whose turn it is not: a chain of its own.
    let other = send_in_turn("lead", &request);
    assert!(other["message"]["parent_id"].is_null(), "{other:#}");
    assert_eq!(other["message"]["hop"], 0, "{other:#}");
}

/// A handoff sent while delivery is not yet enabled (`enabledAfter` in the future) has no
/// delivery; when its chain is cancelled and `enabledAfter` is then moved back before it,
/// the late enrolment finds the cancel: CANCELLED at birth, never written.
#[test]
fn a_handoff_enrolled_after_its_chain_was_cancelled_is_never_written() {
    let w = World::new();
    w.ok(&["agent", "add", "lead", "--provider", "demo"]);
    w.add_http_agent("b");
    w.ok(&["config", "enabledAfter", "2099-01-01T00:00:00Z"]);
    let root = id_of(&w.json(&["send", "lead", "b", "deferred until later"]));
    w.ok(&["chain", "cancel", &root, "--note", "not needed"]);
    w.ok(&["config", "enabledAfter", "0"]);
    w.ok(&["tick"]);
    w.ok(&["tick"]);
    let runs = std::fs::read_to_string(&w.log).unwrap_or_default();
    let status = w.json(&["status", &root]);
    let history: Vec<String> = status["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "delivery" || e["kind"] == "state")
        .map(|e| e["detail"].as_str().unwrap().to_owned())
        .collect();
    assert!(
        status["state"] == "CANCELLED"
            && runs.is_empty()
            && history.len() == 1
            && history[0].contains("CANCELLED"),
        "chains: a handoff enrolled after its chain was cancelled was queued: {}, \
         history {history:?}, writes:\n{runs}",
        status["state"]
    );
}

/// The depth guard refuses a grandchild at depth limit 1; a second try is refused without a
/// second notification; a parent the sender never saw is refused; raising the limit lifts it.
#[test]
fn the_depth_limit_refuses_a_grandchild_and_tells_the_origin_once() {
    let w = World::new();
    for a in ["a", "b", "c"] {
        w.ok(&["agent", "add", a, "--provider", "demo"]);
    }
    w.ok(&["config", "chainDepthLimit", "1"]);
    let root = id_of(&w.json(&["send", "a", "b", "root"]));
    let child = id_of(&w.json(&["send", "b", "c", "child", "--parent", &root]));
    for _ in 0..2 {
        let out = w.run(&["send", "c", "a", "grandchild", "--parent", &child]);
        assert_eq!(out.status.code(), Some(1), "refused, not a usage error");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("depth"), "{err}");
        assert_eq!(err.lines().count(), 1, "one line: {err}");
    }
    let c = chain(&w, &root);
    assert_eq!(c["chain"]["state"], "needs_human");
    assert_eq!(handoffs(&c), 2, "the grandchild was never stored");
    let notes = notifications(&c);
    assert_eq!(notes.len(), 1, "{notes:#?}");
    assert_eq!(notes[0]["recipient"], "a");
    // Spoofed lineage: c never saw the root.
    let out = w.run(&["send", "c", "b", "x", "--parent", &root]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("neither sent to nor by c"));
    // A usage error, not a refusal.
    let out = w.run(&["chain", "resume", &root, "--add", "hops=zero"]);
    assert_eq!(out.status.code(), Some(2));
    // Adding hops would not lift a stop on depth: refused, the chain stays stopped.
    let out = w.run(&["chain", "resume", &root, "--add", "hops=3"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("stopped on its depth"),
        "{out:?}"
    );
    assert_eq!(chain(&w, &root)["chain"]["state"], "needs_human");
    w.ok(&["chain", "resume", &root, "--add", "depth=1"]);
    w.ok(&["send", "c", "a", "grandchild", "--parent", &child]);
    let c = chain(&w, &root);
    assert_eq!(handoffs(&c), 3);
    assert_eq!(c["chain"]["depth_limit"], 2);
}

/// A budget of 0 is spent at birth: the first message goes, any continuation stops the chain.
#[test]
fn a_budget_of_zero_is_spent_at_birth() {
    let w = World::new();
    for a in ["a", "b"] {
        w.ok(&["agent", "add", a, "--provider", "demo"]);
    }
    w.ok(&["config", "chainHopBudget", "0"]);
    let root = id_of(&w.json(&["send", "a", "b", "root"]));
    let out = w.run(&["send", "b", "a", "reply", "--parent", &root]);
    assert_eq!(out.status.code(), Some(1));
    let c = chain(&w, &root);
    assert_eq!(c["chain"]["state"], "needs_human");
    assert_eq!(c["chain"]["hops"], 0);
    assert_eq!(handoffs(&c), 1);
}

/// Eight processes spend from one chain at once: exactly the budget passes, the others are
/// refused, and the origin is told once.
#[test]
fn concurrent_spends_never_pass_the_budget_together() {
    let w = World::new();
    for a in ["a", "b"] {
        w.ok(&["agent", "add", a, "--provider", "demo"]);
    }
    w.ok(&["config", "chainHopBudget", "5"]);
    let root = id_of(&w.json(&["send", "a", "b", "root"]));
    let children: Vec<_> = (0..8)
        .map(|i| {
            w.cmd()
                .args(["send", "b", "a", &format!("reply {i}"), "--parent", &root])
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
    assert_eq!(
        codes.iter().filter(|c| **c == Some(0)).count(),
        5,
        "{codes:?}"
    );
    assert_eq!(
        codes.iter().filter(|c| **c == Some(1)).count(),
        3,
        "{codes:?}"
    );
    let c = chain(&w, &root);
    assert_eq!(c["chain"]["hops"], 5);
    assert_eq!(handoffs(&c), 6);
    assert_eq!(notifications(&c).len(), 1);
}

/// A three-level tree is cancelled while the first turn runs, with a finished part (a turn
/// that returned before) and a reserved part (a write reserved, held at its send boundary's
/// look): the pending and the reserved deliveries below it are CANCELLED and never written
/// (their recipients never run), the finished part stays as it was, open work is closed as
/// cancelled, the running turn is not interrupted and its return is recorded late (told to
/// the sender as a notification, never a turn), each affected agent is told once, and the
/// chain takes no more sends.
#[test]
fn cancel_unwinds_a_three_level_tree_while_one_turn_runs() {
    let w = World::new();
    w.ok(&["agent", "add", "lead", "--provider", "demo"]);
    // a's turn waits for the test's go, then returns its work (the id from its card).
    let go = w.dir.path().join("go");
    let a = w.dir.path().join("a.sh");
    std::fs::write(
        &a,
        format!(
            "#!/bin/sh\necho \"start $HANDOFFS_REQUEST_ID $(date +%s%N) $HANDOFFS_AGENT\" >> {log}\n\
             touch {started}\n\
             i=0; while [ ! -f {go} ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done\n\
             id=$(grep -o 'return_work id=[0-9a-f]*' \"$HANDOFFS_TEXT_FILE\" | cut -d= -f2)\n\
             {bin} return \"$id\" --summary 'done, late' || exit 3\n\
             echo \"end $HANDOFFS_REQUEST_ID $(date +%s%N) $HANDOFFS_AGENT\" >> {log}\n",
            log = w.log.display(),
            started = w.dir.path().join("started").display(),
            go = go.display(),
            bin = env!("CARGO_BIN_EXE_handoffs"),
        ),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&a, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    w.add_command_agent("a", &a);
    for id in ["b", "c"] {
        let script = w.script(&format!("{id}.sh"), 0, 0);
        w.add_command_agent(id, &script);
    }
    // d answers its first activity look at once, and holds every later one until the test
    // lets go: the look at the send boundary, made after the write's reservation committed.
    let gate = ActivityGate::default();
    let d_url = serve(gate.app());
    w.ok(&[
        "agent",
        "add",
        "d",
        "--provider",
        "command",
        "--set",
        &format!("url={d_url}"),
        "--set",
        &format!("activity_url={d_url}activity"),
    ]);
    let root = id_of(&w.json(&[
        "send",
        "lead",
        "a",
        "plan the release",
        "--title",
        "Release",
    ]));
    let _engine = w.spawn_engine();
    let start = Instant::now();
    while !w.dir.path().join("started").exists() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "a's turn never began"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // A finished part: c's turn on a note from a's turn returns before the cancel.
    let finished = id_of(&w.json(&["send", "a", "c", "warm up", "--parent", &root]));
    let start = Instant::now();
    while w.states().get(&finished).map(String::as_str) != Some("RETURNED") {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{:?}",
            w.states()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // A reserved part: d's write is reserved, its send boundary waits on d's activity.
    let reserved = id_of(&w.json(&["send", "a", "d", "ship it", "--parent", &root]));
    let start = Instant::now();
    while !(gate.held() && w.states().get(&reserved).map(String::as_str) == Some("SENDING")) {
        assert!(
            start.elapsed() < Duration::from_secs(30) && gate.writes() == 0,
            "d's write was never held at its send boundary: {:?}, {} writes",
            w.states(),
            gate.writes()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Below the running turn: a child and a grandchild, held while deliveries are paused.
    w.ok(&["config", "enabled", "false"]);
    let child = id_of(&w.json(&[
        "send",
        "a",
        "b",
        "write the notes",
        "--title",
        "Notes",
        "--parent",
        &root,
    ]));
    let grandchild = id_of(&w.json(&["send", "b", "c", "check the notes", "--parent", &child]));
    let cancelled = w.json(&["chain", "cancel", &root, "--note", "plan changed"]);
    assert_eq!(cancelled["chain"]["state"], "cancelled");
    // No more sends in it.
    let out = w.run(&["send", "c", "a", "more", "--parent", &grandchild]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("was cancelled"));
    // d's look answers now; deliveries on again; a's turn ends and returns its work.
    gate.open();
    w.ok(&["config", "enabled", "true"]);
    std::fs::write(&go, "").unwrap();
    w.wait_for(Duration::from_secs(30), |c| c.get("RETURNED") >= Some(&1));
    // Wait until the child and the grandchild leave the pending states (at once when they
    // were cancelled; after their writes when a cancel left them pending), then judge.
    let pending = ["WAITING", "BUSY", "HELD", "UNAVAILABLE", "SENDING"];
    let start = Instant::now();
    let states = loop {
        let states = w.states();
        let settled = [&child, &grandchild, &reserved].iter().all(|id| {
            states
                .get(*id)
                .is_some_and(|s| !pending.contains(&s.as_str()))
        });
        if settled || start.elapsed() > Duration::from_secs(30) {
            break states;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_millis(500));
    let runs = std::fs::read_to_string(&w.log).unwrap();
    let below = [&states[&child], &states[&grandchild], &states[&reserved]];
    // c ran once, for the finished part; b never; d was never written.
    let c_runs = runs.lines().filter(|l| l.ends_with(" c")).count();
    assert!(
        below.iter().all(|s| *s == "CANCELLED")
            && !runs.lines().any(|l| l.ends_with(" b"))
            && c_runs == 2
            && gate.writes() == 0,
        "chains: a delivery was written after its chain was cancelled: \
         child {}, grandchild {}, reserved {} ({} writes to d); runs:\n{runs}",
        below[0],
        below[1],
        below[2],
        gate.writes()
    );
    let set = |k: &str| -> Vec<String> {
        cancelled[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_owned())
            .collect()
    };
    assert!(
        set("cancelled").contains(&reserved) && set("marked") == vec![root.clone()],
        "chains: the cancel left a reserved write to go out: cancelled {:?}, marked {:?}",
        set("cancelled"),
        set("marked")
    );
    assert_eq!(
        set("cancelled"),
        vec![reserved.clone(), child.clone(), grandchild.clone()]
    );
    assert_eq!(set("closed_work"), vec![root.clone(), child.clone()]);
    assert_eq!(
        set("notified"),
        vec!["a", "b", "c", "d", "lead"],
        "lead's work was closed"
    );
    let states = w.states();
    assert_eq!(
        states[&root], "RETURNED",
        "the running turn was not interrupted"
    );
    assert_eq!(states[&child], "CANCELLED");
    assert_eq!(states[&grandchild], "CANCELLED");
    assert_eq!(states[&reserved], "CANCELLED");
    assert_eq!(
        states[&finished], "RETURNED",
        "the finished part is left as it was"
    );
    let c = chain(&w, &root);
    let late: Vec<&Value> = c["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["kind"] == "return")
        .collect();
    assert_eq!(late.len(), 1, "{c:#}");
    assert_eq!(
        late[0]["intent"], "notification",
        "a late return is never a turn"
    );
    assert_eq!(late[0]["recipient"], "lead");
    let notes = notifications(&c)
        .into_iter()
        .filter(|m| m["title"].as_str().unwrap_or("").contains("cancelled"))
        .count();
    assert_eq!(notes, 5, "one notification to each affected agent");
    let work = w.json(&["status", &root]);
    assert!(w.ok(&["status", &root]).contains("late"), "{work:#}");
    // A cancelled handoff is no news in its recipient's inbox; the cancel's notification is.
    let inbox = w.json(&["inbox", "b"]);
    let ids: Vec<&str> = inbox
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert!(!ids.contains(&child.as_str()), "{inbox:#}");
    assert_eq!(ids.len(), 1, "the cancel's notification: {inbox:#}");
    let all = w.json(&["inbox", "b", "--all"]);
    assert!(
        all.to_string().contains(&child),
        "history keeps it: {all:#}"
    );
}

/// A recipient's HTTP side that answers its first activity look at once ("idle") and holds
/// every later look until [`ActivityGate::open`]; it counts the writes it receives.
#[derive(Clone, Default)]
struct ActivityGate {
    looks: Arc<AtomicUsize>,
    held: Arc<AtomicBool>,
    open: Arc<AtomicBool>,
    writes: Arc<AtomicUsize>,
}

impl ActivityGate {
    fn app(&self) -> axum::Router {
        let (g, h) = (self.clone(), self.clone());
        axum::Router::new()
            .route(
                "/activity",
                axum::routing::get(move || {
                    let g = g.clone();
                    async move {
                        if g.looks.fetch_add(1, Ordering::SeqCst) > 0 {
                            g.held.store(true, Ordering::SeqCst);
                            while !g.open.load(Ordering::SeqCst) {
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                        }
                        r#"{"status":"idle"}"#
                    }
                }),
            )
            .route(
                "/",
                axum::routing::post(move || {
                    h.writes.fetch_add(1, Ordering::SeqCst);
                    async { "{}" }
                }),
            )
    }

    fn held(&self) -> bool {
        self.held.load(Ordering::SeqCst)
    }

    fn open(&self) {
        self.open.store(true, Ordering::SeqCst);
    }

    fn writes(&self) -> usize {
        self.writes.load(Ordering::SeqCst)
    }
}

/// A recipient's HTTP side that holds its first write until [`WriteGate::open`] and then
/// turns it away (409, refused); later writes are taken. It counts the writes.
#[derive(Clone, Default)]
struct WriteGate {
    held: Arc<AtomicBool>,
    open: Arc<AtomicBool>,
    writes: Arc<AtomicUsize>,
}

impl WriteGate {
    fn app(&self) -> axum::Router {
        let g = self.clone();
        axum::Router::new().route(
            "/",
            axum::routing::post(move || {
                let g = g.clone();
                async move {
                    if g.writes.fetch_add(1, Ordering::SeqCst) == 0 {
                        g.held.store(true, Ordering::SeqCst);
                        while !g.open.load(Ordering::SeqCst) {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                        return (axum::http::StatusCode::CONFLICT, r#"{"error":"refused"}"#);
                    }
                    (axum::http::StatusCode::OK, "{}")
                }
            }),
        )
    }
}

/// A write on its way when its chain is cancelled is marked and left to land; when the app
/// then turns it away, the delivery waits again, and the engine's next pass finds the cancel:
/// CANCELLED, never written a second time.
#[test]
fn a_write_on_its_way_at_the_cancel_and_turned_away_is_never_written_again() {
    let w = World::new();
    w.ok(&["agent", "add", "lead", "--provider", "demo"]);
    let gate = WriteGate::default();
    let url = serve(gate.app());
    w.ok(&[
        "agent",
        "add",
        "e",
        "--provider",
        "command",
        "--set",
        &format!("url={url}"),
    ]);
    let id = id_of(&w.json(&["send", "lead", "e", "review the patch"]));
    let _engine = w.spawn_engine();
    let start = Instant::now();
    while !gate.held.load(Ordering::SeqCst) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{:?}",
            w.states()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let cancelled = w.json(&["chain", "cancel", &id]);
    assert_eq!(
        cancelled["marked"][0].as_str(),
        Some(id.as_str()),
        "{cancelled:#}"
    );
    gate.open.store(true, Ordering::SeqCst);
    let start = Instant::now();
    let state = loop {
        let state = w.states().get(&id).cloned().unwrap_or_default();
        if state == "CANCELLED" || state == "RETURNED" || start.elapsed() > Duration::from_secs(30)
        {
            break state;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_millis(500));
    let writes = gate.writes.load(Ordering::SeqCst);
    assert!(
        writes == 1 && state == "CANCELLED",
        "chains: a write turned away after its chain was cancelled was written again \
         ({writes} writes, {state})"
    );
}

/// One wait (SPEC §8.2): `handoffs wait` returns on mail, on the cancel of the chain of the
/// turn the agent is working on, or at the timeout, and says which.
#[test]
fn one_wait_wakes_on_mail_on_the_cancel_of_the_turns_chain_and_at_the_timeout() {
    let w = World::new();
    w.ok(&["agent", "add", "lead", "--provider", "demo"]);
    w.ok(&["agent", "add", "c", "--provider", "demo"]);
    // b's turn waits, as an agent would between steps of its work.
    let out = w.dir.path().join("woke.json");
    let b = w.dir.path().join("b.sh");
    std::fs::write(
        &b,
        format!(
            "#!/bin/sh\n{bin} --json wait --as b --timeout-seconds 30 > {out}.tmp || exit 1\n\
             since=$(tr -d ' \\n' < {out}.tmp | grep -o '\"updated_at\":[0-9]*' | head -1 | cut -d: -f2)\n\
             {bin} --json wait --as b --timeout-seconds 2 --since $((since+1)) > {again}\n\
             mv {out}.tmp {out}\n",
            bin = env!("CARGO_BIN_EXE_handoffs"),
            out = out.display(),
            again = w.dir.path().join("again.json").display()
        ),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&b, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    w.add_command_agent("b", &b);
    let started = std::time::Instant::now();
    let woke = w.json(&["wait", "--as", "c", "--timeout-seconds", "1"]);
    assert_eq!(woke["woke"], "timeout");
    assert!(started.elapsed() < Duration::from_secs(10));
    w.ok(&["send", "lead", "c", "mail for c"]);
    let woke = w.json(&["wait", "--as", "c", "--timeout-seconds", "30"]);
    assert_eq!(woke["woke"], "message");
    assert_eq!(woke["messages"].as_array().map(Vec::len), Some(1));
    let out_bad = w.run(&["wait", "--as", "c", "--timeout-seconds", "0"]);
    assert_eq!(out_bad.status.code(), Some(2));

    let root = id_of(&w.json(&[
        "send",
        "lead",
        "b",
        "work that will be dropped",
        "--title",
        "Drop",
    ]));
    let _engine = w.spawn_engine();
    let start = Instant::now();
    while w.states().get(&root).map(String::as_str) != Some("RUNNING") {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "b's turn never ran"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Let b's wait begin before the cancel.
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !out.exists(),
        "b's wait returned before anything happened: {}",
        std::fs::read_to_string(&out).unwrap_or_default()
    );
    w.ok(&["chain", "cancel", &root]);
    let start = Instant::now();
    while !out.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "chains: the wait did not wake on the cancel of its turn's chain"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let woke: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(woke["woke"], "chain_cancelled", "{woke:#}");
    assert_eq!(woke["chain"]["id"], Value::String(root));
    // A second wait since that cancel is not woken by it again, only by the mail still
    // unread (the cancel's notification).
    let again: Value =
        serde_json::from_str(&std::fs::read_to_string(w.dir.path().join("again.json")).unwrap())
            .unwrap();
    assert_eq!(again["woke"], "message", "{again:#}");
    assert!(again["chain"].is_null(), "{again:#}");
}
