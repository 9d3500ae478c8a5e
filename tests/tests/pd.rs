//! PD service limits on a live agent, against a PD stand-in over real HTTP
//! that answers slowly, with 404s, 500s, resets and malformed JSON, and goes
//! down: quotas follow PD's ratios, faults never cost a quota before the
//! TTL, and `governor status` and the `tikv_service_limit_*` metrics say
//! what happened.

use governor_tests::fake_pd::{FakePd, Reply};
use governor_tests::{Agent, Scratch, governor_bin, scrape_metrics};
use keyspace_governor::proto::{PdKeyspaceStatus, PdStatus, StatusReport};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

const TTL: Duration = Duration::from_secs(4);

fn config(pd: &FakePd, dead_port: u16) -> String {
    format!(
        r#"
[resource-control]
max-read-cpu-ratio = 0.5
[resource-control.cpu-throttle]
enabled = true
enable-dynamic-adjustment = false
keyspace-cpu-quotas = "1:200,2:200,3:200"
enable-pd-service-limit = true
pd-service-limit-fetch-interval = "200ms"
pd-service-limit-request-timeout = "150ms"
pd-service-limit-ttl = "{}s"
pd-service-limit-consecutive-404 = 3
pd-service-limit-update-threshold = 0.01
pd-override-config = true
[pd]
# The first member is down: every request fails over to the second.
endpoints = ["127.0.0.1:{dead_port}", "http://{}"]
"#,
        TTL.as_secs(),
        pd.addr
    )
}

fn pd_of(s: &StatusReport) -> PdStatus {
    s.pd.clone().expect("status shows PD while it is enabled")
}

fn row(s: &StatusReport, id: u32) -> PdKeyspaceStatus {
    pd_of(s).keyspaces.into_iter().find(|k| k.keyspace_id == id).unwrap_or_default()
}

/// The keyspace's bucket: where its quota comes from, and its refill.
fn bucket(s: &StatusReport, id: u32) -> Option<(String, u64)> {
    s.keyspaces.iter().find(|k| k.keyspace_id == id)?.bucket.as_ref().map(|b| (b.source.clone(), b.refill_us))
}

