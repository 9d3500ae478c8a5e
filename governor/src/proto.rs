//! The control-socket protocol: one JSON object per line, each way. The
//! reply to `hello` carries the three region fds (SCM_RIGHTS) in the same
//! message as its line.

use crate::region::RegionSizes;
use serde::{Deserialize, Serialize};

/// Which measurement backend the agent runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BackendKind {
    /// eBPF programs on sched_switch + a per-CPU timer; thread clock from
    /// the shared per-CPU table (no syscall).
    Ebpf,
    /// memfd regions; thread clock is CLOCK_THREAD_CPUTIME_ID and the agent
    /// samples /proc schedstat for the kernel's side of the protocol.
    ThreadClock,
}

impl BackendKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Ebpf => "ebpf",
            BackendKind::ThreadClock => "thread-clock",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    /// First message of a client: asks for the regions.
    Hello,
    /// Registers thread `tid` of the caller's process.
    RegisterThread { tid: u32 },
    /// Gives a slot back before the thread exits.
    UnregisterThread { slot: u32, generation: u64 },
    /// Measurement status for operators.
    Status,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "kebab-case")]
pub enum Reply {
    Hello { backend: BackendKind, sizes: RegionSizes },
    Registered { slot: u32, generation: u64 },
    Unregistered,
    Status(Box<StatusReport>),
    Error { message: String },
}

/// What `governor status` shows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    pub backend: BackendKind,
    /// Where threads read the clock: `tsc` (the agent's published mapping),
    /// `vdso` (CLOCK_MONOTONIC) or `thread-cputime` (fallback backend).
    pub thread_clock_source: String,
    pub logical_cores: u32,
    pub uptime_seconds: f64,
    /// The monitor window the ratios are computed over.
    pub window_seconds: f64,
    pub threads: ThreadStats,
    pub keyspaces: Vec<KeyspaceStatus>,
    /// Kernel run-time statistics of the eBPF programs (bpf_stats_enabled).
    pub programs: Vec<ProgramStats>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ThreadStats {
    pub registered: u32,
    pub capacity: u32,
    /// Slots handed out since start (reuse shows as handed_out > capacity).
    pub handed_out: u64,
    pub reclaimed: u64,
    pub exhausted: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KeyspaceStatus {
    pub keyspace_id: u32,
    /// Cumulative charged on-CPU time.
    pub cpu_seconds: f64,
    /// On-CPU time over the monitor window / (cores × window).
    pub window_ratio: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProgramStats {
    pub name: String,
    pub run_time_ns: u64,
    pub run_count: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_as_tagged_json() {
        let r = Request::RegisterThread { tid: 42 };
        let line = serde_json::to_string(&r).unwrap();
        assert_eq!(line, r#"{"op":"register-thread","tid":42}"#);
        assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), r);
    }

    #[test]
    fn backend_names_are_kebab_case() {
        assert_eq!(serde_json::to_string(&BackendKind::ThreadClock).unwrap(), r#""thread-clock""#);
        assert_eq!(BackendKind::Ebpf.as_str(), "ebpf");
    }
}
