//! Tickets when things fail: the agent dies (clients admit at once and
//! re-attach when it is back), a client dies holding tickets (the agent
//! returns everything), a client scribbles on the regions (the agent keeps
//! serving the others).

use governor_tests::{Agent, Holder, Stretch, bare_cap_config};
use keyspace_governor::client::{self, Client, Demand};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn capped() -> String {
    let ratio = 0.05 / std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as f64;
    format!(
        "[resource-control.cpu-throttle]\nenabled = true\nenforce-global-limit = true\ntenant-max-cpu-ratio = {ratio}\n\
         enable-burst = false\nenable-fair-allocation = false\nenable-dynamic-adjustment = false\n\
         enable-runtime-token-management = false\nenable-adaptive-estimated-cpu-per-request-us = false\n\
         [admission-control]\nmode = \"monitor\"\n"
    )
}

#[test]
fn a_dead_agent_admits_everyone_within_a_second_and_a_new_one_governs_again() {
    let _s = serial();
    let mut agent = Agent::start("ebpf", &capped()).unwrap();
    let c = Client::connect(&agent.socket).unwrap();
    // Four threads ask for more than the cap gives (0.05 core), with a long
    // deadline: most of the time they wait in line.
    let stop = Arc::new(AtomicBool::new(false));
    let longest_after_death = Arc::new(AtomicU64::new(0));
    let died_at = Arc::new(Mutex::new(None::<Instant>));
    let first_admit_after_death = Arc::new(Mutex::new(None::<Instant>));
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let (c, stop, longest, died_at, first) = (
                c.clone(),
                stop.clone(),
                longest_after_death.clone(),
                died_at.clone(),
                first_admit_after_death.clone(),
            );
            std::thread::spawn(move || {
                c.register_current_thread().ok();
                while !stop.load(Ordering::Relaxed) {
                    let t0 = Instant::now();
                    let r = c.acquire(3, Demand::new().estimate_us(5_000).timeout(Duration::from_secs(10)));
                    let done = Instant::now();
                    if let Some(d) = *died_at.lock().unwrap()
                        && done > d
                    {
                        let since = done.saturating_duration_since(t0.max(d));
                        longest.fetch_max(since.as_micros() as u64, Ordering::Relaxed);
                        if r.is_ok() {
                            first.lock().unwrap().get_or_insert(done);
                        }
                    }
                    if let Ok(mut t) = r {
                        let _g = t.enter();
                        let end = keyspace_governor::sys::thread_cputime_ns() + 2_000_000;
                        while keyspace_governor::sys::thread_cputime_ns() < end {}
                    }
                }
            })
        })
        .collect();
    // A registered thread that will try to tag, and read its clock, after
    // the agent is gone: the tag reports the loss, the clock reads on (the
    // kernel's, by the syscall), and the thread is no longer measured.
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let tagger = std::thread::spawn({
        let c = c.clone();
        move || {
            c.register_current_thread().unwrap();
            wait.recv().unwrap();
            let before = keyspace_governor::sys::thread_cputime_ns();
            let clock = client::thread_cpu_ns();
            let after = keyspace_governor::sys::thread_cputime_ns();
            assert!(clock.is_some_and(|t| (before..=after).contains(&t)), "{before} {clock:?} {after}");
            assert!(!client::is_measured());
            client::tag(9).err().map(|e| e.to_string())
        }
    });
    std::thread::sleep(Duration::from_secs(1));
    let governed_before = c.fail_open_count();
    assert_eq!(governed_before, 0);
    // kill -9 under load.
    *died_at.lock().unwrap() = Some(Instant::now());
    agent.kill9().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let fail_open = c.fail_open_count();
    assert!(fail_open > 50, "only {fail_open} admitted without the agent");
    let longest = Duration::from_micros(longest_after_death.load(Ordering::Relaxed));
    let first = first_admit_after_death.lock().unwrap().unwrap() - died_at.lock().unwrap().unwrap();
    eprintln!(
        "after the agent's death: first admit {first:?}, longest acquire {longest:?}, {fail_open} fail-open admits"
    );
    assert!(longest < Duration::from_secs(1), "an acquire waited {longest:?} after the agent died");
    // Tags report the loss instead of writing into orphaned maps.
    go.send(()).unwrap();
    let tagged = tagger.join().unwrap();
    assert!(tagged.as_deref().is_some_and(|e| e.contains("gone")), "tag after the agent died: {tagged:?}");
    // A new agent on the same socket: the client re-attaches by itself and
    // is governed again.
    agent.restart().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while c.attachments() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(c.attachments(), 2, "the client did not re-attach");
    std::thread::sleep(Duration::from_millis(500));
    let before = c.fail_open_count();
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(c.fail_open_count(), before, "still admitting without checks after the agent came back");
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    // Governed: the cap held the new agent's keyspace near 0.05 core, and
    // its workers' threads were measured again (they re-registered).
    let status = agent.status().unwrap();
    let k = status.keyspaces.iter().find(|k| k.keyspace_id == 3).expect("keyspace 3 under the new agent");
    assert!(k.granted > 0 && k.waited > 0, "{k:?}");
    assert!(k.cpu_seconds > 0.0 && k.cpu_seconds < 0.2, "{k:?}");
    // The workers (gone by now) had registered with the new agent by themselves.
    assert!(status.threads.handed_out >= 4, "{:?}", status.threads);
}

