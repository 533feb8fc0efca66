//! The one API every front calls: register agents, send, read, work contracts, status,
//! release, configuration. Each operation validates its input, then runs in one short
//! transaction, so nothing is ever written half-way. It never talks to an agent: delivery is
//! the engine's job.

pub mod card;
pub mod deliveries;
pub mod ledger;
pub mod status;
pub mod tasks;

pub use crate::store::{
    AgentRow, DeliveryRow, EventRow, IdTable, MessageRow, StoreError, WorkRow, token_path,
};
pub use status::{EngineHealth, Overview, Unenrolled};

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
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service")
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

/// What `send` did.
#[derive(Clone, Debug, Serialize)]
pub struct Sent {
    pub message: MessageRow,
    /// False when an idempotency key returned an earlier message.
    pub created: bool,
    pub delivery_state: Option<StateKind>,
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

/// A work contract's outcome when its sender closes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Accepted,
    Revision,
    Blocked,
}

impl std::str::FromStr for Outcome {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "accepted" => Ok(Outcome::Accepted),
            "revision" => Ok(Outcome::Revision),
            "blocked" => Ok(Outcome::Blocked),
            other => Err(format!(
                "unknown outcome {other:?}; use accepted, revision or blocked"
            )),
        }
    }
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Accepted => "accepted",
            Outcome::Revision => "revision",
            Outcome::Blocked => "blocked",
        }
    }
}

/// A new message about work `w` (a return, a reminder), from→to, with a fresh id.
pub fn work_message(
    w: &WorkRow,
    (from, to): (&str, &str),
    body: String,
    (intent, kind): (&str, &str),
    title: String,
    now: Millis,
) -> MessageRow {
    MessageRow {
        id: crate::clock::new_id(),
        sender: from.to_owned(),
        recipient: to.to_owned(),
        body_hash: body_hash(&body),
        body,
        intent: intent.to_owned(),
        kind: kind.to_owned(),
        title: Some(title),
        work_id: Some(w.id.clone()),
        idem_key: None,
        created_at: millis(now),
        read_at: None,
    }
}

/// Checks an agent id: `[A-Za-z0-9._-]{1,64}`.
pub fn check_agent_id(id: &str) -> Result<()> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        usage(format!(
            "invalid agent id {:?}: use 1-64 letters, digits, '.', '_' or '-'",
            truncate(id, 80)
        ))
    }
}

fn truncate(s: &str, chars: usize) -> String {
    s.chars().take(chars).collect()
}

