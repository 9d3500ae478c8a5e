//! The agent loop's side of [`Policy`]: refill, monitor window, adaptive
//! estimates, burst flags, dynamic and fair refill, idle eviction. Called
//! from one thread with a clock in µs (the real one in the agent, a
//! simulated one in tests).

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use keyspace_governor_common::admission::{P_BURST_ALLOWED, P_BURST_ENABLED, P_CAP, counter};
use serde::Serialize;

use super::dynamic::{adjust_global_refill, adjust_keyspace_refill};
use super::estimate::ema;
use super::fair::{FairInput, fair_allocate};
use super::keyspace::{BucketBook, QuotaSource};
use super::manager::{Engine, Policy};
use super::window::UsageSample;
use crate::region::{BucketView, GLOBAL, LOW_PRIORITY, OVERFLOW, ParamsView};

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
    /// Idle keyspace cells given up.
    pub evicted: usize,
    /// Sleep slots freed that held places already served (left by clients
    /// that died asleep).
    pub slots_freed: u32,
}

impl Policy {
    /// What a refill may fill a bucket to: its capacity (rate ×
    /// `burst-window`), except a tenant-cap bucket with nothing in flight,
    /// which keeps one interval's refill, as the tenant-cap seed sizes it
    /// (what stands above is trimmed). So a tenant back from idle starts
    /// from one interval (with the window's ten it took its cap + 9 % in its
    /// first second), while a busy tenant's refunds of over-granted tokens
    /// still have room to land. Tokens only threads keep spare (no ticket
    /// running) are nothing in flight: a tenant that stopped keeps them
    /// until its threads serve it again, so they must not keep its bucket
    /// full as well.
    fn idle_cap_limit(b: &BucketView, p: Option<&ParamsView>, book: &mut BucketBook) -> u64 {
        let running = b.inflight_us() != 0 && b.counter(counter::GRANTED) != b.counter(counter::RELEASED);
        if !p.is_some_and(|p| p.has(P_CAP)) || running {
            return book.capacity_us;
        }
        let limit = book.refill_us.min(book.capacity_us);
        book.discarded_us += b.clamp_available(limit);
        limit
    }

    /// One agent step at `now_us`: refill every bucket for the elapsed refill
    /// intervals (a tenant-capped keyspace's toward its charged CPU, from
    /// `cpu_ns`: every measurement cell's charge now, by cell; empty where
    /// it is not read); with a `usage` sample (exactly once per stats
    /// interval), update the monitor window and everything derived from it;
    /// give up idle keyspace cells not in `pinned` (cells a thread is still
    /// tagged with).
    pub fn tick_with(
        &self,
        now_us: u64,
        usage: Option<&UsageSample>,
        cpu_ns: &[u64],
        pinned: impl FnOnce() -> HashSet<u32>,
    ) -> TickReport {
        self.regions().header().agent.now_ms.store(now_us / 1000, Ordering::Relaxed);
        let mut report = TickReport { refill_intervals: self.refill(now_us, cpu_ns), ..TickReport::default() };
        if let Some(sample) = usage {
            let (ratio, fair) = self.observe(now_us, sample);
            report.observed = true;
            report.fair_active = fair;
            report.global_ratio = ratio;
            report.slots_freed = self.sweep_slots();
        }
        report.global_ratio = self.global_ratio();
        report.evicted = self.evict_idle(now_us, pinned);
        report
    }

    /// [`Policy::tick_with`] with nothing pinned and no CPU read (refills
    /// as configured).
    pub fn tick(&self, now_us: u64, usage: Option<&UsageSample>) -> TickReport {
        self.tick_with(now_us, usage, &[], HashSet::new)
    }

