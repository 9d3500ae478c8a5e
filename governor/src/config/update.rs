//! Online updates: a reloaded file ([`ValidatedConfig::apply_update`]) or one
//! `config set key=value` ([`ValidatedConfig::apply_set`]).
//!
//! Both build the complete new configuration, run the same validation as a
//! start, then refuse changes to restart-only keys. The update is applied
//! entirely or not at all, and a refusal lists every reason. The running
//! configuration is never touched: the caller swaps in the returned value.

use std::collections::BTreeMap;

use serde::Serialize;

use super::error::{ConfigError, ConfigErrors, UpdateRejected};
use super::raw::RawConfig;
use super::source::SourceMap;
use super::throttle::Profile;
use super::validated::ValidatedConfig;

/// Keys that only take effect at start, and why.
const RESTART_ONLY: &[(&str, &str)] = &[
    ("resource-control.cpu-throttle.refill-interval", "the refill cadence is fixed at start"),
    ("resource-control.cpu-throttle.burst-window", "bucket capacities are sized at start"),
    ("agent.control-socket", "clients connect to the socket bound at start"),
    ("agent.measure", "the measurement backend is chosen at start"),
    ("agent.max-threads", "it sizes the shared thread-slot region"),
    ("agent.max-keyspaces", "it sizes the shared keyspace table"),
    ("agent.metrics-addr", "the /metrics listener is bound at start"),
    ("agent.timer-period", "the per-CPU timers are attached at start"),
    ("agent.cpu-pressure", "the wakeup program is attached at start"),
];

const MAX_READ: &str = "resource-control.max-read-cpu-ratio";

/// One changed key, with both values printed as TOML.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KeyChange {
    /// Dotted key.
    pub key: String,
    /// Running value.
    pub old: String,
    /// New value.
    pub new: String,
}

/// What an accepted update changes, for the agent's log and its hot paths.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ConfigDiff {
    /// Every changed key, in key order.
    pub changes: Vec<KeyChange>,
}

/// Things the agent must push to running components after an update.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HotUpdates {
    /// Recompute every auto-created cap bucket (or drop them at 0).
    pub tenant_max_cpu_ratio: bool,
    /// The next idle scan uses the new TTL.
    pub tenant_cap_idle_ttl: bool,
    /// Rebuild configured keyspace buckets.
    pub keyspace_cpu_quotas: bool,
    /// Legacy read-limiter budget (only changes while cpu-throttle is off).
    pub max_read_cpu_ratio: bool,
    /// Pending-write thresholds (global and the derived per-keyspace one).
    pub write_quota: bool,
    /// Admission mode or per-tenant limit.
    pub admission_control: bool,
}

impl ConfigDiff {
    /// True when nothing changed.
    pub fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }

    /// True when `key` (dotted) changed, or any key under it when it is a section.
    pub fn changed(&self, key: &str) -> bool {
        self.changes.iter().any(|c| c.key == key || c.key.strip_prefix(key).is_some_and(|r| r.starts_with('.')))
    }

    /// Changed keys.
    pub fn keys(&self) -> Vec<&str> {
        self.changes.iter().map(|c| c.key.as_str()).collect()
    }

    /// Which running components need a push.
    pub fn hot(&self) -> HotUpdates {
        let ct = "resource-control.cpu-throttle";
        HotUpdates {
            tenant_max_cpu_ratio: self.changed(&format!("{ct}.tenant-max-cpu-ratio")),
            tenant_cap_idle_ttl: self.changed(&format!("{ct}.tenant-cap-idle-ttl")),
            keyspace_cpu_quotas: self.changed(&format!("{ct}.keyspace-cpu-quotas")),
            max_read_cpu_ratio: self.changed(MAX_READ),
            write_quota: self.changed("write-quota"),
            admission_control: self.changed("admission-control"),
        }
    }
}

fn flatten(prefix: &str, table: &toml::Table, out: &mut BTreeMap<String, toml::Value>) {
    for (k, v) in table {
        let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        match v {
            toml::Value::Table(t) => flatten(&key, t, out),
            other => {
                out.insert(key, other.clone());
            }
        }
    }
}

