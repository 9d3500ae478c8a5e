//! The load generator: what the tenants of the reader server send, and the
//! latency they see, measured on the client's side.
//!
//! Light tenants are open-loop: a sender thread issues requests at a fixed
//! rate on a schedule fixed in advance, pipelined over a few connections,
//! and each request's latency counts from its *intended* send time. A
//! server that stalls cannot hide the stall by slowing the sender down
//! (no coordinated omission): the requests it held up count in full, late
//! sends included. The noisy tenant is closed-loop: each of its connections
//! sends the next scan as soon as the previous one is answered, as fast as
//! the server lets it. Latencies go into HDR histograms, per phase and per
//! second of the phase (by intended send time).

use anyhow::{Context, Result, bail};
use governor_reader::proto::{Reply, Request, read_frame};
use governor_reader::store::SplitMix;
use hdrhistogram::Histogram;
use std::collections::{BTreeMap, VecDeque};
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A light tenant: point gets at a fixed rate, every `scan_every`-th
/// request a short scan.
#[derive(Clone, Debug)]
pub struct Light {
    pub name: String,
    pub keyspace: u32,
    pub rate: f64,
    pub connections: usize,
    pub scan_every: u64,
    pub scan_rows: u32,
    pub deadline_ms: u32,
}

/// The noisy tenant: long scans, back to back on every connection.
#[derive(Clone, Debug)]
pub struct Noisy {
    pub name: String,
    pub keyspace: u32,
    pub connections: usize,
    pub scan_rows: u32,
    pub deadline_ms: u32,
}

/// What one tenant saw in one phase.
pub struct Log {
    /// Latency of answered requests (rows and scans), µs.
    pub latency: Histogram<u64>,
    /// The same per second of the phase, by intended send time.
    pub per_second: Vec<Histogram<u64>>,
    pub ok: u64,
    /// Busy replies, by the governor's refusal code.
    pub busy: BTreeMap<String, u64>,
    pub errors: u64,
    /// Sends that left more than 1 ms after their intended time (the
    /// generator's own lateness; it counts in the latency regardless).
    pub late_sends: u64,
}

impl Log {
    fn new() -> Log {
        Log {
            latency: Histogram::new(3).expect("3 significant digits"),
            per_second: Vec::new(),
            ok: 0,
            busy: BTreeMap::new(),
            errors: 0,
            late_sends: 0,
        }
    }

    fn add(&mut self, second: usize, latency_us: u64, reply: &Reply) {
        match reply {
            Reply::Busy { code, .. } => *self.busy.entry(code.clone()).or_default() += 1,
            Reply::Error(_) | Reply::Stats(_) => self.errors += 1,
            Reply::Row(_) | Reply::Scanned(_) => {
                self.ok += 1;
                let v = latency_us.max(1);
                while self.per_second.len() <= second {
                    self.per_second.push(Histogram::new(3).expect("3 significant digits"));
                }
                for h in [&mut self.latency, &mut self.per_second[second]] {
                    // Auto-resizing: grows to any value below 2^63 µs.
                    if h.record(v).is_err() {
                        h.saturating_record(v);
                    }
                }
            }
        }
    }
}

type Shared = Arc<Mutex<Log>>;

fn lock(l: &Shared) -> std::sync::MutexGuard<'_, Log> {
    l.lock().unwrap_or_else(|p| p.into_inner())
}

/// One phase's load, running.
pub struct Run {
    threads: Vec<JoinHandle<Result<()>>>,
    pub logs: BTreeMap<String, Shared>,
}

/// Sleeps until `t` with the thread's timer slack at 1 µs (the default
/// 50 µs would delay every send by up to that much).
fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

#[allow(unsafe_code)]
fn fine_timer_slack() {
    // SAFETY: PR_SET_TIMERSLACK takes an integer and touches no memory.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong, 0, 0, 0) };
}

/// Experiment: how the light tenants' client threads are scheduled.
fn client_priority() {
    let mode = std::env::var("DEMO_CLIENT_SCHED").unwrap_or_default();
    #[allow(unsafe_code)]
    // SAFETY: plain syscalls on the calling thread.
    unsafe {
        match mode.as_str() {
            "fifo" => {
                let p = libc::sched_param { sched_priority: 10 };
                libc::sched_setscheduler(0, libc::SCHED_FIFO, &p);
            }
            "nice" => {
                libc::setpriority(libc::PRIO_PROCESS, 0, -20);
            }
            _ => {}
        }
    }
}

fn connect(addr: SocketAddr) -> Result<TcpStream> {
    let s = TcpStream::connect(addr).with_context(|| format!("connecting to the reader server at {addr}"))?;
    s.set_nodelay(true)?;
    // A server that stops answering fails the phase instead of hanging it.
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    Ok(s)
}

fn spawn(name: String, f: impl FnOnce() -> Result<()> + Send + 'static) -> Result<JoinHandle<Result<()>>> {
    std::thread::Builder::new().name(name).spawn(f).context("spawning a load thread")
}

