//! Waiting without blocking an executor thread: [`Client::acquire_async`]
//! and [`Ticket::run`].
//!
//! A future that must wait for CPU tokens registers with one waiter thread
//! per process, which sleeps in `futex_waitv` on the wake words of every
//! bucket some future waits on (and on a word of its own, poked when a new
//! future registers) until the nearest deadline. A refill or a refund that
//! moves a bucket's head wakes it; it wakes the futures of that bucket (and
//! those past their deadline), which poll their place in line again. Nothing
//! polls on a timer: the only timeout is the liveness check that turns a
//! dead agent into fail-open admission.

use super::conn::{Attachment, Client};
use super::ticket::{agent_alive, Demand, Refused, Ticket, LIVENESS_CHECK};
use crate::policy::{self, Knobs, Progress, Queued};
use crate::region::BucketView;
use crate::sys;
use governor_common::admission::counter;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

/// One future's wait: which bucket, since which wake, until when.
struct Entry {
    id: u64,
    att: Arc<Attachment>,
    bucket: u32,
    seen: u32,
    deadline_ns: u64,
    waker: Waker,
}

struct Waiter {
    entries: Mutex<Vec<Entry>>,
    /// Poked (and woken) when an entry is added.
    kick: AtomicU32,
}

fn waiter() -> &'static Waiter {
    static W: OnceLock<&'static Waiter> = OnceLock::new();
    W.get_or_init(|| {
        let w: &'static Waiter = Box::leak(Box::new(Waiter { entries: Mutex::new(Vec::new()), kick: AtomicU32::new(0) }));
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

fn waiter_loop(w: &'static Waiter) {
    loop {
        let kick = w.kick.load(Ordering::SeqCst);
        // What to wait on, gathered under the lock; the wait itself runs
        // without it (futures register meanwhile and poke `kick`). The
        // attachments held here keep the words mapped.
        let (targets, deadline) = {
            let entries = w.entries.lock().unwrap_or_else(|p| p.into_inner());
            let mut deadline = sys::monotonic_ns() + LIVENESS_CHECK.as_nanos() as u64;
            let mut targets: Vec<(Arc<Attachment>, u32, u32)> = Vec::new();
            for e in entries.iter() {
                deadline = deadline.min(e.deadline_ns);
                let dup = targets.iter().any(|(a, b, _)| Arc::ptr_eq(a, &e.att) && *b == e.bucket);
                if !dup && targets.len() < MAX_WORDS {
                    targets.push((e.att.clone(), e.bucket, e.seen));
                }
            }
            (targets, deadline)
        };
        let refs: Vec<(&AtomicU32, u32)> = std::iter::once((&w.kick, kick))
            .chain(targets.iter().map(|(a, b, seen)| (&bucket(a, *b).wake_seq, *seen)))
            .collect();
        if let Err(e) = sys::futex_waitv(&refs, deadline) {
            // A kernel without futex_waitv (before 5.16): wake everyone each
            // liveness period instead.
            log::debug!("futex_waitv: {e}");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        drop(refs);
        drop(targets);
        // Wake every future whose bucket moved, whose deadline passed, or
        // whose agent is gone: they poll again.
        let now = sys::monotonic_ns();
        let mut entries = w.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.retain(|e| {
            let moved = bucket(&e.att, e.bucket).wake_seq.load(Ordering::SeqCst) != e.seen;
            if moved || now >= e.deadline_ns || !agent_alive(&e.att) {
                bucket(&e.att, e.bucket).sleepers.fetch_sub(1, Ordering::SeqCst);
                e.waker.wake_by_ref();
                false
            } else {
                true
            }
        });
    }
}

static NEXT_ENTRY: AtomicU64 = AtomicU64::new(1);

/// Registers a wait for `bucket` of `att` reaching `pos`; `false` if it
/// already did (poll again at once).
fn register(att: &Arc<Attachment>, bucket_i: u32, pos: u64, deadline: Instant, waker: &Waker) -> Option<u64> {
    let b = bucket(att, bucket_i);
    let seen = b.wake_seq.load(Ordering::SeqCst);
    b.sleepers.fetch_add(1, Ordering::SeqCst);
    if b.reached(pos) {
        b.sleepers.fetch_sub(1, Ordering::SeqCst);
        return None;
    }
    let now = Instant::now();
    let deadline_ns = sys::monotonic_ns() + deadline.saturating_duration_since(now).as_nanos() as u64;
    let w = waiter();
    let id = NEXT_ENTRY.fetch_add(1, Ordering::Relaxed);
    w.entries.lock().unwrap_or_else(|p| p.into_inner()).push(Entry {
        id,
        att: att.clone(),
        bucket: bucket_i,
        seen,
        deadline_ns,
        waker: waker.clone(),
    });
    w.kick.fetch_add(1, Ordering::SeqCst);
    sys::futex_wake(&w.kick, 1);
    Some(id)
}

/// Forgets a registration that has not fired yet.
fn unregister(id: u64) {
    let w = waiter();
    let mut entries = w.entries.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(i) = entries.iter().position(|e| e.id == id) {
        let e = entries.swap_remove(i);
        bucket(&e.att, e.bucket).sleepers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One place in line, polled from a future.
struct Line {
    att: Arc<Attachment>,
    q: Option<Queued>,
    k: Knobs,
    deadline: Instant,
    started: Instant,
    registered: Option<u64>,
    waited: bool,
}

enum LineResult {
    Granted(policy::Grant),
    Refused(Refused),
    FailOpen,
}

impl Line {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<LineResult> {
        if let Some(id) = self.registered.take() {
            unregister(id);
        }
        let r = &self.att.admission;
        loop {
            let q = self.q.as_mut().expect("polled after completion");
            match q.poll(r, &self.k) {
                Progress::Ready(g) => {
                    self.q = None;
                    if self.waited {
                        let b = g.cell().and_then(|c| r.keyspace_cell(c)).map_or(r.bucket(crate::region::GLOBAL), |x| x.0);
                        b.count(counter::WAITED, 1);
                        b.count(counter::WAIT_US, self.started.elapsed().as_micros() as u64);
                    }
                    return Poll::Ready(LineResult::Granted(g));
                }
                Progress::Waiting { bucket, pos } => {
                    let now = Instant::now();
                    if now >= self.deadline {
                        let reason = self.q.take().expect("queued").cancel(r);
                        return Poll::Ready(LineResult::Refused(Refused { reason, waited: now - self.started }));
                    }
                    if !agent_alive(&self.att) {
                        let _ = self.q.take().expect("queued").cancel(r);
                        return Poll::Ready(LineResult::FailOpen);
                    }
                    self.waited = true;
                    match register(&self.att, bucket, pos, self.deadline, cx.waker()) {
                        Some(id) => {
                            self.registered = Some(id);
                            return Poll::Pending;
                        }
                        None => continue,
                    }
                }
            }
        }
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        if let Some(id) = self.registered.take() {
            unregister(id);
        }
        if let Some(q) = self.q.take() {
            let _ = q.cancel(&self.att.admission);
        }
    }
}

/// [`Client::acquire_async`]'s future.
pub struct AcquireFuture<'c> {
    client: &'c Client,
    keyspace: u32,
    deadline: Option<Instant>,
    state: AcquireState<'c>,
}

enum AcquireState<'c> {
    Ready(Option<Result<Ticket<'c>, Refused>>),
    Waiting { att: &'c Arc<Attachment>, line: Line, record: u32 },
}

impl Client {
    /// Like [`Client::acquire`], but waits for CPU tokens without blocking
    /// the executor's thread.
    pub fn acquire_async(&self, keyspace: u32, demand: Demand) -> AcquireFuture<'_> {
        let mut t = Ticket::blank(keyspace);
        let state = match self.begin(keyspace, &demand, &mut t) {
            Ok(None) => AcquireState::Ready(Some(Ok(t))),
            Err(r) => AcquireState::Ready(Some(Err(r))),
            Ok(Some(w)) => {
                let super::ticket::Waiting { att, record, q, k } = *w;
                AcquireState::Waiting {
                    att,
                    line: Line {
                        att: att.clone(),
                        q: Some(q),
                        k,
                        deadline: demand.deadline.expect("queued only with a deadline"),
                        started: Instant::now(),
                        registered: None,
                        waited: false,
                    },
                    record,
                }
            }
        };
        AcquireFuture { client: self, keyspace, deadline: demand.deadline, state }
    }
}

impl<'c> Future for AcquireFuture<'c> {
    type Output = Result<Ticket<'c>, Refused>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match &mut this.state {
            AcquireState::Ready(r) => Poll::Ready(r.take().expect("polled after completion")),
            AcquireState::Waiting { att, line, record } => {
                let (att, idx) = (*att, *record);
                let res = std::task::ready!(line.poll(cx));
                let free = || att.ledger.get(idx).map(|r| r.state.store(governor_common::admission::TICKET_FREE, Ordering::Release));
                let out = match res {
                    LineResult::Granted(g) => Ok(this.client.granted(att, idx, g, this.deadline)),
                    LineResult::Refused(r) => {
                        free();
                        Err(r)
                    }
                    LineResult::FailOpen => {
                        free();
                        Ok(this.client.fail_open(this.keyspace, Some(att)))
                    }
                };
                this.state = AcquireState::Ready(None);
                Poll::Ready(out)
            }
        }
    }
}

impl Drop for AcquireFuture<'_> {
    fn drop(&mut self) {
        // A future dropped while in line frees its ledger record (the line
        // itself gives its place back when it drops).
        if let AcquireState::Waiting { att, record, .. } = &self.state
            && let Some(r) = att.ledger.get(*record) {
                r.state.store(governor_common::admission::TICKET_FREE, Ordering::Release);
            }
    }
}

/// [`Ticket::run`]'s future: every poll of the inner future runs inside the
/// ticket (tagged, charged to it); between polls, a ticket that ran past its
/// share tops up, waiting in line without blocking. Resolves to the inner
/// output, or to the refusal of a top-up the deadline cut short.
pub struct TicketFuture<'c, F> {
    ticket: Option<Ticket<'c>>,
    inner: Pin<Box<F>>,
    topup: Option<Line>,
}

