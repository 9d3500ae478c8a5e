//! Serving: the accept loop, one task per connection, and admission of
//! every request through a ticket of its keyspace.
//!
//! A request asks for the CPU it expects to use (the store's cost model,
//! measured at start: a block per point get, the blocks a scan opens), so
//! a scan is admitted with what it needs and runs through without stopping
//! to top up. It waits for those CPU tokens without holding a worker
//! (`acquire_async`, until the deadline the client sent), then runs its
//! work under the ticket (`Ticket::run`: every poll is tagged with the
//! keyspace and charged to the ticket). A scan yields to the runtime every
//! few blocks, so a heavy request never holds a worker for long and a
//! ticket that ran past its share tops up between two steps (waiting in
//! line, again without holding the worker). A refusal, before or during the
//! work, becomes a busy reply carrying the governor's refusal code.

use crate::stats::{Counters, Stats};
use governor_reader::proto::{MAX_FRAME, Op, Reply, Request, ServerStats};
use governor_reader::store::{CostModel, KeyspaceData, Scan, StoreError};
use keyspace_governor::client::thread_cputime_ns;
use keyspace_governor::client::{Client, Demand};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};

/// Connections served at once; more wait in the listen backlog.
const MAX_CONNECTIONS: usize = 1024;

/// Everything a request needs, alive for the whole process (tickets borrow
/// the client, request futures borrow the data).
pub struct Server {
    pub client: Client,
    pub data: BTreeMap<u32, KeyspaceData>,
    pub stats: Stats,
    /// What a get and a scanned block cost on this machine.
    pub costs: CostModel,
    /// Asked-for CPU = expected × this (a margin: work under contention
    /// runs slower than the calibration; the unused rest is refunded).
    pub estimate_margin: f64,
    /// Blocks a scan reads between two yields.
    pub chunk_blocks: usize,
    pub workers: usize,
    /// Two levels of priority among admitted requests.
    pub levels: Levels,
    /// The workers' CPUs, when a watch lets them go (`--pin-workers auto`).
    pub spread: Option<keyspace_governor::client::CpuSpread>,
}

/// Two scheduling levels among admitted requests, the way a storage
/// server's read pool orders the tasks of resource groups by what they have
/// consumed: a request whose keyspace the governor is holding to its cap
/// (it waited in line for its tokens) runs on the lower level, and a scan
/// there takes each step only when no request of the upper level is
/// running (or after `max_hold`, so it is never starved). Requests of
/// keyspaces within their share never interleave with the steps of a
/// capped one; the capped one still gets its tokens' worth, from the time
/// the others leave. With the throttle off nobody waits, and every request
/// is on the upper level.
pub struct Levels {
    enabled: bool,
    max_hold: Duration,
    upper: AtomicUsize,
    idle: Notify,
}

impl Levels {
    pub fn new(enabled: bool, max_hold: Duration) -> Levels {
        Levels { enabled, max_hold, upper: AtomicUsize::new(0), idle: Notify::new() }
    }

    /// A request on the upper level until the guard drops.
    fn enter_upper(&self) -> Upper<'_> {
        self.upper.fetch_add(1, Ordering::SeqCst);
        Upper(self)
    }

    /// Waits, without holding the worker, until no upper-level request is
    /// running, at most `max_hold`.
    async fn lower_turn(&self) {
        let deadline = tokio::time::Instant::now() + self.max_hold;
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.upper.load(Ordering::SeqCst) == 0 || tokio::time::timeout_at(deadline, idle).await.is_err() {
                return;
            }
        }
    }
}

/// An upper-level request in progress; the last one out lets the lower
/// level run.
struct Upper<'a>(&'a Levels);

