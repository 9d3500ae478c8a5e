//! `cargo xtask bench`: the measurement and policy benchmarks, as ratios
//! from one run on this machine. `--json` prints one JSON object.
// The one JSON object has more keys than `json!`'s default recursion allows.
#![recursion_limit = "256"]
mod adoption;
mod operator;
mod path;
mod profile;
mod rules;
mod switch;
mod tickets;
mod wake;

use anyhow::{Context, Result};
use governor_tests::{Agent, run_workload};
use keyspace_governor::client::{self, Client};
use keyspace_governor::policy::{Policy, Settings};
use keyspace_governor::sys;
use serde_json::json;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Short demos behind each demo figure (their median).
const DEMO_RUNS: usize = 5;
/// Rounds of the real server beside a rule-capped hog (their median).
const NEIGHBOUR_ROUNDS: usize = 5;
/// Rounds of the noisy tenant with and without a profile running.
const PROFILE_ROUNDS: usize = 5;

/// The waiting acquires' keys, as `--wait-cpu`, `--client` and the full
/// run print them.
fn wait_cpu_keys(o: &mut serde_json::Map<String, serde_json::Value>, w: &adoption::WaitCpu) {
    o.insert("acquire_wait_cpu_us_p50".into(), json!(round2(w.blocking_p50)));
    o.insert("acquire_wait_cpu_us_p99".into(), json!(round2(w.blocking_p99)));
    o.insert("acquire_async_wait_cpu_us_p99".into(), json!(round2(w.async_p99)));
    o.insert("async_waiter_wakes_per_wait".into(), json!(round2(w.waiter_wakes_per_wait)));
    o.insert("async_waiter_cpu_us_per_wait".into(), json!(round2(w.waiter_cpu_us_per_wait)));
    o.insert("baseline_park_cpu_us_p50".into(), json!(round2(w.park_p50)));
    o.insert("baseline_park_cpu_us_p99".into(), json!(round2(w.park_p99)));
    o.insert("baseline_park_long_cpu_us_p50".into(), json!(round2(w.park_long_p50)));
    o.insert("baseline_park_long_cpu_us_p99".into(), json!(round2(w.park_long_p99)));
    o.insert("baseline_park_long_gap_ms".into(), json!(w.park_long_gap.as_millis() as u64));
}

fn profile_keys(o: &mut serde_json::Map<String, serde_json::Value>, p: &profile::ProfileCost) {
    o.insert("profile_overhead_pct".into(), json!(round2(p.overhead_pct)));
    o.insert("profile_overhead_pct_runs".into(), json!(p.overhead_runs.iter().map(|v| round2(*v)).collect::<Vec<_>>()));
    o.insert("profile_overhead_rows_pct".into(), json!(round2(p.rows_overhead_pct)));
    o.insert(
        "profile_overhead_rows_pct_runs".into(),
        json!(p.rows_overhead_runs.iter().map(|v| round2(*v)).collect::<Vec<_>>()),
    );
    o.insert("profile_ebpf_ns_per_sample".into(), json!(round(p.ebpf_ns_per_sample)));
    o.insert("profile_samples_per_cpu_second".into(), json!(round2(p.samples_per_cpu_second)));
    o.insert("profile_render_ms".into(), json!(round(p.render_ms)));
}

/// `reader_neighbour_p99_ratio` (the median round's p99 beside the capped
/// hog over alone) and the rounds behind it.
fn neighbour_keys(o: &mut serde_json::Map<String, serde_json::Value>, n: &rules::Neighbour) {
    let r3 = |v: &[f64]| v.iter().map(|x| round3(*x)).collect::<Vec<_>>();
    let r1 = |v: &[f64]| v.iter().map(|x| round(*x)).collect::<Vec<_>>();
    o.insert("reader_neighbour_p99_ratio".into(), json!(round3(switch::median(n.ratios.clone()))));
    o.insert("reader_neighbour_p99_ratio_runs".into(), json!(r3(&n.ratios)));
    o.insert("reader_neighbour_alone_p99_us_runs".into(), json!(r1(&n.alone_p99_us)));
    o.insert("reader_neighbour_capped_p99_us_runs".into(), json!(r1(&n.capped_p99_us)));
    o.insert("reader_neighbour_hog_cores_runs".into(), json!(r3(&n.hog_cores)));
}

