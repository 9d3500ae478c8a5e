//! Regions the agent creates itself (memfds), mapped writable for it and
//! sealed before any client sees them.

use super::{Access, AdmissionRegions, FIRST_KEYSPACE, RegionError, Table, TicketView, fd};
use crate::sys;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

fn create(what: &'static str, bytes: usize) -> Result<OwnedFd, RegionError> {
    sys::memfd(what, bytes).map_err(|source| RegionError::Map { what, len: bytes, source })
}

fn seal(what: &'static str, fd: &OwnedFd, read_only: bool) -> Result<(), RegionError> {
    sys::seal(fd.as_raw_fd(), read_only).map_err(|source| RegionError::Map { what, len: 0, source })
}

/// The admission regions with the descriptors behind them.
pub struct AdmissionMemory {
    fds: [OwnedFd; 3],
    pub regions: AdmissionRegions,
}

impl AdmissionMemory {
    /// Zeroed regions for `keyspaces` cells (a power of two). The header and
    /// parameters are sealed read-only for everyone else, the buckets
    /// against resizing.
    pub fn create(keyspaces: u32) -> Result<AdmissionMemory, RegionError> {
        let n = keyspaces as usize + FIRST_KEYSPACE as usize;
        let fds = [
            create("governor-header", std::mem::size_of::<super::HeaderView>())?,
            create("governor-buckets", n * std::mem::size_of::<super::BucketView>())?,
            create("governor-params", n * std::mem::size_of::<super::ParamsView>())?,
        ];
        let mut raw = [0; fd::COUNT];
        raw[fd::HEADER] = fds[0].as_raw_fd();
        raw[fd::BUCKETS] = fds[1].as_raw_fd();
        raw[fd::PARAMS] = fds[2].as_raw_fd();
        let regions = AdmissionRegions::map(&raw, keyspaces, true)?;
        seal("header", &fds[0], true)?;
        seal("bucket", &fds[1], false)?;
        seal("parameter", &fds[2], true)?;
        Ok(AdmissionMemory { fds, regions })
    }

    /// (header, buckets, parameters) descriptors, to hand to clients.
    pub fn raw_fds(&self) -> [RawFd; 3] {
        [self.fds[0].as_raw_fd(), self.fds[1].as_raw_fd(), self.fds[2].as_raw_fd()]
    }
}

/// One client's ticket ledger, as the agent keeps it.
pub struct LedgerMemory {
    fd: OwnedFd,
    pub records: Table<TicketView>,
}

impl LedgerMemory {
    pub fn create(len: u32) -> Result<LedgerMemory, RegionError> {
        let fd = create("governor-ledger", len as usize * std::mem::size_of::<TicketView>())?;
        let records = Table::map_with("ledger", fd.as_raw_fd(), len, Access::ReadWrite)?;
        seal("ledger", &fd, false)?;
        Ok(LedgerMemory { fd, records })
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}
