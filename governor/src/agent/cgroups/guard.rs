//! The latency guard's hand on the rule keyspaces' cgroups: their weight
//! and cap scaled by the factor the policy holds for each keyspace.

use super::Enforcer;
use super::files::{Factors, whole_weight, write_cap, write_weight};
use std::collections::HashMap;

/// The latency guard rewrites a cap at most once per this many bandwidth
/// periods: a write's refill then adds at most a quarter of the cap.
/// Weights, which refill nothing, follow it at every step.
const GUARD_PERIODS: u64 = 4;

impl Enforcer {
    /// The latency guard's factors on `keyspace`'s cgroup.
    pub(super) fn factors(&self, keyspace: u32) -> Factors {
        self.guard.get(&keyspace).copied().unwrap_or(Factors::WHOLE)
    }

    /// The latency guard's factor on `keyspace`'s weight, while it holds
    /// it below what the configuration gives (the cap follows it, at most
    /// once per [`GUARD_PERIODS`] bandwidth periods).
    pub(crate) fn guard_factor_of(&self, keyspace: u32) -> Option<f64> {
        Some(self.factors(keyspace).weight).filter(|&f| f < 1.0 && self.unavailable.is_none())
    }

    /// Scales the cgroups of capped rule keyspaces by the latency guard's
    /// `factors` (keyspace → factor below 1; absent: whole). The weight
    /// follows the factor at every step: whoever waits behind the keyspace
    /// gets the CPU sooner while it contends. The cap follows it at most
    /// once per [`GUARD_PERIODS`] periods (and a second): every write of a
    /// quota refills the group's runtime for the period under way and lifts
    /// its throttle (the kernel's `tg_set_cfs_bandwidth`), so a cap
    /// rewritten at each step would run up to twice what it says. Once
    /// enforcement is unavailable, whatever the guard lowered is written
    /// back whole at once, and the guard stops: a keyspace is not left held
    /// below its cap by a guard that no longer runs.
    pub(crate) fn guard(&mut self, factors: &HashMap<u32, f64>) {
        let gone = self.unavailable.is_some();
        if gone && self.guard.is_empty() {
            return;
        }
        let Some((root, version)) = self.hierarchy.clone() else { return };
        let spacing = std::time::Duration::from_micros(self.settings.period_us * GUARD_PERIODS)
            .max(std::time::Duration::from_secs(1));
        let (weighted, period_us) = (self.settings.weighted, self.settings.period_us);
        let mut next = HashMap::new();
        for (&ks, &cores) in &self.settings.caps {
            let want = if gone { 1.0 } else { factors.get(&ks).copied().unwrap_or(1.0).clamp(0.0, 1.0) };
            let had = self.factors(ks);
            let Some(rel) = self.state.created.get(&ks).or_else(|| self.state.in_place.get(&ks).map(|p| &p.rel)) else {
                continue;
            };
            let dir = root.join(rel.trim_start_matches('/'));
            let due = gone || self.guard_written.get(&ks).is_none_or(|t| t.elapsed() >= spacing);
            let wanted = Factors { quota: if due { want } else { had.quota }, weight: want };
            let mut now = had;
            let mut failed = None;
            if (wanted.quota - had.quota).abs() > 1e-9 {
                self.guard_written.insert(ks, std::time::Instant::now());
                match write_cap(&dir, version, cores, wanted, weighted, period_us) {
                    Ok(()) => now = wanted,
                    // The weight alone follows (below). A quota the kernel
                    // refuses (cgroup v1: below a child group's) is refused
                    // again at every try: said once, until a write takes.
                    Err(e) => failed = Some(format!("cannot rescale {}: {e}; its weight alone follows", dir.display())),
                }
            }
            if (wanted.weight - now.weight).abs() > 1e-9 {
                match write_weight(&dir, version, whole_weight(cores, weighted) * wanted.weight) {
                    Ok(()) => now.weight = wanted.weight,
                    Err(e) => failed = Some(format!("cannot reweigh {}: {e}", dir.display())),
                }
            }
            match failed {
                Some(why) if self.guard_failed.insert(ks) => {
                    log::warn!("cgroups: the latency guard {why} (said once for keyspace {ks})");
                }
                Some(_) => {}
                None if now == wanted => {
                    self.guard_failed.remove(&ks);
                }
                None => {}
            }
            if now != Factors::WHOLE && !gone {
                next.insert(ks, now);
            }
        }
        self.guard = next;
    }
}

#[cfg(test)]
mod tests {
    use super::super::{CapSettings, Enforcer, State, Version};
    use std::collections::HashMap;
    use std::time::{Duration, Instant};

    /// An enforcer holding keyspace 7 capped at 1.5 cores in `<dir>/ks`, a
    /// v1 cgroup made of plain files (and, to refuse its quota as a kernel
    /// would, a directory in the quota file's place).
    fn enforcer(dir: &std::path::Path) -> Enforcer {
        let cg = dir.join("ks");
        std::fs::create_dir_all(cg.join("cpu.cfs_quota_us")).unwrap();
        std::fs::write(cg.join("cpu.cfs_period_us"), "250000").unwrap();
        std::fs::write(cg.join("cpu.shares"), "1024").unwrap();
        let mut state = State::default();
        state.created.insert(7, "/ks".into());
        Enforcer {
            hierarchy: Some((dir.to_path_buf(), Version::V1)),
            unavailable: None,
            prefix: "test".into(),
            state_path: dir.join("state.json"),
            state,
            settings: CapSettings { caps: HashMap::from([(7, 1.5)]), weighted: false, period_us: 250_000 },
            guard: HashMap::new(),
            guard_written: HashMap::new(),
            guard_failed: Default::default(),
            unmoved: Default::default(),
        }
    }

    #[test]
    fn a_refused_quota_leaves_the_cap_whole_and_the_weight_still_follows() {
        let dir = std::env::temp_dir().join(format!("governor-guard-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut e = enforcer(&dir);
        let shares = || std::fs::read_to_string(dir.join("ks/cpu.shares")).unwrap();
        e.guard(&HashMap::from([(7, 0.5)]));
        // The quota could not be written: the cap in force is the whole one,
        // and the weight alone is lowered (half of one core's 1024).
        assert_eq!(e.cap_of(7), Some(1.5));
        assert_eq!(e.guard_factor_of(7), Some(0.5));
        assert_eq!(shares(), "512");
        assert!(e.guard_failed.contains(&7), "the refusal is remembered (said once)");
        // Tried again when due, and written once the kernel takes it.
        e.guard_written.insert(7, Instant::now() - Duration::from_secs(2));
        std::fs::remove_dir(dir.join("ks/cpu.cfs_quota_us")).unwrap();
        e.guard(&HashMap::from([(7, 0.4)]));
        assert_eq!(std::fs::read_to_string(dir.join("ks/cpu.cfs_quota_us")).unwrap(), "150000");
        assert_eq!(e.cap_of(7), Some(0.6));
        assert_eq!(shares(), "410");
        assert!(e.guard_failed.is_empty(), "a write that took clears the refusal");
        // Whole again: both written back.
        e.guard_written.insert(7, Instant::now() - Duration::from_secs(2));
        e.guard(&HashMap::new());
        assert_eq!(std::fs::read_to_string(dir.join("ks/cpu.cfs_quota_us")).unwrap(), "375000");
        assert_eq!((shares().as_str(), e.guard_factor_of(7)), ("1024", None));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
