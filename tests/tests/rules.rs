//! Unmodified processes measured by rule: real programs (stress-ng, xz,
//! sha256sum, a shell) that know nothing of governor, matched by tgid,
//! command name and executable, checked against the kernel's own counts
//! (schedstat of every thread, `wait4`'s rusage); a registered thread inside
//! a matched process stays its tags'; bad rules are refused naming the rule
//! and the key.

use governor_tests::{governor_bin, process_tree as tree, spawn_workload_started, workload_bin, Agent, Scratch};
use std::collections::BTreeSet;
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn governor(agent: &Agent, args: &[&str]) -> Output {
    Command::new(governor_bin()).args(args).arg("--socket").arg(&agent.socket).output().expect("governor runs")
}

fn text(o: &Output) -> String {
    format!("exit {:?}\nstdout:\n{}\nstderr:\n{}", o.status.code(), String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Σ schedstat run time of every thread of every process in `pids`.
fn schedstat_sum(pids: &BTreeSet<u32>) -> u64 {
    let mut sum = 0;
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { continue };
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
                sum += s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            }
        }
    }
    sum
}

fn signal_all(pids: &BTreeSet<u32>, sig: i32) {
    for &p in pids {
        // SAFETY: kill(2) on pids of processes this test started.
        unsafe { libc::kill(p as i32, sig) };
    }
}

fn threads_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task")).map(|d| d.count()).unwrap_or(0)
}

struct Group {
    keyspace: u32,
    root: Child,
}

/// Kills a process tree when dropped, so a failed assertion leaves no
/// stress-ng burning CPU under the next test's rules.
struct KillTree(u32);

impl Drop for KillTree {
    fn drop(&mut self) {
        signal_all(&tree(self.0), libc::SIGKILL);
    }
}

/// Stops every group (so each task's last slice is charged at its switch-out),
/// then reads each keyspace and each group's schedstat sum.
fn snapshot(agent: &Agent, groups: &[&Group]) -> Vec<(f64, f64, usize, usize)> {
    let trees: Vec<BTreeSet<u32>> = groups.iter().map(|g| tree(g.root.id())).collect();
    for t in &trees {
        signal_all(t, libc::SIGSTOP);
    }
    std::thread::sleep(Duration::from_millis(100));
    let status = agent.status().expect("status");
    let out = groups
        .iter()
        .zip(&trees)
        .map(|(g, t)| {
            let charged = status.keyspaces.iter().find(|k| k.keyspace_id == g.keyspace).map_or(0.0, |k| k.cpu_seconds);
            let threads = t.iter().map(|p| threads_of(*p)).sum();
            (charged, schedstat_sum(t) as f64 / 1e9, t.len(), threads)
        })
        .collect();
    for t in &trees {
        signal_all(t, libc::SIGCONT);
    }
    out
}

