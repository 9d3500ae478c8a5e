//! The connection to the agent: one *attachment* per agent the client has
//! talked to (its regions, its ledger, its control connection), and the
//! watch that notices when the agent goes away and attaches to the next one.

use super::attachment::{Adopter, Attachment};
use super::clock::ThreadRef;
use super::error::ClientError;
use crate::proto::{BackendKind, Reply, Request};
use crate::region::RegionSizes;
use crate::sys;
use keyspace_governor_common::{TAG_NONE, cpu_owner};
use std::collections::{BTreeSet, HashMap};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

/// Agents one client attaches to in its life (each restart of the agent is
/// one more; an agent restarted every 2 s takes 9 hours to reach it); past
/// that it stays detached and admits without checks. A gone agent's regions
/// and connection are given back ([`retire_later`]); what stays of it is a
/// few hundred bytes.
const MAX_ATTACHMENTS: usize = 16384;

/// Longest pause between two attempts to attach to a new agent.
/// (A connect to an absent socket costs a few µs: short enough that a
/// server started before its agent is governed within this of its start.)
const REATTACH_MAX_BACKOFF: Duration = Duration::from_millis(250);

/// How long after its agent went away an attachment's regions are given
/// back: far past any admission under way when it was marked detached.
const RETIRE_AFTER: Duration = Duration::from_secs(2);

pub(crate) struct Inner {
    path: PathBuf,
    /// The process that connected: a forked child shares the sockets and
    /// must not talk on them.
    pid: u32,
    /// Every attachment so far, in order; entry `epoch − 1` is in force
    /// (none while `epoch` is 0: no agent answered yet).
    attachments: Box<[OnceLock<Arc<Attachment>>]>,
    /// How many attachments are set; published after the entry is.
    pub(crate) epoch: AtomicU64,
    /// Tickets admitted without a check because no agent answered.
    pub(crate) fail_open: AtomicU64,
    watch: Mutex<Option<UnixStream>>,
    /// Threads registered through this client, by tid: an agent that
    /// appears (or comes back) has them all registered before they need it.
    threads: Mutex<BTreeSet<u32>>,
    /// Registrations made for threads on a new attachment, waiting for
    /// their thread to pick them up: tid → (epoch, slot, generation).
    prereg: Mutex<HashMap<u32, (u64, u32, u64)>>,
    /// Set by [`Client::register_on_park`]: a thread that admits its first
    /// request through this client unregistered (a worker busy from its
    /// start, which has not parked yet) is registered in the background.
    register_on_admit: AtomicBool,
    /// The background thread's jobs (cells, registrations).
    pub(crate) helper: super::helper::Helper,
}

/// A connection to the agent, with the shared regions mapped. Cheap to
/// clone; every clone shares one connection. If the agent goes away, the
/// client notices (its watch connection closes), admits every ticket
/// without a check meanwhile, and attaches to the next agent by itself.
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<Inner>,
}

impl Client {
    /// Connects to the agent's control socket and maps its regions; fails
    /// when no agent answers. A server that may start before the agent uses
    /// [`Client::new`].
    pub fn connect(path: impl AsRef<Path>) -> Result<Client, ClientError> {
        let path = path.as_ref().to_path_buf();
        let attachment = Attachment::open(&path, 1)?;
        let watch = watch_connection(&path, attachment.instance)?;
        log::info!("attached to the governor agent at {}", path.display());
        Client::start(path, Some((attachment, watch)))
    }

    /// A client for the agent at `path`, whether or not one runs now: it
    /// attaches at once if an agent answers, else it admits every ticket
    /// without a check (counted, [`Client::fail_open_count`]; logged once)
    /// and attaches by itself when an agent appears, registering the threads
    /// registered meanwhile. Errors that are the operator's — the socket's
    /// permissions, an agent that refuses this process — are reported at
    /// once.
    pub fn new(path: impl AsRef<Path>) -> Result<Client, ClientError> {
        let path = path.as_ref().to_path_buf();
        match Attachment::open(&path, 1).and_then(|a| Ok((watch_connection(&path, a.instance)?, a))) {
            Ok((watch, attachment)) => {
                log::info!("attached to the governor agent at {}", path.display());
                Client::start(path, Some((attachment, watch)))
            }
            Err(ClientError::Connect { source, .. }) if no_agent(&source) => {
                log::warn!(
                    "no governor agent at {} ({source}); admitting without checks until one answers",
                    path.display()
                );
                Client::start(path, None)
            }
            Err(e) => Err(e),
        }
    }

