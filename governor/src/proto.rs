//! The control-socket protocol: one JSON object per line, each way. The
//! reply to `hello` carries the region descriptors (SCM_RIGHTS, in
//! `region::fd` order) in the same message as its line. A connection that
//! never says `hello` may only ask for `status`, admit over the socket
//! (`acquire` / `release`) and change the configuration (`config-reload`,
//! `config-set`: root or the agent's uid only).

use crate::region::RegionSizes;
use serde::{Deserialize, Serialize};

mod pd;
mod profile;
mod waits;
pub use pd::{PdKeyspaceStatus, PdStatus};
pub use profile::{ProfileKeyspace, ProfileReport, ProfileStack};
pub use waits::{WaitBehind, behind_in_words};

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
    /// Its name in configuration and status (`ebpf`, `thread-clock`).
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
    /// First message of a client: asks for the regions and a ledger.
    Hello,
    /// Registers thread `tid` of the caller's process.
    RegisterThread { tid: u32 },
    /// Gives a slot back before the thread exits.
    UnregisterThread { slot: u32, generation: u64 },
    /// The cell of keyspace `id`, given one if it has none.
    Keyspace { id: u32 },
    /// Sent on a second connection that the client only reads: it ends when
    /// the agent does, which is how a client notices.
    Watch { instance: u64 },
    /// Measurement status for operators.
    Status,
    /// Admission over the socket, for clients that cannot map the regions
    /// (and as the benchmark's baseline): the same decision as the shared
    /// memory fast path, never waiting. The grant is the connection's until
    /// `release`, or until the connection closes.
    Acquire {
        keyspace: u32,
        /// CPU µs expected; absent: the keyspace's published estimate.
        #[serde(default)]
        estimate_us: Option<u64>,
        #[serde(default)]
        write_bytes: u64,
    },
    /// Closes a grant with the CPU the request consumed.
    Release { ticket: u64, consumed_us: u64 },
    /// The registered threads, by client process.
    Threads,
    /// Re-reads the agent's configuration file (as SIGHUP does). Root or the
    /// agent's own uid only.
    ConfigReload,
    /// The configuration in force, with every key spelled out.
    ConfigShow,
    /// Changes one key of the running configuration (`value` is TOML, or a
    /// bare string). Root or the agent's own uid only.
    ConfigSet { key: String, value: String },
    /// Adds a rule (`rule`: its keys as a TOML table) at the end of
    /// `[[rules]]` or at `position`, validated with the whole
    /// configuration. Root or the agent's own uid only.
    RuleAdd {
        rule: String,
        #[serde(default)]
        position: Option<usize>,
    },
    /// Removes the rule named `name`. Root or the agent's own uid only.
    RuleRemove { name: String },
    /// Samples the stacks of tagged threads and rule-matched processes for
    /// `seconds` at `frequency_hz` per CPU, by keyspace (`keyspace`: that
    /// one only; else `top`: the busiest N), and answers with them
    /// symbolized. Admin role.
    Profile {
        seconds: f64,
        frequency_hz: u32,
        #[serde(default)]
        keyspace: Option<u32>,
        #[serde(default)]
        top: Option<u32>,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "kebab-case")]
