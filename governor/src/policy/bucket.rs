//! Token operations on a shared bucket ([`BucketView`]): take, give back,
//! charge debt, take a place in line, refill. Sleeping in line is
//! [`super::sleep`]'s.
//!
//! Tokens are CPU µs held as two monotonic rovers (see
//! [`keyspace_governor_common::admission::BucketCell`]): `tail_us` moves forward for
//! every µs taken, `head_us` for every µs made available, and `head − tail`
//! is what is available. Taking is a CAS on `tail_us` that never drives the
//! bucket below zero; a waiter instead takes its place in line with a
//! fetch-add and is served when `head_us` passes it. Every loop here is
//! bounded: memory that other processes keep rewriting makes an operation
//! give up (refuse, or keep less), never spin.

use crate::region::{BucketView, ParamsView};
use keyspace_governor_common::admission::{P_SHRINK_DEBT, counter as c};
use std::sync::atomic::Ordering;

/// CAS attempts before an operation settles for a bounded fallback.
const ATTEMPTS: u32 = 64;

/// A rover difference as a signed distance.
#[inline]
pub(super) fn signed(d: u64) -> i64 {
    d as i64
}

impl BucketView {
    /// `head − tail`, less what top-ups owe, µs: negative when in debt or
    /// when waiters queue.
    #[inline]
    pub fn available_us(&self) -> i64 {
        let tail = self.tail_us.load(Ordering::Acquire);
        let owed = self.ahead_owed_us.load(Ordering::Acquire);
        signed(self.head_us.load(Ordering::Acquire).wrapping_sub(tail).wrapping_sub(owed))
    }

    /// Takes `us` if that many are available (so never while waiters queue).
    #[inline]
    pub fn try_take(&self, us: u64) -> bool {
        let mut tail = self.tail_us.load(Ordering::Acquire);
        for _ in 0..ATTEMPTS {
            let head = self.head_us.load(Ordering::Acquire);
            if signed(head.wrapping_sub(tail)) < signed(us) {
                return false;
            }
            match self.tail_us.compare_exchange_weak(tail, tail.wrapping_add(us), Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(t) => tail = t,
            }
        }
        // Contended past the bound: take a place in line and keep it only if
        // it is served at once.
        let pos = self.reserve(us);
        if self.reached(pos) {
            return true;
        }
        self.cancel(us);
        false
    }

    /// Takes `us` unconditionally (best-effort global tracking).
    #[inline]
    pub fn take_forced(&self, us: u64) {
        self.tail_us.fetch_add(us, Ordering::AcqRel);
    }

    /// Takes a place in line for `us`: returns the position `head_us` must
    /// reach for the caller to be served.
    #[inline]
    pub fn reserve(&self, us: u64) -> u64 {
        self.tail_us.fetch_add(us, Ordering::AcqRel).wrapping_add(us)
    }

    /// Whether a place in line at `pos` is served.
    #[inline]
    pub fn reached(&self, pos: u64) -> bool {
        signed(self.head_us.load(Ordering::SeqCst).wrapping_sub(pos)) >= 0
    }

    /// Leaves the line (or gives back a reservation): returns `us` to the
    /// head, unclamped, so whoever queued behind moves up by as much. (A
    /// refund, as the agent derives refunds from the head.)
    pub fn cancel(&self, us: u64) {
        let head = self.head_us.fetch_add(us, Ordering::SeqCst);
        self.notify_served(head.wrapping_add(us));
    }

