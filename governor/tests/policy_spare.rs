//! Spare tokens: a thread keeps its tickets' refunds (up to one request's
//! worth) for its next request of the same keyspace, and gives them back the
//! moment anyone waits.

mod common;

use common::essential;
use keyspace_governor::policy::{
    Demand, Policy, Refusal, SPARE_MAX_US, Spare, acquire_spared, acquire_with, release_with,
};
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

/// Two policies in the same state, each thread holding a spare of 400 µs
/// of keyspace 1.
fn spared_pair() -> [(Policy, Option<CellRef>, Spare); 2] {
    [0, 1].map(|_| {
        let p = essential(0.4);
        let cell = setup(&p, 1);
        let mut s = Spare::default();
        let r = p.regions();
        let k = r.header().knobs.snapshot();
        let g = acquire_with(r, &k, 1, cell, &demand(400), Some(&mut s)).unwrap();
        release_with(r, &g, 0, Some(&mut s));
        assert_eq!(s.us, 400);
        (p, cell, s)
    })
}

#[test]
fn the_spared_lane_grants_what_the_ordinary_path_grants_from_the_spare() {
    let [(p1, cell1, mut s1), (p2, cell2, mut s2)] = spared_pair();
    assert_eq!(cell1, cell2);
    let (r1, r2) = (p1.regions(), p2.regions());
    let k1 = r1.header().knobs.snapshot();
    for (us, kind) in [(150, 0), (100, 3), (50, 7)] {
        let d = Demand { kind, ..demand(us) };
        let ordinary = acquire_with(r1, &k1, 1, cell1, &d, Some(&mut s1)).unwrap();
        let lane = acquire_spared(r2, 1, &d, &mut s2).expect("the lane takes it");
        assert_eq!(lane, ordinary, "the same grant");
        assert_eq!(s2, s1, "the same spare left");
        let (e1, e2) = (p1.keyspace(1).unwrap(), p2.keyspace(1).unwrap());
        assert_eq!(e2.bucket().snapshot(), e1.bucket().snapshot(), "the same bucket");
        assert_eq!(*e2.counters(), *e1.counters(), "the same counters");
        assert_eq!(p2.global_bucket(), p1.global_bucket(), "the same global bucket");
        release_with(r1, &ordinary, us / 2, Some(&mut s1));
        release_with(r2, &lane, us / 2, Some(&mut s2));
    }
}

#[test]
fn the_spared_lane_leaves_everything_else_to_the_ordinary_path_untouched() {
    let [(p, cell, mut s), _] = spared_pair();
    let r = p.regions();
    let before = (p.keyspace(1).unwrap().bucket().snapshot(), *p.keyspace(1).unwrap().counters(), s);
    let untouched = |s: &Spare| {
        assert_eq!((p.keyspace(1).unwrap().bucket().snapshot(), *p.keyspace(1).unwrap().counters(), *s), before);
    };
    let declines = [
        ("write bytes", Demand { write_bytes: 10, ..demand(100) }, 1),
        ("low priority", Demand { low_priority: true, ..demand(100) }, 1),
        ("more than the spare holds", demand(500), 1),
        ("another keyspace", demand(100), 2),
    ];
    for (what, d, ks) in declines {
        assert_eq!(acquire_spared(r, ks, &d, &mut s), None, "{what}");
        untouched(&s);
    }
    // Someone asleep on the global bucket: the spare is not to be used.
    r.bucket(GLOBAL).sleepers.fetch_add(1, Ordering::SeqCst);
    assert_eq!(acquire_spared(r, 1, &demand(100), &mut s), None, "a sleeper");
    r.bucket(GLOBAL).sleepers.fetch_sub(1, Ordering::SeqCst);
    untouched(&s);
    // The cell given to another keyspace since: the spare is not its.
    let stale = Spare { cell: cell.map(|c| CellRef { generation: c.generation + 1, ..c }), ..s };
    let mut stale2 = stale;
    assert_eq!(acquire_spared(r, 1, &demand(100), &mut stale2), None, "a stale cell");
    assert_eq!(stale2, stale);
    // Quiet again, the same request goes through.
    assert!(acquire_spared(r, 1, &demand(100), &mut s).is_some());
    assert_eq!(s.us, 300);
}

/// A capped tenant that stopped keeps its threads' spare tokens, but with
/// no ticket running its bucket is trimmed to one interval as any idle
/// capped bucket is (the spare must not keep it full: back from idle, it
/// would take ten intervals at once); a ticket running keeps it whole.
#[test]
fn spare_tokens_alone_do_not_keep_an_idle_capped_bucket_full() {
    let p = essential(0.4);
    let cell = setup(&p, 1);
    let r = p.regions();
    let k = r.header().knobs.snapshot();
    let mut s = Spare::default();
    let g = acquire_with(r, &k, 1, cell, &demand(300), Some(&mut s)).unwrap();
    release_with(r, &g, 100, Some(&mut s));
    let b = tenant(r, cell);
    assert_eq!(b.inflight_us(), 200, "spare tokens count in flight");
    let interval = p.tenant_cap_refill_us();
    // A second of refill intervals, no ticket running: one interval's worth.
    for i in 1..=100 {
        p.tick(i * 10_000, None);
    }
    assert_eq!(b.available_us(), interval as i64, "trimmed to one interval");
    // A ticket running: the refills fill it (its refunds need the room).
    let running = acquire_with(r, &k, 1, cell, &demand(1000), None).unwrap();
    for i in 101..=200 {
        p.tick(i * 10_000, None);
    }
    assert!(b.available_us() > 5 * interval as i64, "{} µs with a ticket running", b.available_us());
    release_with(r, &running, 1000, None);
}
