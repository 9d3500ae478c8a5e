//! [`Policy`]: the bucket set and the fast path (allocate, top-up, release).
//!
//! Allocation order (tenant-cpu-cap.md §3.2): keyspace (tenant) bucket, then global bucket, with
//! rollback of the tenant tokens when the global bucket refuses. When the tenant bucket refuses,
//! a quota'd keyspace may burst on global tokens (never in tenant-cap mode). The fast path does one
//! table lookup (a sharded-map read; a grant keeps its entry, so release and top-up do none), a
//! few CAS operations on the buckets' plain atomics and counter increments: no allocation (except
//! the first request of a keyspace in tenant-cap mode), no mutex, no clock read. The token
//! operations themselves (take, refund, charge debt) are lock-free on [`BucketCell`]. The agent
//! side lives in `agent.rs`.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::agent::AgentState;
use super::bucket::BucketCell;
use super::error::{Refusal, SettingsError};
use super::estimate::static_estimate_us;
use super::grant::{Grant, PolicyCounters};
use super::keyspace::{KeyspaceEntry, KeyspaceTable, QuotaSource};
use super::settings::{Settings, millicores_to_us_per_interval};
use super::{admission::TenantAdmission, write_quota::PendingWrites};

/// Settings the fast path reads, as atomics (hot-updatable without locks).
#[derive(Debug, Default)]
pub(crate) struct Knobs {
    pub enforce_global: AtomicBool,
    pub enable_burst: AtomicBool,
    pub runtime_token_management: AtomicBool,
    pub low_priority_enabled: AtomicBool,
    /// Count requested µs per keyspace (the demand input of fair allocation).
    pub track_demand: AtomicBool,
    pub default_estimate_us: AtomicU64,
    /// `tenant-max-cpu-ratio` (f64 bits).
    pub cap_ratio_bits: AtomicU64,
    /// Uniform cap per refill interval, µs; 0 = cap mode off.
    pub cap_refill_us: AtomicU64,
    pub cap_capacity_us: AtomicU64,
    pub cap_idle_ttl_us: AtomicU64,
    /// Global ratio of the monitor window (f64 bits).
    pub global_ratio_bits: AtomicU64,
    /// Simulated time of the next refill boundary, µs (where a refused caller should retry).
    pub next_refill_at_us: AtomicU64,
}

/// The policy engine. Share it (`Arc<Policy>`): the fast path takes `&self` on any thread; the
/// agent loop calls [`Policy::tick`] from one thread.
#[derive(Debug)]
pub struct Policy {
    pub(crate) settings: Mutex<Settings>,
    pub(crate) knobs: Knobs,
    pub(crate) global: BucketCell,
    pub(crate) low_priority: BucketCell,
    /// Burst tokens left this refill interval (≤ one global refill), µs.
    pub(crate) burst_budget_us: AtomicI64,
    pub(crate) keyspaces: KeyspaceTable,
    pub(crate) counters: PolicyCounters,
    pub(crate) writes: PendingWrites,
    pub(crate) admission: TenantAdmission,
    pub(crate) agent: Mutex<AgentState>,
}

impl Policy {
    /// Builds the policy from validated settings. Buckets start full; the simulated clock starts
    /// at `now_us`.
    pub fn new(settings: Settings, now_us: u64) -> Result<Policy, SettingsError> {
        settings.validate()?;
        let global_refill = settings.global_refill_us();
        let low_refill = settings.low_priority_refill_us();
        let policy = Policy {
            knobs: Knobs::default(),
            global: BucketCell::new(global_refill, settings.capacity_for(global_refill)),
            low_priority: BucketCell::new(low_refill, settings.capacity_for(low_refill)),
            burst_budget_us: AtomicI64::new(global_refill as i64),
            keyspaces: KeyspaceTable::default(),
            counters: PolicyCounters::default(),
            writes: PendingWrites::new(settings.pending_write_threshold_bytes),
            admission: TenantAdmission::new(
                settings.admission_mode,
                settings.max_concurrent_per_tenant,
            ),
            agent: Mutex::new(AgentState::new(&settings, now_us)),
            settings: Mutex::new(settings.clone()),
        };
        policy.store_knobs(&settings);
        policy
            .knobs
            .next_refill_at_us
            .store(now_us + settings.refill_interval_us, Ordering::Release);
        for (&ks, &mc) in &settings.keyspace_cpu_quotas_millicores {
            policy.upsert_quota(
                ks,
                millicores_to_us_per_interval(mc, settings.refill_interval_us),
                QuotaSource::Config,
                &settings,
                now_us,
            );
        }
        Ok(policy)
    }

