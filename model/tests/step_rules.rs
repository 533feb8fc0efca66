//! The rules of SPEC §2, one behaviour per test, driven through `step` exactly as the engine
//! drives it: pass → activity → reservation → boundary → write → observation.

use model::states::{NoResend, ResendPlan, TurnFailure};
use model::{
    Activity, AgentId, Change, Core, Delivery, Effect, Event, EventKind, MessageId, MessageKind,
    Millis, Observed, PassFacts, Permission, Policy, Provider, RequestId, ScanResult, StateKind,
    Target, TurnId, WriteOutcome,
};

const MIN: u64 = 60_000;
const HOUR: u64 = 60 * MIN;

fn target(provider: Provider) -> Target {
    Target {
        agent: AgentId::new("engineer"),
        provider,
        endpoint: "thread-1".to_owned(),
        cwd: "/repo".to_owned(),
        route: std::collections::BTreeMap::new(),
    }
}

fn new_delivery(kind: MessageKind, provider: Provider) -> Delivery {
    model::enrol(
        Core::enrol(
            MessageId::new("m1"),
            target(provider),
            kind,
            "h".to_owned(),
            RequestId::new("r1"),
            Millis(0),
        ),
        None,
    )
}

fn work() -> Delivery {
    new_delivery(MessageKind::Work, Provider::Command)
}

fn facts(provider: Provider) -> PassFacts {
    PassFacts {
        body_hash: "h".to_owned(),
        read_by_recipient: false,
        work_open: true,
        permission: Permission::Allowed,
        recipient: Some(target(provider)),
        one_shot: false,
        outage: None,
        fresh_request_id: RequestId::new("r-fresh"),
    }
}

/// A small engine over one record: every call is one `step`, at a clock it keeps.
struct Drive {
    record: Delivery,
    now: Millis,
    policy: Policy,
    effects: Vec<Effect>,
    change: Change,
}

impl Drive {
    fn new(record: Delivery) -> Drive {
        Drive {
            record,
            now: Millis(0),
            policy: Policy::default(),
            effects: Vec::new(),
            change: Change::Unchanged,
        }
    }
    fn at(&mut self, ms: u64) -> &mut Self {
        self.now = Millis(ms);
        self
    }
    fn on(&mut self, kind: EventKind) -> &mut Self {
        let step = model::step(
            self.record.clone(),
            Event::new(self.now, kind),
            &self.policy,
        );
        step.record.validate(&self.policy).expect("valid record");
        self.record = step.record;
        self.effects = step.effects;
        self.change = step.change;
        self
    }
    fn pass(&mut self) -> &mut Self {
        self.on(EventKind::PassStarted(facts(
            self.record.core().target().provider,
        )))
    }
    fn pass_with(&mut self, f: impl FnOnce(&mut PassFacts)) -> &mut Self {
        let mut facts = facts(self.record.core().target().provider);
        f(&mut facts);
        self.on(EventKind::PassStarted(facts))
    }
    fn activity(&mut self, activity: Activity) -> &mut Self {
        self.on(EventKind::ActivityObserved { activity })
    }
    fn reserve(&mut self) -> &mut Self {
        self.on(EventKind::Reservation {
            earlier_active: None,
            permission: Permission::Allowed,
        })
    }
    fn boundary(&mut self) -> &mut Self {
        let recipient = Some(self.record.core().target().clone());
        self.on(EventKind::SendBoundary {
            permission: Permission::Allowed,
            recipient,
            activity: Activity::Idle,
            work_open: true,
        })
    }
    fn write(&mut self, outcome: WriteOutcome) -> &mut Self {
        self.on(EventKind::WriteResult { outcome })
    }
    fn exact_receipt(&mut self) -> &mut Self {
        let request_id = Some(self.record.core().request_id().clone());
        self.write(WriteOutcome::Receipt {
            turn: TurnId::new("t1"),
            request_id,
        })
    }
    fn observe(&mut self, observed: Observed) -> &mut Self {
        self.on(EventKind::Observation { observed })
    }
    fn scan(&mut self, scan: ScanResult) -> &mut Self {
        self.on(EventKind::HistoryScan { scan })
    }
    /// Pass, idle, reserve, boundary: up to the write.
    fn up_to_write(&mut self) -> &mut Self {
        self.pass().activity(Activity::Idle).reserve().boundary()
    }
    fn kind(&self) -> StateKind {
        self.record.kind()
    }
}

