//! One phase of the demo: run the tenants' load for a fixed time, sample
//! the agent and the server every second, and turn samples and latency
//! histograms into the phase's numbers.

use crate::Progress;
use crate::load::{self, Light, Log, Noisy};
use crate::server::ReaderServer;
use anyhow::{Context, Result};
use governor_reader::proto::ServerStats;
use governor_tests::Agent;
use hdrhistogram::Histogram;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// What a phase runs.
pub struct Spec<'a> {
    pub index: usize,
    pub name: &'static str,
    pub mode: String,
    pub seconds: u64,
    pub lights: &'a [Light],
    pub noisy: Option<&'a Noisy>,
    /// The noisy tenant's cap in cores (checked in every phase it runs in;
    /// enforced only where the agent's configuration says so).
    pub cap_cores: f64,
    pub cores: f64,
}

/// The agent's and the server's counters at one moment.
struct Sample {
    at: Instant,
    agent: BTreeMap<u32, keyspace_governor::proto::KeyspaceStatus>,
    server: ServerStats,
    /// The machine's steal time so far, s.
    steal_s: f64,
}

impl Sample {
    fn take(agent: &Agent, server: &mut ReaderServer) -> Result<Sample> {
        // The agent's counters are read somewhere within the call: take its
        // middle as the sample's time.
        let before = Instant::now();
        let status = agent.status().context("agent status")?;
        let after = Instant::now();
        // When the agent read its counters: Instant is CLOCK_MONOTONIC too.
        let at = match status.counters_read_at_ns {
            0 => before + (after - before) / 2,
            ns => monotonic_instant(ns, before, after),
        };
        let server = server.stats().context("server stats")?;
        if std::env::var_os("DEMO_DEBUG").is_some() {
            let n = status.keyspaces.iter().find(|k| k.keyspace_id == 900);
            eprintln!(
                "status took {:?}; noisy {:?}",
                after - before,
                n.map(|k| (k.cpu_seconds, &k.bucket, k.inflight_requests, k.estimate_us))
            );
        }
        let steal_s = governor_tests::steal_ns() as f64 / 1e9;
        Ok(Sample { at, agent: status.keyspaces.into_iter().map(|k| (k.keyspace_id, k)).collect(), server, steal_s })
    }

    fn cpu_s(&self, ks: u32) -> f64 {
        self.agent.get(&ks).map_or(0.0, |k| k.cpu_seconds)
    }

    fn agent_counts(&self, ks: u32) -> (u64, u64) {
        self.agent.get(&ks).map_or((0, 0), |k| (k.waited, k.refused))
    }

    fn thread_s(&self, ks: u32) -> f64 {
        self.server.keyspaces.get(&ks).map_or(0.0, |k| k.thread_cpu_ns as f64 / 1e9)
    }

    fn ticket_poll_s(&self, ks: u32) -> f64 {
        self.server.keyspaces.get(&ks).map_or(0.0, |k| k.ticket_poll_cpu_ns as f64 / 1e9)
    }

    /// Time during which one of the keyspace's requests waited for admission.
    fn waiting_s(&self, ks: u32) -> f64 {
        self.server.keyspaces.get(&ks).map_or(0.0, |k| k.waiting_us as f64 / 1e6)
    }

    /// The keyspace's threads' run-queue wait so far (the kernel's count).
    fn runq_s(&self, ks: u32) -> f64 {
        self.agent.get(&ks).map_or(0.0, |k| k.cpu_wait_seconds)
    }

    /// Whom the keyspace's threads waited behind over the agent's monitor
    /// window (seconds, by the agent's word for the runner).
    fn behind(&self, ks: u32) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for b in self.agent.get(&ks).map_or(&[][..], |k| &k.cpu_wait_behind[..]) {
            let who = match b.keyspace_id {
                Some(id) => format!("keyspace {id}"),
                None => b.behind.clone(),
            };
            *out.entry(who).or_default() += b.seconds;
        }
        out
    }

    /// Its single waits so far, by the agent's log-2 buckets.
    fn runq_hist(&self, ks: u32) -> Vec<u64> {
        let mut h = self.agent.get(&ks).map_or_else(Vec::new, |k| k.cpu_wait_buckets.clone());
        h.resize(keyspace_governor_common::WAIT_BUCKETS, 0);
        h
    }

    /// Requests the server served for the keyspace so far.
    fn served(&self, ks: u32) -> u64 {
        self.server.keyspaces.get(&ks).map_or(0, |k| k.gets + k.scans)
    }
}

