//! tenant-admission-control.md: disabled / monitor / enforced, 0 = no limit, marker string.
//! Admission control runs on the fast path ([`Policy::admit`]): a request's place among its
//! tenant's in-flight requests is held by its grant and given back when the grant is released.

mod common;

use common::{SEC, base};
use keyspace_governor::config::AdmissionControl;
use keyspace_governor::policy::{
    AdmissionMode, Demand, Grant, Policy, Refusal, Settings, TENANT_ADMISSION_CONTROL_MARKER,
};

fn settings(mode: AdmissionMode, max: u64) -> Settings {
    let mut s = base();
    s.admission = AdmissionControl { mode, max_concurrent_per_tenant: max as u32 };
    s
}

fn policy(mode: AdmissionMode, max: u64) -> Policy {
    Policy::new(settings(mode, max), 0).unwrap()
}

/// One request of `tenant` (no CPU quota: only the admission checks apply).
fn enter(p: &Policy, tenant: u32) -> Result<Grant, Refusal> {
    p.admit(tenant, &Demand::default(), 0)
}

fn refused_and_breaches(p: &Policy) -> (u64, u64) {
    let c = p.counters();
    (c.concurrency_refused, c.concurrency_monitor_breaches)
}

#[test]
fn admission_disabled_counts_nothing_and_refuses_nothing() {
    let p = policy(AdmissionMode::Disabled, 1);
    let grants: Vec<_> = (0..10).map(|_| enter(&p, 1).unwrap()).collect();
    assert_eq!(p.inflight_requests(1), 0);
    assert!(grants.iter().all(|g| !g.counted()));
    grants.into_iter().for_each(|g| p.release(g, 0));
    assert_eq!(p.inflight_requests(1), 0);
    assert_eq!(refused_and_breaches(&p), (0, 0));
}

#[test]
fn admission_monitor_counts_breaches_but_admits() {
    let p = policy(AdmissionMode::Monitor, 2);
    let grants: Vec<_> = (0..5).map(|_| enter(&p, 1).unwrap()).collect();
    assert!(grants.iter().all(|g| g.counted()));
    assert_eq!(p.inflight_requests(1), 5);
    assert_eq!(refused_and_breaches(&p), (0, 3));
    let snap = p.snapshot();
    assert_eq!(snap.admission_mode, AdmissionMode::Monitor);
    assert_eq!(snap.max_concurrent_per_tenant, 2);
    grants.into_iter().for_each(|g| p.release(g, 0));
    assert_eq!(p.inflight_requests(1), 0);
}

#[test]
fn admission_enforced_refuses_over_the_limit_with_the_marker() {
    let p = policy(AdmissionMode::Enforced, 2);
    let x = enter(&p, 1).unwrap();
    let y = enter(&p, 1).unwrap();
    let err = enter(&p, 1).unwrap_err();
    assert_eq!(err, Refusal::ConcurrencyLimited { tenant: 1, inflight: 2, limit: 2 });
    assert!(err.to_string().contains(TENANT_ADMISSION_CONTROL_MARKER));
    assert_eq!(TENANT_ADMISSION_CONTROL_MARKER, "tenant_admission_control");
    assert!(err.is_tenant_admission_control());
    assert_eq!(err.code(), "tenant_admission_control");
    // A refusal holds nothing.
    assert_eq!(p.inflight_requests(1), 2);
    // Other refusals do not carry the marker.
    assert!(!Refusal::GlobalCpuExhausted { keyspace: 1 }.is_tenant_admission_control());
    let other = enter(&p, 2).unwrap(); // per tenant
    p.release(x, 0);
    let z = enter(&p, 1).unwrap();
    assert_eq!(refused_and_breaches(&p), (1, 0));
    for g in [y, z, other] {
        p.release(g, 0);
    }
    assert_eq!(p.inflight_requests(1), 0);
    assert_eq!(p.inflight_requests(2), 0);
}

#[test]
fn admission_limit_zero_is_no_limit_in_every_mode() {
    for mode in [AdmissionMode::Monitor, AdmissionMode::Enforced] {
        let p = policy(mode, 0);
        let grants: Vec<_> = (0..1000).map(|_| enter(&p, 1).unwrap()).collect();
        assert_eq!(p.inflight_requests(1), 1000, "{mode:?}: counted");
        assert_eq!(refused_and_breaches(&p), (0, 0), "{mode:?}: 0 never refuses nor reports a breach");
        grants.into_iter().for_each(|g| p.release(g, 0));
        assert_eq!(p.inflight_requests(1), 0);
    }
}

