//! What the eBPF programs cost a context switch: per run, from the kernel's
//! BPF statistics (net of the floor those statistics add to any program),
//! and end to end, as the slowdown of a same-CPU pipe ping-pong.

use anyhow::{Context, Result};
use governor_tests::{Agent, run_workload};
use std::collections::BTreeMap;
use std::path::Path;

const CALIBRATION: [&str; 2] =
    [keyspace_governor_common::PROG_CALIBRATE, keyspace_governor_common::PROG_CALIBRATE_CLOCK];

/// The CPU the ping-pongs run on: the last one, away from the agent's
/// usual CPU 0 housekeeping where there is a choice.
fn pingpong_cpu() -> String {
    (keyspace_governor::sys::logical_cores().max(1) - 1).to_string()
}

/// Mean ns per round trip of a same-CPU ping-pong between two processes,
/// registered and tagged with the agent at `socket` when given.
pub fn pingpong(socket: Option<&Path>, rounds: u32) -> Result<f64> {
    let rounds = rounds.to_string();
    let cpu = pingpong_cpu();
    let mut args = vec!["pingpong", "--rounds", &rounds, "--cpu", &cpu];
    let out = match socket {
        Some(s) => {
            args.push("--register");
            run_workload(s, &args)?
        }
        // The socket is not used without --register.
        None => run_workload(Path::new("/nonexistent"), &args)?,
    };
    out["round_trip_ns"].as_f64().context("round_trip_ns")
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// End-to-end cost of the programs on a switch-heavy workload, in % of the
/// round trip with nothing attached. Each round measures the baseline with
/// nothing attached; an empty program alone on the tracepoint (what merely
/// attaching any BPF program to sched_switch costs here: the floor no
/// program can go under); then an agent, with two unregistered processes and
/// with two registered, tagged ones. The results are medians over the rounds
/// of each round's ratio, so slow drifts of the host cancel out. The kernel's
/// BPF statistics stay off, as on a production node.
pub struct Overhead {
    pub baseline_ns: f64,
    pub empty_program_pct: f64,
    pub unregistered_pct: f64,
    pub registered_pct: f64,
}

pub fn overhead(rounds: usize) -> Result<Overhead> {
    const TRIPS: u32 = 30_000;
    let (mut base, mut empty, mut unreg, mut reg) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let pct = |x: f64, b: f64| (x - b) / b * 100.0;
    for _ in 0..rounds {
        let b = pingpong(None, TRIPS)?;
        let calib = calibration(&CALIBRATION[..1])?;
        let e = pingpong(None, TRIPS)?;
        drop(calib);
        let agent = Agent::start_default("ebpf")?;
        let u = pingpong(None, TRIPS)?;
        let r = pingpong(Some(&agent.socket), TRIPS)?;
        drop(agent);
        base.push(b);
        empty.push(pct(e, b));
        unreg.push(pct(u, b));
        reg.push(pct(r, b));
    }
    Ok(Overhead {
        baseline_ns: median(base),
        empty_program_pct: median(empty),
        unregistered_pct: median(unreg),
        registered_pct: median(reg),
    })
}

/// Loads a second copy of the object and attaches only (some of) its
/// calibration programs: an empty one (what the statistics charge any
/// program here) and one that only reads the clock.
fn calibration(programs: &[&str]) -> Result<aya::Ebpf> {
    let mut ebpf = aya::EbpfLoader::new()
        .set_max_entries(keyspace_governor_common::MAP_TID_SLOT, 2)
        .set_max_entries(keyspace_governor_common::MAP_SLOTS, 1)
        .set_max_entries(keyspace_governor_common::MAP_KEYSPACES, 1)
        .load(keyspace_governor::EBPF_OBJECT)?;
    let btf = aya::Btf::from_sys_fs()?;
    for &name in programs {
        let prog: &mut aya::programs::BtfTracePoint =
            ebpf.program_mut(name).context("calibration program")?.try_into()?;
        prog.load("sched_switch", &btf)?;
        prog.attach()?;
    }
    Ok(ebpf)
}

fn program_runs(ebpf: &aya::Ebpf, name: &str) -> Result<(u64, u64)> {
    let info = ebpf.program(name).context("program")?.info()?;
    Ok((info.run_time().as_nanos() as u64, info.run_count()))
}

/// ns per run over what `f` makes the programs do: (name → ns per run).
pub fn per_run(
    stats: impl Fn() -> Result<Vec<(String, u64, u64)>>,
    f: impl FnOnce() -> Result<()>,
) -> Result<BTreeMap<String, f64>> {
    let before = stats()?;
    f()?;
    let mut out = BTreeMap::new();
    for (name, time, runs) in stats()? {
        if let Some((_, t0, r0)) = before.iter().find(|b| b.0 == name)
            && runs > *r0
        {
            out.insert(name, (time - t0) as f64 / (runs - r0) as f64);
        }
    }
    Ok(out)
}

/// [`ebpf_cost`] on an agent of its own that counts keyspaces' CPU pressure
/// (`agent.cpu-pressure`): the switch program's dearer registered path and
/// the wakeup program, attached only then.
pub fn pressure_cost() -> Result<BTreeMap<String, f64>> {
    let agent = Agent::start("ebpf", "[agent]\ncpu-pressure = true\n")?;
    anyhow::ensure!(agent.status()?.cpu_pressure, "the agent does not count CPU pressure on this kernel");
    ebpf_cost(&agent)
}

/// Per-run cost of the agent's programs: the switch program over switches
/// between registered threads and, apart, between unregistered processes;
/// the timer (and the wakeup program, when attached); then the statistics'
/// floor and one clock read, from the calibration programs in a pass of
/// their own.
pub fn ebpf_cost(agent: &Agent) -> Result<BTreeMap<String, f64>> {
    // Scoped: the statistics switch off when this fd closes, even if the
    // benchmark dies.
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).context("enabling BPF run-time statistics")?;
    let agent_stats = || -> Result<Vec<(String, u64, u64)>> {
        Ok(agent.status()?.programs.into_iter().map(|p| (p.name, p.run_time_ns, p.run_count)).collect())
    };
    let mut out = BTreeMap::new();
    let reg = per_run(agent_stats, || pingpong(Some(&agent.socket), 20_000).map(drop))?;
    out.insert(
        "registered".to_string(),
        reg.get(keyspace_governor_common::PROG_SCHED_SWITCH).copied().unwrap_or(f64::NAN),
    );
    out.insert("timer".to_string(), reg.get(keyspace_governor_common::PROG_TIMER).copied().unwrap_or(f64::NAN));
    out.insert(
        "wakeup_registered".to_string(),
        reg.get(keyspace_governor_common::PROG_WAKEUP).copied().unwrap_or(f64::NAN),
    );
    let unreg = per_run(agent_stats, || pingpong(None, 20_000).map(drop))?;
    out.insert(
        "unregistered".to_string(),
        unreg.get(keyspace_governor_common::PROG_SCHED_SWITCH).copied().unwrap_or(f64::NAN),
    );
    out.insert(
        "wakeup_unregistered".to_string(),
        unreg.get(keyspace_governor_common::PROG_WAKEUP).copied().unwrap_or(f64::NAN),
    );
    // The agent's programs are still attached; the calibration programs'
    // own figures are what matters in this pass.
    let calib = calibration(&CALIBRATION)?;
    let calib_stats =
        || CALIBRATION.iter().map(|n| program_runs(&calib, n).map(|(t, r)| (n.to_string(), t, r))).collect();
    let c = per_run(calib_stats, || pingpong(None, 20_000).map(drop))?;
    out.insert("floor".to_string(), c.get(CALIBRATION[0]).copied().unwrap_or(f64::NAN));
    out.insert("clock".to_string(), c.get(CALIBRATION[1]).copied().unwrap_or(f64::NAN));
    Ok(out)
}
