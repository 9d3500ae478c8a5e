//! `cargo xtask vm-test [--arch x86_64|aarch64] [--kernel 6.1]`: the eBPF
//! tests inside a VM, on a Debian kernel.
//!
//! - The kernel: the newest `linux-image-<version>…-cloud-{amd64,arm64}`
//!   package apt knows, fetched with `apt-get download` into
//!   `target/vm-cache/<arch>/` on first use. Its `vmlinuz` boots as it is:
//!   the serial console, initramfs support and BTF are built in.
//! - The guest: an initramfs (newc cpio, written here) with Debian's static
//!   busybox for the guest's architecture (fetched the same way), `governor`,
//!   `workload` and the test executables built for that architecture, the C
//!   libraries they link, and `vm_init.sh` as `/init`.
//! - One eBPF object: the host build's. The aarch64 build embeds the same
//!   file (`GOVERNOR_EBPF_OBJECT`), and each agent binary is checked to hold
//!   its exact bytes.
//! - The run: qemu with KVM when the host CPU offers hardware
//!   virtualisation, TCG otherwise; the serial console streams here. The
//!   guest prints `VM-TEST-EXIT=<code>` and powers off; that code is this
//!   task's.
//! - Every step runs once: the accounting tests' bounds compare what the
//!   guest kernel counted with what the agent charged over the same span
//!   (read with the processes stopped, or bracketing the tagged span from
//!   both sides), so an emulated vCPU's lost milliseconds fall inside both.
//!   One exception: a guest whose kernel stops altogether (its heartbeat,
//!   a line every 10 s from its user space, silent for [`SILENCE`]; seen a
//!   few times in x86_64 TCG guests, both vCPUs spinning and no RCU stall
//!   printed, and once with the kernel printing a soft lockup every 28 s,
//!   one vCPU looping on the breakpoint of a tracepoint's patch while the
//!   other, detaching the agent's program, waited for it) is stopped and
//!   booted again once, for the step it stopped in and those after. The
//!   kernel's own lines do not count as a heartbeat. A step that failed,
//!   or a test that hangs while the guest still beats, is never run again.

use crate::dist::Arch;
use crate::{cargo, cross_env, root, run};
use anyhow::{Context, Result, bail};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The integration tests that run in the guest.
const TESTS: &[&str] = &["measurement", "kernel_exact", "client_api", "cpu_wait", "profile"];
const INIT: &str = include_str!("vm_init.sh");
const MARKER: &str = "VM-TEST-EXIT=";
/// The guest's heartbeat line (`vm_init.sh`), read but not echoed.
const ALIVE: &str = "VM-TEST-ALIVE";
/// How long a guest may print nothing, heartbeat included, before its
/// kernel counts as stopped: 9 heartbeats, and 3 times the longest step.
const SILENCE: Duration = Duration::from_secs(90);

pub fn vm_test(arch: Arch, kernel: &str, only: Option<&str>) -> Result<()> {
    let t0 = Instant::now();
    crate::setup::setup(arch == Arch::Aarch64)?;
    crate::setup::vm(arch)?;
    let cache = root().join("target/vm-cache").join(arch.deb());
    std::fs::create_dir_all(&cache)?;
    let (package, vmlinuz) = kernel_image(arch, kernel, &cache)?;
    let busybox = extract(&cache, "busybox-static", arch)?.join("bin/busybox");

    // The host build first: its eBPF object is the one every agent embeds.
    let host = build(Arch::X86_64)?;
    let object = crate::host_ebpf_object()?;
    // A cross build embeds it through its environment (`cross_env`).
    let bins = if arch == Arch::X86_64 { host } else { build(arch)? };
    let bytes = std::fs::read(&object)?;
    let governor = bins.exes.get("governor").context("no governor binary")?;
    if !contains(&std::fs::read(governor)?, &bytes) {
        bail!("{} does not embed the eBPF object {}", governor.display(), object.display());
    }
    eprintln!(
        "eBPF object {} ({} bytes, sha256 {}) is embedded in {}",
        object.display(),
        bytes.len(),
        sha256(&object)?,
        governor.display()
    );

    let initramfs = cache.join("initramfs.cpio");
    std::fs::write(&initramfs, initramfs_image(arch, &busybox, &bins.exes)?)?;
    let built = t0.elapsed();
    eprintln!("initramfs {} ({} MiB)", initramfs.display(), std::fs::metadata(&initramfs)?.len() >> 20);

    let mut run = boot(arch, &vmlinuz, &initramfs, only)?;
    let mut restarts = 0;
    if let Some(step) = run.stopped_in.clone()
        && run.failed.is_none()
    {
        // Again from the step it stopped in; `None` (every default step)
        // runs them all again.
        let rest: Option<String> =
            only.map(|o| o.split(',').filter(|s| !run.done.iter().any(|d| d == s)).collect::<Vec<_>>().join(","));
        eprintln!(
            "the guest's kernel stopped in step {step} (no line, heartbeat included, for {} s): booting it again \
             for {}",
            SILENCE.as_secs(),
            rest.as_deref().unwrap_or("every step")
        );
        restarts = 1;
        run = boot(arch, &vmlinuz, &initramfs, rest.as_deref())?;
    }
    let total = t0.elapsed();
    eprintln!(
        "vm_test_seconds arch={} kernel={package} accel={} build={:.0} boot={:.1} tests={:.0} total={:.0} \
         restarts={restarts} exit={}",
        arch.name(),
        run.accel,
        built.as_secs_f64(),
        run.boot.as_secs_f64(),
        run.tests.as_secs_f64(),
        total.as_secs_f64(),
        run.code.map_or("none".to_string(), |c| c.to_string()),
    );
    match run.code {
        Some(0) => Ok(()),
        Some(code) => std::process::exit(code),
        None => bail!("the guest ended without printing {MARKER}<code>"),
    }
}

