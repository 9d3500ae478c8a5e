//! tenant-cpu-cap.md §7 points 7 and 8: conflicting Essential settings are
//! rejected at start and on online updates, with every reason listed.

use keyspace_governor::config::{ConfigError, ValidatedConfig};

const ESSENTIAL: &str = include_str!("fixtures/seed_cap_essential.toml");
mod common;
const CT: &str = "resource-control.cpu-throttle";

/// `source` with the line `key = ...` replaced by `key = value`; returns the
/// new text and that line's number.
fn with(source: &str, key: &str, value: &str) -> (String, usize) {
    let mut line_no = 0;
    let lines: Vec<String> = source
        .lines()
        .enumerate()
        .map(|(i, l)| {
            let t = l.trim_start();
            if t.strip_prefix(key).is_some_and(|r| r.trim_start().starts_with('=')) {
                line_no = i + 1;
                format!("{key} = {value}")
            } else {
                l.to_string()
            }
        })
        .collect();
    assert!(line_no > 0, "{key} not in fixture");
    (lines.join("\n") + "\n", line_no)
}

/// The conflicting settings of §7 point 7 (plus the low-priority DAG bucket
/// from §4.3), each as (key, conflicting value).
const CONFLICTS: &[(&str, &str)] = &[
    ("keyspace-cpu-quotas", "\"1:1000\""),
    ("enable-pd-service-limit", "true"),
    ("enable-fair-allocation", "true"),
    ("enable-dynamic-adjustment", "true"),
    ("enable-burst", "true"),
    ("enforce-global-limit", "false"),
    ("low-priority-dag-global-enabled", "true"),
];

#[test]
fn seed_cap_07_conflicting_config_rejected() {
    // Each conflict alone is rejected, naming the key and its line.
    for (key, value) in CONFLICTS {
        let (source, line) = with(ESSENTIAL, key, value);
        let errors = ValidatedConfig::from_toml_str(&source).expect_err(key);
        // One error each: PD's missing endpoints are not asked for in
        // tenant-cap mode, where PD is refused anyway.
        assert_eq!(errors.errors.len(), 1, "{errors}");
        assert_eq!(errors.to_string().matches("not supported").count(), 0, "{errors}");
        let conflict = errors
            .errors
            .iter()
            .find(|e| matches!(e, ConfigError::Conflict { .. }))
            .unwrap_or_else(|| panic!("{key}: no conflict reported: {errors}"));
        match conflict {
            ConfigError::Conflict { key: k, line: l, reason } => {
                assert_eq!(k, &format!("{CT}.{key}"));
                assert_eq!(*l, Some(line));
                assert!(reason.contains("tenant-max-cpu-ratio > 0"), "{reason}");
            }
            other => panic!("{key}: expected a conflict, got {other:?}"),
        }
    }
    // Several at once: every reason is listed, one per line.
    let mut source = ESSENTIAL.to_string();
    for (key, value) in CONFLICTS {
        source = with(&source, key, value).0;
    }
    let errors = ValidatedConfig::from_toml_str(&source).unwrap_err();
    let mut keys = errors.keys();
    keys.sort();
    keys.dedup();
    let mut want: Vec<String> = CONFLICTS.iter().map(|(k, _)| format!("{CT}.{k}")).collect();
    want.sort();
    assert_eq!(keys, want);
    // One line per conflict.
    assert_eq!(errors.to_string().lines().count(), CONFLICTS.len());
    // The same settings with the cap off (Premium) are fine, PD aside (it
    // would need [pd] endpoints).
    let premium = with(&source, "tenant-max-cpu-ratio", "0.0").0;
    let premium = with(&premium, "enable-pd-service-limit", "false").0;
    ValidatedConfig::from_toml_str(&premium).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn seed_cap_08_hot_update_validation() {
    // Running: the seed's Premium example (burst, fair, dynamic, quotas on;
    // PD off: the sample names no PD endpoints).
    let running = ValidatedConfig::from_toml_str(&common::throttle_full_supported()).unwrap();
    let before = running.clone();

    // `config set` enabling the cap is refused as a whole, listing all conflicts.
    let rejected = running.apply_set(&format!("{CT}.tenant-max-cpu-ratio"), "0.4").unwrap_err();
    let mut keys = rejected.errors.keys();
    keys.sort();
    let want: Vec<String> = [
        "enable-burst",
        "enable-dynamic-adjustment",
        "enable-fair-allocation",
        "enforce-global-limit",
        "keyspace-cpu-quotas",
    ]
    .iter()
    .map(|k| format!("{CT}.{k}"))
    .collect();
    assert_eq!(keys, want, "{rejected}");
    assert_eq!(running, before, "running configuration changed");

    // A reloaded file that enables the cap with one conflicting option, plus
    // an unrelated valid change, is rejected entirely.
    let (file, burst_line) = with(ESSENTIAL, "enable-burst", "true");
    let file = format!("{file}[admission-control]\nmode = \"monitor\"\n");
    let rejected = running.apply_update(&file).unwrap_err();
    assert_eq!(rejected.errors.keys(), vec![format!("{CT}.enable-burst")]);
    assert_eq!(rejected.errors.errors[0].line(), Some(burst_line));
    assert!(rejected.to_string().contains("running configuration unchanged"));
    assert_eq!(running, before);

    // The Essential profile itself is accepted as an update from Premium
    // (refill-interval and burst-window are unchanged), and reports the hot keys.
    let premium_default = ValidatedConfig::embedded_default();
    let essential = premium_default.apply_update(ESSENTIAL).unwrap_or_else(|e| panic!("{e}"));
    let diff = premium_default.diff(&essential);
    assert!(diff.hot().tenant_max_cpu_ratio);
    assert!(diff.changed(&format!("{CT}.enable-burst")));

    // In cap mode the ratio and idle TTL are hot-updatable.
    let raised = essential.apply_set(&format!("{CT}.tenant-max-cpu-ratio"), "0.5").unwrap();
    let diff = essential.diff(&raised);
    assert_eq!(diff.keys(), vec![format!("{CT}.tenant-max-cpu-ratio")]);
    assert!(diff.hot().tenant_max_cpu_ratio && !diff.hot().tenant_cap_idle_ttl);
    let ttl = essential.apply_set(&format!("{CT}.tenant-cap-idle-ttl"), "1m").unwrap();
    assert!(essential.diff(&ttl).hot().tenant_cap_idle_ttl);
    // ...but turning burst back on while capped is not.
    let err = raised.apply_set(&format!("{CT}.enable-burst"), "true").unwrap_err();
    assert_eq!(err.errors.keys(), vec![format!("{CT}.enable-burst")]);
}
