//! Topics (SPEC §8.2 broadcast): a publish reaches every current subscriber's inbox exactly
//! once, as a notification (never a turn, never a transfer of work), in the same transaction
//! that gives the post its place in the topic's one order; each subscriber reads on from its
//! own durable cursor, or replays from any retained position.

use super::{
    MessageRow, Result, Service, ServiceError, Tx, body_hash, check_agent_id, check_len, millis,
    refused, usage,
};
use crate::store::{PostRow, SubscriberRow, TopicRow};
use serde::Serialize;

/// How many posts a topic keeps readable unless told otherwise.
pub const KEEP_COUNT_DEFAULT: i64 = 1_000;
pub const KEEP_COUNT_MAX: i64 = 100_000;
/// How long (minutes) a topic keeps a post readable unless told otherwise: a week.
pub const KEEP_MINUTES_DEFAULT: i64 = 7 * 24 * 60;
pub const KEEP_MINUTES_MAX: i64 = 365 * 24 * 60;
/// How many posts one read returns at most.
pub const READ_LIMIT_MAX: i64 = 1_000;
/// How many subscribers a topic may have unless configured, and at most.
pub const SUBSCRIBERS_DEFAULT: i64 = 1_000;
pub const SUBSCRIBERS_MAX: i64 = 10_000;

