//! One struct per delivery state (SPEC §2), each holding only what that state needs, and the
//! transitions between them as methods that consume `self`: a transition SPEC §2 does not
//! allow has no method, so it does not compile. `crate::step` is the only caller that turns
//! stored data into these types.

use crate::ids::{AgentId, MessageId, Millis, RequestId, TurnId};
use crate::policy::Policy;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The adapter kind an agent is delivered through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Provider {
    Demo,
    Command,
    Codex,
    ClaudeCode,
}

impl Provider {
    /// Whether a turn lives inside the process that started it, so a one-shot `tick` must not
    /// start one (the turn would die with the process).
    pub fn turns_live_in_starting_process(self) -> bool {
        matches!(self, Provider::Codex | Provider::ClaudeCode)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Provider::Demo => "demo",
            Provider::Command => "command",
            Provider::Codex => "codex",
            Provider::ClaudeCode => "claude-code",
        }
    }
}

impl std::str::FromStr for Provider {
    type Err = String;

    /// A provider by its name (`demo`, `command`, `codex`, `claude-code`).
    fn from_str(s: &str) -> Result<Provider, String> {
        match s {
            "demo" => Ok(Provider::Demo),
            "command" => Ok(Provider::Command),
            "codex" => Ok(Provider::Codex),
            "claude-code" => Ok(Provider::ClaudeCode),
            other => Err(format!(
                "unknown provider {other:?}; use demo, command, codex or claude-code"
            )),
        }
    }
}

/// The adapter settings that address a recipient (SPEC §1): a change to any of them sends a
/// write somewhere else, so each is part of the destination frozen at enrolment (G1). Other
/// settings (a timeout, say) are not.
pub const ROUTE_SETTINGS: &[&str] = &[
    "url",
    "status_url",
    "activity_url",
    "command",
    "binary",
    "home",
    "config_dir",
    "socket",
];

/// Where a delivery goes, frozen at enrolment (G1): the agent, its provider and endpoint, and
/// its route (each [`ROUTE_SETTINGS`] key it has, with the setting's value as JSON text).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Target {
    pub agent: AgentId,
    pub provider: Provider,
    pub endpoint: String,
    pub cwd: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub route: BTreeMap<String, String>,
}

impl Target {
    /// Whether `current` (the agent as registered now) is still this target: same agent,
    /// provider, endpoint and route. The folder may move without redirecting anything.
    pub fn same_destination(&self, current: &Target) -> bool {
        self.changes(current).is_empty()
    }

    /// What differs between this destination and `current`'s, by name (`provider`,
    /// `endpoint`, a route setting), in a stable order.
    pub fn changes(&self, current: &Target) -> Vec<String> {
        let mut out = Vec::new();
        if self.agent != current.agent {
            out.push("agent".to_owned());
        }
        if self.provider != current.provider {
            out.push("provider".to_owned());
        }
        if self.endpoint != current.endpoint {
            out.push("endpoint".to_owned());
        }
        let keys: std::collections::BTreeSet<&String> =
            self.route.keys().chain(current.route.keys()).collect();
        for key in keys {
            if self.route.get(key) != current.route.get(key) {
                out.push(key.clone());
            }
        }
        out
    }
}

/// What kind of message the delivery carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MessageKind {
    /// A plain handoff: open until its recipient reads it.
    Plain,
    /// A work assignment or a work return: open until returned or closed.
    Work,
}

/// What every state carries.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Core {
    pub(crate) message: MessageId,
    pub(crate) target: Target,
    pub(crate) kind: MessageKind,
    /// Hash of the message body at enrolment; a different body later fails the delivery.
    pub(crate) body_hash: String,
    /// The current attempt series.
    pub(crate) request_id: RequestId,
    /// Request ids of earlier series, oldest first (one per resend).
    pub(crate) earlier_request_ids: Vec<RequestId>,
    /// Reservations in the current series.
    pub(crate) attempts: u32,
    /// Explicit refusals in the current series.
    pub(crate) refusals: u32,
    /// Writes of the current series the recipient's app turned away busy (no refusal).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(crate) busy_at_write: u32,
    pub(crate) error_resends: u32,
    pub(crate) interrupt_resends: u32,
    pub(crate) enrolled_at: Millis,
    /// When the state last changed.
    pub(crate) since: Millis,
    /// A passing remark that does not change the state (an outage, a failed check).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) note: Option<String>,
}

