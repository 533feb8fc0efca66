//! Dead letters (SPEC §8.2): what cannot be delivered is kept with its reason (an unknown or
//! removed recipient, a connection not allowed, FAILED with its resends spent, UNAVAILABLE
//! after a destination change, a stopped chain), until a person replays it as a new message
//! (new id, same chain, linked to the dead one; never a resend of its request id) or drops
//! it.

use super::chains::Lineage;
use super::messages::{Draft, Sent, send_in};
use super::{DeadLetterRow, MessageRow, Result, Service, ServiceError, Tx, millis, refused, usage};
use model::Delivery;
use serde::Serialize;

/// Why something could not be delivered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The recipient is not registered (never was, or was removed).
    UnknownRecipient,
    /// The connection sender → recipient is not allowed.
    Topology,
    /// FAILED, with its resends spent or not allowed.
    Failed,
    /// UNAVAILABLE: the recipient is registered somewhere else than it was sent to.
    DestinationChanged,
    /// Its chain's budget or depth limit stopped it, or its chain was cancelled.
    ChainStopped,
}

impl Reason {
    pub const ALL: [Reason; 5] = [
        Reason::UnknownRecipient,
        Reason::Topology,
        Reason::Failed,
        Reason::DestinationChanged,
        Reason::ChainStopped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::UnknownRecipient => "unknown_recipient",
            Reason::Topology => "topology",
            Reason::Failed => "failed",
            Reason::DestinationChanged => "destination_changed",
            Reason::ChainStopped => "chain_stopped",
        }
    }
}

/// Keeps a send refused before anything was stored.
pub(super) fn refused_send(
    tx: &Tx<'_>,
    d: &Draft<'_>,
    parent: Option<&MessageRow>,
    reason: Reason,
    why: &str,
    now: i64,
) -> Result<()> {
    let chain = parent.map(|p| {
        if p.chain_id.is_empty() {
            p.id.clone()
        } else {
            p.chain_id.clone()
        }
    });
    if tx.open_refused_letter(d.from, d.to, d.body, chain.as_deref())? {
        return Ok(());
    }
    tx.put_dead_letter(&DeadLetterRow {
        id: crate::clock::new_id(),
        message_id: None,
        sender: d.from.to_owned(),
        recipient: d.to.to_owned(),
        body: d.body.to_owned(),
        title: d.title.map(str::to_owned),
        reason: reason.as_str().to_owned(),
        detail: why.to_owned(),
        chain_id: chain,
        parent_id: parent.map(|p| p.id.clone()),
        created_at: now,
        replayed_as: None,
        replayed_at: None,
        dropped_at: None,
    })?;
    Ok(())
}

/// Why a delivery in this state is dead, if it is (`model::dead`).
fn dead_reason(d: &Delivery, policy: &model::Policy) -> Option<Reason> {
    model::dead::reason(d, policy).map(|r| match r {
        model::dead::DeadReason::Failed => Reason::Failed,
        model::dead::DeadReason::UnknownRecipient => Reason::UnknownRecipient,
        model::dead::DeadReason::DestinationChanged => Reason::DestinationChanged,
    })
}

/// After a step of message `id`'s delivery from `before` to `after`: keeps it as a dead letter
/// when it just became undeliverable, takes the letter back when it recovered (a person's
/// release keeps it: still replayable). Costs nothing when neither record is dead.
pub(super) fn on_step(
    tx: &Tx<'_>,
    id: &str,
    (before, after): (&Delivery, &Delivery),
    policy: &model::Policy,
    now: i64,
) -> Result<()> {
    let (was, is) = (dead_reason(before, policy), dead_reason(after, policy));
    if was == is {
        return Ok(());
    }
    let Some(reason) = is else {
        if after.kind() != model::StateKind::Cancelled {
            tx.revive_dead_letter(id)?;
        }
        return Ok(());
    };
    let Some(m) = tx.message(id)? else {
        return Ok(());
    };
    tx.put_dead_letter(&DeadLetterRow {
        id: crate::clock::new_id(),
        message_id: Some(m.id.clone()),
        sender: m.sender,
        recipient: m.recipient,
        body: m.body,
        title: m.title,
        reason: reason.as_str().to_owned(),
        detail: after.detail(),
        chain_id: Some(m.chain_id).filter(|c| !c.is_empty()),
        parent_id: m.parent_id,
        created_at: now,
        replayed_as: None,
        replayed_at: None,
        dropped_at: None,
    })?;
    Ok(())
}

/// What a replay did.
#[derive(Clone, Debug, Serialize)]
pub struct Replayed {
    pub dead_letter: DeadLetterRow,
    pub sent: Sent,
}

impl Service {
    fn dead_id(tx: &Tx<'_>, given: &str) -> Result<String> {
        if given.is_empty() || given.len() > super::ID_CHARS_MAX {
            return usage("an id must be 1 to 200 characters");
        }
        match tx.dead_letter_ids(given)?.as_slice() {
            [one] if one == given || given.len() >= super::ID_PREFIX_MIN => Ok(one.clone()),
            [] => Err(ServiceError::NotFound(format!("no dead letter {given:?}"))),
            [_] => usage(format!(
                "{given:?} is too short: give the full id or at least {} characters",
                super::ID_PREFIX_MIN
            )),
            _ => usage(format!("{given:?} names more than one dead letter")),
        }
    }

