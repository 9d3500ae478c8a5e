//! The token bucket cell: plain atomics, no pointers, no locks.
//!
//! `#[repr(C)]` and made only of `AtomicI64`/`AtomicU64`, so the same layout can later live in a
//! shared-memory region. Tokens are CPU microseconds. The fast path (`try_take`, `refund`,
//! `charge_debt`, `settle`) runs on any thread; `refill` and the limit setters are for the agent
//! loop. Every token movement is counted, so the ledger identity
//! `available = refilled − taken + refunded − debt − discarded` holds at every quiescent point.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use serde::Serialize;

/// One token bucket (96 bytes, 8-byte aligned, no implicit padding).
#[repr(C)]
#[derive(Debug, Default)]
pub struct BucketCell {
    /// Tokens available now, µs. Signed: negative means debt (overrun charged after the fact).
    available_us: AtomicI64,
    /// Upper bound of `available_us`, µs. Never exceeded by refill or refund.
    capacity_us: AtomicI64,
    /// Tokens added per refill interval now (possibly reduced by dynamic/fair adjustment), µs.
    refill_us: AtomicU64,
    /// Tokens per refill interval from the quota source (config, PD, tenant cap), µs.
    base_refill_us: AtomicU64,
    /// Tokens granted and not yet released, µs. Drives quota-shrink debt and idle eviction.
    inflight_us: AtomicU64,
    /// 1 while a quota shrink left more in flight than the new quota: no refill until it drains.
    debt_mode: AtomicU64,
    /// Cumulative tokens taken by grants (including forced best-effort takes), µs.
    taken_total_us: AtomicU64,
    /// Cumulative tokens given back by refunds and rollbacks (before clamping), µs.
    refunded_total_us: AtomicU64,
    /// Cumulative overrun charged as debt, µs.
    debt_total_us: AtomicU64,
    /// Cumulative tokens added by refills (and the initial fill), µs.
    refilled_total_us: AtomicU64,
    /// Cumulative tokens dropped because they would have exceeded capacity (or by shrink), µs.
    discarded_total_us: AtomicU64,
    /// Number of refused `try_take` calls.
    refused_total: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<BucketCell>() == 96);
const _: () = assert!(std::mem::align_of::<BucketCell>() == 8);

fn to_i64(us: u64) -> i64 {
    i64::try_from(us).unwrap_or(i64::MAX)
}

/// A plain-number copy of a bucket, for snapshots and tests.
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
    /// `refilled − taken + refunded − debt − discarded`; equals `available_us` when quiescent.
    pub fn ledger_available_us(&self) -> i64 {
        self.refilled_total_us as i64 - self.taken_total_us as i64 + self.refunded_total_us as i64
            - self.debt_total_us as i64
            - self.discarded_total_us as i64
    }
}

impl BucketCell {
    /// A full bucket with the given refill per interval and capacity (µs).
    pub fn new(refill_us: u64, capacity_us: u64) -> Self {
        let cell = BucketCell::default();
        cell.capacity_us
            .store(to_i64(capacity_us), Ordering::Relaxed);
        cell.refill_us.store(refill_us, Ordering::Relaxed);
        cell.base_refill_us.store(refill_us, Ordering::Relaxed);
        cell.available_us
            .store(to_i64(capacity_us), Ordering::Relaxed);
        cell.refilled_total_us.store(capacity_us, Ordering::Relaxed);
        cell
    }

    /// Takes `us` tokens if at least that many are available. Never drives `available` below 0.
    pub fn try_take(&self, us: u64) -> bool {
        let want = to_i64(us);
        let mut cur = self.available_us.load(Ordering::Acquire);
        loop {
            if cur < want {
                self.refused_total.fetch_add(1, Ordering::Relaxed);
                return false;
            }
            match self.available_us.compare_exchange_weak(
                cur,
                cur - want,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(actual) => cur = actual,
            }
        }
        self.inflight_us.fetch_add(us, Ordering::Relaxed);
        self.taken_total_us.fetch_add(us, Ordering::Relaxed);
        true
    }

    /// Takes `us` tokens unconditionally (may go negative). Best-effort global tracking only.
    pub fn force_take(&self, us: u64) {
        self.available_us.fetch_sub(to_i64(us), Ordering::AcqRel);
        self.inflight_us.fetch_add(us, Ordering::Relaxed);
        self.taken_total_us.fetch_add(us, Ordering::Relaxed);
    }

