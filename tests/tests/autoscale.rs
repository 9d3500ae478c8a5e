//! The autoscaling signals of the admission-control seed, on a live agent:
//! scale-down is unsafe while admission control refuses work; scale-up is
//! unhelpful only when one keyspace owns most of the load *and* is held
//! back. Read from `governor status --json` and from `/metrics`.

use governor_tests::{Agent, Holder, essential_config, eventually, governor_bin, run_workload};
use std::process::Command;

fn signals(agent: &Agent) -> serde_json::Value {
    let o = Command::new(governor_bin()).args(["status", "--json", "--socket"]).arg(&agent.socket).output().unwrap();
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["autoscale"].clone()
}

fn scrape(agent: &Agent) -> String {
    governor_tests::scrape_metrics(&agent.status().unwrap().metrics_addr.unwrap())
}

#[test]
fn scale_down_is_unsafe_while_admission_control_refuses_work() {
    let agent =
        Agent::start("ebpf", "[admission-control]\nmode = \"enforced\"\nmax-concurrent-per-tenant = 1\n").unwrap();
    assert_eq!(signals(&agent)["scale_down_unsafe"], false);
    let mut h = Holder::start(&agent.socket);
    assert_eq!(h.acquire(5, 0), Ok(()));
    // The second request of the same tenant is over its limit: refused,
    // with the cross-process marker.
    assert_eq!(h.acquire(5, 0), Err("tenant_admission_control".to_string()));
    let s = signals(&agent);
    assert_eq!(s["scale_down_unsafe"], true, "{s}");
    assert_eq!(s["admission_refusals_recent"], 1, "{s}");
    assert!(scrape(&agent).lines().any(|l| l == "governor_autoscale_scale_down_unsafe 1"));
}

#[test]
fn scale_up_is_unhelpful_only_for_a_dominant_tenant_that_is_held_back() {
    // Held back: a cap of 5 % of the node, two threads asking for far more.
    let capped = Agent::start("ebpf", &essential_config(0.05)).unwrap();
    run_workload(
        &capped.socket,
        &["tickets", "--keyspace", "6", "--threads", "2", "--seconds", "2", "--work-us", "2000"],
    )
    .unwrap();
    let s = signals(&capped);
    assert_eq!(s["dominant_keyspace"], 6, "{s}");
    assert!(s["dominant_share"].as_f64().unwrap() > 0.99, "{s}");
    assert_eq!((s["dominant_throttled"].clone(), s["scale_up_unhelpful"].clone()), (true.into(), true.into()), "{s}");
    assert_eq!(s["scale_down_unsafe"], false, "a tenant cap is not admission control: {s}");
    assert!(scrape(&capped).lines().any(|l| l == "governor_autoscale_scale_up_unhelpful 1"));
    drop(capped);
    // The same load with nothing holding it back: dominant, but more
    // capacity would help.
    let free = Agent::start("ebpf", "").unwrap();
    run_workload(
        &free.socket,
        &["tickets", "--keyspace", "6", "--threads", "2", "--seconds", "2", "--work-us", "2000"],
    )
    .unwrap();
    let s = signals(&free);
    assert_eq!(s["dominant_keyspace"], 6, "{s}");
    assert_eq!((s["dominant_throttled"].clone(), s["scale_up_unhelpful"].clone()), (false.into(), false.into()), "{s}");
}

#[test]
fn thread_pool_rejections_are_counted_apart_and_feed_no_rule() {
    let agent =
        Agent::start("ebpf", "[admission-control]\nmode = \"enforced\"\nmax-concurrent-per-tenant = 1\n").unwrap();
    let mut h = Holder::start(&agent.socket);
    for _ in 0..7 {
        assert_eq!(h.say("pool-reject 9")["reported"], true);
    }
    // The first reports name a keyspace new to the agent: the client's
    // background thread counts them once its cell is in, without making the
    // reporting thread wait.
    let counts = || {
        let status = agent.status().unwrap();
        let k = status.keyspaces.iter().find(|k| k.keyspace_id == 9).map(|k| (k.pool_rejections, k.refused));
        k.unwrap_or((0, 0))
    };
    eventually("7 pool rejections of keyspace 9 counted", || counts().0 >= 7);
    assert_eq!(counts(), (7, 0));
    // Not admission control: scale-down stays safe, nothing is held back.
    let s = signals(&agent);
    assert_eq!(
        (s["scale_down_unsafe"].clone(), s["admission_refusals_recent"].clone()),
        (false.into(), 0.into()),
        "{s}"
    );
    let text = scrape(&agent);
    assert!(text.lines().any(|l| l == "governor_thread_pool_rejections_total{keyspace_id=\"9\"} 7"), "{text}");
    assert!(!text.lines().any(|l| l.starts_with("governor_keyspace_tickets_refused_total{keyspace_id=\"9\"} ") && !l.ends_with(" 0")));
}
