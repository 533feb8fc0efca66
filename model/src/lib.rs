//! The delivery core of handoffs, free of IO: the fourteen delivery states of SPEC §2 as
//! types, the transitions between them, the policy that bounds them, and `step`, which turns
//! one event into the next record plus the effects an engine must perform.
//!
//! This crate never reads a clock, makes an id, touches a file or a socket, or spawns a task:
//! time, ids and the world's answers arrive as data inside each `Event`. The engine, the
//! simulation and the model checker all call the same `step`.

pub mod chain;
pub mod dead;
pub mod delivery;
pub mod event;
pub mod harness;
pub mod ids;
pub mod lease;
pub mod policy;
pub mod states;
pub mod step;
pub mod table;
pub mod work;

pub use delivery::{Class, Delivery, Invalid, StateKind};
pub use event::{
    Activity, Change, Effect, Event, EventKind, Observed, PassFacts, Permission, ScanResult, Step,
    WriteOutcome,
};
pub use ids::{AgentId, MessageId, Millis, RequestId, TurnId};
pub use policy::{PlantedBug, Policy};
pub use states::{Core, MessageKind, Provider, ROUTE_SETTINGS, Target};
pub use step::step;

/// Enrols a message (SPEC §2.1): a new delivery, WAITING, or DUPLICATE of the live plain
/// handoff `duplicate_of` (the caller finds it; work is never deduplicated).
pub fn enrol(core: Core, duplicate_of: Option<MessageId>) -> Delivery {
    match duplicate_of {
        Some(of) if core.kind == MessageKind::Plain => {
            Delivery::Duplicate(states::Duplicate::enrol(core, of))
        }
        _ => Delivery::Waiting(states::Waiting::enrol(core)),
    }
}
