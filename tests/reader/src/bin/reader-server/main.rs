//! `reader-server`: a multi-tenant reader over TCP, governed per keyspace.
//!
//! ```text
//! reader-server [--listen 127.0.0.1:0] [--socket /run/governor/governor.sock]
//!               [--keyspaces 101,102,103,900] [--rows 32768] [--chunk-blocks 2] [--workers N]
//!               [--worker-slice-us 100] [--levels on|off] [--pin-workers on|off|auto]
//! ```
//!
//! Generates each keyspace's rows, connects to the governor agent, starts a
//! tokio runtime whose workers (one per core by default) register with the
//! agent as they start, prints `listening <addr>` on stdout and serves until
//! SIGINT or SIGTERM. If the agent restarts, the client attaches to the new
//! one by itself (admitting without checks meanwhile) and the workers
//! register again on their next request.
//!
//! Workers ask the kernel for a short scheduler slice (`--worker-slice-us`,
//! 0 keeps the kernel's default): a worker deep in a long scan then holds
//! its core against a wakeup (a light request arriving) for about that
//! long, not for the default slice of a millisecond or more.
//!
//! `--pin-workers on` pins each worker to a CPU of its own (`CpuSpread`):
//! left to the kernel, two busy workers can end up sharing one core while
//! the other idles, and a request that arrives then waits for a slice. But
//! a pinned worker cannot leave a core that a process outside the server
//! keeps busy: `auto` pins them too and lets them go while other processes
//! take half a core or more of the server's CPUs
//! (`CpuSpread::watch_other_processes`). Off by default.
//!
//! Admitted requests run on two levels (`--levels`, see `serve::Levels`):
//! a request of a keyspace the governor holds to its cap steps aside for
//! the others.
#![forbid(unsafe_code)]

mod serve;
mod stats;

use anyhow::{Context, Result, bail};
use governor_reader::store::{CostModel, KeyspaceData};
use keyspace_governor::client::Client;
use serve::Server;
use std::io::Write;
use std::sync::OnceLock;
use std::time::Instant;

struct Args {
    listen: String,
    socket: String,
    keyspaces: Vec<u32>,
    rows: u64,
    chunk_blocks: usize,
    workers: usize,
    worker_slice_us: u64,
    levels: bool,
    pin_workers: Pin,
}

/// `--pin-workers`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Pin {
    Off,
    On,
    Auto,
}

const USAGE: &str = "usage: reader-server [--listen 127.0.0.1:0] [--socket /run/governor/governor.sock]
                     [--keyspaces 101,102,103,900] [--rows 32768] [--chunk-blocks 2] [--workers N]
                     [--worker-slice-us 100] [--levels on|off] [--pin-workers on|off|auto]

A multi-tenant reader over TCP, governed per keyspace by the governor agent at --socket:
prints `listening <addr>` on stdout and serves until SIGINT or SIGTERM.
  --keyspaces       the keyspaces it serves, each with --rows rows of generated data
  --chunk-blocks    blocks a scan reads between two yields to the other requests
  --workers         tokio workers, registered with the agent (default: one per CPU)
  --worker-slice-us the scheduler slice the workers ask for (0: the kernel's default)
  --levels          requests of a keyspace held at its cap step aside for the others
  --pin-workers     a CPU per worker; auto lets them go while other processes take
                    half a core or more of the server's CPUs (default off)";

/// The arguments, or `None` when only the usage was asked for.
fn parse_args() -> Result<Option<Args>> {
    let mut a = Args {
        listen: "127.0.0.1:0".into(),
        socket: "/run/governor/governor.sock".into(),
        keyspaces: vec![101, 102, 103, 900],
        rows: 32_768,
        chunk_blocks: 2,
        workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
        worker_slice_us: 100,
        levels: true,
        pin_workers: Pin::Off,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--listen" => a.listen = value()?,
            "--socket" => a.socket = value()?,
            "--keyspaces" => {
                a.keyspaces =
                    value()?.split(',').map(|k| k.trim().parse().context("--keyspaces")).collect::<Result<_>>()?
            }
            "--rows" => a.rows = value()?.parse().context("--rows")?,
            "--chunk-blocks" => a.chunk_blocks = value()?.parse().context("--chunk-blocks")?,
            "--workers" => a.workers = value()?.parse().context("--workers")?,
            "--worker-slice-us" => a.worker_slice_us = value()?.parse().context("--worker-slice-us")?,
            "--levels" => a.levels = on_off(&flag, &value()?)?,
            "--pin-workers" => {
                a.pin_workers = match value()?.as_str() {
                    "on" => Pin::On,
                    "off" => Pin::Off,
                    "auto" => Pin::Auto,
                    v => bail!("{flag} takes on, off or auto, not {v:?}"),
                }
            }
            "--help" | "-h" => return Ok(None),
            other => bail!("unknown argument {other:?}"),
        }
    }
    if a.rows == 0 || a.workers == 0 || a.chunk_blocks == 0 || a.keyspaces.is_empty() {
        bail!("--rows, --workers, --chunk-blocks and --keyspaces must not be zero or empty");
    }
    Ok(Some(a))
}

