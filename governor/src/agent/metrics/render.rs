//! One scrape's exposition: every family from the status and the policy's
//! snapshot, per-keyspace rows folded past the limit.

mod per_keyspace;

use super::histograms::{Series, header, series};
use crate::policy::{KeyspaceSnapshot, PolicySnapshot};
use crate::proto::StatusReport;
use keyspace_governor_common::{WAIT_BUCKETS, wait_bucket_le_ns};
use prometheus::{CounterVec, Encoder, Gauge, GaugeVec, IntCounter, IntCounterVec, Opts, Registry, TextEncoder};
use std::collections::HashMap;

/// Registers metric families on a registry made for one scrape.
struct Families {
    registry: Registry,
}

impl Families {
    fn gauge(&self, name: &str, help: &str, value: f64) {
        let g = Gauge::new(name, help).expect("valid metric name");
        g.set(value);
        self.registry.register(Box::new(g)).expect("registered once");
    }

    fn counter(&self, name: &str, help: &str, value: u64) {
        let c = IntCounter::new(name, help).expect("valid metric name");
        c.inc_by(value);
        self.registry.register(Box::new(c)).expect("registered once");
    }

    fn gauges(&self, name: &str, help: &str, label: &str, values: &[(String, f64)]) {
        let g = GaugeVec::new(Opts::new(name, help), &[label]).expect("valid metric name");
        for (l, v) in values {
            g.with_label_values(&[l.as_str()]).set(*v);
        }
        self.registry.register(Box::new(g)).expect("registered once");
    }

    /// A counter of seconds per label value.
    fn seconds(&self, name: &str, help: &str, label: &str, values: &[(String, f64)]) {
        let c = CounterVec::new(Opts::new(name, help), &[label]).expect("valid metric name");
        for (l, v) in values {
            c.with_label_values(&[l.as_str()]).inc_by(*v);
        }
        self.registry.register(Box::new(c)).expect("registered once");
    }

    fn counters(&self, name: &str, help: &str, label: &str, values: &[(String, u64)]) {
        let c = IntCounterVec::new(Opts::new(name, help), &[label]).expect("valid metric name");
        for (l, v) in values {
            c.with_label_values(&[l.as_str()]).inc_by(*v);
        }
        self.registry.register(Box::new(c)).expect("registered once");
    }
}

/// One keyspace's numbers, as the per-keyspace families show them.
#[derive(Clone, Default)]
struct Row {
    cpu_seconds: f64,
    ratio: f64,
    bucket: Option<(f64, f64, f64, f64, f64)>,
    fair: u64,
    burst: u64,
    burst_us: u64,
    waited: u64,
    granted: u64,
    refused: u64,
    pool_rejected: u64,
    topups_granted: u64,
    topups_refused: u64,
    topups_waited: u64,
    wait_hist: crate::policy::WaitHistograms,
    request_hist: crate::policy::RequestHistograms,
    /// Run-queue wait: ns in all, and waits by log-2 bucket.
    cpu_wait_ns: u64,
    cpu_wait_hist: [u64; WAIT_BUCKETS],
    /// Time with at least one of its threads waiting (ns).
    cpu_some_ns: u64,
    /// Its pressure is counted: it is not a keyspace measured by rule
    /// alone (status shows none for one).
    some_counted: bool,
}

impl Row {
    fn add(&mut self, o: &Row) {
        self.cpu_seconds += o.cpu_seconds;
        self.ratio += o.ratio;
        if let Some((a, c, r, i, d)) = o.bucket {
            let (a0, c0, r0, i0, d0) = self.bucket.unwrap_or_default();
            self.bucket = Some((a0 + a, c0 + c, r0 + r, i0 + i, d0 + d));
        }
        self.fair += o.fair;
        self.burst += o.burst;
        self.burst_us += o.burst_us;
        self.waited += o.waited;
        self.granted += o.granted;
        self.refused += o.refused;
        self.pool_rejected += o.pool_rejected;
        self.topups_granted += o.topups_granted;
        self.topups_refused += o.topups_refused;
        self.topups_waited += o.topups_waited;
        self.wait_hist.add(&o.wait_hist);
        self.request_hist.add(&o.request_hist);
        self.cpu_wait_ns += o.cpu_wait_ns;
        self.cpu_some_ns += o.cpu_some_ns;
        self.some_counted |= o.some_counted;
        for (a, b) in self.cpu_wait_hist.iter_mut().zip(o.cpu_wait_hist) {
            *a += b;
        }
    }
}

