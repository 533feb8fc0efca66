//! The (state × event) table and the state diagram, rendered from `step` itself, so the
//! documentation can never drift from the code. Pure functions returning text.

use crate::delivery::{Class, Delivery, StateKind};
use crate::event::{
    Activity, Change, Event, EventKind, Observed, PassFacts, Permission, ScanResult, WriteOutcome,
};
use crate::ids::{AgentId, MessageId, Millis, RequestId, TurnId};
use crate::policy::Policy;
use crate::states::{
    Accepted, Acknowledged, Busy, BusyReason, Cancelled, CancelledBy, Core, Duplicate, FailCause,
    Failed, Held, HeldReason, MessageKind, NoResend, OwnerRejected, Provider, ResendPlan, Returned,
    Running, Scans, Sending, Target, TurnFailure, Unavailable, UnavailableReason, Uncertain,
    UncertainCause, Waiting, WaitingReason,
};
use crate::step::step;
use std::collections::BTreeSet;
use std::fmt::Write as _;

const T0: Millis = Millis(1_700_000_000_000);
const SECOND: u64 = 1_000;
const MINUTE: u64 = 60 * SECOND;
const HOUR: u64 = 60 * MINUTE;

fn target() -> Target {
    Target {
        agent: AgentId::new("reviewer"),
        provider: Provider::Codex,
        endpoint: "session-1".to_owned(),
        cwd: "/work".to_owned(),
        route: std::collections::BTreeMap::new(),
    }
}

fn core(attempts: u32, refusals: u32) -> Core {
    let mut core = Core::enrol(
        MessageId::new("m1"),
        target(),
        MessageKind::Work,
        "hash-1".to_owned(),
        RequestId::new("r1"),
        T0,
    );
    core.attempts = attempts;
    core.refusals = refusals;
    core
}

fn turn() -> TurnId {
    TurnId::new("turn-1")
}

/// One representative record of each state (several where the state's data changes what
/// an event does), labelled.
pub fn sample_records() -> Vec<(&'static str, Delivery)> {
    let scans = |empty, first: Option<u64>, last: Option<u64>| Scans {
        empty,
        first_empty_at: first.map(|m| T0.plus_ms(m)),
        last_at: last.map(|m| T0.plus_ms(m)),
    };
    let mut resent = core(0, 0);
    resent.earlier_request_ids.push(RequestId::new("r0"));
    resent.error_resends = 1;
    vec![
        (
            "resend queued",
            Waiting {
                core: resent,
                reason: WaitingReason::Resend,
            }
            .into(),
        ),
        (
            "queued",
            Waiting {
                core: core(0, 0),
                reason: WaitingReason::Queued,
            }
            .into(),
        ),
        (
            "in turn",
            Busy {
                core: core(0, 0),
                reason: BusyReason::RecipientInTurn {
                    turn: None,
                    detail: None,
                },
            }
            .into(),
        ),
        (
            "paused",
            Held {
                core: core(0, 0),
                reason: HeldReason::Paused,
            }
            .into(),
        ),
        (
            "agent missing",
            Unavailable {
                core: core(0, 0),
                reason: UnavailableReason::AgentMissing,
            }
            .into(),
        ),
        (
            "refused once",
            OwnerRejected {
                core: core(1, 1),
                detail: "not now".to_owned(),
            }
            .into(),
        ),
        (
            "reserved",
            Sending {
                core: core(1, 0),
                reserved_at: T0,
                issued_at: None,
            }
            .into(),
        ),
        (
            "written",
            Sending {
                core: core(1, 0),
                reserved_at: T0,
                issued_at: Some(T0),
            }
            .into(),
        ),
        (
            "retry written",
            Sending {
                core: core(2, 1),
                reserved_at: T0,
                issued_at: Some(T0),
            }
            .into(),
        ),
        (
            "no receipt",
            Uncertain {
                core: core(1, 0),
                cause: UncertainCause::NoReplyInTime,
                turn: None,
                scans: scans(0, None, None),
            }
            .into(),
        ),
        (
            "2 empty scans",
            Uncertain {
                core: core(1, 0),
                cause: UncertainCause::NoReplyInTime,
                turn: None,
                scans: scans(2, Some(0), Some(30 * MINUTE)),
            }
            .into(),
        ),
        (
            "receipt, unobservable",
            Uncertain {
                core: core(1, 0),
                cause: UncertainCause::Unobservable,
                turn: Some(turn()),
                scans: scans(0, None, None),
            }
            .into(),
        ),
        (
            "accepted",
            Accepted {
                core: core(1, 0),
                turn: turn(),
                observed_at: T0,
            }
            .into(),
        ),
        (
            "running",
            Running {
                core: core(1, 0),
                turn: turn(),
                observed_at: T0,
            }
            .into(),
        ),
        (
            "returned",
            Returned {
                core: core(1, 0),
                turn: turn(),
            }
            .into(),
        ),
        (
            "errored, resend due",
            Failed {
                core: core(1, 0),
                cause: FailCause::Turn {
                    failure: TurnFailure::Errored,
                },
                turn: Some(turn()),
                resend: ResendPlan::NotBefore { at: T0 },
            }
            .into(),
        ),
        (
            "interrupted, resend in 10 min",
            Failed {
                core: core(1, 0),
                cause: FailCause::Turn {
                    failure: TurnFailure::Interrupted,
                },
                turn: Some(turn()),
                resend: ResendPlan::NotBefore {
                    at: T0.plus_ms(10 * MINUTE),
                },
            }
            .into(),
        ),
        (
            "final",
            Failed {
                core: core(1, 0),
                cause: FailCause::Turn {
                    failure: TurnFailure::Errored,
                },
                turn: Some(turn()),
                resend: ResendPlan::Final {
                    why: NoResend::LimitReached,
                },
            }
            .into(),
        ),
        ("read", Acknowledged { core: core(0, 0) }.into()),
        (
            "released",
            Cancelled {
                core: core(1, 0),
                by: CancelledBy::Person { note: None },
            }
            .into(),
        ),
        (
            "duplicate",
            Duplicate {
                core: core(0, 0),
                of: MessageId::new("m0"),
            }
            .into(),
        ),
    ]
}

