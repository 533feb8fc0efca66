//! handoffs: the delivery layer for teams of AI coding agents. The delivery rules live in the
//! `model` crate; this library holds the SQLite store, the adapters, the engine that drives
//! `model::step`, the service every front calls, and the fronts themselves.

pub mod adapter;
pub mod clock;
pub mod context;
pub mod engine;
pub mod front;
pub mod ledger;
pub mod service;
pub mod simulate;
pub mod store;

pub use model;

/// Whether a test build was asked to plant the bug `name` (`HANDOFFS_PLANT=a,b`), so a check
/// can show it fails; always false in a build without the `planted-bugs` feature.
pub fn planted(name: &str) -> bool {
    cfg!(feature = "planted-bugs")
        && std::env::var("HANDOFFS_PLANT").is_ok_and(|v| v.split(',').any(|p| p == name))
}
