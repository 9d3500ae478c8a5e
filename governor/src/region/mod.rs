//! Typed views of the shared regions, mmapped from the agent's map and memfd
//! descriptors.
//!
//! # Layout
//!
//! - [`Table`]: one mmapped array of a shared-cell type, length-checked
//!   against its descriptor before it is mapped.
//! - `measure`: the measurement views (per-CPU anchors, thread slots,
//!   keyspace CPU totals) and the charge step.
//! - `admission`: the admission views (header, token buckets, parameters
//!   and directory, ticket ledgers).
//! - `owned`: the memfd regions the agent creates and seals.
//! - [`MeasureRegions`], [`AdmissionRegions`]: the regions one process maps,
//!   from the descriptors the agent hands out at `hello` ([`fd`] order).
//!
//! The memory is written concurrently by the kernel, the agent and every
//! client, so it is only ever accessed through atomics: each layout of
//! `governor-common` has an atomic mirror here with the same size and field
//! offsets (checked at compile time). Only those mirrors can be mapped: they
//! implement the sealed [`SharedCell`] trait, whose contract is that every
//! bit pattern is a valid value.
#![allow(unsafe_code)]

mod admission;
mod measure;
mod owned;

pub use admission::{AgentView, BucketView, ClockView, Directory, HeaderView, KnobsView, ParamsView, TicketView};
pub use measure::{CpuView, KeyspaceView, SlotView, WaitView};
pub use owned::{AdmissionMemory, LedgerMemory};

use crate::sys::Mapping;
use std::mem::size_of;
use std::os::fd::RawFd;

/// Errors of the region views.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// mmap of a region failed.
    #[error("mapping the {what} region ({len} bytes) failed")]
    Map {
        /// The region.
        what: &'static str,
        /// Its length.
        len: usize,
        /// mmap's error.
        #[source]
        source: std::io::Error,
    },
    /// A descriptor backs less memory than its region needs.
    #[error("the {what} descriptor backs {have} bytes, fewer than the {want} its region needs")]
    TooShort {
        /// The region.
        what: &'static str,
        /// Bytes the descriptor backs.
        have: usize,
        /// Bytes the region needs.
        want: usize,
    },
    /// No free cell for a new keyspace.
    #[error("the keyspace table is full ({capacity} cells); raise agent.max-keyspaces")]
    KeyspaceTableFull {
        /// Cells in the table.
        capacity: u32,
    },
    /// The agent sent a table whose length is not a power of two.
    #[error("the keyspace table length {len} is not a power of two")]
    BadTableLength {
        /// The length sent.
        len: u32,
    },
}

mod sealed {
    pub trait Sealed {}
}

/// A type that may live in a shared region.
///
/// # Safety
/// Implementors are `#[repr(C)]`, made only of atomics and plain integers,
/// so any bit pattern another process writes is a valid value and every
/// access is a data-race-free atomic one. Sealed: only this module's views
/// implement it.
pub unsafe trait SharedCell: sealed::Sealed + Sync {}

macro_rules! shared_cell {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        // SAFETY: the views are repr(C) mirrors made only of atomics and
        // padding integers (checked against their layouts at compile time).
        unsafe impl SharedCell for $t {}
    )*};
}
shared_cell!(CpuView, SlotView, KeyspaceView, WaitView, HeaderView, BucketView, ParamsView, TicketView);
// The tid table: one u32 per tid.
impl sealed::Sealed for std::sync::atomic::AtomicU32 {}
// SAFETY: an AtomicU32 is valid for every bit pattern.
unsafe impl SharedCell for std::sync::atomic::AtomicU32 {}

/// Whether a process may write a region it maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    ReadWrite,
    ReadOnly,
}

/// One mmapped array of `T`.
pub struct Table<T: SharedCell> {
    map: Mapping,
    len: u32,
    _t: std::marker::PhantomData<T>,
}

impl<T: SharedCell> Table<T> {
    /// Maps `len` entries of `T` from `fd`, read-write, after checking the
    /// descriptor backs that many.
    pub fn map(what: &'static str, fd: RawFd, len: u32) -> Result<Self, RegionError> {
        Self::map_with(what, fd, len, Access::ReadWrite)
    }

    /// Maps `len` entries of `T` from `fd` with the given access.
    pub fn map_with(what: &'static str, fd: RawFd, len: u32, access: Access) -> Result<Self, RegionError> {
        let bytes = len as usize * size_of::<T>();
        let have = crate::sys::region_len(fd).map_err(|source| RegionError::Map { what, len: bytes, source })?;
        if have < bytes {
            return Err(RegionError::TooShort { what, have, want: bytes });
        }
        let map = match access {
            Access::ReadWrite => Mapping::map(fd, bytes),
            Access::ReadOnly => Mapping::map_readonly(fd, bytes),
        }
        .map_err(|source| RegionError::Map { what, len: bytes, source })?;
        Ok(Table { map, len, _t: std::marker::PhantomData })
    }