fn facts() -> PassFacts {
    PassFacts {
        body_hash: "hash-1".to_owned(),
        read_by_recipient: false,
        work_open: true,
        permission: Permission::Allowed,
        recipient: Some(target()),
        one_shot: false,
        outage: None,
        fresh_request_id: RequestId::new("r2"),
    }
}

/// One representative event of each kind (several where the data changes the outcome),
/// labelled, at an offset from T0.
pub fn sample_events() -> Vec<(&'static str, Event)> {
    let at = |ms: u64, kind| Event::new(T0.plus_ms(ms), kind);
    let pass = |f: fn(&mut PassFacts)| {
        let mut facts = facts();
        f(&mut facts);
        EventKind::PassStarted(facts)
    };
    let busy = Activity::Busy {
        turn: Some(TurnId::new("turn-0")),
        detail: None,
    };
    let unknown = Activity::Unknown {
        detail: "no answer".to_owned(),
    };
    let write = |outcome| EventKind::WriteResult { outcome };
    let seen = |observed| EventKind::Observation { observed };
    let failed = |failure, turn_open| Observed::Failed {
        turn: turn(),
        failure,
        turn_open,
    };
    vec![
        ("pass: all clear", at(SECOND, pass(|_| {}))),
        (
            "pass: body changed",
            at(SECOND, pass(|f| "hash-2".clone_into(&mut f.body_hash))),
        ),
        (
            "pass: read by recipient",
            at(SECOND, pass(|f| f.read_by_recipient = true)),
        ),
        ("pass: work done", at(SECOND, pass(|f| f.work_open = false))),
        (
            "pass: paused",
            at(SECOND, pass(|f| f.permission = Permission::Paused)),
        ),
        (
            "pass: connection blocked",
            at(SECOND, pass(|f| f.permission = Permission::Blocked)),
        ),
        (
            "pass: agent missing",
            at(SECOND, pass(|f| f.recipient = None)),
        ),
        (
            "pass: endpoint changed",
            at(
                SECOND,
                pass(|f| {
                    if let Some(t) = f.recipient.as_mut() {
                        "session-2".clone_into(&mut t.endpoint);
                    }
                }),
            ),
        ),
        (
            "pass: one-shot tick (codex turns live in-process)",
            at(SECOND, pass(|f| f.one_shot = true)),
        ),
        (
            "pass: outage",
            at(SECOND, pass(|f| f.outage = Some("major outage".to_owned()))),
        ),
        ("pass: all clear, +61 min", at(61 * MINUTE, pass(|_| {}))),
        ("pass: all clear, +25 h", at(25 * HOUR, pass(|_| {}))),
        (
            "activity: idle",
            at(
                SECOND,
                EventKind::ActivityObserved {
                    activity: Activity::Idle,
                },
            ),
        ),
        (
            "activity: busy",
            at(
                SECOND,
                EventKind::ActivityObserved {
                    activity: busy.clone(),
                },
            ),
        ),
        (
            "activity: unknown",
            at(
                SECOND,
                EventKind::ActivityObserved {
                    activity: unknown.clone(),
                },
            ),
        ),
        (
            "reservation: free",
            at(
                SECOND,
                EventKind::Reservation {
                    earlier_active: None,
                    permission: Permission::Allowed,
                },
            ),
        ),
        (
            "reservation: blocked since the pass began",
            at(
                SECOND,
                EventKind::Reservation {
                    earlier_active: None,
                    permission: Permission::Blocked,
                },
            ),
        ),
        (
            "reservation: earlier active",
            at(
                SECOND,
                EventKind::Reservation {
                    earlier_active: Some(MessageId::new("m0")),
                    permission: Permission::Allowed,
                },
            ),
        ),
        (
            "boundary: clear",
            at(
                SECOND,
                EventKind::SendBoundary {
                    permission: Permission::Allowed,
                    recipient: Some(target()),
                    activity: Activity::Idle,
                    work_open: true,
                },
            ),
        ),
        (
            "boundary: endpoint changed",
            at(
                SECOND,
                EventKind::SendBoundary {
                    permission: Permission::Allowed,
                    recipient: Some(Target {
                        endpoint: "session-2".to_owned(),
                        ..target()
                    }),
                    activity: Activity::Idle,
                    work_open: true,
                },
            ),
        ),
        (
            "boundary: work done",
            at(
                SECOND,
                EventKind::SendBoundary {
                    permission: Permission::Allowed,
                    recipient: Some(target()),
                    activity: Activity::Idle,
                    work_open: false,
                },
            ),
        ),
        (
            "boundary: blocked",
            at(
                SECOND,
                EventKind::SendBoundary {
                    permission: Permission::Blocked,
                    recipient: Some(target()),
                    activity: Activity::Idle,
                    work_open: true,
                },
            ),
        ),
        (
            "boundary: busy",
            at(
                SECOND,
                EventKind::SendBoundary {
                    permission: Permission::Allowed,
                    recipient: Some(target()),
                    activity: busy,
                    work_open: true,
                },
            ),
        ),
        (
            "boundary: unknown",
            at(
                SECOND,
                EventKind::SendBoundary {
                    permission: Permission::Allowed,
                    recipient: Some(target()),
                    activity: unknown,
                    work_open: true,
                },
            ),
        ),
        (
            "write: exact receipt",
            at(
                SECOND,
                write(WriteOutcome::Receipt {
                    turn: turn(),
                    request_id: Some(RequestId::new("r1")),
                }),
            ),
        ),
        (
            "write: receipt without our id",
            at(
                SECOND,
                write(WriteOutcome::Receipt {
                    turn: turn(),
                    request_id: None,
                }),
            ),
        ),
        (
            "write: refused",
            at(
                SECOND,
                write(WriteOutcome::Refused {
                    detail: "not now".to_owned(),
                }),
            ),
        ),
        (
            "write: busy at the write",
            at(
                SECOND,
                write(WriteOutcome::Busy {
                    detail: "a turn began".to_owned(),
                }),
            ),
        ),
        (
            "write: withheld (fenced engine)",
            at(
                SECOND,
                write(WriteOutcome::Withheld {
                    detail: "the lease moved".to_owned(),
                }),
            ),
        ),
        (
            "write: error",
            at(
                SECOND,
                write(WriteOutcome::Failed {
                    detail: "reset".to_owned(),
                }),
            ),
        ),
        (
            "write: timed out",
            at(SECOND, write(WriteOutcome::TimedOut)),
        ),
        (
            "observed: accepted",
            at(SECOND, seen(Observed::Accepted { turn: turn() })),
        ),
        (
            "observed: running",
            at(SECOND, seen(Observed::Running { turn: turn() })),
        ),
        (
            "observed: returned",
            at(SECOND, seen(Observed::Returned { turn: turn() })),
        ),
        (
            "observed: errored",
            at(SECOND, seen(failed(TurnFailure::Errored, false))),
        ),
        (
            "observed: interrupted",
            at(SECOND, seen(failed(TurnFailure::Interrupted, false))),
        ),
        (
            "observed: error, turn open",
            at(SECOND, seen(failed(TurnFailure::Errored, true))),
        ),
        ("observed: not found", at(SECOND, seen(Observed::NotFound))),
        (
            "observed: unreachable",
            at(
                SECOND,
                seen(Observed::Unreachable {
                    detail: "down".to_owned(),
                }),
            ),
        ),
        (
            "scan: found returned",
            at(
                SECOND,
                EventKind::HistoryScan {
                    scan: ScanResult::Found {
                        observed: Observed::Returned { turn: turn() },
                    },
                },
            ),
        ),
        (
            "scan: nothing, complete, +61 min",
            at(
                61 * MINUTE,
                EventKind::HistoryScan {
                    scan: ScanResult::NothingFound { complete: true },
                },
            ),
        ),
        (
            "scan: nothing, incomplete",
            at(
                61 * MINUTE,
                EventKind::HistoryScan {
                    scan: ScanResult::NothingFound { complete: false },
                },
            ),
        ),
        ("release", at(SECOND, EventKind::Release { note: None })),
        ("time: +30 s", at(30 * SECOND, EventKind::TimePassed)),
        ("time: +61 s", at(61 * SECOND, EventKind::TimePassed)),
        ("time: +11 min", at(11 * MINUTE, EventKind::TimePassed)),
    ]
}

