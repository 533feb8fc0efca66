//! `handoffs sim`: the real engine, store and command adapter in the simulated world of the
//! `sim` package (SPEC §9). Agents are turmoil hosts speaking the command adapter's HTTP
//! protocol; the engine runs in its own host over a real SQLite file in a temporary folder
//! that survives its crashes; a driver sends handoffs and returns work as agents would; the
//! faults of the seed's plan strike at their moments; then every fault heals and every
//! delivery must settle. An oracle compares what the agents received with the engine's
//! records and judges G1–G8 and liveness. Virtual time, seeded ids, `biased` selects: the same
//! seed on the same commit prints the same bytes.

use crate::adapter::http::{Call, HttpError, Method, Reply, Transport};
use crate::engine::Engine;
use crate::service::{Clock, Service};
use crate::store::Store;
use model::{Delivery, Millis, Policy, StateKind};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{Value, json};
use sim::agent::{Agent, AgentState, TurnRates, short};
use sim::oracle::{self, hms};
use sim::status::{Page, StatusPage};
use sim::{FaultKind, FaultPlan};
use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The virtual moment a run starts at (2027-01-15): fixed, so records replay.
const EPOCH_MS: u64 = 1_800_000_000_000;
/// How long faults strike; then everything heals. One hour: long enough for slow turns,
/// provider outages and re-registrations to overlap the sends, short enough that a sweep
/// covers many seeds (swarm testing favours many short runs).
const FAULT_PHASE: Duration = Duration::from_secs(3_600);
/// The driver sends its handoffs over the first 40 minutes of the fault phase.
const SEND_WINDOW: Duration = Duration::from_secs(40 * 60);
/// How long after healing every delivery has to settle.
const SETTLE_LIMIT: Duration = Duration::from_secs(4 * 3_600);
/// The simulation's step: every message takes at least one (latencies are 1-40 ms), so a
/// request and its answer take about a second of virtual time; half a second keeps the
/// network realistic next to the engine's seconds-long timings and a seed cheap.
const TICK: Duration = sim::oracle::TICK;
/// How long after healing a person releases an UNCERTAIN delivery that once had a receipt
/// (no scan can settle one; SPEC leaves it to a person who knows how it ended).
const PERSON_RELEASES_AFTER: Duration = Duration::from_secs(30 * 60);

/// How the i-th agent host treats a write during a running turn: one in three refuses it
/// (an app that checks and writes in one step), one folds it into the running turn (Codex's
/// `turn/start`), one forks the transcript (a second Claude `--resume`). Against the last
/// two only the engine's own checks keep a write out of a running turn.
fn host_kind(i: usize) -> sim::agent::HostKind {
    use sim::agent::HostKind;
    match i % 3 {
        0 => HostKind::Refusing,
        1 => HostKind::Folding,
        _ => HostKind::Forking,
    }
}

/// Runs so far in this process: each gets its own folder.
static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// What one run found.
#[derive(Debug)]
pub struct Outcome {
    pub seed: u64,
    /// The report, byte for byte the same for the same seed and commit.
    pub text: String,
    pub ok: bool,
    pub virtual_time: Duration,
    /// Each check: its key, how many times it was exercised, and whether it held.
    pub verdicts: Vec<(&'static str, usize, bool)>,
}

/// A trace shared by the hosts: (virtual time, host, text).
type Trace = Arc<Mutex<Vec<(Duration, String, String)>>>;

fn note(trace: &Trace, host: &str, text: String) {
    trace
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push((sim::net::elapsed(), host.to_owned(), text));
}

/// The engine's HTTP over the simulated network. It notes, for the oracle, each write as it
/// leaves the engine, and the request id of each write that could not connect (a refusal no
/// agent saw: its host was down).
#[derive(Debug)]
struct SimTransport {
    unconnected: Unconnected,
    /// With several engines: this engine's host name, and the database where each write's
    /// fencing token is compared, as the write leaves, with the recipient's lease then.
    fencing: Option<(String, PathBuf)>,
}

/// The recipient's lease token as stored now (a read of its own over the database file).
fn lease_fence(db: &Path, agent: &str) -> Option<i64> {
    let conn =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .ok()?;
    conn.query_row(
        "SELECT fence FROM recipient_leases WHERE agent = ?1",
        [agent],
        |r| r.get(0),
    )
    .ok()
}

/// What the network saw of the engine's writes.
#[derive(Debug, Default)]
struct Wire {
    /// Request ids of the writes that could not connect, in order.
    unconnected: Vec<String>,
    /// Every write as it left the engine: (request id, when).
    posted: Vec<(String, Duration)>,
    /// With several engines: every write as it left its engine, with its token and the
    /// recipient's lease then.
    fenced: Vec<oracle::FencedWrite>,
}

type Unconnected = Arc<Mutex<Wire>>;

impl Transport for SimTransport {
    fn call<'a>(
        &'a self,
        method: Method,
        url: &'a str,
        body: Option<&'a Value>,
        timeout: Duration,
    ) -> Call<'a> {
        Box::pin(async move {
            let method = match method {
                Method::Get => "GET",
                Method::Post => "POST",
            };
            let request_id = body
                .filter(|_| method == "POST")
                .and_then(|b| b["request_id"].as_str().map(str::to_owned));
            if let Some(rid) = &request_id {
                let mut wire = self
                    .unconnected
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                wire.posted.push((rid.clone(), sim::net::elapsed()));
                if let (Some((engine, db)), Some(b)) = (&self.fencing, body) {
                    let agent = b["agent"].as_str().unwrap_or_default().to_owned();
                    wire.fenced.push(oracle::FencedWrite {
                        lease: lease_fence(db, &agent),
                        agent,
                        request_id: rid.clone(),
                        engine: engine.clone(),
                        fence: b["fence"].as_i64(),
                        at: sim::net::elapsed(),
                    });
                }
            }
            let body = body.map(|b| b.to_string().into_bytes());
            match sim::net::request(method, url, body, timeout).await {
                Ok((status, body)) => Ok(Reply { status, body }),
                Err(sim::net::NetError::Connect(e)) => {
                    if let Some(rid) = request_id {
                        self.unconnected
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .unconnected
                            .push(rid);
                    }
                    Err(HttpError::Connect(e))
                }
                Err(sim::net::NetError::Timeout) => Err(HttpError::Timeout),
                Err(sim::net::NetError::Other(e)) => Err(HttpError::Other(e)),
            }
        })
    }
}

fn sim_clock() -> Clock {
    Arc::new(|| {
        let ms = u64::try_from(sim::net::elapsed().as_millis()).unwrap_or(u64::MAX);
        Millis(EPOCH_MS + ms)
    })
}

fn agent_name(i: usize) -> String {
    format!("a{i}")
}

/// The host that a re-registered agent is moved to (one at a time).
const SPARE: &str = "spare";

/// The command adapter's settings for an agent served by `host`.
fn settings_at(host: &str) -> Vec<(String, Value)> {
    vec![
        ("url".to_owned(), json!(format!("http://{host}/turn"))),
        (
            "status_url".to_owned(),
            json!(format!("http://{host}/status/{{request_id}}")),
        ),
        (
            "activity_url".to_owned(),
            json!(format!("http://{host}/activity")),
        ),
    ]
}

/// The host an agent's registration addresses now (its `url`'s host).
fn registered_host(settings: &Value) -> String {
    settings
        .get("url")
        .and_then(Value::as_str)
        .and_then(|u| u.strip_prefix("http://"))
        .and_then(|u| u.split('/').next())
        .unwrap_or_default()
        .to_owned()
}

/// Whether a reservation of request `?1` was committed: the delivery holds it as its current
/// request id, SENDING with the write issued or past it (a write delayed on the way may
/// arrive after the engine gave up on it), or among its earlier request ids. A pending record
/// with that id (WAITING, BUSY, OWNER_REJECTED…) has no reservation for the attempt.
const RESERVED_SQL: &str = "SELECT count(*) FROM deliveries WHERE
    (json_extract(record, '$.core.request_id') = ?1 AND (
        (state = 'SENDING' AND json_extract(record, '$.issued_at') IS NOT NULL)
        OR state IN ('UNCERTAIN', 'ACCEPTED', 'RUNNING', 'RETURNED', 'FAILED', 'CANCELLED',
                     'ACKNOWLEDGED')))
    OR EXISTS (SELECT 1 FROM json_each(record, '$.core.earlier_request_ids') WHERE value = ?1)";

/// What a recipient does as a write arrives (G8): reads the database file, over its own
/// connection, for a committed reservation of that request id.
fn reservation_check(db: &Path) -> Result<sim::agent::ReservationCheck, String> {
    let conn =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .map_err(|e| e.to_string())?;
    let conn = Mutex::new(conn);
    Ok(sim::agent::ReservationCheck(Arc::new(
        move |request_id: &str| {
            let conn = conn
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            conn.query_row(RESERVED_SQL, [request_id], |r| r.get::<_, i64>(0))
                .is_ok_and(|n| n > 0)
        },
    )))
}

/// How often a turn answers its handoff to the sender (a ping-pong), and how often it fans
/// the work out to two other agents instead; in a chain given a small hop budget, agents
/// answer nearly always (a rally that only the budget stops).
const PING_PONG: f64 = 0.2;
const FAN_OUT: f64 = 0.06;
const RALLY: f64 = 0.85;
const RALLY_BUDGET: i64 = 3;

/// How often a person cancels a handoff's chain while its write is on the way and about to be
/// turned away (busy or refused), or while it is reserved and the engine looks at the
/// recipient's activity one last time before writing it.
const CANCEL_IN_FLIGHT: f64 = 0.25;

/// The handoff to `agent` whose write is reserved and not yet issued, if any.
fn reserved_for(svc: &mut Service, agent: &str) -> Option<String> {
    let sending = svc.deliveries_in(&[StateKind::Sending], 100).ok()?;
    sending
        .into_iter()
        .find(|d| {
            d.recipient == agent && matches!(&d.record, Delivery::Sending(s) if !s.write_issued())
        })
        .map(|d| d.message_id)
}

