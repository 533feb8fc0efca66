//! Model checking the delivery rules (SPEC §3, §9): the worlds of `world.rs`, each explored
//! exhaustively by stateright, with every guarantee as a property; and the same checks run
//! against deliberately broken policies, to show they can fail.

mod properties;
mod world;

use model::{MessageKind, PlantedBug, Policy, StateKind};
use properties as p;
use stateright::{Checker, HasDiscoveries, Model, Property};
use std::collections::BTreeSet;
use std::io::Write as _;
use world::{Faults, HOUR_MS, MINUTE_MS, Msg, World, WorldPlant};

const WORK: Msg = Msg {
    kind: MessageKind::Work,
    identical_to: None,
    to: 0,
    due_ms: None,
};
const PLAIN: Msg = Msg {
    kind: MessageKind::Plain,
    identical_to: None,
    to: 0,
    due_ms: None,
};

/// Two deliveries to one recipient, with lost replies, crashes, refusals and a person who
/// types into the session: G2, G3 and G8 under concurrency.
fn two_deliveries(policy: Policy) -> World {
    World {
        policy,
        messages: vec![WORK, PLAIN],
        faults: Faults {
            lost_replies: 1,
            crashes: 1,
            refusals: 1,
            foreign_turns: 1,
            releases: 1,
            time_jumps: 1,
            ..Faults::default()
        },
        horizon_ms: 2 * HOUR_MS,
        urgent: false,
        plant: None,
        properties: || {
            let mut props = p::safety();
            for kind in [
                StateKind::Waiting,
                StateKind::Busy,
                StateKind::OwnerRejected,
                StateKind::Sending,
                StateKind::Uncertain,
                StateKind::Accepted,
                StateKind::Running,
                StateKind::Returned,
                StateKind::Cancelled,
            ] {
                props.push(p::reach(kind));
            }
            props.push(Property::sometimes(
                "a crash mid-write is a lost reply (UNCERTAIN)",
                p::crash_mid_write_becomes_uncertain,
            ));
            props
        },
    }
}

/// One piece of work whose turns error and get interrupted: the resend bounds of G4.
fn resends(policy: Policy, errored_turns: u8) -> World {
    World {
        policy,
        messages: vec![WORK],
        faults: Faults {
            errored_turns,
            interrupted_turns: 1,
            foreign_turns: 1,
            work_done: 1,
            long_sleeps: 1,
            time_jumps: 3,
            ..Faults::default()
        },
        horizon_ms: 26 * HOUR_MS,
        urgent: false,
        plant: None,
        properties: || {
            let mut props = p::safety();
            props.push(Property::sometimes(
                "a resend goes out",
                p::a_resend_goes_out,
            ));
            props.push(Property::sometimes(
                "an interrupted turn is resent after the wait",
                p::interrupted_turn_resent_after_wait,
            ));
            props.push(Property::sometimes(
                "the resend window closes",
                p::resend_window_closes,
            ));
            props
        },
    }
}

/// One plain handoff whose reply can be lost, whose engine can crash mid-write and whose
/// agent can go down: UNCERTAIN, history scans and release (G5).
fn honest_release(policy: Policy) -> World {
    World {
        policy,
        messages: vec![PLAIN],
        faults: Faults {
            lost_replies: 1,
            lost_writes: 1,
            crashes: 1,
            agent_downs: 1,
            releases: 1,
            time_jumps: 5,
            ..Faults::default()
        },
        horizon_ms: 3 * HOUR_MS,
        urgent: false,
        plant: None,
        properties: || {
            let mut props = p::safety();
            props.push(p::reach(StateKind::Uncertain));
            props.push(p::reach(StateKind::Cancelled));
            props.push(Property::sometimes(
                "history scans prove a delivery never landed",
                p::scans_prove_never_delivered,
            ));
            props.push(Property::sometimes(
                "a write lost on the way is cancelled by history scans",
                p::lost_write_cancelled_by_scans,
            ));
            props.push(Property::sometimes(
                "a crash mid-write is a lost reply (UNCERTAIN)",
                p::crash_mid_write_becomes_uncertain,
            ));
            props
        },
    }
}

