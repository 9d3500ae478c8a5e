//! Each thread's copy of its clients' current attachment, so the fast path
//! finds it with one relaxed load and no lock: the copy is refreshed (under
//! the client's mutex) only when the client's epoch moved, i.e. after it
//! attached to a new agent.

use super::conn::{Attachment, Client};
use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::sync::Arc;

thread_local! {
    static CACHE: RefCell<Vec<(u64, u64, Arc<Attachment>)>> = const { RefCell::new(Vec::new()) };
}

/// `client`'s current attachment.
#[inline]
pub(crate) fn attachment(client: &Client) -> Arc<Attachment> {
    let id = client.inner.id;
    let epoch = client.inner.epoch.load(Ordering::Acquire);
    let cached = CACHE
        .try_with(|c| {
            let c = c.borrow();
            c.iter().find(|(i, e, _)| *i == id && *e == epoch).map(|(_, _, a)| a.clone())
        })
        .ok()
        .flatten();
    if let Some(a) = cached {
        return a;
    }
    let (epoch, a) = client.current_slow();
    let _ = CACHE.try_with(|c| {
        let mut c = c.borrow_mut();
        c.retain(|(i, _, _)| *i != id);
        // A handful of clients per process at most; keep the cache small.
        if c.len() >= 8 {
            c.remove(0);
        }
        c.push((id, epoch, a.clone()));
    });
    a
}
