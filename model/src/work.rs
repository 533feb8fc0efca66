//! The reminder rule of work contracts (SPEC §2.5, G7), free of IO: past its due time without a
//! return, the sender gets exactly one reminder, as a non-waking notification. The caller reads
//! the work item's clock (due time, whether it is still open, when it was reminded) and the
//! time; these functions decide. A reminder is never a delivery: the caller posts it as a
//! notification and enrols nothing for it.

use crate::ids::Millis;
use crate::policy::{PlantedBug, Policy};

/// Whether work in this state is open: assigned or accepted (not returned, blocked or closed).
pub fn is_open(state: &str) -> bool {
    matches!(state, "assigned" | "accepted")
}

/// When the sender of this work should be reminded, if ever: its due time, while the work is
/// open (assigned or accepted: not returned, blocked or closed) and its sender has not been
/// reminded yet. An engine sleeps until then; `None`: no reminder will ever fall due unless
/// the work changes.
pub fn next_reminder_at(
    due_at: Option<Millis>,
    open: bool,
    reminded_at: Option<Millis>,
) -> Option<Millis> {
    due_at.filter(|_| open && reminded_at.is_none())
}

/// Whether the sender of this work is to be reminded now (exactly once, SPEC §2.5).
pub fn reminder_due(
    due_at: Option<Millis>,
    open: bool,
    reminded_at: Option<Millis>,
    now: Millis,
    policy: &Policy,
) -> bool {
    if policy.planted(PlantedBug::NoReminder) {
        return false;
    }
    next_reminder_at(due_at, open, reminded_at).is_some_and(|at| at <= now)
}

#[cfg(test)]
mod tests {
    use super::{next_reminder_at, reminder_due};
    use crate::ids::Millis;
    use crate::policy::Policy;

    const DUE: Millis = Millis(1_000);

    #[test]
    fn open_work_past_its_due_time_reminds_once() {
        let p = Policy::default();
        assert!(
            !reminder_due(Some(DUE), true, None, Millis(999), &p),
            "not yet due"
        );
        assert!(
            reminder_due(Some(DUE), true, None, DUE, &p),
            "due at its due time"
        );
        assert!(
            reminder_due(Some(DUE), true, None, Millis(9_999), &p),
            "late, still once"
        );
        assert!(
            !reminder_due(Some(DUE), true, Some(DUE), Millis(9_999), &p),
            "reminded already"
        );
        assert_eq!(next_reminder_at(Some(DUE), true, None), Some(DUE));
        assert_eq!(next_reminder_at(Some(DUE), true, Some(DUE)), None);
    }

    #[test]
    fn returned_closed_or_undated_work_is_never_reminded() {
        let p = Policy::default();
        assert!(!reminder_due(Some(DUE), false, None, Millis(9_999), &p));
        assert!(!reminder_due(None, true, None, Millis(9_999), &p));
        assert_eq!(next_reminder_at(Some(DUE), false, None), None);
        assert_eq!(next_reminder_at(None, true, None), None);
    }

    #[cfg(feature = "planted-bugs")]
    #[test]
    fn the_planted_no_reminder_never_reminds() {
        let p = Policy {
            planted_bug: Some(crate::PlantedBug::NoReminder),
            ..Policy::default()
        };
        assert!(!reminder_due(Some(DUE), true, None, Millis(9_999), &p));
    }
}
