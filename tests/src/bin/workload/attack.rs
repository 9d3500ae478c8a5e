//! `workload attack <what>`: what an ordinary local account can do to the
//! agent with nothing but the control socket's permission. Each attack
//! connects like a client (or just connects), misbehaves, and prints one
//! JSON line saying what it saw, with the uid it ran as; the hostile tests
//! run them as nobody.
//!
//! - `fds`: tries to resize every region descriptor `hello` hands out, and
//!   to write the ones a client may only read.
//! - `slot --tid T --write dead|tid`: overwrites the live thread slot of
//!   another client's thread `T` (its state, or its tid).
//! - `exhaust --threads N --keyspaces M --base B`: registers N of its own
//!   threads and asks for keyspace cells B..B+M, then holds them until
//!   stdin closes.
//! - `idle --connections N`: opens N connections that say nothing, until
//!   stdin closes.
//! - `long-line --mib M`: writes M MiB without a newline.
//! - `pipeline --count N --tids A,B,.. [--threads K]`: N `register-thread`
//!   requests for tids that are not its own, in one write, from a process
//!   with K idle threads.

use super::{arg, socket};
use anyhow::{Context, Result, bail};
use keyspace_governor::proto::{Reply, Request};
use keyspace_governor::region::{RegionSizes, SlotView, Table, fd};
use keyspace_governor::sys;
use keyspace_governor_common::{SLOT_DEAD, SLOT_LIVE};
use serde_json::json;
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Region names, in `region::fd` order.
const REGIONS: [&str; fd::COUNT] = ["cpus", "slots", "keyspaces", "header", "buckets", "params", "ledger"];

/// Regions a client may only read: the agent's header and parameters
/// (design §4) and the per-CPU anchors the kernel writes.
fn read_only(i: usize) -> bool {
    matches!(i, fd::CPUS | fd::HEADER | fd::PARAMS)
}

pub fn attack(args: &[String]) -> Result<serde_json::Value> {
    let what = args.get(1).map(String::as_str).unwrap_or("");
    let mut out = match what {
        "fds" => fds(args),
        "slot" => slot(args),
        "exhaust" => exhaust(args),
        "idle" => idle(args),
        "long-line" => long_line(args),
        "pipeline" => pipeline(args),
        other => bail!("unknown attack {other:?}: fds|slot|exhaust|idle|long-line|pipeline"),
    }?;
    out["uid"] = json!(uid());
    Ok(out)
}

fn uid() -> u32 {
    #[allow(unsafe_code)]
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe {
        libc::getuid()
    }
}

/// A connection that said `hello`, with what the agent handed over.
struct Session {
    reader: BufReader<UnixStream>,
    fds: Vec<OwnedFd>,
    sizes: RegionSizes,
}

impl Session {
    fn open(path: &str) -> Result<Session> {
        let stream = UnixStream::connect(path).with_context(|| format!("connecting to {path}"))?;
        stream.set_read_timeout(Some(Duration::from_secs(60)))?;
        let (reply, fds, reader) = keyspace_governor::client::handshake(stream).context("hello")?;
        let sizes = match reply {
            Reply::Hello { sizes, .. } => sizes,
            other => bail!("hello answered {other:?}"),
        };
        if fds.len() != fd::COUNT {
            bail!("hello handed over {} descriptors, not {}", fds.len(), fd::COUNT);
        }
        Ok(Session { reader, fds, sizes })
    }

    fn raw(&self, i: usize) -> RawFd {
        self.fds[i].as_raw_fd()
    }

    fn send(&mut self, text: &str) -> Result<()> {
        self.reader.get_mut().write_all(text.as_bytes())?;
        Ok(())
    }

    fn call(&mut self, req: &Request) -> Result<Reply> {
        self.send(&(serde_json::to_string(req)? + "\n"))?;
        self.reply()
    }

    fn reply(&mut self) -> Result<Reply> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            bail!("the agent closed the connection");
        }
        serde_json::from_str(&line).with_context(|| format!("reply {line:?}"))
    }
}

