//! Token operations on a shared bucket ([`BucketView`]): take, give back,
//! charge debt, wait in line, refill.
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
use keyspace_governor_common::admission::{P_SHRINK_DEBT, SLEEP_SLOTS, counter as c};
use std::sync::atomic::Ordering;

/// CAS attempts before an operation settles for a bounded fallback.
const ATTEMPTS: u32 = 64;

/// The futex bit of the sleepers that wake at every move of the head
/// ([`BucketView::unslotted`]): blocked waiters that found every slot of
/// [`BucketView::sleep_at`] taken.
pub(crate) const CROWD: u32 = 1 << SLEEP_SLOTS;

#[inline]
fn signed(d: u64) -> i64 {
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

    /// Wakes every thread waiting on this bucket, if any (the agent went
    /// away: they all admit now).
    #[inline]
    pub fn notify(&self) {
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            self.wake_seq.fetch_add(1, Ordering::SeqCst);
            crate::sys::futex_wake(&self.wake_seq, i32::MAX);
        }
    }

    /// After `head_us` moved to `to`: wakes the blocked waiters whose
    /// places it served, each under its slot's bit, and the sleepers that
    /// wake at every move (under [`CROWD`]: blocked waiters without a slot;
    /// async waiters, whose thread sleeps in `futex_waitv`, which matches
    /// every bit), and leaves the rest of the line asleep: no system call
    /// when nobody is due. The word still moves, so a waiter about to sleep
    /// re-checks instead.
    #[inline]
    pub fn notify_served(&self, to: u64) {
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            self.wake_seq.fetch_add(1, Ordering::SeqCst);
            let mask = self.served_mask(to);
            if mask != 0 {
                crate::sys::futex_wake_bits(&self.wake_seq, mask);
            }
        }
    }

    /// The wake mask of a head at `to`: the bits of the slots whose places
    /// it reached, and [`CROWD`] while anyone sleeps unslotted.
    pub(crate) fn served_mask(&self, to: u64) -> u32 {
        let mut mask = if self.unslotted.load(Ordering::SeqCst) > 0 { CROWD } else { 0 };
        for (i, s) in self.sleep_at.iter().enumerate() {
            let at = s.load(Ordering::SeqCst);
            if at != 0 && signed(to.wrapping_sub(at)) >= 0 {
                mask |= 1 << i;
            }
        }
        mask
    }

    /// Counts a sleeper that wakes at every move (before it reads the word
    /// and the head, as a slot's place is written).
    pub(crate) fn sleep_unslotted(&self) {
        self.unslotted.fetch_add(1, Ordering::SeqCst);
        self.sleepers.fetch_add(1, Ordering::SeqCst);
    }

    /// Uncounts a sleeper counted by [`Self::sleep_unslotted`].
    pub(crate) fn wake_unslotted(&self) {
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        let _ = self.unslotted.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }

    /// A slot of [`BucketView::sleep_at`] for a blocked waiter of `pos`:
    /// a free one, or one held for a place already served (its holder is
    /// awake or waking, and frees the slot only while it still holds its
    /// own place, so a slot left by a client that died comes back too).
    /// `None` when every slot holds a place still waiting.
    fn claim_sleep_slot(&self, pos: u64) -> Option<usize> {
        let head = self.head_us.load(Ordering::SeqCst);
        self.sleep_at.iter().position(|s| {
            let at = s.load(Ordering::Relaxed);
            (at == 0 || signed(head.wrapping_sub(at)) >= 0)
                && s.compare_exchange(at, pos, Ordering::SeqCst, Ordering::Relaxed).is_ok()
        })
    }

    /// Blocks the calling thread until `pos` is served (a move of the head
    /// that reaches it), the agent goes away, or `timeout` passes; the
    /// caller re-checks. Never waits when `pos` is already served.
    ///
    /// The waiter writes its place into a slot before it reads the word and
    /// the head, and a waker moves the head before it reads the slots (all
    /// sequentially consistent): a waker that read the slot before the
    /// place was in it moved the head before the waiter looked, so the
    /// waiter does not sleep for a place that move served.
    pub fn wait_for(&self, pos: u64, timeout: std::time::Duration) {
        let slot = self.claim_sleep_slot(pos);
        let seq = self.wake_seq.load(Ordering::SeqCst);
        match slot {
            Some(_) => {
                self.sleepers.fetch_add(1, Ordering::SeqCst);
            }
            None => self.sleep_unslotted(),
        }
        if !self.reached(pos) {
            let deadline = crate::sys::monotonic_ns().saturating_add(timeout.as_nanos() as u64);
            crate::sys::futex_wait_bits(&self.wake_seq, seq, deadline, slot.map_or(CROWD, |i| 1 << i));
        }
        match slot {
            Some(i) => {
                self.sleepers.fetch_sub(1, Ordering::SeqCst);
                let _ = self.sleep_at[i].compare_exchange(pos, 0, Ordering::SeqCst, Ordering::Relaxed);
            }
            None => self.wake_unslotted(),
        }
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

    #[test]
    fn a_waiter_is_woken_by_a_give_from_another_thread() {
        let m = std::sync::Arc::new(AdmissionMemory::create(16).unwrap());
        let m2 = m.clone();
        let pos = m.regions.bucket(GLOBAL).reserve(10);
        let t = std::time::Instant::now();
        let giver = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            m2.regions.bucket(GLOBAL).give(10, 100);
        });
        let b = m.regions.bucket(GLOBAL);
        while !b.reached(pos) {
            b.wait_for(pos, std::time::Duration::from_secs(5));
        }
        giver.join().unwrap();
        let waited = t.elapsed();
        assert!(
            waited >= std::time::Duration::from_millis(45) && waited < std::time::Duration::from_secs(2),
            "{waited:?}"
        );
    }

    proptest::proptest! {
        /// A head wakes the slots of the places it reached, never one it
        /// has not, and the crowd only while someone sleeps unslotted.
        #[test]
        fn a_head_wakes_exactly_the_places_it_reached(base in 1u64..1 << 40, places in proptest::collection::vec(1u64..100_000, 1..31), to in 0u64..100_000) {
            let m = AdmissionMemory::create(16).unwrap();
            let b = m.regions.bucket(GLOBAL);
            for (i, &p) in places.iter().enumerate() {
                b.sleep_at[i].store(base + p, std::sync::atomic::Ordering::Relaxed);
            }
            let mask = b.served_mask(base + to);
            proptest::prop_assert!(mask & super::CROWD == 0, "nobody sleeps unslotted");
            b.unslotted.store(1, std::sync::atomic::Ordering::Relaxed);
            proptest::prop_assert_eq!(b.served_mask(base + to), mask | super::CROWD);
            for (i, &p) in places.iter().enumerate() {
                proptest::prop_assert_eq!(mask & (1 << i) != 0, p <= to, "slot {} at {}", i, p);
            }
            for i in places.len()..31 {
                proptest::prop_assert!(mask & (1 << i) == 0, "free slot {} woken", i);
            }
        }
    }

    #[test]
    fn a_waiter_that_finds_every_slot_taken_sleeps_in_the_crowd_and_is_woken() {
        use std::sync::atomic::Ordering;
        use std::time::Duration;
        let m = std::sync::Arc::new(AdmissionMemory::create(16).unwrap());
        let b = m.regions.bucket(GLOBAL);
        // Every slot holds a place far down the line, not yet served.
        for s in &b.sleep_at {
            s.store(u64::MAX / 2, Ordering::SeqCst);
        }
        let pos = b.reserve(10);
        let m2 = m.clone();
        let waiter = std::thread::spawn(move || m2.regions.bucket(GLOBAL).wait_for(pos, Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(b.unslotted.load(Ordering::SeqCst), 1, "counted in the crowd");
        assert_eq!(b.served_mask(b.head_us.load(Ordering::SeqCst)), super::CROWD);
        let t = std::time::Instant::now();
        b.give(10, 100);
        waiter.join().unwrap();
        assert!(t.elapsed() < Duration::from_secs(1), "woken when served: {:?}", t.elapsed());
        assert_eq!((b.unslotted.load(Ordering::SeqCst), b.sleepers.load(Ordering::SeqCst)), (0, 0));
        assert!(b.sleep_at.iter().all(|s| s.load(Ordering::SeqCst) == u64::MAX / 2), "no slot taken over");
    }

    #[test]
    fn a_move_short_of_a_place_leaves_its_waiter_asleep() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::time::Duration;
        let m = std::sync::Arc::new(AdmissionMemory::create(16).unwrap());
        let b = m.regions.bucket(GLOBAL);
        // A waiter 8 ms of tokens back in line.
        let _ahead = b.reserve(8000);
        let pos = b.reserve(10);
        let woke = std::sync::Arc::new(AtomicBool::new(false));
        let (m2, woke2) = (m.clone(), woke.clone());
        let waiter = std::thread::spawn(move || {
            m2.regions.bucket(GLOBAL).wait_for(pos, Duration::from_secs(5));
            woke2.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(50));
        // Serves 2 ms of those ahead: not its place.
        b.give(2000, u64::MAX / 4);
        std::thread::sleep(Duration::from_millis(100));
        assert!(!woke.load(Ordering::SeqCst), "a waiter whose place was not reached woke");
        // Its slot holds its place; serving up to one short of it leaves it asleep.
        assert_eq!(b.sleep_at[0].load(Ordering::SeqCst), pos);
        b.give(pos - 1 - 2000, u64::MAX / 4);
        std::thread::sleep(Duration::from_millis(100));
        assert!(!woke.load(Ordering::SeqCst), "woken one µs short of its place");
        // Serving the rest wakes it at once.
        let t = std::time::Instant::now();
        b.give(1, u64::MAX / 4);
        waiter.join().unwrap();
        assert!(b.reached(pos));
        assert_eq!(b.sleep_at[0].load(Ordering::SeqCst), 0, "the slot was freed");
        assert!(t.elapsed() < Duration::from_secs(1), "woken when served: {:?}", t.elapsed());
    }
}
