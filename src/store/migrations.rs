//! Schema migrations, applied in order inside one transaction and recorded in
//! `PRAGMA user_version`. Hand-written on purpose: the usual crate (`rusqlite_migration`)
//! does not yet build against rusqlite 0.43, and this is twenty lines.

/// The schema version this build writes.
pub const LATEST: i64 = 15;

/// `STEPS[i]` migrates from version `i` to `i + 1`.
pub const STEPS: [&str; 15] = [
    r"
CREATE TABLE agents (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    provider TEXT NOT NULL,
    endpoint TEXT NOT NULL DEFAULT '',
    cwd TEXT NOT NULL DEFAULT '',
    settings TEXT NOT NULL DEFAULT '{}',
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);
CREATE TABLE connections (
    from_agent TEXT NOT NULL,
    to_agent TEXT NOT NULL,
    allowed INTEGER NOT NULL,
    PRIMARY KEY (from_agent, to_agent)
);
CREATE TABLE config (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE messages (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    sender TEXT NOT NULL,
    recipient TEXT NOT NULL,
    body TEXT NOT NULL,
    body_hash TEXT NOT NULL,
    intent TEXT NOT NULL CHECK (intent IN ('handoff', 'notification')),
    kind TEXT NOT NULL CHECK (kind IN ('plain', 'work', 'return', 'reminder')),
    title TEXT,
    work_id TEXT,
    idem_key TEXT,
    created_at INTEGER NOT NULL,
    read_at INTEGER,
    UNIQUE (sender, idem_key)
);
CREATE INDEX messages_inbox ON messages (recipient, read_at, seq);
CREATE INDEX messages_identical ON messages (sender, recipient, body_hash);
CREATE TABLE work (
    id TEXT PRIMARY KEY,
    sender TEXT NOT NULL,
    recipient TEXT NOT NULL,
    title TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('assigned', 'accepted', 'returned', 'blocked', 'closed')),
    due_at INTEGER,
    reminded_at INTEGER,
    summary TEXT,
    evidence TEXT,
    outcome TEXT,
    note TEXT,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);
CREATE TABLE deliveries (
    message_id TEXT PRIMARY KEY REFERENCES messages (id),
    seq INTEGER NOT NULL,
    recipient TEXT NOT NULL,
    state TEXT NOT NULL,
    class TEXT NOT NULL CHECK (class IN ('pending', 'active', 'terminal')),
    record TEXT NOT NULL,
    due_at INTEGER,
    updated_at INTEGER NOT NULL
);
CREATE INDEX deliveries_due ON deliveries (due_at) WHERE due_at IS NOT NULL;
CREATE INDEX deliveries_pending ON deliveries (class, recipient, seq);
CREATE INDEX deliveries_state ON deliveries (state, updated_at);
CREATE TABLE events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at INTEGER NOT NULL,
    message_id TEXT,
    kind TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX events_message ON events (message_id, seq);
CREATE TABLE runs (
    request_id TEXT PRIMARY KEY,
    message_id TEXT NOT NULL,
    agent TEXT NOT NULL,
    pid INTEGER,
    started_at INTEGER NOT NULL,
    ends_at INTEGER,
    ended_at INTEGER,
    exit_code INTEGER,
    outcome TEXT,
    detail TEXT
);
CREATE INDEX runs_open ON runs (agent, outcome);
CREATE TABLE engine (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    at INTEGER NOT NULL,
    report TEXT NOT NULL
);
",
    // 1 → 2: the engine serves one recipient at a time and asks for its due deliveries.
    r"
CREATE INDEX deliveries_recipient_due ON deliveries (recipient, due_at) WHERE due_at IS NOT NULL;
",
    // 2 → 3: a delivery's frozen target holds its route (the settings that address the
    // recipient, G1). No schema change: `Store::migrate` fills the route of every delivery
    // that is not settled from its agent's settings (`fill_routes`).
    "",
    // 3 → 4: Claude Code channels. A `handoffs mcp --channels` server inside a person's
    // interactive Claude session registers itself (`channels`); a write to that session is a
    // card it pushes (`channel_pushes`), taken (pushed_at) in a commit before it is sent.
    r"
CREATE TABLE IF NOT EXISTS channels (
    pid INTEGER PRIMARY KEY,
    agent TEXT NOT NULL,
    session TEXT NOT NULL,
    claude_pid INTEGER NOT NULL,
    opened_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS channel_pushes (
    request_id TEXT PRIMARY KEY,
    listener INTEGER NOT NULL,
    content TEXT NOT NULL,
    meta TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    pushed_at INTEGER
);
CREATE INDEX IF NOT EXISTS channel_pushes_waiting ON channel_pushes (listener) WHERE pushed_at IS NULL;
",
    // 4 → 5: a card names the session it is for and the Claude process it went to (rows kept,
    // filled from their channel), and a run says when its supervisor left it open and since
    // when its message was seen nowhere (`runs.left_open_at`, `runs.missing_since`). Done by
    // `Store::migrate` (`migrate_5`): each change only where it is missing.
    "",
    // 5 → 6: the engine's look for due deliveries other than queued ones reads only those
    // (a backlog of queued deliveries, all due, made each look as long as the backlog).
    r"
DROP INDEX IF EXISTS deliveries_due;
DROP INDEX IF EXISTS deliveries_recipient_due;
CREATE INDEX deliveries_due ON deliveries (due_at)
    WHERE due_at IS NOT NULL AND state NOT IN ('WAITING', 'BUSY', 'OWNER_REJECTED');
CREATE INDEX deliveries_recipient_due ON deliveries (recipient, due_at)
    WHERE due_at IS NOT NULL AND state NOT IN ('WAITING', 'BUSY', 'OWNER_REJECTED');
",
    // 6 → 7: what the page counts is kept as it changes, so a snapshot costs the same however
    // many deliveries there are: each delivery's attempts and resends as columns, their sums
    // and the number of deliveries per state in `delivery_counts` (kept by triggers, whatever
    // writes a row), and the newest deliveries of a state straight from an index.
    // Done by `Store::migrate` (`migrate_7`): each change only where it is missing.
    "",
    // 7 → 8: chains (SPEC §8.2): each message's chain, parent and hop; each chain's budget,
    // depth limit and state. Done by `Store::migrate` (`migrate_8`).
    "",
    // 8 → 9: a chain's caller-defined budget units (SPEC §8.2), as JSON: unit → {limit,
    // spent} in millionths of the unit; and each spend, by the turn (message) that made it.
    // Done by `Store::migrate` (`migrate_9`): each change only where it is missing.
    "",
    // 9 → 10: topics (SPEC §8.2 broadcast): retention, posts in one order per topic, each
    // subscriber's cursor, and which inbox message told whom of which post.
    super::topics::SCHEMA,
    // 10 → 11: artifacts (SPEC §8.2 bounded summaries): the full text of a summary a card
    // carries only in part; and each topic post's hash (`migrate_11`).
    super::artifacts::SCHEMA,
    // 11 → 12: fan-outs (SPEC §8.2): a piece of work split to several agents, its join rule
    // and deadline, and which child answered when.
    super::fanouts::SCHEMA,
    // 12 → 13: agent tokens (remote MCP over HTTP): each agent's bearer token, as its hash.
    super::tokens::SCHEMA,
    // 13 → 14: recipient leases with fencing tokens (several engines on one database), the
    // machine an agent's adapter runs on, and the token each reservation was made under.
    super::leases::SCHEMA,
    // 14 → 15: a delivery may wait with the reason `withheld` (a fenced engine's write that
    // never left, queued again). No schema change: the number keeps a build that does not
    // know that reason from reading such records (it says the database is newer).
    "",
];
