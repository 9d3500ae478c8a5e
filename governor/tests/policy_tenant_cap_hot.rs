//! tenant-cpu-cap.md §7, points 9–14: runtime top-up, low-priority DAG, Premium compatibility,
//! cap hot update / disable, idle-TTL hot update (points 1–7 are in `policy_tenant_cap.rs`).
//! Point 8 (a conflicting online change is rejected as a whole, restart-only keys refused) is
//! decided by the configuration before a change reaches the policy: `config_seed_cap.rs` and
//! `config_online_update.rs`. So is the floor of `tenant-cap-idle-ttl` (point 14).

mod common;

use common::{CORES, Load, MS, SEC, assert_close, base, essential, essential_settings, run, steady};
use keyspace_governor::policy::{AdmissionMode, Policy, Refusal};

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
    assert_eq!(p.global_bucket().available_us(), global_before, "global untouched");
    assert!(!g.is_burst());
    let c = p.counters();
    assert_eq!((c.topup_granted, c.topup_refused, c.burst_granted), (2, 1, 0));
    p.release(g, 320_000);
    let k = p.keyspace(1).unwrap();
    assert_eq!(k.bucket().inflight_us(), 0);
    assert_eq!((k.counters().topups_granted, k.counters().topups_refused), (2, 1));
    // Everything granted was consumed: neither bucket got anything back or went into debt.
    assert_eq!(k.bucket().available_us(), 0);
    assert_eq!(p.global_bucket().available_us(), 480_000 - 320_000);
    assert_eq!(p.global_bucket().debt_total_us, 0);
}

#[test]
fn runtime_top_up_threshold_follows_the_configured_fraction() {
    let p = essential(0.4);
    let s = p.settings().clone();
    assert_eq!((s.throttle().additional_allocation_threshold, s.throttle().per_allocation_us), (0.5, 4000));
    let threshold_milli = (s.throttle().additional_allocation_threshold * 1000.0) as u64;
    let mut g = p.allocate(1, Some(8_000), 0).unwrap();
    assert_eq!(g.granted_us(), 8_000);
    assert!(!g.needs_top_up(4_000, threshold_milli), "at 50 %: not yet");
    assert!(g.needs_top_up(4_001, threshold_milli), "past 50 %");
    p.allocate_more(&mut g, s.throttle().per_allocation_us, 1).unwrap();
    assert_eq!(g.granted_us(), 12_000);
    assert!(!g.needs_top_up(6_000, threshold_milli));
    assert!(g.needs_top_up(6_001, threshold_milli));
    p.release(g, 6_500);
    let k = p.keyspace(1).unwrap();
    assert_eq!(k.bucket().available_us(), 320_000 - 6_500);
}

#[test]
fn seed_cap_10_low_priority_dag_is_cap_aware() {
    // The Essential profile keeps the low-priority DAG bucket off (and the configuration
    // refuses to turn it on with the cap, config_seed_cap.rs)...
    assert!(!essential_settings(CORES, 0.4).throttle().low_priority_dag_global_enabled);
    // ...and when a test profile enables it, unknown keyspaces still pass their tenant cap.
    let mut s = essential_settings(CORES, 0.4);
    s.throttle_mut().low_priority_dag_global_enabled = true;
    s.low_priority_dag_cpu_ratio = 0.5; // 40_000 µs per interval, larger than the cap
    s.throttle_mut().enable_runtime_token_management = false;
    let p = Policy::new(s, 0).unwrap();
    // Unknown keyspace: low-priority bucket, then its tenant cap bucket.
    let g = p.allocate_low_priority(7, Some(320_000), 0).unwrap();
    assert_eq!((g.low_priority_us(), g.tenant_us(), g.global_us()), (320_000, 320_000, 320_000));
    assert_eq!(p.keyspace(7).unwrap().source(), keyspace_governor::policy::QuotaSource::TenantCap);
    let low_before = p.low_priority_bucket().available_us();
    assert_eq!(low_before, 400_000 - 320_000);
    let err = p.allocate_low_priority(7, Some(1000), 0).unwrap_err();
    assert_eq!(err, Refusal::TenantCpuExhausted { keyspace: 7 });
    assert_eq!(p.low_priority_bucket().available_us(), low_before, "low-priority rolled back");
    p.release(g, 320_000);
    assert_eq!(p.keyspace(7).unwrap().bucket().inflight_us(), 0);
    assert_eq!(p.counters().skipped, 0);

    // Premium (no cap): an unknown keyspace uses the legacy global-only fallback.
    let s = {
        let mut s = base();
        s.throttle_mut().low_priority_dag_global_enabled = true;
        s
    };
    let p = Policy::new(s, 0).unwrap();
    let g = p.allocate_low_priority(7, Some(1000), 0).unwrap();
    assert!(!g.is_skip());
    assert_eq!((g.tenant_us(), g.global_us(), g.low_priority_us()), (0, 1000, 1000));
    assert!(p.keyspace(7).is_none(), "no bucket created");
    p.release(g, 500);
    // 500 consumed from each; the unused 500 came back to both.
    let (global, low) = (p.global_bucket(), p.low_priority_bucket());
    assert_eq!(global.available_us(), 480_000 - 500);
    assert_eq!(low.available_us(), 80_000 - 500);
    for b in [global, low] {
        assert_eq!(b.ledger_available_us(), b.available_us());
    }
}