fn describe_change(change: &Change) -> String {
    match change {
        Change::Moved { to, .. } => format!("-> {to}"),
        Change::Updated => "updated".to_owned(),
        Change::Unchanged => "unchanged".to_owned(),
        Change::Ignored { why } => format!("ignored ({why})"),
    }
}

/// Every (sample state × sample event) pair and what `step` does with it, one line each.
pub fn render_table(policy: &Policy) -> String {
    let mut out = String::new();
    for (state_label, record) in sample_records() {
        let _ = writeln!(out, "## {} [{state_label}]", record.kind());
        for (event_label, event) in sample_events() {
            let result = step(record.clone(), event, policy);
            let effects: Vec<String> = result
                .effects
                .iter()
                .map(|e| {
                    format!("{e:?}")
                        .split([' ', '{'])
                        .next()
                        .unwrap_or("")
                        .to_owned()
                })
                .collect();
            let _ = write!(
                out,
                "  {event_label:<42} {}",
                describe_change(&result.change)
            );
            if !effects.is_empty() {
                let _ = write!(out, " then {}", effects.join(", "));
            }
            out.push('\n');
        }
    }
    out
}

/// Every (from, to, event kind) transition the samples exercise.
pub fn transitions(policy: &Policy) -> BTreeSet<(StateKind, StateKind, &'static str)> {
    let mut edges = BTreeSet::new();
    for (_, record) in sample_records() {
        for (_, event) in sample_events() {
            let name = event.kind.name();
            if let Change::Moved { from, to } = step(record.clone(), event, policy).change {
                edges.insert((from, to, name));
            }
        }
    }
    edges
}

