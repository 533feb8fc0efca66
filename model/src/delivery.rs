//! The stored form of a delivery: one enum over the fourteen state structs, tagged by state
//! name for serde. Only `crate::step` takes it apart to run a transition.

use crate::ids::Millis;
use crate::policy::Policy;
use crate::states::{
    Accepted, Acknowledged, Busy, BusyReason, Cancelled, CancelledBy, Core, Duplicate, FailCause,
    Failed, Held, HeldReason, NoResend, OwnerRejected, ResendPlan, Returned, Running, Sending,
    TurnFailure, Unavailable, UnavailableReason, Uncertain, UncertainCause, Waiting, WaitingReason,
};
use serde::{Deserialize, Serialize};
use std::fmt::{self, Write as _};

/// A delivery as stored: its state and that state's data.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Delivery {
    Waiting(Waiting),
    Busy(Busy),
    Held(Held),
    Unavailable(Unavailable),
    OwnerRejected(OwnerRejected),
    Sending(Sending),
    Uncertain(Uncertain),
    Accepted(Accepted),
    Running(Running),
    Returned(Returned),
    Failed(Failed),
    Acknowledged(Acknowledged),
    Cancelled(Cancelled),
    Duplicate(Duplicate),
}

macro_rules! from_state {
    ($($name:ident),*) => {$(
        impl From<$name> for Delivery {
            fn from(state: $name) -> Delivery {
                Delivery::$name(state)
            }
        }
    )*};
}
from_state!(
    Waiting,
    Busy,
    Held,
    Unavailable,
    OwnerRejected,
    Sending,
    Uncertain,
    Accepted,
    Running,
    Returned,
    Failed,
    Acknowledged,
    Cancelled,
    Duplicate
);

/// The name of a state, without its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum StateKind {
    Waiting,
    Busy,
    Held,
    Unavailable,
    OwnerRejected,
    Sending,
    Uncertain,
    Accepted,
    Running,
    Returned,
    Failed,
    Acknowledged,
    Cancelled,
    Duplicate,
}

/// The class of a state (SPEC §2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    Pending,
    Active,
    Terminal,
}

impl StateKind {
    pub const ALL: [StateKind; 14] = [
        StateKind::Waiting,
        StateKind::Busy,
        StateKind::Held,
        StateKind::Unavailable,
        StateKind::OwnerRejected,
        StateKind::Sending,
        StateKind::Uncertain,
        StateKind::Accepted,
        StateKind::Running,
        StateKind::Returned,
        StateKind::Failed,
        StateKind::Acknowledged,
        StateKind::Cancelled,
        StateKind::Duplicate,
    ];

    pub fn class(self) -> Class {
        match self {
            StateKind::Waiting
            | StateKind::Busy
            | StateKind::Held
            | StateKind::Unavailable
            | StateKind::OwnerRejected => Class::Pending,
            StateKind::Sending
            | StateKind::Uncertain
            | StateKind::Accepted
            | StateKind::Running => Class::Active,
            StateKind::Returned
            | StateKind::Failed
            | StateKind::Acknowledged
            | StateKind::Cancelled
            | StateKind::Duplicate => Class::Terminal,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            StateKind::Waiting => "WAITING",
            StateKind::Busy => "BUSY",
            StateKind::Held => "HELD",
            StateKind::Unavailable => "UNAVAILABLE",
            StateKind::OwnerRejected => "OWNER_REJECTED",
            StateKind::Sending => "SENDING",
            StateKind::Uncertain => "UNCERTAIN",
            StateKind::Accepted => "ACCEPTED",
            StateKind::Running => "RUNNING",
            StateKind::Returned => "RETURNED",
            StateKind::Failed => "FAILED",
            StateKind::Acknowledged => "ACKNOWLEDGED",
            StateKind::Cancelled => "CANCELLED",
            StateKind::Duplicate => "DUPLICATE",
        }
    }
}

impl fmt::Display for StateKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for StateKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        StateKind::ALL
            .into_iter()
            .find(|k| k.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("unknown delivery state {s:?}"))
    }
}

