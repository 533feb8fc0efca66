//! Chains (SPEC §8.2): each chain's budget, depth limit and state; the messages of a chain;
//! the message a turn is working on.

use super::messages::{MESSAGE_COLS, message_from};
use super::{MessageRow, OptionalExtension, Result, Tx, params};

pub use model::chain::ChainState;

/// One chain: the messages that descend from one first message.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ChainRow {
    /// The id of its first message.
    pub id: String,
    /// The agent that sent its first message: told when the chain stops.
    pub origin: String,
    pub state: ChainState,
    /// How many continuations (hops) it may make in all.
    pub hop_budget: i64,
    /// How many it made.
    pub hops: i64,
    /// How deep a message may be (the first is at depth 0).
    pub depth_limit: i64,
    /// The caller's units (`--budget tokens=…,usd=…`), each with its limit and what was
    /// spent; hops are above.
    pub units: model::chain::Budget,
    pub stopped_reason: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
}

const CHAIN_COLS: &str = "id, origin, state, hop_budget, hops, depth_limit, stopped_reason, \
     created_at, updated_at, units";

/// The caller's units as stored: unit → {limit, spent} in millionths.
fn units_to_json(b: &model::chain::Budget) -> String {
    let map: serde_json::Map<String, serde_json::Value> = b
        .lines
        .iter()
        .map(|(unit, l)| {
            (
                unit.clone(),
                serde_json::json!({
                    "limit": l.limit.map(model::chain::Amount::millionths),
                    "spent": l.spent.millionths(),
                }),
            )
        })
        .collect();
    serde_json::Value::Object(map).to_string()
}

fn units_from_json(text: &str) -> Result<model::chain::Budget, String> {
    use model::chain::{Amount, Line};
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("a chain's units are not JSON: {e}"))?;
    let mut b = model::chain::Budget::default();
    for (unit, l) in v.as_object().into_iter().flatten() {
        let get = |k: &str| l.get(k).and_then(serde_json::Value::as_i64);
        b.lines.insert(
            unit.clone(),
            Line {
                limit: get("limit").map(Amount::from_millionths),
                spent: Amount::from_millionths(get("spent").unwrap_or(0)),
            },
        );
    }
    Ok(b)
}

fn chain_from(r: &super::sql::Row<'_, '_>) -> rusqlite::Result<ChainRow> {
    Ok(ChainRow {
        id: r.get(0)?,
        origin: r.get(1)?,
        state: r.get::<String>(2)?.parse().map_err(|e: String| {
            rusqlite::Error::FromSqlConversionFailure(2, rusqlite::types::Type::Text, e.into())
        })?,
        hop_budget: r.get(3)?,
        hops: r.get(4)?,
        depth_limit: r.get(5)?,
        stopped_reason: r.get(6)?,
        created_at: r.get(7)?,
        updated_at: r.get(8)?,
        units: units_from_json(&r.get::<String>(9)?).map_err(|e| {
            rusqlite::Error::FromSqlConversionFailure(9, rusqlite::types::Type::Text, e.into())
        })?,
    })
}

