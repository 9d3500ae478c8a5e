//! Sleeping in line on a shared bucket ([`BucketView`]): the sleep slots
//! (one futex bit each), the crowd, the wakes a move of the head makes, the
//! counts a sleep leaves, and what the agent does about the ones a dead
//! client left.

use super::bucket::signed;
use crate::region::BucketView;
use keyspace_governor_common::admission::{SLEEP_SLOTS, T_ASLEEP_MASK, asleep_flags};
use std::sync::atomic::{AtomicU64, Ordering};

/// The futex bit of the sleepers that wake at every move of the head
/// ([`BucketView::unslotted`]): blocked waiters that found every slot of
/// [`BucketView::sleep_at`] taken, and async waiter threads that found
/// none.
pub(crate) const CROWD: u32 = 1 << SLEEP_SLOTS;

impl BucketView {
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

    /// Counts a sleeper in a slot (after it wrote its place there).
    pub(crate) fn count_sleeper(&self) {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
    }

    /// Moves a counted sleeper whose slot was taken over into the crowd.
    pub(crate) fn join_crowd(&self) {
        self.unslotted.fetch_add(1, Ordering::SeqCst);
    }

    /// Moves a counted sleeper of the crowd that found a slot out of it
    /// (after it wrote its place into the slot).
    pub(crate) fn leave_crowd(&self) {
        self.uncount_crowd(1);
    }

    /// Uncounts a sleeper of slot `i`, freeing the slot if it still holds
    /// the sleeper's place `at`.
    pub(crate) fn leave_slot(&self, i: usize, at: u64) {
        self.uncount_sleepers(1);
        let _ = self.sleep_at[i].compare_exchange(at, 0, Ordering::SeqCst, Ordering::Relaxed);
    }

    /// Uncounts a sleeper counted by [`Self::sleep_unslotted`].
    pub(crate) fn wake_unslotted(&self) {
        self.uncount_sleepers(1);
        self.uncount_crowd(1);
    }

