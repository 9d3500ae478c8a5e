//! keyspace-cpu-throttle.md mechanisms: fair allocation, burst, dynamic adjustment, quota shrink
//! debt, release, adaptive estimate, monitor window, snapshot.

mod common;

use common::{MS, SEC, base};
use keyspace_governor::config::ConfigDuration;
use keyspace_governor::policy::{
    AdmissionMode, FairInput, Policy, QuotaSource, Refusal, Settings, UsageSample, fair_allocate,
};

fn approx(a: f64, b: f64, eps: f64) -> bool {
    (a - b).abs() <= eps
}

#[test]
fn throttle_worked_example_fair_allocation() {
    // 8 cores, 6.0 used (75 %), 2.0 available.
    let inputs = [
        FairInput { keyspace: 1, quota: 4.0, usage: 2.5, demand: Some(1.5) }, // A
        FairInput { keyspace: 2, quota: 2.0, usage: 1.5, demand: Some(1.0) }, // B
        FairInput { keyspace: 3, quota: 2.0, usage: 2.0, demand: Some(0.5) }, // C
    ];
    let out = fair_allocate(8.0, 6.0, &inputs);
    assert!(approx(out[0].can_use, 2.0 * 4.0 / 6.0, 1e-9), "A gets 1.33");
    assert!(approx(out[0].allocation, 3.8333, 1e-3), "A = 3.83, got {}", out[0].allocation);
    assert!(approx(out[1].can_use, 0.5, 1e-9), "B capped at remaining quota");
    assert!(approx(out[1].allocation, 2.0, 1e-9));
    assert_eq!(out[2].can_use, 0.0, "C at its quota gets nothing");
    assert!(approx(out[2].allocation, 2.0, 1e-9));
}

/// 8 cores, max-read-cpu-ratio 1.0, 10 ms refill, 1 s window = 1 s stats interval.
fn premium(f: impl FnOnce(&mut Settings)) -> Settings {
    let mut s = {
        let mut s = base();
        s.cpu_cores = 8.0;
        s.resource.max_read_cpu_ratio = 1.0;
        s.resource.window_size = ConfigDuration::from_micros(SEC);
        s.resource.stats_interval = ConfigDuration::from_micros(SEC);
        s
    };
    f(&mut s);
    s
}

fn sample(global_cum_us: u64, ks: &[(u32, u64)]) -> UsageSample {
    UsageSample { global_cpu_cumulative_us: global_cum_us, keyspace_cpu_us: ks.to_vec(), ..UsageSample::default() }
}

#[test]
fn fair_allocation_drives_keyspace_refill_above_threshold() {
    let s = premium(|s| {
        s.throttle_mut().enable_fair_allocation = true;
        s.throttle_mut().keyspace_cpu_quotas = [(1, 4000), (2, 2000), (3, 2000)].into();
    });
    let p = Policy::new(s, 0).unwrap();
    p.tick(0, Some(&sample(0, &[])));
    // Pending demand during the interval (refused requests count as demand too).
    for (ks, demand) in [(1, 1_500_000), (2, 1_000_000), (3, 500_000)] {
        assert!(p.allocate(ks, Some(demand), 500 * MS).is_err());
    }
    // Node at 75 %: A 2.5, B 1.5, C 2.0 cores over the 1 s window.
    let r = p.tick(SEC, Some(&sample(6 * SEC, &[(1, 2_500_000), (2, 1_500_000), (3, 2 * SEC)])));
    assert!(r.fair_active);
    assert!(approx(r.global_ratio, 0.75, 1e-9));
    let refill = |ks| p.keyspace(ks).unwrap().bucket().refill_us();
    // µs per 10 ms interval: 10_000 = one core.
    assert_eq!(refill(1), 38_333, "A: 3.83 cores");
    assert_eq!(refill(2), 20_000, "B: 2.0 cores");
    assert_eq!(refill(3), 20_000, "C: 2.0 cores");
    assert_eq!(p.snapshot().keyspaces[0].fair_allocations, 1);
    // Below the threshold, base rates come back.
    let r = p.tick(2 * SEC, Some(&sample(9 * SEC, &[(1, SEC)])));
    assert!(!r.fair_active);
    assert_eq!(refill(1), 40_000);
}

