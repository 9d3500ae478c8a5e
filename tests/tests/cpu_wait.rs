//! CPU pressure per keyspace: the run-queue wait of registered threads is
//! charged to the keyspace they were tagged with while they waited, and
//! matches the kernel's own per-thread count (schedstat's second field);
//! an unregistered process's waits are charged to no one.

use governor_tests::{Agent, Reap as Hog, run_threads_measured, schedstat_pair};
use std::process::{Command, Stdio};

const HEAVY: u32 = 9100;
const LIGHT: u32 = 9200;
const POOLED: u32 = 9250;
const SOLO: u32 = 9260;

/// One test at a time: each names whom its threads waited behind, which
/// another test's threads would change.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn each_keyspace_is_charged_its_threads_run_queue_wait_as_schedstat_counts_it() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let agent = Agent::start_default("ebpf").expect("agent");
    assert_eq!(agent.status().unwrap().wait_source, "kernel");
    // An unregistered CPU hog beside them: it waits too, for no keyspace.
    let hog = Hog(Command::new("sh").args(["-c", "while :; do :; done"]).stdout(Stdio::null()).spawn().expect("hog"));
    let hog_pid = hog.0.id();
    let hog_wait = || schedstat_pair(hog_pid, hog_pid).expect("hog schedstat").1;
    let hog_before = hog_wait();
    // Keyspace HEAVY: four CPU-bound threads; keyspace LIGHT: two threads
    // that wake every millisecond for 100 µs of work. Two processes, on two
    // cores with the hog: everyone waits.
    let run = run_threads_measured(
        &agent,
        &[
            &["--kinds", "busy,busy,busy,busy", "--keyspace-base", &HEAVY.to_string(), "--keyspaces", "1"],
            &["--kinds", "ticker,ticker", "--keyspace-base", &LIGHT.to_string(), "--keyspaces", "1"],
            &["--kinds", "pooled,pooled", "--keyspace-base", &POOLED.to_string(), "--keyspaces", "1"],
        ],
    )
    .expect("workloads");
    let hog_waited = hog_wait() - hog_before;
    let truth = |ks: u32| run.reports.iter().filter(|r| r.keyspace == ks).map(|r| r.schedstat_wait_ns).sum::<u64>();
    // Tagged the whole time: every wait is the keyspace's, to 1 %.
    for (ks, at_least_ns) in [(HEAVY, 200_000_000u64), (LIGHT, 5_000_000)] {
        let kernel = truth(ks) as f64;
        let charged = run.wait_ns.get(&ks).copied().unwrap_or(0.0);
        eprintln!("keyspace {ks}: charged {charged:.0} ns of run-queue wait, schedstat {kernel:.0} ns");
        // Enough wait that a missing or misattributed share would show.
        assert!(kernel >= at_least_ns as f64, "keyspace {ks} waited only {kernel} ns by schedstat: no contention");
        let error = (charged - kernel).abs() / kernel;
        assert!(
            error <= 0.01,
            "keyspace {ks}: charged {charged} ns, schedstat {kernel} ns ({:.2} % off)",
            error * 100.0
        );
    }
    // The pooled threads sleep untagged: each wakeup's wait is charged to
    // the keyspace they tag next (the work they were woken for). A wait
    // whose slice takes no tag (preempted between untagging and going to
    // sleep) is no keyspace's: never more than schedstat, and all but those
    // (none here). In the slow emulated guests of `vm-test`, which set
    // GOVERNOR_TEST_EMULATED, slices are preempted far more often before
    // the worker sleeps (the 6.1 x86_64 guest read 1.3, 5.3 and once 23.1 %
    // charged to no one): there the test asks for at least half, which
    // still tells the wakeups' waits charged from none at all.
    let (kernel, charged) = (truth(POOLED) as f64, run.wait_ns.get(&POOLED).copied().unwrap_or(0.0));
    eprintln!("keyspace {POOLED}: charged {charged:.0} ns of run-queue wait, schedstat {kernel:.0} ns");
    assert!(kernel >= 5_000_000.0, "the pooled threads waited only {kernel} ns by schedstat: no contention");
    let floor = if std::env::var_os("GOVERNOR_TEST_EMULATED").is_some() { 0.5 } else { 0.95 };
    assert!(
        charged <= kernel && charged >= floor * kernel,
        "pooled: charged {charged} ns, schedstat {kernel} ns ({:+.2} %)",
        (charged / kernel - 1.0) * 100.0
    );
    // The hog waited, and nothing was charged for it: the keyspaces' waits
    // are their threads' and no other keyspace waited.
    assert!(hog_waited >= 50_000_000, "the hog waited only {hog_waited} ns: no contention");
    let others: f64 = run.wait_ns.iter().filter(|(k, _)| ![HEAVY, LIGHT, POOLED].contains(k)).map(|(_, v)| v).sum();
    assert_eq!(others, 0.0, "waits charged to other keyspaces: {:?}", run.wait_ns);
    // The light tenant's waits are shown with percentiles over the window.
    let s = agent.status().unwrap();
    let light = s.keyspaces.iter().find(|k| k.keyspace_id == LIGHT).expect("light keyspace in status");
    let (p50, p99) = (light.cpu_wait_p50_us.expect("p50"), light.cpu_wait_p99_us.expect("p99"));
    assert!(light.cpu_waits > 100, "{} waits", light.cpu_waits);
    assert!(0.0 < p50 && p50 <= p99, "p50 {p50} µs, p99 {p99} µs");
    // A ticker's wait is bounded by the four busy threads' slices and the hog's.
    assert!(p99 < 1_000_000.0, "p99 {p99} µs");
    assert_eq!(light.cpu_wait_buckets.iter().sum::<u64>(), light.cpu_waits);
    // The same figures on /metrics, over HTTP (the workloads have exited:
    // nothing moves between the two reads).
    let text = governor_tests::scrape_metrics(s.metrics_addr.as_deref().expect("metrics address"));
    let value = |name: &str| {
        let key = format!("{name}{{keyspace_id=\"{LIGHT}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(&key)?.trim().parse::<f64>().ok())
    };
    let total = value("governor_keyspace_cpu_wait_seconds_total").expect("wait counter on /metrics");
    assert!((total - light.cpu_wait_seconds).abs() < 1e-6, "/metrics {total} s, status {} s", light.cpu_wait_seconds);
    let count = value("governor_keyspace_cpu_wait_duration_seconds_count").expect("wait histogram on /metrics");
    assert_eq!(count, light.cpu_waits as f64);
    // CPU pressure is not counted unless asked (agent.cpu-pressure): no
    // figure anywhere, and nothing attached to wakeups.
    assert!(!s.cpu_pressure);
    assert_eq!(light.cpu_pressure_some, None);
    assert_eq!(value("governor_keyspace_cpu_pressure_some_seconds_total"), None);
    drop(hog);
}

