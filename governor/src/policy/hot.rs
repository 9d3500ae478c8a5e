//! Online changes: tenant cap ratio and idle TTL, keyspace quotas, whole-settings updates.
//! Every update is validated first; a rejected update changes nothing.

use std::sync::atomic::Ordering;

use super::error::SettingsError;
use super::estimate::static_estimate_us;
use super::grant::PolicyCounters;
use super::keyspace::QuotaSource;
use super::manager::Policy;
use super::settings::{Settings, millicores_to_us_per_interval};

impl Policy {
    /// Hot update of `tenant-max-cpu-ratio`. > 0 recomputes every auto-created cap bucket (a
    /// shrink below in-flight tokens puts it in debt); 0 removes them, so unknown keyspaces
    /// revert to legacy skip-throttle.
    pub fn set_tenant_max_cpu_ratio(&self, ratio: f64) -> Result<(), SettingsError> {
        let mut next = self.settings();
        next.tenant_max_cpu_ratio = ratio;
        self.update_settings(next)
    }

    /// Hot update of `tenant-cap-idle-ttl`, µs; the next eviction scan uses it.
    pub fn set_tenant_cap_idle_ttl_us(&self, ttl_us: u64) -> Result<(), SettingsError> {
        let mut next = self.settings();
        next.tenant_cap_idle_ttl_us = ttl_us;
        self.update_settings(next)
    }

    /// Sets (or with `None` removes) a configured keyspace quota in millicores.
    pub fn set_keyspace_quota_millicores(
        &self,
        keyspace: u32,
        millicores: Option<u64>,
        now_us: u64,
    ) -> Result<(), SettingsError> {
        let mut next = self.settings();
        match millicores {
            Some(mc) => next.keyspace_cpu_quotas_millicores.insert(keyspace, mc),
            None => next.keyspace_cpu_quotas_millicores.remove(&keyspace),
        };
        self.update_settings_at(next, now_us)
    }

    /// Applies a whole new settings value (online config change), at clock 0 for new buckets'
    /// idle timestamps. See [`Policy::update_settings_at`].
    pub fn update_settings(&self, next: Settings) -> Result<(), SettingsError> {
        let now = self.agent.lock().expect("agent lock").last_refill_us;
        self.update_settings_at(next, now)
    }

    /// Applies a whole new settings value. Restart-only keys must be unchanged and the
    /// cross-field rules must hold, otherwise nothing changes.
    pub fn update_settings_at(&self, next: Settings, now_us: u64) -> Result<(), SettingsError> {
        let mut guard = self.settings.lock().expect("settings lock");
        guard.check_online_change(&next)?;
        let prev = std::mem::replace(&mut *guard, next.clone());
        drop(guard);
        self.store_knobs(&next);

        // Tenant cap buckets: recomputed only when the cap itself changed, so an unrelated
        // online change (admission mode, write threshold, ...) never touches busy buckets.
        let prev_cap = prev.tenant_cap_refill_us(prev.tenant_max_cpu_ratio);
        match next.tenant_cap_refill_us(next.tenant_max_cpu_ratio) {
            Some(cap) if prev_cap == Some(cap) => {}
            Some(cap) => {
                let capacity = next.capacity_for(cap);
                for e in self
                    .keyspaces
                    .iter()
                    .filter(|e| e.source() == QuotaSource::TenantCap)
                {
                    e.bucket.set_quota(cap, capacity);
                }
            }
            None => {
                let removed = self.remove_where(|src| src == QuotaSource::TenantCap);
                for _ in 0..removed {
                    PolicyCounters::inc(&self.counters.cap_buckets_evicted);
                }
            }
        }

        // Configured quotas (PD-sourced buckets are left to the PD path unless config wins).
        for (&ks, &mc) in &next.keyspace_cpu_quotas_millicores {
            let us = millicores_to_us_per_interval(mc, next.refill_interval_us);
            let pd_owned = self
                .keyspace(ks)
                .is_some_and(|e| e.source() == QuotaSource::Pd)
                && next.pd_override_config;
            let changed = prev.keyspace_cpu_quotas_millicores.get(&ks) != Some(&mc);
            if (!pd_owned && changed) || self.keyspace(ks).is_none() {
                self.upsert_quota(ks, us, QuotaSource::Config, &next, now_us);
            }
        }
        for ks in prev.keyspace_cpu_quotas_millicores.keys() {
            if !next.keyspace_cpu_quotas_millicores.contains_key(ks) {
                self.remove_keyspace_if(*ks, |e| e.source() == QuotaSource::Config);
            }
        }

        // Per-keyspace static knobs.
        for e in self.keyspaces.iter() {
            let ks = e.id();
            e.set_burst_enabled(
                next.keyspace_burst_enabled
                    .get(&ks)
                    .copied()
                    .unwrap_or(true),
            );
            if prev.keyspace_estimated_cpu_per_request_us.get(&ks)
                != next.keyspace_estimated_cpu_per_request_us.get(&ks)
                || prev.estimated_cpu_per_request_us != next.estimated_cpu_per_request_us
            {
                let est = static_estimate_us(&next, ks);
                e.set_estimate_us(est);
            }
            if !next.enable_burst {
                e.set_burst_allowed(false);
            }
        }

        self.writes
            .set_global_threshold(next.pending_write_threshold_bytes);
        self.admission.set_mode(next.admission_mode);
        self.admission
            .set_max_concurrent_per_tenant(next.max_concurrent_per_tenant);
        if !next.enable_dynamic_adjustment {
            self.global.set_refill(self.global.base_refill_us());
        }
        Ok(())
    }

    /// Removes every keyspace whose quota source matches. Returns how many.
    pub(crate) fn remove_where(&self, pred: impl Fn(QuotaSource) -> bool) -> usize {
        let ids: Vec<u32> = self
            .keyspaces
            .iter()
            .filter(|e| pred(e.source()))
            .map(|e| e.id())
            .collect();
        ids.into_iter()
            .filter(|&ks| self.remove_keyspace_if(ks, |e| pred(e.source())))
            .count()
    }

    /// Current idle TTL of tenant-cap buckets, µs.
    pub fn tenant_cap_idle_ttl_us(&self) -> u64 {
        self.knobs.cap_idle_ttl_us.load(Ordering::Relaxed)
    }
}
