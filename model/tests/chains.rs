//! Model checking chains (SPEC §8.2): a chain whose turns continue it, spend from its budget,
//! fail and are resent, while a person cancels it or resumes it, explored exhaustively by
//! stateright over small bounds. The world decides by the same functions the service and the
//! engine call (`model::chain`: `Chain::continue_at`, `Chain::spend`, `Chain::resume`,
//! `Chain::cancel`, `Chain::may_write`, `on_cancel`) and moves each delivery through real
//! records (`table::sample_records`), releasing them with the real `step`. The properties:
//! no chain spends beyond its budget, no delivery is written after its chain was cancelled, a
//! cancel reaches every descendant, the depth limit holds, and a stopped chain's origin is
//! told once per stop. A broken rule (a planted bug) must be caught with its property's name.

use model::chain::{Amount, Chain, ChainState, Decision, HOPS, OnCancel, Stop, on_cancel};
use model::{Delivery, EventKind, PlantedBug, Policy, StateKind};
use stateright::{Checker, HasDiscoveries, Model, Property};
use std::collections::BTreeSet;

/// A real record in each stage a chain's delivery goes through.
fn record(stage: &str) -> Delivery {
    model::table::sample_records()
        .into_iter()
        .find(|(name, _)| *name == stage)
        .unwrap_or_else(|| panic!("no sample record {stage:?}"))
        .1
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Msg {
    depth: i64,
    record: Delivery,
    /// Its turn was under way at the cancel: its return is recorded as late.
    marked: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    chain: Chain,
    msgs: Vec<Msg>,
    /// Notifications to the chain's origin that it stopped.
    told: u8,
    resumes: u8,
    cancels_left: u8,
    /// Ghost: a write handed over while its chain was cancelled.
    written_after_cancel: bool,
    /// Ghost: what stopped the chain, each time (for the reachability properties).
    stopped_by: BTreeSet<String>,
    /// Ghost: what a cancel did.
    released: bool,
    released_failed: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Action {
    /// The engine reserves a queued delivery (or releases it, its chain cancelled).
    Reserve(usize),
    /// The engine hands the reserved write over.
    Write(usize),
    /// The recipient's turn starts.
    Start(usize),
    /// The turn errors: FAILED, a resend planned.
    Error(usize),
    /// The planned resend is queued again (or released, its chain cancelled).
    Requeue(usize),
    /// The turn returns.
    Return(usize),
    /// The running turn of message `0` sends a continuation.
    Send(usize),
    /// The running turn spends `1` tokens.
    Spend(usize, i64),
    Cancel,
    /// A person adds one of a unit (hops, tokens or depth).
    Resume(&'static str),
}

struct World {
    policy: Policy,
    hops: i64,
    tokens: i64,
    depth_limit: i64,
    max_msgs: usize,
    max_resumes: u8,
}

fn stage(d: &Delivery) -> StateKind {
    d.kind()
}

fn is_written(d: &Delivery) -> bool {
    matches!(d, Delivery::Sending(s) if s.write_issued())
}

impl World {
    fn release(&self, d: &Delivery) -> Delivery {
        let release = EventKind::Release {
            note: Some("its chain was cancelled".to_owned()),
        };
        let now = d.core().since().plus_ms(1);
        model::step(d.clone(), model::Event::new(now, release), &self.policy).record
    }

    fn decided(s: &mut State, d: &Decision) {
        if let Decision::Stops(why) = d {
            s.told += 1;
            s.stopped_by.insert(
                match why {
                    Stop::Depth { .. } => "depth",
                    Stop::Budget(e) if e.unit == HOPS => "hops",
                    Stop::Budget(_) => "tokens",
                }
                .to_owned(),
            );
        }
    }
}

impl Model for World {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let units = [("tokens".to_owned(), Amount::whole(self.tokens))];
        vec![State {
            chain: Chain::new(self.hops, &units, self.depth_limit),
            msgs: vec![Msg {
                depth: 0,
                record: record("queued"),
                marked: false,
            }],
            told: 0,
            resumes: 0,
            cancels_left: 1,
            written_after_cancel: false,
            stopped_by: BTreeSet::new(),
            released: false,
            released_failed: false,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        for (i, m) in s.msgs.iter().enumerate() {
            match stage(&m.record) {
                StateKind::Waiting => actions.push(Action::Reserve(i)),
                StateKind::Sending if is_written(&m.record) => {
                    actions.push(Action::Start(i));
                    actions.push(Action::Error(i));
                }
                StateKind::Sending => actions.push(Action::Write(i)),
                StateKind::Failed if !m.record.is_settled() => actions.push(Action::Requeue(i)),
                StateKind::Running => {
                    actions.push(Action::Return(i));
                    if s.msgs.len() < self.max_msgs {
                        actions.push(Action::Send(i));
                    }
                    for n in [1, 2] {
                        actions.push(Action::Spend(i, n));
                    }
                }
                _ => {}
            }
        }
        if s.cancels_left > 0 {
            actions.push(Action::Cancel);
        }
        if s.resumes < self.max_resumes && s.chain.state == ChainState::NeedsHuman {
            for unit in [HOPS, "tokens", "depth"] {
                actions.push(Action::Resume(unit));
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        let p = &self.policy;
        match action {
            Action::Reserve(i) | Action::Requeue(i) if !s.chain.may_write(p) => {
                // The engine's pass releases a delivery of a cancelled chain.
                s.msgs[i].record = self.release(&s.msgs[i].record);
            }
            Action::Reserve(i) => s.msgs[i].record = record("reserved"),
            Action::Requeue(i) => s.msgs[i].record = record("resend queued"),
            Action::Write(i) => {
                if s.chain.state == ChainState::Cancelled {
                    s.written_after_cancel = true;
                }
                s.msgs[i].record = record("written");
            }
            Action::Start(i) => s.msgs[i].record = record("running"),
            Action::Error(i) => s.msgs[i].record = record("errored, resend due"),
            Action::Return(i) => s.msgs[i].record = record("returned"),
            Action::Send(i) => {
                let depth = s.msgs[i].depth + 1;
                let d = s.chain.continue_at(depth, p);
                World::decided(&mut s, &d);
                if d == Decision::Go {
                    s.msgs.push(Msg {
                        depth,
                        record: record("queued"),
                        marked: false,
                    });
                }
            }
            Action::Spend(_, n) => {
                let d = s.chain.spend(&[("tokens".to_owned(), Amount::whole(n))], p);
                World::decided(&mut s, &d);
                if matches!(d, Decision::Refused(_)) && last.chain == s.chain {
                    return None;
                }
            }
            Action::Cancel => {
                s.cancels_left -= 1;
                s.chain.cancel();
                for m in &mut s.msgs {
                    match on_cancel(&m.record, p) {
                        OnCancel::Release => {
                            s.released = true;
                            s.released_failed |= m.record.kind() == StateKind::Failed;
                            m.record = self.release(&m.record);
                        }
                        OnCancel::Mark => m.marked = true,
                        OnCancel::Leave => {}
                    }
                }
            }
            Action::Resume(unit) => {
                s.chain
                    .resume(&[(unit.to_owned(), Amount::whole(1))])
                    .ok()?;
                s.resumes += 1;
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("no chain spends beyond its budget", |_, s: &State| {
                s.chain
                    .budget
                    .lines
                    .values()
                    .all(|l| l.limit.is_none_or(|limit| l.spent <= limit))
            }),
            Property::always(
                "no delivery is written after its chain was cancelled",
                |_, s: &State| !s.written_after_cancel,
            ),
            Property::always("a cancel reaches every descendant", |_, s: &State| {
                s.chain.state != ChainState::Cancelled
                    || s.msgs.iter().all(|m| m.record.is_settled() || m.marked)
            }),
            Property::always("the depth limit holds", |_, s: &State| {
                s.msgs.iter().all(|m| m.depth <= s.chain.depth_limit)
            }),
            Property::always(
                "a stopped chain's origin is told once per stop",
                |_, s: &State| {
                    let stopped = u8::from(s.chain.state == ChainState::NeedsHuman);
                    // A cancel may end a stopped chain: its stop was told.
                    s.told == s.resumes + stopped
                        || s.chain.state == ChainState::Cancelled && s.told >= s.resumes
                },
            ),
            Property::sometimes("a hop past the budget stops the chain", |_, s: &State| {
                s.stopped_by.contains(HOPS)
            }),
            Property::sometimes("a spend past the budget stops the chain", |_, s: &State| {
                s.stopped_by.contains("tokens")
            }),
            Property::sometimes("the depth limit stops the chain", |_, s: &State| {
                s.stopped_by.contains("depth")
            }),
            Property::sometimes("a resumed chain goes on", |_, s: &State| {
                s.resumes > 0 && s.msgs.len() == 4
            }),
            Property::sometimes("a cancel marks a turn under way", |_, s: &State| {
                s.msgs.iter().any(|m| m.marked)
            }),
            Property::sometimes("a cancel releases a pending delivery", |_, s: &State| {
                s.released
            }),
            Property::sometimes(
                "a cancel releases a FAILED delivery whose resend was planned",
                |_, s: &State| s.released_failed,
            ),
        ]
    }
}

fn world(policy: Policy) -> World {
    World {
        policy,
        hops: 2,
        tokens: 3,
        depth_limit: 2,
        max_msgs: 4,
        max_resumes: 1,
    }
}

#[test]
fn chains_keep_their_budget_depth_and_cancel() {
    let started = std::time::Instant::now();
    let checker = world(Policy::default())
        .checker()
        .threads(1)
        .spawn_bfs()
        .join();
    let unique = checker.unique_state_count();
    eprintln!(
        "model chains: {unique} unique states, depth {}, {:.1?}",
        checker.max_depth(),
        started.elapsed()
    );
    checker.assert_properties();
    assert_eq!(
        unique, 110_737,
        "the chains model's state count changed: update the pinned count if the change is intended"
    );
}

/// The checker finds a counterexample to `property` under the planted `bug`.
fn caught(bug: PlantedBug, property: &'static str) {
    let policy = Policy {
        planted_bug: Some(bug),
        ..Policy::default()
    };
    let checker = world(policy)
        .checker()
        .threads(1)
        .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([property])))
        .spawn_bfs()
        .join();
    let path = checker
        .discovery(property)
        .unwrap_or_else(|| panic!("the checker did not catch {bug:?}: {property} held"));
    eprintln!("{property} fails under {bug:?}:\n{path}");
}

#[test]
fn a_spend_checked_before_it_is_added_is_caught() {
    caught(
        PlantedBug::SpendPastBudget,
        "no chain spends beyond its budget",
    );
}

#[test]
fn a_pass_that_forgets_the_cancel_of_a_waiting_again_delivery_is_caught() {
    caught(
        PlantedBug::RequeueAfterCancel,
        "no delivery is written after its chain was cancelled",
    );
}

#[test]
fn a_cancel_that_lets_a_reserved_write_go_out_is_caught() {
    caught(
        PlantedBug::CancelMarksReserved,
        "no delivery is written after its chain was cancelled",
    );
}

#[test]
fn a_cancel_that_leaves_pending_deliveries_is_caught() {
    caught(
        PlantedBug::CancelLeavesPending,
        "a cancel reaches every descendant",
    );
    caught(
        PlantedBug::CancelLeavesPending,
        "no delivery is written after its chain was cancelled",
    );
}