#[allow(clippy::trivially_copy_pass_by_ref)]
fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl Core {
    /// A new delivery's core: attempt series 1, nothing spent.
    pub fn enrol(
        message: MessageId,
        target: Target,
        kind: MessageKind,
        body_hash: String,
        request_id: RequestId,
        now: Millis,
    ) -> Core {
        Core {
            message,
            target,
            kind,
            body_hash,
            request_id,
            earlier_request_ids: Vec::new(),
            attempts: 0,
            refusals: 0,
            busy_at_write: 0,
            error_resends: 0,
            interrupt_resends: 0,
            enrolled_at: now,
            since: now,
            note: None,
        }
    }

    pub fn message(&self) -> &MessageId {
        &self.message
    }
    pub fn target(&self) -> &Target {
        &self.target
    }
    pub fn kind(&self) -> MessageKind {
        self.kind
    }
    pub fn body_hash(&self) -> &str {
        &self.body_hash
    }
    pub fn request_id(&self) -> &RequestId {
        &self.request_id
    }
    pub fn earlier_request_ids(&self) -> &[RequestId] {
        &self.earlier_request_ids
    }
    pub fn attempts(&self) -> u32 {
        self.attempts
    }
    pub fn refusals(&self) -> u32 {
        self.refusals
    }
    pub fn error_resends(&self) -> u32 {
        self.error_resends
    }
    pub fn interrupt_resends(&self) -> u32 {
        self.interrupt_resends
    }
    pub fn enrolled_at(&self) -> Millis {
        self.enrolled_at
    }
    pub fn since(&self) -> Millis {
        self.since
    }
    pub fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }

    /// Whether the current series is an automatic resend.
    pub fn is_resend(&self) -> bool {
        !self.earlier_request_ids.is_empty()
    }

    fn moved(mut self, now: Millis) -> Core {
        self.since = now;
        self.note = None;
        self
    }
}

// ----- reasons -----------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "why", rename_all = "snake_case")]
pub enum WaitingReason {
    /// Queued; the next pass tries it.
    Queued,
    /// Queued again as an automatic resend.
    Resend,
    /// A one-shot `tick` cannot start a turn that lives inside its own process.
    NeedsRunningEngine,
    /// The engine that reserved the write was fenced right before it (the recipient's lease
    /// had passed to another engine) and wrote nothing: queued again, for the engine that
    /// serves the recipient now. `detail` names the engine that held back.
    Withheld { detail: String },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "why", rename_all = "snake_case")]
pub enum BusyReason {
    /// The recipient is in the middle of a turn.
    RecipientInTurn {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        turn: Option<TurnId>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        detail: Option<String>,
    },
    /// Another delivery to the same recipient is active.
    EarlierDelivery { message: MessageId },
    /// The recipient's app turned the write away: its session was busy at that very moment
    /// (nothing was written). `times`: how many writes of this series were turned away so,
    /// which the engine backs off by.
    AtTheWrite { detail: String, times: u32 },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeldReason {
    /// Delivery is paused (`enabled=false`).
    Paused,
    /// The connection sender→recipient is not allowed.
    ConnectionBlocked,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "why", rename_all = "snake_case")]
pub enum UnavailableReason {
    AgentMissing,
    /// The destination differs from the one frozen at enrolment; `changed` names what.
    TargetChanged {
        #[serde(default)]
        changed: Vec<String>,
    },
    ActivityUnknown {
        detail: String,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "why", rename_all = "snake_case")]
pub enum UncertainCause {
    /// The write failed or timed out after it may have been sent.
    WriteError { detail: String },
    /// A reply came, but not an exact receipt (turn id and our request id).
    NoExactReceipt,
    /// No reply within the sending timeout (or the engine stopped mid-write).
    NoReplyInTime,
    /// An accepted turn could not be observed for the unobserved limit.
    Unobservable,
}

/// How a turn ended badly, for the resend rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnFailure {
    Errored,
    Interrupted,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "why", rename_all = "snake_case")]
pub enum FailCause {
    /// The delivered turn errored or was interrupted.
    Turn { failure: TurnFailure },
    /// The recipient's app refused the write twice; it was never delivered.
    RefusedTwice { detail: String },
    /// The message body changed after it was queued.
    ChangedAfterQueued,
    /// A queued resend was dropped: the work was returned or closed first.
    ResendDropped,
}

/// Whether a failed delivery will be resent.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "plan", rename_all = "snake_case")]
pub enum ResendPlan {
    /// A resend may go out from this instant, if the work is still open then.
    NotBefore { at: Millis },
    /// Final: no resend.
    Final { why: NoResend },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NoResend {
    /// No turn was ever delivered, so there is nothing to resend.
    NeverDelivered,
    LimitReached,
    /// The work was returned or closed, or the message was read.
    WorkDone,
    WindowPassed,
    Released,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "by", rename_all = "snake_case")]
