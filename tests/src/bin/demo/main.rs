//! `cargo xtask demo`: a noisy neighbour on a real multi-tenant server,
//! governed.
//!
//! ```text
//! demo [--json] [--short] [--phase-seconds N] [--svg PATH] [--guard] [--guard-target-us N] [--pin-workers auto|on|off]
//! demo --profile-overhead ROUNDS [--json]
//! ```
//!
//! Starts the governor agent on its embedded default configuration (it
//! measures; its CPU throttle is off) and the reader server
//! (`tests/reader`: tokio workers registered with the agent, every request
//! under a ticket of its keyspace; a request whose keyspace had to wait for
//! its tokens steps aside for the others, `--levels`; `--pin-workers`,
//! `auto` by default, gives each worker a CPU of its own and lets them go
//! while other processes take half a core or more of the server's CPUs;
//! `on` keeps them pinned, `off` leaves them to the kernel). Three light tenants
//! send point gets and short scans open-loop at a fixed rate; the noisy
//! tenant sends long scans closed-loop, as fast as it is answered. Three
//! phases of equal length:
//!
//! 1. `alone`: the light tenants only;
//! 2. `monitor`: light + noisy, the agent measuring only;
//! 3. `enforcing`: the same after the agent is restarted with the default
//!    configuration plus a tenant cap (the Essential profile). The server
//!    keeps running: its client re-attaches to the new agent by itself.
//!    With `--guard` the configuration also turns the latency guard on
//!    (`[latency-guard]`, target `--guard-target-us`, 500 µs by default):
//!    while a light tenant's run-queue waits miss the target, the agent
//!    lowers the noisy tenant's refill below its cap, and the phase shows
//!    that refill per second.
//!
//! Prints progress every second and, per phase, each tenant's CPU (charged
//! by the agent, and the server's own thread-clock count beside it), the
//! noisy tenant's CPU against its cap per 1 s window, the light tenants'
//! latency percentiles, waits and refusals. Writes an SVG of CPU and p99
//! over time. `--json`: one JSON object on stdout, progress on stderr.
//! `--short`: 10 s phases (the test and the benchmark).
//!
//! # Layout
//!
//! - `load`: the open-loop and closed-loop load generator (HDR histograms).
//! - `server`: the reader server child process and its `stats` requests.
//! - `phase`: one phase: load, samples, numbers.
//! - `report`: the tables.
//! - `plot`: the SVG.
//! - `overhead`: `--profile-overhead`, what a running profile costs the
//!   noisy tenant (no phases; the benchmark's `profile_overhead_pct`).

mod load;
mod overhead;
mod phase;
mod plot;
mod report;
mod server;

use anyhow::{Context, Result, bail};
use governor_tests::Agent;
use load::{Light, Noisy};
use serde_json::json;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

/// The noisy tenant's cap, in cores (a ratio of the node's cores in the
/// agent's configuration): a quarter of this 2-core node.
const CAP_CORES: f64 = 0.5;
/// Light load before the first phase, seconds.
const WARM_UP_SECONDS: f64 = 2.0;
/// Rows per keyspace (about 7 MiB of rows, 3 MiB stored).
const ROWS: u64 = 32_768;

struct Opts {
    json: bool,
    phase_seconds: u64,
    svg: PathBuf,
    light_rate: f64,
    noisy_connections: usize,
    noisy_scan_rows: u32,
    chunk_blocks: usize,
    worker_slice_us: u64,
    levels: String,
    pin_workers: String,
    /// The latency guard's target in the enforcing phase, µs (`None`: off).
    guard_target_us: Option<u64>,
    /// `--profile-overhead`: rounds of the profile's cost instead of the phases.
    profile_overhead_rounds: Option<usize>,
}

