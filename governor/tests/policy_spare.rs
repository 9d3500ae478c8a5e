//! Spare tokens: a thread keeps its tickets' refunds (up to one request's
//! worth) for its next request of the same keyspace, and gives them back the
//! moment anyone waits.

mod common;

use common::essential;
use keyspace_governor::policy::{Demand, Policy, Refusal, SPARE_MAX_US, Spare, acquire_with, release_with};
use keyspace_governor::region::{AdmissionRegions, BucketView, CellRef, GLOBAL};
use std::sync::atomic::Ordering;

fn demand(us: u64) -> Demand {
    Demand { estimate_us: Some(us), ..Demand::default() }
}

fn tail(b: &BucketView) -> u64 {
    b.tail_us.load(Ordering::Acquire)
}

/// A cap-mode policy with keyspace `ks` in the directory: its regions,
/// cell and tenant bucket.
fn setup(p: &Policy, ks: u32) -> Option<CellRef> {
    p.release(p.allocate(ks, Some(10), 0).unwrap(), 10);
    p.regions().directory().find(ks)
}

fn tenant(r: &AdmissionRegions, cell: Option<CellRef>) -> &BucketView {
    r.keyspace_cell(cell.unwrap().index).unwrap().0
}

#[test]
fn a_refund_stays_with_the_thread_and_serves_its_next_request_without_touching_the_buckets() {
    let p = essential(0.4);
    let cell = setup(&p, 1);
    let r = p.regions();
    let k = r.header().knobs.snapshot();
    let mut s = Spare::default();
    let g = acquire_with(r, &k, 1, cell, &demand(300), Some(&mut s)).unwrap();
    assert_eq!((g.tenant_us(), g.global_us()), (300, 300));
    release_with(r, &g, 100, Some(&mut s));
    assert_eq!(s, Spare { cell, us: 200 }, "the unused 200 µs stay spare");
    assert_eq!(p.keyspace(1).unwrap().bucket().inflight_us(), 200, "spare tokens count in flight");

    // The next request fits in the spare: neither bucket moves, either way.
    let (t0, g0) = (tail(tenant(r, cell)), tail(r.bucket(GLOBAL)));
    let (h0, gh0) = (tenant(r, cell).head_us.load(Ordering::Acquire), r.bucket(GLOBAL).head_us.load(Ordering::Acquire));
    let g = acquire_with(r, &k, 1, cell, &demand(200), Some(&mut s)).unwrap();
    assert_eq!((g.tenant_us(), g.global_us(), s.us), (200, 200, 0));
    release_with(r, &g, 50, Some(&mut s));
    assert_eq!(s.us, 150);
    assert_eq!((tail(tenant(r, cell)), tail(r.bucket(GLOBAL))), (t0, g0));
    assert_eq!(tenant(r, cell).head_us.load(Ordering::Acquire), h0);
    assert_eq!(r.bucket(GLOBAL).head_us.load(Ordering::Acquire), gh0);
    assert_eq!(p.keyspace(1).unwrap().bucket().inflight_us(), 150);
    let c = *p.keyspace(1).unwrap().counters();
    assert_eq!((c.granted, c.released, c.consumed_us), (3, 3, 160), "every ticket is counted as ever");

    // A request larger than the spare takes from the buckets; its refund
    // tops the spare up to one request's worth and the rest goes back.
    let g = acquire_with(r, &k, 1, cell, &demand(300), Some(&mut s)).unwrap();
    assert_eq!((tail(tenant(r, cell)) - t0, s.us), (300, 150));
    release_with(r, &g, 0, Some(&mut s));
    assert_eq!(s.us, 300, "kept: min(grant, {SPARE_MAX_US} µs)");
    assert_eq!(tenant(r, cell).head_us.load(Ordering::Acquire) - h0, 150, "the rest went back");
    assert_eq!(p.keyspace(1).unwrap().bucket().inflight_us(), 300);

    // A request of another keyspace: the spare goes back to keyspace 1.
    let other = setup(&p, 2);
    let g = acquire_with(r, &k, 2, other, &demand(100), Some(&mut s)).unwrap();
    assert_eq!(s.us, 0);
    assert_eq!(p.keyspace(1).unwrap().bucket().inflight_us(), 0);
    release_with(r, &g, 0, Some(&mut s));
    assert_eq!(s, Spare { cell: other, us: 100 });
    s.give_back(r);
    assert_eq!(p.keyspace(2).unwrap().bucket().inflight_us(), 0);
    // Every token accounted for: what the buckets show is what their books say.
    for ks in [1, 2] {
        let b = p.keyspace(ks).unwrap().bucket().snapshot();
        assert_eq!(b.ledger_available_us(), b.available_us, "keyspace {ks}");
    }
    assert_eq!(p.global_bucket().ledger_available_us(), p.global_bucket().available_us);
}

