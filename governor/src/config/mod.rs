//! `keyspace_governor::config` — the agent's configuration file.
//!
//! # Layout
//!
//! - `units`: [`ConfigDuration`] durations (`"10ms"`) and [`ByteSize`] byte sizes (`"100MiB"`).
//! - `keyspace_list`: [`KeyspaceList`], `"id:value,..."` per-keyspace lists.
//! - `sections`, `throttle`: the sections the policy runs on, one type each
//!   from the file to the policy ([`ResourceControl`] with its
//!   [`CpuThrottle`], [`WriteQuota`], [`AdmissionControl`]).
//! - `raw`: [`RawConfig`], the file as written (serde, defaults,
//!   `deny_unknown_fields`, kebab-case keys from the seeds).
//! - `checker`: the error collector (lines, ranges, keyspace lists).
//! - `validate`: ranges and cross-field rules, including the Essential
//!   tenant-cap profile; every failure is reported, not just the first.
//! - `validated`: [`ValidatedConfig`], proven valid (`[agent]`, `[pd]` and
//!   `[[rules]]` typed by validation); prints back to
//!   TOML/JSON; [`ValidatedConfig::embedded_default`] from `default.toml`.
//! - `update`: online updates ([`ValidatedConfig::apply_update`],
//!   [`ValidatedConfig::apply_set`]), restart-only keys, [`ConfigDiff`].
//! - `access`: `[agent.access]`, the control socket's mode and roles ([`Access`]).
//! - `pd`: `[pd]`, the PD members service limits come from ([`Pd`]).
//! - `rules`: `[[rules]]`, unmodified processes measured by rule ([`Rule`]).
//! - `source`: maps dotted keys to lines so every error names both.
//! - `error`: [`ConfigError`], [`ConfigErrors`], [`UpdateRejected`].
//!
//! ```
//! # use keyspace_governor::config::ValidatedConfig;
//! let cfg = ValidatedConfig::from_toml_str("[agent]\nmax-threads = 1\n").unwrap_err();
//! assert_eq!(cfg.to_string(), "line 2: agent.max-threads: must be between 64 and 1048576, got 1");
//! ```

mod access;
mod checker;
mod error;
pub mod file;
mod keyspace_list;
mod pd;
mod raw;
mod rules;
mod sections;
mod source;
mod throttle;
mod units;
mod update;
mod validate;
mod validated;

pub use access::{Access, Peer, PrincipalError, RawAccess, Role};
pub use error::{ConfigError, ConfigErrors, UpdateRejected};
pub use keyspace_list::{KeyspaceId, KeyspaceList, ListError, ListValue};
pub use pd::{EndpointError, Pd, RawPd};
pub use raw::{AgentConfig, MeasureMode, RawConfig, UnknownBackend};
pub use rules::{MAX_RULES, ProcessIdentity, RawRule, Rule, cgroup_roots};
pub use sections::{AdmissionControl, AdmissionMode, LatencyGuard, ResourceControl, WriteQuota};
pub use source::SourceMap;
pub use throttle::{CpuThrottle, ESSENTIAL_TENANT_MAX_CPU_RATIO, Profile};
pub use units::{ByteSize, ConfigDuration, DurationError, SizeError};
pub use update::{ConfigDiff, HotUpdates, KeyChange};
pub use validated::{EMBEDDED_DEFAULT_TOML, ValidatedConfig};
