//! Property tests over random request streams on a simulated clock: allocate, release, top-up,
//! refill, ratio and TTL hot updates, observations, at random times.

use std::sync::Arc;

use governor::policy::{Grant, KeyspaceEntry, Policy, Settings, UsageSample};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Alloc { ks: u32, est: u64 },
    LowPrio { ks: u32, est: u64 },
    Release { idx: usize, consumed: u64 },
    TopUp { idx: usize, us: u64 },
    Advance { dt: u64 },
    SetRatio { ratio: f64 },
    SetQuota { ks: u32, millicores: Option<u64> },
    Observe,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u32..5, 1u64..40_000).prop_map(|(ks, est)| Op::Alloc { ks, est }),
        1 => (0u32..5, 1u64..20_000).prop_map(|(ks, est)| Op::LowPrio { ks, est }),
        4 => (any::<usize>(), 0u64..60_000).prop_map(|(idx, consumed)| Op::Release { idx, consumed }),
        2 => (any::<usize>(), 1u64..10_000).prop_map(|(idx, us)| Op::TopUp { idx, us }),
        3 => (0u64..35_000).prop_map(|dt| Op::Advance { dt }),
        1 => prop::sample::select(vec![0.0, 0.05, 0.1, 0.3, 0.7]).prop_map(|ratio| Op::SetRatio { ratio }),
        1 => (0u32..5, prop::option::of(100u64..4000)).prop_map(|(ks, millicores)| Op::SetQuota { ks, millicores }),
        1 => Just(Op::Observe),
    ]
}

/// Every bucket ever seen (by pointer), so buckets evicted or removed while grants are
/// outstanding are still checked.
#[derive(Default)]
struct Seen(Vec<Arc<KeyspaceEntry>>);

impl Seen {
    fn add(&mut self, e: Option<Arc<KeyspaceEntry>>) {
        if let Some(e) = e
            && !self.0.iter().any(|x| Arc::ptr_eq(x, &e))
        {
            self.0.push(e);
        }
    }
}

struct Model {
    live: Vec<(Grant, Option<Arc<KeyspaceEntry>>)>,
    /// Σ over released grants of min(consumed, global granted).
    global_consumed_from_tokens: u64,
    global_overrun: u64,
}

fn check(p: &Policy, seen: &Seen, m: &Model) -> Result<(), TestCaseError> {
    for b in [p.global_bucket(), p.low_priority_bucket()]
        .into_iter()
        .chain(seen.0.iter().map(|e| e.bucket()))
    {
        let s = b.snapshot();
        prop_assert!(s.available_us <= s.capacity_us, "above capacity: {s:?}");
        prop_assert_eq!(
            s.ledger_available_us(),
            s.available_us,
            "ledger broken: {:?}",
            s
        );
    }
    // Global: taken = refunded + consumed + outstanding; overrun all charged as debt.
    let g = p.global_bucket().snapshot();
    let outstanding: u64 = m.live.iter().map(|(g, _)| g.global_us()).sum();
    prop_assert_eq!(g.inflight_us, outstanding);
    prop_assert_eq!(
        g.taken_total_us,
        g.refunded_total_us + m.global_consumed_from_tokens + outstanding
    );
    prop_assert_eq!(g.debt_total_us, m.global_overrun);
    // Keyspace buckets: in-flight equals the live grants' tenant tokens.
    for e in &seen.0 {
        let live: u64 = m
            .live
            .iter()
            .filter(|(_, ge)| ge.as_ref().is_some_and(|x| Arc::ptr_eq(x, e)))
            .map(|(g, _)| g.tenant_us())
            .sum();
        prop_assert_eq!(
            e.bucket().inflight_us(),
            live,
            "keyspace {} inflight",
            e.id()
        );
    }
    Ok(())
}

