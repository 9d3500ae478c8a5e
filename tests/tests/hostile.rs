//! The agent under attack by an ordinary local account. Each test runs a
//! hostile `workload attack …` (or `workload corrupt`) as uid 65534 with no
//! capabilities against a real agent on the eBPF backend, then checks that
//! the agent and the legitimate clients beside it come through: region
//! descriptors that cannot be resized (nor written, where clients may only
//! read), another client's thread slot overwritten, every slot and cell
//! hoarded, a thousand idle connections, a request line that never ends,
//! pipelined registrations of foreign threads, random writes into every
//! writable region, and `governor status | head -1`.
//!
//! After every attack the agent must still run, answer status within 1 s,
//! and serve a new legitimate client (register, tag, ticket) within 1 s.

use governor_tests::{Agent, Stretch, essential_config, governor_bin, schedstat_ns, steal_tick_ns, workload_bin};
use keyspace_governor::client::{self, Client, Demand};
use keyspace_governor::proto::{Reply, Request, StatusReport};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Every test owns the node's scheduler tracepoint and CPU: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const NOBODY: u64 = 65534;
const SECOND: Duration = Duration::from_secs(1);

/// 256 thread slots and 256 keyspace cells: small enough to exhaust.
/// The attacks come from a connected client: the socket is open to every
/// local account, every peer holds the client role.
const OPEN: &str = "[agent.access]\nsocket-mode = \"0666\"\n";
const SMALL: &str = "[agent]\nmax-threads = 256\nmax-keyspaces = 256\n[agent.access]\nsocket-mode = \"0666\"\n";

fn cores() -> f64 {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as f64
}

/// The workload binary as uid and gid 65534, no groups, no capabilities:
/// what any local account can run. The agent's socket is mode 0666 in the
/// harness's world-accessible scratch directory, so it can connect.
fn as_nobody(socket: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"])
        .arg(workload_bin())
        .args(args)
        .arg("--socket")
        .arg(socket);
    cmd
}