impl<'c> Ticket<'c> {
    /// Runs `fut` under this ticket; the ticket is released when it ends.
    pub fn run<F: Future>(self, fut: F) -> TicketFuture<'c, F> {
        TicketFuture { ticket: Some(self), inner: Box::pin(fut), topup: None }
    }
}

impl<F: Future> Future for TicketFuture<'_, F> {
    type Output = Result<F::Output, Refused>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // All fields are Unpin (the inner future is boxed).
        let this = self.get_mut();
        loop {
            if let Some(line) = this.topup.as_mut() {
                let res = std::task::ready!(line.poll(cx));
                this.topup = None;
                let t = this.ticket.as_mut().expect("ticket until ready");
                match res {
                    LineResult::Granted(part) => {
                        t.grant.absorb(part);
                        t.topup_due = false;
                        t.store_grant();
                    }
                    LineResult::Refused(r) => {
                        this.ticket = None;
                        return Poll::Ready(Err(r));
                    }
                    LineResult::FailOpen => t.topup_due = false,
                }
            }
            let t = this.ticket.as_mut().expect("ticket until ready");
            if let Some((att, _)) = t.parts() {
                let k = att.admission.header().knobs.snapshot();
                if t.needs_top_up(&k) {
                    let q = policy::top_up_queued(&att.admission, &k, &t.grant, k.per_allocation_us);
                    let deadline = t.deadline.unwrap_or_else(Instant::now);
                    this.topup = Some(Line { att, q: Some(q), k, deadline, started: Instant::now(), registered: None, waited: false });
                    continue;
                }
            }
            break;
        }
        let t = this.ticket.as_mut().expect("ticket until ready");
        let out = {
            let _g = t.enter();
            this.inner.as_mut().poll(cx)
        };
        match out {
            Poll::Ready(v) => {
                this.ticket = None;
                Poll::Ready(Ok(v))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<F> Unpin for TicketFuture<'_, F> {}
