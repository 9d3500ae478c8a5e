//! This process and others: ids, capabilities, pidfds, fork hooks,
//! randomness, the descriptor limit.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Current thread id.
pub fn gettid() -> u32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() as u32 }
}

/// The effective uid of this process.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}

/// The effective gid of this process.
pub fn effective_gid() -> u32 {
    // SAFETY: getegid cannot fail and touches no memory.
    unsafe { libc::getegid() }
}

/// A descriptor that becomes readable when process `pid` exits.
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags; it returns a new descriptor.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by the kernel and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// 8 random bytes from the kernel.
pub fn random_u64() -> u64 {
    let mut v = 0u64;
    // SAFETY: v is a valid 8-byte buffer.
    unsafe { libc::getrandom((&mut v as *mut u64).cast(), 8, 0) };
    v
}

pub const CAP_SYS_ADMIN: u32 = 21;
pub const CAP_PERFMON: u32 = 38;
pub const CAP_BPF: u32 = 39;

/// Runs `child` in the child after every fork of this process.
pub fn on_fork_child(child: extern "C" fn()) {
    // SAFETY: registers a plain function pointer; it runs in the child with
    // only the forking thread alive.
    unsafe { libc::pthread_atfork(None, None, Some(child)) };
}

/// Raises the descriptor limit to its hard maximum: every client holds two
/// connections and a ledger.
pub fn raise_fd_limit() {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: rl is a valid out-pointer; setrlimit only reads it.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) == 0 && rl.rlim_cur < rl.rlim_max {
            rl.rlim_cur = rl.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &rl);
        }
    }
}
