//! Typed views of the shared regions: the per-CPU table, the thread slots
//! and the keyspace table, mmapped from the agent's map (or memfd) fds.
//!
//! The memory is written concurrently by the kernel, the agent and every
//! client, so it is only ever accessed through atomics: each layout of
//! `governor-common` has an atomic mirror here with the same size and field
//! offsets (checked at compile time).
#![allow(unsafe_code)]

use crate::sys::Mapping;
use governor_common::{cell_of_tag, probe_start, CpuCell, HeaderCell, KeyspaceCell, ThreadSlot, KS_EMPTY, KS_LIVE};
use std::mem::{offset_of, size_of};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Errors of the region views.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    #[error("mapping the {what} region ({len} bytes) failed")]
    Map { what: &'static str, len: usize, #[source] source: std::io::Error },
    #[error("the keyspace table is full ({capacity} cells); raise agent.max-keyspaces")]
    KeyspaceTableFull { capacity: u32 },
    #[error("the keyspace table length {len} is not a power of two")]
    BadTableLength { len: u32 },
}

/// Atomic mirror of [`CpuCell`].
#[repr(C)]
pub struct CpuView {
    pub seq: AtomicU64,
    pub last_switch_ns: AtomicU64,
    pub owner: AtomicU64,
    pub base_ns: AtomicU64,
    pub mono_offset_ns: AtomicU64,
    pub resample: AtomicU64,
    pub offset_valid: AtomicU64,
    _pad: [u64; 1],
}

/// Atomic mirror of [`ThreadSlot`].
#[repr(C)]
pub struct SlotView {
    pub oncpu_ns: AtomicU64,
    pub charged_ns: AtomicU64,
    pub tag: AtomicU64,
    pub generation: AtomicU64,
    pub tid: AtomicU32,
    pub state: AtomicU32,
    pub tgid: AtomicU32,
    _pad0: u32,
    pub self_charged_ns: AtomicU64,
    _pad: [u64; 1],
}

/// Atomic mirror of [`KeyspaceCell`]. `keyspace_id` and `state` are one
/// aligned little-endian u64 (`key`), so a single CAS publishes a cell
/// whole: no reader ever waits on a half-inserted cell, and an inserter that
/// dies leaves nothing behind.
#[repr(C)]
pub struct KeyspaceView {
    pub cpu_ns: AtomicU64,
    key: AtomicU64,
    _pad: [u64; 6],
}

#[inline]
const fn live_key(keyspace_id: u32) -> u64 {
    keyspace_id as u64 | (KS_LIVE as u64) << 32
}

impl KeyspaceView {
    /// (state, keyspace id).
    #[inline]
    pub fn load(&self) -> (u32, u32) {
        let k = self.key.load(Ordering::Acquire);
        ((k >> 32) as u32, k as u32)
    }
}

/// Atomic mirror of [`HeaderCell`].
#[repr(C)]
pub struct HeaderView {
    pub clock_seq: AtomicU64,
    pub tsc_base: AtomicU64,
    pub ns_base: AtomicU64,
    pub mult: AtomicU64,
    pub clock_valid: AtomicU64,
    _pad: [u64; 3],
}

macro_rules! same_layout {
    ($view:ty, $cell:ty, $($f:ident),*) => {
        const _: () = assert!(size_of::<$view>() == size_of::<$cell>());
        $(const _: () = assert!(offset_of!($view, $f) == offset_of!($cell, $f));)*
    };
}
same_layout!(CpuView, CpuCell, seq, last_switch_ns, owner, base_ns, mono_offset_ns, resample, offset_valid);
same_layout!(SlotView, ThreadSlot, oncpu_ns, charged_ns, tag, generation, tid, state, tgid, self_charged_ns);
same_layout!(KeyspaceView, KeyspaceCell, cpu_ns);
const _: () = assert!(offset_of!(KeyspaceView, key) == offset_of!(KeyspaceCell, keyspace_id));
const _: () = assert!(offset_of!(KeyspaceCell, state) == offset_of!(KeyspaceCell, keyspace_id) + 4);
#[cfg(target_endian = "big")]
compile_error!("the keyspace cell's id/state word assumes little-endian");
same_layout!(HeaderView, HeaderCell, clock_seq, tsc_base, ns_base, mult, clock_valid);

