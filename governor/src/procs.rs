//! What the agent and the CLI read from `/proc`, through `procfs`: threads
//! and their scheduler time, namespace pids, groups, names, parents and
//! children, cgroup membership and mounts, capabilities, `pid_max`.
//!
//! Every reader returns `None` or an empty list once the process is gone:
//! processes exit between any two reads, and that is never an error here.
//! These are blocking reads; the agent does them off its async runtime's
//! thread (its housekeeping thread, or `spawn_blocking`).

use procfs::process::Process;
use std::path::PathBuf;

fn process(pid: u32) -> Option<Process> {
    Process::new(i32::try_from(pid).ok()?).ok()
}

/// The threads of process `tgid`.
pub fn threads(tgid: u32) -> Vec<u32> {
    let Some(p) = process(tgid) else { return Vec::new() };
    let Ok(tasks) = p.tasks() else { return Vec::new() };
    tasks.flatten().filter_map(|t| u32::try_from(t.tid).ok()).collect()
}

/// On-CPU ns of `tid` of `tgid` as the scheduler counts it (the same
/// counter `CLOCK_THREAD_CPUTIME_ID` reads).
pub fn schedstat_ns(tgid: u32, tid: u32) -> Option<u64> {
    Some(schedstat(tgid, tid)?.0)
}

/// Thread `tid` of `tgid`'s schedstat: its on-CPU ns and its run-queue
/// wait ns (`sched_info.run_delay`), as the kernel counts them.
pub fn schedstat(tgid: u32, tid: u32) -> Option<(u64, u64)> {
    let task = process(tgid)?.task_from_tid(i32::try_from(tid).ok()?).ok()?;
    let s = task.schedstat().ok()?;
    Some((s.sum_exec_runtime, s.run_delay))
}

/// The pids of thread `tid` of `tgid` in each PID namespace it is in, the
/// host's first, its own last (`NSpid`).
pub fn nspid(tgid: u32, tid: u32) -> Option<Vec<u32>> {
    let task = process(tgid)?.task_from_tid(i32::try_from(tid).ok()?).ok()?;
    task.status().ok()?.nspid?.into_iter().map(|v| u32::try_from(v).ok()).collect()
}

/// The supplementary groups of process `pid`.
pub fn groups(pid: u32) -> Vec<u32> {
    process(pid)
        .and_then(|p| p.status().ok())
        .map(|s| s.groups.into_iter().filter_map(|g| u32::try_from(g).ok()).collect())
        .unwrap_or_default()
}

/// The name (`comm`) of process `pid`.
pub fn comm(pid: u32) -> Option<String> {
    Some(process(pid)?.stat().ok()?.comm)
}

/// The name of thread `tid` of `pid`.
pub fn thread_comm(pid: u32, tid: u32) -> Option<String> {
    Some(process(pid)?.task_from_tid(i32::try_from(tid).ok()?).ok()?.stat().ok()?.comm)
}

/// What rules match a process on.
pub struct Identity {
    pub comm: String,
    pub parent: u32,
    /// None for a kernel thread (it has no executable) or when unreadable.
    pub exe: Option<String>,
    pub uid: Option<u32>,
}

/// Name, parent, executable and effective uid of process `tgid`.
pub fn identity(tgid: u32) -> Option<Identity> {
    let p = process(tgid)?;
    let stat = p.stat().ok()?;
    Some(Identity {
        comm: stat.comm,
        parent: u32::try_from(stat.ppid).unwrap_or(0),
        exe: p.exe().ok().map(|e| e.display().to_string()),
        uid: p.status().ok().map(|s| s.euid),
    })
}

/// The parent of process `tgid`.
pub fn parent(tgid: u32) -> Option<u32> {
    u32::try_from(process(tgid)?.stat().ok()?.ppid).ok()
}

/// The child processes of `tgid` (every thread's children).
pub fn children(tgid: u32) -> Vec<u32> {
    let Some(p) = process(tgid) else { return Vec::new() };
    let Ok(tasks) = p.tasks() else { return Vec::new() };
    tasks.flatten().filter_map(|t| t.children().ok()).flatten().collect()
}

/// Every process now.
pub fn all_tgids() -> Vec<u32> {
    procfs::process::all_processes()
        .map(|all| all.flatten().filter_map(|p| u32::try_from(p.pid).ok()).collect())
        .unwrap_or_default()
}

/// `kernel.pid_max`.
pub fn pid_max() -> Option<u32> {
    procfs::sys::kernel::pid_max().ok().and_then(|v| u32::try_from(v).ok())
}

/// The effective capability set of this process.
pub fn effective_caps() -> std::io::Result<u64> {
    let me = Process::myself().map_err(std::io::Error::other)?;
    Ok(me.status().map_err(std::io::Error::other)?.capeff)
}

/// A mounted cgroup hierarchy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupMount {
    pub dir: PathBuf,
    /// cgroup2 (the unified hierarchy); else a v1 hierarchy.
    pub v2: bool,
    /// Offers the `cpu` controller (v2: listed in `cgroup.controllers`).
    pub cpu: bool,
}

