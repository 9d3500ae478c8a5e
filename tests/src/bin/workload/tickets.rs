//! Workloads that take tickets: a greedy tenant, a process that holds
//! tickets on command, and a hostile process that scribbles on the regions.

use super::{arg, burn, socket};
use anyhow::{Context, Result, bail};
use keyspace_governor::client::{self, Client, Demand};
use keyspace_governor::sys;
use serde_json::json;
use std::io::{BufRead, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Burns `us` µs of this thread's CPU.
fn work_us(us: u64) {
    let end = sys::thread_cputime_ns() + us * 1000;
    while sys::thread_cputime_ns() < end {
        burn(5);
    }
}

/// `workload tickets --keyspace K --threads N --seconds S --work-us W
/// [--timeout-ms T] [--keyspaces M] [--untagged-threads U]`: N registered
/// threads run requests of keyspace K as fast as they are admitted, each W
/// µs of CPU under its ticket (with M > 1: keyspaces K..K+M, each thread
/// taking the next one for every request); U more threads spin as long
/// without any tag (every other one registered, the rest not: a server's
/// gRPC or compaction threads). Prints
/// `started` once every thread is registered, then one JSON line (with
/// `loop_seconds`, the wall time from `started` to the last worker's end).
pub fn tickets(args: &[String]) -> Result<serde_json::Value> {
    let keyspace: u32 = arg(args, "--keyspace", 1);
    let threads: usize = arg(args, "--threads", 8);
    let seconds: f64 = arg(args, "--seconds", 5.0);
    let work: u64 = arg(args, "--work-us", 1000);
    let timeout = Duration::from_millis(arg(args, "--timeout-ms", 1000));
    let spread: u32 = arg(args, "--keyspaces", 1u32).max(1);
    let untagged: usize = arg(args, "--untagged-threads", 0);
    let client = Client::connect(socket(args))?;
    let (granted, refused, fail_open) =
        (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    // Σ of what tickets were charged, and of the thread CPU clock over the
    // same stretches of work (measured inside each ticket, independently).
    let (charged, ran) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let ready = Arc::new(std::sync::Barrier::new(threads + untagged + 1));
    let spinners: Vec<_> = (0..untagged)
        .map(|i| {
            let (client, ready) = (client.clone(), ready.clone());
            std::thread::spawn(move || -> Result<u64> {
                if i % 2 == 0 {
                    client.register_current_thread()?;
                }
                ready.wait();
                let (end, cpu0) = (Instant::now() + Duration::from_secs_f64(seconds), sys::thread_cputime_ns());
                while Instant::now() < end {
                    burn(50);
                }
                Ok(sys::thread_cputime_ns() - cpu0)
            })
        })
        .collect();
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let (client, granted, refused, fail_open, ready) =
                (client.clone(), granted.clone(), refused.clone(), fail_open.clone(), ready.clone());
            let (charged, ran) = (charged.clone(), ran.clone());
            std::thread::spawn(move || -> Result<u64> {
                client.register_current_thread()?;
                ready.wait();
                let end = Instant::now() + Duration::from_secs_f64(seconds);
                let cpu0 = sys::thread_cputime_ns();
                let mut next = i as u32;
                while Instant::now() < end {
                    let ks = keyspace + next % spread;
                    next = next.wrapping_add(1);
                    match client.acquire(ks, Demand::new().timeout(timeout)) {
                        Ok(mut t) => {
                            if t.is_fail_open() {
                                fail_open.fetch_add(1, Ordering::Relaxed);
                            }
                            let mut inside = 0;
                            {
                                let _g = t.enter();
                                let c0 = sys::thread_cputime_ns();
                                work_us(work);
                                inside += sys::thread_cputime_ns() - c0;
                            }
                            charged.fetch_add(t.consumed_ns(), Ordering::Relaxed);
                            ran.fetch_add(inside, Ordering::Relaxed);
                            granted.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(_) => {
                            refused.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                Ok(sys::thread_cputime_ns() - cpu0)
            })
        })
        .collect();
    ready.wait();
    let started = Instant::now();
    println!("started");
    std::io::stdout().flush()?;
    let mut cpu = 0;
    for h in handles {
        cpu += h.join().map_err(|_| anyhow::anyhow!("worker panicked"))??;
    }
    let mut untagged_cpu = 0;
    for h in spinners {
        untagged_cpu += h.join().map_err(|_| anyhow::anyhow!("spinner panicked"))??;
    }
    Ok(json!({
        "loop_seconds": started.elapsed().as_secs_f64(),
        "granted": granted.load(Ordering::Relaxed),
        "refused": refused.load(Ordering::Relaxed),
        "fail_open": fail_open.load(Ordering::Relaxed),
        "thread_cpu_ns": cpu,
        "ticket_consumed_ns": charged.load(Ordering::Relaxed),
        "work_cpu_ns": ran.load(Ordering::Relaxed),
        "untagged_cpu_ns": untagged_cpu,
    }))
}

/// `workload hold`: takes commands on stdin, one per line, and answers each
/// with one JSON line:
/// - `acquire KS [WRITE_BYTES [ESTIMATE_US [low]]]` (`low`: a low-priority
///   request) → `{"ok":true}` or `{"refused":code,"message":..}`
/// - `pass KS ESTIMATE_US` → acquires one ticket and drops it at once
///   (its refund stays with the thread, spare), `{"passed":true}`
/// - `held` → `{"held":n}`
/// - `register` → registers the thread: `{"registered":true}` or `{"refused":why}`
/// - `release` → drops every ticket held, `{"released":n}`
/// - `exit`
pub fn hold(args: &[String]) -> Result<serde_json::Value> {
    let client = Client::connect(socket(args))?;
    let mut held = Vec::new();
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    for line in stdin.lock().lines() {
        let line = line?;
        let w: Vec<&str> = line.split_whitespace().collect();
        let reply = match w.as_slice() {
            ["acquire", ks, rest @ ..] => {
                let ks: u32 = ks.parse().context("keyspace")?;
                let mut d = Demand::new();
                if let Some(b) = rest.first() {
                    d = d.write_bytes(b.parse().context("write bytes")?);
                }
                if let Some(e) = rest.get(1) {
                    d = d.estimate_us(e.parse().context("estimate")?);
                }
                if rest.get(2) == Some(&"low") {
                    d = d.low_priority();
                }
                match client.acquire(ks, d) {
                    Ok(t) => {
                        held.push(t);
                        json!({"ok": true})
                    }
                    Err(r) => json!({"refused": r.code(), "message": r.to_string()}),
                }
            }
            ["pass", ks, estimate] => {
                let d = Demand::new().estimate_us(estimate.parse().context("estimate")?);
                match client.acquire(ks.parse().context("keyspace")?, d) {
                    Ok(t) => {
                        drop(t);
                        json!({"passed": true})
                    }
                    Err(r) => json!({"refused": r.code(), "message": r.to_string()}),
                }
            }
            // Requests that wait in line (60 s deadline) and keep their
            // tickets once admitted: `blocked` threads in `acquire`, then
            // `futures` futures in `acquire_async` on one thread's runtime.
            ["queue", ks, estimate, blocked, futures] => {
                let ks: u32 = ks.parse().context("keyspace")?;
                let estimate: u64 = estimate.parse().context("estimate")?;
                let demand = move || Demand::new().estimate_us(estimate).timeout(Duration::from_secs(60));
                let futures: usize = futures.parse().context("futures")?;
                let c = client.clone();
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
                    rt.block_on(async {
                        let waits = (0..futures).map(|_| tokio::spawn(c.acquire_async(ks, demand())));
                        let mut tickets = Vec::new();
                        for w in waits.collect::<Vec<_>>() {
                            tickets.push(w.await);
                        }
                        std::future::pending::<()>().await;
                    });
                });
                for _ in 0..blocked.parse::<usize>().context("blocked")? {
                    let c = client.clone();
                    std::thread::spawn(move || {
                        let _ticket = c.acquire(ks, demand());
                        loop {
                            std::thread::park();
                        }
                    });
                }
                json!({"queued": true})
            }
            ["held"] => json!({"held": held.len()}),
            ["register"] => match client.register_current_thread() {
                Ok(()) => json!({"registered": true}),
                Err(e) => json!({"refused": e.to_string()}),
            },
            // The server's own pool rejected a request of this keyspace.
            ["pool-reject", ks] => {
                client.report_pool_rejection(ks.parse().context("keyspace")?);
                json!({"reported": true})
            }
            ["release"] => {
                let n = held.len();
                held.clear();
                json!({"released": n})
            }
            ["exit"] => break,
            _ => bail!("unknown command {line:?}"),
        };
        writeln!(out, "{reply}")?;
        out.flush()?;
    }
    Ok(json!({"held": held.len()}))
}

/// `workload corrupt --seconds S`: connects like a client, then writes
/// random bytes into every region it can map writable, for S seconds.
/// What a hostile local process with the socket's permission can do.
pub fn corrupt(args: &[String]) -> Result<serde_json::Value> {
    let seconds: f64 = arg(args, "--seconds", 10.0);
    let path = socket(args);
    let stream = std::os::unix::net::UnixStream::connect(&path)?;
    (&stream).write_all(b"{\"op\":\"hello\"}\n")?;
    let mut buf = vec![0u8; 4096];
    use std::os::fd::AsRawFd;
    let (_, fds) = sys::recv_with_fds(stream.as_raw_fd(), &mut buf, 16)?;
    let mut maps = Vec::new();
    let mut refused = 0;
    for f in &fds {
        let len = sys::region_len(f.as_raw_fd()).unwrap_or(0);
        if len == 0 {
            continue;
        }
        match sys::Mapping::map(f.as_raw_fd(), len) {
            Ok(m) => maps.push((m, len)),
            Err(_) => refused += 1,
        }
    }
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ std::process::id() as u64;
    let mut writes = 0u64;
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    while Instant::now() < end {
        for (m, len) in &maps {
            for _ in 0..64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let at = (x as usize % (len / 8)) * 8;
                #[allow(unsafe_code)]
                // SAFETY: `at` is an aligned offset inside a shared mapping of
                // `len` bytes; scribbling on it is the point of this program.
                unsafe {
                    std::ptr::write_volatile(m.as_ptr().add(at) as *mut u64, x);
                }
                writes += 1;
            }
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    let _ = client::thread_cpu_ns();
    Ok(json!({"regions_writable": maps.len(), "regions_refused": refused, "writes": writes}))
}

/// `workload late --keyspace K --threads N --seconds S [--work-us W]`: a
/// server that starts before any agent (`Client::new` on a socket nobody
/// listens on): N registered threads run requests of keyspace K, W µs of
/// CPU each under its ticket, for S seconds. Prints `started`, then one
/// JSON line: when (CLOCK_MONOTONIC ns) the client found itself attached
/// and when a thread first got a ticket that was checked, and the
/// fail-open admissions before and after.
pub fn late(args: &[String]) -> Result<serde_json::Value> {
    let keyspace: u32 = arg(args, "--keyspace", 1);
    let threads: usize = arg(args, "--threads", 4);
    let seconds: f64 = arg(args, "--seconds", 6.0);
    let work: u64 = arg(args, "--work-us", 1000);
    let client = Client::new(socket(args))?;
    let attached_at_start = client.attached();
    let first_checked = Arc::new(AtomicU64::new(u64::MAX));
    let (granted, checked) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (client, first_checked, granted, checked) =
                (client.clone(), first_checked.clone(), granted.clone(), checked.clone());
            std::thread::spawn(move || -> Result<()> {
                client.register_current_thread()?;
                while Instant::now() < end {
                    if let Ok(mut t) = client.acquire(keyspace, Demand::new().timeout(Duration::from_millis(100))) {
                        granted.fetch_add(1, Ordering::Relaxed);
                        if !t.is_fail_open() {
                            checked.fetch_add(1, Ordering::Relaxed);
                            first_checked.fetch_min(sys::monotonic_ns(), Ordering::Relaxed);
                        }
                        let _g = t.enter();
                        work_us(work);
                    }
                }
                Ok(())
            })
        })
        .collect();
    println!("started");
    std::io::stdout().flush()?;
    let (mut attached_ns, mut fail_open_before) = (0, 0);
    while Instant::now() < end {
        if client.attached() {
            attached_ns = sys::monotonic_ns();
            fail_open_before = client.fail_open_count();
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    for h in handles {
        h.join().map_err(|_| anyhow::anyhow!("worker panicked"))??;
    }
    Ok(json!({
        "attached_at_start": attached_at_start,
        "attached_ns": attached_ns,
        "first_checked_ns": first_checked.load(Ordering::Relaxed),
        "fail_open_before_attach": fail_open_before,
        "fail_open": client.fail_open_count(),
        "granted": granted.load(Ordering::Relaxed),
        "checked": checked.load(Ordering::Relaxed),
    }))
}
