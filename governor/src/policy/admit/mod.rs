//! The admission fast path: the checks a ticket passes, run by whoever asks
//! (a client process, or the agent's own `Policy`) directly on the
//! shared regions. No lock, no allocation, no syscall, no clock read.
//!
//! Order (cheapest refusal first, nothing held when refused): the tenant's
//! concurrency (tenant-admission-control.md), pending write bytes, global
//! then keyspace (keyspace-write-quota.md), then CPU tokens: the
//! low-priority DAG bucket when asked, the keyspace (tenant) bucket, then the
//! global bucket with rollback of the tenant tokens when it refuses; a
//! quota'd keyspace whose bucket is empty may burst on global tokens, never
//! in tenant-cap mode (tenant-cpu-cap.md §3.2).
//!
//! - `checks` — the checks that never wait (concurrency, write bytes, the
//!   estimate, CPU tokens) and what undoes them;
//! - `queue` — a request waiting in line for CPU tokens;
//! - `release` — closing a grant: refunds, debt, spare tokens.

mod checks;
mod queue;
mod release;

use checks::{Prep, estimate_of, finish, prepare, take_cpu, take_global_only, touch, undo};
pub use queue::{Progress, Queued, acquire_queued, top_up_queued};
pub use release::{release, release_with};

use super::error::Refusal;
use super::spare::Spare;
use crate::region::{AdmissionRegions, BucketView, CellRef, GLOBAL, ParamsView};
// (FIRST_KEYSPACE is named in full where a bucket index is computed.)
use keyspace_governor_common::admission::{
    DIR_LIVE, KNOB_ADMISSION_ENFORCED, KNOB_ADMISSION_MONITOR, KNOB_ENABLED, KNOB_THROTTLE, KNOB_TRACK_DEMAND,
    P_THROTTLED, counter as c,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Per-keyspace pending-write threshold as a share of the global one.
pub const KEYSPACE_PENDING_WRITE_RATIO: f64 = 0.3;

/// The settings the fast path reads, copied from the header once per call
/// (`crate::region::KnobsView::snapshot`).
pub use keyspace_governor_common::admission::KnobsCell as Knobs;

/// What a request asks for: what the fast path checks (CPU estimate,
/// write bytes, the low-priority bucket) and how long the client waits in
/// line for it. One type from a server's `acquire` to the policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Demand {
    /// CPU µs it expects; `None`: the keyspace's published estimate.
    pub estimate_us: Option<u64>,
    /// Write bytes it holds pending until the ticket drops.
    pub write_bytes: u64,
    /// Wait in line for admission until then; `None`: do not wait. It
    /// bounds admission only: admitted work is paced, not cut off (unless
    /// run with [`crate::client::Ticket::run_until_deadline`]).
    pub deadline: Option<Instant>,
    /// A low-priority DAG request (passes the low-priority bucket first when
    /// `low-priority-dag-global-enabled`).
    pub low_priority: bool,
    /// The request's kind in the server's own numbering (0: none given):
    /// its ticket's work carries it, and profiles split by it. Admission
    /// does not look at it.
    pub kind: u8,
}

impl Demand {
    /// The keyspace's published estimate, no write bytes, no wait.
    pub fn new() -> Demand {
        Demand::default()
    }
    /// Expects `us` µs of CPU instead of the keyspace's estimate (the
    /// agent bounds a grant to a tenth of the tenant's bucket).
    pub fn estimate_us(mut self, us: u64) -> Demand {
        self.estimate_us = Some(us);
        self
    }
    /// Holds `bytes` of pending writes until the ticket drops.
    pub fn write_bytes(mut self, bytes: u64) -> Demand {
        self.write_bytes = bytes;
        self
    }
    /// Waits in line for admission until `at`.
    pub fn deadline(mut self, at: Instant) -> Demand {
        self.deadline = Some(at);
        self
    }
    /// Wait at most `d` from now.
    pub fn timeout(mut self, d: Duration) -> Demand {
        self.deadline = Some(Instant::now() + d);
        self
    }
    /// Draws on the low-priority DAG bucket as well.
    pub fn low_priority(mut self) -> Demand {
        self.low_priority = true;
        self
    }
    /// A request of `kind`, in the server's own numbering (get, scan,
    /// write…; 1–255): `governor profile` shows each kind's stacks apart
    /// under its keyspace. It changes nothing of admission or charging.
    pub fn kind(mut self, kind: u8) -> Demand {
        self.kind = kind;
        self
    }
}

