//! The seed's per-keyspace histograms of requests and waits, written from
//! the counters each bucket cell keeps.

use super::Row;
use crate::agent::metrics::histograms::{Series, header, series};
use keyspace_governor_common::admission::{hist, request as q};

/// The seed's request histograms, per keyspace: each released request's measured CPU and its ratio to the estimate it
/// was admitted with.
pub(super) fn request_histograms(out: &mut String, shown: &[(String, Row)]) {
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

/// The seed's wait histograms, per keyspace: the waits clients counted when they ended, by result; in the first
/// bucket also the acquires (or top-ups) served or refused at once, which
/// no wait counted (the counters' difference).
pub(super) fn wait_histograms(out: &mut String, shown: &[(String, Row)]) {
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
