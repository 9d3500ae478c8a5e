//! The policy's plain-number [`Settings`] from a validated configuration:
//! the one place where configuration keys meet policy fields, so the agent
//! loop and the admission path run the policy exactly as configured.

use super::{AdmissionMode, Settings};
use crate::config::{self, ValidatedConfig};

fn us(d: config::ConfigDuration) -> u64 {
    d.get().as_micros() as u64
}

impl Settings {
    /// Settings for a node of `cpu_cores` logical cores running `cfg`.
    /// Keys the policy has no field for (PD fetch cadence, the agent's own
    /// keys) are used by the agent, not here; fields no key sets keep their
    /// documented defaults.
    pub fn from_config(cfg: &ValidatedConfig, cpu_cores: f64) -> Settings {
        let rc = cfg.resource_control();
        let t = cfg.cpu_throttle();
        let defaults = Settings::default();
        Settings {
            cpu_cores,
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
            enable_dynamic_adjustment: t.enable_dynamic_adjustment,
            high_watermark: t.high_watermark,
            low_watermark: t.low_watermark,
            enable_fair_allocation: t.enable_fair_allocation,
            fair_allocation_threshold: t.fair_allocation_threshold,
            enable_burst: t.enable_burst,
            burst_threshold: t.burst_threshold,
            keyspace_burst_enabled: t.keyspace_burst_enabled.iter().collect(),
            enable_runtime_token_management: t.enable_runtime_token_management,
            runtime_check_interval_us: t.runtime_check_interval_us,
            additional_allocation_threshold: t.additional_allocation_threshold,
            per_allocation_us: t.per_allocation_us,
            tenant_max_cpu_ratio: t.tenant_max_cpu_ratio,
            tenant_cap_idle_ttl_us: us(t.tenant_cap_idle_ttl),
            low_priority_dag_global_enabled: t.low_priority_dag_global_enabled,
            enable_pd_service_limit: t.enable_pd_service_limit,
            pd_service_limit_ttl_us: us(t.pd_service_limit_ttl),
            pd_service_limit_consecutive_404: t.pd_service_limit_consecutive_404,
            pd_service_limit_update_threshold: t.pd_service_limit_update_threshold,
            pd_override_config: t.pd_override_config,
            pending_write_threshold_bytes: cfg.write_quota().pending_write_threshold.get(),
            admission_mode: match cfg.admission_control().mode {
                config::AdmissionMode::Disabled => AdmissionMode::Disabled,
                config::AdmissionMode::Monitor => AdmissionMode::Monitor,
                config::AdmissionMode::Enforced => AdmissionMode::Enforced,
            },
            max_concurrent_per_tenant: cfg.admission_control().max_concurrent_per_tenant.map_or(0, u64::from),
            ..defaults
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Policy;

    #[test]
    fn embedded_default_gives_valid_settings() {
        let s = Settings::from_config(&ValidatedConfig::embedded_default(), 2.0);
        assert_eq!(s.refill_interval_us, 10_000);
        assert_eq!(s.burst_window_us, 100_000);
        assert!(Policy::new(s, 0).is_ok());
    }

    #[test]
    fn essential_profile_reaches_the_policy_as_cap_mode() {
        let text = "[resource-control]\nmax-read-cpu-ratio = 0.6\n[resource-control.cpu-throttle]\nenabled = true\n\
                    enforce-global-limit = true\ntenant-max-cpu-ratio = 0.4\ntenant-cap-idle-ttl = \"10m\"\n\
                    enable-burst = false\nenable-fair-allocation = false\nenable-dynamic-adjustment = false\n\
                    [admission-control]\nmode = \"monitor\"\nmax-concurrent-per-tenant = 32\n";
        let cfg = ValidatedConfig::from_toml_str(text).unwrap();
        let s = Settings::from_config(&cfg, 16.0);
        assert_eq!(s.tenant_max_cpu_ratio, 0.4);
        assert_eq!(s.tenant_cap_idle_ttl_us, 600_000_000);
        assert!(s.enforce_global_limit && !s.enable_burst && !s.enable_fair_allocation);
        assert_eq!(s.admission_mode, AdmissionMode::Monitor);
        assert_eq!(s.max_concurrent_per_tenant, 32);
        let p = Policy::new(s, 0).unwrap();
        // 16 cores × 0.4 = 6.4 cores = 64 000 µs per 10 ms refill.
        assert_eq!(p.tenant_cap_refill_us(), 64_000);
    }

    #[test]
    fn quotas_and_overrides_carry_over() {
        let text = "[resource-control.cpu-throttle]\nkeyspace-cpu-quotas = \"1:1000,2:2000\"\n\
                    keyspace-estimated-cpu-per-request-us = \"1:1500\"\nkeyspace-burst-enabled = \"2:false\"\n";
        let s = Settings::from_config(&ValidatedConfig::from_toml_str(text).unwrap(), 8.0);
        assert_eq!(s.keyspace_cpu_quotas_millicores.get(&2), Some(&2000));
        assert_eq!(s.keyspace_estimated_cpu_per_request_us.get(&1), Some(&1500));
        assert_eq!(s.keyspace_burst_enabled.get(&2), Some(&false));
    }
}
