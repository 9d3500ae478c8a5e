//! Validation: ranges for every key, the keyspace-list formats, and the
//! cross-field rules (watermarks, intervals, the Essential tenant-cap
//! profile). Startup and online updates run exactly this code, so a setting
//! refused at start is refused on reload too.
//!
//! Every rule is checked even after one fails, and every failure names its
//! dotted key and, when there is a source file, its line.

use std::net::SocketAddr;

use super::checker::{Checker, MS, SEC};
use super::error::ConfigErrors;
use super::raw::RawConfig;
use super::source::SourceMap;
use super::validated::{EMBEDDED_DEFAULT_TOML, ValidatedConfig, parse_file};

/// Validates `raw`; `map` supplies line numbers (empty when there is no file).
pub(crate) fn validate(raw: &RawConfig, map: &SourceMap) -> Result<ValidatedConfig, ConfigErrors> {
    let mut c = Checker { map, errors: ConfigErrors::default() };
    let rc = &raw.resource_control;
    let t = &rc.cpu_throttle;

    rc.check(&mut c);
    t.check(&mut c, raw.agent.max_keyspaces);
    raw.write_quota.check(&mut c);
    raw.latency_guard.check(&mut c);

    // [agent]
    let a = &raw.agent;
    c.check(
        a.control_socket.is_absolute(),
        "agent",
        "control-socket",
        format!("must be an absolute path, got {:?}", a.control_socket),
    );
    let mut agent = a.clone();
    if let Err(e) = a.metrics_addr.parse::<SocketAddr>() {
        c.invalid("agent.metrics-addr".into(), format!("{:?} is not a socket address ({e})", a.metrics_addr));
        agent.metrics_addr = SocketAddr::from(([127, 0, 0, 1], 0)).to_string();
    }
    c.int("agent", "metrics-max-keyspaces", a.metrics_max_keyspaces.into(), 1, 100_000);
    c.duration("agent", "timer-period", a.timer_period, MS, SEC);
    c.check(
        !(a.cpu_pressure && a.measure == super::raw::MeasureMode::ThreadClock),
        "agent",
        "cpu-pressure",
        "needs the eBPF backend: the thread-clock backend cannot see when threads wait (set measure to \"auto\" or \"ebpf\", or cpu-pressure to false)",
    );
    c.int("agent", "max-threads", a.max_threads.into(), 64, 1 << 20);
    c.int("agent", "max-keyspaces", a.max_keyspaces.into(), 16, 1 << 20);
    // Per-uid quotas: checked when set; when absent, half the total.
    if let Some(n) = a.max_threads_per_uid {
        c.int("agent", "max-threads-per-uid", n.into(), 1, a.max_threads.into());
    }
    if let Some(n) = a.max_keyspaces_per_uid {
        c.int("agent", "max-keyspaces-per-uid", n.into(), 1, a.max_keyspaces.into());
    }
    agent.max_threads_per_uid = Some(a.threads_per_uid());
    agent.max_keyspaces_per_uid = Some(a.keyspaces_per_uid());
    let rules = super::rules::check(&mut c, &raw.rules);
    let access = super::access::check(&mut c, &a.access);
    // In tenant-cap mode PD is refused on its own (below the Essential rules).
    let pd = super::pd::check(&mut c, &raw.pd, t.enable_pd_service_limit && t.tenant_max_cpu_ratio <= 0.0);

    let validated = ValidatedConfig {
        resource_control: raw.resource_control.clone(),
        write_quota: raw.write_quota.clone(),
        admission_control: raw.admission_control.clone(),
        latency_guard: raw.latency_guard.clone(),
        agent,
        access,
        pd,
        rules,
    };
    c.errors.into_result(validated)
}

/// The ways to a [`ValidatedConfig`]: each runs [`validate`] (here, so the
/// validated types never call back into their checks).
impl ValidatedConfig {
    /// Parses and validates a whole file. All problems are reported together,
    /// each with its dotted key and line.
    pub fn from_toml_str(source: &str) -> Result<Self, ConfigErrors> {
        let (raw, map) = parse_file(source)?;
        validate(&raw, &map)
    }

