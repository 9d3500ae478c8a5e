//! Test and demo harness: runs the real agent binary and the real workload
//! binary as separate processes, and reads the agent over its socket.

use anyhow::{Context, Result, bail};
use keyspace_governor::proto::StatusReport;
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

/// A finished command's exit code, stdout and stderr, for a failed assertion.
pub fn output_text(o: &std::process::Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
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

/// An example of the keyspace-governor package (`governor/examples/`),
/// as `cargo test` builds it.
pub fn example_bin(name: &str) -> PathBuf {
    profile_dir().join("examples").join(name)
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
        let more: Vec<u32> =
            parent.iter().filter(|(p, pp)| out.contains(pp) && !out.contains(p)).map(|(p, _)| *p).collect();
        if more.is_empty() {
            return out;
        }
        out.extend(more);
    }
}

pub mod fake_pd;

/// What `promtool check metrics` finds wrong with an exposition. The seeds
/// name their bucket gauges in µs (`…_us`), which promtool's naming lint
/// flags, and the tenant-cap seed's `cpu_throttle_allocations` counter has
/// no `_total`; those names are kept verbatim on purpose. Anything else promtool
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
        // The tenant-cap seed's counter, named as the seed names it.
        .filter(|l| !(l.starts_with("cpu_throttle_allocations ") && l.contains("_total\" suffix")))
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

/// A child process killed (and reaped) when this goes, however the test
/// ends: a failed assertion leaves no load behind for the next test.
pub struct Reap(pub Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A running agent process.
pub struct Agent {
    child: Child,
    pub socket: PathBuf,
    pub log: PathBuf,
    measure: String,
    config: Option<PathBuf>,
    /// A command the agent runs under (`setpriv …`), if any.
    wrapper: Vec<String>,
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

    /// Starts the agent with `config` on `socket`, a path the caller chose
    /// (a server may be waiting on it already).
    pub fn start_on(measure: &str, config: &str, socket: &Path) -> Result<Agent> {
        Self::spawn_on(&[], measure, Some(config), Some(socket))
    }

    /// Starts the agent with `config` under `wrapper` (a command that runs
    /// the agent's command line, such as `setpriv` with another uid).
    pub fn start_under(wrapper: &[&str], measure: &str, config: &str) -> Result<Agent> {
        Self::spawn_on(wrapper, measure, Some(config), None)
    }

    fn spawn(measure: &str, config: Option<&str>) -> Result<Agent> {
        Self::spawn_on(&[], measure, config, None)
    }

    fn spawn_on(wrapper: &[&str], measure: &str, config: Option<&str>, socket: Option<&Path>) -> Result<Agent> {
        let dir = Scratch::new("agent");
        let socket = socket.map_or_else(|| dir.0.join("governor.sock"), Path::to_path_buf);
        let log = dir.0.join("agent.log");
        let config = match config {
            Some(text) => {
                let cfg = dir.0.join("governor.toml");
                std::fs::write(&cfg, config_file_text(text))?;
                Some(cfg)
            }
            None => None,
        };
        let wrapper: Vec<String> = wrapper.iter().map(|w| w.to_string()).collect();
        let child = Self::launch(&wrapper, measure, &socket, config.as_deref(), &log)?;
        let mut agent = Agent { child, socket, log, measure: measure.to_string(), config, wrapper, _dir: dir };
        agent.wait_ready()?;
        Ok(agent)
    }

    fn launch(wrapper: &[String], measure: &str, socket: &Path, config: Option<&Path>, log: &Path) -> Result<Child> {
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(governor_bin());
                c
            }
            None => Command::new(governor_bin()),
        };
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
        self.child = Self::launch(&self.wrapper, &self.measure, &self.socket, self.config.as_deref(), &self.log)?;
        self.wait_ready()
    }

    /// Stops the agent (SIGTERM, as an operator would) and starts it again
    /// on the same socket with `config` (TOML text) as its configuration.
    pub fn restart_with_config(&mut self, config: &str) -> Result<()> {
        self.stop()?;
        let cfg = self._dir.0.join("governor.toml");
        std::fs::write(&cfg, config_file_text(config)).with_context(|| format!("writing {}", cfg.display()))?;
        self.config = Some(cfg);
        self.child = Self::launch(&self.wrapper, &self.measure, &self.socket, self.config.as_deref(), &self.log)?;
        self.wait_ready()
    }

    /// SIGTERM, then SIGKILL if it has not exited within 5 s; reaps it.
    pub fn stop(&mut self) -> Result<()> {
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
        Ok(keyspace_governor::cli::status::run(&self.socket)?)
    }

    /// The registered threads, as `governor threads --json` lists them.
    pub fn threads(&self) -> Result<Vec<keyspace_governor::proto::ThreadInfo>> {
        Ok(keyspace_governor::cli::threads::run(&self.socket)?)
    }

    /// Charged CPU seconds of `keyspace_id` (0 when never charged).
    pub fn keyspace_seconds(&self, keyspace_id: u32) -> Result<f64> {
        Ok(self.status()?.keyspaces.iter().find(|k| k.keyspace_id == keyspace_id).map_or(0.0, |k| k.cpu_seconds))
    }

    /// Samples a keyspace's charged CPU about every second for `n` windows:
    /// the CPU per wall second (cores) of each window.
    pub fn sample_rates(&self, keyspace: u32, n: usize) -> Result<Vec<f64>> {
        Ok(self.sample_windows(keyspace, n, None)?.into_iter().map(|w| w.cores).collect())
    }

    /// Samples a keyspace about every second for `n` windows: its charged
    /// CPU, its admissions and how many of them waited in line, and (given
    /// a process) the process's own CPU by schedstat over the same window.
    pub fn sample_windows(&self, keyspace: u32, n: usize, process: Option<u32>) -> Result<Vec<Window>> {
        let sample = || -> Result<Sample> {
            let s = self.status()?;
            let k = s.keyspaces.iter().find(|k| k.keyspace_id == keyspace);
            Ok(Sample {
                at: s.counters_read_at_ns as f64 / 1e9,
                charged: k.map_or(0.0, |k| k.cpu_seconds),
                granted: k.map_or(0, |k| k.granted),
                waited: k.map_or(0, |k| k.waited),
                process: process.map_or(0.0, |p| process_schedstat_ns(p) as f64 / 1e9),
                steal: steal_ns() as f64 / 1e9,
            })
        };
        let s_cores = f64::from(self.status()?.logical_cores);
        let mut windows = Vec::new();
        let mut last = sample()?;
        for _ in 0..n {
            std::thread::sleep(Duration::from_secs(1));
            let now = sample()?;
            let secs = now.at - last.at;
            windows.push(Window {
                cores: (now.charged - last.charged) / secs,
                granted: now.granted - last.granted,
                waited: now.waited - last.waited,
                process_cores: (now.process - last.process) / secs,
                steal_pct: (now.steal - last.steal) / (secs * s_cores) * 100.0,
            });
            last = now;
        }
        Ok(windows)
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
    let child = Command::new(workload_bin()).args(args).arg("--socket").arg(socket).stdout(Stdio::piped()).spawn()?;
    once_started(child)
}

