//! The simulated world the real engine is tested in (SPEC §9). It owns what the world does to
//! the engine (fault plans drawn from a seed, later the agent hosts and the oracle) and never
//! a copy of the engine or of its rules: those come from the `model` crate and the root
//! package.
//!
//! Swarm testing: each seed draws its own fault *rates* as well as the faults themselves, so
//! a sweep over seeds covers calm runs, runs dominated by one fault, and everything between.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::fmt;

/// How often each fault strikes in one simulated run, drawn from the seed.
#[derive(Clone, Debug, PartialEq)]
pub struct FaultPlan {
    pub seed: u64,
    /// Chance that a reply from an agent host to the engine is lost.
    pub lost_reply_rate: f64,
    /// Chance that an agent refuses a write.
    pub refusal_rate: f64,
    /// Chance that a turn errors.
    pub errored_turn_rate: f64,
    /// Chance that a turn is interrupted.
    pub interrupted_turn_rate: f64,
    /// Chance, per simulated minute, that an agent host goes down for a while.
    pub agent_outage_rate: f64,
    /// Chance, per simulated minute, that the provider's status page reports an outage.
    pub provider_outage_rate: f64,
    /// Engine crashes (SIGKILL-like) during the run.
    pub engine_crashes: u32,
}

impl FaultPlan {
    /// The plan for `seed`: the same seed always gives the same plan.
    pub fn from_seed(seed: u64) -> FaultPlan {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        // Each fault is off in about a third of the seeds, so calm runs are common too.
        let mut rate = |max: f64| {
            if rng.random_bool(1.0 / 3.0) {
                0.0
            } else {
                (rng.random_range(0.0..max) * 1_000.0).round() / 1_000.0
            }
        };
        let lost_reply_rate = rate(0.3);
        let refusal_rate = rate(0.2);
        let errored_turn_rate = rate(0.2);
        let interrupted_turn_rate = rate(0.1);
        let agent_outage_rate = rate(0.05);
        let provider_outage_rate = rate(0.02);
        let engine_crashes = rng.random_range(0..=4);
        FaultPlan {
            seed,
            lost_reply_rate,
            refusal_rate,
            errored_turn_rate,
            interrupted_turn_rate,
            agent_outage_rate,
            provider_outage_rate,
            engine_crashes,
        }
    }

    /// Whether this plan injects no fault at all.
    pub fn is_calm(&self) -> bool {
        self.engine_crashes == 0
            && [
                self.lost_reply_rate,
                self.refusal_rate,
                self.errored_turn_rate,
                self.interrupted_turn_rate,
                self.agent_outage_rate,
                self.provider_outage_rate,
            ]
            .iter()
            .all(|r| *r == 0.0)
    }
}

impl fmt::Display for FaultPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "seed {}: lost replies {:.3}, refusals {:.3}, errored turns {:.3}, interrupted turns {:.3}, \
             agent outages {:.3}/min, provider outages {:.3}/min, engine crashes {}",
            self.seed,
            self.lost_reply_rate,
            self.refusal_rate,
            self.errored_turn_rate,
            self.interrupted_turn_rate,
            self.agent_outage_rate,
            self.provider_outage_rate,
            self.engine_crashes
        )
    }
}

#[cfg(test)]
mod tests {
    use super::FaultPlan;

    #[test]
    fn the_same_seed_draws_the_same_plan() {
        assert_eq!(FaultPlan::from_seed(7), FaultPlan::from_seed(7));
        assert_eq!(
            FaultPlan::from_seed(7).to_string(),
            FaultPlan::from_seed(7).to_string()
        );
    }

    #[test]
    fn a_sweep_covers_calm_and_faulty_plans() {
        let plans: Vec<FaultPlan> = (0..200).map(FaultPlan::from_seed).collect();
        assert_ne!(plans[7], plans[8], "seeds 7 and 8 drew the same plan");
        assert!(plans.iter().any(|p| p.lost_reply_rate == 0.0));
        assert!(plans.iter().any(|p| p.lost_reply_rate > 0.1));
        assert!(plans.iter().any(|p| p.engine_crashes == 0));
        assert!(plans.iter().any(|p| p.engine_crashes >= 3));
        assert!(plans.iter().filter(|p| p.is_calm()).count() < 20);
    }
}
