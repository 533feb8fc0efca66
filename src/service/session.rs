//! One agent's session (an MCP connection): what is kept for an agent between its calls, and
//! the rules over it. The front holds one per connection (its identity is fixed beside it when
//! the session opens, never taken from a call's arguments). The handoff it last took up is the
//! chain its sends and spends continue when no turn of the agent is under way (SPEC §8.2
//! lineage); the lease tokens it obtained stand in for tokens a call leaves out; and the moment
//! after the last chain stop or cancel a wait reported, so each wakes its waits once.

use super::{Lineage, MessageRow};
use std::collections::HashMap;

/// What is kept for one agent's session.
#[derive(Debug, Clone, Default)]
pub struct Session {
    taken_up: Option<String>,
    leases: HashMap<String, String>,
    chain_seen: i64,
}

impl Session {
    pub fn new() -> Session {
        Session::default()
    }

    /// The handoff this session last took up (read or accepted), if any.
    pub fn taken_up(&self) -> Option<&str> {
        self.taken_up.as_deref()
    }

    /// The session accepted work `id`: its later sends continue that chain.
    pub fn take_up(&mut self, id: &str) {
        self.taken_up = Some(id.to_owned());
    }

    /// The session's agent `me` read `message`: a handoff to it is taken up (a notification,
    /// or a message it sent, is not its work).
    pub fn read(&mut self, me: &str, message: &MessageRow) {
        if message.recipient == me && message.intent == "handoff" {
            self.take_up(&message.id);
        }
    }

    /// The lineage of a send (or spend) from this session: a turn of the agent's own is under
    /// way, or else the handoff it took up is continued; a send with a budget of its own
    /// starts a chain of its own, unless `parent` names one.
    pub fn lineage(&self, parent: Option<String>, budget: Option<String>) -> Lineage {
        Lineage {
            parent,
            request_id: None,
            in_turn: true,
            session: budget.is_none().then(|| self.taken_up.clone()).flatten(),
            budget,
        }
    }

    /// Keeps the lease token a claim of `task_id` returned.
    pub fn keep_lease(&mut self, task_id: &str, token: &str) {
        self.leases.insert(task_id.to_owned(), token.to_owned());
    }

    /// The lease token this session holds for `task` (its full id, or a prefix that names
    /// one task this session claimed); `None` when it holds none, or when the prefix fits
    /// several (the caller must then name the task or give the token).
    pub fn lease_token(&self, task: &str) -> Option<&str> {
        if let Some(t) = self.leases.get(task) {
            return Some(t);
        }
        let mut fitting = self.leases.iter().filter(|(k, _)| k.starts_with(task));
        match (fitting.next(), fitting.next()) {
            (Some((_, t)), None) if !task.is_empty() => Some(t),
            _ => None,
        }
    }

    /// The moment after the last chain stop or cancel this session's waits reported.
    pub fn chain_seen(&self) -> i64 {
        self.chain_seen
    }

    /// A wait reported a chain's stop or cancel recorded at `updated_at`.
    pub fn saw_chain(&mut self, updated_at: i64) {
        self.chain_seen = self.chain_seen.max(updated_at + 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_found_by_its_task_or_a_prefix_naming_one_task() {
        let mut s = Session::new();
        assert_eq!(s.lease_token("t1"), None);
        s.keep_lease("t1-aaaa", "tok-a");
        assert_eq!(s.lease_token("t1-aaaa"), Some("tok-a"));
        assert_eq!(s.lease_token("t1"), Some("tok-a"));
        s.keep_lease("t1-bbbb", "tok-b");
        // Two tasks fit the prefix: none is guessed.
        assert_eq!(s.lease_token("t1"), None);
        assert_eq!(s.lease_token("t1-b"), Some("tok-b"));
        assert_eq!(s.lease_token(""), None);
        // A new claim of the same task replaces its token.
        s.keep_lease("t1-bbbb", "tok-c");
        assert_eq!(s.lease_token("t1-bbbb"), Some("tok-c"));
    }

    #[test]
    fn a_session_remembers_what_it_took_up_and_which_stops_it_saw() {
        let mut s = Session::new();
        assert_eq!(s.taken_up(), None);
        assert_eq!(s.lineage(None, None).session, None);
        s.take_up("m1");
        s.take_up("m2");
        assert_eq!(s.taken_up(), Some("m2"));
        // A send continues what was taken up, unless it brings a budget of its own.
        assert_eq!(s.lineage(None, None).session.as_deref(), Some("m2"));
        assert_eq!(s.lineage(None, Some("hops=3".into())).session, None);
        assert_eq!(
            s.lineage(Some("p".into()), None).parent.as_deref(),
            Some("p")
        );
        assert_eq!(s.chain_seen(), 0);
        s.saw_chain(10);
        s.saw_chain(5);
        assert_eq!(s.chain_seen(), 11);
    }
}
