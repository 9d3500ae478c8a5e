//! tenant-cpu-cap.md §7, points 1–6, on a simulated clock (points 8–14, the online updates, are
//! in `policy_tenant_cap_hot.rs`). Point 7 (conflicting settings rejected) and the
//! configuration half of point 5 (`enable-burst = true` refused with the cap) are checked where
//! they are enforced, by the configuration: `config_seed_cap.rs`.

mod common;

use common::{CORES, Load, MS, SEC, assert_close, essential, essential_settings, run, steady};
use keyspace_governor::policy::{PdFetch, PdLimit, Policy, QuotaSource, Refusal, UsageSample};
use std::collections::BTreeMap;

#[test]
fn seed_cap_01_single_tenant_is_held_at_cap_and_others_unaffected() {
    let p = essential(0.4); // 8 cores × 0.4 = 3.2 cores = 3.2 s of CPU per second
    let noisy = Load { keyspace: 1, cost_us: 1000, per_step: 1000 };
    let victim = Load { keyspace: 2, cost_us: 1000, per_step: 1 }; // 1 core
    run(&p, &[noisy, victim], 0, SEC, MS);
    let out = run(&p, &[noisy, victim], SEC, SEC, MS);
    assert_close(out.consumed_us[0] as f64, 3_200_000.0, 0.01, "noisy tenant over 1 s");
    assert_eq!(out.refused[1], 0, "victim below its cap is never refused");
    assert_eq!(out.consumed_us[1], 1_000_000);
    assert!(matches!(out.last_refusal[0], Some(Refusal::TenantCpuExhausted { keyspace: 1 })));
    assert!(p.counters().tenant_cap_exhausted > 0);
}

#[test]
fn seed_cap_02_multiple_tenants_each_capped_at_the_same_ratio() {
    let p = essential(0.2); // 1.6 cores each; global 4.8 cores
    let loads =
        [Load { keyspace: 1, cost_us: 1000, per_step: 1000 }, Load { keyspace: 2, cost_us: 500, per_step: 1000 }];
    let used = steady(&p, &loads);
    for (i, u) in used.iter().enumerate() {
        assert_close(*u as f64, 1_600_000.0, 0.01, &format!("tenant {i}"));
    }
    let snap = p.snapshot();
    assert!(snap.keyspaces.iter().all(|k| k.base_refill_us == 16_000), "same cap for all");

    // Four greedy tenants want 6.4 cores; the global bucket holds the total at 4.8.
    let p = essential(0.2);
    let loads: Vec<Load> = (1..=4).map(|k| Load { keyspace: k, cost_us: 1000, per_step: 1000 }).collect();
    let used = steady(&p, &loads);
    let total: u64 = used.iter().sum();
    assert_close(total as f64, 4_800_000.0, 0.01, "total held by the global bucket");
    assert!(used.iter().all(|&u| u <= 1_600_000 + 1000), "no tenant above its cap: {used:?}");
    // Free competition within the caps: the global budget is shared evenly (1.2 cores each).
    for u in &used {
        assert_close(*u as f64, 1_200_000.0, 0.02, "even share under global pressure");
    }
}

#[test]
fn seed_cap_03_global_bucket_is_the_bottleneck_when_cap_exceeds_read_ratio() {
    let p = essential(0.7); // cap 5.6 cores > global 4.8 cores
    let load = [Load { keyspace: 9, cost_us: 1000, per_step: 1000 }];
    let warm = run(&p, &load, 0, SEC, MS);
    let out = run(&p, &load, SEC, SEC, MS);
    assert_close(out.consumed_us[0] as f64, 4_800_000.0, 0.01, "held by global");
    assert!(out.consumed_us[0] < 5_600_000 * 99 / 100, "below the tenant cap");
    assert!(p.counters().global_exhausted > 0);
    assert!(matches!(out.last_refusal[0], Some(Refusal::GlobalCpuExhausted { keyspace: 9 })));
    // Rollback: every global refusal gave its tenant tokens back, so the tenant bucket was
    // charged exactly what ran (taken − refunded + overrun debt = consumed), nothing in flight.
    let e = p.keyspace(9).unwrap();
    let b = e.bucket().snapshot();
    assert_eq!(e.counters().debt_forgiven_us, 0);
    assert_eq!(b.taken_total_us + b.debt_total_us - b.refunded_total_us, warm.consumed_us[0] + out.consumed_us[0]);
    assert_eq!(e.counters().consumed_us, warm.consumed_us[0] + out.consumed_us[0]);
    assert!(e.counters().refused_global > 0, "refused by the global bucket, not the cap");
    assert_eq!(e.counters().refused_keyspace, 0);
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
    // The configuration refuses `enable-burst = true` with the cap (config_seed_cap.rs). The
    // policy never bursts a cap bucket even when handed settings that ask for it, and every
    // burst condition of the throttle seed holds: idle node, global tokens left, burst budget
    // covering the request.
    let mut s = essential_settings(CORES, 0.4);
    s.throttle_mut().enable_runtime_token_management = false;
    s.throttle_mut().enable_burst = true; // forbidden by the configuration; the policy must still not burst
    let p = Policy::new(s, 0).unwrap();
    let cap = p.tenant_cap_refill_us() * 10; // full bucket = burst window
    assert_eq!(cap, 320_000);
    let g = p.allocate(1, Some(cap), 0).unwrap();
    p.tick(0, Some(&UsageSample::default())); // global ratio 0 published
    assert_eq!(p.global_ratio(), 0.0);
    let global_before = p.global_bucket().available_us();
    assert_eq!(global_before, 480_000 - 320_000, "global has room");
    assert_eq!(p.snapshot().burst_budget_us, 48_000, "budget would cover it");
    let err = p.allocate(1, Some(1000), 0).unwrap_err();
    assert_eq!(err, Refusal::TenantCpuExhausted { keyspace: 1 });
    assert_eq!(err.code(), "tenant_cap_exhausted");
    assert_eq!(p.global_bucket().available_us(), global_before, "no global-only take");
    assert_eq!(p.snapshot().burst_budget_us, 48_000);
    assert_eq!(p.counters().burst_granted, 0);
    assert_eq!(p.counters().tenant_cap_exhausted, 1);
    assert!(!p.keyspace(1).unwrap().burst_allowed());
    // Nor does a runtime top-up burst.
    let mut g = g;
    assert_eq!(p.allocate_more(&mut g, 1000, 0).unwrap_err(), Refusal::TenantCpuExhausted { keyspace: 1 });
    assert!(!g.is_burst());
    assert_eq!(p.global_bucket().available_us(), global_before);
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
    let fetch = PdFetch::Fetched(BTreeMap::from([(1, PdLimit::Limit(5.0)), (2, PdLimit::NotFound)]));
    assert!(p.apply_pd_service_limits(0, &fetch).is_empty());
    assert_eq!(p.keyspace(1).unwrap().bucket().base_refill_us(), 32_000);
    p.release(a, 100);
    p.release(b, 100);
}

