//! governor's eBPF programs.
//!
//! # Layout
//!
//! - `gov_sched_switch` (`tp_btf/sched_switch`): charges the slice of a
//!   registered task being switched out, exactly as the kernel counted it,
//!   and anchors the clock of a registered task being switched in.
//! - `gov_timer` (`perf_event`, a software CPU clock per CPU): charges what
//!   the kernel has counted so far for a registered task that is still
//!   running, so a long query is charged while it runs.
//!
//! # What "exact" means here
//!
//! The kernel's own count of a task's CPU time is `se.sum_exec_runtime`:
//! schedstat, `CLOCK_THREAD_CPUTIME_ID`, `getrusage`, `top` and cgroup
//! `cpu.stat` all report it. The programs read it from the tracepoint's
//! typed task pointers, so a registered thread is charged what the kernel
//! added to it, no more and no less, however it sleeps, blocks or is
//! preempted. (Timing slices between two tracepoints instead would give the
//! time between a wakeup and the switch to the woken task to the task
//! switched out; the kernel gives it to the woken one.)
//!
//! Field offsets are globals the agent resolves from the running kernel's
//! BTF and sets before load; the verifier knows them as constants. One
//! object runs on every kernel with BTF, on x86_64 and aarch64, without
//! CO-RE relocations.
//!
//! # Cost
//!
//! A switch between two tasks that are not registered reads two tids and
//! two tid-table entries and returns: no helper call, no clock. A registered
//! task switched out reads its own runtime; one switched in reads its slice
//! start (`se.exec_start`) and the clock, and anchors its userspace thread
//! clock there.
//!
//! The charging protocol (docs/design.md §3): the kernel stores the task's
//! runtime in `oncpu_ns` at switch-out and charges `runtime − charged_ns` to
//! the slot's tag; the thread charges its own intervals with one CAS on
//! `charged_ns`. The kernel only writes a slot while its thread cannot run
//! (switched out or interrupted), so plain stores suffice on the slot;
//! keyspace totals are shared by all CPUs and use an atomic add.
#![no_std]
#![no_main]
#![feature(core_intrinsics)]
#![allow(internal_features)]

use aya_ebpf::{
    helpers::{bpf_get_current_task_btf, bpf_get_smp_processor_id, bpf_ktime_get_ns},
    macros::{btf_tracepoint, map, perf_event},
    maps::Array,
    programs::{BtfTracePointContext, PerfEventContext},
};
use core::ptr::{addr_of_mut, read_volatile, write_volatile};
use governor_common::{
    cell_of_tag, cpu_owner, CpuCell, KeyspaceCell, ThreadSlot, DEFAULT_MAX_KEYSPACES, DEFAULT_MAX_THREADS,
    DEFAULT_MAX_TIDS, FRESH_OFFSET_NS, MAX_CPUS, SLOT_DEAD, SLOT_LIVE, TASK_DEAD,
};

/// `BPF_F_MMAPABLE`: the array's values can be mmapped by userspace.
const BPF_F_MMAPABLE: u32 = 1 << 10;

// Offsets in `struct task_struct`, set by the agent from the kernel's BTF.
#[unsafe(no_mangle)]
static GOV_OFF_PID: u32 = 0;
#[unsafe(no_mangle)]
static GOV_OFF_STATE: u32 = 0;
#[unsafe(no_mangle)]
static GOV_OFF_RUNTIME: u32 = 0;
#[unsafe(no_mangle)]
static GOV_OFF_EXEC_START: u32 = 0;

