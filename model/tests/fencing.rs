//! Model checking fencing across engines (issue 17): two engines share one database and serve
//! one recipient under its lease, explored exhaustively by stateright over small bounds while
//! time passes, engines stall (any interleaving: an engine may sit still while the clock runs
//! past its lease), crash and start again as a new engine, and lose their server session
//! while they go on. The world decides by the same rules the store and the service apply
//! (`model::lease`: `take`, `renew`, `hold`, `is_holder`, `deadline`, `may_write`); the
//! deliveries are abstracted to the stages that matter across engines (queued, reserved with
//! its write issued, UNCERTAIN after the sending timeout, released as not landed after a
//! history scan that found nothing, accepted), and the recipient records every write that
//! reaches it, with the lease in the database at that moment.
//!
//! An engine fenced at its write wrote nothing and says so (`WriteOutcome::Withheld`, a
//! transaction that needs no lease): the delivery goes back to the queue when it is still the
//! reservation that engine made (its token), and stays as it is otherwise (UNCERTAIN after
//! the sending timeout, released after a scan).
//!
//! The properties: a step commits only under the lease of the engine that takes it; a write
//! reaches the recipient only under the lease its reservation was made under (fencing); no
//! write reaches a turn that is running (G3 across engines); no write reaches the recipient
//! after its delivery was released as never written (an honest release); nothing goes back to
//! the queue from UNCERTAIN or a release (G4); no handoff reaches the recipient twice (G2); and,
//! reachable, a withheld write reaches the recipient through the other engine. Each check of
//! the product removed (a planted bug of this world) must be caught with its property's name.
//!
//! Clocks: in one world they agree; in another, one engine's runs 2 s ahead (past the lease's
//! margin), so it takes leases early: the properties still hold, by the read of the lease
//! before each write. Assumed, not explored: an engine's last check and its write are one
//! step. The moment between them is the one window fencing leaves open (docs/DEPLOY.md): a
//! stall past the lease there, or a cut session or a clock behind in exactly that moment,
//! lets a write leave under a lease that just moved. The check compares the token the
//! delivery's reservation was made under, as the product's does.

use model::Millis;
use model::lease::{self, Lease};
use stateright::{Checker, HasDiscoveries, Model, Property};
use std::collections::BTreeSet;

/// One tick of the world's clock.
const TICK_MS: u64 = 1_000;
/// The lease: 4 s (an engine's own deadline is 3.2 s after it took or extended it).
const LEASE_MS: u64 = 4_000;
/// A reserved write with no receipt after this long is UNCERTAIN (`sending_timeout_ms`).
const SENDING_TIMEOUT_MS: u64 = 5_000;

