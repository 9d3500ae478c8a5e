//! `[resource-control]`, `[write-quota]`, `[admission-control]` and
//! `[latency-guard]`: one type each from the file to the policy (read with defaults and
//! `deny_unknown_fields`, each checked by its own `check`, which
//! [`super::validate`] calls, and held
//! as they are by a [`super::ValidatedConfig`]).

use serde::{Deserialize, Serialize};

use super::checker::{Checker, DAY, HOUR, MS, RC, SEC};
use super::throttle::CpuThrottle;
use super::units::{ByteSize, ConfigDuration};

/// `[resource-control]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct ResourceControl {
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
    /// The CFS bandwidth period of the cgroups that hold rule-matched
    /// keyspaces to their caps (`cpu.max`, `cpu.cfs_period_us`). A capped
    /// group runs its quota at the start of each period, and each time the
    /// kernel lets it go again its neighbours' wakeups wait behind it: a
    /// Redis beside a hog capped at 0.5 of 2 cores read a p99 of 0.15–2.4 ms
    /// (median 0.98) with 100 ms and 0.18–0.53 ms (median 0.24) with 250 ms,
    /// 0.2 alone (docs/design.md §3). Longer periods stall the capped group
    /// longer (up to the period less its share), and a cap measured over a
    /// few seconds reads off by up to a period's quota at each edge. Range
    /// 1ms..=1s. Default `250ms` (the kernel's is 100 ms).
    pub rule_cpu_period: ConfigDuration,
    /// Keeps the legacy QPS/bytes read limiter running next to the CPU
    /// throttle. Default `true` to match the seed sample.
    pub enable_qps_bytes_limiter: bool,
    /// `[resource-control.cpu-throttle]`.
    pub cpu_throttle: CpuThrottle,
}

impl Default for ResourceControl {
    fn default() -> Self {
        Self {
            enabled: true,
            stats_interval: ConfigDuration::from_secs(1),
            window_size: ConfigDuration::from_secs(60),
            max_read_cpu_ratio: 0.6,
            server_cpu_cores: 0.0,
            rule_cpu_period: ConfigDuration::from_millis(250),
            enable_qps_bytes_limiter: false,
            cpu_throttle: CpuThrottle::default(),
        }
    }
}

impl ResourceControl {
    /// Every key's range, beside the keys (validation calls it; the
    /// cpu-throttle table checks its own).
    pub(super) fn check(&self, c: &mut Checker<'_>) {
        c.duration(RC, "stats-interval", self.stats_interval, MS, HOUR);
        c.duration(RC, "window-size", self.window_size, MS, DAY);
        c.check(
            self.window_size >= self.stats_interval,
            RC,
            "window-size",
            format!("must be at least stats-interval ({}), got {}", self.stats_interval, self.window_size),
        );
        c.ratio(RC, "max-read-cpu-ratio", self.max_read_cpu_ratio, false);
        c.check(
            self.server_cpu_cores == 0.0 || (0.01..=65_536.0).contains(&self.server_cpu_cores),
            RC,
            "server-cpu-cores",
            format!(
                "must be 0 (read from the servers' cgroups) or a number of cores in [0.01, 65536], got {}",
                self.server_cpu_cores
            ),
        );
        c.duration(RC, "rule-cpu-period", self.rule_cpu_period, MS, SEC);
        // Keys of the original system governor does not implement: refused, not
        // ignored, so nobody believes they act.
        c.check(
            !self.enable_qps_bytes_limiter,
            RC,
            "enable-qps-bytes-limiter",
            "is not supported: governor has no QPS/bytes read limiter (set it to false)",
        );
    }
}

/// `[write-quota]`: the scheduler's pending-write guard.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct WriteQuota {
    /// Global cap on write bytes queued in the scheduler, protecting memory.
    /// Each keyspace may hold at most 30% of it (fixed by the seed, not a
    /// key), so one keyspace cannot starve the others. A size string
    /// (`"100MiB"`) or an integer of bytes. Default `100MiB`.
    pub pending_write_threshold: ByteSize,
}