/// One plain handoff under an outage, a pause, a block and a recipient re-registered at its
/// other destination and back: G1 and G6, and the holding states.
fn holds(policy: Policy) -> World {
    World {
        policy,
        messages: vec![PLAIN],
        faults: Faults {
            outages: 2,
            pauses: 1,
            blocks: 1,
            endpoint_changes: 2,
            reads: 1,
            time_jumps: 2,
            ..Faults::default()
        },
        horizon_ms: HOUR_MS,
        urgent: false,
        plant: None,
        properties: || {
            let mut props = p::safety();
            props.push(p::reach(StateKind::Held));
            props.push(p::reach(StateKind::Unavailable));
            props
        },
    }
}

/// Two plain handoffs, the second identical to the first, with a reader, an edited body and
/// refusals: enrolment, acknowledgement and the refusal rule of G2.
fn edits(policy: Policy, refusals: u8) -> World {
    World {
        policy,
        messages: vec![
            PLAIN,
            Msg {
                identical_to: Some(0),
                ..PLAIN
            },
        ],
        faults: Faults {
            body_changes: 1,
            reads: 1,
            refusals,
            lost_replies: 1,
            inexact_receipts: 1,
            time_jumps: 2,
            ..Faults::default()
        },
        horizon_ms: HOUR_MS,
        urgent: false,
        plant: None,
        properties: || {
            let mut props = p::safety();
            for kind in [
                StateKind::OwnerRejected,
                StateKind::Failed,
                StateKind::Acknowledged,
                StateKind::Duplicate,
            ] {
                props.push(p::reach(kind));
            }
            props
        },
    }
}

/// Two handoffs to one recipient and two crashes of the engine (or of a `send`), with a lost
/// reply: G8 over the durable store, and every other guarantee, across more than one crash.
fn durability(policy: Policy, plant: Option<WorldPlant>) -> World {
    World {
        policy,
        messages: vec![WORK, PLAIN],
        faults: Faults {
            crashes: 2,
            lost_replies: 1,
            time_jumps: 2,
            ..Faults::default()
        },
        horizon_ms: HOUR_MS,
        urgent: false,
        plant,
        properties: || {
            let mut props = p::safety();
            props.push(p::reach(StateKind::Uncertain));
            props.push(Property::sometimes(
                "two crashes strike mid-write",
                p::two_crashes_mid_write,
            ));
            props.push(Property::sometimes(
                "a handoff sent before a crash is durable after it",
                p::sent_handoff_survives_a_crash,
            ));
            props
        },
    }
}

/// One handoff to each of two recipients, each its own agent and session; a person types
/// into either session and a reply is lost: G3 per recipient (both may be active at once,
/// neither is written to while busy).
fn two_recipients(policy: Policy) -> World {
    World {
        policy,
        messages: vec![WORK, Msg { to: 1, ..PLAIN }],
        faults: Faults {
            foreign_turns: 1,
            lost_replies: 1,
            time_jumps: 1,
            ..Faults::default()
        },
        horizon_ms: HOUR_MS,
        urgent: false,
        plant: None,
        properties: || {
            let mut props = p::safety();
            props.push(p::reach(StateKind::Busy));
            props.push(Property::sometimes(
                "deliveries to two recipients are active at once",
                p::two_recipients_active_at_once,
            ));
            props
        },
    }
}

