//! Thread-slot allocation: which slot each registered thread holds, and
//! reuse of slots whose thread exited or whose client went away.

use crate::measure::Measurement;
use crate::proto::ThreadStats;
use keyspace_governor_common::{SLOT_FREE, SLOT_LIVE, TAG_NONE, WAIT_TAG_WAITING, cell_of_tag};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How long a released slot rests before its wait mark is settled: longer
/// than any run of the kernel's program that read the slot as registered
/// just before the release (a tracepoint program runs to its end in
/// microseconds, without sleeping).
const SETTLE_AFTER: Duration = Duration::from_millis(10);

#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error("all {capacity} thread slots are in use; raise agent.max-threads")]
    Exhausted { capacity: u32 },
    #[error("thread {tid} is not a thread of process {pid}")]
    NotYourThread { tid: u32, pid: u32 },
    #[error("thread {tid} is already registered (slot {slot})")]
    AlreadyRegistered { tid: u32, slot: u32 },
    #[error("uid {uid} already holds {limit} thread slots (agent.max-threads-per-uid)")]
    UidQuota { uid: u32, limit: u32 },
    #[error("slot {slot} (generation {generation}) is not held by this connection")]
    NotHeld { slot: u32, generation: u64 },
    #[error(transparent)]
    Measure(#[from] crate::measure::MeasureError),
}

/// Owner of a handed-out slot: the agent's own record, which decides; the
/// copy in the shared slot is only what the kernel's program reads, and any
/// client can write it.
#[derive(Clone, Copy, Debug)]
struct Holder {
    conn: u64,
    tid: u32,
    tgid: u32,
    uid: u32,
    generation: u64,
    /// The task's start time (clock ticks since boot): tells the thread
    /// from a later one that reused its tid.
    start: u64,
}

pub struct Slots {
    /// FIFO: a freed slot waits the longest before reuse.
    free: VecDeque<u32>,
    /// Slots released and when, not yet free: a thread the kernel counts
    /// among its keyspace's waiting threads when its slot is released (it
    /// was preempted, or woken, while its unregistration or its process's
    /// exit went through) is no longer seen by the kernel at its next
    /// switch-in, which would have taken it off; the agent does, once the
    /// slot has rested ([`SETTLE_AFTER`]).
    released: VecDeque<(u32, Instant)>,
    held: HashMap<u32, Holder>,
    by_tid: HashMap<u32, u32>,
    by_uid: HashMap<u32, u32>,
    capacity: u32,
    per_uid: u32,
    handed_out: u64,
    reclaimed: u64,
    exhausted: u64,
    repaired: u64,
}

/// A thread a client asked to register, as the agent sees it.
#[derive(Clone, Copy, Debug)]
pub struct Task {
    tgid: u32,
    /// In the agent's PID namespace.
    tid: u32,
    born: u64,
}

/// Finds the thread `client_tid` (as the client sees it, in its own PID
/// namespace) of process `tgid`, and when it started. Reads /proc: call it
/// without holding the agent's locks.
pub fn resolve(tgid: u32, client_tid: u32) -> Result<Task, SlotError> {
    let tid = host_tid(tgid, client_tid).ok_or(SlotError::NotYourThread { tid: client_tid, pid: tgid })?;
    let (born, _) = task_start(tgid, tid).ok_or(SlotError::NotYourThread { tid, pid: tgid })?;
    Ok(Task { tgid, tid, born })
}

/// Start time and state letter of a task, as the kernel reports them.
fn task_start(tgid: u32, tid: u32) -> Option<(u64, char)> {
    let task = procfs::process::Process::new(tgid as i32).ok()?.task_from_tid(tid as i32).ok()?;
    let stat = task.stat().ok()?;
    Some((stat.starttime, stat.state))
}

/// Whether the task that registered (same tid, same start time) still runs.
fn still_running(h: &Holder) -> bool {
    task_start(h.tgid, h.tid).is_some_and(|(start, state)| start == h.start && !matches!(state, 'Z' | 'X' | 'x'))
}

impl Slots {
    /// A new `agent.max-threads-per-uid` (a configuration change): slots
    /// already held stay; registrations past the limit are refused.
    pub fn set_per_uid(&mut self, per_uid: u32) {
        self.per_uid = per_uid;
    }

    /// `per_uid`: slots the threads of one non-root uid may hold.
    pub fn new(capacity: u32, per_uid: u32) -> Slots {
        Slots {
            free: (0..capacity).collect(),
            released: VecDeque::new(),
            held: HashMap::new(),
            by_tid: HashMap::new(),
            by_uid: HashMap::new(),
            capacity,
            per_uid,
            handed_out: 0,
            reclaimed: 0,
            exhausted: 0,
            repaired: 0,
        }
    }