#[test]
fn seed_cap_11_premium_mode_is_unchanged() {
    let mut s = base();
    s.throttle_mut().keyspace_cpu_quotas.set(1, Some(1000)); // 1 core = 10_000 µs per 10 ms
    let p = Policy::new(s, 0).unwrap();
    let g = p.allocate(42, Some(1_000_000), 0).unwrap();
    assert!(g.is_skip(), "unknown keyspace skips throttling");
    assert_eq!((g.tenant_us(), g.global_us()), (0, 0));
    p.release(g, 1_000_000);
    assert_eq!(p.global_bucket().available_us(), 480_000, "no tokens taken");
    assert_eq!(p.keyspace_count(), 1);
    let used = steady(&p, &[Load { keyspace: 1, cost_us: 1000, per_step: 1000 }]);
    assert_close(used[0] as f64, 1_000_000.0, 0.01, "configured 1000 millicores");
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
    assert_eq!(p.tenant_cap_refill_us(), 16_000);
    assert_eq!(p.snapshot().tenant_cap_refill_us, 16_000);
    // Keyspace 1 has 30_000 µs in flight > new quota 16_000: debt until it drains.
    let k1 = || p.keyspace(1).unwrap();
    assert!(k1().bucket().in_debt());
    assert_eq!(k1().bucket().available_us(), 0);
    // The others, with nothing in flight, are clamped to the new capacity.
    assert_eq!(p.keyspace(2).unwrap().bucket().available_us(), 160_000);
    p.tick(10 * MS, None);
    assert_eq!(k1().bucket().available_us(), 0, "no refill while in debt");
    assert_eq!(p.allocate(1, Some(1), 10 * MS).unwrap_err(), Refusal::TenantCpuExhausted { keyspace: 1 });
    p.release(held, 30_000);
    assert!(k1().bucket().in_debt(), "left at the next refill");
    p.tick(20 * MS, None);
    assert!(!k1().bucket().in_debt());
    assert_eq!(k1().bucket().available_us(), 16_000);
    let g = p.allocate(1, Some(1000), 20 * MS).unwrap();
    p.release(g, 1000);
    let used = run(&p, &[Load { keyspace: 3, cost_us: 1000, per_step: 1000 }], SEC, SEC, MS).consumed_us;
    let used2 = run(&p, &[Load { keyspace: 3, cost_us: 1000, per_step: 1000 }], 2 * SEC, SEC, MS).consumed_us;
    assert!(used[0] > 0);
    assert_close(used2[0] as f64, 1_600_000.0, 0.01, "new cap after hot update");
}

