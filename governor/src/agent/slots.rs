//! Thread-slot allocation: which slot each registered thread holds, and
//! reuse of slots whose thread exited or whose client went away.

use crate::measure::Measurement;
use crate::proto::ThreadStats;
use governor_common::{SLOT_DEAD, SLOT_FREE, SLOT_LIVE, TAG_NONE};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;

#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error("all {capacity} thread slots are in use; raise agent.max-threads")]
    Exhausted { capacity: u32 },
    #[error("thread {tid} is not a thread of process {pid}")]
    NotYourThread { tid: u32, pid: u32 },
    #[error("thread {tid} is already registered (slot {slot})")]
    AlreadyRegistered { tid: u32, slot: u32 },
    #[error("slot {slot} (generation {generation}) is not held by this connection")]
    NotHeld { slot: u32, generation: u64 },
    #[error(transparent)]
    Measure(#[from] crate::measure::MeasureError),
}

/// Owner of a handed-out slot.
#[derive(Clone, Copy, Debug)]
struct Holder {
    conn: u64,
    tid: u32,
    tgid: u32,
    generation: u64,
}

pub struct Slots {
    /// FIFO: a freed slot waits the longest before reuse.
    free: VecDeque<u32>,
    held: HashMap<u32, Holder>,
    by_tid: HashMap<u32, u32>,
    capacity: u32,
    handed_out: u64,
    reclaimed: u64,
    exhausted: u64,
}

impl Slots {
    pub fn new(capacity: u32) -> Slots {
        Slots {
            free: (0..capacity).collect(),
            held: HashMap::new(),
            by_tid: HashMap::new(),
            capacity,
            handed_out: 0,
            reclaimed: 0,
            exhausted: 0,
        }
    }

    /// Gives `tid` of process `tgid` a slot and starts measuring it. `tid`
    /// is as the client sees it (its own PID namespace); `tgid` as the agent
    /// sees it (SO_PEERCRED translates it).
    pub fn register(&mut self, m: &mut Measurement, conn: u64, tgid: u32, tid: u32) -> Result<(u32, u64), SlotError> {
        let client_tid = tid;
        let tid = host_tid(tgid, client_tid).ok_or(SlotError::NotYourThread { tid: client_tid, pid: tgid })?;
        if let Some(&slot) = self.by_tid.get(&tid) {
            // A tid is reused only after its thread died: drop the stale holder.
            let live = m.regions.slots.get(slot).is_some_and(|v| v.state.load(Ordering::Acquire) == SLOT_LIVE);
            if live && self.held.get(&slot).is_some_and(|h| h.tgid == tgid && h.conn == conn) {
                return Err(SlotError::AlreadyRegistered { tid, slot });
            }
            // A dead thread's tid came back before the reclaim pass: free it now.
            self.release(m, slot);
        }
        if self.free.is_empty() {
            self.reclaim(m);
        }
        let Some(slot) = self.free.pop_front() else {
            self.exhausted += 1;
            return Err(SlotError::Exhausted { capacity: self.capacity });
        };
        let view = m.regions.slots.get(slot).expect("free list holds valid slots");
        // Both backends count on the kernel's timeline: the thread's runtime
        // so far is where its charging starts. It is blocked waiting for this
        // reply, so the value holds still (what it ran before blocking, if
        // anything, is charged to no tag at its switch-out).
        let start = crate::measure::schedstat_ns(tgid, tid).ok_or(SlotError::NotYourThread { tid, pid: tgid })?;
        let generation = view.generation.load(Ordering::Relaxed) + 1;
        view.oncpu_ns.store(start, Ordering::Relaxed);
        view.charged_ns.store(start, Ordering::Relaxed);
        view.tag.store(TAG_NONE, Ordering::Relaxed);
        view.self_charged_ns.store(0, Ordering::Relaxed);
        view.tid.store(tid, Ordering::Relaxed);
        view.tgid.store(tgid, Ordering::Relaxed);
        view.generation.store(generation, Ordering::Relaxed);
        view.state.store(SLOT_LIVE, Ordering::Release);
        if let Err(e) = m.attach_thread(tid, slot) {
            if let Some(view) = m.regions.slots.get(slot) {
                view.state.store(SLOT_FREE, Ordering::Release);
            }
            self.free.push_back(slot);
            return Err(e.into());
        }
        self.held.insert(slot, Holder { conn, tid, tgid, generation });
        self.by_tid.insert(tid, slot);
        self.handed_out += 1;
        Ok((slot, generation))
    }

