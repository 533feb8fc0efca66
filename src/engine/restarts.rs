//! When an engine on PostgreSQL that failed starts again (`run`, `serve`, `demo`).
//!
//! An engine on a shared database fails when its session ends under it and takes a batch's
//! commit with it (a network cut, the server restarted) or when the server refuses its writes
//! (read-only, out of space). What it did not commit it never acted on (every effect waits for
//! its reservation's commit), and its leases pass to whichever engine looks first once their
//! session is gone, so starting again on a new session is safe: the engine's start reads
//! everything afresh. On SQLite a failing engine stops instead: its file is gone or broken,
//! which another try does not mend.

use std::time::Duration;

/// An engine that ran this long before it failed starts again after [`FIRST`]; one that
/// failed sooner waits twice as long as the last time, up to this, so a failure that persists
/// (a read-only server) is said once a minute, not looped.
pub const CALM: Duration = Duration::from_secs(60);

/// The pause after a failure that came [`CALM`] or more after the engine's start.
pub const FIRST: Duration = Duration::from_secs(1);

/// The pauses between an engine's failures and its next start.
#[derive(Debug)]
pub struct Restarts {
    pause: Duration,
}

impl Default for Restarts {
    fn default() -> Restarts {
        Restarts { pause: FIRST / 2 }
    }
}

impl Restarts {
    /// The pause before the next start, for an engine that ran `ran` before it failed.
    pub fn after(&mut self, ran: Duration) -> Duration {
        self.pause = if ran >= CALM {
            FIRST
        } else {
            (self.pause * 2).min(CALM)
        };
        self.pause
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quick_failures_double_the_pause_up_to_a_minute_and_a_calm_run_resets_it() {
        let mut r = Restarts::default();
        let quick = Duration::from_millis(10);
        let pauses: Vec<u64> = (0..8).map(|_| r.after(quick).as_secs()).collect();
        assert_eq!(pauses, [1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(r.after(CALM), FIRST);
        assert_eq!(r.after(quick), FIRST * 2);
    }
}