/// What the world does at writes (SPEC §8.2). Inside a turn: now and then the turn answers
/// its handoff to the sender, or fans it out to two other agents, naming itself by the
/// write's request id as a program in the turn would (`HANDOFFS_REQUEST_ID`), so the service
/// finds the chain; the answers are delivered and may be answered again, until the chain's
/// budget or depth limit refuses one. At a write being turned away: now and then a person
/// cancels its chain in that instant, so the cancel marks a write on the way whose answer
/// then sends the delivery back to waiting (where nothing may write it again). From a random
/// stream of its own; what is sent counts as the driver's sends for G1.
fn at_write(
    db: &Path,
    seed: u64,
    names: &[String],
    sent: &Arc<Mutex<Vec<Sent>>>,
    policy: &Policy,
) -> Result<sim::agent::AtWrite, String> {
    let svc = Service::with_clock(Store::open(db).map_err(|e| e.to_string())?, sim_clock())
        .with_policy(policy.clone());
    let state = Mutex::new((svc, ChaCha8Rng::seed_from_u64(seed ^ 0x7e11)));
    let (names, sent) = (names.to_vec(), sent.clone());
    Ok(sim::agent::AtWrite(Arc::new(
        move |me: &str, request_id: &str, moment: sim::agent::Moment| {
            let mut g = state
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let (svc, rng) = &mut *g;
            let roll: f64 = rng.random();
            if moment != sim::agent::Moment::Taken {
                if roll >= CANCEL_IN_FLIGHT {
                    return None;
                }
                let id = if moment == sim::agent::Moment::Looked {
                    reserved_for(svc, me)?
                } else {
                    svc.message_of_turn(me, request_id).ok().flatten()?
                };
                let when = if moment == sim::agent::Moment::Looked {
                    "reserved"
                } else {
                    "on the way"
                };
                return Some(match svc.chain_cancel(&id, None, Some("plan changed")) {
                    Ok(c) => format!(
                        "a person cancels the chain of {} while its write is {when}: {} \
                         cancelled, {} under way",
                        short(&id),
                        c.cancelled.len(),
                        c.marked.len()
                    ),
                    Err(e) => format!("a person's cancel refused: {e}"),
                });
            }
            let others: Vec<&String> = names.iter().filter(|n| *n != me).collect();
            let picks = [
                rng.random_range(0..others.len()),
                rng.random_range(0..others.len()),
            ];
            let (handoff, hop_budget) = svc.turn_handoff(me, request_id).ok().flatten()?;
            let ping = if hop_budget.is_some_and(|b| b <= RALLY_BUDGET) {
                RALLY
            } else {
                PING_PONG
            };
            if roll >= ping + FAN_OUT {
                return None;
            }
            let to: Vec<&str> = if roll < ping {
                vec![handoff.sender.as_str()]
            } else {
                let mut two = vec![others[picks[0]].as_str(), others[picks[1]].as_str()];
                two.dedup();
                two
            };
            let lineage = crate::service::Lineage {
                request_id: Some(request_id.to_owned()),
                in_turn: true,
                ..Default::default()
            };
            let mut said = Vec::new();
            for to in to.into_iter().filter(|t| names.iter().any(|n| n == t)) {
                let body = format!(
                    "{me} in turn {} answers {}",
                    short(request_id),
                    short(&handoff.id)
                );
                let host = svc
                    .agent(to)
                    .ok()
                    .flatten()
                    .map(|a| registered_host(&a.settings))
                    .unwrap_or_default();
                match svc.send_as(me, to, &body, None, None, None, &lineage) {
                    Ok(s) => {
                        said.push(format!(
                            "sends {} to {to} from its turn (hop {})",
                            short(&s.message.id),
                            s.message.hop
                        ));
                        sent.lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .push(Sent {
                                id: s.message.id,
                                host,
                            });
                    }
                    Err(e) => said.push(format!("send to {to} from its turn refused: {e}")),
                }
            }
            (!said.is_empty()).then(|| said.join("; "))
        },
    )))
}

/// A handoff the driver sent, and the host its recipient was registered at in that instant
/// (the world's fact for G1, read beside the send with no await between them).
#[derive(Clone, Debug)]
struct Sent {
    id: String,
    host: String,
}

/// A person re-registers `agent` at `host`, at virtual time `now`.
fn register_at(db: &Path, agent: &str, host: &str, now: Duration) -> Result<String, String> {
    let at = Millis(EPOCH_MS + u64::try_from(now.as_millis()).unwrap_or(u64::MAX));
    let store = Store::open(db).map_err(|e| e.to_string())?;
    let mut svc = Service::with_clock(store, Arc::new(move || at));
    svc.add_agent(agent, Some("command"), None, None, None, &settings_at(host))
        .map(|a| a.sentence())
        .map_err(|e| e.to_string())
}

/// A temporary folder, removed when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Where a run's world keeps its database: in memory (`/dev/shm`) when the machine has it.
/// The simulation does not model power loss (a crash takes back only what was not
/// committed), so the syncs the engine makes (before each write, before it waits) would only
/// cost disk time, a third of a run.
/// Only with room to spare (a container's default of 64 MB could fill up under parallel runs
/// and fail a run for a reason that is no part of the world).
fn world_folder() -> PathBuf {
    const ROOM: u64 = 512 << 20;
    let shm = Path::new("/dev/shm");
    let usable = shm.is_dir()
        && std::fs::metadata(shm).is_ok_and(|m| !m.permissions().readonly())
        && nix::sys::statvfs::statvfs(shm)
            .is_ok_and(|v| v.blocks_available().saturating_mul(v.fragment_size()) >= ROOM);
    if usable {
        shm.to_owned()
    } else {
        std::env::temp_dir()
    }
}

/// Runs one seed. `policy` is the engine's (the default, or one with a planted bug).
///
/// # Errors
/// When the world cannot be set up (no temporary folder, a store error).
pub fn run(seed: u64, trace_on: bool, policy: &Policy) -> Result<Outcome, String> {
    run_with_engines(seed, trace_on, policy, 1)
}

/// Runs one seed with `engines` engines (1, or 2 sharing the database under recipient
/// leases, each stalling now and then right before a write).
///
/// # Errors
/// When the world cannot be set up, or `engines` is neither 1 nor 2.
pub fn run_with_engines(
    seed: u64,
    trace_on: bool,
    policy: &Policy,
    engines: usize,
) -> Result<Outcome, String> {
    /// Puts the thread's ids back to random even if the run panics.
    struct Seeded;
    impl Drop for Seeded {
        fn drop(&mut self) {
            crate::clock::seed_ids(None);
        }
    }
    if !(1..=ENGINES.len()).contains(&engines) {
        return Err(format!(
            "the simulation runs 1 or {} engines, not {engines}",
            ENGINES.len()
        ));
    }
    crate::clock::seed_ids(Some(seed));
    let _seeded = Seeded;
    run_seeded(seed, trace_on, policy, engines)
}

