//! Work contracts (SPEC §2.5): accept, return, close, and the messages work sends.

use super::{
    IdTable, MessageRow, Millis, Result, SUMMARY_CHARS_MAX, Service, ServiceError, Tx, WorkRow,
    WorkState, body_hash, check_agent_id, check_len, enabled_after, enrol, millis, refused, usage,
};

/// A work contract's outcome when its sender closes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Accepted,
    Revision,
    Blocked,
}

impl std::str::FromStr for Outcome {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "accepted" => Ok(Outcome::Accepted),
            "revision" => Ok(Outcome::Revision),
            "blocked" => Ok(Outcome::Blocked),
            other => Err(format!(
                "unknown outcome {other:?}; use accepted, revision or blocked"
            )),
        }
    }
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Accepted => "accepted",
            Outcome::Revision => "revision",
            Outcome::Blocked => "blocked",
        }
    }
}

/// A new message about work `w` (a return, a reminder), from→to, with a fresh id, in the
/// chain of the work's own message `of` (one hop below it; it spends no hop of the chain's
/// budget: it closes work, it does not continue it).
pub fn work_message(
    w: &WorkRow,
    of: Option<&MessageRow>,
    (from, to): (&str, &str),
    body: String,
    (intent, kind): (&str, &str),
    title: String,
    now: Millis,
) -> MessageRow {
    let id = crate::clock::new_id();
    let (chain_id, parent_id, hop) = match of {
        Some(m) if !m.chain_id.is_empty() => (m.chain_id.clone(), Some(m.id.clone()), m.hop + 1),
        Some(m) => (m.id.clone(), Some(m.id.clone()), m.hop + 1),
        None => (id.clone(), None, 0),
    };
    MessageRow {
        chain_id,
        parent_id,
        hop,
        id,
        sender: from.to_owned(),
        recipient: to.to_owned(),
        body_hash: body_hash(&body),
        body,
        intent: intent.to_owned(),
        kind: kind.to_owned(),
        title: Some(title),
        work_id: Some(w.id.clone()),
        idem_key: None,
        created_at: millis(now),
        read_at: None,
    }
}

impl Service {
    fn work_for(tx: &Tx<'_>, id: &str) -> Result<(MessageRow, WorkRow)> {
        let m = tx
            .message(id)?
            .ok_or_else(|| ServiceError::NotFound(format!("no message {id:?}")))?;
        let work_id = m
            .work_id
            .clone()
            .filter(|_| m.kind == "work")
            .ok_or_else(|| ServiceError::Refused(format!("{id} is not work (it has no title)")))?;
        let w = tx
            .work(&work_id)?
            .ok_or_else(|| ServiceError::NotFound(format!("no work {work_id:?}")))?;
        Ok((m, w))
    }

    pub fn accept(&mut self, id: &str, actor: &str) -> Result<WorkRow> {
        check_agent_id(actor)?;
        let id = self.resolve(IdTable::Messages, id)?;
        let now = millis(self.now());
        self.store.write(|tx| {
            let (_, mut w) = Self::work_for(tx, &id)?;
            if w.recipient != actor {
                return refused(format!("only {} can accept this work", w.recipient));
            }
            match w.state {
                WorkState::Accepted => return Ok(w),
                WorkState::Assigned => {}
                other => return refused(format!("the work is already {other}")),
            }
            w.state = WorkState::Accepted;
            w.updated_at = now;
            tx.update_work(&w)?;
            tx.event(now, Some(&id), "work", &format!("accepted by {actor}"))?;
            Ok(w)
        })
    }

