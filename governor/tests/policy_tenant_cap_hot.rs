//! tenant-cpu-cap.md §7, points 8–14: online updates, runtime top-up, low-priority DAG, Premium
//! compatibility, cap hot update / disable, idle-TTL hot update (points 1–7 are in
//! `policy_tenant_cap.rs`).

mod common;

use common::{Load, MS, SEC, assert_close, essential, run, steady};
use governor::policy::{AdmissionMode, Policy, Refusal, Settings, SettingsError};

#[test]
fn seed_cap_08_conflicting_online_update_is_rejected_as_a_whole() {
    let p = essential(0.4);
    let before = p.settings();
    let mut next = before.clone();
    next.tenant_max_cpu_ratio = 0.3; // fine on its own
    next.admission_mode = AdmissionMode::Enforced; // fine on its own
    next.enable_fair_allocation = true; // conflicts with the cap
    assert!(matches!(
        p.update_settings(next),
        Err(SettingsError::CapModeConflict { .. })
    ));
    assert_eq!(p.settings(), before, "nothing applied");
    assert_eq!(p.tenant_max_cpu_ratio(), 0.4);
    assert_eq!(p.admission().mode(), AdmissionMode::Disabled);
    let mut restart = before.clone();
    restart.refill_interval_us = 100_000;
    assert!(matches!(
        p.update_settings(restart),
        Err(SettingsError::RestartOnly {
            key: "refill-interval"
        })
    ));
}

#[test]
fn seed_cap_09_runtime_top_up_uses_only_tenant_and_global_buckets() {
    let p = essential(0.4);
    // Initial estimate capped at min(global, tenant) / 10 with runtime token management.
    let g0 = p.allocate(1, Some(1_000_000), 0).unwrap();
    assert_eq!(g0.granted_us(), 32_000, "min(480_000, 320_000) / 10");
    let mut g = g0;
    p.allocate_more(&mut g, 4000, 1).unwrap();
    assert_eq!((g.tenant_us(), g.global_us()), (36_000, 36_000));
    // Drain the tenant bucket; the next top-up is refused with no burst / global-only fallback.
    let left = p.keyspace(1).unwrap().bucket().available_us() as u64;
    p.allocate_more(&mut g, left, 2).unwrap();
    let global_before = p.global_bucket().available_us();
    let err = p.allocate_more(&mut g, 4000, 3).unwrap_err();
    assert_eq!(err, Refusal::TenantCpuExhausted { keyspace: 1 });
    assert_eq!(
        p.global_bucket().available_us(),
        global_before,
        "global untouched"
    );
    assert!(!g.is_burst());
    let c = p.counters();
    assert_eq!(
        (c.topup_granted, c.topup_refused, c.burst_granted),
        (2, 1, 0)
    );
    p.release(g, 320_000);
    assert_eq!(p.keyspace(1).unwrap().bucket().inflight_us(), 0);
    assert_eq!(p.global_bucket().inflight_us(), 0);
}

#[test]
fn seed_cap_10_low_priority_dag_is_cap_aware() {
    // The Essential profile keeps the low-priority DAG bucket off...
    assert!(!Settings::essential(8.0, 0.4).low_priority_dag_global_enabled);
    // ...and when a test profile enables it, unknown keyspaces still pass their tenant cap.
    let mut s = Settings::essential(8.0, 0.4);
    s.low_priority_dag_global_enabled = true;
    s.low_priority_dag_cpu_ratio = 0.5; // 40_000 µs per interval, larger than the cap
    s.enable_runtime_token_management = false;
    let p = Policy::new(s, 0).unwrap();
    // Unknown keyspace: low-priority bucket, then its tenant cap bucket.
    let g = p.allocate_low_priority(7, Some(320_000), 0).unwrap();
    assert_eq!(
        (g.low_priority_us(), g.tenant_us(), g.global_us()),
        (320_000, 320_000, 320_000)
    );
    let low_before = p.low_priority_bucket().available_us();
    let err = p.allocate_low_priority(7, Some(1000), 0).unwrap_err();
    assert_eq!(err, Refusal::TenantCpuExhausted { keyspace: 7 });
    assert_eq!(
        p.low_priority_bucket().available_us(),
        low_before,
        "low-priority rolled back"
    );
    p.release(g, 320_000);

    // Premium (no cap): an unknown keyspace uses the legacy global-only fallback.
    let s = Settings {
        low_priority_dag_global_enabled: true,
        ..Settings::default()
    };
    let p = Policy::new(s, 0).unwrap();
    let g = p.allocate_low_priority(7, Some(1000), 0).unwrap();
    assert!(!g.is_skip());
    assert_eq!(
        (g.tenant_us(), g.global_us(), g.low_priority_us()),
        (0, 1000, 1000)
    );
    p.release(g, 500);
    assert_eq!(p.global_bucket().inflight_us(), 0);
    assert_eq!(p.low_priority_bucket().inflight_us(), 0);
}

#[test]
fn seed_cap_11_premium_mode_is_unchanged() {
    let mut s = Settings::default();
    s.keyspace_cpu_quotas_millicores.insert(1, 1000); // 1 core = 10_000 µs per 10 ms
    let p = Policy::new(s, 0).unwrap();
    let g = p.allocate(42, Some(1_000_000), 0).unwrap();
    assert!(g.is_skip(), "unknown keyspace skips throttling");
    p.release(g, 1_000_000);
    assert_eq!(p.keyspace_count(), 1);
    let used = steady(
        &p,
        &[Load {
            keyspace: 1,
            cost_us: 1000,
            per_step: 1000,
        }],
    );
    assert_close(
        used[0] as f64,
        1_000_000.0,
        0.01,
        "configured 1000 millicores",
    );
    assert!(p.counters().keyspace_exhausted > 0);
    assert_eq!(p.counters().skipped, 1);
}