    /// Applies whole refill intervals elapsed since the last refill, waking
    /// waiters of every bucket that gained tokens; a tenant-capped
    /// keyspace's refill follows its charge in `cpu_ns` (by cell;
    /// [`super::follow`]). Returns how many.
    pub fn refill(&self, now_us: u64, cpu_ns: &[u64]) -> u64 {
        let interval = self.settings().refill_interval_us().max(1);
        let mut e = self.engine();
        if now_us <= e.last_refill_us {
            return 0;
        }
        let intervals = (now_us - e.last_refill_us) / interval;
        if intervals == 0 {
            return 0;
        }
        e.last_refill_us += intervals * interval;
        e.next_refill_at_us = e.last_refill_us + interval;
        let r = self.regions();
        let e = &mut *e;
        for (i, book) in [(GLOBAL, &mut e.global), (LOW_PRIORITY, &mut e.low_priority), (OVERFLOW, &mut e.overflow)] {
            let amount = book.refill_us.saturating_mul(intervals);
            let limit =
                if i == OVERFLOW { Self::idle_cap_limit(r.bucket(i), r.params.get(i), book) } else { book.capacity_us };
            let kept = r.bucket(i).give(amount, limit);
            book.refilled_us += amount;
            book.discarded_us += amount - kept;
        }
        // Burst allocations are capped by one interval's global refill.
        r.bucket(GLOBAL)
            .burst_budget_us
            .store(i64::try_from(e.global.refill_us).unwrap_or(i64::MAX), Ordering::Release);
        for &c in &e.live {
            let Some(st) = e.cells[c as usize].as_mut() else { continue };
            if st.source.is_none() {
                continue;
            }
            let Some((b, p)) = r.keyspace_cell(c) else { continue };
            if st.book.debt_mode {
                if b.inflight_us() > st.book.base_refill_us {
                    continue;
                }
                st.book.debt_mode = false;
                Self::publish_book(p, &st.book);
            }
            let mut amount = st.book.refill_us.saturating_mul(intervals);
            if st.source == Some(QuotaSource::TenantCap) {
                let cpu = cpu_ns.get(c as usize).copied();
                amount = st.follow.amount(amount, cpu, b.available_us(), st.book.capacity_us);
            }
            let limit = Self::idle_cap_limit(b, Some(p), &mut st.book);
            let kept = b.give(amount, limit);
            st.book.refilled_us += amount;
            st.book.discarded_us += amount - kept;
        }
        r.header().agent.refills.fetch_add(intervals, Ordering::Relaxed);
        intervals
    }