pub enum Reply {
    Hello {
        backend: BackendKind,
        sizes: RegionSizes,
        instance: u64,
        /// `crate::region::ADMISSION_LAYOUT` of the agent (0: an agent from
        /// before the field).
        #[serde(default)]
        layout: u32,
    },
    Registered {
        slot: u32,
        generation: u64,
    },
    Keyspace {
        cell: u32,
        generation: u64,
    },
    Unregistered,
    Status(Box<StatusReport>),
    Granted {
        ticket: u64,
        granted_us: u64,
    },
    /// `reason` is the refusal's code (`tenant_cap_exhausted`, …).
    Refused {
        reason: String,
        message: String,
    },
    Released,
    Threads {
        threads: Vec<ThreadInfo>,
    },
    Profile(Box<ProfileReport>),
    /// An accepted configuration change: every key it changed (none when
    /// the new configuration equals the running one).
    ConfigUpdated {
        changes: Vec<ConfigChange>,
    },
    /// The configuration in force: `toml` spells out every key; `file` is
    /// the one the agent started from (none: the embedded default), and
    /// `changes_accepted` counts the changes made to it since (`config
    /// set`, `config reload`, rules, SIGHUP).
    Config {
        toml: String,
        file: Option<String>,
        changes_accepted: u64,
        /// Keys the agent's command line overrides (`--socket`,
        /// `--metrics-addr`), dotted, with what is in force: `toml` keeps
        /// the configuration's own values, which a reload compares with.
        #[serde(default)]
        overridden: std::collections::BTreeMap<String, String>,
    },
    /// A refused configuration change, with every reason; the running
    /// configuration stays.
    ConfigRejected {
        errors: Vec<String>,
        /// The agent could not read its file (a reload): exit 66 at the CLI.
        #[serde(default)]
        file_unreadable: bool,
    },
    Error {
        message: String,
    },
}

/// A registered thread, as `governor threads` shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ThreadInfo {
    /// The client process (host PID namespace) and its command name.
    pub pid: u32,
    pub process: String,
    /// The thread (host PID namespace) and its name.
    pub tid: u32,
    pub name: String,
    pub uid: u32,
    pub slot: u32,
    /// The keyspace its tag names now, if any.
    pub keyspace: Option<u32>,
    /// Its CPU time as the kernel counted it at its last switch-out
    /// (eBPF backend) or last sample (fallback), seconds.
    pub cpu_seconds: f64,
    /// How far its charges run ahead of that count, ns: 0 after a
    /// switch-out, except where the thread split a slice between tags while
    /// the hypervisor stole from its CPU (the thread clock counts steal
    /// inside a slice, the kernel does not). The kernel's count pays it
    /// back: it charges nothing more until it passes the charges.
    #[serde(default)]
    pub charged_ahead_ns: u64,
}

/// How an error reply that refuses the peer itself (its uid) begins.
pub const NOT_PERMITTED: &str = "not permitted: ";

/// One key an accepted configuration change changed; values as TOML.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigChange {
    pub key: String,
    pub old: String,
    pub new: String,
}

/// Configuration changes the agent accepted and refused since it started.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ConfigUpdates {
    pub accepted: u64,
    pub rejected: u64,
    /// The file `config reload` and SIGHUP read; none on the embedded default.
    pub path: Option<String>,
}

/// The CPU the caps are fractions of (`agent::server_cpu`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerCpuStatus {
    /// Cores: `max-read-cpu-ratio` and `tenant-max-cpu-ratio` are fractions of this.
    pub cores: f64,
    /// `config` (`resource-control.server-cpu-cores`), `node` (the node's
    /// online CPUs), `cpu-quota` or `cpuset` (one server cgroup's limit), or
    /// `servers` (the sum of several).
    pub source: String,
    /// The file and values it was read from, as an operator reads them.
    pub detail: String,
    /// The node's online CPUs.
    pub node_cores: u32,
    /// Each distinct limit binding the registered servers, with their pids.
    pub servers: Vec<ServerLimitStatus>,
    /// CPU the servers ran outside any keyspace tag (threads not tagged, or
    /// never registered), counted in the monitor's global CPU since start.
    #[serde(default)]
    pub untagged_cpu_seconds: f64,
}

/// One limit binding one or more registered server processes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerLimitStatus {
    pub cores: f64,
    pub source: String,
    pub detail: String,
    pub pids: Vec<u32>,
}

