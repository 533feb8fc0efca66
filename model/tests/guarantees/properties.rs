//! The guarantees of SPEC §3 as stateright properties. They judge the ghost log (what the
//! recipient really saw) against the numbers SPEC promises, not against the policy the engine
//! was given, so a broken policy is caught rather than believed.

use super::world::{HOUR_MS, MINUTE_MS, State, World};
use model::states::TurnFailure;
use model::{Policy, StateKind};
use stateright::Property;

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

pub fn g3_never_interrupt(_: &World, s: &State) -> bool {
    let active = s.store.iter().flatten().filter(|d| d.is_active()).count();
    active <= 1 && s.ghost.writes.iter().all(|w| !w.session_busy)
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

pub fn g8_durability(_: &World, s: &State) -> bool {
    let nothing_lost = s
        .ghost
        .queued_for
        .iter()
        .zip(&s.store)
        .all(|(frozen, stored)| frozen.is_none() || stored.is_some());
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

pub fn every_delivery_settles(_: &World, s: &State) -> bool {
    s.store
        .iter()
        .all(|d| d.as_ref().is_some_and(model::Delivery::is_settled))
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
        Property::always(G8, g8_durability),
        Property::always(BLIND, nothing_written_blind),
        Property::always("records stay valid", records_stay_valid),
    ]
}
