//! Whom a keyspace's waits for a core were behind, as status reports it.

use serde::{Deserialize, Serialize};

/// What a keyspace's threads waited behind: what held the CPU each of them
/// got when its wait ended (the kernel's count, eBPF backend only).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WaitBehind {
    /// `keyspace` (with `keyspace_id`: that keyspace's work), `untagged` (a
    /// registered thread with no tag), `unmeasured` (a task governor does
    /// not measure), `idle` (the CPU was free: the wakeup's own latency),
    /// `unknown` (the switch-in was not seen) or `other` (a runner the
    /// kernel kept no slot for, or a keyspace gone since).
    pub behind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keyspace_id: Option<u32>,
    /// Seconds waited behind it over the monitor window.
    pub seconds: f64,
}

impl WaitBehind {
    /// Whom the wait was behind, in an operator's words.
    pub fn whom(&self) -> String {
        behind_in_words(&self.behind, self.keyspace_id)
    }
}

/// An operator's words for the runner a wait was behind, given status's
/// word for it ([`WaitBehind::behind`]) and, for `keyspace`, which.
pub fn behind_in_words(behind: &str, keyspace_id: Option<u32>) -> String {
    match (behind, keyspace_id) {
        ("keyspace", Some(id)) => format!("keyspace {id}"),
        ("untagged", _) => "registered threads with no tag".into(),
        ("unmeasured", _) => "tasks governor does not measure".into(),
        ("idle", _) => "an idle CPU (the wakeup's own latency)".into(),
        ("unknown", _) => "not seen (the switch that ended the wait went unseen)".into(),
        (other, _) => format!("{other} runners"),
    }
}
