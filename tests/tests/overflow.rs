//! No request escapes the limits when the keyspace table is full: keyspaces
//! without a cell share the overflow bucket, held to the tenant cap, the
//! write-byte limits and the concurrency limit together, and the global cap
//! holds over everything. Real agent, real eBPF, client processes, and the
//! kernel's schedstat as the measure of CPU.

use governor_tests::{Agent, Holder, Steal, process_schedstat_ns};
use std::io::BufRead;
use std::sync::Mutex;
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn cores() -> f64 {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as f64
}

/// The smallest table the agent takes.
const CELLS: u32 = 16;

#[test]
fn a_full_table_holds_every_keyspace_to_the_caps() {
    let _s = serial();
    // Node budget 0.6 of the cores, tenant cap 0.1 of them (1.2 and 0.2 cores
    // here), a table of 16 cells, 48 keyspaces hammering it.
    let (global_ratio, tenant_ratio) = (0.6, 0.1);
    let config = format!(
        "[resource-control]\nmax-read-cpu-ratio = {global_ratio}\n[resource-control.cpu-throttle]\n\
         profile = \"essential\"\ntenant-max-cpu-ratio = {tenant_ratio}\n[agent]\nmax-threads = 256\n\
         max-keyspaces = {CELLS}\n"
    );
    let agent = Agent::start("ebpf", &config).unwrap();
    // One server process serves keyspaces 1..=16 (they take every cell), a
    // second one keyspaces 17..=48 (none left for them); 4 threads each.
    let load = |first: &str, n: &str| governor_tests::spawn_keyspaces_load(&agent.socket, first, n, "10").unwrap();
    let (mut with_cells, mut with_cells_out) = load("1", "16");
    governor_tests::eventually("16 cells in use", || agent.status().unwrap().admission.cells_in_use == CELLS);
    let (mut without, mut without_out) = load("17", "32");
    let pids = [with_cells.id(), without.id()];
    let cpu = || pids.iter().map(|&p| process_schedstat_ns(p)).sum::<u64>();
    // Past the first second (estimates, the buckets' first fill), 6 s measured.
    std::thread::sleep(Duration::from_millis(1500));
    let cpu0 = cpu();
    let s0 = agent.status().unwrap();
    let steal = Steal::start();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(6));
    let cpu1 = cpu();
    let span = t0.elapsed().as_secs_f64();
    let s1 = agent.status().unwrap();
    let steal = steal.share();
    let mut report = Vec::new();
    for (child, out) in [(&mut with_cells, &mut with_cells_out), (&mut without, &mut without_out)] {
        let mut last = String::new();
        out.read_line(&mut last).unwrap();
        assert!(child.wait().unwrap().success());
        report.push(serde_json::from_str::<serde_json::Value>(&last).unwrap());
    }
    let report = serde_json::Value::Array(report);

    let (global_cap, tenant_cap) = (global_ratio * cores(), tenant_ratio * cores());
    let total = (cpu1 - cpu0) as f64 / 1e9 / span;
    let o = (&s0.admission.overflow, &s1.admission.overflow);
    let overflow = (o.1.cpu_seconds - o.0.cpu_seconds) / span;
    eprintln!(
        "workload {total:.3} cores by schedstat (global cap {global_cap:.2}); overflow bucket {overflow:.3} cores \
         (tenant cap {tenant_cap:.2}), {} keyspaces in it, {} cell requests refused; steal {:.1} %; {report}",
        o.1.keyspaces.len(),
        o.1.cells_refused,
        steal * 100.0
    );
    // The overflow is visible: 48 keyspaces, 16 cells.
    assert_eq!(s1.admission.cells_in_use, CELLS, "{:?}", s1.admission);
    assert_eq!(o.1.keyspaces, (17..=48).collect::<Vec<u32>>());
    assert_eq!(o.1.bucket.as_ref().map(|b| b.source.as_str()), Some("tenant_cap"), "{:?}", o.1);
    assert!(o.1.granted > 1000, "the overflow keyspaces were served: {:?}", o.1);
    // Everything together within the node's budget: before the overflow
    // bucket, the 32 keyspaces without a cell skipped every check and took
    // both cores.
    assert!(
        total <= global_cap * 1.05 && total >= global_cap * (0.90 - steal),
        "the workload ran {total:.3} cores against a global cap of {global_cap:.2}"
    );
    // The keyspaces without a cell, together, within one tenant's cap.
    assert!(
        overflow <= tenant_cap * 1.05 && overflow >= tenant_cap * (0.85 - steal),
        "the overflow bucket's tickets ran {overflow:.3} cores against a tenant cap of {tenant_cap:.2}"
    );
    // And every keyspace with a cell within its own cap (the kernel's charge).
    for k in &s1.keyspaces {
        let before = s0.keyspaces.iter().find(|x| x.keyspace_id == k.keyspace_id).map_or(0.0, |x| x.cpu_seconds);
        let rate = (k.cpu_seconds - before) / span;
        assert!(
            rate <= tenant_cap * 1.05,
            "keyspace {} ran {rate:.3} cores against its cap {tenant_cap:.2}",
            k.keyspace_id
        );
    }
    // Warned once per keyspace, not per request.
    let log = agent.log_text();
    let warnings = log.lines().filter(|l| l.contains("held by the overflow bucket")).count();
    assert!((1..=48).contains(&warnings), "{warnings} overflow warnings in the agent's log");
}