/// The tests' Essential helper is the seed's §4.1 profile (the fixture the configuration tests
/// validate), with the adaptive estimate off so that estimates stay where the tests put them.
#[test]
fn essential_helper_is_the_seed_profile() {
    let fixture = include_str!("fixtures/seed_cap_essential.toml");
    let mut from_fixture = keyspace_governor::policy::Settings::from_toml(fixture, CORES).unwrap();
    assert!(from_fixture.throttle().enable_adaptive_estimated_cpu_per_request_us, "the profile leaves the default on");
    from_fixture.throttle_mut().enable_adaptive_estimated_cpu_per_request_us = false;
    assert_eq!(essential_settings(CORES, 0.4), from_fixture);
    let s = essential_settings(CORES, 0.4);
    assert!(s.cap_mode() && s.throttle().enabled && s.throttle().enforce_global_limit);
    assert!(s.throttle().enable_runtime_token_management);
    assert_eq!(s.tenant_cap_refill_us(s.throttle().tenant_max_cpu_ratio), Some(32_000));
}

/// §7 point 3's premise, enforced by the policy itself: in cap mode the global bucket is a hard
/// node cap even if handed `enforce-global-limit = false` (which the configuration refuses).
#[test]
fn cap_mode_always_enforces_the_global_bucket() {
    let mut s = essential_settings(CORES, 0.7); // cap 56_000 per 10 ms > global 48_000
    s.throttle_mut().enable_runtime_token_management = false;
    s.throttle_mut().enforce_global_limit = false;
    let p = Policy::new(s, 0).unwrap();
    let g = p.allocate(9, Some(480_000), 0).unwrap();
    assert_eq!(p.global_bucket().available_us(), 0);
    assert_eq!(p.allocate(9, Some(1), 0).unwrap_err(), Refusal::GlobalCpuExhausted { keyspace: 9 });
    assert_eq!(p.global_bucket().available_us(), 0, "no best-effort overdraft");
    assert_eq!(p.counters().global_best_effort_overdraft, 0);
    assert_eq!(p.keyspace(9).unwrap().bucket().available_us(), 560_000 - 480_000, "tenant tokens rolled back");
    p.release(g, 480_000);
}

#[test]
fn keyspaces_without_a_cell_are_held_together_to_one_tenant_cap_and_the_global_cap() {
    // 8 cores: tenant cap 0.05 (0.4 core), global 0.6 (4.8 cores); a table of
    // 16 cells and 40 greedy keyspaces: the 24 that find no cell share the
    // overflow bucket.
    let p = Policy::with_cells(essential_settings(CORES, 0.05), 16, 0).unwrap();
    let loads: Vec<Load> = (1..=40).map(|ks| Load { keyspace: ks, cost_us: 500, per_step: 1000 }).collect();
    run(&p, &loads, 0, SEC, MS);
    let out = run(&p, &loads, SEC, SEC, MS);
    let with_cell: Vec<u32> = p.keyspace_entries().iter().map(|e| e.id()).collect();
    assert_eq!(with_cell.len(), 16);
    let (mut cell_us, mut overflow_us) = (0.0, 0.0);
    for (l, us) in loads.iter().zip(&out.consumed_us) {
        if with_cell.contains(&l.keyspace) {
            assert!(*us as f64 <= 400_000.0 * 1.01, "keyspace {} ran {us} µs in 1 s over its cap", l.keyspace);
            cell_us += *us as f64;
        } else {
            overflow_us += *us as f64;
        }
    }
    // Together no more than one tenant's cap (they compete with the 16 for
    // the global tokens, so they may get less).
    assert!(
        (200_000.0..=400_000.0 * 1.01).contains(&overflow_us),
        "24 keyspaces without a cell ran {overflow_us} µs in 1 s"
    );
    // 16 × 0.4 + 0.4 cores asked for, 4.8 allowed: the global cap holds over all.
    assert_close(cell_us + overflow_us, 4_800_000.0, 0.02, "every keyspace over 1 s");
    let o = p.snapshot().overflow;
    assert_eq!(o.source, Some(QuotaSource::TenantCap));
    assert!(o.counters.refused_keyspace > 0, "{o:?}");
}
