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

/// The `reader-server` binary of the governor-reader crate (READER_SERVER_BIN overrides).
pub fn reader_server_bin() -> PathBuf {
    std::env::var_os("READER_SERVER_BIN").map(PathBuf::from).unwrap_or_else(|| profile_dir().join("reader-server"))
}

/// The `demo` binary (DEMO_BIN overrides).
pub fn demo_bin() -> PathBuf {
    std::env::var_os("DEMO_BIN").map(PathBuf::from).unwrap_or_else(|| profile_dir().join("demo"))
}

/// One `GET /metrics` from the agent's exporter at `addr`: the raw reply.
pub fn scrape_metrics(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").expect("request sent");
    let mut raw = String::new();
    s.read_to_string(&mut raw).expect("reply read");
    raw
}

/// `root` and every process below it, from `/proc/<pid>/stat`.
pub fn process_tree(root: u32) -> std::collections::BTreeSet<u32> {
    let mut parent = std::collections::HashMap::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        if let Some(pp) = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<u32>().ok()) {
            parent.insert(pid, pp);
        }
    }
    let mut out = std::collections::BTreeSet::from([root]);
    loop {
        let more: Vec<u32> = parent.iter().filter(|(p, pp)| out.contains(pp) && !out.contains(p)).map(|(p, _)| *p).collect();
        if more.is_empty() {
            return out;
        }
        out.extend(more);
    }
}

pub mod fake_pd;