#[map]
static GOV_CPUS: Array<CpuCell> = Array::with_max_entries(MAX_CPUS, BPF_F_MMAPABLE);
#[map]
static GOV_SLOTS: Array<ThreadSlot> = Array::with_max_entries(DEFAULT_MAX_THREADS, BPF_F_MMAPABLE);
#[map]
static GOV_KEYSPACES: Array<KeyspaceCell> = Array::with_max_entries(DEFAULT_MAX_KEYSPACES, BPF_F_MMAPABLE);
/// `tid → slot + 1` (0: not registered), one entry per possible tid
/// (`kernel.pid_max`): an array lookup is a bounds check and an add, where a
/// hash lookup would hash the key on every context switch. The agent writes
/// it through its own mmap.
/// Array values are padded to 8 bytes, so two tids share an entry: entry
/// `tid / 2`, half `tid % 2`; userspace sees one dense `u32` per tid.
#[map]
static GOV_TID_SLOT: Array<[u32; 2]> = Array::with_max_entries(DEFAULT_MAX_TIDS / 2, BPF_F_MMAPABLE);

/// A field of a kernel task at a BTF-resolved offset.
///
/// # Safety
/// `task` is a trusted task pointer the verifier typed from BTF, and
/// `offset` names a field of type `T` in the running kernel.
#[inline(always)]
unsafe fn task_field<T: Copy>(task: *const u8, offset: &'static u32) -> T {
    // SAFETY: as the caller promises. The global is read-only and frozen:
    // the verifier sees a constant offset into a typed kernel object.
    unsafe {
        let off = read_volatile(offset) as usize;
        read_volatile(task.add(off) as *const T)
    }
}

/// `tid → slot + 1` entry of `tid`, if the table covers it.
#[inline(always)]
fn tid_entry(tid: u32) -> Option<*mut u32> {
    let pair = GOV_TID_SLOT.get_ptr_mut(tid >> 1)?;
    // SAFETY: in-bounds element of the pair the map returned.
    Some(unsafe { (pair as *mut u32).add((tid & 1) as usize) })
}

/// The live slot of `tid` (with its index and tid entry), if registered.
/// A slot handed to another thread since the entry was read is not it.
#[inline(always)]
fn registered(tid: u32) -> Option<(*mut ThreadSlot, u32, *mut u32)> {
    let entry = tid_entry(tid)?;
    // SAFETY: map value pointers are valid for this run.
    unsafe {
        let index = read_volatile(entry);
        if index == 0 {
            return None;
        }
        let slot = GOV_SLOTS.get_ptr_mut(index - 1)?;
        if read_volatile(addr_of_mut!((*slot).tid)) != tid || read_volatile(addr_of_mut!((*slot).state)) != SLOT_LIVE {
            return None;
        }
        Some((slot, index - 1, entry))
    }
}

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

/// Charges the slot up to the kernel's `runtime` of its thread, unless the
/// thread already charged that far.
///
/// # Safety
/// `slot` is a map value pointer whose thread cannot run now.
#[inline(always)]
unsafe fn charge_up_to(slot: *mut ThreadSlot, runtime: u64) {
    // SAFETY: as the caller promises.
    unsafe {
        let charged = read_volatile(addr_of_mut!((*slot).charged_ns));
        if runtime > charged {
            charge(read_volatile(addr_of_mut!((*slot).tag)), runtime - charged);
            write_volatile(addr_of_mut!((*slot).charged_ns), runtime);
        }
    }
}