/// Waits for `child` at most `limit` (killing it then); its status, stdout
/// and stderr.
fn finish(mut child: Child, limit: Duration) -> (ExitStatus, String, String) {
    let end = Instant::now() + limit;
    while child.try_wait().expect("waiting for a child").is_none() {
        if Instant::now() > end {
            let _ = child.kill();
            let out = child.wait_with_output().expect("reaping a killed child");
            panic!(
                "{limit:?} passed and the child still ran; killed it. stdout {:?} stderr {:?}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().expect("collecting a child's output");
    (out.status, String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The JSON report a workload prints last.
fn report(status: ExitStatus, stdout: &str, stderr: &str) -> Value {
    assert!(status.success(), "the attack itself failed ({status}): {stdout}{stderr}");
    let last = stdout.lines().last().unwrap_or_else(|| panic!("the attack printed nothing: {stderr}"));
    serde_json::from_str(last).unwrap_or_else(|e| panic!("attack report {last:?}: {e}"))
}

/// Runs an attack as nobody to completion (at most `limit`): its report.
fn attack(socket: &Path, args: &[&str], limit: Duration) -> Value {
    let child = as_nobody(socket, args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("setpriv runs");
    let (status, out, err) = finish(child, limit);
    let r = report(status, &out, &err);
    assert_eq!(r["uid"], NOBODY, "the attack did not run as nobody: {r}");
    r
}

/// An attack that holds what it took until its stdin closes.
struct Held {
    child: Child,
    stdin: Option<ChildStdin>,
    /// The rest of its stdout, once it ends.
    rest: mpsc::Receiver<String>,
    /// What it printed once it held everything.
    took: Value,
}

impl Held {
    fn start(socket: &Path, args: &[&str], limit: Duration) -> Held {
        let mut child = as_nobody(socket, args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("setpriv runs");
        let stdin = child.stdin.take();
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let (first_tx, first) = mpsc::channel();
        let (rest_tx, rest) = mpsc::channel();
        // Reads its stdout to the end, so it never writes into a closed pipe.
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = out.read_line(&mut line);
            let _ = first_tx.send(line);
            let mut rest = String::new();
            let _ = out.read_to_string(&mut rest);
            let _ = rest_tx.send(rest);
        });
        let line = first.recv_timeout(limit).unwrap_or_default();
        let took: Value = serde_json::from_str(&line).unwrap_or_else(|e| {
            let _ = child.kill();
            let mut err = String::new();
            let _ = child.stderr.take().map(|mut s| s.read_to_string(&mut err));
            panic!("the attack did not report within {limit:?} ({e}): {line:?} {err}")
        });
        assert_eq!(took["uid"], NOBODY, "the attack did not run as nobody: {took}");
        Held { child, stdin, rest, took }
    }

    /// Lets go (closes its stdin) and waits for it to exit: its last report.
    fn release(mut self) -> Value {
        drop(self.stdin.take());
        let (status, _, err) = finish(self.child, Duration::from_secs(30));
        let out = self.rest.recv_timeout(Duration::from_secs(5)).unwrap_or_default();
        let r = report(status, &out, &err);
        assert_eq!(r["uid"], NOBODY, "the attack did not run as nobody: {r}");
        r
    }
}

/// Whether process `pid` still runs (not gone, not a zombie awaiting reaping).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next()))
        .is_some_and(|state| !matches!(state, 'Z' | 'X'))
}

/// User + system CPU seconds process `pid` has used.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("agent stat");
    let rest = stat.rsplit_once(')').expect("stat format").1;
    // Fields after the command: state is field 3, utime 14, stime 15.
    let f: Vec<u64> = rest.split_whitespace().skip(11).take(2).map(|v| v.parse().expect("tick count")).collect();
    (f[0] + f[1]) as f64 * steal_tick_ns() as f64 / 1e9
}

/// Resident memory of process `pid`, KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("VmRSS:")?.trim().strip_suffix("kB")?.trim().parse().ok()))
        .unwrap_or(0)
}

/// The agent's status and how long it took to answer.
fn timed_status(agent: &Agent) -> (StatusReport, Duration) {
    let t0 = Instant::now();
    let s = agent.status().unwrap_or_else(|e| {
        panic!(
            "status failed after {:?}: {}; agent log:\n{}",
            t0.elapsed(),
            keyspace_governor::error_chain(e.as_ref()),
            tail(&agent.log_text())
        )
    });
    (s, t0.elapsed())
}

fn tail(log: &str) -> &str {
    let mut at = log.len().saturating_sub(4000);
    while !log.is_char_boundary(at) {
        at += 1;
    }
    &log[at..]
}

/// Spins until the calling thread ran `d` more CPU.
fn burn(d: Duration) {
    let end = keyspace_governor::sys::thread_cputime_ns() + d.as_nanos() as u64;
    while keyspace_governor::sys::thread_cputime_ns() < end {
        std::hint::spin_loop();
    }
}

/// What a legitimate client does, on a thread of its own so that a hang is
/// reported instead of hanging the test: registers the thread, tags it
/// with `keyspace` for 1 ms of work, takes a ticket (5 ms deadline). With
/// `client`, on that existing connection, else on a new one. How long it
/// took, or what failed.
fn legitimate_round_trip(socket: &Path, client: Option<Client>, keyspace: u32) -> Result<Duration, String> {
    let socket = socket.to_path_buf();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let t0 = Instant::now();
        let r = (|| {
            let chain = |what: &str, e: &(dyn std::error::Error + 'static)| {
                format!("{what}: {}", keyspace_governor::error_chain(e))
            };
            let c = match client {
                Some(c) => c,
                None => Client::connect(&socket).map_err(|e| chain("connect", &e))?,
            };
            c.register_current_thread().map_err(|e| chain("register-thread", &e))?;
            {
                let _g = client::tag(keyspace).map_err(|e| chain(&format!("tag {keyspace}"), &e))?;
                burn(Duration::from_millis(1));
            }
            drop(c.acquire(keyspace, Demand::new().estimate_us(10).timeout(Duration::from_millis(5))));
            client::unregister_current_thread();
            Ok::<_, String>(())
        })();
        let _ = tx.send(r.map(|()| t0.elapsed()));
    });
    rx.recv_timeout(Duration::from_secs(10)).unwrap_or_else(|_| Err("no answer within 10 s: hung".into()))
}

