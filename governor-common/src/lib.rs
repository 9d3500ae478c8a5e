//! Layouts shared by the eBPF programs and userspace.
//!
//! # Layout
//!
//! Everything here crosses the kernel boundary or a process boundary: the
//! values of `BPF_F_MMAPABLE` array maps, which the agent and every client
//! mmap, and the constants both sides must agree on.
//!
//! - [`CpuCell`]: one per CPU, written by the kernel at every context switch
//!   and timer tick; read by a thread to compute its own on-CPU time.
//! - [`ThreadSlot`]: one per registered thread; the kernel accumulates the
//!   thread's on-CPU time here, and the thread and the kernel agree through
//!   `charged_ns` who charges which interval.
//! - [`KeyspaceCell`]: one per keyspace cell; `cpu_ns` is the charged total.
//! - [`admission`]: the admission regions (header, parameters and
//!   directory, token buckets, ticket ledgers).
//!
//! Every layout is `#[repr(C)]`, one cache line, with explicit padding and
//! `u32`/`u64` flags instead of `bool`, so the eBPF object and userspace on
//! x86_64 and aarch64 read the same bytes.
#![cfg_attr(not(test), no_std)]

pub mod admission;

use core::mem::{align_of, size_of};

/// Name of the `CpuCell` array map (indexed by CPU id).
pub const MAP_CPUS: &str = "GOV_CPUS";
/// Name of the `ThreadSlot` array map (indexed by slot id).
pub const MAP_SLOTS: &str = "GOV_SLOTS";
/// Name of the `KeyspaceCell` array map (indexed by keyspace cell id).
pub const MAP_KEYSPACES: &str = "GOV_KEYSPACES";
/// Name of the [`KeyspaceWait`] array map (indexed by keyspace cell id):
/// the agent's alone, never handed to clients.
pub const MAP_WAITS: &str = "GOV_WAITS";
/// Name of the `tid → [slot + 1, rule tag]` array (two `u32` per tid).
pub const MAP_TID_SLOT: &str = "GOV_TID_SLOT";
/// Compiled-in tid table length; the agent loads it at `kernel.pid_max`.
pub const DEFAULT_MAX_TIDS: u32 = 1 << 22;

/// Name of the per-CPU [`RuleCpu`] array (kernel only).
pub const MAP_RULE_CPUS: &str = "GOV_RULE_CPUS";
/// Name of the `tgid → ns` hash of CPU charged while a process's rule is
/// being decided (see [`TAG_PENDING`]).
pub const MAP_PENDING: &str = "GOV_PENDING";
/// Name of the ring buffer of [`RuleEvent`]s.
pub const MAP_EVENTS: &str = "GOV_EVENTS";
/// Name of the rule control array: [`RULE_CTL_ON`], [`RULE_CTL_DROPPED`].
pub const MAP_RULE_CTL: &str = "GOV_RULE_CTL";
/// Control entry: non-zero while the agent has rules (unregistered tasks
/// are looked up, execs reported).
pub const RULE_CTL_ON: u32 = 0;
/// Control entry: events the ring buffer had no room for.
pub const RULE_CTL_DROPPED: u32 = 1;
/// Control entry: non-zero while a rule matches thread names (renames are
/// reported).
pub const RULE_CTL_RENAME: u32 = 2;
/// Entries of the rule control array.
pub const RULE_CTL_ENTRIES: u32 = 3;
/// Processes whose rule can be undecided at once.
pub const MAX_PENDING: u32 = 8192;

/// A process's rule tag (in its threads' tid entries) while the agent
/// decides its rule: it
/// just called `execve` (or was forked by such a process). Its CPU is kept
/// in `GOV_PENDING` meanwhile, and the agent charges it to the keyspace it
/// decides on, so a process is measured from its first slice.
pub const TAG_PENDING: u32 = u32::MAX;

/// The most CPU a process may have run between its fork and an exec a rule
/// matches for it to be charged to that rule's keyspace as the program's
/// launch (a shell's redirections, the pages its fork copied: well under a
/// millisecond to a few). A process that ran longer before its exec was
/// running another program, which no rule measured.
pub const LAUNCH_MAX_NS: u64 = 50_000_000;

