//! The seeds' own sample configurations validate, the embedded default
//! validates, and an empty file gives the documented defaults.

use std::time::Duration;

use keyspace_governor::config::{
    AdmissionMode, ByteSize, EMBEDDED_DEFAULT_TOML, MeasureMode, RawConfig, ValidatedConfig,
};

const ESSENTIAL: &str = include_str!("fixtures/seed_cap_essential.toml");
mod common;

const THROTTLE_FULL: &str = include_str!("fixtures/seed_throttle_full.toml");

#[test]
fn seed_cap_essential_profile_validates() {
    let cfg = ValidatedConfig::from_toml_str(ESSENTIAL).unwrap_or_else(|e| panic!("{e}"));
    let t = cfg.cpu_throttle();
    assert!(t.tenant_cap_enabled());
    assert_eq!(t.tenant_max_cpu_ratio, 0.4);
    assert_eq!(t.tenant_cap_idle_ttl.get(), Duration::from_secs(600));
    assert!(t.enforce_global_limit);
    assert!(!t.enable_burst && !t.enable_fair_allocation && !t.enable_dynamic_adjustment);
    assert!(!t.enable_pd_service_limit && !t.low_priority_dag_global_enabled);
    assert!(t.enable_runtime_token_management);
    assert!(t.keyspace_cpu_quotas.is_empty());
    assert_eq!(cfg.resource_control().max_read_cpu_ratio, 0.6);
}

#[test]
fn seed_throttle_full_example_is_refused_only_for_what_governor_does_not_implement_or_lacks() {
    let errors = ValidatedConfig::from_toml_str(THROTTLE_FULL).unwrap_err();
    assert_eq!(
        errors.keys(),
        vec!["resource-control.enable-qps-bytes-limiter", "resource-control.cpu-throttle.enable-pd-service-limit",]
    );
    let text = errors.to_string();
    assert!(text.matches("not supported").count() == 1, "{errors}");
    // A TiKV node knows PD from its own [pd] section; governor needs it written.
    assert!(text.contains("enable-pd-service-limit: needs pd.endpoints"), "{errors}");
    let with_pd = format!("{THROTTLE_FULL}\n[pd]\nendpoints = [\"127.0.0.1:2379\"]\n");
    let errors = ValidatedConfig::from_toml_str(&with_pd).unwrap_err();
    assert_eq!(errors.keys(), vec!["resource-control.enable-qps-bytes-limiter"]);
}

#[test]
fn seed_throttle_full_example_validates_in_premium_mode() {
    // The seed's sample with the QPS limiter (not implemented) and PD (no
    // endpoints given) off.
    let text = common::throttle_full_supported();
    let cfg = ValidatedConfig::from_toml_str(&text).unwrap_or_else(|e| panic!("{e}"));
    let t = cfg.cpu_throttle();
    assert!(!t.tenant_cap_enabled(), "tenant-max-cpu-ratio is absent, so legacy mode");
    assert_eq!(t.keyspace_cpu_quotas.get(1), Some(1000));
    assert_eq!(t.keyspace_cpu_quotas.get(2), Some(2000));
    assert_eq!(t.keyspace_estimated_cpu_per_request_us.get(2), Some(5000));
    assert_eq!(t.keyspace_burst_enabled.get(1), Some(true));
    assert_eq!(t.keyspace_burst_enabled.get(2), Some(false));
    assert_eq!(t.pd_service_limit_consecutive_404, 3);
    assert_eq!(t.pd_service_limit_fetch_interval.get(), Duration::from_secs(30));
    assert_eq!(t.refill_interval.get(), Duration::from_millis(10));
    assert_eq!(t.burst_window.get(), Duration::from_millis(100));
    assert_eq!(t.per_allocation_us, 4000);
    assert_eq!(cfg.resource_control().window_size.get(), Duration::from_secs(60));
}

#[test]
fn embedded_default_validates_and_equals_empty_file() {
    let embedded = ValidatedConfig::embedded_default();
    let empty = ValidatedConfig::from_toml_str("").unwrap();
    assert_eq!(embedded, empty, "default.toml drifted from the serde defaults");
    assert_eq!(ValidatedConfig::from_raw(&RawConfig::default()).unwrap(), empty);
    assert!(EMBEDDED_DEFAULT_TOML.contains("tenant-max-cpu-ratio = 0.0"));
}