fn failed_turn(failure: TurnFailure) -> Observed {
    Observed::Failed {
        turn: TurnId::new("t1"),
        failure,
        turn_open: false,
    }
}

#[test]
fn an_idle_recipient_gets_exactly_one_write_after_a_committed_reservation() {
    let mut d = Drive::new(work());
    d.pass();
    assert_eq!(d.effects, vec![Effect::CheckActivity]);
    d.activity(Activity::Idle);
    assert_eq!(d.effects, vec![Effect::Reserve]);
    d.reserve();
    assert_eq!(d.kind(), StateKind::Sending);
    assert_eq!(d.record.core().attempts(), 1);
    assert_eq!(
        d.effects,
        vec![Effect::Prepare],
        "nothing is written before the commit"
    );
    d.boundary();
    assert!(
        matches!(d.effects.as_slice(), [Effect::Write { request_id, .. }] if request_id.as_str() == "r1")
    );
    d.boundary();
    assert!(
        d.effects.is_empty(),
        "a repeated boundary never writes twice"
    );
    assert_eq!(d.change, Change::Unchanged);
    d.exact_receipt();
    assert_eq!(d.kind(), StateKind::Accepted);
}

/// The engine begins the pass over a write it just saw accepted inside the write result's own
/// transaction (`engine::after_write`), without the outage guard's answer or the other
/// facts a separate pass reads first: sound only because a pass over an ACCEPTED record
/// asks for its observation whatever the facts say, and the time check at the moment of
/// acceptance moves nothing.
#[test]
fn a_pass_over_a_write_just_accepted_asks_for_its_observation_whatever_the_facts() {
    let mut d = Drive::new(work());
    d.at(MIN).up_to_write().exact_receipt();
    assert_eq!(d.kind(), StateKind::Accepted);
    let accepted = d.record.clone();
    d.on(EventKind::TimePassed);
    assert_eq!(
        d.change,
        Change::Unchanged,
        "no time has passed since the receipt"
    );
    let request_id = accepted.core().request_id().clone();
    let variants: [fn(&mut PassFacts); 7] = [
        |_| {},
        |f| f.outage = Some("the recipient's status page is red".to_owned()),
        |f| f.permission = Permission::Paused,
        |f| f.permission = Permission::Blocked,
        |f| f.recipient = None,
        |f| {
            f.work_open = false;
            f.read_by_recipient = true;
        },
        |f| {
            f.one_shot = true;
            f.body_hash = "changed".to_owned();
        },
    ];
    for change_facts in variants {
        d.record = accepted.clone();
        d.pass_with(change_facts);
        assert_eq!(d.record, accepted, "the record stays as it was");
        assert_eq!(
            d.effects,
            vec![Effect::Observe {
                request_id: request_id.clone()
            }]
        );
    }
}

#[test]
fn busy_recipient_waits_until_its_turn_ends() {
    let mut d = Drive::new(work());
    d.pass().activity(Activity::Busy {
        turn: Some(TurnId::new("theirs")),
        detail: None,
    });
    assert_eq!(d.kind(), StateKind::Busy);
    assert!(d.effects.is_empty());
    d.pass().activity(Activity::Finished).reserve();
    assert_eq!(d.kind(), StateKind::Sending);
}

#[test]
fn a_second_delivery_waits_for_the_earlier_one() {
    let mut d = Drive::new(work());
    d.pass()
        .activity(Activity::Idle)
        .on(EventKind::Reservation {
            earlier_active: Some(MessageId::new("m0")),
            permission: Permission::Allowed,
        });
    assert_eq!(d.kind(), StateKind::Busy);
    assert!(
        d.record
            .detail()
            .contains("waiting for the earlier delivery m0")
    );
    assert_eq!(d.record.core().attempts(), 0, "no attempt spent");
}

