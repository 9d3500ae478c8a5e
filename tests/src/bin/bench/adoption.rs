//! The client as a server meets it: a ticket after the worker slept, the
//! CPU a waiting acquire spends, the longest poll of a keyspace's first
//! use, and the goodput of a capped tenant's admitted work.

use anyhow::{Context, Result};
use governor_tests::{Agent, essential_config, waiter_schedstat, workload_bin};
use keyspace_governor::client::{Client, Demand, TaggedExt};
use keyspace_governor::sys;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::tickets::{ESTIMATE_US, MutexBuckets};

fn cores() -> f64 {
    sys::logical_cores() as f64
}

/// The `p` quantile of `v` (nearest rank; sorts `v`).
pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// A registered worker sleeps 1 ms, then acquires and releases a ticket:
/// the median ns of that acquire + release, and of the mutex-protected
/// buckets measured the same way in the same run.
pub fn cold_ns() -> Result<(f64, f64)> {
    let agent = Agent::start("ebpf", &essential_config(0.5 / cores()))?;
    let client = Client::connect(&agent.socket)?;
    client.register_current_thread()?;
    let demand = Demand::new().estimate_us(ESTIMATE_US);
    drop(client.acquire(1, demand));
    let buckets = MutexBuckets::new();
    let (mut ticket, mut mutex) = (Vec::new(), Vec::new());
    for _ in 0..1000 {
        std::thread::sleep(Duration::from_millis(1));
        let t0 = Instant::now();
        drop(std::hint::black_box(client.acquire(1, demand)));
        ticket.push(t0.elapsed().as_nanos() as f64);
        std::thread::sleep(Duration::from_millis(1));
        let t0 = Instant::now();
        assert!(buckets.acquire(ESTIMATE_US as i64));
        buckets.release(ESTIMATE_US as i64);
        mutex.push(t0.elapsed().as_nanos() as f64);
    }
    keyspace_governor::client::unregister_current_thread();
    Ok((percentile(&mut ticket, 0.5), percentile(&mut mutex, 0.5)))
}

/// CPU (thread clock, µs) of acquires that waited: p50 and p99.
pub struct WaitCpu {
    pub blocking_p50: f64,
    pub blocking_p99: f64,
    pub async_p99: f64,
    /// The process's async waiter thread over the async half, per acquire
    /// that waited: times it ran (its wakeups) and its CPU, µs (schedstat).
    pub waiter_wakes_per_wait: f64,
    pub waiter_cpu_us_per_wait: f64,
    /// One sleep and wake of a thread on this machine (`park`, woken 2 ms
    /// later by another thread): the least a wait that sleeps can cost.
    pub park_p50: f64,
    pub park_p99: f64,
    /// The same with sleeps as long as the blocking waits' median (`gap`):
    /// in this guest a wake costs more the longer the sleep before it
    /// (a thread woken 2 ms on 4–6 µs, 20–80 ms on 10–15 µs).
    pub park_long_p50: f64,
    pub park_long_p99: f64,
    pub park_long_gap: Duration,
}

