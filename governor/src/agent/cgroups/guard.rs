//! The latency guard's hand on the rule keyspaces' cgroups: their weight
//! and cap scaled by the factor the policy holds for each keyspace; and
//! the cap made up for what a keyspace's processes ran outside its cgroup.

use super::Enforcer;
use super::files::{Factors, whole_weight, write_cap, write_weight};
use std::collections::HashMap;
use std::time::Instant;

/// The latency guard rewrites a cap at most once per this many bandwidth
/// periods: a write's refill then adds at most a quarter of the cap.
/// Weights, which refill nothing, follow it at every step.
const GUARD_PERIODS: u64 = 4;

/// What a capped keyspace ran outside its cgroup is made up for by a factor
/// on the cgroup's quota. A process is moved in once the agent has decided
/// its exec report, and the kernel's move waits for an RCU grace period
/// when no move came just before (cgroup_threadgroup_rwsem): 0.3 ms to
/// 20 ms here, so a program run in a loop, a few ms each, does a share of
/// its work outside. The keyspace's charge is exact wherever it ran: it is
/// held against the cap like a bucket, credited the cap and debited the
/// charge at each step, never above `OUTSIDE_MARGIN_PERIODS` periods' quota
/// (the most a window's edges move a held cap by). A debt past that margin
/// lowers the quota by the debt's share of `OUTSIDE_HORIZON` of the cap, so
/// the processes inside repay what ran outside; it comes back as the debt
/// does. The factor moves by whole `OUTSIDE_STEP`s (each write of a quota
/// refills the period under way), within `OUTSIDE_FLOOR..=1`.
const OUTSIDE_MARGIN_PERIODS: f64 = 2.0;
const OUTSIDE_HORIZON: f64 = 2.0;
const OUTSIDE_STEP: f64 = 0.05;
const OUTSIDE_FLOOR: f64 = 0.1;

/// A capped keyspace's charge at the last step, its credit against the cap
/// (core-seconds, negative: debt) and the factor on its cgroup's quota.
#[derive(Clone, Copy, Debug)]
pub(super) struct Outside {
    at: Instant,
    charged_ns: u64,
    credit: f64,
    pub(super) factor: f64,
}

impl Outside {
    /// One step: `ran` core-seconds charged over `secs` against a cap of
    /// `cap` cores over bandwidth periods of `period` seconds.
    fn step(&mut self, cap: f64, period: f64, secs: f64, ran: f64) {
        let margin = OUTSIDE_MARGIN_PERIODS * cap * period;
        self.credit = (self.credit + cap * secs - ran).min(margin);
        let want = (1.0 + (self.credit + margin) / (cap * OUTSIDE_HORIZON)).clamp(OUTSIDE_FLOOR, 1.0);
        if (want - self.factor).abs() >= OUTSIDE_STEP || (want == 1.0 && self.factor < 1.0) {
            self.factor = want;
        }
    }
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

    /// The factor `keyspace`'s quota is lowered by to make up for what its
    /// processes ran outside its cgroup, while below 1.
    pub(crate) fn outside_factor_of(&self, keyspace: u32) -> Option<f64> {
        self.outside.get(&keyspace).map(|o| o.factor).filter(|&f| f < 1.0 && self.unavailable.is_none())
    }

