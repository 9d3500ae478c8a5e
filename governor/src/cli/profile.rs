//! `governor profile`: per-keyspace CPU profiles, as folded stacks, a
//! flame graph (SVG) or pprof, from the samples the agent's kernel program
//! took (see `agent::profile`).

use super::CliError;
use crate::client;
use crate::proto::{ProfileReport, Reply, Request};
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

/// What to sample.
pub struct Ask {
    pub seconds: f64,
    pub frequency_hz: u32,
    /// One keyspace; `None`: every keyspace (or the `top` busiest, chosen
    /// by the agent, which then looks up only their symbols).
    pub keyspace: Option<u32>,
    pub top: Option<usize>,
}

/// Asks the agent for a profile and waits it out.
pub fn run(socket: &Path, ask: &Ask) -> Result<ProfileReport, CliError> {
    use crate::agent::profile::{MAX_FREQUENCY_HZ, MAX_SECONDS};
    if !(ask.seconds > 0.0 && ask.seconds <= MAX_SECONDS) {
        return Err(CliError::Usage(format!("--seconds must be in (0, {MAX_SECONDS}], got {}", ask.seconds)));
    }
    if !(1..=MAX_FREQUENCY_HZ).contains(&ask.frequency_hz) {
        return Err(CliError::Usage(format!(
            "--frequency must be 1..={MAX_FREQUENCY_HZ} Hz, got {}",
            ask.frequency_hz
        )));
    }
    // A keyspace the agent does not know would sample nothing for the
    // whole profile: said at once, as `governor keyspace ID` says it.
    if let Some(id) = ask.keyspace {
        let status = super::status::run(socket)?;
        if !status.keyspaces.iter().any(|k| k.keyspace_id == id) {
            return Err(CliError::Agent {
                message: format!(
                    "keyspace {id} is not known: no thread tagged it and no request asked for it since its cell was last evicted (`governor status` lists the {} live keyspaces)",
                    status.keyspaces.len()
                ),
            });
        }
    }
    let request = Request::Profile {
        seconds: ask.seconds,
        frequency_hz: ask.frequency_hz,
        keyspace: ask.keyspace,
        top: ask.top.map(|n| n.min(u32::MAX as usize) as u32),
    };
    // The profile's length, then symbol lookup.
    let timeout = Duration::from_secs_f64(ask.seconds) + Duration::from_secs(60);
    match client::request_within(socket, &request, timeout)? {
        Reply::Profile(r) => Ok(*r),
        other => Err(CliError::Reply { detail: format!("{other:?}") }),
    }
}

/// Folded stacks, one line each (`keyspace-ID;process;frame;… samples`,
/// with `kind-K` after the keyspace for work of a request kind): what
/// `flamegraph.pl`, inferno, speedscope and Grafana's flame graph panel
/// read.
pub fn folded(r: &ProfileReport) -> String {
    let mut out = String::new();
    for s in &r.stacks {
        let kind = if s.kind == 0 { String::new() } else { format!("kind-{};", s.kind) };
        let frames = s.frames.join(";").replace(' ', "_");
        let _ = writeln!(out, "keyspace-{};{kind}{frames} {}", s.keyspace_id, s.samples);
    }
    out
}

/// A flame graph of the folded stacks, one tower per keyspace.
pub fn svg(r: &ProfileReport) -> Result<Vec<u8>, CliError> {
    if r.stacks.is_empty() {
        return Err(CliError::Agent {
            message: format!(
                "no samples in {:.1} s: the keyspaces profiled used no CPU meanwhile, so there is no flame graph to draw (no file written)",
                r.seconds
            ),
        });
    }
    let text = folded(r);
    let mut options = inferno::flamegraph::Options::default();
    options.title = format!(
        "governor profile: {} keyspace{}, {:.1} s at {} Hz",
        r.keyspaces.len(),
        if r.keyspaces.len() == 1 { "" } else { "s" },
        r.seconds,
        r.frequency_hz
    );
    options.count_name = "samples".into();
    let mut out = Vec::new();
    inferno::flamegraph::from_lines(&mut options, text.lines(), &mut out)
        .map_err(|e| CliError::Usage(format!("no flame graph: {e}")))?;
    Ok(out)
}

/// A summary for a terminal: samples and CPU by keyspace, and each
/// keyspace's hottest frames.
pub fn render(r: &ProfileReport) -> String {
    let mut out = String::new();
    let total: u64 = r.keyspaces.iter().map(|k| k.samples).sum();
    let _ = writeln!(
        out,
        "{} samples in {:.1} s at {} Hz on {} CPUs{}",
        total,
        r.seconds,
        r.frequency_hz,
        r.cpus,
        if r.lost_stacks > 0 { format!(" ({} with a lost stack)", r.lost_stacks) } else { String::new() }
    );
    if total == 0 && r.dropped_samples == 0 {
        let _ = writeln!(out, "no samples: the keyspaces profiled used no CPU meanwhile");
    }
    if r.dropped_samples > 0 {
        let _ = writeln!(
            out,
            "{} more samples found the kernel's table of stacks full and are in no keyspace below",
            r.dropped_samples
        );
    }
    for k in &r.keyspaces {
        let _ = writeln!(
            out,
            "keyspace {}: {} samples ({:.1} %), {:.3} CPU s charged",
            k.keyspace_id,
            k.samples,
            k.samples as f64 * 100.0 / total.max(1) as f64,
            k.cpu_seconds
        );
        let mut leaves: std::collections::BTreeMap<&str, u64> = Default::default();
        let mut kinds: std::collections::BTreeMap<u8, u64> = Default::default();
        for s in r.stacks.iter().filter(|s| s.keyspace_id == k.keyspace_id) {
            if let Some(leaf) = s.frames.last() {
                *leaves.entry(leaf).or_default() += s.samples;
            }
            *kinds.entry(s.kind).or_default() += s.samples;
        }
        if kinds.keys().any(|&kind| kind != 0) {
            let shares: Vec<String> = kinds
                .iter()
                .map(|(kind, n)| {
                    let share = *n as f64 * 100.0 / k.samples.max(1) as f64;
                    if *kind == 0 { format!("no kind {share:.1} %") } else { format!("kind {kind} {share:.1} %") }
                })
                .collect();
            let _ = writeln!(out, "  by request kind: {}", shares.join(", "));
        }
        let mut leaves: Vec<_> = leaves.into_iter().collect();
        leaves.sort_by_key(|l| std::cmp::Reverse(l.1));
        for (leaf, n) in leaves.into_iter().take(5) {
            let _ = writeln!(out, "  {:>5.1} %  {leaf}", n as f64 * 100.0 / k.samples.max(1) as f64);
        }
    }
    out
}

