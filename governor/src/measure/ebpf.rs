//! The eBPF backend: resolves the task fields the programs read from the
//! kernel's BTF, loads governor-ebpf with them, sizes and mmaps its array
//! maps, and attaches `tp_btf/sched_switch` and one software CPU-clock perf
//! event per online CPU.

use super::{Inner, MeasureError, Measurement, Sizing, take_map};
use crate::proto::{BackendKind, ProgramStats};
use crate::region::{Access, MeasureRegions, RegionSizes, Table, fd};
use crate::sys;
use aya::maps::{Array, HashMap, Map, MapData, RingBuf};
use aya::programs::perf_event::{PerfEventScope, PerfTypeId, SamplePolicy, perf_sw_ids};
use aya::programs::{BtfTracePoint, PerfEvent};
use aya::{Btf, Ebpf, EbpfLoader};
use keyspace_governor_common::{
    GLOBAL_OFF_BPRM_FILENAME, GLOBAL_OFF_EXEC_START, GLOBAL_OFF_LAST_QUEUED, GLOBAL_OFF_NIVCSW, GLOBAL_OFF_NVCSW,
    GLOBAL_OFF_PID, GLOBAL_OFF_PREV_RUNTIME, GLOBAL_OFF_RUN_DELAY, GLOBAL_OFF_RUNTIME, GLOBAL_OFF_STATE,
    GLOBAL_OFF_TGID, GLOBAL_PRESSURE_ON, GLOBAL_WAIT_ON, MAP_CPUS, MAP_EVENTS, MAP_KEYSPACES, MAP_PENDING,
    MAP_RULE_CTL, MAP_SLOTS, MAP_TID_SLOT, MAP_WAITS, PROG_EXEC, PROG_FORK, PROG_PROFILE, PROG_RENAME,
    PROG_SCHED_SWITCH, PROG_TIMER, PROG_WAKEUP, RULE_CTL_DROPPED, RULE_CTL_ON, RULE_CTL_RENAME, RuleEvent,
};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};

/// What the eBPF backend keeps alive: the loaded object (its programs stay
/// attached while it lives) and the tid map the agent fills.
pub struct EbpfSide {
    pub(super) ebpf: Ebpf,
    /// `tid → [slot + 1, rule tag]`, mmapped: registering a thread is a
    /// store (`2 × tid`; the rule half belongs to [`RuleMaps`]).
    tid_slot: Table<AtomicU32>,
    /// The rules' side (see [`RuleMaps`]).
    pub(super) rules: RuleMaps,
    /// The profile program's maps and perf events (`None`: this kernel
    /// refused the program).
    pub(super) profile: Option<super::profile::ProfileProbe>,
    // Keep the maps alive: their fds back the mappings.
    _maps: Vec<MapData>,
}

fn boxed<E: std::error::Error + Send + Sync + 'static>(e: E) -> Box<dyn std::error::Error + Send + Sync> {
    Box::new(e)
}

