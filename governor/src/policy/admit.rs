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

use super::bucket::give_back;
use super::error::{Refusal, WriteLimitKind};
use super::spare::{self, Spare, SPARE_MAX_US};
use crate::region::{AdmissionRegions, BucketView, ParamsView, GLOBAL, LOW_PRIORITY};
// (FIRST_KEYSPACE is named in full where a bucket index is computed.)
use keyspace_governor_common::admission::{
    counter as c, hist, KNOB_ADMISSION_ENFORCED, KNOB_ADMISSION_MONITOR, KNOB_BURST, KNOB_ENABLED,
    KNOB_ENFORCE_GLOBAL, KNOB_RUNTIME_TOPUP, KNOB_THROTTLE, KNOB_TRACK_DEMAND, P_BURST_ALLOWED, P_BURST_ENABLED, P_CAP,
    P_THROTTLED,
};
use std::sync::atomic::{AtomicU64, Ordering};

/// Per-keyspace pending-write threshold as a share of the global one.
pub const KEYSPACE_PENDING_WRITE_RATIO: f64 = 0.3;

/// The settings the fast path reads, copied from the header once per call
/// (`crate::region::KnobsView::snapshot`).
pub use keyspace_governor_common::admission::KnobsCell as Knobs;

/// What a request asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Demand {
    /// CPU µs it expects; `None`: the keyspace's published estimate.
    pub estimate_us: Option<u64>,
    /// Write bytes it will hold pending until released.
    pub write_bytes: u64,
    /// A low-priority DAG request (passes the low-priority bucket first when
    /// `low-priority-dag-global-enabled`).
    pub low_priority: bool,
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
    pub(crate) fn unchecked(keyspace: u32, cell: Option<(u32, u64)>) -> Grant {
        Grant {
            keyspace,
            cell_index: cell.map_or(0, |c| c.0),
            cell_generation: cell.map_or(0, |c| c.1),
            tenant_us: 0,
            global_us: 0,
            burst_us: 0,
            low_priority_us: 0,
            write_bytes: 0,
            counted: false,
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
        self.cell_at().map(|c| c.0)
    }

    /// Keyspace cell and its generation when granted, if it had one.
    #[inline]
    pub(crate) fn cell_at(&self) -> Option<(u32, u64)> {
        (self.cell_generation != 0).then_some((self.cell_index, self.cell_generation))
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
struct Cells<'a> {
    global: &'a BucketView,
    global_params: &'a ParamsView,
    tenant: Option<(&'a BucketView, &'a ParamsView)>,
    /// `tenant`'s index in the bucket region (what a waiter sleeps on).
    tenant_index: u32,
}

impl<'a> Cells<'a> {
    /// The keyspace's own bucket, or the overflow bucket for a keyspace
    /// without a cell ([`AdmissionRegions::tenant_bucket`]). A cell given to
    /// another keyspace since `cell` was looked up (its generation moved) is
    /// not this request's: it is left alone.
    #[inline]
    fn of(r: &'a AdmissionRegions, cell: Option<(u32, u64)>) -> Self {
        let tenant = r.tenant_bucket(cell);
        Cells {
            global: r.bucket(GLOBAL),
            global_params: r.params.get(GLOBAL).expect("global parameters"),
            tenant: tenant.map(|(_, b, p)| (b, p)),
            tenant_index: tenant.map_or(GLOBAL, |t| t.0),
        }
    }
}

/// Burst: takes `us` from this interval's burst budget and the global bucket.
fn take_burst(global: &BucketView, us: u64) -> bool {
    let want = us as i64;
    let b = &global.burst_budget_us;
    let mut cur = b.load(Ordering::Acquire);
    for _ in 0..64 {
        if cur < want {
            return false;
        }
        match b.compare_exchange_weak(cur, cur - want, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {
                if global.try_take(us) {
                    return true;
                }
                b.fetch_add(want, Ordering::AcqRel);
                return false;
            }
            Err(v) => cur = v,
        }
    }
    false
}

/// CPU tokens from the tenant bucket then the global bucket (rollback when
/// the global refuses); burst outside cap mode. Returns (tenant µs, burst µs).
#[inline]
fn take_cpu(k: &Knobs, cells: &Cells<'_>, keyspace: u32, us: u64) -> Result<(u64, u64), Refusal> {
    let Some((tenant, params)) = cells.tenant else {
        return Err(Refusal::GlobalCpuExhausted { keyspace });
    };
    let cap = params.has(P_CAP);
    if tenant.try_take(us) {
        if cells.global.try_take(us) {
            return Ok((us, 0));
        }
        if !cap && !k.has(KNOB_ENFORCE_GLOBAL) {
            // Best effort: the global bucket tracks the usage, it does not refuse.
            cells.global.take_forced(us);
            cells.global.count(c::OVERDRAFT, 1);
            return Ok((us, 0));
        }
        give_back(tenant, params, us);
        tenant.count(c::REFUSED_GLOBAL, 1);
        return Err(Refusal::GlobalCpuExhausted { keyspace });
    }
    if !cap
        && k.has(KNOB_BURST)
        && params.has(P_BURST_ENABLED)
        && params.has(P_BURST_ALLOWED)
        && take_burst(cells.global, us)
    {
        tenant.count(c::BURST_GRANTED, 1);
        tenant.count(c::BURST_US, us);
        return Ok((0, us));
    }
    if cap {
        tenant.count(c::REFUSED_CAP, 1);
        Err(Refusal::TenantCpuExhausted { keyspace })
    } else {
        tenant.count(c::REFUSED_QUOTA, 1);
        Err(Refusal::KeyspaceCpuExhaustedNoBurst { keyspace })
    }
}

/// The tenant's in-flight requests: `Ok(counted)`, or the refusal.
fn enter_concurrency(k: &Knobs, bucket: &BucketView, keyspace: u32) -> Result<bool, Refusal> {
    let enforced = k.has(KNOB_ADMISSION_ENFORCED);
    if !enforced && !k.has(KNOB_ADMISSION_MONITOR) {
        return Ok(false);
    }
    let limit = k.max_concurrent_per_tenant;
    let a = &bucket.inflight_requests;
    let mut cur = a.load(Ordering::Acquire);
    for _ in 0..64 {
        if limit > 0 && cur >= limit {
            if enforced {
                bucket.count(c::REFUSED_CONCURRENCY, 1);
                return Err(Refusal::ConcurrencyLimited { tenant: keyspace, inflight: cur, limit });
            }
            bucket.count(c::MONITOR_BREACHES, 1);
            a.fetch_add(1, Ordering::AcqRel);
            return Ok(true);
        }
        match a.compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Ok(true),
            Err(v) => cur = v,
        }
    }
    a.fetch_add(1, Ordering::AcqRel);
    Ok(true)
}

