//! The engine: passes over due deliveries, and a loop that runs them as soon as there is new
//! work. For each delivery it loads the stored record, calls `model::step` with the facts it
//! gathered, commits the result in one short transaction, and only then performs the effect the
//! step asked for (commit before effect). It holds no delivery rule of its own.
//!
//! Recipients are served concurrently, each by one job, and the deliveries of one recipient
//! one after another: a slow or waiting recipient never holds up the others, and a recipient
//! never sees two of our writes at once. The jobs run on the engine's own task (no threads)
//! and share its one SQLite connection (a connection per job would empty every other job's
//! page cache on each commit; and a connection's own commits leave its `data_version` alone,
//! so only other processes wake the watch): a transaction is synchronous, so transactions never
//! interleave while the waits on agents do.
//!
//! Only one engine delivers per database: it holds an exclusive lock on `<db>.engine` for its
//! whole life (released by the OS if it is killed); another engine skips its pass and says so.

pub mod restarts;

use crate::adapter::outage;

use crate::adapter::{Adapters, Write};
use crate::service::{self, Service, ServiceError, StepReads, card};
use crate::store::{AgentRow, QUEUE_HEADS, millis};
use futures_util::StreamExt;
use futures_util::future::LocalBoxFuture;
use futures_util::stream::FuturesUnordered;
use model::states::BusyReason;
use model::{Change, Delivery, Effect, Event, EventKind, Millis, Policy};
use serde::Serialize;
use serde_json::Value;
use std::cell::{RefCell, RefMut};
use std::collections::{HashSet, VecDeque};
use std::rc::Rc;
use std::time::{Duration, Instant};

/// How many deliveries one pass looks at, at most.
const PASS_DELIVERIES_MAX: i64 = 2_000;
/// How many recipients are served at once, at most.
const JOBS_MAX: usize = 64;
/// How many deliveries one job takes through before it hands back (run mode).
const JOB_DELIVERIES_MAX: usize = 256;
/// How often enrolment of stragglers and reminders run at most.
const HOUSEKEEPING_INTERVAL_MS: u64 = 1_000;
/// Housekeeping runs when another process committed, when a reminder falls due, and at the
/// latest this long after the last run (a safety net: sends enrol their own deliveries).
const HOUSEKEEPING_MAX_INTERVAL_MS: u64 = 60_000;
/// How often an engine with nothing to report still saves its report (its heartbeat: the
/// page and the MCP servers call an engine quiet after two minutes without one).
const REPORT_HEARTBEAT_MS: u64 = 10_000;
/// How often a running engine checks the database for another process's commit (its own
/// jobs share its connection, so their commits do not count; a job that ends wakes it).
const WATCH_INTERVAL: Duration = Duration::from_millis(5);
/// With file events, the longest `run` goes without looking for another process's commit.
const FILES_QUIET: Duration = Duration::from_secs(1);
/// After a file event, the longest gap between the looks for the commit it announced ...
const RECHECK_MAX: Duration = Duration::from_millis(256);
/// ... and how long after the event they go on (a commit becomes visible after its sync).
const RECHECK_FOR: Duration = Duration::from_secs(3);
/// How long a delivery whose step failed (a store error, an undecodable record) rests.
const FAILED_STEP_BACKOFF_MS: u64 = 30_000;
/// How long a stopping engine lets the turns it is starting finish their step.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// What one pass did (the health report, saved after each pass).
#[derive(Clone, Debug, Default, Serialize)]
pub struct PassReport {
    pub at: i64,
    /// For `tick`, the pass; for `run`, the window this report covers (about a second).
    pub took_ms: u64,
    /// The longest look of the engine's loop in this report (housekeeping, the due query,
    /// starting jobs), in ms: how long the engine was unable to start anything new.
    pub pass_ms_max: u64,
    pub enrolled: usize,
    pub reminders: usize,
    pub looked_at: usize,
    pub moved: usize,
    pub writes: usize,
    pub errors: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
    pub pid: u32,
    /// How this engine's policy differs from SPEC §2 (`HANDOFFS_POLICY`), if it does.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub policy_differs: Vec<String>,
    /// A one-shot `tick`: over once it has reported (no engine runs after it).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub one_shot: bool,
}

impl PassReport {
    fn absorb(&mut self, part: PassReport) {
        self.moved += part.moved;
        self.writes += part.writes;
        self.errors.extend(part.errors);
    }
}

/// What every job shares: how to reach agents, and the rules.
#[derive(Debug)]
struct Ctx {
    adapters: Adapters,
    policy: Policy,
    one_shot: bool,
    /// Checked before each delivery, so a job that follows a long queue sees an outage begin.
    guard: outage::OutageGuard,
    /// Why a sync of the WAL failed, once one has: the engine then stops (see [`durable`]).
    sync_failed: RefCell<Option<String>>,
    /// Whether the database is PostgreSQL's (a failed commit is the server's, not a disk's).
    postgres: bool,
    /// Called right before the check of the lease that precedes each write, with the write's
    /// request id (the simulation stalls the whole engine there).
    before_write: Option<BeforeWrite>,
    /// The turn to sync before a write: one `fdatasync` at a time runs on the blocking pool
    /// while the engine's other jobs go on; the jobs that wait for it find their commits
    /// covered by it or start the next ([`durable`]).
    sync_turn: tokio::sync::Mutex<()>,
    /// Whether [`durable`] syncs on the blocking pool (`run`, `serve`, `tick`) rather than
    /// in line (the simulation, whose world has no threads of its own).
    sync_off_thread: std::cell::Cell<bool>,
}

/// What [`Engine::with_pause_before_write`] calls.
#[derive(Clone)]
pub struct BeforeWrite(pub Rc<dyn Fn(&str)>);

impl std::fmt::Debug for BeforeWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BeforeWrite")
    }
}

/// Makes the commits of this engine's connection up to now durable before an effect acts on
/// them. It first lets every other job run up to its next wait: jobs whose reservations are
/// ready at the same moment commit them, and the first to come back syncs them all in one
/// `fdatasync` (group commit). That sync runs on the blocking pool, one at a time (the
/// engine's sync turn), so the engine's thread goes on with the other jobs' steps meanwhile;
/// a job that waited for the turn finds its commits covered by the sync before it, or starts
/// the next, which covers every commit made while the last one ran. A lone write waits one
/// turn of the engine's task and its own sync, no more.
///
/// A sync that fails is never tried again: after an `fdatasync` error the kernel may have
/// dropped the dirty pages and a second call may succeed having written nothing, so no later
/// write could trust it. The engine stops instead ([`Engine::run`] returns the error).
async fn durable(ctx: &Ctx, svc: &RefCell<Service>) -> Result<(), ServiceError> {
    if let Some(e) = ctx.sync_failed.borrow().as_ref() {
        return Err(ServiceError::Refused(e.clone()));
    }
    let mark = svc.borrow().changes_so_far();
    tokio::task::yield_now().await;
    if !ctx.sync_off_thread.get() {
        let synced = sync_or_stop(ctx, svc, mark)?;
        tracing::debug!(synced, "durable before the write");
        return Ok(());
    }
    let _turn = ctx.sync_turn.lock().await;
    if let Some(e) = ctx.sync_failed.borrow().as_ref() {
        return Err(ServiceError::Refused(e.clone()));
    }
    // Commits what is batched first (a sync covers only what is committed); `None` when the
    // sync before this one covered `mark` already.
    let sync = svc
        .borrow_mut()
        .sync_elsewhere(mark)
        .map_err(|e| sync_failure(ctx, &e))?;
    let Some(sync) = sync else {
        tracing::debug!(synced = false, "durable before the write");
        return Ok(());
    };
    match tokio::task::spawn_blocking(sync).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(sync_failure(ctx, &e)),
        Err(e) => return Err(sync_failure(ctx, &e)),
    }
    tracing::debug!(synced = true, "durable before the write");
    Ok(())
}

/// [`Store::sync_upto`], recording a failure for the engine to stop on.
fn sync_or_stop(ctx: &Ctx, svc: &RefCell<Service>, mark: u64) -> Result<bool, ServiceError> {
    if let Some(e) = ctx.sync_failed.borrow().as_ref() {
        return Err(ServiceError::Refused(e.clone()));
    }
    svc.borrow_mut()
        .sync_upto(mark)
        .map_err(|e| sync_failure(ctx, &e))
}

