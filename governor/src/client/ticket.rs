//! Tickets: admission of one request through the shared regions, without a
//! syscall or a lock on the fast path.
//!
//! `Client::acquire` checks the tenant's concurrency, the pending write
//! bytes and the CPU tokens ([`crate::policy::acquire`]); with a deadline it
//! waits in line for CPU tokens (sleeping on the bucket's futex word, woken
//! by refills and refunds alike) instead of being refused. The [`Ticket`]
//! records what it holds in the client's ledger, so the agent can return it
//! if the process dies. Work runs inside [`Ticket::enter`] (or
//! [`Ticket::run`] for a future): the thread is tagged with the keyspace and
//! the ticket is charged exactly the CPU the measurement protocol charged
//! meanwhile. Admitted work runs to completion: past its tokens it waits
//! for top-ups at its checkpoints (paced), it is not dropped. Dropping the ticket gives back what it did not use and turns
//! an overrun into (bounded) debt.
//!
//! When no agent answers — it died, or stalls — every acquire admits at once
//! and is counted ([`super::Client::fail_open_count`]): a dead agent never
//! takes the node down.

use super::attachment::Attachment;
use super::conn::Client;
use super::error::Refused;
use super::home;
use super::line::{Waited, agent_alive, charged, wait_in_line};
use crate::policy::{self, Demand, Grant, Knobs, Progress, Queued, Refusal};
use crate::region::{CellRef, TicketView};
use crate::sys;
use keyspace_governor_common::admission::{
    KNOB_RUNTIME_TOPUP, T_COUNTED, TICKET_CLAIMED, TICKET_FREE, TICKET_HELD, counter,
};
use keyspace_governor_common::tag_for;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// One admitted request. Tag its work with [`Ticket::enter`] or
/// [`Ticket::run`]; drop it when the request is done.
///
/// A ticket is owned (`'static + Send`): it can move into a spawned task
/// or to another thread, like tokio's `OwnedSemaphorePermit`. Work that
/// was admitted runs to completion: when it needs more CPU tokens than the
/// ticket holds, [`Ticket::run`] and [`Ticket::checkpoint`] wait for them
/// (the request is paced, never dropped); the deadline of its [`Demand`]
/// bounds only the wait for admission. Aborting running work when tokens
/// run out is an explicit choice: [`Ticket::run_until_deadline`],
/// [`Ticket::checkpoint_until_deadline`].
#[must_use = "a ticket admits work: drop it when the work is done"]
pub struct Ticket {
    /// `None`: admitted without a check (no agent answered); holds nothing.
    pub(crate) att: Option<Arc<Attachment>>,
    record: u32,
    /// Time in line before admission, µs (rounded up): with `paced_us`,
    /// 4-byte fields keep a ticket within 128 bytes, which moves inline
    /// (no `memcpy` call) when it is returned or moved into a task.
    waited_us: u32,
    /// Time spent waiting for top-ups at checkpoints, µs (rounded up).
    paced_us: u32,
    pub(crate) grant: Grant,
    pub(crate) consumed_ns: u64,
    /// `consumed_ns` at the last top-up check.
    checked_ns: u64,
    /// A top-up was refused at a tag switch: the next checkpoint waits for it.
    pub(crate) topup_due: bool,
    pub(crate) deadline: Option<Instant>,
}

/// `d` in µs, rounded up (a wait is never read as none), saturated.
fn micros_up(d: Duration) -> u32 {
    d.as_nanos().div_ceil(1000).min(u128::from(u32::MAX)) as u32
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("keyspace", &self.grant.keyspace())
            .field("granted_us", &self.grant.granted_us())
            .field("consumed_ns", &self.consumed_ns)
            .field("waited", &self.waited())
            .field("fail_open", &self.att.is_none())
            .finish()
    }
}

thread_local! {
    /// Where this thread looks for a free ledger record first: the record
    /// it used last (freed again when its ticket dropped, and still in this
    /// CPU's cache). Threads start far apart, so they claim records on
    /// different cache lines.
    static LEDGER_HINT: std::cell::Cell<u32> = const { std::cell::Cell::new(u32::MAX) };
}

