//! Measurement backends: where the regions come from and who plays the
//! kernel's side of the charging protocol.
//!
//! - [`ebpf`]: BPF array maps (mmapable) and the programs of governor-ebpf.
//! - [`btf`]: the `task_struct` field offsets those programs read, from
//!   the running kernel's BTF.
//! - [`fallback`]: memfd regions; the agent samples schedstat of registered
//!   threads and charges with the same CAS the threads use.

pub mod btf;
pub mod ebpf;
pub mod fallback;
pub mod profile;

use crate::proto::{BackendKind, ProgramStats};
use crate::region::{MeasureRegions, RegionError, RegionSizes, Table, WaitView};
use std::os::fd::{AsRawFd, OwnedFd};

pub use crate::config::MeasureMode;

#[derive(Debug, thiserror::Error)]
pub enum MeasureError {
    #[error(
        "eBPF measurement needs {missing}, which this process lacks: run the agent as root or grant CAP_BPF and CAP_PERFMON (or use --measure=auto to fall back)"
    )]
    MissingCapability { missing: String },
    #[error("this kernel cannot run the eBPF backend")]
    KernelUnsupported(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("loading the eBPF programs failed")]
    Load(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("attaching {program} failed")]
    Attach {
        program: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("creating the {what} region failed")]
    Region {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Map(#[from] RegionError),
    #[error("registering tid {tid} in the kernel map failed: {reason}")]
    Register { tid: u32, reason: String },
}

/// Takes map `name` out of the object as the typed map `M`.
fn take_map<M: TryFrom<aya::maps::Map>>(ebpf: &mut aya::Ebpf, name: &str) -> Result<M, MeasureError> {
    let missing = || MeasureError::Load(format!("map {name} missing or of another type").into());
    M::try_from(ebpf.take_map(name).ok_or_else(missing)?).map_err(|_| missing())
}

/// What is asked of a backend at start: region sizes, the timer, and
/// whether keyspaces' CPU pressure is counted (`agent.cpu-pressure`).
#[derive(Clone, Copy, Debug)]
pub struct Sizing {
    pub max_threads: u32,
    pub max_keyspaces: u32,
    pub timer_period_ns: u64,
    pub cpu_pressure: bool,
}

/// A running backend: the regions (with the fds handed to clients) plus
/// the backend-specific side.
pub struct Measurement {
    pub kind: BackendKind,
    pub regions: MeasureRegions,
    pub sizes: RegionSizes,
    /// Run-queue waits by keyspace cell (the agent's alone).
    pub waits: Table<WaitView>,
    /// How the waits are measured.
    pub wait_source: WaitSource,
    /// Whether the kernel counts each keyspace's waiting threads (the
    /// "some" pressure; eBPF backend with `sched_info` and SMP).
    pub pressure: bool,
    /// cpus, slots, keyspaces.
    fds: [OwnedFd; 3],
    inner: Inner,
}

/// Where a keyspace's run-queue wait comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitSource {
    /// The kernel's `sched_info`, charged at each switch: exact.
    Kernel,
    /// The agent's schedstat samples of registered threads (fallback
    /// backend): a wait is charged to the tag its thread has at the sample.
    Sampled,
    /// Not measured: the kernel keeps no `sched_info`.
    Unavailable,
}

impl WaitSource {
    pub fn as_str(self) -> &'static str {
        match self {
            WaitSource::Kernel => "kernel",
            WaitSource::Sampled => "sampled",
            WaitSource::Unavailable => "unavailable",
        }
    }
}

enum Inner {
    Ebpf(Box<ebpf::EbpfSide>),
    Fallback,
}

impl Measurement {
    /// Starts the backend `mode` asks for.
    pub fn start(mode: MeasureMode, sizing: Sizing) -> Result<Measurement, MeasureError> {
        match mode {
            MeasureMode::ThreadClock => fallback::start(sizing),
            MeasureMode::Ebpf => ebpf::start(sizing),
            MeasureMode::Auto => match ebpf::start(sizing) {
                Ok(m) => Ok(m),
                Err(e) => {
                    log::warn!(
                        "eBPF measurement unavailable ({}), using the thread-clock fallback",
                        crate::error_chain(&e)
                    );
                    fallback::start(sizing)
                }
            },
        }
    }

    /// (cpus, slots, keyspaces) descriptors, to hand to clients.
    pub fn raw_fds(&self) -> [i32; 3] {
        [self.fds[0].as_raw_fd(), self.fds[1].as_raw_fd(), self.fds[2].as_raw_fd()]
    }

    /// Makes the kernel side charge `tid` into `slot`.
    pub fn attach_thread(&mut self, tid: u32, slot: u32) -> Result<(), MeasureError> {
        match &mut self.inner {
            Inner::Ebpf(side) => side.insert_tid(tid, slot),
            Inner::Fallback => Ok(()),
        }
    }

    /// Stops charging `tid`.
    pub fn detach_thread(&mut self, tid: u32) {
        if let Inner::Ebpf(side) = &mut self.inner {
            side.remove_tid(tid);
        }
    }

    pub fn program_stats(&self) -> Vec<ProgramStats> {
        match &self.inner {
            Inner::Ebpf(side) => side.program_stats(),
            Inner::Fallback => Vec::new(),
        }
    }

    /// The maps of rule measurement; `None` on the fallback backend, which
    /// has no kernel side to measure unregistered processes with.
    pub fn rules(&mut self) -> Option<&mut ebpf::RuleMaps> {
        match &mut self.inner {
            Inner::Ebpf(side) => Some(&mut side.rules),
            Inner::Fallback => None,
        }
    }

    fn ebpf_side(&mut self) -> Option<&mut ebpf::EbpfSide> {
        match &mut self.inner {
            Inner::Ebpf(side) => Some(side),
            Inner::Fallback => None,
        }
    }

    /// The loaded object and the profile program's side, when both are there.
    fn profile_parts(&mut self) -> Option<(&mut aya::Ebpf, &mut profile::ProfileProbe)> {
        let side = self.ebpf_side()?;
        Some((&mut side.ebpf, side.profile.as_mut()?))
    }

    fn profile_probe(&self) -> Option<&profile::ProfileProbe> {
        self.ebpf_side_ref()?.profile.as_ref()
    }

    fn ebpf_side_ref(&self) -> Option<&ebpf::EbpfSide> {
        match &self.inner {
            Inner::Ebpf(side) => Some(side),
            Inner::Fallback => None,
        }
    }

    pub fn is_fallback(&self) -> bool {
        matches!(self.inner, Inner::Fallback)
    }
}
