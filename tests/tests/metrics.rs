//! `/metrics` against real parts: the agent's exposition passes `promtool
//! check metrics`, a real Prometheus server (Debian's, which `cargo xtask
//! setup` installs) scrapes it and its HTTP API returns the values
//! `governor status` reports; past `agent.metrics-max-keyspaces` the
//! smallest keyspaces fold into `keyspace_id="other"`.

use governor_tests::{Agent, Scratch, essential_config, run_workload};
use keyspace_governor::client::{self, Client};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn cores() -> f64 {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as f64
}

/// One HTTP/1.1 GET: (status line, headers, body).
fn get(addr: &str, path: &str) -> (String, String, String) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let (status, headers) = head.split_once("\r\n").unwrap_or((head, ""));
    (status.to_string(), headers.to_string(), body.to_string())
}

/// The value of the series `name{labels}` in an exposition (`labels` as
/// written there, e.g. `keyspace_id="1"`; empty for none).
fn sample(text: &str, name: &str, labels: &str) -> Option<f64> {
    let key = if labels.is_empty() { name.to_string() } else { format!("{name}{{{labels}}}") };
    text.lines().find_map(|l| l.strip_prefix(&key)?.strip_prefix(' ')?.trim().parse().ok())
}

fn metrics_addr(agent: &Agent) -> String {
    agent.status().unwrap().metrics_addr.expect("status names the metrics address")
}

/// A free loopback port (bound, then released for the caller to bind).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'-' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A Prometheus server scraping `target` every second, until dropped.
struct Prometheus {
    child: std::process::Child,
    addr: String,
    _dir: Scratch,
}

impl Prometheus {
    fn start(target: &str) -> Prometheus {
        let dir = Scratch::new("prometheus");
        let config = dir.0.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: governor\n    \
                 static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let addr = format!("127.0.0.1:{}", free_port());
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.0.join("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus is installed (cargo xtask setup)");
        Prometheus { child, addr, _dir: dir }
    }