/// What `governor status` shows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    pub backend: BackendKind,
    /// Locks the agent took against its lock order since it started (a
    /// bug: each can deadlock it; the log names the pair). 0 is right.
    #[serde(default)]
    pub lock_order_violations: u64,
    /// Where threads read the clock: `tsc` (the agent's published mapping),
    /// `vdso` (CLOCK_MONOTONIC) or `thread-cputime` (fallback backend).
    pub thread_clock_source: String,
    /// The node's logical cores.
    pub logical_cores: u32,
    /// Where the keyspaces' run-queue waits come from: `kernel` (charged
    /// at each switch, exact), `sampled` (fallback backend) or
    /// `unavailable` (a kernel without `sched_info`).
    #[serde(default)]
    pub wait_source: String,
    /// Whether each keyspace's CPU pressure is counted
    /// (`agent.cpu-pressure`, on the eBPF backend with `sched_info`).
    #[serde(default)]
    pub cpu_pressure: bool,
    /// The CPU the caps are fractions of, and where it came from.
    #[serde(default)]
    pub server_cpu: ServerCpuStatus,
    pub uptime_seconds: f64,
    /// The monitor window the ratios are computed over.
    pub window_seconds: f64,
    pub threads: ThreadStats,
    pub admission: AdmissionStatus,
    pub keyspaces: Vec<KeyspaceStatus>,
    /// CLOCK_MONOTONIC (ns) when the keyspaces' CPU counters were read: a
    /// rate between two reports divides by the difference of these, not by
    /// when the reports arrived.
    #[serde(default)]
    pub counters_read_at_ns: u64,
    /// Kernel run-time statistics of the eBPF programs (bpf_stats_enabled).
    pub programs: Vec<ProgramStats>,
    /// Where `/metrics` is served.
    #[serde(default)]
    pub metrics_addr: Option<String>,
    #[serde(default)]
    pub config_updates: ConfigUpdates,
    /// `[[rules]]` in force, in order.
    #[serde(default)]
    pub rules: Vec<RuleStatus>,
    /// Processes the kernel reported for the rules (exec, fork of a
    /// pending process), and reports it had no room for.
    #[serde(default)]
    pub rule_events: u64,
    #[serde(default)]
    pub rule_events_dropped: u64,
    /// Where capped rule keyspaces are held to their cap, or why they are not.
    #[serde(default)]
    pub rule_enforcement: String,
    /// What whatever scales the storage tier should know (`agent::autoscale`).
    #[serde(default)]
    pub autoscale: AutoscaleSignals,
    /// PD service limits, while `enable-pd-service-limit` is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pd: Option<PdStatus>,
}

/// The admission-control seed's autoscaling rules, evaluated on this node.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AutoscaleSignals {
    /// Admission control refused work recently: the node reads idler than it is.
    pub scale_down_unsafe: bool,
    /// One keyspace owns most of the load and is already throttled: more
    /// capacity would go to the tenant being held back.
    pub scale_up_unhelpful: bool,
    /// `tenant_admission_control` refusals in the window.
    pub admission_refusals_recent: u64,
    /// The keyspace with the most CPU over the monitor window.
    pub dominant_keyspace: Option<u32>,
    /// Its share of the keyspaces' CPU over the monitor window.
    pub dominant_share: f64,
    /// Its tickets waited or were refused in the window.
    pub dominant_throttled: bool,
    /// How far back "recently" looks, seconds.
    pub window_seconds: u64,
}

/// One rule, as `governor rules list` shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RuleStatus {
    pub name: String,
    pub keyspace: u32,
    /// Its matchers, `key=value` words.
    pub matches: String,
    /// Live processes the agent matched to it (their children inherit in
    /// the kernel and are not counted here).
    pub processes_matched: u64,
    /// Threads a thread rule (`thread-name-prefix`) charges apart from
    /// their process.
    #[serde(default)]
    pub threads_matched: u64,
    /// False on the fallback backend, which cannot measure by rule.
    pub measured: bool,
    /// The cores the kernel holds its keyspace to (cgroup), when capped:
    /// the configured cap, lowered while the latency guard holds it down
    /// or while making up for what ran outside (it follows the lower of
    /// `guard_factor` and `outside_factor` at most once a second).
    #[serde(default)]
    pub cap_cores: Option<f64>,
    /// The factor on the keyspace cgroup's cap that makes up for CPU its
    /// processes ran outside the cgroup (those that start and end before
    /// the agent has moved them), while below 1.
    #[serde(default)]
    pub outside_factor: Option<f64>,
    /// The latency guard's factor on the keyspace cgroup's CPU weight (and,
    /// within a second, its cap), while below 1.
    #[serde(default)]
    pub guard_factor: Option<f64>,
    /// Live processes of the capped keyspace that could not be moved into
    /// its cgroup (so the kernel does not hold them), and why.
    #[serde(default)]
    pub processes_not_capped: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_capped_reason: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ThreadStats {
    pub registered: u32,
    pub capacity: u32,
    /// Slots handed out since start (reuse shows as handed_out > capacity).
    pub handed_out: u64,
    pub reclaimed: u64,
    /// Registrations refused: no slot free, or the uid's quota reached.
    pub exhausted: u64,
    /// Slots a client overwrote in shared memory and the agent restored.
    #[serde(default)]
    pub repaired: u64,
}

