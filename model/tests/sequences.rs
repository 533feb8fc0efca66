//! Random event sequences into `step`: never a panic, and every record stays valid under the
//! invariants `model::harness::run` checks. The fuzz target in fuzz/ drives the same harness.

use model::harness::{decode, run};
use model::{PlantedBug, Policy};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 4_000, ..ProptestConfig::default() })]

    #[test]
    fn random_event_sequences_keep_every_record_valid(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        let (start, events) = decode(&bytes, 200);
        if let Err(why) = run(start, events, &Policy::default()) {
            prop_assert!(false, "{}", why);
        }
    }
}

/// The harness is a check that can fail: with a bug planted in `step`, random sequences find
/// a broken invariant within a bounded number of tries.
#[test]
fn the_harness_catches_a_resend_from_uncertain() {
    let broken = Policy {
        planted_bug: Some(PlantedBug::ResendFromUncertain),
        ..Policy::default()
    };
    let caught = (0u32..20_000).find_map(|seed| {
        let bytes: Vec<u8> = (0..96u32)
            .map(|i| {
                (seed.wrapping_mul(2_654_435_761) ^ i.wrapping_mul(40_503)).to_le_bytes()
                    [(i % 4) as usize]
            })
            .collect();
        let (start, events) = decode(&bytes, 40);
        run(start, events, &broken).err().map(|why| (seed, why))
    });
    let (seed, why) = caught.expect("no sequence exposed the planted resend");
    eprintln!("seed {seed}: {why}");
    assert!(why.contains("(G4)"), "{why}");
}
