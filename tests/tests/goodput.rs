//! Admitted work finishes: a tokio server whose tenant is held at its cap
//! completes the requests it admitted (the deadline bounds the wait for
//! admission, not the work), the cap holds in every window, and the books
//! agree: the keyspace's charge and its tickets' consumed CPU against the
//! kernel's count of the worker threads.

use anyhow::{Context, Result};
use governor_tests::{Agent, essential_config, resume, schedstat_ns, stop, waiter_schedstat_of, workload_bin};
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

const KEYSPACE: u32 = 70;
const CAP_CORES: f64 = 0.5;

struct Server {
    child: Child,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
    workers: Vec<u32>,
}

impl Server {
    fn start(agent: &Agent, mode: &str, seconds: u32) -> Result<Server> {
        let mut child = Command::new(workload_bin())
            .args(["async-server", "--keyspace", &KEYSPACE.to_string(), "--tasks", "8", "--workers", "2"])
            .args([
                "--seconds",
                &seconds.to_string(),
                "--deadline-ms",
                "50",
                "--min-ms",
                "1",
                "--max-ms",
                "20",
                "--mode",
                mode,
            ])
            .arg("--socket")
            .arg(&agent.socket)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take().context("stdin")?;
        let mut out = BufReader::new(child.stdout.take().context("stdout")?);
        let started = read_json(&mut out)?;
        let workers = started["workers"]
            .as_array()
            .context("workers")?
            .iter()
            .filter_map(|t| t.as_u64())
            .map(|t| t as u32)
            .collect();
        Ok(Server { child, stdin, out, workers })
    }

    fn pids(&self) -> BTreeSet<u32> {
        BTreeSet::from([self.child.id()])
    }

    /// Σ schedstat of the threads that work for the keyspace: the runtime's
    /// workers and the client's async waiter thread (which charges itself).
    fn workers_ns(&self) -> u64 {
        let pid = self.child.id();
        let waiter = waiter_schedstat_of(&pid.to_string()).0;
        self.workers.iter().map(|&t| schedstat_ns(pid, t).unwrap_or(0)).sum::<u64>() + waiter
    }

    fn line(&mut self) -> Result<()> {
        writeln!(self.stdin)?;
        self.stdin.flush()?;
        Ok(())
    }
}

fn read_json(out: &mut BufReader<ChildStdout>) -> Result<serde_json::Value> {
    let mut line = String::new();
    out.read_line(&mut line)?;
    serde_json::from_str(&line).with_context(|| format!("workload said {line:?}"))
}

/// Both books at a stopped point: the keyspace's charge (s) and the
/// workers' schedstat (ns).
fn books(agent: &Agent, s: &Server) -> Result<(f64, u64)> {
    stop(&s.pids())?;
    let charged = agent.keyspace_seconds(KEYSPACE)?;
    let sched = s.workers_ns();
    resume(&s.pids());
    Ok((charged, sched))
}

struct Run {
    report: serde_json::Value,
    charged_ns: f64,
    workers_ns: f64,
    windows: Vec<governor_tests::Window>,
}

fn run(mode: &str, seconds: u32) -> Result<Run> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let agent = Agent::start("ebpf", &essential_config(CAP_CORES / cores))?;
    let mut s = Server::start(&agent, mode, seconds)?;
    let (c0, w0) = books(&agent, &s)?;
    s.line()?;
    let windows = agent.sample_windows(KEYSPACE, seconds as usize - 1, Some(s.child.id()))?;
    let report = read_json(&mut s.out)?;
    let (c1, w1) = books(&agent, &s)?;
    s.line()?;
    let _ = read_json(&mut s.out)?;
    s.child.wait()?;
    Ok(Run { report, charged_ns: (c1 - c0) * 1e9, workers_ns: (w1 - w0) as f64, windows })
}

#[test]
fn admitted_work_finishes_under_the_cap() {
    let r = run("run", 9).unwrap();
    let rep = &r.report;
    eprintln!("report {rep}\ncharged {:.3} s, workers {:.3} s", r.charged_ns / 1e9, r.workers_ns / 1e9);
    for (i, w) in r.windows.iter().enumerate() {
        eprintln!(
            "window {i}: {:.3} cores (process {:.3}), granted {} waited {}, steal {:.1} %",
            w.cores, w.process_cores, w.granted, w.waited, w.steal_pct
        );
    }
    let n = |k: &str| rep[k].as_u64().unwrap_or_else(|| panic!("{k} in {rep}"));
    assert_eq!(n("admitted"), n("completed"), "every admitted request completed");
    assert_eq!(n("fail_open"), 0, "the agent answered throughout");
    assert!(n("completed") >= 100, "a tenant held at 0.5 core still completes requests: {}", n("completed"));
    assert!(n("waited") > 0, "requests waited in line: the cap held them");
    let goodput = n("completed_cpu_ns") as f64 / r.charged_ns;
    eprintln!("goodput {:.1} %", goodput * 100.0);
    assert!((0.90..=1.01).contains(&goodput), "CPU of completed requests / charged: {:.1} %", goodput * 100.0);
    // The cap over the run within 3 %; in every window after the first
    // within 7 % (less what the host stole, from below, and only where most
    // admissions waited: the cap, not the machine, held it back). A window
    // would move by the tokens its in-flight tickets hold ahead of their
    // CPU (up to 8 tickets × (estimate + a top-up), 6–8 % of a window
    // here); the refill follows the kernel's charge and cancels that, all
    // but what the inventory moved in the last few refill intervals
    // (docs/design.md, "Admitted work finishes"): within 3 % as a rule,
    // 4.8 % at worst in 48 windows here.
    let later = &r.windows[1..];
    let mean = later.iter().map(|w| w.cores).sum::<f64>() / later.len() as f64;
    // Tickets pay by the thread clock, which counts what the host stole
    // within a slice; the kernel's charge does not: from below, less the
    // run's steal.
    let steal = later.iter().map(|w| w.steal_pct).sum::<f64>() / later.len() as f64 / 100.0;
    let low = CAP_CORES * (0.97 - steal);
    assert!(
        (low..=CAP_CORES * 1.03).contains(&mean),
        "mean of the windows: {mean:.3} cores (floor {low:.3}, steal {steal:.3})"
    );
    for (i, w) in later.iter().enumerate() {
        assert!(w.cores <= CAP_CORES * 1.07, "window {}: charged {:.3} cores over the cap", i + 1, w.cores);
        // The process's schedstat adds the runtime's own CPU between polls
        // (below, the books) and its helper threads'.
        assert!(
            w.process_cores <= CAP_CORES * 1.15,
            "window {}: the process ran {:.3} cores by schedstat",
            i + 1,
            w.process_cores
        );
        if w.waited * 2 >= w.granted && w.granted > 0 {
            let floor = CAP_CORES * (0.93 - w.steal_pct / 100.0);
            assert!(w.cores >= floor, "window {}: {:.3} cores, held below the cap ({floor:.3})", i + 1, w.cores);
        }
    }
}

