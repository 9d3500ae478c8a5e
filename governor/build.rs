//! With the `agent` feature: builds governor-ebpf (package keyspace-governor-ebpf) for the BPF target
//! (through aya-build, with the nightly toolchain and bpf-linker that
//! `cargo xtask setup` installs) and leaves the object in OUT_DIR for
//! `include_bytes_aligned!`. The client alone needs none of it.
//!
//! `GOVERNOR_EBPF_OBJECT=<path>` embeds that already built object instead:
//! a cross build for another architecture then carries the very bytes the
//! host build carries (aya-build would compile them again for each target
//! architecture: the same instructions, with different BTF and debug line
//! info). `cargo xtask vm-test` uses it.

#[cfg(feature = "agent")]
fn main() -> anyhow::Result<()> {
    use anyhow::Context as _;
    use std::path::PathBuf;

    println!("cargo:rerun-if-env-changed=GOVERNOR_EBPF_OBJECT");
    if let Some(object) = std::env::var_os("GOVERNOR_EBPF_OBJECT") {
        let out = PathBuf::from(std::env::var("OUT_DIR")?).join("governor-programs");
        println!("cargo:rerun-if-changed={}", PathBuf::from(&object).display());
        std::fs::copy(&object, &out)
            .with_context(|| format!("copying GOVERNOR_EBPF_OBJECT {}", PathBuf::from(&object).display()))?;
        return Ok(());
    }
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let root = manifest.parent().context("governor/ has no parent")?;
    let ebpf_dir = root.join("governor-ebpf");
    let common_dir = root.join("governor-common");
    if !ebpf_dir.join("Cargo.toml").exists() {
        anyhow::bail!(
            "the `agent` feature builds the eBPF programs from the repository's governor-ebpf/ \
             (not in this package): build the agent from the repository (`cargo xtask dist`); \
             a storage server needs only the default `client` feature"
        );
    }
    // The eBPF object embeds the shared layouts too.
    println!("cargo:rerun-if-changed={}", common_dir.display());
    let ebpf_dir = ebpf_dir.to_str().context("non-UTF-8 path")?;
    aya_build::build_ebpf(
        [aya_build::Package { name: "keyspace-governor-ebpf", root_dir: ebpf_dir, ..Default::default() }],
        aya_build::Toolchain::default(),
    )
    .context("building governor-ebpf (run `cargo xtask setup` first)")
}

#[cfg(not(feature = "agent"))]
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
}
