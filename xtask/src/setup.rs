//! `cargo xtask setup`: makes a bare machine able to build and test
//! governor. Idempotent: each step checks before it installs.

use crate::run;
use anyhow::{Context, Result, bail};
use std::process::Command;

const BPF_LINKER_VERSION: &str = "0.10.3";
const NIGHTLY: &str = "nightly";

fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Everything the build and the tests need; `cross` adds the aarch64 parts.
pub fn setup(cross: bool) -> Result<()> {
    nightly_rust_src()?;
    lint_components()?;
    bpf_linker()?;
    // setpriv: attacks run as nobody; prometheus: a real server scrapes the
    // agent, and promtool checks the exposition; stress-ng: the unmodified
    // processes rules measure (with xz, and redis with its load generator);
    // tmux: `governor top` in a terminal.
    let mut packages = vec![
        ("util-linux", "/usr/bin/setpriv"),
        ("prometheus", "/usr/bin/promtool"),
        ("stress-ng", "/usr/bin/stress-ng"),
        ("xz-utils", "/usr/bin/xz"),
        ("tmux", "/usr/bin/tmux"),
        // A real server whose threads a thread-name rule tells apart.
        ("redis-server", "/usr/bin/redis-server"),
        ("redis-tools", "/usr/bin/redis-benchmark"),
        // The package test: `dpkg -i` needs the .deb's dependency, and the
        // unit is checked with systemd-analyze.
        ("adduser", "/usr/sbin/adduser"),
        ("systemd", "/usr/bin/systemd-analyze"),
        // `go tool pprof`, the reference reader of the profiles' pprof.
        ("golang-go", "/usr/bin/go"),
        // The ticket path's length in instructions (`bench`), where the
        // guest has no hardware counters.
        ("valgrind", "/usr/bin/valgrind"),
    ];
    if cross {
        packages.extend([
            ("gcc-aarch64-linux-gnu", "/usr/bin/aarch64-linux-gnu-gcc"),
            ("libc6-dev-arm64-cross", "/usr/aarch64-linux-gnu/lib/libc.so"),
            ("qemu-user", "/usr/bin/qemu-aarch64"),
        ]);
    }
    debian_packages(&packages)?;
    if cross {
        let installed = output(Command::new("rustup").args(["target", "list", "--installed"])).unwrap_or_default();
        if !installed.lines().any(|l| l.trim() == "aarch64-unknown-linux-gnu") {
            run(Command::new("rustup").args(["target", "add", "aarch64-unknown-linux-gnu"]))?;
        }
    }
    eprintln!("setup: ready");
    Ok(())
}

/// What `cargo xtask vm-test` needs beyond [`setup`]: qemu for `arch`, and
/// for arm64 apt's package lists of that architecture (the guest's kernel
/// and busybox come from them, through `apt-get download`).
pub fn vm(arch: crate::dist::Arch) -> Result<()> {
    match arch {
        crate::dist::Arch::X86_64 => debian_packages(&[("qemu-system-x86", "/usr/bin/qemu-system-x86_64")]),
        crate::dist::Arch::Aarch64 => {
            debian_packages(&[("qemu-system-arm", "/usr/bin/qemu-system-aarch64")])?;
            let foreign = output(Command::new("dpkg").arg("--print-foreign-architectures")).unwrap_or_default();
            if foreign.lines().any(|l| l.trim() == "arm64") {
                return Ok(());
            }
            if output(Command::new("id").arg("-u")).map(|s| s.trim().to_string()) != Some("0".into()) {
                bail!("apt has no arm64 package lists; run `cargo xtask vm-test --arch aarch64` as root");
            }
            run(Command::new("dpkg").args(["--add-architecture", "arm64"]))?;
            run(Command::new("apt-get").args(["update", "-q"]))
        }
    }
}

fn nightly_rust_src() -> Result<()> {
    let toolchains = output(Command::new("rustup").args(["toolchain", "list"])).context("rustup is not installed")?;
    if !toolchains.lines().any(|l| l.starts_with(NIGHTLY)) {
        run(Command::new("rustup").args(["toolchain", "install", NIGHTLY, "--profile", "minimal"]))
            .context("the eBPF build needs a nightly toolchain")?;
    }
    let components = output(Command::new("rustup").args(["component", "list", "--installed", "--toolchain", NIGHTLY]))
        .unwrap_or_default();
    if !components.lines().any(|l| l.starts_with("rust-src")) {
        run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", NIGHTLY]))?;
    }
    Ok(())
}

/// clippy and rustfmt on stable (the workspace), clippy on the nightly
/// (the eBPF crate): `cargo xtask test` lints before it tests.
fn lint_components() -> Result<()> {
    for (toolchain, wanted) in [("stable", &["clippy", "rustfmt"][..]), (NIGHTLY, &["clippy"][..])] {
        let installed =
            output(Command::new("rustup").args(["component", "list", "--installed", "--toolchain", toolchain]))
                .unwrap_or_default();
        for c in wanted {
            if !installed.lines().any(|l| l.starts_with(c)) {
                run(Command::new("rustup").args(["component", "add", c, "--toolchain", toolchain]))?;
            }
        }
    }
    Ok(())
}

fn bpf_linker() -> Result<()> {
    let version = output(Command::new("bpf-linker").arg("--version")).unwrap_or_default();
    if version.split_whitespace().any(|w| w == BPF_LINKER_VERSION) {
        return Ok(());
    }
    if !version.is_empty() {
        eprintln!("setup: replacing {} with bpf-linker {BPF_LINKER_VERSION}", version.trim());
    }
    // 0.10.3 loads the nightly's own LLVM; newer releases need a system LLVM.
    run(Command::new("cargo").args(["install", &format!("bpf-linker@{BPF_LINKER_VERSION}"), "--locked", "--force"]))
}

fn debian_packages(packages: &[(&str, &str)]) -> Result<()> {
    let missing: Vec<&str> =
        packages.iter().filter(|(_, probe)| !std::path::Path::new(probe).exists()).map(|(p, _)| *p).collect();
    if missing.is_empty() {
        return Ok(());
    }
    if output(Command::new("id").arg("-u")).map(|s| s.trim().to_string()) != Some("0".into()) {
        bail!("missing Debian packages {missing:?}; run `cargo xtask setup` as root or install them");
    }
    run(Command::new("apt-get").args(["update", "-q"]))?;
    let mut cmd = Command::new("apt-get");
    cmd.args(["install", "-y", "-q", "--no-install-recommends"]).args(&missing);
    cmd.env("DEBIAN_FRONTEND", "noninteractive");
    run(&mut cmd)
}
