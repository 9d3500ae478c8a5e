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
    // The refusal's shape: valid, path, and here the configuration.
    assert_eq!(v["valid"], true, "{out}");
    assert_eq!(v["path"], good.as_str(), "{out}");
    assert_eq!(v["warnings"], serde_json::json!([]), "{out}");
    assert_eq!(v["config"]["resource-control"]["cpu-throttle"]["refill-interval"], "20ms");
}

/// A rule that can match nothing here (its `exe` absent, its `uid` no
/// user's) is valid, since either may appear later; validate warns.
#[test]
fn config_validate_warns_of_rules_that_match_nothing_here() {
    let dir = Scratch::new("cli");
    let file = write(
        &dir,
        "rules.toml",
        "[[rules]]\nname = \"gone\"\nkeyspace = 1\nexe = \"/usr/bin/governor-no-such-binary\"\n\n\
         [[rules]]\nname = \"nobody-here\"\nkeyspace = 2\nuid = 3999999\n\n\
         [[rules]]\nname = \"root\"\nkeyspace = 3\nuid = 0\nexe = \"/bin/sh\"\n\n\
         [[rules]]\nname = \"service\"\nkeyspace = 4\ncgroup = \"/system.slice/governor-no-such.service\"\n",
    );
    let (code, out, _) = governor(&["config", "validate", &file, "--json"]);
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let warnings: Vec<&str> = v["warnings"].as_array().unwrap().iter().map(|w| w.as_str().unwrap()).collect();
    assert_eq!(warnings.len(), 3, "{warnings:?}");
    assert!(warnings[0].starts_with("rules.gone.exe: /usr/bin/governor-no-such-binary does not exist here"));
    assert!(warnings[1].starts_with("rules.nobody-here.uid: no user has uid 3999999"));
    // A service's cgroup exists while it runs: the rule waits for it.
    assert!(warnings[2].starts_with(
        "rules.service.cgroup: /system.slice/governor-no-such.service does not exist here; the rule matches nothing until it does"
    ));
}

