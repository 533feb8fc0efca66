//! Topics (SPEC §8.2 broadcast): each topic's retention, its posts in one order (a post's
//! position is its topic's next number, taken under the write lock), each subscriber's
//! durable cursor, and which inbox message told which subscriber of which post.

use super::{OptionalExtension, Result, Tx, params};

/// A topic and what it keeps.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TopicRow {
    pub name: String,
    /// Who created it (an agent, or a person: `None`).
    pub created_by: Option<String>,
    /// At most this many posts stay readable.
    pub keep_count: i64,
    /// Posts older than this many minutes are no longer readable.
    pub keep_minutes: i64,
    /// The position of its newest post (0: none yet).
    pub last_position: i64,
    pub created_at: i64,
}

/// One post; `body` is `None` once retention dropped it (its position and key stay).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PostRow {
    pub topic: String,
    pub position: i64,
    pub publisher: String,
    pub body: Option<String>,
    /// The SHA-256 of its text (kept when retention drops the text): a repeated key must
    /// come with the same text.
    pub body_hash: Option<String>,
    pub key: Option<String>,
    pub created_at: i64,
}

/// One subscriber of a topic: it has read every post up to `cursor`.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SubscriberRow {
    pub topic: String,
    pub agent: String,
    pub cursor: i64,
    pub subscribed_at: i64,
}