/// CPU pressure, PSI's "some" per keyspace (`agent.cpu-pressure`): the
/// time at least one of its threads waited for a CPU.
#[test]
fn a_keyspaces_cpu_pressure_is_the_time_one_of_its_threads_waited() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let agent = Agent::start("ebpf", "[agent]\ncpu-pressure = true\n").expect("agent");
    assert!(agent.status().unwrap().cpu_pressure, "pressure counted when asked");
    // An unregistered hog beside them, for contention.
    let hog = Hog(Command::new("sh").args(["-c", "while :; do :; done"]).stdout(Stdio::null()).spawn().expect("hog"));
    let run = run_threads_measured(
        &agent,
        &[
            &["--kinds", "busy,busy,busy,busy", "--keyspace-base", &HEAVY.to_string(), "--keyspaces", "1"],
            &["--kinds", "ticker,ticker", "--keyspace-base", &LIGHT.to_string(), "--keyspaces", "1"],
            &["--kinds", "ticker", "--keyspace-base", &SOLO.to_string(), "--keyspaces", "1"],
        ],
    )
    .expect("workloads");
    let truth = |ks: u32| run.reports.iter().filter(|r| r.keyspace == ks).map(|r| r.schedstat_wait_ns).sum::<u64>();
    // A keyspace of one thread: its wait, by schedstat. Counted from the
    // wakeup's tracepoint to the switch-in's by CLOCK_MONOTONIC, where the
    // kernel counts from the enqueue (before the tracepoint: the wakeup's
    // own path is not pressure) to its run-queue clock's last update,
    // which a switch on an idle CPU skips (the wakeup's stands: the time
    // from such a wakeup to the switch-in is pressure, not schedstat's
    // wait). The two ends move the figure by a few µs a wakeup each way:
    // −1.7 to +1.7 % here, and once +3.3 % (CI at 6c185e3; eight runs
    // after it read −0.1 to +1.4 %): from above, 5 %. The emulated guests
    // of `vm-test` (which set GOVERNOR_TEST_EMULATED) read −80 to +280 %
    // of schedstat for a lone
    // ticker's short waits (docs/design.md): there the test checks only
    // that the programs load, count and close on that kernel (some
    // pressure, never more than the run's wall time, none left open).
    let emulated = std::env::var_os("GOVERNOR_TEST_EMULATED").is_some();
    let span = run.span_ns as f64;
    let some = |ks: u32| run.some_ns.get(&ks).copied().unwrap_or(0.0);
    let (solo, solo_kernel) = (some(SOLO), truth(SOLO) as f64);
    eprintln!(
        "keyspace {SOLO} (one thread): {solo:.0} ns with a thread waiting, schedstat {solo_kernel:.0} ns ({:+.2} %), span {span:.0} ns",
        (solo / solo_kernel - 1.0) * 100.0
    );
    // Contention, by schedstat: 5 ms on the host; in the emulated guests
    // 43-241 ms in every run but one of CI's x86_64 guest, which read
    // 1.9 ms (the spinners left the ticker alone most of the run): there 1 ms.
    let contended = if emulated { 1_000_000.0 } else { 5_000_000.0 };
    assert!(solo_kernel >= contended, "the lone ticker waited only {solo_kernel} ns: no contention");
    let (solo_min, solo_max) =
        if emulated { (0.95 * solo_kernel, span) } else { (0.97 * solo_kernel, 1.05 * solo_kernel) };
    assert!((solo_min..=solo_max).contains(&solo), "{solo} ns of pressure for {solo_kernel} ns of wait");
    // Several threads: at least the longest one's wait, at most all of
    // theirs (overlapping waits count once), and never more than the run.
    for ks in [HEAVY, LIGHT] {
        let each: Vec<f64> =
            run.reports.iter().filter(|r| r.keyspace == ks).map(|r| r.schedstat_wait_ns as f64).collect();
        let (longest, all) = (each.iter().copied().fold(0.0, f64::max), each.iter().sum::<f64>());
        eprintln!("keyspace {ks}: {:.0} ns with a thread waiting; threads waited {each:?} ns", some(ks));
        let (min, max) = if emulated { (1.0, span) } else { (0.97 * longest, (1.03 * all).min(span)) };
        assert!(
            some(ks) >= min && some(ks) <= max,
            "keyspace {ks}: {} ns of pressure, threads' waits {each:?}, span {span} ns",
            some(ks)
        );
    }
    // The threads are gone: no keyspace's count is left open (its pressure
    // would grow on), and /metrics says what status says.
    let s = agent.status().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let later = agent.status().unwrap();
    let text = governor_tests::scrape_metrics(later.metrics_addr.as_deref().expect("metrics address"));
    for ks in [HEAVY, LIGHT, SOLO] {
        let at = |r: &keyspace_governor::proto::StatusReport| {
            r.keyspaces.iter().find(|k| k.keyspace_id == ks).map(|k| k.cpu_pressure_some_seconds).expect("in status")
        };
        assert_eq!(at(&s), at(&later), "keyspace {ks}: pressure grew with no thread left");
        let key = format!("governor_keyspace_cpu_pressure_some_seconds_total{{keyspace_id=\"{ks}\"}} ");
        let metric = text.lines().find_map(|l| l.strip_prefix(&key)?.trim().parse::<f64>().ok());
        assert!(metric.is_some_and(|m| (m - at(&later)).abs() < 1e-6), "keyspace {ks}: /metrics {metric:?}");
        let share = later.keyspaces.iter().find(|k| k.keyspace_id == ks).and_then(|k| k.cpu_pressure_some);
        assert!(share.is_some_and(|p| p > 0.0 && p <= 1.0), "keyspace {ks}: share of the window {share:?}");
    }
    drop(hog);
}