#[allow(clippy::too_many_lines)]
fn run_seeded(
    seed: u64,
    trace_on: bool,
    policy: &Policy,
    engines: usize,
) -> Result<Outcome, String> {
    let plan = FaultPlan::from_seed(seed);
    let dir = TempDir(world_folder().join(format!(
        "handoffs-sim-{}-{seed}-{}",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::SeqCst)
    )));
    std::fs::create_dir_all(&dir.0)
        .map_err(|e| format!("cannot create a temporary folder: {e}"))?;
    let db = dir.0.join("h.sqlite3");
    let (store, _) = Store::init(&db).map_err(|e| e.to_string())?;
    let mut setup = Service::with_clock(store, sim_clock());
    let names: Vec<String> = (0..plan.agents).map(agent_name).collect();
    for name in &names {
        setup
            .add_agent(name, Some("command"), None, None, None, &settings_at(name))
            .map_err(|e| e.to_string())?;
    }
    setup
        .config_set("outageGuard", r#"{"url": "http://status/summary.json"}"#)
        .map_err(|e| e.to_string())?;
    drop(setup);

    let trace: Trace = Arc::default();
    let rates = turn_rates(&plan);
    // The agents' hosts, then the spare host (the address a re-registration moves one to).
    let agents: Vec<Agent> = names
        .iter()
        .map(String::as_str)
        .chain([SPARE])
        .enumerate()
        .map(|(i, n)| {
            AgentState::new(
                n,
                seed.wrapping_mul(31).wrapping_add(i as u64),
                rates,
                host_kind(i),
            )
        })
        .collect();
    let sent: Arc<Mutex<Vec<Sent>>> = Arc::default();
    let hook = at_write(&db, seed, &names, &sent, policy)?;
    for a in &agents {
        let mut a = a.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        a.reservations = Some(reservation_check(&db)?);
        a.at_write = Some(hook.clone());
    }
    let page: Page = Arc::new(Mutex::new(StatusPage::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let holds: Arc<Mutex<Vec<oracle::HoldRow>>> = Arc::default();
    let published: Arc<Mutex<Vec<oracle::TopicPostRow>>> = Arc::default();
    let fans: Arc<Mutex<Fans>> = Arc::default();
    let unconnected: Unconnected = Arc::default();

    let w = World {
        seed,
        engines,
        db: &db,
        names: &names,
        agents: &agents,
        page: &page,
        policy,
        trace: &trace,
        stop: &stop,
        sent: &sent,
        holds: &holds,
        published: &published,
        fans: &fans,
        unconnected: &unconnected,
        handoffs: plan.handoffs,
    };
    let mut sim = world(&w);
    let checker = rusqlite::Connection::open(&db).map_err(|e| e.to_string())?;
    let Stepped {
        sim_error,
        healed_at,
        released,
        reregistered,
    } = step_until_settled(&mut sim, &w, &fault_actions(&plan), &checker)?;
    let virtual_time = sim.elapsed();
    stop.store(true, Ordering::SeqCst);
    drop(sim);

    let sent = sent
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let mut facts = gather(
        &checker,
        &names,
        &agents,
        &page,
        &sent,
        &released,
        healed_at,
        virtual_time,
    )?;
    facts.reregistered = reregistered;
    observed_by_world(&mut facts, &w);
    let mut verdicts = oracle::judge(&facts, SETTLE_LIMIT);
    let mut ran = oracle::Verdict {
        key: "sim",
        what: "the simulation ran to its end",
        exercised: 1,
        violations: Vec::new(),
    };
    ran.violations.extend(sim_error);
    verdicts.push(ran);
    verdicts.push(kept_counts(&checker)?);
    if engines > 1 {
        let wire = unconnected
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        verdicts.push(oracle::fencing(&wire.fenced));
    }

    let (out, ok) = report(&Report {
        seed,
        plan: &plan,
        trace: trace_on.then_some(&trace),
        agents: &agents,
        facts: &facts,
        sent: sent.len(),
        virtual_time,
        verdicts: &verdicts,
    });
    let verdicts = verdicts
        .iter()
        .map(|v| (v.key, v.exercised, v.ok()))
        .collect();
    Ok(Outcome {
        seed,
        text: out,
        ok,
        virtual_time,
        verdicts,
    })
}

/// The engines' hosts: the first is the one engine of a run with one.
const ENGINES: [&str; 2] = ["engine", "engine-b"];

/// With several engines, each recipient's lease (virtual time): stalls of up to two
/// minutes outlast it.
const SIM_LEASE_MS: u64 = 10_000;

/// With several engines, how often an engine stalls as a whole right before the check that
/// precedes a write (a stopped process, a frozen VM), and for how long at most.
const STALL_AT_WRITE: f64 = 0.04;
const STALL_MAX: Duration = Duration::from_secs(60);

/// What engine `name` calls before the check that precedes each write: now and then it
/// stalls the engine's whole host (`until`, which [`Stalled`] keeps), from a random stream
/// of its own that lives across the engine's restarts.
fn stall_hook(
    name: &'static str,
    stalls: &Arc<Mutex<ChaCha8Rng>>,
    until: &Rc<Cell<Option<Duration>>>,
    trace: &Trace,
) -> crate::engine::BeforeWrite {
    let (stalls, until, trace) = (stalls.clone(), until.clone(), trace.clone());
    crate::engine::BeforeWrite(Rc::new(move |request_id: &str| {
        let mut rng = stalls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if rng.random_bool(STALL_AT_WRITE) {
            let ms = rng.random_range(1_000..=u64::try_from(STALL_MAX.as_millis()).unwrap_or(1));
            let d = Duration::from_millis(ms);
            until.set(Some(sim::net::elapsed() + d));
            note(
                &trace,
                name,
                format!(
                    "stalls for {} s right before its write of {}",
                    d.as_secs(),
                    short(request_id)
                ),
            );
        }
    }))
}

/// A host's future that stands still while `until` lies ahead: the whole engine stalls (its
/// jobs, its renewals, its housekeeping), while the world's clock and its own timers run on,
/// as for a stopped process.
struct Stalled<F> {
    inner: std::pin::Pin<Box<F>>,
    until: Rc<Cell<Option<Duration>>>,
    sleep: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl<F: std::future::Future> std::future::Future for Stalled<F> {
    type Output = F::Output;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        if let Some(until) = self.until.get() {
            let now = sim::net::elapsed();
            if now < until {
                let sleep = self
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(until.saturating_sub(now))));
                if sleep.as_mut().poll(cx).is_pending() {
                    return std::task::Poll::Pending;
                }
            }
            self.until.set(None);
            self.sleep = None;
        }
        self.inner.as_mut().poll(cx)
    }
}

/// What a seed's world is made of.
struct World<'a> {
    seed: u64,
    /// How many engines share the database (1, or 2 under recipient leases).
    engines: usize,
    db: &'a Path,
    names: &'a [String],
    agents: &'a [Agent],
    page: &'a Page,
    policy: &'a Policy,
    trace: &'a Trace,
    stop: &'a Arc<AtomicBool>,
    sent: &'a Arc<Mutex<Vec<Sent>>>,
    holds: &'a Arc<Mutex<Vec<oracle::HoldRow>>>,
    published: &'a Arc<Mutex<Vec<oracle::TopicPostRow>>>,
    fans: &'a Arc<Mutex<Fans>>,
    unconnected: &'a Unconnected,
    handoffs: usize,
}

/// The fan-outs the driver sent and when it returned each piece of work (its own record).
#[derive(Default)]
struct Fans {
    sent: Vec<oracle::FanoutRow>,
    returns: BTreeMap<String, Duration>,
}