/// [`RuleEvent::kind`]: a process called `execve`.
pub const EVENT_EXEC: u32 = 1;
/// [`RuleEvent::kind`]: a process whose rule is undecided forked.
pub const EVENT_FORK: u32 = 2;
/// [`RuleEvent::kind`]: a thread changed its name (`prctl(PR_SET_NAME)`,
/// `pthread_setname_np`, a write to its `comm`, or an exec).
pub const EVENT_RENAME: u32 = 3;

/// What the agent hears when a process's identity changes: from the ring
/// buffer, in order.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RuleEvent {
    pub kind: u32,
    pub tgid: u32,
    /// The forking process ([`EVENT_FORK`]); 0 otherwise.
    pub parent: u32,
    /// The process's tag before the event (inherited at fork, or set by an
    /// earlier rule): what it keeps when no rule matches. [`TAG_PENDING`]
    /// when it was itself pending: it inherits what its parent gets.
    pub prior: u32,
    /// The thread renamed ([`EVENT_RENAME`]); 0 otherwise.
    pub tid: u32,
    pub _reserved: u32,
    /// `comm` after the event (the thread's new name for [`EVENT_RENAME`]).
    pub comm: [u8; 16],
    /// The path given to `execve`, NUL-terminated, cut to fit.
    pub filename: [u8; 128],
}

/// Per-CPU record of the rule-measured task running there: the runtime its
/// current slice was last charged up to. Kernel only.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RuleCpu {
    /// tid + 1 of the task, 0 when none.
    pub tid: u64,
    pub base_ns: u64,
    /// Whom it took the CPU from (a keyspace cell + 1 or a `BEHIND_*` code).
    pub runner: u64,
    /// The task's switch count (`nvcsw + nivcsw`) when this was written: the
    /// record stands for that slice only, so one left from an earlier slice
    /// (its task untagged before its switch-out) is never taken for it.
    pub switches: u64,
}

/// Name of the `tid → run-queue delay at its last switch-out` hash of
/// rule-measured tasks (kernel only).
pub const MAP_RULE_WAIT: &str = "GOV_RULE_WAIT";
/// Rule-measured tasks whose waits can be counted at once.
pub const MAX_RULE_TASKS: u32 = 65536;

/// Name of the profile's stack table: [`StackFrames`] by the 64-bit hash
/// of their addresses (a hash map of the profile program's own, so two
/// stacks never share an entry as they do in the kernel's stack-trace map,
/// which keeps one stack per bucket of a 32-bit hash).
pub const MAP_STACKS: &str = "GOV_STACKS";
/// Name of the per-CPU scratch buffer a stack is walked into before it is
/// hashed (one [`StackFrames`] per CPU).
pub const MAP_STACK_SCRATCH: &str = "GOV_STACK_SCRATCH";
/// Name of the `ProfileKey → samples` hash of the profile program.
pub const MAP_SAMPLES: &str = "GOV_SAMPLES";
/// Name of the profile's one-entry array: samples that found the
/// [`MAP_SAMPLES`] hash full (counted, never silently lost).
pub const MAP_PROFILE_DROPPED: &str = "GOV_PROFILE_DROPPED";
/// Distinct stacks one profile can hold (the table is preallocated, about
/// 1 KiB each; a stack that finds it full is counted as lost).
pub const MAX_STACKS: u32 = 4096;
/// Frames kept of a stack: the kernel's deepest walk
/// (`PERF_MAX_STACK_DEPTH`).
pub const MAX_FRAMES: usize = 127;
/// A [`ProfileKey`] stack that the sample does not have: a task
/// interrupted in user mode has no kernel stack, a kernel thread no user
/// stack.
pub const NO_STACK: u64 = 0;
/// A [`ProfileKey`] stack that was walked but could not be kept (the
/// table full, or the walk failed): the sample still counts.
pub const LOST_STACK: u64 = 1;

/// One stack's instruction pointers, innermost first; zero after the last.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackFrames {
    pub ips: [u64; MAX_FRAMES],
}

/// The key of a walked stack in [`MAP_STACKS`]: a 64-bit hash of its
/// addresses (the first `n`, `n` ≤ [`MAX_FRAMES`]), never [`NO_STACK`] or
/// [`LOST_STACK`]. Written once here, for the program and for tests.
#[inline(always)]
pub fn stack_hash(ips: &[u64; MAX_FRAMES], n: usize) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < MAX_FRAMES {
        if i >= n {
            break;
        }
        h = (h ^ ips[i]).wrapping_mul(0x0000_0100_0000_01b3);
        h ^= h >> 29;
        i += 1;
    }
    if h <= LOST_STACK { h + 2 } else { h }
}
/// Distinct (tag, process, stacks) keys one profile can hold.
pub const MAX_PROFILE_KEYS: u32 = 16384;

