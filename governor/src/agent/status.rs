//! What `governor status` shows, assembled from the measurement, the
//! policy and the slot table.

use super::Shared;
use crate::policy::{KeyspaceCounters, QuotaSource};
use crate::proto::{AdmissionStatus, BucketStatus, KeyspaceStatus, OverflowStatus, StatusReport, WaitBehind};
use std::sync::atomic::Ordering;

fn source_name(s: QuotaSource) -> &'static str {
    match s {
        QuotaSource::Config => "config",
        QuotaSource::Pd => "pd",
        QuotaSource::TenantCap => "tenant_cap",
    }
}

fn refused(c: &KeyspaceCounters) -> u64 {
    c.refused_keyspace + c.refused_global + c.refused_write + c.refused_concurrency
}

impl Shared {
    fn overflow_status(&self, snap: &crate::policy::PolicySnapshot) -> OverflowStatus {
        let o = &snap.overflow;
        let seen = self.lock_cell_grants().overflow();
        OverflowStatus {
            keyspaces: seen.recent,
            by_uid_quota: seen.by_uid_quota,
            cells_refused: seen.refused_total,
            bucket: o.source.map(|src| BucketStatus {
                source: source_name(src).into(),
                available_us: o.bucket.available_us,
                capacity_us: o.bucket.capacity_us.max(0) as u64,
                refill_us: o.bucket.refill_us,
                inflight_us: o.bucket.inflight_us,
                debt_us: (-o.bucket.available_us).max(0) as u64,
                sleepers: self.policy.regions().bucket(crate::region::OVERFLOW).sleepers.load(Ordering::Relaxed),
            }),
            granted: o.counters.granted,
            refused: refused(&o.counters),
            inflight_requests: o.inflight_requests,
            pending_write_bytes: o.pending_write_bytes,
            cpu_seconds: o.counters.consumed_us as f64 / 1e6,
        }
    }

    pub(crate) fn status(&self) -> StatusReport {
        self.status_of(&self.policy.snapshot())
    }

