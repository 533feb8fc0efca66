//! Messages: send (enrolled in the same transaction), id prefixes, inboxes, reads.

use super::chains::{self, Lineage};
use super::dead;
use super::{
    DUE_MINUTES_MAX, ID_CHARS_MAX, ID_PREFIX_MIN, IdTable, MESSAGE_CHARS_MAX, MessageRow, Result,
    Serialize, Service, ServiceError, StateKind, TITLE_CHARS_MAX, WorkRow, WorkState, body_hash,
    check_agent_id, check_len, connection_allowed, enabled_after, enrol, millis, refused, usage,
};
use crate::store::Tx;
use model::Millis;

/// What `send` did.
#[derive(Clone, Debug, Serialize)]
pub struct Sent {
    pub message: MessageRow,
    /// False when an idempotency key returned an earlier message.
    pub created: bool,
    pub delivery_state: Option<StateKind>,
}

impl Service {
    /// [`Service::send_as`] with no lineage of the front's own: it continues the sender's
    /// active delivery's chain, or starts one.
    pub fn send(
        &mut self,
        from: &str,
        to: &str,
        body: &str,
        title: Option<&str>,
        due_minutes: Option<i64>,
        key: Option<&str>,
    ) -> Result<Sent> {
        self.send_as(from, to, body, title, due_minutes, key, &Lineage::default())
    }

    /// Sends a message from `from` to `to`, in the chain `lineage` names (SPEC §8.2): a send
    /// past its chain's hop budget or depth limit is refused and stops the chain.
    #[allow(clippy::too_many_arguments)]
    pub fn send_as(
        &mut self,
        from: &str,
        to: &str,
        body: &str,
        title: Option<&str>,
        due_minutes: Option<i64>,
        key: Option<&str>,
        lineage: &Lineage,
    ) -> Result<Sent> {
        check_send(from, to, body, title, due_minutes, key)?;
        if let Some(b) = &lineage.budget {
            chains::parse_budget(b)?;
        }
        let now = self.now();
        // The planted bug `enrol_after_commit` (G8): the message is committed first and its
        // delivery in a second transaction, so a send killed in between leaves a message
        // that no delivery will ever carry until the engine's housekeeping finds it.
        let enrol_late = crate::planted(crate::Plant::EnrolAfterCommit);
        let draft = Draft {
            from,
            to,
            body,
            title,
            due_minutes,
            key,
            lineage,
            policy: &self.policy,
            beside: None,
        };
        let sent = self
            .store
            .write(|tx| send_in(tx, &draft, now, enrol_late))?;
        let sent = sent?;
        if enrol_late && sent.created {
            std::thread::sleep(std::time::Duration::from_millis(50));
            let message = sent.message.clone();
            let delivery_state = self.store.write(|tx| enrol(tx, &message, now))?;
            return Ok(Sent {
                delivery_state,
                ..sent
            });
        }
        Ok(sent)
    }

    /// Resolves an id or a unique prefix of ≥ 6 characters.
    pub fn resolve(&mut self, table: IdTable, given: &str) -> Result<String> {
        if given.is_empty() || given.len() > ID_CHARS_MAX {
            return usage("an id must be 1 to 200 characters");
        }
        let matches = self
            .store
            .read(|tx| Ok::<_, ServiceError>(tx.ids_with_prefix(table, given)?))?;
        match matches.as_slice() {
            [one] if one == given => Ok(one.clone()),
            _ if given.len() < ID_PREFIX_MIN => usage(format!(
                "{given:?} is too short: give the full id or at least {ID_PREFIX_MIN} characters"
            )),
            [one] => Ok(one.clone()),
            [] if table == IdTable::Deliveries => {
                // A message that exists but has no delivery deserves a better word.
                match self.resolve(IdTable::Messages, given) {
                    Ok(m) => Err(ServiceError::NotFound(format!(
                        "message {m} has no delivery: a notification is never a turn, and a \
                         message sent before delivery was enabled is never enrolled"
                    ))),
                    Err(ServiceError::NotFound(_)) => {
                        Err(ServiceError::NotFound(format!("no delivery {given:?}")))
                    }
                    Err(e) => Err(e),
                }
            }
            [] => Err(ServiceError::NotFound(format!("no message {given:?}"))),
            _ => usage(format!(
                "{given:?} matches more than one message; give more characters"
            )),
        }
    }

