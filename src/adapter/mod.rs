//! Adapters answer four questions about an agent (SPEC §4): its activity, preparing a write,
//! starting one turn with a request id, and observing what became of a request id (including
//! a history scan). Errors are values, never panics. Which adapter serves an agent is decided
//! by its provider; the engine never knows more than this module's enum.

pub mod channel;
pub mod claude;
pub mod codex;
pub mod command;
pub mod demo;
pub mod doctor;
pub mod http;
pub mod outage;

use crate::store::{AgentRow, MessageRow, Store};
use model::{Activity, Millis, Observed, Provider, ScanResult, WriteOutcome};
use serde_json::Value;
use std::cell::RefCell;
use std::path::Path;

/// What an adapter needs from the process that runs it, and nothing more: the run records
/// (the `runs`, `pushes` and `channels` tables), the clock, and the two work verbs the demo
/// agent uses as its own recipient. The service implements it; adapters never see the service,
/// so the dependency runs one way (service and engine on adapters, never back).
pub trait Host {
    /// The database that holds the run records.
    fn runs(&mut self) -> &mut Store;
    /// The database's file.
    fn db(&self) -> &Path;
    /// The current time (the real clock, or the simulation's).
    fn now(&self) -> Millis;
    /// The demo agent takes on the work it was given, as `handoffs accept` would.
    fn accept_work(&mut self, message: &str, agent: &str) -> Result<(), String>;
    /// The demo agent hands its finished work back, as `handoffs return` would.
    fn return_work(&mut self, message: &str, agent: &str, summary: &str) -> Result<(), String>;
}

/// What a write needs to know.
#[derive(Debug)]
pub struct Write<'a> {
    pub db: &'a Path,
    pub agent: &'a AgentRow,
    pub message: &'a MessageRow,
    pub text: &'a str,
    pub request_id: &'a str,
    /// The fencing token of the engine's lease on the recipient (an HTTP recipient gets it
    /// as `fence`; one that refuses a token smaller than one it saw closes the last window
    /// of fencing, a pause between the engine's check and the write leaving).
    pub fence: Option<i64>,
}

/// The adapters, by provider.
#[derive(Debug, Clone)]
pub struct Adapters {
    pub http: http::Http,
}

impl Default for Adapters {
    fn default() -> Self {
        Adapters::new()
    }
}

impl Adapters {
    /// Adapters on the real network.
    pub fn new() -> Adapters {
        Adapters::with_http(http::Http::real())
    }

    /// Adapters on another network (the simulation's).
    pub fn with_http(http: http::Http) -> Adapters {
        Adapters { http }
    }

    fn provider(agent: &AgentRow) -> Option<Provider> {
        agent.provider.parse::<Provider>().ok()
    }

    /// Whether the recipient is idle, busy, or cannot be verified.
    pub async fn activity(&self, service: &RefCell<dyn Host>, agent: &AgentRow) -> Activity {
        match Self::provider(agent) {
            Some(Provider::Command) => command::activity(self, service, agent).await,
            Some(Provider::Demo) => demo::activity(&mut *service.borrow_mut(), agent),
            Some(Provider::ClaudeCode) => claude::activity(service, agent),
            Some(Provider::Codex) => codex::activity(service, agent).await,
            None => Activity::Unknown {
                detail: format!("unknown provider {:?}", agent.provider),
            },
        }
    }

    /// The recipient's activity when the adapter can tell it without asking anyone: an HTTP
    /// command agent without an `activity_url` is taken as idle (the one-active-delivery
    /// rule keeps our writes apart). The engine then answers the activity checks inside the
    /// step's own transaction. `None`: ask [`Adapters::activity`].
    pub fn activity_without_io(agent: &AgentRow) -> Option<Activity> {
        match Self::provider(agent) {
            Some(Provider::Command) => command::activity_without_io(agent),
            _ => None,
        }
    }

    /// What became of the **accepted** write `request_id` when the adapter can tell without
    /// asking anyone: an HTTP command agent without a `status_url` took an accepted POST as a
    /// whole turn (SPEC §4). The engine asks only for an ACCEPTED delivery, and records the
    /// observation in the transaction of the pass that looks at it: the write result's own,
    /// which begins that pass at once (`engine::after_write`), or after a restart the next
    /// pass's. `None`: ask [`Adapters::observe`].
    pub fn observe_without_io(agent: &AgentRow, request_id: &str) -> Option<Observed> {
        match Self::provider(agent) {
            Some(Provider::Command) => command::observe_without_io(agent, request_id),
            _ => None,
        }
    }

