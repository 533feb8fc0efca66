//! Recipient leases and fencing in process, with an injected clock: two engines' services on
//! one database. The lease passes only when it expired (or its engine's session is gone),
//! each pass adds one to its token, and a step or write of the engine that lost it is
//! refused in the step's own transaction and by the engine's own clock.

mod common;

use handoffs::service::leases::Fencing;
use handoffs::service::{Service, ServiceError};
use handoffs::store::Store;
use model::{EventKind, Millis, Policy};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

const T0: u64 = 1_800_000_000_000;

/// Engine `name`'s service on the database at `db`, reading the time from `clock`, with
/// leases of 2 s.
fn engine_service(db: &std::path::Path, clock: &Arc<AtomicU64>, name: &str) -> Service {
    let clock = clock.clone();
    let mut s = Service::with_clock(
        Store::open(db).unwrap(),
        Arc::new(move || Millis(clock.load(Ordering::SeqCst))),
    );
    s.fence_as(Fencing::new(name, 2_000));
    s
}

/// A step of delivery `id` (the time check), committed through the service's one path.
fn step(s: &mut Service, id: &str) -> Result<(), ServiceError> {
    s.commit_step(
        id,
        &Policy::default(),
        |_| Ok(EventKind::TimePassed),
        &|_, _, _, _| None,
    )
    .map(drop)
}

#[test]
fn a_lease_passes_only_once_expired_and_the_engine_that_lost_it_commits_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("h.sqlite3");
    let clock = Arc::new(AtomicU64::new(T0));
    {
        let (store, _) = Store::init(&db).unwrap();
        let mut s = Service::new(store);
        s.add_agent("lead", Some("demo"), None, None, None, &[])
            .unwrap();
        s.add_agent("dev", Some("demo"), None, None, None, &[])
            .unwrap();
    }
    let mut a = engine_service(&db, &clock, "machine-a");
    let mut b = engine_service(&db, &clock, "machine-b");
    let id = a
        .send("lead", "dev", "first", None, None, None)
        .unwrap()
        .message
        .id;
    let dev = vec!["dev".to_owned()];

    assert_eq!(a.take_leases(&dev).unwrap(), dev, "a takes the free lease");
    assert!(b.take_leases(&dev).unwrap().is_empty(), "b waits for it");
    assert_eq!(a.fencing().unwrap().fence_of("dev"), Some(1));
    assert!(a.may_write_to("dev"));
    step(&mut a, &id).unwrap();

    // A renewal keeps it a's with the same token, for another lease (a's own deadline: a
    // margin of 500 ms before it expires).
    clock.fetch_add(1_500, Ordering::SeqCst);
    a.renew_leases(&|r| r == "dev").unwrap();
    clock.fetch_add(1_400, Ordering::SeqCst);
    assert!(
        b.take_leases(&dev).unwrap().is_empty(),
        "renewed: still a's"
    );
    assert!(a.may_write_to("dev"));

    // a stalls past its lease: by its own clock it may no longer write, and b takes over.
    clock.fetch_add(2_100, Ordering::SeqCst);
    assert!(!a.may_write_to("dev"), "a's own deadline passed");
    assert_eq!(b.take_leases(&dev).unwrap(), dev);
    assert_eq!(b.fencing().unwrap().fence_of("dev"), Some(2), "one more");
    step(&mut b, &id).unwrap();
    match step(&mut a, &id) {
        Err(ServiceError::Fenced(why)) => assert!(why.contains("no longer holds the lease on dev")),
        other => panic!("a's step after b took the lease: {other:?}"),
    }
    // a's renewal finds the lease gone and forgets it; a cannot take it back while b holds it.
    a.renew_leases(&|_| true).unwrap();
    assert_eq!(a.fencing().unwrap().fence_of("dev"), None);
    assert!(a.take_leases(&dev).unwrap().is_empty());

    // b stops and lets its leases go: a takes the recipient at once, with the next token.
    b.release_all_leases().unwrap();
    assert_eq!(a.take_leases(&dev).unwrap(), dev);
    assert_eq!(a.fencing().unwrap().fence_of("dev"), Some(3));
    step(&mut a, &id).unwrap();
}