    /// Gives `tid` of process `tgid` a slot and starts measuring it. `tid`
    /// is as the client sees it (its own PID namespace); `tgid` as the agent
    /// sees it (SO_PEERCRED translates it).
    pub fn register(
        &mut self,
        m: &mut Measurement,
        conn: u64,
        tgid: u32,
        uid: u32,
        tid: u32,
    ) -> Result<(u32, u64), SlotError> {
        let task = resolve(tgid, tid)?;
        self.register_resolved(m, conn, uid, task)
    }

    /// [`Slots::register`] for a task resolved beforehand (without the
    /// agent's locks: resolving reads /proc).
    pub fn register_resolved(
        &mut self,
        m: &mut Measurement,
        conn: u64,
        uid: u32,
        task: Task,
    ) -> Result<(u32, u64), SlotError> {
        let Task { tgid, tid, born } = task;
        if let Some(&slot) = self.by_tid.get(&tid) {
            // A tid is reused only after its thread died: drop the stale holder.
            let live = m.regions.slots.get(slot).is_some_and(|v| v.state.load(Ordering::Acquire) == SLOT_LIVE);
            if live && self.held.get(&slot).is_some_and(|h| h.tgid == tgid && h.conn == conn) {
                return Err(SlotError::AlreadyRegistered { tid, slot });
            }
            // A dead thread's tid came back before the reclaim pass: free it now.
            self.release(m, slot);
        }
        if uid != 0 && self.by_uid.get(&uid).copied().unwrap_or(0) >= self.per_uid {
            self.reclaim(m);
            if self.by_uid.get(&uid).copied().unwrap_or(0) >= self.per_uid {
                self.exhausted += 1;
                return Err(SlotError::UidQuota { uid, limit: self.per_uid });
            }
        }
        if self.free.is_empty() {
            self.reclaim(m);
        }
        if self.free.is_empty() {
            // The last slots were released just now: rather than refuse
            // the thread, settle them at once (a program of the kernel's
            // still finishing with one could then take its thread off the
            // waiting twice; the count is never taken below zero).
            self.settle(m, Duration::ZERO);
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
        let (start, delay) = crate::procs::schedstat(tgid, tid).ok_or(SlotError::NotYourThread { tid, pid: tgid })?;
        let generation = view.generation.load(Ordering::Relaxed) + 1;
        view.oncpu_ns.store(start, Ordering::Relaxed);
        view.charged_ns.store(start, Ordering::Relaxed);
        view.tag.store(TAG_NONE, Ordering::Relaxed);
        view.self_charged_ns.store(0, Ordering::Relaxed);
        // Its waits count from here, with no tag until it sets one.
        view.delay_ns.store(delay, Ordering::Relaxed);
        view.wait_tag.store(0, Ordering::Relaxed);
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
        self.held.insert(slot, Holder { conn, tid, tgid, uid, generation, start: born });
        self.by_tid.insert(tid, slot);
        *self.by_uid.entry(uid).or_insert(0) += 1;
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
        if let Some(n) = self.by_uid.get_mut(&h.uid) {
            *n -= 1;
            if *n == 0 {
                self.by_uid.remove(&h.uid);
            }
        }
        m.detach_thread(h.tid);
        if let Some(view) = m.regions.slots.get(slot) {
            view.state.store(SLOT_FREE, Ordering::Release);
        }
        self.released.push_back((slot, Instant::now()));
        self.reclaimed += 1;
    }

    /// Frees the released slots that rested `rest`: a thread still counted
    /// as waiting in one is taken off its keyspace's waiting threads (else
    /// the keyspace's "some" pressure would stay open for good).
    fn settle(&mut self, m: &Measurement, rest: Duration) {
        while let Some(&(slot, at)) = self.released.front() {
            if at.elapsed() < rest {
                break;
            }
            self.released.pop_front();
            if let Some(view) = m.regions.slots.get(slot) {
                let wait_tag = view.wait_tag.swap(0, Ordering::AcqRel);
                if wait_tag & WAIT_TAG_WAITING != 0
                    && let Some(w) = cell_of_tag(u64::from(wait_tag & !WAIT_TAG_WAITING)).and_then(|c| m.waits.get(c))
                {
                    w.stop_waiting(crate::sys::monotonic_ns());
                }
            }
            self.free.push_back(slot);
        }
    }

    /// Frees the slots of threads that exited, and repairs the slots a
    /// client tampered with. A slot whose shared copy no longer matches the
    /// agent's record (marked dead, or its tid, process or generation
    /// rewritten) is checked against the kernel: if the registered task still
    /// runs, the record is written back (the kernel's next charge covers the
    /// time it missed, as charges are differences of its own counter);
    /// otherwise the slot is freed. On the fallback backend, where no program
    /// marks exits, every slot's task is checked. Returns the slots freed.
    pub fn reclaim(&mut self, m: &mut Measurement) -> usize {
        let fallback = m.is_fallback();
        let mut dead = Vec::new();
        let mut forged = Vec::new();
        for (&slot, h) in &self.held {
            let Some(v) = m.regions.slots.get(slot) else { continue };
            let intact = v.state.load(Ordering::Acquire) == SLOT_LIVE
                && v.tid.load(Ordering::Relaxed) == h.tid
                && v.tgid.load(Ordering::Relaxed) == h.tgid
                && v.generation.load(Ordering::Relaxed) == h.generation;
            if intact && !fallback {
                continue;
            }
            match (still_running(h), intact) {
                (true, true) => {}
                (true, false) => forged.push(slot),
                (false, _) => dead.push(slot),
            }
        }
        for &s in &forged {
            let (Some(h), Some(v)) = (self.held.get(&s).copied(), m.regions.slots.get(s)) else { continue };
            v.tid.store(h.tid, Ordering::Relaxed);
            v.tgid.store(h.tgid, Ordering::Relaxed);
            v.generation.store(h.generation, Ordering::Relaxed);
            v.state.store(SLOT_LIVE, Ordering::Release);
            // The tid table is the agent's alone, but write it again.
            let _ = m.attach_thread(h.tid, s);
            self.repaired += 1;
            if self.repaired <= 10 || self.repaired.is_power_of_two() {
                log::warn!(
                    "slot {s} of thread {} (pid {}) was overwritten in shared memory; restored ({} so far)",
                    h.tid,
                    h.tgid,
                    self.repaired
                );
            }
        }
        for &s in &dead {
            self.release(m, s);
        }
        self.settle(m, SETTLE_AFTER);
        dead.len()
    }

    /// Slots handed out now.
    /// Every held slot with its thread, process and uid, by slot.
    pub fn holders(&self) -> Vec<(u32, u32, u32, u32)> {
        let mut v: Vec<_> = self.held.iter().map(|(&slot, h)| (slot, h.tid, h.tgid, h.uid)).collect();
        v.sort_unstable();
        v
    }

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
            repaired: self.repaired,
        }
    }
}

