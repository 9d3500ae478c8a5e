//! Which CPU a thread runs on, the CPUs the node has, the scheduler's
//! slice, the time-stamp counter.

use std::io;

/// CPU the calling thread runs on: read straight from the thread's rseq
/// area (which glibc registers and the kernel keeps current), else
/// `sched_getcpu`.
#[inline]
pub fn current_cpu() -> u32 {
    #[cfg(test)]
    if let Some(cpu) = super::fake::cpu() {
        return cpu;
    }
    if let Some(cpu) = rseq::cpu_id() {
        return cpu;
    }
    // SAFETY: sched_getcpu has no arguments; -1 only without kernel support.
    let cpu = unsafe { libc::sched_getcpu() };
    cpu.max(0) as u32
}

/// [`current_cpu`], with acquire ordering: no later load moves before it.
#[inline]
pub fn current_cpu_ordered() -> u32 {
    let cpu = current_cpu();
    std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
    cpu
}

#[cfg(all(target_env = "gnu", any(target_arch = "x86_64", target_arch = "aarch64")))]
mod rseq {
    use std::sync::atomic::{AtomicU32, Ordering};

    // Exported by glibc ≥ 2.35: where this thread's `struct rseq` lives,
    // relative to the thread pointer, and its size (0: not registered).
    unsafe extern "C" {
        static __rseq_offset: isize;
        static __rseq_size: u32;
    }

    /// Offset of `cpu_id` in `struct rseq` (after `cpu_id_start`).
    const CPU_ID: isize = 4;

    #[inline]
    fn thread_pointer() -> *const u8 {
        let tp: usize;
        // SAFETY: reads the thread pointer register (x86_64: the TCB's self
        // pointer at %fs:0; aarch64: TPIDR_EL0); no memory is written.
        unsafe {
            #[cfg(target_arch = "x86_64")]
            std::arch::asm!("mov {}, fs:0", out(reg) tp, options(nostack, readonly, preserves_flags));
            #[cfg(target_arch = "aarch64")]
            std::arch::asm!("mrs {}, tpidr_el0", out(reg) tp, options(nostack, nomem, preserves_flags));
        }
        tp as *const u8
    }

    #[inline]
    pub fn cpu_id() -> Option<u32> {
        // SAFETY: plain reads of two constants glibc sets before main.
        if unsafe { __rseq_size } == 0 {
            return None;
        }
        // SAFETY: with rseq registered, thread pointer + __rseq_offset is this
        // thread's `struct rseq`, live for the thread's lifetime; the kernel
        // updates cpu_id, so it is read atomically.
        let cpu = unsafe {
            let p = thread_pointer().offset(__rseq_offset + CPU_ID) as *const AtomicU32;
            (*p).load(Ordering::Relaxed)
        };
        // RSEQ_CPU_ID_UNINITIALIZED / REGISTRATION_FAILED are negative.
        (cpu as i32 >= 0).then_some(cpu)
    }
}

#[cfg(not(all(target_env = "gnu", any(target_arch = "x86_64", target_arch = "aarch64"))))]
mod rseq {
    #[inline]
    pub fn cpu_id() -> Option<u32> {
        None
    }
}

/// Asks the kernel's fair scheduler for a custom slice for the calling
/// thread (`sched_setattr` with `sched_runtime` under `SCHED_OTHER`, which
/// EEVDF honours from Linux 6.12; older kernels accept and ignore it).
///
/// A server whose workers run long requests between short ones gives its
/// workers a short slice: a wakeup that lands on a core where a worker is
/// deep in a long request then waits at most about `slice`, not the
/// default (0.75 ms × (1 + log2 cores)). governor bounds how *much* CPU a
/// tenant gets; the slice bounds how *long* one request can hold a core.
/// The kernel clamps the value to 0.1–100 ms.
pub fn set_thread_slice(slice: std::time::Duration) -> io::Result<()> {
    set_task_slice(0, slice)
}

