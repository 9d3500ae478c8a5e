//! The thread clock and the tag switch: the userspace half of the charging
//! protocol (docs/design.md §3).

use crate::proto::BackendKind;
use crate::region::{ClockView, MeasureRegions, SlotView};
use crate::sys;
use std::sync::atomic::Ordering;

/// Attempts before a read split by switches falls back to the syscall, and
/// before a charge that keeps losing its CAS leaves the interval to the
/// kernel (which charges it at the thread's next switch-out). Neither
/// bound is reached in normal operation; they keep a thread from spinning
/// on memory that something else keeps rewriting.
const ATTEMPTS: u32 = 16;

/// A registered thread's view of its slot.
#[derive(Clone, Copy)]
pub(crate) struct ThreadRef<'a> {
    pub backend: BackendKind,
    pub measure: &'a MeasureRegions,
    /// The agent's TSC mapping.
    pub clock: &'a ClockView,
    pub slot: &'a SlotView,
    /// `cpu_owner(slot, generation)`: how the kernel marks this thread's
    /// anchor in a CPU's record.
    pub owner: u64,
}

impl ThreadRef<'_> {
    /// This thread's CPU time on the kernel's timeline (the value of
    /// `CLOCK_THREAD_CPUTIME_ID`), without a syscall.
    ///
    /// eBPF backend: the runtime the kernel recorded at this thread's
    /// switch-in plus the time since then. The reads are valid when the CPU's
    /// `seq` did not move and the thread stayed on that CPU; otherwise a switch
    /// split them and we read again. An anchor that is not this thread's
    /// current one (see [`keyspace_governor_common::CpuCell`]) is not used: the thread
    /// reads the syscall, which is the same timeline.
    #[inline]
    pub fn clock(&self) -> u64 {
        if self.backend == BackendKind::ThreadClock {
            return sys::thread_cputime_ns();
        }
        for _ in 0..ATTEMPTS {
            let cpu1 = sys::current_cpu();
            // A CPU beyond the table (hot-added after the agent started).
            let Some(cell) = self.measure.cpus.get(cpu1) else { break };
            let s1 = cell.seq.load(Ordering::Acquire);
            let last = cell.last_switch_ns.load(Ordering::Acquire);
            let owner = cell.owner.load(Ordering::Acquire);
            let base = cell.base_ns.load(Ordering::Acquire);
            let on = self.slot.oncpu_ns.load(Ordering::Acquire);
            let now = match crate::tsc::now_ns(self.clock) {
                Some(t) if t >= last => t,
                // No mapping, or one that reads before the kernel's own switch
                // time: the vDSO is the kernel's clock.
                _ => sys::monotonic_ns(),
            };
            // The CPU is read again before the sequence, so a thread that
            // left this CPU and came back between the two reads of `seq` is
            // caught by one check or the other.
            let cpu2 = sys::current_cpu_ordered();
            let s2 = cell.seq.load(Ordering::Acquire);
            if s1 == s2 && cpu1 == cpu2 {
                if owner != self.owner || base != on || last == 0 {
                    break;
                }
                return base + now.saturating_sub(last);
            }
            std::hint::spin_loop();
        }
        sys::thread_cputime_ns()
    }

    /// Charges this thread's time up to now to its current tag, unless the
    /// kernel (or the fallback sampler) charged it already. One CAS on
    /// `charged_ns` decides who charges each interval. Returns the clock it
    /// read.
    #[inline]
    pub fn charge_now(&self) -> u64 {
        let mut t = 0;
        for _ in 0..ATTEMPTS {
            t = self.clock();
            let x = self.slot.charged_ns.load(Ordering::Acquire);
            if t <= x {
                return t;
            }
            if let Some(charged_keyspace) = self.measure.try_charge(self.slot, x, t) {
                if charged_keyspace {
                    // Only this thread writes it (the agent resets it while the
                    // thread waits for its registration): no locked add needed.
                    let own = self.slot.self_charged_ns.load(Ordering::Relaxed);
                    self.slot.self_charged_ns.store(own.wrapping_add(t - x), Ordering::Relaxed);
                }
                return t;
            }
        }
        t
    }

    /// Closes the interval of the old tag and switches to `new_tag`; returns
    /// the old tag and the thread clock at the switch (0 when the tag did not
    /// change: nothing was read).
    #[inline]
    pub fn switch_tag(&self, new_tag: u64) -> (u64, u64) {
        let old = self.slot.tag.load(Ordering::Relaxed);
        if old == new_tag {
            return (old, 0);
        }
        let t = self.charge_now();
        self.slot.tag.store(new_tag, Ordering::Release);
        // A run-queue wait the thread began untagged (a pooled worker woken
        // for work) is the first work it takes after it: the kernel charges
        // it there at the switch-out. It writes `wait_tag` only while the
        // thread is off its CPU.
        if new_tag != keyspace_governor_common::TAG_NONE && self.slot.wait_tag.load(Ordering::Relaxed) == 0 {
            self.slot.wait_tag.store(new_tag as u32, Ordering::Relaxed);
        }
        (old, t)
    }
}