/// Records that a sync failed (the engine stops), and says so.
fn sync_failure(ctx: &Ctx, e: &dyn std::fmt::Display) -> ServiceError {
    let why = if ctx.postgres {
        format!(
            "PostgreSQL did not confirm the engine's commit ({e}); the engine stops so that no \
             write goes out on a commit that may be lost"
        )
    } else {
        format!(
            "the database could not be synced to disk ({e}); the engine stops so that no write \
             goes out on a commit the disk may have lost"
        )
    };
    let first = ctx.sync_failed.borrow_mut().get_or_insert(why).clone();
    ServiceError::Refused(first)
}

/// Polls `fut`; whenever it has to wait, first commits the steps the engine's jobs batched
/// so far ([`Service::batch_steps`]): the write lock is never held while the engine waits
/// on an agent, a timer or another process, and what the jobs decided is visible to others
/// as soon as none of them can go on. Steps ready at the same moment share one commit.
async fn flushing<F: std::future::Future>(ctx: &Ctx, svc: &RefCell<Service>, fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    std::future::poll_fn(|cx| {
        let polled = fut.as_mut().poll(cx);
        if polled.is_pending()
            && !crate::planted::planted(crate::planted::Plant::HoldBatchWhileWaiting)
        {
            flush_or_stop(ctx, svc);
        }
        polled
    })
    .await
}

/// Commits the batched steps; a commit that fails stops the engine like a failed sync (the
/// steps its jobs took for committed are gone, so none of them may act on them).
fn flush_or_stop(ctx: &Ctx, svc: &RefCell<Service>) {
    if let Err(e) = svc.borrow_mut().flush_steps() {
        sync_failure(ctx, &e);
    }
}

/// Batching for as long as `run` or `pass` lasts: turned on by [`Batching::start`], and off
/// when dropped, rolling back whatever was not committed (the normal ends commit first; a
/// future dropped mid-run, or an engine that stops after a failed sync, leaves the database
/// as a crash would, and never holds the write lock after it).
struct Batching(Shared);

impl Batching {
    fn start(ctx: &Ctx, svc: &Shared) -> Batching {
        if let Err(e) = svc.borrow_mut().batch_steps(true) {
            sync_failure(ctx, &e);
        }
        Batching(svc.clone())
    }

    /// Commits what is batched and ends batching (a failure stops the engine).
    fn finish(self, ctx: &Ctx) -> Result<(), ServiceError> {
        if ctx.sync_failed.borrow().is_some() {
            return Ok(());
        }
        let done = self.0.borrow_mut().batch_steps(false);
        done.map_err(|e| sync_failure(ctx, &e))
    }
}

impl Drop for Batching {
    fn drop(&mut self) {
        if let Ok(mut s) = self.0.try_borrow_mut() {
            s.abandon_batch();
        }
    }
}

/// A sync of the WAL running on the blocking pool.
type IdleSync = tokio::task::JoinHandle<Result<(), crate::store::StoreError>>;

/// Syncs every commit of the engine's connection so far, in line: at the end of a pass and
/// on stop. (`run` also syncs whenever it goes idle, on the blocking pool; the commits a
/// write depends on are synced before it, [`durable`]; housekeeping commits with FULL.)
fn sync_all(ctx: &Ctx, svc: &RefCell<Service>) -> Result<bool, ServiceError> {
    let mark = svc.borrow().changes_so_far();
    sync_or_stop(ctx, svc, mark)
}

/// One recipient's job: hands back the recipient and what it did.
type Job = LocalBoxFuture<'static, (String, PassReport)>;

/// The service every job shares (one connection, borrowed only for synchronous work).
type Shared = Rc<RefCell<Service>>;

/// The engine over one database.
pub struct Engine {
    service: Shared,
    ctx: Rc<Ctx>,
    /// How often `run` looks for another process's commit when it has no file events
    /// (`files`: it uses the database folder's events when the kernel gives them).
    watch_every: Duration,
    files: bool,
    /// When enrolment and reminders last ran, and when a report was last saved.
    last_housekeeping: Option<Millis>,
    last_report: Option<Millis>,
    /// The errors last logged (each once, with how often), and when: the same ones again
    /// (a server that stays away fails every pass) are logged once a heartbeat, not each time.
    errors_said: Option<(Vec<(String, usize)>, Millis)>,
    /// The database's `data_version` when housekeeping last ran (another process's commit
    /// changes it), and when the next reminder falls due.
    housekeeping_seen: i64,
    next_reminder: Option<Millis>,
    /// A database several engines share (PostgreSQL): housekeeping runs under its lease.
    shared: bool,
    /// When this engine last tried to take the housekeeping lease.
    last_housekeeping_try: Option<Millis>,
    /// When the recipient leases were last renewed.
    last_renewal: Option<Millis>,
    /// Whether the last look for due work failed (the database refused a read or the
    /// leases' write): `run` then waits its interval instead of looking again at once.
    dispatch_failed: bool,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("one_shot", &self.ctx.one_shot)
            .finish_non_exhaustive()
    }
}

/// Why an engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("another engine is delivering for this database; this one stays idle")]
    Busy,
    #[error("{0}")]
    Io(String),
}

impl Engine {
    /// Takes the engine lock of a SQLite database (`Err(Busy)` when another engine holds
    /// it). On PostgreSQL several engines deliver at once, each recipient under one engine's
    /// lease, and housekeeping under a lease of its own ([`service::leases::HOUSEKEEPING`]).
    pub fn new(mut service: Service, one_shot: bool) -> Result<Engine, EngineError> {
        match service.take_engine_lock() {
            Ok(true) => {}
            Ok(false) => return Err(EngineError::Busy),
            Err(e) => return Err(EngineError::Io(e.to_string())),
        }
        // On SQLite the file's lock already makes this the one engine: no leases, no fences.
        if service.is_postgres() {
            service.fence_as(service::leases::Fencing::new(
                &service::leases::this_host(),
                service::leases::LEASE_MS,
            ));
        }
        Engine::built(service, one_shot)
    }

    /// An engine that shares its database with others under recipient leases as `fencing`,
    /// whatever the backend, without the SQLite file's engine lock: the simulation's engines,
    /// several on one file in one process (a PostgreSQL database's engines, through
    /// [`Engine::new`], share it the same way).
    pub fn sharing(
        mut service: Service,
        fencing: service::leases::Fencing,
    ) -> Result<Engine, EngineError> {
        service.fence_as(fencing);
        Engine::built(service, false)
    }

    fn built(mut service: Service, one_shot: bool) -> Result<Engine, EngineError> {
        let shared = service.fencing().is_some();
        let postgres = service.is_postgres();
        // The engine commits lazily and syncs before each effect instead (group commit).
        service
            .commit_lazily()
            .map_err(|e| EngineError::Io(e.to_string()))?;
        Ok(Engine {
            service: Rc::new(RefCell::new(service)),
            ctx: Rc::new(Ctx {
                adapters: Adapters::new(),
                policy: Policy::default(),
                one_shot,
                guard: outage::OutageGuard::default(),
                sync_failed: RefCell::new(None),
                postgres,
                before_write: None,
                sync_turn: tokio::sync::Mutex::new(()),
                sync_off_thread: std::cell::Cell::new(true),
            }),
            watch_every: WATCH_INTERVAL,
            files: true,
            last_housekeeping: None,
            last_report: None,
            errors_said: None,
            housekeeping_seen: 0,
            next_reminder: None,
            shared,
            last_housekeeping_try: None,
            last_renewal: None,
            dispatch_failed: false,
        })
    }

    /// Serves recipients under leases of `lease_ms` instead of [`service::leases::LEASE_MS`]
    /// (`HANDOFFS_LEASE_MS`: tests and drills of a failover).
    #[must_use]
    pub fn with_lease_ms(self, lease_ms: u64) -> Engine {
        {
            let mut svc = self.service.borrow_mut();
            if let Some(host) = svc.fencing().map(|f| f.host.clone()) {
                svc.fence_as(service::leases::Fencing::new(&host, lease_ms));
            }
        }
        self
    }

    /// This engine's identity in the lease table.
    pub fn engine_id(&self) -> String {
        self.service
            .borrow()
            .fencing()
            .map(|f| f.engine.clone())
            .unwrap_or_default()
    }