#[test]
fn admission_mode_change_while_running_keeps_counts_exact() {
    let p = policy(AdmissionMode::Monitor, 1);
    let counted = enter(&p, 1).unwrap();
    assert!(counted.counted());
    let mut s = p.settings().clone();
    s.admission.mode = AdmissionMode::Disabled;
    p.update_settings(s).unwrap();
    let uncounted = enter(&p, 1).unwrap();
    assert!(!uncounted.counted());
    p.release(uncounted, 0);
    assert_eq!(p.inflight_requests(1), 1, "an uncounted grant gives back nothing");
    // Enforced with the count still held: the limit of 1 is reached.
    let mut s = p.settings().clone();
    s.admission.mode = AdmissionMode::Enforced;
    p.update_settings(s).unwrap();
    assert!(matches!(enter(&p, 1), Err(Refusal::ConcurrencyLimited { inflight: 1, limit: 1, .. })));
    p.release(counted, 0);
    assert_eq!(p.inflight_requests(1), 0);
    let g = enter(&p, 1).unwrap();
    p.release(g, 0);
}

#[test]
fn admission_limit_change_while_running_applies_to_the_next_request() {
    let p = policy(AdmissionMode::Enforced, 3);
    let held: Vec<_> = (0..3).map(|_| enter(&p, 1).unwrap()).collect();
    let mut s = p.settings().clone();
    s.admission.max_concurrent_per_tenant = 2;
    p.update_settings(s).unwrap();
    assert!(matches!(enter(&p, 1), Err(Refusal::ConcurrencyLimited { inflight: 3, limit: 2, .. })));
    held.into_iter().for_each(|g| p.release(g, 0));
    assert_eq!(p.inflight_requests(1), 0);
}

/// The seed's per-tenant counters must not pile up on a node that sees many tenants come and
/// go. In-flight counts live in the tenant's keyspace cell; cells with nothing in flight are
/// given up after the idle TTL, while a busy tenant keeps its cell and its count.
#[test]
fn idle_tenants_are_forgotten_and_busy_ones_kept_with_their_count() {
    let p = policy(AdmissionMode::Enforced, 2);
    let ttl = p.tenant_cap_idle_ttl_us();
    assert_eq!(ttl, 600 * SEC, "tenant-cap-idle-ttl default");
    // 1000 tenants come and go; tenant 7 stays busy with two requests.
    for t in 0..1000u32 {
        let g = enter(&p, t).unwrap();
        p.release(g, 0);
    }
    // Tenant 500 was refused once while it was busy, then went idle.
    let held: Vec<_> = (0..2).map(|_| enter(&p, 500).unwrap()).collect();
    assert!(enter(&p, 500).is_err());
    held.into_iter().for_each(|g| p.release(g, 0));
    let busy: Vec<_> = (0..2).map(|_| enter(&p, 7).unwrap()).collect();
    assert_eq!(p.cells_in_use(), 1000);
    assert_eq!(p.keyspace_count(), 0, "no CPU buckets: cells for the limits only");
    // Not before the TTL...
    assert_eq!(p.tick(ttl - SEC, None).evicted, 0);
    assert_eq!(p.cells_in_use(), 1000);
    // ...then every idle tenant goes.
    let report = p.tick(ttl + SEC, None);
    assert_eq!(report.evicted, 999);
    assert_eq!(p.cells_in_use(), 1);
    // The busy tenant's count survived: it is still at its limit.
    assert_eq!(p.inflight_requests(7), 2);
    assert!(matches!(p.admit(7, &Demand::default(), ttl + SEC), Err(Refusal::ConcurrencyLimited { inflight: 2, .. })));
    busy.into_iter().for_each(|g| p.release(g, 0));
    assert_eq!(p.inflight_requests(7), 0);
    let g = p.admit(7, &Demand::default(), ttl + SEC).unwrap();
    p.release(g, 0);
    // A forgotten tenant starts again from zero.
    assert_eq!(p.inflight_requests(3), 0);
    let g = p.admit(3, &Demand::default(), ttl + SEC).unwrap();
    assert_eq!(p.inflight_requests(3), 1);
    p.release(g, 0);
    // Counters of given-up cells stay in the node-wide totals (tenant 500's and tenant 7's).
    assert_eq!(p.counters().concurrency_refused, 2);
}
