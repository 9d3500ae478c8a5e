//! The jobs of the client's background thread: the round trips to the
//! agent that no server thread should wait for. (The thread's loop is the
//! client's, in `conn`: it owns the attachments the jobs run on.)
//!
//! - A keyspace the agent has no cell for yet: an async caller (a
//!   [`super::Tagged`] poll, [`super::Client::acquire_async`]) asks here and
//!   returns `Pending`; this thread asks the agent for the cell and wakes it.
//! - A registered thread that finds a new agent in force (the first one, or
//!   one that came back) and no registration made for it there: this thread
//!   registers it by its tid; the thread picks the registration up at its
//!   next tag switch and runs untagged until then.

use super::attachment::Attachment;
use super::error::ClientError;
use crate::proto::{Reply, Request};
use crate::region::CellRef;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Condvar, Mutex};
use std::task::Waker;
use std::time::{Duration, Instant};

/// How long a refused cell (the table full, the uid at its quota) is taken
/// as refused before the agent is asked again.
const REFUSED_FOR: Duration = Duration::from_secs(1);

#[derive(Default)]
struct Jobs {
    /// Keyspaces to ask a cell for, by attachment epoch.
    cells: BTreeSet<(u64, u32)>,
    /// Who waits for which of them.
    waiters: Vec<(u64, u32, Waker)>,
    /// Cells the agent refused, and when.
    refused: HashMap<(u64, u32), Instant>,
    /// Threads to register by tid, by attachment epoch.
    threads: BTreeSet<(u64, u32)>,
    /// Pool rejections reported for keyspaces whose cell was being asked
    /// for: counted once it is in.
    pool_rejections: HashMap<(u64, u32), u64>,
    stop: bool,
}

impl Jobs {
    /// Whether the agent refused `key` a cell less than [`REFUSED_FOR`] ago
    /// (an older refusal is forgotten here).
    fn refused_recently(&mut self, key: (u64, u32)) -> bool {
        match self.refused.get(&key) {
            Some(at) if at.elapsed() < REFUSED_FOR => true,
            Some(_) => {
                self.refused.remove(&key);
                false
            }
            None => false,
        }
    }

    /// Remembers a refusal of `key`; bounded: refusals past their time go
    /// once many are kept (keyspaces that are never asked for again).
    fn remember_refusal(&mut self, key: (u64, u32)) {
        if self.refused.len() >= 4096 {
            self.refused.retain(|_, at| at.elapsed() < REFUSED_FOR);
        }
        self.refused.insert(key, Instant::now());
    }
}

/// What a look-up without a round trip found.
pub(crate) enum Cell {
    Found(CellRef),
    /// Asked for; the waker (if any) is woken when the answer is in.
    Pending,
    /// The agent gave this keyspace no cell (recently).
    Refused,
}

#[derive(Default)]
pub(crate) struct Helper {
    jobs: Mutex<Jobs>,
    wake: Condvar,
}

impl Helper {
    fn jobs(&self) -> std::sync::MutexGuard<'_, Jobs> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cell of `keyspace` in `att`, without a round trip: from the shared
    /// directory, or asked for in the background.
    pub(crate) fn cell(&self, att: &Attachment, keyspace: u32, waker: Option<&Waker>) -> Cell {
        if let Some(c) = att.admission.directory().find(keyspace) {
            return Cell::Found(c);
        }
        let key = (att.epoch, keyspace);
        let mut j = self.jobs();
        if j.refused_recently(key) {
            return Cell::Refused;
        }
        // Asked meanwhile and answered: the directory has it now.
        if let Some(c) = att.admission.directory().find(keyspace) {
            return Cell::Found(c);
        }
        j.cells.insert(key);
        if let Some(w) = waker {
            j.waiters.push((att.epoch, keyspace, w.clone()));
        }
        drop(j);
        self.wake.notify_one();
        Cell::Pending
    }

