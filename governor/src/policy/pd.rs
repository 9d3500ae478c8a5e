//! PD service-limit quotas from fetched values (no HTTP here: the caller fetches).
//!
//! `quota_i = global_refill_us × limit_i / Σ limits > 0` (µs per refill interval, the unit of
//! every keyspace quota). The seed writes `global_capacity_us` because, when it was written, the
//! global capacity *was* one refill interval's budget (`cores × max-read-cpu-ratio ×
//! refill-interval`); since `burst-window` decoupled capacity from refill, the per-interval
//! global budget is the quantity that keeps Σ quotas equal to the global rate. A limit of 0 means unlimited: the quota is removed, unless
//! `pd-override-config = false` and a static config quota exists, which then stays. A new quota
//! is applied only when its relative change exceeds `pd-service-limit-update-threshold`. A 404
//! removes a keyspace only after `pd-service-limit-consecutive-404` 404s in a row or after
//! `pd-service-limit-ttl` without a successful value. While PD is unreachable nothing changes,
//! and that time does not count towards the TTL: a keyspace is not dropped the moment PD returns
//! because PD was away.

use std::collections::BTreeMap;

use serde::Serialize;

/// One keyspace's answer from PD.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PdLimit {
    /// `service_limit` in RU/s (only ratios matter); 0 = unlimited.
    Limit(f64),
    /// PD answered 404 for this keyspace.
    NotFound,
    /// PD says the keyspace is archived or tombstoned: it leaves tracking
    /// and its PD quota goes at once.
    Gone,
}

/// The result of one fetch round.
#[derive(Debug, Clone, PartialEq)]
pub enum PdFetch {
    /// PD could not be reached: keep the last quotas.
    Unreachable,
    /// Answers per keyspace; keyspaces not listed were not asked this round.
    Fetched(BTreeMap<u32, PdLimit>),
}

/// A change the tracker decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum PdAction {
    Set { keyspace: u32, quota_us: u64 },
    Remove { keyspace: u32 },
}

#[derive(Debug, Clone, Copy)]
struct Tracked {
    limit: f64,
    /// PD's last value was 0: unlimited, which overrides a static quota too
    /// while `pd-override-config` is on.
    unlimited: bool,
    /// A removal was reported for `unlimited`, so the keyspace's source is
    /// decided again once, not every round.
    announced_unlimited: bool,
    applied_us: Option<u64>,
    consecutive_404: u32,
    last_ok_us: u64,
}

/// One keyspace as the tracker holds it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PdTracked {
    pub keyspace: u32,
    /// Last `service_limit` PD gave (0: unlimited, or never answered).
    pub service_limit: f64,
    /// PD quota applied, µs per refill interval.
    pub quota_us: Option<u64>,
    pub consecutive_404: u32,
    /// When PD last gave a value, policy µs.
    pub last_ok_us: u64,
}

/// Parameters of a PD round.
#[derive(Debug, Clone, Copy)]
pub struct PdParams {
    /// Global refill per interval, µs.
    pub global_refill_us: u64,
    pub update_threshold: f64,
    pub consecutive_404: u32,
    pub ttl_us: u64,
}

/// Per-keyspace PD state across rounds.
#[derive(Debug, Default)]
pub struct PdTracker {
    tracked: BTreeMap<u32, Tracked>,
    /// Since when no round reached PD: that time does not count towards
    /// anyone's TTL.
    unreachable_since_us: Option<u64>,
}