/// What a profile sample is counted under: the tag current when the
/// sample was taken (keyspace cell + 1), the process, the request kind the
/// tag carried (0: none), and the keys of its user and kernel stacks in
/// [`MAP_STACKS`] (or [`NO_STACK`] / [`LOST_STACK`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ProfileKey {
    pub tag: u32,
    pub tgid: u32,
    pub kind: u32,
    pub _pad: u32,
    pub user_stack: u64,
    pub kernel_stack: u64,
}

/// Program names, as exported by the eBPF object.
pub const PROG_SCHED_SWITCH: &str = "gov_sched_switch";
pub const PROG_TIMER: &str = "gov_timer";
/// Program on `tp_btf/sched_wakeup`: a registered thread woken starts
/// waiting for a CPU (the keyspaces' "some" pressure).
pub const PROG_WAKEUP: &str = "gov_wakeup";
/// `tp_btf/sched_process_fork`: a new process inherits its parent's tag.
pub const PROG_FORK: &str = "gov_fork";
/// `tp_btf/sched_process_exec`: a process that calls `execve` is reported.
pub const PROG_EXEC: &str = "gov_exec";
/// `tp_btf/task_rename`: a renamed thread is reported while a rule matches
/// thread names.
pub const PROG_RENAME: &str = "gov_rename";
/// `perf_event` at the profile's frequency, attached only while a profile
/// is taken: counts the stacks of tagged threads by tag.
pub const PROG_PROFILE: &str = "gov_profile";
/// An empty sched_switch program, for benchmarks only.
pub const PROG_CALIBRATE: &str = "gov_calibrate";
/// A sched_switch program that only reads the clock, for benchmarks only.
pub const PROG_CALIBRATE_CLOCK: &str = "gov_calibrate_clock";

/// Read-only globals of the eBPF object: byte offsets in `struct
/// task_struct` that the agent resolves from the running kernel's BTF and
/// sets before loading (the verifier then knows them as constants).
pub const GLOBAL_OFF_PID: &str = "GOV_OFF_PID";
pub const GLOBAL_OFF_STATE: &str = "GOV_OFF_STATE";
/// `se.sum_exec_runtime`, from the start of `task_struct`.
pub const GLOBAL_OFF_RUNTIME: &str = "GOV_OFF_RUNTIME";
/// `se.exec_start`, from the start of `task_struct`.
pub const GLOBAL_OFF_EXEC_START: &str = "GOV_OFF_EXEC_START";
/// `tgid`, from the start of `task_struct`.
pub const GLOBAL_OFF_TGID: &str = "GOV_OFF_TGID";
/// `se.prev_sum_exec_runtime` (the runtime when the current slice began).
pub const GLOBAL_OFF_PREV_RUNTIME: &str = "GOV_OFF_PREV_RUNTIME";
/// `nvcsw` and `nivcsw` (the task's voluntary and involuntary switch
/// counts; their sum names its slice: the kernel adds one at each switch-out,
/// before the tracepoint).
pub const GLOBAL_OFF_NVCSW: &str = "GOV_OFF_NVCSW";
/// See [`GLOBAL_OFF_NVCSW`].
pub const GLOBAL_OFF_NIVCSW: &str = "GOV_OFF_NIVCSW";
/// `sched_info.run_delay` (the task's total time runnable but waiting for a
/// CPU, schedstat's second field), from the start of `task_struct`.
pub const GLOBAL_OFF_RUN_DELAY: &str = "GOV_OFF_RUN_DELAY";
/// Non-zero when the running kernel keeps `sched_info` (CONFIG_SCHED_INFO):
/// run-queue waits are measured.
pub const GLOBAL_WAIT_ON: &str = "GOV_WAIT_ON";
/// `filename` in `struct linux_binprm`.
pub const GLOBAL_OFF_BPRM_FILENAME: &str = "GOV_OFF_BPRM_FILENAME";
/// `sched_info.last_queued` (when the task was queued to wait for a CPU,
/// 0 when it is not waiting in `sched_info`'s count).
pub const GLOBAL_OFF_LAST_QUEUED: &str = "GOV_OFF_LAST_QUEUED";
/// Non-zero when keyspaces' waiting threads are counted (the "some"
/// pressure): `agent.cpu-pressure` asks for it, the kernel has
/// `sched_info`, and the wakeup program is attached. Zero, the verifier
/// drops the switch program's pressure branches.
pub const GLOBAL_PRESSURE_ON: &str = "GOV_PRESSURE_ON";