#[test]
fn burst_uses_global_tokens_under_the_seed_conditions_and_is_capped_per_interval() {
    let s = premium(|s| {
        s.resource.max_read_cpu_ratio = 0.6; // global refill 48_000 per interval
        s.throttle_mut().enable_burst = true;
        s.throttle_mut().enable_runtime_token_management = false;
        s.throttle_mut().keyspace_cpu_quotas = [(1, 1000), (2, 1000)].into();
        s.throttle_mut().keyspace_burst_enabled = [(2, false)].into();
    });
    let p = Policy::new(s, 0).unwrap();
    p.tick(0, Some(&sample(0, &[])));
    p.tick(SEC, Some(&sample(SEC, &[(1, 100_000)]))); // global 0.21, keyspace 0.02: may burst
    assert!(p.keyspace(1).unwrap().burst_allowed());
    assert!(!p.keyspace(2).unwrap().burst_allowed() || !p.keyspace(2).unwrap().burst_enabled());
    let now = SEC;
    let held = p.allocate(1, Some(100_000), now).unwrap(); // drains keyspace 1
    assert!(!held.is_burst());
    let b = p.allocate(1, Some(40_000), now).unwrap();
    assert!(b.is_burst());
    assert_eq!((b.tenant_us(), b.global_us()), (0, 40_000));
    // Burst budget is one global refill (48_000): 8_000 left this interval.
    assert_eq!(p.allocate(1, Some(10_000), now).unwrap_err(), Refusal::KeyspaceCpuExhaustedNoBurst { keyspace: 1 });
    let small = p.allocate(1, Some(8_000), now).unwrap();
    assert!(small.is_burst());
    // keyspace-burst-enabled = false for keyspace 2.
    let held2 = p.allocate(2, Some(100_000), now).unwrap();
    assert!(p.allocate(2, Some(1), now).is_err());
    p.tick(now + 10 * MS, None); // budget refreshed at the refill boundary
    let again = p.allocate(1, Some(30_000), now + 10 * MS).unwrap();
    assert!(again.is_burst());
    assert_eq!(p.counters().burst_granted, 3);
    // High global ratio: no burst.
    p.tick(2 * SEC, Some(&sample(SEC + 3_500_000, &[]))); // 3.5 / 4.8 = 0.73 < 0.9 still allowed
    assert!(p.keyspace(1).unwrap().burst_allowed());
    p.tick(3 * SEC, Some(&sample(SEC + 8_300_000, &[]))); // 4.8 / 4.8 = 1.0
    assert!(!p.keyspace(1).unwrap().burst_allowed());
    for g in [held, b, small, held2, again] {
        let used = g.granted_us();
        p.release(g, used);
    }
    assert_eq!(p.keyspace(1).unwrap().bucket().inflight_us(), 0);
    assert_eq!(p.keyspace(2).unwrap().bucket().inflight_us(), 0);
    let k1 = p.keyspace(1).unwrap();
    assert_eq!(k1.counters().burst_granted, 3);
    assert_eq!(k1.counters().burst_tokens_us, 40_000 + 8_000 + 30_000);
    let g = p.global_bucket();
    assert_eq!(g.ledger_available_us(), g.available_us());
}

#[test]
fn dynamic_adjustment_follows_the_watermarks() {
    let s = premium(|s| {
        s.resource.max_read_cpu_ratio = 0.6; // global 48_000 per interval, 4.8 s per 1 s window
        s.throttle_mut().enable_dynamic_adjustment = true;
        s.throttle_mut().keyspace_cpu_quotas = [(1, 2000)].into(); // 20_000; quota ratio 0.4167
    });
    let p = Policy::new(s, 0).unwrap();
    p.tick(0, Some(&sample(0, &[])));
    // Global ratio 1.0 > 0.8: reduce to base × 0.8 / 1.0. Keyspace ratio 0.75 > 0.9 × 0.4167.
    p.tick(SEC, Some(&sample(4_800_000, &[(1, 3_600_000)])));
    assert_eq!(p.global_bucket().refill_us(), 38_400);
    assert_eq!(p.keyspace(1).unwrap().bucket().refill_us(), 10_000);
    // 0.6 is between the watermarks: keep the reduced global rate; keyspace under → base.
    p.tick(2 * SEC, Some(&sample(4_800_000 + 2_880_000, &[(1, 100_000)])));
    assert_eq!(p.global_bucket().refill_us(), 38_400);
    assert_eq!(p.keyspace(1).unwrap().bucket().refill_us(), 20_000);
    // 0.4 < 0.5: restore.
    p.tick(3 * SEC, Some(&sample(4_800_000 + 2_880_000 + 1_920_000, &[])));
    assert_eq!(p.global_bucket().refill_us(), 48_000);
}

