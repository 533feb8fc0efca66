//! The PostgreSQL schema: the tables of SQLite's schema, spelled for PostgreSQL (`bigint` for SQLite's integers, identity columns for its
//! `AUTOINCREMENT`, byte order (`COLLATE "C"`) for text as SQLite compares it, and a trigger
//! function for its three counting triggers), with the version kept in `handoffs_meta`
//! where SQLite keeps `user_version` and `application_id`. A PostgreSQL database is created at
//! schema 13 and taken on by `STEPS`, the later migrations of both backends in PostgreSQL's
//! spelling, applied under the writers' lock by the first process that opens it. A test checks that both
//! schemas have the same tables and columns.

use super::pg::{PgSession, redacted};
use super::sql::Conn;
use super::{APPLICATION_ID, StoreError, migrations};
use std::path::PathBuf;

/// How a write transaction begins: every writer queues on one transaction-level advisory
/// lock, as SQLite's writers queue on the database's write lock, so a transaction reads
/// what every earlier writer committed and no two writers interleave.
pub const WRITE_BEGIN: &str =
    "BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_advisory_xact_lock(1213089862, 1)";

/// How a write transaction commits: it tells every listening session (an engine waiting
/// for work) that something changed.
pub const WRITE_COMMIT: &str = "NOTIFY handoffs; COMMIT";

/// The schema at version 13.
pub const SCHEMA: &str = r#"
CREATE TABLE handoffs_meta (
    key TEXT COLLATE "C" PRIMARY KEY,
    value BIGINT NOT NULL
);
__DDL__
CREATE FUNCTION handoffs_count_deliveries() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        UPDATE delivery_counts SET n = n - 1, attempts = attempts - OLD.attempts,
            resends = resends - OLD.resends WHERE state = OLD.state;
    END IF;
    IF TG_OP IN ('UPDATE', 'INSERT') THEN
        INSERT INTO delivery_counts VALUES (NEW.state, 0, 0, 0) ON CONFLICT DO NOTHING;
        UPDATE delivery_counts SET n = n + 1, attempts = attempts + NEW.attempts,
            resends = resends + NEW.resends WHERE state = NEW.state;
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER deliveries_count AFTER INSERT OR DELETE ON deliveries
    FOR EACH ROW EXECUTE FUNCTION handoffs_count_deliveries();
CREATE TRIGGER deliveries_count_update AFTER UPDATE OF state, attempts, resends ON deliveries
    FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state
        OR OLD.attempts IS DISTINCT FROM NEW.attempts OR OLD.resends IS DISTINCT FROM NEW.resends)
    EXECUTE FUNCTION handoffs_count_deliveries();
"#;

/// Checks the database at `url` is ours and current, creating the schema when `create`
/// and the database holds no tables; whether it created it. The look is a read-only
/// snapshot (a command, a standby engine, a remote session opening the store never queues
/// behind the writers); only creating or migrating the schema takes the writers' lock, and
/// looks again under it (another process may have just done it).
pub fn prepare(session: &PgSession, url: &str, create: bool) -> Result<bool, StoreError> {
    match in_transaction(session, READ_BEGIN, |s| look(s, url))? {
        Found::Current => return Ok(false),
        Found::Empty if !create => return Err(StoreError::Missing(PathBuf::from(redacted(url)))),
        _ => {}
    }
    in_transaction(session, WRITE_BEGIN, |s| match look(s, url)? {
        Found::Current => Ok(false),
        Found::Behind(version) => {
            migrate(s, version)?;
            Ok(false)
        }
        Found::Empty if !create => Err(StoreError::Missing(PathBuf::from(redacted(url)))),
        Found::Empty => {
            s.batch(&SCHEMA.replace("__DDL__", DDL))?;
            Conn::Pg(s)
                .prepare_cached(
                    "INSERT INTO handoffs_meta (key, value) VALUES ('application_id', ?1), ('user_version', 13)",
                )?
                .execute([APPLICATION_ID])?;
            migrate(s, FIRST)?;
            Ok(true)
        }
    })
}

