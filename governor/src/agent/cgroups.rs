//! Enforcement for rule-matched keyspaces: the kernel holds them to their
//! cap through the CPU controller of a cgroup the agent owns.
//!
//! A keyspace measured by rule that has a CPU cap (its configured quota
//! while cpu-throttle is on, else the tenant cap) gets a cgroup
//! `<prefix>-ks-<id>`, made when its first process is placed, at the top
//! of the hierarchy that has the `cpu`
//! controller (one level: a group nested under another made the wakeups of
//! its neighbours wait 2–4× longer, docs/design.md §3): the
//! cgroup v2 one (`cpu.max`) where it offers it, else cgroup v1's `cpu`
//! hierarchy (`cpu.cfs_quota_us` / `cpu.cfs_period_us`), as on hybrid hosts.
//! Its processes are moved in (children follow at fork, as cgroups do).
//! Where fairness is asked (`enable-fair-allocation`), each keyspace cgroup
//! also weighs its cap (`cpu.weight` on v2, `cpu.shares` on v1: one core is
//! the default weight), so capped keyspaces that contend for a saturated
//! node split it in proportion to their caps, as the fair-allocation seed
//! splits tokens in proportion to quotas.
//!
//! A rule with `cap-in-place` names a cgroup the operator owns: the agent
//! writes the cap (and weight) into that cgroup and moves nothing, and puts
//! back the values it found there, from the state file after a crash too.
//! Everything the agent changes is written to a state file first; on stop
//! the agent moves every process back where it was and removes its
//! cgroups, and a start after a crash does the same from the file. Without
//! a usable controller or the permission, the agent says so and keeps
//! measuring.

mod files;
mod guard;
mod in_place;
mod restore;

use files::{Factors, Version, an_agents, cgroup_of, detect, period_us, put_back_to, quota_us, write_cap, write_whole};
use in_place::{InPlace, dir_ino};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// What the agent changed, as written to the state file.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct State {
    /// Hierarchy mount point and version.
    root: Option<(PathBuf, Version)>,
    /// The slice directory of an agent before keyspace cgroups were put at
    /// the top (relative to the root): removed when found.
    slice: Option<String>,
    /// Keyspace cgroups created (relative to the root).
    created: BTreeMap<u32, String>,
    /// tgid → the cgroup it was in (relative to the root).
    moved: BTreeMap<u32, String>,
    /// Keyspaces capped on the operator's own cgroup: the cgroup, and the
    /// files the agent wrote with what they held before.
    #[serde(default)]
    in_place: BTreeMap<u32, InPlace>,
}

/// What the rule caps take from the configuration, derived here and nowhere
/// else: a key the caps read is read in [`CapSettings::from_config`], and a
/// configuration change that changes these re-applies the caps.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct CapSettings {
    /// keyspace → cores: a rule keyspace's configured quota, else the tenant
    /// cap; none while cpu-throttle is off (measuring only). Thread rules are
    /// measured, not capped: a cgroup holds processes, and their threads
    /// share it.
    pub caps: HashMap<u32, f64>,
    /// Keyspace cgroups weigh their caps (`enable-fair-allocation`).
    pub weighted: bool,
    /// The bandwidth period the caps are written over, µs
    /// (`rule-cpu-period`).
    pub period_us: u64,
}

impl CapSettings {
    /// The caps `config` asks for on a server of `cores`.
    pub(crate) fn from_config(config: &crate::config::ValidatedConfig, cores: f64) -> CapSettings {
        let t = config.cpu_throttle();
        let caps = if t.enabled {
            config
                .rules()
                .iter()
                .filter(|r| r.thread_name_prefix.is_none())
                .filter_map(|r| {
                    let cap = match t.keyspace_cpu_quotas.get(r.keyspace) {
                        Some(millicores) => millicores as f64 / 1000.0,
                        None if t.tenant_max_cpu_ratio > 0.0 => t.tenant_max_cpu_ratio * cores,
                        None => return None,
                    };
                    Some((r.keyspace, cap))
                })
                .collect()
        } else {
            HashMap::new()
        };
        CapSettings {
            caps,
            weighted: t.enabled && t.enable_fair_allocation,
            period_us: period_us(config.resource_control().rule_cpu_period.get()),
        }
    }
}

impl Default for CapSettings {
    /// No caps, over the configuration's default period.
    fn default() -> Self {
        CapSettings {
            caps: HashMap::new(),
            weighted: false,
            period_us: period_us(crate::config::ResourceControl::default().rule_cpu_period.get()),
        }
    }
}

