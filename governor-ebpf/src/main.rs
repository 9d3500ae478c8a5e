//! governor's eBPF programs.
//!
//! # Layout
//!
//! - `gov_sched_switch` (`tp_btf/sched_switch`): closes the slice of the task
//!   being switched out (`current` is still `prev` there) and opens the next.
//! - `gov_timer` (`perf_event`, a software CPU clock per CPU): closes the slice
//!   of whatever runs now, so a long query is charged while it runs.
//! - `gov_exit` (`tp_btf/sched_process_exit`): closes the last slice of an
//!   exiting registered thread and marks its slot dead for the agent to reuse.
//!
//! None of them reads a `task_struct` field: the task is identified through
//! `bpf_get_current_pid_tgid`, so one object runs on every kernel with BTF,
//! on x86_64 and aarch64, without CO-RE relocations.
//!
//! The charging protocol (see docs/design.md §3): the kernel accumulates
//! `oncpu_ns` and charges `oncpu_ns - charged_ns` to the slot's tag; the
//! thread charges its own intervals with one CAS on `charged_ns`. The kernel
//! only writes a slot while its thread cannot run (switched out, interrupted
//! or in its exit path), so plain stores suffice on the slot; keyspace totals
//! are shared by all CPUs and use an atomic add.
#![no_std]
#![no_main]
#![feature(core_intrinsics)]
#![allow(internal_features)]

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns},
    macros::{btf_tracepoint, map, perf_event},
    maps::{Array, HashMap},
    programs::{BtfTracePointContext, PerfEventContext},
};
use aya_log_ebpf::error;
use core::ptr::{addr_of_mut, read_volatile, write_volatile};
use governor_common::{
    cell_of_tag, CpuCell, KeyspaceCell, ThreadSlot, DEFAULT_MAX_KEYSPACES, DEFAULT_MAX_THREADS,
    MAX_CPUS, SLOT_DEAD, SLOT_LIVE, DEFAULT_MAX_TIDS, FLAG_COUNT, FLAG_RULES,
};

/// `BPF_F_MMAPABLE`: the array's values can be mmapped by userspace.
const BPF_F_MMAPABLE: u32 = 1 << 10;

#[map]
static GOV_CPUS: Array<CpuCell> = Array::with_max_entries(MAX_CPUS, BPF_F_MMAPABLE);
#[map]
static GOV_SLOTS: Array<ThreadSlot> = Array::with_max_entries(DEFAULT_MAX_THREADS, BPF_F_MMAPABLE);
#[map]
static GOV_KEYSPACES: Array<KeyspaceCell> =
    Array::with_max_entries(DEFAULT_MAX_KEYSPACES, BPF_F_MMAPABLE);
/// `tid → slot + 1` (0: not registered), one entry per possible tid
/// (`kernel.pid_max`): an array lookup is a bounds check and an add, where a
/// hash lookup would hash the key on every context switch. The agent writes
/// it through its own mmap.
/// Array values are padded to 8 bytes, so two tids share an entry: entry
/// `tid / 2`, half `tid % 2`; userspace sees one dense `u32` per tid.
#[map]
static GOV_TID_SLOT: Array<[u32; 2]> = Array::with_max_entries(DEFAULT_MAX_TIDS / 2, BPF_F_MMAPABLE);

/// `tid → slot + 1` entry of `tid`, if the table covers it.
#[inline(always)]
fn tid_entry(tid: u32) -> Option<*mut u32> {
    let pair = GOV_TID_SLOT.get_ptr_mut(tid >> 1)?;
    // SAFETY: in-bounds element of the pair the map returned.
    Some(unsafe { (pair as *mut u32).add((tid & 1) as usize) })
}
/// `tgid → tag` for unmodified processes measured by rule.
#[map]
static GOV_TGID_RULES: HashMap<u32, u64> = HashMap::with_max_entries(1024, 0);
/// Agent-set switches: [FLAG_RULES] is non-zero when any rule exists, so
/// the common case skips the rules hash lookup.
#[map]
static GOV_FLAGS: Array<u64> = Array::with_max_entries(FLAG_COUNT, 0);

#[inline(always)]
fn charge(tag: u64, delta: u64) {
    let Some(index) = cell_of_tag(tag) else { return };
    if let Some(cell) = GOV_KEYSPACES.get_ptr_mut(index) {
        // SAFETY: the pointer comes from the array map and stays valid for
        // the program's run; the add is atomic against other CPUs.
        unsafe {
            core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
                addr_of_mut!((*cell).cpu_ns),
                delta,
            );
        }
    }
}

