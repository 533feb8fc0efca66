//! The simulation itself: the same seed prints the same bytes, another seed differs, and a
//! planted bug is caught by a sweep within a bounded number of seeds, with the command that
//! replays it. Plain `#[test]`s: a turmoil simulation must not start inside a tokio runtime.

use handoffs::simulate;
use model::Policy;

#[test]
fn the_same_seed_prints_the_same_bytes_and_another_seed_differs() {
    let policy = Policy::default();
    let a = simulate::run(7, true, &policy).unwrap();
    let b = simulate::run(7, true, &policy).unwrap();
    assert!(a.ok, "seed 7 failed:\n{}", a.text);
    assert_eq!(a.text, b.text, "seed 7 printed different bytes twice");
    assert!(a.text.contains("trace:"), "{}", a.text);
    let c = simulate::run(8, false, &policy).unwrap();
    assert_ne!(a.text, c.text);
    assert!(c.ok, "seed 8 failed:\n{}", c.text);
}

/// Sweeps seeds from 1 until the planted bug is caught; at most `bound` seeds. The run that
/// catches it must fail `guarantee`'s own check (each plant proves one check; what else a
/// bug breaks downstream is printed), with the command that replays it.
#[cfg(feature = "planted-bugs")]
fn caught_within(bug: &str, guarantee: &str, bound: u64) {
    let policy: Policy = serde_json::from_str(&format!(r#"{{"planted_bug": "{bug}"}}"#)).unwrap();
    for seed in 1..=bound {
        let o = simulate::run(seed, false, &policy).unwrap();
        if !o.ok {
            assert!(
                o.text.contains("replay with: handoffs sim --seed"),
                "{}",
                o.text
            );
            let failed: Vec<&str> = o
                .text
                .lines()
                .filter(|l| l.contains(": FAILED ("))
                .filter_map(|l| l.split_whitespace().next())
                .collect();
            assert!(
                failed.contains(&guarantee),
                "{bug} must fail {guarantee}, but failed {failed:?} at seed {seed}:\n{}",
                o.text
            );
            eprintln!(
                "{bug}: caught by {} at seed {seed}; replay: \
                 HANDOFFS_POLICY='{{\"planted_bug\":\"{bug}\"}}' handoffs sim --seed {seed} --trace",
                failed.join("+")
            );
            return;
        }
    }
    panic!("the planted {bug} survived {bound} seeds");
}

#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_catches_sending_while_busy() {
    caught_within("send_while_busy", "G3", 20);
}

#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_catches_resending_from_uncertain() {
    caught_within("resend_from_uncertain", "G4", 20);
}

#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_catches_a_reservation_committed_after_the_write() {
    // The recipient looks the reservation up as the write arrives: G8 alone.
    caught_within("reserve_after_write", "G8", 20);
}

#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_catches_a_destination_resolved_at_write_time() {
    // Only seeds with a re-registration can show it: the agent moves to the spare host and
    // back while handoffs are queued for one of them.
    caught_within("resolve_at_write", "G1", 20);
}

#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_catches_a_skipped_activity_recheck_at_the_send_boundary() {
    // A person starts a turn right after the agent answered "idle": the boundary must see it.
    caught_within("skip_boundary_recheck", "G3", 20);
}

#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_catches_a_busy_answer_at_the_write_taken_for_a_refusal() {
    // A person starts a turn right after the boundary's "idle": the app answers 423.
    caught_within("busy_at_write_refused", "G3", 20);
}

#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_catches_a_cancel_that_leaves_pending_deliveries_to_be_written() {
    caught_within("cancel_leaves_pending", "chains", 20);
}

#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_catches_a_pass_that_writes_a_cancelled_chains_delivery_waiting_again() {
    caught_within("requeue_after_cancel", "chains", 20);
}

#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_catches_a_final_failure_not_kept_as_a_dead_letter() {
    caught_within("final_failure_not_kept", "dead", 40);
}

#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_catches_a_publish_that_misses_a_subscriber() {
    caught_within("publish_misses_subscriber", "topics", 10);
}

#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_catches_a_fan_out_deadline_that_never_joins() {
    caught_within("deadline_never_joins", "fanouts", 10);
}

#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_catches_a_cancel_that_lets_a_reserved_write_go_out() {
    caught_within("cancel_marks_reserved", "chains", 20);
}

#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_catches_a_spend_that_crosses_its_chains_budget() {
    caught_within("spend_past_budget", "budgets", 20);
}