    /// A running request's top-up of `us`, taken ahead of the line: it
    /// does not wait behind new admissions queued earlier. What the bucket
    /// holds is taken first; the rest is owed, never more than `bound` at
    /// once, and the next tokens made available ([`BucketView::give`]) pay
    /// it before anyone in line is served, so the line (and new admissions)
    /// repays it. Returns false, taking nothing, when the rest would owe
    /// past `bound`.
    pub fn take_ahead(&self, us: u64, bound: u64) -> bool {
        for _ in 0..ATTEMPTS {
            let tail = self.tail_us.load(Ordering::Acquire);
            let head = self.head_us.load(Ordering::Acquire);
            let part = (signed(head.wrapping_sub(tail)).max(0) as u64).min(us);
            let rest = us - part;
            if self.ahead_owed_us.load(Ordering::Acquire).saturating_add(rest) > bound {
                return false;
            }
            if part > 0
                && self
                    .tail_us
                    .compare_exchange_weak(tail, tail.wrapping_add(part), Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
            {
                continue;
            }
            if rest == 0 || self.owe(rest, bound) {
                self.count(c::AHEAD_US, rest);
                return true;
            }
            // Others owed meanwhile: what was taken goes back.
            if part > 0 {
                self.cancel(part);
            }
            return false;
        }
        false
    }

    /// Adds `us` to what top-ups owe if that stays within `bound`.
    fn owe(&self, us: u64, bound: u64) -> bool {
        let mut owed = self.ahead_owed_us.load(Ordering::Acquire);
        for _ in 0..ATTEMPTS {
            if owed.saturating_add(us) > bound {
                return false;
            }
            match self.ahead_owed_us.compare_exchange_weak(owed, owed + us, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(o) => owed = o,
            }
        }
        false
    }

    /// Pays up to `us` of what top-ups owe; returns what it paid. Off the
    /// fast path: a refund finds nothing owed.
    #[cold]
    #[inline(never)]
    fn pay_ahead(&self, us: u64) -> u64 {
        let mut owed = self.ahead_owed_us.load(Ordering::Acquire);
        for _ in 0..ATTEMPTS {
            let pay = owed.min(us);
            if pay == 0 {
                return 0;
            }
            match self.ahead_owed_us.compare_exchange_weak(owed, owed - pay, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return pay,
                Err(o) => owed = o,
            }
        }
        0
    }

    /// Adds `us` to what is available, never above `capacity`, after paying
    /// what top-ups took ahead of the line. Returns the µs kept, paid ones
    /// included (the rest is dropped). Wakes waiters.
    pub fn give(&self, us: u64, capacity: u64) -> u64 {
        if us == 0 {
            return 0;
        }
        let paid = if self.ahead_owed_us.load(Ordering::Relaxed) > 0 { self.pay_ahead(us) } else { 0 };
        let us = us - paid;
        if us == 0 {
            return paid;
        }
        let mut head = self.head_us.load(Ordering::Acquire);
        let mut kept = 0;
        for _ in 0..ATTEMPTS {
            let tail = self.tail_us.load(Ordering::Acquire);
            // Room below capacity (none if the bucket is above it already).
            let room = signed(tail.wrapping_add(capacity).wrapping_sub(head)).max(0) as u64;
            kept = us.min(room);
            if kept == 0 {
                break;
            }
            match self.head_us.compare_exchange_weak(head, head.wrapping_add(kept), Ordering::SeqCst, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(h) => {
                    head = h;
                    kept = 0;
                }
            }
        }
        if kept > 0 {
            self.notify_served(head.wrapping_add(kept));
        }
        paid + kept
    }

    /// Charges an overrun of `us` as debt, never below `−max_debt`. Returns
    /// (charged, forgiven).
    pub fn charge_debt(&self, us: u64, max_debt: u64) -> (u64, u64) {
        if us == 0 {
            return (0, 0);
        }
        let mut tail = self.tail_us.load(Ordering::Acquire);
        for _ in 0..ATTEMPTS {
            let head = self.head_us.load(Ordering::Acquire);
            // How far tail may go: to head + max_debt.
            let room = signed(head.wrapping_add(max_debt).wrapping_sub(tail)).max(0) as u64;
            let add = us.min(room);
            if add == 0 {
                return (0, us);
            }
            match self.tail_us.compare_exchange_weak(tail, tail.wrapping_add(add), Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return (add, us - add),
                Err(t) => tail = t,
            }
        }
        (0, us)
    }

    /// Agent: drops every available token (a quota shrink below what is in
    /// flight), never touching debt or queued waiters. Returns µs dropped.
    pub fn drop_available(&self) -> u64 {
        self.clamp_available(0)
    }

    /// Agent: drops tokens above `limit` available (a capacity shrink).
    /// Returns µs dropped.
    pub fn clamp_available(&self, limit: u64) -> u64 {
        let mut head = self.head_us.load(Ordering::Acquire);
        for _ in 0..ATTEMPTS {
            let tail = self.tail_us.load(Ordering::Acquire);
            let over = signed(head.wrapping_sub(tail.wrapping_add(limit)));
            if over <= 0 {
                return 0;
            }
            match self.head_us.compare_exchange_weak(
                head,
                head.wrapping_sub(over as u64),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return over as u64,
                Err(h) => head = h,
            }
        }
        0
    }

    /// Agent: forgets every token and debt (a cell given to a new keyspace,
    /// with nothing in flight and nobody waiting). Returns the tail, where
    /// the new holder's count of taken tokens starts.
    pub fn reset_tokens(&self) -> u64 {
        self.ahead_owed_us.store(0, Ordering::Release);
        let tail = self.tail_us.load(Ordering::Acquire);
        self.head_us.store(tail, Ordering::Release);
        tail
    }
}

/// Returns `us` to a bucket, counting as discarded what capacity did not
/// let it keep. (Refunds are not counted here: the agent derives them from
/// `head_us`, see `BucketSnapshot::of`, which saves the fast path an atomic
/// add per bucket.)
#[inline]
pub(crate) fn give_back(b: &BucketView, p: &ParamsView, us: u64) {
    // In shrink debt nothing comes back until in-flight drains.
    let kept = if p.has(P_SHRINK_DEBT) { 0 } else { b.give(us, p.capacity_us.load(Ordering::Relaxed)) };
    if kept < us {
        b.count(c::DISCARDED_US, us - kept);
    }
}

#[cfg(test)]
mod tests {
    use crate::region::{AdmissionMemory, GLOBAL};

