//! `[resource-control.cpu-throttle]`: every key of the throttle seed's
//! Configuration TOML plus the tenant-cap seed's three keys. One type as
//! read from the file, as validated, and as the policy runs on it.
//!
//! Defaults are Premium-style (the throttle seed's sample values) with the
//! uniform tenant cap off (`tenant-max-cpu-ratio = 0.0`), so a node without
//! per-keyspace configuration behaves as it did before the governor.

use serde::{Deserialize, Serialize};

use super::checker::{CT, Checker, DAY, HOUR, MONTH, MS, SEC};
use super::keyspace_list::KeyspaceList;
use super::units::ConfigDuration;

/// `[resource-control.cpu-throttle]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct CpuThrottle {
    /// A deployment profile: `"custom"` (default: every key as written or
    /// its default), `"essential"` (the tenant-cap seed's Essential profile,
    /// §4.1: keys the file leaves out take its values) or `"premium"` (the
    /// throttle seed's defaults). Set online, it sets its keys together.
    pub profile: Profile,
    /// Turns the token-bucket throttle on. Off by default: measuring is safe
    /// to roll out, refusing work is a decision an operator makes.
    pub enabled: bool,
    /// Per-keyspace quotas, `"id:millicores,..."`. Premium tenants get their
    /// own bucket; unlisted keyspaces are not throttled unless the tenant cap
    /// is on. Must be empty in tenant-cap mode. Default `""`.
    pub keyspace_cpu_quotas: KeyspaceList<u64>,
    /// Makes the global bucket a hard node-level cap instead of best-effort
    /// tracking after keyspace allocation. Required in tenant-cap mode.
    /// Default `false` (the seed's Premium sample).
    pub enforce_global_limit: bool,

    /// Derives keyspace quotas from PD `service_limit` (RU/s) ratios, fetched
    /// from `[pd] endpoints`. Off by default.
    pub enable_pd_service_limit: bool,
    /// How often service limits are fetched. Default `30s`.
    pub pd_service_limit_fetch_interval: ConfigDuration,
    /// Timeout of one request to PD; at most the fetch interval. A round
    /// that outlasts the interval leaves its remaining keyspaces for the
    /// next one. Default `5s`.
    pub pd_service_limit_request_timeout: ConfigDuration,
    /// A keyspace without a successful answer from PD for this long (404s,
    /// errors) loses its PD quota. While PD cannot be reached at all, quotas
    /// stay. Default `10m`.
    pub pd_service_limit_ttl: ConfigDuration,
    /// ...or after this many consecutive 404s (at least 1). Default 3.
    pub pd_service_limit_consecutive_404: u32,
    /// Relative change below which a fetched quota is ignored, to avoid
    /// churning buckets on noise. Range [0, 1], default 0.01.
    pub pd_service_limit_update_threshold: f64,
    /// PD quotas win over `keyspace-cpu-quotas` when both exist. Default true.
    pub pd_override_config: bool,

    /// Tokens (CPU µs) taken before a request runs when nothing better is
    /// known. Default 1000 (1 ms).
    pub estimated_cpu_per_request_us: u64,
    /// Per-keyspace overrides of the estimate, `"id:us,..."`. Default `""`.
    pub keyspace_estimated_cpu_per_request_us: KeyspaceList<u64>,
    /// Learns each keyspace's estimate as an EMA of measured CPU per request,
    /// once per `stats-interval`. Default true.
    pub enable_adaptive_estimated_cpu_per_request_us: bool,
    /// How often buckets are refilled. Restart-only. Range 1ms..=1s, at most
    /// `burst-window`. Default `10ms`.
    pub refill_interval: ConfigDuration,
    /// Bucket capacity expressed as time at the refill rate. Restart-only.
    /// Default `100ms`, a compatibility choice (the old capacity).
    pub burst_window: ConfigDuration,

    /// Lowers/raises the global refill rate when node CPU crosses the
    /// watermarks. Must be off in tenant-cap mode. Default true.
    pub enable_dynamic_adjustment: bool,
    /// Node CPU ratio above which the refill rate is lowered. Default 0.8.
    pub high_watermark: f64,
    /// Node CPU ratio below which it is restored; below `high-watermark`.
    /// Default 0.5.
    pub low_watermark: f64,
    /// Legacy admission burst-share guard (proportional fair shares above
    /// the threshold). Must be off in tenant-cap mode. Default true.
    pub enable_fair_allocation: bool,
    /// Node CPU ratio above which fair allocation applies. Default 0.7.
    pub fair_allocation_threshold: f64,
    /// Lets an exhausted keyspace borrow from the global bucket while the
    /// node has headroom (zero-wait OLTP). Must be off in tenant-cap mode,
    /// where the cap is hard. Default true.
    pub enable_burst: bool,
    /// Node CPU ratio below which bursting is allowed. Default 0.9.
    pub burst_threshold: f64,
    /// Per-keyspace burst switches, `"id:true,..."`. Default `""`.
    pub keyspace_burst_enabled: KeyspaceList<bool>,

    /// Tops up tokens while a long request runs instead of guessing its whole
    /// cost up front. Allowed in tenant-cap mode (same buckets). Default true.
    pub enable_runtime_token_management: bool,
    /// How often a running request's consumption is checked, in µs.
    /// Default 2000.
    pub runtime_check_interval_us: u64,
    /// Fraction of the current allocation consumed that triggers a top-up.
    /// Range (0, 1], default 0.5.
    pub additional_allocation_threshold: f64,
    /// Tokens (µs) taken per top-up. Default 4000.
    pub per_allocation_us: u64,

    /// Uniform per-tenant hard cap as a share of node cores (Essential).
    /// `0.0` (default) keeps the legacy Premium behaviour; `> 0` gives every
    /// keyspace its own bucket of this size and requires the Essential
    /// profile. Range [0, 1]. Hot-updatable.
    pub tenant_max_cpu_ratio: f64,
    /// Auto-created cap buckets idle this long are evicted so long-running
    /// nodes do not accumulate dead tenants. At least 1ms, default `10m`.
    /// Hot-updatable.
    pub tenant_cap_idle_ttl: ConfigDuration,
    /// Extra global bucket for low-priority DAG requests. Its fallback path is
    /// not cap-aware, so it must be off in tenant-cap mode. Default false.
    pub low_priority_dag_global_enabled: bool,
}