/// The profile as pprof's protobuf (`profile.proto`, uncompressed): what
/// `go tool pprof`, Pyroscope and Grafana read. Sample values are
/// `samples/count` and `cpu/nanoseconds` (one sample is a period of
/// 1/frequency); each sample carries `keyspace` and `pid` labels (and
/// `kind`, for work of a request kind), and each
/// frame is a function of its own (no addresses: the symbols were looked
/// up on the node).
pub fn pprof(r: &ProfileReport) -> Vec<u8> {
    let mut strings: Vec<String> = vec![String::new()];
    let mut index: std::collections::HashMap<String, i64> = [(String::new(), 0)].into();
    let mut intern = |s: &str| -> i64 {
        if let Some(&i) = index.get(s) {
            return i;
        }
        strings.push(s.to_string());
        index.insert(s.to_string(), strings.len() as i64 - 1);
        strings.len() as i64 - 1
    };
    let period_ns = (1e9 / f64::from(r.frequency_hz.max(1))) as i64;
    let mut out = Vec::new();
    let value_type = |t: i64, u: i64| {
        let mut m = Vec::new();
        pb::int(&mut m, 1, t);
        pb::int(&mut m, 2, u);
        m
    };
    let (samples, count, cpu, ns) = (intern("samples"), intern("count"), intern("cpu"), intern("nanoseconds"));
    pb::bytes(&mut out, 1, &value_type(samples, count));
    pb::bytes(&mut out, 1, &value_type(cpu, ns));
    let (keyspace, pid, kind) = (intern("keyspace"), intern("pid"), intern("kind"));
    // Functions and locations: one each per distinct frame name (id = index + 1).
    let mut functions: Vec<i64> = Vec::new();
    let mut function_of: std::collections::HashMap<String, u64> = Default::default();
    for s in &r.stacks {
        let mut ids = Vec::new();
        for f in s.frames.iter().rev() {
            let id = *function_of.entry(f.clone()).or_insert_with(|| {
                functions.push(intern(f));
                functions.len() as u64
            });
            ids.push(id);
        }
        let mut m = Vec::new();
        pb::packed(&mut m, 1, ids.iter().map(|&i| i as i64));
        pb::packed(&mut m, 2, [s.samples as i64, s.samples as i64 * period_ns].into_iter());
        let mut label = Vec::new();
        pb::int(&mut label, 1, keyspace);
        pb::int(&mut label, 3, i64::from(s.keyspace_id));
        pb::bytes(&mut m, 3, &label);
        let mut label = Vec::new();
        pb::int(&mut label, 1, pid);
        pb::int(&mut label, 3, i64::from(s.pid));
        pb::bytes(&mut m, 3, &label);
        if s.kind != 0 {
            let mut label = Vec::new();
            pb::int(&mut label, 1, kind);
            pb::int(&mut label, 3, i64::from(s.kind));
            pb::bytes(&mut m, 3, &label);
        }
        pb::bytes(&mut out, 2, &m);
    }
    for (i, &name) in functions.iter().enumerate() {
        let id = i as i64 + 1;
        let mut line = Vec::new();
        pb::int(&mut line, 1, id);
        let mut loc = Vec::new();
        pb::int(&mut loc, 1, id);
        pb::bytes(&mut loc, 4, &line);
        pb::bytes(&mut out, 4, &loc);
        let mut f = Vec::new();
        pb::int(&mut f, 1, id);
        pb::int(&mut f, 2, name);
        pb::int(&mut f, 3, name);
        pb::bytes(&mut out, 5, &f);
    }
    for s in &strings {
        pb::bytes(&mut out, 6, s.as_bytes());
    }
    pb::int(&mut out, 10, (r.seconds * 1e9) as i64);
    pb::bytes(&mut out, 11, &value_type(cpu, ns));
    pb::int(&mut out, 12, period_ns);
    out
}

/// The few protobuf encodings pprof needs.
mod pb {
    fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push(v as u8 | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    /// A varint field (skipped when 0, as proto3 does).
    pub fn int(out: &mut Vec<u8>, field: u32, v: i64) {
        if v != 0 {
            varint(out, u64::from(field) << 3);
            varint(out, v as u64);
        }
    }

    /// A length-delimited field: a message, a string, bytes.
    pub fn bytes(out: &mut Vec<u8>, field: u32, b: &[u8]) {
        varint(out, u64::from(field) << 3 | 2);
        varint(out, b.len() as u64);
        out.extend_from_slice(b);
    }

    /// A packed repeated varint field.
    pub fn packed(out: &mut Vec<u8>, field: u32, vs: impl Iterator<Item = i64>) {
        let mut body = Vec::new();
        for v in vs {
            varint(&mut body, v as u64);
        }
        bytes(out, field, &body);
    }
}
