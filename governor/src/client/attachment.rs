//! One agent as a client holds it: the control connection, the regions the
//! agent handed over at `hello`, the client's ticket ledger.

use super::error::ClientError;
use crate::proto::{BackendKind, Reply, Request};
use crate::region::{AdmissionRegions, CellRef, MeasureRegions, RegionSizes, Table, TicketView, fd};
use crate::sys;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

/// How long a call to the agent may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

struct Conn {
    reader: BufReader<UnixStream>,
}

impl Conn {
    fn call(&mut self, req: &Request) -> Result<Reply, ClientError> {
        let mut line = serde_json::to_string(req).expect("requests serialize");
        line.push('\n');
        self.reader.get_mut().write_all(line.as_bytes())?;
        read_reply(&mut self.reader).map_err(|e| match e {
            // The read timed out: the agent is there (it accepted) but does
            // not answer.
            ClientError::Io(io)
                if matches!(io.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) =>
            {
                let waited = self.reader.get_ref().read_timeout().ok().flatten().unwrap_or(CALL_TIMEOUT);
                ClientError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("the agent did not answer within {} s (stopped or stalled?)", waited.as_secs()),
                ))
            }
            e => e,
        })
    }
}

fn read_reply(r: &mut BufReader<UnixStream>) -> Result<Reply, ClientError> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(ClientError::Protocol { detail: "the agent closed the connection".into() });
    }
    let reply: Reply =
        serde_json::from_str(&line).map_err(|e| ClientError::Protocol { detail: format!("{e}: {}", line.trim()) })?;
    if let Reply::Error { message } = reply {
        return Err(ClientError::Refused { message });
    }
    Ok(reply)
}

/// One request on a fresh connection, without `hello` (operator verbs).
#[cfg(feature = "agent")]
pub fn request(path: &Path, req: &Request) -> Result<Reply, ClientError> {
    request_within(path, req, CALL_TIMEOUT)
}

/// [`request`] for a call that takes longer than [`CALL_TIMEOUT`] by
/// design (a profile): the reply is awaited up to `timeout`.
#[cfg(feature = "agent")]
pub fn request_within(path: &Path, req: &Request, timeout: Duration) -> Result<Reply, ClientError> {
    let stream = UnixStream::connect(path).map_err(|source| ClientError::connect(path, source))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(CALL_TIMEOUT))?;
    Conn { reader: BufReader::new(stream) }.call(req)
}

/// Says `hello` on a fresh connection: the reply, the region descriptors
/// that came with it (in `region::fd` order), and the connection for what
/// follows. For tools that speak the protocol themselves; a server uses
/// [`Client::connect`].
pub fn handshake(stream: UnixStream) -> Result<(Reply, Vec<OwnedFd>, BufReader<UnixStream>), ClientError> {
    let mut hello = serde_json::to_string(&Request::Hello).expect("serializes");
    hello.push('\n');
    (&stream).write_all(hello.as_bytes())?;
    // The reply line arrives with the fds; read it byte-exactly so no
    // later bytes are consumed outside the buffered reader.
    let mut buf = vec![0u8; 4096];
    let (n, fds) = sys::recv_with_fds(stream.as_raw_fd(), &mut buf, fd::COUNT)?;
    let mut line = buf[..n].to_vec();
    let mut reader = BufReader::new(stream);
    if !line.ends_with(b"\n") {
        reader.read_until(b'\n', &mut line)?;
    }
    let reply =
        serde_json::from_slice(&line).map_err(|e| ClientError::Protocol { detail: format!("hello reply: {e}") })?;
    Ok((reply, fds, reader))
}

/// What an attachment knows of the client that holds it.
pub(crate) trait Adopter: Send + Sync {
    /// Registers the calling thread with the client, in the background.
    fn adopt_current_thread(self: Arc<Self>);
}

/// Everything a client holds of one agent.
pub(crate) struct Attachment {
    pub(crate) backend: BackendKind,
    pub(crate) sizes: RegionSizes,
    pub(crate) measure: MeasureRegions,
    pub(crate) admission: AdmissionRegions,
    /// This client's own ticket ledger.
    pub(crate) ledger: Table<TicketView>,
    /// Which of the ledger's blocks this process's threads own.
    pub(crate) blocks: super::blocks::Blocks,
    /// The agent's instance at `hello`.
    pub(crate) instance: u64,
    /// This client's count of attachments so far (1 for the first).
    pub(crate) epoch: u64,
    /// Set when the agent behind it went away.
    pub(crate) detached: AtomicBool,
    /// The client it belongs to, set as it comes in force: a ticket's work
    /// on a thread the client has not registered registers it through it.
    pub(crate) owner: OnceLock<Weak<dyn Adopter>>,
    /// The control connection; closed once the agent's memory is given back.
    conn: Mutex<Option<Conn>>,
}

