//! What the engine asks of the store, as named transactions: its queue (what is due, when to
//! look again), a pass's facts read inside a step's own transaction ([`StepReads`]),
//! housekeeping (enrolment and reminders), its report, and the durability of its lazy
//! connection. The engine composes no store query of its own: each operation here is one
//! transaction (or one read inside the step's), so a second storage backend implements these
//! and the store's queries, not the engine.

use super::{Result, Service, ServiceError};
use crate::store::{AgentRow, MessageRow, StoreError, Tx, WorkRow, millis};
use model::{Delivery, EventKind, Millis, PassFacts, Policy};
use serde_json::Value;

/// The reads a step's transaction offers whoever builds its events (the engine): each named,
/// each inside the transaction that commits the step, so the facts a step decides on are the
/// ones it commits with.
pub struct StepReads<'a, 'c> {
    tx: &'a Tx<'c>,
}

impl std::fmt::Debug for StepReads<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepReads").finish_non_exhaustive()
    }
}

impl<'a, 'c> StepReads<'a, 'c> {
    pub(super) fn new(tx: &'a Tx<'c>) -> Self {
        StepReads { tx }
    }

    /// The facts of a reservation of `id`'s write: another delivery active to its recipient,
    /// and whether the sender may still send to it.
    pub fn reservation(&self, id: &str) -> Result<EventKind> {
        let m = self.message(id)?;
        Ok(EventKind::Reservation {
            earlier_active: self
                .tx
                .active_for(&m.recipient, id)?
                .map(model::MessageId::new),
            permission: super::permission(self.tx, &m.sender, &m.recipient)?,
        })
    }

    /// The facts a pass over `id` decides on (SPEC §5): the body's hash, whether the
    /// recipient read it, whether its work is open, the permission, where the recipient is
    /// registered now, and a fresh request id for a write this pass may make.
    pub fn facts(&self, id: &str, one_shot: bool) -> Result<PassFacts> {
        let m = self.message(id)?;
        let recipient = self
            .tx
            .agent(&m.recipient)?
            .as_ref()
            .and_then(super::target_of);
        Ok(PassFacts {
            body_hash: m.body_hash.clone(),
            read_by_recipient: m.read_at.is_some(),
            work_open: super::work_open(self.tx, &m)?,
            permission: super::permission(self.tx, &m.sender, &m.recipient)?,
            recipient,
            one_shot,
            outage: None,
            fresh_request_id: model::RequestId::new(crate::clock::new_id()),
        })
    }

    /// The agent `id` as registered now.
    pub fn agent(&self, id: &str) -> Result<Option<AgentRow>> {
        Ok(self.tx.agent(id)?)
    }

    /// Whether `id` belongs to a chain whose rules forbid writes (cancelled or stopped) and
    /// waits (neither settled nor active): such a delivery is cancelled at its next pass.
    pub fn waits_in_a_closed_chain(&self, id: &str, policy: &Policy) -> Result<bool> {
        Ok(self
            .tx
            .chain_of_message(id)?
            .is_some_and(|c| !c.rules().may_write(policy))
            && self
                .tx
                .delivery(id)?
                .is_some_and(|d| !d.record.is_settled() && !d.record.is_active()))
    }

    fn message(&self, id: &str) -> Result<MessageRow> {
        self.tx
            .message(id)?
            .ok_or_else(|| ServiceError::NotFound(format!("message {id} is gone")))
    }
}

impl Service {
    /// From now on this service's commits are not synced as they are made: the engine's
    /// connection, which syncs before every effect instead ([`Service::sync_upto`]).
    pub fn commit_lazily(&mut self) -> std::result::Result<(), StoreError> {
        self.store.commit_lazily()
    }

    /// Whether the database is PostgreSQL (no file beside which to keep or watch anything).
    pub fn is_postgres(&self) -> bool {
        self.store.is_postgres()
    }

    /// Takes the engine lock of the database ([`Store::take_engine_lock`]): `false` when
    /// another engine holds it.
    pub fn take_engine_lock(&mut self) -> std::result::Result<bool, StoreError> {
        self.store.take_engine_lock()
    }

