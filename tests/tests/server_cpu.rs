//! The caps are fractions of the CPU the server may use: a server process
//! in a cgroup limited to 1 core, under a tenant cap of 0.4, is held to
//! 0.40 core (not 0.4 of the node's cores); its cgroup resized online
//! moves the cap with it; an explicit `server-cpu-cores` wins; several
//! servers with distinct limits add up; status, doctor and /metrics say
//! which number is used and where it came from. Real agent, real eBPF,
//! real cgroups (whichever version offers the cpu controller here).

use governor_tests::{Agent, CpuCgroup, Window, essential_config, eventually, governor_bin, scrape_metrics};
use std::io::BufRead;
use std::process::Command;
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn node_cores() -> f64 {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as f64
}

/// Every window within 5 % of `cap`: never over it, and not under it in a
/// window where requests waited in line (less the hypervisor's steal).
fn held_to(cap: f64, windows: &[Window], what: &str) {
    let rates: Vec<f64> = windows.iter().map(|w| w.cores).collect();
    eprintln!("{what}: cap {cap:.3} cores, per-second CPU {rates:.3?}");
    for w in windows {
        let err = (w.cores - cap) / cap * 100.0;
        assert!(
            err <= 5.0 && (w.waited == 0 || err >= -5.0 - w.steal_pct),
            "{what}: a 1 s window off the {cap:.3}-core cap by {err:+.2} %: {windows:.3?}"
        );
    }
    assert!(windows.iter().any(|w| w.waited > 0), "{what}: nothing waited, the cap never held: {windows:?}");
}

fn server_cpu(agent: &Agent) -> (f64, String, String) {
    let c = agent.status().unwrap().server_cpu;
    (c.cores, c.source, c.detail)
}

fn doctor_check(agent: &Agent, name: &str) -> serde_json::Value {
    let out = Command::new(governor_bin()).args(["doctor", "--json", "--socket"]).arg(&agent.socket).output().unwrap();
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("doctor --json");
    r["checks"].as_array().unwrap().iter().find(|c| c["check"] == name).cloned().unwrap_or_else(|| panic!("{r:#}"))
}