#[test]
fn a_service_that_is_no_engine_steps_without_a_lease() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("h.sqlite3");
    let (store, _) = Store::init(&db).unwrap();
    let mut s = Service::new(store);
    s.add_agent("lead", Some("demo"), None, None, None, &[])
        .unwrap();
    s.add_agent("dev", Some("demo"), None, None, None, &[])
        .unwrap();
    let id = s
        .send("lead", "dev", "first", None, None, None)
        .unwrap()
        .message
        .id;
    // A person's release goes through the same commit path and needs no lease.
    step(&mut s, &id).unwrap();
    assert!(s.may_write_to("dev"));
}

/// One operation on a lease, as an engine's statement makes it.
#[derive(Clone, Copy, Debug)]
enum Op {
    Take,
    Renew,
    /// The fencing check with this token.
    Hold(i64),
    Release,
}

/// The store's SQL for leases does what `model::lease` says, case by case: random sequences
/// of takes, renewals, fencing checks and releases by two engines at times that run past
/// leases, applied to the store and to the model's rules side by side, agree on every answer
/// and on the stored lease after each step. Each operation goes through one of two
/// connections, and the second one's session is ended now and then: on PostgreSQL a lease
/// last written through a session that has ended is the model's `holder_alive = false`
/// (another engine may take it before it expires). On PostgreSQL too when a server is given.
#[test]
fn the_stores_lease_statements_follow_the_models_rules() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = dir.path().join("h.sqlite3");
    Store::init(&sqlite).unwrap();
    lease_rules_agree(&sqlite);
    if let Some(admin) = common::postgres_or_skip("the lease statements on PostgreSQL") {
        let url = common::fresh_postgres(&admin);
        let path = std::path::PathBuf::from(&url);
        Store::init(&path).unwrap();
        lease_rules_agree(&path);
    }
}

/// The second connection of [`lease_rules_agree`]: its store, and which of its sessions it
/// is (a new one after each end).
struct Side {
    store: Option<Store>,
    generation: u32,
}

