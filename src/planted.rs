//! Bugs planted on purpose, so a test can show that the check for a guarantee fails when the
//! product breaks it. The delivery rules' own plants live in `model::PlantedBug` (set through
//! the policy, so the model checker and the simulation sweep them); every plant outside the
//! model is one variant here, switched on by name in `HANDOFFS_PLANT=a,b` — and only in a
//! build with the `planted-bugs` feature: elsewhere [`planted`] is the constant `false`, and
//! the branches it guards are dead code the optimiser removes (their names remain in the
//! binary as strings). Test hooks that slow or hold a step (`HANDOFFS_TEST_*`) are not plants:
//! they break nothing, and are inert without the feature too.

/// A plant outside the delivery rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plant {
    /// `send` enrols the delivery after its message's commit (G8, a kill in between).
    EnrolAfterCommit,
    /// The engine writes without first syncing the commit that reserved the write.
    NoSyncBeforeWrite,
    /// A Claude write resumes the session beside the person's live process (G3).
    ResumeBesideLive,
    /// A Codex write by `turn/start`, without the queue and the holder check (G3).
    TurnStartCodex,
    /// A Codex write by `turn/start` alone, its looks right (G3 at the send boundary).
    TurnStartOnly,
    /// A refused write's retry starts beside its first supervisor (G4).
    RetryBesideSupervisor,
    /// The workspace lease is claimed without its transaction's check (two writers).
    LeaseRace,
    /// The MCP identity guard is off (a tool may name another sender).
    McpSpoof,
    /// The live page answers any Host header.
    WebHost,
    /// The live page inserts text unescaped.
    WebXss,
    /// The live page takes writes without the token.
    WebToken,
    /// A chain's hop budget and depth limit are not checked (a ping-pong never stops).
    ChainUnchecked,
    /// A spend reads its chain in one transaction and records the spend in another, with
    /// work in between (concurrent spends all pass on the same stale budget).
    SpendSplit,
    /// A message enrolled late (after `enabledAfter` passed) ignores that its chain was
    /// cancelled meanwhile: its delivery is queued and written.
    EnrolIgnoresCancel,
    /// The MCP transport drops a request whose `params` is not an object, where it owes the
    /// client an answer with the request's id (the client would wait forever).
    McpDropsBadParams,
    /// The engine keeps its jobs' batched steps uncommitted while they wait on an agent
    /// (its write lock blocks every other process meanwhile).
    HoldBatchWhileWaiting,
    /// A fan-out child's return decides the join from the fan-out as a transaction before
    /// its own read it (two returns at the same moment both join it).
    StaleJoin,
    /// A corpus write reads its entry under the library's lock, then merges and writes it
    /// after letting go of it (concurrent writers lose each other's updates).
    CorpusUnlocked,
    /// Remote MCP serves every agent's sessions from one session manager (a session opened
    /// with one agent's token answers another's).
    RemoteSharedSessions,
    /// Remote MCP takes a token without looking at its expiry.
    TokenExpiryIgnored,
    /// An `--allow-host` name reaches the page and its API, not only `/mcp`.
    RemotePageOpen,
    /// An engine commits steps without checking, in the step's transaction, that it still
    /// holds the recipient's lease (a paused engine that wakes after another took it goes on).
    NoStepFence,
    /// An engine writes without checking the recipient's lease (its own deadline and the
    /// lease in the database): a paused engine whose write was issued before the pause, or
    /// one whose session was cut, writes after another took the lease.
    NoWriteFence,
}

impl Plant {
    pub const ALL: [Plant; 23] = [
        Plant::EnrolAfterCommit,
        Plant::NoSyncBeforeWrite,
        Plant::ResumeBesideLive,
        Plant::TurnStartCodex,
        Plant::TurnStartOnly,
        Plant::RetryBesideSupervisor,
        Plant::LeaseRace,
        Plant::McpSpoof,
        Plant::WebHost,
        Plant::WebXss,
        Plant::WebToken,
        Plant::ChainUnchecked,
        Plant::SpendSplit,
        Plant::EnrolIgnoresCancel,
        Plant::McpDropsBadParams,
        Plant::HoldBatchWhileWaiting,
        Plant::StaleJoin,
        Plant::CorpusUnlocked,
        Plant::RemoteSharedSessions,
        Plant::TokenExpiryIgnored,
        Plant::RemotePageOpen,
        Plant::NoStepFence,
        Plant::NoWriteFence,
    ];

