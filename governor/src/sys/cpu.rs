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

/// One CPU for each of a runtime's worker threads, in turn: for a server
/// whose pool has about as many workers as it has CPUs.
///
/// Left to itself, the kernel may place a woken worker on the CPU where
/// another worker runs, when the other CPU is busy for a moment (a network
/// thread's few µs), and an idle CPU does not pull it back while its idle
/// stretches are shorter than the scheduler's migration cost (0.5 ms): two
/// workers then share one core, a slice each in turn, while the other core
/// idles, and a request that arrives waits for a slice. One worker per CPU
/// keeps them apart. Pinning also keeps a worker where it is when another
/// process takes its CPU, so it suits a node whose cores the server owns.
///
/// ```no_run
/// # struct Builder; impl Builder { fn on_thread_park(self, _f: impl Fn() + Send + Sync + 'static) -> Self { self } }
/// # let builder = Builder;
/// let spread = keyspace_governor::client::CpuSpread::new()?;
/// let builder = builder.on_thread_park(spread.pin_on_park());
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct CpuSpread {
    inner: std::sync::Arc<SpreadInner>,
}

#[derive(Debug)]
struct SpreadInner {
    cpus: Vec<u32>,
    next: std::sync::atomic::AtomicUsize,
}

thread_local! {
    static PINNED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl CpuSpread {
    /// The CPUs the calling thread may run on now (its affinity mask, as
    /// its cgroup's cpuset and `taskset` left it), lowest first.
    pub fn new() -> io::Result<CpuSpread> {
        // SAFETY: a zeroed cpu_set_t is valid; the kernel writes at most its size.
        let set = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
                return Err(io::Error::last_os_error());
            }
            set
        };
        // SAFETY: CPU_ISSET reads the set within its size.
        let cpus: Vec<u32> = (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
            .map(|c| c as u32)
            .collect();
        Ok(CpuSpread { inner: std::sync::Arc::new(SpreadInner { cpus, next: std::sync::atomic::AtomicUsize::new(0) }) })
    }

    /// The CPUs handed out in turn.
    pub fn cpus(&self) -> &[u32] {
        &self.inner.cpus
    }

    /// Pins the calling thread to the next CPU in turn (after the last, the
    /// first again) and returns it.
    pub fn pin_current_thread(&self) -> io::Result<u32> {
        let cpus = &self.inner.cpus;
        if cpus.is_empty() {
            return Err(io::Error::new(io::ErrorKind::NotFound, "no CPU in the affinity mask"));
        }
        let cpu = cpus[self.inner.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % cpus.len()];
        pin_current_thread_to(cpu)?;
        PINNED.with(|p| p.set(true));
        Ok(cpu)
    }

    /// For tokio's `Builder::on_thread_park`: pins each worker thread the
    /// first time it parks (a worker parks as soon as it starts idle), and
    /// never a blocking-pool thread, which does not park this way. Later
    /// parks cost a thread-local check. A failure is logged, not raised:
    /// the thread runs where the kernel puts it. To register the workers
    /// too, call both closures from one `on_thread_park`.
    pub fn pin_on_park(&self) -> impl Fn() + Send + Sync + 'static {
        let spread = self.clone();
        move || {
            if !PINNED.with(|p| p.get())
                && let Err(e) = spread.pin_current_thread()
            {
                PINNED.with(|p| p.set(true));
                log::warn!("pinning a runtime worker to a CPU: {e}");
            }
        }
    }
}

/// Pins the calling thread to CPU `cpu` (its affinity mask: that CPU only).
pub fn pin_current_thread_to(cpu: u32) -> io::Result<()> {
    if cpu as usize >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("CPU {cpu} is past the affinity mask's size")));
    }
    // SAFETY: a zeroed cpu_set_t is valid; `cpu` is within it; the kernel
    // only reads it.
    let r = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu as usize, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if r == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
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
