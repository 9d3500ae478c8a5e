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
//! - `gov_profile` (`perf_event` at a profile's frequency, attached only
//!   while `governor profile` runs): counts the user and kernel stacks of
//!   tagged tasks under their tag.
//!
//! # Run-queue wait
//!
//! The kernel counts each task's time runnable but without a CPU in
//! `sched_info.run_delay` (schedstat's second field), adding a wait when it
//! ends: at the switch-in that ends it, after this tracepoint. So at a
//! task's switch-out its delay has gained exactly the wait before the slice
//! now ending. A registered thread is charged that gain at its switch-out,
//! to the tag it had at its switch-out before (its tag cannot change while
//! it is off its CPU: that is the tag it waited with), or if it waited
//! untagged, to the first tag it took after (`ThreadSlot::wait_tag`, which
//! the thread fills in then: a pooled worker's wakeup waits for the work it
//! was woken for); a rule-measured
//! task, to its rule's keyspace, from its delay at its switch-out before
//! (kept by tid in `GOV_RULE_WAIT`). A wait can gain the delay in parts (a
//! waiting task moved to another CPU's queue, or stopped, adds what it
//! waited so far then), so the base is always the last switch-out, never a
//! switch-in. Unregistered tasks pay nothing for it.
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
#![feature(asm_experimental_arch)]
#![allow(internal_features)]

use aya_ebpf::EbpfContext;
use aya_ebpf::helpers::{bpf_map_delete_elem, bpf_map_lookup_elem, bpf_map_update_elem};
use aya_ebpf::{
    helpers::{
        bpf_get_current_comm, bpf_get_current_task_btf, bpf_get_smp_processor_id, bpf_get_stack, bpf_ktime_get_ns,
        bpf_probe_read_kernel, bpf_probe_read_kernel_str_bytes,
    },
    macros::{btf_tracepoint, map, perf_event},
    maps::{Array, HashMap, PerCpuArray, RingBuf},
    programs::{BtfTracePointContext, PerfEventContext},
};
use core::ffi::c_void;
use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};
use keyspace_governor_common::{
    BEHIND_IDLE, BEHIND_SLOTS, BEHIND_UNKNOWN, BEHIND_UNMEASURED, BEHIND_UNTAGGED, CpuCell, DEFAULT_MAX_KEYSPACES,
    DEFAULT_MAX_THREADS, DEFAULT_MAX_TIDS, EVENT_EXEC, EVENT_FORK, EVENT_RENAME, FRESH_OFFSET_NS, KeyspaceCell,
    KeyspaceWait, LAUNCH_MAX_NS, LOST_STACK, MAX_CPUS, MAX_FRAMES, MAX_PENDING, MAX_PROFILE_KEYS, MAX_RULE_TASKS,
    MAX_STACKS, NO_STACK, ProfileKey, RULE_CTL_DROPPED, RULE_CTL_ENTRIES, RULE_CTL_ON, RULE_CTL_RENAME, RuleCpu,
    RuleEvent, SLOT_DEAD, SLOT_LIVE, StackFrames, TAG_PENDING, TASK_DEAD, ThreadSlot, WAIT_TAG_WAITING, cell_of_tag,
    cpu_owner, kind_of_tag, wait_bucket,
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
#[unsafe(no_mangle)]
static GOV_OFF_TGID: u32 = 0;
#[unsafe(no_mangle)]
static GOV_OFF_PREV_RUNTIME: u32 = 0;
#[unsafe(no_mangle)]
static GOV_OFF_NVCSW: u32 = 0;
#[unsafe(no_mangle)]
static GOV_OFF_NIVCSW: u32 = 0;
#[unsafe(no_mangle)]
static GOV_OFF_BPRM_FILENAME: u32 = 0;
#[unsafe(no_mangle)]
static GOV_OFF_RUN_DELAY: u32 = 0;
/// Non-zero when the kernel has `sched_info` (`GOV_OFF_RUN_DELAY` is valid).
#[unsafe(no_mangle)]
static GOV_WAIT_ON: u32 = 0;
#[unsafe(no_mangle)]
static GOV_OFF_LAST_QUEUED: u32 = 0;
/// Non-zero when waiting threads are counted (`GOV_OFF_LAST_QUEUED` is
/// valid and the wakeup program attached).
#[unsafe(no_mangle)]
static GOV_PRESSURE_ON: u32 = 0;

#[map]
static GOV_CPUS: Array<CpuCell> = Array::with_max_entries(MAX_CPUS, BPF_F_MMAPABLE);
#[map]
static GOV_SLOTS: Array<ThreadSlot> = Array::with_max_entries(DEFAULT_MAX_THREADS, BPF_F_MMAPABLE);
#[map]
static GOV_KEYSPACES: Array<KeyspaceCell> = Array::with_max_entries(DEFAULT_MAX_KEYSPACES, BPF_F_MMAPABLE);
/// Run-queue waits by keyspace cell, beside `GOV_KEYSPACES` (the agent's
/// alone: clients write keyspace cells, never these).
#[map]
static GOV_WAITS: Array<KeyspaceWait> = Array::with_max_entries(DEFAULT_MAX_KEYSPACES, BPF_F_MMAPABLE);
/// `tid → [slot + 1, rule tag]`, one entry per possible tid
/// (`kernel.pid_max`): an array lookup is a bounds check and an add, where a
/// hash lookup would hash the key on every context switch.
/// - `slot + 1` (0: not registered): the agent writes it through its mmap.
/// - the rule tag of the thread's process (0: none, `TAG_PENDING`: being
///   decided): `gov_fork` gives a new thread or process its creator's, the
///   agent sets every thread of a process it matches. The switch reads it
///   from the entry it loads anyway, so rules cost an unmatched switch
///   nothing.
#[map]
static GOV_TID_SLOT: Array<[u32; 2]> = Array::with_max_entries(DEFAULT_MAX_TIDS, BPF_F_MMAPABLE);
/// Per CPU: the rule-measured task running there and how far its slice was
/// charged.
#[map]
static GOV_RULE_CPUS: Array<RuleCpu> = Array::with_max_entries(MAX_CPUS, 0);
/// CPU of processes whose rule is being decided, by tgid.
#[map]
static GOV_PENDING: HashMap<u32, u64> = HashMap::with_max_entries(MAX_PENDING, 0);
/// Exec and fork events for the agent's rules.
#[map]
static GOV_EVENTS: RingBuf = RingBuf::with_byte_size(256 * 1024, 0);
/// `tid → run-queue delay at its last switch-out` of rule-measured tasks
/// (see the crate's notes on run-queue wait).
#[map]
static GOV_RULE_WAIT: HashMap<u32, u64> = HashMap::with_max_entries(MAX_RULE_TASKS, 0);
/// `[rules on, events dropped, thread-name rules on]`.
#[map]
static GOV_RULE_CTL: Array<u64> = Array::with_max_entries(RULE_CTL_ENTRIES, 0);

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

/// The `[slot + 1, rule tag]` entry of `tid`, if the table covers it.
#[inline(always)]
fn tid_entry(tid: u32) -> Option<*mut u32> {
    GOV_TID_SLOT.get_ptr_mut(tid).map(|p| p as *mut u32)
}

/// Whether `entry` names a slot or a rule tag: one load for both halves, so
/// a switch of a task no one measures costs a single test per side.
///
/// # Safety
/// `entry` is a tid entry (8 bytes, 8-aligned in the array map).
#[inline(always)]
unsafe fn measured(entry: *mut u32) -> bool {
    // SAFETY: as the caller promises.
    unsafe { read_volatile(entry as *const u64) != 0 }
}

/// The live slot of `tid` (with its index), given its entry, if registered.
/// A slot handed to another thread since the entry was read is not it.
///
/// # Safety
/// `entry` is `tid`'s entry.
#[inline(always)]
unsafe fn registered(tid: u32, entry: *mut u32) -> Option<(*mut ThreadSlot, u32)> {
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
        Some((slot, index - 1))
    }
}

