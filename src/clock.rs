//! Time and ids as injected values: the engine and the service never read the clock or make
//! an id except through these.

use model::Millis;
use std::time::{SystemTime, UNIX_EPOCH};

/// The current time, in milliseconds since the epoch.
pub fn now() -> Millis {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    Millis(ms)
}

/// A fresh random id (32 hex digits): unique prefixes of 6 or more characters stay practical.
pub fn new_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}
