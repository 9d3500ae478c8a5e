//! The operator surface under load: a `/metrics` scrape, the agent's memory
//! and its CPU with 1000 keyspaces active (each charged CPU again and again
//! by a registered thread cycling through them).

use anyhow::{Context, Result, bail};
use governor_tests::Agent;
use keyspace_governor::client::{self, Client};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

pub struct AgentLoad {
    pub keyspaces: u32,
    pub scrape_ms: f64,
    pub scrape_bytes: usize,
    pub rss_mib: f64,
    pub cpu_pct_of_core: f64,
}

fn scrape(addr: &str) -> Result<String> {
    let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")?;
    let mut body = String::new();
    s.read_to_string(&mut body)?;
    if !body.starts_with("HTTP/1.1 200") {
        bail!("scrape answered {:?}", body.lines().next());
    }
    Ok(body)
}

/// utime + stime of `pid`, seconds.
fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = stat.rsplit_once(')').context("stat")?.1;
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>()? + f[12].parse::<u64>()?;
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks as f64 / hz)
}

fn rss_mib(pid: u32) -> Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .context("VmRSS")?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?;
    Ok(kib / 1024.0)
}

pub fn agent_at_1000_keyspaces() -> Result<AgentLoad> {
    const KEYSPACES: u32 = 1000;
    let agent = Agent::start_default("ebpf")?;
    let addr = agent.status()?.metrics_addr.context("no metrics address")?;
    // A thread of its own: the harness's thread is registered elsewhere.
    let pid = agent.pid();
    let socket = agent.socket.clone();
    let cpu_pct_of_core =
        std::thread::spawn(move || charge_all(&socket, pid, KEYSPACES)).join().expect("load thread")?;
    let live = agent.status()?.keyspaces.len() as u32;
    if live < KEYSPACES {
        bail!("only {live} of {KEYSPACES} keyspaces live in the agent");
    }
    let mut times = Vec::new();
    let mut bytes = 0;
    for _ in 0..20 {
        let t = Instant::now();
        bytes = scrape(&addr)?.len();
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(AgentLoad {
        keyspaces: live,
        scrape_ms: times[times.len() / 2],
        scrape_bytes: bytes,
        rss_mib: rss_mib(agent.pid())?,
        cpu_pct_of_core,
    })
}

/// Registers, charges every keyspace, then keeps charging them all for
/// 5 s; the agent's CPU over those 5 s, % of a core.
fn charge_all(socket: &std::path::Path, agent_pid: u32, keyspaces: u32) -> Result<f64> {
    let client = Client::connect(socket)?;
    client.register_current_thread()?;
    // Every keyspace gets its cell and some CPU, then the agent is watched
    // for 5 s while the thread keeps charging all of them.
    let spin = |d: Duration| {
        let t = Instant::now();
        while t.elapsed() < d {
            std::hint::spin_loop();
        }
    };
    for ks in 1..=keyspaces {
        client::set_tag(ks)?;
        spin(Duration::from_micros(20));
    }
    let (cpu0, t0) = (cpu_seconds(agent_pid)?, Instant::now());
    let mut ks = 0;
    while t0.elapsed() < Duration::from_secs(5) {
        client::set_tag(1 + ks % keyspaces)?;
        ks += 1;
        // A quarter of a core; all of them every ~200 ms.
        spin(Duration::from_micros(50));
        if ks % 100 == 0 {
            std::thread::sleep(Duration::from_millis(15));
        }
    }
    client::clear_tag();
    Ok((cpu_seconds(agent_pid)? - cpu0) / t0.elapsed().as_secs_f64() * 100.0)
}
