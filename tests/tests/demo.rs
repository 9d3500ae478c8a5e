//! The demo as an end-to-end test: a real reader server under a real noisy
//! neighbour, with the agent measuring, then enforcing a tenant cap. The
//! enforcing phase holds the noisy tenant to its cap in every 1 s window
//! and keeps the light tenants' p99 within 1.5× of their p99 alone; the
//! monitor phase shows the noise is real. The SVG parses and draws one
//! series per tenant.

use governor_tests::{run_demo, Scratch};
use serde_json::Value;

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// The numbers the assertions look at, one line per phase.
fn summary(r: &Value) -> String {
    let mut s = String::new();
    for p in r["phases"].as_array().expect("phases") {
        let light = &p["light"];
        s += &format!(
            "{:<9} light p50/p99/p99.9 {}/{}/{} µs ({} requests)",
            p["name"].as_str().unwrap_or("?"),
            light["p50_us"],
            light["p99_us"],
            light["p999_us"],
            light["requests"]
        );
        if let Some(n) = p["noisy"].as_object() {
            s += &format!("; noisy {:.3} cores against a cap of {}, windows {}", f(&n["cpu_cores"]), n["cap_cores"], n["windows_cores"]);
        }
        for (name, t) in p["tenants"].as_object().expect("tenants") {
            s += &format!(
                "\n    {name}: agent {:.4} cores, thread clock {:.4} ({:+.2} %), p99 {} µs, busy {}, errors {}, waited {}, refused {}",
                f(&t["cpu_cores"]),
                f(&t["thread_clock_cores"]),
                f(&t["cross_check_error_pct"]),
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
    let (alone, monitor, enforcing) = (&phases[0], &phases[1], &phases[2]);
    let p99 = |p: &Value| f(&p["light"]["p99_us"]);

    // Enforcing: the noisy tenant at its cap in every 1 s window after the
    // first (which warms up the new agent's estimates and buckets).
    let cap = f(&enforcing["noisy"]["cap_cores"]);
    let windows: Vec<f64> = enforcing["noisy"]["windows_cores"].as_array().expect("windows").iter().map(f).collect();
    assert!(windows.len() >= 5, "too few windows: {windows:?}\n{numbers}");
    for (i, w) in windows.iter().enumerate().skip(1) {
        let err = (w - cap) / cap * 100.0;
        assert!((-5.0..=5.0).contains(&err), "window {i}: {w:.3} cores, {err:+.2} % off the cap {cap}\n{numbers}");
    }
    // ... and the light tenants' tail survives it.
    let governed = p99(enforcing) / p99(alone);
    assert!((0.5..=1.5).contains(&governed), "enforcing p99 {governed:.2}× alone\n{numbers}");

    // Monitor: the noise is real. The noisy tenant takes far more than its
    // cap, and the light tenants' p99 suffers for it.
    let noisy_unthrottled = f(&monitor["noisy"]["cpu_cores"]);
    let cores = f(&r["cores"]);
    assert!(noisy_unthrottled > 2.0 * cap && noisy_unthrottled <= cores, "monitor: noisy {noisy_unthrottled:.3} cores\n{numbers}");
    let unthrottled = p99(monitor) / p99(alone);
    assert!(unthrottled > 1.5 && unthrottled < 1000.0, "monitor p99 only {unthrottled:.2}× alone\n{numbers}");

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

    // The agent's charges and the server's own thread clocks agree.
    for p in phases {
        for (name, t) in p["tenants"].as_object().expect("tenants") {
            let err = f(&t["cross_check_error_pct"]);
            let bound = if t["role"] == "noisy" { 3.0 } else { 8.0 };
            assert!((-bound..=bound).contains(&err), "{name} in {}: agent vs thread clock {err:+.2} %\n{numbers}", p["name"]);
        }
    }

    // The picture: a well-formed SVG with one line series per tenant, in
    // the colour the demo says it drew that tenant in, and its name in a
    // legend.
    let text = std::fs::read_to_string(&svg).unwrap_or_else(|e| panic!("{}: {e}", svg.display()));
    let doc = roxmltree::Document::parse(&text).unwrap_or_else(|e| panic!("{} does not parse: {e}", svg.display()));
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let series = r["series"].as_array().expect("series");
    assert_eq!(series.len(), 4, "{series:?}");
    let points_per_tenant = windows.len() * 3;
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
        assert!(lines.iter().all(|&p| p <= points_per_tenant + 3), "{tenant}: {lines:?} points for {points_per_tenant} seconds");
        assert!(
            doc.descendants().any(|n| n.has_tag_name("text") && n.text().is_some_and(|t| t.trim() == tenant)),
            "no legend names {tenant}"
        );
    }
}
