//! A simulated agent host: one session that is idle or busy, speaking the command adapter's
//! HTTP protocol (SPEC §4): `POST /turn` writes one turn (200 with the turn id, 409 when it
//! refuses, 423 when its session is busy as the write arrives), `GET /status/{request_id}` tells what became of a request (404: never seen, so a
//! history scan is complete), `GET /activity` says idle or busy. A person also starts turns
//! of their own now and then. Everything it received is kept for the oracle, and survives the
//! host's crashes (it is the agent's own history).

use crate::net::{Request, elapsed};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How a host treats a write that arrives while a turn runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostKind {
    /// Turns it away as busy (423, nothing written): the app's own check and the write are
    /// one step.
    Refusing,
    /// Codex-like: a start during a turn is folded into the running turn (answered with that
    /// turn's id); if that turn is then interrupted, the folded text is lost with it.
    Folding,
    /// Claude-like: a resume beside the running turn is taken as a turn of its own on a fork
    /// of the transcript, and both run.
    Forking,
}

impl HostKind {
    pub fn name(self) -> &'static str {
        match self {
            HostKind::Refusing => "refusing",
            HostKind::Folding => "Codex-like",
            HostKind::Forking => "Claude-like",
        }
    }
}

/// How a turn ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    Returned,
    Failed,
    Stopped,
}

impl Ending {
    fn status(self) -> &'static str {
        match self {
            Ending::Returned => "returned",
            Ending::Failed => "failed",
            Ending::Stopped => "stopped",
        }
    }
}

/// One write the agent received.
#[derive(Clone, Debug)]
pub struct Received {
    pub request_id: String,
    /// The agent the write was addressed to (the body's `agent`).
    pub addressed_to: String,
    pub at: Duration,
    /// The session was in a turn when the write arrived, and since when: the app refuses
    /// such a write (its own check and the write are one step), but an engine that checked
    /// the session just before could not have known only if the turn began moments ago.
    pub busy_since: Option<Duration>,
    /// Whether the agent took it (false: refused, or failed).
    pub taken: bool,
    /// Taken during a running turn: folded into it (Codex-like) or run beside it on a forked
    /// transcript (Claude-like). A refusing host never takes such a write.
    pub into_busy: Option<HostKind>,
    /// The HTTP status it answered: 200 taken, 409 refused, 423 busy (a turn runs; nothing
    /// written), 500 failed before it was taken (the engine cannot tell whether it landed).
    pub status: u16,
    /// Whether, at the moment it arrived, the store held a committed reservation for its
    /// request id with the write issued (G8, read from the database file by the recipient).
    pub reserved: bool,
    /// The agent's last answer about its activity before the write arrived: a write after
    /// "busy" (for the turn still running) or after an unreadable answer was sent blind.
    pub last_answer: Option<&'static str>,
}

/// How a simulated recipient looks up, as a write arrives, whether the engine's store holds a
/// committed reservation for that request id (the world gives it one over the database file).
#[derive(Clone)]
pub struct ReservationCheck(pub Arc<dyn Fn(&str) -> bool + Send + Sync>);

impl std::fmt::Debug for ReservationCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReservationCheck")
    }
}

/// The moment of a write at which the world may act beside the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Moment {
    /// The write was taken: a turn of its own begins (the world sends from it, as a program
    /// in the turn would).
    Taken,
    /// The write is being turned away (busy, or refused) and its answer is not out yet.
    TurnedAway,
    /// No write yet: the agent is answering an activity look "idle" (the request id is
    /// empty); the engine may be about to write one it reserved.
    Looked,
}

/// What the world does at a write's moment, given the agent's id and the write's request id:
/// the trace line of what it did, if anything.
#[derive(Clone)]
pub struct AtWrite(pub Arc<AtWriteFn>);

/// The function behind [`AtWrite`]: (agent, request id, moment) → a trace line.
pub type AtWriteFn = dyn Fn(&str, &str, Moment) -> Option<String> + Send + Sync;

impl std::fmt::Debug for AtWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AtWrite")
    }
}