fn errno_name(e: &std::io::Error) -> String {
    let name = match e.raw_os_error() {
        Some(libc::EPERM) => "EPERM",
        Some(libc::EACCES) => "EACCES",
        Some(libc::EBUSY) => "EBUSY",
        Some(libc::EINVAL) => "EINVAL",
        Some(libc::ENODEV) => "ENODEV",
        Some(libc::EOPNOTSUPP) => "EOPNOTSUPP",
        Some(libc::EBADF) => "EBADF",
        Some(libc::ESPIPE) => "ESPIPE",
        Some(libc::EFBIG) => "EFBIG",
        Some(libc::ENOSPC) => "ENOSPC",
        Some(libc::ETXTBSY) => "ETXTBSY",
        Some(n) => return format!("errno {n}"),
        None => return e.to_string(),
    };
    name.to_string()
}

/// "ok", or the errno a libc call returning -1 left.
fn outcome(rc: i64) -> String {
    if rc < 0 { errno_name(&std::io::Error::last_os_error()) } else { "ok".to_string() }
}

/// Tries to resize `fd` (`len` bytes) both ways, with ftruncate and fallocate.
#[allow(unsafe_code)]
fn resize_attempts(fd: RawFd, len: usize) -> Vec<(&'static str, String)> {
    let page = sys::page_size() as libc::off_t;
    let len = len as libc::off_t;
    // Plain syscalls on a descriptor this process holds, with integer
    // arguments; the kernel checks them.
    let sized = |f: &dyn Fn() -> libc::c_int| outcome(f() as i64);
    vec![
        // SAFETY: see above.
        ("ftruncate-grow", sized(&|| unsafe { libc::ftruncate(fd, len + page) })),
        // SAFETY: see above.
        ("fallocate-grow", sized(&|| unsafe { libc::fallocate(fd, 0, len, page) })),
        // SAFETY: see above.
        ("ftruncate-shrink", sized(&|| unsafe { libc::ftruncate(fd, (len - page).max(0)) })),
        // SAFETY: see above.
        ("ftruncate-to-zero", sized(&|| unsafe { libc::ftruncate(fd, 0) })),
    ]
}

/// Tries every way to write a region a client may only read. "mmap-read"
/// is what a legitimate client does, and must work.
#[allow(unsafe_code)]
fn write_attempts(fd: RawFd, len: usize) -> Vec<(&'static str, String)> {
    let page = sys::page_size() as libc::off_t;
    let mmap_write = match sys::Mapping::map(fd, len) {
        Ok(_) => "ok".to_string(),
        Err(e) => errno_name(&e),
    };
    let (mmap_read, mprotect_write) = match sys::Mapping::map_readonly(fd, len) {
        Ok(m) => {
            // SAFETY: m is a live mapping of m.len() bytes this function owns;
            // changing its protection touches no memory Rust knows about.
            let rc = unsafe { libc::mprotect(m.as_ptr().cast(), m.len(), libc::PROT_READ | libc::PROT_WRITE) };
            ("ok".to_string(), outcome(rc as i64))
        }
        Err(e) => (errno_name(&e), "not tried".to_string()),
    };
    // Writes the first word back as it is: a refusal is what is tested.
    let mut word = [0u8; 8];
    // SAFETY: word is a valid 8-byte buffer; fd is a descriptor we hold.
    unsafe { libc::pread(fd, word.as_mut_ptr().cast(), word.len(), 0) };
    // SAFETY: as above.
    let pwrite = outcome(unsafe { libc::pwrite(fd, word.as_ptr().cast(), word.len(), 0) } as i64);
    // SAFETY: a syscall on a descriptor we hold, integer arguments.
    let punch = unsafe { libc::fallocate(fd, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, 0, page) };
    vec![
        ("mmap-read", mmap_read),
        ("mmap-write", mmap_write),
        ("mprotect-write", mprotect_write),
        ("pwrite", pwrite),
        ("punch-hole", outcome(punch as i64)),
    ]
}

