//! PD service-limit quotas from fetched values (keyspace-cpu-throttle.md, Key Component 2).

mod common;

use std::collections::BTreeMap;

use common::{SEC, base};
use keyspace_governor::config::ConfigDuration;
use keyspace_governor::policy::{PdAction, PdFetch, PdLimit, Policy, QuotaSource, Settings};

fn pd(f: impl FnOnce(&mut Settings)) -> Policy {
    let mut s = {
        let mut s = base();
        s.throttle_mut().enable_pd_service_limit = true;
        s.throttle_mut().pd_service_limit_ttl = ConfigDuration::from_micros(600 * SEC);
        s
    };
    f(&mut s);
    Policy::new(s, 0).unwrap()
}

fn fetched(v: &[(u32, PdLimit)]) -> PdFetch {
    PdFetch::Fetched(v.iter().copied().collect::<BTreeMap<_, _>>())
}

fn quota(p: &Policy, ks: u32) -> Option<u64> {
    p.keyspace(ks).map(|e| e.bucket().base_refill_us())
}

#[test]
fn pd_quotas_are_proportional_to_positive_limits() {
    let p = pd(|_| {});
    let a = p.apply_pd_service_limits(
        0,
        &fetched(&[(1, PdLimit::Limit(300.0)), (2, PdLimit::Limit(100.0)), (3, PdLimit::Limit(0.0))]),
    );
    // Two quotas set; keyspace 3 reported unlimited (no quota of any source).
    assert_eq!(a.len(), 3);
    assert!(a.contains(&PdAction::Remove { keyspace: 3 }));
    assert_eq!(quota(&p, 1), Some(36_000));
    assert_eq!(quota(&p, 2), Some(12_000));
    assert_eq!(quota(&p, 3), None, "0 = unlimited, does not participate");
    assert_eq!(p.keyspace(1).unwrap().source(), QuotaSource::Pd);
    // Below the update threshold (1 %): kept; above: applied.
    assert!(
        p.apply_pd_service_limits(SEC, &fetched(&[(1, PdLimit::Limit(301.0)), (2, PdLimit::Limit(100.0))])).is_empty()
    );
    p.apply_pd_service_limits(2 * SEC, &fetched(&[(1, PdLimit::Limit(100.0)), (2, PdLimit::Limit(100.0))]));
    assert_eq!((quota(&p, 1), quota(&p, 2)), (Some(24_000), Some(24_000)));
}

#[test]
fn pd_limit_zero_removes_quota_unless_static_config_wins() {
    let p = pd(|_| {});
    p.apply_pd_service_limits(0, &fetched(&[(1, PdLimit::Limit(100.0))]));
    assert!(quota(&p, 1).is_some());
    let a = p.apply_pd_service_limits(SEC, &fetched(&[(1, PdLimit::Limit(0.0))]));
    assert_eq!(a, vec![PdAction::Remove { keyspace: 1 }]);
    assert!(p.keyspace(1).is_none());
    let g = p.allocate(1, Some(1), SEC).unwrap();
    assert!(g.is_skip(), "unlimited");
    p.release(g, 1);

    let p = pd(|s| {
        s.throttle_mut().pd_override_config = false;
        s.throttle_mut().keyspace_cpu_quotas = [(1, 1000)].into(); // 10_000 µs
    });
    p.apply_pd_service_limits(0, &fetched(&[(1, PdLimit::Limit(100.0))]));
    assert_eq!(quota(&p, 1), Some(10_000), "static config is not overridden");
    p.apply_pd_service_limits(SEC, &fetched(&[(1, PdLimit::Limit(0.0))]));
    assert_eq!(quota(&p, 1), Some(10_000), "static quota kept on unlimited");
    assert_eq!(p.keyspace(1).unwrap().source(), QuotaSource::Config);

    let p = pd(|s| s.throttle_mut().keyspace_cpu_quotas = [(1, 1000)].into());
    p.apply_pd_service_limits(0, &fetched(&[(1, PdLimit::Limit(100.0))]));
    assert_eq!(quota(&p, 1), Some(48_000), "pd-override-config = true: PD wins");
    // ...its "unlimited" too: the static quota goes while PD says 0, and
    // comes back when PD stops answering for the keyspace.
    p.apply_pd_service_limits(SEC, &fetched(&[(1, PdLimit::Limit(0.0))]));
    assert!(p.keyspace(1).is_none(), "unlimited overrides the static quota");
    p.apply_pd_service_limits(2 * SEC, &fetched(&[(1, PdLimit::Limit(0.0))]));
    assert!(p.keyspace(1).is_none());
    for n in 0..3 {
        p.apply_pd_service_limits((3 + n) * SEC, &fetched(&[(1, PdLimit::NotFound)]));
    }
    assert_eq!(quota(&p, 1), Some(10_000), "static quota back after PD dropped the keyspace");
}

