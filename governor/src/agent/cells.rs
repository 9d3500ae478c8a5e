//! Who gets a keyspace cell: each uid's quota of cells
//! (`agent.max-keyspaces-per-uid`, root has none), the table's room, and the
//! record of keyspaces that got none. A keyspace without a cell is not let
//! through: its requests are held by the overflow bucket to the tenant
//! limits (`crate::region::OVERFLOW`); this keeps what an operator needs to
//! see of that (how many, which, since when) and warns once per keyspace.

use crate::policy::Policy;
use crate::region::{CellRef, RegionError};
use keyspace_governor_common::admission::DIR_LIVE;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// A keyspace refused a cell within this long counts as in the overflow.
pub(crate) const OVERFLOW_RECENT: Duration = Duration::from_secs(60);
/// At most this many keyspaces are remembered as overflowed (the oldest go).
const OVERFLOW_REMEMBERED: usize = 4096;

/// Why a keyspace got no cell.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CellRefusal {
    #[error(
        "uid {uid} already has {held} keyspace cells in use (agent.max-keyspaces-per-uid); keyspace {keyspace} \
         gets none until some go idle, and its requests are held by the overflow bucket meanwhile"
    )]
    UidQuota { uid: u32, held: usize, keyspace: u32 },
    #[error("{source}; keyspace {keyspace}'s requests are held by the overflow bucket meanwhile")]
    Table { keyspace: u32, source: RegionError },
}

#[derive(Debug, Default)]
pub(crate) struct CellGrants {
    /// Who asked for each cell given out: (uid, the cell's generation then).
    owners: HashMap<u32, (u32, u64)>,
    /// Keyspaces that got no cell: when they last asked, and the uid whose
    /// quota of cells refused it (`None`: the table had no room).
    overflowed: BTreeMap<u32, (Instant, Option<u32>)>,
    refused_total: u64,
}

/// What status and metrics show of the overflow.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct OverflowView {
    /// Keyspaces refused a cell in the last [`OVERFLOW_RECENT`], ascending.
    pub recent: Vec<u32>,
    /// Those of them refused last by their uid's quota
    /// (`agent.max-keyspaces-per-uid`), not by the table's room.
    pub by_uid_quota: Vec<u32>,
    /// Cell requests refused since start.
    pub refused_total: u64,
}

impl CellGrants {
    /// The cell of keyspace `id` for a client of `uid`, given one if it has
    /// none and the uid is within `per_uid` cells (root has no quota).
    /// Returns (cell, generation, new).
    pub(crate) fn cell_for(
        &mut self,
        policy: &Policy,
        id: u32,
        uid: u32,
        per_uid: u32,
        now_us: u64,
    ) -> Result<(u32, u64, bool), CellRefusal> {
        let r = policy.regions();
        if let Some(CellRef { index: cell, generation }) = r.directory().find(id) {
            return Ok((cell, generation, false));
        }
        if uid != 0 {
            // Cells evicted (or given to another keyspace) since count no more.
            self.owners.retain(|&cell, &mut (_, generation)| {
                r.keyspace_cell(cell)
                    .is_some_and(|(_, p)| p.generation.load(Ordering::Acquire) == generation && p.entry().0 == DIR_LIVE)
            });
            let held = self.owners.values().filter(|(u, _)| *u == uid).count();
            if held >= per_uid as usize {
                return Err(self.refused(CellRefusal::UidQuota { uid, held, keyspace: id }, id, Some(uid)));
            }
        }
        match policy.ensure_keyspace(id, now_us) {
            Ok(CellRef { index: cell, generation }) => {
                self.owners.insert(cell, (uid, generation));
                if self.overflowed.remove(&id).is_some() {
                    log::info!("keyspace {id} has a cell now; it leaves the overflow bucket");
                }
                Ok((cell, generation, true))
            }
            Err(source) => Err(self.refused(CellRefusal::Table { keyspace: id, source }, id, None)),
        }
    }

    /// Records a refusal; the first for a keyspace (or the first after it
    /// was forgotten) is a warning in the log.
    fn refused(&mut self, why: CellRefusal, id: u32, uid_quota: Option<u32>) -> CellRefusal {
        self.refused_total += 1;
        let now = Instant::now();
        if self.overflowed.insert(id, (now, uid_quota)).is_none() {
            log::warn!("{why}");
            if self.overflowed.len() > OVERFLOW_REMEMBERED
                && let Some(oldest) = self.overflowed.iter().min_by_key(|(_, (at, _))| *at).map(|(k, _)| *k)
            {
                self.overflowed.remove(&oldest);
            }
        }
        why
    }

    pub(crate) fn overflow(&self) -> OverflowView {
        let recent = || self.overflowed.iter().filter(|(_, (at, _))| at.elapsed() < OVERFLOW_RECENT);
        OverflowView {
            recent: recent().map(|(k, _)| *k).collect(),
            by_uid_quota: recent().filter(|(_, (_, uid))| uid.is_some()).map(|(k, _)| *k).collect(),
            refused_total: self.refused_total,
        }
    }
}
