//! Rule measurement: what 1 000 installed rules add to a switch the rules
//! do not match, and how exactly a real unmodified program is charged by
//! rule against its threads' schedstat.

use super::switch::{median, per_run, pingpong};
use anyhow::{Context, Result};
use governor_tests::Agent;
use std::process::{Command, Stdio};
use std::time::Duration;

/// `n` rules that match no process here.
fn unmatched_rules(n: usize) -> String {
    (0..n)
        .map(|i| format!("[[rules]]\nname = \"r{i}\"\nkeyspace = {}\ncomm-prefix = \"nomatch{i}\"\n\n", 100_000 + i))
        .collect()
}

/// Per-run cost (raw, statistics' floor included) of the switch program
/// over switches between unregistered, unmatched processes, with no rules
/// and with 1 000; medians over `rounds` alternating rounds.
pub fn unmatched_switch_ns(rounds: usize) -> Result<(f64, f64)> {
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).context("enabling BPF run-time statistics")?;
    let one = |config: &str| -> Result<f64> {
        let agent = Agent::start("ebpf", config)?;
        let stats = || -> Result<Vec<(String, u64, u64)>> {
            Ok(agent.status()?.programs.into_iter().map(|p| (p.name, p.run_time_ns, p.run_count)).collect())
        };
        let r = per_run(stats, || pingpong(None, 20_000).map(drop))?;
        r.get(keyspace_governor_common::PROG_SCHED_SWITCH).copied().context("switch program runs")
    };
    let many = unmatched_rules(1000);
    let (mut none, mut with) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        none.push(one("")?);
        with.push(one(&many)?);
    }
    Ok((median(none), median(with)))
}

/// A `stress-ng --cpu 2` started after its rule, charged by rule over 3 s,
/// against the schedstat of its processes (all stopped at both ends, so
/// every slice is closed): signed error in %.
pub fn attribution_error_pct() -> Result<f64> {
    let agent = Agent::start("ebpf", "[[rules]]\nname = \"stress\"\nkeyspace = 77\ncomm-prefix = \"stress-ng\"\n")?;
    let mut child = stress_ng()?;
    std::thread::sleep(Duration::from_millis(500));
    let snapshot = |pids: &[u32]| -> Result<(f64, f64)> {
        pids.iter().for_each(|&p| unsafe_kill(p, libc::SIGSTOP));
        std::thread::sleep(Duration::from_millis(100));
        let charged = agent.keyspace_seconds(77)?;
        let truth: u64 = pids.iter().filter_map(|&p| governor_tests::schedstat_ns(p, p).ok()).sum();
        pids.iter().for_each(|&p| unsafe_kill(p, libc::SIGCONT));
        Ok((charged, truth as f64 / 1e9))
    };
    let group: Vec<u32> = governor_tests::process_tree(child.id()).into_iter().collect();
    let (c0, s0) = snapshot(&group)?;
    std::thread::sleep(Duration::from_secs(3));
    let (c1, s1) = snapshot(&group)?;
    group.iter().for_each(|&p| unsafe_kill(p, libc::SIGKILL));
    let _ = child.wait();
    Ok(((c1 - c0) / (s1 - s0) - 1.0) * 100.0)
}