/// p50 and p99 of the CPU a thread spends across one park / unpark. The
/// waker waits for each wake to be taken before the next: two unparks
/// before the sleeper parks again leave one token, and a sleeper counting
/// wakes by its parks then waited for one that never came.
fn park_cpu_us(wakes: u32, gap: Duration) -> (f64, f64) {
    use std::sync::atomic::{AtomicU32, Ordering};
    let (go, taken) = (std::sync::Arc::new(AtomicU32::new(0)), std::sync::Arc::new(AtomicU32::new(0)));
    let (go2, taken2) = (go.clone(), taken.clone());
    let (tx, rx) = std::sync::mpsc::channel::<std::thread::Thread>();
    let sleeper = std::thread::spawn(move || {
        tx.send(std::thread::current()).unwrap();
        let mut v = Vec::new();
        let mut seen = 0;
        while seen < wakes {
            let c0 = sys::thread_cputime_ns();
            while go2.load(Ordering::Acquire) == seen {
                std::thread::park();
            }
            v.push((sys::thread_cputime_ns() - c0) as f64 / 1e3);
            seen += 1;
            taken2.store(seen, Ordering::Release);
        }
        v
    });
    let t = rx.recv().unwrap();
    for i in 1..=wakes {
        std::thread::sleep(gap);
        go.store(i, Ordering::Release);
        t.unpark();
        while taken.load(Ordering::Acquire) < i {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    let mut v = sleeper.join().unwrap();
    (percentile(&mut v, 0.5), percentile(&mut v, 0.99))
}

/// Four threads of one tenant capped at 0.1 core take tickets of 2 ms of
/// work: the CPU (thread clock, µs) each acquire that waited spent,
/// blocking and async, beside one park of a thread.
pub fn wait_cpu_us() -> Result<WaitCpu> {
    let agent = Agent::start("ebpf", &essential_config(0.1 / cores()))?;
    let client = Client::connect(&agent.socket)?;
    let demand = || Demand::new().estimate_us(2_000).timeout(Duration::from_secs(1));
    let end = Instant::now() + Duration::from_secs(3);
    // Each acquire that waited: its CPU (µs) and its time in line (s).
    let waits = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..4 {
            let (client, waits) = (&client, &waits);
            s.spawn(move || {
                client.register_current_thread().expect("registered");
                while Instant::now() < end {
                    let c0 = sys::thread_cputime_ns();
                    let Ok(mut t) = client.acquire(2, demand()) else { continue };
                    let cpu = sys::thread_cputime_ns() - c0;
                    if t.did_wait() {
                        waits.lock().unwrap().push((cpu as f64 / 1e3, t.waited().as_secs_f64()));
                    }
                    let _g = t.enter();
                    let stop = sys::thread_cputime_ns() + 2_000_000;
                    while sys::thread_cputime_ns() < stop {}
                }
            });
        }
    });
    let (mut blocking, mut walls): (Vec<f64>, Vec<f64>) = waits.into_inner().unwrap().into_iter().unzip();
    let (blocking_p50, blocking_p99) = (percentile(&mut blocking, 0.5), percentile(&mut blocking, 0.99));
    // The same with four futures on one executor thread: CPU over the
    // polls of each acquire that waited.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let waits = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
    client.register_current_thread()?;
    let local = tokio::task::LocalSet::new();
    let end = Instant::now() + Duration::from_secs(3);
    let waiter0 = waiter_schedstat();
    local.block_on(&rt, async {
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let (client, waits) = (client.clone(), waits.clone());
                tokio::task::spawn_local(async move {
                    while Instant::now() < end {
                        let mut cpu = 0;
                        let mut fut = std::pin::pin!(client.acquire_async(3, demand()));
                        let r = std::future::poll_fn(|cx| {
                            let c0 = sys::thread_cputime_ns();
                            let p = fut.as_mut().poll(cx);
                            cpu += sys::thread_cputime_ns() - c0;
                            p
                        })
                        .await;
                        let Ok(t) = r else { continue };
                        if t.did_wait() {
                            waits.borrow_mut().push(cpu as f64 / 1e3);
                        }
                        t.run(async {
                            let stop = sys::thread_cputime_ns() + 2_000_000;
                            while sys::thread_cputime_ns() < stop {}
                        })
                        .await;
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("task");
        }
    });
    let waiter1 = waiter_schedstat();
    let waited = waits.borrow().len().max(1) as f64;
    let waiter_wakes_per_wait = (waiter1.1 - waiter0.1) as f64 / waited;
    let waiter_cpu_us_per_wait = (waiter1.0 - waiter0.0) as f64 / 1e3 / waited;
    let async_p99 = percentile(&mut waits.borrow_mut(), 0.99);
    keyspace_governor::client::unregister_current_thread();
    let (park_p50, park_p99) = park_cpu_us(300, Duration::from_millis(2));
    let median_wall = if walls.is_empty() { 0.0 } else { percentile(&mut walls, 0.5) };
    let park_long_gap = Duration::from_millis((median_wall * 1e3).round().max(2.0) as u64);
    let (park_long_p50, park_long_p99) = park_cpu_us(40, park_long_gap);
    Ok(WaitCpu {
        blocking_p50,
        blocking_p99,
        async_p99,
        waiter_wakes_per_wait,
        waiter_cpu_us_per_wait,
        park_p50,
        park_p99,
        park_long_p50,
        park_long_p99,
        park_long_gap,
    })
}

/// On a tokio executor thread: the longest poll (µs) of the first
/// `acquire_async` and the first `.tagged()` future of 200 keyspaces the
/// agent never saw.
pub fn first_use_poll_max_us() -> Result<f64> {
    let agent = Agent::start_default("ebpf")?;
    let client = Client::connect(&agent.socket)?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    client.register_current_thread()?;
    let mut longest = 0f64;
    rt.block_on(async {
        for ks in 1000..1200u32 {
            let mut acquire = std::pin::pin!(client.acquire_async(ks, Demand::new()));
            let mut tagged = std::pin::pin!(async {}.tagged(ks + 1000));
            std::future::poll_fn(|cx| {
                let t0 = Instant::now();
                let p = acquire.as_mut().poll(cx);
                longest = longest.max(t0.elapsed().as_secs_f64() * 1e6);
                p
            })
            .await
            .map(drop)
            .map_err(|r| anyhow::anyhow!("keyspace {ks}: {r}"))?;
            std::future::poll_fn(|cx| {
                let t0 = Instant::now();
                let p = tagged.as_mut().poll(cx);
                longest = longest.max(t0.elapsed().as_secs_f64() * 1e6);
                p
            })
            .await;
        }
        Ok::<(), anyhow::Error>(())
    })?;
    keyspace_governor::client::unregister_current_thread();
    Ok(longest)
}

/// `workload async-server` (8 closed-loop requests of 1–20 ms CPU, 50 ms
/// deadline, `ticket.run`) under a 0.5-core cap for 8 s: CPU of completed
/// requests / CPU charged, %, and the worst 1 s window's charge after the
/// first against the cap, signed %.
pub fn goodput_pct() -> Result<(f64, f64)> {
    const KS: u32 = 70;
    let agent = Agent::start("ebpf", &essential_config(0.5 / cores()))?;
    let mut child = Command::new(workload_bin())
        .args(["async-server", "--keyspace", &KS.to_string(), "--tasks", "8", "--workers", "2", "--seconds", "8"])
        .args(["--deadline-ms", "50", "--min-ms", "1", "--max-ms", "20", "--mode", "run", "--socket"])
        .arg(&agent.socket)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut stdin = child.stdin.take().context("stdin")?;
    let mut out = BufReader::new(child.stdout.take().context("stdout")?);
    let mut line = String::new();
    out.read_line(&mut line)?;
    let before = agent.keyspace_seconds(KS)?;
    writeln!(stdin)?;
    let windows = agent.sample_windows(KS, 7, None)?;
    let worst = windows[1..]
        .iter()
        .map(|w| (w.cores - 0.5) / 0.5 * 100.0)
        .fold(0.0_f64, |a, e| if e.abs() > a.abs() { e } else { a });
    line.clear();
    out.read_line(&mut line)?;
    let report: serde_json::Value = serde_json::from_str(&line).with_context(|| format!("workload said {line:?}"))?;
    let charged = agent.keyspace_seconds(KS)? - before;
    writeln!(stdin)?;
    child.wait()?;
    let completed = report["completed_cpu_ns"].as_f64().context("completed_cpu_ns")? / 1e9;
    Ok((completed / charged * 100.0, worst))
}