fn diff_tables(old: &toml::Table, new: &toml::Table) -> ConfigDiff {
    let (mut a, mut b) = (BTreeMap::new(), BTreeMap::new());
    flatten("", old, &mut a);
    flatten("", new, &mut b);
    let mut changes: Vec<KeyChange> = b
        .iter()
        .filter(|(k, v)| a.get(*k) != Some(*v))
        .map(|(k, v)| KeyChange {
            key: k.clone(),
            old: a.get(k).map(ToString::to_string).unwrap_or_default(),
            new: v.to_string(),
        })
        .collect();
    // Keys the new configuration no longer writes (the last rule removed,
    // an optional key unset): their new value is empty.
    changes.extend(a.iter().filter(|(k, _)| !b.contains_key(*k)).map(|(k, v)| KeyChange {
        key: k.clone(),
        old: v.to_string(),
        new: String::new(),
    }));
    changes.sort_by(|x, y| x.key.cmp(&y.key));
    ConfigDiff { changes }
}

fn raw_table(raw: &RawConfig) -> toml::Table {
    toml::Table::try_from(raw).expect("raw config always serializes to a table")
}

impl ValidatedConfig {
    /// Keys that differ between `self` (running) and `new`.
    pub fn diff(&self, new: &ValidatedConfig) -> ConfigDiff {
        diff_tables(&self.to_table(), &new.to_table())
    }

    /// Validates a reloaded file against the running configuration. Errors
    /// carry the line in `source`.
    pub fn apply_update(&self, source: &str) -> Result<ValidatedConfig, UpdateRejected> {
        let (raw, map) = super::validated::parse_file(source).map_err(|errors| UpdateRejected { errors })?;
        self.check_update(&raw, &map)
    }

    /// Validates an already parsed configuration against the running one.
    pub fn apply_update_raw(&self, raw: &RawConfig) -> Result<ValidatedConfig, UpdateRejected> {
        self.check_update(raw, &SourceMap::none())
    }

