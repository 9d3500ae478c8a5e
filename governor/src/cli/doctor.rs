//! `governor doctor`: what this node offers the agent, one line per check,
//! each `ok`, `warn` or `fail` with what to do about it.
//!
//! A `fail` means the eBPF backend cannot run here (the agent falls back to
//! the thread-clock backend under `--measure auto`, or refuses to start
//! under `--measure ebpf`); a `warn` means something works less well than it
//! could. Exit 0 without a `fail`, 1 with one.

use crate::measure::btf::Btf;
use crate::sys;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    Ok,
    Warn,
    Fail,
}

#[derive(Clone, Debug, Serialize)]
pub struct Check {
    pub check: &'static str,
    pub status: Level,
    pub detail: String,
    /// What to do, for `warn` and `fail`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub checks: Vec<Check>,
    /// True when no check failed: the eBPF backend can run here.
    pub ebpf_backend: bool,
}

impl Report {
    pub fn failed(&self) -> bool {
        self.checks.iter().any(|c| c.status == Level::Fail)
    }
}

fn ok(check: &'static str, detail: impl Into<String>) -> Check {
    Check { check, status: Level::Ok, detail: detail.into(), fix: None }
}

fn warn(check: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
    Check { check, status: Level::Warn, detail: detail.into(), fix: Some(fix.into()) }
}

fn fail(check: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
    Check { check, status: Level::Fail, detail: detail.into(), fix: Some(fix.into()) }
}

fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

/// `(major, minor)` of a kernel release string such as `6.18.44-fc`.
pub fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut it = release.split(|c: char| !c.is_ascii_digit());
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

fn kernel() -> (Check, Option<(u32, u32)>) {
    let release = read("/proc/sys/kernel/osrelease").unwrap_or_default();
    let arch = std::env::consts::ARCH;
    match kernel_version(&release) {
        // tp_btf programs, BPF_F_MMAPABLE arrays, bpf_map_freeze: 5.5.
        Some(v) if v >= (5, 5) => (ok("kernel", format!("{release} on {arch}")), Some(v)),
        Some(v) => (
            fail(
                "kernel",
                format!("{release} on {arch}: the eBPF backend needs 5.5 or later (tp_btf, mmapable arrays)"),
                "run a newer kernel; until then the agent measures with the thread-clock backend",
            ),
            Some(v),
        ),
        None => (
            warn("kernel", format!("cannot read the kernel release ({release:?})"), "check /proc/sys/kernel/osrelease"),
            None,
        ),
    }
}

fn btf() -> Check {
    match Btf::from_sys_fs().and_then(|b| b.task_offsets()) {
        Ok(o) => ok(
            "btf",
            format!(
                "/sys/kernel/btf/vmlinux: task_struct pid @{}, __state @{}, se.sum_exec_runtime @{}, se.exec_start @{}",
                o.pid, o.state, o.sum_exec_runtime, o.exec_start
            ),
        ),
        Err(e) => fail(
            "btf",
            crate::error_chain(&e),
            "boot a kernel built with CONFIG_DEBUG_INFO_BTF=y (every major distribution's is)",
        ),
    }
}

fn capabilities() -> Check {
    match crate::measure::ebpf::check_capabilities() {
        Ok(()) => ok("capabilities", "CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN) are effective"),
        Err(e) => fail(
            "capabilities",
            e.to_string(),
            "run the agent as root, or with AmbientCapabilities=CAP_BPF CAP_PERFMON in its unit",
        ),
    }
}

fn memlock(v: Option<(u32, u32)>) -> Check {
    // Since 5.11 BPF memory is charged to the memory cgroup, not RLIMIT_MEMLOCK.
    if v.is_some_and(|v| v >= (5, 11)) {
        return ok("memlock", "BPF memory is charged to the memory cgroup (5.11+); RLIMIT_MEMLOCK does not apply");
    }
    match sys::memlock_limit() {
        Ok(c) if c == libc::RLIM_INFINITY || c >= 256 << 20 => ok("memlock", "RLIMIT_MEMLOCK is large enough"),
        Ok(c) => warn(
            "memlock",
            format!("RLIMIT_MEMLOCK is {} KiB; the agent raises it at start, which needs CAP_SYS_RESOURCE", c / 1024),
            "grant CAP_SYS_RESOURCE, or set LimitMEMLOCK=infinity in the agent's unit",
        ),
        Err(e) => warn("memlock", format!("cannot read RLIMIT_MEMLOCK: {e}"), "check the agent's resource limits"),
    }
}