/// Closes the running slice on this CPU at `now`: charges it to the current
/// task's slot (or its rule) and starts the next slice.
#[inline(always)]
fn close_slice(now: u64, pid_tgid: u64) -> Option<*mut ThreadSlot> {
    let cpu = unsafe { bpf_get_smp_processor_id() };
    let cell = GOV_CPUS.get_ptr_mut(cpu)?;
    let tid = pid_tgid as u32;
    let mut found = None;
    // SAFETY: map value pointers are valid for this run; this CPU is the
    // only writer of its cell.
    unsafe {
        let last = read_volatile(addr_of_mut!((*cell).last_switch_ns));
        let slot = match tid_entry(tid).map(|e| read_volatile(e)) {
            Some(index) if index != 0 => GOV_SLOTS.get_ptr_mut(index - 1),
            _ => None,
        }
        // Only a live slot that still names this thread: a slot handed to
        // another thread since the tid entry was read is left alone.
        .filter(|&s| {
            read_volatile(addr_of_mut!((*s).tid)) == tid && read_volatile(addr_of_mut!((*s).state)) == SLOT_LIVE
        });
        if let Some(s) = slot {
            found = Some(s);
            if last != 0 && now > last {
                let on = read_volatile(addr_of_mut!((*s).oncpu_ns)) + (now - last);
                write_volatile(addr_of_mut!((*s).oncpu_ns), on);
                let charged = read_volatile(addr_of_mut!((*s).charged_ns));
                if on > charged {
                    charge(read_volatile(addr_of_mut!((*s).tag)), on - charged);
                    write_volatile(addr_of_mut!((*s).charged_ns), on);
                }
            }
        } else if last != 0 && now > last && GOV_FLAGS.get(FLAG_RULES).is_some_and(|f| *f != 0) {
            if let Some(tag) = GOV_TGID_RULES.get(&((pid_tgid >> 32) as u32)) {
                charge(*tag, now - last);
            }
        }
        write_volatile(addr_of_mut!((*cell).last_switch_ns), now);
        let seq = read_volatile(addr_of_mut!((*cell).seq));
        write_volatile(addr_of_mut!((*cell).seq), seq + 1);
    }
    found
}

#[btf_tracepoint(function = "sched_switch")]
pub fn gov_sched_switch(_ctx: BtfTracePointContext) -> i32 {
    let now = unsafe { bpf_ktime_get_ns() };
    close_slice(now, bpf_get_current_pid_tgid());
    0
}

/// Does nothing: `cargo xtask bench` attaches it beside `gov_sched_switch`
/// to measure the floor that the kernel's BPF run-time statistics add to
/// any program on this machine. The agent never attaches it.
#[btf_tracepoint(function = "sched_switch")]
pub fn gov_calibrate(_ctx: BtfTracePointContext) -> i32 {
    0
}

/// Reads the clock and nothing else: with [`gov_calibrate`], what one
/// `bpf_ktime_get_ns` costs on this machine. Benchmark only.
#[btf_tracepoint(function = "sched_switch")]
pub fn gov_calibrate_clock(_ctx: BtfTracePointContext) -> i32 {
    let now = unsafe { bpf_ktime_get_ns() };
    (now & 1) as i32
}

#[perf_event]
pub fn gov_timer(_ctx: PerfEventContext) -> u32 {
    let cpu = unsafe { bpf_get_smp_processor_id() };
    if let Some(cell) = GOV_CPUS.get_ptr_mut(cpu) {
        // SAFETY: map value pointer, valid for this run.
        if unsafe { read_volatile(addr_of_mut!((*cell).busy)) } != 0 {
            return 0; // interrupted the exit hook mid-slice: skip this tick
        }
    }
    let now = unsafe { bpf_ktime_get_ns() };
    close_slice(now, bpf_get_current_pid_tgid());
    0
}

#[btf_tracepoint(function = "sched_process_exit")]
pub fn gov_exit(ctx: BtfTracePointContext) -> i32 {
    let now = unsafe { bpf_ktime_get_ns() };
    let pid_tgid = bpf_get_current_pid_tgid();
    let tid = pid_tgid as u32;
    let Some(entry) = tid_entry(tid) else { return 0 };
    // SAFETY: map value pointer, valid for this run.
    let index = unsafe { read_volatile(entry) };
    if index == 0 {
        return 0;
    }
    if GOV_SLOTS.get_ptr_mut(index - 1).is_none() {
        // Only a corrupted tid table gets here; say so, the agent logs it.
        error!(&ctx, "tid {} maps to slot {} beyond the slot table", tid, index - 1);
        // SAFETY: as above.
        unsafe { write_volatile(entry, 0) };
        return 0;
    }
    let cell = GOV_CPUS.get_ptr_mut(unsafe { bpf_get_smp_processor_id() });
    if let Some(c) = cell {
        // SAFETY: map value pointer, valid for this run; only this CPU
        // writes its cell.
        unsafe { write_volatile(addr_of_mut!((*c).busy), 1) };
    }
    if let Some(slot) = close_slice(now, pid_tgid) {
        // SAFETY: map value pointers, valid for this run. The slot is dead
        // before the tid entry clears, so the agent never sees a live slot
        // without its tid.
        unsafe {
            write_volatile(addr_of_mut!((*slot).state), SLOT_DEAD);
            write_volatile(entry, 0);
        }
    }
    if let Some(c) = cell {
        // SAFETY: as above.
        unsafe { write_volatile(addr_of_mut!((*c).busy), 0) };
    }
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