#[test]
fn quota_shrink_enters_debt_until_inflight_drains() {
    let s = premium(|s| s.throttle_mut().keyspace_cpu_quotas = [(1, 2000)].into());
    let p = Policy::new(s, 0).unwrap();
    let g = p.allocate(1, Some(15_000), 0).unwrap();
    p.set_keyspace_quota_millicores(1, Some(1000), 0).unwrap(); // 10_000 < 15_000 in flight
    let snap = p.snapshot().keyspaces[0].clone();
    assert!(snap.in_debt_mode);
    assert_eq!((snap.available_us, snap.base_refill_us, snap.capacity_us), (0, 10_000, 100_000));
    assert_eq!(snap.debt_us, 5_000, "the seed's shrink debt: 15 000 µs in flight over the new 10 000");
    assert_eq!(p.allocate(1, Some(1), 0).unwrap_err(), Refusal::KeyspaceCpuExhaustedNoBurst { keyspace: 1 });
    p.tick(50 * MS, None);
    assert_eq!(p.keyspace(1).unwrap().bucket().available_us(), 0);
    p.release(g, 20_000); // overran by 5_000: debt
    assert_eq!(p.keyspace(1).unwrap().bucket().available_us(), -5_000);
    assert_eq!(p.snapshot().keyspaces[0].debt_us, 5_000);
    p.tick(60 * MS, None);
    assert_eq!(p.keyspace(1).unwrap().bucket().available_us(), 5_000);
    assert!(!p.keyspace(1).unwrap().bucket().in_debt());
    // Removing the quota removes the bucket: the keyspace is unknown again.
    p.set_keyspace_quota_millicores(1, None, 0).unwrap();
    assert!(p.allocate(1, Some(1), 0).unwrap().is_skip());
}

#[test]
fn release_refunds_unused_estimate_and_charges_overrun() {
    let s = premium(|s| {
        s.throttle_mut().enforce_global_limit = true;
        s.throttle_mut().keyspace_cpu_quotas = [(1, 1000)].into();
    });
    let p = Policy::new(s, 0).unwrap();
    let full = p.keyspace(1).unwrap().bucket().available_us();
    let g = p.allocate(1, Some(5_000), 0).unwrap();
    p.release(g, 2_000);
    assert_eq!(p.keyspace(1).unwrap().bucket().available_us(), full - 2_000);
    let g = p.allocate(1, Some(5_000), 0).unwrap();
    p.release(g, 9_000);
    assert_eq!(p.keyspace(1).unwrap().bucket().available_us(), full - 11_000);
    assert_eq!(p.global_bucket().available_us(), p.global_bucket().capacity_us() - 11_000);
    let ks = p.snapshot().keyspaces[0].clone();
    assert_eq!((ks.counters.consumed_us, ks.counters.released, ks.inflight_us), (11_000, 2, 0));
    assert_eq!(ks.bucket.debt_total_us, 4_000);
    assert_eq!(p.global_bucket().debt_total_us, 4_000);
}

#[test]
fn global_is_best_effort_tracking_unless_enforced() {
    let mk = |enforce| {
        Policy::new(
            premium(|s| {
                s.throttle_mut().enforce_global_limit = enforce;
                s.cpu_cores = 1.0; // global 10_000 per interval, capacity 100_000
                s.throttle_mut().keyspace_cpu_quotas = [(1, 8000)].into();
            }),
            0,
        )
        .unwrap()
    };
    let p = mk(false);
    let a = p.allocate(1, Some(100_000), 0).unwrap();
    let b = p.allocate(1, Some(50_000), 0).unwrap(); // global empty: tracked as overdraft
    assert_eq!(p.global_bucket().available_us(), -50_000);
    assert_eq!(p.counters().global_best_effort_overdraft, 1);
    p.release(a, 100_000);
    p.release(b, 50_000);
    let p = mk(true);
    let a = p.allocate(1, Some(100_000), 0).unwrap();
    assert_eq!(p.allocate(1, Some(50_000), 0).unwrap_err(), Refusal::GlobalCpuExhausted { keyspace: 1 });
    assert_eq!(p.keyspace(1).unwrap().bucket().available_us(), 800_000 - 100_000, "tenant rolled back");
    assert_eq!(p.counters().global_exhausted, 1);
    p.release(a, 100_000);
}

