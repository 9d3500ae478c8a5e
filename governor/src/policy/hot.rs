//! Online changes: a new settings value applied whole (from an accepted
//! configuration update), and the narrow updates the seeds name.
//!
//! The configuration validates every change (ranges, the Essential
//! profile's rules, restart-only keys) before it reaches here; this applies
//! what changed and touches nothing else, so an unrelated change never
//! disturbs busy buckets.

use std::sync::atomic::Ordering;

use super::keyspace::QuotaSource;
use super::manager::Policy;
use super::settings::Settings;
use super::window::MonitorWindow;
use crate::region::RegionError;

impl Policy {
    /// Applies a whole new settings value at `now_us`.
    ///
    /// - `tenant-max-cpu-ratio`: > 0 resizes every cap bucket (a shrink below
    ///   in-flight tokens puts it in debt); 0 removes them, so unknown
    ///   keyspaces pass unthrottled again.
    /// - Quotas, PD on or off: every keyspace's source is decided again; a
    ///   PD quota does not outlive PD or the cap.
    /// - Estimates, burst switches, write threshold, admission mode and
    ///   limit, idle TTL: take effect at once.
    /// - `window-size` / `stats-interval`: the monitor window is resized.
    /// - `max-read-cpu-ratio`, `low-priority-dag-*`, and what the overflow
    ///   bucket is held to: the node's buckets are resized.
    pub fn update_settings_at(&self, next: Settings, now_us: u64) -> Result<(), RegionError> {
        let prev = std::mem::replace(&mut *self.lock_settings(), next.clone());
        self.publish_knobs(&next);
        let r = self.regions();
        let mut e = self.engine();
        if prev.window_size_us() != next.window_size_us() || prev.max_window_cpu_us() != next.max_window_cpu_us() {
            let old =
                std::mem::replace(&mut e.window, MonitorWindow::new(next.window_size_us(), next.max_window_cpu_us()));
            e.window.take_samples_from(old);
        }
        if !next.throttle().enable_pd_service_limit || next.cap_mode() {
            e.pd = Default::default();
        }
        // Every keyspace with a cell, and every configured one, decided again.
        let mut ids: Vec<u32> = e.cells.iter().flatten().map(|st| st.id).collect();
        ids.extend(next.throttle().keyspace_cpu_quotas.map().keys());
        ids.sort_unstable();
        ids.dedup();
        for ks in ids {
            let current = r
                .directory()
                .find(ks)
                .and_then(|c| e.cells[c.index as usize].as_ref())
                .map(|st| (st.source, st.book.base_refill_us));
            let wanted = self.source_for(&e, &next, ks);
            let changed = match (current, wanted) {
                (None, None) => false,
                (Some((src, base)), w) => src != w.map(|x| x.0) || w.is_some_and(|(_, us)| us != base),
                (None, Some(_)) => true,
            };
            if changed {
                self.set_source(&mut e, &next, ks, wanted, now_us)?;
            }
        }
        for st in e.cells.iter_mut().flatten() {
            st.burst_enabled = next.throttle().keyspace_burst_enabled.map().get(&st.id).copied().unwrap_or(true);
            // A new static estimate, or adaptive estimates turned off: the
            // learned value goes, the configured one is in force.
            if prev.static_estimate_us(st.id) != next.static_estimate_us(st.id)
                || (prev.throttle().enable_adaptive_estimated_cpu_per_request_us
                    && !next.throttle().enable_adaptive_estimated_cpu_per_request_us)
            {
                st.estimate_us = next.static_estimate_us(st.id);
            }
            if !next.throttle().enable_burst {
                st.burst_allowed = false;
            }
        }
        for (c, st) in e.cells.iter().enumerate() {
            if let (Some(st), Some((_, p))) = (st, r.keyspace_cell(c as u32)) {
                p.estimate_us.store(st.estimate_us, Ordering::Relaxed);
            }
        }
        if !next.throttle().enable_dynamic_adjustment {
            e.global.refill_us = e.global.base_refill_us;
        }
        // The node's buckets follow `max-read-cpu-ratio`, the low-priority
        // ratio and switch, and the overflow bucket the cap or the quotas,
        // whatever else changed (each one only when its size did).
        self.setup_node_buckets(&mut e, &next);
        Ok(())
    }

    /// [`Policy::update_settings_at`] at the last refill's time.
    pub fn update_settings(&self, next: Settings) -> Result<(), RegionError> {
        let now = self.engine().last_refill_us;
        self.update_settings_at(next, now)
    }

    /// Hot update of `tenant-max-cpu-ratio`.
    pub fn set_tenant_max_cpu_ratio(&self, ratio: f64) -> Result<(), RegionError> {
        let mut next = self.settings().clone();
        next.throttle_mut().tenant_max_cpu_ratio = ratio;
        self.update_settings(next)
    }

    /// Hot update of `tenant-cap-idle-ttl`, µs; the next eviction scan uses it.
    pub fn set_tenant_cap_idle_ttl_us(&self, ttl_us: u64) -> Result<(), RegionError> {
        let mut next = self.settings().clone();
        next.throttle_mut().tenant_cap_idle_ttl =
            crate::config::ConfigDuration(std::time::Duration::from_micros(ttl_us));
        self.update_settings(next)
    }

    /// Sets (or with `None` removes) a configured keyspace quota in millicores.
    pub fn set_keyspace_quota_millicores(
        &self,
        keyspace: u32,
        millicores: Option<u64>,
        now_us: u64,
    ) -> Result<(), RegionError> {
        let mut next = self.settings().clone();
        next.throttle_mut().keyspace_cpu_quotas.set(keyspace, millicores);
        self.update_settings_at(next, now_us)
    }

    /// Current idle TTL of tenant-cap buckets, µs.
    pub fn tenant_cap_idle_ttl_us(&self) -> u64 {
        self.settings().tenant_cap_idle_ttl_us()
    }

    /// Keyspaces whose bucket comes from `source`.
    pub fn keyspaces_from(&self, source: QuotaSource) -> Vec<u32> {
        self.engine().cells.iter().flatten().filter(|st| st.source == Some(source)).map(|st| st.id).collect()
    }
}