/// A record that breaks an invariant of SPEC §2.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Invalid(pub String);

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid delivery record: {}", self.0)
    }
}

impl std::error::Error for Invalid {}

macro_rules! each {
    ($value:expr, $s:ident => $body:expr) => {
        match $value {
            Delivery::Waiting($s) => $body,
            Delivery::Busy($s) => $body,
            Delivery::Held($s) => $body,
            Delivery::Unavailable($s) => $body,
            Delivery::OwnerRejected($s) => $body,
            Delivery::Sending($s) => $body,
            Delivery::Uncertain($s) => $body,
            Delivery::Accepted($s) => $body,
            Delivery::Running($s) => $body,
            Delivery::Returned($s) => $body,
            Delivery::Failed($s) => $body,
            Delivery::Acknowledged($s) => $body,
            Delivery::Cancelled($s) => $body,
            Delivery::Duplicate($s) => $body,
        }
    };
}

impl Delivery {
    pub fn kind(&self) -> StateKind {
        match self {
            Delivery::Waiting(_) => StateKind::Waiting,
            Delivery::Busy(_) => StateKind::Busy,
            Delivery::Held(_) => StateKind::Held,
            Delivery::Unavailable(_) => StateKind::Unavailable,
            Delivery::OwnerRejected(_) => StateKind::OwnerRejected,
            Delivery::Sending(_) => StateKind::Sending,
            Delivery::Uncertain(_) => StateKind::Uncertain,
            Delivery::Accepted(_) => StateKind::Accepted,
            Delivery::Running(_) => StateKind::Running,
            Delivery::Returned(_) => StateKind::Returned,
            Delivery::Failed(_) => StateKind::Failed,
            Delivery::Acknowledged(_) => StateKind::Acknowledged,
            Delivery::Cancelled(_) => StateKind::Cancelled,
            Delivery::Duplicate(_) => StateKind::Duplicate,
        }
    }

    pub fn class(&self) -> Class {
        self.kind().class()
    }

    pub fn core(&self) -> &Core {
        each!(self, s => &s.core)
    }

    pub(crate) fn core_mut(&mut self) -> &mut Core {
        each!(self, s => &mut s.core)
    }

    /// Whether this delivery holds its recipient (SPEC §2.2 step 8: one active at a time).
    pub fn is_active(&self) -> bool {
        self.class() == Class::Active
    }

    /// A FAILED delivery whose resend is still possible is not settled yet.
    pub fn is_settled(&self) -> bool {
        match self {
            Delivery::Failed(f) => matches!(f.resend, ResendPlan::Final { .. }),
            other => other.class() == Class::Terminal,
        }
    }

    /// The next instant at which time alone can change this delivery, so an engine can sleep
    /// until then instead of polling. `None`: only an event can change it.
    pub fn next_deadline(&self, policy: &Policy) -> Option<Millis> {
        match self {
            Delivery::Sending(s) => Some(
                s.issued_at
                    .unwrap_or(s.reserved_at)
                    .plus_ms(policy.sending_timeout_ms),
            ),
            Delivery::Accepted(Accepted { observed_at, .. })
            | Delivery::Running(Running { observed_at, .. }) => {
                Some(observed_at.plus_ms(policy.unobserved_limit_ms))
            }
            // Never scanned yet: the first scan is due the moment it became UNCERTAIN (an
            // engine that stopped right after committing UNCERTAIN left it unscanned).
            Delivery::Uncertain(u) => Some(u.scans.last_at.map_or(u.core.since, |at| {
                at.plus_ms(policy.history_scan_interval_ms)
            })),
            Delivery::Failed(Failed {
                resend: ResendPlan::NotBefore { at },
                ..
            }) => Some(*at),
            _ => None,
        }
    }

