//! The CPU usage monitor window (keyspace-cpu-throttle.md, "Windowing and ratios").
//!
//! One sample per `stats-interval`: the node's cumulative read CPU counter and each keyspace's
//! CPU of the requests observed in that interval. Over the samples of the last `window-size`:
//!
//! ```text
//! global_cpu_time   = latest_global − oldest_global      (cumulative counter delta)
//! keyspace_cpu_time = Σ keyspace samples in the window (those after the oldest/baseline)
//! max_cpu_time      = cores × max_read_cpu_ratio × window_size
//! ratio             = cpu_time / max_cpu_time
//! ```

use std::collections::{HashMap, VecDeque};

/// One stats-interval sample, as handed to the policy by the measuring side.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UsageSample {
    /// Cumulative read-path CPU of the node since start, µs (monotonic counter).
    pub global_cpu_cumulative_us: u64,
    /// CPU of each keyspace's requests during this stats interval, µs.
    pub keyspace_cpu_us: Vec<(u32, u64)>,
    /// One run-queue wait's p99 in this stats interval, µs, of each
    /// keyspace that waited (the latency guard reads it).
    pub keyspace_wait_p99_us: Vec<(u32, u64)>,
    /// Whom each keyspace's waits in this stats interval were behind, for
    /// each keyspace whose waits the kernel attributed (the guard reads it).
    pub keyspace_wait_behind: Vec<(u32, WaitsBehind)>,
}

/// Whom a keyspace's run-queue waits in one interval were behind: what
/// held the CPU each of its waits ended on.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WaitsBehind {
    /// All of its wait the kernel attributed in the interval, ns.
    pub total_ns: u64,
    /// Of that, the part behind each keyspace's work: (keyspace, ns).
    pub keyspaces: Vec<(u32, u64)>,
}

#[derive(Debug)]
struct Stored {
    at_us: u64,
    global_cum_us: u64,
    keyspace: Vec<(u32, u64)>,
}

/// Sliding window of samples with running per-keyspace sums (O(keyspaces in sample) per push).
#[derive(Debug)]
pub struct MonitorWindow {
    window_size_us: u64,
    max_cpu_time_us: f64,
    samples: VecDeque<Stored>,
    keyspace_sums: HashMap<u32, u64>,
}

impl MonitorWindow {
    /// `max_cpu_time_us` = cores × max-read-cpu-ratio × window size.
    pub fn new(window_size_us: u64, max_cpu_time_us: f64) -> Self {
        MonitorWindow {
            window_size_us,
            max_cpu_time_us: max_cpu_time_us.max(1.0),
            samples: VecDeque::new(),
            keyspace_sums: HashMap::new(),
        }
    }

    /// Adds the sample taken at `now_us` and drops samples older than the window. A sample stays
    /// while `at + window_size >= now`; the oldest one is the baseline of the global counter and
    /// its keyspace CPU (spent before it) is not summed, so both ratios cover
    /// `(oldest, latest]`, which is exactly `window-size` once the window is full.
    pub fn push(&mut self, now_us: u64, sample: &UsageSample) {
        if !self.samples.is_empty() {
            for &(ks, us) in &sample.keyspace_cpu_us {
                *self.keyspace_sums.entry(ks).or_insert(0) += us;
            }
        }
        self.samples.push_back(Stored {
            at_us: now_us,
            global_cum_us: sample.global_cpu_cumulative_us,
            keyspace: sample.keyspace_cpu_us.clone(),
        });
        while let Some(front) = self.samples.front() {
            if front.at_us.saturating_add(self.window_size_us) >= now_us {
                break;
            }
            self.samples.pop_front();
            // The new oldest sample becomes the baseline: its CPU leaves the sums.
            if let Some(baseline) = self.samples.front() {
                for &(ks, us) in &baseline.keyspace {
                    if let Some(sum) = self.keyspace_sums.get_mut(&ks) {
                        *sum = sum.saturating_sub(us);
                        if *sum == 0 {
                            self.keyspace_sums.remove(&ks);
                        }
                    }
                }
            }
        }
    }

    /// `latest − oldest` of the cumulative global counter, µs.
    pub fn global_cpu_time_us(&self) -> u64 {
        match (self.samples.front(), self.samples.back()) {
            (Some(o), Some(l)) => l.global_cum_us.saturating_sub(o.global_cum_us),
            _ => 0,
        }
    }

    /// Sum of a keyspace's samples in the window, µs.
    pub fn keyspace_cpu_time_us(&self, keyspace: u32) -> u64 {
        self.keyspace_sums.get(&keyspace).copied().unwrap_or(0)
    }

    /// Global ratio of the window.
    pub fn global_ratio(&self) -> f64 {
        self.global_cpu_time_us() as f64 / self.max_cpu_time_us
    }

    /// A keyspace's ratio of the window.
    pub fn keyspace_ratio(&self, keyspace: u32) -> f64 {
        self.keyspace_cpu_time_us(keyspace) as f64 / self.max_cpu_time_us
    }

    /// Every keyspace with CPU in the window and its ratio.
    pub fn keyspace_ratios(&self) -> impl Iterator<Item = (u32, f64)> + '_ {
        self.keyspace_sums.iter().map(|(&ks, &us)| (ks, us as f64 / self.max_cpu_time_us))
    }

    /// Replays `old`'s samples into this (resized) window, so a change of
    /// `window-size` keeps the history it still covers.
    pub fn take_samples_from(&mut self, old: MonitorWindow) {
        for st in old.samples {
            let sample = UsageSample {
                global_cpu_cumulative_us: st.global_cum_us,
                keyspace_cpu_us: st.keyspace,
                ..UsageSample::default()
            };
            self.push(st.at_us, &sample);
        }
    }

    /// Time between the oldest and newest sample, µs.
    pub fn span_us(&self) -> u64 {
        match (self.samples.front(), self.samples.back()) {
            (Some(o), Some(l)) => l.at_us - o.at_us,
            _ => 0,
        }
    }

    /// CPU of every keyspace in the window, µs.
    pub fn keyspace_cpu_us(&self) -> &HashMap<u32, u64> {
        &self.keyspace_sums
    }

    /// Number of samples in the window.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// True before the first sample.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_follow_the_seed_formulas() {
        // 2 cores × 0.5 × 4 s window = 4 s of CPU max.
        let mut w = MonitorWindow::new(4_000_000, 2.0 * 0.5 * 4_000_000.0);
        for i in 0..=6u64 {
            let s = UsageSample {
                global_cpu_cumulative_us: i * 500_000,
                keyspace_cpu_us: vec![(1, 250_000), (2, 100_000 * i)],
                ..UsageSample::default()
            };
            w.push(i * 1_000_000, &s);
        }
        // window keeps samples at 2..=6 s; the one at 2 s is the baseline
        assert_eq!(w.len(), 5);
        assert_eq!(w.global_cpu_time_us(), 2_000_000);
        assert!((w.global_ratio() - 0.5).abs() < 1e-9);
        assert_eq!(w.keyspace_cpu_time_us(1), 1_000_000);
        assert!((w.keyspace_ratio(1) - 0.25).abs() < 1e-9);
        assert_eq!(w.keyspace_cpu_time_us(2), 1_800_000);
        assert_eq!(w.keyspace_ratio(3), 0.0);
    }
}
