//! Per-request CPU estimates: a static default, per-keyspace overrides, and an adaptive EMA
//! updated once per stats interval from the CPU observed on released requests.

use std::collections::HashMap;

/// `alpha × sample + (1 − alpha) × prev`, rounded, at least 1 µs.
pub fn ema(prev_us: u64, sample_us: u64, alpha: f64) -> u64 {
    let v = alpha * sample_us as f64 + (1.0 - alpha) * prev_us as f64;
    (v.round() as u64).max(1)
}

/// Agent-side memory of each keyspace's cumulative (consumed µs, released requests) at the last
/// stats interval, so each interval's mean per-request CPU can be computed from counter deltas.
#[derive(Debug, Default)]
pub struct EstimateTracker {
    last: HashMap<u32, (u64, u64)>,
}

impl EstimateTracker {
    /// Records the cumulative counters and returns this interval's mean µs per request, if any
    /// request was released in the interval.
    pub fn interval_mean(&mut self, keyspace: u32, consumed_total_us: u64, requests_total: u64) -> Option<u64> {
        let (c0, n0) = self.last.insert(keyspace, (consumed_total_us, requests_total)).unwrap_or((0, 0));
        let n = requests_total.saturating_sub(n0);
        (n > 0).then(|| consumed_total_us.saturating_sub(c0) / n)
    }

    /// Forgets an evicted keyspace.
    pub fn forget(&mut self, keyspace: u32) {
        self.last.remove(&keyspace);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ema_moves_toward_samples() {
        assert_eq!(ema(1000, 2000, 0.5), 1500);
        assert_eq!(ema(1000, 2000, 1.0), 2000);
        assert_eq!(ema(0, 0, 0.3), 1);
    }

    #[test]
    fn interval_mean_uses_deltas() {
        let mut t = EstimateTracker::default();
        assert_eq!(t.interval_mean(1, 3000, 3), Some(1000));
        assert_eq!(t.interval_mean(1, 3000, 3), None);
        assert_eq!(t.interval_mean(1, 9000, 5), Some(3000));
    }

    #[test]
    fn ema_converges_to_a_steady_sample() {
        let mut e = 1000;
        for _ in 0..50 {
            e = ema(e, 5000, 0.2);
        }
        assert!((4990..=5000).contains(&e), "converged to {e}");
    }

    #[test]
    fn forget_restarts_the_deltas() {
        let mut t = EstimateTracker::default();
        assert_eq!(t.interval_mean(1, 10_000, 10), Some(1000));
        t.forget(1);
        // After eviction and re-creation counters restart from zero.
        assert_eq!(t.interval_mean(1, 400, 2), Some(200));
    }

    #[test]
    fn counter_reset_does_not_underflow() {
        let mut t = EstimateTracker::default();
        t.interval_mean(1, 10_000, 10);
        // A re-created entry with smaller counters: the request delta saturates to 0.
        assert_eq!(t.interval_mean(1, 100, 1), None);
    }
}
