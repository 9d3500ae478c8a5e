//! The PD service-limit client: every `pd-service-limit-fetch-interval`,
//! each known keyspace's `service_limit` is read from PD and folded into
//! the keyspace quotas (`policy::pd` decides; this module only asks).
//!
//! Per keyspace and round:
//! 1. its name and state, `GET /pd/api/v2/keyspaces/id/{id}` (the
//!    service-limit API is keyed by name). A keyspace PD has archived or
//!    tombstoned loses its PD quota at once. When PD gives no name, the last
//!    known one is used; with none, the keyspace sits this round out.
//! 2. its limit, `GET /resource-manager/api/v1/config/keyspace/service-limit/{name}`:
//!    `{"service_limit": RU/s}`; a 404 counts towards
//!    `pd-service-limit-consecutive-404`.
//!
//! Known keyspaces are the configured quotas and every keyspace with a cell.
//! Each request has `pd-service-limit-request-timeout`; members of
//! `[pd] endpoints` are tried in turn, starting with the one that answered
//! last. At most eight keyspaces are asked at once, and a round never runs
//! past the fetch interval: what it did not reach waits for the next.
//!
//! Faults never cost a quota early. A round in which PD answered nothing at
//! all (down, partitioned, every reply too slow) changes nothing; a keyspace
//! whose own fetches fail keeps its quota until `pd-service-limit-ttl`
//! passes without a value. `tikv_service_limit_fetch_total{result}` and
//! `governor status` say what happened.

use super::Shared;
use crate::config::ValidatedConfig;
use crate::policy::{PdFetch, PdLimit};
use crate::proto::{PdKeyspaceStatus, PdStatus};
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

/// Keyspaces asked at once.
const CONCURRENCY: usize = 8;
/// Largest reply read, bytes.
const MAX_BODY: usize = 64 * 1024;
/// How often a disabled client looks at the configuration again.
const IDLE_CHECK: Duration = Duration::from_secs(1);
/// Upper bounds of `tikv_service_limit_fetch_duration_seconds`.
const DURATION_BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0];

/// What became of one keyspace's fetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Ok,
    NotFound,
    Archived,
    /// No name for it, from PD or from before.
    NoName,
    /// PD answered with a status other than 200 or 404.
    Error,
    Timeout,
    /// No member could be connected to, or the connection broke.
    Unreachable,
    /// 200 with a body that is not the expected JSON.
    Malformed,
    /// The round's time ran out before it was asked.
    Skipped,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::NotFound => "not_found",
            Outcome::Archived => "archived",
            Outcome::NoName => "no_name",
            Outcome::Error => "error",
            Outcome::Timeout => "timeout",
            Outcome::Unreachable => "unreachable",
            Outcome::Malformed => "malformed",
            Outcome::Skipped => "skipped",
        }
    }

    /// PD itself answered (so it is reachable).
    fn answered(self) -> bool {
        matches!(
            self,
            Outcome::Ok | Outcome::NotFound | Outcome::Archived | Outcome::Error | Outcome::Malformed | Outcome::NoName
        )
    }
}

/// A keyspace's name and state in PD.
#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
struct Meta {
    name: String,
    #[serde(default)]
    state: Option<String>,
}

impl Meta {
    fn gone(&self) -> bool {
        matches!(self.state.as_deref(), Some("ARCHIVED" | "TOMBSTONE"))
    }
}

#[derive(serde::Deserialize)]
struct ServiceLimit {
    service_limit: f64,
}

#[derive(Default)]
struct State {
    names: HashMap<u32, Meta>,
    last: HashMap<u32, Outcome>,
    results: BTreeMap<&'static str, u64>,
    rounds: u64,
    last_success_unix: Option<f64>,
    reachable: bool,
    endpoints: Vec<String>,
}

/// The client's memory between rounds, and its metrics.
pub(crate) struct PdClient {
    state: Mutex<State>,
    /// Index into the endpoints of the member that answered last.
    preferred: AtomicUsize,
    pub(super) duration: prometheus::Histogram,
}

impl Default for PdClient {
    fn default() -> Self {
        let opts = prometheus::HistogramOpts::new(
            "tikv_service_limit_fetch_duration_seconds",
            "Time to fetch one keyspace's service limit from PD (name and limit)",
        )
        .buckets(DURATION_BUCKETS.to_vec());
        PdClient {
            state: Mutex::default(),
            preferred: AtomicUsize::new(0),
            duration: prometheus::Histogram::with_opts(opts).expect("valid histogram"),
        }
    }
}

/// A request that got no HTTP answer.
enum Transport {
    Timeout,
    Broken,
}

impl PdClient {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `GET path` from the first member that answers.
    async fn get(&self, endpoints: &[String], path: &str, timeout: Duration) -> Result<(u16, Bytes), Transport> {
        let start = self.preferred.load(Ordering::Relaxed);
        // A member that was too slow says more than one that refused.
        let mut failure = Transport::Broken;
        for i in 0..endpoints.len() {
            let at = (start + i) % endpoints.len();
            let authority = endpoints[at].trim_start_matches("http://");
            match tokio::time::timeout(timeout, get_once(authority, path)).await {
                Ok(Ok(reply)) => {
                    self.preferred.store(at, Ordering::Relaxed);
                    return Ok(reply);
                }
                Ok(Err(e)) => log::debug!("PD {authority}{path}: {e}"),
                Err(_) => failure = Transport::Timeout,
            }
        }
        Err(failure)
    }