/// Run-queue wait of `kss` between two samples: per request served (µs)
/// and one wait's p99 (µs).
fn runq(first: &Sample, last: &Sample, kss: &[u32]) -> (f64, Option<f64>) {
    let wait: f64 = kss.iter().map(|&k| last.runq_s(k) - first.runq_s(k)).sum();
    let served: u64 = kss.iter().map(|&k| last.served(k).saturating_sub(first.served(k))).sum();
    let mut hist = vec![0u64; keyspace_governor_common::WAIT_BUCKETS];
    for &k in kss {
        for (h, (a, b)) in hist.iter_mut().zip(last.runq_hist(k).into_iter().zip(first.runq_hist(k))) {
            *h += a.saturating_sub(b);
        }
    }
    let p99 = keyspace_governor_common::wait_quantile_ns(&hist, 0.99).map(|ns| ns / 1e3);
    (wait * 1e6 / served.max(1) as f64, p99)
}

/// Whom the threads of `kss` waited behind between two samples, as shares
/// of that wait (%). The agent keeps this over its monitor window (a
/// minute), and a phase's agent has run less than that at its end (the
/// enforcing phases start a new one), so the later sample less the earlier
/// is the phase's.
fn behind(first: &Sample, last: &Sample, kss: &[u32]) -> BTreeMap<String, f64> {
    let mut secs: BTreeMap<String, f64> = BTreeMap::new();
    for &k in kss {
        let before = first.behind(k);
        for (who, s) in last.behind(k) {
            let d = s - before.get(&who).copied().unwrap_or(0.0);
            if d > 0.0 {
                *secs.entry(who).or_default() += d;
            }
        }
    }
    let total: f64 = secs.values().sum();
    secs.into_iter().map(|(who, s)| (who, if total > 0.0 { s / total * 100.0 } else { 0.0 })).collect()
}

/// The Instant of a CLOCK_MONOTONIC reading taken between `before` and
/// `after` (clamped into that span).
fn monotonic_instant(ns: u64, before: Instant, after: Instant) -> Instant {
    let now_ns = keyspace_governor::sys::monotonic_ns();
    let now = Instant::now();
    let at = now.checked_sub(Duration::from_nanos(now_ns.saturating_sub(ns))).unwrap_or(before);
    at.clamp(before, after)
}

/// Latency percentiles, µs.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Latency {
    pub requests: u64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
}

impl Latency {
    fn of(h: &Histogram<u64>) -> Latency {
        Latency {
            requests: h.len(),
            p50_us: h.value_at_quantile(0.50),
            p99_us: h.value_at_quantile(0.99),
            p999_us: h.value_at_quantile(0.999),
            max_us: h.max(),
        }
    }
}

/// One tenant in one phase.
#[derive(Clone, Debug, Serialize)]
pub struct TenantResult {
    pub keyspace: u32,
    pub role: &'static str,
    /// Charged by the agent (eBPF), over the phase: cores, and % of the node.
    pub cpu_cores: f64,
    pub cpu_share_pct: f64,
    /// The server's own count of the same work (thread CPU clock), cores.
    pub thread_clock_cores: f64,
    /// (agent − thread clock) / thread clock, over the phase and its tail:
    /// against the work inside the tickets' tags (the agent charged at
    /// least that), and against the whole polls of the tickets' futures
    /// (at most that).
    pub cross_check_error_pct: f64,
    pub cross_check_polls_error_pct: f64,
    /// Agent CPU of each 1 s window, cores.
    pub windows_cores: Vec<f64>,
    /// The kernel's count of the same windows by the server: of the work
    /// inside the tickets' tags (at most what the tenant used), and of the
    /// tickets' whole polls (at least that), cores.
    pub windows_thread_clock_cores: Vec<f64>,
    pub windows_ticket_poll_cores: Vec<f64>,
    /// Share of each window during which at least one of its requests
    /// waited for admission (its tokens held it back), %.
    pub windows_waiting_pct: Vec<f64>,
    pub latency: Latency,
    /// p99 of the requests sent in each second, µs (0: none answered).
    pub p99_per_second_us: Vec<u64>,
    pub busy: BTreeMap<String, u64>,
    pub errors: u64,
    pub late_sends: u64,
    /// Admissions that waited in line (agent), refusals (agent), and the
    /// server's mean time in admission.
    pub waited: u64,
    pub refused: u64,
    pub mean_admission_wait_us: f64,
    pub fail_open: u64,
    /// How long its threads waited for a CPU in the kernel's run queue,
    /// per request served (µs), over the phase and in each 1 s window; and
    /// one wait's p99 over the phase (µs).
    pub runq_wait_per_request_us: f64,
    pub windows_runq_wait_per_request_us: Vec<f64>,
    pub runq_wait_p99_us: Option<f64>,
}

