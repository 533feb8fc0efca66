//! The one API every front calls: register agents, send, read, work contracts, status,
//! release, configuration. Each operation validates its input, then runs in one short
//! transaction, so nothing is ever written half-way. It never talks to an agent: delivery is
//! the engine's job.

pub mod agents;
pub mod artifacts;
pub mod card;
pub mod chains;
pub mod changes;
pub mod config;
pub mod dead;
pub mod deliveries;
pub mod fanout;
pub mod leases;
pub mod ledger;
pub mod messages;
pub mod pass;
pub mod session;
pub mod status;
pub mod tasks;
pub mod tokens;
pub mod topics;
pub mod trace;
pub mod work;

/// Whether a database names a PostgreSQL server (a `postgres://` URL), not a SQLite file.
pub use crate::store::pg::check_url as check_db_url;
pub use crate::store::pg::is_url as is_postgres_url;

/// Whether a failure to open `db` may pass by itself, so that a long-running process
/// (`run`, `serve`, `demo`) waits for it: a server out of reach or turning sessions away for
/// now, a session lost, a schema not created yet. Not a login the server refused, another
/// application's database, one of a newer build, or a corrupt one.
pub fn worth_waiting_for(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::Io(_) | StoreError::Missing(_) | StoreError::Locked
    )
}

/// Whether the server of `db` answers (a session opens and closes again): for a PostgreSQL
/// URL; a SQLite path has no server and always answers. What `demo` waits for before it
/// creates its team there.
pub fn server_answers(db: &std::path::Path) -> Result<(), StoreError> {
    if is_postgres_url(db) {
        crate::store::pg::PgSession::connect(&db.to_string_lossy())?;
    }
    Ok(())
}
pub use crate::store::{
    AgentRow, ChainRow, DeadLetterRow, DeliveryRow, EventRow, FanoutRow, IdTable, MessageRow,
    StoreError, TraceRow, WorkRow, shown, token_path,
};
pub use agents::AgentAdded;
pub use chains::{ChainView, Lineage};
pub use changes::Changes;
pub use fanout::{FanOut, FannedOut, FanoutView, Returned};
pub use messages::Sent;
pub use pass::StepReads;
pub use session::Session;
pub use status::{EngineHealth, Overview, Unenrolled};
pub use work::{Outcome, work_message};

use crate::store::{Store, Tx, millis};
use model::work::WorkState;
use model::{
    Core, Delivery, EventKind, MessageId, MessageKind, Millis, Permission, Provider, RequestId,
    StateKind, Target,
};
use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::sync::Arc;

pub const MESSAGE_CHARS_MAX: usize = 200_000;
pub const TITLE_CHARS_MAX: usize = 200;
pub const SUMMARY_CHARS_MAX: usize = 4_000;
pub const ID_CHARS_MAX: usize = 200;
pub const DUE_MINUTES_MAX: i64 = 43_200;
pub const ID_PREFIX_MIN: usize = 6;
/// The longest list one call returns (an inbox, the tasks).
pub const LIST_LIMIT_MAX: i64 = 10_000;