/// The version [`SCHEMA`] creates; [`STEPS`] take it on from there.
const FIRST: i64 = 13;

/// `STEPS[i]` migrates a PostgreSQL database from version `FIRST + i` to the next: the same
/// change as SQLite's migration of that number, in PostgreSQL's spelling.
const STEPS: [&str; 2] = [
    // 13 → 14: recipient leases with fencing tokens, each agent's machine, and the token a
    // delivery's reservation was made under (`store::leases`).
    r#"
CREATE TABLE recipient_leases (
    agent TEXT COLLATE "C" PRIMARY KEY,
    engine TEXT COLLATE "C" NOT NULL,
    fence BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    session BIGINT
);
CREATE VIEW live_leases AS
    SELECT agent, engine, fence, expires_at FROM recipient_leases l
    WHERE l.session IS NULL OR EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = l.session);
ALTER TABLE agents ADD COLUMN host TEXT COLLATE "C";
ALTER TABLE deliveries ADD COLUMN fence BIGINT;
"#,
    // 14 → 15: a delivery may wait with the reason `withheld`; no schema change.
    "",
];

/// Applies the steps after `from`, under the writers' lock the caller holds, and records the
/// version reached.
fn migrate(session: &PgSession, from: i64) -> Result<(), StoreError> {
    for (i, sql) in STEPS.iter().enumerate() {
        let target = FIRST + i64::try_from(i).unwrap_or(i64::MAX) + 1;
        if target > from {
            session.batch(sql)?;
        }
    }
    Conn::Pg(session)
        .prepare_cached("UPDATE handoffs_meta SET value = ?1 WHERE key = 'user_version'")?
        .execute([migrations::LATEST])?;
    Ok(())
}

/// What [`look`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Found {
    /// No table at all.
    Empty,
    /// Our schema at [`migrations::LATEST`].
    Current,
    /// Our schema at an earlier version this build migrates.
    Behind(i64),
}

/// How a read-only snapshot begins.
pub const READ_BEGIN: &str = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY";

fn in_transaction<T>(
    session: &PgSession,
    begin: &str,
    f: impl FnOnce(&PgSession) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    session.begin(begin)?;
    let out = f(session);
    session.batch(if out.is_ok() { "COMMIT" } else { "ROLLBACK" })?;
    out
}

/// Whether the database holds our schema, current or to migrate, or no table at all; an error for anything else (another application's tables, a schema of
/// another version).
fn look(session: &PgSession, url: &str) -> Result<Found, StoreError> {
    let conn = Conn::Pg(session);
    let one = |sql: &str| -> Result<i64, StoreError> {
        Ok(conn.prepare_cached(sql)?.query_row([], |r| r.get(0))?)
    };
    let ours = one(
        "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename = 'handoffs_meta'",
    )? > 0;
    if !ours {
        let tables = one("SELECT count(*) FROM pg_tables WHERE schemaname = current_schema()")?;
        if tables > 0 {
            return Err(StoreError::Foreign(PathBuf::from(redacted(url))));
        }
        return Ok(Found::Empty);
    }
    let app =
        one("SELECT coalesce(max(value), 0) FROM handoffs_meta WHERE key = 'application_id'")?;
    if app != APPLICATION_ID {
        return Err(StoreError::Foreign(PathBuf::from(redacted(url))));
    }
    let version =
        one("SELECT coalesce(max(value), 0) FROM handoffs_meta WHERE key = 'user_version'")?;
    if version > migrations::LATEST {
        return Err(StoreError::TooNew {
            path: PathBuf::from(redacted(url)),
            found: version,
            known: migrations::LATEST,
        });
    }
    if version < FIRST {
        return Err(StoreError::Sqlite(format!(
            "{} holds schema {version}, which this build cannot migrate to {}",
            redacted(url),
            migrations::LATEST
        )));
    }
    if version < migrations::LATEST {
        return Ok(Found::Behind(version));
    }
    Ok(Found::Current)
}