/// [`set_thread_slice`] for thread `tid` of any process (0: the calling
/// thread); another process's threads need `CAP_SYS_NICE` or the same
/// owner. Its nice value stays.
pub fn set_task_slice(tid: u32, slice: std::time::Duration) -> io::Result<()> {
    // struct sched_attr as of SCHED_ATTR_SIZE_VER0 (48 bytes).
    #[repr(C)]
    struct SchedAttr {
        size: u32,
        policy: u32,
        flags: u64,
        nice: i32,
        priority: u32,
        runtime: u64,
        deadline: u64,
        period: u64,
    }
    // SAFETY: getpriority on the calling thread has no memory effects.
    let nice = unsafe {
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, tid)
    };
    if nice == -1 && io::Error::last_os_error().raw_os_error() != Some(0) {
        return Err(io::Error::last_os_error());
    }
    let attr = SchedAttr {
        size: std::mem::size_of::<SchedAttr>() as u32,
        policy: libc::SCHED_OTHER as u32,
        flags: 0,
        nice,
        priority: 0,
        runtime: u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX),
        deadline: 0,
        period: 0,
    };
    // SAFETY: the kernel reads `attr.size` bytes from a live, initialised
    // struct; pid 0 is the calling thread.
    let r = unsafe { libc::syscall(libc::SYS_sched_setattr, tid, &attr as *const SchedAttr, 0u32) };
    if r == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Pins the calling thread to CPU `cpu` (its affinity mask: that CPU only).
pub fn pin_current_thread_to(cpu: u32) -> io::Result<()> {
    set_current_thread_cpus(&[cpu])
}

/// Sets the calling thread's affinity mask to `cpus`.
pub fn set_current_thread_cpus(cpus: &[u32]) -> io::Result<()> {
    if let Some(&cpu) = cpus.iter().find(|&&c| c as usize >= libc::CPU_SETSIZE as usize) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("CPU {cpu} is past the affinity mask's size")));
    }
    // SAFETY: a zeroed cpu_set_t is valid; every CPU is within it; the
    // kernel only reads it.
    let r = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &cpu in cpus {
            libc::CPU_SET(cpu as usize, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if r == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// The CPUs the calling thread may run on now (its affinity mask), lowest
/// first.
pub fn current_thread_cpus() -> io::Result<Vec<u32>> {
    // SAFETY: a zeroed cpu_set_t is valid; the kernel writes at most its size.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(io::Error::last_os_error());
        }
        set
    };
    // SAFETY: CPU_ISSET reads the set within its size.
    Ok((0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).map(|c| c as u32).collect())
}

/// Number of possible CPUs (the size of per-CPU tables).
pub fn possible_cpus() -> io::Result<u32> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/possible")?;
    parse_cpu_list(text.trim())
        .map(|max| max + 1)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("bad cpu list {text:?}")))
}

/// Online CPU ids.
pub fn online_cpus() -> io::Result<Vec<u32>> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/online")?;
    let mut cpus = Vec::new();
    for part in text.trim().split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b): (u32, u32) = (
            a.parse().map_err(|_| io::Error::new(io::ErrorKind::InvalidData, text.clone()))?,
            b.parse().map_err(|_| io::Error::new(io::ErrorKind::InvalidData, text.clone()))?,
        );
        cpus.extend(a..=b);
    }
    Ok(cpus)
}

fn parse_cpu_list(s: &str) -> Option<u32> {
    s.split(',').filter_map(|p| p.rsplit('-').next()?.parse::<u32>().ok()).max()
}

/// Logical cores the node has (what "cores" means in every ratio).
pub fn logical_cores() -> u32 {
    std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1)
}

/// The CPU's time-stamp counter, where it has one (x86_64).
#[inline]
pub fn rdtsc() -> Option<u64> {
    #[cfg(test)]
    if let Some(tsc) = super::fake::tsc() {
        return tsc;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: RDTSC reads a counter; it has no memory effects.
        Some(unsafe { core::arch::x86_64::_rdtsc() })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse() {
        assert_eq!(parse_cpu_list("0-1"), Some(1));
        assert_eq!(parse_cpu_list("0"), Some(0));
        assert_eq!(parse_cpu_list("0-3,8-11"), Some(11));
        assert_eq!(parse_cpu_list(""), None);
    }

    #[test]
    fn rseq_cpu_matches_sched_getcpu() {
        // Pinned, so the two reads cannot straddle a migration.
        // SAFETY: sched_getcpu has no arguments.
        let cpu = unsafe { libc::sched_getcpu() } as usize;
        pin_current_thread_to(cpu as u32).unwrap();
        // SAFETY: as above.
        unsafe {
            for _ in 0..100 {
                assert_eq!(current_cpu(), libc::sched_getcpu() as u32);
            }
            if let Some(c) = rseq::cpu_id() {
                assert_eq!(c as usize, cpu);
            }
        }
    }
}