/// What the world itself recorded as the run went (the network, the person, the driver),
/// into the oracle's facts.
fn observed_by_world(facts: &mut oracle::Run, w: &World<'_>) {
    {
        let wire = w
            .unconnected
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        facts.unconnected_writes.clone_from(&wire.unconnected);
        facts.posted.clone_from(&wire.posted);
    }
    facts.holds.clone_from(
        &w.holds
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    facts.topic_posts.clone_from(
        &w.published
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    {
        let fans = w
            .fans
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        facts.fanouts.clone_from(&fans.sent);
        facts.returns.clone_from(&fans.returns);
    }
}

/// The simulated network: the status page, the agents' hosts (and the spare), the engine,
/// and the driver (the people who send).
fn world(w: &World<'_>) -> sim::turmoil::Sim<'static> {
    let mut sim = sim::turmoil::Builder::new()
        .simulation_duration(FAULT_PHASE + SETTLE_LIMIT + Duration::from_secs(3_600))
        .tick_duration(TICK)
        .min_message_latency(Duration::from_millis(1))
        .max_message_latency(Duration::from_millis(40))
        .rng_seed(w.seed)
        .build();
    {
        let page = w.page.clone();
        sim.host("status", move || sim::status::host(page.clone()));
    }
    for (name, agent) in w
        .names
        .iter()
        .map(String::as_str)
        .chain([SPARE])
        .zip(w.agents)
    {
        let agent = agent.clone();
        sim.host(name, move || sim::agent::host(agent.clone()));
    }
    for (k, &name) in ENGINES.iter().enumerate().take(w.engines) {
        let db = w.db.to_owned();
        let policy = w.policy.clone();
        let trace = w.trace.clone();
        let unconnected = w.unconnected.clone();
        let shared = w.engines > 1;
        let stalls = Arc::new(Mutex::new(ChaCha8Rng::seed_from_u64(
            w.seed ^ 0x57a1_1000 ^ k as u64,
        )));
        sim.host(name, move || {
            let db = db.clone();
            let policy = policy.clone();
            let trace = trace.clone();
            let transport = SimTransport {
                unconnected: unconnected.clone(),
                fencing: shared.then(|| (name.to_owned(), db.clone())),
            };
            let until: Rc<Cell<Option<Duration>>> = Rc::default();
            let hook = stall_hook(name, &stalls, &until, &trace);
            let engine = async move {
                note(&trace, name, "starts".to_owned());
                let store = Store::open(&db)?;
                let service = Service::with_clock(store, sim_clock());
                let engine = if shared {
                    let fencing = crate::service::leases::Fencing::named(name, "sim", SIM_LEASE_MS);
                    Engine::sharing(service, fencing)?.with_pause_before_write(hook)
                } else {
                    Engine::new(service, false)?
                };
                let mut engine = engine
                    .with_policy(policy)
                    .with_http(crate::adapter::http::Http::new(transport))
                    .with_watch_interval(Duration::from_secs(1));
                engine
                    .run(Duration::from_secs(5), std::future::pending())
                    .await?;
                Ok(())
            };
            Stalled {
                inner: Box::pin(engine),
                until,
                sleep: None,
            }
        });
    }
    {
        let db = w.db.to_owned();
        let names = w.names.to_vec();
        let trace = w.trace.clone();
        let stop = w.stop.clone();
        let sent = w.sent.clone();
        let holds = w.holds.clone();
        let published = w.published.clone();
        let fans = w.fans.clone();
        let handoffs = w.handoffs;
        let seed = w.seed;
        let policy = w.policy.clone();
        sim.client("driver", async move {
            let person = Person {
                trace: &trace,
                sent: &sent,
                published: &published,
                fans: &fans,
                holds: &holds,
                stop: &stop,
                policy: &policy,
            };
            driver(&db, seed, &names, handoffs, &person).await?;
            Ok(())
        });
    }

    sim
}

/// The agents' turn rates of a plan.
fn turn_rates(plan: &FaultPlan) -> TurnRates {
    TurnRates {
        refusal: plan.refusal_rate,
        errored: plan.errored_turn_rate,
        interrupted: plan.interrupted_turn_rate,
        slow: plan.slow_turn_rate,
        person: plan.person_turn_rate,
        failed_write: plan.failed_write_rate,
        unknown_activity: plan.unknown_activity_rate,
        racing_turn: plan.racing_turn_rate,
    }
}

/// The plan's faults as start and end actions, in time order.
fn fault_actions(plan: &FaultPlan) -> Vec<(Duration, bool, FaultKind)> {
    let mut actions = Vec::new();
    for f in plan.faults(FAULT_PHASE) {
        actions.push((f.at, true, f.kind.clone()));
        actions.push((f.at + f.for_, false, f.kind));
    }
    actions.sort_by_key(|a| a.0);
    actions
}

/// What a run's report says.
#[derive(Clone, Copy)]
struct Report<'a> {
    seed: u64,
    plan: &'a FaultPlan,
    /// The trace, when asked for.
    trace: Option<&'a Trace>,
    agents: &'a [Agent],
    facts: &'a oracle::Run,
    sent: usize,
    virtual_time: Duration,
    verdicts: &'a [oracle::Verdict],
}

/// The run's report, and whether every guarantee held.
fn report(r: &Report<'_>) -> (String, bool) {
    let Report {
        seed,
        plan,
        trace,
        agents,
        facts,
        sent,
        virtual_time,
        verdicts,
    } = *r;
    let mut out = String::new();
    let _ = writeln!(out, "handoffs sim --seed {seed}");
    let _ = writeln!(out, "plan: {plan}");
    let _ = writeln!(
        out,
        "hosts: {}",
        (0..plan.agents)
            .map(|i| format!("{} {}", agent_name(i), host_kind(i).name()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if let Some(trace) = trace {
        let mut lines = trace
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        for a in agents {
            let a = a.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            for (at, text) in &a.trace {
                lines.push((*at, a.id.clone(), text.clone()));
            }
        }
        lines.extend(
            facts
                .events
                .iter()
                .filter(|e| matches!(e.kind.as_str(), "state" | "reminder" | "release" | "chain"))
                // The database's history line: committed by whichever engine (or a person)
                // took the step, which the line does not say.
                .map(|e| {
                    (
                        e.at,
                        "history".to_owned(),
                        format!("{} {}", short(&e.message), e.detail),
                    )
                }),
        );
        lines.sort_by_key(|l| l.0);
        let _ = writeln!(out, "trace:");
        for (at, host, text) in lines {
            let _ = writeln!(out, "  {}  {host:<7} {text}", hms(at));
        }
    }
    let _ = writeln!(
        out,
        "world: {} handoffs sent, {} deliveries, {} writes received, virtual time {}",
        sent,
        facts.deliveries.len(),
        facts.writes.len(),
        hms(virtual_time)
    );
    let ok = verdicts.iter().all(oracle::Verdict::ok);
    for v in verdicts {
        out.push_str(&v.line());
    }
    if ok {
        let _ = writeln!(out, "verdict: every guarantee held");
    } else {
        let _ = writeln!(
            out,
            "verdict: FAILED; replay with: handoffs sim --seed {seed} --trace"
        );
    }
    (out, ok)
}

/// What stepping the world to its end found.
struct Stepped {
    sim_error: Option<String>,
    healed_at: Option<Duration>,
    released: BTreeSet<String>,
    reregistered: BTreeSet<String>,
}

/// Steps the world: faults start and end as planned, every fault heals at the end of the
/// fault phase, a person releases what stays uncertain, and the run ends once everything is
/// settled (or the settle limit passes).
fn step_until_settled(
    sim: &mut sim::turmoil::Sim<'static>,
    w: &World<'_>,
    actions: &[(Duration, bool, FaultKind)],
    checker: &rusqlite::Connection,
) -> Result<Stepped, String> {
    let mut next_action = 0;
    let mut sim_error: Option<String> = None;
    let mut driver_done = false;
    let mut healed_at: Option<Duration> = None;
    let mut last_check = Duration::ZERO;
    let mut released: BTreeSet<String> = BTreeSet::new();
    let mut faults_on: BTreeMap<String, u32> = BTreeMap::new();
    let mut reregistered: BTreeSet<String> = BTreeSet::new();
    loop {
        let now = sim.elapsed();
        while healed_at.is_none() && next_action < actions.len() && actions[next_action].0 <= now {
            let (_, start, kind) = actions[next_action].clone();
            next_action += 1;
            // Faults of one kind on one target may overlap: the first to end must not end
            // the others (a fault is on while any of its windows lasts).
            let key = format!("{kind:?}");
            let n = faults_on.entry(key).or_default();
            let (was, now_on) = (*n, if start { *n + 1 } else { n.saturating_sub(1) });
            *n = now_on;
            if let (FaultKind::Reregistered(a), true) = (&kind, start) {
                reregistered.insert(w.names[*a].clone());
            }
            if (was == 0) != (now_on == 0) {
                apply(
                    sim, w.db, w.names, w.agents, w.page, w.trace, now, start, &kind,
                );
            }
        }
        if healed_at.is_none() && now >= FAULT_PHASE {
            heal(sim, w.db, w.names, w.agents, w.page, w.trace, now);
            healed_at = Some(now);
        }
        if now >= last_check + Duration::from_secs(60) {
            last_check = now;
            if let Some(h) = healed_at {
                let rows = delivery_rows(checker)?;
                if now >= h + PERSON_RELEASES_AFTER {
                    person_releases(w.db, &rows, &mut released, w.trace, now)?;
                }
                if now > h + SETTLE_LIMIT {
                    break;
                }
                if rows.iter().all(oracle::settled) {
                    // Settled: stop the driver (it may still return work, which is a new
                    // delivery), and end once it is gone and everything is still settled.
                    if driver_done {
                        break;
                    }
                    w.stop.store(true, Ordering::SeqCst);
                    last_check = now.saturating_sub(Duration::from_secs(59));
                }
            }
        }
        match sim.step() {
            Ok(done) => driver_done = done,
            Err(e) => {
                sim_error = Some(format!("the simulation stopped at {}: {e}", hms(now)));
                break;
            }
        }
    }
    Ok(Stepped {
        sim_error,
        healed_at,
        released,
        reregistered,
    })
}

/// Starts or ends one fault.
#[allow(clippy::too_many_arguments)]
fn apply(
    sim: &mut sim::turmoil::Sim<'_>,
    db: &Path,
    names: &[String],
    agents: &[Agent],
    page: &Page,
    trace: &Trace,
    now: Duration,
    start: bool,
    kind: &FaultKind,
) {
    let text = match (kind, start) {
        (FaultKind::LostReplies(a), true) => {
            sim.partition_oneway(names[*a].as_str(), "engine");
            format!("replies from {} are lost", names[*a])
        }
        (FaultKind::LostReplies(a), false) => {
            sim.repair_oneway(names[*a].as_str(), "engine");
            format!("replies from {} arrive again", names[*a])
        }
        (FaultKind::HeldLink(a), true) => {
            sim.hold("engine", names[*a].as_str());
            format!("the link to {} holds its messages", names[*a])
        }
        (FaultKind::HeldLink(a), false) => {
            sim.release("engine", names[*a].as_str());
            format!("the link to {} lets its messages go", names[*a])
        }
        (FaultKind::AgentDown(a), true) => {
            sim.crash(names[*a].as_str());
            format!("{} goes down", names[*a])
        }
        (FaultKind::AgentDown(a), false) => {
            sim.bounce(names[*a].as_str());
            format!("{} comes back", names[*a])
        }
        (FaultKind::ProviderOutage, on) => {
            page.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .set(on, now);
            if on {
                "the status page reports an outage".to_owned()
            } else {
                "the status page is green again".to_owned()
            }
        }
        (FaultKind::EngineCrash, true) => {
            sim.crash("engine");
            "the engine crashes".to_owned()
        }
        (FaultKind::EngineCrash, false) => {
            sim.bounce("engine");
            "the engine restarts".to_owned()
        }
        (FaultKind::LostRequests(a), true) => {
            sim.partition_oneway("engine", names[*a].as_str());
            format!("requests to {} are lost", names[*a])
        }
        (FaultKind::LostRequests(a), false) => {
            sim.repair_oneway("engine", names[*a].as_str());
            format!("requests to {} arrive again", names[*a])
        }
        (FaultKind::HistoryDown(a), on) => {
            agents[*a]
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .history_down = on;
            if on {
                format!("{}'s history cannot be read", names[*a])
            } else {
                format!("{}'s history can be read again", names[*a])
            }
        }
        (FaultKind::Reregistered(a), on) => {
            let host = if on { SPARE } else { names[*a].as_str() };
            match register_at(db, &names[*a], host, now) {
                Ok(said) => format!("a person re-registers {} at {host}: {said}", names[*a]),
                Err(e) => format!("re-registering {} at {host} failed: {e}", names[*a]),
            }
        }
    };
    trace
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push((now, "world".to_owned(), text));
}

/// Ends every fault: links repaired and released, hosts up, the page green, agents calm.
fn heal(
    sim: &mut sim::turmoil::Sim<'_>,
    db: &Path,
    names: &[String],
    agents: &[Agent],
    page: &Page,
    trace: &Trace,
    now: Duration,
) {
    for (name, agent) in names.iter().map(String::as_str).chain([SPARE]).zip(agents) {
        sim.repair_oneway(name, "engine");
        sim.repair_oneway("engine", name);
        sim.release("engine", name);
        if !sim.is_host_running(name) {
            sim.bounce(name);
        }
        agent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .heal();
    }
    if !sim.is_host_running("engine") {
        sim.bounce("engine");
    }
    // A person puts a re-registered agent back at its own address.
    let moved: Vec<&String> = Service::open(db)
        .and_then(|mut svc| {
            svc.agents()
                .map_err(|e| crate::store::StoreError::Io(e.to_string()))
        })
        .map(|agents| {
            names
                .iter()
                .filter(|n| {
                    agents
                        .iter()
                        .any(|a| &a.id == *n && registered_host(&a.settings) != n.as_str())
                })
                .collect()
        })
        .unwrap_or_default();
    for name in moved {
        let said = register_at(db, name, name, now).unwrap_or_else(|e| e);
        trace
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((
                now,
                "world".to_owned(),
                format!("a person puts {name} back: {said}"),
            ));
    }
    page.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .set(false, now);
    trace
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push((now, "world".to_owned(), "every fault heals".to_owned()));
}

/// The driver: sends the plan's handoffs over the send window (half of them work, some with
/// a due time), then returns work whose turn returned, as its recipient would.
/// What the driver shares with the run: its trace, what it sent, the holds it made, and
/// when to stop.
struct Person<'a> {
    trace: &'a Trace,
    sent: &'a Mutex<Vec<Sent>>,
    /// The posts the driver published, with who subscribed as each was.
    published: &'a Mutex<Vec<oracle::TopicPostRow>>,
    /// The fan-outs it sent and the work it returned.
    fans: &'a Mutex<Fans>,
    holds: &'a Mutex<Vec<oracle::HoldRow>>,
    stop: &'a AtomicBool,
    /// The engine's policy: a planted bug of the service's (a chain's cancel) is the
    /// person's service's too.
    policy: &'a Policy,
}

/// A hold the driver makes for a while: sending paused, or one connection blocked.
struct Hold {
    pair: Option<(usize, usize)>,
    from: Duration,
    until: Duration,
    on: bool,
    done: bool,
}

/// Starts or ends the holds whose time has come.
fn holds_due(
    svc: &mut Service,
    names: &[String],
    planned: &mut [Hold],
    person: &Person<'_>,
) -> Result<(), Box<dyn std::error::Error>> {
    let now = sim::turmoil::elapsed();
    for h in planned.iter_mut().filter(|h| !h.done) {
        let start = !h.on && now >= h.from;
        let end = h.on && now >= h.until;
        if !start && !end {
            continue;
        }
        let what = match h.pair {
            None => {
                svc.config_set("enabled", if start { "false" } else { "true" })?;
                if start {
                    "pauses sending"
                } else {
                    "resumes sending"
                }
                .to_owned()
            }
            Some((a, b)) => {
                svc.set_connection(&names[a], &names[b], end)?;
                format!(
                    "{} {} → {}",
                    if start { "blocks" } else { "allows" },
                    names[a],
                    names[b]
                )
            }
        };
        note(person.trace, "driver", format!("a person {what}"));
        let mut rows = person
            .holds
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if start {
            h.on = true;
            rows.push(oracle::HoldRow {
                pair: h.pair.map(|(a, b)| (names[a].clone(), names[b].clone())),
                from: now,
                until: None,
            });
        } else {
            h.done = true;
            let pair = h.pair.map(|(a, b)| (names[a].clone(), names[b].clone()));
            if let Some(r) = rows
                .iter_mut()
                .rev()
                .find(|r| r.pair == pair && r.until.is_none())
            {
                r.until = Some(now);
            }
        }
    }
    Ok(())
}

/// A person pauses sending, or blocks one connection, for 5 to 15 minutes, in some runs;
/// drawn from a stream of its own, so the sends of older seeds stay as they were.
fn planned_holds(seed: u64, names: &[String]) -> Vec<Hold> {
    let mut planned: Vec<Hold> = Vec::new();
    {
        let mut hr = ChaCha8Rng::seed_from_u64(seed ^ 0x401d);
        let window = u64::try_from(SEND_WINDOW.as_millis()).unwrap_or(u64::MAX);
        let hold = |pair: Option<(usize, usize)>, hr: &mut ChaCha8Rng| {
            let from = Duration::from_millis(hr.random_range(0..window));
            let until = from + Duration::from_secs(hr.random_range(300..900));
            Hold {
                pair,
                from,
                until,
                on: false,
                done: false,
            }
        };
        if hr.random_bool(0.3) {
            planned.push(hold(None, &mut hr));
        }
        if hr.random_bool(0.3) {
            let a = hr.random_range(0..names.len());
            let b = (a + hr.random_range(1..names.len())) % names.len();
            planned.push(hold(Some((a, b)), &mut hr));
        }
    }
    planned
}

async fn driver(
    db: &Path,
    seed: u64,
    names: &[String],
    handoffs: usize,
    person: &Person<'_>,
) -> Result<(), Box<dyn std::error::Error>> {
    let (trace, sent, stop) = (person.trace, person.sent, person.stop);
    let mut svc =
        Service::with_clock(Store::open(db)?, sim_clock()).with_policy(person.policy.clone());
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xd21e);
    let mut planned = planned_holds(seed, names);
    let mut returned: Vec<(String, String)> = Vec::new();
    // A person cancels the chain of an earlier handoff now and then (SPEC §8.2), from a
    // stream of its own.
    let mut cancels = ChaCha8Rng::seed_from_u64(seed ^ 0xca9c);
    // Some handoffs answer an earlier one the sender received (`--parent`), so chains grow
    // into trees; from a stream of its own too.
    let mut links = ChaCha8Rng::seed_from_u64(seed ^ 0x11ae);
    // Half the chains start with a budget of a few hops and 1,000 tokens, and agents working
    // in a chain spend tokens from it now and then (SPEC §8.2); a stream of its own as well.
    let mut budgets = ChaCha8Rng::seed_from_u64(seed ^ 0xb0d6);
    // Agents subscribe to a topic, leave it and publish on it now and then (SPEC §8.2
    // broadcast), from a stream of its own; the topic keeps few posts, so retention works.
    let mut topics = ChaCha8Rng::seed_from_u64(seed ^ 0x70b1);
    svc.topic_create(TOPIC, Some(4), None, None)?;
    // Now and then a sender splits work to several agents (SPEC §8.2 fan-out), from a
    // stream of its own.
    let mut fan_rng = ChaCha8Rng::seed_from_u64(seed ^ 0xfa9);
    let mut subscribers: BTreeSet<String> = BTreeSet::new();
    let mut ids: Vec<String> = Vec::new();
    let mut received: Vec<(usize, String)> = Vec::new();
    let gap_ms = u64::try_from(SEND_WINDOW.as_millis()).unwrap_or(u64::MAX)
        / u64::try_from(handoffs.max(1)).unwrap_or(1);
    for i in 0..handoffs {
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..2 * gap_ms))).await;
        holds_due(&mut svc, names, &mut planned, person)?;
        let from = rng.random_range(0..names.len());
        let to = (from + rng.random_range(1..names.len())) % names.len();
        let work = rng.random_bool(0.5);
        let title = work.then(|| format!("task {i}"));
        let due = (work && rng.random_bool(0.3)).then_some(20);
        let body = format!("handoff {i} from {} to {}", names[from], names[to]);
        let host = svc
            .agent(&names[to])?
            .map(|a| registered_host(&a.settings))
            .unwrap_or_default();
        let parent = links
            .random_bool(0.4)
            .then(|| received.iter().rev().find(|(r, _)| *r == from))
            .flatten()
            .map(|(_, id)| id.clone());
        let budget = (parent.is_none() && budgets.random_bool(0.5))
            .then(|| format!("hops={},tokens=1000", budgets.random_range(1..=3)));
        maybe_spend(&mut svc, names, &received, &mut budgets, trace);
        let lineage = crate::service::Lineage {
            parent,
            budget,
            ..Default::default()
        };
        match svc.send_as(
            &names[from],
            &names[to],
            &body,
            title.as_deref(),
            due,
            None,
            &lineage,
        ) {
            Ok(s) => {
                received.push((to, s.message.id.clone()));
                note(
                    trace,
                    "driver",
                    format!(
                        "sends {} {} → {}{}",
                        short(&s.message.id),
                        names[from],
                        names[to],
                        title
                            .map(|t| format!(" (work \"{t}\")"))
                            .unwrap_or_default()
                    ),
                );
                ids.push(s.message.id.clone());
                sent.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(Sent {
                        id: s.message.id,
                        host,
                    });
            }
            Err(e) => note(trace, "driver", format!("send refused: {e}")),
        }
        maybe_cancel(&mut svc, &ids, &mut cancels, trace);
        maybe_publish(&mut svc, names, &mut topics, &mut subscribers, person);
        maybe_fan_out(&mut svc, names, &mut fan_rng, person);
    }
    while !stop.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_secs(60)).await;
        if stop.load(Ordering::SeqCst) {
            break;
        }
        holds_due(&mut svc, names, &mut planned, person)?;
        tend(&mut svc, names, &mut rng, &mut returned, person)?;
        cancel_under_way(&mut svc, &mut cancels, trace)?;
    }
    Ok(())
}

