//! The ticket path's length, counted exactly where this guest has no
//! hardware counters: valgrind's `lackey` traces a child of this binary
//! (`bench --trace-ticket SOCKET`) that takes and drops one ticket after a
//! thousand warm ones, and the mutex-protected buckets once after a
//! thousand, each between two calls of a marker function. What a cold
//! ticket costs is mostly these lines of code fetched again
//! (docs/benchmarks.md); unlike a time, the counts do not move with the
//! host's speed (only by one instruction, with whether the keyspace's
//! last-used stamp needs a store), so a change on the path reads the same
//! on any day.

use anyhow::{Context, Result, bail};
use governor_tests::{Agent, Scratch, essential_config};
use keyspace_governor::client::{Client, Demand};
use std::collections::HashSet;
use std::hint::black_box;
use std::io::Write;
use std::path::Path;
use std::process::Command;

use super::tickets::{ESTIMATE_US, MutexBuckets};

/// One traced stretch: instructions run, and the distinct 64-byte lines
/// and 4 KiB pages of code they came from and of data they touched (the
/// stack left out).
#[derive(Debug, Default)]
pub struct Stretch {
    pub instructions: u64,
    pub code_lines: usize,
    pub code_pages: usize,
    pub data_lines: usize,
}

/// Called around each traced stretch; the trace finds its address.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn governor_bench_trace_mark(n: u64) -> u64 {
    black_box(n) + 1
}

/// The traced child's part: prints where the marker and its stack lie,
/// then runs the two stretches.
pub fn traced_child(socket: &Path) -> Result<()> {
    let client = Client::connect(socket)?;
    client.register_current_thread()?;
    let demand = Demand::new().estimate_us(ESTIMATE_US);
    let buckets = MutexBuckets::new();
    for _ in 0..1000 {
        drop(black_box(client.acquire(1, demand)));
        assert!(buckets.acquire(ESTIMATE_US as i64));
        buckets.release(ESTIMATE_US as i64);
    }
    let on_stack = 0u8;
    let mut out = std::io::stdout();
    writeln!(
        out,
        "{:x} {:x}",
        governor_bench_trace_mark as *const () as usize,
        black_box(&on_stack) as *const u8 as usize
    )?;
    out.flush()?;
    governor_bench_trace_mark(0);
    drop(black_box(client.acquire(1, demand)));
    governor_bench_trace_mark(1);
    governor_bench_trace_mark(2);
    assert!(buckets.acquire(ESTIMATE_US as i64));
    buckets.release(ESTIMATE_US as i64);
    governor_bench_trace_mark(3);
    Ok(())
}

/// The ticket's acquire and release, and the mutex-protected buckets'.
pub fn ticket_path() -> Result<(Stretch, Stretch)> {
    let agent = Agent::start("ebpf", &essential_config(0.5 / keyspace_governor::sys::logical_cores() as f64))?;
    let dir = Scratch::new("trace");
    let log = dir.0.join("lackey.log");
    let out = Command::new("valgrind")
        .args(["--tool=lackey", "--trace-mem=yes"])
        .arg(format!("--log-file={}", log.display()))
        .arg(std::env::current_exe()?)
        .arg("--trace-ticket")
        .arg(&agent.socket)
        .output()
        .context("running valgrind (cargo xtask setup installs it)")?;
    if !out.status.success() {
        bail!("the traced ticket failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let stdout = String::from_utf8(out.stdout)?;
    let mut addrs = stdout.split_whitespace().map(|w| u64::from_str_radix(w, 16));
    let (Some(Ok(mark)), Some(Ok(stack))) = (addrs.next(), addrs.next()) else {
        bail!("the traced child printed {stdout:?}, not the marker's and the stack's addresses");
    };
    let text = std::fs::read_to_string(&log)?;
    let stretches = stretches(&text, mark, stack);
    match <[Stretch; 2]>::try_from(stretches) {
        Ok([ticket, mutex]) => Ok((ticket, mutex)),
        Err(v) => bail!("expected two traced stretches in {}, found {}", log.display(), v.len()),
    }
}

/// The stretches between the marker's entries 0–1, 2–3, … in a lackey
/// trace (`I  addr,size` for an instruction; ` L`, ` S`, ` M` for data).
fn stretches(trace: &str, mark: u64, stack: u64) -> Vec<Stretch> {
    const STACK_SPAN: u64 = 8 << 20;
    let mut done = Vec::new();
    let mut marks = 0;
    let (mut n, mut code, mut data) = (0u64, HashSet::new(), HashSet::new());
    for line in trace.lines() {
        let mut f = line.split_whitespace();
        let (Some(kind), Some(at)) = (f.next(), f.next()) else { continue };
        let Some(Ok(addr)) = at.split(',').next().map(|a| u64::from_str_radix(a, 16)) else { continue };
        match kind {
            "I" if addr == mark => {
                if marks % 2 == 1 {
                    let pages: HashSet<u64> = code.iter().map(|l| l >> 6).collect();
                    done.push(Stretch {
                        instructions: n,
                        code_lines: code.len(),
                        code_pages: pages.len(),
                        data_lines: data.len(),
                    });
                }
                marks += 1;
                (n, code, data) = (0, HashSet::new(), HashSet::new());
            }
            "I" if marks % 2 == 1 => {
                n += 1;
                code.insert(addr >> 6);
            }
            "L" | "S" | "M" if marks % 2 == 1 && addr.abs_diff(stack) > STACK_SPAN => {
                data.insert(addr >> 6);
            }
            _ => {}
        }
    }
    done
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_stretch_counts_what_runs_between_two_marks() {
        // Marker at 0x100, stack near 0x7f00_0000.
        let trace = "I  00000050,3\nI  00000100,5\n L 7f000010,8\nI  00000104,2\n L 00002000,8\n S 00002008,8\n\
                     I  00001000,4\n M 00003040,4\nI  00000100,5\nI  00000200,1\nI  00000100,5\nI  00000300,4\nI  00000100,5\n";
        let s = super::stretches(trace, 0x100, 0x7f00_0000);
        assert_eq!(s.len(), 2);
        // The marker's own first instruction opens the stretch and is not counted.
        assert_eq!((s[0].instructions, s[0].code_lines, s[0].code_pages, s[0].data_lines), (2, 2, 2, 2));
        assert_eq!((s[1].instructions, s[1].code_lines, s[1].data_lines), (1, 1, 0));
    }
}
