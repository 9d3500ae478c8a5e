//! Who may use the control socket: its file mode and group, and the roles
//! the agent checks on every request from the peer's credentials
//! (`SO_PEERCRED` and the peer's groups). Peers are real processes run as
//! other accounts (`setpriv`).

use governor_tests::{Agent, governor_bin, output_text as text, workload_bin};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::process::{Command, Output};

/// `program args` as uid and gid `id`, no groups, no capabilities.
fn run_as(id: u32, program: &std::path::Path, args: &[&str]) -> Output {
    Command::new("setpriv")
        .arg(format!("--reuid={id}"))
        .arg(format!("--regid={id}"))
        .args(["--clear-groups", "--inh-caps=-all", "--bounding-set=-all"])
        .arg(program)
        .args(args)
        .output()
        .expect("setpriv runs")
}

fn governor_as(id: u32, agent: &Agent, args: &[&str]) -> Output {
    let mut all: Vec<&str> = args.to_vec();
    let socket = agent.socket.to_str().unwrap();
    all.extend(["--socket", socket]);
    run_as(id, &governor_bin(), &all)
}

const NOBODY: u32 = 65534;
/// `daemon` on Debian: an account that is neither root, nobody, nor listed.
const OTHER: u32 = 1;

#[test]
fn by_default_only_the_owner_and_group_can_reach_the_socket() {
    let agent = Agent::start_default("ebpf").unwrap();
    let meta = std::fs::metadata(&agent.socket).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
    assert_eq!(meta.gid(), keyspace_governor::sys::effective_gid());
    let o = governor_as(NOBODY, &agent, &["status", "--json"]);
    assert_ne!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("Permission denied"), "{}", text(&o));
}

#[test]
fn each_request_needs_its_role_and_a_refusal_names_who_holds_it() {
    let config = "[agent.access]\nsocket-mode = \"0666\"\nclients = [\"0\"]\nreaders = [\"nobody\"]\n";
    let agent = Agent::start("ebpf", config).unwrap();
    // nobody reads status (reader role) ...
    let o = governor_as(NOBODY, &agent, &["status", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    // ... but cannot register a thread (client role) ...
    let o = run_as(
        NOBODY,
        &workload_bin(),
        &["busy", "--keyspace", "3", "--seconds", "0.1", "--socket", agent.socket.to_str().unwrap()],
    );
    assert!(!o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("not permitted") && err.contains("client role") && err.contains("agent.access.clients"),
        "{}",
        text(&o)
    );
    // ... nor change the configuration (admin role): exit 77.
    let o = governor_as(NOBODY, &agent, &["config", "set", "resource-control.max-read-cpu-ratio=0.5"]);
    assert_eq!(o.status.code(), Some(77), "{}", text(&o));
    assert!(text(&o).contains("admin role"), "{}", text(&o));
    let o = governor_as(NOBODY, &agent, &["rules", "add", "x", "--keyspace", "1", "--uid", "0"]);
    assert_eq!(o.status.code(), Some(77), "{}", text(&o));
    // An account in no list cannot even read.
    let o = governor_as(OTHER, &agent, &["status", "--json"]);
    assert_eq!(o.status.code(), Some(77), "{}", text(&o));
    assert!(text(&o).contains("reader role"), "{}", text(&o));
    let s = agent.status().unwrap();
    assert_eq!(s.threads.registered, 0);
    assert_eq!(s.config_updates.rejected, 0, "a refused peer is not a refused configuration");

    // Root changes the lists and the mode live; they act at once.
    let root = |args: &[&str]| {
        let o = Command::new(governor_bin()).args(args).arg("--socket").arg(&agent.socket).output().unwrap();
        assert!(o.status.success(), "{}", text(&o));
    };
    root(&["config", "set", "agent.access.readers=[\"nobody\", \"1\"]"]);
    assert_eq!(governor_as(OTHER, &agent, &["status", "--json"]).status.code(), Some(0));
    root(&["config", "set", "agent.access.clients=[]"]);
    let o = run_as(
        NOBODY,
        &workload_bin(),
        &["busy", "--keyspace", "3", "--seconds", "0.1", "--socket", agent.socket.to_str().unwrap()],
    );
    assert!(o.status.success(), "an empty clients list lets every peer register: {}", text(&o));
    root(&["config", "set", "agent.access.socket-mode=0600"]);
    assert_eq!(std::fs::metadata(&agent.socket).unwrap().permissions().mode() & 0o777, 0o600);
    let o = governor_as(NOBODY, &agent, &["status", "--json"]);
    assert_ne!(o.status.code(), Some(0), "{}", text(&o));
}

#[test]
fn unknown_accounts_and_bad_modes_are_refused_naming_the_key() {
    let dir = governor_tests::Scratch::new("access-bad");
    let file = dir.0.join("bad.toml");
    std::fs::write(
        &file,
        "[agent.access]\nsocket-mode = \"rw-rw----\"\nsocket-group = \"no-such-group-here\"\nclients = [\"no-such-user-here\"]\nadmins = [\"@no-such-group-either\"]\n",
    )
    .unwrap();
    let o = Command::new(governor_bin()).args(["config", "validate", "--json"]).arg(&file).output().unwrap();
    assert_eq!(o.status.code(), Some(64), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let keys: Vec<&str> = v["errors"].as_array().unwrap().iter().filter_map(|e| e["key"].as_str()).collect();
    for want in ["agent.access.socket-mode", "agent.access.socket-group", "agent.access.clients", "agent.access.admins"]
    {
        assert!(keys.contains(&want), "no error for {want}: {keys:?}");
    }
}
