//! The agent-loop side of [`Policy`]: refill, monitor window, adaptive estimates, burst flags,
//! dynamic and fair refill, idle eviction. Called from one thread with the simulated clock.

use std::sync::atomic::Ordering;

use serde::Serialize;

use super::dynamic::{adjust_global_refill, adjust_keyspace_refill};
use super::estimate::{EstimateTracker, ema};
use super::fair::{FairInput, fair_allocate};
use super::grant::PolicyCounters;
use super::keyspace::QuotaSource;
use super::manager::Policy;
use super::pd::PdTracker;
use super::settings::Settings;
use super::window::{MonitorWindow, UsageSample};

/// State only the agent loop touches (behind one mutex, never taken by the fast path).
#[derive(Debug)]
pub struct AgentState {
    pub(crate) last_refill_us: u64,
    pub(crate) window: MonitorWindow,
    pub(crate) estimates: EstimateTracker,
    pub(crate) pd: PdTracker,
    /// Cumulative demand (µs) per keyspace at the previous observation.
    pub(crate) last_demand: std::collections::HashMap<u32, u64>,
    pub(crate) last_observe_us: u64,
    pub(crate) fair_active: bool,
}

impl AgentState {
    pub(crate) fn new(s: &Settings, now_us: u64) -> Self {
        AgentState {
            last_refill_us: now_us,
            window: MonitorWindow::new(s.window_size_us, s.max_window_cpu_us()),
            estimates: EstimateTracker::default(),
            pd: PdTracker::default(),
            last_demand: Default::default(),
            last_observe_us: now_us,
            fair_active: false,
        }
    }
}

/// What one [`Policy::tick`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct TickReport {
    /// Refill intervals elapsed and applied.
    pub refill_intervals: u64,
    /// A usage sample was observed (monitor window, estimates, burst, dynamic, fair).
    pub observed: bool,
    /// Fair allocation drove per-keyspace refill this observation.
    pub fair_active: bool,
    pub global_ratio: f64,
    /// Auto-created tenant-cap buckets evicted as idle.
    pub evicted: usize,
    /// Admission-control tenants forgotten with nothing in flight.
    pub admission_evicted: usize,
}

impl Policy {
    /// One agent step at `now_us`: refill every bucket for the elapsed refill intervals; if a
    /// `usage` sample is given, update the monitor window and everything derived from it; evict
    /// idle tenant-cap buckets. Call it at least every `refill-interval`, and pass a sample exactly
    /// once per `stats-interval` (the EMA estimate and the window assume that cadence).
    pub fn tick(&self, now_us: u64, usage: Option<&UsageSample>) -> TickReport {
        let mut report = TickReport {
            refill_intervals: self.refill(now_us),
            ..TickReport::default()
        };
        if let Some(sample) = usage {
            let (ratio, fair) = self.observe(now_us, sample);
            report.observed = true;
            report.global_ratio = ratio;
            report.fair_active = fair;
            // Once per stats interval is often enough to keep the table small.
            report.admission_evicted = self.admission().evict_idle();
        }
        report.global_ratio = self.global_ratio();
        report.evicted = self.evict_idle(now_us);
        report
    }

    /// Applies whole refill intervals elapsed since the last refill. Returns how many.
    pub fn refill(&self, now_us: u64) -> u64 {
        let interval = self
            .settings
            .lock()
            .expect("settings lock")
            .refill_interval_us
            .max(1);
        let mut agent = self.agent.lock().expect("agent lock");
        if now_us <= agent.last_refill_us {
            return 0;
        }
        let intervals = (now_us - agent.last_refill_us) / interval;
        if intervals == 0 {
            return 0;
        }
        agent.last_refill_us += intervals * interval;
        self.knobs
            .next_refill_at_us
            .store(agent.last_refill_us + interval, Ordering::Release);
        drop(agent);
        self.global.refill(intervals);
        self.low_priority.refill(intervals);
        // Burst allocations are capped by one interval's global refill budget.
        self.burst_budget_us
            .store(self.global.refill_us() as i64, Ordering::Release);
        for e in self.keyspaces.iter() {
            e.bucket.refill(intervals);
        }
        intervals
    }

