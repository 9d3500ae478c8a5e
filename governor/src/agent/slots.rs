//! Thread-slot allocation: which slot each registered thread holds, and
//! reuse of slots whose thread exited or whose client went away.

use crate::measure::{fallback, Measurement};
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

    /// Gives `tid` of process `tgid` a slot and starts measuring it.
    pub fn register(&mut self, m: &mut Measurement, conn: u64, tgid: u32, tid: u32) -> Result<(u32, u64), SlotError> {
        if !std::path::Path::new(&format!("/proc/{tgid}/task/{tid}")).exists() {
            return Err(SlotError::NotYourThread { tid, pid: tgid });
        }
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
        let start = if m.is_fallback() { fallback::schedstat_ns(tgid, tid).unwrap_or(0) } else { 0 };
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

    /// Frees the slots of threads that exited: marked dead by the kernel's
    /// exit hook (eBPF), or gone from /proc (fallback).
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