/// The tables of schema 13.
const DDL: &str = r#"
CREATE TABLE agents (
    id TEXT COLLATE "C" PRIMARY KEY,
    name TEXT COLLATE "C" NOT NULL,
    provider TEXT COLLATE "C" NOT NULL,
    endpoint TEXT COLLATE "C" NOT NULL DEFAULT '',
    cwd TEXT COLLATE "C" NOT NULL DEFAULT '',
    settings TEXT COLLATE "C" NOT NULL DEFAULT '{}',
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL
);
CREATE TABLE connections (
    from_agent TEXT COLLATE "C" NOT NULL,
    to_agent TEXT COLLATE "C" NOT NULL,
    allowed BIGINT NOT NULL,
    PRIMARY KEY (from_agent, to_agent)
);
CREATE TABLE config (
    key TEXT COLLATE "C" PRIMARY KEY,
    value TEXT COLLATE "C" NOT NULL
);
CREATE TABLE messages (
    seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    id TEXT COLLATE "C" NOT NULL UNIQUE,
    sender TEXT COLLATE "C" NOT NULL,
    recipient TEXT COLLATE "C" NOT NULL,
    body TEXT COLLATE "C" NOT NULL,
    body_hash TEXT COLLATE "C" NOT NULL,
    intent TEXT COLLATE "C" NOT NULL CHECK (intent IN ('handoff', 'notification')),
    kind TEXT COLLATE "C" NOT NULL CHECK (kind IN ('plain', 'work', 'return', 'reminder')),
    title TEXT COLLATE "C",
    work_id TEXT COLLATE "C",
    idem_key TEXT COLLATE "C",
    created_at BIGINT NOT NULL,
    read_at BIGINT, chain_id TEXT COLLATE "C", parent_id TEXT COLLATE "C", hop BIGINT NOT NULL DEFAULT 0,
    UNIQUE (sender, idem_key)
);
CREATE INDEX messages_inbox ON messages (recipient, read_at, seq);
CREATE INDEX messages_identical ON messages (sender, recipient, body_hash);
CREATE TABLE work (
    id TEXT COLLATE "C" PRIMARY KEY,
    sender TEXT COLLATE "C" NOT NULL,
    recipient TEXT COLLATE "C" NOT NULL,
    title TEXT COLLATE "C" NOT NULL,
    state TEXT COLLATE "C" NOT NULL CHECK (state IN ('assigned', 'accepted', 'returned', 'blocked', 'closed')),
    due_at BIGINT,
    reminded_at BIGINT,
    summary TEXT COLLATE "C",
    evidence TEXT COLLATE "C",
    outcome TEXT COLLATE "C",
    note TEXT COLLATE "C",
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL
);
CREATE TABLE deliveries (
    message_id TEXT COLLATE "C" PRIMARY KEY REFERENCES messages (id),
    seq BIGINT NOT NULL,
    recipient TEXT COLLATE "C" NOT NULL,
    state TEXT COLLATE "C" NOT NULL,
    class TEXT COLLATE "C" NOT NULL CHECK (class IN ('pending', 'active', 'terminal')),
    record TEXT COLLATE "C" NOT NULL,
    due_at BIGINT,
    updated_at BIGINT NOT NULL
, attempts BIGINT NOT NULL DEFAULT 0, resends BIGINT NOT NULL DEFAULT 0);
CREATE INDEX deliveries_pending ON deliveries (class, recipient, seq);
CREATE TABLE events (
    seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    at BIGINT NOT NULL,
    message_id TEXT COLLATE "C",
    kind TEXT COLLATE "C" NOT NULL,
    detail TEXT COLLATE "C" NOT NULL
);
CREATE INDEX events_message ON events (message_id, seq);
CREATE TABLE runs (
    request_id TEXT COLLATE "C" PRIMARY KEY,
    message_id TEXT COLLATE "C" NOT NULL,
    agent TEXT COLLATE "C" NOT NULL,
    pid BIGINT,
    started_at BIGINT NOT NULL,
    ends_at BIGINT,
    ended_at BIGINT,
    exit_code BIGINT,
    outcome TEXT COLLATE "C",
    detail TEXT COLLATE "C"
, left_open_at BIGINT, missing_since BIGINT);
CREATE INDEX runs_open ON runs (agent, outcome);
CREATE TABLE engine (
    id BIGINT PRIMARY KEY CHECK (id = 1),
    at BIGINT NOT NULL,
    report TEXT COLLATE "C" NOT NULL
);
CREATE TABLE channels (
    pid BIGINT PRIMARY KEY,
    agent TEXT COLLATE "C" NOT NULL,
    session TEXT COLLATE "C" NOT NULL,
    claude_pid BIGINT NOT NULL,
    opened_at BIGINT NOT NULL
);
CREATE TABLE channel_pushes (
    request_id TEXT COLLATE "C" PRIMARY KEY,
    listener BIGINT NOT NULL,
    session TEXT COLLATE "C" NOT NULL,
    claude_pid BIGINT NOT NULL,
    content TEXT COLLATE "C" NOT NULL,
    meta TEXT COLLATE "C" NOT NULL,
    created_at BIGINT NOT NULL,
    pushed_at BIGINT
);
CREATE INDEX channel_pushes_waiting ON channel_pushes (listener)
    WHERE pushed_at IS NULL;
