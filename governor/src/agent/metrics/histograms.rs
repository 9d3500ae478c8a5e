//! The seed's per-keyspace histograms, written in the text format from the
//! counters in each bucket cell (the registry's histograms observe one
//! value at a time; these are read whole from shared memory).

use super::render::Row;
use keyspace_governor_common::admission::{hist, request as q};
use std::fmt::Write as _;

/// One histogram series: `first` more in the first bucket than `counts`
/// says (what no counter saw), `counts` per bucket up to `bounds` then the
/// overflow, bounds and sum in the counters' unit (`unit` of them a
/// second, or a ratio of 1).
struct Series<'a> {
    labels: String,
    first: u64,
    counts: &'a [u64],
    bounds: &'a [u64],
    sum: u64,
    unit: f64,
}

fn header(out: &mut String, name: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} histogram");
}

fn series(out: &mut String, name: &str, s: Series<'_>) {
    let Series { labels, first, counts, bounds, sum, unit } = s;
    let mut cumulative = first;
    for (i, bound) in bounds.iter().enumerate() {
        cumulative += counts[i];
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{}\"}} {cumulative}", *bound as f64 / unit);
    }
    cumulative += counts[bounds.len()];
    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {cumulative}");
    let _ = writeln!(out, "{name}_sum{{{labels}}} {}", sum as f64 / unit);
    let _ = writeln!(out, "{name}_count{{{labels}}} {cumulative}");
}

/// Each released request's measured CPU and its ratio to the estimate it
/// was admitted with.
pub(super) fn request(out: &mut String, shown: &[(String, Row)]) {
    let families = [
        (
            "tikv_cpu_throttle_request_cpu_time_seconds",
            "CPU a released request consumed, by keyspace",
            q::CPU,
            q::CPU_SUM,
            &q::CPU_BOUNDS_US,
            1e6,
        ),
        (
            "tikv_cpu_throttle_request_actual_to_estimated_ratio",
            "CPU a released request consumed over the estimate it was admitted with, by keyspace",
            q::RATIO,
            q::RATIO_SUM,
            &q::RATIO_BOUNDS_PERMILLE,
            1e3,
        ),
    ];
    for (name, help, base, sum, bounds, unit) in families {
        header(out, name, help);
        for (ks, r) in shown {
            let h = &r.request_hist.0;
            let counts = &h[base..=base + bounds.len()];
            let labels = format!("keyspace_id=\"{ks}\"");
            series(out, name, Series { labels, first: 0, counts, bounds, sum: h[sum], unit });
        }
    }
}

/// The waits clients counted when they ended, by result; in the first
/// bucket also the acquires (or top-ups) served or refused at once, which
/// no wait counted (the counters' difference).
pub(super) fn wait(out: &mut String, shown: &[(String, Row)]) {
    let families = [
        (
            "tikv_cpu_token_wait_duration_seconds",
            "Time an admission waited in line for CPU tokens, by keyspace and result",
            [(hist::WAIT_GRANTED, "granted"), (hist::WAIT_REFUSED, "refused")],
        ),
        (
            "tikv_cpu_token_runtime_wait_duration_seconds",
            "Time a running request's top-up waited for CPU tokens, by keyspace and result",
            [(hist::RUNTIME_GRANTED, "granted"), (hist::RUNTIME_REFUSED, "refused")],
        ),
    ];
    for (name, help, parts) in families {
        header(out, name, help);
        for (ks, r) in shown {
            for (base, result) in parts {
                let h = &r.wait_hist.0[base..base + hist::SLOTS];
                let waits: u64 = h[..hist::SLOTS - 1].iter().sum();
                let total = match base {
                    hist::WAIT_GRANTED => r.granted,
                    hist::WAIT_REFUSED => r.refused,
                    hist::RUNTIME_GRANTED => r.topups_granted,
                    _ => r.topups_refused,
                };
                let labels = format!("keyspace_id=\"{ks}\",result=\"{result}\"");
                let (counts, sum) = (&h[..=hist::BOUNDS_US.len()], h[hist::SLOTS - 1]);
                let first = total.saturating_sub(waits);
                series(out, name, Series { labels, first, counts, bounds: &hist::BOUNDS_US, sum, unit: 1e6 });
            }
        }
    }
}
