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
        (old, t)
    }
}