    fn start(path: PathBuf, first: Option<(Attachment, UnixStream)>) -> Result<Client, ClientError> {
        super::install_fork_handler();
        let attachments: Box<[OnceLock<Arc<Attachment>>]> = (0..MAX_ATTACHMENTS).map(|_| OnceLock::new()).collect();
        let (epoch, watch) = match first {
            Some((a, w)) => {
                let _ = attachments[0].set(Arc::new(a));
                (1, Some(w))
            }
            None => (0, None),
        };
        let inner = Arc::new(Inner {
            path,
            pid: std::process::id(),
            attachments,
            epoch: AtomicU64::new(epoch),
            fail_open: AtomicU64::new(0),
            watch: Mutex::new(watch.as_ref().map(UnixStream::try_clone).transpose()?),
            threads: Mutex::new(BTreeSet::new()),
            prereg: Mutex::new(HashMap::new()),
            register_on_admit: AtomicBool::new(false),
            helper: super::helper::Helper::default(),
        });
        if let Some(a) = inner.attachments[0].get() {
            let _ = a.owner.set(Arc::downgrade(&inner) as Weak<dyn Adopter>);
        }
        spawn_helper(&inner)?;
        let weak = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name("governor-watch".into())
            .spawn(move || watch_loop(weak, watch))
            .map_err(ClientError::Io)?;
        Ok(Client { inner })
    }

    /// The attachment now in force (`None` before the first agent answered):
    /// two loads, no lock, no reference count.
    #[inline]
    pub(crate) fn attachment(&self) -> Option<&Arc<Attachment>> {
        self.inner.current()
    }

    /// Which backend measures this client (`None` before an agent answered).
    pub fn backend(&self) -> Option<BackendKind> {
        self.attachment().map(|a| a.backend)
    }

    /// Sizes of the shared regions (`None` before an agent answered).
    pub fn sizes(&self) -> Option<RegionSizes> {
        self.attachment().map(|a| a.sizes)
    }

    /// Whether an agent answers now (false before the first one, and between
    /// an agent's death and the next one's arrival).
    pub fn attached(&self) -> bool {
        self.attachment().is_some_and(|a| a.alive())
    }

    /// How many agents this client has attached to (1 until the first
    /// restart).
    pub fn attachments(&self) -> u64 {
        self.inner.epoch.load(Ordering::Acquire)
    }

    /// Tickets admitted without a check because no agent answered.
    pub fn fail_open_count(&self) -> u64 {
        self.inner.fail_open.load(Ordering::Relaxed)
    }

    /// Registers the calling thread; until it exits (or
    /// [`super::unregister_current_thread`]) its CPU time is measured and
    /// charged to its tag. One round trip to the agent (call it where a
    /// thread starts, e.g. in tokio's `on_thread_start`); while no agent
    /// answers it succeeds at once, and the thread is registered in the
    /// background when one appears (untagged until then).
    pub fn register_current_thread(&self) -> Result<(), ClientError> {
        if super::is_registered() {
            return Err(ClientError::AlreadyRegistered);
        }
        self.check_fork()?;
        let tid = sys::gettid();
        self.inner.threads.lock().unwrap_or_else(|p| p.into_inner()).insert(tid);
        let ctx = match self.attachment().filter(|a| a.alive()) {
            Some(att) => match register(att, tid) {
                Ok((slot, generation)) => Some(ThreadCtx { att: att.clone(), slot, generation }),
                // The agent went meanwhile: registered when the next comes.
                Err(ClientError::Io(_)) => None,
                Err(e) => {
                    self.inner.threads.lock().unwrap_or_else(|p| p.into_inner()).remove(&tid);
                    return Err(e);
                }
            },
            None => None,
        };
        let state = ThreadState { client: self.clone(), tid, ctx };
        super::CURRENT.with(|c| *c.borrow_mut() = Some(state));
        Ok(())
    }

