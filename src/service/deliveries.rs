//! The one commit path of a delivery step: the engine's every event and a person's release
//! both load the stored record, `step` it and record what changed in the same transaction
//! (SPEC §5: commit before effect).

use super::{Result, Service, ServiceError, StepReads};
use crate::store::{AgentRow, QUEUE_HEADS, Tx, millis};
use model::{Change, Delivery, Effect, Event, EventKind, Millis, Policy};

/// What one committed step left: the record, the effects it asks for, the recipient as
/// registered now, and what changed.
#[derive(Debug)]
pub struct Committed {
    pub record: Delivery,
    pub effects: Vec<Effect>,
    pub agent: Option<AgentRow>,
    pub change: Change,
}

/// When to look at a delivery again once a step has changed it (the engine's schedule; a
/// release needs none).
pub type Schedule<'a> = &'a dyn Fn(&Change, &Delivery, Option<&AgentRow>, Millis) -> Option<i64>;

/// Answers an effect inside the step's own transaction when that needs nothing from outside
/// the database (a reservation's look for another active delivery, the activity of a
/// recipient whose adapter has no activity source): the event it leads to, or `None` to stop
/// there and hand the effect back. Asked with no effect once the steps ask for nothing more:
/// an event then starts what the next pass would start at once (the engine's look at a write
/// just accepted, when its outcome is known without asking), and `None` ends the transaction.
pub type Follow<'a> =
    &'a mut dyn FnMut(&StepReads<'_, '_>, &Delivery, Option<&Effect>) -> Result<Option<EventKind>>;

impl Service {
    /// Applies one event to the stored delivery `id` in one transaction: the record as
    /// stored now (a person may have released it meanwhile, or the engine moved it), `step`
    /// under `policy`, the new record with when to look again, and its history line. An
    /// ignored or unchanged step records nothing.
    pub fn commit_step(
        &mut self,
        id: &str,
        policy: &Policy,
        event: impl FnOnce(&StepReads<'_, '_>) -> Result<EventKind>,
        schedule: Schedule<'_>,
    ) -> Result<Committed> {
        self.commit_steps(
            id,
            policy,
            |tx| Ok(vec![event(tx)?]),
            &mut |_, _, _| Ok(None),
            schedule,
        )
    }

    /// Applies `events` one after another to the stored delivery `id`, then every effect
    /// `follow` can answer inside the same transaction, and commits the result once: the
    /// record as stored now, each `step` under `policy`, the last record with when to look
    /// again, and a history line for each move. What the steps ask for and `follow` cannot
    /// answer is handed back in order. Nothing is recorded when no step changed anything.
    pub fn commit_steps(
        &mut self,
        id: &str,
        policy: &Policy,
        events: impl FnOnce(&StepReads<'_, '_>) -> Result<Vec<EventKind>>,
        follow: Follow<'_>,
        schedule: Schedule<'_>,
    ) -> Result<Committed> {
        let now = self.now();
        let started = std::time::Instant::now();
        let fencing = self.fencing.as_ref();
        let (committed, by_person, moves) = self
            .store
            .write(|tx| steps_in(tx, id, policy, events, follow, schedule, now, fencing))?;
        // The step's transaction extended the engine's lease on the recipient.
        if let Some(f) = self.fencing.as_mut() {
            f.extended(
                committed.record.core().target().agent.as_str(),
                now,
                started,
            );
        }
        Self::log_moves(id, &committed, by_person, moves);
        Ok(committed)
    }