impl Drop for Upper<'_> {
    fn drop(&mut self) {
        if self.0.upper.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// Accepts connections until `shutdown` completes.
pub async fn run(server: &'static Server, listener: TcpListener, shutdown: impl Future) {
    let limit = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut backoff = Duration::from_millis(1);
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = limit.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            _ = &mut shutdown => return,
        };
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = &mut shutdown => return,
        };
        match accepted {
            Ok((stream, _)) => {
                backoff = Duration::from_millis(1);
                tokio::spawn(async move {
                    if let Err(e) = connection(server, stream).await {
                        log::debug!("connection: {e}");
                    }
                    drop(permit);
                });
            }
            Err(e) => {
                // Out of fds, or a connection reset before accept: back off.
                log::warn!("accept: {e}; retrying in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// Serves one connection's requests in order until it closes.
async fn connection(server: &'static Server, stream: TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let (rd, mut wr) = stream.into_split();
    let mut rd = BufReader::new(rd);
    let (mut body, mut out) = (Vec::new(), Vec::new());
    loop {
        let len = match rd.read_u32().await {
            Ok(len) => len,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        if len > MAX_FRAME {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("a frame of {len} bytes")));
        }
        body.resize(len as usize, 0);
        rd.read_exact(&mut body).await?;
        let reply = match Request::decode(&body) {
            Ok(req) => server.handle(req).await,
            Err(e) => Reply::Error(e.to_string()),
        };
        out.clear();
        reply.encode(&mut out);
        wr.write_all(&out).await?;
    }
}

fn busy(c: &Counters, code: &'static str, waited: Duration) -> Reply {
    c.busy(code);
    Reply::Busy { code: code.to_string(), waited_us: waited.as_micros() as u64 }
}

impl Server {
    /// What a `stats` request answers.
    pub fn stats_now(&self) -> ServerStats {
        let mut s = self.stats.snapshot(&self.client, self.workers);
        if let Some(spread) = &self.spread {
            s.workers_pinned = Some(spread.pinning());
            s.other_processes_cores = spread.other_processes_cores();
            s.workers_let_go = spread.times_let_go();
        }
        s
    }

    async fn handle(&'static self, req: Request) -> Reply {
        if req.op == Op::Stats {
            let s = self.stats_now();
            return Reply::Stats(serde_json::to_vec(&s).expect("stats serialize"));
        }
        let (Some(ks), Some(c)) = (self.data.get(&req.keyspace), self.stats.keyspace(req.keyspace)) else {
            return Reply::Error(format!("no keyspace {}", req.keyspace));
        };
        // Admission: wait in line for the keyspace's CPU tokens, at most
        // until the client's deadline, without holding this worker.
        let started = Instant::now();
        let expected_us = match req.op {
            Op::Get => self.costs.get_us,
            _ => self.costs.scan_us(ks, u64::from(req.count)),
        };
        let demand = Demand::new()
            .estimate_us((expected_us * self.estimate_margin).ceil().max(1.0) as u64)
            .timeout(Duration::from_millis(u64::from(req.deadline_ms)));
        let mut acquire = std::pin::pin!(self.client.acquire_async(req.keyspace, demand));
        let mut in_line = None;
        let admitted = std::future::poll_fn(|cx| {
            let p = acquire.as_mut().poll(cx);
            if p.is_pending() && in_line.is_none() {
                in_line = Some(InLine::new(c));
            }
            p
        })
        .await;
        drop(in_line);
        let waited = started.elapsed();
        Counters::add(&c.wait_us, waited.as_micros() as u64);
        let ticket = match admitted {
            Ok(t) => t,
            Err(refused) => return busy(c, refused.code(), refused.waited),
        };
        // Whether the request waited in line for tokens (its tenant is held
        // at its cap), as the ticket says.
        let waited_in_line = ticket.did_wait();
        if waited_in_line {
            Counters::add(&c.waited, 1);
        }
        if ticket.is_fail_open() {
            Counters::add(&c.fail_open, 1);
        }
        // Capped keyspaces (they waited) below the rest.
        let lower = waited_in_line && self.levels.enabled;
        let upper = (self.levels.enabled && !lower).then(|| self.levels.enter_upper());
        let done = match req.op {
            Op::Get => {
                Counters::add(&c.gets, 1);
                cpu_counted(&c.ticket_poll_cpu_ns, ticket.run(cpu_counted(&c.thread_cpu_ns, get(ks, c, req.key)))).await
            }
            _ => {
                Counters::add(&c.scans, 1);
                let work = scan(ks, c, req.key, req.count, self.chunk_blocks, lower.then_some(&self.levels));
                cpu_counted(&c.ticket_poll_cpu_ns, ticket.run(cpu_counted(&c.thread_cpu_ns, work))).await
            }
        };
        drop(upper);
        // Admitted work runs to completion (paced to the tenant's share).
        match done {
            Ok(reply) => reply,
            Err(e) => Reply::Error(e.to_string()),
        }
    }
}

/// A request of the keyspace waiting in line for admission, until dropped.
struct InLine<'a>(&'a Counters);

impl<'a> InLine<'a> {
    fn new(c: &'a Counters) -> InLine<'a> {
        c.wait_begins();
        InLine(c)
    }
}

impl Drop for InLine<'_> {
    fn drop(&mut self) {
        self.0.wait_ends();
    }
}

/// Polls `work`, adding the CPU of each poll by the kernel's count of the
/// thread (CLOCK_THREAD_CPUTIME_ID) to `counter`. Inside a ticket's `run`
/// it counts the work under the ticket's tag; around it, the tag's set and
/// restore and the ticket's own bookkeeping too: what the agent charges
/// the keyspace lies between the two.
async fn cpu_counted<F: Future>(counter: &AtomicU64, work: F) -> F::Output {
    let mut work = std::pin::pin!(work);
    std::future::poll_fn(|cx| {
        let t0 = thread_cputime_ns();
        let p = work.as_mut().poll(cx);
        Counters::add(counter, thread_cputime_ns().saturating_sub(t0));
        p
    })
    .await
}

async fn get(ks: &KeyspaceData, c: &Counters, row: u64) -> Result<Reply, StoreError> {
    let value = ks.get(row)?;
    Counters::add(&c.rows_read, 1);
    Ok(Reply::Row(value))
}

async fn scan(
    ks: &KeyspaceData,
    c: &Counters,
    start: u64,
    count: u32,
    chunk_blocks: usize,
    lower: Option<&Levels>,
) -> Result<Reply, StoreError> {
    let mut s = Scan::new(ks, start, u64::from(count));
    loop {
        if let Some(levels) = lower {
            levels.lower_turn().await;
        }
        if s.step(ks, chunk_blocks)? {
            break;
        }
        // Let the worker serve others (and the ticket top up) between steps.
        tokio::task::yield_now().await;
    }
    let summary = s.summary();
    Counters::add(&c.rows_read, summary.rows);
    Ok(Reply::Scanned(summary))
}
