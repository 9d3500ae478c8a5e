//! The configuration exactly as written: serde types with defaults and
//! `deny_unknown_fields`, no cross-field checks. [`super::validate`] turns a
//! [`RawConfig`] into a [`super::ValidatedConfig`]. The sections the policy
//! runs on are one type each, read and validated alike
//! ([`super::sections`], [`super::throttle`]), and so is `[agent]`
//! ([`AgentConfig`]: validation fills in its derived per-uid quotas and
//! resolves `[agent.access]` beside it); `[pd]` and `[[rules]]` are read
//! here and typed by validation.
//!
//! Keys are the seeds' keys, verbatim and kebab-case, so operators of the
//! original system recognise them.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::sections::{AdmissionControl, LatencyGuard, ResourceControl, WriteQuota};
use super::units::ConfigDuration;

/// The whole file. Every section may be omitted and then takes its defaults.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct RawConfig {
    /// `[resource-control]`: monitor window and read CPU budget.
    pub resource_control: ResourceControl,
    /// `[write-quota]`: pending write bytes, global and per keyspace.
    pub write_quota: WriteQuota,
    /// `[admission-control]`: per-tenant in-flight request limit.
    pub admission_control: AdmissionControl,
    /// `[latency-guard]`: light keyspaces' run-queue wait.
    pub latency_guard: LatencyGuard,
    /// `[agent]`: the daemon itself (socket, metrics, measurement backend).
    pub agent: AgentConfig,
    /// `[pd]`: the PD members service limits are fetched from.
    pub pd: super::pd::RawPd,
    /// `[[rules]]`: unmodified processes measured by rule, first match wins.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<super::rules::RawRule>,
}

/// Which CPU measurement backend the agent uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MeasureMode {
    /// eBPF when the kernel and privileges allow it, else the thread clock.
    #[default]
    Auto,
    /// eBPF only; start fails if it cannot be loaded.
    Ebpf,
    /// `CLOCK_THREAD_CPUTIME_ID` and schedstat sampling, no eBPF.
    ThreadClock,
}

/// `[agent]`: the daemon. One type as written and as validated: after
/// validation both per-uid quotas hold their value (derived ones included)
/// and `metrics-addr` is a socket address.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct AgentConfig {
    /// Unix socket clients connect to for region fds and CLI verbs.
    /// Restart-only: clients hold the path. Default `/run/governor/governor.sock`.
    pub control_socket: PathBuf,
    /// Where `/metrics` is served; a socket address, loopback by default so
    /// tenant ids are not exposed off-host. Default `127.0.0.1:9464`.
    pub metrics_addr: String,
    /// Keyspaces with series of their own in `/metrics`; the ones with the
    /// least CPU beyond that are summed into `keyspace_id="other"`.
    /// Range 1..=100000, default 500.
    pub metrics_max_keyspaces: u32,
    /// Measurement backend: `auto` (default), `ebpf` or `thread-clock`.
    /// Restart-only: the shared regions are laid out for one backend.
    pub measure: MeasureMode,
    /// Period of the per-CPU timer that closes long running slices, so a 2 s
    /// query is charged while it runs. Range 1ms..=1s, default `10ms`.
    pub timer_period: ConfigDuration,
    /// Counts each keyspace's CPU pressure as Linux's PSI counts a cgroup's
    /// ("some": the share of time at least one of its registered threads
    /// waited for a CPU). It attaches a program to every wakeup in the
    /// system and adds two clock reads and two locked adds to each wait of
    /// a registered thread (docs/benchmarks.md), so it is off by default.
    /// Needs the eBPF backend on a kernel with `sched_info`. Restart-only:
    /// the programs are loaded at start. Default `false`.
    pub cpu_pressure: bool,
    /// Thread slots in the shared region (registered worker threads).
    /// Restart-only: it sizes an mmapped map. Range 64..=1048576, default 16384.
    pub max_threads: u32,
    /// Keyspace cells in the shared table. Restart-only for the same reason.
    /// Range 16..=1048576, default 4096.
    pub max_keyspaces: u32,
    /// Thread slots the processes of one uid may hold at once, so one local
    /// account cannot take them all. Root is not limited (it could stop the
    /// agent anyway). Range 1..=max-threads; default half of `max-threads`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_threads_per_uid: Option<u32>,
    /// Keyspace cells the connections of one uid may have created and still
    /// in use (idle cells are evicted and count no more). Root is not
    /// limited. Range 1..=max-keyspaces; default half of `max-keyspaces`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_keyspaces_per_uid: Option<u32>,
    /// `[agent.access]`: the socket's mode and group, and who may do what,
    /// as written (resolved: [`super::ValidatedConfig::access`]).
    pub access: super::access::RawAccess,
}

impl AgentConfig {
    /// Where `/metrics` listens.
    pub fn metrics_socket(&self) -> std::net::SocketAddr {
        self.metrics_addr.parse().expect("a validated configuration holds a socket address")
    }

    /// Thread slots one uid may hold: as set, else half of `max-threads`.
    pub fn threads_per_uid(&self) -> u32 {
        self.max_threads_per_uid.unwrap_or(self.max_threads / 2).max(1)
    }

    /// Keyspace cells one uid may use: as set, else half of `max-keyspaces`.
    pub fn keyspaces_per_uid(&self) -> u32 {
        self.max_keyspaces_per_uid.unwrap_or(self.max_keyspaces / 2).max(1)
    }
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            control_socket: PathBuf::from("/run/governor/governor.sock"),
            metrics_addr: "127.0.0.1:9464".to_string(),
            metrics_max_keyspaces: 500,
            measure: MeasureMode::Auto,
            timer_period: ConfigDuration::from_millis(10),
            cpu_pressure: false,
            max_threads: 16384,
            max_keyspaces: 4096,
            max_threads_per_uid: None,
            max_keyspaces_per_uid: None,
            access: Default::default(),
        }
    }
}

/// A measurement backend's name that is not one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown measurement backend {0:?} (auto, ebpf, thread-clock)")]
pub struct UnknownBackend(pub String);

impl std::str::FromStr for MeasureMode {
    type Err = UnknownBackend;

    fn from_str(s: &str) -> Result<Self, UnknownBackend> {
        match s {
            "auto" => Ok(MeasureMode::Auto),
            "ebpf" => Ok(MeasureMode::Ebpf),
            "thread-clock" => Ok(MeasureMode::ThreadClock),
            other => Err(UnknownBackend(other.to_string())),
        }
    }
}