impl CpuThrottle {
    /// True in Essential mode: every keyspace gets a uniform-cap bucket.
    pub fn tenant_cap_enabled(&self) -> bool {
        self.tenant_max_cpu_ratio > 0.0
    }

    /// What to tell an operator about quotas larger than a server of
    /// `cores` (`whose`: where that figure comes from, as the sentence
    /// names it): there they hold nothing back. Not an error: one file may
    /// serve a fleet whose larger nodes the quota fits.
    pub fn quotas_above(&self, cores: f64, whose: &str) -> Vec<String> {
        self.keyspace_cpu_quotas
            .iter()
            .filter(|&(_, millicores)| millicores as f64 / 1000.0 > cores)
            .map(|(id, millicores)| {
                format!(
                    "resource-control.cpu-throttle.keyspace-cpu-quotas: keyspace {id}'s quota of {:.3} cores is more than {whose} {cores:.2}: it limits nothing here (only the node's global bucket does)",
                    millicores as f64 / 1000.0
                )
            })
            .collect()
    }
}

/// `profile`: the keys a deployment profile decides, set in one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Profile {
    /// No profile: every key as written, or its default.
    #[default]
    Custom,
    /// tenant-cpu-cap.md §4.1: the throttle on, a uniform tenant cap (0.4
    /// unless set), the global limit hard; burst, fair allocation, dynamic
    /// adjustment, PD service limits, the low-priority DAG bucket and
    /// per-keyspace quotas off.
    Essential,
    /// keyspace-cpu-throttle.md's defaults: no uniform cap; burst, fair
    /// allocation and dynamic adjustment on; the global limit best-effort.
    Premium,
}

/// The tenant cap `profile = "essential"` gives when none is set: the
/// seed's example (tenant-cpu-cap.md §4.1).
pub const ESSENTIAL_TENANT_MAX_CPU_RATIO: f64 = 0.4;

