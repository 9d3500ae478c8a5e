//! Per-keyspace run-queue wait as the kernel charges it (`GOV_WAITS`, one
//! entry per keyspace cell): each holder's totals and log-2 histogram of
//! waits since it got the cell, the histogram over the monitor window
//! for the percentiles status shows, and whom the waits were behind over
//! the window (the kernel's slots of runners, which the agent frees when
//! they stop growing).
//!
//! The wait table is the agent's alone (no client maps it), so its
//! counters only move forward; a cell given to another keyspace keeps
//! counting, and each holder's totals start from the cell's value when it
//! got the cell, as the CPU totals do (`agent::usage`).

use crate::measure::Measurement;
use crate::policy::{Policy, WaitsBehind};
use crate::region::WaitView;
#[cfg(test)]
use keyspace_governor_common::wait_bucket_le_ns;
use keyspace_governor_common::{
    BEHIND_IDLE, BEHIND_SLOTS, BEHIND_UNKNOWN, BEHIND_UNMEASURED, BEHIND_UNTAGGED, WAIT_BUCKETS, wait_quantile_ns,
};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;

/// A keyspace's waits: total ns, how many, by bucket, and how long at
/// least one of its threads waited ("some").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct WaitCounts {
    pub wait_ns: u64,
    pub waits: u64,
    pub hist: [u64; WAIT_BUCKETS],
    pub some_ns: u64,
}

impl WaitCounts {
    /// The cell's counts at `now_ns` (CLOCK_MONOTONIC): a "some" stretch
    /// still open counts up to then.
    fn read(v: &WaitView, now_ns: u64) -> WaitCounts {
        let hist: [u64; WAIT_BUCKETS] = std::array::from_fn(|k| v.hist[k].load(Ordering::Relaxed));
        WaitCounts {
            wait_ns: v.wait_ns.load(Ordering::Relaxed),
            waits: hist.iter().sum(),
            hist,
            some_ns: some_ns(v, now_ns),
        }
    }

    /// `self − earlier`, field by field (never below zero).
    fn since(&self, earlier: &WaitCounts) -> WaitCounts {
        WaitCounts {
            wait_ns: self.wait_ns.saturating_sub(earlier.wait_ns),
            waits: self.waits.saturating_sub(earlier.waits),
            hist: std::array::from_fn(|k| self.hist[k].saturating_sub(earlier.hist[k])),
            some_ns: self.some_ns.saturating_sub(earlier.some_ns),
        }
    }

    /// The `q` quantile of the waits in ns (`wait_quantile_ns`).
    pub(crate) fn quantile_ns(&self, q: f64) -> Option<f64> {
        wait_quantile_ns(&self.hist, q)
    }
}

/// The cell's "some" time at `now_ns`: the closed stretches, and the open
/// one up to now. Read again if a stretch closed while it was read (it
/// would count twice); a stretch whose start the kernel has not written
/// yet (not after the last close) counts from the next read.
fn some_ns(v: &WaitView, now_ns: u64) -> u64 {
    let mut closed = v.some_ns.load(Ordering::Acquire);
    for _ in 0..4 {
        let closed_at = v.some_closed_ns.load(Ordering::Acquire);
        let since = v.some_since_ns.load(Ordering::Acquire);
        let waiting = v.waiting.load(Ordering::Acquire);
        let again = v.some_ns.load(Ordering::Acquire);
        if again == closed {
            // A count past half the range is one taken back below zero.
            let open = waiting > 0 && waiting < u64::MAX / 2 && since > closed_at;
            return closed + if open { now_ns.saturating_sub(since) } else { 0 };
        }
        closed = again;
    }
    closed
}

/// Whom a wait was behind: what held the CPU the waiting thread got when
/// its wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Behind {
    /// A keyspace's work (its registered threads or its rule's processes).
    Keyspace(u32),
    /// A registered thread with no tag.
    Untagged,
    /// A task governor does not measure.
    Unmeasured,
    /// The idle task: the CPU was free, the wait the wakeup's own.
    Idle,
    /// The thread's switch-in was not seen.
    Unknown,
    /// A runner the kernel had no slot left for, or a keyspace that has
    /// since given its cell up.
    Other,
}

impl Behind {
    /// The kernel's code `runner`, with the keyspaces holding cells now.
    fn of(runner: u32, holders: &HashMap<u32, u32>) -> Behind {
        match runner {
            BEHIND_UNTAGGED => Behind::Untagged,
            BEHIND_UNMEASURED => Behind::Unmeasured,
            BEHIND_IDLE => Behind::Idle,
            BEHIND_UNKNOWN => Behind::Unknown,
            0 => Behind::Other,
            cell => holders.get(&(cell - 1)).map_or(Behind::Other, |&id| Behind::Keyspace(id)),
        }
    }