/// Checks the capabilities eBPF loading needs, naming what is missing.
pub fn check_capabilities() -> Result<(), MeasureError> {
    let caps = crate::procs::effective_caps().unwrap_or(0);
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
    let (run_delay, wait_on) = match offsets.run_delay {
        Some(off) => (off, 1u32),
        None => {
            log::warn!("this kernel keeps no sched_info (CONFIG_SCHED_INFO): run-queue waits are not measured");
            (0, 0)
        }
    };
    // Waiting threads are counted when asked, where waits are measured.
    let (last_queued, pressure_on) = match (sizing.cpu_pressure, offsets.last_queued, wait_on) {
        (false, ..) => (0, 0),
        (true, Some(off), 1) => (off, 1u32),
        (true, ..) => {
            log::warn!("agent.cpu-pressure is on, but this kernel keeps no sched_info: CPU pressure is not counted");
            (0, 0)
        }
    };
    let mut ebpf = EbpfLoader::new()
        .set_global(GLOBAL_OFF_PID, &offsets.pid, true)
        .set_global(GLOBAL_OFF_STATE, &offsets.state, true)
        .set_global(GLOBAL_OFF_RUNTIME, &offsets.sum_exec_runtime, true)
        .set_global(GLOBAL_OFF_EXEC_START, &offsets.exec_start, true)
        .set_global(GLOBAL_OFF_TGID, &offsets.tgid, true)
        .set_global(GLOBAL_OFF_PREV_RUNTIME, &offsets.prev_sum_exec_runtime, true)
        .set_global(GLOBAL_OFF_NVCSW, &offsets.nvcsw, true)
        .set_global(GLOBAL_OFF_NIVCSW, &offsets.nivcsw, true)
        .set_global(GLOBAL_OFF_BPRM_FILENAME, &offsets.bprm_filename, true)
        .set_global(GLOBAL_OFF_RUN_DELAY, &run_delay, true)
        .set_global(GLOBAL_WAIT_ON, &wait_on, true)
        .set_global(GLOBAL_OFF_LAST_QUEUED, &last_queued, true)
        .set_global(GLOBAL_PRESSURE_ON, &pressure_on, true)
        .set_max_entries(MAP_CPUS, sizes.cpus)
        .set_max_entries(MAP_SLOTS, sizes.slots)
        .set_max_entries(MAP_TID_SLOT, max_tids)
        .set_max_entries(MAP_KEYSPACES, sizes.keyspaces)
        .set_max_entries(MAP_WAITS, sizes.keyspaces)
        .load(crate::EBPF_OBJECT)
        .map_err(|e| MeasureError::Load(boxed(e)))?;
    if let Err(e) = aya_log::EbpfLogger::init(&mut ebpf) {
        log::debug!("eBPF logger not started: {e}");
    }
    let btf = Btf::from_sys_fs().map_err(|e| MeasureError::Load(boxed(e)))?;

    for (name, tracepoint) in [
        (PROG_SCHED_SWITCH, "sched_switch"),
        (PROG_WAKEUP, "sched_wakeup"),
        (PROG_FORK, "sched_process_fork"),
        (PROG_EXEC, "sched_process_exec"),
        (PROG_RENAME, "task_rename"),
    ] {
        if name == PROG_WAKEUP && pressure_on == 0 {
            // Nothing to count: every wakeup in the system stays unpaid.
            continue;
        }
        let prog: &mut BtfTracePoint = ebpf
            .program_mut(name)
            .ok_or_else(|| MeasureError::Attach { program: name, source: "not in the object".into() })?
            .try_into()
            .map_err(|e| MeasureError::Attach { program: name, source: boxed(e) })?;
        prog.load(tracepoint, &btf).map_err(|e| MeasureError::Attach { program: name, source: boxed(e) })?;
        prog.attach().map_err(|e| MeasureError::Attach { program: name, source: boxed(e) })?;
    }
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

    // Profiles are a diagnosis: an agent that cannot take them still measures.
    let profile = super::profile::ProfileProbe::load(&mut ebpf)
        .map_err(|e| log::warn!("profiles unavailable: {}", crate::error_chain(&e)))
        .ok();

    let mut arrays = Vec::new();
    let mut fds = Vec::new();
    for name in [MAP_CPUS, MAP_SLOTS, MAP_KEYSPACES] {
        let data = match ebpf.take_map(name) {
            Some(Map::Array(data)) => data,
            _ => return Err(MeasureError::Load(format!("map {name} missing or not an array").into())),
        };
        let fd: OwnedFd =
            data.fd().as_fd().try_clone_to_owned().map_err(|source| MeasureError::Region { what: "map", source })?;
        fds.push(fd);
        arrays.push(data);
    }
    let waits_map = match ebpf.take_map(MAP_WAITS) {
        Some(Map::Array(data)) => data,
        _ => return Err(MeasureError::Load("wait table missing".into())),
    };
    // Writable: the agent frees the slots of what waits were behind.
    let waits = Table::map_with("waits", waits_map.fd().as_fd().as_raw_fd(), sizes.keyspaces, Access::ReadWrite)?;
    arrays.push(waits_map);
    let tid_map = match ebpf.take_map(MAP_TID_SLOT) {
        Some(Map::Array(data)) => data,
        _ => return Err(MeasureError::Load("tid table missing".into())),
    };
    // Two u32 per 8-byte array value: [slot + 1, rule tag].
    let tid_slot = Table::map("tid", tid_map.fd().as_fd().as_raw_fd(), max_tids * 2)?;
    let rules = RuleMaps::take(&mut ebpf, Table::map("tid", tid_map.fd().as_fd().as_raw_fd(), max_tids * 2)?)?;
    arrays.push(tid_map);

    let fds: [OwnedFd; 3] = fds.try_into().map_err(|_| MeasureError::Load("three region fds".into()))?;
    let mut raw = [0; fd::COUNT];
    raw[fd::CPUS] = fds[0].as_raw_fd();
    raw[fd::SLOTS] = fds[1].as_raw_fd();
    raw[fd::KEYSPACES] = fds[2].as_raw_fd();
    // Only the programs write the per-CPU anchors: frozen, the map can be
    // mapped writable by no client, nor by the agent.
    crate::sys::bpf_map_freeze(raw[fd::CPUS])
        .map_err(|source| MeasureError::Region { what: "cpu map (freezing)", source })?;
    let regions = MeasureRegions::map(&raw, sizes, Access::ReadOnly)?;
    Ok(Measurement {
        kind: BackendKind::Ebpf,
        regions,
        sizes,
        waits,
        wait_source: if wait_on != 0 { super::WaitSource::Kernel } else { super::WaitSource::Unavailable },
        pressure: pressure_on != 0,
        fds,
        inner: Inner::Ebpf(Box::new(EbpfSide { ebpf, tid_slot, rules, profile, _maps: arrays })),
    })
}

