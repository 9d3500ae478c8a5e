//! Spare tokens through the client: a thread keeps its last ticket's
//! refund for its next ticket of the same keyspace. The agent sees it in
//! flight, and gets it back when the thread ends.

use governor_tests::{Agent, essential_config};
use keyspace_governor::client::{Client, Demand};

#[test]
fn a_thread_keeps_one_requests_refund_and_gives_it_back_when_it_ends() {
    let agent = Agent::start("ebpf", &essential_config(0.25)).unwrap();
    let c = Client::connect(&agent.socket).unwrap();
    let keyspace = |id: u32| {
        agent.status().unwrap().keyspaces.into_iter().find(|k| k.keyspace_id == id).expect("keyspace in status")
    };
    let inflight = |id: u32| keyspace(id).bucket.expect("a cap bucket").inflight_us;
    std::thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..1000 {
                drop(c.acquire(9, Demand::new().estimate_us(700)).expect("tokens"));
            }
            assert_eq!(inflight(9), 700, "one request's worth stays spare");
            let k = keyspace(9);
            assert_eq!((k.granted, k.inflight_requests), (1000, 0), "{k:?}");
            // A smaller request from the spare; its refund keeps only its own worth.
            drop(c.acquire(9, Demand::new().estimate_us(300)).expect("tokens"));
            assert_eq!(inflight(9), 300);
            // A request of another keyspace takes keyspace 9's spare back.
            drop(c.acquire(10, Demand::new().estimate_us(200)).expect("tokens"));
            assert_eq!((inflight(9), inflight(10)), (0, 200));
        })
        .join()
        .unwrap();
    });
    // The thread ended: its spare went back.
    assert_eq!(inflight(10), 0);
    assert_eq!(keyspace(10).granted, 1);
}

#[test]
fn tickets_move_between_threads_and_a_full_block_spills_into_the_shared_half() {
    let agent = Agent::start("ebpf", &essential_config(0.25)).unwrap();
    let c = Client::connect(&agent.socket).unwrap();
    let keyspace = |id: u32| {
        agent.status().unwrap().keyspaces.into_iter().find(|k| k.keyspace_id == id).expect("keyspace in status")
    };
    // One thread takes 20 tickets: 7 fit in its block, the rest are claimed
    // in the shared half of the ledger.
    let held: Vec<_> = std::thread::scope(|s| {
        s.spawn(|| (0..20).map(|_| c.acquire(5, Demand::new().estimate_us(100)).expect("tokens")).collect::<Vec<_>>())
            .join()
            .unwrap()
    });
    // That thread has ended (its block went back); its tickets still hold.
    let k = keyspace(5);
    assert_eq!((k.granted, k.bucket.as_ref().unwrap().inflight_us), (20, 2000), "{k:?}");
    // Another thread drops half of them and takes new ones: the records of
    // the old block are still held, so its new block (perhaps the same
    // one) claims around them.
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut held = held;
            held.truncate(10);
            let more: Vec<_> = (0..10).map(|_| c.acquire(5, Demand::new().estimate_us(100)).expect("tokens")).collect();
            let k = keyspace(5);
            assert_eq!((k.granted, k.bucket.as_ref().unwrap().inflight_us), (30, 2000), "{k:?}");
            drop(more);
            drop(held);
            // Its spare holds one request's worth.
            assert_eq!(keyspace(5).bucket.unwrap().inflight_us, 100);
        })
        .join()
        .unwrap();
    });
    let k = keyspace(5);
    assert_eq!((k.granted, k.bucket.as_ref().unwrap().inflight_us), (30, 0), "{k:?}");
}
