//! The store: schema and migrations, connection settings, short write transactions
//! (SQLite's `BEGIN IMMEDIATE`; on PostgreSQL, one advisory lock all writers queue on), and
//! typed reads and writes of agents, messages, work, deliveries, events and command runs, on
//! SQLite or PostgreSQL (`sql.rs`, `pg.rs`). The only module that knows rusqlite or
//! postgres. It decides nothing about delivery: records go in and out as `model::Delivery`.

/// The states of a delivery queued behind its recipient's earlier ones, as SQL: only the
/// head of such a queue is looked at (`QUEUE_HEADS`). The partial indexes of schema 6 hold
/// this text in their predicates, and a query uses them only when it repeats it word for
/// word: so every query spells it with this macro (`concat!`), and a test checks the
/// indexes, the text and the query plans.
macro_rules! queued {
    () => {
        "('WAITING', 'BUSY', 'OWNER_REJECTED')"
    };
}

mod agents;
mod artifacts;
mod chains;
mod config;
mod dead;
mod deliveries;
mod events;
mod fanouts;
mod leases;
mod memo;
mod messages;
mod migrations;
pub mod pg;
mod pg_schema;
mod runs;
pub mod sql;
mod tokens;
mod topics;
mod work;

pub use agents::AgentRow;
use agents::route_of;
pub use artifacts::ArtifactRow;
pub use chains::{ChainRow, ChainState};
pub use dead::DeadLetterRow;
pub use deliveries::{DeliveryRow, QUEUE_HEADS};
pub use events::{EventRow, TraceRow};
pub use fanouts::{FanoutChildRow, FanoutRow};
pub use leases::LeaseRow;
pub use messages::MessageRow;
pub use runs::{ChannelRow, PushRow, RunRow};
pub use tokens::TokenOwner;
pub use topics::{PostRow, SubscriberRow, TopicRow};
pub use work::{WorkCounts, WorkRow, WorkTimes};

use model::work::WorkState;
use model::{Delivery, Millis, StateKind};

/// Open work in SQL: the states of [`WorkState::OPEN`] (a test keeps the two in step).
const OPEN_WORK: &str = "state IN ('assigned', 'accepted')";
use rusqlite::{Connection, OpenFlags, OptionalExtension, TransactionBehavior};
use serde_json::Value;
use sql::{Conn, params};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Our `PRAGMA application_id` ("HNDF"): tells our database from any other SQLite file.
const APPLICATION_ID: i64 = 0x484E_4446;
/// How [`Store::write`] begins.
const WRITE_BEGIN: &str = "BEGIN IMMEDIATE";
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
    /// The server answered and turned this login away for good (a wrong password, a role or
    /// database that does not exist): waiting will not change it.
    #[error("{0}")]
    Denied(String),
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
        if let rusqlite::Error::ToSqlConversionFailure(inner) = e {
            return match inner.downcast::<pg::PgFailure>() {
                Ok(pg) => pg.into_store_error(),
                Err(other) => StoreError::Sqlite(other.to_string()),
            };
        }
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
pub struct Store {
    db: Db,
    /// The database's path, or its `postgres://` URL: what another process is handed to
    /// open the same database.
    path: PathBuf,
    /// Commits are not synced as they are made ([`Store::commit_lazily`]).
    lazy: bool,
    /// `commits` when this connection's WAL was last synced (shared with syncs made on
    /// another thread, [`Store::sync_elsewhere`]).
    synced_changes: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// The WAL file as this connection first synced it, with its inode, kept open: on Linux a
    /// descriptor reports every writeback error since it was opened, where one opened later
    /// may report none (another process's sync may have seen and cleared it).
    wal: Option<(std::sync::Arc<std::fs::File>, u64)>,
    /// Write transactions committed through [`Store::write`] (the marks of `sync_upto`).
    commits: u64,
    /// The engine's steps share one open write transaction ([`Store::batch_steps`]).
    batch: Batch,
    /// The engine lock, once taken ([`Store::take_engine_lock`]): a locked file beside a
    /// SQLite database (PostgreSQL has none: its engines share it by recipient leases).
    engine_lock: Option<std::fs::File>,
    /// Rows this transaction has read ([`memo`]): forgotten at every transaction boundary.
    memo: std::cell::RefCell<memo::Memo>,
    /// Inside [`Store::read_one_statement`]: the statements its body has run so far (a debug
    /// build checks that it runs one read at most).
    single: std::cell::Cell<Option<u32>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("db", &shown(&self.path))
            .field("lazy", &self.lazy)
            .field("commits", &self.commits)
            .finish_non_exhaustive()
    }
}

/// The connection underneath.
#[derive(Debug)]
enum Db {
    Lite(Connection),
    Pg {
        session: pg::PgSession,
        /// A transaction is open on the session.
        open: std::cell::Cell<bool>,
        /// A step ended and its `RELEASE SAVEPOINT` is not sent yet: it goes in one message
        /// with the next step's `SAVEPOINT` (a round trip a step saved), and `COMMIT` releases
        /// it anyway. Statements between the two run inside the finished step's savepoint,
        /// which changes nothing but what a `ROLLBACK TO` would undo: `Undo` sends the release
        /// first.
        released: std::cell::Cell<bool>,
    },
}

/// Steps batched into one write transaction: each step is a savepoint in it, and the whole
/// is committed when the engine is about to wait or act ([`Store::flush`]).
#[derive(Debug, Default)]
struct Batch {
    /// Writes join the open batch instead of committing each on its own.
    on: bool,
    /// A batch transaction is open (`BEGIN IMMEDIATE` ran, `COMMIT` not yet).
    open: bool,
    /// Why a batch was lost (its commit failed, or SQLite rolled it back after an error):
    /// steps its writers took for committed are gone, so nothing may sync or act on them;
    /// the connection reports this from then on.
    lost: Option<String>,
}

/// The token file beside a database: `<db>.token`.
pub fn token_path(db: &Path) -> PathBuf {
    sibling(db, ".token")
}

/// A sibling path of the database: `<db><suffix>`. A PostgreSQL database has no file to
/// stand beside: its siblings (this machine's page token, command outputs) live under
/// [`local_anchor`].
pub fn sibling(db: &Path, suffix: &str) -> PathBuf {
    let mut p = local_anchor(db).into_os_string();
    p.push(suffix);
    PathBuf::from(p)
}

/// The database as messages name it: its path, or its URL without the password.
pub fn shown(db: &Path) -> String {
    if pg::is_url(db) {
        pg::redacted(&db.to_string_lossy())
    } else {
        db.display().to_string()
    }
}

/// Where the files of this machine that belong to database `db` live: beside the SQLite
/// file itself; for a `postgres://` URL, a name made from the URL (without its password)
/// in this user's state folder (`$HANDOFFS_STATE_DIR`, else `$XDG_STATE_HOME/handoffs`, else
/// `~/.local/state/handoffs`), so every process of this user on this machine finds the same.
pub fn local_anchor(db: &Path) -> PathBuf {
    if !pg::is_url(db) {
        return db.to_owned();
    }
    let url = pg::identity(&db.to_string_lossy());
    let dir = std::env::var_os("HANDOFFS_STATE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_STATE_HOME").map(|d| PathBuf::from(d).join("handoffs")))
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state/handoffs"))
        })
        .unwrap_or_else(|| std::env::temp_dir().join("handoffs"));
    let readable: String = url
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(48)
        .collect();
    let digest = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(url.as_bytes()));
    dir.join(format!("pg-{readable}-{}", &digest[..12]))
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

