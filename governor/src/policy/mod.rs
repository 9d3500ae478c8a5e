//! `governor::policy` — the pure, deterministic CPU governor policy.
//!
//! # Layout
//! - `bucket` — [`BucketCell`], the `#[repr(C)]` all-atomic token bucket (fast path).
//! - `keyspace` — per-keyspace entry: bucket + published estimate/burst/ratio + counters.
//! - `manager` — [`Policy`] and its fast path: `allocate`, `allocate_more`, `release`,
//!   `allocate_low_priority`.
//! - `agent` — the agent loop side: `tick` (refill, monitor window, estimates, burst flags,
//!   dynamic and fair refill, idle eviction).
//! - `low_priority` — the low-priority DAG bucket in front of the cap-aware path.
//! - `hot` — online updates (tenant cap ratio, idle TTL, quotas, whole settings).
//! - `pd` — PD service-limit proportional quotas from fetched values.
//! - `window`, `fair`, `dynamic`, `estimate` — pure functions and small state machines.
//! - `write_quota` — pending write bytes, global + 30 % per keyspace.
//! - `admission` — per-tenant concurrency (disabled / monitor / enforced).
//! - `settings`, `error`, `grant`, `snapshot` — inputs, refusals, outputs.
//!
//! Every time-dependent function takes `now_us`, a simulated clock in microseconds.

mod admission;
mod agent;
mod bucket;
mod dynamic;
mod error;
mod estimate;
mod fair;
mod from_config;
mod grant;
mod hot;
mod keyspace;
mod low_priority;
mod manager;
mod pd;
mod settings;
mod snapshot;
mod window;
mod write_quota;

pub use admission::{AdmissionCounters, AdmissionMode, AdmissionPermit, TenantAdmission};
pub use agent::TickReport;
pub use bucket::{BucketCell, BucketSnapshot};
pub use dynamic::{KEYSPACE_REDUCE_FACTOR, adjust_global_refill, adjust_keyspace_refill};
pub use error::{Refusal, SettingsError, TENANT_ADMISSION_CONTROL_MARKER, WriteLimitKind};
pub use estimate::{EstimateTracker, ema, static_estimate_us};
pub use fair::{FairInput, FairShare, fair_allocate};
pub use grant::{Grant, PolicyCounters, PolicyCountersSnapshot};
pub use keyspace::{IdHasher, KeyspaceCounters, KeyspaceEntry, QuotaSource};
pub use manager::Policy;
pub use pd::{PdAction, PdFetch, PdLimit, PdParams, PdTracker};
pub use settings::{Settings, millicores_to_us_per_interval};
pub use snapshot::{KeyspaceSnapshot, PolicySnapshot};
pub use window::{MonitorWindow, UsageSample};
pub use write_quota::{KEYSPACE_PENDING_WRITE_RATIO, PendingWrites, PendingWritesSnapshot};
