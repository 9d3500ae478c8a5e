//! The fast path under real threads: no token, byte or in-flight count leaks.

use std::sync::Arc;
use std::thread;

use governor::policy::{Policy, Settings};

#[test]
fn policy_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Policy>();
    assert_send_sync::<governor::policy::Grant>();
}

#[test]
fn concurrent_allocate_release_and_agent_ticks_conserve_tokens() {
    let mut s = Settings::essential(2.0, 0.3);
    s.enable_runtime_token_management = true;
    let p = Arc::new(Policy::new(s, 0).unwrap());
    let workers: Vec<_> = (0..2u32)
        .map(|t| {
            let p = Arc::clone(&p);
            thread::spawn(move || {
                let mut granted = 0u64;
                for i in 0..20_000u64 {
                    let ks = (i % 3) as u32 + t;
                    if let Ok(mut g) = p.allocate(ks, Some(500 + i % 700), i) {
                        if i % 5 == 0 {
                            let _ = p.allocate_more(&mut g, 300, i);
                        }
                        let consumed = g.granted_us() * (i % 3) / 2; // under, exact and over
                        p.release(g, consumed);
                        granted += 1;
                    }
                }
                granted
            })
        })
        .collect();
    let agent = {
        let p = Arc::clone(&p);
        thread::spawn(move || {
            for i in 0..2_000u64 {
                p.tick(i * 1_000, None);
            }
        })
    };
    let granted: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    agent.join().unwrap();
    assert!(granted > 0);
    let snap = p.snapshot();
    assert_eq!(snap.global.inflight_us, 0);
    assert_eq!(snap.global.ledger_available_us(), snap.global.available_us);
    assert!(snap.global.available_us <= snap.global.capacity_us);
    for k in &snap.keyspaces {
        assert_eq!(k.inflight_us, 0, "keyspace {}", k.keyspace);
        assert_eq!(k.bucket.ledger_available_us(), k.available_us);
        assert!(k.available_us <= k.capacity_us);
    }
    assert_eq!(snap.counters.granted, granted);
    assert_eq!(snap.counters.released, granted);
}