fn parse_opts() -> Result<Opts> {
    let target = governor_tests::demo_bin().parent().and_then(|p| p.parent()).map(PathBuf::from).unwrap_or_default();
    let mut o = Opts {
        json: false,
        phase_seconds: 15,
        svg: target.join("demo").join("demo.svg"),
        light_rate: 500.0,
        noisy_connections: 16,
        noisy_scan_rows: 8192,
        chunk_blocks: 1,
        worker_slice_us: 100,
        levels: "on".into(),
        pin_workers: "auto".into(),
        guard_target_us: None,
        profile_overhead_rounds: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--json" => o.json = true,
            "--short" => o.phase_seconds = 10,
            "--phase-seconds" => o.phase_seconds = value()?.parse().context("--phase-seconds")?,
            "--svg" => o.svg = PathBuf::from(value()?),
            // Workload knobs, for tuning.
            "--light-rate" => o.light_rate = value()?.parse().context("--light-rate")?,
            "--noisy-connections" => o.noisy_connections = value()?.parse().context("--noisy-connections")?,
            "--noisy-scan-rows" => o.noisy_scan_rows = value()?.parse().context("--noisy-scan-rows")?,
            "--chunk-blocks" => o.chunk_blocks = value()?.parse().context("--chunk-blocks")?,
            "--worker-slice-us" => o.worker_slice_us = value()?.parse().context("--worker-slice-us")?,
            "--levels" => o.levels = value()?,
            "--pin-workers" => o.pin_workers = value()?,
            "--guard" => o.guard_target_us = Some(o.guard_target_us.unwrap_or(500)),
            "--guard-target-us" => o.guard_target_us = Some(value()?.parse().context("--guard-target-us")?),
            "--profile-overhead" => {
                o.profile_overhead_rounds = Some(value()?.parse().context("--profile-overhead")?);
            }
            other => bail!("unknown argument {other:?} (see the doc comment of the demo)"),
        }
    }
    if o.phase_seconds < 3 {
        bail!("--phase-seconds must be at least 3 (the first window is a warm-up)");
    }
    Ok(o)
}

/// Progress lines: on stdout, or on stderr when stdout carries the JSON;
/// rewritten in place on a terminal.
pub struct Progress {
    json: bool,
    tty: bool,
}