#[test]
fn adaptive_estimate_updates_once_per_stats_interval() {
    let s = premium(|s| {
        s.throttle_mut().enable_adaptive_estimated_cpu_per_request_us = true;
        s.adaptive_estimate_alpha = 0.5;
        s.throttle_mut().keyspace_cpu_quotas = [(1, 4000), (2, 4000)].into();
        s.throttle_mut().keyspace_estimated_cpu_per_request_us = [(2, 1500)].into();
    });
    let p = Policy::new(s, 0).unwrap();
    assert_eq!(p.keyspace(1).unwrap().estimate_us(), 1000);
    assert_eq!(p.keyspace(2).unwrap().estimate_us(), 1500, "per-keyspace override");
    for _ in 0..10 {
        let g = p.allocate(1, None, 0).unwrap();
        assert_eq!(g.granted_us(), 1000);
        p.release(g, 3000);
    }
    assert_eq!(p.keyspace(1).unwrap().estimate_us(), 1000, "not before the stats interval");
    p.tick(SEC, Some(&sample(0, &[])));
    assert_eq!(p.keyspace(1).unwrap().estimate_us(), 2000);
    p.tick(2 * SEC, Some(&sample(0, &[])));
    assert_eq!(p.keyspace(1).unwrap().estimate_us(), 2000, "no requests, no change");
    let g = p.allocate(1, None, 2 * SEC).unwrap();
    assert_eq!(g.granted_us(), 2000);
    p.release(g, 2000);
    assert_eq!(p.keyspace(2).unwrap().estimate_us(), 1500);
}

#[test]
fn monitor_window_ratios_are_published_and_exported() {
    let s = {
        let mut s = base();
        s.cpu_cores = 4.0;
        s.resource.max_read_cpu_ratio = 0.5;
        s.resource.window_size = ConfigDuration::from_micros(4 * SEC);
        s.resource.stats_interval = ConfigDuration::from_micros(SEC);
        s
    };
    let s = {
        let mut s = s;
        s.throttle_mut().keyspace_cpu_quotas = [(1, 1000)].into();
        s
    };
    let p = Policy::new(s, 0).unwrap();
    // max_cpu_time = 4 × 0.5 × 4 s = 8 s.
    for i in 0..=5u64 {
        p.tick(i * SEC, Some(&sample(i * SEC, &[(1, 500_000)])));
    }
    // Window (1 s, 5 s]: global 4 s, keyspace 4 × 0.5 s = 2 s.
    assert!(approx(p.global_ratio(), 0.5, 1e-9));
    let snap = p.snapshot();
    assert!(approx(snap.keyspaces[0].ratio, 0.25, 1e-9));
    assert_eq!(snap.keyspaces[0].source, QuotaSource::Config);
    let json = serde_json::to_value(&snap).unwrap();
    assert_eq!(json["keyspaces"][0]["keyspace"], 1);
    assert_eq!(json["keyspaces"][0]["source"], "config");
    for key in [
        "available_us",
        "capacity_us",
        "refill_us",
        "inflight_us",
        "debt_us",
        "ratio",
        "estimate_us",
        "burst_allowed",
        "counters",
    ] {
        assert!(json["keyspaces"][0].get(key).is_some(), "missing {key}");
    }
    assert!(json["keyspaces"][0]["counters"].get("granted").is_some());
    assert!(json.get("global_ratio").is_some());
    let (span, cpu) = p.window_cpu();
    assert_eq!(span, 4 * SEC);
    assert_eq!(cpu.get(&1), Some(&2_000_000));
    assert!(json["counters"].get("tenant_cap_exhausted").is_some());
    assert!(json["counters"].get("global_exhausted").is_some());
}