/// The v2 hierarchy and every v1 hierarchy with the `cpu` controller.
pub fn cgroup_mounts() -> Vec<CgroupMount> {
    let Ok(mounts) = Process::myself().and_then(|me| me.mountinfo()) else { return Vec::new() };
    mounts
        .into_iter()
        .filter_map(|m| match m.fs_type.as_str() {
            "cgroup2" => {
                let controllers = std::fs::read_to_string(m.mount_point.join("cgroup.controllers")).unwrap_or_default();
                let cpu = controllers.split_whitespace().any(|c| c == "cpu");
                Some(CgroupMount { dir: m.mount_point, v2: true, cpu })
            }
            "cgroup" if m.super_options.contains_key("cpu") => {
                Some(CgroupMount { dir: m.mount_point, v2: false, cpu: true })
            }
            _ => None,
        })
        .collect()
}

/// The cgroup paths of process `pid`: the v2 one and the v1 `cpu` one,
/// where present, as (v2, path).
pub fn process_cgroups(pid: u32) -> Vec<(bool, String)> {
    let Some(groups) = process(pid).and_then(|p| p.cgroups().ok()) else { return Vec::new() };
    groups
        .into_iter()
        .filter_map(|g| {
            if g.hierarchy == 0 {
                Some((true, g.pathname))
            } else {
                g.controllers.iter().any(|c| c == "cpu").then_some((false, g.pathname))
            }
        })
        .collect()
}

/// The CPU time of process `tgid`, every thread it ran (exited ones too),
/// as the kernel keeps it in `/proc/<tgid>/stat` (utime + stime, clock
/// ticks: 10 ms at USER_HZ 100), in ns.
pub fn process_cpu_ns(tgid: u32) -> Option<u64> {
    let stat = process(tgid)?.stat().ok()?;
    let ticks = stat.utime.saturating_add(stat.stime);
    Some(ticks.saturating_mul(1_000_000_000) / procfs::ticks_per_second().max(1))
}

/// A mounted cgroup hierarchy and the controllers it offers (v2: those
/// listed in its `cgroup.controllers`; v1: those it was mounted with).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupHierarchy {
    pub dir: PathBuf,
    pub v2: bool,
    pub controllers: Vec<String>,
}

/// Every mounted cgroup hierarchy (the v2 one and each v1 one).
pub fn cgroup_hierarchies() -> Vec<CgroupHierarchy> {
    let Ok(mounts) = Process::myself().and_then(|me| me.mountinfo()) else { return Vec::new() };
    let mut out: Vec<CgroupHierarchy> = Vec::new();
    for m in mounts {
        let h = match m.fs_type.as_str() {
            "cgroup2" => {
                let controllers = std::fs::read_to_string(m.mount_point.join("cgroup.controllers")).unwrap_or_default();
                CgroupHierarchy {
                    dir: m.mount_point,
                    v2: true,
                    controllers: controllers.split_whitespace().map(str::to_string).collect(),
                }
            }
            "cgroup" => {
                let mut controllers: Vec<String> =
                    m.super_options.keys().filter(|k| !matches!(k.as_str(), "rw" | "ro")).cloned().collect();
                controllers.sort();
                CgroupHierarchy { dir: m.mount_point, v2: false, controllers }
            }
            _ => continue,
        };
        // A hierarchy mounted twice (bind mounts) is read once.
        if !out.iter().any(|o| o.v2 == h.v2 && o.controllers == h.controllers) {
            out.push(h);
        }
    }
    out
}

/// The cgroups of process `pid`, one per hierarchy, as (v2, the v1
/// hierarchy's controllers, path).
pub fn process_cgroup_paths(pid: u32) -> Vec<(bool, Vec<String>, String)> {
    let Some(groups) = process(pid).and_then(|p| p.cgroups().ok()) else { return Vec::new() };
    groups.into_iter().map(|g| (g.hierarchy == 0, g.controllers, g.pathname)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_reads_back() {
        let me = std::process::id();
        let tid = crate::sys::gettid();
        assert!(threads(me).contains(&me));
        assert_eq!(nspid(me, tid).and_then(|v| v.first().copied()), Some(tid));
        // 30 ms of this thread's CPU (by its own clock, however long the
        // other tests keep it off a core): schedstat shows it, less at most
        // the running slice it has not been brought up to date for (a
        // scheduler tick, 10 ms at HZ=100).
        let (before, cpu0) = (schedstat_ns(me, tid).unwrap(), crate::sys::thread_cputime_ns());
        while crate::sys::thread_cputime_ns() - cpu0 < 30_000_000 {}
        let (spun, cpu) = (schedstat_ns(me, tid).unwrap() - before, crate::sys::thread_cputime_ns() - cpu0);
        assert!(
            (cpu - 11_000_000..=cpu + 11_000_000).contains(&spun),
            "schedstat {spun} ns for {cpu} ns of the thread's CPU"
        );
        let id = identity(me).unwrap();
        assert_eq!(id.parent, parent(me).unwrap());
        assert_eq!(id.uid, Some(crate::sys::effective_uid()));
        assert!(id.exe.is_some());
        assert_eq!(comm(me), Some(id.comm));
        assert!(all_tgids().contains(&me) && all_tgids().contains(&1));
        assert!(pid_max().is_some_and(|p| p >= 301));
        assert!(threads(u32::MAX).is_empty() && identity(u32::MAX).is_none());
    }
}