/// The rule tag in `entry` (0: none).
///
/// # Safety
/// `entry` is a tid entry.
#[inline(always)]
unsafe fn rule_tag(entry: *mut u32) -> u32 {
    // SAFETY: the second half of the same 8-byte value.
    unsafe { read_volatile(entry.add(1)) }
}

/// Whether the agent has rules (execs are reported only then).
#[inline(always)]
fn rules_on() -> bool {
    // SAFETY: a map value pointer.
    GOV_RULE_CTL.get_ptr_mut(RULE_CTL_ON).is_some_and(|p| unsafe { read_volatile(p) } != 0)
}

/// Charges `delta` ns of `task` to its rule tag; while its process's rule
/// is being decided, into the process's pending total.
///
/// # Safety
/// `task` is a trusted task pointer.
#[inline(always)]
unsafe fn charge_rule(task: *const u8, tag: u32, delta: u64) {
    if tag != TAG_PENDING {
        charge(tag as u64, delta);
        return;
    }
    // SAFETY: as the caller promises.
    let tgid = unsafe { task_field::<u32>(task, &GOV_OFF_TGID) };
    if let Some(p) = GOV_PENDING.get_ptr_mut(&tgid) {
        // SAFETY: a map value pointer; the add is atomic against other CPUs.
        unsafe { core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(p, delta) };
    } else if GOV_PENDING.insert(&tgid, &delta, 1 /* BPF_NOEXIST */).is_err()
        && let Some(p) = GOV_PENDING.get_ptr_mut(&tgid)
    {
        // Another CPU inserted it first.
        // SAFETY: as above.
        unsafe { core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(p, delta) };
    }
}

/// The task's switch count: the kernel adds one at each of its switch-outs,
/// before the tracepoint, so within one slice it stays put.
///
/// # Safety
/// `task` is a trusted task pointer.
#[inline(always)]
unsafe fn switches(task: *const u8) -> u64 {
    // SAFETY: as the caller promises.
    unsafe { task_field::<u64>(task, &GOV_OFF_NVCSW).wrapping_add(task_field::<u64>(task, &GOV_OFF_NIVCSW)) }
}

