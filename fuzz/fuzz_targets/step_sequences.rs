//! Any byte string, decoded into a starting record and events, run through `model::step`:
//! never a panic, and every invariant of `model::harness::run` holds after every step.
//! Run: `cargo fuzz run -s none step_sequences` (works on stable).
#![no_main]

use libfuzzer_sys::fuzz_target;
use model::Policy;
use model::harness::{decode, run};

fuzz_target!(|data: &[u8]| {
    let (start, events) = decode(data, 400);
    if let Err(why) = run(start, events, &Policy::default()) {
        panic!("{why}");
    }
});