#[test]
fn a_tenant_cap_is_a_fraction_of_the_servers_cgroup_limit() {
    let _s = serial();
    let group = CpuCgroup::new("server-cpu", 1.0);
    let agent = Agent::start("ebpf", &essential_config(0.4)).unwrap();
    // No server yet: the node.
    let (cores, source, _) = server_cpu(&agent);
    assert_eq!((cores, source.as_str()), (node_cores(), "node"));
    let (mut child, mut out) = group
        .spawn_workload(
            &agent.socket,
            &["tickets", "--keyspace", "1", "--threads", "8", "--seconds", "26", "--work-us", "1000"],
        )
        .unwrap();
    eventually("the server's cgroup read", || server_cpu(&agent).1 == "cpu-quota");
    let (cores, _, detail) = server_cpu(&agent);
    assert!((cores - 1.0).abs() < 1e-9, "{cores} {detail}");
    assert!(detail.contains(&group.dir.display().to_string()), "{detail}");
    let status = Command::new(governor_bin()).args(["status", "--socket"]).arg(&agent.socket).output().unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(text.contains("caps are fractions of 1.00 (cpu-quota:"), "{text}");
    let metrics = scrape_metrics(&agent.status().unwrap().metrics_addr.unwrap());
    assert!(metrics.contains("governor_server_cpu_cores{source=\"cpu-quota\"} 1\n"), "{metrics}");
    let check = doctor_check(&agent, "server-cpu");
    assert_eq!(check["status"], "ok", "{check}");

    // 0.4 of the server's one core, where the node would say 0.4 × 2.
    let mut windows = agent.sample_windows(1, 7, Some(child.id())).unwrap();
    windows.remove(0);
    held_to(0.4, &windows, "1-core cgroup");
    // The kernel's books agree: the server process's own CPU by schedstat
    // (the tickets' work and the client's admission around it).
    let n = windows.len() as f64;
    let by_kernel = windows.iter().map(|w| w.process_cores).sum::<f64>() / n;
    let steal = windows.iter().map(|w| w.steal_pct).sum::<f64>() / n / 100.0;
    eprintln!("schedstat of the server: {by_kernel:.4} cores; steal {:.2} %", steal * 100.0);
    assert!((0.38..=0.42 * (1.0 + steal)).contains(&by_kernel), "schedstat {by_kernel:.4} cores for a 0.4-core cap");
    let status = agent.status().unwrap();
    let k = status.keyspaces.iter().find(|k| k.keyspace_id == 1).unwrap();
    assert_eq!(k.bucket.as_ref().unwrap().refill_us, 4000, "0.4 core × 10 ms: {k:?}");
    assert_eq!(status.admission.global.refill_us, 6000, "max-read-cpu-ratio 0.6 × 1 core × 10 ms");

    // The operator halves the cgroup: the cap follows within the second.
    group.limit(0.5);
    eventually("the halved cgroup read", || (server_cpu(&agent).0 - 0.5).abs() < 1e-9);
    let mut windows = agent.sample_windows(1, 6, None).unwrap();
    windows.remove(0);
    held_to(0.2, &windows, "0.5-core cgroup");

    // An explicit number wins, and doctor says it is more than the cgroup allows.
    let set = |v: &str| {
        let out = Command::new(governor_bin())
            .args(["config", "set", &format!("resource-control.server-cpu-cores={v}"), "--socket"])
            .arg(&agent.socket)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    set("0.75");
    let (cores, source, _) = server_cpu(&agent);
    assert_eq!((cores, source.as_str()), (0.75, "config"));
    let k = agent.status().unwrap().keyspaces.into_iter().find(|k| k.keyspace_id == 1).unwrap();
    assert_eq!(k.bucket.unwrap().refill_us, 3000, "0.4 × 0.75 core × 10 ms");
    let check = doctor_check(&agent, "server-cpu");
    assert_eq!(check["status"], "warn", "{check}");
    assert!(check["detail"].as_str().unwrap().contains("more than the 0.50 cores"), "{check}");
    set("0");
    assert_eq!(server_cpu(&agent).1, "cpu-quota");
    let refused = Command::new(governor_bin())
        .args(["config", "set", "resource-control.server-cpu-cores=-1", "--socket"])
        .arg(&agent.socket)
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(64), "{}", String::from_utf8_lossy(&refused.stderr));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("resource-control.server-cpu-cores"));

    // The server gone: the node again.
    let mut last = String::new();
    out.read_line(&mut last).unwrap();
    assert!(child.wait().unwrap().success());
    eventually("the node once the server went", || server_cpu(&agent).1 == "node");
    assert!(agent.log_text().contains("server CPU: 1.00 cores"), "the change is logged");
}

#[test]
fn servers_with_distinct_limits_add_up() {
    let _s = serial();
    let (a, b) = (CpuCgroup::new("server-cpu-a", 0.5), CpuCgroup::new("server-cpu-b", 0.25));
    let agent = Agent::start("ebpf", &essential_config(0.4)).unwrap();
    let load = |g: &CpuCgroup, ks: &str, secs: &str| {
        g.spawn_workload(
            &agent.socket,
            &["tickets", "--keyspace", ks, "--threads", "1", "--seconds", secs, "--work-us", "200"],
        )
        .unwrap()
    };
    let (mut first, _o1) = load(&a, "1", "4");
    let (mut second, _o2) = load(&a, "2", "8");
    let (mut third, _o3) = load(&b, "3", "8");
    eventually("three servers read", || {
        agent.status().unwrap().server_cpu.servers.iter().map(|l| l.pids.len()).sum::<usize>() == 3
    });
    let c = agent.status().unwrap().server_cpu;
    assert!((c.cores - 0.75).abs() < 1e-9 && c.source == "servers", "one cgroup counts once: {c:?}");
    assert_eq!(c.servers.len(), 2, "{c:?}");
    let k = agent.status().unwrap().keyspaces.into_iter().find(|k| k.keyspace_id == 3).unwrap();
    assert_eq!(k.bucket.unwrap().refill_us, 3000, "0.4 × 0.75 core × 10 ms");
    // One of a's two servers goes: a still counts; then b's goes: a alone.
    assert!(first.wait().unwrap().success());
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!((agent.status().unwrap().server_cpu.cores - 0.75).abs() < 1e-9);
    third.kill().unwrap();
    third.wait().unwrap();
    eventually("b's limit gone with its server", || agent.status().unwrap().server_cpu.source == "cpu-quota");
    assert!((agent.status().unwrap().server_cpu.cores - 0.5).abs() < 1e-9);
    second.kill().unwrap();
    second.wait().unwrap();
}