    /// The newest dead letters (open ones only unless `all`).
    pub fn dead_list(&mut self, all: bool, limit: i64) -> Result<Vec<DeadLetterRow>> {
        if !(1..=super::LIST_LIMIT_MAX).contains(&limit) {
            return usage("the limit must be 1 to 10000");
        }
        self.store.read(|tx| Ok(tx.dead_letters(all, limit)?))
    }

    pub fn dead_show(&mut self, given: &str) -> Result<DeadLetterRow> {
        self.store.read(|tx| {
            let id = Self::dead_id(tx, given)?;
            tx.dead_letter(&id)?
                .ok_or_else(|| ServiceError::NotFound(format!("no dead letter {given:?}")))
        })
    }

    /// Replays a dead letter once, as a new message from its sender (to `to`, or to its
    /// recipient), in its chain and linked to it; a delivery of it that still waits is
    /// cancelled in the same transaction, so only the new message can land.
    pub fn dead_replay(&mut self, given: &str, to: Option<&str>) -> Result<Replayed> {
        if let Some(t) = to {
            super::check_agent_id(t)?;
        }
        let now = self.now();
        let policy = self.policy.clone();
        // A refused replay rolls back (the letter stays, its delivery is left as it was); what
        // refused it is kept for a second look below.
        let mut refused_as: Option<(String, String, Lineage)> = None;
        let out = self.store.write(|tx| {
            let id = Self::dead_id(tx, given)?;
            let mut dead = tx
                .dead_letter(&id)?
                .ok_or_else(|| ServiceError::NotFound(format!("no dead letter {given:?}")))?;
            if let Some(m) = &dead.replayed_as {
                return refused(format!("dead letter {id} was already replayed as {m}"));
            }
            if dead.dropped_at.is_some() {
                return refused(format!("dead letter {id} was dropped"));
            }
            if let Some(m) = &dead.message_id
                && tx
                    .delivery(m)?
                    .is_some_and(|d| !d.record.is_settled() && !d.record.is_active())
            {
                let release = model::EventKind::Release {
                    note: Some(format!("replayed as a new message (dead letter {id})")),
                };
                super::deliveries::steps_in(
                    tx,
                    m,
                    &model::Policy::default(),
                    |_| Ok(vec![release]),
                    &mut |_, _, _| Ok(None),
                    &|_, _, _, _| None,
                    now,
                    None,
                )?;
            }
            let lineage = Lineage {
                parent: dead.message_id.clone().or_else(|| dead.parent_id.clone()),
                request_id: None,
                in_turn: false,
                budget: None,
                session: None,
            };
            let draft = Draft {
                from: &dead.sender,
                to: to.unwrap_or(&dead.recipient),
                body: &dead.body,
                title: dead.title.as_deref(),
                due_minutes: None,
                key: None,
                lineage: &lineage,
                policy: &policy,
                beside: None,
            };
            // A replay that cannot be delivered either changes nothing: the letter stays.
            let sent = match send_in(tx, &draft, now, false)? {
                Ok(sent) => sent,
                Err(why) => {
                    refused_as =
                        Some((draft.from.to_owned(), draft.to.to_owned(), lineage.clone()));
                    return refused(format!("the replay was refused: {why}"));
                }
            };
            // A fan-out's child replayed: the fan-out waits for the replay instead.
            if let Some(old) = dead.message_id.as_deref() {
                super::fanout::on_replay(tx, old, &sent.message, millis(now))?;
            }
            if !tx.mark_dead_letter(&id, Some(&sent.message.id), millis(now))? {
                return refused(format!("dead letter {id} changed meanwhile; try again"));
            }
            tx.event(
                millis(now),
                Some(&sent.message.id),
                "replay",
                &format!("replay of dead letter {id} ({})", dead.reason),
            )?;
            dead.replayed_as = Some(sent.message.id.clone());
            dead.replayed_at = Some(millis(now));
            Ok(Replayed {
                dead_letter: dead,
                sent,
            })
        });
        // When the replay's chain refused it, the chain's stop and its origin's one
        // notification are committed on their own, as for any send that stops a chain (so a
        // resume can lift it); a placement that would pass changes nothing.
        if out.is_err()
            && let Some((from, to, lineage)) = refused_as
        {
            self.store
                .write(
                    |tx| match super::chains::place(tx, (&from, &to), &lineage, &policy, now)? {
                        Ok(_) => refused("the chain does not stop this replay"),
                        Err(_) => Ok(()),
                    },
                )
                .ok();
        }
        out
    }

    pub fn dead_drop(&mut self, given: &str) -> Result<DeadLetterRow> {
        let now = millis(self.now());
        self.store.write(|tx| {
            let id = Self::dead_id(tx, given)?;
            if !tx.mark_dead_letter(&id, None, now)? {
                return refused(format!("dead letter {id} was already replayed or dropped"));
            }
            tx.event(now, None, "dead", &format!("dead letter {id} dropped"))?;
            tx.dead_letter(&id)?
                .ok_or_else(|| ServiceError::NotFound(format!("no dead letter {given:?}")))
        })
    }
}
