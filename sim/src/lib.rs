//! The simulated world the real engine is tested in (SPEC §9). It owns what the world does to
//! the engine (fault plans drawn from a seed, the agent hosts and the status page on a
//! turmoil network, what the agents received) and never a copy of the engine or of its
//! rules: the root package runs its real engine in this world (`handoffs sim`).
//!
//! Swarm testing: each seed draws its own fault *rates* as well as the faults themselves, so
//! a sweep over seeds covers calm runs, runs dominated by one fault, and everything between.

pub mod agent;
pub mod net;
pub mod oracle;
pub mod status;

/// The simulation framework, for the runner that puts the engine in this world.
pub use turmoil;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::fmt;
use std::time::Duration;

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
    /// Chance that a turn is slow (10 to 60 minutes).
    pub slow_turn_rate: f64,
    /// Chance, per simulated minute, that a person starts a turn of their own.
    pub person_turn_rate: f64,
    /// Chance, per simulated minute, that an agent's link holds its messages for a while.
    pub held_link_rate: f64,
    /// Engine crashes (SIGKILL-like) during the run.
    pub engine_crashes: u32,
    /// Chance, per simulated minute and agent, that requests from the engine to it are lost
    /// for a while (writes that never land: the engine cannot tell, and must scan).
    pub lost_request_rate: f64,
    /// Chance that an agent fails a write with a server error before taking it (the engine
    /// cannot tell whether it landed: UNCERTAIN, settled by history scans).
    pub failed_write_rate: f64,
    /// Chance that an agent's activity answer cannot be read (503): the engine must not write.
    pub unknown_activity_rate: f64,
    /// Chance that a person starts a turn right after the agent answered "idle" (between the
    /// engine's first look and its write): the send boundary must see it.
    pub racing_turn_rate: f64,
    /// Times a person re-registers an agent at another address (the spare host) for a
    /// while, then back (G1: nothing queued follows the agent to its new address).
    pub reregistrations: u32,
    /// Chance, per simulated minute and agent, that the agent's history cannot be read for
    /// 10 to 40 minutes (its status queries answer 503): a history scan in that window is
    /// incomplete and must not count toward a release (G5).
    pub history_outage_rate: f64,
    /// Agents, and handoffs the driver sends.
    pub agents: usize,
    pub handoffs: usize,
}

