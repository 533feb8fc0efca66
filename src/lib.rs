//! handoffs: the delivery layer for teams of AI coding agents. The delivery rules live in the
//! `model` crate; this library holds the SQLite store, the adapters, the engine that drives
//! `model::step`, the service every front calls, and the fronts themselves.

pub mod adapter;
pub mod clock;
pub mod context;
pub mod engine;
pub mod front;
pub mod planted;
pub mod service;
pub mod simulate;
pub mod store;
pub mod text;

pub use model;

pub use planted::{Plant, planted};
