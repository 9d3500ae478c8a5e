//! The process's waiter thread: it sleeps in `futex_waitv` on the wake
//! words of every bucket some future waits on (and on a word of its own,
//! poked when a registration needs it) until the nearest deadline, holding
//! one sleep slot per bucket at the first place its futures wait for there.
//! A move of a bucket's head that serves some sleeper's place wakes it; it
//! wakes only the futures whose place in line that head reached (and those
//! past their deadline, or whose agent went), which poll again: a refill
//! wakes the one future it serves, not the whole line.
//!
//! The thread is not registered, so the kernel charges its CPU to no one.
//! It charges itself: what it ran since it last woke futures (sleeping,
//! being woken, looking at the heads) is shared out equally among the
//! futures it wakes whose place was reached, added to each one's keyspace
//! cell and handed to the future, which counts it into its ticket with the
//! CPU of its own polls (a future woken at its deadline leaves its part to
//! the next one served).
//! So the keyspace's charge and its tickets agree, and the CPU that
//! waiting for admission costs is the keyspace's (docs/design.md,
//! "Waiting"). A stretch in which nothing waited is no one's.

use super::attachment::Attachment;
use super::line::{LIVENESS_CHECK, agent_alive};
use super::ticket::claim_shared;
use crate::region::BucketView;
use crate::sys;
use keyspace_governor_common::admission::{TICKET_FREE, asleep_flags};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::Waker;
use std::time::Instant;

/// One future's wait: which bucket, for which place in line, until when,
/// and the keyspace cell its wait is charged to.
struct Entry {
    id: u64,
    att: Arc<Attachment>,
    bucket: u32,
    pos: u64,
    deadline_ns: u64,
    cell: Option<u32>,
    waker: Waker,
}

/// Credits kept for woken futures that have not polled again; a future
/// leaked after its wake leaves one behind, so no more than this are kept.
const MAX_CREDITS: usize = 4096;

/// What the waiter thread waits for, under one lock.
#[derive(Default)]
struct Waits {
    entries: Vec<Entry>,
    /// As the thread last went to sleep: the buckets it wakes for at a
    /// place no later than the one given (its slot's), as (attachment,
    /// bucket, place), and the time it wakes by. A registration behind one
    /// of those places, due no sooner, needs no kick.
    /// The attachment is named by its address (only compared).
    covered: Vec<(usize, u32, u64)>,
    wakes_by_ns: u64,
    /// The thread's CPU given to futures it woke, by registration, until
    /// each polls again and takes it ([`unregister`]).
    credits: Vec<(u64, u64)>,
}

struct Waiter {
    waits: Mutex<Waits>,
    /// Poked (and woken) when an entry is added that the thread's sleep
    /// does not cover.
    kick: AtomicU32,
}

impl Waiter {
    fn lock(&self) -> std::sync::MutexGuard<'_, Waits> {
        self.waits.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn waiter() -> &'static Waiter {
    static W: OnceLock<&'static Waiter> = OnceLock::new();
    W.get_or_init(|| {
        let w: &'static Waiter =
            Box::leak(Box::new(Waiter { waits: Mutex::new(Waits::default()), kick: AtomicU32::new(0) }));
        std::thread::Builder::new()
            .name("governor-waiter".into())
            .spawn(move || waiter_loop(w))
            .expect("spawning the governor waiter thread");
        w
    })
}

fn bucket(att: &Attachment, i: u32) -> &BucketView {
    att.admission.bucket(i)
}

/// At most this many words per `futex_waitv` (the kernel's limit is 128).
const MAX_WORDS: usize = 127;

/// Whether place `a` comes before place `b` in line.
fn before(a: u64, b: u64) -> bool {
    (a.wrapping_sub(b) as i64) < 0
}

/// The first place in line the futures of `entries` wait for on bucket
/// `b` of `att`.
fn first_place(entries: &[Entry], att: &Arc<Attachment>, b: u32) -> Option<u64> {
    entries
        .iter()
        .filter(|e| Arc::ptr_eq(&e.att, att) && e.bucket == b)
        .map(|e| e.pos)
        .reduce(|first, p| if before(p, first) { p } else { first })
}

