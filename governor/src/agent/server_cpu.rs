//! The CPU the storage servers may use: the number every cap is a fraction
//! of. `max-read-cpu-ratio` sizes the node budget from it and the tenant cap
//! is `tenant-max-cpu-ratio` of it, as TiKV sizes both from its own cgroup
//! limit (SysQuota) rather than from the node.
//!
//! A server is a process that registered a thread. Its limit is the
//! smallest of its CFS bandwidth quota along its cgroup's path up to the
//! root (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`),
//! the CPUs of its cpuset (v2 `cpuset.cpus.effective`, v1
//! `cpuset.effective_cpus`) and the node's online CPUs. With several
//! servers, a limit that binds several of them (one cgroup, or an ancestor
//! they share) counts once and distinct limits add up, never past the node:
//! the buckets are the node's, shared by every server attached. No server
//! registered, or none limited: the node's online CPUs.
//! `resource-control.server-cpu-cores` set above 0 replaces all of it.
//!
//! Read when a server registers its first thread and when it goes, and
//! again every second (an operator or Kubernetes may resize the cgroup); a
//! change resizes the buckets, the tenant caps and the rule caps at once,
//! and is logged.
//!
//! The servers' CPU is also what the monitor's global count is made of, as
//! the seed defines global CPU: every thread of a server, tagged or not
//! (gRPC, raft, compaction, threads never registered). Their tagged CPU is
//! in the keyspaces' counts already; what they ran beyond it
//! ([`ServerCpu::ran_since_last`], `/proc/<pid>/stat`) is added untagged
//! (`agent::usage`).

use super::Shared;
use crate::policy::Settings;
use crate::proto::{ServerCpuStatus, ServerLimitStatus};
use crate::ranked::RankedGuard;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};

/// Where a number of cores came from.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Origin {
    /// `resource-control.server-cpu-cores`.
    Config,
    /// The node's online CPUs.
    Node,
    /// A CFS bandwidth limit: its cgroup directory, the file and its values.
    Quota { dir: PathBuf, file: &'static str, quota_us: u64, period_us: u64 },
    /// A cpuset: its cgroup directory, the file and how many CPUs it lists.
    Cpuset { dir: PathBuf, file: &'static str, cpus: u32 },
    /// The sum of this many distinct server limits.
    Servers(usize),
}

/// A number of cores and where it came from.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Limit {
    pub(crate) cores: f64,
    pub(crate) origin: Origin,
}

impl Limit {
    fn node(cpus: u32) -> Limit {
        Limit { cores: f64::from(cpus), origin: Origin::Node }
    }

    /// One word for the origin: `config`, `node`, `cpu-quota`, `cpuset` or
    /// `servers` (the metric's label).
    pub(crate) fn kind(&self) -> &'static str {
        match self.origin {
            Origin::Config => "config",
            Origin::Node => "node",
            Origin::Quota { .. } => "cpu-quota",
            Origin::Cpuset { .. } => "cpuset",
            Origin::Servers(_) => "servers",
        }
    }

    /// The origin as an operator reads it.
    pub(crate) fn describe(&self) -> String {
        match &self.origin {
            Origin::Config => "resource-control.server-cpu-cores".into(),
            Origin::Node => "the node's online CPUs".into(),
            Origin::Quota { dir, file, quota_us, period_us } => {
                format!("{}/{file}: quota {quota_us} µs per {period_us} µs", dir.display())
            }
            Origin::Cpuset { dir, file, cpus } => format!("{}/{file}: {cpus} CPUs", dir.display()),
            Origin::Servers(n) => format!("the sum of {n} server cgroups' limits"),
        }
    }

    /// What several servers bound by this limit share: its directory.
    fn binding(&self) -> String {
        match &self.origin {
            Origin::Quota { dir, file, .. } | Origin::Cpuset { dir, file, .. } => format!("{}/{file}", dir.display()),
            _ => "node".into(),
        }
    }
}

