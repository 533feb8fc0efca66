//! `handoffs task`: the task ledger on the command line.

use super::{Cli, Failure, TaskCmd, Value, emit, one_line, open, short, usage, when};

pub(super) fn task(cli: &Cli, cmd: &TaskCmd) -> Result<(), Failure> {
    use crate::service::ledger::{Ledger, find_root};
    let cwd = std::env::current_dir().map_err(|e| usage(format!("no current folder: {e}")))?;
    let mut l = Ledger::open_root(&find_root(&cwd)?)?;
    // With a delivery database at hand, agents named here must be registered there.
    let mut svc = open(cli).ok();
    let mut known = |id: &str| -> Result<(), Failure> {
        match svc.as_mut() {
            Some(s) => Ok(s.check_registered(id)?),
            None => Ok(()),
        }
    };
    let line = task_line;
    match cmd {
        TaskCmd::Create {
            actor,
            title,
            goal,
            constraints,
            target,
            cap,
        } => {
            known(&actor.as_agent)?;
            if let Some(t) = target {
                known(t)?;
            }
            let t = l.create(
                &actor.as_agent,
                title,
                goal,
                constraints.as_deref(),
                target.as_deref(),
                Some(*cap),
            )?;
            emit(cli, &t, || format!("created {}", line(&t)));
        }
        TaskCmd::Claim { id, actor, minutes } => {
            known(&actor.as_agent)?;
            let c = l.claim(&actor.as_agent, id, *minutes)?;
            // The claim's own list holds the sweep's warning too.
            let _ = l.take_warnings();
            for w in &c.warnings {
                eprintln!("handoffs: warning: {w}");
            }
            emit(cli, &c, || {
                format!(
                    "claimed {}\nlease token: {}\nuntil {}",
                    line(&c.task),
                    c.lease.token,
                    when(c.lease.expires_at)
                )
            });
        }
        TaskCmd::Renew {
            id,
            actor,
            token,
            minutes,
        } => {
            let lease = l.renew(&actor.as_agent, id, token, *minutes)?;
            emit(cli, &lease, || {
                format!("lease until {}", when(lease.expires_at))
            });
        }
        TaskCmd::Pass {
            id,
            actor,
            token,
            summary,
            next_action,
            files,
            target,
        } => {
            let pass = crate::service::tasks::Pass {
                task_id: id,
                token,
                summary,
                next_action,
                changed_files: files,
                target,
            };
            let p = crate::service::tasks::pass_task(svc.as_mut(), &mut l, &actor.as_agent, &pass)?;
            emit(cli, &p, || {
                let told = p
                    .notice
                    .get("message_id")
                    .and_then(Value::as_str)
                    .map_or_else(
                        || format!("; {}", p.notice.as_str().unwrap_or_default()),
                        |m| format!("; told with message {}", short(m)),
                    );
                format!(
                    "passed to {target}: {} ({} handoffs left){told}",
                    line(&p.passed.task),
                    p.passed.handoffs_left
                )
            });
        }
        TaskCmd::Complete {
            id,
            actor,
            token,
            summary,
            files,
        } => {
            let t = l.complete(&actor.as_agent, id, token, summary.as_deref(), files)?;
            emit(cli, &t, || format!("done {}", line(&t)));
        }
        TaskCmd::Show { id } => {
            let d = l.show(id)?;
            emit(cli, &d, || task_detail_text(&d));
        }
        TaskCmd::List { state, limit } => {
            let ts = l.list(state.as_deref(), *limit)?;
            emit(cli, &ts, || {
                if ts.is_empty() {
                    "no tasks".to_owned()
                } else {
                    ts.iter().map(|t| line(t) + "\n").collect()
                }
            });
        }
        TaskCmd::Resume {
            id,
            add,
            target,
            anyone,
            by,
        } => {
            if let Some(t) = target {
                known(t)?;
            }
            let target = if *anyone { Some("") } else { target.as_deref() };
            let t = l.resume(by, id, *add, target)?;
            emit(cli, &t, || format!("resumed {}", line(&t)));
        }
    }
    for w in l.take_warnings() {
        eprintln!("handoffs: warning: {w}");
    }
    Ok(())
}

/// One line per task: id, state, title, budget, owner, target.
pub(super) fn task_line(t: &crate::service::ledger::Task) -> String {
    format!(
        "{}  {:<11} {}  (budget {}/{}{}{})",
        short(&t.id),
        t.state,
        one_line(&t.title, 60),
        t.handoffs_used,
        t.handoff_cap,
        t.owner
            .as_deref()
            .map(|o| format!(", owner {o}"))
            .unwrap_or_default(),
        t.target_agent
            .as_deref()
            .map(|o| format!(", for {o}"))
            .unwrap_or_default(),
    )
}

/// `task show`: the brief, its lease and its history.
pub(super) fn task_detail_text(d: &crate::service::ledger::TaskDetail) -> String {
    let line = task_line;
    let t = &d.task;
    let mut out = format!("{}\ngoal: {}\n", line(t), t.goal);
    if let Some(c) = &t.constraints {
        out.push_str(&format!("constraints: {c}\n"));
    }
    if let Some(s) = &t.summary {
        out.push_str(&format!("summary: {s}\n"));
    }
    if let Some(n) = &t.next_action {
        out.push_str(&format!("next: {n}\n"));
    }
    if !t.changed_files.is_empty() {
        out.push_str(&format!("changed: {}\n", t.changed_files.join(", ")));
    }
    if let Some(lease) = &d.lease {
        out.push_str(&format!(
            "lease: {} until {}\n",
            lease.holder,
            when(lease.expires_at)
        ));
    }
    for e in &d.events {
        out.push_str(&format!(
            "{}  {:<13} {}  {}\n",
            when(e.at),
            e.kind,
            e.actor,
            e.detail
        ));
    }
    out
}