#[test]
fn a_block_committed_after_the_pass_began_holds_at_the_reservation() {
    // The pass saw the connection allowed; a person blocked it while the activity was
    // looked up. The reservation's own read sees the block: HELD, no attempt spent.
    let mut d = Drive::new(work());
    d.pass()
        .activity(Activity::Idle)
        .on(EventKind::Reservation {
            earlier_active: None,
            permission: Permission::Blocked,
        });
    assert_eq!(d.kind(), StateKind::Held);
    assert_eq!(d.record.core().attempts(), 0, "no attempt spent");
    assert!(d.effects.is_empty(), "nothing prepared: {:?}", d.effects);
}

#[test]
fn a_receipt_without_our_request_id_is_uncertain() {
    let mut d = Drive::new(work());
    d.up_to_write().write(WriteOutcome::Receipt {
        turn: TurnId::new("t1"),
        request_id: None,
    });
    assert_eq!(d.kind(), StateKind::Uncertain);
}

#[test]
fn second_refusal_fails_without_holding_recipient() {
    let mut d = Drive::new(work());
    let refused = || WriteOutcome::Refused {
        detail: "session locked".to_owned(),
    };
    d.up_to_write().write(refused());
    assert_eq!(d.kind(), StateKind::OwnerRejected);
    d.up_to_write().write(refused());
    assert_eq!(d.kind(), StateKind::Failed);
    assert!(d.record.detail().contains("refused twice; never delivered"));
    assert!(!d.record.is_active(), "a FAILED delivery holds nobody");
    d.pass();
    assert_eq!(
        d.kind(),
        StateKind::Failed,
        "never resent: no turn was delivered"
    );
}

#[test]
fn a_write_turned_away_busy_waits_and_never_counts_as_a_refusal() {
    let mut d = Drive::new(work());
    let busy = || WriteOutcome::Busy {
        detail: "thread t is open in another Codex process".to_owned(),
    };
    for _ in 0..3 {
        d.up_to_write().write(busy());
        assert_eq!(d.kind(), StateKind::Busy, "a busy recipient is waited for");
        assert!(d.record.detail().contains("busy at the write"));
        assert_eq!(d.record.core().refusals(), 0, "no refusal counted");
        assert_eq!(
            d.record.core().request_id().as_str(),
            "r1",
            "nothing was written"
        );
    }
    d.up_to_write().write(WriteOutcome::Refused {
        detail: "not now".to_owned(),
    });
    assert_eq!(d.kind(), StateKind::OwnerRejected, "the first real refusal");
    d.up_to_write().write(WriteOutcome::Receipt {
        turn: TurnId::new("t1"),
        request_id: Some(RequestId::new("r1")),
    });
    assert_eq!(d.kind(), StateKind::Accepted);
    assert_eq!(
        d.record.core().attempts(),
        5,
        "each reservation counted, unused or not"
    );
}

#[test]
fn a_write_withheld_by_a_fenced_engine_is_queued_again_and_never_backs_out_an_uncertain_one() {
    let withheld = || WriteOutcome::Withheld {
        detail: "engine e1 lost the lease on bob before its write".to_owned(),
    };
    let mut d = Drive::new(work());
    d.up_to_write().write(withheld());
    assert_eq!(d.kind(), StateKind::Waiting, "nothing was written");
    assert!(
        d.record
            .detail()
            .contains("nothing written: engine e1 lost the lease"),
        "{}",
        d.record.detail()
    );
    assert_eq!(d.record.core().request_id().as_str(), "r1");
    assert_eq!(d.record.core().attempts(), 1, "the attempt stays counted");
    d.up_to_write().write(WriteOutcome::Receipt {
        turn: TurnId::new("t1"),
        request_id: Some(RequestId::new("r1")),
    });
    assert_eq!(
        d.kind(),
        StateKind::Accepted,
        "delivered by the next reservation"
    );
    // Past the sending timeout the write is UNCERTAIN: a late word from the fenced engine
    // changes nothing (nothing is resent from UNCERTAIN).
    let mut d = Drive::new(work());
    d.up_to_write();
    d.at(60_000).on(EventKind::TimePassed);
    assert_eq!(d.kind(), StateKind::Uncertain);
    d.write(withheld());
    assert_eq!(
        d.kind(),
        StateKind::Uncertain,
        "never backed out once UNCERTAIN"
    );
}