/// Process `tgid`'s cgroup in one hierarchy that has `cpu` or `cpuset`.
#[derive(Clone, Debug)]
pub(crate) struct Place {
    pub(crate) mount: PathBuf,
    pub(crate) rel: String,
    pub(crate) v2: bool,
    pub(crate) controllers: Vec<String>,
}

impl Place {
    fn has(&self, controller: &str) -> bool {
        self.controllers.iter().any(|c| c == controller)
    }
}

/// Where process `tgid` sits in every hierarchy offering `cpu` or `cpuset`.
pub(crate) fn places_of(tgid: u32) -> Vec<Place> {
    let hierarchies = crate::procs::cgroup_hierarchies();
    crate::procs::process_cgroup_paths(tgid)
        .into_iter()
        .filter_map(|(v2, controllers, rel)| {
            let h = hierarchies.iter().find(|h| {
                h.v2 == v2 && (v2 || (!controllers.is_empty() && controllers.iter().all(|c| h.controllers.contains(c))))
            })?;
            let place = Place { mount: h.dir.clone(), rel, v2, controllers: h.controllers.clone() };
            (place.has("cpu") || place.has("cpuset")).then_some(place)
        })
        .collect()
}

/// The CPUs in a kernel CPU list (`0-3,8,10-11`); `None` when malformed.
pub(crate) fn count_cpus(list: &str) -> Option<u32> {
    let list = list.trim();
    if list.is_empty() {
        return Some(0);
    }
    list.split(',').try_fold(0u32, |n, part| {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.trim().parse::<u32>().ok()?, b.trim().parse::<u32>().ok()?),
            None => {
                let c = part.trim().parse::<u32>().ok()?;
                (c, c)
            }
        };
        (hi >= lo).then(|| n + (hi - lo + 1))
    })
}

/// The node's online CPUs.
pub(crate) fn node_cpus() -> u32 {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|t| count_cpus(&t))
        .filter(|&n| n > 0)
        .unwrap_or_else(crate::sys::logical_cores)
}

/// The bandwidth limit written in `dir`, if any.
fn quota_at(dir: &Path, v2: bool) -> Option<Limit> {
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    let (file, quota_us, period_us) = if v2 {
        let text = read("cpu.max")?;
        let mut f = text.split_whitespace();
        let quota = f.next()?.parse::<u64>().ok()?; // "max": no limit
        ("cpu.max", quota, f.next().and_then(|p| p.parse().ok()).unwrap_or(100_000))
    } else {
        let quota = read("cpu.cfs_quota_us")?.trim().parse::<i64>().ok()?; // -1: no limit
        let period = read("cpu.cfs_period_us")?.trim().parse::<u64>().ok()?;
        ("cpu.cfs_quota_us", u64::try_from(quota).ok()?, period)
    };
    (quota_us > 0 && period_us > 0).then(|| Limit {
        cores: quota_us as f64 / period_us as f64,
        origin: Origin::Quota { dir: dir.to_path_buf(), file, quota_us, period_us },
    })
}