/// The topic the simulated agents publish on.
const TOPIC: &str = "news";

/// Now and then a sender splits a piece of work to two or three others, joined on all or a
/// quorum, with a deadline of a few minutes or none: the oracle's `fanouts` check judges
/// each join against the driver's own record of the returns.
fn maybe_fan_out(svc: &mut Service, names: &[String], rng: &mut ChaCha8Rng, person: &Person<'_>) {
    if names.len() < 3 || !rng.random_bool(0.12) {
        return;
    }
    let from = rng.random_range(0..names.len());
    let n = rng.random_range(2..=names.len().min(4) - 1);
    let mut to: Vec<String> = (1..names.len())
        .map(|k| names[(from + k) % names.len()].clone())
        .collect();
    while to.len() > n {
        to.remove(rng.random_range(0..to.len()));
    }
    let quorum = rng.random_range(1..=n);
    let join = if quorum == n {
        "all".to_owned()
    } else {
        format!("quorum:{quorum}")
    };
    let deadline = rng
        .random_bool(0.7)
        .then(|| f64::from(rng.random_range(2_u32..=8)));
    let at = sim::turmoil::elapsed();
    let title = format!(
        "fan {}",
        person
            .fans
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .sent
            .len()
    );
    let hosts: Vec<String> = to
        .iter()
        .map(|t| {
            svc.agent(t)
                .ok()
                .flatten()
                .map(|a| registered_host(&a.settings))
                .unwrap_or_default()
        })
        .collect();
    let lineage = crate::service::Lineage::default();
    match svc.fan_out(&crate::service::FanOut {
        from: &names[from],
        to: &to,
        body: "split work",
        title: &title,
        join: Some(&join),
        deadline_minutes: deadline,
        cancel_rest: rng.random_bool(0.3),
        due_minutes: None,
        key: None,
        lineage: &lineage,
    }) {
        Ok(done) => {
            note(
                person.trace,
                "driver",
                format!(
                    "{} fans out {} to {} ({join}{})",
                    names[from],
                    short(&done.fanout.id),
                    to.join(", "),
                    deadline
                        .map(|m| format!(", deadline {m} min"))
                        .unwrap_or_default()
                ),
            );
            let children: Vec<String> =
                done.children.iter().map(|c| c.message.id.clone()).collect();
            person
                .sent
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .extend(done.children.iter().zip(&hosts).map(|(c, host)| Sent {
                    id: c.message.id.clone(),
                    host: host.clone(),
                }));
            person
                .fans
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .sent
                .push(oracle::FanoutRow {
                    id: done.fanout.id.clone(),
                    chain: done.children[0].message.chain_id.clone(),
                    children,
                    quorum,
                    deadline: deadline.map(|m| at + Duration::from_secs_f64(m * 60.0)),
                });
        }
        Err(e) => note(person.trace, "driver", format!("fan-out refused: {e}")),
    }
}

