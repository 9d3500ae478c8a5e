//! Property tests over random request streams on a simulated clock: allocate, release, top-up,
//! refill, ratio and TTL hot updates, observations, at random times.

mod common;

use common::{base, essential_settings};
use keyspace_governor::config::ConfigDuration;
use keyspace_governor::policy::{BucketSnapshot, Grant, Policy, Settings, UsageSample};
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

/// The model of one node bucket (global or low-priority): what the live grants hold of it, what
/// released grants consumed of their tokens, and the debt their overruns must have charged.
#[derive(Default)]
struct NodeModel {
    /// Σ over released grants of min(consumed, µs held).
    consumed_from_tokens: u64,
    /// Σ over released grants of the overrun the bucket could take as debt (never below
    /// −max debt; the rest is forgiven).
    charged_debt: u64,
    /// Σ of the overrun forgiven.
    forgiven: u64,
}

impl NodeModel {
    /// A release of a grant that held `held` µs and consumed `consumed`, on a bucket whose
    /// available tokens were `available` just before, with `max_debt`.
    fn release(&mut self, held: u64, consumed: u64, available: i64, max_debt: u64) {
        if held == 0 {
            return;
        }
        self.consumed_from_tokens += consumed.min(held);
        let overrun = consumed.saturating_sub(held);
        let room = (available + max_debt as i64).max(0) as u64;
        self.charged_debt += overrun.min(room);
        self.forgiven += overrun - overrun.min(room);
    }
}

struct Model {
    live: Vec<Grant>,
    global: NodeModel,
    low: NodeModel,
    global_max_debt: u64,
    low_max_debt: u64,
}

/// A keyspace bucket never owes more than one second of the largest rate any keyspace gets in
/// these streams (a 4000-millicore quota: 40_000 µs per 10 ms interval).
const KEYSPACE_DEBT_BOUND: i64 = 4_000_000;

fn check_bucket(what: &str, s: &BucketSnapshot) -> Result<(), TestCaseError> {
    prop_assert!(s.available_us <= s.capacity_us, "{what} above capacity: {s:?}");
    prop_assert_eq!(s.ledger_available_us(), s.available_us, "{} ledger broken: {:?}", what, s);
    Ok(())
}

fn check(p: &Policy, m: &Model) -> Result<(), TestCaseError> {
    let g = p.global_bucket();
    let low = p.low_priority_bucket();
    check_bucket("global", &g)?;
    check_bucket("low-priority", &low)?;
    // Node buckets: taken = refunded + consumed + outstanding; every overrun charged as debt
    // down to −max debt, and never below.
    let outstanding: u64 = m.live.iter().map(|g| g.global_us()).sum();
    prop_assert_eq!(
        g.taken_total_us,
        g.refunded_total_us + m.global.consumed_from_tokens + outstanding,
        "global conservation: {:?}",
        g
    );
    prop_assert_eq!(g.debt_total_us, m.global.charged_debt);
    prop_assert!(g.available_us >= -(m.global_max_debt as i64), "global below max debt: {g:?}");
    let outstanding_low: u64 = m.live.iter().map(|g| g.low_priority_us()).sum();
    prop_assert_eq!(
        low.taken_total_us,
        low.refunded_total_us + m.low.consumed_from_tokens + outstanding_low,
        "low-priority conservation: {:?}",
        low
    );
    prop_assert_eq!(low.debt_total_us, m.low.charged_debt);
    prop_assert!(low.available_us >= -(m.low_max_debt as i64), "low-priority below max debt: {low:?}");
    // Keyspace buckets: in-flight equals the live grants' tenant tokens on that cell (a cell
    // with tokens in flight is never given up, so cell and keyspace name it).
    for e in p.keyspace_entries() {
        let b = e.bucket();
        check_bucket(&format!("keyspace {}", e.id()), b)?;
        prop_assert!(b.available_us >= -KEYSPACE_DEBT_BOUND, "keyspace {} debt unbounded: {b:?}", e.id());
        let live: u64 =
            m.live.iter().filter(|g| g.cell() == Some(e.cell()) && g.keyspace() == e.id()).map(|g| g.tenant_us()).sum();
        prop_assert_eq!(b.inflight_us(), live, "keyspace {} inflight", e.id());
        if b.in_debt() {
            prop_assert!(b.available_us <= 0, "keyspace {} in shrink debt holds tokens: {b:?}", e.id());
        }
    }
    Ok(())
}