/// Every descriptor of `hello`: resize attempts on all, write attempts on
/// the read-only ones, and each one's length before and after.
fn fds(args: &[String]) -> Result<serde_json::Value> {
    let s = Session::open(&socket(args))?;
    let mut regions = Vec::new();
    for (i, name) in REGIONS.iter().enumerate() {
        let fd = s.raw(i);
        let len = sys::region_len(fd).with_context(|| format!("length of the {name} region"))?;
        let mut ops = serde_json::Map::new();
        if read_only(i) {
            for (op, r) in write_attempts(fd, len) {
                ops.insert(op.to_string(), json!(r));
            }
        }
        for (op, r) in resize_attempts(fd, len) {
            ops.insert(op.to_string(), json!(r));
        }
        let after = sys::region_len(fd).map(|l| json!(l)).unwrap_or_else(|e| json!(e.to_string()));
        regions.push(
            json!({"fd": i, "region": name, "read_only": read_only(i), "len": len, "len_after": after, "ops": ops}),
        );
    }
    Ok(json!({ "regions": regions }))
}

/// Overwrites another client's live slot: `--write dead` marks it dead,
/// `--write tid` names another tid in it.
fn slot(args: &[String]) -> Result<serde_json::Value> {
    let victim: u32 = arg(args, "--tid", 0);
    let write: String = arg(args, "--write", "dead".to_string());
    let s = Session::open(&socket(args))?;
    let slots = Table::<SlotView>::map("thread slot", s.raw(fd::SLOTS), s.sizes.slots)?;
    let Some((i, v)) = slots
        .iter()
        .find(|(_, v)| v.tid.load(Ordering::Acquire) == victim && v.state.load(Ordering::Acquire) == SLOT_LIVE)
    else {
        bail!("no live slot of {} holds tid {victim}", slots.len());
    };
    let before = json!({
        "state": v.state.load(Ordering::Relaxed),
        "tid": v.tid.load(Ordering::Relaxed),
        "generation": v.generation.load(Ordering::Relaxed),
        "tag": v.tag.load(Ordering::Relaxed),
    });
    match write.as_str() {
        "dead" => v.state.store(SLOT_DEAD, Ordering::Release),
        "tid" => v.tid.store(victim.wrapping_add(1), Ordering::Release),
        other => bail!("--write {other:?}: dead or tid"),
    }
    Ok(json!({"slot": i, "before": before, "wrote": write}))
}

/// `n` threads that only sleep while the process lives; their tids.
fn idle_threads(n: usize) -> Result<Vec<u32>> {
    let (tx, rx) = std::sync::mpsc::channel();
    for _ in 0..n {
        let tx = tx.clone();
        std::thread::Builder::new().stack_size(64 * 1024).spawn(move || {
            let _ = tx.send(sys::gettid());
            drop(tx);
            loop {
                std::thread::park();
            }
        })?;
    }
    drop(tx);
    Ok(rx.iter().take(n).collect())
}

/// Prints `line` (with the uid) at once, then waits until stdin closes
/// (the test's signal to let go).
fn hold(line: &serde_json::Value) -> Result<()> {
    let mut line = line.clone();
    line["uid"] = json!(uid());
    let mut out = std::io::stdout();
    writeln!(out, "{line}")?;
    out.flush()?;
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    Ok(())
}

/// Takes every thread slot and keyspace cell it can, and holds them.
fn exhaust(args: &[String]) -> Result<serde_json::Value> {
    let threads: usize = arg(args, "--threads", 300);
    let keyspaces: u32 = arg(args, "--keyspaces", 300);
    let base: u32 = arg(args, "--base", 100_000);
    let mut s = Session::open(&socket(args))?;
    let tids = idle_threads(threads)?;
    let (mut slots, mut slot_refusals, mut slot_error) = (0u32, 0u32, None::<String>);
    for &tid in &tids {
        match s.call(&Request::RegisterThread { tid })? {
            Reply::Registered { .. } => slots += 1,
            Reply::Error { message } => {
                slot_refusals += 1;
                slot_error.get_or_insert(message);
            }
            other => bail!("register-thread answered {other:?}"),
        }
    }
    let (mut cells, mut cell_refusals, mut cell_error) = (0u32, 0u32, None::<String>);
    for id in base..base + keyspaces {
        match s.call(&Request::Keyspace { id })? {
            Reply::Keyspace { .. } => cells += 1,
            Reply::Error { message } => {
                cell_refusals += 1;
                cell_error.get_or_insert(message);
            }
            other => bail!("keyspace answered {other:?}"),
        }
    }
    let held = json!({
        "threads": tids.len(), "slots": slots, "slot_refusals": slot_refusals, "slot_error": slot_error,
        "cells": cells, "cell_refusals": cell_refusals, "cell_error": cell_error,
    });
    hold(&held)?;
    Ok(held)
}