/// The newest kernel package of `version` (e.g. `6.1`) for `arch`, from
/// apt's package lists.
fn kernel_package(arch: Arch, version: &str) -> Result<String> {
    let pattern = format!("^linux-image-{}[.-][0-9].*-cloud-{}$", version.replace('.', "\\."), arch.deb());
    let out = Command::new("apt-cache").args(["search", "--names-only", &pattern]).output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let key = |name: &str| -> Vec<u64> {
        name.split(|c: char| !c.is_ascii_digit()).filter(|s| !s.is_empty()).map(|s| s.parse().unwrap_or(0)).collect()
    };
    text.lines()
        .filter_map(|l| l.split_whitespace().next())
        .max_by_key(|name| key(name))
        .map(str::to_string)
        .with_context(|| format!("apt knows no package matching {pattern} (run `apt-get update`)"))
}

/// Downloads `package` for `arch` with apt into `cache` (once) and unpacks
/// it there; returns the unpacked tree.
fn extract(cache: &Path, package: &str, arch: Arch) -> Result<PathBuf> {
    let tree = cache.join(package);
    if tree.is_dir() {
        return Ok(tree);
    }
    let find = || -> Option<PathBuf> {
        std::fs::read_dir(cache).ok()?.flatten().map(|e| e.path()).find(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with(&format!("{package}_")) && name.ends_with(&format!("_{}.deb", arch.deb()))
        })
    };
    if find().is_none() {
        let mut get = Command::new("apt-get");
        get.args(["download", &format!("{package}:{}", arch.deb())]).current_dir(cache);
        eprintln!("+ {get:?}");
        if !get.status().context("running apt-get")?.success() {
            bail!("{get:?} failed");
        }
    }
    let deb = find().with_context(|| format!("apt-get download left no {package} package in {}", cache.display()))?;
    let partial = cache.join(format!("{package}.partial"));
    let _ = std::fs::remove_dir_all(&partial);
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&partial))?;
    std::fs::rename(&partial, &tree)?;
    Ok(tree)
}

/// (package, vmlinuz) of the kernel `version` for `arch`.
fn kernel_image(arch: Arch, version: &str, cache: &Path) -> Result<(String, PathBuf)> {
    let package = kernel_package(arch, version)?;
    let boot = extract(cache, &package, arch)?.join("boot");
    let vmlinuz = std::fs::read_dir(&boot)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("vmlinuz-")))
        .with_context(|| format!("{package} holds no vmlinuz"))?;
    Ok((package, vmlinuz))
}

struct Built {
    /// Guest file name → host path: governor, workload and the tests.
    exes: BTreeMap<String, PathBuf>,
}

