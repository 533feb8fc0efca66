//! The snapshot as the page and Prometheus read it: the service's board rendered to the
//! status JSON (plain words instead of adapter details on the public demo) and to the
//! metrics text. Rendering only: every state, reason and total is decided in `service`.

use super::{
    Attention, Board, Bytes, ChainInFlight, DeliveryView, LIST_LIMIT, Service, ServiceError,
    Snapshot, StateKind, TIMING_SAMPLES, Value, WebOptions, json, median,
};

pub(super) fn plain_event(kind: &str) -> &'static str {
    match kind {
        "sent" => "a handoff was sent",
        "delivery" => "a delivery changed state",
        "work" => "work moved on",
        "read" => "a message was read",
        "release" => "a person released a delivery",
        "reminder" => "an overdue reminder was sent",
        _ => "something changed",
    }
}

pub(super) fn plain_detail(state: StateKind) -> &'static str {
    match state {
        StateKind::Waiting => "queued for its turn",
        StateKind::Busy => "waiting for the recipient to finish its current turn",
        StateKind::Sending => "being written into the recipient's session",
        StateKind::Accepted | StateKind::Running => "the recipient is working on it",
        StateKind::Returned => "the recipient's turn finished",
        StateKind::Acknowledged => "done",
        StateKind::Cancelled => "released by a person",
        StateKind::Failed => "could not be delivered",
        StateKind::Duplicate => "the same message was already on its way",
        _ => "",
    }
}

/// Histogram buckets for delivery times, in seconds.
const BUCKETS_S: [f64; 9] = [
    1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3_600.0, 14_400.0, 86_400.0,
];

pub(super) fn histogram(out: &mut String, name: &str, help: &str, samples_ms: &[i64]) {
    out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
    for b in BUCKETS_S {
        #[allow(clippy::cast_precision_loss)]
        let n = samples_ms
            .iter()
            .filter(|&&ms| (ms as f64) / 1000.0 <= b)
            .count();
        out.push_str(&format!("{name}_bucket{{le=\"{b}\"}} {n}\n"));
    }
    #[allow(clippy::cast_precision_loss)]
    // `+ 0.0`: an empty sum of floats is -0.0, which would print as "-0".
    let sum: f64 = samples_ms.iter().map(|&ms| ms as f64 / 1000.0).sum::<f64>() + 0.0;
    out.push_str(&format!(
        "{name}_bucket{{le=\"+Inf\"}} {n}\n{name}_sum {sum}\n{name}_count {n}\n",
        n = samples_ms.len()
    ));
}

/// Builds the status document and the metrics text from the service's board.
pub fn build(svc: &mut Service, options: &WebOptions) -> Result<Snapshot, ServiceError> {
    let board = svc.board(LIST_LIMIT)?;
    let status = status_json(&board, options.public_demo);
    let engine_alive = board.overview.engine_health.alive();
    let content = {
        use std::hash::{Hash as _, Hasher as _};
        let mut steady = status.clone();
        steady["generated_at"] = Value::Null;
        steady["engine"] = json!({ "alive": engine_alive });
        let mut h = std::collections::hash_map::DefaultHasher::new();
        steady.to_string().hash(&mut h);
        h.finish()
    };
    Ok(Snapshot {
        content,
        status: Bytes::from(serde_json::to_vec(&status).unwrap_or_default()),
        metrics: metrics_text(&board),
        engine_alive,
    })
}