#[btf_tracepoint(function = "sched_switch")]
pub fn gov_sched_switch(ctx: BtfTracePointContext) -> i32 {
    // sched_switch(bool preempt, struct task_struct *prev, struct task_struct *next, ...)
    // SAFETY: arguments 1 and 2 are the typed task pointers of this
    // tracepoint on every supported kernel; fields at BTF offsets.
    unsafe {
        let prev: *const u8 = ctx.arg(1);
        let next: *const u8 = ctx.arg(2);
        let prev_tid = task_field::<u32>(prev, &GOV_OFF_PID);
        if let Some((slot, _, entry)) = registered(prev_tid) {
            // The kernel brought prev's runtime up to date before the switch.
            let runtime = task_field::<u64>(prev, &GOV_OFF_RUNTIME);
            charge_up_to(slot, runtime);
            write_volatile(addr_of_mut!((*slot).oncpu_ns), runtime);
            if task_field::<u32>(prev, &GOV_OFF_STATE) & TASK_DEAD != 0 {
                // Its final switch: the slot is dead before the tid entry
                // clears, so the agent never sees a live slot without a tid.
                write_volatile(addr_of_mut!((*slot).state), SLOT_DEAD);
                write_volatile(entry, 0);
            }
        }
        if let Some((slot, index, _)) = registered(task_field::<u32>(next, &GOV_OFF_PID)) {
            if let Some(cell) = GOV_CPUS.get_ptr_mut(bpf_get_smp_processor_id()) {
                let (start, runtime) =
                    (task_field::<u64>(next, &GOV_OFF_EXEC_START), task_field::<u64>(next, &GOV_OFF_RUNTIME));
                // The run queue's clock was brought up to date for this
                // switch only if a task (not the idle loop) blocked: a wakeup
                // skips the update, and the slice then starts back at it.
                let fresh = prev_tid != 0 && task_field::<u32>(prev, &GOV_OFF_STATE) != 0;
                anchor(cell, start, runtime, index, slot, fresh);
            }
        }
    }
    0
}

/// Anchors the clock of the registered thread being switched in: its slice
/// starts at `exec_start` on the run queue's task clock, moved onto
/// CLOCK_MONOTONIC by this CPU's offset between the two (see [`CpuCell`]).
/// The offset is sampled (the one clock read) unless a fresh sample was
/// taken within [`FRESH_OFFSET_NS`] of this slice's start on the task
/// clock. A sample never reads the thread clock ahead of the kernel's
/// count; where it reads behind (a wakeup's sample, by the wakeup's
/// latency), the kernel charges the difference at switch-out.
///
/// # Safety
/// `cell` and `slot` are map value pointers; this CPU is the only writer of
/// its cell and runs with interrupts off here.
#[inline(always)]
unsafe fn anchor(cell: *mut CpuCell, exec_start: u64, runtime: u64, index: u32, slot: *mut ThreadSlot, fresh: bool) {
    // SAFETY: as the caller promises.
    unsafe {
        let since_fresh = exec_start.wrapping_sub(read_volatile(addr_of_mut!((*cell).fresh_task_ns))) as i64;
        let offset = if read_volatile(addr_of_mut!((*cell).offset_valid)) != 0 && since_fresh.unsigned_abs() <= FRESH_OFFSET_NS {
            read_volatile(addr_of_mut!((*cell).mono_offset_ns))
        } else {
            let sample = bpf_ktime_get_ns().wrapping_sub(exec_start);
            if fresh {
                write_volatile(addr_of_mut!((*cell).fresh_task_ns), exec_start);
                write_volatile(addr_of_mut!((*cell).offset_valid), 1);
            }
            write_volatile(addr_of_mut!((*cell).mono_offset_ns), sample);
            sample
        };
        let start = exec_start.wrapping_add(offset);
        let owner = cpu_owner(index, read_volatile(addr_of_mut!((*slot).generation)));
        write_volatile(addr_of_mut!((*cell).last_switch_ns), start);
        write_volatile(addr_of_mut!((*cell).base_ns), runtime);
        write_volatile(addr_of_mut!((*cell).owner), owner);
        let seq = read_volatile(addr_of_mut!((*cell).seq));
        write_volatile(addr_of_mut!((*cell).seq), seq + 1);
    }
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

/// Charges a running registered task up to the runtime the kernel has
/// counted so far (brought up to date at least every scheduler tick). The
/// running thread's anchor is left alone.
#[perf_event]
pub fn gov_timer(_ctx: PerfEventContext) -> u32 {
    // SAFETY: the helper returns the trusted current task; a timer (a
    // hardirq) cannot land inside the switch program, whose IRQs are off.
    unsafe {
        let task = bpf_get_current_task_btf() as *const u8;
        if task.is_null() {
            return 0;
        }
        if let Some((slot, _, _)) = registered(task_field::<u32>(task, &GOV_OFF_PID)) {
            charge_up_to(slot, task_field::<u64>(task, &GOV_OFF_RUNTIME));
        }
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