fn release(p: &Policy, m: &mut Model, g: Grant, consumed: u64) {
    let (global, low) = (p.global_bucket(), p.low_priority_bucket());
    m.global.release(g.global_us(), consumed, global.available_us, m.global_max_debt);
    m.low.release(g.low_priority_us(), consumed, low.available_us, m.low_max_debt);
    p.release(g, consumed);
}

fn run_stream(settings: Settings, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let global_max_debt = settings.max_debt_for(settings.global_refill_us());
    let low_max_debt = settings.max_debt_for(settings.low_priority_refill_us());
    let p = Policy::new(settings, 0).unwrap();
    let mut m = Model {
        live: Vec::new(),
        global: NodeModel::default(),
        low: NodeModel::default(),
        global_max_debt,
        low_max_debt,
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
                    prop_assert_eq!(g.keyspace(), ks);
                    m.live.push(g);
                }
            }
            Op::Release { idx, consumed } if !m.live.is_empty() => {
                let g = m.live.swap_remove(idx % m.live.len());
                cum += consumed;
                release(&p, &mut m, g, consumed);
            }
            Op::TopUp { idx, us } if !m.live.is_empty() => {
                let i = idx % m.live.len();
                let _ = p.allocate_more(&mut m.live[i], us, now);
            }
            Op::Advance { dt } => {
                now += dt;
                p.tick(now, None);
            }
            Op::SetRatio { ratio } => {
                p.set_tenant_max_cpu_ratio(ratio).unwrap();
            }
            Op::SetQuota { ks, millicores } => {
                p.set_keyspace_quota_millicores(ks, millicores, now).unwrap();
            }
            Op::Observe => {
                p.tick(
                    now,
                    Some(&UsageSample {
                        global_cpu_cumulative_us: cum,
                        keyspace_cpu_us: vec![(1, cum / 7)],
                        ..UsageSample::default()
                    }),
                );
            }
            _ => {}
        }
        check(&p, &m)?;
    }
    // Drain: everything released, nothing outstanding anywhere.
    for g in std::mem::take(&mut m.live) {
        let used = g.granted_us();
        release(&p, &mut m, g, used);
    }
    check(&p, &m)?;
    for e in p.keyspace_entries() {
        prop_assert_eq!(e.bucket().inflight_us(), 0);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn prop_tokens_conserved_and_capacity_respected_in_cap_mode(ops in prop::collection::vec(op(), 1..300)) {
        let mut s = essential_settings(2.0, 0.3);
        // Forbidden with the cap by the configuration; the policy must stay consistent anyway
        // (the low-priority path is cap-aware).
        s.throttle_mut().low_priority_dag_global_enabled = true;
        s.throttle_mut().tenant_cap_idle_ttl = keyspace_governor::config::ConfigDuration::from_micros(50_000);
        // The configuration would refuse quotas while capped; the policy applies them, and the
        // cap takes precedence until a SetRatio of 0 lets them act.
        run_stream(s, ops)?;
    }

    #[test]
    fn prop_tokens_conserved_and_capacity_respected_in_premium_mode(ops in prop::collection::vec(op(), 1..300)) {
        let s = {
    let mut s = base();
    s.cpu_cores = 2.0;
    s.throttle_mut().enable_burst = true;
    s.throttle_mut().enable_dynamic_adjustment = true;
    s.throttle_mut().enable_fair_allocation = true;
    s.throttle_mut().enable_runtime_token_management = true;
    s.throttle_mut().keyspace_cpu_quotas = [(1, 500), (2, 1000)].into();
    s.resource.window_size = ConfigDuration::from_micros(20_000);
    s.resource.stats_interval = ConfigDuration::from_micros(10_000);
    s
};
        // SetRatio > 0 switches to cap mode with burst / fair / dynamic still set (the
        // configuration would refuse that combination; the policy must stay consistent).
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
        let mut s = essential_settings(2.0, 0.4); // cap 8_000 µs per 10 ms
        s.throttle_mut().burst_window = keyspace_governor::config::ConfigDuration::from_micros(INTERVAL); // capacity = one refill quantum
        s.throttle_mut().enable_runtime_token_management = runtime;
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
        let mut s = essential_settings(4.0, 0.2); // cap 8_000 µs per 10 ms each, global 24_000
        s.throttle_mut().burst_window = keyspace_governor::config::ConfigDuration::from_micros(INTERVAL);
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