/// Claims a free record in the shared half of the client's ledger (bounded
/// scan from the thread's hint), for a thread without a block of its own
/// or with every record of its block held.
pub(crate) fn claim_shared(att: &Attachment) -> Option<u32> {
    static SPREAD: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let (start, end) = (att.blocks.shared_start(), att.ledger.len());
    let len = end.checked_sub(start).filter(|&n| n > 0)?;
    let hint = LEDGER_HINT.try_with(|h| h.get()).unwrap_or(u32::MAX);
    let mut idx =
        if (start..end).contains(&hint) { hint } else { start + SPREAD.fetch_add(61, Ordering::Relaxed) % len };
    for _ in 0..len {
        let r = att.ledger.get(idx)?;
        if r.state.load(Ordering::Relaxed) == TICKET_FREE
            && r.state.compare_exchange(TICKET_FREE, TICKET_CLAIMED, Ordering::AcqRel, Ordering::Relaxed).is_ok()
        {
            let _ = LEDGER_HINT.try_with(|h| h.set(idx));
            return Some(idx);
        }
        idx += 1;
        if idx == end {
            idx = start;
        }
    }
    None
}

fn record(att: &Attachment, idx: u32) -> &TicketView {
    att.ledger.get(idx).expect("claimed record")
}

/// Writes what a granted ticket holds into its record, then marks it held.
#[inline]
fn write_record(att: &Attachment, idx: u32, g: &Grant) {
    let r = record(att, idx);
    let (cell, generation) = g.cell_at().map_or((0, 0), |c| (c.index + 1, c.generation));
    r.cell.store(cell, Ordering::Relaxed);
    r.generation.store(generation, Ordering::Relaxed);
    r.tenant_us.store(g.tenant_us, Ordering::Relaxed);
    r.global_us.store(g.global_us, Ordering::Relaxed);
    r.burst_us.store(g.burst_us, Ordering::Relaxed);
    r.write_bytes.store(g.write_bytes, Ordering::Relaxed);
    r.flags.store(if g.counted { T_COUNTED } else { 0 }, Ordering::Relaxed);
    r.consumed_ns.store(0, Ordering::Relaxed);
    r.state.store(TICKET_HELD, Ordering::Release);
}

impl Client {
    /// Reports that the server's own thread pool rejected a request of
    /// `keyspace` (it overflowed): counted apart from admission refusals,
    /// since an overflowing pool says the node needs capacity, where an
    /// admission refusal says a tenant is being held back. Call it on the
    /// rejecting thread, while the request's keyspace is known. A store in
    /// shared memory (for a keyspace new to the agent, counted once its
    /// cell is in, without waiting); nothing happens when the agent is away.
    pub fn report_pool_rejection(&self, keyspace: u32) {
        let Some(att) = self.attachment().filter(|a| a.alive()) else { return };
        match self.inner.helper.cell(att, keyspace, None) {
            super::helper::Cell::Found(c) => {
                if let Some((b, _)) = att.admission.keyspace_cell(c.index) {
                    b.count(counter::POOL_REJECTED, 1);
                }
            }
            // Counted by the background thread once the cell is in.
            super::helper::Cell::Pending => self.inner.helper.pool_rejection(att.epoch, keyspace),
            // No cell for it: counted where it is held, the overflow bucket.
            super::helper::Cell::Refused => att.admission.counted_on(None).count(counter::POOL_REJECTED, 1),
        }
    }

