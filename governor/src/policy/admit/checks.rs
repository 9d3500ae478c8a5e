//! The checks that never wait, in the fast path's order, and what undoes them.

use super::{Demand, Grant, KEYSPACE_PENDING_WRITE_RATIO, Knobs, RequestBuckets, sub_saturating};
use crate::policy::bucket::give_back;
use crate::policy::error::{Refusal, WriteLimitKind};
use crate::policy::spare::Spare;
use crate::region::{AdmissionRegions, BucketView, CellRef, LOW_PRIORITY, ParamsView};
use keyspace_governor_common::admission::{
    KNOB_ADMISSION_ENFORCED, KNOB_ADMISSION_MONITOR, KNOB_BURST, KNOB_ENABLED, KNOB_ENFORCE_GLOBAL, KNOB_RUNTIME_TOPUP,
    KNOB_THROTTLE, KNOB_TRACK_DEMAND, P_BURST_ALLOWED, P_BURST_ENABLED, P_CAP, P_THROTTLED, counter as c,
};
use std::sync::atomic::Ordering;

/// Burst: takes `us` from this interval's burst budget and the global bucket.
pub(super) fn take_burst(global: &BucketView, us: u64) -> bool {
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

/// CPU tokens refused: the refusal, and the counter of the bucket that
/// counts it as a refused admission. A refused top-up is not one (the server
/// never saw it; it counts `TOPUP_REFUSED`), so the caller decides.
pub(super) struct CpuRefused<'a> {
    pub refusal: Refusal,
    on: Option<(&'a BucketView, usize)>,
}

impl CpuRefused<'_> {
    /// Counts it as a refused admission.
    pub fn count(&self) {
        if let Some((b, counter)) = self.on {
            b.count(counter, 1);
        }
    }
}

/// CPU tokens from the tenant bucket then the global bucket (rollback when
/// the global refuses); burst outside cap mode. Returns (tenant µs, burst µs).
#[inline]
pub(super) fn take_cpu<'a>(
    k: &Knobs,
    buckets: &RequestBuckets<'a>,
    keyspace: u32,
    us: u64,
) -> Result<(u64, u64), CpuRefused<'a>> {
    let Some((tenant, params)) = buckets.tenant else {
        return Err(CpuRefused { refusal: Refusal::GlobalCpuExhausted { keyspace }, on: None });
    };
    let cap = params.has(P_CAP);
    if tenant.try_take(us) {
        if buckets.global.try_take(us) {
            return Ok((us, 0));
        }
        if !cap && !k.has(KNOB_ENFORCE_GLOBAL) {
            // Best effort: the global bucket tracks the usage, it does not refuse.
            buckets.global.take_forced(us);
            buckets.global.count(c::OVERDRAFT, 1);
            return Ok((us, 0));
        }
        give_back(tenant, params, us);
        return Err(CpuRefused {
            refusal: Refusal::GlobalCpuExhausted { keyspace },
            on: Some((tenant, c::REFUSED_GLOBAL)),
        });
    }
    if !cap
        && k.has(KNOB_BURST)
        && params.has(P_BURST_ENABLED)
        && params.has(P_BURST_ALLOWED)
        && take_burst(buckets.global, us)
    {
        tenant.count(c::BURST_GRANTED, 1);
        tenant.count(c::BURST_US, us);
        return Ok((0, us));
    }
    Err(if cap {
        CpuRefused { refusal: Refusal::TenantCpuExhausted { keyspace }, on: Some((tenant, c::REFUSED_CAP)) }
    } else {
        CpuRefused { refusal: Refusal::KeyspaceCpuExhaustedNoBurst { keyspace }, on: Some((tenant, c::REFUSED_QUOTA)) }
    })
}

