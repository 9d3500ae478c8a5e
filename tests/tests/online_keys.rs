//! Every key the configuration has, changed on one running agent with
//! `governor config set`: each either acts — its effect seen in `status`,
//! in a scrape, or in what clients are granted and refused — or is refused
//! as restart-only (or unsupported), exit 64, the running value kept. The
//! test ends by comparing the keys it changed with every key of the
//! embedded default, so a new key without an online check fails here.

use governor_tests::fake_pd::{FakePd, Reply};
use governor_tests::{Agent, Holder, Reap, governor_bin, output_text as text, scrape_metrics, workload_bin};
use serde_json::Value;
use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const CT: &str = "resource-control.cpu-throttle";
const NOBODY: u32 = 65534;
const MIB: u64 = 1 << 20;

struct Run {
    agent: Agent,
    covered: BTreeSet<String>,
}

/// The key of a `config set` argument, with `cpu-throttle.` keys written short.
fn full(key: &str) -> String {
    if key.contains('.') { key.to_string() } else { format!("{CT}.{key}") }
}

impl Run {
    /// `governor ARGS` against the agent. A call the agent did not answer
    /// within the CLI's 5 s is said and asked again (at most twice): a
    /// change applied meanwhile is then accepted with nothing to change,
    /// and the effect checks that follow still decide.
    fn governor(&self, args: &[&str]) -> Output {
        let run = || {
            let started = Instant::now();
            let o = Command::new(governor_bin())
                .args(args)
                .arg("--socket")
                .arg(&self.agent.socket)
                .output()
                .expect("governor runs");
            (o, started.elapsed())
        };
        let (mut o, mut took) = run();
        for _ in 0..2 {
            if o.status.code() != Some(1)
                || !String::from_utf8_lossy(&o.stdout).contains("talking to the governor agent failed")
            {
                break;
            }
            eprintln!("governor {args:?}: no answer in {took:?}, asking again");
            (o, took) = run();
        }
        o
    }

    /// `config set KEY=VALUE`, accepted; the key counts as covered.
    fn set(&mut self, key: &str, value: &str) {
        let key = full(key);
        let o = self.governor(&["config", "set", &format!("{key}={value}"), "--json"]);
        assert_eq!(o.status.code(), Some(0), "{key}={value}: {}", text(&o));
        self.covered.insert(key);
    }

    /// `config set KEY=VALUE`, refused with `why`, the running configuration kept.
    fn refused(&mut self, key: &str, value: &str, why: &str) {
        let key = full(key);
        let before = self.governor(&["status", "--json"]);
        let o = self.governor(&["config", "set", &format!("{key}={value}")]);
        assert_eq!(o.status.code(), Some(64), "{key}={value}: {}", text(&o));
        assert!(String::from_utf8_lossy(&o.stderr).contains(why), "{key}={value}: expected {why:?}: {}", text(&o));
        let after = self.governor(&["status", "--json"]);
        let updates = |o: &Output| json(o)["config_updates"]["accepted"].clone();
        assert_eq!(updates(&before), updates(&after), "{key}: a refused change was applied");
        self.covered.insert(key);
    }

    fn status(&self) -> Value {
        json(&self.governor(&["status", "--json"]))
    }

    fn row(&self, keyspace: u64) -> Value {
        self.status()["keyspaces"]
            .as_array()
            .and_then(|a| a.iter().find(|k| k["keyspace_id"] == keyspace).cloned())
            .unwrap_or(Value::Null)
    }

