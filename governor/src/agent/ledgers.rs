//! Each client connection's ticket ledger (a memfd the client writes and
//! the agent reads), and what the agent gives back from it when the client
//! goes: tokens, write bytes and in-flight counts of every ticket it held.
//!
//! A record is only a client's claim. What it returns is bounded the way
//! every release is: tokens never above a bucket's capacity, debt never below
//! its bound, counts never below zero; a record that names a cell now held by
//! another keyspace (a different generation) returns nothing to it.

use crate::policy::{self, Grant, Policy};
use crate::region::{CellRef, LedgerMemory, RegionError};
use keyspace_governor_common::admission::{
    LEDGER_LEN, T_ASLEEP_MASK, T_COUNTED, T_SPARE, TICKET_FREE, TICKET_HELD, asleep_of, counter,
};
use std::collections::HashMap;
use std::sync::atomic::Ordering;

#[derive(Default)]
pub(crate) struct Ledgers {
    by_conn: HashMap<u64, LedgerMemory>,
}

/// What one reclaim returned.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reclaimed {
    pub tickets: u64,
    pub write_bytes: u64,
    pub requests: u64,
    /// Threads' spare tokens returned, µs.
    pub spare_us: u64,
    /// Sleepers taken back off buckets' counts (threads that died asleep).
    pub asleep: u64,
}

impl Ledgers {
    /// A fresh ledger for connection `conn`; its descriptor for `hello`.
    pub(crate) fn open(&mut self, conn: u64) -> Result<i32, RegionError> {
        let l = LedgerMemory::create(LEDGER_LEN)?;
        let fd = l.raw_fd();
        self.by_conn.insert(conn, l);
        Ok(fd)
    }

    /// Returns everything connection `conn`'s tickets held, and forgets the
    /// ledger.
    pub(crate) fn reclaim(&mut self, conn: u64, policy: &Policy) -> Reclaimed {
        let Some(l) = self.by_conn.remove(&conn) else { return Reclaimed::default() };
        let r = policy.regions();
        let mut out = Reclaimed::default();
        for (_, rec) in l.records.iter() {
            let state = rec.state.load(Ordering::Acquire);
            if state == TICKET_FREE {
                continue;
            }
            // A thread that died asleep in line (waiting for admission or a
            // top-up, or the process's waiter thread for its futures) left
            // its counts on the bucket: they would keep every later move
            // waking, its spare tokens off and its cell from going idle.
            if let Some((bucket, n, unslotted)) = asleep_of(rec.flags.load(Ordering::Relaxed)) {
                if let Some(b) = r.bucket_at(bucket) {
                    b.take_back_asleep(n, unslotted);
                    out.asleep += n;
                }
                rec.flags.fetch_and(!T_ASLEEP_MASK, Ordering::Relaxed);
            }
            if state != TICKET_HELD {
                continue;
            }
            let cell = rec.cell.load(Ordering::Relaxed);
            let cell =
                cell.checked_sub(1).map(|index| CellRef { index, generation: rec.generation.load(Ordering::Relaxed) });
            if rec.flags.load(Ordering::Relaxed) & T_SPARE != 0 {
                // A thread's spare tokens: no ticket, only tokens to return.
                // A thread never keeps more than `SPARE_MAX_US`: a record
                // that says more is garbage, and returns no more than that.
                let us = rec
                    .tenant_us
                    .load(Ordering::Relaxed)
                    .min(rec.global_us.load(Ordering::Relaxed))
                    .min(policy::SPARE_MAX_US);
                policy::return_spare(r, cell, us);
                rec.state.store(TICKET_FREE, Ordering::Release);
                out.spare_us += us;
                continue;
            }
            let g = Grant {
                tenant_us: rec.tenant_us.load(Ordering::Relaxed),
                global_us: rec.global_us.load(Ordering::Relaxed),
                burst_us: rec.burst_us.load(Ordering::Relaxed),
                write_bytes: rec.write_bytes.load(Ordering::Relaxed),
                counted: rec.flags.load(Ordering::Relaxed) & T_COUNTED != 0,
                skipped: false,
                ..Grant::unchecked(0, cell)
            };
            // What the dead client's work consumed (as last recorded) is
            // settled like any release; the rest goes back.
            let consumed_us = rec.consumed_ns.load(Ordering::Relaxed) / 1000;
            policy::release(r, &g, consumed_us.min(g.global_us.max(g.tenant_us)));
            let b = r.counted_on(g.cell());
            b.count(counter::RECLAIMED, 1);
            rec.state.store(TICKET_FREE, Ordering::Release);
            out.tickets += 1;
            out.write_bytes += g.write_bytes;
            out.requests += g.counted as u64;
        }
        out
    }
}
