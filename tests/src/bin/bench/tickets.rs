//! Admission: the shared-memory ticket path against the two designs it
//! replaces (a tenant and a global bucket behind one mutex; a round trip to
//! the agent per acquire and per release), the tenant cap held on real CPU,
//! and how soon a dead agent stops holding anyone back.

use anyhow::{Context, Result, bail};
use governor_tests::{Agent, essential_config, spawn_workload_started};
use keyspace_governor::client::{Client, Demand};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use super::{best, per_op};

/// µs each benchmarked request asks for: far below what the buckets hold,
/// so every acquire succeeds and every release refunds it all.
pub const ESTIMATE_US: u64 = 10;

pub struct FastPath {
    pub uncontended_ns: f64,
    /// The same with a deadline (`Demand::timeout`), as servers ask: it may
    /// wait in line, and here is let through at once.
    pub deadline_ns: f64,
    /// One thread, two keyspaces in turn: no request finds a spare of its own.
    pub alternating_ns: f64,
    pub contended_ns: f64,
    pub mutex_ns: f64,
    pub mutex_contended_ns: f64,
    pub rpc_ns: f64,
}

fn cores() -> f64 {
    keyspace_governor::sys::logical_cores() as f64
}

/// Per-op ns of `op` run `n` times on each of `threads` threads at once:
/// the mean over the threads of (their elapsed time / n).
fn concurrent(threads: usize, n: u64, op: impl Fn() + Sync) -> f64 {
    let start = Barrier::new(threads);
    let per: Vec<f64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (start, op) = (&start, &op);
                s.spawn(move || {
                    start.wait();
                    per_op(n, |_| op())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("bench thread")).collect()
    });
    per.iter().sum::<f64>() / per.len() as f64
}

/// The baseline: the seed's decision (tenant then global bucket, nothing
/// taken on refusal) and its refund, under one `std::sync::Mutex`.
pub struct MutexBuckets {
    inner: Mutex<(i64, i64)>,
}

impl MutexBuckets {
    pub fn new() -> MutexBuckets {
        MutexBuckets { inner: Mutex::new((1_000_000, 1_000_000)) }
    }

    pub fn acquire(&self, us: i64) -> bool {
        let mut b = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if b.0 < us || b.1 < us {
            return false;
        }
        b.0 -= us;
        b.1 -= us;
        true
    }

    pub fn release(&self, us: i64) {
        let mut b = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        b.0 += us;
        b.1 += us;
    }
}

/// One acquire and one release as round trips on the agent's socket.
struct Rpc {
    stream: UnixStream,
    reader: BufReader<UnixStream>,
    line: String,
}

impl Rpc {
    fn connect(socket: &std::path::Path) -> Result<Rpc> {
        let stream = UnixStream::connect(socket)?;
        let reader = BufReader::new(stream.try_clone()?);
        Ok(Rpc { stream, reader, line: String::new() })
    }

    fn call(&mut self, request: &str) -> Result<serde_json::Value> {
        self.stream.write_all(request.as_bytes())?;
        self.line.clear();
        self.reader.read_line(&mut self.line)?;
        Ok(serde_json::from_str(&self.line)?)
    }

    fn acquire_release(&mut self, keyspace: u32) -> Result<()> {
        let granted =
            self.call(&format!("{{\"op\":\"acquire\",\"keyspace\":{keyspace},\"estimate_us\":{ESTIMATE_US}}}\n"))?;
        let ticket = granted["ticket"].as_u64().with_context(|| format!("not granted: {granted}"))?;
        let released = self.call(&format!("{{\"op\":\"release\",\"ticket\":{ticket},\"consumed_us\":0}}\n"))?;
        if released["reply"] != "released" {
            bail!("release: {released}");
        }
        Ok(())
    }
}

/// The fast path and its baselines, on an agent in tenant-cap mode (the
/// full decision: tenant bucket, global bucket, ledger record).
pub fn fast_path() -> Result<FastPath> {
    let agent = Agent::start("ebpf", &essential_config(0.5 / cores()))?;
    let client = Client::connect(&agent.socket)?;
    let demand = Demand::new().estimate_us(ESTIMATE_US);
    let ticket_of = |keyspace: u32| {
        let t = client.acquire(keyspace, demand).expect("tokens available");
        drop(std::hint::black_box(t));
    };
    let ticket = || ticket_of(1);
    ticket();
    ticket_of(2);
    let uncontended_ns = best(5, || per_op(1_000_000, |_| ticket()));
    let deadline_ns = best(5, || {
        per_op(1_000_000, |_| {
            let t = client.acquire(1, demand.timeout(std::time::Duration::from_secs(1))).expect("tokens available");
            drop(std::hint::black_box(t));
        })
    });
    let alternating_ns = best(5, || per_op(1_000_000, |i| ticket_of(1 + (i & 1) as u32)));
    let contended_ns = best(5, || concurrent(2, 500_000, ticket));
    let buckets = MutexBuckets::new();
    let mutex = || {
        assert!(buckets.acquire(ESTIMATE_US as i64));
        buckets.release(ESTIMATE_US as i64);
    };
    let mutex_ns = best(5, || per_op(1_000_000, |_| mutex()));
    let mutex_contended_ns = best(5, || concurrent(2, 500_000, mutex));
    let mut rpc = Rpc::connect(&agent.socket)?;
    rpc.acquire_release(1)?;
    let mut failed = None;
    let rpc_ns = best(3, || {
        per_op(5_000, |_| {
            if let Err(e) = rpc.acquire_release(1) {
                failed.get_or_insert(e);
            }
        })
    });
    if let Some(e) = failed {
        return Err(e.context("acquire over the socket"));
    }
    Ok(FastPath { uncontended_ns, deadline_ns, alternating_ns, contended_ns, mutex_ns, mutex_contended_ns, rpc_ns })
}

