//! The kernel side of a profile: `gov_profile`, loaded with the other
//! programs but attached (one CPU-clock perf event per online CPU, at the
//! profile's frequency) only while a profile is taken, and its two maps:
//! the samples counted by (tag, process, stacks) and the stacks themselves,
//! by the hash of their addresses.
//! Nothing is sampled and nothing is paid while no profile runs.

use super::{MeasureError, Measurement, take_map};
use crate::sys;
use aya::Ebpf;
use aya::maps::{Array, HashMap, MapData};
use aya::programs::PerfEvent;
use aya::programs::perf_event::{PerfEventLinkId, PerfEventScope, PerfTypeId, SamplePolicy, perf_sw_ids};
use keyspace_governor_common::{MAP_PROFILE_DROPPED, MAP_SAMPLES, MAP_STACKS, PROG_PROFILE, ProfileKey, StackFrames};

/// The profile program's maps and, while a profile runs, its perf events.
pub struct ProfileProbe {
    stacks: HashMap<MapData, u64, StackFrames>,
    samples: HashMap<MapData, ProfileKey, u64>,
    /// Samples that found `samples` full.
    dropped: Array<MapData, u64>,
    links: Vec<PerfEventLinkId>,
}

/// Why a profile cannot be taken.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("profiles need the eBPF backend and its profile program; this agent has neither (see its log)")]
    NoKernelSide,
    #[error("a profile is being taken already; one at a time")]
    Busy,
    #[error("attaching the profile's perf events failed: {0}")]
    Attach(String),
    #[error("profile seconds must be in (0, {max}], got {got}")]
    Seconds { got: f64, max: f64 },
    #[error("profile frequency must be 1..={max} Hz, got {got}")]
    Frequency { got: u32, max: u32 },
    #[error("the profile's worker failed: {0}")]
    Worker(String),
}

fn program(ebpf: &mut Ebpf) -> Result<&mut PerfEvent, MeasureError> {
    ebpf.program_mut(PROG_PROFILE)
        .ok_or_else(|| MeasureError::Attach { program: PROG_PROFILE, source: "not in the object".into() })?
        .try_into()
        .map_err(|e| MeasureError::Attach { program: PROG_PROFILE, source: Box::new(e) })
}

impl ProfileProbe {
    /// Loads the program (not attached) and takes its maps.
    pub(super) fn load(ebpf: &mut Ebpf) -> Result<ProfileProbe, MeasureError> {
        program(ebpf)?.load().map_err(|e| MeasureError::Attach { program: PROG_PROFILE, source: Box::new(e) })?;
        let stacks = take_map(ebpf, MAP_STACKS)?;
        let samples = take_map(ebpf, MAP_SAMPLES)?;
        let dropped = take_map(ebpf, MAP_PROFILE_DROPPED)?;
        Ok(ProfileProbe { stacks, samples, dropped, links: Vec::new() })
    }
}

impl ProfileProbe {
    fn attach(&mut self, ebpf: &mut Ebpf, frequency_hz: u64) -> Result<(), ProfileError> {
        if !self.links.is_empty() {
            return Err(ProfileError::Busy);
        }
        let prog = program(ebpf).map_err(|e| ProfileError::Attach(e.to_string()))?;
        let mut links = Vec::new();
        let online = sys::online_cpus().map_err(|e| ProfileError::Attach(format!("online CPUs: {e}")))?;
        for cpu in online {
            match prog.attach(
                PerfTypeId::Software,
                perf_sw_ids::PERF_COUNT_SW_CPU_CLOCK as u64,
                PerfEventScope::AllProcessesOneCpu { cpu },
                SamplePolicy::Frequency(frequency_hz),
                true,
            ) {
                Ok(link) => links.push(link),
                Err(e) => {
                    for link in links {
                        let _ = prog.detach(link);
                    }
                    return Err(ProfileError::Attach(format!("CPU {cpu}: {e}")));
                }
            }
        }
        self.links = links;
        Ok(())
    }

    fn detach(&mut self, ebpf: &mut Ebpf) {
        let links = std::mem::take(&mut self.links);
        if let Ok(prog) = program(ebpf) {
            for link in links {
                if let Err(e) = prog.detach(link) {
                    log::warn!("profile: detaching a perf event failed: {e}");
                }
            }
        }
    }
}

impl Measurement {
    /// Starts sampling tagged tasks at `frequency_hz` on every online CPU.
    pub fn profile_start(&mut self, frequency_hz: u64) -> Result<(), ProfileError> {
        let (ebpf, probe) = self.profile_parts().ok_or(ProfileError::NoKernelSide)?;
        probe.attach(ebpf, frequency_hz)
    }

    /// Stops sampling (what was counted stays until [`Self::profile_clear`]).
    pub fn profile_stop(&mut self) {
        if let Some((ebpf, probe)) = self.profile_parts() {
            probe.detach(ebpf);
        }
    }

    /// The samples counted so far, by key.
    pub fn profile_counts(&self) -> Vec<(ProfileKey, u64)> {
        match self.profile_probe() {
            Some(probe) => probe.samples.iter().filter_map(Result::ok).collect(),
            None => Vec::new(),
        }
    }

    /// The keys counted so far, without their counts.
    pub fn profile_keys(&self) -> Vec<ProfileKey> {
        match self.profile_probe() {
            Some(probe) => probe.samples.keys().filter_map(Result::ok).collect(),
            None => Vec::new(),
        }
    }

    /// Samples counted nowhere so far: the hash of keys was full.
    pub fn profile_dropped(&self) -> u64 {
        self.profile_probe().and_then(|p| p.dropped.get(&0, 0).ok()).unwrap_or(0)
    }

    /// The instruction pointers of the stack kept under `key`, innermost
    /// first.
    pub fn profile_stack(&self, key: u64) -> Option<Vec<u64>> {
        let frames = self.profile_probe()?.stacks.get(&key, 0).ok()?;
        Some(frames.ips.iter().copied().take_while(|&ip| ip != 0).collect())
    }

    /// Forgets every sample and stack, for the next profile.
    pub fn profile_clear(&mut self) {
        let Some((_, probe)) = self.profile_parts() else { return };
        let keys: Vec<ProfileKey> = probe.samples.keys().filter_map(Result::ok).collect();
        for k in keys {
            let _ = probe.samples.remove(&k);
        }
        let stacks: Vec<u64> = probe.stacks.keys().filter_map(Result::ok).collect();
        for s in stacks {
            let _ = probe.stacks.remove(&s);
        }
        let _ = probe.dropped.set(0, 0, 0);
    }
}
