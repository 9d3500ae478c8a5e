//! The control socket: newline-delimited JSON requests, one task per
//! connection. `hello` is answered with the region descriptors attached and
//! opens the connection's ticket ledger; when the connection closes, the
//! client's thread slots and tickets (ledger and socket grants) come back.
//!
//! It holds under abuse: a line longer than [`MAX_LINE`] closes the
//! connection, at most [`MAX_CONNECTIONS`] are served at once (the rest wait
//! in the kernel's backlog) and at most [`MAX_CONNECTIONS_PER_UID`] for one
//! non-root uid (more are closed at once), an accept error backs off instead of spinning,
//! and registration's `/proc` reads run off the runtime's thread.
//!
//! Who may do what (`agent.access`): the socket file's mode and group
//! decide who connects; each request then needs a role the peer's
//! `SO_PEERCRED` credentials hold (admin, client, reader; see
//! `config::access`), or is refused with `not permitted` naming who holds it.

use super::live_config::{Change, Refused};
use super::{AgentError, Shared};
use crate::config::{Access, ConfigDiff, Peer, Role};
use crate::policy::{Demand, Grant};
use crate::proto::{ConfigChange, Reply, Request};
use crate::region::fd;
use crate::sys;
use keyspace_governor_common::admission::LEDGER_LEN;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Interest};
use tokio::net::{UnixListener, UnixStream};

/// Longest request line, bytes.
pub const MAX_LINE: usize = 64 * 1024;
/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 4096;
/// Connections one non-root uid may have open at once: one account cannot
/// take the others' share.
pub const MAX_CONNECTIONS_PER_UID: usize = 1024;

///
/// Also returns the agent's claim on the path, to hold while it runs: an
/// abstract socket named after the path (the kernel drops it with the
/// process, and no file operation removes it), so a second agent on the
/// same path is refused even when the socket file was deleted under the
/// first. Two agents on one path would share the keyspace cgroups and the
/// state file, and each would undo the other's caps.
pub(super) fn bind(path: &Path, access: &Access) -> Result<(UnixListener, Claim), AgentError> {
    let listen_err = |source| AgentError::Listen { path: path.to_path_buf(), source };
    let made_dir = path.parent().filter(|d| !d.as_os_str().is_empty() && !d.exists()).map(Path::to_path_buf);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(listen_err)?;
    }
    let mut claim = Claim::take(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::AddrInUse => AgentError::AlreadyRunning { path: path.to_path_buf() },
        _ => listen_err(source),
    })?;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        // Only a socket is taken for a crashed agent's and removed: any
        // other file there is someone's, and stays.
        if !meta.file_type().is_socket() {
            return Err(AgentError::NotASocket { path: path.to_path_buf() });
        }
        // A live agent answers (one in another network namespace holds no
        // claim here); a stale socket file from a crash does not.
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(AgentError::SocketInUse { path: path.to_path_buf() });
        }
        std::fs::remove_file(path).map_err(listen_err)?;
    }
    claim.made_dir = made_dir;
    let listener = UnixListener::bind(path).map_err(listen_err)?;
    if let Ok(m) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::MetadataExt;
        claim.socket = Some((path.to_path_buf(), m.dev(), m.ino()));
    }
    access.apply_to_socket(path).map_err(|source| AgentError::SocketAccess {
        path: path.to_path_buf(),
        group: access.written.socket_group.clone().unwrap_or_else(|| "(the agent's own)".into()),
        mode: access.mode,
        source,
    })?;
    Ok((listener, claim))
}

/// An agent's claim on its control socket's path ([`bind`]). Given up
/// when dropped, as the agent stops (or fails to start once it bound):
/// the socket file goes, and the directory the agent made for it if
/// nothing else is in it now.
pub(crate) struct Claim {
    _held: std::os::unix::net::UnixListener,
    /// The socket, once bound, with its device and inode: only that file
    /// is removed (one put at the path since is someone else's).
    socket: Option<(std::path::PathBuf, u64, u64)>,
    /// The socket's directory, when the agent made it.
    made_dir: Option<std::path::PathBuf>,
}

