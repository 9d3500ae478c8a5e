//! The server's per-keyspace counters: plain atomics bumped on the request
//! path, read whole by a `stats` request.

use governor_reader::proto::{KeyspaceStats, ServerStats};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// One keyspace's counters (see [`KeyspaceStats`] for what each means).
#[derive(Default)]
pub struct Counters {
    pub gets: AtomicU64,
    pub scans: AtomicU64,
    pub rows_read: AtomicU64,
    pub waited: AtomicU64,
    pub wait_us: AtomicU64,
    pub thread_cpu_ns: AtomicU64,
    pub ticket_poll_cpu_ns: AtomicU64,
    pub fail_open: AtomicU64,
    /// Busy replies by code; refusals are the slow path, a lock is fine.
    busy: Mutex<BTreeMap<&'static str, u64>>,
    /// Requests waiting for admission now, since when one has, and the
    /// time with at least one before that (waits are the slow path too).
    waiting: Mutex<Waiting>,
}

#[derive(Default)]
struct Waiting {
    now: u32,
    since: Option<Instant>,
    total_us: u64,
}

impl Waiting {
    fn total_us(&self, at: Instant) -> u64 {
        self.total_us + self.since.map_or(0, |s| (at - s).as_micros() as u64)
    }
}

impl Counters {
    pub fn add(c: &AtomicU64, v: u64) {
        c.fetch_add(v, Ordering::Relaxed);
    }

    pub fn busy(&self, code: &'static str) {
        *self.busy.lock().unwrap_or_else(|p| p.into_inner()).entry(code).or_default() += 1;
    }

    /// A request of the keyspace starts waiting for admission.
    pub fn wait_begins(&self) {
        let mut w = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        w.now += 1;
        if w.now == 1 {
            w.since = Some(Instant::now());
        }
    }

    /// A request that waited is admitted or refused.
    pub fn wait_ends(&self) {
        let mut w = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        w.now -= 1;
        if w.now == 0 {
            let at = Instant::now();
            w.total_us = w.total_us(at);
            w.since = None;
        }
    }

    fn snapshot(&self) -> KeyspaceStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        KeyspaceStats {
            gets: get(&self.gets),
            scans: get(&self.scans),
            rows_read: get(&self.rows_read),
            busy: self
                .busy
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect(),
            waited: get(&self.waited),
            wait_us: get(&self.wait_us),
            thread_cpu_ns: get(&self.thread_cpu_ns),
            ticket_poll_cpu_ns: get(&self.ticket_poll_cpu_ns),
            fail_open: get(&self.fail_open),
            waiting_us: self.waiting.lock().unwrap_or_else(|p| p.into_inner()).total_us(Instant::now()),
        }
    }
}

/// Counters of every keyspace the server holds (fixed at start).
pub struct Stats {
    keyspaces: BTreeMap<u32, Counters>,
}

impl Stats {
    pub fn new(keyspaces: impl IntoIterator<Item = u32>) -> Stats {
        Stats { keyspaces: keyspaces.into_iter().map(|k| (k, Counters::default())).collect() }
    }

    pub fn keyspace(&self, id: u32) -> Option<&Counters> {
        self.keyspaces.get(&id)
    }

    pub fn snapshot(&self, client: &keyspace_governor::client::Client, workers: usize) -> ServerStats {
        ServerStats {
            workers,
            attachments: client.attachments(),
            attached: client.attached(),
            keyspaces: self.keyspaces.iter().map(|(k, c)| (*k, c.snapshot())).collect(),
            ..ServerStats::default()
        }
    }
}
