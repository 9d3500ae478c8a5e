//! governor: a per-node CPU governor for multi-tenant storage servers.
//!
//! A storage server links this crate for [`client`]: it registers its
//! worker threads with the node's agent, tags their work with keyspaces
//! (tenants), and admits requests through tickets taken from shared memory
//! (no syscall and no lock on the fast path). The agent (the `governor`
//! binary) measures every registered thread's on-CPU time in the kernel and
//! keeps the token buckets the tickets draw on.
//!
//! ```toml
//! # The client alone: stable Rust, no eBPF toolchain. Not on crates.io
//! # yet: a path (or git) dependency on the repository's `governor/`.
//! keyspace-governor = { path = "../governor/governor" }
//! ```
//!
//! # Features
//!
//! - `client` (default): [`client`], the only public API of the default
//!   build; stable Rust, no eBPF toolchain, aya, tokio or clap.
//! - `agent`: the daemon, the operator CLI, the configuration, the
//!   measurement backends and the whole policy (modules `agent`, `cli`,
//!   `config`, `measure`, `policy`, `region`, `proto`, `tsc`, `sys`, public
//!   for the agent's binary and its tests). It builds the eBPF programs from
//!   the repository's `governor-ebpf/` with the nightly toolchain and
//!   bpf-linker (`cargo xtask setup`), so it builds from the repository only.

#![deny(unsafe_code)]
#![cfg_attr(not(feature = "agent"), deny(missing_docs))]

#[cfg(feature = "agent")]
pub mod agent;
#[cfg(feature = "agent")]
pub mod cli;
#[cfg(feature = "client")]
#[deny(missing_docs)]
pub mod client;
#[cfg(feature = "agent")]
pub mod config;
#[cfg(feature = "agent")]
pub mod measure;
#[cfg(feature = "agent")]
pub mod procs;
// Modules the client uses internally: public with the `agent` feature (the
// daemon and its tests reach into them), private in the client build, whose
// public API is `client` alone. Declared one by one, not through a macro,
// so that rustfmt formats them.
#[cfg(feature = "agent")]
pub mod policy;
#[cfg(not(feature = "agent"))]
#[allow(dead_code, unused_imports)]
mod policy;
#[cfg(feature = "agent")]
pub mod proto;
#[cfg(not(feature = "agent"))]
#[allow(dead_code, unused_imports)]
mod proto;
#[cfg(feature = "agent")]
pub mod ranked;
#[cfg(feature = "agent")]
pub mod region;
#[cfg(not(feature = "agent"))]
#[allow(dead_code, unused_imports)]
mod region;
#[cfg(feature = "agent")]
pub mod sys;
#[cfg(not(feature = "agent"))]
#[allow(dead_code, unused_imports)]
mod sys;
#[cfg(feature = "agent")]
pub mod tsc;
#[cfg(not(feature = "agent"))]
#[allow(dead_code, unused_imports)]
mod tsc;

/// The eBPF object built from governor-ebpf by build.rs.
#[cfg(feature = "agent")]
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/governor-programs"));

/// "a: b: c" from an error and its sources, for one-line logs.
#[cfg(feature = "agent")]
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