    /// For tokio's `Builder::on_thread_park`: registers each worker thread
    /// of the runtime the first time it parks, and never a blocking-pool
    /// thread, which does not park this way. A worker that finds tasks
    /// waiting as it starts (a server that starts under load) does not park
    /// while it has work: it is registered instead when it first admits a
    /// request through this client (the first [`Client::acquire`] or
    /// [`Client::acquire_async`] on that thread), in the background, with no
    /// round trip on the way; its work is measured once the registration is
    /// in, one round trip to the agent later. From then on, any thread that
    /// admits its first request through this client unregistered is
    /// registered the same way. Later parks cost a thread-local check. A
    /// failed registration is logged (through the `log` crate), not raised:
    /// the thread runs unmeasured.
    ///
    /// ```no_run
    /// # let client = keyspace_governor::client::Client::new("/run/governor/governor.sock")?;
    /// # struct Builder; impl Builder { fn on_thread_park(self, _f: impl Fn() + Send + Sync + 'static) -> Self { self } }
    /// # let builder = Builder;
    /// let builder = builder.on_thread_park(client.register_on_park());
    /// # Ok::<(), keyspace_governor::client::ClientError>(())
    /// ```
    pub fn register_on_park(&self) -> impl Fn() + Send + Sync + 'static {
        self.inner.register_on_admit.store(true, Ordering::Relaxed);
        let client = self.clone();
        move || {
            if !super::is_registered()
                && let Err(e) = client.register_current_thread()
            {
                log::warn!("registering a runtime worker: {e}");
            }
        }
    }

    /// For tokio's `Builder::on_thread_start`: registers every thread the
    /// runtime starts, its blocking-pool threads too (for work run with
    /// `spawn_blocking` under a ticket moved there, which then is measured
    /// by the kernel like the rest). Pair it with
    /// [`super::unregister_current_thread`] in `on_thread_stop`.
    pub fn register_on_start(&self) -> impl Fn() + Send + Sync + 'static {
        let client = self.clone();
        move || {
            if let Err(e) = client.register_current_thread() {
                log::warn!("registering a runtime thread: {e}");
            }
        }
    }

    /// The calling thread admits its first request through this client
    /// (its home in the ledger was just made): registers it in the
    /// background if [`Client::register_on_park`] asked for it and it is
    /// not registered. No round trip: the background thread registers it by
    /// its tid, and the thread picks the registration up at its next tag
    /// switch, as after an agent's restart.
    #[cold]
    pub(crate) fn first_admission_on_thread(&self) {
        if self.inner.register_on_admit.load(Ordering::Relaxed) {
            self.adopt_current_thread();
        }
    }

    /// Registers the calling thread in the background, if no client has
    /// it: the thread picks the registration up at its next tag switch, one
    /// round trip to the agent later. For a thread that admits its first
    /// request, or runs a ticket's work, unregistered.
    #[cold]
    pub(crate) fn adopt_current_thread(&self) {
        if self.check_fork().is_err() {
            return;
        }
        let tid = sys::gettid();
        let adopted = super::CURRENT.try_with(|c| match c.try_borrow_mut() {
            Ok(mut slot) if slot.is_none() => {
                *slot = Some(ThreadState { client: self.clone(), tid, ctx: None });
                true
            }
            _ => false,
        });
        if adopted != Ok(true) {
            return;
        }
        self.inner.threads.lock().unwrap_or_else(|p| p.into_inner()).insert(tid);
        if let Some(att) = self.attachment().filter(|a| a.alive()) {
            self.inner.helper.register(att.epoch, tid);
        }
    }

    fn check_fork(&self) -> Result<(), ClientError> {
        if std::process::id() != self.inner.pid {
            return Err(ClientError::Forked { parent: self.inner.pid });
        }
        Ok(())
    }

    /// Sends one request on the current attachment and waits for its reply.
    #[cfg(feature = "agent")]
    pub fn call(&self, req: &Request) -> Result<Reply, ClientError> {
        self.check_fork()?;
        self.attachment().ok_or(ClientError::AgentGone)?.call(req)
    }

    /// Charged on-CPU ns of `keyspace_id` so far, as the shared table says.
    pub fn keyspace_cpu_ns(&self, keyspace_id: u32) -> Option<u64> {
        let att = self.attachment()?;
        let cell = att.admission.directory().find(keyspace_id)?;
        Some(att.measure.keyspaces.get(cell.index)?.cpu_ns.load(Ordering::Relaxed))
    }
}

/// Registers thread `tid` of this process on `att`: its slot and generation.
fn register(att: &Attachment, tid: u32) -> Result<(u32, u64), ClientError> {
    let (slot, generation) = match att.call(&Request::RegisterThread { tid })? {
        Reply::Registered { slot, generation } => (slot, generation),
        other => return Err(ClientError::Protocol { detail: format!("expected registered, got {other:?}") }),
    };
    if att.measure.slots.get(slot).is_none() {
        return Err(ClientError::Protocol { detail: format!("slot {slot} out of range") });
    }
    Ok((slot, generation))
}

/// Whether connecting failed because no agent listens (rather than for a
/// reason the operator must fix).
fn no_agent(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(e.kind(), NotFound | ConnectionRefused | ConnectionReset)
}