/// A bucket the waiter thread counts itself asleep on (once, however many
/// futures wait there): in a sleep slot that holds the first place its
/// futures wait for, so a move of the head wakes it only when it serves
/// some sleeper's place (`futex_waitv` matches every bit), or in the crowd
/// when no slot is free; with the ledger record that says so.
struct Counted {
    att: Arc<Attachment>,
    bucket: u32,
    record: Option<u32>,
    /// The slot and the place it holds; `None`: in the crowd.
    slot: Option<(usize, u64)>,
}

impl Counted {
    /// Counts the waiter thread among the bucket's sleepers for place
    /// `first`, and says so in a record of the attachment's ledger, for the
    /// agent to take back if the process dies.
    ///
    /// With no record free (the ledger is full) it does not count itself
    /// (a count nobody could take back would outlive a process that died):
    /// the bucket's moves do not wake it then, its liveness check does.
    fn new(att: Arc<Attachment>, bucket_i: u32, first: u64) -> Counted {
        let Some(record) = claim_shared(&att) else {
            return Counted { att, bucket: bucket_i, record: None, slot: None };
        };
        let b = bucket(&att, bucket_i);
        let slot = b.claim_sleep_slot(first).map(|i| (i, first));
        match slot {
            Some(_) => b.count_sleeper(),
            None => b.sleep_unslotted(),
        }
        let c = Counted { att, bucket: bucket_i, record: Some(record), slot };
        c.say_asleep();
        c
    }

    fn say_asleep(&self) {
        if let Some(r) = self.record.and_then(|i| self.att.ledger.get(i)) {
            r.flags.store(asleep_flags(self.bucket, 1, self.slot.is_none()), Ordering::Relaxed);
        }
    }

    fn is(&self, att: &Arc<Attachment>, bucket: u32) -> bool {
        Arc::ptr_eq(&self.att, att) && self.bucket == bucket
    }

    /// Moves the slot to `first`, the first place the futures wait for now
    /// (before the thread reads the word and the heads). A slot taken over
    /// since (its place was served) is claimed again; with none free, the
    /// crowd.
    ///
    /// In the crowd it tries for a slot again: a process whose futures keep
    /// coming would otherwise stay there, woken at every move.
    fn place(&mut self, first: u64) {
        if self.record.is_none() {
            return;
        }
        let b = bucket(&self.att, self.bucket);
        match self.slot {
            Some((_, at)) if at == first => {}
            Some((i, at)) => {
                if b.sleep_at[i].compare_exchange(at, first, Ordering::SeqCst, Ordering::Relaxed).is_ok() {
                    self.slot = Some((i, first));
                    return;
                }
                self.slot = b.claim_sleep_slot(first).map(|j| (j, first));
                if self.slot.is_none() {
                    b.join_crowd();
                    self.say_asleep();
                }
            }
            None => {
                self.slot = b.claim_sleep_slot(first).map(|j| (j, first));
                if self.slot.is_some() {
                    // The record says so before the count goes down.
                    self.say_asleep();
                    b.leave_crowd();
                }
            }
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        let Some(r) = self.record.and_then(|i| self.att.ledger.get(i)) else { return };
        r.flags.store(0, Ordering::Relaxed);
        r.state.store(TICKET_FREE, Ordering::Release);
        let b = bucket(&self.att, self.bucket);
        match self.slot {
            Some((i, at)) => b.leave_slot(i, at),
            None => b.wake_unslotted(),
        }
    }
}

/// The waiter thread's own CPU, by its thread clock: what it ran since it
/// last shared it out.
struct OwnCpu {
    /// The clock at the last reading.
    last_ns: u64,
    /// Run for futures since the last share.
    owed_ns: u64,
    /// The last wake found futures waiting: what the thread runs until it
    /// sleeps again (waking them) is theirs too.
    serving: bool,
}

impl OwnCpu {
    /// Reads the clock; the stretch since the last reading is owed when it
    /// was run for futures (`for_futures`), else it is no one's.
    fn read(&mut self, for_futures: bool) {
        let now = sys::thread_cputime_ns();
        if for_futures {
            self.owed_ns = self.owed_ns.saturating_add(now.saturating_sub(self.last_ns));
        }
        self.last_ns = now;
    }

