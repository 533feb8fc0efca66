//! The world the delivery rules are checked in: one durable store, an engine that can crash
//! and recover from it, one or two recipients whose sessions can each be idle, busy with our
//! turn or with someone else's, finish, fail, be interrupted, refuse, go down and lose
//! replies, and a person who can read, release, pause, block and return work. Every change to
//! a delivery goes through `model::step`, the very function the engine calls, and every
//! reminder of overdue work through `model::work::reminder_due`.
//!
//! The store is split the way a crash splits it: `State::store` is what was committed
//! (durable: a crash keeps it) and `State::uncommitted` what a process computed but has not
//! committed yet (a crash loses it). A correct engine commits each step's record in the same
//! transaction that decides it and performs the step's effects only after that commit, and a
//! correct `send` answers only after its message and delivery are committed; so a crash
//! between computing and committing is the same as a crash just before the step, and the
//! world commits each step at once. Only a planted bug lets something out before its commit:
//! `WorldPlant::EnrolAfterCommit` (the enrolment waits in `State::uncommitted`) and
//! `PlantedBug::ReserveAfterWrite` (the reservation waits in the engine's memory,
//! `Phase::Uncommitted`).
//!
//! Indexes are stored as `u8`: these worlds hold a handful of messages and writes.
//!
//! Beside the world, a ghost log records what really happened (writes the recipients saw,
//! reservations, resends, scans, cancels, what each sender was told, reminders), so
//! properties judge the rules from outside them.

#![allow(clippy::cast_possible_truncation)]

use model::PlantedBug;
use model::states::TurnFailure;
use model::{
    Activity, Change, Core, Delivery, Effect, Event, EventKind, MessageId, MessageKind, Millis,
    Observed, PassFacts, Permission, Policy, Provider, RequestId, ScanResult, StateKind, Target,
    TurnId, WriteOutcome,
};
use stateright::Model;

pub const MINUTE_MS: u64 = 60_000;
pub const HOUR_MS: u64 = 60 * MINUTE_MS;
/// How late a reminder of overdue work may be and still be in time (G7): the engine's
/// housekeeping runs when a reminder falls due and at least once a minute; the simulation's
/// oracle allows the same two minutes (`sim::oracle::REMINDER_LAG`).
pub const REMINDER_LAG_MS: u64 = 2 * MINUTE_MS;

/// A message the world will send.
#[derive(Clone, Debug)]
pub struct Msg {
    pub kind: MessageKind,
    /// The same sender, recipient and body as an earlier message.
    pub identical_to: Option<usize>,
    /// Its recipient, by index (each recipient is its own agent with its own session).
    pub to: u8,
    /// Work only: it falls due this long after it is sent (G7).
    pub due_ms: Option<u64>,
}

/// A known-wrong behaviour planted in the world (the engine's scheduling or the `send`
/// command), where `model::step` cannot express it: shows that a property can fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WorldPlant {
    /// `send` commits the message and answers success, then enrols its delivery in a second
    /// transaction: a crash in between loses the delivery (breaks G8).
    EnrolAfterCommit,
    /// The engine never schedules another look at an UNCERTAIN delivery (the engine's
    /// `scan_never_rescheduled`): no pass, so no history scan, ever again (breaks liveness).
    ScanNeverRescheduled,
}

/// How many times each fault or human act may happen in one run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Faults {
    pub lost_replies: u8,
    /// Writes lost on the way: they never land, and no reply comes.
    pub lost_writes: u8,
    /// Replies that carry a turn id but not our request id.
    pub inexact_receipts: u8,
    pub crashes: u8,
    pub refusals: u8,
    pub errored_turns: u8,
    pub interrupted_turns: u8,
    pub foreign_turns: u8,
    /// A person's turn (or another process) takes the session after the send boundary and
    /// before the write lands, at a host that checks its session as it writes (Codex's writer
    /// lock, Claude's session lock and registry, an HTTP app answering 423): the app turns the
    /// write away as busy, and nothing is written.
    pub races_at_write: u8,
    pub outages: u8,
    pub agent_downs: u8,
    pub releases: u8,
    pub reads: u8,
    pub work_done: u8,
    pub pauses: u8,
    pub blocks: u8,
    pub endpoint_changes: u8,
    pub body_changes: u8,
    /// Days the engine may sleep through (jumps past a resend window).
    pub long_sleeps: u8,
    /// Jumps of the clock to the next deadline (unbounded in urgent worlds, where time only
    /// passes when nothing else can happen).
    pub time_jumps: u8,
}

