//! keyspace-write-quota.md: the seed's three tests, plus counters by reason. Pending write
//! bytes are admitted on the fast path ([`Policy::admit`] with `Demand::write_bytes`) and
//! returned when the grant is released.

mod common;

use common::{SEC, base};
use keyspace_governor::config::ByteSize;
use keyspace_governor::policy::{Demand, Grant, KEYSPACE_PENDING_WRITE_RATIO, Policy, Refusal, WriteLimitKind};

/// A global threshold of `threshold` bytes. (The configuration's floor is 1 KiB; the seed's
/// arithmetic reads better with 1000, so the field is set directly.)
fn policy(threshold: u64) -> Policy {
    Policy::new(
        {
            let mut s = base();
            s.write_quota.pending_write_threshold = ByteSize(threshold);
            s
        },
        0,
    )
    .unwrap()
}

fn write(p: &Policy, keyspace: u32, bytes: u64) -> Result<Grant, Refusal> {
    p.admit(keyspace, &Demand { write_bytes: bytes, ..Demand::default() }, 0)
}

fn global_bytes(p: &Policy) -> u64 {
    p.snapshot().pending_writes.global_bytes
}

/// (refused by the keyspace limit, refused by the global limit).
fn refusals(p: &Policy) -> (u64, u64) {
    let c = p.counters();
    (c.write_refused_keyspace, c.write_refused_global)
}

#[test]
fn write_quota_heavy_keyspace_hits_its_limit_while_others_pass() {
    let p = policy(1000);
    assert_eq!(KEYSPACE_PENDING_WRITE_RATIO, 0.3);
    let w = p.snapshot().pending_writes;
    assert_eq!((w.global_threshold_bytes, w.keyspace_threshold_bytes), (1000, 300));
    let mut held: Vec<Grant> = (0..3).map(|_| write(&p, 1, 100).unwrap()).collect();
    assert!(held.iter().all(|g| g.write_bytes() == 100));
    assert_eq!(global_bytes(&p), 300, "below the global cap");
    assert_eq!(p.pending_write_bytes(1), 300);
    let err = write(&p, 1, 100).unwrap_err();
    assert_eq!(
        err,
        Refusal::WriteBytesLimited {
            keyspace: 1,
            kind: WriteLimitKind::KeyspaceLimit,
            pending_bytes: 300,
            threshold_bytes: 300
        }
    );
    assert_eq!(err.code(), "write_keyspace_limit");
    assert!(!err.is_tenant_admission_control());
    assert_eq!(p.pending_write_bytes(1), 300, "a refusal holds nothing");
    let other = write(&p, 2, 100).unwrap();
    assert_eq!(refusals(&p), (1, 0));
    assert_eq!(global_bytes(&p), 400);
    p.release(held.pop().unwrap(), 0);
    assert_eq!(p.pending_write_bytes(1), 200);
    held.push(write(&p, 1, 100).unwrap());
    for g in held.into_iter().chain([other]) {
        p.release(g, 0);
    }
    assert_eq!(global_bytes(&p), 0);
}

#[test]
fn write_quota_global_cap_still_enforced() {
    let p = policy(1000);
    let held: Vec<Grant> = (1..=4).map(|ks| write(&p, ks, 250).unwrap()).collect(); // each below 300
    assert_eq!(global_bytes(&p), 1000);
    let err = write(&p, 5, 1).unwrap_err();
    assert_eq!(
        err,
        Refusal::WriteBytesLimited {
            keyspace: 5,
            kind: WriteLimitKind::GlobalLimit,
            pending_bytes: 1000,
            threshold_bytes: 1000
        }
    );
    assert_eq!(err.code(), "write_global_limit");
    assert_eq!(refusals(&p), (0, 1));
    assert_eq!(p.pending_write_bytes(5), 0);
    // Pending bytes keep a keyspace's cell; nothing else does once it is idle.
    let ttl = p.tenant_cap_idle_ttl_us();
    assert_eq!(p.tick(ttl + SEC, None).evicted, 1, "only keyspace 5 (nothing pending)");
    assert_eq!(p.cells_in_use(), 4);
    for g in held {
        p.release(g, 0);
    }
    assert_eq!(global_bytes(&p), 0);
    assert!((1..=4).all(|ks| p.pending_write_bytes(ks) == 0));
    // The seed's "remove the entry at zero, no unbounded growth": idle cells are given up.
    assert_eq!(p.tick(2 * ttl + 2 * SEC, None).evicted, 4);
    assert_eq!(p.cells_in_use(), 0, "entries dropped once at zero and idle");
    // The node-wide refusal counters survive the keyspaces they were counted on.
    assert_eq!(refusals(&p), (0, 1));
}

#[test]
fn write_quota_uses_the_request_context_keyspace_id() {
    struct Ctx {
        keyspace_id: u32,
    }
    let p = policy(1000);
    let heavy = Ctx { keyspace_id: 7 };
    let a = write(&p, heavy.keyspace_id, 300).unwrap();
    assert_eq!(a.keyspace(), 7);
    assert_eq!(p.pending_write_bytes(7), 300);
    assert_eq!(p.pending_write_bytes(8), 0);
    // Same bytes, different context keyspace: the check follows the context id.
    let b = write(&p, Ctx { keyspace_id: 8 }.keyspace_id, 100).unwrap();
    assert_eq!(p.pending_write_bytes(8), 100);
    assert!(matches!(
        write(&p, heavy.keyspace_id, 1),
        Err(Refusal::WriteBytesLimited { keyspace: 7, kind: WriteLimitKind::KeyspaceLimit, .. })
    ));
    p.release(a, 0);
    p.release(b, 0);
    assert_eq!((p.pending_write_bytes(7), p.pending_write_bytes(8)), (0, 0));
}

#[test]
fn write_bytes_and_the_in_flight_place_come_back_when_cpu_refuses() {
    let p = Policy::new(
        {
            let mut s = base();
            s.write_quota.pending_write_threshold = ByteSize(1000);
            s.admission.mode = keyspace_governor::policy::AdmissionMode::Enforced;
            s.admission.max_concurrent_per_tenant = 10;
            s.throttle_mut().keyspace_cpu_quotas = [(1, 100)].into();
            s
        },
        0,
    )
    .unwrap();
    let demand = |est| Demand { estimate_us: Some(est), write_bytes: 200, ..Demand::default() };
    let g = p.admit(1, &demand(10_000), 0).unwrap();
    assert_eq!((g.write_bytes(), g.counted(), g.tenant_us()), (200, true, 10_000));
    assert_eq!(p.admit(1, &demand(1), 0).unwrap_err(), Refusal::KeyspaceCpuExhaustedNoBurst { keyspace: 1 });
    assert_eq!(p.pending_write_bytes(1), 200, "refused request's bytes given back");
    assert_eq!(global_bytes(&p), 200);
    assert_eq!(p.inflight_requests(1), 1, "refused request's place given back");
    p.release(g, 10_000);
    assert_eq!((p.pending_write_bytes(1), global_bytes(&p), p.inflight_requests(1)), (0, 0, 0));
}