    /// Validates an already parsed configuration (no line numbers).
    pub fn from_raw(raw: &RawConfig) -> Result<Self, ConfigErrors> {
        validate(raw, &SourceMap::none())
    }

    pub(crate) fn from_raw_with_map(raw: &RawConfig, map: &SourceMap) -> Result<Self, ConfigErrors> {
        validate(raw, map)
    }

    /// The embedded default file (`src/config/default.toml`), validated.
    pub fn embedded_default() -> Self {
        match Self::from_toml_str(EMBEDDED_DEFAULT_TOML) {
            Ok(config) => config,
            // A unit test proves the embedded file validates.
            Err(e) => panic!("embedded default configuration is invalid:\n{e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::checker::CAP_KEY;
    use super::super::error::ConfigError;
    use super::super::keyspace_list::KeyspaceList;
    use super::*;

    fn capped() -> RawConfig {
        let mut raw = RawConfig::default();
        raw.resource_control.cpu_throttle.tenant_max_cpu_ratio = 0.4;
        raw
    }

    #[test]
    fn cap_with_premium_defaults_lists_every_conflict_without_lines() {
        let errors = validate(&capped(), &SourceMap::none()).unwrap_err();
        assert_eq!(
            errors.keys(),
            vec![
                "resource-control.cpu-throttle.enforce-global-limit",
                "resource-control.cpu-throttle.enable-burst",
                "resource-control.cpu-throttle.enable-fair-allocation",
                "resource-control.cpu-throttle.enable-dynamic-adjustment",
            ]
        );
        assert!(errors.errors.iter().all(|e| e.line().is_none()));
        assert!(errors.errors.iter().all(|e| matches!(e, ConfigError::Conflict { .. })));
    }

    #[test]
    fn cap_with_the_essential_profile_validates() {
        let mut raw = capped();
        let t = &mut raw.resource_control.cpu_throttle;
        t.enforce_global_limit = true;
        t.enable_burst = false;
        t.enable_fair_allocation = false;
        t.enable_dynamic_adjustment = false;
        let cfg = validate(&raw, &SourceMap::none()).unwrap();
        assert!(cfg.cpu_throttle().tenant_cap_enabled());
    }

    #[test]
    fn nan_ratio_is_out_of_range_and_does_not_enable_the_cap() {
        let mut raw = RawConfig::default();
        raw.resource_control.cpu_throttle.tenant_max_cpu_ratio = f64::NAN;
        let errors = validate(&raw, &SourceMap::none()).unwrap_err();
        assert_eq!(errors.keys(), vec![CAP_KEY]);
    }

    #[test]
    fn more_quotas_than_keyspace_cells_are_rejected() {
        let mut raw = RawConfig::default();
        raw.agent.max_keyspaces = 16;
        raw.resource_control.cpu_throttle.keyspace_cpu_quotas =
            KeyspaceList::read(&(1..=17).map(|i| format!("{i}:100")).collect::<Vec<_>>().join(","));
        let errors = validate(&raw, &SourceMap::none()).unwrap_err();
        assert_eq!(errors.keys(), vec!["resource-control.cpu-throttle.keyspace-cpu-quotas"]);
    }

    #[test]
    fn conflicting_default_points_at_the_cap_line_and_says_so() {
        let source = "[resource-control.cpu-throttle]\ntenant-max-cpu-ratio = 0.4\nenforce-global-limit = true\nenable-burst = false\nenable-fair-allocation = false\n";
        let raw: RawConfig = toml::from_str(source).unwrap();
        let errors = validate(&raw, &SourceMap::new(source)).unwrap_err();
        assert_eq!(
            errors.to_string(),
            "line 2: resource-control.cpu-throttle.enable-dynamic-adjustment: must be false while \
             tenant-max-cpu-ratio > 0 (essential tenant-cap mode; profile = \"essential\" sets every such key) \
             (not set in the file; its default conflicts)"
        );
    }

    #[test]
    fn the_essential_profile_fills_what_the_file_leaves_out() {
        let cfg = ValidatedConfig::from_toml_str("[resource-control.cpu-throttle]\nprofile = \"essential\"\n").unwrap();
        let t = cfg.cpu_throttle();
        assert!(t.enabled && t.enforce_global_limit);
        assert!(!t.enable_burst && !t.enable_fair_allocation && !t.enable_dynamic_adjustment);
        assert!(!t.enable_pd_service_limit && !t.low_priority_dag_global_enabled);
        assert_eq!(t.tenant_max_cpu_ratio, 0.4);
        // Printed back, it reads the same.
        assert_eq!(ValidatedConfig::from_toml_str(&cfg.to_toml_string()).unwrap(), cfg);
        // A key the file writes wins, and is checked.
        let cfg = ValidatedConfig::from_toml_str(
            "[resource-control.cpu-throttle]\nprofile = \"essential\"\ntenant-max-cpu-ratio = 0.25\n",
        )
        .unwrap();
        assert_eq!(cfg.cpu_throttle().tenant_max_cpu_ratio, 0.25);
        let source =
            "[resource-control.cpu-throttle]\nprofile = \"essential\"\nenable-burst = true\ntenant-max-cpu-ratio = 0\n";
        let errors = ValidatedConfig::from_toml_str(source).unwrap_err();
        assert_eq!(errors.keys(), vec!["resource-control.cpu-throttle.tenant-max-cpu-ratio"], "{errors}");
        assert!(errors.to_string().starts_with("line 4: "), "{errors}");
        let source = "[resource-control.cpu-throttle]\nprofile = \"essential\"\nenable-burst = true\n";
        let errors = ValidatedConfig::from_toml_str(source).unwrap_err();
        assert_eq!(errors.keys(), vec!["resource-control.cpu-throttle.enable-burst"], "{errors}");
        // Premium has no uniform cap.
        let source = "[resource-control.cpu-throttle]\nprofile = \"premium\"\ntenant-max-cpu-ratio = 0.3\n";
        let errors = ValidatedConfig::from_toml_str(source).unwrap_err();
        assert!(errors.to_string().contains("must be 0 with profile = \"premium\""), "{errors}");
    }

    #[test]
    fn setting_a_profile_online_sets_its_keys_and_keeps_a_running_cap() {
        let default = ValidatedConfig::embedded_default();
        let essential = default.apply_set("resource-control.cpu-throttle.profile", "essential").unwrap();
        assert_eq!(essential.cpu_throttle().tenant_max_cpu_ratio, 0.4);
        assert!(essential.cpu_throttle().enabled && !essential.cpu_throttle().enable_burst);
        let capped = essential.apply_set("resource-control.cpu-throttle.tenant-max-cpu-ratio", "0.25").unwrap();
        let again = capped.apply_set("resource-control.cpu-throttle.profile", "essential").unwrap();
        assert_eq!(again.cpu_throttle().tenant_max_cpu_ratio, 0.25, "a running cap stays");
        let premium = capped.apply_set("resource-control.cpu-throttle.profile", "premium").unwrap();
        let t = premium.cpu_throttle();
        assert_eq!(t.tenant_max_cpu_ratio, 0.0);
        assert!(t.enable_burst && t.enable_fair_allocation && t.enable_dynamic_adjustment && !t.enforce_global_limit);
        assert!(t.enabled, "premium leaves the throttle as it was");
    }

    #[test]
    fn per_uid_quotas_default_to_half_and_are_bounded_by_the_totals() {
        let source = "[agent]\nmax-threads = 1000\nmax-keyspaces = 64\n";
        let cfg = validate(&toml::from_str(source).unwrap(), &SourceMap::new(source)).unwrap();
        assert_eq!((cfg.agent.threads_per_uid(), cfg.agent.keyspaces_per_uid()), (500, 32));
        let source = "[agent]\nmax-threads = 1000\nmax-threads-per-uid = 1001\nmax-keyspaces-per-uid = 0\n";
        let errors = validate(&toml::from_str(source).unwrap(), &SourceMap::new(source)).unwrap_err();
        assert_eq!(
            errors.to_string(),
            "line 3: agent.max-threads-per-uid: must be between 1 and 1000, got 1001\n\
             line 4: agent.max-keyspaces-per-uid: must be between 1 and 4096, got 0"
        );
    }
}