    /// Polls `f` on fresh status (50 ms apart) until it holds; panics
    /// with `what` and the last status after `limit`.
    fn until(&self, what: &str, limit: Duration, f: impl Fn(&Value) -> bool) -> Value {
        let start = Instant::now();
        loop {
            let s = self.status();
            if f(&s) {
                return s;
            }
            assert!(start.elapsed() < limit, "{what}: not within {limit:?}; status: {s:#}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `f` holds on fresh status for the whole of `d`.
    fn holds(&self, what: &str, d: Duration, f: impl Fn(&Value) -> bool) {
        let start = Instant::now();
        while start.elapsed() < d {
            let s = self.status();
            assert!(f(&s), "{what}: broken after {:?}; status: {s:#}", start.elapsed());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn scrape(&self) -> String {
        scrape_metrics(self.status()["metrics_addr"].as_str().expect("metrics address"))
    }

    /// Σ of a metric family's samples whose labels contain `labels`.
    fn metric(&self, name: &str, labels: &str) -> f64 {
        self.scrape()
            .lines()
            .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
            .filter(|l| l.contains(labels))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    fn cores(&self) -> f64 {
        self.status()["server_cpu"]["cores"].as_f64().expect("cores")
    }

    /// One `workload` run, as root or as `uid`.
    fn workload(&self, uid: Option<u32>, args: &[&str]) -> Output {
        let mut cmd = match uid {
            Some(u) => {
                let mut c = Command::new("setpriv");
                c.args(["--reuid", &u.to_string(), "--regid", &u.to_string(), "--clear-groups"]).arg(workload_bin());
                c
            }
            None => Command::new(workload_bin()),
        };
        cmd.args(args).arg("--socket").arg(&self.agent.socket).stdin(Stdio::null()).output().expect("workload runs")
    }

    /// `governor ARGS` as `uid`.
    fn governor_as(&self, uid: u32, args: &[&str]) -> Output {
        Command::new("setpriv")
            .args(["--reuid", &uid.to_string(), "--regid", &uid.to_string(), "--clear-groups"])
            .arg(governor_bin())
            .args(args)
            .arg("--socket")
            .arg(&self.agent.socket)
            .output()
            .expect("setpriv")
    }
}

fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(o)))
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// Tokens the keyspace's running requests hold, µs.
fn inflight(r: &Run, keyspace: u64) -> u64 {
    r.row(keyspace)["bucket"]["inflight_us"].as_u64().unwrap_or(0)
}

/// What one fresh client's acquire of `estimate_us` on `keyspace` takes
/// from its bucket (a fresh process: no spare tokens of an earlier one).
fn taken(r: &Run, keyspace: u64, estimate_us: u64) -> u64 {
    // Clients gone before are reclaimed within 100 ms.
    std::thread::sleep(Duration::from_millis(300));
    let mut h = Holder::start(&r.agent.socket);
    let before = inflight(r, keyspace);
    let reply = h.say(&format!("acquire {keyspace} 0 {estimate_us}"));
    assert_eq!(reply["ok"], true, "{reply}");
    let after = inflight(r, keyspace);
    h.say("release");
    after.saturating_sub(before)
}

/// Top-ups per request of 20 ms CPU on keyspace 6 in one second of load.
fn topups_per_request(r: &Run) -> (f64, f64) {
    let before = r.metric("tikv_cpu_token_runtime_allocations_total", "result=\"granted\"");
    let o = r.workload(None, &["tickets", "--keyspace", "6", "--threads", "1", "--seconds", "1", "--work-us", "20000"]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let v: Value = serde_json::from_str(out.lines().last().unwrap_or("")).expect("workload JSON");
    let after = r.metric("tikv_cpu_token_runtime_allocations_total", "result=\"granted\"");
    let requests = num(&v["granted"]);
    assert!(requests >= 10.0, "{v}");
    ((after - before) / requests, num(&v["ticket_consumed_ns"]) / requests / 1e6)
}

/// Asserts the top-ups a 20 ms request took: one ticket drop checks once,
/// topping up `per_ms` at a time until the grant (from 1 ms) covers
/// consumed / threshold, so each request takes ⌈(c / threshold − 1) / per⌉.
/// The consumed CPU `c` is the tickets' own mean: on a host that steals it
/// reads above the 20 ms of kernel CPU (docs/design.md, the thread clock).
fn assert_topups(r: &Run, threshold: f64, per_ms: f64) {
    let (n, c) = topups_per_request(r);
    eprintln!("top-ups at threshold {threshold}, {per_ms} ms: {n:.2} per request, {c:.2} ms consumed");
    let expected = (c / threshold - 1.0) / per_ms;
    assert!(
        (expected - 0.75..=expected + 1.25).contains(&n),
        "{c:.2} ms consumed per request at threshold {threshold} in {per_ms} ms top-ups: {expected:.2} \
         expected, {n:.2} taken"
    );
    assert!((19.5..=30.0).contains(&c), "20 ms of work read as {c:.2} ms");
}

/// Every key of the embedded default, dotted.
fn default_keys() -> BTreeSet<String> {
    let o = Command::new(governor_bin()).args(["config", "show", "--json"]).output().expect("config show");
    let mut keys = BTreeSet::new();
    fn walk(prefix: &str, v: &Value, keys: &mut BTreeSet<String>) {
        match v {
            Value::Object(m) => {
                for (k, v) in m {
                    walk(&if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") }, v, keys);
                }
            }
            _ => {
                keys.insert(prefix.to_string());
            }
        }
    }
    walk("", &json(&o), &mut keys);
    keys
}

#[test]
fn every_key_acts_online_or_is_refused() {
    let mut pd = FakePd::start();
    pd.keyspace(5, "five", "ENABLED");
    pd.keyspace(6, "six", "ENABLED");
    pd.reply("five", Reply::Limit(300.0));
    pd.reply("six", Reply::Limit(100.0));
    let other_pd = FakePd::start();
    let config = format!(
        "[resource-control]\nmax-read-cpu-ratio = 0.5\n[resource-control.cpu-throttle]\nenabled = true\n\
         enable-dynamic-adjustment = false\nenable-fair-allocation = false\nenable-burst = false\n\
         keyspace-cpu-quotas = \"5:100,6:2000\"\n[agent.access]\nsocket-mode = \"0666\"\n\
         [pd]\nendpoints = [\"http://{}\"]\n",
        pd.addr
    );
    let mut r = Run { agent: Agent::start("ebpf", &config).expect("agent"), covered: BTreeSet::new() };
    let started = Instant::now();
    let cores = r.cores();
    let per_interval = |ratio: f64, cores: f64| (ratio * cores * 10_000.0).round();
    let near = |v: &Value, want: f64| (num(v) - want).abs() <= 1.0;

    // Restart-only keys, and the one key of the original system governor
    // does not implement: refused, the running value kept.
    for (key, value) in [
        ("refill-interval", "20ms"),
        ("burst-window", "200ms"),
        ("agent.control-socket", "/tmp/elsewhere.sock"),
        ("agent.measure", "thread-clock"),
        ("agent.max-threads", "128"),
        ("agent.max-keyspaces", "64"),
        ("agent.metrics-addr", "127.0.0.1:1"),
        ("agent.timer-period", "5ms"),
        ("agent.cpu-pressure", "true"),
    ] {
        r.refused(key, value, "cannot change online");
    }
    r.refused("resource-control.enable-qps-bytes-limiter", "true", "is not supported");

    // [resource-control]
    r.set("resource-control.enabled", "false");
    r.until("admission off", Duration::from_secs(2), |s| s["admission"]["enabled"] == false);
    r.set("resource-control.enabled", "true");
    r.until("admission on", Duration::from_secs(2), |s| s["admission"]["enabled"] == true);
    // The node budget sizes the global bucket while the throttle runs: it
    // changes with the throttle off, and the throttle then runs on it.
    r.refused("resource-control.max-read-cpu-ratio", "0.3", "cannot change online");
    // The window spans up to `window-size` of samples `stats-interval` apart.
    std::thread::sleep(Duration::from_secs(5).saturating_sub(started.elapsed()));
    assert!(num(&r.status()["window_seconds"]) >= 3.5, "a minute's window spans the agent's uptime");
    r.set("resource-control.window-size", "2500ms");
    r.until("a 2.5 s window of 1 s samples", Duration::from_secs(4), |s| {
        (1.9..=2.1).contains(&num(&s["window_seconds"]))
    });
    r.set("resource-control.stats-interval", "300ms");
    r.until("a 2.5 s window of 300 ms samples", Duration::from_secs(4), |s| {
        (2.25..=2.55).contains(&num(&s["window_seconds"]))
    });

    // [resource-control.cpu-throttle], the custom profile.
    r.set("enabled", "false");
    r.until("throttle off", Duration::from_secs(2), |s| s["admission"]["throttle"] == false);
    r.set("resource-control.max-read-cpu-ratio", "0.3");
    r.set("enabled", "true");
    r.until("throttle on, on a budget of 0.3", Duration::from_secs(2), |s| {
        s["admission"]["throttle"] == true && near(&s["admission"]["global"]["refill_us"], per_interval(0.3, cores))
    });
    r.set("enabled", "false");
    r.set("resource-control.max-read-cpu-ratio", "0.5");
    r.set("enabled", "true");
    r.until("back on 0.5", Duration::from_secs(2), |s| {
        near(&s["admission"]["global"]["refill_us"], per_interval(0.5, cores))
    });
    r.set("keyspace-cpu-quotas", "5:100,6:2000,7:600");
    let s = r.until("keyspace 7's quota", Duration::from_secs(2), |_| r.row(7)["bucket"]["source"] == "config");
    assert!(s["keyspaces"].as_array().is_some());
    assert_eq!(r.row(7)["bucket"]["refill_us"], 6000, "600 ‰ of a core per 10 ms");

    // Estimates: learned from what requests use, static when learning is
    // off, per keyspace where configured.
    let o = r.workload(None, &["tickets", "--keyspace", "5", "--threads", "1", "--seconds", "1.5", "--work-us", "300"]);
    assert!(o.status.success(), "{}", text(&o));
    r.until("keyspace 5 learned ~300 µs", Duration::from_secs(5), |_| {
        (150.0..=700.0).contains(&num(&r.row(5)["estimate_us"]))
    });
    r.set("enable-adaptive-estimated-cpu-per-request-us", "false");
    r.until("the static estimate back", Duration::from_secs(3), |_| r.row(5)["estimate_us"] == 1000);
    r.set("estimated-cpu-per-request-us", "3000");
    r.until("the default estimate 3000", Duration::from_secs(3), |_| r.row(5)["estimate_us"] == 3000);
    r.set("keyspace-estimated-cpu-per-request-us", "5:2500,6:1000");
    r.until("keyspace estimates", Duration::from_secs(3), |_| {
        r.row(5)["estimate_us"] == 2500 && r.row(6)["estimate_us"] == 1000 && r.row(7)["estimate_us"] == 3000
    });

    // Runtime token management: an estimate takes at most a tenth of the
    // buckets (and tops up as it runs), or all of it without.
    let clipped = taken(&r, 6, 50_000);
    assert!((1..=10_000).contains(&clipped), "with runtime top-ups the 50 ms estimate takes a tenth: {clipped}");
    r.set("enable-runtime-token-management", "false");
    assert_eq!(taken(&r, 6, 50_000), 50_000, "without runtime top-ups the estimate is taken whole");

    // Enforcing the node's budget: a second 90 ms request overdraws the
    // 100 ms global bucket, or is refused.
    let mut h = Holder::start(&r.agent.socket);
    let overdrafts = r.status()["admission"]["global_overdrafts"].as_u64().unwrap();
    for _ in 0..2 {
        assert_eq!(h.say("acquire 6 0 90000")["ok"], true);
    }
    assert!(r.status()["admission"]["global_overdrafts"].as_u64().unwrap() > overdrafts, "best effort overdraws");
    h.say("release");
    drop(h);
    r.set("enforce-global-limit", "true");
    let mut h = Holder::start(&r.agent.socket);
    assert_eq!(h.say("acquire 6 0 90000")["ok"], true);
    let second = h.say("acquire 6 0 90000");
    assert_eq!(second["refused"], "global_exhausted", "enforced: {second}");
    h.say("release");
    drop(h);
    r.set("enforce-global-limit", "false");

    // Low-priority requests: their own bucket (0.1 of the cores) once
    // enabled, so a 50 ms one is refused there.
    r.set("low-priority-dag-global-enabled", "true");
    let mut h = Holder::start(&r.agent.socket);
    let low = h.say("acquire 6 0 50000 low");
    assert_eq!(low["refused"], "low_priority_exhausted", "{low}");
    r.set("low-priority-dag-global-enabled", "false");
    assert_eq!(h.say("acquire 6 0 50000 low")["ok"], true);
    h.say("release");
    drop(h);

    // Top-ups of a running request: how often it checks, from what share
    // of its grant it asks, and how much each brings. A 20 ms request that
    // starts with 1 ms asks until its grant covers consumed / threshold.
    r.set("enable-runtime-token-management", "true");
    assert_topups(&r, 0.5, 4.0);
    r.set("additional-allocation-threshold", "0.9");
    assert_topups(&r, 0.9, 4.0);
    r.set("per-allocation-us", "10000");
    assert_topups(&r, 0.9, 10.0);
    // A check every 200 ms: a 20 ms request never reaches one (even with
    // a hypervisor stealing the host's time inside it).
    r.set("runtime-check-interval-us", "200000");
    let (rarely, c) = topups_per_request(&r);
    assert!(rarely == 0.0, "a {c:.2} ms request never reaches a 200 ms check: {rarely:.2}");
    for (key, value) in [("runtime-check-interval-us", "2000"), ("per-allocation-us", "4000")] {
        r.set(key, value);
    }
    r.set("additional-allocation-threshold", "0.5");

    // A steady load at 0.6 of the node budget (keyspace 7's quota) for
    // the refill and fairness keys.
    let mut load = Command::new(workload_bin())
        .args(["tickets", "--keyspace", "7", "--threads", "2", "--seconds", "60", "--work-us", "1000", "--socket"])
        .arg(&r.agent.socket)
        .stdout(Stdio::null())
        .spawn()
        .expect("load");
    let budget = per_interval(0.5, cores);
    let ratio = |s: &Value| num(&s["admission"]["global_ratio"]);
    r.until("the load at about 0.6 of the budget", Duration::from_secs(6), |s| (0.45..=0.75).contains(&ratio(s)));
    let refill = |s: &Value| num(&s["admission"]["global"]["refill_us"]);
    r.set("enable-dynamic-adjustment", "true");
    r.set("low-watermark", "0.2");
    r.set("high-watermark", "0.3");
    r.until("above the high watermark: the refill lowered", Duration::from_secs(4), |s| refill(s) < 0.8 * budget);
    r.set("enable-dynamic-adjustment", "false");
    r.until("no dynamic adjustment: the base refill", Duration::from_secs(3), |s| refill(s) == budget);
    r.set("enable-dynamic-adjustment", "true");
    r.until("lowered again", Duration::from_secs(4), |s| refill(s) < 0.8 * budget);
    r.set("high-watermark", "0.95");
    r.holds("between the watermarks: kept", Duration::from_millis(1500), |s| refill(s) < 0.8 * budget);
    r.set("low-watermark", "0.9");
    r.until("below the low watermark: restored", Duration::from_secs(4), |s| refill(s) == budget);
    r.set("enable-dynamic-adjustment", "false");
    r.set("low-watermark", "0.5");
    r.set("high-watermark", "0.8");
    r.until("the load back near its quota", Duration::from_secs(6), |s| (0.45..=0.75).contains(&ratio(s)));

    let fair = |r: &Run| r.metric("tikv_cpu_throttle_fair_allocations_total", "");
    r.set("enable-fair-allocation", "true");
    let f0 = fair(&r);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(fair(&r), f0, "the global ratio is under fair-allocation-threshold 0.7");
    r.set("fair-allocation-threshold", "0.3");
    let start = Instant::now();
    while fair(&r) <= f0 {
        assert!(start.elapsed() < Duration::from_secs(4), "fair allocation never ran above the threshold");
        std::thread::sleep(Duration::from_millis(100));
    }
    r.set("enable-fair-allocation", "false");
    std::thread::sleep(Duration::from_millis(300));
    let f1 = fair(&r);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(fair(&r), f1, "fair allocation off");
    r.set("fair-allocation-threshold", "0.7");

    let bursts = |r: &Run| r.metric("tikv_cpu_throttle_burst_total", "keyspace_id=\"7\"");
    let grows = |r: &Run, what: &str| {
        let b0 = bursts(r);
        let start = Instant::now();
        while bursts(r) <= b0 {
            assert!(start.elapsed() < Duration::from_secs(4), "{what}: no burst");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let still = |r: &Run, what: &str| {
        std::thread::sleep(Duration::from_millis(300));
        let b0 = bursts(r);
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(bursts(r), b0, "{what}: burst");
    };
    r.set("enable-burst", "true");
    grows(&r, "burst on, the node under burst-threshold 0.9");
    r.set("keyspace-burst-enabled", "7:false");
    still(&r, "keyspace 7's burst off");
    r.set("keyspace-burst-enabled", "\"\"");
    grows(&r, "keyspace 7's burst back");
    r.set("burst-threshold", "0.2");
    still(&r, "the node above burst-threshold 0.2");
    r.set("enable-burst", "false");
    r.set("burst-threshold", "0.9");
    let _ = load.kill();
    let _ = load.wait();

    // PD service limits: keyspaces 5 and 6 at 300 : 100.
    let pd_of = |s: &Value| s["pd"].clone();
    let pd_row = |s: &Value, ks: u64| {
        pd_of(s)["keyspaces"]
            .as_array()
            .and_then(|a| a.iter().find(|k| k["keyspace_id"] == ks).cloned())
            .unwrap_or(Value::Null)
    };
    let source = |r: &Run, ks: u64| r.row(ks)["bucket"]["source"].as_str().unwrap_or("").to_string();
    r.set("enable-pd-service-limit", "true");
    r.until("PD quotas", Duration::from_secs(5), |_| source(&r, 5) == "pd" && source(&r, 6) == "pd");
    let rounds = |s: &Value| s["pd"]["rounds"].as_u64().unwrap_or(0);
    let r0 = rounds(&r.status());
    std::thread::sleep(Duration::from_millis(1200));
    assert!(rounds(&r.status()) <= r0 + 1, "a round every 30 s");
    // (A request may take at most the interval.)
    r.set("pd-service-limit-request-timeout", "450ms");
    r.set("pd-service-limit-fetch-interval", "500ms");
    r.until("a round every 500 ms", Duration::from_secs(3), |s| rounds(s) >= r0 + 3);
    let result = |s: &Value, name: &str| s["pd"]["results"][name].as_u64().unwrap_or(0);
    pd.reply("five", Reply::Slow(Duration::from_millis(300), 300.0));
    std::thread::sleep(Duration::from_millis(600));
    let t0 = result(&r.status(), "timeout");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(result(&r.status(), "timeout"), t0, "a 300 ms answer is within 450 ms");
    r.set("pd-service-limit-request-timeout", "150ms");
    r.until("a 300 ms answer times out", Duration::from_secs(3), |s| result(s, "timeout") > t0);
    pd.reply("five", Reply::Limit(300.0));
    let s = r.until("five's quota", Duration::from_secs(3), |s| pd_row(s, 5)["last_result"] == "ok");
    let q5 = pd_row(&s, 5)["quota_us"].clone();
    pd.reply("five", Reply::Limit(310.0));
    r.until("six's quota moved 2.4 %", Duration::from_secs(4), |s| pd_row(s, 5)["service_limit"] == 310.0);
    r.holds("five's moved 0.8 %, under the 1 % threshold", Duration::from_millis(1000), |s| {
        pd_row(s, 5)["quota_us"] == q5
    });
    r.set("pd-service-limit-update-threshold", "0.001");
    r.until("over a 0.1 % threshold", Duration::from_secs(3), |s| pd_row(s, 5)["quota_us"] != q5);
    r.set("pd-override-config", "false");
    r.until("the static quota wins", Duration::from_secs(3), |_| source(&r, 5) == "config");
    r.set("pd-override-config", "true");
    r.until("PD's quota wins", Duration::from_secs(3), |_| source(&r, 5) == "pd");
    r.set("pd-service-limit-consecutive-404", "1000");
    pd.reply("five", Reply::NotFound);
    r.until("404s counted", Duration::from_secs(5), |s| pd_row(s, 5)["consecutive_404"].as_u64() >= Some(3));
    assert_eq!(source(&r, 5), "pd", "fewer 404s than the limit keep the quota");
    r.set("pd-service-limit-consecutive-404", "2");
    r.until("dropped after 2 404s", Duration::from_secs(3), |_| source(&r, 5) == "config");
    pd.reply("five", Reply::Limit(300.0));
    r.until("PD's quota again", Duration::from_secs(3), |_| source(&r, 5) == "pd");
    pd.reply("five", Reply::ServerError);
    r.holds("errors keep the quota for the 10 min TTL", Duration::from_millis(1200), |_| source(&r, 5) == "pd");
    r.set("pd-service-limit-ttl", "1s");
    r.until("dropped past a 1 s TTL", Duration::from_secs(4), |_| source(&r, 5) == "config");
    let asked = other_pd.asked().len();
    r.set("pd.endpoints", &format!("[\"http://{}\"]", other_pd.addr));
    let start = Instant::now();
    while other_pd.asked().len() <= asked {
        assert!(start.elapsed() < Duration::from_secs(3), "the new PD member is never asked");
        std::thread::sleep(Duration::from_millis(50));
    }
    r.set("enable-pd-service-limit", "false");
    r.until("no PD", Duration::from_secs(3), |s| s["pd"].is_null() && source(&r, 6) == "config");
    pd.stop();

    // [write-quota]: a keyspace's writes are refused while 0.3 of the
    // threshold is pending.
    let mut h = Holder::start(&r.agent.socket);
    assert_eq!((h.acquire(5, 20 * MIB), h.acquire(5, 1)), (Ok(()), Ok(())), "20 MiB pending, under 30");
    h.say("release");
    r.set("write-quota.pending-write-threshold", "\"50MiB\"");
    assert_eq!(h.acquire(5, 20 * MIB), Ok(()));
    assert_eq!(h.acquire(5, 1), Err("write_keyspace_limit".into()), "20 MiB pending, over 15");
    h.say("release");
    r.set("write-quota.pending-write-threshold", "\"100MiB\"");

    // [admission-control]
    r.set("admission-control.max-concurrent-per-tenant", "2");
    r.set("admission-control.mode", "enforced");
    assert_eq!((h.acquire(5, 0), h.acquire(5, 0)), (Ok(()), Ok(())));
    assert_eq!(h.acquire(5, 0), Err("tenant_admission_control".into()));
    h.say("release");
    r.set("admission-control.mode", "monitor");
    let breaches = r.status()["admission"]["monitor_breaches"].as_u64().unwrap();
    for _ in 0..3 {
        assert_eq!(h.acquire(5, 0), Ok(()), "monitor mode refuses nothing");
    }
    assert!(r.status()["admission"]["monitor_breaches"].as_u64().unwrap() > breaches, "the breach recorded");
    h.say("release");
    r.set("admission-control.mode", "disabled");
    r.set("admission-control.max-concurrent-per-tenant", "0");
    drop(h);

    // [latency-guard]: what the guard runs on, in status (its effect on the
    // refills is tests/latency_guard.rs).
    let guard = |r: &Run| r.status()["admission"]["latency_guard"].clone();
    assert_eq!(guard(&r)["enabled"], false);
    r.set("latency-guard.enabled", "true");
    assert_eq!(guard(&r)["enabled"], true);
    r.set("latency-guard.target-wait-p99", "\"500us\"");
    assert_eq!(guard(&r)["target_wait_p99_us"], 500);
    r.set("latency-guard.floor-ratio", "0.5");
    assert_eq!(guard(&r)["floor_ratio"], 0.5);
    r.set("latency-guard.decrease", "0.5");
    assert_eq!(guard(&r)["decrease"], 0.5);
    r.set("latency-guard.increase", "0.25");
    assert_eq!(guard(&r)["increase"], 0.25);
    r.set("latency-guard.enabled", "false");
    assert_eq!(guard(&r)["enabled"], false);

    // [agent]
    let folded = |r: &Run| r.metric("governor_metrics_keyspaces_folded", "");
    assert_eq!(folded(&r), 0.0);
    r.set("agent.metrics-max-keyspaces", "1");
    assert!(folded(&r) >= 2.0, "the rest folded into keyspace_id=\"other\"");
    assert!(r.scrape().contains("keyspace_id=\"other\""));
    r.set("agent.metrics-max-keyspaces", "500");
    // Two clients of one uid register a thread each.
    let exhausted = |r: &Run| r.status()["threads"]["exhausted"].as_u64().unwrap();
    let two = |r: &Run| {
        let (mut a, mut b) = (Holder::start_as(&r.agent.socket, NOBODY), Holder::start_as(&r.agent.socket, NOBODY));
        assert_eq!(a.say("register")["registered"], true);
        b.say("register")
    };
    let e0 = exhausted(&r);
    let second = two(&r);
    assert_eq!((exhausted(&r), &second["registered"]), (e0, &Value::Bool(true)), "{second}");
    r.set("agent.max-threads-per-uid", "1");
    std::thread::sleep(Duration::from_millis(300));
    let second = two(&r);
    assert!(second["refused"].is_string() && exhausted(&r) > e0, "the uid's second thread refused a slot: {second}");
    r.set("agent.max-threads-per-uid", "8192");
    r.set("agent.max-keyspaces-per-uid", "1");
    let mut h = Holder::start_as(&r.agent.socket, NOBODY);
    assert_eq!((h.acquire(41, 0), h.acquire(42, 0)), (Ok(()), Ok(())));
    let overflow = r.status()["admission"]["overflow"]["keyspaces"].clone();
    assert!(
        overflow.as_array().is_some_and(|a| a.iter().any(|k| k == 42)),
        "42 shares the overflow bucket: {overflow}"
    );
    // Refused by the uid's quota, with room left in the table: every view
    // names the quota, not a full table.
    let by_uid = r.status()["admission"]["overflow"]["by_uid_quota"].clone();
    assert!(by_uid.as_array().is_some_and(|a| a.iter().any(|k| k == 42)), "{by_uid}");
    let said = text(&r.governor(&["keyspace", "42"]));
    assert!(said.contains("its server's uid holds its quota of cells (agent.max-keyspaces-per-uid"), "{said}");
    assert!(!said.contains("table is full"), "{said}");
    let status = text(&r.governor(&["status"]));
    assert!(status.contains("refused by their uid's quota: raise agent.max-keyspaces-per-uid"), "{status}");
    drop(h);
    r.set("agent.max-keyspaces-per-uid", "2048");

    // [agent.access]
    let mode = |r: &Run| std::fs::metadata(&r.agent.socket).unwrap().mode() & 0o777;
    r.set("agent.access.socket-mode", "\"0600\"");
    assert_eq!(mode(&r), 0o600);
    // The socket's mode keeps others out: EX_NOPERM (77), as a role would.
    let o = r.governor_as(NOBODY, &["status"]);
    assert_eq!(o.status.code(), Some(77), "{}", text(&o));
    r.set("agent.access.socket-mode", "\"0666\"");
    assert_eq!(mode(&r), 0o666);
    let group = |r: &Run| std::fs::metadata(&r.agent.socket).unwrap().gid();
    r.set("agent.access.socket-group", "\"daemon\"");
    assert_eq!(group(&r), 1, "the daemon group");
    r.set("agent.access.socket-group", "\"root\"");
    assert_eq!(group(&r), 0);
    let nobody_tickets = |r: &Run| {
        r.workload(Some(NOBODY), &["tickets", "--keyspace", "5", "--threads", "1", "--seconds", "0.1"]).status.success()
    };
    assert!(nobody_tickets(&r), "anyone may take tickets");
    // Roles nest: a client may read, and an empty list lets anyone in.
    let nobody_reads = |r: &Run| r.governor_as(NOBODY, &["status"]).status.code();
    r.set("agent.access.clients", "[\"daemon\"]");
    assert!(!nobody_tickets(&r), "only daemon may");
    assert_eq!(nobody_reads(&r), Some(0), "anyone may read");
    r.set("agent.access.readers", "[\"daemon\"]");
    assert_eq!(nobody_reads(&r), Some(77), "only daemon may read");
    r.set("agent.access.readers", "[\"nobody\"]");
    assert_eq!(nobody_reads(&r), Some(0), "nobody reads");
    assert!(!nobody_tickets(&r), "but takes no tickets");
    r.set("agent.access.clients", "[]");
    r.set("agent.access.readers", "[]");
    let nobody_set = |r: &Run| r.governor_as(NOBODY, &["config", "set", "agent.metrics-max-keyspaces=400"]);
    assert_eq!(nobody_set(&r).status.code(), Some(77));
    r.set("agent.access.admins", "[\"nobody\"]");
    let o = nobody_set(&r);
    assert_eq!(o.status.code(), Some(0), "an admin now: {}", text(&o));
    r.set("agent.access.admins", "[]");

    // The Essential profile, its tenant cap, the servers' cores and a rule
    // capped by them.
    r.set("profile", "essential");
    r.until("the seed's cap", Duration::from_secs(2), |s| s["admission"]["tenant_max_cpu_ratio"] == 0.4);
    let mut h = Holder::start(&r.agent.socket);
    assert_eq!(h.acquire(50, 0), Ok(()));
    let cap_refill = |r: &Run| num(&r.row(50)["bucket"]["refill_us"]);
    assert_eq!(r.row(50)["bucket"]["source"], "tenant_cap");
    assert_eq!(cap_refill(&r), per_interval(0.4, cores));
    r.set("tenant-max-cpu-ratio", "0.25");
    r.until("the cap at 0.25", Duration::from_secs(2), |_| cap_refill(&r) == per_interval(0.25, cores));
    // The cgroup of a rule is made when the rule first matches a process.
    let sleeper = Reap(Command::new("sleep").arg("600").spawn().unwrap());
    let o = r.governor(&["rules", "add", "capped", "--keyspace", "60", "--tgid", &sleeper.0.id().to_string()]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    r.covered.insert("rules".into());
    let rule_cap = |s: &Value| num(&s["rules"][0]["cap_cores"]);
    r.until("the rule capped at the tenant cap", Duration::from_secs(2), |s| (rule_cap(s) - 0.25 * cores).abs() < 1e-6);
    // The bandwidth period the rule's cap is written over: status says it,
    // and the keyspace's cgroup holds it.
    let period_file = |s: &Value| {
        let how = s["rule_enforcement"].as_str().unwrap_or_default().to_string();
        // "… in <root>/<prefix>-ks-<id>"
        let dir = how.rsplit_once(" in ").map(|(_, p)| p.replace("<id>", "60"));
        (how, dir.map(std::path::PathBuf::from))
    };
    let (how, dir) = period_file(&r.status());
    assert!(how.contains("over 250 ms"), "the default period: {how}");
    let read_period = |dir: &std::path::Path| {
        ["cpu.cfs_period_us", "cpu.max"]
            .iter()
            .find_map(|f| std::fs::read_to_string(dir.join(f)).ok())
            .unwrap_or_default()
    };
    let dir = dir.expect("rule caps enforced by a cgroup on this host");
    r.until("the rule's process in its cgroup", Duration::from_secs(2), |_| !read_period(&dir).is_empty());
    assert!(read_period(&dir).trim().ends_with("250000"), "{}: {}", dir.display(), read_period(&dir));
    r.set("resource-control.rule-cpu-period", "\"100ms\"");
    r.until("the period at 100 ms", Duration::from_secs(2), |s| {
        s["rule_enforcement"].as_str().unwrap_or_default().contains("over 100 ms")
    });
    assert!(read_period(&dir).trim().ends_with("100000"), "{}: {}", dir.display(), read_period(&dir));
    r.refused("resource-control.rule-cpu-period", "\"2s\"", "rule-cpu-period");
    r.set("resource-control.rule-cpu-period", "\"250ms\"");
    r.set("resource-control.server-cpu-cores", "1");
    let s = r.until("one core", Duration::from_secs(2), |s| s["server_cpu"]["cores"] == 1.0);
    assert_eq!(s["server_cpu"]["source"], "config", "{:#}", s["server_cpu"]);
    assert!(near(&s["admission"]["global"]["refill_us"], per_interval(0.5, 1.0)), "the budget of one core");
    assert_eq!(cap_refill(&r), per_interval(0.25, 1.0));
    assert!((rule_cap(&s) - 0.25).abs() < 1e-6, "the rule's cap follows the cores: {:#}", s["rules"]);
    r.set("resource-control.server-cpu-cores", "0");
    r.until("the node's cores", Duration::from_secs(2), |s| s["server_cpu"]["source"] == "node");
    h.say("release");
    drop(h);
    r.set("tenant-cap-idle-ttl", "1s");
    r.until("the idle tenant's bucket given up", Duration::from_secs(6), |_| {
        r.row(50)["bucket"]["source"] != "tenant_cap"
    });
    r.set("profile", "premium");
    r.until("no cap", Duration::from_secs(2), |s| s["admission"]["tenant_max_cpu_ratio"] == 0.0);
    r.set("profile", "custom");

    // Every key of the configuration was changed above: the embedded
    // default's, plus the optional socket group and the rules.
    let keys = default_keys();
    let missing: Vec<&String> = keys.difference(&r.covered).collect();
    assert!(missing.is_empty(), "keys without an online check: {missing:?}");
    let extra: Vec<&String> = r.covered.difference(&keys).collect();
    assert_eq!(extra, ["agent.access.socket-group", "rules"], "covered beyond the default: {extra:?}");
    eprintln!("{} keys checked online", r.covered.len());
}
