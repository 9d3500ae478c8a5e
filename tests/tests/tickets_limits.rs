//! Pending write bytes and per-tenant concurrency through the shared
//! regions, across two client processes; and the modes that admit and count
//! instead of refusing.

use governor_tests::{Agent, Holder, governor_bin};
use std::sync::Mutex;

/// `governor ARGS --socket S` on the agent: its text output.
fn cli(agent: &Agent, args: &[&str]) -> String {
    let o = std::process::Command::new(governor_bin()).args(args).arg("--socket").arg(&agent.socket).output().unwrap();
    assert!(o.status.success(), "governor {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

#[test]
fn write_bytes_hold_each_keyspace_to_thirty_percent_and_the_node_to_its_threshold() {
    let _s = serial();
    // 1 MiB globally; 30 % (314 572 bytes) per keyspace.
    let agent = Agent::start("ebpf", "[write-quota]\npending-write-threshold = \"1MiB\"\n").unwrap();
    let (mut a, mut b) = (Holder::start(&agent.socket), Holder::start(&agent.socket));
    assert_eq!(a.acquire(1, 300_000), Ok(()));
    assert_eq!(a.acquire(1, 20_000), Ok(()), "below the keyspace threshold before it");
    // Keyspace 1 is at 320 000 ≥ 314 572: the other process is refused there…
    assert_eq!(b.acquire(1, 1), Err("write_keyspace_limit".into()));
    // …and admitted for another keyspace.
    assert_eq!(b.acquire(2, 1), Ok(()));
    // The global cap still holds: every keyspace below 30 %, together over 1 MiB.
    assert_eq!(a.acquire(3, 300_000), Ok(()));
    assert_eq!(b.acquire(4, 300_000), Ok(()));
    assert_eq!(a.acquire(5, 200_000), Ok(()));
    assert_eq!(b.acquire(6, 1), Err("write_global_limit".into()));
    let s = agent.status().unwrap();
    assert_eq!(s.admission.global_pending_write_bytes, 1_120_001);
    // The operator sees the limits beside the counts.
    let a_ = &s.admission;
    assert_eq!((a_.pending_write_threshold_bytes, a_.keyspace_pending_write_threshold_bytes), (1 << 20, 314_572));
    let status = cli(&agent, &["status"]);
    assert!(status.contains("writes up to 1MiB pending (314572B per keyspace)"), "{status}");
    let explained = cli(&agent, &["keyspace", "1"]);
    assert!(
        explained.contains("320000B of writes pending of at most 314572B per keyspace, 1120001B of 1MiB on the node"),
        "{explained}"
    );
    // Releasing gives the bytes back.
    assert_eq!(a.say("release")["released"], 4);
    assert_eq!(b.acquire(1, 1), Ok(()));
    assert_eq!(b.acquire(6, 1), Ok(()));
    assert_eq!(agent.status().unwrap().admission.global_pending_write_bytes, 300_003);
}

#[test]
fn enforced_admission_control_refuses_the_tenant_over_its_limit_across_processes() {
    let _s = serial();
    let agent =
        Agent::start("ebpf", "[admission-control]\nmode = \"enforced\"\nmax-concurrent-per-tenant = 3\n").unwrap();
    let (mut a, mut b) = (Holder::start(&agent.socket), Holder::start(&agent.socket));
    assert_eq!(a.acquire(7, 0), Ok(()));
    assert_eq!(a.acquire(7, 0), Ok(()));
    assert_eq!(b.acquire(7, 0), Ok(()));
    // The fourth request of tenant 7 is refused, whichever process sends it,
    // with the marker autoscalers match on.
    let r = b.say("acquire 7 0");
    assert_eq!(r["refused"], "tenant_admission_control", "{r}");
    assert!(r["message"].as_str().unwrap().contains("tenant_admission_control"), "{r}");
    assert_eq!(a.acquire(8, 0), Ok(()), "other tenants are not affected");
    assert_eq!(a.say("release")["released"], 3);
    assert_eq!(b.acquire(7, 0), Ok(()));
    let s = agent.status().unwrap();
    let k = s.keyspaces.iter().find(|k| k.keyspace_id == 7).unwrap();
    assert_eq!(k.inflight_requests, 2);
    assert_eq!(k.refused, 1);
    assert_eq!(s.admission.max_concurrent_per_tenant, 3);
    assert!(cli(&agent, &["status"]).contains("concurrency enforced at 3 in flight per tenant"));
    let explained = cli(&agent, &["keyspace", "7"]);
    assert!(explained.contains("2 in flight") && explained.contains("at most 3 requests in flight"), "{explained}");
}

#[test]
fn monitor_modes_admit_and_count_what_they_would_refuse() {
    let _s = serial();
    // Admission control in monitor mode, and a best-effort global bucket that
    // is smaller than one keyspace's quota.
    let config = "[resource-control]\nmax-read-cpu-ratio = 0.01\n[resource-control.cpu-throttle]\nenabled = true\n\
                  enforce-global-limit = false\nkeyspace-cpu-quotas = \"9:1000\"\nenable-burst = false\n\
                  enable-fair-allocation = false\nenable-dynamic-adjustment = false\n\
                  enable-runtime-token-management = false\n[admission-control]\nmode = \"monitor\"\n\
                  max-concurrent-per-tenant = 1\n";
    let agent = Agent::start("ebpf", config).unwrap();
    let mut a = Holder::start(&agent.socket);
    // Global capacity: 2 cores × 0.01 × 100 ms = 2 ms; ten 5 ms tickets of
    // keyspace 9 (quota 1 core: 100 ms capacity) all pass, each past what
    // the global bucket can ever hold, so each is an overdraft however the
    // refills fall (with 1 ms tickets two fitted, and a refill or two
    // during the round trips would have let a third in).
    for _ in 0..10 {
        let r = a.say("acquire 9 0 5000");
        assert_eq!(r["ok"], true, "{r}");
    }
    let s = agent.status().unwrap();
    assert_eq!(s.admission.monitor_breaches, 9, "{:?}", s.admission);
    assert_eq!(s.admission.global_overdrafts, 10, "{:?}", s.admission);
    assert_eq!(s.admission.refused, 0);
    assert!(s.admission.global.available_us < 0, "the global bucket tracks the overdraft: {:?}", s.admission.global);
    assert_eq!(s.keyspaces.iter().find(|k| k.keyspace_id == 9).unwrap().inflight_requests, 10);
}
