//! End-to-end measurement: the real agent (real eBPF on this kernel, or the
//! thread-clock fallback) and real client processes.

use governor_tests::{Agent, eventually, run_workload, schedstat_ns, spawn_workload_started};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The tests load programs on every context switch and count CPU time:
/// run them one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const CONFIG: &str = "[agent]\nmax-threads = 256\n";

fn cores() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// Runs the exactly-once workload; returns (total error %, worst share
/// difference in share points, steal during the run as % of the threads'
/// CPU time).
fn exactly_once(measure: &str, switches: u64) -> (f64, f64, f64) {
    let agent = Agent::start(measure, CONFIG).expect("agent starts");
    let steal_before = governor_tests::steal_ns();
    let threads = (3 * cores()).to_string();
    let out = run_workload(
        &agent.socket,
        &[
            "exactly-once",
            "--threads",
            &threads,
            "--keyspaces",
            "8",
            "--switches",
            &switches.to_string(),
            "--base",
            "1000",
        ],
    )
    .expect("workload runs");
    assert_eq!(out["backend"], measure);
    assert_eq!(out["switches"].as_u64().unwrap(), switches * 3 * cores() as u64);
    let truth = out["thread_cpu_ns"].as_u64().unwrap() as f64;
    let own: BTreeMap<u32, f64> = out["self_measured_ns"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.parse().unwrap(), v.as_u64().unwrap() as f64))
        .collect();
    assert_eq!(own.len(), 8);
    let steal = (governor_tests::steal_ns() - steal_before) as f64;
    let status = agent.status().unwrap();
    let charged: BTreeMap<u32, f64> = status.keyspaces.iter().map(|k| (k.keyspace_id, k.cpu_seconds * 1e9)).collect();
    assert_eq!(charged.keys().collect::<Vec<_>>(), own.keys().collect::<Vec<_>>());
    let charged_total: f64 = charged.values().sum();
    let own_total: f64 = own.values().sum();
    // Signed: positive is over-charging.
    let err_pct = (charged_total - truth) / truth * 100.0;
    let worst_share_pp =
        own.iter().map(|(k, v)| ((v / own_total) - (charged[k] / charged_total)).abs() * 100.0).fold(0.0, f64::max);
    let steal_pct = steal / truth * 100.0;
    eprintln!(
        "{measure}: charged {:.4} s vs thread clocks {:.4} s: error {err_pct:.3} %, worst share diff \
         {worst_share_pp:.3} pp, steal {steal_pct:.3} %",
        charged_total / 1e9,
        truth / 1e9
    );
    (err_pct, worst_share_pp, steal_pct)
}

#[test]
fn ebpf_charges_every_nanosecond_exactly_once() {
    let _s = serial();
    // 300 000 switches a thread among 8 keyspaces, 3 threads per core.
    let (err, share, steal) = exactly_once("ebpf", 300_000);
    // Both sides count on the kernel's runtime, which leaves the
    // hypervisor's steal out: no allowance for it (it is printed above).
    assert!((-0.5..=0.5).contains(&err), "attribution error {err:+.3} % outside ±0.5 % (steal {steal:.3} %)");
    assert!(share <= 1.0, "a keyspace's share is off by {share:.3} share points");
}

#[test]
fn thread_clock_fallback_charges_exactly_once() {
    let _s = serial();
    let (err, share, _steal) = exactly_once("thread-clock", 100_000);
    assert!((-0.5..=0.5).contains(&err), "attribution error {err:+.3} % outside ±0.5 %");
    assert!(share <= 1.0, "a keyspace's share is off by {share:.3} share points");
}

#[test]
fn long_slice_is_charged_while_it_runs() {
    let _s = serial();
    let agent = Agent::start("ebpf", CONFIG).unwrap();
    let steal = governor_tests::Steal::start();
    let (mut child, mut out) =
        spawn_workload_started(&agent.socket, &["busy", "--keyspace", "77", "--seconds", "2"]).unwrap();
    // The busy thread is the process's main thread, tagged from a little
    // before `started`. Once it has run half a second by the kernel's count:
    let pid = child.id();
    let started = schedstat_ns(pid, pid).unwrap();
    let ran_since = || schedstat_ns(pid, pid).map_or(0, |s| s - started);
    eventually("the busy thread ran 0.5 s", || ran_since() >= 500_000_000);
    let (before, charged, after) = (ran_since(), agent.keyspace_seconds(77).unwrap(), schedstat_ns(pid, pid).unwrap());
    let mut last = String::new();
    std::io::BufRead::read_line(&mut out, &mut last).unwrap();
    assert!(child.wait().unwrap().success());
    eprintln!("charged {charged:.3} s while the busy thread had run {:.3} s since `started`", before as f64 / 1e9);
    // Charged while it runs: at most one timer period (10 ms) and a
    // scheduler tick (4 ms) behind the kernel's count, and never more than
    // all the thread ran.
    assert!(
        charged >= (before as f64 / 1e9) - 0.02 && charged <= after as f64 / 1e9,
        "{charged:.3} s charged after the thread ran {:.3} s since `started`, {:.3} s in all",
        before as f64 / 1e9,
        after as f64 / 1e9
    );
    // And the whole slice once it ends: what the thread's CPU clock says it
    // ran. (Its tag ends on the thread clock, which over one long slice
    // counts what the hypervisor stole in it: the bound widens by that.)
    let ran = serde_json::from_str::<serde_json::Value>(&last).unwrap()["thread_cpu_ns"].as_u64().unwrap() as f64 / 1e9;
    let total = agent.keyspace_seconds(77).unwrap();
    let steal = steal.share();
    eprintln!(
        "charged {total:.4} s in all for {ran:.4} s of thread CPU: {:+.3} % (steal {:.2} %)",
        (total / ran - 1.0) * 100.0,
        steal * 100.0
    );
    assert!(
        total >= ran * 0.997 && total <= ran * (1.003 + steal),
        "{total:.4} s charged for {ran:.4} s of work, steal {steal:.4}"
    );
}

