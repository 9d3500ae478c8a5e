//! `governor keyspace ID`: one keyspace explained from the agent's status:
//! where its quota comes from, its bucket, debt and estimate, and why it is
//! or is not being throttled right now.

use super::CliError;
use crate::config::ByteSize;
use crate::proto::{KeyspaceStatus, StatusReport};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;

#[derive(Debug, Serialize)]
pub struct Explanation {
    pub keyspace: KeyspaceStatus,
    /// `tenant_cap`, `config`, `pd`, or `none` (only the global bucket).
    pub quota_source: String,
    /// Whether a request of this keyspace would wait (or be refused) now.
    pub throttled_now: bool,
    /// Why, in the order an operator reads it.
    pub why: Vec<String>,
    /// Cores the kernel holds its processes to, when a rule measures it
    /// and caps it (its cgroup's bandwidth; the buckets admit tickets only).
    pub kernel_cap_cores: Option<f64>,
    /// Of those processes, the ones the cap does not hold (they could not
    /// be moved into its cgroup).
    pub processes_not_capped: u64,
}

pub fn run(socket: &Path, id: u32) -> Result<Explanation, CliError> {
    let status = super::status::run(socket)?;
    explain(&status, id)
}

/// PD's name and service limit for `id`, and the sum of positive limits.
fn pd_row(s: &StatusReport, id: u32) -> Option<(String, f64, f64)> {
    let pd = s.pd.as_ref()?;
    let k = pd.keyspaces.iter().find(|k| k.keyspace_id == id)?;
    let total = pd.keyspaces.iter().filter_map(|k| k.service_limit).filter(|v| *v > 0.0).sum();
    Some((k.name.clone().unwrap_or_default(), k.service_limit?, total))
}

