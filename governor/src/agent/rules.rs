//! Rule measurement: unmodified processes charged to a keyspace by
//! `[[rules]]` (see `config::rules` for what a rule matches).
//!
//! Every tid entry of the kernel's tid table carries, beside the thread's
//! slot, the rule tag of its process. The sched_switch program charges a
//! task that is not registered by that tag, from the kernel's own runtime
//! counter, exactly like a registered thread; the switch loads the entry
//! anyway, so rules cost an unmatched switch nothing. The tags change three
//! ways:
//!
//! - **fork** (in the kernel): a new thread or process takes its creator's
//!   tag before it can run, so a measured process's children are measured
//!   from their first slice, and a reused tid starts clean;
//! - **exec** (kernel, then agent): while there are rules, a process that
//!   calls `execve` becomes *pending* and is reported on a ring buffer with
//!   its new command name and path; its CPU is kept aside meanwhile. The
//!   agent (a thread of its own, woken by the report) matches the rules,
//!   sets the entry (the first matching rule's keyspace, or what the
//!   process had before), moves the process into its keyspace's cgroup if
//!   capped, and charges the CPU kept aside to it (every thread of the
//!   process). A process that lives for one slice is counted too;
//! - **scan** (agent): at start and whenever the rules change, every process
//!   in `/proc` is matched, children inheriting from parents;
//! - **rename** (kernel, then agent): while a rule matches thread names, a
//!   renamed thread is reported, and the agent gives that one thread the
//!   keyspace of the first thread rule its new name matches, or its
//!   process's again. Thread rules never decide a whole process: a process
//!   is decided by the first rule without a thread name it matches, then
//!   each of its threads (the main one included) that a thread rule before
//!   that matches is charged apart.
//!
//! Nothing reads `/proc` on a timer. On the fallback backend there is no
//! kernel side: rules are kept and reported as not measured.

use super::cgroups::CapSettings;
use crate::config::{ProcessIdentity, Rule};
use crate::measure::Measurement;
use crate::measure::ebpf::RuleMaps;
use crate::proto::RuleStatus;
use keyspace_governor_common::{EVENT_EXEC, EVENT_FORK, EVENT_RENAME, RuleEvent, TAG_PENDING};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How long after setting a pending process's entry the agent takes what
/// was kept aside for it: a switch program that read "pending" just before
/// has long finished adding by then.
const SETTLE: Duration = Duration::from_millis(5);
/// How long a decision is remembered for the process's forks reported
/// after it.
const REMEMBER: Duration = Duration::from_secs(10);

/// One rule with the keyspace cell it charges.
#[derive(Clone, Debug)]
struct Active {
    rule: Rule,
    /// `cell + 1`.
    tag: u32,
}

#[derive(Default)]
pub(crate) struct Rules {
    active: Vec<Active>,
    /// Holds capped rule keyspaces to their cap (None: not started yet).
    pub(crate) enforcer: Option<super::cgroups::Enforcer>,
    /// What the agent itself decided, by tgid: (tag, rule index).
    decided: HashMap<u32, (u32, Option<usize>)>,
    /// Recent decisions for pending processes, for their forks.
    recent: HashMap<u32, (u32, Instant)>,
    /// Pending CPU to collect: (when, tgid, tag).
    settle: VecDeque<(Instant, u32, u32)>,
    last_sweep: Option<Instant>,
    /// Counters for status and metrics.
    pub(crate) events: u64,
    /// Reports the kernel had no room for (its count, read at each poll).
    pub(crate) dropped: u64,
    pub(crate) pending_ns: u64,
    /// True when the backend cannot measure by rule.
    unsupported: bool,
    /// Threads a thread rule charges apart from their process, by tid.
    threads: HashMap<u32, ThreadTag>,
}

/// A thread the agent tagged apart from its process.
#[derive(Clone, Copy, Debug)]
struct ThreadTag {
    tgid: u32,
    tag: u32,
    rule: usize,
    /// Its process's tag, which it takes back when no thread rule wants it.
    base: u32,
}

/// Reads what rules match on from `/proc/<tgid>`; `None` once it is gone
/// (or for a kernel thread, which has no executable).
pub(crate) fn identity(tgid: u32) -> Option<ProcessIdentity> {
    let id = crate::procs::identity(tgid)?;
    let cgroups = crate::procs::process_cgroups(tgid).into_iter().map(|(_, path)| path).collect();
    Some(ProcessIdentity { tgid, comm: id.comm, exe: id.exe, uid: id.uid, cgroups })
}

