//! Chains (SPEC §8.2): the lineage of a send, the hop budget and depth limit that stop a
//! runaway chain, and a person's view and release of a chain.

use super::{
    ChainRow, IdTable, MessageRow, Result, Service, ServiceError, Tx, body_hash, millis, refused,
    usage,
};
use crate::store::ChainState;
use model::Millis;
use serde::Serialize;

/// Where a send comes from, as its front knows it (the sender itself is a separate argument).
#[derive(Clone, Debug, Default)]
pub struct Lineage {
    /// An explicit parent message (id or unique prefix): `send --parent ID`.
    pub parent: Option<String>,
    /// The turn the send is made from (`HANDOFFS_REQUEST_ID` in a supervised run).
    pub request_id: Option<String>,
    /// The send comes from inside the sender's session (its MCP server, or a command run in
    /// its turn): without a parent or a run, the turn it is working on (its delivery ACCEPTED
    /// or RUNNING) is the parent. A person's send (the page, a plain CLI call) starts a chain.
    pub in_turn: bool,
    /// A new chain's budget, `hops=N[,UNIT=N…]` (`send --budget`): only for a send that
    /// starts a chain.
    pub budget: Option<String>,
    /// The handoff the sender's session last took up (an MCP session's `read_message` or
    /// `accept_work` of a handoff sent to it): the parent when no turn of the agent is under
    /// way, so an agent that pulls its mail and answers it continues the chain it answers.
    pub session: Option<String>,
}

/// The most hops a chain's budget may be given, and the deepest limit.
pub const HOP_BUDGET_MAX: i64 = 100_000;
pub const DEPTH_LIMIT_MAX: i64 = 1_000;

/// Where a new message goes in its chain, or why it may not.
pub(super) enum Place {
    /// A chain's first message.
    Root,
    /// A continuation of `parent`, one hop deeper, allowed by the chain's budget.
    Child { parent: Box<MessageRow> },
    /// Beside `of` (a fan-out's later children beside its first): the same chain, parent
    /// and hop.
    Sibling { of: Box<MessageRow> },
}

/// Places a fan-out's later child beside its first, `of` (already in the chain, which the
/// first child's placement checked and charged one hop): the same chain, parent and hop. A
/// fan-out spends one hop however wide it is (at most `FANOUT_CHILDREN_MAX` children), so
/// a chain's budget bounds how many fan-outs it makes, not how wide each is.
pub(super) fn beside(of: &MessageRow) -> Place {
    Place::Sibling {
        of: Box::new(of.clone()),
    }
}

/// The message `from` continues, if any: an explicit parent (which `from` must have sent or
/// received); else none when the send gives a budget (it starts a chain); else the turn the
/// send comes from, else `from`'s active delivery.
pub(super) fn parent_of(tx: &Tx<'_>, from: &str, lineage: &Lineage) -> Result<Option<MessageRow>> {
    if let Some(given) = &lineage.parent {
        if given.is_empty() || given.len() > super::ID_CHARS_MAX {
            return usage(format!(
                "a parent is a message id (or a unique prefix) of 1 to {} characters",
                super::ID_CHARS_MAX
            ));
        }
        let ids = tx.ids_with_prefix(IdTable::Messages, given)?;
        let id = match ids.as_slice() {
            [one] if one == given || given.len() >= super::ID_PREFIX_MIN => one.clone(),
            [] => return Err(ServiceError::NotFound(format!("no message {given:?}"))),
            _ => return usage(format!("{given:?} names more than one message")),
        };
        let m = tx
            .message(&id)?
            .ok_or_else(|| ServiceError::NotFound(format!("no message {given:?}")))?;
        if m.recipient != from && m.sender != from {
            return refused(format!(
                "{from} cannot continue message {id}: it was neither sent to nor by {from}"
            ));
        }
        return Ok(Some(m));
    }
    // A budget starts a chain of its own, unless a parent is named.
    if lineage.budget.is_some() {
        return Ok(None);
    }
    let turn = match &lineage.request_id {
        Some(r) if !r.is_empty() => tx.message_of_turn(from, r)?,
        _ => None,
    };
    let id = match turn {
        Some(m) => Some(m),
        None if lineage.in_turn => tx.message_in_turn(from)?,
        None => None,
    };
    if let Some(id) = id {
        return Ok(tx.message(&id)?);
    }
    session_work(tx, from, lineage.session.as_deref())
}