/// After an attack: the agent still runs, answers status within 1 s, never
/// panicked, and a new legitimate client gets through within 1 s.
fn assert_survived(agent: &Agent, what: &str) {
    assert!(running(agent.pid()), "the agent is gone after {what}; its log:\n{}", tail(&agent.log_text()));
    let (_, took) = timed_status(agent);
    let legit = legitimate_round_trip(&agent.socket, None, 4242);
    let log = agent.log_text();
    eprintln!("after {what}: status answered in {took:?}; a new client's round trip: {legit:?}");
    assert!(took < SECOND, "after {what}, status took {took:?}");
    match legit {
        Ok(t) => assert!(t < SECOND, "after {what}, a new client's register + tag + ticket took {t:?}"),
        Err(e) => panic!("after {what}, a new legitimate client failed: {e}"),
    }
    assert!(!log.contains("panicked"), "the agent panicked during {what}:\n{}", tail(&log));
}

/// A registered thread of this (legitimate) process, tagged with one
/// keyspace for its whole life. It burns CPU on command and blocks in
/// between, so whenever it is idle the kernel has charged all it ran.
struct Victim {
    tid: u32,
    go: mpsc::Sender<Option<Duration>>,
    done: mpsc::Receiver<()>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Victim {
    fn start(c: &Client, keyspace: u32) -> Victim {
        let (go, orders) = mpsc::channel::<Option<Duration>>();
        let (finished, done) = mpsc::channel();
        let (tid_tx, tid_rx) = mpsc::channel();
        let c = c.clone();
        let thread = std::thread::spawn(move || {
            c.register_current_thread().expect("the victim registers");
            let _g = client::tag(keyspace).expect("the victim tags");
            tid_tx.send(keyspace_governor::sys::gettid()).expect("test alive");
            while let Ok(Some(d)) = orders.recv() {
                burn(d);
                let _ = finished.send(());
            }
        });
        let tid = tid_rx.recv_timeout(Duration::from_secs(10)).expect("the victim started");
        Victim { tid, go, done, thread: Some(thread) }
    }

    /// Starts burning `d` of CPU; [`Victim::wait`] returns once it is done.
    fn burn(&self, d: Duration) {
        self.go.send(Some(d)).expect("victim alive");
    }

    fn wait(&self, limit: Duration) {
        self.done.recv_timeout(limit).unwrap_or_else(|_| panic!("the victim did not finish its work within {limit:?}"));
    }

    /// (the keyspace's charged seconds, the thread's kernel CPU seconds),
    /// read while it is idle.
    fn books(&self, agent: &Agent, keyspace: u32) -> (f64, f64) {
        let charged = agent.keyspace_seconds(keyspace).expect("status");
        let ran = schedstat_ns(std::process::id(), self.tid).expect("victim schedstat") as f64 / 1e9;
        (charged, ran)
    }
}

impl Drop for Victim {
    fn drop(&mut self) {
        let _ = self.go.send(None);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn region_descriptors_cannot_be_resized_nor_written_where_read_only() {
    let _s = serial();
    let agent = Agent::start("ebpf", SMALL).unwrap();
    let legit = Client::connect(&agent.socket).unwrap();
    let r = attack(&agent.socket, &["attack", "fds"], Duration::from_secs(30));
    // Every resize fails and leaves the length as it was; the read-only
    // regions map read-only (as a client does) and cannot be written by any
    // means. Which errno depends on the kind of descriptor (sealed memfd:
    // EPERM; BPF map: EINVAL / ENODEV / ESPIPE).
    let mut wrong = Vec::new();
    for region in r["regions"].as_array().expect("regions") {
        let name = region["region"].as_str().unwrap_or("?");
        eprintln!("{name:>10} ({} bytes, after {}): {}", region["len"], region["len_after"], region["ops"]);
        for (op, result) in region["ops"].as_object().expect("ops") {
            let must_work = op == "mmap-read";
            if (result == "ok") != must_work {
                wrong.push(format!("{name}: {op} → {result}"));
            }
        }
        if region["len_after"] != region["len"] {
            wrong.push(format!("{name}: length {} → {}", region["len"], region["len_after"]));
        }
    }
    // The client attached before the attack still works, and so does the agent.
    let before = legitimate_round_trip(&agent.socket, Some(legit), 31);
    eprintln!("the client attached before the attack: {before:?}");
    assert!(wrong.is_empty(), "a client could resize or write a region it must not: {wrong:#?}");
    assert!(before.as_ref().is_ok_and(|t| *t < SECOND), "the client attached before the attack: {before:?}");
    assert_survived(&agent, "resizing and writing the region descriptors");
}

/// A nobody process overwrites the victim's live slot (`write`: `dead` or
/// `tid`) while it works; the agent must keep it registered and charged.
fn overwritten_slot_keeps_its_thread_measured(write: &str) {
    let agent = Agent::start("ebpf", SMALL).unwrap();
    let c = Client::connect(&agent.socket).unwrap();
    const KS: u32 = 61;
    let victim = Victim::start(&c, KS);
    victim.burn(Duration::from_millis(300));
    victim.wait(Duration::from_secs(10));
    let registered = agent.status().unwrap().threads.registered;
    let (charged0, ran0) = victim.books(&agent, KS);
    // 3 s of work; the slot is overwritten 0.3 s in.
    victim.burn(Duration::from_secs(3));
    std::thread::sleep(Duration::from_millis(300));
    let tid = victim.tid.to_string();
    let r = attack(&agent.socket, &["attack", "slot", "--tid", &tid, "--write", write], Duration::from_secs(30));
    let attacked = Instant::now();
    eprintln!("overwrote the victim's slot: {r}");
    // Still registered at every look in the next second.
    let mut looks = Vec::new();
    while attacked.elapsed() < Duration::from_millis(1100) {
        looks.push(agent.status().unwrap().threads.registered);
        std::thread::sleep(Duration::from_millis(100));
    }
    victim.wait(Duration::from_secs(20));
    let (charged1, ran1) = victim.books(&agent, KS);
    let (charged, ran) = (charged1 - charged0, ran1 - ran0);
    let err = (charged - ran) / ran;
    eprintln!(
        "registered before {registered}, in the second after: {looks:?}; over the work: keyspace {KS} charged \
         {charged:.4} s for {ran:.4} s the thread ran ({:+.2} %)",
        err * 100.0
    );
    let repaired = agent.status().unwrap().threads;
    eprintln!("threads after: {repaired:?}");
    assert!(
        looks.iter().all(|&n| n == registered),
        "registered went {registered} → {looks:?} after the slot was overwritten"
    );
    assert!(
        err.abs() <= 0.02,
        "keyspace {KS} charged {charged:.4} s for {ran:.4} s of the victim's CPU ({:+.2} %)",
        err * 100.0
    );
    drop(victim);
    assert_survived(&agent, &format!("overwriting another client's slot ({write})"));
}

#[test]
fn another_clients_slot_marked_dead_stays_registered_and_charged() {
    let _s = serial();
    overwritten_slot_keeps_its_thread_measured("dead");
}

#[test]
fn another_clients_slot_given_a_wrong_tid_stays_registered_and_charged() {
    let _s = serial();
    overwritten_slot_keeps_its_thread_measured("tid");
}

#[test]
fn a_hoarder_of_slots_and_cells_leaves_room_for_others() {
    let _s = serial();
    let agent = Agent::start("ebpf", SMALL).unwrap();
    let c = Client::connect(&agent.socket).unwrap();
    // More threads than slots, more keyspaces than cells.
    let hoarder = Held::start(
        &agent.socket,
        &["attack", "exhaust", "--threads", "272", "--keyspaces", "320", "--base", "100000"],
        Duration::from_secs(60),
    );
    let s = agent.status().unwrap();
    eprintln!(
        "the hoarder took {}; threads {:?}, cells {} / {}",
        hoarder.took, s.threads, s.admission.cells_in_use, s.admission.cells
    );
    // Root's server registers a thread and tags a keyspace nobody used yet.
    let legit = legitimate_round_trip(&agent.socket, Some(c), 7);
    let fresh = legitimate_round_trip(&agent.socket, None, 8);
    eprintln!("legitimate client while hoarded: attached before {legit:?}, new {fresh:?}");
    let r = hoarder.release();
    eprintln!("hoarder: {r}");
    for (who, got) in [("the client attached before", legit), ("a new client", fresh)] {
        match got {
            Ok(t) => assert!(t < SECOND, "{who} took {t:?} to register and tag while hoarded"),
            Err(e) => panic!("{who} could not register a thread and tag a new keyspace while nobody hoarded {r}: {e}"),
        }
    }
    assert_survived(&agent, "hoarding slots and cells");
}

#[test]
fn a_thousand_idle_connections_cost_the_agent_nothing() {
    let _s = serial();
    let agent = Agent::start("ebpf", SMALL).unwrap();
    let c = Client::connect(&agent.socket).unwrap();
    let pid = agent.pid();
    let log_before = agent.log_text().len();
    let idler = Held::start(&agent.socket, &["attack", "idle", "--connections", "1100"], Duration::from_secs(60));
    eprintln!("idle connections: {}", idler.took);
    assert_eq!(idler.took["connected"], 1100, "{}", idler.took);
    std::thread::sleep(Duration::from_millis(500));
    let (cpu0, t0) = (cpu_seconds(pid), Instant::now());
    let mut slowest = Duration::ZERO;
    while t0.elapsed() < Duration::from_secs(3) {
        slowest = slowest.max(timed_status(&agent).1);
        std::thread::sleep(Duration::from_millis(250));
    }
    let cpu = (cpu_seconds(pid) - cpu0) / t0.elapsed().as_secs_f64();
    let legit = legitimate_round_trip(&agent.socket, Some(c), 9);
    idler.release();
    std::thread::sleep(Duration::from_millis(300));
    let grown = agent.log_text().len() - log_before;
    eprintln!(
        "with 1100 idle connections: agent CPU {:.2} % of a core over 3 s, slowest status {slowest:?}, \
         legitimate round trip {legit:?}; log grew {grown} bytes",
        cpu * 100.0
    );
    assert!(slowest < SECOND, "status took {slowest:?} with 1100 idle connections");
    assert!(cpu < 0.10, "the agent used {:.2} % of a core on idle connections", cpu * 100.0);
    assert!(grown < 1_000_000, "the agent's log grew {grown} bytes");
    assert!(legit.as_ref().is_ok_and(|t| *t < SECOND), "a legitimate client among the idle connections: {legit:?}");
    assert_survived(&agent, "1100 idle connections");
}

#[test]
fn a_request_line_that_never_ends_is_cut_off() {
    let _s = serial();
    let agent = Agent::start("ebpf", SMALL).unwrap();
    let pid = agent.pid();
    let rss_before = rss_kib(pid);
    let mut child = as_nobody(&agent.socket, &["attack", "long-line", "--mib", "100"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("setpriv runs");
    let (mut peak, mut slowest) = (rss_before, Duration::ZERO);
    let (t0, mut last_status) = (Instant::now(), None::<Instant>);
    while child.try_wait().unwrap().is_none() && t0.elapsed() < Duration::from_secs(60) {
        peak = peak.max(rss_kib(pid));
        if last_status.is_none_or(|t| t.elapsed() >= Duration::from_millis(100)) {
            slowest = slowest.max(timed_status(&agent).1);
            last_status = Some(Instant::now());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let (status, out, err) = finish(child, Duration::from_secs(5));
    let r = report(status, &out, &err);
    peak = peak.max(rss_kib(pid));
    slowest = slowest.max(timed_status(&agent).1);
    eprintln!("endless line: {r}; agent RSS {rss_before} KiB before, peak {peak} KiB; slowest status {slowest:?}");
    assert_eq!(r["uid"], NOBODY);
    let written = r["written"].as_u64().unwrap_or(u64::MAX);
    assert!(r["closed"] == true && written < 100 << 20, "the agent did not close the connection: {r}");
    assert!(peak < 64 << 10, "agent RSS reached {peak} KiB (from {rss_before} KiB)");
    assert!(slowest < SECOND, "status took {slowest:?} during the endless line");
    assert_survived(&agent, "a 100 MiB request line");
}

#[test]
fn pipelined_registrations_of_foreign_threads_do_not_hold_up_status() {
    let _s = serial();
    let agent = Agent::start("ebpf", SMALL).unwrap();
    let c = Client::connect(&agent.socket).unwrap();
    let victim = Victim::start(&c, 62);
    let registered = agent.status().unwrap().threads.registered;
    // init, the agent, this process, a registered thread of it, tid 0, tids
    // beyond pid_max: none is the attacker's. Its 2000 idle threads make each
    // refusal look through 2000 tasks.
    let tids =
        [1, agent.pid(), std::process::id(), victim.tid, 0, 4_194_305, u32::MAX].map(|t| t.to_string()).join(",");
    let child =
        as_nobody(&agent.socket, &["attack", "pipeline", "--count", "50", "--tids", &tids, "--threads", "2000"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("setpriv runs");
    let (t0, mut slowest, mut looks) = (Instant::now(), Duration::ZERO, 0);
    let watcher = std::thread::spawn(move || finish(child, Duration::from_secs(120)));
    while !watcher.is_finished() {
        slowest = slowest.max(timed_status(&agent).1);
        looks += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, out, err) = watcher.join().expect("watcher");
    let r = report(status, &out, &err);
    let after = agent.status().unwrap().threads;
    eprintln!(
        "pipelined: {r}; {looks} status calls over {:?}, slowest {slowest:?}; threads after {after:?}",
        t0.elapsed()
    );
    assert_eq!(r["uid"], NOBODY);
    assert_eq!((r["registered"].as_u64(), r["refused"].as_u64()), (Some(0), Some(50)), "{r}");
    assert!(slowest < SECOND, "status took {slowest:?} while 50 foreign registrations were pending");
    assert_eq!(after.registered, registered, "{after:?}");
    drop(victim);
    assert_survived(&agent, "50 pipelined registrations of foreign threads");
}

#[test]
fn random_writes_into_every_writable_region_bound_the_damage() {
    let _s = serial();
    let started = Instant::now();
    // A tenant cap of 0.1 core: the legitimate tickets wait in line.
    let agent = Agent::start("ebpf", &format!("{}{OPEN}", essential_config(0.1 / cores()))).unwrap();
    let pid = agent.pid();
    let c = Client::connect(&agent.socket).unwrap();
    let vandal = as_nobody(&agent.socket, &["corrupt", "--seconds", "10"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("setpriv runs");
    // A legitimate worker tags and measures, and takes tickets with a 5 ms
    // deadline: its slowest tag switch and slowest ticket, rounds, tag errors.
    let worker = {
        let c = c.clone();
        std::thread::spawn(move || {
            c.register_current_thread().expect("the worker registers");
            let (mut tag_worst, mut ticket_worst) = (Stretch::default(), Stretch::default());
            let (mut rounds, mut tag_errors) = (0u64, Vec::new());
            let end = Instant::now() + Duration::from_secs(10);
            while Instant::now() < end {
                let t0 = Stretch::start();
                match client::tag(77) {
                    Ok(g) => {
                        let _ = client::thread_cpu_ns();
                        drop(g);
                    }
                    Err(e) if tag_errors.len() < 5 => tag_errors.push(e.to_string()),
                    Err(_) => {}
                }
                tag_worst = tag_worst.max(t0.end());
                let t0 = Stretch::start();
                if let Ok(mut t) = c.acquire(78, Demand::new().estimate_us(200).timeout(Duration::from_millis(5))) {
                    let _g = t.enter();
                    burn(Duration::from_micros(100));
                }
                ticket_worst = ticket_worst.max(t0.end());
                rounds += 1;
            }
            (tag_worst, ticket_worst, rounds, tag_errors)
        })
    };
    let (mut worst_status, mut worst_share, mut looks) = (Duration::ZERO, 0f64, 0);
    let end = Instant::now() + Duration::from_secs(10);
    while Instant::now() < end {
        assert!(running(pid), "the agent died under random writes; its log:\n{}", tail(&agent.log_text()));
        let (s, took) = timed_status(&agent);
        worst_status = worst_status.max(took);
        looks += 1;
        // No keyspace ran more than every core the whole time.
        let bound = cores() * started.elapsed().as_secs_f64();
        for k in &s.keyspaces {
            worst_share = worst_share.max(k.cpu_seconds / bound);
            assert!(
                k.cpu_seconds.is_finite() && k.cpu_seconds >= 0.0 && k.cpu_seconds <= bound,
                "keyspace {} charged {} s, more than {bound:.2} s ({} cores × {:.2} s)",
                k.keyspace_id,
                k.cpu_seconds,
                cores(),
                started.elapsed().as_secs_f64()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let (tag_worst, ticket_worst, rounds, tag_errors) = worker.join().expect("the worker did not panic");
    let (status, out, err) = finish(vandal, Duration::from_secs(30));
    eprintln!(
        "vandal ({status}): {} {}; legitimate worker: {rounds} rounds, slowest tag switch {tag_worst}, slowest \
         ticket {ticket_worst}, tag errors {tag_errors:?}; {looks} status calls, slowest {worst_status:?}; largest \
         keyspace share of cores × elapsed {worst_share:.4}",
        out.trim(),
        err.trim(),
    );
    assert!(status.success(), "the vandal failed: {err}");
    assert!(worst_status < SECOND, "status took {worst_status:?}");
    // A stall on a word the vandal wrote would last a waiter's liveness
    // check (100 ms) or a socket timeout (5 s); a wakeup the host delays by
    // stealing the vCPU (it shows as time asleep) takes milliseconds.
    assert!(tag_worst.held() < Duration::from_millis(50), "a tag switch took {tag_worst}");
    assert!(ticket_worst.held() < Duration::from_millis(50), "a ticket with a 5 ms deadline took {ticket_worst}");
    assert_survived(&agent, "10 s of random writes into every writable region");
}

#[test]
fn status_into_a_pipe_closed_after_one_line_exits_quietly() {
    let _s = serial();
    let agent = Agent::start("ebpf", "[agent]\nmax-keyspaces = 4096\n").unwrap();
    let c = Client::connect(&agent.socket).unwrap();
    // 2000 keyspaces: the table is larger than a pipe holds, so the CLI is
    // still writing when the reader goes.
    for id in 1..=2000 {
        match c.call(&Request::Keyspace { id }) {
            Ok(Reply::Keyspace { .. }) => {}
            other => panic!("keyspace {id}: {other:?}"),
        }
    }
    let full = Command::new(governor_bin()).args(["status", "--socket"]).arg(&agent.socket).output().unwrap();
    assert!(full.status.success() && full.stdout.len() > 128 << 10, "the full status is {} bytes", full.stdout.len());
    for json in [false, true] {
        // `governor status --socket S | head -1`
        let mut cmd = Command::new(governor_bin());
        cmd.args(["status", "--socket"]).arg(&agent.socket);
        if json {
            cmd.arg("--json");
        }
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let mut head = BufReader::new(child.stdout.take().unwrap());
        let mut first = String::new();
        head.read_line(&mut first).unwrap();
        drop(head);
        let (status, _, stderr) = finish(child, Duration::from_secs(10));
        let sigpipe = status.signal() == Some(libc::SIGPIPE);
        eprintln!("status{} | head -1: {first:?}; exit {status}; stderr {stderr:?}", if json { " --json" } else { "" });
        assert!(
            !stderr.contains("panicked") && (status.success() || sigpipe),
            "`governor status{} | head -1` ended with {status}: {stderr}",
            if json { " --json" } else { "" }
        );
    }
    assert_survived(&agent, "status readers that hang up");
}
