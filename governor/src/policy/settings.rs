//! Plain-number settings of the policy, with units in every name.
//!
//! This is the policy's own view; the TOML config module (kebab-case keys from the seeds) is glued
//! to it elsewhere. Durations are microseconds (`_us`), ratios are fractions of 1.0, CPU quotas are
//! millicores (1000 = one core), byte thresholds are bytes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::admission::AdmissionMode;
use super::error::SettingsError;

/// Every knob of the policy. `Default` gives the Premium-compatible defaults with the optional
/// mechanisms (burst, fair, dynamic, adaptive estimate, PD, tenant cap) switched off.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    /// Logical CPU cores of the node. Tenant cap is computed against this (not × read ratio).
    pub cpu_cores: f64,
    /// `max-read-cpu-ratio`: fraction of the node the read path may use (global bucket rate).
    /// Restart-only.
    pub max_read_cpu_ratio: f64,
    /// `refill-interval`, µs: how often the agent refills buckets. Restart-only.
    pub refill_interval_us: u64,
    /// `burst-window`, µs: bucket capacity = rate × burst window. Restart-only.
    pub burst_window_us: u64,
    /// `stats-interval`, µs: monitor sampling period; EMA estimates update once per interval.
    pub stats_interval_us: u64,
    /// `window-size`, µs: monitor window length.
    pub window_size_us: u64,
    /// `enforce-global-limit`: global bucket is a hard cap (else best-effort tracking, may go
    /// negative). Tenant-cap buckets always enforce the global bucket.
    pub enforce_global_limit: bool,
    /// `keyspace-cpu-quotas`: keyspace id → millicores.
    pub keyspace_cpu_quotas_millicores: BTreeMap<u32, u64>,
    /// `estimated-cpu-per-request-us`: default estimate, µs.
    pub estimated_cpu_per_request_us: u64,
    /// `keyspace-estimated-cpu-per-request-us`: keyspace id → estimate, µs.
    pub keyspace_estimated_cpu_per_request_us: BTreeMap<u32, u64>,
    /// `enable-adaptive-estimated-cpu-per-request-us`: EMA over observed per-request CPU.
    pub enable_adaptive_estimate: bool,
    /// EMA weight of the newest per-interval mean (0 < alpha ≤ 1).
    pub adaptive_estimate_alpha: f64,
    /// `enable-dynamic-adjustment`: watermark-based refill adjustment.
    pub enable_dynamic_adjustment: bool,
    /// `high-watermark`: global ratio above which the global refill is reduced.
    pub high_watermark: f64,
    /// `low-watermark`: global ratio below which the global refill is restored.
    pub low_watermark: f64,
    /// `enable-fair-allocation`: proportional fair refill above the threshold.
    pub enable_fair_allocation: bool,
    /// `fair-allocation-threshold`: global ratio above which fair allocation drives refill.
    pub fair_allocation_threshold: f64,
    /// `enable-burst`: quota'd keyspaces may borrow from the global bucket when it is idle.
    pub enable_burst: bool,
    /// `burst-threshold`: global ratio below which bursting is allowed.
    pub burst_threshold: f64,
    /// Keyspace ratio below which the keyspace may burst (the seed's "keyspace threshold").
    pub keyspace_burst_threshold: f64,
    /// `keyspace-burst-enabled`: keyspace id → bool; unlisted keyspaces may burst.
    pub keyspace_burst_enabled: BTreeMap<u32, bool>,
    /// `enable-runtime-token-management`: caps initial estimates to min(global, tenant)/10 and
    /// lets running requests top up with `allocate_more`.
    pub enable_runtime_token_management: bool,
    /// `runtime-check-interval-us`, µs (used by the caller's check loop).
    pub runtime_check_interval_us: u64,
    /// `additional-allocation-threshold`: top up once consumed > this × allocation.
    pub additional_allocation_threshold: f64,
    /// `per-allocation-us`, µs per top-up.
    pub per_allocation_us: u64,
    /// `tenant-max-cpu-ratio`: > 0 = Essential uniform cap per keyspace (fraction of logical
    /// cores); 0 = legacy skip-throttle for unknown keyspaces. Hot-updatable.
    pub tenant_max_cpu_ratio: f64,
    /// `tenant-cap-idle-ttl`, µs: evict auto-created cap buckets idle this long. Hot-updatable.
    pub tenant_cap_idle_ttl_us: u64,
    /// `low-priority-dag-global-enabled`: low-priority DAG requests pass an extra bucket first.
    pub low_priority_dag_global_enabled: bool,
    /// Fraction of logical cores given to the low-priority DAG bucket.
    pub low_priority_dag_cpu_ratio: f64,
    /// `enable-pd-service-limit`: derive quotas from PD service limits.
    pub enable_pd_service_limit: bool,
    /// `pd-service-limit-ttl`, µs: drop a PD quota not confirmed for this long.
    pub pd_service_limit_ttl_us: u64,
    /// `pd-service-limit-consecutive-404`: drop a PD quota after this many 404s in a row.
    pub pd_service_limit_consecutive_404: u32,
    /// `pd-service-limit-update-threshold`: minimum relative change to apply a new quota.
    pub pd_service_limit_update_threshold: f64,
    /// `pd-override-config`: PD quotas replace static config quotas.
    pub pd_override_config: bool,
    /// Scheduler pending-write threshold, bytes (global); per keyspace = 0.3 × this.
    pub pending_write_threshold_bytes: u64,
    /// `multitenancy.admission_control.mode`.
    pub admission_mode: AdmissionMode,
    /// `multitenancy.admission_control.max_concurrent_per_tenant`; 0 = no limit.
    pub max_concurrent_per_tenant: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            cpu_cores: 8.0,
            max_read_cpu_ratio: 0.6,
            refill_interval_us: 10_000,
            burst_window_us: 100_000,
            stats_interval_us: 1_000_000,
            window_size_us: 60_000_000,
            enforce_global_limit: false,
            keyspace_cpu_quotas_millicores: BTreeMap::new(),
            estimated_cpu_per_request_us: 1000,
            keyspace_estimated_cpu_per_request_us: BTreeMap::new(),
            enable_adaptive_estimate: false,
            adaptive_estimate_alpha: 0.2,
            enable_dynamic_adjustment: false,
            high_watermark: 0.8,
            low_watermark: 0.5,
            enable_fair_allocation: false,
            fair_allocation_threshold: 0.7,
            enable_burst: false,
            burst_threshold: 0.9,
            keyspace_burst_threshold: 0.65,
            keyspace_burst_enabled: BTreeMap::new(),
            enable_runtime_token_management: false,
            runtime_check_interval_us: 2000,
            additional_allocation_threshold: 0.5,
            per_allocation_us: 4000,
            tenant_max_cpu_ratio: 0.0,
            tenant_cap_idle_ttl_us: 600_000_000,
            low_priority_dag_global_enabled: false,
            low_priority_dag_cpu_ratio: 0.1,
            enable_pd_service_limit: false,
            pd_service_limit_ttl_us: 600_000_000,
            pd_service_limit_consecutive_404: 3,
            pd_service_limit_update_threshold: 0.01,
            pd_override_config: true,
            pending_write_threshold_bytes: 100 * 1024 * 1024,
            admission_mode: AdmissionMode::Disabled,
            max_concurrent_per_tenant: 0,
        }
    }
}

