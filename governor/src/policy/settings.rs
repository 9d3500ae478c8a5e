//! Plain-number settings of the policy, with units in every name.
//!
//! Built only from a validated configuration ([`Settings::from_config`]): the
//! configuration is the one place that holds defaults, ranges, the Essential
//! profile's cross-field rules and which keys are restart-only, so the
//! policy never disagrees with what an operator was told. Durations are µs
//! (`_us`), ratios are fractions of 1.0, quotas millicores (1000 = one core),
//! thresholds bytes.

use std::collections::BTreeMap;

use serde::Serialize;

use super::AdmissionMode;
use crate::config::{self, ValidatedConfig};

/// Every knob of the policy, as the configuration set it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Settings {
    /// Logical CPU cores of the node. The tenant cap is computed against this.
    pub cpu_cores: f64,
    /// `resource-control.enabled`: off admits everything without a check.
    pub enabled: bool,
    /// `cpu-throttle.enabled`: CPU token buckets act.
    pub throttle_enabled: bool,
    /// `max-read-cpu-ratio`: share of the node the read path may use (global bucket rate).
    pub max_read_cpu_ratio: f64,
    /// `refill-interval`, µs.
    pub refill_interval_us: u64,
    /// `burst-window`, µs: bucket capacity = rate × burst window.
    pub burst_window_us: u64,
    /// `stats-interval`, µs: monitor sampling period; estimates update once per interval.
    pub stats_interval_us: u64,
    /// `window-size`, µs: monitor window length.
    pub window_size_us: u64,
    /// `enforce-global-limit`: the global bucket refuses (else best-effort tracking).
    pub enforce_global_limit: bool,
    /// `keyspace-cpu-quotas`: keyspace id → millicores.
    pub keyspace_cpu_quotas_millicores: BTreeMap<u32, u64>,
    /// `estimated-cpu-per-request-us`.
    pub estimated_cpu_per_request_us: u64,
    /// `keyspace-estimated-cpu-per-request-us`.
    pub keyspace_estimated_cpu_per_request_us: BTreeMap<u32, u64>,
    /// `enable-adaptive-estimated-cpu-per-request-us`: EMA over measured per-request CPU.
    pub enable_adaptive_estimate: bool,
    /// EMA weight of the newest per-interval mean (not a configuration key).
    pub adaptive_estimate_alpha: f64,
    pub enable_dynamic_adjustment: bool,
    pub high_watermark: f64,
    pub low_watermark: f64,
    pub enable_fair_allocation: bool,
    pub fair_allocation_threshold: f64,
    pub enable_burst: bool,
    pub burst_threshold: f64,
    /// Keyspace ratio below which a keyspace may burst (the seed's "keyspace threshold").
    pub keyspace_burst_threshold: f64,
    /// `keyspace-burst-enabled`: keyspace id → bool; unlisted keyspaces may burst.
    pub keyspace_burst_enabled: BTreeMap<u32, bool>,
    pub enable_runtime_token_management: bool,
    /// `runtime-check-interval-us`: CPU between two top-up checks of a ticket.
    pub runtime_check_interval_us: u64,
    pub additional_allocation_threshold: f64,
    pub per_allocation_us: u64,
    /// `tenant-max-cpu-ratio`: > 0 = Essential uniform cap per keyspace.
    pub tenant_max_cpu_ratio: f64,
    /// `tenant-cap-idle-ttl`, µs.
    pub tenant_cap_idle_ttl_us: u64,
    pub low_priority_dag_global_enabled: bool,
    /// Share of the node given to the low-priority DAG bucket (not a configuration key).
    pub low_priority_dag_cpu_ratio: f64,
    pub enable_pd_service_limit: bool,
    pub pd_service_limit_ttl_us: u64,
    pub pd_service_limit_consecutive_404: u32,
    pub pd_service_limit_update_threshold: f64,
    pub pd_override_config: bool,
    /// `write-quota.pending-write-threshold`, bytes; per keyspace 0.3 × this.
    pub pending_write_threshold_bytes: u64,
    pub admission_mode: AdmissionMode,
    /// 0 = no limit.
    pub max_concurrent_per_tenant: u64,
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
    /// Settings for a node of `cpu_cores` logical cores running `cfg`.
    pub fn from_config(cfg: &ValidatedConfig, cpu_cores: f64) -> Settings {
        let rc = cfg.resource_control();
        let t = cfg.cpu_throttle();
        Settings {
            cpu_cores,
            enabled: rc.enabled,
            throttle_enabled: t.enabled,
            max_read_cpu_ratio: rc.max_read_cpu_ratio,
            refill_interval_us: us(t.refill_interval),
            burst_window_us: us(t.burst_window),
            stats_interval_us: us(rc.stats_interval),
            window_size_us: us(rc.window_size),
            enforce_global_limit: t.enforce_global_limit,
            keyspace_cpu_quotas_millicores: t.keyspace_cpu_quotas.iter().collect(),
            estimated_cpu_per_request_us: t.estimated_cpu_per_request_us,
            keyspace_estimated_cpu_per_request_us: t.keyspace_estimated_cpu_per_request_us.iter().collect(),
            enable_adaptive_estimate: t.enable_adaptive_estimated_cpu_per_request_us,
            adaptive_estimate_alpha: 0.2,
            enable_dynamic_adjustment: t.enable_dynamic_adjustment,
            high_watermark: t.high_watermark,
            low_watermark: t.low_watermark,
            enable_fair_allocation: t.enable_fair_allocation,
            fair_allocation_threshold: t.fair_allocation_threshold,
            enable_burst: t.enable_burst,
            burst_threshold: t.burst_threshold,
            keyspace_burst_threshold: 0.65,
            keyspace_burst_enabled: t.keyspace_burst_enabled.iter().collect(),
            enable_runtime_token_management: t.enable_runtime_token_management,
            runtime_check_interval_us: t.runtime_check_interval_us,
            additional_allocation_threshold: t.additional_allocation_threshold,
            per_allocation_us: t.per_allocation_us,
            tenant_max_cpu_ratio: t.tenant_max_cpu_ratio,
            tenant_cap_idle_ttl_us: us(t.tenant_cap_idle_ttl),
            low_priority_dag_global_enabled: t.low_priority_dag_global_enabled,
            low_priority_dag_cpu_ratio: 0.1,
            enable_pd_service_limit: t.enable_pd_service_limit,
            pd_service_limit_ttl_us: us(t.pd_service_limit_ttl),
            pd_service_limit_consecutive_404: t.pd_service_limit_consecutive_404,
            pd_service_limit_update_threshold: t.pd_service_limit_update_threshold,
            pd_override_config: t.pd_override_config,
            pending_write_threshold_bytes: cfg.write_quota().pending_write_threshold.get(),
            admission_mode: cfg.admission_control().mode,
            max_concurrent_per_tenant: cfg.admission_control().max_concurrent_per_tenant.into(),
        }
    }

    /// Settings from a configuration text (tests and benchmarks: the same
    /// validation as the agent's).
    pub fn from_toml(text: &str, cpu_cores: f64) -> Result<Settings, crate::config::ConfigErrors> {
        Ok(Settings::from_config(&ValidatedConfig::from_toml_str(text)?, cpu_cores))
    }

    /// Capacity of a bucket refilled `refill_us` per interval: rate × burst window.
    pub fn capacity_for(&self, refill_us: u64) -> u64 {
        let interval = self.refill_interval_us.max(1) as u128;
        let c = (refill_us as u128 * self.burst_window_us.max(1) as u128 / interval).max(refill_us as u128);
        u64::try_from(c).unwrap_or(u64::MAX)
    }

    /// How far below zero an overrun may drive a bucket refilled `refill_us`
    /// per interval: one second of its rate (at least its capacity), so a
    /// bucket in debt recovers within a bounded time.
    pub fn max_debt_for(&self, refill_us: u64) -> u64 {
        let per_second = refill_us as u128 * 1_000_000 / self.refill_interval_us.max(1) as u128;
        u64::try_from(per_second).unwrap_or(u64::MAX).max(self.capacity_for(refill_us))
    }

    fn cores_us(&self, ratio: f64) -> u64 {
        let v = self.cpu_cores.max(0.0) * ratio.max(0.0) * self.refill_interval_us as f64;
        if v.is_finite() { v.min(u64::MAX as f64) as u64 } else { 0 }
    }

    /// Global refill per interval: cores × max-read-cpu-ratio × refill interval, µs.
    pub fn global_refill_us(&self) -> u64 {
        self.cores_us(self.max_read_cpu_ratio)
    }

    /// Uniform tenant cap per refill interval for `ratio`, µs; `None` when the
    /// cap is off (ratio ≤ 0). A ratio so small that it rounds below 1 µs per
    /// interval still caps, at 1 µs: "tiny" must not read as "off".
    pub fn tenant_cap_refill_us(&self, ratio: f64) -> Option<u64> {
        if ratio.is_nan() || ratio <= 0.0 {
            return None;
        }
        let millicores = (self.cpu_cores.max(0.0) * ratio * 1000.0) as u64;
        Some(millicores_to_us_per_interval(millicores, self.refill_interval_us.max(1)).max(1))
    }

    /// Low-priority DAG bucket refill per interval, µs.
    pub fn low_priority_refill_us(&self) -> u64 {
        self.cores_us(self.low_priority_dag_cpu_ratio)
    }

    /// Maximum CPU time of a monitor window: cores × max-read-cpu-ratio × window size, µs.
    pub fn max_window_cpu_us(&self) -> f64 {
        self.cpu_cores * self.max_read_cpu_ratio * self.window_size_us as f64
    }

    /// The static estimate of a keyspace: its override, else the default; at least 1 µs.
    pub fn static_estimate_us(&self, keyspace: u32) -> u64 {
        self.keyspace_estimated_cpu_per_request_us
            .get(&keyspace)
            .copied()
            .unwrap_or(self.estimated_cpu_per_request_us)
            .max(1)
    }

    /// Tenant-cap (Essential) mode.
    pub fn cap_mode(&self) -> bool {
        self.tenant_cap_refill_us(self.tenant_max_cpu_ratio).is_some()
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
        assert_eq!((s.refill_interval_us, s.burst_window_us), (10_000, 100_000));
        assert!(s.enabled && !s.throttle_enabled && !s.cap_mode());
        assert_eq!(s.global_refill_us(), 12_000);
        assert_eq!(s.max_debt_for(12_000), 1_200_000);
    }
}
