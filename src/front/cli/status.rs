//! `handoffs status`: the overview, or one delivery with its history, as text or JSON.

use super::{Cli, Failure, Serialize, emit, one_line, open, short, when};

/// `status` without an id: the overview and the handoffs no engine has taken up yet.
#[derive(Serialize)]
pub(super) struct StatusOut<'a> {
    #[serde(flatten)]
    overview: &'a crate::service::Overview,
    waiting_for_engine: &'a [crate::service::Unenrolled],
}

pub(super) fn status(cli: &Cli, id: Option<&str>) -> Result<(), Failure> {
    let mut s = open(cli)?;
    if let Some(id) = id {
        let d = s.delivery(id)?;
        emit(cli, &d, || {
            let v = &d.delivery;
            let mut out = format!(
                "{} {} → {}  {}\n{}\nattempts: {}  request: {}\n",
                v.id, v.from, v.to, v.state, v.detail, v.attempts, v.request_id
            );
            if !v.earlier_request_ids.is_empty() {
                out.push_str(&format!(
                    "earlier requests: {}\n",
                    v.earlier_request_ids.join(", ")
                ));
            }
            out.push_str("history:\n");
            for e in &d.events {
                out.push_str(&format!("  {}  {}  {}\n", when(e.at), e.kind, e.detail));
            }
            out
        });
        return Ok(());
    }
    let o = s.overview(20)?;
    let waiting = s.waiting_for_engine(20)?;
    let status = StatusOut {
        overview: &o,
        waiting_for_engine: &waiting,
    };
    emit(cli, &status, || {
        let mut out = String::new();
        let section = |out: &mut String, title: &str, items: &[crate::service::DeliveryView]| {
            out.push_str(&format!("{title} ({})\n", items.len()));
            for v in items {
                out.push_str(&format!(
                    "  {}  {} → {}  {}  {}\n",
                    short(&v.id),
                    v.from,
                    v.to,
                    v.state,
                    one_line(&v.detail, 90)
                ));
            }
        };
        if !waiting.is_empty() {
            out.push_str(&format!(
                "waiting for an engine ({}){}\n",
                waiting.len(),
                if o.engine_reported_at.is_none() {
                    ": start one with `handoffs run` or `handoffs tick`"
                } else {
                    ""
                }
            ));
            for m in &waiting {
                out.push_str(&format!(
                    "  {}  {} → {}  {}\n",
                    short(&m.id),
                    m.from,
                    m.to,
                    one_line(m.title.as_deref().unwrap_or(&m.preview), 90)
                ));
            }
        }
        section(&mut out, "queued", &o.queued);
        section(&mut out, "in flight", &o.in_flight);
        section(&mut out, "needs attention", &o.needs_attention);
        if !o.damaged.is_empty() {
            out.push_str(&format!(
                "damaged ({}): never acted on; repair or restore the database\n",
                o.damaged.len()
            ));
            for d in &o.damaged {
                out.push_str(&format!("  {d}\n"));
            }
        }
        if !o.overdue_work.is_empty() {
            out.push_str(&format!("overdue work ({})\n", o.overdue_work.len()));
            for w in &o.overdue_work {
                out.push_str(&format!(
                    "  {}  {} → {}  {}\n",
                    short(&w.id),
                    w.sender,
                    w.recipient,
                    w.title
                ));
            }
        }
        section(&mut out, "recent", &o.recent);
        match o.engine_health {
            crate::service::EngineHealth::Running { reported_at } => {
                out.push_str(&format!("engine: last pass {}\n", when(reported_at)));
            }
            crate::service::EngineHealth::OneShot { reported_at } => out.push_str(&format!(
                "engine: last pass {} was a one-shot `tick`; nothing is delivered until `handoffs run` or `serve` runs\n",
                when(reported_at)
            )),
            crate::service::EngineHealth::Quiet { reported_at } => out.push_str(&format!(
                "engine: not running (last pass {}); nothing is delivered until `handoffs run` or `serve` runs\n",
                when(reported_at)
            )),
            crate::service::EngineHealth::Never => out.push_str(
                "engine: no pass yet; start one with `handoffs run` or `handoffs tick`\n",
            ),
        }
        if !o.engine_policy_differs.is_empty() {
            out.push_str(&format!(
                "engine: timings differ from SPEC (HANDOFFS_POLICY): {}\n",
                o.engine_policy_differs.join(", ")
            ));
        }
        let mut engines: Vec<(&str, Vec<&str>)> = Vec::new();
        for l in o.leases.iter().filter(|l| !l.agent.starts_with('~')) {
            match engines.iter_mut().find(|(e, _)| *e == l.engine) {
                Some((_, agents)) => agents.push(&l.agent),
                None => engines.push((&l.engine, vec![&l.agent])),
            }
        }
        if engines.len() > 1 {
            for (engine, agents) in engines {
                out.push_str(&format!("engine {engine} serves {}\n", agents.join(", ")));
            }
        }
        for u in &o.unserved {
            out.push_str(&format!(
                "no engine serves {}: it is served only on {}, and no engine there has taken it (start `handoffs run` on {})\n",
                u.agent, u.host, u.host
            ));
        }
        out
    });
    Ok(())
}
