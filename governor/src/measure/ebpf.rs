//! The eBPF backend: resolves the task fields the programs read from the
//! kernel's BTF, loads governor-ebpf with them, sizes and mmaps its array
//! maps, and attaches `tp_btf/sched_switch` and one software CPU-clock perf
//! event per online CPU.

use super::{Inner, MeasureError, Measurement, Sizing};
use crate::proto::{BackendKind, ProgramStats};
use crate::region::{fd, Access, MeasureRegions, RegionSizes, Table};
use crate::sys;
use aya::maps::{Map, MapData};
use aya::programs::perf_event::{perf_sw_ids, PerfEventScope, PerfTypeId, SamplePolicy};
use aya::programs::{BtfTracePoint, PerfEvent};
use aya::{Btf, Ebpf, EbpfLoader};
use governor_common::{
    GLOBAL_OFF_EXEC_START, GLOBAL_OFF_PID, GLOBAL_OFF_RUNTIME, GLOBAL_OFF_STATE, MAP_CPUS, MAP_KEYSPACES, MAP_SLOTS, MAP_TID_SLOT,
    PROG_SCHED_SWITCH, PROG_TIMER,
};
use std::sync::atomic::{AtomicU32, Ordering};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

/// What the eBPF backend keeps alive: the loaded object (its programs stay
/// attached while it lives) and the tid map the agent fills.
pub struct EbpfSide {
    ebpf: Ebpf,
    /// `tid → slot + 1`, mmapped: registering a thread is a store.
    tid_slot: Table<AtomicU32>,
    // Keep the maps alive: their fds back the mappings.
    _maps: Vec<MapData>,
}

fn boxed<E: std::error::Error + Send + Sync + 'static>(e: E) -> Box<dyn std::error::Error + Send + Sync> {
    Box::new(e)
}

/// Checks the capabilities eBPF loading needs, naming what is missing.
pub fn check_capabilities() -> Result<(), MeasureError> {
    let caps = sys::effective_caps().unwrap_or(0);
    let has = |c: u32| caps & (1u64 << c) != 0;
    if has(sys::CAP_SYS_ADMIN) || (has(sys::CAP_BPF) && has(sys::CAP_PERFMON)) {
        return Ok(());
    }
    let missing: Vec<&str> = [(sys::CAP_BPF, "CAP_BPF"), (sys::CAP_PERFMON, "CAP_PERFMON")]
        .into_iter()
        .filter(|(c, _)| !has(*c))
        .map(|(_, n)| n)
        .collect();
    Err(MeasureError::MissingCapability { missing: missing.join(" and ") })
}