/// A connection to the SQLite file at `path` (created when `create`), with the busy timeout
/// every handoffs database uses: `HANDOFFS_BUSY_TIMEOUT_MS` shortens it for tests and scripts
/// that prefer to fail fast; the default rides out any other process's short transaction.
/// Nothing is written yet, so a foreign file can still be told apart. The delivery store and
/// the task ledger both open their files here.
pub fn connect(path: &Path, create: bool) -> Result<Connection> {
    let mut flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_URI
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    if create {
        flags |= OpenFlags::SQLITE_OPEN_CREATE;
    }
    let conn = Connection::open_with_flags(path, flags).map_err(|e| StoreError::Corrupt {
        path: path.to_owned(),
        detail: e.to_string(),
    })?;
    let busy = std::env::var("HANDOFFS_BUSY_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(BUSY_TIMEOUT, Duration::from_millis);
    conn.busy_timeout(busy)?;
    // Every query of the store is prepared once and kept (the default keeps only 16), and
    // stays prepared: without the planner's stability guarantee, SQLite (built with STAT4)
    // prepared a statement anew each time a bound value changed, a fifth of a delivery's time.
    conn.set_prepared_statement_cache_capacity(128);
    conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG,
        true,
    )?;
    Ok(conn)
}

/// The settings every handoffs database runs with: WAL, `synchronous=FULL` (each commit's WAL
/// frames are on stable storage before the commit returns, so a power cut never takes back
/// what a front reported done), foreign keys, temporary tables in memory. The engine's own
/// connection then commits lazily and syncs before each effect instead
/// ([`Store::commit_lazily`], [`Store::sync_upto`]).
pub fn settle(conn: &Connection) -> Result<()> {
    let journal: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
    if !journal.eq_ignore_ascii_case("wal") {
        let _: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
    }
    conn.execute_batch(
        "PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON; PRAGMA temp_store=MEMORY;",
    )?;
    Ok(())
}

/// `HANDOFFS_SYNC=full`: the engine too syncs every commit as it is made (one fsync per
/// transaction, no group commit; measured in docs/PERFORMANCE.md), instead of committing
/// lazily and syncing once before each effect.
fn sync_every_commit() -> bool {
    std::env::var("HANDOFFS_SYNC").is_ok_and(|v| v.eq_ignore_ascii_case("full"))
}

/// What [`Store::init`] made: the database (a new file, or the schema on an empty
/// PostgreSQL database) and this user's token file for it (on PostgreSQL one per machine and
/// user, so a second machine's `init` makes a token for a database that was there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Created {
    pub database: bool,
    pub token: bool,
}