    /// The cell of `keyspace` for a blocking admission: the directory's, or
    /// the agent's answer (a round trip). `None` when the agent refuses one
    /// (the table full, the uid's quota of cells spent: the overflow bucket
    /// holds the keyspace), remembered for [`REFUSED_FOR`] so that the
    /// requests after it do not ask again (a round trip each otherwise).
    pub(crate) fn cell_now(&self, att: &Attachment, keyspace: u32) -> Result<Option<CellRef>, ClientError> {
        if let Some(c) = att.admission.directory().find(keyspace) {
            return Ok(Some(c));
        }
        let key = (att.epoch, keyspace);
        if self.jobs().refused_recently(key) {
            return Ok(None);
        }
        match att.cell_of(keyspace) {
            Ok(c) => Ok(Some(c)),
            Err(ClientError::Refused { .. }) => {
                self.jobs().remember_refusal(key);
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Counts a pool rejection of `keyspace` once its cell is in.
    pub(crate) fn pool_rejection(&self, epoch: u64, keyspace: u32) {
        *self.jobs().pool_rejections.entry((epoch, keyspace)).or_default() += 1;
    }

    /// Registers thread `tid` on the attachment of `epoch` in the background.
    pub(crate) fn register(&self, epoch: u64, tid: u32) {
        if self.jobs().threads.insert((epoch, tid)) {
            self.wake.notify_one();
        }
    }

    pub(crate) fn stop(&self) {
        self.jobs().stop = true;
        self.wake.notify_all();
    }
}

/// The jobs taken at once by the background thread.
pub(crate) struct Batch {
    /// (attachment epoch, keyspace) to ask a cell for.
    pub cells: BTreeSet<(u64, u32)>,
    /// (attachment epoch, tid) to register.
    pub threads: BTreeSet<(u64, u32)>,
}

impl Helper {
    /// Waits for jobs (at most a second, so the thread notices a client
    /// dropped elsewhere): `None` once stopped, else what is queued (maybe
    /// nothing).
    pub(crate) fn next_batch(&self) -> Option<Batch> {
        let mut j = self.jobs();
        if j.cells.is_empty() && j.threads.is_empty() && !j.stop {
            j = self.wake.wait_timeout(j, Duration::from_secs(1)).unwrap_or_else(|p| p.into_inner()).0;
        }
        if j.stop {
            return None;
        }
        Some(Batch { cells: std::mem::take(&mut j.cells), threads: std::mem::take(&mut j.threads) })
    }

    /// Asks `att` (the attachment of `epoch`, if it still exists) for the
    /// cell of `keyspace`, then counts the pool rejections kept for it and
    /// wakes who waits for it.
    pub(crate) fn ask_cell(&self, att: Option<&Attachment>, epoch: u64, keyspace: u32) {
        let mut cell = None;
        let refused = match att {
            Some(att) if att.alive() => match att.call(&Request::Keyspace { id: keyspace }) {
                Ok(Reply::Keyspace { cell: c, .. }) => {
                    cell = Some(c);
                    false
                }
                Ok(other) => {
                    log::debug!("keyspace {keyspace}: expected a cell, got {other:?}");
                    true
                }
                Err(e) => {
                    log::debug!("keyspace {keyspace}: {e}");
                    true
                }
            },
            // The agent went: callers go on without a cell (fail-open).
            _ => true,
        };
        let mut j = self.jobs();
        if refused {
            j.remember_refusal((epoch, keyspace));
        }
        if let Some(n) = j.pool_rejections.remove(&(epoch, keyspace))
            && let (Some(att), Some(c)) = (att, cell)
            && let Some((b, _)) = att.admission.keyspace_cell(c)
        {
            b.count(keyspace_governor_common::admission::counter::POOL_REJECTED, n);
        }
        let mut woken = Vec::new();
        j.waiters.retain(|(e, k, w)| {
            let hit = *e == epoch && *k == keyspace;
            if hit {
                woken.push(w.clone());
            }
            !hit
        });
        drop(j);
        woken.into_iter().for_each(Waker::wake);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_holds_for_its_time_and_the_kept_ones_stay_bounded() {
        let mut j = Jobs::default();
        assert!(!j.refused_recently((1, 7)));
        j.remember_refusal((1, 7));
        assert!(j.refused_recently((1, 7)));
        assert!(!j.refused_recently((2, 7)), "another attachment's refusal is its own");
        // Refusals of keyspaces never asked for again: past their time,
        // they go once 4096 are kept.
        let old = Instant::now() - 2 * REFUSED_FOR;
        for k in 0..4096 {
            j.refused.insert((1, 1000 + k), old);
        }
        j.remember_refusal((1, 8));
        assert_eq!(j.refused.len(), 2, "only the recent ones stay");
        assert!(j.refused_recently((1, 7)) && j.refused_recently((1, 8)));
        j.refused.insert((1, 9), old);
        assert!(!j.refused_recently((1, 9)), "an old refusal is asked again");
        assert!(!j.refused.contains_key(&(1, 9)));
    }
}
