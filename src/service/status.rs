//! What is going on, decided once for every front: the overview lists, the page's typed
//! snapshot ([`Board`]: agent states, attention reasons, totals, timings), and engine health
//! under one liveness rule ([`engine_health`]). Fronts render these; they decide nothing.

use super::{DeliveryView, Result, Service, enabled_after};
use crate::store::{ChainRow, StoreError, WorkRow, millis};
use model::StateKind;
use serde::Serialize;
use serde_json::Value;
use std::collections::HashMap;

/// An engine that has not reported for this long is taken as not running (an engine
/// reports about once a second while it runs).
pub const ENGINE_QUIET_MS: i64 = 120_000;

/// Whether an engine is delivering, as far as its last report tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum EngineHealth {
    /// A running engine reported within [`ENGINE_QUIET_MS`].
    Running { reported_at: i64 },
    /// The last pass, recent, was a one-shot `tick`: over once it reported.
    OneShot { reported_at: i64 },
    /// The last report is older than [`ENGINE_QUIET_MS`].
    Quiet { reported_at: i64 },
    /// No engine ever reported on this database.
    Never,
}

/// The one liveness rule: the engine whose last report (`at`, the report) is `report` is
/// running at `now` when it reported within [`ENGINE_QUIET_MS`], and not as a one-shot `tick`.
pub fn engine_health(report: Option<(i64, &Value)>, now: i64) -> EngineHealth {
    match report {
        None => EngineHealth::Never,
        Some((at, _)) if now - at > ENGINE_QUIET_MS => EngineHealth::Quiet { reported_at: at },
        Some((at, r)) if r.get("one_shot").and_then(Value::as_bool) == Some(true) => {
            EngineHealth::OneShot { reported_at: at }
        }
        Some((at, _)) => EngineHealth::Running { reported_at: at },
    }
}

impl EngineHealth {
    pub fn alive(self) -> bool {
        matches!(self, EngineHealth::Running { .. })
    }

    pub fn reported_at(self) -> Option<i64> {
        match self {
            EngineHealth::Running { reported_at }
            | EngineHealth::OneShot { reported_at }
            | EngineHealth::Quiet { reported_at } => Some(reported_at),
            EngineHealth::Never => None,
        }
    }

    /// Until when this verdict holds without reading the report again: a running engine
    /// stays running until its report is [`ENGINE_QUIET_MS`] old; any other verdict may change
    /// with the next pass (an engine reports about once a second).
    pub fn holds_until(self, now: i64) -> i64 {
        match self {
            EngineHealth::Running { reported_at } => reported_at + ENGINE_QUIET_MS,
            _ => now + 1_000,
        }
    }

    /// What someone who just sent a handoff should know (None: an engine is delivering).
    pub fn warning(self, now: i64) -> Option<String> {
        match self {
            EngineHealth::Running { .. } => None,
            EngineHealth::OneShot { .. } => Some(
                "the last engine pass was a one-shot `handoffs tick`: the handoff is stored, but nothing is delivered until `handoffs run` (or `serve`, or another `tick`) runs on this database".to_owned(),
            ),
            EngineHealth::Quiet { reported_at } => Some(format!(
                "no engine has reported for {} minutes: the handoff is stored, but nothing is being delivered until `handoffs run` (or `serve`) runs on this database",
                (now - reported_at) / 60_000
            )),
            EngineHealth::Never => Some(
                "no engine has ever run on this database: the handoff is stored, but nothing is delivered until `handoffs run` (or `serve`) runs on it".to_owned(),
            ),
        }
    }
}

/// What `status` shows without an id.
#[derive(Clone, Debug, Serialize)]
pub struct Overview {
    /// Enrolled and waiting for their turn: WAITING and BUSY.
    pub queued: Vec<DeliveryView>,
    pub in_flight: Vec<DeliveryView>,
    pub needs_attention: Vec<DeliveryView>,
    pub overdue_work: Vec<WorkRow>,
    pub recent: Vec<DeliveryView>,
    pub counts: Vec<(String, i64)>,
    pub engine: Option<Value>,
    pub engine_reported_at: Option<i64>,
    /// The engine's health by the one liveness rule, at the overview's time.
    pub engine_health: EngineHealth,
    /// How the reporting engine's timings differ from SPEC §2 (empty: they do not).
    pub engine_policy_differs: Vec<String>,
    /// Deliveries whose stored record cannot be read back, each error naming its row: shown,
    /// never acted on (a person repairs or restores the database).
    pub damaged: Vec<String>,
    /// Which engine serves which recipient now (the leases that have not expired).
    pub leases: Vec<crate::store::LeaseRow>,
    /// Recipients bound to a machine (a `command`, `claude-code` or `codex` agent, served
    /// only by an engine there) with a handoff queued for [`UNSERVED_AFTER_MS`] or more and
    /// no engine holding their lease, while some engine runs: no engine runs on that machine.
    pub unserved: Vec<Unserved>,
}

