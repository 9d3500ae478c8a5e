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
        let calib = calibration(&[(CALIBRATION[0], "sched_switch")])?;
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

/// Loads a second copy of the object and attaches (some of) its
/// calibration programs, each to a tracepoint: an empty one (what the
/// statistics charge any program here) and one that only reads the clock.
fn calibration(programs: &[(&str, &str)]) -> Result<aya::Ebpf> {
    let mut ebpf = aya::EbpfLoader::new()
        .set_max_entries(keyspace_governor_common::MAP_TID_SLOT, 2)
        .set_max_entries(keyspace_governor_common::MAP_SLOTS, 1)
        .set_max_entries(keyspace_governor_common::MAP_KEYSPACES, 1)
        .load(keyspace_governor::EBPF_OBJECT)?;
    let btf = aya::Btf::from_sys_fs()?;
    for &(name, tracepoint) in programs {
        let prog: &mut aya::programs::BtfTracePoint =
            ebpf.program_mut(name).context("calibration program")?.try_into()?;
        prog.load(tracepoint, &btf)?;
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

/// Passes of each kind in [`ebpf_cost`]: its figures are medians over them.
const COST_PASSES: usize = 7;

/// Per-run cost of the agent's programs, net of the statistics' floor: the
/// switch program over switches between registered threads and, apart,
/// between unregistered processes; the timer (and the wakeup program, when
/// attached). The calibration programs (an empty one on each tracepoint,
/// one that reads the clock) run beside the agent's on the same switches
/// and wakeups, so each pass's floor is measured on that pass's events: a
/// floor taken in a pass of its own moved with the host between passes
/// (net figures of one program read 2–21 ns in six runs in a row). Keys:
/// the raw per-run figures (`registered`, `unregistered`, `timer`,
/// `wakeup_registered`, `wakeup_unregistered`, `floor`, `wakeup_floor`,
/// `clock`) and the net ones (`*_net`), each the median over the passes.
pub fn ebpf_cost(agent: &Agent) -> Result<BTreeMap<String, f64>> {
    use keyspace_governor_common::{PROG_SCHED_SWITCH, PROG_TIMER, PROG_WAKEUP};
    // Scoped: the statistics switch off when this fd closes, even if the
    // benchmark dies.
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).context("enabling BPF run-time statistics")?;
    let switch_calib = calibration(&[(CALIBRATION[0], "sched_switch"), (CALIBRATION[1], "sched_switch")])?;
    // A second copy: a program loads for one tracepoint.
    let wakeup_calib = calibration(&[(CALIBRATION[0], "sched_wakeup")])?;
    let stats = || -> Result<Vec<(String, u64, u64)>> {
        let mut v: Vec<_> =
            agent.status()?.programs.into_iter().map(|p| (p.name, p.run_time_ns, p.run_count)).collect();
        let (t, r) = program_runs(&switch_calib, CALIBRATION[0])?;
        v.push(("floor".to_string(), t, r));
        let (t, r) = program_runs(&switch_calib, CALIBRATION[1])?;
        v.push(("clock".to_string(), t, r));
        let (t, r) = program_runs(&wakeup_calib, CALIBRATION[0])?;
        v.push(("wakeup_floor".to_string(), t, r));
        Ok(v)
    };
    let mut passes: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut keep = |key: &str, v: Option<f64>| {
        if let Some(v) = v {
            passes.entry(key.to_string()).or_default().push(v);
        }
    };
    for _ in 0..COST_PASSES {
        let reg = per_run(stats, || pingpong(Some(&agent.socket), 20_000).map(drop))?;
        let unreg = per_run(stats, || pingpong(None, 20_000).map(drop))?;
        let get = |m: &BTreeMap<String, f64>, k: &str| m.get(k).copied();
        let net = |m: &BTreeMap<String, f64>, k: &str, floor: &str| Some(get(m, k)? - get(m, floor)?);
        keep("registered", get(&reg, PROG_SCHED_SWITCH));
        keep("registered_net", net(&reg, PROG_SCHED_SWITCH, "floor"));
        keep("timer", get(&reg, PROG_TIMER));
        keep("wakeup_registered", get(&reg, PROG_WAKEUP));
        keep("wakeup_registered_net", net(&reg, PROG_WAKEUP, "wakeup_floor"));
        keep("unregistered", get(&unreg, PROG_SCHED_SWITCH));
        keep("unregistered_net", net(&unreg, PROG_SCHED_SWITCH, "floor"));
        keep("wakeup_unregistered", get(&unreg, PROG_WAKEUP));
        keep("wakeup_unregistered_net", net(&unreg, PROG_WAKEUP, "wakeup_floor"));
        keep("floor", get(&unreg, "floor"));
        keep("wakeup_floor", get(&unreg, "wakeup_floor"));
        keep("clock", get(&unreg, "clock"));
        keep("clock_net", net(&unreg, "clock", "floor"));
    }
    Ok(passes.into_iter().map(|(k, v)| (k, median(v))).collect())
}
