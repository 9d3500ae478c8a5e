//! Autoscaling signals (the admission-control seed's two rules), for
//! whatever scales the storage tier:
//!
//! - **scale-down unsafe** while admission control is refusing work
//!   (`tenant_admission_control` refusals in the last [`WINDOW`]): work held
//!   back makes a saturated node read as idle;
//! - **scale-up unhelpful** when one keyspace owns most of the node's
//!   measured load ([`DOMINANT_SHARE`] of the keyspaces' CPU over the
//!   monitor window) *and* is already being throttled (its tickets waited
//!   or were refused in the last [`WINDOW`]). Both halves are required:
//!   concentration alone says who caused the load, not that anything holds
//!   it back.
//!
//! Thread-pool rejections the server reports are counted apart and feed
//! neither rule: an overflowing pool is a reason to add capacity.

use crate::proto::AutoscaleSignals;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// How far back "recently" looks.
pub const WINDOW: Duration = Duration::from_secs(60);
/// Share of the keyspaces' CPU that makes one keyspace dominant.
pub const DOMINANT_SHARE: f64 = 0.5;

/// One sample of the counters the rules look at.
struct Sample {
    at: Instant,
    /// `tenant_admission_control` refusals since start.
    admission_refused: u64,
    /// Per keyspace: tickets that waited or were refused, since start.
    held_back: HashMap<u32, u64>,
}

#[derive(Default)]
pub(crate) struct History {
    samples: VecDeque<Sample>,
}

impl History {
    /// Records the counters now (once per stats interval).
    pub(crate) fn record(&mut self, admission_refused: u64, held_back: HashMap<u32, u64>) {
        let at = Instant::now();
        self.samples.push_back(Sample { at, admission_refused, held_back });
        while self.samples.len() > 2 && self.samples.front().is_some_and(|s| at.duration_since(s.at) > WINDOW) {
            self.samples.pop_front();
        }
    }

    /// The signals, from the oldest sample still inside [`WINDOW`] to now,
    /// and the monitor window's CPU per keyspace.
    pub(crate) fn signals(
        &self,
        admission_refused: u64,
        held_back: &HashMap<u32, u64>,
        window_cpu: &HashMap<u32, u64>,
    ) -> AutoscaleSignals {
        let oldest = self.samples.front();
        // Before the first sample, "recently" is since start.
        let refused = admission_refused.saturating_sub(oldest.map_or(0, |s| s.admission_refused));
        let total: u64 = window_cpu.values().sum();
        let dominant = window_cpu.iter().max_by_key(|(k, v)| (**v, std::cmp::Reverse(**k))).map(|(k, v)| (*k, *v));
        let share = match (dominant, total) {
            (Some((_, v)), t) if t > 0 => v as f64 / t as f64,
            _ => 0.0,
        };
        let throttled = dominant.is_some_and(|(k, _)| {
            let now = held_back.get(&k).copied().unwrap_or(0);
            let then = oldest.and_then(|s| s.held_back.get(&k).copied()).unwrap_or(0);
            now > then
        });
        AutoscaleSignals {
            scale_down_unsafe: refused > 0,
            scale_up_unhelpful: share >= DOMINANT_SHARE && throttled,
            admission_refusals_recent: refused,
            dominant_keyspace: dominant.map(|(k, _)| k),
            dominant_share: share,
            dominant_throttled: throttled,
            window_seconds: WINDOW.as_secs(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_halves_are_needed_to_call_a_scale_up_unhelpful() {
        let mut h = History::default();
        h.record(0, HashMap::from([(1, 0), (2, 0)]));
        let cpu = HashMap::from([(1, 800), (2, 200)]);
        // Dominant but not held back: scale-up may help.
        let s = h.signals(0, &HashMap::from([(1, 0), (2, 5)]), &cpu);
        assert!(!s.scale_up_unhelpful && !s.scale_down_unsafe);
        assert_eq!((s.dominant_keyspace, s.dominant_share), (Some(1), 0.8));
        // Dominant and held back: it would not.
        let s = h.signals(0, &HashMap::from([(1, 3), (2, 0)]), &cpu);
        assert!(s.scale_up_unhelpful && s.dominant_throttled);
        // Held back but not dominant: it would.
        let s = h.signals(0, &HashMap::from([(1, 3)]), &HashMap::from([(1, 400), (2, 600)]));
        assert!(!s.scale_up_unhelpful);
        // Admission refusals since the oldest sample: no scale-down.
        let s = h.signals(2, &HashMap::new(), &cpu);
        assert!(s.scale_down_unsafe);
        assert_eq!(s.admission_refusals_recent, 2);
    }
}
