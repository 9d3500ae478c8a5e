//! The thread clock and the tag switch: the userspace half of the charging
//! protocol (docs/design.md §3).

use crate::proto::BackendKind;
use crate::region::{Regions, SlotView};
use crate::sys;
use std::sync::atomic::Ordering;

/// This thread's on-CPU ns on the slot's timeline.
///
/// eBPF backend: `oncpu_ns` (kernel-maintained up to the last switch-in or
/// tick on this CPU) plus the time since then. The reads are valid when the
/// CPU's `seq` did not move and the thread stayed on that CPU; otherwise a
/// switch or a tick split them and we read again.
#[inline]
pub fn thread_clock(backend: BackendKind, regions: &Regions, slot: &SlotView) -> u64 {
    if backend == BackendKind::ThreadClock {
        return sys::thread_cputime_ns();
    }
    loop {
        let cpu1 = sys::current_cpu();
        let Some(cell) = regions.cpus.get(cpu1) else {
            // A CPU beyond the table (hot-added after the agent started):
            // report the kernel's figure so far rather than mix timelines.
            return slot.oncpu_ns.load(Ordering::Acquire);
        };
        let s1 = cell.seq.load(Ordering::Acquire);
        let last = cell.last_switch_ns.load(Ordering::Acquire);
        let on = slot.oncpu_ns.load(Ordering::Acquire);
        let now = match crate::tsc::now_ns(regions.header()) {
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
        if s1 == s2 && cpu1 == cpu2 && last != 0 {
            return on + now.saturating_sub(last);
        }
        std::hint::spin_loop();
    }
}

/// Charges this thread's time up to now to its current tag, unless the
/// kernel (or the fallback sampler) charged it already. One CAS on
/// `charged_ns` decides who charges each interval.
#[inline]
pub fn charge_now(backend: BackendKind, regions: &Regions, slot: &SlotView) {
    loop {
        let t = thread_clock(backend, regions, slot);
        let x = slot.charged_ns.load(Ordering::Acquire);
        if t <= x {
            return;
        }
        if let Some(charged_keyspace) = regions.try_charge(slot, x, t) {
            if charged_keyspace {
                // Only this thread writes it (the agent resets it while the
                // thread waits for its registration): no locked add needed.
                let own = slot.self_charged_ns.load(Ordering::Relaxed);
                slot.self_charged_ns.store(own + (t - x), Ordering::Relaxed);
            }
            return;
        }
    }
}

/// Closes the interval of the old tag and switches to `new_tag`; returns
/// the old tag.
#[inline]
pub fn switch_tag(backend: BackendKind, regions: &Regions, slot: &SlotView, new_tag: u64) -> u64 {
    let old = slot.tag.load(Ordering::Relaxed);
    if old == new_tag {
        return old;
    }
    charge_now(backend, regions, slot);
    slot.tag.store(new_tag, Ordering::Release);
    old
}