/// Starts the tenants' load for `[start, start + seconds)`.
pub fn start(addr: SocketAddr, lights: &[Light], noisy: Option<&Noisy>, start: Instant, seconds: f64) -> Result<Run> {
    let end = start + Duration::from_secs_f64(seconds);
    let mut run = Run { threads: Vec::new(), logs: BTreeMap::new() };
    for (i, t) in lights.iter().enumerate() {
        let log: Shared = Arc::new(Mutex::new(Log::new()));
        run.logs.insert(t.name.clone(), log.clone());
        // Tenants' schedules interleave instead of firing together.
        let offset = Duration::from_secs_f64(i as f64 / lights.len() as f64 / t.rate);
        let mut writers = Vec::new();
        for c in 0..t.connections {
            let stream = connect(addr)?;
            let pending = Arc::new(Mutex::new(VecDeque::<Instant>::new()));
            let (reader, log, p) = (stream.try_clone()?, log.clone(), pending.clone());
            run.threads.push(spawn(format!("{}-read{c}", t.name), move || read_replies(reader, p, log, start))?);
            writers.push((stream, pending));
        }
        let t = t.clone();
        run.threads
            .push(spawn(format!("{}-send", t.name), move || send_open_loop(&t, writers, log, start + offset, end))?);
    }
    if let Some(n) = noisy {
        let log: Shared = Arc::new(Mutex::new(Log::new()));
        run.logs.insert(n.name.clone(), log.clone());
        for c in 0..n.connections {
            let (n, log, stream) = (n.clone(), log.clone(), connect(addr)?);
            run.threads.push(spawn(format!("noisy-{c}"), move || closed_loop(&n, c as u64, stream, log, start, end))?);
        }
    }
    Ok(run)
}

/// Sends a light tenant's requests on schedule, round robin over its
/// connections, then half-closes them (the server answers what it has and
/// closes, which ends the readers).
fn send_open_loop(
    t: &Light,
    mut conns: Vec<(TcpStream, Arc<Mutex<VecDeque<Instant>>>)>,
    log: Shared,
    first: Instant,
    end: Instant,
) -> Result<()> {
    fine_timer_slack();
    client_priority();
    let interval = Duration::from_secs_f64(1.0 / t.rate);
    let mut rng = SplitMix(u64::from(t.keyspace) * 7919);
    let mut buf = Vec::with_capacity(64);
    let mut late = 0;
    for i in 0u64.. {
        let intended = first + interval * i as u32;
        if intended >= end {
            break;
        }
        sleep_until(intended);
        if Instant::now() > intended + Duration::from_millis(1) {
            late += 1;
        }
        let req = if i % t.scan_every == t.scan_every - 1 {
            Request::scan(t.keyspace, rng.next_u64(), t.scan_rows, t.deadline_ms)
        } else {
            Request::get(t.keyspace, rng.next_u64(), t.deadline_ms)
        };
        let (stream, pending) = &mut conns[i as usize % t.connections];
        pending.lock().unwrap_or_else(|p| p.into_inner()).push_back(intended);
        buf.clear();
        req.encode(&mut buf);
        stream.write_all(&buf).context("sending a request")?;
    }
    lock(&log).late_sends += late;
    for (s, _) in conns {
        let _ = s.shutdown(Shutdown::Write);
    }
    Ok(())
}

/// Reads one connection's replies in order and records each against the
/// intended send time of its request.
fn read_replies(
    mut stream: TcpStream,
    pending: Arc<Mutex<VecDeque<Instant>>>,
    log: Shared,
    start: Instant,
) -> Result<()> {
    client_priority();
    let mut buf = Vec::new();
    while read_frame(&mut stream, &mut buf).context("reading a reply")?.is_some() {
        let done = Instant::now();
        let intended =
            pending.lock().unwrap_or_else(|p| p.into_inner()).pop_front().context("a reply to no request")?;
        let reply = Reply::decode(&buf)?;
        let second = intended.saturating_duration_since(start).as_secs() as usize;
        lock(&log).add(second, (done - intended).as_micros() as u64, &reply);
    }
    let left = pending.lock().unwrap_or_else(|p| p.into_inner()).len();
    if left > 0 {
        bail!("the server closed a connection with {left} requests unanswered");
    }
    Ok(())
}

/// One connection of the noisy tenant: scan after scan until `end`.
fn closed_loop(n: &Noisy, conn: u64, mut stream: TcpStream, log: Shared, start: Instant, end: Instant) -> Result<()> {
    let mut rng = SplitMix(u64::from(n.keyspace) * 104_729 + conn);
    let (mut out, mut buf) = (Vec::with_capacity(64), Vec::new());
    while Instant::now() < end {
        out.clear();
        Request::scan(n.keyspace, rng.next_u64(), n.scan_rows, n.deadline_ms).encode(&mut out);
        let sent = Instant::now();
        stream.write_all(&out).context("sending a scan")?;
        if read_frame(&mut stream, &mut buf).context("reading a scan reply")?.is_none() {
            bail!("the server closed the noisy tenant's connection");
        }
        let reply = Reply::decode(&buf)?;
        let second = sent.saturating_duration_since(start).as_secs() as usize;
        lock(&log).add(second, sent.elapsed().as_micros() as u64, &reply);
    }
    Ok(())
}

impl Run {
    /// Waits for every answer, then hands back each tenant's log.
    pub fn finish(self) -> Result<BTreeMap<String, Log>> {
        for t in self.threads {
            t.join().map_err(|_| anyhow::anyhow!("a load thread panicked"))??;
        }
        self.logs
            .into_iter()
            .map(|(name, l)| {
                let log = Arc::try_unwrap(l).map_err(|_| anyhow::anyhow!("log of {name} still shared"))?;
                Ok((name, log.into_inner().unwrap_or_else(|p| p.into_inner())))
            })
            .collect()
    }

    /// p99 (µs) over the given tenants' requests sent in `second`, as far
    /// as they are answered yet.
    pub fn p99_of_second(&self, tenants: &[String], second: usize) -> Option<u64> {
        let mut h: Histogram<u64> = Histogram::new(3).expect("3 significant digits");
        for t in tenants {
            if let Some(log) = self.logs.get(t)
                && let Some(s) = lock(log).per_second.get(second)
            {
                h.add(s).ok()?;
            }
        }
        (!h.is_empty()).then(|| h.value_at_quantile(0.99))
    }
}
