//! `[[rules]]`: unmodified processes measured by rule.
//!
//! A rule gives every process it matches to a keyspace. It matches on the
//! process's identity — cgroup path (exact or prefix, on the cgroup v2
//! hierarchy or the cgroup v1 `cpu` hierarchy), tgid, effective uid,
//! executable path, or command-name prefix; every matcher a rule lists must
//! hold. Rules are tried in order and the first match wins. A rule with a
//! `thread-name-prefix` matches threads rather than processes: the threads
//! of a matching process whose name starts with it (a process's main thread
//! is named by its command name), so one process's threads can be charged
//! to different keyspaces; its other threads go by the rules after it. A
//! thread is matched again whenever it is renamed. A process is
//! matched when it starts a program (exec) and whenever the rules change; a
//! child belongs to its parent's keyspace from its first slice (fork), and
//! keeps it through an exec no rule matches. Threads a client registers and
//! tags are charged by their tags, never by a rule.
//!
//! ```toml
//! [[rules]]
//! name = "nightly-backup"
//! keyspace = 900
//! comm-prefix = "pg_dump"
//! ```

use std::collections::HashMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::checker::Checker;

/// Most rules a configuration may hold.
pub const MAX_RULES: usize = 4096;
/// `comm` holds 15 bytes (TASK_COMM_LEN − 1): a longer prefix never matches.
const COMM_MAX: usize = 15;

/// One rule as written: integers wide, so a value out of range is reported
/// with the rule's name rather than as a parse error.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct RawRule {
    /// Unique; names the rule in status, metrics and errors.
    pub name: String,
    /// The keyspace its processes are charged to.
    pub keyspace: i64,
    /// The process's cgroup path is exactly this (`/system.slice/x.service`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    /// The process's cgroup path is this or below it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup_prefix: Option<String>,
    /// The process has this tgid (pid).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tgid: Option<i64>,
    /// The process runs as this effective uid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<i64>,
    /// The process executes this file (absolute path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exe: Option<String>,
    /// The process's command name (`comm`, 15 bytes) starts with this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_prefix: Option<String>,
    /// The thread's name (15 bytes, as `pthread_setname_np` sets it) starts
    /// with this: the rule charges those threads only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread_name_prefix: Option<String>,
    /// Hold the keyspace to its cap on the rule's `cgroup` itself (its
    /// `cpu.max`, or `cpu.cfs_quota_us` on cgroup v1) instead of moving its
    /// processes into a cgroup of governor's; what was there is put back
    /// when the agent stops. Needs `cgroup`. Default false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cap_in_place: bool,
}

/// A validated rule.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct Rule {
    pub name: String,
    pub keyspace: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cgroup_prefix: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tgid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exe: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm_prefix: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thread_name_prefix: Option<String>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub cap_in_place: bool,
}

/// What a process is, as rules see it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessIdentity {
    pub tgid: u32,
    pub comm: String,
    pub exe: Option<String>,
    pub uid: Option<u32>,
    /// Its cgroup paths: the v2 one and the v1 `cpu` one, where present.
    pub cgroups: Vec<String>,
}

/// `path` is `dir` or below it, component-wise (`/a` covers `/a/b`, not `/ab`).
fn under(path: &str, dir: &str) -> bool {
    let dir = dir.trim_end_matches('/');
    dir.is_empty() || path == dir || path.strip_prefix(dir).is_some_and(|rest| rest.starts_with('/'))
}

impl Rule {
    /// Whether `p`'s main thread (named by its command name) matches every
    /// matcher of the rule.
    pub fn matches(&self, p: &ProcessIdentity) -> bool {
        self.matches_thread(p, &p.comm)
    }

    /// Whether a thread called `thread` of process `p` matches every
    /// matcher of the rule.
    pub fn matches_thread(&self, p: &ProcessIdentity, thread: &str) -> bool {
        self.thread_name_prefix.as_deref().is_none_or(|t| thread.starts_with(t))
            && self.tgid.is_none_or(|t| t == p.tgid)
            && self.uid.is_none_or(|u| p.uid == Some(u))
            && self.comm_prefix.as_deref().is_none_or(|c| p.comm.starts_with(c))
            && self.exe.as_deref().is_none_or(|e| p.exe.as_deref() == Some(e))
            && self.cgroup.as_deref().is_none_or(|c| p.cgroups.iter().any(|g| g == c))
            && self.cgroup_prefix.as_deref().is_none_or(|c| p.cgroups.iter().any(|g| under(g, c)))
    }