fn parent_of(tgid: u32) -> Option<u32> {
    crate::procs::parent(tgid)
}

fn cstr(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

impl Rules {
    /// What process `tgid` is, as the rules see it: one the agent moved
    /// into a keyspace cgroup is matched by the cgroup it came from (the
    /// operator's), not by the agent's.
    fn identity(&self, tgid: u32) -> Option<ProcessIdentity> {
        let mut p = identity(tgid)?;
        if let Some((ours, orig)) = self.enforcer.as_ref().and_then(|e| e.moved_from(tgid)) {
            for g in p.cgroups.iter_mut().filter(|g| **g == ours) {
                *g = orig.to_string();
            }
        }
        Some(p)
    }

    /// The keyspace a tag stands for, among the rules'.
    fn keyspace_of(&self, tag: u32) -> Option<u32> {
        self.active.iter().find(|a| a.tag == tag).map(|a| a.rule.keyspace)
    }

    /// Moves `tgid` into (or out of) the cgroup of the keyspace `tag` names.
    fn place(&mut self, tgid: u32, tag: u32) {
        let keyspace = self.keyspace_of(tag);
        if let Some(e) = self.enforcer.as_mut() {
            e.place(tgid, keyspace);
        }
    }

    /// Whether a decided process waits for its CPU kept aside to be taken.
    pub(crate) fn settling(&self) -> bool {
        !self.settle.is_empty()
    }

    /// Records the batch's moves in the enforcer's state file.
    fn flush_moves(&mut self) {
        if let Some(e) = self.enforcer.as_mut() {
            e.flush();
        }
    }

    /// The first rule that decides process `p` (thread rules never do).
    fn first_match(&self, p: &ProcessIdentity) -> Option<usize> {
        self.active.iter().position(|a| a.rule.thread_name_prefix.is_none() && a.rule.matches(p))
    }

    /// The thread rule that charges a thread called `name` of `p` apart
    /// from its process: the first rule matching the thread, if it is a
    /// thread rule.
    fn thread_rule(&self, p: &ProcessIdentity, name: &str) -> Option<usize> {
        let i = self.active.iter().position(|a| a.rule.matches_thread(p, name))?;
        self.active[i].rule.thread_name_prefix.is_some().then_some(i)
    }

    fn thread_rules(&self) -> bool {
        self.active.iter().any(|a| a.rule.thread_name_prefix.is_some())
    }

    /// Gives thread `tid` of `p` (now called `name`) its thread rule's tag,
    /// or its process's back when none wants it. A pending thread waits for
    /// its process's decision, which comes here after.
    fn retag_thread(&mut self, maps: &RuleMaps, p: &ProcessIdentity, tid: u32, name: &str) {
        let now = maps.tag(tid);
        if now == TAG_PENDING {
            return;
        }
        let known = self.threads.get(&tid).copied().filter(|t| t.tgid == p.tgid);
        match self.thread_rule(p, name) {
            Some(i) => {
                let tag = self.active[i].tag;
                let base = known.map_or(now, |t| t.base);
                if maps.set_thread_tag(tid, now, tag) {
                    self.threads.insert(tid, ThreadTag { tgid: p.tgid, tag, rule: i, base });
                }
            }
            None => {
                if let Some(t) = known {
                    self.threads.remove(&tid);
                    maps.set_thread_tag(tid, now, t.base);
                }
            }
        }
    }

    /// Puts back the process tag of every thread charged apart.
    fn untag_threads(&mut self, maps: &RuleMaps) {
        for (tid, t) in self.threads.drain() {
            maps.set_thread_tag(tid, t.tag, t.base);
        }
    }

    /// Processes the rules charge (all or some of their threads): their
    /// CPU is in the rule keyspaces' counts.
    pub(crate) fn matched_tgids(&self) -> HashSet<u32> {
        let mut out: HashSet<u32> = self.decided.iter().filter(|(_, (tag, _))| *tag != 0).map(|(t, _)| *t).collect();
        out.extend(self.threads.values().map(|t| t.tgid));
        out
    }

    /// Keyspace cells the rules charge (never evicted while a rule names them).
    pub(crate) fn cells(&self) -> impl Iterator<Item = u32> + '_ {
        self.active.iter().map(|a| a.tag - 1)
    }

    /// The rules naming each keyspace, for status.
    pub(crate) fn names_by_keyspace(&self) -> HashMap<u32, String> {
        let mut out: HashMap<u32, String> = HashMap::new();
        for a in &self.active {
            out.entry(a.rule.keyspace)
                .and_modify(|s| {
                    s.push(',');
                    s.push_str(&a.rule.name);
                })
                .or_insert_with(|| a.rule.name.clone());
        }
        out
    }

    pub(crate) fn status(&self) -> Vec<RuleStatus> {
        self.active
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let (not_capped, why) = self.enforcer.as_ref().map_or((0, None), |e| e.unmoved_of(a.rule.keyspace));
                RuleStatus {
                    name: a.rule.name.clone(),
                    keyspace: a.rule.keyspace,
                    matches: a.rule.matchers(),
                    processes_matched: self.decided.values().filter(|(_, r)| *r == Some(i)).count() as u64,
                    threads_matched: self.threads.values().filter(|t| t.rule == i).count() as u64,
                    measured: !self.unsupported,
                    cap_cores: self.enforcer.as_ref().and_then(|e| e.cap_of(a.rule.keyspace)),
                    // Six places: the steps' products carry float noise
                    // (0.8999999999999999) that says nothing.
                    guard_factor: self
                        .enforcer
                        .as_ref()
                        .and_then(|e| e.guard_factor_of(a.rule.keyspace))
                        .map(|f| (f * 1e6).round() / 1e6),
                    outside_factor: self
                        .enforcer
                        .as_ref()
                        .and_then(|e| e.outside_factor_of(a.rule.keyspace))
                        .map(|f| (f * 1e6).round() / 1e6),
                    processes_not_capped: not_capped,
                    not_capped_reason: why,
                }
            })
            .collect()
    }

    /// Scales the capped rule keyspaces' cgroup caps by the latency
    /// guard's factors (keyspace → factor below 1), and makes up for what
    /// their processes ran outside their cgroups.
    pub(crate) fn guard_caps(&mut self, factors: &HashMap<u32, f64>, cpu_ns: &[u64]) {
        // Each rule keyspace's whole charge (cell `tag − 1`), wherever its
        // processes ran: what makes up for those outside its cgroup.
        let charged: HashMap<u32, u64> = self
            .active
            .iter()
            .filter_map(|a| Some((a.rule.keyspace, *cpu_ns.get(a.tag.checked_sub(1)? as usize)?)))
            .collect();
        if let Some(e) = self.enforcer.as_mut() {
            e.guard(factors, &charged);
        }
    }

    /// Takes a new rule list: `cells[i]` is the keyspace cell of `rules[i]`,
    /// `caps` what the kernel holds capped rule keyspaces to. Every process
    /// is matched again; entries the agent set that no rule gives any more
    /// are cleared.
    pub(crate) fn apply(&mut self, m: &mut Measurement, rules: &[Rule], cells: &[u32], mut caps: CapSettings) {
        // Keyspaces whose rule caps its own cgroup (never shared, validation says).
        let in_place: HashMap<u32, String> =
            rules.iter().filter(|r| r.cap_in_place).filter_map(|r| Some((r.keyspace, r.cgroup.clone()?))).collect();
        self.active = rules.iter().zip(cells).map(|(r, c)| Active { rule: r.clone(), tag: c + 1 }).collect();
        if let Some(e) = self.enforcer.as_mut() {
            if m.rules().is_none() {
                caps.caps.clear();
            }
            e.set_caps(caps, &in_place);
        }
        let Some(maps) = m.rules() else {
            self.unsupported = true;
            if !rules.is_empty() {
                log::warn!(
                    "{} rules measure nothing: measuring unmodified processes needs the eBPF backend (this agent runs the thread-clock fallback)",
                    rules.len()
                );
            }
            return;
        };
        maps.set_exec_events(!rules.is_empty());
        let thread_rules = self.thread_rules();
        maps.set_rename_events(thread_rules);
        // Threads charged apart under the old rules go back to their
        // process first; the scan decides them again.
        self.untag_threads(maps);
        let started = Instant::now();
        let tgids = crate::procs::all_tgids();
        // Match every process, then resolve parents before children: like
        // the kernel at fork, a child that runs its parent's executable
        // (it did not exec) inherits the parent's keyspace; one that runs
        // another (it exec'd) takes its own first match, else inherits.
        let mut procs: HashMap<u32, (Option<usize>, Option<String>, u32)> = HashMap::new();
        for &t in &tgids {
            if let Some(p) = self.identity(t)
                && p.exe.is_some()
            {
                let own = self.first_match(&p);
                procs.insert(t, (own, p.exe, parent_of(t).unwrap_or(0)));
            }
        }
        let mut resolved: HashMap<u32, (u32, Option<usize>)> = HashMap::new();
        for &t in procs.keys() {
            let mut chain = vec![t];
            while let Some(&cur) = chain.last() {
                let pp = procs[&cur].2;
                if resolved.contains_key(&pp) || !procs.contains_key(&pp) || chain.len() > 4096 || chain.contains(&pp) {
                    break;
                }
                chain.push(pp);
            }
            while let Some(cur) = chain.pop() {
                if resolved.contains_key(&cur) {
                    continue;
                }
                let (own, exe, pp) = &procs[&cur];
                let inherited = resolved.get(pp).map(|(tag, _)| *tag).filter(|tag| *tag != 0);
                let same_exe = procs.get(pp).is_some_and(|(_, pexe, _)| pexe == exe);
                let r = match (inherited, own) {
                    (Some(tag), _) if same_exe => (tag, None),
                    (_, Some(i)) => (self.active[*i].tag, Some(*i)),
                    (Some(tag), None) => (tag, None),
                    (None, None) => (0, None),
                };
                resolved.insert(cur, r);
            }
        }
        let mut set = 0;
        for (&t, &(tag, rule)) in &resolved {
            let now = maps.tag(t);
            if now == TAG_PENDING {
                continue; // its exec report decides
            }
            // Entries inherited in the kernel under older rules are reset too.
            if now != tag && maps.replace_tag(t, None, tag) {
                set += 1;
            }
            if tag != 0 {
                self.decided.insert(t, (tag, rule));
            } else {
                self.decided.remove(&t);
            }
        }
        if thread_rules {
            for &t in resolved.keys() {
                let Some(p) = self.identity(t) else { continue };
                for tid in crate::procs::threads(t) {
                    if let Some(name) = crate::procs::thread_comm(t, tid) {
                        self.retag_thread(maps, &p, tid, &name);
                    }
                }
            }
        }
        let placed: Vec<(u32, u32)> = resolved.iter().map(|(&t, &(tag, _))| (t, tag)).collect();
        for (t, tag) in placed {
            self.place(t, tag);
        }
        self.flush_moves();
        // Processes decided before that are gone from /proc now.
        let gone: Vec<u32> = self.decided.keys().filter(|t| !resolved.contains_key(t)).copied().collect();
        for t in gone {
            if let Some((old, _)) = self.decided.remove(&t) {
                maps.replace_tag(t, Some(old), 0);
            }
        }
        log::info!(
            "rules: {} in force; {} processes matched or inherited, {} threads charged apart, {set} entries changed, in {:?}",
            self.active.len(),
            self.decided.len(),
            self.threads.len(),
            started.elapsed()
        );
    }

    /// Decides the processes the kernel reported, charges what was kept
    /// aside for them, and every second sweeps for leftovers.
    pub(crate) fn poll(&mut self, m: &mut Measurement) {
        let Some(maps) = m.rules() else { return };
        let mut events = Vec::new();
        maps.drain(&mut events);
        self.dropped = maps.dropped();
        let now = Instant::now();
        self.events += events.len() as u64;
        // Decide each process once per batch, on its latest report: a shell
        // that forked while pending and whose child exec'd since reports
        // both, and only what the child runs now counts.
        let mut last: HashMap<u32, usize> = HashMap::new();
        let mut renamed: HashMap<u32, usize> = HashMap::new();
        for (i, e) in events.iter().enumerate() {
            if e.kind == EVENT_RENAME {
                renamed.insert(e.tid, i);
            } else {
                last.insert(e.tgid, i);
            }
        }
        for (i, e) in events.iter().enumerate() {
            if last.get(&e.tgid) == Some(&i) {
                self.decide(maps, e, now);
            }
        }
        self.flush_moves();
        // Renames after the decisions: a thread renamed while its process
        // was pending is matched against what its process became.
        for (&tid, &i) in &renamed {
            let e = &events[i];
            if let Some(p) = self.identity(e.tgid).filter(|p| p.exe.is_some()) {
                self.retag_thread(maps, &p, tid, &cstr(&e.comm));
            }
        }
        let mut due = Vec::new();
        while self.settle.front().is_some_and(|(t, _, _)| *t <= now) {
            due.extend(self.settle.pop_front().map(|(_, tgid, tag)| (tgid, tag)));
        }
        let sweep = self.last_sweep.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1));
        if sweep {
            self.last_sweep = Some(now);
            self.recent.retain(|_, (_, t)| now.duration_since(*t) < REMEMBER);
            self.decided.retain(|t, _| std::path::Path::new(&format!("/proc/{t}")).exists());
            self.threads.retain(|tid, t| std::path::Path::new(&format!("/proc/{}/task/{tid}", t.tgid)).exists());
            let waiting: HashSet<u32> = self.settle.iter().map(|(_, t, _)| *t).collect();
            for tgid in maps.pending_tgids() {
                if waiting.contains(&tgid) {
                    continue;
                }
                match maps.tag(tgid) {
                    // Reported but not decided yet (its event is still in
                    // the buffer), or the report was lost: decide from /proc.
                    TAG_PENDING => {
                        let tag =
                            self.identity(tgid).and_then(|p| self.first_match(&p)).map_or(0, |i| self.active[i].tag);
                        if maps.replace_tag(tgid, Some(TAG_PENDING), tag) {
                            self.settle.push_back((now + SETTLE, tgid, tag));
                        }
                    }
                    tag => due.push((tgid, tag)),
                }
            }
        }
        let taken: Vec<(u32, u64)> = due.into_iter().map(|(tgid, tag)| (tag, maps.take_pending(tgid))).collect();
        for (tag, ns) in taken {
            self.pending_ns += ns;
            if let Some(cell) = tag.checked_sub(1).and_then(|c| m.regions.keyspaces.get(c)) {
                cell.cpu_ns.fetch_add(ns, Ordering::Relaxed);
            }
        }
    }

    /// What `parent`'s children inherit: its decision if it was pending,
    /// else its tag.
    fn inherited_from(&self, maps: &RuleMaps, parent: u32) -> u32 {
        match self.recent.get(&parent) {
            Some(&(tag, _)) => tag,
            None => Some(maps.tag(parent)).filter(|t| *t != TAG_PENDING).unwrap_or(0),
        }
    }

    fn decide(&mut self, maps: &mut RuleMaps, e: &RuleEvent, now: Instant) {
        // What it runs now (it may have exec'd since this report); the
        // report's words where /proc is already gone (a process that lived
        // one slice).
        let alive = self.identity(e.tgid).filter(|p| p.exe.is_some());
        let parent = match e.kind {
            EVENT_FORK => e.parent,
            EVENT_EXEC => parent_of(e.tgid).unwrap_or(0),
            _ => return,
        };
        let inherited = match (e.kind, e.prior) {
            (EVENT_EXEC, prior) if prior != TAG_PENDING => prior,
            _ => self.inherited_from(maps, parent),
        };
        let own = match &alive {
            Some(p) => self.first_match(p),
            // Gone: a fork report has nothing of its own (it ran its
            // parent's program), an exec report names what it ran.
            None if e.kind == EVENT_EXEC => self.first_match(&ProcessIdentity {
                tgid: e.tgid,
                comm: cstr(&e.comm),
                exe: Some(cstr(&e.filename)),
                uid: None,
                cgroups: Vec::new(),
            }),
            None => None,
        };
        // A fork child still running its parent's program inherits, as the
        // kernel does; one that exec'd since takes its own match.
        let exec_since =
            e.kind == EVENT_FORK && alive.as_ref().is_some_and(|p| identity(parent).is_none_or(|pp| pp.exe != p.exe));
        let (tag, rule) = match own {
            Some(i) if e.kind == EVENT_EXEC || exec_since => (self.active[i].tag, Some(i)),
            _ => (inherited, None),
        };
        self.recent.insert(e.tgid, (tag, now));
        log::debug!(
            "rules: process {} ({}, {:?}) {} -> tag {tag} ({})",
            e.tgid,
            if e.kind == EVENT_EXEC { "exec" } else { "fork" },
            cstr(&e.comm),
            cstr(&e.filename),
            rule.map_or("no rule".to_string(), |i| format!("rule {}", self.active[i].rule.name))
        );
        // An exec report is the latest word on a live process: if an older
        // report of it was decided in between (a fork report read just
        // before the child exec'd), this one overrides it.
        let decided = maps.replace_tag(e.tgid, Some(TAG_PENDING), tag)
            || (e.kind == EVENT_EXEC && alive.is_some() && maps.replace_tag(e.tgid, None, tag));
        if decided {
            if tag != 0 {
                self.decided.insert(e.tgid, (tag, rule));
            } else {
                self.decided.remove(&e.tgid);
            }
            if let Some(p) = &alive {
                self.place(e.tgid, tag);
                // Its main thread may be one a thread rule charges apart.
                if self.thread_rules() {
                    self.retag_thread(maps, p, e.tgid, &p.comm.clone());
                }
            }
            self.settle.push_back((now + SETTLE, e.tgid, tag));
        }
    }
}