/// The schema of topics (migration 10).
pub(super) const SCHEMA: &str = r"
CREATE TABLE IF NOT EXISTS topics (
    name TEXT PRIMARY KEY,
    created_by TEXT,
    keep_count INTEGER NOT NULL,
    keep_minutes INTEGER NOT NULL,
    last_position INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS topic_posts (
    topic TEXT NOT NULL REFERENCES topics (name),
    position INTEGER NOT NULL,
    publisher TEXT NOT NULL,
    body TEXT,
    idem_key TEXT,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (topic, position)
);
CREATE UNIQUE INDEX IF NOT EXISTS topic_posts_key ON topic_posts (topic, publisher, idem_key)
    WHERE idem_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS topic_posts_kept ON topic_posts (topic, position)
    WHERE body IS NOT NULL;
CREATE TABLE IF NOT EXISTS topic_subscribers (
    topic TEXT NOT NULL REFERENCES topics (name),
    agent TEXT NOT NULL,
    cursor INTEGER NOT NULL,
    subscribed_at INTEGER NOT NULL,
    PRIMARY KEY (topic, agent)
);
CREATE TABLE IF NOT EXISTS topic_notices (
    topic TEXT NOT NULL,
    position INTEGER NOT NULL,
    agent TEXT NOT NULL,
    message_id TEXT NOT NULL,
    PRIMARY KEY (topic, position, agent)
);
";

const TOPIC_COLS: &str = "name, created_by, keep_count, keep_minutes, last_position, created_at";
const POST_COLS: &str = "topic, position, publisher, body, idem_key, created_at, body_hash";

fn topic_from(r: &super::sql::Row<'_, '_>) -> rusqlite::Result<TopicRow> {
    Ok(TopicRow {
        name: r.get(0)?,
        created_by: r.get(1)?,
        keep_count: r.get(2)?,
        keep_minutes: r.get(3)?,
        last_position: r.get(4)?,
        created_at: r.get(5)?,
    })
}

fn post_from(r: &super::sql::Row<'_, '_>) -> rusqlite::Result<PostRow> {
    Ok(PostRow {
        topic: r.get(0)?,
        position: r.get(1)?,
        publisher: r.get(2)?,
        body: r.get(3)?,
        key: r.get(4)?,
        created_at: r.get(5)?,
        body_hash: r.get(6)?,
    })
}

impl Tx<'_> {
    pub fn topic(&self, name: &str) -> Result<Option<TopicRow>> {
        Ok(self
            .tx
            .prepare_cached(&format!("SELECT {TOPIC_COLS} FROM topics WHERE name = ?1"))?
            .query_row([name], topic_from)
            .optional()?)
    }

    pub fn topics(&self) -> Result<Vec<TopicRow>> {
        let mut st = self
            .tx
            .prepare_cached(&format!("SELECT {TOPIC_COLS} FROM topics ORDER BY name"))?;
        let rows = st.query_map([], topic_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    pub fn insert_topic(&self, t: &TopicRow) -> Result<()> {
        self.exec(
            &format!("INSERT INTO topics ({TOPIC_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6)"),
            params![
                t.name,
                t.created_by,
                t.keep_count,
                t.keep_minutes,
                t.last_position,
                t.created_at
            ],
        )?;
        Ok(())
    }

    pub fn set_topic_retention(
        &self,
        name: &str,
        keep_count: i64,
        keep_minutes: i64,
    ) -> Result<()> {
        self.exec(
            "UPDATE topics SET keep_count = ?2, keep_minutes = ?3 WHERE name = ?1",
            params![name, keep_count, keep_minutes],
        )?;
        Ok(())
    }

    /// Takes the topic's next position (under the write lock: one total order per topic).
    pub fn next_topic_position(&self, name: &str) -> Result<i64> {
        self.exec(
            "UPDATE topics SET last_position = last_position + 1 WHERE name = ?1",
            [name],
        )?;
        Ok(self
            .tx
            .prepare_cached("SELECT last_position FROM topics WHERE name = ?1")?
            .query_row([name], |r| r.get(0))?)
    }

    pub fn insert_post(&self, p: &PostRow) -> Result<()> {
        self.exec(
            &format!("INSERT INTO topic_posts ({POST_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)"),
            params![
                p.topic,
                p.position,
                p.publisher,
                p.body,
                p.key,
                p.created_at,
                p.body_hash
            ],
        )?;
        Ok(())
    }

    /// When the topic's newest post was published.
    pub fn newest_post_time(&self, topic: &str) -> Result<Option<i64>> {
        Ok(self
            .tx
            .prepare_cached("SELECT max(created_at) FROM topic_posts WHERE topic = ?1")?
            .query_row([topic], |r| r.get(0))?)
    }

    /// Forgets `agent`'s subscriptions (it was removed).
    pub fn unsubscribe_everywhere(&self, agent: &str) -> Result<usize> {
        self.exec("DELETE FROM topic_subscribers WHERE agent = ?1", [agent])
    }

    pub fn post_by_key(&self, topic: &str, publisher: &str, key: &str) -> Result<Option<PostRow>> {
        Ok(self
            .tx
            .prepare_cached(&format!(
                "SELECT {POST_COLS} FROM topic_posts
                 WHERE topic = ?1 AND publisher = ?2 AND idem_key = ?3"
            ))?
            .query_row([topic, publisher, key], post_from)
            .optional()?)
    }

    /// Up to `limit` retained posts after position `after`, oldest first; none published
    /// before `since` (past the topic's age limit, whether or not a publish dropped it yet).
    pub fn posts_after(
        &self,
        topic: &str,
        after: i64,
        since: i64,
        limit: i64,
    ) -> Result<Vec<PostRow>> {
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {POST_COLS} FROM topic_posts
             WHERE topic = ?1 AND position > ?2 AND body IS NOT NULL AND created_at >= ?3
             ORDER BY position LIMIT ?4"
        ))?;
        let rows = st.query_map(params![topic, after, since, limit], post_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// The oldest position still readable (published at `since` or later), and how many
    /// posts are.
    pub fn retained_posts(&self, topic: &str, since: i64) -> Result<(Option<i64>, i64)> {
        Ok(self
            .tx
            .prepare_cached(
                "SELECT min(position), count(*) FROM topic_posts
                 WHERE topic = ?1 AND body IS NOT NULL AND created_at >= ?2",
            )?
            .query_row(params![topic, since], |r| Ok((r.get(0)?, r.get(1)?)))?)
    }

    /// Drops the text of posts past the topic's retention (older than `before`, or more than
    /// `keep_count` behind `last`); their positions and keys stay. Returns how many.
    pub fn trim_posts(
        &self,
        topic: &str,
        last: i64,
        keep_count: i64,
        before: i64,
    ) -> Result<usize> {
        self.exec(
            "UPDATE topic_posts SET body = NULL
             WHERE topic = ?1 AND body IS NOT NULL AND (position <= ?2 OR created_at < ?3)",
            params![topic, last.saturating_sub(keep_count), before],
        )
    }

    pub fn subscriber(&self, topic: &str, agent: &str) -> Result<Option<SubscriberRow>> {
        Ok(self
            .tx
            .prepare_cached(
                "SELECT topic, agent, cursor, subscribed_at FROM topic_subscribers
                 WHERE topic = ?1 AND agent = ?2",
            )?
            .query_row([topic, agent], |r| {
                Ok(SubscriberRow {
                    topic: r.get(0)?,
                    agent: r.get(1)?,
                    cursor: r.get(2)?,
                    subscribed_at: r.get(3)?,
                })
            })
            .optional()?)
    }

    /// The topic's subscribers, by agent id.
    pub fn subscribers(&self, topic: &str) -> Result<Vec<String>> {
        let mut st = self.tx.prepare_cached(
            "SELECT agent FROM topic_subscribers WHERE topic = ?1 ORDER BY agent",
        )?;
        let rows = st.query_map([topic], |r| r.get(0))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    pub fn subscribe(&self, s: &SubscriberRow) -> Result<()> {
        self.exec(
            "INSERT INTO topic_subscribers (topic, agent, cursor, subscribed_at)
             VALUES (?1, ?2, ?3, ?4)",
            params![s.topic, s.agent, s.cursor, s.subscribed_at],
        )?;
        Ok(())
    }

    pub fn unsubscribe(&self, topic: &str, agent: &str) -> Result<bool> {
        Ok(self.exec(
            "DELETE FROM topic_subscribers WHERE topic = ?1 AND agent = ?2",
            [topic, agent],
        )? > 0)
    }

    /// Moves a subscriber's cursor forward (never back).
    pub fn advance_cursor(&self, topic: &str, agent: &str, to: i64) -> Result<()> {
        self.exec(
            "UPDATE topic_subscribers SET cursor = CASE WHEN cursor > ?3 THEN cursor ELSE ?3 END WHERE topic = ?1 AND agent = ?2",
            params![topic, agent, to],
        )?;
        Ok(())
    }

    /// Notes that `message_id` told `agent` of the post at `position` (once: the key is the
    /// post and the agent).
    pub fn insert_topic_notice(
        &self,
        topic: &str,
        position: i64,
        agent: &str,
        message_id: &str,
    ) -> Result<()> {
        self.exec(
            "INSERT INTO topic_notices (topic, position, agent, message_id) VALUES (?1, ?2, ?3, ?4)",
            params![topic, position, agent, message_id],
        )?;
        Ok(())
    }

    /// Who was told of the post at `position`, by agent.
    pub fn topic_notices(&self, topic: &str, position: i64) -> Result<Vec<(String, String)>> {
        let mut st = self.tx.prepare_cached(
            "SELECT agent, message_id FROM topic_notices
             WHERE topic = ?1 AND position = ?2 ORDER BY agent",
        )?;
        let rows = st.query_map(params![topic, position], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// How many posts the topics have had in all (for `/metrics`).
    pub fn publish_count(&self) -> Result<i64> {
        Ok(self
            .tx
            .prepare_cached("SELECT coalesce(sum(last_position), 0) FROM topics")?
            .query_row([], |r| r.get(0))?)
    }
}
