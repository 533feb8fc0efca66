//! Fan-out (SPEC §8.2): one piece of work split to several agents in one transaction,
//! joined once, when all of its children (join) or the first K (quorum) have returned, or at
//! its deadline (flagged partial): the sender then gets ONE combined return, an ordinary
//! handoff with every guarantee of SPEC §3. A return after the join is recorded as late and
//! told to the sender (a notification, never a turn); optionally the children still
//! unanswered are cancelled when the fan-out is joined.
//!
//! Exactly once: a child's return and the deadline's look both decide the join inside one
//! `BEGIN IMMEDIATE` transaction that re-reads the fan-out, so of two returns at the same
//! moment from two processes, one joins it and the other finds it joined (late).

use super::chains::{self, Lineage};
use super::messages::{Draft, Sent, send_in};
use super::{
    ID_CHARS_MAX, MessageRow, Result, Serialize, Service, ServiceError, Tx, WorkRow, WorkState,
    body_hash, check_len, enabled_after, enrol, millis, refused, usage,
};
use crate::store::{FanoutChildRow, FanoutRow};
use model::Millis;

/// The most children one fan-out may have.
pub const FANOUT_CHILDREN_MAX: usize = 64;
/// The shortest deadline, in minutes (six seconds): a join cannot be asked for sooner.
pub const DEADLINE_MINUTES_MIN: f64 = 0.1;
/// The longest deadline, in minutes (30 days, as a due time).
pub const DEADLINE_MINUTES_MAX: f64 = 43_200.0;

/// When a fan-out is joined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Join {
    /// When every child has returned.
    All,
    /// When the first K have.
    Quorum(i64),
}

impl Join {
    /// `all` or `quorum:K`, for `n` children.
    pub fn parse(text: &str, n: usize) -> Result<Join> {
        let n = i64::try_from(n).unwrap_or(i64::MAX);
        match text.trim() {
            "all" => Ok(Join::All),
            other => {
                let Some(k) = other.strip_prefix("quorum:") else {
                    return usage(format!(
                        "unknown join {other:?}: use all or quorum:K (K of the {n} children)"
                    ));
                };
                match k.trim().parse::<i64>() {
                    Ok(k) if (1..=n).contains(&k) => Ok(Join::Quorum(k)),
                    _ => usage(format!(
                        "quorum:{k} is not a number of children from 1 to {n}"
                    )),
                }
            }
        }
    }
}

/// A fan-out as its front gave it.
#[derive(Debug)]
pub struct FanOut<'a> {
    pub from: &'a str,
    pub to: &'a [String],
    pub body: &'a str,
    pub title: &'a str,
    /// `all` (the default) or `quorum:K`.
    pub join: Option<&'a str>,
    /// The join comes at the latest this many minutes after the send (fractions allowed, at
    /// least 0.1), flagged partial when returns are missing.
    pub deadline_minutes: Option<f64>,
    /// Cancel the children still unanswered when it is joined.
    pub cancel_rest: bool,
    /// Each child's due time (a reminder to the sender, SPEC §2.5).
    pub due_minutes: Option<i64>,
    pub key: Option<&'a str>,
    pub lineage: &'a Lineage,
}

/// What a fan-out did.
#[derive(Clone, Debug, Serialize)]
pub struct FannedOut {
    pub fanout: FanoutRow,
    /// Each child's work message and its delivery's state, in the order given.
    pub children: Vec<Sent>,
    /// False when an idempotency key returned an earlier fan-out.
    pub created: bool,
}

/// A fan-out and how far its children got.
#[derive(Clone, Debug, Serialize)]
pub struct FanoutView {
    pub fanout: FanoutRow,
    pub children: Vec<ChildView>,
    /// Returns that count toward the join (answered before it).
    pub answered: i64,
}