#[test]
fn real_programs_are_charged_by_rule_within_half_a_percent_of_schedstat() {
    let _s = serial();
    // Started before the agent: a multi-process stress-ng, matched by tgid
    // (its workers inherit).
    let mut a = Group {
        keyspace: 901,
        root: Command::new("stress-ng").args(["--cpu", "2", "--timeout", "60"]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap(),
    };
    let _reap_a = KillTree(a.root.id());
    std::thread::sleep(Duration::from_millis(300));
    let config = format!(
        "[[rules]]\nname = \"early-stress\"\nkeyspace = 901\ntgid = {}\n\n\
         [[rules]]\nname = \"late-stress\"\nkeyspace = 902\ncomm-prefix = \"stress-ng\"\n\n\
         [[rules]]\nname = \"xz\"\nkeyspace = 903\nexe = \"/usr/bin/xz\"\n",
        a.root.id()
    );
    let agent = Agent::start("ebpf", &config).unwrap();
    // Started after the rules: stress-ng matched by command name, and a
    // two-thread xz matched by executable, started from a shell.
    let mut b = Group {
        keyspace: 902,
        root: Command::new("stress-ng").args(["--cpu", "1", "--timeout", "60"]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap(),
    };
    let mut c = Group {
        keyspace: 903,
        root: Command::new("sh").args(["-c", "xz -T2 -3 -c < /dev/urandom > /dev/null"]).spawn().unwrap(),
    };
    let (_reap_b, _reap_c) = (KillTree(b.root.id()), KillTree(c.root.id()));
    std::thread::sleep(Duration::from_millis(500));
    let before = snapshot(&agent, &[&a, &b, &c]);
    std::thread::sleep(Duration::from_secs(4));
    let after = snapshot(&agent, &[&a, &b, &c]);
    for g in [&mut a, &mut b, &mut c] {
        signal_all(&tree(g.root.id()), libc::SIGKILL);
        let _ = g.root.wait();
    }
    for (i, ((c0, s0, procs, threads), (c1, s1, _, _))) in before.iter().zip(&after).enumerate() {
        let (charged, truth) = (c1 - c0, s1 - s0);
        let err = (charged / truth - 1.0) * 100.0;
        eprintln!(
            "keyspace {}: {procs} processes, {threads} threads: charged {charged:.4} s, schedstat {truth:.4} s: {err:+.3} %",
            901 + i
        );
        assert!(truth > 0.5, "group {i} hardly ran ({truth:.3} s): the test measures nothing");
        assert!((-0.5..=0.5).contains(&err), "keyspace {}: {err:+.3} % off schedstat\n{}", 901 + i, agent.log_text());
    }
    assert!(before[0].2 >= 3, "stress-ng --cpu 2 is a parent and two workers: {:?}", before[0]);
    assert!(before[2].3 >= 3, "xz -T2 runs a thread per block beside its main thread: {:?}", before[2]);
    let listed = governor(&agent, &["rules", "list", "--json"]);
    let list: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap_or_else(|_| panic!("{}", text(&listed)));
    assert_eq!(list["rules"].as_array().map(Vec::len), Some(3), "{list}");
    assert_eq!(list["events_dropped"], 0, "{list}");
}

#[test]
fn a_thousand_short_lived_processes_are_all_counted() {
    let _s = serial();
    let scratch = Scratch::new("rules-short");
    let data = scratch.0.join("data");
    std::fs::write(&data, vec![7u8; 512 << 10]).unwrap();
    let agent = Agent::start("ebpf", "").unwrap();
    // A shell that waits for a line, then forks and execs a real binary a
    // thousand times. It is put under a rule by tgid while it waits: its
    // children inherit at fork and keep the keyspace through their exec.
    // Reaped below by wait4, which also gives its rusage.
    #[allow(clippy::zombie_processes)]
    let mut sh = Command::new("sh")
        .arg("-c")
        .arg(format!("read go; for i in $(seq 1000); do sha256sum {} > /dev/null; done", data.display()))
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = sh.id();
    let added = governor(&agent, &["rules", "add", "spawner", "--keyspace", "950", "--tgid", &pid.to_string()]);
    assert!(added.status.success(), "{}", text(&added));
    let t0 = Instant::now();
    std::io::Write::write_all(sh.stdin.as_mut().unwrap(), b"go\n").unwrap();
    // wait4: the shell's rusage with every child it reaped.
    let mut status = 0;
    // SAFETY: an all-zero rusage is valid; wait4 on our own child.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::wait4(pid as i32, &mut status, 0, &mut ru) };
    assert_eq!(r, pid as i32);
    let elapsed = t0.elapsed();
    std::thread::sleep(Duration::from_millis(300));
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    let truth = tv(ru.ru_utime) + tv(ru.ru_stime);
    let charged = agent.keyspace_seconds(950).unwrap();
    let err = (charged / truth - 1.0) * 100.0;
    let s = agent.status().unwrap();
    eprintln!(
        "1000 processes in {elapsed:?}: charged {charged:.4} s, rusage {truth:.4} s: {err:+.2} % ({} reports, {} dropped)",
        s.rule_events, s.rule_events_dropped
    );
    assert!(truth > 0.5, "the processes hardly ran ({truth:.3} s)");
    assert!((-2.0..=2.0).contains(&err), "{err:+.2} % off the kernel's rusage");
    assert!(s.rule_events >= 1000, "every exec is reported: {}", s.rule_events);
}

#[test]
fn a_registered_thread_in_a_matched_process_is_charged_by_its_tags() {
    let _s = serial();
    let exe = std::fs::canonicalize(workload_bin()).unwrap();
    let config = format!("[[rules]]\nname = \"workload\"\nkeyspace = 12\nexe = {:?}\n", exe.display().to_string());
    let agent = Agent::start("ebpf", &config).unwrap();
    let (mut child, mut out) =
        spawn_workload_started(&agent.socket, &["busy", "--keyspace", "11", "--seconds", "1"]).unwrap();
    let mut last = String::new();
    std::io::BufRead::read_line(&mut out, &mut last).unwrap();
    assert!(child.wait().unwrap().success());
    std::thread::sleep(Duration::from_millis(100));
    let ran = serde_json::from_str::<serde_json::Value>(&last).unwrap()["thread_cpu_ns"].as_u64().unwrap() as f64 / 1e9;
    let tagged = agent.keyspace_seconds(11).unwrap();
    let by_rule = agent.keyspace_seconds(12).unwrap();
    eprintln!("tagged thread ran {ran:.4} s: keyspace 11 {tagged:.4} s, rule's keyspace 12 {by_rule:.4} s");
    assert!((tagged - ran).abs() <= ran * 0.005, "{tagged:.4} s charged to the tag for {ran:.4} s");
    // The rule measures the rest of the process (start-up, connecting,
    // the untagged moments): something, and far less than the work.
    assert!(by_rule > 0.0 && by_rule < ran * 0.05, "{by_rule:.4} s charged by rule");
}

#[test]
fn bad_rules_are_refused_naming_the_rule_and_the_key() {
    let _s = serial();
    let scratch = Scratch::new("rules-bad");
    let file = scratch.0.join("bad.toml");
    std::fs::write(
        &file,
        "[[rules]]\nname = \"a\"\nkeyspace = 1\ncgroup = \"/no/such/cgroup-here\"\n\n\
         [[rules]]\nname = \"b\"\nkeyspace = -1\ncomm-prefix = \"a-name-much-too-long\"\n\n\
         [[rules]]\nname = \"a\"\nkeyspace = 2\nuid = 0\n\n\
         [[rules]]\nname = \"c\"\nkeyspace = 3\n\n\
         [[rules]]\nname = \"d\"\nkeyspace = 4\nexe = \"bin/x\"\n\n\
         [[rules]]\nname = \"e\"\nkeyspace = 5\nthread-name-prefix = \"\"\n",
    )
    .unwrap();
    let out = Command::new(governor_bin()).args(["config", "validate", "--json"]).arg(&file).output().unwrap();
    assert_eq!(out.status.code(), Some(64), "{}", text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let keys: Vec<&str> = v["errors"].as_array().unwrap().iter().filter_map(|e| e["key"].as_str()).collect();
    for want in ["rules.a.cgroup", "rules.b.keyspace", "rules.b.comm-prefix", "rules.a.name", "rules.c", "rules.d.exe", "rules.e.thread-name-prefix"] {
        assert!(keys.contains(&want), "no error for {want}: {keys:?}");
    }
    // Online: refused whole with exit 64; the rules in force stay.
    let agent = Agent::start("ebpf", "[[rules]]\nname = \"keep\"\nkeyspace = 5\nuid = 12345\n").unwrap();
    let refused = governor(&agent, &["rules", "add", "keep", "--keyspace", "6", "--comm-prefix", "x"]);
    assert_eq!(refused.status.code(), Some(64), "{}", text(&refused));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("rules.keep.name"), "{}", text(&refused));
    let missing = governor(&agent, &["rules", "remove", "nope"]);
    assert_eq!(missing.status.code(), Some(64), "{}", text(&missing));
    let s = agent.status().unwrap();
    assert_eq!(s.rules.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), ["keep"]);
    let removed = governor(&agent, &["rules", "remove", "keep"]);
    assert!(removed.status.success(), "{}", text(&removed));
    assert!(agent.status().unwrap().rules.is_empty());
}

/// The cgroup (relative path) of `pid` in the hierarchy with the cpu
/// controller: the v1 `cpu` one on a hybrid host, else v2.
fn cpu_cgroup(pid: u32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let v1 = text.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, c, p) = (f.next()?, f.next()?, f.next()?);
        c.split(',').any(|c| c == "cpu").then(|| p.to_string())
    });
    v1.or_else(|| text.lines().find_map(|l| l.strip_prefix("0::").map(str::to_string)))
}

