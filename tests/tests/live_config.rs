//! Live configuration against a running agent: `governor config set`,
//! `governor config reload` and SIGHUP change what the agent enforces at
//! once; a bad change (out of range, restart-only, unknown key, a file with
//! several errors) is refused whole with every reason, exit 64, and the
//! running configuration stays; the log and the counters record both; only
//! root or the agent's uid may change it.

use governor_tests::{governor_bin, Agent};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// The Essential profile: a tenant cap with its required settings.
fn capped(ratio: f64) -> String {
    format!(
        "[resource-control.cpu-throttle]\nenabled = true\nenforce-global-limit = true\ntenant-max-cpu-ratio = {ratio}\n\
         enable-burst = false\nenable-fair-allocation = false\nenable-dynamic-adjustment = false\n"
    )
}

fn governor(agent: &Agent, args: &[&str]) -> Output {
    Command::new(governor_bin()).args(args).arg("--socket").arg(&agent.socket).output().expect("governor runs")
}

fn text(o: &Output) -> String {
    format!("exit {:?}\nstdout:\n{}\nstderr:\n{}", o.status.code(), String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn cap_ratio(agent: &Agent) -> f64 {
    agent.status().expect("status").admission.tenant_max_cpu_ratio
}

#[test]
fn set_reload_and_sighup_apply_at_once_and_bad_changes_change_nothing() {
    let agent = Agent::start("auto", &capped(0.25)).expect("agent");
    let path = agent.config_path().expect("a config file").to_path_buf();
    assert_eq!(cap_ratio(&agent), 0.25);

    // One key, applied at once: the policy's cap follows.
    let o = governor(&agent, &["config", "set", "resource-control.cpu-throttle.tenant-max-cpu-ratio=0.5", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(v["accepted"], true);
    assert_eq!(v["changes"][0]["key"], "resource-control.cpu-throttle.tenant-max-cpu-ratio");
    assert_eq!((v["changes"][0]["old"].as_str(), v["changes"][0]["new"].as_str()), (Some("0.25"), Some("0.5")));
    assert_eq!(cap_ratio(&agent), 0.5);

    // Out of range; restart-only; a profile rule broken by one key: each
    // refused with its reason, exit 64, nothing changes.
    for (set, reason) in [
        ("resource-control.cpu-throttle.tenant-max-cpu-ratio=1.5", "must be in [0, 1]"),
        ("resource-control.cpu-throttle.refill-interval=20ms", "cannot change online"),
        ("resource-control.cpu-throttle.enable-burst=true", "must be false while tenant-max-cpu-ratio > 0"),
        ("resource-control.cpu-throttle.no-such-key=1", "no-such-key"),
    ] {
        let o = governor(&agent, &["config", "set", set]);
        assert_eq!(o.status.code(), Some(64), "{set}: {}", text(&o));
        assert!(String::from_utf8_lossy(&o.stderr).contains(reason), "{set}: {}", text(&o));
        assert_eq!(cap_ratio(&agent), 0.5, "{set} changed the running configuration");
    }
    let o = governor(&agent, &["config", "set", "not-an-assignment"]);
    assert_eq!(o.status.code(), Some(64), "{}", text(&o));

    // A file with several errors: every one of them reported, none applied.
    std::fs::write(
        &path,
        capped(0.1).replace("enable-burst = false", "enable-burst = true")
            + "[agent]\nmax-keyspaces = 8192\n[resource-control]\nmax-read-cpu-ratio = 7\n",
    )
    .unwrap();
    let o = governor(&agent, &["config", "reload", "--json"]);
    assert_eq!(o.status.code(), Some(64), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let errors: Vec<String> = v["errors"].as_array().expect("errors").iter().map(|e| e.as_str().unwrap().to_string()).collect();
    for part in ["enable-burst", "max-read-cpu-ratio", "max-keyspaces"] {
        assert!(errors.iter().any(|e| e.contains(part)), "no reason about {part}: {errors:#?}");
    }
    assert_eq!(cap_ratio(&agent), 0.5);

    // The file fixed: SIGHUP applies it.
    std::fs::write(&path, capped(0.1)).unwrap();
    agent.signal(libc::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(5);
    while cap_ratio(&agent) != 0.1 {
        assert!(Instant::now() < deadline, "SIGHUP did not apply the file:\n{}", agent.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    // `config reload` of an unchanged file: accepted, nothing changed.
    let o = governor(&agent, &["config", "reload"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("nothing changed"), "{}", text(&o));

    // Counted and logged: 3 accepted (set, SIGHUP, reload), 5 refused (the
    // malformed assignment never reached the agent).
    let s = agent.status().expect("status");
    assert_eq!((s.config_updates.accepted, s.config_updates.rejected), (3, 5), "{:?}", s.config_updates);
    assert_eq!(s.config_updates.path.as_deref(), Some(path.canonicalize().unwrap().to_str().unwrap()));
    let log = agent.log_text();
    assert!(log.contains("tenant-max-cpu-ratio 0.25 -> 0.5"), "{log}");
    assert!(log.contains("SIGHUP") && log.contains("tenant-max-cpu-ratio 0.5 -> 0.1"), "{log}");
    assert_eq!(log.matches("refused, the running configuration stays").count(), 5, "{log}");
}

#[test]
fn only_root_or_the_agents_uid_may_change_the_configuration() {
    // A socket every local account can reach (clients register through
    // it): the change itself checks the peer.
    let agent = Agent::start("auto", &format!("{}[agent.access]\nsocket-mode = \"0666\"\n", capped(0.25))).expect("agent");
    let o = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(governor_bin())
        .args(["config", "set", "resource-control.cpu-throttle.tenant-max-cpu-ratio=1", "--socket"])
        .arg(&agent.socket)
        .output()
        .expect("setpriv");
    let out = text(&o);
    assert_eq!(o.status.code(), Some(77), "{out}");
    assert!(out.contains("needs the admin role, held by root, the agent's user"), "{out}");
    assert_eq!(cap_ratio(&agent), 0.25);
    assert_eq!(agent.status().unwrap().config_updates.rejected, 0, "a refused peer is not a refused configuration");
}

#[test]
fn the_embedded_default_has_no_file_to_reload_but_can_be_set() {
    let agent = Agent::start_default("auto").expect("agent");
    let o = governor(&agent, &["config", "reload"]);
    assert_eq!(o.status.code(), Some(64), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("embedded default"), "{}", text(&o));
    let o = governor(&agent, &["config", "set", "agent.metrics-max-keyspaces=3"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
}
