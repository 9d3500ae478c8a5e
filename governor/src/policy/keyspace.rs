//! One keyspace's policy state: its bucket plus the atomics the agent publishes to the fast path
//! (estimate, burst flag, ratio) and the counters the fast path feeds back (requests, consumption,
//! refusals by reason). Everything is an atomic so allocate/release never take a lock.

use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};

use dashmap::DashMap;
use serde::Serialize;

use super::bucket::BucketCell;

/// Multiplicative hash for `u32` keyspace ids: one multiply, no SipHash on the fast path.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn write_u32(&mut self, v: u32) {
        self.0 = (v as u64 ^ 0x9e37_79b9).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// Resolution of `last_used_us`, µs (1 ms).
pub const TOUCH_GRANULARITY_US: u64 = 1_000;

/// Keyspace id → entry. One lookup per allocate; grants keep the `Arc`, so release needs none.
pub type KeyspaceTable = DashMap<u32, Arc<KeyspaceEntry>, BuildHasherDefault<IdHasher>>;

/// Where a keyspace's quota comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QuotaSource {
    /// `keyspace-cpu-quotas` in the static configuration.
    Config,
    /// Proportional share of PD service limits.
    Pd,
    /// Auto-created on first request in tenant-cap mode (uniform cap).
    TenantCap,
}

impl QuotaSource {
    fn to_u8(self) -> u8 {
        match self {
            QuotaSource::Config => 0,
            QuotaSource::Pd => 1,
            QuotaSource::TenantCap => 2,
        }
    }
    fn from_u8(v: u8) -> Self {
        match v {
            1 => QuotaSource::Pd,
            2 => QuotaSource::TenantCap,
            _ => QuotaSource::Config,
        }
    }
}

/// Per-keyspace counters, by outcome.
#[derive(Debug, Default)]
pub struct KeyspaceCounters {
    pub granted: AtomicU64,
    pub refused_keyspace: AtomicU64,
    pub refused_global: AtomicU64,
    pub burst_granted: AtomicU64,
    pub burst_tokens_us: AtomicU64,
    pub topups_granted: AtomicU64,
    pub topups_refused: AtomicU64,
    pub fair_allocations: AtomicU64,
    /// Estimated µs asked for by allocate calls (granted or not): the demand signal.
    pub demand_us: AtomicU64,
    /// Measured µs of released requests.
    pub consumed_us: AtomicU64,
    /// Released requests (denominator of the adaptive estimate).
    pub released: AtomicU64,
}

/// A keyspace's bucket and published state.
#[derive(Debug)]
pub struct KeyspaceEntry {
    id: u32,
    pub(crate) bucket: BucketCell,
    source: AtomicU8,
    /// Current per-request estimate, µs (static, override or EMA).
    estimate_us: AtomicU64,
    /// Per-keyspace `keyspace-burst-enabled`.
    burst_enabled: AtomicBool,
    /// Published each stats interval: burst conditions hold for this keyspace.
    burst_allowed: AtomicBool,
    /// Keyspace ratio of the monitor window (f64 bits).
    ratio_bits: AtomicU64,
    /// Last allocate call, µs of the simulated clock (idle eviction).
    last_used_us: AtomicU64,
    pub(crate) counters: KeyspaceCounters,
}

impl KeyspaceEntry {
    pub(crate) fn new(
        id: u32,
        source: QuotaSource,
        refill_us: u64,
        capacity_us: u64,
        estimate_us: u64,
        burst_enabled: bool,
        now_us: u64,
    ) -> Self {
        KeyspaceEntry {
            id,
            bucket: BucketCell::new(refill_us, capacity_us),
            source: AtomicU8::new(source.to_u8()),
            estimate_us: AtomicU64::new(estimate_us),
            burst_enabled: AtomicBool::new(burst_enabled),
            burst_allowed: AtomicBool::new(false),
            ratio_bits: AtomicU64::new(0f64.to_bits()),
            last_used_us: AtomicU64::new(now_us),
            counters: KeyspaceCounters::default(),
        }
    }

    pub fn id(&self) -> u32 {
        self.id
    }
    pub fn bucket(&self) -> &BucketCell {
        &self.bucket
    }
    pub fn source(&self) -> QuotaSource {
        QuotaSource::from_u8(self.source.load(Ordering::Acquire))
    }
    pub(crate) fn set_source(&self, s: QuotaSource) {
        self.source.store(s.to_u8(), Ordering::Release);
    }
    pub fn estimate_us(&self) -> u64 {
        self.estimate_us.load(Ordering::Relaxed)
    }
    pub(crate) fn set_estimate_us(&self, v: u64) {
        self.estimate_us.store(v.max(1), Ordering::Relaxed);
    }
    pub fn burst_enabled(&self) -> bool {
        self.burst_enabled.load(Ordering::Relaxed)
    }
    pub(crate) fn set_burst_enabled(&self, v: bool) {
        self.burst_enabled.store(v, Ordering::Relaxed);
    }
    pub fn burst_allowed(&self) -> bool {
        self.burst_allowed.load(Ordering::Relaxed)
    }
    pub(crate) fn set_burst_allowed(&self, v: bool) {
        self.burst_allowed.store(v, Ordering::Relaxed);
    }
    pub fn ratio(&self) -> f64 {
        f64::from_bits(self.ratio_bits.load(Ordering::Relaxed))
    }
    pub(crate) fn set_ratio(&self, r: f64) {
        self.ratio_bits.store(r.to_bits(), Ordering::Relaxed);
    }
    pub fn last_used_us(&self) -> u64 {
        self.last_used_us.load(Ordering::Relaxed)
    }
    /// Records use at `now_us`. Only idle eviction (TTL of minutes) reads it, so it is written
    /// at most once per [`TOUCH_GRANULARITY_US`] to keep a shared store off the fast path.
    pub(crate) fn touch(&self, now_us: u64) {
        if self
            .last_used_us
            .load(Ordering::Relaxed)
            .saturating_add(TOUCH_GRANULARITY_US)
            <= now_us
        {
            self.last_used_us.fetch_max(now_us, Ordering::Relaxed);
        }
    }
    pub fn counters(&self) -> &KeyspaceCounters {
        &self.counters
    }
}
