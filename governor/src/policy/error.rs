//! Typed refusals of the fast path and errors of settings updates.
//!
//! A refusal always names its reason, so callers (retry loops, metrics, autoscalers) can tell
//! a deliberate hold-back of one tenant from a node that is out of capacity.

use serde::Serialize;

/// The marker carried by every refusal caused by tenant admission control.
///
/// This is a cross-process contract (matched on by autoscalers that must not grow the cluster on
/// behalf of a tenant that is being contained): treat it as API, not as log text.
pub const TENANT_ADMISSION_CONTROL_MARKER: &str = "tenant_admission_control";

/// Which pending-write threshold refused a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WriteLimitKind {
    /// The node-wide pending write bytes reached the global threshold.
    GlobalLimit,
    /// This keyspace's pending write bytes reached `0.3 × global threshold`.
    KeyspaceLimit,
}

impl std::fmt::Display for WriteLimitKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WriteLimitKind::GlobalLimit => "global_limit",
            WriteLimitKind::KeyspaceLimit => "keyspace_limit",
        })
    }
}

/// Why a request was not admitted. Returned by the fast path; never allocates.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Tenant-cap mode: the keyspace's uniform cap bucket is empty. No burst, no fallback.
    #[error("tenant cpu exhausted: keyspace {keyspace} is at its tenant cap")]
    TenantCpuExhausted {
        /// The keyspace refused.
        keyspace: u32,
    },
    /// A quota'd keyspace's bucket is empty and bursting was not possible.
    #[error("keyspace cpu exhausted: keyspace {keyspace} has no tokens and cannot burst")]
    KeyspaceCpuExhaustedNoBurst {
        /// The keyspace refused.
        keyspace: u32,
    },
    /// The node-level (global) bucket is empty; the tenant allocation was rolled back.
    #[error("global cpu exhausted while admitting keyspace {keyspace}")]
    GlobalCpuExhausted {
        /// The keyspace refused.
        keyspace: u32,
    },
    /// The low-priority DAG bucket is empty.
    #[error("low-priority dag cpu exhausted while admitting keyspace {keyspace}")]
    LowPriorityCpuExhausted {
        /// The keyspace refused.
        keyspace: u32,
    },
    /// Admission control (enforced mode): the tenant has too many requests in flight.
    #[error("tenant_admission_control: tenant {tenant} has {inflight} requests in flight, limit {limit}")]
    ConcurrencyLimited {
        /// The tenant (keyspace) refused.
        tenant: u32,
        /// Its requests in flight when refused.
        inflight: u64,
        /// Its limit.
        limit: u64,
    },
    /// The client already holds as many tickets as its ledger records.
    #[error("too many tickets: this client holds {limit}, its ledger's size")]
    TooManyTickets {
        /// Tickets the ledger holds.
        limit: u32,
    },
    /// Pending write bytes reached a threshold.
    #[error("write bytes limited ({kind}): keyspace {keyspace} pending {pending_bytes} >= {threshold_bytes}")]
    WriteBytesLimited {
        /// The keyspace refused.
        keyspace: u32,
        /// Which threshold it reached.
        kind: WriteLimitKind,
        /// Bytes pending (the node's or the keyspace's, as `kind` says).
        pending_bytes: u64,
        /// The threshold reached.
        threshold_bytes: u64,
    },
}

impl Refusal {
    /// The refusal's code: its label in metrics (`reason="…"`), in the
    /// protocol's `refused` reply and in [`crate::client::Refused::code`].
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::TenantCpuExhausted { .. } => "tenant_cap_exhausted",
            Refusal::KeyspaceCpuExhaustedNoBurst { .. } => "keyspace_exhausted",
            Refusal::GlobalCpuExhausted { .. } => "global_exhausted",
            Refusal::LowPriorityCpuExhausted { .. } => "low_priority_exhausted",
            Refusal::ConcurrencyLimited { .. } => TENANT_ADMISSION_CONTROL_MARKER,
            Refusal::TooManyTickets { .. } => "too_many_tickets",
            Refusal::WriteBytesLimited { kind: WriteLimitKind::GlobalLimit, .. } => "write_global_limit",
            Refusal::WriteBytesLimited { kind: WriteLimitKind::KeyspaceLimit, .. } => "write_keyspace_limit",
        }
    }

    /// True for refusals a wait in line can end (CPU tokens).
    pub fn is_cpu(&self) -> bool {
        matches!(
            self,
            Refusal::TenantCpuExhausted { .. }
                | Refusal::KeyspaceCpuExhaustedNoBurst { .. }
                | Refusal::GlobalCpuExhausted { .. }
        )
    }

    /// True for refusals caused by tenant admission control (see [`TENANT_ADMISSION_CONTROL_MARKER`]).
    pub fn is_tenant_admission_control(&self) -> bool {
        matches!(self, Refusal::ConcurrencyLimited { .. })
    }
}