#[test]
fn a_servers_untagged_cpu_counts_in_the_global_ratio_and_lowers_the_refill() {
    let _s = serial();
    // Node budget 0.5 of the cores (1 core here), a 3 s window, the
    // throttle seed's watermarks (0.8 / 0.5) and dynamic adjustment.
    let config = "[resource-control]\nstats-interval = \"1s\"\nwindow-size = \"3s\"\nmax-read-cpu-ratio = 0.5\n\
                  [resource-control.cpu-throttle]\nenabled = true\n";
    let agent = Agent::start("ebpf", config).unwrap();
    let base = agent.status().unwrap().admission.global.refill_us;
    // One thread takes tickets for keyspace 1; two more spin untagged (one
    // registered, one never), as a server's gRPC and compaction threads.
    let (mut child, mut out) = governor_tests::spawn_workload_started(
        &agent.socket,
        &[
            "tickets",
            "--keyspace",
            "1",
            "--threads",
            "1",
            "--seconds",
            "7",
            "--work-us",
            "200",
            "--untagged-threads",
            "2",
        ],
    )
    .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(4500));
    let s = agent.status().unwrap();
    let (ratio, refill) = (s.admission.global_ratio, s.admission.global.refill_us);
    // Keyspace 1's share of the same window, in the global ratio's units
    // (cores × max-read-cpu-ratio × window-size): what the ratio read when
    // only tagged CPU counted.
    let share = s.keyspaces.iter().find(|k| k.keyspace_id == 1).map_or(0.0, |k| k.window_ratio);
    let tagged_ratio = share * s.window_seconds * s.server_cpu.cores / (s.server_cpu.cores * 0.5 * 3.0);
    eprintln!("global ratio {ratio:.3} (tagged CPU alone {tagged_ratio:.3}), global refill {refill} of {base} µs");
    assert!(ratio > 0.8 && tagged_ratio < 0.8, "global ratio {ratio:.3}, tagged alone {tagged_ratio:.3}");
    // Above the high watermark the refill is base × 0.8 / ratio.
    let expected = base as f64 * 0.8 / ratio;
    assert!((refill as f64 - expected).abs() <= expected * 0.05, "global refill {refill} µs, expected {expected:.0}");
    // The untagged count against the kernel's: stopped, so both hold still.
    let pids = governor_tests::process_tree(child.id());
    governor_tests::stop(&pids).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(2300));
    let s = agent.status().unwrap();
    let ran = governor_tests::process_schedstat_ns(child.id()) as f64 / 1e9;
    let tagged = s.keyspaces.iter().find(|k| k.keyspace_id == 1).map_or(0.0, |k| k.cpu_seconds);
    let untagged = s.server_cpu.untagged_cpu_seconds;
    governor_tests::resume(&pids);
    eprintln!("the server ran {ran:.3} s by schedstat, {tagged:.3} s tagged, {untagged:.3} s counted untagged");
    let truth = ran - tagged;
    assert!(
        (untagged - truth).abs() <= truth * 0.03 + 0.03,
        "untagged {untagged:.3} s, schedstat − tagged {truth:.3} s"
    );
    // The window's global against its tagged part, as all the server's CPU
    // against its tagged CPU by the kernel (a steady load: the same mix).
    let (seen, truth) = (ratio / tagged_ratio, ran / tagged);
    assert!((seen - truth).abs() <= truth * 0.15, "global / tagged {seen:.2} in the window, {truth:.2} by schedstat");
    let metrics = scrape_metrics(&s.metrics_addr.unwrap());
    assert!(metrics.contains("governor_server_untagged_cpu_seconds_total "), "{metrics}");
    let mut last = String::new();
    out.read_line(&mut last).unwrap();
    assert!(child.wait().unwrap().success());
}