    /// Renews the leases of the recipients this engine serves (and of housekeeping), a
    /// quarter lease after the last renewal, and lets go of those it has not served for half
    /// a lease.
    fn keep_leases(&mut self, busy: &HashSet<String>, report: &mut PassReport) {
        let now = self.now();
        let every = self
            .service
            .borrow()
            .fencing()
            .map_or(u64::MAX, service::leases::Fencing::renew_every);
        if self.last_renewal.is_some_and(|t| now.since(t) < every) {
            return;
        }
        self.last_renewal = Some(now);
        if let Err(e) = self
            .service
            .borrow_mut()
            .renew_leases(&|r| busy.contains(r) || r == service::leases::HOUSEKEEPING)
        {
            report.errors.push(e.to_string());
        }
    }

    /// Whether this engine runs housekeeping now: always on SQLite (one engine per file); on
    /// a shared database while it holds the housekeeping lease, which it tries to take (at
    /// most once a quarter lease) when no live engine holds it: a paused or dead holder's
    /// passes to another engine like a recipient's.
    fn runs_housekeeping(&mut self, report: &mut PassReport) -> bool {
        const KEY: &str = service::leases::HOUSEKEEPING;
        if !self.shared || self.service.borrow().may_write_to(KEY) {
            return true;
        }
        let now = self.now();
        let every = self
            .service
            .borrow()
            .fencing()
            .map_or(0, service::leases::Fencing::renew_every);
        if self
            .last_housekeeping_try
            .is_some_and(|t| now.since(t) < every)
        {
            return false;
        }
        self.last_housekeeping_try = Some(now);
        match self.service.borrow_mut().take_leases(&[KEY.to_owned()]) {
            Ok(held) if !held.is_empty() => {
                tracing::info!("this engine runs housekeeping now");
                true
            }
            Ok(_) => false,
            Err(e) => {
                report.errors.push(e.to_string());
                false
            }
        }
    }

    /// How long `run` may wait at most before renewing its leases (and looking whether a
    /// lease of another engine expired, to take over its recipients).
    fn renewal_wait(&self) -> Duration {
        let every = self
            .service
            .borrow()
            .fencing()
            .map_or(u64::MAX, service::leases::Fencing::renew_every);
        let since = self.last_renewal.map_or(every, |t| self.now().since(t));
        Duration::from_millis(every.saturating_sub(since))
    }

    /// Calls `hook` right before the check of the lease that precedes each write, then lets
    /// every other task run once (the simulation: a hook that stalls the engine's host there
    /// stalls the engine between the commit that issued a write and its write).
    #[must_use]
    pub fn with_pause_before_write(mut self, hook: BeforeWrite) -> Engine {
        self.ctx = Rc::new(Ctx {
            adapters: self.ctx.adapters.clone(),
            policy: self.ctx.policy.clone(),
            one_shot: self.ctx.one_shot,
            guard: outage::OutageGuard::default(),
            sync_failed: RefCell::new(None),
            postgres: self.ctx.postgres,
            before_write: Some(hook),
            sync_turn: tokio::sync::Mutex::new(()),
            sync_off_thread: std::cell::Cell::new(self.ctx.sync_off_thread.get()),
        });
        self
    }

    /// Uses `policy` instead of the default (tests and the simulation).
    #[must_use]
    pub fn with_policy(mut self, policy: Policy) -> Engine {
        self.ctx = Rc::new(Ctx {
            adapters: self.ctx.adapters.clone(),
            policy,
            one_shot: self.ctx.one_shot,
            guard: outage::OutageGuard::default(),
            sync_failed: RefCell::new(None),
            postgres: self.ctx.postgres,
            before_write: self.ctx.before_write.clone(),
            sync_turn: tokio::sync::Mutex::new(()),
            sync_off_thread: std::cell::Cell::new(self.ctx.sync_off_thread.get()),
        });
        self
    }

    /// Looks for other processes' commits every `every` instead of waiting for the database
    /// folder's file events (the simulation, where each look costs a step of virtual time
    /// and the file system's events are no part of the world).
    #[must_use]
    pub fn with_watch_interval(mut self, every: Duration) -> Engine {
        self.watch_every = every;
        self.files = false;
        self.ctx.sync_off_thread.set(false);
        self
    }

    /// Reaches agents and status pages through `http` instead of the real network (the
    /// simulation).
    #[must_use]
    pub fn with_http(mut self, http: crate::adapter::http::Http) -> Engine {
        self.ctx = Rc::new(Ctx {
            adapters: Adapters::with_http(http),
            policy: self.ctx.policy.clone(),
            one_shot: self.ctx.one_shot,
            guard: outage::OutageGuard::default(),
            sync_failed: RefCell::new(None),
            postgres: self.ctx.postgres,
            before_write: self.ctx.before_write.clone(),
            sync_turn: tokio::sync::Mutex::new(()),
            sync_off_thread: std::cell::Cell::new(self.ctx.sync_off_thread.get()),
        });
        self
    }

    fn now(&self) -> Millis {
        self.service.borrow().now()
    }

