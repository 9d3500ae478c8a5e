//! `workload threads`: registered threads that work the way a storage
//! server's threads do (sleep between requests, block in syscalls, get
//! preempted by wakeups, spin), each under its keyspace, so the test can
//! set the agent's charges against the kernel's own per-thread counters.
//!
//! Protocol on stdin/stdout, so the test can stop the process and read each
//! thread's schedstat and the agent's charges at both edges of the tagged
//! span:
//! 1. prints `{"ready": [{"tid", "keyspace", "kind"}, ...]}` once every
//!    thread is registered, tagged with its keyspace and on its way to
//!    wait;
//! 2. waits for a line on stdin, then every thread works for `--seconds`
//!    (and on until it used `--min-cpu-ms`, default 100) and waits, still
//!    tagged;
//! 3. prints `{"worked": [{"tid", "keyspace", "kind", "thread_cpu_ns",
//!    "thread_clock_ns"}, ...]}` (CPU time of the work by
//!    `CLOCK_THREAD_CPUTIME_ID` and by the client's thread clock);
//! 4. waits for another line, then every thread clears its tag and
//!    unregisters, and the process exits.
//!
//! Between the two prints every thread is tagged the whole time, so all
//! the CPU its schedstat shows between a stop after the first and a stop
//! after the second is its keyspace's.

use super::{arg, burn, socket};
use anyhow::{Context, Result, bail};
use keyspace_governor::client::{self, Client};
use keyspace_governor::sys;
use serde_json::json;
use std::io::{BufRead, Read, Write};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Busy work for about `us` microseconds of CPU (calibrated by the
/// thread's own CPU clock, so preemption stretches wall time, not work).
fn work_us(us: u64) {
    let end = sys::thread_cputime_ns() + us * 1000;
    while sys::thread_cputime_ns() < end {
        burn(5);
    }
}

fn pin(cpu: usize) {
    let _ = sys::pin_current_thread_to(cpu as u32);
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    /// 150 µs of work, then a 200 µs sleep: a request loop that waits on I/O.
    Sleepy,
    /// Work, then block reading a pipe another (unregistered) thread feeds
    /// every 100 µs; every tenth round a 4 KiB write and fsync.
    Blocking,
    /// CPU-bound, pinned to CPU 0.
    Spinner,
    /// Pinned to CPU 0 beside a spinner: wakes every 50 µs, works 10 µs,
    /// preempting the spinner each time.
    Waker,
    /// CPU-bound, on any CPU: a heavy scan.
    Busy,
    /// Wakes every 1 ms (on a fixed schedule) for 100 µs of work: a light
    /// tenant's point reads.
    Ticker,
    /// A ticker that sleeps untagged and tags its keyspace for each
    /// request, as a pooled worker woken for work does.
    Pooled,
}

impl Kind {
    fn parse(s: &str) -> Result<Kind> {
        Ok(match s {
            "sleepy" => Kind::Sleepy,
            "blocking" => Kind::Blocking,
            "spinner" => Kind::Spinner,
            "waker" => Kind::Waker,
            "busy" => Kind::Busy,
            "ticker" => Kind::Ticker,
            "pooled" => Kind::Pooled,
            other => bail!("unknown thread kind {other:?}"),
        })
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Sleepy => "sleepy",
            Kind::Blocking => "blocking",
            Kind::Spinner => "spinner",
            Kind::Waker => "waker",
            Kind::Busy => "busy",
            Kind::Ticker => "ticker",
            Kind::Pooled => "pooled",
        }
    }

    /// Works until `until`, and on (30 s at most) until the thread has used
    /// `min_cpu_ns` of CPU: a machine busy elsewhere stretches the wall
    /// time, not the work the test measures.
    fn run(self, until: Instant, min_cpu_ns: u64, scratch: &std::path::Path, keyspace: u32) -> Result<()> {
        let cpu0 = sys::thread_cputime_ns();
        let more = || {
            let now = Instant::now();
            now < until || (now < until + Duration::from_secs(30) && sys::thread_cputime_ns() - cpu0 < min_cpu_ns)
        };
        match self {
            Kind::Sleepy => {
                while more() {
                    work_us(150);
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
            Kind::Blocking => {
                let (mut rx, mut tx) = std::io::pipe()?;
                let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
                let feeder_stop = stop.clone();
                let feeder = std::thread::spawn(move || {
                    while !feeder_stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_micros(100));
                        if tx.write_all(&[1]).is_err() {
                            break;
                        }
                    }
                });
                let mut file = std::fs::File::create(scratch.join(format!("fsync-{}", sys::gettid())))?;
                let mut round = 0u64;
                let mut b = [0u8; 1];
                while more() {
                    work_us(40);
                    rx.read_exact(&mut b)?;
                    round += 1;
                    if round.is_multiple_of(10) {
                        file.write_all(&[7u8; 4096])?;
                        file.sync_all()?;
                    }
                }
                drop(file);
                let _ = std::fs::remove_file(scratch.join(format!("fsync-{}", sys::gettid())));
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                drop(rx);
                feeder.join().map_err(|_| anyhow::anyhow!("feeder panicked"))?;
            }
            Kind::Spinner => {
                pin(0);
                while more() {
                    burn(50);
                }
            }
            Kind::Waker => {
                pin(0);
                while more() {
                    std::thread::sleep(Duration::from_micros(50));
                    work_us(10);
                }
            }
            Kind::Busy => {
                while more() {
                    burn(50);
                }
            }
            Kind::Ticker | Kind::Pooled => {
                let pooled = matches!(self, Kind::Pooled);
                let mut next = Instant::now();
                while more() {
                    next += Duration::from_millis(1);
                    if pooled {
                        client::clear_tag();
                    }
                    if let Some(d) = next.checked_duration_since(Instant::now()) {
                        std::thread::sleep(d);
                    }
                    if pooled {
                        client::set_tag(keyspace)?;
                    }
                    work_us(100);
                }
            }
        }
        Ok(())
    }
}

