//! Waiting without blocking an executor thread: [`Client::acquire_async`],
//! [`Ticket::run`] and [`Ticket::checkpoint_async`].
//!
//! A future that must wait for CPU tokens registers with the process's
//! waiter thread ([`super::waiter`]), which wakes it when its place in line
//! is reached (or its deadline passes, or the agent goes); it polls again.
//! Nothing polls on a timer: the only timeout is the liveness check that
//! turns a dead agent into fail-open admission. The CPU a future spends
//! polling its place in line is charged to its keyspace (and, once
//! admitted, to its ticket), like the work itself; so is its part of the
//! waiter thread's CPU, which the thread shares out among the futures it
//! wakes.

use super::attachment::Attachment;
use super::conn::Client;
use super::error::Refused;
use super::line::{agent_alive, charged};
use super::ticket::{Ticket, granted};
use super::waiter::{register, unregister};
use crate::policy::Demand;
use crate::policy::{self, Knobs, Progress, Queued};
use crate::region::CellRef;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// One place in line, polled from a future.
struct Line {
    att: Arc<Attachment>,
    q: Option<Queued>,
    k: Knobs,
    /// `None`: waits until served (a paced top-up).
    deadline: Option<Instant>,
    started: Instant,
    registered: Option<u64>,
    waited: bool,
    /// The keyspace cell it admits, and the CPU its polls took there.
    cell: Option<u32>,
    cpu_ns: u64,
}

enum LineResult {
    Granted(policy::Grant),
    Refused(Refused),
    FailOpen,
}

impl Line {
    /// Polls its place in line, tagged with its keyspace.
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<LineResult> {
        let att = self.att.clone();
        let (out, cpu) = charged(&att, self.cell, || self.poll_untagged(cx));
        self.cpu_ns += cpu;
        out
    }

