//! The ticket API against a real agent on real CPU: the tenant cap holds,
//! quotas split a saturated node, burst fills an idle one, waiters are woken
//! by refunds in arrival order and leave at their deadline.

use governor_tests::{
    Agent, Stretch, blocked_in_futex, essential_config, eventually, spawn_workload_started, thread_schedstat,
};
use keyspace_governor::client::{Client, Demand};
use std::io::BufRead;
use std::sync::Mutex;
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn cores() -> f64 {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as f64
}

#[test]
fn a_greedy_tenant_is_held_to_its_cap_in_every_second() {
    let _s = serial();
    // 0.5 core on this 2-core machine (0.25 × cores elsewhere).
    let ratio = 0.5 / cores();
    let agent = Agent::start("ebpf", &essential_config(ratio)).unwrap();
    let steal = governor_tests::Steal::start();
    let (mut child, mut out) = spawn_workload_started(
        &agent.socket,
        &["tickets", "--keyspace", "1", "--threads", "8", "--seconds", "12", "--work-us", "1000"],
    )
    .unwrap();
    // The first window warms up (estimates, the bucket's initial fill).
    let mut windows = agent.sample_windows(1, 11, None).unwrap();
    windows.remove(0);
    let mut last = String::new();
    out.read_line(&mut last).unwrap();
    assert!(child.wait().unwrap().success());
    let report: serde_json::Value = serde_json::from_str(&last).unwrap();
    let cap = ratio * cores();
    let rates: Vec<f64> = windows.iter().map(|w| w.cores).collect();
    eprintln!(
        "cap {cap:.3} cores; per-second CPU {rates:.3?}; waited {:?}; workload {report}",
        windows.iter().map(|w| w.waited).collect::<Vec<_>>()
    );
    // Never over the cap; and not under it in a window where its requests
    // waited in line (the cap held it back, not a machine busy elsewhere),
    // less what the hypervisor stole then (`Window::steal_pct`).
    for w in &windows {
        let err = (w.cores - cap) / cap * 100.0;
        assert!(
            err <= 5.0 && (w.waited == 0 || err >= -5.0 - w.steal_pct),
            "a 1 s window off the cap by {err:+.2} %: {windows:.3?}"
        );
    }
    assert!(windows.iter().any(|w| w.waited > 0), "nothing waited: the cap never held: {windows:?}");
    // The workers' own CPU clocks, read around the work inside each ticket,
    // agree with what the agent charged the keyspace and with what the
    // tickets were charged. (The tickets' tag switches sit just outside the
    // clock reads: a few µs each. Tickets pay by the thread clock, which
    // counts what the hypervisor stole within a slice; the keyspace is
    // charged the kernel's count, which does not.)
    let steal = steal.share();
    let charged = agent.keyspace_seconds(1).unwrap();
    let tickets = report["ticket_consumed_ns"].as_f64().unwrap() / 1e9;
    let ran = report["work_cpu_ns"].as_f64().unwrap() / 1e9;
    eprintln!(
        "keyspace charged {charged:.4} s, tickets consumed {tickets:.4} s, work by the thread clocks {ran:.4} s; steal {:.2} %",
        steal * 100.0
    );
    // The keyspace is also charged the CPU its requests spent waiting in
    // line (admission is the tenant's work too): 3 % here, where eight
    // threads sleep on one futex word and every move of the head wakes them
    // all (the async waiter wakes only the one served).
    assert!(
        charged >= ran * 0.99 && charged <= ran * (1.05 + steal),
        "charged {charged:.4} s, workers ran {ran:.4} s, steal {steal:.4}"
    );
    assert!(
        tickets >= charged * 0.995 && tickets <= charged * (1.005 + steal),
        "tickets {tickets:.4} s, keyspace {charged:.4} s, steal {steal:.4}"
    );
    assert!(report["granted"].as_u64().unwrap() > 1000, "{report}");
    assert_eq!(report["fail_open"], 0);
}