/// A workload spawned with its stdout piped, once it printed `started`.
fn once_started(mut child: Child) -> Result<(Child, BufReader<std::process::ChildStdout>)> {
    let mut out = BufReader::new(child.stdout.take().context("stdout")?);
    let mut line = String::new();
    out.read_line(&mut line)?;
    if line.trim() != "started" {
        bail!("workload said {line:?} instead of started");
    }
    Ok((child, out))
}

/// The `tickets` workload on keyspaces `first..first+n` (4 threads, 1 ms
/// of work per ticket, 2 s deadlines) for `seconds`: the full-table load.
pub fn spawn_keyspaces_load(
    socket: &Path,
    first: &str,
    n: &str,
    seconds: &str,
) -> Result<(Child, BufReader<std::process::ChildStdout>)> {
    spawn_workload_started(
        socket,
        &[
            "tickets",
            "--keyspace",
            first,
            "--keyspaces",
            n,
            "--threads",
            "4",
            "--seconds",
            seconds,
            "--work-us",
            "1000",
            "--timeout-ms",
            "2000",
        ],
    )
}

/// The Essential profile (tenant-cpu-cap.md §4.1) with a tenant cap of
/// `ratio` of the node's cores.
pub fn essential_config(ratio: f64) -> String {
    format!(
        "[resource-control]\nmax-read-cpu-ratio = 0.6\n[resource-control.cpu-throttle]\nprofile = \"essential\"\n\
         tenant-max-cpu-ratio = {ratio}\n[agent]\nmax-threads = 256\n"
    )
}