#[test]
fn a_client_killed_holding_tickets_gets_everything_returned() {
    let _s = serial();
    let config = "[resource-control.cpu-throttle]\nenabled = true\nenforce-global-limit = true\n\
                  tenant-max-cpu-ratio = 0.4\nenable-burst = false\nenable-fair-allocation = false\n\
                  enable-dynamic-adjustment = false\nenable-runtime-token-management = false\n\
                  [admission-control]\nmode = \"monitor\"\n";
    let agent = Agent::start("ebpf", config).unwrap();
    let mut holder = Holder::start(&agent.socket);
    // 100 tickets over two keyspaces, 100 kB of write bytes each (10 MB),
    // every one counted in flight.
    for i in 0..100 {
        let r = holder.say(&format!("acquire {} 100000 100", 40 + i % 2));
        assert_eq!(r["ok"], true, "{r}");
    }
    // And a ticket of keyspace 42 come and gone: its refund stays with the
    // holder's thread, spare.
    assert_eq!(holder.say("pass 42 500")["passed"], true);
    let before = agent.status().unwrap();
    let spare =
        before.keyspaces.iter().find(|k| k.keyspace_id == 42).and_then(|k| k.bucket.as_ref()).map(|b| b.inflight_us);
    assert_eq!(spare, Some(500), "{:?}", before.keyspaces);
    let held: Vec<_> = before.keyspaces.iter().filter(|k| k.keyspace_id == 40 || k.keyspace_id == 41).collect();
    assert_eq!(held.iter().map(|k| k.inflight_requests).sum::<u64>(), 100, "{held:?}");
    assert_eq!(held.iter().map(|k| k.pending_write_bytes).sum::<u64>(), 10_000_000);
    assert_eq!(held.iter().map(|k| k.bucket.as_ref().unwrap().inflight_us).sum::<u64>(), 10_000);
    assert_eq!(before.admission.global_pending_write_bytes, 10_000_000);
    // kill -9.
    let killed = Instant::now();
    holder.kill9();
    let mut returned = None;
    while killed.elapsed() < Duration::from_secs(1) {
        let s = agent.status().unwrap();
        let ks: Vec<_> = s.keyspaces.iter().filter(|k| (40..=42).contains(&k.keyspace_id)).collect();
        if s.admission.reclaimed == 100
            && ks.iter().all(|k| k.inflight_requests == 0 && k.pending_write_bytes == 0)
            && ks.iter().all(|k| {
                // Full again; or, once a refill ran with nothing in flight,
                // the one interval an idle tenant-cap bucket keeps.
                k.bucket.as_ref().is_some_and(|b| {
                    b.inflight_us == 0
                        && (b.available_us == b.capacity_us as i64 || b.available_us == b.refill_us as i64)
                })
            })
            && s.admission.global_pending_write_bytes == 0
        {
            returned = Some(killed.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let returned = returned.unwrap_or_else(|| panic!("not all returned within 1 s: {:#?}", agent.status().unwrap()));
    eprintln!("100 tickets, 10 MB and 100 in-flight requests returned {returned:?} after kill -9");
}

/// The sleepers counted on keyspace `ks`'s bucket, as `status` shows them.
fn sleepers(agent: &Agent, ks: u32) -> Option<u32> {
    let s = agent.status().unwrap();
    s.keyspaces.iter().find(|k| k.keyspace_id == ks).and_then(|k| k.bucket.as_ref()).map(|b| b.sleepers)
}

#[test]
fn a_client_killed_asleep_in_line_leaves_no_sleeper_behind() {
    let _s = serial();
    // A tenant refilled at a few ms of CPU a second: a line of tens of ms waits
    // for seconds.
    let config = bare_cap_config(0.001) + "[admission-control]\nmode = \"monitor\"\n";
    let agent = Agent::start("ebpf", &config).unwrap();
    let (mut dying, mut living) = (Holder::start(&agent.socket), Holder::start(&agent.socket));
    let until = |what: &str, want: u32| {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            if sleepers(&agent, 60) == Some(want) {
                return t.elapsed();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("{what}: {want} sleepers expected, status says {:?}", sleepers(&agent, 60));
    };
    // Twenty futures in line (one waiter thread asleep for them all), then
    // three blocked threads behind them, then the living client's one.
    assert_eq!(dying.say("queue 60 1000 0 20")["queued"], true);
    until("the dying client's waiter thread", 1);
    assert_eq!(dying.say("queue 60 1000 3 0")["queued"], true);
    until("and its three blocked threads", 4);
    assert_eq!(living.say("queue 60 1000 1 0")["queued"], true);
    until("and the living client's thread", 5);
    dying.kill9();
    let back = until("only the living client's after kill -9", 1);
    eprintln!("a dead client's 4 sleepers taken back {back:?} after kill -9");
    // The count stays the living thread's for as long as it waits.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(sleepers(&agent, 60), Some(1));
}

#[test]
fn a_client_scribbling_on_the_regions_does_not_stop_the_agent_or_the_others() {
    let _s = serial();
    let agent = Agent::start("ebpf", &capped()).unwrap();
    let vandal = Command::new(governor_tests::workload_bin())
        .args(["corrupt", "--seconds", "10", "--socket"])
        .arg(&agent.socket)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // A legitimate client tags, measures and takes tickets meanwhile.
    let c = Client::connect(&agent.socket).unwrap();
    let c2 = c.clone();
    let legit = std::thread::spawn(move || {
        c2.register_current_thread().unwrap();
        let mut slowest = Stretch::default();
        let end = Instant::now() + Duration::from_secs(10);
        let mut ops = 0u64;
        while Instant::now() < end {
            let t0 = Stretch::start();
            {
                let _g = client::tag(77).unwrap();
                let _ = client::thread_cpu_ns();
            }
            let r = c2.acquire(78, Demand::new().estimate_us(10).timeout(Duration::from_millis(5)));
            drop(r);
            slowest = slowest.max(t0.end());
            ops += 1;
        }
        (slowest, ops)
    });
    let mut worst_status = Duration::ZERO;
    let end = Instant::now() + Duration::from_secs(10);
    while Instant::now() < end {
        let t0 = Instant::now();
        let s = agent.status().expect("the agent answers");
        worst_status = worst_status.max(t0.elapsed());
        for k in &s.keyspaces {
            // Physical bounds: no keyspace ran more than every core the whole time.
            assert!(k.cpu_seconds <= s.logical_cores as f64 * s.uptime_seconds + 1.0, "{k:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let (slowest, ops) = legit.join().unwrap();
    let out = vandal.wait_with_output().unwrap();
    eprintln!(
        "vandal: {}; legitimate client: {ops} tag+acquire rounds, slowest {slowest}; slowest status {worst_status:?}",
        String::from_utf8_lossy(&out.stdout).trim()
    );
    assert!(out.status.success());
    assert!(worst_status < Duration::from_secs(1), "status took {worst_status:?}");
    // Its deadline is 5 ms; nothing it does may hang on what the vandal
    // wrote. (Counted in the thread's own time: not the time it was
    // runnable with no CPU free, which a busy machine decides.)
    assert!(slowest.held() < Duration::from_millis(50), "a legitimate operation took {slowest}");
    assert!(agent.status().is_ok(), "the agent died: {}", agent.log_text());
    assert!(!agent.log_text().contains("panicked"), "{}", agent.log_text());
}

/// The shared regions mapped into this process, by name (`/proc/self/maps`):
/// the agent's memfds (`memfd:governor-…`) and BPF maps.
fn governor_mappings() -> std::collections::BTreeMap<String, usize> {
    let mut by_name = std::collections::BTreeMap::new();
    for line in std::fs::read_to_string("/proc/self/maps").unwrap().lines() {
        if let Some(name) = line.split_whitespace().nth(5)
            && (name.starts_with("/memfd:governor") || name.starts_with("anon_inode:bpf-map"))
        {
            *by_name.entry(name.to_string()).or_insert(0) += 1;
        }
    }
    by_name
}

#[test]
fn a_server_that_outlives_many_agents_keeps_one_set_of_regions() {
    let _s = serial();
    let mut agent = Agent::start("ebpf", &bare_cap_config(0.4)).unwrap();
    let c = Client::connect(&agent.socket).unwrap();
    c.register_current_thread().unwrap();
    drop(c.acquire(5, Demand::new()).unwrap());
    // A ticket admitted by the first agent and given back after its regions are.
    let held = c.acquire(5, Demand::new()).unwrap();
    for round in 2..=6 {
        if round % 2 == 0 {
            agent.kill9().unwrap();
        }
        agent.restart().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while c.attachments() < round && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(c.attachments(), round, "the client did not re-attach");
        drop(c.acquire(5, Demand::new()).unwrap());
    }
    // Given back 2 s after each agent went away (so are those of the
    // clients of tests before, whose agents went): one agent's regions, its
    // header, buckets, parameters and this client's ledger (memfds) and the
    // three measurement maps.
    std::thread::sleep(Duration::from_millis(2500));
    let after = governor_mappings();
    eprintln!("mapped after 6 agents: {after:?}");
    let one: std::collections::BTreeMap<String, usize> =
        ["/memfd:governor-buckets", "/memfd:governor-header", "/memfd:governor-ledger", "/memfd:governor-params"]
            .into_iter()
            .map(|n| (n.to_string(), 1))
            .chain([("anon_inode:bpf-map".to_string(), 3)])
            .collect();
    assert_eq!(after, one, "a gone agent's regions are still mapped");
    drop(held);
    // Still governed by the last agent.
    let t = c.acquire(5, Demand::new()).unwrap();
    drop(t);
    let status = agent.status().unwrap();
    assert!(status.keyspaces.iter().any(|k| k.keyspace_id == 5 && k.granted >= 1), "{:?}", status.keyspaces);
}
