//! `workload rows`: two keyspaces served by the same threads, in turns of
//! 600 and 200 µs by default, each in a function of its own (`hash_rows`
//! for the first, `compress_rows` for the second): what a per-keyspace
//! profile must tell apart. With `--kinds`, the two are request kinds of
//! the first keyspace instead: kind 1 tagged with
//! `client::set_tag_with_kind`, kind 2 run
//! under a ticket of `Demand::kind(2)`; `--totals FILE` then keeps in FILE
//! the CPU time the threads spent in each kind so far, by the kernel's
//! thread CPU clock (`KIND1_NS KIND2_NS ADMISSION_NS`, rewritten every
//! 100 ms; the ticket's acquire, between the two kinds, is of neither, and
//! the readings' own cost is taken out): the truth a profile's kind shares
//! are checked against.

use super::arg;
use anyhow::Result;
use keyspace_governor::client::{self, Client, Demand};
use keyspace_governor::sys::thread_cputime_ns;
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Keyspace A's work: integer mixing, no calls.
#[inline(never)]
fn hash_rows(rounds: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for i in 0..rounds {
        h = (h ^ i).wrapping_mul(0x0100_0000_01b3).rotate_left(7);
    }
    std::hint::black_box(h)
}

/// Keyspace B's work: a different loop, no calls either.
#[inline(never)]
fn compress_rows(rounds: u64) -> u64 {
    let mut x = 0x1234_5678_9abc_def0u64;
    let mut run = 0u64;
    for i in 0..rounds {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        run = run.wrapping_add((x ^ i) & 0xff);
    }
    std::hint::black_box(run)
}

/// Rounds of `f` that take about `d` of the thread's CPU: the fastest of
/// five timings of at least 2 ms each (one timing alone reads long after a
/// preemption, or on a first run, which emulation makes slow, and the two
/// kinds' turns would then be calibrated off their 3:1).
fn calibrate(f: fn(u64) -> u64, d: Duration) -> u64 {
    let timed = |rounds| {
        let t = thread_cputime_ns();
        f(rounds);
        (thread_cputime_ns() - t).max(1)
    };
    let mut rounds = 1000u64;
    while timed(rounds) < 2_000_000 {
        rounds *= 2;
    }
    let took = (0..5).map(|_| timed(rounds)).min().unwrap_or(1);
    (rounds as f64 * d.as_nanos() as f64 / took as f64).max(1.0) as u64
}

