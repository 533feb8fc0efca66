//! The guarantees of SPEC §3 as stateright properties. They judge the ghost log (what the
//! recipient really saw) against the numbers SPEC promises, not against the policy the engine
//! was given, so a broken policy is caught rather than believed.

use super::world::{HOUR_MS, MINUTE_MS, REMINDER_LAG_MS, Session, State, World, target};
use model::states::{HeldReason, TurnFailure, UnavailableReason};
use model::{Delivery, Policy, StateKind};
use stateright::{Model, Property};

/// The bounds SPEC §2 promises.
fn spec() -> Policy {
    Policy::default()
}

/// Every write reached the destination the recipient was registered at when its message was
/// sent: read from the world (where the write landed, where the agent was), not the record.
pub fn g1_exact_recipient(_: &World, s: &State) -> bool {
    !s.ghost.issued_to_moved_agent
        && s.ghost
            .writes
            .iter()
            .all(|w| s.ghost.queued_for[w.msg as usize] == Some(w.landed_at))
}

pub fn g2_one_write_per_attempt(_: &World, s: &State) -> bool {
    let retries = spec().refusal_retries_max as usize;
    let per_message = (0..s.store.len()).all(|k| {
        let writes = s
            .ghost
            .writes
            .iter()
            .filter(|w| w.msg as usize == k)
            .count();
        writes <= s.ghost.reservations[k] as usize
    });
    let per_request = s.ghost.writes.iter().all(|w| {
        let same = || {
            s.ghost
                .writes
                .iter()
                .filter(|x| x.request_id == w.request_id)
        };
        same().filter(|x| !x.refused).count() <= 1 && same().count() <= 1 + retries
    });
    per_message && per_request
}

/// No write reached a busy session, at most one delivery per recipient is active, and a busy
/// recipient is waited for: a write its app turned away because the session was busy at that
/// moment never counts as a refusal (each record's refusals are refusals the app really made,
/// for its request id), so a race with a person's turn never ends a delivery FAILED.
pub fn g3_never_interrupt(w: &World, s: &State) -> bool {
    let waited_for = s.store.iter().enumerate().all(|(k, d)| {
        d.as_ref().is_none_or(|d| {
            let refused = s
                .ghost
                .writes
                .iter()
                .filter(|x| {
                    x.msg as usize == k && x.refused && &x.request_id == d.core().request_id()
                })
                .count();
            d.core().refusals() as usize <= refused
        })
    });
    waited_for && g3_one_at_a_time(w, s)
}

fn g3_one_at_a_time(w: &World, s: &State) -> bool {
    let one_active_each = (0..w.recipient_count()).all(|r| {
        let active = s
            .store
            .iter()
            .zip(&w.messages)
            .filter(|(d, m)| m.to as usize == r && d.as_ref().is_some_and(Delivery::is_active))
            .count();
        active <= 1
    });
    one_active_each && s.ghost.writes.iter().all(|w| !w.session_busy)
}

/// Nothing is written while the recipient's activity cannot be verified.
pub fn nothing_written_blind(_: &World, s: &State) -> bool {
    !s.ghost.issued_while_unknown
}

pub fn g4_bounded_resend(_: &World, s: &State) -> bool {
    let spec = spec();
    let counts_ok = (0..s.store.len()).all(|k| {
        let of = |f: TurnFailure| {
            s.ghost
                .resends
                .iter()
                .filter(|r| r.msg as usize == k && r.failure == Some(f))
                .count()
        };
        of(TurnFailure::Errored) <= spec.error_resends_max as usize
            && of(TurnFailure::Interrupted) <= spec.interrupt_resends_max as usize
    });
    let each_ok = s.ghost.resends.iter().all(|r| {
        let waited = r.at.since(r.failed_at);
        r.from == StateKind::Failed
            && r.failure.is_some()
            && r.fresh_id_new
            && r.work_open
            && waited <= spec.resend_window_ms
            && (r.failure != Some(TurnFailure::Interrupted)
                || waited >= spec.interrupt_resend_wait_ms)
    });
    let writes_ok = !s.ghost.issued_resend_of_done_work;
    counts_ok && each_ok && writes_ok
}

