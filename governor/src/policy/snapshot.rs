//! Read-only views of [`Policy`] and its serializable state for status,
//! metrics and tests.

use std::sync::atomic::Ordering;

use keyspace_governor_common::admission::counter;
use serde::Serialize;

use super::AdmissionMode;
use super::keyspace::{BucketSnapshot, KeyspaceCounters, KeyspaceEntry, QuotaSource};
use super::manager::Policy;
use crate::region::{GLOBAL, LOW_PRIORITY, OVERFLOW};

/// One keyspace with a bucket, as exported.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KeyspaceSnapshot {
    pub keyspace: u32,
    pub cell: u32,
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
    pub fair_allocations: u64,
    pub inflight_requests: u64,
    pub pending_write_bytes: u64,
    pub counters: KeyspaceCounters,
    pub bucket: BucketSnapshot,
}

/// Node-wide counters by outcome: the `reason` labels of the allocation
/// metrics. Sums over every keyspace cell, including given-up ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PolicyCountersSnapshot {
    pub granted: u64,
    pub skipped: u64,
    pub burst_granted: u64,
    pub tenant_cap_exhausted: u64,
    pub keyspace_exhausted: u64,
    pub global_exhausted: u64,
    pub low_priority_exhausted: u64,
    pub global_best_effort_overdraft: u64,
    pub topup_granted: u64,
    pub topup_refused: u64,
    pub cap_buckets_created: u64,
    pub cap_buckets_evicted: u64,
    pub released: u64,
    pub write_refused_global: u64,
    pub write_refused_keyspace: u64,
    pub concurrency_refused: u64,
    pub concurrency_monitor_breaches: u64,
    pub waited: u64,
    pub fail_open: u64,
    pub reclaimed: u64,
}

/// Pending write bytes, node-wide.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PendingWritesSnapshot {
    pub global_threshold_bytes: u64,
    pub keyspace_threshold_bytes: u64,
    pub global_bytes: u64,
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
    pub admission_mode: AdmissionMode,
    pub max_concurrent_per_tenant: u64,
    pub counters: PolicyCountersSnapshot,
    pub pending_writes: PendingWritesSnapshot,
    pub keyspaces: Vec<KeyspaceSnapshot>,
    pub overflow: OverflowSnapshot,
    /// Keyspaces under their fair share that waited past the latency
    /// guard's target in its last step, mostly behind the keyspaces above
    /// it (those are being lowered), ascending.
    pub latency_guard_suffering: Vec<u32>,
    /// The same past the target mostly behind something else (an idle CPU,
    /// tasks governor does not measure): nobody is lowered for them.
    pub latency_guard_waiting_elsewhere: Vec<u32>,
    /// The keyspaces the guard holds below their share, with the factor on
    /// their refill ([`Policy::guard_factors`]).
    pub latency_guard_factors: Vec<(u32, f64)>,
    /// Every keyspace with CPU in the monitor window, its ratio (the
    /// global ratio's denominator), whether it has a bucket or not.
    pub keyspace_ratios: Vec<(u32, f64)>,
}

/// The overflow bucket: what holds keyspaces without a cell.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OverflowSnapshot {
    /// What it is held to (`None`: no CPU bucket, only the request limits).
    pub source: Option<QuotaSource>,
    pub bucket: BucketSnapshot,
    pub inflight_requests: u64,
    pub pending_write_bytes: u64,
    pub counters: KeyspaceCounters,
}

