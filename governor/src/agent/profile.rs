//! `governor profile`: where each keyspace's CPU goes, by stack.
//!
//! The kernel samples every CPU at the asked frequency while the profile
//! runs and counts each tagged task's user and kernel stacks under the tag
//! it works for at that instant (`gov_profile`), so two keyspaces served by
//! the same threads get their own stacks. The agent reads the counts four
//! times a second and, for every stack it has not seen, turns the user
//! addresses into file offsets while the process is alive (its mappings are
//! gone once it exits), so a process that exits mid-profile still shows
//! what it ran. Symbols are looked up at the end, from the files. All of it
//! runs off the runtime's threads; only this connection waits.

use super::Shared;
use crate::measure::profile::ProfileError;
use crate::proto::{ProfileKeyspace, ProfileReport, ProfileStack, Reply};
use blazesym::normalize::{Normalizer, UserMeta};
use blazesym::symbolize::source::{Elf, Kernel, Source};
use blazesym::symbolize::{Input, Symbolized, Symbolizer};
use keyspace_governor_common::{LOST_STACK, NO_STACK, ProfileKey};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest profile, seconds.
pub(crate) const MAX_SECONDS: f64 = 300.0;
/// Highest sampling frequency per CPU.
pub(crate) const MAX_FREQUENCY_HZ: u32 = 1000;

/// Which keyspaces a report keeps.
#[derive(Clone, Copy, Debug)]
pub(super) enum Pick {
    /// This one.
    One(u32),
    /// The N with the most samples.
    Top(usize),
    All,
}

/// A user frame as the process mapped it.
#[derive(Clone, Debug)]
enum UserFrame {
    /// An offset into a file (an executable or a shared library).
    File { path: PathBuf, offset: u64 },
    /// A name the normalizer knew at once (the vDSO's, say).
    Named(String),
    /// Nothing mapped there (a stack walked without frame pointers).
    Unknown,
}

/// What one profile has gathered.
#[derive(Default)]
struct Session {
    counts: HashMap<ProfileKey, u64>,
    /// By (process, user stack key), innermost first.
    user: HashMap<(u32, u64), Vec<UserFrame>>,
    /// By kernel stack key, innermost first.
    kernel: HashMap<u64, Vec<u64>>,
    /// Tag → keyspace, as the directory said when the tag was first seen.
    keyspaces: HashMap<u32, u32>,
    /// Process names, read when first seen.
    names: HashMap<u32, String>,
    /// Samples the kernel could not key (its table full).
    dropped: u64,
}

impl Session {
    /// Readies every stack not seen before; with `counts` (the last read,
    /// once sampling stopped) also reads the kernel's counts. The reads
    /// while sampling take the keys alone: one system call a key, not two.
    fn collect(&mut self, shared: &Shared, counts: bool) {
        let ids: HashMap<u32, u32> =
            shared.policy.regions().directory().live().map(|(id, cell)| (cell + 1, id)).collect();
        let mut new_user = Vec::new();
        let mut pending = std::collections::HashSet::new();
        {
            let m = shared.lock_measurement();
            self.dropped = m.profile_dropped();
            let keys: Vec<(ProfileKey, Option<u64>)> = if counts {
                m.profile_counts().into_iter().map(|(k, n)| (k, Some(n))).collect()
            } else {
                m.profile_keys().into_iter().map(|k| (k, None)).collect()
            };
            for (key, n) in keys {
                if let Some(n) = n {
                    self.counts.insert(key, n);
                }
                if let Some(&id) = ids.get(&key.tag) {
                    self.keyspaces.entry(key.tag).or_insert(id);
                }
                if key.user_stack > LOST_STACK
                    && !self.user.contains_key(&(key.tgid, key.user_stack))
                    && pending.insert((key.tgid, key.user_stack))
                    && let Some(ips) = m.profile_stack(key.user_stack)
                {
                    new_user.push((key.tgid, key.user_stack, ips));
                }
                if key.kernel_stack > LOST_STACK
                    && !self.kernel.contains_key(&key.kernel_stack)
                    && let Some(ips) = m.profile_stack(key.kernel_stack)
                {
                    self.kernel.insert(key.kernel_stack, ips);
                }
            }
        }
        // Outside the lock: the process's mappings, from /proc.
        let normalizer = Normalizer::new();
        for (tgid, id, ips) in new_user {
            self.names.entry(tgid).or_insert_with(|| process_name(tgid));
            self.user.insert((tgid, id), normalize(&normalizer, tgid, &ips));
        }
    }

