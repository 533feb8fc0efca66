//! Messages: send (enrolled in the same transaction), id prefixes, inboxes, reads.

use super::{
    DUE_MINUTES_MAX, ID_CHARS_MAX, ID_PREFIX_MIN, IdTable, MESSAGE_CHARS_MAX, MessageRow, Result,
    Serialize, Service, ServiceError, StateKind, TITLE_CHARS_MAX, WorkRow, WorkState, body_hash,
    check_agent_id, check_len, connection_allowed, enabled_after, enrol, millis, refused, usage,
};

/// What `send` did.
#[derive(Clone, Debug, Serialize)]
pub struct Sent {
    pub message: MessageRow,
    /// False when an idempotency key returned an earlier message.
    pub created: bool,
    pub delivery_state: Option<StateKind>,
}

impl Service {
    pub fn send(
        &mut self,
        from: &str,
        to: &str,
        body: &str,
        title: Option<&str>,
        due_minutes: Option<i64>,
        key: Option<&str>,
    ) -> Result<Sent> {
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
        let now = self.now();
        let hash = body_hash(body);
        // The planted bug `enrol_after_commit` (G8): the message is committed first and its
        // delivery in a second transaction, so a send killed in between leaves a message
        // that no delivery will ever carry until the engine's housekeeping finds it.
        let enrol_late = crate::planted(crate::Plant::EnrolAfterCommit);
        let sent = self.store.write(|tx| {
            for id in [from, to] {
                if tx.agent(id)?.is_none() {
                    return Err(ServiceError::NotFound(format!(
                        "unknown agent {id:?}: no agent of that id is registered"
                    )));
                }
            }
            if let Some(k) = key
                && let Some(existing) = tx.message_by_key(from, k)?
            {
                if existing.recipient == to
                    && existing.body_hash == hash
                    && existing.title.as_deref() == title
                {
                    let state = tx.delivery(&existing.id)?.map(|d| d.record.kind());
                    return Ok(Sent {
                        message: existing,
                        created: false,
                        delivery_state: state,
                    });
                }
                return refused(format!("key {k:?} was already used for a different message"));
            }
            if !connection_allowed(tx, from, to)? {
                return refused(format!(
                    "the connection {from} → {to} is not allowed; `handoffs allow {from} {to}` opens it"
                ));
            }
            let id = crate::clock::new_id();
            let work_id = title.map(|_| id.clone());
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
            };
            tx.insert_message(&message)?;
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
            tx.event(millis(now), Some(&id), "sent", &format!("{what} {from} → {to}"))?;
            let delivery_state = if !enrol_late && millis(now) >= enabled_after(tx)? {
                enrol(tx, &message, now)?
            } else {
                None
            };
            Ok(Sent {
                message,
                created: true,
                delivery_state,
            })
        })?;
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
