//! Time and ids as injected values: the engine and the service never read the clock or make
//! an id except through these. The simulation makes ids reproducible: on its thread they
//! come from a stream seeded with the run's seed.

use model::Millis;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::cell::RefCell;
use std::time::{SystemTime, UNIX_EPOCH};

thread_local! {
    static SEEDED_IDS: RefCell<Option<ChaCha8Rng>> = const { RefCell::new(None) };
}

/// The current time, in milliseconds since the epoch.
pub fn now() -> Millis {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    Millis(ms)
}

/// The current time, in milliseconds since the epoch, as the records hold it.
pub fn now_ms() -> i64 {
    i64::try_from(now().0).unwrap_or(i64::MAX)
}

/// A fresh id (32 hex digits): random, or from this thread's seeded stream (see
/// [`seed_ids`]). Unique prefixes of 6 or more characters stay practical.
pub fn new_id() -> String {
    let seeded = SEEDED_IDS.with(|s| {
        s.borrow_mut()
            .as_mut()
            .map(|rng| format!("{:032x}", rng.random::<u128>()))
    });
    seeded.unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string())
}

/// Makes this thread's ids come from a stream seeded with `seed` (None: random again).
pub fn seed_ids(seed: Option<u64>) {
    SEEDED_IDS.with(|s| *s.borrow_mut() = seed.map(ChaCha8Rng::seed_from_u64));
}
