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
#[cfg(feature = "agent")]
mod dynamic;
mod error;
#[cfg(feature = "agent")]
mod estimate;
#[cfg(feature = "agent")]
mod fair;
#[cfg(feature = "agent")]
mod follow;
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
mod sleep;
#[cfg(feature = "agent")]
mod snapshot;
mod spare;
#[cfg(feature = "agent")]
mod tick;
#[cfg(feature = "agent")]
mod window;

pub use admit::{
    Demand, Grant, KEYSPACE_PENDING_WRITE_RATIO, Knobs, Progress, Queued, acquire, acquire_queued, acquire_spared,
    acquire_with, release, release_with, top_up, top_up_queued,
};
pub use error::{Refusal, TENANT_ADMISSION_CONTROL_MARKER, WriteLimitKind};
pub use spare::{SPARE_MAX_US, Spare, return_tokens as return_spare};
#[cfg(feature = "agent")]
pub use {
    dynamic::{KEYSPACE_REDUCE_FACTOR, adjust_global_refill, adjust_keyspace_refill},
    estimate::{EstimateTracker, ema},
    fair::{FairInput, FairShare, fair_allocate},
    guard::{GuardInput, GuardStep, guard_step},
    keyspace::{
        BucketBook, BucketSnapshot, KeyspaceCounters, KeyspaceEntry, KeyspaceState, QuotaSource, RequestHistograms,
        WaitHistograms,
    },
    manager::{DEFAULT_CELLS, Policy},
    pd::{PdAction, PdFetch, PdLimit, PdParams, PdTracked, PdTracker},
    settings::{Settings, millicores_to_us_per_interval},
    snapshot::{KeyspaceSnapshot, OverflowSnapshot, PendingWritesSnapshot, PolicyCountersSnapshot, PolicySnapshot},
    tick::TickReport,
    window::{MonitorWindow, UsageSample, WaitsBehind},
};

/// How firmly the per-tenant concurrency limit is applied
/// (tenant-admission-control.md): the configuration's `admission-control.mode`,
/// one type from the TOML to the policy.
#[cfg(feature = "agent")]
pub use crate::config::AdmissionMode;
