//! The latency guard (`[latency-guard]`), as a pure step over one stats
//! interval: who is under and who above the fair share of the CPU the
//! keyspaces used, whether one under it waited in the run queue past the
//! target behind the work of those above it, and each keyspace's refill
//! factor after the interval (AIMD: multiplied down while the target is
//! missed, given back by a step once it is met, never below the floor).
//!
//! A keyspace lowers the ones above their share only for waits they
//! caused: when most of its wait in the interval (by the kernel's count of
//! what held the CPU each wait ended on), less the part behind its own
//! threads, was behind their work. A wait
//! behind an idle CPU (the machine's own wakeup latency), a task governor
//! does not measure, or a registered thread with no tag is no keyspace's
//! doing, and lowering a keyspace would not shorten it.

use crate::config::LatencyGuard;
use std::collections::BTreeSet;

/// One keyspace in one interval.
#[derive(Clone, Debug, PartialEq)]
pub struct GuardInput {
    pub keyspace: u32,
    /// CPU it used in the interval, µs.
    pub cpu_us: u64,
    /// One run-queue wait's p99 in the interval, µs (none: it did not wait).
    pub wait_p99_us: Option<u64>,
    /// Whom its waits in the interval were behind.
    pub behind: crate::policy::WaitsBehind,
    /// Its refill factor before the step.
    pub factor: f64,
}

/// One step's outcome.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GuardStep {
    /// A keyspace under its fair share waited past the target, behind the
    /// work of keyspaces above it.
    pub missed: bool,
    /// The keyspaces that did, ascending.
    pub suffering: Vec<u32>,
    /// Keyspaces under their fair share that waited past the target mostly
    /// behind something else (an idle CPU, unmeasured tasks): nobody is
    /// lowered for them. Ascending.
    pub waiting_elsewhere: Vec<u32>,
    /// Each input's factor after the step, in input order.
    pub factors: Vec<f64>,
}

