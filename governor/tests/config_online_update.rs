//! Online updates (file reload and `config set`): validated as a whole
//! against the running configuration, restart-only keys refused, all or
//! nothing, every reason listed.

use keyspace_governor::config::{ConfigError, ValidatedConfig};

mod common;

const CT: &str = "resource-control.cpu-throttle";

fn running() -> ValidatedConfig {
    // cpu-throttle enabled, so max-read-cpu-ratio is restart-only.
    ValidatedConfig::from_toml_str(&common::throttle_full_supported()).unwrap()
}

/// (dotted key, value) pairs a `config set` must refuse, naming that key.
const BAD_SETS: &[(&str, &str)] = &[
    ("resource-control.cpu-throttle.refill-interval", "20ms"),
    ("resource-control.cpu-throttle.burst-window", "200ms"),
    ("resource-control.max-read-cpu-ratio", "0.7"),
    ("agent.control-socket", "/tmp/other.sock"),
    ("agent.measure", "thread-clock"),
    ("agent.max-threads", "1024"),
    ("agent.max-keyspaces", "128"),
    ("resource-control.cpu-throttle.tenant-max-cpu-ratio", "1.5"),
    ("resource-control.cpu-throttle.tenant-cap-idle-ttl", "0ms"),
    ("resource-control.cpu-throttle.low-watermark", "0.95"),
    ("resource-control.cpu-throttle.keyspace-cpu-quotas", "1:100,,2:3"),
    ("resource-control.cpu-throttle.keyspace-cpu-quotas", "1:100,1:5"),
    ("resource-control.cpu-throttle.enable-burst", "maybe"),
    ("resource-control.cpu-throttle.pd-service-limit-ttl", "10"),
    ("resource-control.cpu-throttle.no-such-key", "1"),
    ("no-such-section.key", "1"),
    ("agent.metrics-addr", "nowhere"),
    ("admission-control.mode", "strict"),
    ("admission-control.max-concurrent-per-tenant", "-3"),
    ("write-quota.pending-write-threshold", "lots"),
    ("resource-control.cpu-throttle", "1"),
];

#[test]
fn every_bad_set_is_rejected_naming_the_key() {
    let running = running();
    let before = running.clone();
    for (key, value) in BAD_SETS {
        let rejected = running.apply_set(key, value).expect_err(&format!("accepted {key}={value}"));
        assert!(rejected.errors.names_key(key), "{key}={value}: wrong key in\n{rejected}");
        assert!(rejected.to_string().contains(key), "{rejected}");
    }
    assert_eq!(running, before);
}

#[test]
fn restart_only_changes_in_a_reloaded_file_are_all_listed_with_lines() {
    let running = running();
    let source = common::throttle_full_supported()
        .replace("refill-interval = \"10ms\"", "refill-interval = \"50ms\"")
        .replace("burst-window = \"100ms\"", "burst-window = \"500ms\"")
        .replace("max-read-cpu-ratio = 0.6", "max-read-cpu-ratio = 0.8")
        + "[agent]\nmeasure = \"ebpf\"\nmax-threads = 4096\ncontrol-socket = \"/tmp/g.sock\"\n"
        + "max-keyspaces = 64\ntimer-period = \"5ms\"\nmetrics-addr = \"127.0.0.1:9000\"\n";
    let rejected = running.apply_update(&source).unwrap_err();
    let mut keys = rejected.errors.keys();
    keys.sort();
    assert_eq!(
        keys,
        vec![
            "agent.control-socket",
            "agent.max-keyspaces",
            "agent.max-threads",
            "agent.measure",
            "agent.metrics-addr",
            "agent.timer-period",
            "resource-control.cpu-throttle.burst-window",
            "resource-control.cpu-throttle.refill-interval",
            "resource-control.max-read-cpu-ratio",
        ]
    );
    for e in &rejected.errors.errors {
        assert!(e.line().is_some(), "no line for {e}");
    }
    let refill = rejected.errors.errors.iter().find(|e| e.key() == format!("{CT}.refill-interval")).unwrap();
    assert!(matches!(refill, ConfigError::RestartOnly { old, new, .. } if old == "\"10ms\"" && new == "\"50ms\""));
    assert_eq!(rejected.to_string().lines().count(), 1 + 9);
}

