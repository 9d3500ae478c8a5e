//! The client library a storage server links.
//!
//! # Layout
//!
//! - [`Client`]: the connection to the agent and the mmapped regions.
//! - [`Client::register_current_thread`]: gives the calling thread a slot;
//!   the kernel then measures it exactly.
//! - [`tag`]: an RAII guard that charges the thread's CPU to a keyspace
//!   until dropped, then restores the previous tag.
//! - [`Tagged`] / [`TaggedExt::tagged`]: a future wrapper that tags every
//!   poll with its keyspace, wherever the executor runs it.
//! - [`thread_cpu_ns`]: the thread's own on-CPU ns without a syscall.
//! - [`Client::acquire`] / [`Client::acquire_async`]: a [`Ticket`] that
//!   admits one request (CPU tokens, pending write bytes, a place among the
//!   tenant's in-flight requests), tags its work, and gives back what it did
//!   not use when dropped.
//!
//! ```no_run
//! use keyspace_governor::client::{self, Client};
//! let c = Client::connect("/run/governor/governor.sock")?;
//! c.register_current_thread()?;
//! {
//!     let _g = client::tag(42)?; // CPU from here on is keyspace 42's
//!     // ... serve the request ...
//! } // back to the previous tag
//! # Ok::<(), keyspace_governor::client::ClientError>(())
//! ```

mod attachment;
mod blocks;
mod clock;
mod conn;
mod error;
mod future;
mod helper;
mod home;
mod line;
mod ticket;
mod wait;
mod waiter;

pub use crate::policy::Demand;
pub use crate::policy::{Refusal, TENANT_ADMISSION_CONTROL_MARKER, WriteLimitKind};
pub use crate::proto::BackendKind;
pub use crate::region::{RegionError, RegionSizes};
pub use crate::sys::{CpuSpread, set_thread_slice, thread_cputime_ns};
#[cfg(feature = "agent")]
pub use attachment::{CALL_TIMEOUT, handshake, request, request_within};
pub use conn::Client;
pub use error::{ClientError, Refused};
pub use future::{Tagged, TaggedExt};
pub use line::FAIL_OPEN_AFTER;
pub use ticket::{Ticket, TicketGuard};
pub use wait::{AcquireFuture, Checkpoint, DeadlineFuture, TicketFuture};

use keyspace_governor_common::{TAG_NONE, tag_for};
use std::cell::RefCell;

thread_local! {
    static CURRENT: RefCell<Option<conn::ThreadState>> = const { RefCell::new(None) };
}

