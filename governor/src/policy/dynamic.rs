//! Watermark-based dynamic refill adjustment (keyspace-cpu-throttle.md, `update_refill_rates`).
//!
//! Global: ratio above the high watermark reduces the refill in proportion (`base × high / ratio`),
//! ratio below the low watermark restores the base rate, in between the current rate is kept.
//! Keyspace: ratio above `0.9 × quota ratio` reduces (`base × 0.9·quota_ratio / ratio`), otherwise
//! the base rate is restored.

/// Share of a keyspace's quota ratio above which its refill is reduced.
pub const KEYSPACE_REDUCE_FACTOR: f64 = 0.9;

/// New global refill per interval, µs.
pub fn adjust_global_refill(base_us: u64, current_us: u64, ratio: f64, high: f64, low: f64) -> u64 {
    if ratio > high && ratio > 0.0 {
        (base_us as f64 * high / ratio) as u64
    } else if ratio < low {
        base_us
    } else {
        current_us
    }
}

/// New keyspace refill per interval, µs. `quota_ratio` = keyspace quota / global quota.
pub fn adjust_keyspace_refill(base_us: u64, ratio: f64, quota_ratio: f64) -> u64 {
    let threshold = KEYSPACE_REDUCE_FACTOR * quota_ratio;
    if ratio > threshold && ratio > 0.0 { (base_us as f64 * threshold / ratio) as u64 } else { base_us }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn global_reduces_above_high_restores_below_low_keeps_between() {
        assert_eq!(adjust_global_refill(1000, 1000, 1.0, 0.8, 0.5), 800);
        assert_eq!(adjust_global_refill(1000, 800, 0.6, 0.8, 0.5), 800);
        assert_eq!(adjust_global_refill(1000, 800, 0.4, 0.8, 0.5), 1000);
    }

    #[test]
    fn keyspace_reduces_above_ninety_percent_of_quota_ratio() {
        // quota ratio 0.5 → threshold 0.45; ratio 0.9 → half rate.
        assert_eq!(adjust_keyspace_refill(1000, 0.9, 0.5), 500);
        assert_eq!(adjust_keyspace_refill(1000, 0.44, 0.5), 1000);
    }

    #[test]
    fn watermark_boundaries_keep_the_current_rate() {
        // Exactly at the high watermark: not above, so no reduction.
        assert_eq!(adjust_global_refill(1000, 900, 0.8, 0.8, 0.5), 900);
        // Exactly at the low watermark: not below, so no restore.
        assert_eq!(adjust_global_refill(1000, 900, 0.5, 0.8, 0.5), 900);
        // Idle node restores.
        assert_eq!(adjust_global_refill(1000, 10, 0.0, 0.8, 0.5), 1000);
    }

    #[test]
    fn reduction_is_proportional_to_overshoot() {
        // 2× the high watermark halves the rate relative to base × high.
        assert_eq!(adjust_global_refill(10_000, 10_000, 1.6, 0.8, 0.5), 5_000);
        // Keyspace at 2× its threshold gets half its base rate.
        assert_eq!(adjust_keyspace_refill(10_000, 0.36, 0.2), 5_000);
    }

    #[test]
    fn keyspace_with_zero_quota_ratio_and_no_usage_keeps_base() {
        assert_eq!(adjust_keyspace_refill(1000, 0.0, 0.0), 1000);
        // Any usage above a zero threshold reduces to zero.
        assert_eq!(adjust_keyspace_refill(1000, 0.1, 0.0), 0);
    }

    proptest::proptest! {
        #[test]
        fn adjusted_rates_never_exceed_base(
            base in 0u64..1_000_000,
            current in 0u64..1_000_000,
            ratio in 0.0f64..3.0,
            quota_ratio in 0.0f64..1.0,
        ) {
            let current = current.min(base);
            proptest::prop_assert!(adjust_global_refill(base, current, ratio, 0.8, 0.5) <= base);
            proptest::prop_assert!(adjust_keyspace_refill(base, ratio, quota_ratio) <= base);
        }
    }
}
