//! The reminder rule of work contracts (SPEC §2.5, G7), free of IO: past its due time without a
//! return, the sender gets exactly one reminder, as a non-waking notification. The caller reads
//! the work item's clock (due time, whether it is still open, when it was reminded) and the
//! time; these functions decide. A reminder is never a delivery: the caller posts it as a
//! notification and enrols nothing for it.

use crate::ids::Millis;
use crate::policy::{PlantedBug, Policy};

/// Where a work contract stands (SPEC §2.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkState {
    /// Given, not yet accepted.
    Assigned,
    /// Accepted by its recipient.
    Accepted,
    /// Returned done, waiting for its sender to close it.
    Returned,
    /// Returned as blocked.
    Blocked,
    /// Closed by its sender.
    Closed,
}

impl WorkState {
    /// The states in which work is open: the one definition of "open".
    pub const OPEN: [WorkState; 2] = [WorkState::Assigned, WorkState::Accepted];

    /// Whether work in this state is open: assigned or accepted (not returned, blocked or
    /// closed). Open work can be returned, and its sender is reminded when it is overdue.
    pub fn is_open(self) -> bool {
        Self::OPEN.contains(&self)
    }

    /// Returned, done or blocked: waiting for its sender to close it.
    pub fn is_returned(self) -> bool {
        matches!(self, WorkState::Returned | WorkState::Blocked)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            WorkState::Assigned => "assigned",
            WorkState::Accepted => "accepted",
            WorkState::Returned => "returned",
            WorkState::Blocked => "blocked",
            WorkState::Closed => "closed",
        }
    }
}

impl std::fmt::Display for WorkState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for WorkState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        [
            WorkState::Assigned,
            WorkState::Accepted,
            WorkState::Returned,
            WorkState::Blocked,
            WorkState::Closed,
        ]
        .into_iter()
        .find(|w| w.as_str() == s)
        .ok_or_else(|| format!("no work state {s:?}"))
    }
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
