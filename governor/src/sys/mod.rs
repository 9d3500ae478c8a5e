//! The syscall seam: every raw libc call governor makes outside the region
//! views lives here, each behind a safe function, in a file by kind of call:
//!
//! - `cpu` — the CPU a thread runs on (rseq), the node's CPUs, affinity,
//!   the scheduler's slice, the time-stamp counter;
//! - `spread` — runtime workers one to a CPU, let go while other processes
//!   hold the CPUs;
//! - `clock` — CLOCK_MONOTONIC and the thread's CPU clock;
//! - `memory` — mappings, memfds and seals, BPF map descriptors, memlock;
//! - `futex` — the waits and wakes of the token lines;
//! - `socket` — descriptors passed over unix sockets, peer credentials;
//! - `process` — ids, capabilities, pidfds, fork hooks, limits.
//!
//! (Cgroups are read and written through their files; they need no raw call.)
//!
//! In the library's unit tests the calls that make time and place — the
//! CPU, both clocks, the TSC — and the token lines' futex waits and wakes
//! go first to `fake`, a per-thread double a test sets, so the thread
//! clock, the TSC mapping, the charging protocol and waiting in line are
//! tested on plain memory without eBPF, an agent or a scheduler's help.
#![allow(unsafe_code)]

mod clock;
mod cpu;
mod futex;
mod memory;
mod process;
mod socket;
mod spread;

#[cfg(test)]
pub(crate) mod fake;

pub use clock::{clock_ticks_per_second, monotonic_ns, process_cputime_ns, thread_cputime_ns};
pub use cpu::{
    current_cpu, current_cpu_ordered, current_thread_cpus, logical_cores, online_cpus, pin_current_thread_to,
    possible_cpus, rdtsc, set_current_thread_cpus, set_task_slice, set_thread_slice,
};
pub use futex::{futex_wait, futex_wait_bits, futex_waitv, futex_wake, futex_wake_bits};
pub use memory::{
    Mapping, bpf_map_dup, bpf_map_freeze, memfd, memlock_limit, page_size, raise_memlock, region_len, ring_buffer_wait,
    seal, wake, wake_fd,
};
pub use process::{
    CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN, effective_gid, effective_uid, gettid, on_fork_child, pidfd_open,
    raise_fd_limit, random_u64,
};
pub use socket::{peer_cred, peer_pid, recv_with_fds, send_with_fds};
pub use spread::CpuSpread;