/// `millicores * refill_interval_us / 1000`: a millicore quota as µs per refill interval.
pub fn millicores_to_us_per_interval(millicores: u64, refill_interval_us: u64) -> u64 {
    ((millicores as u128 * refill_interval_us as u128) / 1000) as u64
}

impl Settings {
    /// Capacity of a bucket whose refill per interval is `refill_us`: rate × burst window.
    pub fn capacity_for(&self, refill_us: u64) -> u64 {
        let interval = self.refill_interval_us.max(1) as u128;
        ((refill_us as u128 * self.burst_window_us.max(1) as u128) / interval)
            .max(refill_us as u128) as u64
    }

    /// Global refill per interval: cores × max-read-cpu-ratio × refill interval, µs.
    pub fn global_refill_us(&self) -> u64 {
        (self.cpu_cores * self.max_read_cpu_ratio * self.refill_interval_us as f64) as u64
    }

    /// Global capacity: global rate × burst window, µs.
    pub fn global_capacity_us(&self) -> u64 {
        self.capacity_for(self.global_refill_us())
    }

    /// Uniform tenant cap per refill interval for `ratio` (against logical cores), µs.
    /// `None` when the cap is disabled (ratio ≤ 0).
    pub fn tenant_cap_refill_us(&self, ratio: f64) -> Option<u64> {
        if ratio <= 0.0 {
            return None;
        }
        let millicores = (self.cpu_cores.max(1.0) * ratio * 1000.0) as u64;
        Some(millicores_to_us_per_interval(
            millicores,
            self.refill_interval_us.max(1),
        ))
    }