impl Drop for Claim {
    fn drop(&mut self) {
        use std::os::unix::fs::MetadataExt;
        if let Some((socket, dev, ino)) = &self.socket
            && std::fs::symlink_metadata(socket).is_ok_and(|m| m.dev() == *dev && m.ino() == *ino)
        {
            let _ = std::fs::remove_file(socket);
        }
        if let Some(dir) = &self.made_dir {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

impl Claim {
    fn take(path: &Path) -> std::io::Result<Claim> {
        use std::os::linux::net::SocketAddrExt;
        // The path as every agent names it: absolute, its directory's links
        // resolved.
        let abs = match (path.parent().map(std::fs::canonicalize), path.file_name()) {
            (Some(Ok(dir)), Some(name)) => dir.join(name),
            _ => std::path::absolute(path)?,
        };
        let name = format!("governor-agent-{:08x}", super::fnv32(abs.as_os_str().as_encoded_bytes()));
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        Ok(Claim { _held: std::os::unix::net::UnixListener::bind_addr(&addr)?, socket: None, made_dir: None })
    }
}

/// Who a peer is taken for when its credentials cannot be read: the least.
fn nobody() -> Peer {
    Peer { pid: 0, uid: 65534, gids: vec![65534] }
}

/// The peer of a connection: uid, pid and every group it is in.
fn peer_of(fd: RawFd) -> Peer {
    let Ok((pid, uid, gid)) = sys::peer_cred(fd) else {
        return nobody();
    };
    let mut gids = vec![gid];
    gids.extend(crate::procs::groups(pid));
    Peer { pid, uid, gids }
}

/// The role a request needs, and what it is called in a refusal.
fn needs(request: &Request) -> Option<(Role, &'static str)> {
    Some(match request {
        Request::Watch { .. } => return None,
        Request::Status | Request::Threads | Request::ConfigShow => (Role::Reader, "read status"),
        Request::ConfigReload | Request::ConfigSet { .. } | Request::RuleAdd { .. } | Request::RuleRemove { .. } => {
            (Role::Admin, "change the configuration")
        }
        Request::Profile { .. } => (Role::Admin, "profile the node's processes"),
        Request::Hello
        | Request::RegisterThread { .. }
        | Request::UnregisterThread { .. }
        | Request::Keyspace { .. }
        | Request::Acquire { .. }
        | Request::Release { .. } => (Role::Client, "register threads or take tickets"),
    })
}

pub(super) async fn serve(
    listener: UnixListener,
    shared: Arc<Shared>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), AgentError> {
    static NEXT_CONN: AtomicU64 = AtomicU64::new(1);
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let per_uid: Arc<std::sync::Mutex<HashMap<u32, usize>>> = Arc::default();
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            p = permits.clone().acquire_owned() => p.expect("never closed"),
        };
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let uid = sys::peer_cred(stream.as_raw_fd()).map_or(65534, |(_, uid, _)| uid);
                    if uid != 0 {
                        let mut open = per_uid.lock().unwrap_or_else(|p| p.into_inner());
                        let n = open.entry(uid).or_insert(0);
                        if *n >= MAX_CONNECTIONS_PER_UID {
                            // Closed at once: the peer reads EOF.
                            drop(stream);
                            continue;
                        }
                        *n += 1;
                    }
                    let id = NEXT_CONN.fetch_add(1, Ordering::Relaxed);
                    let (shared, per_uid) = (shared.clone(), per_uid.clone());
                    tokio::spawn(async move {
                        connection(stream, id, shared).await;
                        if uid != 0 {
                            let mut open = per_uid.lock().unwrap_or_else(|p| p.into_inner());
                            if let Some(n) = open.get_mut(&uid) {
                                *n -= 1;
                                if *n == 0 {
                                    open.remove(&uid);
                                }
                            }
                        }
                        drop(permit);
                    });
                }
                Err(e) => {
                    log::warn!("accept on the control socket: {e}");
                    // Out of descriptors, most likely: let connections close.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
}

/// Runs `f` on the blocking pool: the runtime's one thread keeps serving.
async fn blocking(shared: &Arc<Shared>, f: impl FnOnce(&Shared) -> Reply + Send + 'static) -> Reply {
    let shared = shared.clone();
    tokio::task::spawn_blocking(move || f(&shared))
        .await
        .unwrap_or_else(|e| Reply::Error { message: format!("the agent failed to answer: {e}") })
}

async fn connection(stream: UnixStream, conn: u64, shared: Arc<Shared>) {
    // Reads /proc: off the runtime's thread (the stream, so its fd, outlives it).
    let fd = stream.as_raw_fd();
    let who = tokio::task::spawn_blocking(move || peer_of(fd)).await.unwrap_or_else(|_| nobody());
    let (peer, uid) = (who.pid, who.uid);
    let agent_uid = sys::effective_uid();
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    let mut said_hello = false;
    let mut grants = SocketGrants::default();
    loop {
        line.clear();
        match (&mut reader).take(MAX_LINE as u64 + 1).read_line(&mut line).await {
            Ok(0) => break,
            Ok(_) if line.len() > MAX_LINE => {
                log::warn!("connection {conn} (pid {peer}): request line over {MAX_LINE} bytes; closed");
                let _ = send(
                    reader.get_mut(),
                    &Reply::Error { message: format!("request line over {MAX_LINE} bytes") },
                    None,
                )
                .await;
                break;
            }
            Ok(_) => {}
            Err(e) => {
                log::debug!("connection {conn}: {e}");
                break;
            }
        }
        let request = match serde_json::from_str::<Request>(&line) {
            Ok(r) => r,
            Err(e) => {
                let reply = Reply::Error { message: format!("malformed request: {e}") };
                if send(reader.get_mut(), &reply, None).await.is_err() {
                    break;
                }
                continue;
            }
        };
        if let Some((role, what)) = needs(&request) {
            let access = shared.access();
            if !access.allows(&who, role, agent_uid) {
                let message = format!(
                    "{}uid {uid} may not {what}: that needs the {} role, held by {}",
                    crate::proto::NOT_PERMITTED,
                    role.as_str(),
                    access.holders(role)
                );
                log::info!("connection {conn} (pid {peer}): refused: {message}");
                if send(reader.get_mut(), &Reply::Error { message }, None).await.is_err() {
                    break;
                }
                continue;
            }
        }
        let (reply, fds) = match request {
            // The client only reads this connection: it ends when we do.
            Request::Watch { .. } => continue,
            Request::Hello => {
                said_hello = true;
                hello(&shared, conn)
            }
            // Status waits on the measurement locks; thread names come from
            // /proc: both off the runtime's thread.
            Request::Status => (blocking(&shared, |s| Reply::Status(Box::new(s.status()))).await, None),
            Request::Threads => (
                blocking(&shared, |s| Reply::Threads { threads: super::status::name_threads(s.thread_rows()) }).await,
                None,
            ),
            Request::Acquire { keyspace, estimate_us, write_bytes } => {
                (grants.acquire(&shared, keyspace, Demand { estimate_us, write_bytes, ..Demand::default() }), None)
            }
            Request::Release { ticket, consumed_us } => (grants.release(&shared, ticket, consumed_us), None),
            // Operators' verbs (the admin role, checked above).
            // A change may read its file and scan /proc for the rules.
            Request::ConfigReload => (
                blocking(&shared, move |s| {
                    config_reply(s.change_config(Change::Reload(format!("config reload by uid {uid}"))))
                })
                .await,
                None,
            ),
            Request::ConfigShow => (blocking(&shared, |s| s.config_reply()).await, None),
            Request::ConfigSet { key, value } => {
                (blocking(&shared, move |s| config_reply(s.change_config(Change::Set(&key, &value)))).await, None)
            }
            Request::RuleAdd { rule, position } => (
                blocking(&shared, move |s| config_reply(s.change_config(Change::AddRule(&rule, position)))).await,
                None,
            ),
            Request::RuleRemove { name } => {
                (blocking(&shared, move |s| config_reply(s.change_config(Change::RemoveRule(&name)))).await, None)
            }
            // Waits out the profile on this connection's task alone; the
            // symbols are looked up off the runtime's threads.
            Request::Profile { seconds, frequency_hz, keyspace, top } => {
                let pick = match (keyspace, top) {
                    (Some(ks), _) => super::profile::Pick::One(ks),
                    (None, Some(n)) => super::profile::Pick::Top(n as usize),
                    (None, None) => super::profile::Pick::All,
                };
                (super::profile::take(&shared, seconds, frequency_hz, pick).await, None)
            }
            _ if !said_hello => (Reply::Error { message: "say hello first".into() }, None),
            Request::RegisterThread { tid } => {
                let s = shared.clone();
                // Reads /proc: off the runtime's thread.
                let r = tokio::task::spawn_blocking(move || {
                    // /proc first, then the locks: status never waits on it.
                    let task = super::slots::resolve(peer, tid)?;
                    let registered = {
                        let mut m = s.lock_measurement();
                        s.lock_slots().register_resolved(&mut m, conn, uid, task)
                    };
                    if registered.is_ok() {
                        s.server_registered(peer, conn);
                    }
                    registered
                })
                .await;
                match r {
                    Ok(Ok((slot, generation))) => (Reply::Registered { slot, generation }, None),
                    Ok(Err(e)) => (Reply::Error { message: e.to_string() }, None),
                    Err(e) => (Reply::Error { message: format!("registration failed: {e}") }, None),
                }
            }
            Request::UnregisterThread { slot, generation } => {
                let mut m = shared.lock_measurement();
                match shared.lock_slots().unregister(&mut m, conn, slot, generation) {
                    Ok(()) => (Reply::Unregistered, None),
                    Err(e) => (Reply::Error { message: e.to_string() }, None),
                }
            }
            Request::Keyspace { id } => keyspace(&shared, id, uid),
        };
        if let Err(e) = send(reader.get_mut(), &reply, fds).await {
            log::debug!("connection {conn}: {e}");
            break;
        }
    }
    {
        let mut m = shared.lock_measurement();
        shared.lock_slots().drop_connection(&mut m, conn);
    }
    grants.close(&shared);
    {
        // A server's last connection: the caps may follow its cgroup out.
        let s = shared.clone();
        let _ = tokio::task::spawn_blocking(move || s.server_connection_closed(conn)).await;
    }
    let back = shared.lock_ledgers().reclaim(conn, &shared.policy);
    if back.tickets > 0 {
        log::info!(
            "client pid {peer} went holding {} tickets ({} write bytes, {} requests in flight); all returned",
            back.tickets,
            back.write_bytes,
            back.requests
        );
    }
}

/// Grants a connection holds through `acquire` over the socket: at most
/// [`LEDGER_LEN`], like a ledger, and released when the connection closes.
#[derive(Default)]
struct SocketGrants {
    next: u64,
    held: HashMap<u64, Grant>,
}

impl SocketGrants {
    fn acquire(&mut self, shared: &Shared, keyspace: u32, demand: Demand) -> Reply {
        if self.held.len() >= LEDGER_LEN as usize {
            return Reply::Error { message: format!("this connection already holds {LEDGER_LEN} grants") };
        }
        match shared.policy.admit(keyspace, &demand, super::now_us()) {
            Ok(g) => {
                self.next += 1;
                let granted_us = g.granted_us();
                self.held.insert(self.next, g);
                Reply::Granted { ticket: self.next, granted_us }
            }
            Err(r) => Reply::Refused { reason: r.code().to_string(), message: r.to_string() },
        }
    }

    fn release(&mut self, shared: &Shared, ticket: u64, consumed_us: u64) -> Reply {
        match self.held.remove(&ticket) {
            Some(g) => {
                shared.policy.release(g, consumed_us);
                Reply::Released
            }
            None => Reply::Error { message: format!("no grant {ticket} on this connection") },
        }
    }

    /// The connection closed: what it still held comes back, unconsumed.
    fn close(&mut self, shared: &Shared) {
        for (_, g) in self.held.drain() {
            shared.policy.release(g, 0);
        }
    }
}

fn hello(shared: &Shared, conn: u64) -> (Reply, Option<Vec<RawFd>>) {
    let ledger = match shared.lock_ledgers().open(conn) {
        Ok(fd) => fd,
        Err(e) => return (Reply::Error { message: format!("cannot open a ticket ledger: {e}") }, None),
    };
    let m = shared.lock_measurement();
    let mut fds = vec![0; fd::COUNT];
    let [cpus, slots, keyspaces] = m.raw_fds();
    fds[fd::CPUS] = cpus;
    fds[fd::SLOTS] = slots;
    fds[fd::KEYSPACES] = keyspaces;
    let [header, buckets, params] = shared.policy.memory().raw_fds();
    fds[fd::HEADER] = header;
    fds[fd::BUCKETS] = buckets;
    fds[fd::PARAMS] = params;
    fds[fd::LEDGER] = ledger;
    let mut sizes = m.sizes;
    sizes.ledger = keyspace_governor_common::admission::LEDGER_LEN;
    let layout = crate::region::ADMISSION_LAYOUT;
    (Reply::Hello { backend: m.kind, sizes, instance: shared.instance, layout }, Some(fds))
}

/// The cell of keyspace `id`, given one if it has none, within the asking
/// uid's quota of cells (`cells::CellGrants`).
fn keyspace(shared: &Shared, id: u32, uid: u32) -> (Reply, Option<Vec<RawFd>>) {
    let per_uid = shared.keyspaces_per_uid.load(std::sync::atomic::Ordering::Relaxed);
    let granted = shared.lock_cell_grants().cell_for(&shared.policy, id, uid, per_uid, super::now_us());
    match granted {
        Ok((cell, generation, new)) => {
            if new {
                let m = shared.lock_measurement();
                shared.lock_usage().note(&m, cell, id, generation);
            }
            (Reply::Keyspace { cell, generation }, None)
        }
        Err(e) => (Reply::Error { message: e.to_string() }, None),
    }
}

/// The reply to a configuration change: what changed, or every reason it
/// was refused.
fn config_reply(result: Result<ConfigDiff, Refused>) -> Reply {
    match result {
        Ok(diff) => Reply::ConfigUpdated {
            changes: diff.changes.into_iter().map(|c| ConfigChange { key: c.key, old: c.old, new: c.new }).collect(),
        },
        Err(why) => {
            Reply::ConfigRejected { errors: why.reasons(), file_unreadable: matches!(why, Refused::Read { .. }) }
        }
    }
}

async fn send(stream: &mut UnixStream, reply: &Reply, fds: Option<Vec<RawFd>>) -> std::io::Result<()> {
    let mut bytes = serde_json::to_vec(reply).expect("replies serialize");
    bytes.push(b'\n');
    match fds {
        None => stream.write_all(&bytes).await,
        Some(fds) => {
            // The first chunk carries the fds; the rest (if any) follows plainly.
            let sent = loop {
                stream.writable().await?;
                match stream.try_io(Interest::WRITABLE, || sys::send_with_fds(stream.as_raw_fd(), &bytes, &fds)) {
                    Ok(n) => break n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(e) => return Err(e),
                }
            };
            stream.write_all(&bytes[sent..]).await
        }
    }
}