/// `task_struct.__state` of a task on its final switch (`TASK_DEAD`).
pub const TASK_DEAD: u32 = 0x80;

/// Compiled-in upper bounds of the maps; the agent may load smaller ones.
pub const MAX_CPUS: u32 = 1024;
pub const DEFAULT_MAX_THREADS: u32 = 16384;
pub const DEFAULT_MAX_KEYSPACES: u32 = 4096;

/// A tag of 0 means "untagged": the slice is charged to no keyspace.
/// Any other tag holds `keyspace cell index + 1` in its low 32 bits (what
/// the charge goes by) and the request kind a server gave in bits 32–39
/// (0: none; only profiles read it, see [`tag_for`]).
pub const TAG_NONE: u64 = 0;

/// Slot states (`ThreadSlot::state`).
pub const SLOT_FREE: u32 = 0;
/// Registered and alive: the kernel charges it.
pub const SLOT_LIVE: u32 = 1;
/// The thread exited: the kernel charged its final slice and cleared its
/// tid entry; the agent may reuse the slot.
pub const SLOT_DEAD: u32 = 2;

/// How long, on a CPU's task clock, a fresh sample of its clock offset
/// stands for the switch-ins that follow (see [`CpuCell`]): the offset
/// drifts by a few hundred ppm at most (0.04 µs in this time), or jumps by
/// what the hypervisor steals, which is bounded by this time too.
pub const FRESH_OFFSET_NS: u64 = 250_000;

/// Per-CPU switch record: the anchor of the registered thread running on
/// this CPU, written by the kernel when it switches a registered thread in.
///
/// A running thread's kernel CPU time is `base_ns` (its runtime at the
/// switch-in) plus the time since `last_switch_ns`, on CLOCK_MONOTONIC.
/// `seq` changes whenever the anchor does, so a reader on this CPU can tell
/// that its reads were not split by a switch.
///
/// The reader trusts the anchor only if it is its own and current: `owner`
/// names the slot (`slot + 1`, with the slot's generation in the high half)
/// and `base_ns` equals the slot's `oncpu_ns`, which the kernel sets at every
/// switch-out. A thread registered while it ran has no anchor of its own
/// yet; and where the kernel does not trace a switch (some hypervisor
/// helper threads are switched without the tracepoint firing), the anchor
/// or the slot belongs to another slice and the two disagree. In both cases
/// the reader asks the kernel with a syscall instead. `last_switch_ns` is 0
/// while no anchor can be made.
///
/// The anchor costs no clock read at a switch: it is the task's own
/// `se.exec_start` (where the kernel starts counting the slice, on the run
/// queue's task clock) moved onto CLOCK_MONOTONIC by `mono_offset_ns`, the
/// difference between the two clocks on this CPU. A sample (one clock read,
/// `ktime − exec_start`) is never below the true offset; it is exact within
/// a microsecond where the scheduler brought the run queue's clock up to
/// date for the switch itself (a task blocked: *fresh*), and high by the
/// wakeup's latency after a wakeup. A fresh sample stands for the
/// switch-ins whose slices start within [`FRESH_OFFSET_NS`] of it on the
/// task clock (no clock read; after a wakeup this anchors exactly where the
/// kernel starts counting); other switch-ins sample. The offset is not
/// constant: it grows as the hypervisor steals time and as the task clock's
/// rate differs from CLOCK_MONOTONIC's (100 µs a second and more on our
/// VMs), so an estimate carried longer would read the thread clock ahead of
/// the kernel, and a thread that charged past the kernel's count would take
/// the excess from its next stretches.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuCell {
    pub seq: u64,
    pub last_switch_ns: u64,
    pub owner: u64,
    /// The switched-in thread's kernel runtime at the switch.
    pub base_ns: u64,
    /// CLOCK_MONOTONIC − the run queue's task clock, wrapping.
    pub mono_offset_ns: u64,
    /// The task clock (`exec_start`) of the last fresh sample of
    /// `mono_offset_ns`.
    pub fresh_task_ns: u64,
    /// Non-zero once `mono_offset_ns` has been measured.
    pub offset_valid: u64,
    /// `(tid + 1) | runner << 32` of the registered thread switched in
    /// last: whom it took the CPU from (a keyspace cell + 1 or a `BEHIND_*`
    /// code), what its wait, charged at its switch-out, was behind. Kernel
    /// only.
    pub behind: u64,
}

