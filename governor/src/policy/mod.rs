//! `keyspace_governor::policy` — the CPU governor's policy: token buckets in shared
//! memory, the admission fast path on them, and the agent's loop over them.
//!
//! # Layout
//! - `admit` — the fast path any process runs on the shared regions:
//!   [`acquire`], [`top_up`], [`release`]; [`Demand`], [`Grant`], [`Knobs`].
//! - `bucket` — token operations on one shared bucket (take, give back,
//!   debt, wait in line, refill).
//! - `manager` — `Policy`: owns the admission regions, decides and
//!   publishes every bucket's source, rate and capacity.
//! - `tick` — the agent loop's side: `Policy::tick` (refill, monitor
//!   window, estimates, burst flags, dynamic and fair refill, idle eviction).
//! - `hot` — online settings changes.
//! - `keyspace` — the agent's record of a keyspace cell, and read-only views.
//! - `pd` — PD service-limit proportional quotas from fetched values.
//! - `window`, `fair`, `dynamic`, `estimate` — pure functions and small state machines.
//! - `settings`, `error`, `snapshot` — inputs (from the configuration only), refusals, outputs.
//!
//! Only `admit`, `bucket` and `error` are built for the light client
//! (feature `client`); the rest is the agent's.
//!
//! Every time-dependent function takes `now_us`, so tests drive it with a
//! simulated clock.

mod admit;
mod bucket;
mod error;
mod spare;
#[cfg(feature = "agent")]
mod tick;
#[cfg(feature = "agent")]
mod dynamic;
#[cfg(feature = "agent")]
mod estimate;
#[cfg(feature = "agent")]
mod fair;
#[cfg(feature = "agent")]
mod guard;
#[cfg(feature = "agent")]
mod hot;
#[cfg(feature = "agent")]
mod keyspace;
#[cfg(feature = "agent")]
mod manager;
#[cfg(feature = "agent")]
mod pd;
#[cfg(feature = "agent")]
mod settings;
#[cfg(feature = "agent")]
mod snapshot;
#[cfg(feature = "agent")]
mod window;

pub use admit::{
    acquire, acquire_queued, acquire_with, release, release_with, top_up, top_up_queued, Demand,
    Grant, Knobs, Progress, Queued, KEYSPACE_PENDING_WRITE_RATIO,
};
pub use spare::{return_tokens as return_spare, Spare, SPARE_MAX_US};
pub use error::{Refusal, WriteLimitKind, TENANT_ADMISSION_CONTROL_MARKER};
#[cfg(feature = "agent")]
pub use {
    tick::TickReport,
    dynamic::{adjust_global_refill, adjust_keyspace_refill, KEYSPACE_REDUCE_FACTOR},
    estimate::{ema, EstimateTracker},
    fair::{fair_allocate, FairInput, FairShare},
    guard::{guard_step, GuardInput, GuardStep},
    keyspace::{BucketBook, BucketSnapshot, KeyspaceCounters, KeyspaceEntry, KeyspaceState, QuotaSource, RequestHistograms, WaitHistograms},
    manager::{Policy, DEFAULT_CELLS},
    pd::{PdAction, PdFetch, PdLimit, PdParams, PdTracked, PdTracker},
    settings::{millicores_to_us_per_interval, Settings},
    snapshot::{KeyspaceSnapshot, OverflowSnapshot, PendingWritesSnapshot, PolicyCountersSnapshot, PolicySnapshot},
    window::{MonitorWindow, UsageSample},
};

/// How firmly the per-tenant concurrency limit is applied
/// (tenant-admission-control.md): the configuration's `admission-control.mode`,
/// one type from the TOML to the policy.
#[cfg(feature = "agent")]
pub use crate::config::AdmissionMode;