fn per_op(n: u64, f: impl FnMut(u64)) -> f64 {
    let mut f = f;
    let t = Instant::now();
    for i in 0..n {
        f(i);
    }
    t.elapsed().as_nanos() as f64 / n as f64
}

/// Best of `rounds` (the VM's neighbours add noise, never speed).
fn best(rounds: usize, mut f: impl FnMut() -> f64) -> f64 {
    (0..rounds).map(|_| f()).fold(f64::INFINITY, f64::min)
}

/// The exactly-once run: (Σ charges − Σ thread clocks) / Σ thread clocks,
/// signed, in %; the worst per-keyspace share difference in share points;
/// and the machine's steal time over the run as a share of the thread clocks.
fn attribution(agent: &Agent) -> Result<(f64, f64, f64)> {
    let cores = sys::logical_cores();
    let steal_before = governor_tests::steal_ns();
    let out = run_workload(
        &agent.socket,
        &["exactly-once", "--threads", &(3 * cores).to_string(), "--switches", "100000", "--base", "5000"],
    )?;
    let truth = out["thread_cpu_ns"].as_u64().context("thread_cpu_ns")? as f64;
    let own: BTreeMap<u32, f64> = out["self_measured_ns"]
        .as_object()
        .context("self_measured_ns")?
        .iter()
        .map(|(k, v)| (k.parse().unwrap_or(0), v.as_f64().unwrap_or(0.0)))
        .collect();
    let charged: BTreeMap<u32, f64> = agent
        .status()?
        .keyspaces
        .iter()
        .filter(|k| (5000..5100).contains(&k.keyspace_id))
        .map(|k| (k.keyspace_id, k.cpu_seconds * 1e9))
        .collect();
    let (own_total, charged_total): (f64, f64) = (own.values().sum(), charged.values().sum());
    let share_pp = own
        .iter()
        .map(|(k, v)| (v / own_total - charged.get(k).copied().unwrap_or(0.0) / charged_total).abs() * 100.0)
        .fold(0.0, f64::max);
    let steal = (governor_tests::steal_ns() - steal_before) as f64;
    Ok(((charged_total - truth) / truth * 100.0, share_pp, steal / truth * 100.0))
}

/// A registered thread that works 150 µs and sleeps 200 µs: its charge
/// against the kernel's count of it (schedstat, read with its process
/// stopped at both ends of its tagged span, less what its tag switch before
/// the span charged ahead of the count), signed, in %.
fn sleepy_thread_error_pct(agent: &Agent) -> Result<f64> {
    let (mut reports, charged) =
        governor_tests::run_threads(agent, &[&["--kinds", "sleepy", "--keyspace-base", "6000", "--seconds", "1.4"]])?;
    let r = reports.pop().context("one thread")?;
    let charged = charged.get(&6000).copied().unwrap_or(0.0);
    let truth = r.kernel_charge_ns();
    Ok((charged - truth) / truth * 100.0)
}

/// The worst keyspace's |charged run-queue wait − its threads' schedstat
/// run-queue time| / that time, %: four CPU-bound threads of one keyspace,
/// two tickers of another and two pooled workers of a third, on this
/// machine's cores at once (a pooled worker's wait before a slice that takes
/// no tag is no keyspace's, and counts here as error).
fn cpu_wait_error_pct(agent: &Agent) -> Result<f64> {
    let run = governor_tests::run_threads_measured(
        agent,
        &[
            &["--kinds", "busy,busy,busy,busy", "--keyspace-base", "6100", "--keyspaces", "1"],
            &["--kinds", "ticker,ticker", "--keyspace-base", "6200", "--keyspaces", "1"],
            &["--kinds", "pooled,pooled", "--keyspace-base", "6300", "--keyspaces", "1"],
        ],
    )?;
    let mut worst: f64 = 0.0;
    for ks in [6100, 6200, 6300] {
        let truth = run.reports.iter().filter(|r| r.keyspace == ks).map(|r| r.schedstat_wait_ns).sum::<u64>() as f64;
        let charged = run.wait_ns.get(&ks).copied().unwrap_or(0.0);
        worst = worst.max(if truth > 0.0 { (charged - truth).abs() / truth * 100.0 } else { 100.0 });
    }
    Ok(worst)
}

