//! A pure harness that decodes any byte string into a starting record and a sequence of
//! events, runs them through `step`, and checks the invariants of SPEC §2 after every step.
//! proptest and the fuzzer drive the same harness, so whatever one finds the other replays.

use crate::delivery::{Delivery, StateKind};
use crate::event::{
    Activity, Change, Effect, Event, EventKind, Observed, PassFacts, Permission, ScanResult,
    WriteOutcome,
};
use crate::ids::{MessageId, Millis, RequestId, TurnId};
use crate::policy::Policy;
use crate::states::{Provider, ResendPlan, Target, TurnFailure};
use crate::step::step;
use crate::table::sample_records;

/// Reads choices from bytes; past the end every choice is 0.
struct Bytes<'a> {
    data: &'a [u8],
    at: usize,
}

impl Bytes<'_> {
    fn next(&mut self) -> u8 {
        let b = self.data.get(self.at).copied().unwrap_or(0);
        self.at += 1;
        b
    }
    fn pick<T: Clone>(&mut self, options: &[T]) -> T {
        options[self.next() as usize % options.len()].clone()
    }
    fn flag(&mut self) -> bool {
        self.next() % 2 == 1
    }
    fn done(&self) -> bool {
        self.at >= self.data.len()
    }
}

const DELTAS_MS: [u64; 9] = [
    0,
    1_000,
    30_000,
    61_000,
    600_000,
    1_860_000,
    3_660_000,
    90_000_000,
    u64::MAX / 4,
];

/// Decodes `data` into a starting record and up to `max_events` events.
pub fn decode(data: &[u8], max_events: usize) -> (Delivery, Vec<Event>) {
    let mut b = Bytes { data, at: 0 };
    let samples = sample_records();
    let start = samples[b.next() as usize % samples.len()].1.clone();
    let mut now = start.core().since;
    let target = start.core().target.clone();
    let mut events = Vec::new();
    let mut fresh = 0u32;
    while !b.done() && events.len() < max_events {
        let delta = b.pick(&DELTAS_MS);
        // A clock that sometimes steps back must not confuse the rules.
        now = if b.next() == 255 {
            Millis(now.0.saturating_sub(delta))
        } else {
            now.plus_ms(delta)
        };
        let turn = TurnId::new(format!("t{}", b.next() % 3));
        let request_id = if b.flag() {
            start.core().request_id.clone()
        } else {
            RequestId::new(format!("other-{}", b.next() % 3))
        };
        let current_target = match b.next() % 5 {
            0 => None,
            3 => Some(Target {
                route: [("url".to_owned(), "\"http://elsewhere/\"".to_owned())].into(),
                ..target.clone()
            }),
            1 => Some(Target {
                endpoint: "elsewhere".to_owned(),
                ..target.clone()
            }),
            2 => Some(Target {
                provider: Provider::Codex,
                ..target.clone()
            }),
            _ => Some(target.clone()),
        };
        let activity = match b.next() % 6 {
            0 => Activity::Idle,
            1 => Activity::Busy {
                turn: Some(turn.clone()),
                detail: None,
            },
            2 => Activity::Finished,
            3 => Activity::Stopped,
            4 => Activity::Failed,
            _ => Activity::Unknown {
                detail: "no answer".to_owned(),
            },
        };
        let permission = b.pick(&[Permission::Allowed, Permission::Paused, Permission::Blocked]);
        let failure = b.pick(&[TurnFailure::Errored, TurnFailure::Interrupted]);
        let observed = match b.next() % 7 {
            0 => Observed::Accepted { turn: turn.clone() },
            1 => Observed::Running { turn: turn.clone() },
            2 => Observed::Returned { turn: turn.clone() },
            3 => Observed::Failed {
                turn: turn.clone(),
                failure,
                turn_open: b.flag(),
            },
            4 => Observed::NotFound,
            _ => Observed::Unreachable {
                detail: "down".to_owned(),
            },
        };
        let kind = match b.next() % 9 {
            0 => {
                fresh += 1;
                EventKind::PassStarted(PassFacts {
                    body_hash: if b.next() == 0 {
                        "edited".to_owned()
                    } else {
                        start.core().body_hash.clone()
                    },
                    read_by_recipient: b.next().is_multiple_of(4),
                    work_open: !b.next().is_multiple_of(4),
                    permission,
                    recipient: current_target,
                    one_shot: b.flag(),
                    outage: (b.next().is_multiple_of(5)).then(|| "outage".to_owned()),
                    fresh_request_id: RequestId::new(format!("fresh-{fresh}")),
                })
            }
            1 => EventKind::ActivityObserved { activity },
            2 => EventKind::Reservation {
                earlier_active: b
                    .flag()
                    .then(|| b.pick(&[MessageId::new("m0"), start.core().message.clone()])),
                permission,
            },
            3 => EventKind::SendBoundary {
                permission,
                recipient: current_target,
                activity,
                work_open: !b.next().is_multiple_of(4),
            },
            4 => EventKind::WriteResult {
                outcome: match b.next() % 7 {
                    0 => WriteOutcome::Receipt {
                        turn,
                        request_id: Some(request_id),
                    },
                    1 => WriteOutcome::Receipt {
                        turn,
                        request_id: None,
                    },
                    2 => WriteOutcome::Refused {
                        detail: "no".to_owned(),
                    },
                    3 => WriteOutcome::Failed {
                        detail: "reset".to_owned(),
                    },
                    4 => WriteOutcome::TimedOut,
                    5 => WriteOutcome::Busy {
                        detail: "a turn began".to_owned(),
                    },
                    _ => WriteOutcome::Withheld {
                        detail: "the lease moved".to_owned(),
                    },
                },
            },
            5 => EventKind::Observation { observed },
            6 => EventKind::HistoryScan {
                scan: if b.flag() {
                    ScanResult::Found { observed }
                } else {
                    ScanResult::NothingFound { complete: b.flag() }
                },
            },
            7 => EventKind::Release {
                note: b.flag().then(|| "known".to_owned()),
            },
            _ => EventKind::TimePassed,
        };
        events.push(Event::new(now, kind));
    }
    (start, events)
}

