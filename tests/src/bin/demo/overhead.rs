//! `demo --profile-overhead ROUNDS`: what a running `governor profile`
//! costs the demo's noisy tenant. The noisy tenant alone (closed-loop long
//! scans on every connection, the server's cores busy) in windows of
//! [`WINDOW_SECONDS`], alternately with and without a 99 Hz profile of
//! every keyspace running over the window (its look-up of symbols after
//! the window is not counted in the next one); each round's overhead is
//! the scans per second lost, and the result is the median over rounds.

use super::load::{self, Noisy};
use anyhow::{Context, Result, bail};
use governor_tests::Agent;
use serde_json::json;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One window of the noisy tenant's load, seconds.
const WINDOW_SECONDS: f64 = 5.0;

/// Scans per second the noisy tenant completed over one window, with a
/// profile running over it or not.
fn window(agent: &Agent, addr: SocketAddr, noisy: &Noisy, profiled: bool) -> Result<f64> {
    let profile = if profiled {
        // Sampling starts before the window and ends after it.
        let child = Command::new(governor_tests::governor_bin())
            .args(["profile", "--seconds", &(WINDOW_SECONDS + 1.0).to_string(), "--frequency", "99"])
            .args(["--format", "folded", "--socket"])
            .arg(&agent.socket)
            .stdout(Stdio::null())
            .spawn()
            .context("governor profile")?;
        std::thread::sleep(Duration::from_millis(500));
        Some(child)
    } else {
        None
    };
    let run = load::start(addr, &[], Some(noisy), Instant::now() + Duration::from_millis(50), WINDOW_SECONDS)?;
    let logs = run.finish().context("the noisy tenant's load")?;
    if let Some(mut child) = profile {
        let status = child.wait()?;
        if !status.success() {
            bail!("governor profile failed: {status}");
        }
    }
    let log = logs.get(&noisy.name).context("the noisy tenant's log")?;
    if log.ok == 0 {
        bail!("the noisy tenant completed no scan (busy {:?}, errors {})", log.busy, log.errors);
    }
    Ok(log.ok as f64 / WINDOW_SECONDS)
}

/// Runs `rounds` rounds (the order alternating) and prints the result.
pub fn run(agent: &Agent, addr: SocketAddr, noisy: &Noisy, rounds: usize, json_out: bool) -> Result<()> {
    // A window unmeasured first: connections, caches, the keyspace's cell.
    window(agent, addr, noisy, false)?;
    let mut runs = Vec::new();
    let (mut without, mut with) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let mut rate = [0.0; 2];
        for profiled in if round % 2 == 0 { [false, true] } else { [true, false] } {
            rate[usize::from(profiled)] = window(agent, addr, noisy, profiled)?;
        }
        without.push(rate[0]);
        with.push(rate[1]);
        runs.push((rate[0] - rate[1]) / rate[0] * 100.0);
        eprintln!(
            "round {}: {:.1} scans/s without a profile, {:.1} with: {:+.2} % lost",
            round + 1,
            rate[0],
            rate[1],
            runs[round]
        );
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let out = json!({
        "profile_overhead_pct": median(&runs),
        "profile_overhead_pct_runs": runs,
        "noisy_scans_per_s_without": median(&without),
        "noisy_scans_per_s_with": median(&with),
        "window_seconds": WINDOW_SECONDS,
        "frequency_hz": 99,
    });
    if json_out {
        println!("{out}");
    } else {
        println!(
            "profile overhead on the noisy tenant: {:.2} % (median of {rounds} rounds: {:?})",
            median(&runs),
            out["profile_overhead_pct_runs"]
        );
    }
    Ok(())
}
