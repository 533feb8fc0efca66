//! Supervised runs, Claude channels and their cards (the run records adapters keep).

use super::{OptionalExtension, Result, Tx, params};

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

pub(super) fn run_from(r: &super::sql::Row<'_, '_>) -> rusqlite::Result<RunRow> {
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

pub(super) fn channel_from(r: &super::sql::Row<'_, '_>) -> rusqlite::Result<ChannelRow> {
    Ok(ChannelRow {
        pid: r.get(0)?,
        agent: r.get(1)?,
        session: r.get(2)?,
        claude_pid: r.get(3)?,
        opened_at: r.get(4)?,
    })
}

pub(super) fn push_from(r: &super::sql::Row<'_, '_>) -> rusqlite::Result<PushRow> {
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

pub(super) const RUN_COLS: &str =
    "request_id, message_id, agent, pid, started_at, ends_at, ended_at, exit_code, outcome, detail";

impl Tx<'_> {
    pub fn insert_run(&self, r: &RunRow) -> Result<()> {
        self.exec(
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

    /// Forgets a refused or held run (it never ran), so a retry with the same request id can
    /// run.
    pub fn forget_refused_run(&self, request_id: &str) -> Result<()> {
        self.exec(
            "DELETE FROM runs WHERE request_id = ?1 AND outcome IN ('refused', 'held')",
            [request_id],
        )?;
        Ok(())
    }

    /// Notes that the run's supervisor left it open (nobody could tell how its write ended).
    pub fn leave_run_open(&self, request_id: &str, at: i64) -> Result<()> {
        self.exec(
            // A note of what the turn waited for goes too: nobody watches the turn any more.
            "UPDATE runs SET left_open_at = ?2, detail = NULL
             WHERE request_id = ?1 AND outcome IS NULL",
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
        self.exec(
            "UPDATE runs SET missing_since = coalesce(missing_since, ?2)
             WHERE request_id = ?1 AND outcome IS NULL",
            params![request_id, at],
        )?;
        Ok(())
    }

    /// Records the pid of a run's command once it started.
    pub fn set_run_pid(&self, request_id: &str, pid: i64) -> Result<()> {
        self.exec(
            "UPDATE runs SET pid = ?2 WHERE request_id = ?1",
            params![request_id, pid],
        )?;
        Ok(())
    }

    /// Registers a channel listener (a `handoffs mcp --channels` process).
    pub fn open_channel(&self, c: &ChannelRow) -> Result<()> {
        self.exec(
            "INSERT INTO channels (pid, agent, session, claude_pid, opened_at)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (pid) DO UPDATE SET agent = excluded.agent, session = excluded.session,
               claude_pid = excluded.claude_pid, opened_at = excluded.opened_at",
            params![c.pid, c.agent, c.session, c.claude_pid, c.opened_at],
        )?;
        Ok(())
    }

    pub fn close_channel(&self, pid: i64) -> Result<()> {
        self.exec("DELETE FROM channels WHERE pid = ?1", [pid])?;
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
        self.exec(
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
        let changed = self.exec(
            "UPDATE channel_pushes SET pushed_at = ?3
             WHERE request_id = ?1 AND listener = ?2 AND pushed_at IS NULL",
            params![request_id, listener, at],
        )?;
        if changed > 0 {
            self.exec(
                "UPDATE runs SET pid = ?2 WHERE request_id = ?1",
                params![request_id, listener],
            )?;
        }
        Ok(changed > 0)
    }

    /// Takes back a card no listener took: false when it was pushed meanwhile.
    pub fn withdraw_push(&self, request_id: &str) -> Result<bool> {
        let changed = self.exec(
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

    /// Notes, on a run still going, what its turn waits for (`None`: nothing any more); the
    /// run's outcome replaces it.
    pub fn set_run_note(&self, request_id: &str, note: Option<&str>) -> Result<()> {
        self.exec(
            "UPDATE runs SET detail = ?2 WHERE request_id = ?1 AND outcome IS NULL",
            params![request_id, note],
        )?;
        Ok(())
    }

    pub fn finish_run(
        &self,
        request_id: &str,
        at: i64,
        exit_code: Option<i64>,
        outcome: &str,
        detail: Option<&str>,
    ) -> Result<()> {
        let changed = self.exec(
            "UPDATE runs SET ended_at = ?2, exit_code = ?3, outcome = ?4, detail = ?5
             WHERE request_id = ?1 AND outcome IS NULL",
            params![request_id, at, exit_code, outcome, detail],
        )?;
        if changed > 0 {
            // The run's delivery is due at once: a running engine notices the commit.
            self.exec(
                "UPDATE deliveries SET due_at = ?2 WHERE message_id =
                   (SELECT message_id FROM runs WHERE request_id = ?1) AND class = 'active'",
                params![request_id, at],
            )?;
        }
        Ok(())
    }
}

/// The named transactions of the run records: what adapters, their supervisors and the
/// channel listener do with runs, channels and cards, each one transaction of its own (they
/// compose no store query themselves).
impl super::Store {
    pub fn run(&mut self, request_id: &str) -> Result<Option<RunRow>> {
        self.read(|tx| tx.run(request_id))
    }

    /// Runs of `agent` with no outcome yet, oldest first.
    pub fn open_runs_for(&mut self, agent: &str) -> Result<Vec<RunRow>> {
        self.read(|tx| tx.open_runs_for(agent))
    }

    pub fn insert_run(&mut self, r: &RunRow) -> Result<()> {
        self.write_shared(|tx| tx.insert_run(r))
    }

    /// Records how a run ended (once: a run with an outcome keeps it) and makes its delivery
    /// due at once.
    pub fn finish_run(
        &mut self,
        request_id: &str,
        at: i64,
        exit_code: Option<i64>,
        outcome: &str,
        detail: Option<&str>,
    ) -> Result<()> {
        self.write_shared(|tx| tx.finish_run(request_id, at, exit_code, outcome, detail))
    }

    /// Forgets a run that wrote nothing (refused, held), so a retry may use its request id.
    pub fn forget_refused_run(&mut self, request_id: &str) -> Result<()> {
        self.write_shared(|tx| tx.forget_refused_run(request_id))
    }

    pub fn leave_run_open(&mut self, request_id: &str, at: i64) -> Result<()> {
        self.write_shared(|tx| tx.leave_run_open(request_id, at))
    }

    pub fn run_marks(&mut self, request_id: &str) -> Result<(Option<i64>, Option<i64>)> {
        self.read(|tx| tx.run_marks(request_id))
    }

    pub fn mark_run_missing(&mut self, request_id: &str, at: i64) -> Result<()> {
        self.write_shared(|tx| tx.mark_run_missing(request_id, at))
    }

    pub fn set_run_pid(&mut self, request_id: &str, pid: i64) -> Result<()> {
        self.write_shared(|tx| tx.set_run_pid(request_id, pid))
    }

    /// What a run's turn waits for now, shown with its delivery (see [`super::Tx::set_run_note`]).
    pub fn set_run_note(&mut self, request_id: &str, note: Option<&str>) -> Result<()> {
        self.write_shared(|tx| tx.set_run_note(request_id, note))
    }

    /// The message a run delivers (one statement).
    pub fn run_message(&mut self, message_id: &str) -> Result<Option<super::MessageRow>> {
        self.read_one_statement(|tx| tx.message(message_id))
    }

    /// Whether the delivery of `message_id` holds its recipient (a write of it may be going).
    pub fn delivery_is_active(&mut self, message_id: &str) -> Result<bool> {
        Ok(self
            .read(|tx| tx.delivery(message_id))?
            .is_some_and(|d| d.record.is_active()))
    }

    /// Agent `id` as registered now.
    pub fn registered_agent(&mut self, id: &str) -> Result<Option<super::AgentRow>> {
        self.read(|tx| tx.agent(id))
    }

    pub fn open_channel(&mut self, c: &ChannelRow) -> Result<()> {
        self.write_shared(|tx| tx.open_channel(c))
    }

    pub fn close_channel(&mut self, pid: i64) -> Result<()> {
        self.write_shared(|tx| tx.close_channel(pid))
    }

    pub fn channels_for(&mut self, agent: &str, session: &str) -> Result<Vec<ChannelRow>> {
        self.read(|tx| tx.channels_for(agent, session))
    }

    /// A channel write's run and its card, committed together; a refused run of the same
    /// request id (a retry after a refusal: nothing was written) makes way for them.
    pub fn queue_push(&mut self, run: &RunRow, push: &PushRow) -> Result<()> {
        self.write_shared(|tx| {
            tx.forget_refused_run(&run.request_id)?;
            tx.insert_run(run)?;
            tx.insert_push(push)
        })
    }

    pub fn push(&mut self, request_id: &str) -> Result<Option<PushRow>> {
        self.read(|tx| tx.push(request_id))
    }

    pub fn waiting_pushes(&mut self, listener: i64) -> Result<Vec<PushRow>> {
        self.read(|tx| tx.waiting_pushes(listener))
    }

    pub fn take_push(&mut self, request_id: &str, listener: i64, at: i64) -> Result<bool> {
        self.write_shared(|tx| tx.take_push(request_id, listener, at))
    }

    pub fn withdraw_push(&mut self, request_id: &str) -> Result<bool> {
        self.write_shared(|tx| tx.withdraw_push(request_id))
    }

    /// Takes back a card no listener took and records its run's end, in one transaction:
    /// false (nothing recorded) when it was taken meanwhile.
    pub fn withdraw_push_and_finish(
        &mut self,
        request_id: &str,
        at: i64,
        outcome: &str,
        detail: &str,
    ) -> Result<bool> {
        self.write_shared(|tx| {
            let withdrawn = tx.withdraw_push(request_id)?;
            if withdrawn {
                tx.finish_run(request_id, at, None, outcome, Some(detail))?;
            }
            Ok(withdrawn)
        })
    }
}