/// Charges a rule-measured task's slice up to its `runtime`: from where this
/// CPU last charged it in this slice (its record's switch count is the
/// task's, or one behind at the switch-out), or from the slice's start
/// (`se.prev_sum_exec_runtime`) when the switch-in was not seen (the rule
/// came while it ran). Leaves the CPU's record at `runtime` (`keep`) or
/// clears it (switch-out).
///
/// # Safety
/// `task` is a trusted task pointer running on (or leaving) this CPU.
#[inline(always)]
unsafe fn charge_rule_slice(task: *const u8, tid: u32, tag: u32, keep: bool) {
    // SAFETY: as the caller promises; this CPU is the only writer of its cell.
    unsafe {
        let Some(cell) = GOV_RULE_CPUS.get_ptr_mut(bpf_get_smp_processor_id()) else { return };
        let runtime = task_field::<u64>(task, &GOV_OFF_RUNTIME);
        // Both read unconditionally: one load instruction may not serve a
        // map value and a task pointer (the verifier refuses it).
        let charged = read_volatile(addr_of_mut!((*cell).base_ns));
        let slice_start = task_field::<u64>(task, &GOV_OFF_PREV_RUNTIME);
        let count = switches(task);
        let seen = read_volatile(addr_of_mut!((*cell).tid)) == tid as u64 + 1
            && read_volatile(addr_of_mut!((*cell).switches)).wrapping_add(!keep as u64) == count;
        let base = if seen { charged } else { slice_start };
        if runtime > base {
            charge_rule(task, tag, runtime - base);
        }
        if !keep {
            let runner = if seen { read_volatile(addr_of_mut!((*cell).runner)) as u32 } else { BEHIND_UNKNOWN };
            rule_waited(task, tid, tag, runner);
        }
        write_volatile(addr_of_mut!((*cell).switches), count);
        write_volatile(addr_of_mut!((*cell).base_ns), runtime);
        write_volatile(addr_of_mut!((*cell).tid), if keep { tid as u64 + 1 } else { 0 });
    }
}

/// At a rule-measured task's switch-out: charges what its run-queue delay
/// gained since its last switch-out to its rule's keyspace, behind
/// `runner` (a task first seen now only leaves its base; one whose rule is
/// being decided charges nothing).
///
/// # Safety
/// `task` is a trusted task pointer being switched out.
#[inline(always)]
unsafe fn rule_waited(task: *const u8, tid: u32, tag: u32, runner: u32) {
    if !wait_on() {
        return;
    }
    // SAFETY: as the caller promises; map value pointers are valid for
    // this run, and only this CPU switches the task out.
    unsafe {
        let delay = task_field::<u64>(task, &GOV_OFF_RUN_DELAY);
        if let Some(p) = rule_wait_entry(tid) {
            let seen = read_volatile(p);
            if delay > seen {
                if tag != TAG_PENDING {
                    charge_wait(tag as u64, delay - seen, runner);
                }
                write_volatile(p, delay);
            }
        } else {
            // Full: this task's waits go uncounted until room is made.
            rule_wait_set(tid, delay);
        }
        if task_field::<u32>(task, &GOV_OFF_STATE) & TASK_DEAD != 0 {
            rule_wait_forget(tid);
        }
    }
}

// `GOV_RULE_WAIT` through the helpers themselves, always inlined: the map's
// generic methods, called from several places, become BPF subprograms
// taking the map as an argument, which kernels before 6.2 refuse.

/// `tid`'s entry in `GOV_RULE_WAIT`, if it has one.
#[inline(always)]
fn rule_wait_entry(tid: u32) -> Option<*mut u64> {
    // SAFETY: the map's own address and a key of its key type.
    let p = unsafe { bpf_map_lookup_elem(addr_of!(GOV_RULE_WAIT) as *mut c_void, &tid as *const u32 as *const c_void) };
    (!p.is_null()).then_some(p as *mut u64)
}

/// Sets `tid`'s base in `GOV_RULE_WAIT` (a full map keeps it out).
#[inline(always)]
fn rule_wait_set(tid: u32, delay: u64) {
    // SAFETY: as above, with a value of its value type; flags 0: any.
    unsafe {
        bpf_map_update_elem(
            addr_of!(GOV_RULE_WAIT) as *mut c_void,
            &tid as *const u32 as *const c_void,
            &delay as *const u64 as *const c_void,
            0,
        )
    };
}

/// Drops `tid`'s base from `GOV_RULE_WAIT`.
#[inline(always)]
fn rule_wait_forget(tid: u32) {
    // SAFETY: as above.
    unsafe { bpf_map_delete_elem(addr_of!(GOV_RULE_WAIT) as *mut c_void, &tid as *const u32 as *const c_void) };
}

/// Whether run-queue waits are measured on this kernel.
#[inline(always)]
fn wait_on() -> bool {
    // SAFETY: a read-only global the agent sets before load.
    unsafe { read_volatile(&GOV_WAIT_ON) != 0 }
}

/// `*p += v` atomically, returning what `*p` held: BPF's fetching add
/// (kernel 5.12), written out because the compiler emits it only for BPF
/// ISA v3, whose other changes the programs do not need.
///
/// # Safety
/// `p` is a valid, aligned map value pointer for this program's run.
#[inline(always)]
unsafe fn fetch_add(p: *mut u64, v: u64) -> u64 {
    let mut r = v;
    // SAFETY: as the caller promises; the instruction reads and writes
    // only `*p` and `r`.
    unsafe {
        core::arch::asm!(
            "{r} = atomic_fetch_add((u64 *)({p} + 0), {r})",
            p = in(reg) p,
            r = inout(reg) r,
            options(nostack),
        );
    }
    r
}

/// Whether waiting threads are counted.
#[inline(always)]
fn pressure_on() -> bool {
    // SAFETY: a read-only global the agent sets before load.
    unsafe { read_volatile(&GOV_PRESSURE_ON) != 0 }
}