CREATE INDEX deliveries_due ON deliveries (due_at)
    WHERE due_at IS NOT NULL AND state NOT IN ('WAITING', 'BUSY', 'OWNER_REJECTED');
CREATE INDEX deliveries_recipient_due ON deliveries (recipient, due_at)
    WHERE due_at IS NOT NULL AND state NOT IN ('WAITING', 'BUSY', 'OWNER_REJECTED');
CREATE TABLE delivery_counts (
    state TEXT COLLATE "C" PRIMARY KEY,
    n BIGINT NOT NULL,
    attempts BIGINT NOT NULL,
    resends BIGINT NOT NULL
);
CREATE INDEX deliveries_state ON deliveries (state, updated_at, seq);
CREATE INDEX messages_chain ON messages (chain_id, seq);
CREATE TABLE chains (
    id TEXT COLLATE "C" PRIMARY KEY,
    origin TEXT COLLATE "C" NOT NULL,
    state TEXT COLLATE "C" NOT NULL CHECK (state IN ('open', 'needs_human', 'cancelled')),
    hop_budget BIGINT NOT NULL,
    hops BIGINT NOT NULL DEFAULT 0,
    depth_limit BIGINT NOT NULL,
    stopped_reason TEXT COLLATE "C",
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL
, units TEXT COLLATE "C" NOT NULL DEFAULT '{}');
CREATE INDEX chains_state ON chains (state, updated_at);
CREATE TABLE dead_letters (
    id TEXT COLLATE "C" PRIMARY KEY,
    message_id TEXT COLLATE "C",
    sender TEXT COLLATE "C" NOT NULL,
    recipient TEXT COLLATE "C" NOT NULL,
    body TEXT COLLATE "C" NOT NULL,
    title TEXT COLLATE "C",
    reason TEXT COLLATE "C" NOT NULL CHECK (reason IN ('unknown_recipient', 'topology', 'failed',
        'destination_changed', 'chain_stopped')),
    detail TEXT COLLATE "C" NOT NULL,
    chain_id TEXT COLLATE "C",
    parent_id TEXT COLLATE "C",
    created_at BIGINT NOT NULL,
    replayed_as TEXT COLLATE "C",
    replayed_at BIGINT,
    dropped_at BIGINT
);
CREATE INDEX dead_letters_message ON dead_letters (message_id);
CREATE INDEX dead_letters_new ON dead_letters (created_at);
CREATE TABLE chain_spends (
    seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    chain_id TEXT COLLATE "C" NOT NULL,
    message_id TEXT COLLATE "C" NOT NULL,
    agent TEXT COLLATE "C" NOT NULL,
    unit TEXT COLLATE "C" NOT NULL,
    amount BIGINT NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE INDEX chain_spends_chain ON chain_spends (chain_id, message_id);
CREATE TABLE topics (
    name TEXT COLLATE "C" PRIMARY KEY,
    created_by TEXT COLLATE "C",
    keep_count BIGINT NOT NULL,
    keep_minutes BIGINT NOT NULL,
    last_position BIGINT NOT NULL DEFAULT 0,
    created_at BIGINT NOT NULL
);
CREATE TABLE topic_posts (
    topic TEXT COLLATE "C" NOT NULL REFERENCES topics (name),
    position BIGINT NOT NULL,
    publisher TEXT COLLATE "C" NOT NULL,
    body TEXT COLLATE "C",
    idem_key TEXT COLLATE "C",
    created_at BIGINT NOT NULL, body_hash TEXT COLLATE "C",
    PRIMARY KEY (topic, position)
);
CREATE UNIQUE INDEX topic_posts_key ON topic_posts (topic, publisher, idem_key)
    WHERE idem_key IS NOT NULL;
CREATE INDEX topic_posts_kept ON topic_posts (topic, position)
    WHERE body IS NOT NULL;
CREATE TABLE topic_subscribers (
    topic TEXT COLLATE "C" NOT NULL REFERENCES topics (name),
    agent TEXT COLLATE "C" NOT NULL,
    cursor BIGINT NOT NULL,
    subscribed_at BIGINT NOT NULL,
    PRIMARY KEY (topic, agent)
);
CREATE TABLE topic_notices (
    topic TEXT COLLATE "C" NOT NULL,
    position BIGINT NOT NULL,
    agent TEXT COLLATE "C" NOT NULL,
    message_id TEXT COLLATE "C" NOT NULL,
    PRIMARY KEY (topic, position, agent)
);
CREATE TABLE artifacts (
    id TEXT COLLATE "C" PRIMARY KEY,
    kind TEXT COLLATE "C" NOT NULL,
    sender TEXT COLLATE "C" NOT NULL,
    recipient TEXT COLLATE "C" NOT NULL,
    body TEXT COLLATE "C" NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE TABLE fanouts (
    id TEXT COLLATE "C" PRIMARY KEY,
    sender TEXT COLLATE "C" NOT NULL,
    title TEXT COLLATE "C" NOT NULL,
    children BIGINT NOT NULL CHECK (children >= 1),
    quorum BIGINT NOT NULL CHECK (quorum >= 1 AND quorum <= children),
    join_rule TEXT COLLATE "C" NOT NULL CHECK (join_rule IN ('all', 'quorum')),
    deadline_at BIGINT,
    cancel_rest BIGINT NOT NULL,
    state TEXT COLLATE "C" NOT NULL CHECK (state IN ('waiting', 'complete', 'partial', 'cancelled')),
    combined_id TEXT COLLATE "C",
    idem_key TEXT COLLATE "C",
    created_at BIGINT NOT NULL,
    joined_at BIGINT
);
CREATE UNIQUE INDEX fanouts_key ON fanouts (sender, idem_key)
    WHERE idem_key IS NOT NULL;
CREATE INDEX fanouts_waiting ON fanouts (deadline_at)
    WHERE state = 'waiting';
CREATE TABLE fanout_children (
    message_id TEXT COLLATE "C" PRIMARY KEY,
    fanout_id TEXT COLLATE "C" NOT NULL REFERENCES fanouts (id),
    recipient TEXT COLLATE "C" NOT NULL,
    position BIGINT NOT NULL,
    answered_at BIGINT,
    late BIGINT NOT NULL DEFAULT 0,
    UNIQUE (fanout_id, position)
);
CREATE TABLE agent_tokens (
    agent TEXT COLLATE "C" PRIMARY KEY,
    hash TEXT COLLATE "C" NOT NULL UNIQUE,
    created_at BIGINT NOT NULL,
    expires_at BIGINT
);
"#;

#[cfg(test)]
mod tests {
    #[test]
    fn a_new_migration_needs_its_postgresql_step() {
        // PostgreSQL databases start at schema 13 (this file's `SCHEMA`) and take each later
        // SQLite migration as a step of `STEPS`, in PostgreSQL's spelling.
        assert_eq!(
            super::FIRST + i64::try_from(super::STEPS.len()).unwrap(),
            super::migrations::LATEST,
            "migration {} has no PostgreSQL step in store/pg_schema.rs",
            super::migrations::LATEST
        );
    }
}