pub fn g5_honest_release(_: &World, s: &State) -> bool {
    let spec = spec();
    s.ghost.cancels.iter().all(|c| {
        if c.by_person {
            return true;
        }
        let scans: Vec<_> = s
            .ghost
            .scans
            .iter()
            .filter(|x| x.msg == c.msg && x.request_id == c.request_id && x.complete_and_empty)
            .collect();
        let span = match (scans.first(), scans.last()) {
            (Some(a), Some(b)) => b.at.since(a.at),
            _ => 0,
        };
        scans.len() >= spec.history_scans_min as usize
            && span >= spec.history_scan_span_ms
            && !s.history.iter().any(|l| l.request_id == c.request_id)
    })
}

pub fn g6_outages_hold(_: &World, s: &State) -> bool {
    !s.ghost.reserved_during_outage
}

/// G7: overdue work reminds its sender exactly once, in time (at its due time, within SPEC's
/// lag), and only while the work is open; work returned before its due time is never
/// reminded. Judged from the reminders the senders received and when the work was returned.
/// (That a reminder never becomes a turn holds by construction here: the world posts it to
/// the sender and enrols nothing for it, as the engine does; the simulation and the
/// real-process test check it.)
pub fn g7_deadlines(_: &World, s: &State) -> bool {
    s.msgs.iter().enumerate().all(|(k, m)| {
        let mut reminders = s.ghost.reminders.iter().filter(|r| r.msg as usize == k);
        let Some(due) = m.due_at else {
            return reminders.next().is_none();
        };
        let reminders: Vec<_> = reminders.collect();
        let late = due.plus_ms(REMINDER_LAG_MS);
        let each_in_time = reminders
            .iter()
            .all(|r| r.work_open && r.at >= due && r.at <= late);
        let returned_before_due = m.returned_at.is_some_and(|r| r < due);
        let open_past_lag = m.returned_at.is_none_or(|r| r > late);
        let count_ok = if returned_before_due {
            reminders.is_empty()
        } else if open_past_lag && s.now > late {
            reminders.len() == 1
        } else {
            reminders.len() <= 1
        };
        each_in_time && count_ok
    })
}

/// G8: nothing a crash can reach is lost, and every write was reserved on stable storage
/// first. Read from the durable store (`State::store`), never from what a process still holds
/// in memory:
/// - every message whose sender was told "sent" has its delivery in the durable store, or its
///   enrolment is still held by the live process about to commit it. A crash empties every
///   process's memory, so in every state after any crash each acknowledged send is enrolled
///   durably;
/// - every turn that landed belongs to a stored delivery (one of its request ids);
/// - every write arrived while the durable store held its committed reservation (looked up
///   as it arrived).
pub fn g8_durability(_: &World, s: &State) -> bool {
    let nothing_lost = (0..s.store.len())
        .all(|k| !s.ghost.sent_ok[k] || s.store[k].is_some() || s.uncommitted[k].is_some());
    let every_turn_traceable = s.history.iter().all(|landed| {
        s.store[landed.msg as usize].as_ref().is_some_and(|d| {
            let core = d.core();
            core.request_id() == &landed.request_id
                || core.earlier_request_ids().contains(&landed.request_id)
        })
    });
    let committed_before_write = s.ghost.writes.iter().all(|w| w.committed_before);
    nothing_lost && every_turn_traceable && committed_before_write
}

pub fn records_stay_valid(w: &World, s: &State) -> bool {
    s.store
        .iter()
        .flatten()
        .all(|d| d.validate(&w.policy).is_ok())
}

/// Settled, or resting in a pending state for a reason that still holds (SPEC §3, liveness):
/// held while deliveries are paused or the connection blocked, unavailable while its
/// recipient is registered elsewhere than its frozen target.
fn settled_or_resting(w: &World, s: &State, k: usize) -> bool {
    let Some(record) = &s.store[k] else {
        return false;
    };
    if record.is_settled() {
        return true;
    }
    match record {
        Delivery::Held(held) => match held.reason() {
            HeldReason::Paused => s.paused,
            HeldReason::ConnectionBlocked => s.blocked,
        },
        Delivery::Unavailable(unavailable) => {
            let to = w.messages[k].to;
            let now_at = target(to, s.recipients[to as usize].dest);
            matches!(
                unavailable.reason(),
                UnavailableReason::TargetChanged { .. }
            ) && !unavailable.core().target().same_destination(&now_at)
        }
        _ => false,
    }
}