/// The tenant's in-flight requests: `Ok(counted)`, or the refusal.
pub(super) fn enter_concurrency(k: &Knobs, bucket: &BucketView, keyspace: u32) -> Result<bool, Refusal> {
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
pub(super) fn enter_writes(
    k: &Knobs,
    global: &BucketView,
    tenant: &BucketView,
    keyspace: u32,
    bytes: u64,
) -> Result<(), Refusal> {
    let threshold = k.pending_write_threshold;
    let g = global.pending_write_bytes.load(Ordering::Acquire);
    if g >= threshold {
        // The node's count, and the keyspace's (its refusals, whichever
        // limit refused them).
        global.count(c::REFUSED_WRITE_GLOBAL, 1);
        tenant.count(c::REFUSED_WRITE_GLOBAL, 1);
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
pub(super) fn estimate(k: &Knobs, buckets: &RequestBuckets<'_>, demand: &Demand) -> (u64, u64) {
    estimate_of(k.flags, k.default_estimate_us, buckets.global, buckets.tenant, demand)
}

/// [`estimate`] from the knobs' flags and default estimate alone (what the
/// spared lane reads of the knobs).
#[inline(always)]
pub(super) fn estimate_of(
    flags: u64,
    default_estimate_us: u64,
    global: &BucketView,
    tenant: Option<(&BucketView, &ParamsView)>,
    demand: &Demand,
) -> (u64, u64) {
    let published = tenant.map(|(_, p)| p.estimate_us.load(Ordering::Relaxed)).unwrap_or(0);
    let estimated = demand.estimate_us.unwrap_or(if published > 0 { published } else { default_estimate_us }).max(1);
    let mut est = estimated;
    if flags & KNOB_RUNTIME_TOPUP != 0
        && let Some((tenant, _)) = tenant
    {
        let room = global.available_us().min(tenant.available_us()) / 10;
        if room > 0 {
            est = est.min(room as u64);
        }
    }
    (est, estimated)
}

/// Stamps the keyspace's bucket as used now: idle eviction reads it. The
/// agent's coarse clock, so no clock read.
#[inline(always)]
pub(super) fn touch(r: &AdmissionRegions, b: &BucketView) {
    let now = r.header().agent.now_ms.load(Ordering::Relaxed);
    if b.last_used_ms.load(Ordering::Relaxed) != now {
        b.last_used_ms.store(now, Ordering::Relaxed);
    }
}

/// Where a request stands after the checks that never wait.
pub(super) enum Prep {
    /// Admitted without CPU tokens (admission off, or no bucket).
    Done(Grant),
    /// Concurrency, write bytes and the low-priority bucket held; `est` CPU
    /// µs still to take (`throttled`: from the tenant bucket then the global
    /// one; else from the global one alone).
    Cpu { g: Grant, est: u64, throttled: bool },
    /// As `Cpu`, but the `est` µs came from the thread's spare tokens.
    Spared { g: Grant, est: u64 },
}

/// The checks before any CPU token is taken: admission on, concurrency,
/// pending writes, whether the keyspace is throttled, the estimate. Always
/// inlined into the fast path (see `acquire_with`).
#[inline(always)]
pub(super) fn prepare(
    r: &AdmissionRegions,
    k: &Knobs,
    buckets: &RequestBuckets<'_>,
    keyspace: u32,
    cell: Option<CellRef>,
    demand: &Demand,
    spare: Option<&mut Spare>,
) -> Result<Prep, Refusal> {
    // The kind rides on the grant to whatever runs its work (the tag).
    let mut g = Grant { kind: demand.kind, ..Grant::unchecked(keyspace, cell) };
    if !k.has(KNOB_ENABLED) {
        buckets.global.count(c::SKIPPED, 1);
        buckets.global.count(c::GRANTED, 1);
        return Ok(Prep::Done(g));
    }
    let tenant = buckets.tenant.map(|t| t.0);
    if let Some(b) = tenant {
        g.counted = enter_concurrency(k, b, keyspace)?;
        touch(r, b);
    }
    if demand.write_bytes > 0
        && let Some(b) = tenant
    {
        if let Err(e) = enter_writes(k, buckets.global, b, keyspace, demand.write_bytes) {
            undo(r, buckets, &g);
            return Err(e);
        }
        g.write_bytes = demand.write_bytes;
    }
    let throttled = k.has(KNOB_THROTTLE) && buckets.tenant.is_some_and(|(_, p)| p.has(P_THROTTLED));
    let low =
        k.has(KNOB_THROTTLE) && demand.low_priority && r.params.get(LOW_PRIORITY).is_some_and(|p| p.has(P_THROTTLED));
    if !throttled && !low {
        let b = tenant.unwrap_or(buckets.global);
        b.count(c::SKIPPED, 1);
        b.count(c::GRANTED, 1);
        return Ok(Prep::Done(g));
    }
    g.skipped = false;
    let (est, estimated) = estimate(k, buckets, demand);
    g.estimate_us = estimated;
    if k.has(KNOB_TRACK_DEMAND)
        && let Some(b) = tenant
    {
        b.count(c::DEMAND_US, est);
    }
    // The low-priority DAG bucket first.
    if low {
        let lb = r.bucket(LOW_PRIORITY);
        if !lb.try_take(est) {
            lb.count(c::REFUSED_GLOBAL, 1);
            undo(r, buckets, &g);
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
pub(super) fn undo(r: &AdmissionRegions, buckets: &RequestBuckets<'_>, g: &Grant) {
    let tenant = buckets.tenant.map(|t| t.0);
    if g.low_priority_us > 0
        && let Some(p) = r.params.get(LOW_PRIORITY)
    {
        give_back(r.bucket(LOW_PRIORITY), p, g.low_priority_us);
    }
    if g.counted
        && let Some(b) = tenant
    {
        sub_saturating(&b.inflight_requests, 1);
    }
    if g.write_bytes > 0 {
        sub_saturating(&buckets.global.pending_write_bytes, g.write_bytes);
        if let Some(b) = tenant {
            sub_saturating(&b.pending_write_bytes, g.write_bytes);
        }
    }
}

/// Records a grant that got its CPU tokens (`from_spare`: the thread's
/// spare tokens, already counted in flight). Always inlined: on the
/// uncontended acquire it is the rest of the fast path, and left to itself
/// the compiler stopped inlining it there when a slow-path caller grew
/// (+9 ns an acquire and release, `docs/benchmarks.md`).
#[inline(always)]
pub(super) fn finish(
    buckets: &RequestBuckets<'_>,
    mut g: Grant,
    est: u64,
    tenant_us: u64,
    burst_us: u64,
    from_spare: bool,
) -> Grant {
    g.tenant_us = tenant_us;
    g.burst_us = burst_us;
    g.global_us = est;
    match buckets.tenant {
        Some((b, _)) => {
            if tenant_us > 0 && !from_spare {
                b.add_inflight_us(tenant_us);
            }
            b.count(c::GRANTED, 1);
        }
        None => buckets.global.count(c::GRANTED, 1),
    }
    g
}

/// CPU from the global bucket alone (a keyspace without a bucket, on the
/// low-priority path).
pub(super) fn take_global_only<'a>(
    k: &Knobs,
    buckets: &RequestBuckets<'a>,
    keyspace: u32,
    us: u64,
) -> Result<(u64, u64), CpuRefused<'a>> {
    if buckets.global.try_take(us) {
        return Ok((0, 0));
    }
    if !k.has(KNOB_ENFORCE_GLOBAL) {
        buckets.global.take_forced(us);
        buckets.global.count(c::OVERDRAFT, 1);
        return Ok((0, 0));
    }
    Err(CpuRefused { refusal: Refusal::GlobalCpuExhausted { keyspace }, on: Some((buckets.global, c::REFUSED_GLOBAL)) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::{AdmissionMemory, GLOBAL};

    #[test]
    fn a_write_refused_by_the_node_limit_is_counted_on_its_keyspace_too() {
        let m = AdmissionMemory::create(4).unwrap();
        let r = &m.regions;
        let (global, first, second) = (r.bucket(GLOBAL), r.keyspace_cell(0).unwrap().0, r.keyspace_cell(1).unwrap().0);
        let k = Knobs { pending_write_threshold: 1000, ..Default::default() };
        // Below its own limit (300) when it enters, the first keyspace fills the node's.
        enter_writes(&k, global, first, 7, 1000).unwrap();
        let refused = enter_writes(&k, global, second, 8, 1).unwrap_err();
        assert!(matches!(refused, Refusal::WriteBytesLimited { kind: WriteLimitKind::GlobalLimit, .. }), "{refused:?}");
        let counted = |b: &BucketView| b.counter(c::REFUSED_WRITE_GLOBAL);
        assert_eq!((counted(global), counted(second), counted(first)), (1, 1, 0));
    }
}