    /// Batches this service's write steps into one open transaction (`on`), or commits what
    /// is batched and stops (`off`): the engine, while it runs ([`Store::batch_steps`]).
    pub fn batch_steps(&mut self, on: bool) -> std::result::Result<(), StoreError> {
        self.store.batch_steps(on)
    }

    /// Ends batching, rolling back what is not committed ([`Store::abandon_batch`]).
    pub fn abandon_batch(&mut self) {
        self.store.abandon_batch();
    }

    /// Commits the steps batched so far ([`Store::flush`]): before the engine waits.
    pub fn flush_steps(&mut self) -> std::result::Result<(), StoreError> {
        self.store.flush()
    }

    /// A mark of the commits made so far, to hand to [`Service::sync_upto`].
    pub fn changes_so_far(&self) -> u64 {
        self.store.changes_so_far()
    }

    /// Makes every commit up to `mark` durable (group commit: one sync covers every commit
    /// made before it). Returns whether it synced.
    pub fn sync_upto(&mut self, mark: u64) -> std::result::Result<bool, StoreError> {
        self.store.sync_upto(mark)
    }

    /// [`Service::sync_upto`] as a call to make on another thread; `None` when nothing is
    /// left to sync.
    pub fn sync_elsewhere(
        &mut self,
        mark: u64,
    ) -> std::result::Result<
        Option<impl FnOnce() -> std::result::Result<(), StoreError> + Send + 'static + use<>>,
        StoreError,
    > {
        self.store.sync_elsewhere(mark)
    }

    /// Keeps the engine's last report (the page and `status` read it).
    pub fn save_engine_report(&mut self, at: i64, report: &Value) -> Result<()> {
        Ok(self.store.write(|tx| tx.save_report(at, report))?)
    }