/// One more waiting thread of keyspace cell `index`: the first opens the
/// keyspace's "some" stretch.
#[inline(always)]
fn start_waiting(index: u32) {
    if let Some(w) = GOV_WAITS.get_ptr_mut(index) {
        // SAFETY: a map value pointer, valid for the program's run; the add
        // is atomic against other CPUs.
        unsafe {
            let before = fetch_add(addr_of_mut!((*w).waiting), 1);
            if before == 0 {
                write_volatile(addr_of_mut!((*w).some_since_ns), bpf_ktime_get_ns());
            }
        }
    }
}

/// One waiting thread of keyspace cell `index` fewer: the last closes the
/// stretch. Its start is read before the count drops, so a stretch that
/// another CPU opens at once cannot move it.
#[inline(always)]
fn stop_waiting(index: u32) {
    if let Some(w) = GOV_WAITS.get_ptr_mut(index) {
        // SAFETY: as in `start_waiting`.
        unsafe {
            let since = read_volatile(addr_of_mut!((*w).some_since_ns));
            let before = fetch_add(addr_of_mut!((*w).waiting), u64::MAX);
            if before == 1 {
                let now = bpf_ktime_get_ns();
                if now > since {
                    core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
                        addr_of_mut!((*w).some_ns),
                        now - since,
                    );
                }
                write_volatile(addr_of_mut!((*w).some_closed_ns), now);
            } else if before == 0 {
                // Never counted: put the count back.
                core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
                    addr_of_mut!((*w).waiting),
                    1,
                );
            }
        }
    }
}

/// Counts a registered thread that became runnable (woken, or preempted)
/// among the waiting threads of the keyspace it waits with, once.
///
/// # Safety
/// `slot` is a map value pointer whose thread is not running.
#[inline(always)]
unsafe fn mark_waiting(slot: *mut ThreadSlot) {
    // SAFETY: as the caller promises: the thread writes `wait_tag` only
    // while it runs.
    unsafe {
        let wait_tag = read_volatile(addr_of_mut!((*slot).wait_tag));
        if wait_tag & WAIT_TAG_WAITING != 0 {
            return;
        }
        if let Some(index) = cell_of_tag(wait_tag as u64) {
            write_volatile(addr_of_mut!((*slot).wait_tag), wait_tag | WAIT_TAG_WAITING);
            start_waiting(index);
        }
    }
}

/// At a registered thread's switch-in (or, should that have gone unseen,
/// at the timer or its switch-out): it waits no more.
///
/// # Safety
/// `slot` is a map value pointer whose thread is being switched in or out,
/// or is running on this CPU.
#[inline(always)]
unsafe fn unmark_waiting(slot: *mut ThreadSlot) {
    // SAFETY: as the caller promises; the thread writes `wait_tag` only
    // while it runs and the flag is clear, and the flag is set only while
    // it is off its CPU.
    unsafe {
        let wait_tag = read_volatile(addr_of_mut!((*slot).wait_tag));
        if wait_tag & WAIT_TAG_WAITING != 0 {
            let tag = wait_tag & !WAIT_TAG_WAITING;
            write_volatile(addr_of_mut!((*slot).wait_tag), tag);
            if let Some(index) = cell_of_tag(tag as u64) {
                stop_waiting(index);
            }
        }
    }
}

/// Whom the registered thread `tid`, being switched out, took this CPU
/// from at its switch-in (`CpuCell::behind`).
#[inline(always)]
fn waited_behind(tid: u32) -> u32 {
    // SAFETY: the helper reads this CPU's number.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    let Some(cell) = GOV_CPUS.get_ptr_mut(cpu) else { return BEHIND_UNKNOWN };
    // SAFETY: a map value pointer; only this CPU's switches write it.
    let behind = unsafe { read_volatile(addr_of_mut!((*cell).behind)) };
    if behind as u32 == tid.wrapping_add(1) { (behind >> 32) as u32 } else { BEHIND_UNKNOWN }
}

/// Adds `delta` ns waited behind `runner` to `w`'s slot for it, claiming a
/// free one if it has none (two CPUs claiming one slot at once for two
/// runners leave it to one of them, with both waits).
///
/// # Safety
/// `w` is a map value pointer, valid for the program's run.
#[inline(always)]
unsafe fn charge_behind(w: *mut KeyspaceWait, runner: u32, delta: u64) {
    // SAFETY: as the caller promises; indices below the arrays' length.
    unsafe {
        let runners = addr_of_mut!((*w).behind_runner) as *mut u32;
        let ns = addr_of_mut!((*w).behind_ns) as *mut u64;
        let mut i = 0;
        while i < BEHIND_SLOTS {
            let r = read_volatile(runners.add(i));
            if r == runner || r == 0 {
                if r == 0 {
                    write_volatile(runners.add(i), runner);
                }
                core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
                    ns.add(i),
                    delta,
                );
                return;
            }
            i += 1;
        }
        core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
            addr_of_mut!((*w).behind_other_ns),
            delta,
        );
    }
}

/// Charges one run-queue wait of `delta` ns, behind `runner`, to the
/// keyspace of `tag`.
#[inline(always)]
fn charge_wait(tag: u64, delta: u64, runner: u32) {
    let Some(index) = cell_of_tag(tag) else { return };
    if let Some(w) = GOV_WAITS.get_ptr_mut(index) {
        let k = wait_bucket(delta);
        // SAFETY: a map value pointer, valid for the program's run; `k` is
        // below the histogram's length; the adds are atomic against other
        // CPUs.
        unsafe {
            core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
                addr_of_mut!((*w).wait_ns),
                delta,
            );
            if let Some(bucket) = (*w).hist.get_mut(k) {
                core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(bucket, 1);
            }
            charge_behind(w, runner, delta);
        }
    }
}

