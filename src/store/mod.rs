//! The SQLite store: schema and migrations, connection settings, short `BEGIN IMMEDIATE`
//! transactions, and typed reads and writes of agents, messages, work, deliveries, events and
//! command runs. The only module that knows rusqlite. It decides nothing about delivery:
//! records go in and out as `model::Delivery`.

mod migrations;

use model::work::WorkState;
use model::{Delivery, Millis, StateKind};

/// Open work in SQL: the states of [`WorkState::OPEN`] (a test keeps the two in step).
const OPEN_WORK: &str = "state IN ('assigned', 'accepted')";
use rusqlite::{
    Connection, OpenFlags, OptionalExtension, Transaction, TransactionBehavior, params,
};
use serde_json::Value;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Our `PRAGMA application_id` ("HNDF"): tells our database from any other SQLite file.
const APPLICATION_ID: i64 = 0x484E_4446;
/// How long a writer waits for another process's transaction before giving up.
const BUSY_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("no database at {0}; create one with `handoffs init`")]
    Missing(PathBuf),
    #[error("{0} is not a handoffs database")]
    Foreign(PathBuf),
    #[error("{path} is unreadable or corrupt: {detail}")]
    Corrupt { path: PathBuf, detail: String },
    #[error("{path} was written by a newer handoffs (schema {found}, this build knows {known})")]
    TooNew {
        path: PathBuf,
        found: i64,
        known: i64,
    },
    #[error("the database is locked by another process for too long; try again")]
    Locked,
    #[error("the database is read-only: {0}")]
    ReadOnly(String),
    #[error("database error: {0}")]
    Sqlite(String),
    #[error("{0}")]
    Io(String),
    #[error("stored record for {message} is invalid: {detail}")]
    BadRecord { message: String, detail: String },
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        use rusqlite::ErrorCode;
        match e.sqlite_error_code() {
            Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => StoreError::Locked,
            Some(ErrorCode::ReadOnly) => StoreError::ReadOnly(e.to_string()),
            Some(ErrorCode::NotADatabase) => StoreError::Corrupt {
                path: PathBuf::new(),
                detail: "file is not a database".to_owned(),
            },
            Some(ErrorCode::CannotOpen | ErrorCode::PermissionDenied) => {
                StoreError::Io(format!("cannot open the database: {e}"))
            }
            _ => StoreError::Sqlite(e.to_string()),
        }
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// An open database.
#[derive(Debug)]
pub struct Store {
    conn: Connection,
    path: PathBuf,
}

/// The token file beside a database: `<db>.token`.
pub fn token_path(db: &Path) -> PathBuf {
    let mut p = db.as_os_str().to_owned();
    p.push(".token");
    PathBuf::from(p)
}

/// A sibling path of the database: `<db><suffix>`.
pub fn sibling(db: &Path, suffix: &str) -> PathBuf {
    let mut p = db.as_os_str().to_owned();
    p.push(suffix);
    PathBuf::from(p)
}

/// A file's permission bits, if it exists.
#[cfg(unix)]
pub fn mode_of(path: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .ok()
        .map(|m| m.permissions().mode() & 0o777)
}
#[cfg(not(unix))]
pub fn mode_of(path: &Path) -> Option<u32> {
    std::fs::metadata(path).ok().map(|_| 0o600)
}

#[cfg(unix)]
fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}
#[cfg(not(unix))]
fn set_mode(_: &Path, _: u32) -> std::io::Result<()> {
    Ok(())
}

impl Store {
    /// Creates the database (and its folder, 0700) if missing, migrates it, and writes the
    /// token file (0600) if missing. Idempotent. Returns whether anything was created.
    pub fn init(path: &Path) -> Result<(Store, bool)> {
        let existed = path.exists();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
            && !dir.exists()
        {
            std::fs::create_dir_all(dir)
                .map_err(|e| StoreError::Io(format!("cannot create {}: {e}", dir.display())))?;
            set_mode(dir, 0o700).map_err(|e| StoreError::Io(e.to_string()))?;
        }
        if !existed {
            // Create the file with 0600 before SQLite opens it.
            let mut opts = std::fs::OpenOptions::new();
            opts.write(true).create_new(true);
            #[cfg(unix)]
            {
                use std::os::unix::fs::OpenOptionsExt;
                opts.mode(0o600);
            }
            opts.open(path)
                .map_err(|e| StoreError::Io(format!("cannot create {}: {e}", path.display())))?;
        }
        let store = Store::open_inner(path, !existed)?;
        let token = token_path(path);
        let mut created_token = false;
        // An empty or truncated token file would let anyone send through the page: replace it.
        if std::fs::read_to_string(&token).is_ok_and(|t| t.trim().len() < 16) {
            std::fs::remove_file(&token)
                .map_err(|e| StoreError::Io(format!("cannot replace {}: {e}", token.display())))?;
        }
        if !token.exists() {
            let value = format!(
                "{}{}",
                uuid::Uuid::new_v4().simple(),
                uuid::Uuid::new_v4().simple()
            );
            let mut opts = std::fs::OpenOptions::new();
            opts.write(true).create_new(true);
            #[cfg(unix)]
            {
                use std::os::unix::fs::OpenOptionsExt;
                opts.mode(0o600);
            }
            opts.open(&token)
                .and_then(|mut f| f.write_all(value.as_bytes()))
                .map_err(|e| StoreError::Io(format!("cannot write {}: {e}", token.display())))?;
            created_token = true;
        }
        Ok((store, !existed || created_token))
    }

    /// Opens an existing database; a missing file says how to create one.
    pub fn open(path: &Path) -> Result<Store> {
        if !path.exists() {
            return Err(StoreError::Missing(path.to_owned()));
        }
        Store::open_inner(path, false)
    }