/// Threads that switch keyspaces as they run, preempted often: a wait
/// ends in the keyspace it began in, each keyspace's pressure stays within
/// its threads' waits, and none is left open once they are gone. (A
/// switch-in that the kernel's tracepoint did not show once left a
/// thread counted as waiting while it ran; at its next switch-out the
/// count moved to the keyspace it left with, and the first keyspace's
/// pressure then grew a second per second for good.)
#[test]
fn pressure_of_threads_switching_keyspaces_ends_where_it_began_and_closes() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    const A: u32 = 9500;
    const B: u32 = 9501;
    let agent = Agent::start("ebpf", "[resource-control]\nstats-interval = \"250ms\"\n[agent]\ncpu-pressure = true\n")
        .expect("agent");
    let hog = Hog(Command::new("sh").args(["-c", "while :; do :; done"]).stdout(Stdio::null()).spawn().expect("hog"));
    let (a, b) = (A.to_string(), B.to_string());
    let started = std::time::Instant::now();
    governor_tests::run_workload(
        &agent.socket,
        &["rows", "--threads", "4", "--seconds", "4", "--a", a.as_str(), "--b", b.as_str()],
    )
    .expect("rows");
    let span = started.elapsed().as_secs_f64();
    drop(hog);
    // The agent reads the last waits at its next stats interval.
    std::thread::sleep(std::time::Duration::from_millis(600));
    let at = |r: &keyspace_governor::proto::StatusReport, ks: u32| {
        let k = r.keyspaces.iter().find(|k| k.keyspace_id == ks).expect("in status");
        (k.cpu_wait_seconds, k.cpu_pressure_some_seconds)
    };
    let s = agent.status().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(600));
    let later = agent.status().unwrap();
    for ks in [A, B] {
        let (wait, some) = at(&s, ks);
        eprintln!("keyspace {ks}: its threads waited {wait:.3} s; one of them waited during {some:.3} s");
        assert!(wait >= 0.2, "keyspace {ks} waited only {wait} s: no contention");
        // Overlapping waits count once: at most the sum of the waits (with
        // the margin of the test above, and a timer period for each
        // switch-in the tracepoint did not show); in the emulated guests,
        // whose pressure the test above reads loosely, at most the run.
        let most = if std::env::var_os("GOVERNOR_TEST_EMULATED").is_some() { span } else { 1.05 * wait + 0.05 };
        assert!(some > 0.0 && some <= most, "keyspace {ks}: {some} s of pressure for {wait} s of wait in {span:.1} s");
        assert_eq!(at(&later, ks), (wait, some), "keyspace {ks}: its pressure grew with no thread left");
    }
}