#[test]
fn refill_is_per_interval_and_never_exceeds_capacity() {
    let s = premium(|s| s.throttle_mut().keyspace_cpu_quotas = [(1, 500)].into()); // 5_000 / 10 ms
    let p = Policy::new(s, 0).unwrap();
    // Entries are snapshots: read again after every change.
    let b = || p.keyspace(1).unwrap();
    assert_eq!(b().bucket().capacity_us(), 50_000, "rate × 100 ms burst window");
    let g = p.allocate(1, Some(50_000), 0).unwrap();
    p.release(g, 50_000);
    assert_eq!(p.next_refill_at_us(), 10 * MS);
    assert_eq!(p.tick(25 * MS, None).refill_intervals, 2);
    assert_eq!(p.next_refill_at_us(), 30 * MS, "boundaries stay on the refill grid");
    assert_eq!(b().bucket().available_us(), 10_000);
    assert_eq!(p.tick(29 * MS, None).refill_intervals, 0);
    assert_eq!(b().bucket().available_us(), 10_000);
    p.tick(10 * SEC, None);
    assert_eq!(b().bucket().available_us(), 50_000);
    let snap = b().bucket().snapshot();
    assert_eq!(snap.ledger_available_us(), snap.available_us);
    assert!(snap.discarded_total_us > 0, "refill above capacity is dropped and counted");
}

/// The tests' baseline, built from the configuration, is the documented Premium default with
/// the CPU throttle on and every optional mechanism off.
#[test]
fn base_settings_are_the_premium_defaults_with_optional_mechanisms_off() {
    let s = base();
    assert!(s.resource.enabled && s.throttle().enabled);
    assert_eq!((s.cpu_cores, s.resource.max_read_cpu_ratio), (8.0, 0.6));
    assert_eq!(
        (s.refill_interval_us(), s.burst_window_us(), s.stats_interval_us(), s.window_size_us()),
        (10 * MS, 100 * MS, SEC, 60 * SEC)
    );
    assert!(!s.throttle().enforce_global_limit && !s.cap_mode());
    assert!(!s.throttle().enable_adaptive_estimated_cpu_per_request_us && !s.throttle().enable_dynamic_adjustment);
    assert!(
        !s.throttle().enable_fair_allocation
            && !s.throttle().enable_burst
            && !s.throttle().enable_runtime_token_management
    );
    assert!(!s.throttle().enable_pd_service_limit && !s.throttle().low_priority_dag_global_enabled);
    assert!(s.throttle().keyspace_cpu_quotas.map().is_empty());
    assert_eq!(s.throttle().estimated_cpu_per_request_us, 1000);
    assert_eq!((s.throttle().high_watermark, s.throttle().low_watermark), (0.8, 0.5));
    assert_eq!((s.throttle().fair_allocation_threshold, s.throttle().burst_threshold), (0.7, 0.9));
    assert_eq!(s.tenant_cap_idle_ttl_us(), 600 * SEC);
    assert_eq!(s.pending_write_threshold_bytes(), 100 << 20);
    assert_eq!((s.admission.mode, s.max_concurrent_per_tenant()), (AdmissionMode::Disabled, 0));
    assert_eq!(s.global_refill_us(), 48_000);
    let p = Policy::new(s, 0).unwrap();
    let g = p.global_bucket();
    assert_eq!((g.refill_us(), g.capacity_us(), g.available_us()), (48_000, 480_000, 480_000));
}