#[derive(Clone, Debug)]
pub struct World {
    /// The policy the engine runs with (a test may break it on purpose).
    pub policy: Policy,
    pub messages: Vec<Msg>,
    pub faults: Faults,
    /// Time never passes beyond this.
    pub horizon_ms: u64,
    /// Liveness mode: time passes only when nothing else can happen.
    pub urgent: bool,
    pub plant: Option<WorldPlant>,
    pub properties: fn() -> Vec<stateright::Property<World>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Session {
    Idle,
    /// Our turn, by its index in the recipient's history.
    Ours(u8),
    /// A turn someone else started (a person typing, another tool).
    Foreign,
    /// Like `Foreign`, but it took the session while our write was on its way, at a host
    /// that checks its session as it writes: our write is turned away as busy.
    Taken,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TurnStatus {
    Running,
    Returned,
    Failed(TurnFailure),
}

/// A write that landed in the recipient's session: its history, which a scan searches.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Landed {
    pub msg: u8,
    pub request_id: RequestId,
    pub status: TurnStatus,
    pub ended_at: Option<Millis>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// The reservation is committed; the adapter is preparing.
    Reserved,
    /// The send boundary is committed (`issued_at`); the write is on its way.
    Issued,
    /// The write went out; the reply (if not lost) is on its way back.
    Awaiting(Option<WriteOutcome>),
    /// Planted bug only: the write landed before the reservation was committed.
    Uncommitted(WriteOutcome),
}

/// How the recipient's app takes a write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Landing {
    /// It lands and an exact receipt comes back.
    Lands,
    /// It lands; the receipt has a turn id but not our request id.
    Inexact,
    /// The app refuses it before accepting anything.
    Refused,
    /// It is lost on the way: nothing lands, no reply.
    Lost,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Inflight {
    pub msg: u8,
    pub phase: Phase,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct MsgState {
    pub read: bool,
    /// Work returned (or closed): no longer open.
    pub work_done: bool,
    pub body_changed: bool,
    /// Work with a due time: when it falls due (the work row's `due_at`).
    pub due_at: Option<Millis>,
    /// When its sender was reminded (the work row's `reminded_at`).
    pub reminded_at: Option<Millis>,
    /// Work with a due time: when it was returned.
    pub returned_at: Option<Millis>,
}

/// One recipient agent: its session, where it is registered, whether its host is up.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Recipient {
    pub session: Session,
    /// Where the recipient is registered now: one of two destinations (two URLs of one
    /// agent id), which a person can switch back and forth.
    pub dest: u8,
    pub down: bool,
}

/// One write a recipient's app received.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WriteLog {
    pub msg: u8,
    pub request_id: RequestId,
    /// The recipient and the destination (0 or 1) the write reached, as the world saw it.
    pub landed_at: (u8, u8),
    /// The session of the recipient it reached was busy.
    pub session_busy: bool,
    pub refused: bool,
    /// The recipient's activity could not be verified when the write was issued.
    pub activity_unknown: bool,
    /// Read from the durable store as the write arrived: it held this message's delivery
    /// SENDING with this request id and its write issued (a committed reservation).
    pub committed_before: bool,
}