    /// Returns work: `returned` (or `blocked`) and one return handoff to its sender.
    pub fn return_work(
        &mut self,
        id: &str,
        actor: &str,
        summary: &str,
        evidence: Option<&str>,
        blocked: bool,
    ) -> Result<super::Returned> {
        check_agent_id(actor)?;
        check_len("the summary", summary, SUMMARY_CHARS_MAX)?;
        if summary.trim().is_empty() {
            return usage("the summary is empty");
        }
        if let Some(e) = evidence {
            check_len("the evidence", e, SUMMARY_CHARS_MAX)?;
        }
        let id = self.resolve(IdTable::Messages, id)?;
        let now = self.now();
        let own = self.policy.clone();
        // The planted bug `stale_join`: the fan-out's state is read before the return's
        // transaction, and trusted in it.
        let stale = if crate::planted(crate::Plant::StaleJoin) {
            let state = self.store.read(|tx| {
                let Some(c) = tx.fanout_child(&id)? else {
                    return Ok::<_, ServiceError>(None);
                };
                Ok(tx.fanout(&c.fanout_id)?.map(|f| f.state))
            })?;
            std::thread::sleep(std::time::Duration::from_millis(150));
            state
        } else {
            None
        };
        self.store.write(|tx| {
            let (work_msg, mut w) = Self::work_for(tx, &id)?;
            if w.recipient != actor {
                return refused(format!("only {} can return this work", w.recipient));
            }
            // A fan-out's child counts toward its join (SPEC §8.2), unless its chain was
            // cancelled (then it is a chain's late return, below).
            if let Some(child) = tx.fanout_child(&work_msg.id)?
                && !tx.in_cancelled_chain(&work_msg.id)?
            {
                return super::fanout::child_returned(
                    tx,
                    (&work_msg, w, child),
                    actor,
                    (summary, evidence),
                    blocked,
                    (&own, now, stale.as_deref()),
                );
            }
            if w.state == WorkState::Closed
                && w.outcome.as_deref() == Some(super::chains::CANCELLED)
            {
                if w.summary.is_some() {
                    return refused("the work was already returned late; its chain was cancelled");
                }
                // Its chain was cancelled while the turn ran: the return is recorded, late,
                // and told to the sender (never a turn).
                let (work, note) =
                    late_return(tx, &work_msg, w, actor, (summary, evidence), blocked, now)?;
                return Ok(super::Returned {
                    work,
                    message: Some(note),
                    fanout: None,
                });
            }
            if !w.state.is_open() {
                return refused(format!("the work was already {}", w.state));
            }
            record_return(&mut w, (summary, evidence), blocked, millis(now));
            tx.update_work(&w)?;
            let verb = if blocked { "blocked" } else { "returned" };
            let shown = summary_card(tx, (summary, evidence), (actor, &w.sender), now)?;
            let body = format!("Work {verb}: {}\n\n{shown}", w.title);
            let ret = work_message(
                &w,
                Some(&work_msg),
                (actor, &w.sender),
                body,
                ("handoff", "return"),
                format!("{verb}: {}", w.title),
                now,
            );
            tx.insert_message(&ret)?;
            tx.event(
                millis(now),
                Some(&id),
                "work",
                &format!("{verb} by {actor}"),
            )?;
            tx.event(
                millis(now),
                Some(&ret.id),
                "sent",
                &format!("return {actor} → {}", w.sender),
            )?;
            if millis(now) >= enabled_after(tx)? {
                enrol(tx, &ret, now)?;
            }
            Ok(super::Returned {
                work: w,
                message: Some(ret),
                fanout: None,
            })
        })
    }

    pub fn close(
        &mut self,
        id: &str,
        actor: &str,
        outcome: Outcome,
        note: Option<&str>,
    ) -> Result<WorkRow> {
        check_agent_id(actor)?;
        if let Some(n) = note {
            check_len("the note", n, SUMMARY_CHARS_MAX)?;
        }
        let id = self.resolve(IdTable::Messages, id)?;
        let at = self.now();
        let now = millis(at);
        let own = self.policy.clone();
        self.store.write(|tx| {
            let (_, mut w) = Self::work_for(tx, &id)?;
            if w.sender != actor {
                return refused(format!(
                    "only the sender ({}) can close this work",
                    w.sender
                ));
            }
            if w.state == WorkState::Closed {
                return refused("the work is already closed");
            }
            w.state = WorkState::Closed;
            w.outcome = Some(outcome.as_str().to_owned());
            w.note = note.map(str::to_owned);
            w.updated_at = now;
            tx.update_work(&w)?;
            tx.event(
                now,
                Some(&id),
                "work",
                &format!("closed by {actor}: {}", outcome.as_str()),
            )?;
            // A fan-out child closed before it answered may leave its fan-out unable to
            // reach its quorum: then it is joined partial now.
            super::fanout::on_child_closed(tx, &id, &own, at)?;
            Ok(w)
        })
    }