fn bpf_stats() -> Check {
    match read("/proc/sys/kernel/bpf_stats_enabled").as_deref() {
        Some("1") => ok("bpf-stats", "kernel.bpf_stats_enabled = 1: status and /metrics report the programs' run time"),
        Some(_) => warn(
            "bpf-stats",
            "kernel.bpf_stats_enabled = 0: the programs' run time reads 0 in status and /metrics",
            "sysctl -w kernel.bpf_stats_enabled=1 (it adds ~30 ns to every BPF program run)",
        ),
        None => warn("bpf-stats", "no kernel.bpf_stats_enabled", "a kernel before 5.1 has no BPF run-time statistics"),
    }
}

fn clocksource() -> Check {
    let source = read("/sys/devices/system/clocksource/clocksource0/current_clocksource").unwrap_or_default();
    if crate::tsc::usable() {
        ok(
            "clocksource",
            format!("{source} with constant_tsc and nonstop_tsc: threads read their clock from the TSC (~12 ns)"),
        )
    } else {
        warn(
            "clocksource",
            format!("{source:?}: threads read their clock through the vDSO (~30 ns) instead of the TSC"),
            "nothing to do for correctness; the TSC path needs clocksource tsc with constant_tsc and nonstop_tsc",
        )
    }
}

fn pid_max() -> Check {
    match crate::procs::pid_max() {
        Some(p) if p <= keyspace_governor_common::DEFAULT_MAX_TIDS => {
            ok("pid-max", format!("kernel.pid_max = {p}: the tid table is sized to it at start"))
        }
        Some(p) => fail(
            "pid-max",
            format!(
                "kernel.pid_max = {p} exceeds the tid table's {} entries",
                keyspace_governor_common::DEFAULT_MAX_TIDS
            ),
            format!("sysctl -w kernel.pid_max={}", keyspace_governor_common::DEFAULT_MAX_TIDS),
        ),
        None => warn("pid-max", "cannot read kernel.pid_max", "check /proc/sys/kernel/pid_max"),
    }
}

/// Where the cgroup hierarchies are and which one holds the cpu controller
/// (for holding unmodified readers to a cap).
fn cgroups() -> Check {
    // One reader of the mounts for doctor, rule validation and the caps.
    let mounts = crate::procs::cgroup_mounts();
    let v2 = mounts.iter().find(|m| m.v2).map(|m| m.dir.display().to_string());
    let v2_cpu = mounts.iter().any(|m| m.v2 && m.cpu);
    let v1_cpu = mounts.iter().find(|m| !m.v2).map(|m| m.dir.display().to_string());
    match (v2, v1_cpu) {
        (Some(p), _) if v2_cpu => ok("cgroups", format!("cgroup v2 at {p} with the cpu controller (cpu.max)")),
        (v2, Some(p)) => ok(
            "cgroups",
            format!(
                "hybrid: cpu controller on cgroup v1 at {p} (cpu.cfs_quota_us){}",
                v2.map(|v| format!("; cgroup v2 at {v} without it")).unwrap_or_default()
            ),
        ),
        (Some(p), None) => warn(
            "cgroups",
            format!("cgroup v2 at {p} without the cpu controller"),
            "enable it: echo +cpu > <parent>/cgroup.subtree_control",
        ),
        (None, None) => warn(
            "cgroups",
            "no cgroup hierarchy with a cpu controller",
            "mount cgroup v2 (or the v1 cpu controller) to cap unmodified processes",
        ),
    }
}

fn custom_slice(v: Option<(u32, u32)>) -> Check {
    if v.is_some_and(|v| v >= (6, 12)) {
        ok(
            "sched-slice",
            "EEVDF custom slices (6.12+): servers can bound how long one request holds a core (keyspace_governor::client::set_thread_slice)",
        )
    } else {
        warn(
            "sched-slice",
            "no custom scheduler slices before 6.12: a capped tenant's long requests can delay other tenants' wakeups by a default slice",
            "nothing governor can change; a kernel 6.12 or later lets servers shorten their workers' slice",
        )
    }
}

/// The running agent, and its keyspace table: keyspaces without a cell
/// are held together by the overflow bucket, a warning.
/// The number the caps are fractions of, and whether the servers can use it.
fn server_cpu(c: &crate::proto::ServerCpuStatus) -> Check {
    let what = format!(
        "caps are fractions of {:.2} cores ({}: {}); the node has {} CPUs, {} server cgroup limit(s) seen",
        c.cores,
        c.source,
        c.detail,
        c.node_cores,
        c.servers.len()
    );
    let detected: f64 = c.servers.iter().map(|l| l.cores).sum::<f64>().min(f64::from(c.node_cores));
    if c.source == "config" && !c.servers.is_empty() && c.cores > detected * 1.01 {
        warn(
            "server-cpu",
            format!(
                "{what}: more than the {detected:.2} cores the registered servers' cgroups allow, so caps bite late"
            ),
            "set resource-control.server-cpu-cores = 0 to follow the servers' cgroups, or to what they may use",
        )
    } else if c.source == "config" && c.cores > f64::from(c.node_cores) {
        warn("server-cpu", format!("{what}: more than the node has"), "set resource-control.server-cpu-cores = 0")
    } else {
        ok("server-cpu", what)
    }
}

