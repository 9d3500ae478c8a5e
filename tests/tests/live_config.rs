//! Live configuration against a running agent: `governor config set`,
//! `governor config reload` and SIGHUP change what the agent enforces at
//! once; a bad change (out of range, restart-only, unknown key, a file with
//! several errors) is refused whole with every reason, exit 64, and the
//! running configuration stays; the log and the counters record both; only
//! root or the agent's uid may change it.

use governor_tests::{Agent, governor_bin, output_text as text};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// The Essential profile: a tenant cap with its required settings.
fn capped(ratio: f64) -> String {
    format!(
        "[resource-control.cpu-throttle]\nenabled = true\nenforce-global-limit = true\ntenant-max-cpu-ratio = {ratio}\n\
         enable-burst = false\nenable-fair-allocation = false\nenable-dynamic-adjustment = false\n"
    )
}

fn governor(agent: &Agent, args: &[&str]) -> Output {
    Command::new(governor_bin()).args(args).arg("--socket").arg(&agent.socket).output().expect("governor runs")
}

fn cap_ratio(agent: &Agent) -> f64 {
    agent.status().expect("status").admission.tenant_max_cpu_ratio
}

#[test]
fn set_reload_and_sighup_apply_at_once_and_bad_changes_change_nothing() {
    let agent = Agent::start("auto", &capped(0.25)).expect("agent");
    let path = agent.config_path().expect("a config file").to_path_buf();
    assert_eq!(cap_ratio(&agent), 0.25);

    // One key, applied at once: the policy's cap follows.
    let o = governor(&agent, &["config", "set", "resource-control.cpu-throttle.tenant-max-cpu-ratio=0.5", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(v["accepted"], true);
    assert_eq!(v["changes"][0]["key"], "resource-control.cpu-throttle.tenant-max-cpu-ratio");
    assert_eq!((v["changes"][0]["old"].as_str(), v["changes"][0]["new"].as_str()), (Some("0.25"), Some("0.5")));
    assert_eq!(cap_ratio(&agent), 0.5);

    // Out of range; restart-only; a profile rule broken by one key: each
    // refused with its reason, exit 64, nothing changes.
    for (set, reason) in [
        ("resource-control.cpu-throttle.tenant-max-cpu-ratio=1.5", "must be in [0, 1]"),
        ("resource-control.cpu-throttle.refill-interval=20ms", "cannot change online"),
        ("resource-control.cpu-throttle.enable-burst=true", "must be false while tenant-max-cpu-ratio > 0"),
        ("resource-control.cpu-throttle.no-such-key=1", "no-such-key"),
    ] {
        let o = governor(&agent, &["config", "set", set]);
        assert_eq!(o.status.code(), Some(64), "{set}: {}", text(&o));
        assert!(String::from_utf8_lossy(&o.stderr).contains(reason), "{set}: {}", text(&o));
        assert_eq!(cap_ratio(&agent), 0.5, "{set} changed the running configuration");
    }
    let o = governor(&agent, &["config", "set", "not-an-assignment"]);
    assert_eq!(o.status.code(), Some(64), "{}", text(&o));
    let o = governor(&agent, &["config", "set", "=5"]);
    assert_eq!(o.status.code(), Some(64), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("`=5` names no key"), "{}", text(&o));
    // Several wrong entries of a list: each is named.
    let o = governor(&agent, &["config", "set", "resource-control.cpu-throttle.keyspace-cpu-quotas=1:0,x:5"]);
    assert_eq!(o.status.code(), Some(64), "{}", text(&o));
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(said.contains("2 entries are wrong") && said.contains("\"1:0\"") && said.contains("\"x:5\""), "{said}");

    // A file with several errors: every one of them reported, none applied.
    std::fs::write(
        &path,
        capped(0.1).replace("enable-burst = false", "enable-burst = true")
            + "[agent]\nmax-keyspaces = 8192\n[resource-control]\nmax-read-cpu-ratio = 7\n",
    )
    .unwrap();
    let o = governor(&agent, &["config", "reload", "--json"]);
    assert_eq!(o.status.code(), Some(64), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let errors: Vec<String> =
        v["errors"].as_array().expect("errors").iter().map(|e| e.as_str().unwrap().to_string()).collect();
    for part in ["enable-burst", "max-read-cpu-ratio", "max-keyspaces"] {
        assert!(errors.iter().any(|e| e.contains(part)), "no reason about {part}: {errors:#?}");
    }
    assert_eq!(cap_ratio(&agent), 0.5);

    // The file fixed: SIGHUP applies it.
    std::fs::write(&path, capped(0.1)).unwrap();
    agent.signal(libc::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(5);
    while cap_ratio(&agent) != 0.1 {
        assert!(Instant::now() < deadline, "SIGHUP did not apply the file:\n{}", agent.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    // `config reload` of an unchanged file: accepted, nothing changed.
    let o = governor(&agent, &["config", "reload"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("nothing changed"), "{}", text(&o));

    // Counted and logged: 3 accepted (set, SIGHUP, reload), 6 refused (the
    // malformed assignments never reached the agent).
    let s = agent.status().expect("status");
    assert_eq!((s.config_updates.accepted, s.config_updates.rejected), (3, 6), "{:?}", s.config_updates);
    assert_eq!(s.config_updates.path.as_deref(), Some(path.canonicalize().unwrap().to_str().unwrap()));
    // `config show --socket`: what the agent holds now, and where it came from.
    let o = governor(&agent, &["config", "show", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let shown: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(shown["config"]["resource-control"]["cpu-throttle"]["tenant-max-cpu-ratio"], 0.1, "{shown}");
    assert_eq!(shown["changes_accepted"], 3, "{shown}");
    assert_eq!(shown["file"].as_str(), s.config_updates.path.as_deref());
    // The test's agent listens where its command line says, not where its file does.
    assert_eq!(shown["overridden"]["agent.control-socket"].as_str(), agent.socket.to_str(), "{shown}");
    let o = governor(&agent, &["status"]);
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(said.contains("3 changes accepted, 6 refused since start"), "{said}");
    assert!(said.contains(&format!("metrics      http://{}/metrics", s.metrics_addr.as_deref().unwrap())), "{said}");
    let log = agent.log_text();
    assert!(log.contains("tenant-max-cpu-ratio 0.25 -> 0.5"), "{log}");
    assert!(log.contains("SIGHUP") && log.contains("tenant-max-cpu-ratio 0.5 -> 0.1"), "{log}");
    assert_eq!(log.matches("refused, the running configuration stays").count(), 6, "{log}");
    // A set to the value in force, written another way: nothing changed, and why.
    let o = governor(&agent, &["config", "set", "write-quota.pending-write-threshold=100mb"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "accepted; nothing changed: write-quota.pending-write-threshold is that value already\n"
    );
}

#[test]
fn only_root_or_the_agents_uid_may_change_the_configuration() {
    // A socket every local account can reach (clients register through
    // it): the change itself checks the peer.
    let agent =
        Agent::start("auto", &format!("{}[agent.access]\nsocket-mode = \"0666\"\n", capped(0.25))).expect("agent");
    let o = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(governor_bin())
        .args(["config", "set", "resource-control.cpu-throttle.tenant-max-cpu-ratio=1", "--socket"])
        .arg(&agent.socket)
        .output()
        .expect("setpriv");
    let out = text(&o);
    assert_eq!(o.status.code(), Some(77), "{out}");
    assert!(out.contains("needs the admin role, held by root, the agent's user"), "{out}");
    assert_eq!(cap_ratio(&agent), 0.25);
    assert_eq!(agent.status().unwrap().config_updates.rejected, 0, "a refused peer is not a refused configuration");
}

/// The seeds' Essential profile in one step from the embedded default:
/// the tenant cap alone is refused there (its required settings conflict,
/// and the refusal names the profile), `profile=essential` switches them
/// together with a cap of 0.4, after which the cap moves on its own; a
/// greedy tenant is then held at the cap; `profile=premium` goes back.
#[test]
fn one_step_to_the_essential_profile_and_back() {
    let agent = Agent::start_default("ebpf").expect("agent");
    let throttle = |a: &Agent| a.status().expect("status").admission.throttle;
    assert!(!throttle(&agent) && cap_ratio(&agent) == 0.0, "the default: no throttle, no cap");
    let cap = "resource-control.cpu-throttle.tenant-max-cpu-ratio=0.25";
    let o = governor(&agent, &["config", "set", cap]);
    assert_eq!(o.status.code(), Some(64), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    for key in ["enforce-global-limit", "enable-burst", "enable-fair-allocation", "enable-dynamic-adjustment"] {
        assert!(err.contains(&format!("cpu-throttle.{key}: must be")), "{key} named: {}", text(&o));
    }
    assert!(
        err.contains("profile = \"essential\" sets every such key"),
        "the refusal names the one step: {}",
        text(&o)
    );
    assert_eq!(cap_ratio(&agent), 0.0, "refused whole");

    let o = governor(&agent, &["config", "set", "resource-control.cpu-throttle.profile=essential", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let changed: Vec<&str> = v["changes"].as_array().unwrap().iter().filter_map(|c| c["key"].as_str()).collect();
    eprintln!("profile=essential changed {changed:?}");
    for key in [
        "profile",
        "enabled",
        "enforce-global-limit",
        "enable-burst",
        "enable-fair-allocation",
        "enable-dynamic-adjustment",
        "tenant-max-cpu-ratio",
    ] {
        assert!(changed.contains(&format!("resource-control.cpu-throttle.{key}").as_str()), "{key} in {changed:?}");
    }
    assert_eq!(changed.len(), 7, "only the profile's keys that differed: {changed:?}");
    assert!(throttle(&agent), "the throttle is on");
    assert_eq!(cap_ratio(&agent), 0.4, "the seed's example cap");

    // The README's own example now works as written.
    let o = governor(&agent, &["config", "set", cap]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(cap_ratio(&agent), 0.25);
    // And the cap acts: a greedy tenant on every core is held at it.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let mut greedy = Command::new(governor_tests::workload_bin())
        .args(["tickets", "--keyspace", "91", "--threads", "2", "--seconds", "5", "--socket"])
        .arg(&agent.socket)
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("workload");
    std::thread::sleep(Duration::from_secs(1));
    let windows = agent.sample_windows(91, 3, None).expect("windows");
    let _ = greedy.wait();
    let want = 0.25 * cores;
    for (i, w) in windows.iter().enumerate() {
        eprintln!("window {i}: {:.3} cores (cap {want:.3}), steal {:.1} %", w.cores, w.steal_pct);
        assert!(w.cores <= want * 1.10, "window {i}: {:.3} cores over the cap {want:.3}", w.cores);
        assert!(
            w.cores >= want * (0.85 - w.steal_pct / 100.0),
            "window {i}: {:.3} cores, held below the cap {want:.3}",
            w.cores
        );
    }

    // A tenant cap and premium do not mix; premium restores its defaults.
    let o = governor(&agent, &["config", "set", "resource-control.cpu-throttle.profile=premium"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(cap_ratio(&agent), 0.0);
    let o = governor(&agent, &["config", "set", cap]);
    assert_eq!(o.status.code(), Some(64), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("must be 0 with profile = \"premium\""), "{}", text(&o));
}

#[test]
fn the_embedded_default_has_no_file_to_reload_but_can_be_set() {
    let agent = Agent::start_default("auto").expect("agent");
    let o = governor(&agent, &["config", "reload"]);
    assert_eq!(o.status.code(), Some(64), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("embedded default"), "{}", text(&o));
    let o = governor(&agent, &["config", "set", "agent.metrics-max-keyspaces=3"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
}

/// Fifty invalid changes in a row, over every path (`config set` of many
/// keys, reloads of broken files): each refused naming its key, the
/// running configuration identical to the start after every one, and the
/// agent counting all fifty.
#[test]
fn fifty_invalid_changes_are_each_refused_naming_the_key_and_change_nothing() {
    let agent = Agent::start("auto", &capped(0.25)).expect("agent");
    let path = agent.config_path().expect("a config file").to_path_buf();
    let original = std::fs::read_to_string(&path).unwrap();
    let before = agent.status().expect("status");
    let sets: Vec<(String, &str)> = vec![
        ("resource-control.cpu-throttle.tenant-max-cpu-ratio=-0.1".into(), "tenant-max-cpu-ratio"),
        ("resource-control.cpu-throttle.tenant-max-cpu-ratio=nan".into(), "tenant-max-cpu-ratio"),
        ("resource-control.cpu-throttle.tenant-max-cpu-ratio=\"half\"".into(), "tenant-max-cpu-ratio"),
        ("resource-control.max-read-cpu-ratio=2".into(), "max-read-cpu-ratio"),
        ("resource-control.stats-interval=0s".into(), "stats-interval"),
        ("resource-control.window-size=1ms".into(), "window-size"),
        ("resource-control.stats-interval=forever".into(), "stats-interval"),
        ("resource-control.cpu-throttle.enable-fair-allocation=true".into(), "enable-fair-allocation"),
        ("resource-control.cpu-throttle.enable-dynamic-adjustment=true".into(), "enable-dynamic-adjustment"),
        ("resource-control.cpu-throttle.keyspace-cpu-quotas=1:x".into(), "keyspace-cpu-quotas"),
        ("resource-control.cpu-throttle.keyspace-cpu-quotas=1:100,1:200".into(), "keyspace-cpu-quotas"),
        (
            "resource-control.cpu-throttle.keyspace-estimated-cpu-per-request-us=7:0".into(),
            "keyspace-estimated-cpu-per-request-us",
        ),
        ("resource-control.cpu-throttle.keyspace-burst-enabled=3:maybe".into(), "keyspace-burst-enabled"),
        ("resource-control.cpu-throttle.refill-interval=50ms".into(), "refill-interval"),
        ("resource-control.cpu-throttle.burst-window=5s".into(), "burst-window"),
        ("resource-control.cpu-throttle.enable-pd-service-limit=true".into(), "enable-pd-service-limit"),
        ("resource-control.enable-qps-bytes-limiter=true".into(), "enable-qps-bytes-limiter"),
        ("admission-control.mode=strict".into(), "admission-control.mode"),
        ("admission-control.max-concurrent-per-tenant=-1".into(), "max-concurrent-per-tenant"),
        ("write-quota.pending-write-threshold=12".into(), "pending-write-threshold"),
        ("write-quota.pending-write-threshold=lots".into(), "pending-write-threshold"),
        ("agent.control-socket=/tmp/elsewhere.sock".into(), "control-socket"),
        ("agent.metrics-addr=127.0.0.1:1".into(), "metrics-addr"),
        ("agent.measure=thread-clock".into(), "agent.measure"),
        ("agent.max-threads=128".into(), "max-threads"),
        ("agent.max-keyspaces=64".into(), "max-keyspaces"),
        ("agent.timer-period=5ms".into(), "timer-period"),
        ("agent.metrics-max-keyspaces=0".into(), "metrics-max-keyspaces"),
        ("agent.max-threads-per-uid=0".into(), "max-threads-per-uid"),
        ("agent.max-keyspaces-per-uid=1000000".into(), "max-keyspaces-per-uid"),
        ("agent.access.socket-mode=0999".into(), "socket-mode"),
        ("agent.access.clients=[\"no-such-user-here\"]".into(), "agent.access.clients"),
        ("agent.access.admins=[\"@no-such-group-here\"]".into(), "agent.access.admins"),
        ("agent.no-such-key=1".into(), "no-such-key"),
        ("no-such-section.key=1".into(), "no-such-section"),
        ("resource-control.cpu-throttle=1".into(), "resource-control.cpu-throttle"),
    ];
    let mut refused = 0;
    for (set, key) in &sets {
        let o = governor(&agent, &["config", "set", set, "--json"]);
        assert_eq!(o.status.code(), Some(64), "{set}: {}", text(&o));
        assert!(
            String::from_utf8_lossy(&o.stdout).contains(key),
            "{set}: the refusal does not name {key}: {}",
            text(&o)
        );
        assert_eq!(cap_ratio(&agent), 0.25, "{set} changed the running configuration");
        refused += 1;
    }
    // Broken files, reloaded: each names its key.
    let files: Vec<(String, &str)> = (0..14)
        .map(|i| match i % 7 {
            0 => (capped(0.25) + &format!("[agent]\nmax-threads = {}\n", 10 + i), "max-threads"),
            1 => (capped(0.25) + "[resource-control]\nwindow-size = \"1ms\"\n", "window-size"),
            2 => (capped(0.25).replace("enable-burst = false", "enable-burst = true"), "enable-burst"),
            3 => (capped(0.25) + "[agent]\nno-such-key = 1\n", "no-such-key"),
            4 => (capped(0.25) + "[[rules]]\nname = \"r\"\nkeyspace = -5\nuid = 0\n", "rules.r.keyspace"),
            5 => (capped(0.25) + "[agent.access]\nreaders = [\"@no-such-group-here\"]\n", "agent.access.readers"),
            _ => ("this is = = not toml".to_string(), "line 1"),
        })
        .collect();
    for (body, key) in &files {
        std::fs::write(&path, body).unwrap();
        let o = governor(&agent, &["config", "reload", "--json"]);
        assert_eq!(o.status.code(), Some(64), "{body}: {}", text(&o));
        assert!(String::from_utf8_lossy(&o.stdout).contains(key), "reload does not name {key}: {}", text(&o));
        assert_eq!(cap_ratio(&agent), 0.25, "a reload changed the running configuration");
        refused += 1;
    }
    // The file gone: EX_NOINPUT (66), naming it, the configuration kept.
    std::fs::remove_file(&path).unwrap();
    let o = governor(&agent, &["config", "reload", "--json"]);
    assert_eq!(o.status.code(), Some(66), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains(&*path.to_string_lossy()), "{}", text(&o));
    assert_eq!(cap_ratio(&agent), 0.25, "a reload of no file changed the running configuration");
    refused += 1;
    // A FIFO in its place (no writer ever comes): refused at once, naming
    // what it is; the agent goes on answering.
    assert!(Command::new("mkfifo").arg(&path).status().unwrap().success());
    let t0 = Instant::now();
    let o = governor(&agent, &["config", "reload", "--json"]);
    assert_eq!(o.status.code(), Some(66), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("a FIFO, not a configuration file"), "{}", text(&o));
    assert!(t0.elapsed() < Duration::from_secs(2), "the reload of a FIFO took {:?}", t0.elapsed());
    assert_eq!(cap_ratio(&agent), 0.25);
    std::fs::remove_file(&path).unwrap();
    refused += 1;
    // An empty file (an editor between truncating and writing it) would put
    // the embedded default in force, rules and quotas gone: refused.
    for empty in ["", "\n  \n"] {
        std::fs::write(&path, empty).unwrap();
        let o = governor(&agent, &["config", "reload", "--json"]);
        assert_eq!(o.status.code(), Some(64), "{}", text(&o));
        assert!(String::from_utf8_lossy(&o.stdout).contains("is empty: a file still being written?"), "{}", text(&o));
        assert_eq!(cap_ratio(&agent), 0.25);
        refused += 1;
    }
    assert!(refused >= 50, "{refused} attempts");
    let after = agent.status().expect("status");
    assert_eq!(after.config_updates.rejected - before.config_updates.rejected, refused);
    assert_eq!(after.config_updates.accepted, before.config_updates.accepted);
    // The original file reloaded: accepted with nothing to change, so the
    // running configuration is still exactly the one the agent started on.
    std::fs::write(&path, original).unwrap();
    let o = governor(&agent, &["config", "reload", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(v["changes"].as_array().map(Vec::len), Some(0), "{v}");
}

/// Configuration changes that put rules in force, status reads, `/metrics`
/// scrapes and new keyspaces' cell requests, all at once for a few seconds,
/// with a rule whose idle keyspace the tick looks at every interval: the
/// agent answers every one of them. (Status once took the engine, the cell
/// grants and the configuration under the measurement lock, against the
/// order the tick and a configuration change take them: the agent stopped
/// answering.)
#[test]
fn status_scrapes_cell_requests_and_changes_at_once_never_stall_the_agent() {
    let config = format!("{}\n[[rules]]\nname = \"idle\"\nkeyspace = 61\ncomm-prefix = \"zz-no-such\"\n", capped(0.25));
    let agent = Agent::start("ebpf", &config).expect("agent");
    let addr = agent.status().unwrap().metrics_addr.expect("metrics address");
    let until = Instant::now() + Duration::from_secs(6);
    let slowest = std::sync::Mutex::new(Vec::<(String, Duration)>::new());
    let timed = |what: &str, f: &dyn Fn()| {
        let mut n = 0u32;
        let mut worst = Duration::ZERO;
        while Instant::now() < until {
            let t = Instant::now();
            f();
            worst = worst.max(t.elapsed());
            n += 1;
        }
        slowest.lock().unwrap().push((format!("{what} ×{n}"), worst));
    };
    std::thread::scope(|s| {
        s.spawn(|| timed("status", &|| drop(agent.status().expect("status answered"))));
        s.spawn(|| timed("scrape", &|| assert!(governor_tests::scrape_metrics(&addr).contains("governor_"))));
        s.spawn(|| {
            let ratio = std::cell::Cell::new(0.25);
            timed("config set", &|| {
                ratio.set(if ratio.get() == 0.25 { 0.3 } else { 0.25 });
                let kv = format!("resource-control.cpu-throttle.tenant-max-cpu-ratio={}", ratio.get());
                let o = governor(&agent, &["config", "set", &kv]);
                assert_eq!(o.status.code(), Some(0), "{}", text(&o));
            })
        });
        s.spawn(|| {
            let ks = std::cell::Cell::new(1000u32);
            timed("new keyspace", &|| {
                ks.set(ks.get() + 1);
                let ks = ks.get().to_string();
                governor_tests::run_workload(&agent.socket, &["tickets", "--keyspace", &ks, "--seconds", "0.01"])
                    .expect("tickets on a new keyspace");
            })
        });
    });
    let slowest = slowest.into_inner().unwrap();
    eprintln!("{slowest:?}");
    for (what, worst) in &slowest {
        assert!(*worst < Duration::from_secs(3), "{what}: one took {worst:?}");
    }
    // Every lock was taken in the order: none of these paths can deadlock
    // another (a lock taken against it is counted; its pair is in the log).
    let broken = agent.status().unwrap().lock_order_violations;
    assert_eq!(broken, 0, "locks taken against the order; the agent's log names them");
}
