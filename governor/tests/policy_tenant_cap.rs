//! tenant-cpu-cap.md §7, points 1–7, on a simulated clock (points 8–14, the online updates, are
//! in `policy_tenant_cap_hot.rs`; the config-level halves of 7 and 8 in `config_seed_cap.rs`).

mod common;

use common::{Load, MS, SEC, assert_close, essential, run, steady};
use governor::policy::{
    PdFetch, PdLimit, Policy, QuotaSource, Refusal, Settings, SettingsError, UsageSample,
};
use std::collections::BTreeMap;

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
    let load = [Load {
        keyspace: 9,
        cost_us: 1000,
        per_step: 1000,
    }];
    let warm = run(&p, &load, 0, SEC, MS);
    let out = run(&p, &load, SEC, SEC, MS);
    assert_close(
        out.consumed_us[0] as f64,
        4_800_000.0,
        0.01,
        "held by global",
    );
    assert!(
        out.consumed_us[0] < 5_600_000 * 99 / 100,
        "below the tenant cap"
    );
    assert!(p.counters().global_exhausted > 0);
    assert!(matches!(
        out.last_refusal[0],
        Some(Refusal::GlobalCpuExhausted { keyspace: 9 })
    ));
    // Rollback: every global refusal gave its tenant tokens back, so the tenant bucket was
    // charged exactly what ran (taken − refunded + overrun debt = consumed), nothing in flight.
    let b = p.keyspace(9).unwrap().bucket().snapshot();
    assert_eq!(
        b.taken_total_us + b.debt_total_us - b.refunded_total_us,
        warm.consumed_us[0] + out.consumed_us[0]
    );
    assert_eq!(b.inflight_us, 0);
    assert_eq!(b.ledger_available_us(), b.available_us);
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
    // ...and the policy never bursts a cap bucket, even when every burst condition of the
    // throttle seed holds: idle node, global tokens left, burst budget covering the request.
    let s = Settings {
        enable_runtime_token_management: false,
        ..Settings::essential(8.0, 0.4)
    };
    let p = Policy::new(s, 0).unwrap();
    let cap = p.tenant_cap_refill_us() * 10; // full bucket = burst window
    let g = p.allocate(1, Some(cap), 0).unwrap();
    p.tick(0, Some(&UsageSample::default())); // global ratio 0 published
    assert_eq!(p.global_ratio(), 0.0);
    let global_before = p.global_bucket().available_us();
    assert_eq!(global_before, 480_000 - 320_000, "global has room");
    assert_eq!(
        p.snapshot().burst_budget_us,
        48_000,
        "budget would cover it"
    );
    let err = p.allocate(1, Some(1000), 0).unwrap_err();
    assert_eq!(err, Refusal::TenantCpuExhausted { keyspace: 1 });
    assert_eq!(
        p.global_bucket().available_us(),
        global_before,
        "no global-only take"
    );
    assert_eq!(p.snapshot().burst_budget_us, 48_000);
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