/// Why an operation did not happen. Every front maps these in one place.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The request itself is malformed (exit 2, HTTP 400).
    #[error("{0}")]
    Usage(String),
    /// Well-formed but refused (exit 1, HTTP 409/404/403).
    #[error("{0}")]
    Refused(String),
    /// Something that names nothing that exists (exit 1, HTTP 404).
    #[error("{0}")]
    NotFound(String),
    /// An engine's step or write for a recipient whose lease moved to another engine.
    #[error("{0}")]
    Fenced(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

pub type Result<T, E = ServiceError> = std::result::Result<T, E>;

fn usage<T>(msg: impl Into<String>) -> Result<T> {
    Err(ServiceError::Usage(msg.into()))
}
fn refused<T>(msg: impl Into<String>) -> Result<T> {
    Err(ServiceError::Refused(msg.into()))
}

/// A source of the current time (the real clock, or the simulation's).
pub type Clock = Arc<dyn Fn() -> Millis + Send + Sync>;

/// The service over one database.
pub struct Service {
    store: Store,
    clock: Clock,
    /// The rules this service decides by (only its planted bug is read, in test builds).
    policy: model::Policy,
    /// An engine's identity and recipient leases (`None` for every other front).
    fencing: Option<leases::Fencing>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service")
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

/// A delivery as the fronts show it.
#[derive(Clone, Debug, Serialize)]
pub struct DeliveryView {
    pub id: String,
    pub from: String,
    pub to: String,
    pub title: Option<String>,
    pub state: StateKind,
    pub detail: String,
    pub attempts: u32,
    pub request_id: String,
    pub earlier_request_ids: Vec<String>,
    pub enrolled_at: i64,
    pub updated_at: i64,
}

/// One delivery with its history.
#[derive(Clone, Debug, Serialize)]
pub struct DeliveryDetail {
    #[serde(flatten)]
    pub delivery: DeliveryView,
    pub record: Delivery,
    pub events: Vec<EventRow>,
}

/// Checks an agent id: `[A-Za-z0-9._-]{1,64}`.
/// The sender of what `handoffs` itself tells an agent (a chain stopped or cancelled): no
/// agent, so never an agent to itself; no agent may be registered under it.
pub const SYSTEM_SENDER: &str = "handoffs";

pub fn check_agent_id(id: &str) -> Result<()> {
    if id_shaped(id) {
        Ok(())
    } else {
        usage(format!(
            "invalid agent id {:?}: use 1-64 letters, digits, '.', '_' or '-'",
            truncate(id, 80)
        ))
    }
}

/// `[A-Za-z0-9._-]{1,64}`: the shape of agent ids and topic names.
fn id_shaped(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn truncate(s: &str, chars: usize) -> String {
    s.chars().take(chars).collect()
}

fn check_len(what: &str, value: &str, max: usize) -> Result<()> {
    check_no_nul(what, value)?;
    let n = value.chars().count();
    if n > max {
        usage(format!("{what} is {n} characters; the limit is {max}"))
    } else {
        Ok(())
    }
}

/// Text with a NUL character is refused on both backends alike: PostgreSQL cannot store one
/// in a `text` column, and a store whose backends kept different texts would not be one.
fn check_no_nul(what: &str, value: &str) -> Result<()> {
    if value.contains('\0') {
        usage(format!(
            "{what} contains a NUL character (\\0), which cannot be stored"
        ))
    } else {
        Ok(())
    }
}

pub fn body_hash(body: &str) -> String {
    hex::encode(Sha256::digest(body.as_bytes()))
}

pub fn parse_provider(s: &str) -> Result<Provider> {
    s.parse().map_err(ServiceError::Usage)
}

/// The agent as a delivery target.
pub fn target_of(agent: &AgentRow) -> Option<Target> {
    let provider = parse_provider(&agent.provider).ok()?;
    Some(Target {
        agent: model::AgentId::new(&agent.id),
        provider,
        endpoint: agent.endpoint.clone(),
        cwd: agent.cwd.clone(),
        route: agent.route(),
    })
}

/// Whether delivery is enabled and from→to allowed (SPEC §5 `allow`/`block`, `config`).
pub fn permission(tx: &Tx<'_>, from: &str, to: &str) -> Result<Permission, StoreError> {
    let enabled = tx
        .config("enabled")?
        .and_then(|v| v.as_bool())
        .unwrap_or(true);
    if !enabled {
        return Ok(Permission::Paused);
    }
    Ok(if connection_allowed(tx, from, to)? {
        Permission::Allowed
    } else {
        Permission::Blocked
    })
}

fn connection_allowed(tx: &Tx<'_>, from: &str, to: &str) -> Result<bool, StoreError> {
    if from == to {
        return Ok(false);
    }
    if let Some(explicit) = tx.connection(from, to)? {
        return Ok(explicit);
    }
    let mode = tx.config("connections")?;
    Ok(mode.as_ref().and_then(Value::as_str) != Some("explicit"))
}

/// Whether `work` is still open (not returned, blocked or closed); a plain message is open
/// until its recipient reads it.
pub fn work_open(tx: &Tx<'_>, message: &MessageRow) -> Result<bool, StoreError> {
    // A cancelled chain's work is closed: nothing of it is resent.
    if tx.in_cancelled_chain(&message.id)? {
        return Ok(false);
    }
    match &message.work_id {
        Some(work_id) if message.kind == "work" => {
            Ok(tx.work(work_id)?.is_some_and(|w| w.state.is_open()))
        }
        _ => Ok(message.read_at.is_none()),
    }
}

/// Creates the delivery for `message` (SPEC §2.1), inside the caller's transaction.
pub fn enrol(
    tx: &Tx<'_>,
    message: &MessageRow,
    now: Millis,
) -> Result<Option<StateKind>, StoreError> {
    let Some(agent) = tx.agent(&message.recipient)? else {
        return Ok(None);
    };
    let Some(target) = target_of(&agent) else {
        return Ok(None);
    };
    let kind = if message.kind == "plain" {
        MessageKind::Plain
    } else {
        MessageKind::Work
    };
    let core = Core::enrol(
        MessageId::new(&message.id),
        target,
        kind,
        message.body_hash.clone(),
        RequestId::new(crate::clock::new_id()),
        now,
    );
    let duplicate_of = if kind == MessageKind::Plain {
        tx.live_identical(message)?.map(MessageId::new)
    } else {
        None
    };
    let mut record = model::enrol(core, duplicate_of);
    // Enrolled late (after `enabledAfter` moved back) in a chain cancelled meanwhile: it is
    // cancelled with its chain, never written.
    if tx.in_cancelled_chain(&message.id)?
        && !crate::planted::planted(crate::planted::Plant::EnrolIgnoresCancel)
    {
        let release = EventKind::Release {
            note: Some("its chain was cancelled".to_owned()),
        };
        record = model::step(
            record,
            model::Event::new(now, release),
            &model::Policy::default(),
        )
        .record;
    }
    let state = record.kind();
    let due = (state == StateKind::Waiting).then_some(millis(now));
    tx.insert_delivery(
        &DeliveryRow {
            message_id: message.id.clone(),
            recipient: message.recipient.clone(),
            record,
            due_at: due,
            updated_at: millis(now),
        },
        &message.id,
    )?;
    let detail = match state {
        StateKind::Duplicate => {
            "enrolled as DUPLICATE of a live identical handoff; not sent".to_owned()
        }
        StateKind::Cancelled => format!(
            "enrolled for {}; CANCELLED: its chain was cancelled, so it is never written",
            message.recipient
        ),
        _ => format!("enrolled for {}; WAITING", message.recipient),
    };
    tx.event(millis(now), Some(&message.id), "delivery", &detail)?;
    Ok(Some(state))
}

/// The `enabledAfter` instant (ms), 0 when unset.
pub fn enabled_after(tx: &Tx<'_>) -> Result<i64, StoreError> {
    Ok(tx
        .config("enabledAfter")?
        .and_then(|v| v.as_i64())
        .unwrap_or(0))
}

impl crate::adapter::Host for Service {
    fn runs(&mut self) -> &mut Store {
        &mut self.store
    }

    fn db(&self) -> &std::path::Path {
        self.store.path()
    }

    fn now(&self) -> Millis {
        Service::now(self)
    }

    fn accept_work(&mut self, message: &str, agent: &str) -> Result<(), String> {
        self.accept(message, agent)
            .map(drop)
            .map_err(|e| e.to_string())
    }

    fn return_work(&mut self, message: &str, agent: &str, summary: &str) -> Result<(), String> {
        Service::return_work(self, message, agent, summary, None, false)
            .map(drop)
            .map_err(|e| e.to_string())
    }
}

impl Service {
    pub fn new(store: Store) -> Service {
        Service::with_clock(store, Arc::new(crate::clock::now))
    }

    /// The service over the existing database at `path`.
    pub fn open(path: &std::path::Path) -> Result<Service, StoreError> {
        Ok(Service::new(Store::open(path)?))
    }

    /// The service over the database at `path`, created (mode 0600) when missing; says
    /// whether it was created.
    pub fn init(path: &std::path::Path) -> Result<(Service, crate::store::Created), StoreError> {
        let (store, created) = Store::init(path)?;
        Ok((Service::new(store), created))
    }

    /// The database's file.
    pub fn db_path(&self) -> &std::path::Path {
        self.store.path()
    }

    /// A number that changes whenever another connection commits (SQLite's `data_version`).
    pub fn data_version(&self) -> Result<i64, StoreError> {
        self.store.data_version()
    }

    /// A service over `store` that reads the time from `clock` (the simulation's virtual
    /// clock, a test's fixed one).
    pub fn with_clock(store: Store, clock: Clock) -> Service {
        Service {
            store,
            clock,
            policy: model::Policy::default(),
            fencing: None,
        }
    }

    /// Decides by `policy` where the service decides by rules (test builds plant bugs here).
    #[must_use]
    pub fn with_policy(mut self, policy: model::Policy) -> Service {
        self.policy = policy;
        self
    }

    pub fn set_policy(&mut self, policy: model::Policy) {
        self.policy = policy;
    }

    pub fn now(&self) -> Millis {
        (self.clock)()
    }

    pub fn clock(&self) -> Clock {
        self.clock.clone()
    }

    /// A second service over the same database and clock, on a connection of its own.
    pub fn reopen(&self) -> Result<Service, StoreError> {
        Ok(Service::with_clock(
            Store::open(self.store.path())?,
            self.clock.clone(),
        ))
    }

    // ----- agents -----

    // ----- config -----

    // ----- messages -----

    // ----- status and release -----

    /// The fronts' view of one stored delivery.
    pub fn view(tx: &Tx<'_>, d: &DeliveryRow) -> Result<DeliveryView, StoreError> {
        let m = tx.message(&d.message_id)?;
        let core = d.record.core();
        let mut detail = d.record.detail();
        // A turn of ours that waits for a person (a Codex approval) says so with its delivery.
        if matches!(d.record.kind(), StateKind::Running | StateKind::Accepted)
            && let Some(run) = tx.run(&core.request_id().to_string())?
            && run.outcome.is_none()
            && let Some(note) = run.detail
        {
            detail = if detail.is_empty() {
                note
            } else {
                format!("{detail}; {note}")
            };
        }
        Ok(DeliveryView {
            id: d.message_id.clone(),
            from: m.as_ref().map(|m| m.sender.clone()).unwrap_or_default(),
            to: d.recipient.clone(),
            title: m.and_then(|m| m.title),
            state: d.record.kind(),
            detail,
            attempts: core.attempts(),
            request_id: core.request_id().to_string(),
            earlier_request_ids: core
                .earlier_request_ids()
                .iter()
                .map(ToString::to_string)
                .collect(),
            enrolled_at: millis(core.enrolled_at()),
            updated_at: d.updated_at,
        })
    }

    pub fn delivery(&mut self, id: &str) -> Result<DeliveryDetail> {
        let id = self.resolve(IdTable::Deliveries, id)?;
        self.store.read(|tx| {
            let d = tx
                .delivery(&id)?
                .ok_or_else(|| ServiceError::NotFound(format!("no delivery {id:?}")))?;
            Ok(DeliveryDetail {
                delivery: Self::view(tx, &d)?,
                events: tx.events_for(&id)?,
                record: d.record,
            })
        })
    }

    /// A person's release: cancels one stuck delivery; never resends.
    pub fn release(&mut self, id: &str, note: Option<&str>) -> Result<DeliveryView> {
        if let Some(n) = note {
            check_len("the note", n, SUMMARY_CHARS_MAX)?;
        }
        let id = self.resolve(IdTable::Deliveries, id)?;
        // A write in flight is judged by SPEC's sending timeout, the longest any engine may
        // use (a policy only shortens it): the engine's job may still be waiting for the
        // write's answer, whatever a drill policy says, and releasing now would free the
        // recipient under a write that may still land (G3).
        let policy = model::Policy::default();
        let release = EventKind::Release {
            note: note.map(str::to_owned),
        };
        let step = self.commit_step(&id, &policy, |_| Ok(release), &|_, _, _, _| None)?;
        match step.change {
            model::Change::Ignored { why } => return refused(why),
            model::Change::Unchanged => return refused("already CANCELLED; nothing to release"),
            _ => {}
        }
        self.store.read(|tx| {
            let row = tx
                .delivery(&id)?
                .ok_or_else(|| ServiceError::NotFound(id.clone()))?;
            Ok(Self::view(tx, &row)?)
        })
    }

    /// When the engine last reported, and its report (None: never).
    pub fn engine_report(&mut self) -> Result<Option<(i64, Value)>> {
        self.store.read(|tx| Ok(tx.report()?))
    }

    pub fn events_after(&mut self, after: i64, limit: i64) -> Result<Vec<EventRow>> {
        self.store.read(|tx| Ok(tx.events_after(after, limit)?))
    }
}