    /// Admits one request of `keyspace`, or refuses it (after waiting in line
    /// for CPU tokens until the demand's deadline, if it has one).
    pub fn acquire(&self, keyspace: u32, demand: Demand) -> Result<Ticket, Refused> {
        let mut t = Ticket::blank(keyspace);
        let Some(w) = self.begin(keyspace, &demand, &mut t, None)? else { return Ok(t) };
        let Waiting { att, record: idx, q, k } = *w;
        let deadline = demand.deadline.expect("queued only with a deadline");
        let cell = q.cell();
        let (res, cpu) = charged(&att, cell, || wait_in_line(&att, &k, q, Some(deadline), idx));
        match res {
            (Waited::Granted(g), waited) => {
                let mut t = granted(att, idx, g, demand.deadline);
                t.set_waited(waited);
                t.add_consumed(cpu);
                Ok(t)
            }
            (Waited::Refused(r), _) => {
                record(&att, idx).state.store(TICKET_FREE, Ordering::Release);
                Err(r)
            }
            (Waited::FailOpen, _) => {
                record(&att, idx).state.store(TICKET_FREE, Ordering::Release);
                Ok(self.fail_open(keyspace, Some(&att)))
            }
        }
    }

    /// Everything up to the wait: the fast path fills `t` in place (a ticket
    /// is too big to move cheaply through every layer), or the request gets
    /// a place in line. `known`: the keyspace's cell as the caller found it
    /// (`Some(None)`: the agent gave it none); `None`: look it up here, with
    /// a round trip the first time the agent sees the keyspace.
    #[inline]
    pub(crate) fn begin(
        &self,
        keyspace: u32,
        demand: &Demand,
        t: &mut Ticket,
        known: Option<Option<CellRef>>,
    ) -> Result<Option<Box<Waiting>>, Refused> {
        let Some(att) = self.attachment().filter(|a| a.alive()) else {
            *t = self.fail_open(keyspace, None);
            return Ok(None);
        };
        home::with_home(att, true, |mut home| {
            let mine = home.as_ref().and_then(|h| h.claim());
            // Almost every ticket of a busy thread: its spare tokens pay.
            if let (Some(h), Some(idx)) = (home.as_deref_mut(), mine)
                && known.is_none_or(|c| c.is_some() && c == h.spare.cell)
                && let Some(g) = policy::acquire_spared(&att.admission, keyspace, demand, &mut h.spare)
            {
                write_record(att, idx, &g);
                t.att = Some(h.take_ref());
                t.record = idx;
                t.grant = g;
                t.deadline = demand.deadline;
                h.sync();
                return Ok(None);
            }
            // A thread's first admission here cannot take the spared lane
            // (its spare is empty): the thread may want registering.
            if let Some(h) = home.as_deref_mut()
                && std::mem::take(&mut h.just_made)
            {
                self.first_admission_on_thread();
            }
            let cell = match known {
                Some(c) => c,
                // `None`: no cell (the overflow bucket holds it).
                None => match self.inner.helper.cell_now(att, keyspace) {
                    Ok(c) => c,
                    Err(_) => {
                        if let Some(idx) = mine {
                            record(att, idx).state.store(TICKET_FREE, Ordering::Release);
                        }
                        *t = self.fail_open(keyspace, None);
                        return Ok(None);
                    }
                },
            };
            let k = att.admission.header().knobs.snapshot();
            let Some(idx) = mine.or_else(|| claim_shared(att)) else {
                return Err(Refused::new(Refusal::TooManyTickets { limit: att.ledger.len() }, Duration::ZERO, None));
            };
            let spare = home.as_deref_mut().map(|h| &mut h.spare);
            let queued = demand.deadline.is_some_and(|deadline| deadline > Instant::now());
            // A request that may wait takes its place in line, and is
            // admitted on the spot when the line lets it through: the same
            // path as one that may not, with no allocation and no tagging.
            let admitted = if queued {
                policy::acquire_queued(&att.admission, &k, keyspace, cell, demand, spare).map(|mut q| {
                    match q.poll(&att.admission, &k) {
                        Progress::Ready(g) => Ok(g),
                        Progress::Waiting { .. } => Err(q),
                    }
                })
            } else {
                policy::acquire_with(&att.admission, &k, keyspace, cell, demand, spare).map(Ok)
            };
            let out = admitted.map(|now| match now {
                Ok(g) => {
                    write_record(att, idx, &g);
                    // A reference the thread keeps for its tickets: no
                    // shared count touched when it has one.
                    t.att = Some(home.as_deref_mut().map_or_else(|| att.clone(), |h| h.take_ref()));
                    t.record = idx;
                    t.grant = g;
                    t.deadline = demand.deadline;
                    None
                }
                Err(q) => Some(Box::new(Waiting { att: att.clone(), record: idx, q, k })),
            });
            if let Some(h) = home {
                h.sync();
            }
            out.or_else(|reason| {
                record(att, idx).state.store(TICKET_FREE, Ordering::Release);
                // A refusal from buckets nobody refills any more is no refusal.
                if !queued && reason.is_cpu() && !agent_alive(att) {
                    *t = self.fail_open(keyspace, Some(att));
                    return Ok(None);
                }
                Err(Refused::new(reason, Duration::ZERO, cell.map(|c| c.index)))
            })
        })
    }

