//! Pending write bytes per keyspace (keyspace-write-quota.md).
//!
//! A global pending-bytes counter with a hard threshold, plus one counter per keyspace with a
//! fixed threshold of 30 % of the global one, so up to three write-heavy keyspaces can be active
//! before the global cap is approached. The keyspace id is the one from the request context.
//! The busy check runs before the increment, in the seed's order: global first, then keyspace.

use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;
use serde::Serialize;

use super::error::{Refusal, WriteLimitKind};
use super::keyspace::IdHasher;

/// Per-keyspace threshold as a fraction of the global threshold.
pub const KEYSPACE_PENDING_WRITE_RATIO: f64 = 0.3;

/// Counters of pending write bytes and of refusals by reason.
#[derive(Debug)]
pub struct PendingWrites {
    global_threshold_bytes: AtomicU64,
    global_bytes: AtomicU64,
    by_keyspace: DashMap<u32, AtomicU64, BuildHasherDefault<IdHasher>>,
    refused_global_limit: AtomicU64,
    refused_keyspace_limit: AtomicU64,
}

/// Serializable view of the pending-write state.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct PendingWritesSnapshot {
    pub global_threshold_bytes: u64,
    pub keyspace_threshold_bytes: u64,
    pub global_bytes: u64,
    pub refused_global_limit: u64,
    pub refused_keyspace_limit: u64,
}

impl PendingWrites {
    pub fn new(global_threshold_bytes: u64) -> Self {
        PendingWrites {
            global_threshold_bytes: AtomicU64::new(global_threshold_bytes),
            global_bytes: AtomicU64::new(0),
            by_keyspace: DashMap::default(),
            refused_global_limit: AtomicU64::new(0),
            refused_keyspace_limit: AtomicU64::new(0),
        }
    }

    /// Changes the global threshold (the keyspace threshold follows).
    pub fn set_global_threshold(&self, bytes: u64) {
        self.global_threshold_bytes.store(bytes, Ordering::Release);
    }

    /// `0.3 × global threshold`, bytes.
    pub fn keyspace_threshold_bytes(&self) -> u64 {
        (self.global_threshold_bytes.load(Ordering::Acquire) as f64 * KEYSPACE_PENDING_WRITE_RATIO)
            as u64
    }

    /// The seed's `too_busy`: `Some(kind)` if the global or this keyspace's threshold is reached.
    pub fn too_busy(&self, keyspace: u32) -> Option<(WriteLimitKind, u64, u64)> {
        let global_threshold = self.global_threshold_bytes.load(Ordering::Acquire);
        let global = self.global_bytes.load(Ordering::Acquire);
        if global >= global_threshold {
            return Some((WriteLimitKind::GlobalLimit, global, global_threshold));
        }
        let ks = self.keyspace_bytes(keyspace);
        let ks_threshold = self.keyspace_threshold_bytes();
        if ks >= ks_threshold {
            return Some((WriteLimitKind::KeyspaceLimit, ks, ks_threshold));
        }
        None
    }

    /// Checks `too_busy` for the request-context keyspace, then adds `bytes` to both counters.
    pub fn try_inc(&self, keyspace: u32, bytes: u64) -> Result<(), Refusal> {
        if let Some((kind, pending_bytes, threshold_bytes)) = self.too_busy(keyspace) {
            match kind {
                WriteLimitKind::GlobalLimit => {
                    self.refused_global_limit.fetch_add(1, Ordering::Relaxed)
                }
                WriteLimitKind::KeyspaceLimit => {
                    self.refused_keyspace_limit.fetch_add(1, Ordering::Relaxed)
                }
            };
            return Err(Refusal::WriteBytesLimited {
                keyspace,
                kind,
                pending_bytes,
                threshold_bytes,
            });
        }
        self.inc(keyspace, bytes);
        Ok(())
    }

    /// Unconditional increment (enqueue of a task that skips flow control). Returns (global, keyspace).
    pub fn inc(&self, keyspace: u32, bytes: u64) -> (u64, u64) {
        let g = self.global_bytes.fetch_add(bytes, Ordering::AcqRel) + bytes;
        let k = match self.by_keyspace.get(&keyspace) {
            Some(c) => c.fetch_add(bytes, Ordering::AcqRel) + bytes,
            None => {
                self.by_keyspace
                    .entry(keyspace)
                    .or_insert_with(|| AtomicU64::new(0))
                    .fetch_add(bytes, Ordering::AcqRel)
                    + bytes
            }
        };
        (g, k)
    }

    /// Dequeue: subtracts `bytes`; drops the keyspace entry when it reaches zero (best effort).
    pub fn dec(&self, keyspace: u32, bytes: u64) -> (u64, u64) {
        let g = self
            .global_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some(v.saturating_sub(bytes))
            })
            .map(|v| v.saturating_sub(bytes))
            .unwrap_or(0);
        let k = self
            .by_keyspace
            .get(&keyspace)
            .map(|c| {
                c.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                    Some(v.saturating_sub(bytes))
                })
                .map(|v| v.saturating_sub(bytes))
                .unwrap_or(0)
            })
            .unwrap_or(0);
        if k == 0 {
            self.by_keyspace
                .remove_if(&keyspace, |_, c| c.load(Ordering::Acquire) == 0);
        }
        (g, k)
    }

    pub fn global_bytes(&self) -> u64 {
        self.global_bytes.load(Ordering::Acquire)
    }

    pub fn keyspace_bytes(&self, keyspace: u32) -> u64 {
        self.by_keyspace
            .get(&keyspace)
            .map(|c| c.load(Ordering::Acquire))
            .unwrap_or(0)
    }

    /// Number of keyspaces with pending bytes.
    pub fn tracked_keyspaces(&self) -> usize {
        self.by_keyspace.len()
    }

    pub fn snapshot(&self) -> PendingWritesSnapshot {
        PendingWritesSnapshot {
            global_threshold_bytes: self.global_threshold_bytes.load(Ordering::Acquire),
            keyspace_threshold_bytes: self.keyspace_threshold_bytes(),
            global_bytes: self.global_bytes(),
            refused_global_limit: self.refused_global_limit.load(Ordering::Relaxed),
            refused_keyspace_limit: self.refused_keyspace_limit.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dec_to_zero_drops_the_entry() {
        let w = PendingWrites::new(1000);
        w.inc(7, 100);
        assert_eq!(w.tracked_keyspaces(), 1);
        assert_eq!(w.dec(7, 100), (0, 0));
        assert_eq!(w.tracked_keyspaces(), 0);
        assert_eq!(w.keyspace_threshold_bytes(), 300);
    }
}
