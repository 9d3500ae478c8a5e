//! A request that waits in line for CPU tokens (a new admission or a running
//! request's top-up).

use super::checks::{Prep, finish, prepare, take_burst, undo};
use super::{Demand, Grant, Knobs, RequestBuckets};
use crate::policy::bucket::give_back;
use crate::policy::error::Refusal;
use crate::policy::spare::Spare;
use crate::region::{AdmissionRegions, CellRef, GLOBAL, ParamsView};
use keyspace_governor_common::admission::{
    KNOB_BURST, KNOB_ENFORCE_GLOBAL, P_BURST_ALLOWED, P_BURST_ENABLED, P_CAP, P_THROTTLED, counter as c, hist,
};
use std::sync::atomic::Ordering;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
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
    Waiting {
        bucket: u32,
        pos: u64,
    },
}

/// Like [`acquire`], but instead of refusing for want of CPU tokens, takes a
/// place in line. Refusals that are not about CPU (concurrency, write bytes,
/// the low-priority bucket) still come at once. A thread's `spare` tokens
/// serve it first, as in [`acquire_with`].
pub fn acquire_queued(
    r: &AdmissionRegions,
    k: &Knobs,
    keyspace: u32,
    cell: Option<CellRef>,
    demand: &Demand,
    spare: Option<&mut Spare>,
) -> Result<Queued, Refusal> {
    let buckets = RequestBuckets::of(r, cell);
    let done =
        |g, est, tenant_us, spared| Queued { g, est, tenant_us, burst_us: 0, stage: Stage::Done, topup: false, spared };
    let (g, est, throttled) = match prepare(r, k, &buckets, keyspace, cell, demand, spare)? {
        Prep::Done(g) => return Ok(done(g, 0, 0, false)),
        Prep::Spared { g, est } => return Ok(done(g, est, est, true)),
        Prep::Cpu { g, est, throttled } => (g, est, throttled),
    };
    Ok(Queued::start(&buckets, k, g, est, throttled, false, false))
}

/// A top-up of `us` for the running request `g`. With `ahead` (work that
/// runs to completion) it is served ahead of its keyspace's requests in line
/// (in the node's global bucket it waits in line): it takes
/// what the buckets hold and owes the rest, while what top-ups owe a bucket
/// stays within `ahead_bound`, and the next tokens pay it back; past
/// that, and without `ahead` (work that gives up at its deadline), it waits
/// in line like a new request. Its grant, once ready, holds only the top-up:
/// add it to `g` with [`Grant::absorb`].
pub fn top_up_queued(r: &AdmissionRegions, k: &Knobs, g: &Grant, us: u64, ahead: bool) -> Queued {
    let buckets = RequestBuckets::of(r, g.cell_at());
    let part = Grant {
        tenant_us: 0,
        global_us: 0,
        burst_us: 0,
        low_priority_us: 0,
        write_bytes: 0,
        counted: false,
        ..g.clone()
    };
    let throttled = buckets.tenant.is_some_and(|(_, p)| p.has(P_THROTTLED));
    if g.skipped {
        return Queued { g: part, est: 0, tenant_us: 0, burst_us: 0, stage: Stage::Done, topup: true, spared: false };
    }
    Queued::start(&buckets, k, part, us.max(1), throttled, true, ahead)
}