/// The admission side of the node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdmissionStatus {
    /// `resource-control.enabled`.
    pub enabled: bool,
    /// `cpu-throttle.enabled`: CPU token buckets act.
    pub throttle: bool,
    /// `tenant-max-cpu-ratio` (0: no uniform cap).
    pub tenant_max_cpu_ratio: f64,
    /// `disabled`, `monitor` or `enforced`.
    pub admission_mode: String,
    pub global: BucketStatus,
    /// Global ratio of the monitor window (CPU / (cores × max-read-cpu-ratio × window)).
    pub global_ratio: f64,
    pub global_pending_write_bytes: u64,
    /// The write limits in force (`write-quota.pending-write-threshold`):
    /// the node's pending write bytes, and each keyspace's share of them.
    #[serde(default)]
    pub pending_write_threshold_bytes: u64,
    #[serde(default)]
    pub keyspace_pending_write_threshold_bytes: u64,
    /// `admission-control.max-concurrent-per-tenant` (0: no limit).
    #[serde(default)]
    pub max_concurrent_per_tenant: u64,
    /// Keyspace cells in use / available.
    pub cells_in_use: u32,
    pub cells: u32,
    pub granted: u64,
    pub refused: u64,
    pub waited: u64,
    pub fail_open: u64,
    pub reclaimed: u64,
    /// Admission control in monitor mode: requests over the limit, admitted.
    pub monitor_breaches: u64,
    /// Best-effort global bucket (`enforce-global-limit = false`): grants
    /// that overdrew it instead of being refused.
    pub global_overdrafts: u64,
    /// Keyspaces without a cell, held together by the overflow bucket.
    #[serde(default)]
    pub overflow: OverflowStatus,
    /// `[latency-guard]` and what it does now.
    #[serde(default)]
    pub latency_guard: LatencyGuardStatus,
}

/// The latency guard: its settings and its last step.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencyGuardStatus {
    pub enabled: bool,
    /// One run-queue wait's p99 a keyspace under its fair share should see, µs.
    pub target_wait_p99_us: u64,
    /// The least share of its refill a keyspace keeps.
    pub floor_ratio: f64,
    /// Factor per interval the target is missed, and share given back per
    /// interval it is met.
    pub decrease: f64,
    pub increase: f64,
    /// Keyspaces under their fair share waiting past the target now, most
    /// of it behind the work of keyspaces above their share: the refills of
    /// those (the ones they waited behind) are being lowered.
    pub suffering: Vec<u32>,
    /// Keyspaces under their fair share waiting past the target now, most
    /// of it behind something no keyspace's refill changes (an idle CPU's
    /// wakeup, tasks governor does not measure, registered threads with no
    /// tag): nobody is lowered for them.
    #[serde(default)]
    pub waiting_elsewhere: Vec<u32>,
}

/// The overflow bucket: keyspaces that got no cell (the table is full, or
/// their server's uid holds `agent.max-keyspaces-per-uid` cells) share it,
/// held to the tenant cap (or the smallest quota), the write-byte limits and
/// the concurrency limit together. Not empty is a warning: raise
/// `agent.max-keyspaces` (or the per-uid quota).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OverflowStatus {
    /// Keyspaces refused a cell in the last minute.
    pub keyspaces: Vec<u32>,
    /// Those of them refused by their server's uid's quota of cells
    /// (`agent.max-keyspaces-per-uid`) while the table had room.
    #[serde(default)]
    pub by_uid_quota: Vec<u32>,
    /// Cell requests refused since start.
    pub cells_refused: u64,
    /// Its CPU bucket (`tenant_cap`, `config` or `pd`: what it is held
    /// to), when it has one.
    pub bucket: Option<BucketStatus>,
    pub granted: u64,
    pub refused: u64,
    pub inflight_requests: u64,
    pub pending_write_bytes: u64,
    /// CPU its tickets consumed (their thread clocks), since start.
    pub cpu_seconds: f64,
}