    /// Monitor window and everything derived from it. Returns (global ratio, fair active).
    pub fn observe(&self, now_us: u64, sample: &UsageSample) -> (f64, bool) {
        let s = self.settings.lock().expect("settings lock").clone();
        let mut agent = self.agent.lock().expect("agent lock");
        agent.window.push(now_us, sample);
        let global_ratio = agent.window.global_ratio();
        self.knobs
            .global_ratio_bits
            .store(global_ratio.to_bits(), Ordering::Release);
        let elapsed = now_us.saturating_sub(agent.last_observe_us).max(1);
        agent.last_observe_us = now_us;

        // Global refill: dynamic adjustment or base.
        let global_base = self.global.base_refill_us();
        let global_refill = if s.enable_dynamic_adjustment {
            adjust_global_refill(
                global_base,
                self.global.refill_us(),
                global_ratio,
                s.high_watermark,
                s.low_watermark,
            )
        } else {
            global_base
        };
        self.global.set_refill(global_refill);

        let fair_active = s.enable_fair_allocation && global_ratio > s.fair_allocation_threshold;
        let mut fair_inputs = Vec::new();
        let total = global_base as f64;
        for e in self.keyspaces.iter() {
            let ks = e.id();
            let ratio = agent.window.keyspace_ratio(ks);
            e.set_ratio(ratio);
            let demand_total = e.counters.demand_us.load(Ordering::Relaxed);
            let prev = agent.last_demand.insert(ks, demand_total).unwrap_or(0);
            if s.enable_adaptive_estimate {
                let consumed = e.counters.consumed_us.load(Ordering::Relaxed);
                let released = e.counters.released.load(Ordering::Relaxed);
                if let Some(mean) = agent.estimates.interval_mean(ks, consumed, released) {
                    e.set_estimate_us(ema(e.estimate_us(), mean, s.adaptive_estimate_alpha));
                }
            }
            if e.source() == QuotaSource::TenantCap {
                e.set_burst_allowed(false);
                e.bucket.set_refill(e.bucket.base_refill_us());
                continue;
            }
            e.set_burst_allowed(
                s.enable_burst
                    && global_ratio < s.burst_threshold
                    && ratio < s.keyspace_burst_threshold,
            );
            let base = e.bucket.base_refill_us();
            let mut refill = base;
            if s.enable_dynamic_adjustment && global_base > 0 {
                refill = adjust_keyspace_refill(base, ratio, base as f64 / global_base as f64);
            }
            e.bucket.set_refill(refill);
            if fair_active {
                // Demand over the stats interval, scaled to one refill interval.
                let demand = demand_total.saturating_sub(prev) as f64 * s.refill_interval_us as f64
                    / elapsed as f64;
                fair_inputs.push(FairInput {
                    keyspace: ks,
                    quota: base as f64,
                    usage: ratio * total,
                    demand: Some(demand),
                });
            }
        }
        if fair_active {
            for share in fair_allocate(total, global_ratio * total, &fair_inputs) {
                if let Some(e) = self.keyspaces.get(&share.keyspace) {
                    let base = e.bucket.base_refill_us();
                    // Floor of one request per interval so an idle keyspace is never starved.
                    let floor = e.estimate_us().min(base);
                    let fair = (share.allocation.min(base as f64) as u64).max(floor);
                    e.bucket.set_refill(e.bucket.refill_us().min(fair));
                    e.counters.fair_allocations.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        agent.fair_active = fair_active;
        (global_ratio, fair_active)
    }

    /// Evicts auto-created tenant-cap buckets with no request within the (current) idle TTL and
    /// nothing in flight. Returns how many were evicted.
    pub fn evict_idle(&self, now_us: u64) -> usize {
        let ttl = self.knobs.cap_idle_ttl_us.load(Ordering::Acquire);
        let idle = |e: &super::keyspace::KeyspaceEntry| {
            e.source() == QuotaSource::TenantCap
                && now_us.saturating_sub(e.last_used_us()) >= ttl
                && e.bucket.inflight_us() == 0
        };
        let victims: Vec<u32> = self
            .keyspaces
            .iter()
            .filter(|e| idle(e))
            .map(|e| e.id())
            .collect();
        let mut evicted = 0;
        for ks in victims {
            if self.remove_keyspace_if(ks, idle) {
                evicted += 1;
                PolicyCounters::inc(&self.counters.cap_buckets_evicted);
                let mut agent = self.agent.lock().expect("agent lock");
                agent.estimates.forget(ks);
                agent.last_demand.remove(&ks);
            }
        }
        evicted
    }
}