/// The tid, as the kernel (and so the eBPF programs) and the agent see it,
/// of the thread of process `tgid` that calls itself `client_tid` in its
/// own PID namespace. A client in a container sees other numbers than the
/// host: its thread is the one whose innermost NSpid is `client_tid`.
fn host_tid(tgid: u32, client_tid: u32) -> Option<u32> {
    // Same namespace: the task exists under that number and has no inner id.
    use crate::procs::nspid;
    if nspid(tgid, client_tid).is_some_and(|ids| ids == [client_tid]) {
        return Some(client_tid);
    }
    crate::procs::threads(tgid)
        .into_iter()
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

    /// A thread counted as waiting when its slot goes back (its process
    /// exiting, say) is no longer seen by the kernel's program: the agent
    /// takes it off its keyspace's waiting threads once the slot rested,
    /// and the slot is not handed out before.
    #[test]
    fn a_slot_released_while_its_thread_waits_closes_the_wait_before_reuse() {
        let sizing = crate::measure::Sizing {
            max_threads: 1,
            max_keyspaces: 4,
            timer_period_ns: 10_000_000,
            cpu_pressure: false,
        };
        let mut m = crate::measure::fallback::start(sizing).expect("thread-clock backend");
        let mut slots = Slots::new(1, 1);
        let (pid, tid) = (std::process::id(), crate::sys::gettid());
        let (slot, generation) = slots.register(&mut m, 7, pid, 0, tid).expect("a slot");
        // As the kernel's program leaves it: the thread waits, tagged with
        // cell 2, the cell's one waiting thread since 1 s.
        let w = m.waits.get(2).expect("cell 2");
        w.waiting.store(1, Ordering::Relaxed);
        w.some_since_ns.store(1_000_000_000, Ordering::Relaxed);
        let view = m.regions.slots.get(slot).expect("the slot");
        view.wait_tag.store(3 | WAIT_TAG_WAITING, Ordering::Relaxed);
        slots.unregister(&mut m, 7, slot, generation).expect("unregistered");
        // Resting: still counted, and no slot to hand out but by settling.
        slots.reclaim(&mut m);
        assert_eq!(m.waits.get(2).unwrap().waiting.load(Ordering::Relaxed), 1);
        std::thread::sleep(SETTLE_AFTER);
        slots.reclaim(&mut m);
        let w = m.waits.get(2).unwrap();
        assert_eq!(w.waiting.load(Ordering::Relaxed), 0, "taken off the waiting threads");
        let closed_at = w.some_closed_ns.load(Ordering::Relaxed);
        assert!(closed_at > 1_000_000_000, "the stretch closed at {closed_at}");
        assert_eq!(w.some_ns.load(Ordering::Relaxed), closed_at - 1_000_000_000, "the stretch counted whole");
        assert_eq!(m.regions.slots.get(slot).unwrap().wait_tag.load(Ordering::Relaxed), 0);
        assert!(slots.register(&mut m, 7, pid, 0, tid).is_ok(), "the slot is free again");
    }

    #[test]
    fn a_tid_of_another_process_is_not_ours() {
        // pid 1 is never one of this test's threads.
        assert_eq!(host_tid(std::process::id(), 1), None);
    }
}