impl Progress {
    fn say(&mut self, line: &str) {
        if self.json {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    }

    fn second(&mut self, spec: &phase::Spec<'_>, s: u64, cpu: &[(String, f64)], light_p99_us: Option<u64>) {
        let cpu: Vec<String> = cpu.iter().map(|(n, c)| format!("{n} {c:.2}")).collect();
        let p99 = light_p99_us.map_or("-".to_string(), report::ms);
        let line = format!(
            "  [{}/3 {:<9}] {:>2}/{} s  cpu (cores): {}  light p99 {p99}",
            spec.index,
            spec.name,
            s,
            spec.seconds,
            cpu.join("  ")
        );
        if self.tty && !self.json {
            print!("\r{line}\x1b[K");
            let _ = std::io::stdout().flush();
            if s == spec.seconds {
                println!();
            }
        } else {
            self.say(&line);
        }
    }
}

fn tenants(o: &Opts) -> (Vec<Light>, Noisy) {
    let lights = (1..=3)
        .map(|i| Light {
            name: format!("light-{i}"),
            keyspace: 100 + i,
            rate: o.light_rate,
            connections: 4,
            scan_every: 10,
            scan_rows: 256,
            deadline_ms: 100,
        })
        .collect();
    let noisy = Noisy {
        name: "noisy".into(),
        keyspace: 900,
        connections: o.noisy_connections,
        scan_rows: o.noisy_scan_rows,
        deadline_ms: 1000,
    };
    (lights, noisy)
}

/// The embedded default configuration plus the tenant cap: the Essential
/// profile in one key, with the demo's `tenant-max-cpu-ratio`; and the
/// latency guard with `guard_target_us`.
fn cap_config(ratio: f64, guard_target_us: Option<u64>) -> String {
    let guard = guard_target_us
        .map_or(String::new(), |t| format!("[latency-guard]\nenabled = true\ntarget-wait-p99 = \"{t}us\"\n"));
    format!(
        "# The embedded default, plus the demo's tenant cap (Essential profile).\n\
         [resource-control.cpu-throttle]\nprofile = \"essential\"\ntenant-max-cpu-ratio = {ratio}\n{guard}"
    )
}

fn main() -> Result<()> {
    let o = parse_opts()?;
    let t0 = Instant::now();
    let mut progress = Progress { json: o.json, tty: std::io::stdout().is_terminal() };
    let mut agent = Agent::start_default("auto")?;
    let status = agent.status()?;
    let cores = f64::from(status.logical_cores);
    let (lights, noisy) = tenants(&o);
    let keyspaces: Vec<u32> = lights.iter().map(|l| l.keyspace).chain([noisy.keyspace]).collect();
    let mut server = server::ReaderServer::start(
        &agent.socket,
        &keyspaces,
        ROWS,
        o.chunk_blocks,
        o.worker_slice_us,
        &o.levels,
        &o.pin_workers,
    )?;
    let ratio = CAP_CORES / cores;
    progress.say(&format!(
        "governor agent up: backend {}, thread clock {}, {cores} cores, embedded default configuration (measuring; cpu-throttle off)",
        status.backend.as_str(),
        status.thread_clock_source
    ));
    if let Some(rounds) = o.profile_overhead_rounds {
        return overhead::run(&agent, server.addr, &noisy, rounds.max(1), o.json);
    }
    let workers = server.stats()?.workers;
    progress.say(&format!(
        "reader server at {}: {workers} tokio workers registered with the agent (scheduler slice {} µs, levels {}, one per CPU {}), keyspaces {keyspaces:?}, {ROWS} rows each",
        server.addr,
        o.worker_slice_us,
        o.levels,
        match o.pin_workers.as_str() {
            "auto" => "while other processes take under half a core",
            other => other,
        }
    ));
    progress.say(&format!(
        "tenants: light-1..3 open-loop {} req/s each (gets, 1 in 10 a {}-row scan); noisy closed-loop, {} connections of {}-row scans",
        o.light_rate, lights[0].scan_rows, noisy.connections, noisy.scan_rows
    ));
    let spec = |index, name, mode: String, with_noisy: bool| phase::Spec {
        index,
        name,
        mode,
        seconds: o.phase_seconds,
        lights: &lights,
        noisy: with_noisy.then_some(&noisy),
        cap_cores: CAP_CORES,
        cores,
    };
    // Warm-up, not measured: connections, caches, the tenants' keyspace
    // cells in the agent. A cold first second would flatter the ratios
    // against the alone phase.
    progress.say(&format!("warming up: {WARM_UP_SECONDS} s of the light tenants' load, not measured"));
    let warm = load::start(
        server.addr,
        &lights,
        None,
        Instant::now() + std::time::Duration::from_millis(50),
        WARM_UP_SECONDS,
    )?;
    warm.finish().context("warm-up load")?;
    let measuring = "agent measuring (cpu-throttle off)".to_string();
    let mut phases = Vec::new();
    for (i, name, with_noisy) in [(1, "alone", false), (2, "monitor", true)] {
        progress.say(&format!(
            "\nphase {i}/3 {name}: {}, {measuring}",
            if with_noisy { "light + noisy" } else { "light tenants alone" }
        ));
        phases.push(
            phase::run(&spec(i, name, measuring.clone(), with_noisy), &agent, &mut server, &mut progress)
                .with_context(|| context(&agent, &server))?,
        );
    }
    let config = cap_config(ratio, o.guard_target_us);
    let t_restart = Instant::now();
    agent.restart_with_config(&config)?;
    let reattached = server.wait_attached(2, std::time::Duration::from_secs(15))?;
    let guard = o.guard_target_us.map_or(String::new(), |t| format!(", latency guard on (target p99 {t} µs)"));
    let enforcing = format!("agent enforcing: tenant-max-cpu-ratio {ratio} = {CAP_CORES} core per tenant{guard}");
    progress.say(&format!(
        "\nagent restarted with the tenant cap in {:.1?}; the server re-attached by itself {:.0?} after the new agent answered",
        t_restart.elapsed() - reattached,
        reattached
    ));
    progress.say(&format!("phase 3/3 enforcing: light + noisy, {enforcing}"));
    phases.push(
        phase::run(&spec(3, "enforcing", enforcing, true), &agent, &mut server, &mut progress)
            .with_context(|| context(&agent, &server))?,
    );
    if std::env::var_os("DEMO_DEBUG").is_some() {
        eprintln!("agent log:\n{}\nreader-server log:\n{}", agent.log_text(), server.log_text());
    }
    plot::write(&o.svg, &phases, &lights, &noisy, CAP_CORES, cores)?;
    let (alone, monitor, enforced) = (&phases[0], &phases[1], &phases[2]);
    let ratio_of = |p: &phase::PhaseResult| p.light.p99_us as f64 / alone.light.p99_us.max(1) as f64;
    let worst_tenant_ratio = |p: &phase::PhaseResult| {
        lights
            .iter()
            .map(|l| p.tenants[&l.name].latency.p99_us as f64 / alone.tenants[&l.name].latency.p99_us.max(1) as f64)
            .fold(0.0, f64::max)
    };
    let result = json!({
        "cores": cores,
        "backend": status.backend.as_str(),
        "phase_seconds": o.phase_seconds,
        "cap": { "cores": CAP_CORES, "tenant_max_cpu_ratio": ratio, "config": config },
        "guard_target_us": o.guard_target_us,
        "tenants": {
            "light": lights.iter().map(|l| json!({"name": l.name, "keyspace": l.keyspace, "rate_per_s": l.rate,
                "connections": l.connections, "scan_every": l.scan_every, "scan_rows": l.scan_rows, "deadline_ms": l.deadline_ms})).collect::<Vec<_>>(),
            "noisy": {"name": noisy.name, "keyspace": noisy.keyspace, "connections": noisy.connections,
                "scan_rows": noisy.scan_rows, "deadline_ms": noisy.deadline_ms},
        },
        "server": { "rows_per_keyspace": ROWS, "chunk_blocks": o.chunk_blocks, "worker_slice_us": o.worker_slice_us, "levels": o.levels, "pin_workers": o.pin_workers },
        "phases": phases,
        "light_p99_ratio": { "monitor": ratio_of(monitor), "enforcing": ratio_of(enforced) },
        "worst_light_tenant_p99_ratio": { "monitor": worst_tenant_ratio(monitor), "enforcing": worst_tenant_ratio(enforced) },
        "noisy_cap_error_pct": enforced.noisy.as_ref().map(|n| n.worst_window_error_pct),
        "reattach_ms": reattached.as_secs_f64() * 1e3,
        "svg": o.svg,
        "series": plot::series(&lights, &noisy),
        "elapsed_s": t0.elapsed().as_secs_f64(),
    });
    if o.json {
        println!("{result}");
    } else {
        report::print(&phases, &lights, &noisy, cores);
        println!(
            "\nlight tenants' p99: alone {}, noisy neighbour unthrottled {} ({:.2}×), governed {} ({:.2}×)",
            report::ms(alone.light.p99_us),
            report::ms(monitor.light.p99_us),
            ratio_of(monitor),
            report::ms(enforced.light.p99_us),
            ratio_of(enforced)
        );
        if let (Some(m), Some(e)) = (&monitor.noisy, &enforced.noisy) {
            println!(
                "noisy tenant: {:.2} cores unthrottled; {:.3} cores governed against a cap of {CAP_CORES} \
                 (worst 1 s window after the first off by {:.1} %)",
                m.cpu_cores, e.cpu_cores, e.worst_window_error_pct
            );
        }
        println!("plot: {}", o.svg.display());
        println!("demo took {:.1?}", t0.elapsed());
    }
    Ok(())
}

/// What to read when a phase fails: the agent's and the server's logs.
fn context(agent: &Agent, server: &server::ReaderServer) -> String {
    format!("agent log:\n{}\nreader-server log:\n{}", agent.log_text(), server.log_text())
}
