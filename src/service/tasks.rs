//! The task ledger as the fronts use it: one registration check and one notification of the
//! next agent, the same from the CLI (`handoffs task pass`) and MCP (`pass_handoff`).

use super::{Result, Service, ServiceError};
use crate::service::ledger::{Ledger, Passed};
use serde::Serialize;
use serde_json::{Value, json};

/// What passing a task on did: the ledger's record, and how the next agent was told.
#[derive(Debug, Serialize)]
pub struct PassedOn {
    #[serde(flatten)]
    pub passed: Passed,
    /// `{"message_id"}` of the handoff that tells the next agent, or why none was sent.
    pub notice: Value,
}

/// What a pass carries besides who passes it.
#[derive(Debug)]
pub struct Pass<'a> {
    pub task_id: &'a str,
    pub token: &'a str,
    pub summary: &'a str,
    pub next_action: &'a str,
    pub changed_files: &'a [String],
    pub target: &'a str,
}

impl Service {
    /// `id` is a registered agent; else a clear refusal that says how to see the agents.
    pub fn check_registered(&mut self, id: &str) -> Result<()> {
        if self.agents()?.iter().any(|a| a.id == id) {
            Ok(())
        } else {
            Err(ServiceError::NotFound(format!(
                "unknown agent {id:?}: no agent of that id is registered"
            )))
        }
    }
}

/// `me` passes a task on to `p.target`: with a delivery database (`service`), the target
/// must be registered there and is sent a handoff saying the task waits for it; without
/// one, the ledger alone records the pass.
pub fn pass_task(
    service: Option<&mut Service>,
    ledger: &mut Ledger,
    me: &str,
    p: &Pass<'_>,
) -> Result<PassedOn> {
    let Some(service) = service else {
        let passed = pass_in_ledger(ledger, me, p)?;
        return Ok(PassedOn {
            passed,
            notice: json!("no delivery database; no message sent"),
        });
    };
    service.check_registered(me)?;
    service.check_registered(p.target)?;
    let passed = pass_in_ledger(ledger, me, p)?;
    let notice = notify(service, me, &passed, p);
    Ok(PassedOn { passed, notice })
}

fn pass_in_ledger(ledger: &mut Ledger, me: &str, p: &Pass<'_>) -> Result<Passed> {
    ledger.pass(
        me,
        p.task_id,
        p.token,
        p.summary,
        p.next_action,
        p.changed_files,
        p.target,
    )
}

/// Tells the next agent with a handoff (never to oneself). The pass is recorded already: a
/// send that fails is said in the notice, never an error that hides the pass.
fn notify(service: &mut Service, me: &str, passed: &Passed, p: &Pass<'_>) -> Value {
    if p.target == me {
        return json!("queued for yourself; no message sent");
    }
    let id = &passed.task.id;
    // The pass summary rides on the card within the summary cap (SPEC §8.2); the whole of it
    // is kept as an artifact, and in the ledger's brief.
    let summary = match service.bounded_text(p.summary, "pass", (me, p.target)) {
        Ok(s) => s,
        Err(e) => format!("(not shown: {e}; `handoffs task show {id}` has it)"),
    };
    let text = format!(
        "Task {id} ({}) is queued for you in the shared ledger. Next action: {}\n\
         Claim it (claim_handoff, or `handoffs task claim {id}`) before you change the workspace.\n\n\
         Summary of the pass:\n{summary}",
        passed.task.title, p.next_action
    );
    // One key per pass (the count of handoffs only grows): a send repeated for the same pass
    // returns the first message.
    let key = format!("task-pass:{id}:{}", passed.task.handoffs_used);
    match service.send(me, p.target, &text, None, None, Some(&key)) {
        Ok(sent) => json!({ "message_id": sent.message.id }),
        Err(e) => json!(format!(
            "the task is queued, but {} was not sent a message: {e}",
            p.target
        )),
    }
}