/// The cap test of `tests/tickets.rs`: one tenant capped at 0.5 core runs 8
/// threads of 1 ms tickets as fast as it can; the worst of ten 1 s windows
/// after the first, as |CPU − cap| / cap in %, and the windows (cores).
pub fn cap_error_pct() -> Result<(f64, Vec<f64>)> {
    let ratio = 0.5 / cores();
    let agent = Agent::start("ebpf", &essential_config(ratio))?;
    let (mut child, _out) = spawn_workload_started(
        &agent.socket,
        &["tickets", "--keyspace", "1", "--threads", "8", "--seconds", "12", "--work-us", "1000"],
    )?;
    let mut rates = agent.sample_rates(1, 11)?;
    rates.remove(0);
    if !child.wait()?.success() {
        bail!("the tickets workload failed");
    }
    let cap = ratio * cores();
    Ok((rates.iter().map(|r| (r - cap).abs() / cap * 100.0).fold(0.0, f64::max), rates))
}

/// kill -9 the agent while four threads wait in line for a tenant capped at
/// 0.05 core: ms from the kill to the first acquire admitted.
pub fn fail_open_ms() -> Result<f64> {
    let ratio = 0.05 / cores();
    let mut agent = Agent::start("ebpf", &essential_config(ratio))?;
    let client = Client::connect(&agent.socket)?;
    let stop = AtomicBool::new(false);
    let died: Mutex<Option<Instant>> = Mutex::new(None);
    let first: Mutex<Option<Instant>> = Mutex::new(None);
    std::thread::scope(|s| -> Result<()> {
        for _ in 0..4 {
            let (client, stop, died, first) = (&client, &stop, &died, &first);
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let r = client.acquire(3, Demand::new().estimate_us(5_000).timeout(Duration::from_secs(10)));
                    let at = Instant::now();
                    // Only admissions without the agent count (a refill just
                    // before the kill could grant one normally).
                    if r.as_ref().is_ok_and(|t| t.is_fail_open()) && died.lock().unwrap().is_some_and(|d| at > d) {
                        first.lock().unwrap().get_or_insert(at);
                    }
                    // Hold each grant a little, as a request would.
                    std::thread::sleep(Duration::from_millis(1));
                }
            });
        }
        std::thread::sleep(Duration::from_secs(1));
        *died.lock().unwrap() = Some(Instant::now());
        let killed = agent.kill9();
        std::thread::sleep(Duration::from_secs(1));
        stop.store(true, Ordering::Relaxed);
        killed
    })?;
    let (d, f) = (died.lock().unwrap().context("killed")?, *first.lock().unwrap());
    let f = f.context("no acquire was admitted within 1 s of the agent's death")?;
    Ok((f - d).as_secs_f64() * 1e3)
}

/// The table full (16 cells, 48 keyspaces on two server processes, a node
/// budget of 0.6 of the cores and a tenant cap of 0.1): the workload's CPU
/// by schedstat against the global cap, signed, in %.
pub fn overflow_cap_error_pct() -> Result<f64> {
    let global_ratio = 0.6;
    let config = format!(
        "[resource-control]\nmax-read-cpu-ratio = {global_ratio}\n[resource-control.cpu-throttle]\n\
         profile = \"essential\"\ntenant-max-cpu-ratio = 0.1\n[agent]\nmax-threads = 256\nmax-keyspaces = 16\n"
    );
    let agent = Agent::start("ebpf", &config)?;
    let load = |first: &str, n: &str| governor_tests::spawn_keyspaces_load(&agent.socket, first, n, "9");
    let (mut with_cells, _a) = load("1", "16")?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while agent.status()?.admission.cells_in_use < 16 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let (mut without, _b) = load("17", "32")?;
    let pids = [with_cells.id(), without.id()];
    let cpu = || pids.iter().map(|&p| governor_tests::process_schedstat_ns(p)).sum::<u64>();
    std::thread::sleep(Duration::from_millis(1500));
    let (cpu0, t0) = (cpu(), Instant::now());
    std::thread::sleep(Duration::from_secs(6));
    let total = (cpu() - cpu0) as f64 / 1e9 / t0.elapsed().as_secs_f64();
    for child in [&mut with_cells, &mut without] {
        if !child.wait()?.success() {
            bail!("a tickets workload failed");
        }
    }
    let cap = global_ratio * cores();
    Ok((total - cap) / cap * 100.0)
}

/// A server in a cgroup limited to 1 core, tenant cap 0.4 (of that core):
/// the worst 1 s window of the tenant's charged CPU against 0.4 core, and
/// the server's CPU by schedstat over all of them, signed, both in %.
pub fn cgroup_cap_error_pct() -> Result<(f64, f64)> {
    let group = governor_tests::CpuCgroup::new("bench-server-cpu", 1.0);
    let agent = Agent::start("ebpf", &essential_config(0.4))?;
    let (mut child, _out) = group.spawn_workload(
        &agent.socket,
        &["tickets", "--keyspace", "1", "--threads", "8", "--seconds", "9", "--work-us", "1000"],
    )?;
    let mut windows = agent.sample_windows(1, 8, Some(child.id()))?;
    windows.remove(0);
    if !child.wait()?.success() {
        bail!("the tickets workload failed");
    }
    let cap = 0.4;
    let worst = windows.iter().map(|w| (w.cores - cap).abs() / cap * 100.0).fold(0.0, f64::max);
    let by_kernel = windows.iter().map(|w| w.process_cores).sum::<f64>() / windows.len() as f64;
    Ok((worst, (by_kernel - cap) / cap * 100.0))
}
