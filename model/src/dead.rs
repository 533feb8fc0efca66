//! Dead letters (SPEC §8.2): which delivery states mean a handoff cannot be delivered, so the
//! service keeps it, with its reason, until a person replays or drops it. A pure function of
//! the record; the service calls it after every step (and a refused send is kept by the
//! service itself: it never has a record).

use crate::delivery::Delivery;
use crate::policy::{PlantedBug, Policy};
use crate::states::{NoResend, ResendPlan, UnavailableReason};

/// Why a delivery's handoff is dead.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeadReason {
    /// FAILED for good: never delivered, its resends spent, or too late for one.
    Failed,
    /// UNAVAILABLE: its recipient is not registered (never was, or was removed).
    UnknownRecipient,
    /// UNAVAILABLE: its recipient is registered somewhere else than it was sent to.
    DestinationChanged,
}

/// Why `d` is dead, if it is. Work that was done, or a resend a person released, is no dead
/// letter; nor is a recipient whose activity cannot be verified for now.
pub fn reason(d: &Delivery, policy: &Policy) -> Option<DeadReason> {
    match d {
        Delivery::Failed(f)
            if matches!(
                f.resend(),
                ResendPlan::Final {
                    why: NoResend::NeverDelivered | NoResend::LimitReached | NoResend::WindowPassed
                }
            ) && !policy.planted(PlantedBug::FinalFailureNotKept) =>
        {
            Some(DeadReason::Failed)
        }
        Delivery::Unavailable(u) => match u.reason() {
            UnavailableReason::AgentMissing => Some(DeadReason::UnknownRecipient),
            UnavailableReason::TargetChanged { .. } => Some(DeadReason::DestinationChanged),
            UnavailableReason::ActivityUnknown { .. } => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::{DeadReason, reason};
    use crate::policy::{PlantedBug, Policy};
    use crate::table::sample_records;

    /// Among the sample records, only the final failure and the missing agent are dead (a
    /// FAILED with a resend due, a queued, running or returned delivery is not); the plant
    /// forgets the failure.
    #[test]
    fn only_what_cannot_be_delivered_is_dead() {
        let p = Policy::default();
        let dead: Vec<(&str, Option<DeadReason>)> = sample_records()
            .iter()
            .map(|(name, d)| (*name, reason(d, &p)))
            .filter(|(_, r)| r.is_some())
            .collect();
        assert_eq!(
            dead,
            vec![
                ("agent missing", Some(DeadReason::UnknownRecipient)),
                ("final", Some(DeadReason::Failed)),
            ]
        );
        let planted = Policy {
            planted_bug: Some(PlantedBug::FinalFailureNotKept),
            ..Policy::default()
        };
        let final_failure = &sample_records()
            .into_iter()
            .find(|(n, _)| *n == "final")
            .map(|(_, d)| d);
        assert_eq!(
            final_failure.as_ref().and_then(|d| reason(d, &planted)),
            None
        );
    }
}
