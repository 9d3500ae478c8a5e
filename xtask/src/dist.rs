//! `cargo xtask dist`: a tarball and a `.deb` per architecture, in
//! `target/dist/`.
//!
//! Both hold `/usr/bin/governor` (the agent with its eBPF object inside),
//! the systemd unit, the embedded default configuration as
//! `/etc/governor/governor.toml` (a conffile), and the docs, dashboard and
//! DaemonSet under `/usr/share/doc/governor`. The `.deb`'s postinst creates
//! the system user `governor` the unit runs as.

use crate::{root, run};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Arch {
    #[value(name = "x86_64")]
    X86_64,
    Aarch64,
}

impl Arch {
    pub fn deb(self) -> &'static str {
        match self {
            Arch::X86_64 => "amd64",
            Arch::Aarch64 => "arm64",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::X86_64 => "x86_64",
            Arch::Aarch64 => "aarch64",
        }
    }

    /// ELF `e_machine` of its binaries.
    fn elf_machine(self) -> u16 {
        match self {
            Arch::X86_64 => 62,
            Arch::Aarch64 => 183,
        }
    }
}

/// Where `cargo xtask dist` puts the packages.
pub fn dir() -> PathBuf {
    root().join("target/dist")
}

/// The `.deb` of `arch` (after `dist`).
pub fn deb_path(arch: Arch) -> PathBuf {
    dir().join(format!("governor_{}_{}.deb", env!("CARGO_PKG_VERSION"), arch.deb()))
}

fn binary(arch: Arch) -> PathBuf {
    match arch {
        Arch::X86_64 => root().join("target/release/governor"),
        Arch::Aarch64 => root().join("target/aarch64-unknown-linux-gnu/release/governor"),
    }
}

fn copy(from: &Path, to: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(to.parent().expect("a parent"))?;
    std::fs::copy(from, to).with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

fn write(to: &Path, text: &str, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(to.parent().expect("a parent"))?;
    std::fs::write(to, text)?;
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// Packages the already built binary of `arch`; returns (tarball, deb).
pub fn package(arch: Arch) -> Result<(PathBuf, PathBuf)> {
    let version = env!("CARGO_PKG_VERSION");
    let bin = binary(arch);
    let head = std::fs::read(&bin).with_context(|| format!("{} (build it first)", bin.display()))?;
    let machine = head.get(18..20).map(|b| u16::from_le_bytes([b[0], b[1]]));
    if head.get(..4) != Some(b"\x7fELF") || machine != Some(arch.elf_machine()) {
        bail!("{} is not an {} ELF binary", bin.display(), arch.name());
    }
    let stage = dir().join(format!("governor-{version}-{}", arch.name()));
    let _ = std::fs::remove_dir_all(&stage);
    let r = root();
    copy(&bin, &stage.join("usr/bin/governor"), 0o755)?;
    copy(&r.join("deploy/systemd/governor.service"), &stage.join("lib/systemd/system/governor.service"), 0o644)?;
    copy(&r.join("governor/src/config/default.toml"), &stage.join("etc/governor/governor.toml"), 0o644)?;
    let doc = stage.join("usr/share/doc/governor");
    copy(&r.join("README.md"), &doc.join("README.md"), 0o644)?;
    copy(&r.join("docs/design.md"), &doc.join("design.md"), 0o644)?;
    copy(&r.join("deploy/grafana/governor-dashboard.json"), &doc.join("governor-dashboard.json"), 0o644)?;
    copy(&r.join("deploy/kubernetes/governor-daemonset.yaml"), &doc.join("governor-daemonset.yaml"), 0o644)?;
    std::fs::create_dir_all(dir())?;
    let tarball = dir().join(format!("governor-{version}-{}-linux.tar.gz", arch.name()));
    run(Command::new("tar")
        .arg("-czf")
        .arg(&tarball)
        .arg("--owner=0")
        .arg("--group=0")
        .arg("-C")
        .arg(&stage)
        .args(["usr", "lib", "etc"]))?;
    let size_kib = walk_size(&stage)? / 1024;
    write(
        &stage.join("DEBIAN/control"),
        &format!(
            "Package: governor\nVersion: {version}\nArchitecture: {}\nMaintainer: governor developers <governor@localhost>\n\
             Section: admin\nPriority: optional\nInstalled-Size: {size_kib}\nDepends: libc6 (>= 2.34), adduser\n\
             Description: per-node CPU governor for multi-tenant storage servers\n \
             Measures each keyspace's CPU exactly with eBPF and admits or refuses work\n \
             through a shared-memory ticket API, with token buckets per keyspace.\n",
            arch.deb()
        ),
        0o644,
    )?;
    write(&stage.join("DEBIAN/conffiles"), "/etc/governor/governor.toml\n", 0o644)?;
    write(
        &stage.join("DEBIAN/postinst"),
        "#!/bin/sh\nset -e\nif [ \"$1\" = configure ]; then\n  \
         getent passwd governor >/dev/null || adduser --system --group --no-create-home --home /nonexistent governor\n  \
         if [ -d /run/systemd/system ]; then systemctl daemon-reload || true; fi\nfi\n",
        0o755,
    )?;
    write(
        &stage.join("DEBIAN/postrm"),
        "#!/bin/sh\nset -e\nif [ -d /run/systemd/system ]; then systemctl daemon-reload || true; fi\n",
        0o755,
    )?;
    let deb = deb_path(arch);
    run(Command::new("dpkg-deb").args(["--build", "--root-owner-group"]).arg(&stage).arg(&deb))?;
    eprintln!("{}\n{}", tarball.display(), deb.display());
    Ok((tarball, deb))
}

fn walk_size(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let m = e.metadata()?;
        total += if m.is_dir() { walk_size(&e.path())? } else { m.len() };
    }
    Ok(total)
}