/// One token bucket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BucketStatus {
    /// `config`, `pd`, `tenant_cap`, or `global`.
    pub source: String,
    pub available_us: i64,
    pub capacity_us: u64,
    /// Refill per refill interval now.
    pub refill_us: u64,
    pub inflight_us: u64,
    pub debt_us: u64,
    /// Threads asleep on the bucket now, waiting in line: blocked
    /// acquires and top-ups, and each client process's waiter thread for
    /// its futures (one per process, however many futures wait).
    #[serde(default)]
    pub sleepers: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KeyspaceStatus {
    pub keyspace_id: u32,
    /// Cumulative charged on-CPU time.
    pub cpu_seconds: f64,
    /// On-CPU time over the monitor window / (the servers' cores × window).
    pub window_ratio: f64,
    /// Run-queue wait of its threads (runnable, waiting for a CPU), charged
    /// to the keyspace they were tagged with while they waited; cumulative.
    #[serde(default)]
    pub cpu_wait_seconds: f64,
    /// Waits counted (one per wakeup or preemption that had to wait).
    #[serde(default)]
    pub cpu_waits: u64,
    /// One wait's p50 and p99 over the monitor window, µs (none: no wait).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_wait_p50_us: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_wait_p99_us: Option<f64>,
    /// Waits by log-2 bucket since it got its cell: bucket `k` below
    /// `2^(10 + k)` ns, the last the rest (`governor-common::wait_bucket`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cpu_wait_buckets: Vec<u64>,
    /// Time during which at least one of its registered threads waited for
    /// a CPU (PSI's "some", per keyspace); cumulative. Counted by the
    /// kernel on the eBPF backend only.
    #[serde(default)]
    pub cpu_pressure_some_seconds: f64,
    /// That time's share of the monitor window (none: not counted here, or
    /// no sample yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_pressure_some: Option<f64>,
    /// Whom its waits over the monitor window were behind, the most first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cpu_wait_behind: Vec<WaitBehind>,
    /// Its token bucket, when it has one.
    pub bucket: Option<BucketStatus>,
    pub estimate_us: u64,
    pub granted: u64,
    pub refused: u64,
    /// Of those, refused by the node's global bucket (`global_exhausted`).
    #[serde(default)]
    pub refused_global: u64,
    pub waited: u64,
    pub inflight_requests: u64,
    pub pending_write_bytes: u64,
    /// Requests the server's thread pool rejected (reported by the server);
    /// apart from `refused`, and feeding no autoscaling rule.
    #[serde(default)]
    pub pool_rejections: u64,
    /// Top-ups of running requests refused (the request ran on, or was
    /// aborted where the server asked for that): apart from `refused`,
    /// which counts admissions the server saw refused.
    #[serde(default)]
    pub topups_refused: u64,
    /// Waits of running requests for a top-up at a checkpoint (their
    /// pacing): apart from `waited`, which counts admissions that waited.
    #[serde(default)]
    pub topups_waited: u64,
    /// The rules that charge unmodified processes to it, comma-separated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
}

impl KeyspaceStatus {
    /// Whether its pressure is counted: pressure counts registered threads
    /// only, so a keyspace none of them waited for shows none rather than a
    /// zero that reads "never waited" (in status and on `/metrics` alike),
    /// unless it is a ticket keyspace no rule measures (its servers'
    /// threads took tickets and never waited). A keyspace measured by rule,
    /// or once measured by a rule since removed, shows none.
    pub fn pressure_counted(&self) -> bool {
        self.cpu_pressure_some_seconds > 0.0 || (self.rule.is_none() && self.granted > 0)
    }
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
