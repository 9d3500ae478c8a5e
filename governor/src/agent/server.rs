//! The control socket: newline-delimited JSON requests, one task per
//! connection. `hello` is answered with the region fds attached.

use super::{AgentError, Shared};
use crate::proto::{Reply, Request};
use crate::sys;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Interest};
use tokio::net::{UnixListener, UnixStream};

pub(super) fn bind(path: &Path) -> Result<UnixListener, AgentError> {
    let listen_err = |source| AgentError::Listen { path: path.to_path_buf(), source };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(listen_err)?;
    }
    if path.exists() {
        // A live agent answers; a stale socket file from a crash does not.
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(AgentError::AlreadyRunning { path: path.to_path_buf() });
        }
        std::fs::remove_file(path).map_err(listen_err)?;
    }
    let listener = UnixListener::bind(path).map_err(listen_err)?;
    // Clients run unprivileged; they can only register their own threads.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).map_err(listen_err)?;
    Ok(listener)
}

pub(super) async fn serve(
    listener: UnixListener,
    shared: Arc<Shared>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), AgentError> {
    static NEXT_CONN: AtomicU64 = AtomicU64::new(1);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let id = NEXT_CONN.fetch_add(1, Ordering::Relaxed);
                    tokio::spawn(connection(stream, id, shared.clone()));
                }
                Err(e) => log::warn!("accept on the control socket: {e}"),
            },
        }
    }
}

async fn connection(stream: UnixStream, conn: u64, shared: Arc<Shared>) {
    let peer = sys::peer_pid(stream.as_raw_fd()).unwrap_or(0);
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    loop {
        line.clear();
        match reader.read_line(&mut line).await {
            Ok(0) => break,
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
        let (reply, fds) = handle(&shared, conn, peer, request);
        if let Err(e) = send(reader.get_mut(), &reply, fds).await {
            log::debug!("connection {conn}: {e}");
            break;
        }
    }
    let mut m = shared.lock_measurement();
    shared.lock_slots().drop_connection(&mut m, conn);
}

fn handle(shared: &Shared, conn: u64, peer: u32, request: Request) -> (Reply, Option<[i32; 4]>) {
    match request {
        Request::Hello => {
            let m = shared.lock_measurement();
            (Reply::Hello { backend: m.kind, sizes: m.sizes }, Some(m.raw_fds()))
        }
        Request::RegisterThread { tid } => {
            let mut m = shared.lock_measurement();
            match shared.lock_slots().register(&mut m, conn, peer, tid) {
                Ok((slot, generation)) => (Reply::Registered { slot, generation }, None),
                Err(e) => (Reply::Error { message: e.to_string() }, None),
            }
        }
        Request::UnregisterThread { slot, generation } => {
            let mut m = shared.lock_measurement();
            match shared.lock_slots().unregister(&mut m, conn, slot, generation) {
                Ok(()) => (Reply::Unregistered, None),
                Err(e) => (Reply::Error { message: e.to_string() }, None),
            }
        }
        Request::Status => (Reply::Status(Box::new(shared.status())), None),
    }
}

async fn send(stream: &mut UnixStream, reply: &Reply, fds: Option<[i32; 4]>) -> std::io::Result<()> {
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
