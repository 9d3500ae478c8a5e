//! The policy's settings: the configuration's own sections, as validated
//! (one type from the file to the policy: a key is a field of
//! [`CpuThrottle`] or of the other sections, nowhere copied), with the
//! servers' cores and the policy's constants beside them, and every
//! derived figure (µs per interval, capacities, caps) computed here.
//!
//! Built only from a validated configuration ([`Settings::from_config`]): the
//! configuration is the one place that holds defaults, ranges, the Essential
//! profile's cross-field rules and which keys are restart-only, so the
//! policy never disagrees with what an operator was told. Durations read
//! as µs (`_us`), ratios are fractions of 1.0, quotas millicores (1000 =
//! one core), thresholds bytes.

use serde::Serialize;

use crate::config::{self, AdmissionControl, CpuThrottle, LatencyGuard, ResourceControl, ValidatedConfig, WriteQuota};

/// The policy's inputs: the configuration's sections and the servers' cores.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Settings {
    /// The cores the storage servers may use: every ratio is a share of them.
    pub cpu_cores: f64,
    /// `[resource-control]`, its `cpu-throttle` table inside.
    pub resource: ResourceControl,
    /// `[write-quota]`.
    pub write_quota: WriteQuota,
    /// `[admission-control]`.
    pub admission: AdmissionControl,
    /// `[latency-guard]`.
    pub latency_guard: LatencyGuard,
    /// EMA weight of the newest per-interval mean (not a configuration key).
    pub adaptive_estimate_alpha: f64,
    /// Keyspace ratio below which a keyspace may burst (the seed's "keyspace
    /// threshold"; not a configuration key).
    pub keyspace_burst_threshold: f64,
    /// Share of the node given to the low-priority DAG bucket (not a
    /// configuration key).
    pub low_priority_dag_cpu_ratio: f64,
}

/// `millicores × refill_interval_us / 1000`: a millicore quota as µs per
/// refill interval, saturating instead of wrapping.
pub fn millicores_to_us_per_interval(millicores: u64, refill_interval_us: u64) -> u64 {
    let v = millicores as u128 * refill_interval_us as u128 / 1000;
    u64::try_from(v).unwrap_or(u64::MAX)
}

fn us(d: config::ConfigDuration) -> u64 {
    u64::try_from(d.get().as_micros()).unwrap_or(u64::MAX)
}

impl Settings {
    /// Settings for servers of `cpu_cores` cores running `cfg`.
    pub fn from_config(cfg: &ValidatedConfig, cpu_cores: f64) -> Settings {
        Settings {
            cpu_cores,
            resource: cfg.resource_control().clone(),
            write_quota: cfg.write_quota().clone(),
            admission: cfg.admission_control().clone(),
            latency_guard: cfg.latency_guard().clone(),
            adaptive_estimate_alpha: 0.2,
            keyspace_burst_threshold: 0.65,
            low_priority_dag_cpu_ratio: 0.1,
        }
    }

    /// `[resource-control.cpu-throttle]`.
    pub fn throttle(&self) -> &CpuThrottle {
        &self.resource.cpu_throttle
    }

    /// `[resource-control.cpu-throttle]`, to change (tests, online updates).
    pub fn throttle_mut(&mut self) -> &mut CpuThrottle {
        &mut self.resource.cpu_throttle
    }

    /// `refill-interval`, µs.
    pub fn refill_interval_us(&self) -> u64 {
        us(self.throttle().refill_interval)
    }

    /// `burst-window`, µs: bucket capacity = rate × burst window.
    pub fn burst_window_us(&self) -> u64 {
        us(self.throttle().burst_window)
    }

    /// `stats-interval`, µs: monitor sampling period; estimates update once per interval.
    pub fn stats_interval_us(&self) -> u64 {
        us(self.resource.stats_interval)
    }

    /// `window-size`, µs: monitor window length.
    pub fn window_size_us(&self) -> u64 {
        us(self.resource.window_size)
    }

    /// `tenant-cap-idle-ttl`, µs.
    pub fn tenant_cap_idle_ttl_us(&self) -> u64 {
        us(self.throttle().tenant_cap_idle_ttl)
    }

    /// `pd-service-limit-ttl`, µs.
    pub fn pd_service_limit_ttl_us(&self) -> u64 {
        us(self.throttle().pd_service_limit_ttl)
    }

    /// `write-quota.pending-write-threshold`, bytes; per keyspace 0.3 × this.
    pub fn pending_write_threshold_bytes(&self) -> u64 {
        self.write_quota.pending_write_threshold.get()
    }