    /// The matchers, as `key=value` words (for status and `rules list`).
    pub fn matchers(&self) -> String {
        let mut out = Vec::new();
        if let Some(v) = &self.cgroup {
            out.push(format!("cgroup={v}"));
        }
        if let Some(v) = &self.cgroup_prefix {
            out.push(format!("cgroup-prefix={v}"));
        }
        if let Some(v) = self.tgid {
            out.push(format!("tgid={v}"));
        }
        if let Some(v) = self.uid {
            out.push(format!("uid={v}"));
        }
        if let Some(v) = &self.exe {
            out.push(format!("exe={v}"));
        }
        if let Some(v) = &self.comm_prefix {
            out.push(format!("comm-prefix={v}"));
        }
        if let Some(v) = &self.thread_name_prefix {
            out.push(format!("thread-name-prefix={v}"));
        }
        out.join(" ")
    }

    /// Back to the form written in a file.
    pub fn to_raw(&self) -> RawRule {
        RawRule {
            name: self.name.clone(),
            keyspace: self.keyspace.into(),
            cgroup: self.cgroup.clone(),
            cgroup_prefix: self.cgroup_prefix.clone(),
            tgid: self.tgid.map(Into::into),
            uid: self.uid.map(Into::into),
            exe: self.exe.clone(),
            comm_prefix: self.comm_prefix.clone(),
            thread_name_prefix: self.thread_name_prefix.clone(),
            cap_in_place: self.cap_in_place,
        }
    }
}

/// Roots a rule's cgroup path may live under: the cgroup v2 hierarchy and
/// the cgroup v1 `cpu` hierarchy, wherever this host mounts them.
pub fn cgroup_roots() -> Vec<std::path::PathBuf> {
    crate::procs::cgroup_mounts().into_iter().map(|m| m.dir).collect()
}

/// The kernel's `pid_max`: every pid is below it (`None` where it cannot be read).
fn pid_max() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/pid_max").ok()?.trim().parse().ok()
}

