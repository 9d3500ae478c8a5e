//! keyspace-write-quota.md: the seed's three tests, plus counters by reason.

use governor::policy::{KEYSPACE_PENDING_WRITE_RATIO, Policy, Refusal, Settings, WriteLimitKind};

fn policy(threshold: u64) -> Policy {
    Policy::new(
        Settings {
            pending_write_threshold_bytes: threshold,
            ..Settings::default()
        },
        0,
    )
    .unwrap()
}

#[test]
fn write_quota_heavy_keyspace_hits_its_limit_while_others_pass() {
    let p = policy(1000);
    let w = p.pending_writes();
    assert_eq!(KEYSPACE_PENDING_WRITE_RATIO, 0.3);
    assert_eq!(w.keyspace_threshold_bytes(), 300);
    for _ in 0..3 {
        w.try_inc(1, 100).unwrap();
    }
    assert_eq!(w.global_bytes(), 300, "below the global cap");
    let err = w.try_inc(1, 100).unwrap_err();
    assert!(matches!(
        err,
        Refusal::WriteBytesLimited {
            keyspace: 1,
            kind: WriteLimitKind::KeyspaceLimit,
            pending_bytes: 300,
            threshold_bytes: 300
        }
    ));
    assert_eq!(err.reason(), "write_keyspace_limit");
    w.try_inc(2, 100).unwrap();
    let snap = w.snapshot();
    assert_eq!(
        (snap.refused_keyspace_limit, snap.refused_global_limit),
        (1, 0)
    );
    w.dec(1, 100);
    w.try_inc(1, 100).unwrap();
}

#[test]
fn write_quota_global_cap_still_enforced() {
    let p = policy(1000);
    let w = p.pending_writes();
    for ks in 1..=4 {
        w.try_inc(ks, 250).unwrap(); // each below 300
    }
    assert_eq!(w.global_bytes(), 1000);
    let err = w.try_inc(5, 1).unwrap_err();
    assert!(matches!(
        err,
        Refusal::WriteBytesLimited {
            keyspace: 5,
            kind: WriteLimitKind::GlobalLimit,
            ..
        }
    ));
    assert_eq!(err.reason(), "write_global_limit");
    let snap = w.snapshot();
    assert_eq!(
        (snap.refused_keyspace_limit, snap.refused_global_limit),
        (0, 1)
    );
    for ks in 1..=4 {
        w.dec(ks, 250);
    }
    assert_eq!(w.global_bytes(), 0);
    assert_eq!(w.tracked_keyspaces(), 0, "entries dropped at zero");
}

#[test]
fn write_quota_uses_the_request_context_keyspace_id() {
    struct Ctx {
        keyspace_id: u32,
    }
    let p = policy(1000);
    let w = p.pending_writes();
    let heavy = Ctx { keyspace_id: 7 };
    w.try_inc(heavy.keyspace_id, 300).unwrap();
    assert_eq!(w.keyspace_bytes(7), 300);
    assert_eq!(w.keyspace_bytes(8), 0);
    // Same bytes, different context keyspace: the check follows the context id.
    assert!(w.try_inc(Ctx { keyspace_id: 8 }.keyspace_id, 100).is_ok());
    assert!(matches!(
        w.try_inc(heavy.keyspace_id, 1),
        Err(Refusal::WriteBytesLimited { keyspace: 7, .. })
    ));
}
