//! The demo adapter: simulated agents that live in the database. A turn is a row in `runs`
//! that ends after `turn_seconds / speed`; when the engine observes it finished, the demo
//! agent does what a real one would: it returns work it was given.

use super::Host;
use super::Write;
use crate::store::{AgentRow, RunRow, millis};
use model::{Activity, Observed, ScanResult, TurnId, WriteOutcome};
use serde_json::Value;

const TURN_SECONDS_DEFAULT: f64 = 3.0;

pub fn check_settings(settings: &Value) -> Result<(), String> {
    for key in ["turn_seconds", "speed"] {
        if let Some(v) = settings.get(key) {
            match v.as_f64() {
                Some(x) if x > 0.0 && x <= 86_400.0 => {}
                _ => return Err(format!("demo setting {key} must be a number above 0")),
            }
        }
    }
    Ok(())
}

fn turn_ms(agent: &AgentRow) -> i64 {
    let secs = agent
        .settings
        .get("turn_seconds")
        .and_then(Value::as_f64)
        .unwrap_or(TURN_SECONDS_DEFAULT);
    let speed = agent
        .settings
        .get("speed")
        .and_then(Value::as_f64)
        .unwrap_or(1.0);
    #[allow(clippy::cast_possible_truncation)]
    let ms = (secs / speed * 1000.0).round() as i64;
    ms.max(1)
}

pub fn activity(service: &mut dyn Host, agent: &AgentRow) -> Activity {
    let now = millis(service.now());
    let open = service.runs().open_runs_for(&agent.id);
    match open {
        Ok(runs) => match runs.iter().find(|r| r.ends_at.is_some_and(|e| e > now)) {
            Some(r) => Activity::Busy {
                turn: Some(TurnId::new(&r.request_id)),
                detail: None,
            },
            None => Activity::Idle,
        },
        Err(e) => Activity::Unknown {
            detail: e.to_string(),
        },
    }
}

pub fn start(service: &mut dyn Host, w: &Write<'_>) -> WriteOutcome {
    let now = millis(service.now());
    let row = RunRow {
        request_id: w.request_id.to_owned(),
        message_id: w.message.id.clone(),
        agent: w.agent.id.clone(),
        pid: None,
        started_at: now,
        ends_at: Some(now + turn_ms(w.agent)),
        ended_at: None,
        exit_code: None,
        outcome: None,
        detail: None,
    };
    match service.runs().insert_run(&row) {
        Ok(()) => {
            // The demo agent takes on work it was given as its turn starts, as a real one
            // would with `handoffs accept`.
            if w.message.kind == "work"
                && let Err(e) = service.accept_work(&w.message.id, &w.agent.id)
            {
                tracing::debug!(error = %e, "demo agent could not accept work");
            }
            WriteOutcome::Receipt {
                turn: TurnId::new(w.request_id),
                request_id: Some(model::RequestId::new(w.request_id)),
            }
        }
        Err(e) => WriteOutcome::Failed {
            detail: e.to_string(),
        },
    }
}

pub fn observe(service: &mut dyn Host, agent: &AgentRow, request_id: &str) -> Observed {
    let now = millis(service.now());
    let run = match service.runs().run(request_id) {
        Ok(r) => r,
        Err(e) => {
            return Observed::Unreachable {
                detail: e.to_string(),
            };
        }
    };
    let Some(run) = run else {
        return Observed::NotFound;
    };
    let turn = TurnId::new(request_id);
    if run.outcome.is_some() || run.ends_at.is_some_and(|e| e <= now) {
        if run.outcome.is_none() {
            finish(service, agent, &run, now);
        }
        Observed::Returned { turn }
    } else {
        Observed::Running { turn }
    }
}

/// The demo agent's turn ends: it returns the work it was given, as a real agent would
/// with `handoffs return`.
fn finish(service: &mut dyn Host, agent: &AgentRow, run: &RunRow, now: i64) {
    let _ = service
        .runs()
        .finish_run(&run.request_id, now, Some(0), "returned", None);
    let message = service.runs().run_message(&run.message_id).ok().flatten();
    if let Some(m) = message
        && m.kind == "work"
        && let Some(title) = &m.title
    {
        let summary = format!("{} finished \"{title}\"", agent.name);
        if let Err(e) = service.return_work(&m.id, &agent.id, &summary) {
            tracing::debug!(error = %e, "demo agent could not return work");
        }
    }
}

pub fn scan(service: &mut dyn Host, request_id: &str) -> ScanResult {
    match service.runs().run(request_id) {
        Ok(Some(_)) => ScanResult::Found {
            observed: Observed::Running {
                turn: TurnId::new(request_id),
            },
        },
        Ok(None) => ScanResult::NothingFound { complete: true },
        Err(_) => ScanResult::NothingFound { complete: false },
    }
}