impl Inner {
    #[inline]
    pub(crate) fn current(&self) -> Option<&Arc<Attachment>> {
        let epoch = self.epoch.load(Ordering::Acquire) as usize;
        epoch.checked_sub(1).and_then(|i| self.attachments[i].get())
    }

    pub(crate) fn attachment_of(&self, epoch: u64) -> Option<Arc<Attachment>> {
        self.attachments.get(usize::try_from(epoch).ok()?.checked_sub(1)?)?.get().cloned()
    }

    /// Registers thread `tid` on `att` for it, to pick up at its next tag
    /// switch; nothing if the thread has gone meanwhile.
    pub(crate) fn preregister(&self, att: &Attachment, tid: u32) {
        if !self.threads.lock().unwrap_or_else(|p| p.into_inner()).contains(&tid) {
            return;
        }
        match register(att, tid) {
            Ok((slot, generation)) => {
                self.prereg.lock().unwrap_or_else(|p| p.into_inner()).insert(tid, (att.epoch, slot, generation));
            }
            Err(e) => log::debug!("registering thread {tid} on the new agent: {e}"),
        }
    }

    /// The registration made for `tid` on the attachment of `epoch`, if any.
    fn take_registration(&self, tid: u32, epoch: u64) -> Option<(u32, u64)> {
        let mut p = self.prereg.lock().unwrap_or_else(|p| p.into_inner());
        match p.remove(&tid) {
            Some((e, slot, generation)) if e == epoch => Some((slot, generation)),
            Some(stale) if stale.0 > epoch => {
                p.insert(tid, stale);
                None
            }
            _ => None,
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.helper.stop();
        // Ends the watch thread's blocking read.
        if let Some(w) = self.watch.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = w.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// A second connection that says `watch` and then only waits: it ends when
/// the agent does.
fn watch_connection(path: &Path, instance: u64) -> Result<UnixStream, ClientError> {
    let s = UnixStream::connect(path).map_err(|source| ClientError::connect(path, source))?;
    let mut line = serde_json::to_string(&Request::Watch { instance }).expect("serializes");
    line.push('\n');
    (&s).write_all(line.as_bytes())?;
    Ok(s)
}

/// Waits for the agent to go, marks its attachment detached, then attaches
/// to the next agent (retrying with backoff), registers the client's
/// threads there, and watches that one. Starts by attaching when the
/// client started without an agent. Ends when the client is dropped.
fn watch_loop(client: Weak<Inner>, mut watch: Option<UnixStream>) {
    loop {
        if let Some(w) = watch.as_mut() {
            let mut b = [0u8; 64];
            // Returns on the agent's exit (EOF or reset), or when the client
            // shuts the socket down on drop.
            while matches!(w.read(&mut b), Ok(n) if n > 0) {}
            let Some(inner) = client.upgrade() else { return };
            if std::process::id() != inner.pid {
                return;
            }
            if let Some(att) = inner.current() {
                att.detach();
                retire_later(att.clone());
            }
            log::warn!(
                "governor agent at {} went away; admitting without checks until one is back",
                inner.path.display()
            );
        }
        let Some(path) = client.upgrade().map(|i| i.path.clone()) else { return };
        let mut backoff = Duration::from_millis(50);
        loop {
            let Some(inner) = client.upgrade() else { return };
            let epoch = inner.epoch.load(Ordering::Acquire) + 1;
            let Some(entry) = inner.attachments.get(epoch as usize - 1) else {
                log::error!(
                    "the governor agent at {} restarted {MAX_ATTACHMENTS} times under this client; \
                     it admits without checks from now on (reconnect to be governed again)",
                    path.display()
                );
                return;
            };
            match Attachment::open(&path, epoch).and_then(|a| Ok((watch_connection(&path, a.instance)?, a))) {
                Ok((w, a)) => {
                    // Every registered thread gets its registration before
                    // the new agent is in force, so none waits for one.
                    let tids: Vec<u32> =
                        inner.threads.lock().unwrap_or_else(|p| p.into_inner()).iter().copied().collect();
                    for tid in tids {
                        inner.preregister(&a, tid);
                    }
                    let _ = a.owner.set(Arc::downgrade(&inner) as Weak<dyn Adopter>);
                    let _ = entry.set(Arc::new(a));
                    inner.epoch.store(epoch, Ordering::Release);
                    if let Ok(clone) = w.try_clone() {
                        *inner.watch.lock().unwrap_or_else(|p| p.into_inner()) = Some(clone);
                    }
                    watch = Some(w);
                    log::info!("attached to the governor agent at {}", path.display());
                    break;
                }
                Err(_) => {
                    drop(inner);
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(REATTACH_MAX_BACKOFF);
                }
            }
        }
    }
}

/// Gives a gone agent's memory back ([`Attachment::retire`]) once every
/// admission that read it before it was marked detached has long finished:
/// a client that outlives many agents keeps one set of regions, not one per
/// agent (8–10 MB each at the default sizes).
fn retire_later(att: Arc<Attachment>) {
    let spawned = std::thread::Builder::new().name("governor-retire".into()).spawn(move || {
        std::thread::sleep(RETIRE_AFTER);
        if let Err(e) = att.retire() {
            log::warn!("giving back a gone governor agent's regions: {e}");
        }
    });
    if let Err(e) = spawned {
        log::warn!("giving back a gone governor agent's regions: {e}");
    }
}

/// Starts the client's background thread ([`super::helper`]); it ends
/// with the client.
fn spawn_helper(inner: &Arc<Inner>) -> std::io::Result<()> {
    let client = Arc::downgrade(inner);
    std::thread::Builder::new().name("governor-client".into()).spawn(move || helper_loop(client)).map(drop)
}

fn helper_loop(client: Weak<Inner>) {
    loop {
        let Some(inner) = client.upgrade() else { return };
        let Some(batch) = inner.helper.next_batch() else { return };
        for (epoch, keyspace) in batch.cells {
            inner.helper.ask_cell(inner.attachment_of(epoch).as_deref(), epoch, keyspace);
        }
        for (epoch, tid) in batch.threads {
            if let Some(att) = inner.attachment_of(epoch).filter(|a| a.alive()) {
                inner.preregister(&att, tid);
            }
        }
    }
}

impl Adopter for Inner {
    fn adopt_current_thread(self: Arc<Self>) {
        Client { inner: self }.adopt_current_thread();
    }
}

/// A registered thread, kept in a thread-local: its client, and its
/// registration with the agent in force (`None` while no agent answers, or
/// until its registration with a new one is in).
pub(crate) struct ThreadState {
    pub(crate) client: Client,
    tid: u32,
    pub(crate) ctx: Option<ThreadCtx>,
}

impl ThreadState {
    /// Whether its registration belongs to the client's current agent.
    #[inline]
    pub(crate) fn fresh(&self) -> bool {
        self.ctx.as_ref().is_some_and(|c| c.att.epoch == self.client.inner.epoch.load(Ordering::Relaxed))
    }

    /// Moves to the agent in force: picks up the registration made for this
    /// thread there, or asks for one in the background. Never a round trip.
    pub(crate) fn refresh(&mut self) {
        let inner = &self.client.inner;
        let Some(att) = inner.current() else { return };
        if self.fresh() {
            return;
        }
        match inner.take_registration(self.tid, att.epoch) {
            Some((slot, generation)) => self.ctx = Some(ThreadCtx { att: att.clone(), slot, generation }),
            None => {
                // The old registration is dead: the thread runs untagged
                // until the new one is in.
                self.ctx = None;
                if att.alive() {
                    inner.helper.register(att.epoch, self.tid);
                }
            }
        }
    }
}

impl Drop for ThreadState {
    fn drop(&mut self) {
        let inner = &self.client.inner;
        inner.threads.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.tid);
        inner.prereg.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.tid);
    }
}

/// A thread's registration with one agent.
pub(crate) struct ThreadCtx {
    pub(crate) att: Arc<Attachment>,
    slot: u32,
    generation: u64,
}

impl ThreadCtx {
    #[inline]
    pub(crate) fn thread(&self) -> ThreadRef<'_> {
        let a = &self.att;
        ThreadRef {
            backend: a.backend,
            measure: &a.measure,
            clock: &a.admission.header().clock,
            slot: a.measure.slots.get(self.slot).expect("slot checked at registration"),
            owner: cpu_owner(self.slot, self.generation),
        }
    }

    #[inline]
    pub(crate) fn switch(&self, tag: u64) -> u64 {
        self.thread().switch_tag(tag).0
    }

    #[inline]
    pub(crate) fn clock(&self) -> u64 {
        self.thread().clock()
    }
}

impl Drop for ThreadCtx {
    fn drop(&mut self) {
        if !self.att.alive() {
            return;
        }
        // Close the last interval, then give the slot back.
        self.switch(TAG_NONE);
        let req = Request::UnregisterThread { slot: self.slot, generation: self.generation };
        if let Err(e) = self.att.call(&req) {
            log::debug!("unregistering slot {}: {e}", self.slot);
        }
    }
}
