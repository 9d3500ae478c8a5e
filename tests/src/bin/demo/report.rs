//! The demo's tables: per phase, each tenant's CPU (agent and thread clock),
//! admissions and latency; the noisy tenant's 1 s windows against its cap.

use crate::load::{Light, Noisy};
use crate::phase::PhaseResult;
use keyspace_governor::proto::behind_in_words;

/// µs as milliseconds for a table.
pub fn ms(us: u64) -> String {
    if us >= 10_000 { format!("{:.1} ms", us as f64 / 1e3) } else { format!("{:.2} ms", us as f64 / 1e3) }
}

/// µs as µs below a millisecond, else as [`ms`]: run-queue waits are often
/// a few µs.
fn fine(us: f64) -> String {
    if us < 1000.0 { format!("{us:.1} µs") } else { ms(us.round() as u64) }
}

pub fn print(phases: &[PhaseResult], lights: &[Light], noisy: &Noisy, cores: f64) {
    for (i, p) in phases.iter().enumerate() {
        println!("\nphase {}/{} {} ({:.1} s): {}", i + 1, phases.len(), p.name, p.seconds, p.mode);
        println!(
            "  {:<8} {:>4} | {:>9} {:>6} | {:>9} {:>7} | {:>6} {:>5} {:>6} {:>7} {:>9} | {:>8} {:>8} {:>8}",
            "tenant",
            "ks",
            "agent cpu",
            "node",
            "thr clock",
            "diff",
            "ok",
            "busy",
            "waited",
            "refused",
            "mean wait",
            "p50",
            "p99",
            "p99.9"
        );
        println!("  {}", "-".repeat(124));
        let names = lights.iter().map(|l| &l.name).chain(std::iter::once(&noisy.name));
        for name in names {
            let Some(t) = p.tenants.get(name) else { continue };
            println!(
                "  {:<8} {:>4} | {:>9.3} {:>5.1}% | {:>9.3} {:>+6.2}% | {:>6} {:>5} {:>6} {:>7} {:>9} | {:>8} {:>8} {:>8}",
                name,
                t.keyspace,
                t.cpu_cores,
                t.cpu_share_pct,
                t.thread_clock_cores,
                t.cross_check_error_pct,
                t.latency.requests,
                t.busy.values().sum::<u64>() + t.errors,
                t.waited,
                t.refused,
                ms(t.mean_admission_wait_us as u64),
                ms(t.latency.p50_us),
                ms(t.latency.p99_us),
                ms(t.latency.p999_us),
            );
        }
        println!(
            "  {:<13} | {:>9} {:>6} | {:>9} {:>7} | {:>6} {:>5} {:>6} {:>7} {:>9} | {:>8} {:>8} {:>8}",
            "light, all",
            "",
            "",
            "",
            "",
            p.light.requests,
            "",
            "",
            "",
            "",
            ms(p.light.p50_us),
            ms(p.light.p99_us),
            ms(p.light.p999_us)
        );
        println!(
            "  light tenants' latency: p99 {}; per request {} in the kernel's run queue (one wait's p99 {}), the rest \
             in the server and its admission queue",
            ms(p.light.p99_us),
            fine(p.light_runq_wait_per_request_us),
            p.light_runq_wait_p99_us.map_or("-".into(), fine),
        );
        if !p.light_wait_behind_pct.is_empty() {
            // (Shares under half a per cent left out.)
            let mut by: Vec<(&String, &f64)> = p.light_wait_behind_pct.iter().filter(|(_, pct)| **pct >= 0.5).collect();
            by.sort_by(|a, b| b.1.total_cmp(a.1));
            let w: Vec<String> = by.iter().map(|(who, pct)| format!("{} {pct:.0} %", behind_words(who))).collect();
            println!("  that wait was behind: {}", w.join(", "));
        }
        if p.windows_other_processes_cores.iter().any(Option::is_some) {
            let w: Vec<String> =
                p.windows_other_processes_cores.iter().map(|c| c.map_or("-".into(), |c| format!("{c:.2}"))).collect();
            println!(
                "  other processes on the server's CPUs each second (cores; the workers are let go at 0.5): {}; let go \
                 {} times",
                w.join(" "),
                p.workers_let_go
            );
        }
        if let Some(n) = &p.noisy {
            let w: Vec<String> = n.windows_cores.iter().map(|w| format!("{w:.3}")).collect();
            println!(
                "  noisy CPU per 1 s window (cores; cap {:.3} = {:.0}% of the node): {}",
                n.cap_cores,
                n.cap_cores / cores * 100.0,
                w.join(" ")
            );
            println!("  worst window after the first: {:.1} % off the cap", n.worst_window_error_pct);
            if p.mode.contains("latency guard") {
                let r: Vec<String> = n.windows_refill_us.iter().map(|r| r.to_string()).collect();
                println!(
                    "  noisy refill per 10 ms interval at each second (µs; the latency guard lowers it): {}",
                    r.join(" ")
                );
            }
        }
    }
    println!(
        "\n(agent cpu: charged by the agent's eBPF measurement; thr clock: the server's own CLOCK_THREAD_CPUTIME_ID \
         around each request's work; busy: busy replies; waited/refused: the agent's admission counters; \
         mean wait: time in admission per request; latency from each request's intended send time)"
    );
}

/// The operator's words for whom a wait was behind (`phase`'s keys: status's
/// word, or `keyspace N`), with what they stand for in the demo.
fn behind_words(who: &str) -> String {
    match who {
        "unmeasured" => format!("{} (the load generator, the agent, kernel threads)", behind_in_words(who, None)),
        "untagged" => format!("{} (the runtime between requests)", behind_in_words(who, None)),
        k if k.starts_with("keyspace ") => k.to_string(),
        k => behind_in_words(k, None),
    }
}
