//! `handoffs tick`, `run` and `sim`: the engine and the simulation from the command line.

use super::{
    Cli, Duration, Engine, EngineError, Failure, Service, emit, json, out, runtime, usage,
};

pub(super) fn engine_cmd(cli: &Cli, interval: Option<Duration>) -> Result<(), Failure> {
    let lease_ms = crate::service::leases::lease_ms_from_env().map_err(usage)?;
    let mut restarts = crate::engine::restarts::Restarts::default();
    loop {
        let service = open_or_wait(cli, interval.is_some())?;
        let again = interval.is_some() && service.is_postgres();
        let engine = match Engine::new(service, interval.is_none()) {
            Ok(e) => e.with_lease_ms(lease_ms),
            Err(EngineError::Busy) => {
                let msg = "another engine is delivering for this database; this pass is skipped";
                if interval.is_some() {
                    // A long-running engine that stays away says so where a log catches it.
                    eprintln!("handoffs: {msg}");
                }
                emit(cli, &json!({"skipped": msg}), || msg.to_owned());
                return Ok(());
            }
            Err(e) => {
                return Err(Failure {
                    code: 1,
                    message: e.to_string(),
                });
            }
        };
        let started = std::time::Instant::now();
        match deliver(cli, engine, interval) {
            // On PostgreSQL an engine that failed starts again on a new session, after a
            // pause that grows while it keeps failing (`engine::restarts`).
            Err(f) if again && f.code == 1 => {
                let pause = restarts.after(started.elapsed());
                eprintln!(
                    "handoffs: {}; starting again on a new session in {} s",
                    f.message,
                    pause.as_secs()
                );
                pause_unless_stopped(pause)?;
            }
            other => return other,
        }
    }
}

/// The database's service; a long-running engine (`run`, `serve`) that cannot reach a
/// PostgreSQL server, or finds no schema there yet, tries again (every second, saying so
/// once) instead of exiting, so that a server's restart, or engines started beside their
/// server (compose.yaml), does not leave a team without its engines.
pub(super) fn open_or_wait(cli: &Cli, keep_trying: bool) -> Result<Service, Failure> {
    wait_for_server(cli, keep_trying, || Service::open(&super::db_path(cli)))
}

/// `attempt` until it succeeds, every second, saying its first failure once, while the
/// database is on a PostgreSQL server, `keep_trying`, and the failure is one that may pass
/// (`service::worth_waiting_for`: a wrong password or another application's database ends
/// it at once); Ctrl+C or SIGTERM ends the wait.
pub(super) fn wait_for_server<T>(
    cli: &Cli,
    keep_trying: bool,
    attempt: impl Fn() -> Result<T, crate::service::StoreError>,
) -> Result<T, Failure> {
    let mut said = false;
    loop {
        match attempt() {
            Err(e)
                if keep_trying
                    && crate::service::is_postgres_url(&super::db_path(cli))
                    && crate::service::worth_waiting_for(&e) =>
            {
                if !said {
                    eprintln!("handoffs: {e}; trying again every second");
                    said = true;
                }
                pause_unless_stopped(std::time::Duration::from_secs(1))?;
            }
            other => return Ok(other?),
        }
    }
}

/// Waits `pause`, unless asked to stop meanwhile (Ctrl+C or SIGTERM): then the failure that
/// ends `run` with that signal's code, as a stop while it delivers does (a plain sleep left
/// the signal to its default action: the process died of it, with no exit code and no word).
fn pause_unless_stopped(pause: Duration) -> Result<(), Failure> {
    let stopped = runtime()?.block_on(async {
        tokio::select! {
            () = tokio::time::sleep(pause) => None,
            code = crate::front::live::stop_signal(false) => Some(code),
        }
    });
    match stopped {
        None => Ok(()),
        Some(code) => Err(Failure {
            code,
            message: "stopped".to_owned(),
        }),
    }
}

/// Runs `engine`: one pass (`tick`), or until stopped (`run`).
fn deliver(cli: &Cli, mut engine: Engine, interval: Option<Duration>) -> Result<(), Failure> {
    if std::env::var_os("HANDOFFS_POLICY").is_some() {
        // Shorter bounds for tests and drills, e.g. {"sending_timeout_ms": 1000}.
        engine = engine.with_policy(policy_from_env()?);
    }
    let rt = runtime()?;
    match interval {
        None => {
            let report = rt.block_on(engine.pass());
            emit(cli, &report, || {
                let mut out = format!(
                    "pass: looked at {}, moved {}, wrote {}, enrolled {}, reminders {}, {} ms",
                    report.looked_at,
                    report.moved,
                    report.writes,
                    report.enrolled,
                    report.reminders,
                    report.took_ms
                );
                for e in &report.errors {
                    out.push_str(&format!("\nerror: {e}"));
                }
                out
            });
            Ok(())
        }
        Some(interval) => {
            // Ctrl+C and SIGTERM (a service manager) stop it alike: no new job, running ones
            // get their grace; the exit code says which signal it was. SIGHUP does not: an
            // engine started with `nohup` outlives its terminal.
            let stopped_by = std::sync::Arc::new(std::sync::atomic::AtomicU8::new(0));
            let code = stopped_by.clone();
            tracing::info!(pid = std::process::id(), "engine started");
            let ran = rt.block_on(engine.run(interval, async move {
                let signal = crate::front::live::stop_signal(false).await;
                code.store(signal, std::sync::atomic::Ordering::SeqCst);
            }));
            // Asked to stop: it stops, whatever its last flush said.
            let signal = stopped_by.load(std::sync::atomic::Ordering::SeqCst);
            if signal == 0 {
                ran.map_err(|message| Failure { code: 1, message })?;
            } else if let Err(e) = ran {
                eprintln!("handoffs: {e}");
            }
            match signal {
                0 => Ok(()),
                code => Err(Failure {
                    code,
                    message: "stopped".to_owned(),
                }),
            }
        }
    }
}

