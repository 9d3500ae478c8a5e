//! Putting back what the enforcer changed: a keyspace's processes where
//! they came from and its cgroup removed, the operator's cgroup values a cap
//! in place replaced, and everything at stop (or at the start after a
//! crash, from the state file).

use super::files::{Version, cap_files};
use super::{Enforcer, State};
use std::path::Path;

/// What the cap files of cgroup `dir` hold now, trimmed.
pub(super) fn read_values(dir: &Path, version: Version) -> Vec<(String, String)> {
    cap_files(version)
        .iter()
        .filter_map(|f| Some((f.to_string(), std::fs::read_to_string(dir.join(f)).ok()?.trim().to_string())))
        .collect()
}

impl Enforcer {
    pub(super) fn move_back(&self, root: &Path, tgid: u32, orig: &str) {
        let target = root.join(orig.trim_start_matches('/'));
        let target = if target.is_dir() { target } else { root.to_path_buf() };
        if let Err(e) = std::fs::write(target.join("cgroup.procs"), tgid.to_string())
            && e.raw_os_error() != Some(libc::ESRCH)
        {
            log::warn!("cgroups: cannot move process {tgid} back to {}: {e}", target.display());
        }
    }

    /// Moves every process of `keyspace`'s cgroup back and removes it.
    pub(super) fn release_keyspace(&mut self, keyspace: u32) {
        self.unmoved.retain(|_, (k, _)| *k != keyspace);
        let Some(rel) = self.state.created.remove(&keyspace) else { return };
        let Some((root, _)) = self.state.root.clone() else { return };
        let dir = root.join(&rel);
        // Children forked inside go where their ancestor came from (or the root).
        let fallback = self.state.moved.values().next().cloned().unwrap_or_else(|| "/".into());
        for _ in 0..3 {
            let procs: Vec<u32> = std::fs::read_to_string(dir.join("cgroup.procs"))
                .unwrap_or_default()
                .lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect();
            if procs.is_empty() {
                break;
            }
            for p in procs {
                let orig = self.state.moved.remove(&p).unwrap_or_else(|| fallback.clone());
                self.move_back(&root, p, &orig);
            }
        }
        if let Err(e) = std::fs::remove_dir(&dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            log::warn!("cgroups: cannot remove {}: {e}", dir.display());
        }
        self.save();
    }

    /// Records what an in-place cap's files hold after the agent wrote
    /// them (`InPlace::written`), in the state file when it changed.
    pub(super) fn note_written(&mut self, keyspace: u32) {
        let Some((root, version)) = self.state.root.clone() else { return };
        let Some(p) = self.state.in_place.get_mut(&keyspace) else { return };
        let dir = root.join(p.rel.trim_start_matches('/'));
        // Gone or made anew since (a service restarted): nothing of ours is there.
        if p.ino != 0 && super::dir_ino(&dir) != p.ino {
            log::info!("cgroups: {} is gone or was made anew since it was capped: nothing to put back", dir.display());
            return;
        }
        let now = read_values(&dir, version);
        if now != p.written {
            p.written = now;
            self.save();
        }
    }

    /// Puts back what a keyspace's in-place cap replaced: each file that
    /// still holds what the agent wrote (one the operator changed since
    /// stays as they left it, and the log says so).
    pub(super) fn restore_in_place(&mut self, keyspace: u32) {
        let Some(p) = self.state.in_place.remove(&keyspace) else { return };
        let Some((root, version)) = self.state.root.clone() else { return };
        let dir = root.join(p.rel.trim_start_matches('/'));
        // Gone or made anew since (a service restarted): nothing of ours is there.
        if p.ino != 0 && super::dir_ino(&dir) != p.ino {
            log::info!("cgroups: {} is gone or was made anew since it was capped: nothing to put back", dir.display());
            return;
        }
        let now = read_values(&dir, version);
        let changed = |file: &str| {
            let holds = now.iter().find(|(f, _)| f == file).map(|(_, v)| v);
            let wrote = p.written.iter().find(|(f, _)| f == file).map(|(_, v)| v);
            matches!((holds, wrote), (Some(h), Some(w)) if h != w)
        };
        // cgroup v1's quota and period are one setting: both stay if either changed.
        let pair = ["cpu.cfs_period_us", "cpu.cfs_quota_us"];
        let pair_changed = pair.iter().any(|f| changed(f));
        for (file, value) in &p.saved {
            if changed(file) || (pair_changed && pair.contains(&file.as_str())) {
                log::warn!(
                    "cgroups: {} was changed by someone else since the agent wrote it{}: left as it is",
                    dir.join(file).display(),
                    if changed(file) { "" } else { " (with the other half of the quota and period)" }
                );
                continue;
            }
            if let Err(e) = std::fs::write(dir.join(file), value)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                log::warn!("cgroups: cannot put {value:?} back into {}: {e}", dir.join(file).display());
            }
        }
        self.save();
    }

    pub(super) fn remove_slice(&mut self) {
        if let (Some((root, _)), Some(slice)) = (self.state.root.clone(), self.state.slice.take()) {
            let _ = std::fs::remove_dir(root.join(slice));
        }
    }

    /// Removes the keyspace cgroups of this agent's name that no record
    /// names (a record a full disk kept from being written, or one lost):
    /// their processes go to the root of the hierarchy, as nothing says
    /// where they came from. Agents on other sockets have other names.
    pub(super) fn sweep(&mut self) {
        let Some((root, version)) = self.hierarchy.clone() else { return };
        let Ok(entries) = std::fs::read_dir(&root) else { return };
        let mine = format!("{}-ks-", self.prefix);
        let found: Vec<(u32, String)> = entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let id = name.strip_prefix(&mine)?.parse().ok()?;
                (!self.state.created.contains_key(&id)).then_some((id, name))
            })
            .collect();
        if found.is_empty() {
            return;
        }
        log::warn!(
            "cgroups: {} keyspace cgroups of this agent's name that no record names ({}): their processes go to the root",
            found.len(),
            found.iter().map(|(_, n)| n.as_str()).collect::<Vec<_>>().join(", ")
        );
        self.state.root.get_or_insert((root, version));
        for (id, name) in found {
            self.state.created.insert(id, name);
            self.release_keyspace(id);
        }
    }

    /// Puts everything back: processes where they were, no cgroups of ours.
    pub(crate) fn restore_all(&mut self) {
        if !self.state.created.is_empty() || !self.state.in_place.is_empty() {
            log::info!(
                "cgroups: putting back {} keyspace cgroups (their processes where they came from) and {} caps in place",
                self.state.created.len(),
                self.state.in_place.len()
            );
        }
        let keyspaces: Vec<u32> = self.state.created.keys().copied().collect();
        for ks in keyspaces {
            self.release_keyspace(ks);
        }
        let in_place: Vec<u32> = self.state.in_place.keys().copied().collect();
        for ks in in_place {
            self.restore_in_place(ks);
        }
        // What is left was not in a cgroup of ours (the keyspaces' own went
        // back above): moved elsewhere by the operator since, or gone, its
        // pid perhaps another process's now. It stays where it is.
        let left = std::mem::take(&mut self.state.moved);
        if !left.is_empty() {
            log::debug!(
                "cgroups: {} processes moved out of the keyspace cgroups since, or gone, left where they are",
                left.len()
            );
        }
        self.remove_slice();
        self.settings.caps.clear();
        self.guard.clear();
        self.guard_written.clear();
        self.guard_failed.clear();
        let _ = std::fs::remove_file(&self.state_path);
        self.state = State::default();
    }
}