/// Raises this process's descriptor limit to its hard limit.
fn raise_nofile() {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    #[allow(unsafe_code)]
    // SAFETY: rl is a valid out-pointer; setrlimit only reads it.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) == 0 {
            rl.rlim_cur = rl.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &rl);
        }
    }
}

/// Opens connections that never say anything, and holds them.
fn idle(args: &[String]) -> Result<serde_json::Value> {
    let n: usize = arg(args, "--connections", 1100);
    raise_nofile();
    let path = socket(args);
    let mut conns = Vec::with_capacity(n);
    let mut error = None;
    let start = Instant::now();
    for _ in 0..n {
        match UnixStream::connect(&path) {
            Ok(c) => conns.push(c),
            Err(e) => {
                error = Some(e.to_string());
                break;
            }
        }
    }
    let connected = json!({"connected": conns.len(), "error": error, "seconds": start.elapsed().as_secs_f64()});
    hold(&connected)?;
    Ok(connected)
}

/// One request line that never ends.
fn long_line(args: &[String]) -> Result<serde_json::Value> {
    let total: usize = arg::<usize>(args, "--mib", 100) << 20;
    let stream = UnixStream::connect(socket(args))?;
    // An agent that stops reading without closing shows as a timeout.
    stream.set_write_timeout(Some(Duration::from_secs(10)))?;
    let chunk = vec![b'a'; 64 * 1024];
    let start = Instant::now();
    let mut written = 0usize;
    let mut error = None;
    while written < total {
        match (&stream).write(&chunk[..chunk.len().min(total - written)]) {
            Ok(n) => written += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                error = Some(e);
                break;
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let closed = error
        .as_ref()
        .is_some_and(|e| matches!(e.kind(), std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset));
    // What the agent said before it closed, if anything.
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut reply = Vec::new();
    let read = (&stream).take(4096).read_to_end(&mut reply);
    Ok(json!({
        "written": written,
        "closed": closed,
        "error": error.map(|e| e.to_string()),
        "seconds": seconds,
        "reply": String::from_utf8_lossy(&reply).trim(),
        "read_error": read.err().map(|e| e.to_string()),
    }))
}

/// Registration requests for threads that are not this process's, all in
/// one write, then every reply.
fn pipeline(args: &[String]) -> Result<serde_json::Value> {
    let count: usize = arg(args, "--count", 50);
    let threads: usize = arg(args, "--threads", 0);
    let tids: Vec<u32> = arg(args, "--tids", String::new()).split(',').filter_map(|t| t.trim().parse().ok()).collect();
    if tids.is_empty() {
        bail!("--tids A,B,..");
    }
    // Each foreign tid makes the agent look through this process's tasks.
    idle_threads(threads)?;
    let mut s = Session::open(&socket(args))?;
    let batch: String = (0..count)
        .map(|i| {
            serde_json::to_string(&Request::RegisterThread { tid: tids[i % tids.len()] }).expect("serializes") + "\n"
        })
        .collect();
    let start = Instant::now();
    s.send(&batch)?;
    let (mut registered, mut refused, mut messages) = (0u32, 0u32, BTreeSet::new());
    let mut slowest_reply = 0f64;
    let mut last = Instant::now();
    for _ in 0..count {
        match s.reply()? {
            Reply::Registered { .. } => registered += 1,
            Reply::Error { message } => {
                refused += 1;
                if messages.len() < 6 {
                    messages.insert(message);
                }
            }
            other => bail!("register-thread answered {other:?}"),
        }
        slowest_reply = f64::max(slowest_reply, last.elapsed().as_secs_f64());
        last = Instant::now();
    }
    Ok(json!({
        "sent": count, "threads": threads, "registered": registered, "refused": refused, "messages": messages,
        "seconds": start.elapsed().as_secs_f64(), "slowest_reply_seconds": slowest_reply,
    }))
}