impl CpuThrottle {
    /// Every key's range and the rules between them, the Essential
    /// profile's included (validation calls it); `max_keyspaces` is
    /// `agent.max-keyspaces`.
    pub(super) fn check(&self, c: &mut Checker<'_>, max_keyspaces: u32) {
        c.list("keyspace-cpu-quotas", &self.keyspace_cpu_quotas);
        c.list("keyspace-estimated-cpu-per-request-us", &self.keyspace_estimated_cpu_per_request_us);
        c.list("keyspace-burst-enabled", &self.keyspace_burst_enabled);
        let quotas = self.keyspace_cpu_quotas.len();
        c.check(
            quotas <= max_keyspaces as usize,
            CT,
            "keyspace-cpu-quotas",
            format!("lists {quotas} keyspaces, more than agent.max-keyspaces ({})", max_keyspaces),
        );
        c.duration(CT, "pd-service-limit-fetch-interval", self.pd_service_limit_fetch_interval, SEC / 10, DAY);
        c.duration(CT, "pd-service-limit-request-timeout", self.pd_service_limit_request_timeout, MS, HOUR);
        c.check(
            self.pd_service_limit_request_timeout <= self.pd_service_limit_fetch_interval,
            CT,
            "pd-service-limit-request-timeout",
            "must not exceed pd-service-limit-fetch-interval, or fetches overlap",
        );
        c.duration(CT, "pd-service-limit-ttl", self.pd_service_limit_ttl, MS, MONTH);
        c.check(
            self.pd_service_limit_ttl >= self.pd_service_limit_fetch_interval,
            CT,
            "pd-service-limit-ttl",
            "must be at least pd-service-limit-fetch-interval, or every keyspace expires between fetches",
        );
        c.int(CT, "pd-service-limit-consecutive-404", self.pd_service_limit_consecutive_404.into(), 1, 1000);
        c.ratio(CT, "pd-service-limit-update-threshold", self.pd_service_limit_update_threshold, true);
        c.int(CT, "estimated-cpu-per-request-us", self.estimated_cpu_per_request_us, 1, 60_000_000);
        c.duration(CT, "refill-interval", self.refill_interval, MS, SEC);
        c.duration(CT, "burst-window", self.burst_window, MS, SEC * 10);
        c.check(
            self.refill_interval <= self.burst_window,
            CT,
            "refill-interval",
            format!("must not exceed burst-window ({}), got {}", self.burst_window, self.refill_interval),
        );
        c.ratio(CT, "high-watermark", self.high_watermark, false);
        c.ratio(CT, "low-watermark", self.low_watermark, true);
        c.check(
            self.low_watermark < self.high_watermark,
            CT,
            "low-watermark",
            format!("must be below high-watermark ({}), got {}", self.high_watermark, self.low_watermark),
        );
        c.ratio(CT, "fair-allocation-threshold", self.fair_allocation_threshold, false);
        c.ratio(CT, "burst-threshold", self.burst_threshold, false);
        c.int(CT, "runtime-check-interval-us", self.runtime_check_interval_us, 100, 10_000_000);
        c.ratio(CT, "additional-allocation-threshold", self.additional_allocation_threshold, false);
        c.int(CT, "per-allocation-us", self.per_allocation_us, 1, 60_000_000);
        c.ratio(CT, "tenant-max-cpu-ratio", self.tenant_max_cpu_ratio, true);
        c.duration(CT, "tenant-cap-idle-ttl", self.tenant_cap_idle_ttl, MS, MONTH);

        match self.profile {
            Profile::Essential if self.tenant_max_cpu_ratio <= 0.0 => c.invalid(
                format!("{CT}.tenant-max-cpu-ratio"),
                "must be above 0 with profile = \"essential\" (the uniform tenant cap is the profile)",
            ),
            Profile::Premium if self.tenant_max_cpu_ratio > 0.0 => c.invalid(
                format!("{CT}.tenant-max-cpu-ratio"),
                "must be 0 with profile = \"premium\" (a uniform tenant cap is profile = \"essential\")",
            ),
            _ => {}
        }
        // Essential profile (tenant-cpu-cap.md §4.3): every violated rule is listed.
        if self.tenant_max_cpu_ratio > 0.0 {
            c.cap_rule("enforce-global-limit", !self.enforce_global_limit, "must be true");
            c.cap_rule("enable-burst", self.enable_burst, "must be false");
            c.cap_rule("enable-fair-allocation", self.enable_fair_allocation, "must be false");
            c.cap_rule("enable-dynamic-adjustment", self.enable_dynamic_adjustment, "must be false");
            c.cap_rule("enable-pd-service-limit", self.enable_pd_service_limit, "must be false");
            c.cap_rule(
                "low-priority-dag-global-enabled",
                self.low_priority_dag_global_enabled,
                "must be false (its fallback path bypasses the tenant cap)",
            );
            c.cap_rule(
                "keyspace-cpu-quotas",
                !self.keyspace_cpu_quotas.is_empty() || self.keyspace_cpu_quotas.problem().is_some(),
                "must be empty (the uniform cap replaces per-keyspace quotas)",
            );
        }
    }
}