#[test]
fn seed_cap_13_disabling_the_cap_removes_auto_created_buckets() {
    let s = essential_settings(CORES, 0.4);
    assert!(s.throttle().enforce_global_limit);
    let p = Policy::new(s, 0).unwrap();
    for ks in 1..=3 {
        let g = p.allocate(ks, Some(10), 0).unwrap();
        p.release(g, 10);
    }
    assert_eq!(p.keyspace_count(), 3);
    p.set_tenant_max_cpu_ratio(0.0).unwrap();
    assert_eq!(p.keyspace_count(), 0);
    assert_eq!(p.tenant_cap_refill_us(), 0);
    assert!(p.keyspaces_from(keyspace_governor::policy::QuotaSource::TenantCap).is_empty());
    let g = p.allocate(1, Some(10_000_000), 0).unwrap();
    assert!(g.is_skip(), "reverted to legacy skip-throttle");
    p.release(g, 10_000_000);
    let g = p.allocate(99, Some(10_000_000), 0).unwrap();
    assert!(g.is_skip(), "unknown keyspaces too");
    p.release(g, 10_000_000);
    assert_eq!(p.keyspace_count(), 0);
    // And re-enabling creates them again.
    p.set_tenant_max_cpu_ratio(0.4).unwrap();
    let g = p.allocate(1, Some(10), 0).unwrap();
    assert!(!g.is_skip());
    p.release(g, 10);
    assert_eq!(p.keyspace(1).unwrap().bucket().base_refill_us(), 32_000);
}

#[test]
fn seed_cap_14_idle_ttl_is_hot_updatable() {
    let p = essential(0.4);
    assert_eq!(p.tenant_cap_idle_ttl_us(), 600 * SEC);
    let g = p.allocate(1, Some(10), 0).unwrap();
    p.release(g, 10);
    let held = p.allocate(2, Some(10), 0).unwrap();
    assert_eq!(p.tick(120 * SEC, None).evicted, 0, "2 min idle < 10 min TTL");
    p.set_tenant_cap_idle_ttl_us(60 * SEC).unwrap();
    let report = p.tick(121 * SEC, None);
    assert_eq!(report.evicted, 1, "next scan uses the new TTL");
    assert!(p.keyspace(1).is_none());
    assert!(p.keyspace(2).is_some(), "in-flight tokens keep a bucket alive");
    p.release(held, 10);
    assert_eq!(p.tick(122 * SEC, None).evicted, 1);
    assert_eq!(p.counters().cap_buckets_evicted, 2);
    assert_eq!(p.keyspace_count(), 0);
    // Raising it back: a bucket used at 122 s survives a scan 100 s later.
    p.set_tenant_cap_idle_ttl_us(600 * SEC).unwrap();
    assert_eq!(p.tenant_cap_idle_ttl_us(), 600 * SEC);
    let g = p.allocate(3, Some(10), 122 * SEC).unwrap();
    p.release(g, 10);
    assert_eq!(p.tick(222 * SEC, None).evicted, 0);
    assert!(p.keyspace(3).is_some());
    assert_eq!(p.counters().cap_buckets_created, 3);
}

#[test]
fn online_update_that_does_not_shrink_the_cap_leaves_busy_buckets_alone() {
    let p = essential(0.4); // 32_000 µs per interval
    let a = p.allocate(1, Some(30_000), 0).unwrap();
    let b = p.allocate(1, Some(25_000), 0).unwrap();
    let k = || p.keyspace(1).unwrap();
    assert_eq!(k().bucket().inflight_us(), 55_000, "more in flight than one interval's cap");
    let available = k().bucket().available_us();
    assert_eq!(available, 320_000 - 55_000);
    // An unrelated change (admission mode) must not touch the tenant buckets.
    let mut next = p.settings().clone();
    next.admission.mode = AdmissionMode::Monitor;
    p.update_settings(next).unwrap();
    assert!(!k().bucket().in_debt(), "unchanged cap is not a shrink");
    assert_eq!(k().bucket().available_us(), available);
    // Raising the cap is not a shrink either, even with more in flight than the new quota.
    p.set_tenant_max_cpu_ratio(0.5).unwrap(); // 40_000 < 55_000 in flight
    assert!(!k().bucket().in_debt());
    assert_eq!(k().bucket().base_refill_us(), 40_000);
    assert_eq!(k().bucket().capacity_us(), 400_000);
    assert_eq!(k().bucket().available_us(), available);
    let g = p.allocate(1, Some(1000), 0).unwrap();
    assert!(g.counted(), "admitted under monitor mode");
    for g in [a, b, g] {
        let used = g.granted_us();
        p.release(g, used);
    }
    assert_eq!(k().bucket().inflight_us(), 0);
    assert_eq!(p.inflight_requests(1), 0);
}