fn policy_allocate_release_ns() -> f64 {
    let s = Settings::from_toml(
        "[resource-control.cpu-throttle]\nenabled = true\nenforce-global-limit = true\ntenant-max-cpu-ratio = 0.4\n\
         enable-burst = false\nenable-fair-allocation = false\nenable-dynamic-adjustment = false\n\
         enable-runtime-token-management = false\n",
        sys::logical_cores() as f64,
    )
    .expect("valid settings");
    let p = Policy::new(s, 0).expect("valid settings");
    best(5, || {
        per_op(2_000_000, |i| {
            let g = p.allocate(1, Some(10), i).expect("tokens available");
            // A full refund keeps the bucket level without agent ticks.
            p.release(g, 0);
        })
    })
}

/// How many idle wakeups the machine's wake baseline takes, and how long
/// apart (the sleeper's CPU goes idle, and halts, meanwhile).
const IDLE_WAKES: u32 = 300;
const IDLE_WAKE_GAP: Duration = Duration::from_millis(2);

/// The machine's idle-wake keys, beside the demo's ratios: a light
/// request's threads on two CPUs take such wakeups.
fn idle_wake_keys(o: &mut serde_json::Map<String, serde_json::Value>, w: &wake::IdleWake) {
    let (p50, p99) = w.latency_us.map_or((None, None), |(a, b)| (Some(round2(a)), Some(round2(b))));
    o.insert("baseline_idle_wake_us_p50".into(), json!(p50));
    o.insert("baseline_idle_wake_us_p99".into(), json!(p99));
    o.insert("cpuidle_halt_poll_ns".into(), json!(w.halt_poll_ns));
}

/// `n` short demos without the latency guard and `n` with it, alternating:
/// each run's JSON.
fn short_demos(n: usize) -> Result<(Vec<serde_json::Value>, Vec<serde_json::Value>)> {
    let dir = governor_tests::Scratch::new("bench-demo");
    let svg = dir.0.join("demo.svg");
    let (mut plain, mut guarded) = (Vec::new(), Vec::new());
    for _ in 0..n {
        plain.push(governor_tests::run_demo(&["--short"], &svg)?);
        guarded.push(governor_tests::run_demo(&["--short", "--guard"], &svg)?);
    }
    Ok((plain, guarded))
}