/// The handoff `agent`'s session took up, if it is still one sent to `agent`.
fn session_work(tx: &Tx<'_>, agent: &str, session: Option<&str>) -> Result<Option<MessageRow>> {
    let Some(id) = session else {
        return Ok(None);
    };
    Ok(tx
        .message(id)?
        .filter(|m| m.recipient == agent && m.intent == "handoff"))
}

/// The chain `parent` belongs to; an older chain without a row gets one now, with the
/// configured limits.
fn chain_of(tx: &Tx<'_>, parent: &MessageRow, now: i64) -> Result<ChainRow> {
    let id = if parent.chain_id.is_empty() {
        parent.id.clone()
    } else {
        parent.chain_id.clone()
    };
    if let Some(c) = tx.chain(&id)? {
        return Ok(c);
    }
    let origin = tx
        .message(&id)?
        .map_or_else(|| parent.sender.clone(), |m| m.sender);
    let c = new_chain(tx, &id, &origin, now)?;
    tx.insert_chain(&c)?;
    Ok(c)
}

fn new_chain(tx: &Tx<'_>, id: &str, origin: &str, now: i64) -> Result<ChainRow> {
    let (hop_budget, depth_limit) = limits(tx)?;
    Ok(ChainRow {
        id: id.to_owned(),
        origin: origin.to_owned(),
        state: ChainState::Open,
        hop_budget,
        hops: 0,
        depth_limit,
        units: model::chain::Budget::default(),
        stopped_reason: None,
        created_at: now,
        updated_at: now,
    })
}

/// A new chain's budget as a send gives it (`hops=N,tokens=N,usd=N`): the hops, and the
/// caller's units with their limits.
pub(super) fn parse_budget(text: &str) -> Result<(Option<i64>, model::chain::Budget)> {
    let amounts = model::chain::parse_amounts(text).map_err(ServiceError::Usage)?;
    let mut hops = None;
    let mut units = Vec::new();
    for (unit, n) in amounts {
        if unit == model::chain::HOPS {
            let whole = n.whole_units();
            if model::chain::Amount::whole(whole) != n || whole > HOP_BUDGET_MAX {
                return usage(format!(
                    "hops={n}: give a whole number of hops from 0 to {HOP_BUDGET_MAX}"
                ));
            }
            hops = Some(whole);
        } else if unit == "depth" {
            return usage("the depth limit is configured (chainDepthLimit), not budgeted");
        } else {
            units.push((unit, n));
        }
    }
    let budget = model::chain::Budget::limited(units.iter().map(|(u, n)| (u.as_str(), *n)));
    Ok((hops, budget))
}

/// The configured hop budget and depth limit of a new chain.
fn limits(tx: &Tx<'_>) -> Result<(i64, i64)> {
    let get = |key: &str, default: i64| -> Result<i64> {
        Ok(tx.config(key)?.and_then(|v| v.as_i64()).unwrap_or(default))
    };
    Ok((
        get("chainHopBudget", super::config::HOP_BUDGET_DEFAULT)?,
        get("chainDepthLimit", super::config::DEPTH_LIMIT_DEFAULT)?,
    ))
}

/// Decides where a send from `from` to `to` goes in its chain, spending its hop. A send past
/// the chain's budget or depth limit stops the chain (`needs_human`) and tells its origin
/// once: `Err(refusal)` to give the sender after this transaction commits.
pub(super) fn place(
    tx: &Tx<'_>,
    (from, to): (&str, &str),
    lineage: &Lineage,
    policy: &model::Policy,
    now: Millis,
) -> Result<std::result::Result<Place, String>> {
    let Some(parent) = parent_of(tx, from, lineage)? else {
        return Ok(Ok(Place::Root));
    };
    if lineage.budget.is_some() {
        return usage(format!(
            "a budget is given by the send that starts a chain, and this send continues \
             chain {}: leave the budget out (a person adds to a stopped chain with `handoffs \
             chain resume`)",
            if parent.chain_id.is_empty() {
                &parent.id
            } else {
                &parent.chain_id
            }
        ));
    }
    let at = millis(now);
    let mut chain = chain_of(tx, &parent, at)?;
    if crate::planted(crate::Plant::ChainUnchecked) {
        chain.hops += 1;
        chain.updated_at = at;
        tx.update_chain(&chain)?;
        return Ok(Ok(Place::Child {
            parent: Box::new(parent),
        }));
    }
    let mut rules = chain.rules();
    let decision = rules.continue_at(parent.hop + 1, policy);
    match decided(tx, &mut chain, &rules, decision, &parent, from, at)? {
        Ok(()) => Ok(Ok(Place::Child {
            parent: Box::new(parent),
        })),
        Err(why) => Ok(Err(format!("{from} → {to}: {why}"))),
    }
}