/// The page's status document (`/api/status`): the board, with adapters' details replaced by
/// plain words on the public demo.
pub(super) fn status_json(b: &Board, public: bool) -> Value {
    let o = &b.overview;
    let delivery = |d: &DeliveryView, reason: Option<&str>| -> Value {
        let mut v = json!({
            "id": d.id, "from": d.from, "to": d.to, "title": d.title,
            "preview": b.previews.get(&d.id).cloned().unwrap_or_default(),
            "state": d.state, "attempts": d.attempts,
            "detail": if public { plain_detail(d.state).to_owned() } else { d.detail.clone() },
            "enrolled_at": d.enrolled_at, "updated_at": d.updated_at,
        });
        if let Some(r) = reason {
            v["reason"] = json!(r);
        }
        v
    };
    let needs: Vec<Value> = b
        .attention
        .iter()
        .map(|a| match a {
            Attention::Delivery { view, reason } => delivery(view, Some(reason)),
            Attention::Overdue { work: w, reason } => json!({
                "id": w.id, "from": w.sender, "to": w.recipient, "title": w.title,
                "preview": "", "state": "OVERDUE", "attempts": 0, "detail": "",
                "reason": reason, "enrolled_at": w.created_at, "updated_at": w.updated_at,
            }),
            Attention::Chain { chain: c, reason } => json!({
                "id": c.id, "from": c.origin, "to": "", "title": "chain stopped",
                "preview": "", "state": "CHAIN_STOPPED", "attempts": c.hops,
                "detail": if public { Some("stopped by its budget or depth limit") } else { c.stopped_reason.as_deref() },
                "reason": if public { "A chain stopped by its budget or depth limit." } else { reason.as_str() },
                "enrolled_at": c.created_at,
                "updated_at": c.updated_at,
            }),
        })
        .collect();
    let counts: serde_json::Map<String, Value> = o
        .counts
        .iter()
        .map(|(k, n)| (k.clone(), json!(n)))
        .collect();
    let tail = |v: &[i64]| -> Vec<i64> {
        let n = usize::try_from(TIMING_SAMPLES).unwrap_or(200);
        v[v.len().saturating_sub(n)..].to_vec()
    };
    let t = &b.timings;
    json!({
        "generated_at": b.generated_at,
        "public_demo": public,
        "can_send": !public,
        "engine": {
            "alive": o.engine_health.alive(),
            "reported_at": o.engine_reported_at,
            "report": if public { Value::Null } else { o.engine.clone().unwrap_or(Value::Null) },
        },
        "counts": counts,
        "in_flight": o.in_flight.iter().chain(&o.queued).map(|d| delivery(d, None)).collect::<Vec<_>>(),
        "needs_attention": needs,
        "recent": o.recent.iter().map(|d| delivery(d, None)).collect::<Vec<_>>(),
        "agents": b.agents,
        "totals": {
            "in_flight": b.totals.in_flight,
            "needs_attention": b.totals.needs_attention,
            "open_work": b.totals.open_work,
            "overdue": b.totals.overdue,
        },
        "open_work": b.open_work.iter().map(|ow| { let w = &ow.work; json!({
            "id": w.id, "sender": w.sender, "recipient": w.recipient, "title": w.title,
            "state": w.state, "due_at": w.due_at, "overdue": ow.overdue,
            "summary": w.summary, "created_at": w.created_at, "updated_at": w.updated_at,
        })}).collect::<Vec<_>>(),
        "timings": {
            "send_to_accept_ms": tail(&t.send_to_accept_ms),
            "accept_to_return_ms": tail(&t.accept_to_return_ms),
            "send_to_accept_p50_ms": median(&t.send_to_accept_ms),
            "accept_to_return_p50_ms": median(&t.accept_to_return_ms),
        },
        "last_event_id": b.last_event_seq,
        "chains": b.chains.iter().map(|ChainInFlight { chain: c, first }| json!({
            "id": c.id, "first": first, "origin": c.origin, "state": c.state,
            "hops": c.hops, "hop_budget": c.hop_budget, "depth_limit": c.depth_limit,
            "units": c.units.lines.iter().map(|(u, l)| (u.clone(), json!({"spent": l.spent, "limit": l.limit}))).collect::<serde_json::Map<_, _>>(),
            "stopped_reason": if public { None } else { c.stopped_reason.as_deref() },
            "created_at": c.created_at, "updated_at": c.updated_at,
        })).collect::<Vec<_>>(),
        "topics": b.topics.iter().map(|t| json!({
            "name": t.name, "last_position": t.last_position, "retained": t.retained,
            "subscribers": t.subscribers, "keep_count": t.keep_count,
            "keep_minutes": t.keep_minutes,
        })).collect::<Vec<_>>(),
        "fanouts": b.fanouts.iter().map(|v| { let f = &v.fanout; json!({
            "id": f.id, "sender": f.sender, "title": f.title, "join": f.join_rule,
            "quorum": f.quorum, "children": f.children, "answered": v.answered,
            "deadline_at": f.deadline_at, "created_at": f.created_at,
            "waiting_on": v.children.iter().filter(|c| c.answered_at.is_none()).map(|c| c.recipient.as_str()).collect::<Vec<_>>(),
        })}).collect::<Vec<_>>(),
        "dead_letters": {
            "counts": b.dead_counts.iter().map(|(r, n)| (r.clone(), json!(n))).collect::<serde_json::Map<_, _>>(),
            "newest": b.dead_letters.iter().map(|d| json!({
                "id": d.id, "from": d.sender, "to": d.recipient, "reason": d.reason,
                "detail": if public { "" } else { d.detail.as_str() }, "title": d.title,
                "preview": crate::text::one_line(&d.body, 140), "created_at": d.created_at,
            })).collect::<Vec<_>>(),
        },
    })
}