    /// Monitor window and everything derived from it. Returns (global ratio,
    /// fair active).
    pub fn observe(&self, now_us: u64, sample: &UsageSample) -> (f64, bool) {
        let s = self.settings();
        let r = self.regions();
        let mut guard = self.engine();
        let e = &mut *guard;
        e.window.push(now_us, sample);
        let global_ratio = e.window.global_ratio();
        e.global_ratio = global_ratio;
        let elapsed = now_us.saturating_sub(e.last_observe_us).max(1);
        e.last_observe_us = now_us;

        // Global refill: dynamic adjustment or base.
        let global_base = e.global.base_refill_us;
        e.global.refill_us = if s.throttle().enable_dynamic_adjustment {
            adjust_global_refill(
                global_base,
                e.global.refill_us,
                global_ratio,
                s.throttle().high_watermark,
                s.throttle().low_watermark,
            )
        } else {
            global_base
        };
        if let Some(p) = r.params.get(GLOBAL) {
            Self::publish_book(p, &e.global);
        }

        let fair_active = s.throttle().enable_fair_allocation && global_ratio > s.throttle().fair_allocation_threshold;
        let mut fair_inputs = Vec::new();
        let total = global_base as f64;
        let active: HashSet<u32> = sample.keyspace_cpu_us.iter().filter(|(_, us)| *us > 0).map(|(ks, _)| *ks).collect();
        let Engine { cells, window, estimates, last_demand, .. } = e;
        for (c, st) in cells.iter_mut().enumerate() {
            let Some(st) = st.as_mut() else { continue };
            let c = c as u32;
            let Some((b, p)) = r.keyspace_cell(c) else { continue };
            let ratio = window.keyspace_ratio(st.id);
            st.ratio = ratio;
            if active.contains(&st.id) {
                st.last_used_us = now_us;
            }
            let demand_total = b.counter(counter::DEMAND_US);
            let prev_demand = last_demand.insert(c, demand_total).unwrap_or(0);
            if s.throttle().enable_adaptive_estimated_cpu_per_request_us {
                let consumed = b.counter(counter::CONSUMED_US);
                let released = b.counter(counter::RELEASED);
                if let Some(mean) = estimates.interval_mean(c, consumed, released) {
                    // Clients write these counters: no request used more CPU
                    // than every core for the whole interval.
                    let bound = (elapsed as f64 * s.cpu_cores.max(1.0)) as u64;
                    st.estimate_us = ema(st.estimate_us, mean.clamp(1, bound.max(1)), s.adaptive_estimate_alpha);
                }
            }
            p.estimate_us.store(st.estimate_us, Ordering::Relaxed);
            let mut flags = p.flags.load(Ordering::Relaxed) & !(P_BURST_ALLOWED | P_BURST_ENABLED);
            if st.burst_enabled {
                flags |= P_BURST_ENABLED;
            }
            match st.source {
                None => {}
                Some(QuotaSource::TenantCap) => {
                    st.burst_allowed = false;
                    st.book.refill_us = st.book.base_refill_us;
                }
                Some(_) => {
                    st.burst_allowed = s.throttle().enable_burst
                        && global_ratio < s.throttle().burst_threshold
                        && ratio < s.keyspace_burst_threshold;
                    if st.burst_allowed {
                        flags |= P_BURST_ALLOWED;
                    }
                    let base = st.book.base_refill_us;
                    st.book.refill_us = if s.throttle().enable_dynamic_adjustment && global_base > 0 {
                        adjust_keyspace_refill(base, ratio, base as f64 / global_base as f64)
                    } else {
                        base
                    };
                    if fair_active {
                        // Demand over the stats interval, scaled to one refill interval.
                        let demand = demand_total.saturating_sub(prev_demand) as f64 * s.refill_interval_us() as f64
                            / elapsed as f64;
                        fair_inputs.push(FairInput {
                            keyspace: c,
                            quota: base as f64,
                            usage: ratio * total,
                            demand: Some(demand),
                        });
                    }
                }
            }
            p.flags.store(flags, Ordering::Release);
            Self::publish_book(p, &st.book);
        }
        if fair_active {
            for share in fair_allocate(total, global_ratio * total, &fair_inputs) {
                let c = share.keyspace;
                let Some(st) = cells.get_mut(c as usize).and_then(|x| x.as_mut()) else { continue };
                let base = st.book.base_refill_us;
                // Floor of one request per interval so an idle keyspace is never starved.
                let floor = st.estimate_us.min(base);
                let fair = (share.allocation.min(base as f64) as u64).max(floor);
                st.book.refill_us = st.book.refill_us.min(fair);
                st.fair_allocations += 1;
                if let Some((_, p)) = r.keyspace_cell(c) {
                    Self::publish_book(p, &st.book);
                }
            }
        }
        e.fair_active = fair_active;
        Self::guard(e, &s, r, sample);
        (global_ratio, fair_active)
    }

    /// The latency guard's step for this sample: every cell's factor moves
    /// (down for the keyspaces above their fair share while one under it
    /// waits past the target, back up otherwise) and scales the refill just
    /// set for it.
    fn guard(e: &mut Engine, s: &super::Settings, r: &crate::region::AdmissionRegions, sample: &UsageSample) {
        let cpu: std::collections::HashMap<u32, u64> = sample.keyspace_cpu_us.iter().copied().collect();
        let waits: std::collections::HashMap<u32, u64> = sample.keyspace_wait_p99_us.iter().copied().collect();
        let behind: std::collections::HashMap<u32, &super::WaitsBehind> =
            sample.keyspace_wait_behind.iter().map(|(id, b)| (*id, b)).collect();
        let cells: Vec<u32> = e.live.iter().copied().collect();
        let inputs: Vec<super::GuardInput> = cells
            .iter()
            .filter_map(|&c| e.cells[c as usize].as_ref())
            .map(|st| super::GuardInput {
                keyspace: st.id,
                cpu_us: cpu.get(&st.id).copied().unwrap_or(0),
                wait_p99_us: waits.get(&st.id).copied(),
                behind: behind.get(&st.id).map_or_else(Default::default, |b| (*b).clone()),
                factor: st.guard_factor,
            })
            .collect();
        let step = super::guard_step(&s.latency_guard, &inputs);
        let mut factors = step.factors.iter();
        for &c in &cells {
            let Some(st) = e.cells[c as usize].as_mut() else { continue };
            let Some(&f) = factors.next() else { break };
            st.guard_factor = f;
            if f < 1.0 && st.source.is_some() {
                st.book.refill_us = (st.book.refill_us as f64 * f).round() as u64;
                if let Some((_, p)) = r.keyspace_cell(c) {
                    Self::publish_book(p, &st.book);
                }
            }
        }
        // Said when the guard starts holding keyspaces down and when all are
        // whole again, not at each interval's miss or met in between (AIMD
        // takes turns at them).
        let was_holding = inputs.iter().any(|k| k.factor < 1.0);
        let lowered: Vec<String> = inputs
            .iter()
            .zip(&step.factors)
            .filter(|(_, f)| **f < 1.0)
            .map(|(k, f)| format!("{} to {:.0} %", k.keyspace, f * 100.0))
            .collect();
        if !was_holding && !lowered.is_empty() {
            log::info!(
                "latency guard: keyspaces {:?} wait past the target behind those above their share; refills lowered: {}",
                step.suffering,
                lowered.join(", ")
            );
        } else if was_holding && lowered.is_empty() {
            log::info!("latency guard: targets met; every refill is whole again");
        }
        // Said when it starts, not at every interval it lasts.
        if !step.waiting_elsewhere.is_empty() && e.guard.waiting_elsewhere.is_empty() {
            log::info!(
                "latency guard: keyspaces {:?} wait past the target, mostly behind no keyspace above its share \
                 (an idle CPU, tasks governor does not measure): nobody is lowered for them",
                step.waiting_elsewhere
            );
        }
        e.guard = step;
    }