/// The seed's `too_busy` then the increment of both counters.
fn enter_writes(k: &Knobs, global: &BucketView, tenant: &BucketView, keyspace: u32, bytes: u64) -> Result<(), Refusal> {
    let threshold = k.pending_write_threshold;
    let g = global.pending_write_bytes.load(Ordering::Acquire);
    if g >= threshold {
        global.count(c::REFUSED_WRITE_GLOBAL, 1);
        return Err(Refusal::WriteBytesLimited {
            keyspace,
            kind: WriteLimitKind::GlobalLimit,
            pending_bytes: g,
            threshold_bytes: threshold,
        });
    }
    let ks_threshold = (threshold as f64 * KEYSPACE_PENDING_WRITE_RATIO) as u64;
    let p = tenant.pending_write_bytes.load(Ordering::Acquire);
    if p >= ks_threshold {
        tenant.count(c::REFUSED_WRITE_KEYSPACE, 1);
        return Err(Refusal::WriteBytesLimited {
            keyspace,
            kind: WriteLimitKind::KeyspaceLimit,
            pending_bytes: p,
            threshold_bytes: ks_threshold,
        });
    }
    global.pending_write_bytes.fetch_add(bytes, Ordering::AcqRel);
    tenant.pending_write_bytes.fetch_add(bytes, Ordering::AcqRel);
    Ok(())
}