/// Writes the time spent in each kind to `path`, whole (through a rename).
fn write_totals(path: &str, spent: &[AtomicU64; 3]) -> Result<()> {
    let tmp = format!("{path}.tmp");
    let [k1, k2, admit] = spent.each_ref().map(|n| n.load(Ordering::Relaxed));
    std::fs::write(&tmp, format!("{k1} {k2} {admit}\n"))?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// `--threads N --a ID --b ID --seconds S --a-us U --b-us U [--kinds
/// [--totals FILE]]`: prints the turns each thread took.
pub fn rows(args: &[String]) -> Result<serde_json::Value> {
    let threads: usize = arg(args, "--threads", 2);
    let (a, b): (u32, u32) = (arg(args, "--a", 7100), arg(args, "--b", 7200));
    let seconds: f64 = arg(args, "--seconds", 5.0);
    // Turns of 600 and 200 µs: in an emulated guest each tag switch reads
    // the clock, where the timer's interrupts land, and with turns of 150
    // and 50 µs the switches into the second keyspace drew 2-6 % of its
    // samples (CI at c45c305: 93.8 % in its function, bound 90 %).
    let (a_us, b_us): (u64, u64) = (arg(args, "--a-us", 600), arg(args, "--b-us", 200));
    let a_rounds = calibrate(hash_rows, Duration::from_micros(a_us));
    let b_rounds = calibrate(compress_rows, Duration::from_micros(b_us));
    let kinds = args.iter().any(|a| a == "--kinds");
    let totals: Option<String> = args.windows(2).find(|w| w[0] == "--totals").map(|w| w[1].clone());
    let spent = Arc::new([AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)]);
    let client = Client::connect(super::socket(args))?;
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (client, spent) = (client.clone(), spent.clone());
            std::thread::spawn(move || -> Result<u64> {
                client.register_current_thread()?;
                let mut b_rounds = b_rounds;
                let end = Instant::now() + Duration::from_secs_f64(seconds);
                let mut turns = 0;
                loop {
                    if kinds {
                        let t0 = thread_cputime_ns();
                        client::set_tag_with_kind(a, 1)?;
                        hash_rows(a_rounds);
                        client::clear_tag();
                        let t1 = thread_cputime_ns();
                        // Between two readings lies one reading's cost
                        // (the end of the first, the start of the second,
                        // a system call that takes microseconds in an
                        // emulated guest): taken out of each kind's time.
                        let read = thread_cputime_ns() - t1;
                        let mut ticket = client.acquire(a, Demand::new().kind(2))?;
                        // The admission is of neither kind: kept apart.
                        let t2 = thread_cputime_ns();
                        let work = ticket.enter();
                        compress_rows(b_rounds);
                        drop(work);
                        let t3 = thread_cputime_ns();
                        spent[0].fetch_add((t1 - t0).saturating_sub(read), Ordering::Relaxed);
                        spent[1].fetch_add((t3 - t2).saturating_sub(read), Ordering::Relaxed);
                        spent[2].fetch_add(t2 - t1, Ordering::Relaxed);
                    } else if turns % 16 == 0 {
                        // One turn in 16 is timed on the thread clock, and
                        // the second keyspace's rounds steered a step
                        // towards `b_us / a_us` of the first's time: the
                        // calibration alone left the first keyspace 81–86 %
                        // of the CPU, not 75 %, in the emulated x86_64 guest.
                        // The clock is read untagged (see below).
                        let t0 = thread_cputime_ns();
                        client::set_tag(a)?;
                        hash_rows(a_rounds);
                        client::clear_tag();
                        let t1 = thread_cputime_ns();
                        client::set_tag(b)?;
                        compress_rows(b_rounds);
                        client::clear_tag();
                        let t2 = thread_cputime_ns();
                        let want = (t1 - t0) as f64 * b_us as f64 / a_us.max(1) as f64;
                        let step = (want / (t2 - t1).max(1) as f64).clamp(0.8, 1.25);
                        b_rounds = (b_rounds as f64 * step).max(1.0) as u64;
                    } else {
                        client::set_tag(a)?;
                        hash_rows(a_rounds);
                        client::set_tag(b)?;
                        compress_rows(b_rounds);
                    }
                    turns += 1;
                    // The deadline is read every 16 turns, and untagged:
                    // in an emulated guest a clock read is where the
                    // guest's timer interrupts land, and read under the
                    // second keyspace's tag (as the loop's condition did
                    // after that keyspace's turn) it put 7-8 % of that
                    // keyspace's samples in `clock_gettime` (CI at
                    // bfd06eb, aarch64: 88.6 % in its function).
                    if turns % 16 == 0 {
                        client::clear_tag();
                        if Instant::now() >= end {
                            break;
                        }
                    }
                }
                client::clear_tag();
                Ok(turns)
            })
        })
        .collect();
    if let Some(path) = &totals {
        while !handles.iter().all(|h| h.is_finished()) {
            write_totals(path, &spent)?;
            std::thread::sleep(Duration::from_millis(100));
        }
        write_totals(path, &spent)?;
    }
    let mut turns = 0;
    for h in handles {
        turns += h.join().map_err(|_| anyhow::anyhow!("worker panicked"))??;
    }
    Ok(json!({ "turns": turns, "a_rounds": a_rounds, "b_rounds": b_rounds }))
}