/// At a registered thread's switch-out: charges the wait that ended at this
/// slice's start to the tag the thread waited with, and keeps the tag it
/// leaves with for the next wait.
///
/// # Safety
/// `task` is the thread's trusted task pointer, `slot` its map value
/// pointer; the thread cannot run now.
#[inline(always)]
unsafe fn slot_waited(task: *const u8, tid: u32, slot: *mut ThreadSlot) {
    if !wait_on() {
        return;
    }
    // SAFETY: as the caller promises.
    unsafe {
        let delay = task_field::<u64>(task, &GOV_OFF_RUN_DELAY);
        let seen = read_volatile(addr_of_mut!((*slot).delay_ns));
        if delay > seen {
            let tag = read_volatile(addr_of_mut!((*slot).wait_tag)) & !WAIT_TAG_WAITING;
            charge_wait(tag as u64, delay - seen, waited_behind(tid));
            write_volatile(addr_of_mut!((*slot).delay_ns), delay);
        }
        // (Never counted as waiting here: the switch-out took it off first.)
        let waiting = read_volatile(addr_of_mut!((*slot).wait_tag)) & WAIT_TAG_WAITING;
        write_volatile(addr_of_mut!((*slot).wait_tag), read_volatile(addr_of_mut!((*slot).tag)) as u32 | waiting);
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
        // Whom next takes the CPU from, if next is measured.
        let mut runner = if prev_tid == 0 { BEHIND_IDLE } else { BEHIND_UNMEASURED };
        if let Some(entry) = tid_entry(prev_tid)
            && measured(entry)
        {
            if let Some((slot, _)) = registered(prev_tid, entry) {
                // The kernel brought prev's runtime up to date before the switch.
                let runtime = task_field::<u64>(prev, &GOV_OFF_RUNTIME);
                charge_up_to(slot, runtime);
                write_volatile(addr_of_mut!((*slot).oncpu_ns), runtime);
                runner = cell_of_tag(read_volatile(addr_of_mut!((*slot).tag))).map_or(BEHIND_UNTAGGED, |c| c + 1);
                // It ran, so it waits no more, though its switch-in may not
                // have been seen (this guest's 6.18 kernel was caught
                // switching to a thread without the tracepoint): a count
                // left open would hold its keyspace's "some" stretch open
                // for good, and its next switch-out would move the count's
                // tag to the one it leaves with.
                if pressure_on() {
                    unmark_waiting(slot);
                }
                slot_waited(prev, prev_tid, slot);
                // Runnable still (preempted, or woken before it could
                // sleep): it waits on. One preempted on its way to sleep
                // (its state set already) is not, as `sched_info` has it.
                if pressure_on() && task_field::<u32>(prev, &GOV_OFF_STATE) == 0 {
                    mark_waiting(slot);
                }
                if task_field::<u32>(prev, &GOV_OFF_STATE) & TASK_DEAD != 0 {
                    // Its final switch: the slot is dead before the tid entry
                    // clears, so the agent never sees a live slot without a tid.
                    write_volatile(addr_of_mut!((*slot).state), SLOT_DEAD);
                    write_volatile(entry, 0);
                }
            } else {
                // Not registered: measured by rule if its process has a tag.
                let tag = rule_tag(entry);
                if tag != 0 && prev_tid != 0 {
                    charge_rule_slice(prev, prev_tid, tag, false);
                    if tag != TAG_PENDING {
                        runner = cell_of_tag(tag as u64).map_or(BEHIND_UNMEASURED, |c| c + 1);
                    }
                }
            }
        }
        let next_tid = task_field::<u32>(next, &GOV_OFF_PID);
        let Some(entry) = tid_entry(next_tid).filter(|&e| measured(e)) else { return 0 };
        if let Some((slot, index)) = registered(next_tid, entry) {
            if pressure_on() {
                unmark_waiting(slot);
            }
            if let Some(cell) = GOV_CPUS.get_ptr_mut(bpf_get_smp_processor_id()) {
                if wait_on() {
                    write_volatile(addr_of_mut!((*cell).behind), (next_tid as u64 + 1) | (runner as u64) << 32);
                }
                let (start, runtime) =
                    (task_field::<u64>(next, &GOV_OFF_EXEC_START), task_field::<u64>(next, &GOV_OFF_RUNTIME));
                // The run queue's clock was brought up to date for this
                // switch only if a task (not the idle loop) blocked: a wakeup
                // skips the update, and the slice then starts back at it.
                let fresh = prev_tid != 0 && task_field::<u32>(prev, &GOV_OFF_STATE) != 0;
                anchor(cell, start, runtime, index, slot, fresh);
            }
        } else if rule_tag(entry) != 0
            && next_tid != 0
            && let Some(cell) = GOV_RULE_CPUS.get_ptr_mut(bpf_get_smp_processor_id())
        {
            // Its slice starts at its runtime now, behind `runner`.
            write_volatile(addr_of_mut!((*cell).runner), runner as u64);
            write_volatile(addr_of_mut!((*cell).switches), switches(next));
            write_volatile(addr_of_mut!((*cell).tid), next_tid as u64 + 1);
            write_volatile(addr_of_mut!((*cell).base_ns), task_field::<u64>(next, &GOV_OFF_RUNTIME));
        }
    }
    0
}

