//! The task ledger (SPEC §8.1): resumable task briefs for one workspace, one writer lease at a
//! time, and a finite handoff budget. It lives in the project, in `<root>/.handoffs/ledger.sqlite3`
//! (the root is `$HANDOFFS_ROOT`, else the nearest folder with a `.git` file or folder), beside
//! a `.gitignore` so it is never committed.
//!
//! Every operation is one `BEGIN IMMEDIATE` transaction, so two processes racing for the lease
//! are serialised by SQLite: exactly one wins. Each transaction first sweeps a lease that has
//! run out: its task goes back to the queue with a warning to inspect the workspace, and its
//! token stops working (the fence), so a holder that wakes up late cannot write over whoever
//! claimed next.

use model::Policy;
use model::chain::{Amount, Budget};
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::{ServiceError, check_agent_id};

pub const LEASE_MINUTES_DEFAULT: i64 = 90;
pub const LEASE_MINUTES_MAX: i64 = 24 * 60;
pub const HANDOFF_CAP_DEFAULT: i64 = 4;
pub const HANDOFF_CAP_MAX: i64 = 16;
pub const TITLE_MAX: usize = 200;
pub const TEXT_MAX: usize = 4_000;
pub const GOAL_MAX: usize = 20_000;
pub const FILES_MAX: usize = 1_000;
pub const PATH_MAX: usize = 1_000;
const WORKSPACE: &str = "workspace";

type Result<T> = std::result::Result<T, ServiceError>;

fn usage<T>(m: impl Into<String>) -> Result<T> {
    Err(ServiceError::Usage(m.into()))
}
fn refused<T>(m: impl Into<String>) -> Result<T> {
    Err(ServiceError::Refused(m.into()))
}
fn db_err(e: rusqlite::Error) -> ServiceError {
    ServiceError::Store(crate::store::StoreError::from(e))
}

/// Finds the project root: `$HANDOFFS_ROOT`, else the nearest ancestor of `start` that holds a
/// `.git` file or folder.
pub fn find_root(start: &Path) -> Result<PathBuf> {
    if let Some(root) = std::env::var_os("HANDOFFS_ROOT").filter(|v| !v.is_empty()) {
        let root = PathBuf::from(root);
        if !root.is_dir() {
            return refused(format!("HANDOFFS_ROOT={} is not a folder", root.display()));
        }
        return Ok(root);
    }
    let start = std::fs::canonicalize(start).unwrap_or_else(|_| start.to_owned());
    for dir in start.ancestors() {
        if dir.join(".git").exists() {
            return Ok(dir.to_owned());
        }
    }
    refused(format!(
        "no project root above {}: run inside a git repository or set HANDOFFS_ROOT",
        start.display()
    ))
}

/// A task brief.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Task {
    pub id: String,
    pub title: String,
    pub goal: String,
    pub constraints: Option<String>,
    /// queued, claimed, needs_human or done.
    pub state: String,
    pub created_by: String,
    /// Who the brief is queued for (None: anyone).
    pub target_agent: Option<String>,
    /// The lease holder while claimed; the last holder otherwise.
    pub owner: Option<String>,
    pub summary: Option<String>,
    pub next_action: Option<String>,
    pub changed_files: Vec<String>,
    pub handoff_cap: i64,
    pub handoffs_used: i64,
    pub created_at: i64,
    pub updated_at: i64,
}

/// An entry of a task's append-only history.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TaskEvent {
    pub seq: i64,
    pub task_id: String,
    pub at: i64,
    pub actor: String,
    pub kind: String,
    pub detail: String,
}

/// The workspace's writer lease.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Lease {
    pub task_id: String,
    pub holder: String,
    /// The holder's secret: shown only to the claim that took it.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub token: String,
    pub acquired_at: i64,
    pub expires_at: i64,
}

/// What a claim returns: the task, its lease, and warnings (a stale lease swept on the way).
#[derive(Clone, Debug, Serialize)]
pub struct Claimed {
    pub task: Task,
    pub lease: Lease,
    pub warnings: Vec<String>,
}

/// A task with its history and the workspace lease.
#[derive(Clone, Debug, Serialize)]
pub struct TaskDetail {
    pub task: Task,
    pub events: Vec<TaskEvent>,
    pub lease: Option<Lease>,
}

/// What passing a brief did.
#[derive(Clone, Debug, Serialize)]
pub struct Passed {
    pub task: Task,
    pub handoffs_left: i64,
}

/// The ledger of one workspace.
#[derive(Debug)]
pub struct Ledger {
    conn: Connection,
    path: PathBuf,
    now: fn() -> i64,
    /// Warnings from the last operation (a stale lease swept on the way).
    warnings: Vec<String>,
}

