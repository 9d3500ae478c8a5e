//! Project tasks: `cargo xtask setup | test [--repeat N [--busy-cores K]] | demo [--json] [--short] [--guard] | bench [--json] | dist [--arch A]
//! | vm-test [--arch A] [--kernel V]`.
//!
//! # Layout
//!
//! - `setup`: installs what a bare machine lacks (idempotent).
//! - `test`: setup, then the lints (the agent crate's shape, rustfmt, clippy -D warnings), then every test: the amd64 package (a test installs
//!   it), host tests (real eBPF included), the light client on stable (its
//!   tests, and no agent crate in its tree), the aarch64 cross build with
//!   its pure unit tests under qemu-user, and the arm64 package;
//!   `--repeat N` runs the host suites N times and lists every test that
//!   failed at least once (`repeat.rs`).
//! - `demo`: a noisy neighbour on the reader server, measured, then
//!   governed: CPU per tenant, the light tenants' latency, an SVG.
//! - `bench`: the benchmark harness; `--json` prints one JSON object.
//! - `dist`: a tarball and a `.deb` per architecture in `target/dist/`.
//! - `vm-test`: the eBPF tests inside a VM booting a Debian kernel (`vm.rs`).

mod dist;
mod repeat;
mod setup;
mod structure;
mod vm;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install the toolchain parts, bpf-linker and Debian packages needed.
    Setup,
    /// Setup, then run every test.
    Test {
        /// Skip the aarch64 cross build and qemu-user tests.
        #[arg(long)]
        host_only: bool,
        /// Run the host suites this many times instead, and report each
        /// test that failed at least once (`target/test-repeat/`).
        #[arg(long, value_name = "N")]
        repeat: Option<u32>,
        /// With --repeat: keep this many cores busy (`stress-ng --cpu K`)
        /// all the while.
        #[arg(long, value_name = "K", default_value_t = 0, requires = "repeat")]
        busy_cores: u32,
    },
    /// The checks `test` runs before any test: the agent crate's shape (no
    /// file over 600 lines, no import cycle), formatting, clippy.
    Lint,
    /// Setup, then run the demo: a noisy neighbour on a multi-tenant reader
    /// server, with the agent measuring, then enforcing a tenant cap.
    Demo {
        /// Print one JSON object on stdout (progress goes to stderr).
        #[arg(long)]
        json: bool,
        /// Shorter phases (10 s instead of 15 s).
        #[arg(long)]
        short: bool,
        /// The enforcing phase with the latency guard on too.
        #[arg(long)]
        guard: bool,
    },
    /// Build and package: a tarball and a .deb per architecture in target/dist/.
    Dist {
        /// Only this architecture (default: both).
        #[arg(long, value_enum)]
        arch: Option<dist::Arch>,
    },
    /// Boot a Debian kernel in qemu and run the eBPF tests inside it: the
    /// agent on the eBPF backend, exactly-once measurement, the long slice,
    /// the kernel's own counts, the client API.
    VmTest {
        #[arg(long, value_enum, default_value = "x86_64")]
        arch: dist::Arch,
        /// Kernel version of Debian's `linux-image-<VERSION>…-cloud-*` packages.
        #[arg(long, default_value = "6.1")]
        kernel: String,
        /// Only these guest steps (comma-separated: doctor, agent-backend,
        /// measurement, kernel_exact, client_api, cgroup-v2, tickets, server-cpu, cpu-wait; and, run only
        /// when named, core, CI's subset of measurement, and profile).
        #[arg(long)]
        only: Option<String>,
    },
    /// Setup, then run the benchmarks.
    Bench {
        /// Print one JSON object on stdout (progress goes to stderr).
        #[arg(long)]
        json: bool,
    },
}

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// Runs `cmd` from the workspace root, failing on a non-zero exit.
pub fn run(cmd: &mut Command) -> Result<()> {
    cmd.current_dir(root());
    eprintln!("+ {cmd:?}");
    let status = cmd.status().with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

/// Style is part of the build: the agent crate's shape (no file over 600
/// lines, no import cycle), formatting (rustfmt.toml), then clippy with
/// warnings as errors on the agent build, the client build and the eBPF
/// crate (workspace `[lints]`), before any test runs.
fn lint() -> Result<()> {
    structure::check(&root().join("governor/src"))?;
    run(cargo().args(["fmt", "--all", "--check"]))?;
    let deny = ["--", "-D", "warnings"];
    run(cargo()
        .args(["clippy", "--release", "--workspace", "--exclude", "keyspace-governor-ebpf", "--all-targets"])
        .args(["--features", "keyspace-governor/agent"])
        .args(deny))?;
    run(cargo().args(["clippy", "--release", "-p", "keyspace-governor", "--lib", "--examples"]).args(deny))?;
    // The eBPF crate builds only for the BPF target, with the nightly (through
    // rustup's `cargo`, not the stable one that runs this task).
    run(Command::new("cargo")
        .env_remove("RUSTC")
        .env_remove("RUSTC_WRAPPER")
        .env_remove("RUSTUP_TOOLCHAIN")
        .args(["+nightly", "clippy", "--release", "-p", "keyspace-governor-ebpf", "--target", "bpfel-unknown-none"])
        .args(["-Z", "build-std=core"])
        .args(deny))
}

fn build_release() -> Result<()> {
    run(cargo().args(["build", "--release", "--bins"]))
}

fn test(host_only: bool, repeat: Option<u32>, busy_cores: u32) -> Result<()> {
    setup::setup(!host_only && repeat.is_none())?;
    lint()?;
    build_release()?;
    // The host's package first: a test installs it with dpkg.
    dist::package(dist::Arch::X86_64)?;
    if let Some(rounds) = repeat {
        return repeat::repeat(rounds, busy_cores);
    }
    // Host: unit, config, policy and end-to-end tests (real eBPF).
    run(cargo().args(["test", "--release"]))?;
    light_client()?;
    if !host_only {
        cross_aarch64()?;
        let (_, deb) = dist::package(dist::Arch::Aarch64)?;
        check_deb(&deb, "arm64")?;
        // Debian 12's 6.1 kernel in qemu, both architectures, one eBPF
        // object: the agent comes up on eBPF, exactly once, the long slice,
        // the client API, a rule cap held by cgroup v2's cpu.max, tickets, a
        // tenant cap of a server's 1-core cgroup, run-queue wait per keyspace,
        // per-keyspace profiles.
        for arch in ["x86_64", "aarch64"] {
            run(Command::new(std::env::current_exe()?).args([
                "vm-test",
                "--arch",
                arch,
                "--kernel",
                "6.1",
                "--only",
                "doctor,agent-backend,core,client_api,cgroup-v2,tickets,server-cpu,cpu-wait,profile",
            ]))?;
        }
    }
    Ok(())
}

/// A package for another architecture cannot be installed here: its
/// metadata and contents are checked instead.
fn check_deb(deb: &Path, arch: &str) -> Result<()> {
    let field = |f: &str| -> Result<String> {
        let out = Command::new("dpkg-deb").args(["--field"]).arg(deb).arg(f).output()?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    if field("Architecture")? != arch || field("Package")? != "governor" {
        bail!("{}: not a governor package for {arch}", deb.display());
    }
    let list = Command::new("dpkg-deb").arg("--contents").arg(deb).output()?;
    let list = String::from_utf8_lossy(&list.stdout);
    for path in ["./usr/bin/governor", "./lib/systemd/system/governor.service", "./etc/governor/governor.toml"] {
        if !list.lines().any(|l| l.ends_with(path)) {
            bail!("{} lacks {path}:\n{list}", deb.display());
        }
    }
    // Its agent runs (under qemu-user) and takes the configuration it ships,
    // and embeds the host's eBPF object, byte for byte.
    let stage = dist::dir().join(format!("governor-{}-aarch64", env!("CARGO_PKG_VERSION")));
    let object = std::fs::read(host_ebpf_object()?)?;
    if !vm::contains(&std::fs::read(stage.join("usr/bin/governor"))?, &object) {
        bail!("the packaged aarch64 governor does not embed the host build's eBPF object");
    }
    let out = Command::new("qemu-aarch64")
        .args(["-L", "/usr/aarch64-linux-gnu"])
        .arg(stage.join("usr/bin/governor"))
        .args(["config", "validate"])
        .arg(stage.join("etc/governor/governor.toml"))
        .output()
        .context("running the aarch64 governor under qemu-aarch64")?;
    if !out.status.success() {
        bail!("the packaged aarch64 governor: {}", String::from_utf8_lossy(&out.stderr));
    }
    eprintln!(
        "{}: governor for {arch}, with binary, unit and configuration; its agent validates its configuration",
        deb.display()
    );
    Ok(())
}

fn dist(arch: Option<dist::Arch>) -> Result<()> {
    if arch != Some(dist::Arch::Aarch64) {
        build_release()?;
        dist::package(dist::Arch::X86_64)?;
    }
    if arch != Some(dist::Arch::X86_64) {
        setup::setup(true)?;
        run(cross_env(cargo())?.args([
            "build",
            "--release",
            "--target",
            "aarch64-unknown-linux-gnu",
            "-p",
            "keyspace-governor",
            "--features",
            "keyspace-governor/agent",
            "--bins",
        ]))?;
        let (_, deb) = dist::package(dist::Arch::Aarch64)?;
        check_deb(&deb, "arm64")?;
    }
    Ok(())
}

/// Crates the light client (`--no-default-features --features client`)
/// must not pull in: the eBPF toolchain's, and the agent's.
const AGENT_ONLY_CRATES: &[&str] = &[
    "aya",
    "aya-build",
    "aya-log",
    "aya-obj",
    "clap",
    "dashmap",
    "env_logger",
    "procfs",
    "prometheus",
    "tokio",
    "toml",
];

/// The light client builds and passes its unit tests on stable Rust, its
/// dependency tree (build dependencies included) holds none of
/// [`AGENT_ONLY_CRATES`], its rustdoc builds with no warning, and it
/// packages for crates.io.
fn light_client() -> Result<()> {
    let features = ["-p", "keyspace-governor", "--no-default-features", "--features", "client"];
    let stable = || {
        let mut c = Command::new("rustup");
        c.args(["run", "stable", "cargo"]);
        c
    };
    run(stable().args(["test", "--release", "--lib"]).args(features))?;
    let mut tree = stable();
    tree.args(["tree", "-e", "normal,build", "--prefix", "none"]).args(features).current_dir(root());
    let out = tree.output().context("running cargo tree")?;
    if !out.status.success() {
        bail!("cargo tree failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let found: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| AGENT_ONLY_CRATES.contains(name))
        .collect();
    if !found.is_empty() {
        bail!("the light client depends on {found:?}:\n{text}");
    }
    eprintln!(
        "light client: {} crates, none of {AGENT_ONLY_CRATES:?}",
        text.lines().collect::<std::collections::BTreeSet<_>>().len()
    );
    // Its documentation is its API: no broken link, nothing undocumented
    // (the crate denies missing docs in this build).
    run(stable().args(["doc", "--no-deps"]).args(features).env("RUSTDOCFLAGS", "-D warnings"))?;
    // What a server links must package and build from its own sources as
    // crates.io would serve them (together: the client needs its layouts).
    forget_unpacked_packages()?;
    let target = root().join("target/publish-check");
    forget_package_builds(&target)?;
    run(stable()
        .args(["publish", "--dry-run", "--allow-dirty", "-p", "keyspace-governor-common", "-p", "keyspace-governor"])
        .env("CARGO_TARGET_DIR", &target)
        .current_dir(root()))
}

/// The dry run builds the client against the common crate as a registry
/// package, whose build cargo keys by name and version, not by its sources:
/// a later dry run of the same version reused the build of an older common
/// crate (seen: `asleep_flags` added to it, and the client's verification
/// failed to find it). So the dry run builds in a directory of its own, from
/// which our packages' builds are removed first (their dependencies' stay).
fn forget_package_builds(target: &Path) -> Result<()> {
    for dir in ["debug/.fingerprint", "debug/deps", "debug/build"] {
        let Ok(entries) = std::fs::read_dir(target.join(dir)) else { continue };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().replace('_', "-");
            if !(name.starts_with("keyspace-governor") || name.starts_with("libkeyspace-governor")) {
                continue;
            }
            let p = e.path();
            if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) }
                .with_context(|| format!("removing {}", p.display()))?;
        }
    }
    Ok(())
}

/// A dry run unpacks our own packages into cargo's registry sources, and a
/// later one with the same version reuses that copy instead of what it just
/// packaged (seen: a layout added to the common crate, and the client built
/// against the stale copy). They are not published, so no copy there is
/// anyone else's: removed before each dry run.
fn forget_unpacked_packages() -> Result<()> {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .context("neither CARGO_HOME nor HOME is set")?;
    for kind in ["src", "cache"] {
        let Ok(indexes) = std::fs::read_dir(home.join("registry").join(kind)) else { continue };
        for index in indexes.flatten() {
            let Ok(entries) = std::fs::read_dir(index.path()) else { continue };
            for e in entries.flatten() {
                if !e.file_name().to_string_lossy().starts_with("keyspace-governor-") {
                    continue;
                }
                let p = e.path();
                if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) }
                    .with_context(|| format!("removing {}", p.display()))?;
            }
        }
    }
    Ok(())
}