/// Now and then an agent subscribes to the topic or leaves it, and one publishes on it: the
/// oracle's `topics` check compares each post's notifications with who subscribed as it was
/// published (the driver's own record, not the store's).
fn maybe_publish(
    svc: &mut Service,
    names: &[String],
    rng: &mut ChaCha8Rng,
    subscribers: &mut BTreeSet<String>,
    person: &Person<'_>,
) {
    let trace = person.trace;
    if rng.random_bool(0.3) {
        let a = &names[rng.random_range(0..names.len())];
        if subscribers.contains(a) {
            match svc.topic_unsubscribe(TOPIC, a) {
                Ok(_) => {
                    subscribers.remove(a);
                    note(trace, "driver", format!("{a} leaves {TOPIC}"));
                }
                Err(e) => note(trace, "driver", format!("unsubscribe refused: {e}")),
            }
        } else {
            match svc.topic_subscribe(TOPIC, a, false) {
                Ok(_) => {
                    subscribers.insert(a.clone());
                    note(trace, "driver", format!("{a} subscribes to {TOPIC}"));
                }
                Err(e) => note(trace, "driver", format!("subscribe refused: {e}")),
            }
        }
    }
    if rng.random_bool(0.4) {
        let from = &names[rng.random_range(0..names.len())];
        match svc.topic_publish(TOPIC, from, &format!("news from {from}"), None) {
            Ok(p) => {
                note(
                    trace,
                    "driver",
                    format!(
                        "{from} publishes {TOPIC} #{}; told {}",
                        p.position,
                        if p.notified.is_empty() {
                            "nobody".to_owned()
                        } else {
                            p.notified.join(", ")
                        }
                    ),
                );
                person
                    .published
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(oracle::TopicPostRow {
                        title: format!("{TOPIC} #{}", p.position),
                        publisher: from.clone(),
                        at: sim::turmoil::elapsed(),
                        subscribers: subscribers.clone(),
                    });
            }
            Err(e) => note(trace, "driver", format!("publish refused: {e}")),
        }
    }
}

/// Now and then, a person cancels the chain of a handoff whose turn is under way (the write
/// out, or the turn running): the cancel marks it and lets it run, and whatever it does next
/// (a busy answer, a refusal, an error with a resend planned) must not write it again.
fn cancel_under_way(
    svc: &mut Service,
    rng: &mut ChaCha8Rng,
    trace: &Trace,
) -> Result<(), Box<dyn std::error::Error>> {
    if !rng.random_bool(0.15) {
        return Ok(());
    }
    let under_way = svc.deliveries_in(
        &[
            StateKind::Sending,
            StateKind::Uncertain,
            StateKind::Accepted,
            StateKind::Running,
        ],
        100,
    )?;
    if under_way.is_empty() {
        return Ok(());
    }
    let id = under_way[rng.random_range(0..under_way.len())]
        .message_id
        .clone();
    cancel_chain_of(svc, &id, trace);
    Ok(())
}

/// What people do once a minute after the sends: recipients read some of the plain handoffs
/// that reached them, recipients return some delivered work, senders close some of the work
/// returned to them.
fn tend(
    svc: &mut Service,
    names: &[String],
    rng: &mut ChaCha8Rng,
    returned: &mut Vec<(String, String)>,
    person: &Person<'_>,
) -> Result<(), Box<dyn std::error::Error>> {
    let trace = person.trace;
    // Recipients read some of the plain handoffs that reached them; senders close some
    // of the work returned to them.
    for name in names {
        for m in svc.inbox(name, false, 100)? {
            let delivered = svc.delivery_state(&m.id)? == Some(StateKind::Returned);
            if m.work_id.is_none() && delivered && rng.random_bool(0.5) {
                svc.read(&m.id, name)?;
                note(trace, "driver", format!("{name} reads {}", short(&m.id)));
            }
        }
    }
    let mut kept = Vec::new();
    for (id, sender) in returned.drain(..) {
        if rng.random_bool(0.5) {
            match svc.close(&id, &sender, crate::service::Outcome::Accepted, None) {
                Ok(_) => note(trace, "driver", format!("{sender} closes {}", short(&id))),
                Err(e) => note(trace, "driver", format!("close refused: {e}")),
            }
        } else {
            kept.push((id, sender));
        }
    }
    *returned = kept;
    let done = svc.open_work_returned(1_000)?;
    for crate::service::WorkRow {
        id,
        recipient,
        sender,
        ..
    } in done
    {
        if !rng.random_bool(0.7) {
            continue;
        }
        let _ = svc.accept(&id, &recipient);
        match svc.return_work(&id, &recipient, "done (simulated)", None, false) {
            Ok(_) => {
                person
                    .fans
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .returns
                    .entry(id.clone())
                    .or_insert_with(sim::turmoil::elapsed);
                note(
                    trace,
                    "driver",
                    format!("{recipient} returns {}", short(&id)),
                );
                returned.push((id, sender));
            }
            Err(e) => note(trace, "driver", format!("return refused: {e}")),
        }
    }
    Ok(())
}

/// Now and then, an agent working on one of the last handoffs it received spends tokens from
/// that handoff's chain.
fn maybe_spend(
    svc: &mut Service,
    names: &[String],
    received: &[(usize, String)],
    rng: &mut ChaCha8Rng,
    trace: &Trace,
) {
    if received.is_empty() || !rng.random_bool(0.6) {
        return;
    }
    let recent = &received[received.len().saturating_sub(6)..];
    let (who, id) = &recent[rng.random_range(0..recent.len())];
    let tokens = rng.random_range(150..=450);
    let lineage = crate::service::Lineage {
        parent: Some(id.clone()),
        ..Default::default()
    };
    match svc.chain_spend(&names[*who], &format!("tokens={tokens}"), &lineage) {
        Ok(s) => note(
            trace,
            "driver",
            format!(
                "{} spends {tokens} tokens in chain {} (on {})",
                names[*who],
                short(&s.chain.id),
                short(id)
            ),
        ),
        Err(e) => note(trace, "driver", format!("spend refused: {e}")),
    }
}

/// Now and then, a person cancels the chain of one of the handoffs sent so far.
fn maybe_cancel(svc: &mut Service, ids: &[String], rng: &mut ChaCha8Rng, trace: &Trace) {
    if ids.is_empty() || !rng.random_bool(0.08) {
        return;
    }
    let id = &ids[rng.random_range(0..ids.len())];
    cancel_chain_of(svc, id, trace);
}

/// A person cancels the chain of handoff `id`.
fn cancel_chain_of(svc: &mut Service, id: &str, trace: &Trace) {
    match svc.chain_cancel(id, None, Some("plan changed")) {
        Ok(c) => note(
            trace,
            "driver",
            format!(
                "cancels the chain of {}: {} cancelled, {} under way",
                short(id),
                c.cancelled.len(),
                c.marked.len()
            ),
        ),
        Err(e) => note(trace, "driver", format!("cancel refused: {e}")),
    }
}

/// What the chains' oracle reads: each cancelled chain and when, and each message's chain.
#[allow(clippy::type_complexity)]
fn chain_facts(
    c: &rusqlite::Connection,
) -> Result<(BTreeMap<String, Duration>, BTreeMap<String, String>), String> {
    let err = |e: rusqlite::Error| e.to_string();
    let at = virtual_at;
    let mut st = c
        .prepare("SELECT id, updated_at FROM chains WHERE state = 'cancelled'")
        .map_err(err)?;
    let cancels = st
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))
        .and_then(Iterator::collect::<rusqlite::Result<Vec<_>>>)
        .map_err(err)?
        .into_iter()
        .map(|(id, ms)| (id, at(ms)))
        .collect();
    let chain_of = pairs(c, "SELECT id, chain_id FROM messages")?;
    Ok((cancels, chain_of))
}

/// What the budgets' oracle reads: each chain's hop budget, depth limit and unit limits, and
/// what was taken from them, counted from the handoffs and the spends themselves (a work's
/// return, a reminder or a notification continues no chain: only sends spend hops).
fn chain_budgets(c: &rusqlite::Connection) -> Result<Vec<oracle::ChainBudgetRow>, String> {
    let err = |e: rusqlite::Error| e.to_string();
    let mut st = c
        .prepare(
            "SELECT c.id, c.hop_budget, c.depth_limit, c.units,
                    (SELECT count(*) FROM messages m WHERE m.chain_id = c.id
                        AND m.intent = 'handoff' AND m.kind IN ('plain', 'work')
                        AND m.parent_id IS NOT NULL),
                    (SELECT coalesce(max(m.hop), 0) FROM messages m WHERE m.chain_id = c.id
                        AND m.intent = 'handoff' AND m.kind IN ('plain', 'work'))
             FROM chains c ORDER BY c.id",
        )
        .map_err(err)?;
    let mut rows = st
        .query_map([], |r| {
            Ok((
                oracle::ChainBudgetRow {
                    chain: r.get(0)?,
                    hop_budget: r.get(1)?,
                    depth_limit: r.get(2)?,
                    continuations: r.get(4)?,
                    deepest: r.get(5)?,
                    ..Default::default()
                },
                r.get::<_, String>(3)?,
            ))
        })
        .and_then(Iterator::collect::<rusqlite::Result<Vec<_>>>)
        .map_err(err)?;
    let mut spends = c
        .prepare("SELECT unit, sum(amount) FROM chain_spends WHERE chain_id = ?1 GROUP BY unit")
        .map_err(err)?;
    let mut out = Vec::with_capacity(rows.len());
    for (mut row, units) in rows.drain(..) {
        let units: BTreeMap<String, Value> = serde_json::from_str(&units)
            .map_err(|e| format!("chain {}: units are not JSON: {e}", row.chain))?;
        row.limits = units
            .iter()
            .filter_map(|(u, l)| Some((u.clone(), l.get("limit")?.as_i64()?)))
            .collect();
        row.spent = spends
            .query_map([&row.chain], |r| Ok((r.get(0)?, r.get(1)?)))
            .and_then(Iterator::collect::<rusqlite::Result<_>>)
            .map_err(err)?;
        out.push(row);
    }
    Ok(out)
}

