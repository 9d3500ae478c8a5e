//! `cargo xtask bench`: the measurement and policy benchmarks, as ratios
//! from one run on this machine. `--json` prints one JSON object.
use anyhow::{Context, Result};
use governor::client::{self, Client};
use governor::policy::{Policy, Settings};
use governor::sys;
use governor_tests::{run_workload, Agent};
use serde_json::json;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::time::Instant;

fn per_op(n: u64, f: impl FnMut(u64)) -> f64 {
    let mut f = f;
    let t = Instant::now();
    for i in 0..n {
        f(i);
    }
    t.elapsed().as_nanos() as f64 / n as f64
}

/// Best of `rounds` (the VM's neighbours add noise, never speed).
fn best(rounds: usize, mut f: impl FnMut() -> f64) -> f64 {
    (0..rounds).map(|_| f()).fold(f64::INFINITY, f64::min)
}

const STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";

const CALIBRATION: [&str; 2] = [governor_common::PROG_CALIBRATE, governor_common::PROG_CALIBRATE_CLOCK];

/// Loads a second copy of the object and attaches only its calibration
/// programs: an empty one (what the statistics charge any program here)
/// and one that only reads the clock.
fn calibration() -> Result<aya::Ebpf> {
    let mut ebpf = aya::EbpfLoader::new()
        .set_max_entries(governor_common::MAP_TID_SLOT, 2)
        .set_max_entries(governor_common::MAP_SLOTS, 1)
        .set_max_entries(governor_common::MAP_KEYSPACES, 1)
        .load(governor::EBPF_OBJECT)?;
    let btf = aya::Btf::from_sys_fs()?;
    for name in CALIBRATION {
        let prog: &mut aya::programs::BtfTracePoint =
            ebpf.program_mut(name).context("calibration program")?.try_into()?;
        prog.load("sched_switch", &btf)?;
        prog.attach()?;
    }
    Ok(ebpf)
}

fn calibration_stats(ebpf: &aya::Ebpf) -> Result<Vec<(u64, u64)>> {
    CALIBRATION
        .iter()
        .map(|name| {
            let info = ebpf.program(name).context("calibration program")?.info()?;
            Ok((info.run_time().as_nanos() as u64, info.run_count()))
        })
        .collect()
}

/// `rounds` pipe round trips between this thread (tagged 1) and a second
/// registered thread (tagged 2): two context switches per round trip per side.
fn ping_pong(client: &Client, rounds: u32) -> Result<()> {
    let (mut a_r, mut b_w) = std::io::pipe()?;
    let (mut b_r, mut a_w) = std::io::pipe()?;
    let c2 = client.clone();
    let peer = std::thread::spawn(move || -> Result<()> {
        c2.register_current_thread()?;
        let _g = client::tag(2)?;
        let mut b = [0u8; 1];
        for _ in 0..rounds {
            b_r.read_exact(&mut b)?;
            b_w.write_all(&b)?;
        }
        Ok(())
    });
    let _g = client::tag(1)?;
    let mut b = [7u8; 1];
    for _ in 0..rounds {
        a_w.write_all(&b)?;
        a_r.read_exact(&mut b)?;
    }
    peer.join().expect("peer thread")
}

/// ns per run of the agent's programs, then (in a second pass, so they do
/// not share the tracepoint with the agent's program while it is measured)
/// of the calibration programs.
fn ebpf_cost(client: &Client, agent: &Agent) -> Result<BTreeMap<String, f64>> {
    let before_flag = std::fs::read_to_string(STATS).unwrap_or_else(|_| "0".into());
    std::fs::write(STATS, "1").context("enabling bpf_stats_enabled")?;
    let mut out = BTreeMap::new();
    let before = agent.status()?.programs;
    ping_pong(client, 20_000)?;
    for p in agent.status()?.programs {
        if let Some(b) = before.iter().find(|b| b.name == p.name) {
            let runs = p.run_count - b.run_count;
            if runs > 0 {
                out.insert(p.name.clone(), (p.run_time_ns - b.run_time_ns) as f64 / runs as f64);
            }
        }
    }
    let calib = calibration()?;
    let calib_before = calibration_stats(&calib)?;
    ping_pong(client, 20_000)?;
    let calib_after = calibration_stats(&calib)?;
    std::fs::write(STATS, before_flag.trim())?;
    for ((key, a), b) in ["floor", "clock"].iter().zip(&calib_after).zip(&calib_before) {
        let runs = a.1 - b.1;
        if runs > 0 {
            out.insert(key.to_string(), (a.0 - b.0) as f64 / runs as f64);
        }
    }
    Ok(out)
}

