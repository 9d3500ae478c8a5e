//! Atomic mirrors of the measurement layouts, and the charge step.

use super::MeasureRegions;
use keyspace_governor_common::{
    BEHIND_SLOTS, CpuCell, KeyspaceCell, KeyspaceWait, ThreadSlot, WAIT_BUCKETS, cell_of_tag,
};
use std::mem::{offset_of, size_of};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Atomic mirror of [`CpuCell`].
#[repr(C)]
pub struct CpuView {
    pub seq: AtomicU64,
    pub last_switch_ns: AtomicU64,
    pub owner: AtomicU64,
    pub base_ns: AtomicU64,
    pub mono_offset_ns: AtomicU64,
    pub fresh_task_ns: AtomicU64,
    pub offset_valid: AtomicU64,
    _behind: u64,
}

/// Atomic mirror of [`ThreadSlot`].
#[repr(C)]
pub struct SlotView {
    pub oncpu_ns: AtomicU64,
    pub charged_ns: AtomicU64,
    pub tag: AtomicU64,
    pub generation: AtomicU64,
    pub tid: AtomicU32,
    pub state: AtomicU32,
    pub tgid: AtomicU32,
    pub wait_tag: AtomicU32,
    pub self_charged_ns: AtomicU64,
    pub delay_ns: AtomicU64,
}

/// Atomic mirror of [`KeyspaceCell`].
#[repr(C)]
pub struct KeyspaceView {
    pub cpu_ns: AtomicU64,
    _pad: [u64; 7],
}

/// Atomic mirror of [`KeyspaceWait`].
#[repr(C)]
pub struct WaitView {
    pub wait_ns: AtomicU64,
    pub hist: [AtomicU64; WAIT_BUCKETS],
    pub behind_runner: [AtomicU32; BEHIND_SLOTS],
    pub behind_ns: [AtomicU64; BEHIND_SLOTS],
    pub behind_other_ns: AtomicU64,
    pub waiting: AtomicU64,
    pub some_since_ns: AtomicU64,
    pub some_ns: AtomicU64,
    pub some_closed_ns: AtomicU64,
}

impl WaitView {
    /// One waiting thread fewer, as the kernel's program counts it at a
    /// switch-in (`stop_waiting`): the last closes the "some" stretch at
    /// `now_ns` (CLOCK_MONOTONIC, the program's clock). For a thread the
    /// program can no longer see (its slot released while it waited).
    pub fn stop_waiting(&self, now_ns: u64) {
        let since = self.some_since_ns.load(Ordering::Acquire);
        match self.waiting.fetch_sub(1, Ordering::AcqRel) {
            1 => {
                self.some_ns.fetch_add(now_ns.saturating_sub(since), Ordering::AcqRel);
                self.some_closed_ns.store(now_ns, Ordering::Release);
            }
            // Never counted: the count goes back.
            0 => {
                self.waiting.fetch_add(1, Ordering::AcqRel);
            }
            _ => {}
        }
    }
}

macro_rules! same_layout {
    ($view:ty, $cell:ty, $($f:ident),*) => {
        const _: () = assert!(size_of::<$view>() == size_of::<$cell>());
        $(const _: () = assert!(offset_of!($view, $f) == offset_of!($cell, $f));)*
    };
}
pub(super) use same_layout;

same_layout!(CpuView, CpuCell, seq, last_switch_ns, owner, base_ns, mono_offset_ns, fresh_task_ns, offset_valid);
same_layout!(
    SlotView,
    ThreadSlot,
    oncpu_ns,
    charged_ns,
    tag,
    generation,
    tid,
    state,
    tgid,
    wait_tag,
    self_charged_ns,
    delay_ns
);
same_layout!(KeyspaceView, KeyspaceCell, cpu_ns);
same_layout!(
    WaitView,
    KeyspaceWait,
    wait_ns,
    hist,
    behind_runner,
    behind_ns,
    behind_other_ns,
    waiting,
    some_since_ns,
    some_ns,
    some_closed_ns
);

impl MeasureRegions {
    /// One attempt at the protocol's charge: move `slot.charged_ns` from
    /// `from` (as the caller read it) to `to` with one CAS and, on success,
    /// add the interval to the keyspace of the slot's tag. `None`: another
    /// party (kernel, thread or agent) moved `charged_ns` first; read again.
    /// `Some(true)` when a keyspace was charged, `Some(false)` when the slot
    /// was untagged. The tag is read before the CAS, so it is the tag the
    /// interval ran under whoever charges.
    #[inline]
    pub fn try_charge(&self, slot: &SlotView, from: u64, to: u64) -> Option<bool> {
        let tag = slot.tag.load(Ordering::Acquire);
        slot.charged_ns.compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire).ok()?;
        let cell = cell_of_tag(tag).and_then(|i| self.keyspaces.get(i));
        if let Some(cell) = cell {
            cell.cpu_ns.fetch_add(to - from, Ordering::Relaxed);
        }
        Some(cell.is_some())
    }
}