#[test]
fn a_tenant_back_from_idle_takes_no_more_than_its_cap_in_its_first_second() {
    let _s = serial();
    let ratio = 0.5 / cores();
    let cap = ratio * cores();
    let agent = Agent::start("ebpf", &essential_config(ratio)).unwrap();
    // The tenant's bucket exists (a first request made it) and has been idle
    // long enough to be full; then eight threads want far more than the cap,
    // for one second: what they get in it is the worst 1 s window.
    let one_second = ["tickets", "--keyspace", "1", "--threads", "8", "--seconds", "1", "--work-us", "1000"];
    governor_tests::run_workload(&agent.socket, &["tickets", "--keyspace", "1", "--threads", "1", "--seconds", "0.1"])
        .unwrap();
    let mut firsts = Vec::new();
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(1500));
        let steal = governor_tests::Steal::start();
        let before = agent.keyspace_seconds(1).unwrap();
        let report = governor_tests::run_workload(&agent.socket, &one_second).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let charged = agent.keyspace_seconds(1).unwrap() - before;
        let wall = report["loop_seconds"].as_f64().unwrap();
        let tickets = report["ticket_consumed_ns"].as_f64().unwrap() / 1e9;
        let steal = steal.share();
        eprintln!(
            "after idle: charged {charged:.4} s, tickets {tickets:.4} s in {wall:.4} s, steal {:.2} %; {report}",
            steal * 100.0
        );
        // What the tenant got is the kernel's charge: the tickets' thread
        // clocks also count what the host stole within a slice (one CI run
        // read them 3.6 % above the charge, the charge 0.8 % above the cap).
        firsts.push(charged / wall.max(1.0));
        // Held back: the cap, not a lack of demand.
        assert!(report["granted"].as_u64().unwrap() > 300 && charged >= cap * (0.9 - steal), "{report}");
    }
    let worst = firsts.iter().copied().fold(0.0, f64::max);
    let err = (worst - cap) / cap * 100.0;
    eprintln!("cap {cap:.3} cores; first seconds after idle {firsts:.4?}: worst {err:+.2} %");
    // An idle bucket keeps one refill interval's tokens (+1 % of the
    // second), and the loop's second may hold one refill more than its
    // share of the 10 ms grid (+1 %): +2 % at worst by that count, +0.5 to
    // +1.3 % read. A bucket left full would give +10 %.
    assert!((-5.0..=3.0).contains(&err), "the first second after idle off the cap by {err:+.2} %: {firsts:.4?}");
}