    fn poll_untagged(&mut self, cx: &mut Context<'_>) -> Poll<LineResult> {
        if let Some(id) = self.registered.take() {
            // The waiter thread's CPU for this wait, charged to the keyspace.
            self.cpu_ns += unregister(id);
        }
        let r = &self.att.admission;
        loop {
            let q = self.q.as_mut().expect("polled after completion");
            match q.poll(r, &self.k) {
                Progress::Ready(g) => {
                    let (which, top_up) = (q.wait_hist(true), q.is_top_up());
                    self.q = None;
                    if self.waited {
                        super::line::count_wait(r, &g, self.started.elapsed(), top_up);
                        r.counted_on(self.cell).observe_wait(which, self.started.elapsed());
                    }
                    return Poll::Ready(LineResult::Granted(g));
                }
                Progress::Waiting { bucket, pos } => {
                    let now = Instant::now();
                    if self.deadline.is_some_and(|d| now >= d) {
                        r.counted_on(self.cell).observe_wait(q.wait_hist(false), now - self.started);
                        let reason = self.q.take().expect("queued").cancel(r);
                        return Poll::Ready(LineResult::Refused(Refused::new(reason, now - self.started, self.cell)));
                    }
                    if !agent_alive(&self.att) {
                        let _ = self.q.take().expect("queued").cancel(r);
                        return Poll::Ready(LineResult::FailOpen);
                    }
                    self.waited = true;
                    match register(&self.att, bucket, pos, self.deadline, self.cell, cx.waker()) {
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

impl Line {
    fn new(att: Arc<Attachment>, q: Queued, k: Knobs, deadline: Option<Instant>) -> Line {
        let cell = q.cell();
        Line { att, q: Some(q), k, deadline, started: Instant::now(), registered: None, waited: false, cell, cpu_ns: 0 }
    }

    /// How long it has waited (zero if it was served on its first poll).
    fn waited(&self) -> Duration {
        if self.waited { self.started.elapsed() } else { Duration::ZERO }
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        if let Some(id) = self.registered.take() {
            // A credit not taken stays with the keyspace, charged.
            unregister(id);
        }
        if let Some(q) = self.q.take() {
            let _ = q.cancel(&self.att.admission);
        }
    }
}

/// [`Client::acquire_async`]'s future. Owned: it can move into a spawned
/// task.
pub struct AcquireFuture {
    state: AcquireState,
}

enum AcquireState {
    /// The agent has no cell for the keyspace yet: asked for in the
    /// background, this future is woken when it is in.
    Cell {
        client: Client,
        keyspace: u32,
        demand: Demand,
    },
    Ready(Option<Result<Ticket, Refused>>),
    Waiting {
        client: Client,
        keyspace: u32,
        deadline: Option<Instant>,
        line: Line,
        record: u32,
    },
}

impl Client {
    /// Like [`Client::acquire`], but waits for CPU tokens without blocking
    /// the executor's thread; the first request of a keyspace the agent has
    /// no cell for waits for it without blocking too.
    ///
    /// Ready at its first poll when the tokens are there (as are
    /// [`Ticket::checkpoint_async`] and [`Ticket::run`] with nothing to
    /// wait for): it does not yield to the executor by itself, so a task
    /// that loops on admissions with no other `.await` (a load generator
    /// inside the server) should call `tokio::task::yield_now().await`
    /// between them.
    pub fn acquire_async(&self, keyspace: u32, demand: Demand) -> AcquireFuture {
        if let Some(att) = self.attachment().filter(|a| a.alive())
            && att.admission.directory().find(keyspace).is_none()
        {
            return AcquireFuture { state: AcquireState::Cell { client: self.clone(), keyspace, demand } };
        }
        AcquireFuture { state: self.acquire_state(keyspace, demand, None) }
    }

    fn acquire_state(&self, keyspace: u32, demand: Demand, known: Option<Option<CellRef>>) -> AcquireState {
        let mut t = Ticket::blank(keyspace);
        match self.begin(keyspace, &demand, &mut t, known) {
            Ok(None) => AcquireState::Ready(Some(Ok(t))),
            Err(r) => AcquireState::Ready(Some(Err(r))),
            Ok(Some(w)) => {
                let super::ticket::Waiting { att, record, q, k } = *w;
                let deadline = demand.deadline.expect("queued only with a deadline");
                AcquireState::Waiting {
                    client: self.clone(),
                    keyspace,
                    deadline: demand.deadline,
                    line: Line::new(att, q, k, Some(deadline)),
                    record,
                }
            }
        }
    }
}

impl Future for AcquireFuture {
    type Output = Result<Ticket, Refused>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let AcquireState::Cell { client, keyspace, .. } = &this.state {
            let known = match client.attachment().filter(|a| a.alive()) {
                Some(att) => match client.inner.helper.cell(att, *keyspace, Some(cx.waker())) {
                    super::helper::Cell::Found(c) => Some(Some(c)),
                    super::helper::Cell::Pending => return Poll::Pending,
                    super::helper::Cell::Refused => Some(None),
                },
                // The agent went: `begin` admits without a check.
                None => Some(None),
            };
            let AcquireState::Cell { client, keyspace, demand } =
                std::mem::replace(&mut this.state, AcquireState::Ready(None))
            else {
                unreachable!("matched above")
            };
            this.state = client.acquire_state(keyspace, demand, known);
        }
        match &mut this.state {
            AcquireState::Cell { .. } => unreachable!("resolved above"),
            AcquireState::Ready(r) => Poll::Ready(r.take().expect("polled after completion")),
            AcquireState::Waiting { client, keyspace, deadline, line, record } => {
                let res = std::task::ready!(line.poll(cx));
                let (att, idx) = (line.att.clone(), *record);
                let free = || {
                    att.ledger
                        .get(idx)
                        .map(|r| r.state.store(keyspace_governor_common::admission::TICKET_FREE, Ordering::Release))
                };
                let out = match res {
                    LineResult::Granted(g) => {
                        let waited = line.waited();
                        let mut t = granted(att.clone(), idx, g, *deadline);
                        t.set_waited(waited);
                        t.add_consumed(line.cpu_ns);
                        Ok(t)
                    }
                    LineResult::Refused(r) => {
                        free();
                        Err(r)
                    }
                    LineResult::FailOpen => {
                        free();
                        Ok(client.fail_open(*keyspace, Some(&att)))
                    }
                };
                this.state = AcquireState::Ready(None);
                Poll::Ready(out)
            }
        }
    }
}

impl Drop for AcquireFuture {
    fn drop(&mut self) {
        // A future dropped while in line frees its ledger record (the line
        // itself gives its place back when it drops).
        if let AcquireState::Waiting { line, record, .. } = &self.state
            && let Some(r) = line.att.ledger.get(*record)
        {
            r.state.store(keyspace_governor_common::admission::TICKET_FREE, Ordering::Release);
        }
    }
}

/// The work of a ticket, polled under it: every poll of the inner future
/// runs inside the ticket (tagged, charged to it); between polls, a ticket
/// that ran past its share tops up, waiting in line without blocking —
/// until served, or, when `deadline` is set, until then.
struct Run<F> {
    ticket: Option<Ticket>,
    inner: Pin<Box<F>>,
    topup: Option<Line>,
    /// Give up (and drop the work) when a top-up is still refused then.
    abort_at: Option<Instant>,
}

impl<F: Future> Run<F> {
    fn poll_run(&mut self, cx: &mut Context<'_>) -> Poll<Result<F::Output, Refused>> {
        loop {
            if let Some(line) = self.topup.as_mut() {
                let res = std::task::ready!(line.poll(cx));
                let (waited, cpu) = (line.waited(), line.cpu_ns);
                self.topup = None;
                let t = self.ticket.as_mut().expect("ticket until ready");
                t.waited_for_top_up(waited, cpu);
                match res {
                    LineResult::Granted(part) => t.absorb_top_up(part),
                    LineResult::Refused(r) => {
                        self.ticket = None;
                        return Poll::Ready(Err(r));
                    }
                    LineResult::FailOpen => t.topup_due = false,
                }
            }
            let t = self.ticket.as_mut().expect("ticket until ready");
            if let Some(line) = top_up_line(t, self.abort_at) {
                self.topup = Some(line);
                continue;
            }
            break;
        }
        let t = self.ticket.as_mut().expect("ticket until ready");
        let out = {
            let _g = t.enter();
            self.inner.as_mut().poll(cx)
        };
        match out {
            Poll::Ready(v) => {
                self.ticket = None;
                Poll::Ready(Ok(v))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// The line a ticket that ran past its share waits in for its top-up;
/// `None` when it needs none.
fn top_up_line(t: &Ticket, deadline: Option<Instant>) -> Option<Line> {
    let att = t.attachment()?;
    let k = att.admission.header().knobs.snapshot();
    if !t.needs_top_up(&k) {
        return None;
    }
    let q = policy::top_up_queued(&att.admission, &k, &t.grant, k.per_allocation_us, deadline.is_none());
    Some(Line::new(att, q, k, deadline))
}

/// [`Ticket::run`]'s future: resolves to the inner future's output. The
/// work runs to completion, paced to its keyspace's share.
pub struct TicketFuture<F> {
    run: Run<F>,
}

/// [`Ticket::run_until_deadline`]'s future: resolves to the inner output,
/// or to the refusal of a top-up that the deadline cut short (the rest of
/// the work is dropped).
pub struct DeadlineFuture<F> {
    run: Run<F>,
}

impl Ticket {
    /// Runs `fut` under this ticket to completion; the ticket is released
    /// when it ends. When the work needs more CPU tokens than the ticket
    /// holds, the next poll waits for a top-up (without blocking the
    /// executor): the work is paced to its keyspace's share, never dropped.
    pub fn run<F: Future>(self, fut: F) -> TicketFuture<F> {
        TicketFuture { run: Run { ticket: Some(self), inner: Box::pin(fut), topup: None, abort_at: None } }
    }

    /// Runs `fut` under this ticket, giving up when a top-up is still
    /// refused at the deadline of the ticket's [`Demand`] (at once if it had
    /// none): for work that is worthless late. The rest of the work is
    /// dropped, and what it consumed is charged.
    pub fn run_until_deadline<F: Future>(self, fut: F) -> DeadlineFuture<F> {
        let abort_at = Some(self.deadline.unwrap_or_else(Instant::now));
        DeadlineFuture { run: Run { ticket: Some(self), inner: Box::pin(fut), topup: None, abort_at } }
    }

    /// [`Ticket::checkpoint`] without blocking the executor: for async code
    /// that runs a ticket's work in [`Ticket::enter`] stretches between
    /// `.await`s. Waits for a top-up when the ticket ran past its share.
    pub fn checkpoint_async(&mut self) -> Checkpoint<'_> {
        Checkpoint { ticket: self, line: None, started: false }
    }
}

impl<F: Future> Future for TicketFuture<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        // All fields are Unpin (the inner future is boxed).
        match std::task::ready!(self.get_mut().run.poll_run(cx)) {
            Ok(v) => Poll::Ready(v),
            Err(r) => unreachable!("a paced top-up has no deadline: {r}"),
        }
    }
}

impl<F: Future> Future for DeadlineFuture<F> {
    type Output = Result<F::Output, Refused>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.get_mut().run.poll_run(cx)
    }
}

impl<F> Unpin for TicketFuture<F> {}
impl<F> Unpin for DeadlineFuture<F> {}

/// [`Ticket::checkpoint_async`]'s future.
pub struct Checkpoint<'a> {
    ticket: &'a mut Ticket,
    line: Option<Line>,
    started: bool,
}

impl Future for Checkpoint<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        loop {
            if !this.started {
                this.started = true;
                this.line = top_up_line(this.ticket, None);
            }
            let Some(line) = this.line.as_mut() else { return Poll::Ready(()) };
            let res = std::task::ready!(line.poll(cx));
            this.ticket.waited_for_top_up(line.waited(), line.cpu_ns);
            this.line = None;
            match res {
                LineResult::Granted(part) => {
                    this.ticket.absorb_top_up(part);
                    // Still past its share (a large overrun): another top-up.
                    this.started = false;
                }
                LineResult::Refused(_) | LineResult::FailOpen => {
                    this.ticket.topup_due = false;
                    return Poll::Ready(());
                }
            }
        }
    }
}