/// At rest: nothing can happen any more, within the world's horizon. No action of the
/// engine, a recipient, a person, a fault or the clock leads anywhere. (The checks before
/// `actions` are shortcuts: a write in flight, a turn, an outage, a host down, a pause or a
/// block always has an action that changes something.)
fn at_rest(w: &World, s: &State) -> bool {
    if !s.inflight.is_empty()
        || s.outage
        || s.paused
        || s.blocked
        || s.recipients
            .iter()
            .any(|r| r.down || r.session != Session::Idle)
    {
        return false;
    }
    let mut actions = Vec::new();
    w.actions(s, &mut actions);
    !actions
        .into_iter()
        .any(|a| w.next_state(s, a).is_some_and(|n| w.within_boundary(&n)))
}

/// Liveness (SPEC §3): once the faults stop, every delivery settles (RETURNED, ACKNOWLEDGED,
/// DUPLICATE, CANCELLED, FAILED with its resends spent or not allowed) or rests for a reason
/// that still holds, within a bound.
///
/// Checked as an `always` property over the states where the world is at rest (nothing can
/// happen any more), which are exactly the ends of the world's paths. Every path ends: each
/// fault and each human act has a counter, so faults are finite; the healing acts (an outage
/// ends, a host comes back, a person's turn ends, a pause or block is lifted) stay enabled
/// until taken, so no path ends before they happen, and in an urgent world time passes only
/// when nothing else can. That is weak fairness of the healing and of the engine: an action
/// that stays enabled is eventually taken. The world's horizon is the bound: a delivery still
/// waiting for a deadline past it is not settled within the bound, and fails.
///
/// (stateright's `Property::eventually` judges the path that first reached each state, and
/// skips the same state reached by another path; an `always` property over resting states
/// judges every end, whichever path led there.)
pub fn every_delivery_settles(w: &World, s: &State) -> bool {
    (0..s.store.len()).all(|k| settled_or_resting(w, s, k)) || !at_rest(w, s)
}

/// The world came to rest after a fault left a delivery UNCERTAIN, and it settled.
pub fn uncertain_delivery_settles_after_faults(w: &World, s: &State) -> bool {
    !s.ghost.scans.is_empty()
        && (0..s.store.len()).all(|k| settled_or_resting(w, s, k))
        && at_rest(w, s)
}

/// At rest with a delivery UNAVAILABLE because its recipient is registered elsewhere: the
/// resting clause of liveness is used.
pub fn rests_unavailable_at_rest(w: &World, s: &State) -> bool {
    (0..s.store.len()).all(|k| settled_or_resting(w, s, k))
        && s.store
            .iter()
            .flatten()
            .any(|d| d.kind() == StateKind::Unavailable)
        && at_rest(w, s)
}

/// Two crashes struck the engine with work in flight.
pub fn two_crashes_mid_write(_: &World, s: &State) -> bool {
    s.ghost.crashed_mid_write.len() >= 2
}

/// A handoff sent before a crash is in the durable store after it.
pub fn sent_handoff_survives_a_crash(_: &World, s: &State) -> bool {
    s.ghost
        .crashed_mid_write
        .iter()
        .any(|&k| s.ghost.sent_ok[k as usize] && s.store[k as usize].is_some())
}

/// Deliveries to two recipients are active at the same time (G3 is per recipient).
pub fn two_recipients_active_at_once(w: &World, s: &State) -> bool {
    let active = |r: u8| {
        s.store
            .iter()
            .zip(&w.messages)
            .any(|(d, m)| m.to == r && d.as_ref().is_some_and(Delivery::is_active))
    };
    active(0) && active(1)
}

/// A write was turned away busy twice (a person's turn took the session as it arrived), and
/// the delivery went on to be taken as a turn.
pub fn turned_away_busy_twice_then_delivered(_: &World, s: &State) -> bool {
    s.ghost.turned_away_busy.len() >= 2
        && s.store.iter().flatten().any(|d| {
            matches!(
                d.kind(),
                StateKind::Returned | StateKind::Accepted | StateKind::Running
            ) && s
                .ghost
                .turned_away_busy
                .iter()
                .filter(|r| *r == d.core().request_id())
                .count()
                >= 2
        })
}

/// Overdue work reminded its sender.
pub fn overdue_work_reminded(_: &World, s: &State) -> bool {
    !s.ghost.reminders.is_empty()
}

/// Work returned before its due time passed its due time and the lag without a reminder.
pub fn work_returned_in_time_never_reminded(_: &World, s: &State) -> bool {
    s.msgs.iter().any(|m| {
        m.due_at.is_some_and(|due| {
            m.returned_at.is_some_and(|r| r < due)
                && s.now > due.plus_ms(REMINDER_LAG_MS)
                && m.reminded_at.is_none()
        })
    })
}