/// A recipient no engine serves: see [`Overview::unserved`].
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Unserved {
    pub agent: String,
    /// The machine whose engine would serve it.
    pub host: String,
}

/// How long a handoff to a machine-bound recipient waits, with an engine running somewhere
/// and none holding that recipient, before `status` says no engine serves it (an engine on
/// its machine takes it within a pass; a few seconds leave room for a slow one).
pub const UNSERVED_AFTER_MS: i64 = 10_000;

/// A handoff sent but not yet enrolled by an engine: who to whom, and how it begins.
#[derive(Clone, Debug, Serialize)]
pub struct Unenrolled {
    pub id: String,
    pub from: String,
    pub to: String,
    pub title: Option<String>,
    /// The message's first 120 characters, on one line.
    pub preview: String,
    pub created_at: i64,
}

/// What an agent is doing, as the page shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentActivity {
    /// A delivery to it could not reach it.
    Unreachable,
    /// A delivery to it is held (a blocked connection, delivery paused).
    Held,
    /// A delivery to it is being written or worked on.
    Busy,
    Idle,
}

/// One agent on the page.
#[derive(Clone, Debug, Serialize)]
pub struct AgentState {
    pub id: String,
    pub name: String,
    pub provider: String,
    pub in_flight: i64,
    pub open_work: i64,
    pub state: AgentActivity,
}

/// Something a person should look at, with the reason in plain words.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Attention {
    Delivery {
        view: DeliveryView,
        reason: String,
    },
    Overdue {
        work: WorkRow,
        reason: String,
    },
    /// A chain stopped by its hop budget or depth limit (SPEC §8.2).
    Chain {
        chain: ChainRow,
        reason: String,
    },
}

/// Totals over everything, not just the listed newest.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Totals {
    /// WAITING, BUSY, SENDING, ACCEPTED and RUNNING deliveries.
    pub in_flight: i64,
    /// Deliveries needing a look, and overdue work.
    pub needs_attention: i64,
    pub open_work: i64,
    pub overdue: i64,
    /// Writes into recipients' sessions, over all deliveries.
    pub attempts: i64,
    /// Bounded resends (after an error or an interrupted turn).
    pub resends: i64,
}

/// How long work takes, oldest sample first, over all work.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Timings {
    pub send_to_accept_ms: Vec<i64>,
    pub accept_to_return_ms: Vec<i64>,
}

/// Open work, with whether it is overdue.
#[derive(Clone, Debug, Serialize)]
pub struct OpenWork {
    #[serde(flatten)]
    pub work: WorkRow,
    pub overdue: bool,
}

/// The page's snapshot, decided here from three short reads (the overview, the agents, and
/// the counts, work and timings in one transaction).
#[derive(Clone, Debug, Serialize)]
pub struct Board {
    pub generated_at: i64,
    pub overview: Overview,
    pub agents: Vec<AgentState>,
    pub attention: Vec<Attention>,
    pub open_work: Vec<OpenWork>,
    pub totals: Totals,
    pub timings: Timings,
    /// Each listed delivery's message, on one line (by message id).
    pub previews: HashMap<String, String>,
    pub last_event_seq: i64,
    /// Open dead letters by reason, and the newest of them.
    pub dead_counts: Vec<(String, i64)>,
    pub dead_letters: Vec<crate::store::DeadLetterRow>,
    /// The chains in flight (SPEC §8.2): those stopped for a person, then those of the
    /// deliveries on their way, each once, at most `CHAINS_SHOWN`.
    pub chains: Vec<ChainInFlight>,
    /// The broadcast topics (SPEC §8.2), and how many posts they have had in all.
    pub topics: Vec<super::topics::TopicView>,
    pub publishes: i64,
    /// The fan-outs waiting for their join (SPEC §8.2), the newest first, at most 20.
    pub fanouts: Vec<super::fanout::FanoutView>,
    /// How many fan-outs were joined complete, and how many partial, in all.
    pub joins: (i64, i64),
}