/// Checks every rule; returns the valid ones. Each failure names the rule
/// (`rules.<name>.<key>`, or `rules[<n>]` before it has a usable name).
pub(super) fn check(c: &mut Checker<'_>, raw: &[RawRule]) -> Vec<Rule> {
    if raw.len() > MAX_RULES {
        c.invalid("rules".into(), format!("{} rules, more than the {MAX_RULES} allowed", raw.len()));
    }
    let mut names: HashMap<&str, usize> = HashMap::new();
    let mut seen: HashMap<String, String> = HashMap::new();
    let mut out = Vec::new();
    for (i, r) in raw.iter().enumerate() {
        let name_ok = !r.name.is_empty()
            && r.name.len() <= 64
            && r.name.chars().all(|ch| ch.is_ascii_alphanumeric() || "-_.".contains(ch));
        let id = if name_ok { format!("rules.{}", r.name) } else { format!("rules[{i}]") };
        let before = c.errors.errors.len();
        if !name_ok {
            c.invalid(format!("{id}.name"), format!("{:?} is not a rule name: 1 to 64 of A-Z a-z 0-9 - _ .", r.name));
        } else if let Some(first) = names.insert(&r.name, i) {
            c.invalid(format!("{id}.name"), format!("duplicate: rules {first} and {i} are both named {:?}", r.name));
        }
        let int = |c: &mut Checker<'_>, key: &str, v: i64| -> u32 {
            u32::try_from(v).unwrap_or_else(|_| {
                c.invalid(format!("{id}.{key}"), format!("must be between 0 and {}, got {v}", u32::MAX));
                0
            })
        };
        let keyspace = int(c, "keyspace", r.keyspace);
        let tgid = r.tgid.map(|v| int(c, "tgid", v));
        // Judged on the value written: one out of range is said above.
        if r.tgid == Some(0) {
            c.invalid(format!("{id}.tgid"), "0 is no process");
        } else if let (Some(t), Some(max)) = (tgid.filter(|t| *t > 0), pid_max())
            && t >= max
        {
            c.invalid(format!("{id}.tgid"), format!("{t} is no process: the kernel's pids are below {max} (pid_max)"));
        }
        let uid = r.uid.map(|v| int(c, "uid", v));
        for (key, v) in [("cgroup", &r.cgroup), ("cgroup-prefix", &r.cgroup_prefix)] {
            let Some(v) = v else { continue };
            if !v.starts_with('/') || v.split('/').any(|part| part == "..") {
                c.invalid(
                    format!("{id}.{key}"),
                    format!("{v:?} is not a cgroup path: absolute, as /proc/<pid>/cgroup shows it, without .."),
                );
            }
        }
        if let Some(e) = &r.exe
            && !Path::new(e).is_absolute()
        {
            c.invalid(format!("{id}.exe"), format!("{e:?} is not an absolute path"));
        }
        for (key, what, v) in [
            ("comm-prefix", "a command name", &r.comm_prefix),
            ("thread-name-prefix", "a thread name", &r.thread_name_prefix),
        ] {
            if let Some(p) = v
                && (p.is_empty() || p.len() > COMM_MAX)
            {
                c.invalid(format!("{id}.{key}"), format!("{p:?} can never match: {what} holds 1 to {COMM_MAX} bytes"));
            }
        }
        let rule = Rule {
            name: r.name.clone(),
            keyspace,
            cgroup: r.cgroup.clone(),
            cgroup_prefix: r.cgroup_prefix.clone(),
            tgid,
            uid,
            exe: r.exe.clone(),
            comm_prefix: r.comm_prefix.clone(),
            thread_name_prefix: r.thread_name_prefix.clone(),
            cap_in_place: r.cap_in_place,
        };
        if r.cap_in_place && (r.cgroup.is_none() || r.thread_name_prefix.is_some()) {
            c.invalid(
                format!("{id}.cap-in-place"),
                "needs cgroup (the cgroup to cap) and no thread-name-prefix: a cgroup holds whole processes",
            );
        }
        let matchers = rule.matchers();
        if matchers.is_empty() {
            c.invalid(
                id.clone(),
                "matches nothing: give at least one of cgroup, cgroup-prefix, tgid, uid, exe, comm-prefix, thread-name-prefix",
            );
        } else if let Some(first) = seen.insert(matchers.clone(), r.name.clone()) {
            c.invalid(id.clone(), format!("duplicate of rule {first:?} ({matchers}): it could never match first"));
        }
        if c.errors.errors.len() == before {
            out.push(rule);
        }
    }
    // An in-place cap holds one cgroup: its keyspace is that rule's alone.
    for r in out.iter().filter(|r| r.cap_in_place) {
        if let Some(other) = out.iter().find(|o| o.keyspace == r.keyspace && o.name != r.name) {
            c.invalid(
                format!("rules.{}.cap-in-place", r.name),
                format!(
                    "keyspace {} is also rule {:?}'s: an in-place cap holds one cgroup, give it a keyspace of its own",
                    r.keyspace, other.name
                ),
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn process(comm: &str, cgroups: &[&str]) -> ProcessIdentity {
        ProcessIdentity {
            tgid: 42,
            comm: comm.into(),
            exe: Some("/usr/bin/stress-ng".into()),
            uid: Some(1000),
            cgroups: cgroups.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn rule(f: impl FnOnce(&mut Rule)) -> Rule {
        let mut r = Rule {
            name: "r".into(),
            keyspace: 9,
            cgroup: None,
            cgroup_prefix: None,
            tgid: None,
            uid: None,
            exe: None,
            comm_prefix: None,
            thread_name_prefix: None,
            cap_in_place: false,
        };
        f(&mut r);
        r
    }

    #[test]
    fn every_matcher_must_hold_and_prefixes_follow_path_components() {
        let p = process("stress-ng-cpu", &["/batch/a", "/"]);
        assert!(rule(|r| r.comm_prefix = Some("stress".into())).matches(&p));
        assert!(!rule(|r| r.comm_prefix = Some("stressy".into())).matches(&p));
        assert!(rule(|r| r.cgroup_prefix = Some("/batch".into())).matches(&p));
        assert!(!rule(|r| r.cgroup_prefix = Some("/bat".into())).matches(&p));
        assert!(rule(|r| r.cgroup = Some("/batch/a".into())).matches(&p));
        assert!(!rule(|r| r.cgroup = Some("/batch".into())).matches(&p));
        assert!(
            rule(|r| {
                r.uid = Some(1000);
                r.exe = Some("/usr/bin/stress-ng".into());
            })
            .matches(&p)
        );
        assert!(
            !rule(|r| {
                r.uid = Some(1000);
                r.tgid = Some(43);
            })
            .matches(&p)
        );
        // Unknown identity parts never match.
        let mut gone = p.clone();
        gone.uid = None;
        assert!(!rule(|r| r.uid = Some(1000)).matches(&gone));
        // Thread names: the main thread is named by the command name.
        let io = rule(|r| {
            r.exe = Some("/usr/bin/stress-ng".into());
            r.thread_name_prefix = Some("io_thd_".into());
        });
        assert!(io.matches_thread(&p, "io_thd_1") && !io.matches_thread(&p, "bio_aof") && !io.matches(&p));
        assert!(rule(|r| r.thread_name_prefix = Some("stress".into())).matches(&p));
    }
}