    /// Open work (and work returned but not yet closed), newest first.
    pub fn open_work(&mut self, limit: i64) -> Result<Vec<WorkRow>> {
        self.store.read(|tx| Ok(tx.open_work(limit)?))
    }
}

/// Records a return on `w`: `returned` (or `blocked`) while it is open (closed work, a late
/// return, keeps its state), with the summary and the evidence.
pub(super) fn record_return(
    w: &mut WorkRow,
    (summary, evidence): (&str, Option<&str>),
    blocked: bool,
    now: i64,
) {
    if w.state.is_open() {
        w.state = if blocked {
            WorkState::Blocked
        } else {
            WorkState::Returned
        };
    }
    w.summary = Some(summary.to_owned());
    w.evidence = evidence.map(str::to_owned);
    w.updated_at = now;
}

/// A return that came late (`why`), told to the work's sender as a notification (never a
/// turn) that carries the summary and evidence within the cap.
pub(super) fn late_notice(
    tx: &crate::store::Tx<'_>,
    (w, work_msg): (&WorkRow, &MessageRow),
    (actor, verb): (&str, &str),
    why: &str,
    now: Millis,
) -> Result<MessageRow> {
    let shown = summary_card(
        tx,
        (w.summary.as_deref().unwrap_or(""), w.evidence.as_deref()),
        (actor, &w.sender),
        now,
    )?;
    let body = format!("Work {verb} late ({why}): {}\n\n{shown}", w.title);
    let note = work_message(
        w,
        Some(work_msg),
        (actor, &w.sender),
        body,
        ("notification", "return"),
        format!("{verb} late: {}", w.title),
        now,
    );
    tx.insert_message(&note)?;
    Ok(note)
}

/// A return's summary and evidence as its card carries them: within the summary cap, the
/// whole kept as an artifact when cut (SPEC §8.2 bounded summaries).
fn summary_card(
    tx: &crate::store::Tx<'_>,
    (summary, evidence): (&str, Option<&str>),
    between: (&str, &str),
    now: Millis,
) -> Result<String> {
    let mut full = summary.to_owned();
    if let Some(e) = evidence {
        full.push_str(&format!("\n\nEvidence: {e}"));
    }
    Ok(super::artifacts::bounded(tx, &full, "return", between, millis(now))?.0)
}

/// A return of work whose chain was cancelled while its turn ran: the summary is kept on
/// the closed work, and the sender gets it as a notification (never a turn).
fn late_return(
    tx: &crate::store::Tx<'_>,
    work_msg: &MessageRow,
    mut w: WorkRow,
    actor: &str,
    (summary, evidence): (&str, Option<&str>),
    blocked: bool,
    now: Millis,
) -> Result<(WorkRow, MessageRow)> {
    record_return(&mut w, (summary, evidence), blocked, millis(now));
    tx.update_work(&w)?;
    let verb = if blocked { "blocked" } else { "returned" };
    let ret = late_notice(
        tx,
        (&w, work_msg),
        (actor, verb),
        "its chain was cancelled while the turn ran",
        now,
    )?;
    tx.event(
        millis(now),
        Some(&w.id),
        "work",
        &format!("{verb} late by {actor}: its chain was cancelled"),
    )?;
    Ok((w, ret))
}

impl Service {
    /// Open work whose handoff's delivery is RETURNED (the recipient's turn is over), at
    /// most `limit` looked at.
    pub fn open_work_returned(&mut self, limit: i64) -> Result<Vec<WorkRow>> {
        self.store.read(|tx| {
            let mut out = Vec::new();
            for w in tx.open_work(limit)? {
                if w.state.is_open()
                    && tx
                        .delivery(&w.id)?
                        .is_some_and(|d| d.record.kind() == model::StateKind::Returned)
                {
                    out.push(w);
                }
            }
            Ok(out)
        })
    }
}
