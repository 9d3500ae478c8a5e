//! The thread-clock fallback: the same regions in memfds. Threads read
//! their clock with CLOCK_THREAD_CPUTIME_ID; the agent plays the kernel's
//! part by sampling /proc schedstat of each registered thread and charging
//! the unclaimed interval with the same CAS on `charged_ns` the thread uses.

use super::{Inner, MeasureError, Measurement, Sizing};
use crate::proto::BackendKind;
use crate::region::{Access, MeasureRegions, RegionSizes, SlotView, Table, fd};
use crate::sys;
use keyspace_governor_common::{KeyspaceWait, SLOT_LIVE, ThreadSlot, cell_of_tag, wait_bucket};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;

pub fn start(sizing: Sizing) -> Result<Measurement, MeasureError> {
    if sizing.cpu_pressure {
        log::warn!("agent.cpu-pressure is on, but the thread-clock backend cannot see threads wait: not counted");
    }
    let ncpus = sys::possible_cpus().map_err(|source| MeasureError::Region { what: "cpu", source })?;
    let sizes = RegionSizes { cpus: ncpus, slots: sizing.max_threads, keyspaces: sizing.max_keyspaces, ledger: 0 };
    let make = |what: &'static str, n: u32| {
        sys::memfd(what, n as usize * std::mem::size_of::<ThreadSlot>())
            .map_err(|source| MeasureError::Region { what, source })
    };
    let fds = [
        make("governor-cpus", sizes.cpus)?,
        make("governor-slots", sizes.slots)?,
        make("governor-keyspaces", sizes.keyspaces)?,
    ];
    let mut raw = [0; fd::COUNT];
    raw[fd::CPUS] = fds[0].as_raw_fd();
    raw[fd::SLOTS] = fds[1].as_raw_fd();
    raw[fd::KEYSPACES] = fds[2].as_raw_fd();
    let regions = MeasureRegions::map(&raw, sizes, Access::ReadWrite)?;
    // Clients write slots and keyspace cells (their own charges); the
    // per-CPU table they only read.
    for (i, f) in fds.iter().enumerate() {
        crate::sys::seal(f.as_raw_fd(), i == 0)
            .map_err(|source| MeasureError::Region { what: "measurement", source })?;
    }
    // Run-queue waits: the agent's own memory, never handed out.
    let waits_fd = sys::memfd("governor-waits", sizes.keyspaces as usize * std::mem::size_of::<KeyspaceWait>())
        .map_err(|source| MeasureError::Region { what: "waits", source })?;
    let waits = Table::map("waits", waits_fd.as_raw_fd(), sizes.keyspaces)?;
    Ok(Measurement {
        kind: BackendKind::ThreadClock,
        regions,
        sizes,
        waits,
        wait_source: super::WaitSource::Sampled,
        pressure: false,
        fds,
        inner: Inner::Fallback,
    })
}

/// Charges `slot` up to `now_ns` of its thread clock, unless the thread
/// already charged that far. The CAS makes the thread and the agent charge
/// each interval exactly once.
pub fn charge_up_to(m: &Measurement, slot: &SlotView, now_ns: u64) {
    loop {
        let charged = slot.charged_ns.load(Ordering::Acquire);
        if now_ns <= charged || m.regions.try_charge(slot, charged, now_ns).is_some() {
            return;
        }
    }
}

/// One sampling pass over every live slot (fallback backend only).
pub fn sample(m: &Measurement) {
    for (_, slot) in m.regions.slots.iter() {
        if slot.state.load(Ordering::Acquire) != SLOT_LIVE {
            continue;
        }
        let (tgid, tid) = (slot.tgid.load(Ordering::Relaxed), slot.tid.load(Ordering::Relaxed));
        if let Some((ns, delay)) = crate::procs::schedstat(tgid, tid) {
            slot.oncpu_ns.store(ns, Ordering::Release);
            charge_up_to(m, slot, ns);
            // What the thread waited since the last sample, to its tag now
            // (several waits between two samples count as one).
            let seen = slot.delay_ns.swap(delay, Ordering::Relaxed);
            let tag = slot.tag.load(Ordering::Relaxed);
            if delay > seen
                && let Some(w) = cell_of_tag(tag).and_then(|c| m.waits.get(c))
            {
                w.wait_ns.fetch_add(delay - seen, Ordering::Relaxed);
                w.hist[wait_bucket(delay - seen)].fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}