fn now_ms() -> i64 {
    crate::store::millis(crate::clock::now())
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS tasks (
  id TEXT PRIMARY KEY,
  title TEXT NOT NULL,
  goal TEXT NOT NULL,
  constraints TEXT,
  state TEXT NOT NULL CHECK (state IN ('queued','claimed','needs_human','done')),
  created_by TEXT NOT NULL,
  target_agent TEXT,
  owner TEXT,
  summary TEXT,
  next_action TEXT,
  changed_files TEXT NOT NULL DEFAULT '[]',
  handoff_cap INTEGER NOT NULL CHECK (handoff_cap >= 0),
  handoffs_used INTEGER NOT NULL DEFAULT 0 CHECK (handoffs_used >= 0),
  created_at INTEGER NOT NULL,
  updated_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS task_events (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  task_id TEXT NOT NULL REFERENCES tasks(id),
  at INTEGER NOT NULL,
  actor TEXT NOT NULL,
  kind TEXT NOT NULL,
  detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS task_events_task ON task_events(task_id, seq);
CREATE TABLE IF NOT EXISTS leases (
  workspace TEXT PRIMARY KEY,
  task_id TEXT NOT NULL REFERENCES tasks(id),
  holder TEXT NOT NULL,
  token TEXT NOT NULL,
  acquired_at INTEGER NOT NULL,
  expires_at INTEGER NOT NULL
);
-- The history is append-only.
CREATE TRIGGER IF NOT EXISTS task_events_no_update BEFORE UPDATE ON task_events
  BEGIN SELECT RAISE(ABORT, 'task history is append-only'); END;
CREATE TRIGGER IF NOT EXISTS task_events_no_delete BEFORE DELETE ON task_events
  BEGIN SELECT RAISE(ABORT, 'task history is append-only'); END;
PRAGMA user_version = 1;
";

fn private_file(path: &Path, contents: Option<&[u8]>) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    match opts.open(path) {
        Ok(mut f) => {
            if let Some(c) = contents {
                f.write_all(c)?;
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

fn check_text(what: &str, s: &str, max: usize, required: bool) -> Result<()> {
    super::check_no_nul(what, s)?;
    if required && s.trim().is_empty() {
        return usage(format!("{what} is empty"));
    }
    if s.chars().count() > max {
        return usage(format!("{what} is longer than {max} characters"));
    }
    Ok(())
}

fn check_task_id(id: &str) -> Result<()> {
    if id.is_empty() || id.len() > super::ID_CHARS_MAX {
        return usage("a task id must be 1 to 200 characters");
    }
    Ok(())
}

fn row_task(r: &rusqlite::Row<'_>) -> rusqlite::Result<Task> {
    let files: String = r.get("changed_files")?;
    Ok(Task {
        id: r.get("id")?,
        title: r.get("title")?,
        goal: r.get("goal")?,
        constraints: r.get("constraints")?,
        state: r.get("state")?,
        created_by: r.get("created_by")?,
        target_agent: r.get("target_agent")?,
        owner: r.get("owner")?,
        summary: r.get("summary")?,
        next_action: r.get("next_action")?,
        changed_files: serde_json::from_str(&files).unwrap_or_default(),
        handoff_cap: r.get("handoff_cap")?,
        handoffs_used: r.get("handoffs_used")?,
        created_at: r.get("created_at")?,
        updated_at: r.get("updated_at")?,
    })
}

fn row_lease(r: &rusqlite::Row<'_>) -> rusqlite::Result<Lease> {
    Ok(Lease {
        task_id: r.get("task_id")?,
        holder: r.get("holder")?,
        token: r.get("token")?,
        acquired_at: r.get("acquired_at")?,
        expires_at: r.get("expires_at")?,
    })
}

fn task(tx: &rusqlite::Transaction<'_>, id: &str) -> Result<Task> {
    tx.query_row("SELECT * FROM tasks WHERE id = ?1", [id], row_task)
        .optional()
        .map_err(db_err)?
        .ok_or_else(|| ServiceError::NotFound(format!("no task {id:?}")))
}

fn lease(tx: &rusqlite::Transaction<'_>) -> Result<Option<Lease>> {
    tx.query_row(
        "SELECT * FROM leases WHERE workspace = ?1",
        [WORKSPACE],
        row_lease,
    )
    .optional()
    .map_err(db_err)
}

fn event(
    tx: &rusqlite::Transaction<'_>,
    task_id: &str,
    at: i64,
    actor: &str,
    kind: &str,
    detail: &str,
) -> Result<()> {
    tx.execute(
        "INSERT INTO task_events (task_id, at, actor, kind, detail) VALUES (?1, ?2, ?3, ?4, ?5)",
        params![task_id, at, actor, kind, detail],
    )
    .map_err(db_err)?;
    Ok(())
}

use crate::text::when;

/// A lease that ran out returns its task to the queue, with a warning in the task's history.
/// Returns the warning, if there was one.
fn sweep(tx: &rusqlite::Transaction<'_>, now: i64) -> Result<Option<String>> {
    let Some(l) = lease(tx)? else {
        return Ok(None);
    };
    if l.expires_at > now {
        return Ok(None);
    }
    tx.execute("DELETE FROM leases WHERE workspace = ?1", [WORKSPACE])
        .map_err(db_err)?;
    let warning = format!(
        "{}'s lease on task {} ran out at {}: the task is back in the queue, open to any \
         agent; inspect the workspace before continuing (its changes may be half-done)",
        l.holder,
        l.task_id,
        when(l.expires_at)
    );
    // Back in the queue for anyone: the agent it was queued for may be the one that stopped.
    tx.execute(
        "UPDATE tasks SET state = 'queued', target_agent = NULL, updated_at = ?2
         WHERE id = ?1 AND state = 'claimed'",
        params![l.task_id, now],
    )
    .map_err(db_err)?;
    event(tx, &l.task_id, now, "handoffs", "lease_expired", &warning)?;
    Ok(Some(warning))
}

/// Checks that `agent` holds the workspace lease on `task_id` with `token`.
fn fence(tx: &rusqlite::Transaction<'_>, task_id: &str, agent: &str, token: &str) -> Result<Lease> {
    match lease(tx)? {
        Some(l) if l.task_id == task_id && l.holder == agent && l.token == token => Ok(l),
        Some(l) if l.task_id == task_id && l.holder == agent => refused(format!(
            "that lease token is not the current one for task {task_id} (a mistyped token, or \
             one from an earlier claim)"
        )),
        Some(l) if l.task_id == task_id => refused(format!(
            "task {task_id} is leased by {}, not {agent}",
            l.holder
        )),
        _ => refused(format!(
            "{agent} holds no lease on task {task_id}; claim it first (a lease that ran out \
             returns its task to the queue)"
        )),
    }
}

impl Ledger {
    /// Opens (creating if needed) the ledger of the project rooted at `root`.
    pub fn open_root(root: &Path) -> Result<Ledger> {
        let dir = root.join(".handoffs");
        if !dir.exists() {
            std::fs::create_dir_all(&dir).map_err(|e| {
                ServiceError::Refused(format!("cannot create {}: {e}", dir.display()))
            })?;
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
            }
        }
        let io = |e: std::io::Error| ServiceError::Refused(format!("{}: {e}", dir.display()));
        // Everything in the state folder stays out of git.
        private_file(
            &dir.join(".gitignore"),
            Some(b"# handoffs state: never commit\n*\n"),
        )
        .map_err(io)?;
        let path = dir.join("ledger.sqlite3");
        private_file(&path, None).map_err(io)?;
        Ledger::open(&path)
    }

    /// Opens (creating the schema if needed) a ledger file.
    pub fn open(path: &Path) -> Result<Ledger> {
        let conn = crate::store::connect(path, true).map_err(|e| {
            let why = match e {
                crate::store::StoreError::Corrupt { detail, .. } => detail,
                other => other.to_string(),
            };
            ServiceError::Refused(format!("cannot open the ledger {}: {why}", path.display()))
        })?;
        let corrupt = |e: String| {
            ServiceError::Refused(format!("{} is not a readable ledger: {e}", path.display()))
        };
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(|e| corrupt(e.to_string()))?;
        crate::store::settle(&conn).map_err(|e| corrupt(e.to_string()))?;
        if version == 0 {
            let mut conn = conn;
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(db_err)?;
            tx.execute_batch(SCHEMA)
                .map_err(|e| corrupt(e.to_string()))?;
            tx.commit().map_err(db_err)?;
            return Ok(Ledger {
                conn,
                path: path.to_owned(),
                now: now_ms,
                warnings: Vec::new(),
            });
        }
        if version > 1 {
            return refused(format!(
                "{} was written by a newer handoffs (ledger schema {version})",
                path.display()
            ));
        }
        Ok(Ledger {
            conn,
            path: path.to_owned(),
            now: now_ms,
            warnings: Vec::new(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The warnings of the last operation: a lease that ran out and was swept on the way.
    pub fn take_warnings(&mut self) -> Vec<String> {
        std::mem::take(&mut self.warnings)
    }

    /// Replaces the clock (tests).
    #[must_use]
    pub fn with_clock(mut self, now: fn() -> i64) -> Ledger {
        self.now = now;
        self
    }

    fn write<T>(
        &mut self,
        f: impl FnOnce(&rusqlite::Transaction<'_>, i64, Option<String>) -> Result<T>,
    ) -> Result<T> {
        let now = (self.now)();
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(db_err)?;
        self.warnings.clear();
        let warning = sweep(&tx, now)?;
        let swept = warning.is_some();
        self.warnings.extend(warning.clone());
        match f(&tx, now, warning) {
            Ok(v) => {
                tx.commit().map_err(db_err)?;
                Ok(v)
            }
            Err(e) => {
                // Nothing of a refused operation is kept, but the sweep of a stale lease is.
                drop(tx);
                if swept {
                    let tx = self
                        .conn
                        .transaction_with_behavior(TransactionBehavior::Immediate)
                        .map_err(db_err)?;
                    sweep(&tx, now)?;
                    tx.commit().map_err(db_err)?;
                }
                Err(e)
            }
        }
    }

    pub fn create(
        &mut self,
        agent: &str,
        title: &str,
        goal: &str,
        constraints: Option<&str>,
        target_agent: Option<&str>,
        handoff_cap: Option<i64>,
    ) -> Result<Task> {
        check_agent_id(agent)?;
        check_text("the title", title, TITLE_MAX, true)?;
        check_text("the goal", goal, GOAL_MAX, true)?;
        if let Some(c) = constraints {
            check_text("the constraints", c, GOAL_MAX, false)?;
        }
        if let Some(t) = target_agent {
            check_agent_id(t)?;
        }
        let cap = handoff_cap.unwrap_or(HANDOFF_CAP_DEFAULT);
        if !(0..=HANDOFF_CAP_MAX).contains(&cap) {
            return usage(format!(
                "the handoff budget must be 0 to {HANDOFF_CAP_MAX} passes"
            ));
        }
        let id = crate::clock::new_id();
        self.write(|tx, now, _| {
            tx.execute(
                "INSERT INTO tasks (id, title, goal, constraints, state, created_by, target_agent,
                   handoff_cap, created_at, updated_at)
                 VALUES (?1, ?2, ?3, ?4, 'queued', ?5, ?6, ?7, ?8, ?8)",
                params![id, title, goal, constraints, agent, target_agent, cap, now],
            )
            .map_err(db_err)?;
            event(
                tx,
                &id,
                now,
                agent,
                "created",
                &format!(
                    "{title} (budget {cap} handoffs{})",
                    target_agent
                        .map(|t| format!(", for {t}"))
                        .unwrap_or_default()
                ),
            )?;
            task(tx, &id)
        })
    }

    /// Resolves a task id or a unique prefix of at least 6 characters.
    fn resolve(&mut self, given: &str) -> Result<String> {
        check_task_id(given)?;
        let mut stmt = self
            .conn
            .prepare_cached("SELECT id FROM tasks WHERE id >= ?1 AND id < ?1 || x'ffff' LIMIT 3")
            .map_err(db_err)?;
        let ids: Vec<String> = stmt
            .query_map([given], |r| r.get(0))
            .map_err(db_err)?
            .collect::<rusqlite::Result<_>>()
            .map_err(db_err)?;
        match ids.as_slice() {
            [one] if one == given => Ok(one.clone()),
            _ if given.len() < super::ID_PREFIX_MIN => usage(format!(
                "{given:?} is too short: give the full task id or at least 6 characters"
            )),
            [one] => Ok(one.clone()),
            [] => Err(ServiceError::NotFound(format!("no task {given:?}"))),
            _ => usage(format!("{given:?} matches more than one task")),
        }
    }

    /// Takes the workspace's writer lease for `task_id`.
    pub fn claim(&mut self, agent: &str, task_id: &str, minutes: Option<i64>) -> Result<Claimed> {
        check_agent_id(agent)?;
        let minutes = minutes.unwrap_or(LEASE_MINUTES_DEFAULT);
        if !(1..=LEASE_MINUTES_MAX).contains(&minutes) {
            return usage(format!("a lease lasts 1 to {LEASE_MINUTES_MAX} minutes"));
        }
        let id = self.resolve(task_id)?;
        #[cfg(feature = "planted-bugs")]
        if crate::planted(crate::Plant::LeaseRace) {
            return self.claim_unguarded(agent, &id, minutes);
        }
        self.write(|tx, now, warning| {
            let t = task(tx, &id)?;
            if let Some(l) = lease(tx)? {
                if l.holder == agent && l.task_id == id {
                    return refused(format!(
                        "{agent} already holds the lease on task {id} (until {}); renew it instead",
                        when(l.expires_at)
                    ));
                }
                return refused(format!(
                    "the workspace is leased by {} for task {} until {}: one writer at a time",
                    l.holder,
                    l.task_id,
                    when(l.expires_at)
                ));
            }
            check_claimable(&t, agent)?;
            let mut warnings: Vec<String> = warning.into_iter().collect();
            let last: Option<(String, String)> = tx
                .query_row(
                    "SELECT kind, detail FROM task_events WHERE task_id = ?1 ORDER BY seq DESC LIMIT 1",
                    [&id],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .optional()
                .map_err(db_err)?;
            if let Some((kind, detail)) = last
                && kind == "lease_expired"
                && !warnings.contains(&detail)
            {
                warnings.push(detail);
            }
            let l = Lease {
                task_id: id.clone(),
                holder: agent.to_owned(),
                token: crate::clock::new_id(),
                acquired_at: now,
                expires_at: now + minutes * 60_000,
            };
            insert_lease(tx, &l)?;
            tx.execute(
                "UPDATE tasks SET state = 'claimed', owner = ?2, updated_at = ?3 WHERE id = ?1",
                params![id, agent, now],
            )
            .map_err(db_err)?;
            event(
                tx,
                &id,
                now,
                agent,
                "claimed",
                &format!("lease until {}", when(l.expires_at)),
            )?;
            Ok(Claimed {
                task: task(tx, &id)?,
                lease: l,
                warnings,
            })
        })
    }

    /// The planted lease race: the check and the take are two transactions.
    #[cfg(feature = "planted-bugs")]
    fn claim_unguarded(&mut self, agent: &str, id: &str, minutes: i64) -> Result<Claimed> {
        let now = (self.now)();
        let free = self
            .conn
            .query_row("SELECT count(*) FROM leases", [], |r| r.get::<_, i64>(0))
            .map_err(db_err)?
            == 0;
        std::thread::sleep(std::time::Duration::from_millis(300));
        if !free {
            return refused("the workspace is leased: one writer at a time");
        }
        let l = Lease {
            task_id: id.to_owned(),
            holder: agent.to_owned(),
            token: crate::clock::new_id(),
            acquired_at: now,
            expires_at: now + minutes * 60_000,
        };
        self.conn
            .execute(
                "INSERT OR REPLACE INTO leases (workspace, task_id, holder, token, acquired_at, expires_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![WORKSPACE, l.task_id, l.holder, l.token, l.acquired_at, l.expires_at],
            )
            .map_err(db_err)?;
        self.conn
            .execute(
                "UPDATE tasks SET state = 'claimed', owner = ?2 WHERE id = ?1",
                params![id, agent],
            )
            .map_err(db_err)?;
        let t = self
            .conn
            .query_row("SELECT * FROM tasks WHERE id = ?1", [id], row_task)
            .map_err(db_err)?;
        Ok(Claimed {
            task: t,
            lease: l,
            warnings: vec![],
        })
    }

    /// Extends the holder's lease.
    pub fn renew(
        &mut self,
        agent: &str,
        task_id: &str,
        token: &str,
        minutes: Option<i64>,
    ) -> Result<Lease> {
        check_agent_id(agent)?;
        let minutes = minutes.unwrap_or(LEASE_MINUTES_DEFAULT);
        if !(1..=LEASE_MINUTES_MAX).contains(&minutes) {
            return usage(format!("a lease lasts 1 to {LEASE_MINUTES_MAX} minutes"));
        }
        let id = self.resolve(task_id)?;
        self.write(|tx, now, _| {
            let mut l = fence(tx, &id, agent, token)?;
            l.expires_at = now + minutes * 60_000;
            tx.execute(
                "UPDATE leases SET expires_at = ?2 WHERE workspace = ?1",
                params![WORKSPACE, l.expires_at],
            )
            .map_err(db_err)?;
            event(
                tx,
                &id,
                now,
                agent,
                "renewed",
                &format!("lease until {}", when(l.expires_at)),
            )?;
            Ok(l)
        })
    }

    /// Hands the brief on: records the summary, next action and changed files, releases the
    /// lease, queues the task for `target_agent` and spends one handoff. With the budget spent,
    /// the brief is still recorded but the task stops in `needs_human`.
    #[allow(clippy::too_many_arguments)] // one per field of the brief; a struct would only rename them
    pub fn pass(
        &mut self,
        agent: &str,
        task_id: &str,
        token: &str,
        summary: &str,
        next_action: &str,
        changed_files: &[String],
        target_agent: &str,
    ) -> Result<Passed> {
        check_agent_id(agent)?;
        check_agent_id(target_agent)?;
        check_text("the summary", summary, TEXT_MAX, true)?;
        check_text("the next action", next_action, TEXT_MAX, true)?;
        check_files(changed_files)?;
        let id = self.resolve(task_id)?;
        let outcome = self.write(|tx, now, _| {
            fence(tx, &id, agent, token)?;
            let t = task(tx, &id)?;
            let files = merge_files(&t.changed_files, changed_files);
            tx.execute("DELETE FROM leases WHERE workspace = ?1", [WORKSPACE])
                .map_err(db_err)?;
            let spent = handoff_budget(&t)
                .spend(
                    &[(HANDOFFS.to_owned(), Amount::whole(1))],
                    &Policy::default(),
                )
                .is_err();
            let state = if spent { "needs_human" } else { "queued" };
            tx.execute(
                "UPDATE tasks SET state = ?2, summary = ?3, next_action = ?4, changed_files = ?5,
                   target_agent = ?6, handoffs_used = handoffs_used + ?7, updated_at = ?8
                 WHERE id = ?1",
                params![
                    id,
                    state,
                    summary,
                    next_action,
                    files,
                    target_agent,
                    i64::from(!spent),
                    now
                ],
            )
            .map_err(db_err)?;
            if spent {
                event(
                    tx,
                    &id,
                    now,
                    agent,
                    "needs_human",
                    &format!(
                        "handoff budget of {} spent; the brief for {target_agent} is saved and \
                         waits for a person",
                        t.handoff_cap
                    ),
                )?;
                return Ok(Err(t.handoff_cap));
            }
            event(
                tx,
                &id,
                now,
                agent,
                "passed",
                &format!("to {target_agent}: {next_action}"),
            )?;
            let t = task(tx, &id)?;
            Ok(Ok(Passed {
                handoffs_left: t.handoff_cap - t.handoffs_used,
                task: t,
            }))
        })?;
        outcome.or_else(|cap| {
            refused(format!(
                "the handoff budget of {cap} for task {id} is spent: the task now needs a person \
                 (`handoffs task resume {id} --add N`); your summary was saved"
            ))
        })
    }

    /// Marks the task done and releases the lease.
    pub fn complete(
        &mut self,
        agent: &str,
        task_id: &str,
        token: &str,
        summary: Option<&str>,
        changed_files: &[String],
    ) -> Result<Task> {
        check_agent_id(agent)?;
        if let Some(s) = summary {
            check_text("the summary", s, TEXT_MAX, true)?;
        }
        check_files(changed_files)?;
        let id = self.resolve(task_id)?;
        self.write(|tx, now, _| {
            fence(tx, &id, agent, token)?;
            let t = task(tx, &id)?;
            let files = merge_files(&t.changed_files, changed_files);
            tx.execute("DELETE FROM leases WHERE workspace = ?1", [WORKSPACE])
                .map_err(db_err)?;
            tx.execute(
                "UPDATE tasks SET state = 'done', summary = coalesce(?2, summary),
                   changed_files = ?3, updated_at = ?4 WHERE id = ?1",
                params![id, summary, files, now],
            )
            .map_err(db_err)?;
            event(tx, &id, now, agent, "completed", summary.unwrap_or("done"))?;
            task(tx, &id)
        })
    }

    /// A person adds budget to a task that stopped in `needs_human` (or any open task), and
    /// may queue it for another agent (`Some("")`: for anyone). What is left to spend stays
    /// at most 16.
    pub fn resume(
        &mut self,
        person: &str,
        task_id: &str,
        add: i64,
        target: Option<&str>,
    ) -> Result<Task> {
        check_text("the person's name", person, 200, true)?;
        if !(1..=HANDOFF_CAP_MAX).contains(&add) {
            return usage(format!(
                "a resumed task gets 1 to {HANDOFF_CAP_MAX} more passes"
            ));
        }
        if let Some(t) = target.filter(|t| !t.is_empty()) {
            check_agent_id(t)?;
        }
        let id = self.resolve(task_id)?;
        self.write(|tx, now, _| {
            let t = task(tx, &id)?;
            if t.state == "done" {
                return refused(format!("task {id} is done"));
            }
            let left = t.handoff_cap - t.handoffs_used;
            if left.max(0) + add > HANDOFF_CAP_MAX {
                return usage(format!(
                    "task {id} has {left} handoffs left; at most {HANDOFF_CAP_MAX} can be left to spend"
                ));
            }
            // A spent budget restarts from what was used, so `add` is what is left after.
            let mut budget = handoff_budget(&t);
            budget.add(HANDOFFS, Amount::whole(add));
            let cap = budget.limit(HANDOFFS).map_or(add, Amount::whole_units);
            let new_target = match target {
                None => t.target_agent.clone(),
                Some("") => None,
                Some(x) => Some(x.to_owned()),
            };
            tx.execute(
                "UPDATE tasks SET handoff_cap = ?2, target_agent = ?4,
                   state = CASE state WHEN 'needs_human' THEN 'queued' ELSE state END,
                   updated_at = ?3 WHERE id = ?1",
                params![id, cap, now, new_target],
            )
            .map_err(db_err)?;
            event(
                tx,
                &id,
                now,
                person,
                "resumed",
                &format!(
                    "{add} more handoffs (budget {cap}, {} used){}",
                    t.handoffs_used,
                    match &new_target {
                        Some(x) => format!(", queued for {x}"),
                        None => ", open to any agent".to_owned(),
                    }
                ),
            )?;
            task(tx, &id)
        })
    }

    pub fn show(&mut self, task_id: &str) -> Result<TaskDetail> {
        let id = self.resolve(task_id)?;
        self.write(|tx, _, _| {
            let t = task(tx, &id)?;
            let mut stmt = tx
                .prepare_cached("SELECT * FROM task_events WHERE task_id = ?1 ORDER BY seq")
                .map_err(db_err)?;
            let events = stmt
                .query_map([&id], |r| {
                    Ok(TaskEvent {
                        seq: r.get("seq")?,
                        task_id: r.get("task_id")?,
                        at: r.get("at")?,
                        actor: r.get("actor")?,
                        kind: r.get("kind")?,
                        detail: r.get("detail")?,
                    })
                })
                .map_err(db_err)?
                .collect::<rusqlite::Result<Vec<_>>>()
                .map_err(db_err)?;
            let lease = lease(tx)?.filter(|l| l.task_id == id).map(|mut l| {
                // The token is the holder's secret: it is shown only at claim time.
                l.token = String::new();
                l
            });
            Ok(TaskDetail {
                task: t,
                events,
                lease,
            })
        })
    }

    /// Tasks, newest first; `state` filters.
    pub fn list(&mut self, state: Option<&str>, limit: i64) -> Result<Vec<Task>> {
        if let Some(s) = state
            && !["queued", "claimed", "needs_human", "done"].contains(&s)
        {
            return usage("state must be queued, claimed, needs_human or done");
        }
        if !(1..=super::LIST_LIMIT_MAX).contains(&limit) {
            return usage("limit must be 1 to 10000");
        }
        self.write(|tx, _, _| {
            let mut stmt = tx
                .prepare_cached(
                    "SELECT * FROM tasks WHERE (?1 IS NULL OR state = ?1)
                     ORDER BY updated_at DESC, id LIMIT ?2",
                )
                .map_err(db_err)?;
            stmt.query_map(params![state, limit], row_task)
                .map_err(db_err)?
                .collect::<rusqlite::Result<Vec<_>>>()
                .map_err(db_err)
        })
    }
}

fn insert_lease(tx: &rusqlite::Transaction<'_>, l: &Lease) -> Result<()> {
    tx.execute(
        "INSERT INTO leases (workspace, task_id, holder, token, acquired_at, expires_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![
            WORKSPACE,
            l.task_id,
            l.holder,
            l.token,
            l.acquired_at,
            l.expires_at
        ],
    )
    .map_err(db_err)?;
    Ok(())
}

fn check_claimable(t: &Task, agent: &str) -> Result<()> {
    match t.state.as_str() {
        "queued" => {}
        "needs_human" => {
            return refused(format!(
                "task {} spent its handoff budget and needs a person (`handoffs task resume {} --add N`)",
                t.id, t.id
            ));
        }
        "done" => return refused(format!("task {} is done", t.id)),
        _ => return refused(format!("task {} is already claimed", t.id)),
    }
    if let Some(target) = &t.target_agent
        && target != agent
    {
        return refused(format!("task {} is queued for {target}, not {agent}", t.id));
    }
    Ok(())
}

fn check_files(files: &[String]) -> Result<()> {
    if files.len() > FILES_MAX {
        return usage(format!("at most {FILES_MAX} changed files"));
    }
    for f in files {
        if f.trim().is_empty() || f.len() > PATH_MAX {
            return usage(format!(
                "a changed file must be a path of 1 to {PATH_MAX} characters"
            ));
        }
    }
    Ok(())
}

/// The changed files as a set: the union of what was there and what is added, sorted.
fn merge_files(old: &[String], new: &[String]) -> String {
    let set: BTreeSet<&str> = old.iter().chain(new).map(String::as_str).collect();
    Value::from(set.into_iter().collect::<Vec<_>>()).to_string()
}

/// The unit of a task's budget.
const HANDOFFS: &str = "handoffs";

/// A task's handoff budget as a budget of one unit: the ledger's budget and a chain's are
/// one mechanism (SPEC §8.1, §8.2), spent and lifted by the same rules.
fn handoff_budget(t: &Task) -> Budget {
    let mut b = Budget::limited([(HANDOFFS, Amount::whole(t.handoff_cap))]);
    if let Some(line) = b.lines.get_mut(HANDOFFS) {
        line.spent = Amount::whole(t.handoffs_used);
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger() -> (tempfile::TempDir, Ledger) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join(".git")).unwrap();
        let l = Ledger::open_root(dir.path()).unwrap();
        (dir, l)
    }

    #[test]
    #[allow(clippy::many_single_char_names)]
    fn one_lease_per_workspace_and_the_budget_runs_out() {
        let (dir, mut l) = ledger();
        let gi = std::fs::read_to_string(dir.path().join(".handoffs/.gitignore")).unwrap();
        assert!(gi.contains('*'));
        let a = l
            .create("a", "Fix", "Fix the test", None, None, Some(1))
            .unwrap();
        let b = l
            .create("a", "Docs", "Write docs", None, None, None)
            .unwrap();
        let c = l.claim("a", &a.id, None).unwrap();
        let err = l.claim("b", &b.id, None).unwrap_err().to_string();
        assert!(err.contains("leased by a"), "{err}");
        assert!(l.renew("b", &a.id, &c.lease.token, None).is_err());
        assert!(l.renew("a", &a.id, "wrong", None).is_err());
        let p = l
            .pass(
                "a",
                &a.id,
                &c.lease.token,
                "half",
                "finish",
                &["x.rs".into(), "a.rs".into()],
                "b",
            )
            .unwrap();
        assert_eq!(p.handoffs_left, 0);
        assert_eq!(p.task.changed_files, vec!["a.rs", "x.rs"]);
        // Queued for b: a cannot take it back.
        assert!(l.claim("a", &a.id, None).is_err());
        let c2 = l.claim("b", &a.id, None).unwrap();
        let err = l
            .pass(
                "b",
                &a.id,
                &c2.lease.token,
                "more",
                "again",
                &["x.rs".into(), "b.rs".into()],
                "a",
            )
            .unwrap_err()
            .to_string();
        assert!(err.contains("budget of 1"), "{err}");
        let t = l.show(&a.id).unwrap();
        assert_eq!(t.task.state, "needs_human");
        assert_eq!(t.task.changed_files, vec!["a.rs", "b.rs", "x.rs"]);
        assert_eq!(t.task.summary.as_deref(), Some("more"));
        assert!(l.claim("a", &a.id, None).is_err());
        let t = l.resume("person", &a.id, 2, None).unwrap();
        assert_eq!((t.state.as_str(), t.handoff_cap), ("queued", 3));
        // At most 16 left to spend, whatever the cap was.
        assert!(l.resume("person", &a.id, 15, None).is_err());
        let t = l.resume("person", &a.id, 14, Some("")).unwrap();
        assert_eq!((t.handoff_cap, t.target_agent), (17, None));
        // The lease is free again: b's other task can be claimed.
        assert!(l.claim("b", &b.id, None).is_ok());
    }

    #[test]
    fn a_stale_lease_returns_its_task_and_fences_its_holder() {
        use std::sync::atomic::{AtomicI64, Ordering};
        static NOW: AtomicI64 = AtomicI64::new(1_000_000);
        fn now() -> i64 {
            NOW.load(Ordering::SeqCst)
        }
        let (_dir, l) = ledger();
        let mut l = l.with_clock(now);
        let t = l.create("a", "Fix", "Fix it", None, None, None).unwrap();
        let c = l.claim("a", &t.id, Some(1)).unwrap();
        NOW.fetch_add(61_000, Ordering::SeqCst);
        let c2 = l.claim("b", &t.id, None).unwrap();
        assert_eq!(c2.warnings.len(), 1, "{c2:?}");
        assert!(c2.warnings[0].contains("inspect the workspace"));
        let err = l
            .complete("a", &t.id, &c.lease.token, None, &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("leased by b"), "{err}");
        let events = l.show(&t.id).unwrap().events;
        let kinds: Vec<_> = events.iter().map(|e| e.kind.as_str()).collect();
        assert_eq!(kinds, ["created", "claimed", "lease_expired", "claimed"]);
        l.complete("b", &t.id, &c2.lease.token, None, &[]).unwrap();
        // The sweep also opened the task to anyone.
        let t2 = l.create("a", "Other", "x", None, Some("a"), None).unwrap();
        let c3 = l.claim("a", &t2.id, Some(1)).unwrap();
        NOW.fetch_add(61_000, Ordering::SeqCst);
        // Any operation sweeps, and says so.
        l.list(None, 10).unwrap();
        assert_eq!(l.take_warnings().len(), 1);
        let c4 = l.claim("b", &t2.id, None).unwrap();
        assert_eq!(c4.warnings.len(), 1, "the next claim still hears of it");
        assert!(l.renew("a", &t2.id, &c3.lease.token, None).is_err());
        // The history is append-only, even to SQL.
        assert!(l.conn.execute("DELETE FROM task_events", []).is_err());
    }
}