#[test]
fn keyspaces_without_a_cell_share_the_write_and_concurrency_limits() {
    let _s = serial();
    // 1 MiB globally, 30 % (314 572 bytes) per keyspace; 3 requests in flight
    // per tenant.
    let config = format!(
        "[write-quota]\npending-write-threshold = \"1MiB\"\n[admission-control]\nmode = \"enforced\"\n\
         max-concurrent-per-tenant = 3\n[agent]\nmax-keyspaces = {CELLS}\n"
    );
    let agent = Agent::start("ebpf", &config).unwrap();
    let mut a = Holder::start(&agent.socket);
    let mut b = Holder::start(&agent.socket);
    // Every cell taken, one ticket each.
    for ks in 1..=CELLS {
        assert_eq!(a.acquire(ks, 0), Ok(()), "keyspace {ks}");
    }
    assert_eq!(agent.status().unwrap().admission.cells_in_use, CELLS);
    // Keyspaces 100.. have no cell: their writes count together…
    assert_eq!(a.acquire(100, 300_000), Ok(()));
    assert_eq!(b.acquire(101, 20_000), Ok(()), "below the keyspace threshold before it");
    assert_eq!(b.acquire(102, 1), Err("write_keyspace_limit".into()), "shared write bytes over 30 %");
    // …and so do their requests in flight: two held, a third admitted, the
    // fourth refused whichever keyspace and process asks.
    assert_eq!(b.acquire(103, 0), Ok(()));
    assert_eq!(a.acquire(104, 0), Err("tenant_admission_control".into()));
    assert_eq!(b.acquire(105, 0), Err("tenant_admission_control".into()));
    // A keyspace with a cell is not affected.
    assert_eq!(b.acquire(1, 0), Ok(()));
    let s = agent.status().unwrap();
    let o = &s.admission.overflow;
    assert_eq!(o.inflight_requests, 3, "{o:?}");
    assert_eq!(o.pending_write_bytes, 320_000, "{o:?}");
    assert_eq!(o.refused, 3, "{o:?}");
    assert_eq!(o.keyspaces, vec![100, 101, 102, 103, 104, 105], "{o:?}");
    assert!(o.bucket.is_none(), "no CPU bucket without a cap or quotas: {o:?}");
    // A process refused a cell does not ask again for every request (a
    // round trip each): 20 more of keyspace 100 (each refused by the
    // concurrency limit, after the cell's look-up) ask the agent once at most.
    for _ in 0..20 {
        assert_eq!(a.acquire(100, 0), Err("tenant_admission_control".into()));
    }
    let asked = agent.status().unwrap().admission.overflow.cells_refused - o.cells_refused;
    assert!(asked <= 1, "{asked} cell requests for 20 admissions of a keyspace refused a cell");
    // Released, they leave nothing behind.
    assert_eq!(b.say("release")["released"], 3);
    let o = agent.status().unwrap().admission.overflow;
    assert_eq!((o.inflight_requests, o.pending_write_bytes), (1, 300_000), "{o:?}");
    // Shown where operators look.
    let text = governor_tests::scrape_metrics(s.metrics_addr.as_deref().expect("metrics address"));
    for name in ["governor_keyspace_overflow_keyspaces 6", "governor_keyspace_cells_refused_total"] {
        assert!(text.lines().any(|l| l.starts_with(name)), "no {name} in the scrape");
    }
    let doctor = std::process::Command::new(governor_tests::governor_bin())
        .args(["doctor", "--json", "--socket"])
        .arg(&agent.socket)
        .output()
        .unwrap();
    let d: serde_json::Value = serde_json::from_slice(&doctor.stdout).unwrap();
    let table = d["checks"].as_array().unwrap().iter().find(|c| c["check"] == "keyspace-table").cloned();
    assert_eq!(table.as_ref().map(|c| c["status"].as_str()), Some(Some("warn")), "{d}");
    // `governor keyspace` of one of them says where it is held, not that it is unknown.
    let k = std::process::Command::new(governor_tests::governor_bin())
        .args(["keyspace", "100", "--socket"])
        .arg(&agent.socket)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&k.stderr);
    assert!(said.contains("keyspace 100 has no cell of its own") && said.contains("overflow bucket"), "{said}");
    assert!(!said.contains("  "), "a run of spaces in the message: {said}");
}
