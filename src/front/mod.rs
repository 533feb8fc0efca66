//! The fronts: each parses its input, makes one service call, and renders the result. They
//! hold no delivery logic; errors are mapped to exit codes (or HTTP statuses) in one place.

pub mod cli;
pub mod live;
pub mod mcp;
pub mod tls;
pub mod web;