/// `CpuCell::owner` of slot `index` at `generation`.
#[inline]
pub const fn cpu_owner(index: u32, generation: u64) -> u64 {
    (index as u64 + 1) | generation << 32
}

/// Per-thread measurement slot.
///
/// `oncpu_ns` is the thread's CPU time as the kernel counts it
/// (`se.sum_exec_runtime`, the counter behind schedstat and
/// `CLOCK_THREAD_CPUTIME_ID`) at its last switch-out: written only by the
/// kernel, while the thread is off-CPU (the fallback backend's agent
/// samples it instead). `charged_ns` is the point of that timeline up to
/// which the thread's time has been charged: the kernel stores it while the
/// thread cannot run; the thread moves it with a single CAS, so an interval
/// is charged by exactly one side.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ThreadSlot {
    /// Kernel CPU time at the last switch-out (eBPF backend) or the last
    /// schedstat sample (fallback backend).
    pub oncpu_ns: u64,
    pub charged_ns: u64,
    /// Current tag: [`TAG_NONE`] or keyspace cell index + 1, with the
    /// request kind above (see [`tag_for`]).
    pub tag: u64,
    /// Registration generation; bumped every time the slot is handed out, so
    /// stale handles can be detected.
    pub generation: u64,
    pub tid: u32,
    pub state: u32,
    /// The tgid that registered the thread (reclaim on client death).
    pub tgid: u32,
    /// The tag the run-queue wait before the current slice is charged to:
    /// the kernel sets it at each switch-out to the tag the thread leaves
    /// with (it cannot change while the thread is off its CPU, so it is the
    /// tag it waits with); a thread that left untagged sets it to the first
    /// tag it takes after (the work a pooled worker was woken for). With
    /// [`WAIT_TAG_WAITING`] while the kernel counts the thread among its
    /// keyspace's waiting threads (woken or preempted, not yet back on a
    /// CPU: never while it runs).
    pub wait_tag: u32,
    /// Charges the thread made itself (diagnostic: how the work splits).
    pub self_charged_ns: u64,
    /// The thread's run-queue delay (`sched_info.run_delay`) at its last
    /// switch-out: its waits are charged from there (kernel only; the agent
    /// sets it at registration).
    pub delay_ns: u64,
}

/// Per-keyspace CPU cell: `cpu_ns` is the total charged to the keyspace
/// that holds cell index `i` (its tag is `i + 1`). Which keyspace that is,
/// the agent's directory says ([`admission::ParamsCell`]); a cell given to a
/// new keyspace keeps counting, and the agent remembers where it started.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct KeyspaceCell {
    /// Total charged on-CPU ns (monotonic).
    pub cpu_ns: u64,
    pub _pad: [u64; 7],
}

/// Log-2 buckets of a keyspace's run-queue waits ([`wait_bucket`]).
pub const WAIT_BUCKETS: usize = 22;
/// Waits below `1 << WAIT_BUCKET_SHIFT` ns fall in bucket 0.
pub const WAIT_BUCKET_SHIFT: u32 = 10;