pub fn threads(args: &[String]) -> Result<serde_json::Value> {
    let kinds: Vec<Kind> =
        arg(args, "--kinds", "sleepy".to_string()).split(',').map(Kind::parse).collect::<Result<_>>()?;
    let base: u32 = arg(args, "--keyspace-base", 100);
    let keyspaces: u32 = arg(args, "--keyspaces", kinds.len() as u32).max(1);
    let seconds: f64 = arg(args, "--seconds", 1.0);
    let min_cpu_ns: u64 = arg::<u64>(args, "--min-cpu-ms", 100) * 1_000_000;
    let scratch = std::env::temp_dir();
    let client = Client::connect(socket(args))?;
    let n = kinds.len();
    let go = Arc::new(Barrier::new(n + 1));
    let exit = Arc::new(Barrier::new(n + 1));
    let until = Arc::new(std::sync::OnceLock::<Instant>::new());
    let (tx, rx) = std::sync::mpsc::channel::<Result<serde_json::Value>>();
    let handles: Vec<_> = kinds
        .iter()
        .enumerate()
        .map(|(i, &kind)| {
            let (client, go, exit, until, scratch, tx) =
                (client.clone(), go.clone(), exit.clone(), until.clone(), scratch.clone(), tx.clone());
            let keyspace = base + i as u32 % keyspaces;
            std::thread::spawn(move || {
                let report = |v: Result<serde_json::Value>| tx.send(v).map_err(|_| anyhow::anyhow!("main gone"));
                let tid = sys::gettid();
                if let Err(e) = client.register_current_thread() {
                    return report(Err(e.into()));
                }
                // Tagged from here to the end (the keyspace's cell looked up
                // now: an agent round trip the first time, charged to the
                // tag before, as set_tag says).
                if let Err(e) = client::set_tag(keyspace) {
                    return report(Err(e.into()));
                }
                report(Ok(json!({"tid": tid, "keyspace": keyspace, "kind": kind.name()})))?;
                go.wait();
                let result = (|| -> Result<serde_json::Value> {
                    let until = *until.get().context("start time")?;
                    let clock0 = client::thread_cpu_ns().context("registered")?;
                    let cpu0 = sys::thread_cputime_ns();
                    let r = kind.run(until, min_cpu_ns, &scratch, keyspace);
                    let cpu1 = sys::thread_cputime_ns();
                    let clock1 = client::thread_cpu_ns().context("registered")?;
                    r?;
                    Ok(json!({
                        "tid": tid, "keyspace": keyspace, "kind": kind.name(),
                        "thread_cpu_ns": cpu1 - cpu0, "thread_clock_ns": clock1 - clock0,
                    }))
                })();
                report(result)?;
                exit.wait();
                client::clear_tag();
                Ok(())
            })
        })
        .collect();
    let collect = || (0..n).map(|_| rx.recv()?).collect::<Result<Vec<_>>>();
    let ready = collect()?;
    println!("{}", json!({ "ready": ready }));
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    until.set(Instant::now() + Duration::from_secs_f64(seconds)).map_err(|_| anyhow::anyhow!("start set twice"))?;
    go.wait();
    let worked = collect()?;
    println!("{}", json!({ "worked": worked }));
    std::io::stdout().flush()?;
    line.clear();
    std::io::stdin().lock().read_line(&mut line)?;
    exit.wait();
    for h in handles {
        h.join().map_err(|_| anyhow::anyhow!("thread panicked"))??;
    }
    Ok(json!({ "done": n, "backend": client.backend().map_or("none", |b| b.as_str()) }))
}

