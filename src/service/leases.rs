//! An engine's recipient leases (issue 17): which recipients this engine serves now, with
//! the fencing token of each, and until when it may still act on them by its own clock.
//!
//! A lease is taken before the engine steps any delivery of the recipient, renewed while it
//! serves it, and let go when it stops serving it. Every step the engine commits checks the
//! token in the step's own transaction (`deliveries::steps_in`), and before each write the
//! engine checks it still holds the lease by its own clock ([`Service::may_write_to`]): the
//! lease counts as its own only until a margin before it expires in the database, so an
//! engine paused past its lease (a stopped process, a frozen VM, a long GC-like stall) finds
//! it gone when it wakes, whatever it was doing, and writes nothing. The rules themselves
//! (when a lease passes, its token, an engine's deadline) are `model::lease`'s.

use super::{Result, Service, ServiceError};
use crate::store::{LeaseRow, millis};
use model::Millis;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The lease of housekeeping (enrolment, reminders, fan-out deadlines), which one engine of a
/// shared database runs at a time: a name no agent can have (`~` is not in an agent id).
pub const HOUSEKEEPING: &str = "~housekeeping";

/// How long a lease lasts unless renewed (`HANDOFFS_LEASE_MS` shortens it for tests).
pub const LEASE_MS: u64 = 20_000;

/// The shortest and longest lease `HANDOFFS_LEASE_MS` may ask for.
pub const LEASE_MS_RANGE: std::ops::RangeInclusive<u64> = 1_000..=600_000;

/// This engine's identity and its leases.
#[derive(Debug)]
pub struct Fencing {
    /// Unique to this engine process: its machine, pid and a random part.
    pub engine: String,
    /// The machine it runs on (agents bound to another machine are not served here).
    pub host: String,
    /// How long a lease lasts unless renewed.
    pub lease_ms: u64,
    held: HashMap<String, Held>,
}

#[derive(Clone, Copy, Debug)]
struct Held {
    fence: i64,
    /// Until when this engine may act on the lease by its own clock: a margin before the
    /// lease expires in the database ...
    until: Millis,
    /// ... and the same by the monotonic clock, which no adjustment of the wall clock moves.
    until_mono: Instant,
    /// When a job of this engine last served the recipient.
    used: Millis,
}

impl Fencing {
    /// An engine on `host` with leases of `lease_ms`.
    pub fn new(host: &str, lease_ms: u64) -> Fencing {
        let random: u32 = rand::random();
        Fencing::named(
            &format!("{host}/{}/{random:08x}", std::process::id()),
            host,
            lease_ms,
        )
    }

    /// The engine `engine` on `host` with leases of `lease_ms` (the simulation names its
    /// engines, so a seed replays byte for byte).
    pub fn named(engine: &str, host: &str, lease_ms: u64) -> Fencing {
        Fencing {
            engine: engine.to_owned(),
            host: host.to_owned(),
            lease_ms,
            held: HashMap::new(),
        }
    }

    /// How often the engine renews its leases: four times a lease.
    pub fn renew_every(&self) -> u64 {
        self.lease_ms / 4
    }

    /// The token of the lease this engine holds on `recipient`, if any.
    pub fn fence_of(&self, recipient: &str) -> Option<i64> {
        self.held.get(recipient).map(|h| h.fence)
    }

    /// This engine's own deadlines for a lease that was taken or extended to `now` plus a
    /// lease by a statement started at `now` (the service's clock) and `started` (the
    /// monotonic one).
    fn deadlines(&self, now: Millis, started: Instant) -> (Millis, Instant) {
        let until = model::lease::deadline(now, self.lease_ms);
        (until, started + Duration::from_millis(until.since(now)))
    }

    /// Records that a committed step extended the lease on `recipient` (see
    /// `deliveries::steps_in`), from `now` and `started`.
    pub(super) fn extended(&mut self, recipient: &str, now: Millis, started: Instant) {
        let (until, until_mono) = self.deadlines(now, started);
        if let Some(h) = self.held.get_mut(recipient) {
            h.until = h.until.max(until);
            h.until_mono = h.until_mono.max(until_mono);
        }
    }
}

/// The machine this process runs on: `HANDOFFS_HOST`, else the system's host name
/// (`gethostname`).
pub fn this_host() -> String {
    if let Ok(host) = std::env::var("HANDOFFS_HOST")
        && !host.trim().is_empty()
    {
        return host.trim().to_owned();
    }
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// The lease length asked for by `HANDOFFS_LEASE_MS`, or [`LEASE_MS`].
///
/// # Errors
/// A value that is not a whole number of milliseconds within [`LEASE_MS_RANGE`].
pub fn lease_ms_from_env() -> std::result::Result<u64, String> {
    match std::env::var("HANDOFFS_LEASE_MS") {
        Err(_) => Ok(LEASE_MS),
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(ms) if LEASE_MS_RANGE.contains(&ms) => Ok(ms),
            _ => Err(format!(
                "HANDOFFS_LEASE_MS must be a number of milliseconds from {} to {}, not {v:?}",
                LEASE_MS_RANGE.start(),
                LEASE_MS_RANGE.end()
            )),
        },
    }
}