    /// One step of the correction for `keyspace` (capped at `cap` cores),
    /// whose whole charge is `charged_ns` now.
    fn outside_step(&mut self, keyspace: u32, cap: f64, charged_ns: Option<u64>) -> f64 {
        let now = Instant::now();
        let Some(charged_ns) = charged_ns else { return 1.0 };
        let period = self.settings.period_us as f64 / 1e6;
        let o = self.outside.entry(keyspace).or_insert(Outside { at: now, charged_ns, credit: 0.0, factor: 1.0 });
        let secs = now.duration_since(o.at).as_secs_f64();
        if cap > 0.0 && secs > 0.0 {
            let ran = charged_ns.saturating_sub(o.charged_ns) as f64 / 1e9;
            let was = o.factor;
            (o.at, o.charged_ns) = (now, charged_ns);
            o.step(cap, period, secs, ran);
            // Said when it starts and when it ends; the steps between in
            // the debug log.
            let level = if (was == 1.0) != (o.factor == 1.0) { log::Level::Info } else { log::Level::Debug };
            if o.factor != was {
                log::log!(
                    level,
                    "cgroups: keyspace {keyspace} ran {:.3} cores against its {cap:.2} cap over {secs:.1} s ({:+.3} core-seconds \
                     against it); the cap of its cgroup {} {:.0} % of it{}",
                    ran / secs,
                    o.credit,
                    if o.factor < was { "lowered to" } else { "given back to" },
                    o.factor * 100.0,
                    if o.factor < 1.0 { ", to make up for what its processes ran outside it" } else { "" }
                );
            }
        }
        o.factor
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
    ///
    /// `charged_ns` (keyspace → its whole charge so far) steps the
    /// correction for what ran outside the cgroup ([`Outside`]): the
    /// quota follows the lower of the two factors, the weight the guard's.
    pub(crate) fn guard(&mut self, factors: &HashMap<u32, f64>, charged_ns: &HashMap<u32, u64>) {
        let gone = self.unavailable.is_some();
        self.outside.retain(|k, _| self.settings.caps.contains_key(k));
        if gone && self.guard.is_empty() {
            return;
        }
        let Some((root, version)) = self.hierarchy.clone() else { return };
        let spacing = std::time::Duration::from_micros(self.settings.period_us * GUARD_PERIODS)
            .max(std::time::Duration::from_secs(1));
        let (weighted, period_us) = (self.settings.weighted, self.settings.period_us);
        let mut next = HashMap::new();
        let caps: Vec<(u32, f64)> = self.settings.caps.iter().map(|(&k, &c)| (k, c)).collect();
        for (ks, cores) in caps {
            let want = if gone { 1.0 } else { factors.get(&ks).copied().unwrap_or(1.0).clamp(0.0, 1.0) };
            let outside = if gone { 1.0 } else { self.outside_step(ks, cores, charged_ns.get(&ks).copied()) };
            let had = self.factors(ks);
            let Some(rel) = self.state.created.get(&ks).or_else(|| self.state.in_place.get(&ks).map(|p| &p.rel)) else {
                continue;
            };
            let dir = root.join(rel.trim_start_matches('/'));
            let due = gone || self.guard_written.get(&ks).is_none_or(|t| t.elapsed() >= spacing);
            let wanted = Factors { quota: if due { want.min(outside) } else { had.quota }, weight: want };
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
            if now != had {
                self.note_written(ks);
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
            dirty: false,
            capped_in_place: Default::default(),
            taken_from: Default::default(),
            outside: HashMap::new(),
        }
    }

    /// A cap held inside (each second's charge off by up to a period's
    /// quota, as windows cut periods) is never lowered; one second of
    /// steady work outside lowers it until the processes inside make up for
    /// it, and it comes back once they stop.
    #[test]
    fn what_runs_outside_lowers_the_cap_until_the_whole_holds_it() {
        use super::Outside;
        let (cap, period) = (0.5, 0.25);
        let mut o = Outside { at: Instant::now(), charged_ns: 0, credit: 0.0, factor: 1.0 };
        for i in 0..60 {
            let jitter = if i % 2 == 0 { 0.125 } else { -0.125 };
            o.step(cap, period, 1.0, cap + jitter);
            assert_eq!(o.factor, 1.0, "second {i}: a held cap lowered ({o:?})");
        }
        // 0.2 cores run outside each second; inside, what the factor leaves.
        let mut total = 0.0;
        for _ in 0..30 {
            let ran = cap * o.factor + 0.2;
            total += ran;
            o.step(cap, period, 1.0, ran);
        }
        assert!((0.55..=0.65).contains(&o.factor), "{o:?}");
        let late = cap * o.factor + 0.2;
        assert!((cap * 0.95..=cap * 1.05).contains(&late), "{late} cores with {o:?}");
        assert!(total / 30.0 <= cap * 1.1, "{} cores over the 30 s", total / 30.0);
        // Nothing outside any more: given back within a few seconds.
        for _ in 0..6 {
            o.step(cap, period, 1.0, cap * o.factor);
        }
        assert_eq!(o.factor, 1.0, "{o:?}");
    }

    #[test]
    fn a_refused_quota_leaves_the_cap_whole_and_the_weight_still_follows() {
        let dir = std::env::temp_dir().join(format!("governor-guard-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut e = enforcer(&dir);
        let shares = || std::fs::read_to_string(dir.join("ks/cpu.shares")).unwrap();
        e.guard(&HashMap::from([(7, 0.5)]), &HashMap::new());
        // The quota could not be written: the cap in force is the whole one,
        // and the weight alone is lowered (half of one core's 1024).
        assert_eq!(e.cap_of(7), Some(1.5));
        assert_eq!(e.guard_factor_of(7), Some(0.5));
        assert_eq!(shares(), "512");
        assert!(e.guard_failed.contains(&7), "the refusal is remembered (said once)");
        // Tried again when due, and written once the kernel takes it.
        e.guard_written.insert(7, Instant::now() - Duration::from_secs(2));
        std::fs::remove_dir(dir.join("ks/cpu.cfs_quota_us")).unwrap();
        e.guard(&HashMap::from([(7, 0.4)]), &HashMap::new());
        assert_eq!(std::fs::read_to_string(dir.join("ks/cpu.cfs_quota_us")).unwrap(), "150000");
        assert_eq!(e.cap_of(7), Some(0.6));
        assert_eq!(shares(), "410");
        assert!(e.guard_failed.is_empty(), "a write that took clears the refusal");
        // Whole again: both written back.
        e.guard_written.insert(7, Instant::now() - Duration::from_secs(2));
        e.guard(&HashMap::new(), &HashMap::new());
        assert_eq!(std::fs::read_to_string(dir.join("ks/cpu.cfs_quota_us")).unwrap(), "375000");
        assert_eq!((shares().as_str(), e.guard_factor_of(7)), ("1024", None));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