    /// Takes `n` sleepers off the count, never below zero (the agent takes
    /// a dead client's back, and a client's record may lie).
    pub(crate) fn uncount_sleepers(&self, n: u32) {
        let _ = self.sleepers.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |s| Some(s.saturating_sub(n)));
    }

    /// Takes `n` off the crowd's count, never below zero.
    fn uncount_crowd(&self, n: u64) {
        let _ = self.unslotted.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |s| Some(s.saturating_sub(n)));
    }

    /// Takes back what a dead client's ledger record says its thread
    /// counted asleep here ([`asleep_flags`]): `n` sleepers, and as many
    /// of the crowd if `unslotted`.
    pub fn take_back_asleep(&self, n: u64, unslotted: bool) {
        self.uncount_sleepers(u32::try_from(n).unwrap_or(u32::MAX));
        if unslotted {
            self.uncount_crowd(n);
        }
    }

    /// A slot of [`BucketView::sleep_at`] for a blocked waiter of `pos`: a
    /// free one, else one held for a place already served (its holder is
    /// awake, waking, or gone: a slot left by a client that died comes
    /// back). `None` when every slot holds a place still waiting.
    ///
    /// Taking over a served place wakes its slot's bit: the move that
    /// served it moves the head before it reads the slots, so it may not
    /// have seen that place yet, and would then read this one and leave the
    /// old holder asleep until this place is served (or its liveness check
    /// ends the sleep, 100 ms on).
    pub(crate) fn claim_sleep_slot(&self, pos: u64) -> Option<usize> {
        let take =
            |i: usize, at: u64| self.sleep_at[i].compare_exchange(at, pos, Ordering::SeqCst, Ordering::Relaxed).is_ok();
        if let Some(i) = (0..SLEEP_SLOTS).find(|&i| self.sleep_at[i].load(Ordering::Relaxed) == 0 && take(i, 0)) {
            return Some(i);
        }
        let head = self.head_us.load(Ordering::SeqCst);
        let i = (0..SLEEP_SLOTS).find(|&i| {
            let at = self.sleep_at[i].load(Ordering::Relaxed);
            at != 0 && signed(head.wrapping_sub(at)) >= 0 && take(i, at)
        })?;
        self.wake_slots(1 << i);
        Some(i)
    }

    /// Wakes the holders of the slots in `bits` whose places were taken
    /// from them (served). The word moves first: a holder that read it
    /// before its head check, but is not yet asleep in the kernel, then
    /// finds it changed instead of sleeping through this wake (the move
    /// that served it may have read the slot's new place, not its own).
    fn wake_slots(&self, bits: u32) {
        self.wake_seq.fetch_add(1, Ordering::SeqCst);
        crate::sys::futex_wake_bits(&self.wake_seq, bits);
    }

    /// Frees the slots of [`BucketView::sleep_at`] that hold places already
    /// served, and wakes them: the agent's sweep, for slots a client left
    /// when it died asleep (each would add its bit to every later wake
    /// mask). A live holder of such a slot is awake or waking and frees it
    /// itself; freeing it first and waking it again is harmless. Returns
    /// how many were freed.
    pub fn sweep_served_slots(&self) -> u32 {
        let head = self.head_us.load(Ordering::SeqCst);
        let mut bits = 0u32;
        for (i, s) in self.sleep_at.iter().enumerate() {
            let at = s.load(Ordering::Relaxed);
            if at != 0
                && signed(head.wrapping_sub(at)) >= 0
                && s.compare_exchange(at, 0, Ordering::SeqCst, Ordering::Relaxed).is_ok()
            {
                bits |= 1 << i;
            }
        }
        if bits != 0 {
            self.wake_slots(bits);
        }
        bits.count_ones()
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
        self.wait_recorded(pos, timeout, None);
    }

    /// [`Self::wait_for`], saying in a ledger record's flags (`record`: its
    /// flags, and this bucket's index) what the sleep counts on this
    /// bucket while it does, so the agent takes the counts back if the
    /// client dies asleep ([`asleep_flags`]).
    pub fn wait_recorded(&self, pos: u64, timeout: std::time::Duration, record: Option<(&AtomicU64, u32)>) {
        let slot = self.claim_sleep_slot(pos);
        let seq = self.wake_seq.load(Ordering::SeqCst);
        match slot {
            Some(_) => self.count_sleeper(),
            None => self.sleep_unslotted(),
        }
        // Only the record's thread writes its flags.
        if let Some((flags, index)) = record {
            flags.store(flags.load(Ordering::Relaxed) | asleep_flags(index, 1, slot.is_none()), Ordering::Relaxed);
        }
        if !self.reached(pos) {
            let deadline = crate::sys::monotonic_ns().saturating_add(timeout.as_nanos() as u64);
            crate::sys::futex_wait_bits(&self.wake_seq, seq, deadline, slot.map_or(CROWD, |i| 1 << i));
        }
        if let Some((flags, _)) = record {
            flags.store(flags.load(Ordering::Relaxed) & !T_ASLEEP_MASK, Ordering::Relaxed);
        }
        match slot {
            Some(i) => self.leave_slot(i, pos),
            None => self.wake_unslotted(),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::region::{AdmissionMemory, GLOBAL};

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

    /// A thread asleep on the global bucket of `m` for `pos` (10 s at
    /// most), once it is counted asleep; it returns how long it slept.
    fn asleep_for(m: &std::sync::Arc<AdmissionMemory>, pos: u64) -> std::thread::JoinHandle<std::time::Duration> {
        use std::time::Duration;
        let (m2, t) = (m.clone(), std::time::Instant::now());
        let h = std::thread::spawn(move || {
            m2.regions.bucket(GLOBAL).wait_for(pos, Duration::from_secs(10));
            t.elapsed()
        });
        while m.regions.bucket(GLOBAL).sleepers.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(20));
        h
    }

    #[test]
    fn a_served_slot_taken_over_before_the_move_reads_it_wakes_its_holder() {
        use std::sync::atomic::Ordering;
        use std::time::{Duration, Instant};
        let m = std::sync::Arc::new(AdmissionMemory::create(16).unwrap());
        let b = m.regions.bucket(GLOBAL);
        // Every slot but the first holds a place far down the line.
        for s in &b.sleep_at[1..] {
            s.store(u64::MAX / 2, Ordering::SeqCst);
        }
        let first = b.reserve(10);
        let second = b.reserve(10);
        let holder = asleep_for(&m, first);
        assert_eq!(b.sleep_at[0].load(Ordering::SeqCst), first);
        // The head moves past the first place; the move has not read the
        // slots yet when the next waiter takes the first one's slot over.
        b.head_us.fetch_add(10, Ordering::SeqCst);
        let word = b.wake_seq.load(Ordering::SeqCst);
        let m3 = m.clone();
        let next = std::thread::spawn(move || m3.regions.bucket(GLOBAL).wait_for(second, Duration::from_secs(10)));
        let woke = holder.join().unwrap();
        assert!(woke < Duration::from_secs(2), "the first waiter slept {woke:?} past its place");
        // The takeover moved the word too: a holder that read it but was
        // not asleep yet does not go to sleep on it.
        assert_ne!(b.wake_seq.load(Ordering::SeqCst), word, "the takeover left the word");
        assert_eq!(b.sleep_at[0].load(Ordering::SeqCst), second, "the slot serves the next place");
        let t = Instant::now();
        b.give(10, u64::MAX / 4);
        next.join().unwrap();
        assert!(t.elapsed() < Duration::from_secs(2), "the next waiter woke when served: {:?}", t.elapsed());
    }

    #[test]
    fn the_sweep_frees_and_wakes_served_slots_and_leaves_waiting_ones() {
        use std::sync::atomic::Ordering;
        use std::time::Duration;
        let m = std::sync::Arc::new(AdmissionMemory::create(16).unwrap());
        let b = m.regions.bucket(GLOBAL);
        b.give(5, 100);
        let pos = b.reserve(15);
        assert!(!b.reached(pos));
        let asleep = asleep_for(&m, pos);
        // A place a dead client left, served long ago; one still waiting.
        b.sleep_at[3].store(5, Ordering::SeqCst);
        b.sleep_at[5].store(u64::MAX / 2, Ordering::SeqCst);
        let word = b.wake_seq.load(Ordering::SeqCst);
        assert_eq!(b.sweep_served_slots(), 1, "only the dead client's place is served");
        assert_ne!(b.wake_seq.load(Ordering::SeqCst), word, "the sweep moved the word");
        assert_eq!(b.sleep_at[3].load(Ordering::SeqCst), 0);
        assert_eq!(b.sleep_at[0].load(Ordering::SeqCst), pos, "a place not served keeps its slot");
        // The head passes the sleeper's place, and no move wakes it: the sweep does.
        b.head_us.fetch_add(10, Ordering::SeqCst);
        assert_eq!(b.sweep_served_slots(), 1);
        let woke = asleep.join().unwrap();
        assert!(woke < Duration::from_secs(2), "asleep {woke:?} past its place");
        assert_eq!(b.sleep_at[5].load(Ordering::SeqCst), u64::MAX / 2, "a waiting place stays");
        assert_eq!(b.sleep_at.iter().filter(|s| s.load(Ordering::SeqCst) != 0).count(), 1);
    }
}