#[test]
fn syntax_errors_in_a_reloaded_file_are_rejected_with_key_and_line() {
    let rejected = running().apply_update("[agent]\nmax-threads = \"many\"\n").unwrap_err();
    assert_eq!(rejected.errors.keys(), vec!["agent.max-threads"]);
    assert_eq!(rejected.errors.errors[0].line(), Some(2));
}

#[test]
fn max_read_cpu_ratio_is_hot_while_cpu_throttle_is_disabled() {
    let running = ValidatedConfig::embedded_default();
    assert!(!running.cpu_throttle().enabled);
    let updated = running.apply_set("resource-control.max-read-cpu-ratio", "0.7").unwrap();
    let diff = running.diff(&updated);
    assert_eq!(diff.keys(), vec!["resource-control.max-read-cpu-ratio"]);
    assert!(diff.hot().max_read_cpu_ratio);
    assert_eq!(updated.resource_control().max_read_cpu_ratio, 0.7);
    // Enabling the throttle and changing the ratio in one step is refused.
    let source = "[resource-control]\nmax-read-cpu-ratio = 0.7\n[resource-control.cpu-throttle]\nenabled = true\n";
    let rejected = running.apply_update(source).unwrap_err();
    assert_eq!(rejected.errors.keys(), vec!["resource-control.max-read-cpu-ratio"]);
    assert_eq!(rejected.errors.errors[0].line(), Some(2));
}

#[test]
fn accepted_update_reports_changed_keys_and_hot_flags() {
    let running = running();
    let source = common::throttle_full_supported()
        + "[admission-control]\nmode = \"monitor\"\nmax-concurrent-per-tenant = 32\n"
        + "[write-quota]\npending-write-threshold = \"256MiB\"\n";
    let updated = running.apply_update(&source).unwrap();
    let diff = running.diff(&updated);
    assert_eq!(
        diff.keys(),
        vec![
            "admission-control.max-concurrent-per-tenant",
            "admission-control.mode",
            "write-quota.pending-write-threshold",
        ]
    );
    let hot = diff.hot();
    assert!(hot.admission_control && hot.write_quota);
    assert!(!hot.tenant_max_cpu_ratio && !hot.keyspace_cpu_quotas);
    assert_eq!(updated.admission_control().limit(), Some(32));
    assert_eq!(diff.changes[1].old, "\"disabled\"");
    assert_eq!(diff.changes[1].new, "\"monitor\"");
    // Unchanged reload: empty diff.
    assert!(running.diff(&running.apply_update(&common::throttle_full_supported()).unwrap()).is_empty());
}

#[test]
fn set_accepts_unquoted_strings_and_typed_values() {
    let running = running();
    let a = running.apply_set(&format!("{CT}.keyspace-cpu-quotas"), "1:500, 3:700").unwrap();
    assert_eq!(a.cpu_throttle().keyspace_cpu_quotas.get(3), Some(700));
    assert!(running.diff(&a).hot().keyspace_cpu_quotas);
    let b = running.apply_set(&format!("{CT}.pd-service-limit-ttl"), "\"20m\"").unwrap();
    assert_eq!(b.cpu_throttle().pd_service_limit_ttl.to_string(), "20m");
    // An address parses unquoted too; the listener is bound at start.
    let c = running.apply_set("agent.metrics-addr", "[::1]:9000").unwrap_err();
    assert!(c.to_string().contains("bound at start"), "{c}");
    let d = running.apply_set(&format!("{CT}.enable-burst"), "false").unwrap();
    assert!(!d.cpu_throttle().enable_burst);
}
