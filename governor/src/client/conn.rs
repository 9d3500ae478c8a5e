//! The connection to the agent and the per-thread registration.

use super::clock::ThreadRef;
use crate::proto::{BackendKind, Reply, Request};
use crate::region::{RegionError, RegionSizes, Regions};
use crate::sys;
use governor_common::{cpu_owner, TAG_NONE};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// How long a call to the agent may take.
pub const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to the governor agent at {path}")]
    Connect { path: PathBuf, #[source] source: std::io::Error },
    #[error("talking to the governor agent failed")]
    Io(#[from] std::io::Error),
    #[error("the agent sent a malformed reply: {detail}")]
    Protocol { detail: String },
    #[error("the agent refused: {message}")]
    Refused { message: String },
    #[error(transparent)]
    Region(#[from] RegionError),
    #[error("this thread is already registered")]
    AlreadyRegistered,
    #[error("this client was connected by process {parent}; a forked child must connect its own")]
    Forked { parent: u32 },
}

struct Conn {
    reader: BufReader<UnixStream>,
}

impl Conn {
    fn call(&mut self, req: &Request) -> Result<Reply, ClientError> {
        let mut line = serde_json::to_string(req).expect("requests serialize");
        line.push('\n');
        self.reader.get_mut().write_all(line.as_bytes())?;
        read_reply(&mut self.reader)
    }
}

fn read_reply(r: &mut BufReader<UnixStream>) -> Result<Reply, ClientError> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(ClientError::Protocol { detail: "the agent closed the connection".into() });
    }
    let reply: Reply = serde_json::from_str(&line)
        .map_err(|e| ClientError::Protocol { detail: format!("{e}: {}", line.trim()) })?;
    if let Reply::Error { message } = reply {
        return Err(ClientError::Refused { message });
    }
    Ok(reply)
}

pub(crate) struct Inner {
    conn: Mutex<Conn>,
    /// The process that connected: a forked child shares the socket and
    /// must not talk on it.
    pid: u32,
    pub(crate) backend: BackendKind,
    pub(crate) regions: Regions,
    pub(crate) sizes: RegionSizes,
}