/// The cpuset of `dir`, if it lists any CPU.
fn cpuset_at(dir: &Path, v2: bool) -> Option<Limit> {
    let files: &[&'static str] =
        if v2 { &["cpuset.cpus.effective"] } else { &["cpuset.effective_cpus", "cpuset.cpus"] };
    files.iter().find_map(|&file| {
        let cpus = count_cpus(&std::fs::read_to_string(dir.join(file)).ok()?)?;
        (cpus > 0)
            .then(|| Limit { cores: f64::from(cpus), origin: Origin::Cpuset { dir: dir.to_path_buf(), file, cpus } })
    })
}

/// The limit of a process found in `places`, on a node of `node` CPUs: the
/// smallest quota from its cgroup up to the hierarchy's root, its cpuset,
/// and the node; nothing read under `skip` (the cgroups the agent writes).
pub(crate) fn limit_in(places: &[Place], node: u32, skip: &[PathBuf]) -> Limit {
    let mut best = Limit::node(node);
    let mut take = |l: Option<Limit>| {
        if let Some(l) = l
            && l.cores < best.cores
            && !matches!(&l.origin, Origin::Quota { dir, .. } | Origin::Cpuset { dir, .. } if skip.iter().any(|s| dir.starts_with(s)))
        {
            best = l;
        }
    };
    for p in places {
        let leaf = p.mount.join(p.rel.trim_start_matches('/'));
        if p.has("cpu") {
            let mut dir = leaf.clone();
            while dir.starts_with(&p.mount) {
                take(quota_at(&dir, p.v2));
                if dir == p.mount || !dir.pop() {
                    break;
                }
            }
        }
        if p.has("cpuset") {
            take(cpuset_at(&leaf, p.v2));
        }
    }
    best
}

/// The servers attached, their limits, and the number in force.
pub(crate) struct ServerCpu {
    node: u32,
    /// `resource-control.server-cpu-cores` when above 0.
    configured: Option<f64>,
    /// Each server process → the connections it registered threads on.
    servers: BTreeMap<u32, BTreeSet<u64>>,
    /// The last reading of each server's limit.
    limits: BTreeMap<u32, Limit>,
    current: Limit,
    /// The cgroups the agent writes limits into (`cgroups::Enforcer::written_dirs`).
    skip: Vec<PathBuf>,
    /// Each server's CPU (every thread) at the last reading, ns.
    cpu_last: BTreeMap<u32, u64>,
}

/// The servers' CPU over one monitor sample, for the global count.
#[derive(Debug, Default)]
pub(crate) struct ServersRan {
    /// CPU the servers ran, every thread, ns.
    pub(crate) ns: u64,
    /// How many servers were read.
    pub(crate) servers: usize,
    /// Cells the rules charge: CPU charged to them is not the servers'.
    pub(crate) rule_cells: HashSet<u32>,
}

fn configured(key: f64) -> Option<f64> {
    (key > 0.0).then_some(key)
}

impl ServerCpu {
    pub(crate) fn new(server_cpu_cores: f64) -> ServerCpu {
        let node = node_cpus();
        let mut s = ServerCpu {
            node,
            configured: configured(server_cpu_cores),
            servers: BTreeMap::new(),
            limits: BTreeMap::new(),
            current: Limit::node(node),
            skip: Vec::new(),
            cpu_last: BTreeMap::new(),
        };
        s.current = s.combine(s.configured);
        s
    }

    /// The number in force.
    pub(crate) fn current(&self) -> &Limit {
        &self.current
    }

    /// The number a configuration with `server-cpu-cores = key` would use.
    pub(crate) fn cores_with(&self, key: f64) -> f64 {
        self.combine(configured(key)).cores
    }

    fn combine(&self, configured: Option<f64>) -> Limit {
        if let Some(cores) = configured {
            return Limit { cores, origin: Origin::Config };
        }
        let mut distinct: BTreeMap<String, &Limit> = BTreeMap::new();
        for l in self.limits.values() {
            distinct.insert(l.binding(), l);
        }
        let node = Limit::node(self.node);
        if distinct.is_empty() || distinct.values().any(|l| l.origin == Origin::Node) {
            return node;
        }
        if distinct.len() == 1 {
            return distinct.into_values().next().cloned().unwrap_or(node);
        }
        let sum: f64 = distinct.values().map(|l| l.cores).sum();
        if sum >= node.cores { node } else { Limit { cores: sum, origin: Origin::Servers(distinct.len()) } }
    }

    /// Puts the combined number in force; true when it changed.
    fn settle(&mut self) -> bool {
        let next = self.combine(self.configured);
        let changed = next != self.current;
        self.current = next;
        changed
    }

    pub(crate) fn set_configured(&mut self, key: f64) -> bool {
        self.configured = configured(key);
        self.settle()
    }

    /// Process `tgid` registered a thread on connection `conn`; `skip` the
    /// cgroups the agent writes now.
    pub(crate) fn attach(&mut self, tgid: u32, conn: u64, skip: Vec<PathBuf>) -> bool {
        self.skip = skip;
        let conns = self.servers.entry(tgid).or_default();
        conns.insert(conn);
        if !self.limits.contains_key(&tgid) {
            self.limits.insert(tgid, limit_in(&places_of(tgid), self.node, &self.skip));
        }
        // Its CPU counts from here on: before it registered, it was no server.
        if let std::collections::btree_map::Entry::Vacant(e) = self.cpu_last.entry(tgid) {
            e.insert(crate::procs::process_cpu_ns(tgid).unwrap_or(0));
        }
        self.settle()
    }

    /// Connection `conn` closed.
    pub(crate) fn detach(&mut self, conn: u64) -> bool {
        let mut gone = Vec::new();
        for (&tgid, conns) in &mut self.servers {
            if conns.remove(&conn) && conns.is_empty() {
                gone.push(tgid);
            }
        }
        if gone.is_empty() {
            return false;
        }
        for tgid in gone {
            self.servers.remove(&tgid);
            self.limits.remove(&tgid);
            self.cpu_last.remove(&tgid);
        }
        self.settle()
    }

    /// Reads every server's limit again.
    pub(crate) fn refresh(&mut self, skip: Vec<PathBuf>) -> bool {
        self.skip = skip;
        self.node = node_cpus();
        let (node, skip) = (self.node, &self.skip);
        self.limits = self.servers.keys().map(|&tgid| (tgid, limit_in(&places_of(tgid), node, skip))).collect();
        self.settle()
    }

    /// CPU the servers ran since the last call, every thread, ns, leaving
    /// out `exclude` (processes the rules charge: their CPU is in the rule
    /// keyspaces' counts); and how many servers were counted.
    pub(crate) fn ran_since_last(&mut self, exclude: &HashSet<u32>) -> (u64, usize) {
        let (mut ns, mut servers) = (0u64, 0usize);
        for (&tgid, last) in &mut self.cpu_last {
            let Some(now) = crate::procs::process_cpu_ns(tgid) else { continue };
            let ran = now.saturating_sub(*last);
            *last = now;
            if !exclude.contains(&tgid) {
                ns = ns.saturating_add(ran);
                servers += 1;
            }
        }
        (ns, servers)
    }

    pub(crate) fn status(&self) -> ServerCpuStatus {
        let c = &self.current;
        let mut by_binding: BTreeMap<String, ServerLimitStatus> = BTreeMap::new();
        for (&tgid, l) in &self.limits {
            let row = by_binding.entry(l.binding()).or_insert_with(|| ServerLimitStatus {
                cores: l.cores,
                source: l.kind().into(),
                detail: l.describe(),
                pids: Vec::new(),
            });
            row.pids.push(tgid);
        }
        ServerCpuStatus {
            cores: c.cores,
            source: c.kind().into(),
            detail: c.describe(),
            node_cores: self.node,
            servers: by_binding.into_values().collect(),
            untagged_cpu_seconds: 0.0,
        }
    }
}

impl Shared {
    pub(crate) fn lock_server_cpu(&self) -> RankedGuard<'_, ServerCpu> {
        self.server_cpu.lock()
    }

    /// The servers' CPU since the last monitor sample.
    pub(crate) fn servers_ran(&self) -> ServersRan {
        let (exclude, rule_cells) = {
            let r = self.lock_rules();
            (r.matched_tgids(), r.cells().collect())
        };
        let (ns, servers) = self.lock_server_cpu().ran_since_last(&exclude);
        ServersRan { ns, servers, rule_cells }
    }

    fn written_dirs(&self) -> Vec<PathBuf> {
        self.lock_rules().enforcer.as_ref().map(|e| e.written_dirs()).unwrap_or_default()
    }

    /// Process `tgid` registered a thread on connection `conn`.
    pub(crate) fn server_registered(&self, tgid: u32, conn: u64) {
        let skip = self.written_dirs();
        if self.lock_server_cpu().attach(tgid, conn, skip) {
            self.server_cpu_changed(&format!("server pid {tgid} registered"));
        }
    }

    /// Connection `conn` closed.
    pub(crate) fn server_connection_closed(&self, conn: u64) {
        if self.lock_server_cpu().detach(conn) {
            self.server_cpu_changed(&format!("a server went (connection {conn})"));
        }
    }

    /// Reads the servers' limits again (housekeeping, once a second).
    pub(crate) fn refresh_server_cpu(&self) {
        let skip = self.written_dirs();
        if self.lock_server_cpu().refresh(skip) {
            self.server_cpu_changed("a server's cgroup limit changed");
        }
    }

    /// Resizes the buckets, tenant caps and rule caps to the number in force.
    fn server_cpu_changed(&self, why: &str) {
        // The configuration lock first: a change of configuration and this
        // apply one after the other, each with the number current then.
        let running = self.lock_config();
        let now = self.lock_server_cpu().current().clone();
        log::info!(
            "server CPU: {:.2} cores ({}), {why}: the node budget and every cap are fractions of it now",
            now.cores,
            now.describe()
        );
        if let Err(e) =
            self.policy.update_settings_at(Settings::from_config(&running.config, now.cores), super::now_us())
        {
            log::warn!("server CPU: the policy could not resize to {:.2} cores: {e}", now.cores);
        }
        if !running.config.rules().is_empty()
            && let Err(e) = self.apply_rules(&running.config)
        {
            log::warn!("server CPU: the rule caps could not be resized: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_count() {
        assert_eq!(count_cpus("0-3,8,10-11\n"), Some(7));
        assert_eq!(count_cpus("5"), Some(1));
        assert_eq!(count_cpus(""), Some(0));
        assert_eq!(count_cpus("3-1"), None);
        assert_eq!(count_cpus("a"), None);
    }

    /// A cgroup tree in a scratch directory: `files` as (path, text).
    fn tree(tag: &str, files: &[(&str, &str)]) -> PathBuf {
        let root = std::env::temp_dir().join(format!("governor-server-cpu-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (path, text) in files {
            let p = root.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        root
    }

    fn place(mount: &Path, rel: &str, v2: bool, controllers: &[&str]) -> Place {
        Place {
            mount: mount.to_path_buf(),
            rel: rel.into(),
            v2,
            controllers: controllers.iter().map(|c| c.to_string()).collect(),
        }
    }

    #[test]
    fn the_smallest_limit_on_the_path_wins_v2() {
        let root = tree(
            "v2",
            &[
                ("cpu.max", "max 100000\n"),
                ("kubepods/cpu.max", "250000 100000\n"),
                ("kubepods/pod/cpu.max", "max 100000\n"),
                ("kubepods/pod/cpuset.cpus.effective", "0-3\n"),
                ("kubepods/pod/tikv/cpu.max", "max 100000\n"),
                ("kubepods/pod/tikv/cpuset.cpus.effective", "0-3\n"),
            ],
        );
        let l = limit_in(&[place(&root, "/kubepods/pod/tikv", true, &["cpu", "cpuset"])], 8, &[]);
        assert_eq!(l.cores, 2.5);
        assert_eq!(l.kind(), "cpu-quota");
        assert!(l.describe().contains("kubepods/cpu.max: quota 250000 µs per 100000 µs"), "{}", l.describe());
        // A cpuset narrower than the quota wins.
        std::fs::write(root.join("kubepods/pod/tikv/cpuset.cpus.effective"), "2-3\n").unwrap();
        let l = limit_in(&[place(&root, "/kubepods/pod/tikv", true, &["cpu", "cpuset"])], 8, &[]);
        assert_eq!((l.cores, l.kind()), (2.0, "cpuset"));
        // No limit anywhere: the node.
        let l = limit_in(&[place(&root, "/", true, &["cpu"])], 8, &[]);
        assert_eq!((l.cores, l.kind()), (8.0, "node"));
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn v1_reads_cfs_quota_and_the_cpuset_hierarchy() {
        let cpu = tree(
            "v1-cpu",
            &[
                ("cpu.cfs_quota_us", "-1\n"),
                ("cpu.cfs_period_us", "100000\n"),
                ("svc/cpu.cfs_quota_us", "50000\n"),
                ("svc/cpu.cfs_period_us", "100000\n"),
                ("svc/tikv/cpu.cfs_quota_us", "-1\n"),
                ("svc/tikv/cpu.cfs_period_us", "100000\n"),
            ],
        );
        let cpuset = tree("v1-cpuset", &[("svc/cpuset.cpus", "0\n"), ("svc/cpuset.effective_cpus", "0-1\n")]);
        let places = [place(&cpu, "/svc/tikv", false, &["cpu"]), place(&cpuset, "/svc", false, &["cpuset"])];
        let l = limit_in(&places, 4, &[]);
        assert_eq!((l.cores, l.kind()), (0.5, "cpu-quota"));
        // A cap the agent wrote itself (a rule's cgroup) is not the server's limit.
        let l = limit_in(&places, 4, &[cpu.join("svc")]);
        assert_eq!((l.cores, l.kind()), (2.0, "cpuset"));
        let l = limit_in(&places[1..], 4, &[]);
        assert_eq!((l.cores, l.kind()), (2.0, "cpuset"), "the effective CPUs, not the configured ones");
        let _ = std::fs::remove_dir_all(cpu);
        let _ = std::fs::remove_dir_all(cpuset);
    }

    fn quota(dir: &str, cores: f64) -> Limit {
        Limit {
            cores,
            origin: Origin::Quota {
                dir: dir.into(),
                file: "cpu.max",
                quota_us: (cores * 1e5) as u64,
                period_us: 100_000,
            },
        }
    }

    #[test]
    fn several_servers_add_distinct_limits_up_to_the_node() {
        let mut s = ServerCpu::new(0.0);
        s.node = 4;
        s.servers.insert(1, [10].into());
        s.servers.insert(2, [11].into());
        s.servers.insert(3, [12].into());
        s.limits.insert(1, quota("/a", 1.0));
        s.limits.insert(2, quota("/a", 1.0));
        assert!(s.settle());
        assert_eq!((s.current().cores, s.current().kind()), (1.0, "cpu-quota"), "one cgroup counts once");
        s.limits.insert(3, quota("/b", 0.5));
        s.settle();
        assert_eq!((s.current().cores, s.current().kind()), (1.5, "servers"));
        assert_eq!(s.status().servers.len(), 2);
        assert_eq!(s.status().servers[0].pids, [1, 2]);
        s.limits.insert(3, quota("/b", 3.5));
        s.settle();
        assert_eq!((s.current().cores, s.current().kind()), (4.0, "node"), "never past the node");
        // The configured number wins; 0 gives detection back.
        assert!(s.set_configured(0.75));
        assert_eq!((s.current().cores, s.current().kind()), (0.75, "config"));
        assert_eq!(s.cores_with(0.0), 4.0);
        s.set_configured(0.0);
        // The last connection of a server going takes its limit away.
        assert!(!s.detach(99));
        s.limits.insert(3, quota("/b", 0.5));
        s.settle();
        assert!(!s.detach(10), "pid 2 is still in /a");
        assert!(s.detach(11));
        assert_eq!((s.current().cores, s.current().kind()), (0.5, "cpu-quota"));
        assert!(s.detach(12));
        assert_eq!((s.current().cores, s.current().kind()), (4.0, "node"));
    }
}
