//! The oracle: one function per guarantee of SPEC §3, each judging a finished run from plain
//! rows (what the engine stored) and the agents' own records (what the recipients saw), against
//! the numbers SPEC promises (`Policy::default()`), never the policy the engine ran with. Each
//! verdict says how many times its check was exercised, so a check that had nothing to judge
//! says so instead of passing silently.
//!
//! It must never read the engine's memory or the database: the runner hands it rows.

use crate::agent::{HostKind, short};
use model::Policy;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::Duration;

/// How long after a provider outage begins a correct engine may still reserve an attempt: the
/// guard's 60 s cache and 5 s timeout (SPEC §2.2 step 6), then the activity check of step 7,
/// which may take up to its 30 s request timeout before the reservation of step 8.
pub const GUARD_LAG: Duration = Duration::from_secs(100);
/// The simulation's step. Within one step each host keeps its own clock, so two hosts may
/// date the same moment up to one step apart: the oracle never orders events of two hosts
/// closer than that.
pub const TICK: Duration = Duration::from_millis(500);
/// How late a reminder may be: the engine's housekeeping runs at least once a minute.
pub const REMINDER_LAG: Duration = Duration::from_secs(120);
/// A write may reach a session whose turn began this shortly before it: the send boundary's
/// check and the write are a few network hops apart. A host that refuses busy writes refuses
/// it (no harm). A Codex-like or Claude-like host takes it (folded, or forked): that is
/// forgiven only when the turn began after the engine's last look said idle, the one race a
/// check-then-write over the command protocol cannot close (the real codex adapter closes it
/// by writing through Codex's queue; a Claude session offers no such precondition).
pub const BUSY_RACE: Duration = Duration::from_secs(5);
/// The answer of an app that checks its session as it writes and finds it busy (423 Locked):
/// nothing was written, and the delivery waits (SPEC §4).
pub const BUSY_AT_WRITE: u16 = 423;
/// The least time between two writes of one request id that its app turned away busy: the
/// engine's first backoff (half a second), less the network's jitter.
pub const BUSY_AGAIN_MIN: Duration = Duration::from_millis(400);

/// One delivery as stored at the end of the run.
#[derive(Clone, Debug, Default)]
pub struct DeliveryRow {
    pub id: String,
    pub recipient: String,
    /// The state, in capitals.
    pub state: String,
    /// Every request id of the delivery, oldest first; the last is the current one.
    pub request_ids: Vec<String>,
    /// The refusals counted in its current series (two end it FAILED, never delivered).
    pub refusals: u32,
    pub error_resends: u32,
    pub interrupt_resends: u32,
    /// FAILED with a resend still planned.
    pub resend_pending: bool,
    /// UNCERTAIN after an exact receipt (only a person can release it).
    pub had_receipt: bool,
    /// UNAVAILABLE because its destination changed since it was queued.
    pub destination_changed: bool,
    /// The recipient is registered again where this delivery was queued (by its record's
    /// frozen route): an UNAVAILABLE for a changed destination no longer has its reason.
    pub destination_restored: bool,
    /// CANCELLED by history scans: how many empty scans, from the first to the last.
    pub cancelled_by_scans: Option<(u32, Duration)>,
}

/// One line of the engine's event history about a delivery.
#[derive(Clone, Debug)]
pub struct EventRow {
    pub at: Duration,
    pub message: String,
    /// `delivery` (enrolled), `state` (moved), `release`, …
    pub kind: String,
    pub detail: String,
}

/// One write a host received.
#[derive(Clone, Debug)]
pub struct WriteRow {
    pub host: String,
    pub write: crate::agent::Received,
}

/// A handoff the driver sent, and the host its recipient was registered at in that instant.
#[derive(Clone, Debug)]
pub struct SentRow {
    pub id: String,
    pub host: String,
}

/// A piece of work with a due time.
#[derive(Clone, Debug)]
pub struct WorkRow {
    pub id: String,
    pub due_at: Duration,
    /// When it was first returned (or closed by its chain's cancel), if it was.
    pub returned_at: Option<Duration>,
    /// When each reminder was sent.
    pub reminders: Vec<Duration>,
    /// Reminders that got a delivery (a reminder must never wake anyone).
    pub reminder_deliveries: usize,
}

/// A post the driver published on a topic, and who subscribed to the topic as it did.
#[derive(Clone, Debug)]
pub struct TopicPostRow {
    /// Its title in a subscriber's inbox: `topic #position`.
    pub title: String,
    pub publisher: String,
    pub at: Duration,
    pub subscribers: BTreeSet<String>,
}

/// A fan-out the driver sent (SPEC §8.2), as the driver recorded it.
#[derive(Clone, Debug)]
pub struct FanoutRow {
    pub id: String,
    /// Its children's work messages, the first first.
    pub children: Vec<String>,
    pub quorum: usize,
    pub deadline: Option<Duration>,
    /// The chain its children are in.
    pub chain: String,
}

/// A combined return the store holds (a message from `handoffs`, kind `return`, intent
/// `handoff`): the first child it answers, when it was made, and what its title says.
#[derive(Clone, Debug)]
pub struct CombinedRow {
    pub id: String,
    pub first_child: String,
    pub at: Duration,
    pub partial: bool,
    /// The answers it combines, from its title (`joined (K/N): …`).
    pub answered: usize,
}

/// Everything a run leaves for the oracle.
/// A while a person held deliveries back: sending paused (`pair` None), or the connection
/// from one agent to another blocked.
#[derive(Clone, Debug)]
pub struct HoldRow {
    pub pair: Option<(String, String)>,
    pub from: Duration,
    pub until: Option<Duration>,
}

/// One chain's budget at the end of a run and what was taken from it, counted from the
/// messages and the spends themselves (not from the chain's own tally).
#[derive(Clone, Debug, Default)]
pub struct ChainBudgetRow {
    pub chain: String,
    pub hop_budget: i64,
    pub depth_limit: i64,
    /// Handoffs sent in the chain below its first message: each spends one hop.
    pub continuations: i64,
    /// The deepest handoff's depth.
    pub deepest: i64,
    /// The caller's units with a limit: unit → limit, in millionths.
    pub limits: BTreeMap<String, i64>,
    /// Every spend recorded, summed by unit, in millionths.
    pub spent: BTreeMap<String, i64>,
}

/// How an agent answered one history query.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HistoryAnswer {
    Found,
    NotFound,
    /// The history could not be read (503): an incomplete scan.
    Unreadable,
}