/// The tokens a request takes and its estimate: the estimate is its own,
/// else the keyspace's published one, else the default; it takes that,
/// or with runtime token management at most a tenth of what the tenant and
/// global buckets hold (it tops up as it runs).
#[inline]
fn estimate(k: &Knobs, cells: &Cells<'_>, demand: &Demand) -> (u64, u64) {
    let published = cells.tenant.map(|(_, p)| p.estimate_us.load(Ordering::Relaxed)).unwrap_or(0);
    let estimated = demand.estimate_us.unwrap_or(if published > 0 { published } else { k.default_estimate_us }).max(1);
    let mut est = estimated;
    if k.has(KNOB_RUNTIME_TOPUP)
        && let Some((tenant, _)) = cells.tenant {
            let room = cells.global.available_us().min(tenant.available_us()) / 10;
            if room > 0 {
                est = est.min(room as u64);
            }
        }
    (est, estimated)
}

/// Where a request stands after the checks that never wait.
enum Prep {
    /// Admitted without CPU tokens (admission off, or no bucket).
    Done(Grant),
    /// Concurrency, write bytes and the low-priority bucket held; `est` CPU
    /// µs still to take (`throttled`: from the tenant bucket then the global
    /// one; else from the global one alone).
    Cpu { g: Grant, est: u64, throttled: bool },
    /// As `Cpu`, but the `est` µs came from the thread's spare tokens.
    Spared { g: Grant, est: u64 },
}

#[inline]
fn prepare(
    r: &AdmissionRegions,
    k: &Knobs,
    cells: &Cells<'_>,
    keyspace: u32,
    cell: Option<(u32, u64)>,
    demand: &Demand,
    spare: Option<&mut Spare>,
) -> Result<Prep, Refusal> {
    let mut g = Grant::unchecked(keyspace, cell);
    if !k.has(KNOB_ENABLED) {
        cells.global.count(c::SKIPPED, 1);
        cells.global.count(c::GRANTED, 1);
        return Ok(Prep::Done(g));
    }
    let tenant = cells.tenant.map(|t| t.0);
    if let Some(b) = tenant {
        g.counted = enter_concurrency(k, b, keyspace)?;
        // Idle eviction reads it; the agent's coarse clock, so no clock read.
        let now = r.header().agent.now_ms.load(Ordering::Relaxed);
        if b.last_used_ms.load(Ordering::Relaxed) != now {
            b.last_used_ms.store(now, Ordering::Relaxed);
        }
    }
    if demand.write_bytes > 0
        && let Some(b) = tenant {
            if let Err(e) = enter_writes(k, cells.global, b, keyspace, demand.write_bytes) {
                undo(r, cells, &g);
                return Err(e);
            }
            g.write_bytes = demand.write_bytes;
        }
    let throttled = k.has(KNOB_THROTTLE) && cells.tenant.is_some_and(|(_, p)| p.has(P_THROTTLED));
    let low = k.has(KNOB_THROTTLE) && demand.low_priority && r.params.get(LOW_PRIORITY).is_some_and(|p| p.has(P_THROTTLED));
    if !throttled && !low {
        let b = tenant.unwrap_or(cells.global);
        b.count(c::SKIPPED, 1);
        b.count(c::GRANTED, 1);
        return Ok(Prep::Done(g));
    }
    g.skipped = false;
    let (est, estimated) = estimate(k, cells, demand);
    g.estimate_us = estimated;
    if k.has(KNOB_TRACK_DEMAND)
        && let Some(b) = tenant {
            b.count(c::DEMAND_US, est);
        }
    // The low-priority DAG bucket first.
    if low {
        let lb = r.bucket(LOW_PRIORITY);
        if !lb.try_take(est) {
            lb.count(c::REFUSED_GLOBAL, 1);
            undo(r, cells, &g);
            return Err(Refusal::LowPriorityCpuExhausted { keyspace });
        }
        g.low_priority_us = est;
    }
    if throttled && !low && spare.is_some_and(|s| s.take(r, cell, est)) {
        return Ok(Prep::Spared { g, est });
    }
    Ok(Prep::Cpu { g, est, throttled })
}