    /// Frees every bucket's sleep slots that hold served places
    /// ([`BucketView::sweep_served_slots`]), once per stats interval.
    fn sweep_slots(&self) -> u32 {
        let r = self.regions();
        let e = self.engine();
        let fixed = [GLOBAL, LOW_PRIORITY, OVERFLOW].map(|i| r.bucket(i));
        let cells = e.live.iter().filter_map(|&c| r.keyspace_cell(c).map(|(b, _)| b));
        fixed.into_iter().chain(cells).map(BucketView::sweep_served_slots).sum()
    }

    /// Gives up keyspace cells idle for the idle TTL: tenant-cap buckets, and
    /// cells that only served measurement or request limits. Never a cell
    /// with tokens in flight, requests or write bytes pending, waiters, debt
    /// still owed, or a thread tagged with it (`pinned`). Configured and PD
    /// quotas stay. Returns how many went.
    /// `pinned` is asked (once) only if some cell is idle.
    pub fn evict_idle(&self, now_us: u64, pinned: impl FnOnce() -> HashSet<u32>) -> usize {
        let ttl = self.settings().tenant_cap_idle_ttl_us();
        let r = self.regions();
        let mut e = self.engine();
        let now_ms = now_us / 1000;
        let mut evicted = 0;
        let mut pinned = Some(pinned);
        let mut pinned_set = HashSet::new();
        let live: Vec<u32> = e.live.iter().copied().collect();
        for c in live {
            let Some(st) = e.cells[c as usize].as_ref() else { continue };
            if matches!(st.source, Some(QuotaSource::Config) | Some(QuotaSource::Pd)) {
                continue;
            }
            let Some((b, _)) = r.keyspace_cell(c) else { continue };
            let last_ms = b.last_used_ms.load(Ordering::Relaxed).min(now_ms);
            let last_us = st.last_used_us.max(last_ms * 1000);
            let idle = now_us.saturating_sub(last_us) >= ttl
                // No tenant tokens in flight, or only threads' spare ones
                // (no ticket running): a spare left behind is worth nothing
                // to the cell's next holder (its generation differs).
                && (b.inflight_us() == 0 || b.counter(counter::GRANTED) == b.counter(counter::RELEASED))
                && b.inflight_requests.load(Ordering::Acquire) == 0
                && b.pending_write_bytes.load(Ordering::Acquire) == 0
                && b.sleepers.load(Ordering::Acquire) == 0
                && (st.source.is_none() || b.available_us() >= 0);
            if !idle {
                continue;
            }
            if let Some(f) = pinned.take() {
                pinned_set = f();
            }
            if pinned_set.contains(&c) {
                continue;
            }
            if st.source == Some(QuotaSource::TenantCap) {
                e.cap_buckets_evicted += 1;
            }
            for (i, v) in b.counter_values().into_iter().enumerate() {
                e.retired[i] += v;
            }
            r.directory().evict(c);
            e.cells[c as usize] = None;
            e.live.remove(&c);
            e.estimates.forget(c);
            e.last_demand.remove(&c);
            evicted += 1;
        }
        evicted
    }
}
