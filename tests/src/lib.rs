//! Test and demo harness: runs the real agent binary and the real workload
//! binary as separate processes, and reads the agent over its socket.

use anyhow::{bail, Context, Result};
use governor::proto::StatusReport;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Directory of the running executable's profile (target/<profile>).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().expect("exe dir");
    // Test executables live in target/<profile>/deps.
    if dir.ends_with("deps") { dir.parent().expect("profile dir").to_path_buf() } else { dir.to_path_buf() }
}

/// The `governor` binary (GOVERNOR_BIN overrides).
pub fn governor_bin() -> PathBuf {
    std::env::var_os("GOVERNOR_BIN").map(PathBuf::from).unwrap_or_else(|| profile_dir().join("governor"))
}

/// The `workload` binary (WORKLOAD_BIN overrides).
pub fn workload_bin() -> PathBuf {
    std::env::var_os("WORKLOAD_BIN").map(PathBuf::from).unwrap_or_else(|| profile_dir().join("workload"))
}

/// A fresh scratch directory under /tmp, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "governor-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).expect("scratch dir");
        // Unprivileged agents in tests must reach it too.
        let _ = std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o777));
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running agent process.
pub struct Agent {
    child: Child,
    pub socket: PathBuf,
    pub log: PathBuf,
    _dir: Scratch,
}

impl Agent {
    /// Starts `governor agent --measure <measure>` with `config` (TOML text
    /// appended to a scratch config file) and waits for its socket.
    pub fn start(measure: &str, config: &str) -> Result<Agent> {
        Self::spawn(measure, Some(config))
    }

    /// Starts the agent on its embedded default configuration (only the
    /// socket is moved to a scratch directory).
    pub fn start_default(measure: &str) -> Result<Agent> {
        Self::spawn(measure, None)
    }

    fn spawn(measure: &str, config: Option<&str>) -> Result<Agent> {
        let dir = Scratch::new("agent");
        let socket = dir.0.join("governor.sock");
        let log = dir.0.join("agent.log");
        let mut cmd = Command::new(governor_bin());
        cmd.args(["agent", "--measure", measure, "--socket"]).arg(&socket);
        if let Some(text) = config {
            let cfg = dir.0.join("governor.toml");
            std::fs::write(&cfg, text)?;
            cmd.arg("--config").arg(&cfg);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .with_context(|| format!("spawning {}", governor_bin().display()))?;
        let mut agent = Agent { child, socket, log, _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if std::os::unix::net::UnixStream::connect(&agent.socket).is_ok() {
                return Ok(agent);
            }
            if let Some(st) = agent.child.try_wait()? {
                bail!("agent exited with {st}: {}", std::fs::read_to_string(&agent.log).unwrap_or_default());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!("agent did not open {} in 20 s", agent.socket.display())
    }

    pub fn status(&self) -> Result<StatusReport> {
        Ok(governor::cli::status::run(&self.socket)?)
    }

    /// Charged CPU seconds of `keyspace_id` (0 when never charged).
    pub fn keyspace_seconds(&self, keyspace_id: u32) -> Result<f64> {
        Ok(self.status()?.keyspaces.iter().find(|k| k.keyspace_id == keyspace_id).map_or(0.0, |k| k.cpu_seconds))
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let pid = self.child.id() as i32;
        // Ask politely first so it removes its socket, then make sure.
        unsafe_kill(pid, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[allow(unsafe_code)]
fn unsafe_kill(pid: i32, sig: i32) {
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(pid, sig) };
}

/// Runs the workload binary to completion; its last stdout line as JSON.
pub fn run_workload(socket: &Path, args: &[&str]) -> Result<serde_json::Value> {
    let out = Command::new(workload_bin()).args(args).arg("--socket").arg(socket).output()?;
    if !out.status.success() {
        bail!("workload {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8(out.stdout)?;
    let last = text.lines().last().context("workload printed nothing")?;
    Ok(serde_json::from_str(last)?)
}

/// Starts the workload and returns it once it printed `started`.
pub fn spawn_workload_started(socket: &Path, args: &[&str]) -> Result<(Child, BufReader<std::process::ChildStdout>)> {
    let mut child = Command::new(workload_bin())
        .args(args)
        .arg("--socket")
        .arg(socket)
        .stdout(Stdio::piped())
        .spawn()?;
    let mut out = BufReader::new(child.stdout.take().context("stdout")?);
    let mut line = String::new();
    out.read_line(&mut line)?;
    if line.trim() != "started" {
        bail!("workload said {line:?} instead of started");
    }
    Ok((child, out))
}

/// One USER_HZ tick in ns: the resolution of [`steal_ns`], per CPU.
pub fn steal_tick_ns() -> u64 {
    #[allow(unsafe_code)]
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    1_000_000_000 / hz
}

/// Steal time of the whole machine so far (ns), from /proc/stat: time the
/// hypervisor ran something else while a vCPU wanted to run. The eBPF
/// backend measures on CLOCK_MONOTONIC, which includes it; the threads' CPU
/// clocks exclude it. Resolution: one tick per CPU ([`steal_tick_ns`]).
pub fn steal_ns() -> u64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: u64 = stat
        .lines()
        .find(|l| l.starts_with("cpu "))
        .and_then(|l| l.split_whitespace().nth(8))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    ticks * steal_tick_ns()
}