/// Gives back what [`prepare`] took: the low-priority tokens, the write
/// bytes, the place among the tenant's in-flight requests.
fn undo(r: &AdmissionRegions, cells: &Cells<'_>, g: &Grant) {
    let tenant = cells.tenant.map(|t| t.0);
    if g.low_priority_us > 0
        && let Some(p) = r.params.get(LOW_PRIORITY) {
            give_back(r.bucket(LOW_PRIORITY), p, g.low_priority_us);
        }
    if g.counted
        && let Some(b) = tenant {
            sub_saturating(&b.inflight_requests, 1);
        }
    if g.write_bytes > 0 {
        sub_saturating(&cells.global.pending_write_bytes, g.write_bytes);
        if let Some(b) = tenant {
            sub_saturating(&b.pending_write_bytes, g.write_bytes);
        }
    }
}

/// Records a grant that got its CPU tokens (`from_spare`: the thread's
/// spare tokens, already counted in flight).
#[inline]
fn finish(cells: &Cells<'_>, mut g: Grant, est: u64, tenant_us: u64, burst_us: u64, from_spare: bool) -> Grant {
    g.tenant_us = tenant_us;
    g.burst_us = burst_us;
    g.global_us = est;
    match cells.tenant {
        Some((b, _)) => {
            if tenant_us > 0 && !from_spare {
                b.add_inflight_us(tenant_us);
            }
            b.count(c::GRANTED, 1);
        }
        None => cells.global.count(c::GRANTED, 1),
    }
    g
}

/// CPU from the global bucket alone (a keyspace without a bucket, on the
/// low-priority path).
fn take_global_only(k: &Knobs, cells: &Cells<'_>, keyspace: u32, us: u64) -> Result<(u64, u64), Refusal> {
    if cells.global.try_take(us) {
        return Ok((0, 0));
    }
    if !k.has(KNOB_ENFORCE_GLOBAL) {
        cells.global.take_forced(us);
        cells.global.count(c::OVERDRAFT, 1);
        return Ok((0, 0));
    }
    cells.global.count(c::REFUSED_GLOBAL, 1);
    Err(Refusal::GlobalCpuExhausted { keyspace })
}

/// Admits one request of `keyspace` (whose cell the caller looked up), or
/// refuses it without waiting. Nothing is held after a refusal.
#[inline]
pub fn acquire(
    r: &AdmissionRegions,
    k: &Knobs,
    keyspace: u32,
    cell: Option<(u32, u64)>,
    demand: &Demand,
) -> Result<Grant, Refusal> {
    acquire_with(r, k, keyspace, cell, demand, None)
}

