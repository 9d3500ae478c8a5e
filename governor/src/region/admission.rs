//! Atomic mirrors of the admission layouts, and the keyspace directory.

use super::measure::same_layout;
use super::{FIRST_KEYSPACE, RegionError, Table};
use keyspace_governor_common::admission::{
    AgentCell, BucketCell, DIR_EMPTY, DIR_LIVE, HOT_INFLIGHT_US, HOT_SHARDS, KnobsCell, ParamsCell, SLEEP_SLOTS,
    TicketRecord, counter, dir_key, hist, request,
};
use keyspace_governor_common::{HeaderCell, probe_start};
use std::mem::{offset_of, size_of};
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// Atomic mirror of [`HeaderCell`]: the TSC clock mapping.
#[repr(C)]
pub struct ClockView {
    pub clock_seq: AtomicU64,
    pub tsc_base: AtomicU64,
    pub ns_base: AtomicU64,
    pub mult: AtomicU64,
    pub clock_valid: AtomicU64,
    _pad: [u64; 3],
}

/// Atomic mirror of [`AgentCell`].
#[repr(C)]
pub struct AgentView {
    pub instance: AtomicU64,
    pub heartbeat_ns: AtomicU64,
    pub now_ms: AtomicU64,
    pub refills: AtomicU64,
    pub stopping: AtomicU64,
    _pad: [u64; 3],
}

/// Atomic mirror of [`KnobsCell`].
#[repr(C)]
pub struct KnobsView {
    pub flags: AtomicU64,
    pub refill_interval_us: AtomicU64,
    pub default_estimate_us: AtomicU64,
    pub topup_threshold_milli: AtomicU64,
    pub per_allocation_us: AtomicU64,
    pub runtime_check_interval_us: AtomicU64,
    pub pending_write_threshold: AtomicU64,
    pub max_concurrent_per_tenant: AtomicU64,
}

/// Atomic mirror of [`keyspace_governor_common::admission::HeaderPage`].
#[repr(C)]
pub struct HeaderView {
    pub clock: ClockView,
    pub agent: AgentView,
    pub knobs: KnobsView,
}

/// Atomic mirror of [`BucketCell`]. The token operations live in
/// `policy::bucket`.
#[repr(C)]
pub struct BucketView {
    pub tail_us: AtomicU64,
    pub head_us: AtomicU64,
    pub wake_seq: AtomicU32,
    pub sleepers: AtomicU32,
    pub inflight_requests: AtomicU64,
    pub pending_write_bytes: AtomicU64,
    pub last_used_ms: AtomicU64,
    pub burst_budget_us: AtomicI64,
    pub ahead_owed_us: AtomicU64,
    pub hot: [[AtomicU64; 8]; HOT_SHARDS],
    pub counters: [AtomicU64; counter::COUNT],
    pub hist: [AtomicU64; hist::LEN],
    pub request: [[AtomicU64; request::SHARD]; HOT_SHARDS],
    pub sleep_at: [AtomicU64; SLEEP_SLOTS],
    pub unslotted: AtomicU64,
}

thread_local! {
    /// This thread's hot-counter shard, given out round-robin.
    static SHARD: usize = {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        NEXT.fetch_add(1, Ordering::Relaxed) % HOT_SHARDS
    };
}

#[inline]
fn my_shard() -> usize {
    SHARD.try_with(|s| *s).unwrap_or(0)
}

