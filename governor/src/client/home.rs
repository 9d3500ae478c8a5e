//! A thread's home in the client's ledger.
//!
//! The first half of a ledger is cut into blocks of [`BLOCK`] records
//! ([`super::blocks`]). A
//! thread that admits requests takes a block of its own (a bit in this
//! process's memory, once per thread and agent) and claims its tickets'
//! records there with a plain load and store: only the owner moves a record
//! of its block from free to claimed, and whoever holds a record (the
//! owner, or a thread its ticket moved to) only ever frees it. A thread
//! holding more tickets than its block has, or a thread without a block,
//! claims in the second half by compare-and-swap.
//!
//! The block's first record mirrors the thread's spare tokens
//! ([`crate::policy::Spare`]), so that the agent returns them, as it returns
//! every ticket, when the client dies. When the thread ends, its spare goes
//! back to the buckets and its block to the process.

use super::attachment::Attachment;
use super::blocks::BLOCK;
use crate::policy::Spare;
use crate::region::TicketView;
use keyspace_governor_common::admission::{T_SPARE, TICKET_CLAIMED, TICKET_FREE, TICKET_HELD};
use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// References to its attachment a thread keeps for its tickets.
const REFS: usize = 16;

/// One thread's block in one attachment's ledger, and its spare tokens.
pub(crate) struct Home {
    pub(crate) att: Arc<Attachment>,
    /// The block's first record (the spare's mirror).
    first: u32,
    pub(crate) spare: Spare,
    /// The spare as the mirror shows it.
    mirrored: Spare,
    /// References to `att` for this thread's tickets: a ticket takes one
    /// and, dropped on this thread, puts it back, so an owned ticket costs
    /// no write to the attachment's shared reference count.
    refs: Vec<Arc<Attachment>>,
    /// Made for this thread's admission now under way: the thread's first
    /// on this attachment (cleared by the admission that reads it).
    pub(crate) just_made: bool,
}

thread_local! {
    static HOME: RefCell<Option<Home>> = const { RefCell::new(None) };
}

/// Set in a forked child: its threads' homes would be the parent's.
static FORKED: AtomicBool = AtomicBool::new(false);

impl Home {
    #[cold]
    #[inline(never)]
    fn new(att: &Arc<Attachment>) -> Option<Home> {
        let block = att.blocks.take()?;
        let home = Home {
            att: att.clone(),
            first: block * BLOCK,
            spare: Spare::default(),
            mirrored: Spare::default(),
            refs: Vec::with_capacity(REFS),
            just_made: true,
        };
        let r = home.record(home.first);
        r.cell.store(0, Ordering::Relaxed);
        r.tenant_us.store(0, Ordering::Relaxed);
        r.global_us.store(0, Ordering::Relaxed);
        r.flags.store(T_SPARE, Ordering::Relaxed);
        r.state.store(TICKET_HELD, Ordering::Release);
        Some(home)
    }

    #[inline]
    fn record(&self, idx: u32) -> &TicketView {
        self.att.ledger.get(idx).expect("a block lies inside the ledger")
    }

    /// A free record of the block, claimed (plain store: only this thread
    /// claims here).
    #[inline]
    pub(crate) fn claim(&self) -> Option<u32> {
        (self.first + 1..self.first + BLOCK).find(|&i| {
            let r = self.record(i);
            let free = r.state.load(Ordering::Acquire) == TICKET_FREE;
            if free {
                r.state.store(TICKET_CLAIMED, Ordering::Relaxed);
            }
            free
        })
    }

    /// A reference to the attachment for a ticket.
    #[inline]
    pub(crate) fn take_ref(&mut self) -> Arc<Attachment> {
        self.refs.pop().unwrap_or_else(|| self.att.clone())
    }

    /// Brings the mirror up to the spare.
    #[inline]
    pub(crate) fn sync(&mut self) {
        if self.spare == self.mirrored {
            return;
        }
        let r = self.record(self.first);
        if self.spare.cell != self.mirrored.cell {
            let (cell, generation) = self.spare.cell.map_or((0, 0), |c| (c.index + 1, c.generation));
            r.cell.store(cell, Ordering::Relaxed);
            r.generation.store(generation, Ordering::Relaxed);
        }
        r.tenant_us.store(self.spare.us, Ordering::Relaxed);
        r.global_us.store(self.spare.us, Ordering::Relaxed);
        self.mirrored = self.spare;
    }
}

impl Drop for Home {
    fn drop(&mut self) {
        if self.att.alive() {
            self.spare.give_back(&self.att.admission);
        }
        let r = self.record(self.first);
        r.tenant_us.store(0, Ordering::Relaxed);
        r.global_us.store(0, Ordering::Relaxed);
        r.state.store(TICKET_FREE, Ordering::Release);
        self.att.blocks.give(self.first / BLOCK);
    }
}

/// Runs `f` with the calling thread's home on `att`: made on first use when
/// `make`, else only if it exists. `None` when the thread has none (no block
/// left, thread-locals gone, a forked child).
#[inline(always)]
pub(crate) fn with_home<R>(att: &Arc<Attachment>, make: bool, f: impl FnOnce(Option<&mut Home>) -> R) -> R {
    let mut f = Some(f);
    let mut run = |home: Option<&mut Home>| (f.take().expect("run once"))(home);
    if FORKED.load(Ordering::Relaxed) {
        return run(None);
    }
    let out = HOME.try_with(|h| {
        let Ok(mut slot) = h.try_borrow_mut() else { return None };
        if !slot.as_ref().is_some_and(|home| Arc::ptr_eq(&home.att, att)) {
            if !make {
                return None;
            }
            // The thread moved to another agent or client: its old spare goes back.
            *slot = None;
            *slot = Home::new(att);
        }
        Some(run(slot.as_mut()))
    });
    match out {
        Ok(Some(v)) => v,
        _ => run(None),
    }
}

/// Releases a ticket of `att` in one visit to the calling thread's home:
/// `at_home` when the thread has a home there (then the home takes the
/// ticket's reference back, if it has room), else `elsewhere`.
#[inline(always)]
pub(crate) fn release_owned(
    att: Arc<Attachment>,
    at_home: impl FnOnce(&mut Home),
    elsewhere: impl FnOnce(&Attachment),
) {
    let mut att = Some(att);
    let mut at_home = Some(at_home);
    if !FORKED.load(Ordering::Relaxed) {
        let _ = HOME.try_with(|h| {
            if let Ok(mut slot) = h.try_borrow_mut()
                && let Some(home) = slot.as_mut()
                && att.as_ref().is_some_and(|a| Arc::ptr_eq(&home.att, a))
            {
                (at_home.take().expect("once"))(home);
                let a = att.take().expect("once");
                if home.refs.len() < REFS {
                    home.refs.push(a);
                }
            }
        });
    }
    if let Some(a) = att {
        elsewhere(&a);
    }
}

/// In a forked child: forgets the forking thread's home without giving
/// anything back (it is the parent's), and makes no more.
pub(crate) fn forget_after_fork() {
    FORKED.store(true, Ordering::Relaxed);
    let _ = HOME.try_with(|h| {
        if let Ok(mut slot) = h.try_borrow_mut()
            && let Some(home) = slot.take()
        {
            std::mem::forget(home);
        }
    });
}