impl Service {
    /// Makes this service an engine's: it serves recipients under leases (see the module).
    pub fn fence_as(&mut self, fencing: Fencing) {
        self.fencing = Some(fencing);
    }

    /// The engine's identity and its leases, when this service is an engine's.
    pub fn fencing(&self) -> Option<&Fencing> {
        self.fencing.as_ref()
    }

    /// Who asks for due work: the engine and its machine (empty for a service that is not an
    /// engine's, which then sees no leased recipient as its own).
    pub(super) fn asker(&self) -> (String, String) {
        self.fencing.as_ref().map_or_else(
            || (String::new(), this_host()),
            |f| (f.engine.clone(), f.host.clone()),
        )
    }

    /// Takes the leases of `recipients` this engine does not hold with time to spare, in one
    /// transaction: the recipients it holds now, in the order given. A recipient another
    /// engine holds is left out.
    pub fn take_leases(&mut self, recipients: &[String]) -> Result<Vec<String>> {
        let Some(fencing) = self.fencing.as_ref() else {
            return Ok(recipients.to_vec());
        };
        let now = self.now();
        let started = Instant::now();
        let spare = fencing.lease_ms / 2;
        let wanted: Vec<&String> = recipients
            .iter()
            .filter(|r| {
                fencing
                    .held
                    .get(r.as_str())
                    .is_none_or(|h| h.until <= now.plus_ms(spare))
            })
            .collect();
        if !wanted.is_empty() {
            let engine = fencing.engine.clone();
            let expires = millis(now.plus_ms(fencing.lease_ms));
            let taken = self.store.write(|tx| {
                let mut taken = Vec::new();
                for r in &wanted {
                    if let Some(fence) = tx.take_lease(r, &engine, millis(now), expires)? {
                        taken.push(((*r).clone(), fence));
                    }
                    // Test builds: a test may pause the engine here, inside the transaction.
                    crate::planted::hold_once("HANDOFFS_TEST_HOLD_IN_WRITE", r);
                }
                Ok::<_, crate::store::StoreError>(taken)
            })?;
            let fencing = self.fencing.as_mut().expect("checked above");
            let (until, until_mono) = fencing.deadlines(now, started);
            for r in &wanted {
                fencing.held.remove(r.as_str());
            }
            for (r, fence) in taken {
                if let Some(before) = self.fencing.as_ref().and_then(|f| f.fence_of(&r))
                    && before != fence
                {
                    tracing::info!(recipient = %r, fence, "recipient lease taken anew");
                }
                self.fencing.as_mut().expect("checked above").held.insert(
                    r,
                    Held {
                        fence,
                        until,
                        until_mono,
                        used: now,
                    },
                );
            }
        }
        let fencing = self.fencing.as_mut().expect("checked above");
        Ok(recipients
            .iter()
            .filter(|r| match fencing.held.get_mut(r.as_str()) {
                Some(h) => {
                    h.used = now;
                    true
                }
                None => false,
            })
            .cloned()
            .collect())
    }

    /// Renews the leases of recipients this engine served within the last half lease or is
    /// serving now (`serving`), and lets the others go, in one transaction. A lease found
    /// gone (taken by another engine after this one was paused) is forgotten.
    /// An engine that holds no lease writes nothing (an idle engine costs nothing).
    pub fn renew_leases(&mut self, serving: &dyn Fn(&str) -> bool) -> Result<()> {
        let Some(fencing) = self.fencing.as_ref().filter(|f| !f.held.is_empty()) else {
            return Ok(());
        };
        let now = self.now();
        let started = Instant::now();
        let idle: Vec<String> = fencing
            .held
            .iter()
            .filter(|(r, h)| !serving(r) && now.since(h.used) >= fencing.lease_ms / 2)
            .map(|(r, _)| r.clone())
            .collect();
        let engine = fencing.engine.clone();
        let expires = millis(now.plus_ms(fencing.lease_ms));
        let renewed = self.store.write(|tx| {
            for r in &idle {
                tx.release_lease(r, &engine)?;
            }
            tx.renew_leases(&engine, expires)
        })?;
        let fencing = self.fencing.as_mut().expect("checked above");
        let (until, until_mono) = fencing.deadlines(now, started);
        let mut kept = HashMap::new();
        for (r, fence) in renewed {
            if let Some(h) = fencing.held.get(&r)
                && h.fence == fence
            {
                kept.insert(
                    r,
                    Held {
                        until,
                        until_mono,
                        ..*h
                    },
                );
            }
        }
        for r in fencing.held.keys() {
            if !kept.contains_key(r) && !idle.contains(r) {
                tracing::warn!(recipient = %r, "recipient lease lost: another engine may serve it now");
            }
        }
        fencing.held = kept;
        Ok(())
    }