/// Per-keyspace run-queue wait: how long the keyspace's threads were
/// runnable but waiting for a CPU, charged to the tag they waited with
/// (registered threads) or their rule's keyspace (rule-measured processes).
/// A wait is one stretch from becoming runnable (a wakeup, or a preemption
/// that left it runnable) to getting a CPU, as the kernel's `sched_info`
/// counts it. Written by the kernel only; the agent reads it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct KeyspaceWait {
    /// Total ns waited (monotonic).
    pub wait_ns: u64,
    /// `hist[k]`: waits of `wait_bucket(ns) == k` (their sum is the count).
    pub hist: [u64; WAIT_BUCKETS],
    /// What the waits were behind: the task a waiting thread took its CPU
    /// from when its wait ended, as `behind_runner[i]` (0: a free slot;
    /// a keyspace cell + 1, or one of the `BEHIND_*` codes) with the ns
    /// waited behind it in `behind_ns[i]` (monotonic, whoever holds the
    /// slot). The kernel claims a free slot for a runner it has no slot
    /// for; the agent frees slots that stopped growing; waits behind a
    /// runner with no slot free go to `behind_other_ns`.
    pub behind_runner: [u32; BEHIND_SLOTS],
    pub behind_ns: [u64; BEHIND_SLOTS],
    pub behind_other_ns: u64,
    /// Registered threads of the keyspace waiting for a CPU now (woken or
    /// preempted while tagged with it, not yet switched in).
    pub waiting: u64,
    /// When `waiting` last went from 0 to 1 (CLOCK_MONOTONIC ns).
    pub some_since_ns: u64,
    /// Time during which `waiting` was above 0, up to its last return to
    /// 0 (monotonic): the keyspace's PSI-style "some" CPU pressure.
    pub some_ns: u64,
    /// When `waiting` last returned to 0, after `some_ns` took the
    /// stretch: a `some_since_ns` not after it is a stretch's start not
    /// yet written.
    pub some_closed_ns: u64,
}

/// [`ThreadSlot::wait_tag`]'s flag: the thread is counted in its
/// keyspace's [`KeyspaceWait::waiting`].
pub const WAIT_TAG_WAITING: u32 = 1 << 31;

/// Slots of [`KeyspaceWait::behind_runner`].
pub const BEHIND_SLOTS: usize = 8;
/// A waiter took its CPU from a registered thread that had no tag (the
/// server's own work).
pub const BEHIND_UNTAGGED: u32 = u32::MAX - 3;
/// ... from a task governor does not measure (another process, a kernel
/// thread, a process no rule matched or whose rule is being decided).
pub const BEHIND_UNMEASURED: u32 = u32::MAX - 2;
/// ... from the idle task: the CPU was free, the wait was the wakeup's own.
pub const BEHIND_IDLE: u32 = u32::MAX - 1;
/// Not known: the thread's switch-in was not seen (it was registered, or
/// the agent started, while it ran).
pub const BEHIND_UNKNOWN: u32 = u32::MAX;

/// The bucket of a wait of `ns`: the bit length of `ns >> WAIT_BUCKET_SHIFT`,
/// at most `WAIT_BUCKETS - 1`. Bucket `k < WAIT_BUCKETS - 1` holds waits
/// below [`wait_bucket_le_ns`]`(k)`; the last holds the rest.
#[inline(always)]
pub const fn wait_bucket(ns: u64) -> usize {
    let mut v = ns >> WAIT_BUCKET_SHIFT;
    // The open bucket first, against a constant: every path below then
    // holds `v < 2^(WAIT_BUCKETS - 1)` and ends below WAIT_BUCKETS, which
    // the eBPF verifier (6.1's too) can follow; a clamp at the end it
    // cannot.
    if v >= 1 << (WAIT_BUCKETS - 1) {
        return WAIT_BUCKETS - 1;
    }
    let mut k = 0usize;
    // A binary search, not a loop: the eBPF verifier sees a bounded path.
    if v >= 1 << 16 {
        v >>= 16;
        k += 16;
    }
    if v >= 1 << 8 {
        v >>= 8;
        k += 8;
    }
    if v >= 1 << 4 {
        v >>= 4;
        k += 4;
    }
    if v >= 1 << 2 {
        v >>= 2;
        k += 2;
    }
    if v >= 1 << 1 {
        v >>= 1;
        k += 1;
    }
    k + v as usize
}

/// The exclusive upper bound, in ns, of wait bucket `k` (not the last).
#[inline]
pub const fn wait_bucket_le_ns(k: usize) -> u64 {
    1u64 << (WAIT_BUCKET_SHIFT as usize + k)
}