/// The noisy tenant against its cap.
#[derive(Clone, Debug, Serialize)]
pub struct CapCheck {
    pub cap_cores: f64,
    pub cpu_cores: f64,
    pub windows_cores: Vec<f64>,
    /// Worst |window − cap| / cap over the windows after the first, %.
    pub worst_window_error_pct: f64,
    /// Its bucket's refill per refill interval at the end of each window,
    /// µs (below the cap's while the latency guard lowers it).
    pub windows_refill_us: Vec<u64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct PhaseResult {
    pub name: &'static str,
    pub mode: String,
    pub seconds: f64,
    /// Time the hypervisor ran something else while this machine's vCPUs
    /// wanted to run, as a share of all its CPU over the phase, %.
    pub steal_pct: f64,
    pub tenants: BTreeMap<String, TenantResult>,
    /// Every light tenant's requests together.
    pub light: Latency,
    /// The light tenants' p99 per second together, µs.
    pub light_p99_per_second_us: Vec<u64>,
    /// The light tenants' run-queue wait per request served (µs) and one
    /// wait's p99 (µs), together: the kernel's part of their latency.
    pub light_runq_wait_per_request_us: f64,
    pub light_runq_wait_p99_us: Option<f64>,
    /// Whom that wait was behind (what held the CPU when each wait ended:
    /// `idle` is the machine's own wakeup latency), % of it.
    pub light_wait_behind_pct: BTreeMap<String, f64>,
    /// The machine's steal time in each 1 s window, as a share of all its
    /// CPU then, %: the hypervisor ran something else while it wanted to
    /// run (the thread clock counts that time within a slice; the kernel,
    /// and so the charges, do not).
    pub windows_steal_pct: Vec<f64>,
    pub noisy: Option<CapCheck>,
    /// With `--pin-workers auto`: what other processes took of the
    /// server's CPUs each second, as its watch read it (cores), and the
    /// times it let the workers go in the phase.
    pub windows_other_processes_cores: Vec<Option<f64>>,
    pub workers_let_go: u64,
}

fn merged<'a>(hs: impl Iterator<Item = &'a Histogram<u64>>) -> Histogram<u64> {
    let mut m = Histogram::new(3).expect("3 significant digits");
    for h in hs {
        m.add(h).expect("auto-resizing histograms merge");
    }
    m
}

/// Runs one phase: load from now for `seconds`, a sample per second.
pub fn run(spec: &Spec<'_>, agent: &Agent, server: &mut ReaderServer, progress: &mut Progress) -> Result<PhaseResult> {
    let start = Instant::now() + Duration::from_millis(50);
    let run = load::start(server.addr, spec.lights, spec.noisy, start, spec.seconds as f64)?;
    std::thread::sleep(start.saturating_duration_since(Instant::now()));
    let mut samples = vec![Sample::take(agent, server)?];
    let light_names: Vec<String> = spec.lights.iter().map(|l| l.name.clone()).collect();
    for s in 1..=spec.seconds {
        std::thread::sleep((start + Duration::from_secs(s)).saturating_duration_since(Instant::now()));
        samples.push(Sample::take(agent, server)?);
        let (a, b) = (&samples[samples.len() - 2], &samples[samples.len() - 1]);
        let dt = (b.at - a.at).as_secs_f64();
        let mut cpu: Vec<(String, f64)> =
            spec.lights.iter().map(|l| (l.name.clone(), (b.cpu_s(l.keyspace) - a.cpu_s(l.keyspace)) / dt)).collect();
        if let Some(n) = spec.noisy {
            cpu.push((n.name.clone(), (b.cpu_s(n.keyspace) - a.cpu_s(n.keyspace)) / dt));
        }
        progress.second(spec, s, &cpu, run.p99_of_second(&light_names, s as usize - 1));
    }
    let logs = run.finish()?;
    // After the stragglers: the cross-check covers every request's work.
    let tail = Sample::take(agent, server)?;
    Ok(summarize(spec, &samples, &tail, &logs))
}