/// `c` with the aarch64 cross linker and qemu-user runner.
/// The eBPF object the host build embeds (building it if need be): every
/// architecture's agent embeds these very bytes.
fn host_ebpf_object() -> Result<PathBuf> {
    static OBJECT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    if let Some(p) = OBJECT.get() {
        return Ok(p.clone());
    }
    let mut c = cargo();
    c.args([
        "build",
        "--release",
        "-p",
        "keyspace-governor",
        "--features",
        "keyspace-governor/agent",
        "--bin",
        "governor",
        "--message-format=json-render-diagnostics",
    ])
    .current_dir(root())
    .stderr(std::process::Stdio::inherit());
    let out = c.output().with_context(|| format!("starting {c:?}"))?;
    if !out.status.success() {
        bail!("{c:?} failed with {}", out.status);
    }
    let object = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|m| {
            m["reason"] == "build-script-executed" && m["package_id"].as_str().is_some_and(|p| p.contains("/governor#"))
        })
        .and_then(|m| m["out_dir"].as_str().map(|d| Path::new(d).join("governor-programs")))
        .context("the host build did not report governor's eBPF object")?;
    Ok(OBJECT.get_or_init(|| object).clone())
}

/// The environment of an aarch64 cross build: its linker, qemu-user as the
/// runner, and the host build's eBPF object to embed.
fn cross_env(mut c: Command) -> Result<Command> {
    c.env("GOVERNOR_EBPF_OBJECT", host_ebpf_object()?);
    for (k, v) in [
        ("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER", "aarch64-linux-gnu-gcc"),
        ("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER", "qemu-aarch64 -L /usr/aarch64-linux-gnu"),
        ("CC_aarch64_unknown_linux_gnu", "aarch64-linux-gnu-gcc"),
    ] {
        c.env(k, v);
    }
    Ok(c)
}