/// Possible tids: `kernel.pid_max` (the tid table has one entry each).
fn pid_max() -> u32 {
    crate::procs::pid_max().unwrap_or(keyspace_governor_common::DEFAULT_MAX_TIDS)
}

impl EbpfSide {
    pub(super) fn insert_tid(&mut self, tid: u32, slot: u32) -> Result<(), MeasureError> {
        let entry = self.tid_slot.get(tid.saturating_mul(2)).ok_or_else(|| MeasureError::Register {
            tid,
            reason: format!(
                "tid beyond the tid table ({} entries, kernel.pid_max at start); restart the agent",
                self.tid_slot.len() / 2
            ),
        })?;
        entry.store(slot + 1, Ordering::Release);
        Ok(())
    }

    pub(super) fn remove_tid(&mut self, tid: u32) {
        // Already 0 when the thread's final switch cleared it first.
        if let Some(entry) = self.tid_slot.get(tid.saturating_mul(2)) {
            entry.store(0, Ordering::Release);
        }
    }

    pub(super) fn program_stats(&self) -> Vec<ProgramStats> {
        [PROG_SCHED_SWITCH, PROG_WAKEUP, PROG_TIMER, PROG_FORK, PROG_EXEC, PROG_RENAME, PROG_PROFILE]
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

/// A [`RuleEvent`] record, field by field (native byte order, as the
/// program wrote it).
fn parse_event(b: &[u8]) -> Option<RuleEvent> {
    let u = |at: usize| Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?));
    Some(RuleEvent {
        kind: u(0)?,
        tgid: u(4)?,
        parent: u(8)?,
        prior: u(12)?,
        tid: u(16)?,
        _reserved: 0,
        comm: b.get(24..40)?.try_into().ok()?,
        filename: b.get(40..168)?.try_into().ok()?,
    })
}

/// The maps behind rule measurement (`agent::rules` drives them).
pub struct RuleMaps {
    /// The tid table, mmapped again: the rule half of each entry (`2 × tid + 1`).
    tids: Table<AtomicU32>,
    pending: HashMap<MapData, u32, u64>,
    events: RingBuf<MapData>,
    ctl: Array<MapData, u64>,
}

