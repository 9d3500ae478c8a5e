//! `governor threads`: the registered threads, by client process.

use super::CliError;
use crate::client;
use crate::proto::{Reply, Request, ThreadInfo};
use std::fmt::Write as _;
use std::path::Path;

pub fn run(socket: &Path) -> Result<Vec<ThreadInfo>, CliError> {
    match client::request(socket, &Request::Threads)? {
        Reply::Threads { threads } => Ok(threads),
        other => Err(CliError::Reply { detail: format!("{other:?}") }),
    }
}

/// One block per process, a line per thread.
pub fn render(threads: &[ThreadInfo]) -> String {
    let mut out = String::new();
    if threads.is_empty() {
        out.push_str("no registered threads\n");
        return out;
    }
    let mut sorted: Vec<&ThreadInfo> = threads.iter().collect();
    sorted.sort_by_key(|t| (t.pid, t.tid));
    let mut last = None;
    for t in sorted {
        if last != Some(t.pid) {
            let n = threads.iter().filter(|x| x.pid == t.pid).count();
            let _ = writeln!(
                out,
                "pid {} {} (uid {}): {n} registered thread{}",
                t.pid,
                t.process,
                t.uid,
                if n == 1 { "" } else { "s" }
            );
            let _ = writeln!(out, "  {:>8}  {:<16} {:>9} {:>12} {:>6}", "tid", "name", "keyspace", "cpu (s)", "slot");
            last = Some(t.pid);
        }
        let ks = t.keyspace.map_or("-".to_string(), |k| k.to_string());
        let _ = writeln!(out, "  {:>8}  {:<16} {:>9} {:>12.3} {:>6}", t.tid, t.name, ks, t.cpu_seconds, t.slot);
    }
    out
}