/// An engine: its slot (a machine) and its incarnation (a crashed engine starts again as
/// another engine, with another id).
type EngineId = (u8, u8);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Stage {
    Queued,
    /// Reserved under `fence` by `by` at `since`, its write issued.
    Sending {
        by: EngineId,
        fence: i64,
        since: u64,
    },
    Uncertain,
    /// Released after a history scan found nothing: said to have never been written.
    Released,
    Accepted,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Job {
    Idle,
    /// Holding the issued write of message `msg`, reserved under `fence`.
    Issued {
        msg: usize,
        fence: i64,
    },
    /// Its write reached the recipient; the receipt is not committed yet.
    Written {
        msg: usize,
    },
    /// Fenced at its write of `msg` (reserved under `fence`), it wrote nothing and is about
    /// to say so (`WriteOutcome::Withheld`, a transaction that needs no lease).
    Withholding {
        msg: usize,
        fence: i64,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Engine {
    incarnation: u8,
    /// The lease this engine believes it holds: its token and its own deadline.
    held: Option<(i64, Millis)>,
    job: Job,
    /// Its server session is open (a cut one opens anew at its next statement).
    connected: bool,
    /// Which session it is on (the lease names the session of its holder's last statement).
    session: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    now: Millis,
    lease: Option<Lease<EngineId>>,
    /// The holder's session as the lease names it: (slot, session).
    lease_session: (u8, u8),
    engines: [Engine; 2],
    stages: [Stage; 2],
    /// The message whose turn runs in the recipient's session.
    turn: Option<usize>,
    crashes_left: u8,
    cuts_left: u8,
    /// Ghosts: a step committed by an engine that no longer held the lease; and, set when a
    /// write reaches the recipient, what was wrong with it.
    stale_step: bool,
    stale_write: bool,
    into_running_turn: bool,
    after_release: bool,
    /// A handoff reached the recipient a second time.
    twice: bool,
    /// A delivery went back to the queue from UNCERTAIN or after its release.
    requeued_from_uncertain: bool,
    /// Ghosts for the reachability properties.
    passed_while_issued: bool,
    fenced_at_write: bool,
    fenced_at_step: bool,
    resumed_own_lease: bool,
    landed: BTreeSet<usize>,
    /// Messages a fenced engine withheld (backed out, nothing written).
    withheld: BTreeSet<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Action {
    Tick,
    Take(usize),
    Renew(usize),
    Reserve(usize, usize),
    Write(usize),
    Confirm(usize),
    Expire(usize, usize),
    Scan(usize, usize),
    Finish,
    Crash(usize),
    /// The engine's server session is cut (a network fault, a server restart); the engine
    /// goes on, unaware until its next statement.
    CutSession(usize),
    /// A fenced engine records that its write was withheld.
    Withhold(usize),
}

/// A check of the product removed, to show that the properties catch it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plant {
    /// A step commits without checking the lease in its transaction (`no_step_fence`).
    NoStepFence,
    /// A write goes out without any check of the lease (`no_write_fence`).
    NoWriteFence,
    /// The write checks only the engine's own deadline, not the lease in the database (the
    /// product before the database check: a cut session let another engine take over at
    /// once while the first still wrote by its own clock).
    WriteCheckLocalOnly,
    /// The withheld write is recorded without checking that the delivery is still the
    /// reservation the fenced engine made (a world plant only): it backs out whatever the
    /// delivery became meanwhile.
    NoWithholdCheck,
    /// The engine says it withheld a write that went out (a world plant only: a write whose
    /// reply was lost taken for one never sent).
    WithholdAfterWrite,
}

struct World {
    horizon_ms: u64,
    plant: Option<Plant>,
    /// How far engine 1's clock runs ahead of engine 0's.
    skew_ms: u64,
    /// Sessions that may be cut.
    cuts: u8,
}

impl World {
    /// Engine `e`'s clock: the world's, and engine 1's ahead by the skew.
    fn clock(&self, s: &State, e: usize) -> Millis {
        if e == 1 {
            s.now.plus_ms(self.skew_ms)
        } else {
            s.now
        }
    }

    fn id(s: &State, e: usize) -> EngineId {
        (
            u8::try_from(e).expect("two engines"),
            s.engines[e].incarnation,
        )
    }

    /// Whether the lease's holder is alive to the server: its engine is the slot's current
    /// incarnation and the session the lease names is still open.
    fn holder_alive(s: &State) -> bool {
        s.lease.as_ref().is_none_or(|l| {
            let e = usize::from(l.engine.0);
            let engine = &s.engines[e];
            engine.incarnation == l.engine.1
                && engine.connected
                && s.lease_session == (l.engine.0, engine.session)
        })
    }

    /// A statement of engine `e`: its session is opened anew if it was cut.
    fn touch(s: &mut State, e: usize) {
        let engine = &mut s.engines[e];
        if !engine.connected {
            engine.connected = true;
            engine.session += 1;
        }
    }

    fn name_session(s: &mut State, e: usize) {
        s.lease_session = (u8::try_from(e).expect("two engines"), s.engines[e].session);
    }

    /// The step fence: the lease is extended when it is still `e`'s with its token (or the
    /// check is planted away); otherwise the engine forgets it and commits nothing.
    fn step_holds(&self, s: &mut State, e: usize) -> bool {
        Self::touch(s, e);
        let Some((fence, until)) = s.engines[e].held else {
            return false;
        };
        let id = Self::id(s, e);
        if self.plant == Some(Plant::NoStepFence) {
            s.stale_step |= !lease::is_holder(s.lease.as_ref(), &id, fence);
            s.engines[e].held = Some((
                fence,
                until.max(lease::deadline(self.clock(s, e), LEASE_MS)),
            ));
            return true;
        }
        if let Some(l) = lease::hold(s.lease.as_ref(), &id, fence, self.clock(s, e), LEASE_MS) {
            s.lease = Some(l);
            Self::name_session(s, e);
            s.engines[e].held = Some((
                fence,
                until.max(lease::deadline(self.clock(s, e), LEASE_MS)),
            ));
            true
        } else {
            s.engines[e].held = None;
            s.fenced_at_step = true;
            false
        }
    }

    /// The write-time check of engine `e` for a write reserved under `fence`.
    fn may_write(&self, s: &mut State, e: usize, fence: i64) -> bool {
        if self.plant == Some(Plant::NoWriteFence) {
            return true;
        }
        let own = s.engines[e]
            .held
            .is_some_and(|(f, until)| f == fence && lease::may_write(until, self.clock(s, e)));
        if self.plant == Some(Plant::WriteCheckLocalOnly) {
            return own;
        }
        Self::touch(s, e);
        if own {
            return lease::is_holder(s.lease.as_ref(), &Self::id(s, e), fence);
        }
        // Past its own deadline: the lease is taken up again if nobody took it meanwhile
        // (an engine back from a stall that nobody covered writes after all).
        let id = Self::id(s, e);
        match lease::hold(s.lease.as_ref(), &id, fence, self.clock(s, e), LEASE_MS) {
            Some(l) => {
                s.lease = Some(l);
                Self::name_session(s, e);
                s.engines[e].held = Some((fence, lease::deadline(self.clock(s, e), LEASE_MS)));
                s.resumed_own_lease = true;
                true
            }
            None => false,
        }
    }

    fn active(stage: Stage) -> bool {
        matches!(stage, Stage::Sending { .. } | Stage::Uncertain)
    }
}

impl Model for World {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let cuts = self.cuts;
        let engine = Engine {
            incarnation: 0,
            held: None,
            job: Job::Idle,
            connected: true,
            session: 0,
        };
        vec![State {
            now: Millis(0),
            lease: None,
            lease_session: (0, 0),
            engines: [engine.clone(), engine],
            stages: [Stage::Queued; 2],
            turn: None,
            crashes_left: 1,
            cuts_left: cuts,
            stale_step: false,
            stale_write: false,
            into_running_turn: false,
            after_release: false,
            passed_while_issued: false,
            fenced_at_write: false,
            fenced_at_step: false,
            resumed_own_lease: false,
            landed: BTreeSet::new(),
            withheld: BTreeSet::new(),
            requeued_from_uncertain: false,
            twice: false,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        if s.now.0 < self.horizon_ms {
            actions.push(Action::Tick);
        }
        if s.turn.is_some() {
            actions.push(Action::Finish);
        }
        for e in 0..2 {
            let engine = &s.engines[e];
            if s.crashes_left > 0 {
                actions.push(Action::Crash(e));
            }
            if s.cuts_left > 0 && engine.connected {
                actions.push(Action::CutSession(e));
            }
            // An engine takes the lease when it holds none or holds it with under half a
            // lease to spare, and renews it any time (the product: every quarter lease).
            if engine
                .held
                .is_none_or(|(_, until)| until <= self.clock(s, e).plus_ms(LEASE_MS / 2))
            {
                actions.push(Action::Take(e));
            }
            if engine.held.is_some() {
                actions.push(Action::Renew(e));
            }
            match engine.job {
                Job::Issued { .. } => actions.push(Action::Write(e)),
                Job::Written { .. } => actions.push(Action::Confirm(e)),
                Job::Withholding { .. } => actions.push(Action::Withhold(e)),
                Job::Idle if engine.held.is_some() => {
                    for m in 0..2 {
                        match s.stages[m] {
                            Stage::Queued if !Self::active(s.stages[1 - m]) && s.turn.is_none() => {
                                actions.push(Action::Reserve(e, m));
                            }
                            Stage::Sending { since, .. }
                                if self.clock(s, e).0 >= since + SENDING_TIMEOUT_MS =>
                            {
                                actions.push(Action::Expire(e, m));
                            }
                            Stage::Uncertain => actions.push(Action::Scan(e, m)),
                            _ => {}
                        }
                    }
                }
                Job::Idle => {}
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Tick => s.now = s.now.plus_ms(TICK_MS),
            Action::Finish => s.turn = None,
            Action::Crash(e) => {
                s.crashes_left -= 1;
                let engine = &mut s.engines[e];
                engine.incarnation += 1;
                engine.held = None;
                engine.job = Job::Idle;
                engine.connected = false;
            }
            Action::CutSession(e) => {
                s.cuts_left -= 1;
                s.engines[e].connected = false;
            }
            Action::Take(e) => {
                let alive = Self::holder_alive(&s);
                Self::touch(&mut s, e);
                let id = Self::id(&s, e);
                let before = s.lease.as_ref().map(|l| l.engine);
                match lease::take(s.lease.as_ref(), &id, self.clock(&s, e), LEASE_MS, alive) {
                    Some(l) => {
                        if before.is_some_and(|b| b != id)
                            && s.engines
                                .iter()
                                .enumerate()
                                .any(|(o, x)| o != e && matches!(x.job, Job::Issued { .. }))
                        {
                            s.passed_while_issued = true;
                        }
                        s.engines[e].held =
                            Some((l.fence, lease::deadline(self.clock(&s, e), LEASE_MS)));
                        s.lease = Some(l);
                        Self::name_session(&mut s, e);
                    }
                    None => s.engines[e].held = None,
                }
            }
            Action::Renew(e) => {
                Self::touch(&mut s, e);
                let id = Self::id(&s, e);
                let (fence, _) = s.engines[e].held?;
                match s
                    .lease
                    .as_ref()
                    .and_then(|l| lease::renew(l, &id, self.clock(&s, e), LEASE_MS))
                {
                    Some(l) if l.fence == fence => {
                        s.engines[e].held =
                            Some((fence, lease::deadline(self.clock(&s, e), LEASE_MS)));
                        s.lease = Some(l);
                        Self::name_session(&mut s, e);
                    }
                    _ => s.engines[e].held = None,
                }
            }
            Action::Reserve(e, m) => {
                if self.step_holds(&mut s, e) {
                    let (fence, _) = s.engines[e].held?;
                    s.stages[m] = Stage::Sending {
                        by: Self::id(&s, e),
                        fence,
                        since: self.clock(&s, e).0,
                    };
                    s.engines[e].job = Job::Issued { msg: m, fence };
                }
            }
            Action::Write(e) => {
                let Job::Issued { msg, fence } = s.engines[e].job else {
                    return None;
                };
                if self.may_write(&mut s, e, fence) {
                    let id = Self::id(&s, e);
                    s.stale_write |= !lease::is_holder(s.lease.as_ref(), &id, fence);
                    s.into_running_turn |= s.turn.is_some();
                    s.after_release |= s.stages[msg] == Stage::Released;
                    s.turn = Some(msg);
                    s.twice |= !s.landed.insert(msg);
                    s.engines[e].job = if self.plant == Some(Plant::WithholdAfterWrite) {
                        Job::Withholding { msg, fence }
                    } else {
                        Job::Written { msg }
                    };
                } else {
                    // Nothing written; the engine says so next (or crashes first, and the
                    // delivery is left as a crash leaves it: its write issued, unwritten).
                    s.fenced_at_write = true;
                    s.engines[e].held = None;
                    s.engines[e].job = Job::Withholding { msg, fence };
                }
            }
            Action::Confirm(e) => {
                let Job::Written { msg } = s.engines[e].job else {
                    return None;
                };
                s.engines[e].job = Job::Idle;
                if self.step_holds(&mut s, e)
                    && matches!(s.stages[msg], Stage::Sending { .. } | Stage::Uncertain)
                {
                    s.stages[msg] = Stage::Accepted;
                }
            }
            Action::Withhold(e) => {
                let Job::Withholding { msg, fence } = s.engines[e].job else {
                    return None;
                };
                s.engines[e].job = Job::Idle;
                Self::touch(&mut s, e);
                // No lease needed: the step applies only to the very reservation this engine
                // made (the delivery's token is the one it reserved under, and the model's
                // rule backs out only an issued write still SENDING).
                let mine = matches!(s.stages[msg], Stage::Sending { fence: f, .. } if f == fence);
                if mine || self.plant == Some(Plant::NoWithholdCheck) {
                    s.requeued_from_uncertain |=
                        matches!(s.stages[msg], Stage::Uncertain | Stage::Released);
                    s.stages[msg] = Stage::Queued;
                    s.withheld.insert(msg);
                }
            }
            Action::Expire(e, m) => {
                if self.step_holds(&mut s, e) {
                    s.stages[m] = Stage::Uncertain;
                }
            }
            Action::Scan(e, m) => {
                if self.step_holds(&mut s, e) {
                    // The scan reads the recipient's history as it is now.
                    s.stages[m] = if s.landed.contains(&m) {
                        Stage::Accepted
                    } else {
                        Stage::Released
                    };
                }
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(STEPS_FENCED, |_, s: &State| !s.stale_step),
            Property::always(
                "a write reaches the recipient only under the lease it was reserved under",
                |_, s: &State| !s.stale_write,
            ),
            Property::always("no write reaches a running turn (G3)", |_, s: &State| {
                !s.into_running_turn
            }),
            Property::always(
                "no write reaches the recipient after its delivery was released as unwritten",
                |_, s: &State| !s.after_release,
            ),
            Property::always(
                "nothing goes back to the queue from UNCERTAIN or a release (G4)",
                |_, s: &State| !s.requeued_from_uncertain,
            ),
            Property::always(
                "no handoff reaches the recipient twice (G2)",
                |_, s: &State| !s.twice,
            ),
            Property::sometimes(
                "a write a fenced engine withheld reaches the recipient through the other engine",
                |_, s: &State| s.withheld.iter().any(|m| s.landed.contains(m)),
            ),
            Property::sometimes(
                "the lease passes to another engine while a write is issued",
                |_, s: &State| s.passed_while_issued,
            ),
            Property::sometimes("an engine is fenced at its write", |_, s: &State| {
                s.fenced_at_write
            }),
            Property::sometimes("an engine is fenced at a step", |_, s: &State| {
                s.fenced_at_step
            }),
            Property::sometimes(
                "an engine past its own deadline takes its lease up again and writes",
                |_, s: &State| s.resumed_own_lease,
            ),
            Property::sometimes("both handoffs reach the recipient", |_, s: &State| {
                s.landed.len() == 2
            }),
            Property::sometimes("a delivery is released as unwritten", |_, s: &State| {
                s.stages.contains(&Stage::Released)
            }),
        ]
    }
}

fn world(plant: Option<Plant>) -> World {
    World {
        horizon_ms: 8 * TICK_MS,
        plant,
        skew_ms: 0,
        cuts: 1,
    }
}

/// Engine 1's clock runs 2 s ahead (past the lease's margin of 0.8 s), and no session is cut.
fn clocks_apart(plant: Option<Plant>) -> World {
    World {
        skew_ms: 2 * TICK_MS,
        cuts: 0,
        ..world(plant)
    }
}

#[test]
fn two_engines_with_fencing_write_only_under_their_lease() {
    let started = std::time::Instant::now();
    let checker = world(None).checker().threads(1).spawn_bfs().join();
    let unique = checker.unique_state_count();
    eprintln!(
        "model fencing: {unique} unique states, depth {}, {:.1?}",
        checker.max_depth(),
        started.elapsed()
    );
    checker.assert_properties();
    assert_eq!(
        unique, 3_201_961,
        "the fencing model's state count changed: update the pinned count if the change is intended"
    );
}

/// Engines whose clocks disagree by more than the margin take each other's leases early, and
/// still write only under their own: the read of the lease before each write, not the
/// clocks, is what keeps them apart.
#[test]
fn two_engines_whose_clocks_disagree_still_write_only_under_their_lease() {
    let started = std::time::Instant::now();
    let checker = clocks_apart(None).checker().threads(1).spawn_bfs().join();
    let unique = checker.unique_state_count();
    eprintln!(
        "model fencing, clocks 2 s apart: {unique} unique states, depth {}, {:.1?}",
        checker.max_depth(),
        started.elapsed()
    );
    checker.assert_properties();
    assert_eq!(
        unique, 357_779,
        "the fencing model's state count changed: update the pinned count if the change is intended"
    );
}

#[test]
fn a_write_checked_by_the_engines_own_clock_alone_is_caught_when_clocks_disagree() {
    caught_in(clocks_apart(Some(Plant::WriteCheckLocalOnly)), FENCED);
}

/// The checker finds a counterexample to `property` with `plant`.
fn caught(plant: Plant, property: &'static str) {
    caught_in(world(Some(plant)), property);
}

/// The checker finds a counterexample to `property` in `world` (which plants a bug).
fn caught_in(world: World, property: &'static str) {
    let plant = world.plant;
    let checker = world
        .checker()
        .threads(1)
        .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([property])))
        .spawn_bfs()
        .join();
    let path = checker
        .discovery(property)
        .unwrap_or_else(|| panic!("the checker did not catch {plant:?}: {property} held"));
    eprintln!("{property} fails under {plant:?}:\n{path}");
}

const STEPS_FENCED: &str = "a step commits only under the lease of the engine that takes it";
const FENCED: &str = "a write reaches the recipient only under the lease it was reserved under";

#[test]
fn a_step_committed_without_the_lease_check_is_caught() {
    caught(Plant::NoStepFence, STEPS_FENCED);
}

#[test]
fn a_write_without_the_lease_check_is_caught() {
    caught(Plant::NoWriteFence, FENCED);
    caught(Plant::NoWriteFence, "no write reaches a running turn (G3)");
    caught(
        Plant::NoWriteFence,
        "no write reaches the recipient after its delivery was released as unwritten",
    );
}

#[test]
fn a_write_checked_by_the_engines_own_clock_alone_is_caught_after_a_cut_session() {
    caught(Plant::WriteCheckLocalOnly, FENCED);
}

#[test]
fn a_write_said_withheld_after_it_went_out_is_caught() {
    caught(
        Plant::WithholdAfterWrite,
        "no handoff reaches the recipient twice (G2)",
    );
}

#[test]
fn a_withheld_write_recorded_without_checking_the_reservation_is_caught() {
    caught(
        Plant::NoWithholdCheck,
        "nothing goes back to the queue from UNCERTAIN or a release (G4)",
    );
}
