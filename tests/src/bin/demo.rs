//! `cargo xtask demo`: the agent, on its embedded default configuration,
//! measuring a noisy-neighbour workload: six worker threads serve eight
//! keyspaces, and keyspace 1007 does 64× the work of keyspace 1000 per
//! request. The agent's per-keyspace CPU is printed next to what the
//! workload measured for itself with CLOCK_THREAD_CPUTIME_ID.
use anyhow::Result;
use governor_tests::{run_workload, Agent};

fn main() -> Result<()> {
    let agent = Agent::start_default("auto")?;
    let status = agent.status()?;
    println!("governor agent up: backend {}, {} logical cores", status.backend.as_str(), status.logical_cores);
    let threads = (3 * status.logical_cores).to_string();
    println!("running {threads} worker threads × 50 000 keyspace switches, uneven work per keyspace ...\n");
    let out = run_workload(
        &agent.socket,
        &["exactly-once", "--threads", &threads, "--keyspaces", "8", "--switches", "50000", "--base", "1000"],
    )?;
    let status = agent.status()?;
    let own = out["self_measured_ns"].as_object().cloned().unwrap_or_default();
    let own_total: f64 = own.values().filter_map(|v| v.as_u64()).map(|v| v as f64).sum();
    let charged_total: f64 = status.keyspaces.iter().map(|k| k.cpu_seconds).sum();
    println!(
        "{:>9} | {:>14} {:>7} | {:>16} {:>7} | {:>8}",
        "keyspace", "agent cpu (s)", "share", "workload cpu (s)", "share", "diff pp"
    );
    println!("{}", "-".repeat(76));
    for k in &status.keyspaces {
        let mine = own.get(&k.keyspace_id.to_string()).and_then(|v| v.as_u64()).unwrap_or(0) as f64 / 1e9;
        let (a, b) = (k.cpu_seconds / charged_total * 100.0, mine / (own_total / 1e9) * 100.0);
        println!(
            "{:>9} | {:>14.4} {:>6.2}% | {:>16.4} {:>6.2}% | {:>+8.3}",
            k.keyspace_id, k.cpu_seconds, a, mine, b, a - b
        );
    }
    let truth = out["thread_cpu_ns"].as_u64().unwrap_or(0) as f64 / 1e9;
    println!("{}", "-".repeat(76));
    println!(
        "{:>9} | {:>14.4} {:>7} | {:>16.4} {:>7} |",
        "total", charged_total, "", own_total / 1e9, ""
    );
    println!(
        "\nworker threads' CLOCK_THREAD_CPUTIME_ID total: {truth:.4} s; charged to keyspaces: {charged_total:.4} s \
         (error {:+.3} %)",
        (charged_total - truth) / truth * 100.0
    );
    for p in &status.programs {
        if p.run_count > 0 {
            println!("eBPF {}: {} runs, {:.0} ns/run", p.name, p.run_count, p.run_time_ns as f64 / p.run_count as f64);
        }
    }
    Ok(())
}
