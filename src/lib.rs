//! handoffs: the delivery layer for teams of AI coding agents. This library hosts the
//! engine, the store, the adapters and the fronts as they land; the delivery rules live in
//! the `model` crate and are re-exported here.

pub use model;
