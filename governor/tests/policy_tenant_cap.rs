//! tenant-cpu-cap.md §7, points 1–6 and 8–14, on a simulated clock.

mod common;

use common::{Load, assert_close, run};
use governor::policy::{
    AdmissionMode, PdFetch, PdLimit, Policy, QuotaSource, Refusal, Settings, SettingsError,
};
use std::collections::BTreeMap;

const SEC: u64 = 1_000_000;
const MS: u64 = 1_000;

fn essential(ratio: f64) -> Policy {
    Policy::new(Settings::essential(8.0, ratio), 0).expect("valid essential profile")
}

/// 1 s warm-up (drains the initial burst-window capacity), then 1 s measured.
fn steady(policy: &Policy, loads: &[Load]) -> Vec<u64> {
    run(policy, loads, 0, SEC, MS);
    run(policy, loads, SEC, SEC, MS).consumed_us
}

#[test]
fn seed_cap_01_single_tenant_is_held_at_cap_and_others_unaffected() {
    let p = essential(0.4); // 8 cores × 0.4 = 3.2 cores = 3.2 s of CPU per second
    let noisy = Load {
        keyspace: 1,
        cost_us: 1000,
        per_step: 1000,
    };
    let victim = Load {
        keyspace: 2,
        cost_us: 1000,
        per_step: 1,
    }; // 1 core
    run(&p, &[noisy, victim], 0, SEC, MS);
    let out = run(&p, &[noisy, victim], SEC, SEC, MS);
    assert_close(
        out.consumed_us[0] as f64,
        3_200_000.0,
        0.01,
        "noisy tenant over 1 s",
    );
    assert_eq!(out.refused[1], 0, "victim below its cap is never refused");
    assert_eq!(out.consumed_us[1], 1_000_000);
    assert!(matches!(
        out.last_refusal[0],
        Some(Refusal::TenantCpuExhausted { keyspace: 1 })
    ));
    assert!(p.counters().tenant_cap_exhausted > 0);
}

#[test]
fn seed_cap_02_multiple_tenants_each_capped_at_the_same_ratio() {
    let p = essential(0.2); // 1.6 cores each; global 4.8 cores
    let loads = [
        Load {
            keyspace: 1,
            cost_us: 1000,
            per_step: 1000,
        },
        Load {
            keyspace: 2,
            cost_us: 500,
            per_step: 1000,
        },
    ];
    let used = steady(&p, &loads);
    for (i, u) in used.iter().enumerate() {
        assert_close(*u as f64, 1_600_000.0, 0.01, &format!("tenant {i}"));
    }
    let snap = p.snapshot();
    assert!(
        snap.keyspaces.iter().all(|k| k.base_refill_us == 16_000),
        "same cap for all"
    );

    // Four greedy tenants want 6.4 cores; the global bucket holds the total at 4.8.
    let p = essential(0.2);
    let loads: Vec<Load> = (1..=4)
        .map(|k| Load {
            keyspace: k,
            cost_us: 1000,
            per_step: 1000,
        })
        .collect();
    let used = steady(&p, &loads);
    let total: u64 = used.iter().sum();
    assert_close(
        total as f64,
        4_800_000.0,
        0.01,
        "total held by the global bucket",
    );
    assert!(
        used.iter().all(|&u| u <= 1_600_000 + 1000),
        "no tenant above its cap: {used:?}"
    );
    // Free competition within the caps: the global budget is shared evenly (1.2 cores each).
    for u in &used {
        assert_close(
            *u as f64,
            1_200_000.0,
            0.02,
            "even share under global pressure",
        );
    }
}

#[test]
fn seed_cap_03_global_bucket_is_the_bottleneck_when_cap_exceeds_read_ratio() {
    let p = essential(0.7); // cap 5.6 cores > global 4.8 cores
    let used = steady(
        &p,
        &[Load {
            keyspace: 9,
            cost_us: 1000,
            per_step: 1000,
        }],
    );
    assert_close(used[0] as f64, 4_800_000.0, 0.01, "held by global");
    assert!(p.counters().global_exhausted > 0);
    // Rollback: the tenant bucket lost nothing on global refusals beyond what was consumed.
    let ks = p.snapshot().keyspaces[0].clone();
    assert_eq!(ks.bucket.ledger_available_us(), ks.available_us);
}

