//! Spare tokens: what a thread keeps of its tickets' refunds for its next
//! ticket of the same keyspace.
//!
//! A request that used less CPU than it was granted gives the rest back.
//! Given back to the buckets, the next request of the same thread takes it
//! again: two compare-and-swaps on lines every thread of the keyspace
//! writes, for tokens that come straight back. A thread instead keeps up to
//! one request's worth ([`SPARE_MAX_US`] at most) and admits its next
//! request of that keyspace from it, touching no shared line.
//!
//! The tokens stay taken from both buckets while spare, so the cap holds:
//! a keyspace can never run on more tokens than its buckets handed out.
//! What changes is only who holds them, and that is bounded: a thread
//! holds at most [`SPARE_MAX_US`], and gives it back at once when anyone
//! waits. A spare is used, and a refund kept, only while both buckets have
//! no line and no debt (`head ≥ tail`) and nobody sleeps on them; otherwise
//! the spare goes back to the buckets, which wakes the waiters, and the
//! request takes the ordinary path. Spare tokens count in the bucket's µs
//! in flight (taken, not yet consumed nor returned), and the client mirrors
//! them in its ledger, so the agent gets them back when the client dies.

use super::bucket::give_back;
use crate::region::{AdmissionRegions, BucketView, CellRef, GLOBAL, ParamsView};
use keyspace_governor_common::admission::P_SHRINK_DEBT;
use std::sync::atomic::Ordering;

/// The most a thread keeps spare, µs.
pub const SPARE_MAX_US: u64 = 1000;

/// One thread's spare tokens: `us` taken from keyspace cell `cell`'s bucket
/// and from the global bucket, not yet used.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Spare {
    /// (cell, generation) the tokens came from.
    pub cell: Option<CellRef>,
    pub us: u64,
}

/// Whether a bucket lets a thread use or keep spare tokens: no line, no
/// debt, nobody asleep on it.
#[inline]
pub(crate) fn quiet(b: &BucketView) -> bool {
    b.sleepers.load(Ordering::Relaxed) == 0 && b.available_us() >= 0
}

/// The tenant bucket of `cell`, if the cell still belongs to the keyspace
/// that took the tokens.
#[inline]
pub(crate) fn tenant_of(r: &AdmissionRegions, cell: Option<CellRef>) -> Option<(&BucketView, &ParamsView)> {
    let CellRef { index: c, generation } = cell?;
    r.keyspace_cell(c).filter(|(_, p)| p.generation.load(Ordering::Acquire) == generation)
}

impl Spare {
    /// Takes `us` for a new request of `cell` if the spare holds that much
    /// and both buckets are quiet. A spare of another keyspace, or one that
    /// meets a line or debt, goes back to its buckets.
    #[inline]
    pub(crate) fn take(&mut self, r: &AdmissionRegions, cell: Option<CellRef>, us: u64) -> bool {
        if self.us == 0 {
            return false;
        }
        if self.cell == cell
            && let Some((tenant, params)) = tenant_of(r, cell)
            && may_keep(r, tenant, params)
        {
            if self.us < us {
                // Too little for this request: kept for a smaller one.
                return false;
            }
            self.us -= us;
            return true;
        }
        self.give_back(r);
        false
    }

    /// Gives every spare µs back to the buckets it came from (a cell given
    /// to another keyspace since gets nothing; the global bucket still
    /// does).
    pub fn give_back(&mut self, r: &AdmissionRegions) {
        let us = std::mem::take(&mut self.us);
        if us == 0 {
            return;
        }
        return_tokens(r, self.cell, us);
    }
}

/// Returns `us` spare µs of `cell` to its buckets: the agent does this for
/// the spare of a client that died.
pub fn return_tokens(r: &AdmissionRegions, cell: Option<CellRef>, us: u64) {
    if let Some(p) = r.params.get(GLOBAL) {
        give_back(r.bucket(GLOBAL), p, us);
    }
    if let Some((tenant, params)) = tenant_of(r, cell) {
        give_back(tenant, params, us);
        tenant.sub_inflight_us(us);
    }
}

/// Whether spare tokens of `tenant` may be used, or a refund kept: both
/// buckets quiet, and no quota shrink draining what is in flight.
#[inline]
pub(crate) fn may_keep(r: &AdmissionRegions, tenant: &BucketView, params: &ParamsView) -> bool {
    !params.has(P_SHRINK_DEBT) && quiet(tenant) && quiet(r.bucket(GLOBAL))
}
