//! The validated configuration: typed values (parsed keyspace lists, a real
//! socket address) that passed every range and cross-field rule. It can only
//! be built by [`ValidatedConfig::from_toml_str`], [`ValidatedConfig::from_raw`],
//! [`ValidatedConfig::embedded_default`] or an accepted online update, so
//! holding one is proof the rules hold.
//!
//! It serializes back to TOML or JSON with the file's kebab-case keys
//! (durations as strings, lists as `"id:value"` strings), for
//! `governor config show`; the TOML output parses back to the same value.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Serialize;

use super::keyspace_list::KeyspaceList;
use super::raw::{AdmissionMode, MeasureMode, RawConfig};
use super::source::SourceMap;
use super::units::{ByteSize, ConfigDuration};

/// The embedded default configuration file, documented key by key.
pub const EMBEDDED_DEFAULT_TOML: &str = include_str!("default.toml");

/// A configuration that passed validation. See the module docs.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ValidatedConfig {
    pub(crate) resource_control: ResourceControl,
    pub(crate) write_quota: WriteQuota,
    pub(crate) admission_control: AdmissionControl,
    pub(crate) agent: AgentConfig,
    pub(crate) pd: super::pd::Pd,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) rules: Vec<super::rules::Rule>,
}

/// `[resource-control]`, validated. Field meanings: see
/// [`super::RawResourceControl`].
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ResourceControl {
    pub enabled: bool,
    pub stats_interval: ConfigDuration,
    pub window_size: ConfigDuration,
    pub max_read_cpu_ratio: f64,
    pub server_cpu_cores: f64,
    pub enable_qps_bytes_limiter: bool,
    pub cpu_throttle: CpuThrottle,
}

/// `[resource-control.cpu-throttle]`, validated. Field meanings: see
/// [`super::RawCpuThrottle`].
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct CpuThrottle {
    pub profile: super::raw_throttle::Profile,
    pub enabled: bool,
    pub keyspace_cpu_quotas: KeyspaceList<u64>,
    pub enforce_global_limit: bool,
    pub enable_pd_service_limit: bool,
    pub pd_service_limit_fetch_interval: ConfigDuration,
    pub pd_service_limit_request_timeout: ConfigDuration,
    pub pd_service_limit_ttl: ConfigDuration,
    pub pd_service_limit_consecutive_404: u32,
    pub pd_service_limit_update_threshold: f64,
    pub pd_override_config: bool,
    pub estimated_cpu_per_request_us: u64,
    pub keyspace_estimated_cpu_per_request_us: KeyspaceList<u64>,
    pub enable_adaptive_estimated_cpu_per_request_us: bool,
    pub refill_interval: ConfigDuration,
    pub burst_window: ConfigDuration,
    pub enable_dynamic_adjustment: bool,
    pub high_watermark: f64,
    pub low_watermark: f64,
    pub enable_fair_allocation: bool,
    pub fair_allocation_threshold: f64,
    pub enable_burst: bool,
    pub burst_threshold: f64,
    pub keyspace_burst_enabled: KeyspaceList<bool>,
    pub enable_runtime_token_management: bool,
    pub runtime_check_interval_us: u64,
    pub additional_allocation_threshold: f64,
    pub per_allocation_us: u64,
    pub tenant_max_cpu_ratio: f64,
    pub tenant_cap_idle_ttl: ConfigDuration,
    pub low_priority_dag_global_enabled: bool,
}

impl CpuThrottle {
    /// True in Essential mode: every keyspace gets a uniform-cap bucket.
    pub fn tenant_cap_enabled(&self) -> bool {
        self.tenant_max_cpu_ratio > 0.0
    }
}

/// `[write-quota]`, validated.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct WriteQuota {
    /// Global cap on pending write bytes.
    pub pending_write_threshold: ByteSize,
}

impl WriteQuota {
    /// The per-keyspace cap, `0.3 ×` the global threshold (rounded down).
    /// Derived, not a key: the seed deliberately adds no knob.
    pub fn per_keyspace_pending_write_threshold(&self) -> ByteSize {
        ByteSize(self.pending_write_threshold.0 / 10 * 3 + self.pending_write_threshold.0 % 10 * 3 / 10)
    }
}