impl Tx<'_> {
    pub fn insert_chain(&self, c: &ChainRow) -> Result<()> {
        self.exec(
            &format!(
                "INSERT INTO chains ({CHAIN_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)"
            ),
            params![
                c.id,
                c.origin,
                c.state.as_str(),
                c.hop_budget,
                c.hops,
                c.depth_limit,
                c.stopped_reason,
                c.created_at,
                c.updated_at,
                units_to_json(&c.units)
            ],
        )?;
        Ok(())
    }

    pub fn update_chain(&self, c: &ChainRow) -> Result<()> {
        self.exec(
            "UPDATE chains SET state = ?2, hop_budget = ?3, hops = ?4, depth_limit = ?5,
                 stopped_reason = ?6, updated_at = ?7, units = ?8 WHERE id = ?1",
            params![
                c.id,
                c.state.as_str(),
                c.hop_budget,
                c.hops,
                c.depth_limit,
                c.stopped_reason,
                c.updated_at,
                units_to_json(&c.units)
            ],
        )?;
        Ok(())
    }

    pub fn chain(&self, id: &str) -> Result<Option<ChainRow>> {
        Ok(self
            .tx
            .prepare_cached(&format!("SELECT {CHAIN_COLS} FROM chains WHERE id = ?1"))?
            .query_row([id], chain_from)
            .optional()?)
    }

    /// The newest chains first (`needs_human` ones first of all), at most `limit`.
    pub fn chains(&self, limit: i64) -> Result<Vec<ChainRow>> {
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {CHAIN_COLS} FROM chains
             ORDER BY state = 'needs_human' DESC, updated_at DESC, id LIMIT ?1"
        ))?;
        let rows = st.query_map([limit], chain_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// The chains stopped for a person (`needs_human`), newest first, at most `limit`, and
    /// how many there are.
    pub fn stopped_chains(&self, limit: i64) -> Result<(Vec<ChainRow>, i64)> {
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {CHAIN_COLS} FROM chains WHERE state = 'needs_human'
             ORDER BY updated_at DESC, id LIMIT ?1"
        ))?;
        let rows = st
            .query_map([limit], chain_from)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        let n = self
            .tx
            .prepare_cached("SELECT count(*) FROM chains WHERE state = 'needs_human'")?
            .query_row([], |r| r.get(0))?;
        Ok((rows, n))
    }

    /// The chain message `id` belongs to, if it has a row.
    pub fn chain_of_message(&self, id: &str) -> Result<Option<ChainRow>> {
        self.remembered(
            |m| &mut m.chain_of_message,
            id.to_owned(),
            || {
                let cols = CHAIN_COLS
                    .split(", ")
                    .map(|c| format!("c.{c}"))
                    .collect::<Vec<_>>()
                    .join(", ");
                Ok(self
                    .tx
                    .prepare_cached(&format!(
                        "SELECT {cols} FROM messages m JOIN chains c ON c.id = m.chain_id WHERE m.id = ?1"
                    ))?
                    .query_row([id], chain_from)
                    .optional()?)
            },
        )
    }

    /// Records a spend of `agent`'s turn on `message_id` in chain `chain_id`.
    pub fn insert_spend(
        &self,
        (chain_id, message_id, agent): (&str, &str, &str),
        ask: &[(String, model::chain::Amount)],
        now: i64,
    ) -> Result<()> {
        for (unit, n) in ask {
            self.exec(
                "INSERT INTO chain_spends (chain_id, message_id, agent, unit, amount, created_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![chain_id, message_id, agent, unit, n.millionths(), now],
            )?;
        }
        Ok(())
    }

    /// What was spent in chain `id`, by message and unit.
    pub fn chain_spends(
        &self,
        id: &str,
    ) -> Result<
        std::collections::BTreeMap<
            String,
            std::collections::BTreeMap<String, model::chain::Amount>,
        >,
    > {
        let mut st = self.tx.prepare_cached(
            "SELECT message_id, unit, sum(amount) FROM chain_spends WHERE chain_id = ?1
             GROUP BY message_id, unit",
        )?;
        let rows = st.query_map([id], |r| {
            Ok((r.get::<String>(0)?, r.get::<String>(1)?, r.get::<i64>(2)?))
        })?;
        let mut out: std::collections::BTreeMap<_, std::collections::BTreeMap<_, _>> =
            std::collections::BTreeMap::new();
        for row in rows {
            let (m, unit, n) = row?;
            out.entry(m)
                .or_default()
                .insert(unit, model::chain::Amount::from_millionths(n));
        }
        Ok(out)
    }

    /// Whether message `id` belongs to a cancelled chain: its chain's row, as
    /// [`Tx::chain_of_message`] reads it (and remembers it for the transaction).
    pub fn in_cancelled_chain(&self, id: &str) -> Result<bool> {
        Ok(self
            .chain_of_message(id)?
            .is_some_and(|c| c.state == model::chain::ChainState::Cancelled))
    }

    /// Every message of chain `id`, oldest first.
    pub fn chain_messages(&self, id: &str) -> Result<Vec<MessageRow>> {
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {MESSAGE_COLS} FROM messages WHERE chain_id = ?1 ORDER BY seq"
        ))?;
        let rows = st.query_map([id], message_from)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// The message whose turn `request_id` is, when that turn is `agent`'s: a supervised run
    /// (its program and everything it starts have `HANDOFFS_REQUEST_ID`), or the write an
    /// HTTP recipient received (its body's `request_id`, the delivery's current one).
    pub fn message_of_turn(&self, agent: &str, request_id: &str) -> Result<Option<String>> {
        let sql = if self.tx.is_pg() {
            "SELECT message_id FROM runs WHERE request_id = ?1 AND agent = ?2
             UNION ALL
             SELECT message_id FROM deliveries
             WHERE recipient = ?2 AND CAST(record AS jsonb) #>> '{core,request_id}' = ?1
             LIMIT 1"
        } else {
            "SELECT message_id FROM runs WHERE request_id = ?1 AND agent = ?2
             UNION ALL
             SELECT message_id FROM deliveries
             WHERE recipient = ?2 AND json_extract(record, '$.core.request_id') = ?1
             LIMIT 1"
        };
        Ok(self
            .tx
            .prepare_cached(sql)?
            .query_row(params![request_id, agent], |r| r.get(0))
            .optional()?)
    }

    /// The message of the turn `agent` is working on: its delivery ACCEPTED or RUNNING (at
    /// most one delivery per recipient is active, G3; a reservation or a write nobody can
    /// place is no turn under way).
    pub fn message_in_turn(&self, agent: &str) -> Result<Option<String>> {
        Ok(self
            .tx
            .prepare_cached(
                "SELECT message_id FROM deliveries WHERE recipient = ?1 AND class = 'active'
                   AND state IN ('ACCEPTED', 'RUNNING')
                 ORDER BY seq DESC LIMIT 1",
            )?
            .query_row([agent], |r| r.get(0))
            .optional()?)
    }
}

impl ChainRow {
    /// The chain as its rules see it (`model::chain`): hops are one unit of its budget.
    pub fn rules(&self) -> model::chain::Chain {
        use model::chain::{Amount, HOPS, Line};
        let mut budget = self.units.clone();
        budget.lines.insert(
            HOPS.to_owned(),
            Line {
                limit: Some(Amount::whole(self.hop_budget)),
                spent: Amount::whole(self.hops),
            },
        );
        model::chain::Chain {
            state: self.state,
            budget,
            depth_limit: self.depth_limit,
        }
    }

    /// Takes what the rules decided back into the row.
    pub fn take(&mut self, c: &model::chain::Chain) {
        use model::chain::HOPS;
        let mut units = c.budget.clone();
        if let Some(h) = units.lines.remove(HOPS) {
            self.hop_budget = h
                .limit
                .map_or(self.hop_budget, model::chain::Amount::whole_units);
            self.hops = h.spent.whole_units();
        }
        self.units = units;
        self.state = c.state;
        self.depth_limit = c.depth_limit;
    }
}
