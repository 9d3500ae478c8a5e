//! Per-keyspace run-queue wait as the kernel charges it (`GOV_WAITS`, one
//! entry per keyspace cell): each holder's totals and log-2 histogram of
//! waits since it got the cell, and the histogram over the monitor window
//! for the percentiles status shows.
//!
//! The wait table is the agent's alone (no client maps it), so its
//! counters only move forward; a cell given to another keyspace keeps
//! counting, and each holder's totals start from the cell's value when it
//! got the cell, as the CPU totals do (`agent::usage`).

use crate::measure::Measurement;
use crate::policy::Policy;
use crate::region::WaitView;
#[cfg(test)]
use keyspace_governor_common::wait_bucket_le_ns;
use keyspace_governor_common::{WAIT_BUCKETS, wait_quantile_ns};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;

/// A keyspace's waits: total ns, how many, and by bucket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct WaitCounts {
    pub wait_ns: u64,
    pub waits: u64,
    pub hist: [u64; WAIT_BUCKETS],
}

impl WaitCounts {
    fn read(v: &WaitView) -> WaitCounts {
        WaitCounts {
            wait_ns: v.wait_ns.load(Ordering::Relaxed),
            waits: v.waits.load(Ordering::Relaxed),
            hist: std::array::from_fn(|k| v.hist[k].load(Ordering::Relaxed)),
        }
    }

    /// `self − earlier`, field by field (never below zero).
    fn since(&self, earlier: &WaitCounts) -> WaitCounts {
        WaitCounts {
            wait_ns: self.wait_ns.saturating_sub(earlier.wait_ns),
            waits: self.waits.saturating_sub(earlier.waits),
            hist: std::array::from_fn(|k| self.hist[k].saturating_sub(earlier.hist[k])),
        }
    }

    /// The `q` quantile of the waits in ns (`wait_quantile_ns`).
    pub(crate) fn quantile_ns(&self, q: f64) -> Option<f64> {
        wait_quantile_ns(&self.hist, q)
    }
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
}

#[derive(Debug, Default)]
pub(crate) struct Waits {
    holders: HashMap<u32, Holder>,
}

impl Waits {
    fn cell(m: &Measurement, cell: u32) -> WaitCounts {
        m.waits.get(cell).map(WaitCounts::read).unwrap_or_default()
    }

    /// The holder of `cell` now, started where the cell stands if it is new
    /// (a cell's first holder from zero: nothing counted before it).
    fn holder(&mut self, m: &Measurement, cell: u32, id: u32, generation: u64) -> &mut Holder {
        let fresh = || Holder {
            id,
            generation,
            base: if generation == 1 { WaitCounts::default() } else { Self::cell(m, cell) },
            history: VecDeque::new(),
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
    /// history. Returns one wait's p99 (µs) since the last sample, for each
    /// keyspace that waited in between.
    pub(crate) fn sample(&mut self, m: &Measurement, policy: &Policy, now_ns: u64, window_ns: u64) -> Vec<(u32, u64)> {
        let r = policy.regions();
        let start = now_ns.saturating_sub(window_ns);
        let mut seen = Vec::new();
        let mut p99s = Vec::new();
        for (id, c) in r.directory().live() {
            let generation = r.keyspace_cell(c).map_or(0, |(_, p)| p.generation.load(Ordering::Acquire));
            let value = Self::cell(m, c);
            let h = self.holder(m, c, id, generation);
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
        p99s
    }

    /// Keyspace `id`'s totals since it got `cell`, and its waits over the
    /// monitor window (since the last sample at or before its start).
    pub(crate) fn current(&self, m: &Measurement, cell: u32, id: u32, generation: u64) -> (WaitCounts, WaitCounts) {
        let value = Self::cell(m, cell);
        match self.holders.get(&cell).filter(|h| h.id == id && h.generation == generation) {
            Some(h) => {
                let totals = value.since(&h.base);
                let window = h.history.front().map_or(totals, |(_, first)| totals.since(first));
                (totals, window)
            }
            None if generation == 1 => (value, value),
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
    fn totals_and_windows_subtract_field_by_field() {
        let a = WaitCounts { wait_ns: 10, waits: 2, hist: counts(&[(1, 2)]).hist };
        let b = WaitCounts { wait_ns: 25, waits: 5, hist: counts(&[(1, 3), (4, 2)]).hist };
        let d = b.since(&a);
        assert_eq!((d.wait_ns, d.waits), (15, 3));
        assert_eq!((d.hist[1], d.hist[4]), (1, 2));
        // Never below zero, whatever the order.
        assert_eq!(a.since(&b).wait_ns, 0);
    }
}
