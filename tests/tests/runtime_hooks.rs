//! The tokio hooks: `register_on_park` registers a runtime's workers and
//! not its blocking-pool threads (a worker busy from its start, which never
//! parks, at its first admission); `register_on_start` registers both. A
//! ticket moved into `spawn_blocking` charges the kernel's count of that
//! work to its keyspace under either (under the park hook, the thread is
//! registered as it enters the ticket). `CpuSpread` pins each worker to a CPU of its own.

use governor_tests::{Agent, essential_config};
use keyspace_governor::client::{self, Client, Demand};
use keyspace_governor::sys;
use std::time::{Duration, Instant};

fn burn(ns: u64) -> u64 {
    let t0 = sys::thread_cputime_ns();
    while sys::thread_cputime_ns() - t0 < ns {}
    sys::thread_cputime_ns() - t0
}

#[test]
fn workers_register_on_park_and_blocking_threads_on_start() {
    let agent = std::sync::Arc::new(Agent::start("ebpf", &essential_config(1.0)).unwrap());
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
    // A ticket moved into spawn_blocking there still charges its work: the
    // blocking-pool thread is registered as it enters the ticket, in the
    // background, and its work is the keyspace's from then on.
    let (c, a) = (client.clone(), agent.clone());
    let (measured_after, ran, charged) = rt.block_on(async move {
        let ticket = c.acquire_async(11, Demand::new().timeout(Duration::from_secs(1))).await.unwrap();
        let keyspace = move || a.keyspace_seconds(11).unwrap();
        tokio::task::spawn_blocking(move || {
            let mut ticket = ticket;
            let t0 = Instant::now();
            let mut measured_after = None;
            while t0.elapsed() < Duration::from_secs(3) {
                let _g = ticket.enter();
                burn(100_000);
                if client::is_measured() {
                    measured_after = Some(t0.elapsed());
                    break;
                }
            }
            let before = keyspace();
            let ran: u64 = (0..200)
                .map(|_| {
                    let _g = ticket.enter();
                    burn(1_000_000)
                })
                .sum();
            (measured_after, ran, (keyspace() - before) * 1e9)
        })
        .await
        .unwrap()
    });
    drop(rt);
    eprintln!("blocking thread under the park hook: registered after {measured_after:?}");
    let measured_after = measured_after.expect("the blocking-pool thread was registered within 3 s of its ticket");
    assert!(measured_after < Duration::from_secs(1), "registered {measured_after:?} after entering its ticket");
    let err = (charged - ran as f64) / ran as f64 * 100.0;
    eprintln!("work {ran} ns on a blocking thread, keyspace charged {charged:.0} ns ({err:+.3} %)");
    assert!((-0.5..=1.0).contains(&err), "charged {err:+.3} % off the work");

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

/// A worker that finds work as it starts never parks while it has some: the
/// park hook cannot register it. It is registered at its first admission
/// instead, in the background (no round trip in its poll), and its tickets'
/// work is charged from then on. A current-thread runtime whose one future
/// is never pending is that worker, deterministically: it never parks.
#[test]
fn a_worker_busy_from_its_start_registers_at_its_first_admission() {
    const KS: u32 = 13;
    let agent = Agent::start("ebpf", &essential_config(1.0)).unwrap();
    let client = Client::connect(&agent.socket).unwrap();
    // The keyspace's cell made beforehand, on another thread, so the
    // worker's admissions are ready at once and its future never pending.
    let c = client.clone();
    std::thread::spawn(move || drop(c.acquire(KS, Demand::new()).unwrap())).join().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().on_thread_park(client.register_on_park()).build().unwrap();
    let (registered_before, first_admission, measured_after, ran, charged) = rt.block_on(async {
        let registered_before = client::is_registered();
        let demand = || Demand::new().timeout(Duration::from_secs(1));
        let t0 = Instant::now();
        let ticket = client.acquire_async(KS, demand()).await.unwrap();
        let first_admission = t0.elapsed();
        drop(ticket);
        // Tickets' work, until the registration is in (the thread clock
        // then reads from the shared page, and the tag takes).
        let mut measured_after = None;
        while t0.elapsed() < Duration::from_secs(3) {
            let mut ticket = client.acquire_async(KS, demand()).await.unwrap();
            let _g = ticket.enter();
            burn(100_000);
            if client::is_measured() {
                measured_after = Some(t0.elapsed());
                break;
            }
        }
        // A second of tickets' work, with the kernel's count of it beside.
        let before = agent.keyspace_seconds(KS).unwrap();
        let (mut ran, t1) = (0, Instant::now());
        while t1.elapsed() < Duration::from_secs(1) {
            let mut ticket = client.acquire_async(KS, demand()).await.unwrap();
            let _g = ticket.enter();
            ran += burn(1_000_000);
        }
        let charged = (agent.keyspace_seconds(KS).unwrap() - before) * 1e9;
        (registered_before, first_admission, measured_after, ran, charged)
    });
    assert!(!registered_before, "the worker had not parked, so the park hook had not registered it");
    eprintln!("first admission {first_admission:?}; registration in after {measured_after:?}");
    let measured_after = measured_after.expect("the worker was registered within 3 s of its first admission");
    // Nothing in the poll waited for the agent: the first admission took no
    // round trip (the registration is the background thread's).
    assert!(first_admission < Duration::from_millis(20), "first admission took {first_admission:?}");
    assert!(measured_after < Duration::from_secs(1), "registered {measured_after:?} after its first admission");
    let err = (charged - ran as f64) / ran as f64 * 100.0;
    eprintln!("work {ran} ns, keyspace charged {charged:.0} ns ({err:+.3} %)");
    assert!(ran > 500_000_000, "the worker ran its tickets' work: {ran} ns");
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
    let rt = spread_runtime(&spread, workers);
    std::thread::sleep(Duration::from_millis(200));
    let seen = on_each_worker(&rt, workers, || (sys::gettid(), allowed_cpus(), sys::current_cpu()));
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

/// A runtime of `workers` whose workers follow `spread` at each park.
fn spread_runtime(spread: &client::CpuSpread, workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .on_thread_park(spread.pin_on_park())
        .build()
        .unwrap()
}

/// `f` run on each of the runtime's `workers` at once: one task per
/// worker, each holding its worker until all run.
fn on_each_worker<T: Send + 'static>(rt: &tokio::runtime::Runtime, workers: usize, f: fn() -> T) -> Vec<T> {
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(workers));
    rt.block_on(async {
        let tasks: Vec<_> = (0..workers)
            .map(|_| {
                let b = barrier.clone();
                tokio::spawn(async move {
                    b.wait();
                    f()
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    })
}

/// Each worker's allowed CPUs, read on the worker, the second of two
/// rounds: every worker has parked (and applied what the spread says now)
/// before it.
fn worker_masks(rt: &tokio::runtime::Runtime, workers: usize) -> Vec<String> {
    on_each_worker(rt, workers, allowed_cpus);
    std::thread::sleep(Duration::from_millis(20));
    on_each_worker(rt, workers, allowed_cpus)
}

/// With `watch_other_processes`, the workers are let go (onto all of the
/// spread's CPUs) while another process takes a core, and pinned again,
/// one each, once it has stopped.
#[test]
fn cpu_spread_lets_workers_go_while_another_process_holds_a_cpu() {
    let spread = client::CpuSpread::new().unwrap();
    let cpus = spread.cpus().to_vec();
    if cpus.len() < 2 {
        eprintln!("one CPU: nothing to spread");
        return;
    }
    spread.watch_other_processes().unwrap();
    let all = allowed_cpus();
    let workers = cpus.len().min(4);
    let rt = spread_runtime(&spread, workers);
    let pinned_apart = |masks: &[String]| {
        let mut one: Vec<&String> = masks.iter().filter(|m| m.parse::<u32>().is_ok()).collect();
        one.sort();
        one.dedup();
        one.len() == workers
    };
    // Before the watch's first period, the workers keep to a CPU each.
    let masks = worker_masks(&rt, workers);
    assert!(spread.pinning());
    assert!(pinned_apart(&masks), "workers pinned one to a CPU at first: {masks:?}");

    // Another process takes a core: let go within two periods or so.
    let mut burner = std::process::Command::new("sh").args(["-c", "while :; do :; done"]).spawn().unwrap();
    let t = std::time::Instant::now();
    while spread.pinning() && t.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let let_go = t.elapsed();
    let others = spread.other_processes_cores().unwrap_or(0.0);
    let masks = worker_masks(&rt, workers);
    eprintln!("a burner: let go after {let_go:?}, other processes {others:.2} cores; workers allowed on {masks:?}");
    assert!(!spread.pinning(), "still pinned after {let_go:?} with a burner beside (others {others:.2} cores)");
    // Half a core over a half-second period: the burner ran 0.25 s of it.
    assert!(let_go >= Duration::from_millis(200), "let go {let_go:?} after the burner started");
    assert!(
        (0.8..=cpus.len() as f64 + 0.2).contains(&others),
        "the burner's core, as the watch read it: {others:.2} cores"
    );
    assert!(masks.iter().all(|m| *m == all), "let go: every worker on {all}: {masks:?}");
    burner.kill().unwrap();
    burner.wait().unwrap();

    // Back to calm: pinned again after two calm periods, unless something
    // else on this machine keeps the CPUs busy (a busy round of the tests).
    let t = std::time::Instant::now();
    while !spread.pinning() && t.elapsed() < Duration::from_secs(4) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let others = spread.other_processes_cores().unwrap_or(0.0);
    if !spread.pinning() && others > 0.3 {
        eprintln!("other processes still take {others:.2} cores here: the workers stay let go");
        return;
    }
    let masks = worker_masks(&rt, workers);
    eprintln!("burner gone: pinned again after {:?} (others {others:.2} cores); workers on {masks:?}", t.elapsed());
    assert!(spread.pinning(), "not pinned again {:?} after the burner stopped", t.elapsed());
    // The period the burner stopped in counts as calm when it ran less
    // than 0.3 of it: 0.85 s after at the least.
    assert!(t.elapsed() >= Duration::from_millis(700), "pinned again before two calm periods: {:?}", t.elapsed());
    assert!(pinned_apart(&masks), "pinned again one to a CPU: {masks:?}");
}