/// The `q` quantile (0..=1), in ns, of the waits a histogram of
/// [`WAIT_BUCKETS`] counts holds, interpolated within its log-2 bucket (the
/// open last bucket read as one more doubling); `None` without waits.
pub fn wait_quantile_ns(hist: &[u64], q: f64) -> Option<f64> {
    let total: u64 = hist.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total as f64;
    let mut below = 0u64;
    for (k, &n) in hist.iter().enumerate() {
        if n > 0 && (below + n) as f64 >= rank {
            let lo = if k == 0 { 0.0 } else { wait_bucket_le_ns(k - 1) as f64 };
            let hi = if k + 1 < WAIT_BUCKETS { wait_bucket_le_ns(k) as f64 } else { lo * 2.0 };
            let within = ((rank - below as f64) / n as f64).clamp(0.0, 1.0);
            return Some(lo + (hi - lo) * within);
        }
        below += n;
    }
    None
}

/// The clock part of the agent's header ([`admission::HeaderPage`]): the
/// TSC → CLOCK_MONOTONIC mapping that lets a thread read the kernel's clock
/// without the vDSO call.
///
/// `ns = ns_base + ((tsc − tsc_base) × mult) >> 32`, valid while
/// `clock_valid != 0`; `clock_seq` is odd while the agent rewrites it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HeaderCell {
    pub clock_seq: u64,
    pub tsc_base: u64,
    pub ns_base: u64,
    /// ns per TSC tick, 32.32 fixed point.
    pub mult: u64,
    pub clock_valid: u64,
    pub _pad: [u64; 3],
}

const _: () = assert!(size_of::<HeaderCell>() == 64);
const _: () = assert!(size_of::<CpuCell>() == 64);
const _: () = assert!(size_of::<ThreadSlot>() == 64);
const _: () = assert!(size_of::<KeyspaceCell>() == 64);
const _: () = assert!(align_of::<CpuCell>() == 8);
const _: () = assert!(align_of::<ThreadSlot>() == 8);
const _: () = assert!(align_of::<KeyspaceCell>() == 8);
const _: () = assert!(size_of::<RuleEvent>() == 168);
const _: () = assert!(size_of::<RuleCpu>() == 32);
const _: () = assert!(size_of::<KeyspaceWait>() == 320);
const _: () = assert!(size_of::<ProfileKey>() == 32);
const _: () = assert!(size_of::<StackFrames>() == 8 * MAX_FRAMES);

/// First probe position of `keyspace_id` in a table of `len` cells
/// (`len` a power of two). Fibonacci hashing: ids are often dense small
/// integers, which a plain modulo would cluster.
#[inline]
pub const fn probe_start(keyspace_id: u32, len: u32) -> u32 {
    let h = (keyspace_id as u64).wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ((h >> 32) as u32) & (len - 1)
}

/// Tag value for keyspace cell `index`.
#[inline]
pub const fn tag_for_cell(index: u32) -> u64 {
    index as u64 + 1
}

/// Tag value for keyspace cell `index` doing a request of `kind` (a
/// server's own numbering of its request kinds: get, scan, write…; 0 for
/// none). The kind never changes what is charged where.
#[inline]
pub const fn tag_for(index: u32, kind: u8) -> u64 {
    tag_for_cell(index) | (kind as u64) << 32
}

/// The request kind a tag carries (0: none given).
#[inline]
pub const fn kind_of_tag(tag: u64) -> u8 {
    (tag >> 32) as u8
}