/// Faults that stop (SPEC §3 liveness): each world is urgent (time passes only when nothing
/// else can happen) and every fault has a counter, so each path ends at rest once its faults
/// are spent and healed; there, every delivery must have settled (`p::every_delivery_settles`
/// says which fairness this encodes). The horizon, 6 hours, is the bound. Urgency also means
/// a fault that may strike at any moment (an outage, a host down, a re-registration) strikes
/// before the clock next moves: these worlds explore every order of faults and steps, not
/// every timing of the faults.
fn healing(
    policy: Policy,
    plant: Option<WorldPlant>,
    messages: Vec<Msg>,
    faults: Faults,
    properties: fn() -> Vec<Property<World>>,
) -> World {
    World {
        policy,
        messages,
        faults,
        horizon_ms: 6 * HOUR_MS,
        urgent: true,
        plant,
        properties,
    }
}

/// What every healing world checks: the safety guarantees, liveness, and that it really
/// healed from the faults that matter for liveness.
fn healing_properties() -> Vec<Property<World>> {
    let mut props = p::safety();
    props.push(Property::always(p::LIVENESS, p::every_delivery_settles));
    props.push(p::reach(StateKind::Cancelled));
    props.push(Property::sometimes(
        "an uncertain delivery settles once the faults stop",
        p::uncertain_delivery_settles_after_faults,
    ));
    props.push(Property::sometimes(
        "two crashes strike mid-write",
        p::two_crashes_mid_write,
    ));
    props
}

/// And, where a recipient is re-registered: a delivery rests UNAVAILABLE for it.
fn healing_properties_with_moves() -> Vec<Property<World>> {
    let mut props = healing_properties();
    props.push(Property::sometimes(
        "a delivery rests unavailable while its recipient is registered elsewhere",
        p::rests_unavailable_at_rest,
    ));
    props
}

/// Two handoffs to one recipient; two crashes, a lost write, a lost reply, the recipient's
/// host down for a while and a re-registration elsewhere (a reason to rest UNAVAILABLE).
fn healing_after_crashes(policy: Policy, plant: Option<WorldPlant>) -> World {
    let faults = Faults {
        crashes: 2,
        lost_writes: 1,
        lost_replies: 1,
        agent_downs: 1,
        endpoint_changes: 1,
        ..Faults::default()
    };
    let properties = healing_properties_with_moves;
    healing(policy, plant, vec![WORK, PLAIN], faults, properties)
}

/// Two handoffs to one recipient; two crashes, a lost write, a refusal, an errored turn and
/// an outage.
fn healing_after_refusals_and_outages(policy: Policy) -> World {
    let faults = Faults {
        crashes: 2,
        lost_writes: 1,
        refusals: 1,
        errored_turns: 1,
        outages: 1,
        ..Faults::default()
    };
    healing(policy, None, vec![WORK, PLAIN], faults, healing_properties)
}

/// One handoff to each of two recipients; two crashes, a lost write and a re-registration.
fn healing_two_recipients(policy: Policy) -> World {
    let faults = Faults {
        crashes: 2,
        lost_writes: 1,
        endpoint_changes: 1,
        ..Faults::default()
    };
    let messages = vec![WORK, Msg { to: 1, ..PLAIN }];
    healing(
        policy,
        None,
        messages,
        faults,
        healing_properties_with_moves,
    )
}

/// Two handoffs to one recipient whose app checks its session as it writes: a person's turn
/// takes the session between the send boundary and the write twice (each write is turned
/// away as busy, nothing written), beside one real refusal, a lost reply and a crash. A busy recipient is
/// waited for: no race counts as a refusal, and every delivery settles once the races stop.
fn busy_at_the_write(policy: Policy) -> World {
    let faults = Faults {
        races_at_write: 2,
        refusals: 1,
        crashes: 1,
        lost_replies: 1,
        ..Faults::default()
    };
    healing(policy, None, vec![WORK, PLAIN], faults, || {
        let mut props = p::safety();
        props.push(Property::always(p::LIVENESS, p::every_delivery_settles));
        props.push(Property::sometimes(
            "a write turned away busy twice is then delivered",
            p::turned_away_busy_twice_then_delivered,
        ));
        props
    })
}

