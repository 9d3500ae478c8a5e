//! `governor status`: the measurement backend, admission, and per-keyspace
//! CPU and tickets.

use super::CliError;
use crate::client;
use crate::config::ByteSize;
use crate::proto::{AdmissionStatus, Reply, Request, StatusReport};
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
    let waits = match s.wait_source.as_str() {
        "kernel" => "the kernel's sched_info, charged at each switch (exact)",
        "sampled" => "schedstat samples of registered threads (fallback backend)",
        "unavailable" => "not measured (this kernel keeps no sched_info)",
        other => other,
    };
    let _ = writeln!(out, "runq waits   {waits}");
    let pressure = if s.cpu_pressure {
        "counted per keyspace (share of time at least one of its threads waited)"
    } else {
        "not counted (agent.cpu-pressure = false, or no eBPF backend)"
    };
    let _ = writeln!(out, "pressure     {pressure}");
    let c = &s.server_cpu;
    let _ = writeln!(
        out,
        "cores        {} on the node; caps are fractions of {:.2} ({}: {})",
        s.logical_cores, c.cores, c.source, c.detail
    );
    for l in c.servers.iter().filter(|_| c.servers.len() > 1 || c.source == "config") {
        let pids: Vec<String> = l.pids.iter().map(u32::to_string).collect();
        let _ = writeln!(out, "  server     pid {}: {:.2} cores ({})", pids.join(","), l.cores, l.detail);
    }
    let _ = writeln!(out, "uptime       {:.1} s", s.uptime_seconds);
    let _ = writeln!(
        out,
        "threads      {} registered / {} slots ({} handed out, {} reclaimed, {} refused)",
        s.threads.registered, s.threads.capacity, s.threads.handed_out, s.threads.reclaimed, s.threads.exhausted
    );
    if !s.rules.is_empty() {
        // How their caps are held, or why they are not.
        let capped = s.rules.iter().filter(|r| r.cap_cores.is_some()).count();
        let how = match (capped, s.rule_enforcement.as_str()) {
            (_, e) if e.starts_with("unavailable") => format!("caps {e}"),
            (0, _) => "none capped".to_string(),
            (n, "") => format!("{n} capped"),
            (n, e) => format!("{n} capped by {e}"),
        };
        let _ = writeln!(out, "rules        {} in force; {how}", s.rules.len());
    }
    let _ = writeln!(out, "window       {:.1} s", s.window_seconds);
    let _ = writeln!(
        out,
        "metrics      {}",
        s.metrics_addr.as_deref().map_or("off".into(), |a| format!("http://{a}/metrics"))
    );
    let u = &s.config_updates;
    let _ = writeln!(
        out,
        "config       {}; {} changes accepted, {} refused since start",
        u.path.as_deref().map_or("the embedded default".into(), |p| format!("from {p}")),
        u.accepted,
        u.rejected
    );
    let a = &s.admission;
    let _ = writeln!(out, "admission    {}", admission_line(a));
    let g = &a.latency_guard;
    if g.enabled {
        let mut now = if g.suffering.is_empty() {
            "no keyspace under its fair share waits past it behind those above".to_string()
        } else {
            format!("keyspaces {:?} wait past it behind those above their share: lowering those", g.suffering)
        };
        if !g.waiting_elsewhere.is_empty() {
            now.push_str(&format!(
                "; keyspaces {:?} wait past it mostly behind no keyspace above its share (an idle CPU, tasks \
                 governor does not measure): nobody is lowered for them",
                g.waiting_elsewhere
            ));
        }
        let _ = writeln!(
            out,
            "latency      guard on, run-queue wait p99 target {} µs, floor {:.0}% of a refill; {now}",
            g.target_wait_p99_us,
            g.floor_ratio * 100.0
        );
    } else {
        let _ = writeln!(out, "latency      guard off (latency-guard.enabled = false)");
    }
    let g = &a.global;
    // With the throttle off the buckets keep their last state, and no
    // ticket draws on them.
    let throttle = a.enabled && a.throttle;
    if throttle {
        let _ = writeln!(
            out,
            "global       {} / {} µs available, refill {} µs, {} µs in flight, monitor ratio {:.1}% (of cores × max-read-cpu-ratio × window-size)",
            g.available_us,
            g.capacity_us,
            g.refill_us,
            g.inflight_us,
            a.global_ratio * 100.0
        );
    } else {
        let _ = writeln!(
            out,
            "global       no bucket holds anything (cpu-throttle off); monitor ratio {:.1}% (of cores × max-read-cpu-ratio × window-size)",
            a.global_ratio * 100.0
        );
    }
    let _ = writeln!(
        out,
        "tickets      {} granted, {} refused, {} waited, {} fail-open, {} reclaimed",
        a.granted, a.refused, a.waited, a.fail_open, a.reclaimed
    );
    let _ = writeln!(out, "cells        {} / {} keyspace cells in use", a.cells_in_use, a.cells);
    let o = &a.overflow;
    if !o.keyspaces.is_empty() || o.granted + o.refused > 0 {
        let held = o.bucket.as_ref().map_or("request limits only".to_string(), |b| {
            format!(
                "{} bucket, {} / {} µs available, refill {} µs",
                b.source, b.available_us, b.capacity_us, b.refill_us
            )
        });
        if o.keyspaces.is_empty() {
            // Over: say what it held, without the alarm.
            let _ = writeln!(
                out,
                "overflow     none in the last minute ({} cell requests refused since start; {} granted, {} refused \
                 through the overflow bucket)",
                o.cells_refused, o.granted, o.refused
            );
        } else {
            let uid = o.by_uid_quota.len();
            let raise = match (uid, o.keyspaces.len() - uid) {
                (0, _) => "raise agent.max-keyspaces".to_string(),
                (n, 0) => format!("all {n} refused by their uid's quota: raise agent.max-keyspaces-per-uid"),
                (n, _) => format!(
                    "{n} of them by their uid's quota: raise agent.max-keyspaces-per-uid and agent.max-keyspaces"
                ),
            };
            let _ = writeln!(
                out,
                "overflow     WARNING {} keyspaces without a cell in the last minute ({} cell requests refused; {raise}): \
                 held together, {held}; {} granted, {} refused",
                o.keyspaces.len(),
                o.cells_refused,
                o.granted,
                o.refused
            );
        }
    }
    out.push('\n');
    let _ = writeln!(
        out,
        "{:>12} {:>12} {:>8} {:>11} {:>8} {:>10} {:>23} {:>10} {:>9} {:>9}",
        "keyspace",
        "cpu seconds",
        "of CPU",
        "runq wait s",
        "pressure",
        "bucket",
        "available / capacity µs",
        "granted",
        "refused",
        "waited"
    );
    for k in &s.keyspaces {
        let (source, tokens) = match &k.bucket {
            Some(b) if throttle => (b.source.as_str(), format!("{} / {}", b.available_us, b.capacity_us)),
            _ => ("-", "-".to_string()),
        };
        // The share of the window at least one of its threads waited.
        let pressure = k.cpu_pressure_some.map_or_else(|| "-".to_string(), |p| format!("{:.1}%", p * 100.0));
        let _ = write!(
            out,
            "{:>12} {:>12.3} {:>7.1}% {:>11.3} {:>8} {:>10} {:>23} {:>10} {:>9} {:>9}",
            k.keyspace_id,
            k.cpu_seconds,
            k.window_ratio * 100.0,
            k.cpu_wait_seconds,
            pressure,
            source,
            tokens,
            k.granted,
            k.refused,
            k.waited
        );
        let _ = match &k.rule {
            Some(rule) => writeln!(out, "  rule {rule}"),
            None => writeln!(out),
        };
    }
    if let Some(pd) = &s.pd {
        let last = match pd.last_success_unix {
            Some(t) => {
                let now =
                    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
                format!("last answer {:.0} s ago", (now - t).max(0.0))
            }
            None => "never answered".into(),
        };
        let reach = if pd.reachable { "reachable" } else { "NOT reachable, quotas kept" };
        let _ = writeln!(
            out,
            "
pd           {} ({reach}, {last}, {} rounds)",
            pd.endpoints.join(", "),
            pd.rounds
        );
        let _ = writeln!(
            out,
            "{:>12} {:>20} {:>10} {:>14} {:>12} {:>6} {:>12}",
            "keyspace", "name", "state", "service limit", "quota µs", "404s", "last result"
        );
        for k in &pd.keyspaces {
            let _ = writeln!(
                out,
                "{:>12} {:>20} {:>10} {:>14} {:>12} {:>6} {:>12}",
                k.keyspace_id,
                k.name.as_deref().unwrap_or("?"),
                k.state.as_deref().unwrap_or("?"),
                k.service_limit.map_or("-".into(), |v| if v == 0.0 { "unlimited".into() } else { format!("{v}") }),
                k.quota_us.map_or("-".into(), |q| q.to_string()),
                k.consecutive_404,
                k.last_result
            );
        }
    }
    if !s.programs.is_empty() && s.programs.iter().all(|p| p.run_count == 0) {
        let _ = writeln!(
            out,
            "\nprograms     {} attached; run times need sysctl kernel.bpf_stats_enabled=1",
            s.programs.len()
        );
    } else if !s.programs.is_empty() {
        let _ = writeln!(out, "\n{:>18} {:>14} {:>12} {:>10}", "program", "run time ns", "runs", "ns/run");
        for p in &s.programs {
            let per = if p.run_count == 0 { 0.0 } else { p.run_time_ns as f64 / p.run_count as f64 };
            let _ = writeln!(out, "{:>18} {:>14} {:>12} {:>10.1}", p.name, p.run_time_ns, p.run_count, per);
        }
    }
    out
}

/// "cpu-throttle on, tenant cap 25% of the servers' CPU, concurrency monitor at
/// 16 in flight per tenant, writes up to 100MiB pending (30MiB per keyspace)".
fn admission_line(a: &AdmissionStatus) -> String {
    if !a.enabled {
        return "off (resource-control.enabled = false): everything admitted".into();
    }
    let mut parts = vec![if a.throttle { "cpu-throttle on" } else { "cpu-throttle off" }.to_string()];
    if a.throttle && a.tenant_max_cpu_ratio > 0.0 {
        parts.push(format!("tenant cap {:.1}% of the servers' CPU", a.tenant_max_cpu_ratio * 100.0));
    }
    parts.push(match (a.admission_mode.as_str(), a.max_concurrent_per_tenant) {
        ("disabled", _) | (_, 0) => format!("concurrency {}", a.admission_mode),
        (mode, n) => format!("concurrency {mode} at {n} in flight per tenant"),
    });
    parts.push(format!(
        "writes up to {} pending ({} per keyspace)",
        ByteSize(a.pending_write_threshold_bytes),
        ByteSize(a.keyspace_pending_write_threshold_bytes)
    ));
    parts.join(", ")
}
