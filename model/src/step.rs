//! `step`: the one function that applies an event to a stored delivery. It is the only place
//! stored data becomes typed state, and the only place a delivery changes state, in the
//! engine, the simulation and the model checker alike.

use crate::delivery::Delivery;
use crate::event::{
    Activity, Change, Effect, Event, EventKind, Observed, PassFacts, Permission, ScanResult, Step,
    WriteOutcome,
};
use crate::ids::{MessageId, Millis};
use crate::policy::{PlantedBug, Policy};
use crate::states::Target;
use crate::states::{
    AfterRefusal, BusyReason, HeldReason, NoResend, Observable, Pending, Releasable, ResendPlan,
    UnavailableReason, UncertainCause, WaitingReason,
};

/// What one arm of `step` produced, before the change is classified.
struct Out {
    record: Delivery,
    effects: Vec<Effect>,
}

// Short-lived, never stored: boxing `Done` would only add an allocation per step.
#[allow(clippy::large_enum_variant)]
enum Arm {
    Done(Out),
    Ignored(&'static str),
}

fn done(record: impl Into<Delivery>) -> Arm {
    Arm::Done(Out {
        record: record.into(),
        effects: Vec::new(),
    })
}

fn with(record: impl Into<Delivery>, effects: Vec<Effect>) -> Arm {
    Arm::Done(Out {
        record: record.into(),
        effects,
    })
}

/// Applies `event` to `record` under `policy`: the record to commit next, the effects to
/// perform after that commit, and what changed. It never fails and never panics: an event
/// that does not apply leaves the record untouched (`Change::Ignored`), and an event whose
/// result is already there is a no-op (`Change::Unchanged`).
pub fn step(record: Delivery, event: Event, policy: &Policy) -> Step {
    let before = record.clone();
    let now = event.now;
    let arm = match event.kind {
        EventKind::PassStarted(facts) => on_pass(record, facts, now, policy),
        EventKind::ActivityObserved { activity } => on_activity(record, &activity, now, policy),
        EventKind::Reservation {
            earlier_active,
            permission,
        } => on_reservation(record, earlier_active, permission, now),
        EventKind::SendBoundary {
            permission,
            recipient,
            activity,
            work_open,
        } => on_send_boundary(
            record,
            permission,
            recipient.as_ref(),
            &activity,
            work_open,
            now,
            policy,
        ),
        EventKind::WriteResult { outcome } => on_write_result(record, outcome, now, policy),
        EventKind::Observation { observed } => on_observation(record, observed, now, policy),
        EventKind::HistoryScan { scan } => on_scan(record, scan, now, policy),
        EventKind::Release { note } => on_release(record, note, now, policy),
        EventKind::TimePassed => on_time(record, now, policy),
    };
    match arm {
        Arm::Ignored(why) => Step {
            record: before,
            effects: Vec::new(),
            change: Change::Ignored { why },
        },
        Arm::Done(Out {
            mut record,
            effects,
        }) => {
            let (from, to) = (before.kind(), record.kind());
            let change = if from == to {
                // Staying in a state is never a new arrival: keep when it was entered, so
                // landing where it already is compares equal and is a no-op.
                record.core_mut().since = before.core().since;
                if record == before {
                    Change::Unchanged
                } else {
                    Change::Updated
                }
            } else {
                Change::Moved { from, to }
            };
            Step {
                record,
                effects,
                change,
            }
        }
    }
}

// ----- SPEC §2.2 steps 1–6, and §2.3 resends -----------------------------------------------

fn on_pass(record: Delivery, facts: PassFacts, now: Millis, policy: &Policy) -> Arm {
    match record {
        Delivery::Waiting(p) => pass_pending(p, &facts, now, policy),
        Delivery::Busy(p) => pass_pending(p, &facts, now, policy),
        Delivery::Held(p) => pass_pending(p, &facts, now, policy),
        Delivery::Unavailable(p) => pass_pending(p, &facts, now, policy),
        Delivery::OwnerRejected(p) => pass_pending(p, &facts, now, policy),
        Delivery::Uncertain(u) => {
            if policy.planted(PlantedBug::ResendFromUncertain) {
                #[cfg(feature = "planted-bugs")]
                return done(u.planted_resend(facts.fresh_request_id, now));
            }
            let request_id = u.core.request_id.clone();
            let mut effects = vec![Effect::Observe {
                request_id: request_id.clone(),
            }];
            let scan_due = u
                .scans
                .last_at
                .is_none_or(|at| now.since(at) >= policy.history_scan_interval_ms);
            if scan_due {
                effects.push(Effect::ScanHistory { request_id });
            }
            with(u, effects)
        }
        Delivery::Accepted(a) => {
            let request_id = a.core.request_id.clone();
            with(a, vec![Effect::Observe { request_id }])
        }
        Delivery::Running(r) => {
            let request_id = r.core.request_id.clone();
            with(r, vec![Effect::Observe { request_id }])
        }
        Delivery::Failed(f) => match f.resend {
            ResendPlan::Final { .. } => done(f),
            ResendPlan::NotBefore { at } => {
                if now.since(f.core.since) > policy.resend_window_ms {
                    done(f.finalize(NoResend::WindowPassed))
                } else if !facts.work_open {
                    done(f.finalize(NoResend::WorkDone))
                } else if now < at {
                    done(f)
                } else {
                    done(f.resend_with(facts.fresh_request_id, now))
                }
            }
        },
        other @ (Delivery::Sending(_)
        | Delivery::Returned(_)
        | Delivery::Acknowledged(_)
        | Delivery::Cancelled(_)
        | Delivery::Duplicate(_)) => done(other),
    }
}

fn pass_pending<P>(mut p: P, facts: &PassFacts, now: Millis, policy: &Policy) -> Arm
where
    P: Pending + Into<Delivery>,
{
    let core = p.core();
    // 1. The body changed since enrolment.
    if facts.body_hash != core.body_hash {
        return done(p.changed_after_queued(now));
    }
    // 2. Read by the recipient, unless this is an automatic resend of work still open.
    if facts.read_by_recipient && !(core.is_resend() && facts.work_open) {
        return done(p.acknowledge(now));
    }
    // A queued resend is only sent while its work is open (SPEC §2.3, G4).
    if core.is_resend() && !facts.work_open {
        return done(p.drop_resend(now));
    }
    // 3. Paused, or the connection is not allowed.
    match facts.permission {
        Permission::Paused => return done(p.hold(HeldReason::Paused, now)),
        Permission::Blocked => return done(p.hold(HeldReason::ConnectionBlocked, now)),
        Permission::Allowed => {}
    }
    // 4. The recipient is gone or moved: nothing is sent blind, nothing redirected.
    match &facts.recipient {
        None => return done(p.unavailable(UnavailableReason::AgentMissing, now)),
        Some(current) if !destination_changes(&core.target, current, policy).is_empty() => {
            let changed = destination_changes(&core.target, current, policy);
            return done(p.unavailable(UnavailableReason::TargetChanged { changed }, now));
        }
        Some(_) => {}
    }
    // 5. A one-shot tick cannot host a turn that lives inside its own process.
    if facts.one_shot && core.target.provider.turns_live_in_starting_process() {
        return done(p.wait(WaitingReason::NeedsRunningEngine, now));
    }
    // 6. An outage: the state stays, the reason goes in the detail, no attempt is spent.
    if let Some(outage) = facts
        .outage
        .as_ref()
        .filter(|_| !policy.planted(PlantedBug::IgnoreOutage))
    {
        p.core_mut().note = Some(format!("provider outage: {outage}; no attempt spent"));
        return done(p);
    }
    // Every check passed: a lifted hold queues again; then ask about activity (step 7).
    let record: Delivery = p.into();
    let record = match record {
        Delivery::Held(h) => h.wait(WaitingReason::Queued, now).into(),
        Delivery::Unavailable(u) => u.wait(WaitingReason::Queued, now).into(),
        Delivery::Waiting(w) if w.reason == WaitingReason::NeedsRunningEngine => {
            w.wait(WaitingReason::Queued, now).into()
        }
        mut other => {
            other.core_mut().note = None;
            other
        }
    };
    with(record, vec![Effect::CheckActivity])
}

// ----- step 7 ------------------------------------------------------------------------------

/// Whether `activity` forbids a write now, and why; `None` when the recipient is free.
enum Verdict {
    Free,
    Busy(BusyReason),
    Unknown(String),
}

fn judge(activity: &Activity, policy: &Policy) -> Verdict {
    match activity {
        Activity::Busy { turn, detail } => {
            if policy.planted(PlantedBug::SendWhileBusy) {
                Verdict::Free
            } else {
                Verdict::Busy(BusyReason::RecipientInTurn {
                    turn: turn.clone(),
                    detail: detail.clone(),
                })
            }
        }
        Activity::Unknown { .. } if policy.planted(PlantedBug::UnknownIsIdle) => Verdict::Free,
        Activity::Unknown { detail } => Verdict::Unknown(detail.clone()),
        Activity::Idle | Activity::Finished | Activity::Stopped | Activity::Failed => Verdict::Free,
    }
}

fn on_activity(record: Delivery, activity: &Activity, now: Millis, policy: &Policy) -> Arm {
    fn go<P: Pending + Into<Delivery>>(p: P, verdict: Verdict, now: Millis) -> Arm {
        match verdict {
            Verdict::Busy(reason) => done(p.busy(reason, now)),
            Verdict::Unknown(detail) => {
                done(p.unavailable(UnavailableReason::ActivityUnknown { detail }, now))
            }
            Verdict::Free => with(p, vec![Effect::Reserve]),
        }
    }
    let verdict = judge(activity, policy);
    match record {
        Delivery::Waiting(p) => go(p, verdict, now),
        Delivery::Busy(p) => go(p, verdict, now),
        Delivery::OwnerRejected(p) => go(p, verdict, now),
        // A pass turns a lifted hold into WAITING first; steps 1-6 are never skipped.
        Delivery::Held(_) | Delivery::Unavailable(_) => {
            Arm::Ignored("a held or unavailable delivery is re-checked by a pass first")
        }
        _ => Arm::Ignored("activity matters only before a reservation"),
    }
}

// ----- step 8 ------------------------------------------------------------------------------

fn on_reservation(
    record: Delivery,
    earlier_active: Option<MessageId>,
    permission: Permission,
    now: Millis,
) -> Arm {
    fn go<P: Pending + Into<Delivery>>(
        p: P,
        earlier: Option<MessageId>,
        permission: Permission,
        now: Millis,
    ) -> Arm {
        // A pause or a block committed since the pass began: held, no attempt spent.
        match permission {
            Permission::Paused => return done(p.hold(HeldReason::Paused, now)),
            Permission::Blocked => return done(p.hold(HeldReason::ConnectionBlocked, now)),
            Permission::Allowed => {}
        }
        match earlier {
            Some(message) if message != p.core().message => {
                done(p.busy(BusyReason::EarlierDelivery { message }, now))
            }
            _ => with(p.reserve(now), vec![Effect::Prepare]),
        }
    }
    match record {
        Delivery::Waiting(p) => go(p, earlier_active, permission, now),
        Delivery::Busy(p) => go(p, earlier_active, permission, now),
        Delivery::OwnerRejected(p) => go(p, earlier_active, permission, now),
        Delivery::Held(_) | Delivery::Unavailable(_) => {
            Arm::Ignored("a held or unavailable delivery is re-checked by a pass first")
        }
        // Already reserved: a repeated reservation reserves nothing more.
        s @ Delivery::Sending(_) => done(s),
        _ => Arm::Ignored("only a pending delivery can be reserved"),
    }
}

// ----- step 9 ------------------------------------------------------------------------------

fn on_send_boundary(
    record: Delivery,
    permission: Permission,
    recipient: Option<&Target>,
    activity: &Activity,
    work_open: bool,
    now: Millis,
    policy: &Policy,
) -> Arm {
    let Delivery::Sending(s) = record else {
        return Arm::Ignored("the send boundary is checked only while SENDING");
    };
    if s.write_issued() {
        // The write was handed over already; it is never handed over twice.
        if policy.planted(PlantedBug::WriteTwice) {
            let write = Effect::Write {
                request_id: s.core.request_id.clone(),
                target: s.core.target.clone(),
            };
            return with(s, vec![write]);
        }
        return done(s);
    }
    if s.core.is_resend() && !work_open {
        return done(s.back_out(now).drop_resend(now));
    }
    match permission {
        Permission::Paused => return done(s.back_out(now).hold(HeldReason::Paused, now)),
        Permission::Blocked => {
            return done(s.back_out(now).hold(HeldReason::ConnectionBlocked, now));
        }
        Permission::Allowed => {}
    }
    match recipient {
        None => {
            return done(
                s.back_out(now)
                    .unavailable(UnavailableReason::AgentMissing, now),
            );
        }
        Some(current) if !destination_changes(&s.core.target, current, policy).is_empty() => {
            let changed = destination_changes(&s.core.target, current, policy);
            return done(
                s.back_out(now)
                    .unavailable(UnavailableReason::TargetChanged { changed }, now),
            );
        }
        Some(_) => {}
    }
    let verdict = if policy.planted(PlantedBug::SkipBoundaryRecheck) {
        Verdict::Free
    } else {
        judge(activity, policy)
    };
    match verdict {
        Verdict::Busy(reason) => done(s.back_out(now).busy(reason, now)),
        Verdict::Unknown(detail) => done(
            s.back_out(now)
                .unavailable(UnavailableReason::ActivityUnknown { detail }, now),
        ),
        Verdict::Free => {
            let write = Effect::Write {
                request_id: s.core.request_id.clone(),
                target: s.core.target.clone(),
            };
            with(s.issue_write(now), vec![write])
        }
    }
}

// ----- step 10 -----------------------------------------------------------------------------

fn on_write_result(record: Delivery, outcome: WriteOutcome, now: Millis, policy: &Policy) -> Arm {
    match record {
        Delivery::Sending(s) if s.write_issued() => match outcome {
            WriteOutcome::Receipt { turn, request_id } => {
                if request_id.as_ref() == Some(&s.core.request_id) {
                    done(s.accept(turn, now))
                } else {
                    done(s.uncertain(UncertainCause::NoExactReceipt, Some(turn), now))
                }
            }
            WriteOutcome::Refused { detail } => match s.refused(detail, now, policy) {
                AfterRefusal::Retry(rejected) => done(rejected),
                AfterRefusal::Failed(failed) => done(failed),
            },
            WriteOutcome::Busy { detail } if policy.planted(PlantedBug::BusyAtWriteRefused) => {
                match s.refused(detail, now, policy) {
                    AfterRefusal::Retry(rejected) => done(rejected),
                    AfterRefusal::Failed(failed) => done(failed),
                }
            }
            // Busy at the write: nothing was written; wait as for a busy recipient. The
            // reserved attempt stays counted, unused; the next one reuses the request id.
            WriteOutcome::Busy { detail } => {
                let times = s.core.busy_at_write + 1;
                let mut waiting = s.back_out(now);
                waiting.core.busy_at_write = times;
                done(waiting.busy(BusyReason::AtTheWrite { detail, times }, now))
            }
            WriteOutcome::Withheld { detail } => {
                let mut waiting = s.back_out(now);
                waiting.reason = WaitingReason::Withheld { detail };
                done(waiting)
            }
            WriteOutcome::Failed { detail } => {
                done(s.uncertain(UncertainCause::WriteError { detail }, None, now))
            }
            WriteOutcome::TimedOut => done(s.uncertain(UncertainCause::NoReplyInTime, None, now)),
        },
        Delivery::Sending(_) => Arm::Ignored("no write was issued for this reservation"),
        // A late exact receipt settles an uncertain write.
        Delivery::Uncertain(u) => match outcome {
            WriteOutcome::Receipt {
                turn,
                request_id: Some(r),
            } if r == u.core.request_id => done(u.observed_accepted(turn, now)),
            _ => Arm::Ignored("only an exact receipt settles an uncertain write"),
        },
        d @ (Delivery::Accepted(_) | Delivery::Running(_) | Delivery::Returned(_))
            if matches!(outcome, WriteOutcome::Receipt { .. }) =>
        {
            done(d)
        }
        _ => Arm::Ignored("no write is in flight"),
    }
}

// ----- SPEC §2.3 observation ---------------------------------------------------------------

fn on_observation(record: Delivery, observed: Observed, now: Millis, policy: &Policy) -> Arm {
    match record {
        Delivery::Uncertain(u) => observe(u, observed, now, policy),
        Delivery::Accepted(a) => match observed {
            Observed::Accepted { .. } => {
                let mut a = a;
                a.observed_at = now;
                done(a)
            }
            other => observe(a, other, now, policy),
        },
        Delivery::Running(r) => match observed {
            Observed::Accepted { .. } | Observed::Running { .. } => {
                let mut r = r;
                r.observed_at = now;
                done(r)
            }
            Observed::Failed {
                turn_open: true, ..
            } => {
                let mut r = r;
                r.observed_at = now;
                r.core.note = Some("recoverable error".to_owned());
                done(r)
            }
            other => observe(r, other, now, policy),
        },
        d @ Delivery::Returned(_) if matches!(observed, Observed::Returned { .. }) => done(d),
        _ => Arm::Ignored("only an active delivery is observed"),
    }
}

fn observe<O>(o: O, observed: Observed, now: Millis, policy: &Policy) -> Arm
where
    O: Observable + Into<Delivery>,
{
    match observed {
        Observed::Accepted { turn } => done(o.observed_accepted(turn, now)),
        Observed::Running { turn } => done(o.observed_running(turn, now)),
        Observed::Returned { turn } => done(o.observed_returned(turn, now)),
        Observed::Failed {
            turn,
            turn_open: true,
            ..
        } => {
            let mut r = o.observed_running(turn, now);
            r.core.note = Some("recoverable error".to_owned());
            done(r)
        }
        Observed::Failed {
            turn,
            failure,
            turn_open: false,
        } => done(o.observed_failed(turn, failure, now, policy)),
        // Nothing learned; the unobserved limit and the history scans decide.
        Observed::NotFound | Observed::Unreachable { .. } => done(o),
    }
}

// ----- SPEC §2.4 honest release ------------------------------------------------------------

fn on_scan(record: Delivery, scan: ScanResult, now: Millis, policy: &Policy) -> Arm {
    let Delivery::Uncertain(mut u) = record else {
        return Arm::Ignored("history scans reconcile only UNCERTAIN deliveries");
    };
    match scan {
        ScanResult::Found {
            observed:
                observed @ (Observed::Accepted { .. }
                | Observed::Running { .. }
                | Observed::Returned { .. }
                | Observed::Failed { .. }),
        } => observe(u, observed, now, policy),
        ScanResult::Found { .. } | ScanResult::NothingFound { complete: false } => {
            u.scans.last_at = Some(now);
            done(u)
        }
        ScanResult::NothingFound { complete: true } => {
            u.scans.last_at = Some(now);
            if u.turn.is_some() {
                // A receipt proved it landed: no scan can prove otherwise.
                u.core.note =
                    Some("a receipt proved it landed; only a person can release it".to_owned());
                return done(u);
            }
            u.scans.empty += 1;
            let first = *u.scans.first_empty_at.get_or_insert(now);
            let scans_min = if policy.planted(PlantedBug::CancelEarly) {
                2
            } else {
                policy.history_scans_min
            };
            if u.scans.empty >= scans_min && now.since(first) >= policy.history_scan_span_ms {
                done(u.never_delivered(now))
            } else {
                done(u)
            }
        }
    }
}

fn on_release(record: Delivery, note: Option<String>, now: Millis, policy: &Policy) -> Arm {
    match record {
        Delivery::Waiting(s) => done(s.release(note, now)),
        Delivery::Busy(s) => done(s.release(note, now)),
        Delivery::Held(s) => done(s.release(note, now)),
        Delivery::Unavailable(s) => done(s.release(note, now)),
        Delivery::OwnerRejected(s) => done(s.release(note, now)),
        // A write in flight is about to have an outcome: releasing it now would free the
        // recipient while the write may still land (G3). Wait for the sending timeout.
        Delivery::Sending(s)
            if s.issued_at
                .is_some_and(|at| now.since(at) < policy.sending_timeout_ms) =>
        {
            Arm::Ignored("the write is in flight; its outcome is known within a minute")
        }
        Delivery::Sending(s) => done(s.release(note, now)),
        Delivery::Uncertain(s) => done(s.release(note, now)),
        Delivery::Accepted(s) => done(s.release(note, now)),
        Delivery::Running(s) => done(s.release(note, now)),
        Delivery::Failed(f) => match f.resend {
            ResendPlan::NotBefore { .. } => done(f.finalize(NoResend::Released)),
            ResendPlan::Final { .. } => Arm::Ignored("already FAILED; nothing to release"),
        },
        c @ Delivery::Cancelled(_) => done(c),
        Delivery::Returned(_) => Arm::Ignored("already RETURNED; nothing to release"),
        Delivery::Acknowledged(_) => Arm::Ignored("already ACKNOWLEDGED; nothing to release"),
        Delivery::Duplicate(_) => Arm::Ignored("a DUPLICATE was never sent; nothing to release"),
    }
}

// ----- SPEC §2.3 timeouts ------------------------------------------------------------------

fn on_time(record: Delivery, now: Millis, policy: &Policy) -> Arm {
    match record {
        // No receipt within the timeout of the write: it may have landed.
        Delivery::Sending(s)
            if s.issued_at
                .is_some_and(|at| now.since(at) >= policy.sending_timeout_ms) =>
        {
            done(s.uncertain(UncertainCause::NoReplyInTime, None, now))
        }
        // Reserved, but the write was never issued (the engine stopped while preparing): the
        // committed record proves nothing went out, so it queues again.
        Delivery::Sending(s)
            if s.issued_at.is_none() && now.since(s.reserved_at) >= policy.sending_timeout_ms =>
        {
            let mut w = s.back_out(now);
            w.core.note = Some("the engine stopped before writing; nothing was sent".to_owned());
            done(w)
        }
        Delivery::Accepted(a) if now.since(a.observed_at) >= policy.unobserved_limit_ms => {
            done(a.unobservable(now))
        }
        Delivery::Running(r) if now.since(r.observed_at) >= policy.unobserved_limit_ms => {
            done(r.unobservable(now))
        }
        other => done(other),
    }
}

/// What differs between the frozen destination and the registration now (G1).
fn destination_changes(frozen: &Target, current: &Target, policy: &Policy) -> Vec<String> {
    if policy.planted(PlantedBug::ResolveAtWrite) {
        // The planted bug: only the provider and endpoint count.
        let current = Target {
            route: frozen.route.clone(),
            ..current.clone()
        };
        return frozen.changes(&current);
    }
    frozen.changes(current)
}