#[test]
fn a_write_with_no_reply_in_sixty_seconds_becomes_uncertain_and_is_never_resent() {
    let mut d = Drive::new(work());
    d.up_to_write();
    d.at(59_999).on(EventKind::TimePassed);
    assert_eq!(d.kind(), StateKind::Sending);
    d.at(60_000).on(EventKind::TimePassed);
    assert_eq!(d.kind(), StateKind::Uncertain);
    d.at(30 * HOUR).pass();
    assert_eq!(d.kind(), StateKind::Uncertain);
    assert_eq!(
        d.record.core().request_id().as_str(),
        "r1",
        "no fresh request id"
    );
    assert!(!d.effects.iter().any(|e| matches!(e, Effect::Write { .. })));
}

#[test]
fn a_delivery_that_just_became_uncertain_is_due_for_its_first_scan_at_once() {
    // An engine that stops right after committing UNCERTAIN must leave it due at once, or
    // the next engine waits for its fallback before the first scan (the kill test's stall).
    let mut d = Drive::new(work());
    d.up_to_write();
    d.at(60_000).on(EventKind::TimePassed);
    assert_eq!(d.kind(), StateKind::Uncertain);
    assert_eq!(d.record.next_deadline(&d.policy), Some(Millis(60_000)));
    d.at(60_001).on(EventKind::HistoryScan {
        scan: ScanResult::NothingFound { complete: false },
    });
    assert_eq!(
        d.record.next_deadline(&d.policy),
        Some(Millis(60_001 + d.policy.history_scan_interval_ms))
    );
}

#[test]
fn three_empty_complete_scans_over_an_hour_cancel_an_uncertain_delivery() {
    let mut d = Drive::new(work());
    d.up_to_write().write(WriteOutcome::TimedOut);
    let empty = || ScanResult::NothingFound { complete: true };
    d.at(MIN).scan(empty());
    d.at(31 * MIN).scan(empty());
    d.at(59 * MIN).scan(empty());
    assert_eq!(
        d.kind(),
        StateKind::Uncertain,
        "three scans within 58 minutes are not enough"
    );
    d.at(61 * MIN)
        .scan(ScanResult::NothingFound { complete: false });
    assert_eq!(
        d.kind(),
        StateKind::Uncertain,
        "an incomplete scan proves nothing"
    );
    d.at(62 * MIN).scan(empty());
    assert_eq!(d.kind(), StateKind::Cancelled);
    assert!(d.record.detail().contains("never delivered"));
}

#[test]
fn a_scan_that_finds_the_request_moves_to_what_it_saw() {
    let mut d = Drive::new(work());
    d.up_to_write().write(WriteOutcome::TimedOut);
    d.at(MIN).scan(ScanResult::NothingFound { complete: true });
    d.at(31 * MIN).scan(ScanResult::Found {
        observed: Observed::Returned {
            turn: TurnId::new("t1"),
        },
    });
    assert_eq!(d.kind(), StateKind::Returned);
}

#[test]
fn a_delivery_with_a_receipt_is_never_cancelled_by_scans() {
    let mut d = Drive::new(work());
    d.up_to_write().exact_receipt();
    d.at(11 * MIN).on(EventKind::TimePassed);
    assert_eq!(d.kind(), StateKind::Uncertain);
    for minute in [12, 43, 74, 105, 136] {
        d.at(minute * MIN)
            .scan(ScanResult::NothingFound { complete: true });
    }
    assert_eq!(d.kind(), StateKind::Uncertain);
    d.on(EventKind::Release {
        note: Some("checked the session by hand".to_owned()),
    });
    assert_eq!(d.kind(), StateKind::Cancelled);
}