    /// Shares what is owed equally among the futures woken now (with the
    /// remainder to the first): each part goes to the future's keyspace
    /// cell and to its credit. Owed CPU with no future to take it waits
    /// for the next wake.
    fn share(&mut self, woken: &[(u64, Arc<Attachment>, u32)], credits: &mut Vec<(u64, u64)>) {
        if woken.is_empty() || self.owed_ns == 0 {
            return;
        }
        let n = woken.len() as u64;
        let (each, rest) = (self.owed_ns / n, self.owed_ns % n);
        for (i, (id, att, cell)) in woken.iter().enumerate() {
            let ns = if i == 0 { each + rest } else { each };
            if let Some(k) = att.measure.keyspaces.get(*cell) {
                k.cpu_ns.fetch_add(ns, Ordering::Relaxed);
            }
            credits.push((*id, ns));
        }
        if credits.len() > MAX_CREDITS {
            credits.drain(..credits.len() - MAX_CREDITS);
        }
        self.owed_ns = 0;
    }
}

fn waiter_loop(w: &'static Waiter) {
    let mut counted: Vec<Counted> = Vec::new();
    let mut own = OwnCpu { last_ns: sys::thread_cputime_ns(), owed_ns: 0, serving: false };
    loop {
        let kick = w.kick.load(Ordering::SeqCst);
        // What to wait on, gathered under the lock; the wait itself runs
        // without it (futures register meanwhile, and poke `kick` when this
        // sleep does not cover them). The attachments held here keep the
        // words mapped.
        let (words, deadline, due) = {
            let mut waits = w.lock();
            let Waits { entries, covered, wakes_by_ns, .. } = &mut *waits;
            // About to sleep with nothing to wait for: what it ran since
            // its last wake (waking futures) is owed if that wake served
            // some; the sleep itself is owed only if a registration ends it.
            if entries.is_empty() {
                own.read(own.serving);
                own.serving = false;
            }
            // The liveness check bounds a sleep with futures waiting; with
            // none, it sleeps until a registration kicks it (below).
            let mut deadline = sys::monotonic_ns() + LIVENESS_CHECK.as_nanos() as u64;
            // The thread counts itself asleep on each bucket a future waits
            // on, at the first place there (before it reads the words and
            // the heads, as a blocked waiter does), and no longer on the
            // others.
            counted.retain(|c| entries.iter().any(|e| c.is(&e.att, e.bucket)));
            for c in counted.iter_mut() {
                if let Some(first) = first_place(entries, &c.att, c.bucket) {
                    c.place(first);
                }
            }
            for e in entries.iter() {
                deadline = deadline.min(e.deadline_ns);
                if !counted.iter().any(|c| c.is(&e.att, e.bucket)) && counted.len() < MAX_WORDS {
                    let first = first_place(entries, &e.att, e.bucket).unwrap_or(e.pos);
                    counted.push(Counted::new(e.att.clone(), e.bucket, first));
                }
            }
            let words: Vec<u32> =
                counted.iter().map(|c| bucket(&c.att, c.bucket).wake_seq.load(Ordering::SeqCst)).collect();
            let now = sys::monotonic_ns();
            let due = entries.iter().any(|e| bucket(&e.att, e.bucket).reached(e.pos) || now >= e.deadline_ns);
            covered.clear();
            if !due {
                covered.extend(
                    counted.iter().filter_map(|c| c.slot.map(|(_, at)| (Arc::as_ptr(&c.att) as usize, c.bucket, at))),
                );
            }
            *wakes_by_ns = if entries.is_empty() { u64::MAX } else { deadline };
            (words, deadline, due)
        };
        if !due && counted.is_empty() {
            // Nothing waits: only the kick word, with a plain futex wait
            // (every kernel has it), for an hour at a time.
            sys::futex_wait(&w.kick, kick, std::time::Duration::from_secs(3600));
        } else if !due {
            let refs: Vec<(&AtomicU32, u32)> = std::iter::once((&w.kick, kick))
                .chain(counted.iter().zip(&words).map(|(c, &seen)| (&bucket(&c.att, c.bucket).wake_seq, seen)))
                .collect();
            if let Err(e) = sys::futex_waitv(&refs, deadline) {
                // A kernel without futex_waitv (before 5.16): every future
                // looks at its place each millisecond instead.
                log::debug!("futex_waitv: {e}");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        // Wake every future whose place in line was reached, whose deadline
        // passed, or whose agent is gone: they poll again. The rest wait on
        // for the bucket's next move.
        // (Woken after the lock is let go: a waker may poll its future
        // at once, which registers again.)
        let now = sys::monotonic_ns();
        let mut ready = Vec::new();
        let mut woken = Vec::new();
        {
            let mut waits = w.lock();
            // Futures wait (since before the sleep, or registered during
            // it): the stretch since the last reading was run for them.
            own.serving = !waits.entries.is_empty();
            waits.entries.retain_mut(|e| {
                let alive = agent_alive(&e.att);
                let served = bucket(&e.att, e.bucket).reached(e.pos);
                let done = served || now >= e.deadline_ns || !alive;
                if done {
                    ready.push(std::mem::replace(&mut e.waker, Waker::noop().clone()));
                    // Only a future served pays: one woken at its deadline
                    // is refused and holds no ticket to count it in.
                    if let Some(cell) = e.cell.filter(|_| served && alive) {
                        woken.push((e.id, e.att.clone(), cell));
                    }
                }
                !done
            });
            // Credited before the wakes: a woken future may poll at once.
            // (Waking them is part of the next share.)
            own.read(own.serving);
            own.share(&woken, &mut waits.credits);
        }
        ready.into_iter().for_each(Waker::wake);
    }
}

static NEXT_ENTRY: AtomicU64 = AtomicU64::new(1);

/// Registers a wait for `bucket` of `att` reaching `pos`, charged to
/// keyspace cell `cell`; `None` if it already did (poll again at once).
/// The waiter thread counts itself
/// asleep on the bucket before it looks whether the place was reached; it
/// is kicked unless its sleep already wakes for an earlier place of the
/// same bucket, and by the registration's deadline.
pub(super) fn register(
    att: &Arc<Attachment>,
    bucket_i: u32,
    pos: u64,
    deadline: Option<Instant>,
    cell: Option<u32>,
    waker: &Waker,
) -> Option<u64> {
    if bucket(att, bucket_i).reached(pos) {
        return None;
    }
    let deadline_ns = match deadline {
        Some(d) => sys::monotonic_ns()
            .saturating_add(u64::try_from(d.saturating_duration_since(Instant::now()).as_nanos()).unwrap_or(u64::MAX)),
        None => u64::MAX,
    };
    let w = waiter();
    let id = NEXT_ENTRY.fetch_add(1, Ordering::Relaxed);
    let covered = {
        let mut waits = w.lock();
        waits.entries.push(Entry {
            id,
            att: att.clone(),
            bucket: bucket_i,
            pos,
            deadline_ns,
            cell,
            waker: waker.clone(),
        });
        deadline_ns >= waits.wakes_by_ns
            && waits
                .covered
                .iter()
                .any(|&(a, b, at)| a == Arc::as_ptr(att) as usize && b == bucket_i && !before(pos, at))
    };
    if !covered {
        w.kick.fetch_add(1, Ordering::SeqCst);
        sys::futex_wake(&w.kick, 1);
    }
    Some(id)
}

/// Ends a registration: forgets it if it has not fired yet (the waiter
/// thread moves its slot, or stops counting itself on a bucket nobody
/// waits on, at its next wake); if it fired, returns the waiter thread's
/// CPU credited to it (ns), already charged to its keyspace, for its ticket.
pub(super) fn unregister(id: u64) -> u64 {
    let mut waits = waiter().lock();
    if let Some(i) = waits.entries.iter().position(|e| e.id == id) {
        waits.entries.swap_remove(i);
        return 0;
    }
    match waits.credits.iter().position(|&(c, _)| c == id) {
        Some(i) => waits.credits.swap_remove(i).1,
        None => 0,
    }
}