    /// Records that this engine, fenced right before its write of delivery `id` (the
    /// recipient's lease had passed to another engine, or could not be read), wrote nothing:
    /// the step `WriteOutcome::Withheld`, in a transaction that needs no lease (this engine
    /// may hold none now). It applies only to the very reservation the engine made, named by
    /// its request id and attempt (one reservation each: the attempt grows with every one, a
    /// resend takes a fresh request id), its write issued and still SENDING (`step` backs out
    /// nothing else: once UNCERTAIN it stays so, nothing is resent from there). `None` when
    /// the delivery moved on meanwhile; nothing is recorded then.
    pub fn commit_withheld(
        &mut self,
        id: &str,
        policy: &Policy,
        (request_id, attempt): (&model::RequestId, u32),
        detail: String,
        schedule: Schedule<'_>,
    ) -> Result<Option<Committed>> {
        let now = self.now();
        let done = self.store.write(|tx| {
            let mine = tx.delivery(id)?.is_some_and(|row| {
                matches!(&row.record, Delivery::Sending(s) if s.write_issued()
                    && s.core().request_id() == request_id
                    && s.core().attempts() == attempt)
            });
            if !mine {
                return Ok(None);
            }
            let outcome = model::WriteOutcome::Withheld { detail };
            let events = |_: &StepReads<'_, '_>| Ok(vec![EventKind::WriteResult { outcome }]);
            steps_in(
                tx,
                id,
                policy,
                events,
                &mut |_, _, _| Ok(None),
                schedule,
                now,
                None,
            )
            .map(Some)
        })?;
        let Some((committed, by_person, moves)) = done else {
            return Ok(None);
        };
        Self::log_moves(id, &committed, by_person, moves);
        Ok(matches!(committed.change, Change::Moved { .. }).then_some(committed))
    }

    /// Says what a committed step did, once it is committed: a step rolled back never shows
    /// as a move.
    fn log_moves(
        id: &str,
        committed: &Committed,
        by_person: bool,
        moves: Vec<(model::StateKind, model::StateKind, String)>,
    ) {
        if by_person {
            tracing::info!(
                delivery = id,
                detail = %committed.record.detail(),
                "released by a person"
            );
        } else {
            for (from, to, detail) in moves {
                tracing::info!(
                    delivery = id,
                    recipient = %committed.record.core().target().agent,
                    %from,
                    %to,
                    %detail,
                    "delivery moved"
                );
            }
        }
    }
}

/// What several steps in one transaction changed, taken together: the first state left and
/// the last one reached when any moved, else an update if any updated, else the last.
fn merge(before: Option<Change>, next: Change) -> Change {
    match (before, next) {
        (Some(Change::Moved { from, .. }), Change::Moved { to, .. }) => Change::Moved { from, to },
        (Some(moved @ Change::Moved { .. }), _) | (_, moved @ Change::Moved { .. }) => moved,
        (Some(Change::Updated), _) | (_, Change::Updated) => Change::Updated,
        (_, next) => next,
    }
}

