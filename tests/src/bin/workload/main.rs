//! A tagged multi-threaded workload: a storage server's worker threads in
//! miniature. It measures itself with CLOCK_THREAD_CPUTIME_ID so its own
//! numbers can be set against what the agent charged. Prints one JSON line.
mod attack;
mod kinds;
mod probe;
mod rows;
mod server;
mod tickets;

use anyhow::{Context, Result, bail};
use keyspace_governor::client::{self, Client};
use keyspace_governor::sys;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    args.windows(2).find(|w| w[0] == name).and_then(|w| w[1].parse().ok()).unwrap_or(default)
}

fn socket(args: &[String]) -> String {
    arg(args, "--socket", "/run/governor/governor.sock".to_string())
}

/// Busy work: `units` × 120 rounds of integer mixing (~0.1 µs a unit).
#[inline(never)]
fn burn(units: u64) {
    let mut x = 0x1234_5678u64;
    for i in 0..units * 120 {
        x = x.rotate_left(5) ^ i.wrapping_mul(0x9E37_79B9);
    }
    std::hint::black_box(x);
}

fn burn_for(d: Duration) -> u64 {
    let start = Instant::now();
    let mut n = 0;
    while start.elapsed() < d {
        burn(50);
        n += 1;
    }
    n
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Threads switch among keyspaces `base..base+k` with uneven work, directly
/// from one keyspace to the next (no untagged gap).
fn exactly_once(args: &[String]) -> Result<serde_json::Value> {
    let threads: usize = arg(args, "--threads", 6);
    let keyspaces: u32 = arg(args, "--keyspaces", 8);
    let switches: u64 = arg(args, "--switches", 100_000);
    let base: u32 = arg(args, "--base", 1000);
    let client = Client::connect(socket(args))?;
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let client = client.clone();
            std::thread::spawn(move || -> Result<(u64, BTreeMap<u32, u64>, u64)> {
                client.register_current_thread()?;
                let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((t as u64 + 1) * 7919));
                let mut own: BTreeMap<u32, u64> = BTreeMap::new();
                let start = sys::thread_cputime_ns();
                let mut prev_t = start;
                let mut prev_k = None;
                for _ in 0..switches {
                    let k = (rng.next() % keyspaces as u64) as u32;
                    let t = sys::thread_cputime_ns();
                    if let Some(pk) = prev_k {
                        *own.entry(base + pk).or_default() += t - prev_t;
                    }
                    client::set_tag(base + k)?;
                    prev_t = t;
                    prev_k = Some(k);
                    // Keyspace k does (k+1)² units: heavily uneven.
                    burn(((k + 1) * (k + 1)) as u64 * 2);
                }
                let t = sys::thread_cputime_ns();
                if let Some(pk) = prev_k {
                    *own.entry(base + pk).or_default() += t - prev_t;
                }
                client::clear_tag();
                let end = sys::thread_cputime_ns();
                Ok((end - start, own, switches))
            })
        })
        .collect();
    let mut total = 0u64;
    let mut own: BTreeMap<u32, u64> = BTreeMap::new();
    let mut total_switches = 0;
    for h in handles {
        let (t, o, s) = h.join().map_err(|_| anyhow::anyhow!("worker panicked"))??;
        total += t;
        total_switches += s;
        for (k, v) in o {
            *own.entry(k).or_default() += v;
        }
    }
    Ok(json!({
        "threads": threads,
        "switches": total_switches,
        "thread_cpu_ns": total,
        "self_measured_ns": own.iter().map(|(k, v)| (k.to_string(), *v)).collect::<BTreeMap<_, _>>(),
        "backend": client.backend().map_or("none", |b| b.as_str()),
    }))
}

/// One tagged thread busy for `--seconds`; prints "started" first so the
/// caller can time its look at the agent.
fn busy(args: &[String]) -> Result<serde_json::Value> {
    let keyspace: u32 = arg(args, "--keyspace", 1);
    let secs: f64 = arg(args, "--seconds", 2.0);
    let client = Client::connect(socket(args))?;
    client.register_current_thread()?;
    // The keyspace's cell is looked up now (an agent round trip the first
    // time, charged to the tag before, as set_tag says; milliseconds in an
    // emulated guest): the measured period starts with a plain switch.
    drop(client::tag(keyspace)?);
    let start = sys::thread_cputime_ns();
    let _g = client::tag(keyspace)?;
    println!("started");
    burn_for(Duration::from_secs_f64(secs));
    drop(_g);
    Ok(json!({ "thread_cpu_ns": sys::thread_cputime_ns() - start }))
}

/// A tagged thread, a registered untagged thread, and an unregistered
/// thread that "tags" anyway: only the first is charged.
/// `burn --threads N --seconds S`: an unmodified CPU burner. It never
/// talks to the agent; rules measure it from outside (the VM guest's cgroup
/// test caps it by rule).
fn burn_threads(args: &[String]) -> Result<serde_json::Value> {
    let secs: f64 = arg(args, "--seconds", 1.0);
    let n: usize = arg(args, "--threads", 1);
    let hs: Vec<_> = (0..n).map(|_| std::thread::spawn(move || burn_for(Duration::from_secs_f64(secs)))).collect();
    let rounds: u64 = hs.into_iter().map(|h| h.join().expect("no panic")).sum();
    Ok(json!({ "threads": n, "rounds": rounds }))
}