fn on_off(flag: &str, v: &str) -> Result<bool> {
    match v {
        "on" => Ok(true),
        "off" => Ok(false),
        v => bail!("{flag} takes on or off, not {v:?}"),
    }
}

/// Lines of the governor client's log (re-attachment, fail-open) on stderr.
struct StderrLog;

impl log::Log for StderrLog {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::Level::Info
    }
    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            eprintln!("reader-server: {} {}: {}", r.level(), r.target(), r.args());
        }
    }
    fn flush(&self) {}
}

static SERVER: OnceLock<Server> = OnceLock::new();

fn main() -> Result<()> {
    let args = match parse_args() {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{USAGE}");
            return Ok(());
        }
        Err(e) => {
            eprintln!("reader-server: {e:#}\n{USAGE}");
            std::process::exit(2);
        }
    };
    let _ = log::set_logger(&StderrLog).map(|()| log::set_max_level(log::LevelFilter::Info));
    let t0 = Instant::now();
    let data = args
        .keyspaces
        .iter()
        .map(|&k| (k, KeyspaceData::generate(k, args.rows)))
        .collect::<std::collections::BTreeMap<_, _>>();
    for ks in data.values() {
        eprintln!(
            "reader-server: keyspace {}: {} rows in {} blocks ({:.1} MiB, {:.1} MiB stored)",
            ks.id,
            ks.rows,
            ks.blocks(),
            ks.raw_bytes as f64 / (1 << 20) as f64,
            ks.stored_bytes() as f64 / (1 << 20) as f64
        );
    }
    eprintln!("reader-server: data generated in {:.2?}", t0.elapsed());
    let sample = data.values().next().context("no keyspace")?;
    let costs = CostModel::measure(sample, 2000, keyspace_governor::client::thread_cputime_ns)
        .context("measuring the cost model")?;
    eprintln!("reader-server: a point get costs {:.1} µs, a scanned block {:.1} µs", costs.get_us, costs.scan_block_us);
    let client = Client::connect(&args.socket)
        .with_context(|| format!("connecting to the governor agent at {}", args.socket))?;
    let spread = (args.pin_workers != Pin::Off)
        .then(keyspace_governor::client::CpuSpread::new)
        .transpose()
        .context("reading the CPUs this process may use")?;
    let watched = spread.clone().filter(|_| args.pin_workers == Pin::Auto);
    if let Some(spread) = &watched {
        spread.watch_other_processes().context("watching what other processes take of this process's CPUs")?;
    }
    let server = SERVER.get_or_init(|| Server {
        client,
        stats: stats::Stats::new(data.keys().copied()),
        data,
        chunk_blocks: args.chunk_blocks,
        costs,
        estimate_margin: 1.25,
        workers: args.workers,
        levels: serve::Levels::new(args.levels, std::time::Duration::from_millis(2)),
        spread: watched,
    });
    let slice = std::time::Duration::from_micros(args.worker_slice_us);
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(spread) = &spread {
        builder.on_thread_park(spread.pin_on_park());
    }
    let rt = builder
        .worker_threads(args.workers)
        .enable_all()
        .on_thread_start(move || {
            if !slice.is_zero()
                && let Err(e) = keyspace_governor::client::set_thread_slice(slice)
            {
                log::warn!("asking the kernel for a {slice:?} scheduler slice: {e}");
            }
            let server = SERVER.get().expect("set before the runtime starts");
            if let Err(e) = server.client.register_current_thread() {
                log::warn!("registering a runtime thread with the governor agent: {e}");
            }
        })
        .build()
        .context("building the tokio runtime")?;
    rt.block_on(async {
        let listener =
            tokio::net::TcpListener::bind(&args.listen).await.with_context(|| format!("binding {}", args.listen))?;
        let addr = listener.local_addr()?;
        println!("listening {addr}");
        std::io::stdout().flush()?;
        eprintln!(
            "reader-server: {} workers (scheduler slice {}, {}), {} keyspaces, listening on {addr}",
            args.workers,
            if slice.is_zero() { "the kernel's default".to_string() } else { format!("{slice:?}") },
            spread.as_ref().map_or("not pinned".into(), |s| format!(
                "one each on CPUs {:?}{}",
                s.cpus(),
                if server.spread.is_some() { ", all of them while other processes take half a core" } else { "" }
            )),
            server.data.len()
        );
        serve::run(server, listener, shutdown_signal()).await;
        anyhow::Ok(())
    })?;
    let s = server.stats_now();
    eprintln!("reader-server: stopped; {}", serde_json::to_string(&s)?);
    Ok(())
}

/// Completes on SIGINT or SIGTERM.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("installing the SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