impl Profile {
    /// Gives `t` the profile's value for each key it decides, except those
    /// `keep` names (a key written in the file, or a running tenant cap when
    /// the profile is set online).
    pub(crate) fn fill(self, t: &mut CpuThrottle, keep: impl Fn(&str) -> bool) {
        let premium = CpuThrottle::default();
        let (enabled, ratio, off, global) = match self {
            Profile::Custom => return,
            Profile::Essential => (Some(true), ESSENTIAL_TENANT_MAX_CPU_RATIO, true, true),
            Profile::Premium => (None, premium.tenant_max_cpu_ratio, false, premium.enforce_global_limit),
        };
        let set = |key: &str, field: &mut bool, value: bool| {
            if !keep(key) {
                *field = value;
            }
        };
        if let Some(on) = enabled {
            set("enabled", &mut t.enabled, on);
        }
        set("enforce-global-limit", &mut t.enforce_global_limit, global);
        set("enable-burst", &mut t.enable_burst, if off { false } else { premium.enable_burst });
        set(
            "enable-fair-allocation",
            &mut t.enable_fair_allocation,
            if off { false } else { premium.enable_fair_allocation },
        );
        set(
            "enable-dynamic-adjustment",
            &mut t.enable_dynamic_adjustment,
            if off { false } else { premium.enable_dynamic_adjustment },
        );
        if off {
            set("enable-pd-service-limit", &mut t.enable_pd_service_limit, false);
            set("low-priority-dag-global-enabled", &mut t.low_priority_dag_global_enabled, false);
            if !keep("keyspace-cpu-quotas") {
                t.keyspace_cpu_quotas.clear();
            }
        }
        if !keep("tenant-max-cpu-ratio") {
            t.tenant_max_cpu_ratio = ratio;
        }
    }
}

impl Default for CpuThrottle {
    fn default() -> Self {
        Self {
            profile: Profile::Custom,
            enabled: false,
            keyspace_cpu_quotas: KeyspaceList::default(),
            enforce_global_limit: false,
            enable_pd_service_limit: false,
            pd_service_limit_fetch_interval: ConfigDuration::from_secs(30),
            pd_service_limit_request_timeout: ConfigDuration::from_secs(5),
            pd_service_limit_ttl: ConfigDuration::from_secs(600),
            pd_service_limit_consecutive_404: 3,
            pd_service_limit_update_threshold: 0.01,
            pd_override_config: true,
            estimated_cpu_per_request_us: 1000,
            keyspace_estimated_cpu_per_request_us: KeyspaceList::default(),
            enable_adaptive_estimated_cpu_per_request_us: true,
            refill_interval: ConfigDuration::from_millis(10),
            burst_window: ConfigDuration::from_millis(100),
            enable_dynamic_adjustment: true,
            high_watermark: 0.8,
            low_watermark: 0.5,
            enable_fair_allocation: true,
            fair_allocation_threshold: 0.7,
            enable_burst: true,
            burst_threshold: 0.9,
            keyspace_burst_enabled: KeyspaceList::default(),
            enable_runtime_token_management: true,
            runtime_check_interval_us: 2000,
            additional_allocation_threshold: 0.5,
            per_allocation_us: 4000,
            tenant_max_cpu_ratio: 0.0,
            tenant_cap_idle_ttl: ConfigDuration::from_secs(600),
            low_priority_dag_global_enabled: false,
        }
    }
}
