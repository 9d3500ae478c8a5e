//! The deployment files: the systemd unit passes `systemd-analyze verify`,
//! and every metric the Grafana dashboard queries is in a real scrape of an
//! agent doing the work those metrics describe.

use governor_tests::{Agent, Scratch, essential_config, governor_bin, run_workload};
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace")
}

#[test]
fn the_systemd_unit_verifies_against_an_installed_binary() {
    // A root with the binary where the unit says, as the .deb installs it.
    let root = Scratch::new("deploy-root");
    let bin = root.0.join("usr/bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::copy(governor_bin(), bin.join("governor")).unwrap();
    std::fs::create_dir_all(root.0.join("bin")).unwrap();
    std::fs::copy("/bin/kill", root.0.join("bin/kill")).unwrap();
    // The host's own units (sysinit.target and the rest the defaults pull in).
    let system = root.0.join("usr/lib/systemd");
    std::fs::create_dir_all(&system).unwrap();
    let cp = Command::new("cp").arg("-a").arg("/usr/lib/systemd/system").arg(&system).status().unwrap();
    assert!(cp.success());
    let units = root.0.join("etc/systemd/system");
    std::fs::create_dir_all(&units).unwrap();
    let unit = units.join("governor.service");
    std::fs::copy(repo().join("deploy/systemd/governor.service"), &unit).unwrap();
    let o = Command::new("systemd-analyze")
        .arg("verify")
        .arg(format!("--root={}", root.0.display()))
        .arg("/etc/systemd/system/governor.service")
        .output()
        .expect("systemd-analyze runs");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains("governor.service:"), "warnings about the unit: {err}");
    // The binary it starts takes the flags it is given.
    let text = std::fs::read_to_string(&unit).unwrap();
    let exec = text.lines().find_map(|l| l.strip_prefix("ExecStart=")).unwrap();
    assert_eq!(exec, "/usr/bin/governor agent --config /etc/governor/governor.toml");
    let help = Command::new(governor_bin()).args(["agent", "--help"]).output().unwrap();
    assert!(String::from_utf8_lossy(&help.stdout).contains("--config"));
}

#[test]
fn every_metric_the_dashboard_queries_is_in_a_scrape() {
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(repo().join("deploy/grafana/governor-dashboard.json")).unwrap())
            .unwrap();
    let mut wanted = BTreeSet::new();
    for panel in dash["panels"].as_array().expect("panels") {
        for t in panel["targets"].as_array().expect("targets") {
            let expr = t["expr"].as_str().expect("expr");
            // Metric names: identifiers that are not PromQL functions or labels.
            let mut word = String::new();
            for ch in expr.chars().chain([' ']) {
                if ch.is_ascii_alphanumeric() || ch == '_' {
                    word.push(ch);
                } else {
                    if word.starts_with("governor_") || word.starts_with("tikv_") || word.starts_with("cpu_throttle_") {
                        wanted.insert(word.clone());
                    }
                    word.clear();
                }
            }
        }
    }
    assert!(wanted.len() >= 15, "{wanted:?}");
    // An agent with buckets, tickets, refusals, a rule and eBPF statistics.
    let config =
        format!("{}\n[[rules]]\nname = \"sleepers\"\nkeyspace = 77\ncomm-prefix = \"sleep\"\n", essential_config(0.05));
    let agent = Agent::start("ebpf", &config).unwrap();
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).unwrap();
    let mut sleeper = Command::new("sleep").arg("5").spawn().unwrap();
    run_workload(
        &agent.socket,
        &["tickets", "--keyspace", "5", "--threads", "2", "--seconds", "1", "--work-us", "2000"],
    )
    .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let addr = agent.status().unwrap().metrics_addr.unwrap();
    let text = governor_tests::scrape_metrics(&addr);
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    let present: BTreeSet<&str> =
        text.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split(['{', ' ']).next()).collect();
    let missing: Vec<&String> = wanted.iter().filter(|m| !present.contains(m.as_str())).collect();
    assert!(missing.is_empty(), "the dashboard queries metrics no scrape has: {missing:?}");
}

#[test]
fn the_daemonsets_configuration_validates() {
    let yaml = std::fs::read_to_string(repo().join("deploy/kubernetes/governor-daemonset.yaml")).unwrap();
    // The ConfigMap's `governor.toml: |` block: its lines indented by four.
    let toml: String = yaml
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("governor.toml: |"))
        .skip(1)
        .take_while(|l| l.starts_with("    ") || l.trim().is_empty())
        .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or("")))
        .collect();
    assert!(toml.contains("[agent.access]"), "{toml}");
    let scratch = Scratch::new("deploy-k8s");
    let file = scratch.0.join("governor.toml");
    std::fs::write(&file, &toml).unwrap();
    let o = Command::new(governor_bin()).args(["config", "validate"]).arg(&file).output().unwrap();
    assert!(o.status.success(), "{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    // What the pod runs is what the unit runs.
    assert!(yaml.contains(r#"args: ["agent", "--config", "/etc/governor/governor.toml"]"#));
}