/// Ends `side`'s session, and waits until the server no longer lists it (on PostgreSQL a
/// session's end reaches `pg_stat_activity` a moment after its socket closes).
fn end_session(side: &mut Side, db: &std::path::Path) {
    let Some(store) = side.store.take() else {
        return;
    };
    side.generation += 1;
    let pid = store.session_pid();
    drop(store);
    let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) else {
        return;
    };
    let mut client = ::postgres::Client::connect(&db.to_string_lossy(), ::postgres::NoTls).unwrap();
    let listed = |c: &mut ::postgres::Client| -> bool {
        c.query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
            &[&pid],
        )
        .unwrap()
        .get::<_, i64>(0)
            > 0
    };
    let t = std::time::Instant::now();
    while listed(&mut client) {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "session {pid} still listed 10 s after its end"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

#[allow(clippy::too_many_lines)]
fn lease_rules_agree(db: &std::path::Path) {
    use model::lease::{self, Lease};
    const L: u64 = 4_000;
    let sessions_end = common::is_postgres(db);
    let mut main = Store::open(db).unwrap();
    let mut side = Side {
        store: None,
        generation: 0,
    };
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |n: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % n
    };
    let (mut checked, mut taken_from_the_gone) = (0, 0);
    for case in 0..120 {
        let agent = format!("r{case}");
        let engines = [format!("a{case}"), format!("b{case}")];
        let mut now = 1_000_u64;
        let mut model: Option<Lease<String>> = None;
        // The session the lease was last written through: `None` for the main one,
        // `Some(g)` for the side's generation `g`.
        let mut written_by: Option<u32> = None;
        for _ in 0..10 {
            now += next(4) * 1_000;
            if next(6) == 0 {
                end_session(&mut side, db);
            }
            let through_side = next(2) == 0;
            let e = usize::try_from(next(2)).unwrap();
            let op = match next(4) {
                0 => Op::Take,
                1 => Op::Renew,
                2 => Op::Hold(i64::try_from(next(3)).unwrap() + 1),
                _ => Op::Release,
            };
            let engine = &engines[e];
            let expires = i64::try_from(now + L).unwrap();
            let at = i64::try_from(now).unwrap();
            let store = if through_side {
                side.store.get_or_insert_with(|| Store::open(db).unwrap())
            } else {
                &mut main
            };
            let (stored, answer) = store
                .write(|tx| {
                    let answer = match op {
                        Op::Take => format!("{:?}", tx.take_lease(&agent, engine, at, expires)?),
                        Op::Renew => format!(
                            "{:?}",
                            tx.renew_leases(engine, expires)?
                                .into_iter()
                                .map(|(_, f)| f)
                                .collect::<Vec<_>>()
                        ),
                        Op::Hold(fence) => {
                            format!("{:?}", tx.hold_lease(&agent, engine, fence, expires)?)
                        }
                        Op::Release => {
                            tx.release_lease(&agent, engine)?;
                            "()".to_owned()
                        }
                    };
                    // The check before a write reads the same lease (with no delivery).
                    let (no_fence, lease) = tx.fence_and_lease("no such delivery", &agent)?;
                    assert_eq!(no_fence, None);
                    assert_eq!(lease, tx.lease_of(&agent)?);
                    Ok::<_, handoffs::store::StoreError>((lease, answer))
                })
                .unwrap();
            let session = through_side.then_some(side.generation);
            let holder_alive = !sessions_end
                || written_by.is_none_or(|g| side.store.is_some() && g == side.generation);
            let before = model.clone();
            let expected = match op {
                Op::Take => {
                    let taken = lease::take(model.as_ref(), engine, Millis(now), L, holder_alive);
                    let fence = taken.as_ref().map(|l| l.fence);
                    if taken.is_some() {
                        let still_live = before
                            .as_ref()
                            .is_some_and(|l| l.engine != *engine && l.expires_at > Millis(now));
                        if still_live {
                            taken_from_the_gone += 1;
                        }
                        model = taken;
                        written_by = session;
                    }
                    format!("{fence:?}")
                }
                Op::Renew => {
                    let renewed = model
                        .as_ref()
                        .and_then(|l| lease::renew(l, engine, Millis(now), L));
                    let fences: Vec<i64> = renewed.iter().map(|l| l.fence).collect();
                    if renewed.is_some() {
                        model = renewed;
                        written_by = session;
                    }
                    format!("{fences:?}")
                }
                Op::Hold(fence) => {
                    let held = lease::hold(model.as_ref(), engine, fence, Millis(now), L);
                    let ok = held.is_some();
                    if ok {
                        model = held;
                        written_by = session;
                    }
                    format!("{ok:?}")
                }
                Op::Release => {
                    model = model.map(|l| lease::release(&l, engine));
                    "()".to_owned()
                }
            };
            let stored = stored.map(|r| Lease {
                engine: r.engine,
                fence: r.fence,
                expires_at: Millis(u64::try_from(r.expires_at).unwrap()),
            });
            assert_eq!(
                (&answer, &stored),
                (&expected, &model),
                "case {case}: {op:?} by {engine} at {now} through the {} session (the lease's \
                 holder alive: {holder_alive}): the store's answer and lease against the model's",
                if through_side { "second" } else { "first" }
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 1_200);
    if sessions_end {
        // The case this connection pair is for happened, or the check proved nothing.
        assert!(
            taken_from_the_gone > 0,
            "no lease was taken before its expiry from a holder whose session had ended"
        );
    }
}