    /// `admission-control.max-concurrent-per-tenant`; 0 = no limit.
    pub fn max_concurrent_per_tenant(&self) -> u64 {
        self.admission.max_concurrent_per_tenant.into()
    }

    /// Settings from a configuration text (tests and benchmarks: the same
    /// validation as the agent's).
    pub fn from_toml(text: &str, cpu_cores: f64) -> Result<Settings, crate::config::ConfigErrors> {
        Ok(Settings::from_config(&ValidatedConfig::from_toml_str(text)?, cpu_cores))
    }

    /// Capacity of a bucket refilled `refill_us` per interval: rate × burst window.
    pub fn capacity_for(&self, refill_us: u64) -> u64 {
        let interval = self.refill_interval_us().max(1) as u128;
        let c = (refill_us as u128 * self.burst_window_us().max(1) as u128 / interval).max(refill_us as u128);
        u64::try_from(c).unwrap_or(u64::MAX)
    }

    /// How far below zero an overrun may drive a bucket refilled `refill_us`
    /// per interval: one second of its rate (at least its capacity), so a
    /// bucket in debt recovers within a bounded time.
    pub fn max_debt_for(&self, refill_us: u64) -> u64 {
        let per_second = refill_us as u128 * 1_000_000 / self.refill_interval_us().max(1) as u128;
        u64::try_from(per_second).unwrap_or(u64::MAX).max(self.capacity_for(refill_us))
    }

    fn cores_us(&self, ratio: f64) -> u64 {
        let v = self.cpu_cores.max(0.0) * ratio.max(0.0) * self.refill_interval_us() as f64;
        if v.is_finite() { v.min(u64::MAX as f64) as u64 } else { 0 }
    }

    /// Global refill per interval: cores × max-read-cpu-ratio × refill interval, µs.
    pub fn global_refill_us(&self) -> u64 {
        self.cores_us(self.resource.max_read_cpu_ratio)
    }

    /// Uniform tenant cap per refill interval for `ratio`, µs; `None` when the
    /// cap is off (ratio ≤ 0). A ratio so small that it rounds below 1 µs per
    /// interval still caps, at 1 µs: "tiny" must not read as "off".
    pub fn tenant_cap_refill_us(&self, ratio: f64) -> Option<u64> {
        if ratio.is_nan() || ratio <= 0.0 {
            return None;
        }
        let millicores = (self.cpu_cores.max(0.0) * ratio * 1000.0) as u64;
        Some(millicores_to_us_per_interval(millicores, self.refill_interval_us().max(1)).max(1))
    }

    /// Low-priority DAG bucket refill per interval, µs.
    pub fn low_priority_refill_us(&self) -> u64 {
        self.cores_us(self.low_priority_dag_cpu_ratio)
    }

    /// Maximum CPU time of a monitor window: cores × max-read-cpu-ratio × window size, µs.
    pub fn max_window_cpu_us(&self) -> f64 {
        self.cpu_cores * self.resource.max_read_cpu_ratio * self.window_size_us() as f64
    }

    /// The static estimate of a keyspace: its override, else the default; at least 1 µs.
    pub fn static_estimate_us(&self, keyspace: u32) -> u64 {
        self.throttle()
            .keyspace_estimated_cpu_per_request_us
            .map()
            .get(&keyspace)
            .copied()
            .unwrap_or(self.throttle().estimated_cpu_per_request_us)
            .max(1)
    }

    /// Tenant-cap (Essential) mode.
    pub fn cap_mode(&self) -> bool {
        self.tenant_cap_refill_us(self.throttle().tenant_max_cpu_ratio).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_saturate_instead_of_wrapping() {
        assert_eq!(millicores_to_us_per_interval(u64::MAX, u64::MAX), u64::MAX);
        assert_eq!(millicores_to_us_per_interval(1500, 10_000), 15_000);
    }

    #[test]
    fn a_tiny_cap_ratio_still_caps() {
        let s = Settings::from_toml("", 2.0).unwrap();
        assert_eq!(s.tenant_cap_refill_us(0.0), None);
        assert_eq!(s.tenant_cap_refill_us(1e-9), Some(1), "rounds up to 1 µs, not to off");
        assert_eq!(s.tenant_cap_refill_us(0.25), Some(5_000));
    }

    #[test]
    fn embedded_default_gives_the_documented_settings() {
        let s = Settings::from_config(&ValidatedConfig::embedded_default(), 2.0);
        assert_eq!((s.refill_interval_us(), s.burst_window_us()), (10_000, 100_000));
        assert!(s.resource.enabled && !s.throttle().enabled && !s.cap_mode());
        assert_eq!(s.global_refill_us(), 12_000);
        assert_eq!(s.max_debt_for(12_000), 1_200_000);
    }
}