    /// The status report built from `snap`: a scrape renders both from the
    /// same snapshot.
    pub(crate) fn status_of(&self, snap: &crate::policy::PolicySnapshot) -> StatusReport {
        // Before the measurement lock: the policy's engine lock comes first.
        let pd = self.pd.status(self);
        let s = self.policy.settings();
        let r = self.policy.regions();
        let mut server_cpu = self.lock_server_cpu().status();
        // The engine too: the tick holds it while it asks which cells are
        // pinned (the measurement lock), so taking it under that lock could
        // deadlock with an eviction.
        let (span_us, window) = self.policy.window_cpu();
        // The same for everything else that takes the engine, the cell
        // grants or the configuration: a configuration change holds the
        // configuration while it takes the measurement and rules locks, and
        // a keyspace's cell request holds the grants while it takes the
        // engine, so none of them may be taken under the measurement lock.
        let cells_in_use = self.policy.cells_in_use() as u32;
        let overflow = self.overflow_status(snap);
        let config_updates = self.lock_config().counts();
        let m = self.lock_measurement();
        // Slots before rules, as the tick's pinned cells take them.
        let threads = self.lock_slots().stats();
        let usage = self.lock_usage();
        server_cpu.untagged_cpu_seconds = usage.untagged_ns as f64 / 1e9;
        let rules = self.lock_rules();
        let rule_names = rules.names_by_keyspace();
        let buckets: std::collections::HashMap<u32, &crate::policy::KeyspaceSnapshot> =
            snap.keyspaces.iter().map(|k| (k.keyspace, k)).collect();
        let counters_read_at_ns = crate::sys::monotonic_ns();
        let mut keyspaces: Vec<KeyspaceStatus> = r
            .directory()
            .live()
            .map(|(id, cell)| {
                let (b, p) = r.keyspace_cell(cell).expect("live cell");
                let generation = p.generation.load(Ordering::Acquire);
                let cpu_ns = usage.current_ns(&m, cell, id, generation);
                let (waits, window_waits, span_ns) = usage.waits.current(&m, cell, id, generation);
                let us = |q: f64| window_waits.quantile_ns(q).map(|ns| (ns / 10.0).round() / 100.0);
                let k = buckets.get(&id);
                let c = k.map(|k| k.counters).unwrap_or_else(|| KeyspaceCounters::of(b));
                let mut status = KeyspaceStatus {
                    keyspace_id: id,
                    cpu_seconds: cpu_ns as f64 / 1e9,
                    cpu_wait_seconds: waits.wait_ns as f64 / 1e9,
                    cpu_waits: waits.waits,
                    cpu_wait_p50_us: us(0.5),
                    cpu_wait_p99_us: us(0.99),
                    cpu_wait_buckets: if waits.waits == 0 { Vec::new() } else { waits.hist.to_vec() },
                    cpu_pressure_some_seconds: waits.some_ns as f64 / 1e9,
                    cpu_pressure_some: None,
                    cpu_wait_behind: usage
                        .waits
                        .behind(cell, id, generation)
                        .into_iter()
                        .map(|(b, ns)| WaitBehind {
                            behind: b.name().into(),
                            keyspace_id: b.keyspace_id(),
                            seconds: ns as f64 / 1e9,
                        })
                        .collect(),
                    window_ratio: if span_us == 0 {
                        0.0
                    } else {
                        window.get(&id).copied().unwrap_or(0) as f64 / (span_us as f64 * server_cpu.cores)
                    },
                    bucket: k.map(|k| BucketStatus {
                        source: source_name(k.source).into(),
                        available_us: k.available_us,
                        capacity_us: k.capacity_us.max(0) as u64,
                        refill_us: k.refill_us,
                        inflight_us: k.inflight_us,
                        debt_us: k.debt_us,
                        sleepers: b.sleepers.load(Ordering::Relaxed),
                    }),
                    estimate_us: p.estimate_us.load(Ordering::Relaxed),
                    granted: c.granted,
                    refused: refused(&c),
                    refused_global: c.refused_global,
                    waited: c.waited,
                    inflight_requests: b.inflight_requests.load(Ordering::Relaxed),
                    pending_write_bytes: b.pending_write_bytes.load(Ordering::Relaxed),
                    pool_rejections: c.pool_rejected,
                    topups_refused: c.topups_refused,
                    topups_waited: c.topups_waited,
                    rule: rule_names.get(&id).cloned(),
                };
                if m.pressure && span_ns > 0 && status.pressure_counted() {
                    status.cpu_pressure_some = Some((window_waits.some_ns as f64 / span_ns as f64).min(1.0));
                }
                status
            })
            .collect();
        keyspaces.sort_by_key(|k| k.keyspace_id);
        let thread_clock_source = if m.is_fallback() {
            "thread-cputime"
        } else if crate::tsc::now_ns(&r.header().clock).is_some() {
            "tsc"
        } else {
            "vdso"
        };
        let g = r.bucket(crate::region::GLOBAL);
        let c = snap.counters;
        // From the counters the rows above already read: tickets that waited
        // or were refused, per keyspace.
        let held_back = keyspaces.iter().map(|k| (k.keyspace_id, k.waited + k.refused)).collect();
        let autoscale = self.autoscale.lock().signals(c.concurrency_refused, &held_back, &window);
        StatusReport {
            backend: m.kind,
            thread_clock_source: thread_clock_source.to_string(),
            logical_cores: crate::sys::logical_cores(),
            wait_source: m.wait_source.as_str().to_string(),
            cpu_pressure: m.pressure,
            server_cpu,
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            window_seconds: span_us as f64 / 1e6,
            threads,
            admission: AdmissionStatus {
                enabled: s.resource.enabled,
                throttle: s.throttle().enabled,
                tenant_max_cpu_ratio: s.throttle().tenant_max_cpu_ratio,
                admission_mode: format!("{:?}", s.admission.mode).to_lowercase(),
                global: BucketStatus {
                    source: "global".into(),
                    available_us: snap.global.available_us,
                    capacity_us: snap.global.capacity_us.max(0) as u64,
                    refill_us: snap.global.refill_us,
                    inflight_us: g.inflight_us(),
                    debt_us: (-snap.global.available_us).max(0) as u64,
                    sleepers: g.sleepers.load(Ordering::Relaxed),
                },
                global_ratio: snap.global_ratio,
                global_pending_write_bytes: snap.pending_writes.global_bytes,
                pending_write_threshold_bytes: snap.pending_writes.global_threshold_bytes,
                keyspace_pending_write_threshold_bytes: snap.pending_writes.keyspace_threshold_bytes,
                max_concurrent_per_tenant: snap.max_concurrent_per_tenant,
                cells_in_use,
                cells: r.directory().len(),
                granted: c.granted,
                refused: c.tenant_cap_exhausted
                    + c.keyspace_exhausted
                    + c.global_exhausted
                    + c.low_priority_exhausted
                    + c.write_refused_global
                    + c.write_refused_keyspace
                    + c.concurrency_refused,
                waited: c.waited,
                fail_open: c.fail_open,
                reclaimed: c.reclaimed,
                monitor_breaches: c.concurrency_monitor_breaches,
                global_overdrafts: c.global_best_effort_overdraft,
                overflow,
                latency_guard: crate::proto::LatencyGuardStatus {
                    enabled: s.latency_guard.enabled,
                    target_wait_p99_us: s.latency_guard.target_wait_p99.get().as_micros() as u64,
                    floor_ratio: s.latency_guard.floor_ratio,
                    decrease: s.latency_guard.decrease,
                    increase: s.latency_guard.increase,
                    suffering: snap.latency_guard_suffering.clone(),
                    waiting_elsewhere: snap.latency_guard_waiting_elsewhere.clone(),
                },
            },
            keyspaces,
            counters_read_at_ns,
            programs: m.program_stats(),
            metrics_addr: self.metrics_addr.map(|a| a.to_string()),
            config_updates,
            lock_order_violations: crate::ranked::violations(),
            rules: rules.status(),
            rule_events: rules.events,
            rule_events_dropped: rules.dropped,
            rule_enforcement: rules.enforcer.as_ref().map_or_else(String::new, |e| e.describe()),
            autoscale,
            pd,
        }
    }
}