    /// `governor config set <dotted_key>=<value>`: the running configuration
    /// with one key replaced, validated as a whole. `value` is TOML
    /// (`0.5`, `true`, `"10ms"`); a value that is not TOML is taken as a
    /// string, so `10ms` and `1:100,2:200` need no quotes.
    pub fn apply_set(&self, dotted_key: &str, value: &str) -> Result<ValidatedConfig, UpdateRejected> {
        let reject = |error| UpdateRejected { errors: ConfigErrors::one(error) };
        let key = dotted_key.trim();
        // From the raw form, so that values derived from others (the per-uid
        // quotas) stay derived and follow the key set.
        let mut table = raw_table(&self.to_raw());
        let (parents, leaf) = match key.rsplit_once('.') {
            Some((p, l)) => (p.split('.').collect::<Vec<_>>(), l),
            None => (Vec::new(), key),
        };
        let mut cursor = &mut table;
        for part in parents {
            cursor = match cursor.get_mut(part) {
                Some(toml::Value::Table(t)) => t,
                _ => {
                    return Err(reject(ConfigError::UnknownKey { key: key.into(), line: None }));
                }
            };
        }
        // A key the running configuration leaves out (an optional one, such
        // as `agent.access.socket-group`) is known if the section takes it.
        let absent = match cursor.get(leaf) {
            Some(toml::Value::Table(_)) => {
                return Err(reject(ConfigError::InvalidValue {
                    key: key.into(),
                    line: None,
                    reason: "is a section; set one of its keys".into(),
                }));
            }
            Some(_) => false,
            None => true,
        };
        let parsed = toml::from_str::<toml::Table>(&format!("v = {value}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(value.trim().to_string()));
        cursor.insert(leaf.to_string(), parsed);
        let mut raw: RawConfig = table.try_into().map_err(|e: toml::de::Error| {
            if absent && e.message().contains("unknown field") {
                return reject(ConfigError::UnknownKey { key: key.into(), line: None });
            }
            reject(ConfigError::InvalidValue { key: key.into(), line: None, reason: e.message().trim().to_string() })
        })?;
        if key == "resource-control.cpu-throttle.profile" {
            // One step: the profile sets every key it decides, keeping a
            // running tenant cap.
            let t = &mut raw.resource_control.cpu_throttle;
            let keep_cap = t.profile == Profile::Essential && self.cpu_throttle().tenant_max_cpu_ratio > 0.0;
            t.profile.fill(t, |k| k == "tenant-max-cpu-ratio" && keep_cap);
        }
        self.check_update(&raw, &SourceMap::none())
    }

    fn check_update(&self, raw: &RawConfig, map: &SourceMap) -> Result<ValidatedConfig, UpdateRejected> {
        let validated = ValidatedConfig::from_raw_with_map(raw, map);
        let mut errors = match &validated {
            Ok(_) => ConfigErrors::default(),
            Err(e) => e.clone(),
        };
        let raw_diff = diff_tables(&raw_table(&self.to_raw()), &raw_table(raw));
        for change in &raw_diff.changes {
            let why = RESTART_ONLY.iter().find(|(k, _)| *k == change.key).map(|(_, why)| *why);
            let why = why.or_else(|| {
                let throttle_on = self.cpu_throttle().enabled || raw.resource_control.cpu_throttle.enabled;
                (change.key == MAX_READ && throttle_on)
                    .then_some("it sizes the global token bucket while cpu-throttle is enabled")
            });
            if let Some(why) = why {
                errors.push(ConfigError::RestartOnly {
                    key: change.key.clone(),
                    line: map.line_of(&change.key),
                    old: change.old.clone(),
                    new: change.new.clone(),
                    why,
                });
            }
        }
        match validated {
            Ok(config) if errors.errors.is_empty() => Ok(config),
            _ => Err(UpdateRejected { errors: errors.sorted() }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diff_flattens_nested_tables_into_dotted_keys() {
        let old: toml::Table = toml::from_str("[a.b]\nx = 1\ny = \"s\"\n[c]\nz = true\n").unwrap();
        let new: toml::Table = toml::from_str("[a.b]\nx = 2\ny = \"s\"\n[c]\nz = true\n").unwrap();
        let diff = diff_tables(&old, &new);
        assert_eq!(diff.changes, vec![KeyChange { key: "a.b.x".into(), old: "1".into(), new: "2".into() }]);
        assert!(diff.changed("a.b.x") && diff.changed("a.b") && diff.changed("a"));
        assert!(!diff.changed("a.b.y") && !diff.changed("c") && !diff.changed("a.b.x2"));
        assert!(diff_tables(&old, &old).is_empty());
    }

    #[test]
    fn diff_reports_keys_added_and_keys_gone() {
        let old: toml::Table = toml::from_str("r = [1]\n[c]\nz = true\n").unwrap();
        let new: toml::Table = toml::from_str("[a]\nx = 2\n[c]\nz = true\n").unwrap();
        let diff = diff_tables(&old, &new);
        assert_eq!(
            diff.changes,
            vec![
                KeyChange { key: "a.x".into(), old: String::new(), new: "2".into() },
                KeyChange { key: "r".into(), old: "[1]".into(), new: String::new() },
            ]
        );
        assert!(diff.changed("r") && !diff.changed("c"));
    }

    #[test]
    fn every_restart_only_key_exists_in_the_config() {
        let table = ValidatedConfig::embedded_default().to_table();
        let mut flat = BTreeMap::new();
        flatten("", &table, &mut flat);
        for (key, _) in RESTART_ONLY {
            assert!(flat.contains_key(*key), "{key}");
        }
        assert!(flat.contains_key(MAX_READ));
    }

    #[test]
    fn a_rejected_set_does_not_touch_the_running_config() {
        let running = ValidatedConfig::embedded_default();
        let rejected = running.apply_set("agent.max-threads", "8").unwrap_err();
        // Out of range and restart-only; the per-uid quota, at half the
        // total, follows it and adds no error of its own.
        assert_eq!(rejected.errors.keys(), vec!["agent.max-threads", "agent.max-threads"]);
        let rejected = running.apply_set("agent.max-keyspaces", "8").unwrap_err();
        assert_eq!(rejected.errors.keys(), vec!["agent.max-keyspaces", "agent.max-keyspaces"]);
        assert_eq!(running, ValidatedConfig::embedded_default());
    }

    #[test]
    fn a_set_keeps_derived_quotas_derived_and_explicit_ones_checked() {
        let running = ValidatedConfig::embedded_default();
        let half = running.agent().max_keyspaces / 2;
        // An explicit per-uid quota is checked against the running total.
        let over = running.apply_set("agent.max-keyspaces-per-uid", &(2 * half + 1).to_string()).unwrap_err();
        assert_eq!(over.errors.keys(), vec!["agent.max-keyspaces-per-uid"]);
        let set = running.apply_set("agent.max-keyspaces-per-uid", "7").unwrap();
        assert_eq!(set.agent().keyspaces_per_uid(), 7);
        assert_eq!(set.agent().max_keyspaces, running.agent().max_keyspaces);
    }
}
