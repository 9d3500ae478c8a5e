//! The validated configuration: typed values (parsed keyspace lists, a real
//! socket address) that passed every range and cross-field rule. It can only
//! be built by [`ValidatedConfig::from_toml_str`], [`ValidatedConfig::from_raw`],
//! [`ValidatedConfig::embedded_default`] or an accepted online update, so
//! holding one is proof the rules hold.
//!
//! It serializes back to TOML or JSON with the file's kebab-case keys
//! (durations as strings, lists as `"id:value"` strings), for
//! `governor config show`; the TOML output parses back to the same value.

use serde::Serialize;

use super::raw::{AgentConfig, RawConfig};
use super::sections::{AdmissionControl, LatencyGuard, ResourceControl, WriteQuota};
use super::source::SourceMap;
use super::throttle::CpuThrottle;

/// The embedded default configuration file, documented key by key.
pub const EMBEDDED_DEFAULT_TOML: &str = include_str!("default.toml");

/// A configuration that passed validation. See the module docs.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ValidatedConfig {
    pub(crate) resource_control: ResourceControl,
    pub(crate) write_quota: WriteQuota,
    pub(crate) admission_control: AdmissionControl,
    pub(crate) latency_guard: LatencyGuard,
    pub(crate) agent: AgentConfig,
    /// `[agent.access]` resolved (it prints back as written, in `agent`).
    #[serde(skip)]
    pub(crate) access: super::access::Access,
    pub(crate) pd: super::pd::Pd,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) rules: Vec<super::rules::Rule>,
}

/// A file as written, with its profile's values for the keys it leaves
/// out, and where each key sits.
pub(crate) fn parse_file(source: &str) -> Result<(RawConfig, SourceMap), super::ConfigErrors> {
    let map = SourceMap::new(source);
    // Serde stops at the first unknown key or value of the wrong type. So
    // that one run names them all, the line of each is blanked (when it
    // holds the whole `key = value`) and the file read again; the lines
    // keep their numbers. Range and consistency checks follow once the
    // file reads.
    let mut errors = Vec::new();
    let mut lines: Vec<&str> = source.lines().collect();
    let mut text = std::borrow::Cow::Borrowed(source);
    let mut raw: RawConfig = loop {
        match toml::from_str(&text) {
            Ok(raw) if errors.is_empty() => break raw,
            Ok(_) => return Err(super::ConfigErrors { errors }),
            Err(e) => {
                // The blanked lines moved the byte offsets, not the lines.
                let error = match &text {
                    std::borrow::Cow::Borrowed(_) => map.convert(&e),
                    std::borrow::Cow::Owned(t) => {
                        map.convert_at(&e, e.span().map(|s| SourceMap::new(t).line_of_offset(s.start)))
                    }
                };
                let line = error.line().filter(|l| {
                    let at = l.wrapping_sub(1);
                    errors.len() < 64
                        && lines.get(at).is_some_and(|t| {
                            !t.trim().is_empty() && !t.trim_start().starts_with('[') && t.parse::<toml::Table>().is_ok()
                        })
                });
                // An element of an array of tables that lacks a key: the
                // whole element goes, so the next ones are read too.
                let element = error.line().filter(|l| {
                    errors.len() < 64
                        && e.message().starts_with("missing field")
                        && lines.get(l.wrapping_sub(1)).is_some_and(|t| t.trim_start().starts_with("[["))
                });
                errors.push(error);
                if let Some(l) = element {
                    let end =
                        lines[l..].iter().position(|t| t.trim_start().starts_with('[')).map_or(lines.len(), |n| l + n);
                    lines[l - 1..end].iter_mut().for_each(|t| *t = "");
                    text = std::borrow::Cow::Owned(lines.join("\n"));
                    continue;
                }
                let Some(l) = line else { return Err(super::ConfigErrors { errors }) };
                lines[l - 1] = "";
                text = std::borrow::Cow::Owned(lines.join("\n"));
            }
        }
    };
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

    pub fn latency_guard(&self) -> &LatencyGuard {
        &self.latency_guard
    }

    /// `[admission-control]`.
    pub fn admission_control(&self) -> &AdmissionControl {
        &self.admission_control
    }

    /// `[agent]`.
    pub fn agent(&self) -> &AgentConfig {
        &self.agent
    }

    /// `[agent.access]`, its users and groups resolved.
    pub fn access(&self) -> &super::access::Access {
        &self.access
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

    /// What to tell an operator about a configuration that holds on a
    /// server of `cores` (`whose`: where that figure comes from) but may not
    /// be what was meant: quotas above the server (they hold nothing back),
    /// and a tenant cap not below the node's read budget (one tenant at its
    /// cap can empty the global bucket, and the others are then refused or
    /// wait there). Not errors.
    pub fn notices_on(&self, cores: f64, whose: &str) -> Vec<String> {
        let t = self.cpu_throttle();
        let mut notes = t.quotas_above(cores, whose);
        let budget = self.resource_control.max_read_cpu_ratio;
        if t.enabled && t.tenant_max_cpu_ratio > 0.0 && t.tenant_max_cpu_ratio >= budget {
            notes.push(format!(
                "resource-control.cpu-throttle.tenant-max-cpu-ratio: {} is not below resource-control.max-read-cpu-ratio ({budget}): one tenant at its cap can take the node's whole read budget, and the others are then refused (global_exhausted) or wait in the global bucket's line; keep the cap below it (the Essential profile's 0.4 of 0.6)",
                t.tenant_max_cpu_ratio
            ));
        }
        notes
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
    fn to_raw_round_trips() {
        let cfg = ValidatedConfig::embedded_default();
        assert_eq!(cfg.to_raw(), RawConfig::default());
        assert_eq!(ValidatedConfig::from_raw(&cfg.to_raw()).unwrap(), cfg);
    }
}
