//! governor: a per-node CPU governor for multi-tenant storage servers.
//!
//! # Layout
//!
//! - [`config`]: the TOML configuration, parsed then validated, with online
//!   updates applied whole or not at all.
//! - [`region`]: typed, atomic views of the shared regions (per-CPU switch
//!   records, thread slots, keyspace cells).
//! - [`measure`]: the measurement backends: eBPF (the programs of
//!   governor-ebpf) or the thread-clock fallback.
//! - [`client`]: what a storage server links: connect, register threads,
//!   tag work with keyspaces, read the thread clock.
//! - [`agent`]: the daemon: backend, control socket, slot reuse, window.
//! - [`proto`]: the control-socket messages.
//! - [`cli`]: the operator verbs.
//! - [`tsc`]: CLOCK_MONOTONIC from the TSC, calibrated by the agent.
//! - `sys`: the syscall seam (the only other place with `unsafe`).
//!
//! # Features
//!
//! - `client`: what a storage server links (`client`, and the admission
//!   fast path of `policy`); stable Rust, no eBPF toolchain, aya, tokio or
//!   clap: `governor = { default-features = false, features = ["client"] }`.
//! - `agent` (default): the daemon, the CLI, the configuration, the
//!   measurement backends and the whole policy; builds the eBPF programs.
#![deny(unsafe_code)]

#[cfg(feature = "agent")]
pub mod agent;
#[cfg(feature = "agent")]
pub mod cli;
#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "agent")]
pub mod config;
#[cfg(feature = "agent")]
pub mod measure;
pub mod policy;
#[cfg(feature = "agent")]
pub mod procs;
pub mod proto;
pub mod region;
pub mod sys;
pub mod tsc;

/// The eBPF object built from governor-ebpf by build.rs.
#[cfg(feature = "agent")]
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/governor-programs"));

/// "a: b: c" from an error and its sources, for one-line logs.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}