/// What stopped a chain, from its reason: `depth`, `hops` or the unit spent (what a person
/// adds to lift it, `Stop::lifted_by`).
pub(super) fn stopped_on(reason: &str) -> &str {
    if reason.starts_with("depth") {
        "depth"
    } else if let Some(unit) = reason.strip_prefix("budget ") {
        unit.split('=').next().unwrap_or(model::chain::HOPS)
    } else {
        model::chain::HOPS
    }
}

/// Takes the rules' `decision` for `chain` (already applied to `rules`) into the store: a
/// spend or hop allowed is kept; a stop is kept with one notification to the chain's origin
/// (from `handoffs`, naming `from`, in the chain, below `at_message`); a refusal changes
/// nothing. `Err` is the
/// refusal to give after the transaction commits.
fn decided(
    tx: &Tx<'_>,
    chain: &mut ChainRow,
    rules: &model::chain::Chain,
    decision: model::chain::Decision,
    at_message: &MessageRow,
    from: &str,
    at: i64,
) -> Result<std::result::Result<(), String>> {
    use model::chain::Decision;
    let chain_id = chain.id.clone();
    let resume = |what: &str| format!("`handoffs chain resume {chain_id} --add {what}=N` lifts it");
    match decision {
        Decision::Go => {
            chain.take(rules);
            chain.updated_at = at;
            tx.update_chain(chain)?;
            Ok(Ok(()))
        }
        Decision::Refused(ChainState::Cancelled) => {
            let why = chain.stopped_reason.clone().unwrap_or_default();
            Ok(Err(format!(
                "chain {} was cancelled ({why}): nothing more is sent in it",
                chain.id
            )))
        }
        Decision::Refused(_) => {
            let why = chain.stopped_reason.clone().unwrap_or_default();
            let what = stopped_on(&why);
            Ok(Err(format!(
                "chain {} is stopped ({why}) and waits for a person: {}",
                chain.id,
                resume(what)
            )))
        }
        Decision::Stops(stop) => {
            let reason = stop.to_string();
            chain.take(rules);
            chain.stopped_reason = Some(reason.clone());
            chain.updated_at = at;
            tx.update_chain(chain)?;
            tx.event(
                at,
                Some(&at_message.id),
                "chain",
                &format!("chain {} stopped: {reason}", chain.id),
            )?;
            let resume = resume(stop.lifted_by());
            let body = format!(
                "Chain {} stopped at a send or spend of {from}'s: {reason}. Nothing more is \
                 sent or spent in it until a person looks: {resume}.",
                chain.id
            );
            let note = MessageRow {
                id: crate::clock::new_id(),
                sender: super::SYSTEM_SENDER.to_owned(),
                recipient: chain.origin.clone(),
                body_hash: body_hash(&body),
                body,
                intent: "notification".to_owned(),
                kind: "plain".to_owned(),
                title: Some(format!("chain {} stopped", crate::text::short(&chain.id))),
                work_id: None,
                idem_key: None,
                created_at: at,
                read_at: None,
                chain_id: chain.id.clone(),
                parent_id: Some(at_message.id.clone()),
                hop: at_message.hop + 1,
            };
            tx.insert_message(&note)?;
            Ok(Err(format!(
                "chain {} stopped: {reason}; {} was told, and {resume}",
                chain.id, chain.origin
            )))
        }
    }
}

/// Starts the chain of `message` (its first message): its row, with the configured limits.
pub(super) fn start(tx: &Tx<'_>, message: &MessageRow, budget: Option<&str>) -> Result<()> {
    let mut c = new_chain(tx, &message.id, &message.sender, message.created_at)?;
    if let Some(text) = budget {
        let (hops, units) = parse_budget(text)?;
        c.hop_budget = hops.unwrap_or(c.hop_budget);
        c.units = units;
    }
    Ok(tx.insert_chain(&c)?)
}