    pub(crate) fn fail_open(&self, keyspace: u32, att: Option<&Attachment>) -> Ticket {
        self.inner.fail_open.fetch_add(1, Ordering::Relaxed);
        if let Some(att) = att {
            att.admission.bucket(crate::region::GLOBAL).count(counter::FAIL_OPEN, 1);
        }
        Ticket::blank(keyspace)
    }
}

/// A ticket for a grant that waited in line, in ledger record `idx`.
pub(crate) fn granted(att: Arc<Attachment>, idx: u32, g: Grant, deadline: Option<Instant>) -> Ticket {
    write_record(&att, idx, &g);
    Ticket {
        att: Some(att),
        record: idx,
        grant: g,
        consumed_ns: 0,
        checked_ns: 0,
        topup_due: false,
        deadline,
        waited_us: 0,
        paced_us: 0,
    }
}

/// A request that waits in line for CPU tokens, with its ledger record.
pub(crate) struct Waiting {
    pub(crate) att: Arc<Attachment>,
    pub(crate) record: u32,
    pub(crate) q: Queued,
    pub(crate) k: Knobs,
}

impl Ticket {
    /// A ticket that holds nothing (what a fail-open admission hands out).
    #[inline]
    pub(crate) fn blank(keyspace: u32) -> Ticket {
        Ticket {
            att: None,
            record: 0,
            grant: Grant::unchecked(keyspace, None),
            consumed_ns: 0,
            checked_ns: 0,
            topup_due: false,
            deadline: None,
            waited_us: 0,
            paced_us: 0,
        }
    }

    /// How long the request waited in line before it was admitted (zero
    /// when tokens were there at once): a server that runs priority levels
    /// puts requests that waited (their tenant is held at its cap) below the
    /// rest. To the µs, rounded up.
    pub fn waited(&self) -> Duration {
        Duration::from_micros(self.waited_us.into())
    }

    /// Whether the request waited in line before it was admitted.
    pub fn did_wait(&self) -> bool {
        self.waited_us != 0
    }

    /// How long the running work waited for top-ups at its checkpoints so
    /// far (the pacing that holds its keyspace to its share). To the µs,
    /// rounded up.
    pub fn paced(&self) -> Duration {
        Duration::from_micros(self.paced_us.into())
    }

    /// The keyspace the ticket admits.
    pub fn keyspace(&self) -> u32 {
        self.grant.keyspace()
    }

    /// CPU µs this ticket holds (its estimate plus top-ups).
    pub fn granted_us(&self) -> u64 {
        self.grant.granted_us()
    }

    /// CPU the ticket's work consumed so far, ns (the measurement
    /// protocol's own count, not wall time), with what its admission and
    /// its top-ups cost: the polls of its wait in line and, for the async
    /// forms, its part of the waiter thread's CPU. What the keyspace was
    /// charged for it.
    pub fn consumed_ns(&self) -> u64 {
        self.consumed_ns
    }