/// Where the hierarchy with the cpu controller is mounted.
fn cpu_hierarchy() -> std::path::PathBuf {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let mount = mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let cpu_v1 = f[2] == "cgroup" && f[3].split(',').any(|o| o == "cpu");
            let v2 = f[2] == "cgroup2"
                && std::fs::read_to_string(format!("{}/cgroup.controllers", f[1])).unwrap_or_default().contains("cpu");
            (cpu_v1 || v2).then(|| f[1].to_string())
        })
        .next_back()
        .unwrap();
    std::path::PathBuf::from(mount)
}

/// The CFS bandwidth settings of a cgroup directory, as written there.
fn bandwidth(dir: &std::path::Path) -> String {
    ["cpu.max", "cpu.cfs_quota_us", "cpu.cfs_period_us"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(dir.join(f)).ok())
        .map(|v| v.trim().to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn a_rule_capped_process_is_held_to_its_cap_by_the_kernel_and_put_back_after() {
    let _s = serial();
    let config = "[resource-control.cpu-throttle]\nenabled = true\nkeyspace-cpu-quotas = \"960:500\"\n\n\
                  [[rules]]\nname = \"capped\"\nkeyspace = 960\ncomm-prefix = \"stress-ng\"\n";
    let mut agent = Agent::start("ebpf", config).unwrap();
    let listed = governor(&agent, &["rules", "list", "--json"]);
    let list: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap_or_else(|_| panic!("{}", text(&listed)));
    if list["enforcement"].as_str().unwrap_or("").starts_with("unavailable") {
        panic!("this host must offer a cpu controller: {list}");
    }
    assert_eq!(list["rules"][0]["cap_cores"], 0.5, "{list}");
    let mut stress =
        Command::new("stress-ng").args(["--cpu", "2", "--timeout", "60"]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let root = stress.id();
    let _reap = KillTree(root);
    let original = cpu_cgroup(std::process::id()).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let group = tree(root);
    assert!(group.len() >= 3, "stress-ng and its two workers: {group:?}");
    let inside = cpu_cgroup(root).unwrap();
    assert!(inside.ends_with("/ks-960"), "stress-ng is in {inside}");
    // Per 1 s window for 10 s: the agent's charge and the kernel's
    // schedstat, each against the 0.5-core cap.
    let mut last = (Instant::now(), agent.keyspace_seconds(960).unwrap(), schedstat_sum(&tree(root)) as f64 / 1e9);
    let mut worst: f64 = 0.0;
    for _ in 0..10 {
        std::thread::sleep(Duration::from_secs(1));
        let now = (Instant::now(), agent.keyspace_seconds(960).unwrap(), schedstat_sum(&tree(root)) as f64 / 1e9);
        let wall = (now.0 - last.0).as_secs_f64();
        let (by_agent, by_kernel) = ((now.1 - last.1) / wall, (now.2 - last.2) / wall);
        eprintln!("window: agent {by_agent:.3} cores, schedstat {by_kernel:.3} cores (cap 0.5)");
        for rate in [by_agent, by_kernel] {
            worst = worst.max(((rate / 0.5) - 1.0).abs() * 100.0);
        }
        last = now;
    }
    assert!(worst <= 5.0, "a window was {worst:.2} % off the 0.5-core cap");
    // Stopped politely: every process back where it was, no cgroup left.
    let cgdir = |rel: &str| cpu_hierarchy().join(rel.trim_start_matches('/'));
    let ks_dir = cgdir(&inside);
    assert!(ks_dir.is_dir());
    let quota = std::fs::read_to_string(ks_dir.join("cpu.cfs_quota_us")).or_else(|_| std::fs::read_to_string(ks_dir.join("cpu.max")));
    assert!(quota.as_deref().unwrap_or("").starts_with("50000"), "{quota:?}");
    agent.restart_with_config("").unwrap();
    for p in tree(root) {
        assert_eq!(cpu_cgroup(p).as_deref(), Some(original.as_str()), "process {p} after the agent stopped");
    }
    assert!(!ks_dir.exists(), "{} left behind", ks_dir.display());
    // SIGKILLed while capping: the next agent on the socket puts it back.
    agent.restart_with_config(config).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(cpu_cgroup(root).unwrap().ends_with("/ks-960"));
    agent.kill9().unwrap();
    assert!(cpu_cgroup(root).unwrap().ends_with("/ks-960"), "a killed agent changes nothing more");
    agent.restart_with_config("").unwrap();
    for p in tree(root) {
        assert_eq!(cpu_cgroup(p).as_deref(), Some(original.as_str()), "process {p} after the restart");
    }
    assert!(!ks_dir.exists(), "{} left behind after the restart", ks_dir.display());
    signal_all(&tree(root), libc::SIGKILL);
    let _ = stress.wait();
}

/// Σ schedstat of the threads of `pid`, split by whether their name starts
/// with `prefix`: (named so, the others).
fn schedstat_by_name(pid: u32, prefix: &str) -> (f64, f64, usize) {
    let (mut named, mut rest, mut n) = (0u64, 0u64, 0);
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let name = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        let ns: u64 = std::fs::read_to_string(t.path().join("schedstat")).unwrap_or_default().split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(0);
        if name.starts_with(prefix) {
            named += ns;
            n += 1;
        } else {
            rest += ns;
        }
    }
    (named as f64 / 1e9, rest as f64 / 1e9, n)
}

/// Keyspaces 700 and 701 as charged, and redis's threads by name, read
/// while redis is stopped (every slice closed).
fn redis_reading(agent: &Agent, redis: u32) -> [f64; 4] {
    signal_all(&BTreeSet::from([redis]), libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(100));
    let (io, rest, _) = schedstat_by_name(redis, "io_thd_");
    let (k700, k701) = (agent.keyspace_seconds(700).unwrap_or(0.0), agent.keyspace_seconds(701).unwrap_or(0.0));
    signal_all(&BTreeSet::from([redis]), libc::SIGCONT);
    [k700, k701, io, rest]
}

fn redis_load(port: u16) {
    let o = Command::new("redis-benchmark")
        .args(["-p", &port.to_string(), "-c", "50", "-P", "16", "-n", "80000", "-t", "get,set", "-q", "--threads", "2"])
        .output()
        .expect("redis-benchmark runs (cargo xtask setup installs redis-tools)");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn a_thread_rule_charges_redis_io_threads_apart_from_the_rest_of_redis() {
    let _s = serial();
    // Redis names its I/O threads io_thd_<n> (pthread_setname_np) as it
    // starts them; its main, bio_* and jemalloc threads go by the process rule.
    let config = "[[rules]]\nname = \"redis-io\"\nkeyspace = 700\ncomm-prefix = \"redis-server\"\nthread-name-prefix = \"io_thd_\"\n\n\
                  [[rules]]\nname = \"redis\"\nkeyspace = 701\ncomm-prefix = \"redis-server\"\n";
    let agent = Agent::start("ebpf", config).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut redis = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(["--io-threads", "3", "--io-threads-do-reads", "yes", "--daemonize", "no"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server runs (cargo xtask setup installs it)");
    let pid = redis.id();
    let _reap = KillTree(pid);
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    let check = |phase: &str, before: [f64; 4], after: [f64; 4], split: bool| {
        let d: Vec<f64> = (0..4).map(|i| after[i] - before[i]).collect();
        let (k700, k701, io, rest) = (d[0], d[1], d[2], d[3]);
        eprintln!("{phase}: keyspace 700 {k700:.4} s, 701 {k701:.4} s; schedstat io_thd_* {io:.4} s, other threads {rest:.4} s");
        assert!(io > 0.3 && rest > 0.3, "{phase}: redis hardly ran (io {io:.3} s, rest {rest:.3} s)");
        let (want700, want701) = if split { (io, rest) } else { (0.0, io + rest) };
        for (ks, got, want) in [(700, k700, want700), (701, k701, want701)] {
            assert!((got - want).abs() <= 0.005 * want + 0.002, "{phase}: keyspace {ks} charged {got:.4} s, schedstat {want:.4} s\n{}", agent.log_text());
        }
    };
    // Named after the rules: the rename reports.
    let start = redis_reading(&agent, pid);
    redis_load(port);
    let loaded = redis_reading(&agent, pid);
    check("renamed under the rule", start, loaded, true);
    let (_, _, io_threads) = schedstat_by_name(pid, "io_thd_");
    let listed = governor(&agent, &["rules", "list", "--json"]);
    let list: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap_or_else(|_| panic!("{}", text(&listed)));
    assert_eq!((io_threads, list["rules"][0]["threads_matched"].as_u64()), (2, Some(2)), "{list}");
    assert_eq!(list["rules"][1]["processes_matched"], 1, "{list}");
    // Without the thread rule its threads go back to the process's keyspace...
    let o = governor(&agent, &["rules", "remove", "redis-io"]);
    assert!(o.status.success(), "{}", text(&o));
    let start = redis_reading(&agent, pid);
    redis_load(port);
    let loaded = redis_reading(&agent, pid);
    check("thread rule removed", start, loaded, false);
    // ...and with it back, the scan finds the named threads again.
    let o = governor(
        &agent,
        &["rules", "add", "redis-io", "--keyspace", "700", "--comm-prefix", "redis-server", "--thread-name-prefix", "io_thd_", "--position", "0"],
    );
    assert!(o.status.success(), "{}", text(&o));
    let start = redis_reading(&agent, pid);
    redis_load(port);
    let loaded = redis_reading(&agent, pid);
    check("thread rule added back", start, loaded, true);
    signal_all(&BTreeSet::from([pid]), libc::SIGKILL);
    let _ = redis.wait();
}

#[test]
fn with_fair_allocation_capped_keyspaces_split_a_saturated_node_by_their_caps() {
    let _s = serial();
    // Two stress-ng, each wanting both cores, capped at 1.6 and 0.8 cores
    // (more than the node together). By weight alone the kernel splits the
    // node evenly, and the 0.8 cap then gives 1.2 : 0.8; weighing the caps,
    // it splits 2 : 1.
    let spawn = || Command::new("stress-ng").args(["--cpu", "2", "--timeout", "60"]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let (mut big, mut small) = (spawn(), spawn());
    let (_reap_big, _reap_small) = (KillTree(big.id()), KillTree(small.id()));
    let config = |fair: bool| {
        format!(
            "[resource-control.cpu-throttle]\nenabled = true\nenable-fair-allocation = {fair}\nkeyspace-cpu-quotas = \"971:1600,972:800\"\n\n\
             [[rules]]\nname = \"big\"\nkeyspace = 971\ntgid = {}\n\n[[rules]]\nname = \"small\"\nkeyspace = 972\ntgid = {}\n",
            big.id(),
            small.id()
        )
    };
    let agent = Agent::start("ebpf", &config(true)).unwrap();
    let rates = |agent: &Agent| -> (f64, f64) {
        std::thread::sleep(Duration::from_millis(700));
        let t0 = (Instant::now(), agent.keyspace_seconds(971).unwrap(), agent.keyspace_seconds(972).unwrap());
        std::thread::sleep(Duration::from_secs(3));
        let t1 = (Instant::now(), agent.keyspace_seconds(971).unwrap(), agent.keyspace_seconds(972).unwrap());
        let wall = (t1.0 - t0.0).as_secs_f64();
        ((t1.1 - t0.1) / wall, (t1.2 - t0.2) / wall)
    };
    let list = governor(&agent, &["rules", "list", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap_or_else(|_| panic!("{}", text(&list)));
    let how = v["enforcement"].as_str().unwrap_or_default().to_string();
    assert!(how.contains("cpu.shares") || how.contains("cpu.weight"), "{v}");
    let (b, s) = rates(&agent);
    eprintln!("weighted by cap: {b:.3} and {s:.3} cores (ratio {:.2})", b / s);
    // Saturated by the two alone (anything else running skews the split).
    assert!(b + s > 1.8, "the node was not saturated by the two: {b:.3} + {s:.3} cores");
    assert!((1.8..=2.2).contains(&(b / s)), "caps 1.6 : 0.8 weighted, got {b:.3} : {s:.3}");
    // Fairness off, online: default weights, and the even split the caps cut.
    let o = governor(&agent, &["config", "set", "resource-control.cpu-throttle.enable-fair-allocation=false"]);
    assert!(o.status.success(), "{}", text(&o));
    let (b, s) = rates(&agent);
    eprintln!("default weights: {b:.3} and {s:.3} cores (ratio {:.2})", b / s);
    assert!(b + s > 1.8, "the node was not saturated by the two: {b:.3} + {s:.3} cores");
    assert!((1.3..=1.7).contains(&(b / s)), "default weights, got {b:.3} : {s:.3}");
    for c in [&mut big, &mut small] {
        signal_all(&tree(c.id()), libc::SIGKILL);
        let _ = c.wait();
    }
}

#[test]
fn cap_in_place_caps_the_operators_own_cgroup_and_puts_it_back() {
    let _s = serial();
    // The operator's cgroup, with a stress-ng in it.
    let rel = format!("/governor-test-own-{}", std::process::id());
    let dir = cpu_hierarchy().join(rel.trim_start_matches('/'));
    std::fs::create_dir_all(&dir).unwrap();
    struct Rmdir(std::path::PathBuf);
    impl Drop for Rmdir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir(&self.0);
        }
    }
    let _rmdir = Rmdir(dir.clone());
    let before = bandwidth(&dir);
    let mut stress = Command::new("sh")
        .arg("-c")
        .arg(format!("echo $$ > {}/cgroup.procs && exec stress-ng --cpu 2 --timeout 60", dir.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let root = stress.id();
    let _reap = KillTree(root);
    std::thread::sleep(Duration::from_millis(500));
    let config = format!(
        "[resource-control.cpu-throttle]\nenabled = true\nkeyspace-cpu-quotas = \"981:500\"\n\n\
         [[rules]]\nname = \"own\"\nkeyspace = 981\ncgroup = \"{rel}\"\ncap-in-place = true\n"
    );
    let mut agent = Agent::start("ebpf", &config).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert!(bandwidth(&dir).contains("50000"), "capped in place: {}", bandwidth(&dir));
    for p in tree(root) {
        assert_eq!(cpu_cgroup(p).as_deref(), Some(rel.as_str()), "process {p} stays in the operator's cgroup");
    }
    let mut last = (Instant::now(), agent.keyspace_seconds(981).unwrap());
    for _ in 0..3 {
        std::thread::sleep(Duration::from_secs(1));
        let now = (Instant::now(), agent.keyspace_seconds(981).unwrap());
        let rate = (now.1 - last.1) / (now.0 - last.0).as_secs_f64();
        eprintln!("window: {rate:.3} cores (cap 0.5, in place)");
        assert!((0.475..=0.525).contains(&rate), "{rate:.3} cores against a 0.5 cap");
        last = now;
    }
    agent.restart_with_config("").unwrap();
    assert_eq!(bandwidth(&dir), before, "put back when the agent stopped");
    // SIGKILLed while capping: the next agent on the socket puts it back.
    agent.restart_with_config(&config).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(bandwidth(&dir).contains("50000"));
    agent.kill9().unwrap();
    agent.restart_with_config("").unwrap();
    assert_eq!(bandwidth(&dir), before, "put back by the next agent");
    // Without a cgroup to cap, the key is refused naming the rule.
    let bad = governor(&agent, &["rules", "add", "loose", "--keyspace", "982", "--comm-prefix", "x", "--cap-in-place"]);
    assert_eq!(bad.status.code(), Some(64), "{}", text(&bad));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("rules.loose.cap-in-place"), "{}", text(&bad));
    signal_all(&tree(root), libc::SIGKILL);
    let _ = stress.wait();
}
