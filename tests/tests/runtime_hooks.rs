//! The tokio hooks: `register_on_park` registers a runtime's workers and
//! not its blocking-pool threads; `register_on_start` registers both, so a
//! ticket moved into `spawn_blocking` charges the kernel's count of that
//! work to its keyspace. `CpuSpread` pins each worker to a CPU of its own.

use governor_tests::{Agent, essential_config};
use keyspace_governor::client::{self, Client, Demand};
use keyspace_governor::sys;
use std::time::Duration;

fn burn(ns: u64) -> u64 {
    let t0 = sys::thread_cputime_ns();
    while sys::thread_cputime_ns() - t0 < ns {}
    sys::thread_cputime_ns() - t0
}

#[test]
fn workers_register_on_park_and_blocking_threads_on_start() {
    let agent = Agent::start("ebpf", &essential_config(1.0)).unwrap();
    let client = Client::connect(&agent.socket).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .on_thread_park(client.register_on_park())
        .build()
        .unwrap();
    // Let the workers start and go idle (they park, and register).
    std::thread::sleep(Duration::from_millis(200));
    let (worker, blocking) = rt.block_on(async {
        let worker = tokio::spawn(async { client::is_registered() }).await.unwrap();
        let blocking = tokio::task::spawn_blocking(client::is_registered).await.unwrap();
        (worker, blocking)
    });
    assert!(worker, "a worker registered when it first parked");
    assert!(!blocking, "a blocking-pool thread is not registered by the park hook");
    drop(rt);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .on_thread_start(client.register_on_start())
        .on_thread_stop(client::unregister_current_thread)
        .build()
        .unwrap();
    let before = agent.keyspace_seconds(12).unwrap();
    let c = client.clone();
    let (registered, ran) = rt.block_on(async move {
        let ticket = c.acquire_async(12, Demand::new().timeout(Duration::from_secs(1))).await.unwrap();
        // The owned ticket moves to a blocking-pool thread with its work.
        tokio::task::spawn_blocking(move || {
            let mut ticket = ticket;
            let registered = client::is_registered();
            let ran = {
                let _g = ticket.enter();
                burn(200_000_000)
            };
            (registered, ran)
        })
        .await
        .unwrap()
    });
    // Thread stop unregisters: the last charge is settled by then.
    drop(rt);
    assert!(registered, "register_on_start registered the blocking-pool thread");
    let charged = (agent.keyspace_seconds(12).unwrap() - before) * 1e9;
    let err = (charged - ran as f64) / ran as f64 * 100.0;
    eprintln!("work {ran} ns on a blocking thread, keyspace charged {charged:.0} ns ({err:+.3} %)");
    // The charge is the kernel's count of the tagged span; the thread clock
    // read inside it misses only the tag switches at its edges.
    assert!((-0.5..=1.0).contains(&err), "charged {err:+.3} % off the work");
}

/// A rayon pool whose threads register as they start: parallel work that
/// tags itself with the request's keyspace is charged to it, whichever pool
/// thread runs each piece, as the kernel counts it.
#[test]
fn rayon_pieces_tagged_with_the_keyspace_are_charged_to_it() {
    use rayon::prelude::*;
    let agent = Agent::start("ebpf", &essential_config(1.0)).unwrap();
    let client = Client::connect(&agent.socket).unwrap();
    let c = client.clone();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .start_handler(move |_| c.register_current_thread().expect("a pool thread registers"))
        .exit_handler(|_| client::unregister_current_thread())
        .build()
        .unwrap();
    let (ks, other) = (13, 14);
    let before = (agent.keyspace_seconds(ks).unwrap(), agent.keyspace_seconds(other).unwrap());
    // Two requests' pieces interleaved on the same two threads.
    let (ran, ran_other): (u64, u64) = pool.install(|| {
        (0..16u32)
            .into_par_iter()
            .map(|i| {
                let k = if i % 2 == 0 { ks } else { other };
                let _g = client::tag(k).expect("tagged");
                let ns = burn(15_000_000 + u64::from(i) * 1_000_000);
                if k == ks { (ns, 0) } else { (0, ns) }
            })
            .reduce(|| (0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    });
    drop(pool);
    // The pool's threads went idle (switched out): their charges are in.
    std::thread::sleep(Duration::from_millis(200));
    for (k, ran, before) in [(ks, ran, before.0), (other, ran_other, before.1)] {
        let charged = (agent.keyspace_seconds(k).unwrap() - before) * 1e9;
        let err = (charged - ran as f64) / ran as f64 * 100.0;
        eprintln!("keyspace {k}: pieces ran {ran} ns, charged {charged:.0} ns ({err:+.3} %)");
        assert!((-0.5..=1.0).contains(&err), "keyspace {k}: charged {err:+.3} % off its pieces");
    }
}

/// The calling thread's allowed CPUs, as the kernel lists them.
fn allowed_cpus() -> String {
    let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap().trim().to_string()
}

/// `CpuSpread::pin_on_park` gives each worker of a runtime a CPU of its
/// own, in turn, and leaves the blocking pool's threads where they were.
#[test]
fn cpu_spread_pins_each_worker_to_a_cpu_of_its_own() {
    let spread = client::CpuSpread::new().unwrap();
    let cpus = spread.cpus().to_vec();
    assert!(!cpus.is_empty());
    let all = allowed_cpus();
    let workers = cpus.len().min(4);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .on_thread_park(spread.pin_on_park())
        .build()
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    // One task per worker at once: each holds its worker until all run.
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(workers));
    let seen: Vec<(u32, String, u32)> = rt.block_on(async {
        let tasks: Vec<_> = (0..workers)
            .map(|_| {
                let b = barrier.clone();
                tokio::spawn(async move {
                    b.wait();
                    (sys::gettid(), allowed_cpus(), sys::current_cpu())
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    });
    let blocking = rt.block_on(async { tokio::task::spawn_blocking(allowed_cpus).await.unwrap() });
    drop(rt);
    eprintln!("allowed {all}; workers (tid, allowed, running on): {seen:?}; blocking thread {blocking}");
    let mut pinned: Vec<u32> = seen
        .iter()
        .map(|(tid, allowed, on)| {
            let cpu: u32 = allowed.parse().unwrap_or_else(|_| panic!("worker {tid} allowed on {allowed}, not one CPU"));
            assert_eq!(*on, cpu, "worker {tid} runs on the CPU it is pinned to");
            cpu
        })
        .collect();
    pinned.sort_unstable();
    let mut expect = cpus[..workers].to_vec();
    expect.sort_unstable();
    assert_eq!(pinned, expect, "each worker on a CPU of its own, the first {workers} in turn");
    assert_eq!(blocking, all, "a blocking-pool thread is not pinned");

    // In turn: after the last CPU, the first again.
    let spread = client::CpuSpread::new().unwrap();
    let got: Vec<u32> = (0..cpus.len() + 1)
        .map(|_| {
            let s = spread.clone();
            std::thread::spawn(move || s.pin_current_thread().unwrap()).join().unwrap()
        })
        .collect();
    let mut expect = cpus.clone();
    expect.push(cpus[0]);
    assert_eq!(got, expect);
}