    pub fn inbox(&mut self, agent: &str, all: bool, limit: i64) -> Result<Vec<MessageRow>> {
        check_agent_id(agent)?;
        if !(1..=super::LIST_LIMIT_MAX).contains(&limit) {
            return usage("limit must be 1 to 10000");
        }
        self.store.read(|tx| {
            if tx.agent(agent)?.is_none() {
                return Err(ServiceError::NotFound(format!("unknown agent {agent:?}")));
            }
            Ok(tx.inbox(agent, all, limit)?)
        })
    }

    /// The full message; marks it read when `reader` is its recipient.
    pub fn read(&mut self, id: &str, reader: &str) -> Result<MessageRow> {
        check_agent_id(reader)?;
        let id = self.resolve(IdTable::Messages, id)?;
        let now = millis(self.now());
        self.store.write(|tx| {
            let mut m = tx
                .message(&id)?
                .ok_or_else(|| ServiceError::NotFound(format!("no message {id:?}")))?;
            if m.recipient != reader && m.sender != reader {
                return refused(format!(
                    "{reader} is neither the sender nor the recipient of {id}"
                ));
            }
            if m.recipient == reader && tx.mark_read(&id, now)? {
                m.read_at = Some(now);
                tx.event(now, Some(&id), "read", &format!("read by {reader}"))?;
            }
            Ok(m)
        })
    }
}

/// The checks of a send's arguments that need no database.
pub(super) fn check_send(
    from: &str,
    to: &str,
    body: &str,
    title: Option<&str>,
    due_minutes: Option<i64>,
    key: Option<&str>,
) -> Result<()> {
    check_agent_id(from)?;
    check_agent_id(to)?;
    check_len("the message", body, MESSAGE_CHARS_MAX)?;
    if body.trim().is_empty() {
        return usage("the message is empty");
    }
    if let Some(t) = title {
        check_len("the title", t, TITLE_CHARS_MAX)?;
        if t.trim().is_empty() {
            return usage("the title is empty");
        }
    }
    if let Some(k) = key {
        check_len("the key", k, ID_CHARS_MAX)?;
    }
    match (due_minutes, title) {
        (Some(_), None) => {
            return usage("due_minutes needs a title (only work has a due time)");
        }
        (Some(m), _) if !(1..=DUE_MINUTES_MAX).contains(&m) => {
            return usage(format!("due_minutes must be 1 to {DUE_MINUTES_MAX}"));
        }
        _ => {}
    }
    if from == to {
        return refused("an agent never sends to itself");
    }
    Ok(())
}

/// A send as its front gave it.
pub(super) struct Draft<'a> {
    pub from: &'a str,
    pub to: &'a str,
    pub body: &'a str,
    pub title: Option<&'a str>,
    pub due_minutes: Option<i64>,
    pub key: Option<&'a str>,
    pub lineage: &'a Lineage,
    /// The rules' policy (its planted bug, in tests).
    pub policy: &'a model::Policy,
    /// Placed beside this message (a fan-out's later children beside its first), not by
    /// `lineage`.
    pub beside: Option<&'a MessageRow>,
}