/// Σ run-queue wait (ns) of every thread of every process in `pids`.
fn wait_sum(pids: &std::collections::BTreeSet<u32>) -> u64 {
    pids.iter()
        .flat_map(|&p| {
            std::fs::read_dir(format!("/proc/{p}/task")).into_iter().flatten().flatten().filter_map(move |t| {
                let tid: u32 = t.file_name().to_str()?.parse().ok()?;
                schedstat_pair(p, tid).ok().map(|s| s.1)
            })
        })
        .sum()
}

#[test]
fn a_rule_matched_process_is_charged_its_run_queue_wait() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // stress-ng, unmodified: a parent and three CPU workers on two cores.
    let stress = Hog(Command::new("stress-ng")
        .args(["--cpu", "3", "--timeout", "60", "--quiet"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("stress-ng (cargo xtask setup installs it)"));
    let root = stress.0.id();
    governor_tests::eventually("stress-ng forks its three workers", || governor_tests::process_tree(root).len() >= 4);
    // With pressure counted (for registered threads: none here).
    let config =
        format!("[agent]\ncpu-pressure = true\n\n[[rules]]\nname = \"stress\"\nkeyspace = 9300\ntgid = {root}\n");
    let agent = Agent::start("ebpf", &config).expect("agent");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let snapshot = || {
        let pids = governor_tests::process_tree(root);
        governor_tests::stop(&pids).expect("stop");
        let charged =
            agent.status().unwrap().keyspaces.iter().find(|k| k.keyspace_id == 9300).map(|k| k.cpu_wait_seconds);
        let kernel = wait_sum(&pids);
        governor_tests::resume(&pids);
        (charged.expect("the rule's keyspace in status") * 1e9, kernel as f64, pids.len())
    };
    let (c0, k0, procs) = snapshot();
    std::thread::sleep(std::time::Duration::from_secs(2));
    let (c1, k1, _) = snapshot();
    let (charged, kernel) = (c1 - c0, k1 - k0);
    eprintln!("stress-ng ({procs} processes): charged {charged:.0} ns of run-queue wait, schedstat {kernel:.0} ns");
    assert!(procs >= 4, "stress-ng --cpu 3 is a parent and three workers: {procs}");
    assert!(kernel >= 200_000_000.0, "stress-ng waited only {kernel} ns: no contention");
    let error = (charged - kernel).abs() / kernel;
    assert!(error <= 0.01, "charged {charged} ns, schedstat {kernel} ns ({:.2} % off)", error * 100.0);
    // Three workers on two cores wait behind one another: the rule's
    // keyspace waits behind itself (90 % here; the rest is other tasks;
    // 51 % with a core kept busy by a stress-ng outside any rule, which
    // then takes most of the rest).
    let s = agent.status().unwrap();
    let k = s.keyspaces.iter().find(|k| k.keyspace_id == 9300).unwrap();
    let total: f64 = k.cpu_wait_behind.iter().map(|b| b.seconds).sum();
    let own: f64 = k.cpu_wait_behind.iter().filter(|b| b.keyspace_id == Some(9300)).map(|b| b.seconds).sum();
    eprintln!("stress-ng waited behind {:?}", k.cpu_wait_behind);
    assert!(total > 0.2 && (0.4..=1.0).contains(&(own / total)), "{own} of {total} s behind its own keyspace");
    // Pressure counts registered threads: a keyspace measured by rule
    // alone shows none, in status and on /metrics, rather than a zero.
    assert!(s.cpu_pressure, "pressure counted when asked");
    assert_eq!(k.cpu_pressure_some, None, "a rule's keyspace has no pressure figure");
    let text = governor_tests::scrape_metrics(s.metrics_addr.as_deref().expect("metrics address"));
    assert!(
        !text.lines().any(|l| l.starts_with("governor_keyspace_cpu_pressure_some_seconds_total{keyspace_id=\"9300\"}")),
        "a pressure series for the rule's keyspace"
    );
    // The rule removed, its keyspace stays until it idles out: still no
    // pressure figure and no series, rather than a zero.
    let removed = Command::new(governor_tests::governor_bin())
        .args(["rules", "remove", "stress", "--socket"])
        .arg(&agent.socket)
        .output()
        .unwrap();
    assert!(removed.status.success(), "{}", governor_tests::output_text(&removed));
    let s = agent.status().unwrap();
    let k = s.keyspaces.iter().find(|k| k.keyspace_id == 9300).expect("the keyspace stays");
    assert_eq!((&k.rule, k.cpu_pressure_some), (&None, None), "a former rule's keyspace has no pressure figure");
    let text = governor_tests::scrape_metrics(s.metrics_addr.as_deref().expect("metrics address"));
    assert!(
        !text.lines().any(|l| l.starts_with("governor_keyspace_cpu_pressure_some_seconds_total{keyspace_id=\"9300\"}")),
        "a pressure series for the former rule's keyspace"
    );
    drop(stress);
}

/// Whom a keyspace's waits were behind: two CPU-bound threads of two
/// keyspaces share CPU 0, so each waits behind the other's work. What
/// status shows adds up to the keyspace's whole wait (nothing is lost or
/// counted twice), and `governor keyspace ID` names the other.
#[test]
fn a_keyspaces_waits_name_whom_they_were_behind() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    const SPIN: u32 = 9400;
    const OTHER: u32 = 9401;
    let agent = Agent::start_default("ebpf").expect("agent");
    // In the emulated guests, tasks governor does not measure can take most
    // of CPU 0 (87 % in one CI run of the aarch64 guest, leaving 0.069 s
    // behind the other keyspace in 1 s): the spinners run three times as
    // long there, so the other keyspace still holds 0.1 s of their waits.
    let emulated = std::env::var_os("GOVERNOR_TEST_EMULATED").is_some();
    let seconds = if emulated { "3" } else { "1" };
    let run = run_threads_measured(
        &agent,
        &[&[
            "--kinds",
            "spinner,spinner",
            "--keyspace-base",
            &SPIN.to_string(),
            "--keyspaces",
            "2",
            "--seconds",
            seconds,
        ]],
    )
    .expect("workload");
    // The workload has exited: once the agent has read the last waits (at
    // its next stats interval), the parts add up to the totals.
    let parts = |k: &keyspace_governor::proto::KeyspaceStatus| k.cpu_wait_behind.iter().map(|b| b.seconds).sum::<f64>();
    let mut status = agent.status().unwrap();
    governor_tests::eventually("the agent reads the last waits", || {
        status = agent.status().unwrap();
        [SPIN, OTHER].iter().all(|&ks| {
            status.keyspaces.iter().find(|k| k.keyspace_id == ks).is_some_and(|k| {
                let total = k.cpu_wait_seconds;
                total > 0.0 && (parts(k) - total).abs() <= 1e-9 * total.max(1.0) + 1e-9
            })
        })
    });
    for (ks, other) in [(SPIN, OTHER), (OTHER, SPIN)] {
        let k = status.keyspaces.iter().find(|k| k.keyspace_id == ks).unwrap();
        let total = parts(k);
        let behind_other =
            k.cpu_wait_behind.iter().filter(|b| b.keyspace_id == Some(other)).map(|b| b.seconds).sum::<f64>();
        eprintln!(
            "keyspace {ks}: waited {:.4} s ({:.4} s in the measured span), behind {:?}",
            k.cpu_wait_seconds,
            run.wait_ns.get(&ks).copied().unwrap_or(0.0) / 1e9,
            k.cpu_wait_behind.iter().map(|b| (b.behind.as_str(), b.keyspace_id, b.seconds)).collect::<Vec<_>>()
        );
        assert!(total >= 0.2, "keyspace {ks} waited only {total} s: no contention");
        // Other tasks of CPU 0 (kernel threads, the agent) take a sliver
        // (0.2-7 % here and in the emulated VMs; more beside a busy core):
        // at least 60 % behind the other. In the emulated guests of `cargo
        // xtask vm-test` tasks governor does not measure took 44 % and 66 %
        // of CPU 0 in two CI runs of the aarch64 guest (something of the
        // guest's own ran there meanwhile; other runs read 1.5-6.8 %): there
        // the share is of the waits not behind those tasks (behind the
        // other keyspace, a registered thread with no tag, the idle task),
        // and the other keyspace still holds 0.1 s of it.
        let unmeasured = k.cpu_wait_behind.iter().filter(|b| b.behind == "unmeasured").map(|b| b.seconds).sum::<f64>();
        // (A sum less a part can be a rounding short of the part it holds.)
        let share = if emulated { behind_other / (total - unmeasured).max(1e-9) } else { behind_other / total };
        assert!(
            (0.6..=1.0 + 1e-9).contains(&share) && behind_other >= 0.1,
            "keyspace {ks}: {:.1} % behind keyspace {other} ({behind_other:.3} s; {unmeasured:.3} s behind unmeasured \
             tasks)",
            share * 100.0
        );
    }
    let out = std::process::Command::new(governor_tests::governor_bin())
        .args(["keyspace", &OTHER.to_string(), "--socket"])
        .arg(&agent.socket)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}");
    assert!(out.status.success(), "{text}");
    assert!(text.lines().any(|l| l.contains("waited behind") && l.contains(&format!("keyspace {SPIN} "))), "{text}");
}
