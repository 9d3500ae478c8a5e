//! Malformed configuration files: each is rejected with an error naming the
//! exact dotted key and the line it sits on.

use keyspace_governor::config::{ConfigError, ValidatedConfig};

/// (file text, key the error must name, line it must report).
const CASES: &[(&str, &str, usize)] = &[
    // [resource-control]: types, durations, ranges, unknown keys.
    ("[resource-control]\nenabled = \"yes\"\n", "resource-control.enabled", 2),
    ("[resource-control]\nstats-interval = \"10\"\n", "resource-control.stats-interval", 2),
    ("[resource-control]\nstats-interval = \"ms\"\n", "resource-control.stats-interval", 2),
    ("[resource-control]\nstats-interval = \"-1s\"\n", "resource-control.stats-interval", 2),
    ("[resource-control]\nstats-interval = \"1.5.s\"\n", "resource-control.stats-interval", 2),
    ("[resource-control]\nstats-interval = 1000\n", "resource-control.stats-interval", 2),
    ("[resource-control]\nstats-interval = \"0s\"\n", "resource-control.stats-interval", 2),
    ("[resource-control]\nwindow-size = \"99999999999999999999h\"\n", "resource-control.window-size", 2),
    ("[resource-control]\nwindow-size = \"10fortnights\"\n", "resource-control.window-size", 2),
    ("[resource-control]\nstats-interval = \"2s\"\nwindow-size = \"1s\"\n", "resource-control.window-size", 3),
    ("[resource-control]\nmax-read-cpu-ratio = 1.5\n", "resource-control.max-read-cpu-ratio", 2),
    ("[resource-control]\nmax-read-cpu-ratio = 0.0\n", "resource-control.max-read-cpu-ratio", 2),
    ("[resource-control]\nmax-read-cpu-ratio = nan\n", "resource-control.max-read-cpu-ratio", 2),
    ("[resource-control]\nserver-cpu-cores = -1\n", "resource-control.server-cpu-cores", 2),
    ("[resource-control]\nserver-cpu-cores = 0.001\n", "resource-control.server-cpu-cores", 2),
    ("[resource-control]\nmax-read-cpu-ratio = \"0.6\"\n", "resource-control.max-read-cpu-ratio", 2),
    ("[resource-control]\nenabled = true\nbogus-key = 1\n", "resource-control.bogus-key", 3),
    // [resource-control.cpu-throttle]: intervals.
    (
        "[resource-control.cpu-throttle]\nrefill-interval = \"0ms\"\n",
        "resource-control.cpu-throttle.refill-interval",
        2,
    ),
    ("[resource-control.cpu-throttle]\nrefill-interval = \"2s\"\n", "resource-control.cpu-throttle.refill-interval", 2),
    (
        "[resource-control.cpu-throttle]\nrefill-interval = \"200ms\"\n",
        "resource-control.cpu-throttle.refill-interval",
        2,
    ),
    ("[resource-control.cpu-throttle]\nrefill-interval = \"10\"\n", "resource-control.cpu-throttle.refill-interval", 2),
    ("[resource-control.cpu-throttle]\nburst-window = \"20s\"\n", "resource-control.cpu-throttle.burst-window", 2),
    // Keyspace lists.
    (
        "[resource-control.cpu-throttle]\nkeyspace-cpu-quotas = \"1:\"\n",
        "resource-control.cpu-throttle.keyspace-cpu-quotas",
        2,
    ),
    (
        "[resource-control.cpu-throttle]\nkeyspace-cpu-quotas = \"x:100\"\n",
        "resource-control.cpu-throttle.keyspace-cpu-quotas",
        2,
    ),
    (
        "[resource-control.cpu-throttle]\nkeyspace-cpu-quotas = \"1:-5\"\n",
        "resource-control.cpu-throttle.keyspace-cpu-quotas",
        2,
    ),
    (
        "[resource-control.cpu-throttle]\nkeyspace-cpu-quotas = \"1:100,1:200\"\n",
        "resource-control.cpu-throttle.keyspace-cpu-quotas",
        2,
    ),
    (
        "[resource-control.cpu-throttle]\nkeyspace-cpu-quotas = \"1:100,,2:3\"\n",
        "resource-control.cpu-throttle.keyspace-cpu-quotas",
        2,
    ),
    (
        "[resource-control.cpu-throttle]\nkeyspace-cpu-quotas = 5\n",
        "resource-control.cpu-throttle.keyspace-cpu-quotas",
        2,
    ),
    (
        "[resource-control.cpu-throttle]\nkeyspace-estimated-cpu-per-request-us = \"1:abc\"\n",
        "resource-control.cpu-throttle.keyspace-estimated-cpu-per-request-us",
        2,
    ),
    (
        "[resource-control.cpu-throttle]\nkeyspace-burst-enabled = \"1:yes\"\n",
        "resource-control.cpu-throttle.keyspace-burst-enabled",
        2,
    ),
    // Thresholds and ratios.
    ("[resource-control.cpu-throttle]\nhigh-watermark = 1.2\n", "resource-control.cpu-throttle.high-watermark", 2),
    ("[resource-control.cpu-throttle]\nlow-watermark = 0.9\n", "resource-control.cpu-throttle.low-watermark", 2),
    (
        "[resource-control.cpu-throttle]\nfair-allocation-threshold = 0.0\n",
        "resource-control.cpu-throttle.fair-allocation-threshold",
        2,
    ),
    ("[resource-control.cpu-throttle]\nburst-threshold = -0.1\n", "resource-control.cpu-throttle.burst-threshold", 2),
    (
        "[resource-control.cpu-throttle]\npd-service-limit-consecutive-404 = 0\n",
        "resource-control.cpu-throttle.pd-service-limit-consecutive-404",
        2,
    ),
    (
        "[resource-control.cpu-throttle]\npd-service-limit-update-threshold = 2.0\n",
        "resource-control.cpu-throttle.pd-service-limit-update-threshold",
        2,
    ),
    (
        "[resource-control.cpu-throttle]\npd-service-limit-request-timeout = \"1m\"\n",
        "resource-control.cpu-throttle.pd-service-limit-request-timeout",
        2,
    ),
    (
        "[resource-control.cpu-throttle]\npd-service-limit-ttl = \"1s\"\n",
        "resource-control.cpu-throttle.pd-service-limit-ttl",
        2,
    ),
    (
        "[resource-control.cpu-throttle]\nenable-pd-service-limit = 1\n",
        "resource-control.cpu-throttle.enable-pd-service-limit",
        2,
    ),
    (
        "[resource-control.cpu-throttle]\nestimated-cpu-per-request-us = 0\n",
        "resource-control.cpu-throttle.estimated-cpu-per-request-us",
        2,
    ),
    (
        "[resource-control.cpu-throttle]\nestimated-cpu-per-request-us = -1\n",
        "resource-control.cpu-throttle.estimated-cpu-per-request-us",
        2,
    ),
    (
        "[resource-control.cpu-throttle]\nruntime-check-interval-us = 0\n",
        "resource-control.cpu-throttle.runtime-check-interval-us",
        2,
    ),
    (
        "[resource-control.cpu-throttle]\nadditional-allocation-threshold = 0.0\n",
        "resource-control.cpu-throttle.additional-allocation-threshold",
        2,
    ),
    ("[resource-control.cpu-throttle]\nper-allocation-us = 0\n", "resource-control.cpu-throttle.per-allocation-us", 2),
    // Tenant cap ranges (tenant-cpu-cap.md §4.3).
    (
        "[resource-control.cpu-throttle]\ntenant-max-cpu-ratio = 1.5\n",
        "resource-control.cpu-throttle.tenant-max-cpu-ratio",
        2,
    ),
    (
        "[resource-control.cpu-throttle]\ntenant-max-cpu-ratio = -0.1\n",
        "resource-control.cpu-throttle.tenant-max-cpu-ratio",
        2,
    ),
    (
        "[resource-control.cpu-throttle]\ntenant-cap-idle-ttl = \"0s\"\n",
        "resource-control.cpu-throttle.tenant-cap-idle-ttl",
        2,
    ),
    (
        "[resource-control.cpu-throttle]\ntenant-cap-idle-ttl = \"500us\"\n",
        "resource-control.cpu-throttle.tenant-cap-idle-ttl",
        2,
    ),
    (
        "[resource-control.cpu-throttle]\nenabled = true\nenable-bursting = true\n",
        "resource-control.cpu-throttle.enable-bursting",
        3,
    ),
    ("[resource-control]\ncpu-throttle = { enabled = true, wat = 1 }\n", "resource-control.cpu-throttle.wat", 2),
    // Essential conflict that is not set in the file points at the cap's line.
    (
        "[resource-control.cpu-throttle]\n\ntenant-max-cpu-ratio = 0.4\n",
        "resource-control.cpu-throttle.enforce-global-limit",
        3,
    ),
    // [write-quota]
    ("[write-quota]\npending-write-threshold = \"100XB\"\n", "write-quota.pending-write-threshold", 2),
    ("[write-quota]\npending-write-threshold = -1\n", "write-quota.pending-write-threshold", 2),
    ("[write-quota]\npending-write-threshold = 0\n", "write-quota.pending-write-threshold", 2),
    ("[write-quota]\nper-keyspace-threshold = \"30MiB\"\n", "write-quota.per-keyspace-threshold", 2),
    // [admission-control]
    ("[admission-control]\nmode = \"strict\"\n", "admission-control.mode", 2),
    ("[admission-control]\nmax-concurrent-per-tenant = -1\n", "admission-control.max-concurrent-per-tenant", 2),
    // [agent]
    ("[agent]\nmetrics-addr = \"localhost\"\n", "agent.metrics-addr", 2),
    ("[agent]\nmetrics-addr = \"127.0.0.1:99999\"\n", "agent.metrics-addr", 2),
    ("[agent]\nmeasure = \"perf\"\n", "agent.measure", 2),
    ("[agent]\ntimer-period = \"500us\"\n", "agent.timer-period", 2),
    ("[agent]\ntimer-period = \"2s\"\n", "agent.timer-period", 2),
    ("[agent]\ncpu-pressure = \"yes\"\n", "agent.cpu-pressure", 2),
    ("[agent]\nmeasure = \"thread-clock\"\ncpu-pressure = true\n", "agent.cpu-pressure", 3),
    ("[agent]\nmax-threads = 32\n", "agent.max-threads", 2),
    ("[agent]\nmax-threads = 2000000\n", "agent.max-threads", 2),
    ("[agent]\nmax-keyspaces = 0\n", "agent.max-keyspaces", 2),
    ("[agent]\ncontrol-socket = \"relative.sock\"\n", "agent.control-socket", 2),
    ("[agent]\nsocket = \"/tmp/x.sock\"\n", "agent.socket", 2),
    ("# header\n[bogus-section]\nx = 1\n", "bogus-section", 2),
    ("[agent]\nmax-threads = \n", "agent.max-threads", 2),
];