/// `workload pingpong --rounds N --cpu C [--register]`: a same-CPU pipe
/// ping-pong between this process and a child (`pingpong-peer`), both
/// pinned to CPU `C`: two context switches a round trip. With
/// `--register` both register their thread with the agent and tag it
/// (keyspaces 1 and 2). Prints the mean ns per round trip.
///
/// Both processes have two threads either way: the client's watch thread
/// when registered, an idle one otherwise. glibc's syscall wrappers take a
/// slower path (cancellation points) in a process with more than one
/// thread, which would otherwise count as a cost of registering (about 5 %
/// of the round trip here); a storage server has many threads anyway.
pub fn pingpong(args: &[String]) -> Result<serde_json::Value> {
    let rounds: u64 = arg(args, "--rounds", 20_000);
    let cpu: usize = arg(args, "--cpu", 0);
    let register = args.iter().any(|a| a == "--register");
    let mut peer = std::process::Command::new(std::env::current_exe()?);
    peer.args(["pingpong-peer", "--rounds", &rounds.to_string(), "--cpu", &cpu.to_string()]);
    if register {
        peer.args(["--register", "--socket", &socket(args)]);
    }
    let mut child = peer.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).spawn()?;
    let mut to = child.stdin.take().context("peer stdin")?;
    let mut from = child.stdout.take().context("peer stdout")?;
    pin(cpu);
    let _keep = if register {
        let c = Client::connect(socket(args))?;
        c.register_current_thread()?;
        Some((client::tag(1)?, c))
    } else {
        second_thread();
        None
    };
    let mut b = [0u8; 1];
    // The peer says it is ready with one byte.
    from.read_exact(&mut b)?;
    let t = Instant::now();
    for _ in 0..rounds {
        to.write_all(&b)?;
        from.read_exact(&mut b)?;
    }
    let ns = t.elapsed().as_nanos() as f64 / rounds as f64;
    drop(to);
    if !child.wait()?.success() {
        bail!("pingpong peer failed");
    }
    Ok(json!({ "round_trip_ns": ns, "rounds": rounds, "registered": register }))
}

/// An idle second thread, parked for the life of the process.
fn second_thread() {
    std::thread::spawn(|| {
        loop {
            std::thread::park();
        }
    });
}

pub fn pingpong_peer(args: &[String]) -> Result<serde_json::Value> {
    let rounds: u64 = arg(args, "--rounds", 20_000);
    pin(arg(args, "--cpu", 0));
    let _keep = if args.iter().any(|a| a == "--register") {
        let c = Client::connect(socket(args))?;
        c.register_current_thread()?;
        Some((client::tag(2)?, c))
    } else {
        second_thread();
        None
    };
    let (mut stdin, mut stdout) = (std::io::stdin().lock(), std::io::stdout().lock());
    let mut b = [1u8; 1];
    stdout.write_all(&b)?;
    stdout.flush()?;
    for _ in 0..rounds {
        stdin.read_exact(&mut b)?;
        stdout.write_all(&b)?;
        stdout.flush()?;
    }
    Ok(json!({}))
}