/// This process's async waiter thread (`governor-waiter`) by schedstat:
/// (on-CPU ns, times it ran); zeros before it started.
pub fn waiter_schedstat() -> (u64, u64) {
    waiter_schedstat_of("self")
}

/// [`waiter_schedstat`] of process `pid` (a number, or `self`).
pub fn waiter_schedstat_of(pid: &str) -> (u64, u64) {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return (0, 0) };
    for t in tasks.flatten() {
        if std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "governor-waiter") {
            let stat = std::fs::read_to_string(t.path().join("schedstat")).unwrap_or_default();
            let f: Vec<u64> = stat.split_whitespace().filter_map(|v| v.parse().ok()).collect();
            return (f.first().copied().unwrap_or(0), f.get(2).copied().unwrap_or(0));
        }
    }
    (0, 0)
}

/// A tenant cap of `ratio` and nothing else that moves tokens: no burst,
/// fair, dynamic or runtime allocation, fixed estimates; the global limit
/// enforced. A line's wait is then the cap's refill alone.
pub fn bare_cap_config(ratio: f64) -> String {
    format!(
        "[resource-control.cpu-throttle]\nenabled = true\nenforce-global-limit = true\n\
         tenant-max-cpu-ratio = {ratio}\nenable-burst = false\nenable-fair-allocation = false\n\
         enable-dynamic-adjustment = false\nenable-runtime-token-management = false\n\
         enable-adaptive-estimated-cpu-per-request-us = false\n"
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
        Self::spawn(Command::new(workload_bin()), socket)
    }

    /// [`Holder::start`] as user `uid` (group `uid`, no other groups).
    pub fn start_as(socket: &Path, uid: u32) -> Holder {
        let mut cmd = Command::new("setpriv");
        cmd.args(["--reuid", &uid.to_string(), "--regid", &uid.to_string(), "--clear-groups"]).arg(workload_bin());
        Self::spawn(cmd, socket)
    }

    fn spawn(mut cmd: Command, socket: &Path) -> Holder {
        let mut child = cmd
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

/// The machine's steal since it started: what the hypervisor ran instead
/// of this machine while it wanted to run. The kernel's count leaves it
/// out; the thread clock counts it within a slice (docs/testing.md), so a
/// split between tags, or a ticket's consumption, may be off by it.
pub struct Steal {
    ns: u64,
    at: Instant,
}

impl Steal {
    pub fn start() -> Steal {
        Steal { ns: steal_ns(), at: Instant::now() }
    }

    /// Steal since the start as a share of all the machine's CPU since, as
    /// a fraction (0.01: 1 %), at /proc/stat's resolution of a tick.
    pub fn share(&self) -> f64 {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        (steal_ns() - self.ns) as f64 / (self.at.elapsed().as_secs_f64() * 1e9 * cores)
    }
}

/// A configuration's text as a file: one of blanks only (the defaults) says
/// so in a comment, as the agent wants it (it refuses an empty file).
fn config_file_text(text: &str) -> String {
    if text.trim().is_empty() { "# the defaults\n".into() } else { text.into() }
}

/// The kernel's count of a thread's on-CPU ns (`/proc/<pid>/task/<tid>/schedstat`,
/// first field), read from outside the thread.
pub fn schedstat_ns(pid: u32, tid: u32) -> Result<u64> {
    Ok(schedstat_pair(pid, tid)?.0)
}

/// A thread's schedstat: on-CPU ns and run-queue wait ns.
pub fn schedstat_pair(pid: u32, tid: u32) -> Result<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat"))
        .with_context(|| format!("schedstat of {pid}/{tid}"))?;
    let mut fields = text.split_whitespace().map(|f| f.parse::<u64>().context("schedstat value"));
    Ok((fields.next().context("empty schedstat")??, fields.next().context("no run-queue field in schedstat")??))
}

/// Waits until `ok` holds, polling every 10 ms, for at most 10 s (then
/// panics naming `what`): for what the agent does in its own time (moving
/// a process, reading an event), instead of a sleep that guesses how long
/// that takes on a busy machine.
pub fn eventually(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ok() {
        assert!(Instant::now() < deadline, "not within 10 s: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// This thread's on-CPU and run-queue-wait ns so far (its schedstat).
pub fn thread_schedstat() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let mut f = text.split_whitespace().map(|v| v.parse().unwrap_or(0));
    (f.next().unwrap_or(0), f.next().unwrap_or(0))
}

/// A stretch of one thread's time, split the scheduler's way: on a CPU,
/// runnable but waiting for one, and asleep (the rest).
#[derive(Clone, Copy, Debug, Default)]
pub struct Stretch {
    pub wall: Duration,
    pub oncpu_ns: u64,
    pub runqueue_ns: u64,
    start: Option<(Instant, u64, u64)>,
}

impl Stretch {
    pub fn start() -> Stretch {
        let (cpu, wait) = thread_schedstat();
        Stretch { start: Some((Instant::now(), cpu, wait)), ..Stretch::default() }
    }

    pub fn end(self) -> Stretch {
        let (t0, cpu0, wait0) = self.start.expect("started");
        let wall = t0.elapsed();
        let (cpu, wait) = thread_schedstat();
        Stretch { wall, oncpu_ns: cpu - cpu0, runqueue_ns: wait - wait0, start: None }
    }

    /// Time the thread spent in our hands: on a CPU or asleep, not the
    /// time it was runnable but the machine had no CPU for it (another
    /// process spins on one of two cores, say).
    pub fn held(&self) -> Duration {
        self.wall.saturating_sub(Duration::from_nanos(self.runqueue_ns))
    }

    pub fn max(self, other: Stretch) -> Stretch {
        if other.held() > self.held() { other } else { self }
    }
}

impl std::fmt::Display for Stretch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let asleep = (self.wall.as_nanos() as u64).saturating_sub(self.oncpu_ns + self.runqueue_ns);
        write!(
            f,
            "{:?} ({} µs on a CPU, {} µs runnable waiting for one, {} µs asleep)",
            self.wall,
            self.oncpu_ns / 1000,
            self.runqueue_ns / 1000,
            asleep / 1000
        )
    }
}

/// The cgroup (relative path) of `pid` in the hierarchy with the cpu
/// controller: the v1 `cpu` one on a hybrid host, else v2.
pub fn cpu_cgroup(pid: u32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let v1 = text.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, c, p) = (f.next()?, f.next()?, f.next()?);
        c.split(',').any(|c| c == "cpu").then(|| p.to_string())
    });
    v1.or_else(|| text.lines().find_map(|l| l.strip_prefix("0::").map(str::to_string)))
}