/// `handoffs sim`: runs before any runtime exists (a turmoil simulation builds its own).
pub(super) fn sim_cmd(
    cli: &Cli,
    seed: Option<u64>,
    seeds: Option<&str>,
    trace: bool,
    engines: usize,
) -> Result<(), Failure> {
    let policy = policy_from_env()?;
    // A planted bug replays only in a build that has it.
    let replay_env = std::env::var("HANDOFFS_POLICY")
        .map(|p| {
            let build = if p.contains("planted_bug") {
                "(a build with --features planted-bugs) "
            } else {
                ""
            };
            format!("{build}HANDOFFS_POLICY='{p}' ")
        })
        .unwrap_or_default();
    let failed = |seeds: &[u64]| Failure {
        code: 1,
        message: format!(
            "guarantees failed for seed{} {}",
            if seeds.len() == 1 { "" } else { "s" },
            seeds
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    if let Some(range) = seeds {
        let (a, b) = range
            .split_once("..")
            .and_then(|(a, b)| Some((a.trim().parse::<u64>().ok()?, b.trim().parse::<u64>().ok()?)))
            .filter(|(a, b)| a <= b)
            .ok_or_else(|| {
                usage(format!(
                    "--seeds takes FROM..TO, like 1..200 (got {range:?})"
                ))
            })?;
        let started = std::time::Instant::now();
        let sweep = crate::simulate::sweep(a, b, &policy, engines, |o| {
            if !o.ok {
                if cli.json {
                    out(&json!({"seed": o.seed, "ok": false, "report": o.text}).to_string());
                } else {
                    eprintln!(
                        "seed {} FAILED; replay: {replay_env}handoffs sim --seed {} --trace",
                        o.seed, o.seed
                    );
                }
            }
        })
        .map_err(|message| Failure { code: 1, message })?;
        let wall = started.elapsed();
        let hours = sweep.virtual_time.as_secs_f64() / 3_600.0;
        emit(
            cli,
            &json!({
                "runs": sweep.runs,
                "virtual_hours": hours,
                "wall_seconds": wall.as_secs_f64(),
                "failures": sweep.failures,
                "exercised": sweep.exercised.iter().map(|(k, runs, total)| {
                    json!({"check": k, "runs": runs, "checks": total})
                }).collect::<Vec<_>>(),
            }),
            || {
                format!(
                    "{}{} runs, {hours:.1} virtual hours in {:.1} s of wall time ({:.0}× faster, {:.2} s a run), {} failed",
                    sweep.exercised_lines(),
                    sweep.runs,
                    wall.as_secs_f64(),
                    sweep.virtual_time.as_secs_f64() / wall.as_secs_f64().max(1e-9),
                    wall.as_secs_f64()
                        / f64::from(u32::try_from(sweep.runs.max(1)).unwrap_or(u32::MAX)),
                    sweep.failures.len()
                )
            },
        );
        return if sweep.failures.is_empty() {
            Ok(())
        } else {
            Err(failed(&sweep.failures))
        };
    }
    let seed = seed.unwrap_or(1);
    let outcome = crate::simulate::run_with_engines(seed, trace, &policy, engines)
        .map_err(|message| Failure { code: 1, message })?;
    let mut text = outcome.text.clone();
    if !outcome.ok && !replay_env.is_empty() {
        text.push_str(&format!(
            "replay this policy with: {replay_env}handoffs sim --seed {seed} --trace{}\n",
            if engines > 1 { " --engines 2" } else { "" }
        ));
    }
    emit(
        cli,
        &json!({"seed": seed, "ok": outcome.ok, "virtual_ms": outcome.virtual_time.as_millis(), "report": text}),
        || text.clone(),
    );
    if outcome.ok {
        Ok(())
    } else {
        Err(failed(&[seed]))
    }
}

/// The engine's policy: the default, or `HANDOFFS_POLICY` (JSON, any subset of the bounds),
/// which may shorten SPEC §2's timings but never raise its limits (`check_against_spec`).
pub(super) fn policy_from_env() -> Result<model::Policy, Failure> {
    match std::env::var_os("HANDOFFS_POLICY") {
        None => Ok(model::Policy::default()),
        Some(raw) => {
            let policy: model::Policy = serde_json::from_str(&raw.to_string_lossy())
                .map_err(|e| usage(format!("HANDOFFS_POLICY is not a valid policy: {e}")))?;
            policy
                .check_against_spec()
                .map_err(|e| usage(format!("HANDOFFS_POLICY: {e}")))?;
            Ok(policy)
        }
    }
}