#[test]
fn an_errored_turn_is_resent_twice_at_most_each_with_a_fresh_request_id() {
    let mut d = Drive::new(work());
    let mut ids = vec![];
    for round in 0..3 {
        d.up_to_write().exact_receipt();
        ids.push(d.record.core().request_id().clone());
        d.observe(failed_turn(TurnFailure::Errored));
        assert_eq!(d.kind(), StateKind::Failed);
        d.pass_with(|f| f.fresh_request_id = RequestId::new(format!("r-{round}")));
        if round < 2 {
            assert_eq!(d.kind(), StateKind::Waiting, "resend {round}");
            assert_eq!(d.record.core().attempts(), 0);
        }
    }
    assert_eq!(d.kind(), StateKind::Failed);
    assert!(matches!(
        &d.record,
        Delivery::Failed(f) if *f.resend() == ResendPlan::Final { why: NoResend::LimitReached }
    ));
    assert_eq!(ids, ["r1", "r-0", "r-1"].map(RequestId::new));
    assert_eq!(
        d.record.core().earlier_request_ids(),
        ["r1", "r-0"].map(RequestId::new)
    );
}

#[test]
fn an_interrupted_turn_is_resent_once_no_sooner_than_ten_minutes_later() {
    let mut d = Drive::new(work());
    d.up_to_write().exact_receipt();
    d.at(MIN).observe(failed_turn(TurnFailure::Interrupted));
    d.at(10 * MIN).pass();
    assert_eq!(d.kind(), StateKind::Failed, "9 minutes is too soon");
    d.at(11 * MIN).pass();
    assert_eq!(d.kind(), StateKind::Waiting);
    d.up_to_write().exact_receipt();
    d.at(12 * MIN)
        .observe(failed_turn(TurnFailure::Interrupted));
    d.at(30 * MIN).pass();
    assert_eq!(
        d.kind(),
        StateKind::Failed,
        "only one resend after an interruption"
    );
}

#[test]
fn no_resend_once_the_work_is_returned_or_the_window_has_passed() {
    let mut d = Drive::new(work());
    d.up_to_write()
        .exact_receipt()
        .observe(failed_turn(TurnFailure::Errored));
    let mut late = Drive::new(d.record.clone());
    d.pass_with(|f| f.work_open = false);
    assert!(
        matches!(&d.record, Delivery::Failed(f) if *f.resend() == ResendPlan::Final { why: NoResend::WorkDone })
    );
    d.pass();
    assert_eq!(d.kind(), StateKind::Failed, "the decision is final");
    late.at(25 * HOUR).pass();
    assert!(
        matches!(&late.record, Delivery::Failed(f) if *f.resend() == ResendPlan::Final { why: NoResend::WindowPassed })
    );
}

#[test]
fn a_plain_message_read_by_its_recipient_is_acknowledged_but_a_resend_of_open_work_is_not() {
    let mut plain = Drive::new(new_delivery(MessageKind::Plain, Provider::Command));
    plain.pass_with(|f| f.read_by_recipient = true);
    assert_eq!(plain.kind(), StateKind::Acknowledged);

    let mut w = Drive::new(work());
    w.up_to_write()
        .exact_receipt()
        .observe(failed_turn(TurnFailure::Errored));
    w.pass_with(|f| f.read_by_recipient = true);
    assert_eq!(w.kind(), StateKind::Waiting, "the resend goes on");
    w.pass_with(|f| f.read_by_recipient = true);
    assert_eq!(
        w.kind(),
        StateKind::Waiting,
        "reading does not close open work"
    );
}

#[test]
fn an_outage_spends_no_attempt_and_says_why() {
    let mut d = Drive::new(work());
    d.pass_with(|f| f.outage = Some("api degraded".to_owned()));
    assert_eq!(d.kind(), StateKind::Waiting);
    assert!(d.effects.is_empty());
    assert_eq!(d.record.core().attempts(), 0);
    assert!(d.record.detail().contains("api degraded"));
    d.pass_with(|f| f.outage = Some("api degraded".to_owned()));
    assert_eq!(
        d.change,
        Change::Unchanged,
        "a second pass in the same outage writes nothing new"
    );
    d.pass();
    assert_eq!(d.effects, vec![Effect::CheckActivity]);
    assert!(d.record.core().note().is_none());
}

#[test]
fn a_paused_or_blocked_delivery_is_held_and_queued_again_when_allowed() {
    let mut d = Drive::new(work());
    d.pass_with(|f| f.permission = Permission::Blocked);
    assert_eq!(d.kind(), StateKind::Held);
    d.pass_with(|f| f.permission = Permission::Blocked);
    assert_eq!(d.change, Change::Unchanged);
    d.pass();
    assert_eq!(d.kind(), StateKind::Waiting);
    assert_eq!(d.effects, vec![Effect::CheckActivity]);
}