    /// Its name in `HANDOFFS_PLANT`.
    pub fn name(self) -> &'static str {
        match self {
            Plant::EnrolAfterCommit => "enrol_after_commit",
            Plant::NoSyncBeforeWrite => "no_sync_before_write",
            Plant::ResumeBesideLive => "resume_beside_live",
            Plant::TurnStartCodex => "turn_start_codex",
            Plant::TurnStartOnly => "turn_start_only",
            Plant::RetryBesideSupervisor => "retry_beside_supervisor",
            Plant::LeaseRace => "lease_race",
            Plant::McpSpoof => "mcp_spoof",
            Plant::WebHost => "web_host",
            Plant::WebXss => "web_xss",
            Plant::WebToken => "web_token",
            Plant::ChainUnchecked => "chain_unchecked",
            Plant::SpendSplit => "spend_split",
            Plant::EnrolIgnoresCancel => "enrol_ignores_cancel",
            Plant::McpDropsBadParams => "mcp_drops_bad_params",
            Plant::HoldBatchWhileWaiting => "hold_batch_while_waiting",
            Plant::StaleJoin => "stale_join",
            Plant::CorpusUnlocked => "corpus_unlocked",
            Plant::RemoteSharedSessions => "remote_shared_sessions",
            Plant::TokenExpiryIgnored => "token_expiry_ignored",
            Plant::RemotePageOpen => "remote_page_open",
            Plant::NoStepFence => "no_step_fence",
            Plant::NoWriteFence => "no_write_fence",
        }
    }
}

/// Whether a test build was asked to plant `plant`; always false without `planted-bugs`.
pub fn planted(plant: Plant) -> bool {
    cfg!(feature = "planted-bugs")
        && std::env::var("HANDOFFS_PLANT")
            .is_ok_and(|v| v.split(',').any(|p| p.trim() == plant.name()))
}

/// Test builds only (`planted-bugs`): with `var=DIR` set, says `DIR/ready` (with `what`) and
/// waits for `DIR/go`, at most a minute, blocking the calling thread (for a hold inside a
/// transaction, which is synchronous). Each process holds there once. Elsewhere: nothing.
pub fn hold_once(var: &str, what: &str) {
    static HELD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !cfg!(feature = "planted-bugs") {
        return;
    }
    let Some(dir) = std::env::var_os(var).map(std::path::PathBuf::from) else {
        return;
    };
    if HELD.swap(true, std::sync::atomic::Ordering::SeqCst) {
        return;
    }
    let _ = std::fs::write(dir.join("ready"), what);
    let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !dir.join("go").exists() && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::Plant;

    /// Every plant CI switches on exists: a misspelt name would plant nothing, and the
    /// check meant to catch it would "pass" for the wrong reason.
    #[test]
    fn every_plant_named_in_ci_exists() {
        let ci = include_str!("../.ci/run");
        let known: Vec<&str> = Plant::ALL.iter().map(|p| p.name()).collect();
        let mut seen = 0;
        for part in ci.split("HANDOFFS_PLANT=").skip(1) {
            let names = part.split([' ', '\\', '\n']).next().unwrap_or_default();
            for name in names.split(',').filter(|n| !n.is_empty()) {
                assert!(known.contains(&name), "CI plants an unknown bug {name:?}");
                seen += 1;
            }
        }
        assert!(seen >= 5, "CI plants {seen} bugs by name");
        for (i, a) in known.iter().enumerate() {
            assert!(!known[i + 1..].contains(a), "two plants named {a}");
        }
    }
}