/// A chain and its messages, each with its delivery's state.
#[derive(Clone, Debug, Serialize)]
pub struct ChainView {
    pub chain: ChainRow,
    pub messages: Vec<ChainMessage>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ChainMessage {
    #[serde(flatten)]
    pub message: MessageRow,
    pub delivery_state: Option<model::StateKind>,
    /// What its turn spent from the chain's budget, by unit.
    pub spent: std::collections::BTreeMap<String, model::chain::Amount>,
}

impl Service {
    /// Chain `id` (a chain id, or any of its messages' ids or a unique prefix) with its
    /// messages, oldest first.
    pub fn chain_show(&mut self, given: &str) -> Result<ChainView> {
        let id = self.resolve(IdTable::Messages, given)?;
        let now = millis(self.now());
        self.store.write(|tx| {
            let m = tx
                .message(&id)?
                .ok_or_else(|| ServiceError::NotFound(format!("no message {given:?}")))?;
            let chain = chain_of(tx, &m, now)?;
            let mut messages = Vec::new();
            let mut spends = tx.chain_spends(&chain.id)?;
            for message in tx.chain_messages(&chain.id)? {
                let delivery_state = tx.delivery(&message.id)?.map(|d| d.record.kind());
                let spent = spends.remove(&message.id).unwrap_or_default();
                messages.push(ChainMessage {
                    message,
                    delivery_state,
                    spent,
                });
            }
            Ok(ChainView { chain, messages })
        })
    }

    /// The newest chains, stopped ones first.
    pub fn chain_list(&mut self, limit: i64) -> Result<Vec<ChainRow>> {
        if !(1..=10_000).contains(&limit) {
            return usage("the limit must be 1 to 10000");
        }
        self.store.read(|tx| Ok(tx.chains(limit)?))
    }

    /// A person lifts a stopped chain, adding to its hops (`hops=N`), to any unit of its
    /// budget (`tokens=N`) or to its depth limit (`depth=N`); the chain is open again.
    pub fn chain_resume(&mut self, given: &str, add: &str) -> Result<ChainRow> {
        let amounts = model::chain::parse_amounts(add).map_err(|e| {
            ServiceError::Usage(format!("{e} (hops=N, depth=N or a unit of the budget)"))
        })?;
        for (unit, n) in &amounts {
            let whole = n.whole_units();
            let whole_only = unit == model::chain::HOPS || unit == "depth";
            if *n == model::chain::Amount::ZERO
                || whole_only
                    && (model::chain::Amount::whole(whole) != *n || whole > HOP_BUDGET_MAX)
            {
                return usage(format!(
                    "{unit}={n}: give a {}number above 0{}",
                    if whole_only { "whole " } else { "" },
                    if whole_only {
                        format!(", at most {HOP_BUDGET_MAX}")
                    } else {
                        String::new()
                    }
                ));
            }
        }
        let id = self.resolve(IdTable::Messages, given)?;
        let now = millis(self.now());
        self.store.write(|tx| {
            let m = tx
                .message(&id)?
                .ok_or_else(|| ServiceError::NotFound(format!("no message {given:?}")))?;
            let mut chain = chain_of(tx, &m, now)?;
            if chain.state == ChainState::NeedsHuman {
                let on = stopped_on(chain.stopped_reason.as_deref().unwrap_or_default());
                if !amounts.iter().any(|(u, _)| u == on) {
                    return usage(format!(
                        "chain {} stopped on its {on}: a resume must add to it (`--add \
                         {on}=N`), or it would stop again at once",
                        chain.id
                    ));
                }
            }
            let mut rules = chain.rules();
            match rules.resume(&amounts) {
                Err(ChainState::Cancelled) => {
                    return refused(format!(
                        "chain {} was cancelled: it cannot be resumed",
                        chain.id
                    ));
                }
                Err(_) => {
                    return refused(format!(
                        "chain {} is not stopped: nothing to resume",
                        chain.id
                    ));
                }
                Ok(()) => {}
            }
            let was = chain.state;
            chain.take(&rules);
            chain.hop_budget = chain.hop_budget.min(HOP_BUDGET_MAX);
            chain.depth_limit = chain.depth_limit.min(DEPTH_LIMIT_MAX);
            chain.stopped_reason = None;
            chain.updated_at = now;
            tx.update_chain(&chain)?;
            tx.event(
                now,
                Some(&chain.id),
                "chain",
                &format!(
                    "chain {} resumed (was {was}, added {add}): hop budget {}, depth limit {}",
                    chain.id, chain.hop_budget, chain.depth_limit
                ),
            )?;
            Ok(chain)
        })
    }