    /// The keyspace, when it is one.
    pub(crate) fn keyspace_id(self) -> Option<u32> {
        match self {
            Behind::Keyspace(id) => Some(id),
            _ => None,
        }
    }

    /// The word status uses for it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Behind::Keyspace(_) => "keyspace",
            Behind::Untagged => "untagged",
            Behind::Unmeasured => "unmeasured",
            Behind::Idle => "idle",
            Behind::Unknown => "unknown",
            Behind::Other => "other",
        }
    }
}

/// The agent's view of one cell's runner slots: what it read last, and
/// when each slot last grew or changed hands.
#[derive(Debug, Default)]
struct Slots {
    runner: [u32; BEHIND_SLOTS],
    ns: [u64; BEHIND_SLOTS],
    other_ns: u64,
    moved_ns: [u64; BEHIND_SLOTS],
}

impl Slots {
    /// What the waits of the cell were behind since the last read, and
    /// frees (in the kernel's table) the slots idle for `idle_ns`.
    fn step(&mut self, v: &WaitView, holders: &HashMap<u32, u32>, now_ns: u64, idle_ns: u64) -> Vec<(Behind, u64)> {
        let mut out = Vec::new();
        for i in 0..BEHIND_SLOTS {
            let runner = v.behind_runner[i].load(Ordering::Relaxed);
            let ns = v.behind_ns[i].load(Ordering::Relaxed);
            if runner != self.runner[i] {
                self.runner[i] = runner;
                self.moved_ns[i] = now_ns;
            }
            let grew = ns.saturating_sub(self.ns[i]);
            self.ns[i] = ns;
            if grew > 0 {
                out.push((Behind::of(runner, holders), grew));
                self.moved_ns[i] = now_ns;
            } else if runner != 0 && now_ns.saturating_sub(self.moved_ns[i]) >= idle_ns {
                // Whatever the kernel adds before it claims the slot again
                // goes to the next holder's first read: nothing, as the
                // slot stood still for a whole window.
                v.behind_runner[i].store(0, Ordering::Relaxed);
                self.runner[i] = 0;
                self.moved_ns[i] = now_ns;
            }
        }
        let other = v.behind_other_ns.load(Ordering::Relaxed);
        if other > self.other_ns {
            out.push((Behind::Other, other - self.other_ns));
        }
        self.other_ns = other;
        out
    }
}

/// What one sample found of the keyspaces' waits since the one before.
#[derive(Debug, Default)]
pub(crate) struct IntervalWaits {
    /// One wait's p99, µs, of each keyspace that waited.
    pub p99_us: Vec<(u32, u64)>,
    /// Whom each keyspace's waits were behind.
    pub behind: Vec<(u32, WaitsBehind)>,
}

/// The policy's view of `moved`: the whole, and the part behind each
/// keyspace.
fn waits_behind(moved: &[(Behind, u64)]) -> WaitsBehind {
    WaitsBehind {
        total_ns: moved.iter().map(|(_, ns)| ns).sum(),
        keyspaces: by_behind(moved.iter().copied())
            .into_iter()
            .filter_map(|(b, ns)| b.keyspace_id().map(|id| (id, ns)))
            .collect(),
    }
}

/// Sums `(whom, ns)` pairs by whom, the largest first.
fn by_behind(parts: impl IntoIterator<Item = (Behind, u64)>) -> Vec<(Behind, u64)> {
    let mut sums: HashMap<Behind, u64> = HashMap::new();
    for (b, ns) in parts {
        *sums.entry(b).or_default() += ns;
    }
    let mut v: Vec<(Behind, u64)> = sums.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    v
}

#[derive(Debug)]
struct Holder {
    id: u32,
    generation: u64,
    /// The cell's counts when this keyspace got it.
    base: WaitCounts,
    /// This holder's totals at recent samples (ns of the sample, totals),
    /// oldest first: one at or before the window's start, then every
    /// sample since at which they moved.
    history: VecDeque<(u64, WaitCounts)>,
    /// Whom its waits were behind, by sample (ns of the sample, what moved
    /// since the one before), over the monitor window.
    behind: VecDeque<(u64, Vec<(Behind, u64)>)>,
}

#[derive(Debug, Default)]
pub(crate) struct Waits {
    holders: HashMap<u32, Holder>,
    slots: HashMap<u32, Slots>,
}

impl Waits {
    fn cell(m: &Measurement, cell: u32) -> WaitCounts {
        let now = crate::sys::monotonic_ns();
        m.waits.get(cell).map(|v| WaitCounts::read(v, now)).unwrap_or_default()
    }

