//! `cargo xtask test --repeat N [--busy-cores K]`: the host suites N times
//! in a row, each test executable run as `cargo test` runs it, and a table
//! of every test that failed at least once.
//!
//! A test that fails on scheduling luck fails now and then, so one green
//! run proves little; N runs, idle and with `stress-ng --cpu K` keeping K
//! cores busy the whole time, find it before CI does. The executables are
//! built once (`cargo test --no-run`); each run of one is its output, kept
//! under `target/test-repeat/` when something in it failed, and the
//! summary (per test: runs, failures, the first failure's message) goes to
//! `target/test-repeat/summary.json`.

use crate::{cargo, root};
use anyhow::{Context, Result, bail};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One test executable of the host suites.
struct Exe {
    /// `package/target` (`governor/lib`, `governor-tests/kernel_exact`).
    name: String,
    path: PathBuf,
    /// Its package's directory: `cargo test` runs it from there.
    dir: PathBuf,
}

#[derive(Default)]
struct Tally {
    runs: u32,
    failures: u32,
    /// The first failure's panic message, a few lines.
    first: Option<String>,
}

pub fn repeat(rounds: u32, busy_cores: u32) -> Result<()> {
    let exes = executables()?;
    let out = root().join("target/test-repeat");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    let _load = (busy_cores > 0).then(|| BusyCores::start(busy_cores)).transpose()?;
    let mut tally: BTreeMap<String, Tally> = BTreeMap::new();
    let mut times = Vec::new();
    for round in 1..=rounds {
        let t0 = Instant::now();
        for exe in &exes {
            eprintln!("repeat {round}/{rounds}: {}", exe.name);
            let output = Command::new(&exe.path)
                .current_dir(&exe.dir)
                .env("CARGO_MANIFEST_DIR", &exe.dir)
                .stdin(Stdio::null())
                .output()
                .with_context(|| format!("running {}", exe.path.display()))?;
            let text =
                format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
            let results = results(&text);
            let mut failed = false;
            for (test, ok) in &results {
                let t = tally.entry(format!("{} {test}", exe.name)).or_default();
                t.runs += 1;
                if !ok {
                    failed = true;
                    t.failures += 1;
                    t.first.get_or_insert_with(|| message(&text, test));
                }
            }
            // An executable that died without a verdict for every test it
            // started (a crash, an abort) counts as a failure of its own.
            if !output.status.success() && !failed {
                failed = true;
                let t = tally.entry(format!("{} (the executable)", exe.name)).or_default();
                t.runs += 1;
                t.failures += 1;
                t.first.get_or_insert_with(|| format!("exited with {} without a failing test", output.status));
            }
            if failed {
                let log = out.join(format!("round-{round}-{}.log", exe.name.replace('/', "-")));
                std::fs::write(&log, &text)?;
                eprintln!("repeat {round}/{rounds}: {} FAILED, output in {}", exe.name, log.display());
            }
        }
        times.push(t0.elapsed());
    }

    let failing: Vec<(&String, &Tally)> = tally.iter().filter(|(_, t)| t.failures > 0).collect();
    let total_runs: u32 = tally.values().map(|t| t.runs).sum();
    eprintln!(
        "\n{} tests in {} executables, {rounds} rounds{}: {total_runs} test runs, {} failing at least once; rounds took {}",
        tally.len(),
        exes.len(),
        if busy_cores > 0 { format!(" with {busy_cores} core(s) kept busy by stress-ng") } else { String::new() },
        failing.len(),
        times.iter().map(|d| format!("{:.0} s", d.as_secs_f64())).collect::<Vec<_>>().join(", "),
    );
    for (name, t) in &failing {
        eprintln!(
            "  {name}: {} of {} runs failed\n      {}",
            t.failures,
            t.runs,
            t.first.as_deref().unwrap_or("").replace('\n', "\n      ")
        );
    }
    let summary = serde_json::json!({
        "rounds": rounds,
        "busy_cores": busy_cores,
        "tests": tally.len(),
        "test_runs": total_runs,
        "round_seconds": times.iter().map(|d| (d.as_secs_f64() * 10.0).round() / 10.0).collect::<Vec<_>>(),
        "failing": failing.iter().map(|(name, t)| serde_json::json!({
            "test": name, "runs": t.runs, "failures": t.failures, "first_failure": t.first,
        })).collect::<Vec<_>>(),
    });
    std::fs::write(out.join("summary.json"), serde_json::to_string_pretty(&summary)?)?;
    if !failing.is_empty() {
        bail!("{} tests failed at least once in {rounds} rounds (target/test-repeat/)", failing.len());
    }
    Ok(())
}