/// A chain in flight, with what its first message asked (its title, or its body on one line).
#[derive(Clone, Debug, Serialize)]
pub struct ChainInFlight {
    pub chain: ChainRow,
    pub first: String,
}

/// How many chains in flight the page lists.
pub const CHAINS_SHOWN: usize = 20;

/// The chains in flight: the stopped ones first, then the chains of the deliveries on their
/// way or queued (the overview's lists, newest first), each once.
fn chains_in_flight(
    tx: &crate::store::Tx<'_>,
    overview: &Overview,
    stopped: &[ChainRow],
) -> std::result::Result<Vec<ChainInFlight>, StoreError> {
    let mut seen = std::collections::HashSet::new();
    let mut out: Vec<ChainRow> = Vec::new();
    for c in stopped {
        if out.len() < CHAINS_SHOWN && seen.insert(c.id.clone()) {
            out.push(c.clone());
        }
    }
    for d in overview.in_flight.iter().chain(&overview.queued) {
        if out.len() >= CHAINS_SHOWN {
            break;
        }
        if let Some(c) = tx.chain_of_message(&d.id)?
            && seen.insert(c.id.clone())
        {
            out.push(c);
        }
    }
    out.into_iter()
        .map(|chain| {
            let first = tx.message(&chain.id)?.map_or_else(String::new, |m| {
                m.title
                    .unwrap_or_else(|| crate::text::one_line(&m.body, 140))
            });
            Ok(ChainInFlight { chain, first })
        })
        .collect()
}

/// Why a person should look at a delivery, in plain words.
pub fn attention_reason(d: &DeliveryView) -> String {
    match d.state {
        StateKind::Uncertain => format!(
            "Nobody can tell whether this reached {}; it will not be resent on its own. Check \
             their session, then release it (`handoffs release {}`).",
            d.to,
            crate::text::short(&d.id)
        ),
        StateKind::Unavailable => format!("{} could not be reached; it will be retried.", d.to),
        StateKind::Held => format!(
            "Held: the connection {} → {} is blocked, or delivery is paused.",
            d.from, d.to
        ),
        StateKind::OwnerRejected => format!("{} refused the turn.", d.to),
        _ => format!("{} needs a look.", d.state.as_str()),
    }
}

fn overdue_reason(w: &WorkRow, now: i64) -> String {
    let late = (now - w.due_at.unwrap_or(now)) / 60_000;
    let since = if late < 1 {
        "is now overdue".to_owned()
    } else {
        format!("was due {late} min ago")
    };
    format!(
        "Work \"{}\" for {} {since} and is still {}.",
        w.title, w.recipient, w.state
    )
}

/// The middle sample (None: no samples).
pub fn median(samples: &[i64]) -> Option<i64> {
    let mut v = samples.to_vec();
    v.sort_unstable();
    v.get(v.len() / 2).copied()
}