    /// Gets ready to write; an error here means nothing was written.
    pub fn prepare(&self, _agent: &AgentRow) -> Result<(), String> {
        Ok(())
    }

    /// Writes one turn, once.
    pub async fn start(&self, service: &RefCell<dyn Host>, w: &Write<'_>) -> WriteOutcome {
        match Self::provider(w.agent) {
            Some(Provider::Command) => command::start(self, service, w).await,
            Some(Provider::Demo) => demo::start(&mut *service.borrow_mut(), w),
            Some(Provider::ClaudeCode) => claude::start(service, w).await,
            Some(Provider::Codex) => codex::start(service, w).await,
            _ => WriteOutcome::Refused {
                detail: format!("no adapter for provider {:?}", w.agent.provider),
            },
        }
    }

    /// What became of `request_id`.
    pub async fn observe(
        &self,
        service: &RefCell<dyn Host>,
        agent: &AgentRow,
        request_id: &str,
    ) -> Observed {
        match Self::provider(agent) {
            Some(Provider::Command) => command::observe(self, service, agent, request_id).await,
            Some(Provider::Demo) => demo::observe(&mut *service.borrow_mut(), agent, request_id),
            Some(Provider::ClaudeCode) => claude::observe(service, agent, request_id),
            Some(Provider::Codex) => codex::observe(service, agent, request_id).await,
            _ => Observed::Unreachable {
                detail: format!("no adapter for provider {:?}", agent.provider),
            },
        }
    }

    /// Searches the recipient's history for `request_id`.
    pub async fn scan(
        &self,
        service: &RefCell<dyn Host>,
        agent: &AgentRow,
        request_id: &str,
    ) -> ScanResult {
        match Self::provider(agent) {
            Some(Provider::Command) => command::scan(self, service, agent, request_id).await,
            Some(Provider::Demo) => demo::scan(&mut *service.borrow_mut(), request_id),
            Some(Provider::ClaudeCode) => claude::scan(service, agent, request_id),
            Some(Provider::Codex) => codex::scan(service, agent, request_id).await,
            _ => ScanResult::NothingFound { complete: false },
        }
    }

    /// How often an active delivery to this agent is observed, in milliseconds.
    pub fn observe_interval_ms(agent: &AgentRow) -> u64 {
        match Self::provider(agent) {
            // Without a status URL an accepted POST is returned: observe at once.
            Some(Provider::Command) if agent.settings.get("url").is_some() => {
                if agent.settings.get("status_url").is_some() {
                    2_000
                } else {
                    0
                }
            }
            // A finished run marks its delivery due itself; this only catches a vanished
            // supervisor.
            Some(Provider::Demo) => 250,
            _ => 1_000,
        }
    }
}

/// Checks an agent's adapter settings when it is registered (SPEC §4).
pub fn check_settings(provider: Provider, settings: &Value) -> Result<(), String> {
    match provider {
        Provider::Command => command::check_settings(settings),
        Provider::Demo => demo::check_settings(settings),
        Provider::ClaudeCode => claude::check_settings(settings),
        Provider::Codex => codex::check_settings(settings),
    }
}

/// Checks an agent's endpoint when it is registered: a Claude session or Codex thread id goes
/// into a program's arguments and a file name, so it is an id and nothing else (never an
/// option, never a path).
pub fn check_endpoint(provider: Provider, endpoint: &str) -> Result<(), String> {
    match provider {
        Provider::Codex | Provider::ClaudeCode => {
            let ok = !endpoint.is_empty()
                && !endpoint.starts_with('-')
                && endpoint
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
            if ok {
                Ok(())
            } else {
                Err(format!(
                    "--endpoint {endpoint:?} is not a {} id (letters, digits, '-' and '_', not starting with '-')",
                    if provider == Provider::Codex {
                        "Codex thread"
                    } else {
                        "Claude session"
                    }
                ))
            }
        }
        _ => Ok(()),
    }
}