pub(crate) struct Enforcer {
    hierarchy: Option<(PathBuf, Version)>,
    /// Why enforcement is unavailable, when it is.
    pub(crate) unavailable: Option<String>,
    /// Keyspace cgroups are `<root>/<prefix>-ks-<id>`.
    prefix: String,
    state_path: PathBuf,
    state: State,
    /// The caps in force (until the configuration says: none).
    settings: CapSettings,
    /// keyspace → the latency guard's factors its cap and weight are
    /// written scaled by now (absent: whole).
    guard: HashMap<u32, Factors>,
    /// keyspace → when the guard last rewrote its cap.
    guard_written: HashMap<u32, std::time::Instant>,
    /// Keyspaces whose cgroup refused the latency guard's last write (said
    /// once in the log until a write takes).
    guard_failed: std::collections::HashSet<u32>,
    /// keyspace → what its processes ran outside its cgroup ([`guard::Outside`]).
    outside: HashMap<u32, guard::Outside>,
    /// tgid → (keyspace, why): processes of a capped keyspace that could not
    /// be moved into its cgroup (on cgroup v1 moving another user's process
    /// takes euid 0), so the kernel does not hold them.
    unmoved: BTreeMap<u32, (u32, String)>,
    /// Moves not yet in the state file.
    dirty: bool,
    /// Keyspaces the rules cap on the operator's own cgroup (relative to
    /// the root): never given one of ours. One not there yet is capped when
    /// its first process is placed.
    capped_in_place: HashMap<u32, String>,
    /// Other agents' keyspace cgroups a process was taken from (said once).
    taken_from: std::collections::HashSet<String>,
}

impl Enforcer {
    /// The enforcer for an agent whose state lives at `state_path`; first
    /// puts back whatever an agent that died left there.
    pub(crate) fn new(state_path: PathBuf, prefix: String) -> Enforcer {
        let (hierarchy, unavailable) = match detect() {
            Ok(h) => (Some(h), None),
            Err(why) => (None, Some(why.to_string())),
        };
        let mut e = Enforcer {
            hierarchy,
            unavailable,
            prefix,
            state_path,
            state: State::default(),
            settings: CapSettings::default(),
            guard: HashMap::new(),
            guard_written: HashMap::new(),
            guard_failed: std::collections::HashSet::new(),
            outside: HashMap::new(),
            unmoved: BTreeMap::new(),
            dirty: false,
            capped_in_place: HashMap::new(),
            taken_from: std::collections::HashSet::new(),
        };
        // Read as a regular file only (a FIFO there would hang the start).
        let left = crate::config::file::read_regular(&e.state_path, "state file", 64 << 20)
            .and_then(|text| serde_json::from_str::<State>(&text).map_err(std::io::Error::other));
        match left {
            Ok(left) => {
                // An agent killed with nothing in place left an empty record.
                if !(left.created.is_empty() && left.moved.is_empty() && left.in_place.is_empty()) {
                    log::warn!(
                        "cgroups: a previous agent left {} keyspace cgroups, {} moved processes and {} caps in place ({}); putting them back",
                        left.created.len(),
                        left.moved.len(),
                        left.in_place.len(),
                        e.state_path.display()
                    );
                }
                e.state = left;
                e.restore_all();
            }
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => log::warn!("cgroups: ignoring unreadable state file {}: {err}", e.state_path.display()),
        }
        e.sweep();
        e
    }

    /// The cap enforced on `keyspace`, in cores.
    pub(crate) fn cap_of(&self, keyspace: u32) -> Option<f64> {
        let cap = self.settings.caps.get(&keyspace).copied().filter(|_| self.unavailable.is_none())?;
        let period = self.settings.period_us;
        Some(quota_us(cap * self.factors(keyspace).quota, period) as f64 / period as f64)
    }

    /// Live processes of capped `keyspace` that could not be moved into its
    /// cgroup, with the children they forked since (born outside it too),
    /// and the last reason.
    pub(crate) fn unmoved_of(&self, keyspace: u32) -> (u64, Option<String>) {
        let Some((_, version)) = self.hierarchy else { return (0, None) };
        let mut outside = std::collections::BTreeSet::new();
        let mut why = None;
        for (&tgid, (k, reason)) in &self.unmoved {
            if *k != keyspace || !Path::new(&format!("/proc/{tgid}")).exists() {
                continue;
            }
            why = Some(reason.clone());
            let mut todo = vec![tgid];
            while let Some(p) = todo.pop() {
                if !self.holds(p, version) && outside.insert(p) {
                    todo.extend(crate::procs::children(p));
                }
            }
        }
        (outside.len() as u64, why)
    }