    /// The engine's service (tests and the fronts read through it between passes).
    pub fn service(&self) -> RefMut<'_, Service> {
        self.service.borrow_mut()
    }

    /// One bounded pass: housekeeping, then every due delivery once, recipients concurrently.
    #[tracing::instrument(name = "pass", level = "debug", skip_all)]
    pub async fn pass(&mut self) -> PassReport {
        let started = Instant::now();
        let started_at = self.now();
        let mut report = self.new_report();
        let batching = Batching::start(&self.ctx, &self.service);
        self.housekeeping_if_due(&mut report);
        let mut jobs = FuturesUnordered::new();
        let mut busy = HashSet::new();
        self.dispatch(&mut jobs, &mut busy, &mut report, false, usize::MAX);
        let (ctx, svc) = (self.ctx.clone(), self.service.clone());
        // On a shared database the leases of the recipients this pass serves are renewed
        // while its jobs last (a write that waits on a slow recipient outlasts a lease), as
        // `run` renews them: another engine does not take a recipient from a pass still
        // serving it. Dropping the jobs' future between renewals loses nothing.
        let every = self
            .service
            .borrow()
            .fencing()
            .map(|f| Duration::from_millis(f.renew_every()));
        let mut renew = tokio::time::interval(every.unwrap_or(Duration::from_secs(3600)));
        renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        renew.tick().await;
        loop {
            tokio::select! {
                next = flushing(&ctx, &svc, jobs.next()) => match next {
                    Some((_, part)) => report.absorb(part),
                    None => break,
                },
                _ = renew.tick(), if every.is_some() => self.keep_leases(&busy, &mut report),
            }
        }
        if let Err(e) = sync_all(&self.ctx, &self.service) {
            report.errors.push(e.to_string());
        }
        if self.ctx.sync_failed.borrow().is_none()
            && let Err(e) = self.service.borrow_mut().release_all_leases()
        {
            report.errors.push(e.to_string());
        }
        report.took_ms = elapsed_ms(started);
        report.pass_ms_max = report.took_ms;
        let worth_saving = report.moved > 0
            || !report.errors.is_empty()
            || self
                .last_report
                .is_none_or(|t| started_at.since(t) >= REPORT_HEARTBEAT_MS);
        if worth_saving {
            self.save_report(&mut report, started_at);
        }
        if let Err(e) = batching.finish(&self.ctx) {
            report.errors.push(e.to_string());
        }
        report
    }

    fn new_report(&self) -> PassReport {
        PassReport {
            at: millis(self.now()),
            pid: std::process::id(),
            policy_differs: self
                .ctx
                .policy
                .check_against_spec()
                .unwrap_or_else(|e| vec![e]),
            one_shot: self.ctx.one_shot,
            ..PassReport::default()
        }
    }

    /// Logs the errors of a report window: each distinct one once, with how often it came;
    /// the very same ones as last time only once a heartbeat ([`REPORT_HEARTBEAT_MS`]), so a
    /// server that stays away is said every 10 s, not on every pass of every second.
    fn log_errors(&mut self, errors: &[String], now: Millis) {
        let mut counted: Vec<(String, usize)> = Vec::new();
        for e in errors {
            match counted.iter_mut().find(|(seen, _)| seen == e) {
                Some((_, n)) => *n += 1,
                None => counted.push((e.clone(), 1)),
            }
        }
        let same = |said: &[(String, usize)]| {
            said.len() == counted.len() && said.iter().zip(&counted).all(|(a, b)| a.0 == b.0)
        };
        if let Some((said, at)) = &self.errors_said
            && same(said)
            && now.since(*at) < REPORT_HEARTBEAT_MS
        {
            return;
        }
        for (e, times) in &counted {
            tracing::warn!(error = %e, times, "engine pass");
        }
        self.errors_said = (!counted.is_empty()).then_some((counted, now));
    }

    fn save_report(&mut self, report: &mut PassReport, at: Millis) {
        self.last_report = Some(at);
        let value = serde_json::to_value(&*report).unwrap_or(Value::Null);
        let at = report.at;
        if let Err(e) = self.service.borrow_mut().save_engine_report(at, &value) {
            report.errors.push(e.to_string());
        }
    }

    /// Enrolling stragglers and reminders scan tables, so they run only when something may
    /// have changed: another process committed (a send by an older client, a config change),
    /// a reminder fell due, or a minute passed; and at most once a second.
    fn housekeeping_if_due(&mut self, report: &mut PassReport) {
        if !self.runs_housekeeping(report) {
            return;
        }
        let now = self.now();
        let seen = self.service.borrow().data_version().unwrap_or(0);
        let due = match self.last_housekeeping {
            None => true,
            Some(t) if now.since(t) < HOUSEKEEPING_INTERVAL_MS => false,
            Some(t) => {
                seen != self.housekeeping_seen
                    || self.next_reminder.is_some_and(|r| r <= now)
                    || now.since(t) >= HOUSEKEEPING_MAX_INTERVAL_MS
            }
        };
        if !due {
            return;
        }
        // A reminder can fall due only where the last housekeeping said one would (new work
        // is due a minute after it is given at the soonest, and is seen before then).
        let reminders_may_be_due =
            self.last_housekeeping.is_none() || self.next_reminder.is_some_and(|r| r <= now);
        self.last_housekeeping = Some(now);
        self.housekeeping_seen = seen;
        match self.housekeeping(reminders_may_be_due) {
            Ok((enrolled, reminders)) => {
                report.enrolled += enrolled;
                report.reminders += reminders;
            }
            Err(e) => report.errors.push(e.to_string()),
        }
        self.next_reminder = self.service.borrow_mut().next_reminder_at().ok().flatten();
    }

    /// Starts a job for every recipient with due deliveries that has none running yet; with
    /// `follow` a job goes on with what else of its recipient becomes due. Returns how many
    /// it started.
    fn dispatch(
        &mut self,
        jobs: &mut FuturesUnordered<Job>,
        busy: &mut HashSet<String>,
        report: &mut PassReport,
        follow: bool,
        cap: usize,
    ) -> usize {
        self.dispatch_failed = false;
        if self.ctx.sync_failed.borrow().is_some() {
            return 0;
        }
        let now = self.now();
        let due = self
            .service
            .borrow_mut()
            .due(now, QUEUE_HEADS, PASS_DELIVERIES_MAX);
        let due = match due {
            Ok(due) => due,
            Err(e) => {
                report.errors.push(e.to_string());
                self.dispatch_failed = true;
                return 0;
            }
        };
        // Group by recipient, in the order the store gave (active first, then oldest).
        let mut groups: Vec<(String, Vec<String>)> = Vec::new();
        for (id, recipient) in due {
            if busy.contains(&recipient) {
                continue;
            }
            match groups.iter_mut().find(|(r, _)| *r == recipient) {
                Some((_, ids)) => ids.push(id),
                None => groups.push((recipient, vec![id])),
            }
        }
        // Each recipient is served under this engine's lease on it; one another engine holds
        // is left to that engine.
        groups.truncate(cap.saturating_sub(jobs.len()));
        let wanted: Vec<String> = groups.iter().map(|(r, _)| r.clone()).collect();
        let held = match self.service.borrow_mut().take_leases(&wanted) {
            Ok(held) => held,
            Err(e) => {
                report.errors.push(e.to_string());
                self.dispatch_failed = true;
                return 0;
            }
        };
        groups.retain(|(r, _)| held.contains(r));
        let mut started = 0;
        for (recipient, ids) in groups {
            report.looked_at += ids.len();
            busy.insert(recipient.clone());
            jobs.push(Box::pin(serve(
                self.ctx.clone(),
                self.service.clone(),
                recipient,
                ids,
                follow,
            )));
            started += 1;
        }
        started
    }

    /// Enrols handoffs that have no delivery yet, and sends due reminders (one each, as a
    /// non-waking notification).
    fn housekeeping(&mut self, reminders_may_be_due: bool) -> Result<(usize, usize), ServiceError> {
        let policy = self.ctx.policy.clone();
        self.service
            .borrow_mut()
            .housekeeping(&policy, reminders_may_be_due)
    }
}

/// When the engine should look at a delivery again, given its new record. A delivery that
/// waits on something only polling can see (a person's turn, an outage, an unreachable
/// agent, a long turn of ours) is looked at less often the longer it has waited: a tenth of
/// its time in the state, between the state's base interval and a cap. What a commit can
/// change (a registration, a connection, `enabled`, a turn of ours ending) wakes the
/// recipient's deliveries at once instead.
fn due_after(
    policy: &Policy,
    record: &Delivery,
    agent: Option<&AgentRow>,
    now: Millis,
) -> Option<i64> {
    let soon = |ms: u64| Some(millis(now.plus_ms(ms)));
    let waited = now.since(record.core().since());
    let backoff =
        |base_ms: u64, cap_ms: u64| soon((waited / 10).clamp(base_ms, cap_ms.max(base_ms)));
    let observe = agent.map_or(1_000, Adapters::observe_interval_ms);
    let deadline = record.next_deadline(policy).map(millis);
    match record {
        // A queued delivery a pass left queued (an outage, a one-shot tick), and one refused
        // once that a pass left there: its one retry goes at once on the move (see `apply`).
        Delivery::Waiting(_) | Delivery::OwnerRejected(_) => backoff(1_000, 15_000),
        Delivery::Busy(b) => match b.reason() {
            BusyReason::EarlierDelivery { .. } => soon(30_000),
            BusyReason::RecipientInTurn { .. } => backoff(500, 15_000),
            // Turned away at the write while the look said idle (an app without an activity
            // source, or one whose look and lock disagree): twice as long each time, from
            // half a second to 30 s, so a session taken for long is not written at in a loop.
            BusyReason::AtTheWrite { times, .. } => {
                soon((500_u64 << (*times).saturating_sub(1).min(6)).min(30_000))
            }
        },
        Delivery::Held(_) | Delivery::Unavailable(_) => backoff(5_000, 60_000),
        Delivery::Sending(_) | Delivery::Failed(_) => deadline,
        // Never less often than four times within the unobserved limit, so a turn that can
        // be observed is never taken for one that cannot.
        Delivery::Accepted(_) | Delivery::Running(_) => {
            let cap = (policy.unobserved_limit_ms / 4).min(30_000);
            [deadline, backoff(observe, cap)]
                .into_iter()
                .flatten()
                .min()
        }
        Delivery::Uncertain(_) if policy.planted(model::PlantedBug::ScanNeverRescheduled) => None,
        // A scan deadline already past (never scanned yet) is due at once only the first
        // time; a pass that could not scan (the agent is gone) backs off instead of spinning.
        Delivery::Uncertain(_) => {
            let floor = millis(now.plus_ms((waited / 10).clamp(1_000, 30_000)));
            let scan = deadline.map(|d| {
                if d <= millis(now) && waited > 0 {
                    floor
                } else {
                    d
                }
            });
            [scan, soon(30_000)].into_iter().flatten().min()
        }
        _ => None,
    }
}