    pub(crate) fn store_knobs(&self, s: &Settings) {
        let k = &self.knobs;
        k.enforce_global
            .store(s.enforce_global_limit, Ordering::Release);
        k.enable_burst.store(
            s.enable_burst && s.tenant_max_cpu_ratio <= 0.0,
            Ordering::Release,
        );
        k.runtime_token_management
            .store(s.enable_runtime_token_management, Ordering::Release);
        k.low_priority_enabled
            .store(s.low_priority_dag_global_enabled, Ordering::Release);
        k.track_demand
            .store(s.enable_fair_allocation, Ordering::Release);
        k.default_estimate_us
            .store(s.estimated_cpu_per_request_us.max(1), Ordering::Release);
        k.cap_ratio_bits
            .store(s.tenant_max_cpu_ratio.to_bits(), Ordering::Release);
        let cap = s.tenant_cap_refill_us(s.tenant_max_cpu_ratio).unwrap_or(0);
        k.cap_refill_us.store(cap, Ordering::Release);
        k.cap_capacity_us
            .store(s.capacity_for(cap), Ordering::Release);
        k.cap_idle_ttl_us
            .store(s.tenant_cap_idle_ttl_us, Ordering::Release);
    }

    /// Creates or updates a keyspace bucket with `refill_us` per interval (capacity from the burst
    /// window). Shrinking below what is in flight puts the bucket in debt.
    pub(crate) fn upsert_quota(
        &self,
        ks: u32,
        refill_us: u64,
        source: QuotaSource,
        s: &Settings,
        now_us: u64,
    ) {
        let capacity = s.capacity_for(refill_us);
        if let Some(e) = self.keyspaces.get(&ks) {
            e.bucket.set_quota(refill_us, capacity);
            e.set_source(source);
            return;
        }
        let estimate = static_estimate_us(s, ks);
        let burst = s.keyspace_burst_enabled.get(&ks).copied().unwrap_or(true);
        let entry = KeyspaceEntry::new(ks, source, refill_us, capacity, estimate, burst, now_us);
        self.keyspaces.insert(ks, Arc::new(entry));
    }

    /// Tenant-cap mode: the keyspace's uniform-cap bucket, created on first request.
    fn ensure_cap_bucket(&self, ks: u32, cap_refill_us: u64, now_us: u64) -> Arc<KeyspaceEntry> {
        let capacity = self.knobs.cap_capacity_us.load(Ordering::Acquire);
        // First request of this keyspace only: reading the override map under the settings lock
        // is off the steady-state fast path.
        let estimate = static_estimate_us(&self.settings.lock().expect("settings lock"), ks);
        self.keyspaces
            .entry(ks)
            .or_insert_with(|| {
                PolicyCounters::inc(&self.counters.cap_buckets_created);
                Arc::new(KeyspaceEntry::new(
                    ks,
                    QuotaSource::TenantCap,
                    cap_refill_us,
                    capacity,
                    estimate,
                    false,
                    now_us,
                ))
            })
            .clone()
    }

    pub(crate) fn lookup(&self, ks: u32, now_us: u64) -> Option<Arc<KeyspaceEntry>> {
        if let Some(e) = self.keyspaces.get(&ks) {
            return Some(e.clone());
        }
        match self.knobs.cap_refill_us.load(Ordering::Acquire) {
            0 => None,
            cap => Some(self.ensure_cap_bucket(ks, cap, now_us)),
        }
    }

    /// Admits a request of `keyspace` that expects `estimate_us` of CPU (`None` = the keyspace's
    /// current estimate). Unknown keyspaces outside tenant-cap mode get a skip grant.
    pub fn allocate(
        &self,
        keyspace: u32,
        estimate_us: Option<u64>,
        now_us: u64,
    ) -> Result<Grant, Refusal> {
        match self.lookup(keyspace, now_us) {
            Some(entry) => self.allocate_entry(entry, estimate_us, now_us),
            None => {
                PolicyCounters::inc(&self.counters.skipped);
                Ok(Grant::skip(keyspace))
            }
        }
    }

    pub(crate) fn allocate_entry(
        &self,
        entry: Arc<KeyspaceEntry>,
        estimate_us: Option<u64>,
        now_us: u64,
    ) -> Result<Grant, Refusal> {
        entry.touch(now_us);
        let mut est = estimate_us.unwrap_or_else(|| entry.estimate_us()).max(1);
        if self.knobs.track_demand.load(Ordering::Relaxed) {
            entry.counters.demand_us.fetch_add(est, Ordering::Relaxed);
        }
        if self.knobs.runtime_token_management.load(Ordering::Relaxed) {
            let room = self.global.available_us().min(entry.bucket.available_us()) / 10;
            if room > 0 {
                est = est.min(room as u64);
            }
        }
        match self.take_pair(&entry, est) {
            Ok(burst_us) => {
                entry.counters.granted.fetch_add(1, Ordering::Relaxed);
                let tenant_us = est - burst_us;
                Ok(Grant {
                    keyspace: entry.id(),
                    entry: Some(entry),
                    tenant_us,
                    global_us: est,
                    burst_us,
                    low_priority_us: 0,
                })
            }
            Err(r) => Err(r),
        }
    }

