//! Futexes on shared words: the waits and wakes of the token lines.

use std::io;

/// Waits while the shared word at `word` still holds `expected`, at most
/// `timeout`. Returns early when woken, when the value differs already, or
/// on a signal; the caller re-checks its condition either way.
pub fn futex_wait(word: &std::sync::atomic::AtomicU32, expected: u32, timeout: std::time::Duration) {
    let ts =
        libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    // SAFETY: word is a valid, aligned u32 (it may be in a shared mapping:
    // the shared, not private, futex op is used); ts is a valid timeout.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, &ts as *const libc::timespec);
    }
}

/// [`futex_wait`] for a waiter that only a wake naming one of `bits`
/// concerns (`FUTEX_WAIT_BITSET`): [`futex_wake_bits`] with other bits
/// leaves it asleep. `deadline_ns` is absolute, CLOCK_MONOTONIC.
pub fn futex_wait_bits(word: &std::sync::atomic::AtomicU32, expected: u32, deadline_ns: u64, bits: u32) {
    #[cfg(test)]
    if super::fake::futex_wait(bits, deadline_ns).is_some() {
        return;
    }
    let ts = libc::timespec {
        tv_sec: (deadline_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (deadline_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: word is a valid, aligned u32 (maybe in a shared mapping: the
    // shared op); ts is a valid absolute timeout; the fifth argument is
    // unused by this op.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT_BITSET,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            bits,
        );
    }
}

/// Wakes the waiters of the shared word at `word` whose bits meet `bits`
/// (`FUTEX_WAKE_BITSET`; plain and `futex_waitv` waiters match any bits).
pub fn futex_wake_bits(word: &std::sync::atomic::AtomicU32, bits: u32) {
    #[cfg(test)]
    if super::fake::futex_wake(bits).is_some() {
        return;
    }
    // SAFETY: word is a valid, aligned u32; the op only reads its address;
    // the timeout and second address are unused by it.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE_BITSET,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            bits,
        );
    }
}

/// Wakes up to `n` waiters of the shared word at `word`.
pub fn futex_wake(word: &std::sync::atomic::AtomicU32, n: i32) {
    #[cfg(test)]
    if super::fake::futex_wake(u32::MAX).is_some() {
        return;
    }
    // SAFETY: word is a valid, aligned u32; FUTEX_WAKE only reads its address.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, n);
    }
}

/// Waits until any of `words` (address, expected value) no longer holds
/// its value, or until CLOCK_MONOTONIC reaches `deadline_ns`
/// (`futex_waitv`, Linux 5.16). At most 128 words.
pub fn futex_waitv(words: &[(&std::sync::atomic::AtomicU32, u32)], deadline_ns: u64) -> io::Result<()> {
    #[repr(C)]
    struct Waitv {
        val: u64,
        uaddr: u64,
        flags: u32,
        reserved: u32,
    }
    const FUTEX2_SIZE_U32: u32 = 0x02;
    const SYS_FUTEX_WAITV: libc::c_long = 449;
    let v: Vec<Waitv> = words
        .iter()
        .map(|(w, val)| Waitv { val: *val as u64, uaddr: w.as_ptr() as u64, flags: FUTEX2_SIZE_U32, reserved: 0 })
        .collect();
    let ts = libc::timespec {
        tv_sec: (deadline_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (deadline_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: v holds valid futex_waitv entries for aligned u32 words that
    // outlive the call; ts is an absolute CLOCK_MONOTONIC deadline.
    let rc = unsafe {
        libc::syscall(
            SYS_FUTEX_WAITV,
            v.as_ptr(),
            v.len() as libc::c_uint,
            0,
            &ts as *const libc::timespec,
            libc::CLOCK_MONOTONIC,
        )
    };
    if rc < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::ETIMEDOUT) | Some(libc::EINTR) => Ok(()),
            _ => Err(e),
        };
    }
    Ok(())
}