/// The step for `inputs`; with the guard off every factor is 1.
pub fn guard_step(cfg: &LatencyGuard, inputs: &[GuardInput]) -> GuardStep {
    if !cfg.enabled {
        return GuardStep { factors: vec![1.0; inputs.len()], ..GuardStep::default() };
    }
    let active: Vec<&GuardInput> = inputs.iter().filter(|k| k.cpu_us > 0 || k.wait_p99_us.is_some()).collect();
    let fair =
        if active.is_empty() { 0.0 } else { active.iter().map(|k| k.cpu_us as f64).sum::<f64>() / active.len() as f64 };
    let above: BTreeSet<u32> = active.iter().filter(|k| k.cpu_us as f64 > fair).map(|k| k.keyspace).collect();
    let target_us = cfg.target_wait_p99.get().as_micros() as u64;
    let (mut suffering, mut waiting_elsewhere) = (Vec::new(), Vec::new());
    let mut blamed = BTreeSet::new();
    for k in active.iter().filter(|k| (k.cpu_us as f64) < fair && k.wait_p99_us.is_some_and(|w| w > target_us)) {
        let b = &k.behind;
        let behind_above: u64 = b.keyspaces.iter().filter(|(id, _)| above.contains(id)).map(|(_, ns)| ns).sum();
        // Its waits behind its own threads are its own doing: what the
        // others are to blame for is a share of the rest.
        let own: u64 = b.keyspaces.iter().filter(|(id, _)| *id == k.keyspace).map(|(_, ns)| ns).sum();
        let others = b.total_ns.saturating_sub(own);
        if b.total_ns == 0 {
            // No count of whom it waited behind (none kept this interval):
            // those above their share, as the likeliest cause.
            suffering.push(k.keyspace);
            blamed.extend(above.iter().copied());
        } else if behind_above.saturating_mul(2) > others {
            suffering.push(k.keyspace);
            blamed.extend(b.keyspaces.iter().filter(|(id, ns)| *ns > 0 && above.contains(id)).map(|(id, _)| *id));
        } else {
            waiting_elsewhere.push(k.keyspace);
        }
    }
    suffering.sort_unstable();
    waiting_elsewhere.sort_unstable();
    let factors = inputs
        .iter()
        .map(|k| {
            if blamed.contains(&k.keyspace) {
                (k.factor * cfg.decrease).max(cfg.floor_ratio)
            } else {
                // Whole again exactly, not a rounding's width short of it.
                let up = k.factor + cfg.increase;
                if up >= 1.0 - 1e-9 { 1.0 } else { up }
            }
        })
        .collect();
    GuardStep { missed: !suffering.is_empty(), suffering, waiting_elsewhere, factors }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::WaitsBehind;

    fn on() -> LatencyGuard {
        LatencyGuard { enabled: true, ..LatencyGuard::default() }
    }

    /// A keyspace with no count of whom it waited behind.
    fn input(keyspace: u32, cpu_us: u64, wait_p99_us: Option<u64>, factor: f64) -> GuardInput {
        GuardInput { keyspace, cpu_us, wait_p99_us, behind: WaitsBehind::default(), factor }
    }

    /// One that waited `total_ns` in the interval, `keyspaces` of it behind
    /// those keyspaces' work.
    fn behind(mut k: GuardInput, total_ns: u64, keyspaces: &[(u32, u64)]) -> GuardInput {
        k.behind = WaitsBehind { total_ns, keyspaces: keyspaces.to_vec() };
        k
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
        // From the floor, eight steps of 0.1 make it whole exactly (a sum
        // of floats stops a rounding short of 1, and a factor below 1
        // keeps a rule keyspace's cap rewritten as lowered).
        let mut f = 0.2;
        for _ in 0..8 {
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

    #[test]
    fn only_waits_behind_the_heavy_ones_lower_them_and_only_those_it_waited_behind() {
        let cfg = on();
        // Three keyspaces: 1 and 2 above their share, 3 under it and past
        // the target. Mostly behind keyspace 1: 1 is lowered, 2 (which it
        // never waited behind) is given back.
        let step = |light: GuardInput| {
            guard_step(&cfg, &[input(1, 900_000, Some(500), 1.0), input(2, 800_000, Some(500), 0.5), light])
        };
        let s = step(behind(input(3, 20_000, Some(6_000), 1.0), 1_000_000, &[(1, 600_000)]));
        assert_eq!((s.missed, s.suffering.clone()), (true, vec![3]));
        assert!(s.waiting_elsewhere.is_empty());
        assert!((s.factors[0] - 0.7).abs() < 1e-9, "{:?}", s.factors);
        assert!((s.factors[1] - 0.6).abs() < 1e-9, "{:?}", s.factors);
        assert_eq!(s.factors[2], 1.0);
        // Half or less behind them (the rest behind an idle CPU or unmeasured
        // tasks): nobody is lowered, the refills come back.
        let s = step(behind(input(3, 20_000, Some(6_000), 1.0), 1_000_000, &[(1, 300_000), (2, 200_000)]));
        assert!(!s.missed);
        assert!(s.suffering.is_empty());
        assert_eq!(s.waiting_elsewhere, vec![3]);
        assert!((s.factors[0] - 1.0).abs() < 1e-9 && (s.factors[1] - 0.6).abs() < 1e-9, "{:?}", s.factors);
        // Behind a keyspace under its share (4, light too): not the heavy
        // ones' doing either.
        let s = guard_step(
            &cfg,
            &[
                input(1, 900_000, Some(500), 1.0),
                input(4, 30_000, Some(100), 1.0),
                behind(input(3, 20_000, Some(6_000), 1.0), 1_000_000, &[(4, 900_000)]),
            ],
        );
        assert_eq!((s.missed, s.waiting_elsewhere.clone()), (false, vec![3]));
        assert_eq!(s.factors, vec![1.0, 1.0, 1.0]);
        // Behind its own threads: its own doing, left out of the whole.
        // 400 000 behind keyspace 1 of the 700 000 not behind itself.
        let s = step(behind(input(3, 20_000, Some(6_000), 1.0), 1_000_000, &[(1, 400_000), (3, 300_000)]));
        assert_eq!(s.suffering, vec![3]);
        // All of it behind itself: nobody else to lower.
        let s = step(behind(input(3, 20_000, Some(6_000), 1.0), 1_000_000, &[(3, 1_000_000)]));
        assert_eq!((s.missed, s.waiting_elsewhere.clone()), (false, vec![3]));
        // Both halves of the boundary: 500 001 of 1 000 000 ns behind the
        // heavy ones lowers them, 500 000 does not.
        assert!(step(behind(input(3, 20_000, Some(6_000), 1.0), 1_000_000, &[(1, 500_001)])).missed);
        assert!(!step(behind(input(3, 20_000, Some(6_000), 1.0), 1_000_000, &[(1, 500_000)])).missed);
    }
}
