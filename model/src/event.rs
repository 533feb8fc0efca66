//! What can happen to a delivery (`Event`) and what the engine must do next (`Effect`).
//! Everything the rules look at arrives inside the event, gathered by the caller: the clock,
//! fresh ids, the recipient's answers, the database's facts.

use crate::delivery::{Delivery, StateKind};
use crate::ids::{MessageId, Millis, RequestId, TurnId};
use crate::states::{Target, TurnFailure};
use serde::{Deserialize, Serialize};

/// One input to `step`, at one instant.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Event {
    pub now: Millis,
    pub kind: EventKind,
}

impl Event {
    pub fn new(now: Millis, kind: EventKind) -> Event {
        Event { now, kind }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum EventKind {
    /// An engine pass reaches this delivery (SPEC §2.2 steps 1–6, §2.3 resends).
    PassStarted(PassFacts),
    /// The adapter's answer to `Effect::CheckActivity` (step 7).
    ActivityObserved { activity: Activity },
    /// The reservation transaction's view (step 8): another active delivery to the same
    /// recipient, if any, and the permission read in that same transaction, so a pause or a
    /// block committed after the pass began holds the delivery before an attempt is spent.
    Reservation {
        earlier_active: Option<MessageId>,
        permission: Permission,
    },
    /// The re-check at the send boundary, after preparing (step 9): permission, the
    /// recipient's registration (so a moved agent gets nothing) and activity.
    SendBoundary {
        permission: Permission,
        recipient: Option<Target>,
        activity: Activity,
        /// Whether the work is still open (a resend of done work is dropped).
        work_open: bool,
    },
    /// What the one write returned (step 10).
    WriteResult { outcome: WriteOutcome },
    /// What the adapter observed of the request id (SPEC §2.3).
    Observation { observed: Observed },
    /// A search of the recipient's session history for the request id (SPEC §2.4).
    HistoryScan { scan: ScanResult },
    /// A person releases the delivery (`handoffs release`).
    Release { note: Option<String> },
    /// Only time went by: the timeouts of SPEC §2.3.
    TimePassed,
}

impl EventKind {
    /// A short name for tables and logs.
    pub fn name(&self) -> &'static str {
        match self {
            EventKind::PassStarted(_) => "pass_started",
            EventKind::ActivityObserved { .. } => "activity_observed",
            EventKind::Reservation { .. } => "reservation",
            EventKind::SendBoundary { .. } => "send_boundary",
            EventKind::WriteResult { .. } => "write_result",
            EventKind::Observation { .. } => "observation",
            EventKind::HistoryScan { .. } => "history_scan",
            EventKind::Release { .. } => "release",
            EventKind::TimePassed => "time_passed",
        }
    }
}

/// The facts of the database and the world an engine pass gathers for one delivery.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PassFacts {
    /// Hash of the message body now.
    pub body_hash: String,
    /// Whether the recipient has read the message.
    pub read_by_recipient: bool,
    /// Work: not yet returned or closed. A plain message: not yet read.
    pub work_open: bool,
    /// Whether delivery is enabled and the connection sender→recipient allowed.
    pub permission: Permission,
    /// The recipient as registered now; `None` when it is not registered.
    pub recipient: Option<Target>,
    /// This pass is a one-shot `tick` (its process ends with the pass).
    pub one_shot: bool,
    /// The outage guard's report, when it reports an outage.
    pub outage: Option<String>,
    /// A fresh request id, used only if this pass resends.
    pub fresh_request_id: RequestId,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Permission {
    Allowed,
    /// Delivery is disabled (`enabled=false`).
    Paused,
    /// The connection sender→recipient is not allowed.
    Blocked,
}

/// What the recipient's session is doing (SPEC §4 activity).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "activity", rename_all = "snake_case")]
pub enum Activity {
    Idle,
    Busy {
        turn: Option<TurnId>,
        detail: Option<String>,
    },
    Finished,
    Stopped,
    Failed,
    Unknown {
        detail: String,
    },
}

/// What one write returned (SPEC §4 start).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum WriteOutcome {
    /// A receipt: the turn id, and the request id the app echoed (if it did).
    Receipt {
        turn: TurnId,
        request_id: Option<RequestId>,
    },
    /// The app refused before accepting anything; nothing was written.
    Refused { detail: String },
    /// The app turned the write away because the session was busy at that very moment (a turn
    /// began, or another process took the session, after the engine's last look); nothing was
    /// written. The delivery waits, as for a busy recipient; this is no refusal.
    Busy { detail: String },
    /// The engine did not hand the write to the adapter: right before it, the recipient's
    /// lease was found to have passed to another engine (fencing, issue 17). Nothing was
    /// written, and the engine that held back says so, in a transaction that does not need
    /// the lease: the reservation it made is backed out (its attempt stays counted, unused),
    /// so the engine that serves the recipient now delivers it at once instead of finding it
    /// UNCERTAIN once the sending timeout runs out.
    Withheld { detail: String },
    /// An error after the write may have been sent.
    Failed { detail: String },
    /// No answer in time.
    TimedOut,
}

/// What observation learned of a request id (SPEC §4 observe).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "observed", rename_all = "snake_case")]
pub enum Observed {
    Accepted {
        turn: TurnId,
    },
    Running {
        turn: TurnId,
    },
    Returned {
        turn: TurnId,
    },
    /// The turn failed; `turn_open` when the same turn is still open (a recoverable error).
    Failed {
        turn: TurnId,
        failure: TurnFailure,
        turn_open: bool,
    },
    /// The recipient knows no such request.
    NotFound,
    /// The recipient could not be asked.
    Unreachable {
        detail: String,
    },
}

/// A history scan's answer.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "scan", rename_all = "snake_case")]
pub enum ScanResult {
    /// The request id was found, with what became of it.
    Found { observed: Observed },
    /// No candidate found; `complete` only when the whole relevant history was searched.
    NothingFound { complete: bool },
}

/// What the engine must do after committing the step's record.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "effect", rename_all = "snake_case")]
pub enum Effect {
    /// Ask the adapter for the recipient's activity; feed `ActivityObserved`.
    CheckActivity,
    /// Open the reservation transaction; feed `Reservation`.
    Reserve,
    /// Let the adapter prepare, then re-check; feed `SendBoundary`.
    Prepare,
    /// Write one turn, once, with this request id, to this target; feed `WriteResult`.
    Write {
        request_id: RequestId,
        target: Target,
    },
    /// Ask the adapter what became of the request id; feed `Observation`.
    Observe { request_id: RequestId },
    /// Search the recipient's session history for the request id; feed `HistoryScan`.
    ScanHistory { request_id: RequestId },
}

/// What a step did to the record.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "change", rename_all = "snake_case")]
pub enum Change {
    /// A transition to another state.
    Moved { from: StateKind, to: StateKind },
    /// Same state, new data (a refreshed observation, a counted scan, a note).
    Updated,
    /// Already there: nothing to change (a repeated receipt, a release of a cancelled one).
    Unchanged,
    /// The event does not apply to this state (a stale reply); the record is untouched.
    Ignored { why: &'static str },
}

/// The result of `step`: the record to commit, and then the effects to perform in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    pub record: Delivery,
    pub effects: Vec<Effect>,
    pub change: Change,
}
