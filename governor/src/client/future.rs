//! A future that charges every poll to its keyspace.

use super::set_raw_tag;
use keyspace_governor_common::tag_for_cell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

pin_project_lite::pin_project! {
    /// Wraps a future so that each poll runs under its keyspace tag, on
    /// whichever registered worker thread polls it; the worker's previous
    /// tag is restored after the poll. Work between polls is not charged to
    /// this keyspace.
    pub struct Tagged<F> {
        #[pin]
        inner: F,
        keyspace_id: u32,
    }
}

impl<F> Tagged<F> {
    /// `inner`, each poll of it charged to `keyspace_id`.
    pub fn new(keyspace_id: u32, inner: F) -> Self {
        Tagged { inner, keyspace_id }
    }

    /// The keyspace its polls are charged to.
    pub fn keyspace_id(&self) -> u32 {
        self.keyspace_id
    }
}

impl<F: Future> Future for Tagged<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        // Looked up at every poll (a shared-memory probe; the agent may give
        // an idle keyspace's cell to another between polls). A keyspace the
        // agent has no cell for yet is asked for in the background: this
        // poll waits for it (woken when it is in) rather than block the
        // worker on a round trip or run uncharged. A poll on an
        // unregistered worker, while no agent answers, or for a keyspace the
        // agent gave no cell, runs untagged.
        let looked_up =
            super::with_thread(|client, ctx| client.inner.helper.cell(&ctx.att, *this.keyspace_id, Some(cx.waker())));
        let cell = match looked_up {
            Ok(Some(super::helper::Cell::Found(c))) => Some(c),
            Ok(Some(super::helper::Cell::Pending)) => return Poll::Pending,
            _ => None,
        };
        // The guard restores the worker's tag even if the poll panics.
        let _restore = super::TagGuard::new(cell.and_then(|c| set_raw_tag(tag_for_cell(c.index))));
        this.inner.poll(cx)
    }
}

/// `.tagged(keyspace)` on any future.
pub trait TaggedExt: Future + Sized {
    /// This future, each poll of it charged to `keyspace_id` (see [`Tagged`]).
    fn tagged(self, keyspace_id: u32) -> Tagged<Self> {
        Tagged::new(keyspace_id, self)
    }
}

impl<F: Future> TaggedExt for F {}