/// Work due half an hour after it is sent, which its recipient may return before or after
/// that, with a crash and an errored turn (resent while the work is open): G7.
fn deadlines(policy: Policy) -> World {
    World {
        policy,
        messages: vec![Msg {
            due_ms: Some(30 * MINUTE_MS),
            ..WORK
        }],
        faults: Faults {
            work_done: 1,
            crashes: 1,
            errored_turns: 1,
            time_jumps: 3,
            ..Faults::default()
        },
        horizon_ms: 2 * HOUR_MS,
        urgent: false,
        plant: None,
        properties: || {
            let mut props = p::safety();
            props.push(Property::sometimes(
                "overdue work reminds its sender",
                p::overdue_work_reminded,
            ));
            props.push(Property::sometimes(
                "work returned before its due time is never reminded",
                p::work_returned_in_time_never_reminded,
            ));
            props.push(Property::sometimes(
                "work returned late was reminded first",
                p::work_returned_after_a_reminder,
            ));
            props
        },
    }
}

/// A reliable environment (no lost replies, crashes, outages or refusals; turns may still
/// error, be interrupted or be delayed by a person): every delivery settles.
fn reliable() -> World {
    World {
        policy: Policy::default(),
        messages: vec![WORK, PLAIN],
        faults: Faults {
            errored_turns: 2,
            interrupted_turns: 1,
            foreign_turns: 1,
            ..Faults::default()
        },
        horizon_ms: 4 * HOUR_MS,
        urgent: true,
        plant: None,
        properties: || {
            let mut props = p::safety();
            props.push(Property::always(p::LIVENESS, p::every_delivery_settles));
            props
        },
    }
}

fn say(line: &str) {
    // Straight to stderr, past the test harness's capture, so the counts always show.
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Explores `world` exhaustively, asserts every property, prints and pins the state count.
fn check_all(name: &str, world: World, pinned: usize) {
    let started = std::time::Instant::now();
    let checker = world.checker().threads(1).spawn_bfs().join();
    let unique = checker.unique_state_count();
    say(&format!(
        "model {name}: {unique} unique states, {} generated, depth {}, {:.1?}",
        checker.state_count(),
        checker.max_depth(),
        started.elapsed()
    ));
    checker.assert_properties();
    assert_eq!(
        unique, pinned,
        "the {name} model's state count changed: update the pinned count if the change is intended"
    );
}

/// Runs `world` until `property` has a counterexample, prints it, and returns it.
fn counterexample(world: World, property: &'static str) -> String {
    counterexample_ending(world, property).0
}

/// A counterexample to `property` in `world` (printed), and the state it ends in.
fn counterexample_ending(world: World, property: &'static str) -> (String, world::State) {
    let checker = world
        .checker()
        .threads(1)
        .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([property])))
        .spawn_bfs()
        .join();
    let path = checker
        .discovery(property)
        .unwrap_or_else(|| panic!("the checker did not catch the broken rule: {property} held"));
    let text = format!("{property} fails:\n{path}");
    say(&text);
    (text, path.last_state().clone())
}

#[test]
fn two_deliveries_to_one_recipient_keep_every_guarantee() {
    check_all("two deliveries", two_deliveries(Policy::default()), 448_979);
}

#[test]
fn resends_stay_within_their_bounds() {
    check_all("resends", resends(Policy::default(), 3), 477_489);
}

#[test]
fn uncertain_deliveries_are_only_released_honestly() {
    check_all("honest release", honest_release(Policy::default()), 108_488);
}

#[test]
fn holds_and_outages_spend_no_attempt() {
    check_all("holds", holds(Policy::default()), 124_694);
}

#[test]
fn edits_reads_and_refusals_are_judged_before_sending() {
    check_all("edits", edits(Policy::default(), 3), 307_608);
}