    /// One keyspace: its name (refreshed), then its limit.
    async fn fetch(
        &self,
        endpoints: &[String],
        id: u32,
        known: Option<Meta>,
        timeout: Duration,
    ) -> (Option<Meta>, Outcome, Option<PdLimit>) {
        let fresh = match self.get(endpoints, &format!("/pd/api/v2/keyspaces/id/{id}"), timeout).await {
            Ok((200, body)) => match serde_json::from_slice::<Meta>(&body) {
                Ok(m) if !m.name.is_empty() => Some(m),
                _ => return (known, Outcome::Malformed, None),
            },
            // Not known to PD (yet): the last name, if any, still serves.
            Ok(_) => None,
            Err(Transport::Timeout) => return (known, Outcome::Timeout, None),
            Err(Transport::Broken) => return (known, Outcome::Unreachable, None),
        };
        let Some(meta) = fresh.or(known) else {
            return (None, Outcome::NoName, None);
        };
        if meta.gone() {
            return (Some(meta), Outcome::Archived, Some(PdLimit::Gone));
        }
        let path = format!("/resource-manager/api/v1/config/keyspace/service-limit/{}", path_segment(&meta.name));
        let (outcome, limit) = match self.get(endpoints, &path, timeout).await {
            Ok((200, body)) => match serde_json::from_slice::<ServiceLimit>(&body) {
                Ok(l) if l.service_limit.is_finite() && l.service_limit >= 0.0 => {
                    (Outcome::Ok, Some(PdLimit::Limit(l.service_limit)))
                }
                _ => (Outcome::Malformed, None),
            },
            Ok((404, _)) => (Outcome::NotFound, Some(PdLimit::NotFound)),
            Ok(_) => (Outcome::Error, None),
            Err(Transport::Timeout) => (Outcome::Timeout, None),
            Err(Transport::Broken) => (Outcome::Unreachable, None),
        };
        (Some(meta), outcome, limit)
    }

    /// What `governor status` shows.
    pub(crate) fn status(&self, shared: &Shared) -> Option<PdStatus> {
        let config = shared.running_config();
        let t = config.cpu_throttle();
        if !t.enable_pd_service_limit || t.tenant_cap_enabled() {
            return None;
        }
        let now = super::now_us();
        let s = self.lock();
        let mut rows: BTreeMap<u32, PdKeyspaceStatus> = BTreeMap::new();
        for (&id, outcome) in &s.last {
            let meta = s.names.get(&id);
            rows.insert(
                id,
                PdKeyspaceStatus {
                    keyspace_id: id,
                    name: meta.map(|m| m.name.clone()),
                    state: meta.and_then(|m| m.state.clone()),
                    last_result: outcome.label().to_string(),
                    ..Default::default()
                },
            );
        }
        for t in shared.policy.pd_tracked() {
            let row = rows
                .entry(t.keyspace)
                .or_insert_with(|| PdKeyspaceStatus { keyspace_id: t.keyspace, ..Default::default() });
            row.service_limit = Some(t.service_limit);
            row.quota_us = t.quota_us;
            row.consecutive_404 = t.consecutive_404;
            row.seconds_since_ok = Some(now.saturating_sub(t.last_ok_us) as f64 / 1e6);
        }
        let endpoints = if s.endpoints.is_empty() { config.pd().endpoints.clone() } else { s.endpoints.clone() };
        Some(PdStatus {
            endpoints,
            rounds: s.rounds,
            last_success_unix: s.last_success_unix,
            reachable: s.reachable,
            results: s.results.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            keyspaces: rows.into_values().collect(),
        })
    }
}

