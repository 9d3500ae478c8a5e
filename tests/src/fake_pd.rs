//! A PD stand-in for tests: the two endpoints the agent reads, over real
//! HTTP/1.1 on loopback, with faults on demand.
//!
//! - `GET /pd/api/v2/keyspaces/id/{id}`: the keyspace's meta
//!   (`{"id","name","state",...}`), 404 for unknown ids.
//! - `GET /resource-manager/api/v1/config/keyspace/service-limit/{name}`:
//!   what [`Reply`] the test set for that name.
//!
//! [`FakePd::stop`] closes the listener (connections are refused, as with a
//! PD that is down) and [`FakePd::start_again`] reopens it on the same port.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// What the service-limit endpoint answers for one keyspace name.
#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    /// 200 `{"service_limit": v}`.
    Limit(f64),
    /// 404.
    NotFound,
    /// 500.
    ServerError,
    /// The limit, but only after this long.
    Slow(Duration, f64),
    /// The connection is reset before any reply.
    Reset,
    /// 200 with a body that is not the expected JSON.
    Malformed,
}

#[derive(Default)]
struct Book {
    /// id → (name, state).
    keyspaces: HashMap<u32, (String, String)>,
    limits: HashMap<String, Reply>,
    /// Every path asked, in order.
    asked: Vec<String>,
}

/// See the module docs.
pub struct FakePd {
    pub addr: SocketAddr,
    book: Arc<Mutex<Book>>,
    stop: Arc<AtomicBool>,
    server: Option<JoinHandle<()>>,
}

impl FakePd {
    pub fn start() -> FakePd {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the fake PD");
        let addr = listener.local_addr().unwrap();
        let mut pd = FakePd { addr, book: Arc::default(), stop: Arc::default(), server: None };
        pd.serve(listener);
        pd
    }

    fn serve(&mut self, listener: TcpListener) {
        let (book, stop) = (self.book.clone(), self.stop.clone());
        self.server = Some(std::thread::spawn(move || {
            for conn in listener.incoming() {
                if stop.load(Ordering::Acquire) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let book = book.clone();
                std::thread::spawn(move || answer(conn, &book));
            }
        }));
    }

    /// Sets a keyspace's name and state (`ENABLED`, `ARCHIVED`, ...).
    pub fn keyspace(&self, id: u32, name: &str, state: &str) {
        self.book.lock().unwrap().keyspaces.insert(id, (name.to_string(), state.to_string()));
    }

    /// Sets what the service-limit endpoint answers for `name`.
    pub fn reply(&self, name: &str, reply: Reply) {
        self.book.lock().unwrap().limits.insert(name.to_string(), reply);
    }

    /// Every path asked so far.
    pub fn asked(&self) -> Vec<String> {
        self.book.lock().unwrap().asked.clone()
    }

    /// Closes the listener: connections are refused until [`Self::start_again`].
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.server.take() {
            t.join().unwrap();
        }
    }

    /// Listens again on the same address.
    pub fn start_again(&mut self) {
        self.stop.store(false, Ordering::Release);
        let listener = TcpListener::bind(self.addr).expect("rebind the fake PD");
        self.serve(listener);
    }
}

impl Drop for FakePd {
    fn drop(&mut self) {
        if self.server.is_some() {
            self.stop();
        }
    }
}

fn answer(mut conn: TcpStream, book: &Mutex<Book>) {
    conn.set_read_timeout(Some(Duration::from_secs(5))).ok();
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&head).to_string();
    let path = text.split(' ').nth(1).unwrap_or_default().to_string();
    let reply = {
        let mut b = book.lock().unwrap();
        b.asked.push(path.clone());
        if let Some(id) = path.strip_prefix("/pd/api/v2/keyspaces/id/") {
            match id.parse::<u32>().ok().and_then(|id| b.keyspaces.get(&id).map(|k| (id, k.clone()))) {
                Some((id, (name, state))) => meta(id, &name, &state),
                None => (404, "keyspace not found".to_string()),
            }
        } else if let Some(name) = path.strip_prefix("/resource-manager/api/v1/config/keyspace/service-limit/") {
            let name = unescape(name);
            match b.limits.get(&name).cloned() {
                Some(r) => {
                    drop(b);
                    match r {
                        Reply::Reset => {
                            reset(&conn);
                            return;
                        }
                        Reply::Slow(d, v) => {
                            std::thread::sleep(d);
                            limit(v)
                        }
                        Reply::Limit(v) => limit(v),
                        Reply::NotFound => (404, "service limit not found".to_string()),
                        Reply::ServerError => (500, "resource manager is not ready".to_string()),
                        Reply::Malformed => (200, "{\"service_limit\": \"lots\"".to_string()),
                    }
                }
                None => (404, "service limit not found".to_string()),
            }
        } else {
            (404, "404 page not found".to_string())
        }
    };
    let (status, body) = reply;
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        _ => "Internal Server Error",
    };
    let _ = write!(
        conn,
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
}

/// A keyspace's meta, indented as PD's API writes it.
fn meta(id: u32, name: &str, state: &str) -> (u16, String) {
    (
        200,
        format!(
            "{{\n  \"id\": {id},\n  \"name\": {name:?},\n  \"state\": {state:?},\n  \"created_at\": 1700000000,\n  \"state_changed_at\": 1700000000,\n  \"config\": {{}}\n}}"
        ),
    )
}

fn limit(v: f64) -> (u16, String) {
    // PD's reply carries more than the limit; the agent must not mind.
    (200, format!("{{\"service_limit\":{v},\"available_tokens\":0}}"))
}

/// Closes with a reset (SO_LINGER 0), as a crashing peer would.
fn reset(conn: &TcpStream) {
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: a valid socket and a properly sized option value.
    unsafe {
        libc::setsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

/// `%XX` escapes back to bytes.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(v);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