    /// The holder of `cell` now, started where the cell stands if it is new
    /// (a cell's first holder from zero: nothing counted before it).
    fn holder(&mut self, m: &Measurement, cell: u32, id: u32, generation: u64) -> &mut Holder {
        let fresh = || Holder {
            id,
            generation,
            base: if generation == 1 { WaitCounts::default() } else { Self::cell(m, cell) },
            history: VecDeque::new(),
            behind: VecDeque::new(),
        };
        let h = self.holders.entry(cell).or_insert_with(fresh);
        if h.id != id || h.generation != generation {
            *h = fresh();
        }
        h
    }

    /// Records where a keyspace's count starts when the agent gives it a cell.
    pub(crate) fn note(&mut self, m: &Measurement, cell: u32, id: u32, generation: u64) {
        let h = self.holder(m, cell, id, generation);
        if h.history.is_empty() {
            h.base = Self::cell(m, cell);
        }
    }

    /// One sample of every live cell at `now_ns`, keeping `window_ns` of
    /// history. Returns, for each keyspace that waited since the last
    /// sample, one wait's p99 (µs) in between, and whom its waits in between
    /// were behind.
    pub(crate) fn sample(&mut self, m: &Measurement, policy: &Policy, now_ns: u64, window_ns: u64) -> IntervalWaits {
        let r = policy.regions();
        let start = now_ns.saturating_sub(window_ns);
        let mut seen = Vec::new();
        let mut p99s = Vec::new();
        let mut behind = Vec::new();
        let holders: HashMap<u32, u32> = r.directory().live().map(|(id, c)| (c, id)).collect();
        for (id, c) in r.directory().live() {
            let generation = r.keyspace_cell(c).map_or(0, |(_, p)| p.generation.load(Ordering::Acquire));
            let value = Self::cell(m, c);
            let moved = match m.waits.get(c) {
                Some(v) => self.slots.entry(c).or_default().step(v, &holders, now_ns, window_ns),
                None => Vec::new(),
            };
            let h = self.holder(m, c, id, generation);
            if !moved.is_empty() {
                behind.push((id, waits_behind(&moved)));
                h.behind.push_back((now_ns, moved));
            }
            while h.behind.front().is_some_and(|(t, _)| *t <= start) {
                h.behind.pop_front();
            }
            let totals = value.since(&h.base);
            let since_last = h.history.back().map_or(totals, |(_, last)| totals.since(last));
            if let Some(ns) = since_last.quantile_ns(0.99) {
                p99s.push((id, (ns / 1e3).round() as u64));
            }
            if h.history.back().is_none_or(|(_, last)| *last != totals) {
                h.history.push_back((now_ns, totals));
            }
            // Keep one sample at or before the window's start as its base.
            while h.history.len() > 1 && h.history[1].0 <= start {
                h.history.pop_front();
            }
            seen.push(c);
        }
        self.holders.retain(|c, _| seen.contains(c));
        IntervalWaits { p99_us: p99s, behind }
    }

    /// Whom keyspace `id`'s waits were behind over the monitor window, the
    /// largest first (ns).
    pub(crate) fn behind(&self, cell: u32, id: u32, generation: u64) -> Vec<(Behind, u64)> {
        match self.holders.get(&cell).filter(|h| h.id == id && h.generation == generation) {
            Some(h) => by_behind(h.behind.iter().flat_map(|(_, parts)| parts.iter().copied())),
            None => Vec::new(),
        }
    }

