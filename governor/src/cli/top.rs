//! `governor top`: per keyspace CPU and admission, refreshed like `top`.
//!
//! Each frame compares two status reports `--interval` apart: CPU is the
//! cores a keyspace used over that interval (what the kernel charged), its
//! run-queue wait how long its threads waited for a CPU in it (ms per
//! second: 1000 is one thread waiting all the time), the ticket counts are
//! what happened in it. In a terminal the screen is
//! redrawn in place; otherwise (a pipe, `--json`) frames follow each other.

use super::CliError;
use crate::proto::{KeyspaceStatus, StatusReport};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

/// What a frame is sorted by, largest first (`keyspace`: smallest id first).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SortKey {
    Cpu,
    Ratio,
    /// Run-queue wait over the interval.
    RunQueue,
    Fill,
    Debt,
    Waits,
    Refusals,
    Keyspace,
}

/// One keyspace over one interval.
#[derive(Debug, serde::Serialize)]
pub struct Row {
    pub keyspace_id: u32,
    /// Cores used over the interval.
    pub cpu_cores: f64,
    /// Share of the servers' CPU over the monitor window.
    pub window_ratio: f64,
    /// Run-queue wait of its threads over the interval, ms per second.
    pub cpu_wait_ms_per_s: f64,
    /// Bucket fill, % of capacity (none without a bucket).
    pub bucket_fill_pct: Option<f64>,
    pub bucket_source: Option<String>,
    pub debt_us: u64,
    pub granted: u64,
    pub waited: u64,
    pub refused: u64,
    /// The rule that measures it, if any.
    pub rule: Option<String>,
}

/// One frame.
#[derive(Debug, serde::Serialize)]
pub struct Frame {
    pub interval_seconds: f64,
    pub cores: u32,
    /// Cores used by every keyspace together over the interval.
    pub total_cores: f64,
    pub global_ratio: f64,
    /// Whether the buckets hold anything (`resource-control.enabled` and
    /// `cpu-throttle.enabled`); while not, rows carry no bucket.
    pub throttle: bool,
    pub rows: Vec<Row>,
}

fn frame(before: &StatusReport, after: &StatusReport, seconds: f64, sort: SortKey) -> Frame {
    let old: HashMap<u32, &KeyspaceStatus> = before.keyspaces.iter().map(|k| (k.keyspace_id, k)).collect();
    // With the throttle off a cell keeps its bucket as it was last; no
    // ticket draws on it, so it is not shown.
    let throttle = after.admission.enabled && after.admission.throttle;
    let mut rows: Vec<Row> = after
        .keyspaces
        .iter()
        .map(|k| {
            let o = old.get(&k.keyspace_id);
            let delta = |f: fn(&KeyspaceStatus) -> u64| f(k).saturating_sub(o.map_or(0, |o| f(o)));
            let cpu = (k.cpu_seconds - o.map_or(0.0, |o| o.cpu_seconds)).max(0.0) / seconds;
            let wait = (k.cpu_wait_seconds - o.map_or(0.0, |o| o.cpu_wait_seconds)).max(0.0) / seconds;
            let bucket = k.bucket.as_ref().filter(|_| throttle);
            Row {
                keyspace_id: k.keyspace_id,
                cpu_cores: cpu,
                window_ratio: k.window_ratio,
                cpu_wait_ms_per_s: wait * 1000.0,
                bucket_fill_pct: bucket
                    .filter(|b| b.capacity_us > 0)
                    .map(|b| b.available_us.max(0) as f64 / b.capacity_us as f64 * 100.0),
                bucket_source: bucket.map(|b| b.source.clone()),
                debt_us: bucket.map_or(0, |b| b.debt_us),
                granted: delta(|k| k.granted),
                waited: delta(|k| k.waited),
                refused: delta(|k| k.refused),
                rule: k.rule.clone(),
            }
        })
        .collect();
    let key = |r: &Row| -> f64 {
        match sort {
            SortKey::Cpu => r.cpu_cores,
            SortKey::Ratio => r.window_ratio,
            SortKey::RunQueue => r.cpu_wait_ms_per_s,
            SortKey::Fill => r.bucket_fill_pct.unwrap_or(-1.0),
            SortKey::Debt => r.debt_us as f64,
            SortKey::Waits => r.waited as f64,
            SortKey::Refusals => r.refused as f64,
            SortKey::Keyspace => -f64::from(r.keyspace_id),
        }
    };
    rows.sort_by(|a, b| key(b).total_cmp(&key(a)).then(a.keyspace_id.cmp(&b.keyspace_id)));
    Frame {
        interval_seconds: seconds,
        cores: after.logical_cores,
        total_cores: rows.iter().map(|r| r.cpu_cores).sum(),
        global_ratio: after.admission.global_ratio,
        throttle,
        rows,
    }
}