/// Where the hierarchy with the cpu controller is mounted.
pub fn cpu_hierarchy() -> std::path::PathBuf {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let mount = mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let cpu_v1 = f[2] == "cgroup" && f[3].split(',').any(|o| o == "cpu");
            let v2 = f[2] == "cgroup2"
                && std::fs::read_to_string(format!("{}/cgroup.controllers", f[1])).unwrap_or_default().contains("cpu");
            (cpu_v1 || v2).then(|| f[1].to_string())
        })
        .next_back()
        .unwrap();
    std::path::PathBuf::from(mount)
}

/// The CFS bandwidth settings of a cgroup directory, as written there.
pub fn bandwidth(dir: &std::path::Path) -> String {
    ["cpu.max", "cpu.cfs_quota_us", "cpu.cfs_period_us"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(dir.join(f)).ok())
        .map(|v| v.trim().to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

/// A cgroup of this test in the hierarchy with the cpu controller, with a
/// CFS bandwidth limit; removed when dropped (its processes gone first).
pub struct CpuCgroup {
    pub dir: PathBuf,
}

impl CpuCgroup {
    /// `/governor-test-<tag>-<pid>`, limited to `cores`.
    pub fn new(tag: &str, cores: f64) -> CpuCgroup {
        let dir = cpu_hierarchy().join(format!("governor-test-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        let g = CpuCgroup { dir };
        g.limit(cores);
        g
    }

    /// Sets the limit to `cores` (period 100 ms), on either cgroup version.
    pub fn limit(&self, cores: f64) {
        let quota = (cores * 100_000.0).round() as u64;
        if self.dir.join("cpu.max").exists() {
            std::fs::write(self.dir.join("cpu.max"), format!("{quota} 100000")).unwrap();
        } else {
            std::fs::write(self.dir.join("cpu.cfs_period_us"), "100000").unwrap();
            std::fs::write(self.dir.join("cpu.cfs_quota_us"), quota.to_string()).unwrap();
        }
    }

    /// The workload with `args`, started inside this cgroup; returned once
    /// it printed `started`.
    pub fn spawn_workload(
        &self,
        socket: &Path,
        args: &[&str],
    ) -> Result<(Child, BufReader<std::process::ChildStdout>)> {
        let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
        let script = format!(
            "echo $$ > '{}/cgroup.procs' && exec '{}' {} --socket '{}'",
            self.dir.display(),
            workload_bin().display(),
            quoted.join(" "),
            socket.display()
        );
        once_started(Command::new("sh").arg("-c").arg(script).stdout(Stdio::piped()).spawn()?)
    }
}

impl Drop for CpuCgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() || !self.dir.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// One window of [`Agent::sample_windows`].
#[derive(Clone, Copy, Debug)]
pub struct Window {
    /// The keyspace's charged CPU, cores.
    pub cores: f64,
    /// Its admissions, and those that waited in line for tokens.
    pub granted: u64,
    pub waited: u64,
    /// The given process's CPU by schedstat, cores (0 without one).
    pub process_cores: f64,
    /// The machine's steal time, as a share of all its CPU, %: tickets pay
    /// by the thread clock, which counts what the hypervisor stole within a
    /// slice, so a capped tenant gets about that much less of the kernel's
    /// CPU for its tokens.
    pub steal_pct: f64,
}

struct Sample {
    /// When the agent read its counters, CLOCK_MONOTONIC s.
    at: f64,
    charged: f64,
    granted: u64,
    waited: u64,
    process: f64,
    steal: f64,
}

/// Σ schedstat of every thread of `pid` (0 once it is gone).
pub fn process_schedstat_ns(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|t| {
            std::fs::read_to_string(t.path().join("schedstat")).ok()?.split_whitespace().next()?.parse::<u64>().ok()
        })
        .sum()
}

/// Whether thread `tid` of this process sleeps in a futex wait now (a
/// ticket waiter in line, a thread at a barrier), by its
/// `/proc/self/task/<tid>/syscall`.
pub fn blocked_in_futex(tid: u32) -> bool {
    let text = std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall")).unwrap_or_default();
    text.split_whitespace().next().and_then(|n| n.parse::<i64>().ok()) == Some(libc::SYS_futex)
}

/// Stops every process in `pids` (SIGSTOP) and waits until each of their
/// threads has stopped: switched out, so the kernel's count of it, and
/// every charge the agent makes for it, hold still until [`resume`].
/// A test reads both sides at such a moment instead of sleeping and
/// hoping the moment has come.
pub fn stop(pids: &std::collections::BTreeSet<u32>) -> Result<()> {
    signal_all(pids, libc::SIGSTOP);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let running: Vec<String> = pids
            .iter()
            .flat_map(|pid| {
                let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten();
                tasks.filter_map(move |t| {
                    let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
                    let state = stat.rsplit_once(')')?.1.split_whitespace().next()?.to_string();
                    // Stopped, or gone (zombie, dead): either way off the CPU for good.
                    (!matches!(state.as_str(), "T" | "t" | "Z" | "X"))
                        .then(|| format!("{pid}/{}: {state}", t.file_name().to_string_lossy()))
                })
            })
            .collect();
        if running.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("threads still not stopped 10 s after SIGSTOP: {running:?}");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Lets processes [`stop`]ped go on (SIGCONT).
pub fn resume(pids: &std::collections::BTreeSet<u32>) {
    signal_all(pids, libc::SIGCONT);
}

/// Sends `sig` to every process of `pids`.
pub fn signal_all(pids: &std::collections::BTreeSet<u32>, sig: i32) {
    for &p in pids {
        #[allow(unsafe_code)]
        // SAFETY: kill(2) on pids of processes the test started.
        unsafe {
            libc::kill(p as i32, sig)
        };
    }
}

/// One thread of a `workload threads` run, with the kernel's figures for
/// its tagged span.
#[derive(Clone, Debug)]
pub struct ThreadReport {
    pub tid: u32,
    pub keyspace: u32,
    pub kind: String,
    /// Its work by `CLOCK_THREAD_CPUTIME_ID` and by the client's thread
    /// clock, read inside the thread around the work.
    pub thread_cpu_ns: u64,
    pub thread_clock_ns: u64,
    /// The kernel's count (schedstat) between the two stops of
    /// [`run_threads`]: all of its tagged span, the work and the moments
    /// around it.
    pub schedstat_ns: u64,
    /// The kernel's run-queue wait (schedstat's second field) over the
    /// same span.
    pub schedstat_wait_ns: u64,
    /// How far the thread's charges ran ahead of the kernel's count at the
    /// first and at the second stop (`governor threads`' `charged_ahead_ns`):
    /// a slice split between tags while the hypervisor stole from its CPU
    /// is charged ahead, and the kernel's count pays that back later.
    pub charged_ahead_before_ns: u64,
    pub charged_ahead_after_ns: u64,
}

impl ThreadReport {
    /// What the thread's tag was charged in the span if the charges are the
    /// kernel's count: its schedstat, less what was charged ahead before the
    /// span (paid back by the span's count), plus what the span charged
    /// ahead.
    pub fn kernel_charge_ns(&self) -> f64 {
        self.schedstat_ns as f64 - self.charged_ahead_before_ns as f64 + self.charged_ahead_after_ns as f64
    }
}

/// What [`run_threads_measured`] saw: every thread's report, and each
/// keyspace's charged CPU and run-queue wait between the two stops (ns).
#[derive(Clone, Debug)]
pub struct ThreadsRun {
    pub reports: Vec<ThreadReport>,
    pub cpu_ns: std::collections::BTreeMap<u32, f64>,
    pub wait_ns: std::collections::BTreeMap<u32, f64>,
    /// Time during which at least one of the keyspace's threads waited
    /// (its "some" pressure), ns.
    pub some_ns: std::collections::BTreeMap<u32, f64>,
    /// The machine's steal from the start of the run to its second stop
    /// ([`steal_ns`], at its resolution of a tick per CPU).
    pub steal_ns: u64,
    /// Wall time from the resume after the first stop to the second stop,
    /// ns: the span the counts cover, and more.
    pub span_ns: u64,
}

/// A `workload threads` process (see its protocol in `workload/kinds.rs`).
struct ThreadsWorkload {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
    ready: Vec<(u32, u32, String)>,
}

impl ThreadsWorkload {
    /// Starts it and waits until every thread is registered and tagged.
    fn spawn(socket: &Path, args: &[&str]) -> Result<ThreadsWorkload> {
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
        Ok(ThreadsWorkload { child, out, ready })
    }

    /// Each thread's (on-CPU ns, run-queue wait ns).
    fn schedstat(&self) -> Result<Vec<(u64, u64)>> {
        let pid = self.child.id();
        self.ready.iter().map(|(tid, ..)| schedstat_pair(pid, *tid)).collect()
    }

    fn send_line(&mut self) -> Result<()> {
        use std::io::Write;
        let stdin = self.child.stdin.as_mut().context("stdin")?;
        stdin.write_all(b"go\n")?;
        stdin.flush()?;
        Ok(())
    }
}

/// Every keyspace's charge and run-queue wait (ns) read while the
/// processes measured are stopped: once the agent's counts hold still (at
/// once on the eBPF backend, which charged each thread as it stopped; after
/// a sampling pass or two on the fallback, which reads their schedstat).
fn settled_charges(agent: &Agent) -> Result<std::collections::BTreeMap<u32, (f64, f64, f64)>> {
    let read = || -> Result<std::collections::BTreeMap<u32, (f64, f64, f64)>> {
        Ok(agent
            .status()?
            .keyspaces
            .iter()
            // The agent counts whole nanoseconds; status gives seconds, and
            // the product can land a rounding off (1031909631.0000001).
            .map(|k| {
                let ns = |s: f64| (s * 1e9).round();
                (k.keyspace_id, (ns(k.cpu_seconds), ns(k.cpu_wait_seconds), ns(k.cpu_pressure_some_seconds)))
            })
            .collect())
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = read()?;
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let now = read()?;
        // Settled when the charges and waits hold still (a pressure count
        // left open would move on: the pressure tests bound it themselves).
        let still = |a: &(f64, f64, f64), b: &(f64, f64, f64)| (a.0, a.1) == (b.0, b.1);
        if now.len() == last.len() && now.iter().all(|(k, v)| last.get(k).is_some_and(|l| still(v, l))) {
            return Ok(now);
        }
        if Instant::now() > deadline {
            let moved: Vec<_> = now.iter().filter(|(k, v)| last.get(k).is_none_or(|l| !still(v, l))).collect();
            bail!(
                "the agent's charges still moved 10 s after the processes stopped: (cpu, wait, pressure) ns {moved:?}"
            );
        }
        last = now;
    }
}

/// Runs `workload threads` processes (one per argument list) side by
/// side. Each process is stopped after its threads are tagged and before
/// they work, and again after they worked, still tagged: every thread's
/// schedstat and every keyspace's charge are read at both stops, so both
/// sides count the very same span. Returns every thread's report and the
/// charge of each keyspace between the stops (ns).
pub fn run_threads(
    agent: &Agent,
    workloads: &[&[&str]],
) -> Result<(Vec<ThreadReport>, std::collections::BTreeMap<u32, f64>)> {
    let run = run_threads_measured(agent, workloads)?;
    Ok((run.reports, run.cpu_ns))
}

/// [`run_threads`], with the run-queue waits of the same span.
pub fn run_threads_measured(agent: &Agent, workloads: &[&[&str]]) -> Result<ThreadsRun> {
    let mut procs: Vec<ThreadsWorkload> =
        workloads.iter().map(|args| ThreadsWorkload::spawn(&agent.socket, args)).collect::<Result<_>>()?;
    let steal0 = steal_ns();
    let pids: std::collections::BTreeSet<u32> = procs.iter().map(|p| p.child.id()).collect();
    stop(&pids)?;
    let charged_before = settled_charges(agent)?;
    let ahead_before = charged_ahead(agent)?;
    let before: Vec<Vec<(u64, u64)>> = procs.iter().map(ThreadsWorkload::schedstat).collect::<Result<_>>()?;
    let resumed = Instant::now();
    resume(&pids);
    for p in &mut procs {
        p.send_line()?;
    }
    let worked: Vec<serde_json::Value> = procs
        .iter_mut()
        .map(|p| {
            let v = read_json(&mut p.out)?;
            v["worked"]
                .as_array()
                .cloned()
                .map(serde_json::Value::Array)
                .with_context(|| format!("expected worked, got {v}"))
        })
        .collect::<Result<_>>()?;
    stop(&pids)?;
    let span_ns = resumed.elapsed().as_nanos() as u64;
    let charged_after = settled_charges(agent)?;
    let ahead_after = charged_ahead(agent)?;
    let after: Vec<Vec<(u64, u64)>> = procs.iter().map(ThreadsWorkload::schedstat).collect::<Result<_>>()?;
    let steal = steal_ns() - steal0;
    resume(&pids);
    let mut reports = Vec::new();
    for (p, ((w, b), a)) in procs.iter().zip(worked.iter().zip(&before).zip(&after)) {
        for (i, (tid, keyspace, kind)) in p.ready.iter().enumerate() {
            let w = w
                .as_array()
                .into_iter()
                .flatten()
                .find(|w| w["tid"].as_u64() == Some(*tid as u64))
                .context("thread result")?;
            reports.push(ThreadReport {
                tid: *tid,
                keyspace: *keyspace,
                kind: kind.clone(),
                thread_cpu_ns: w["thread_cpu_ns"].as_u64().context("thread_cpu_ns")?,
                thread_clock_ns: w["thread_clock_ns"].as_u64().context("thread_clock_ns")?,
                schedstat_ns: a[i].0 - b[i].0,
                schedstat_wait_ns: a[i].1 - b[i].1,
                charged_ahead_before_ns: ahead_before.get(tid).copied().context("registered at the first stop")?,
                charged_ahead_after_ns: ahead_after.get(tid).copied().context("registered at the second stop")?,
            });
        }
    }
    for p in &mut procs {
        p.send_line()?;
        let status = p.child.wait()?;
        if !status.success() {
            bail!("workload threads exited with {status}");
        }
    }
    let since = |pick: fn(&(f64, f64, f64)) -> f64| {
        charged_after
            .iter()
            .map(|(k, v)| (*k, pick(v) - charged_before.get(k).map_or(0.0, pick)))
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    Ok(ThreadsRun {
        reports,
        cpu_ns: since(|v| v.0),
        wait_ns: since(|v| v.1),
        some_ns: since(|v| v.2),
        steal_ns: steal,
        span_ns,
    })
}

/// Every registered thread's `charged_ahead_ns`, by tid.
fn charged_ahead(agent: &Agent) -> Result<std::collections::BTreeMap<u32, u64>> {
    Ok(agent.threads()?.into_iter().map(|t| (t.tid, t.charged_ahead_ns)).collect())
}

fn read_json(out: &mut BufReader<std::process::ChildStdout>) -> Result<serde_json::Value> {
    let mut line = String::new();
    if out.read_line(&mut line)? == 0 {
        bail!("workload ended without a report");
    }
    serde_json::from_str(&line).with_context(|| format!("workload said {line:?}"))
}