    /// The cgroup directories whose limits the agent writes (its keyspace
    /// cgroups, and the operators' cgroups it caps in place): a server's
    /// limit is never read from them, or a rule cap would shrink the number
    /// it is a fraction of.
    pub(crate) fn written_dirs(&self) -> Vec<PathBuf> {
        let Some((root, _)) = &self.hierarchy else { return Vec::new() };
        let mut dirs: Vec<PathBuf> = self.state.created.values().map(|rel| root.join(rel)).collect();
        dirs.extend(self.state.in_place.values().map(|p| root.join(p.rel.trim_start_matches('/'))));
        dirs
    }

    /// What `describe` says of the weights (`file`, " and cpu.weight"):
    /// written to weigh the caps, or by the latency guard while it holds a
    /// keyspace down, or not at all.
    fn weights_written(&self, file: &str) -> String {
        if self.settings.weighted {
            file.to_string()
        } else if self.guard.values().any(|f| f.weight < 1.0) {
            format!("{file} (the latency guard's, while it holds a keyspace down)")
        } else {
            String::new()
        }
    }

    /// Where enforcement happens, for status.
    pub(crate) fn describe(&self) -> String {
        match (&self.hierarchy, &self.unavailable) {
            (_, Some(why)) => format!("unavailable: {why}"),
            (Some((root, Version::V2)), None) => {
                format!(
                    "cgroup v2 cpu.max{} over {} ms in {}/{}-ks-<id>",
                    self.weights_written(" and cpu.weight"),
                    self.settings.period_us / 1000,
                    root.display(),
                    self.prefix
                )
            }
            (Some((root, Version::V1)), None) => {
                let euid = crate::sys::effective_uid();
                format!(
                    "cgroup v1 cpu.cfs_quota_us{} over {} ms in {}/{}-ks-<id>{}",
                    self.weights_written(" and cpu.shares"),
                    self.settings.period_us / 1000,
                    root.display(),
                    self.prefix,
                    if euid == 0 {
                        String::new()
                    } else {
                        format!(
                            "; the agent runs as uid {euid}, and on cgroup v1 it can move only that uid's processes into them (another user's takes euid 0): caps of other users' processes are not held"
                        )
                    }
                )
            }
            (None, None) => "unavailable".into(),
        }
    }

    /// Writes the moves of the last batch of decisions to the state file,
    /// forgetting gone processes once many are kept.
    pub(crate) fn flush(&mut self) {
        if std::mem::take(&mut self.dirty) {
            if self.state.moved.len() > 256 {
                self.state.moved.retain(|t, _| Path::new(&format!("/proc/{t}")).exists());
            }
            if !self.save() {
                self.unrecorded();
            }
        }
    }

    /// Writes the state file whole ([`write_whole`]); false, said in the
    /// log, when it cannot.
    fn save(&self) -> bool {
        let text = serde_json::to_string(&self.state).expect("state serializes");
        match write_whole(&self.state_path, text.as_bytes()) {
            Ok(()) => true,
            Err(e) => {
                log::warn!("cgroups: cannot write the state file {}: {e}", self.state_path.display());
                false
            }
        }
    }

    /// Enforcement stops because the record of what it changes cannot be
    /// written: without it a crash would leave processes capped with nobody
    /// to put them back. Everything it changed is put back first, from what
    /// it knows.
    fn unrecorded(&mut self) {
        self.restore_all();
        self.fail(format!(
            "cannot write the state file {} (the record that puts back what the agent changes, after a crash too); restart the agent once it can",
            self.state_path.display()
        ));
    }

    fn fail(&mut self, what: String) {
        log::warn!("cgroups: {what}; rule caps are not enforced, measuring goes on");
        self.unavailable = Some(what);
    }