/// One mmapped array of `T`.
pub struct Table<T> {
    map: Mapping,
    len: u32,
    _t: std::marker::PhantomData<T>,
}

impl<T> Table<T> {
    /// Maps `len` entries of `T` from `fd`.
    pub fn map(what: &'static str, fd: RawFd, len: u32) -> Result<Self, RegionError> {
        let bytes = len as usize * size_of::<T>();
        let map = Mapping::map(fd, bytes).map_err(|source| RegionError::Map { what, len: bytes, source })?;
        Ok(Table { map, len, _t: std::marker::PhantomData })
    }

    pub fn len(&self) -> u32 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Entry `i`, or `None` past the end.
    #[inline]
    pub fn get(&self, i: u32) -> Option<&T> {
        if i < self.len {
            // SAFETY: i is in bounds of a mapping of len * size_of::<T>()
            // bytes, page-aligned so T's alignment holds; T is an atomic
            // mirror for which every bit pattern is valid.
            Some(unsafe { &*(self.map.as_ptr() as *const T).add(i as usize) })
        } else {
            None
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        (0..self.len).filter_map(move |i| self.get(i).map(|v| (i, v)))
    }
}

/// The keyspace table: open addressing on the keyspace id, insert by CAS, so
/// a client can add a keyspace it has never seen without a round trip.
pub struct KeyspaceTable {
    pub cells: Table<KeyspaceView>,
}

impl KeyspaceTable {
    pub fn new(cells: Table<KeyspaceView>) -> Result<Self, RegionError> {
        let len = cells.len();
        if len == 0 || !len.is_power_of_two() {
            return Err(RegionError::BadTableLength { len });
        }
        Ok(KeyspaceTable { cells })
    }

    /// Cell index of `keyspace_id`, if present.
    #[inline]
    pub fn find(&self, keyspace_id: u32) -> Option<u32> {
        let len = self.cells.len();
        let mut i = probe_start(keyspace_id, len);
        for _ in 0..len {
            let cell = self.cells.get(i)?;
            match cell.load() {
                (KS_EMPTY, _) => return None,
                (KS_LIVE, id) if id == keyspace_id => return Some(i),
                _ => {}
            }
            i = (i + 1) & (len - 1);
        }
        None
    }

    /// Cell index of `keyspace_id`, inserting it when absent.
    pub fn find_or_insert(&self, keyspace_id: u32) -> Result<u32, RegionError> {
        let len = self.cells.len();
        let mut i = probe_start(keyspace_id, len);
        let mut probes = 0;
        while probes < len {
            let cell = self.cells.get(i).expect("index masked to the table length");
            match cell.load() {
                (KS_EMPTY, _) => {
                    if cell
                        .key
                        .compare_exchange(0, live_key(keyspace_id), Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        return Ok(i);
                    }
                    // Lost the race for this cell: look at it again.
                    continue;
                }
                (KS_LIVE, id) if id == keyspace_id => return Ok(i),
                _ => {}
            }
            i = (i + 1) & (len - 1);
            probes += 1;
        }
        Err(RegionError::KeyspaceTableFull { capacity: len })
    }

    /// Every live keyspace: (keyspace id, cell index, charged ns).
    pub fn live(&self) -> impl Iterator<Item = (u32, u32, u64)> + '_ {
        self.cells.iter().filter_map(|(i, c)| match c.load() {
            (KS_LIVE, id) => Some((id, i, c.cpu_ns.load(Ordering::Relaxed))),
            _ => None,
        })
    }
}

/// The four regions, as one process sees them.
pub struct Regions {
    pub cpus: Table<CpuView>,
    pub slots: Table<SlotView>,
    pub keyspaces: KeyspaceTable,
    /// One cell, written by the agent only.
    pub header: Table<HeaderView>,
}

