//! The configuration exactly as written: serde types with defaults and
//! `deny_unknown_fields`, no cross-field checks. [`super::validate`] turns a
//! [`RawConfig`] into a [`super::ValidatedConfig`].
//!
//! Keys are the seeds' keys, verbatim and kebab-case, so operators of the
//! original system recognise them.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::raw_throttle::RawCpuThrottle;
use super::units::{ByteSize, ConfigDuration};

/// The whole file. Every section may be omitted and then takes its defaults.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct RawConfig {
    /// `[resource-control]`: monitor window and read CPU budget.
    pub resource_control: RawResourceControl,
    /// `[write-quota]`: pending write bytes, global and per keyspace.
    pub write_quota: RawWriteQuota,
    /// `[admission-control]`: per-tenant in-flight request limit.
    pub admission_control: RawAdmissionControl,
    /// `[agent]`: the daemon itself (socket, metrics, measurement backend).
    pub agent: RawAgent,
    /// `[pd]`: the PD members service limits are fetched from.
    pub pd: super::pd::RawPd,
    /// `[[rules]]`: unmodified processes measured by rule, first match wins.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<super::rules::RawRule>,
}

/// `[resource-control]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct RawResourceControl {
    /// Master switch. Off means the governor measures nothing and admits
    /// everything, which is how a node behaves without it.
    pub enabled: bool,
    /// How often the monitor samples CPU counters and recomputes ratios;
    /// also the cadence of the adaptive per-request estimate. Default `1s`.
    pub stats_interval: ConfigDuration,
    /// How far back the monitor window looks when computing global and
    /// per-keyspace ratios. Longer is steadier, shorter reacts faster.
    /// Default `1m`.
    pub window_size: ConfigDuration,
    /// Share of node CPU that reads may use in total; sizes the global bucket
    /// (`cores × ratio`). Default `0.6`, the value both seeds use, leaving
    /// 40% of the node for writes, raft and compaction.
    pub max_read_cpu_ratio: f64,
    /// The cores the storage servers may use, which `max-read-cpu-ratio`
    /// and `tenant-max-cpu-ratio` are fractions of. `0` (default): read from
    /// the cgroups of the processes that register threads (CFS quota and
    /// cpuset, v1 and v2, re-read every second), the node's online CPUs
    /// while none is registered or limited.
    pub server_cpu_cores: f64,
    /// Keeps the legacy QPS/bytes read limiter running next to the CPU
    /// throttle. Default `true` to match the seed sample.
    pub enable_qps_bytes_limiter: bool,
    /// `[resource-control.cpu-throttle]`.
    pub cpu_throttle: RawCpuThrottle,
}

impl Default for RawResourceControl {
    fn default() -> Self {
        Self {
            enabled: true,
            stats_interval: ConfigDuration::from_secs(1),
            window_size: ConfigDuration::from_secs(60),
            max_read_cpu_ratio: 0.6,
            server_cpu_cores: 0.0,
            enable_qps_bytes_limiter: false,
            cpu_throttle: RawCpuThrottle::default(),
        }
    }
}

/// `[write-quota]`: the scheduler's pending-write guard.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct RawWriteQuota {
    /// Global cap on write bytes queued in the scheduler, protecting memory.
    /// Each keyspace may hold at most 30% of it (fixed by the seed, not a
    /// key), so one keyspace cannot starve the others. A size string
    /// (`"100MiB"`) or an integer of bytes. Default `100MiB`.
    pub pending_write_threshold: ByteSize,
}

impl Default for RawWriteQuota {
    fn default() -> Self {
        Self { pending_write_threshold: ByteSize::mib(100) }
    }
}

/// How firmly the per-tenant concurrency limit is applied
/// (tenant-admission-control.md); the policy takes it as it is
/// (`policy::AdmissionMode`). Written kebab-case in the configuration and
/// in status alike.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AdmissionMode {
    /// Nothing is counted, nothing refused. The default.
    #[default]
    Disabled,
    /// Counted and breaches recorded, but the work still runs: pick a limit
    /// from evidence before enforcing it.
    Monitor,
    /// A tenant over its limit is refused with the `tenant_admission_control`
    /// marker.
    Enforced,
}

/// `[admission-control]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct RawAdmissionControl {
    /// `disabled` (default), `monitor` or `enforced`.
    pub mode: AdmissionMode,
    /// Most requests one tenant may have in flight. `0` means no limit (not
    /// "refuse everything"), which keeps monitor mode honest before anybody
    /// has picked a number.
    pub max_concurrent_per_tenant: u32,
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

/// `[agent]`: the daemon.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct RawAgent {
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
    /// `[agent.access]`: the socket's mode and group, and who may do what.
    pub access: super::access::RawAccess,
}

impl Default for RawAgent {
    fn default() -> Self {
        Self {
            control_socket: PathBuf::from("/run/governor/governor.sock"),
            metrics_addr: "127.0.0.1:9464".to_string(),
            metrics_max_keyspaces: 500,
            measure: MeasureMode::Auto,
            timer_period: ConfigDuration::from_millis(10),
            max_threads: 16384,
            max_keyspaces: 4096,
            max_threads_per_uid: None,
            max_keyspaces_per_uid: None,
            access: Default::default(),
        }
    }
}

impl std::str::FromStr for MeasureMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(MeasureMode::Auto),
            "ebpf" => Ok(MeasureMode::Ebpf),
            "thread-clock" => Ok(MeasureMode::ThreadClock),
            other => Err(format!("unknown measurement backend {other:?} (auto, ebpf, thread-clock)")),
        }
    }
}
