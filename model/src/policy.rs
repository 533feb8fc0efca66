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
    /// The destination is resolved when writing, from the registration as it is then, and a
    /// changed route is not seen as a new destination (breaks G1).
    ResolveAtWrite,
}
