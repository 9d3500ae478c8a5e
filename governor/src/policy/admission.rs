//! Tenant concurrency admission control (tenant-admission-control.md).
//!
//! Bounds the requests one tenant may have in flight. Modes: `disabled` (nothing counted, nothing
//! refused), `monitor` (counted; would-be refusals are recorded but the work runs), `enforced`
//! (over the limit is refused with a [`Refusal::ConcurrencyLimited`], whose text carries the
//! `tenant_admission_control` marker). A limit of 0 means no limit: nothing is refused and monitor
//! never records a breach.

use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use dashmap::DashMap;
use serde::{Deserialize, Serialize};

use super::error::Refusal;
use super::keyspace::IdHasher;

/// How firmly the per-tenant limit is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdmissionMode {
    Disabled,
    Monitor,
    Enforced,
}

impl AdmissionMode {
    fn to_u8(self) -> u8 {
        match self {
            AdmissionMode::Disabled => 0,
            AdmissionMode::Monitor => 1,
            AdmissionMode::Enforced => 2,
        }
    }
    fn from_u8(v: u8) -> Self {
        match v {
            1 => AdmissionMode::Monitor,
            2 => AdmissionMode::Enforced,
            _ => AdmissionMode::Disabled,
        }
    }
}

/// Proof of admission. Give it back with [`TenantAdmission::leave`]; it remembers whether it was
/// counted, so a mode change while requests run never under- or over-counts.
#[derive(Debug)]
#[must_use = "an admission permit must be returned with leave()"]
pub struct AdmissionPermit {
    tenant: u32,
    counted: bool,
}

impl AdmissionPermit {
    pub fn tenant(&self) -> u32 {
        self.tenant
    }
    /// Whether this admission was counted in the tenant's in-flight number.
    pub fn counted(&self) -> bool {
        self.counted
    }
}

/// Counters of admission control.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct AdmissionCounters {
    pub admitted: u64,
    /// Refused in enforced mode.
    pub refused: u64,
    /// Monitor mode: would have been refused, admitted anyway.
    pub monitor_breaches: u64,
}

/// Per-tenant in-flight counters (hot-updatable mode and limit).
#[derive(Debug)]
pub struct TenantAdmission {
    mode: AtomicU8,
    max_concurrent: AtomicU64,
    inflight: DashMap<u32, AtomicU64, BuildHasherDefault<IdHasher>>,
    admitted: AtomicU64,
    refused: AtomicU64,
    monitor_breaches: AtomicU64,
}

impl TenantAdmission {
    pub fn new(mode: AdmissionMode, max_concurrent_per_tenant: u64) -> Self {
        TenantAdmission {
            mode: AtomicU8::new(mode.to_u8()),
            max_concurrent: AtomicU64::new(max_concurrent_per_tenant),
            inflight: DashMap::default(),
            admitted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            monitor_breaches: AtomicU64::new(0),
        }
    }

    pub fn set_mode(&self, mode: AdmissionMode) {
        self.mode.store(mode.to_u8(), Ordering::Release);
    }

    pub fn mode(&self) -> AdmissionMode {
        AdmissionMode::from_u8(self.mode.load(Ordering::Acquire))
    }

    /// 0 = no limit.
    pub fn set_max_concurrent_per_tenant(&self, max: u64) {
        self.max_concurrent.store(max, Ordering::Release);
    }

    /// Admits one request of `tenant`, or refuses it in enforced mode when at the limit.
    pub fn enter(&self, tenant: u32) -> Result<AdmissionPermit, Refusal> {
        let mode = self.mode();
        if mode == AdmissionMode::Disabled {
            self.admitted.fetch_add(1, Ordering::Relaxed);
            return Ok(AdmissionPermit {
                tenant,
                counted: false,
            });
        }
        let limit = self.max_concurrent.load(Ordering::Acquire);
        let counter = self
            .inflight
            .entry(tenant)
            .or_insert_with(|| AtomicU64::new(0));
        let mut cur = counter.load(Ordering::Acquire);
        loop {
            if limit > 0 && cur >= limit {
                if mode == AdmissionMode::Enforced {
                    self.refused.fetch_add(1, Ordering::Relaxed);
                    return Err(Refusal::ConcurrencyLimited {
                        tenant,
                        inflight: cur,
                        limit,
                    });
                }
                self.monitor_breaches.fetch_add(1, Ordering::Relaxed);
                counter.fetch_add(1, Ordering::AcqRel);
                break;
            }
            match counter.compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(actual) => cur = actual,
            }
        }
        self.admitted.fetch_add(1, Ordering::Relaxed);
        Ok(AdmissionPermit {
            tenant,
            counted: true,
        })
    }

    /// Returns a permit; decrements the in-flight count if the permit was counted.
    pub fn leave(&self, permit: AdmissionPermit) {
        if permit.counted
            && let Some(c) = self.inflight.get(&permit.tenant)
        {
            let _ = c.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some(v.saturating_sub(1))
            });
        }
    }

    /// Forgets tenants with nothing in flight, so the table holds only
    /// active tenants however many come and go. A tenant's entry is held
    /// (shard-locked) while `enter` counts into it, and a counted permit
    /// keeps it above zero until `leave`, so no count is lost. Returns how
    /// many entries went.
    pub fn evict_idle(&self) -> usize {
        let before = self.inflight.len();
        self.inflight.retain(|_, c| c.load(Ordering::Acquire) != 0);
        before.saturating_sub(self.inflight.len())
    }

    /// Tenants with an entry (in flight now, or since the last eviction).
    pub fn tracked_tenants(&self) -> usize {
        self.inflight.len()
    }

    /// Requests of `tenant` currently counted in flight.
    pub fn inflight(&self, tenant: u32) -> u64 {
        self.inflight
            .get(&tenant)
            .map(|c| c.load(Ordering::Acquire))
            .unwrap_or(0)
    }

    pub fn counters(&self) -> AdmissionCounters {
        AdmissionCounters {
            admitted: self.admitted.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            monitor_breaches: self.monitor_breaches.load(Ordering::Relaxed),
        }
    }
}
