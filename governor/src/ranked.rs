//! The agent's locks, ranked: each mutex has a place in one order, and a
//! thread that takes a lock while it holds one ranked after it has broken
//! the order (two threads doing that in opposite orders deadlock, as status
//! and the tick once did). The order is [`Rank`]'s, written once; every
//! lock is checked against it as it is taken, at the cost of a
//! thread-local read and write. A break is logged with both names, once
//! per pair, and counted ([`violations`], in `governor status`), so the
//! tests that drive the agent hard can assert there was none.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// The agent's locks, in the order a thread may take them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum Rank {
    /// The running configuration.
    Config = 0,
    /// Who got each keyspace cell.
    CellGrants,
    /// Ledgers of the connections' grants.
    Ledgers,
    /// The policy's engine (buckets, keyspaces, monitor).
    Engine,
    /// The measurement backend and its regions.
    Measurement,
    /// Thread slots.
    Slots,
    /// CPU usage by keyspace cell.
    Usage,
    /// Rule measurement.
    Rules,
    /// The policy's settings (a leaf).
    Settings,
    /// The servers' CPU (a leaf).
    ServerCpu,
    /// Autoscaling history (a leaf).
    Autoscale,
}

const NAMES: [&str; 11] = [
    "config",
    "cell_grants",
    "ledgers",
    "engine",
    "measurement",
    "slots",
    "usage",
    "rules",
    "settings",
    "server_cpu",
    "autoscale",
];

thread_local! {
    /// Bit `r` set: this thread holds the lock of rank `r`.
    static HELD: Cell<u32> = const { Cell::new(0) };
    /// Breaks by this thread (the unit test's own count).
    static BROKEN_HERE: Cell<u64> = const { Cell::new(0) };
}

static VIOLATIONS: AtomicU64 = AtomicU64::new(0);
/// Pairs already logged (bit `held * 16 + taken`).
static LOGGED: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

/// Locks taken against the order since the agent started.
pub fn violations() -> u64 {
    VIOLATIONS.load(Ordering::Relaxed)
}

/// A mutex with a place in [`Rank`]'s order.
pub struct Ranked<T> {
    rank: Rank,
    inner: Mutex<T>,
}

/// The guard of a [`Ranked`] lock; the lock counts as held until it drops.
pub struct RankedGuard<'a, T> {
    guard: MutexGuard<'a, T>,
    rank: Rank,
}

impl<T> Ranked<T> {
    pub const fn new(rank: Rank, value: T) -> Ranked<T> {
        Ranked { rank, inner: Mutex::new(value) }
    }

    /// Takes the lock (a poisoned one too: the agent's state stays usable
    /// after a panicked request), checking the order first.
    pub fn lock(&self) -> RankedGuard<'_, T> {
        let bit = 1u32 << self.rank as u8;
        let held = HELD.with(Cell::get);
        // Held locks ranked after this one, or this one again.
        let after = held & !(bit - 1);
        if after != 0 {
            broken(after.trailing_zeros() as usize, self.rank as usize);
        }
        let guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        HELD.with(|h| h.set(h.get() | bit));
        RankedGuard { guard, rank: self.rank }
    }
}

#[cold]
fn broken(held: usize, taken: usize) {
    VIOLATIONS.fetch_add(1, Ordering::Relaxed);
    BROKEN_HERE.with(|b| b.set(b.get() + 1));
    let pair = held * 16 + taken;
    let first = LOGGED[pair / 64].fetch_or(1 << (pair % 64), Ordering::Relaxed) & (1 << (pair % 64)) == 0;
    if first {
        log::error!(
            "lock order broken: {} taken while holding {} (the order is config, cell_grants, ledgers, engine, \
             measurement, slots, usage, rules, then the leaves settings, server_cpu, autoscale); \
             this can deadlock the agent: please report it",
            NAMES[taken],
            NAMES[held]
        );
    }
}

impl<T> Drop for RankedGuard<'_, T> {
    fn drop(&mut self) {
        let bit = 1u32 << self.rank as u8;
        HELD.with(|h| h.set(h.get() & !bit));
    }
}

impl<T> std::ops::Deref for RankedGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> std::ops::DerefMut for RankedGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_is_quiet_and_against_it_is_counted() {
        let (config, rules) = (Ranked::new(Rank::Config, 1), Ranked::new(Rank::Rules, 2));
        let here = || BROKEN_HERE.with(Cell::get);
        let (before, total) = (here(), violations());
        {
            let _c = config.lock();
            let _r = rules.lock();
        }
        assert_eq!(here(), before);
        {
            let _r = rules.lock();
            let _c = config.lock();
        }
        assert_eq!(here(), before + 1);
        assert!(violations() > total);
        // Released: the order starts afresh.
        let _c = config.lock();
        assert_eq!(here(), before + 1);
    }
}