    /// `len` zeroed entries in a fresh memfd, for unit tests that run the
    /// protocols on plain memory.
    #[cfg(test)]
    pub(crate) fn zeroed(len: u32) -> Self {
        let fd = crate::sys::memfd("test", (len as usize * size_of::<T>()).max(1)).expect("memfd");
        Self::map("test", std::os::fd::AsRawFd::as_raw_fd(&fd), len).expect("mapping")
    }

    pub fn len(&self) -> u32 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Gives the table's pages back ([`Mapping::retire`]): every entry
    /// reads zero from now on.
    pub fn retire(&self) -> std::io::Result<()> {
        self.map.retire()
    }

    /// Entry `i`, or `None` past the end.
    #[inline]
    pub fn get(&self, i: u32) -> Option<&T> {
        if i < self.len {
            // SAFETY: i is in bounds of a mapping of len * size_of::<T>()
            // bytes, page-aligned so T's alignment holds; T: SharedCell is
            // valid for every bit pattern and accessed only atomically.
            Some(unsafe { &*(self.map.as_ptr() as *const T).add(i as usize) })
        } else {
            None
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        (0..self.len).filter_map(move |i| self.get(i).map(|v| (i, v)))
    }
}

/// Sizes of the regions, sent with their descriptors.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct RegionSizes {
    /// Per-CPU records (the CPUs the agent found).
    pub cpus: u32,
    /// Thread slots: threads that can be registered at once.
    pub slots: u32,
    /// Keyspace cells; the bucket and parameter regions hold one more
    /// entry (the global one, at index 0).
    pub keyspaces: u32,
    /// Ticket records in each client's ledger.
    pub ledger: u32,
}

/// Positions of the region descriptors in `hello`'s SCM_RIGHTS message.
pub mod fd {
    pub const CPUS: usize = 0;
    pub const SLOTS: usize = 1;
    pub const KEYSPACES: usize = 2;
    pub const HEADER: usize = 3;
    pub const BUCKETS: usize = 4;
    pub const PARAMS: usize = 5;
    /// The client's own ticket ledger.
    pub const LEDGER: usize = 6;
    pub const COUNT: usize = 7;
}

/// Index of the node's global bucket in the bucket and parameter regions.
pub const GLOBAL: u32 = 0;
/// Index of the low-priority DAG bucket.
pub const LOW_PRIORITY: u32 = 1;
/// Index of the overflow bucket: what holds a keyspace that has no cell
/// (the table is full, or its server's uid holds its quota of cells) to the
/// tenant limits, shared by every such keyspace.
pub const OVERFLOW: u32 = 2;
/// Index of keyspace cell 0; keyspace cell `c` is at `c + FIRST_KEYSPACE`.
pub const FIRST_KEYSPACE: u32 = 3;

/// A keyspace's cell in the shared table as a request found it: its index
/// and the generation it had then (a cell evicted and given to another
/// keyspace since has moved on, and is not this request's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CellRef {
    pub index: u32,
    pub generation: u64,
}

/// The admission regions' layout (bucket indices, cell layouts): a client
/// attaches only to an agent that publishes the same. Raised with every
/// change a client of another build would misread.
pub const ADMISSION_LAYOUT: u32 = 5;

/// The measurement regions: per-CPU anchors, thread slots, keyspace CPU
/// totals (BPF maps, or memfds in the fallback backend).
pub struct MeasureRegions {
    pub cpus: Table<CpuView>,
    pub slots: Table<SlotView>,
    pub keyspaces: Table<KeyspaceView>,
}

impl MeasureRegions {
    /// Gives every table's pages back ([`Table::retire`]).
    pub fn retire(&self) -> std::io::Result<()> {
        self.cpus.retire()?;
        self.slots.retire()?;
        self.keyspaces.retire()
    }

    /// Maps them from their descriptors (`fd::CPUS..=fd::KEYSPACES`).
    pub fn map(fds: &[RawFd], sizes: RegionSizes, access_cpus: Access) -> Result<Self, RegionError> {
        Ok(MeasureRegions {
            cpus: Table::map_with("cpu", fds[fd::CPUS], sizes.cpus, access_cpus)?,
            slots: Table::map("thread slot", fds[fd::SLOTS], sizes.slots)?,
            keyspaces: Table::map("keyspace", fds[fd::KEYSPACES], sizes.keyspaces)?,
        })
    }
}

/// The admission regions: the agent's header, the token buckets, the
/// parameters and directory. The agent owns them; a client maps the header
/// and parameters read-only.
pub struct AdmissionRegions {
    pub header: Table<HeaderView>,
    /// [`GLOBAL`], [`LOW_PRIORITY`], [`OVERFLOW`], then keyspace cells from
    /// [`FIRST_KEYSPACE`].
    pub buckets: Table<BucketView>,
    /// Indexed as `buckets`; written by the agent only.
    pub params: Table<ParamsView>,
}

impl AdmissionRegions {
    /// Gives every table's pages back ([`Table::retire`]).
    pub fn retire(&self) -> std::io::Result<()> {
        self.header.retire()?;
        self.buckets.retire()?;
        self.params.retire()
    }

