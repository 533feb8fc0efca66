//! Every bound of the delivery rules (SPEC §2), in one struct, with its unit in its name.
//! Nothing else in the workspace may hard-code one of these numbers.

use serde::{Deserialize, Serialize};

const SECOND_MS: u64 = 1_000;
const MINUTE_MS: u64 = 60 * SECOND_MS;
const HOUR_MS: u64 = 60 * MINUTE_MS;

/// The bounds `step` enforces. `Policy::default()` is the behaviour SPEC §2 promises.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Policy {
    /// Automatic resends after an errored turn.
    pub error_resends_max: u32,
    /// Automatic resends after an interrupted turn.
    pub interrupt_resends_max: u32,
    /// How long after an interruption the resend may go out, at the earliest.
    pub interrupt_resend_wait_ms: u64,
    /// Resends are only considered this long after the failure.
    pub resend_window_ms: u64,
    /// A reserved write with no receipt after this long is UNCERTAIN.
    pub sending_timeout_ms: u64,
    /// An ACCEPTED or RUNNING delivery that cannot be observed this long is UNCERTAIN.
    pub unobserved_limit_ms: u64,
    /// Complete history scans that found nothing needed before an automatic CANCELLED.
    pub history_scans_min: u32,
    /// Those scans must span at least this long, from the first to the last.
    pub history_scan_span_ms: u64,
    /// At least this long between two history scans of one delivery.
    pub history_scan_interval_ms: u64,
    /// Retries after an explicit refusal; one more refusal fails the delivery.
    pub refusal_retries_max: u32,
    /// A bug planted on purpose, so a test can show that the checks catch it.
    #[cfg(feature = "planted-bugs")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planted_bug: Option<PlantedBug>,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            error_resends_max: 2,
            interrupt_resends_max: 1,
            interrupt_resend_wait_ms: 10 * MINUTE_MS,
            resend_window_ms: 24 * HOUR_MS,
            sending_timeout_ms: 60 * SECOND_MS,
            unobserved_limit_ms: 10 * MINUTE_MS,
            history_scans_min: 3,
            history_scan_span_ms: HOUR_MS,
            history_scan_interval_ms: 30 * MINUTE_MS,
            refusal_retries_max: 1,
            #[cfg(feature = "planted-bugs")]
            planted_bug: None,
        }
    }
}

impl Policy {
    /// Checks a policy given from outside (`HANDOFFS_POLICY`) against SPEC §2: timings may be
    /// shortened (for drills and tests), never lengthened; the resend and refusal limits may
    /// never rise above SPEC's, nor may fewer history scans cancel a delivery. Returns what
    /// differs from SPEC, one `name value (SPEC value)` each, for `status` to show.
    pub fn check_against_spec(&self) -> Result<Vec<String>, String> {
        let spec = Policy::default();
        let limits = [
            (
                "error_resends_max",
                self.error_resends_max,
                spec.error_resends_max,
            ),
            (
                "interrupt_resends_max",
                self.interrupt_resends_max,
                spec.interrupt_resends_max,
            ),
            (
                "refusal_retries_max",
                self.refusal_retries_max,
                spec.refusal_retries_max,
            ),
        ];
        let mut differs = Vec::new();
        for (name, value, max) in limits {
            if value > max {
                return Err(format!(
                    "{name} may not be raised above SPEC's {max} (given {value})"
                ));
            }
            if value != max {
                differs.push(format!("{name} {value} (SPEC {max})"));
            }
        }
        if self.history_scans_min < spec.history_scans_min {
            return Err(format!(
                "history_scans_min may not be lowered below SPEC's {} (given {})",
                spec.history_scans_min, self.history_scans_min
            ));
        }
        if self.history_scans_min != spec.history_scans_min {
            differs.push(format!(
                "history_scans_min {} (SPEC {})",
                self.history_scans_min, spec.history_scans_min
            ));
        }
        let timings = [
            (
                "interrupt_resend_wait_ms",
                self.interrupt_resend_wait_ms,
                spec.interrupt_resend_wait_ms,
            ),
            (
                "resend_window_ms",
                self.resend_window_ms,
                spec.resend_window_ms,
            ),
            (
                "sending_timeout_ms",
                self.sending_timeout_ms,
                spec.sending_timeout_ms,
            ),
            (
                "unobserved_limit_ms",
                self.unobserved_limit_ms,
                spec.unobserved_limit_ms,
            ),
            (
                "history_scan_span_ms",
                self.history_scan_span_ms,
                spec.history_scan_span_ms,
            ),
            (
                "history_scan_interval_ms",
                self.history_scan_interval_ms,
                spec.history_scan_interval_ms,
            ),
        ];
        for (name, value, max) in timings {
            if value > max {
                return Err(format!(
                    "{name} may only be shortened: SPEC's is {max}, given {value}"
                ));
            }
            if value != max {
                differs.push(format!("{name} {value} (SPEC {max})"));
            }
        }
        #[cfg(feature = "planted-bugs")]
        if let Some(bug) = self.planted_bug {
            differs.push(format!("planted bug {bug:?}"));
        }
        Ok(differs)
    }