/// A connection to the agent, with the shared regions mapped. Cheap to
/// clone; every clone shares one connection.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl Client {
    /// Connects to the agent's control socket and maps its regions.
    pub fn connect(path: impl AsRef<Path>) -> Result<Client, ClientError> {
        let path = path.as_ref();
        let stream = UnixStream::connect(path)
            .map_err(|source| ClientError::Connect { path: path.to_path_buf(), source })?;
        // A hung agent must not hang the server's threads (registration,
        // thread exit): calls fail after this long instead.
        stream.set_read_timeout(Some(CALL_TIMEOUT))?;
        stream.set_write_timeout(Some(CALL_TIMEOUT))?;
        let mut hello = serde_json::to_string(&Request::Hello).expect("serializes");
        hello.push('\n');
        (&stream).write_all(hello.as_bytes())?;
        // The reply line arrives with the fds; read it byte-exactly so no
        // later bytes are consumed outside the buffered reader.
        let mut buf = vec![0u8; 4096];
        let (n, fds) = sys::recv_with_fds(stream.as_raw_fd(), &mut buf, 4)?;
        let mut line = buf[..n].to_vec();
        let mut reader = BufReader::new(stream);
        if !line.ends_with(b"\n") {
            reader.read_until(b'\n', &mut line)?;
        }
        let reply: Reply = serde_json::from_slice(&line)
            .map_err(|e| ClientError::Protocol { detail: format!("hello reply: {e}") })?;
        let (backend, sizes) = match reply {
            Reply::Hello { backend, sizes } => (backend, sizes),
            Reply::Error { message } => return Err(ClientError::Refused { message }),
            other => return Err(ClientError::Protocol { detail: format!("expected hello, got {other:?}") }),
        };
        if fds.len() != 4 {
            return Err(ClientError::Protocol { detail: format!("expected 4 region fds, got {}", fds.len()) });
        }
        let regions =
            Regions::map([fds[0].as_raw_fd(), fds[1].as_raw_fd(), fds[2].as_raw_fd(), fds[3].as_raw_fd()], sizes)?;
        super::install_fork_handler();
        let pid = std::process::id();
        Ok(Client { inner: Arc::new(Inner { conn: Mutex::new(Conn { reader }), pid, backend, regions, sizes }) })
    }

    /// Which backend measures this client.
    pub fn backend(&self) -> BackendKind {
        self.inner.backend
    }

    /// Sizes of the shared regions.
    pub fn sizes(&self) -> RegionSizes {
        self.inner.sizes
    }

    /// Registers the calling thread; until it exits (or
    /// [`super::unregister_current_thread`]) its CPU time is measured and
    /// charged to its tag.
    pub fn register_current_thread(&self) -> Result<(), ClientError> {
        if super::is_registered() {
            return Err(ClientError::AlreadyRegistered);
        }
        let tid = sys::gettid();
        let (slot, generation) = match self.call(&Request::RegisterThread { tid })? {
            Reply::Registered { slot, generation } => (slot, generation),
            other => return Err(ClientError::Protocol { detail: format!("expected registered, got {other:?}") }),
        };
        if self.inner.regions.slots.get(slot).is_none() {
            return Err(ClientError::Protocol { detail: format!("slot {slot} out of range") });
        }
        let ctx = ThreadCtx { client: self.clone(), slot, generation };
        super::CURRENT.with(|c| *c.borrow_mut() = Some(ctx));
        Ok(())
    }

    /// Sends one request and waits for its reply.
    pub fn call(&self, req: &Request) -> Result<Reply, ClientError> {
        if std::process::id() != self.inner.pid {
            return Err(ClientError::Forked { parent: self.inner.pid });
        }
        self.inner.conn.lock().unwrap_or_else(|p| p.into_inner()).call(req)
    }

    /// Keyspace cell of `keyspace_id`, inserting it when new.
    pub(crate) fn cell_of(&self, keyspace_id: u32) -> Result<u32, ClientError> {
        let ks = &self.inner.regions.keyspaces;
        match ks.find(keyspace_id) {
            Some(c) => Ok(c),
            None => Ok(ks.find_or_insert(keyspace_id)?),
        }
    }

    /// Charged on-CPU ns of `keyspace_id` so far, as the shared table says.
    pub fn keyspace_cpu_ns(&self, keyspace_id: u32) -> Option<u64> {
        let ks = &self.inner.regions.keyspaces;
        let cell = ks.cells.get(ks.find(keyspace_id)?)?;
        Some(cell.cpu_ns.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// A registered thread's context, kept in a thread-local.
pub(crate) struct ThreadCtx {
    pub(crate) client: Client,
    slot: u32,
    generation: u64,
}

impl ThreadCtx {
    #[inline]
    fn thread(&self) -> ThreadRef<'_> {
        let i = &self.client.inner;
        ThreadRef {
            backend: i.backend,
            regions: &i.regions,
            slot: i.regions.slots.get(self.slot).expect("slot checked at registration"),
            owner: cpu_owner(self.slot, self.generation),
        }
    }

    #[inline]
    pub(crate) fn switch(&self, tag: u64) -> u64 {
        self.thread().switch_tag(tag)
    }

    #[inline]
    pub(crate) fn clock(&self) -> u64 {
        self.thread().clock()
    }
}

impl Drop for ThreadCtx {
    fn drop(&mut self) {
        // Close the last interval, then give the slot back.
        self.switch(TAG_NONE);
        let req = Request::UnregisterThread { slot: self.slot, generation: self.generation };
        if let Err(e) = self.client.call(&req) {
            log::debug!("unregistering slot {}: {e}", self.slot);
        }
    }
}