    /// Maps them from their descriptors (`fd::HEADER..=fd::PARAMS`); `agent`
    /// maps everything writable, a client the header and parameters
    /// read-only.
    pub fn map(fds: &[RawFd], keyspaces: u32, agent: bool) -> Result<Self, RegionError> {
        let ro = if agent { Access::ReadWrite } else { Access::ReadOnly };
        if keyspaces == 0 || !keyspaces.is_power_of_two() {
            return Err(RegionError::BadTableLength { len: keyspaces });
        }
        let n = keyspaces + FIRST_KEYSPACE;
        Ok(AdmissionRegions {
            header: Table::map_with("header", fds[fd::HEADER], 1, ro)?,
            buckets: Table::map("bucket", fds[fd::BUCKETS], n)?,
            params: Table::map_with("parameter", fds[fd::PARAMS], n, ro)?,
        })
    }

    /// The agent's header.
    #[inline]
    pub fn header(&self) -> &HeaderView {
        self.header.get(0).expect("the header region has one entry")
    }

    /// The keyspace directory over the parameter region.
    #[inline]
    pub fn directory(&self) -> Directory<'_> {
        Directory::new(&self.params)
    }

    /// Bucket `i` ([`GLOBAL`], [`LOW_PRIORITY`], [`OVERFLOW`] or a keyspace's).
    #[inline]
    pub fn bucket(&self, i: u32) -> &BucketView {
        self.buckets.get(i).unwrap_or_else(|| self.buckets.get(GLOBAL).expect("the global bucket"))
    }

    /// Bucket `i`, if there is one (an index read from a client's memory).
    #[inline]
    pub fn bucket_at(&self, i: u32) -> Option<&BucketView> {
        self.buckets.get(i)
    }

    /// Keyspace cell `c`'s bucket and parameters.
    #[inline]
    pub fn keyspace_cell(&self, c: u32) -> Option<(&BucketView, &ParamsView)> {
        let i = c.checked_add(FIRST_KEYSPACE)?;
        Some((self.buckets.get(i)?, self.params.get(i)?))
    }

    /// The tenant bucket a request of `cell` is held by, with its index: the
    /// keyspace's own while `cell` (and its generation) is current; the
    /// overflow bucket for a keyspace without a cell. `None` for a cell given
    /// to another keyspace since it was looked up: a grant of it settles
    /// into nothing.
    #[inline]
    pub fn tenant_bucket(&self, cell: Option<CellRef>) -> Option<(u32, &BucketView, &ParamsView)> {
        match cell {
            None => Some((OVERFLOW, self.buckets.get(OVERFLOW)?, self.params.get(OVERFLOW)?)),
            Some(CellRef { index: c, generation }) => {
                let (b, p) = self.keyspace_cell(c)?;
                (p.generation.load(std::sync::atomic::Ordering::Acquire) == generation).then_some((
                    c + FIRST_KEYSPACE,
                    b,
                    p,
                ))
            }
        }
    }

    /// The bucket a request of `cell` counts into (waits, top-ups): its
    /// keyspace's, the overflow bucket without a cell, the global one for a
    /// cell gone since.
    #[inline]
    pub fn counted_on(&self, cell: Option<u32>) -> &BucketView {
        match cell {
            None => self.bucket(OVERFLOW),
            Some(c) => self.keyspace_cell(c).map_or(self.bucket(GLOBAL), |x| x.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_descriptor_shorter_than_the_region_is_refused_before_mapping() {
        let fd = crate::sys::memfd("short", 64 * 3).unwrap();
        let r = Table::<BucketView>::map("bucket", fd.as_raw_fd(), 2);
        let want = 2 * size_of::<BucketView>();
        assert!(matches!(r, Err(RegionError::TooShort { have: 192, want: w, .. }) if w == want), "{:?}", r.err());
        assert!(Table::<ParamsView>::map("parameter", fd.as_raw_fd(), 3).is_ok());
    }

    #[test]
    fn a_sealed_read_only_region_cannot_be_mapped_writable_or_resized() {
        let fd = crate::sys::memfd("ro", 4096).unwrap();
        let mine = Table::<ParamsView>::map("parameter", fd.as_raw_fd(), 64).unwrap();
        crate::sys::seal(fd.as_raw_fd(), true).unwrap();
        // The mapping made before the seal still writes.
        mine.get(1).unwrap().capacity_us.store(7, std::sync::atomic::Ordering::Relaxed);
        assert!(Table::<ParamsView>::map("parameter", fd.as_raw_fd(), 64).is_err(), "writable map after seal");
        let theirs = Table::<ParamsView>::map_with("parameter", fd.as_raw_fd(), 64, Access::ReadOnly).unwrap();
        assert_eq!(theirs.get(1).unwrap().capacity_us.load(std::sync::atomic::Ordering::Relaxed), 7);
        // SAFETY: ftruncate on a descriptor we own.
        let rc = unsafe { libc::ftruncate(fd.as_raw_fd(), 0) };
        assert_eq!(rc, -1);
        assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EPERM));
    }
}