/// What top-ups may owe a bucket at once: three top-ups, never more than
/// the bucket's capacity but at least one top-up. A larger bound paces
/// running work less and moves the cap's 1 s windows more (a capacity, 50 ms
/// at 0.5 core: a window 7.8 % under the cap; docs/design.md).
fn ahead_bound(p: &ParamsView, k: &Knobs) -> u64 {
    p.capacity_us.load(Ordering::Relaxed).min(3 * k.per_allocation_us).max(k.per_allocation_us)
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
    /// Off the fast path (a request that may wait), and kept out of line so
    /// that the fast path's inlining does not depend on it.
    #[inline(never)]
    fn start(
        buckets: &RequestBuckets<'_>,
        k: &Knobs,
        g: Grant,
        est: u64,
        throttled: bool,
        topup: bool,
        ahead: bool,
    ) -> Queued {
        let mut q = Queued { g, est, tenant_us: 0, burst_us: 0, stage: Stage::Global(None), topup, spared: false };
        let Some((tenant, params)) = buckets.tenant.filter(|_| throttled) else { return q };
        if tenant.try_take(est) || (ahead && tenant.take_ahead(est, ahead_bound(params, k))) {
            q.tenant_us = est;
        } else if !params.has(P_CAP)
            && k.has(KNOB_BURST)
            && params.has(P_BURST_ENABLED)
            && params.has(P_BURST_ALLOWED)
            && take_burst(buckets.global, est)
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
        let buckets = RequestBuckets::of(r, self.g.cell_at());
        loop {
            match self.stage {
                Stage::Tenant(pos) => {
                    let Some((tenant, _)) = buckets.tenant else {
                        self.stage = Stage::Global(None);
                        continue;
                    };
                    if !tenant.reached(pos) {
                        return Progress::Waiting { bucket: buckets.tenant_index, pos };
                    }
                    self.tenant_us = self.est;
                    self.stage = Stage::Global(None);
                }
                Stage::Global(None) => {
                    let cap = buckets.tenant.is_some_and(|(_, p)| p.has(P_CAP));
                    if buckets.global.try_take(self.est) {
                        self.stage = Stage::Done;
                    } else if !cap && !k.has(KNOB_ENFORCE_GLOBAL) {
                        buckets.global.take_forced(self.est);
                        buckets.global.count(c::OVERDRAFT, 1);
                        self.stage = Stage::Done;
                    } else {
                        // Served ahead of its own keyspace's line only: in the
                        // node's line it waits with the other keyspaces' new
                        // requests, which its debt would make wait.
                        self.stage = Stage::Global(Some(buckets.global.reserve(self.est)));
                    }
                }
                Stage::Global(Some(pos)) => {
                    if !buckets.global.reached(pos) {
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
                        let on = buckets.tenant.map_or(buckets.global, |t| t.0);
                        if self.tenant_us > 0 {
                            on.add_inflight_us(self.tenant_us);
                        }
                        on.count(c::TOPUP_GRANTED, 1);
                        return Progress::Ready(part);
                    }
                    return Progress::Ready(finish(&buckets, g, self.est, self.tenant_us, self.burst_us, self.spared));
                }
            }
        }
    }

    /// Gives up: leaves every line, returns tokens and what the checks took.
    /// Returns the refusal the request ends with.
    pub fn cancel(self, r: &AdmissionRegions) -> Refusal {
        let buckets = RequestBuckets::of(r, self.g.cell_at());
        let keyspace = self.g.keyspace;
        let cap = buckets.tenant.is_some_and(|(_, p)| p.has(P_CAP));
        let refusal = match self.stage {
            Stage::Tenant(_) if cap => Refusal::TenantCpuExhausted { keyspace },
            Stage::Tenant(_) => Refusal::KeyspaceCpuExhaustedNoBurst { keyspace },
            _ => Refusal::GlobalCpuExhausted { keyspace },
        };
        let on = buckets.tenant.map_or(buckets.global, |t| t.0);
        if self.topup && self.stage != Stage::Done {
            on.count(c::TOPUP_REFUSED, 1);
        }
        match self.stage {
            Stage::Tenant(_) => {
                if let Some((tenant, _)) = buckets.tenant {
                    tenant.cancel(self.est);
                    if !self.topup {
                        tenant.count(if cap { c::REFUSED_CAP } else { c::REFUSED_QUOTA }, 1);
                    }
                }
            }
            Stage::Global(pos) => {
                if pos.is_some() {
                    buckets.global.cancel(self.est);
                }
                if let Some((tenant, params)) = buckets.tenant
                    && self.tenant_us > 0
                {
                    give_back(tenant, params, self.tenant_us);
                }
                if !self.topup {
                    on.count(c::REFUSED_GLOBAL, 1);
                }
            }
            Stage::Done => {}
        }
        if self.stage != Stage::Done && !self.topup {
            undo(r, &buckets, &self.g);
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
    /// Whether it is a running request's top-up rather than an admission.
    pub fn is_top_up(&self) -> bool {
        self.topup
    }

    pub fn wait_hist(&self, granted: bool) -> usize {
        match (self.topup, granted) {
            (false, true) => hist::WAIT_GRANTED,
            (false, false) => hist::WAIT_REFUSED,
            (true, true) => hist::RUNTIME_GRANTED,
            (true, false) => hist::RUNTIME_REFUSED,
        }
    }
}