impl Policy {
    /// Serializable state of everything, for status and metrics.
    pub fn snapshot(&self) -> PolicySnapshot {
        let s = self.settings();
        let r = self.regions();
        let mut keyspaces: Vec<KeyspaceSnapshot> = self
            .keyspace_entries()
            .into_iter()
            .map(|e| {
                let (b, _) = r.keyspace_cell(e.cell).expect("live cell");
                KeyspaceSnapshot {
                    keyspace: e.id(),
                    cell: e.cell,
                    source: e.source(),
                    available_us: e.bucket.available_us,
                    capacity_us: e.bucket.capacity_us,
                    refill_us: e.bucket.refill_us,
                    base_refill_us: e.bucket.base_refill_us,
                    inflight_us: e.bucket.inflight_us,
                    // Overdrawn tokens, and in shrink debt what is in
                    // flight above the new quota (the seed's debt state).
                    debt_us: (-e.bucket.available_us).max(0) as u64
                        + if e.bucket.in_debt {
                            e.bucket.inflight_us.saturating_sub(e.bucket.base_refill_us)
                        } else {
                            0
                        },
                    in_debt_mode: e.bucket.in_debt,
                    ratio: e.ratio(),
                    estimate_us: e.estimate_us(),
                    burst_enabled: e.burst_enabled(),
                    burst_allowed: e.burst_allowed(),
                    fair_allocations: e.fair_allocations(),
                    inflight_requests: b.inflight_requests.load(Ordering::Relaxed),
                    pending_write_bytes: b.pending_write_bytes.load(Ordering::Relaxed),
                    counters: e.counters,
                    bucket: e.bucket,
                }
            })
            .collect();
        keyspaces.sort_by_key(|k| k.keyspace);
        let threshold = s.pending_write_threshold_bytes();
        let (latency_guard_suffering, latency_guard_waiting_elsewhere, keyspace_ratios) = {
            let e = self.engine();
            (e.guard.suffering.clone(), e.guard.waiting_elsewhere.clone(), e.window.keyspace_ratios().collect())
        };
        PolicySnapshot {
            global: self.global_bucket(),
            low_priority: self.low_priority_bucket(),
            global_ratio: self.global_ratio(),
            tenant_max_cpu_ratio: s.throttle().tenant_max_cpu_ratio,
            tenant_cap_refill_us: s.tenant_cap_refill_us(s.throttle().tenant_max_cpu_ratio).unwrap_or(0),
            tenant_cap_idle_ttl_us: s.tenant_cap_idle_ttl_us(),
            burst_budget_us: r.bucket(GLOBAL).burst_budget_us.load(Ordering::Relaxed),
            admission_mode: s.admission.mode,
            max_concurrent_per_tenant: s.max_concurrent_per_tenant(),
            counters: self.counters(),
            pending_writes: PendingWritesSnapshot {
                global_threshold_bytes: threshold,
                keyspace_threshold_bytes: (threshold as f64 * super::admit::KEYSPACE_PENDING_WRITE_RATIO) as u64,
                global_bytes: r.bucket(GLOBAL).pending_write_bytes.load(Ordering::Relaxed),
            },
            keyspaces,
            overflow: self.overflow(),
            latency_guard_suffering,
            latency_guard_waiting_elsewhere,
            latency_guard_factors: self.guard_factors(),
            keyspace_ratios,
        }
    }

    /// The global bucket.
    pub fn global_bucket(&self) -> BucketSnapshot {
        BucketSnapshot::of(self.regions().bucket(GLOBAL), &self.engine().global)
    }

    /// The overflow bucket.
    pub fn overflow(&self) -> OverflowSnapshot {
        let s = self.settings();
        let e = self.engine();
        let b = self.regions().bucket(OVERFLOW);
        OverflowSnapshot {
            source: self.overflow_source(&e, &s).map(|x| x.0),
            bucket: BucketSnapshot::of(b, &e.overflow),
            inflight_requests: b.inflight_requests.load(Ordering::Relaxed),
            pending_write_bytes: b.pending_write_bytes.load(Ordering::Relaxed),
            counters: KeyspaceCounters::of(b),
        }
    }

    /// The low-priority DAG bucket.
    pub fn low_priority_bucket(&self) -> BucketSnapshot {
        BucketSnapshot::of(self.regions().bucket(LOW_PRIORITY), &self.engine().low_priority)
    }

    /// Every keyspace with a bucket.
    pub fn keyspace_entries(&self) -> Vec<KeyspaceEntry> {
        let r = self.regions();
        let e = self.engine();
        e.cells
            .iter()
            .enumerate()
            .filter_map(|(c, st)| {
                let st = st.as_ref().filter(|st| st.source.is_some())?;
                let (b, _) = r.keyspace_cell(c as u32)?;
                Some(KeyspaceEntry::read(st, c as u32, b))
            })
            .collect()
    }

    /// A keyspace's entry, if it has a bucket.
    pub fn keyspace(&self, keyspace: u32) -> Option<KeyspaceEntry> {
        let c = self.regions().directory().find(keyspace)?.index;
        let e = self.engine();
        let st = e.cells.get(c as usize)?.as_ref().filter(|st| st.source.is_some() && st.id == keyspace)?;
        let (b, _) = self.regions().keyspace_cell(c)?;
        Some(KeyspaceEntry::read(st, c, b))
    }

    /// Number of keyspaces with buckets.
    pub fn keyspace_count(&self) -> usize {
        self.engine().cells.iter().flatten().filter(|st| st.source.is_some()).count()
    }