impl Attachment {
    /// Connects, says `hello` and maps what the agent hands over.
    pub(crate) fn open(path: &Path, epoch: u64) -> Result<Attachment, ClientError> {
        let stream = UnixStream::connect(path).map_err(|source| ClientError::connect(path, source))?;
        // A hung agent must not hang the server's threads (registration,
        // thread exit): calls fail after this long instead.
        stream.set_read_timeout(Some(CALL_TIMEOUT))?;
        stream.set_write_timeout(Some(CALL_TIMEOUT))?;
        let (reply, fds, reader) = handshake(stream)?;
        let (backend, sizes, instance) = match reply {
            Reply::Hello { layout, .. } if layout != crate::region::ADMISSION_LAYOUT => {
                return Err(ClientError::Refused {
                    message: format!(
                        "the agent's admission regions have layout {layout}, this client reads layout {}: build the \
                         server against the agent's release",
                        crate::region::ADMISSION_LAYOUT
                    ),
                });
            }
            Reply::Hello { backend, sizes, instance, .. } => (backend, sizes, instance),
            Reply::Error { message } => return Err(ClientError::Refused { message }),
            other => return Err(ClientError::Protocol { detail: format!("expected hello, got {other:?}") }),
        };
        if fds.len() != fd::COUNT {
            return Err(ClientError::Protocol {
                detail: format!("expected {} region fds, got {}", fd::COUNT, fds.len()),
            });
        }
        let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let measure = MeasureRegions::map(&raw, sizes, crate::region::Access::ReadOnly)?;
        let admission = AdmissionRegions::map(&raw, sizes.keyspaces, false)?;
        let ledger = Table::map("ledger", raw[fd::LEDGER], sizes.ledger)?;
        Ok(Attachment {
            backend,
            sizes,
            measure,
            admission,
            blocks: super::blocks::Blocks::new(ledger.len()),
            ledger,
            instance,
            epoch,
            detached: AtomicBool::new(false),
            owner: OnceLock::new(),
            conn: Mutex::new(Some(Conn { reader })),
        })
    }

    /// A ticket's work on a thread its client has not registered (a tokio
    /// blocking-pool thread under the park hook, a worker of a runtime
    /// without hooks, a thread of the server's own): registers the thread
    /// in the background, so the work is measured and charged from about
    /// one round trip to the agent on. Left alone, it would run uncharged,
    /// past any cap.
    #[cold]
    #[inline(never)]
    pub(crate) fn adopt_current_thread(&self) {
        if let Some(owner) = self.owner.get().and_then(Weak::upgrade) {
            owner.adopt_current_thread();
        }
    }

    pub(crate) fn call(&self, req: &Request) -> Result<Reply, ClientError> {
        match self.conn.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            Some(conn) => conn.call(req),
            None => Err(ClientError::Protocol { detail: "the agent went away".into() }),
        }
    }

    /// Whether the agent behind it is still the one that answered `hello`.
    #[inline]
    /// The agent behind it went away: marks it so, and wakes every thread
    /// waiting on its buckets, so they admit now (fail-open) instead of at
    /// their next liveness check.
    pub(crate) fn detach(&self) {
        self.detached.store(true, Ordering::Release);
        for (_, bucket) in self.admission.buckets.iter() {
            bucket.notify();
        }
    }

    /// Gives back the memory of an agent that went away: its regions and
    /// the ledger read zero from now on (not alive: the instance reads 0),
    /// and the pages are freed. Tickets and threads that still point into
    /// them write where nobody reads.
    pub(crate) fn retire(&self) -> std::io::Result<()> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner()).take();
        self.measure.retire()?;
        self.admission.retire()?;
        self.ledger.retire()
    }

    pub(crate) fn alive(&self) -> bool {
        !self.detached.load(Ordering::Relaxed)
            && self.admission.header().agent.instance.load(Ordering::Relaxed) == self.instance
    }

    /// The cell of `keyspace_id`: looked up in the shared directory, or
    /// given by the agent (one round trip, the first time this agent sees
    /// the keyspace).
    pub(crate) fn cell_of(&self, keyspace_id: u32) -> Result<CellRef, ClientError> {
        if let Some(found) = self.admission.directory().find(keyspace_id) {
            return Ok(found);
        }
        match self.call(&Request::Keyspace { id: keyspace_id })? {
            Reply::Keyspace { cell, generation } if cell < self.sizes.keyspaces => {
                Ok(CellRef { index: cell, generation })
            }
            other => Err(ClientError::Protocol { detail: format!("expected a keyspace cell, got {other:?}") }),
        }
    }
}