/// The explanation of keyspace `id` in `s`.
pub fn explain(s: &StatusReport, id: u32) -> Result<Explanation, CliError> {
    let Some(k) = s.keyspaces.iter().find(|k| k.keyspace_id == id).cloned() else {
        let o = &s.admission.overflow;
        if o.keyspaces.contains(&id) {
            let why = if o.by_uid_quota.contains(&id) {
                "its server's uid holds its quota of cells (agent.max-keyspaces-per-uid, half the table by default)"
            } else {
                "the keyspace table is full (agent.max-keyspaces)"
            };
            return Err(CliError::Agent {
                message: format!(
                    "keyspace {id} has no cell of its own: {why}, with {} of {} cells live; its requests share the overflow bucket with {} other keyspaces (`governor status`, overflow line)",
                    s.admission.cells_in_use,
                    s.admission.cells,
                    o.keyspaces.len() - 1
                ),
            });
        }
        return Err(CliError::Agent {
            message: format!(
                "keyspace {id} is not known: no thread tagged it and no request asked for it since its cell was last evicted ({} keyspaces live)",
                s.keyspaces.len()
            ),
        });
    };
    let a = &s.admission;
    let mut why = Vec::new();
    let source = k.bucket.as_ref().map_or("none".to_string(), |b| b.source.clone());
    let mut throttled = false;
    if !a.enabled {
        why.push("resource-control.enabled = false: every request is admitted, nothing is throttled".into());
    } else if !a.throttle {
        why.push("cpu-throttle is off: the agent measures this keyspace but throttles nothing".into());
    } else {
        match source.as_str() {
            "tenant_cap" => why.push(format!(
                "its quota is the uniform tenant cap: tenant-max-cpu-ratio {} = {:.2} cores of the servers' {:.2} ({})",
                a.tenant_max_cpu_ratio,
                a.tenant_max_cpu_ratio * s.server_cpu.cores,
                s.server_cpu.cores,
                s.server_cpu.detail
            )),
            "config" => why.push("its quota is configured (resource-control.cpu-throttle.keyspace-cpu-quotas)".into()),
            "pd" => why.push(match pd_row(s, id) {
                Some((name, limit, total)) => format!(
                    "its quota comes from PD: keyspace {name:?} has service_limit {limit} RU/s of {total} among the keyspaces PD limits, so that share of the global refill"
                ),
                None => "its quota comes from PD's service limit for the keyspace".into(),
            }),
            "none" if pd_row(s, id).is_some_and(|(_, limit, _)| limit == 0.0) => {
                why.push("PD's service_limit for it is 0 (unlimited): no bucket of its own, only the node's global bucket limits it".into())
            }
            "none" => why.push("it has no bucket of its own (no tenant cap, no configured or PD quota): only the node's global bucket limits it".into()),
            other => why.push(format!("its bucket's quota source is {other}")),
        }
        if let Some(b) = &k.bucket {
            if b.available_us <= 0 || b.debt_us > 0 {
                throttled = true;
                why.push(format!(
                    "throttled now: its bucket is empty ({} µs available of {} µs, {} µs of debt to repay); requests wait for the next refill of {} µs",
                    b.available_us, b.capacity_us, b.debt_us, b.refill_us
                ));
            } else {
                why.push(format!(
                    "admitting now: {} µs available of {} µs, {} µs out (held by running tickets, or kept spare by the threads that served it, for their next request), refilled by {} µs per refill interval",
                    b.available_us, b.capacity_us, b.inflight_us, b.refill_us
                ));
            }
        }
        if a.global.available_us <= 0 {
            throttled = true;
            why.push(format!(
                "the node's global bucket is empty ({} µs available of {} µs): every keyspace waits for its refill",
                a.global.available_us, a.global.capacity_us
            ));
        }
    }
    // A keyspace measured by rule that took no ticket has no requests to
    // estimate.
    let estimate = if k.rule.is_some() && k.granted == 0 {
        String::new()
    } else {
        format!("; each request asks for about {} µs (its estimate)", k.estimate_us)
    };
    why.push(format!(
        "it used {:.2} % of the servers' CPU over the monitor window ({:.3} CPU seconds in all){estimate}",
        k.window_ratio * 100.0,
        k.cpu_seconds,
    ));
    why.push(match (k.cpu_wait_p50_us, k.cpu_wait_p99_us) {
        (Some(p50), Some(p99)) => format!(
            "its threads waited {:.3} s for a CPU in all ({} waits, run-queue time the kernel counted); \
             over the monitor window one wait took {p50:.1} µs at p50, {p99:.1} µs at p99",
            k.cpu_wait_seconds, k.cpu_waits
        ),
        _ => format!(
            "its threads waited {:.3} s for a CPU in all ({} waits); none over the monitor window",
            k.cpu_wait_seconds, k.cpu_waits
        ),
    });
    if let Some(share) = k.cpu_pressure_some {
        why.push(format!(
            "at least one of its threads waited for a CPU during {:.1} % of the monitor window (its CPU pressure, PSI's \"some\"; {:.3} s in all)",
            share * 100.0,
            k.cpu_pressure_some_seconds
        ));
    }
    // A rule keyspace's processes take no tickets: a cap holds them in the
    // kernel, through their cgroup's CPU bandwidth.
    let rule = k.rule.as_deref().and_then(|name| s.rules.iter().find(|r| r.name == name));
    let kernel_cap_cores = rule.and_then(|r| r.cap_cores);
    if let (Some(r), Some(cap)) = (rule, kernel_cap_cores) {
        why.push(format!(
            "its processes (rule {}) are held to {cap:.2} cores by the kernel: the agent's cgroup for the keyspace gives them that much CPU per bandwidth period (resource-control.rule-cpu-period), and the kernel stops them for the rest of the period once they ran it; the bucket above admits tickets only",
            r.name
        ));
        if r.processes_not_capped > 0 {
            not_held_note(&mut why, r);
        }
        if let Some(f) = r.outside_factor {
            why.push(format!(
                "its processes ran past the cap outside the cgroup (programs that start and end within a few ms, before the agent has moved them in; its charge counts them wherever they ran): the cgroup's cap is lowered to {:.0} % of it to make up, and given back as they stop",
                f * 100.0
            ));
        }
        if let Some(f) = r.guard_factor {
            why.push(format!(
                "the latency guard holds its CPU weight at {:.0} % of the configured one, and the cap (above, as in force) follows within a second, while keyspaces under their share wait for a CPU past its target behind this one; it gives both back as they meet the target",
                f * 100.0
            ));
        }
        why.push(
            "time its processes spent stopped by that cap counts as run-queue wait (above), behind \"an idle CPU\" when the CPU had nothing else to run".into(),
        );
    }
    if let Some(behind) = behind_line(&k.cpu_wait_behind) {
        why.push(behind);
    }
    let paced = if k.topups_waited == 0 {
        String::new()
    } else {
        format!("; running ones waited {} times at checkpoints for a top-up (paced)", k.topups_waited)
    };
    why.push(format!(
        "tickets since its cell was created: {} granted, {} waited in line before admission, {} refused; {} in flight{paced}",
        k.granted, k.waited, k.refused, k.inflight_requests
    ));
    if k.refused_global > 0 {
        why.push(format!(
            "{} of its refusals were the node's global bucket's (global_exhausted), not its own: every keyspace's admissions share that bucket, so a tenant near the read budget (max-read-cpu-ratio) holds the others back (`governor status`, global line)",
            k.refused_global
        ));
    }
    // A keyspace measured by rule that took no ticket meets no limit.
    if a.enabled && !(k.rule.is_some() && k.granted == 0) {
        why.push(limits_line(a, &k));
    }
    let processes_not_capped = rule.map_or(0, |r| r.processes_not_capped);
    Ok(Explanation {
        keyspace: k,
        quota_source: source,
        throttled_now: throttled,
        why,
        kernel_cap_cores,
        processes_not_capped,
    })
}