/// Keyspace cell index of a tag, or `None` for [`TAG_NONE`].
#[inline]
pub const fn cell_of_tag(tag: u64) -> Option<u32> {
    match tag as u32 {
        0 => None,
        low => Some(low - 1),
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: the types are repr(C), made only of integers, with no implicit
    // padding (checked by the size asserts above); any bit pattern is valid.
    unsafe impl aya::Pod for super::CpuCell {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::ThreadSlot {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::KeyspaceCell {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::RuleCpu {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::KeyspaceWait {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::ProfileKey {}
    // SAFETY: as above: plain integers, no padding.
    unsafe impl aya::Pod for super::StackFrames {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stack_is_keyed_by_its_walked_frames_alone_and_never_as_none_or_lost() {
        let mut a = [0u64; MAX_FRAMES];
        // The instructions of one hot loop, one frame each: a stack apiece.
        let mut keys = std::collections::HashSet::new();
        for ip in 0x5555_0000_1000u64..0x5555_0000_1000 + 20_000 {
            a[0] = ip;
            let k = stack_hash(&a, 1);
            assert!(k > LOST_STACK);
            assert!(keys.insert(k), "two stacks share key {k:#x}");
        }
        // What lies past the walked frames does not count; a deeper stack
        // is another; the full depth is read.
        let (b, mut c) = ([7u64; MAX_FRAMES], [7u64; MAX_FRAMES]);
        c[5] = 8;
        assert_eq!(stack_hash(&b, 5), stack_hash(&c, 5));
        assert_ne!(stack_hash(&b, 6), stack_hash(&c, 6));
        assert_ne!(stack_hash(&b, 2), stack_hash(&b, 3));
        let mut d = b;
        d[MAX_FRAMES - 1] = 9;
        assert_ne!(stack_hash(&b, MAX_FRAMES), stack_hash(&d, MAX_FRAMES));
    }

    #[test]
    fn tags_round_trip_and_zero_is_untagged() {
        assert_eq!(cell_of_tag(TAG_NONE), None);
        for i in [0u32, 1, 17, 4095, u32::MAX - 1] {
            assert_eq!(cell_of_tag(tag_for_cell(i)), Some(i));
            assert_eq!(kind_of_tag(tag_for_cell(i)), 0);
            // A kind rides along and changes nothing of the charge.
            for kind in [1u8, 7, 255] {
                assert_eq!((cell_of_tag(tag_for(i, kind)), kind_of_tag(tag_for(i, kind))), (Some(i), kind));
                assert_eq!(cell_of_tag(tag_for(i, kind) as u32 as u64), Some(i), "a wait tag keeps the cell");
            }
        }
    }

    #[test]
    fn cpu_owner_tells_slots_and_generations_apart() {
        assert_ne!(cpu_owner(0, 1), cpu_owner(1, 1));
        assert_ne!(cpu_owner(5, 1), cpu_owner(5, 2));
        // Never 0, the value of a cell no registered thread was switched into.
        assert_ne!(cpu_owner(0, 0), 0);
    }

    #[test]
    fn probe_start_stays_in_range_and_spreads_dense_ids() {
        let len = 4096;
        let mut seen = [false; 4096];
        let mut distinct = 0;
        for id in 0..1024u32 {
            let p = probe_start(id, len);
            assert!(p < len);
            if !seen[p as usize] {
                seen[p as usize] = true;
                distinct += 1;
            }
        }
        // Dense ids must not pile onto a few buckets.
        assert!(distinct > 800, "only {distinct} distinct probe starts");
    }

    #[test]
    fn field_offsets_are_stable() {
        // The eBPF object and the client read these offsets; a change here
        // is an ABI change.
        assert_eq!(core::mem::offset_of!(CpuCell, seq), 0);
        assert_eq!(core::mem::offset_of!(CpuCell, last_switch_ns), 8);
        assert_eq!(core::mem::offset_of!(CpuCell, owner), 16);
        assert_eq!(core::mem::offset_of!(CpuCell, base_ns), 24);
        assert_eq!(core::mem::offset_of!(ThreadSlot, oncpu_ns), 0);
        assert_eq!(core::mem::offset_of!(ThreadSlot, charged_ns), 8);
        assert_eq!(core::mem::offset_of!(ThreadSlot, tag), 16);
        assert_eq!(core::mem::offset_of!(ThreadSlot, tid), 32);
        assert_eq!(core::mem::offset_of!(ThreadSlot, state), 36);
        assert_eq!(core::mem::offset_of!(KeyspaceCell, cpu_ns), 0);
    }

    #[test]
    fn wait_buckets_are_log2_from_a_microsecond() {
        assert_eq!(wait_bucket(0), 0);
        assert_eq!(wait_bucket(1023), 0);
        assert_eq!(wait_bucket(1024), 1);
        assert_eq!(wait_bucket(2047), 1);
        assert_eq!(wait_bucket(2048), 2);
        assert_eq!(wait_bucket(u64::MAX), WAIT_BUCKETS - 1);
        // Every wait below a bucket's bound falls in it or below, every
        // wait at the bound above it.
        for k in 0..WAIT_BUCKETS - 1 {
            let le = wait_bucket_le_ns(k);
            assert_eq!(wait_bucket(le - 1), k, "{le}");
            assert_eq!(wait_bucket(le), k + 1, "{le}");
        }
    }
}
