//! One keyspace cell as the agent keeps it: where its quota comes from, its
//! rates, its debt mode, what it last published; and the read-only views of
//! a bucket ([`BucketSnapshot`]) and a keyspace ([`KeyspaceEntry`]) handed to
//! status, metrics and tests.

use keyspace_governor_common::admission::counter as c;
use serde::Serialize;

use crate::region::BucketView;

/// Where a keyspace's quota comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QuotaSource {
    /// `keyspace-cpu-quotas` in the static configuration.
    Config,
    /// Proportional share of PD service limits.
    Pd,
    /// Uniform tenant cap, given on first use in tenant-cap mode.
    TenantCap,
}

/// The agent's record of one bucket: its rates and what it added and
/// dropped (the clients' side is in the shared cell's counters).
#[derive(Debug, Clone, Default)]
pub struct BucketBook {
    /// Tokens per refill interval from the quota source, µs.
    pub base_refill_us: u64,
    /// Tokens per refill interval now (after dynamic or fair adjustment), µs.
    pub refill_us: u64,
    pub capacity_us: u64,
    pub max_debt_us: u64,
    /// A quota shrink left more in flight than the new quota: no refill
    /// until it drains.
    pub debt_mode: bool,
    /// Tokens the agent added (fills and refills, before clamping), µs.
    pub refilled_us: u64,
    /// Tokens the agent dropped (capacity clamps, shrinks), µs.
    pub discarded_us: u64,
    /// The bucket's `tail_us` when this holder got the cell.
    pub tail_base_us: u64,
}

/// The agent's record of one keyspace cell.
#[derive(Debug, Clone)]
pub struct KeyspaceState {
    pub id: u32,
    pub generation: u64,
    /// `None`: the cell serves measurement and request limits only; the
    /// keyspace passes the CPU check unthrottled.
    pub source: Option<QuotaSource>,
    pub book: BucketBook,
    pub estimate_us: u64,
    pub burst_enabled: bool,
    pub burst_allowed: bool,
    /// Keyspace ratio of the monitor window.
    pub ratio: f64,
    pub fair_allocations: u64,
    /// Last use the agent saw (an acquire, or CPU charged), µs.
    pub last_used_us: u64,
    /// The latency guard's factor on its refill (1: untouched).
    pub guard_factor: f64,
    /// A tenant-capped keyspace's refill correction toward its CPU.
    pub follow: super::follow::CpuFollow,
}

/// A plain copy of one bucket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct BucketSnapshot {
    pub available_us: i64,
    pub capacity_us: i64,
    pub refill_us: u64,
    pub base_refill_us: u64,
    pub inflight_us: u64,
    pub in_debt: bool,
    pub taken_total_us: u64,
    pub refunded_total_us: u64,
    pub debt_total_us: u64,
    pub refilled_total_us: u64,
    pub discarded_total_us: u64,
    pub refused_total: u64,
}

impl BucketSnapshot {
    /// Reads the shared cell with the agent's record of it.
    pub fn of(b: &BucketView, book: &BucketBook) -> BucketSnapshot {
        let tail = b.tail_us.load(std::sync::atomic::Ordering::Acquire);
        let head = b.head_us.load(std::sync::atomic::Ordering::Acquire);
        let debt = b.counter(c::DEBT_US);
        // Top-ups taken ahead of the line, and the part of them paid back
        // from refills and refunds (which the head never saw).
        let ahead = b.counter(c::AHEAD_US);
        let paid = ahead.wrapping_sub(b.ahead_owed_us.load(std::sync::atomic::Ordering::Acquire));
        // The head moves by what the agent added and dropped and by refunds
        // (kept part); the rovers started equal at `tail_base_us`.
        let refunded = head
            .wrapping_sub(book.tail_base_us)
            .wrapping_sub(book.refilled_us)
            .wrapping_add(book.discarded_us)
            .wrapping_add(b.counter(c::DISCARDED_US))
            .wrapping_add(paid);
        BucketSnapshot {
            available_us: b.available_us(),
            capacity_us: i64::try_from(book.capacity_us).unwrap_or(i64::MAX),
            refill_us: book.refill_us,
            base_refill_us: book.base_refill_us,
            inflight_us: b.inflight_us(),
            in_debt: book.debt_mode,
            taken_total_us: tail.wrapping_sub(book.tail_base_us).wrapping_sub(debt).wrapping_add(ahead),
            refunded_total_us: refunded,
            debt_total_us: debt,
            refilled_total_us: book.refilled_us,
            discarded_total_us: book.discarded_us + b.counter(c::DISCARDED_US),
            refused_total: [c::REFUSED_CAP, c::REFUSED_QUOTA, c::REFUSED_GLOBAL].iter().map(|&i| b.counter(i)).sum(),
        }
    }

    /// `refilled − taken + refunded − debt − discarded`; equals `available_us`
    /// when every token movement was recorded.
    pub fn ledger_available_us(&self) -> i64 {
        (self.refilled_total_us as i64)
            .wrapping_sub(self.taken_total_us as i64)
            .wrapping_add(self.refunded_total_us as i64)
            .wrapping_sub(self.debt_total_us as i64)
            .wrapping_sub(self.discarded_total_us as i64)
    }

    // Accessors named as the fields, so a snapshot reads like a bucket.
    pub fn available_us(&self) -> i64 {
        self.available_us
    }
    pub fn capacity_us(&self) -> i64 {
        self.capacity_us
    }
    pub fn refill_us(&self) -> u64 {
        self.refill_us
    }
    pub fn base_refill_us(&self) -> u64 {
        self.base_refill_us
    }
    pub fn inflight_us(&self) -> u64 {
        self.inflight_us
    }
    pub fn in_debt(&self) -> bool {
        self.in_debt
    }
    pub fn snapshot(&self) -> BucketSnapshot {
        *self
    }
}