/// Sizes of the regions, sent with their fds.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct RegionSizes {
    pub cpus: u32,
    pub slots: u32,
    pub keyspaces: u32,
}

impl Regions {
    /// Maps the regions from their fds (cpus, slots, keyspaces, header).
    pub fn map(fds: [RawFd; 4], sizes: RegionSizes) -> Result<Self, RegionError> {
        Ok(Regions {
            cpus: Table::map("cpu", fds[0], sizes.cpus)?,
            slots: Table::map("thread slot", fds[1], sizes.slots)?,
            keyspaces: KeyspaceTable::new(Table::map("keyspace", fds[2], sizes.keyspaces)?)?,
            header: Table::map("header", fds[3], 1)?,
        })
    }

    /// One attempt at the protocol's charge: move `slot.charged_ns` from
    /// `from` (as the caller read it) to `to` with one CAS and, on success,
    /// add the interval to the keyspace of the slot's tag. `None`: another
    /// party (kernel, thread or agent) moved `charged_ns` first; read again.
    /// `Some(true)` when a keyspace was charged, `Some(false)` when the slot
    /// was untagged. The tag is read before the CAS, so it is the tag the
    /// interval ran under whoever charges.
    #[inline]
    pub fn try_charge(&self, slot: &SlotView, from: u64, to: u64) -> Option<bool> {
        let tag = slot.tag.load(Ordering::Acquire);
        slot.charged_ns.compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire).ok()?;
        let cell = cell_of_tag(tag).and_then(|i| self.keyspaces.cells.get(i));
        if let Some(cell) = cell {
            cell.cpu_ns.fetch_add(to - from, Ordering::Relaxed);
        }
        Some(cell.is_some())
    }

    /// The agent's header cell.
    pub fn header(&self) -> &HeaderView {
        self.header.get(0).expect("the header region has one cell")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn table(len: u32) -> (std::os::fd::OwnedFd, KeyspaceTable) {
        let fd = crate::sys::memfd("ks", len as usize * 64).unwrap();
        let t = KeyspaceTable::new(Table::map("keyspace", fd.as_raw_fd(), len).unwrap()).unwrap();
        (fd, t)
    }

    #[test]
    fn insert_then_find_many_keyspaces() {
        let (_fd, t) = table(256);
        let mut cells = std::collections::HashSet::new();
        for id in 0..200u32 {
            let c = t.find_or_insert(id * 7).unwrap();
            assert!(cells.insert(c), "cell {c} handed out twice");
        }
        for id in 0..200u32 {
            assert!(t.find(id * 7).is_some());
            assert_eq!(t.find(id * 7), Some(t.find_or_insert(id * 7).unwrap()));
        }
        assert_eq!(t.find(3), None);
        assert_eq!(t.live().count(), 200);
    }

    #[test]
    fn full_table_is_a_typed_error() {
        let (_fd, t) = table(8);
        for id in 0..8 {
            t.find_or_insert(id).unwrap();
        }
        assert!(matches!(t.find_or_insert(99), Err(RegionError::KeyspaceTableFull { capacity: 8 })));
    }

    #[test]
    fn concurrent_inserts_agree_on_one_cell_per_keyspace() {
        let (_fd, t) = table(1024);
        let t = &t;
        let results: Vec<Vec<u32>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| s.spawn(move || (0..500u32).map(|id| t.find_or_insert(id).unwrap()).collect()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in &results[1..] {
            assert_eq!(r, &results[0]);
        }
        assert_eq!(t.live().count(), 500);
    }

    #[test]
    fn non_power_of_two_table_is_rejected() {
        let fd = crate::sys::memfd("ks", 3 * 64).unwrap();
        let r = KeyspaceTable::new(Table::map("keyspace", fd.as_raw_fd(), 3).unwrap());
        assert!(matches!(r, Err(RegionError::BadTableLength { len: 3 })));
    }
}
