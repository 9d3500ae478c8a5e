//! The fast path under real threads: no token, byte or in-flight count leaks.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;

use common::essential_settings;
use keyspace_governor::policy::{AdmissionMode, Demand, Policy};

#[test]
fn policy_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Policy>();
    assert_send_sync::<keyspace_governor::policy::Grant>();
}

/// What one worker did, for the conservation checks.
#[derive(Default)]
struct Tally {
    granted: u64,
    /// Σ min(consumed, global µs held) over released grants.
    global_consumed_from_tokens: u64,
}

#[test]
fn concurrent_allocate_release_and_agent_ticks_conserve_tokens() {
    let mut s = essential_settings(2.0, 0.3);
    s.throttle_mut().enable_runtime_token_management = true;
    // Count in-flight requests and pending write bytes too (never refusing: no limit, and a
    // threshold far above what is ever pending).
    s.admission.mode = AdmissionMode::Monitor;
    s.admission.max_concurrent_per_tenant = 0;
    let p = Arc::new(Policy::new(s, 0).unwrap());
    let done = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..4u32)
        .map(|t| {
            let p = Arc::clone(&p);
            thread::spawn(move || {
                let mut tally = Tally::default();
                for i in 0..100_000u64 {
                    let ks = (i % 3) as u32 + t;
                    let demand = Demand {
                        estimate_us: Some(500 + i % 700),
                        write_bytes: if i % 4 == 0 { 100 + i % 900 } else { 0 },
                        ..Demand::default()
                    };
                    if let Ok(mut g) = p.admit(ks, &demand, i) {
                        if i % 5 == 0 {
                            let _ = p.allocate_more(&mut g, 300, i);
                        }
                        let consumed = g.granted_us() * (i % 3) / 2; // under, exact and over
                        tally.global_consumed_from_tokens += consumed.min(g.global_us());
                        p.release(g, consumed);
                        tally.granted += 1;
                    }
                }
                tally
            })
        })
        .collect();
    // The agent refills (every simulated ms) and scans for idle cells while the workers run.
    let agent = {
        let p = Arc::clone(&p);
        let done = Arc::clone(&done);
        thread::spawn(move || {
            let mut i = 0u64;
            // At most 100 simulated seconds: far below the idle TTL, so no cell is given up.
            while !done.load(Ordering::Relaxed) && i < 100_000 {
                p.tick(i * 1_000, None);
                i += 1;
            }
            i
        })
    };
    let tallies: Vec<Tally> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    done.store(true, Ordering::Relaxed);
    let ticks = agent.join().unwrap();
    assert!(ticks > 0);
    let granted: u64 = tallies.iter().map(|t| t.granted).sum();
    let consumed: u64 = tallies.iter().map(|t| t.global_consumed_from_tokens).sum();
    assert!(granted > 0);
    let snap = p.snapshot();
    // Global: everything taken came back as refunds or was consumed; nothing outstanding.
    assert_eq!(snap.global.taken_total_us, snap.global.refunded_total_us + consumed);
    assert_eq!(snap.global.ledger_available_us(), snap.global.available_us);
    assert!(snap.global.available_us <= snap.global.capacity_us);
    assert_eq!(snap.pending_writes.global_bytes, 0);
    assert_eq!(snap.keyspaces.len(), 6);
    for k in &snap.keyspaces {
        assert_eq!(k.inflight_us, 0, "keyspace {}", k.keyspace);
        assert_eq!(k.inflight_requests, 0, "keyspace {}", k.keyspace);
        assert_eq!(k.pending_write_bytes, 0, "keyspace {}", k.keyspace);
        assert_eq!(k.bucket.ledger_available_us(), k.available_us);
        assert!(k.available_us <= k.capacity_us);
        assert_eq!(k.counters.granted, k.counters.released, "keyspace {}", k.keyspace);
    }
    assert_eq!(snap.counters.granted, granted);
    assert_eq!(snap.counters.released, granted);
    assert_eq!(snap.counters.concurrency_refused, 0);
}