/// What one admitted request holds. Plain data: give it back exactly once
/// with [`release`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use = "a grant must be released"]
pub struct Grant {
    pub(crate) keyspace: u32,
    /// Keyspace cell and its generation when granted (as [`Grant::cell_at`]:
    /// two fields, so the keyspace id shares the index's word and a ticket
    /// stays within 128 bytes).
    pub(crate) cell_index: u32,
    /// 0, never a live cell's generation: the keyspace has no cell.
    pub(crate) cell_generation: u64,
    /// Taken from the keyspace (tenant) bucket, µs.
    pub(crate) tenant_us: u64,
    /// Taken from the global bucket, µs (tenant µs plus burst µs).
    pub(crate) global_us: u64,
    /// Part of `global_us` taken by bursting (no tenant tokens), µs.
    pub(crate) burst_us: u64,
    /// Taken from the low-priority DAG bucket, µs.
    pub(crate) low_priority_us: u64,
    pub(crate) write_bytes: u64,
    /// Counted in the tenant's in-flight requests.
    pub(crate) counted: bool,
    /// The request kind its work is tagged with ([`Demand::kind`]): for
    /// profiles; admission does not read it.
    pub(crate) kind: u8,
    /// Passed the CPU check without a bucket (no quota, no cap; or admission
    /// off).
    pub(crate) skipped: bool,
    /// The estimate the request was admitted with, µs (0: none known — a
    /// fail-open ticket, or one reclaimed from a dead client —, and the
    /// release observes no request histogram).
    pub(crate) estimate_us: u64,
}

impl Grant {
    /// Nothing taken yet: the state a grant starts in, and a ticket admitted
    /// without checks (fail-open) keeps.
    pub(crate) fn unchecked(keyspace: u32, cell: Option<CellRef>) -> Grant {
        Grant {
            keyspace,
            cell_index: cell.map_or(0, |c| c.index),
            cell_generation: cell.map_or(0, |c| c.generation),
            tenant_us: 0,
            global_us: 0,
            burst_us: 0,
            low_priority_us: 0,
            write_bytes: 0,
            counted: false,
            kind: 0,
            skipped: true,
            estimate_us: 0,
        }
    }

    pub fn keyspace(&self) -> u32 {
        self.keyspace
    }
    /// Legacy skip-throttle: the keyspace has no bucket and no tokens were taken.
    pub fn is_skip(&self) -> bool {
        self.skipped
    }
    /// Admitted (at least partly) by bursting on global tokens.
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
    pub fn burst_us(&self) -> u64 {
        self.burst_us
    }
    pub fn low_priority_us(&self) -> u64 {
        self.low_priority_us
    }
    pub fn write_bytes(&self) -> u64 {
        self.write_bytes
    }
    pub fn counted(&self) -> bool {
        self.counted
    }
    pub fn cell(&self) -> Option<u32> {
        self.cell_at().map(|c| c.index)
    }

    /// Keyspace cell and its generation when granted, if it had one.
    #[inline]
    pub(crate) fn cell_at(&self) -> Option<CellRef> {
        (self.cell_generation != 0).then_some(CellRef { index: self.cell_index, generation: self.cell_generation })
    }
    /// Runtime token management: should the holder top up now?
    /// (`consumed > threshold × granted`)
    pub fn needs_top_up(&self, consumed_us: u64, threshold_milli: u64) -> bool {
        !self.skipped && consumed_us.saturating_mul(1000) > threshold_milli.saturating_mul(self.granted_us())
    }
}

/// Subtracts `n`, never below zero (a counter another process corrupted
/// stays at zero instead of wrapping). Bounded.
fn sub_saturating(a: &AtomicU64, n: u64) {
    let mut cur = a.load(Ordering::Acquire);
    for _ in 0..64 {
        match a.compare_exchange_weak(cur, cur.saturating_sub(n), Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return,
            Err(v) => cur = v,
        }
    }
}

/// The buckets and parameters one request touches.
struct RequestBuckets<'a> {
    global: &'a BucketView,
    global_params: &'a ParamsView,
    tenant: Option<(&'a BucketView, &'a ParamsView)>,
    /// `tenant`'s index in the bucket region (what a waiter sleeps on).
    tenant_index: u32,
}

impl<'a> RequestBuckets<'a> {
    /// The keyspace's own bucket, or the overflow bucket for a keyspace
    /// without a cell ([`AdmissionRegions::tenant_bucket`]). A cell given to
    /// another keyspace since `cell` was looked up (its generation moved) is
    /// not this request's: it is left alone.
    #[inline]
    fn of(r: &'a AdmissionRegions, cell: Option<CellRef>) -> Self {
        let tenant = r.tenant_bucket(cell);
        RequestBuckets {
            global: r.bucket(GLOBAL),
            global_params: r.params.get(GLOBAL).expect("global parameters"),
            tenant: tenant.map(|(_, b, p)| (b, p)),
            tenant_index: tenant.map_or(GLOBAL, |t| t.0),
        }
    }
}

/// Admits one request of `keyspace` (whose cell the caller looked up), or
/// refuses it without waiting. Nothing is held after a refusal.
#[inline]
pub fn acquire(
    r: &AdmissionRegions,
    k: &Knobs,
    keyspace: u32,
    cell: Option<CellRef>,
    demand: &Demand,
) -> Result<Grant, Refusal> {
    acquire_with(r, k, keyspace, cell, demand, None)
}

