//! The latency guard (`[latency-guard]`), as a pure step over one stats
//! interval: who is under and who above the fair share of the CPU the
//! keyspaces used, whether one under it waited in the run queue past the
//! target, and each keyspace's refill factor after the interval (AIMD:
//! multiplied down while the target is missed, given back by a step once it
//! is met, never below the floor).

use crate::config::LatencyGuard;

/// One keyspace in one interval.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GuardInput {
    pub keyspace: u32,
    /// CPU it used in the interval, µs.
    pub cpu_us: u64,
    /// One run-queue wait's p99 in the interval, µs (none: it did not wait).
    pub wait_p99_us: Option<u64>,
    /// Its refill factor before the step.
    pub factor: f64,
}

/// One step's outcome.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GuardStep {
    /// A keyspace under its fair share waited past the target.
    pub missed: bool,
    /// The keyspaces that missed it, ascending.
    pub suffering: Vec<u32>,
    /// Each input's factor after the step, in input order.
    pub factors: Vec<f64>,
}

/// The step for `inputs`; with the guard off every factor is 1.
pub fn guard_step(cfg: &LatencyGuard, inputs: &[GuardInput]) -> GuardStep {
    if !cfg.enabled {
        return GuardStep { missed: false, suffering: Vec::new(), factors: vec![1.0; inputs.len()] };
    }
    let active: Vec<&GuardInput> = inputs.iter().filter(|k| k.cpu_us > 0 || k.wait_p99_us.is_some()).collect();
    let fair =
        if active.is_empty() { 0.0 } else { active.iter().map(|k| k.cpu_us as f64).sum::<f64>() / active.len() as f64 };
    let target_us = cfg.target_wait_p99.get().as_micros() as u64;
    let mut suffering: Vec<u32> = active
        .iter()
        .filter(|k| (k.cpu_us as f64) < fair && k.wait_p99_us.is_some_and(|w| w > target_us))
        .map(|k| k.keyspace)
        .collect();
    suffering.sort_unstable();
    let missed = !suffering.is_empty();
    let factors = inputs
        .iter()
        .map(|k| {
            if missed && k.cpu_us as f64 > fair {
                (k.factor * cfg.decrease).max(cfg.floor_ratio)
            } else {
                (k.factor + cfg.increase).min(1.0)
            }
        })
        .collect();
    GuardStep { missed, suffering, factors }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on() -> LatencyGuard {
        LatencyGuard { enabled: true, ..LatencyGuard::default() }
    }

    fn input(keyspace: u32, cpu_us: u64, wait_p99_us: Option<u64>, factor: f64) -> GuardInput {
        GuardInput { keyspace, cpu_us, wait_p99_us, factor }
    }

    #[test]
    fn a_light_keyspace_waiting_past_the_target_lowers_the_heavy_ones_to_the_floor_and_no_further() {
        let cfg = on();
        let mut heavy = 1.0;
        for step in 0..20 {
            let s = guard_step(&cfg, &[input(1, 900_000, Some(500), heavy), input(2, 20_000, Some(6_000), 1.0)]);
            assert!(s.missed);
            assert_eq!(s.suffering, vec![2]);
            // The light one is not to blame: it stays whole.
            assert_eq!(s.factors[1], 1.0);
            let want = (0.7f64.powi(step + 1)).max(0.2);
            assert!((s.factors[0] - want).abs() < 1e-9, "step {step}: {} want {want}", s.factors[0]);
            heavy = s.factors[0];
        }
        assert_eq!(heavy, 0.2);
    }

    #[test]
    fn met_targets_give_the_refill_back_step_by_step_and_off_means_whole() {
        let cfg = on();
        // Light waits under the target (2 ms): nobody suffers.
        let s = guard_step(&cfg, &[input(1, 900_000, Some(500), 0.2), input(2, 20_000, Some(1_500), 1.0)]);
        assert!(!s.missed);
        assert!((s.factors[0] - 0.3).abs() < 1e-9);
        // The heavy keyspace gone: given back up to 1, never past.
        let mut f = 0.3;
        for _ in 0..10 {
            f = guard_step(&cfg, &[input(1, 0, None, f), input(2, 20_000, Some(9_000), 1.0)]).factors[0];
        }
        assert_eq!(f, 1.0);
        let off = LatencyGuard::default();
        assert_eq!(
            guard_step(&off, &[input(1, 900_000, Some(1), 0.2), input(2, 1, Some(9_000), 1.0)]).factors,
            vec![1.0, 1.0]
        );
    }

    #[test]
    fn a_heavy_keyspace_waiting_long_is_not_protected_and_one_alone_has_no_neighbour() {
        let cfg = on();
        // The heavy one's own long waits lower nobody: it is above its share.
        let s = guard_step(&cfg, &[input(1, 900_000, Some(50_000), 1.0), input(2, 20_000, Some(100), 1.0)]);
        assert!(!s.missed);
        // Alone, a keyspace is its own fair share: nobody under it.
        let s = guard_step(&cfg, &[input(1, 900_000, Some(50_000), 0.5)]);
        assert!(!s.missed);
        assert!((s.factors[0] - 0.6).abs() < 1e-9);
    }
}