fn agent(socket: &Path) -> Vec<Check> {
    match super::status::run(socket) {
        Ok(s) => {
            let a = &s.admission;
            let table = if a.overflow.keyspaces.is_empty() {
                ok("keyspace-table", format!("{} / {} keyspace cells in use; none overflowed", a.cells_in_use, a.cells))
            } else {
                warn(
                    "keyspace-table",
                    format!(
                        "{} keyspaces got no cell in the last minute ({} of them refused by their uid's quota; {} / {} \
                         cells in use): they share the overflow bucket, held together to the tenant limits",
                        a.overflow.keyspaces.len(),
                        a.overflow.by_uid_quota.len(),
                        a.cells_in_use,
                        a.cells
                    ),
                    "raise agent.max-keyspaces (restart), or agent.max-keyspaces-per-uid if one uid holds its quota",
                )
            };
            vec![
                ok(
                    "agent",
                    format!(
                        "answering at {}: backend {}, thread clock {}, up {:.0} s",
                        socket.display(),
                        s.backend.as_str(),
                        s.thread_clock_source,
                        s.uptime_seconds
                    ),
                ),
                table,
                server_cpu(&s.server_cpu),
                rule_caps(&s),
            ]
        }
        Err(e) => {
            let said = crate::error_chain(&e);
            let fix = if said.contains("did not answer within") {
                "it runs but does not answer: see whether it is stopped (ps -o stat) or stuck, and its log"
            } else {
                "start it: governor agent (as root, or with CAP_BPF and CAP_PERFMON)"
            };
            vec![warn("agent", said, fix)]
        }
    }
}

/// Whether the rule caps hold every process they cap.
fn rule_caps(s: &crate::proto::StatusReport) -> Check {
    let unheld: Vec<String> = s
        .rules
        .iter()
        .filter(|r| r.processes_not_capped > 0)
        .map(|r| {
            format!(
                "{} process(es) of rule {} ({})",
                r.processes_not_capped,
                r.name,
                r.not_capped_reason.as_deref().unwrap_or("refused")
            )
        })
        .collect();
    if s.rule_enforcement.starts_with("unavailable") && !s.rules.is_empty() {
        return warn(
            "rule-caps",
            format!("rules are in force, but their caps are not enforced: {}", s.rule_enforcement),
            "fix what it says, then restart the agent",
        );
    }
    if unheld.is_empty() {
        let how = if s.rule_enforcement.is_empty() { "no rule caps" } else { s.rule_enforcement.as_str() };
        return ok("rule-caps", how);
    }
    warn(
        "rule-caps",
        format!(
            "not held: {} could not be moved into their keyspace's cgroup; {}",
            unheld.join(", "),
            s.rule_enforcement
        ),
        "on cgroup v1 run the agent as root (euid 0) to cap other users' processes, or cap their own cgroup with cap-in-place",
    )
}

/// Runs every check.
pub fn run(socket: &Path) -> Report {
    let (k, version) = kernel();
    let mut checks = vec![
        k,
        btf(),
        capabilities(),
        memlock(version),
        pid_max(),
        bpf_stats(),
        clocksource(),
        cgroups(),
        custom_slice(version),
    ];
    checks.extend(agent(socket));
    let ebpf_backend = !checks.iter().any(|c| c.status == Level::Fail);
    Report { checks, ebpf_backend }
}

/// One line per check.
pub fn render(r: &Report) -> String {
    let mut out = String::new();
    for c in &r.checks {
        let level = match c.status {
            Level::Ok => "ok  ",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        };
        let _ = writeln!(out, "{level}  {:<14} {}", c.check, c.detail);
        if let Some(fix) = &c.fix {
            let _ = writeln!(out, "      {:<14} fix: {fix}", "");
        }
    }
    let _ = writeln!(
        out,
        "{}",
        if r.ebpf_backend {
            "the eBPF backend can run here"
        } else {
            "the eBPF backend cannot run here: the agent measures with the thread-clock backend (--measure auto)"
        }
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions_parse() {
        assert_eq!(kernel_version("6.18.44-fc-v669"), Some((6, 18)));
        assert_eq!(kernel_version("6.1.0-28-cloud-amd64"), Some((6, 1)));
        assert_eq!(kernel_version("5.4"), Some((5, 4)));
        assert_eq!(kernel_version("junk"), None);
    }
}
