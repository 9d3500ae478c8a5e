//! The demo as an end-to-end test: a real reader server under a real noisy
//! neighbour, with the agent measuring, then enforcing a tenant cap. The
//! enforcing phase holds the noisy tenant to its cap in every 1 s window
//! (by the agent and by the kernel's count), refuses no light request, and
//! leaves the light tenants' p99 below its unthrottled value; the monitor
//! phase shows the noise is real. The SVG parses and draws one series per
//! tenant. Latency ratios are timing figures, not mechanism: `cargo xtask
//! bench` reports them.

use governor_tests::{Scratch, run_demo};
use serde_json::Value;

/// How far a tenant's charge may stray outside the kernel's counts of its
/// tickets' work and polls over a phase, %. The kernel's count bounds each
/// thread's total; how a slice splits between tags rests on the thread
/// clock, which can be off by a microsecond or two at a tag change
/// (docs/design.md §3): nothing against a noisy tenant's long polls, a few
/// percent of a light tenant's 20 µs gets.
const CROSS_CHECK_PCT: f64 = 1.0;
const CROSS_CHECK_LIGHT_PCT: f64 = 5.0;

/// A window in which the noisy tenant's requests waited for tokens this
/// share of the time (%) was held back by its cap.
const HELD_PCT: f64 = 50.0;

/// A second in which the hypervisor stole less than this share of the
/// machine (%) is one the host left alone.
const CLEAN_STEAL_PCT: f64 = 2.0;

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// The numbers the assertions look at, one line per phase.
fn summary(r: &Value) -> String {
    let mut s = String::new();
    for p in r["phases"].as_array().expect("phases") {
        let light = &p["light"];
        s += &format!(
            "{:<9} (steal {:.1} %) light p50/p99/p99.9 {}/{}/{} µs ({} requests), p99 per second {}",
            p["name"].as_str().unwrap_or("?"),
            f(&p["steal_pct"]),
            light["p50_us"],
            light["p99_us"],
            light["p999_us"],
            light["requests"],
            p["light_p99_per_second_us"]
        );
        if let Some(n) = p["noisy"].as_object() {
            s += &format!(
                "; noisy {:.3} cores against a cap of {}, windows {}",
                f(&n["cpu_cores"]),
                n["cap_cores"],
                n["windows_cores"]
            );
            let t = &p["tenants"]["noisy"];
            s += &format!(
                "\n    noisy by thread clock inside the tags {}, of the polls {}, waiting % {}",
                t["windows_thread_clock_cores"], t["windows_ticket_poll_cores"], t["windows_waiting_pct"]
            );
        }
        for (name, t) in p["tenants"].as_object().expect("tenants") {
            s += &format!(
                "\n    {name}: agent {:.4} cores, thread clock {:.4} ({:+.2} % inside the tags, {:+.2} % of the polls), p99 {} µs, busy {}, errors {}, waited {}, refused {}",
                f(&t["cpu_cores"]),
                f(&t["thread_clock_cores"]),
                f(&t["cross_check_error_pct"]),
                f(&t["cross_check_polls_error_pct"]),
                t["latency"]["p99_us"],
                t["busy"],
                t["errors"],
                t["waited"],
                t["refused"]
            );
        }
        s += "\n";
    }
    s + &format!("light p99 ratios to alone: {}", r["light_p99_ratio"])
}