#[test]
fn the_books_agree_with_the_kernel() {
    let r = run("enter", 6).unwrap();
    let rep = &r.report;
    let consumed = rep["ticket_consumed_ns"].as_u64().unwrap() as f64;
    let err = |x: f64| (x - r.workers_ns) / r.workers_ns * 100.0;
    eprintln!(
        "report {rep}\nworkers {:.4} s: charged {:+.3} %, tickets consumed {:+.3} %",
        r.workers_ns / 1e9,
        err(r.charged_ns),
        err(consumed)
    );
    assert!(r.workers_ns > 1e9, "the workers ran: {} ns", r.workers_ns);
    // The keyspace's charge and its tickets' consumed CPU agree with each
    // other exactly (the same thread clock, over the same stretches,
    // admission included)...
    // The tickets' thread clock counts what the host stole within a slice,
    // the kernel's charge does not: apart by up to the run's steal.
    let steal_pct = r.windows.iter().map(|w| w.steal_pct).sum::<f64>() / r.windows.len() as f64;
    let apart = (r.charged_ns - consumed).abs() / consumed * 100.0;
    assert!(apart <= 0.5 + steal_pct, "charge and tickets' consumed {apart:.3} % apart (steal {steal_pct:.1} %)");
    // ...and fall short of the workers' and the waiter thread's schedstat
    // by the runtime's own CPU between polls (scheduling, parking, waking:
    // untagged), 1.5-1.8 % in this workload of 1 ms stretches: not yet
    // within 1 %.
    for (what, e) in [("charge", err(r.charged_ns)), ("tickets' consumed", err(consumed))] {
        assert!(
            (-4.0 - steal_pct..=0.5).contains(&e),
            "{what} vs the workers' schedstat: {e:+.3} % (steal {steal_pct:.1} %)"
        );
    }
}

/// Aborting stays the server's explicit choice: with `run_until_deadline`
/// the work of a request whose top-up is still refused at its deadline is
/// dropped; status counts those refused top-ups apart from the admissions
/// the server saw refused, and every admitted request either completed or
/// was dropped.
#[test]
fn aborting_at_the_deadline_is_an_explicit_choice_counted_apart() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let agent = Agent::start("ebpf", &essential_config(CAP_CORES / cores)).unwrap();
    let mut s = Server::start(&agent, "until-deadline", 5).unwrap();
    let before = agent.status().unwrap();
    let at = |st: &keyspace_governor::proto::StatusReport| {
        st.keyspaces.iter().find(|k| k.keyspace_id == KEYSPACE).map_or((0, 0), |k| (k.refused, k.topups_refused))
    };
    s.line().unwrap();
    let rep = read_json(&mut s.out).unwrap();
    let (refused, topups_refused) = {
        let (r0, t0) = at(&before);
        let (r1, t1) = at(&agent.status().unwrap());
        (r1 - r0, t1 - t0)
    };
    s.line().unwrap();
    let _ = read_json(&mut s.out);
    s.child.wait().unwrap();
    eprintln!("report {rep}\nstatus: refused {refused}, top-ups refused {topups_refused}");
    let n = |k: &str| rep[k].as_u64().unwrap_or_else(|| panic!("{k} in {rep}"));
    assert_eq!(n("fail_open"), 0, "the agent answered throughout");
    assert_eq!(n("admitted"), n("completed") + n("dropped"), "every admitted request completed or was dropped");
    // A 50 ms deadline at a 0.5-core cap drops work (the default paces it:
    // `admitted_work_finishes_under_the_cap`), each at a top-up refused at
    // its deadline; a top-up refused at once and then waited for in line
    // counts too.
    assert!(n("dropped") >= 10, "work dropped at refused top-ups: {}", n("dropped"));
    assert!(
        (n("dropped")..=n("dropped") * 3).contains(&topups_refused),
        "refused top-ups {topups_refused} for {} dropped requests",
        n("dropped")
    );
    // Admissions the server saw refused, and only those.
    assert_eq!(refused, n("refused"), "status counts the refusals the server saw");
}