    /// Keyspace `id`'s totals since it got `cell`, its waits over the
    /// monitor window (since the last sample at or before its start), and
    /// that stretch's length in ns (0: no sample yet).
    pub(crate) fn current(
        &self,
        m: &Measurement,
        cell: u32,
        id: u32,
        generation: u64,
    ) -> (WaitCounts, WaitCounts, u64) {
        let now = crate::sys::monotonic_ns();
        let value = m.waits.get(cell).map(|v| WaitCounts::read(v, now)).unwrap_or_default();
        match self.holders.get(&cell).filter(|h| h.id == id && h.generation == generation) {
            Some(h) => {
                let totals = value.since(&h.base);
                let (window, span) =
                    h.history.front().map_or((totals, 0), |(t, first)| (totals.since(first), now.saturating_sub(*t)));
                (totals, window, span)
            }
            None if generation == 1 => (value, value, 0),
            None => Default::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(hist: &[(usize, u64)]) -> WaitCounts {
        let mut c = WaitCounts::default();
        for &(k, n) in hist {
            c.hist[k] = n;
            c.waits += n;
        }
        c
    }

    #[test]
    fn quantiles_fall_in_the_bucket_that_holds_them() {
        assert_eq!(WaitCounts::default().quantile_ns(0.5), None);
        // 90 waits in [64, 128) µs-ish (bucket 7: 65.5–131 µs), 10 in bucket 12.
        let c = counts(&[(7, 90), (12, 10)]);
        let p50 = c.quantile_ns(0.5).unwrap();
        assert!((wait_bucket_le_ns(6) as f64..wait_bucket_le_ns(7) as f64).contains(&p50), "{p50}");
        let p99 = c.quantile_ns(0.99).unwrap();
        assert!((wait_bucket_le_ns(11) as f64..=wait_bucket_le_ns(12) as f64).contains(&p99), "{p99}");
        // The median of a bucket's waits is its middle.
        let one = counts(&[(3, 100)]);
        let mid = (wait_bucket_le_ns(2) + wait_bucket_le_ns(3)) as f64 / 2.0;
        assert!((one.quantile_ns(0.5).unwrap() - mid).abs() < 1.0);
    }

    #[test]
    fn runner_slots_give_what_grew_to_whom_holds_them_and_free_idle_ones() {
        // SAFETY: all atomics (and padding): zero is a valid value.
        #[allow(unsafe_code)]
        let v: WaitView = unsafe { std::mem::zeroed() };
        let holders: HashMap<u32, u32> = [(0, 500), (3, 800)].into();
        let mut s = Slots::default();
        let idle = 10_000;
        // The kernel claims two slots and overflows once.
        v.behind_runner[0].store(1, Ordering::Relaxed);
        v.behind_ns[0].store(100, Ordering::Relaxed);
        v.behind_runner[1].store(BEHIND_IDLE, Ordering::Relaxed);
        v.behind_ns[1].store(5, Ordering::Relaxed);
        v.behind_other_ns.store(7, Ordering::Relaxed);
        let got = by_behind(s.step(&v, &holders, 1_000, idle));
        assert_eq!(got, vec![(Behind::Keyspace(500), 100), (Behind::Other, 7), (Behind::Idle, 5)]);
        // Nothing moved: nothing to give, nothing freed yet.
        assert!(s.step(&v, &holders, 5_000, idle).is_empty());
        v.behind_ns[0].store(160, Ordering::Relaxed);
        assert_eq!(s.step(&v, &holders, 6_000, idle), vec![(Behind::Keyspace(500), 60)]);
        // Slot 1 stood still for a window: freed; slot 0 grew since.
        assert!(s.step(&v, &holders, 11_500, idle).is_empty());
        assert_eq!(v.behind_runner[1].load(Ordering::Relaxed), 0);
        assert_eq!(v.behind_runner[0].load(Ordering::Relaxed), 1);
        // The kernel gives the free slot to another runner: its ns count on
        // from where they stood, and only the growth is the new runner's.
        v.behind_runner[1].store(4, Ordering::Relaxed);
        v.behind_ns[1].store(35, Ordering::Relaxed);
        assert_eq!(s.step(&v, &holders, 12_000, idle), vec![(Behind::Keyspace(800), 30)]);
        // A cell no keyspace holds any more is "other".
        v.behind_ns[1].store(36, Ordering::Relaxed);
        assert_eq!(s.step(&v, &HashMap::new(), 13_000, idle), vec![(Behind::Other, 1)]);
    }

    #[test]
    fn the_guard_sees_the_whole_wait_and_the_part_behind_each_keyspace() {
        let moved = [
            (Behind::Keyspace(5), 100),
            (Behind::Idle, 50),
            (Behind::Keyspace(5), 20),
            (Behind::Unmeasured, 30),
            (Behind::Keyspace(7), 40),
            (Behind::Other, 10),
        ];
        let b = waits_behind(&moved);
        assert_eq!(b.total_ns, 250);
        assert_eq!(b.keyspaces, vec![(5, 120), (7, 40)]);
        assert_eq!(waits_behind(&[]), WaitsBehind::default());
    }

    #[test]
    fn totals_and_windows_subtract_field_by_field() {
        let a = WaitCounts { wait_ns: 10, waits: 2, hist: counts(&[(1, 2)]).hist, some_ns: 7 };
        let b = WaitCounts { wait_ns: 25, waits: 5, hist: counts(&[(1, 3), (4, 2)]).hist, some_ns: 20 };
        let d = b.since(&a);
        assert_eq!((d.wait_ns, d.waits, d.some_ns), (15, 3, 13));
        assert_eq!((d.hist[1], d.hist[4]), (1, 2));
        // Never below zero, whatever the order.
        assert_eq!(a.since(&b).wait_ns, 0);
    }
}