    /// Instant query: (labels, value) of each series.
    fn query(&self, q: &str) -> Vec<(serde_json::Value, f64)> {
        let (status, _, body) = get(&self.addr, &format!("/api/v1/query?query={}", url_encode(q)));
        if !status.contains("200") {
            return Vec::new();
        }
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        v["data"]["result"]
            .as_array()
            .map(|r| {
                r.iter()
                    .filter_map(|s| Some((s["metric"].clone(), s["value"][1].as_str()?.parse::<f64>().ok()?)))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Waits until `q` returns something, at most 30 s.
    fn wait_for(&self, q: &str) -> Vec<(serde_json::Value, f64)> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if TcpStream::connect(&self.addr).is_ok() {
                let r = self.query(q);
                if !r.is_empty() {
                    return r;
                }
            }
            assert!(Instant::now() < deadline, "Prometheus never returned {q}");
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The seeds' metric names (keyspace-cpu-throttle.md and tenant-cpu-cap.md)
/// that describe what governor has, and governor's own.
const FAMILIES: &[&str] = &[
    "tikv_cpu_usage_monitor_global_ratio",
    "tikv_cpu_usage_monitor_keyspace_ratio",
    "tikv_cpu_throttle_allocations_total",
    "tikv_cpu_throttle_global_bucket_available_us",
    "tikv_cpu_throttle_global_bucket_capacity_us",
    "tikv_cpu_throttle_global_refill_rate_us_per_interval",
    "tikv_cpu_throttle_keyspace_bucket_available_us",
    "tikv_cpu_throttle_keyspace_bucket_capacity_us",
    "tikv_cpu_throttle_keyspace_refill_rate_us_per_interval",
    "tikv_cpu_throttle_keyspace_inflight_us",
    "tikv_cpu_throttle_keyspace_debt_us",
    "tikv_cpu_throttle_fair_allocations_total",
    "tikv_cpu_throttle_burst_total",
    "tikv_cpu_throttle_burst_tokens_used_total",
    "tikv_cpu_token_allocation_retries_total",
    "tikv_cpu_token_runtime_allocations_total",
    "cpu_throttle_tenant_cap_ratio",
    "cpu_throttle_tenant_cap_quota_us",
    "governor_keyspace_cpu_seconds_total",
    "governor_thread_slots",
    "governor_tickets_fail_open_total",
    "governor_tickets_reclaimed_total",
    "governor_write_refused_total",
    "governor_admission_control_total",
];

#[test]
fn a_real_prometheus_scrapes_what_status_reports() {
    let _s = serial();
    let ratio = 0.5 / cores();
    let agent = Agent::start("ebpf", &essential_config(ratio)).unwrap();
    // Two tenants, capped: grants, waits, CPU.
    for ks in ["1", "2"] {
        run_workload(
            &agent.socket,
            &["tickets", "--keyspace", ks, "--threads", "2", "--seconds", "1", "--work-us", "500"],
        )
        .unwrap();
    }
    let addr = metrics_addr(&agent);
    let (status_line, headers, body) = get(&addr, "/metrics");
    assert!(status_line.contains("200"), "{status_line}");
    assert!(headers.to_lowercase().contains("content-type: text/plain; version=0.0.4"), "{headers}");
    for family in FAMILIES {
        assert!(body.contains(&format!("# TYPE {family} ")), "{family} missing from the exposition:\n{body}");
    }
    let problems = governor_tests::promtool_check(&body);
    assert!(problems.is_empty(), "promtool check metrics: {problems:#?}");
    // Other paths and methods.
    assert!(get(&addr, "/nope").0.contains("404"));

    // The same numbers through a real Prometheus server.
    let prom = Prometheus::start(&addr);
    let up = prom.wait_for("up{job=\"governor\"} == 1");
    assert_eq!(up.len(), 1, "{up:?}");
    let status = agent.status().unwrap();
    let capacity = prom.wait_for("tikv_cpu_throttle_global_bucket_capacity_us");
    assert_eq!(capacity[0].1, status.admission.global.capacity_us as f64);
    let quota = prom.wait_for("cpu_throttle_tenant_cap_quota_us");
    let k1 = status.keyspaces.iter().find(|k| k.keyspace_id == 1).expect("keyspace 1");
    assert_eq!(quota[0].1, k1.bucket.as_ref().expect("a cap bucket").refill_us as f64);
    // Counters that no longer move (the workloads are over).
    for k in status.keyspaces.iter().filter(|k| k.keyspace_id == 1 || k.keyspace_id == 2) {
        let q = format!("governor_keyspace_cpu_seconds_total{{keyspace_id=\"{}\"}}", k.keyspace_id);
        let cpu = prom.wait_for(&q)[0].1;
        assert!((cpu - k.cpu_seconds).abs() <= 1e-6 * k.cpu_seconds.max(1.0), "{q}: {cpu} vs status {}", k.cpu_seconds);
        let q = format!("governor_keyspace_tickets_granted_total{{keyspace_id=\"{}\"}}", k.keyspace_id);
        assert_eq!(prom.wait_for(&q)[0].1, k.granted as f64, "{q}");
        let q = format!("tikv_cpu_token_allocation_retries_total{{keyspace_id=\"{}\"}}", k.keyspace_id);
        assert_eq!(prom.wait_for(&q)[0].1, k.waited as f64, "{q}");
        assert!(k.granted > 100 && k.waited > 0, "{k:?}");
    }
    let granted: f64 = prom
        .wait_for("tikv_cpu_throttle_allocations_total")
        .iter()
        .filter(|(m, _)| m["result"] == "granted" || m["result"] == "skipped")
        .map(|(_, v)| v)
        .sum();
    assert_eq!(granted, status.admission.granted as f64);
}

#[test]
fn past_the_limit_the_smallest_keyspaces_fold_into_other() {
    let _s = serial();
    let agent = Agent::start("ebpf", "[agent]\nmetrics-max-keyspaces = 2\n").unwrap();
    let c = Client::connect(&agent.socket).unwrap();
    c.register_current_thread().unwrap();
    // Four keyspaces with 40, 30, 20 and 10 ms of CPU.
    for (ks, ms) in [(11u32, 40u64), (12, 30), (13, 20), (14, 10)] {
        let _g = client::tag(ks).unwrap();
        let end = keyspace_governor::sys::thread_cputime_ns() + ms * 1_000_000;
        while keyspace_governor::sys::thread_cputime_ns() < end {}
    }
    client::clear_tag();
    let status = agent.status().unwrap();
    let cpu = |ks: u32| status.keyspaces.iter().find(|k| k.keyspace_id == ks).map_or(0.0, |k| k.cpu_seconds);
    let (_, _, body) = get(&metrics_addr(&agent), "/metrics");
    let series: Vec<&str> = body.lines().filter(|l| l.starts_with("governor_keyspace_cpu_seconds_total{")).collect();
    assert_eq!(series.len(), 3, "{series:?}");
    let got = |label: &str| sample(&body, "governor_keyspace_cpu_seconds_total", &format!("keyspace_id=\"{label}\""));
    assert_eq!(got("11"), Some(cpu(11)));
    assert_eq!(got("12"), Some(cpu(12)));
    let other = got("other").expect("an other series");
    assert!((other - (cpu(13) + cpu(14))).abs() < 1e-9, "other {other}, keyspaces 13 + 14 {}", cpu(13) + cpu(14));
    assert!((0.025..0.035).contains(&other), "other {other} s for 30 ms of CPU");
    assert_eq!(sample(&body, "governor_metrics_keyspaces_folded", ""), Some(2.0));
    // PD is off: none of its series, the fetch durations' histogram included.
    assert!(!body.contains("tikv_service_limit_"), "PD series with PD off");
}

#[test]
fn wait_histograms_count_every_admission_by_result() {
    let _s = serial();
    // 0.25 core for keyspace 7: four workers wait in line, and with a 1 ms
    // deadline some give up.
    let agent = Agent::start("ebpf", &essential_config(0.25 / cores())).unwrap();
    let patient = run_workload(
        &agent.socket,
        &["tickets", "--keyspace", "7", "--threads", "4", "--seconds", "2", "--work-us", "1000"],
    )
    .unwrap();
    let hasty = run_workload(
        &agent.socket,
        &["tickets", "--keyspace", "7", "--threads", "4", "--seconds", "1", "--work-us", "1000", "--timeout-ms", "1"],
    )
    .unwrap();
    let (_, _, text) = get(&metrics_addr(&agent), "/metrics");
    let s = agent.status().unwrap();
    let k = s.keyspaces.iter().find(|k| k.keyspace_id == 7).unwrap();
    let name = "tikv_cpu_token_wait_duration_seconds";
    let of = |series: &str, result: &str, le: Option<&str>| {
        let labels = match le {
            Some(le) => format!("keyspace_id=\"7\",result=\"{result}\",le=\"{le}\""),
            None => format!("keyspace_id=\"7\",result=\"{result}\""),
        };
        sample(&text, &format!("{name}{series}"), &labels).unwrap_or_else(|| panic!("no {name}{series}{{{labels}}}"))
    };
    eprintln!(
        "workloads: {patient} {hasty}; keyspace 7: {} granted, {} waited, {} refused",
        k.granted, k.waited, k.refused
    );
    // Every admission is one observation, by its result.
    assert_eq!(of("_count", "granted", None) as u64, k.granted);
    assert_eq!(of("_count", "refused", None) as u64, k.refused);
    assert!(k.waited > 100 && k.refused > 10, "the cap held them: {k:?}");
    // Those that waited are above the first bucket or in it; at most the
    // served-at-once ones and the short waits sit at or below 0.5 ms.
    let at_once = of("_bucket", "granted", Some("0.0005"));
    assert!(at_once >= (k.granted - k.waited) as f64 && at_once <= k.granted as f64, "{at_once}");
    let mean = of("_sum", "granted", None) / k.waited as f64;
    assert!((0.0002..=0.5).contains(&mean), "mean wait of those that waited: {mean} s");
    // A 1 ms deadline: every refusal that waited waited about that long.
    let refused_by_2_5ms = of("_bucket", "refused", Some("0.0025"));
    let refused_late = of("_bucket", "refused", Some("+Inf")) - refused_by_2_5ms;
    assert!(refused_late <= k.refused as f64 * 0.2, "{refused_late} refusals waited past 2.5 ms for a 1 ms deadline");
    // Buckets never decrease, and the exposition is valid.
    let buckets: Vec<f64> = ["0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "+Inf"]
        .iter()
        .map(|le| of("_bucket", "granted", Some(le)))
        .collect();
    assert!(buckets.windows(2).all(|w| w[0] <= w[1]), "{buckets:?}");
    let problems = governor_tests::promtool_check(&text);
    assert!(problems.is_empty(), "promtool: {problems:?}");
}

#[test]
fn request_histograms_count_every_release_with_its_cpu_and_its_estimate() {
    let _s = serial();
    // Static estimates of 1000 µs; keyspace 7's tickets do 300 µs of work,
    // keyspace 8's 1800 µs (topped up on the way).
    let config = format!(
        "[resource-control]\nmax-read-cpu-ratio = 0.6\n[resource-control.cpu-throttle]\nprofile = \"essential\"\n\
         tenant-max-cpu-ratio = {}\nenable-adaptive-estimated-cpu-per-request-us = false\n\
         estimated-cpu-per-request-us = 1000\n[agent]\nmax-threads = 256\n",
        0.9 / cores()
    );
    let agent = Agent::start("ebpf", &config).unwrap();
    let mut reports = Vec::new();
    for (ks, work) in [("7", "300"), ("8", "1800")] {
        let out = run_workload(
            &agent.socket,
            &["tickets", "--keyspace", ks, "--threads", "2", "--seconds", "1.5", "--work-us", work],
        )
        .unwrap();
        reports.push(out);
    }
    std::thread::sleep(Duration::from_millis(300));
    let (_, _, text) = get(&metrics_addr(&agent), "/metrics");
    let s = agent.status().unwrap();
    let cpu = "tikv_cpu_throttle_request_cpu_time_seconds";
    let ratio = "tikv_cpu_throttle_request_actual_to_estimated_ratio";
    let of = |name: &str, series: &str, ks: &str, le: Option<&str>| {
        let labels = match le {
            Some(le) => format!("keyspace_id=\"{ks}\",le=\"{le}\""),
            None => format!("keyspace_id=\"{ks}\""),
        };
        sample(&text, &format!("{name}{series}"), &labels).unwrap_or_else(|| panic!("no {name}{series}{{{labels}}}"))
    };
    for ((ks, work_us, cpu_le, ratio_le), report) in
        [("7", 300.0, "0.0005", "0.5"), ("8", 1800.0, "0.0025", "2")].into_iter().zip(&reports)
    {
        let k = s.keyspaces.iter().find(|k| k.keyspace_id.to_string() == ks).unwrap();
        let consumed_s = report["ticket_consumed_ns"].as_f64().unwrap() / 1e9;
        eprintln!("keyspace {ks}: {report}; status {} granted, estimate {} µs", k.granted, k.estimate_us);
        assert_eq!(k.estimate_us, 1000, "{k:?}");
        // One observation per released ticket, in both families.
        let n = of(cpu, "_count", ks, None);
        assert_eq!(n as u64, k.granted, "every granted ticket was released");
        assert_eq!(of(ratio, "_count", ks, None), n);
        assert!(n > 200.0, "{n} tickets");
        // The CPU is what the tickets were charged.
        let sum = of(cpu, "_sum", ks, None);
        assert!((sum - consumed_s).abs() <= consumed_s * 0.01 + 0.001, "histogram {sum} s, tickets {consumed_s} s");
        let mean_us = sum / n * 1e6;
        assert!(
            mean_us >= work_us * 0.95 && mean_us <= work_us * 1.5,
            "mean request CPU {mean_us} µs for {work_us} µs of work"
        );
        // The ratio is that CPU over the 1000 µs estimate.
        let mean_ratio = of(ratio, "_sum", ks, None) / n;
        assert!((mean_ratio - mean_us / 1000.0).abs() <= 0.01, "mean ratio {mean_ratio}, mean CPU {mean_us} µs");
        // Most land in the bucket their work falls in (some are preempted).
        let in_cpu = of(cpu, "_bucket", ks, Some(cpu_le));
        let in_ratio = of(ratio, "_bucket", ks, Some(ratio_le));
        assert!(
            in_cpu >= n * 0.8 && in_ratio >= n * 0.8,
            "{in_cpu} and {in_ratio} of {n} at or below {cpu_le} s / {ratio_le}"
        );
        let below = if ks == "7" { ("0.00025", "0.25") } else { ("0.001", "1") };
        assert!(
            of(cpu, "_bucket", ks, Some(below.0)) <= n * 0.05 && of(ratio, "_bucket", ks, Some(below.1)) <= n * 0.05,
            "few requests cost less than their work"
        );
    }
    let problems = governor_tests::promtool_check(&text);
    assert!(problems.is_empty(), "promtool: {problems:?}");
}

/// The labels a panel's target must carry: those its legend names and those
/// its outermost `by (…)` keeps (less `le`, which `histogram_quantile` uses).
fn shown_labels(expr: &str, legend: &str) -> Vec<String> {
    let mut labels: Vec<String> =
        legend.split("{{").skip(1).filter_map(|s| s.split_once("}}").map(|(l, _)| l.trim().to_string())).collect();
    if let Some((_, rest)) = expr.split_once("by (")
        && let Some((group, _)) = rest.split_once(')')
    {
        labels.extend(group.split(',').map(|l| l.trim().to_string()).filter(|l| l != "le"));
    }
    labels.sort();
    labels.dedup();
    labels
}

#[test]
fn every_dashboard_query_returns_series_with_the_labels_its_panel_shows() {
    use governor_tests::fake_pd::{FakePd, Reply};
    let _s = serial();
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(repo.join("deploy/grafana/governor-dashboard.json")).unwrap())
            .unwrap();
    // A live agent with every source the panels draw from: tenants held to
    // quotas (grants, waits, refusals, top-ups), a PD quota, a rule, eBPF
    // statistics, CPU pressure, the latency guard and a configuration change.
    let pd = FakePd::start();
    pd.keyspace(9, "pd-tenant", "ENABLED");
    pd.reply("pd-tenant", Reply::Limit(100.0));
    let config = format!(
        "[resource-control]\nmax-read-cpu-ratio = 0.6\n[resource-control.cpu-throttle]\nenabled = true\n\
         enable-dynamic-adjustment = false\nkeyspace-cpu-quotas = \"5:100,6:150\"\nenable-burst = false\n\
         enable-pd-service-limit = true\npd-service-limit-fetch-interval = \"200ms\"\n\
         pd-service-limit-request-timeout = \"150ms\"\n[pd]\nendpoints = [\"http://{}\"]\n\
         [agent]\nmax-threads = 256\ncpu-pressure = true\n[latency-guard]\nenabled = true\n[[rules]]\nname = \"sleepers\"\nkeyspace = 77\ncomm-prefix = \"sleep\"\n",
        pd.addr
    );
    let agent = Agent::start("ebpf", &config).unwrap();
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).unwrap();
    let mut sleeper = Command::new("sleep").arg("30").spawn().unwrap();
    let addr = metrics_addr(&agent);
    let prom = Prometheus::start(&addr);
    prom.wait_for("up{job=\"governor\"} == 1");
    let set = Command::new(governor_tests::governor_bin())
        .args(["config", "set", "resource-control.cpu-throttle.keyspace-cpu-quotas=5:100,6:160", "--socket"])
        .arg(&agent.socket)
        .output()
        .unwrap();
    assert!(set.status.success(), "{}", String::from_utf8_lossy(&set.stderr));
    // Four seconds of load while Prometheus scrapes every second: keyspace 5
    // (0.1 core) with short deadlines (refusals), 6 (0.16 core) with tickets
    // longer than their estimate (top-ups that wait), 9 under its PD quota.
    let socket = agent.socket.clone();
    let loads: Vec<_> = [
        vec![
            "tickets",
            "--keyspace",
            "5",
            "--threads",
            "3",
            "--seconds",
            "4",
            "--work-us",
            "1000",
            "--timeout-ms",
            "2",
        ],
        vec!["tickets", "--keyspace", "6", "--threads", "2", "--seconds", "4", "--work-us", "8000"],
        vec!["tickets", "--keyspace", "9", "--threads", "1", "--seconds", "4", "--work-us", "500"],
    ]
    .into_iter()
    .map(|args| {
        let socket = socket.clone();
        std::thread::spawn(move || run_workload(&socket, &args).unwrap())
    })
    .collect();
    for l in loads {
        eprintln!("{}", l.join().unwrap());
    }
    // Two more scrapes, so every rate has the load's last samples.
    std::thread::sleep(Duration::from_millis(2500));
    let mut checked = 0;
    let mut problems = Vec::new();
    for panel in dash["panels"].as_array().expect("panels") {
        let title = panel["title"].as_str().unwrap_or_default();
        for t in panel["targets"].as_array().expect("targets") {
            let expr = t["expr"].as_str().expect("expr");
            let legend = t["legendFormat"].as_str().unwrap_or_default();
            let want = shown_labels(expr, legend);
            let series = prom.query(expr);
            checked += 1;
            if series.is_empty() {
                problems.push(format!("{title}: `{expr}` returned no series"));
                continue;
            }
            if !series.iter().any(|(_, v)| v.is_finite()) {
                problems.push(format!("{title}: `{expr}` returned only NaN: {series:?}"));
            }
            for (labels, _) in &series {
                for l in &want {
                    if labels.get(l).and_then(|v| v.as_str()).is_none_or(str::is_empty) {
                        problems.push(format!("{title}: `{expr}` has a series without `{l}`: {labels}"));
                    }
                }
            }
            eprintln!("{title} [{legend}]: {} series, {want:?}", series.len());
        }
    }
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    assert!(checked >= 24, "{checked} targets");
    assert!(problems.is_empty(), "{problems:#?}");
}
