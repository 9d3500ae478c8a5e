//! `workload redis-probe --port P --rate R --seconds S [--connections C]`:
//! a latency-sensitive client of a real server (Debian's `redis-server`)
//! at a fixed rate, open loop: request `i` of a connection is due at
//! `start + i / rate`, and its latency counts from when it was due, not
//! from when it was sent, so a client held up by the server (or the
//! machine) does not hide the wait it caused (coordinated omission).
//! Requests are `GET k` of a 64-byte value set first. Prints the latency
//! percentiles in µs and how many requests ran late by more than a period.

use super::arg;
use anyhow::{Context, Result, bail};
use serde_json::json;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Reads one RESP reply (a simple string, an error, or a bulk string).
fn reply(r: &mut BufReader<TcpStream>, line: &mut String, body: &mut Vec<u8>) -> Result<()> {
    line.clear();
    r.read_line(line)?;
    match line.as_bytes().first() {
        Some(b'+') | Some(b':') => Ok(()),
        Some(b'$') => {
            let n: i64 = line[1..].trim().parse().context("bulk length")?;
            if n >= 0 {
                body.resize(n as usize + 2, 0);
                std::io::Read::read_exact(r, body)?;
            }
            Ok(())
        }
        _ => bail!("redis said {line:?}"),
    }
}

fn command(parts: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", parts.len()).into_bytes();
    for p in parts {
        out.extend_from_slice(format!("${}\r\n", p.len()).as_bytes());
        out.extend_from_slice(p);
        out.extend_from_slice(b"\r\n");
    }
    out
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

pub fn redis_probe(args: &[String]) -> Result<serde_json::Value> {
    let port: u16 = arg(args, "--port", 6379);
    let rate: f64 = arg(args, "--rate", 1000.0);
    let seconds: f64 = arg(args, "--seconds", 5.0);
    let connections: usize = arg::<usize>(args, "--connections", 1).max(1);
    let per = Duration::from_secs_f64(connections as f64 / rate);
    let threads: Vec<_> = (0..connections)
        .map(|c| {
            std::thread::spawn(move || -> Result<(Vec<f64>, u64)> {
                // Sleeps end when due, not up to 50 µs later (the default
                // timer slack): the probe's own lateness is not the server's.
                // SAFETY: prctl with integer arguments only.
                #[allow(unsafe_code)]
                unsafe {
                    libc::prctl(libc::PR_SET_TIMERSLACK, 1u64, 0u64, 0u64, 0u64)
                };
                let stream = TcpStream::connect(("127.0.0.1", port)).context("connecting to redis")?;
                stream.set_nodelay(true)?;
                let mut w = stream.try_clone()?;
                let mut r = BufReader::new(stream);
                let (mut line, mut body) = (String::new(), Vec::new());
                let key = format!("probe-{c}");
                w.write_all(&command(&[b"SET", key.as_bytes(), &[b'v'; 64]]))?;
                reply(&mut r, &mut line, &mut body)?;
                let get = command(&[b"GET", key.as_bytes()]);
                // Connections start spread over one period.
                let start = Instant::now() + per.mul_f64(c as f64 / connections as f64);
                let n = (seconds / per.as_secs_f64()) as u64;
                let (mut lat, mut late) = (Vec::with_capacity(n as usize), 0);
                for i in 0..n {
                    let due = start + per.mul_f64(i as f64);
                    let now = Instant::now();
                    if let Some(d) = due.checked_duration_since(now) {
                        std::thread::sleep(d);
                    } else if now - due > per {
                        late += 1;
                    }
                    w.write_all(&get)?;
                    reply(&mut r, &mut line, &mut body)?;
                    lat.push(due.elapsed().as_secs_f64() * 1e6);
                }
                Ok((lat, late))
            })
        })
        .collect();
    let (mut all, mut late) = (Vec::new(), 0);
    for t in threads {
        let (l, n) = t.join().map_err(|_| anyhow::anyhow!("probe thread panicked"))??;
        all.extend(l);
        late += n;
    }
    all.sort_by(|a, b| a.total_cmp(b));
    Ok(json!({
        "requests": all.len(),
        "late": late,
        "p50_us": percentile(&all, 0.5),
        "p99_us": percentile(&all, 0.99),
        "p999_us": percentile(&all, 0.999),
        "max_us": all.last().copied().unwrap_or(0.0),
    }))
}

/// `workload slice --pid P --us N`: asks for an `N` µs scheduler slice for
/// every thread of `P` and of its children (an experiment's knob).
pub fn slice(args: &[String]) -> Result<serde_json::Value> {
    let pid: u32 = arg(args, "--pid", 0);
    let us: u64 = arg(args, "--us", 100);
    let mut pids = vec![pid];
    for e in std::fs::read_dir("/proc")?.flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let ppid = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<u32>().ok());
        if ppid == Some(pid) {
            pids.push(p);
        }
    }
    let mut set = 0;
    for p in pids {
        for t in std::fs::read_dir(format!("/proc/{p}/task"))?.flatten() {
            let Ok(tid) = t.file_name().to_string_lossy().parse::<u32>() else { continue };
            keyspace_governor::sys::set_task_slice(tid, Duration::from_micros(us))?;
            set += 1;
        }
    }
    Ok(json!({ "threads": set }))
}