/// A topic as `topic list` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct TopicView {
    pub name: String,
    pub keep_count: i64,
    pub keep_minutes: i64,
    /// The position of its newest post (0: none yet).
    pub last_position: i64,
    /// How many posts are still readable, and the oldest of them.
    pub retained: i64,
    pub oldest_position: Option<i64>,
    pub subscribers: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct TopicCreated {
    pub topic: TopicRow,
    /// False: it existed (its retention updated if asked).
    pub created: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct Subscribed {
    pub topic: String,
    pub agent: String,
    /// The subscriber has read everything up to here.
    pub cursor: i64,
    /// False: it subscribed already (its cursor kept).
    pub new: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct Unsubscribed {
    pub topic: String,
    pub agent: String,
    pub removed: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct Published {
    pub topic: String,
    pub position: i64,
    pub publisher: String,
    /// Who was told of this post (each once), and the inbox message that told each.
    pub notified: Vec<String>,
    pub messages: Vec<String>,
    /// Subscribers the publisher may not reach (a blocked or not allowed connection): not
    /// told, though they read the topic themselves.
    pub withheld: Vec<String>,
    /// The same key was published before: this is that post, and nobody was told again.
    pub repeated: bool,
}

/// One post as a reader sees it.
#[derive(Clone, Debug, Serialize)]
pub struct PostView {
    pub position: i64,
    pub publisher: String,
    pub body: String,
    pub created_at: i64,
}

#[derive(Clone, Debug, Serialize)]
pub struct TopicRead {
    pub topic: String,
    pub agent: String,
    pub posts: Vec<PostView>,
    /// The reader's cursor after this read (its position in the topic when not subscribed).
    pub cursor: i64,
    /// Positions asked for that retention no longer keeps.
    pub skipped: i64,
    /// More retained posts follow.
    pub more: bool,
}

/// Checks a topic name: the same alphabet as agent ids.
pub fn check_topic_name(name: &str) -> Result<()> {
    if super::id_shaped(name) {
        Ok(())
    } else {
        usage(format!(
            "invalid topic name {:?}: use 1-64 letters, digits, '.', '_' or '-'",
            name.chars().take(80).collect::<String>()
        ))
    }
}

fn topic_of(tx: &Tx<'_>, name: &str) -> Result<TopicRow> {
    tx.topic(name)?.ok_or_else(|| {
        ServiceError::NotFound(format!(
            "no topic {name:?} (create it with `handoffs topic create {name}`)"
        ))
    })
}

fn registered(tx: &Tx<'_>, agent: &str) -> Result<()> {
    if tx.agent(agent)?.is_none() {
        return Err(ServiceError::NotFound(format!("no agent {agent:?}")));
    }
    Ok(())
}

/// Every topic as `topic list` and the page show it at `now`.
pub(super) fn views(tx: &Tx<'_>, now: i64) -> Result<Vec<TopicView>> {
    tx.topics()?.into_iter().map(|t| view(tx, t, now)).collect()
}

/// The first moment a post of a topic that keeps posts `keep_minutes` is still kept at `now`.
fn kept_since(keep_minutes: i64, now: i64) -> i64 {
    now.saturating_sub(keep_minutes.saturating_mul(60_000))
}

fn view(tx: &Tx<'_>, t: TopicRow, now: i64) -> Result<TopicView> {
    let (oldest_position, retained) =
        tx.retained_posts(&t.name, kept_since(t.keep_minutes, now))?;
    Ok(TopicView {
        subscribers: tx.subscribers(&t.name)?,
        name: t.name,
        keep_count: t.keep_count,
        keep_minutes: t.keep_minutes,
        last_position: t.last_position,
        retained,
        oldest_position,
    })
}

impl Service {
    /// Creates topic `name` (or, when it exists, sets the retention asked for).
    pub fn topic_create(
        &mut self,
        name: &str,
        keep_count: Option<i64>,
        keep_minutes: Option<i64>,
        by: Option<&str>,
    ) -> Result<TopicCreated> {
        check_topic_name(name)?;
        if let Some(n) = keep_count
            && !(1..=KEEP_COUNT_MAX).contains(&n)
        {
            return usage(format!("--keep must be 1 to {KEEP_COUNT_MAX}"));
        }
        if let Some(m) = keep_minutes
            && !(1..=KEEP_MINUTES_MAX).contains(&m)
        {
            return usage(format!("--keep-minutes must be 1 to {KEEP_MINUTES_MAX}"));
        }
        if let Some(a) = by {
            check_agent_id(a)?;
        }
        let now = millis(self.now());
        self.store.write(|tx| {
            if let Some(t) = tx.topic(name)? {
                if keep_count.is_some() || keep_minutes.is_some() {
                    let count = keep_count.unwrap_or(t.keep_count);
                    let minutes = keep_minutes.unwrap_or(t.keep_minutes);
                    tx.set_topic_retention(name, count, minutes)?;
                    tx.trim_posts(name, t.last_position, count, kept_since(minutes, now))?;
                }
                return Ok(TopicCreated {
                    topic: topic_of(tx, name)?,
                    created: false,
                });
            }
            let t = TopicRow {
                name: name.to_owned(),
                created_by: by.map(str::to_owned),
                keep_count: keep_count.unwrap_or(KEEP_COUNT_DEFAULT),
                keep_minutes: keep_minutes.unwrap_or(KEEP_MINUTES_DEFAULT),
                last_position: 0,
                created_at: now,
            };
            tx.insert_topic(&t)?;
            tx.event(now, None, "topic", &format!("topic {name} created"))?;
            Ok(TopicCreated {
                topic: t,
                created: true,
            })
        })
    }

    pub fn topic_list(&mut self) -> Result<Vec<TopicView>> {
        let now = millis(self.now());
        self.store.read(|tx| views(tx, now))
    }

    /// Subscribes `agent` to `name`: it reads what is published from now on, or, with
    /// `history`, every post still retained too.
    pub fn topic_subscribe(
        &mut self,
        name: &str,
        agent: &str,
        history: bool,
    ) -> Result<Subscribed> {
        check_topic_name(name)?;
        check_agent_id(agent)?;
        let now = millis(self.now());
        self.store.write(|tx| {
            let t = topic_of(tx, name)?;
            registered(tx, agent)?;
            if let Some(s) = tx.subscriber(name, agent)? {
                return Ok(Subscribed {
                    topic: s.topic,
                    agent: s.agent,
                    cursor: s.cursor,
                    new: false,
                });
            }
            // A publish writes one notification per subscriber in one transaction: the
            // number of subscribers is bounded (`config topicSubscribersMax`).
            let most = tx
                .config("topicSubscribersMax")?
                .and_then(|v| v.as_i64())
                .unwrap_or(SUBSCRIBERS_DEFAULT);
            let now_subscribed = i64::try_from(tx.subscribers(name)?.len()).unwrap_or(i64::MAX);
            if now_subscribed >= most {
                return refused(format!(
                    "topic {name} has {now_subscribed} subscribers, its most \
                     (`handoffs config topicSubscribersMax N` raises it)"
                ));
            }
            let cursor = if history {
                tx.retained_posts(name, kept_since(t.keep_minutes, now))?
                    .0
                    .map_or(t.last_position, |p| p - 1)
            } else {
                t.last_position
            };
            tx.subscribe(&SubscriberRow {
                topic: name.to_owned(),
                agent: agent.to_owned(),
                cursor,
                subscribed_at: now,
            })?;
            tx.event(now, None, "topic", &format!("{agent} subscribed to {name}"))?;
            Ok(Subscribed {
                topic: name.to_owned(),
                agent: agent.to_owned(),
                cursor,
                new: true,
            })
        })
    }

    pub fn topic_unsubscribe(&mut self, name: &str, agent: &str) -> Result<Unsubscribed> {
        check_topic_name(name)?;
        check_agent_id(agent)?;
        let now = millis(self.now());
        self.store.write(|tx| {
            topic_of(tx, name)?;
            let removed = tx.unsubscribe(name, agent)?;
            if removed {
                tx.event(
                    now,
                    None,
                    "topic",
                    &format!("{agent} unsubscribed from {name}"),
                )?;
            }
            Ok(Unsubscribed {
                topic: name.to_owned(),
                agent: agent.to_owned(),
                removed,
            })
        })
    }

    /// Publishes `body` on `name` from `from`: one transaction takes the topic's next
    /// position, keeps the post, and puts one notification in each current subscriber's
    /// inbox (registered subscribers; the publisher too if it subscribes). A repeated `key`
    /// returns the first post and tells nobody again.
    pub fn topic_publish(
        &mut self,
        name: &str,
        from: &str,
        body: &str,
        key: Option<&str>,
    ) -> Result<Published> {
        check_topic_name(name)?;
        check_agent_id(from)?;
        check_len("the message", body, super::MESSAGE_CHARS_MAX)?;
        if body.trim().is_empty() {
            return usage("the message is empty");
        }
        if let Some(k) = key {
            check_len("the key", k, super::ID_CHARS_MAX)?;
        }
        let now = millis(self.now());
        let misses_one = self
            .policy
            .planted(model::PlantedBug::PublishMissesSubscriber);
        self.store.write(|tx| {
            let t = topic_of(tx, name)?;
            registered(tx, from)?;
            if let Some(k) = key
                && let Some(p) = tx.post_by_key(name, from, k)?
            {
                if p.body_hash.as_deref() != Some(body_hash(body).as_str()) {
                    return refused(format!(
                        "key {k:?} was published on {name} before (#{}) with another message",
                        p.position
                    ));
                }
                let told = tx.topic_notices(name, p.position)?;
                return Ok(Published {
                    topic: name.to_owned(),
                    position: p.position,
                    publisher: p.publisher,
                    notified: told.iter().map(|(a, _)| a.clone()).collect(),
                    messages: told.into_iter().map(|(_, m)| m).collect(),
                    withheld: Vec::new(),
                    repeated: true,
                });
            }
            let position = tx.next_topic_position(name)?;
            // Never dated before the post ahead of it (another process may have read its
            // clock first and committed later): positions and times rise together.
            let now = now.max(tx.newest_post_time(name)?.unwrap_or(0));
            tx.insert_post(&PostRow {
                topic: name.to_owned(),
                position,
                publisher: from.to_owned(),
                body: Some(body.to_owned()),
                body_hash: Some(body_hash(body)),
                key: key.map(str::to_owned),
                created_at: now,
            })?;
            let (mut notified, mut messages, mut withheld) = (Vec::new(), Vec::new(), Vec::new());
            let mut subscribers = tx.subscribers(name)?;
            if misses_one {
                subscribers.pop();
            }
            for agent in subscribers {
                // A subscriber the publisher may not reach (`block`, `connections explicit`)
                // is not told; it still reads the topic itself.
                if agent != from && !super::connection_allowed(tx, from, &agent)? {
                    withheld.push(agent);
                    continue;
                }
                let m = notice(name, position, from, &agent, body, now);
                tx.insert_message(&m)?;
                tx.insert_topic_notice(name, position, &agent, &m.id)?;
                notified.push(agent);
                messages.push(m.id);
            }
            tx.trim_posts(
                name,
                position,
                t.keep_count,
                kept_since(t.keep_minutes, now),
            )?;
            tx.event(
                now,
                None,
                "publish",
                &format!(
                    "{from} published {name} #{position}; {} told",
                    notified.len()
                ),
            )?;
            Ok(Published {
                topic: name.to_owned(),
                position,
                publisher: from.to_owned(),
                notified,
                messages,
                withheld,
                repeated: false,
            })
        })
    }

    /// Reads `name` as `agent`: the retained posts after its cursor (moving the cursor on to
    /// the last one returned), or, `from` a position, a replay (the cursor only moves on).
    pub fn topic_read(
        &mut self,
        name: &str,
        agent: &str,
        from: Option<i64>,
        limit: i64,
    ) -> Result<TopicRead> {
        check_topic_name(name)?;
        check_agent_id(agent)?;
        if !(1..=READ_LIMIT_MAX).contains(&limit) {
            return usage(format!("--limit must be 1 to {READ_LIMIT_MAX}"));
        }
        if from.is_some_and(|p| p < 1) {
            return usage("--from must be a position, 1 or more");
        }
        let now = millis(self.now());
        self.store.write(|tx| {
            let t = topic_of(tx, name)?;
            registered(tx, agent)?;
            let sub = tx.subscriber(name, agent)?;
            let after = match (from, &sub) {
                (Some(p), _) => p - 1,
                (None, Some(s)) => s.cursor,
                (None, None) => {
                    return refused(format!(
                        "{agent} does not subscribe to {name}: subscribe first, or replay with --from"
                    ));
                }
            };
            let since = kept_since(t.keep_minutes, now);
            let mut rows = tx.posts_after(name, after, since, limit + 1)?;
            let more = rows.len() > usize::try_from(limit).unwrap_or(usize::MAX);
            rows.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
            // Where the read got to: its last post, or (none found) the newest position.
            // Positions on the way that retention no longer keeps are counted as skipped.
            let reached = rows
                .last()
                .map_or(after.max(t.last_position), |p| p.position);
            let returned = i64::try_from(rows.len()).unwrap_or(i64::MAX);
            let skipped = (reached - after - returned).max(0);
            let reached = reached.min(t.last_position);
            // The cursor moves on only over what this read covered from the cursor on: a
            // replay that starts past it skips nothing the subscriber has not read.
            let cursor = match &sub {
                Some(s) if after <= s.cursor && reached > s.cursor => {
                    tx.advance_cursor(name, agent, reached)?;
                    reached
                }
                Some(s) => s.cursor,
                None => reached,
            };
            Ok(TopicRead {
                topic: name.to_owned(),
                agent: agent.to_owned(),
                posts: rows
                    .into_iter()
                    .map(|p| PostView {
                        position: p.position,
                        publisher: p.publisher,
                        body: p.body.unwrap_or_default(),
                        created_at: p.created_at,
                    })
                    .collect(),
                cursor,
                skipped,
                more,
            })
        })
    }
}

/// The inbox message that tells `to` of a post: a notification, never a turn.
fn notice(name: &str, position: i64, from: &str, to: &str, body: &str, now: i64) -> MessageRow {
    let id = crate::clock::new_id();
    // The post itself (its title names the topic and position, its sender the publisher):
    // within the limit of any message, like the post.
    let text = body.to_owned();
    MessageRow {
        chain_id: id.clone(),
        parent_id: None,
        hop: 0,
        id,
        sender: from.to_owned(),
        recipient: to.to_owned(),
        body_hash: body_hash(&text),
        body: text,
        intent: "notification".to_owned(),
        kind: "plain".to_owned(),
        title: Some(format!("{name} #{position}")),
        work_id: None,
        idem_key: None,
        created_at: now,
        read_at: None,
    }
}

#[cfg(test)]
mod tests {
    use super::Service;
    use crate::store::Store;
    use model::Millis;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Retention by age holds at every read, not only after the next publish: a post older
    /// than the topic's age limit is neither read, nor replayed, nor counted as kept.
    #[test]
    fn a_post_past_its_age_limit_is_no_longer_read() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("h.sqlite3");
        drop(Store::init(&db).unwrap());
        let clock = Arc::new(AtomicU64::new(1_800_000_000_000));
        let c = clock.clone();
        let mut s = Service::with_clock(
            Store::open(&db).unwrap(),
            Arc::new(move || Millis(c.load(Ordering::SeqCst))),
        );
        for a in ["pub", "sub"] {
            s.add_agent(a, Some("demo"), None, None, None, &[]).unwrap();
        }
        s.topic_create("t", None, Some(10), None).unwrap();
        s.topic_subscribe("t", "sub", false).unwrap();
        s.topic_publish("t", "pub", "old news", None).unwrap();
        clock.fetch_add(9 * 60_000, Ordering::SeqCst);
        s.topic_publish("t", "pub", "fresh news", None).unwrap();
        clock.fetch_add(2 * 60_000, Ordering::SeqCst);
        // 11 minutes after the first post, 2 after the second: only the second is kept.
        let r = s.topic_read("t", "sub", None, 50).unwrap();
        let read: Vec<(i64, &str)> = r
            .posts
            .iter()
            .map(|p| (p.position, p.body.as_str()))
            .collect();
        assert_eq!(read, [(2, "fresh news")]);
        assert_eq!((r.skipped, r.cursor), (1, 2));
        let replay = s.topic_read("t", "pub", Some(1), 50).unwrap();
        assert_eq!(replay.posts.len(), 1);
        assert_eq!(replay.skipped, 1);
        let listed = s.topic_list().unwrap();
        assert_eq!(
            (listed[0].retained, listed[0].oldest_position),
            (1, Some(2))
        );
    }
}