/// Builds governor, workload and [`TESTS`] for `arch` (a cross build embeds
/// the host's eBPF object).
fn build(arch: Arch) -> Result<Built> {
    let target = match arch {
        Arch::X86_64 => vec![],
        Arch::Aarch64 => vec!["--target", "aarch64-unknown-linux-gnu"],
    };
    let cmd = |verb: &str| -> Result<Command> {
        let mut c = if arch == Arch::X86_64 { cargo() } else { cross_env(cargo())? };
        c.arg(verb).args(["--release", "--message-format=json-render-diagnostics"]).args(&target).current_dir(root());
        Ok(c)
    };
    let mut built = Built { exes: BTreeMap::new() };
    let mut bins = cmd("build")?;
    bins.args([
        "-p",
        "keyspace-governor",
        "--features",
        "keyspace-governor/agent",
        "--bin",
        "governor",
        "-p",
        "governor-tests",
        "--bin",
        "workload",
    ]);
    let mut tests = cmd("test")?;
    tests.args(["--no-run", "-p", "governor-tests"]);
    for t in TESTS {
        tests.args(["--test", t]);
    }
    for mut c in [bins, tests] {
        eprintln!("+ {c:?}");
        let out = c.stderr(Stdio::inherit()).output().with_context(|| format!("starting {c:?}"))?;
        if !out.status.success() {
            bail!("{c:?} failed with {}", out.status);
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let Ok(m) = serde_json::from_str::<serde_json::Value>(line) else { continue };
            let name = m["target"]["name"].as_str().unwrap_or("");
            if m["reason"] == "compiler-artifact"
                && let Some(exe) = m["executable"].as_str()
                && (["governor", "workload"].contains(&name) || TESTS.contains(&name))
            {
                built.exes.insert(name.to_string(), exe.into());
            }
        }
    }
    for name in ["governor", "workload"].iter().chain(TESTS) {
        if !built.exes.contains_key(*name) {
            bail!("the {} build produced no {name}", arch.name());
        }
    }
    Ok(built)
}

pub(crate) fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

fn sha256(path: &Path) -> Result<String> {
    let out = Command::new("sha256sum").arg(path).output()?;
    Ok(String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap_or("?").to_string())
}

/// The shared libraries `elfs` need, recursively: guest path → host path.
/// The dynamic loader goes where the binaries ask for it, the rest in /lib.
fn libraries(arch: Arch, elfs: &[&PathBuf]) -> Result<BTreeMap<String, PathBuf>> {
    let dirs: &[&str] = match arch {
        Arch::X86_64 => &["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu"],
        Arch::Aarch64 => &["/usr/aarch64-linux-gnu/lib"],
    };
    let mut found = BTreeMap::new();
    let mut queue: Vec<PathBuf> = elfs.iter().map(|p| p.to_path_buf()).collect();
    while let Some(elf) = queue.pop() {
        let out = Command::new("readelf").args(["-W", "-d", "-l"]).arg(&elf).output().context("running readelf")?;
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let bracketed = || line.split_once('[').and_then(|(_, r)| r.split_once(']')).map(|(v, _)| v.trim());
            let (guest, host) = if line.contains("Requesting program interpreter") {
                let interp =
                    bracketed().context("readelf: interpreter")?.trim_start_matches("Requesting program interpreter: ");
                let name = Path::new(interp).file_name().context("interpreter name")?;
                let host = dirs.iter().map(|d| Path::new(d).join(name)).find(|p| p.exists());
                (interp.to_string(), host.with_context(|| format!("no {interp} for {}", arch.name()))?)
            } else if line.contains("(NEEDED)") {
                let name = bracketed().context("readelf: NEEDED")?;
                let host = dirs.iter().map(|d| Path::new(d).join(name)).find(|p| p.exists());
                (
                    format!("/lib/{name}"),
                    host.with_context(|| format!("{name} for {} not found in {dirs:?}", arch.name()))?,
                )
            } else {
                continue;
            };
            if let std::collections::btree_map::Entry::Vacant(e) = found.entry(guest) {
                queue.push(host.clone());
                e.insert(host);
            }
        }
    }
    Ok(found)
}

/// The guest's root file system: busybox, /init, the binaries in
/// /opt/governor (where the tests look for governor and workload beside
/// themselves) and their libraries.
fn initramfs_image(arch: Arch, busybox: &Path, exes: &BTreeMap<String, PathBuf>) -> Result<Vec<u8>> {
    let mut c = Cpio::default();
    for dir in ["bin", "dev", "etc", "lib", "lib64", "opt", "opt/governor", "proc", "root", "run", "sys", "tmp"] {
        c.entry(dir, 0o040755, 0, &[]);
    }
    c.entry("dev/console", 0o020600, (5 << 8) | 1, &[]);
    c.entry("init", 0o100755, 0, INIT.as_bytes());
    c.entry(
        "etc/passwd",
        0o100644,
        0,
        b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
    );
    c.entry("etc/group", 0o100644, 0, b"root:x:0:\nnogroup:x:65534:\n");
    c.entry("bin/busybox", 0o100755, 0, &std::fs::read(busybox).with_context(|| busybox.display().to_string())?);
    for (name, path) in exes {
        c.entry(&format!("opt/governor/{name}"), 0o100755, 0, &std::fs::read(path)?);
    }
    for (guest, host) in libraries(arch, &exes.values().collect::<Vec<_>>())? {
        c.entry(guest.trim_start_matches('/'), 0o100755, 0, &std::fs::read(&host)?);
    }
    Ok(c.finish())
}