#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_catches_unknown_activity_taken_for_idle() {
    caught_within("unknown_is_idle", "G3", 20);
}

#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_catches_an_uncertain_delivery_never_looked_at_again() {
    caught_within("scan_never_rescheduled", "liveness", 20);
}

#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_catches_a_write_of_unknown_outcome_written_again() {
    caught_within("retry_unknown_write", "G2", 20);
}

#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_catches_a_cancel_after_two_complete_scans() {
    // Shows only when a scan between two complete ones an hour apart cannot read the
    // recipient's history (a history outage).
    caught_within("cancel_early", "G5", 25);
}

#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_catches_an_attempt_spent_during_an_outage() {
    caught_within("ignore_outage", "G6", 20);
}

#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_catches_overdue_work_never_reminded() {
    caught_within("no_reminder", "G7", 20);
}

/// Sweeps seeds until a run's report says `text` (a violation's own words); at most `bound`.
#[cfg(feature = "planted-bugs")]
fn said_within(bug: &str, text: &str, bound: u64) {
    let policy: Policy = serde_json::from_str(&format!(r#"{{"planted_bug": "{bug}"}}"#)).unwrap();
    for seed in 1..=bound {
        let o = simulate::run(seed, false, &policy).unwrap();
        if let Some(line) = o.text.lines().find(|l| l.contains(text)) {
            assert!(!o.ok, "{}", o.text);
            eprintln!("{bug}: seed {seed} says: {}", line.trim());
            return;
        }
    }
    panic!("no run of {bug} in {bound} seeds said {text:?}");
}

/// SPEC §9: a Codex-like host folds a start into its running turn, so an engine that writes
/// into a busy session is caught by what the host did, in G3's own words.
#[cfg(feature = "planted-bugs")]
#[test]
fn a_codex_like_host_shows_a_naive_write_folded_into_a_running_turn() {
    said_within("send_while_busy", "(Codex-like) folded", 20);
}

/// SPEC §9: a Claude-like host forks its transcript on a resume beside a running turn.
#[cfg(feature = "planted-bugs")]
#[test]
fn a_claude_like_host_shows_a_naive_resume_forking_its_transcript() {
    said_within("send_while_busy", "(Claude-like) forked its transcript", 20);
}

/// Two engines share the database under recipient leases, each stalling as a whole now and
/// then right before a write, past its lease: every guarantee holds, and every write leaves
/// under the lease it was reserved under (the `fencing` check, exercised by each write).
#[test]
fn two_engines_that_stall_keep_every_guarantee_and_write_only_under_their_lease() {
    let policy = Policy::default();
    for seed in 1..=3 {
        let o = simulate::run_with_engines(seed, false, &policy, 2).unwrap();
        assert!(o.ok, "seed {seed} with two engines failed:\n{}", o.text);
        let fencing = o.verdicts.iter().find(|v| v.0 == "fencing");
        assert!(
            fencing.is_some_and(|v| v.1 > 0),
            "seed {seed}: the fencing check judged nothing:\n{}",
            o.text
        );
    }
    let one = simulate::run(1, false, &policy).unwrap();
    assert!(
        one.verdicts.iter().all(|v| v.0 != "fencing"),
        "one engine takes no leases: no fencing check"
    );
}

/// The write-time check of the lease removed (`no_write_fence`, a plant outside the delivery
/// rules, so the binary runs it): a stalled engine writes after the other engine took its
/// recipient, and the sweep of two engines catches it with the fencing check's own words.
#[cfg(feature = "planted-bugs")]
#[test]
fn a_sweep_of_two_engines_catches_a_write_without_its_lease_check() {
    for seed in 1..=5_u64 {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_handoffs"))
            .args(["sim", "--seed", &seed.to_string(), "--engines", "2"])
            .env("HANDOFFS_PLANT", "no_write_fence")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        if out.status.success() {
            continue;
        }
        assert!(
            text.lines()
                .any(|l| l.starts_with("fencing") && l.contains(": FAILED (")),
            "no_write_fence must fail the fencing check at seed {seed}:\n{text}"
        );
        let said = text
            .lines()
            .find(|l| l.contains("while the lease was at fence"))
            .unwrap_or_else(|| panic!("the fencing check's own words at seed {seed}:\n{text}"));
        eprintln!(
            "no_write_fence: caught by fencing at seed {seed}: {}",
            said.trim()
        );
        return;
    }
    panic!("the planted no_write_fence survived 5 seeds of two engines");
}
