//! The one commit path of a delivery step: the engine's every event and a person's release
//! both load the stored record, `step` it and record what changed in the same transaction
//! (SPEC §5: commit before effect).

use super::{Result, Service, ServiceError};
use crate::store::{AgentRow, Tx, millis};
use model::{Change, Delivery, Effect, Event, EventKind, Millis, Policy};

/// What one committed step left: the record, the effects it asks for, the recipient as
/// registered now, and what changed.
#[derive(Debug)]
pub struct Committed {
    pub record: Delivery,
    pub effects: Vec<Effect>,
    pub agent: Option<AgentRow>,
    pub change: Change,
}

/// When to look at a delivery again once a step has changed it (the engine's schedule; a
/// release needs none).
pub type Schedule<'a> = &'a dyn Fn(&Change, &Delivery, Option<&AgentRow>, Millis) -> Option<i64>;

impl Service {
    /// Applies one event to the stored delivery `id` in one transaction: the record as
    /// stored now (a person may have released it meanwhile, or the engine moved it), `step`
    /// under `policy`, the new record with when to look again, and its history line. An
    /// ignored or unchanged step records nothing.
    pub fn commit_step(
        &mut self,
        id: &str,
        policy: &Policy,
        event: impl FnOnce(&Tx<'_>) -> Result<EventKind>,
        schedule: Schedule<'_>,
    ) -> Result<Committed> {
        let now = self.now();
        let mut by_person = false;
        let committed = self.store.write(|tx| -> Result<Committed> {
            let row = tx
                .delivery(id)?
                .ok_or_else(|| ServiceError::NotFound(format!("no delivery {id}")))?;
            let kind = event(tx)?;
            by_person = matches!(kind, EventKind::Release { .. });
            let step = model::step(row.record.clone(), Event::new(now, kind), policy);
            let agent = tx.agent(&row.recipient)?;
            let committed = |step: model::Step, agent| Committed {
                record: step.record,
                effects: step.effects,
                agent,
                change: step.change,
            };
            if matches!(step.change, Change::Ignored { .. } | Change::Unchanged) {
                return Ok(committed(step, agent));
            }
            let due = schedule(&step.change, &step.record, agent.as_ref(), now);
            tx.save_delivery(id, &step.record, due, millis(now))?;
            let note_changed = step.record.core().note() != row.record.core().note();
            let freed = match step.change {
                Change::Moved { from, to } => {
                    !step.record.is_active()
                        && (from.class() == model::Class::Active
                            || to.class() == model::Class::Terminal)
                }
                _ => false,
            };
            if by_person {
                tx.event(millis(now), Some(id), "release", &step.record.detail())?;
            } else if let Change::Moved { from, to } = step.change {
                tx.event(
                    millis(now),
                    Some(id),
                    "state",
                    &format!("{from} → {to}: {}", step.record.detail()),
                )?;
            } else if note_changed && step.record.core().note().is_some() {
                tx.event(millis(now), Some(id), "note", &step.record.detail())?;
            }
            if freed || by_person {
                tx.wake_recipient(&row.recipient, millis(now))?;
            }
            Ok(committed(step, agent))
        })?;
        // Said once it is committed: a step rolled back never shows as a move.
        if by_person {
            tracing::info!(
                delivery = id,
                detail = %committed.record.detail(),
                "released by a person"
            );
        } else if let Change::Moved { from, to } = committed.change {
            tracing::info!(
                delivery = id,
                recipient = %committed.record.core().target().agent,
                %from,
                %to,
                detail = %committed.record.detail(),
                "delivery moved"
            );
        }
        Ok(committed)
    }
}