fn elapsed_ms(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// One recipient's deliveries, one after another: those it was given, then whatever else of
/// this recipient is due by then (a queue drains at the pace of its turns), up to a bound so
/// that a pass ends.
async fn serve(
    ctx: Rc<Ctx>,
    svc: Shared,
    recipient: String,
    ids: Vec<String>,
    follow: bool,
) -> (String, PassReport) {
    let mut report = PassReport::default();
    let mut ids: VecDeque<String> = ids.into();
    let mut served = 0;
    let mut seen_busy: SeenBusy = None;
    while let Some(id) = ids.pop_front() {
        if let Err(e) = deliver(&ctx, &svc, &id, &mut report, &mut seen_busy).await {
            report.errors.push(format!("{id}: {e}"));
            if matches!(e, ServiceError::Fenced(_)) {
                // Another engine serves this recipient now: this job does nothing more.
                tracing::warn!(recipient = %recipient, error = %e, "lease lost");
                svc.borrow_mut().forget_lease(&recipient);
                break;
            }
            if ctx.sync_failed.borrow().is_some() {
                // The engine stops: this job records nothing more.
                break;
            }
            // Rest it, so a row that cannot be stepped is not taken again at once.
            let mut s = svc.borrow_mut();
            let later = millis(s.now().plus_ms(FAILED_STEP_BACKOFF_MS));
            if let Err(e) = s.set_due(&id, Some(later)) {
                report.errors.push(format!("{id}: {e}"));
            }
        }
        served += 1;
        if ids.is_empty() && follow && served < JOB_DELIVERIES_MAX {
            let more = {
                let mut s = svc.borrow_mut();
                let now = s.now();
                s.due_for(&recipient, now, QUEUE_HEADS)
            };
            match more {
                Ok(more) => ids.extend(more),
                Err(e) => report.errors.push(e.to_string()),
            }
        }
    }
    (recipient, report)
}

/// A destination one of a job's deliveries found in a turn, the answer, and when (the
/// service's clock). The job's next queued delivery to the same destination takes that answer
/// for its look ([`Effect::CheckActivity`]) instead of asking again, so a busy recipient is
/// asked once per look at its queue, not once per queued delivery. Never for the re-check at
/// the send boundary, and never an answer that would let a write go.
type SeenBusy = Option<(model::states::Target, model::Activity, Millis)>;

/// How long a job keeps a "busy" answer for its next deliveries.
const SEEN_BUSY_FOR_MS: u64 = 1_000;

/// What [`apply`] leaves: the record, the effects it asks for, the recipient as registered.
struct Applied {
    record: Delivery,
    effects: Vec<Effect>,
    agent: Option<AgentRow>,
    /// Whether the step recorded a new record (with when to look at it again).
    saved: bool,
}

/// Applies one event to the stored delivery `id` through the service's one commit path
/// ([`Service::commit_step`]) under this engine's policy and schedule.
fn apply(
    ctx: &Ctx,
    svc: &RefCell<Service>,
    id: &str,
    report: &mut PassReport,
    event: impl FnOnce(&StepReads<'_, '_>) -> Result<EventKind, ServiceError>,
) -> Result<Applied, ServiceError> {
    apply_all(
        ctx,
        svc,
        id,
        report,
        |tx| Ok(vec![event(tx)?]),
        &mut |_, _, _| Ok(None),
    )
}

/// Applies `events`, then whatever effects `follow` answers without IO, in one transaction
/// ([`Service::commit_steps`]).
fn apply_all(
    ctx: &Ctx,
    svc: &RefCell<Service>,
    id: &str,
    report: &mut PassReport,
    events: impl FnOnce(&StepReads<'_, '_>) -> Result<Vec<EventKind>, ServiceError>,
    follow: service::deliveries::Follow<'_>,
) -> Result<Applied, ServiceError> {
    let policy = &ctx.policy;
    // Just accepted: observe at once (a short turn may already be over); just refused once:
    // the one retry goes at once. Only on the move itself: a look that changed nothing waits
    // its interval, even within the same millisecond (the simulation's clock stands still
    // while a host runs). A step that changes nothing records nothing: when to look again is
    // set once the pass is over (see `deliver`), since a crash before the pass's next step
    // would leave the delivery resting on a reason that may be gone by then.
    let schedule = |change: &Change, record: &Delivery, agent: Option<&AgentRow>, now: Millis| {
        if matches!(
            change,
            Change::Moved {
                to: model::StateKind::Accepted | model::StateKind::OwnerRejected,
                ..
            }
        ) {
            Some(millis(now))
        } else {
            due_after(policy, record, agent, now)
        }
    };
    let committed = svc
        .borrow_mut()
        .commit_steps(id, policy, events, follow, &schedule)?;
    let moved = matches!(committed.change, Change::Moved { .. });
    if moved {
        report.moved += 1;
    }
    Ok(Applied {
        saved: moved || committed.change == Change::Updated,
        record: committed.record,
        effects: committed.effects,
        agent: committed.agent,
    })
}

/// What a step's transaction can answer itself, so a delivery takes fewer transactions: the
/// reservation's look for another active delivery to the recipient (a fact of the database);
/// when the recipient's adapter knows its activity without asking anyone, the activity check
/// and the send boundary (whose other facts are read in the same transaction); and when it
/// knows the outcome of an accepted write without asking, the observation. The record is
/// the one the previous step left; every answer is about its frozen target.
fn in_transaction<'a>(
    ctx: &'a Ctx,
    id: &'a str,
) -> impl FnMut(
    &StepReads<'_, '_>,
    &Delivery,
    Option<&Effect>,
) -> Result<Option<EventKind>, ServiceError>
+ 'a {
    move |tx, record, effect| {
        let Some(effect) = effect else {
            return Ok(None);
        };
        let target = record.core().target();
        let quiet = || -> Result<Option<model::Activity>, ServiceError> {
            Ok(tx
                .agent(target.agent.as_str())?
                .map(|a| a.at_target(target))
                .filter(|a| ctx.adapters.prepare(a).is_ok())
                .and_then(|a| Adapters::activity_without_io(&a)))
        };
        Ok(match effect {
            Effect::Reserve if !ctx.policy.planted(model::PlantedBug::ReserveAfterWrite) => {
                Some(tx.reservation(id)?)
            }
            Effect::CheckActivity => {
                quiet()?.map(|activity| EventKind::ActivityObserved { activity })
            }
            // Only what an accepted write became can be known without asking.
            Effect::Observe { request_id } if matches!(record, Delivery::Accepted(_)) => tx
                .agent(target.agent.as_str())?
                .map(|a| a.at_target(target))
                .and_then(|a| Adapters::observe_without_io(&a, request_id.as_str()))
                .map(|observed| EventKind::Observation { observed }),
            Effect::Prepare => match quiet()? {
                Some(activity) => {
                    let facts = tx.facts(id, ctx.one_shot)?;
                    Some(EventKind::SendBoundary {
                        permission: facts.permission,
                        recipient: facts.recipient,
                        activity,
                        work_open: facts.work_open,
                    })
                }
                None => None,
            },
            _ => None,
        })
    }
}

/// What the write-result step's transaction answers itself: what [`in_transaction`] answers,
/// and, when the write was accepted and what became of it is known without asking anyone (an
/// HTTP recipient without a status URL), the pass that would look at it at once (the
/// schedule of a write just accepted, [`apply_all`]) begun in the same transaction: its time
/// check and its start, whose observation [`in_transaction`] then answers: one commit fewer a
/// delivery. What a separate pass ([`begin_pass`]) does first is left out on purpose: the
/// outage guard's answer and the closed-chain check matter only to a delivery that waits,
/// and a pass over an ACCEPTED record asks for its observation whatever its facts say
/// (model/tests/step_rules.rs, `a_pass_over_a_write_just_accepted_…`).
fn after_write<'a>(
    ctx: &'a Ctx,
    id: &'a str,
    request_id: &'a model::RequestId,
) -> impl FnMut(
    &StepReads<'_, '_>,
    &Delivery,
    Option<&Effect>,
) -> Result<Option<EventKind>, ServiceError>
+ 'a {
    let mut answer = in_transaction(ctx, id);
    // 0: the pass is not begun; 1: its time check is made; 2: it has started.
    let mut begun = 0;
    move |tx, record, effect| {
        if effect.is_none()
            && begun < 2
            && matches!(record, Delivery::Accepted(_))
            && record.core().request_id() == request_id
        {
            let target = record.core().target();
            let known = tx
                .agent(target.agent.as_str())?
                .map(|a| a.at_target(target))
                .and_then(|a| Adapters::observe_without_io(&a, request_id.as_str()))
                .is_some();
            if known {
                begun += 1;
                return Ok(Some(if begun == 1 {
                    EventKind::TimePassed
                } else {
                    EventKind::PassStarted(tx.facts(id, ctx.one_shot)?)
                }));
            }
        }
        answer(tx, record, effect)
    }
}

/// The end of a pass that recorded nothing: the delivery is looked at again after its state's
/// interval rather than at once (one short transaction, and only if it is still due: a
/// commit meanwhile, a wake, may have made it due at another time).
fn rest(ctx: &Ctx, svc: &RefCell<Service>, id: &str) -> Result<(), ServiceError> {
    let mut svc = svc.borrow_mut();
    let now = svc.now();
    svc.rest(id, now, |record, agent| {
        due_after(&ctx.policy, record, agent, now)
    })
}