    /// Keyspace cells in use (with or without a bucket).
    pub fn cells_in_use(&self) -> usize {
        self.engine().cells.iter().flatten().count()
    }

    /// Counters by outcome, summed over every cell (live and given up).
    pub fn counters(&self) -> PolicyCountersSnapshot {
        let r = self.regions();
        let e = self.engine();
        let mut sum = e.retired;
        for (c, st) in e.cells.iter().enumerate() {
            if st.is_none() {
                continue;
            }
            let Some((b, _)) = r.keyspace_cell(c as u32) else { continue };
            for (i, v) in b.counter_values().into_iter().enumerate() {
                sum[i] += v;
            }
        }
        // Keyspaces without a cell count into the overflow bucket.
        for (i, v) in r.bucket(OVERFLOW).counter_values().into_iter().enumerate() {
            sum[i] += v;
        }
        let g = r.bucket(GLOBAL);
        let low = r.bucket(LOW_PRIORITY);
        let gc = |i: usize| g.counter(i);
        PolicyCountersSnapshot {
            granted: sum[counter::GRANTED] + gc(counter::GRANTED),
            skipped: sum[counter::SKIPPED] + gc(counter::SKIPPED),
            burst_granted: sum[counter::BURST_GRANTED],
            tenant_cap_exhausted: sum[counter::REFUSED_CAP],
            keyspace_exhausted: sum[counter::REFUSED_QUOTA],
            global_exhausted: sum[counter::REFUSED_GLOBAL] + gc(counter::REFUSED_GLOBAL),
            low_priority_exhausted: low.counter(counter::REFUSED_GLOBAL),
            global_best_effort_overdraft: gc(counter::OVERDRAFT),
            topup_granted: sum[counter::TOPUP_GRANTED] + gc(counter::TOPUP_GRANTED),
            topup_refused: sum[counter::TOPUP_REFUSED] + gc(counter::TOPUP_REFUSED),
            cap_buckets_created: e.cap_buckets_created,
            cap_buckets_evicted: e.cap_buckets_evicted,
            released: sum[counter::RELEASED] + gc(counter::RELEASED),
            write_refused_global: gc(counter::REFUSED_WRITE_GLOBAL),
            write_refused_keyspace: sum[counter::REFUSED_WRITE_KEYSPACE],
            concurrency_refused: sum[counter::REFUSED_CONCURRENCY],
            concurrency_monitor_breaches: sum[counter::MONITOR_BREACHES],
            waited: sum[counter::WAITED] + gc(counter::WAITED),
            fail_open: sum[counter::FAIL_OPEN] + gc(counter::FAIL_OPEN),
            reclaimed: sum[counter::RECLAIMED] + gc(counter::RECLAIMED),
        }
    }

    /// The monitor window's span and each keyspace's CPU in it, µs.
    pub fn window_cpu(&self) -> (u64, std::collections::HashMap<u32, u64>) {
        let e = self.engine();
        (e.window.span_us(), e.window.keyspace_cpu_us().clone())
    }

    /// The next refill boundary, µs.
    pub fn next_refill_at_us(&self) -> u64 {
        self.engine().next_refill_at_us
    }

    /// Global ratio of the monitor window.
    pub fn global_ratio(&self) -> f64 {
        self.engine().global_ratio
    }

    /// Current `tenant-max-cpu-ratio`.
    pub fn tenant_max_cpu_ratio(&self) -> f64 {
        self.settings().throttle().tenant_max_cpu_ratio
    }

    /// Uniform cap per refill interval, µs (0 = cap mode off).
    pub fn tenant_cap_refill_us(&self) -> u64 {
        let s = self.settings();
        s.tenant_cap_refill_us(s.throttle().tenant_max_cpu_ratio).unwrap_or(0)
    }

    /// Requests of `keyspace` counted in flight (admission control).
    pub fn inflight_requests(&self, keyspace: u32) -> u64 {
        self.regions()
            .directory()
            .find(keyspace)
            .and_then(|c| self.regions().keyspace_cell(c.index))
            .map_or(0, |(b, _)| b.inflight_requests.load(Ordering::Relaxed))
    }

    /// Pending write bytes of `keyspace`.
    pub fn pending_write_bytes(&self, keyspace: u32) -> u64 {
        self.regions()
            .directory()
            .find(keyspace)
            .and_then(|c| self.regions().keyspace_cell(c.index))
            .map_or(0, |(b, _)| b.pending_write_bytes.load(Ordering::Relaxed))
    }
}