/// What `promtool check metrics` finds wrong with an exposition. The seeds
/// name their bucket gauges in µs (`…_us`), which promtool's naming lint
/// flags; those names are kept verbatim on purpose. Anything else promtool
/// says (format, types, help, duplicates) is a problem.
pub fn promtool_check(exposition: &str) -> Vec<String> {
    use std::io::Write;
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool is installed (cargo xtask setup)");
    promtool.stdin.take().unwrap().write_all(exposition.as_bytes()).unwrap();
    let out = promtool.wait_with_output().unwrap();
    let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let mut problems: Vec<String> = report
        .lines()
        .filter(|l| !l.trim().is_empty())
        .filter(|l| !(l.contains("metric names should not contain abbreviated units") && l.contains("_us")))
        .map(str::to_string)
        .collect();
    if !out.status.success() && !report.contains("abbreviated units") {
        problems.push(format!("promtool failed: {report}"));
    }
    problems
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
    measure: String,
    config: Option<PathBuf>,
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
        let config = match config {
            Some(text) => {
                let cfg = dir.0.join("governor.toml");
                std::fs::write(&cfg, text)?;
                Some(cfg)
            }
            None => None,
        };
        let child = Self::launch(measure, &socket, config.as_deref(), &log)?;
        let mut agent = Agent { child, socket, log, measure: measure.to_string(), config, _dir: dir };
        agent.wait_ready()?;
        Ok(agent)
    }

    fn launch(measure: &str, socket: &Path, config: Option<&Path>, log: &Path) -> Result<Child> {
        let mut cmd = Command::new(governor_bin());
        // /metrics on any free port: agents of different tests (and a
        // demo running beside them) never collide; status says which.
        cmd.args(["agent", "--measure", measure, "--metrics-addr", "127.0.0.1:0", "--socket"]).arg(socket);
        if let Some(cfg) = config {
            cmd.arg("--config").arg(cfg);
        }
        let log = std::fs::OpenOptions::new().create(true).append(true).open(log)?;
        cmd.stdout(Stdio::null()).stderr(log).spawn().with_context(|| format!("spawning {}", governor_bin().display()))
    }

    fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            // Ready once it answers: its programs are attached and its
            // start-up work is over (a bare connect succeeds earlier).
            if self.socket.exists() && self.status().is_ok() {
                return Ok(());
            }
            if let Some(st) = self.child.try_wait()? {
                bail!("agent exited with {st}: {}", std::fs::read_to_string(&self.log).unwrap_or_default());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!("agent did not open {} in 20 s", self.socket.display())
    }

    /// Kills the agent with SIGKILL, as a crash would, and reaps it.
    pub fn kill9(&mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    /// Starts the agent again on the same socket and configuration.
    pub fn restart(&mut self) -> Result<()> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = Self::launch(&self.measure, &self.socket, self.config.as_deref(), &self.log)?;
        self.wait_ready()
    }

    /// Stops the agent (SIGTERM, as an operator would) and starts it again
    /// on the same socket with `config` (TOML text) as its configuration.
    pub fn restart_with_config(&mut self, config: &str) -> Result<()> {
        self.stop()?;
        let cfg = self._dir.0.join("governor.toml");
        std::fs::write(&cfg, config).with_context(|| format!("writing {}", cfg.display()))?;
        self.config = Some(cfg);
        self.child = Self::launch(&self.measure, &self.socket, self.config.as_deref(), &self.log)?;
        self.wait_ready()
    }

    /// SIGTERM, then SIGKILL if it has not exited within 5 s; reaps it.
    fn stop(&mut self) -> Result<()> {
        unsafe_kill(self.child.id() as i32, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.child.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        self.child.wait()?;
        Ok(())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The configuration file the agent was started with, if any.
    pub fn config_path(&self) -> Option<&Path> {
        self.config.as_deref()
    }

    /// Sends `signal` to the agent.
    pub fn signal(&self, signal: i32) {
        unsafe_kill(self.child.id() as i32, signal);
    }

    pub fn status(&self) -> Result<StatusReport> {
        Ok(governor::cli::status::run(&self.socket)?)
    }

    /// Charged CPU seconds of `keyspace_id` (0 when never charged).
    pub fn keyspace_seconds(&self, keyspace_id: u32) -> Result<f64> {
        Ok(self.status()?.keyspaces.iter().find(|k| k.keyspace_id == keyspace_id).map_or(0.0, |k| k.cpu_seconds))
    }

    /// Samples a keyspace's charged CPU about every second for `n` windows:
    /// the CPU per wall second (cores) of each window.
    pub fn sample_rates(&self, keyspace: u32, n: usize) -> Result<Vec<f64>> {
        let mut rates = Vec::new();
        let mut last = (Instant::now(), self.keyspace_seconds(keyspace)?);
        for _ in 0..n {
            std::thread::sleep(Duration::from_secs(1));
            let now = (Instant::now(), self.keyspace_seconds(keyspace)?);
            rates.push((now.1 - last.1) / (now.0 - last.0).as_secs_f64());
            last = now;
        }
        Ok(rates)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // Ask politely first so it removes its socket, then make sure.
        let _ = self.stop();
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

/// Runs the demo binary with `--json` and `args`, drawing its SVG at
/// `svg`; its JSON result. The error carries its progress and logs.
pub fn run_demo(args: &[&str], svg: &Path) -> Result<serde_json::Value> {
    let out = Command::new(demo_bin())
        .arg("--json")
        .args(args)
        .arg("--svg")
        .arg(svg)
        .output()
        .with_context(|| format!("running {}", demo_bin().display()))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!("the demo failed with {}:\n{stderr}", out.status);
    }
    serde_json::from_slice(&out.stdout).with_context(|| format!("the demo's output is not JSON; it said:\n{stderr}"))
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

/// The Essential profile (tenant-cpu-cap.md §4.1) with a tenant cap of
/// `ratio` of the node's cores.
pub fn essential_config(ratio: f64) -> String {
    format!(
        "[resource-control]\nmax-read-cpu-ratio = 0.6\n[resource-control.cpu-throttle]\nenabled = true\n\
         enforce-global-limit = true\ntenant-max-cpu-ratio = {ratio}\nenable-burst = false\n\
         enable-fair-allocation = false\nenable-dynamic-adjustment = false\n[agent]\nmax-threads = 256\n"
    )
}

/// A `workload hold` process: a client that takes tickets on command, one
/// JSON reply per command line.
pub struct Holder {
    child: Child,
    stdin: std::process::ChildStdin,
    out: BufReader<std::process::ChildStdout>,
}

impl Holder {
    pub fn start(socket: &Path) -> Holder {
        let mut child = Command::new(workload_bin())
            .args(["hold", "--socket"])
            .arg(socket)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting workload hold");
        let stdin = child.stdin.take().expect("stdin");
        let out = BufReader::new(child.stdout.take().expect("stdout"));
        Holder { child, stdin, out }
    }

    /// Sends one command and returns its reply.
    pub fn say(&mut self, cmd: &str) -> serde_json::Value {
        use std::io::Write;
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{cmd}: {line:?}: {e}"))
    }

    /// `Ok(())` when admitted, else the refusal's code.
    pub fn acquire(&mut self, keyspace: u32, write_bytes: u64) -> Result<(), String> {
        let r = self.say(&format!("acquire {keyspace} {write_bytes}"));
        if r["ok"] == true { Ok(()) } else { Err(r["refused"].as_str().unwrap_or("?").to_string()) }
    }

    /// SIGKILL, and reap it.
    pub fn kill9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        use std::io::Write;
        let _ = writeln!(self.stdin, "exit");
        let _ = self.child.wait();
    }
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

/// The kernel's count of a thread's on-CPU ns (`/proc/<pid>/task/<tid>/schedstat`,
/// first field), read from outside the thread.
pub fn schedstat_ns(pid: u32, tid: u32) -> Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat"))
        .with_context(|| format!("schedstat of {pid}/{tid}"))?;
    text.split_whitespace().next().context("empty schedstat")?.parse().context("schedstat value")
}

/// One thread of a `workload threads` run, with the kernel's figures for
/// its tagged work.
#[derive(Clone, Debug)]
pub struct ThreadReport {
    pub tid: u32,
    pub keyspace: u32,
    pub kind: String,
    /// `CLOCK_THREAD_CPUTIME_ID` over the tagged period (inside the thread).
    pub thread_cpu_ns: u64,
    /// The client's thread clock over the same period.
    pub thread_clock_ns: u64,
    /// schedstat from outside, read while the thread waited before and after.
    pub schedstat_ns: u64,
}

/// A running `workload threads` process, driven through its protocol.
pub struct ThreadsWorkload {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
    ready: Vec<(u32, u32, String)>,
    schedstat_before: Vec<u64>,
}

impl ThreadsWorkload {
    /// Starts it and waits until every thread is registered.
    pub fn spawn(socket: &Path, args: &[&str]) -> Result<ThreadsWorkload> {
        let mut child = Command::new(workload_bin())
            .arg("threads")
            .args(args)
            .arg("--socket")
            .arg(socket)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let mut out = BufReader::new(child.stdout.take().context("stdout")?);
        let v = read_json(&mut out)?;
        let ready = v["ready"]
            .as_array()
            .with_context(|| format!("expected ready, got {v}"))?
            .iter()
            .map(|t| {
                Ok((
                    t["tid"].as_u64().context("tid")? as u32,
                    t["keyspace"].as_u64().context("keyspace")? as u32,
                    t["kind"].as_str().context("kind")?.to_string(),
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ThreadsWorkload { child, out, ready, schedstat_before: Vec::new() })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Reads every thread's schedstat, then lets them work.
    pub fn go(&mut self) -> Result<()> {
        let pid = self.pid();
        self.schedstat_before = self.ready.iter().map(|(tid, ..)| schedstat_ns(pid, *tid)).collect::<Result<_>>()?;
        self.send_line()
    }

    /// Waits for the work to end; reads schedstat again while the threads
    /// wait, then lets the process exit.
    pub fn finish(mut self) -> Result<Vec<ThreadReport>> {
        let v = read_json(&mut self.out)?;
        let worked = v["worked"].as_array().with_context(|| format!("expected worked, got {v}"))?.clone();
        let pid = self.pid();
        let mut reports = Vec::new();
        for (i, (tid, keyspace, kind)) in self.ready.iter().enumerate() {
            let w = worked.iter().find(|w| w["tid"].as_u64() == Some(*tid as u64)).context("thread result")?;
            let after = schedstat_ns(pid, *tid)?;
            reports.push(ThreadReport {
                tid: *tid,
                keyspace: *keyspace,
                kind: kind.clone(),
                thread_cpu_ns: w["thread_cpu_ns"].as_u64().context("thread_cpu_ns")?,
                thread_clock_ns: w["thread_clock_ns"].as_u64().context("thread_clock_ns")?,
                schedstat_ns: after - self.schedstat_before[i],
            });
        }
        self.send_line()?;
        let status = self.child.wait()?;
        if !status.success() {
            bail!("workload threads exited with {status}");
        }
        Ok(reports)
    }

    fn send_line(&mut self) -> Result<()> {
        use std::io::Write;
        let stdin = self.child.stdin.as_mut().context("stdin")?;
        stdin.write_all(b"go\n")?;
        stdin.flush()?;
        Ok(())
    }
}

fn read_json(out: &mut BufReader<std::process::ChildStdout>) -> Result<serde_json::Value> {
    let mut line = String::new();
    if out.read_line(&mut line)? == 0 {
        bail!("workload ended without a report");
    }
    serde_json::from_str(&line).with_context(|| format!("workload said {line:?}"))
}