    #[test]
    fn take_never_below_zero_and_give_never_above_capacity() {
        let m = AdmissionMemory::create(16).unwrap();
        let b = m.regions.bucket(GLOBAL);
        assert_eq!(b.give(200, 200), 200);
        assert!(b.try_take(150));
        assert!(!b.try_take(51));
        assert!(b.try_take(50));
        assert_eq!(b.available_us(), 0);
        assert_eq!(b.give(500, 200), 200, "clamped at capacity");
        assert_eq!(b.available_us(), 200);
    }

    #[test]
    fn a_top_up_taken_ahead_is_served_before_the_line_and_paid_by_the_next_tokens() {
        let m = AdmissionMemory::create(16).unwrap();
        let b = m.regions.bucket(GLOBAL);
        // Empty, with a new admission of 300 in line.
        let pos = b.reserve(300);
        assert!(!b.reached(pos));
        // A running request's top-up goes ahead, within the bound only.
        assert!(b.take_ahead(200, 250));
        assert!(!b.take_ahead(100, 250), "past the bound");
        assert_eq!(b.available_us(), -500, "the line and what is owed");
        // The next 200 tokens pay the top-up, not the one in line.
        assert_eq!(b.give(150, 1000), 150);
        assert!(!b.reached(pos));
        // 50 pay the rest of the top-up, 50 go to the line.
        assert_eq!(b.give(100, 1000), 100);
        assert!(!b.reached(pos));
        assert_eq!(b.give(250, 1000), 250);
        assert!(b.reached(pos));
        assert_eq!(b.available_us(), 0);
        assert_eq!(b.counter(keyspace_governor_common::admission::counter::AHEAD_US), 200);
        assert_eq!(b.ahead_owed_us.load(std::sync::atomic::Ordering::Relaxed), 0);
        // What the bucket holds goes first: 100 held, 150 owed.
        b.give(100, 1000);
        assert!(b.take_ahead(250, 250));
        assert_eq!(b.available_us(), -150);
        assert_eq!(b.counter(keyspace_governor_common::admission::counter::AHEAD_US), 350);
    }

    #[test]
    fn debt_is_bounded_and_repaid_by_later_tokens() {
        let m = AdmissionMemory::create(16).unwrap();
        let b = m.regions.bucket(GLOBAL);
        b.give(100, 100);
        assert!(b.try_take(100));
        assert_eq!(b.charge_debt(150, 1000), (150, 0));
        assert_eq!(b.available_us(), -150);
        assert_eq!(b.charge_debt(2000, 1000), (850, 1150), "never below −max_debt");
        assert_eq!(b.available_us(), -1000);
        assert!(!b.try_take(1));
        b.give(1100, 100);
        assert_eq!(b.available_us(), 100);
    }

    #[test]
    fn waiters_are_served_in_arrival_order_and_newcomers_cannot_overtake() {
        let m = AdmissionMemory::create(16).unwrap();
        let b = m.regions.bucket(GLOBAL);
        let first = b.reserve(30);
        let second = b.reserve(30);
        assert!(!b.try_take(1), "a newcomer sees the queue");
        b.give(40, 100);
        assert!(b.reached(first) && !b.reached(second));
        // The first leaves its place: the second moves up by as much.
        b.cancel(30);
        assert!(b.reached(second));
        assert_eq!(b.available_us(), 10);
    }

    #[test]
    fn a_shrink_drops_available_tokens_but_not_debt() {
        let m = AdmissionMemory::create(16).unwrap();
        let b = m.regions.bucket(GLOBAL);
        b.give(500, 500);
        assert_eq!(b.clamp_available(200), 300);
        assert_eq!(b.drop_available(), 200);
        assert_eq!(b.available_us(), 0);
        b.charge_debt(50, 100);
        assert_eq!(b.drop_available(), 0);
        assert_eq!(b.available_us(), -50);
    }
}
