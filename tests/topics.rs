//! Broadcast topics (SPEC §8.2), as real processes: a publish reaches every current
//! subscriber's inbox exactly once, as a notification (never a turn); each subscriber reads
//! on from its own durable cursor; anyone registered replays from a retained position;
//! retention by count; idempotent publishes; one total order under concurrent publishers;
//! bad input is one clear line with the right exit code.

mod common;

use common::World;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::process::Stdio;

/// `handoffs topic ARGS… --json`, asserted to succeed.
fn topic(w: &World, args: &[&str]) -> Value {
    let mut all = vec!["topic"];
    all.extend_from_slice(args);
    w.json(&all)
}

/// An agent's unread inbox (all of it: up to 1000).
fn inbox(w: &World, agent: &str) -> Vec<Value> {
    w.json(&["inbox", agent, "--limit", "1000"])
        .as_array()
        .expect("the inbox is a JSON array")
        .clone()
}

/// The positions of a `topic read` answer, in the order given.
fn positions(read: &Value) -> Vec<i64> {
    read["posts"]
        .as_array()
        .expect("posts is an array")
        .iter()
        .map(|p| p["position"].as_i64().expect("a post has a position"))
        .collect()
}

/// The bodies of a `topic read` answer, in the order given.
fn bodies(read: &Value) -> Vec<String> {
    read["posts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["body"].as_str().unwrap().to_owned())
        .collect()
}

/// The strings of a JSON array, sorted.
fn sorted(v: &Value) -> Vec<String> {
    let mut out: Vec<String> = v
        .as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect();
    out.sort();
    out
}

/// The topic named `name` in `topic list --json`.
fn listed(w: &World, name: &str) -> Value {
    let list = topic(w, &["list"]);
    let found: Vec<&Value> = list
        .as_array()
        .expect("topic list is an array")
        .iter()
        .filter(|t| t["name"] == name)
        .collect();
    assert_eq!(found.len(), 1, "one topic {name} listed: {list:#}");
    found[0].clone()
}

/// Runs `args`, asserts exit `code`, a one-line stderr without a panic, and empty stdout;
/// returns the stderr line.
/// `handoffs --json topic publish TOPIC FROM -` with `text` on stdin.
fn publish_stdin(w: &World, topic: &str, from: &str, text: &str) -> std::process::Output {
    let mut child = w
        .cmd()
        .args(["--json", "topic", "publish", topic, from, "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn fails(w: &World, args: &[&str], code: i32) -> String {
    let out = w.run(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(code),
        "handoffs {args:?}: expected exit {code}; stdout {:?}, stderr {stderr:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        !stderr.contains("panicked") && !stderr.contains("RUST_BACKTRACE"),
        "handoffs {args:?} panicked: {stderr}"
    );
    let lines: Vec<&str> = stderr.trim_end().lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "handoffs {args:?}: one error line expected, got {stderr:?}"
    );
    assert!(
        !lines[0].trim().is_empty(),
        "handoffs {args:?}: empty error"
    );
    lines[0].to_owned()
}

fn add_agents(w: &World, ids: &[&str]) {
    for id in ids {
        w.ok(&["agent", "add", id, "--provider", "demo"]);
    }
}

/// Nothing queued, in flight or needing attention, and no delivery counted at all.
fn assert_no_deliveries(w: &World) {
    let s = w.json(&["status"]);
    for section in ["queued", "in_flight", "needs_attention", "recent"] {
        assert_eq!(
            s[section].as_array().map(Vec::len),
            Some(0),
            "status {section} must be empty (a topic notification is never a turn): {s:#}"
        );
    }
    assert_eq!(
        s["counts"].as_array().map(Vec::len),
        Some(0),
        "no delivery counted: {s:#}"
    );
}

#[test]
#[allow(clippy::many_single_char_names)]
fn a_publish_reaches_each_subscriber_once_as_a_notification_and_reads_on_from_the_cursor() {
    let w = World::new();
    add_agents(&w, &["pub", "s1", "s2", "bystander"]);

    let c = topic(&w, &["create", "news"]);
    assert_eq!(c["created"], true);
    assert_eq!(c["topic"]["name"], "news");
    assert_eq!(c["topic"]["keep_count"], 1000);
    assert_eq!(c["topic"]["keep_minutes"], 10080);
    assert_eq!(c["topic"]["last_position"], 0);
    assert!(c["topic"]["created_at"].as_i64().unwrap() > 0);

    // Creating it again is not an error, and changes nothing without flags.
    let again = topic(&w, &["create", "news"]);
    assert_eq!(again["created"], false);
    assert_eq!(again["topic"]["keep_count"], 1000);
    assert_eq!(again["topic"]["keep_minutes"], 10080);

    for s in ["s1", "s2"] {
        let sub = topic(&w, &["subscribe", "news", s]);
        assert_eq!(sub["topic"], "news");
        assert_eq!(sub["agent"], s);
        assert_eq!(sub["cursor"], 0);
        assert_eq!(sub["new"], true);
    }
    let l = listed(&w, "news");
    assert_eq!(sorted(&l["subscribers"]), ["s1", "s2"]);
    assert_eq!(l["last_position"], 0);
    assert_eq!(l["retained"], 0);
    assert_eq!(l["oldest_position"], Value::Null);

    let mut message_ids = BTreeSet::new();
    for (i, text) in ["first post", "second post"].iter().enumerate() {
        let p = topic(&w, &["publish", "news", "pub", text]);
        assert_eq!(p["topic"], "news");
        assert_eq!(p["position"], Value::from(i + 1));
        assert_eq!(p["publisher"], "pub");
        assert_eq!(p["repeated"], false);
        assert_eq!(
            sorted(&p["notified"]),
            ["s1", "s2"],
            "topics: publish #{} did not reach every subscriber (s1, s2) once",
            i + 1
        );
        let msgs = p["messages"].as_array().unwrap();
        assert_eq!(msgs.len(), 2, "one message per subscriber: {p:#}");
        for m in msgs {
            assert!(message_ids.insert(m.as_str().unwrap().to_owned()));
        }
    }

    // Each subscriber: exactly one notification per post, titled NAME #POSITION, from the
    // publisher, carrying the text.
    let mut inbox_ids = BTreeSet::new();
    for s in ["s1", "s2"] {
        let msgs = inbox(&w, s);
        assert_eq!(msgs.len(), 2, "{s}: two notifications: {msgs:#?}");
        let mut by_title: BTreeMap<String, &Value> = BTreeMap::new();
        for m in &msgs {
            assert_eq!(m["intent"], "notification", "{m:#}");
            assert_eq!(m["sender"], "pub");
            assert_eq!(m["recipient"], s);
            inbox_ids.insert(m["id"].as_str().unwrap().to_owned());
            assert!(
                by_title
                    .insert(m["title"].as_str().unwrap().to_owned(), m)
                    .is_none(),
                "{s}: a title twice: {msgs:#?}"
            );
        }
        assert_eq!(
            by_title.keys().collect::<Vec<_>>(),
            ["news #1", "news #2"],
            "{s}"
        );
        assert!(
            by_title["news #1"]["body"]
                .as_str()
                .unwrap()
                .contains("first post")
        );
        assert!(
            by_title["news #2"]["body"]
                .as_str()
                .unwrap()
                .contains("second post")
        );
    }
    assert_eq!(
        inbox_ids, message_ids,
        "the publishes named the messages the inboxes hold"
    );
    assert!(
        inbox(&w, "bystander").is_empty(),
        "a non-subscriber is told nothing"
    );
    assert!(
        inbox(&w, "pub").is_empty(),
        "a publisher that does not subscribe is told nothing"
    );

    // `read ID` shows one notification and marks it read.
    let one = inbox(&w, "s1")[0]["id"].as_str().unwrap().to_owned();
    let shown = w.json(&["read", &one, "--as", "s1"]);
    assert_eq!(shown["id"], Value::String(one.clone()));
    assert_eq!(shown["intent"], "notification");
    assert_eq!(inbox(&w, "s1").len(), 1, "read marked it read");

    // Reading on from the cursor: both posts in order, then nothing new.
    let r = topic(&w, &["read", "news", "s1"]);
    assert_eq!(r["topic"], "news");
    assert_eq!(r["agent"], "s1");
    assert_eq!(positions(&r), [1, 2]);
    assert_eq!(bodies(&r), ["first post", "second post"]);
    for p in r["posts"].as_array().unwrap() {
        assert_eq!(p["publisher"], "pub");
        assert!(p["created_at"].as_i64().unwrap() > 0);
    }
    assert_eq!(r["cursor"], 2);
    assert_eq!(r["skipped"], 0);
    assert_eq!(r["more"], false);
    let r = topic(&w, &["read", "news", "s1"]);
    assert_eq!(positions(&r), Vec::<i64>::new(), "nothing new: {r:#}");
    assert_eq!(r["cursor"], 2);
    assert_eq!(r["more"], false);
    // Cursors are per subscriber: s2 has read nothing yet.
    let r = topic(&w, &["read", "news", "s2", "--limit", "1"]);
    assert_eq!(positions(&r), [1]);
    assert_eq!(r["cursor"], 1);
    assert_eq!(r["more"], true);
    let r = topic(&w, &["read", "news", "s2"]);
    assert_eq!(positions(&r), [2]);
    assert_eq!(r["more"], false);

    // A publisher that subscribes is told of its own post too; a post read from stdin.
    topic(&w, &["subscribe", "news", "pub"]);
    let out = publish_stdin(&w, "news", "pub", "third, from stdin");
    assert!(
        out.status.success(),
        "publish -: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let p: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(p["position"], 3);
    assert_eq!(sorted(&p["notified"]), ["pub", "s1", "s2"]);
    let own = inbox(&w, "pub");
    assert_eq!(own.len(), 1);
    assert_eq!(own[0]["title"], "news #3");
    assert!(
        own[0]["body"]
            .as_str()
            .unwrap()
            .contains("third, from stdin")
    );
    let r = topic(&w, &["read", "news", "s1"]);
    assert_eq!(positions(&r), [3]);
    assert_eq!(bodies(&r), ["third, from stdin"]);
    assert!(inbox(&w, "bystander").is_empty());

    // Never a delivery: nothing queued or in flight, and a pass of the engine delivers
    // nothing for it.
    assert_no_deliveries(&w);
    let tick = w.json(&["tick"]);
    assert_eq!(tick["writes"], 0, "{tick:#}");
    assert_eq!(tick["errors"].as_array().map(Vec::len), Some(0), "{tick:#}");
    assert_no_deliveries(&w);
    assert_eq!(inbox(&w, "s2").len(), 3, "the notifications stay unread");
    let l = listed(&w, "news");
    assert_eq!(l["last_position"], 3);
    assert_eq!(l["retained"], 3);
    assert_eq!(l["oldest_position"], 1);
}

#[test]
fn a_late_subscriber_reads_only_later_posts_unless_it_asks_for_history() {
    let w = World::new();
    add_agents(&w, &["pub", "early", "late", "historian"]);
    topic(&w, &["create", "t.log-1_x"]);
    topic(&w, &["subscribe", "t.log-1_x", "early"]);
    for text in ["one", "two", "three"] {
        topic(&w, &["publish", "t.log-1_x", "pub", text]);
    }

    let sub = topic(&w, &["subscribe", "t.log-1_x", "late"]);
    assert_eq!(sub["new"], true);
    assert_eq!(sub["cursor"], 3, "starts at the newest position");
    let r = topic(&w, &["read", "t.log-1_x", "late"]);
    assert_eq!(positions(&r), Vec::<i64>::new(), "nothing before it: {r:#}");
    assert_eq!(r["cursor"], 3);
    assert!(inbox(&w, "late").is_empty(), "not told of earlier posts");

    let hist = topic(&w, &["subscribe", "t.log-1_x", "historian", "--history"]);
    assert_eq!(hist["new"], true);

    let p = topic(&w, &["publish", "t.log-1_x", "pub", "four"]);
    assert_eq!(p["position"], 4);
    assert_eq!(sorted(&p["notified"]), ["early", "historian", "late"]);

    let r = topic(&w, &["read", "t.log-1_x", "late"]);
    assert_eq!(positions(&r), [4]);
    assert_eq!(bodies(&r), ["four"]);
    assert_eq!(r["cursor"], 4);
    let told = inbox(&w, "late");
    assert_eq!(told.len(), 1);
    assert_eq!(told[0]["title"], "t.log-1_x #4");

    // --history: the retained older posts too, oldest first.
    let r = topic(&w, &["read", "t.log-1_x", "historian"]);
    assert_eq!(positions(&r), [1, 2, 3, 4]);
    assert_eq!(bodies(&r), ["one", "two", "three", "four"]);
    assert_eq!(r["cursor"], 4);
    assert_eq!(r["skipped"], 0);
    assert_eq!(
        inbox(&w, "historian").len(),
        1,
        "told only of the later post"
    );

    let r = topic(&w, &["read", "t.log-1_x", "early"]);
    assert_eq!(positions(&r), [1, 2, 3, 4]);
    assert_eq!(inbox(&w, "early").len(), 4);

    // Subscribing again keeps the cursor (also with --history).
    let again = topic(&w, &["subscribe", "t.log-1_x", "late"]);
    assert_eq!(again["new"], false);
    assert_eq!(again["cursor"], 4);
    let again = topic(&w, &["subscribe", "t.log-1_x", "historian", "--history"]);
    assert_eq!(again["new"], false);
    assert_eq!(
        again["cursor"], 4,
        "--history does not rewind a subscription"
    );
    let r = topic(&w, &["read", "t.log-1_x", "historian"]);
    assert_eq!(positions(&r), Vec::<i64>::new());

    // Unsubscribing: told of nothing more, no cursor to read on from.
    let u = topic(&w, &["unsubscribe", "t.log-1_x", "late"]);
    assert_eq!(u["topic"], "t.log-1_x");
    assert_eq!(u["agent"], "late");
    assert_eq!(u["removed"], true);
    let u = topic(&w, &["unsubscribe", "t.log-1_x", "late"]);
    assert_eq!(u["removed"], false);
    let p = topic(&w, &["publish", "t.log-1_x", "pub", "five"]);
    assert_eq!(p["position"], 5);
    assert_eq!(sorted(&p["notified"]), ["early", "historian"]);
    assert_eq!(
        inbox(&w, "late").len(),
        1,
        "nothing new for an ex-subscriber"
    );
    fails(&w, &["topic", "read", "t.log-1_x", "late"], 1);
    assert_eq!(
        sorted(&listed(&w, "t.log-1_x")["subscribers"]),
        ["early", "historian"]
    );
}

#[test]
#[allow(clippy::many_single_char_names)]
fn replay_skips_what_retention_dropped_and_never_moves_a_cursor_back() {
    let w = World::new();
    add_agents(&w, &["pub", "sub", "reader", "newcomer"]);
    let c = topic(
        &w,
        &["create", "ring", "--keep", "3", "--keep-minutes", "60"],
    );
    assert_eq!(c["created"], true);
    assert_eq!(c["topic"]["keep_count"], 3);
    assert_eq!(c["topic"]["keep_minutes"], 60);
    topic(&w, &["subscribe", "ring", "sub"]);
    for i in 1..=5 {
        let p = topic(&w, &["publish", "ring", "pub", &format!("post {i}")]);
        assert_eq!(p["position"], i);
    }
    let l = listed(&w, "ring");
    assert_eq!(l["keep_count"], 3);
    assert_eq!(l["keep_minutes"], 60);
    assert_eq!(l["last_position"], 5);
    assert_eq!(l["retained"], 3);
    assert_eq!(l["oldest_position"], 3);

    // Anyone registered may replay; what is no longer kept is skipped and counted.
    let r = topic(&w, &["read", "ring", "reader", "--from", "1"]);
    assert_eq!(positions(&r), [3, 4, 5], "{r:#}");
    assert_eq!(bodies(&r), ["post 3", "post 4", "post 5"]);
    assert_eq!(r["skipped"], 2);
    assert_eq!(r["more"], false);
    let r = topic(&w, &["read", "ring", "reader", "--from", "4"]);
    assert_eq!(positions(&r), [4, 5]);
    assert_eq!(r["skipped"], 0);
    let r = topic(
        &w,
        &["read", "ring", "reader", "--from", "1", "--limit", "2"],
    );
    assert_eq!(positions(&r), [3, 4]);
    assert_eq!(r["skipped"], 2);
    assert_eq!(r["more"], true);

    // The subscriber's own read also skips what retention dropped.
    let r = topic(&w, &["read", "ring", "sub"]);
    assert_eq!(positions(&r), [3, 4, 5], "{r:#}");
    assert_eq!(r["skipped"], 2);
    assert_eq!(r["cursor"], 5);
    // The subscriber got all five notifications (retention is about posts, not inboxes).
    assert_eq!(inbox(&w, "sub").len(), 5);

    // A replay does not move the cursor back.
    let r = topic(&w, &["read", "ring", "sub", "--from", "1"]);
    assert_eq!(positions(&r), [3, 4, 5]);
    assert_eq!(r["cursor"], 5, "the cursor only moves forward: {r:#}");
    let r = topic(&w, &["read", "ring", "sub"]);
    assert_eq!(positions(&r), Vec::<i64>::new(), "nothing new: {r:#}");
    assert_eq!(r["cursor"], 5);

    // --history starts at the oldest retained post.
    topic(&w, &["subscribe", "ring", "newcomer", "--history"]);
    let r = topic(&w, &["read", "ring", "newcomer"]);
    assert_eq!(positions(&r), [3, 4, 5], "{r:#}");

    // Creating again with --keep changes the retention; it applies from the next publish.
    let c = topic(&w, &["create", "ring", "--keep", "2"]);
    assert_eq!(c["created"], false);
    assert_eq!(c["topic"]["keep_count"], 2);
    assert_eq!(c["topic"]["keep_minutes"], 60, "unchanged when not given");
    assert_eq!(c["topic"]["last_position"], 5);
    let p = topic(&w, &["publish", "ring", "pub", "post 6"]);
    assert_eq!(p["position"], 6);
    let r = topic(&w, &["read", "ring", "reader", "--from", "1"]);
    assert_eq!(positions(&r), [5, 6], "{r:#}");
    assert_eq!(r["skipped"], 4);
    let l = listed(&w, "ring");
    assert_eq!(l["retained"], 2);
    assert_eq!(l["oldest_position"], 5);
    let c = topic(&w, &["create", "ring", "--keep-minutes", "525600"]);
    assert_eq!(c["topic"]["keep_count"], 2);
    assert_eq!(c["topic"]["keep_minutes"], 525_600);
    // The bounds themselves are accepted.
    let c = topic(
        &w,
        &["create", "big", "--keep", "100000", "--keep-minutes", "1"],
    );
    assert_eq!(c["topic"]["keep_count"], 100_000);
    assert_eq!(c["topic"]["keep_minutes"], 1);
}

#[test]
fn a_repeated_key_returns_the_first_post_and_tells_nobody_again() {
    let w = World::new();
    add_agents(&w, &["pub", "other", "s1", "s2"]);
    topic(&w, &["create", "keyed"]);
    topic(&w, &["create", "elsewhere"]);
    topic(&w, &["subscribe", "keyed", "s1"]);
    topic(&w, &["subscribe", "keyed", "s2"]);
    topic(&w, &["subscribe", "elsewhere", "s1"]);

    let first = topic(
        &w,
        &[
            "publish",
            "keyed",
            "pub",
            "the build is green",
            "--key",
            "k1",
        ],
    );
    assert_eq!(first["position"], 1);
    assert_eq!(first["repeated"], false);
    assert_eq!(sorted(&first["notified"]), ["s1", "s2"]);
    assert_eq!(first["messages"].as_array().unwrap().len(), 2);

    let again = topic(
        &w,
        &[
            "publish",
            "keyed",
            "pub",
            "the build is green",
            "--key",
            "k1",
        ],
    );
    assert_eq!(again["topic"], "keyed");
    assert_eq!(again["position"], 1, "the first post: {again:#}");
    assert_eq!(again["publisher"], "pub");
    assert_eq!(again["repeated"], true, "{again:#}");
    // The same key with another text is refused, as a send's is (SPEC §5).
    let err = fails(
        &w,
        &[
            "topic",
            "publish",
            "keyed",
            "pub",
            "a different text",
            "--key",
            "k1",
        ],
        1,
    );
    assert!(
        err.contains("key \"k1\" was published on keyed before (#1) with another message"),
        "{err}"
    );
    for s in ["s1", "s2"] {
        let msgs = inbox(&w, s);
        assert_eq!(msgs.len(), 1, "{s}: told once: {msgs:#?}");
        assert_eq!(msgs[0]["title"], "keyed #1");
    }
    let l = listed(&w, "keyed");
    assert_eq!(l["last_position"], 1);
    assert_eq!(l["retained"], 1);
    let r = topic(&w, &["read", "keyed", "s1"]);
    assert_eq!(positions(&r), [1]);
    assert_eq!(bodies(&r), ["the build is green"]);

    // The key belongs to the topic and the publisher: another publisher, or another
    // topic, with the same key is a new post.
    let p = topic(&w, &["publish", "keyed", "other", "mine", "--key", "k1"]);
    assert_eq!(p["position"], 2);
    assert_eq!(p["repeated"], false);
    let p = topic(&w, &["publish", "elsewhere", "pub", "there", "--key", "k1"]);
    assert_eq!(p["position"], 1);
    assert_eq!(p["repeated"], false);
    assert_eq!(sorted(&p["notified"]), ["s1"]);
    // A new key is a new post.
    let p = topic(&w, &["publish", "keyed", "pub", "again", "--key", "k2"]);
    assert_eq!(p["position"], 3);
    assert_eq!(p["repeated"], false);
    let titles: BTreeSet<String> = inbox(&w, "s2")
        .iter()
        .map(|m| m["title"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        titles,
        ["keyed #1", "keyed #2", "keyed #3"]
            .map(str::to_owned)
            .into_iter()
            .collect()
    );
    assert_eq!(inbox(&w, "s1").len(), 4, "three on keyed, one on elsewhere");
    assert_no_deliveries(&w);
}

#[test]
fn concurrent_publishers_make_one_total_order_and_every_subscriber_is_told_once_per_post() {
    const PUBLISHERS: usize = 8;
    const EACH: usize = 10;
    const TOTAL: i64 = 80;
    const _: () = assert!(PUBLISHERS * EACH == 80);
    let total = usize::try_from(TOTAL).unwrap();
    let w = World::new();
    let publishers: Vec<String> = (1..=PUBLISHERS).map(|i| format!("p{i}")).collect();
    let subscribers = ["s1", "s2", "s3"];
    for p in &publishers {
        add_agents(&w, &[p]);
    }
    add_agents(&w, &subscribers);
    topic(&w, &["create", "busy"]);
    for s in subscribers {
        topic(&w, &["subscribe", "busy", s]);
    }

    let barrier = std::sync::Barrier::new(PUBLISHERS);
    // publisher → the positions its publishes got, in the order it made them.
    let got: Vec<(String, Vec<(i64, String)>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = publishers
            .iter()
            .map(|p| {
                let (w, barrier) = (&w, &barrier);
                scope.spawn(move || {
                    barrier.wait();
                    let mut mine = Vec::new();
                    for i in 0..EACH {
                        let text = format!("{p} says {i}");
                        let out = w.run(&["--json", "topic", "publish", "busy", p, &text]);
                        assert!(
                            out.status.success(),
                            "concurrent publish {text:?} failed ({:?}): {}",
                            out.status.code(),
                            String::from_utf8_lossy(&out.stderr)
                        );
                        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
                        assert_eq!(v["repeated"], false);
                        assert_eq!(sorted(&v["notified"]), ["s1", "s2", "s3"], "{text}: {v:#}");
                        mine.push((v["position"].as_i64().unwrap(), text));
                    }
                    (p.clone(), mine)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });

    // One total order: every position 1..=TOTAL given once, rising within each publisher.
    let mut expected: BTreeMap<i64, (String, String)> = BTreeMap::new();
    for (p, mine) in &got {
        assert!(
            mine.windows(2).all(|a| a[0].0 < a[1].0),
            "{p}'s positions do not rise: {mine:?}"
        );
        for (pos, text) in mine {
            let dup = expected.insert(*pos, (p.clone(), text.clone()));
            assert!(
                dup.is_none(),
                "position {pos} given twice: {dup:?} and {text}"
            );
        }
    }
    assert_eq!(
        expected.keys().copied().collect::<Vec<_>>(),
        (1..=TOTAL).collect::<Vec<_>>()
    );
    let l = listed(&w, "busy");
    assert_eq!(l["last_position"], TOTAL);
    assert_eq!(l["retained"], TOTAL);

    for s in subscribers {
        // Exactly one notification per position, from that post's publisher, with its text.
        let msgs = inbox(&w, s);
        assert_eq!(msgs.len(), total, "{s}: one per post");
        let mut seen = BTreeSet::new();
        for m in &msgs {
            assert_eq!(m["intent"], "notification");
            let title = m["title"].as_str().unwrap();
            let pos: i64 = title
                .strip_prefix("busy #")
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{s}: title {title:?} is not \"busy #N\""));
            assert!(seen.insert(pos), "{s}: told twice of #{pos}");
            let (publisher, text) = &expected[&pos];
            assert_eq!(m["sender"], publisher.as_str(), "{s} #{pos}");
            assert!(
                m["body"].as_str().unwrap().contains(text.as_str()),
                "{s} #{pos}: body {:?} lacks {text:?}",
                m["body"]
            );
        }
        assert_eq!(seen, (1..=TOTAL).collect::<BTreeSet<_>>(), "{s}");

        // Reading on: 1..=TOTAL in order, each once, in two pages of the default 50.
        let r1 = topic(&w, &["read", "busy", s]);
        assert_eq!(positions(&r1), (1..=50).collect::<Vec<_>>(), "{s}");
        assert_eq!(r1["more"], true);
        assert_eq!(r1["cursor"], 50);
        let r2 = topic(&w, &["read", "busy", s]);
        assert_eq!(positions(&r2), (51..=TOTAL).collect::<Vec<_>>(), "{s}");
        assert_eq!(r2["more"], false);
        assert_eq!(r2["cursor"], TOTAL);
        let mut pairs = BTreeSet::new();
        for post in r1["posts"]
            .as_array()
            .unwrap()
            .iter()
            .chain(r2["posts"].as_array().unwrap())
        {
            let pos = post["position"].as_i64().unwrap();
            let pair = (
                post["publisher"].as_str().unwrap().to_owned(),
                post["body"].as_str().unwrap().to_owned(),
            );
            assert_eq!(pair, expected[&pos], "{s}: post #{pos}");
            assert!(pairs.insert(pair), "{s}: a post twice");
        }
        assert_eq!(pairs.len(), total);
        let r3 = topic(&w, &["read", "busy", s]);
        assert_eq!(positions(&r3), Vec::<i64>::new());
    }
    assert_no_deliveries(&w);
}

#[test]
fn bad_input_is_one_line_with_the_right_exit_code_and_writes_nothing() {
    let w = World::new();
    add_agents(&w, &["pub", "sub", "stranger"]);
    topic(&w, &["create", "real"]);
    topic(&w, &["subscribe", "real", "sub"]);
    topic(&w, &["publish", "real", "pub", "kept"]);

    // Unknown topic: exit 1.
    for args in [
        &["topic", "publish", "nope", "pub", "x"][..],
        &["topic", "read", "nope", "sub"],
        &["topic", "read", "nope", "sub", "--from", "1"],
        &["topic", "subscribe", "nope", "sub"],
        &["topic", "unsubscribe", "nope", "sub"],
    ] {
        let line = fails(&w, args, 1);
        assert!(line.contains("nope"), "{args:?}: names the topic: {line}");
    }
    // Unknown agent: exit 1.
    for args in [
        &["topic", "publish", "real", "ghost", "boo"][..],
        &["topic", "subscribe", "real", "ghost"],
        &["topic", "read", "real", "ghost", "--from", "1"],
    ] {
        let line = fails(&w, args, 1);
        assert!(line.contains("ghost"), "{args:?}: names the agent: {line}");
    }
    // A registered non-subscriber has no cursor to read on from.
    fails(&w, &["topic", "read", "real", "stranger"], 1);

    // Invalid names and out-of-range flags: usage, exit 2.
    let long = "n".repeat(65);
    for args in [
        &["topic", "create", "bad name"][..],
        &["topic", "create", ""],
        &["topic", "create", &long],
        &["topic", "create", "slash/name"],
        &["topic", "create", "ok", "--keep", "0"],
        &["topic", "create", "ok", "--keep", "100001"],
        &["topic", "create", "ok", "--keep", "-1"],
        &["topic", "create", "ok", "--keep-minutes", "0"],
        &["topic", "create", "ok", "--keep-minutes", "525601"],
        &["topic", "create", "real", "--keep", "0"],
        &["topic", "read", "real", "sub", "--limit", "0"],
        &["topic", "read", "real", "sub", "--limit", "1001"],
    ] {
        fails(&w, args, 2);
    }
    // A name of exactly 64 allowed characters is fine.
    let max = "a.b_c-D9".repeat(8);
    assert_eq!(topic(&w, &["create", &max])["created"], true);

    // Nothing was written by any of them.
    let list = topic(&w, &["list"]);
    let mut names: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    names.sort_unstable();
    assert_eq!(names, [max.as_str(), "real"], "{list:#}");
    let l = listed(&w, "real");
    assert_eq!(l["last_position"], 1, "the failed publishes left nothing");
    assert_eq!(l["keep_count"], 1000, "--keep 0 changed nothing");
    assert_eq!(sorted(&l["subscribers"]), ["sub"]);
    let msgs = inbox(&w, "sub");
    assert_eq!(msgs.len(), 1, "{msgs:#?}");
    assert_eq!(msgs[0]["title"], "real #1");
    let r = topic(&w, &["read", "real", "sub"]);
    assert_eq!(positions(&r), [1], "--limit 0 did not move the cursor");
}

#[test]
fn an_invalid_name_is_a_usage_error_on_every_topic_command() {
    let w = World::new();
    add_agents(&w, &["pub", "sub"]);
    for args in [
        &["topic", "publish", "bad name", "pub", "x"][..],
        &["topic", "subscribe", "bad name", "sub"],
        &["topic", "unsubscribe", "bad name", "sub"],
        &["topic", "read", "bad name", "sub", "--from", "1"],
    ] {
        fails(&w, args, 2);
    }
}

/// A replay that starts past a subscriber's cursor does not move it over posts it never
/// read; one that starts at or before the cursor moves it on to where it got.
#[test]
fn a_replay_past_the_cursor_leaves_it_where_it_was() {
    let w = World::new();
    add_agents(&w, &["pub", "s1"]);
    topic(&w, &["create", "news"]);
    topic(&w, &["subscribe", "news", "s1"]);
    for i in 1..=5 {
        topic(&w, &["publish", "news", "pub", &format!("post {i}")]);
    }
    let far = topic(&w, &["read", "news", "s1", "--from", "99999"]);
    assert_eq!(positions(&far), Vec::<i64>::new());
    assert_eq!(far["cursor"], 0, "{far:#}");
    let late = topic(&w, &["read", "news", "s1", "--from", "4", "--limit", "1"]);
    assert_eq!(positions(&late), [4]);
    assert_eq!(late["cursor"], 0, "a replay past the cursor: {late:#}");
    let from_start = topic(&w, &["read", "news", "s1", "--from", "1", "--limit", "2"]);
    assert_eq!(positions(&from_start), [1, 2]);
    assert_eq!(from_start["cursor"], 2, "{from_start:#}");
    let on = topic(&w, &["read", "news", "s1"]);
    assert_eq!(
        positions(&on),
        [3, 4, 5],
        "every post read once from the cursor"
    );
}

/// A subscriber the publisher may not reach (a blocked connection) is not told, and says
/// so; a removed agent's subscriptions go with it, so the id added again starts afresh.
#[test]
fn blocked_subscribers_are_not_told_and_removed_agents_unsubscribe() {
    let w = World::new();
    add_agents(&w, &["pub", "s1", "s2"]);
    topic(&w, &["create", "news"]);
    topic(&w, &["subscribe", "news", "s1"]);
    topic(&w, &["subscribe", "news", "s2"]);
    w.ok(&["block", "pub", "s2"]);
    let p = topic(&w, &["publish", "news", "pub", "hello"]);
    assert_eq!(sorted(&p["notified"]), ["s1"], "{p:#}");
    assert_eq!(sorted(&p["withheld"]), ["s2"], "{p:#}");
    assert!(inbox(&w, "s2").is_empty(), "a blocked publisher reached s2");
    w.ok(&["agent", "remove", "s1"]);
    assert_eq!(sorted(&listed(&w, "news")["subscribers"]), ["s2"]);
    w.ok(&["agent", "add", "s1", "--provider", "demo"]);
    fails(&w, &["topic", "read", "news", "s1"], 1);
}

#[test]
fn more_bad_publishes_and_reads_fail_with_usage_errors() {
    let w = World::new();
    add_agents(&w, &["pub", "s1"]);
    topic(&w, &["create", "news"]);
    topic(&w, &["subscribe", "news", "s1"]);
    let key = "k".repeat(201);
    for args in [
        vec!["topic", "read", "news", "s1", "--from", "0"],
        vec!["topic", "read", "news", "s1", "--from", "-3"],
        vec!["topic", "publish", "news", "pub", "   "],
        vec![
            "topic",
            "publish",
            "news",
            "pub",
            "ok",
            "--key",
            key.as_str(),
        ],
    ] {
        fails(&w, &args, 2);
    }
    // A post past the limit (from stdin: one argument cannot hold it) is refused; one at
    // the limit reaches its subscriber whole, its notification no longer than the post.
    let publish = |text: &str| publish_stdin(&w, "news", "pub", text);
    let out = publish(&"x".repeat(200_001));
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        listed(&w, "news")["last_position"],
        0,
        "nothing was published"
    );
    let out = publish(&"y".repeat(200_000));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let p: Value = serde_json::from_slice(&out.stdout).unwrap();
    let told = w.json(&["read", p["messages"][0].as_str().unwrap(), "--as", "s1"]);
    let body = told["message"]["body"]
        .as_str()
        .or_else(|| told["body"].as_str())
        .unwrap();
    assert_eq!(body.len(), 200_000);
}

/// A topic's subscribers are bounded (a publish tells each in one transaction): past the
/// configured most, a subscribe is refused with one line, and leaving makes room again.
#[test]
fn a_topic_takes_no_more_subscribers_than_its_most() {
    let w = World::new();
    for a in ["s1", "s2", "s3"] {
        w.ok(&["agent", "add", a, "--provider", "demo"]);
    }
    w.ok(&["topic", "create", "busy"]);
    w.ok(&["config", "topicSubscribersMax", "2"]);
    topic(&w, &["subscribe", "busy", "s1"]);
    topic(&w, &["subscribe", "busy", "s2"]);
    let refused = fails(&w, &["topic", "subscribe", "busy", "s3"], 1);
    assert!(
        refused.contains("topic busy has 2 subscribers, its most"),
        "{refused}"
    );
    // Subscribing again is no new subscriber.
    assert_eq!(topic(&w, &["subscribe", "busy", "s2"])["new"], false);
    topic(&w, &["unsubscribe", "busy", "s1"]);
    assert_eq!(topic(&w, &["subscribe", "busy", "s3"])["new"], true);
    let bad = fails(&w, &["config", "topicSubscribersMax", "0"], 2);
    assert!(bad.contains("from 1 to 10000"), "{bad}");
}