impl RuleMaps {
    fn take(ebpf: &mut Ebpf, tids: Table<AtomicU32>) -> Result<RuleMaps, MeasureError> {
        Ok(RuleMaps {
            tids,
            pending: take_map(ebpf, MAP_PENDING)?,
            events: take_map(ebpf, MAP_EVENTS)?,
            ctl: take_map(ebpf, MAP_RULE_CTL)?,
        })
    }

    fn half(&self, tid: u32) -> Option<&AtomicU32> {
        self.tids.get(tid.checked_mul(2)?.checked_add(1)?)
    }

    /// The tag of thread `tid` (of a process: its main thread's; 0: none).
    pub fn tag(&self, tgid: u32) -> u32 {
        self.half(tgid).map_or(0, |e| e.load(Ordering::Acquire))
    }

    /// Sets the tag of every thread of process `tgid` that still has `from`
    /// (`None`: whatever it has, except pending), until no thread is left
    /// behind (threads created meanwhile copy their creator's). True if
    /// the main thread holds `to` afterwards.
    pub fn replace_tag(&self, tgid: u32, from: Option<u32>, to: u32) -> bool {
        for _ in 0..4 {
            let mut changed = false;
            for tid in crate::procs::threads(tgid).into_iter().chain([tgid]) {
                let Some(e) = self.half(tid) else { continue };
                let now = e.load(Ordering::Acquire);
                let ok = match from {
                    Some(f) => now == f,
                    None => now != keyspace_governor_common::TAG_PENDING,
                };
                if ok && now != to && e.compare_exchange(now, to, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        self.tag(tgid) == to
    }

    /// Turns rule measurement (exec reports) on or off.
    pub fn set_exec_events(&mut self, on: bool) {
        if let Err(e) = self.ctl.set(RULE_CTL_ON, u64::from(on), 0) {
            log::warn!("cannot switch exec reports {}: {e}", if on { "on" } else { "off" });
        }
    }

    /// Turns rename reports (rules on thread names) on or off.
    pub fn set_rename_events(&mut self, on: bool) {
        if let Err(e) = self.ctl.set(RULE_CTL_RENAME, u64::from(on), 0) {
            log::warn!("cannot switch rename reports {}: {e}", if on { "on" } else { "off" });
        }
    }

    /// Sets the rule tag of thread `tid` alone, if it is not pending and
    /// still holds `from`. True if it holds `to` afterwards.
    pub fn set_thread_tag(&self, tid: u32, from: u32, to: u32) -> bool {
        let Some(e) = self.half(tid) else { return false };
        from == to
            || (from != keyspace_governor_common::TAG_PENDING
                && e.compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire).is_ok())
    }

    /// A descriptor of the exec and rename reports' ring buffer, to wait on
    /// (readable when reports are in).
    pub fn events_fd(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        use std::os::fd::AsRawFd;
        crate::sys::bpf_map_dup(self.events.as_raw_fd())
    }

    /// Events the ring buffer had no room for, since start.
    pub fn dropped(&self) -> u64 {
        self.ctl.get(&RULE_CTL_DROPPED, 0).unwrap_or(0)
    }

    /// Every event waiting, in order.
    pub fn drain(&mut self, out: &mut Vec<RuleEvent>) {
        while let Some(item) = self.events.next() {
            if let Some(e) = parse_event(&item) {
                out.push(e);
            }
        }
    }

    /// Takes the CPU kept for pending process `tgid`.
    pub fn take_pending(&mut self, tgid: u32) -> u64 {
        let ns = self.pending.get(&tgid, 0).unwrap_or(0);
        let _ = self.pending.remove(&tgid);
        ns
    }

    /// Processes with CPU kept pending.
    pub fn pending_tgids(&self) -> Vec<u32> {
        self.pending.keys().filter_map(Result::ok).collect()
    }
}
