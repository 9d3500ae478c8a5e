//! Charges match the kernel's own accounting: threads that sleep, block in
//! syscalls, get preempted by wakeups and spin are charged what the kernel
//! added to their `sum_exec_runtime` (read from outside, through schedstat,
//! with the processes stopped at both ends of the tagged span, and inside,
//! through `CLOCK_THREAD_CPUTIME_ID`), in one process and across several.

use governor_tests::{Agent, ThreadReport, run_threads_measured, steal_tick_ns};
use std::collections::BTreeMap;
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const CONFIG: &str = "[agent]\nmax-threads = 256\n";

fn rel_pct(a: f64, truth: f64) -> f64 {
    (a - truth) / truth * 100.0
}

/// Runs the workloads (one process each) side by side; returns every
/// thread's report and each keyspace's charge over the same span as the
/// reports' schedstat (both read while the processes are stopped).
///
/// Each thread took its tag before the span, charging its time so far by
/// its thread clock: where the hypervisor stole from its CPU inside that
/// slice, the charge ran ahead of the kernel's count, and the span's count
/// pays it back ([`ThreadReport::kernel_charge_ns`]). What ran ahead is
/// at most what the machine's steal counter moved by over the run (plus
/// the counter's resolution): more would be charges from nowhere.
fn run(agent: &Agent, workloads: &[&[&str]]) -> (Vec<ThreadReport>, BTreeMap<u32, f64>) {
    let run = run_threads_measured(agent, workloads).expect("the workloads ran");
    let allowed = run.steal_ns + 2 * steal_tick_ns();
    for r in &run.reports {
        assert!(
            r.charged_ahead_before_ns + r.charged_ahead_after_ns <= allowed,
            "{} (tid {}): charged {} ns ahead of the kernel's count before the span and {} ns after, with {} ns \
             of steal on the machine",
            r.kind,
            r.tid,
            r.charged_ahead_before_ns,
            r.charged_ahead_after_ns,
            run.steal_ns
        );
        if r.charged_ahead_before_ns + r.charged_ahead_after_ns > 0 {
            eprintln!(
                "{:>9}: charged ahead of the kernel's count by {} ns before the span, {} ns after (steal {} ns)",
                r.kind, r.charged_ahead_before_ns, r.charged_ahead_after_ns, run.steal_ns
            );
        }
    }
    (run.reports, run.cpu_ns)
}

#[test]
fn each_kind_of_thread_is_charged_what_the_kernel_counted() {
    let _s = serial();
    let agent = Agent::start("ebpf", CONFIG).unwrap();
    let (reports, charged) =
        run(&agent, &[&["--kinds", "sleepy,blocking,spinner,waker", "--keyspace-base", "100", "--seconds", "1.5"]]);
    let mut failures = Vec::new();
    for r in &reports {
        let c = charged.get(&r.keyspace).copied().unwrap_or(0.0);
        // The work's own clock counts inside the span; what was charged
        // for the span's work ahead of it belongs beside the span's charge.
        let for_work = c + r.charged_ahead_before_ns as f64 - r.charged_ahead_after_ns as f64;
        let vs_clock = rel_pct(for_work, r.thread_cpu_ns as f64);
        let vs_sched = rel_pct(c, r.kernel_charge_ns());
        let own_clock = rel_pct(r.thread_clock_ns as f64, r.thread_cpu_ns as f64);
        eprintln!(
            "{:>9}: charged {:.4} s, CLOCK_THREAD_CPUTIME_ID {:.4} s ({vs_clock:+.3} %), schedstat {:.4} s \
             ({vs_sched:+.3} %), thread clock {own_clock:+.3} %",
            r.kind,
            c / 1e9,
            r.thread_cpu_ns as f64 / 1e9,
            r.schedstat_ns as f64 / 1e9
        );
        // Every kind did real work (a sleepy thread ~40 % of 1.5 s).
        if r.thread_cpu_ns < 50_000_000 {
            failures.push(format!("{}: only {} ns of work", r.kind, r.thread_cpu_ns));
        }
        // The charge is the kernel's count of the tagged span; the thread's
        // own clocks, read around its work inside that span, agree with
        // each other and show no more than it.
        for (what, pct) in [("schedstat", vs_sched), ("own thread clock", own_clock)] {
            if pct.abs() > 0.3 {
                failures.push(format!("{}: {what} off by {pct:+.3} %", r.kind));
            }
        }
        if vs_clock < -0.3 || c > r.kernel_charge_ns() * 1.003 {
            failures.push(format!("{}: charged {vs_clock:+.3} % of the work's CLOCK_THREAD_CPUTIME_ID", r.kind));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn several_processes_each_keyspace_matches_its_threads_schedstat() {
    let _s = serial();
    let agent = Agent::start("ebpf", CONFIG).unwrap();
    let (reports, charged) = run(
        &agent,
        &[
            &[
                "--kinds",
                "sleepy,blocking,spinner,sleepy",
                "--keyspace-base",
                "200",
                "--keyspaces",
                "2",
                "--seconds",
                "1.5",
            ],
            &["--kinds", "blocking,sleepy,waker", "--keyspace-base", "300", "--keyspaces", "2", "--seconds", "1.5"],
            &["--kinds", "spinner,blocking", "--keyspace-base", "400", "--keyspaces", "1", "--seconds", "1.5"],
        ],
    );
    let mut truth: BTreeMap<u32, f64> = BTreeMap::new();
    for r in &reports {
        *truth.entry(r.keyspace).or_default() += r.kernel_charge_ns();
    }
    assert_eq!(truth.len(), 5, "{truth:?}");
    let mut failures = Vec::new();
    for (ks, t) in &truth {
        let c = charged.get(ks).copied().unwrap_or(0.0);
        let pct = rel_pct(c, *t);
        eprintln!("keyspace {ks}: charged {:.4} s, schedstat sum {:.4} s ({pct:+.3} %)", c / 1e9, t / 1e9);
        if pct.abs() > 0.5 {
            failures.push(format!("keyspace {ks}: {pct:+.3} %"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn both_backends_agree_on_the_same_workload() {
    let _s = serial();
    let args: &[&str] = &["--kinds", "sleepy,blocking,spinner", "--keyspace-base", "500", "--seconds", "1"];
    let mut ratios = Vec::new();
    for measure in ["ebpf", "thread-clock"] {
        let agent = Agent::start(measure, CONFIG).unwrap();
        let (reports, charged) = run(&agent, &[args]);
        let truth: f64 = reports.iter().map(ThreadReport::kernel_charge_ns).sum();
        let total: f64 = reports.iter().map(|r| charged.get(&r.keyspace).copied().unwrap_or(0.0)).sum();
        eprintln!("{measure}: charged {:.4} s for schedstat {:.4} s", total / 1e9, truth / 1e9);
        for r in &reports {
            eprintln!(
                "  {measure} {}: charged {:.4} s, schedstat {:.4} s, thread clock {:.4} s, CLOCK_THREAD_CPUTIME_ID {:.4} s",
                r.kind,
                charged.get(&r.keyspace).copied().unwrap_or(0.0) / 1e9,
                r.schedstat_ns as f64 / 1e9,
                r.thread_clock_ns as f64 / 1e9,
                r.thread_cpu_ns as f64 / 1e9
            );
        }
        ratios.push(total / truth);
    }
    let diff = (ratios[0] - ratios[1]).abs() * 100.0;
    assert!(diff <= 0.5, "backends differ by {diff:.3} % (ratios {ratios:?})");
    for r in &ratios {
        assert!((r - 1.0).abs() <= 0.005, "a backend is off the kernel's count: ratios {ratios:?}");
    }
}