impl WriteQuota {
    /// The per-keyspace cap, `0.3 ×` the global threshold (rounded down).
    /// Derived, not a key: the seed deliberately adds no knob.
    pub fn per_keyspace_pending_write_threshold(&self) -> ByteSize {
        ByteSize(self.pending_write_threshold.0 / 10 * 3 + self.pending_write_threshold.0 % 10 * 3 / 10)
    }
}

impl WriteQuota {
    /// Every key's range (validation calls it).
    pub(super) fn check(&self, c: &mut Checker<'_>) {
        c.check(
            self.pending_write_threshold.0 >= 1024,
            "write-quota",
            "pending-write-threshold",
            format!("must be at least 1KiB, got {}", self.pending_write_threshold),
        );
    }
}

impl Default for WriteQuota {
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
pub struct AdmissionControl {
    /// `disabled` (default), `monitor` or `enforced`.
    pub mode: AdmissionMode,
    /// Most requests one tenant may have in flight. `0` means no limit (not
    /// "refuse everything"), which keeps monitor mode honest before anybody
    /// has picked a number.
    pub max_concurrent_per_tenant: u32,
}

impl AdmissionControl {
    /// The in-flight limit per tenant; `None` when the file says 0.
    pub fn limit(&self) -> Option<u32> {
        Some(self.max_concurrent_per_tenant).filter(|n| *n > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_keyspace_write_threshold_is_thirty_percent_rounded_down() {
        let share =
            |n| WriteQuota { pending_write_threshold: ByteSize(n) }.per_keyspace_pending_write_threshold().get();
        assert_eq!(share(10), 3);
        assert_eq!(share(7), 2);
        assert_eq!(share(100 << 20), (100u64 << 20) * 3 / 10);
        assert_eq!(share(u64::MAX), (u128::from(u64::MAX) * 3 / 10) as u64);
    }
}

/// `[latency-guard]`: protects light keyspaces' latency from the run-queue
/// wait heavy ones cause. Each stats interval, when a keyspace using less
/// than its fair share of the node (the keyspaces' CPU in that interval over
/// how many ran) saw one run-queue wait's p99 above `target-wait-p99`, the
/// refill of every keyspace above its fair share is multiplied by
/// `decrease`, never below `floor-ratio` of what it would be; once no one
/// under its share misses the target, `increase` of it is given back per
/// interval. Only keyspaces with a bucket can be lowered. Off by default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct LatencyGuard {
    /// Turns the guard on. Default `false`.
    pub enabled: bool,
    /// One run-queue wait's p99 a keyspace under its fair share should
    /// see. Range 10us..=1s. Default `2ms`.
    pub target_wait_p99: ConfigDuration,
    /// The least share of its refill the guard leaves a keyspace. Range
    /// (0, 1]. Default 0.2.
    pub floor_ratio: f64,
    /// Factor on a heavy keyspace's refill per interval the target is
    /// missed. Range (0, 1). Default 0.7.
    pub decrease: f64,
    /// Share of its refill given back per interval the target is met.
    /// Range (0, 1]. Default 0.1.
    pub increase: f64,
}

impl Default for LatencyGuard {
    fn default() -> Self {
        Self {
            enabled: false,
            target_wait_p99: ConfigDuration::from_millis(2),
            floor_ratio: 0.2,
            decrease: 0.7,
            increase: 0.1,
        }
    }
}

impl LatencyGuard {
    /// Every key's range, beside the keys (validation calls it).
    pub(super) fn check(&self, c: &mut Checker<'_>) {
        const S: &str = "latency-guard";
        let (min, max) = (std::time::Duration::from_micros(10), std::time::Duration::from_secs(1));
        c.duration(S, "target-wait-p99", self.target_wait_p99, min, max);
        c.ratio(S, "floor-ratio", self.floor_ratio, false);
        c.check(
            self.decrease > 0.0 && self.decrease < 1.0,
            S,
            "decrease",
            format!("must be in (0, 1), got {}", self.decrease),
        );
        c.ratio(S, "increase", self.increase, false);
    }
}