#[test]
fn quotas_split_a_saturated_node_in_proportion() {
    let _s = serial();
    let config = "[resource-control]\nmax-read-cpu-ratio = 1.0\n[resource-control.cpu-throttle]\nenabled = true\n\
                  keyspace-cpu-quotas = \"1:200,2:400,3:600\"\nenable-burst = false\nenable-fair-allocation = false\n\
                  enable-dynamic-adjustment = false\n[agent]\nmax-threads = 256\n";
    let agent = Agent::start("ebpf", config).unwrap();
    // 12 greedy threads on the node: every keyspace wants more than its quota.
    let procs: Vec<_> = (1..=3)
        .map(|ks| {
            spawn_workload_started(
                &agent.socket,
                &["tickets", "--keyspace", &ks.to_string(), "--threads", "4", "--seconds", "7", "--work-us", "1000"],
            )
            .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    let read = || {
        let s = agent.status().unwrap();
        let k =
            |ks: u32| s.keyspaces.iter().find(|k| k.keyspace_id == ks).map_or((0.0, 0), |k| (k.cpu_seconds, k.waited));
        (s.counters_read_at_ns as f64 / 1e9, [k(1), k(2), k(3)], governor_tests::steal_ns() as f64 / 1e9)
    };
    let before = read();
    std::thread::sleep(Duration::from_secs(5));
    let after = read();
    for (mut c, _) in procs {
        assert!(c.wait().unwrap().success());
    }
    let secs = after.0 - before.0;
    let steal_pct = (after.2 - before.2) / (secs * cores()) * 100.0;
    let rates: Vec<f64> = before.1.iter().zip(&after.1).map(|(b, a)| (a.0 - b.0) / secs).collect();
    let waited: Vec<u64> = before.1.iter().zip(&after.1).map(|(b, a)| a.1 - b.1).collect();
    eprintln!(
        "CPU per second of keyspaces 1..3 (quotas 0.2, 0.4, 0.6 cores): {rates:.3?}, waited {waited:?}, steal {steal_pct:.1} %"
    );
    // Each at its quota: never over it, and not under it while its
    // requests waited in line for tokens (every keyspace wants more than
    // its quota, so they do unless the machine is busy elsewhere), less
    // what the hypervisor stole meanwhile.
    for ((rate, quota), waited) in rates.iter().zip([0.2, 0.4, 0.6]).zip(&waited) {
        let err = (rate - quota) / quota * 100.0;
        assert!(
            err <= 5.0 && (*waited == 0 || err >= -5.0 - steal_pct),
            "a keyspace off its quota by {err:+.2} %: {rates:.3?}, waited {waited}, steal {steal_pct:.1} %"
        );
    }
    assert!(waited.iter().all(|w| *w > 0), "a keyspace never waited: its quota was never tested: {waited:?}");
}

#[test]
fn burst_gives_an_idle_node_to_one_keyspace() {
    let _s = serial();
    let config = "[resource-control]\nmax-read-cpu-ratio = 1.0\n[resource-control.cpu-throttle]\nenabled = true\n\
                  keyspace-cpu-quotas = \"9:100\"\nenable-burst = true\nenable-fair-allocation = false\n\
                  enable-dynamic-adjustment = false\n[agent]\nmax-threads = 256\n";
    let agent = Agent::start("ebpf", config).unwrap();
    let threads = (cores() as usize).to_string();
    let (mut child, mut out) = spawn_workload_started(
        &agent.socket,
        &[
            "tickets",
            "--keyspace",
            "9",
            "--threads",
            &threads,
            "--seconds",
            "4",
            "--work-us",
            "500",
            "--timeout-ms",
            "100",
        ],
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let windows = agent.sample_windows(9, 3, Some(child.id())).unwrap();
    let mut last = String::new();
    out.read_line(&mut last).unwrap();
    assert!(child.wait().unwrap().success());
    let report: serde_json::Value = serde_json::from_str(&last).unwrap();
    let status = agent.status().unwrap();
    let k = status.keyspaces.iter().find(|k| k.keyspace_id == 9).unwrap().clone();
    eprintln!(
        "quota 0.1 core, burst on, a node with nothing else to serve: {windows:.3?}; {report}; waited {} of {}",
        k.waited, k.granted
    );
    // Far above its quota: all the CPU its threads got (by schedstat; less
    // what the work loop spends outside tickets), whatever else the machine
    // runs. At most the whole node.
    for w in &windows {
        assert!(
            w.cores >= 5.0 * 0.1 && w.cores <= cores() * 1.02,
            "not far above its quota of 0.1 core: {windows:.3?}"
        );
        assert!(
            w.cores >= 0.93 * w.process_cores && w.cores <= 1.03 * w.process_cores,
            "not what its threads ran: {windows:.3?}"
        );
    }
    assert_eq!(report["refused"], 0, "{report}");
    // At full use of the node a request may meet an empty burst budget just
    // before a refill boundary; a rare short wait, never a refusal.
    assert!(k.waited * 100 <= k.granted, "waited {} of {} requests", k.waited, k.granted);
}

/// An agent with one tenant-cap bucket of `capacity_us` that refills once a
/// second (the longest refill interval): anything served sooner was served
/// by a refund.
fn slow_refill_agent(capacity_us: u64) -> Agent {
    let ratio = capacity_us as f64 / 1e6 / cores();
    let config = format!(
        "[resource-control]\nmax-read-cpu-ratio = 1.0\n[resource-control.cpu-throttle]\nenabled = true\n\
         enforce-global-limit = true\ntenant-max-cpu-ratio = {ratio}\nrefill-interval = \"1s\"\nburst-window = \"1s\"\n\
         enable-burst = false\nenable-fair-allocation = false\nenable-dynamic-adjustment = false\n\
         enable-runtime-token-management = false\nenable-adaptive-estimated-cpu-per-request-us = false\n"
    );
    Agent::start("ebpf", &config).unwrap()
}

#[test]
fn a_refund_wakes_a_waiter_long_before_the_next_refill() {
    let _s = serial();
    let agent = slow_refill_agent(100_000);
    let c = Client::connect(&agent.socket).unwrap();
    let mut attempts = Vec::new();
    for _ in 0..3 {
        // Hold every token, then let a waiter queue behind.
        let holder = c.acquire(5, Demand::new().estimate_us(100_000)).expect("the full bucket");
        let c2 = c.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            tx.send(keyspace_governor::sys::gettid()).unwrap();
            let wait0 = thread_schedstat().1;
            let t = c2.acquire(5, Demand::new().estimate_us(60_000).timeout(Duration::from_secs(3)));
            let served_at = Instant::now();
            (t.map(drop), served_at, Duration::from_nanos(thread_schedstat().1 - wait0))
        });
        let tid = rx.recv().unwrap();
        eventually("the waiter asleep in line", || blocked_in_futex(tid));
        let refunded_at = Instant::now();
        drop(holder); // consumed nothing: all 100 ms of tokens come back
        let (r, served_at, runnable) = waiter.join().unwrap();
        r.expect("served");
        if served_at < refunded_at {
            // A refill landed first; that proves nothing about refunds.
            attempts.push(None);
            continue;
        }
        // From the refund to its service, less the time the woken waiter
        // was runnable with no CPU to run on (a busy machine's, not ours).
        let after = (served_at - refunded_at).saturating_sub(runnable);
        attempts.push(Some(after));
        eprintln!(
            "waiter served {after:?} after the refund ({:?} in all, {runnable:?} of it waiting for a CPU)",
            served_at - refunded_at
        );
        assert!(after < Duration::from_millis(20), "served {after:?} after the refund");
        return;
    }
    panic!("a refill served the waiter before the refund every time: {attempts:?}");
}

#[test]
fn waiters_of_one_keyspace_are_served_in_arrival_order() {
    let _s = serial();
    let agent = slow_refill_agent(100_000);
    let c = Client::connect(&agent.socket).unwrap();
    // Five holders of 20 ms each drain the bucket.
    let holders: Vec<_> = (0..5).map(|_| c.acquire(6, Demand::new().estimate_us(20_000)).expect("tokens")).collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiters: Vec<_> = (0..5)
        .map(|i| {
            let (c, tx) = (c.clone(), tx.clone());
            let (tid_tx, tid_rx) = std::sync::mpsc::channel();
            let w = std::thread::spawn(move || {
                tid_tx.send(keyspace_governor::sys::gettid()).unwrap();
                let t = c.acquire(6, Demand::new().estimate_us(20_000).timeout(Duration::from_secs(30)));
                tx.send(i).unwrap();
                // Hold it a while, so served waiters do not refund to the next.
                t.map(|t| {
                    std::thread::sleep(Duration::from_millis(1000));
                    drop(t)
                })
            });
            // Arrive in order: the next comes once this one sleeps in line.
            let tid = tid_rx.recv().unwrap();
            eventually(&format!("waiter {i} asleep in line"), || blocked_in_futex(tid));
            w
        })
        .collect();
    let mut order = Vec::new();
    for h in holders {
        drop(h);
        order.push(rx.recv_timeout(Duration::from_secs(10)).expect("one waiter served per refund"));
    }
    for w in waiters {
        w.join().unwrap().expect("served");
    }
    assert_eq!(order, vec![0, 1, 2, 3, 4]);
}

#[test]
fn a_deadline_is_honoured_within_two_milliseconds() {
    let _s = serial();
    let agent = slow_refill_agent(100_000);
    let c = Client::connect(&agent.socket).unwrap();
    let _holder = c.acquire(7, Demand::new().estimate_us(100_000)).expect("the full bucket");
    let mut late = Vec::new();
    for wait_ms in [20u64, 50, 80] {
        let stretch = Stretch::start();
        let r = c.acquire(7, Demand::new().estimate_us(50_000).timeout(Duration::from_millis(wait_ms)));
        let stretch = stretch.end();
        let refused = r.expect_err("nothing can serve it before the deadline");
        assert_eq!(refused.code(), "tenant_cap_exhausted");
        // Never early; late by at most 2 ms of the time the thread was ours
        // (asleep or running, not runnable with no CPU to run on).
        let early = wait_ms as f64 - stretch.wall.as_secs_f64() * 1e3;
        let over = stretch.held().as_secs_f64() * 1e3 - wait_ms as f64;
        eprintln!("deadline {wait_ms} ms: refused after {stretch} (waited {:?})", refused.waited);
        late.push(over);
        assert!(early <= 0.0, "refused {early:.2} ms before a {wait_ms} ms deadline");
        assert!(over <= 2.0, "refused {over:.2} ms after a {wait_ms} ms deadline");
    }
}
