//! Recipient leases across engines (issue 17), free of IO: the rules by which one engine at a
//! time serves a recipient, each pass of the lease to another engine adding one to its
//! fencing token, and until when an engine may still act on a lease by its own clock.
//!
//! The store applies [`take`], [`renew`] and [`hold`] in SQL, in the transaction of the
//! engine's statement (a differential test in `tests/leases.rs` holds the SQL to these
//! functions case by case, on both backends); the service keeps each engine's own deadline by
//! [`deadline`] and checks it with [`may_write`] right before a write; the model checker
//! explores them with engines that pause, crash and lose their sessions
//! (`model/tests/fencing.rs`).

use crate::Millis;

/// A recipient's lease as the database holds it, for engines named by `E`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Lease<E> {
    /// The engine that holds it (or held it last).
    pub engine: E,
    /// The fencing token: one more each time the lease passed to another engine.
    pub fence: i64,
    /// When it expires unless renewed; [`Millis`]`(0)` once its engine let it go.
    pub expires_at: Millis,
}

/// The lease `engine` holds after asking for it at `now` (for `lease_ms`), or `None` when
/// another engine holds it: a recipient nobody leased yet gets token 1; the lease of `engine`
/// itself is extended with its token unchanged; another engine's passes to `engine`, its
/// token one higher, once it expired at `now` (or was let go) or the holder's server session
/// is gone (`holder_alive` false: a killed engine's recipients are taken over at once).
pub fn take<E: Clone + PartialEq>(
    current: Option<&Lease<E>>,
    engine: &E,
    now: Millis,
    lease_ms: u64,
    holder_alive: bool,
) -> Option<Lease<E>> {
    let expires_at = now.plus_ms(lease_ms);
    match current {
        None => Some(Lease {
            engine: engine.clone(),
            fence: 1,
            expires_at,
        }),
        Some(l) if l.engine == *engine => Some(Lease {
            expires_at,
            ..l.clone()
        }),
        Some(l) if l.expires_at <= now || !holder_alive => Some(Lease {
            engine: engine.clone(),
            fence: l.fence + 1,
            expires_at,
        }),
        Some(_) => None,
    }
}

/// The lease after `engine` renews it at `now`: extended while it is still `engine`'s and was
/// not let go, expired or not (nobody took it meanwhile, or it would name another engine).
pub fn renew<E: Clone + PartialEq>(
    current: &Lease<E>,
    engine: &E,
    now: Millis,
    lease_ms: u64,
) -> Option<Lease<E>> {
    (current.engine == *engine && current.expires_at > Millis(0)).then(|| Lease {
        expires_at: now.plus_ms(lease_ms),
        ..current.clone()
    })
}

/// Whether the lease is still `engine`'s with the token `fence` (expired or not: nobody took
/// it meanwhile, or it would name another engine with a higher token).
pub fn is_holder<E: PartialEq>(current: Option<&Lease<E>>, engine: &E, fence: i64) -> bool {
    current.is_some_and(|l| l.engine == *engine && l.fence == fence)
}

/// The fencing check of every step an engine commits: the lease extended from `now`, when it
/// is still `engine`'s with the token `fence` the engine took; `None` when it passed to
/// another engine (the step is refused and nothing of it is committed).
pub fn hold<E: Clone + PartialEq>(
    current: Option<&Lease<E>>,
    engine: &E,
    fence: i64,
    now: Millis,
    lease_ms: u64,
) -> Option<Lease<E>> {
    current
        .filter(|_| is_holder(current, engine, fence))
        .map(|l| Lease {
            expires_at: now.plus_ms(lease_ms),
            ..l.clone()
        })
}

/// The lease after `engine` lets it go: it expires at once (another engine may take it).
pub fn release<E: Clone + PartialEq>(current: &Lease<E>, engine: &E) -> Lease<E> {
    if current.engine == *engine {
        Lease {
            expires_at: Millis(0),
            ..current.clone()
        }
    } else {
        current.clone()
    }
}

/// The margin an engine keeps before its lease's expiry: a fifth of the lease, at least
/// 500 ms (for the time between its last check and its write, and clocks a little apart).
pub fn margin_ms(lease_ms: u64) -> u64 {
    (lease_ms / 5).max(500)
}

/// Until when an engine may act on a lease that a statement it started at `started` took or
/// extended: the lease less the margin, counted from before the statement (so however long
/// the statement took, the deadline falls before the expiry the database recorded).
pub fn deadline(started: Millis, lease_ms: u64) -> Millis {
    started.plus_ms(lease_ms.saturating_sub(margin_ms(lease_ms)))
}

/// Whether an engine whose own deadline for the lease is `until` may write at `now`.
pub fn may_write(until: Millis, now: Millis) -> bool {
    now < until
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: u64 = 5_000;

    fn lease(engine: u8, fence: i64, expires_at: u64) -> Lease<u8> {
        Lease {
            engine,
            fence,
            expires_at: Millis(expires_at),
        }
    }

    #[test]
    fn a_lease_passes_only_when_expired_or_its_holder_is_gone_and_its_token_then_grows() {
        let now = Millis(10_000);
        assert_eq!(take(None, &0, now, L, true), Some(lease(0, 1, 15_000)));
        let held = lease(0, 3, 12_000);
        assert_eq!(
            take(Some(&held), &0, now, L, true),
            Some(lease(0, 3, 15_000))
        );
        assert_eq!(take(Some(&held), &1, now, L, true), None);
        assert_eq!(
            take(Some(&held), &1, now, L, false),
            Some(lease(1, 4, 15_000))
        );
        let expired = lease(0, 3, 10_000);
        assert_eq!(
            take(Some(&expired), &1, now, L, true),
            Some(lease(1, 4, 15_000))
        );
        let let_go = release(&held, &0);
        assert_eq!(let_go.expires_at, Millis(0));
        assert_eq!(
            take(Some(&let_go), &1, now, L, true),
            Some(lease(1, 4, 15_000))
        );
        assert_eq!(release(&held, &1), held, "only the holder lets a lease go");
    }

    #[test]
    fn only_the_holder_with_its_token_holds_or_renews_a_lease() {
        let now = Millis(20_000);
        let held = lease(0, 3, 12_000);
        assert_eq!(hold(Some(&held), &0, 3, now, L), Some(lease(0, 3, 25_000)));
        assert_eq!(hold(Some(&held), &0, 2, now, L), None);
        assert_eq!(hold(Some(&held), &1, 3, now, L), None);
        assert_eq!(hold(None, &0, 1, now, L), None);
        assert_eq!(renew(&held, &0, now, L), Some(lease(0, 3, 25_000)));
        assert_eq!(renew(&held, &1, now, L), None);
        assert_eq!(renew(&release(&held, &0), &0, now, L), None);
    }

    #[test]
    fn an_engine_stops_writing_a_margin_before_its_lease_expires() {
        assert_eq!(margin_ms(20_000), 4_000);
        assert_eq!(margin_ms(1_000), 500);
        let until = deadline(Millis(1_000), 20_000);
        assert_eq!(until, Millis(17_000));
        assert!(may_write(until, Millis(16_999)));
        assert!(!may_write(until, Millis(17_000)));
    }
}