impl BucketView {
    /// Adds `n` to counter `c` (a `counter::*` index).
    #[inline]
    pub fn count(&self, c: usize, n: u64) {
        if c < counter::HOT {
            self.hot[my_shard()][c].fetch_add(n, Ordering::Relaxed);
        } else {
            self.counters[c].fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Counter `c`. `RELEASED` and `CONSUMED_US` add what the request
    /// histograms counted (a release observed there is counted only there,
    /// see [`Self::observe_request`]).
    #[inline]
    pub fn counter(&self, c: usize) -> u64 {
        if c < counter::HOT {
            let hot = self.hot.iter().fold(0u64, |sum, s| sum.wrapping_add(s[c].load(Ordering::Relaxed)));
            let observed = match c {
                counter::RELEASED => request::CPU..request::CPU + request::BUCKETS,
                counter::CONSUMED_US => request::CPU_SUM..request::CPU_SUM + 1,
                _ => return hot,
            };
            self.request.iter().fold(hot, |sum, s| {
                s[observed.clone()].iter().fold(sum, |sum, v| sum.wrapping_add(v.load(Ordering::Relaxed)))
            })
        } else {
            self.counters[c].load(Ordering::Relaxed)
        }
    }

    /// A wait of `waited` ended: counted in histogram `base` ([`hist`]).
    pub fn observe_wait(&self, base: usize, waited: std::time::Duration) {
        let us = u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
        self.hist[base + hist::bucket(us)].fetch_add(1, Ordering::Relaxed);
        self.hist[base + hist::SLOTS - 1].fetch_add(us, Ordering::Relaxed);
    }

    /// A request was released having consumed `consumed_us` against an
    /// estimate of `estimate_us`: counted in this thread group's shard of
    /// the request histograms, which also stand for the release and its CPU
    /// in `RELEASED` and `CONSUMED_US` (the caller counts neither), so a
    /// release pays two atomic adds for the histograms rather than four.
    /// Always inlined: it is most of a release, and the compiler's own
    /// choice moved with unrelated changes (`docs/benchmarks.md`).
    #[inline(always)]
    pub fn observe_request(&self, consumed_us: u64, estimate_us: u64) {
        let h = &self.request[my_shard()];
        h[request::CPU + request::bucket(&request::CPU_BOUNDS_US, consumed_us)].fetch_add(1, Ordering::Relaxed);
        if consumed_us > 0 {
            h[request::CPU_SUM].fetch_add(consumed_us, Ordering::Relaxed);
        }
        let permille = consumed_us.saturating_mul(1000) / estimate_us.max(1);
        h[request::RATIO + request::bucket(&request::RATIO_BOUNDS_PERMILLE, permille)].fetch_add(1, Ordering::Relaxed);
        if permille > 0 {
            h[request::RATIO_SUM].fetch_add(permille, Ordering::Relaxed);
        }
    }

    /// The request histograms, summed over their shards.
    pub fn request_hist(&self) -> [u64; request::LEN] {
        std::array::from_fn(|i| self.request.iter().fold(0u64, |sum, s| sum.wrapping_add(s[i].load(Ordering::Relaxed))))
    }

    /// The wait histograms as they stand.
    pub fn wait_hist(&self) -> [u64; hist::LEN] {
        std::array::from_fn(|i| self.hist[i].load(Ordering::Relaxed))
    }

    /// Every counter, the hot ones summed over their shards.
    pub fn counter_values(&self) -> [u64; counter::COUNT] {
        std::array::from_fn(|c| self.counter(c))
    }

    /// Zeroes every counter (a cell given to a new keyspace).
    pub fn reset_counters(&self) {
        for v in self
            .counters
            .iter()
            .chain(self.hot.iter().flatten())
            .chain(self.hist.iter())
            .chain(self.request.iter().flatten())
        {
            v.store(0, Ordering::Relaxed);
        }
    }

    /// µs taken for tickets not yet released and for threads' spare tokens
    /// ([`crate::policy::Spare`]) (0 if the shards, which other
    /// processes write, add up to less).
    #[inline]
    pub fn inflight_us(&self) -> u64 {
        let sum = self.hot.iter().fold(0u64, |sum, s| sum.wrapping_add(s[HOT_INFLIGHT_US].load(Ordering::Acquire)));
        (sum as i64).max(0) as u64
    }

    #[inline]
    pub fn add_inflight_us(&self, us: u64) {
        self.hot[my_shard()][HOT_INFLIGHT_US].fetch_add(us, Ordering::Relaxed);
    }

    /// Takes `us` off the µs in flight (on this thread's shard, which may go
    /// "negative": only the sum means anything).
    #[inline]
    pub fn sub_inflight_us(&self, us: u64) {
        self.hot[my_shard()][HOT_INFLIGHT_US].fetch_sub(us, Ordering::Relaxed);
    }
}

/// Atomic mirror of [`ParamsCell`].
#[repr(C)]
pub struct ParamsView {
    pub key: AtomicU64,
    pub generation: AtomicU64,
    pub capacity_us: AtomicU64,
    pub refill_us: AtomicU64,
    pub estimate_us: AtomicU64,
    pub max_debt_us: AtomicU64,
    pub flags: AtomicU64,
    _pad: u64,
}

impl KnobsView {
    /// A copy of the knobs; `flags` read with Acquire, so the values the
    /// agent stored before publishing a flag are seen with it.
    #[inline]
    pub fn snapshot(&self) -> KnobsCell {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        KnobsCell {
            flags: self.flags.load(Ordering::Acquire),
            refill_interval_us: l(&self.refill_interval_us),
            default_estimate_us: l(&self.default_estimate_us),
            topup_threshold_milli: l(&self.topup_threshold_milli),
            per_allocation_us: l(&self.per_allocation_us),
            runtime_check_interval_us: l(&self.runtime_check_interval_us),
            pending_write_threshold: l(&self.pending_write_threshold),
            max_concurrent_per_tenant: l(&self.max_concurrent_per_tenant),
        }
    }
}

impl ParamsView {
    /// (directory state, keyspace id).
    #[inline]
    pub fn entry(&self) -> (u32, u32) {
        let k = self.key.load(Ordering::Acquire);
        ((k >> 32) as u32, k as u32)
    }

    #[inline]
    pub fn has(&self, flag: u64) -> bool {
        self.flags.load(Ordering::Relaxed) & flag != 0
    }
}

/// Atomic mirror of [`TicketRecord`].
#[repr(C)]
pub struct TicketView {
    pub state: AtomicU32,
    pub cell: AtomicU32,
    pub generation: AtomicU64,
    pub tenant_us: AtomicU64,
    pub global_us: AtomicU64,
    pub burst_us: AtomicU64,
    pub write_bytes: AtomicU64,
    pub flags: AtomicU64,
    pub consumed_ns: AtomicU64,
}

same_layout!(ClockView, HeaderCell, clock_seq, tsc_base, ns_base, mult, clock_valid);
same_layout!(AgentView, AgentCell, instance, heartbeat_ns, now_ms, refills, stopping);
same_layout!(
    KnobsView,
    KnobsCell,
    flags,
    refill_interval_us,
    default_estimate_us,
    topup_threshold_milli,
    per_allocation_us,
    runtime_check_interval_us,
    pending_write_threshold,
    max_concurrent_per_tenant
);
same_layout!(HeaderView, keyspace_governor_common::admission::HeaderPage, clock, agent, knobs);
same_layout!(
    BucketView,
    BucketCell,
    tail_us,
    head_us,
    wake_seq,
    sleepers,
    inflight_requests,
    pending_write_bytes,
    last_used_ms,
    burst_budget_us,
    ahead_owed_us,
    hot,
    counters,
    hist,
    request,
    sleep_at,
    unslotted
);
same_layout!(ParamsView, ParamsCell, key, generation, capacity_us, refill_us, estimate_us, max_debt_us, flags);
same_layout!(
    TicketView,
    TicketRecord,
    state,
    cell,
    generation,
    tenant_us,
    global_us,
    burst_us,
    write_bytes,
    flags,
    consumed_ns
);

/// The keyspace directory: open addressing on the keyspace id over the
/// parameter region's keys (entry `c + FIRST_KEYSPACE` names keyspace cell
/// `c`). Only the
/// agent inserts and evicts; anyone may look up. Probes stop at an empty
/// entry and never visit more than the table, so a lookup is bounded
/// whatever the memory holds.
pub struct Directory<'a> {
    params: &'a Table<ParamsView>,
    len: u32,
}

impl<'a> Directory<'a> {
    pub fn new(params: &'a Table<ParamsView>) -> Self {
        Directory { params, len: params.len().saturating_sub(FIRST_KEYSPACE) }
    }