    /// Lets every lease of this engine go (an engine that stops): another engine may serve
    /// its recipients at once instead of after the leases expire.
    pub fn release_all_leases(&mut self) -> Result<()> {
        let Some(fencing) = self.fencing.as_mut().filter(|f| !f.held.is_empty()) else {
            return Ok(());
        };
        fencing.held.clear();
        let engine = fencing.engine.clone();
        Ok(self.store.write(|tx| tx.release_leases(&engine))?)
    }

    /// Forgets the lease of `recipient` (a step found it moved to another engine).
    pub fn forget_lease(&mut self, recipient: &str) {
        if let Some(f) = self.fencing.as_mut() {
            f.held.remove(recipient);
        }
    }

    /// Whether this engine may write to `recipient` now: it holds the lease and, by its own
    /// clocks (the service's and the monotonic one), the lease has not come within its margin
    /// of expiring. A service that is not an
    /// engine's may always.
    pub fn may_write_to(&self, recipient: &str) -> bool {
        let Some(fencing) = self.fencing.as_ref() else {
            return true;
        };
        let now = self.now();
        fencing
            .held
            .get(recipient)
            .is_some_and(|h| model::lease::may_write(h.until, now) && Instant::now() < h.until_mono)
    }

    /// The check right before the write of delivery `id` to `recipient`: this engine's own
    /// deadline for the lease ([`Service::may_write_to`]), then the lease in the database,
    /// read now: still this engine's with the token the delivery's reservation was made
    /// under (`deliveries.fence`; `model::lease::is_holder`). The read catches what no clock
    /// of the engine can: its server session was cut (a network fault, a server restart) and
    /// another engine took the lease at once, while this one, unaware, still had time by its
    /// own deadline; or the lease passed to another engine and came back since the
    /// reservation. A read that fails is an error: no write then.
    ///
    /// An engine past its own deadline (back from a stall) takes the lease up again when
    /// nobody took it meanwhile (`hold`, in a transaction of its own) and writes after all:
    /// it would otherwise withhold a write that no other engine was in the way of.
    ///
    /// `Some(token)` to write with (`None` inside: a service that is not an engine's, which
    /// may always write), or `None`: no write.
    pub fn may_write_now(&mut self, recipient: &str, id: &str) -> Result<Option<Option<i64>>> {
        let Some(fencing) = self.fencing.as_ref() else {
            return Ok(Some(None));
        };
        let Some(fence) = fencing.fence_of(recipient) else {
            return Ok(None);
        };
        let engine = fencing.engine.clone();
        let (reserved, row) = self
            .store
            .read_one_statement(|tx| tx.fence_and_lease(id, recipient))?;
        if reserved != Some(fence) {
            return Ok(None);
        }
        if !self.may_write_to(recipient) {
            let now = self.now();
            let started = Instant::now();
            let until = millis(now.plus_ms(fencing.lease_ms));
            let held = self
                .store
                .write(|tx| tx.hold_lease(recipient, &engine, fence, until))?;
            if held && let Some(f) = self.fencing.as_mut() {
                f.extended(recipient, now, started);
                tracing::info!(%recipient, fence, "recipient lease taken up again after a stall");
            }
            return Ok(held.then_some(Some(fence)));
        }
        let current = row.map(|r| model::lease::Lease {
            engine: r.engine,
            fence: r.fence,
            expires_at: Millis(u64::try_from(r.expires_at).unwrap_or(0)),
        });
        Ok(model::lease::is_holder(current.as_ref(), &engine, fence).then_some(Some(fence)))
    }

    /// Every recipient lease in the database.
    pub fn leases(&mut self) -> Result<Vec<LeaseRow>> {
        // The method path is not general enough over `Tx`'s lifetime: a closure it is.
        #[allow(clippy::redundant_closure_for_method_calls)]
        Ok(self.store.read(|tx| tx.leases())?)
    }

    /// The error of a step or write refused because this engine no longer holds the lease.
    pub fn fenced(recipient: &str, engine: &str) -> ServiceError {
        ServiceError::Fenced(format!(
            "engine {engine} no longer holds the lease on {recipient}: another engine serves it now, so this one writes nothing more to it"
        ))
    }
}