#[test]
fn a_waiter_gets_the_spare_and_nobody_overtakes_it() {
    let p = essential(0.4);
    let cell = setup(&p, 1);
    let r = p.regions();
    let k = r.header().knobs.snapshot();
    let mut s = Spare::default();
    let g = acquire_with(r, &k, 1, cell, &demand(500), Some(&mut s)).unwrap();
    release_with(r, &g, 0, Some(&mut s));
    assert_eq!(s.us, 500);
    // Someone waits in line on the tenant bucket (it asked for more than
    // is there).
    let b = tenant(r, cell);
    let need = b.available_us() as u64 + 1_000;
    let pos = b.reserve(need);
    assert!(!b.reached(pos));
    // This thread's next request does not jump the line: its spare goes to
    // the bucket (moving the waiter up) and it is refused like anyone.
    let head = b.head_us.load(Ordering::Acquire);
    let err = acquire_with(r, &k, 1, cell, &demand(100), Some(&mut s)).unwrap_err();
    assert_eq!(err, Refusal::TenantCpuExhausted { keyspace: 1 });
    assert_eq!(s.us, 0);
    assert_eq!(b.head_us.load(Ordering::Acquire) - head, 500, "the spare went to the line");
    assert!(!b.reached(pos), "500 of the 1000 missing");
    b.cancel(need);
}

#[test]
fn a_refund_goes_to_the_buckets_while_anyone_waits_and_an_overrun_is_paid_from_the_spare_first() {
    let p = essential(0.4);
    let cell = setup(&p, 1);
    let r = p.regions();
    let k = r.header().knobs.snapshot();
    let mut s = Spare::default();
    // A sleeper on the global bucket: refunds go back (they wake it).
    let g = acquire_with(r, &k, 1, cell, &demand(400), Some(&mut s)).unwrap();
    r.bucket(GLOBAL).sleepers.fetch_add(1, Ordering::SeqCst);
    release_with(r, &g, 100, Some(&mut s));
    r.bucket(GLOBAL).sleepers.fetch_sub(1, Ordering::SeqCst);
    assert_eq!(s.us, 0);
    assert_eq!(p.keyspace(1).unwrap().bucket().inflight_us(), 0);

    // Quiet again: the refund of a 300 µs request stays spare.
    let g = acquire_with(r, &k, 1, cell, &demand(300), Some(&mut s)).unwrap();
    release_with(r, &g, 0, Some(&mut s));
    assert_eq!(s.us, 300);
    let g = acquire_with(r, &k, 1, cell, &demand(200), Some(&mut s)).unwrap();
    assert_eq!(s.us, 100);
    let debt0 = p.keyspace(1).unwrap().bucket().debt_total_us;
    release_with(r, &g, 250, Some(&mut s));
    assert_eq!(s.us, 50, "the 50 µs overrun came out of the spare");
    assert_eq!(p.keyspace(1).unwrap().bucket().debt_total_us, debt0, "no debt");
    let g = acquire_with(r, &k, 1, cell, &demand(40), Some(&mut s)).unwrap();
    release_with(r, &g, 140, Some(&mut s));
    assert_eq!(s.us, 0);
    assert_eq!(p.keyspace(1).unwrap().bucket().debt_total_us - debt0, 90, "100 over: 10 from the spare, 90 as debt");
    assert_eq!(p.keyspace(1).unwrap().bucket().inflight_us(), 0);
    let b = p.keyspace(1).unwrap().bucket().snapshot();
    assert_eq!(b.ledger_available_us(), b.available_us);
}