impl Service {
    pub fn overview(&mut self, limit: i64) -> Result<Overview> {
        use StateKind::{
            Accepted, Acknowledged, Busy, Cancelled, Duplicate, Failed, Held, OwnerRejected,
            Returned, Running, Sending, Unavailable, Uncertain, Waiting,
        };
        let now = millis(self.now());
        self.store.read(|tx| {
            let damaged = std::cell::RefCell::new(Vec::new());
            let views = |states: &[StateKind]| -> Result<Vec<DeliveryView>, StoreError> {
                let (rows, bad) = tx.deliveries_or_damaged_in(states, limit)?;
                damaged
                    .borrow_mut()
                    .extend(bad.into_iter().map(|e| e.to_string()));
                rows.iter().map(|d| Self::view(tx, d)).collect()
            };
            let report = tx.report()?;
            let mut leases = tx.leases()?;
            leases.retain(|l| l.expires_at > now);
            let queued = views(&[Waiting, Busy])?;
            let health = engine_health(report.as_ref().map(|(at, r)| (*at, r)), now);
            let mut unserved: Vec<Unserved> = Vec::new();
            for d in queued.iter().filter(|d| {
                health.alive()
                    && d.state == Waiting
                    && now - d.updated_at >= UNSERVED_AFTER_MS
                    && !leases.iter().any(|l| l.agent == d.to)
            }) {
                if unserved.iter().any(|u| u.agent == d.to) {
                    continue;
                }
                if let Some(host) = tx.agent(&d.to)?.and_then(|a| a.host) {
                    unserved.push(Unserved {
                        agent: d.to.clone(),
                        host,
                    });
                }
            }
            Ok(Overview {
                leases,
                unserved,
                queued,
                in_flight: views(&[Sending, Accepted, Running])?,
                needs_attention: views(&[Uncertain, Unavailable, Held, OwnerRejected])?,
                // The newest overdue work; the totals are the board's.
                overdue_work: tx.newest_open_work(Some(now), limit)?,
                recent: views(&[Returned, Failed, Acknowledged, Cancelled, Duplicate])?,
                counts: tx.count_by_state()?,
                engine_reported_at: report.as_ref().map(|r| r.0),
                engine_health: health,
                engine_policy_differs: report
                    .as_ref()
                    .and_then(|r| r.1.get("policy_differs"))
                    .and_then(Value::as_array)
                    .map(|a| {
                        a.iter()
                            .filter_map(Value::as_str)
                            .map(str::to_owned)
                            .collect()
                    })
                    .unwrap_or_default(),
                engine: report.map(|r| r.1),
                damaged: damaged.take(),
            })
        })
    }

    /// The engine's health now, by the one liveness rule.
    pub fn engine_health(&mut self) -> Result<EngineHealth> {
        let now = millis(self.now());
        let report = self.store.read(|tx| -> Result<_> { Ok(tx.report()?) })?;
        Ok(engine_health(report.as_ref().map(|(at, r)| (*at, r)), now))
    }

    /// The page's snapshot: the overview with `limit` per list, every agent's state, what
    /// needs attention and why, open work, totals and timings.
    pub fn board(&mut self, limit: i64) -> Result<Board> {
        use StateKind::{
            Accepted, Busy, Held, OwnerRejected, Running, Sending, Unavailable, Uncertain, Waiting,
        };
        let now = millis(self.now());
        let overview = self.overview(limit)?;
        let agents = self.agents()?;
        self.store.read(|tx| {
            let busy = tx.count_by_recipient(&[Sending, Accepted, Running])?;
            let unreachable = tx.count_by_recipient(&[Unavailable])?;
            let held = tx.count_by_recipient(&[Held])?;
            let (open_total, overdue_total, open_by_agent) = tx.work_counts(now)?;
            let (stopped, stopped_total) = tx.stopped_chains(20)?;
            let dead_counts = tx.dead_letter_counts()?;
            let dead_letters = tx.dead_letters(false, 20)?;
            let topics = super::topics::views(tx, now)?;
            let publishes = tx.publish_count()?;
            let fanouts = super::fanout::waiting(tx, 20)?;
            let joins = tx.fanout_joins()?;
            let chains = chains_in_flight(tx, &overview, &stopped)?;
            let open_work = tx.newest_open_work(None, 100)?;
            // Every piece of work: the metrics' histograms count all of it (so they only
            // grow), the page's chart shows the newest.
            let work_times = tx.work_timings(i64::MAX)?;
            let (attempts, resends) = tx.delivery_totals()?;
            let last_event_seq = tx.last_event_seq()?;
            let mut previews = HashMap::new();
            for d in overview
                .in_flight
                .iter()
                .chain(&overview.queued)
                .chain(&overview.needs_attention)
                .chain(&overview.recent)
            {
                if let Some(m) = tx.message(&d.id)? {
                    previews.insert(d.id.clone(), crate::text::one_line(&m.body, 140));
                }
            }
            let of = |list: &[(String, i64)], id: &str| {
                list.iter().find(|(r, _)| r == id).map_or(0, |(_, n)| *n)
            };
            let agents = agents
                .iter()
                .map(|a| {
                    let in_flight = of(&busy, &a.id);
                    AgentState {
                        id: a.id.clone(),
                        name: a.name.clone(),
                        provider: a.provider.clone(),
                        in_flight,
                        open_work: of(&open_by_agent, &a.id),
                        state: if of(&unreachable, &a.id) > 0 {
                            AgentActivity::Unreachable
                        } else if of(&held, &a.id) > 0 {
                            AgentActivity::Held
                        } else if in_flight > 0 {
                            AgentActivity::Busy
                        } else {
                            AgentActivity::Idle
                        },
                    }
                })
                .collect();
            let mut attention: Vec<Attention> = overview
                .needs_attention
                .iter()
                .map(|d| Attention::Delivery {
                    reason: attention_reason(d),
                    view: d.clone(),
                })
                .collect();
            attention.extend(overview.overdue_work.iter().map(|w| Attention::Overdue {
                reason: overdue_reason(w, now),
                work: w.clone(),
            }));
            attention.extend(stopped.into_iter().map(|c| {
                let why = c.stopped_reason.as_deref().unwrap_or("stopped");
                let add = super::chains::stopped_on(why);
                Attention::Chain {
                    reason: format!(
                        "Chain {} from {} stopped: {why}. Nothing more is sent in it until you \
                         look (`handoffs chain show {}`; `handoffs chain resume {} --add {add}=N` \
                         lifts it).",
                        crate::text::short(&c.id),
                        c.origin,
                        crate::text::short(&c.id),
                        crate::text::short(&c.id),
                    ),
                    chain: c,
                }
            }));
            let mut timings = Timings::default();
            // Oldest first, so the newest samples are last.
            for (sent, accepted, returned) in work_times.iter().rev() {
                if let Some(a) = accepted {
                    timings.send_to_accept_ms.push(a - sent);
                    if let Some(r) = returned {
                        timings.accept_to_return_ms.push(r - a);
                    }
                }
            }
            let count_of = |states: &[StateKind]| -> i64 {
                overview
                    .counts
                    .iter()
                    .filter(|(k, _)| states.iter().any(|s| s.as_str() == k))
                    .map(|(_, n)| n)
                    .sum()
            };
            let totals = Totals {
                in_flight: count_of(&[Waiting, Busy, Sending, Accepted, Running]),
                needs_attention: count_of(&[Uncertain, Unavailable, Held, OwnerRejected])
                    + overdue_total
                    + stopped_total,
                open_work: open_total,
                overdue: overdue_total,
                attempts,
                resends,
            };
            let open_work = open_work
                .into_iter()
                .map(|w| OpenWork {
                    overdue: w.due_at.is_some_and(|d| d <= now) && w.state.is_open(),
                    work: w,
                })
                .collect();
            Ok(Board {
                generated_at: now,
                agents,
                attention,
                open_work,
                totals,
                timings,
                previews,
                last_event_seq,
                overview,
                dead_counts,
                dead_letters,
                chains,
                topics,
                publishes,
                fanouts,
                joins,
            })
        })
    }