/// `name` as one URL path segment.
fn path_segment(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// One HTTP/1.1 GET on a fresh connection.
async fn get_once(authority: &str, path: &str) -> Result<(u16, Bytes), Box<dyn std::error::Error + Send + Sync>> {
    let stream = tokio::net::TcpStream::connect(authority).await?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    let driver = tokio::spawn(connection);
    let request = hyper::Request::get(path)
        .header(hyper::header::HOST, authority)
        .header(hyper::header::USER_AGENT, concat!("governor/", env!("CARGO_PKG_VERSION")))
        .header(hyper::header::ACCEPT, "application/json")
        .body(Empty::<Bytes>::new())?;
    let reply = async {
        let response = sender.send_request(request).await?;
        let status = response.status().as_u16();
        let body = Limited::new(response.into_body(), MAX_BODY).collect().await?.to_bytes();
        Ok((status, body))
    }
    .await;
    driver.abort();
    reply
}

impl Shared {
    /// Keyspaces PD is asked about: the configured quotas and every keyspace
    /// with a cell (PD has no keyspace 0).
    fn pd_keyspaces(&self, config: &ValidatedConfig) -> Vec<u32> {
        let mut ids: Vec<u32> = self.policy.regions().directory().live().map(|(id, _)| id).collect();
        ids.extend(config.cpu_throttle().keyspace_cpu_quotas.iter().map(|(id, _)| id));
        ids.retain(|&id| id != 0);
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

/// Fetches on the interval for as long as the agent runs.
pub(super) async fn run(shared: Arc<Shared>) {
    loop {
        let config = shared.running_config();
        let t = config.cpu_throttle();
        if !t.enable_pd_service_limit || t.tenant_cap_enabled() {
            tokio::time::sleep(IDLE_CHECK).await;
            continue;
        }
        let started = Instant::now();
        round(&shared, &config).await;
        // The interval as configured now; a change to PD's keys is seen
        // within a second.
        loop {
            let c = shared.running_config();
            let t = c.cpu_throttle();
            let left = t.pd_service_limit_fetch_interval.get().saturating_sub(started.elapsed());
            if left.is_zero() || !t.enable_pd_service_limit || c.pd() != config.pd() {
                break;
            }
            tokio::time::sleep(left.min(IDLE_CHECK)).await;
        }
    }
}

/// One round over every known keyspace.
async fn round(shared: &Arc<Shared>, config: &ValidatedConfig) {
    let t = config.cpu_throttle();
    let endpoints = Arc::new(config.pd().endpoints.clone());
    let timeout = t.pd_service_limit_request_timeout.get();
    let deadline = tokio::time::Instant::now() + t.pd_service_limit_fetch_interval.get();
    let ids = shared.pd_keyspaces(config);
    {
        let mut s = shared.pd.lock();
        if s.endpoints != *endpoints {
            shared.pd.preferred.store(0, Ordering::Relaxed);
            s.endpoints = endpoints.to_vec();
        }
    }
    let permits = Arc::new(tokio::sync::Semaphore::new(CONCURRENCY));
    let mut tasks = tokio::task::JoinSet::new();
    for &id in &ids {
        let (shared, endpoints, permits) = (shared.clone(), endpoints.clone(), permits.clone());
        let known = shared.pd.lock().names.get(&id).cloned();
        tasks.spawn(async move {
            let work = async {
                let _permit = permits.acquire_owned().await.expect("never closed");
                let start = Instant::now();
                let r = shared.pd.fetch(&endpoints, id, known, timeout).await;
                shared.pd.duration.observe(start.elapsed().as_secs_f64());
                r
            };
            let r = tokio::time::timeout_at(deadline, work).await.unwrap_or((None, Outcome::Skipped, None));
            (id, r)
        });
    }
    let mut answers = BTreeMap::new();
    let mut outcomes = Vec::with_capacity(ids.len());
    while let Some(joined) = tasks.join_next().await {
        let Ok((id, (meta, outcome, limit))) = joined else { continue };
        outcomes.push((id, meta, outcome));
        if let Some(l) = limit {
            answers.insert(id, l);
        }
    }
    let reachable = outcomes.iter().any(|(_, _, o)| o.answered());
    let fetch = if reachable || ids.is_empty() { PdFetch::Fetched(answers) } else { PdFetch::Unreachable };
    let actions = shared.policy.apply_pd_service_limits(super::now_us(), &fetch);
    {
        let mut s = shared.pd.lock();
        s.rounds += 1;
        s.reachable = reachable || ids.is_empty();
        if outcomes.iter().any(|(_, _, o)| matches!(o, Outcome::Ok | Outcome::NotFound | Outcome::Archived)) {
            s.last_success_unix =
                SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).ok().map(|d| d.as_secs_f64());
        }
        for (id, meta, outcome) in outcomes {
            *s.results.entry(outcome.label()).or_default() += 1;
            s.last.insert(id, outcome);
            match meta {
                Some(m) => {
                    s.names.insert(id, m);
                }
                None if outcome == Outcome::NoName => {
                    s.names.remove(&id);
                }
                None => {}
            }
        }
        let live: std::collections::HashSet<u32> = ids.iter().copied().collect();
        s.last.retain(|id, _| live.contains(id));
        s.names.retain(|id, _| live.contains(id));
    }
    if !reachable && !ids.is_empty() {
        log::warn!("PD service limits: no member of {:?} answered; quotas stay as they are", endpoints);
    }
    for a in actions {
        match a {
            crate::policy::PdAction::Set { keyspace, quota_us } => {
                log::info!("PD service limits: keyspace {keyspace} quota {quota_us} µs per refill interval")
            }
            crate::policy::PdAction::Remove { keyspace } => {
                log::info!("PD service limits: keyspace {keyspace} PD quota removed")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::path_segment;

    #[test]
    fn names_are_escaped_as_one_path_segment() {
        assert_eq!(path_segment("tenant-01_a.b~c"), "tenant-01_a.b~c");
        assert_eq!(path_segment("a/b c?"), "a%2Fb%20c%3F");
        assert_eq!(path_segment("ü"), "%C3%BC");
    }
}