#[test]
fn pd_404_removes_only_after_consecutive_count_or_ttl() {
    let p = pd(|s| s.throttle_mut().pd_service_limit_consecutive_404 = 3);
    p.apply_pd_service_limits(0, &fetched(&[(1, PdLimit::Limit(100.0)), (2, PdLimit::Limit(100.0))]));
    for i in 1..=2 {
        assert!(
            p.apply_pd_service_limits(i * SEC, &fetched(&[(1, PdLimit::NotFound), (2, PdLimit::Limit(100.0))]))
                .is_empty()
        );
        assert!(quota(&p, 1).is_some(), "404 #{i} tolerated");
    }
    let a = p.apply_pd_service_limits(3 * SEC, &fetched(&[(1, PdLimit::NotFound), (2, PdLimit::Limit(100.0))]));
    assert!(a.contains(&PdAction::Remove { keyspace: 1 }));
    assert!(quota(&p, 1).is_none());
    assert_eq!(quota(&p, 2), Some(48_000), "sole remaining keyspace gets everything");
    // A success resets the 404 streak.
    p.apply_pd_service_limits(4 * SEC, &fetched(&[(2, PdLimit::NotFound)]));
    p.apply_pd_service_limits(5 * SEC, &fetched(&[(2, PdLimit::Limit(100.0))]));
    p.apply_pd_service_limits(6 * SEC, &fetched(&[(2, PdLimit::NotFound)]));
    assert!(quota(&p, 2).is_some());
    // TTL: not confirmed for 600 s.
    let a = p.apply_pd_service_limits(606 * SEC, &fetched(&[]));
    assert_eq!(a, vec![PdAction::Remove { keyspace: 2 }]);
}

#[test]
fn pd_unreachable_keeps_last_quotas() {
    let p = pd(|_| {});
    p.apply_pd_service_limits(0, &fetched(&[(1, PdLimit::Limit(100.0))]));
    for i in 1..100 {
        assert!(p.apply_pd_service_limits(i * 60 * SEC, &PdFetch::Unreachable).is_empty());
    }
    assert_eq!(quota(&p, 1), Some(48_000));
    // PD is back after 99 minutes: the outage (from the first round that
    // missed it, at 60 s) does not count towards the 600 s TTL, so a
    // keyspace whose first fetches fail keeps its quota...
    let back = 99 * 60 * SEC + SEC;
    assert!(p.apply_pd_service_limits(back, &fetched(&[])).is_empty());
    assert!(p.apply_pd_service_limits(back + 539 * SEC, &fetched(&[])).is_empty());
    assert_eq!(quota(&p, 1), Some(48_000));
    // ...until the TTL has run while PD answered (60 s before, 540 s after).
    let a = p.apply_pd_service_limits(back + 541 * SEC, &fetched(&[]));
    assert_eq!(a, vec![PdAction::Remove { keyspace: 1 }]);
}

#[test]
fn pd_quota_throttles_and_does_not_outlive_pd() {
    let p = pd(|s| s.throttle_mut().keyspace_cpu_quotas = [(2, 1000)].into());
    p.apply_pd_service_limits(0, &fetched(&[(1, PdLimit::Limit(100.0)), (2, PdLimit::Limit(100.0))]));
    assert_eq!((quota(&p, 1), quota(&p, 2)), (Some(24_000), Some(24_000)));
    // The PD quota is a bucket like any other: capacity = rate × 100 ms burst window.
    let e = p.keyspace(1).unwrap();
    assert_eq!(e.bucket().capacity_us(), 240_000);
    let g = p.allocate(1, Some(240_000), 0).unwrap();
    assert!(!g.is_skip());
    assert_eq!(
        p.allocate(1, Some(1), 0).unwrap_err(),
        keyspace_governor::policy::Refusal::KeyspaceCpuExhaustedNoBurst { keyspace: 1 }
    );
    p.release(g, 240_000);
    // Turning PD off online drops its quotas; a static quota comes back.
    let mut s = p.settings().clone();
    s.throttle_mut().enable_pd_service_limit = false;
    p.update_settings(s).unwrap();
    assert_eq!(quota(&p, 1), None);
    assert_eq!(quota(&p, 2), Some(10_000));
    assert_eq!(p.keyspace(2).unwrap().source(), QuotaSource::Config);
    assert_eq!(p.keyspaces_from(QuotaSource::Pd), Vec::<u32>::new());
    // And with PD off, answers are ignored.
    assert!(p.apply_pd_service_limits(SEC, &fetched(&[(1, PdLimit::Limit(100.0))])).is_empty());
    assert_eq!(quota(&p, 1), None);
}