fn run_stream(settings: Settings, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let p = Policy::new(settings, 0).unwrap();
    let mut seen = Seen::default();
    let mut m = Model {
        live: Vec::new(),
        global_consumed_from_tokens: 0,
        global_overrun: 0,
    };
    let mut now = 0u64;
    let mut cum = 0u64;
    for op in ops {
        match op {
            Op::Alloc { ks, est } | Op::LowPrio { ks, est } => {
                let r = if matches!(op, Op::Alloc { .. }) {
                    p.allocate(ks, Some(est), now)
                } else {
                    p.allocate_low_priority(ks, Some(est), now)
                };
                if let Ok(g) = r {
                    let e = p.keyspace(ks);
                    seen.add(e.clone());
                    let e = if g.tenant_us() > 0 || g.is_burst() {
                        e
                    } else {
                        None
                    };
                    m.live.push((g, e));
                }
            }
            Op::Release { idx, consumed } if !m.live.is_empty() => {
                let (g, _) = m.live.swap_remove(idx % m.live.len());
                if g.global_us() > 0 {
                    // Skip grants hold no tokens and settle nothing.
                    m.global_consumed_from_tokens += consumed.min(g.global_us());
                    m.global_overrun += consumed.saturating_sub(g.global_us());
                }
                cum += consumed;
                p.release(g, consumed);
            }
            Op::TopUp { idx, us } if !m.live.is_empty() => {
                let i = idx % m.live.len();
                let _ = p.allocate_more(&mut m.live[i].0, us, now);
            }
            Op::Advance { dt } => {
                now += dt;
                p.tick(now, None);
            }
            Op::SetRatio { ratio } => {
                let _ = p.set_tenant_max_cpu_ratio(ratio);
            }
            Op::SetQuota { ks, millicores } => {
                let _ = p.set_keyspace_quota_millicores(ks, millicores, now);
            }
            Op::Observe => {
                p.tick(
                    now,
                    Some(&UsageSample {
                        global_cpu_cumulative_us: cum,
                        keyspace_cpu_us: vec![(1, cum / 7)],
                    }),
                );
            }
            _ => {}
        }
        check(&p, &seen, &m)?;
    }
    // Drain: everything released, nothing outstanding anywhere.
    for (g, _) in m.live.drain(..) {
        let used = g.granted_us();
        m.global_consumed_from_tokens += used;
        p.release(g, used);
    }
    check(&p, &seen, &m)?;
    prop_assert_eq!(p.low_priority_bucket().inflight_us(), 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn prop_tokens_conserved_and_capacity_respected_in_cap_mode(ops in prop::collection::vec(op(), 1..300)) {
        let mut s = Settings::essential(2.0, 0.3);
        s.low_priority_dag_global_enabled = true;
        s.tenant_cap_idle_ttl_us = 50_000;
        // SetQuota ops are rejected in cap mode (conflict) and applied once the ratio is 0.
        run_stream(s, ops)?;
    }

    #[test]
    fn prop_tokens_conserved_and_capacity_respected_in_premium_mode(ops in prop::collection::vec(op(), 1..300)) {
        let s = Settings {
            cpu_cores: 2.0,
            enable_burst: true,
            enable_dynamic_adjustment: true,
            enable_fair_allocation: true,
            enable_runtime_token_management: true,
            keyspace_cpu_quotas_millicores: [(1, 500), (2, 1000)].into(),
            window_size_us: 20_000,
            stats_interval_us: 10_000,
            ..Settings::default()
        };
        // Ratio hot updates to > 0 are rejected here (burst/fair/dynamic conflict): no change.
        run_stream(s, ops)?;
    }

    /// With truthful charging (release with the real CPU), a keyspace's consumption over any
    /// window of k refill intervals is at most k × cap + one refill quantum + one request.
    #[test]
    fn prop_consumption_over_any_window_bounded_by_cap(
        reqs in prop::collection::vec((0u64..3_000, 1u64..8_000, 0u64..8_000), 1..600),
        runtime in any::<bool>(),
    ) {
        const INTERVAL: u64 = 10_000;
        const MAX_REQUEST: u64 = 8_000;
        let mut s = Settings::essential(2.0, 0.4); // cap 8_000 µs per 10 ms
        s.burst_window_us = INTERVAL; // capacity = one refill quantum
        s.enable_runtime_token_management = runtime;
        let p = Policy::new(s, 0).unwrap();
        let cap = p.tenant_cap_refill_us();
        prop_assert_eq!(cap, 8_000);
        let mut now = 0u64;
        let mut per_interval: Vec<u64> = Vec::new();
        for (dt, est, consumed) in reqs {
            now += dt;
            p.tick(now, None);
            if let Ok(g) = p.allocate(1, Some(est), now) {
                let idx = (now / INTERVAL) as usize;
                if per_interval.len() <= idx {
                    per_interval.resize(idx + 1, 0);
                }
                per_interval[idx] += consumed;
                p.release(g, consumed);
            }
        }
        for start in 0..per_interval.len() {
            let mut sum = 0;
            for (k, c) in per_interval[start..].iter().enumerate() {
                sum += c;
                let k = k as u64 + 1;
                prop_assert!(sum <= k * cap + cap + MAX_REQUEST, "window [{start}, +{k}) consumed {sum} > {}", k * cap + cap + MAX_REQUEST);
            }
        }
    }

    /// The same bound for several keyspaces at once, under global pressure and with runtime
    /// top-ups: each keyspace's truthful consumption over any window of k refill intervals is at
    /// most k × cap + one refill quantum + one request's overrun.
    #[test]
    fn prop_every_keyspace_bounded_by_cap_with_top_ups(
        reqs in prop::collection::vec(
            (0u64..2_000, 0u32..3, 1u64..8_000, 0u64..8_000, prop::option::of(1u64..4_000)),
            1..800,
        ),
    ) {
        const INTERVAL: u64 = 10_000;
        const MAX_CONSUMED: u64 = 8_000;
        let mut s = Settings::essential(4.0, 0.2); // cap 8_000 µs per 10 ms each, global 24_000
        s.burst_window_us = INTERVAL;
        let p = Policy::new(s, 0).unwrap();
        let cap = p.tenant_cap_refill_us();
        prop_assert_eq!(cap, 8_000);
        let mut now = 0u64;
        let mut per: Vec<Vec<u64>> = vec![Vec::new(); 3];
        for (dt, ks, est, consumed, top_up) in reqs {
            now += dt;
            p.tick(now, None);
            if let Ok(mut g) = p.allocate(ks, Some(est), now) {
                if let Some(us) = top_up {
                    let _ = p.allocate_more(&mut g, us, now);
                }
                let series = &mut per[ks as usize];
                let idx = (now / INTERVAL) as usize;
                if series.len() <= idx {
                    series.resize(idx + 1, 0);
                }
                series[idx] += consumed;
                p.release(g, consumed);
            }
        }
        for (ks, series) in per.iter().enumerate() {
            for start in 0..series.len() {
                let mut sum = 0;
                for (k, c) in series[start..].iter().enumerate() {
                    sum += c;
                    let bound = (k as u64 + 1) * cap + cap + MAX_CONSUMED;
                    prop_assert!(sum <= bound, "keyspace {ks}: window [{start}, +{}) consumed {sum} > {bound}", k + 1);
                }
            }
        }
    }
}
