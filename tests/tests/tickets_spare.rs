//! Spare tokens through the client: a thread keeps its last ticket's
//! refund for its next ticket of the same keyspace. The agent sees it in
//! flight, and gets it back when the thread ends.

use governor::client::{Client, Demand};
use governor_tests::{essential_config, Agent};

#[test]
fn a_thread_keeps_one_requests_refund_and_gives_it_back_when_it_ends() {
    let agent = Agent::start("ebpf", &essential_config(0.25)).unwrap();
    let c = Client::connect(&agent.socket).unwrap();
    let keyspace = |id: u32| agent.status().unwrap().keyspaces.into_iter().find(|k| k.keyspace_id == id).expect("keyspace in status");
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