/// Runs `events` from `start` and checks the invariants after every step; the error names
/// the step and the rule broken.
pub fn run(start: Delivery, events: Vec<Event>, policy: &Policy) -> Result<Delivery, String> {
    let mut record = start;
    let fixed = |d: &Delivery| {
        let c = d.core();
        (
            c.message.clone(),
            c.target.clone(),
            c.kind,
            c.body_hash.clone(),
            c.enrolled_at,
        )
    };
    let identity = fixed(&record);
    let mut writes_this_reservation = 0usize;
    for (i, event) in events.into_iter().enumerate() {
        let before = record.clone();
        let event_name = event.kind.name();
        let is_release = matches!(event.kind, EventKind::Release { .. });
        let is_scan = matches!(event.kind, EventKind::HistoryScan { .. });
        let result = step(record, event, policy);
        let after = &result.record;
        let fail = |why: &str| {
            format!(
                "step {i} ({event_name}) from {}: {why}\nbefore: {before:?}\nafter: {after:?}",
                before.kind()
            )
        };
        after.validate(policy).map_err(|e| fail(&e.to_string()))?;
        if fixed(after) != identity {
            return Err(fail("the message, target or body hash changed (G1)"));
        }
        match &result.change {
            Change::Ignored { .. } | Change::Unchanged if *after != before => {
                return Err(fail("an ignored or unchanged step altered the record"));
            }
            Change::Moved { from, to } if (from, to) != (&before.kind(), &after.kind()) => {
                return Err(fail("the reported move does not match the records"));
            }
            _ => {}
        }
        let moved = matches!(result.change, Change::Moved { .. });
        if after.core().request_id != before.core().request_id {
            let resend = before.kind() == StateKind::Failed && after.kind() == StateKind::Waiting;
            if !resend {
                return Err(fail(
                    "the request id changed outside a resend from FAILED (G4)",
                ));
            }
            if after.core().earlier_request_ids.last() != Some(&before.core().request_id) {
                return Err(fail("a resend lost the earlier request id"));
            }
        }
        if moved && after.kind() == StateKind::Sending {
            writes_this_reservation = 0;
            if after.core().attempts != before.core().attempts + 1 {
                return Err(fail("a reservation did not spend exactly one attempt"));
            }
        }
        let writes = result
            .effects
            .iter()
            .filter(|e| matches!(e, Effect::Write { .. }))
            .count();
        writes_this_reservation += writes;
        if writes > 0 && before.kind() != StateKind::Sending {
            return Err(fail("a write without a reservation (G2)"));
        }
        if writes_this_reservation > 1 {
            return Err(fail("two writes for one reservation (G2)"));
        }
        if moved && after.kind() == StateKind::Cancelled && !is_release && !is_scan {
            return Err(fail(
                "CANCELLED by something other than a release or a history scan (G5)",
            ));
        }
        let frozen = match &before {
            Delivery::Failed(f) => matches!(f.resend, ResendPlan::Final { .. }),
            Delivery::Returned(_)
            | Delivery::Acknowledged(_)
            | Delivery::Cancelled(_)
            | Delivery::Duplicate(_) => true,
            _ => false,
        };
        if frozen && moved {
            return Err(fail("a settled delivery changed state"));
        }
        record = result.record;
    }
    Ok(record)
}