pub fn render(f: &Frame, limit: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "governor top — {:.2} of {} cores used by keyspaces over the last {:.1} s; monitor ratio {:.1} %{}",
        f.total_cores,
        f.cores,
        f.interval_seconds,
        f.global_ratio * 100.0,
        if f.throttle { "" } else { "; cpu-throttle off: no bucket holds anything" }
    );
    let _ = writeln!(
        out,
        "{:>10} {:>8} {:>8} {:>9} {:>11} {:>10} {:>9} {:>8} {:>8}  RULE",
        "KEYSPACE", "CORES", "WINDOW%", "RUNQ ms/s", "BUCKET", "FILL%", "DEBT µs", "WAITS", "REFUSED"
    );
    for r in f.rows.iter().take(limit) {
        let fill = r.bucket_fill_pct.map_or("-".to_string(), |p| format!("{p:.0}"));
        let _ = writeln!(
            out,
            "{:>10} {:>8.3} {:>8.1} {:>9.1} {:>11} {:>10} {:>9} {:>8} {:>8}  {}",
            r.keyspace_id,
            r.cpu_cores,
            r.window_ratio * 100.0,
            r.cpu_wait_ms_per_s,
            r.bucket_source.as_deref().unwrap_or("-"),
            fill,
            r.debt_us,
            r.waited,
            r.refused,
            r.rule.as_deref().unwrap_or("")
        );
    }
    if f.rows.len() > limit {
        let _ = writeln!(out, "… {} more keyspaces (--limit)", f.rows.len() - limit);
    }
    out
}

/// Options of a `top` run.
pub struct Options {
    pub interval: Duration,
    /// Frames to print; `None`: until interrupted.
    pub iterations: Option<u64>,
    pub sort: SortKey,
    pub limit: usize,
    pub json: bool,
}

/// Prints frames with `emit` until done (or the agent goes away).
pub fn run(socket: &Path, o: &Options, mut emit: impl FnMut(&str)) -> Result<(), CliError> {
    let tty = std::io::IsTerminal::is_terminal(&std::io::stdout()) && !o.json;
    let mut before = super::status::run(socket)?;
    let mut at = Instant::now();
    let mut n = 0;
    while o.iterations.is_none_or(|max| n < max) {
        std::thread::sleep(o.interval);
        let after = super::status::run(socket)?;
        let now = Instant::now();
        // The agent's own read times when it gives them (an agent busy for a
        // moment answers late, not wrong).
        let seconds = match (before.counters_read_at_ns, after.counters_read_at_ns) {
            (b, a) if b > 0 && a > b => (a - b) as f64 / 1e9,
            _ => now.duration_since(at).as_secs_f64(),
        };
        let mut f = frame(&before, &after, seconds, o.sort);
        let body = if o.json {
            // The same rows the table shows.
            f.rows.truncate(o.limit);
            serde_json::to_string(&f).expect("frames serialize") + "\n"
        } else if tty {
            // Home, draw, clear what the last frame left below.
            format!("\x1b[H{}\x1b[J", render(&f, o.limit))
        } else {
            render(&f, o.limit) + "\n"
        };
        if n == 0 && tty {
            emit("\x1b[2J");
        }
        emit(&body);
        (before, at) = (after, now);
        n += 1;
    }
    Ok(())
}