/// A send inside the caller's transaction: the message, its work and its delivery; or, for
/// a send that cannot be delivered (unknown recipient, a connection not allowed, a stopped
/// chain), its dead letter and the refusal to give (`Ok(Err(..))`, to commit).
pub(super) fn send_in(
    tx: &Tx<'_>,
    d: &Draft<'_>,
    now: Millis,
    enrol_late: bool,
) -> Result<std::result::Result<Sent, ServiceError>> {
    let Draft {
        from,
        to,
        body,
        title,
        due_minutes,
        key,
        lineage,
        policy,
        beside: _,
    } = *d;
    let hash = body_hash(body);
    if tx.agent(from)?.is_none() {
        return Err(ServiceError::NotFound(format!(
            "unknown agent {from:?}: no agent of that id is registered"
        )));
    }
    if let Some(k) = key
        && let Some(existing) = tx.message_by_key(from, k)?
    {
        if existing.recipient == to
            && existing.body_hash == hash
            && existing.title.as_deref() == title
        {
            let state = tx.delivery(&existing.id)?.map(|d| d.record.kind());
            return Ok(Ok(Sent {
                message: existing,
                created: false,
                delivery_state: state,
            }));
        }
        return refused(format!(
            "key {k:?} was already used for a different message"
        ));
    }
    // What cannot be delivered is kept as a dead letter (SPEC §8.2), committed with the
    // refusal.
    let dead =
        |reason: dead::Reason, why: String| -> Result<std::result::Result<Sent, ServiceError>> {
            let parent = chains::parent_of(tx, from, lineage).ok().flatten();
            dead::refused_send(tx, d, parent.as_ref(), reason, &why, millis(now))?;
            Ok(Err(if reason == dead::Reason::UnknownRecipient {
                ServiceError::NotFound(why)
            } else {
                ServiceError::Refused(why)
            }))
        };
    if tx.agent(to)?.is_none() {
        return dead(
            dead::Reason::UnknownRecipient,
            format!("unknown agent {to:?}: no agent of that id is registered"),
        );
    }
    if !connection_allowed(tx, from, to)? {
        return dead(
            dead::Reason::Topology,
            format!(
                "the connection {from} → {to} is not allowed; `handoffs allow {from} {to}` opens it"
            ),
        );
    }
    let placed = match d.beside {
        Some(of) => Ok(chains::beside(of)),
        None => chains::place(tx, (from, to), lineage, policy, now)?,
    };
    let place = match placed {
        Ok(place) => place,
        // Stopped: the chain's stop and its origin's notification are committed.
        Err(why) => return dead(dead::Reason::ChainStopped, why),
    };
    let id = crate::clock::new_id();
    let work_id = title.map(|_| id.clone());
    let (chain_id, parent_id, hop) = match &place {
        chains::Place::Root => (id.clone(), None, 0),
        chains::Place::Child { parent } => (
            if parent.chain_id.is_empty() {
                parent.id.clone()
            } else {
                parent.chain_id.clone()
            },
            Some(parent.id.clone()),
            parent.hop + 1,
        ),
        chains::Place::Sibling { of } => (of.chain_id.clone(), of.parent_id.clone(), of.hop),
    };
    let message = MessageRow {
        id: id.clone(),
        sender: from.to_owned(),
        recipient: to.to_owned(),
        body: body.to_owned(),
        body_hash: hash.clone(),
        intent: "handoff".to_owned(),
        kind: if title.is_some() { "work" } else { "plain" }.to_owned(),
        title: title.map(str::to_owned),
        work_id: work_id.clone(),
        idem_key: key.map(str::to_owned),
        created_at: millis(now),
        read_at: None,
        chain_id,
        parent_id,
        hop,
    };
    tx.insert_message(&message)?;
    if matches!(place, chains::Place::Root) {
        chains::start(tx, &message, lineage.budget.as_deref())?;
    }
    if let (Some(work_id), Some(title)) = (work_id, title) {
        tx.insert_work(&WorkRow {
            id: work_id,
            sender: from.to_owned(),
            recipient: to.to_owned(),
            title: title.to_owned(),
            state: WorkState::Assigned,
            due_at: due_minutes.map(|m| millis(now) + m * 60_000),
            reminded_at: None,
            summary: None,
            evidence: None,
            outcome: None,
            note: None,
            created_at: millis(now),
            updated_at: millis(now),
        })?;
    }
    let what = if title.is_some() { "work" } else { "handoff" };
    tx.event(
        millis(now),
        Some(&id),
        "sent",
        &format!("{what} {from} → {to}"),
    )?;
    let delivery_state = if !enrol_late && millis(now) >= enabled_after(tx)? {
        enrol(tx, &message, now)?
    } else {
        None
    };
    Ok(Ok(Sent {
        message,
        created: true,
        delivery_state,
    }))
}
