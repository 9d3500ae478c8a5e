//! A cap written into the operator's own cgroup (`cap-in-place`): what it
//! held is recorded first, to put back at stop or after a crash.

use super::files::{Version, write_cap};
use super::{Enforcer, restore};
use std::path::Path;

/// An operator's cgroup a keyspace is capped on.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct InPlace {
    pub(super) rel: String,
    pub(super) saved: Vec<(String, String)>,
    /// What the files held after the agent's last write: a file that holds
    /// something else when it is put back was changed by the operator since,
    /// and stays as they left it.
    #[serde(default)]
    pub(super) written: Vec<(String, String)>,
    /// The cgroup directory's inode: one made anew since (a service
    /// restarted) holds none of this, and is capped again.
    #[serde(default)]
    pub(super) ino: u64,
}

/// The inode of cgroup directory `dir`; 0 when it is not there.
pub(super) fn dir_ino(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(dir).map_or(0, |m| m.ino())
}

impl Enforcer {
    /// Caps keyspace `ks` on the operator's cgroup it is capped in place
    /// on, if that is there, its values kept first to put back; false when
    /// they could not be recorded (enforcement stopped).
    pub(super) fn cap_in_place(&mut self, ks: u32, root: &Path, version: Version) -> bool {
        let (Some(&cores), Some(rel)) = (self.settings.caps.get(&ks), self.capped_in_place.get(&ks)) else {
            return true;
        };
        let rel = rel.clone();
        let dir = root.join(rel.trim_start_matches('/'));
        let ino = dir_ino(&dir);
        if self.state.in_place.get(&ks).is_some_and(|p| p.ino != ino) {
            // Gone, or made anew: what the old one held went with it.
            log::info!(
                "cgroups: {} {} since keyspace {ks} was capped on it",
                dir.display(),
                if ino == 0 { "is gone" } else { "was made anew" }
            );
            self.state.in_place.remove(&ks);
            self.save();
        }
        if ino == 0 {
            return true;
        }
        if let std::collections::btree_map::Entry::Vacant(e) = self.state.in_place.entry(ks) {
            let saved = restore::read_values(&dir, version);
            e.insert(InPlace { rel, saved, written: Vec::new(), ino });
            if !self.save() {
                self.state.in_place.remove(&ks);
                self.unrecorded();
                return false;
            }
        }
        // A quota written refills its period: the guard's next write waits.
        self.guard_written.insert(ks, std::time::Instant::now());
        let (weighted, period_us) = (self.settings.weighted, self.settings.period_us);
        if let Err(e) = write_cap(&dir, version, cores, self.factors(ks), weighted, period_us) {
            log::warn!("cgroups: cannot cap {} in place: {e}", dir.display());
        }
        self.note_written(ks);
        true
    }
}