#[test]
fn untagged_and_unregistered_time_is_charged_to_no_keyspace() {
    let _s = serial();
    let agent = Agent::start("ebpf", CONFIG).unwrap();
    let out = run_workload(&agent.socket, &["untagged", "--seconds", "1", "--keyspace", "7"]).unwrap();
    // On the agent's own timeline (the thread clock), so the hypervisor's
    // steal time does not blur the comparison.
    let tagged = out["tagged_thread_clock_ns"].as_u64().unwrap() as f64 / 1e9;
    let status = agent.status().unwrap();
    let total: f64 = status.keyspaces.iter().map(|k| k.cpu_seconds).sum();
    let seven = agent.keyspace_seconds(7).unwrap();
    eprintln!("tagged thread {tagged:.4} s; keyspace 7 charged {seven:.4} s; all keyspaces {total:.4} s");
    // The unregistered thread's "tag" must not even create keyspace 8.
    assert!(status.keyspaces.iter().all(|k| k.keyspace_id == 7), "{:?}", status.keyspaces);
    assert!((seven - tagged).abs() / tagged < 0.01, "keyspace 7: {seven} vs {tagged}");
    assert!((total - seven).abs() < 1e-9);
}

#[test]
fn ten_thousand_short_lived_threads_reuse_slots() {
    let _s = serial();
    let agent = Agent::start("ebpf", "[agent]\nmax-threads = 64\n").unwrap();
    let out =
        run_workload(&agent.socket, &["churn", "--threads", "10000", "--parallel", "4", "--keyspace", "5"]).unwrap();
    assert_eq!(out["failures"], 0, "{out}");
    assert_eq!(out["abrupt_exits"], 5000);
    let status = agent.status().unwrap();
    eprintln!("{:?}", status.threads);
    assert_eq!(status.threads.capacity, 64);
    assert!(status.threads.handed_out >= 10_000, "{:?}", status.threads);
    assert_eq!(status.threads.exhausted, 0);
    assert!(agent.keyspace_seconds(5).unwrap() > 0.0);
}

#[test]
fn ebpf_without_capabilities_fails_naming_them() {
    let _s = serial();
    let dir = governor_tests::Scratch::new("nocap");
    let socket = dir.0.join("g.sock");
    let out = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"])
        .arg(governor_tests::governor_bin())
        .args(["agent", "--measure", "ebpf", "--metrics-addr", "127.0.0.1:0", "--socket"])
        .arg(&socket)
        .output()
        .expect("setpriv runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(77), "agent without capabilities: {stderr}");
    assert!(stderr.contains("CAP_BPF") && stderr.contains("CAP_PERFMON"), "{stderr}");
}

#[test]
fn auto_without_capabilities_falls_back_and_says_so() {
    let _s = serial();
    let dir = governor_tests::Scratch::new("nocap-auto");
    let socket = dir.0.join("g.sock");
    let mut child = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"])
        .arg(governor_tests::governor_bin())
        .args(["agent", "--measure", "auto", "--metrics-addr", "127.0.0.1:0", "--socket"])
        .arg(&socket)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = keyspace_governor::cli::status::run(&socket);
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(status.expect("fallback agent answers").backend, keyspace_governor::proto::BackendKind::ThreadClock);
    assert!(stderr.contains("thread-clock") && stderr.contains("CAP_BPF"), "{stderr}");
}

#[test]
fn client_on_a_missing_socket_gets_a_typed_error_naming_the_path() {
    let path = std::path::Path::new("/tmp/governor-no-such-dir/agent.sock");
    match keyspace_governor::client::Client::connect(path) {
        Err(keyspace_governor::client::ClientError::Connect { path: p, .. }) => assert_eq!(p, path),
        Err(other) => panic!("wrong error: {other}"),
        Ok(_) => panic!("connected to nothing"),
    }
    let err = keyspace_governor::client::Client::connect(path).err().unwrap();
    assert!(err.to_string().contains("/tmp/governor-no-such-dir/agent.sock"), "{err}");
}

#[test]
fn a_client_in_its_own_pid_namespace_is_measured_under_its_host_tids() {
    let _s = serial();
    let agent = Agent::start("ebpf", CONFIG).unwrap();
    // The workload runs as pid 1 of a fresh PID namespace: the tids it sends
    // are not the kernel's.
    let out = std::process::Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc"])
        .arg(governor_tests::workload_bin())
        .args(["busy", "--keyspace", "55", "--seconds", "0.5", "--socket"])
        .arg(&agent.socket)
        .output()
        .expect("unshare runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let ran = serde_json::from_str::<serde_json::Value>(stdout.lines().last().unwrap()).unwrap()["thread_cpu_ns"]
        .as_u64()
        .unwrap() as f64
        / 1e9;
    let charged = agent.keyspace_seconds(55).unwrap();
    eprintln!("namespaced client: ran {ran:.4} s, charged {charged:.4} s");
    assert!(charged >= ran * 0.99 && charged <= ran * 1.02 + 0.005, "charged {charged} for {ran}");
}