/// [`acquire`], first from the calling thread's spare tokens.
#[inline]
pub fn acquire_with(
    r: &AdmissionRegions,
    k: &Knobs,
    keyspace: u32,
    cell: Option<(u32, u64)>,
    demand: &Demand,
    spare: Option<&mut Spare>,
) -> Result<Grant, Refusal> {
    let cells = Cells::of(r, cell);
    let (g, est, throttled) = match prepare(r, k, &cells, keyspace, cell, demand, spare)? {
        Prep::Done(g) => return Ok(g),
        Prep::Spared { g, est } => return Ok(finish(&cells, g, est, est, 0, true)),
        Prep::Cpu { g, est, throttled } => (g, est, throttled),
    };
    let result = if throttled { take_cpu(k, &cells, keyspace, est) } else { take_global_only(k, &cells, keyspace, est) };
    match result {
        Ok((tenant_us, burst_us)) => Ok(finish(&cells, g, est, tenant_us, burst_us, false)),
        Err(e) => {
            undo(r, &cells, &g);
            Err(e)
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// In the tenant bucket's line, at this position.
    Tenant(u64),
    /// Tenant tokens held (or none needed); in the global bucket's line once
    /// it had to queue there.
    Global(Option<u64>),
    Done,
}

/// A request that waits in line for CPU tokens: tenant bucket first, then
/// the global one, each served in arrival order. Poll it after every wake of
/// the bucket it waits on; cancel it at the deadline.
#[derive(Debug)]
#[must_use = "a queued request must be polled to a grant or cancelled"]
pub struct Queued {
    g: Grant,
    est: u64,
    tenant_us: u64,
    burst_us: u64,
    stage: Stage,
    /// A running request's top-up, not a new request.
    topup: bool,
    /// Served from the thread's spare tokens.
    spared: bool,
}

/// Where a queued request stands.
#[derive(Debug)]
pub enum Progress {
    Ready(Grant),
    /// Waiting for bucket `bucket` (an index of the bucket region) to reach `pos`.
    Waiting { bucket: u32, pos: u64 },
}

/// Like [`acquire`], but instead of refusing for want of CPU tokens, takes a
/// place in line. Refusals that are not about CPU (concurrency, write bytes,
/// the low-priority bucket) still come at once. A thread's `spare` tokens
/// serve it first, as in [`acquire_with`].
pub fn acquire_queued(
    r: &AdmissionRegions,
    k: &Knobs,
    keyspace: u32,
    cell: Option<(u32, u64)>,
    demand: &Demand,
    spare: Option<&mut Spare>,
) -> Result<Queued, Refusal> {
    let cells = Cells::of(r, cell);
    let done = |g, est, tenant_us, spared| Queued { g, est, tenant_us, burst_us: 0, stage: Stage::Done, topup: false, spared };
    let (g, est, throttled) = match prepare(r, k, &cells, keyspace, cell, demand, spare)? {
        Prep::Done(g) => return Ok(done(g, 0, 0, false)),
        Prep::Spared { g, est } => return Ok(done(g, est, est, true)),
        Prep::Cpu { g, est, throttled } => (g, est, throttled),
    };
    Ok(Queued::start(&cells, k, g, est, throttled, false))
}

/// A top-up of `us` for the running request `g`, waiting in line like a new
/// request. Its grant, once ready, holds only the top-up: add it to `g` with
/// [`Grant::absorb`].
pub fn top_up_queued(r: &AdmissionRegions, k: &Knobs, g: &Grant, us: u64) -> Queued {
    let cells = Cells::of(r, g.cell_at());
    let part = Grant { tenant_us: 0, global_us: 0, burst_us: 0, low_priority_us: 0, write_bytes: 0, counted: false, ..g.clone() };
    let throttled = cells.tenant.is_some_and(|(_, p)| p.has(P_THROTTLED));
    if g.skipped {
        return Queued { g: part, est: 0, tenant_us: 0, burst_us: 0, stage: Stage::Done, topup: true, spared: false };
    }
    Queued::start(&cells, k, part, us.max(1), throttled, true)
}

impl Grant {
    /// Adds a top-up's tokens to this grant.
    pub fn absorb(&mut self, part: Grant) {
        self.tenant_us += part.tenant_us;
        self.global_us += part.global_us;
        self.burst_us += part.burst_us;
    }
}

impl Queued {
    fn start(cells: &Cells<'_>, k: &Knobs, g: Grant, est: u64, throttled: bool, topup: bool) -> Queued {
        let mut q = Queued { g, est, tenant_us: 0, burst_us: 0, stage: Stage::Global(None), topup, spared: false };
        let Some((tenant, params)) = cells.tenant.filter(|_| throttled) else { return q };
        if tenant.try_take(est) {
            q.tenant_us = est;
        } else if !params.has(P_CAP)
            && k.has(KNOB_BURST)
            && params.has(P_BURST_ENABLED)
            && params.has(P_BURST_ALLOWED)
            && take_burst(cells.global, est)
        {
            tenant.count(c::BURST_GRANTED, 1);
            tenant.count(c::BURST_US, est);
            q.burst_us = est;
            q.stage = Stage::Done;
        } else {
            q.stage = Stage::Tenant(tenant.reserve(est));
        }
        q
    }

    /// Moves as far as the buckets allow.
    pub fn poll(&mut self, r: &AdmissionRegions, k: &Knobs) -> Progress {
        let cells = Cells::of(r, self.g.cell_at());
        loop {
            match self.stage {
                Stage::Tenant(pos) => {
                    let Some((tenant, _)) = cells.tenant else {
                        self.stage = Stage::Global(None);
                        continue;
                    };
                    if !tenant.reached(pos) {
                        return Progress::Waiting { bucket: cells.tenant_index, pos };
                    }
                    self.tenant_us = self.est;
                    self.stage = Stage::Global(None);
                }
                Stage::Global(None) => {
                    let cap = cells.tenant.is_some_and(|(_, p)| p.has(P_CAP));
                    if cells.global.try_take(self.est) {
                        self.stage = Stage::Done;
                    } else if !cap && !k.has(KNOB_ENFORCE_GLOBAL) {
                        cells.global.take_forced(self.est);
                        cells.global.count(c::OVERDRAFT, 1);
                        self.stage = Stage::Done;
                    } else {
                        self.stage = Stage::Global(Some(cells.global.reserve(self.est)));
                    }
                }
                Stage::Global(Some(pos)) => {
                    if !cells.global.reached(pos) {
                        return Progress::Waiting { bucket: GLOBAL, pos };
                    }
                    self.stage = Stage::Done;
                }
                Stage::Done => {
                    let g = self.g.clone();
                    if g.skipped && self.est == 0 {
                        return Progress::Ready(g);
                    }
                    if self.topup {
                        let mut part = g;
                        part.tenant_us = self.tenant_us;
                        part.burst_us = self.burst_us;
                        part.global_us = self.est;
                        let on = cells.tenant.map_or(cells.global, |t| t.0);
                        if self.tenant_us > 0 {
                            on.add_inflight_us(self.tenant_us);
                        }
                        on.count(c::TOPUP_GRANTED, 1);
                        return Progress::Ready(part);
                    }
                    return Progress::Ready(finish(&cells, g, self.est, self.tenant_us, self.burst_us, self.spared));
                }
            }
        }
    }

    /// Gives up: leaves every line, returns tokens and what the checks took.
    /// Returns the refusal the request ends with.
    pub fn cancel(self, r: &AdmissionRegions) -> Refusal {
        let cells = Cells::of(r, self.g.cell_at());
        let keyspace = self.g.keyspace;
        let cap = cells.tenant.is_some_and(|(_, p)| p.has(P_CAP));
        let refusal = match self.stage {
            Stage::Tenant(_) if cap => Refusal::TenantCpuExhausted { keyspace },
            Stage::Tenant(_) => Refusal::KeyspaceCpuExhaustedNoBurst { keyspace },
            _ => Refusal::GlobalCpuExhausted { keyspace },
        };
        let on = cells.tenant.map_or(cells.global, |t| t.0);
        if self.topup && self.stage != Stage::Done {
            on.count(c::TOPUP_REFUSED, 1);
        }
        match self.stage {
            Stage::Tenant(_) => {
                if let Some((tenant, _)) = cells.tenant {
                    tenant.cancel(self.est);
                    if !self.topup {
                        tenant.count(if cap { c::REFUSED_CAP } else { c::REFUSED_QUOTA }, 1);
                    }
                }
            }
            Stage::Global(pos) => {
                if pos.is_some() {
                    cells.global.cancel(self.est);
                }
                if let Some((tenant, params)) = cells.tenant
                    && self.tenant_us > 0 {
                        give_back(tenant, params, self.tenant_us);
                    }
                if !self.topup {
                    on.count(c::REFUSED_GLOBAL, 1);
                }
            }
            Stage::Done => {}
        }
        if self.stage != Stage::Done && !self.topup {
            undo(r, &cells, &self.g);
        }
        refusal
    }

    pub fn keyspace(&self) -> u32 {
        self.g.keyspace
    }

    /// The keyspace cell the request is for, if it has one.
    pub fn cell(&self) -> Option<u32> {
        self.g.cell()
    }

    /// A running request's top-up, not a new admission.
    pub fn is_topup(&self) -> bool {
        self.topup
    }

    /// The wait histogram its wait ends in ([`hist`]), by its result.
    pub fn wait_hist(&self, granted: bool) -> usize {
        match (self.topup, granted) {
            (false, true) => hist::WAIT_GRANTED,
            (false, false) => hist::WAIT_REFUSED,
            (true, true) => hist::RUNTIME_GRANTED,
            (true, false) => hist::RUNTIME_REFUSED,
        }
    }
}

/// Runtime top-up: `us` more for a running request, from the same tenant
/// and global buckets (burst outside cap mode, as for a first grant).
pub fn top_up(r: &AdmissionRegions, k: &Knobs, g: &mut Grant, us: u64) -> Result<(), Refusal> {
    if g.skipped {
        return Ok(());
    }
    let cells = Cells::of(r, g.cell_at());
    let us = us.max(1);
    let result = if cells.tenant.is_some_and(|(_, p)| p.has(P_THROTTLED)) {
        take_cpu(k, &cells, g.keyspace, us)
    } else {
        take_global_only(k, &cells, g.keyspace, us)
    };
    let counted_on = cells.tenant.map_or(cells.global, |t| t.0);
    match result {
        Ok((tenant_us, burst_us)) => {
            if tenant_us > 0
                && let Some((b, _)) = cells.tenant {
                    b.add_inflight_us(tenant_us);
                }
            g.tenant_us += tenant_us;
            g.burst_us += burst_us;
            g.global_us += us;
            counted_on.count(c::TOPUP_GRANTED, 1);
            Ok(())
        }
        Err(e) => {
            counted_on.count(c::TOPUP_REFUSED, 1);
            Err(e)
        }
    }
}

/// Gives back `granted` µs of a bucket whose holder consumed `consumed`:
/// refunds the unused part or charges the overrun as debt. Returns the debt
/// charged.
#[inline]
fn settle(b: &BucketView, p: &ParamsView, granted: u64, consumed: u64) -> u64 {
    if consumed < granted {
        give_back(b, p, granted - consumed);
        0
    } else {
        charge_overrun(b, p, consumed - granted)
    }
}

/// Charges an overrun of `us` as debt, within the bucket's bound. Returns
/// the debt charged.
fn charge_overrun(b: &BucketView, p: &ParamsView, us: u64) -> u64 {
    let (charged, forgiven) = b.charge_debt(us, p.max_debt_us.load(Ordering::Relaxed));
    b.count(c::DEBT_US, charged);
    if forgiven > 0 {
        b.count(c::DEBT_FORGIVEN_US, forgiven);
    }
    charged
}

/// Closes a grant with the CPU the request measurably consumed: unused
/// tokens go back (waking waiters), an overrun becomes bounded debt, write
/// bytes and the in-flight count are returned.
#[inline]
pub fn release(r: &AdmissionRegions, g: &Grant, consumed_us: u64) {
    release_with(r, g, consumed_us, None)
}

/// [`release`], keeping the refund as the calling thread's spare tokens
/// when the grant is a plain one (as many tenant as global tokens, no
/// burst, no low-priority tokens) and its buckets are quiet.
#[inline]
pub fn release_with(r: &AdmissionRegions, g: &Grant, consumed_us: u64, spare: Option<&mut Spare>) {
    let cells = Cells::of(r, g.cell_at());
    if let Some(s) = spare
        && keep_refund(r, &cells, g, consumed_us, s)
    {
        return;
    }
    let tenant = cells.tenant;
    if g.global_us > 0 {
        settle(cells.global, cells.global_params, g.global_us, consumed_us);
    }
    if g.burst_us > 0 {
        // The burst budget caps what bursting consumes per interval, not what
        // it estimated: the unused part goes back to it.
        let back = g.burst_us.saturating_sub(consumed_us);
        if back > 0 {
            cells.global.burst_budget_us.fetch_add(i64::try_from(back).unwrap_or(0), Ordering::AcqRel);
        }
    }
    if g.low_priority_us > 0
        && let Some(p) = r.params.get(LOW_PRIORITY) {
            settle(r.bucket(LOW_PRIORITY), p, g.low_priority_us, consumed_us);
        }
    if let Some((b, p)) = tenant {
        if g.tenant_us > 0 {
            settle(b, p, g.tenant_us, consumed_us.saturating_sub(g.burst_us));
            b.sub_inflight_us(g.tenant_us);
        }
        if g.counted {
            sub_saturating(&b.inflight_requests, 1);
        }
        if g.write_bytes > 0 {
            sub_saturating(&b.pending_write_bytes, g.write_bytes);
        }
        // Counted as released (and its CPU as consumed) by the request
        // histograms when observed there.
        if g.estimate_us > 0 {
            b.observe_request(consumed_us, g.estimate_us);
        } else {
            b.count(c::CONSUMED_US, consumed_us);
            b.count(c::RELEASED, 1);
        }
    } else if g.estimate_us > 0 {
        cells.global.observe_request(consumed_us, g.estimate_us);
    } else {
        cells.global.count(c::RELEASED, 1);
    }
    if g.write_bytes > 0 {
        sub_saturating(&cells.global.pending_write_bytes, g.write_bytes);
    }
}

/// The release of [`release_with`] when the refund stays spare; `false`
/// (nothing done) when it may not.
#[inline]
fn keep_refund(r: &AdmissionRegions, cells: &Cells<'_>, g: &Grant, consumed_us: u64, s: &mut Spare) -> bool {
    let granted = g.tenant_us;
    // The overflow bucket's tokens are shared by keyspaces without cells: a
    // thread keeps no spare of them.
    if g.cell_generation == 0 || granted == 0 || g.global_us != granted || g.burst_us != 0 || g.low_priority_us != 0 || (s.us > 0 && s.cell != g.cell_at()) {
        return false;
    }
    let Some((b, p)) = cells.tenant else { return false };
    if !spare::may_keep(r, b, p) {
        return false;
    }
    let (global, gp) = (cells.global, cells.global_params);
    let used = consumed_us.min(granted);
    // An overrun is paid from the spare first; the rest is debt, as ever.
    let over = consumed_us - used;
    let paid = over.min(s.us);
    let held = s.us - paid + (granted - used);
    let kept = held.min(granted.min(SPARE_MAX_US));
    let back = held - kept;
    if back > 0 {
        give_back(global, gp, back);
        give_back(b, p, back);
    }
    if over > paid {
        charge_overrun(global, gp, over - paid);
        charge_overrun(b, p, over - paid);
    }
    // In flight: the grant and the old spare, less the new spare.
    let done = s.us + granted - kept;
    if done > 0 {
        b.sub_inflight_us(done);
    }
    s.cell = g.cell_at();
    s.us = kept;
    if g.counted {
        sub_saturating(&b.inflight_requests, 1);
    }
    if g.write_bytes > 0 {
        sub_saturating(&b.pending_write_bytes, g.write_bytes);
        sub_saturating(&global.pending_write_bytes, g.write_bytes);
    }
    if g.estimate_us > 0 {
        b.observe_request(consumed_us, g.estimate_us);
    } else {
        if consumed_us > 0 {
            b.count(c::CONSUMED_US, consumed_us);
        }
        b.count(c::RELEASED, 1);
    }
    true
}