/// Cross-compiles the userspace for aarch64 and runs the pure unit tests
/// (layouts, config, policy, regions) under qemu-user.
fn cross_aarch64() -> Result<()> {
    let target = "aarch64-unknown-linux-gnu";
    run(cross_env(cargo())?.args([
        "build",
        "--release",
        "--target",
        target,
        "-p",
        "keyspace-governor",
        "--features",
        "keyspace-governor/agent",
        "--bins",
    ]))?;
    run(cross_env(cargo())?.args(["test", "--release", "--target", target, "-p", "keyspace-governor-common"]))?;
    // governor's own integration tests are the pure config and policy suites.
    run(cross_env(cargo())?.args([
        "test",
        "--release",
        "--target",
        target,
        "-p",
        "keyspace-governor",
        "--features",
        "agent",
        "--lib",
        "--tests",
    ]))
}

fn tests_bin(name: &str) -> PathBuf {
    root().join("target/release").join(name)
}

fn main() -> Result<()> {
    match Cli::parse().task {
        Task::Setup => setup::setup(true),
        Task::Lint => lint(),
        Task::Test { host_only, repeat, busy_cores } => test(host_only, repeat, busy_cores),
        Task::Dist { arch } => dist(arch),
        Task::VmTest { arch, kernel, only } => vm::vm_test(arch, &kernel, only.as_deref()),
        Task::Demo { json, short, guard } => {
            setup::setup(false)?;
            build_release()?;
            let mut cmd = Command::new(tests_bin("demo"));
            if json {
                cmd.arg("--json");
            }
            if short {
                cmd.arg("--short");
            }
            if guard {
                cmd.arg("--guard");
            }
            run(&mut cmd)
        }
        Task::Bench { json } => {
            setup::setup(false)?;
            build_release()?;
            let mut cmd = Command::new(tests_bin("bench"));
            if json {
                cmd.arg("--json");
            }
            run(&mut cmd)
        }
    }
}