#[test]
fn seed_cap_04_no_keyspace_gets_skip_throttle_in_cap_mode() {
    let p = essential(0.4);
    for ks in 100..200 {
        let g = p.allocate(ks, Some(10), 0).unwrap();
        assert!(!g.is_skip(), "keyspace {ks} skipped");
        assert_eq!(g.tenant_us(), 10);
        p.release(g, 10);
    }
    assert_eq!(p.keyspace_count(), 100);
    assert_eq!(p.counters().skipped, 0);
    assert_eq!(p.counters().cap_buckets_created, 100);
}

#[test]
fn seed_cap_05_exhausted_tenant_never_bursts() {
    // Config validation forbids burst with the cap...
    let mut s = Settings::essential(8.0, 0.4);
    s.enable_burst = true;
    assert!(matches!(
        s.validate(),
        Err(SettingsError::CapModeConflict {
            key: "enable-burst",
            ..
        })
    ));
    // ...and the policy never bursts a cap bucket even when the node is idle.
    let s = Settings {
        enable_runtime_token_management: false,
        ..Settings::essential(8.0, 0.4)
    };
    let p = Policy::new(s, 0).unwrap();
    let cap = p.tenant_cap_refill_us() * 10; // full bucket = burst window
    let g = p.allocate(1, Some(cap), 0).unwrap();
    p.tick(10 * MS, Some(&Default::default())); // low global ratio published
    let err = p.allocate(1, Some(cap), 10 * MS).unwrap_err();
    assert_eq!(err, Refusal::TenantCpuExhausted { keyspace: 1 });
    assert_eq!(p.counters().burst_granted, 0);
    assert!(!p.keyspace(1).unwrap().burst_allowed());
    p.release(g, cap);
}

#[test]
fn seed_cap_06_no_pd_dependency() {
    let p = essential(0.4);
    // No PD fetch at all: buckets are still created and capped uniformly.
    let a = p.allocate(1, Some(100), 0).unwrap();
    let b = p.allocate(2, Some(100), 0).unwrap();
    assert_eq!(p.keyspace(1).unwrap().bucket().base_refill_us(), 32_000);
    assert_eq!(p.keyspace(2).unwrap().bucket().base_refill_us(), 32_000);
    assert_eq!(p.keyspace(1).unwrap().source(), QuotaSource::TenantCap);
    // PD answers are ignored with enable-pd-service-limit = false.
    let fetch = PdFetch::Fetched(BTreeMap::from([
        (1, PdLimit::Limit(5.0)),
        (2, PdLimit::NotFound),
    ]));
    assert!(p.apply_pd_service_limits(0, &fetch).is_empty());
    assert_eq!(p.keyspace(1).unwrap().bucket().base_refill_us(), 32_000);
    p.release(a, 100);
    p.release(b, 100);
}

#[test]
fn seed_cap_07_conflicting_settings_are_rejected_in_cap_mode() {
    // Config validation proper belongs to the config module; this checks the policy's own
    // `Settings::validate`, which `Policy::new` and every online update run.
    let base = Settings::essential(8.0, 0.4);
    assert!(base.validate().is_ok());
    type Tweak = fn(&mut Settings);
    let cases: [(&str, Tweak); 6] = [
        ("keyspace-cpu-quotas", |s| {
            s.keyspace_cpu_quotas_millicores.insert(1, 1000);
        }),
        ("enable-pd-service-limit", |s| {
            s.enable_pd_service_limit = true
        }),
        ("enable-fair-allocation", |s| {
            s.enable_fair_allocation = true
        }),
        ("enable-dynamic-adjustment", |s| {
            s.enable_dynamic_adjustment = true
        }),
        ("enable-burst", |s| s.enable_burst = true),
        ("enforce-global-limit", |s| s.enforce_global_limit = false),
    ];
    for (key, f) in cases {
        let mut s = base.clone();
        f(&mut s);
        match Policy::new(s, 0) {
            Err(SettingsError::CapModeConflict { key: k, .. }) => assert_eq!(k, key),
            other => panic!("{key}: expected a cap-mode conflict, got {other:?}"),
        }
    }
    let mut s = base.clone();
    s.tenant_max_cpu_ratio = 1.5;
    assert!(matches!(
        s.validate(),
        Err(SettingsError::InvalidValue {
            key: "tenant-max-cpu-ratio",
            ..
        })
    ));
}

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