/// How old the send boundary's look may be when its write goes out: older, the engine looks
/// again first (it stalled in between; a turn may have begun). Counted from before the look.
const LOOK_FRESH_MS: u64 = 2_000;

/// Takes one delivery through as much of SPEC §2.2–2.4 as it can now.
#[tracing::instrument(name = "delivery", level = "info", skip_all, fields(id = %id))]
async fn deliver(
    ctx: &Ctx,
    svc: &RefCell<Service>,
    id: &str,
    report: &mut PassReport,
    seen_busy: &mut SeenBusy,
) -> Result<(), ServiceError> {
    // After a failed sync nothing more is committed toward a write that cannot go out.
    if let Some(e) = ctx.sync_failed.borrow().as_ref() {
        return Err(ServiceError::Refused(e.clone()));
    }
    let one_shot = ctx.one_shot;
    let started = begin_pass(ctx, svc, id, report).await?;
    let mut saved = started.saved;
    let mut queue: VecDeque<Effect> = started.effects.into();
    let record = started.record;
    // The record as last committed, for the planted reordering below.
    let mut current = record.clone();
    let adapters = &ctx.adapters;
    // The recipient as registered when the last step was committed.
    let mut registered = started.agent;
    // When this pass's send boundary looked at the recipient's activity.
    let mut looked_at: Option<Millis> = None;
    while let Some(effect) = queue.pop_front() {
        let Some(agent) = registered.take() else {
            // Gone since the pass began: the next pass makes it UNAVAILABLE.
            break;
        };
        // Every adapter call goes to the destination frozen at enrolment, never to wherever
        // the agent is registered now (G1): a changed destination stops a write at the
        // step, and observation keeps asking where the write went.
        let agent = if ctx.policy.planted(model::PlantedBug::ResolveAtWrite) {
            agent
        } else {
            agent.at_target(record.core().target())
        };
        tracing::debug!(effect = ?effect, recipient = %agent.id, "effect");
        let next = match effect {
            Effect::CheckActivity => {
                let activity =
                    activity_for_look(adapters, svc, &agent, record.core().target(), seen_busy)
                        .await;
                apply_all(
                    ctx,
                    svc,
                    id,
                    report,
                    |_| Ok(vec![EventKind::ActivityObserved { activity }]),
                    &mut in_transaction(ctx, id),
                )?
            }
            Effect::Reserve if ctx.policy.planted(model::PlantedBug::ReserveAfterWrite) => {
                planted_reserve_after_write(ctx, svc, id, &current, &agent, report).await?
            }
            Effect::Reserve => apply_all(
                ctx,
                svc,
                id,
                report,
                |tx| Ok(vec![tx.reservation(id)?]),
                &mut in_transaction(ctx, id),
            )?,
            Effect::Prepare => {
                if let Err(e) = adapters.prepare(&agent) {
                    report.errors.push(format!("{id}: prepare: {e}"));
                }
                looked_at = Some(svc.borrow().now());
                let activity = adapters.activity(svc, &agent).await;
                apply(ctx, svc, id, report, |tx| {
                    let facts = tx.facts(id, one_shot)?;
                    Ok(EventKind::SendBoundary {
                        permission: facts.permission,
                        recipient: facts.recipient,
                        activity,
                        work_open: facts.work_open,
                    })
                })?
            }
            Effect::Write { request_id, .. } => {
                // When the send boundary looked (in this pass; else when it was committed).
                let looked = looked_at.or_else(|| match &current {
                    Delivery::Sending(s) => *s.issued_at(),
                    _ => None,
                });
                // The reservation this write belongs to: what a withheld write names.
                let attempt = current.core().attempts();
                let outcome =
                    match issued_write(ctx, svc, id, &agent, looked, request_id.as_str(), report)
                        .await
                    {
                        Err(fenced @ ServiceError::Fenced(_)) => {
                            withhold(ctx, svc, id, (&request_id, attempt), &fenced, report);
                            return Err(fenced);
                        }
                        outcome => outcome?,
                    };
                apply_all(
                    ctx,
                    svc,
                    id,
                    report,
                    |_| Ok(vec![EventKind::WriteResult { outcome }]),
                    &mut after_write(ctx, id, &request_id),
                )?
            }
            Effect::Observe { request_id } => {
                let observed = observe(adapters, svc, &agent, &current, request_id.as_str()).await;
                apply(ctx, svc, id, report, |_| {
                    Ok(EventKind::Observation { observed })
                })?
            }
            Effect::ScanHistory { request_id } => {
                let scan = adapters.scan(svc, &agent, request_id.as_str()).await;
                apply(ctx, svc, id, report, |_| {
                    Ok(EventKind::HistoryScan { scan })
                })?
            }
        };
        saved |= next.saved;
        queue.extend(next.effects);
        current = next.record;
        registered = next.agent;
    }
    if !saved {
        rest(ctx, svc, id)?;
    }
    Ok(())
}

/// The first step of a delivery's pass: the outage guard, then the time check and the pass's
/// facts in one transaction, followed by as much as the transaction can answer itself (for
/// an HTTP recipient without an activity source: through the reservation and the send
/// boundary, so the write's reservation is this one commit).
async fn begin_pass(
    ctx: &Ctx,
    svc: &RefCell<Service>,
    id: &str,
    report: &mut PassReport,
) -> Result<Applied, ServiceError> {
    let config = svc.borrow_mut().config_value("outageGuard")?;
    let outage = ctx.guard.check(&ctx.adapters.http, &config).await;
    apply_all(
        ctx,
        svc,
        id,
        report,
        |tx| {
            // A delivery of a cancelled chain that is waiting again (its marked turn was
            // turned away busy, refused, or failed with a resend planned) is cancelled too.
            if tx.waits_in_a_closed_chain(id, &ctx.policy)? {
                let note = Some("its chain was cancelled".to_owned());
                return Ok(vec![EventKind::Release { note }]);
            }
            let mut facts = tx.facts(id, ctx.one_shot)?;
            facts.outage.clone_from(&outage);
            Ok(vec![EventKind::TimePassed, EventKind::PassStarted(facts)])
        },
        &mut in_transaction(ctx, id),
    )
}

/// The recipient's activity for a queued delivery's look: a busy answer this job got for the
/// same destination within [`SEEN_BUSY_FOR_MS`], else the adapter's (kept when busy).
async fn activity_for_look(
    adapters: &Adapters,
    svc: &RefCell<Service>,
    agent: &AgentRow,
    target: &model::states::Target,
    seen_busy: &mut SeenBusy,
) -> model::Activity {
    let now = svc.borrow().now();
    if let Some((t, activity, at)) = seen_busy.as_ref()
        && t == target
        && now.since(*at) <= SEEN_BUSY_FOR_MS
    {
        return activity.clone();
    }
    let activity = adapters.activity(svc, agent).await;
    *seen_busy = matches!(activity, model::Activity::Busy { .. })
        .then(|| (target.clone(), activity.clone(), svc.borrow().now()));
    activity
}

/// What became of the write `request_id` of `record`: known without asking only for an
/// ACCEPTED write (an HTTP recipient without a status URL), else the adapter's answer.
async fn observe(
    adapters: &Adapters,
    svc: &RefCell<Service>,
    agent: &AgentRow,
    record: &Delivery,
    request_id: &str,
) -> model::Observed {
    let known = matches!(record, Delivery::Accepted(_))
        .then(|| Adapters::observe_without_io(agent, request_id))
        .flatten();
    match known {
        Some(observed) => observed,
        None => adapters.observe(svc, agent, request_id).await,
    }
}