impl Store {
    /// Creates the database (and its folder, 0700) if missing, migrates it, and writes the
    /// token file (0600) if missing. Idempotent. Returns what was created.
    pub fn init(path: &Path) -> Result<(Store, Created)> {
        if pg::is_url(path) {
            let (store, created) = Store::open_pg(path, true)?;
            let token = token_path(path);
            if let Some(dir) = token.parent() {
                // This user's state folder of handoffs: private, however it came to be.
                std::fs::create_dir_all(dir)
                    .map_err(|e| StoreError::Io(format!("cannot create {}: {e}", dir.display())))?;
                set_mode(dir, 0o700).map_err(|e| {
                    StoreError::Io(format!("cannot make {} private (0700): {e}", dir.display()))
                })?;
            }
            let token = ensure_token(&token)?;
            return Ok((
                store,
                Created {
                    database: created,
                    token,
                },
            ));
        }
        let existed = path.exists();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
            && !dir.exists()
        {
            std::fs::create_dir_all(dir)
                .map_err(|e| StoreError::Io(format!("cannot create {}: {e}", dir.display())))?;
            set_mode(dir, 0o700).map_err(|e| {
                StoreError::Io(format!("cannot make {} private (0700): {e}", dir.display()))
            })?;
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
        let token = ensure_token(&token_path(path))?;
        Ok((
            store,
            Created {
                database: !existed,
                token,
            },
        ))
    }

    /// Opens an existing database; a missing file says how to create one.
    pub fn open(path: &Path) -> Result<Store> {
        if pg::is_url(path) {
            return Store::open_pg(path, false).map(|(store, _)| store);
        }
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
        let conn = connect(path, false).map_err(|e| match e {
            StoreError::Corrupt { detail, .. } => corrupt(detail),
            other => other,
        })?;
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
        settle(&conn)?;
        // Absolute, so every process it is handed to (supervisors, commands running in another
        // folder through HANDOFFS_DB) finds the same database.
        let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
        let mut conn = conn;
        if version < migrations::LATEST {
            migrate(&mut conn, version)?;
        }
        let store = Store::with_db(Db::Lite(conn), path);
        for suffix in ["-wal", "-shm"] {
            let p = sibling(&store.path, suffix);
            if p.exists() {
                let _ = set_mode(&p, 0o600);
            }
        }
        Ok(store)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` in one short write transaction (SQLite's `BEGIN IMMEDIATE`; PostgreSQL's
    /// writers queue on one advisory lock, as SQLite's do on its file): all of it is
    /// committed, or none. While steps are batched ([`Store::batch_steps`]) it is a savepoint
    /// of the open batch instead: all of it or none of it joins the batch, committed by
    /// [`Store::flush`].
    pub fn write<T, E>(&mut self, f: impl FnOnce(&Tx<'_>) -> Result<T, E>) -> Result<T, E>
    where
        E: From<StoreError>,
    {
        if self.batch.on {
            return self.step_in_batch(f);
        }
        self.transaction(true, f)
    }

    /// [`Store::write`], committed at once even while steps are batched: what another
    /// process acts on as soon as it is written (a supervisor reads its run, a Claude
    /// channel its card). The open batch is committed first, in order.
    pub fn write_shared<T, E>(&mut self, f: impl FnOnce(&Tx<'_>) -> Result<T, E>) -> Result<T, E>
    where
        E: From<StoreError>,
    {
        self.flush()?;
        self.transaction(true, f)
    }

    /// Runs `f` in a read transaction (a consistent snapshot); inside the open batch while
    /// one is open (it sees the batch's steps, as it would have seen them committed).
    pub fn read<T, E>(&mut self, f: impl FnOnce(&Tx<'_>) -> Result<T, E>) -> Result<T, E>
    where
        E: From<StoreError>,
    {
        if self.batch.open {
            self.check_batch()?;
            if !self.is_postgres() {
                return f(&self.tx());
            }
            // On PostgreSQL any failed statement aborts the whole transaction: a read
            // inside the batch is a savepoint of its own, so a failed one leaves it whole.
            return self.savepoint(f);
        }
        self.transaction(false, f)
    }

    /// [`Store::read`] for a body that runs exactly one statement: on PostgreSQL, outside a
    /// batch, it runs on its own without `BEGIN` and `COMMIT` (a single statement is a
    /// consistent snapshot by itself), one round trip instead of two (a read's `BEGIN` goes
    /// out with its first statement, its `COMMIT` on its own). A body of more statements
    /// would read each from a snapshot of its own, and a write would commit outside the
    /// writers' lock: use [`Store::read`] or [`Store::write`].
    pub fn read_one_statement<T, E>(
        &mut self,
        f: impl FnOnce(&Tx<'_>) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<StoreError>,
    {
        self.single.set(Some(0));
        let out = self.read_alone(f);
        self.single.set(None);
        out
    }

    /// [`Store::read_one_statement`]'s body run as it may be.
    fn read_alone<T, E>(&mut self, f: impl FnOnce(&Tx<'_>) -> Result<T, E>) -> Result<T, E>
    where
        E: From<StoreError>,
    {
        let Db::Pg { session, open, .. } = &self.db else {
            return self.read(f);
        };
        if self.batch.open || open.get() {
            return self.read(f);
        }
        // As a `BEGIN` would: a session lost since the last transaction is opened anew.
        session.fresh();
        self.memo.borrow_mut().clear();
        let out = f(&self.tx());
        self.memo.borrow_mut().clear();
        out
    }

    /// The PostgreSQL server process of this connection's session (it changes when a lost
    /// session is opened anew); `None` on SQLite.
    pub fn session_pid(&self) -> Option<i64> {
        self.conn().session_pid()
    }

    /// A [`Tx`] on the connection, with this store's memo.
    fn tx(&self) -> Tx<'_> {
        Tx {
            tx: TxConn {
                conn: self.conn(),
                memo: &self.memo,
                single: &self.single,
            },
        }
    }

    /// The connection, for a [`Tx`].
    fn conn(&self) -> Conn<'_> {
        match &self.db {
            Db::Lite(c) => Conn::Lite(c),
            Db::Pg { session, .. } => Conn::Pg(session),
        }
    }

    /// Whether a transaction is open on the connection.
    fn in_transaction(&self) -> bool {
        match &self.db {
            Db::Lite(c) => !c.is_autocommit(),
            Db::Pg { open, .. } => open.get(),
        }
    }

    /// One statement of transaction control, in each backend's spelling. SQLite's are
    /// cached statements like every other (parsing them anew cost a tenth of a delivery).
    fn control(&self, what: Control) -> Result<()> {
        // What was read stays true inside one transaction and one step: a transaction's
        // ends and a step undone forget it.
        if !matches!(what, Control::Savepoint | Control::Release) {
            self.memo.borrow_mut().clear();
        }
        match &self.db {
            Db::Lite(c) => {
                let sql = match what {
                    Control::BeginWrite => WRITE_BEGIN,
                    Control::BeginRead => "BEGIN DEFERRED",
                    Control::CommitWrite | Control::CommitRead => "COMMIT",
                    Control::Rollback => return Ok(c.execute_batch("ROLLBACK")?),
                    Control::Savepoint => "SAVEPOINT step",
                    Control::Release => "RELEASE step",
                    Control::Undo => return Ok(c.execute_batch("ROLLBACK TO step; RELEASE step")?),
                };
                c.prepare_cached(sql)?.execute([])?;
                Ok(())
            }
            Db::Pg {
                session,
                open,
                released,
            } => match what {
                Control::BeginWrite => {
                    released.set(false);
                    session.begin(pg_schema::WRITE_BEGIN)?;
                    open.set(true);
                    Ok(())
                }
                // A read's `BEGIN` cannot fail on its own: it goes out with its first
                // statement (a writer's may time out on the writers' lock: it is waited for).
                Control::BeginRead => {
                    released.set(false);
                    session.begin_later(pg_schema::READ_BEGIN);
                    open.set(true);
                    Ok(())
                }
                Control::CommitWrite | Control::CommitRead => {
                    open.set(false);
                    released.set(false);
                    session.commit(if what == Control::CommitWrite {
                        pg_schema::WRITE_COMMIT
                    } else {
                        "COMMIT"
                    })
                }
                Control::Rollback => {
                    open.set(false);
                    released.set(false);
                    session.rollback()
                }
                // Goes out with the step's first statement (or its undo, or the commit).
                Control::Savepoint => {
                    session.hold(if released.replace(false) {
                        "RELEASE SAVEPOINT step; SAVEPOINT step"
                    } else {
                        "SAVEPOINT step"
                    });
                    Ok(())
                }
                Control::Release => {
                    released.set(true);
                    Ok(())
                }
                Control::Undo => session.undo(if released.replace(false) {
                    "RELEASE SAVEPOINT step; ROLLBACK TO SAVEPOINT step; RELEASE SAVEPOINT step"
                } else {
                    "ROLLBACK TO SAVEPOINT step; RELEASE SAVEPOINT step"
                }),
            },
        }
    }

    /// From now on (`on`) this connection's writes are steps of one open write transaction,
    /// each a savepoint, committed together by [`Store::flush`] (which also runs before any
    /// sync): the engine batches the steps its jobs take at the same moment, so their pages
    /// go to the WAL once. Whoever turns it on flushes before it waits on anything (holding
    /// the write lock meanwhile would stall every other process's commit) and before any
    /// other process may act on what it wrote. Off flushes what is open.
    pub fn batch_steps(&mut self, on: bool) -> Result<()> {
        if !on {
            self.flush()?;
        }
        self.batch.on = on;
        Ok(())
    }

    /// Ends batching without committing: what is open is rolled back, as a crash would
    /// leave it (an engine dropped mid-run, or one that stops after a failed sync).
    pub fn abandon_batch(&mut self) {
        if self.batch.open && self.in_transaction() {
            let _ = self.control(Control::Rollback);
        }
        self.batch.open = false;
        self.batch.on = false;
    }

    /// Commits the open batch, if any. A failed commit loses the whole batch: every later
    /// flush and sync on this connection fails with the reason (see [`Batch::lost`]).
    pub fn flush(&mut self) -> Result<()> {
        self.check_batch()?;
        if !self.batch.open {
            return Ok(());
        }
        self.batch.open = false;
        if let Err(e) = self.control(Control::CommitWrite) {
            if self.in_transaction() {
                let _ = self.control(Control::Rollback);
            }
            return Err(self.lose_batch(&format!("its commit failed: {e}")));
        }
        Ok(())
    }

    /// Fails once a batch was lost, and notices a batch SQLite rolled back on its own (after
    /// an I/O error, a full disk).
    fn check_batch(&mut self) -> Result<()> {
        if self.batch.open && !self.in_transaction() {
            self.batch.open = false;
            return Err(self.lose_batch("the database rolled it back after an error"));
        }
        match &self.batch.lost {
            Some(why) => Err(StoreError::Io(why.clone())),
            None => Ok(()),
        }
    }

    fn lose_batch(&mut self, why: &str) -> StoreError {
        let why = self.batch.lost.get_or_insert_with(|| {
            format!("the engine's batched steps were not committed ({why})")
        });
        StoreError::Io(why.clone())
    }

    /// One step of the open batch (opened here if none is): a savepoint, released when `f`
    /// succeeds and rolled back when it fails or panics, so the batch keeps every other
    /// step whole.
    fn step_in_batch<T, E>(&mut self, f: impl FnOnce(&Tx<'_>) -> Result<T, E>) -> Result<T, E>
    where
        E: From<StoreError>,
    {
        self.check_batch()?;
        if !self.batch.open {
            if self.in_transaction() {
                self.control(Control::Rollback).map_err(|e| {
                    StoreError::Sqlite(format!("cannot end an open transaction: {e}"))
                })?;
            }
            self.control(Control::BeginWrite)?;
            self.batch.open = true;
        }
        let out = self.savepoint(f)?;
        self.commits += 1;
        Ok(out)
    }

    /// `f` in a savepoint of the open batch: released when `f` succeeds, rolled back when
    /// it fails or panics.
    fn savepoint<T, E>(&mut self, f: impl FnOnce(&Tx<'_>) -> Result<T, E>) -> Result<T, E>
    where
        E: From<StoreError>,
    {
        /// Undoes the step unless it was released.
        struct Step<'s>(&'s Store, bool);
        impl Drop for Step<'_> {
            fn drop(&mut self) {
                // A savepoint that cannot be undone takes the whole batch with it (the
                // next look at the batch reports it lost), never half a step.
                if !self.1 && self.0.control(Control::Undo).is_err() {
                    let _ = self.0.control(Control::Rollback);
                }
            }
        }
        self.control(Control::Savepoint)?;
        let mut step = Step(self, false);
        let out = f(&self.tx());
        if out.is_ok() {
            self.control(Control::Release)?;
            step.1 = true;
        }
        drop(step);
        // An error inside `f` may have made SQLite roll the whole batch back.
        self.check_batch()?;
        out
    }

    /// Begins, runs `f`, then commits; anything else (an error, a failed commit, a panic)
    /// rolls back.
    fn transaction<T, E>(
        &mut self,
        write: bool,
        f: impl FnOnce(&Tx<'_>) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<StoreError>,
    {
        /// Rolls back unless the transaction was committed.
        struct Open<'s>(&'s Store, bool);
        impl Drop for Open<'_> {
            fn drop(&mut self) {
                if !self.1 {
                    let _ = self.0.control(Control::Rollback);
                }
            }
        }
        if self.in_transaction() {
            // An earlier ROLLBACK failed and left a transaction open (holding the write
            // lock): end it before beginning anew.
            self.control(Control::Rollback)
                .map_err(|e| StoreError::Sqlite(format!("cannot end an open transaction: {e}")))?;
        }
        self.control(if write {
            Control::BeginWrite
        } else {
            Control::BeginRead
        })?;
        let mut open = Open(self, false);
        let out = f(&self.tx())?;
        self.control(if write {
            Control::CommitWrite
        } else {
            Control::CommitRead
        })?;
        open.1 = true;
        drop(open);
        if write {
            self.commits += 1;
        }
        Ok(out)
    }

    /// From now on this connection's commits are not synced as they are made (`synchronous`
    /// NORMAL: a power cut may take back the newest of them, never tear one); whoever
    /// commits lazily calls [`Store::sync_upto`] before anything outside the database acts
    /// on what it committed. The engine's connection only; a no-op with `HANDOFFS_SYNC=full`,
    /// and on PostgreSQL, whose commit returns once it is flushed (`synchronous_commit`).
    pub fn commit_lazily(&mut self) -> Result<()> {
        if let Db::Lite(conn) = &self.db
            && !sync_every_commit()
        {
            conn.execute_batch("PRAGMA synchronous=NORMAL;")?;
            self.lazy = true;
        }
        Ok(())
    }

    /// How many write transactions this connection has committed so far: a mark to hand to
    /// [`Store::sync_upto`] right after a commit.
    pub fn changes_so_far(&self) -> u64 {
        self.commits
    }

    /// Makes every commit of this connection up to `mark` (from [`Store::changes_so_far`])
    /// durable: one `fdatasync` of the WAL file, unless an earlier sync already covered it
    /// (so commits made at the same moment share one: group commit). The WAL holds every
    /// commit since the last checkpoint, and a checkpoint syncs the database file itself,
    /// so this is what `synchronous=FULL` would have done at each of those commits. SQLite
    /// offers no call for it; it is hand-written on purpose (docs/ARCHITECTURE.md). Returns
    /// whether it synced.
    pub fn sync_upto(&mut self, mark: u64) -> Result<bool> {
        match self.sync_elsewhere(mark)? {
            Some(sync) => sync().map(|()| true),
            None => Ok(false),
        }
    }

    /// What [`Store::sync_upto`] would do, as a call to make on any thread (an engine going
    /// idle syncs without stalling its own thread); `None` when there is nothing to sync.
    /// The call records its mark once its sync returned.
    pub fn sync_elsewhere(
        &mut self,
        mark: u64,
    ) -> Result<Option<impl FnOnce() -> Result<()> + Send + 'static + use<>>> {
        use std::sync::atomic::Ordering;
        // What is batched is committed first: a sync covers only what is committed.
        self.flush()?;
        let synced = self.synced_changes.clone();
        if !self.lazy || synced.load(Ordering::SeqCst) >= mark {
            return Ok(None);
        }
        // The sync covers every commit made so far, not only those up to `mark`: a job whose
        // step was committed with another's finds it synced already (group commit).
        let mark = self.commits;
        let wal = sibling(&self.path, "-wal");
        let cannot = |what: &str, e: std::io::Error| {
            StoreError::Io(format!("cannot {what} {}: {e}", wal.display()))
        };
        let inode = match std::fs::metadata(&wal) {
            Ok(m) => {
                use std::os::unix::fs::MetadataExt as _;
                Some(m.ino())
            }
            // No WAL file: everything is in the database file, synced by its checkpoint.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(cannot("look at", e)),
        };
        if let Some(inode) = inode
            && self.wal.as_ref().is_none_or(|(_, ino)| *ino != inode)
        {
            let f = std::fs::File::open(&wal).map_err(|e| cannot("open", e))?;
            self.wal = Some((std::sync::Arc::new(f), inode));
        }
        let file = inode.and_then(|_| self.wal.as_ref().map(|(f, _)| f.clone()));
        Ok(Some(move || {
            if let Some(f) = file {
                f.sync_data()
                    .map_err(|e| StoreError::Io(format!("cannot sync {}: {e}", wal.display())))?;
            }
            synced.fetch_max(mark, Ordering::SeqCst);
            Ok(())
        }))
    }

    /// [`Store::write`], synced before it returns even on a lazy connection (what a reader
    /// may act on at once: a reminder in someone's inbox). Syncs everything before it too.
    pub fn write_synced<T, E>(&mut self, f: impl FnOnce(&Tx<'_>) -> Result<T, E>) -> Result<T, E>
    where
        E: From<StoreError>,
    {
        self.flush()?;
        let Db::Lite(conn) = &self.db else {
            return self.transaction(true, f);
        };
        if !self.lazy {
            return self.transaction(true, f);
        }
        conn.execute_batch("PRAGMA synchronous=FULL;")
            .map_err(StoreError::from)?;
        let out = self.transaction(true, f);
        if let Db::Lite(conn) = &self.db {
            conn.execute_batch("PRAGMA synchronous=NORMAL;")
                .map_err(StoreError::from)?;
        }
        if out.is_ok() {
            // A FULL commit syncs the WAL, and with it every earlier commit.
            self.synced_changes
                .fetch_max(self.commits, std::sync::atomic::Ordering::SeqCst);
        }
        out
    }

    /// A number that changes whenever another connection commits (SQLite's `data_version`;
    /// on PostgreSQL, the notifications other sessions' commits sent). Polling it is how a
    /// running engine notices new work at once without re-reading tables.
    pub fn data_version(&self) -> Result<i64> {
        match &self.db {
            Db::Lite(conn) => Ok(conn
                .prepare_cached("PRAGMA data_version")?
                .query_row([], |r| r.get(0))?),
            Db::Pg { session, .. } => Ok(i64::try_from(session.notified()?).unwrap_or(i64::MAX)),
        }
    }

    /// The SQLite connection (a test's look underneath).
    #[cfg(test)]
    fn lite(&self) -> &Connection {
        match &self.db {
            Db::Lite(c) => c,
            Db::Pg { .. } => panic!("not a SQLite store"),
        }
    }

    /// Whether this store is a PostgreSQL database.
    pub fn is_postgres(&self) -> bool {
        matches!(self.db, Db::Pg { .. })
    }

    /// Takes the engine lock of this SQLite database, a file lock beside it (one engine per
    /// file): `false` when another engine holds it. A PostgreSQL database has none: its
    /// engines share it by recipient leases, and always get `true`.
    pub fn take_engine_lock(&mut self) -> Result<bool> {
        if self.is_postgres() {
            return Ok(true);
        }
        let path = sibling(&self.path, ".engine");
        let mut options = std::fs::File::options();
        options.create(true).truncate(false).write(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        let file = options
            .open(&path)
            .map_err(|e| StoreError::Io(format!("cannot open {}: {e}", path.display())))?;
        match file.try_lock() {
            Ok(()) => {
                self.engine_lock = Some(file);
                Ok(true)
            }
            Err(std::fs::TryLockError::WouldBlock) => Ok(false),
            Err(std::fs::TryLockError::Error(e)) => Err(StoreError::Io(format!(
                "cannot lock {}: {e}",
                path.display()
            ))),
        }
    }

    fn with_db(db: Db, path: PathBuf) -> Store {
        Store {
            db,
            path,
            lazy: false,
            synced_changes: std::sync::Arc::default(),
            commits: 0,
            wal: None,
            batch: Batch::default(),
            engine_lock: None,
            memo: std::cell::RefCell::default(),
            single: std::cell::Cell::new(None),
        }
    }

    /// Opens the PostgreSQL database at `url`, creating its schema when `create` (and it has
    /// none); returns whether it created it.
    fn open_pg(url: &Path, create: bool) -> Result<(Store, bool)> {
        let text = url.to_string_lossy().into_owned();
        let session = pg::PgSession::connect(&text)?;
        let created = pg_schema::prepare(&session, &text, create)?;
        let store = Store::with_db(
            Db::Pg {
                session,
                open: std::cell::Cell::new(false),
                released: std::cell::Cell::new(false),
            },
            url.to_owned(),
        );
        Ok((store, created))
    }
}

/// Transaction control (see [`Store::control`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Control {
    BeginWrite,
    BeginRead,
    CommitWrite,
    CommitRead,
    Rollback,
    Savepoint,
    Release,
    Undo,
}

/// Writes a fresh page token to `token` (0600) unless a sound one is there; whether it wrote.
fn ensure_token(token: &Path) -> Result<bool> {
    // An empty or truncated token file would let anyone send through the page: replace it.
    if std::fs::read_to_string(token).is_ok_and(|t| t.trim().len() < 16) {
        std::fs::remove_file(token)
            .map_err(|e| StoreError::Io(format!("cannot replace {}: {e}", token.display())))?;
    }
    if token.exists() {
        return Ok(false);
    }
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
    opts.open(token)
        .and_then(|mut f| f.write_all(value.as_bytes()))
        .map_err(|e| StoreError::Io(format!("cannot write {}: {e}", token.display())))?;
    Ok(true)
}

fn migrate(conn: &mut Connection, from: i64) -> Result<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
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
            if target == 7 {
                migrate_7(&tx)?;
            }
            if target == 8 {
                migrate_8(&tx)?;
            }
            if target == 9 {
                migrate_9(&tx)?;
            }
            if target == 11 {
                migrate_11(&tx)?;
            }
            if target == 14 {
                for (table, column, kind) in leases::COLUMNS_14 {
                    add_column_if_missing(&tx, table, column, kind)?;
                }
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

/// Adds `column` (of type `kind`) to `table` unless it is there (a migration re-run over a
/// schema that already has it).
fn add_column_if_missing(
    tx: &rusqlite::Transaction<'_>,
    table: &str,
    column: &str,
    kind: &str,
) -> Result<()> {
    let present: bool = tx.query_row(
        "SELECT count(*) > 0 FROM pragma_table_info(?1) WHERE name = ?2",
        [table, column],
        |r| r.get(0),
    )?;
    if !present {
        tx.execute_batch(&format!("ALTER TABLE {table} ADD COLUMN {column} {kind};"))?;
    }
    Ok(())
}

/// Schema 7: each delivery's attempts and resends as columns, and the page's counts kept by
/// triggers (`delivery_counts`, counted afresh from the rows), so a snapshot costs the same
/// however many deliveries there are; the newest of a state straight from an index. Each
/// change only where it is missing.
fn migrate_7(tx: &rusqlite::Transaction<'_>) -> Result<()> {
    for column in ["attempts", "resends"] {
        add_column_if_missing(tx, "deliveries", column, "INTEGER NOT NULL DEFAULT 0")?;
    }
    tx.execute_batch(
        r"UPDATE deliveries SET
    attempts = coalesce(json_extract(record, '$.core.attempts'), 0),
    resends = coalesce(json_extract(record, '$.core.error_resends'), 0)
            + coalesce(json_extract(record, '$.core.interrupt_resends'), 0)
    WHERE json_valid(record);
CREATE TABLE IF NOT EXISTS delivery_counts (
    state TEXT PRIMARY KEY,
    n INTEGER NOT NULL,
    attempts INTEGER NOT NULL,
    resends INTEGER NOT NULL
) WITHOUT ROWID;
DELETE FROM delivery_counts;
INSERT INTO delivery_counts (state, n, attempts, resends)
    SELECT state, count(*), sum(attempts), sum(resends) FROM deliveries GROUP BY state;
CREATE TRIGGER IF NOT EXISTS deliveries_count_insert AFTER INSERT ON deliveries BEGIN
    INSERT OR IGNORE INTO delivery_counts VALUES (NEW.state, 0, 0, 0);
    UPDATE delivery_counts SET n = n + 1, attempts = attempts + NEW.attempts,
        resends = resends + NEW.resends WHERE state = NEW.state;
END;
CREATE TRIGGER IF NOT EXISTS deliveries_count_delete AFTER DELETE ON deliveries BEGIN
    UPDATE delivery_counts SET n = n - 1, attempts = attempts - OLD.attempts,
        resends = resends - OLD.resends WHERE state = OLD.state;
END;
CREATE TRIGGER IF NOT EXISTS deliveries_count_update AFTER UPDATE OF state, attempts, resends ON deliveries
    WHEN OLD.state IS NOT NEW.state OR OLD.attempts IS NOT NEW.attempts
        OR OLD.resends IS NOT NEW.resends
BEGIN
    UPDATE delivery_counts SET n = n - 1, attempts = attempts - OLD.attempts,
        resends = resends - OLD.resends WHERE state = OLD.state;
    INSERT OR IGNORE INTO delivery_counts VALUES (NEW.state, 0, 0, 0);
    UPDATE delivery_counts SET n = n + 1, attempts = attempts + NEW.attempts,
        resends = resends + NEW.resends WHERE state = NEW.state;
END;
DROP INDEX IF EXISTS deliveries_state;
CREATE INDEX deliveries_state ON deliveries (state, updated_at, seq);",
    )?;
    Ok(())
}

/// Schema 8: chains (SPEC §8.2). Each message's `chain_id`, `parent_id` and `hop` (a message
/// from before is a chain of its own, hop 0), and a `chains` row per chain that has one (made
/// when a chain starts, or when an older one is first continued). Each change only where it
/// is missing.
fn migrate_8(tx: &rusqlite::Transaction<'_>) -> Result<()> {
    for (column, kind) in [
        ("chain_id", "TEXT"),
        ("parent_id", "TEXT"),
        ("hop", "INTEGER NOT NULL DEFAULT 0"),
    ] {
        let present: bool = tx.query_row(
            "SELECT count(*) > 0 FROM pragma_table_info('messages') WHERE name = ?1",
            [column],
            |r| r.get(0),
        )?;
        if !present {
            tx.execute_batch(&format!("ALTER TABLE messages ADD COLUMN {column} {kind};"))?;
        }
    }
    tx.execute_batch(
        r"UPDATE messages SET chain_id = id WHERE chain_id IS NULL;
CREATE INDEX IF NOT EXISTS messages_chain ON messages (chain_id, seq);
CREATE TABLE IF NOT EXISTS chains (
    id TEXT PRIMARY KEY,
    origin TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('open', 'needs_human', 'cancelled')),
    hop_budget INTEGER NOT NULL,
    hops INTEGER NOT NULL DEFAULT 0,
    depth_limit INTEGER NOT NULL,
    stopped_reason TEXT,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS chains_state ON chains (state, updated_at);
CREATE TABLE IF NOT EXISTS dead_letters (
    id TEXT PRIMARY KEY,
    message_id TEXT,
    sender TEXT NOT NULL,
    recipient TEXT NOT NULL,
    body TEXT NOT NULL,
    title TEXT,
    reason TEXT NOT NULL CHECK (reason IN ('unknown_recipient', 'topology', 'failed',
        'destination_changed', 'chain_stopped')),
    detail TEXT NOT NULL,
    chain_id TEXT,
    parent_id TEXT,
    created_at INTEGER NOT NULL,
    replayed_as TEXT,
    replayed_at INTEGER,
    dropped_at INTEGER
);
CREATE INDEX IF NOT EXISTS dead_letters_message ON dead_letters (message_id);
CREATE INDEX IF NOT EXISTS dead_letters_new ON dead_letters (created_at);",
    )?;
    Ok(())
}

/// Schema 9: a chain's budget units and each spend, each only where it is missing.
fn migrate_9(tx: &rusqlite::Transaction<'_>) -> Result<()> {
    let present: bool = tx.query_row(
        "SELECT count(*) > 0 FROM pragma_table_info('chains') WHERE name = 'units'",
        [],
        |r| r.get(0),
    )?;
    if !present {
        tx.execute_batch("ALTER TABLE chains ADD COLUMN units TEXT NOT NULL DEFAULT '{}';")?;
    }
    tx.execute_batch(
        r"CREATE TABLE IF NOT EXISTS chain_spends (
    seq INTEGER PRIMARY KEY,
    chain_id TEXT NOT NULL,
    message_id TEXT NOT NULL,
    agent TEXT NOT NULL,
    unit TEXT NOT NULL,
    amount INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS chain_spends_chain ON chain_spends (chain_id, message_id);",
    )?;
    Ok(())
}

/// Schema 11: each topic post keeps the hash of its text (a repeated key must come with the
/// same text), added only where it is missing.
fn migrate_11(tx: &rusqlite::Transaction<'_>) -> Result<()> {
    let present: bool = tx.query_row(
        "SELECT count(*) > 0 FROM pragma_table_info('topic_posts') WHERE name = 'body_hash'",
        [],
        |r| r.get(0),
    )?;
    if !present {
        tx.execute_batch("ALTER TABLE topic_posts ADD COLUMN body_hash TEXT;")?;
    }
    Ok(())
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

/// A transaction, with typed queries.
#[derive(Debug)]
pub struct Tx<'a> {
    tx: TxConn<'a>,
}

/// The connection as a [`Tx`] sees it: every statement passes here, and one that may change
/// a remembered row forgets them all ([`memo::forgets`]).
#[derive(Clone, Copy, Debug)]
struct TxConn<'a> {
    conn: Conn<'a>,
    memo: &'a std::cell::RefCell<memo::Memo>,
    single: &'a std::cell::Cell<Option<u32>>,
}

impl<'a> TxConn<'a> {
    fn prepare_cached(&self, sql: &str) -> rusqlite::Result<sql::Stmt<'a>> {
        if let Some(ran) = self.single.get() {
            let read = ["SELECT ", "WITH "]
                .iter()
                .any(|p| sql.trim_start().starts_with(p))
                && !["UPDATE ", "INSERT ", "DELETE "]
                    .iter()
                    .any(|w| sql.contains(w));
            debug_assert!(
                ran == 0 && read,
                "read_one_statement's body ran more than one statement, or a write: {sql}"
            );
            self.single.set(Some(ran + 1));
        }
        if memo::forgets(sql) {
            self.memo.borrow_mut().clear();
        }
        self.conn.prepare_cached(sql)
    }

    fn is_pg(&self) -> bool {
        self.conn.is_pg()
    }

    fn session_pid(&self) -> Option<i64> {
        self.conn.session_pid()
    }
}

impl Tx<'_> {
    /// Runs one statement, prepared once per connection (the statement cache).
    fn exec(&self, sql: &str, params: impl sql::Params) -> Result<usize> {
        Ok(self.tx.prepare_cached(sql)?.execute(params)?)
    }

    /// `key`'s row from `table` of this transaction's memo, or `load`ed and remembered.
    fn remembered<K, V: Clone>(
        &self,
        table: impl Fn(&mut memo::Memo) -> &mut std::collections::HashMap<K, V>,
        key: K,
        load: impl FnOnce() -> Result<V>,
    ) -> Result<V>
    where
        K: std::hash::Hash + Eq,
    {
        if let Some(v) = table(&mut self.tx.memo.borrow_mut()).get(&key) {
            return Ok(v.clone());
        }
        let v = load()?;
        table(&mut self.tx.memo.borrow_mut()).insert(key, v.clone());
        Ok(v)
    }

    /// Reads one row through a cached statement.
    fn row<T>(
        &self,
        sql: &str,
        params: impl sql::Params,
        f: impl FnOnce(&sql::Row<'_, '_>) -> rusqlite::Result<T>,
    ) -> rusqlite::Result<T> {
        self.tx.prepare_cached(sql)?.query_row(params, f)
    }

    /// SQLite's quick integrity check: `ok`, or the first problem it found.
    pub fn quick_check(&self) -> Result<String> {
        // PostgreSQL checks its own pages; what can make it lose a commit handoffs counted
        // on is how the server runs.
        let check = if self.tx.is_pg() {
            "SELECT CASE
               WHEN current_setting('fsync') <> 'on'
                 THEN 'the server runs with fsync off: a crash can lose or tear commits'
               WHEN current_setting('full_page_writes') <> 'on'
                 THEN 'the server runs with full_page_writes off: a crash can tear pages'
               WHEN current_setting('synchronous_commit') = 'off'
                 THEN 'commits are not flushed before they return (synchronous_commit off)'
               ELSE 'ok' END"
        } else {
            "PRAGMA quick_check"
        };
        Ok(self.tx.prepare_cached(check)?.query_row([], |r| r.get(0))?)
    }
}

/// Which table an id prefix is resolved in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdTable {
    Messages,
    Deliveries,
}

/// Milliseconds since the epoch, as stored.
pub fn millis(m: Millis) -> i64 {
    i64::try_from(m.0).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::{OPEN_WORK, WorkState};

    /// What a transaction read is remembered only while nothing can have changed it: a
    /// write of this transaction, a step undone and another connection's commit each make
    /// the next read go to the database again.
    #[test]
    fn remembered_rows_never_outlive_what_can_change_them() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("h.db");
        let (mut store, _) = super::Store::init(&db).unwrap();
        let (mut other, _) = super::Store::init(&db).unwrap();
        let (one, two) = (serde_json::json!(1), serde_json::json!(2));
        // Within one transaction: read, write, read again.
        let seen: Vec<Option<serde_json::Value>> = store
            .write(|tx| {
                let before = tx.config("k")?;
                let again = tx.config("k")?;
                tx.set_config("k", &one)?;
                Ok::<_, super::StoreError>(vec![before, again, tx.config("k")?])
            })
            .unwrap();
        assert_eq!(seen, vec![None, None, Some(one.clone())]);
        tx_sees(&mut store, Some(&one));
        // Another connection's commit, between two transactions of this one.
        other.write(|tx| tx.set_config("k", &two)).unwrap();
        tx_sees(&mut store, Some(&two));
        // In a batch: a step that wrote and was undone leaves nothing remembered of it.
        store.batch_steps(true).unwrap();
        tx_sees(&mut store, Some(&two));
        let undone: Result<(), super::StoreError> = store.write(|tx| {
            tx.set_config("k", &one)?;
            assert_eq!(tx.config("k")?, Some(one.clone()));
            Err(super::StoreError::Sqlite("undo".to_owned()))
        });
        assert!(undone.is_err());
        tx_sees(&mut store, Some(&two));
        store.batch_steps(false).unwrap();
        other.write(|tx| tx.set_config("k", &one)).unwrap();
        tx_sees(&mut store, Some(&one));
        // And what it is for: inside a batch, a row read stays remembered across the steps'
        // savepoints and their own statements. A change made behind the memo's back (the
        // test's raw statement on the same connection, which nothing else could make) is
        // not seen until the batch ends.
        store.batch_steps(true).unwrap();
        store
            .write(|tx| {
                assert_eq!(tx.config("k")?, Some(one.clone()));
                tx.exec(
                    "UPDATE deliveries SET due_at = due_at WHERE message_id = ?1",
                    super::params!["none"],
                )?;
                tx.event(0, None, "note", "a step's own line")?;
                Ok::<_, super::StoreError>(())
            })
            .unwrap();
        store
            .lite()
            .execute("UPDATE config SET value = '3' WHERE key = 'k'", [])
            .unwrap();
        tx_sees(&mut store, Some(&one));
        store.batch_steps(false).unwrap();
        tx_sees(&mut store, Some(&serde_json::json!(3)));
    }

    /// `read_one_statement` takes one read: a debug build (every test) stops a body that
    /// runs two statements, or a write.
    #[test]
    #[cfg(debug_assertions)]
    fn read_one_statement_is_held_to_one_read() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _) = super::Store::init(&dir.path().join("h.db")).unwrap();
        let one: Option<serde_json::Value> = store.read_one_statement(|tx| tx.config("a")).unwrap();
        assert_eq!(one, None);
        for (what, two) in [("two reads", false), ("a write", true)] {
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _: Result<(), super::StoreError> = store.read_one_statement(|tx| {
                    if two {
                        tx.set_config("a", &serde_json::json!(1))
                    } else {
                        tx.config("a")?;
                        tx.config("b").map(|_| ())
                    }
                });
            }));
            let said = ran.expect_err(what);
            let said = said.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(
                said.contains("read_one_statement's body ran more than one statement, or a write"),
                "{what}: {said}"
            );
        }
    }

    /// What a read transaction of `store` finds under the key `k`, checked.
    fn tx_sees(store: &mut super::Store, v: Option<&serde_json::Value>) {
        let read: Option<serde_json::Value> = store.read(|tx| tx.config("k")).unwrap();
        assert_eq!(read.as_ref(), v);
    }

    /// A transaction whose body fails or panics leaves nothing behind, and the connection
    /// takes the next one.
    #[test]
    fn a_failed_or_panicking_transaction_is_rolled_back() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _) = super::Store::init(&dir.path().join("h.db")).unwrap();
        let v = serde_json::json!(1);
        let failed: Result<(), super::StoreError> = store.write(|tx| {
            tx.set_config("k", &v)?;
            Err(super::StoreError::Sqlite("no".to_owned()))
        });
        assert!(failed.is_err());
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _: Result<(), super::StoreError> = store.write(|tx| {
                tx.set_config("k", &v)?;
                panic!("mid-transaction")
            });
        }));
        assert!(panicked.is_err());
        assert!(store.lite().is_autocommit(), "no transaction left open");
        // One left open anyway (a ROLLBACK that failed) is ended before the next begins.
        store.lite().execute_batch("BEGIN").unwrap();
        let _: Option<serde_json::Value> = store.read(|tx| tx.config("k")).unwrap();
        assert!(store.lite().is_autocommit());
        let read: Option<serde_json::Value> = store.read(|tx| tx.config("k")).unwrap();
        assert_eq!(read, None, "nothing of either was committed");
        store.write(|tx| tx.set_config("k", &v)).unwrap();
        assert_eq!(store.read(|tx| tx.config("k")).unwrap(), Some(v));
    }

    /// Batched steps: each is whole or absent (a failing or panicking one leaves the others),
    /// other connections see none of them before the flush, a read inside sees them, a sync
    /// flushes first and covers every step, and a run record is committed at once.
    #[test]
    fn batched_steps_commit_together_and_a_failed_step_alone_is_undone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.db");
        let (mut store, _) = super::Store::init(&path).unwrap();
        let mut other = super::Store::open(&path).unwrap();
        let config = |s: &mut super::Store, k: &str| -> Option<serde_json::Value> {
            s.read(|tx| tx.config(k)).unwrap()
        };
        store.commit_lazily().unwrap();
        store.batch_steps(true).unwrap();
        store
            .write(|tx| tx.set_config("a", &serde_json::json!(1)))
            .unwrap();
        let failed: Result<(), super::StoreError> = store.write(|tx| {
            tx.set_config("b", &serde_json::json!(2))?;
            Err(super::StoreError::Sqlite("no".to_owned()))
        });
        assert!(failed.is_err());
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _: Result<(), super::StoreError> = store.write(|tx| {
                tx.set_config("c", &serde_json::json!(3))?;
                panic!("mid-step")
            });
        }));
        assert!(panicked.is_err());
        store
            .write(|tx| tx.set_config("d", &serde_json::json!(4)))
            .unwrap();
        assert_eq!(config(&mut store, "a"), Some(serde_json::json!(1)));
        assert_eq!(
            config(&mut other, "a"),
            None,
            "not committed before the flush"
        );
        let mark = store.changes_so_far();
        store.sync_upto(mark).unwrap();
        for (k, v) in [("a", Some(1)), ("b", None), ("c", None), ("d", Some(4))] {
            assert_eq!(
                config(&mut other, k),
                v.map(|v| serde_json::json!(v)),
                "{k}"
            );
        }
        // What another process acts on is committed at once, with the batch before it.
        store
            .write(|tx| tx.set_config("e", &serde_json::json!(5)))
            .unwrap();
        store
            .write_shared(|tx| tx.set_config("f", &serde_json::json!(6)))
            .unwrap();
        assert_eq!(config(&mut other, "e"), Some(serde_json::json!(5)));
        assert_eq!(config(&mut other, "f"), Some(serde_json::json!(6)));
        store.batch_steps(false).unwrap();
        assert!(store.lite().is_autocommit());
        // Abandoned (an engine dropped mid-run): what is open is rolled back, as a crash
        // would leave it, and writes commit on their own again.
        store.batch_steps(true).unwrap();
        store
            .write(|tx| tx.set_config("g", &serde_json::json!(7)))
            .unwrap();
        store.abandon_batch();
        assert!(store.lite().is_autocommit());
        assert_eq!(config(&mut other, "g"), None);
        store
            .write(|tx| tx.set_config("h", &serde_json::json!(8)))
            .unwrap();
        assert_eq!(config(&mut other, "h"), Some(serde_json::json!(8)));
    }

    /// A batch SQLite rolled back (an I/O error, a full disk) is lost: its steps' writers
    /// took them for committed, so no flush or sync may report success on that connection.
    #[test]
    fn a_lost_batch_fails_every_later_flush_and_sync() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _) = super::Store::init(&dir.path().join("h.db")).unwrap();
        store.commit_lazily().unwrap();
        store.batch_steps(true).unwrap();
        store
            .write(|tx| tx.set_config("a", &serde_json::json!(1)))
            .unwrap();
        store.lite().execute_batch("ROLLBACK").unwrap();
        let e = store.flush().unwrap_err().to_string();
        assert!(e.contains("were not committed"), "{e}");
        assert!(store.sync_upto(store.changes_so_far()).is_err());
        assert!(store.flush().is_err(), "for good");
    }

    /// A lazy connection syncs once for every write commit made since its last sync, and
    /// not again for the same ones; reads are no commits.
    #[test]
    fn sync_upto_syncs_each_write_commit_once() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _) = super::Store::init(&dir.path().join("h.db")).unwrap();
        store.commit_lazily().unwrap();
        let start = store.changes_so_far();
        store
            .write(|tx| tx.set_config("k", &serde_json::json!(1)))
            .unwrap();
        let mark = store.changes_so_far();
        assert_eq!(mark, start + 1);
        let _: Option<serde_json::Value> = store.read(|tx| tx.config("k")).unwrap();
        assert_eq!(store.changes_so_far(), mark, "a read is no commit");
        // With HANDOFFS_SYNC=full every commit syncs itself: sync_upto has nothing to do.
        let lazy = !super::sync_every_commit();
        assert_eq!(
            store.sync_upto(mark).unwrap(),
            lazy,
            "the first sync covering it"
        );
        assert!(!store.sync_upto(mark).unwrap(), "already covered");
        // A synced write leaves nothing for sync_upto either.
        store
            .write_synced(|tx| tx.set_config("k", &serde_json::json!(2)))
            .unwrap();
        assert!(!store.sync_upto(store.changes_so_far()).unwrap());
    }

    /// The queued states in SQL are the model's queued states, the partial indexes of schema
    /// 6 hold that very text, and the engine's looks for due deliveries use those indexes
    /// (a query whose predicate differs by a word would scan the table instead).
    #[test]
    fn the_due_looks_use_the_partial_indexes() {
        use model::StateKind;
        let named: Vec<String> = [
            StateKind::Waiting,
            StateKind::Busy,
            StateKind::OwnerRejected,
        ]
        .iter()
        .map(|s| format!("'{}'", s.as_str()))
        .collect();
        assert_eq!(queued!(), format!("({})", named.join(", ")));
        assert_eq!(super::migrations::STEPS[5].matches(queued!()).count(), 2);
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = super::Store::init(&dir.path().join("h.db")).unwrap();
        let plan = |sql: &str| -> String {
            let mut st = store
                .lite()
                .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
                .unwrap();
            let n = st.parameter_count();
            let rows: Vec<String> = st
                .query_map(rusqlite::params_from_iter(vec![0_i64; n]), |r| {
                    r.get::<_, String>(3)
                })
                .unwrap()
                .map(Result::unwrap)
                .collect();
            rows.join("; ")
        };
        for (sql, index) in [
            (super::deliveries::DUE_SQL, "deliveries_due"),
            (super::deliveries::NEXT_DUE_SQL, "deliveries_due"),
            (super::deliveries::DUE_FOR_SQL, "deliveries_recipient_due"),
        ] {
            let p = plan(sql);
            assert!(p.contains(&format!("USING INDEX {index}")), "{sql}\n→ {p}");
        }
    }

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