#[test]
fn a_governed_noisy_neighbour_keeps_its_cap_and_the_light_tenants_keep_their_tail() {
    let dir = Scratch::new("demo");
    let svg = dir.0.join("demo.svg");
    let r = run_demo(&["--short"], &svg).unwrap_or_else(|e| panic!("{e:#}"));
    let numbers = summary(&r);
    eprintln!("{numbers}");
    let phases = r["phases"].as_array().expect("phases");
    assert_eq!(phases.len(), 3, "{numbers}");
    let (monitor, enforcing) = (&phases[1], &phases[2]);

    // Enforcing: the noisy tenant never above its cap in any 1 s window
    // after the first (which warms up the new agent's estimates and
    // buckets), by the agent's charge and by the kernel's count of the
    // server's threads; and not below it in any window its tokens held it
    // back (a request of it waited in line for tokens for most of the
    // window: 85–100 % here, idle or with a core kept busy). A window in
    // which it hardly waited was held back by the machine, not by the cap:
    // that is no failure of the governor.
    let cap = f(&enforcing["noisy"]["cap_cores"]);
    let noisy = &enforcing["tenants"]["noisy"];
    let series =
        |key: &str| -> Vec<f64> { noisy[key].as_array().unwrap_or_else(|| panic!("{key}")).iter().map(f).collect() };
    // By the kernel's count: the work inside its tickets' tags (the least
    // it used) never over the cap, the tickets' whole polls (the most) not
    // under it.
    let (by_agent, inside, polls, waiting) = (
        series("windows_cores"),
        series("windows_thread_clock_cores"),
        series("windows_ticket_poll_cores"),
        series("windows_waiting_pct"),
    );
    let steal: Vec<f64> = enforcing["windows_steal_pct"].as_array().expect("steal").iter().map(f).collect();
    let n = by_agent.len();
    assert!(
        n >= 5 && inside.len() == n && polls.len() == n && waiting.len() == n && steal.len() == n,
        "windows\n{numbers}"
    );
    let mut held = 0;
    for i in 1..n {
        let err = |w: f64| (w - cap) / cap * 100.0;
        for (what, w) in [("agent", by_agent[i]), ("thread clock inside the tags", inside[i])] {
            assert!(err(w) <= 5.0, "window {i}: {what} {w:.3} cores, {:+.2} % over the cap {cap}\n{numbers}", err(w));
        }
        if waiting[i] >= HELD_PCT {
            held += 1;
            // Tickets pay by the thread clock, which counts the time the
            // hypervisor stole within a slice (the kernel does not): with
            // that much of the machine stolen, the tenant gets that much
            // less of the kernel's CPU for its tokens.
            for (what, w) in [("agent", by_agent[i]), ("thread clock of the polls", polls[i])] {
                assert!(
                    err(w) >= -5.0 - steal[i],
                    "window {i}: {what} {w:.3} cores, {:+.2} % under the cap {cap} while it waited {:.0} % of the window (steal {:.1} %)\n{numbers}",
                    err(w),
                    waiting[i],
                    steal[i]
                );
            }
        }
    }
    eprintln!("noisy held back by its tokens in {held} of {} windows", by_agent.len() - 1);
    assert!(held >= 1, "the cap never held the noisy tenant back: nothing was tested\n{numbers}");
    // The light tenants' tail is better governed than not. (How close it
    // comes to their tail alone is a timing ratio: `cargo xtask bench`
    // reports it as demo_victim_p99_ratio.)
    // Second by second, over the seconds the host left this machine alone
    // (steal under 2 %: a hypervisor that takes a third of the machine in
    // one phase decides any latency comparison); the median of their p99s.
    let clean_p99s = |p: &Value| -> Vec<f64> {
        let steal = p["windows_steal_pct"].as_array().expect("steal");
        let mut v: Vec<f64> = p["light_p99_per_second_us"]
            .as_array()
            .expect("per second")
            .iter()
            .zip(steal.iter().map(f).chain(std::iter::repeat(f64::INFINITY)))
            .filter(|(p99, steal)| f(p99) > 0.0 && *steal < CLEAN_STEAL_PCT)
            .map(|(p99, _)| f(p99))
            .collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let (governed, unthrottled) = (clean_p99s(enforcing), clean_p99s(monitor));
    if governed.len() >= 3 && unthrottled.len() >= 3 {
        let (g, u) = (governed[governed.len() / 2], unthrottled[unthrottled.len() / 2]);
        assert!(
            g < u,
            "light p99 governed {g} µs, unthrottled {u} µs (medians of the seconds without steal)\n{numbers}"
        );
    } else {
        eprintln!(
            "the host stole from this machine in all but {} governed and {} unthrottled seconds: no latency comparison this run",
            governed.len(),
            unthrottled.len()
        );
    }

    // Monitor: the agent only measures. The noisy tenant never waits and
    // takes well over its cap.
    let noisy_unthrottled = f(&monitor["noisy"]["cpu_cores"]);
    let cores = f(&r["cores"]);
    assert!(
        noisy_unthrottled > 1.5 * cap && noisy_unthrottled <= cores * 1.02,
        "monitor: noisy {noisy_unthrottled:.3} cores\n{numbers}"
    );

    // Every light request answered, none refused; the noisy tenant waited
    // in line under the cap, and never before it.
    for p in phases {
        for (name, t) in p["tenants"].as_object().expect("tenants") {
            assert_eq!(t["errors"], 0, "{name} in {}\n{numbers}", p["name"]);
            if t["role"] == "light" {
                assert_eq!(t["busy"].as_object().map_or(0, |b| b.len()), 0, "{name} in {}\n{numbers}", p["name"]);
                assert_eq!(t["waited"], 0, "{name} waited in {}\n{numbers}", p["name"]);
            }
        }
    }
    let noisy_waited = enforcing["tenants"]["noisy"]["waited"].as_u64().expect("waited");
    assert!(noisy_waited > 0, "{numbers}");
    assert_eq!(monitor["tenants"]["noisy"]["waited"], 0, "{numbers}");

    // The agent charged each tenant at least the kernel's count of the work
    // inside its tickets' tags and at most that of the tickets' whole polls.
    for p in phases {
        for (name, t) in p["tenants"].as_object().expect("tenants") {
            let (inside, polls) = (f(&t["cross_check_error_pct"]), f(&t["cross_check_polls_error_pct"]));
            // The split can also be off by what the hypervisor stole within
            // a slice (the thread clock counts it, the kernel does not).
            let tolerance =
                if t["role"] == "light" { CROSS_CHECK_LIGHT_PCT } else { CROSS_CHECK_PCT } + f(&p["steal_pct"]);
            assert!(
                inside >= -tolerance && polls <= tolerance,
                "{name} in {}: agent {inside:+.2} % against the work inside its tags, {polls:+.2} % against the tickets' polls\n{numbers}",
                p["name"]
            );
        }
    }

    // Whom the light tenants' kernel wait was behind: shares of it that
    // add up, each phase's own (the agent keeps them over its window).
    for p in phases {
        let by = p["light_wait_behind_pct"].as_object().expect("light_wait_behind_pct");
        if by.is_empty() {
            continue;
        }
        let total: f64 = by.values().map(f).sum();
        assert!(
            by.values().all(|v| (0.0..=100.0).contains(&f(v))) && (99.9..=100.1).contains(&total),
            "{}: the light tenants' wait behind {by:?} adds up to {total:.2} %\n{numbers}",
            p["name"]
        );
    }

    // The picture: a well-formed SVG with one line series per tenant, in
    // the colour the demo says it drew that tenant in, and its name in a
    // legend.
    let text = std::fs::read_to_string(&svg).unwrap_or_else(|e| panic!("{}: {e}", svg.display()));
    let doc = roxmltree::Document::parse(&text).unwrap_or_else(|e| panic!("{} does not parse: {e}", svg.display()));
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let series = r["series"].as_array().expect("series");
    assert_eq!(series.len(), 4, "{series:?}");
    let points_per_tenant = by_agent.len() * 3;
    for s in series {
        let (tenant, color) = (s["tenant"].as_str().expect("tenant"), s["color"].as_str().expect("color"));
        let lines: Vec<usize> = doc
            .descendants()
            .filter(|n| n.has_tag_name("polyline") && n.attribute("stroke") == Some(color))
            .map(|n| n.attribute("points").unwrap_or("").split_whitespace().count())
            .filter(|&points| points >= points_per_tenant / 2)
            .collect();
        // CPU for every tenant; p99 too for the light ones.
        let expected = if tenant == "noisy" { 1 } else { 2 };
        assert_eq!(lines.len(), expected, "{tenant} ({color}): series of {lines:?} points");
        assert!(
            lines.iter().all(|&p| p <= points_per_tenant + 3),
            "{tenant}: {lines:?} points for {points_per_tenant} seconds"
        );
        assert!(
            doc.descendants().any(|n| n.has_tag_name("text") && n.text().is_some_and(|t| t.trim() == tenant)),
            "no legend names {tenant}"
        );
    }
}
