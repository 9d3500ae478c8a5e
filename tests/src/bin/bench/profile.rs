//! What a profile costs: the demo's noisy tenant's throughput with a 99 Hz
//! profile running against without (`demo --profile-overhead`: the reader
//! server's scans, rounds alternating), the same for the `rows` workload
//! (two threads switching keyspaces every turn), the profile program's own
//! run time per sample from the kernel's BPF statistics, and how long the
//! CLI takes from the end of 10 s of sampling to an SVG.

use anyhow::{Context, Result, bail};
use governor_tests::{Agent, Scratch, governor_bin, workload_bin};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub struct ProfileCost {
    /// The demo's noisy tenant: median over rounds of the scans per second
    /// lost with the profile running, %.
    pub overhead_pct: f64,
    pub overhead_runs: Vec<f64>,
    /// The same for the `rows` workload's turns per second.
    pub rows_overhead_pct: f64,
    pub rows_overhead_runs: Vec<f64>,
    /// `gov_profile`'s run time per sample (statistics' floor included).
    pub ebpf_ns_per_sample: f64,
    /// Samples per second per CPU seen.
    pub samples_per_cpu_second: f64,
    /// From the end of sampling to the SVG written, ms.
    pub render_ms: f64,
}

/// Turns per second of `workload rows` over `seconds`.
fn rows_rate(agent: &Agent, seconds: f64) -> Result<f64> {
    let out = Command::new(workload_bin())
        .args(["rows", "--threads", "2", "--seconds", &seconds.to_string(), "--socket"])
        .arg(&agent.socket)
        .output()?;
    if !out.status.success() {
        bail!("workload rows: {}", String::from_utf8_lossy(&out.stderr));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    Ok(v["turns"].as_f64().context("turns")? / seconds)
}

fn profile(agent: &Agent, args: &[&str]) -> Result<std::process::Child> {
    Ok(Command::new(governor_bin())
        .arg("profile")
        .args(args)
        .arg("--socket")
        .arg(&agent.socket)
        .stdout(Stdio::null())
        .spawn()?)
}

pub fn cost(rounds: usize) -> Result<ProfileCost> {
    let agent = Agent::start_default("ebpf")?;
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).context("enabling BPF run-time statistics")?;
    let program = || -> Result<(u64, u64)> {
        let s = agent.status()?;
        let p = s.programs.iter().find(|p| p.name == keyspace_governor_common::PROG_PROFILE).context("gov_profile")?;
        Ok((p.run_time_ns, p.run_count))
    };
    let mut runs = Vec::new();
    let (mut run_ns, mut samples, mut profiled_s) = (0u64, 0u64, 0.0);
    for round in 0..rounds {
        let mut pair = [0.0; 2];
        for with in if round % 2 == 0 { [false, true] } else { [true, false] } {
            let rate = if with {
                let before = program()?;
                let mut p = profile(&agent, &["--seconds", "3.5"])?;
                std::thread::sleep(Duration::from_millis(250));
                let rate = rows_rate(&agent, 3.0)?;
                p.wait()?;
                let after = program()?;
                run_ns += after.0 - before.0;
                samples += after.1 - before.1;
                profiled_s += 3.5;
                rate
            } else {
                rows_rate(&agent, 3.0)?
            };
            pair[usize::from(with)] = rate;
        }
        runs.push((1.0 - pair[1] / pair[0]) * 100.0);
    }
    let cpus = keyspace_governor::sys::online_cpus().map_or(1, |c| c.len()) as f64;
    // 10 s of samples, rendered.
    let dir = Scratch::new("bench-profile");
    let svg = dir.0.join("p.svg");
    let mut work = Command::new(workload_bin())
        .args(["rows", "--threads", "2", "--seconds", "11", "--socket"])
        .arg(&agent.socket)
        .stdout(Stdio::null())
        .spawn()?;
    let t = Instant::now();
    let status = profile(&agent, &["--seconds", "10", "--format", "svg", "--output", svg.to_str().unwrap()])?.wait()?;
    let render_ms = (t.elapsed().as_secs_f64() - 10.0) * 1000.0;
    let _ = work.wait();
    if !status.success() || !svg.exists() {
        bail!("governor profile --format svg failed");
    }
    drop(agent);
    let (overhead_pct, overhead_runs) = demo_overhead(rounds)?;
    Ok(ProfileCost {
        overhead_pct,
        overhead_runs,
        rows_overhead_pct: crate::switch::median(runs.clone()),
        rows_overhead_runs: runs,
        ebpf_ns_per_sample: run_ns as f64 / samples.max(1) as f64,
        samples_per_cpu_second: samples as f64 / profiled_s / cpus,
        render_ms,
    })
}

/// `demo --profile-overhead ROUNDS --json`: the demo's noisy tenant with
/// and without a profile (its own agent and reader server).
fn demo_overhead(rounds: usize) -> Result<(f64, Vec<f64>)> {
    let out = Command::new(governor_tests::demo_bin())
        .args(["--profile-overhead", &rounds.to_string(), "--json"])
        .stderr(Stdio::inherit())
        .output()
        .context("demo --profile-overhead")?;
    if !out.status.success() {
        bail!("demo --profile-overhead failed: {}", out.status);
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("demo --profile-overhead output")?;
    let runs: Vec<f64> = v["profile_overhead_pct_runs"]
        .as_array()
        .context("profile_overhead_pct_runs")?
        .iter()
        .filter_map(serde_json::Value::as_f64)
        .collect();
    Ok((v["profile_overhead_pct"].as_f64().context("profile_overhead_pct")?, runs))
}