#[test]
fn empty_file_gives_documented_defaults() {
    let cfg = ValidatedConfig::from_toml_str("").unwrap();
    let rc = cfg.resource_control();
    assert!(rc.enabled && !rc.enable_qps_bytes_limiter);
    assert_eq!(rc.stats_interval.get(), Duration::from_secs(1));
    assert_eq!(rc.window_size.get(), Duration::from_secs(60));
    assert_eq!(rc.max_read_cpu_ratio, 0.6);
    let t = cfg.cpu_throttle();
    assert!(!t.enabled);
    assert_eq!(t.tenant_max_cpu_ratio, 0.0);
    assert_eq!(t.tenant_cap_idle_ttl.get(), Duration::from_secs(600));
    assert!(!t.low_priority_dag_global_enabled);
    assert_eq!(t.refill_interval.get(), Duration::from_millis(10));
    assert_eq!(t.burst_window.get(), Duration::from_millis(100));
    assert_eq!((t.high_watermark, t.low_watermark), (0.8, 0.5));
    assert_eq!(t.estimated_cpu_per_request_us, 1000);
    assert_eq!(cfg.write_quota().pending_write_threshold, ByteSize::mib(100));
    assert_eq!(cfg.write_quota().per_keyspace_pending_write_threshold().get(), 100 * 1024 * 1024 * 3 / 10);
    assert_eq!(cfg.admission_control().mode, AdmissionMode::Disabled);
    assert_eq!(cfg.admission_control().limit(), None);
    let a = cfg.agent();
    assert_eq!(a.control_socket.to_str(), Some("/run/governor/governor.sock"));
    assert_eq!(a.metrics_socket().to_string(), "127.0.0.1:9464");
    assert_eq!(a.measure, MeasureMode::Auto);
    assert_eq!(a.timer_period.get(), Duration::from_millis(10));
    assert_eq!((a.max_threads, a.max_keyspaces), (16384, 4096));
}

#[test]
fn pending_write_threshold_accepts_integer_bytes_and_size_strings() {
    let a = ValidatedConfig::from_toml_str("[write-quota]\npending-write-threshold = 10000\n").unwrap();
    assert_eq!(a.write_quota().pending_write_threshold.get(), 10000);
    assert_eq!(a.write_quota().per_keyspace_pending_write_threshold().get(), 3000);
    let b = ValidatedConfig::from_toml_str("[write-quota]\npending-write-threshold = \"1GiB\"\n").unwrap();
    assert_eq!(b.write_quota().pending_write_threshold.get(), 1 << 30);
}

#[test]
fn toml_output_round_trips_with_kebab_case_keys_and_string_durations() {
    for source in [ESSENTIAL, &common::throttle_full_supported(), ""] {
        let cfg = ValidatedConfig::from_toml_str(source).unwrap();
        let printed = cfg.to_toml_string();
        assert!(printed.contains("[resource-control.cpu-throttle]"), "{printed}");
        assert!(printed.contains("refill-interval = \"10ms\""), "{printed}");
        assert!(printed.contains("pending-write-threshold = \"100MiB\""), "{printed}");
        let again = ValidatedConfig::from_toml_str(&printed).unwrap_or_else(|e| panic!("{e}\n{printed}"));
        assert_eq!(again, cfg);
    }
}

#[test]
fn json_output_uses_the_same_keys() {
    let cfg = ValidatedConfig::from_toml_str(&common::throttle_full_supported()).unwrap();
    let json: serde_json::Value = serde_json::from_str(&cfg.to_json_string()).unwrap();
    let t = &json["resource-control"]["cpu-throttle"];
    assert_eq!(t["keyspace-cpu-quotas"], "1:1000,2:2000");
    assert_eq!(t["burst-window"], "100ms");
    assert_eq!(t["tenant-max-cpu-ratio"], 0.0);
    assert_eq!(json["agent"]["measure"], "auto");
    assert_eq!(json["admission-control"]["mode"], "disabled");
    assert_eq!(json["agent"]["metrics-addr"], "127.0.0.1:9464");
}