/// `tikv_service_limit_fetch_duration_seconds`, kept across scrapes.
pub(super) fn render_pd_duration(h: &prometheus::Histogram) -> String {
    let mut out = Vec::new();
    TextEncoder::new().encode(&prometheus::core::Collector::collect(h), &mut out).expect("text encoding");
    String::from_utf8(out).expect("text format is UTF-8")
}

/// The exposition for one scrape.
pub(crate) fn render(status: &StatusReport, snap: &PolicySnapshot, max_keyspaces: usize) -> String {
    let f = Families { registry: Registry::new() };
    let a = &status.admission;

    // Monitor window and buckets (keyspace-cpu-throttle.md, Metrics).
    f.gauge(
        "tikv_cpu_usage_monitor_global_ratio",
        "CPU over the monitor window / (cores × max-read-cpu-ratio × window)",
        snap.global_ratio,
    );
    f.gauge(
        "tikv_cpu_throttle_global_bucket_available_us",
        "Tokens in the node's global bucket (negative: debt or waiters)",
        a.global.available_us as f64,
    );
    f.gauge(
        "tikv_cpu_throttle_global_bucket_capacity_us",
        "Capacity of the node's global bucket",
        a.global.capacity_us as f64,
    );
    f.gauge(
        "tikv_cpu_throttle_global_refill_rate_us_per_interval",
        "Global refill per refill interval",
        a.global.refill_us as f64,
    );
    let c = &snap.counters;
    let results = [
        ("granted", c.granted.saturating_sub(c.skipped)),
        ("skipped", c.skipped),
        ("tenant_cap_exhausted", c.tenant_cap_exhausted),
        ("keyspace_exhausted", c.keyspace_exhausted),
        ("global_exhausted", c.global_exhausted),
        ("low_priority_exhausted", c.low_priority_exhausted),
    ];
    f.counters(
        "tikv_cpu_throttle_allocations_total",
        "Token allocations by result",
        "result",
        &results.iter().map(|(l, v)| (l.to_string(), *v)).collect::<Vec<_>>(),
    );
    f.counters(
        "tikv_cpu_token_runtime_allocations_total",
        "Runtime top-ups of running requests by result",
        "result",
        &[("granted".into(), c.topup_granted), ("refused".into(), c.topup_refused)],
    );

    // Tenant cap (tenant-cpu-cap.md §5.4), its name and label as the seed
    // writes them (a counter without the `_total` suffix).
    f.counters(
        "cpu_throttle_allocations",
        "Requests refused at admission, by reason: tenant_cap_exhausted (a tenant at its hard cap), \
         global_exhausted (the node's global bucket)",
        "reason",
        &[("tenant_cap_exhausted".into(), c.tenant_cap_exhausted), ("global_exhausted".into(), c.global_exhausted)],
    );
    f.gauge(
        "cpu_throttle_tenant_cap_ratio",
        "tenant-max-cpu-ratio in force (0: no uniform cap)",
        snap.tenant_max_cpu_ratio,
    );
    f.gauge(
        "cpu_throttle_tenant_cap_quota_us",
        "Uniform tenant cap per refill interval, µs",
        snap.tenant_cap_refill_us as f64,
    );

    // The latency guard: what it acts on, for alerts and panels.
    let g = &a.latency_guard;
    f.gauge("governor_latency_guard_enabled", "1 while [latency-guard] is enabled", f64::from(u8::from(g.enabled)));
    let ones = |ids: &[u32]| ids.iter().map(|id| (id.to_string(), 1.0)).collect::<Vec<_>>();
    f.gauges(
        "governor_latency_guard_suffering",
        "1 for a keyspace under its fair share whose run-queue wait p99 missed the target, mostly behind \
         keyspaces above their share (those are lowered)",
        "keyspace_id",
        &ones(&g.suffering),
    );
    f.gauges(
        "governor_latency_guard_waiting_elsewhere",
        "1 for a keyspace under its fair share whose wait p99 missed the target mostly behind what no refill \
         changes (an idle CPU, unmeasured tasks): nobody is lowered for it",
        "keyspace_id",
        &ones(&g.waiting_elsewhere),
    );
    // While the guard is on, every keyspace with a bucket has a factor (1
    // when not held down): a panel draws a line that dips, and an alert can
    // tell "not held" from "no data".
    let held: HashMap<u32, f64> = snap.latency_guard_factors.iter().copied().collect();
    let factors: Vec<(String, f64)> = if g.enabled {
        snap.keyspaces.iter().map(|k| (k.keyspace.to_string(), held.get(&k.keyspace).copied().unwrap_or(1.0))).collect()
    } else {
        Vec::new()
    };
    f.gauges(
        "governor_latency_guard_refill_factor",
        "While [latency-guard] is enabled, the factor the guard holds each keyspace's refill (and a rule \
         keyspace's cgroup) at: 1 when not held down",
        "keyspace_id",
        &factors,
    );

    // Per keyspace, bounded.
    let buckets: HashMap<u32, &KeyspaceSnapshot> = snap.keyspaces.iter().map(|k| (k.keyspace, k)).collect();
    // Every keyspace's ratio, bucket or not (measured by rule, or with no quota).
    let ratios: HashMap<u32, f64> = snap.keyspace_ratios.iter().copied().collect();
    let mut rows: Vec<(u32, Row)> = status
        .keyspaces
        .iter()
        .map(|k| {
            let b = buckets.get(&k.keyspace_id);
            let row = Row {
                cpu_seconds: k.cpu_seconds,
                ratio: ratios.get(&k.keyspace_id).copied().or(b.map(|b| b.ratio)).unwrap_or(0.0),
                bucket: k.bucket.as_ref().map(|x| {
                    (
                        x.available_us as f64,
                        x.capacity_us as f64,
                        x.refill_us as f64,
                        x.inflight_us as f64,
                        x.debt_us as f64,
                    )
                }),
                fair: b.map_or(0, |b| b.fair_allocations),
                burst: b.map_or(0, |b| b.counters.burst_granted),
                burst_us: b.map_or(0, |b| b.counters.burst_tokens_us),
                waited: k.waited,
                granted: k.granted,
                refused: k.refused,
                pool_rejected: k.pool_rejections,
                topups_granted: b.map_or(0, |b| b.counters.topups_granted),
                topups_refused: k.topups_refused,
                topups_waited: k.topups_waited,
                wait_hist: b.map_or_else(Default::default, |b| b.counters.wait_hist),
                request_hist: b.map_or_else(Default::default, |b| b.counters.request_hist),
                cpu_wait_ns: (k.cpu_wait_seconds * 1e9).round() as u64,
                cpu_wait_hist: std::array::from_fn(|i| k.cpu_wait_buckets.get(i).copied().unwrap_or(0)),
                cpu_some_ns: (k.cpu_pressure_some_seconds * 1e9).round() as u64,
                some_counted: k.pressure_counted(),
            };
            (k.keyspace_id, row)
        })
        .collect();
    rows.sort_by(|x, y| y.1.cpu_seconds.total_cmp(&x.1.cpu_seconds).then(x.0.cmp(&y.0)));
    let folded = rows.len().saturating_sub(max_keyspaces);
    let mut shown: Vec<(String, Row)> =
        rows.iter().take(max_keyspaces).map(|(id, r)| (id.to_string(), r.clone())).collect();
    if folded > 0 {
        let mut other = Row::default();
        for (_, r) in &rows[max_keyspaces..] {
            other.add(r);
        }
        shown.push(("other".into(), other));
    }
    f.gauge(
        "governor_metrics_keyspaces_folded",
        "Keyspaces summed into keyspace_id=\"other\" (agent.metrics-max-keyspaces)",
        folded as f64,
    );
    let per = |pick: &dyn Fn(&Row) -> Option<f64>| -> Vec<(String, f64)> {
        shown.iter().filter_map(|(l, r)| pick(r).map(|v| (l.clone(), v))).collect()
    };
    let per_count = |pick: &dyn Fn(&Row) -> u64| -> Vec<(String, u64)> {
        shown.iter().map(|(l, r)| (l.clone(), pick(r))).collect()
    };
    const KS: &str = "keyspace_id";
    f.gauges(
        "tikv_cpu_usage_monitor_keyspace_ratio",
        "Keyspace CPU over the monitor window, same denominator as the global ratio",
        KS,
        &per(&|r| Some(r.ratio)),
    );
    f.gauges(
        "tikv_cpu_throttle_keyspace_bucket_available_us",
        "Tokens in the keyspace's bucket",
        KS,
        &per(&|r| r.bucket.map(|b| b.0)),
    );
    f.gauges(
        "tikv_cpu_throttle_keyspace_bucket_capacity_us",
        "Capacity of the keyspace's bucket",
        KS,
        &per(&|r| r.bucket.map(|b| b.1)),
    );
    f.gauges(
        "tikv_cpu_throttle_keyspace_refill_rate_us_per_interval",
        "Keyspace refill per refill interval",
        KS,
        &per(&|r| r.bucket.map(|b| b.2)),
    );
    f.gauges(
        "tikv_cpu_throttle_keyspace_inflight_us",
        "µs the keyspace's running requests and threads' spare tokens hold",
        KS,
        &per(&|r| r.bucket.map(|b| b.3)),
    );
    f.gauges("tikv_cpu_throttle_keyspace_debt_us", "The keyspace bucket's debt", KS, &per(&|r| r.bucket.map(|b| b.4)));
    f.counters(
        "tikv_cpu_throttle_fair_allocations_total",
        "Refill intervals the keyspace's refill was set by fair allocation",
        KS,
        &per_count(&|r| r.fair),
    );
    f.counters(
        "tikv_cpu_throttle_burst_total",
        "Requests admitted by bursting on global tokens",
        KS,
        &per_count(&|r| r.burst),
    );
    f.counters(
        "tikv_cpu_throttle_burst_tokens_used_total",
        "Global tokens taken by bursting, µs",
        KS,
        &per_count(&|r| r.burst_us),
    );
    f.counters(
        "tikv_cpu_token_allocation_retries_total",
        "Acquires that waited in line for tokens before admission",
        KS,
        &per_count(&|r| r.waited),
    );
    f.counters(
        "governor_keyspace_topup_waits_total",
        "Running requests' waits for a top-up at a checkpoint (their pacing to the keyspace's share)",
        KS,
        &per_count(&|r| r.topups_waited),
    );
    let per_second = |pick: &dyn Fn(&Row) -> f64| -> Vec<(String, f64)> {
        shown.iter().map(|(l, r)| (l.clone(), pick(r))).collect()
    };
    f.seconds(
        "governor_keyspace_cpu_seconds_total",
        "On-CPU time the kernel counted for the keyspace's tagged threads",
        KS,
        &per_second(&|r| r.cpu_seconds.max(0.0)),
    );
    f.seconds(
        "governor_keyspace_cpu_wait_seconds_total",
        "Run-queue wait of the keyspace's threads: runnable, waiting for a CPU, as the kernel counts it",
        KS,
        &per_second(&|r| r.cpu_wait_ns as f64 / 1e9),
    );
    // Only where it is counted (agent.cpu-pressure): a zero would read as
    // "never waited".
    if status.cpu_pressure {
        f.seconds(
            "governor_keyspace_cpu_pressure_some_seconds_total",
            "Time during which at least one of the keyspace's registered threads waited for a CPU (PSI's \"some\", per keyspace; its rate is the share of time); \"other\" sums the folded keyspaces'",
            KS,
            &shown
                .iter()
                .filter(|(_, r)| r.some_counted)
                .map(|(l, r)| (l.clone(), r.cpu_some_ns as f64 / 1e9))
                .collect::<Vec<_>>(),
        );
    }
    f.counters("governor_keyspace_tickets_granted_total", "Tickets granted", KS, &per_count(&|r| r.granted));
    f.counters(
        "governor_keyspace_tickets_refused_total",
        "Tickets refused, every reason",
        KS,
        &per_count(&|r| r.refused),
    );
    f.counters(
        "governor_thread_pool_rejections_total",
        "Requests the server's thread pool rejected (reported by the server): not admission refusals, and no autoscaling rule reads them",
        KS,
        &per_count(&|r| r.pool_rejected),
    );

    // Write bytes (keyspace-write-quota.md) and admission control
    // (tenant-admission-control.md).
    f.gauge(
        "governor_pending_write_bytes",
        "Pending write bytes held by tickets, node-wide",
        a.global_pending_write_bytes as f64,
    );
    f.counters(
        "governor_write_refused_total",
        "Requests refused for pending write bytes, by the limit that refused them",
        "limit",
        &[("keyspace".into(), c.write_refused_keyspace), ("global".into(), c.write_refused_global)],
    );
    f.counters(
        "governor_admission_control_total",
        "Requests over max-concurrent-per-tenant: refused (tenant_admission_control) or admitted in monitor mode",
        "outcome",
        &[("refused".into(), c.concurrency_refused), ("monitor_breach".into(), c.concurrency_monitor_breaches)],
    );

    // The agent itself.
    f.counter(
        "governor_tickets_fail_open_total",
        "Tickets admitted without a check while no agent answered (counted when it came back)",
        a.fail_open,
    );
    f.counter(
        "governor_tickets_reclaimed_total",
        "Tickets the agent returned from clients that went away",
        a.reclaimed,
    );
    let c = &status.server_cpu;
    f.gauges(
        "governor_server_cpu_cores",
        "Cores the caps and the node budget are fractions of, by where the number came from \
         (config, node, cpu-quota, cpuset, servers)",
        "source",
        &[(c.source.clone(), c.cores)],
    );
    f.gauge("governor_node_cpu_cores", "The node's online CPUs", f64::from(c.node_cores));
    let untagged = prometheus::Counter::new(
        "governor_server_untagged_cpu_seconds_total",
        "CPU the registered servers ran outside any keyspace tag, counted in the monitor's global CPU",
    )
    .expect("valid metric name");
    untagged.inc_by(c.untagged_cpu_seconds.max(0.0));
    f.registry.register(Box::new(untagged)).expect("registered once");
    f.gauge("governor_keyspace_cells", "Keyspace cells in use", f64::from(a.cells_in_use));
    f.gauge("governor_keyspace_cells_capacity", "Keyspace cells in the shared table", f64::from(a.cells));
    let o = &a.overflow;
    f.gauge(
        "governor_keyspace_overflow_keyspaces",
        "Keyspaces refused a cell in the last minute, held together by the overflow bucket (raise agent.max-keyspaces, or agent.max-keyspaces-per-uid when their uid's quota refused them)",
        o.keyspaces.len() as f64,
    );
    f.counter(
        "governor_keyspace_cells_refused_total",
        "Cell requests refused (table full, or the uid's agent.max-keyspaces-per-uid reached)",
        o.cells_refused,
    );
    f.counters(
        "governor_keyspace_overflow_requests_total",
        "Requests of keyspaces without a cell, by outcome",
        "outcome",
        &[("granted".into(), o.granted), ("refused".into(), o.refused)],
    );
    let t = &status.threads;
    f.gauge("governor_thread_slots", "Registered threads", f64::from(t.registered));
    f.gauge("governor_thread_slots_capacity", "Thread slots in the shared region", f64::from(t.capacity));
    f.counter(
        "governor_thread_registrations_refused_total",
        "Registrations refused: no slot free, or the uid's quota reached",
        t.exhausted,
    );
    f.counter(
        "governor_thread_slots_repaired_total",
        "Slots a client overwrote in shared memory and the agent restored",
        t.repaired,
    );
    let u = &status.config_updates;
    f.counters(
        "governor_config_updates_total",
        "Configuration changes (config set, config reload, SIGHUP) the agent applied or refused whole",
        "result",
        &[("accepted".to_string(), u.accepted), ("rejected".to_string(), u.rejected)],
    );
    let a = &status.autoscale;
    f.gauge(
        "governor_autoscale_scale_down_unsafe",
        "1 while admission control refused work in the last minute (tenant_admission_control): do not scale down",
        f64::from(u8::from(a.scale_down_unsafe)),
    );
    f.gauge(
        "governor_autoscale_scale_up_unhelpful",
        "1 while one keyspace owns most of the load and is already throttled: more capacity would go to it",
        f64::from(u8::from(a.scale_up_unhelpful)),
    );
    f.gauge(
        "governor_autoscale_dominant_share",
        "Share of the keyspaces' CPU over the monitor window held by the busiest keyspace",
        a.dominant_share,
    );
    f.gauges(
        "governor_rule_keyspace",
        "Keyspace each [[rules]] entry charges the processes it matches to",
        "rule",
        &status.rules.iter().map(|r| (r.name.clone(), f64::from(r.keyspace))).collect::<Vec<_>>(),
    );
    f.gauges(
        "governor_rule_processes_matched",
        "Live processes the agent matched to each rule (their children inherit in the kernel, uncounted)",
        "rule",
        &status.rules.iter().map(|r| (r.name.clone(), r.processes_matched as f64)).collect::<Vec<_>>(),
    );
    f.counter(
        "governor_rule_process_reports_total",
        "Exec and fork reports the kernel sent for the rules",
        status.rule_events,
    );
    f.counter(
        "governor_rule_process_reports_dropped_total",
        "Exec reports the kernel's ring buffer had no room for (those processes kept their inherited keyspace)",
        status.rule_events_dropped,
    );
    f.counters(
        "governor_ebpf_program_runs_total",
        "Runs of each eBPF program (kernel statistics; 0 unless kernel.bpf_stats_enabled)",
        "program",
        &status.programs.iter().map(|p| (p.name.clone(), p.run_count)).collect::<Vec<_>>(),
    );
    let run_time = CounterVec::new(
        Opts::new(
            "governor_ebpf_program_run_time_seconds_total",
            "Run time of each eBPF program (kernel statistics; 0 unless kernel.bpf_stats_enabled)",
        ),
        &["program"],
    )
    .expect("valid metric name");
    for p in &status.programs {
        run_time.with_label_values(&[p.name.as_str()]).inc_by(p.run_time_ns as f64 / 1e9);
    }
    f.registry.register(Box::new(run_time)).expect("registered once");
    f.gauge("governor_uptime_seconds", "Seconds since the agent started", status.uptime_seconds);

    // PD service limits (keyspace-cpu-throttle.md, Metrics), while PD is on.
    if let Some(pd) = &status.pd {
        f.counters(
            "tikv_service_limit_fetch_total",
            "Keyspace service-limit fetches from PD by result",
            "result",
            &pd.results.iter().map(|(k, v)| (k.clone(), *v)).collect::<Vec<_>>(),
        );
        f.gauge(
            "tikv_service_limit_last_success_timestamp",
            "Unix time of the last fetch round PD answered (0: never)",
            pd.last_success_unix.unwrap_or(0.0),
        );
        let shown: std::collections::HashSet<&str> = shown.iter().map(|(l, _)| l.as_str()).collect();
        let pick = |v: &dyn Fn(&crate::proto::PdKeyspaceStatus) -> Option<f64>| -> Vec<(String, f64)> {
            pd.keyspaces
                .iter()
                .filter(|k| shown.contains(k.keyspace_id.to_string().as_str()))
                .filter_map(|k| v(k).map(|x| (k.keyspace_id.to_string(), x)))
                .collect()
        };
        f.gauges(
            "tikv_service_limit_keyspace_value",
            "Last service_limit PD gave the keyspace (RU/s; 0: unlimited)",
            KS,
            &pick(&|k| k.service_limit),
        );
        f.gauges(
            "tikv_service_limit_keyspace_quota_us",
            "Keyspace quota derived from PD service limits, µs per refill interval",
            KS,
            &pick(&|k| k.quota_us.map(|q| q as f64)),
        );
    }

    let mut out = Vec::new();
    TextEncoder::new().encode(&f.registry.gather(), &mut out).expect("text encoding");
    let mut text = String::from_utf8(out).expect("text format is UTF-8");
    per_keyspace::wait_histograms(&mut text, &shown);
    per_keyspace::request_histograms(&mut text, &shown);
    const WAIT: &str = "governor_keyspace_cpu_wait_duration_seconds";
    header(&mut text, WAIT, "One run-queue wait of the keyspace's threads (a wakeup or preemption to getting a CPU)");
    let bounds: [u64; WAIT_BUCKETS - 1] = std::array::from_fn(wait_bucket_le_ns);
    for (ks, r) in &shown {
        let labels = format!("keyspace_id=\"{ks}\"");
        let (counts, sum) = (&r.cpu_wait_hist[..], r.cpu_wait_ns);
        series(&mut text, WAIT, Series { labels, first: 0, counts, bounds: &bounds, sum, unit: 1e9 });
    }
    text
}