/// [`acquire`], first from the calling thread's spare tokens. Always
/// inlined (with `checks::prepare`) into the client's fast path: left to
/// the compiler, the inlining there changed with changes elsewhere in the
/// crate (a field added to the profile report alone moved
/// `ticket_acquire_release_ns` by 13 ns, docs/benchmarks.md).
#[inline(always)]
pub fn acquire_with(
    r: &AdmissionRegions,
    k: &Knobs,
    keyspace: u32,
    cell: Option<CellRef>,
    demand: &Demand,
    spare: Option<&mut Spare>,
) -> Result<Grant, Refusal> {
    let buckets = RequestBuckets::of(r, cell);
    let (g, est, throttled) = match prepare(r, k, &buckets, keyspace, cell, demand, spare)? {
        Prep::Done(g) => return Ok(g),
        Prep::Spared { g, est } => return Ok(finish(&buckets, g, est, est, 0, true)),
        Prep::Cpu { g, est, throttled } => (g, est, throttled),
    };
    let result =
        if throttled { take_cpu(k, &buckets, keyspace, est) } else { take_global_only(k, &buckets, keyspace, est) };
    match result {
        Ok((tenant_us, burst_us)) => Ok(finish(&buckets, g, est, tenant_us, burst_us, false)),
        Err(e) => {
            e.count();
            undo(r, &buckets, &g);
            Err(e.refusal)
        }
    }
}

/// The spared lane: a request that asks only CPU tokens (no write bytes,
/// not low priority), of the keyspace whose spare tokens the calling thread
/// holds, while the knobs count no concurrency and the spare's buckets are
/// quiet ([`super::spare::may_keep`]). It gets the grant [`acquire_with`]
/// gives from the spare, with the same stores, in one straight pass that
/// reads the knobs' flags and default estimate instead of a snapshot, and
/// the keyspace's cell from the spare instead of the directory: the path
/// of almost every ticket of a busy thread. `None`: nothing was done (the
/// spare too small, a check that asks for the ordinary path); take
/// [`acquire_with`].
#[inline(always)]
pub fn acquire_spared(r: &AdmissionRegions, keyspace: u32, demand: &Demand, spare: &mut Spare) -> Option<Grant> {
    if spare.us == 0 || demand.write_bytes != 0 || demand.low_priority {
        return None;
    }
    let knobs = &r.header().knobs;
    let flags = knobs.flags.load(Ordering::Acquire);
    if flags & (KNOB_ENABLED | KNOB_THROTTLE) != KNOB_ENABLED | KNOB_THROTTLE
        || flags & (KNOB_ADMISSION_ENFORCED | KNOB_ADMISSION_MONITOR) != 0
    {
        return None;
    }
    // The spare's cell, while it is still this keyspace's (the directory's
    // live entry for it, at the generation the tokens came from).
    let cell = spare.cell?;
    let (tenant, params) = super::spare::tenant_of(r, Some(cell))?;
    if params.entry() != (DIR_LIVE, keyspace) || !params.has(P_THROTTLED) || !super::spare::may_keep(r, tenant, params)
    {
        return None;
    }
    let default_estimate_us = knobs.default_estimate_us.load(Ordering::Relaxed);
    let (est, estimated) = estimate_of(flags, default_estimate_us, r.bucket(GLOBAL), Some((tenant, params)), demand);
    if spare.us < est {
        return None;
    }
    touch(r, tenant);
    if flags & KNOB_TRACK_DEMAND != 0 {
        tenant.count(c::DEMAND_US, est);
    }
    spare.us -= est;
    tenant.count(c::GRANTED, 1);
    Some(Grant {
        kind: demand.kind,
        tenant_us: est,
        global_us: est,
        skipped: false,
        estimate_us: estimated,
        ..Grant::unchecked(keyspace, Some(cell))
    })
}

/// Runtime top-up: `us` more for a running request, from the same tenant
/// and global buckets (burst outside cap mode, as for a first grant).
pub fn top_up(r: &AdmissionRegions, k: &Knobs, g: &mut Grant, us: u64) -> Result<(), Refusal> {
    if g.skipped {
        return Ok(());
    }
    let buckets = RequestBuckets::of(r, g.cell_at());
    let us = us.max(1);
    let result = if buckets.tenant.is_some_and(|(_, p)| p.has(P_THROTTLED)) {
        take_cpu(k, &buckets, g.keyspace, us)
    } else {
        take_global_only(k, &buckets, g.keyspace, us)
    };
    let counted_on = buckets.tenant.map_or(buckets.global, |t| t.0);
    match result {
        Ok((tenant_us, burst_us)) => {
            if tenant_us > 0
                && let Some((b, _)) = buckets.tenant
            {
                b.add_inflight_us(tenant_us);
            }
            g.tenant_us += tenant_us;
            g.burst_us += burst_us;
            g.global_us += us;
            counted_on.count(c::TOPUP_GRANTED, 1);
            Ok(())
        }
        Err(e) => {
            // A refused top-up, never a refused admission.
            counted_on.count(c::TOPUP_REFUSED, 1);
            Err(e.refusal)
        }
    }
}