/// With the CPU throttle off (the configuration's default) quotas are not enforced; with
/// resource control off nothing is checked at all.
#[test]
fn throttle_and_resource_control_switches() {
    let quota = [(1, 100)].into(); // 1_000 µs per interval, capacity 10_000
    let p = Policy::new(
        {
            let mut s = base();
            s.throttle_mut().enabled = false;
            s.throttle_mut().keyspace_cpu_quotas = quota;
            s
        },
        0,
    )
    .unwrap();
    let g = p.allocate(1, Some(1_000_000), 0).unwrap();
    assert!(g.is_skip(), "cpu-throttle off: no tokens taken");
    p.release(g, 1_000_000);
    assert_eq!(p.keyspace(1).unwrap().bucket().available_us(), 10_000);
    // Switched on online: the quota acts.
    let mut s = p.settings().clone();
    s.throttle_mut().enabled = true;
    p.update_settings(s).unwrap();
    let g = p.allocate(1, Some(10_000), 0).unwrap();
    assert!(!g.is_skip());
    assert!(p.allocate(1, Some(1), 0).is_err());
    // resource-control.enabled = false admits everything, counting nothing against limits.
    let mut s = p.settings().clone();
    s.resource.enabled = false;
    s.admission.mode = AdmissionMode::Enforced;
    s.admission.max_concurrent_per_tenant = 1;
    p.update_settings(s).unwrap();
    let free: Vec<_> = (0..3).map(|_| p.allocate(1, Some(1), 0).unwrap()).collect();
    assert!(free.iter().all(|g| g.is_skip() && !g.counted()));
    assert_eq!(p.inflight_requests(1), 0);
    for f in free {
        p.release(f, 1);
    }
    p.release(g, 10_000);
    assert_eq!(p.keyspace(1).unwrap().bucket().inflight_us(), 0);
}

#[test]
fn refunds_are_kept_back_while_in_shrink_debt() {
    let s = premium(|s| s.throttle_mut().keyspace_cpu_quotas = [(1, 2000)].into()); // 20_000 / 10 ms
    let p = Policy::new(s, 0).unwrap();
    let a = p.allocate(1, Some(12_000), 0).unwrap();
    let b = p.allocate(1, Some(8_000), 0).unwrap();
    p.set_keyspace_quota_millicores(1, Some(1000), 0).unwrap(); // 10_000 < 20_000 in flight
    let k = || p.keyspace(1).unwrap().bucket().snapshot();
    assert!(k().in_debt);
    assert_eq!((k().available_us, k().inflight_us), (0, 20_000));
    // 10_000 unused: in debt nothing comes back (counted as refunded, then discarded).
    let discarded = k().discarded_total_us;
    p.release(a, 2_000);
    assert_eq!((k().available_us, k().inflight_us), (0, 8_000));
    assert_eq!(k().discarded_total_us - discarded, 10_000);
    assert_eq!(k().ledger_available_us(), k().available_us);
    assert!(k().in_debt, "left at the next refill");
    // In-flight is now within the new quota: the next refill ends debt mode.
    p.tick(10 * MS, None);
    assert!(!k().in_debt);
    assert_eq!(k().available_us, 10_000);
    // Out of debt, refunds come back again (up to capacity).
    p.release(b, 3_000);
    assert_eq!((k().available_us, k().inflight_us), (15_000, 0));
    assert_eq!(k().ledger_available_us(), k().available_us);
}

/// A quota removed (the bucket's tokens stay with the cell, for grants still out) and set
/// again lower starts as a fresh bucket of the new size: never above its new capacity.
#[test]
fn a_quota_removed_and_set_again_lower_starts_within_its_new_capacity() {
    let s = premium(|s| s.throttle_mut().keyspace_cpu_quotas = [(1, 4000)].into()); // capacity 400_000
    let p = Policy::new(s, 0).unwrap();
    let g = p.allocate(1, Some(10), 0).unwrap();
    p.release(g, 10);
    p.set_keyspace_quota_millicores(1, None, 0).unwrap();
    assert!(p.keyspace(1).is_none());
    p.set_keyspace_quota_millicores(1, Some(100), 0).unwrap(); // 1_000 per 10 ms, capacity 10_000
    let b = p.keyspace(1).unwrap().bucket().snapshot();
    assert_eq!((b.base_refill_us, b.capacity_us), (1_000, 10_000));
    assert_eq!(b.ledger_available_us(), b.available_us);
    assert!(b.available_us <= b.capacity_us, "available {} above the new capacity {}", b.available_us, b.capacity_us);
    assert_eq!(b.available_us, 10_000, "a fresh bucket starts full");
    // The new quota holds: 30 intervals' worth at once is refused.
    match p.allocate(1, Some(300_000), 0) {
        Err(e) => assert_eq!(e, Refusal::KeyspaceCpuExhaustedNoBurst { keyspace: 1 }),
        Ok(g) => {
            p.release(g, 300_000);
            panic!("admitted 300_000 µs against a 10_000 µs bucket");
        }
    }
}