/// Work returned after its due time: reminded exactly once first.
pub fn work_returned_after_a_reminder(_: &World, s: &State) -> bool {
    s.msgs.iter().any(|m| {
        matches!((m.reminded_at, m.returned_at), (Some(at), Some(r)) if at <= r)
            && m.due_at
                .is_some_and(|due| s.now > due.plus_ms(REMINDER_LAG_MS))
    })
}

pub fn a_resend_goes_out(_: &World, s: &State) -> bool {
    !s.ghost.resends.is_empty()
}

pub fn scans_prove_never_delivered(_: &World, s: &State) -> bool {
    s.ghost.cancels.iter().any(|c| !c.by_person)
}

/// A crash after the write was issued leaves the delivery UNCERTAIN, like a lost reply.
pub fn crash_mid_write_becomes_uncertain(_: &World, s: &State) -> bool {
    s.ghost.crashed_mid_write.iter().any(|&k| {
        s.store[k as usize]
            .as_ref()
            .is_some_and(|d| d.kind() == StateKind::Uncertain)
            && s.inflight.is_empty()
    })
}

/// A write lost on the way, honestly cancelled by history scans.
pub fn lost_write_cancelled_by_scans(_: &World, s: &State) -> bool {
    s.ghost
        .cancels
        .iter()
        .any(|c| !c.by_person && s.ghost.lost_writes.contains(&c.request_id))
}

pub fn interrupted_turn_resent_after_wait(_: &World, s: &State) -> bool {
    s.ghost.resends.iter().any(|r| {
        r.failure == Some(TurnFailure::Interrupted) && r.at.since(r.failed_at) >= 10 * MINUTE_MS
    })
}

pub fn resend_window_closes(_: &World, s: &State) -> bool {
    s.store.iter().flatten().any(|d| {
        matches!(d, model::Delivery::Failed(f) if *f.resend() == model::states::ResendPlan::Final { why: model::states::NoResend::WindowPassed })
    }) && s.now.0 > 24 * HOUR_MS
}

macro_rules! reaches {
    ($($f:ident => $kind:ident),* $(,)?) => {
        $(
            pub fn $f(_: &World, s: &State) -> bool {
                s.store.iter().flatten().any(|d| d.kind() == StateKind::$kind)
            }
        )*
        /// Every `reaches …` property, by state.
        pub fn reach(kind: StateKind) -> Property<World> {
            match kind {
                $(StateKind::$kind => Property::sometimes(
                    concat!("reaches ", stringify!($kind)), $f),)*
            }
        }
    };
}

reaches!(
    reaches_waiting => Waiting,
    reaches_busy => Busy,
    reaches_held => Held,
    reaches_unavailable => Unavailable,
    reaches_owner_rejected => OwnerRejected,
    reaches_sending => Sending,
    reaches_uncertain => Uncertain,
    reaches_accepted => Accepted,
    reaches_running => Running,
    reaches_returned => Returned,
    reaches_failed => Failed,
    reaches_acknowledged => Acknowledged,
    reaches_cancelled => Cancelled,
    reaches_duplicate => Duplicate,
);

pub const G1: &str = "G1 exact recipient";
pub const G2: &str = "G2 one write per attempt";
pub const G3: &str = "G3 never interrupt";
pub const G4: &str = "G4 bounded resend";
pub const G5: &str = "G5 honest release";
pub const G6: &str = "G6 outages hold";
pub const G7: &str = "G7 deadlines";
pub const G8: &str = "G8 durability";
pub const LIVENESS: &str = "liveness: every delivery settles";
pub const BLIND: &str = "nothing is written while the activity is unknown";

/// The safety guarantees every world checks.
pub fn safety() -> Vec<Property<World>> {
    vec![
        Property::always(G1, g1_exact_recipient),
        Property::always(G2, g2_one_write_per_attempt),
        Property::always(G3, g3_never_interrupt),
        Property::always(G4, g4_bounded_resend),
        Property::always(G5, g5_honest_release),
        Property::always(G6, g6_outages_hold),
        Property::always(G7, g7_deadlines),
        Property::always(G8, g8_durability),
        Property::always(BLIND, nothing_written_blind),
        Property::always("records stay valid", records_stay_valid),
    ]
}
