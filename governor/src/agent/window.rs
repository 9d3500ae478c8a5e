//! Per-keyspace on-CPU ratios over a sliding window, from the cumulative
//! counters of the keyspace table sampled every stats interval.

use std::collections::{HashMap, VecDeque};

pub struct Window {
    span_ns: u64,
    samples: VecDeque<(u64, HashMap<u32, u64>)>,
}

impl Window {
    pub fn new(span_ns: u64) -> Window {
        Window { span_ns, samples: VecDeque::new() }
    }

    pub fn span_ns(&self) -> u64 {
        self.span_ns
    }

    /// Adds a sample of cumulative per-keyspace ns at `now_ns`; drops
    /// samples older than the window (keeping one at or before its start).
    pub fn push(&mut self, now_ns: u64, totals: HashMap<u32, u64>) {
        self.samples.push_back((now_ns, totals));
        while self.samples.len() > 2 && self.samples[1].0 + self.span_ns <= now_ns {
            self.samples.pop_front();
        }
    }

    /// On-CPU ns of each keyspace between the oldest and newest sample, and
    /// the time between them.
    pub fn deltas(&self) -> (u64, HashMap<u32, u64>) {
        let (Some(first), Some(last)) = (self.samples.front(), self.samples.back()) else {
            return (0, HashMap::new());
        };
        let d = last
            .1
            .iter()
            .map(|(ks, v)| (*ks, v.saturating_sub(first.1.get(ks).copied().unwrap_or(0))))
            .collect();
        (last.0 - first.0, d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_keeps_only_its_span() {
        let mut w = Window::new(10);
        for t in 0..30u64 {
            w.push(t, HashMap::from([(1, t * 100)]));
        }
        let (dt, d) = w.deltas();
        assert_eq!(dt, 10);
        assert_eq!(d[&1], 1000);
    }

    #[test]
    fn new_keyspace_counts_from_zero() {
        let mut w = Window::new(100);
        w.push(0, HashMap::new());
        w.push(5, HashMap::from([(7, 50)]));
        assert_eq!(w.deltas(), (5, HashMap::from([(7, 50)])));
    }
}