/// A registered thread woken starts waiting for a CPU, when the wakeup
/// queued it (`sched_info.last_queued` set, as the kernel's run-queue
/// delay counts it), not when it only set the state of a thread still
/// queued (running, or preempted on its way to sleep: its switch decides).
/// So the count follows the same waits as schedstat's run-queue time.
#[btf_tracepoint(function = "sched_wakeup")]
pub fn gov_wakeup(ctx: BtfTracePointContext) -> i32 {
    // sched_wakeup(struct task_struct *p)
    // SAFETY: argument 0 is the typed task pointer of this tracepoint;
    // fields at BTF offsets.
    unsafe {
        let p: *const u8 = ctx.arg(0);
        let tid = task_field::<u32>(p, &GOV_OFF_PID);
        let Some(entry) = tid_entry(tid) else { return 0 };
        if let Some((slot, _)) = registered(tid, entry)
            && task_field::<u64>(p, &GOV_OFF_LAST_QUEUED) != 0
        {
            mark_waiting(slot);
        }
    }
    0
}

/// A new thread or process takes its creator's rule tag before it can run
/// (and no slot: a reused tid starts clean). Children of a measured process
/// are measured from their first slice.
#[btf_tracepoint(function = "sched_process_fork")]
pub fn gov_fork(ctx: BtfTracePointContext) -> i32 {
    // SAFETY: sched_process_fork(struct task_struct *parent, struct task_struct *child).
    unsafe {
        let parent: *const u8 = ctx.arg(0);
        let child: *const u8 = ctx.arg(1);
        let tid = task_field::<u32>(child, &GOV_OFF_PID);
        let Some(entry) = tid_entry(tid) else { return 0 };
        let tag = tid_entry(task_field::<u32>(parent, &GOV_OFF_PID)).map_or(0, |e| rule_tag(e));
        write_volatile(entry, 0);
        write_volatile(entry.add(1), tag);
        // A new task's run-queue delay starts at zero; a tid reused by a
        // task no rule measures keeps no old base.
        if tag != 0 {
            rule_wait_set(tid, 0);
        } else if rules_on() {
            rule_wait_forget(tid);
        }
        let tgid = task_field::<u32>(child, &GOV_OFF_TGID);
        if tag == TAG_PENDING
            && tgid == tid
            && !report(
                EVENT_FORK,
                tgid,
                task_field::<u32>(parent, &GOV_OFF_TGID),
                0,
                0,
                core::ptr::null(),
                core::ptr::null(),
            )
        {
            // Unreported: the child is left unmeasured rather than pending forever.
            write_volatile(entry.add(1), 0);
        }
    }
    0
}

/// A process that calls `execve` while the agent has rules is reported, and
/// pending until the agent decides which rule (if any) it matches now. It
/// runs one thread at this point (exec ended the others).
#[btf_tracepoint(function = "sched_process_exec")]
pub fn gov_exec(ctx: BtfTracePointContext) -> i32 {
    // SAFETY: sched_process_exec(struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm).
    unsafe {
        if !rules_on() {
            return 0;
        }
        let task: *const u8 = ctx.arg(0);
        let bprm: *const u8 = ctx.arg(2);
        let tgid = task_field::<u32>(task, &GOV_OFF_TGID);
        let Some(entry) = tid_entry(task_field::<u32>(task, &GOV_OFF_PID)) else { return 0 };
        // Pending still (a child of a pending process): the agent resolves
        // what it inherits from its parent.
        let prior = rule_tag(entry);
        let filename =
            bpf_probe_read_kernel(bprm.add(read_volatile(&GOV_OFF_BPRM_FILENAME) as usize) as *const *const u8)
                .unwrap_or(core::ptr::null());
        // A process nothing measured before (and no registered thread) is
        // charged from here on as one seen at its switch-in, so a move into
        // a cgroup that restarts its slice (`sched_move_task`) loses nothing:
        // from its fork when all it ran before is a launch (so a matched
        // process is charged its whole life as the kernel counts it), else
        // from its exec. The record is whole before the tag says pending: a
        // timer tick may come in between (only the switch runs with IRQs off).
        let tid = task_field::<u32>(task, &GOV_OFF_PID);
        if prior == 0
            && registered(tid, entry).is_none()
            && let Some(cell) = GOV_RULE_CPUS.get_ptr_mut(bpf_get_smp_processor_id())
        {
            let runtime = task_field::<u64>(task, &GOV_OFF_RUNTIME);
            write_volatile(addr_of_mut!((*cell).runner), BEHIND_UNKNOWN as u64);
            write_volatile(addr_of_mut!((*cell).switches), switches(task));
            write_volatile(addr_of_mut!((*cell).base_ns), if runtime <= LAUNCH_MAX_NS { 0 } else { runtime });
            write_volatile(addr_of_mut!((*cell).tid), tid as u64 + 1);
        }
        // Pending next: the slices that follow the report wait for the decision.
        write_volatile(entry.add(1), TAG_PENDING);
        if !report(EVENT_EXEC, tgid, 0, prior, 0, core::ptr::null(), filename) {
            write_volatile(entry.add(1), if prior == TAG_PENDING { 0 } else { prior });
            // Unmeasured again: nothing is kept for its switch-out.
            if prior == 0
                && let Some(cell) = GOV_RULE_CPUS.get_ptr_mut(bpf_get_smp_processor_id())
            {
                write_volatile(addr_of_mut!((*cell).tid), 0);
            }
        }
    }
    0
}

