//! The server's per-keyspace counters: plain atomics bumped on the request
//! path, read whole by a `stats` request.

use governor_reader::proto::{KeyspaceStats, ServerStats};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// One keyspace's counters (see [`KeyspaceStats`] for what each means).
#[derive(Default)]
pub struct Counters {
    pub gets: AtomicU64,
    pub scans: AtomicU64,
    pub rows_read: AtomicU64,
    pub waited: AtomicU64,
    pub wait_us: AtomicU64,
    pub thread_cpu_ns: AtomicU64,
    pub fail_open: AtomicU64,
    /// Busy replies by code; refusals are the slow path, a lock is fine.
    busy: Mutex<BTreeMap<&'static str, u64>>,
}

impl Counters {
    pub fn add(c: &AtomicU64, v: u64) {
        c.fetch_add(v, Ordering::Relaxed);
    }

    pub fn busy(&self, code: &'static str) {
        *self.busy.lock().unwrap_or_else(|p| p.into_inner()).entry(code).or_default() += 1;
    }

    fn snapshot(&self) -> KeyspaceStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        KeyspaceStats {
            gets: get(&self.gets),
            scans: get(&self.scans),
            rows_read: get(&self.rows_read),
            busy: self.busy.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            waited: get(&self.waited),
            wait_us: get(&self.wait_us),
            thread_cpu_ns: get(&self.thread_cpu_ns),
            fail_open: get(&self.fail_open),
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

    pub fn snapshot(&self, client: &governor::client::Client, workers: usize) -> ServerStats {
        ServerStats {
            workers,
            attachments: client.attachments(),
            attached: client.attached(),
            keyspaces: self.keyspaces.iter().map(|(k, c)| (*k, c.snapshot())).collect(),
        }
    }
}
