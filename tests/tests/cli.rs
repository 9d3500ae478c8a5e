//! The `governor` binary's operator verbs, run as a real process.

use governor_tests::{Agent, Scratch, governor_bin};
use std::process::Command;

fn governor(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(governor_bin()).args(args).output().expect("governor runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write(dir: &Scratch, name: &str, text: &str) -> String {
    let p = dir.0.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_string_lossy().into_owned()
}

#[test]
fn config_validate_exits_64_listing_every_error_with_key_and_line() {
    let dir = Scratch::new("cli");
    let bad = write(
        &dir,
        "bad.toml",
        "[resource-control]\nwindow-size = \"10\"\n[resource-control.cpu-throttle]\ntenant-max-cpu-ratio = 1.5\nno-such-key = 1\n",
    );
    let (code, _out, err) = governor(&["config", "validate", &bad]);
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("resource-control.window-size") && err.contains("line 2"), "{err}");
    let (code, out, _) = governor(&["config", "validate", &bad, "--json"]);
    assert_eq!(code, 64);
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["valid"], false);
    let keys: Vec<&str> = v["errors"].as_array().unwrap().iter().filter_map(|e| e["key"].as_str()).collect();
    assert!(!keys.is_empty());
    assert!(keys.iter().all(|k| k.starts_with("resource-control")), "{keys:?}");
}

#[test]
fn config_validate_prints_the_validated_configuration() {
    let dir = Scratch::new("cli");
    let good = write(&dir, "good.toml", "[resource-control.cpu-throttle]\nrefill-interval = \"20ms\"\n");
    let (code, out, err) = governor(&["config", "validate", &good]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("refill-interval = \"20ms\""), "{out}");
    let (code, out, _) = governor(&["config", "validate", &good, "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["resource-control"]["cpu-throttle"]["refill-interval"], "20ms");
}

#[test]
fn config_validate_of_a_missing_file_fails_naming_it() {
    let (code, _, err) = governor(&["config", "validate", "/tmp/governor-no-such-file.toml"]);
    assert_eq!(code, 66, "EX_NOINPUT: {err}");
    assert!(err.contains("/tmp/governor-no-such-file.toml"), "{err}");
}

#[test]
fn config_show_without_a_file_is_the_embedded_default() {
    let (code, out, _) = governor(&["config", "show", "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["agent"]["measure"], "auto");
}

#[test]
fn agent_with_a_bad_config_exits_64() {
    let dir = Scratch::new("cli");
    let bad = write(&dir, "bad.toml", "[agent]\nmax-threads = 1\n");
    let (code, _, err) = governor(&["agent", "--config", &bad, "--measure", "thread-clock"]);
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("agent.max-threads"), "{err}");
}

#[test]
fn unknown_verbs_and_flags_are_usage_errors() {
    assert_eq!(governor(&["frobnicate"]).0, 64);
    assert_eq!(governor(&["status", "--bogus"]).0, 64);
}

#[test]
fn status_json_reports_backend_and_keyspaces() {
    let agent = Agent::start("thread-clock", "").unwrap();
    let socket = agent.socket.to_string_lossy().into_owned();
    let (code, out, err) = governor(&["status", "--socket", &socket, "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["backend"], "thread-clock");
    assert!(v["keyspaces"].is_array());
    let (code, out, _) = governor(&["status", "--socket", &socket]);
    assert_eq!(code, 0);
    assert!(out.contains("backend      thread-clock"), "{out}");
}

#[test]
fn status_on_a_missing_socket_names_the_path() {
    let (code, out, _) = governor(&["status", "--socket", "/tmp/governor-nothing-here.sock", "--json"]);
    assert_eq!(code, 1);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["error"].as_str().unwrap().contains("/tmp/governor-nothing-here.sock"), "{v}");
}
