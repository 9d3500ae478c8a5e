//! Read-only views of [`Policy`] and its serializable state for status and metrics.

use serde::Serialize;

use super::admission::AdmissionCounters;
use super::bucket::BucketSnapshot;
use super::grant::PolicyCountersSnapshot;
use super::keyspace::{KeyspaceEntry, QuotaSource};
use super::manager::Policy;
use super::settings::Settings;
use super::write_quota::PendingWritesSnapshot;
use super::{admission::TenantAdmission, bucket::BucketCell, write_quota::PendingWrites};
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// One keyspace, as exported.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KeyspaceSnapshot {
    pub keyspace: u32,
    pub source: QuotaSource,
    pub available_us: i64,
    pub capacity_us: i64,
    pub refill_us: u64,
    pub base_refill_us: u64,
    pub inflight_us: u64,
    /// Outstanding debt, µs (`max(0, −available)`).
    pub debt_us: u64,
    pub in_debt_mode: bool,
    pub ratio: f64,
    pub estimate_us: u64,
    pub burst_enabled: bool,
    pub burst_allowed: bool,
    pub last_used_us: u64,
    pub granted: u64,
    pub refused_keyspace: u64,
    pub refused_global: u64,
    pub burst_granted: u64,
    pub burst_tokens_us: u64,
    pub topups_granted: u64,
    pub topups_refused: u64,
    pub fair_allocations: u64,
    pub consumed_us: u64,
    pub released: u64,
    pub bucket: BucketSnapshot,
}

impl KeyspaceSnapshot {
    pub fn of(e: &KeyspaceEntry) -> Self {
        let b = e.bucket().snapshot();
        let c = e.counters();
        let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        KeyspaceSnapshot {
            keyspace: e.id(),
            source: e.source(),
            available_us: b.available_us,
            capacity_us: b.capacity_us,
            refill_us: b.refill_us,
            base_refill_us: b.base_refill_us,
            inflight_us: b.inflight_us,
            debt_us: (-b.available_us).max(0) as u64,
            in_debt_mode: b.in_debt,
            ratio: e.ratio(),
            estimate_us: e.estimate_us(),
            burst_enabled: e.burst_enabled(),
            burst_allowed: e.burst_allowed(),
            last_used_us: e.last_used_us(),
            granted: l(&c.granted),
            refused_keyspace: l(&c.refused_keyspace),
            refused_global: l(&c.refused_global),
            burst_granted: l(&c.burst_granted),
            burst_tokens_us: l(&c.burst_tokens_us),
            topups_granted: l(&c.topups_granted),
            topups_refused: l(&c.topups_refused),
            fair_allocations: l(&c.fair_allocations),
            consumed_us: l(&c.consumed_us),
            released: l(&c.released),
            bucket: b,
        }
    }
}

/// The whole policy, as exported (keyspaces sorted by id).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicySnapshot {
    pub global: BucketSnapshot,
    pub low_priority: BucketSnapshot,
    pub global_ratio: f64,
    pub tenant_max_cpu_ratio: f64,
    pub tenant_cap_refill_us: u64,
    pub tenant_cap_idle_ttl_us: u64,
    pub burst_budget_us: i64,
    pub counters: PolicyCountersSnapshot,
    pub keyspaces: Vec<KeyspaceSnapshot>,
    pub pending_writes: PendingWritesSnapshot,
    pub admission: AdmissionCounters,
}

impl Policy {
    /// Serializable state of everything, for status and metrics.
    pub fn snapshot(&self) -> PolicySnapshot {
        let mut keyspaces: Vec<KeyspaceSnapshot> = self
            .keyspaces
            .iter()
            .map(|e| KeyspaceSnapshot::of(&e))
            .collect();
        keyspaces.sort_by_key(|k| k.keyspace);
        PolicySnapshot {
            global: self.global.snapshot(),
            low_priority: self.low_priority.snapshot(),
            global_ratio: self.global_ratio(),
            tenant_max_cpu_ratio: self.tenant_max_cpu_ratio(),
            tenant_cap_refill_us: self.tenant_cap_refill_us(),
            tenant_cap_idle_ttl_us: self.tenant_cap_idle_ttl_us(),
            burst_budget_us: self.burst_budget_us.load(Ordering::Relaxed),
            counters: self.counters(),
            keyspaces,
            pending_writes: self.writes.snapshot(),
            admission: self.admission.counters(),
        }
    }

    /// Pending write bytes (scheduler side).
    pub fn pending_writes(&self) -> &PendingWrites {
        &self.writes
    }

    /// Tenant concurrency admission control.
    pub fn admission(&self) -> &TenantAdmission {
        &self.admission
    }

    /// The global bucket (read-only view).
    pub fn global_bucket(&self) -> &BucketCell {
        &self.global
    }

    /// The low-priority DAG bucket (read-only view).
    pub fn low_priority_bucket(&self) -> &BucketCell {
        &self.low_priority
    }

    /// A keyspace's entry, if it has a bucket.
    pub fn keyspace(&self, keyspace: u32) -> Option<Arc<KeyspaceEntry>> {
        self.keyspaces.get(&keyspace).map(|e| e.clone())
    }

    /// Number of keyspaces with buckets.
    pub fn keyspace_count(&self) -> usize {
        self.keyspaces.len()
    }

    /// Counters by outcome. `granted` / `released` are kept per keyspace on the fast path (no
    /// node-wide shared counter line); this sums them with those of removed keyspaces.
    pub fn counters(&self) -> PolicyCountersSnapshot {
        let mut c = self.counters.snapshot();
        for e in self.keyspaces.iter() {
            c.granted += e.counters.granted.load(Ordering::Relaxed);
            c.released += e.counters.released.load(Ordering::Relaxed);
        }
        c
    }

    /// Folds a removed keyspace's monotonic counters into the node-wide ones.
    pub(crate) fn retire(&self, e: &KeyspaceEntry) {
        self.counters.granted.fetch_add(
            e.counters.granted.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
        self.counters.released.fetch_add(
            e.counters.released.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
    }

    /// Removes a keyspace if `pred` holds for it, retiring its counters. True if removed.
    pub(crate) fn remove_keyspace_if(
        &self,
        ks: u32,
        pred: impl FnOnce(&KeyspaceEntry) -> bool,
    ) -> bool {
        match self.keyspaces.remove_if(&ks, |_, e| pred(e)) {
            Some((_, e)) => {
                self.retire(&e);
                true
            }
            None => false,
        }
    }

    /// The next refill boundary, µs of the simulated clock: a refused caller waits until then
    /// (or its deadline) and retries; refunds do not wake waiters early.
    pub fn next_refill_at_us(&self) -> u64 {
        self.knobs.next_refill_at_us.load(Ordering::Acquire)
    }

    /// Global ratio of the monitor window, as published to the fast path.
    pub fn global_ratio(&self) -> f64 {
        f64::from_bits(self.knobs.global_ratio_bits.load(Ordering::Relaxed))
    }

    /// Current `tenant-max-cpu-ratio`.
    pub fn tenant_max_cpu_ratio(&self) -> f64 {
        f64::from_bits(self.knobs.cap_ratio_bits.load(Ordering::Relaxed))
    }

    /// Uniform cap per refill interval, µs (0 = cap mode off).
    pub fn tenant_cap_refill_us(&self) -> u64 {
        self.knobs.cap_refill_us.load(Ordering::Relaxed)
    }

    /// A copy of the running settings.
    pub fn settings(&self) -> Settings {
        self.settings.lock().expect("settings lock").clone()
    }
}