/// Restores the previous tag when dropped. Not `Send`: a tag belongs to the
/// thread that set it, so a guard cannot be held across an `.await` that
/// might resume on another worker (use [`Tagged`] for futures).
#[must_use = "the tag is restored when the guard drops"]
pub struct TagGuard {
    previous: Option<u64>,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl TagGuard {
    pub(crate) fn new(previous: Option<u64>) -> TagGuard {
        TagGuard { previous, _not_send: std::marker::PhantomData }
    }
}

impl Drop for TagGuard {
    fn drop(&mut self) {
        if let Some(prev) = self.previous {
            set_raw_tag(prev);
        }
    }
}

/// Runs `f` on the calling thread's registration, moving it to the
/// client's current agent first if the client attached to a new one since
/// (the registration made there for it; never a round trip). `None` on an
/// unregistered thread; `Err(AgentGone)` while no agent answers, or until
/// the thread's registration with a new agent is in.
#[inline]
pub(crate) fn with_ctx<R>(f: impl FnOnce(&conn::ThreadCtx) -> R) -> Result<Option<R>, ClientError> {
    with_thread(|_, ctx| f(ctx))
}

/// [`with_ctx`], with the thread's client too.
pub(crate) fn with_thread<R>(f: impl FnOnce(&Client, &conn::ThreadCtx) -> R) -> Result<Option<R>, ClientError> {
    CURRENT
        .try_with(|c| {
            let fresh = match c.try_borrow() {
                Ok(b) => match b.as_ref() {
                    None => return Ok(None),
                    Some(st) => st.fresh(),
                },
                // Re-entered from inside a tag switch: leave it alone.
                Err(_) => return Ok(None),
            };
            if !fresh
                && let Ok(mut b) = c.try_borrow_mut()
                && let Some(st) = b.as_mut()
            {
                st.refresh();
            }
            let b = c.borrow();
            match b.as_ref().and_then(|st| Some((&st.client, st.ctx.as_ref()?))) {
                Some((client, ctx)) if ctx.att.alive() => Ok(Some(f(client, ctx))),
                _ => Err(ClientError::AgentGone),
            }
        })
        .unwrap_or(Ok(None))
}

/// Charges the calling thread's CPU to `keyspace_id` until the guard drops.
/// On an unregistered thread it does nothing (that time is charged to no
/// keyspace). While no agent answers it reports [`ClientError::AgentGone`].
pub fn tag(keyspace_id: u32) -> Result<TagGuard, ClientError> {
    tag_with_kind(keyspace_id, 0)
}

/// [`tag`] for a request of `kind` (the server's own numbering, as
/// [`Demand::kind`]): charged exactly as [`tag`]; `governor profile` shows
/// the kind's stacks apart under its keyspace.
pub fn tag_with_kind(keyspace_id: u32, kind: u8) -> Result<TagGuard, ClientError> {
    // One visit to the thread's context: find the cell, switch to it.
    let previous = with_ctx(|ctx| ctx.att.cell_of(keyspace_id).map(|cell| ctx.switch(tag_for(cell.index, kind))))?;
    Ok(TagGuard::new(previous.transpose()?))
}

/// Switches the calling thread to `keyspace_id` with no guard: for
/// executors that manage tags themselves. Time up to now goes to the
/// previous tag.
pub fn set_tag(keyspace_id: u32) -> Result<(), ClientError> {
    tag(keyspace_id).map(std::mem::forget)
}

/// [`set_tag`] for a request of `kind` (see [`tag_with_kind`]).
pub fn set_tag_with_kind(keyspace_id: u32, kind: u8) -> Result<(), ClientError> {
    tag_with_kind(keyspace_id, kind).map(std::mem::forget)
}

/// Switches the calling thread to no keyspace, with no guard.
pub fn clear_tag() {
    set_raw_tag(TAG_NONE);
}

/// Leaves the current keyspace: time is charged to no keyspace until the
/// guard drops.
pub fn untagged() -> TagGuard {
    TagGuard::new(set_raw_tag(TAG_NONE))
}

/// Sets the raw tag of the current thread; the previous tag, if registered.
pub(crate) fn set_raw_tag(tag: u64) -> Option<u64> {
    // A guard dropped while thread-locals are being destroyed finds no
    // context rather than panicking.
    with_ctx(|ctx| ctx.switch(tag)).ok().flatten()
}

/// The calling thread's CPU time as the kernel counts it (the value of
/// `CLOCK_THREAD_CPUTIME_ID`), read without a syscall on the eBPF backend;
/// `None` if the thread is not registered. While its agent is away (no
/// agent answers, or the thread's registration with a new one is not in
/// yet) it is the syscall's reading ([`thread_cputime_ns`]): the same
/// clock, so differences across an agent's restart hold.
pub fn thread_cpu_ns() -> Option<u64> {
    match with_ctx(|ctx| ctx.clock()) {
        Ok(t) => t,
        Err(_) => Some(thread_cputime_ns()),
    }
}

/// Whether the calling thread is registered.
pub fn is_registered() -> bool {
    CURRENT.with(|c| c.borrow().is_some())
}

/// Whether the calling thread's CPU is measured now: registered, with its
/// registration in with the agent in force (false while no agent answers,
/// and for about one round trip after a thread is registered in the
/// background or an agent comes back).
pub fn is_measured() -> bool {
    matches!(with_ctx(|_| ()), Ok(Some(())))
}

/// In a forked child, the forking thread's context belongs to the parent:
/// its slot, its tags, its connection. Forget it without running its
/// destructor (which would give the parent's live slot back).
extern "C" fn forget_thread_context_after_fork() {
    home::forget_after_fork();
    let _ = CURRENT.try_with(|c| {
        if let Ok(mut slot) = c.try_borrow_mut()
            && let Some(st) = slot.take()
        {
            std::mem::forget(st);
        }
    });
}

pub(crate) fn install_fork_handler() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| crate::sys::on_fork_child(forget_thread_context_after_fork));
}

/// Charges the thread's time so far and gives its slot back.
pub fn unregister_current_thread() {
    if let Some(st) = CURRENT.with(|c| c.borrow_mut().take()) {
        drop(st);
    }
}
