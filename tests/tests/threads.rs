//! `governor threads`: a client's registered thread is listed under its
//! process with its kernel tid, names from /proc, the keyspace its tag names
//! and its CPU; once the client exits, it is gone.

use governor_tests::{Agent, governor_bin, spawn_workload_started};
use serde_json::Value;
use std::process::Command;
use std::time::{Duration, Instant};

fn threads(agent: &Agent, json: bool) -> (Option<i32>, String) {
    let mut cmd = Command::new(governor_bin());
    cmd.args(["threads", "--socket"]).arg(&agent.socket);
    if json {
        cmd.arg("--json");
    }
    let o = cmd.output().unwrap();
    (o.status.code(), String::from_utf8_lossy(&o.stdout).into_owned())
}

#[test]
fn a_registered_thread_is_listed_with_its_keyspace_until_it_exits() {
    let agent = Agent::start_default("ebpf").expect("agent");
    let t0 = Instant::now();
    let (mut child, _out) =
        spawn_workload_started(&agent.socket, &["busy", "--keyspace", "4242", "--seconds", "1.5"]).unwrap();
    let pid = child.id();
    let (code, out) = threads(&agent, true);
    assert_eq!(code, Some(0), "{out}");
    let list: Value = serde_json::from_str(&out).expect("json");
    let list = list.as_array().expect("a list");
    assert_eq!(list.len(), 1, "{out}");
    let t = &list[0];
    assert_eq!(t["pid"], pid);
    // The busy thread is the workload's main thread.
    assert_eq!(t["tid"], pid);
    assert_eq!(t["keyspace"], 4242);
    assert_eq!(t["uid"], 0);
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap();
    assert_eq!(t["process"].as_str(), Some(comm.trim()));
    assert_eq!(t["name"].as_str(), Some(comm.trim()));
    let cpu = t["cpu_seconds"].as_f64().expect("cpu");
    assert!((0.0..=t0.elapsed().as_secs_f64()).contains(&cpu), "{cpu} s of CPU in {:?}", t0.elapsed());
    let (_, table) = threads(&agent, false);
    assert!(table.contains(&format!("pid {pid} ")) && table.contains("4242"), "{table}");

    assert!(child.wait().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let (_, out) = threads(&agent, true);
        if serde_json::from_str::<Value>(&out).unwrap().as_array().unwrap().is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "still listed after the client exited: {out}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(threads(&agent, false).1.trim(), "no registered threads");
}