fn main() -> Result<()> {
    // The child that `path::ticket_path` runs under valgrind.
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--trace-ticket") {
        let socket = args.get(i + 1).context("--trace-ticket SOCKET")?;
        return path::traced_child(std::path::Path::new(socket));
    }
    let json_out = std::env::args().any(|a| a == "--json");
    // `--tickets`: the ticket fast path and its baselines alone (a quick
    // before/after of a change on that path).
    // `--client`: the figures of the client as a server meets it alone.
    // `--demo`: the demo ratios alone (five short demos without the latency
    // guard and five with it, alternating).
    if std::env::args().any(|a| a == "--demo") {
        let (plain, guarded) = short_demos(DEMO_RUNS)?;
        let ratios = |d: &[serde_json::Value]| {
            d.iter().map(|d| d["light_p99_ratio"]["enforcing"].as_f64().map(round3)).collect::<Vec<_>>()
        };
        let sorted = |d: &[serde_json::Value]| {
            let mut r: Vec<f64> = d.iter().filter_map(|d| d["light_p99_ratio"]["enforcing"].as_f64()).collect();
            r.sort_by(f64::total_cmp);
            r.get(r.len() / 2).copied().map(round3)
        };
        let mut o = json!({
            "demo_victim_p99_ratio": sorted(&plain),
            "demo_victim_p99_ratio_runs": ratios(&plain),
            "demo_victim_p99_ratio_guarded": sorted(&guarded),
            "demo_victim_p99_ratio_guarded_runs": ratios(&guarded),
        });
        if let Some(o) = o.as_object_mut() {
            idle_wake_keys(o, &wake::idle_wake(IDLE_WAKES, IDLE_WAKE_GAP));
        }
        println!("{o}");
        return Ok(());
    }
    if std::env::args().any(|a| a == "--wake") {
        let mut o = serde_json::Map::new();
        idle_wake_keys(&mut o, &wake::idle_wake(IDLE_WAKES, IDLE_WAKE_GAP));
        println!("{}", serde_json::Value::Object(o));
        return Ok(());
    }
    if std::env::args().any(|a| a == "--cold") {
        let (cold, mutex_cold) = adoption::cold_ns()?;
        println!(
            "{}",
            json!({"ticket_acquire_cold_ns": round(cold), "baseline_mutex_bucket_cold_ns": round(mutex_cold)})
        );
        return Ok(());
    }
    if std::env::args().any(|a| a == "--wait-cpu") {
        let mut o = serde_json::Map::new();
        wait_cpu_keys(&mut o, &adoption::wait_cpu_us()?);
        println!("{}", serde_json::Value::Object(o));
        return Ok(());
    }
    if std::env::args().any(|a| a == "--client") {
        let goodput = adoption::goodput_pct()?;
        let (cold, mutex_cold) = adoption::cold_ns()?;
        let mut o = serde_json::Map::new();
        o.insert("ticket_acquire_cold_ns".into(), json!(round(cold)));
        o.insert("baseline_mutex_bucket_cold_ns".into(), json!(round(mutex_cold)));
        wait_cpu_keys(&mut o, &adoption::wait_cpu_us()?);
        o.insert("first_use_poll_max_us".into(), json!(round2(adoption::first_use_poll_max_us()?)));
        o.insert("goodput_pct".into(), json!(round2(goodput.0)));
        o.insert("goodput_window_error_pct".into(), json!(round2(goodput.1)));
        println!("{}", serde_json::Value::Object(o));
        return Ok(());
    }
    // `--caps`: the caps' error figures alone (the full table, a server's cgroup).
    if std::env::args().any(|a| a == "--caps") {
        let overflow = tickets::overflow_cap_error_pct()?;
        let (cgroup, cgroup_schedstat) = tickets::cgroup_cap_error_pct()?;
        println!(
            "{}",
            json!({
                "overflow_cap_error_pct": round2(overflow),
                "cgroup_cap_error_pct": round2(cgroup),
                "cgroup_cap_schedstat_error_pct": round2(cgroup_schedstat),
            })
        );
        return Ok(());
    }
    // `--neighbour`: a real server beside a rule-capped hog, and the rule
    // cap's worst 1 s window, alone.
    if std::env::args().any(|a| a == "--profile") {
        let p = profile::cost(PROFILE_ROUNDS)?;
        let mut o = serde_json::Map::new();
        profile_keys(&mut o, &p);
        println!("{}", serde_json::Value::Object(o));
        return Ok(());
    }
    if std::env::args().any(|a| a == "--neighbour") {
        let n = rules::reader_neighbour(NEIGHBOUR_ROUNDS)?;
        let rule_cap = rules::cap_error_pct()?;
        let mut o = serde_json::Map::new();
        neighbour_keys(&mut o, &n);
        o.insert("rule_cap_error_pct".into(), json!(round2(rule_cap)));
        println!("{}", serde_json::Value::Object(o));
        return Ok(());
    }
    // `--switch`: the tag switch and the eBPF programs' cost per switch
    // alone (the other half of a before/after on the hot paths).
    if std::env::args().any(|a| a == "--switch") {
        let agent = Agent::start_default("ebpf")?;
        let client = Client::connect(&agent.socket)?;
        client.register_current_thread()?;
        let g = client::tag(1)?;
        let tag_switch_ns = best(5, || {
            per_op(2_000_000, |i| {
                client::set_tag(1 + (i & 1) as u32).expect("tag");
            })
        });
        drop(g);
        let ebpf = switch::ebpf_cost(&agent)?;
        let e = |k: &str| ebpf.get(k).copied().unwrap_or(f64::NAN);
        client::unregister_current_thread();
        drop(client);
        drop(agent);
        let pressure = switch::pressure_cost()?;
        let p = |k: &str| pressure.get(k).copied().unwrap_or(f64::NAN);
        println!(
            "{}",
            json!({
                "tag_switch_ns": round2(tag_switch_ns),
                "ebpf_stats_floor_ns": round(e("floor")),
                "ebpf_sched_switch_net_ns": round(e("registered_net")),
                "ebpf_sched_switch_unregistered_ns": round(e("unregistered_net")),
                "ebpf_timer_ns": round(e("timer")),
                "ebpf_sched_switch_pressure_net_ns": round(p("registered_net")),
                "ebpf_sched_switch_pressure_unregistered_ns": round(p("unregistered_net")),
                "ebpf_wakeup_net_ns": round(p("wakeup_registered_net")),
                "ebpf_wakeup_unregistered_ns": round(p("wakeup_unregistered_net")),
            })
        );
        return Ok(());
    }
    if std::env::args().any(|a| a == "--tickets") {
        let f = tickets::fast_path()?;
        let (ticket, mutex) = path::ticket_path()?;
        println!(
            "{}",
            json!({
                "ticket_acquire_release_ns": round2(f.uncontended_ns),
                "ticket_acquire_release_deadline_ns": round2(f.deadline_ns),
                "ticket_acquire_release_alternating_ns": round2(f.alternating_ns),
                "ticket_acquire_release_contended_ns": round2(f.contended_ns),
                "baseline_mutex_bucket_ns": round2(f.mutex_ns),
                "baseline_mutex_bucket_contended_ns": round2(f.mutex_contended_ns),
                "ticket_vs_mutex": round3(f.uncontended_ns / f.mutex_ns),
                "ticket_path_instructions": ticket.instructions,
                "ticket_path_code_lines": ticket.code_lines,
                "ticket_path_code_pages": ticket.code_pages,
                "ticket_path_data_lines": ticket.data_lines,
                "baseline_mutex_bucket_instructions": mutex.instructions,
                "baseline_mutex_bucket_code_lines": mutex.code_lines,
            })
        );
        return Ok(());
    }
    let agent = Agent::start_default("ebpf")?;
    // Measure the steady state: the agent publishes the TSC clock after its
    // second calibration anchor (where the kernel keeps time on the TSC).
    let deadline = Instant::now() + std::time::Duration::from_secs(2);
    while agent.status()?.thread_clock_source == "vdso" && keyspace_governor::tsc::usable() && Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let clock_source = agent.status()?.thread_clock_source;
    let client = Client::connect(&agent.socket)?;
    client.register_current_thread()?;
    let _g = client::tag(1)?;

    let thread_clock_ns = best(5, || {
        per_op(2_000_000, |_| {
            std::hint::black_box(client::thread_cpu_ns());
        })
    });
    let clock_thread_cputime_ns = best(5, || {
        per_op(200_000, |_| {
            std::hint::black_box(sys::thread_cputime_ns());
        })
    });
    let tag_switch_ns = best(5, || {
        per_op(2_000_000, |i| {
            client::set_tag(1 + (i & 1) as u32).expect("tag");
        })
    });
    drop(_g);
    let ebpf = switch::ebpf_cost(&agent)?;
    let (attribution, share_pp, steal) = attribution(&agent)?;
    let sleepy = sleepy_thread_error_pct(&agent)?;
    let cpu_wait = cpu_wait_error_pct(&agent)?;
    let policy = policy_allocate_release_ns();
    client::unregister_current_thread();
    drop(client);
    drop(agent);
    let pressure = switch::pressure_cost()?;
    let p = |k: &str| pressure.get(k).copied().unwrap_or(f64::NAN);
    let admission = tickets::fast_path()?;
    let (cap_error, cap_rates) = tickets::cap_error_pct()?;
    let fail_open = tickets::fail_open_ms()?;
    let overflow_cap = tickets::overflow_cap_error_pct()?;
    let (cgroup_cap, cgroup_cap_schedstat) = tickets::cgroup_cap_error_pct()?;
    let (cold_ns, mutex_cold_ns) = adoption::cold_ns()?;
    let (path, mutex_path) = path::ticket_path()?;
    let w = adoption::wait_cpu_us()?;
    let first_use_poll = adoption::first_use_poll_max_us()?;
    let goodput = adoption::goodput_pct()?;
    let load = operator::agent_at_1000_keyspaces()?;
    // The light tenants' p99 governed against alone is a timing ratio that
    // moves from run to run: the median of five short demos, and of five
    // with the latency guard on, alternating.
    let (demos, guarded) = short_demos(DEMO_RUNS)?;
    let idle_wake = wake::idle_wake(IDLE_WAKES, IDLE_WAKE_GAP);
    let median_of = |demos: &[serde_json::Value], f: &dyn Fn(&serde_json::Value) -> Option<f64>| {
        let mut runs = demos.iter().map(|d| f(d).context("a demo figure")).collect::<Result<Vec<f64>>>()?;
        let runs_in_order = runs.clone();
        runs.sort_by(f64::total_cmp);
        Ok::<_, anyhow::Error>((runs[runs.len() / 2], runs_in_order))
    };
    let (victim_ratio, victim_ratios) = median_of(&demos, &|d| d["light_p99_ratio"]["enforcing"].as_f64())?;
    let (guarded_ratio, guarded_ratios) = median_of(&guarded, &|d| d["light_p99_ratio"]["enforcing"].as_f64())?;
    let (unthrottled_ratio, _) = median_of(&demos, &|d| d["light_p99_ratio"]["monitor"].as_f64())?;
    let (demo_cap_error, _) = median_of(&demos, &|d| d["noisy_cap_error_pct"].as_f64())?;
    let (unmatched_none, unmatched_1000) = rules::unmatched_switch_ns(5)?;
    let rule_attribution = rules::attribution_error_pct()?;
    let rule_cap = rules::cap_error_pct()?;
    let neighbour = rules::reader_neighbour(NEIGHBOUR_ROUNDS)?;
    let profile_cost = profile::cost(PROFILE_ROUNDS)?;
    // Agent up and down alternate: measured last, on its own.
    let overhead = switch::overhead(9)?;

    let e = |k: &str| ebpf.get(k).copied().unwrap_or(f64::NAN);
    let result = json!({
        "thread_clock_ns": round(thread_clock_ns),
        "thread_clock_source": clock_source,
        "clock_thread_cputime_ns": round(clock_thread_cputime_ns),
        "tag_switch_ns": round(tag_switch_ns),
        "ebpf_stats_floor_ns": round(e("floor")),
        "ebpf_clock_read_ns": round(e("clock_net")),
        "ebpf_sched_switch_ns": round(e("registered")),
        "ebpf_sched_switch_net_ns": round(e("registered_net")),
        "ebpf_sched_switch_unregistered_raw_ns": round(e("unregistered")),
        "ebpf_sched_switch_unregistered_ns": round(e("unregistered_net")),
        "ebpf_timer_ns": round(e("timer")),
        "ebpf_sched_switch_pressure_net_ns": round(p("registered_net")),
        "ebpf_sched_switch_pressure_unregistered_ns": round(p("unregistered_net")),
        "ebpf_wakeup_net_ns": round(p("wakeup_registered_net")),
        "ebpf_wakeup_unregistered_ns": round(p("wakeup_unregistered_net")),
        "pingpong_round_trip_ns": round(overhead.baseline_ns),
        "ctx_switch_overhead_empty_program_pct": round2(overhead.empty_program_pct),
        "ctx_switch_overhead_unregistered_pct": round2(overhead.unregistered_pct),
        "ctx_switch_overhead_registered_pct": round2(overhead.registered_pct),
        "attribution_error_pct": round3(attribution.abs()),
        "attribution_signed_error_pct": round3(attribution),
        "attribution_share_error_pp": round3(share_pp),
        "attribution_steal_pct": round3(steal),
        "sleepy_thread_error_pct": round3(sleepy.abs()),
        "cpu_wait_error_pct": round3(cpu_wait),
        "sleepy_thread_signed_error_pct": round3(sleepy),
        "policy_allocate_release_ns": round(policy),
        "ticket_acquire_release_ns": round(admission.uncontended_ns),
        "ticket_acquire_release_deadline_ns": round(admission.deadline_ns),
        "ticket_acquire_release_contended_ns": round(admission.contended_ns),
        "ticket_acquire_release_alternating_ns": round(admission.alternating_ns),
        "baseline_mutex_bucket_ns": round(admission.mutex_ns),
        "baseline_mutex_bucket_contended_ns": round(admission.mutex_contended_ns),
        "baseline_socket_rpc_ns": round(admission.rpc_ns),
        "ticket_vs_mutex": round3(admission.uncontended_ns / admission.mutex_ns),
        "ticket_vs_mutex_contended": round3(admission.contended_ns / admission.mutex_contended_ns),
        "ticket_vs_rpc": round3(admission.uncontended_ns / admission.rpc_ns),
        "cap_error_pct": round2(cap_error),
        "cap_window_cores": cap_rates.iter().map(|r| round3(*r)).collect::<Vec<_>>(),
        "fail_open_ms": round2(fail_open),
        "demo_victim_p99_ratio": round3(victim_ratio),
        "demo_victim_p99_ratio_runs": victim_ratios.iter().map(|r| round3(*r)).collect::<Vec<_>>(),
        "demo_victim_p99_ratio_guarded": round3(guarded_ratio),
        "demo_victim_p99_ratio_guarded_runs": guarded_ratios.iter().map(|r| round3(*r)).collect::<Vec<_>>(),
        "demo_unthrottled_p99_ratio": round3(unthrottled_ratio),
        "demo_noisy_cap_error_pct": round2(demo_cap_error),
        "logical_cores": sys::logical_cores(),
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
    });
    let mut result = result;
    // The operator surface at 1000 active keyspaces (a second object: the
    // macro above is at its recursion limit).
    if let Some(o) = result.as_object_mut() {
        o.insert("metrics_scrape_ms".into(), json!(round2(load.scrape_ms)));
        idle_wake_keys(o, &idle_wake);
        o.insert("ticket_acquire_cold_ns".into(), json!(round(cold_ns)));
        o.insert("baseline_mutex_bucket_cold_ns".into(), json!(round(mutex_cold_ns)));
        o.insert("ticket_cold_vs_mutex".into(), json!(round3(cold_ns / mutex_cold_ns)));
        o.insert("ticket_path_instructions".into(), json!(path.instructions));
        o.insert("ticket_path_code_lines".into(), json!(path.code_lines));
        o.insert("ticket_path_code_pages".into(), json!(path.code_pages));
        o.insert("ticket_path_data_lines".into(), json!(path.data_lines));
        o.insert("baseline_mutex_bucket_instructions".into(), json!(mutex_path.instructions));
        o.insert("baseline_mutex_bucket_code_lines".into(), json!(mutex_path.code_lines));
        wait_cpu_keys(o, &w);
        o.insert("first_use_poll_max_us".into(), json!(round2(first_use_poll)));
        o.insert("goodput_pct".into(), json!(round2(goodput.0)));
        o.insert("goodput_window_error_pct".into(), json!(round2(goodput.1)));
        o.insert("rule_attribution_error_pct".into(), json!(round3(rule_attribution.abs())));
        o.insert("rule_attribution_signed_error_pct".into(), json!(round3(rule_attribution)));
        o.insert("rule_cap_error_pct".into(), json!(round2(rule_cap)));
        neighbour_keys(o, &neighbour);
        profile_keys(o, &profile_cost);
        o.insert("overflow_cap_error_pct".into(), json!(round2(overflow_cap)));
        o.insert("cgroup_cap_error_pct".into(), json!(round2(cgroup_cap)));
        o.insert("cgroup_cap_schedstat_error_pct".into(), json!(round2(cgroup_cap_schedstat)));
        o.insert("ebpf_unmatched_switch_raw_ns".into(), json!(round(unmatched_none)));
        o.insert("ebpf_unmatched_switch_1000_rules_raw_ns".into(), json!(round(unmatched_1000)));
        o.insert("ebpf_unmatched_switch_1000_rules_delta_ns".into(), json!(round(unmatched_1000 - unmatched_none)));
        o.insert("metrics_scrape_bytes".into(), json!(load.scrape_bytes));
        o.insert("metrics_keyspaces".into(), json!(load.keyspaces));
        o.insert("agent_rss_mib".into(), json!(round2(load.rss_mib)));
        o.insert("agent_cpu_pct_of_core".into(), json!(round2(load.cpu_pct_of_core)));
    }
    if json_out {
        println!("{result}");
    } else {
        for (k, v) in result.as_object().expect("object") {
            println!("{k:>28}  {v}");
        }
    }
    Ok(())
}

fn round(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}