/// A reminder a sender received about overdue work.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ReminderLog {
    pub msg: u8,
    pub at: Millis,
    /// The work was still open (not returned) when the reminder went out.
    pub work_open: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ResendLog {
    pub msg: u8,
    pub from: StateKind,
    pub failure: Option<TurnFailure>,
    pub failed_at: Millis,
    pub at: Millis,
    pub fresh_id_new: bool,
    pub work_open: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ScanLog {
    pub msg: u8,
    pub request_id: RequestId,
    pub at: Millis,
    pub complete_and_empty: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CancelLog {
    pub msg: u8,
    pub by_person: bool,
    pub request_id: RequestId,
    pub at: Millis,
}

/// What really happened, kept beside the world for the properties.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Ghost {
    pub writes: Vec<WriteLog>,
    /// Reservations ever made, per message, across all series.
    pub reservations: Vec<u8>,
    pub reserved_during_outage: bool,
    pub resends: Vec<ResendLog>,
    pub scans: Vec<ScanLog>,
    pub cancels: Vec<CancelLog>,
    /// A crash struck between a reservation and its reply.
    pub crashed_mid_write: Vec<u8>,

    /// A resend was issued after its work was returned or closed.
    pub issued_resend_of_done_work: bool,
    /// A write was issued while the recipient's activity could not be verified.
    pub issued_while_unknown: bool,
    /// A write was issued although the agent's registration (its whole destination) no
    /// longer matched the one its message was sent to.
    pub issued_to_moved_agent: bool,
    /// Request ids whose write was lost on the way.
    pub lost_writes: Vec<RequestId>,
    /// The recipient and the destination it was registered at when each message was sent.
    pub queued_for: Vec<Option<(u8, u8)>>,
    /// The sender was told its `send` succeeded.
    pub sent_ok: Vec<bool>,
    /// Reminders the senders received.
    pub reminders: Vec<ReminderLog>,
    /// Request ids whose write the recipient's app turned away because its session was taken
    /// as the write arrived (nothing written).
    pub turned_away_busy: Vec<RequestId>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub now: Millis,
    /// The durable store: one committed record per enrolled message. A crash keeps it.
    pub store: Vec<Option<Delivery>>,
    /// Records computed but not committed yet, per message: a crash loses them. Only a
    /// planted `send` that answers before enrolling leaves one here.
    pub uncommitted: Vec<Option<Delivery>>,
    /// The engine's memory, lost in a crash.
    pub inflight: Vec<Inflight>,
    pub msgs: Vec<MsgState>,
    pub recipients: Vec<Recipient>,
    /// What landed in the recipients' sessions, in order (each entry's message names its
    /// recipient): their histories, which a scan searches.
    pub history: Vec<Landed>,
    pub outage: bool,
    pub paused: bool,
    pub blocked: bool,
    pub left: Faults,
    pub ghost: Ghost,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Send(u8),
    /// Planted `send` only: the delivery's enrolment, committed after the answer.
    CommitEnrolment(u8),
    Pass(u8),
    Boundary(u8),
    Land(u8, Landing),
    CommitLate(u8),
    Reply(u8),
    LoseReply(u8),
    WriteTimesOut(u8),
    Crash,
    /// Recipient `.0`'s turn ends.
    TurnEnds(u8, Option<TurnFailure>),
    ForeignTurnStarts(u8),
    /// A person's turn takes recipient `.0`'s session while our write is on its way.
    TakenAtWrite(u8),
    ForeignTurnEnds(u8),
    OutageStarts,
    OutageEnds,
    AgentDown(u8),
    AgentUp(u8),
    Read(u8),
    WorkDone(u8),
    /// The engine reminds the sender of overdue work (`model::work::reminder_due`).
    Remind(u8),
    Release(u8),
    TogglePause,
    ToggleBlock,
    EndpointChanges(u8),
    BodyChanges(u8),
    Advance(Millis, bool),
}

/// Recipient `r` as registered at destination `dest`: the same agent id, provider and
/// endpoint, another URL (the route), as a re-registration with `--set url=…` makes it.
pub fn target(r: u8, dest: u8) -> Target {
    Target {
        agent: model::AgentId::new(format!("rcpt{r}")),
        provider: Provider::Command,
        endpoint: "s".to_owned(),
        cwd: "/w".to_owned(),
        route: [("url".to_owned(), format!("\"http://rcpt{r}.d{dest}/\""))].into(),
    }
}

/// Which recipient and destination a target's route addresses: how the engine's adapter
/// resolves it.
fn dest_of(target: &Target) -> (u8, u8) {
    let url = target.route.get("url").map_or("", String::as_str);
    (
        u8::from(url.contains("rcpt1.")),
        u8::from(url.contains(".d1/")),
    )
}

fn request_id(msg: usize, series: usize) -> RequestId {
    RequestId::new(format!("r{msg}.{series}"))
}

fn body_hash(msg: &Msg, index: usize, changed: bool) -> String {
    let base = msg.identical_to.unwrap_or(index);
    if changed {
        format!("b{base}'")
    } else {
        format!("b{base}")
    }
}

impl World {
    /// Applies one event to message `k` through `model::step`, committing the record and
    /// logging what the ghost needs. Returns the effects to perform.
    fn apply(&self, s: &mut State, k: usize, kind: EventKind) -> Vec<Effect> {
        let Some(record) = s.store[k].clone() else {
            return Vec::new();
        };
        let is_release = matches!(kind, EventKind::Release { .. });
        let before_kind = record.kind();
        let old_id = record.core().request_id().clone();
        let before_failure = match &record {
            Delivery::Failed(f) => match f.cause() {
                model::states::FailCause::Turn { failure } => Some(*failure),
                _ => None,
            },
            _ => None,
        };
        let step = model::step(record, Event::new(s.now, kind), &self.policy);
        if let Change::Moved { to, .. } = step.change {
            if to == StateKind::Sending {
                s.ghost.reservations[k] += 1;
                if s.outage {
                    s.ghost.reserved_during_outage = true;
                }
            }
            if to == StateKind::Cancelled {
                s.ghost.cancels.push(CancelLog {
                    msg: k as u8,
                    by_person: is_release,
                    request_id: step.record.core().request_id().clone(),
                    at: s.now,
                });
            }
        }
        let new_id = step.record.core().request_id().clone();
        if new_id != old_id {
            // When the recipient's turn really ended, from its own history.
            let ended = s
                .history
                .iter()
                .find(|l| l.request_id == old_id)
                .and_then(|l| l.ended_at);
            s.ghost.resends.push(ResendLog {
                msg: k as u8,
                from: before_kind,
                failure: before_failure,
                failed_at: ended.unwrap_or(Millis(u64::MAX)),
                at: s.now,
                fresh_id_new: !step.record.core().earlier_request_ids().contains(&new_id)
                    && !s.history.iter().any(|l| l.request_id == new_id),
                work_open: self.work_open(s, k),
            });
        }
        s.store[k] = Some(step.record);
        step.effects
    }

    fn work_open(&self, s: &State, k: usize) -> bool {
        match self.messages[k].kind {
            MessageKind::Plain => !s.msgs[k].read,
            MessageKind::Work => !s.msgs[k].work_done,
        }
    }

    /// The recipient of message `k`.
    fn to(&self, k: usize) -> usize {
        self.messages[k].to as usize
    }

    /// How many recipients the world has: as many as its messages address (at least one).
    pub fn recipient_count(&self) -> usize {
        self.messages
            .iter()
            .map(|m| m.to as usize + 1)
            .max()
            .unwrap_or(1)
    }

    /// Another delivery to the same recipient that is active (SPEC §2.2 step 8).
    fn earlier_active(&self, s: &State, k: usize) -> Option<MessageId> {
        s.store.iter().enumerate().find_map(|(j, d)| {
            d.as_ref()
                .filter(|d| j != k && self.to(j) == self.to(k) && d.is_active())
                .map(|d| d.core().message().clone())
        })
    }

    fn activity(s: &State, r: usize) -> Activity {
        if s.recipients[r].down {
            Activity::Unknown {
                detail: "agent host down".to_owned(),
            }
        } else {
            match s.recipients[r].session {
                Session::Idle => Activity::Idle,
                Session::Ours(i) => Activity::Busy {
                    turn: Some(TurnId::new(format!("t{i}"))),
                    detail: None,
                },
                Session::Foreign | Session::Taken => Activity::Busy {
                    turn: None,
                    detail: None,
                },
            }
        }
    }

    fn permission(s: &State) -> Permission {
        if s.paused {
            Permission::Paused
        } else if s.blocked {
            Permission::Blocked
        } else {
            Permission::Allowed
        }
    }

    /// What recipient `r`'s session says about `request_id`, from its own history.
    fn observe(&self, s: &State, r: usize, request_id: &RequestId) -> Observed {
        if s.recipients[r].down {
            return Observed::Unreachable {
                detail: "agent host down".to_owned(),
            };
        }
        match s
            .history
            .iter()
            .enumerate()
            .find(|(_, l)| self.to(l.msg as usize) == r && &l.request_id == request_id)
        {
            None => Observed::NotFound,
            Some((i, landed)) => {
                let turn = TurnId::new(format!("t{i}"));
                match landed.status {
                    TurnStatus::Running => Observed::Running { turn },
                    TurnStatus::Returned => Observed::Returned { turn },
                    TurnStatus::Failed(failure) => Observed::Failed {
                        turn,
                        failure,
                        turn_open: false,
                    },
                }
            }
        }
    }

    fn pass(&self, s: &mut State, k: usize) {
        let r = self.to(k);
        self.apply(s, k, EventKind::TimePassed);
        let series = s.store[k]
            .as_ref()
            .map_or(0, |d| d.core().earlier_request_ids().len() + 1);
        let facts = PassFacts {
            body_hash: body_hash(&self.messages[k], k, s.msgs[k].body_changed),
            read_by_recipient: s.msgs[k].read,
            work_open: self.work_open(s, k),
            permission: Self::permission(s),
            recipient: Some(target(r as u8, s.recipients[r].dest)),
            one_shot: false,
            outage: s.outage.then(|| "provider outage".to_owned()),
            fresh_request_id: request_id(k, series),
        };
        let mut effects = self.apply(s, k, EventKind::PassStarted(facts));
        // An engine that restarted resumes a reservation it no longer holds in memory.
        let resumable = matches!(&s.store[k], Some(Delivery::Sending(_)))
            && !s.inflight.iter().any(|f| f.msg as usize == k);
        if resumable {
            s.inflight.push(Inflight {
                msg: k as u8,
                phase: Phase::Reserved,
            });
        }
        while let Some(effect) = (!effects.is_empty()).then(|| effects.remove(0)) {
            let more = match effect {
                Effect::CheckActivity => {
                    let activity = Self::activity(s, r);
                    self.apply(s, k, EventKind::ActivityObserved { activity })
                }
                Effect::Reserve => {
                    if self.policy.planted(PlantedBug::ReserveAfterWrite) {
                        // The bug: the write goes out first, the reservation is committed
                        // later (CommitLate), and a crash in between forgets it.
                        let outcome = self.land(s, k, Landing::Lands);
                        s.inflight.push(Inflight {
                            msg: k as u8,
                            phase: Phase::Uncommitted(outcome.unwrap_or(WriteOutcome::TimedOut)),
                        });
                        Vec::new()
                    } else {
                        let earlier_active = self.earlier_active(s, k);
                        let permission = Self::permission(s);
                        self.apply(
                            s,
                            k,
                            EventKind::Reservation {
                                earlier_active,
                                permission,
                            },
                        )
                    }
                }
                Effect::Prepare => {
                    if !s.inflight.iter().any(|f| f.msg as usize == k) {
                        s.inflight.push(Inflight {
                            msg: k as u8,
                            phase: Phase::Reserved,
                        });
                    }
                    Vec::new()
                }
                Effect::Observe { request_id } => {
                    let observed = self.observe(s, r, &request_id);
                    self.apply(s, k, EventKind::Observation { observed })
                }
                Effect::ScanHistory { request_id } => {
                    let scan = if s.recipients[r].down {
                        ScanResult::NothingFound { complete: false }
                    } else {
                        match self.observe(s, r, &request_id) {
                            Observed::NotFound | Observed::Unreachable { .. } => {
                                ScanResult::NothingFound { complete: true }
                            }
                            observed => ScanResult::Found { observed },
                        }
                    };
                    s.ghost.scans.push(ScanLog {
                        msg: k as u8,
                        request_id: request_id.clone(),
                        at: s.now,
                        complete_and_empty: scan == ScanResult::NothingFound { complete: true },
                    });
                    self.apply(s, k, EventKind::HistoryScan { scan })
                }
                Effect::Write { .. } => Vec::new(), // only the send boundary issues writes
            };
            effects.extend(more);
        }
    }

    /// The send boundary, committed: permission, registration and activity re-checked.
    fn boundary(&self, s: &mut State, slot: usize) {
        let k = s.inflight[slot].msg as usize;
        let r = self.to(k);
        let event = EventKind::SendBoundary {
            permission: Self::permission(s),
            recipient: Some(target(r as u8, s.recipients[r].dest)),
            activity: Self::activity(s, r),
            work_open: self.work_open(s, k),
        };
        let effects = self.apply(s, k, event);
        if effects.iter().any(|e| matches!(e, Effect::Write { .. })) {
            if s.recipients[r].down {
                s.ghost.issued_while_unknown = true;
            }
            if s.ghost.queued_for[k] != Some((r as u8, s.recipients[r].dest)) {
                s.ghost.issued_to_moved_agent = true;
            }
            let is_resend = s.store[k]
                .as_ref()
                .is_some_and(|d| !d.core().earlier_request_ids().is_empty());
            if is_resend && !self.work_open(s, k) {
                s.ghost.issued_resend_of_done_work = true;
            }
            s.inflight[slot].phase = Phase::Issued;
        } else {
            s.inflight.remove(slot);
        }
    }

    /// A write reaches the recipient's app (or is lost on the way); returns the reply.
    fn land(&self, s: &mut State, k: usize, how: Landing) -> Option<WriteOutcome> {
        let record = s.store[k].as_ref()?;
        let request_id = record.core().request_id().clone();
        // The engine's adapter addresses the target frozen in the record; the planted bug
        // resolves the registration as it is at the moment of writing.
        let (to, frozen_dest) = dest_of(record.core().target());
        let landed_at = if self.policy.planted(PlantedBug::ResolveAtWrite) {
            (to, s.recipients[to as usize].dest)
        } else {
            (to, frozen_dest)
        };
        // The recipient looks the reservation up in the durable store as the write arrives.
        let committed_before = matches!(
            record,
            Delivery::Sending(x) if x.core().request_id() == &request_id && x.write_issued()
        );
        let r = to as usize;
        let mut log = WriteLog {
            msg: k as u8,
            request_id: request_id.clone(),
            landed_at,
            session_busy: s.recipients[r].session != Session::Idle,
            refused: false,
            activity_unknown: s.recipients[r].down,
            committed_before,
        };
        let outcome = match how {
            Landing::Lost => {
                s.left.lost_writes -= 1;
                s.ghost.lost_writes.push(request_id);
                return None;
            }
            _ if s.recipients[r].down => {
                log.refused = true;
                WriteOutcome::Refused {
                    detail: "connection refused".to_owned(),
                }
            }
            // The app checks its session as it writes: taken, so nothing is written.
            _ if s.recipients[r].session == Session::Taken => {
                s.ghost.turned_away_busy.push(request_id);
                return Some(WriteOutcome::Busy {
                    detail: "a person's turn took the session".to_owned(),
                });
            }
            Landing::Refused => {
                s.left.refusals -= 1;
                log.refused = true;
                WriteOutcome::Refused {
                    detail: "refused".to_owned(),
                }
            }
            Landing::Lands | Landing::Inexact => {
                let index = s.history.len();
                s.history.push(Landed {
                    msg: k as u8,
                    request_id: request_id.clone(),
                    status: TurnStatus::Running,
                    ended_at: None,
                });
                s.recipients[r].session = Session::Ours(index as u8);
                let echoed = if how == Landing::Inexact {
                    s.left.inexact_receipts -= 1;
                    None
                } else {
                    Some(request_id)
                };
                WriteOutcome::Receipt {
                    turn: TurnId::new(format!("t{index}")),
                    request_id: echoed,
                }
            }
        };
        s.ghost.writes.push(log);
        Some(outcome)
    }

    /// The instants at which time alone changes something; `true` marks a sleep through a
    /// resend window.
    fn deadlines(&self, s: &State) -> Vec<(Millis, bool)> {
        let mut out = Vec::new();
        for d in s.store.iter().flatten() {
            if let Some(t) = d.next_deadline(&self.policy) {
                out.push((t, false));
            }
            if let Delivery::Failed(f) = d
                && matches!(f.resend(), model::states::ResendPlan::NotBefore { .. })
                && s.left.long_sleeps > 0
            {
                out.push((
                    f.core().since().plus_ms(self.policy.resend_window_ms + 1),
                    true,
                ));
            }
        }
        // The engine sleeps until the next reminder falls due at the latest (it wakes then
        // and runs its housekeeping): the clock never jumps past that instant.
        let mut wake = Millis(self.horizon_ms);
        for (k, m) in s.msgs.iter().enumerate() {
            // When a reminder falls due, and the instant just past SPEC's lag, when G7
            // judges whether open work was reminded in time.
            if let Some(t) =
                model::work::next_reminder_at(m.due_at, self.work_open(s, k), m.reminded_at)
            {
                out.push((t, false));
                out.push((t.plus_ms(REMINDER_LAG_MS + 1), false));
                if t > s.now {
                    wake = wake.min(t);
                }
            }
        }
        out.retain(|(t, _)| *t > s.now && *t <= wake);
        out.sort();
        out.dedup();
        out
    }

    /// Whether the engine reminds the sender of message `k` now.
    fn reminder_due(&self, s: &State, k: usize) -> bool {
        let m = &s.msgs[k];
        model::work::reminder_due(
            m.due_at,
            self.work_open(s, k),
            m.reminded_at,
            s.now,
            &self.policy,
        )
    }

    fn non_time_actions(&self, s: &State, actions: &mut Vec<Action>) {
        let n = self.messages.len();
        for k in 0..n {
            let k8 = k as u8;
            if !s.ghost.sent_ok[k] {
                // Messages are sent in order.
                if k == 0 || s.ghost.sent_ok[k - 1] {
                    actions.push(Action::Send(k8));
                }
                continue;
            }
            if s.uncommitted[k].is_some() {
                actions.push(Action::CommitEnrolment(k8));
            }
            if self.reminder_due(s, k) {
                actions.push(Action::Remind(k8));
            }
            let Some(record) = &s.store[k] else {
                continue;
            };
            let never_looked_at = self.plant == Some(WorldPlant::ScanNeverRescheduled)
                && record.kind() == StateKind::Uncertain;
            if !never_looked_at {
                actions.push(Action::Pass(k8));
            }
            if s.left.reads > 0 && !s.msgs[k].read {
                actions.push(Action::Read(k8));
            }
            if s.left.work_done > 0
                && !s.msgs[k].work_done
                && self.messages[k].kind == MessageKind::Work
            {
                actions.push(Action::WorkDone(k8));
            }
            if s.left.releases > 0 {
                actions.push(Action::Release(k8));
            }
            if s.left.body_changes > 0 && !s.msgs[k].body_changed {
                actions.push(Action::BodyChanges(k8));
            }
        }
        for f in &s.inflight {
            match &f.phase {
                Phase::Reserved => actions.push(Action::Boundary(f.msg)),
                Phase::Issued => {
                    actions.push(Action::Land(f.msg, Landing::Lands));
                    if s.left.refusals > 0 {
                        actions.push(Action::Land(f.msg, Landing::Refused));
                    }
                    if s.left.lost_writes > 0 {
                        actions.push(Action::Land(f.msg, Landing::Lost));
                    }
                    if s.left.inexact_receipts > 0 {
                        actions.push(Action::Land(f.msg, Landing::Inexact));
                    }
                }
                Phase::Awaiting(Some(_)) => {
                    actions.push(Action::Reply(f.msg));
                    if s.left.lost_replies > 0 {
                        actions.push(Action::LoseReply(f.msg));
                    }
                }
                Phase::Awaiting(None) => actions.push(Action::WriteTimesOut(f.msg)),
                Phase::Uncommitted(_) => actions.push(Action::CommitLate(f.msg)),
            }
        }
        let memory = !s.inflight.is_empty() || s.uncommitted.iter().any(Option::is_some);
        if s.left.crashes > 0 && memory {
            actions.push(Action::Crash);
        }
        for (r, rcpt) in s.recipients.iter().enumerate() {
            let r8 = r as u8;
            match rcpt.session {
                Session::Ours(_) => {
                    actions.push(Action::TurnEnds(r8, None));
                    if s.left.errored_turns > 0 {
                        actions.push(Action::TurnEnds(r8, Some(TurnFailure::Errored)));
                    }
                    if s.left.interrupted_turns > 0 {
                        actions.push(Action::TurnEnds(r8, Some(TurnFailure::Interrupted)));
                    }
                }
                Session::Foreign | Session::Taken => actions.push(Action::ForeignTurnEnds(r8)),
                Session::Idle => {
                    // The re-check at the send boundary and the write reach the app together
                    // (each adapter checks the session as it writes), so a person's turn
                    // cannot slip in between them.
                    let writing = s
                        .inflight
                        .iter()
                        .any(|f| f.phase == Phase::Issued && self.to(f.msg as usize) == r);
                    if s.left.foreign_turns > 0 && !writing {
                        actions.push(Action::ForeignTurnStarts(r8));
                    }
                    if s.left.races_at_write > 0 && writing {
                        actions.push(Action::TakenAtWrite(r8));
                    }
                }
            }
            if rcpt.down {
                actions.push(Action::AgentUp(r8));
            } else if s.left.agent_downs > 0 {
                actions.push(Action::AgentDown(r8));
            }
            if s.left.endpoint_changes > 0 {
                actions.push(Action::EndpointChanges(r8));
            }
        }
        if s.outage {
            actions.push(Action::OutageEnds);
        } else if s.left.outages > 0 {
            actions.push(Action::OutageStarts);
        }
        if s.paused || s.left.pauses > 0 {
            actions.push(Action::TogglePause);
        }
        if s.blocked || s.left.blocks > 0 {
            actions.push(Action::ToggleBlock);
        }
    }
}

impl Model for World {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let n = self.messages.len();
        let recipient = Recipient {
            session: Session::Idle,
            dest: 0,
            down: false,
        };
        vec![State {
            now: Millis(0),
            store: vec![None; n],
            uncommitted: vec![None; n],
            inflight: Vec::new(),
            msgs: vec![MsgState::default(); n],
            recipients: vec![recipient; self.recipient_count()],
            history: Vec::new(),
            outage: false,
            paused: false,
            blocked: false,
            left: self.faults,
            ghost: Ghost {
                reservations: vec![0; n],
                queued_for: vec![None; n],
                sent_ok: vec![false; n],
                ..Ghost::default()
            },
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        self.non_time_actions(s, actions);
        if self.urgent {
            if actions
                .iter()
                .any(|a| self.next_state(s, a.clone()).is_some())
            {
                return;
            }
            actions.clear();
        }
        // A write in flight resolves (lands, is refused or lost) within the adapter's request
        // timeout, far below the sending timeout: time does not jump over it. Nor does it
        // jump over a reminder that is due: the engine wakes when one falls due.
        let writing = s.inflight.iter().any(|f| f.phase == Phase::Issued);
        let reminding = (0..s.msgs.len()).any(|k| self.reminder_due(s, k));
        if !writing && !reminding && (self.urgent || s.left.time_jumps > 0) {
            for (t, long) in self.deadlines(s) {
                actions.push(Action::Advance(t, long));
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Send(k) => {
                let k = k as usize;
                let msg = &self.messages[k];
                let r = msg.to;
                let dest = s.recipients[r as usize].dest;
                let core = Core::enrol(
                    MessageId::new(format!("m{k}")),
                    target(r, dest),
                    msg.kind,
                    body_hash(msg, k, false),
                    request_id(k, 0),
                    s.now,
                );
                let duplicate_of = msg.identical_to.filter(|&j| {
                    s.store[j]
                        .as_ref()
                        .is_some_and(|d| !d.is_settled() && d.kind() != StateKind::Failed)
                });
                s.ghost.queued_for[k] = Some((r, dest));
                s.ghost.sent_ok[k] = true;
                s.msgs[k].due_at = msg.due_ms.map(|ms| s.now.plus_ms(ms));
                let record =
                    model::enrol(core, duplicate_of.map(|j| MessageId::new(format!("m{j}"))));
                if self.plant == Some(WorldPlant::EnrolAfterCommit) {
                    // The bug: the sender is told "sent" before the delivery is committed.
                    s.uncommitted[k] = Some(record);
                } else {
                    // The message and its delivery commit in one transaction, then `send`
                    // answers.
                    s.store[k] = Some(record);
                }
            }
            Action::CommitEnrolment(k) => {
                let k = k as usize;
                s.store[k] = s.uncommitted[k].take();
            }
            Action::Pass(k) => self.pass(&mut s, k as usize),
            Action::Boundary(k) => {
                let slot = s.inflight.iter().position(|f| f.msg == k)?;
                self.boundary(&mut s, slot);
            }
            Action::Land(k, how) => {
                let slot = s.inflight.iter().position(|f| f.msg == k)?;
                let reply = self.land(&mut s, k as usize, how);
                s.inflight[slot].phase = Phase::Awaiting(reply);
            }
            Action::CommitLate(k) => {
                let slot = s.inflight.iter().position(|f| f.msg == k)?;
                let Phase::Uncommitted(outcome) = s.inflight[slot].phase.clone() else {
                    return None;
                };
                let k = k as usize;
                self.apply(
                    &mut s,
                    k,
                    EventKind::Reservation {
                        earlier_active: None,
                        permission: Permission::Allowed,
                    },
                );
                let r = self.to(k);
                let boundary = EventKind::SendBoundary {
                    permission: Permission::Allowed,
                    recipient: Some(target(r as u8, s.recipients[r].dest)),
                    activity: Activity::Idle,
                    work_open: true,
                };
                self.apply(&mut s, k, boundary);
                s.inflight[slot].phase = Phase::Awaiting(Some(outcome));
            }
            Action::Reply(k) => {
                let slot = s.inflight.iter().position(|f| f.msg == k)?;
                let Phase::Awaiting(Some(outcome)) = s.inflight.remove(slot).phase else {
                    return None;
                };
                self.apply(&mut s, k as usize, EventKind::WriteResult { outcome });
            }
            Action::LoseReply(k) => {
                s.left.lost_replies -= 1;
                let slot = s.inflight.iter().position(|f| f.msg == k)?;
                s.inflight[slot].phase = Phase::Awaiting(None);
            }
            Action::WriteTimesOut(k) => {
                let slot = s.inflight.iter().position(|f| f.msg == k)?;
                s.inflight.remove(slot);
                let outcome = WriteOutcome::TimedOut;
                self.apply(&mut s, k as usize, EventKind::WriteResult { outcome });
            }
            Action::Crash => {
                s.left.crashes -= 1;
                for f in std::mem::take(&mut s.inflight) {
                    s.ghost.crashed_mid_write.push(f.msg);
                }
                // Whatever was computed and not committed is gone with the process.
                for u in &mut s.uncommitted {
                    *u = None;
                }
            }
            Action::TurnEnds(r, failure) => {
                let r = r as usize;
                let Session::Ours(i) = s.recipients[r].session else {
                    return None;
                };
                s.history[i as usize].ended_at = Some(s.now);
                s.history[i as usize].status = match failure {
                    None => TurnStatus::Returned,
                    Some(f) => {
                        match f {
                            TurnFailure::Errored => s.left.errored_turns -= 1,
                            TurnFailure::Interrupted => s.left.interrupted_turns -= 1,
                        }
                        TurnStatus::Failed(f)
                    }
                };
                s.recipients[r].session = Session::Idle;
            }
            Action::ForeignTurnStarts(r) => {
                s.left.foreign_turns -= 1;
                s.recipients[r as usize].session = Session::Foreign;
            }
            Action::TakenAtWrite(r) => {
                s.left.races_at_write -= 1;
                s.recipients[r as usize].session = Session::Taken;
            }
            Action::ForeignTurnEnds(r) => s.recipients[r as usize].session = Session::Idle,
            Action::OutageStarts => {
                s.left.outages -= 1;
                s.outage = true;
            }
            Action::OutageEnds => s.outage = false,
            Action::AgentDown(r) => {
                s.left.agent_downs -= 1;
                s.recipients[r as usize].down = true;
            }
            Action::AgentUp(r) => s.recipients[r as usize].down = false,
            Action::Read(k) => {
                s.left.reads -= 1;
                s.msgs[k as usize].read = true;
            }
            Action::WorkDone(k) => {
                s.left.work_done -= 1;
                let m = &mut s.msgs[k as usize];
                m.work_done = true;
                if m.due_at.is_some() {
                    m.returned_at = Some(s.now);
                }
            }
            Action::Remind(k) => {
                // One transaction: the notification to the sender (never a delivery: nothing
                // is enrolled for it) and the work row's `reminded_at`.
                let k = k as usize;
                let work_open = self.work_open(&s, k);
                s.msgs[k].reminded_at = Some(s.now);
                s.ghost.reminders.push(ReminderLog {
                    msg: k as u8,
                    at: s.now,
                    work_open,
                });
            }
            Action::Release(k) => {
                s.left.releases -= 1;
                self.apply(&mut s, k as usize, EventKind::Release { note: None });
            }
            Action::TogglePause => {
                if !s.paused {
                    s.left.pauses -= 1;
                }
                s.paused = !s.paused;
            }
            Action::ToggleBlock => {
                if !s.blocked {
                    s.left.blocks -= 1;
                }
                s.blocked = !s.blocked;
            }
            Action::EndpointChanges(r) => {
                s.left.endpoint_changes -= 1;
                s.recipients[r as usize].dest ^= 1;
            }
            Action::BodyChanges(k) => {
                s.left.body_changes -= 1;
                s.msgs[k as usize].body_changed = true;
            }
            Action::Advance(t, long) => {
                if long {
                    s.left.long_sleeps -= 1;
                }
                if !self.urgent {
                    s.left.time_jumps -= 1;
                }
                s.now = t;
            }
        }
        (s != *last).then_some(s)
    }

    fn properties(&self) -> Vec<stateright::Property<Self>> {
        (self.properties)()
    }

    fn within_boundary(&self, s: &State) -> bool {
        s.now.0 <= self.horizon_ms
    }
}