    /// Whether `bug` is planted in this policy (always false without the test feature).
    #[allow(unused_variables)]
    pub fn planted(&self, bug: PlantedBug) -> bool {
        #[cfg(feature = "planted-bugs")]
        {
            self.planted_bug == Some(bug)
        }
        #[cfg(not(feature = "planted-bugs"))]
        {
            false
        }
    }
}

/// Known-wrong behaviours that tests plant to prove a check can fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlantedBug {
    /// Treat a busy recipient as idle (breaks G3).
    SendWhileBusy,
    /// Resend an UNCERTAIN delivery with a fresh request id (breaks G4).
    ResendFromUncertain,
    /// The engine writes before its reservation is committed (breaks G8; engine-level).
    ReserveAfterWrite,
    /// The send boundary hands the same write over again (breaks G2).
    WriteTwice,
    /// An outage the guard reports is ignored: attempts are spent during it (breaks G6).
    IgnoreOutage,
    /// Overdue work never reminds its sender (breaks G7; honoured by `work::reminder_due`,
    /// which the engine and the model world both decide by).
    NoReminder,
    /// The engine never schedules another look at an UNCERTAIN delivery (breaks liveness;
    /// engine-level).
    ScanNeverRescheduled,
    /// History scans cancel after 2 empty scans instead of SPEC's 3 (breaks G5).
    CancelEarly,
    /// The send boundary does not look at the recipient's activity again (breaks G3 when a
    /// turn starts between the reservation and the write).
    SkipBoundaryRecheck,
    /// An activity that cannot be verified is taken for idle (breaks "nothing is written
    /// while the activity is unknown").
    UnknownIsIdle,
    /// The destination is resolved when writing, from the registration as it is then, and a
    /// changed route is not seen as a new destination (breaks G1).
    ResolveAtWrite,
    /// A write whose outcome is unknown (a timeout, a server error) is written again at once
    /// with the same request id, the naive retry (breaks G2; engine-level).
    RetryUnknownWrite,
    /// A write the app turned away because its session was busy at that moment counts as a
    /// refusal: a second such race ends the delivery FAILED, never delivered, where SPEC says
    /// wait (breaks G3's "a busy recipient is waited for").
    BusyAtWriteRefused,
    /// A chain's cancel marks the chain but leaves its pending deliveries to the engine,
    /// which writes them (breaks "nothing is written after its chain was cancelled";
    /// service-level).
    CancelLeavesPending,
    /// The engine's pass forgets a cancel: a delivery of a cancelled chain that waits again
    /// (its marked write turned away busy or refused, or its turn errored with a resend
    /// planned) is reserved and written anyway (breaks "nothing is written after its chain
    /// was cancelled"; the cancel itself is right).
    RequeueAfterCancel,
    /// A chain's cancel takes a write that is reserved but not yet written for one under way:
    /// it is marked and left to go out (breaks "nothing is written after its chain was
    /// cancelled").
    CancelMarksReserved,
    /// A delivery FAILED for good is not kept as a dead letter (breaks "what cannot be
    /// delivered lands in the dead-letter list").
    FinalFailureNotKept,
    /// A budget's check looks at what was spent before a spend, not at what would be after
    /// it, so the spend that crosses the limit passes (breaks "no chain spends beyond its
    /// budget").
    SpendPastBudget,
    /// A publish tells every subscriber but the last (by id) of its topic (breaks "a publish
    /// reaches each subscriber once"; service-level).
    PublishMissesSubscriber,
    /// A fan-out's deadline passes without its partial join: the sender waits for ever
    /// (breaks "joined at the deadline"; service-level, in the engine's housekeeping).
    DeadlineNeverJoins,
}

#[cfg(test)]
mod tests {
    use super::Policy;

    #[test]
    fn timings_may_be_shortened_but_limits_never_raised() {
        let spec = Policy::default();
        assert_eq!(spec.check_against_spec(), Ok(Vec::new()));
        let fast = Policy {
            sending_timeout_ms: 1_500,
            ..Policy::default()
        };
        assert_eq!(
            fast.check_against_spec(),
            Ok(vec!["sending_timeout_ms 1500 (SPEC 60000)".to_owned()])
        );
        for broken in [
            Policy {
                error_resends_max: 3,
                ..Policy::default()
            },
            Policy {
                interrupt_resends_max: 2,
                ..Policy::default()
            },
            Policy {
                refusal_retries_max: 2,
                ..Policy::default()
            },
            Policy {
                history_scans_min: 1,
                ..Policy::default()
            },
            Policy {
                sending_timeout_ms: 120_000,
                ..Policy::default()
            },
        ] {
            assert!(broken.check_against_spec().is_err(), "{broken:?}");
        }
    }
}