    /// Handoffs no engine has taken up yet: sent before their recipient was registered (or
    /// could be routed), waiting for an engine's pass to enrol them. Not part of the
    /// overview: it reads the messages table, which the page rebuilds too often to afford.
    pub fn waiting_for_engine(&mut self, limit: i64) -> Result<Vec<Unenrolled>> {
        self.store.read(|tx| {
            Ok(tx
                .unenrolled(enabled_after(tx)?, limit)?
                .into_iter()
                .map(|m| Unenrolled {
                    preview: crate::text::one_line(&m.body, 120),
                    id: m.id,
                    from: m.sender,
                    to: m.recipient,
                    title: m.title,
                    created_at: m.created_at,
                })
                .collect())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn engine_health_is_one_rule() {
        let running = json!({});
        let tick = json!({"one_shot": true});
        assert_eq!(engine_health(None, 5), EngineHealth::Never);
        assert_eq!(
            engine_health(Some((0, &running)), ENGINE_QUIET_MS),
            EngineHealth::Running { reported_at: 0 }
        );
        assert_eq!(
            engine_health(Some((0, &running)), ENGINE_QUIET_MS + 1),
            EngineHealth::Quiet { reported_at: 0 }
        );
        assert_eq!(
            engine_health(Some((0, &tick)), 1),
            EngineHealth::OneShot { reported_at: 0 }
        );
        assert!(!EngineHealth::OneShot { reported_at: 0 }.alive());
        assert!(
            EngineHealth::Running { reported_at: 0 }
                .warning(1)
                .is_none()
        );
        assert!(EngineHealth::Never.warning(1).is_some());
        assert_eq!(median(&[5, 1, 3]), Some(3));
        assert_eq!(median(&[]), None);
    }
}
