//! Shared memory: mappings, memfds and their seals, BPF map descriptors,
//! the locked-memory limit.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

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

    /// Gives the mapped pages back: the range is replaced, in one step, by
    /// private zero-filled memory, so the descriptor's pages are freed once
    /// nobody else maps them, while a pointer still held into the range
    /// reads zeros and writes into memory nobody shares instead of faulting.
    pub fn retire(&self) -> io::Result<()> {
        // SAFETY: MAP_FIXED over exactly the range this mapping owns (from
        // a successful mmap, unmapped only on drop): the kernel swaps the
        // pages under its mapping lock, so no access sees the range unmapped.
        let ptr = unsafe {
            libc::mmap(
                self.ptr.cast(),
                self.len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(())
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
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET_INFO_BY_FD,
            &mut attr as *mut InfoAttr,
            std::mem::size_of::<InfoAttr>(),
        )
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
    let rc = unsafe {
        libc::syscall(libc::SYS_bpf, BPF_MAP_FREEZE, &attr as *const FreezeAttr, std::mem::size_of::<FreezeAttr>())
    };
    if rc != 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// A descriptor of its own for the BPF map behind `fd` (close-on-exec):
/// it keeps the map open for as long as it lives.
pub fn bpf_map_dup(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC reads no memory; the new descriptor is ours.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if new < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `new` was just opened and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

/// An eventfd to end a [`ring_buffer_wait`] early ([`wake`]).
pub fn wake_fd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd takes no pointer; the new descriptor is ours.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Ends the [`ring_buffer_wait`] on `wake` (now, or the next one).
pub fn wake(wake: &OwnedFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: 8 readable bytes, as an eventfd takes them.
    let _ = unsafe { libc::write(wake.as_raw_fd(), one.as_ptr().cast(), one.len()) };
}

/// Waits until the ring buffer map behind `fd` has records to read, `wake`
/// was woken, or `timeout` passes (true: records are in). A signal ends the
/// wait early.
pub fn ring_buffer_wait(fd: &OwnedFd, wake: &OwnedFd, timeout: std::time::Duration) -> bool {
    let mut p = [
        libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
    ];
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    // SAFETY: two valid pollfds, for the length given.
    let rc = unsafe { libc::poll(p.as_mut_ptr(), 2, ms) };
    rc > 0 && p[0].revents & libc::POLLIN != 0
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

#[cfg(test)]
mod tests {
    use super::*;

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