/// A thread renamed while a rule matches thread names is reported; the agent
/// decides whether its new name moves it to another keyspace than its
/// process's. A process's rename at exec is reported too: its exec report
/// follows and decides.
#[btf_tracepoint(function = "task_rename")]
pub fn gov_rename(ctx: BtfTracePointContext) -> i32 {
    // SAFETY: task_rename(struct task_struct *task, const char *comm).
    unsafe {
        // SAFETY: a map value pointer.
        if !GOV_RULE_CTL.get_ptr_mut(RULE_CTL_RENAME).is_some_and(|p| read_volatile(p) != 0) {
            return 0;
        }
        let task: *const u8 = ctx.arg(0);
        let comm: *const u8 = ctx.arg(1);
        let tgid = task_field::<u32>(task, &GOV_OFF_TGID);
        let tid = task_field::<u32>(task, &GOV_OFF_PID);
        report(EVENT_RENAME, tgid, 0, 0, tid, comm, core::ptr::null());
    }
    0
}

/// Puts one event in the ring buffer; false (and counted) when it is full.
/// `comm` is the name to report (null: the current task's).
///
/// # Safety
/// `comm` and `filename` are null or kernel string pointers.
#[inline(always)]
unsafe fn report(
    kind: u32,
    tgid: u32,
    parent: u32,
    prior: u32,
    tid: u32,
    comm: *const u8,
    filename: *const u8,
) -> bool {
    let Some(mut e) = GOV_EVENTS.reserve::<RuleEvent>(0) else {
        if let Some(p) = GOV_RULE_CTL.get_ptr_mut(RULE_CTL_DROPPED) {
            // SAFETY: a map value pointer.
            unsafe { core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(p, 1) };
        }
        return false;
    };
    let ev = e.as_mut_ptr();
    // SAFETY: `ev` is the reserved record; every field is written before submit.
    unsafe {
        write_volatile(addr_of_mut!((*ev).kind), kind);
        write_volatile(addr_of_mut!((*ev).tgid), tgid);
        write_volatile(addr_of_mut!((*ev).parent), parent);
        write_volatile(addr_of_mut!((*ev).prior), prior);
        write_volatile(addr_of_mut!((*ev).tid), tid);
        write_volatile(addr_of_mut!((*ev)._reserved), 0);
        if comm.is_null() {
            (*ev).comm = bpf_get_current_comm().unwrap_or([0; 16]);
        } else {
            (*ev).comm = [0; 16];
            let _ = bpf_probe_read_kernel_str_bytes(comm, &mut (*ev).comm);
        }
        (*ev).filename[0] = 0;
        if !filename.is_null() {
            let _ = bpf_probe_read_kernel_str_bytes(filename, &mut (*ev).filename);
        }
    }
    e.submit(0);
    true
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
        let offset = if read_volatile(addr_of_mut!((*cell).offset_valid)) != 0
            && since_fresh.unsigned_abs() <= FRESH_OFFSET_NS
        {
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
    // SAFETY: a helper with no arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    (now & 1) as i32
}

/// The task running here (a trusted pointer), its tid and its tid entry,
/// if the table covers it.
///
/// # Safety
/// Called from a program whose context has a current task (a perf event).
#[inline(always)]
unsafe fn current() -> Option<(*const u8, u32, *mut u32)> {
    // SAFETY: the helper returns the trusted current task or null.
    unsafe {
        let task = bpf_get_current_task_btf() as *const u8;
        if task.is_null() {
            return None;
        }
        let tid = task_field::<u32>(task, &GOV_OFF_PID);
        Some((task, tid, tid_entry(tid)?))
    }
}

/// Moves the running registered thread's anchor (its CPU's cell) back to
/// what the kernel's count says now, when the anchor taken at its switch-in
/// reads the thread's clock behind it: `runtime` (as of the kernel's last
/// update) less the anchor's base is what the slice ran, so the slice
/// started no later than that long before now. The thread's clock then
/// reads at most the kernel's count, and lags it by no more than the time
/// since that update. An anchor sampled after a wakeup whose run queue's
/// clock was stale (milliseconds, in an emulated guest) would otherwise
/// hold the clock behind for the whole slice, and a thread that untags on
/// it leaves the difference to no keyspace.
///
/// # Safety
/// `slot` (cell `index`) is the registered thread running on this CPU, its
/// kernel runtime `runtime`; called where no switch can interleave (the
/// timer's hardirq).
#[inline(always)]
unsafe fn reanchor(slot: *mut ThreadSlot, index: u32, runtime: u64) {
    // SAFETY: as the caller promises; this CPU is the only writer of its
    // cell, and a reader on it sees the sequence move.
    unsafe {
        let Some(cell) = GOV_CPUS.get_ptr_mut(bpf_get_smp_processor_id()) else { return };
        let owner = cpu_owner(index, read_volatile(addr_of_mut!((*slot).generation)));
        let base = read_volatile(addr_of_mut!((*cell).base_ns));
        if read_volatile(addr_of_mut!((*cell).owner)) != owner || runtime < base {
            return;
        }
        let last = read_volatile(addr_of_mut!((*cell).last_switch_ns));
        let start = bpf_ktime_get_ns().wrapping_sub(runtime - base);
        if (start.wrapping_sub(last) as i64) < 0 {
            write_volatile(addr_of_mut!((*cell).last_switch_ns), start);
            let seq = read_volatile(addr_of_mut!((*cell).seq));
            write_volatile(addr_of_mut!((*cell).seq), seq + 1);
        }
    }
}

/// Charges a running registered task up to the runtime the kernel has
/// counted so far (brought up to date at least every scheduler tick), and
/// moves its anchor back (never forward) if it reads the thread's clock
/// behind that ([`reanchor`]).
#[perf_event]
pub fn gov_timer(_ctx: PerfEventContext) -> u32 {
    // SAFETY: the helper returns the trusted current task; a timer (a
    // hardirq) cannot land inside the switch program, whose IRQs are off.
    unsafe {
        let Some((task, tid, entry)) = current() else { return 0 };
        if let Some((slot, index)) = registered(tid, entry) {
            // It runs, so it waits no more: a switch-in the tracepoint did
            // not show leaves it counted as waiting until here at most.
            if pressure_on() {
                unmark_waiting(slot);
            }
            let runtime = task_field::<u64>(task, &GOV_OFF_RUNTIME);
            charge_up_to(slot, runtime);
            reanchor(slot, index, runtime);
        } else {
            let tag = rule_tag(entry);
            if tag != 0 && tid != 0 {
                charge_rule_slice(task, tid, tag, true);
            }
        }
    }
    0
}

/// Stacks of the profile program ([`gov_profile`]), by the hash of their
/// addresses.
#[map]
static GOV_STACKS: HashMap<u64, StackFrames> = HashMap::with_max_entries(MAX_STACKS, 0);
/// Where a stack is walked before it is hashed (too big for the BPF stack).
#[map]
static GOV_STACK_SCRATCH: PerCpuArray<StackFrames> = PerCpuArray::with_max_entries(1, 0);
/// Samples by tag, process and stacks.
#[map]
static GOV_SAMPLES: HashMap<ProfileKey, u64> = HashMap::with_max_entries(MAX_PROFILE_KEYS, 0);

/// Samples the hash had no room for.
#[map]
static GOV_PROFILE_DROPPED: Array<u64> = Array::with_max_entries(1, 0);

/// `BPF_F_USER_STACK`: `bpf_get_stack` walks the user stack.
const BPF_F_USER_STACK: u64 = 1 << 8;

/// Walks the sample's user (`flags` = [`BPF_F_USER_STACK`]) or kernel
/// stack and keeps it in [`GOV_STACKS`] under its hash, which it returns:
/// [`NO_STACK`] for an empty walk, [`LOST_STACK`] when the walk failed or
/// the table is full. The same stack is stored once (a second insert of
/// one hash finds it there).
#[inline(always)]
unsafe fn keep_stack(ctx: &PerfEventContext, flags: u64) -> u64 {
    let Some(buf) = GOV_STACK_SCRATCH.get_ptr_mut(0) else { return LOST_STACK };
    // SAFETY: buf is this CPU's map value, a StackFrames for this run; the
    // helper writes at most its size and zeroes the rest.
    unsafe {
        let len = bpf_get_stack(ctx.as_ptr(), buf as *mut c_void, size_of::<StackFrames>() as u32, flags);
        if len < 0 {
            return LOST_STACK;
        }
        let n = len as usize / 8;
        if n == 0 {
            return NO_STACK;
        }
        let h = keyspace_governor_common::stack_hash(&(*buf).ips, n.min(MAX_FRAMES));
        if GOV_STACKS.get_ptr(&h).is_some() || GOV_STACKS.insert(&h, &*buf, 1 /* BPF_NOEXIST */).is_ok() {
            return h;
        }
        // Another CPU stored it meanwhile, or the table is full.
        if GOV_STACKS.get_ptr(&h).is_some() { h } else { LOST_STACK }
    }
}

/// Profile sample (a CPU clock at the profile's frequency, attached only
/// while a profile is taken): the task running here is counted, with its
/// user and kernel stacks, under the tag it works for now — a registered
/// thread's current tag (the one its next charge goes to) and the request
/// kind it carries, else its rule's keyspace. Untagged tasks are not
/// counted.
#[perf_event]
pub fn gov_profile(ctx: PerfEventContext) -> u32 {
    // SAFETY: the helper returns the trusted current task; the slot and
    // tid-table pointers are map values, valid for this run.
    unsafe {
        let Some((task, tid, entry)) = current() else { return 0 };
        if tid == 0 {
            return 0;
        }
        let (mut tag, mut kind) = (0u32, 0u32);
        if let Some((slot, _)) = registered(tid, entry) {
            let t = read_volatile(addr_of!((*slot).tag));
            if let Some(cell) = cell_of_tag(t) {
                tag = cell + 1;
                kind = kind_of_tag(t) as u32;
            }
        }
        if tag == 0 {
            tag = rule_tag(entry);
        }
        if tag == 0 || tag == TAG_PENDING {
            return 0;
        }
        let user_stack = keep_stack(&ctx, BPF_F_USER_STACK);
        let kernel_stack = keep_stack(&ctx, 0);
        let tgid = task_field::<u32>(task, &GOV_OFF_TGID);
        let key = ProfileKey { tag, tgid, kind, _pad: 0, user_stack, kernel_stack };
        if let Some(p) = GOV_SAMPLES.get_ptr_mut(&key) {
            core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(p, 1);
        } else if GOV_SAMPLES.insert(&key, &1, 1 /* BPF_NOEXIST */).is_err() {
            // Another CPU put it in first, or the hash is full.
            let p = match GOV_SAMPLES.get_ptr_mut(&key) {
                Some(p) => Some(p),
                None => GOV_PROFILE_DROPPED.get_ptr_mut(0),
            };
            if let Some(p) = p {
                core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(p, 1);
            }
        }
    }
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
