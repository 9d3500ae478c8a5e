//! PD's service limits, as status reports them.

use serde::{Deserialize, Serialize};

/// The PD service-limit client (`agent::pd`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PdStatus {
    /// Members asked, in order; the first answered last time.
    pub endpoints: Vec<String>,
    /// Fetch rounds so far.
    pub rounds: u64,
    /// Unix time of the last round that got an answer from PD.
    pub last_success_unix: Option<f64>,
    /// Whether the last round reached PD at all (quotas stay when not).
    pub reachable: bool,
    /// Keyspace fetches by result, since start: `ok`, `not_found`,
    /// `archived`, `no_name`, `error`, `timeout`, `unreachable`,
    /// `malformed`, `skipped`.
    pub results: std::collections::BTreeMap<String, u64>,
    pub keyspaces: Vec<PdKeyspaceStatus>,
}

/// One keyspace as PD sees it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PdKeyspaceStatus {
    pub keyspace_id: u32,
    /// Its name in PD (the service-limit API is keyed by name).
    pub name: Option<String>,
    /// Its state in PD (`ENABLED`, `DISABLED`, `ARCHIVED`, `TOMBSTONE`).
    pub state: Option<String>,
    /// Last `service_limit` (RU/s; 0: unlimited).
    pub service_limit: Option<f64>,
    /// PD quota applied, µs per refill interval.
    pub quota_us: Option<u64>,
    pub consecutive_404: u32,
    /// Seconds since PD last gave a value.
    pub seconds_since_ok: Option<f64>,
    /// Result of its last fetch.
    pub last_result: String,
}
