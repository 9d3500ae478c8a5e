//! The latency guard's hand on the rule keyspaces' cgroups: their weight
//! and cap scaled by the factor the policy holds for each keyspace.

use super::{Enforcer, whole_weight, write_cap, write_weight};
use std::collections::HashMap;

/// The latency guard rewrites a cap at most once per this many bandwidth
/// periods: a write's refill then adds at most a quarter of the cap.
/// Weights, which refill nothing, follow it at every step.
const GUARD_PERIODS: u64 = 4;

/// The latency guard's factors on a keyspace cgroup, as written: its quota
/// (rewritten at most once per [`GUARD_PERIODS`] periods) and its weight
/// (at every step).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Factors {
    pub(super) quota: f64,
    pub(super) weight: f64,
}

impl Factors {
    pub(super) const WHOLE: Factors = Factors { quota: 1.0, weight: 1.0 };
}

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
            if (wanted.quota - had.quota).abs() > 1e-9 {
                self.guard_written.insert(ks, std::time::Instant::now());
                match write_cap(&dir, version, cores, wanted, weighted, period_us) {
                    Ok(()) => now = wanted,
                    Err(e) => log::warn!("cgroups: the latency guard cannot rescale {}: {e}", dir.display()),
                }
            } else if (wanted.weight - had.weight).abs() > 1e-9 {
                match write_weight(&dir, version, whole_weight(cores, weighted) * wanted.weight) {
                    Ok(()) => now.weight = wanted.weight,
                    Err(e) => log::warn!("cgroups: the latency guard cannot reweigh {}: {e}", dir.display()),
                }
            }
            if now != Factors::WHOLE && !gone {
                next.insert(ks, now);
            }
        }
        self.guard = next;
    }
}