    /// When the soonest reminder of open work, or deadline of a fan-out, falls due, if any.
    pub fn next_reminder_at(&mut self) -> Result<Option<Millis>> {
        let at = self.store.read(|tx: &Tx<'_>| {
            let work = tx.next_reminder_at()?;
            let fanout = tx.next_fanout_deadline()?;
            Ok::<_, ServiceError>(work.into_iter().chain(fanout).min())
        })?;
        Ok(at.and_then(|t| u64::try_from(t).ok()).map(Millis))
    }

    /// Deliveries due at `now` with their recipients: at most `heads` from the head of each
    /// recipient's queue, `limit` in all, active ones first, then the oldest.
    pub fn due(&mut self, now: Millis, heads: i64, limit: i64) -> Result<Vec<(String, String)>> {
        let (engine, host) = self.asker();
        Ok(self
            .store
            .read(|tx| tx.due(millis(now), heads, limit, (&engine, &host)))?)
    }

    /// Deliveries of `recipient` due at `now`, at most `heads` from its queue's head.
    pub fn due_for(&mut self, recipient: &str, now: Millis, heads: i64) -> Result<Vec<String>> {
        Ok(self
            .store
            .read(|tx| tx.due_for(recipient, millis(now), heads))?)
    }

    /// When the next delivery among the queues' heads falls due, if any.
    pub fn next_due(&mut self, heads: i64) -> Result<Option<i64>> {
        let (engine, host) = self.asker();
        let now = millis(self.now());
        Ok(self
            .store
            .read_one_statement(|tx| tx.next_due(heads, now, (&engine, &host)))?)
    }

    /// Looks at delivery `id` again at `at` (never, with `None`).
    pub fn set_due(&mut self, id: &str, at: Option<i64>) -> Result<()> {
        Ok(self.store.write(|tx| tx.set_due(id, at))?)
    }

    /// The end of a pass that recorded nothing: if `id` is still due at `now`, it is looked
    /// at again when `after` says (from its record and its recipient as registered), in one
    /// transaction, so a commit meanwhile (a wake) is never overwritten.
    pub fn rest(
        &mut self,
        id: &str,
        now: Millis,
        after: impl FnOnce(&Delivery, Option<&AgentRow>) -> Option<i64>,
    ) -> Result<()> {
        let now = millis(now);
        self.store.write(|tx| {
            let Some(row) = tx.delivery(id)? else {
                return Ok(());
            };
            if row.due_at.is_some_and(|d| d <= now) {
                let agent = tx.agent(&row.recipient)?;
                tx.set_due(id, after(&row.record, agent.as_ref()))?;
            }
            Ok::<_, ServiceError>(())
        })
    }

    /// A configuration value as stored (`Null` when unset).
    pub fn config_value(&mut self, key: &str) -> Result<Value> {
        Ok(self.store.read(|tx| tx.config(key))?.unwrap_or(Value::Null))
    }

    /// The facts of a reservation of `id`'s write, read on their own (outside a step).
    pub fn reservation_facts(&mut self, id: &str) -> Result<EventKind> {
        self.store.read(|tx| StepReads::new(tx).reservation(id))
    }

    /// The facts of a pass over `id`, read on their own (outside a step).
    pub fn pass_facts(&mut self, id: &str, one_shot: bool) -> Result<PassFacts> {
        self.store.read(|tx| StepReads::new(tx).facts(id, one_shot))
    }

    /// Message `id` with its work, if it has any: what a card is made of.
    pub fn message_and_work(&mut self, id: &str) -> Result<(MessageRow, Option<WorkRow>)> {
        self.store.read(|tx| {
            let m = tx
                .message(id)?
                .ok_or_else(|| ServiceError::NotFound(format!("message {id} is gone")))?;
            let w = match m.work_id.as_deref() {
                Some(w) => tx.work(w)?,
                None => None,
            };
            Ok((m, w))
        })
    }

    /// Enrols handoffs that have no delivery yet, and sends each overdue piece of work's one
    /// reminder (SPEC §2.5: a non-waking notification, exactly once). Returns how many were
    /// enrolled and reminded. A reminder is a message someone may read at once, so when
    /// `reminders_may_be_due` (where the last housekeeping said one would fall due) the
    /// transaction is synced before it commits even on a lazy connection: a power cut must
    /// not take it back and have the next engine send another (G7).
    pub fn housekeeping(
        &mut self,
        policy: &Policy,
        reminders_may_be_due: bool,
    ) -> Result<(usize, usize)> {
        let now = self.now();
        let work = |tx: &Tx<'_>| {
            let after = super::enabled_after(tx)?;
            let mut enrolled = 0;
            for m in tx.unenrolled(after, 1_000)? {
                if super::enrol(tx, &m, now)?.is_some() {
                    enrolled += 1;
                }
            }
            let reminders = remind(tx, policy, now)?;
            // A fan-out's deadline is among the times `next_reminder_at` names.
            let joined = super::fanout::join_past_deadline(tx, policy, now)?;
            if joined > 0 {
                tracing::info!(joined, "fan-outs joined partial at their deadline");
            }
            Ok::<_, ServiceError>((enrolled, reminders))
        };
        if reminders_may_be_due {
            self.store.write_synced(work)
        } else {
            self.store.write(work)
        }
    }
}

/// Sends the reminder of every piece of open work past its due time that has none yet: the
/// store finds the candidates; the rule of SPEC §2.5 (`model::work`) decides.
fn remind(tx: &Tx<'_>, policy: &Policy, now: Millis) -> Result<usize> {
    let at = |ms: i64| Millis(u64::try_from(ms).unwrap_or(0));
    let overdue = tx.overdue_unreminded(millis(now))?.into_iter().filter(|w| {
        model::work::reminder_due(
            w.due_at.map(at),
            w.state.is_open(),
            w.reminded_at.map(at),
            at(millis(now)),
            policy,
        )
    });
    let mut reminders = 0;
    for mut w in overdue {
        let body = format!(
            "Reminder: the work \"{}\" you gave to {} is past its due time and has not been returned.",
            w.title, w.recipient
        );
        let of = tx.message(&w.id)?;
        let m = super::work_message(
            &w,
            of.as_ref(),
            (&w.recipient, &w.sender),
            body,
            ("notification", "reminder"),
            format!("overdue: {}", w.title),
            now,
        );
        tx.insert_message(&m)?;
        w.reminded_at = Some(millis(now));
        tx.update_work(&w)?;
        tx.event(
            millis(now),
            Some(&w.id),
            "reminder",
            &format!("overdue; {} reminded", w.sender),
        )?;
        reminders += 1;
    }
    Ok(reminders)
}