/// A rule cap that does not hold some of the keyspace's processes.
fn not_held_note(why: &mut Vec<String>, r: &crate::proto::RuleStatus) {
    why.push(format!(
        "but {} of its processes could not be moved into that cgroup ({}): the kernel does not hold them, and they run uncapped",
        r.processes_not_capped,
        r.not_capped_reason.as_deref().unwrap_or("refused")
    ));
}

/// Its requests in flight and pending write bytes against the limits that
/// refuse them (`too_many_requests`, `too_busy`).
fn limits_line(a: &crate::proto::AdmissionStatus, k: &KeyspaceStatus) -> String {
    let concurrency = match (a.admission_mode.as_str(), a.max_concurrent_per_tenant) {
        ("disabled", _) => "no limit on requests in flight (admission-control.mode = disabled)".to_string(),
        (_, 0) => "no limit on requests in flight (admission-control.max-concurrent-per-tenant = 0)".to_string(),
        (mode, limit) => format!(
            "at most {limit} requests in flight (admission-control.max-concurrent-per-tenant; {})",
            if mode == "enforced" { "refused past it" } else { "monitor mode: counted past it, admitted" }
        ),
    };
    format!(
        "{concurrency}; {} of writes pending of at most {} per keyspace, {} of {} on the node (write-quota.pending-write-threshold; a write is refused once either is reached)",
        ByteSize(k.pending_write_bytes),
        ByteSize(a.keyspace_pending_write_threshold_bytes),
        ByteSize(a.global_pending_write_bytes),
        ByteSize(a.pending_write_threshold_bytes)
    )
}

/// What the keyspace's waits over the window were behind, the three
/// largest with their shares (none: no wait, or no kernel count).
fn behind_line(behind: &[crate::proto::WaitBehind]) -> Option<String> {
    let total: f64 = behind.iter().map(|b| b.seconds).sum();
    if total <= 0.0 {
        return None;
    }
    // The three largest, of which those above half a percent (the first
    // always).
    let parts: Vec<String> = behind
        .iter()
        .take(3)
        .enumerate()
        .filter(|(i, b)| *i == 0 || b.seconds / total >= 0.005)
        .map(|(_, b)| format!("{} {:.0} %", b.whom(), b.seconds / total * 100.0))
        .collect();
    Some(format!(
        "over the monitor window its threads waited behind (what held the CPU each got when its wait ended): {}",
        parts.join(", ")
    ))
}

pub fn render(e: &Explanation) -> String {
    let mut out = String::new();
    let _ = match e.kernel_cap_cores {
        Some(cap) if e.processes_not_capped > 0 => writeln!(
            out,
            "keyspace {}: capped at {cap:.2} cores by a rule's cgroup, but {} of its processes run outside it, uncapped",
            e.keyspace.keyspace_id, e.processes_not_capped
        ),
        Some(cap) => writeln!(
            out,
            "keyspace {}: held by the kernel to {cap:.2} cores (a rule's cgroup); its tickets {}",
            e.keyspace.keyspace_id,
            if e.throttled_now { "are throttled now" } else { "are not throttled now" }
        ),
        None => writeln!(
            out,
            "keyspace {}: {}",
            e.keyspace.keyspace_id,
            if e.throttled_now { "throttled now" } else { "not throttled now" }
        ),
    };
    for w in &e.why {
        let _ = writeln!(out, "  - {w}");
    }
    out
}