    /// The report: the keyspaces `pick` keeps, their symbols looked up
    /// (only theirs), their stacks merged by keyspace, process and frames.
    fn report(self, seconds: f64, frequency_hz: u32, pick: Pick, cpu: &BTreeMap<u32, f64>) -> ProfileReport {
        let mut totals: BTreeMap<u32, u64> = BTreeMap::new();
        for (key, n) in &self.counts {
            if let Some(&ks) = self.keyspaces.get(&key.tag) {
                *totals.entry(ks).or_default() += n;
            }
        }
        let kept: std::collections::HashSet<u32> = match pick {
            Pick::One(ks) => [ks].into(),
            Pick::All => totals.keys().copied().collect(),
            Pick::Top(n) => {
                let mut busiest: Vec<(u32, u64)> = totals.iter().map(|(k, v)| (*k, *v)).collect();
                busiest.sort_by_key(|&(k, v)| (std::cmp::Reverse(v), k));
                busiest.into_iter().take(n).map(|(k, _)| k).collect()
            }
        };
        let counts: Vec<(&ProfileKey, &u64)> = self
            .counts
            .iter()
            .filter(|(key, _)| self.keyspaces.get(&key.tag).is_some_and(|ks| kept.contains(ks)))
            .collect();
        let symbolizer = Symbolizer::new();
        let user_names = symbolize_user(
            &symbolizer,
            counts.iter().filter_map(|(k, _)| self.user.get(&(k.tgid, k.user_stack))).flatten(),
        );
        let kernel_names = symbolize_kernel(
            &symbolizer,
            counts.iter().filter_map(|(k, _)| self.kernel.get(&k.kernel_stack)).flatten().copied(),
        );
        let mut merged: BTreeMap<(u32, u8, u32, Vec<String>), u64> = BTreeMap::new();
        let mut by_keyspace: BTreeMap<u32, u64> = BTreeMap::new();
        let mut lost = 0;
        for (key, n) in counts {
            let Some(&ks) = self.keyspaces.get(&key.tag) else { continue };
            *by_keyspace.entry(ks).or_default() += n;
            let mut frames = vec![self.names.get(&key.tgid).cloned().unwrap_or_else(|| process_name(key.tgid))];
            match self.user.get(&(key.tgid, key.user_stack)) {
                Some(stack) => frames.extend(stack.iter().rev().flat_map(|f| user_frame_names(f, &user_names))),
                None if key.user_stack == NO_STACK => {}
                None => frames.push("[lost]".into()),
            }
            match self.kernel.get(&key.kernel_stack) {
                Some(stack) => frames.extend(
                    stack.iter().rev().map(|ip| format!("{}_[k]", kernel_names.get(ip).map_or("[unknown]", |s| s))),
                ),
                None if key.kernel_stack == NO_STACK => {}
                None => frames.push("[lost]_[k]".into()),
            }
            // Walked but not kept (the table full, or the walk failed), or
            // kept but gone by the time it was read.
            let missing = |s: u64, known: bool| s == LOST_STACK || (s != NO_STACK && !known);
            if missing(key.user_stack, self.user.contains_key(&(key.tgid, key.user_stack)))
                || missing(key.kernel_stack, self.kernel.contains_key(&key.kernel_stack))
            {
                lost += n;
            }
            let kind = u8::try_from(key.kind).unwrap_or(0);
            *merged.entry((ks, kind, key.tgid, frames)).or_default() += n;
        }
        let mut keyspaces: Vec<ProfileKeyspace> = by_keyspace
            .into_iter()
            .map(|(keyspace_id, samples)| ProfileKeyspace {
                keyspace_id,
                samples,
                cpu_seconds: cpu.get(&keyspace_id).copied().unwrap_or(0.0),
            })
            .collect();
        keyspaces.sort_by(|a, b| b.samples.cmp(&a.samples).then(a.keyspace_id.cmp(&b.keyspace_id)));
        let mut stacks: Vec<ProfileStack> = merged
            .into_iter()
            .map(|((keyspace_id, kind, pid, frames), samples)| ProfileStack { keyspace_id, kind, pid, frames, samples })
            .collect();
        stacks.sort_by_key(|s| std::cmp::Reverse(s.samples));
        ProfileReport {
            seconds,
            frequency_hz,
            cpus: crate::sys::online_cpus().map_or(0, |c| c.len() as u32),
            keyspaces,
            stacks,
            lost_stacks: lost,
            dropped_samples: self.dropped,
        }
    }
}

fn process_name(tgid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{tgid}/comm"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| format!("[pid {tgid}]"))
}

/// User addresses as file offsets (a return address points after its
/// call: one byte back names the calling line).
fn normalize(normalizer: &Normalizer, tgid: u32, ips: &[u64]) -> Vec<UserFrame> {
    let addrs: Vec<u64> =
        ips.iter().enumerate().map(|(i, ip)| if i == 0 { *ip } else { ip.saturating_sub(1) }).collect();
    let Ok(out) = normalizer.normalize_user_addrs(blazesym::Pid::from(tgid), &addrs) else {
        return addrs.iter().map(|_| UserFrame::Unknown).collect();
    };
    out.outputs
        .iter()
        .map(|&(offset, meta)| match out.meta.get(meta) {
            Some(UserMeta::Elf(elf)) => UserFrame::File { path: elf.path.clone(), offset },
            Some(UserMeta::Sym(sym)) => UserFrame::Named(sym.name.to_string()),
            _ => UserFrame::Unknown,
        })
        .collect()
}