    /// Admitted without a check because no agent answered.
    pub fn is_fail_open(&self) -> bool {
        self.att.is_none()
    }

    /// Runs the ticket's work on this thread until the guard drops: the
    /// thread's CPU is charged to the keyspace (and to this ticket). A
    /// thread the client has not registered (a `spawn_blocking` thread, a
    /// thread of the server's own) is registered here, in the background:
    /// the ticket counts its work by the thread clock at once, the keyspace
    /// from about one round trip to the agent on.
    pub fn enter(&mut self) -> TicketGuard<'_> {
        let tag = self.grant.cell().map(|c| tag_for(c, self.grant.kind));
        let epoch = self.att.as_ref().map(|a| a.epoch);
        // On this client's current registration, tag and read the thread
        // clock in one step; elsewhere (unregistered thread, fail-open
        // ticket) just read the kernel's clock.
        let tagged = match (tag, epoch) {
            (Some(tag), Some(epoch)) => super::with_ctx(|ctx| {
                (ctx.att.epoch == epoch).then(|| {
                    let th = ctx.thread();
                    let (old, t) = th.switch_tag(tag);
                    (old, if t == 0 { th.clock() } else { t })
                })
            })
            .ok()
            .flatten()
            .flatten(),
            _ => None,
        };
        let (prev_tag, t0) = match tagged {
            Some((old, t)) => (Some(old), t),
            None => {
                if let Some(att) = &self.att {
                    att.adopt_current_thread();
                }
                (None, sys::thread_cputime_ns())
            }
        };
        TicketGuard { ticket: self, prev_tag, t0, _not_send: std::marker::PhantomData }
    }

    /// Records CPU consumed by a finished stretch of work, and tops up if the
    /// ticket ran past its share (without waiting: a refusal is kept for the
    /// next [`Ticket::checkpoint`]).
    pub(crate) fn add_consumed(&mut self, ns: u64) {
        self.consumed_ns = self.consumed_ns.saturating_add(ns);
        let Some(att) = &self.att else { return };
        record(att, self.record).consumed_ns.store(self.consumed_ns, Ordering::Relaxed);
        let k = att.admission.header().knobs.snapshot();
        if !k.has(KNOB_RUNTIME_TOPUP) {
            return;
        }
        if self.consumed_ns.saturating_sub(self.checked_ns) < k.runtime_check_interval_us.saturating_mul(1000) {
            return;
        }
        self.checked_ns = self.consumed_ns;
        for _ in 0..64 {
            if !self.grant.needs_top_up(self.consumed_ns / 1000, k.topup_threshold_milli) {
                return;
            }
            if policy::top_up(&att.admission, &k, &mut self.grant, k.per_allocation_us).is_err() {
                self.topup_due = true;
                return;
            }
            write_record(att, self.record, &self.grant);
        }
    }

    /// Whether the ticket must top up before running more work.
    pub(crate) fn needs_top_up(&self, k: &Knobs) -> bool {
        self.topup_due
            || (k.has(KNOB_RUNTIME_TOPUP) && self.grant.needs_top_up(self.consumed_ns / 1000, k.topup_threshold_milli))
    }

    /// Between two stretches of a long request's work: if it ran past its
    /// share, waits in line for a top-up (blocking this thread; in async
    /// code use [`Ticket::checkpoint_async`]). The work is paced to its
    /// keyspace's share, never refused: admitted work finishes.
    pub fn checkpoint(&mut self) {
        let _ = self.top_up_waiting(None);
    }

    /// [`Ticket::checkpoint`] for a request that gives up when tokens run
    /// out: waits for a top-up only until the deadline of its [`Demand`] (a
    /// ticket without one is refused at once). A refusal says the request
    /// should stop; the ticket still holds what it had.
    pub fn checkpoint_until_deadline(&mut self) -> Result<(), Refused> {
        let deadline = self.deadline.unwrap_or_else(Instant::now);
        self.top_up_waiting(Some(deadline))
    }

    fn top_up_waiting(&mut self, deadline: Option<Instant>) -> Result<(), Refused> {
        let Some(att) = self.att.clone() else { return Ok(()) };
        let k = att.admission.header().knobs.snapshot();
        for _ in 0..1024 {
            if !self.needs_top_up(&k) {
                self.topup_due = false;
                return Ok(());
            }
            let q = policy::top_up_queued(&att.admission, &k, &self.grant, k.per_allocation_us, deadline.is_none());
            let ((res, waited), cpu) =
                charged(&att, self.grant.cell(), || wait_in_line(&att, &k, q, deadline, self.record));
            self.waited_for_top_up(waited, cpu);
            match res {
                Waited::Granted(part) => self.absorb_top_up(part),
                Waited::Refused(r) => return Err(r),
                Waited::FailOpen => {
                    self.topup_due = false;
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// The ticket's attachment, for the async waiter.
    pub(crate) fn attachment(&self) -> Option<Arc<Attachment>> {
        self.att.clone()
    }

    /// Counts a wait for a top-up: its time as pacing, the CPU it spent
    /// as the ticket's.
    /// Records the time the request waited in line for admission.
    pub(crate) fn set_waited(&mut self, waited: Duration) {
        self.waited_us = micros_up(waited);
    }

    pub(crate) fn waited_for_top_up(&mut self, waited: Duration, cpu_ns: u64) {
        self.paced_us = self.paced_us.saturating_add(micros_up(waited));
        self.consumed_ns = self.consumed_ns.saturating_add(cpu_ns);
    }

    /// Adds a granted top-up to the ticket and its ledger record.
    pub(crate) fn absorb_top_up(&mut self, part: Grant) {
        self.grant.absorb(part);
        self.topup_due = false;
        if let Some(att) = &self.att {
            write_record(att, self.record, &self.grant);
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let Some(att) = self.att.take() else { return };
        let (consumed_us, grant, idx) = (self.consumed_ns / 1000, &self.grant, self.record);
        home::release_owned(
            att,
            |h| {
                policy::release_with(&h.att.admission, grant, consumed_us, Some(&mut h.spare));
                h.sync();
                record(&h.att, idx).state.store(TICKET_FREE, Ordering::Release);
            },
            |att| {
                policy::release(&att.admission, grant, consumed_us);
                record(att, idx).state.store(TICKET_FREE, Ordering::Release);
            },
        );
    }
}

/// Work of a ticket running on this thread. Not `Send`: it tags the thread
/// that entered it.
#[must_use = "the ticket's work runs until the guard drops"]
pub struct TicketGuard<'a> {
    ticket: &'a mut Ticket,
    /// The tag to restore, when the thread was tagged.
    prev_tag: Option<u64>,
    t0: u64,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl TicketGuard<'_> {
    /// CPU this stretch of work consumed so far, ns.
    pub fn consumed_ns(&self) -> u64 {
        let now = match self.prev_tag {
            Some(_) => super::thread_cpu_ns().unwrap_or(self.t0),
            None => sys::thread_cputime_ns(),
        };
        now.saturating_sub(self.t0)
    }
}

impl Drop for TicketGuard<'_> {
    fn drop(&mut self) {
        let t1 = match self.prev_tag {
            Some(prev) => super::with_ctx(|ctx| {
                let th = ctx.thread();
                let (_, t) = th.switch_tag(prev);
                if t == 0 { th.clock() } else { t }
            })
            .ok()
            .flatten()
            .unwrap_or(self.t0),
            None => sys::thread_cputime_ns(),
        };
        self.ticket.add_consumed(t1.saturating_sub(self.t0));
    }
}

#[cfg(test)]
mod tests {
    /// Moves of up to 128 bytes are inline stores; past that, a `memcpy`
    /// call on every return and move of a ticket (the fast path's cost).
    #[test]
    fn a_ticket_moves_inline() {
        assert!(std::mem::size_of::<super::Ticket>() <= 128, "{} bytes", std::mem::size_of::<super::Ticket>());
    }
}