impl PdTracker {
    /// Folds one fetch round into the state and returns the quota changes to apply.
    pub fn update(&mut self, now_us: u64, fetch: &PdFetch, p: PdParams) -> Vec<PdAction> {
        let PdFetch::Fetched(answers) = fetch else {
            self.unreachable_since_us.get_or_insert(now_us);
            return Vec::new();
        };
        if let Some(since) = self.unreachable_since_us.take() {
            let outage = now_us.saturating_sub(since);
            for t in self.tracked.values_mut() {
                t.last_ok_us = t.last_ok_us.saturating_add(outage).min(now_us);
            }
        }
        let mut actions = Vec::new();
        for (&ks, answer) in answers {
            if *answer == PdLimit::Gone {
                if let Some(t) = self.tracked.remove(&ks)
                    && (t.applied_us.is_some() || t.unlimited)
                {
                    actions.push(PdAction::Remove { keyspace: ks });
                }
                continue;
            }
            let t = self.tracked.entry(ks).or_insert(Tracked {
                limit: 0.0,
                unlimited: false,
                announced_unlimited: false,
                applied_us: None,
                consecutive_404: 0,
                last_ok_us: now_us,
            });
            match *answer {
                PdLimit::Limit(v) => {
                    t.limit = v.max(0.0);
                    t.unlimited = t.limit == 0.0;
                    t.consecutive_404 = 0;
                    t.last_ok_us = now_us;
                }
                PdLimit::NotFound => t.consecutive_404 += 1,
                PdLimit::Gone => unreachable!("handled above"),
            }
        }
        let expired: Vec<u32> = self
            .tracked
            .iter()
            .filter(|(_, t)| {
                t.consecutive_404 >= p.consecutive_404.max(1) || now_us.saturating_sub(t.last_ok_us) >= p.ttl_us
            })
            .map(|(&ks, _)| ks)
            .collect();
        for ks in expired {
            if let Some(t) = self.tracked.remove(&ks)
                && (t.applied_us.is_some() || t.unlimited)
            {
                actions.push(PdAction::Remove { keyspace: ks });
            }
        }
        let sum: f64 = self.tracked.values().filter(|t| t.limit > 0.0).map(|t| t.limit).sum();
        for (&ks, t) in self.tracked.iter_mut() {
            if t.limit <= 0.0 {
                if t.applied_us.take().is_some() || (t.unlimited && !t.announced_unlimited) {
                    actions.push(PdAction::Remove { keyspace: ks });
                }
                t.announced_unlimited = t.unlimited;
                continue;
            }
            let quota = (p.global_refill_us as f64 * t.limit / sum) as u64;
            let apply = match t.applied_us {
                None => true,
                Some(old) => old == 0 || (quota as f64 - old as f64).abs() / old as f64 > p.update_threshold,
            };
            if apply {
                t.applied_us = Some(quota);
                actions.push(PdAction::Set { keyspace: ks, quota_us: quota });
            }
        }
        actions
    }

    /// Every tracked keyspace, in id order.
    pub fn tracked(&self) -> Vec<PdTracked> {
        self.tracked
            .iter()
            .map(|(&keyspace, t)| PdTracked {
                keyspace,
                service_limit: t.limit,
                quota_us: t.applied_us,
                consecutive_404: t.consecutive_404,
                last_ok_us: t.last_ok_us,
            })
            .collect()
    }

    /// PD's last word on the keyspace was "unlimited" (`service_limit = 0`).
    pub fn unlimited(&self, keyspace: u32) -> bool {
        self.tracked.get(&keyspace).is_some_and(|t| t.unlimited)
    }

    /// Every quota currently applied, µs per refill interval.
    pub fn applied(&self) -> impl Iterator<Item = u64> + '_ {
        self.tracked.values().filter_map(|t| t.applied_us)
    }

    /// The quota currently applied for a keyspace, µs per refill interval.
    pub fn applied_us(&self, keyspace: u32) -> Option<u64> {
        self.tracked.get(&keyspace).and_then(|t| t.applied_us)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> PdParams {
        PdParams { global_refill_us: 10_000, update_threshold: 0.01, consecutive_404: 3, ttl_us: 1_000_000 }
    }

    #[test]
    fn proportional_quotas_and_threshold() {
        let mut t = PdTracker::default();
        let f = PdFetch::Fetched(BTreeMap::from([(1, PdLimit::Limit(300.0)), (2, PdLimit::Limit(100.0))]));
        let a = t.update(0, &f, params());
        assert_eq!(
            a,
            vec![PdAction::Set { keyspace: 1, quota_us: 7500 }, PdAction::Set { keyspace: 2, quota_us: 2500 }]
        );
        // 0.5 % change: below the 1 % threshold, nothing applied.
        let f = PdFetch::Fetched(BTreeMap::from([(1, PdLimit::Limit(301.5)), (2, PdLimit::Limit(100.0))]));
        assert!(t.update(10, &f, params()).is_empty());
        // Archived: gone at once, and the other keyspace takes the whole budget.
        let f = PdFetch::Fetched(BTreeMap::from([(1, PdLimit::Gone), (2, PdLimit::Limit(100.0))]));
        assert_eq!(
            t.update(20, &f, params()),
            vec![PdAction::Remove { keyspace: 1 }, PdAction::Set { keyspace: 2, quota_us: 10_000 }]
        );
        assert_eq!(t.tracked().len(), 1);
    }
}