#[test]
fn every_malformed_file_is_rejected_naming_key_and_line() {
    assert!(CASES.len() >= 40, "only {} cases", CASES.len());
    for (source, key, line) in CASES {
        let errors = ValidatedConfig::from_toml_str(source).expect_err(&format!("accepted malformed file:\n{source}"));
        assert!(
            errors.errors.iter().any(|e| e.key() == *key && e.line() == Some(*line)),
            "file:\n{source}\nwanted `{key}` at line {line}, got:\n{errors}\n{errors:?}"
        );
        let text = errors.to_string();
        assert!(text.contains(&format!("line {line}: {key}: ")), "display lacks `line {line}: {key}: `:\n{text}");
    }
}

#[test]
fn unknown_keys_are_reported_as_unknown_key() {
    let errors = ValidatedConfig::from_toml_str("[agent]\nmax-thread = 64\n").unwrap_err();
    assert_eq!(errors.errors, vec![ConfigError::UnknownKey { key: "agent.max-thread".into(), line: Some(2) }]);
    // Nested tables: the unknown one is named, as written.
    for (text, key, line) in [
        ("[multitenancy.admission_control]\nmode = \"enforced\"\n", "multitenancy", 1),
        ("[resource-control.cpu-throttle.bogus]\nx = 1\n", "resource-control.cpu-throttle.bogus", 1),
        ("[agent]\nmax-threads = 64\n[agent.nested]\nx = 1\n", "agent.nested", 3),
        (
            "[resource-control]\nenabled = true\n[resource-control.cpu-throttle]\nbogus-key = 1\n",
            "resource-control.cpu-throttle.bogus-key",
            4,
        ),
    ] {
        let errors = ValidatedConfig::from_toml_str(text).unwrap_err();
        assert_eq!(errors.errors, vec![ConfigError::UnknownKey { key: key.into(), line: Some(line) }], "{text:?}");
    }
}