#[test]
fn a_moved_or_missing_agent_gets_nothing_sent_blind() {
    let mut d = Drive::new(work());
    d.pass_with(|f| f.recipient = None);
    assert_eq!(d.kind(), StateKind::Unavailable);
    d.pass_with(|f| {
        if let Some(t) = f.recipient.as_mut() {
            t.endpoint = "thread-2".to_owned();
        }
    });
    assert_eq!(d.kind(), StateKind::Unavailable);
    assert!(d.record.detail().contains("nothing is redirected"));
    // Moved between the reservation and the write: backed out, nothing written.
    let mut e = Drive::new(work());
    e.pass().activity(Activity::Idle).reserve();
    let mut moved = target(Provider::Command);
    moved.endpoint = "thread-2".to_owned();
    e.on(EventKind::SendBoundary {
        permission: Permission::Allowed,
        recipient: Some(moved),
        activity: Activity::Idle,
        work_open: true,
    });
    assert_eq!(e.kind(), StateKind::Unavailable);
    assert!(e.effects.is_empty());
}

#[test]
fn a_one_shot_tick_never_starts_a_codex_turn() {
    let mut d = Drive::new(new_delivery(MessageKind::Work, Provider::Codex));
    d.pass_with(|f| f.one_shot = true);
    assert_eq!(d.kind(), StateKind::Waiting);
    assert!(d.effects.is_empty());
    assert!(d.record.detail().contains("handoffs run"));
    d.pass();
    assert_eq!(d.effects, vec![Effect::CheckActivity]);
}

#[test]
fn a_message_edited_after_queueing_fails_unsent() {
    let mut d = Drive::new(work());
    d.pass_with(|f| f.body_hash = "other".to_owned());
    assert_eq!(d.kind(), StateKind::Failed);
    assert!(d.record.detail().contains("changed after it was queued"));
}

#[test]
fn a_failed_report_while_the_turn_is_open_is_running() {
    let mut d = Drive::new(work());
    d.up_to_write().exact_receipt().observe(Observed::Failed {
        turn: TurnId::new("t1"),
        failure: TurnFailure::Errored,
        turn_open: true,
    });
    assert_eq!(d.kind(), StateKind::Running);
    assert!(d.record.detail().contains("recoverable error"));
}

#[test]
fn an_unobservable_turn_becomes_uncertain_after_ten_minutes() {
    let mut d = Drive::new(work());
    d.up_to_write().exact_receipt();
    d.at(9 * MIN).observe(Observed::Running {
        turn: TurnId::new("t1"),
    });
    d.at(18 * MIN).observe(Observed::Unreachable {
        detail: "down".to_owned(),
    });
    d.on(EventKind::TimePassed);
    assert_eq!(d.kind(), StateKind::Running, "observed 9 minutes ago");
    d.at(19 * MIN).on(EventKind::TimePassed);
    assert_eq!(d.kind(), StateKind::Uncertain);
}

#[test]
fn release_cancels_a_stuck_delivery_and_is_a_no_op_when_repeated() {
    let mut d = Drive::new(work());
    d.up_to_write().write(WriteOutcome::TimedOut);
    d.on(EventKind::Release { note: None });
    assert_eq!(d.kind(), StateKind::Cancelled);
    d.on(EventKind::Release { note: None });
    assert_eq!(d.change, Change::Unchanged);
    let mut done = Drive::new(work());
    done.up_to_write()
        .exact_receipt()
        .observe(Observed::Returned {
            turn: TurnId::new("t1"),
        });
    done.on(EventKind::Release { note: None });
    assert!(matches!(done.change, Change::Ignored { why } if why.contains("RETURNED")));
}

#[test]
fn stale_events_are_ignored_and_leave_the_record_untouched() {
    let mut d = Drive::new(work());
    let before = d.record.clone();
    d.exact_receipt();
    assert!(matches!(d.change, Change::Ignored { .. }));
    assert_eq!(d.record, before);
}