/// Polls status until `f` says yes (20 ms apart); panics with the last
/// status after `limit`.
fn wait(agent: &Agent, limit: Duration, what: &str, f: impl Fn(&StatusReport) -> bool) -> (StatusReport, Duration) {
    let start = Instant::now();
    loop {
        let s = agent.status().unwrap();
        if f(&s) {
            return (s, start.elapsed());
        }
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}; PD status: {:#?}", s.pd);
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn result_count(s: &StatusReport, result: &str) -> u64 {
    pd_of(s).results.get(result).copied().unwrap_or(0)
}

#[test]
fn quotas_follow_pd_and_faults_never_drop_them_before_the_ttl() {
    let mut pd = FakePd::start();
    pd.keyspace(1, "tenant-one", "ENABLED");
    pd.keyspace(2, "tenant two", "ENABLED");
    pd.keyspace(3, "t3", "ENABLED");
    pd.reply("tenant-one", Reply::Limit(300.0));
    pd.reply("tenant two", Reply::Limit(100.0));
    pd.reply("t3", Reply::Limit(0.0));
    let dead_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let agent = Agent::start("ebpf", &config(&pd, dead_port)).unwrap();
    let first = agent.status().unwrap();
    // cores × 0.5 per 10 ms refill interval.
    let global = u64::from(first.logical_cores) * 5_000;
    assert_eq!(first.admission.global.refill_us, global);

    // Steady: 300 : 100 of the global refill; 0 means unlimited, which
    // overrides the static quota too (pd-override-config).
    let (s, _) = wait(&agent, Duration::from_secs(5), "PD quotas", |s| {
        bucket(s, 1).is_some_and(|b| b.0 == "pd") && bucket(s, 2).is_some_and(|b| b.0 == "pd") && bucket(s, 3).is_none()
    });
    let (q1, q2) = (bucket(&s, 1).unwrap().1, bucket(&s, 2).unwrap().1);
    assert_eq!((q1, q2), (global * 3 / 4, global / 4), "{:#?}", s.pd);
    assert_eq!((row(&s, 1).quota_us, row(&s, 1).service_limit), (Some(q1), Some(300.0)));
    assert_eq!((row(&s, 2).name.as_deref(), row(&s, 2).state.as_deref()), (Some("tenant two"), Some("ENABLED")));
    assert_eq!((row(&s, 3).service_limit, row(&s, 3).quota_us), (Some(0.0), None));
    let p = pd_of(&s);
    assert!(p.reachable && p.rounds >= 1);
    assert_eq!(p.endpoints, vec![format!("http://127.0.0.1:{dead_port}"), format!("http://{}", pd.addr)]);
    assert!(
        pd.asked().iter().any(|p| p == "/resource-manager/api/v1/config/keyspace/service-limit/tenant%20two"),
        "names are escaped"
    );

    let o = Command::new(governor_bin()).args(["status", "--socket"]).arg(&agent.socket).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    let line = |needle: &str| {
        text.lines().find(|l| l.contains(needle)).unwrap_or_else(|| panic!("no {needle:?} in\n{text}")).to_string()
    };
    let pd_line = text.lines().find(|l| l.starts_with("pd ")).unwrap_or_default();
    assert!(pd_line.contains(&format!("http://{}", pd.addr)) && pd_line.contains("(reachable,"), "{text}");
    let two: Vec<String> = line("tenant two").split_whitespace().map(str::to_string).collect();
    assert_eq!(two, ["2", "tenant", "two", "ENABLED", "100", &q2.to_string(), "0", "ok"], "{text}");
    assert!(line(" t3 ").contains("unlimited"), "{text}");

    let explain = |id: u32| {
        let o = Command::new(governor_bin())
            .args(["keyspace", &id.to_string(), "--socket"])
            .arg(&agent.socket)
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    assert!(explain(1).contains("keyspace \"tenant-one\" has service_limit 300 RU/s of 400"), "{}", explain(1));
    assert!(explain(3).contains("service_limit for it is 0 (unlimited)"), "{}", explain(3));

    // The seed's metrics, scraped.
    let text = scrape_metrics(&s.metrics_addr.clone().unwrap());
    let value = |line: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(line))
            .unwrap_or_else(|| panic!("no {line} in\n{text}"))
            .trim()
            .parse()
            .unwrap()
    };
    assert_eq!(value("tikv_service_limit_keyspace_value{keyspace_id=\"1\"}"), 300.0);
    assert_eq!(value("tikv_service_limit_keyspace_value{keyspace_id=\"3\"}"), 0.0);
    assert_eq!(value("tikv_service_limit_keyspace_quota_us{keyspace_id=\"2\"}"), q2 as f64);
    assert!(value("tikv_service_limit_fetch_total{result=\"ok\"}") >= 3.0);
    assert!(value("tikv_service_limit_fetch_duration_seconds_count") >= 3.0);
    let body = text.split_once("\r\n\r\n").expect("an HTTP reply").1;
    let problems = governor_tests::promtool_check(body);
    assert!(problems.is_empty(), "promtool check metrics: {problems:#?}");
    let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs_f64();
    let last = value("tikv_service_limit_last_success_timestamp");
    assert!((now - 5.0..=now + 1.0).contains(&last), "last success {last}, now {now}");

    // Faults on both keyspaces, each for 3 rounds, 2.4 s in all (< TTL):
    // no quota moves.
    for fault in [Reply::Slow(Duration::from_millis(400), 1.0), Reply::ServerError, Reply::Reset, Reply::Malformed] {
        pd.reply("tenant-one", fault.clone());
        pd.reply("tenant two", fault);
        std::thread::sleep(Duration::from_millis(600));
        let s = agent.status().unwrap();
        assert_eq!((bucket(&s, 1), bucket(&s, 2)), (Some(("pd".into(), q1)), Some(("pd".into(), q2))), "{:#?}", s.pd);
    }
    let s = agent.status().unwrap();
    for result in ["timeout", "error", "unreachable", "malformed"] {
        assert!(result_count(&s, result) >= 2, "{result}: {:#?}", s.pd);
    }

    // PD down for longer than the TTL: quotas stay.
    pd.reply("tenant-one", Reply::Limit(300.0));
    pd.reply("tenant two", Reply::Limit(100.0));
    pd.stop();
    std::thread::sleep(TTL + Duration::from_secs(1));
    let s = agent.status().unwrap();
    assert!(!pd_of(&s).reachable, "{:#?}", s.pd);
    assert_eq!((bucket(&s, 1), bucket(&s, 2)), (Some(("pd".into(), q1)), Some(("pd".into(), q2))));

    // Back, then keyspace 2 answers 500s only: its quota lasts the TTL,
    // counted from its last value (the outage does not count), then goes;
    // keyspace 1 takes the whole budget and 2 its static quota.
    pd.start_again();
    wait(&agent, Duration::from_secs(3), "PD reachable again", |s| pd_of(s).reachable && row(s, 2).last_result == "ok");
    pd.reply("tenant two", Reply::ServerError);
    let (s, took) =
        wait(&agent, TTL + Duration::from_secs(3), "TTL expiry", |s| bucket(s, 2).is_some_and(|b| b.0 == "config"));
    assert!(
        took >= TTL - Duration::from_millis(600) && took <= TTL + Duration::from_millis(1500),
        "expired after {took:?}"
    );
    assert_eq!(bucket(&s, 1), Some(("pd".into(), global)));
    assert_eq!(bucket(&s, 2), Some(("config".into(), 2_000)), "200 millicores per 10 ms");

    // Archived in PD: its PD quota goes at once.
    pd.reply("tenant two", Reply::Limit(100.0));
    wait(&agent, Duration::from_secs(3), "keyspace 2 back", |s| bucket(s, 2) == Some(("pd".into(), global / 4)));
    let rounds = pd_of(&agent.status().unwrap()).rounds;
    pd.keyspace(1, "tenant-one", "ARCHIVED");
    let (s, _) = wait(&agent, Duration::from_secs(5), "archived", |s| bucket(s, 1).is_some_and(|b| b.0 == "config"));
    // At the first fetch round that saw it (or the one after, if a round
    // was under way when it changed).
    let took = pd_of(&s).rounds - rounds;
    assert!(took <= 2, "archived keyspace dropped after {took} fetch rounds");
    assert_eq!((row(&s, 1).state.as_deref(), row(&s, 1).last_result.as_str()), (Some("ARCHIVED"), "archived"));
    assert_eq!(bucket(&s, 2), Some(("pd".into(), global)));

    // 404s: tolerated twice, the third removes the PD quota.
    pd.reply("tenant two", Reply::NotFound);
    let (s, _) = wait(&agent, Duration::from_secs(2), "a first 404", |s| row(s, 2).consecutive_404 >= 1);
    assert_eq!(bucket(&s, 2), Some(("pd".into(), global)), "one 404 is not a deletion");
    let (s, _) = wait(&agent, Duration::from_secs(2), "three 404s", |s| bucket(s, 2).is_some_and(|b| b.0 == "config"));
    assert!(result_count(&s, "not_found") >= 3);

    // Turned off online: PD quotas go, status stops showing PD.
    pd.keyspace(1, "tenant-one", "ENABLED");
    pd.reply("tenant two", Reply::Limit(100.0));
    wait(&agent, Duration::from_secs(3), "quotas back", |s| bucket(s, 2).is_some_and(|b| b.0 == "pd"));
    let o = Command::new(governor_bin())
        .args(["config", "set", "resource-control.cpu-throttle.enable-pd-service-limit=false", "--socket"])
        .arg(&agent.socket)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s = agent.status().unwrap();
    assert!(s.pd.is_none());
    for id in 1..=3 {
        assert_eq!(bucket(&s, id), Some(("config".into(), 2_000)), "keyspace {id}");
    }
    let log = agent.log_text();
    assert!(log.contains("no member of") && log.contains("quotas stay"), "the outage is logged:\n{log}");
}

#[test]
fn pd_settings_are_checked() {
    let dir = Scratch::new("pd-config");
    let cases = [
        (
            "[resource-control.cpu-throttle]\nenable-pd-service-limit = true\n",
            "enable-pd-service-limit: needs pd.endpoints",
        ),
        ("[pd]\nendpoints = [\"https://pd:2379\"]\n", "https is not supported"),
        ("[pd]\nendpoints = [\"pd\"]\n", "missing the port"),
        ("[pd]\nendpoint = \"pd:2379\"\n", "pd.endpoint: unknown key"),
    ];
    for (text, expected) in cases {
        let file = dir.0.join("bad.toml");
        std::fs::write(&file, text).unwrap();
        let o = Command::new(governor_bin()).args(["config", "validate"]).arg(&file).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(64), "{text}: {err}");
        assert!(err.contains(expected), "{text}: expected {expected:?} in {err}");
    }
    let good = dir.0.join("good.toml");
    std::fs::write(
        &good,
        "[resource-control.cpu-throttle]\nenable-pd-service-limit = true\n[pd]\nendpoints = [\"pd-0.pd:2379\", \"http://10.0.0.2:2379\"]\n",
    )
    .unwrap();
    let o = Command::new(governor_bin()).args(["config", "validate"]).arg(&good).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