/// The rows of a query of two text columns, as a map from the first to the second.
fn pairs(c: &rusqlite::Connection, sql: &str) -> Result<BTreeMap<String, String>, String> {
    let mut st = c.prepare(sql).map_err(|e| e.to_string())?;
    st.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
        .and_then(Iterator::collect::<rusqlite::Result<BTreeMap<_, _>>>)
        .map_err(|e| e.to_string())
}

/// The deliveries a person released: each stuck one the driver released, and every pending
/// one of a cancelled chain.
fn released_by_people(
    c: &rusqlite::Connection,
    driver: &BTreeSet<String>,
) -> Result<BTreeSet<String>, String> {
    let mut st = c
        .prepare("SELECT DISTINCT message_id FROM events WHERE kind = 'release'")
        .map_err(|e| e.to_string())?;
    let mut all = driver.clone();
    all.extend(
        st.query_map([], |r| r.get::<_, String>(0))
            .and_then(Iterator::collect::<rusqlite::Result<Vec<_>>>)
            .map_err(|e| e.to_string())?,
    );
    Ok(all)
}

/// A person who knows how a stuck delivery ended releases each UNCERTAIN delivery that once
/// had a receipt (scans cannot settle those), once.
fn person_releases(
    db: &Path,
    rows: &[oracle::DeliveryRow],
    released: &mut BTreeSet<String>,
    trace: &Trace,
    now: Duration,
) -> Result<(), String> {
    let stuck: Vec<&oracle::DeliveryRow> = rows
        .iter()
        .filter(|d| d.state == "UNCERTAIN" && d.had_receipt && !released.contains(&d.id))
        .collect();
    if stuck.is_empty() {
        return Ok(());
    }
    let at = Millis(EPOCH_MS + u64::try_from(now.as_millis()).unwrap_or(u64::MAX));
    let store = Store::open(db).map_err(|e| e.to_string())?;
    let mut svc = Service::with_clock(store, Arc::new(move || at));
    for d in stuck {
        let said = match svc.release(&d.id, Some("the person saw the turn run")) {
            Ok(v) => v.state.as_str().to_owned(),
            Err(e) => e.to_string(),
        };
        released.insert(d.id.clone());
        trace
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((
                now,
                "person".to_owned(),
                format!("releases {}: {said}", short(&d.id)),
            ));
    }
    Ok(())
}

/// The deliveries as the oracle reads them: plain rows from the stored records.
fn delivery_rows(c: &rusqlite::Connection) -> Result<Vec<oracle::DeliveryRow>, String> {
    // Where each agent is registered now, by the route settings a delivery freezes.
    let mut agents = c
        .prepare_cached("SELECT id, settings FROM agents")
        .map_err(|e| e.to_string())?;
    let registered: std::collections::BTreeMap<String, Value> = agents
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
        .and_then(Iterator::collect::<rusqlite::Result<Vec<_>>>)
        .map_err(|e| e.to_string())?
        .into_iter()
        .map(|(id, s)| (id, serde_json::from_str(&s).unwrap_or(Value::Null)))
        .collect();
    let mut st = c
        .prepare_cached("SELECT message_id, recipient, record FROM deliveries ORDER BY seq")
        .map_err(|e| e.to_string())?;
    let rows: Vec<(String, String, String)> = st
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .and_then(Iterator::collect)
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for (id, recipient, raw) in rows {
        let record: Delivery = serde_json::from_str(&raw)
            .map_err(|e| format!("delivery {id} does not decode: {e}"))?;
        let core = record.core();
        let mut request_ids: Vec<String> = core
            .earlier_request_ids()
            .iter()
            .map(ToString::to_string)
            .collect();
        request_ids.push(core.request_id().to_string());
        // The route a record freezes holds each routing setting as its JSON text.
        let destination_restored = registered.get(&recipient).is_some_and(|settings| {
            model::ROUTE_SETTINGS.iter().all(|k| {
                core.target().route.get(*k).map(String::as_str)
                    == settings.get(*k).map(Value::to_string).as_deref()
            })
        });
        out.push(oracle::DeliveryRow {
            destination_restored,
            id,
            recipient,
            state: record.kind().as_str().to_owned(),
            request_ids,
            refusals: core.refusals(),
            error_resends: core.error_resends(),
            interrupt_resends: core.interrupt_resends(),
            resend_pending: matches!(&record, Delivery::Failed(f)
                if matches!(f.resend(), model::states::ResendPlan::NotBefore { .. })),
            had_receipt: matches!(&record, Delivery::Uncertain(u) if u.turn().is_some()),
            destination_changed: matches!(&record, Delivery::Unavailable(u)
                if matches!(u.reason(), model::states::UnavailableReason::TargetChanged { .. })),
            cancelled_by_scans: match &record {
                Delivery::Cancelled(c) => match c.by() {
                    model::states::CancelledBy::HistoryScans {
                        scans,
                        first_at,
                        last_at,
                    } => Some((*scans, Duration::from_millis(last_at.since(*first_at)))),
                    model::states::CancelledBy::Person { .. } => None,
                },
                _ => None,
            },
        });
    }
    Ok(out)
}

/// The counts the store keeps as rows change (`delivery_counts`, the page's totals) against a
/// count of the rows themselves, their records decoded here.
fn kept_counts(c: &rusqlite::Connection) -> Result<oracle::Verdict, String> {
    let err = |e: rusqlite::Error| e.to_string();
    let mut counted: BTreeMap<String, (i64, i64, i64)> = BTreeMap::new();
    let mut st = c
        .prepare("SELECT message_id, record FROM deliveries")
        .map_err(err)?;
    let rows: Vec<(String, String)> = st
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .and_then(Iterator::collect)
        .map_err(err)?;
    for (id, raw) in rows {
        let record: Delivery = serde_json::from_str(&raw)
            .map_err(|e| format!("delivery {id} does not decode: {e}"))?;
        let core = record.core();
        let e = counted
            .entry(record.kind().as_str().to_owned())
            .or_default();
        e.0 += 1;
        e.1 += i64::from(core.attempts());
        e.2 += i64::from(core.error_resends() + core.interrupt_resends());
    }
    let mut st = c
        .prepare("SELECT state, n, attempts, resends FROM delivery_counts WHERE n != 0 OR attempts != 0 OR resends != 0")
        .map_err(err)?;
    let kept: BTreeMap<String, (i64, i64, i64)> = st
        .query_map([], |r| Ok((r.get(0)?, (r.get(1)?, r.get(2)?, r.get(3)?))))
        .and_then(Iterator::collect)
        .map_err(err)?;
    let mut v = oracle::Verdict {
        key: "counts",
        what: "the counts the store keeps match its deliveries",
        exercised: counted.len(),
        violations: Vec::new(),
    };
    if kept != counted {
        v.violations.push(format!(
            "kept (deliveries, attempts, resends) by state {kept:?}, counted {counted:?}"
        ));
    }
    Ok(v)
}

/// A stored time (ms since the epoch) as the simulation's virtual time.
fn virtual_at(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0).saturating_sub(EPOCH_MS))
}

/// Every event about a message, in order.
fn message_events(c: &rusqlite::Connection) -> Result<Vec<oracle::EventRow>, String> {
    let err = |e: rusqlite::Error| e.to_string();
    let at = virtual_at;
    let mut st = c
        .prepare(
            "SELECT at, message_id, kind, detail FROM events
             WHERE message_id IS NOT NULL ORDER BY seq",
        )
        .map_err(err)?;
    st.query_map([], |r| {
        Ok(oracle::EventRow {
            at: at(r.get(0)?),
            message: r.get(1)?,
            kind: r.get(2)?,
            detail: r.get(3)?,
        })
    })
    .and_then(Iterator::collect)
    .map_err(err)
}