#[test]
fn a_reliable_recipient_settles_every_delivery() {
    check_all("reliable", reliable(), 14_069);
}

#[test]
fn two_crashes_lose_nothing_durable() {
    check_all("durability", durability(Policy::default(), None), 69_406);
}

#[test]
fn each_of_two_recipients_is_never_interrupted() {
    check_all("two recipients", two_recipients(Policy::default()), 71_835);
}

#[test]
fn every_delivery_settles_once_crashes_and_lost_writes_stop() {
    check_all(
        "healing after crashes",
        healing_after_crashes(Policy::default(), None),
        45_867,
    );
}

#[test]
fn every_delivery_settles_once_refusals_and_outages_stop() {
    let world = healing_after_refusals_and_outages(Policy::default());
    check_all("healing after refusals and outages", world, 56_855);
}

#[test]
fn every_delivery_to_two_recipients_settles_once_the_faults_stop() {
    check_all(
        "healing, two recipients",
        healing_two_recipients(Policy::default()),
        50_556,
    );
}

#[test]
fn a_recipient_busy_at_the_write_is_waited_for() {
    check_all(
        "busy at the write",
        busy_at_the_write(Policy::default()),
        32_963,
    );
}

#[test]
fn a_busy_answer_at_the_write_taken_for_a_refusal_is_caught_by_g3() {
    let broken = Policy {
        planted_bug: Some(PlantedBug::BusyAtWriteRefused),
        ..Policy::default()
    };
    let path = counterexample(busy_at_the_write(broken), p::G3);
    assert!(
        path.contains("TakenAtWrite"),
        "a person's turn takes the session as the write arrives"
    );
}

#[test]
fn overdue_work_reminds_its_sender_once_in_time() {
    check_all("deadlines", deadlines(Policy::default()), 111_580);
}

#[test]
fn every_state_is_reached_by_some_world() {
    let worlds = [
        two_deliveries(Policy::default()),
        resends(Policy::default(), 3),
        honest_release(Policy::default()),
        holds(Policy::default()),
        edits(Policy::default(), 3),
        reliable(),
        durability(Policy::default(), None),
        two_recipients(Policy::default()),
        healing_after_crashes(Policy::default(), None),
        healing_after_refusals_and_outages(Policy::default()),
        healing_two_recipients(Policy::default()),
        deadlines(Policy::default()),
    ];
    let names: BTreeSet<&str> = worlds
        .iter()
        .flat_map(|w| w.properties().into_iter().map(|p| p.name))
        .collect();
    for kind in StateKind::ALL {
        let name = p::reach(kind).name;
        assert!(names.contains(name), "no world has the property {name:?}");
    }
}

#[test]
fn a_second_refusal_retry_is_caught_by_g2() {
    let broken = Policy {
        refusal_retries_max: 2,
        ..Policy::default()
    };
    let path = counterexample(edits(broken, 3), p::G2);
    assert!(path.contains("Refused"));
}

#[test]
fn sending_while_busy_is_caught_by_g3() {
    let broken = Policy {
        planted_bug: Some(PlantedBug::SendWhileBusy),
        ..Policy::default()
    };
    let path = counterexample(two_deliveries(broken), p::G3);
    assert!(path.contains("Land("));
}

#[test]
fn a_third_error_resend_is_caught_by_g4() {
    let broken = Policy {
        error_resends_max: 3,
        ..Policy::default()
    };
    let path = counterexample(resends(broken, 3), p::G4);
    assert_eq!(path.matches("Some(Errored))").count(), 3);
}

#[test]
fn resending_from_uncertain_is_caught_by_g4() {
    let broken = Policy {
        planted_bug: Some(PlantedBug::ResendFromUncertain),
        ..Policy::default()
    };
    counterexample(honest_release(broken), p::G4);
}

#[test]
fn cancelling_after_one_scan_is_caught_by_g5() {
    let broken = Policy {
        history_scans_min: 1,
        history_scan_span_ms: 0,
        ..Policy::default()
    };
    counterexample(honest_release(broken), p::G5);
}