fn untagged(args: &[String]) -> Result<serde_json::Value> {
    let secs: f64 = arg(args, "--seconds", 1.0);
    let tagged_ks: u32 = arg(args, "--keyspace", 7);
    let client = Client::connect(socket(args))?;
    // Each thread reports its CPU time by CLOCK_THREAD_CPUTIME_ID and, when
    // registered, by the thread clock (the timeline the agent charges on).
    let run = |mode: u32| {
        let client = client.clone();
        std::thread::spawn(move || -> Result<(u64, Option<u64>)> {
            if mode < 2 {
                client.register_current_thread()?;
            }
            let start = sys::thread_cputime_ns();
            let clock_start = client::thread_cpu_ns();
            let g = match mode {
                0 => Some(client::tag(tagged_ks)?),
                2 => Some(client::tag(tagged_ks + 1)?), // a no-op: not registered
                _ => None,
            };
            burn_for(Duration::from_secs_f64(secs));
            drop(g);
            let clock = clock_start.and_then(|s| Some(client::thread_cpu_ns()? - s));
            Ok((sys::thread_cputime_ns() - start, clock))
        })
    };
    let hs: Vec<_> = (0..3).map(run).collect();
    let times: Vec<(u64, Option<u64>)> = hs.into_iter().map(|h| h.join().expect("no panic")).collect::<Result<_>>()?;
    Ok(json!({
        "tagged_ns": times[0].0,
        "tagged_thread_clock_ns": times[0].1,
        "registered_untagged_ns": times[1].0,
        "unregistered_ns": times[2].0,
    }))
}

/// Many short-lived registered threads, `--parallel` at a time. Half exit
/// normally (the client gives the slot back); half die abruptly with a raw
/// exit, so only the agent can reclaim their slots.
fn churn(args: &[String]) -> Result<serde_json::Value> {
    let total: u64 = arg(args, "--threads", 10_000);
    let parallel: u64 = arg(args, "--parallel", 4);
    let keyspace: u32 = arg(args, "--keyspace", 5);
    let client = Client::connect(socket(args))?;
    let failures = Arc::new(AtomicU64::new(0));
    let abrupt_done = Arc::new(AtomicU64::new(0));
    let mut last_error = None::<String>;
    let (tx, rx) = std::sync::mpsc::channel::<Option<String>>();
    let mut started = 0u64;
    let mut finished = 0u64;
    while finished < total {
        while started < total && started - finished < parallel {
            let (client, tx, abrupt_done) = (client.clone(), tx.clone(), abrupt_done.clone());
            let abrupt = started % 2 == 1;
            std::thread::Builder::new().stack_size(64 * 1024).spawn(move || {
                let r = (|| -> Result<()> {
                    client.register_current_thread()?;
                    let _g = client::tag(keyspace)?;
                    burn(20);
                    Ok(())
                })();
                if abrupt {
                    abrupt_done.fetch_add(1, Ordering::SeqCst);
                }
                let _ = tx.send(r.err().map(|e| keyspace_governor::error_chain(e.as_ref())));
                if abrupt {
                    // SAFETY: ends this thread at once, skipping destructors,
                    // as a crashed thread would; nothing else touches its stack.
                    unsafe { libc::syscall(libc::SYS_exit, 0) };
                }
            })?;
            started += 1;
        }
        if let Some(err) = rx.recv()? {
            failures.fetch_add(1, Ordering::Relaxed);
            last_error = Some(err);
        }
        finished += 1;
    }
    Ok(json!({
        "threads": total,
        "failures": failures.load(Ordering::Relaxed),
        "abrupt_exits": abrupt_done.load(Ordering::SeqCst),
        "last_error": last_error,
    }))
}

fn main() -> Result<()> {
    const USAGE: &str = "usage: workload exactly-once|busy|untagged|burn|churn|threads|rows|pingpong|redis-probe|slice|tickets|async-server|late|hold|corrupt|attack [--socket PATH] ...\n\
        (the test suites' load generator: each workload's flags are in the doc comment of its function under tests/src/bin/workload/)";
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(verb) = args.first() else { bail!("{USAGE}") };
    if matches!(verb.as_str(), "--help" | "-h" | "help") {
        println!("{USAGE}");
        return Ok(());
    }
    let out = match verb.as_str() {
        "exactly-once" => exactly_once(&args),
        "busy" => busy(&args),
        "untagged" => untagged(&args),
        "burn" => burn_threads(&args),
        "churn" => churn(&args),
        "threads" => kinds::threads(&args),
        "tickets" => tickets::tickets(&args),
        "async-server" => server::async_server(&args),
        "late" => tickets::late(&args),
        "hold" => tickets::hold(&args),
        "corrupt" => tickets::corrupt(&args),
        "attack" => attack::attack(&args),
        "pingpong" => kinds::pingpong(&args),
        "redis-probe" => probe::redis_probe(&args),
        "slice" => probe::slice(&args),
        "rows" => rows::rows(&args),
        "pingpong-peer" => {
            kinds::pingpong_peer(&args)?;
            return Ok(());
        }
        other => bail!("unknown workload {other:?}\n{USAGE}"),
    }
    .with_context(|| format!("workload {verb}"))?;
    println!("{out}");
    Ok(())
}