/// A quota larger than the server is valid (one file may serve nodes of
/// several sizes) but limits nothing there: validate says so on stderr and
/// exits 0, and so does the agent's log, at start and when one is set.
#[test]
fn a_quota_above_the_servers_cores_is_valid_and_said_to_limit_nothing() {
    let dir = Scratch::new("cli");
    let text = "[resource-control]\nserver-cpu-cores = 2\n[resource-control.cpu-throttle]\nenabled = true\n\
                keyspace-cpu-quotas = \"900:5000,901:1500\"\n";
    let file = write(&dir, "big.toml", text);
    let (code, out, err) = governor(&["config", "validate", &file]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("keyspace-cpu-quotas = \"900:5000,901:1500\""), "{out}");
    let warnings: Vec<&str> = err.lines().filter(|l| l.starts_with("warning: ")).collect();
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(
        warnings[0]
            .contains("keyspace 900's quota of 5.000 cores is more than resource-control.server-cpu-cores, 2.00: it limits nothing here"),
        "{err}"
    );
    let (code, out, err) = governor(&["config", "validate", &file, "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("stdout stays JSON");
    assert!(err.contains("keyspace 900's quota"), "{err}");
    assert_eq!(v["valid"], true, "{out}");
    let listed = v["warnings"].as_array().expect("warnings");
    assert!(listed.len() == 1 && listed[0].as_str().unwrap().contains("keyspace 900's quota"), "{out}");
    let agent = Agent::start("ebpf", text).expect("agent");
    let said = |what: &str| agent.log_text().lines().filter(|l| l.contains(what)).count();
    assert_eq!(said("keyspace 900's quota of 5.000 cores"), 1, "{}", agent.log_text());
    // The agent compares with the cores it found for its servers.
    assert_eq!(said("more than this server's 2.00"), 1, "{}", agent.log_text());
    let socket = agent.socket.to_string_lossy().into_owned();
    let set = "resource-control.cpu-throttle.keyspace-cpu-quotas=900:5000,902:2500";
    let (code, _, err) = governor(&["config", "set", set, "--socket", &socket]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(said("keyspace 902's quota of 2.500 cores"), 1, "{}", agent.log_text());
    assert_eq!(said("keyspace 900's quota of 5.000 cores"), 2, "{}", agent.log_text());
}

#[test]
fn config_validate_of_a_missing_file_fails_naming_it() {
    let (code, _, err) = governor(&["config", "validate", "/tmp/governor-no-such-file.toml"]);
    assert_eq!(code, 66, "EX_NOINPUT: {err}");
    assert!(err.contains("/tmp/governor-no-such-file.toml"), "{err}");
    // With --json, the object every validation prints, and the reason.
    let (code, out, _) = governor(&["config", "validate", "/tmp/governor-no-such-file.toml", "--json"]);
    assert_eq!(code, 66);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (&v["valid"], &v["path"]),
        (&serde_json::json!(false), &serde_json::json!("/tmp/governor-no-such-file.toml"))
    );
    assert!(v["error"].as_str().unwrap().contains("No such file"), "{v}");
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
    // An empty file (cut short, or still being written) is refused, at
    // start as by validate; a comment alone is the embedded default.
    let empty = write(&dir, "empty.toml", "\n");
    let (code, _, err) = governor(&["agent", "--config", &empty, "--measure", "thread-clock"]);
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("the file is empty"), "{err}");
    let (code, out, _) = governor(&["config", "validate", "--json", &empty]);
    assert_eq!(code, 64, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["valid"], false, "{v}");
    let comment = write(&dir, "comment.toml", "# the embedded default\n");
    assert_eq!(governor(&["config", "validate", &comment]).0, 0);
}

#[test]
fn unknown_verbs_and_flags_are_usage_errors() {
    assert_eq!(governor(&["frobnicate"]).0, 64);
    assert_eq!(governor(&["status", "--bogus"]).0, 64);
    // With --json, a JSON object on stdout too, saying what was wrong.
    for (args, said) in [
        (&["keyspace", "abc", "--json"][..], "invalid value 'abc'"),
        (&["rules", "add", "x", "--json"][..], "required arguments were not provided: --keyspace"),
    ] {
        let (code, out, err) = governor(args);
        assert_eq!(code, 64, "{args:?}: {err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|_| panic!("{args:?}: {out:?}"));
        assert!(v["error"].as_str().is_some_and(|e| e.contains(said)), "{args:?}: {v}");
    }
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

/// A tenant cap not below the node's read budget is valid, but one tenant
/// at its cap can then empty the global bucket: validate warns.
#[test]
fn config_validate_warns_of_a_tenant_cap_that_can_take_the_whole_budget() {
    let dir = Scratch::new("cli");
    let body = |ratio: f64| {
        format!("[resource-control.cpu-throttle]\nprofile = \"essential\"\ntenant-max-cpu-ratio = {ratio}\n")
    };
    for (ratio, warned) in [(0.4, false), (0.6, true), (0.9, true)] {
        let file = write(&dir, "cap.toml", &body(ratio));
        let (code, out, _) = governor(&["config", "validate", &file, "--json"]);
        assert_eq!(code, 0, "{out}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let said = v["warnings"].to_string();
        assert_eq!(said.contains("is not below resource-control.max-read-cpu-ratio (0.6)"), warned, "{ratio}: {said}");
    }
}

/// Without --socket, a verb talks to GOVERNOR_SOCKET when it is set.
#[test]
fn verbs_find_the_agent_at_governor_socket() {
    let agent = Agent::start("auto", "").unwrap();
    let o =
        Command::new(governor_bin()).args(["status", "--json"]).env("GOVERNOR_SOCKET", &agent.socket).output().unwrap();
    assert!(o.status.success(), "{}", governor_tests::output_text(&o));
    let s: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(s["uptime_seconds"].is_number(), "{s}");
}

/// The agent's control socket path: a file there that is not a socket is
/// never removed; a second agent on a path is refused even after the first
/// one's socket file was deleted under it (they would share the keyspace
/// cgroups and the crash record); a start that fails on the metrics port
/// leaves no socket file.
#[test]
fn an_agent_keeps_to_its_own_socket_path() {
    let dir = Scratch::new("cli-socket");
    let not_a_socket = write(&dir, "g.sock", "precious data\n");
    let (code, _, err) = governor(&["agent", "--measure", "thread-clock", "--socket", &not_a_socket]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("is there and is not a socket"), "{err}");
    assert_eq!(std::fs::read_to_string(&not_a_socket).unwrap(), "precious data\n");
    // With --json (its log as JSON lines), the reason is a JSON line too.
    let (code, _, err) = governor(&["agent", "--json", "--measure", "thread-clock", "--socket", &not_a_socket]);
    assert_eq!(code, 1, "{err}");
    let last: serde_json::Value = serde_json::from_str(err.lines().last().unwrap_or("")).unwrap_or_default();
    assert_eq!(last["level"], "ERROR", "{err}");
    assert_eq!(last["exit_code"], 1, "{err}");
    assert!(last["message"].as_str().is_some_and(|m| m.contains("is there and is not a socket")), "{err}");
    // Another program's live socket at the path: left alone, and said so
    // (not read as an agent's).
    let foreign = dir.0.join("foreign.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&foreign).unwrap();
    let (code, _, err) = governor(&["agent", "--measure", "thread-clock", "--socket", foreign.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("is a socket something listens on, and no agent here holds it"), "{err}");
    assert!(foreign.exists(), "the other program's socket was removed");
    // A verb pointed at it is told the path is wrong, not that no agent runs.
    let (code, _, err) = governor(&["status", "--socket", &not_a_socket]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("it is a file, not a socket"), "{err}");

    let mut first = Agent::start("thread-clock", "").unwrap();
    let socket = first.socket.to_string_lossy().into_owned();
    std::fs::remove_file(&first.socket).unwrap();
    let (code, _, err) =
        governor(&["agent", "--measure", "thread-clock", "--metrics-addr", "127.0.0.1:0", "--socket", &socket]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("another agent is already serving"), "{err}");
    // Someone's file put at the path since: the agent's stop leaves it.
    std::fs::write(&first.socket, "theirs\n").unwrap();
    first.stop().unwrap();
    assert_eq!(std::fs::read_to_string(&first.socket).unwrap(), "theirs\n", "removed at the agent's stop");

    // The port taken: refused, and the socket it had bound is gone again,
    // with the directory it made for it.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().to_string();
    let fresh = dir.0.join("made").join("fresh.sock");
    let (code, _, err) =
        governor(&["agent", "--measure", "thread-clock", "--metrics-addr", &port, "--socket", fresh.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("cannot serve /metrics"), "{err}");
    assert!(!fresh.exists(), "a failed start left {}", fresh.display());
    assert!(!dir.0.join("made").exists(), "a failed start left the directory it made");
}

/// An agent that is there but does not answer (stopped): the verbs say so
/// after the call's timeout, and doctor does not tell the operator to start it.
#[test]
fn a_stopped_agent_is_said_to_not_answer() {
    let agent = Agent::start("thread-clock", "").unwrap();
    let socket = agent.socket.to_string_lossy().into_owned();
    agent.signal(libc::SIGSTOP);
    let (code, out, _) = governor(&["status", "--socket", &socket, "--json"]);
    let (dcode, dout, _) = governor(&["doctor", "--socket", &socket, "--json"]);
    agent.signal(libc::SIGCONT);
    assert_eq!(code, 1, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let said = v["error"].as_str().unwrap_or_default();
    assert!(said.contains("the agent did not answer within 5 s (stopped or stalled?)"), "{v}");
    assert!(dcode != 0 || dout.contains("does not answer"), "{dout}");
    assert!(dout.contains("it runs but does not answer"), "{dout}");
    assert!(!dout.contains("start it"), "{dout}");
}
