//! What the fast path hands out ([`Grant`]) and the node-wide counters by outcome.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use super::keyspace::KeyspaceEntry;

/// Tokens granted to one request. Not `Clone`: give it back exactly once with
/// [`Policy::release`](super::Policy::release). Holds the keyspace entry, so release needs no
/// lookup and still settles correctly if the keyspace was evicted meanwhile.
#[derive(Debug)]
#[must_use = "a grant must be released with Policy::release"]
pub struct Grant {
    pub(crate) keyspace: u32,
    pub(crate) entry: Option<Arc<KeyspaceEntry>>,
    /// Taken from the keyspace (tenant) bucket, µs.
    pub(crate) tenant_us: u64,
    /// Taken from the global bucket, µs (= tenant_us + burst_us).
    pub(crate) global_us: u64,
    /// Part of `global_us` taken by bursting (global only, no tenant tokens), µs.
    pub(crate) burst_us: u64,
    /// Taken from the low-priority DAG bucket, µs.
    pub(crate) low_priority_us: u64,
}

impl Grant {
    pub(crate) fn skip(keyspace: u32) -> Self {
        Grant {
            keyspace,
            entry: None,
            tenant_us: 0,
            global_us: 0,
            burst_us: 0,
            low_priority_us: 0,
        }
    }

    pub fn keyspace(&self) -> u32 {
        self.keyspace
    }
    /// Legacy skip-throttle: the keyspace has no bucket and nothing was taken.
    pub fn is_skip(&self) -> bool {
        self.entry.is_none() && self.global_us == 0
    }
    /// The request was admitted (at least partly) by bursting on global tokens.
    pub fn is_burst(&self) -> bool {
        self.burst_us > 0
    }
    /// Total µs this request holds (initial estimate plus top-ups).
    pub fn granted_us(&self) -> u64 {
        self.global_us.max(self.tenant_us)
    }
    pub fn tenant_us(&self) -> u64 {
        self.tenant_us
    }
    pub fn global_us(&self) -> u64 {
        self.global_us
    }
    pub fn low_priority_us(&self) -> u64 {
        self.low_priority_us
    }
    /// Runtime token management: should the caller top up now? (`consumed > threshold × granted`)
    pub fn needs_top_up(&self, consumed_us: u64, additional_allocation_threshold: f64) -> bool {
        !self.is_skip()
            && consumed_us as f64 > additional_allocation_threshold * self.granted_us() as f64
    }
}

/// Node-wide counters by outcome; the `reason` labels of the allocation metrics.
#[derive(Debug, Default)]
pub struct PolicyCounters {
    pub granted: AtomicU64,
    pub skipped: AtomicU64,
    pub burst_granted: AtomicU64,
    pub tenant_cap_exhausted: AtomicU64,
    pub keyspace_exhausted: AtomicU64,
    pub global_exhausted: AtomicU64,
    pub low_priority_exhausted: AtomicU64,
    /// Best-effort mode: global bucket overdrawn instead of refusing.
    pub global_best_effort_overdraft: AtomicU64,
    pub topup_granted: AtomicU64,
    pub topup_refused: AtomicU64,
    pub cap_buckets_created: AtomicU64,
    pub cap_buckets_evicted: AtomicU64,
    pub released: AtomicU64,
}

/// Plain copy of [`PolicyCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PolicyCountersSnapshot {
    pub granted: u64,
    pub skipped: u64,
    pub burst_granted: u64,
    pub tenant_cap_exhausted: u64,
    pub keyspace_exhausted: u64,
    pub global_exhausted: u64,
    pub low_priority_exhausted: u64,
    pub global_best_effort_overdraft: u64,
    pub topup_granted: u64,
    pub topup_refused: u64,
    pub cap_buckets_created: u64,
    pub cap_buckets_evicted: u64,
    pub released: u64,
}

impl PolicyCounters {
    pub(crate) fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> PolicyCountersSnapshot {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        PolicyCountersSnapshot {
            granted: l(&self.granted),
            skipped: l(&self.skipped),
            burst_granted: l(&self.burst_granted),
            tenant_cap_exhausted: l(&self.tenant_cap_exhausted),
            keyspace_exhausted: l(&self.keyspace_exhausted),
            global_exhausted: l(&self.global_exhausted),
            low_priority_exhausted: l(&self.low_priority_exhausted),
            global_best_effort_overdraft: l(&self.global_best_effort_overdraft),
            topup_granted: l(&self.topup_granted),
            topup_refused: l(&self.topup_refused),
            cap_buckets_created: l(&self.cap_buckets_created),
            cap_buckets_evicted: l(&self.cap_buckets_evicted),
            released: l(&self.released),
        }
    }
}