    /// Puts `settings` in force: the cap (cores) of every capped rule
    /// keyspace, and when weighted its weight too; keyspaces no longer
    /// capped give their processes back. Keyspaces in `in_place` are capped
    /// on that cgroup (relative to the hierarchy's root) instead of one of
    /// governor's.
    pub(crate) fn set_caps(&mut self, settings: CapSettings, in_place: &HashMap<u32, String>) {
        let (caps, weighted, period_us) = (settings.caps.clone(), settings.weighted, settings.period_us);
        let Some((root, version)) = self.hierarchy.clone() else {
            self.settings = settings;
            return;
        };
        if self.unavailable.is_some() {
            self.settings = settings;
            return;
        }
        self.state.root = Some((root.clone(), version));
        self.capped_in_place = in_place.clone();
        // In place: the operator's cgroups, values kept to put back.
        let dropped: Vec<u32> = self
            .state
            .in_place
            .keys()
            .copied()
            .filter(|k| !caps.contains_key(k) || in_place.get(k) != self.state.in_place.get(k).map(|p| &p.rel))
            .collect();
        for ks in dropped {
            self.restore_in_place(ks);
        }
        self.settings = settings;
        for (ks, rel) in in_place {
            let dir = root.join(rel.trim_start_matches('/'));
            if caps.contains_key(ks) && !dir.is_dir() {
                // A service's cgroup exists while it runs.
                log::info!(
                    "cgroups: keyspace {ks} is capped on {} once it exists (at its first process)",
                    dir.display()
                );
            }
            if !self.cap_in_place(*ks, &root, version) {
                return;
            }
        }
        let caps: HashMap<u32, f64> = caps.into_iter().filter(|(k, _)| !in_place.contains_key(k)).collect();
        if !caps.is_empty() && version == Version::V2 {
            let _ = std::fs::write(root.join("cgroup.subtree_control"), "+cpu");
        }
        // Gone or uncapped first.
        let old: Vec<u32> = self.state.created.keys().copied().filter(|k| !caps.contains_key(k)).collect();
        for ks in old {
            self.release_keyspace(ks);
        }
        // A keyspace's cgroup is made when its first process is placed
        // (`cgroup_for`): a rule that matches nothing leaves no trace in the
        // hierarchy. The ones there take the new cap now.
        for (&ks, &cores) in &caps {
            let Some(rel) = self.state.created.get(&ks) else { continue };
            let dir = root.join(rel);
            self.guard_written.insert(ks, std::time::Instant::now());
            if let Err(e) = write_cap(&dir, version, cores, self.factors(ks), weighted, period_us) {
                return self.fail(format!("cannot set the CPU cap of {}: {e}", dir.display()));
            }
        }
        if caps.is_empty() && self.state.created.is_empty() {
            self.remove_slice();
        }
        self.save();
    }

    /// The cgroup (relative to the root) that holds capped `keyspace`'s
    /// processes, made and capped now if it is not there yet; none once
    /// enforcement fails.
    fn cgroup_for(&mut self, keyspace: u32, root: &Path, version: Version) -> Option<String> {
        if let Some(rel) = self.state.created.get(&keyspace) {
            return Some(rel.clone());
        }
        if let Some(rel) = self.capped_in_place.get(&keyspace) {
            // Its own cgroup, capped now if it appeared (or was made anew) since.
            let ino = dir_ino(&root.join(rel.trim_start_matches('/')));
            if self.state.in_place.get(&keyspace).is_none_or(|p| p.ino != ino) {
                self.cap_in_place(keyspace, root, version);
            }
            return None;
        }
        let cores = *self.settings.caps.get(&keyspace)?;
        let rel = format!("{}-ks-{keyspace}", self.prefix);
        let dir = root.join(&rel);
        if !dir.is_dir()
            && let Err(e) = std::fs::create_dir(&dir)
        {
            self.fail(format!("cannot create {}: {e}", dir.display()));
            return None;
        }
        // Recorded before anything is moved in: an agent that dies now
        // leaves a record the next one removes it by.
        self.state.created.insert(keyspace, rel.clone());
        if !self.save() {
            self.state.created.remove(&keyspace);
            let _ = std::fs::remove_dir(&dir);
            self.unrecorded();
            return None;
        }
        self.guard_written.insert(keyspace, std::time::Instant::now());
        let (weighted, period_us) = (self.settings.weighted, self.settings.period_us);
        if let Err(e) = write_cap(&dir, version, cores, self.factors(keyspace), weighted, period_us) {
            self.fail(format!("cannot set the CPU cap of {}: {e}", dir.display()));
            return None;
        }
        Some(rel)
    }