#[test]
fn a_tiny_cap_ratio_caps_instead_of_turning_the_cap_off() {
    let mut s = essential_settings(CORES, 0.4);
    s.throttle_mut().enable_runtime_token_management = false; // the estimate is taken whole
    let p = Policy::new(s, 0).unwrap();
    p.set_tenant_max_cpu_ratio(1e-9).unwrap();
    assert_eq!(p.tenant_cap_refill_us(), 1, "at least 1 µs per interval");
    let g = p.allocate(5, Some(10), 0).unwrap();
    assert!(!g.is_skip(), "still cap mode");
    assert_eq!(g.tenant_us(), 10, "a full bucket of 10 µs (1 µs × 100 ms / 10 ms)");
    assert_eq!(p.allocate(5, Some(1), 0).unwrap_err(), Refusal::TenantCpuExhausted { keyspace: 5 });
    p.release(g, 10);
    p.tick(10 * MS, None);
    assert_eq!(p.keyspace(5).unwrap().bucket().available_us(), 1);
}

/// tenant-cpu-cap.md §7 points 12–13 together: the cap switched off (buckets removed; their
/// cells keep what they held) and on again at a lower ratio gives every tenant a bucket of the
/// new size, never one still holding the old capacity's tokens.
#[test]
fn reenabling_the_cap_at_a_lower_ratio_gives_buckets_the_new_capacity() {
    let mut s = essential_settings(CORES, 0.4);
    s.throttle_mut().enable_runtime_token_management = false; // estimates taken whole
    let p = Policy::new(s, 0).unwrap();
    let g = p.allocate(1, Some(10), 0).unwrap();
    p.release(g, 10);
    assert_eq!(p.keyspace(1).unwrap().bucket().available_us(), 320_000 - 10);
    p.set_tenant_max_cpu_ratio(0.0).unwrap();
    p.set_tenant_max_cpu_ratio(0.05).unwrap(); // 4_000 per 10 ms, capacity 40_000
    let b = p.keyspace(1).unwrap().bucket().snapshot();
    assert_eq!((b.base_refill_us, b.capacity_us), (4_000, 40_000));
    assert_eq!(b.ledger_available_us(), b.available_us);
    assert!(
        b.available_us <= b.capacity_us,
        "available {} above the new cap capacity {}",
        b.available_us,
        b.capacity_us
    );
    match p.allocate(1, Some(300_000), 0) {
        Err(e) => assert_eq!(e, Refusal::TenantCpuExhausted { keyspace: 1 }),
        Ok(g) => {
            p.release(g, 300_000);
            panic!("admitted 300_000 µs against a 40_000 µs cap bucket");
        }
    }
}

/// Idle eviction never forgives debt: a cap bucket that owes tokens stays until refills have
/// repaid them (a new bucket would start full).
#[test]
fn a_cap_bucket_in_debt_is_kept_until_repaid() {
    let p = essential(0.4); // 32_000 per 10 ms, capacity 320_000
    p.set_tenant_cap_idle_ttl_us(MS).unwrap();
    let g = p.allocate(1, Some(1_000), 0).unwrap();
    assert_eq!(g.tenant_us(), 1_000);
    p.release(g, 400_000); // overran by 399_000
    let k = || p.keyspace(1).unwrap().bucket().snapshot();
    assert_eq!(k().available_us, 320_000 - 400_000);
    assert_eq!(k().debt_total_us, 399_000);
    assert_eq!(p.tick(10 * MS, None).evicted, 0, "idle past the TTL, but in debt");
    assert_eq!(k().available_us, -48_000);
    assert_eq!(p.tick(20 * MS, None).evicted, 0);
    assert_eq!(k().available_us, -16_000);
    assert_eq!(p.allocate(1, Some(1), 20 * MS).unwrap_err(), Refusal::TenantCpuExhausted { keyspace: 1 });
    // Repaid at the next refill: then it goes.
    assert_eq!(p.tick(30 * MS, None).evicted, 1);
    assert!(p.keyspace(1).is_none());
    assert_eq!(p.counters().cap_buckets_evicted, 1);
}