    /// A turn working in a chain spends from its budget (`tokens=1200,usd=0.05`), all or
    /// nothing, in one transaction. The chain is the one `lineage` names for `agent` (its
    /// turn, or an explicit message of the chain it sent or received). A spend past a limit is
    /// refused and stops the chain in `needs_human`, its origin told once.
    pub fn chain_spend(&mut self, agent: &str, units: &str, lineage: &Lineage) -> Result<Spent> {
        super::check_agent_id(agent)?;
        let ask = model::chain::parse_amounts(units).map_err(ServiceError::Usage)?;
        if ask
            .iter()
            .any(|(u, _)| u == model::chain::HOPS || u == "depth")
        {
            return usage("hops and depth are spent by sends, not by `spend`");
        }
        let now = millis(self.now());
        let policy = self.policy.clone();
        let outcome = self.store.write(|tx| {
            if tx.agent(agent)?.is_none() {
                return Err(ServiceError::NotFound(format!(
                    "unknown agent {agent:?}: no agent of that id is registered"
                )));
            }
            let Some(at) = parent_of(tx, agent, lineage)? else {
                return refused(format!(
                    "{agent} is working in no chain: spend from inside a turn (its MCP server, \
                     or a run's HANDOFFS_REQUEST_ID), or name a message of the chain as the parent"
                ));
            };
            let mut chain = chain_of(tx, &at, now)?;
            if crate::planted(crate::Plant::SpendSplit) {
                // The planted race: the budget read here is decided on after this
                // transaction, while other processes spend from it too.
                return Ok(Err((chain, at)));
            }
            let mut rules = chain.rules();
            let decision = rules.spend(&ask, &policy);
            let done = decided(tx, &mut chain, &rules, decision, &at, agent, now)?;
            if done.is_ok() {
                tx.insert_spend((&chain.id, &at.id, agent), &ask, now)?;
                tx.event(
                    now,
                    Some(&at.id),
                    "spend",
                    &format!("{agent} spent {units} in chain {}", chain.id),
                )?;
            }
            Ok(Ok(done.map(|()| Spent {
                chain: chain.clone(),
                message: at.id.clone(),
            })))
        })?;
        match outcome {
            Ok(done) => done.map_err(ServiceError::Refused),
            Err((chain, at)) => self.spend_split(chain, &at, (agent, &ask), now),
        }
    }

