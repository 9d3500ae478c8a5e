//! The kernel's clocks: CLOCK_MONOTONIC and the calling thread's CPU time.

#[inline]
fn clock(id: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid out-pointer; the clocks used here always exist.
    unsafe { libc::clock_gettime(id, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CLOCK_MONOTONIC in ns: the clock `bpf_ktime_get_ns` reads.
#[inline]
pub fn monotonic_ns() -> u64 {
    #[cfg(test)]
    if let Some(ns) = super::fake::monotonic_ns() {
        return ns;
    }
    clock(libc::CLOCK_MONOTONIC)
}

/// The calling thread's CPU time (a syscall, ~600 ns on a VM).
#[inline]
pub fn thread_cputime_ns() -> u64 {
    #[cfg(test)]
    if let Some(ns) = super::fake::thread_cputime_ns() {
        return ns;
    }
    clock(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// The calling process's CPU time, all its threads (a syscall).
pub fn process_cputime_ns() -> u64 {
    clock(libc::CLOCK_PROCESS_CPUTIME_ID)
}

/// The unit of `/proc/stat` and `/proc/<pid>/stat` times, per second.
pub fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf reads a constant of the C library.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 { hz as u64 } else { 100 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_clock_advances_with_work() {
        let a = thread_cputime_ns();
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        assert!(thread_cputime_ns() > a);
    }
}