/// One child of a fan-out as the page and `fanout show` list it.
#[derive(Clone, Debug, Serialize)]
pub struct ChildView {
    pub message_id: String,
    pub recipient: String,
    /// Its work's state (`assigned`, `accepted`, `returned`, `blocked`, `closed`).
    pub work_state: Option<String>,
    pub answered_at: Option<i64>,
    pub late: bool,
}

/// What a return did: the work after it, the message it sent (the return handoff; for a
/// fan-out's child, the combined return when this return joined the fan-out, or the
/// notification of a late return; none while the fan-out waits), and the fan-out it is part of.
#[derive(Clone, Debug, Serialize)]
pub struct Returned {
    pub work: WorkRow,
    pub message: Option<MessageRow>,
    pub fanout: Option<FanoutRow>,
}

fn check_fan_out(f: &FanOut<'_>) -> Result<(Join, Option<i64>)> {
    if f.to.is_empty() {
        return usage("a fan-out needs at least one recipient");
    }
    if f.to.len() > FANOUT_CHILDREN_MAX {
        return usage(format!(
            "a fan-out has at most {FANOUT_CHILDREN_MAX} recipients ({} given)",
            f.to.len()
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    for to in f.to {
        if !seen.insert(to.as_str()) {
            return usage(format!("{to} is named twice in the fan-out"));
        }
    }
    if let Some(k) = f.key {
        check_len("the key", k, ID_CHARS_MAX)?;
    }
    let join = Join::parse(f.join.unwrap_or("all"), f.to.len())?;
    let deadline_ms = match f.deadline_minutes {
        None => None,
        Some(m) if m.is_finite() && (DEADLINE_MINUTES_MIN..=DEADLINE_MINUTES_MAX).contains(&m) => {
            // In range, so the product fits an i64.
            #[allow(clippy::cast_possible_truncation)]
            Some((m * 60_000.0).round() as i64)
        }
        Some(_) => {
            return usage(format!(
                "the deadline must be {DEADLINE_MINUTES_MIN} to {DEADLINE_MINUTES_MAX} minutes"
            ));
        }
    };
    if let Some(b) = &f.lineage.budget {
        chains::parse_budget(b)?;
    }
    Ok((join, deadline_ms))
}

impl Service {
    /// Splits one piece of work to `f.to` in one transaction: one work message per
    /// recipient (the first placed by the send's lineage, spending the fan-out's one hop,
    /// the others beside it in its chain) and the fan-out that joins them. Refused as a
    /// whole, with no child sent, when any child cannot be sent (an unknown recipient, a
    /// connection not allowed, a chain past its budget or depth); a chain the fan-out would
    /// take past its budget is stopped and its origin told, as for any send.
    pub fn fan_out(&mut self, f: &FanOut<'_>) -> Result<FannedOut> {
        let out = self.fan_out_in(f);
        if let Err(ServiceError::Refused(_)) = &out
            && let Some(first) = f.to.first()
        {
            // The chain's stop (and its origin's one notification) is committed on its own,
            // as for a refused send, when the first child's placement stops it; a placement
            // that would pass changes nothing (rolled back).
            let now = self.now();
            let policy = self.policy.clone();
            let _ = self.store.write(|tx| {
                match chains::place(tx, (f.from, first), f.lineage, &policy, now)? {
                    Ok(_) => refused("the chain does not stop this fan-out"),
                    Err(_) => Ok(()),
                }
            });
        }
        out
    }

    fn fan_out_in(&mut self, f: &FanOut<'_>) -> Result<FannedOut> {
        let (join, deadline_ms) = check_fan_out(f)?;
        for to in f.to {
            super::messages::check_send(f.from, to, f.body, Some(f.title), f.due_minutes, None)?;
        }
        let now = self.now();
        let policy = self.policy.clone();
        self.store.write(|tx| {
            if let Some(k) = f.key
                && let Some(earlier) = tx.fanout_by_key(f.from, k)?
            {
                return again(tx, earlier, f, (join, deadline_ms), k);
            }
            let mut children: Vec<Sent> = Vec::with_capacity(f.to.len());
            for to in f.to {
                let draft = Draft {
                    from: f.from,
                    to,
                    body: f.body,
                    title: Some(f.title),
                    due_minutes: f.due_minutes,
                    key: None,
                    lineage: f.lineage,
                    policy: &policy,
                    beside: children.first().map(|s| &s.message),
                };
                // A child that cannot be sent refuses the whole fan-out: rolled back.
                let sent = send_in(tx, &draft, now, false)??;
                children.push(sent);
            }
            let n = i64::try_from(children.len()).unwrap_or(i64::MAX);
            let fanout = FanoutRow {
                id: crate::clock::new_id(),
                sender: f.from.to_owned(),
                title: f.title.to_owned(),
                children: n,
                quorum: match join {
                    Join::All => n,
                    Join::Quorum(k) => k,
                },
                join_rule: match join {
                    Join::All => "all",
                    Join::Quorum(_) => "quorum",
                }
                .to_owned(),
                deadline_at: deadline_ms.map(|ms| millis(now) + ms),
                cancel_rest: f.cancel_rest,
                state: "waiting".to_owned(),
                combined_id: None,
                idem_key: f.key.map(str::to_owned),
                created_at: millis(now),
                joined_at: None,
            };
            tx.insert_fanout(&fanout)?;
            for (i, c) in children.iter().enumerate() {
                tx.insert_fanout_child(&FanoutChildRow {
                    fanout_id: fanout.id.clone(),
                    message_id: c.message.id.clone(),
                    recipient: c.message.recipient.clone(),
                    position: i64::try_from(i).unwrap_or(i64::MAX),
                    answered_at: None,
                    late: false,
                })?;
            }
            tx.event(
                millis(now),
                Some(&children[0].message.id),
                "fanout",
                &format!(
                    "fan-out {} by {}: {} to {} ({})",
                    fanout.id,
                    f.from,
                    f.title,
                    f.to.join(", "),
                    rule_text(&fanout)
                ),
            )?;
            Ok(FannedOut {
                fanout,
                children,
                created: true,
            })
        })
    }

    /// A fan-out (its id, or the id of any of its children) and how far its children got.
    pub fn fanout_show(&mut self, given: &str) -> Result<FanoutView> {
        if given.is_empty() || given.len() > ID_CHARS_MAX {
            return usage("an id must be 1 to 200 characters");
        }
        let known = self
            .store
            .read(|tx| Ok::<_, ServiceError>(tx.fanout(given)?))?;
        let by_prefix = if known.is_none() && given.len() >= super::ID_PREFIX_MIN {
            self.store
                .read(|tx| Ok::<_, ServiceError>(tx.fanout_ids_with_prefix(given)?))?
        } else {
            Vec::new()
        };
        let id = if let Some(f) = known {
            f.id
        } else if let [one] = by_prefix.as_slice() {
            one.clone()
        } else {
            let m = self.resolve(super::IdTable::Messages, given)?;
            self.store
                .read(|tx| Ok::<_, ServiceError>(tx.fanout_child(&m)?))?
                .ok_or_else(|| {
                    ServiceError::NotFound(format!(
                        "{given} is not a fan-out nor one of its children"
                    ))
                })?
                .fanout_id
        };
        self.store.read(|tx| {
            let f = tx
                .fanout(&id)?
                .ok_or_else(|| ServiceError::NotFound(format!("no fan-out {id:?}")))?;
            view(tx, f)
        })
    }

    /// [`Service::fanout_show`] for `agent` (an MCP session's): its sender or one of its
    /// children's recipients only.
    pub fn fanout_show_for(&mut self, agent: &str, given: &str) -> Result<FanoutView> {
        super::check_agent_id(agent)?;
        let v = self.fanout_show(given)?;
        if v.fanout.sender != agent && !v.children.iter().any(|c| c.recipient == agent) {
            return refused(format!(
                "{agent} is neither the sender nor a child of fan-out {}",
                v.fanout.id
            ));
        }
        Ok(v)
    }

    /// Fan-outs still waiting for their join, the newest first.
    pub fn fanouts_waiting(&mut self, limit: i64) -> Result<Vec<FanoutView>> {
        self.store.read(|tx| waiting(tx, limit))
    }
}

/// Fan-outs still waiting for their join, the newest first, at most `limit`.
pub(super) fn waiting(tx: &Tx<'_>, limit: i64) -> Result<Vec<FanoutView>> {
    tx.fanouts_waiting(limit)?
        .into_iter()
        .map(|f| view(tx, f))
        .collect()
}

/// A repeated key: the earlier fan-out when it asked the same, else refused.
fn again(
    tx: &Tx<'_>,
    earlier: FanoutRow,
    f: &FanOut<'_>,
    (join, deadline_ms): (Join, Option<i64>),
    key: &str,
) -> Result<FannedOut> {
    let kids = tx.fanout_children(&earlier.id)?;
    let mut children = Vec::with_capacity(kids.len());
    for c in &kids {
        if let Some(m) = tx.message(&c.message_id)? {
            let delivery_state = tx.delivery(&m.id)?.map(|d| d.record.kind());
            children.push(Sent {
                message: m,
                created: false,
                delivery_state,
            });
        }
    }
    let same = earlier.title == f.title
        && kids
            .iter()
            .map(|c| c.recipient.as_str())
            .eq(f.to.iter().map(String::as_str))
        && children
            .first()
            .is_some_and(|c| c.message.body_hash == body_hash(f.body))
        && earlier.quorum
            == match join {
                Join::All => earlier.children,
                Join::Quorum(k) => k,
            }
        && earlier.deadline_at.map(|d| d - earlier.created_at) == deadline_ms
        && earlier.cancel_rest == f.cancel_rest
        && children.first().is_some_and(|c| {
            tx.work(&c.message.id)
                .ok()
                .flatten()
                .map(|w| w.due_at.map(|d| d - w.created_at))
                == Some(f.due_minutes.map(|m| m * 60_000))
        });
    if !same {
        return refused(format!(
            "key {key:?} was already used for a different fan-out"
        ));
    }
    Ok(FannedOut {
        fanout: earlier,
        children,
        created: false,
    })
}

fn view(tx: &Tx<'_>, fanout: FanoutRow) -> Result<FanoutView> {
    let mut children = Vec::new();
    let mut answered = 0;
    for c in tx.fanout_children(&fanout.id)? {
        if c.answered_at.is_some() && !c.late {
            answered += 1;
        }
        let work_state = tx.work(&c.message_id)?.map(|w| w.state.to_string());
        children.push(ChildView {
            message_id: c.message_id,
            recipient: c.recipient,
            work_state,
            answered_at: c.answered_at,
            late: c.late,
        });
    }
    Ok(FanoutView {
        fanout,
        children,
        answered,
    })
}

/// The join rule in words: `all 3`, `quorum 2 of 3`, with the deadline.
fn rule_text(f: &FanoutRow) -> String {
    let rule = if f.join_rule == "all" {
        format!("join all {}", f.children)
    } else {
        format!("quorum {} of {}", f.quorum, f.children)
    };
    match f.deadline_at {
        Some(at) => format!("{rule}, deadline {}", crate::text::when(at)),
        None => rule,
    }
}

/// A return of `w`, the work of fan-out child `child` (its message `work_msg`), inside the
/// return's transaction: recorded on the work; before the join it counts toward it (and
/// joins it when it is the last one needed); after the join it is recorded as late and told
/// to the sender.
pub(super) fn child_returned(
    tx: &Tx<'_>,
    (work_msg, mut w, child): (&MessageRow, WorkRow, FanoutChildRow),
    actor: &str,
    (summary, evidence): (&str, Option<&str>),
    blocked: bool,
    (own, now, stale): (&model::Policy, Millis, Option<&str>),
) -> Result<Returned> {
    let mut f = tx
        .fanout(&child.fanout_id)?
        .ok_or_else(|| ServiceError::NotFound(format!("no fan-out {:?}", child.fanout_id)))?;
    if w.summary.is_some() || child.answered_at.is_some() {
        return refused(format!("the work was already {}", w.state));
    }
    // Past its deadline the fan-out is joined partial before this return counts, whether or
    // not the engine's housekeeping got to it yet: the return is late.
    if f.state == "waiting" && f.deadline_at.is_some_and(|d| d <= millis(now)) {
        join(tx, &mut f, (true, Some(&work_msg.id)), own, now)?;
    }
    let cancelled_by_join = w.state == WorkState::Closed
        && w.outcome.as_deref() == Some(super::chains::CANCELLED)
        && f.state != "waiting";
    if !w.state.is_open() && !cancelled_by_join {
        return refused(format!("the work was already {}", w.state));
    }
    let verb = if blocked { "blocked" } else { "returned" };
    super::work::record_return(&mut w, (summary, evidence), blocked, millis(now));
    tx.update_work(&w)?;
    // (`stale`: the planted bug's state, read before this transaction.)
    let late = stale.unwrap_or(&f.state) != "waiting";
    tx.answer_fanout_child(&work_msg.id, millis(now), late)?;
    if late {
        tx.event(
            millis(now),
            Some(&work_msg.id),
            "work",
            &format!(
                "{verb} late by {actor}: fan-out {} was already joined",
                f.id
            ),
        )?;
        let why = format!("fan-out {} was joined {} before it came", f.id, f.state);
        let note = super::work::late_notice(tx, (&w, work_msg), (actor, verb), &why, now)?;
        return Ok(Returned {
            work: w,
            message: Some(note),
            fanout: Some(f),
        });
    }
    let (returned, reachable) = standing(tx, &f)?;
    tx.event(
        millis(now),
        Some(&work_msg.id),
        "work",
        &format!(
            "{verb} by {actor}: {returned} of the {} returns fan-out {} needs",
            f.quorum, f.id
        ),
    )?;
    // A blocked answer is recorded and shown, but it is no return: it counts toward no
    // quorum, and when too few children are left to reach it, the fan-out is joined partial.
    let message = if returned >= f.quorum {
        Some(join(tx, &mut f, (false, None), own, now)?)
    } else if reachable < f.quorum {
        Some(join(tx, &mut f, (true, None), own, now)?)
    } else {
        None
    };
    Ok(Returned {
        work: w,
        message,
        fanout: Some(f),
    })
}

/// Joins fan-out `f` (complete, or `partial` at its deadline): the one combined return to
/// its sender (each answer's summary, who answered, who did not), and, when asked, the
/// unanswered children cancelled. Inside the caller's transaction, which read `f` waiting.
fn join(
    tx: &Tx<'_>,
    f: &mut FanoutRow,
    (partial, spare): (bool, Option<&str>),
    own: &model::Policy,
    now: Millis,
) -> Result<MessageRow> {
    let at = millis(now);
    let children = tx.fanout_children(&f.id)?;
    let mut answers = String::new();
    let mut unanswered = Vec::new();
    let mut count = 0;
    for c in &children {
        let w = tx.work(&c.message_id)?;
        match (&w, c.answered_at) {
            (Some(w), Some(_)) if !c.late => {
                count += 1;
                answers.push_str(&format!(
                    "\n\n## {} {} (work {})\n\n{}",
                    c.recipient,
                    w.state,
                    crate::text::short(&c.message_id),
                    w.summary.as_deref().unwrap_or("")
                ));
                if let Some(e) = &w.evidence {
                    answers.push_str(&format!("\n\nEvidence: {e}"));
                }
            }
            _ => unanswered.push(c),
        }
    }
    if partial { "partial" } else { "complete" }.clone_into(&mut f.state);
    f.joined_at = Some(at);
    let mut cancelled = Vec::new();
    if f.cancel_rest && !unanswered.is_empty() {
        let mut msgs = Vec::new();
        // (`spare`: the child whose late return is joining it; its part is not cancelled.)
        for c in unanswered
            .iter()
            .filter(|c| Some(c.message_id.as_str()) != spare)
        {
            if let Some(m) = tx.message(&c.message_id)? {
                msgs.push(m);
            }
        }
        let why = format!("fan-out {} was joined {}", f.id, f.state);
        cancelled = chains::cancel_part(tx, &msgs, own, &why, now)?;
    }
    let head = if partial {
        let cause = if f.deadline_at.is_some_and(|d| d <= at) {
            "its deadline passed"
        } else {
            "it can no longer reach its quorum (children closed unanswered)"
        };
        format!(
            "Fan-out \"{}\" joined PARTIAL: {cause} with {count} of {} answered ({} needed).",
            f.title, f.children, f.quorum
        )
    } else {
        format!(
            "Fan-out \"{}\" joined: {count} of {} answered ({}).",
            f.title,
            f.children,
            rule_text(f)
        )
    };
    let missing = if unanswered.is_empty() {
        String::new()
    } else {
        let who: Vec<String> = unanswered
            .iter()
            .map(|c| {
                format!(
                    "{} (work {})",
                    c.recipient,
                    crate::text::short(&c.message_id)
                )
            })
            .collect();
        let then = if f.cancel_rest {
            "cancelled"
        } else {
            "still open; a later return is recorded as late and told to you"
        };
        format!("\n\nNot answered: {} ({then}).", who.join(", "))
    };
    let full = format!(
        "{head}{missing}{answers}\n\nClose each answered child's work with `handoffs close ID \
         accepted|revision|blocked` (MCP close_work)."
    );
    let (body, _) =
        super::artifacts::bounded(tx, &full, "fan-out", (super::SYSTEM_SENDER, &f.sender), at)?;
    let first = tx.message(&children[0].message_id)?.ok_or_else(|| {
        ServiceError::NotFound(format!("no message {:?}", children[0].message_id))
    })?;
    let id = crate::clock::new_id();
    let combined = MessageRow {
        chain_id: if first.chain_id.is_empty() {
            first.id.clone()
        } else {
            first.chain_id.clone()
        },
        parent_id: Some(first.id.clone()),
        hop: first.hop + 1,
        id,
        sender: super::SYSTEM_SENDER.to_owned(),
        recipient: f.sender.clone(),
        body_hash: body_hash(&body),
        body,
        intent: "handoff".to_owned(),
        kind: "return".to_owned(),
        title: Some(format!(
            "{} ({count}/{}): {}",
            if partial { "partial" } else { "joined" },
            f.children,
            f.title
        )),
        work_id: None,
        idem_key: None,
        created_at: at,
        read_at: None,
    };
    tx.insert_message(&combined)?;
    f.combined_id = Some(combined.id.clone());
    tx.update_fanout(f)?;
    tx.event(
        at,
        Some(&combined.id),
        "sent",
        &format!(
            "fan-out {} joined {}: {count} of {} answered{}; combined return → {}",
            f.id,
            f.state,
            f.children,
            if cancelled.is_empty() {
                String::new()
            } else {
                format!(", {} cancelled", cancelled.len())
            },
            f.sender
        ),
    )?;
    if at >= enabled_after(tx)? {
        enrol(tx, &combined, now)?;
    }
    Ok(combined)
}

/// Joins, partial, every waiting fan-out whose deadline has passed (the engine's
/// housekeeping); a fan-out whose chain was cancelled is closed without a return. Returns
/// how many it joined.
pub(super) fn join_past_deadline(tx: &Tx<'_>, own: &model::Policy, now: Millis) -> Result<usize> {
    let mut joined = 0;
    if own.planted(model::PlantedBug::DeadlineNeverJoins) {
        return Ok(0);
    }
    for mut f in tx.fanouts_past_deadline(millis(now), 100)? {
        let first = tx.fanout_children(&f.id)?.into_iter().next();
        if let Some(c) = first
            && tx.in_cancelled_chain(&c.message_id)?
        {
            "cancelled".clone_into(&mut f.state);
            f.joined_at = Some(millis(now));
            tx.update_fanout(&f)?;
            continue;
        }
        join(tx, &mut f, (true, None), own, now)?;
        joined += 1;
    }
    Ok(joined)
}

/// How fan-out `f` stands: the children returned before its join (not blocked), and how
/// many could still count (those, and the children whose work is still open, unanswered).
fn standing(tx: &Tx<'_>, f: &FanoutRow) -> Result<(i64, i64)> {
    let (mut returned, mut reachable) = (0, 0);
    for k in tx.fanout_children(&f.id)? {
        let work = tx.work(&k.message_id)?;
        let counts = k.answered_at.is_some()
            && !k.late
            && work.as_ref().is_some_and(|w| w.state != WorkState::Blocked);
        let open = k.answered_at.is_none() && work.is_some_and(|w| w.state.is_open());
        if counts {
            returned += 1;
        }
        if counts || open {
            reachable += 1;
        }
    }
    Ok((returned, reachable))
}

/// A child replayed after it died (`old`, a dead letter, now `new` to `recipient`): while
/// its fan-out waits and its work is open, the replay is the child from then on and the old
/// work is closed as replaced; otherwise the fan-out is left as it is.
pub(super) fn on_replay(tx: &Tx<'_>, old: &str, new: &MessageRow, now: i64) -> Result<()> {
    let Some(c) = tx.fanout_child(old)? else {
        return Ok(());
    };
    let waiting = tx
        .fanout(&c.fanout_id)?
        .is_some_and(|f| f.state == "waiting");
    let Some(mut w) = tx.work(old)?.filter(|w| w.state.is_open()) else {
        return Ok(());
    };
    if !waiting || c.answered_at.is_some() {
        return Ok(());
    }
    tx.relink_fanout_child(old, &new.id, &new.recipient)?;
    w.state = WorkState::Closed;
    w.outcome = Some("replaced".to_owned());
    w.note = Some(format!("replayed as {}", new.id));
    w.updated_at = now;
    tx.update_work(&w)?;
    Ok(())
}

/// A child's work closed by its sender before it answered: if the fan-out can no longer
/// reach its quorum (too few children left open), it is joined partial now.
pub(super) fn on_child_closed(
    tx: &Tx<'_>,
    id: &str,
    own: &model::Policy,
    now: Millis,
) -> Result<Option<MessageRow>> {
    let Some(c) = tx.fanout_child(id)? else {
        return Ok(None);
    };
    let Some(mut f) = tx.fanout(&c.fanout_id)? else {
        return Ok(None);
    };
    if f.state != "waiting" {
        return Ok(None);
    }
    let (_, reachable) = standing(tx, &f)?;
    if reachable >= f.quorum {
        return Ok(None);
    }
    Ok(Some(join(tx, &mut f, (true, None), own, now)?))
}

/// Marks the waiting fan-out of child message `id`, if any, cancelled (its chain was): no
/// combined return comes.
pub(super) fn on_chain_cancel(tx: &Tx<'_>, id: &str, now: i64) -> Result<()> {
    if let Some(c) = tx.fanout_child(id)?
        && let Some(mut f) = tx.fanout(&c.fanout_id)?
        && f.state == "waiting"
    {
        "cancelled".clone_into(&mut f.state);
        f.joined_at = Some(now);
        tx.update_fanout(&f)?;
    }
    Ok(())
}