/// A cpio archive in the kernel's initramfs ("newc") format, every entry
/// owned by root.
#[derive(Default)]
struct Cpio {
    out: Vec<u8>,
    inode: u32,
}

impl Cpio {
    /// `rdev` is `major << 8 | minor`, for device nodes.
    fn entry(&mut self, name: &str, mode: u32, rdev: u32, data: &[u8]) {
        self.inode += 1;
        let fields =
            [self.inode, mode, 0, 0, 1, 0, data.len() as u32, 0, 0, rdev >> 8, rdev & 0xff, name.len() as u32 + 1, 0];
        self.out.extend_from_slice(b"070701");
        for f in fields {
            self.out.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad(4);
        self.out.extend_from_slice(data);
        self.pad(4);
    }

    fn pad(&mut self, to: usize) {
        while !self.out.len().is_multiple_of(to) {
            self.out.push(0);
        }
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, 0, &[]);
        self.pad(512);
        self.out
    }
}

struct Run {
    accel: &'static str,
    /// qemu's start to the guest's /init.
    boot: Duration,
    /// The guest's /init to its exit code.
    tests: Duration,
    code: Option<i32>,
    /// The steps that finished, in order.
    done: Vec<String>,
    /// The first failed step's code.
    failed: Option<i32>,
    /// The step the guest fell silent in (its kernel stopped), if it did.
    stopped_in: Option<String>,
}

/// Hardware virtualisation: /dev/kvm and a CPU with VMX or SVM (a /dev/kvm
/// without them cannot run an unmodified kernel).
fn kvm_usable() -> bool {
    let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    Path::new("/dev/kvm").exists()
        && flags.lines().any(|l| l.starts_with("flags") && (l.contains(" vmx") || l.contains(" svm")))
}