/// Counters of one keyspace, by outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct KeyspaceCounters {
    pub granted: u64,
    pub refused_keyspace: u64,
    pub refused_global: u64,
    pub refused_write: u64,
    pub refused_concurrency: u64,
    pub monitor_breaches: u64,
    pub burst_granted: u64,
    pub burst_tokens_us: u64,
    pub topups_granted: u64,
    pub topups_refused: u64,
    pub consumed_us: u64,
    pub released: u64,
    pub demand_us: u64,
    /// Admissions that waited in line, and how long in all.
    pub waited: u64,
    pub wait_us: u64,
    /// Running requests' waits for a top-up at a checkpoint (pacing), and
    /// how long in all.
    pub topups_waited: u64,
    pub topup_wait_us: u64,
    pub fail_open: u64,
    pub debt_forgiven_us: u64,
    pub reclaimed: u64,
    /// Thread-pool rejections the server reported (not admission refusals).
    pub pool_rejected: u64,
    /// How long acquires waited, by result (`admission::hist`).
    pub wait_hist: WaitHistograms,
    /// What released requests consumed (`admission::request`).
    pub request_hist: RequestHistograms,
}

/// A bucket's histogram counters as read: its wait histograms
/// (`admission::hist`) or its request histograms (`admission::request`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts<const N: usize>(pub [u64; N]);

/// How long acquires waited, by result.
pub type WaitHistograms = Counts<{ keyspace_governor_common::admission::hist::LEN }>;
/// What released requests consumed, and against their estimates.
pub type RequestHistograms = Counts<{ keyspace_governor_common::admission::request::LEN }>;

impl<const N: usize> Default for Counts<N> {
    fn default() -> Self {
        Counts([0; N])
    }
}

impl<const N: usize> Serialize for Counts<N> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.as_slice().serialize(s)
    }
}

impl<const N: usize> Counts<N> {
    /// Adds `o`'s counts (folding keyspaces together).
    pub fn add(&mut self, o: &Counts<N>) {
        for (a, b) in self.0.iter_mut().zip(o.0.iter()) {
            *a = a.wrapping_add(*b);
        }
    }
}

impl KeyspaceCounters {
    pub fn of(b: &BucketView) -> KeyspaceCounters {
        KeyspaceCounters {
            granted: b.counter(c::GRANTED),
            refused_keyspace: b.counter(c::REFUSED_CAP) + b.counter(c::REFUSED_QUOTA),
            refused_global: b.counter(c::REFUSED_GLOBAL),
            refused_write: b.counter(c::REFUSED_WRITE_KEYSPACE) + b.counter(c::REFUSED_WRITE_GLOBAL),
            refused_concurrency: b.counter(c::REFUSED_CONCURRENCY),
            monitor_breaches: b.counter(c::MONITOR_BREACHES),
            burst_granted: b.counter(c::BURST_GRANTED),
            burst_tokens_us: b.counter(c::BURST_US),
            topups_granted: b.counter(c::TOPUP_GRANTED),
            topups_refused: b.counter(c::TOPUP_REFUSED),
            consumed_us: b.counter(c::CONSUMED_US),
            released: b.counter(c::RELEASED),
            demand_us: b.counter(c::DEMAND_US),
            waited: b.counter(c::WAITED),
            wait_us: b.counter(c::WAIT_US),
            topups_waited: b.counter(c::TOPUP_WAITED),
            topup_wait_us: b.counter(c::TOPUP_WAIT_US),
            fail_open: b.counter(c::FAIL_OPEN),
            debt_forgiven_us: b.counter(c::DEBT_FORGIVEN_US),
            reclaimed: b.counter(c::RECLAIMED),
            pool_rejected: b.counter(c::POOL_REJECTED),
            wait_hist: Counts(b.wait_hist()),
            request_hist: Counts(b.request_hist()),
        }
    }
}

/// A keyspace with a bucket, as of the moment it was read.
#[derive(Debug, Clone)]
pub struct KeyspaceEntry {
    pub(crate) state: KeyspaceState,
    pub(crate) cell: u32,
    pub(crate) bucket: BucketSnapshot,
    pub(crate) counters: KeyspaceCounters,
}

impl KeyspaceEntry {
    pub(crate) fn read(state: &KeyspaceState, cell: u32, b: &BucketView) -> KeyspaceEntry {
        KeyspaceEntry {
            state: state.clone(),
            cell,
            bucket: BucketSnapshot::of(b, &state.book),
            counters: KeyspaceCounters::of(b),
        }
    }

    pub fn id(&self) -> u32 {
        self.state.id
    }
    pub fn cell(&self) -> u32 {
        self.cell
    }
    pub fn source(&self) -> QuotaSource {
        self.state.source.unwrap_or(QuotaSource::Config)
    }
    pub fn bucket(&self) -> &BucketSnapshot {
        &self.bucket
    }
    pub fn estimate_us(&self) -> u64 {
        self.state.estimate_us
    }
    pub fn burst_enabled(&self) -> bool {
        self.state.burst_enabled
    }
    pub fn burst_allowed(&self) -> bool {
        self.state.burst_allowed
    }
    pub fn ratio(&self) -> f64 {
        self.state.ratio
    }
    pub fn last_used_us(&self) -> u64 {
        self.state.last_used_us
    }
    pub fn counters(&self) -> &KeyspaceCounters {
        &self.counters
    }
    pub fn fair_allocations(&self) -> u64 {
        self.state.fair_allocations
    }
}