    fn open_inner(path: &Path, fresh: bool) -> Result<Store> {
        let corrupt = |detail: String| StoreError::Corrupt {
            path: path.to_owned(),
            detail,
        };
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE
                | OpenFlags::SQLITE_OPEN_URI
                | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|e| corrupt(e.to_string()))?;
        // HANDOFFS_BUSY_TIMEOUT_MS shortens the wait for tests and scripts that prefer to fail
        // fast; the default rides out any other process's short transaction.
        let busy = std::env::var("HANDOFFS_BUSY_TIMEOUT_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(BUSY_TIMEOUT, Duration::from_millis);
        conn.busy_timeout(busy)?;
        // Reading the header tells a garbage file from a database before anything is written.
        let app_id: i64 = conn
            .query_row("PRAGMA application_id", [], |r| r.get(0))
            .map_err(|e| match StoreError::from(e) {
                StoreError::Corrupt { detail, .. } => corrupt(detail),
                other => other,
            })?;
        let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if !fresh && app_id != APPLICATION_ID {
            let empty: i64 =
                conn.query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0))?;
            if empty > 0 || version != 0 {
                return Err(StoreError::Foreign(path.to_owned()));
            }
        }
        if version > migrations::LATEST {
            return Err(StoreError::TooNew {
                path: path.to_owned(),
                found: version,
                known: migrations::LATEST,
            });
        }
        let journal: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
        if !journal.eq_ignore_ascii_case("wal") {
            let _: String = conn
                .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
                .map_err(StoreError::from)?;
        }
        // WAL + NORMAL is durable against a killed process (the engine's crash model); set
        // HANDOFFS_SYNC=full to also survive power loss at about a tenth of the commit rate.
        let sync = if std::env::var("HANDOFFS_SYNC").is_ok_and(|v| v.eq_ignore_ascii_case("full")) {
            "FULL"
        } else {
            "NORMAL"
        };
        conn.execute_batch(&format!(
            "PRAGMA synchronous={sync}; PRAGMA foreign_keys=ON; PRAGMA temp_store=MEMORY;"
        ))?;
        // Absolute, so every process it is handed to (supervisors, commands running in another
        // folder through HANDOFFS_DB) finds the same database.
        let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
        let mut store = Store { conn, path };
        if version < migrations::LATEST {
            store.migrate(version)?;
        }
        for suffix in ["-wal", "-shm"] {
            let p = sibling(&store.path, suffix);
            if p.exists() {
                let _ = set_mode(&p, 0o600);
            }
        }
        Ok(store)
    }

    fn migrate(&mut self, from: i64) -> Result<()> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        // Another process may have migrated while we waited for the lock.
        let now: i64 = tx.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        for (i, sql) in migrations::STEPS.iter().enumerate() {
            let target = i64::try_from(i).unwrap_or(i64::MAX) + 1;
            if target > now.max(from) {
                tx.execute_batch(sql)?;
                if target == 3 {
                    fill_routes(&tx)?;
                }
                if target == 5 {
                    migrate_5(&tx)?;
                }
            }
        }
        tx.execute_batch(&format!(
            "PRAGMA user_version = {}; PRAGMA application_id = {APPLICATION_ID};",
            migrations::LATEST
        ))?;
        tx.commit()?;
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` in one short `BEGIN IMMEDIATE` transaction: all of it is committed, or none.
    pub fn write<T, E>(&mut self, f: impl FnOnce(&Tx<'_>) -> Result<T, E>) -> Result<T, E>
    where
        E: From<StoreError>,
    {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(StoreError::from)?;
        let out = f(&Tx { tx: &tx })?;
        tx.commit().map_err(StoreError::from)?;
        Ok(out)
    }

    /// Runs `f` in a read transaction (a consistent snapshot).
    pub fn read<T, E>(&mut self, f: impl FnOnce(&Tx<'_>) -> Result<T, E>) -> Result<T, E>
    where
        E: From<StoreError>,
    {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Deferred)
            .map_err(StoreError::from)?;
        let out = f(&Tx { tx: &tx })?;
        tx.commit().map_err(StoreError::from)?;
        Ok(out)
    }

    /// SQLite's `data_version`: changes whenever another connection commits. Polling it is
    /// how a running engine notices new work at once without re-reading tables.
    pub fn data_version(&self) -> Result<i64> {
        Ok(self
            .conn
            .prepare_cached("PRAGMA data_version")?
            .query_row([], |r| r.get(0))?)
    }
}

/// A registered agent.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct AgentRow {
    pub id: String,
    pub name: String,
    pub provider: String,
    pub endpoint: String,
    pub cwd: String,
    pub settings: Value,
    pub created_at: i64,
    pub updated_at: i64,
}

/// Schema 5: cards name their session and Claude process (rows kept, filled from their
/// channel; a card without one that was never pushed is dropped: nothing was written), and
/// runs get `left_open_at` and `missing_since`, each only where it is missing.
fn migrate_5(tx: &rusqlite::Transaction<'_>) -> Result<()> {
    let column = |table: &str, name: &str| -> Result<bool> {
        Ok(tx.query_row(
            &format!("SELECT count(*) > 0 FROM pragma_table_info('{table}') WHERE name = ?1"),
            [name],
            |r| r.get(0),
        )?)
    };
    if !column("channel_pushes", "session")? {
        tx.execute_batch(
            "CREATE TABLE channel_pushes_5 (
                 request_id TEXT PRIMARY KEY,
                 listener INTEGER NOT NULL,
                 session TEXT NOT NULL,
                 claude_pid INTEGER NOT NULL,
                 content TEXT NOT NULL,
                 meta TEXT NOT NULL,
                 created_at INTEGER NOT NULL,
                 pushed_at INTEGER
             );
             INSERT INTO channel_pushes_5
               SELECT p.request_id, p.listener, coalesce(c.session, ''), coalesce(c.claude_pid, 0),
                      p.content, p.meta, p.created_at, p.pushed_at
               FROM channel_pushes p LEFT JOIN channels c ON c.pid = p.listener
               WHERE c.pid IS NOT NULL OR p.pushed_at IS NOT NULL;
             DROP TABLE channel_pushes;
             ALTER TABLE channel_pushes_5 RENAME TO channel_pushes;
             CREATE INDEX IF NOT EXISTS channel_pushes_waiting ON channel_pushes (listener)
                 WHERE pushed_at IS NULL;",
        )?;
    }
    for name in ["left_open_at", "missing_since"] {
        if !column("runs", name)? {
            tx.execute_batch(&format!("ALTER TABLE runs ADD COLUMN {name} INTEGER;"))?;
        }
    }
    Ok(())
}

/// Migration 2 → 3: records written before targets carried a route get the route their agent
/// has now (the best knowledge there is), so an upgrade neither redirects nor strands them.
fn fill_routes(tx: &rusqlite::Transaction<'_>) -> Result<()> {
    let mut rows = Vec::new();
    {
        let mut st = tx.prepare(
            "SELECT d.message_id, d.record, a.settings FROM deliveries d
             JOIN agents a ON a.id = d.recipient",
        )?;
        let mut q = st.query([])?;
        while let Some(r) = q.next()? {
            let id: String = r.get(0)?;
            let record: String = r.get(1)?;
            let settings: String = r.get(2)?;
            rows.push((
                id,
                record,
                serde_json::from_str(&settings).unwrap_or(Value::Null),
            ));
        }
    }
    for (id, record, settings) in rows {
        let Ok(mut value) = serde_json::from_str::<Value>(&record) else {
            continue;
        };
        let Some(target) = value
            .pointer_mut("/core/target")
            .and_then(Value::as_object_mut)
        else {
            continue;
        };
        if target.contains_key("route") {
            continue;
        }
        let route: serde_json::Map<String, Value> = route_of(&settings)
            .into_iter()
            .map(|(k, v)| (k, Value::String(v)))
            .collect();
        target.insert("route".to_owned(), Value::Object(route));
        tx.execute(
            "UPDATE deliveries SET record = ?2 WHERE message_id = ?1",
            rusqlite::params![id, value.to_string()],
        )?;
    }
    Ok(())
}

fn route_of(settings: &Value) -> std::collections::BTreeMap<String, String> {
    model::ROUTE_SETTINGS
        .iter()
        .filter_map(|k| Some(((*k).to_owned(), settings.get(*k)?.to_string())))
        .collect()
}

impl AgentRow {
    /// The settings that address this agent (`model::ROUTE_SETTINGS`), each as JSON text: the
    /// part of its destination that lives in its settings (G1).
    pub fn route(&self) -> std::collections::BTreeMap<String, String> {
        route_of(&self.settings)
    }

    /// This agent as the adapters must address it for a delivery frozen to `target`: the
    /// provider, endpoint and route of the target (where the delivery was queued for), the
    /// rest (folder, timeouts) as registered now. While the destination is unchanged this is
    /// the row itself; after a change, observation and history scans still go where the write
    /// went, and a write can only go there (G1).
    #[must_use]
    pub fn at_target(&self, target: &model::Target) -> AgentRow {
        let mut row = self.clone();
        target.provider.as_str().clone_into(&mut row.provider);
        row.endpoint.clone_from(&target.endpoint);
        if let Some(obj) = row.settings.as_object_mut() {
            for key in model::ROUTE_SETTINGS {
                match target.route.get(*key) {
                    Some(text) => {
                        let value = serde_json::from_str(text).unwrap_or(Value::Null);
                        obj.insert((*key).to_owned(), value);
                    }
                    None => {
                        obj.remove(*key);
                    }
                }
            }
        }
        row
    }
}

/// Open work: in all, overdue, and per recipient.
pub type WorkCounts = (i64, i64, Vec<(String, i64)>);

/// When one piece of work was sent, accepted and returned (ms).
pub type WorkTimes = (i64, Option<i64>, Option<i64>);

/// A stored message.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MessageRow {
    pub id: String,
    pub sender: String,
    pub recipient: String,
    pub body: String,
    pub body_hash: String,
    /// `handoff` (should become a turn) or `notification` (inbox only).
    pub intent: String,
    /// `plain`, `work`, `return` or `reminder`.
    pub kind: String,
    pub title: Option<String>,
    pub work_id: Option<String>,
    pub idem_key: Option<String>,
    pub created_at: i64,
    pub read_at: Option<i64>,
}

/// A work contract.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct WorkRow {
    pub id: String,
    pub sender: String,
    pub recipient: String,
    pub title: String,
    pub state: WorkState,
    pub due_at: Option<i64>,
    pub reminded_at: Option<i64>,
    pub summary: Option<String>,
    pub evidence: Option<String>,
    pub outcome: Option<String>,
    pub note: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
}

/// A stored delivery: the model's record plus the engine's schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct DeliveryRow {
    pub message_id: String,
    pub recipient: String,
    pub record: Delivery,
    pub due_at: Option<i64>,
    pub updated_at: i64,
}

/// One line of the event timeline.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct EventRow {
    pub seq: i64,
    pub at: i64,
    pub message_id: Option<String>,
    pub kind: String,
    pub detail: String,
}

/// One supervised command run (the argv adapter's durable history).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct RunRow {
    pub request_id: String,
    pub message_id: String,
    pub agent: String,
    pub pid: Option<i64>,
    pub started_at: i64,
    pub ends_at: Option<i64>,
    pub ended_at: Option<i64>,
    pub exit_code: Option<i64>,
    /// NULL while running; `returned`, `errored`, `refused`.
    pub outcome: Option<String>,
    pub detail: Option<String>,
}

/// A channel listener: a `handoffs mcp --channels` process inside a Claude session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelRow {
    pub pid: i64,
    pub agent: String,
    pub session: String,
    /// The Claude process that started it (its parent).
    pub claude_pid: i64,
    pub opened_at: i64,
}

/// A card a channel listener pushes into its session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushRow {
    pub request_id: String,
    pub listener: i64,
    /// The session the card is for: pushed only while the listener's Claude has it open.
    pub session: String,
    /// That Claude process: the card's turn lives while it holds the session.
    pub claude_pid: i64,
    pub content: String,
    /// JSON object of string values: the notification's `meta`.
    pub meta: String,
    pub created_at: i64,
    pub pushed_at: Option<i64>,
}

fn channel_from(r: &rusqlite::Row<'_>) -> rusqlite::Result<ChannelRow> {
    Ok(ChannelRow {
        pid: r.get(0)?,
        agent: r.get(1)?,
        session: r.get(2)?,
        claude_pid: r.get(3)?,
        opened_at: r.get(4)?,
    })
}

fn push_from(r: &rusqlite::Row<'_>) -> rusqlite::Result<PushRow> {
    Ok(PushRow {
        request_id: r.get(0)?,
        listener: r.get(1)?,
        session: r.get(2)?,
        claude_pid: r.get(3)?,
        content: r.get(4)?,
        meta: r.get(5)?,
        created_at: r.get(6)?,
        pushed_at: r.get(7)?,
    })
}

/// A transaction, with typed queries.
#[derive(Debug)]
pub struct Tx<'a> {
    tx: &'a Transaction<'a>,
}

fn agent_from(r: &rusqlite::Row<'_>) -> rusqlite::Result<AgentRow> {
    let settings: String = r.get(5)?;
    Ok(AgentRow {
        id: r.get(0)?,
        name: r.get(1)?,
        provider: r.get(2)?,
        endpoint: r.get(3)?,
        cwd: r.get(4)?,
        settings: serde_json::from_str(&settings).unwrap_or(Value::Null),
        created_at: r.get(6)?,
        updated_at: r.get(7)?,
    })
}

const AGENT_COLS: &str = "id, name, provider, endpoint, cwd, settings, created_at, updated_at";
const MESSAGE_COLS: &str = "id, sender, recipient, body, body_hash, intent, kind, title, work_id, idem_key, created_at, read_at";
const WORK_COLS: &str = "id, sender, recipient, title, state, due_at, reminded_at, summary, evidence, outcome, note, created_at, updated_at";
const RUN_COLS: &str =
    "request_id, message_id, agent, pid, started_at, ends_at, ended_at, exit_code, outcome, detail";

fn message_from(r: &rusqlite::Row<'_>) -> rusqlite::Result<MessageRow> {
    Ok(MessageRow {
        id: r.get(0)?,
        sender: r.get(1)?,
        recipient: r.get(2)?,
        body: r.get(3)?,
        body_hash: r.get(4)?,
        intent: r.get(5)?,
        kind: r.get(6)?,
        title: r.get(7)?,
        work_id: r.get(8)?,
        idem_key: r.get(9)?,
        created_at: r.get(10)?,
        read_at: r.get(11)?,
    })
}

fn work_from(r: &rusqlite::Row<'_>) -> rusqlite::Result<WorkRow> {
    Ok(WorkRow {
        id: r.get(0)?,
        sender: r.get(1)?,
        recipient: r.get(2)?,
        title: r.get(3)?,
        state: {
            let text: String = r.get(4)?;
            text.parse().map_err(|e: String| {
                rusqlite::Error::FromSqlConversionFailure(4, rusqlite::types::Type::Text, e.into())
            })?
        },
        due_at: r.get(5)?,
        reminded_at: r.get(6)?,
        summary: r.get(7)?,
        evidence: r.get(8)?,
        outcome: r.get(9)?,
        note: r.get(10)?,
        created_at: r.get(11)?,
        updated_at: r.get(12)?,
    })
}

fn run_from(r: &rusqlite::Row<'_>) -> rusqlite::Result<RunRow> {
    Ok(RunRow {
        request_id: r.get(0)?,
        message_id: r.get(1)?,
        agent: r.get(2)?,
        pid: r.get(3)?,
        started_at: r.get(4)?,
        ends_at: r.get(5)?,
        ended_at: r.get(6)?,
        exit_code: r.get(7)?,
        outcome: r.get(8)?,
        detail: r.get(9)?,
    })
}

fn class_of(kind: StateKind) -> &'static str {
    match kind.class() {
        model::Class::Pending => "pending",
        model::Class::Active => "active",
        model::Class::Terminal => "terminal",
    }
}

impl Tx<'_> {
    /// SQLite's quick integrity check: `ok`, or the first problem it found.
    pub fn quick_check(&self) -> Result<String> {
        Ok(self.tx.query_row("PRAGMA quick_check", [], |r| r.get(0))?)
    }

    // ----- config -----

    pub fn config(&self, key: &str) -> Result<Option<Value>> {
        let v: Option<String> = self
            .tx
            .query_row("SELECT value FROM config WHERE key = ?1", [key], |r| {
                r.get(0)
            })
            .optional()?;
        Ok(v.and_then(|s| serde_json::from_str(&s).ok()))
    }

    pub fn set_config(&self, key: &str, value: &Value) -> Result<()> {
        self.tx.execute(
            "INSERT INTO config (key, value) VALUES (?1, ?2)
             ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            params![key, value.to_string()],
        )?;
        Ok(())
    }

    // ----- agents and connections -----

    pub fn agent(&self, id: &str) -> Result<Option<AgentRow>> {
        Ok(self
            .tx
            .prepare_cached(&format!("SELECT {AGENT_COLS} FROM agents WHERE id = ?1"))?
            .query_row([id], agent_from)
            .optional()?)
    }

    pub fn agents(&self) -> Result<Vec<AgentRow>> {
        let mut st = self
            .tx
            .prepare_cached(&format!("SELECT {AGENT_COLS} FROM agents ORDER BY id"))?;
        let rows = st.query_map([], agent_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    pub fn upsert_agent(&self, a: &AgentRow) -> Result<()> {
        self.tx.execute(
            "INSERT INTO agents (id, name, provider, endpoint, cwd, settings, created_at, updated_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
             ON CONFLICT (id) DO UPDATE SET name = excluded.name, provider = excluded.provider,
               endpoint = excluded.endpoint, cwd = excluded.cwd, settings = excluded.settings,
               updated_at = excluded.updated_at",
            params![
                a.id,
                a.name,
                a.provider,
                a.endpoint,
                a.cwd,
                a.settings.to_string(),
                a.created_at,
                a.updated_at
            ],
        )?;
        Ok(())
    }

    pub fn remove_agent(&self, id: &str) -> Result<bool> {
        Ok(self.tx.execute("DELETE FROM agents WHERE id = ?1", [id])? > 0)
    }

    /// The explicit connection row for from→to, if any.
    pub fn connection(&self, from: &str, to: &str) -> Result<Option<bool>> {
        Ok(self
            .tx
            .prepare_cached(
                "SELECT allowed FROM connections WHERE from_agent = ?1 AND to_agent = ?2",
            )?
            .query_row([from, to], |r| r.get(0))
            .optional()?)
    }

    pub fn set_connection(&self, from: &str, to: &str, allowed: bool) -> Result<()> {
        self.tx.execute(
            "INSERT INTO connections (from_agent, to_agent, allowed) VALUES (?1, ?2, ?3)
             ON CONFLICT (from_agent, to_agent) DO UPDATE SET allowed = excluded.allowed",
            params![from, to, allowed],
        )?;
        Ok(())
    }

    pub fn connections(&self) -> Result<Vec<(String, String, bool)>> {
        let mut st = self.tx.prepare_cached(
            "SELECT from_agent, to_agent, allowed FROM connections ORDER BY from_agent, to_agent",
        )?;
        let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    // ----- messages -----

    pub fn insert_message(&self, m: &MessageRow) -> Result<()> {
        self.tx.execute(
            &format!("INSERT INTO messages ({MESSAGE_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)"),
            params![
                m.id, m.sender, m.recipient, m.body, m.body_hash, m.intent, m.kind, m.title,
                m.work_id, m.idem_key, m.created_at, m.read_at
            ],
        )?;
        Ok(())
    }

    pub fn message(&self, id: &str) -> Result<Option<MessageRow>> {
        Ok(self
            .tx
            .prepare_cached(&format!(
                "SELECT {MESSAGE_COLS} FROM messages WHERE id = ?1"
            ))?
            .query_row([id], message_from)
            .optional()?)
    }

    pub fn message_by_key(&self, sender: &str, key: &str) -> Result<Option<MessageRow>> {
        Ok(self
            .tx
            .prepare_cached(&format!(
                "SELECT {MESSAGE_COLS} FROM messages WHERE sender = ?1 AND idem_key = ?2"
            ))?
            .query_row([sender, key], message_from)
            .optional()?)
    }

    /// Ids in `table` starting with `prefix` (at most 2, enough to tell unique from ambiguous).
    pub fn ids_with_prefix(&self, table: IdTable, prefix: &str) -> Result<Vec<String>> {
        let (t, col) = match table {
            IdTable::Messages => ("messages", "id"),
            IdTable::Deliveries => ("deliveries", "message_id"),
        };
        let escaped = prefix
            .replace('\\', "\\\\")
            .replace('%', "\\%")
            .replace('_', "\\_");
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {col} FROM {t} WHERE {col} LIKE ?1 ESCAPE '\\' ORDER BY {col} LIMIT 2"
        ))?;
        let rows = st.query_map([format!("{escaped}%")], |r| r.get(0))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    pub fn mark_read(&self, id: &str, at: i64) -> Result<bool> {
        Ok(self.tx.execute(
            "UPDATE messages SET read_at = ?2 WHERE id = ?1 AND read_at IS NULL",
            params![id, at],
        )? > 0)
    }

    pub fn inbox(&self, agent: &str, all: bool, limit: i64) -> Result<Vec<MessageRow>> {
        let filter = if all { "" } else { "AND read_at IS NULL" };
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {MESSAGE_COLS} FROM messages WHERE recipient = ?1 {filter}
             ORDER BY seq DESC LIMIT ?2"
        ))?;
        let rows = st.query_map(params![agent, limit], message_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Unread handoffs, created at or after `after`, to a registered agent, without a
    /// delivery yet (SPEC §2.1), oldest first.
    pub fn unenrolled(&self, after: i64, limit: i64) -> Result<Vec<MessageRow>> {
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {} FROM messages m
             WHERE m.intent = 'handoff' AND m.read_at IS NULL AND m.created_at >= ?1
               AND EXISTS (SELECT 1 FROM agents a WHERE a.id = m.recipient)
               AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.message_id = m.id)
             ORDER BY m.seq LIMIT ?2",
            MESSAGE_COLS
                .split(", ")
                .map(|c| format!("m.{c}"))
                .collect::<Vec<_>>()
                .join(", ")
        ))?;
        let rows = st.query_map(params![after, limit], message_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// A live (pending or active) plain handoff with the same sender, recipient and body.
    pub fn live_identical(&self, m: &MessageRow) -> Result<Option<String>> {
        Ok(self
            .tx
            .prepare_cached(
                "SELECT d.message_id FROM deliveries d JOIN messages m ON m.id = d.message_id
                 WHERE m.sender = ?1 AND m.recipient = ?2 AND m.body_hash = ?3 AND m.kind = 'plain'
                   AND d.class IN ('pending', 'active') AND m.id != ?4
                 ORDER BY m.seq LIMIT 1",
            )?
            .query_row(params![m.sender, m.recipient, m.body_hash, m.id], |r| {
                r.get(0)
            })
            .optional()?)
    }

    // ----- work -----

    pub fn insert_work(&self, w: &WorkRow) -> Result<()> {
        self.tx.execute(
            &format!("INSERT INTO work ({WORK_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)"),
            params![
                w.id, w.sender, w.recipient, w.title, w.state.as_str(), w.due_at, w.reminded_at, w.summary,
                w.evidence, w.outcome, w.note, w.created_at, w.updated_at
            ],
        )?;
        Ok(())
    }

    pub fn work(&self, id: &str) -> Result<Option<WorkRow>> {
        Ok(self
            .tx
            .prepare_cached(&format!("SELECT {WORK_COLS} FROM work WHERE id = ?1"))?
            .query_row([id], work_from)
            .optional()?)
    }

    pub fn update_work(&self, w: &WorkRow) -> Result<()> {
        self.tx.execute(
            "UPDATE work SET state = ?2, reminded_at = ?3, summary = ?4, evidence = ?5,
               outcome = ?6, note = ?7, updated_at = ?8 WHERE id = ?1",
            params![
                w.id,
                w.state.as_str(),
                w.reminded_at,
                w.summary,
                w.evidence,
                w.outcome,
                w.note,
                w.updated_at
            ],
        )?;
        Ok(())
    }

    pub fn open_work(&self, limit: i64) -> Result<Vec<WorkRow>> {
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {WORK_COLS} FROM work WHERE state != 'closed' ORDER BY created_at LIMIT ?1"
        ))?;
        let rows = st.query_map([limit], work_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Work past its due time, not returned, not yet reminded.
    pub fn overdue_unreminded(&self, now: i64) -> Result<Vec<WorkRow>> {
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {WORK_COLS} FROM work
             WHERE due_at IS NOT NULL AND due_at <= ?1 AND reminded_at IS NULL
               AND {OPEN_WORK} ORDER BY due_at"
        ))?;
        let rows = st.query_map([now], work_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// When the next reminder falls due: the earliest due time of open, unreminded work.
    pub fn next_reminder_at(&self) -> Result<Option<i64>> {
        Ok(self
            .tx
            .prepare_cached(&format!(
                "SELECT min(due_at) FROM work
                 WHERE due_at IS NOT NULL AND reminded_at IS NULL AND {OPEN_WORK}"
            ))?
            .query_row([], |r| r.get(0))?)
    }

    // ----- deliveries -----

    pub fn insert_delivery(&self, d: &DeliveryRow, seq_of_message: &str) -> Result<()> {
        let json =
            serde_json::to_string(&d.record).map_err(|e| StoreError::Sqlite(e.to_string()))?;
        let kind = d.record.kind();
        self.tx.execute(
            "INSERT INTO deliveries (message_id, seq, recipient, state, class, record, due_at, updated_at)
             VALUES (?1, (SELECT seq FROM messages WHERE id = ?2), ?3, ?4, ?5, ?6, ?7, ?8)",
            params![
                d.message_id,
                seq_of_message,
                d.recipient,
                kind.as_str(),
                class_of(kind),
                json,
                d.due_at,
                d.updated_at
            ],
        )?;
        Ok(())
    }

    pub fn delivery(&self, message_id: &str) -> Result<Option<DeliveryRow>> {
        let row: Option<(String, String, String, Option<i64>, i64)> = self
            .tx
            .prepare_cached(
                "SELECT message_id, recipient, record, due_at, updated_at FROM deliveries WHERE message_id = ?1",
            )?
            .query_row([message_id], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
            })
            .optional()?;
        row.map(|(message_id, recipient, json, due_at, updated_at)| {
            decode_delivery(message_id, recipient, &json, due_at, updated_at)
        })
        .transpose()
    }

    pub fn save_delivery(
        &self,
        message_id: &str,
        record: &Delivery,
        due_at: Option<i64>,
        now: i64,
    ) -> Result<()> {
        let json = serde_json::to_string(record).map_err(|e| StoreError::Sqlite(e.to_string()))?;
        let kind = record.kind();
        self.tx.execute(
            "UPDATE deliveries SET state = ?2, class = ?3, record = ?4, due_at = ?5, updated_at = ?6
             WHERE message_id = ?1",
            params![message_id, kind.as_str(), class_of(kind), json, due_at, now],
        )?;
        Ok(())
    }

    pub fn set_due(&self, message_id: &str, due_at: Option<i64>) -> Result<()> {
        self.tx.execute(
            "UPDATE deliveries SET due_at = ?2 WHERE message_id = ?1",
            params![message_id, due_at],
        )?;
        Ok(())
    }

    /// Makes every pending delivery to `recipient` due now (its earlier delivery settled).
    pub fn wake_recipient(&self, recipient: &str, now: i64) -> Result<()> {
        self.tx.execute(
            "UPDATE deliveries SET due_at = ?2 WHERE recipient = ?1 AND class = 'pending'
               AND (due_at IS NULL OR due_at > ?2)",
            params![recipient, now],
        )?;
        Ok(())
    }

    /// Makes every pending delivery due at `now` (a change of `enabled` or `connections`).
    pub fn wake_pending(&self, now: i64) -> Result<()> {
        self.tx.execute(
            "UPDATE deliveries SET due_at = ?1 WHERE class = 'pending'
               AND (due_at IS NULL OR due_at > ?1)",
            params![now],
        )?;
        Ok(())
    }

    /// Another active delivery to `recipient`, if any.
    pub fn active_for(&self, recipient: &str, except: &str) -> Result<Option<String>> {
        Ok(self
            .tx
            .prepare_cached(
                "SELECT message_id FROM deliveries WHERE recipient = ?1 AND class = 'active'
                   AND message_id != ?2 LIMIT 1",
            )?
            .query_row([recipient, except], |r| r.get(0))
            .optional()?)
    }

    /// The due deliveries of one recipient, in the order of [`Tx::due`].
    pub fn due_for(&self, recipient: &str, now: i64, per_recipient: i64) -> Result<Vec<String>> {
        let mut out: Vec<(i64, i64, String)> = Vec::new();
        let mut others = self.tx.prepare_cached(
            "SELECT message_id, CASE class WHEN 'active' THEN 0 ELSE 1 END, seq FROM deliveries
             WHERE recipient = ?1 AND due_at <= ?2
               AND state NOT IN ('WAITING', 'BUSY', 'OWNER_REJECTED')
             ORDER BY due_at LIMIT 64",
        )?;
        for row in others.query_map(params![recipient, now], |r| {
            Ok((r.get(1)?, r.get(2)?, r.get(0)?))
        })? {
            out.push(row?);
        }
        let mut heads = self.tx.prepare_cached(
            "SELECT message_id, seq, due_at FROM deliveries
             WHERE class = 'pending' AND recipient = ?1
               AND state IN ('WAITING', 'BUSY', 'OWNER_REJECTED')
             ORDER BY seq LIMIT ?2",
        )?;
        for row in heads.query_map(params![recipient, per_recipient], |row| {
            Ok((
                row.get::<_, String>(0)?,
                row.get::<_, i64>(1)?,
                row.get::<_, Option<i64>>(2)?,
            ))
        })? {
            let (id, seq, due) = row?;
            if due.is_some_and(|d| d <= now) {
                out.push((1, seq, id));
            }
        }
        out.sort();
        Ok(out.into_iter().map(|(_, _, id)| id).collect())
    }

    /// Due deliveries for one pass, active ones first, then oldest first. Of the deliveries
    /// queued to take a turn (WAITING, BUSY, OWNER_REJECTED) only the oldest few per
    /// recipient are looked at, so a long queue is not re-examined row by row.
    pub fn due(&self, now: i64, per_recipient: i64, limit: i64) -> Result<Vec<(String, String)>> {
        let mut out: Vec<(i64, i64, String, String)> = Vec::new();
        let mut others = self.tx.prepare_cached(
            "SELECT message_id, CASE class WHEN 'active' THEN 0 ELSE 1 END, seq, recipient
             FROM deliveries
             WHERE due_at <= ?1 AND state NOT IN ('WAITING', 'BUSY', 'OWNER_REJECTED')
             ORDER BY due_at LIMIT ?2",
        )?;
        for row in others.query_map(params![now, limit], |r| {
            Ok((r.get(1)?, r.get(2)?, r.get(0)?, r.get(3)?))
        })? {
            out.push(row?);
        }
        let mut recipients = self
            .tx
            .prepare_cached("SELECT DISTINCT recipient FROM deliveries WHERE class = 'pending'")?;
        let recipients: Vec<String> = recipients
            .query_map([], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()?;
        let mut heads = self.tx.prepare_cached(
            "SELECT message_id, seq, due_at FROM deliveries
             WHERE class = 'pending' AND recipient = ?1
               AND state IN ('WAITING', 'BUSY', 'OWNER_REJECTED')
             ORDER BY seq LIMIT ?2",
        )?;
        for r in recipients {
            for row in heads.query_map(params![r, per_recipient], |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, i64>(1)?,
                    row.get::<_, Option<i64>>(2)?,
                ))
            })? {
                let (id, seq, due) = row?;
                if due.is_some_and(|d| d <= now) {
                    out.push((1, seq, id, r.clone()));
                }
            }
        }
        out.sort();
        out.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        Ok(out.into_iter().map(|(_, _, id, r)| (id, r)).collect())
    }

    /// The earliest due time among the deliveries `due` would look at (for the engine's
    /// sleep): queued rows behind the first `per_recipient` of their recipient do not count.
    pub fn next_due(&self, per_recipient: i64) -> Result<Option<i64>> {
        Ok(self
            .tx
            .prepare_cached(
                "SELECT min(due_at) FROM (
               SELECT due_at FROM deliveries
               WHERE state NOT IN ('WAITING', 'BUSY', 'OWNER_REJECTED') AND due_at IS NOT NULL
               UNION ALL
               SELECT (SELECT min(due_at) FROM (
                         SELECT due_at FROM deliveries d
                         WHERE d.class = 'pending' AND d.recipient = r.recipient
                           AND d.state IN ('WAITING', 'BUSY', 'OWNER_REJECTED')
                         ORDER BY d.seq LIMIT ?1))
               FROM (SELECT DISTINCT recipient FROM deliveries WHERE class = 'pending') r
             )",
            )?
            .query_row([per_recipient], |r| r.get(0))?)
    }

    /// The pending deliveries to `recipient` (queued, busy, held, unavailable, refused once),
    /// oldest first.
    pub fn pending_for(&self, recipient: &str) -> Result<Vec<DeliveryRow>> {
        let mut st = self.tx.prepare_cached(
            "SELECT message_id, recipient, record, due_at, updated_at FROM deliveries
             WHERE class = 'pending' AND recipient = ?1 ORDER BY seq",
        )?;
        let rows = st.query_map([recipient], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, Option<i64>>(3)?,
                r.get::<_, i64>(4)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (message_id, recipient, json, due_at, updated_at) = row?;
            out.push(decode_delivery(
                message_id, recipient, &json, due_at, updated_at,
            )?);
        }
        Ok(out)
    }

    /// Deliveries by state, newest change first.
    pub fn deliveries_in(&self, states: &[StateKind], limit: i64) -> Result<Vec<DeliveryRow>> {
        let (rows, damaged) = self.deliveries_or_damaged_in(states, limit)?;
        match damaged.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(rows),
        }
    }

    /// As [`Tx::deliveries_in`], with the rows that cannot be read back set apart (each
    /// error names its row), so one damaged row does not hide the others.
    pub fn deliveries_or_damaged_in(
        &self,
        states: &[StateKind],
        limit: i64,
    ) -> Result<(Vec<DeliveryRow>, Vec<StoreError>)> {
        if states.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let list = states
            .iter()
            .map(|s| format!("'{}'", s.as_str()))
            .collect::<Vec<_>>()
            .join(", ");
        let mut st = self.tx.prepare(&format!(
            "SELECT message_id, recipient, record, due_at, updated_at FROM deliveries
             WHERE state IN ({list}) ORDER BY updated_at DESC, seq DESC LIMIT ?1"
        ))?;
        let rows = st.query_map([limit], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get(3)?,
                r.get(4)?,
            ))
        })?;
        let mut out = Vec::new();
        let mut damaged = Vec::new();
        for row in rows {
            let (m, rcpt, json, due, upd) = row?;
            match decode_delivery(m, rcpt, &json, due, upd) {
                Ok(d) => out.push(d),
                Err(e @ StoreError::BadRecord { .. }) => damaged.push(e),
                Err(e) => return Err(e),
            }
        }
        Ok((out, damaged))
    }

    pub fn count_by_state(&self) -> Result<Vec<(String, i64)>> {
        let mut st = self.tx.prepare_cached(
            "SELECT state, count(*) FROM deliveries GROUP BY state ORDER BY state",
        )?;
        let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Recent work, newest change first: when each was sent, accepted and returned.
    pub fn work_timings(&self, limit: i64) -> Result<Vec<WorkTimes>> {
        let mut st = self.tx.prepare_cached(
            "SELECT w.created_at,
               (SELECT min(e.at) FROM events e WHERE e.message_id = w.id AND e.kind = 'work'
                  AND e.detail LIKE 'accepted by %'),
               (SELECT min(e.at) FROM events e WHERE e.message_id = w.id AND e.kind = 'work'
                  AND (e.detail LIKE 'returned by %' OR e.detail LIKE 'blocked by %'))
             FROM work w ORDER BY w.updated_at DESC LIMIT ?1",
        )?;
        let rows = st.query_map([limit], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Open work (not closed): how much in all, how much overdue at `now`, and how much per
    /// recipient.
    pub fn work_counts(&self, now: i64) -> Result<WorkCounts> {
        let (open, overdue) = self
            .tx
            .prepare_cached(&format!(
                "SELECT count(*),
                    coalesce(sum({OPEN_WORK} AND due_at IS NOT NULL AND due_at <= ?1), 0)
             FROM work WHERE state != 'closed'"
            ))?
            .query_row([now], |r| Ok((r.get(0)?, r.get(1)?)))?;
        let mut st = self.tx.prepare_cached(
            "SELECT recipient, count(*) FROM work WHERE state != 'closed' GROUP BY recipient",
        )?;
        let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok((open, overdue, rows.collect::<rusqlite::Result<_>>()?))
    }

    /// The newest open work first (`overdue_at`: only work overdue at that time).
    pub fn newest_open_work(&self, overdue_at: Option<i64>, limit: i64) -> Result<Vec<WorkRow>> {
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {WORK_COLS} FROM work WHERE state != 'closed'
               AND (?1 IS NULL OR ({OPEN_WORK} AND due_at IS NOT NULL AND due_at <= ?1))
             ORDER BY created_at DESC LIMIT ?2"
        ))?;
        let rows = st.query_map(rusqlite::params![overdue_at, limit], work_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Deliveries per recipient in the given states.
    pub fn count_by_recipient(&self, states: &[StateKind]) -> Result<Vec<(String, i64)>> {
        let list = states
            .iter()
            .map(|s| format!("'{}'", s.as_str()))
            .collect::<Vec<_>>()
            .join(", ");
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT recipient, count(*) FROM deliveries WHERE state IN ({list}) GROUP BY recipient"
        ))?;
        let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// All deliveries' write attempts and resends (for /metrics).
    pub fn delivery_totals(&self) -> Result<(i64, i64)> {
        Ok(self
            .tx
            .prepare_cached(
                "SELECT coalesce(sum(json_extract(record, '$.core.attempts')), 0),
                    coalesce(sum(json_extract(record, '$.core.error_resends')
                               + json_extract(record, '$.core.interrupt_resends')), 0)
             FROM deliveries",
            )?
            .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))?)
    }

    /// The newest event's sequence number (0: none).
    pub fn last_event_seq(&self) -> Result<i64> {
        Ok(self
            .tx
            .prepare_cached("SELECT coalesce(max(seq), 0) FROM events")?
            .query_row([], |r| r.get(0))?)
    }

    // ----- events -----

    pub fn event(&self, at: i64, message_id: Option<&str>, kind: &str, detail: &str) -> Result<()> {
        self.tx
            .prepare_cached(
                "INSERT INTO events (at, message_id, kind, detail) VALUES (?1, ?2, ?3, ?4)",
            )?
            .execute(params![at, message_id, kind, detail])?;
        Ok(())
    }

    pub fn events_for(&self, message_id: &str) -> Result<Vec<EventRow>> {
        let mut st = self.tx.prepare_cached(
            "SELECT seq, at, message_id, kind, detail FROM events WHERE message_id = ?1 ORDER BY seq",
        )?;
        let rows = st.query_map([message_id], event_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    pub fn events_after(&self, after: i64, limit: i64) -> Result<Vec<EventRow>> {
        let mut st = self.tx.prepare_cached(
            "SELECT seq, at, message_id, kind, detail FROM events WHERE seq > ?1 ORDER BY seq LIMIT ?2",
        )?;
        let rows = st.query_map([after, limit], event_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    // ----- command runs -----

    pub fn insert_run(&self, r: &RunRow) -> Result<()> {
        self.tx.execute(
            &format!(
                "INSERT INTO runs ({RUN_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)"
            ),
            params![
                r.request_id,
                r.message_id,
                r.agent,
                r.pid,
                r.started_at,
                r.ends_at,
                r.ended_at,
                r.exit_code,
                r.outcome,
                r.detail
            ],
        )?;
        Ok(())
    }

    pub fn run(&self, request_id: &str) -> Result<Option<RunRow>> {
        Ok(self
            .tx
            .prepare_cached(&format!(
                "SELECT {RUN_COLS} FROM runs WHERE request_id = ?1"
            ))?
            .query_row([request_id], run_from)
            .optional()?)
    }

    /// Forgets a refused run (it never ran), so a retry with the same request id can run.
    pub fn forget_refused_run(&self, request_id: &str) -> Result<()> {
        self.tx.execute(
            "DELETE FROM runs WHERE request_id = ?1 AND outcome = 'refused'",
            [request_id],
        )?;
        Ok(())
    }

    /// Notes that the run's supervisor left it open (nobody could tell how its write ended).
    pub fn leave_run_open(&self, request_id: &str, at: i64) -> Result<()> {
        self.tx.execute(
            "UPDATE runs SET left_open_at = ?2 WHERE request_id = ?1 AND outcome IS NULL",
            params![request_id, at],
        )?;
        Ok(())
    }

    /// When the run's supervisor left it open, and since when its message was seen nowhere.
    pub fn run_marks(&self, request_id: &str) -> Result<(Option<i64>, Option<i64>)> {
        Ok(self
            .tx
            .prepare_cached("SELECT left_open_at, missing_since FROM runs WHERE request_id = ?1")?
            .query_row([request_id], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?
            .unwrap_or((None, None)))
    }

    /// Notes since when an open run's message was seen nowhere (kept from the first look).
    pub fn mark_run_missing(&self, request_id: &str, at: i64) -> Result<()> {
        self.tx.execute(
            "UPDATE runs SET missing_since = coalesce(missing_since, ?2)
             WHERE request_id = ?1 AND outcome IS NULL",
            params![request_id, at],
        )?;
        Ok(())
    }

    /// Records the pid of a run's command once it started.
    pub fn set_run_pid(&self, request_id: &str, pid: i64) -> Result<()> {
        self.tx.execute(
            "UPDATE runs SET pid = ?2 WHERE request_id = ?1",
            params![request_id, pid],
        )?;
        Ok(())
    }

    /// Registers a channel listener (a `handoffs mcp --channels` process).
    pub fn open_channel(&self, c: &ChannelRow) -> Result<()> {
        self.tx.execute(
            "INSERT OR REPLACE INTO channels (pid, agent, session, claude_pid, opened_at)
             VALUES (?1, ?2, ?3, ?4, ?5)",
            params![c.pid, c.agent, c.session, c.claude_pid, c.opened_at],
        )?;
        Ok(())
    }

    pub fn close_channel(&self, pid: i64) -> Result<()> {
        self.tx
            .execute("DELETE FROM channels WHERE pid = ?1", [pid])?;
        Ok(())
    }

    /// The channel listeners registered for an agent's session, newest first.
    pub fn channels_for(&self, agent: &str, session: &str) -> Result<Vec<ChannelRow>> {
        let mut st = self.tx.prepare_cached(
            "SELECT pid, agent, session, claude_pid, opened_at FROM channels
             WHERE agent = ?1 AND session = ?2 ORDER BY opened_at DESC",
        )?;
        let rows = st.query_map([agent, session], channel_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    pub fn channel(&self, pid: i64) -> Result<Option<ChannelRow>> {
        Ok(self
            .tx
            .prepare_cached(
                "SELECT pid, agent, session, claude_pid, opened_at FROM channels WHERE pid = ?1",
            )?
            .query_row([pid], channel_from)
            .optional()?)
    }

    /// A card for a channel listener to push.
    pub fn insert_push(&self, p: &PushRow) -> Result<()> {
        self.tx.execute(
            "INSERT INTO channel_pushes
               (request_id, listener, session, claude_pid, content, meta, created_at, pushed_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            params![
                p.request_id,
                p.listener,
                p.session,
                p.claude_pid,
                p.content,
                p.meta,
                p.created_at,
                p.pushed_at
            ],
        )?;
        Ok(())
    }

    pub fn push(&self, request_id: &str) -> Result<Option<PushRow>> {
        Ok(self
            .tx
            .prepare_cached(
                "SELECT request_id, listener, session, claude_pid, content, meta, created_at,
                        pushed_at
                 FROM channel_pushes WHERE request_id = ?1",
            )?
            .query_row([request_id], push_from)
            .optional()?)
    }

    /// The cards waiting for a listener, oldest first.
    pub fn waiting_pushes(&self, listener: i64) -> Result<Vec<PushRow>> {
        let mut st = self.tx.prepare_cached(
            "SELECT request_id, listener, session, claude_pid, content, meta, created_at, pushed_at
             FROM channel_pushes WHERE listener = ?1 AND pushed_at IS NULL ORDER BY created_at",
        )?;
        let rows = st.query_map([listener], push_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Takes a waiting card for pushing: marks it pushed and records the listener as the
    /// run's receipt. False when it was taken back (or taken) already.
    pub fn take_push(&self, request_id: &str, listener: i64, at: i64) -> Result<bool> {
        let changed = self.tx.execute(
            "UPDATE channel_pushes SET pushed_at = ?3
             WHERE request_id = ?1 AND listener = ?2 AND pushed_at IS NULL",
            params![request_id, listener, at],
        )?;
        if changed > 0 {
            self.tx.execute(
                "UPDATE runs SET pid = ?2 WHERE request_id = ?1",
                params![request_id, listener],
            )?;
        }
        Ok(changed > 0)
    }

    /// Takes back a card no listener took: false when it was pushed meanwhile.
    pub fn withdraw_push(&self, request_id: &str) -> Result<bool> {
        let changed = self.tx.execute(
            "DELETE FROM channel_pushes WHERE request_id = ?1 AND pushed_at IS NULL",
            [request_id],
        )?;
        Ok(changed > 0)
    }

    pub fn open_runs_for(&self, agent: &str) -> Result<Vec<RunRow>> {
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {RUN_COLS} FROM runs WHERE agent = ?1 AND outcome IS NULL ORDER BY started_at"
        ))?;
        let rows = st.query_map([agent], run_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    pub fn finish_run(
        &self,
        request_id: &str,
        at: i64,
        exit_code: Option<i64>,
        outcome: &str,
        detail: Option<&str>,
    ) -> Result<()> {
        let changed = self.tx.execute(
            "UPDATE runs SET ended_at = ?2, exit_code = ?3, outcome = ?4, detail = ?5
             WHERE request_id = ?1 AND outcome IS NULL",
            params![request_id, at, exit_code, outcome, detail],
        )?;
        if changed > 0 {
            // The run's delivery is due at once: a running engine notices the commit.
            self.tx.execute(
                "UPDATE deliveries SET due_at = ?2 WHERE message_id =
                   (SELECT message_id FROM runs WHERE request_id = ?1) AND class = 'active'",
                params![request_id, at],
            )?;
        }
        Ok(())
    }

    // ----- engine -----

    pub fn save_report(&self, at: i64, report: &Value) -> Result<()> {
        self.tx.execute(
            "INSERT INTO engine (id, at, report) VALUES (1, ?1, ?2)
             ON CONFLICT (id) DO UPDATE SET at = excluded.at, report = excluded.report",
            params![at, report.to_string()],
        )?;
        Ok(())
    }

    pub fn report(&self) -> Result<Option<(i64, Value)>> {
        let row: Option<(i64, String)> = self
            .tx
            .query_row("SELECT at, report FROM engine WHERE id = 1", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .optional()?;
        Ok(row.map(|(at, s)| (at, serde_json::from_str(&s).unwrap_or(Value::Null))))
    }
}

/// Which table an id prefix is resolved in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdTable {
    Messages,
    Deliveries,
}

fn event_from(r: &rusqlite::Row<'_>) -> rusqlite::Result<EventRow> {
    Ok(EventRow {
        seq: r.get(0)?,
        at: r.get(1)?,
        message_id: r.get(2)?,
        kind: r.get(3)?,
        detail: r.get(4)?,
    })
}

fn decode_delivery(
    message_id: String,
    recipient: String,
    json: &str,
    due_at: Option<i64>,
    updated_at: i64,
) -> Result<DeliveryRow> {
    let bad = |detail: String| StoreError::BadRecord {
        message: message_id.clone(),
        detail,
    };
    let record: Delivery = serde_json::from_str(json).map_err(|e| bad(e.to_string()))?;
    // Read back, a record must still be one `step` could have made: a row edited by hand or
    // damaged is a clear error naming it, never a wrong state acted on.
    record.check_shape().map_err(|e| bad(e.to_string()))?;
    if record.core().message().as_str() != message_id {
        return Err(bad(format!(
            "its record belongs to message {}",
            record.core().message()
        )));
    }
    if record.core().target().agent.as_str() != recipient {
        return Err(bad(format!(
            "its record is addressed to {}, its row to {recipient}",
            record.core().target().agent
        )));
    }
    Ok(DeliveryRow {
        message_id,
        recipient,
        record,
        due_at,
        updated_at,
    })
}

/// Milliseconds since the epoch, as stored.
pub fn millis(m: Millis) -> i64 {
    i64::try_from(m.0).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::{OPEN_WORK, WorkState};

    /// The SQL spelling of open work names exactly the open states.
    #[test]
    fn open_work_in_sql_is_the_open_states() {
        let named: Vec<String> = WorkState::OPEN
            .iter()
            .map(|s| format!("'{}'", s.as_str()))
            .collect();
        assert_eq!(OPEN_WORK, format!("state IN ({})", named.join(", ")));
    }
}
