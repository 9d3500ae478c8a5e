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