    /// Puts process `tgid`, charged to `keyspace` (None: to none), where its
    /// keyspace's cap holds it: into the keyspace's cgroup if capped, back
    /// where it was if it was moved and no longer is.
    pub(crate) fn place(&mut self, tgid: u32, keyspace: Option<u32>) {
        if self.unavailable.is_some() {
            return;
        }
        let Some((root, version)) = self.hierarchy.clone() else { return };
        let capped = keyspace.filter(|k| self.settings.caps.contains_key(k));
        match capped.and_then(|k| Some((k, self.cgroup_for(k, &root, version)?))) {
            Some((ks, rel)) => {
                if cgroup_of(tgid, version).as_deref() == Some(&format!("/{rel}")) {
                    self.unmoved.remove(&tgid);
                    return;
                }
                // Children it forked before the move stay behind (later ones
                // are born inside): they go too.
                let mut todo = vec![tgid];
                while let Some(p) = todo.pop() {
                    let Some(orig) = cgroup_of(p, version) else { continue };
                    if orig != format!("/{rel}") {
                        match std::fs::write(root.join(&rel).join("cgroup.procs"), p.to_string()) {
                            Ok(()) => {
                                // Moved first, written to the state file once the batch is done
                                // (`flush`): a short-lived process runs outside its cap until it
                                // is in. An agent that dies in between leaves it unrecorded; the
                                // next one moves it where a recorded process came from.
                                // Never back into another agent's keyspace cgroup; taken
                                // from one, said (once per cgroup): two agents' rules match it.
                                if an_agents(&orig) && self.taken_from.insert(orig.clone()) {
                                    log::warn!(
                                        "cgroups: process {p} was in {orig}, another governor agent's keyspace cgroup: \
                                         rules of two agents match it, and the last to move it holds it"
                                    );
                                }
                                self.state.moved.entry(p).or_insert(put_back_to(orig));
                                self.dirty = true;
                                self.unmoved.remove(&p);
                            }
                            Err(e) => {
                                log::warn!(
                                    "cgroups: cannot move process {p} into {rel}: {e}; the kernel does not hold it to keyspace {ks}'s cap"
                                );
                                // Bounded: the ones gone go once many are kept.
                                if self.unmoved.len() >= 1024 {
                                    self.unmoved.retain(|t, _| Path::new(&format!("/proc/{t}")).exists());
                                }
                                self.unmoved.insert(p, (ks, e.to_string()));
                            }
                        }
                    }
                    todo.extend(crate::procs::children(p));
                }
            }
            None => {
                self.unmoved.remove(&tgid);
                let recorded = self.state.moved.remove(&tgid);
                // Only from a cgroup of ours: where the operator moved it
                // since, it stays. One born inside goes where its nearest
                // ancestor came from.
                if self.holds(tgid, version)
                    && let Some(orig) = recorded.clone().or_else(|| self.origin_of_ancestors(tgid, version))
                {
                    self.move_back(&root, tgid, &orig);
                }
                if recorded.is_some() {
                    self.save();
                }
            }
        }
    }

    /// Where the nearest ancestor of `tgid` came from: its record if the
    /// agent moved it, else its cgroup if not one of ours; the root when
    /// none says.
    fn origin_of_ancestors(&self, tgid: u32, version: Version) -> Option<String> {
        let mut p = tgid;
        for _ in 0..64 {
            p = crate::procs::parent(p).filter(|&pp| pp > 1)?;
            if let Some(orig) = self.state.moved.get(&p) {
                return Some(orig.clone());
            }
            match cgroup_of(p, version) {
                Some(now) if !self.is_ours(&now) => return Some(put_back_to(now)),
                Some(_) => {}
                None => return None,
            }
        }
        Some("/".into())
    }

    /// Whether `tgid` is in one of the keyspace cgroups the agent made.
    fn holds(&self, tgid: u32, version: Version) -> bool {
        cgroup_of(tgid, version).is_some_and(|now| self.is_ours(&now))
    }

    /// Whether cgroup `path` (as /proc shows it) is one the agent made.
    fn is_ours(&self, path: &str) -> bool {
        let path = path.trim_start_matches('/');
        self.state.created.values().any(|rel| rel.trim_start_matches('/') == path)
    }

    /// The cgroup `tgid` was in before the agent moved it into a keyspace
    /// cgroup it is still in, and the agent's cgroup as /proc shows it:
    /// rules match the operator's cgroup, not the agent's.
    pub(crate) fn moved_from(&self, tgid: u32) -> Option<(String, &str)> {
        let orig = self.state.moved.get(&tgid)?;
        let (_, version) = self.hierarchy.as_ref()?;
        let now = cgroup_of(tgid, *version).filter(|now| self.is_ours(now))?;
        Some((now, orig.as_str()))
    }
}
