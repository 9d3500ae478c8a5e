//! Closing a grant with the CPU its request consumed: refunds, bounded debt,
//! the thread's spare tokens, the request histograms.

use super::{Grant, RequestBuckets, sub_saturating};
use crate::policy::bucket::give_back;
use crate::policy::spare::{self, SPARE_MAX_US, Spare};
use crate::region::{AdmissionRegions, BucketView, LOW_PRIORITY, ParamsView};
use keyspace_governor_common::admission::counter as c;
use std::sync::atomic::Ordering;

/// Gives back `granted` µs of a bucket whose holder consumed `consumed`:
/// refunds the unused part or charges the overrun as debt. Returns the debt
/// charged.
#[inline]
pub(super) fn settle(b: &BucketView, p: &ParamsView, granted: u64, consumed: u64) -> u64 {
    if consumed < granted {
        give_back(b, p, granted - consumed);
        0
    } else {
        charge_overrun(b, p, consumed - granted)
    }
}

/// Charges an overrun of `us` as debt, within the bucket's bound. Returns
/// the debt charged.
#[cold]
#[inline(never)]
pub(super) fn charge_overrun(b: &BucketView, p: &ParamsView, us: u64) -> u64 {
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
    let buckets = RequestBuckets::of(r, g.cell_at());
    if let Some(s) = spare
        && keep_refund(r, &buckets, g, consumed_us, s)
    {
        return;
    }
    let tenant = buckets.tenant;
    if g.global_us > 0 {
        settle(buckets.global, buckets.global_params, g.global_us, consumed_us);
    }
    if g.burst_us > 0 {
        // The burst budget caps what bursting consumes per interval, not what
        // it estimated: the unused part goes back to it.
        let back = g.burst_us.saturating_sub(consumed_us);
        if back > 0 {
            buckets.global.burst_budget_us.fetch_add(i64::try_from(back).unwrap_or(0), Ordering::AcqRel);
        }
    }
    if g.low_priority_us > 0
        && let Some(p) = r.params.get(LOW_PRIORITY)
    {
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
        buckets.global.observe_request(consumed_us, g.estimate_us);
    } else {
        buckets.global.count(c::RELEASED, 1);
    }
    if g.write_bytes > 0 {
        sub_saturating(&buckets.global.pending_write_bytes, g.write_bytes);
    }
}

/// The release of [`release_with`] when the refund stays spare; `false`
/// (nothing done) when it may not.
#[inline]
pub(super) fn keep_refund(
    r: &AdmissionRegions,
    buckets: &RequestBuckets<'_>,
    g: &Grant,
    consumed_us: u64,
    s: &mut Spare,
) -> bool {
    let granted = g.tenant_us;
    // The overflow bucket's tokens are shared by keyspaces without buckets: a
    // thread keeps no spare of them.
    if g.cell_generation == 0
        || granted == 0
        || g.global_us != granted
        || g.burst_us != 0
        || g.low_priority_us != 0
        || (s.us > 0 && s.cell != g.cell_at())
    {
        return false;
    }
    let Some((b, p)) = buckets.tenant else { return false };
    if !spare::may_keep(r, b, p) {
        return false;
    }
    let (global, gp) = (buckets.global, buckets.global_params);
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