/// The state diagram in Graphviz DOT, generated from `transitions`.
pub fn render_dot(policy: &Policy) -> String {
    let mut out = String::from(
        "// Generated by `cargo test --package model` from model::step; do not edit.\n\
         digraph delivery {\n  rankdir=LR;\n  node [shape=box, style=rounded, fontname=\"Helvetica\"];\n",
    );
    for kind in StateKind::ALL {
        let (color, shape) = match kind.class() {
            Class::Pending => ("#fff4cc", "box"),
            Class::Active => ("#d6eaff", "box"),
            Class::Terminal => ("#e2f5e2", "doubleoctagon"),
        };
        let _ = writeln!(
            out,
            "  {kind} [shape={shape}, style=\"rounded,filled\", fillcolor=\"{color}\"];"
        );
    }
    let mut merged: std::collections::BTreeMap<(StateKind, StateKind), Vec<&str>> =
        std::collections::BTreeMap::new();
    for (from, to, name) in transitions(policy) {
        merged.entry((from, to)).or_default().push(name);
    }
    out.push_str("  enrolment [shape=point];\n");
    let mut plain = core(0, 0);
    plain.kind = MessageKind::Plain;
    for (label, duplicate_of) in [
        ("enrol", None),
        (
            "enrol: identical to a live plain handoff",
            Some(MessageId::new("m0")),
        ),
    ] {
        let kind = crate::enrol(plain.clone(), duplicate_of).kind();
        let _ = writeln!(out, "  enrolment -> {kind} [label=\"{label}\"];");
    }
    for ((from, to), names) in merged {
        let _ = writeln!(out, "  {from} -> {to} [label=\"{}\"];", names.join("\\n"));
    }
    out.push_str("}\n");
    out
}