/// Best-effort global tracking (enforce-global-limit = false) records every µs a request
/// holds, including runtime top-ups of requests without a keyspace bucket: an empty global
/// bucket goes negative (an overdraft), it never hands out µs it did not take.
#[test]
fn best_effort_global_tracks_top_ups_of_unthrottled_grants() {
    let s = {
        let mut s = base();
        s.throttle_mut().low_priority_dag_global_enabled = true;
        s.throttle_mut().keyspace_cpu_quotas = [(2, 80_000)].into();
        s
    };
    let p = Policy::new(s, 0).unwrap();
    let big = p.allocate(2, Some(479_000), 0).unwrap();
    // Keyspace 7 has no bucket: the low-priority bucket, then the global bucket alone.
    let mut g = p.allocate_low_priority(7, Some(1_000), 0).unwrap();
    assert_eq!((g.tenant_us(), g.global_us(), g.low_priority_us()), (0, 1_000, 1_000));
    assert_eq!(p.global_bucket().available_us(), 0);
    let overdraft = p.counters().global_best_effort_overdraft;
    p.allocate_more(&mut g, 5_000, 0).unwrap();
    assert_eq!(g.global_us(), 6_000);
    let global = p.global_bucket();
    assert_eq!(global.available_us(), -5_000, "the top-up is taken, as an overdraft");
    assert_eq!(p.counters().global_best_effort_overdraft, overdraft + 1);
    p.release(g, 0);
    p.release(big, 479_000);
    // 479_000 consumed, nothing else: 1_000 left of the initial 480_000.
    let global = p.global_bucket();
    assert_eq!(global.available_us(), 1_000);
    assert_eq!(global.taken_total_us, global.refunded_total_us + 479_000);
    assert_eq!(global.ledger_available_us(), global.available_us());
}

/// A running request whose keyspace cell was given up while it held no tenant tokens (a
/// low-priority request of a keyspace without a bucket) and then given to a new holder must
/// not take the new holder's tokens when it tops up: its release could not give them back.
#[test]
fn a_top_up_never_touches_a_cell_given_to_another_holder() {
    let s = {
        let mut s = base();
        s.throttle_mut().low_priority_dag_global_enabled = true;
        s.throttle_mut().tenant_cap_idle_ttl = ConfigDuration::from_micros(50 * MS);
        s
    };
    let p = Policy::new(s, 0).unwrap();
    let mut lp = p.allocate_low_priority(3, Some(1_000), 0).unwrap();
    assert_eq!(lp.tenant_us(), 0);
    let old_cell = lp.cell();
    assert!(old_cell.is_some());
    // Idle past the TTL: the cell (limits only, nothing in flight) is given up...
    assert_eq!(p.tick(60 * MS, None).evicted, 1);
    assert_eq!(p.cells_in_use(), 0);
    // ...and keyspace 3 gets a quota: a new holder of a cell, with a bucket.
    p.set_keyspace_quota_millicores(3, Some(1000), 60 * MS).unwrap(); // capacity 100_000
    let full = p.keyspace(3).unwrap().bucket().snapshot();
    assert_eq!((full.available_us, full.inflight_us), (100_000, 0));
    let _ = p.allocate_more(&mut lp, 500, 60 * MS);
    p.release(lp, 0);
    let b = p.keyspace(3).unwrap().bucket().snapshot();
    assert_eq!(
        (b.available_us, b.inflight_us),
        (100_000, 0),
        "the new holder's bucket was charged by a grant of the old one (cell {old_cell:?})"
    );
    // Nothing pins the cell, so it could go once idle (a configured quota stays, though).
    assert_eq!(b.ledger_available_us(), b.available_us);
}

#[test]
fn the_low_priority_bucket_is_switched_on_and_off_online() {
    // 8 cores × low-priority-dag-cpu-ratio 0.1 × 10 ms: 8 000 µs a refill,
    // 80 000 µs of capacity.
    let off = premium(|s| s.throttle_mut().low_priority_dag_global_enabled = false);
    let on = {
        let mut s = off.clone();
        s.throttle_mut().low_priority_dag_global_enabled = true;
        s
    };
    let p = Policy::new(off.clone(), 0).unwrap();
    let take = |n: u32| (0..n).map(|_| p.allocate_low_priority(1, Some(30_000), 0)).collect::<Vec<_>>();
    assert!(take(3).iter().all(|g| g.is_ok()), "off: 90 000 µs of low-priority work admitted past the bucket");
    p.update_settings_at(on, 0).unwrap();
    let after = take(3);
    assert_eq!(after.iter().filter(|g| g.is_ok()).count(), 2, "on: the bucket's 80 000 µs hold two of three");
    assert_eq!(after[2].as_ref().unwrap_err(), &Refusal::LowPriorityCpuExhausted { keyspace: 1 });
    p.update_settings_at(off, 0).unwrap();
    assert!(take(1)[0].is_ok(), "off again: admitted");
}