/// Says that the write of delivery `id` (its `reservation`: request id and attempt) was
/// withheld because this engine was fenced (`fenced`) right before it: nothing was written,
/// so the delivery is queued again for the engine that serves its recipient now, instead of
/// turning UNCERTAIN when the sending timeout runs out (an hour of history scans for a write
/// that provably never left). Best effort: when it cannot be recorded (the database is out
/// of reach, or the delivery moved on) the delivery is left as a crash leaves it.
fn withhold(
    ctx: &Ctx,
    svc: &RefCell<Service>,
    id: &str,
    reservation: (&model::RequestId, u32),
    fenced: &ServiceError,
    report: &mut PassReport,
) {
    let policy = &ctx.policy;
    let schedule = |_: &Change, record: &Delivery, agent: Option<&AgentRow>, now: Millis| {
        due_after(policy, record, agent, now)
    };
    let detail = fenced.to_string();
    match svc
        .borrow_mut()
        .commit_withheld(id, policy, reservation, detail, &schedule)
    {
        Ok(Some(_)) => {
            report.moved += 1;
            tracing::info!(
                delivery = id,
                request = %reservation.0,
                attempt = reservation.1,
                "write withheld, queued again for the engine that serves its recipient now"
            );
        }
        Ok(None) => {}
        Err(e) => report
            .errors
            .push(format!("{id}: recording the withheld write: {e}")),
    }
}

/// The planted bug `reserve_after_write`, a pure reordering: the reservation and the send
/// boundary are decided exactly as the correct engine decides them (same facts, same
/// `step`), but committed only after the write. The recipient sees a write its store does
/// not know of yet (G8), and a kill in between forgets it.
async fn planted_reserve_after_write(
    ctx: &Ctx,
    svc: &RefCell<Service>,
    id: &str,
    current: &Delivery,
    agent: &AgentRow,
    report: &mut PassReport,
) -> Result<Applied, ServiceError> {
    let reservation = svc.borrow_mut().reservation_facts(id)?;
    let now = svc.borrow().now();
    let reserved = model::step(
        current.clone(),
        Event::new(now, reservation.clone()),
        &ctx.policy,
    );
    if !reserved.effects.contains(&Effect::Prepare) {
        // The reservation is refused (an earlier delivery is active): as usual.
        return apply(ctx, svc, id, report, |_| Ok(reservation));
    }
    let activity = ctx.adapters.activity(svc, agent).await;
    let facts = svc.borrow_mut().pass_facts(id, ctx.one_shot)?;
    let boundary = EventKind::SendBoundary {
        permission: facts.permission,
        recipient: facts.recipient,
        activity,
        work_open: facts.work_open,
    };
    let issued = model::step(
        reserved.record,
        Event::new(now, boundary.clone()),
        &ctx.policy,
    );
    let write = issued.effects.iter().find_map(|e| match e {
        Effect::Write { request_id, .. } => Some(request_id.clone()),
        _ => None,
    });
    let Some(request_id) = write else {
        // No write at the boundary: nothing to reorder.
        return apply(ctx, svc, id, report, |_| Ok(reservation));
    };
    let fence = svc.borrow().fencing().and_then(|f| f.fence_of(&agent.id));
    let outcome = write_now(ctx, svc, id, agent, request_id.as_str(), fence, report).await?;
    apply(ctx, svc, id, report, |_| Ok(reservation))?;
    apply(ctx, svc, id, report, |_| Ok(boundary))?;
    apply(ctx, svc, id, report, |_| {
        Ok(EventKind::WriteResult { outcome })
    })
}

/// The write `request_id` of delivery `id`, issued in `current`: made durable, the lease
/// checked (and a stale look taken again), then written; what came of it.
async fn issued_write(
    ctx: &Ctx,
    svc: &RefCell<Service>,
    id: &str,
    agent: &AgentRow,
    looked_at: Option<Millis>,
    request_id: &str,
    report: &mut PassReport,
) -> Result<model::WriteOutcome, ServiceError> {
    // The commit that reserved this write (and everything before it) is on stable storage
    // before the write goes out: a power cut cannot take the reservation back and let the
    // next engine write again (G2, G8).
    if !crate::planted::planted(crate::planted::Plant::NoSyncBeforeWrite) {
        durable(ctx, svc).await?;
    }
    crate::adapter::codex::hold_at("HANDOFFS_TEST_HOLD_ENGINE_WRITE", request_id).await;
    if let Some(hook) = ctx.before_write.as_ref() {
        (hook.0)(request_id);
        tokio::task::yield_now().await;
    }
    // The send boundary's look went stale (the engine stalled since: a stopped process, a
    // suspended machine, a sync that took seconds): a turn may have begun meanwhile, so the
    // engine looks again, and a busy or unreadable session turns the write away (nothing is
    // written; the delivery waits as for a busy recipient).
    if looked_at.is_some_and(|t| svc.borrow().now().since(t) > LOOK_FRESH_MS) {
        let activity = ctx.adapters.activity(svc, agent).await;
        if let model::Activity::Busy { .. } | model::Activity::Unknown { .. } = activity {
            return Ok(model::WriteOutcome::Busy {
                detail: format!(
                    "the engine stalled since its last look, and a new look found the session {}",
                    if matches!(activity, model::Activity::Busy { .. }) {
                        "busy"
                    } else {
                        "unreadable"
                    }
                ),
            });
        }
    }
    // Last, with no wait before the write: the lease is still this engine's by its own
    // clock, with its margin, and in the database, with the token the reservation was made
    // under. An engine paused since its reservation (past the lease, which another engine
    // may have taken), or whose server session was cut and its lease taken over at once,
    // writes nothing (and says so: `withhold`, by the caller).
    let fence = if crate::planted(crate::Plant::NoWriteFence) {
        svc.borrow().fencing().and_then(|f| f.fence_of(&agent.id))
    } else {
        let checked = svc.borrow_mut().may_write_now(&agent.id, id);
        let engine = || {
            svc.borrow()
                .fencing()
                .map(|f| f.engine.clone())
                .unwrap_or_default()
        };
        match checked {
            Ok(Some(fence)) => fence,
            Ok(None) => return Err(service::Service::fenced(&agent.id, &engine())),
            // The lease cannot be read (a session cut under the engine): no write without it,
            // and another engine may serve the recipient now.
            Err(e) => {
                return Err(ServiceError::Fenced(format!(
                    "engine {} cannot read its lease on {} right before its write ({e}), so it writes nothing",
                    engine(),
                    agent.id
                )));
            }
        }
    };
    let mut outcome = write_now(ctx, svc, id, agent, request_id, fence, report).await?;
    if ctx.policy.planted(model::PlantedBug::RetryUnknownWrite)
        && matches!(
            outcome,
            model::WriteOutcome::TimedOut | model::WriteOutcome::Failed { .. }
        )
    {
        outcome = write_now(ctx, svc, id, agent, request_id, fence, report).await?;
    }
    Ok(outcome)
}

/// Hands one write to the adapter: the card for the message, with `request_id`.
async fn write_now(
    ctx: &Ctx,
    svc: &RefCell<Service>,
    id: &str,
    agent: &AgentRow,
    request_id: &str,
    fence: Option<i64>,
    report: &mut PassReport,
) -> Result<model::WriteOutcome, ServiceError> {
    let (message, work) = svc.borrow_mut().message_and_work(id)?;
    let text = card::card(&message, work.as_ref());
    let db = svc.borrow().db_path().to_owned();
    let write = Write {
        db: &db,
        agent,
        message: &message,
        text: &text,
        request_id,
        fence,
    };
    report.writes += 1;
    Ok(ctx.adapters.start(svc, &write).await)
}

/// Waits until another connection commits, or `deadline`. With the database's file events
/// (`events`) it sleeps until one comes, looking at most every [`FILES_QUIET`] (a file system
/// that sends none); after an event it looks at once and again 1, 2, 4 … 256 ms later, then
/// every 256 ms until 3 s after it, since the commit that wrote the WAL becomes visible only
/// after its sync. Without events it looks every `every`.
async fn watch(
    svc: &RefCell<Service>,
    seen: i64,
    deadline: tokio::time::Instant,
    every: Duration,
    events: &mut Option<tokio::sync::watch::Receiver<u64>>,
) {
    let changed = || svc.borrow().data_version().unwrap_or(seen) != seen;
    let mut recheck: Option<(Duration, tokio::time::Instant)> = None;
    while let Some(rx) = events.as_mut() {
        if changed() {
            return;
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return;
        }
        let nap = recheck.map_or(FILES_QUIET, |(r, _)| r).min(deadline - now);
        tokio::select! {
            biased;
            // `Changes` holds a sender of its own: the channel never closes.
            _ = rx.changed() => recheck = Some((Duration::from_millis(1), tokio::time::Instant::now())),
            () = tokio::time::sleep(nap) => {
                // Doubling up to RECHECK_MAX, then at that pace until RECHECK_FOR after the
                // event (a slow sync of another process's commit).
                recheck = recheck
                    .map(|(r, at)| ((r * 2).min(RECHECK_MAX), at))
                    .filter(|(_, at)| at.elapsed() <= RECHECK_FOR);
            }
        }
    }
    loop {
        let version = svc.borrow().data_version();
        if version.unwrap_or(seen) != seen {
            return;
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return;
        }
        tokio::time::sleep(every.min(deadline - now)).await;
    }
}