/// `[admission-control]`, validated.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct AdmissionControl {
    /// `disabled`, `monitor` or `enforced`.
    pub mode: AdmissionMode,
    /// In-flight requests per tenant; `None` when the file says 0 (no limit).
    #[serde(serialize_with = "limit_as_zero")]
    pub max_concurrent_per_tenant: Option<u32>,
}

fn limit_as_zero<S: serde::Serializer>(v: &Option<u32>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u32(v.unwrap_or(0))
}

/// `[agent]`, validated. Field meanings: see [`super::RawAgent`].
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct AgentConfig {
    pub control_socket: PathBuf,
    pub metrics_addr: SocketAddr,
    pub metrics_max_keyspaces: u32,
    pub measure: MeasureMode,
    pub timer_period: ConfigDuration,
    pub max_threads: u32,
    pub max_keyspaces: u32,
    pub max_threads_per_uid: u32,
    pub max_keyspaces_per_uid: u32,
    /// `[agent.access]` (a table: after every plain key).
    pub access: super::access::Access,
}

/// A file as written, with its profile's values for the keys it leaves
/// out, and where each key sits.
pub(crate) fn parse_file(source: &str) -> Result<(RawConfig, SourceMap), super::ConfigError> {
    let map = SourceMap::new(source);
    let mut raw: RawConfig = toml::from_str(source).map_err(|e| map.convert(&e))?;
    let t = &mut raw.resource_control.cpu_throttle;
    t.profile.fill(t, |key| map.line_of(&format!("resource-control.cpu-throttle.{key}")).is_some());
    Ok((raw, map))
}

impl ValidatedConfig {
    /// `[resource-control]`.
    pub fn resource_control(&self) -> &ResourceControl {
        &self.resource_control
    }

    /// `[resource-control.cpu-throttle]`.
    pub fn cpu_throttle(&self) -> &CpuThrottle {
        &self.resource_control.cpu_throttle
    }

    /// `[write-quota]`.
    pub fn write_quota(&self) -> &WriteQuota {
        &self.write_quota
    }

    /// `[admission-control]`.
    pub fn admission_control(&self) -> &AdmissionControl {
        &self.admission_control
    }

    /// `[agent]`.
    pub fn agent(&self) -> &AgentConfig {
        &self.agent
    }

    /// `[pd]`.
    pub fn pd(&self) -> &super::pd::Pd {
        &self.pd
    }

    /// `[[rules]]`, in order (first match wins).
    pub fn rules(&self) -> &[super::rules::Rule] {
        &self.rules
    }

    /// The configuration as a TOML document with every key spelled out.
    pub fn to_toml_string(&self) -> String {
        toml::to_string(self).expect("validated config always serializes to TOML")
    }

    /// The configuration as pretty JSON with the same keys.
    pub fn to_json_string(&self) -> String {
        serde_json::to_string_pretty(self).expect("validated config always serializes to JSON")
    }

    /// The configuration as a TOML table (every key present).
    pub(crate) fn to_table(&self) -> toml::Table {
        toml::Table::try_from(self).expect("validated config always serializes to a table")
    }

    /// Back to the raw form, e.g. to edit one key and validate again.
    pub fn to_raw(&self) -> RawConfig {
        let mut raw: RawConfig = self.to_table().try_into().expect("validated config always parses back as raw");
        // Per-uid quotas at their derived default stay derived, so a change
        // of the totals moves them along.
        let a = &mut raw.agent;
        if a.max_threads_per_uid == Some(a.max_threads / 2) {
            a.max_threads_per_uid = None;
        }
        if a.max_keyspaces_per_uid == Some(a.max_keyspaces / 2) {
            a.max_keyspaces_per_uid = None;
        }
        raw
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

    #[test]
    fn to_raw_round_trips() {
        let cfg = ValidatedConfig::embedded_default();
        assert_eq!(cfg.to_raw(), RawConfig::default());
        assert_eq!(ValidatedConfig::from_raw(&cfg.to_raw()).unwrap(), cfg);
    }
}