/// A fault at a moment of the fault phase, lasting `for_`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    pub at: Duration,
    pub for_: Duration,
    pub kind: FaultKind,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// Replies from this agent to the engine are lost (a one-way partition).
    LostReplies(usize),
    /// Messages between the engine and this agent are held, then released.
    HeldLink(usize),
    /// The agent host is down.
    AgentDown(usize),
    /// The provider's status page reports an outage.
    ProviderOutage,
    /// The engine crashes and restarts after `for_`.
    EngineCrash,
    /// The agent is re-registered at the spare host's address, and back after `for_`.
    Reregistered(usize),
    /// Requests from the engine to this agent are lost (a one-way partition the other way).
    LostRequests(usize),
    /// This agent's history cannot be read: its status queries answer 503.
    HistoryDown(usize),
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
        let slow_turn_rate = rate(0.1);
        let person_turn_rate = rate(0.1);
        let held_link_rate = rate(0.05);
        let engine_crashes = rng.random_range(0..=4);
        let agents = rng.random_range(2..=4);
        let handoffs = rng.random_range(10..=40);
        // Drawn last, so the plans of earlier commits keep their other numbers.
        let reregistrations = if rng.random_bool(0.5) {
            0
        } else {
            rng.random_range(1..=2)
        };
        let lost_request_rate = if rng.random_bool(0.5) {
            0.0
        } else {
            (rng.random_range(0.0..0.05) * 1_000.0_f64).round() / 1_000.0
        };
        let failed_write_rate = if rng.random_bool(0.5) {
            0.0
        } else {
            (rng.random_range(0.0..0.15) * 1_000.0_f64).round() / 1_000.0
        };
        let mut late_rate = |max: f64| {
            if rng.random_bool(0.5) {
                0.0
            } else {
                (rng.random_range(0.0..max) * 1_000.0_f64).round() / 1_000.0
            }
        };
        let unknown_activity_rate = late_rate(0.1);
        let racing_turn_rate = late_rate(0.1);
        let history_outage_rate = late_rate(0.03);
        FaultPlan {
            seed,
            lost_reply_rate,
            refusal_rate,
            errored_turn_rate,
            interrupted_turn_rate,
            agent_outage_rate,
            provider_outage_rate,
            slow_turn_rate,
            person_turn_rate,
            held_link_rate,
            engine_crashes,
            lost_request_rate,
            failed_write_rate,
            unknown_activity_rate,
            racing_turn_rate,
            reregistrations,
            history_outage_rate,
            agents,
            handoffs,
        }
    }

    /// The timed faults of a fault phase of `phase`, in order: per simulated minute and agent
    /// a lost-reply window, a held link or an outage by their rates, provider outages, and
    /// the engine crashes at random moments. Drawn from the seed, so the same seed replays.
    pub fn faults(&self, phase: Duration) -> Vec<Fault> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ 0x5eed_f417);
        let minutes = phase.as_secs() / 60;
        let mut out = Vec::new();
        let secs =
            |rng: &mut ChaCha8Rng, lo: u64, hi: u64| Duration::from_secs(rng.random_range(lo..hi));
        for minute in 0..minutes {
            let start = Duration::from_secs(minute * 60);
            for agent in 0..self.agents {
                // Lost replies strike per minute at a tenth of the per-reply rate's odds,
                // for 10 s to 2 min.
                if self.lost_reply_rate > 0.0
                    && rng.random_bool((self.lost_reply_rate / 10.0).min(1.0))
                {
                    let at = start + secs(&mut rng, 0, 60);
                    let for_ = secs(&mut rng, 10, 120);
                    out.push(Fault {
                        at,
                        for_,
                        kind: FaultKind::LostReplies(agent),
                    });
                }
                if self.held_link_rate > 0.0 && rng.random_bool(self.held_link_rate.min(1.0)) {
                    let at = start + secs(&mut rng, 0, 60);
                    let for_ = secs(&mut rng, 1, 40);
                    out.push(Fault {
                        at,
                        for_,
                        kind: FaultKind::HeldLink(agent),
                    });
                }
                if self.agent_outage_rate > 0.0 && rng.random_bool(self.agent_outage_rate.min(1.0))
                {
                    let at = start + secs(&mut rng, 0, 60);
                    let for_ = secs(&mut rng, 30, 900);
                    out.push(Fault {
                        at,
                        for_,
                        kind: FaultKind::AgentDown(agent),
                    });
                }
            }
            if self.provider_outage_rate > 0.0
                && rng.random_bool(self.provider_outage_rate.min(1.0))
            {
                let at = start + secs(&mut rng, 0, 60);
                let for_ = secs(&mut rng, 120, 1_800);
                out.push(Fault {
                    at,
                    for_,
                    kind: FaultKind::ProviderOutage,
                });
            }
        }
        for _ in 0..self.engine_crashes {
            let at =
                Duration::from_millis(rng.random_range(
                    1_000..phase.as_millis().try_into().unwrap_or(u64::MAX).max(1_001),
                ));
            let for_ = Duration::from_millis(rng.random_range(100..60_000));
            out.push(Fault {
                at,
                for_,
                kind: FaultKind::EngineCrash,
            });
        }
        // Re-registrations one after another (one spare address), each in its own slice of
        // the phase.
        let slices = u64::from(self.reregistrations.max(1));
        let slice_ms = u64::try_from(phase.as_millis()).unwrap_or(u64::MAX) / slices;
        for k in 0..u64::from(self.reregistrations) {
            let begin = k * slice_ms + rng.random_range(0..slice_ms / 2);
            let for_ = rng.random_range(60_000..(slice_ms / 2).max(60_001));
            out.push(Fault {
                at: Duration::from_millis(begin),
                for_: Duration::from_millis(for_),
                kind: FaultKind::Reregistered(rng.random_range(0..self.agents)),
            });
        }
        if self.lost_request_rate > 0.0 {
            for minute in 0..minutes {
                for agent in 0..self.agents {
                    if rng.random_bool(self.lost_request_rate.min(1.0)) {
                        let at = Duration::from_secs(minute * 60) + secs(&mut rng, 0, 60);
                        let for_ = secs(&mut rng, 5, 90);
                        out.push(Fault {
                            at,
                            for_,
                            kind: FaultKind::LostRequests(agent),
                        });
                    }
                }
            }
        }
        if self.history_outage_rate > 0.0 {
            for minute in 0..minutes {
                for agent in 0..self.agents {
                    if rng.random_bool(self.history_outage_rate.min(1.0)) {
                        let at = Duration::from_secs(minute * 60) + secs(&mut rng, 0, 60);
                        let for_ = secs(&mut rng, 600, 2_400);
                        out.push(Fault {
                            at,
                            for_,
                            kind: FaultKind::HistoryDown(agent),
                        });
                    }
                }
            }
        }
        out.sort_by_key(|f| f.at);
        out
    }

    /// Whether this plan injects no fault at all.
    pub fn is_calm(&self) -> bool {
        self.engine_crashes == 0
            && self.reregistrations == 0
            && self.lost_request_rate == 0.0
            && self.failed_write_rate == 0.0
            && self.unknown_activity_rate == 0.0
            && self.racing_turn_rate == 0.0
            && self.history_outage_rate == 0.0
            && [
                self.lost_reply_rate,
                self.refusal_rate,
                self.errored_turn_rate,
                self.interrupted_turn_rate,
                self.agent_outage_rate,
                self.provider_outage_rate,
                self.slow_turn_rate,
                self.person_turn_rate,
                self.held_link_rate,
            ]
            .iter()
            .all(|r| *r == 0.0)
    }
}

impl fmt::Display for FaultPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "seed {}: {} agents, {} handoffs; lost replies {:.3}, refusals {:.3}, errored turns {:.3}, \
             interrupted turns {:.3}, slow turns {:.3}, person turns {:.3}/min, held links {:.3}/min, \
             agent outages {:.3}/min, provider outages {:.3}/min, engine crashes {}, re-registrations {}, lost requests {:.3}/min, failed writes {:.3}, unknown activity {:.3}, racing turns {:.3}, history outages {:.3}/min",
            self.seed,
            self.agents,
            self.handoffs,
            self.lost_reply_rate,
            self.refusal_rate,
            self.errored_turn_rate,
            self.interrupted_turn_rate,
            self.slow_turn_rate,
            self.person_turn_rate,
            self.held_link_rate,
            self.agent_outage_rate,
            self.provider_outage_rate,
            self.engine_crashes,
            self.reregistrations,
            self.lost_request_rate,
            self.failed_write_rate,
            self.unknown_activity_rate,
            self.racing_turn_rate,
            self.history_outage_rate
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
        assert!(plans.iter().any(|p| p.reregistrations == 2));
        assert!(plans.iter().filter(|p| p.is_calm()).count() < 20);
    }
}