/// The body of [`Service::commit_steps`] inside a transaction the caller holds (a chain's
/// cancel steps each of its deliveries in one): what was committed, whether a person's
/// release was among the steps, and the moves to log once the caller's transaction commits.
///
/// With `fencing` (an engine's step), the step commits only while the engine still holds the
/// recipient's lease with the token it took, checked in this transaction; a reservation
/// records that token.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub(super) fn steps_in(
    tx: &Tx<'_>,
    id: &str,
    policy: &Policy,
    events: impl FnOnce(&StepReads<'_, '_>) -> Result<Vec<EventKind>>,
    follow: Follow<'_>,
    schedule: Schedule<'_>,
    now: Millis,
    fencing: Option<&super::leases::Fencing>,
) -> Result<(
    Committed,
    bool,
    Vec<(model::StateKind, model::StateKind, String)>,
)> {
    let reads = StepReads::new(tx);
    let mut by_person = false;
    let mut moves = Vec::new();
    let row = tx
        .delivery(id)?
        .ok_or_else(|| ServiceError::NotFound(format!("no delivery {id}")))?;
    let fence = match fencing {
        Some(f) if !crate::planted(crate::Plant::NoStepFence) => {
            let fence = f.fence_of(&row.recipient);
            let until = millis(now.plus_ms(f.lease_ms));
            match fence {
                Some(t) if tx.hold_lease(&row.recipient, &f.engine, t, until)? => fence,
                _ => return Err(Service::fenced(&row.recipient, &f.engine)),
            }
        }
        Some(f) => f.fence_of(&row.recipient),
        None => None,
    };
    let mut record = row.record.clone();
    let mut effects = std::collections::VecDeque::new();
    let mut change: Option<Change> = None;
    let mut lines: Vec<(&str, String)> = Vec::new();
    let mut pending: std::collections::VecDeque<EventKind> = events(&reads)?.into();
    loop {
        let kind = match pending.pop_front() {
            Some(kind) => kind,
            None => match effects.front() {
                Some(effect) => match follow(&reads, &record, Some(effect))? {
                    Some(kind) => {
                        effects.pop_front();
                        kind
                    }
                    None => break,
                },
                None => match follow(&reads, &record, None)? {
                    Some(kind) => kind,
                    None => break,
                },
            },
        };
        by_person |= matches!(kind, EventKind::Release { .. });
        let note_before = record.core().note().map(str::to_owned);
        let step = model::step(record, Event::new(now, kind), policy);
        effects.extend(step.effects);
        record = step.record;
        change = Some(merge(change, step.change.clone()));
        if let Change::Moved { from, to } = step.change {
            moves.push((from, to, record.detail()));
        }
        if by_person {
            if matches!(step.change, Change::Moved { .. } | Change::Updated) {
                lines.push(("release", record.detail()));
            }
        } else if let Change::Moved { from, to } = step.change {
            lines.push(("state", format!("{from} → {to}: {}", record.detail())));
        } else if step.change == Change::Updated
            && record.core().note() != note_before.as_deref()
            && record.core().note().is_some()
        {
            lines.push(("note", record.detail()));
        }
    }
    let change = change.unwrap_or(Change::Unchanged);
    let agent = tx.agent(&row.recipient)?;
    if matches!(change, Change::Ignored { .. } | Change::Unchanged) {
        moves.clear();
        let committed = Committed {
            record,
            effects: effects.into(),
            agent,
            change,
        };
        return Ok((committed, by_person, moves));
    }
    // The recipient's queue moves up when, all steps taken together, this delivery
    // stopped holding the recipient or left the queue for good (a reservation that
    // timed out within the same transaction frees nothing).
    let (was, is) = (row.record.kind().class(), record.kind().class());
    // A write turned away busy frees nobody: the recipient's session is busy, and waking its
    // queue would write at it again at once instead of on the backoff.
    let turned_away = matches!(
        &record,
        Delivery::Busy(b) if matches!(b.reason(), model::states::BusyReason::AtTheWrite { .. })
    );
    let freed = !record.is_active()
        && !turned_away
        && (was == model::Class::Active
            || (is == model::Class::Terminal && was != model::Class::Terminal));
    let due = schedule(&change, &record, agent.as_ref(), now);
    tx.save_delivery(id, &record, due, millis(now))?;
    if let Some(fence) = fence
        && matches!(
            change,
            Change::Moved {
                to: model::StateKind::Sending,
                ..
            }
        )
    {
        tx.set_delivery_fence(id, fence)?;
    }
    super::dead::on_step(tx, id, (&row.record, &record), policy, millis(now))?;
    for (kind, text) in &lines {
        tx.event(millis(now), Some(id), kind, text)?;
    }
    if freed || by_person {
        tx.wake_queue(&row.recipient, millis(now), QUEUE_HEADS)?;
    }
    let committed = Committed {
        record,
        effects: effects.into(),
        agent,
        change,
    };
    Ok((committed, by_person, moves))
}

impl Service {
    /// Deliveries now in one of `states`, at most `limit`.
    pub fn deliveries_in(
        &mut self,
        states: &[model::StateKind],
        limit: i64,
    ) -> Result<Vec<super::DeliveryRow>> {
        Ok(self.store.read(|tx| tx.deliveries_in(states, limit))?)
    }

    /// The state of the delivery of message `id` (exact id), if it has one.
    pub fn delivery_state(&mut self, id: &str) -> Result<Option<model::StateKind>> {
        Ok(self
            .store
            .read(|tx| tx.delivery(id))?
            .map(|d| d.record.kind()))
    }
}
