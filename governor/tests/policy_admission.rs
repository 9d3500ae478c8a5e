//! tenant-admission-control.md: disabled / monitor / enforced, 0 = no limit, marker string.

use governor::policy::{
    AdmissionMode, Policy, Refusal, Settings, TENANT_ADMISSION_CONTROL_MARKER,
};

fn policy(mode: AdmissionMode, max: u64) -> Policy {
    Policy::new(
        Settings {
            admission_mode: mode,
            max_concurrent_per_tenant: max,
            ..Settings::default()
        },
        0,
    )
    .unwrap()
}

#[test]
fn admission_disabled_counts_nothing_and_refuses_nothing() {
    let p = policy(AdmissionMode::Disabled, 1);
    let a = p.admission();
    let permits: Vec<_> = (0..10).map(|_| a.enter(1).unwrap()).collect();
    assert_eq!(a.inflight(1), 0);
    assert!(permits.iter().all(|p| !p.counted()));
    permits.into_iter().for_each(|p| a.leave(p));
    let c = a.counters();
    assert_eq!((c.refused, c.monitor_breaches), (0, 0));
}

#[test]
fn admission_monitor_counts_breaches_but_admits() {
    let p = policy(AdmissionMode::Monitor, 2);
    let a = p.admission();
    let permits: Vec<_> = (0..5).map(|_| a.enter(1).unwrap()).collect();
    assert_eq!(a.inflight(1), 5);
    assert_eq!(a.counters().monitor_breaches, 3);
    assert_eq!(a.counters().refused, 0);
    permits.into_iter().for_each(|p| a.leave(p));
    assert_eq!(a.inflight(1), 0);
}

#[test]
fn admission_enforced_refuses_over_the_limit_with_the_marker() {
    let p = policy(AdmissionMode::Enforced, 2);
    let a = p.admission();
    let x = a.enter(1).unwrap();
    let y = a.enter(1).unwrap();
    let err = a.enter(1).unwrap_err();
    assert_eq!(
        err,
        Refusal::ConcurrencyLimited {
            tenant: 1,
            inflight: 2,
            limit: 2
        }
    );
    assert!(err.to_string().contains(TENANT_ADMISSION_CONTROL_MARKER));
    assert_eq!(TENANT_ADMISSION_CONTROL_MARKER, "tenant_admission_control");
    assert!(err.is_tenant_admission_control());
    assert_eq!(err.reason(), "tenant_admission_control");
    let other = a.enter(2).unwrap(); // per tenant
    a.leave(x);
    let z = a.enter(1).unwrap();
    assert_eq!(a.counters().refused, 1);
    for p in [y, z, other] {
        a.leave(p);
    }
    assert_eq!(a.inflight(1), 0);
}

#[test]
fn admission_limit_zero_is_no_limit_in_every_mode() {
    for mode in [AdmissionMode::Monitor, AdmissionMode::Enforced] {
        let p = policy(mode, 0);
        let a = p.admission();
        let permits: Vec<_> = (0..1000).map(|_| a.enter(1).unwrap()).collect();
        assert_eq!(a.inflight(1), 1000);
        assert_eq!(
            a.counters().monitor_breaches,
            0,
            "{mode:?}: 0 never reports a breach"
        );
        assert_eq!(a.counters().refused, 0);
        permits.into_iter().for_each(|p| a.leave(p));
    }
}

#[test]
fn admission_mode_change_while_running_keeps_counts_exact() {
    let p = policy(AdmissionMode::Monitor, 1);
    let a = p.admission();
    let counted = a.enter(1).unwrap();
    let mut s = p.settings();
    s.admission_mode = AdmissionMode::Disabled;
    p.update_settings(s).unwrap();
    let uncounted = a.enter(1).unwrap();
    a.leave(uncounted);
    assert_eq!(a.inflight(1), 1);
    a.leave(counted);
    assert_eq!(a.inflight(1), 0);
}

#[test]
fn idle_tenants_are_forgotten_and_busy_ones_kept_with_their_count() {
    let p = policy(AdmissionMode::Enforced, 2);
    let a = p.admission();
    // 1000 tenants come and go; tenant 7 stays busy with two requests.
    for t in 0..1000u32 {
        let permit = a.enter(t).unwrap();
        a.leave(permit);
    }
    let busy: Vec<_> = (0..2).map(|_| a.enter(7).unwrap()).collect();
    assert_eq!(a.tracked_tenants(), 1000);
    let report = p.tick(1_000_000, Some(&governor::policy::UsageSample::default()));
    assert_eq!(report.admission_evicted, 999);
    assert_eq!(a.tracked_tenants(), 1);
    // The busy tenant's count survived: it is still at its limit.
    assert!(matches!(a.enter(7), Err(Refusal::ConcurrencyLimited { inflight: 2, .. })));
    busy.into_iter().for_each(|p| a.leave(p));
    assert_eq!(a.inflight(7), 0);
    assert!(a.enter(7).is_ok());
}