/// Boots the guest, streaming its console; waits for its exit code.
fn boot(arch: Arch, vmlinuz: &Path, initramfs: &Path, only: Option<&str>) -> Result<Run> {
    let kvm = arch == Arch::X86_64 && std::env::consts::ARCH == "x86_64" && kvm_usable();
    let (qemu, console, limit) = match arch {
        Arch::X86_64 => ("qemu-system-x86_64", "ttyS0", Duration::from_secs(30 * 60)),
        Arch::Aarch64 => ("qemu-system-aarch64", "ttyAMA0", Duration::from_secs(75 * 60)),
    };
    let mut cmd = Command::new("nice");
    cmd.args([
        "-n", "19", qemu, "-smp", "2", "-m", "2048", "-display", "none", "-monitor", "none", "-serial", "stdio",
        "-nic", "none",
    ]);
    cmd.arg("-no-reboot").arg("-kernel").arg(vmlinuz).arg("-initrd").arg(initramfs);
    // loglevel 5: warnings with their stack traces (lockups, RCU stalls).
    let mut append = format!("console={console} panic=-1 loglevel=5");
    if arch == Arch::X86_64 && !kvm {
        // TCG's vCPUs read the host's TSC, but the guest's synchronisation
        // check fails on the emulation's delays and leaves the kernel on the
        // HPET, while the scheduler keeps counting on the TSC. A node keeps
        // time on the TSC (or kvm-clock): so does the guest.
        append.push_str(" tsc=reliable");
    }
    if let Some(steps) = only {
        append.push_str(&format!(" vm_test_only={steps}"));
    }
    cmd.args(["-append", &append]);
    match arch {
        Arch::X86_64 if kvm => cmd.args(["-accel", "kvm", "-cpu", "host"]),
        Arch::X86_64 => cmd.args(["-accel", "tcg", "-cpu", "max"]),
        // pauth-impdef: pointer authentication with a cheap hash under TCG.
        Arch::Aarch64 => cmd.args(["-M", "virt", "-accel", "tcg", "-cpu", "max,pauth-impdef=on"]),
    };
    eprintln!("+ {cmd:?}");
    let start = Instant::now();
    let mut child =
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).spawn().with_context(|| format!("starting {qemu}"))?;
    let stdout = child.stdout.take().context("qemu stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut r = BufReader::new(stdout);
        let mut buf = Vec::new();
        while r.read_until(b'\n', &mut buf).is_ok_and(|n| n > 0) {
            let line = String::from_utf8_lossy(&buf).trim_end().to_string();
            buf.clear();
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut run = Run {
        accel: if kvm { "kvm" } else { "tcg" },
        boot: Duration::ZERO,
        tests: Duration::ZERO,
        code: None,
        done: Vec::new(),
        failed: None,
        stopped_in: None,
    };
    let mut current = String::from("boot");
    // The last line from the guest's user space (the kernel's own lines,
    // lockup reports among them, say nothing of whether it still runs).
    let mut alive_at = Instant::now();
    loop {
        let left = limit.checked_sub(start.elapsed()).unwrap_or_default();
        let quiet = SILENCE.saturating_sub(alive_at.elapsed());
        let got = if quiet.is_zero() {
            Err(std::sync::mpsc::RecvTimeoutError::Timeout)
        } else {
            rx.recv_timeout(left.min(quiet))
        };
        match got {
            Ok(line) => {
                if !is_kernel_line(&line) {
                    alive_at = Instant::now();
                }
                // The heartbeat may land inside a test's line: taken out.
                let line = if line.contains(ALIVE) { line.replace(ALIVE, "") } else { line };
                if line.trim().is_empty() {
                    continue;
                }
                println!("{line}");
                // `VM-TEST-STEP name: command` at its start, `VM-TEST-STEP
                // name rc=N seconds=S` at its end.
                if let Some(step) = line.strip_prefix("VM-TEST-STEP ") {
                    match step.split_once(" rc=") {
                        Some((name, rest)) => {
                            run.done.push(name.to_string());
                            let rc = rest.split_whitespace().next().and_then(|c| c.parse::<i32>().ok());
                            if rc != Some(0) && run.failed.is_none() {
                                run.failed = Some(rc.unwrap_or(1));
                            }
                        }
                        None => current = step.split(':').next().unwrap_or(step).to_string(),
                    }
                }
                if line.starts_with("VM-TEST-INIT") {
                    run.boot = start.elapsed();
                }
                if let Some(code) = line.strip_prefix(MARKER) {
                    run.tests = start.elapsed() - run.boot;
                    run.code = code.trim().parse().ok();
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) if start.elapsed() >= limit => {
                eprintln!("the guest did not finish in {} s: stopping qemu", limit.as_secs());
                let _ = child.kill();
                break;
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                eprintln!(
                    "the guest's user space printed nothing for {} s, not even its heartbeat: stopping qemu",
                    SILENCE.as_secs()
                );
                // What the host ran meanwhile (a host process starving the
                // niced qemu would look the same from here).
                if let Ok(ps) = Command::new("ps").args(["-eo", "pid,ni,pcpu,etime,time,comm", "--sort=-pcpu"]).output()
                {
                    let text = String::from_utf8_lossy(&ps.stdout);
                    eprintln!("host processes by CPU:\n{}", text.lines().take(8).collect::<Vec<_>>().join("\n"));
                }
                run.stopped_in = Some(current.clone());
                let _ = child.kill();
                break;
            }
        }
    }
    let status = child.wait()?;
    if run.code.is_none() {
        eprintln!("{qemu} exited with {status}");
    }
    Ok(run)
}

/// A line of the guest kernel's log on the console: `[  120.428775] …`.
fn is_kernel_line(line: &str) -> bool {
    line.trim_start()
        .strip_prefix('[')
        .and_then(|rest| rest.split_once(']'))
        .is_some_and(|(stamp, _)| stamp.trim().parse::<f64>().is_ok())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_kernels_console_lines_are_told_from_the_guests_user_space() {
        assert!(super::is_kernel_line(
            "[  120.428775] watchdog: BUG: soft lockup - CPU#1 stuck for 45s! [governor:478]"
        ));
        assert!(super::is_kernel_line("[   95.449175] Call Trace:"));
        assert!(!super::is_kernel_line("VM-TEST-STEP profile rc=0 seconds=30.1"));
        assert!(!super::is_kernel_line("[ok] 3 samples"));
        assert!(!super::is_kernel_line("test keyspaces_on_the_same_threads ... ok"));
        assert!(!super::is_kernel_line(""));
    }
}