fn check_len(what: &str, value: &str, max: usize) -> Result<()> {
    let n = value.chars().count();
    if n > max {
        usage(format!("{what} is {n} characters; the limit is {max}"))
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

/// What `add_agent` did: the agent as stored, and (G1) the open deliveries that stay with
/// the destination they were queued for because this registration changed it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AgentAdded {
    #[serde(flatten)]
    pub agent: AgentRow,
    pub updated: bool,
    /// What changed in the destination of those deliveries (`url`, `endpoint`, …).
    pub destination_changed: Vec<String>,
    /// Pending deliveries queued for the old destination: they become UNAVAILABLE.
    pub stranded_deliveries: usize,
    /// What the destination checks found wrong (the registration stands; SPEC §5 `doctor`);
    /// filled from [`Service::destination_problems`] by a front that prints them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

impl AgentAdded {
    /// One line for a person.
    pub fn sentence(&self) -> String {
        let a = &self.agent;
        let verb = if self.updated {
            "updated"
        } else {
            "registered"
        };
        let mut line = format!("{} ({}) {verb}", a.id, a.provider);
        if self.stranded_deliveries > 0 {
            let n = self.stranded_deliveries;
            line.push_str(&format!(
                "; its destination changed ({}): {n} open {} queued for the old destination {} UNAVAILABLE, never redirected (register it as it was, or `handoffs release` {})",
                self.destination_changed.join(", "),
                if n == 1 { "delivery" } else { "deliveries" },
                if n == 1 { "stays" } else { "stay" },
                if n == 1 { "it" } else { "them" },
            ));
        }
        line
    }
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
    let record = model::enrol(core, duplicate_of);
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
    let detail = if state == StateKind::Duplicate {
        "enrolled as DUPLICATE of a live identical handoff; not sent".to_owned()
    } else {
        format!("enrolled for {}; WAITING", message.recipient)
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
    pub fn init(path: &std::path::Path) -> Result<(Service, bool), StoreError> {
        let (store, created) = Store::init(path)?;
        Ok((Service::new(store), created))
    }

    /// The database's file.
    pub fn db_path(&self) -> &std::path::Path {
        self.store.path()
    }

    /// A number that changes whenever another connection commits (SQLite's `data_version`).
    pub fn data_version(&mut self) -> Result<i64, StoreError> {
        self.store.data_version()
    }

    /// The store, for the delivery side only (the engine, the simulation); fronts never call
    /// it (tests/architecture.rs checks).
    pub(crate) fn store_mut(&mut self) -> &mut Store {
        &mut self.store
    }

    pub fn with_clock(store: Store, clock: Clock) -> Service {
        Service { store, clock }
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

    pub fn add_agent(
        &mut self,
        id: &str,
        provider: Option<&str>,
        name: Option<&str>,
        endpoint: Option<&str>,
        cwd: Option<&str>,
        settings: &[(String, Value)],
    ) -> Result<AgentAdded> {
        check_agent_id(id)?;
        let provider = provider.map(parse_provider).transpose()?;
        if let Some(n) = name {
            check_len("name", n, ID_CHARS_MAX)?;
        }
        for v in [endpoint, cwd].into_iter().flatten() {
            check_len("endpoint/cwd", v, 4_096)?;
        }
        let now = millis(self.now());
        self.store.write(|tx| {
            let existing = tx.agent(id)?;
            let provider = match (provider, &existing) {
                (Some(p), _) => p,
                (None, Some(a)) => parse_provider(&a.provider)?,
                (None, None) => {
                    return usage(format!(
                        "agent {id} is new: say which adapter delivers to it with --provider demo|command|codex|claude-code"
                    ));
                }
            };
            let mut merged = existing
                .as_ref()
                .map(|a| a.settings.clone())
                .filter(Value::is_object)
                .unwrap_or_else(|| json!({}));
            for (k, v) in settings {
                if let Some(obj) = merged.as_object_mut() {
                    if v.is_null() {
                        obj.remove(k);
                    } else {
                        obj.insert(k.clone(), v.clone());
                    }
                }
            }
            crate::adapter::check_settings(provider, &merged).map_err(ServiceError::Usage)?;
            if let Some(e) = endpoint {
                crate::adapter::check_endpoint(provider, e).map_err(ServiceError::Usage)?;
            }
            let row = AgentRow {
                id: id.to_owned(),
                name: name
                    .map(str::to_owned)
                    .or_else(|| existing.as_ref().map(|a| a.name.clone()))
                    .unwrap_or_else(|| id.to_owned()),
                provider: provider.as_str().to_owned(),
                endpoint: endpoint
                    .map(str::to_owned)
                    .or_else(|| existing.as_ref().map(|a| a.endpoint.clone()))
                    .unwrap_or_default(),
                cwd: cwd
                    .map(str::to_owned)
                    .or_else(|| existing.as_ref().map(|a| a.cwd.clone()))
                    .unwrap_or_default(),
                settings: merged,
                created_at: existing.as_ref().map_or(now, |a| a.created_at),
                updated_at: now,
            };
            tx.upsert_agent(&row)?;
            // G1: queued deliveries keep the destination they were queued for.
            let mut changed = Vec::new();
            let mut stranded = 0;
            let old = existing.as_ref().and_then(target_of);
            let moved = match (&old, target_of(&row)) {
                (Some(old), Some(new)) if !old.same_destination(&new) => Some(new),
                _ => None,
            };
            if let Some(new) = moved {
                for d in tx.pending_for(id)? {
                    let c = d.record.core().target().changes(&new);
                    if !c.is_empty() {
                        stranded += 1;
                        for k in c {
                            if !changed.contains(&k) {
                                changed.push(k);
                            }
                        }
                    }
                }
            }
            let added = AgentAdded {
                agent: row,
                updated: existing.is_some(),
                destination_changed: changed,
                stranded_deliveries: stranded,
                warnings: Vec::new(),
            };
            tx.event(now, None, "agent", &format!("agent {}", added.sentence()))?;
            // A registration change is a fact the next pass must see at once (a destination
            // restored, or changed away).
            tx.wake_recipient(id, now)?;
            Ok(added)
        })
    }

    /// What the destination checks find wrong with `agent` now (they run `--version` and
    /// open a connection: call this outside a transaction). A registration stands either way.
    pub fn destination_problems(agent: &AgentRow) -> Vec<String> {
        crate::adapter::doctor::check(agent)
            .into_iter()
            .filter(|f| !f.ok)
            .map(|f| f.text)
            .collect()
    }

    /// Every agent's destination checks, then the database's (SPEC §5 `doctor`).
    pub fn doctor(&mut self) -> Result<Vec<crate::adapter::doctor::Finding>> {
        use crate::adapter::doctor::Finding;
        let agents = self.agents()?;
        let mut out: Vec<Finding> = agents
            .iter()
            .flat_map(crate::adapter::doctor::check)
            .collect();
        let path = self.store.path().to_owned();
        let db = |ok: bool, text: String| Finding {
            agent: String::new(),
            ok,
            text,
        };
        let check: String = self
            .store
            .read(|tx: &crate::store::Tx<'_>| tx.quick_check())
            .unwrap_or_else(|e: crate::store::StoreError| e.to_string());
        out.push(if check == "ok" {
            db(true, format!("database {}: integrity ok", path.display()))
        } else {
            db(false, format!("database {}: {check}", path.display()))
        });
        let token = crate::store::token_path(&path);
        for file in [path.clone(), token] {
            match crate::store::mode_of(&file) {
                Some(mode) if mode.trailing_zeros() >= 6 => {
                    out.push(db(
                        true,
                        format!("{} is private ({mode:o})", file.display()),
                    ));
                }
                Some(mode) => out.push(db(
                    false,
                    format!(
                        "{} is readable by others ({mode:o}); chmod 600 it",
                        file.display()
                    ),
                )),
                None => out.push(db(false, format!("{} is missing", file.display()))),
            }
        }
        Ok(out)
    }

    pub fn agents(&mut self) -> Result<Vec<AgentRow>> {
        self.store.read(|tx| Ok(tx.agents()?))
    }

    pub fn remove_agent(&mut self, id: &str) -> Result<()> {
        check_agent_id(id)?;
        let now = millis(self.now());
        self.store.write(|tx| {
            if !tx.remove_agent(id)? {
                return Err(ServiceError::NotFound(format!("unknown agent {id:?}")));
            }
            tx.event(now, None, "agent", &format!("agent {id} removed"))?;
            Ok(())
        })
    }

    pub fn set_connection(&mut self, from: &str, to: &str, allowed: bool) -> Result<()> {
        check_agent_id(from)?;
        check_agent_id(to)?;
        if from == to {
            return usage("an agent never sends to itself");
        }
        let now = millis(self.now());
        self.store.write(|tx| {
            tx.set_connection(from, to, allowed)?;
            let verb = if allowed { "allowed" } else { "blocked" };
            tx.event(now, None, "connection", &format!("{from} → {to} {verb}"))?;
            // Held deliveries on this pair are looked at again at once.
            tx.wake_recipient(to, now)?;
            Ok(())
        })
    }

    // ----- config -----

    /// Every key with its value, the default where none was set.
    pub fn config(&mut self) -> Result<Vec<(String, Value)>> {
        self.store.read(|tx| {
            let mut out = Vec::new();
            for key in CONFIG_KEYS {
                out.push((
                    key.to_owned(),
                    tx.config(key)?.unwrap_or_else(|| config_default(key)),
                ));
            }
            Ok(out)
        })
    }

    pub fn config_get(&mut self, key: &str) -> Result<Value> {
        check_config_key(key)?;
        self.store
            .read(|tx| Ok(tx.config(key)?.unwrap_or_else(|| config_default(key))))
    }

    pub fn config_set(&mut self, key: &str, raw: &str) -> Result<Value> {
        check_config_key(key)?;
        let now = self.now();
        let value = parse_config_value(key, raw, now)?;
        self.store.write(|tx| {
            tx.set_config(key, &value)?;
            tx.event(millis(now), None, "config", &format!("{key} = {value}"))?;
            // A pause lifted or a connection rule changed: held deliveries are looked at now.
            tx.wake_pending(millis(now))?;
            Ok(value)
        })
    }

    // ----- messages -----

    pub fn send(
        &mut self,
        from: &str,
        to: &str,
        body: &str,
        title: Option<&str>,
        due_minutes: Option<i64>,
        key: Option<&str>,
    ) -> Result<Sent> {
        check_agent_id(from)?;
        check_agent_id(to)?;
        check_len("the message", body, MESSAGE_CHARS_MAX)?;
        if body.trim().is_empty() {
            return usage("the message is empty");
        }
        if let Some(t) = title {
            check_len("the title", t, TITLE_CHARS_MAX)?;
            if t.trim().is_empty() {
                return usage("the title is empty");
            }
        }
        if let Some(k) = key {
            check_len("the key", k, ID_CHARS_MAX)?;
        }
        match (due_minutes, title) {
            (Some(_), None) => {
                return usage("due_minutes needs a title (only work has a due time)");
            }
            (Some(m), _) if !(1..=DUE_MINUTES_MAX).contains(&m) => {
                return usage(format!("due_minutes must be 1 to {DUE_MINUTES_MAX}"));
            }
            _ => {}
        }
        if from == to {
            return refused("an agent never sends to itself");
        }
        let now = self.now();
        let hash = body_hash(body);
        // The planted bug `enrol_after_commit` (G8): the message is committed first and its
        // delivery in a second transaction, so a send killed in between leaves a message
        // that no delivery will ever carry until the engine's housekeeping finds it.
        let enrol_late = crate::planted(crate::Plant::EnrolAfterCommit);
        let sent = self.store.write(|tx| {
            for id in [from, to] {
                if tx.agent(id)?.is_none() {
                    return Err(ServiceError::NotFound(format!(
                        "unknown agent {id:?}; register it with `handoffs agent add {id} --provider …`"
                    )));
                }
            }
            if let Some(k) = key
                && let Some(existing) = tx.message_by_key(from, k)?
            {
                if existing.recipient == to
                    && existing.body_hash == hash
                    && existing.title.as_deref() == title
                {
                    let state = tx.delivery(&existing.id)?.map(|d| d.record.kind());
                    return Ok(Sent {
                        message: existing,
                        created: false,
                        delivery_state: state,
                    });
                }
                return refused(format!("key {k:?} was already used for a different message"));
            }
            if !connection_allowed(tx, from, to)? {
                return refused(format!(
                    "the connection {from} → {to} is not allowed; `handoffs allow {from} {to}` opens it"
                ));
            }
            let id = crate::clock::new_id();
            let work_id = title.map(|_| id.clone());
            let message = MessageRow {
                id: id.clone(),
                sender: from.to_owned(),
                recipient: to.to_owned(),
                body: body.to_owned(),
                body_hash: hash.clone(),
                intent: "handoff".to_owned(),
                kind: if title.is_some() { "work" } else { "plain" }.to_owned(),
                title: title.map(str::to_owned),
                work_id: work_id.clone(),
                idem_key: key.map(str::to_owned),
                created_at: millis(now),
                read_at: None,
            };
            tx.insert_message(&message)?;
            if let (Some(work_id), Some(title)) = (work_id, title) {
                tx.insert_work(&WorkRow {
                    id: work_id,
                    sender: from.to_owned(),
                    recipient: to.to_owned(),
                    title: title.to_owned(),
                    state: WorkState::Assigned,
                    due_at: due_minutes.map(|m| millis(now) + m * 60_000),
                    reminded_at: None,
                    summary: None,
                    evidence: None,
                    outcome: None,
                    note: None,
                    created_at: millis(now),
                    updated_at: millis(now),
                })?;
            }
            let what = if title.is_some() { "work" } else { "handoff" };
            tx.event(millis(now), Some(&id), "sent", &format!("{what} {from} → {to}"))?;
            let delivery_state = if !enrol_late && millis(now) >= enabled_after(tx)? {
                enrol(tx, &message, now)?
            } else {
                None
            };
            Ok(Sent {
                message,
                created: true,
                delivery_state,
            })
        })?;
        if enrol_late && sent.created {
            std::thread::sleep(std::time::Duration::from_millis(50));
            let message = sent.message.clone();
            let delivery_state = self.store.write(|tx| enrol(tx, &message, now))?;
            return Ok(Sent {
                delivery_state,
                ..sent
            });
        }
        Ok(sent)
    }

    /// Resolves an id or a unique prefix of ≥ 6 characters.
    pub fn resolve(&mut self, table: IdTable, given: &str) -> Result<String> {
        if given.is_empty() || given.len() > ID_CHARS_MAX {
            return usage("an id must be 1 to 200 characters");
        }
        let matches = self
            .store
            .read(|tx| Ok::<_, ServiceError>(tx.ids_with_prefix(table, given)?))?;
        match matches.as_slice() {
            [one] if one == given => Ok(one.clone()),
            _ if given.len() < ID_PREFIX_MIN => usage(format!(
                "{given:?} is too short: give the full id or at least {ID_PREFIX_MIN} characters"
            )),
            [one] => Ok(one.clone()),
            [] if table == IdTable::Deliveries => {
                // A message that exists but has no delivery deserves a better word.
                match self.resolve(IdTable::Messages, given) {
                    Ok(m) => Err(ServiceError::NotFound(format!(
                        "message {m} has no delivery: a notification is never a turn, and a \
                         message sent before delivery was enabled is never enrolled"
                    ))),
                    Err(ServiceError::NotFound(_)) => {
                        Err(ServiceError::NotFound(format!("no delivery {given:?}")))
                    }
                    Err(e) => Err(e),
                }
            }
            [] => Err(ServiceError::NotFound(format!("no message {given:?}"))),
            _ => usage(format!(
                "{given:?} matches more than one message; give more characters"
            )),
        }
    }

    pub fn inbox(&mut self, agent: &str, all: bool, limit: i64) -> Result<Vec<MessageRow>> {
        check_agent_id(agent)?;
        if !(1..=10_000).contains(&limit) {
            return usage("limit must be 1 to 10000");
        }
        self.store.read(|tx| {
            if tx.agent(agent)?.is_none() {
                return Err(ServiceError::NotFound(format!("unknown agent {agent:?}")));
            }
            Ok(tx.inbox(agent, all, limit)?)
        })
    }

    /// The full message; marks it read when `reader` is its recipient.
    pub fn read(&mut self, id: &str, reader: &str) -> Result<MessageRow> {
        check_agent_id(reader)?;
        let id = self.resolve(IdTable::Messages, id)?;
        let now = millis(self.now());
        self.store.write(|tx| {
            let mut m = tx
                .message(&id)?
                .ok_or_else(|| ServiceError::NotFound(format!("no message {id:?}")))?;
            if m.recipient != reader && m.sender != reader {
                return refused(format!(
                    "{reader} is neither the sender nor the recipient of {id}"
                ));
            }
            if m.recipient == reader && tx.mark_read(&id, now)? {
                m.read_at = Some(now);
                tx.event(now, Some(&id), "read", &format!("read by {reader}"))?;
            }
            Ok(m)
        })
    }

    fn work_for(tx: &Tx<'_>, id: &str) -> Result<(MessageRow, WorkRow)> {
        let m = tx
            .message(id)?
            .ok_or_else(|| ServiceError::NotFound(format!("no message {id:?}")))?;
        let work_id = m
            .work_id
            .clone()
            .filter(|_| m.kind == "work")
            .ok_or_else(|| ServiceError::Refused(format!("{id} is not work (it has no title)")))?;
        let w = tx
            .work(&work_id)?
            .ok_or_else(|| ServiceError::NotFound(format!("no work {work_id:?}")))?;
        Ok((m, w))
    }

    pub fn accept(&mut self, id: &str, actor: &str) -> Result<WorkRow> {
        check_agent_id(actor)?;
        let id = self.resolve(IdTable::Messages, id)?;
        let now = millis(self.now());
        self.store.write(|tx| {
            let (_, mut w) = Self::work_for(tx, &id)?;
            if w.recipient != actor {
                return refused(format!("only {} can accept this work", w.recipient));
            }
            match w.state {
                WorkState::Accepted => return Ok(w),
                WorkState::Assigned => {}
                other => return refused(format!("the work is already {other}")),
            }
            w.state = WorkState::Accepted;
            w.updated_at = now;
            tx.update_work(&w)?;
            tx.event(now, Some(&id), "work", &format!("accepted by {actor}"))?;
            Ok(w)
        })
    }

    /// Returns work: `returned` (or `blocked`) and one return handoff to its sender.
    pub fn return_work(
        &mut self,
        id: &str,
        actor: &str,
        summary: &str,
        evidence: Option<&str>,
        blocked: bool,
    ) -> Result<(WorkRow, MessageRow)> {
        check_agent_id(actor)?;
        check_len("the summary", summary, SUMMARY_CHARS_MAX)?;
        if summary.trim().is_empty() {
            return usage("the summary is empty");
        }
        if let Some(e) = evidence {
            check_len("the evidence", e, SUMMARY_CHARS_MAX)?;
        }
        let id = self.resolve(IdTable::Messages, id)?;
        let now = self.now();
        self.store.write(|tx| {
            let (_, mut w) = Self::work_for(tx, &id)?;
            if w.recipient != actor {
                return refused(format!("only {} can return this work", w.recipient));
            }
            if !w.state.is_open() {
                return refused(format!("the work was already {}", w.state));
            }
            w.state = if blocked {
                WorkState::Blocked
            } else {
                WorkState::Returned
            };
            w.summary = Some(summary.to_owned());
            w.evidence = evidence.map(str::to_owned);
            w.updated_at = millis(now);
            tx.update_work(&w)?;
            let verb = if blocked { "blocked" } else { "returned" };
            let mut body = format!("Work {verb}: {}\n\n{summary}", w.title);
            if let Some(e) = evidence {
                body.push_str(&format!("\n\nEvidence: {e}"));
            }
            let ret = work_message(
                &w,
                (actor, &w.sender),
                body,
                ("handoff", "return"),
                format!("{verb}: {}", w.title),
                now,
            );
            tx.insert_message(&ret)?;
            tx.event(
                millis(now),
                Some(&id),
                "work",
                &format!("{verb} by {actor}"),
            )?;
            tx.event(
                millis(now),
                Some(&ret.id),
                "sent",
                &format!("return {actor} → {}", w.sender),
            )?;
            if millis(now) >= enabled_after(tx)? {
                enrol(tx, &ret, now)?;
            }
            Ok((w, ret))
        })
    }

    pub fn close(
        &mut self,
        id: &str,
        actor: &str,
        outcome: Outcome,
        note: Option<&str>,
    ) -> Result<WorkRow> {
        check_agent_id(actor)?;
        if let Some(n) = note {
            check_len("the note", n, SUMMARY_CHARS_MAX)?;
        }
        let id = self.resolve(IdTable::Messages, id)?;
        let now = millis(self.now());
        self.store.write(|tx| {
            let (_, mut w) = Self::work_for(tx, &id)?;
            if w.sender != actor {
                return refused(format!(
                    "only the sender ({}) can close this work",
                    w.sender
                ));
            }
            if w.state == WorkState::Closed {
                return refused("the work is already closed");
            }
            w.state = WorkState::Closed;
            w.outcome = Some(outcome.as_str().to_owned());
            w.note = note.map(str::to_owned);
            w.updated_at = now;
            tx.update_work(&w)?;
            tx.event(
                now,
                Some(&id),
                "work",
                &format!("closed by {actor}: {}", outcome.as_str()),
            )?;
            Ok(w)
        })
    }

    // ----- status and release -----

    /// The fronts' view of one stored delivery.
    pub fn view(tx: &Tx<'_>, d: &DeliveryRow) -> Result<DeliveryView, StoreError> {
        let m = tx.message(&d.message_id)?;
        let core = d.record.core();
        Ok(DeliveryView {
            id: d.message_id.clone(),
            from: m.as_ref().map(|m| m.sender.clone()).unwrap_or_default(),
            to: d.recipient.clone(),
            title: m.and_then(|m| m.title),
            state: d.record.kind(),
            detail: d.record.detail(),
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

    /// Open work (and work returned but not yet closed), newest first.
    pub fn open_work(&mut self, limit: i64) -> Result<Vec<WorkRow>> {
        self.store.read(|tx| Ok(tx.open_work(limit)?))
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

const CONFIG_KEYS: [&str; 4] = ["enabled", "enabledAfter", "connections", "outageGuard"];

fn check_config_key(key: &str) -> Result<()> {
    if CONFIG_KEYS.contains(&key) {
        Ok(())
    } else {
        usage(format!(
            "unknown config key {key:?}; keys: {}",
            CONFIG_KEYS.join(", ")
        ))
    }
}

fn config_default(key: &str) -> Value {
    match key {
        "enabled" => json!(true),
        "enabledAfter" => json!(0),
        "connections" => json!("open"),
        _ => Value::Null,
    }
}

fn parse_config_value(key: &str, raw: &str, now: Millis) -> Result<Value> {
    match key {
        "enabled" => match raw {
            "true" | "on" | "1" => Ok(json!(true)),
            "false" | "off" | "0" => Ok(json!(false)),
            _ => usage("enabled takes true or false"),
        },
        "enabledAfter" => {
            if raw == "now" {
                return Ok(json!(millis(now)));
            }
            if let Ok(ms) = raw.parse::<i64>()
                && ms >= 0
            {
                return Ok(json!(ms));
            }
            humantime::parse_rfc3339_weak(raw)
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .and_then(|d| i64::try_from(d.as_millis()).ok())
                .map(|ms| json!(ms))
                .ok_or_else(|| {
                    ServiceError::Usage(
                        "enabledAfter takes `now`, milliseconds since the epoch, or a time like 2026-11-29T12:00:00Z".to_owned(),
                    )
                })
        }
        "connections" => match raw {
            "open" | "explicit" => Ok(json!(raw)),
            _ => usage("connections takes open or explicit"),
        },
        "outageGuard" => {
            let v: Value = serde_json::from_str(raw)
                .map_err(|e| ServiceError::Usage(format!("outageGuard takes JSON: {e}")))?;
            crate::adapter::outage::check_config(&v).map_err(ServiceError::Usage)?;
            Ok(v)
        }
        _ => usage(format!("unknown config key {key:?}")),
    }
}