    /// Gives back a slot the connection holds.
    pub fn unregister(&mut self, m: &mut Measurement, conn: u64, slot: u32, generation: u64) -> Result<(), SlotError> {
        match self.held.get(&slot) {
            Some(h) if h.conn == conn && h.generation == generation => {
                self.release(m, slot);
                Ok(())
            }
            _ => Err(SlotError::NotHeld { slot, generation }),
        }
    }

    /// Releases every slot a closed connection held.
    pub fn drop_connection(&mut self, m: &mut Measurement, conn: u64) {
        let slots: Vec<u32> = self.held.iter().filter(|(_, h)| h.conn == conn).map(|(s, _)| *s).collect();
        for s in slots {
            self.release(m, s);
        }
    }

    fn release(&mut self, m: &mut Measurement, slot: u32) {
        let Some(h) = self.held.remove(&slot) else { return };
        if self.by_tid.get(&h.tid) == Some(&slot) {
            self.by_tid.remove(&h.tid);
        }
        m.detach_thread(h.tid);
        if let Some(view) = m.regions.slots.get(slot) {
            view.state.store(SLOT_FREE, Ordering::Release);
        }
        self.free.push_back(slot);
        self.reclaimed += 1;
    }

    /// Frees the slots of threads that exited: marked dead at their final
    /// switch (eBPF), or gone from /proc (fallback).
    pub fn reclaim(&mut self, m: &mut Measurement) -> usize {
        let fallback = m.is_fallback();
        let dead: Vec<u32> = self
            .held
            .iter()
            .filter(|(slot, h)| {
                let state = m.regions.slots.get(**slot).map(|v| v.state.load(Ordering::Acquire));
                state == Some(SLOT_DEAD)
                    || (fallback && !std::path::Path::new(&format!("/proc/{}/task/{}", h.tgid, h.tid)).exists())
            })
            .map(|(s, _)| *s)
            .collect();
        for &s in &dead {
            self.release(m, s);
        }
        dead.len()
    }

    /// Slots handed out now.
    pub fn held_slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.held.keys().copied()
    }

    pub fn stats(&self) -> ThreadStats {
        ThreadStats {
            registered: self.held.len() as u32,
            capacity: self.capacity,
            handed_out: self.handed_out,
            reclaimed: self.reclaimed,
            exhausted: self.exhausted,
        }
    }
}

/// The innermost-namespace pid list of a task (`NSpid:` in its status).
fn nspid(tgid: u32, task: u32) -> Option<Vec<u32>> {
    let status = std::fs::read_to_string(format!("/proc/{tgid}/task/{task}/status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    line.split_whitespace().map(|v| v.parse().ok()).collect()
}

/// The tid, as the kernel (and so the eBPF programs) and the agent see it,
/// of the thread of process `tgid` that calls itself `client_tid` in its
/// own PID namespace. A client in a container sees other numbers than the
/// host: its thread is the one whose innermost NSpid is `client_tid`.
fn host_tid(tgid: u32, client_tid: u32) -> Option<u32> {
    // Same namespace: the task exists under that number and has no inner id.
    if nspid(tgid, client_tid).is_some_and(|ids| ids == [client_tid]) {
        return Some(client_tid);
    }
    std::fs::read_dir(format!("/proc/{tgid}/task"))
        .ok()?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|&task| nspid(tgid, task).is_some_and(|ids| ids.len() > 1 && ids.last() == Some(&client_tid)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_threads_map_to_themselves() {
        let pid = std::process::id();
        let tid = crate::sys::gettid();
        assert_eq!(host_tid(pid, tid), Some(tid));
        assert_eq!(host_tid(pid, pid), Some(pid));
    }

    #[test]
    fn a_tid_of_another_process_is_not_ours() {
        // pid 1 is never one of this test's threads.
        assert_eq!(host_tid(std::process::id(), 1), None);
    }
}
