//! The hierarchy the caps live in, the cgroup files a cap and a weight
//! are written to, and the values written.

use std::path::{Path, PathBuf};

/// The cgroup version of the hierarchy the caps are written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) enum Version {
    V1,
    V2,
}

/// No mounted hierarchy offers the cpu controller.
#[derive(Debug, thiserror::Error)]
#[error("no cgroup hierarchy here offers the cpu controller (cgroup v2 without cpu, and no v1 cpu mount)")]
pub(super) struct NoCpuController;

/// The hierarchy with the cpu controller: v2 when it has it, else v1.
pub(super) fn detect() -> Result<(PathBuf, Version), NoCpuController> {
    let mounts = crate::procs::cgroup_mounts();
    let pick = |v2: bool| mounts.iter().find(|m| m.cpu && m.v2 == v2).map(|m| m.dir.clone());
    match (pick(true), pick(false)) {
        (Some(dir), _) => Ok((dir, Version::V2)),
        (None, Some(dir)) => Ok((dir, Version::V1)),
        (None, None) => Err(NoCpuController),
    }
}

/// The cgroup of `tgid` in a hierarchy of `version` (relative path).
pub(super) fn cgroup_of(tgid: u32, version: Version) -> Option<String> {
    crate::procs::process_cgroups(tgid).into_iter().find(|(v2, _)| *v2 == (version == Version::V2)).map(|(_, p)| p)
}

/// The files a cap and a weight are written to, in the order to write them.
pub(super) fn cap_files(version: Version) -> &'static [&'static str] {
    match version {
        Version::V2 => &["cpu.max", "cpu.weight"],
        Version::V1 => &["cpu.cfs_period_us", "cpu.cfs_quota_us", "cpu.shares"],
    }
}

/// A bandwidth period in µs, within what the kernel accepts (1 ms..1 s, the
/// range the configuration validates).
pub(super) fn period_us(period: std::time::Duration) -> u64 {
    period.as_micros().clamp(1_000, 1_000_000) as u64
}

/// Writes `cores` over `period_us`, scaled by the latency guard's
/// `quota` factor, and the weight of `cores` (default: one core's) scaled
/// by its `weight` factor, into `dir`.
pub(super) fn write_cap(
    dir: &Path,
    version: Version,
    cores: f64,
    factors: Factors,
    weighted: bool,
    period_us: u64,
) -> std::io::Result<()> {
    let quota = quota_us(cores * factors.quota, period_us);
    match version {
        Version::V2 => std::fs::write(dir.join("cpu.max"), format!("{quota} {period_us}"))?,
        Version::V1 => {
            std::fs::write(dir.join("cpu.cfs_period_us"), period_us.to_string())?;
            std::fs::write(dir.join("cpu.cfs_quota_us"), quota.to_string())?;
        }
    }
    write_weight(dir, version, whole_weight(cores, weighted) * factors.weight)
}

/// The cores a cgroup capped at `cores` is weighed as: its cap when caps
/// are weighted, else one core (the default weight).
pub(super) fn whole_weight(cores: f64, weighted: bool) -> f64 {
    if weighted { cores } else { 1.0 }
}

/// The quota written for `cores` over `period_us`: at least 1 ms, the
/// kernel's least.
pub(super) fn quota_us(cores: f64, period_us: u64) -> u64 {
    ((cores * period_us as f64).round() as u64).max(1000)
}

/// Writes the weight of `cores` into `dir`.
pub(super) fn write_weight(dir: &Path, version: Version, cores: f64) -> std::io::Result<()> {
    let (file, w) = weight(version, cores);
    std::fs::write(dir.join(file), w.to_string())
}

/// The CPU weight of a cgroup capped at `cores`, as its version writes it:
/// the default weight per core.
pub(super) fn weight(version: Version, cores: f64) -> (&'static str, u64) {
    match version {
        Version::V2 => ("cpu.weight", ((cores * 100.0).round() as u64).clamp(1, 10_000)),
        Version::V1 => ("cpu.shares", ((cores * 1024.0).round() as u64).clamp(2, 262_144)),
    }
}

/// The latency guard's factors on a keyspace cgroup, as written: its quota
/// (rewritten at most once per `GUARD_PERIODS` bandwidth periods) and its weight
/// (at every step).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Factors {
    pub(super) quota: f64,
    pub(super) weight: f64,
}

impl Factors {
    pub(super) const WHOLE: Factors = Factors { quota: 1.0, weight: 1.0 };
}

/// Whether cgroup `path` (as /proc shows it) is a keyspace cgroup of some
/// governor agent (`/governor-ks-<id>`, `/governor-<hash>-ks-<id>`): never
/// where a process is put back to, as that agent may be gone and its cap
/// would hold the process with nobody to lift it.
pub(super) fn an_agents(path: &str) -> bool {
    let name = path.trim_start_matches('/');
    let Some((head, id)) = name.rsplit_once("-ks-") else { return false };
    let hashed = |h: &str| h.len() == 8 && h.bytes().all(|b| b.is_ascii_hexdigit());
    !name.contains('/')
        && !id.is_empty()
        && id.bytes().all(|b| b.is_ascii_digit())
        && (head == "governor" || head.strip_prefix("governor-").is_some_and(hashed))
}

/// Where a process found in cgroup `path` is put back to: there, unless it
/// is a keyspace cgroup of some agent ([`an_agents`]), then the root.
pub(super) fn put_back_to(path: String) -> String {
    if an_agents(&path) { "/".into() } else { path }
}

/// Writes `bytes` to `path` whole or not at all: a new file beside it,
/// synced, renamed over it. A crash or a full disk leaves the old file.
pub(super) fn write_whole(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".new");
    let tmp = PathBuf::from(tmp);
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()
    });
    match written.and_then(|()| std::fs::rename(&tmp, path)) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agents_keyspace_cgroups_are_told_by_their_names() {
        for yes in ["/governor-ks-960", "/governor-5f6dc58d-ks-1", "governor-ks-0"] {
            assert!(an_agents(yes), "{yes}");
        }
        for no in
            ["/", "/system.slice/governor-ks-1", "/governor-ks-", "/governor-xyz-ks-1", "/governor-ks-1a", "/gov-ks-1"]
        {
            assert!(!an_agents(no), "{no}");
        }
    }

    #[test]
    fn a_file_written_whole_replaces_the_old_one_or_leaves_it() {
        let dir = std::env::temp_dir().join(format!("governor-write-whole-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("state.json");
        write_whole(&p, b"one").unwrap();
        write_whole(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        // Its directory gone: an error, nothing half written anywhere.
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(write_whole(&p, b"three").is_err());
        assert!(!dir.exists());
    }
}