    /// Low-priority DAG bucket refill per interval, µs.
    pub fn low_priority_refill_us(&self) -> u64 {
        (self.cpu_cores * self.low_priority_dag_cpu_ratio * self.refill_interval_us as f64) as u64
    }

    /// Maximum CPU time of a monitor window: cores × max-read-cpu-ratio × window size, µs.
    pub fn max_window_cpu_us(&self) -> f64 {
        self.cpu_cores * self.max_read_cpu_ratio * self.window_size_us as f64
    }

    /// Range checks and the Essential cross-field rules (tenant-cpu-cap.md §4.3).
    pub fn validate(&self) -> Result<(), SettingsError> {
        fn bad(key: &'static str, reason: &str) -> SettingsError {
            SettingsError::InvalidValue {
                key,
                reason: reason.to_string(),
            }
        }
        if !(0.0..=1.0).contains(&self.tenant_max_cpu_ratio) {
            return Err(bad("tenant-max-cpu-ratio", "must be in [0.0, 1.0]"));
        }
        if self.tenant_cap_idle_ttl_us < 1000 {
            return Err(bad("tenant-cap-idle-ttl", "must be at least 1ms"));
        }
        if self.cpu_cores <= 0.0 || !(0.0..=1.0).contains(&self.max_read_cpu_ratio) {
            return Err(bad(
                "max-read-cpu-ratio",
                "cores must be > 0 and ratio in [0, 1]",
            ));
        }
        if self.refill_interval_us == 0 || self.burst_window_us < self.refill_interval_us {
            return Err(bad(
                "burst-window",
                "refill-interval > 0 and burst-window >= refill-interval",
            ));
        }
        if self.stats_interval_us == 0 || self.window_size_us < self.stats_interval_us {
            return Err(bad(
                "window-size",
                "stats-interval > 0 and window-size >= stats-interval",
            ));
        }
        if self.low_watermark > self.high_watermark {
            return Err(bad("low-watermark", "must not exceed high-watermark"));
        }
        if !(self.adaptive_estimate_alpha > 0.0 && self.adaptive_estimate_alpha <= 1.0) {
            return Err(bad("adaptive-estimate-alpha", "must be in (0, 1]"));
        }
        if self.tenant_max_cpu_ratio > 0.0 {
            let conflict = |key, reason| Err(SettingsError::CapModeConflict { key, reason });
            if !self.enforce_global_limit {
                return conflict("enforce-global-limit", "must be true");
            }
            if self.enable_burst {
                return conflict("enable-burst", "must be false");
            }
            if self.enable_fair_allocation {
                return conflict("enable-fair-allocation", "must be false");
            }
            if self.enable_dynamic_adjustment {
                return conflict("enable-dynamic-adjustment", "must be false");
            }
            if self.enable_pd_service_limit {
                return conflict("enable-pd-service-limit", "must be false");
            }
            if !self.keyspace_cpu_quotas_millicores.is_empty() {
                return conflict("keyspace-cpu-quotas", "must be empty");
            }
        }
        Ok(())
    }

    /// Rejects changes to restart-only keys between `self` (running) and `next`.
    pub fn check_online_change(&self, next: &Settings) -> Result<(), SettingsError> {
        let restart_only: [(&'static str, bool); 4] = [
            ("cpu-cores", self.cpu_cores != next.cpu_cores),
            (
                "max-read-cpu-ratio",
                self.max_read_cpu_ratio != next.max_read_cpu_ratio,
            ),
            (
                "refill-interval",
                self.refill_interval_us != next.refill_interval_us,
            ),
            ("burst-window", self.burst_window_us != next.burst_window_us),
        ];
        for (key, changed) in restart_only {
            if changed {
                return Err(SettingsError::RestartOnly { key });
            }
        }
        next.validate()
    }

    /// The Essential profile of tenant-cpu-cap.md §4.1 with the given cap ratio.
    pub fn essential(cpu_cores: f64, tenant_max_cpu_ratio: f64) -> Settings {
        Settings {
            cpu_cores,
            enforce_global_limit: true,
            tenant_max_cpu_ratio,
            enable_runtime_token_management: true,
            ..Settings::default()
        }
    }
}