    /// The planted `spend_split`: decides on a budget read in an earlier transaction, after
    /// a pause, and records the spend in a second one.
    fn spend_split(
        &mut self,
        mut chain: ChainRow,
        at: &MessageRow,
        (agent, ask): (&str, &[(String, model::chain::Amount)]),
        now: i64,
    ) -> Result<Spent> {
        std::thread::sleep(std::time::Duration::from_millis(500));
        let policy = self.policy.clone();
        let done = self
            .store
            .write(|tx| -> Result<std::result::Result<(), String>> {
                let mut rules = chain.rules();
                let decision = rules.spend(ask, &policy);
                let done = decided(tx, &mut chain, &rules, decision, at, agent, now)?;
                if done.is_ok() {
                    tx.insert_spend((&chain.id, &at.id, agent), ask, now)?;
                }
                Ok(done)
            })?;
        done.map_err(ServiceError::Refused)?;
        Ok(Spent {
            chain,
            message: at.id.clone(),
        })
    }
}

/// A spend that passed: the chain after it, and the message its turn works on.
#[derive(Clone, Debug, Serialize)]
pub struct Spent {
    pub chain: ChainRow,
    pub message: String,
}

/// What a chain's cancel did.
#[derive(Clone, Debug, Serialize)]
pub struct ChainCancelled {
    pub chain: ChainRow,
    /// Deliveries cancelled before anything was written.
    pub cancelled: Vec<String>,
    /// Deliveries whose turn was under way (or whose write may have landed): left to run,
    /// their later returns recorded as late.
    pub marked: Vec<String>,
    /// Open work closed as cancelled.
    pub closed_work: Vec<String>,
    /// The agents told, once each.
    pub notified: Vec<String>,
}

impl Service {
    /// Cancels chain `given` (a chain id or any of its messages) and everything pending in
    /// it, in one transaction: pending deliveries are CANCELLED (never written), open work is
    /// closed as cancelled, turns under way are marked (not interrupted) so their returns are
    /// recorded as late, and each affected agent (and `by`, the agent cancelling, if any) is
    /// told once. `by`: an agent may cancel only a chain it started.
    pub fn chain_cancel(
        &mut self,
        given: &str,
        by: Option<&str>,
        note: Option<&str>,
    ) -> Result<ChainCancelled> {
        if let Some(n) = note {
            super::check_len("the note", n, super::SUMMARY_CHARS_MAX)?;
        }
        let id = self.resolve(IdTable::Messages, given)?;
        let now = self.now();
        // The service's own policy decides what the cancel does (its planted bug, in tests).
        let own = self.policy.clone();
        // A write in flight is judged by SPEC's sending timeout, as a person's release is.
        let policy = model::Policy::default();
        self.store.write(|tx| {
            let m = tx
                .message(&id)?
                .ok_or_else(|| ServiceError::NotFound(format!("no message {given:?}")))?;
            let mut chain = chain_of(tx, &m, millis(now))?;
            if let Some(agent) = by
                && agent != chain.origin
            {
                return refused(format!(
                    "only the chain's origin ({}) can cancel chain {}",
                    chain.origin, chain.id
                ));
            }
            if chain.state == ChainState::Cancelled {
                return refused(format!("chain {} is already cancelled", chain.id));
            }
            let who = by.unwrap_or("a person");
            let why = format!(
                "chain {} cancelled by {who}{}",
                chain.id,
                note.map(|n| format!(": {n}")).unwrap_or_default()
            );
            let mut rules = chain.rules();
            rules.cancel();
            chain.take(&rules);
            chain.stopped_reason = Some(why.clone());
            chain.updated_at = millis(now);
            tx.update_chain(&chain)?;
            let mut out = ChainCancelled {
                chain: chain.clone(),
                cancelled: Vec::new(),
                marked: Vec::new(),
                closed_work: Vec::new(),
                notified: Vec::new(),
            };
            let mut affected = std::collections::BTreeSet::new();
            let messages = tx.chain_messages(&chain.id)?;
            for msg in &messages {
                cancel_delivery(tx, msg, (&own, &policy), &why, now, &mut out, &mut affected)?;
                close_work(tx, msg, &why, millis(now), &mut out, &mut affected)?;
                super::fanout::on_chain_cancel(tx, &msg.id, millis(now))?;
            }
            if let Some(agent) = by {
                affected.insert(agent.to_owned());
            }
            let root = messages.first().cloned().unwrap_or(m);
            for agent in affected {
                notify(tx, &chain, &root, &agent, &why, &out, millis(now))?;
                out.notified.push(agent);
            }
            tx.event(millis(now), Some(&chain.id), "chain", &why)?;
            Ok(out)
        })
    }
}

/// Cancels a part of a chain, `msgs` (a fan-out's children still unanswered when it is
/// joined), not the chain: each pending delivery is cancelled, a turn under way is marked
/// (its return is recorded late), open work is closed as cancelled, and each recipient
/// affected is told once. Returns the messages whose delivery or work it cancelled.
pub(super) fn cancel_part(
    tx: &Tx<'_>,
    msgs: &[MessageRow],
    own: &model::Policy,
    why: &str,
    now: Millis,
) -> Result<Vec<String>> {
    let Some(first) = msgs.first() else {
        return Ok(Vec::new());
    };
    let policy = model::Policy::default();
    let mut out = ChainCancelled {
        chain: chain_of(tx, first, millis(now))?,
        cancelled: Vec::new(),
        marked: Vec::new(),
        closed_work: Vec::new(),
        notified: Vec::new(),
    };
    let mut affected = std::collections::BTreeSet::new();
    for msg in msgs {
        cancel_delivery(tx, msg, (own, &policy), why, now, &mut out, &mut affected)?;
        close_work(tx, msg, why, millis(now), &mut out, &mut affected)?;
    }
    for msg in msgs {
        if !affected.remove(&msg.recipient) {
            continue;
        }
        let body = format!(
            "{why}: your part, \"{}\" (work {}), is cancelled. A turn under way goes on; \
             what it returns is recorded as late.",
            msg.title.as_deref().unwrap_or(""),
            crate::text::short(&msg.id)
        );
        let note = MessageRow {
            id: crate::clock::new_id(),
            sender: super::SYSTEM_SENDER.to_owned(),
            recipient: msg.recipient.clone(),
            body_hash: body_hash(&body),
            body,
            intent: "notification".to_owned(),
            kind: "plain".to_owned(),
            title: Some(format!("cancelled: {}", msg.title.as_deref().unwrap_or(""))),
            work_id: None,
            idem_key: None,
            created_at: millis(now),
            read_at: None,
            chain_id: msg.chain_id.clone(),
            parent_id: Some(msg.id.clone()),
            hop: msg.hop + 1,
        };
        tx.insert_message(&note)?;
    }
    let mut done: Vec<String> = out.cancelled;
    done.extend(out.marked);
    for w in out.closed_work {
        if !done.contains(&w) {
            done.push(w);
        }
    }
    Ok(done)
}

/// Cancels `msg`'s delivery when nothing of it can have been written yet; marks it when its
/// turn is under way.
fn cancel_delivery(
    tx: &Tx<'_>,
    msg: &MessageRow,
    (own, policy): (&model::Policy, &model::Policy),
    why: &str,
    now: Millis,
    out: &mut ChainCancelled,
    affected: &mut std::collections::BTreeSet<String>,
) -> Result<()> {
    let Some(d) = tx.delivery(&msg.id)? else {
        return Ok(());
    };
    match model::chain::on_cancel(&d.record, own) {
        model::chain::OnCancel::Leave => {}
        model::chain::OnCancel::Release => {
            release_in(tx, &msg.id, policy, why, now, out)?;
            affected.insert(msg.recipient.clone());
        }
        model::chain::OnCancel::Mark => {
            tx.event(
                millis(now),
                Some(&msg.id),
                "chain",
                &format!(
                    "{why}; its turn goes on (request {}), and a return is recorded as late",
                    d.record.core().request_id()
                ),
            )?;
            out.marked.push(msg.id.clone());
            affected.insert(msg.recipient.clone());
        }
    }
    Ok(())
}

fn release_in(
    tx: &Tx<'_>,
    id: &str,
    policy: &model::Policy,
    why: &str,
    now: Millis,
    out: &mut ChainCancelled,
) -> Result<()> {
    let release = model::EventKind::Release {
        note: Some(why.to_owned()),
    };
    let (done, _, _) = super::deliveries::steps_in(
        tx,
        id,
        policy,
        |_| Ok(vec![release]),
        &mut |_, _, _| Ok(None),
        &|_, _, _, _| None,
        now,
        None,
    )?;
    if done.record.kind() == model::StateKind::Cancelled {
        out.cancelled.push(id.to_owned());
    }
    Ok(())
}

/// Closes `msg`'s work as cancelled while it is open.
fn close_work(
    tx: &Tx<'_>,
    msg: &MessageRow,
    why: &str,
    now: i64,
    out: &mut ChainCancelled,
    affected: &mut std::collections::BTreeSet<String>,
) -> Result<()> {
    if msg.kind != "work" {
        return Ok(());
    }
    let Some(mut w) = msg
        .work_id
        .as_deref()
        .map(|id| tx.work(id))
        .transpose()?
        .flatten()
    else {
        return Ok(());
    };
    if !w.state.is_open() {
        return Ok(());
    }
    w.state = model::work::WorkState::Closed;
    w.outcome = Some(CANCELLED.to_owned());
    w.note = Some(why.to_owned());
    w.updated_at = now;
    tx.update_work(&w)?;
    tx.event(
        now,
        Some(&w.id),
        "work",
        &format!("closed as cancelled: {why}"),
    )?;
    out.closed_work.push(w.id.clone());
    affected.insert(w.recipient.clone());
    affected.insert(w.sender.clone());
    Ok(())
}

/// The outcome of work closed by its chain's cancel.
pub const CANCELLED: &str = "cancelled";

/// One notification to `agent` about the cancel (intent `notification`: never a turn).
fn notify(
    tx: &Tx<'_>,
    chain: &ChainRow,
    root: &MessageRow,
    agent: &str,
    why: &str,
    out: &ChainCancelled,
    now: i64,
) -> Result<()> {
    let body = format!(
        "{why}. Cancelled before they were written: {}; turns under way go on, and what they \
         return is recorded as late: {}; work closed as cancelled: {}.",
        list(&out.cancelled),
        list(&out.marked),
        list(&out.closed_work)
    );
    let note = MessageRow {
        id: crate::clock::new_id(),
        sender: super::SYSTEM_SENDER.to_owned(),
        recipient: agent.to_owned(),
        body_hash: body_hash(&body),
        body,
        intent: "notification".to_owned(),
        kind: "plain".to_owned(),
        title: Some(format!("chain {} cancelled", crate::text::short(&chain.id))),
        work_id: None,
        idem_key: None,
        created_at: now,
        read_at: None,
        chain_id: chain.id.clone(),
        parent_id: Some(root.id.clone()),
        hop: root.hop + 1,
    };
    tx.insert_message(&note)?;
    Ok(())
}

fn list(ids: &[String]) -> String {
    if ids.is_empty() {
        return "none".to_owned();
    }
    ids.iter()
        .map(|i| crate::text::short(i))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What woke a waiting agent (SPEC §8.2, one wait): mail, the cancel of the chain of the turn
/// it is working on, or that chain stopped by its budget or depth limit.
#[derive(Clone, Debug, Serialize)]
pub struct Woken {
    /// `message`, `chain_cancelled`, `budget_spent` (the chain stopped on its budget) or
    /// `chain_stopped` (on its depth limit).
    pub woke: &'static str,
    pub messages: Vec<MessageRow>,
    /// The chain of the turn the agent is working on, when that is what woke it.
    pub chain: Option<ChainRow>,
}

impl Service {
    /// One look for a waiting `agent`: its unread messages, and the chain of the turn it is
    /// working on (its active delivery, else the handoff its session took up, `session`)
    /// when that chain was cancelled or stopped at or after `since` (ms: 0 for any time; an
    /// MCP session passes the moment after the last such change it reported, so a wait in
    /// a loop is woken once by each). `None`: nothing yet.
    pub fn wake_look(
        &mut self,
        agent: &str,
        session: Option<&str>,
        since: i64,
    ) -> Result<Option<Woken>> {
        let (turn, chain) =
            self.store
                .read(|tx| -> Result<(Option<String>, Option<ChainRow>)> {
                    let m = match tx.message_in_turn(agent)? {
                        Some(id) => tx.message(&id)?,
                        None => session_work(tx, agent, session)?,
                    };
                    let Some(m) = m else {
                        return Ok((None, None));
                    };
                    let id = m.id.clone();
                    let chain_id = if m.chain_id.is_empty() {
                        m.id
                    } else {
                        m.chain_id
                    };
                    let chain = tx.chain(&chain_id)?.filter(|c| c.updated_at >= since);
                    Ok((Some(id), chain))
                })?;
        // The message the turn is working on is no news.
        let messages: Vec<MessageRow> = self
            .inbox(agent, false, 50)?
            .into_iter()
            .filter(|m| Some(&m.id) != turn.as_ref())
            .collect();
        let woke = match chain.as_ref().map(|c| c.state) {
            Some(ChainState::Cancelled) => "chain_cancelled",
            Some(ChainState::NeedsHuman)
                if chain
                    .as_ref()
                    .and_then(|c| c.stopped_reason.as_deref())
                    .is_some_and(|r| stopped_on(r) != "depth") =>
            {
                "budget_spent"
            }
            Some(ChainState::NeedsHuman) => "chain_stopped",
            _ if !messages.is_empty() => "message",
            _ => return Ok(None),
        };
        let chain = chain.filter(|c| c.state != ChainState::Open);
        Ok(Some(Woken {
            woke,
            messages,
            chain,
        }))
    }
}

impl Service {
    /// The message whose delivery to `agent` made the write `request_id` (a turn's handoff).
    pub fn message_of_turn(&mut self, agent: &str, request_id: &str) -> Result<Option<String>> {
        Ok(self
            .store
            .read(|tx| tx.message_of_turn(agent, request_id))?)
    }

    /// The handoff a turn (`agent`'s write `request_id`) works on, with its chain's hop
    /// budget.
    pub fn turn_handoff(
        &mut self,
        agent: &str,
        request_id: &str,
    ) -> Result<Option<(MessageRow, Option<i64>)>> {
        self.store.read(|tx| {
            let Some(m) = tx
                .message_of_turn(agent, request_id)?
                .map(|id| tx.message(&id))
                .transpose()?
                .flatten()
            else {
                return Ok(None);
            };
            let budget = tx.chain(&m.chain_id)?.map(|c| c.hop_budget);
            Ok(Some((m, budget)))
        })
    }
}
