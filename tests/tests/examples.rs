//! The client's examples (`governor/examples/`) as a storage engineer runs
//! them: each example server, a real process on a real agent with eBPF,
//! serves a heavy keyspace and a light one over TCP. The heavy one is held
//! at its cap in every window and finishes every request it admitted; the
//! light one is never refused; both are charged the CPU their requests ran.
//! And the README's Rust is the examples' code, so it runs as written.

use anyhow::{Context, Result, bail};
use governor_tests::{Agent, Reap as Server, essential_config, example_bin};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const HEAVY: u32 = 81;
const LIGHT: u32 = 82;
const HEAVY_US: u64 = 5000;
const LIGHT_US: u64 = 300;
const CAP_CORES: f64 = 0.5;

/// Starts an example server on `agent`; its child and its address.
fn start(example: &str, agent: &Agent) -> Result<(Server, String)> {
    let bin = example_bin(example);
    if !bin.exists() {
        bail!("{} is missing: `cargo test --release` builds the examples", bin.display());
    }
    let mut child = Command::new(&bin).arg(&agent.socket).arg("127.0.0.1:0").stdout(Stdio::piped()).spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("stdout")?).read_line(&mut line)?;
    let addr =
        line.trim().strip_prefix("listening on ").with_context(|| format!("{example} said {line:?}"))?.to_string();
    Ok((Server(child), addr))
}

#[derive(Default, Debug)]
struct Tally {
    ok: u64,
    busy: u64,
    waited: u64,
}

/// A connection sending `keyspace cpu_us` requests, one at a time, `pause`
/// apart, until `stop`.
fn client(
    addr: String,
    keyspace: u32,
    cpu_us: u64,
    pause: Duration,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Result<Tally>> {
    std::thread::spawn(move || {
        let stream = TcpStream::connect(&addr)?;
        stream.set_nodelay(true)?;
        let mut writer = stream.try_clone()?;
        let mut reader = BufReader::new(stream);
        let mut t = Tally::default();
        while !stop.load(Ordering::Relaxed) {
            writer.write_all(format!("{keyspace} {cpu_us}\n").as_bytes())?;
            let mut reply = String::new();
            reader.read_line(&mut reply)?;
            let words: Vec<&str> = reply.split_whitespace().collect();
            match words.as_slice() {
                ["ok", waited_us, _digest] => {
                    t.ok += 1;
                    t.waited += u64::from(waited_us.parse::<u64>()? > 0);
                }
                ["busy", _reason] => t.busy += 1,
                _ => bail!("keyspace {keyspace}: the server replied {reply:?}"),
            }
            std::thread::sleep(pause);
        }
        Ok(t)
    })
}

fn governs(example: &str) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let agent = Agent::start("ebpf", &essential_config(CAP_CORES / cores)).unwrap();
    let (server, addr) = start(example, &agent).unwrap();
    let (h0, l0) = (agent.keyspace_seconds(HEAVY).unwrap(), agent.keyspace_seconds(LIGHT).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let heavy: Vec<_> = (0..3).map(|_| client(addr.clone(), HEAVY, HEAVY_US, Duration::ZERO, stop.clone())).collect();
    let light = client(addr.clone(), LIGHT, LIGHT_US, Duration::from_millis(20), stop.clone());
    std::thread::sleep(Duration::from_secs(1));
    let windows = agent.sample_windows(HEAVY, 4, Some(server.0.id())).unwrap();
    stop.store(true, Ordering::Relaxed);
    let heavy: Vec<Tally> = heavy.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
    let light = light.join().unwrap().unwrap();
    let (h1, l1) = (agent.keyspace_seconds(HEAVY).unwrap(), agent.keyspace_seconds(LIGHT).unwrap());
    let heavy_ok: u64 = heavy.iter().map(|t| t.ok).sum();
    let heavy_waited: u64 = heavy.iter().map(|t| t.waited).sum();
    let heavy_busy: u64 = heavy.iter().map(|t| t.busy).sum();
    let heavy_ran = heavy_ok as f64 * HEAVY_US as f64 / 1e6;
    let light_ran = light.ok as f64 * LIGHT_US as f64 / 1e6;
    eprintln!(
        "{example}: heavy ok {heavy_ok} (waited {heavy_waited}) busy {heavy_busy}, charged {:.3} s for {heavy_ran:.3} s of work",
        h1 - h0
    );
    eprintln!("{example}: light {light:?}, charged {:.4} s for {light_ran:.4} s of work", l1 - l0);
    for (i, w) in windows.iter().enumerate() {
        eprintln!(
            "window {i}: {:.3} cores (process {:.3}), granted {} waited {}, steal {:.1} %",
            w.cores, w.process_cores, w.granted, w.waited, w.steal_pct
        );
    }
    assert!(heavy_ok >= 100, "the heavy keyspace still completes requests at its cap: {heavy_ok}");
    assert!(heavy_waited > 0, "heavy requests waited in line: the cap held them");
    assert_eq!(light.busy, 0, "the light keyspace is never refused");
    assert!(light.ok >= 100, "light requests served: {}", light.ok);
    // Every admitted request finished: the heavy keyspace was charged the
    // work its completed requests ran, plus what admission and the
    // server's polls around it cost.
    // The work is timed by the thread clock, which counts what the host
    // stole within a slice where the kernel's count does not: the charge
    // falls short of it by up to the steal share.
    let steal = windows.iter().map(|w| w.steal_pct).fold(0.0, f64::max) / 100.0;
    let ratio = (h1 - h0) / heavy_ran;
    assert!(
        (0.98 - steal..=1.10).contains(&ratio),
        "heavy charged / its completed work: {ratio:.3} (steal up to {steal:.3})"
    );
    // A light request of 300 µs carries its admission and its polls' own
    // cost (on tokio, up to a quarter of it here).
    let ratio = (l1 - l0) / light_ran;
    assert!(
        (0.98 - steal..=1.50).contains(&ratio),
        "light charged / its completed work: {ratio:.3} (steal up to {steal:.3})"
    );
    // The cap in every window after the first, from below only where the
    // cap (not the machine) held the keyspace back.
    for (i, w) in windows.iter().enumerate().skip(1) {
        assert!(w.cores <= CAP_CORES * 1.10, "window {i}: {:.3} cores over the cap", w.cores);
        if w.waited * 2 >= w.granted && w.granted > 0 {
            let floor = CAP_CORES * (0.88 - w.steal_pct / 100.0);
            assert!(w.cores >= floor, "window {i}: {:.3} cores, held below the cap ({floor:.3})", w.cores);
        }
    }
}

#[test]
fn the_tokio_example_governs_its_keyspaces() {
    governs("tokio_server");
}

#[test]
fn the_thread_pool_example_governs_its_keyspaces() {
    governs("thread_pool_server");
}

/// Every Rust block of the README appears, line for line (indentation
/// aside), in one of the examples: what a reader copies is code this suite
/// runs.
#[test]
fn the_readme_rust_is_the_examples_code() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let dir = root.join("governor/examples");
    let mut sources = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "rs") {
            sources.push((
                path.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read_to_string(&path).unwrap(),
            ));
        }
    }
    let norm = |text: &str| text.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join("\n");
    let blocks: Vec<&str> = readme.split("```rust\n").skip(1).map(|b| b.split("```").next().unwrap()).collect();
    assert!(blocks.len() >= 2, "the README shows the examples' code: {} Rust blocks", blocks.len());
    for block in blocks {
        let want = norm(block);
        let found = sources.iter().find(|(_, src)| norm(src).contains(&want));
        assert!(found.is_some(), "this README block is in no example under governor/examples/:\n{block}");
    }
}
