//! The deployment files: the systemd unit passes `systemd-analyze verify`
//! and the DaemonSet's configuration validates. (The Grafana dashboard is
//! checked by a real Prometheus in `metrics.rs`.)

use governor_tests::{Scratch, governor_bin};
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
    // What the pod runs is what the unit runs: the binary the .deb put on
    // the node, mounted into a stock image (nothing to build).
    assert!(yaml.contains(r#"args: ["agent", "--config", "/etc/governor/governor.toml"]"#));
    assert!(yaml.contains(r#"command: ["/opt/governor/governor"]"#) && yaml.contains("image: debian:bookworm-slim"));
    assert!(yaml.contains("hostPath: {path: /usr/bin/governor, type: File}"));
}