    /// Tenant then global (rollback on global failure); burst fallback outside cap mode.
    /// Returns the µs that came from bursting (0 or `us`).
    fn take_pair(&self, entry: &KeyspaceEntry, us: u64) -> Result<u64, Refusal> {
        let ks = entry.id();
        let cap_mode = entry.source() == QuotaSource::TenantCap;
        if entry.bucket.try_take(us) {
            if self.global.try_take(us) {
                return Ok(0);
            }
            if !cap_mode && !self.knobs.enforce_global.load(Ordering::Relaxed) {
                // Best effort: track the usage on the global bucket, do not refuse.
                self.global.force_take(us);
                PolicyCounters::inc(&self.counters.global_best_effort_overdraft);
                return Ok(0);
            }
            entry.bucket.rollback(us);
            PolicyCounters::inc(&self.counters.global_exhausted);
            entry
                .counters
                .refused_global
                .fetch_add(1, Ordering::Relaxed);
            return Err(Refusal::GlobalCpuExhausted { keyspace: ks });
        }
        if !cap_mode && self.can_burst(entry) && self.take_burst(us) {
            PolicyCounters::inc(&self.counters.burst_granted);
            entry.counters.burst_granted.fetch_add(1, Ordering::Relaxed);
            entry
                .counters
                .burst_tokens_us
                .fetch_add(us, Ordering::Relaxed);
            return Ok(us);
        }
        entry
            .counters
            .refused_keyspace
            .fetch_add(1, Ordering::Relaxed);
        if cap_mode {
            PolicyCounters::inc(&self.counters.tenant_cap_exhausted);
            Err(Refusal::TenantCpuExhausted { keyspace: ks })
        } else {
            PolicyCounters::inc(&self.counters.keyspace_exhausted);
            Err(Refusal::KeyspaceCpuExhaustedNoBurst { keyspace: ks })
        }
    }

    fn can_burst(&self, entry: &KeyspaceEntry) -> bool {
        self.knobs.enable_burst.load(Ordering::Relaxed)
            && entry.burst_enabled()
            && entry.burst_allowed()
    }

    /// Burst: takes `us` from this interval's burst budget and from the global bucket.
    fn take_burst(&self, us: u64) -> bool {
        let want = us as i64;
        let mut cur = self.burst_budget_us.load(Ordering::Acquire);
        loop {
            if cur < want {
                return false;
            }
            match self.burst_budget_us.compare_exchange_weak(
                cur,
                cur - want,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(a) => cur = a,
            }
        }
        if self.global.try_take(us) {
            true
        } else {
            self.burst_budget_us.fetch_add(want, Ordering::AcqRel);
            false
        }
    }

    /// Runtime top-up: `us` more for a running request, from the same tenant and global buckets.
    /// In tenant-cap mode there is no burst and no global-only fallback.
    pub fn allocate_more(&self, grant: &mut Grant, us: u64, now_us: u64) -> Result<(), Refusal> {
        let Some(entry) = grant.entry.clone() else {
            return Ok(()); // skip grants are not throttled
        };
        entry.touch(now_us);
        match self.take_pair(&entry, us.max(1)) {
            Ok(burst_us) => {
                PolicyCounters::inc(&self.counters.topup_granted);
                entry
                    .counters
                    .topups_granted
                    .fetch_add(1, Ordering::Relaxed);
                let us = us.max(1);
                grant.tenant_us += us - burst_us;
                grant.global_us += us;
                grant.burst_us += burst_us;
                Ok(())
            }
            Err(r) => {
                PolicyCounters::inc(&self.counters.topup_refused);
                entry
                    .counters
                    .topups_refused
                    .fetch_add(1, Ordering::Relaxed);
                Err(r)
            }
        }
    }

    /// Closes a grant with the measured CPU: unused tokens are refunded, an overrun is charged
    /// as debt (tenant bucket: the part not covered by burst tokens).
    pub fn release(&self, grant: Grant, consumed_us: u64) {
        if grant.global_us > 0 {
            self.global.settle(grant.global_us, consumed_us);
        }
        if grant.low_priority_us > 0 {
            self.low_priority.settle(grant.low_priority_us, consumed_us);
        }
        if let Some(entry) = &grant.entry {
            let tenant_consumed = consumed_us.saturating_sub(grant.burst_us);
            entry.bucket.settle(grant.tenant_us, tenant_consumed);
            entry
                .counters
                .consumed_us
                .fetch_add(consumed_us, Ordering::Relaxed);
            entry.counters.released.fetch_add(1, Ordering::Relaxed);
        } else if grant.global_us > 0 {
            // Global-only grant (no keyspace entry): counted node-wide.
            PolicyCounters::inc(&self.counters.released);
        }
    }
}
