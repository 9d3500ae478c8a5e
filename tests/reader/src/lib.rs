//! A multi-tenant reader server for governor's demo: what a storage server
//! looks like from the governor's side.
//!
//! # Layout
//!
//! - [`store`]: each keyspace's rows in compressed, checksummed blocks, and
//!   the CPU work of a point get (one block) and a scan (many, a few at a
//!   time).
//! - [`proto`]: the TCP protocol (length-prefixed frames answered in order)
//!   and the statistics the server reports.
//! - `src/bin/reader-server/`: the server: a tokio runtime whose workers are
//!   registered with the governor agent; every request runs under a ticket
//!   of its keyspace, and a refusal becomes a busy reply.
#![forbid(unsafe_code)]

pub mod proto;
pub mod store;