/// The test executables `cargo test --release` runs (doc tests aside), in
/// its order.
fn executables() -> Result<Vec<Exe>> {
    let mut c = cargo();
    c.args(["test", "--release", "--no-run", "--message-format=json-render-diagnostics"])
        .current_dir(root())
        .stderr(Stdio::inherit());
    let out = c.output().with_context(|| format!("starting {c:?}"))?;
    if !out.status.success() {
        bail!("{c:?} failed with {}", out.status);
    }
    let mut exes = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(m) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if m["reason"] != "compiler-artifact" || m["profile"]["test"] != true {
            continue;
        }
        let (Some(path), Some(manifest)) = (m["executable"].as_str(), m["manifest_path"].as_str()) else { continue };
        let package = m["package_id"].as_str().map_or("?", package_name);
        let kind = m["target"]["kind"][0].as_str().unwrap_or("");
        let target = m["target"]["name"].as_str().unwrap_or("?");
        exes.push(Exe {
            name: match kind {
                "lib" => format!("{package}/lib"),
                "test" => format!("{package}/{target}"),
                _ => format!("{package}/{target} ({kind})"),
            },
            path: path.into(),
            dir: PathBuf::from(manifest).parent().context("manifest directory")?.to_path_buf(),
        });
    }
    if exes.is_empty() {
        bail!("cargo test --no-run reported no test executables");
    }
    Ok(exes)
}

/// The package's name in a cargo package id: `path+file:///w/tests#governor-tests@0.1.0`,
/// or `path+file:///w/governor#0.1.0` when the name is the directory's.
fn package_name(id: &str) -> &str {
    let (path, tail) = id.rsplit_once('#').unwrap_or((id, ""));
    match tail.split_once('@') {
        Some((name, _)) => name,
        None => path.rsplit('/').next().unwrap_or(path),
    }
}

/// `(test, passed)` for every verdict line libtest printed.
fn results(text: &str) -> Vec<(String, bool)> {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("test ")?;
            let (name, verdict) = rest.rsplit_once(" ... ")?;
            match verdict.trim() {
                "ok" => Some((name.to_string(), true)),
                "FAILED" => Some((name.to_string(), false)),
                _ => None,
            }
        })
        .collect()
}

/// The panic message of `test` in libtest's failure report.
fn message(text: &str, test: &str) -> String {
    let header = format!("---- {test} stdout ----");
    let Some(start) = text.find(&header) else { return "(no captured output)".into() };
    text[start + header.len()..]
        .lines()
        .skip_while(|l| !l.contains("panicked at"))
        .take(4)
        .collect::<Vec<_>>()
        .join("\n")
}

/// `stress-ng --cpu K` for as long as this lives.
struct BusyCores(Child);

impl BusyCores {
    fn start(cores: u32) -> Result<BusyCores> {
        let child = Command::new("stress-ng")
            .args(["--cpu", &cores.to_string(), "--cpu-method", "matrixprod", "--timeout", "0", "--quiet"])
            .stdout(Stdio::null())
            .spawn()
            .context("starting stress-ng (cargo xtask setup installs it)")?;
        std::thread::sleep(Duration::from_millis(500));
        eprintln!("stress-ng --cpu {cores} (pid {}) keeps {cores} core(s) busy", child.id());
        Ok(BusyCores(child))
    }
}

impl Drop for BusyCores {
    fn drop(&mut self) {
        // SIGTERM lets stress-ng stop its workers; then reap it.
        let _ = Command::new("kill").arg(self.0.id().to_string()).status();
        let _ = self.0.wait();
    }
}