fn summarize(spec: &Spec<'_>, samples: &[Sample], tail: &Sample, logs: &BTreeMap<String, Log>) -> PhaseResult {
    let (first, last) = (&samples[0], &samples[samples.len() - 1]);
    let span = (last.at - first.at).as_secs_f64();
    let per_window = |f: &dyn Fn(&Sample) -> f64| -> Vec<f64> {
        samples.windows(2).map(|w| (f(&w[1]) - f(&w[0])) / (w[1].at - w[0].at).as_secs_f64()).collect()
    };
    let windows = |ks: u32| per_window(&|s: &Sample| s.cpu_s(ks));
    let mut tenants = BTreeMap::new();
    let roles = spec
        .lights
        .iter()
        .map(|l| (&l.name, l.keyspace, "light"))
        .chain(spec.noisy.map(|n| (&n.name, n.keyspace, "noisy")));
    for (name, ks, role) in roles {
        let log = &logs[name];
        let cpu_cores = (last.cpu_s(ks) - first.cpu_s(ks)) / span;
        let (agent_total, thread_total) = (tail.cpu_s(ks) - first.cpu_s(ks), tail.thread_s(ks) - first.thread_s(ks));
        let polls_total = tail.ticket_poll_s(ks) - first.ticket_poll_s(ks);
        let rel = |truth: f64| if truth > 0.0 { (agent_total - truth) / truth * 100.0 } else { 0.0 };
        let (w0, r0) = first.agent_counts(ks);
        let (w1, r1) = tail.agent_counts(ks);
        let (s0, s1) = (
            first.server.keyspaces.get(&ks).cloned().unwrap_or_default(),
            tail.server.keyspaces.get(&ks).cloned().unwrap_or_default(),
        );
        let admitted = (s1.gets + s1.scans).saturating_sub(s0.gets + s0.scans);
        let busy_server: u64 = s1.busy.values().sum::<u64>() - s0.busy.values().sum::<u64>();
        let (runq_per_request, runq_p99) = runq(first, last, &[ks]);
        tenants.insert(
            name.clone(),
            TenantResult {
                keyspace: ks,
                role,
                cpu_cores,
                cpu_share_pct: cpu_cores / spec.cores * 100.0,
                thread_clock_cores: (last.thread_s(ks) - first.thread_s(ks)) / span,
                cross_check_error_pct: rel(thread_total),
                cross_check_polls_error_pct: rel(polls_total),
                windows_cores: windows(ks),
                windows_thread_clock_cores: per_window(&|s: &Sample| s.thread_s(ks)),
                windows_ticket_poll_cores: per_window(&|s: &Sample| s.ticket_poll_s(ks)),
                windows_waiting_pct: per_window(&|s: &Sample| s.waiting_s(ks) * 100.0),
                latency: Latency::of(&log.latency),
                p99_per_second_us: log
                    .per_second
                    .iter()
                    .map(|h| if h.is_empty() { 0 } else { h.value_at_quantile(0.99) })
                    .collect(),
                busy: log.busy.clone(),
                errors: log.errors,
                late_sends: log.late_sends,
                waited: w1.saturating_sub(w0),
                refused: r1.saturating_sub(r0),
                mean_admission_wait_us: (s1.wait_us - s0.wait_us) as f64 / (admitted + busy_server).max(1) as f64,
                fail_open: s1.fail_open - s0.fail_open,
                runq_wait_per_request_us: runq_per_request,
                windows_runq_wait_per_request_us: samples.windows(2).map(|w| runq(&w[0], &w[1], &[ks]).0).collect(),
                runq_wait_p99_us: runq_p99,
            },
        );
    }
    let light_logs: Vec<&Log> = spec.lights.iter().map(|l| &logs[&l.name]).collect();
    let seconds = light_logs.iter().map(|l| l.per_second.len()).max().unwrap_or(0);
    let light_p99_per_second_us = (0..seconds)
        .map(|s| {
            let h = merged(light_logs.iter().filter_map(|l| l.per_second.get(s)));
            if h.is_empty() { 0 } else { h.value_at_quantile(0.99) }
        })
        .collect();
    let noisy = spec.noisy.map(|n| {
        let t = &tenants[&n.name];
        let worst = t
            .windows_cores
            .iter()
            .skip(1)
            .map(|w| (w - spec.cap_cores).abs() / spec.cap_cores * 100.0)
            .fold(0.0, f64::max);
        CapCheck {
            cap_cores: spec.cap_cores,
            cpu_cores: t.cpu_cores,
            windows_cores: t.windows_cores.clone(),
            worst_window_error_pct: worst,
            windows_refill_us: samples
                .iter()
                .skip(1)
                .map(|s| s.agent.get(&n.keyspace).and_then(|k| k.bucket.as_ref()).map_or(0, |b| b.refill_us))
                .collect(),
        }
    });
    let windows_steal_pct = samples
        .windows(2)
        .map(|w| (w[1].steal_s - w[0].steal_s) / ((w[1].at - w[0].at).as_secs_f64() * spec.cores) * 100.0)
        .collect();
    let light_kss: Vec<u32> = spec.lights.iter().map(|l| l.keyspace).collect();
    let (light_runq_wait_per_request_us, light_runq_wait_p99_us) = runq(first, last, &light_kss);
    PhaseResult {
        light_runq_wait_per_request_us,
        light_runq_wait_p99_us,
        light_wait_behind_pct: behind(first, last, &light_kss),
        windows_steal_pct,
        name: spec.name,
        mode: spec.mode.clone(),
        seconds: span,
        steal_pct: (last.steal_s - first.steal_s) / (span * spec.cores) * 100.0,
        light: Latency::of(&merged(light_logs.iter().map(|l| &l.latency))),
        light_p99_per_second_us,
        tenants,
        noisy,
        windows_other_processes_cores: samples.iter().skip(1).map(|s| s.server.other_processes_cores).collect(),
        workers_let_go: last.server.workers_let_go.saturating_sub(first.server.workers_let_go),
    }
}