#[test]
fn all_semantic_errors_in_one_file_are_listed_in_line_order() {
    let source = "\
[resource-control]
max-read-cpu-ratio = 2.0
[resource-control.cpu-throttle]
high-watermark = 0.4
low-watermark = 0.6
keyspace-cpu-quotas = \"1:0\"
[agent]
max-threads = 1
";
    let errors = ValidatedConfig::from_toml_str(source).unwrap_err();
    let lines: Vec<_> = errors.errors.iter().map(|e| (e.key(), e.line())).collect();
    assert_eq!(
        lines,
        vec![
            ("resource-control.max-read-cpu-ratio", Some(2)),
            ("resource-control.cpu-throttle.low-watermark", Some(5)),
            ("resource-control.cpu-throttle.keyspace-cpu-quotas", Some(6)),
            ("agent.max-threads", Some(8)),
        ]
    );
    assert_eq!(errors.to_string().lines().count(), 4);
}

#[test]
fn every_unknown_key_and_wrong_type_in_one_file_is_listed() {
    let source = "\
tenant-max-cpu-ratio = 0.3
[resource-control.cpu-throttle]
profile = \"essentail\"
tennant-max-cpu-ratio = 0.2
tenant-max-cpu-ratio = 0.25
[agent]
max-keyspaces = \"many\"
";
    let errors = ValidatedConfig::from_toml_str(source).unwrap_err();
    let lines: Vec<_> = errors.errors.iter().map(|e| (e.key(), e.line())).collect();
    assert_eq!(
        lines,
        vec![
            ("tenant-max-cpu-ratio", Some(1)),
            ("resource-control.cpu-throttle.profile", Some(3)),
            ("resource-control.cpu-throttle.tennant-max-cpu-ratio", Some(4)),
            ("agent.max-keyspaces", Some(7)),
        ]
    );
    // A value spread over lines cannot be set aside: the listing stops there.
    let errors = ValidatedConfig::from_toml_str("bogus = [\n1,\n]\n[agent]\nmax-keyspaces = \"many\"\n").unwrap_err();
    assert_eq!(errors.errors.len(), 1, "{errors}");
    assert_eq!(errors.errors[0].key(), "bogus");
}

