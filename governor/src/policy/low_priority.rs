//! Low-priority DAG requests (tenant-cpu-cap.md §5.2, `try_allocate_low_priority_dag_with_burst`).
//!
//! When `low-priority-dag-global-enabled`, a low-priority request first takes from its own
//! bucket (a fraction of the node), then goes through the same cap-aware tenant/global path as
//! any request, with rollback of the low-priority tokens on refusal. Outside tenant-cap mode an
//! unknown keyspace keeps the legacy global-only fallback; in cap mode it still has to pass its
//! tenant cap, so the low-priority path never bypasses the cap.

use std::sync::atomic::Ordering;

use super::error::Refusal;
use super::grant::{Grant, PolicyCounters};
use super::manager::Policy;

impl Policy {
    /// Low-priority DAG request: the low-priority bucket first (when enabled), then the same
    /// cap-aware tenant/global path. Outside cap mode an unknown keyspace uses the legacy
    /// global-only fallback; in cap mode it still has to pass its tenant cap.
    pub fn allocate_low_priority(
        &self,
        keyspace: u32,
        estimate_us: Option<u64>,
        now_us: u64,
    ) -> Result<Grant, Refusal> {
        if !self.knobs.low_priority_enabled.load(Ordering::Relaxed) {
            return self.allocate(keyspace, estimate_us, now_us);
        }
        let entry = self.lookup(keyspace, now_us);
        let est = estimate_us
            .or_else(|| entry.as_ref().map(|e| e.estimate_us()))
            .unwrap_or_else(|| self.knobs.default_estimate_us.load(Ordering::Relaxed))
            .max(1);
        if !self.low_priority.try_take(est) {
            PolicyCounters::inc(&self.counters.low_priority_exhausted);
            return Err(Refusal::LowPriorityCpuExhausted { keyspace });
        }
        let result = match entry {
            Some(entry) => self.allocate_entry(entry, Some(est), now_us),
            None => self.global_only(keyspace, est),
        };
        match result {
            Ok(mut g) => {
                if g.global_us < est {
                    self.low_priority.rollback(est - g.global_us);
                }
                g.low_priority_us = g.global_us.min(est);
                Ok(g)
            }
            Err(r) => {
                self.low_priority.rollback(est);
                Err(r)
            }
        }
    }

    fn global_only(&self, keyspace: u32, us: u64) -> Result<Grant, Refusal> {
        if !self.global.try_take(us) {
            if self.knobs.enforce_global.load(Ordering::Relaxed) {
                PolicyCounters::inc(&self.counters.global_exhausted);
                return Err(Refusal::GlobalCpuExhausted { keyspace });
            }
            self.global.force_take(us);
            PolicyCounters::inc(&self.counters.global_best_effort_overdraft);
        }
        PolicyCounters::inc(&self.counters.granted);
        Ok(Grant {
            keyspace,
            entry: None,
            tenant_us: 0,
            global_us: us,
            burst_us: 0,
            low_priority_us: 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::settings::Settings;
    use super::*;

    #[test]
    fn disabled_low_priority_is_a_plain_allocation() {
        let p = Policy::new(Settings::essential(8.0, 0.4), 0).unwrap();
        let g = p.allocate_low_priority(1, Some(100), 0).unwrap();
        assert_eq!((g.low_priority_us(), g.tenant_us()), (0, 100));
        assert_eq!(p.low_priority_bucket().inflight_us(), 0);
        p.release(g, 100);
    }

    #[test]
    fn exhausted_low_priority_bucket_refuses_before_tenant_and_global() {
        let s = Settings {
            low_priority_dag_global_enabled: true,
            low_priority_dag_cpu_ratio: 0.01, // 800 µs per 10 ms, capacity 8_000
            ..Settings::essential(8.0, 0.4)
        };
        let p = Policy::new(s, 0).unwrap();
        let err = p.allocate_low_priority(1, Some(9_000), 0).unwrap_err();
        assert_eq!(err, Refusal::LowPriorityCpuExhausted { keyspace: 1 });
        assert_eq!(p.counters().low_priority_exhausted, 1);
        assert_eq!(p.global_bucket().inflight_us(), 0, "global untouched");
    }
}