    /// The reason for the current state, in plain words.
    pub fn detail(&self) -> String {
        let base = match self {
            Delivery::Waiting(w) => match &w.reason {
                WaitingReason::Queued => "queued; the next pass tries it".to_owned(),
                WaitingReason::Resend => format!(
                    "queued again as an automatic resend with a fresh request id (earlier: {})",
                    w.core
                        .earlier_request_ids
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                WaitingReason::NeedsRunningEngine => format!(
                    "a one-shot tick cannot start a {} turn; run `handoffs run` or `handoffs serve`",
                    w.core.target.provider.as_str()
                ),
                WaitingReason::Withheld { detail } => {
                    format!("queued again, nothing written: {detail}")
                }
            },
            Delivery::Busy(b) => match &b.reason {
                BusyReason::RecipientInTurn { turn, detail } => {
                    let mut s = "the recipient is in the middle of a turn".to_owned();
                    if let Some(t) = turn {
                        let _ = write!(s, " ({t})");
                    }
                    if let Some(d) = detail {
                        let _ = write!(s, ": {d}");
                    }
                    s
                }
                BusyReason::EarlierDelivery { message } => {
                    format!("waiting for the earlier delivery {message}")
                }
                BusyReason::AtTheWrite { detail, times } => {
                    let mut s = format!("busy at the write: {detail}");
                    if *times > 1 {
                        let _ = write!(s, " ({times} times in a row)");
                    }
                    s
                }
            },
            Delivery::Held(h) => match h.reason {
                HeldReason::Paused => "delivery is paused (enabled=false)".to_owned(),
                HeldReason::ConnectionBlocked => format!(
                    "the connection to {} is not allowed; `handoffs allow` releases the hold",
                    h.core.target.agent
                ),
            },
            Delivery::Unavailable(u) => match &u.reason {
                UnavailableReason::AgentMissing => {
                    format!("agent {} is not registered", u.core.target.agent)
                }
                UnavailableReason::TargetChanged { changed } => format!(
                    "agent {} changed its destination ({}) since this was queued; nothing is redirected: register it as it was, or release this delivery",
                    u.core.target.agent,
                    if changed.is_empty() {
                        "provider or endpoint".to_owned()
                    } else {
                        changed.join(", ")
                    }
                ),
                UnavailableReason::ActivityUnknown { detail } => {
                    format!("the recipient's activity cannot be verified: {detail}")
                }
            },
            Delivery::OwnerRejected(o) => {
                format!(
                    "the recipient's app refused the write ({}); one retry is allowed",
                    o.detail
                )
            }
            Delivery::Sending(s) => {
                if s.write_issued() {
                    format!("attempt {} is being written", s.core.attempts)
                } else {
                    format!("attempt {} is reserved", s.core.attempts)
                }
            }
            Delivery::Uncertain(u) => {
                let why = match &u.cause {
                    UncertainCause::WriteError { detail } => format!("the write failed: {detail}"),
                    UncertainCause::NoExactReceipt => {
                        "the reply was not an exact receipt".to_owned()
                    }
                    UncertainCause::NoReplyInTime => "no reply in time".to_owned(),
                    UncertainCause::Unobservable => {
                        "the accepted turn could not be observed".to_owned()
                    }
                };
                format!(
                    "{why}; it may have landed, so it is observed and never resent ({} empty history scans so far)",
                    u.scans.empty
                )
            }
            Delivery::Accepted(a) => format!("the recipient's session took turn {}", a.turn),
            Delivery::Running(r) => format!("turn {} is in progress", r.turn),
            Delivery::Returned(r) => format!("turn {} finished", r.turn),
            Delivery::Failed(f) => {
                let why = match &f.cause {
                    FailCause::Turn {
                        failure: TurnFailure::Errored,
                    } => "the turn failed".to_owned(),
                    FailCause::Turn {
                        failure: TurnFailure::Interrupted,
                    } => "the turn was interrupted".to_owned(),
                    FailCause::RefusedTwice { detail } => {
                        format!("refused twice; never delivered ({detail})")
                    }
                    FailCause::ChangedAfterQueued => "changed after it was queued".to_owned(),
                    FailCause::ResendDropped => {
                        "the queued resend was dropped: the work was returned or closed".to_owned()
                    }
                };
                let plan = match &f.resend {
                    ResendPlan::NotBefore { at } => match at.since(f.core.since) {
                        0 => "a resend may follow at once, while the work is open".to_owned(),
                        wait => format!(
                            "a resend may follow {} after the failure, while the work is open",
                            span(wait)
                        ),
                    },
                    ResendPlan::Final { why } => match why {
                        NoResend::NeverDelivered => "nothing to resend".to_owned(),
                        NoResend::LimitReached => "resend limit reached".to_owned(),
                        NoResend::WorkDone => "no resend: the work is done".to_owned(),
                        NoResend::WindowPassed => "no resend: the resend window passed".to_owned(),
                        NoResend::Released => "no resend: released by a person".to_owned(),
                    },
                };
                format!("{why}; {plan}")
            }
            Delivery::Acknowledged(_) => {
                "the recipient read the message before a turn was needed".to_owned()
            }
            Delivery::Cancelled(c) => match &c.by {
                CancelledBy::Person { note } => match note {
                    Some(n) => format!("released by a person: {n}; nothing resent"),
                    None => "released by a person; nothing resent".to_owned(),
                },
                CancelledBy::HistoryScans { scans, .. } => format!(
                    "never delivered ({scans} complete history scans found nothing); nothing resent; the inbox message is unchanged"
                ),
            },
            Delivery::Duplicate(d) => format!("identical to {}, still live; not sent", d.of),
        };
        match &self.core().note {
            Some(note) => format!("{base} ({note})"),
            None => base,
        }
    }

    /// Checks the invariants SPEC §2 implies for a single record under `policy`: its shape
    /// ([`Delivery::check_shape`]) and the policy's bounds.
    pub fn validate(&self, policy: &Policy) -> Result<(), Invalid> {
        self.check_shape()?;
        let core = self.core();
        let bad = |why: String| Err(Invalid(why));
        if core.error_resends > policy.error_resends_max {
            return bad(format!("{} error resends", core.error_resends));
        }
        if core.interrupt_resends > policy.interrupt_resends_max {
            return bad(format!("{} interrupt resends", core.interrupt_resends));
        }
        if core.refusals > policy.refusal_retries_max + 1 {
            return bad(format!("{} refusals", core.refusals));
        }
        match self {
            Delivery::Cancelled(Cancelled {
                by:
                    CancelledBy::HistoryScans {
                        scans,
                        first_at,
                        last_at,
                    },
                ..
            }) if *scans < policy.history_scans_min
                || last_at.since(*first_at) < policy.history_scan_span_ms =>
            {
                bad(format!(
                    "cancelled after {scans} scans over {}ms",
                    last_at.since(*first_at)
                ))
            }
            _ => Ok(()),
        }
    }

    /// The invariants every record holds whatever the policy it was made under: what a
    /// stored record is checked against when it is read back.
    pub fn check_shape(&self) -> Result<(), Invalid> {
        let core = self.core();
        let bad = |why: String| Err(Invalid(why));
        let resends = core.error_resends + core.interrupt_resends;
        if core.earlier_request_ids.len() != resends as usize {
            return bad(format!(
                "{} earlier request ids for {resends} resends",
                core.earlier_request_ids.len()
            ));
        }
        let mut ids: Vec<_> = core.earlier_request_ids.iter().collect();
        ids.push(&core.request_id);
        ids.sort();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return bad("a request id is reused".to_owned());
        }
        if self.class() == Class::Active && core.attempts == 0 {
            return bad(format!("{} without a reserved attempt", self.kind()));
        }
        match self {
            Delivery::OwnerRejected(_) if core.refusals == 0 => {
                bad("OWNER_REJECTED without a refusal".to_owned())
            }
            Delivery::Failed(f) => match (&f.resend, &f.turn) {
                (ResendPlan::NotBefore { .. }, None) => {
                    bad("a resend planned for a turn never delivered".to_owned())
                }
                _ => Ok(()),
            },
            _ => Ok(()),
        }
    }
}

/// A span of time for people: "500 ms", "12 s", "10 min", "2 h".
fn span(ms: u64) -> String {
    match ms {
        0..=999 => format!("{ms} ms"),
        1_000..=119_999 => format!("{} s", ms / 1_000),
        120_000..=7_199_999 => format!("{} min", ms / 60_000),
        _ => format!("{} h", ms / 3_600_000),
    }
}