pub fn start(sizing: Sizing) -> Result<Measurement, MeasureError> {
    check_capabilities()?;
    sys::raise_memlock();
    let ncpus = sys::possible_cpus().map_err(|source| MeasureError::Region { what: "cpu", source })?;
    let sizes = RegionSizes { cpus: ncpus, slots: sizing.max_threads, keyspaces: sizing.max_keyspaces, ledger: 0 };
    let max_tids = pid_max();
    let offsets = super::btf::Btf::from_sys_fs()
        .and_then(|b| b.task_offsets())
        .map_err(|e| MeasureError::KernelUnsupported(Box::new(e)))?;
    log::debug!("task_struct offsets from the kernel's BTF: {offsets:?}");
    let mut ebpf = EbpfLoader::new()
        .set_global(GLOBAL_OFF_PID, &offsets.pid, true)
        .set_global(GLOBAL_OFF_STATE, &offsets.state, true)
        .set_global(GLOBAL_OFF_RUNTIME, &offsets.sum_exec_runtime, true)
        .set_global(GLOBAL_OFF_EXEC_START, &offsets.exec_start, true)
        .set_max_entries(MAP_CPUS, sizes.cpus)
        .set_max_entries(MAP_SLOTS, sizes.slots)
        .set_max_entries(MAP_TID_SLOT, max_tids.div_ceil(2))
        .set_max_entries(MAP_KEYSPACES, sizes.keyspaces)
        .load(crate::EBPF_OBJECT)
        .map_err(|e| MeasureError::Load(boxed(e)))?;
    if let Err(e) = aya_log::EbpfLogger::init(&mut ebpf) {
        log::debug!("eBPF logger not started: {e}");
    }
    let btf = Btf::from_sys_fs().map_err(|e| MeasureError::Load(boxed(e)))?;

    let name = PROG_SCHED_SWITCH;
    let prog: &mut BtfTracePoint = ebpf
        .program_mut(name)
        .ok_or_else(|| MeasureError::Attach { program: name, source: "not in the object".into() })?
        .try_into()
        .map_err(|e| MeasureError::Attach { program: name, source: boxed(e) })?;
    prog.load("sched_switch", &btf).map_err(|e| MeasureError::Attach { program: name, source: boxed(e) })?;
    prog.attach().map_err(|e| MeasureError::Attach { program: name, source: boxed(e) })?;
    let timer: &mut PerfEvent = ebpf
        .program_mut(PROG_TIMER)
        .ok_or_else(|| MeasureError::Attach { program: PROG_TIMER, source: "not in the object".into() })?
        .try_into()
        .map_err(|e| MeasureError::Attach { program: PROG_TIMER, source: boxed(e) })?;
    timer.load().map_err(|e| MeasureError::Attach { program: PROG_TIMER, source: boxed(e) })?;
    let online = sys::online_cpus().map_err(|source| MeasureError::Region { what: "cpu", source })?;
    for cpu in online {
        timer
            .attach(
                PerfTypeId::Software,
                perf_sw_ids::PERF_COUNT_SW_CPU_CLOCK as u64,
                PerfEventScope::AllProcessesOneCpu { cpu },
                SamplePolicy::Period(sizing.timer_period_ns),
                true,
            )
            .map_err(|e| MeasureError::Attach { program: PROG_TIMER, source: boxed(e) })?;
    }

    let mut arrays = Vec::new();
    let mut fds = Vec::new();
    for name in [MAP_CPUS, MAP_SLOTS, MAP_KEYSPACES] {
        let data = match ebpf.take_map(name) {
            Some(Map::Array(data)) => data,
            _ => return Err(MeasureError::Load(format!("map {name} missing or not an array").into())),
        };
        let fd: OwnedFd = data
            .fd()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|source| MeasureError::Region { what: "map", source })?;
        fds.push(fd);
        arrays.push(data);
    }
    let tid_map = match ebpf.take_map(MAP_TID_SLOT) {
        Some(Map::Array(data)) => data,
        _ => return Err(MeasureError::Load("tid table missing".into())),
    };
    // Two u32 per 8-byte array value: one dense u32 per tid.
    let tid_slot = Table::map("tid", tid_map.fd().as_fd().as_raw_fd(), max_tids.div_ceil(2) * 2)?;
    arrays.push(tid_map);

    let fds: [OwnedFd; 3] = fds.try_into().map_err(|_| MeasureError::Load("three region fds".into()))?;
    let mut raw = [0; fd::COUNT];
    raw[fd::CPUS] = fds[0].as_raw_fd();
    raw[fd::SLOTS] = fds[1].as_raw_fd();
    raw[fd::KEYSPACES] = fds[2].as_raw_fd();
    // Only the programs write the per-CPU anchors: frozen, the map can be
    // mapped writable by no client, nor by the agent.
    crate::sys::bpf_map_freeze(raw[fd::CPUS]).map_err(|source| MeasureError::Region { what: "cpu map (freezing)", source })?;
    let regions = MeasureRegions::map(&raw, sizes, Access::ReadOnly)?;
    Ok(Measurement {
        kind: BackendKind::Ebpf,
        regions,
        sizes,
        fds,
        inner: Inner::Ebpf(Box::new(EbpfSide { ebpf, tid_slot, _maps: arrays })),
    })
}

/// Possible tids: `kernel.pid_max` (the tid table has one entry each).
fn pid_max() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(governor_common::DEFAULT_MAX_TIDS)
}

impl EbpfSide {
    pub(super) fn insert_tid(&mut self, tid: u32, slot: u32) -> Result<(), MeasureError> {
        let entry = self.tid_slot.get(tid).ok_or_else(|| MeasureError::Register {
            tid,
            reason: format!("tid beyond the tid table ({} entries, kernel.pid_max at start); restart the agent", self.tid_slot.len()),
        })?;
        entry.store(slot + 1, Ordering::Release);
        Ok(())
    }

    pub(super) fn remove_tid(&mut self, tid: u32) {
        // Already 0 when the thread's final switch cleared it first.
        if let Some(entry) = self.tid_slot.get(tid) {
            entry.store(0, Ordering::Release);
        }
    }

    pub(super) fn program_stats(&self) -> Vec<ProgramStats> {
        [PROG_SCHED_SWITCH, PROG_TIMER]
            .into_iter()
            .filter_map(|name| {
                let info = self.ebpf.program(name)?.info().ok()?;
                Some(ProgramStats {
                    name: name.to_string(),
                    run_time_ns: info.run_time().as_nanos() as u64,
                    run_count: info.run_count(),
                })
            })
            .collect()
    }
}