/// `stress-ng --cpu 2`: a parent and two CPU-bound workers.
fn stress_ng() -> Result<std::process::Child> {
    Command::new("stress-ng")
        .args(["--cpu", "2", "--timeout", "30"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("stress-ng (cargo xtask setup installs it)")
}

fn unsafe_kill(pid: u32, sig: i32) {
    // SAFETY: kill(2) on processes this benchmark started.
    unsafe { libc::kill(pid as i32, sig) };
}

/// A `stress-ng --cpu 2` rule-capped at 0.5 core by the kernel (cgroup):
/// the worst 1 s window of 8, by the agent's charge, off the cap in %.
pub fn cap_error_pct() -> Result<f64> {
    let agent = Agent::start(
        "ebpf",
        "[resource-control.cpu-throttle]\nenabled = true\nkeyspace-cpu-quotas = \"78:500\"\n\n\
         [[rules]]\nname = \"capped\"\nkeyspace = 78\ncomm-prefix = \"stress-ng\"\n",
    )?;
    let mut child = stress_ng()?;
    std::thread::sleep(Duration::from_millis(1500));
    let rates = agent.sample_rates(78, 8)?;
    unsafe_kill(child.id(), libc::SIGTERM);
    let _ = child.wait();
    Ok(rates.iter().map(|r| (r / 0.5 - 1.0).abs() * 100.0).fold(0.0, f64::max))
}

/// A real latency-sensitive server beside a CPU hog held to a rule cap.
pub struct Neighbour {
    /// Per round, the server's p99 beside the capped hog over its p99 alone.
    pub ratios: Vec<f64>,
    /// Per round, the server's p99 alone and beside the capped hog, µs.
    pub alone_p99_us: Vec<f64>,
    pub capped_p99_us: Vec<f64>,
    /// Per round, the hog's CPU by schedstat while the server was probed, cores.
    pub hog_cores: Vec<f64>,
}

/// Debian's `redis-server` probed at 1 000 `GET`/s open loop for 5 s
/// (`workload redis-probe`, latency from each request's due time), alone
/// and then beside `stress-ng --cpu 2` matched by a rule and capped at 0.5
/// core (`keyspace-cpu-quotas`, the default bandwidth period), `rounds`
/// times.
pub fn reader_neighbour(rounds: usize) -> Result<Neighbour> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut redis = Command::new("redis-server");
    redis.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]);
    redis.stdout(Stdio::null());
    // In a session of its own, as a service manager starts it: with
    // autogroups on, a server sharing its session's scheduling group with
    // its client (and this benchmark) waited 4–10× longer beside the hog.
    // SAFETY: setsid(2) only, between fork and exec.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut redis, || {
            if libc::setsid() < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
        })
    };
    let redis = redis.spawn().context("redis-server (cargo xtask setup installs it)")?;
    let _redis = governor_tests::Reap(redis);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        anyhow::ensure!(std::time::Instant::now() < deadline, "redis-server did not listen on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let probe = || -> Result<f64> {
        let o = Command::new(governor_tests::workload_bin())
            .args(["redis-probe", "--port", &port.to_string(), "--rate", "1000", "--seconds", "5"])
            .output()?;
        anyhow::ensure!(o.status.success(), "redis-probe: {}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
        v["p99_us"].as_f64().context("p99_us")
    };
    let agent = Agent::start(
        "ebpf",
        "[resource-control.cpu-throttle]\nenabled = true\nkeyspace-cpu-quotas = \"79:500\"\n\n\
         [[rules]]\nname = \"hog\"\nkeyspace = 79\ncomm-prefix = \"stress-ng\"\n",
    )?;
    let mut n =
        Neighbour { ratios: Vec::new(), alone_p99_us: Vec::new(), capped_p99_us: Vec::new(), hog_cores: Vec::new() };
    for _ in 0..rounds {
        let alone = probe()?;
        let mut hog = stress_ng()?;
        // Moved into its cgroup and past its first period.
        std::thread::sleep(Duration::from_millis(1500));
        let hog_ns = || -> u64 {
            governor_tests::process_tree(hog.id()).iter().map(|&p| governor_tests::process_schedstat_ns(p)).sum()
        };
        let (h0, t0) = (hog_ns(), std::time::Instant::now());
        let capped = probe()?;
        let cores = (hog_ns() - h0) as f64 / 1e9 / t0.elapsed().as_secs_f64();
        governor_tests::process_tree(hog.id()).iter().for_each(|&p| unsafe_kill(p, libc::SIGKILL));
        let _ = hog.wait();
        n.ratios.push(capped / alone);
        n.alone_p99_us.push(alone);
        n.capped_p99_us.push(capped);
        n.hog_cores.push(cores);
    }
    drop(agent);
    Ok(n)
}
