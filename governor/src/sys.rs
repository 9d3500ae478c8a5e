//! The syscall seam: every raw libc call governor makes outside the region
//! views lives here, each behind a safe function.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Current thread id.
pub fn gettid() -> u32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() as u32 }
}

/// CPU the calling thread runs on: read straight from the thread's rseq
/// area (which glibc registers and the kernel keeps current), else
/// `sched_getcpu`.
#[inline]
pub fn current_cpu() -> u32 {
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
    clock(libc::CLOCK_MONOTONIC)
}

/// The calling thread's CPU time (a syscall, ~600 ns on a VM).
#[inline]
pub fn thread_cputime_ns() -> u64 {
    clock(libc::CLOCK_THREAD_CPUTIME_ID)
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
        libc::getpriority(libc::PRIO_PROCESS, 0)
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
    let r = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0u32) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
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
    s.split(',')
        .filter_map(|p| p.rsplit('-').next()?.parse::<u32>().ok())
        .max()
}

/// Logical cores the node has (what "cores" means in every ratio).
pub fn logical_cores() -> u32 {
    std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1)
}

/// A shared mapping of `len` bytes of `fd` at offset 0.
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; all access goes through atomics.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes (rounded up to a page) of `fd`, read-write, shared.
    pub fn map(fd: RawFd, len: usize) -> io::Result<Mapping> {
        Self::map_prot(fd, len, libc::PROT_READ | libc::PROT_WRITE)
    }

    /// Maps `len` bytes (rounded up to a page) of `fd`, read-only, shared.
    pub fn map_readonly(fd: RawFd, len: usize) -> io::Result<Mapping> {
        Self::map_prot(fd, len, libc::PROT_READ)
    }

    fn map_prot(fd: RawFd, len: usize, prot: libc::c_int) -> io::Result<Mapping> {
        let page = page_size();
        let len = len.div_ceil(page) * page;
        // SAFETY: a fresh shared mapping of a file descriptor we were given;
        // the kernel validates fd, length and protection.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr: ptr.cast(), len })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len came from a successful mmap and are unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

/// An anonymous memory file of `len` bytes, zero-filled, that can be
/// sealed ([`seal`]).
pub fn memfd(name: &str, len: usize) -> io::Result<OwnedFd> {
    let cname = CString::new(name).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: cname is a valid C string; flags are constants.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by memfd_create and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: fd is a valid memfd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// `F_SEAL_FUTURE_WRITE` (Linux 5.1): no new writable mapping or write.
const F_SEAL_FUTURE_WRITE: libc::c_int = 0x0010;

/// Seals a memfd so that nobody it is handed to can resize it; with
/// `read_only`, nobody can map it writable or write it any more either
/// (mappings made before the seal, the agent's own, stay writable). The
/// seals themselves are sealed.
pub fn seal(fd: RawFd, read_only: bool) -> io::Result<()> {
    let mut seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    if read_only {
        seals |= F_SEAL_FUTURE_WRITE;
    }
    // SAFETY: fcntl on a descriptor we own; the kernel validates it.
    if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Length in bytes a region descriptor can back: a memfd's size, or for a
/// BPF array map its entries × the value size rounded to 8 (the kernel's
/// layout of a mmapable array). Checked before mapping, so a short or
/// resized descriptor is refused instead of faulting later.
pub fn region_len(fd: RawFd) -> io::Result<usize> {
    // SAFETY: a zeroed stat is a valid out-parameter.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is a descriptor; st is a valid out-pointer.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if st.st_size > 0 {
        return Ok(st.st_size as usize);
    }
    // Not a file with a size: a BPF map's size from its information.
    let info = bpf_map_info(fd)?;
    Ok(info.max_entries as usize * (info.value_size as usize).div_ceil(8) * 8)
}

/// The head of `struct bpf_map_info`.
struct BpfMapInfo {
    value_size: u32,
    max_entries: u32,
}

fn bpf_map_info(fd: RawFd) -> io::Result<BpfMapInfo> {
    #[repr(C)]
    struct InfoAttr {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    let mut info = [0u8; 96];
    let mut attr = InfoAttr { bpf_fd: fd as u32, info_len: info.len() as u32, info: info.as_mut_ptr() as u64 };
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    // SAFETY: attr points at a buffer of info_len bytes the kernel fills.
    let rc = unsafe {
        libc::syscall(libc::SYS_bpf, BPF_OBJ_GET_INFO_BY_FD, &mut attr as *mut InfoAttr, std::mem::size_of::<InfoAttr>())
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // struct bpf_map_info: type, id, key_size, value_size, max_entries, ...
    let word = |at: usize| u32::from_ne_bytes(info[at..at + 4].try_into().expect("4 bytes"));
    Ok(BpfMapInfo { value_size: word(12), max_entries: word(16) })
}

/// Freezes the BPF map behind `fd` for user space: no update through the
/// syscall and no writable mapping from now on, by anyone (the programs
/// still write it). Fails while a writable mapping exists.
pub fn bpf_map_freeze(fd: RawFd) -> io::Result<()> {
    #[repr(C)]
    struct FreezeAttr {
        map_fd: u32,
    }
    const BPF_MAP_FREEZE: libc::c_long = 22;
    let attr = FreezeAttr { map_fd: fd as u32 };
    // SAFETY: attr is a valid bpf_attr prefix for this command.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_FREEZE, &attr as *const FreezeAttr, std::mem::size_of::<FreezeAttr>()) };
    if rc != 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// Waits while the shared word at `word` still holds `expected`, at most
/// `timeout`. Returns early when woken, when the value differs already, or
/// on a signal; the caller re-checks its condition either way.
pub fn futex_wait(word: &std::sync::atomic::AtomicU32, expected: u32, timeout: std::time::Duration) {
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
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
        libc::syscall(SYS_FUTEX_WAITV, v.as_ptr(), v.len() as libc::c_uint, 0, &ts as *const libc::timespec, libc::CLOCK_MONOTONIC)
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

/// Sends `data` on a unix stream socket with `fds` attached (SCM_RIGHTS).
pub fn send_with_fds(sock: RawFd, data: &[u8], fds: &[RawFd]) -> io::Result<usize> {
    let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut _, iov_len: data.len() };
    let fd_bytes = std::mem::size_of_val(fds) as u32;
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
    let mut cbuf = vec![0u8; space.max(1)];
    // SAFETY: zeroed msghdr is a valid starting value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: msg_control points at a buffer of CMSG_SPACE(fd_bytes)
        // bytes, so the first header and its data fit.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(cmsg).cast(), fds.len());
        }
    }
    // SAFETY: msg points at valid buffers for the duration of the call.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
}

/// Receives into `buf` from a unix stream socket, collecting up to `max_fds`
/// descriptors passed with SCM_RIGHTS.
pub fn recv_with_fds(sock: RawFd, buf: &mut [u8], max_fds: usize) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let fd_bytes = (max_fds * std::mem::size_of::<RawFd>()) as u32;
    // SAFETY: pure computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
    let mut cbuf = vec![0u8; space];
    // SAFETY: zeroed msghdr is a valid starting value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg points at valid buffers for the duration of the call.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into cbuf.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg) as *const RawFd;
                let count = ((*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok((n as usize, fds))
}

/// Credentials of the peer of a unix socket: (pid, uid, gid).
pub fn peer_cred(sock: RawFd) -> io::Result<(u32, u32, u32)> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred/len are valid out-pointers of the right size.
    let rc = unsafe {
        libc::getsockopt(sock, libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len)
    };
    if rc != 0 { Err(io::Error::last_os_error()) } else { Ok((cred.pid as u32, cred.uid, cred.gid)) }
}

/// Pid of the peer of a unix socket.
pub fn peer_pid(sock: RawFd) -> io::Result<u32> {
    peer_cred(sock).map(|c| c.0)
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

/// Raises RLIMIT_MEMLOCK for old kernels that charge BPF maps to it.
/// This process's soft RLIMIT_MEMLOCK, bytes (`RLIM_INFINITY` when none).
pub fn memlock_limit() -> io::Result<u64> {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: rl is a valid, writable rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rl.rlim_cur)
}

pub fn raise_memlock() {
    let rl = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: rl is a valid pointer; failure is harmless on new kernels.
    unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &rl) };
}

/// The CPU's time-stamp counter, where it has one (x86_64).
#[inline]
pub fn rdtsc() -> Option<u64> {
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
        // SAFETY: a zeroed cpu_set_t is valid; sched_setaffinity only reads it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            let cpu = libc::sched_getcpu() as usize;
            libc::CPU_SET(cpu, &mut set);
            assert_eq!(libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set), 0);
            for _ in 0..100 {
                assert_eq!(current_cpu(), libc::sched_getcpu() as u32);
            }
            if let Some(c) = rseq::cpu_id() {
                assert_eq!(c as usize, cpu);
            }
        }
    }

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

    #[test]
    fn memfd_maps_zeroed_and_shared() {
        let fd = memfd("t", 8192).unwrap();
        let a = Mapping::map(fd.as_raw_fd(), 8192).unwrap();
        let b = Mapping::map(fd.as_raw_fd(), 8192).unwrap();
        // SAFETY: both mappings are 8192 bytes of the same memfd.
        unsafe {
            assert_eq!(*a.as_ptr().add(100), 0);
            *a.as_ptr().add(100) = 7;
            assert_eq!(*b.as_ptr().add(100), 7);
        }
    }
}
