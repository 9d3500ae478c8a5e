//! `governor top` in a real terminal (tmux, read back with capture-pane)
//! and as a script would run it (`--iterations`, `--json`), against an
//! agent measuring a busy keyspace.

use governor_tests::{Agent, governor_bin, schedstat_ns, spawn_workload_started};
use std::process::Command;
use std::time::{Duration, Instant};

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// One busy thread at a time: each has a core of its own.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn tmux(args: &[&str]) -> std::process::Output {
    Command::new("tmux").args(args).output().expect("tmux runs (cargo xtask setup installs it)")
}

#[test]
fn top_redraws_in_a_terminal_and_shows_the_busy_keyspace_first() {
    let _s = serial();
    let agent = Agent::start("ebpf", "").unwrap();
    let (mut busy, _out) =
        spawn_workload_started(&agent.socket, &["busy", "--keyspace", "42", "--seconds", "6"]).unwrap();
    // A quiet keyspace too: it sorts below.
    let client = keyspace_governor::client::Client::connect(&agent.socket).unwrap();
    client.register_current_thread().unwrap();
    drop(keyspace_governor::client::tag(7).unwrap());
    let session = format!("governor-top-{}", std::process::id());
    let cmd = format!("{} top --socket {} --interval 0.5", governor_bin().display(), agent.socket.display());
    let o = tmux(&["new-session", "-d", "-s", &session, "-x", "150", "-y", "30", &cmd]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let capture = || String::from_utf8_lossy(&tmux(&["capture-pane", "-p", "-t", &session]).stdout).into_owned();
    // Frames keep coming: the header line is redrawn in place (one copy on
    // screen) and the busy keyspace's row changes.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut screens = Vec::new();
    while Instant::now() < deadline && screens.len() < 4 {
        std::thread::sleep(Duration::from_millis(700));
        let s = capture();
        if s.contains("KEYSPACE") {
            screens.push(s);
        }
    }
    let _ = tmux(&["kill-session", "-t", &session]);
    let _ = busy.wait();
    assert!(screens.len() >= 3, "top drew {} frames: {screens:?}", screens.len());
    let last = screens.last().unwrap();
    assert_eq!(last.matches("governor top").count(), 1, "redrawn in place, not scrolled:\n{last}");
    let rows: Vec<&str> =
        last.lines().skip_while(|l| !l.contains("KEYSPACE")).skip(1).filter(|l| !l.trim().is_empty()).collect();
    let first: Vec<&str> = rows.first().expect("a row").split_whitespace().collect();
    assert_eq!(first[0], "42", "the busy keyspace sorts first:\n{last}");
    let cores: f64 = first[1].parse().unwrap();
    // Its figure is checked against the kernel's count in the JSON test.
    assert!(cores > 0.05 && cores <= 1.05, "a busy thread uses up to one core, top says {cores}:\n{last}");
    assert!(rows.iter().any(|r| r.split_whitespace().next() == Some("7")), "the quiet keyspace is listed:\n{last}");
}

#[test]
fn top_for_scripts_prints_the_frames_asked_for() {
    let _s = serial();
    let agent = Agent::start("ebpf", "").unwrap();
    let (mut busy, _out) =
        spawn_workload_started(&agent.socket, &["busy", "--keyspace", "43", "--seconds", "8"]).unwrap();
    // The busy thread (the process's main thread) by the kernel's count,
    // around the whole top run.
    let pid = busy.id();
    let ran0 = schedstat_ns(pid, pid).unwrap();
    let t0 = Instant::now();
    let o = Command::new(governor_bin())
        .args(["top", "--json", "--iterations", "3", "--interval", "0.5", "--sort", "keyspace", "--socket"])
        .arg(&agent.socket)
        .output()
        .unwrap();
    let took = t0.elapsed();
    let ran = (schedstat_ns(pid, pid).unwrap() - ran0) as f64 / 1e9;
    let _ = busy.kill();
    let _ = busy.wait();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let frames: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object a line"))
        .collect();
    assert_eq!(frames.len(), 3);
    assert!(took >= Duration::from_millis(1400) && took < Duration::from_secs(5), "3 frames 0.5 s apart took {took:?}");
    // The frames' CPU adds up to what the kernel counted for the busy
    // thread over the run (less its first moments before top's first
    // read, and the scheduler tick the count lags by); no frame has it
    // above one core.
    let mut shown = 0.0;
    for f in &frames {
        let row = f["rows"].as_array().unwrap().iter().find(|r| r["keyspace_id"] == 43).expect("keyspace 43");
        let cores = row["cpu_cores"].as_f64().unwrap();
        let interval = f["interval_seconds"].as_f64().unwrap();
        assert!(cores > 0.0 && cores <= 1.05, "{f}");
        assert!((interval - 0.5).abs() < 0.2, "{f}");
        shown += cores * interval;
    }
    eprintln!("top's frames show {shown:.3} s of CPU; the busy thread ran {ran:.3} s over the run ({took:?})");
    assert!(
        shown <= ran * 1.02 + 0.02 && shown >= ran * 0.75,
        "top's frames show {shown:.3} s, the kernel counted {ran:.3} s"
    );
    // A bad interval, or no frame at all, is a usage error.
    for args in [&["top", "--interval", "0"][..], &["top", "--iterations", "0"][..]] {
        let bad = Command::new(governor_bin()).args(args).arg("--socket").arg(&agent.socket).output().unwrap();
        assert_eq!(bad.status.code(), Some(64), "{args:?}");
    }
    // --limit holds for scripts too.
    let o = Command::new(governor_bin())
        .args(["top", "--json", "--iterations", "1", "--interval", "0.1", "--limit", "0", "--socket"])
        .arg(&agent.socket)
        .output()
        .unwrap();
    let frame: serde_json::Value = serde_json::from_slice(&o.stdout).expect("a frame");
    assert_eq!(frame["rows"], serde_json::json!([]), "{frame}");
}

/// With the throttle off, the cells keep their buckets as they were last
/// and no ticket draws on them: `top` and `status` show none, and show
/// them again once it is back on.
#[test]
fn with_the_throttle_off_no_bucket_is_shown() {
    let _s = serial();
    let agent = Agent::start("ebpf", &governor_tests::essential_config(0.2)).unwrap();
    governor_tests::run_workload(&agent.socket, &["tickets", "--keyspace", "7", "--seconds", "1", "--work-us", "500"])
        .unwrap();
    let cli = |args: &[&str]| {
        let o = Command::new(governor_bin()).args(args).arg("--socket").arg(&agent.socket).output().unwrap();
        assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    let frame = |text: String| -> serde_json::Value { serde_json::from_str(&text).expect("a frame") };
    let row7 = |f: &serde_json::Value| f["rows"].as_array().unwrap().iter().find(|r| r["keyspace_id"] == 7).cloned();
    let top = ["top", "--json", "--iterations", "1", "--interval", "0.1"];
    let on = frame(cli(&top));
    assert_eq!(on["throttle"], true, "{on}");
    assert_eq!(row7(&on).expect("keyspace 7")["bucket_source"], "tenant_cap", "{on}");
    let table_row = |status: &str| -> Vec<String> {
        let line = status.lines().find(|l| l.split_whitespace().next() == Some("7")).expect("keyspace 7's row");
        line.split_whitespace().map(str::to_string).collect()
    };
    assert_eq!(table_row(&cli(&["status"]))[5], "tenant_cap");

    cli(&["config", "set", "resource-control.cpu-throttle.enabled=false"]);
    let off = frame(cli(&top));
    assert_eq!(off["throttle"], false, "{off}");
    let r = row7(&off).expect("keyspace 7 still listed");
    assert!(r["bucket_source"].is_null() && r["bucket_fill_pct"].is_null(), "{off}");
    let text = cli(&["top", "--iterations", "1", "--interval", "0.1"]);
    assert!(text.contains("cpu-throttle off: no bucket holds anything"), "{text}");
    let status = cli(&["status"]);
    assert!(status.contains("global       no bucket holds anything (cpu-throttle off)"), "{status}");
    assert_eq!(&table_row(&status)[5..7], ["-", "-"], "{status}");
    // The JSON keeps the cell's last bucket, beside the switch that says
    // it holds nothing.
    let json: serde_json::Value = serde_json::from_str(&cli(&["status", "--json"])).unwrap();
    assert_eq!(json["admission"]["throttle"], false);

    cli(&["config", "set", "resource-control.cpu-throttle.enabled=true"]);
    let back = frame(cli(&top));
    assert_eq!(row7(&back).expect("keyspace 7")["bucket_source"], "tenant_cap", "{back}");
}