impl Engine {
    /// Serves deliveries until `shutdown` resolves: a new job as soon as the database changes
    /// (a send, a finished run, a release) or a job ends, and at the latest when the next
    /// delivery is due or `interval` has passed. On shutdown it stops starting jobs and gives
    /// the running ones a short grace to finish their step.
    /// Returns an error when the database disappears under it (a deleted folder).
    pub async fn run(
        &mut self,
        interval: Duration,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), String> {
        tokio::pin!(shutdown);
        let mut jobs: FuturesUnordered<Job> = FuturesUnordered::new();
        let mut busy: HashSet<String> = HashSet::new();
        let mut report = self.new_report();
        let mut window = Instant::now();
        let db = self.service.borrow().db_path().to_owned();
        // A PostgreSQL database has no file to watch or to lose: a listening session counts
        // the commits of the others (`data_version`), which the engine polls.
        let file = !self.service.borrow().is_postgres();
        let mut changes = if self.files && file {
            service::Changes::watch(&db)
        } else {
            None
        };
        let mut events = changes.as_ref().map(service::Changes::subscribe);
        let mut idle_sync: Option<IdleSync> = None;
        // The steps of jobs ready at the same moment share one commit (`flushing`).
        let _batching = Batching::start(&self.ctx, &self.service);
        let (ctx, svc) = (self.ctx.clone(), self.service.clone());
        loop {
            let failed = self.ctx.sync_failed.borrow().clone();
            if let Some(e) = failed {
                let _ = self.stop(jobs).await;
                return Err(e);
            }
            if file && !db.exists() {
                return Err(format!(
                    "the database {} is gone; the engine stops",
                    db.display()
                ));
            }
            // Read before looking: a commit by another connection meanwhile is noticed.
            let seen = self.service.borrow().data_version().unwrap_or(0);
            let looked = Instant::now();
            self.keep_leases(&busy, &mut report);
            self.housekeeping_if_due(&mut report);
            self.dispatch(&mut jobs, &mut busy, &mut report, true, JOBS_MAX);
            report.pass_ms_max = report.pass_ms_max.max(elapsed_ms(looked));
            let now = self.now();
            let since_report = self.last_report.map(|t| now.since(t));
            if since_report.is_none_or(|ms| {
                ms >= REPORT_HEARTBEAT_MS
                    || (ms >= HOUSEKEEPING_INTERVAL_MS
                        && (report.moved > 0 || !report.errors.is_empty()))
            }) {
                self.log_errors(&report.errors, now);
                report.took_ms = elapsed_ms(window);
                self.save_report(&mut report, now);
                report = self.new_report();
                window = Instant::now();
            }
            let next_due = self
                .service
                .borrow_mut()
                .next_due(QUEUE_HEADS)
                .ok()
                .flatten();
            let mut wait = match next_due {
                Some(d) => {
                    Duration::from_millis(u64::try_from(d - millis(now)).unwrap_or(0)).min(interval)
                }
                None => interval,
            };
            wait = self.sooner_for_housekeeping(wait, now);
            if wait.is_zero() && (!jobs.is_empty() || self.dispatch_failed) {
                // What is due belongs to a recipient whose job is running (or waits for a
                // free job), or the look for it failed: look again when a job ends, another
                // process commits, or the interval passed.
                wait = interval;
            }
            wait = wait.min(self.renewal_wait());
            // What the loop itself wrote (housekeeping, rests, the report) is committed
            // before it yields or waits; the jobs' steps whenever they all wait (`flushing`).
            flush_or_stop(&ctx, &svc);
            if wait.is_zero() {
                // More is due now: let other tasks run, and look whether we were asked to stop.
                tokio::task::yield_now().await;
                tokio::select! {
                    biased;
                    () = &mut shutdown => return self.stop(jobs).await,
                    () = std::future::ready(()) => continue,
                }
            }
            // Nothing the engine committed waits unsynced while it has nothing running
            // (while jobs run, each write syncs everything before it). The sync runs on the
            // blocking pool, so a send that comes meanwhile is not held up by the disk (the
            // simulation, whose worlds are replayed from a seed, syncs in line).
            if jobs.is_empty() && idle_sync.is_none() {
                idle_sync = self.sync_when_idle();
                if self.ctx.sync_failed.borrow().is_some() {
                    continue;
                }
            }
            // While jobs run, their own commits would raise a file event each (a wake of the
            // watch's thread and of this one per WAL write): poll instead, and listen again
            // once they are done.
            let mut polling = None;
            let listen = match changes.as_mut() {
                Some(c) if jobs.is_empty() => {
                    if !c.resume() {
                        changes = None;
                        events = None;
                    }
                    &mut events
                }
                Some(c) => {
                    c.pause();
                    &mut polling
                }
                None => &mut events,
            };
            let deadline = tokio::time::Instant::now() + wait;
            tokio::select! {
                biased;
                () = &mut shutdown => return self.stop(jobs).await,
                Some((recipient, part)) = flushing(&ctx, &svc, jobs.next()), if !jobs.is_empty() => {
                    busy.remove(&recipient);
                    report.absorb(part);
                }
                () = watch(&self.service, seen, deadline, self.watch_every, listen) => {}
                done = async { idle_sync.as_mut().expect("guarded").await }, if idle_sync.is_some() => {
                    idle_sync = None;
                    match done {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => { sync_failure(&self.ctx, &e); }
                        Err(e) => { sync_failure(&self.ctx, &e); }
                    }
                }
            }
        }
    }

    /// `wait`, shortened so that a reminder or a fan-out's deadline is kept as promptly as a
    /// delivery (one that is already due waits for housekeeping's next turn, at most a second
    /// away); so is a commit housekeeping skipped for coming within a second of its last
    /// turn (a fan-out sent then names its deadline only to the next housekeeping).
    fn sooner_for_housekeeping(&self, mut wait: Duration, now: Millis) -> Duration {
        if self.service.borrow().data_version().unwrap_or(0) != self.housekeeping_seen {
            wait = wait.min(Duration::from_millis(HOUSEKEEPING_INTERVAL_MS));
        }
        if let Some(r) = self.next_reminder {
            let until = if r > now {
                r.since(now)
            } else {
                HOUSEKEEPING_INTERVAL_MS
            };
            wait = wait.min(Duration::from_millis(until));
        }
        wait
    }

    /// Syncs what the engine committed now that nothing runs: on the blocking pool (the
    /// sync it hands back), or in line in the simulation.
    fn sync_when_idle(&mut self) -> Option<IdleSync> {
        let mut s = self.service.borrow_mut();
        let mark = s.changes_so_far();
        match s.sync_elsewhere(mark) {
            Ok(None) => {}
            Ok(Some(sync)) if self.files => return Some(tokio::task::spawn_blocking(sync)),
            Ok(Some(sync)) => {
                if let Err(e) = sync() {
                    sync_failure(&self.ctx, &e);
                }
            }
            Err(e) => {
                sync_failure(&self.ctx, &e);
            }
        }
        None
    }

    /// Lets running jobs finish their step for a short while; what is cut off mid-write is
    /// left as a crash would leave it, for the next engine to settle.
    async fn stop(&mut self, mut jobs: FuturesUnordered<Job>) -> Result<(), String> {
        let _ = tokio::time::timeout(
            STOP_GRACE,
            flushing(&self.ctx, &self.service, async {
                while jobs.next().await.is_some() {}
            }),
        )
        .await;
        // After a failed sync nothing more is committed: `run`'s `Batching` rolls back.
        let synced = sync_all(&self.ctx, &self.service);
        let failed = self.ctx.sync_failed.borrow().is_some();
        if !failed && jobs.is_empty() {
            // Another engine may serve these recipients at once (a job cut off mid-step
            // keeps its lease until it expires, as a crash would).
            let _ = self.service.borrow_mut().release_all_leases();
        }
        let off = if failed {
            Ok(())
        } else {
            self.service.borrow_mut().batch_steps(false)
        };
        synced.map_err(|e| e.to_string())?;
        off.map_err(|e| e.to_string())?;
        Ok(())
    }
}