#[derive(Clone, Debug, Default)]
pub struct Run {
    pub deliveries: Vec<DeliveryRow>,
    pub events: Vec<EventRow>,
    pub writes: Vec<WriteRow>,
    /// Per host: (request id, when the turn really ended, how).
    pub turns_ended: Vec<(String, String, Duration, &'static str)>,
    /// Every history (status) query an agent answered: (host, when, request id, answer).
    pub status_queries: Vec<(String, Duration, String, HistoryAnswer)>,
    pub sent: Vec<SentRow>,
    pub work: Vec<WorkRow>,
    /// The provider outages the status page reported: (from, until).
    pub outages: Vec<(Duration, Option<Duration>)>,
    /// Deliveries a person released.
    pub released: BTreeSet<String>,
    /// Where each agent is registered at the end (its host).
    pub registered: BTreeMap<String, String>,
    /// Agents a person re-registered at another host during the run.
    pub reregistered: BTreeSet<String>,
    /// Request ids of the writes that could not connect (their host was down): refusals no
    /// agent saw, noted by the network.
    pub unconnected_writes: Vec<String>,
    /// The open dead letters of deliveries: message id → reason (SPEC §8.2).
    pub dead_letters: BTreeMap<String, String>,
    /// Every write as it left the engine (request id, when), as the network saw it.
    pub posted: Vec<(String, Duration)>,
    /// Chains a person cancelled, and when (SPEC §8.2).
    pub chain_cancels: BTreeMap<String, Duration>,
    /// Each message's chain.
    pub chain_of: BTreeMap<String, String>,
    /// Each chain's budget and what was taken from it (SPEC §8.2 budgets).
    pub chain_budgets: Vec<ChainBudgetRow>,
    /// Activity answers that forbade a write: "busy", or unreadable (503).
    pub busy_answers: usize,
    /// The pauses and blocks a person made, and each delivery's sender.
    pub holds: Vec<HoldRow>,
    pub senders: BTreeMap<String, String>,
    pub healed_at: Option<Duration>,
    pub end: Duration,
    /// The posts the driver published (SPEC §8.2 broadcast).
    pub topic_posts: Vec<TopicPostRow>,
    /// Every topic notification in an inbox: (title, recipient, whether it got a delivery).
    pub topic_notices: Vec<(String, String, bool)>,
    /// The fan-outs the driver sent (SPEC §8.2 fan-out).
    pub fanouts: Vec<FanoutRow>,
    /// When the driver returned each piece of work it returned (its own record).
    pub returns: BTreeMap<String, Duration>,
    /// Every combined return in the store.
    pub combined: Vec<CombinedRow>,
    /// Work closed as cancelled (by its chain's cancel, or its fan-out's join with
    /// cancel-rest): nothing of it is to be delivered any more.
    pub work_cancelled: BTreeSet<String>,
}

/// One guarantee's verdict.
#[derive(Clone, Debug)]
pub struct Verdict {
    pub key: &'static str,
    pub what: &'static str,
    /// How many times the check had something to judge.
    pub exercised: usize,
    pub violations: Vec<String>,
}

impl Verdict {
    fn new(key: &'static str, what: &'static str) -> Verdict {
        Verdict {
            key,
            what,
            exercised: 0,
            violations: Vec::new(),
        }
    }

    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }

    /// `G1       exact recipient: ok (12 checked)`, `… not exercised`, or `… FAILED (…)`.
    pub fn line(&self) -> String {
        let mut out = String::new();
        let head = format!("{:<8} {}", self.key, self.what);
        if !self.violations.is_empty() {
            let _ = writeln!(
                out,
                "{head}: FAILED ({} violations, {} checked)",
                self.violations.len(),
                self.exercised
            );
            for v in self.violations.iter().take(5) {
                let _ = writeln!(out, "           {v}");
            }
        } else if self.exercised == 0 {
            let _ = writeln!(out, "{head}: ok, not exercised");
        } else {
            let _ = writeln!(out, "{head}: ok ({} checked)", self.exercised);
        }
        out
    }
}

/// A virtual time as `h:mm:ss.mmm`.
pub fn hms(d: Duration) -> String {
    let ms = d.as_millis();
    format!(
        "{}:{:02}:{:02}.{:03}",
        ms / 3_600_000,
        ms / 60_000 % 60,
        ms / 1_000 % 60,
        ms % 1_000
    )
}

/// Which delivery each request id belongs to.
fn owners(run: &Run) -> BTreeMap<&str, &DeliveryRow> {
    let mut out = BTreeMap::new();
    for d in &run.deliveries {
        for r in &d.request_ids {
            out.insert(r.as_str(), d);
        }
    }
    out
}

/// The host each handoff's recipient was registered at when it was sent.
fn queued_at(run: &Run) -> BTreeMap<&str, &str> {
    run.sent
        .iter()
        .map(|s| (s.id.as_str(), s.host.as_str()))
        .collect()
}

/// A state event's `FROM → TO: …` parts.
fn moved(e: &EventRow) -> Option<(&str, &str)> {
    let (from, rest) = e.detail.split_once(" → ")?;
    let to = rest.split(':').next()?.trim();
    Some((from.trim(), to))
}

const ACTIVE: [&str; 4] = ["SENDING", "UNCERTAIN", "ACCEPTED", "RUNNING"];

/// G1: every write reached the host its recipient was registered at when the handoff was
/// sent, and named that recipient.
pub fn g1_exact_recipient(run: &Run) -> Verdict {
    let mut v = Verdict::new("G1", "exact recipient");
    let owners = owners(run);
    let queued = queued_at(run);
    for w in &run.writes {
        let Some(d) = owners.get(w.write.request_id.as_str()) else {
            continue; // G2 judges writes that belong to no delivery
        };
        // Exercised: a write to an agent that was re-registered elsewhere during the run,
        // where a redirect could have happened.
        if run.reregistered.contains(&d.recipient) {
            v.exercised += 1;
        }
        let queued_for = queued.get(d.id.as_str()).copied();
        if queued_for.is_some_and(|q| q != w.host) || w.write.addressed_to != d.recipient {
            v.violations.push(format!(
                "a write of {} to {}, queued for host {}, reached host {} addressed to {}",
                short(&d.id),
                d.recipient,
                queued_for.unwrap_or("?"),
                w.host,
                w.write.addressed_to
            ));
        }
    }
    v
}

