//! `governor keyspace ID` against a running agent: the quota's source and
//! the cap it comes from, the bucket's state, and an unknown keyspace
//! (exit 1); with the throttle off, it says nothing is throttled.

use governor_tests::{Agent, governor_bin, spawn_workload_started};
use serde_json::Value;
use std::process::Command;

fn explain(agent: &Agent, id: &str) -> (Option<i32>, Value) {
    let o =
        Command::new(governor_bin()).args(["keyspace", id, "--json", "--socket"]).arg(&agent.socket).output().unwrap();
    (
        o.status.code(),
        serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|_| panic!("not json: {}", String::from_utf8_lossy(&o.stdout))),
    )
}

fn why(v: &Value) -> String {
    v["why"].as_array().expect("why").iter().map(|w| w.as_str().unwrap()).collect::<Vec<_>>().join("\n")
}

#[test]
fn a_capped_keyspace_names_its_cap_and_its_bucket() {
    let agent = Agent::start(
        "ebpf",
        "[resource-control.cpu-throttle]\nenabled = true\nenforce-global-limit = true\ntenant-max-cpu-ratio = 0.25\n\
         enable-burst = false\nenable-fair-allocation = false\nenable-dynamic-adjustment = false\n",
    )
    .unwrap();
    let (mut child, _out) =
        spawn_workload_started(&agent.socket, &["busy", "--keyspace", "31", "--seconds", "0.5"]).unwrap();
    // A refill or two after the bucket was made (10 ms apart).
    std::thread::sleep(std::time::Duration::from_millis(100));
    let (code, v) = explain(&agent, "31");
    assert_eq!(code, Some(0), "{v:#}");
    assert_eq!(v["quota_source"], "tenant_cap", "{v:#}");
    assert_eq!(v["keyspace"]["keyspace_id"], 31);
    let text = why(&v);
    let cores = agent.status().unwrap().server_cpu.cores;
    let cap = format!("tenant-max-cpu-ratio 0.25 = {:.2} cores of the servers' {cores:.2}", 0.25 * cores);
    assert!(text.contains(&cap), "no {cap:?} in {text}");
    // Nothing asked for tokens: not throttled, the bucket as full as an
    // idle tenant-cap bucket is kept at a refill (one interval's worth).
    let b = &v["keyspace"]["bucket"];
    assert_eq!(b["available_us"].as_i64(), b["refill_us"].as_i64(), "{v:#}");
    assert_eq!(v["throttled_now"], false, "{v:#}");
    assert!(text.contains("admitting now"), "{text}");
    assert!(child.wait().unwrap().success());

    let (code, v) = explain(&agent, "32");
    assert_eq!(code, Some(1), "{v:#}");
    assert!(v["error"].as_str().unwrap().contains("keyspace 32 is not known"), "{v:#}");
}

#[test]
fn with_the_throttle_off_nothing_is_throttled() {
    let agent = Agent::start_default("ebpf").unwrap();
    let (mut child, _out) =
        spawn_workload_started(&agent.socket, &["busy", "--keyspace", "33", "--seconds", "0.3"]).unwrap();
    let (code, v) = explain(&agent, "33");
    assert_eq!(code, Some(0), "{v:#}");
    assert_eq!(v["throttled_now"], false);
    assert!(why(&v).contains("cpu-throttle is off"), "{v:#}");
    assert!(child.wait().unwrap().success());
}