impl Shared {
    /// Every registered thread with its keyspace and CPU, names still empty.
    pub(crate) fn thread_rows(&self) -> Vec<crate::proto::ThreadInfo> {
        let r = self.policy.regions();
        let ids: std::collections::HashMap<u32, u32> = r.directory().live().map(|(id, cell)| (cell, id)).collect();
        let m = self.lock_measurement();
        let holders = self.lock_slots().holders();
        holders
            .into_iter()
            .map(|(slot, tid, pid, uid)| {
                let view = m.regions.slots.get(slot);
                let tag = view.map_or(0, |v| v.tag.load(Ordering::Relaxed));
                let (counted, charged) =
                    view.map_or((0, 0), |v| (v.oncpu_ns.load(Ordering::Relaxed), v.charged_ns.load(Ordering::Relaxed)));
                crate::proto::ThreadInfo {
                    pid,
                    process: String::new(),
                    tid,
                    name: String::new(),
                    uid,
                    slot,
                    keyspace: keyspace_governor_common::cell_of_tag(tag).and_then(|c| ids.get(&c).copied()),
                    cpu_seconds: counted as f64 / 1e9,
                    charged_ahead_ns: charged.saturating_sub(counted),
                }
            })
            .collect()
    }
}

/// Fills in process and thread names from /proc (a name that cannot be
/// read, of a thread that just exited, stays empty).
pub(crate) fn name_threads(mut rows: Vec<crate::proto::ThreadInfo>) -> Vec<crate::proto::ThreadInfo> {
    let mut processes: std::collections::HashMap<u32, String> = std::collections::HashMap::new();
    for t in &mut rows {
        t.process = processes.entry(t.pid).or_insert_with(|| crate::procs::comm(t.pid).unwrap_or_default()).clone();
        t.name = crate::procs::thread_comm(t.pid, t.tid).unwrap_or_default();
    }
    rows
}