/// The protocol's userspace half on plain memory: the kernel's side (its
/// switch records, its charges) is written by the test, the CPU and the
/// clocks come from the syscall seam's double.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::{HeaderView, Table};
    use crate::sys::fake::{self, Fake};
    use keyspace_governor_common::tag_for_cell;
    use std::sync::Arc;

    const OWNER: u64 = 0x5_0000_0001;
    /// The thread's runtime at its switch-in, as the kernel recorded it.
    const BASE: u64 = 40_000_000;
    /// When that switch happened on the CPU, CLOCK_MONOTONIC.
    const SWITCH: u64 = 9_000_000_000;

    struct World {
        measure: Arc<MeasureRegions>,
        header: Table<HeaderView>,
    }

    /// Two CPUs, the thread on CPU 1 since `SWITCH`, four keyspace cells.
    fn world() -> World {
        let measure =
            Arc::new(MeasureRegions { cpus: Table::zeroed(2), slots: Table::zeroed(4), keyspaces: Table::zeroed(4) });
        let cpu = measure.cpus.get(1).unwrap();
        cpu.seq.store(6, Ordering::Relaxed);
        cpu.last_switch_ns.store(SWITCH, Ordering::Relaxed);
        cpu.owner.store(OWNER, Ordering::Relaxed);
        cpu.base_ns.store(BASE, Ordering::Relaxed);
        let slot = measure.slots.get(0).unwrap();
        slot.oncpu_ns.store(BASE, Ordering::Relaxed);
        slot.charged_ns.store(BASE, Ordering::Relaxed);
        World { measure, header: Table::zeroed(1) }
    }

    impl World {
        fn thread(&self) -> ThreadRef<'_> {
            ThreadRef {
                backend: BackendKind::Ebpf,
                measure: &self.measure,
                clock: &self.header.get(0).unwrap().clock,
                slot: self.measure.slots.get(0).unwrap(),
                owner: OWNER,
            }
        }

        fn keyspace_ns(&self, cell: u32) -> u64 {
            self.measure.keyspaces.get(cell).unwrap().cpu_ns.load(Ordering::Relaxed)
        }
    }

    /// On CPU 1, `since` ns after the switch; the syscall would read `syscall`.
    fn at(since: u64, syscall: u64) -> Fake {
        Fake {
            cpu: Some(Box::new(|| 1)),
            monotonic_ns: Some(SWITCH + since),
            thread_cputime_ns: Some(syscall),
            ..Default::default()
        }
    }

    #[test]
    fn the_clock_is_the_runtime_at_switch_in_plus_the_time_since() {
        let w = world();
        let _f = fake::install(at(300_000, 1));
        assert_eq!(w.thread().clock(), BASE + 300_000);
    }

    #[test]
    fn an_anchor_that_is_not_this_threads_current_one_reads_the_syscall() {
        let w = world();
        let _f = fake::install(at(300_000, 77));
        let cpu = w.measure.cpus.get(1).unwrap();
        // Another thread's anchor (the kernel switched this one out).
        cpu.owner.store(OWNER + 1, Ordering::Relaxed);
        assert_eq!(w.thread().clock(), 77);
        cpu.owner.store(OWNER, Ordering::Relaxed);
        // An anchor of an earlier switch-in than the slot's.
        w.measure.slots.get(0).unwrap().oncpu_ns.store(BASE + 1, Ordering::Relaxed);
        assert_eq!(w.thread().clock(), 77);
        // A CPU beyond the table (hot-added after the agent started).
        fake::set(|f| f.cpu = Some(Box::new(|| 5)));
        assert_eq!(w.thread().clock(), 77);
    }

    #[test]
    fn a_read_split_by_a_migration_or_a_switch_is_read_again() {
        let w = world();
        // First attempt: read on CPU 0, then on CPU 1 (migrated between).
        let mut calls = 0;
        let _f = fake::install(Fake {
            cpu: Some(Box::new(move || {
                calls += 1;
                if calls == 1 { 0 } else { 1 }
            })),
            ..at(500_000, 1)
        });
        assert_eq!(w.thread().clock(), BASE + 500_000);
        // First attempt: the kernel switched on CPU 1 during the reads.
        let (m, mut calls) = (w.measure.clone(), 0);
        fake::set(|f| {
            f.cpu = Some(Box::new(move || {
                calls += 1;
                if calls == 2 {
                    m.cpus.get(1).unwrap().seq.fetch_add(2, Ordering::Relaxed);
                }
                1
            }))
        });
        assert_eq!(w.thread().clock(), BASE + 500_000);
        // A CPU record rewritten at every read: the syscall after 16 tries.
        let (m, mut tries) = (w.measure.clone(), 0u32);
        fake::set(|f| {
            f.cpu = Some(Box::new(move || {
                tries += 1;
                m.cpus.get(1).unwrap().seq.fetch_add(2, Ordering::Relaxed);
                assert!(tries <= 2 * ATTEMPTS, "bounded");
                1
            }))
        });
        assert_eq!(w.thread().clock(), 1);
    }

    #[test]
    fn a_tsc_reading_before_the_kernels_switch_time_falls_back_to_the_vdso() {
        let w = world();
        let h = &w.header.get(0).unwrap().clock;
        // A published mapping: one tick per ns, anchored at SWITCH.
        h.tsc_base.store(0, Ordering::Relaxed);
        h.ns_base.store(SWITCH, Ordering::Relaxed);
        h.mult.store(1 << 32, Ordering::Relaxed);
        h.clock_valid.store(1, Ordering::Relaxed);
        let _f = fake::install(Fake { tsc: Some(Some(200_000)), ..at(900_000, 1) });
        assert_eq!(w.thread().clock(), BASE + 200_000, "the TSC, not the vDSO");
        // The mapping lags the kernel's clock: it reads before the switch.
        w.measure.cpus.get(1).unwrap().last_switch_ns.store(SWITCH + 250_000, Ordering::Relaxed);
        assert_eq!(w.thread().clock(), BASE + 650_000, "the vDSO");
    }

    #[test]
    fn each_interval_is_charged_once_to_the_tag_it_ran_under() {
        let w = world();
        let slot = w.measure.slots.get(0).unwrap();
        let _f = fake::install(at(300_000, 1));
        // Untagged until now: the interval closes without a keyspace.
        assert_eq!(w.thread().switch_tag(tag_for_cell(2)), (0, BASE + 300_000));
        assert_eq!((w.keyspace_ns(2), slot.charged_ns.load(Ordering::Relaxed)), (0, BASE + 300_000));
        // Same tag again: nothing is read or charged.
        assert_eq!(w.thread().switch_tag(tag_for_cell(2)), (tag_for_cell(2), 0));
        fake::set(|f| f.monotonic_ns = Some(SWITCH + 1_000_000));
        assert_eq!(w.thread().switch_tag(tag_for_cell(3)), (tag_for_cell(2), BASE + 1_000_000));
        assert_eq!(w.keyspace_ns(2), 700_000, "cell 2's 0.7 ms");
        assert_eq!(slot.self_charged_ns.load(Ordering::Relaxed), 700_000, "charged by the thread itself");
        // The kernel charged past the thread's clock (at a switch-out the
        // thread has not seen): the thread charges nothing until it catches up.
        slot.charged_ns.store(BASE + 1_500_000, Ordering::Relaxed);
        fake::set(|f| f.monotonic_ns = Some(SWITCH + 1_200_000));
        assert_eq!(w.thread().charge_now(), BASE + 1_200_000);
        assert_eq!((w.keyspace_ns(3), slot.charged_ns.load(Ordering::Relaxed)), (0, BASE + 1_500_000));
        fake::set(|f| f.monotonic_ns = Some(SWITCH + 1_600_000));
        w.thread().charge_now();
        assert_eq!(w.keyspace_ns(3), 100_000, "only what the kernel had not charged");
        assert_eq!(w.keyspace_ns(2), 700_000);
    }

    #[test]
    fn the_thread_clock_backend_reads_the_syscall() {
        let w = world();
        let _f = fake::install(at(300_000, 123));
        let t = ThreadRef { backend: BackendKind::ThreadClock, ..w.thread() };
        assert_eq!(t.clock(), 123);
    }
}
