//! A server that starts before the agent: it admits fail-open (counted)
//! while no agent answers, and is attached and governed within a second of
//! the agent's start, without a restart.

use governor_tests::{Agent, Scratch, essential_config, spawn_workload_started};
use std::io::BufRead;
use std::time::Duration;

#[test]
fn a_server_started_before_the_agent_is_governed_once_it_answers() {
    let dir = Scratch::new("late-agent");
    let socket = dir.0.join("governor.sock");
    let (mut child, mut out) = spawn_workload_started(
        &socket,
        &["late", "--keyspace", "9", "--threads", "4", "--seconds", "7", "--work-us", "1000"],
    )
    .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let agent = Agent::start_on("ebpf", &essential_config(0.5 / cores), &socket).unwrap();
    // The agent answers from here on (start_on returns once it does).
    let answered_ns = keyspace_governor::sys::monotonic_ns();
    let windows = agent.sample_windows(9, 3, Some(child.id())).unwrap();
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(child.wait().unwrap().success());
    let r: serde_json::Value = serde_json::from_str(&line).unwrap();
    eprintln!("{r}\nwindows {windows:.3?}");
    let n = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}"));
    assert_eq!(r["attached_at_start"], false, "no agent ran when the server started");
    assert!(n("fail_open_before_attach") > 100, "admissions before the agent were fail-open and counted: {r}");
    let attached_after_ms = n("attached_ns").saturating_sub(answered_ns) as f64 / 1e6;
    let governed_after_ms = n("first_checked_ns").saturating_sub(answered_ns) as f64 / 1e6;
    eprintln!(
        "attached {attached_after_ms:.1} ms, first checked ticket {governed_after_ms:.1} ms after the agent answered (0: before start_on returned)"
    );
    assert!(
        n("attached_ns") > 0 && attached_after_ms <= 1000.0,
        "attached {attached_after_ms:.1} ms after the agent answered"
    );
    assert!(governed_after_ms <= 1000.0, "the first checked ticket {governed_after_ms:.1} ms after the agent answered");
    assert!(n("checked") > 100, "tickets checked by the agent once attached: {r}");
    // Governed: the threads registered in the background are charged, and
    // the tenant is held at its cap (0.5 core) in the windows after.
    let charged = agent.keyspace_seconds(9).unwrap();
    assert!(charged > 0.5, "the keyspace was charged {charged:.3} s");
    // (The first window holds the attach, and fail-open work before it.)
    for w in &windows[1..] {
        assert!(w.cores <= 0.5 * 1.05, "over the cap after attaching: {windows:.3?}");
        assert!(w.cores >= 0.5 * (0.90 - w.steal_pct / 100.0), "held below the cap: {windows:.3?}");
    }
}