/// A symbol and the functions inlined into it at the address, outermost
/// first.
fn names_of(s: &Symbolized<'_>) -> Option<Vec<String>> {
    let sym = s.as_sym()?;
    let mut names = vec![sym.name.to_string()];
    names.extend(sym.inlined.iter().map(|f| f.name.to_string()));
    Some(names)
}

fn symbolize_user<'a>(
    symbolizer: &Symbolizer,
    frames: impl Iterator<Item = &'a UserFrame>,
) -> HashMap<(PathBuf, u64), Vec<String>> {
    let mut by_file: HashMap<&PathBuf, Vec<u64>> = HashMap::new();
    for f in frames {
        if let UserFrame::File { path, offset } = f {
            by_file.entry(path).or_default().push(*offset);
        }
    }
    let mut names = HashMap::new();
    for (path, mut offsets) in by_file {
        offsets.sort_unstable();
        offsets.dedup();
        let src = Source::Elf(Elf::new(path));
        let Ok(found) = symbolizer.symbolize(&src, Input::FileOffset(&offsets)) else { continue };
        for (offset, s) in offsets.iter().zip(&found) {
            if let Some(n) = names_of(s) {
                names.insert((path.clone(), *offset), n);
            }
        }
    }
    names
}

fn symbolize_kernel(symbolizer: &Symbolizer, ips: impl Iterator<Item = u64>) -> HashMap<u64, String> {
    let mut ips: Vec<u64> = ips.collect();
    ips.sort_unstable();
    ips.dedup();
    let src = Source::Kernel(Kernel::default());
    let Ok(found) = symbolizer.symbolize(&src, Input::AbsAddr(&ips)) else { return HashMap::new() };
    ips.into_iter().zip(found.iter()).filter_map(|(ip, s)| Some((ip, s.as_sym()?.name.to_string()))).collect()
}

fn user_frame_names(f: &UserFrame, names: &HashMap<(PathBuf, u64), Vec<String>>) -> Vec<String> {
    match f {
        UserFrame::File { path, offset } => match names.get(&(path.clone(), *offset)) {
            Some(n) => n.clone(),
            None => {
                // No symbol there (a stripped binary): the file alone, so
                // its samples stack up as one frame instead of one per
                // instruction.
                let file = path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into());
                vec![format!("[{file}]")]
            }
        },
        UserFrame::Named(n) => vec![n.clone()],
        UserFrame::Unknown => vec!["[unknown]".into()],
    }
}

/// CPU charged so far, by keyspace.
fn charged(shared: &Shared) -> BTreeMap<u32, f64> {
    shared.status().keyspaces.iter().map(|k| (k.keyspace_id, k.cpu_seconds)).collect()
}

async fn off_runtime<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, ProfileError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ProfileError::Worker(e.to_string()))
}

/// Takes a profile of `seconds` at `frequency_hz` per CPU of the keyspaces
/// `pick` names, and answers with it.
pub(super) async fn take(shared: &Arc<Shared>, seconds: f64, frequency_hz: u32, pick: Pick) -> Reply {
    match run(shared, seconds, frequency_hz, pick).await {
        Ok(report) => Reply::Profile(Box::new(report)),
        Err(e) => Reply::Error { message: e.to_string() },
    }
}

async fn run(shared: &Arc<Shared>, seconds: f64, frequency_hz: u32, pick: Pick) -> Result<ProfileReport, ProfileError> {
    if !(seconds > 0.0 && seconds <= MAX_SECONDS) {
        return Err(ProfileError::Seconds { got: seconds, max: MAX_SECONDS });
    }
    if !(1..=MAX_FREQUENCY_HZ).contains(&frequency_hz) {
        return Err(ProfileError::Frequency { got: frequency_hz, max: MAX_FREQUENCY_HZ });
    }
    let s = shared.clone();
    // The CPU charged is read right after sampling starts and right before
    // it stops, so it spans what was sampled (not the attach, the last
    // stacks' look-up or the clean-up around it).
    let before = off_runtime(move || {
        s.lock_measurement().profile_start(u64::from(frequency_hz))?;
        Ok::<_, ProfileError>(charged(&s))
    })
    .await??;
    let started = Instant::now();
    let end = started + Duration::from_secs_f64(seconds);
    let mut session = Session::default();
    loop {
        let now = Instant::now();
        if now >= end {
            break;
        }
        tokio::time::sleep((end - now).min(Duration::from_millis(250))).await;
        let s = shared.clone();
        session = match off_runtime(move || {
            session.collect(&s, false);
            session
        })
        .await
        {
            Ok(session) => session,
            Err(e) => {
                let s = shared.clone();
                let _ = off_runtime(move || s.lock_measurement().profile_stop()).await;
                return Err(e);
            }
        };
    }
    let s = shared.clone();
    off_runtime(move || {
        let after = charged(&s);
        s.lock_measurement().profile_stop();
        let took = started.elapsed().as_secs_f64();
        session.collect(&s, true);
        s.lock_measurement().profile_clear();
        let cpu: BTreeMap<u32, f64> =
            after.iter().map(|(k, v)| (*k, v - before.get(k).copied().unwrap_or(0.0))).collect();
        session.report(took, frequency_hz, pick, &cpu)
    })
    .await
}