    /// Keyspace cells in the table.
    pub fn len(&self) -> u32 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline]
    fn entry(&self, cell: u32) -> &'a ParamsView {
        self.params.get(cell + FIRST_KEYSPACE).expect("cell masked to the table")
    }

    /// The cell of `keyspace_id`, if present.
    #[inline]
    pub fn find(&self, keyspace_id: u32) -> Option<super::CellRef> {
        if self.len == 0 {
            return None;
        }
        let mask = self.len - 1;
        let mut c = probe_start(keyspace_id, self.len);
        for _ in 0..self.len {
            let p = self.entry(c);
            match p.entry() {
                (DIR_EMPTY, _) => return None,
                (DIR_LIVE, id) if id == keyspace_id => {
                    return Some(super::CellRef { index: c, generation: p.generation.load(Ordering::Acquire) });
                }
                _ => {}
            }
            c = (c + 1) & mask;
        }
        None
    }

    /// Agent only: the cell of `keyspace_id`, giving it a free one (the
    /// first empty or evicted entry on its probe path) when absent. `init`
    /// (given the cell and its parameters) prepares it before the entry
    /// becomes visible: a client can find it and count into it from then on.
    /// Returns (cell, generation, inserted).
    pub fn insert(
        &self,
        keyspace_id: u32,
        init: impl FnOnce(u32, &ParamsView),
    ) -> Result<(u32, u64, bool), RegionError> {
        if let Some(super::CellRef { index: c, generation: g }) = self.find(keyspace_id) {
            return Ok((c, g, false));
        }
        let mask = self.len.checked_sub(1).ok_or(RegionError::KeyspaceTableFull { capacity: 0 })?;
        let mut c = probe_start(keyspace_id, self.len);
        for _ in 0..self.len {
            let p = self.entry(c);
            if p.entry().0 != DIR_LIVE {
                let generation = p.generation.load(Ordering::Relaxed) + 1;
                p.generation.store(generation, Ordering::Relaxed);
                init(c, p);
                p.key.store(dir_key(keyspace_id, DIR_LIVE), Ordering::Release);
                return Ok((c, generation, true));
            }
            c = (c + 1) & mask;
        }
        Err(RegionError::KeyspaceTableFull { capacity: self.len })
    }

    /// Agent only: takes `cell` from its keyspace; lookups skip it from now on
    /// and a later insert may reuse it.
    pub fn evict(&self, cell: u32) {
        if cell < self.len {
            let p = self.entry(cell);
            let (_, id) = p.entry();
            p.flags.store(0, Ordering::Relaxed);
            p.key.store(dir_key(id, keyspace_governor_common::admission::DIR_TOMBSTONE), Ordering::Release);
        }
    }

    /// Every live entry: (keyspace id, cell).
    pub fn live(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        (0..self.len).filter_map(move |c| match self.entry(c).entry() {
            (DIR_LIVE, id) => Some((id, c)),
            _ => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn params(cells: u32) -> (std::os::fd::OwnedFd, Table<ParamsView>) {
        let fd = crate::sys::memfd("params", (cells + FIRST_KEYSPACE) as usize * 64).unwrap();
        let t = Table::map("parameter", fd.as_raw_fd(), cells + FIRST_KEYSPACE).unwrap();
        (fd, t)
    }

    #[test]
    fn insert_find_evict_and_reuse() {
        let (_fd, t) = params(256);
        let d = Directory::new(&t);
        let mut cells = std::collections::HashSet::new();
        for id in 0..200u32 {
            let (c, g, new) = d.insert(id * 7, |_, p| p.capacity_us.store(id as u64, Ordering::Relaxed)).unwrap();
            assert!(new && g == 1 && cells.insert(c), "cell {c} handed out twice");
        }
        assert_eq!(d.live().count(), 200);
        let c = d.find(14).unwrap().index;
        assert_eq!(t.get(c + FIRST_KEYSPACE).unwrap().capacity_us.load(Ordering::Relaxed), 2);
        assert_eq!(d.insert(14, |_, _| panic!("no init for a present keyspace")).unwrap(), (c, 1, false));
        d.evict(c);
        assert_eq!(d.find(14), None);
        // Keyspaces probing past the evicted entry are still found.
        assert!((0..200u32).filter(|id| *id != 2).all(|id| d.find(id * 7).is_some()));
        let (c2, g2, new) = d.insert(14, |_, _| {}).unwrap();
        assert!(new && c2 == c && g2 == 2, "the evicted cell is reused with a new generation");
    }

    #[test]
    fn a_full_table_is_a_typed_error_and_garbage_keys_cannot_hang_a_lookup() {
        let (_fd, t) = params(8);
        let d = Directory::new(&t);
        for id in 0..8 {
            d.insert(id, |_, _| {}).unwrap();
        }
        assert!(matches!(d.insert(99, |_, _| {}), Err(RegionError::KeyspaceTableFull { capacity: 8 })));
        // Every entry live under foreign ids: a lookup still ends.
        for c in 0..8 {
            t.get(c + FIRST_KEYSPACE).unwrap().key.store(dir_key(1000 + c, 77), Ordering::Relaxed);
        }
        assert_eq!(d.find(5), None);
    }
}