#[test]
fn turning_adaptive_estimates_off_puts_the_static_estimate_back() {
    let s = premium(|s| {
        s.throttle_mut().keyspace_cpu_quotas = [(1, 4000)].into();
        s.throttle_mut().enable_adaptive_estimated_cpu_per_request_us = true;
    });
    let static_us = s.static_estimate_us(1);
    let p = Policy::new(s.clone(), 0).unwrap();
    p.tick(0, Some(&sample(0, &[])));
    // Requests that take 5 ms each: the estimate learns towards it.
    for _ in 0..20 {
        let g = p.allocate(1, None, 0).unwrap();
        p.release(g, 5_000);
    }
    p.tick(SEC, Some(&sample(100_000, &[(1, 100_000)])));
    let learned = p.snapshot().keyspaces[0].estimate_us;
    assert!(learned > static_us, "learned {learned} µs, static {static_us} µs");
    p.update_settings_at(
        {
            let mut s = s;
            s.throttle_mut().enable_adaptive_estimated_cpu_per_request_us = false;
            s
        },
        SEC,
    )
    .unwrap();
    assert_eq!(p.snapshot().keyspaces[0].estimate_us, static_us, "the learned value does not outlive the setting");
}

#[test]
fn the_node_budget_and_the_tenant_caps_follow_the_cores_and_the_ratio_online() {
    // Throttle off: max-read-cpu-ratio may change online; the global bucket
    // follows (8 cores × 1.0 × 10 ms = 80 000 µs a refill, then × 0.5).
    let off = premium(|s| s.throttle_mut().enabled = false);
    let p = Policy::new(off.clone(), 0).unwrap();
    assert_eq!(p.global_bucket().refill_us(), 80_000);
    p.update_settings_at(
        {
            let mut s = off.clone();
            s.resource.max_read_cpu_ratio = 0.5;
            s
        },
        0,
    )
    .unwrap();
    let g = p.global_bucket();
    assert_eq!((g.refill_us(), g.capacity_us()), (40_000, 400_000), "the bucket has the new size");
    // The throttle turned on afterwards runs on that budget.
    p.update_settings_at(
        {
            let mut s = off.clone();
            s.resource.max_read_cpu_ratio = 0.5;
            s.throttle_mut().enabled = true;
            s
        },
        0,
    )
    .unwrap();
    assert_eq!(p.global_bucket().refill_us(), 40_000);
    // The servers' cores shrink (a cgroup resized): the node budget and a
    // tenant cap shrink with them, on the next settings.
    let capped = {
        let mut s = off;
        s.throttle_mut().enabled = true;
        s.throttle_mut().enforce_global_limit = true;
        s.throttle_mut().tenant_max_cpu_ratio = 0.25;
        s.throttle_mut().enable_burst = false;
        s.throttle_mut().enable_fair_allocation = false;
        s.throttle_mut().enable_dynamic_adjustment = false;
        s
    };
    let p = Policy::new(capped.clone(), 0).unwrap();
    let g = p.allocate(1, Some(1), 0).unwrap();
    p.release(g, 1);
    assert_eq!(p.keyspace(1).unwrap().bucket().refill_us(), 20_000, "0.25 × 8 cores × 10 ms");
    p.update_settings_at(
        {
            let mut s = capped;
            s.cpu_cores = 2.0;
            s
        },
        0,
    )
    .unwrap();
    assert_eq!(p.keyspace(1).unwrap().bucket().refill_us(), 5_000, "0.25 × 2 cores × 10 ms");
    assert_eq!(p.global_bucket().refill_us(), 20_000, "1.0 × 2 cores × 10 ms");
}
