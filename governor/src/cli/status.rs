//! `governor status`: the measurement backend and per-keyspace CPU.

use super::CliError;
use crate::client;
use crate::proto::{Reply, Request, StatusReport};
use std::fmt::Write as _;
use std::path::Path;

pub fn run(socket: &Path) -> Result<StatusReport, CliError> {
    match client::request(socket, &Request::Status)? {
        Reply::Status(s) => Ok(*s),
        other => Err(CliError::Reply { detail: format!("{other:?}") }),
    }
}

/// Human-readable table.
pub fn render(s: &StatusReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "backend      {}", s.backend.as_str());
    let _ = writeln!(out, "thread clock {}", s.thread_clock_source);
    let _ = writeln!(out, "cores        {}", s.logical_cores);
    let _ = writeln!(out, "uptime       {:.1} s", s.uptime_seconds);
    let _ = writeln!(
        out,
        "threads      {} registered / {} slots ({} handed out, {} reclaimed, {} refused)",
        s.threads.registered, s.threads.capacity, s.threads.handed_out, s.threads.reclaimed, s.threads.exhausted
    );
    let _ = writeln!(out, "window       {:.1} s\n", s.window_seconds);
    let _ = writeln!(out, "{:>12} {:>14} {:>14}", "keyspace", "cpu seconds", "window ratio");
    for k in &s.keyspaces {
        let _ = writeln!(out, "{:>12} {:>14.3} {:>13.1}%", k.keyspace_id, k.cpu_seconds, k.window_ratio * 100.0);
    }
    if !s.programs.is_empty() {
        let _ = writeln!(out, "\n{:>18} {:>14} {:>12} {:>10}", "program", "run time ns", "runs", "ns/run");
        for p in &s.programs {
            let per = if p.run_count == 0 { 0.0 } else { p.run_time_ns as f64 / p.run_count as f64 };
            let _ = writeln!(out, "{:>18} {:>14} {:>12} {:>10.1}", p.name, p.run_time_ns, p.run_count, per);
        }
    }
    out
}