pub enum CancelledBy {
    Person {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        note: Option<String>,
    },
    HistoryScans {
        scans: u32,
        first_at: Millis,
        last_at: Millis,
    },
}

/// The history scans of an UNCERTAIN delivery so far.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Scans {
    /// Complete scans that found nothing.
    pub empty: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_empty_at: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_at: Option<Millis>,
}

// ----- the fourteen states ---------------------------------------------------------------

/// Access to the data every state carries.
pub(crate) trait HasCore: Sized {
    fn core(&self) -> &Core;
    fn core_mut(&mut self) -> &mut Core;
    fn into_core(self) -> Core;
}

macro_rules! state {
    ($(#[$doc:meta])* $name:ident { $($(#[$fdoc:meta])* $field:ident : $ty:ty),* $(,)? }) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub struct $name {
            pub(crate) core: Core,
            $($(#[$fdoc])* pub(crate) $field: $ty,)*
        }

        impl $name {
            /// The data every state carries.
            pub fn core(&self) -> &Core {
                &self.core
            }
            $(
                $(#[$fdoc])*
                pub fn $field(&self) -> &$ty {
                    &self.$field
                }
            )*
        }

        impl HasCore for $name {
            fn core(&self) -> &Core {
                &self.core
            }
            fn core_mut(&mut self) -> &mut Core {
                &mut self.core
            }
            fn into_core(self) -> Core {
                self.core
            }
        }
    };
}

state!(
    /// Queued; the next pass tries it.
    Waiting { reason: WaitingReason }
);
state!(
    /// The recipient is in a turn, or another delivery to it is in flight.
    Busy { reason: BusyReason }
);
state!(
    /// Held on purpose (paused, or the connection is not allowed); no attempt spent.
    Held { reason: HeldReason }
);
state!(
    /// The agent is gone, its target changed, or its activity cannot be verified.
    Unavailable { reason: UnavailableReason }
);
state!(
    /// The recipient's app refused the write before accepting it; one retry is allowed.
    OwnerRejected { detail: String }
);
state!(
    /// One attempt is reserved (committed) and the write may be in flight.
    Sending {
        reserved_at: Millis,
        /// When the write was handed to the adapter (committed before it was); `None` while
        /// preparing. It is never handed over twice.
        issued_at: Option<Millis>,
    }
);
state!(
    /// The write may have landed but nobody can tell; observed, never resent.
    Uncertain {
        cause: UncertainCause,
        /// The turn, when a receipt once proved the write landed.
        turn: Option<TurnId>,
        scans: Scans,
    }
);
state!(
    /// The recipient's session took the turn (exact receipt).
    Accepted { turn: TurnId, observed_at: Millis }
);
state!(
    /// The turn is in progress.
    Running { turn: TurnId, observed_at: Millis }
);
state!(
    /// The turn finished.
    Returned { turn: TurnId }
);
state!(
    /// The turn failed or was interrupted, the app refused twice, or the message changed.
    Failed {
        cause: FailCause,
        turn: Option<TurnId>,
        resend: ResendPlan,
    }
);
state!(
    /// The recipient read the message itself before any turn was needed.
    Acknowledged {}
);
state!(
    /// Proven never received, or released by a person.
    Cancelled { by: CancelledBy }
);
state!(
    /// Identical to a plain handoff still pending or active; not sent.
    Duplicate { of: MessageId }
);

// ----- transitions -------------------------------------------------------------------------

/// Transitions every pending state (WAITING, BUSY, HELD, UNAVAILABLE, OWNER_REJECTED) shares:
/// the checks of one pass (SPEC §2.2) and the reservation.
pub(crate) trait Pending: HasCore {
    /// Step 1: the body changed after enrolment.
    fn changed_after_queued(self, now: Millis) -> Failed {
        Failed {
            core: self.into_core().moved(now),
            cause: FailCause::ChangedAfterQueued,
            turn: None,
            resend: ResendPlan::Final {
                why: NoResend::NeverDelivered,
            },
        }
    }
    /// A queued resend whose work was returned or closed meanwhile: final, nothing sent.
    fn drop_resend(self, now: Millis) -> Failed {
        Failed {
            core: self.into_core().moved(now),
            cause: FailCause::ResendDropped,
            turn: None,
            resend: ResendPlan::Final {
                why: NoResend::WorkDone,
            },
        }
    }
    /// Step 2: the recipient read it before a turn was needed.
    fn acknowledge(self, now: Millis) -> Acknowledged {
        Acknowledged {
            core: self.into_core().moved(now),
        }
    }
    /// Step 3.
    fn hold(self, reason: HeldReason, now: Millis) -> Held {
        Held {
            core: self.into_core().moved(now),
            reason,
        }
    }
    /// Steps 4 and 7.
    fn unavailable(self, reason: UnavailableReason, now: Millis) -> Unavailable {
        Unavailable {
            core: self.into_core().moved(now),
            reason,
        }
    }
    /// Step 5, or a lifted hold.
    fn wait(self, reason: WaitingReason, now: Millis) -> Waiting {
        Waiting {
            core: self.into_core().moved(now),
            reason,
        }
    }
    /// Steps 7 and 8.
    fn busy(self, reason: BusyReason, now: Millis) -> Busy {
        Busy {
            core: self.into_core().moved(now),
            reason,
        }
    }
    /// Step 8: one attempt reserved. The caller commits this before any byte is written.
    fn reserve(self, now: Millis) -> Sending {
        let mut core = self.into_core().moved(now);
        core.attempts += 1;
        Sending {
            core,
            reserved_at: now,
            issued_at: None,
        }
    }
}

macro_rules! pending {
    ($($name:ident),*) => {$(
        impl Pending for $name {}
    )*};
}
pending!(Waiting, Busy, Held, Unavailable, OwnerRejected);

/// A person's release: every non-terminal state can be cancelled; nothing is resent.
pub(crate) trait Releasable: HasCore {
    fn release(self, note: Option<String>, now: Millis) -> Cancelled {
        Cancelled {
            core: self.into_core().moved(now),
            by: CancelledBy::Person { note },
        }
    }
}

macro_rules! releasable {
    ($($name:ident),*) => {$(
        impl Releasable for $name {}
    )*};
}
releasable!(
    Waiting,
    Busy,
    Held,
    Unavailable,
    OwnerRejected,
    Sending,
    Uncertain,
    Accepted,
    Running
);

impl Waiting {
    /// Enrolment (SPEC §2.1): a new delivery, queued.
    pub(crate) fn enrol(core: Core) -> Waiting {
        Waiting {
            core,
            reason: WaitingReason::Queued,
        }
    }
}

impl Duplicate {
    /// Enrolment of a plain handoff identical to a live one.
    pub(crate) fn enrol(core: Core, of: MessageId) -> Duplicate {
        Duplicate { core, of }
    }
}

impl Sending {
    /// Step 9 passed: the write is handed to the adapter, exactly once.
    #[must_use]
    pub(crate) fn issue_write(mut self, now: Millis) -> Sending {
        self.issued_at = Some(now);
        self
    }

    /// Whether the write was handed over.
    pub fn write_issued(&self) -> bool {
        self.issued_at.is_some()
    }

    /// Nothing was written (step 9 failed, or the engine stopped before issuing the write):
    /// back to a pending state. The reserved attempt stays counted, unused.
    pub(crate) fn back_out(self, now: Millis) -> Waiting {
        Waiting {
            core: self.core.moved(now),
            reason: WaitingReason::Queued,
        }
    }

    /// Exact receipt: the turn id, and our request id echoed.
    pub(crate) fn accept(self, turn: TurnId, now: Millis) -> Accepted {
        Accepted {
            core: self.core.moved(now),
            turn,
            observed_at: now,
        }
    }

    /// The app refused the write before accepting it: retried while `refusal_retries_max`
    /// allows, then FAILED, so a refusing app never holds its recipient.
    pub(crate) fn refused(self, detail: String, now: Millis, policy: &Policy) -> AfterRefusal {
        let mut core = self.core.moved(now);
        core.refusals += 1;
        if core.refusals > policy.refusal_retries_max {
            AfterRefusal::Failed(Failed {
                core,
                cause: FailCause::RefusedTwice { detail },
                turn: None,
                resend: ResendPlan::Final {
                    why: NoResend::NeverDelivered,
                },
            })
        } else {
            AfterRefusal::Retry(OwnerRejected { core, detail })
        }
    }

    /// The outcome of the write is unknown: never repeated for this attempt. `turn` is a
    /// turn the app reported without an exact receipt: proof enough that something landed.
    pub(crate) fn uncertain(
        self,
        cause: UncertainCause,
        turn: Option<TurnId>,
        now: Millis,
    ) -> Uncertain {
        Uncertain {
            core: self.core.moved(now),
            cause,
            turn,
            scans: Scans::default(),
        }
    }
}

/// Where an explicit refusal leads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AfterRefusal {
    /// One more try is allowed.
    Retry(OwnerRejected),
    /// Refused too often: never delivered.
    Failed(Failed),
}

/// What observation can learn of an active delivery's turn (from UNCERTAIN, ACCEPTED and
/// RUNNING alike).
pub(crate) trait Observable: HasCore {
    fn observed_accepted(self, turn: TurnId, now: Millis) -> Accepted {
        Accepted {
            core: self.into_core().moved(now),
            turn,
            observed_at: now,
        }
    }
    fn observed_running(self, turn: TurnId, now: Millis) -> Running {
        Running {
            core: self.into_core().moved(now),
            turn,
            observed_at: now,
        }
    }
    fn observed_returned(self, turn: TurnId, now: Millis) -> Returned {
        Returned {
            core: self.into_core().moved(now),
            turn,
        }
    }
    /// The delivered turn failed: decide now whether a resend may follow (SPEC §2.3).
    fn observed_failed(
        self,
        turn: TurnId,
        failure: TurnFailure,
        now: Millis,
        policy: &Policy,
    ) -> Failed {
        let core = self.into_core().moved(now);
        let (spent, max, wait_ms) = match failure {
            TurnFailure::Errored => (core.error_resends, policy.error_resends_max, 0),
            TurnFailure::Interrupted => (
                core.interrupt_resends,
                policy.interrupt_resends_max,
                policy.interrupt_resend_wait_ms,
            ),
        };
        let resend = if spent < max {
            ResendPlan::NotBefore {
                at: now.plus_ms(wait_ms),
            }
        } else {
            ResendPlan::Final {
                why: NoResend::LimitReached,
            }
        };
        Failed {
            core,
            cause: FailCause::Turn { failure },
            turn: Some(turn),
            resend,
        }
    }
}

macro_rules! observable {
    ($($name:ident),*) => {$(
        impl Observable for $name {}
    )*};
}
observable!(Uncertain, Accepted, Running);

impl Accepted {
    /// Not observable for the unobserved limit: nobody can tell how the turn ended.
    pub(crate) fn unobservable(self, now: Millis) -> Uncertain {
        Uncertain {
            cause: UncertainCause::Unobservable,
            turn: Some(self.turn),
            core: self.core.moved(now),
            scans: Scans::default(),
        }
    }
}

impl Running {
    /// Not observable for the unobserved limit: nobody can tell how the turn ended.
    pub(crate) fn unobservable(self, now: Millis) -> Uncertain {
        Uncertain {
            cause: UncertainCause::Unobservable,
            turn: Some(self.turn),
            core: self.core.moved(now),
            scans: Scans::default(),
        }
    }
}

impl Uncertain {
    /// Enough complete, empty history scans over a long enough span: never delivered.
    pub(crate) fn never_delivered(self, now: Millis) -> Cancelled {
        let first_at = self.scans.first_empty_at.unwrap_or(now);
        Cancelled {
            by: CancelledBy::HistoryScans {
                scans: self.scans.empty,
                first_at,
                last_at: now,
            },
            core: self.core.moved(now),
        }
    }
}

impl Failed {
    /// An automatic resend: WAITING again with a fresh request id; the earlier turn is never
    /// replayed and the earlier request id is kept.
    pub(crate) fn resend_with(self, fresh: RequestId, now: Millis) -> Waiting {
        let mut core = self.core.moved(now);
        match self.cause {
            FailCause::Turn {
                failure: TurnFailure::Errored,
            } => core.error_resends += 1,
            FailCause::Turn {
                failure: TurnFailure::Interrupted,
            } => core.interrupt_resends += 1,
            FailCause::RefusedTwice { .. }
            | FailCause::ChangedAfterQueued
            | FailCause::ResendDropped => {}
        }
        let old = std::mem::replace(&mut core.request_id, fresh);
        core.earlier_request_ids.push(old);
        core.attempts = 0;
        core.refusals = 0;
        core.busy_at_write = 0;
        Waiting {
            core,
            reason: WaitingReason::Resend,
        }
    }

    /// The resend decision becomes final.
    #[must_use]
    pub(crate) fn finalize(mut self, why: NoResend) -> Failed {
        self.resend = ResendPlan::Final { why };
        self
    }
}

/// The planted "resend from UNCERTAIN" bug needs a transition that SPEC §2 forbids; it exists
/// only in test builds.
#[cfg(feature = "planted-bugs")]
impl Uncertain {
    pub(crate) fn planted_resend(self, fresh: RequestId, now: Millis) -> Waiting {
        let mut core = self.core.moved(now);
        let old = std::mem::replace(&mut core.request_id, fresh);
        core.earlier_request_ids.push(old);
        core.error_resends += 1;
        core.attempts = 0;
        Waiting {
            core,
            reason: WaitingReason::Resend,
        }
    }
}
