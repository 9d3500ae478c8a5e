//! What both example servers share: the request line and the CPU work.
//!
//! A request is one line, `<keyspace> <cpu_us>`: run `cpu_us` µs of CPU for
//! keyspace `<keyspace>`. The reply is `ok <waited_us> <digest>` (the
//! ticket's wait in line, and the work's result), `busy <reason>` when
//! admission refused it, or `error <what>`.

use keyspace_governor::client;
use std::time::Instant;

/// The longest stretch of work between two checkpoints (and, in the tokio
/// server, two polls: a light request on the same worker waits behind one
/// stretch of a heavy one), µs.
pub const STRETCH_US: u64 = 250;

/// `(keyspace, cpu_us)` of a request line.
pub fn parse(line: &str) -> Result<(u32, u64), String> {
    let mut words = line.split_whitespace();
    let (Some(keyspace), Some(cpu_us), None) = (words.next(), words.next(), words.next()) else {
        return Err(format!("expected `<keyspace> <cpu_us>`, got {line:?}"));
    };
    let keyspace = keyspace.parse().map_err(|e| format!("keyspace {keyspace:?}: {e}"))?;
    let cpu_us = cpu_us.parse().map_err(|e| format!("cpu_us {cpu_us:?}: {e}"))?;
    Ok((keyspace, cpu_us))
}

/// Hashes for `us` µs of the calling thread's CPU (by the thread clock the
/// agent measures; by wall time on an unregistered thread).
pub fn spin(us: u64) -> u64 {
    let start_cpu = client::thread_cpu_ns();
    let start = Instant::now();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    loop {
        for i in 0..256u64 {
            h = (h ^ i).wrapping_mul(0x0100_0000_01b3);
        }
        let spent_ns = match (start_cpu, client::thread_cpu_ns()) {
            (Some(a), Some(b)) => b - a,
            _ => start.elapsed().as_nanos() as u64,
        };
        if spent_ns >= us * 1000 {
            return h;
        }
    }
}