/// The Prometheus text of `/metrics`.
pub(super) fn metrics_text(b: &Board) -> String {
    let o = &b.overview;
    let mut m = String::new();
    m.push_str(
        "# HELP handoffs_deliveries Deliveries by state.\n# TYPE handoffs_deliveries gauge\n",
    );
    for (state, n) in &o.counts {
        m.push_str(&format!("handoffs_deliveries{{state=\"{state}\"}} {n}\n"));
    }
    m.push_str(
        "# HELP handoffs_dead_letters Dead letters not yet replayed or dropped, by reason.\n# TYPE handoffs_dead_letters gauge\n",
    );
    for reason in crate::service::dead::Reason::ALL {
        let n = b
            .dead_counts
            .iter()
            .find(|(r, _)| r == reason.as_str())
            .map_or(0, |(_, n)| *n);
        m.push_str(&format!(
            "handoffs_dead_letters{{reason=\"{}\"}} {n}\n",
            reason.as_str()
        ));
    }
    m.push_str(&format!(
        "# HELP handoffs_delivery_attempts_total Writes into recipients' sessions, over all deliveries.\n\
         # TYPE handoffs_delivery_attempts_total counter\nhandoffs_delivery_attempts_total {}\n\
         # HELP handoffs_delivery_resends_total Bounded resends (after an error or an interrupted turn).\n\
         # TYPE handoffs_delivery_resends_total counter\nhandoffs_delivery_resends_total {}\n",
        b.totals.attempts, b.totals.resends
    ));
    m.push_str(&format!(
        "# HELP handoffs_topic_publishes_total Posts published on topics, over all topics.\n\
         # TYPE handoffs_topic_publishes_total counter\nhandoffs_topic_publishes_total {}\n",
        b.publishes
    ));
    m.push_str(&format!(
        "# HELP handoffs_fanout_joins_total Fan-outs joined, complete or partial (their deadline cut them).\n\
         # TYPE handoffs_fanout_joins_total counter\n\
         handoffs_fanout_joins_total{{result=\"complete\"}} {}\n\
         handoffs_fanout_joins_total{{result=\"partial\"}} {}\n",
        b.joins.0, b.joins.1
    ));
    m.push_str(&format!(
        "# HELP handoffs_open_work Work not yet closed.\n# TYPE handoffs_open_work gauge\nhandoffs_open_work {}\n",
        b.totals.open_work
    ));
    histogram(
        &mut m,
        "handoffs_send_to_accept_seconds",
        "Time from sending work to its acceptance.",
        &b.timings.send_to_accept_ms,
    );
    histogram(
        &mut m,
        "handoffs_accept_to_return_seconds",
        "Time from accepting work to returning it.",
        &b.timings.accept_to_return_ms,
    );
    let pass_ms = o
        .engine
        .as_ref()
        .and_then(|r| r.get("pass_ms_max"))
        .and_then(Value::as_f64);
    m.push_str("# HELP handoffs_engine_pass_duration_seconds The longest engine pass (housekeeping, the due query, starting jobs) in its last report.\n# TYPE handoffs_engine_pass_duration_seconds gauge\n");
    m.push_str(&format!(
        "handoffs_engine_pass_duration_seconds {}\n",
        pass_ms.map_or("NaN".to_owned(), |ms| (ms / 1000.0).to_string())
    ));
    m.push_str(&format!(
        "# HELP handoffs_engine_up Whether an engine reported in the last 2 minutes.\n# TYPE handoffs_engine_up gauge\nhandoffs_engine_up {}\n",
        u8::from(o.engine_health.alive())
    ));
    m
}