/// (Σ charges − Σ thread clocks) / Σ thread clocks, signed, and the
/// machine's steal time over the same run as a share of the thread clocks.
fn attribution_error_pct(agent: &Agent) -> Result<(f64, f64)> {
    let cores = sys::logical_cores();
    let steal_before = governor_tests::steal_ns();
    let out = run_workload(
        &agent.socket,
        &["exactly-once", "--threads", &(3 * cores).to_string(), "--switches", "100000", "--base", "5000"],
    )?;
    let truth = out["thread_cpu_ns"].as_u64().context("thread_cpu_ns")? as f64;
    let charged: f64 = agent
        .status()?
        .keyspaces
        .iter()
        .filter(|k| (5000..5100).contains(&k.keyspace_id))
        .map(|k| k.cpu_seconds * 1e9)
        .sum();
    let steal = (governor_tests::steal_ns() - steal_before) as f64;
    Ok(((charged - truth) / truth * 100.0, steal / truth * 100.0))
}

fn policy_allocate_release_ns() -> f64 {
    let s = Settings { enable_runtime_token_management: false, ..Settings::essential(sys::logical_cores() as f64, 0.4) };
    let p = Policy::new(s, 0).expect("valid settings");
    best(5, || {
        per_op(2_000_000, |i| {
            let g = p.allocate(1, Some(10), i).expect("tokens available");
            // A full refund keeps the bucket level without agent ticks.
            p.release(g, 0);
        })
    })
}

fn main() -> Result<()> {
    let json_out = std::env::args().any(|a| a == "--json");
    let agent = Agent::start_default("ebpf")?;
    // Measure the steady state: the agent publishes the TSC clock after its
    // second calibration anchor (where the kernel keeps time on the TSC).
    let deadline = Instant::now() + std::time::Duration::from_secs(2);
    while agent.status()?.thread_clock_source == "vdso" && governor::tsc::usable() && Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let clock_source = agent.status()?.thread_clock_source;
    let client = Client::connect(&agent.socket)?;
    client.register_current_thread()?;
    let _g = client::tag(1)?;

    let thread_clock_ns = best(5, || per_op(2_000_000, |_| {
        std::hint::black_box(client::thread_cpu_ns());
    }));
    let clock_thread_cputime_ns = best(5, || per_op(200_000, |_| {
        std::hint::black_box(sys::thread_cputime_ns());
    }));
    let tag_switch_ns = best(5, || per_op(2_000_000, |i| {
        client::set_tag(1 + (i & 1) as u32).expect("tag");
    }));
    drop(_g);
    let ebpf = ebpf_cost(&client, &agent)?;
    let (attribution, steal) = attribution_error_pct(&agent)?;
    let policy = policy_allocate_release_ns();

    let result = json!({
        "thread_clock_ns": round(thread_clock_ns),
        "thread_clock_source": clock_source,
        "clock_thread_cputime_ns": round(clock_thread_cputime_ns),
        "tag_switch_ns": round(tag_switch_ns),
        "ebpf_sched_switch_ns": round(ebpf.get("gov_sched_switch").copied().unwrap_or(f64::NAN)),
        "ebpf_stats_floor_ns": round(ebpf.get("floor").copied().unwrap_or(f64::NAN)),
        "ebpf_sched_switch_net_ns": round(
            ebpf.get("gov_sched_switch").copied().unwrap_or(f64::NAN) - ebpf.get("floor").copied().unwrap_or(f64::NAN)
        ),
        "ebpf_clock_read_ns": round(
            ebpf.get("clock").copied().unwrap_or(f64::NAN) - ebpf.get("floor").copied().unwrap_or(f64::NAN)
        ),
        "ebpf_timer_ns": round(ebpf.get("gov_timer").copied().unwrap_or(f64::NAN)),
        "attribution_error_pct": (attribution.abs() * 1000.0).round() / 1000.0,
        "attribution_signed_error_pct": (attribution * 1000.0).round() / 1000.0,
        "attribution_steal_pct": (steal * 1000.0).round() / 1000.0,
        "policy_allocate_release_ns": round(policy),
        "logical_cores": sys::logical_cores(),
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
    });
    if json_out {
        println!("{result}");
    } else {
        for (k, v) in result.as_object().expect("object") {
            println!("{k:>28}  {v}");
        }
    }
    Ok(())
}

fn round(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}