/// G2: a request id is written again only after an explicit refusal (at most SPEC's refusal
/// retries times) or after the app turned it away busy (423: nothing written, so it is no
/// write); every write belongs to a delivery.
pub fn g2_one_write_per_attempt(run: &Run) -> Verdict {
    let mut v = Verdict::new("G2", "one write per attempt");
    let per_id = 1 + Policy::default().refusal_retries_max as usize;
    let owners = owners(run);
    let mut by_id: BTreeMap<&str, Vec<&WriteRow>> = BTreeMap::new();
    for w in &run.writes {
        by_id
            .entry(w.write.request_id.as_str())
            .or_default()
            .push(w);
    }
    for (rid, got) in &by_id {
        // Exercised: a request id whose write was refused or failed (a 409 or a 500), where
        // an engine could be tempted to write it again.
        if got.iter().any(|g| !g.write.taken) {
            v.exercised += 1;
        }
        if !owners.contains_key(rid) {
            v.violations.push(format!(
                "a write with request {} belongs to no delivery",
                short(rid)
            ));
        }
        // Only an explicit refusal (409) or a busy answer (423) allows the same request id
        // again; a write taken, or failed with a server error (it may have landed), never.
        // A busy answer wrote nothing, so it counts toward no limit.
        let again_after_taken = got
            .windows(2)
            .any(|p| p[0].write.status != 409 && p[0].write.status != BUSY_AT_WRITE);
        let writes = got
            .iter()
            .filter(|g| g.write.status != BUSY_AT_WRITE)
            .count();
        if again_after_taken || writes > per_id {
            v.violations.push(format!(
                "request {} was written {} times ({})",
                short(rid),
                writes,
                got.iter()
                    .map(|g| format!(
                        "{} at {}{}",
                        g.host,
                        hms(g.write.at),
                        match (g.write.taken, g.write.status) {
                            (true, _) => " taken",
                            (false, BUSY_AT_WRITE) => " busy",
                            (false, _) => " refused",
                        }
                    ))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
    }
    v
}

/// G3: no write is taken by a session in another turn, none arrives later than the race
/// allowance into one, at most one delivery per recipient is active at any moment (from
/// the engine's full state history, not samples), and a busy recipient is waited for: a
/// write the app turned away busy (423) never counts as a refusal.
pub fn g3_never_interrupt(run: &Run) -> Verdict {
    let mut v = Verdict::new("G3", "never interrupt");
    // Exercised: each answer that forbade a write (busy, unreadable), and each write that
    // arrived while the session was in a turn.
    v.exercised = run.busy_answers;
    g3_waited_for(run, &mut v);
    // When each write left the engine: a link that holds a write delays its arrival, and the
    // engine answers for what it knew when it sent, not for the network's delay.
    let mut posted: BTreeMap<&str, Vec<Duration>> = BTreeMap::new();
    for (rid, at) in &run.posted {
        posted.entry(rid.as_str()).or_default().push(*at);
    }
    let left = |w: &WriteRow| {
        // The latest departure of its request id no later than its arrival (the hosts'
        // clocks may disagree by one step of the simulation).
        posted
            .get(w.write.request_id.as_str())
            .and_then(|ts| ts.iter().filter(|t| **t <= w.write.at + TICK).max())
            .map_or(w.write.at, |t| (*t).min(w.write.at))
    };
    for w in &run.writes {
        if w.write.busy_since.is_some() {
            v.exercised += 1;
        }
        match w.write.last_answer {
            Some("busy") => v.violations.push(format!(
                "{} was sent {} at {} after it had answered that its turn was still running",
                w.host,
                short(&w.write.request_id),
                hms(w.write.at)
            )),
            Some("unknown") => v.violations.push(format!(
                "{} was sent {} at {} after its activity could not be read (written blind)",
                w.host,
                short(&w.write.request_id),
                hms(w.write.at)
            )),
            _ => {}
        }
        if let Some(since) = w.write.busy_since {
            // A turn that began after the engine's last look said idle, moments before the
            // write landed, is a race no check-then-write can see (see BUSY_RACE); any other
            // write into a running turn is the engine's.
            let sent = left(w);
            let race = w.write.last_answer == Some("idle") && sent <= since + BUSY_RACE;
            if w.write.taken && !race {
                let (req, at, began) = (short(&w.write.request_id), hms(w.write.at), hms(since));
                v.violations.push(match w.write.into_busy {
                    Some(HostKind::Folding) => format!(
                        "{} (Codex-like) folded {req} at {at} into the running turn that began at {began}",
                        w.host
                    ),
                    Some(HostKind::Forking) => format!(
                        "{} (Claude-like) forked its transcript: {req} resumed at {at} beside the turn that began at {began}",
                        w.host
                    ),
                    _ => format!("{} took {req} at {at} in a turn that began at {began}", w.host),
                });
            } else if !w.write.taken && sent > since + BUSY_RACE {
                v.violations.push(format!(
                    "{} was sent {} at {} in a turn that began at {}",
                    w.host,
                    short(&w.write.request_id),
                    hms(sent),
                    hms(since)
                ));
            }
        }
    }
    // Replay the state history: which deliveries are active, per recipient.
    let recipient: BTreeMap<&str, &str> = run
        .deliveries
        .iter()
        .map(|d| (d.id.as_str(), d.recipient.as_str()))
        .collect();
    let mut active: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for e in &run.events {
        let Some(r) = recipient.get(e.message.as_str()) else {
            continue;
        };
        if e.kind == "release" {
            // A person's release leaves whatever state it was in for CANCELLED or FAILED.
            active.entry(r).or_default().remove(e.message.as_str());
            continue;
        }
        let (true, Some((_, to))) = (e.kind == "state", moved(e)) else {
            continue;
        };
        let set = active.entry(r).or_default();
        if ACTIVE.contains(&to) {
            if set.insert(e.message.as_str()) && set.len() > 1 {
                v.violations.push(format!(
                    "{} deliveries active at once to {r} at {} ({})",
                    set.len(),
                    hms(e.at),
                    set.iter().map(|m| short(m)).collect::<Vec<_>>().join(", ")
                ));
            }
        } else {
            set.remove(e.message.as_str());
        }
    }
    v
}

/// A delivery's refusals are refusals it really met: each one an explicit 409 from the agent
/// or a write that could not connect, for its current request id. A 423 (busy at the write)
/// taken for a refusal shows as one more refusal than that.
fn g3_waited_for(run: &Run, v: &mut Verdict) {
    for d in &run.deliveries {
        let Some(rid) = d.request_ids.last() else {
            continue;
        };
        let answered = |status: u16| {
            run.writes
                .iter()
                .filter(|w| &w.write.request_id == rid && w.write.status == status)
                .count()
        };
        let busy = answered(BUSY_AT_WRITE);
        if busy > 0 {
            v.exercised += busy;
        }
        // Turned away busy again and again: on a backoff, never in a loop.
        let times: Vec<Duration> = run
            .writes
            .iter()
            .filter(|w| &w.write.request_id == rid && w.write.status == BUSY_AT_WRITE)
            .map(|w| w.write.at)
            .collect();
        if let Some(p) = times.windows(2).find(|p| p[1] < p[0] + BUSY_AGAIN_MIN) {
            v.violations.push(format!(
                "request {} was written at a busy session again {} ms after it was turned away",
                short(rid),
                p[1].saturating_sub(p[0]).as_millis()
            ));
        }
        let unconnected = run.unconnected_writes.iter().filter(|r| *r == rid).count();
        let refusals = answered(409) + unconnected;
        if d.refusals as usize > refusals {
            v.violations.push(format!(
                "{} counts {} refusals for request {}, but met {refusals} (and {busy} busy answers at the write, which are no refusal)",
                short(&d.id),
                d.refusals,
                short(rid)
            ));
        }
    }
}

/// G4: resends within SPEC's limits, an interrupted turn resent no sooner than 10 minutes
/// after it really ended (by the recipient's record), nothing resent from UNCERTAIN or
/// CANCELLED; every state event is readable.
pub fn g4_bounded_resend(run: &Run) -> Verdict {
    let mut v = Verdict::new("G4", "bounded resend");
    let spec = Policy::default();
    let ended: BTreeMap<&str, (Duration, &str)> = run
        .turns_ended
        .iter()
        .map(|(_, rid, at, how)| (rid.as_str(), (*at, *how)))
        .collect();
    let first_write: BTreeMap<&str, Duration> =
        run.writes.iter().rev().fold(BTreeMap::new(), |mut m, w| {
            m.insert(w.write.request_id.as_str(), w.write.at);
            m
        });
    for d in &run.deliveries {
        let resends = d.request_ids.len().saturating_sub(1);
        if resends == 0 {
            continue;
        }
        v.exercised += 1;
        let max = (spec.error_resends_max + spec.interrupt_resends_max) as usize;
        if resends > max
            || d.error_resends > spec.error_resends_max
            || d.interrupt_resends > spec.interrupt_resends_max
        {
            v.violations.push(format!(
                "{} was resent {resends} times ({} after errors, {} after interruptions)",
                short(&d.id),
                d.error_resends,
                d.interrupt_resends
            ));
        }
        for pair in d.request_ids.windows(2) {
            let (before, after) = (pair[0].as_str(), pair[1].as_str());
            match ended.get(before) {
                None => v.violations.push(format!(
                    "{} was resent as {} though its turn {} never ended at the recipient",
                    short(&d.id),
                    short(after),
                    short(before)
                )),
                Some((at, "stopped")) => {
                    if let Some(w) = first_write.get(after)
                        && *w < *at + Duration::from_millis(spec.interrupt_resend_wait_ms)
                    {
                        v.violations.push(format!(
                            "{} was resent at {} only {}s after its interrupted turn ended",
                            short(&d.id),
                            hms(*w),
                            w.saturating_sub(*at).as_secs()
                        ));
                    }
                }
                Some((_, "returned")) => v.violations.push(format!(
                    "{} was resent though its turn {} returned",
                    short(&d.id),
                    short(before)
                )),
                Some(_) => {}
            }
        }
    }
    for e in run.events.iter().filter(|e| e.kind == "state") {
        let Some((from, to)) = moved(e) else {
            v.violations
                .push(format!("an unreadable state event: {:?}", e.detail));
            continue;
        };
        let resumes = matches!(
            to,
            "ACCEPTED" | "RUNNING" | "RETURNED" | "FAILED" | "CANCELLED"
        );
        if (from == "UNCERTAIN" && !resumes) || from == "CANCELLED" {
            v.violations.push(format!(
                "{} went {from} → {to} at {}",
                short(&e.message),
                hms(e.at)
            ));
        }
    }
    v
}

/// G5: a delivery cancelled without a person's release was never taken by its recipient, and
/// the recipient answered at least SPEC's number of history queries for it with "not found",
/// spanning at least SPEC's hour.
pub fn g5_honest_release(run: &Run) -> Verdict {
    let mut v = Verdict::new("G5", "honest release");
    let spec = Policy::default();
    for d in run.deliveries.iter().filter(|d| d.state == "CANCELLED") {
        let Some(current) = d.request_ids.last() else {
            continue;
        };
        if run.released.contains(&d.id) {
            // A person who knew how it ended released it (SPEC §2.4): whatever was taken.
            continue;
        }
        // Exercised: a cancel by history scans.
        v.exercised += 1;
        if let Some(w) = run
            .writes
            .iter()
            .find(|w| w.write.taken && &w.write.request_id == current)
        {
            v.violations.push(format!(
                "{} was cancelled, but {} took {} at {}",
                short(&d.id),
                w.host,
                short(current),
                hms(w.write.at)
            ));
        }
        if let Some((n, span)) = d.cancelled_by_scans
            && (n < spec.history_scans_min
                || span < Duration::from_millis(spec.history_scan_span_ms))
        {
            v.violations.push(format!(
                "{} was cancelled after {n} empty history scans over {}s (SPEC: {} over {}s)",
                short(&d.id),
                span.as_secs(),
                spec.history_scans_min,
                spec.history_scan_span_ms / 1_000
            ));
        }
        // The recipient's side. A status query does not say whether it is a scan or an
        // observation (the engine observes an UNCERTAIN delivery between its scans), so count
        // the most "not found" answers that could be scans SPEC's interval apart: the
        // engine's own complete scans are such a set, so an honest cancel always has one
        // of at least SPEC's size; a cancel whose middle scan could not read the history
        // (503) has none, however many observations it made.
        let cancelled_at = run
            .events
            .iter()
            .filter(|e| {
                e.message == d.id
                    && e.kind == "state"
                    && moved(e).is_some_and(|(_, to)| to == "CANCELLED")
            })
            .map(|e| e.at)
            .next_back()
            .unwrap_or(Duration::MAX);
        let interval = Duration::from_millis(spec.history_scan_interval_ms);
        let mut scans: Vec<Duration> = Vec::new();
        let mut unreadable = 0;
        for (_, at, _, answer) in run
            .status_queries
            .iter()
            .filter(|q| &q.2 == current && q.1 <= cancelled_at)
        {
            match answer {
                HistoryAnswer::NotFound
                    if scans
                        .last()
                        .is_none_or(|l| at.saturating_sub(*l) >= interval) =>
                {
                    scans.push(*at);
                }
                HistoryAnswer::Unreadable => unreadable += 1,
                _ => {}
            }
        }
        let span = match (scans.first(), scans.last()) {
            (Some(a), Some(b)) => b.saturating_sub(*a),
            _ => Duration::ZERO,
        };
        if scans.len() < spec.history_scans_min as usize
            || span < Duration::from_millis(spec.history_scan_span_ms)
        {
            v.violations.push(format!(
                "{} was cancelled after at most {} complete history scans that found nothing, {}s apart or more, as its recipient answered them ({}; {unreadable} answers unreadable)",
                short(&d.id),
                scans.len(),
                interval.as_secs(),
                scans.iter().map(|at| hms(*at)).collect::<Vec<_>>().join(", ")
            ));
        }
    }
    v
}

/// G6: no attempt is reserved while the outage guard must have seen an outage.
pub fn g6_outages_hold(run: &Run) -> Verdict {
    let mut v = Verdict::new("G6", "outages hold");
    // Exercised: each time the guard held a delivery back (its note in the history).
    v.exercised = run
        .events
        .iter()
        .filter(|e| e.kind == "note" && e.detail.contains("provider outage"))
        .count();
    for e in run.events.iter().filter(|e| e.kind == "state") {
        let Some((_, "SENDING")) = moved(e) else {
            continue;
        };
        for (from, until) in &run.outages {
            let seen = *from + GUARD_LAG;
            if e.at > seen && until.is_none_or(|u| e.at < u) {
                v.violations.push(format!(
                    "{} was reserved at {} during the outage from {}",
                    short(&e.message),
                    hms(e.at),
                    hms(*from)
                ));
            }
        }
    }
    v
}

/// G7: work still open at its due time reminds its sender exactly once, within the lag;
/// work returned before it never does; no reminder becomes a turn.
pub fn g7_deadlines(run: &Run) -> Verdict {
    let mut v = Verdict::new("G7", "deadlines");
    for w in &run.work {
        if w.due_at + REMINDER_LAG > run.end {
            continue; // not judgeable within this run
        }
        v.exercised += 1;
        // Open past its due time and the lag: exactly one reminder, in time. Returned before
        // its due time: none. Returned within the lag: at most one.
        let open_past_lag = w.returned_at.is_none_or(|r| r > w.due_at + REMINDER_LAG);
        // Returned before its due time by more than the hosts' clocks may disagree: a return
        // dated within one step of the due time may have come after the engine's look.
        let returned_before_due = w.returned_at.is_some_and(|r| r + TICK <= w.due_at);
        match (open_past_lag, returned_before_due, w.reminders.as_slice()) {
            (_, false, [at]) if *at <= w.due_at + REMINDER_LAG && *at >= w.due_at => {}
            (false, _, []) => {}
            (_, _, [at]) => v.violations.push(format!(
                "work {} due at {} was reminded at {}",
                short(&w.id),
                hms(w.due_at),
                hms(*at)
            )),
            (_, _, r) => v.violations.push(format!(
                "work {} ({}) has {} reminders",
                short(&w.id),
                if open_past_lag {
                    "open past its due time"
                } else if returned_before_due {
                    "returned before its due time"
                } else {
                    "returned just after its due time"
                },
                r.len()
            )),
        }
        if w.reminder_deliveries > 0 {
            v.violations
                .push(format!("a reminder of {} became a turn", short(&w.id)));
        }
    }
    v
}

/// G8: every handoff the driver sent has its delivery, and every write arrived after its
/// reservation was committed (looked up by the recipient as it arrived).
pub fn g8_durability(run: &Run) -> Verdict {
    let mut v = Verdict::new(
        "G8",
        "durability (nothing lost, every write reserved first)",
    );
    let enrolled: BTreeSet<&str> = run.deliveries.iter().map(|d| d.id.as_str()).collect();
    for s in &run.sent {
        v.exercised += 1;
        if !enrolled.contains(s.id.as_str()) {
            v.violations
                .push(format!("handoff {} has no delivery", short(&s.id)));
        }
    }
    for w in &run.writes {
        v.exercised += 1;
        if !w.write.reserved {
            v.violations.push(format!(
                "{} received {} at {} before its reservation was committed",
                w.host,
                short(&w.write.request_id),
                hms(w.write.at)
            ));
        }
    }
    v
}

/// Whether a delivery has settled for good: terminal (FAILED only with no resend planned),
/// or pending for a reason that still holds (a destination that changed since, and is not
/// registered as it was again). Every other state is unsettled, whatever its reason.
pub fn settled(d: &DeliveryRow) -> bool {
    match d.state.as_str() {
        "RETURNED" | "ACKNOWLEDGED" | "DUPLICATE" | "CANCELLED" => true,
        "FAILED" => !d.resend_pending,
        "UNAVAILABLE" => d.destination_changed && !d.destination_restored,
        _ => false,
    }
}

/// Liveness: after every fault healed, every delivery settled within the bound.
pub fn liveness(run: &Run, bound: Duration) -> Verdict {
    let mut v = Verdict::new("liveness", "every delivery settles after healing");
    if run.healed_at.is_none() {
        v.violations
            .push("the run ended before every fault healed".to_owned());
    }
    let queued = queued_at(run);
    for d in &run.deliveries {
        v.exercised += 1;
        // UNAVAILABLE for a changed destination holds only while it still differs.
        let stale = d.destination_changed
            && queued
                .get(d.id.as_str())
                .is_some_and(|q| run.registered.get(&d.recipient).map(String::as_str) == Some(*q));
        if stale {
            v.violations.push(format!(
                "{} is still UNAVAILABLE though {} is registered where it was queued again",
                short(&d.id),
                d.recipient
            ));
        } else if !settled(d) {
            v.violations.push(format!(
                "{} is still {} {} after every fault healed",
                short(&d.id),
                d.state,
                hms(bound)
            ));
        }
    }
    v
}

/// Every verdict, in SPEC's order.
pub fn judge(run: &Run, settle_bound: Duration) -> Vec<Verdict> {
    vec![
        g1_exact_recipient(run),
        g2_one_write_per_attempt(run),
        g3_never_interrupt(run),
        g4_bounded_resend(run),
        g5_honest_release(run),
        g6_outages_hold(run),
        g7_deadlines(run),
        g8_durability(run),
        held(run),
        liveness(run, settle_bound),
        chains(run),
        budgets(run),
        dead(run),
        topics(run),
        fanouts(run),
    ]
}

/// A write as it left one of several engines sharing a database (issue 17): the token its
/// reservation was made under (`fence` in the POST) and the recipient's lease token in the
/// database at that moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FencedWrite {
    pub agent: String,
    pub request_id: String,
    /// The engine's host.
    pub engine: String,
    pub fence: Option<i64>,
    pub lease: Option<i64>,
    pub at: Duration,
}

/// Fencing across engines (issue 17): every write leaves its engine under the lease its
/// reservation was made under: its token is the recipient's lease token at that moment, so
/// an engine stalled past its lease, which another engine took meanwhile, writes nothing.
/// Exercised by each write that carries a token.
pub fn fencing(writes: &[FencedWrite]) -> Verdict {
    let mut v = Verdict::new(
        "fencing",
        "a write leaves only under the lease it was reserved under",
    );
    let shown = |f: Option<i64>| f.map_or_else(|| "none".to_owned(), |f| f.to_string());
    for w in writes {
        v.exercised += 1;
        // A write with no token: its engine held no lease on the recipient as it wrote.
        if w.fence.is_none() || w.lease != w.fence {
            v.violations.push(format!(
                "{} wrote {} to {} at {} under fence {} while the lease was at fence {}",
                w.engine,
                short(&w.request_id),
                w.agent,
                hms(w.at),
                shown(w.fence),
                shown(w.lease)
            ));
        }
    }
    v
}

/// SPEC §8.2 broadcast: each post reached every agent that subscribed to its topic as it was
/// published exactly once, unless a person had blocked the connection from its publisher
/// (then never), nobody else, and never as a turn.
pub fn topics(run: &Run) -> Verdict {
    let mut v = Verdict::new("topics", "a publish reaches each subscriber once");
    let mut told: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    for (title, to, turned) in &run.topic_notices {
        *told.entry((title.as_str(), to.as_str())).or_default() += 1;
        if *turned {
            v.violations
                .push(format!("the notification {title} to {to} became a turn"));
        }
    }
    for p in &run.topic_posts {
        v.exercised += 1;
        for s in &p.subscribers {
            let blocked = *s != p.publisher
                && run.holds.iter().any(|h| {
                    h.pair.as_ref() == Some(&(p.publisher.clone(), s.clone()))
                        && h.from <= p.at
                        && h.until.is_none_or(|u| p.at < u)
                });
            let n = told
                .get(&(p.title.as_str(), s.as_str()))
                .copied()
                .unwrap_or(0);
            match (n, blocked) {
                (1, false) | (0, true) => {}
                (0, false) => v.violations.push(format!(
                    "{} never reached {s}, who subscribed as it was published",
                    p.title
                )),
                (_, true) => v.violations.push(format!(
                    "{} reached {s}, though {} → {s} was blocked",
                    p.title, p.publisher
                )),
                (n, false) => v
                    .violations
                    .push(format!("{} reached {s} {n} times", p.title)),
            }
        }
        for ((title, to), _) in told.range((p.title.as_str(), "")..) {
            if *title != p.title {
                break;
            }
            if !p.subscribers.contains(*to) {
                v.violations.push(format!(
                    "{} reached {to}, who did not subscribe as it was published",
                    p.title
                ));
            }
        }
    }
    v
}

/// SPEC §8.2 fan-out: each fan-out is joined at most once, into one combined return; once
/// its K-th child returned (the driver's record), or its deadline passed, it is joined (with
/// the housekeeping's lag, as a reminder is), unless its chain was cancelled first; a
/// complete join combines at least K answers and comes no sooner than the K-th; a partial
/// one fewer, and no sooner than the deadline; and the answers it counts are the returns the
/// agents made before it.
pub fn fanouts(run: &Run) -> Verdict {
    let mut v = Verdict::new(
        "fanouts",
        "a fan-out joins once, at K returns or its deadline",
    );
    for f in &run.fanouts {
        let Some(first) = f.children.first() else {
            continue;
        };
        let combos: Vec<&CombinedRow> = run
            .combined
            .iter()
            .filter(|c| &c.first_child == first)
            .collect();
        if combos.len() > 1 {
            v.violations.push(format!(
                "fan-out {} joined {} times",
                short(&f.id),
                combos.len()
            ));
        }
        let mut rets: Vec<Duration> = f
            .children
            .iter()
            .filter_map(|c| run.returns.get(c).copied())
            .collect();
        rets.sort();
        let kth = rets.get(f.quorum.saturating_sub(1)).copied();
        let due = match (kth, f.deadline) {
            (Some(k), Some(d)) => Some(k.min(d)),
            (k, d) => k.or(d),
        };
        let cancel = run.chain_cancels.get(&f.chain).copied();
        let joined = !combos.is_empty();
        match (due, cancel) {
            (Some(due), Some(c)) if c + TICK < due && joined => {
                v.violations.push(format!(
                    "fan-out {} was joined though its chain was cancelled at {} before \
                     anything was due",
                    short(&f.id),
                    hms(c)
                ));
            }
            (Some(due), c)
                if !joined
                    && c.is_none_or(|c| c > due + REMINDER_LAG)
                    && due + REMINDER_LAG < run.end =>
            {
                v.violations.push(format!(
                    "fan-out {} was never joined, though it was due at {} ({})",
                    short(&f.id),
                    hms(due),
                    if kth == Some(due) {
                        format!("its {}th return", f.quorum)
                    } else {
                        "its deadline".to_owned()
                    }
                ));
            }
            _ => {}
        }
        let Some(c) = combos.first() else {
            continue;
        };
        v.exercised += 1;
        let lo = rets.iter().filter(|t| **t + TICK < c.at).count();
        let hi = rets.iter().filter(|t| **t <= c.at + TICK).count();
        if !(lo..=hi).contains(&c.answered) {
            v.violations.push(format!(
                "fan-out {}'s combined return counts {} answers; the agents returned {lo} to \
                 {hi} before it",
                short(&f.id),
                c.answered
            ));
        }
        if c.partial {
            if c.answered >= f.quorum {
                v.violations.push(format!(
                    "fan-out {} was joined partial with {} of the {} answers it needs",
                    short(&f.id),
                    c.answered,
                    f.quorum
                ));
            }
            if f.deadline.is_none_or(|d| c.at + TICK < d) {
                v.violations.push(format!(
                    "fan-out {} was joined partial at {}, before its deadline",
                    short(&f.id),
                    hms(c.at)
                ));
            }
        } else if c.answered < f.quorum {
            v.violations.push(format!(
                "fan-out {} was joined complete with {} of the {} answers it needs",
                short(&f.id),
                c.answered,
                f.quorum
            ));
        }
    }
    v
}

/// SPEC §8.2 dead letters: a handoff that cannot be delivered is kept with its reason, judged
/// from the world: FAILED with no resend pending, outside a cancelled chain, not released by a
/// person, and no turn of it returned by the agents' own records (so never delivered, or its
/// resends spent): a `failed` letter; UNAVAILABLE because its recipient was registered
/// elsewhere: a `destination_changed` letter. And no open letter for a handoff delivered.
pub fn dead(run: &Run) -> Verdict {
    let mut v = Verdict::new("dead", "what cannot be delivered is kept as a dead letter");
    let returned: BTreeSet<&str> = run
        .turns_ended
        .iter()
        .filter(|t| t.3 == "returned")
        .map(|t| t.1.as_str())
        .collect();
    for d in &run.deliveries {
        let cancelled = run
            .chain_of
            .get(&d.id)
            .is_some_and(|c| run.chain_cancels.contains_key(c))
            || run.work_cancelled.contains(&d.id);
        let expected = match d.state.as_str() {
            "FAILED"
                if !d.resend_pending
                    && !cancelled
                    && !run.released.contains(&d.id)
                    && !d.request_ids.iter().any(|r| returned.contains(r.as_str())) =>
            {
                Some("failed")
            }
            "UNAVAILABLE" if d.destination_changed => Some("destination_changed"),
            _ => None,
        };
        let kept = run.dead_letters.get(&d.id).map(String::as_str);
        if let Some(reason) = expected {
            v.exercised += 1;
            if kept != Some(reason) {
                v.violations.push(format!(
                    "{} ended {} and cannot be delivered, but is kept as {}",
                    short(&d.id),
                    d.state,
                    kept.map_or("no dead letter".to_owned(), |k| format!("a {k} letter"))
                ));
            }
        } else if let Some(k) = kept
            && matches!(d.state.as_str(), "RETURNED" | "ACKNOWLEDGED")
        {
            v.violations.push(format!(
                "{} was delivered ({}), but a {k} dead letter is still open",
                short(&d.id),
                d.state
            ));
        }
    }
    v
}

/// SPEC §8.2 budgets: no chain makes more hops than its hop budget, goes deeper than its
/// depth limit, or spends more of a unit than its limit; a refused spend or send takes
/// nothing.
pub fn budgets(run: &Run) -> Verdict {
    let mut v = Verdict::new("budgets", "no chain spends beyond its budget");
    for b in &run.chain_budgets {
        if b.continuations == 0 && b.spent.is_empty() {
            continue;
        }
        v.exercised += 1;
        let chain = short(&b.chain);
        if b.continuations > b.hop_budget {
            v.violations.push(format!(
                "chain {chain} made {} hops, past its hop budget of {}",
                b.continuations, b.hop_budget
            ));
        }
        if b.deepest > b.depth_limit {
            v.violations.push(format!(
                "chain {chain} reached depth {}, past its depth limit of {}",
                b.deepest, b.depth_limit
            ));
        }
        for (unit, spent) in &b.spent {
            if let Some(limit) = b.limits.get(unit)
                && spent > limit
            {
                v.violations.push(format!(
                    "chain {chain} spent {} {unit}, past its limit of {}",
                    whole(*spent),
                    whole(*limit)
                ));
            }
        }
    }
    v
}

/// An amount in millionths as a number: `1200`, `0.05`.
fn whole(millionths: i64) -> String {
    let (units, frac) = (millionths / 1_000_000, (millionths % 1_000_000).abs());
    if frac == 0 {
        units.to_string()
    } else {
        format!("{units}.{}", format!("{frac:06}").trim_end_matches('0'))
    }
}

/// SPEC §8.2 cascading cancel: once a chain is cancelled, none of its deliveries is written
/// again. What may still arrive after the cancel are the writes already on the wire at that
/// moment: judged from the network's own record of when each write left the engine (to the
/// millisecond of the cancel's record), not from what the engine marked. A write that left
/// after the cancel (reserved before it or not), a retry after a busy answer or a refusal,
/// or a resend is a violation.
pub fn chains(run: &Run) -> Verdict {
    let mut v = Verdict::new("chains", "nothing is written after its chain was cancelled");
    let owners = owners(run);
    let cancelled_at = |rid: &str| {
        owners
            .get(rid)
            .and_then(|d| run.chain_of.get(&d.id))
            .and_then(|c| run.chain_cancels.get(c).map(|at| (c, *at)))
    };
    for d in &run.deliveries {
        if run
            .chain_of
            .get(&d.id)
            .is_some_and(|c| run.chain_cancels.contains_key(c))
        {
            v.exercised += 1;
        }
    }
    let ms = |t: Duration| Duration::from_millis(u64::try_from(t.as_millis()).unwrap_or(u64::MAX));
    // Per request of a cancelled chain: the writes on the wire at its cancel (left by then,
    // not yet arrived), which may still arrive.
    let mut on_the_wire: BTreeMap<&str, i64> = BTreeMap::new();
    for (rid, left) in &run.posted {
        if cancelled_at(rid).is_some_and(|(_, at)| ms(*left) <= at) {
            *on_the_wire.entry(rid.as_str()).or_default() += 1;
        }
    }
    for w in &run.writes {
        let rid = w.write.request_id.as_str();
        if cancelled_at(rid).is_some_and(|(_, at)| w.write.at <= at) {
            *on_the_wire.entry(rid).or_default() -= 1;
        }
    }
    for w in &run.writes {
        let rid = w.write.request_id.as_str();
        let Some((chain, at)) = cancelled_at(rid) else {
            continue;
        };
        if w.write.at <= at {
            continue;
        }
        let left = on_the_wire.entry(rid).or_default();
        *left -= 1;
        if *left < 0 {
            v.violations.push(format!(
                "{} was written to {} at {} (request {}), after its chain {} was cancelled at {}",
                owners.get(rid).map_or("?", |d| short(&d.id)),
                w.host,
                hms(w.write.at),
                short(rid),
                short(chain),
                hms(at)
            ));
        }
    }
    v
}

/// How long after a person paused sending (or blocked a pair) a reservation may still be
/// committed: none, since the reservation reads the permission in its own transaction; a
/// second for the clock's granularity.
const HOLD_LAG: Duration = Duration::from_secs(1);

/// SPEC §2.2: while sending is paused, or the connection is blocked, nothing is reserved
/// (the delivery waits HELD).
pub fn held(run: &Run) -> Verdict {
    let mut v = Verdict::new("held", "pauses and blocks hold");
    let recipient: BTreeMap<&str, &str> = run
        .deliveries
        .iter()
        .map(|d| (d.id.as_str(), d.recipient.as_str()))
        .collect();
    for e in run.events.iter().filter(|e| e.kind == "state") {
        let Some((_, to)) = moved(e) else { continue };
        if to == "HELD" {
            // Exercised: each time a delivery was held back.
            v.exercised += 1;
        }
        if to != "SENDING" {
            continue;
        }
        let (Some(to_agent), Some(from_agent)) = (
            recipient.get(e.message.as_str()),
            run.senders.get(&e.message),
        ) else {
            continue;
        };
        for h in &run.holds {
            let during = e.at >= h.from + HOLD_LAG && h.until.is_none_or(|u| e.at < u);
            let applies = h
                .pair
                .as_ref()
                .is_none_or(|(a, b)| a == from_agent && b == to_agent);
            if during && applies {
                v.violations.push(format!(
                    "{} was reserved at {} while {} (since {})",
                    short(&e.message),
                    hms(e.at),
                    match &h.pair {
                        None => "sending was paused".to_owned(),
                        Some((a, b)) => format!("{a} → {b} was blocked"),
                    },
                    hms(h.from)
                ));
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::{
        ChainBudgetRow, DeliveryRow, EventRow, HoldRow, Run, WorkRow, WriteRow, budgets, chains,
        g3_never_interrupt, g7_deadlines, held, settled,
    };
    use crate::agent::Received;
    use std::time::Duration;

    /// A write leaves under the recipient's lease, or it is the fencing check's violation:
    /// under an older token, or with none.
    #[test]
    fn a_write_under_a_lease_that_moved_or_none_is_a_fencing_violation() {
        let write = |fence: Option<i64>, lease: Option<i64>| super::FencedWrite {
            agent: "a0".to_owned(),
            request_id: "e5c5adb1ffff".to_owned(),
            engine: "engine-b".to_owned(),
            fence,
            lease,
            at: Duration::from_secs(90),
        };
        let v = super::fencing(&[write(Some(3), Some(3))]);
        assert!(v.ok() && v.exercised == 1, "{:?}", v.violations);
        let v = super::fencing(&[write(Some(3), Some(4)), write(None, Some(4))]);
        assert_eq!(
            v.violations,
            [
                "engine-b wrote e5c5adb1 to a0 at 0:01:30.000 under fence 3 while the lease was at fence 4",
                "engine-b wrote e5c5adb1 to a0 at 0:01:30.000 under fence none while the lease was at fence 4",
            ]
        );
    }

    /// One write of request `r1` to host `b`, answered `status`.
    fn answered(status: u16) -> WriteRow {
        WriteRow {
            host: "b".to_owned(),
            write: Received {
                request_id: "r1".to_owned(),
                addressed_to: "b".to_owned(),
                at: Duration::from_secs(10),
                busy_since: None,
                taken: status == 200,
                into_busy: None,
                status,
                reserved: true,
                last_answer: None,
            },
        }
    }

    #[test]
    fn a_busy_answer_at_the_write_counted_as_a_refusal_is_caught_by_g3() {
        let mut run = reserved_at(10);
        run.deliveries[0].refusals = 1;
        run.deliveries[0].state = "OWNER_REJECTED".to_owned();
        run.writes = vec![answered(423)];
        let v = g3_never_interrupt(&run);
        assert!(
            v.violations
                .iter()
                .any(|m| m.contains("counts 1 refusals for request r1, but met 0")),
            "{:?}",
            v.violations
        );
        // A real refusal, or a write that could not connect, is one.
        run.writes.push(answered(409));
        assert!(g3_never_interrupt(&run).violations.is_empty());
        run.writes.pop();
        run.unconnected_writes = vec!["r1".to_owned()];
        assert!(g3_never_interrupt(&run).violations.is_empty());
    }

    /// A write that a held link delivered late into a turn is judged by when it left the
    /// engine: sent when the session was idle, it is no interruption; sent 6 s into the
    /// turn, it is, wherever it arrived.
    #[test]
    fn g3_dates_a_write_by_when_it_left_the_engine() {
        let mut run = reserved_at(10);
        let mut w = answered(423);
        w.write.at = Duration::from_millis(15_500);
        w.write.busy_since = Some(Duration::from_millis(9_500));
        w.write.last_answer = Some("idle");
        run.writes = vec![w];
        run.posted = vec![("r1".to_owned(), Duration::from_secs(9))];
        assert!(
            g3_never_interrupt(&run).violations.is_empty(),
            "{:?}",
            g3_never_interrupt(&run).violations
        );
        run.posted = vec![("r1".to_owned(), Duration::from_millis(15_400))];
        let v = g3_never_interrupt(&run);
        assert!(
            v.violations
                .iter()
                .any(|m| m
                    .contains("was sent r1 at 0:00:15.400 in a turn that began at 0:00:09.500")),
            "{:?}",
            v.violations
        );
    }

    /// A return dated within one step of the due time may have come after the engine's look
    /// (each host keeps its own clock within a step): a reminder then is no violation; a
    /// return a step or more before the due time forbids one.
    #[test]
    fn g7_forgives_a_reminder_beside_a_return_at_the_due_time_only() {
        let due = Duration::from_secs(600);
        let mut run = Run {
            end: Duration::from_secs(3_600),
            work: vec![WorkRow {
                id: "w1".to_owned(),
                due_at: due,
                returned_at: Some(Duration::from_millis(599_900)),
                reminders: vec![due + Duration::from_millis(200)],
                reminder_deliveries: 0,
            }],
            ..Run::default()
        };
        assert!(g7_deadlines(&run).violations.is_empty());
        run.work[0].returned_at = Some(Duration::from_secs(599));
        let v = g7_deadlines(&run);
        assert!(
            v.violations
                .iter()
                .any(|m| m.contains("work w1 due at 0:10:00.000 was reminded at 0:10:00.200")),
            "{:?}",
            v.violations
        );
    }

    /// Only a write on the wire at the cancel may arrive after it, once; one that left after
    /// the cancel, or a retry of the one that arrived, is caught.
    #[test]
    fn chains_judges_writes_after_a_cancel_by_when_they_left_the_engine() {
        let mut run = reserved_at(10);
        run.chain_of.insert("m1".to_owned(), "c1".to_owned());
        run.chain_cancels
            .insert("c1".to_owned(), Duration::from_millis(10_500));
        // Left at 9.8 s, arrived at 10.9 s: on the wire at the cancel.
        run.posted = vec![("r1".to_owned(), Duration::from_millis(9_800))];
        let mut w = answered(409);
        w.write.at = Duration::from_millis(10_900);
        run.writes = vec![w.clone()];
        assert!(chains(&run).violations.is_empty(), "{:?}", chains(&run));
        // Its retry left after the cancel.
        run.posted.push(("r1".to_owned(), Duration::from_secs(12)));
        w.write.at = Duration::from_millis(12_400);
        run.writes.push(w.clone());
        let v = chains(&run);
        assert_eq!(v.violations.len(), 1, "{v:?}");
        assert!(
            v.violations[0].contains("after its chain c1 was cancelled"),
            "{v:?}"
        );
        // A write reserved before the cancel that left after it is caught too.
        run.posted = vec![("r1".to_owned(), Duration::from_millis(10_600))];
        run.writes = vec![w];
        assert_eq!(chains(&run).violations.len(), 1);
    }

    fn reserved_at(secs: u64) -> Run {
        Run {
            deliveries: vec![DeliveryRow {
                id: "m1".to_owned(),
                recipient: "b".to_owned(),
                state: "RETURNED".to_owned(),
                request_ids: vec!["r1".to_owned()],
                refusals: 0,
                error_resends: 0,
                interrupt_resends: 0,
                resend_pending: false,
                had_receipt: false,
                destination_changed: false,
                destination_restored: false,
                cancelled_by_scans: None,
            }],
            events: vec![EventRow {
                at: Duration::from_secs(secs),
                message: "m1".to_owned(),
                kind: "state".to_owned(),
                detail: "WAITING → SENDING: attempt 1 is reserved".to_owned(),
            }],
            senders: [("m1".to_owned(), "a".to_owned())].into(),
            holds: vec![HoldRow {
                pair: Some(("a".to_owned(), "b".to_owned())),
                from: Duration::from_secs(100),
                until: Some(Duration::from_secs(200)),
            }],
            ..Run::default()
        }
    }

    /// Seed 2804 of the soak: the run was judged settled while deliveries stayed UNAVAILABLE
    /// for a destination their recipient was registered at again (an outage kept them there
    /// until the heal), so it ended before the engine could take them up.
    #[test]
    fn an_unavailable_whose_destination_is_restored_is_not_settled() {
        let mut d = reserved_at(0).deliveries.remove(0);
        d.state = "UNAVAILABLE".to_owned();
        d.destination_changed = true;
        assert!(settled(&d));
        d.destination_restored = true;
        assert!(!settled(&d));
        d.destination_changed = false;
        assert!(!settled(&d));
    }

    #[test]
    fn a_reservation_while_the_pair_is_blocked_is_caught() {
        let v = held(&reserved_at(150));
        assert_eq!(v.violations.len(), 1, "{:?}", v.violations);
        assert!(
            v.violations[0].contains("a → b was blocked"),
            "{:?}",
            v.violations
        );
        assert!(
            held(&reserved_at(250)).violations.is_empty(),
            "after the block"
        );
        assert!(
            held(&reserved_at(50)).violations.is_empty(),
            "before the block"
        );
    }

    #[test]
    fn a_chain_past_its_budget_is_caught_by_budgets() {
        let at_limit = ChainBudgetRow {
            chain: "c1".to_owned(),
            hop_budget: 2,
            depth_limit: 8,
            continuations: 2,
            deepest: 2,
            limits: [("tokens".to_owned(), 1_000_000_000)].into(),
            spent: [("tokens".to_owned(), 1_000_000_000)].into(),
        };
        let mut run = Run {
            chain_budgets: vec![at_limit.clone()],
            ..Run::default()
        };
        let v = budgets(&run);
        assert!(v.violations.is_empty() && v.exercised == 1, "{v:?}");
        run.chain_budgets[0]
            .spent
            .insert("tokens".to_owned(), 1_000_500_000);
        run.chain_budgets[0].continuations = 3;
        run.chain_budgets[0].deepest = 9;
        let v = budgets(&run);
        assert_eq!(
            v.violations,
            [
                "chain c1 made 3 hops, past its hop budget of 2",
                "chain c1 reached depth 9, past its depth limit of 8",
                "chain c1 spent 1000.5 tokens, past its limit of 1000",
            ],
        );
    }
}

#[cfg(test)]
mod fanout_tests {
    use super::{CombinedRow, FanoutRow, Run, fanouts};
    use std::time::Duration;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    /// A quorum-1 fan-out to two children with a deadline at 600 s; child `c1` returned at
    /// 100 s (the driver's record).
    fn run_with(combined: Vec<CombinedRow>) -> Run {
        Run {
            fanouts: vec![FanoutRow {
                id: "f1".to_owned(),
                children: vec!["c1".to_owned(), "c2".to_owned()],
                quorum: 1,
                deadline: Some(secs(600)),
                chain: "c1".to_owned(),
            }],
            returns: [("c1".to_owned(), secs(100))].into(),
            combined,
            end: secs(3_600),
            ..Run::default()
        }
    }

    fn joined(at: u64, partial: bool, answered: usize) -> CombinedRow {
        CombinedRow {
            id: format!("m{at}"),
            first_child: "c1".to_owned(),
            at: secs(at),
            partial,
            answered,
        }
    }

    #[test]
    fn a_join_at_the_quorum_passes_and_every_wrong_join_is_named() {
        let v = fanouts(&run_with(vec![joined(100, false, 1)]));
        assert!(v.ok(), "{:?}", v.violations);
        assert_eq!(v.exercised, 1);
        let cases = [
            (
                vec![joined(100, false, 1), joined(101, false, 1)],
                "joined 2 times",
            ),
            (
                vec![],
                "was never joined, though it was due at 0:01:40.000 (its 1th return)",
            ),
            (
                vec![joined(50, false, 1)],
                "counts 1 answers; the agents returned 0 to 0",
            ),
            (vec![joined(100, true, 0)], "before its deadline"),
        ];
        for (combined, says) in cases {
            let v = fanouts(&run_with(combined));
            assert!(
                v.violations.iter().any(|m| m.contains(says)),
                "{says}: {:?}",
                v.violations
            );
        }
    }
}