    /// Gives `us` tokens back, clamped at capacity (the excess is counted as discarded).
    pub fn refund(&self, us: u64) {
        if us == 0 {
            return;
        }
        let add = to_i64(us);
        let mut cur = self.available_us.load(Ordering::Acquire);
        loop {
            let cap = self.capacity_us.load(Ordering::Acquire);
            let next = cur.saturating_add(add).min(cap.max(cur));
            match self.available_us.compare_exchange_weak(
                cur,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.refunded_total_us.fetch_add(us, Ordering::Relaxed);
                    let dropped = add - (next - cur);
                    if dropped > 0 {
                        self.discarded_total_us
                            .fetch_add(dropped as u64, Ordering::Relaxed);
                    }
                    return;
                }
                Err(actual) => cur = actual,
            }
        }
    }

    /// Charges an overrun of `us` as debt: `available` may go negative.
    pub fn charge_debt(&self, us: u64) {
        if us == 0 {
            return;
        }
        self.available_us.fetch_sub(to_i64(us), Ordering::AcqRel);
        self.debt_total_us.fetch_add(us, Ordering::Relaxed);
    }

    /// Undoes a successful `try_take(us)` (refund and drop it from in-flight).
    pub fn rollback(&self, us: u64) {
        self.refund(us);
        self.inflight_us.fetch_sub(us, Ordering::AcqRel);
    }

    /// Closes a grant of `granted_us`: refunds the unused part or charges the overrun as debt.
    pub fn settle(&self, granted_us: u64, consumed_us: u64) {
        if consumed_us < granted_us {
            self.refund(granted_us - consumed_us);
        } else {
            self.charge_debt(consumed_us - granted_us);
        }
        self.inflight_us.fetch_sub(granted_us, Ordering::AcqRel);
    }

    /// Agent: adds `intervals × refill_us`, clamped at capacity. Skipped while in quota-shrink debt
    /// and in-flight still exceeds the quota. Returns the tokens actually added.
    pub fn refill(&self, intervals: u64) -> u64 {
        let refill = self.refill_us.load(Ordering::Acquire);
        if self.debt_mode.load(Ordering::Acquire) != 0 {
            if self.inflight_us.load(Ordering::Acquire)
                > self.base_refill_us.load(Ordering::Acquire)
            {
                return 0;
            }
            self.debt_mode.store(0, Ordering::Release);
        }
        let amount = refill.saturating_mul(intervals);
        if amount == 0 {
            return 0;
        }
        self.refilled_total_us.fetch_add(amount, Ordering::Relaxed);
        let before = self.available_us.load(Ordering::Acquire);
        self.refund_inner(amount);
        (self.available_us.load(Ordering::Acquire) - before).max(0) as u64
    }

    fn refund_inner(&self, us: u64) {
        // Same clamp as `refund`, but counted as refill rather than refund.
        let add = to_i64(us);
        let mut cur = self.available_us.load(Ordering::Acquire);
        loop {
            let cap = self.capacity_us.load(Ordering::Acquire);
            let next = cur.saturating_add(add).min(cap.max(cur));
            match self.available_us.compare_exchange_weak(
                cur,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    let dropped = add - (next - cur);
                    if dropped > 0 {
                        self.discarded_total_us
                            .fetch_add(dropped as u64, Ordering::Relaxed);
                    }
                    return;
                }
                Err(actual) => cur = actual,
            }
        }
    }

    /// Agent: sets the quota (base refill) and capacity. When the quota is *reduced* below what
    /// is in flight, the bucket enters debt: positive tokens are dropped and refill pauses until
    /// in-flight drains to the new quota. An unchanged or raised quota never enters debt (the
    /// seed's rule is about shrinks only). Tokens above the new capacity are dropped.
    pub fn set_quota(&self, base_refill_us: u64, capacity_us: u64) {
        let old_base = self.base_refill_us.swap(base_refill_us, Ordering::AcqRel);
        self.refill_us.store(base_refill_us, Ordering::Release);
        self.capacity_us
            .store(to_i64(capacity_us), Ordering::Release);
        let shrunk = base_refill_us < old_base;
        let limit = if shrunk && self.inflight_us.load(Ordering::Acquire) > base_refill_us {
            self.debt_mode.store(1, Ordering::Release);
            0
        } else {
            to_i64(capacity_us)
        };
        self.clamp_available(limit);
    }

    /// Agent: sets the current refill per interval (dynamic / fair adjustment), µs.
    pub fn set_refill(&self, refill_us: u64) {
        self.refill_us.store(refill_us, Ordering::Release);
    }

    fn clamp_available(&self, limit: i64) {
        let mut cur = self.available_us.load(Ordering::Acquire);
        while cur > limit {
            match self.available_us.compare_exchange_weak(
                cur,
                limit,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.discarded_total_us
                        .fetch_add((cur - limit) as u64, Ordering::Relaxed);
                    return;
                }
                Err(actual) => cur = actual,
            }
        }
    }

    pub fn available_us(&self) -> i64 {
        self.available_us.load(Ordering::Acquire)
    }
    pub fn capacity_us(&self) -> i64 {
        self.capacity_us.load(Ordering::Acquire)
    }
    pub fn refill_us(&self) -> u64 {
        self.refill_us.load(Ordering::Acquire)
    }
    pub fn base_refill_us(&self) -> u64 {
        self.base_refill_us.load(Ordering::Acquire)
    }
    pub fn inflight_us(&self) -> u64 {
        self.inflight_us.load(Ordering::Acquire)
    }
    pub fn in_debt(&self) -> bool {
        self.debt_mode.load(Ordering::Acquire) != 0
    }

    /// A plain-number copy of every field.
    pub fn snapshot(&self) -> BucketSnapshot {
        BucketSnapshot {
            available_us: self.available_us(),
            capacity_us: self.capacity_us(),
            refill_us: self.refill_us(),
            base_refill_us: self.base_refill_us(),
            inflight_us: self.inflight_us(),
            in_debt: self.in_debt(),
            taken_total_us: self.taken_total_us.load(Ordering::Relaxed),
            refunded_total_us: self.refunded_total_us.load(Ordering::Relaxed),
            debt_total_us: self.debt_total_us.load(Ordering::Relaxed),
            refilled_total_us: self.refilled_total_us.load(Ordering::Relaxed),
            discarded_total_us: self.discarded_total_us.load(Ordering::Relaxed),
            refused_total: self.refused_total.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_never_goes_below_zero_and_refund_never_exceeds_capacity() {
        let b = BucketCell::new(100, 200);
        assert!(b.try_take(150));
        assert!(!b.try_take(51));
        assert!(b.try_take(50));
        assert_eq!(b.available_us(), 0);
        b.refund(500);
        assert_eq!(b.available_us(), 200);
        let s = b.snapshot();
        assert_eq!(s.ledger_available_us(), s.available_us);
        assert_eq!(s.discarded_total_us, 300);
    }

    #[test]
    fn debt_is_repaid_by_refill() {
        let b = BucketCell::new(100, 100);
        assert!(b.try_take(100));
        b.settle(100, 250);
        assert_eq!(b.available_us(), -150);
        assert!(!b.try_take(1));
        assert_eq!(b.refill(1), 100);
        assert_eq!(b.available_us(), -50);
        b.refill(2);
        assert_eq!(b.available_us(), 100);
        assert_eq!(b.inflight_us(), 0);
        let s = b.snapshot();
        assert_eq!(s.ledger_available_us(), s.available_us);
    }

    #[test]
    fn quota_shrink_below_inflight_enters_debt_until_drained() {
        let b = BucketCell::new(1000, 1000);
        assert!(b.try_take(800));
        b.set_quota(500, 500);
        assert!(b.in_debt());
        assert_eq!(b.available_us(), 0);
        assert_eq!(b.refill(1), 0, "no refill while inflight > new quota");
        b.settle(800, 800);
        assert_eq!(b.refill(1), 500);
        assert!(!b.in_debt());
        let s = b.snapshot();
        assert_eq!(s.ledger_available_us(), s.available_us);
    }

    #[test]
    fn unchanged_or_raised_quota_never_enters_debt() {
        let b = BucketCell::new(1000, 10_000);
        assert!(b.try_take(4000));
        b.set_quota(1000, 10_000); // same quota, 4000 in flight > 1000
        assert!(!b.in_debt());
        assert_eq!(b.available_us(), 6000, "no tokens dropped");
        b.set_quota(2000, 20_000); // raised, still below in flight
        assert!(!b.in_debt());
        assert_eq!(b.available_us(), 6000);
        b.set_quota(1500, 15_000); // reduced below in flight: debt
        assert!(b.in_debt());
        assert_eq!(b.available_us(), 0);
    }
}
