//! Histograms written in the text format from counters read whole (the
//! seed's per-keyspace histograms live in each bucket cell; the registry's
//! histograms observe one value at a time).

use std::fmt::Write as _;

/// One histogram series: `first` more in the first bucket than `counts`
/// says (what no counter saw), `counts` per bucket up to `bounds` then the
/// overflow, bounds and sum in the counters' unit (`unit` of them a
/// second, or a ratio of 1).
pub(super) struct Series<'a> {
    pub(super) labels: String,
    pub(super) first: u64,
    pub(super) counts: &'a [u64],
    pub(super) bounds: &'a [u64],
    pub(super) sum: u64,
    pub(super) unit: f64,
}

pub(super) fn header(out: &mut String, name: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} histogram");
}

pub(super) fn series(out: &mut String, name: &str, s: Series<'_>) {
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
