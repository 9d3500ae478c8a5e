//! `governor doctor` on the real node: every check reports ok, warn or fail
//! with a fix where it is not ok; its facts match the kernel's own files;
//! root with a running agent passes and names the agent's backend; an
//! account without capabilities fails the capabilities check (exit 1).

use governor_tests::{Agent, governor_bin};
use serde_json::Value;
use std::process::Command;

fn check<'a>(r: &'a Value, name: &str) -> &'a Value {
    r["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|c| c["check"] == name)
        .unwrap_or_else(|| panic!("no {name} check in {r:#}"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap().trim().to_string()
}

fn well_formed(r: &Value) {
    let checks = r["checks"].as_array().expect("checks");
    assert!(checks.len() >= 10, "{r:#}");
    for c in checks {
        let status = c["status"].as_str().expect("status");
        assert!(["ok", "warn", "fail"].contains(&status), "{c}");
        assert_eq!(c["fix"].is_string(), status != "ok", "a fix exactly where a check is not ok: {c}");
        assert!(!c["detail"].as_str().unwrap_or("").is_empty(), "{c}");
    }
}

#[test]
fn root_with_a_running_agent_can_run_the_ebpf_backend() {
    let agent = Agent::start_default("ebpf").expect("agent");
    let out = Command::new(governor_bin()).args(["doctor", "--json", "--socket"]).arg(&agent.socket).output().unwrap();
    let r: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(out.status.code(), Some(0), "{r:#}");
    well_formed(&r);
    assert_eq!(r["ebpf_backend"], true);
    for name in ["kernel", "btf", "capabilities", "memlock", "pid-max"] {
        assert_eq!(check(&r, name)["status"], "ok", "{name}: {r:#}");
    }
    // Facts from the kernel's own files.
    assert!(check(&r, "kernel")["detail"].as_str().unwrap().starts_with(&read("/proc/sys/kernel/osrelease")));
    assert!(
        check(&r, "pid-max")["detail"].as_str().unwrap().contains(&format!("= {}:", read("/proc/sys/kernel/pid_max")))
    );
    let stats_on = read("/proc/sys/kernel/bpf_stats_enabled") == "1";
    assert_eq!(check(&r, "bpf-stats")["status"], if stats_on { "ok" } else { "warn" });
    let source = read("/sys/devices/system/clocksource/clocksource0/current_clocksource");
    assert!(check(&r, "clocksource")["detail"].as_str().unwrap().contains(&source));
    // The agent answers, on the backend it logged.
    let a = check(&r, "agent");
    assert_eq!(a["status"], "ok", "{a}");
    assert!(a["detail"].as_str().unwrap().contains("backend ebpf"), "{a}");
}

#[test]
fn an_account_without_capabilities_fails_with_the_fix() {
    let out = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(governor_bin())
        .args(["doctor", "--json", "--socket", "/nonexistent/governor.sock"])
        .output()
        .unwrap();
    let r: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(out.status.code(), Some(1), "{r:#}");
    well_formed(&r);
    assert_eq!(r["ebpf_backend"], false);
    let caps = check(&r, "capabilities");
    assert_eq!(caps["status"], "fail");
    assert!(
        caps["detail"].as_str().unwrap().contains("CAP_BPF") && caps["fix"].as_str().unwrap().contains("CAP_PERFMON"),
        "{caps}"
    );
    assert_eq!(check(&r, "agent")["status"], "warn");
    // The table says the same.
    let text = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(governor_bin())
        .args(["doctor", "--socket", "/nonexistent/governor.sock"])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&text.stdout);
    assert!(table.lines().any(|l| l.starts_with("FAIL") && l.contains("capabilities")), "{table}");
    assert!(table.contains("cannot run here"), "{table}");
}