/// Everything the oracle judges, read once the run is over.
#[allow(clippy::too_many_arguments)]
fn gather(
    c: &rusqlite::Connection,
    names: &[String],
    agents: &[Agent],
    page: &Page,
    sent: &[Sent],
    released: &BTreeSet<String>,
    healed_at: Option<Duration>,
    end: Duration,
) -> Result<oracle::Run, String> {
    let err = |e: rusqlite::Error| e.to_string();
    let at = virtual_at;
    let events = message_events(c)?;
    let mut writes = Vec::new();
    let mut turns_ended = Vec::new();
    let mut status_queries = Vec::new();
    for (host, a) in names.iter().map(String::as_str).chain([SPARE]).zip(agents) {
        let a = a.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for r in &a.received {
            writes.push(oracle::WriteRow {
                host: host.to_owned(),
                write: r.clone(),
            });
        }
        for (rid, when, how) in &a.ended {
            turns_ended.push((host.to_owned(), rid.clone(), *when, *how));
        }
        for (when, rid, found) in &a.status_queries {
            let answer = if *found {
                oracle::HistoryAnswer::Found
            } else {
                oracle::HistoryAnswer::NotFound
            };
            status_queries.push((host.to_owned(), *when, rid.clone(), answer));
        }
        for (when, rid) in &a.unanswered_queries {
            let answer = oracle::HistoryAnswer::Unreadable;
            status_queries.push((host.to_owned(), *when, rid.clone(), answer));
        }
    }
    status_queries.sort_by_key(|q| q.1);
    let (chain_cancels, chain_of) = chain_facts(c)?;
    writes.sort_by_key(|w| w.write.at);
    let mut st = c
        .prepare(
            "SELECT w.id, w.due_at,
                    (SELECT min(t) FROM (
                        SELECT min(m.created_at) AS t FROM messages m
                         WHERE m.work_id = w.id AND m.kind = 'return'
                        UNION ALL
                        SELECT min(e.at) FROM events e WHERE e.message_id = w.id
                           AND e.kind = 'work' AND e.detail LIKE 'closed as cancelled%')),
                    (SELECT group_concat(m.created_at) FROM messages m WHERE m.work_id = w.id AND m.kind = 'reminder'),
                    (SELECT count(*) FROM messages m JOIN deliveries d ON d.message_id = m.id
                      WHERE m.work_id = w.id AND m.kind = 'reminder')
             FROM work w WHERE w.due_at IS NOT NULL ORDER BY w.created_at",
        )
        .map_err(err)?;
    let work: Vec<oracle::WorkRow> = st
        .query_map([], |r| {
            let reminders: Option<String> = r.get(3)?;
            Ok(oracle::WorkRow {
                id: r.get(0)?,
                due_at: at(r.get(1)?),
                returned_at: r.get::<_, Option<i64>>(2)?.map(at),
                reminders: reminders
                    .unwrap_or_default()
                    .split(',')
                    .filter_map(|t| t.parse().ok())
                    .map(at)
                    .collect(),
                reminder_deliveries: r.get::<_, i64>(4)?.try_into().unwrap_or(usize::MAX),
            })
        })
        .and_then(Iterator::collect)
        .map_err(err)?;
    Ok(oracle::Run {
        deliveries: delivery_rows(c)?,
        events,
        writes,
        turns_ended,
        status_queries,
        sent: sent
            .iter()
            .map(|s| oracle::SentRow {
                id: s.id.clone(),
                host: s.host.clone(),
            })
            .collect(),
        work,
        outages: page
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .windows
            .clone(),
        // A person's releases: each stuck delivery, and every pending one of a cancelled chain.
        released: released_by_people(c, released)?,
        reregistered: BTreeSet::new(),
        unconnected_writes: Vec::new(),
        chain_cancels,
        chain_of,
        posted: Vec::new(),
        dead_letters: pairs(
            c,
            "SELECT message_id, reason FROM dead_letters
             WHERE message_id IS NOT NULL AND replayed_at IS NULL AND dropped_at IS NULL
             ORDER BY created_at",
        )?,
        chain_budgets: chain_budgets(c)?,
        holds: Vec::new(),
        senders: pairs(c, "SELECT id, sender FROM messages")?,
        busy_answers: agents
            .iter()
            .map(|a| {
                a.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .busy_answers
            })
            .sum(),
        registered: {
            let mut st = c.prepare("SELECT id, settings FROM agents").map_err(err)?;
            st.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
                .and_then(Iterator::collect::<rusqlite::Result<Vec<_>>>)
                .map_err(err)?
                .into_iter()
                .map(|(id, settings)| {
                    let settings = serde_json::from_str(&settings).unwrap_or(Value::Null);
                    (id, registered_host(&settings))
                })
                .collect()
        },
        healed_at,
        end,
        topic_posts: Vec::new(),
        topic_notices: topic_notices(c)?,
        fanouts: Vec::new(),
        returns: BTreeMap::new(),
        combined: combined(c)?,
        work_cancelled: {
            let mut st = c
                .prepare("SELECT id FROM work WHERE state = 'closed' AND outcome = 'cancelled'")
                .map_err(err)?;
            st.query_map([], |r| r.get::<_, String>(0))
                .and_then(Iterator::collect::<rusqlite::Result<BTreeSet<_>>>)
                .map_err(err)?
        },
    })
}

/// Every combined return of a fan-out in the store: the first child it answers, when it
/// was made, and what its title says (`joined (K/N): …` or `partial (K/N): …`).
fn combined(c: &rusqlite::Connection) -> Result<Vec<oracle::CombinedRow>, String> {
    let err = |e: rusqlite::Error| e.to_string();
    let mut st = c
        .prepare(
            "SELECT id, parent_id, created_at, title FROM messages
             WHERE sender = 'handoffs' AND kind = 'return' AND intent = 'handoff'
             ORDER BY seq",
        )
        .map_err(err)?;
    let rows = st
        .query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, Option<String>>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, Option<String>>(3)?,
            ))
        })
        .and_then(Iterator::collect::<rusqlite::Result<Vec<_>>>)
        .map_err(err)?;
    Ok(rows
        .into_iter()
        .map(|(id, parent, at, title)| {
            let title = title.unwrap_or_default();
            let answered = title
                .split_once('(')
                .and_then(|(_, rest)| rest.split_once('/'))
                .and_then(|(k, _)| k.parse().ok())
                .unwrap_or(usize::MAX);
            oracle::CombinedRow {
                id,
                first_child: parent.unwrap_or_default(),
                at: virtual_at(at),
                partial: title.starts_with("partial"),
                answered,
            }
        })
        .collect())
}

/// Every topic notification in an inbox: its title, its recipient, and whether it got a
/// delivery (a notification must never become a turn).
fn topic_notices(c: &rusqlite::Connection) -> Result<Vec<(String, String, bool)>, String> {
    let err = |e: rusqlite::Error| e.to_string();
    let mut st = c
        .prepare(
            // Every notification titled as a post, straight from the inboxes (not through
            // `topic_notices`, whose key would hide a second copy).
            "SELECT m.title, m.recipient,
                    EXISTS (SELECT 1 FROM deliveries d WHERE d.message_id = m.id)
             FROM messages m
             WHERE m.intent = 'notification' AND m.title LIKE 'news #%'
             ORDER BY m.seq",
        )
        .map_err(err)?;
    st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .and_then(Iterator::collect::<rusqlite::Result<Vec<_>>>)
        .map_err(err)
}

/// A sweep's summary.
#[derive(Debug, Default)]
pub struct Sweep {
    pub runs: u64,
    pub failures: Vec<u64>,
    pub virtual_time: Duration,
    /// Per check: in how many runs it was exercised, and how many times in all.
    pub exercised: Vec<(&'static str, u64, u64)>,
}

impl Sweep {
    fn count(&mut self, o: &Outcome) {
        for (key, n, _) in &o.verdicts {
            let i = if let Some(i) = self.exercised.iter().position(|(k, _, _)| k == key) {
                i
            } else {
                self.exercised.push((key, 0, 0));
                self.exercised.len() - 1
            };
            let e = &mut self.exercised[i];
            e.1 += u64::from(*n > 0);
            e.2 += *n as u64;
        }
    }

    /// One line per check: how often the sweep exercised it.
    pub fn exercised_lines(&self) -> String {
        let mut out = String::new();
        for (key, runs, total) in &self.exercised {
            let _ = writeln!(
                out,
                "{key:<8} exercised in {runs} of {} runs ({total} checks){}",
                self.runs,
                if *runs == 0 { ": NOT EXERCISED" } else { "" }
            );
        }
        out
    }
}

/// Runs seeds `from..=to`, calling `each` with every outcome.
///
/// # Errors
/// When a world cannot be set up.
pub fn sweep(
    from: u64,
    to: u64,
    policy: &Policy,
    engines: usize,
    mut each: impl FnMut(&Outcome),
) -> Result<Sweep, String> {
    let mut s = Sweep::default();
    for seed in from..=to {
        let o = run_with_engines(seed, false, policy, engines)?;
        s.runs += 1;
        s.virtual_time += o.virtual_time;
        s.count(&o);
        if !o.ok {
            s.failures.push(seed);
        }
        each(&o);
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::kept_counts;
    use crate::service::Service;
    use std::path::Path;

    /// A database at `db` where `a` has sent `b` (both demo agents) `n` handoffs.
    fn sent(db: &Path, n: usize) {
        let (mut s, _) = Service::init(db).unwrap();
        for agent in ["a", "b"] {
            s.add_agent(agent, Some("demo"), None, None, None, &[])
                .unwrap();
        }
        for i in 0..n {
            s.send("a", "b", &format!("m{i}"), None, None, None)
                .unwrap();
        }
    }

    /// The kept counts follow inserts and moves, and the check names a count that drifted.
    #[test]
    fn kept_counts_match_until_one_drifts() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("h.db");
        sent(&db, 3);
        let c = rusqlite::Connection::open(&db).unwrap();
        let v = kept_counts(&c).unwrap();
        assert!(v.ok(), "{:?}", v.violations);
        assert_eq!(v.exercised, 1);
        c.execute("UPDATE delivery_counts SET n = n + 1", [])
            .unwrap();
        let v = kept_counts(&c).unwrap();
        assert!(!v.ok());
        assert!(v.violations[0].starts_with("kept (deliveries, attempts, resends)"));
    }

    /// A database of schema 6 gets its counts from the records it holds.
    #[test]
    fn counts_are_filled_from_the_records_on_upgrade() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("h.db");
        sent(&db, 2);
        let c = rusqlite::Connection::open(&db).unwrap();
        c.execute_batch(
            "DROP TRIGGER deliveries_count_insert; DROP TRIGGER deliveries_count_delete;
             DROP TRIGGER deliveries_count_update; DROP TABLE delivery_counts;
             DROP INDEX deliveries_state; CREATE INDEX deliveries_state ON deliveries (state, updated_at);
             ALTER TABLE deliveries DROP COLUMN attempts; ALTER TABLE deliveries DROP COLUMN resends;
             UPDATE deliveries SET record = json_set(record, '$.core.attempts', 2);
             PRAGMA user_version = 6;",
        )
        .unwrap();
        drop(c);
        drop(Service::open(&db).unwrap());
        let c = rusqlite::Connection::open(&db).unwrap();
        let v = kept_counts(&c).unwrap();
        assert!(v.ok(), "{:?}", v.violations);
        let attempts: i64 = c
            .query_row("SELECT sum(attempts) FROM delivery_counts", [], |r| {
                r.get(0)
            })
            .unwrap();
        assert_eq!(attempts, 4);
    }
}