#[test]
fn seed_cap_12_hot_update_recomputes_every_cap_bucket() {
    let p = essential(0.4);
    let held = p.allocate(1, Some(30_000), 0).unwrap();
    for ks in 2..=5 {
        let g = p.allocate(ks, Some(10), 0).unwrap();
        p.release(g, 10);
    }
    p.set_tenant_max_cpu_ratio(0.2).unwrap();
    for ks in 1..=5 {
        let b = p.keyspace(ks).unwrap();
        assert_eq!(b.bucket().base_refill_us(), 16_000);
        assert_eq!(b.bucket().capacity_us(), 160_000);
    }
    // Keyspace 1 has 30_000 µs in flight > new quota 16_000: debt until it drains.
    let k1 = p.keyspace(1).unwrap();
    assert!(k1.bucket().in_debt());
    assert!(k1.bucket().available_us() <= 0);
    p.tick(10 * MS, None);
    assert!(k1.bucket().available_us() <= 0, "no refill while in debt");
    assert!(p.allocate(1, Some(1), 10 * MS).is_err());
    p.release(held, 30_000);
    p.tick(20 * MS, None);
    assert_eq!(k1.bucket().available_us(), 16_000);
    let g = p.allocate(1, Some(1000), 20 * MS).unwrap();
    p.release(g, 1000);
    let used = run(
        &p,
        &[Load {
            keyspace: 3,
            cost_us: 1000,
            per_step: 1000,
        }],
        SEC,
        SEC,
        MS,
    )
    .consumed_us;
    let used2 = run(
        &p,
        &[Load {
            keyspace: 3,
            cost_us: 1000,
            per_step: 1000,
        }],
        2 * SEC,
        SEC,
        MS,
    )
    .consumed_us;
    assert!(used[0] > 0);
    assert_close(
        used2[0] as f64,
        1_600_000.0,
        0.01,
        "new cap after hot update",
    );
}

#[test]
fn seed_cap_13_disabling_the_cap_removes_auto_created_buckets() {
    let mut s = Settings::essential(8.0, 0.4);
    s.enforce_global_limit = true;
    let p = Policy::new(s, 0).unwrap();
    for ks in 1..=3 {
        let g = p.allocate(ks, Some(10), 0).unwrap();
        p.release(g, 10);
    }
    assert_eq!(p.keyspace_count(), 3);
    p.set_tenant_max_cpu_ratio(0.0).unwrap();
    assert_eq!(p.keyspace_count(), 0);
    let g = p.allocate(1, Some(10_000_000), 0).unwrap();
    assert!(g.is_skip(), "reverted to legacy skip-throttle");
    p.release(g, 10_000_000);
    // And re-enabling creates them again.
    p.set_tenant_max_cpu_ratio(0.4).unwrap();
    let g = p.allocate(1, Some(10), 0).unwrap();
    assert!(!g.is_skip());
    p.release(g, 10);
}

#[test]
fn seed_cap_14_idle_ttl_is_hot_updatable() {
    let p = essential(0.4);
    assert_eq!(p.tenant_cap_idle_ttl_us(), 600 * SEC);
    let g = p.allocate(1, Some(10), 0).unwrap();
    p.release(g, 10);
    let held = p.allocate(2, Some(10), 0).unwrap();
    assert_eq!(
        p.tick(120 * SEC, None).evicted,
        0,
        "2 min idle < 10 min TTL"
    );
    p.set_tenant_cap_idle_ttl_us(60 * SEC).unwrap();
    let report = p.tick(121 * SEC, None);
    assert_eq!(report.evicted, 1, "next scan uses the new TTL");
    assert!(p.keyspace(1).is_none());
    assert!(
        p.keyspace(2).is_some(),
        "in-flight tokens keep a bucket alive"
    );
    p.release(held, 10);
    assert_eq!(p.tick(122 * SEC, None).evicted, 1);
    assert_eq!(p.counters().cap_buckets_evicted, 2);
    assert!(
        p.set_tenant_cap_idle_ttl_us(0).is_err(),
        "TTL must be at least 1 ms"
    );
}

#[test]
fn online_update_that_does_not_shrink_the_cap_leaves_busy_buckets_alone() {
    let p = essential(0.4); // 32_000 µs per interval
    let a = p.allocate(1, Some(30_000), 0).unwrap();
    let b = p.allocate(1, Some(25_000), 0).unwrap();
    let k = p.keyspace(1).unwrap();
    assert_eq!(
        k.bucket().inflight_us(),
        55_000,
        "more in flight than one interval's cap"
    );
    let available = k.bucket().available_us();
    // An unrelated change (admission mode) must not touch the tenant buckets.
    let mut next = p.settings();
    next.admission_mode = AdmissionMode::Monitor;
    p.update_settings(next).unwrap();
    assert!(!k.bucket().in_debt(), "unchanged cap is not a shrink");
    assert_eq!(k.bucket().available_us(), available);
    // Raising the cap is not a shrink either, even with more in flight than the new quota.
    p.set_tenant_max_cpu_ratio(0.5).unwrap(); // 40_000 < 55_000 in flight
    assert!(!k.bucket().in_debt());
    assert_eq!(k.bucket().base_refill_us(), 40_000);
    assert_eq!(k.bucket().available_us(), available);
    let g = p.allocate(1, Some(1000), 0).unwrap();
    for g in [a, b, g] {
        let used = g.granted_us();
        p.release(g, used);
    }
    assert_eq!(k.bucket().inflight_us(), 0);
}