#[test]
fn every_rule_that_lacks_a_key_is_listed_by_its_name_or_position() {
    let source = "\
[[rules]]
name = \"a\"
keyspace = 1
comm_prefix = \"x\"

[[rules]]
keyspace = 2
comm-prefix = \"y\"

[[rules]]
name = \"c\"
comm-prefix = \"z\"
";
    let errors = ValidatedConfig::from_toml_str(source).unwrap_err();
    let mut found: Vec<_> = errors.errors.iter().map(|e| (e.key(), e.line())).collect();
    found.sort_by_key(|(_, line)| *line);
    assert_eq!(
        found,
        vec![("rules.a.comm_prefix", Some(4)), ("rules[1].name", Some(6)), ("rules.c.keyspace", Some(10)),],
        "{errors}"
    );
}

#[test]
fn a_rule_after_one_set_aside_keeps_its_position() {
    // Rule 0 lacks its keyspace and is set aside; rule 1, unnamed, is still
    // rules[1] (not rules[0] of what is left), for its unknown key and for
    // the name it lacks.
    let source = "[[rules]]\nname = \"a\"\n\n[[rules]]\nkeyspace = 2\nbogus = 1\n";
    let errors = ValidatedConfig::from_toml_str(source).unwrap_err();
    let found: Vec<_> = errors.errors.iter().map(|e| (e.key(), e.line())).collect();
    assert_eq!(
        found,
        vec![("rules.a.keyspace", Some(1)), ("rules[1].bogus", Some(6)), ("rules[1].name", Some(4))],
        "{errors}"
    );
}