#[test]
fn cancelling_before_an_hour_of_scans_is_caught_by_g5() {
    let broken = Policy {
        history_scan_span_ms: 20 * 60_000,
        history_scan_interval_ms: 10 * 60_000,
        ..Policy::default()
    };
    counterexample(honest_release(broken), p::G5);
}

#[test]
fn writing_twice_for_one_reservation_is_caught_by_g2() {
    let broken = Policy {
        planted_bug: Some(PlantedBug::WriteTwice),
        ..Policy::default()
    };
    let path = counterexample(two_deliveries(broken), p::G2);
    assert!(
        path.contains("Crash"),
        "the double write comes from a resumed reservation"
    );
}

#[test]
fn skipping_the_activity_recheck_at_the_send_boundary_is_caught_by_g3() {
    let broken = Policy {
        planted_bug: Some(PlantedBug::SkipBoundaryRecheck),
        ..Policy::default()
    };
    let path = counterexample(two_deliveries(broken), p::G3);
    assert!(
        path.contains("ForeignTurnStarts"),
        "a person's turn starts between the reservation and the write"
    );
}

#[test]
fn taking_unknown_activity_for_idle_is_caught() {
    let broken = Policy {
        planted_bug: Some(PlantedBug::UnknownIsIdle),
        ..Policy::default()
    };
    let path = counterexample(honest_release(broken), p::BLIND);
    assert!(path.contains("AgentDown"));
}

#[test]
fn cancelling_after_two_scans_is_caught_by_g5() {
    let broken = Policy {
        planted_bug: Some(PlantedBug::CancelEarly),
        ..Policy::default()
    };
    counterexample(honest_release(broken), p::G5);
}

#[test]
fn spending_an_attempt_during_an_outage_is_caught_by_g6() {
    let broken = Policy {
        planted_bug: Some(PlantedBug::IgnoreOutage),
        ..Policy::default()
    };
    let path = counterexample(holds(broken), p::G6);
    assert!(path.contains("OutageStarts"));
}

#[test]
fn resolving_the_destination_at_write_time_is_caught_by_g1() {
    let broken = Policy {
        planted_bug: Some(PlantedBug::ResolveAtWrite),
        ..Policy::default()
    };
    let path = counterexample(holds(broken), p::G1);
    assert!(path.contains("EndpointChanges"));
}

#[test]
fn writing_before_the_reservation_is_committed_is_caught_by_g8() {
    let broken = Policy {
        planted_bug: Some(PlantedBug::ReserveAfterWrite),
        ..Policy::default()
    };
    counterexample(honest_release(broken), p::G8);
}

#[test]
fn answering_a_send_before_its_delivery_is_committed_is_caught_by_g8() {
    let world = durability(Policy::default(), Some(WorldPlant::EnrolAfterCommit));
    let path = counterexample(world, p::G8);
    assert!(
        path.contains("Send(") && path.contains("Crash"),
        "a crash between the answer and the enrolment's commit loses the delivery"
    );
}

#[test]
fn an_uncertain_delivery_never_looked_at_again_is_caught_by_liveness() {
    let world = healing_after_crashes(Policy::default(), Some(WorldPlant::ScanNeverRescheduled));
    let (_, end) = counterexample_ending(world, p::LIVENESS);
    assert!(
        end.store
            .iter()
            .flatten()
            .any(|d| d.kind() == StateKind::Uncertain),
        "the delivery left unsettled is UNCERTAIN"
    );
}

#[test]
fn overdue_work_never_reminded_is_caught_by_g7() {
    let broken = Policy {
        planted_bug: Some(PlantedBug::NoReminder),
        ..Policy::default()
    };
    let path = counterexample(deadlines(broken), p::G7);
    assert!(!path.contains("Remind("));
}