/// The per-turn fault rates an agent draws from.
#[derive(Clone, Copy, Debug, Default)]
pub struct TurnRates {
    pub refusal: f64,
    pub errored: f64,
    pub interrupted: f64,
    pub slow: f64,
    /// Chance per simulated minute that a person starts a turn of their own.
    pub person: f64,
    /// Chance that a write fails with a server error before it is taken.
    pub failed_write: f64,
    /// Chance that an activity answer is unreadable (503).
    pub unknown_activity: f64,
    /// Chance that a person starts a turn right after an "idle" answer.
    pub racing_turn: f64,
}

#[derive(Clone, Debug)]
struct Turn {
    /// None for a person's own turn.
    request_id: Option<String>,
    began_at: Duration,
    ends_at: Duration,
    ending: Ending,
    /// Writes a Codex-like host folded into this turn: they end with it.
    folded: Vec<String>,
}

/// One agent's session and history.
#[derive(Debug)]
pub struct AgentState {
    pub id: String,
    pub kind: HostKind,
    rng: ChaCha8Rng,
    rates: TurnRates,
    /// Once healed, the agent takes every write and every turn returns.
    healed: bool,
    turn: Option<Turn>,
    /// Turns a Claude-like host runs beside `turn`, each on its fork of the transcript.
    forks: Vec<Turn>,
    statuses: BTreeMap<String, Ending>,
    pub received: Vec<Received>,
    /// Each turn of ours that ended: (request id, when it really ended, how).
    pub ended: Vec<(String, Duration, &'static str)>,
    /// Each status (history) query answered: (when, request id, whether the request was
    /// found). The engine's history scans are among them.
    pub status_queries: Vec<(Duration, String, bool)>,
    /// Each status query that could not be answered (503: the history is unreadable).
    pub unanswered_queries: Vec<(Duration, String)>,
    /// The history cannot be read now (a fault): status queries answer 503.
    pub history_down: bool,
    /// Activity answers that forbade a write: "busy", or unreadable (503).
    pub busy_answers: usize,
    /// The last activity answer, and the turn it was about (its start), if busy.
    last_answer: Option<(&'static str, Option<Duration>)>,
    /// Looks up each arriving write's reservation (none: every write counts as reserved).
    pub reservations: Option<ReservationCheck>,
    /// What the world does at each write until the agent is healed (none: nothing).
    pub at_write: Option<AtWrite>,
    /// Trace lines: (virtual time, text).
    pub trace: Vec<(Duration, String)>,
}

/// An agent shared between its host and the oracle.
pub type Agent = Arc<Mutex<AgentState>>;

impl AgentState {
    pub fn new(id: &str, seed: u64, rates: TurnRates, kind: HostKind) -> Agent {
        Arc::new(Mutex::new(AgentState {
            id: id.to_owned(),
            kind,
            rng: ChaCha8Rng::seed_from_u64(seed),
            rates,
            healed: false,
            turn: None,
            forks: Vec::new(),
            statuses: BTreeMap::new(),
            received: Vec::new(),
            ended: Vec::new(),
            status_queries: Vec::new(),
            unanswered_queries: Vec::new(),
            history_down: false,
            busy_answers: 0,
            last_answer: None,
            reservations: None,
            at_write: None,
            trace: Vec::new(),
        }))
    }

    /// Lets the world act at this moment of a write (until healed).
    fn at_write(&mut self, agent: &str, request_id: &str, moment: Moment, now: Duration) {
        if !self.healed
            && let Some(hook) = self.at_write.clone()
            && let Some(what) = (hook.0)(agent, request_id, moment)
        {
            self.trace.push((now, what));
        }
    }

    /// From now on no fault: every write is taken and every turn returns, no person turns.
    pub fn heal(&mut self) {
        self.healed = true;
    }

    /// Ends the current turn (and any fork) if its time has come.
    fn advance(&mut self, now: Duration) {
        if let Some(turn) = &self.turn
            && turn.ends_at <= now
        {
            let turn = turn.clone();
            self.record_end(&turn);
            self.turn = None;
        }
        let (over, running): (Vec<Turn>, Vec<Turn>) =
            self.forks.drain(..).partition(|t| t.ends_at <= now);
        self.forks = running;
        for turn in over {
            self.record_end(&turn);
        }
    }

    fn record_end(&mut self, turn: &Turn) {
        for r in turn.request_id.iter().chain(&turn.folded) {
            self.statuses.insert(r.clone(), turn.ending);
            self.ended
                .push((r.clone(), turn.ends_at, turn.ending.status()));
        }
    }

    fn busy(&self) -> bool {
        self.turn.is_some() || !self.forks.is_empty()
    }

    /// When the session's running turn began (the earliest, with forks).
    fn busy_since(&self) -> Option<Duration> {
        self.turn
            .iter()
            .chain(&self.forks)
            .map(|t| t.began_at)
            .min()
    }

    /// A person starts a turn of their own if the session is idle.
    fn person_turn(&mut self, now: Duration) {
        self.advance(now);
        if self.busy() || self.healed {
            return;
        }
        let len = Duration::from_secs(self.rng.random_range(20..600));
        self.turn = Some(Turn {
            request_id: None,
            began_at: now,
            ends_at: now + len,
            ending: Ending::Returned,
            folded: Vec::new(),
        });
        self.trace
            .push((now, format!("person starts a turn of {}s", len.as_secs())));
    }

    fn chance(&mut self, p: f64) -> bool {
        !self.healed && p > 0.0 && self.rng.random_bool(p.min(1.0))
    }

    /// Answers one request of the protocol.
    pub fn handle(&mut self, req: &Request) -> (u16, String) {
        let now = elapsed();
        self.advance(now);
        match (req.method.as_str(), req.path.as_str()) {
            ("POST", "/turn") => self.write(req, now),
            ("GET", "/activity") => {
                if self.chance(self.rates.unknown_activity) {
                    self.busy_answers += 1;
                    self.last_answer = Some(("unknown", None));
                    return (503, "{}".to_owned());
                }
                let status = if self.busy() { "busy" } else { "idle" };
                if !self.busy() {
                    let me = self.id.clone();
                    self.at_write(&me, "", Moment::Looked, now);
                }
                if self.busy() {
                    self.busy_answers += 1;
                }
                self.last_answer = Some((status, self.busy_since()));
                if !self.busy() && self.chance(self.rates.racing_turn) {
                    // A person starts typing right after the engine looked.
                    let len = Duration::from_secs(self.rng.random_range(20..300));
                    self.turn = Some(Turn {
                        request_id: None,
                        began_at: now,
                        ends_at: now + len,
                        ending: Ending::Returned,
                        folded: Vec::new(),
                    });
                    self.trace.push((
                        now,
                        format!(
                            "person starts a turn of {}s right after answering idle",
                            len.as_secs()
                        ),
                    ));
                }
                (200, json!({ "status": status }).to_string())
            }
            ("GET", path) if path.starts_with("/status/") && self.history_down && !self.healed => {
                let id = &path["/status/".len()..];
                self.unanswered_queries.push((now, id.to_owned()));
                (503, "{}".to_owned())
            }
            ("GET", path) if path.starts_with("/status/") => {
                let id = &path["/status/".len()..];
                let answer = match (self.statuses.get(id), &self.turn) {
                    (Some(e), _) => (200, json!({ "status": e.status() }).to_string()),
                    (None, Some(t))
                        if t.request_id.as_deref() == Some(id)
                            || t.folded.iter().any(|f| f == id) =>
                    {
                        (200, json!({ "status": "running" }).to_string())
                    }
                    (None, _)
                        if self
                            .forks
                            .iter()
                            .any(|t| t.request_id.as_deref() == Some(id)) =>
                    {
                        (200, json!({ "status": "running" }).to_string())
                    }
                    _ => (404, "{}".to_owned()),
                };
                self.status_queries
                    .push((now, id.to_owned(), answer.0 != 404));
                answer
            }
            _ => (404, "{}".to_owned()),
        }
    }

    fn write(&mut self, req: &Request, now: Duration) -> (u16, String) {
        let body: Value = serde_json::from_slice(&req.body).unwrap_or(Value::Null);
        let request_id = body["request_id"].as_str().unwrap_or_default().to_owned();
        let addressed_to = body["agent"].as_str().unwrap_or_default().to_owned();
        let busy_since = self.busy_since();
        let while_busy = busy_since.is_some();
        // The last answer counts only while it is still about the same moment: "busy" about
        // the turn still running, or "unknown".
        let last_answer = match self.last_answer {
            Some(("busy", began)) if began.is_some() && began == busy_since => Some("busy"),
            Some(("unknown", _)) => Some("unknown"),
            Some(("busy", _)) | None => None,
            Some((a, _)) => Some(a),
        };
        let reserved = self
            .reservations
            .as_ref()
            .is_none_or(|check| (check.0)(&request_id));
        let into_busy = (while_busy && self.kind != HostKind::Refusing).then_some(self.kind);
        let turned_away = while_busy && into_busy.is_none();
        let refused = turned_away || self.chance(self.rates.refusal);
        self.received.push(Received {
            request_id: request_id.clone(),
            addressed_to: addressed_to.clone(),
            at: now,
            busy_since,
            taken: !refused,
            into_busy: into_busy.filter(|_| !refused),
            status: match (turned_away, refused) {
                (true, _) => 423,
                (false, true) => 409,
                (false, false) => 200,
            },
            reserved,
            last_answer,
        });
        // A write starts a new exchange: the next write needs a new look.
        self.last_answer = None;
        if !refused && self.chance(self.rates.failed_write) {
            if let Some(last) = self.received.last_mut() {
                last.taken = false;
                last.into_busy = None;
                last.status = 500;
            }
            self.trace.push((
                now,
                format!("write {} failed (500), not taken", short(&request_id)),
            ));
            return (500, json!({ "error": "internal error" }).to_string());
        }
        if refused {
            self.at_write(&addressed_to, &request_id, Moment::TurnedAway, now);
        }
        if turned_away {
            self.trace
                .push((now, format!("write {} busy (423)", short(&request_id))));
            return (423, json!({ "error": "busy" }).to_string());
        }
        if refused {
            self.trace
                .push((now, format!("write {} refused", short(&request_id))));
            return (409, json!({ "error": "refused" }).to_string());
        }
        let slow = self.chance(self.rates.slow);
        let secs = if slow {
            self.rng.random_range(600..3_600)
        } else {
            self.rng.random_range(5..300)
        };
        let ending = if self.chance(self.rates.errored) {
            Ending::Failed
        } else if self.chance(self.rates.interrupted) {
            Ending::Stopped
        } else {
            Ending::Returned
        };
        if into_busy == Some(HostKind::Folding)
            && let Some(turn) = self.turn.as_mut()
        {
            // Codex's turn/start during a turn: the text joins the running turn, whose id
            // comes back as if it were a turn of its own.
            turn.folded.push(request_id.clone());
            let running = turn
                .request_id
                .clone()
                .unwrap_or_else(|| "person".to_owned());
            self.trace.push((
                now,
                format!(
                    "write {} folded into the running turn ({})",
                    short(&request_id),
                    short(&running)
                ),
            ));
            return (
                200,
                json!({ "turn_id": running, "request_id": request_id }).to_string(),
            );
        }
        let turn = Turn {
            request_id: Some(request_id.clone()),
            began_at: now,
            ends_at: now + Duration::from_secs(secs),
            ending,
            folded: Vec::new(),
        };
        if into_busy == Some(HostKind::Forking) {
            // A second resume beside the running turn: the transcript forks, both run.
            self.forks.push(turn);
            self.trace.push((
                now,
                format!(
                    "write {} resumed beside the running turn: the transcript forks",
                    short(&request_id)
                ),
            ));
            return (
                200,
                json!({ "turn_id": request_id, "request_id": request_id }).to_string(),
            );
        }
        self.turn = Some(turn);
        self.trace.push((
            now,
            format!(
                "write {} taken: a turn of {secs}s that will end {}",
                short(&request_id),
                ending.status()
            ),
        ));
        self.at_write(&addressed_to, &request_id, Moment::Taken, now);
        (
            200,
            json!({ "turn_id": request_id, "request_id": request_id }).to_string(),
        )
    }
}

/// The first 8 characters of an id, for traces.
pub fn short(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}

/// The agent host's software: the protocol server, and a person who starts turns now and
/// then.
///
/// # Errors
/// When the server cannot listen.
pub async fn host(agent: Agent) -> Result<(), Box<dyn std::error::Error>> {
    let person = agent.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(60)).await;
            let mut a = person
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let p = a.rates.person;
            if a.chance(p) {
                a.person_turn(elapsed());
            }
        }
    });
    crate::net::serve(move |req| {
        agent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .handle(&req)
    })
    .await
}
