//! Proportional fair allocation (keyspace-cpu-throttle.md, "Key Component 3").
//!
//! Above `fair-allocation-threshold`, the capacity still available on the node is shared among
//! the keyspaces still under quota, in proportion to their quotas, each capped at its remaining
//! quota (and at its demand when known). Keyspaces at or over quota get nothing more. Single pass:
//! what a capped keyspace leaves is not redistributed, exactly as in the seed's worked example.

/// One keyspace's numbers, all in the same unit (cores, or µs per interval).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FairInput {
    pub keyspace: u32,
    pub quota: f64,
    pub usage: f64,
    /// Pending demand; `None` = unknown (not a cap).
    pub demand: Option<f64>,
}

/// What the keyspace may add and its resulting allocation (`usage + can_use`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FairShare {
    pub keyspace: u32,
    pub can_use: f64,
    pub allocation: f64,
}

/// `available = total − current_usage`; shares it by quota among keyspaces with `usage < quota`.
pub fn fair_allocate(total: f64, current_usage: f64, inputs: &[FairInput]) -> Vec<FairShare> {
    let available = (total - current_usage).max(0.0);
    let eligible_quota: f64 = inputs.iter().filter(|k| k.usage < k.quota).map(|k| k.quota).sum();
    inputs
        .iter()
        .map(|k| {
            let can_use = if k.usage < k.quota && eligible_quota > 0.0 {
                let fair_share = available * (k.quota / eligible_quota);
                let mut c = (k.quota - k.usage).min(fair_share);
                if let Some(d) = k.demand {
                    c = c.min(d.max(0.0));
                }
                c
            } else {
                0.0
            };
            FairShare { keyspace: k.keyspace, can_use, allocation: k.usage + can_use }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn over_quota_keyspace_gets_nothing_and_nothing_when_node_full() {
        let out = fair_allocate(4.0, 4.0, &[FairInput { keyspace: 1, quota: 2.0, usage: 1.0, demand: None }]);
        assert_eq!(out[0].can_use, 0.0);
        let out = fair_allocate(8.0, 3.0, &[FairInput { keyspace: 1, quota: 2.0, usage: 3.0, demand: Some(5.0) }]);
        assert_eq!(out[0].can_use, 0.0);
        assert_eq!(out[0].allocation, 3.0);
    }

    #[test]
    fn unknown_demand_is_not_a_cap_and_leftover_is_not_redistributed() {
        let out = fair_allocate(
            10.0,
            4.0,
            &[
                FairInput { keyspace: 1, quota: 3.0, usage: 2.0, demand: None },
                FairInput { keyspace: 2, quota: 3.0, usage: 0.0, demand: None },
            ],
        );
        // available 6 split 3/3; keyspace 1 capped at its remaining 1.0, keyspace 2 at 3.0.
        assert_eq!(out[0].can_use, 1.0);
        assert_eq!(out[1].can_use, 3.0);
        let total: f64 = out.iter().map(|s| s.can_use).sum();
        assert!(total < 6.0, "single pass: keyspace 1's unused 2.0 stays unallocated");
    }

    #[test]
    fn no_eligible_keyspace_means_no_allocation() {
        let out = fair_allocate(8.0, 1.0, &[FairInput { keyspace: 1, quota: 0.0, usage: 0.0, demand: Some(1.0) }]);
        assert_eq!(out[0].can_use, 0.0);
        assert!(fair_allocate(8.0, 1.0, &[]).is_empty());
    }

    proptest::proptest! {
        #[test]
        fn shares_respect_available_remaining_quota_and_demand(
            total in 0.0f64..64.0,
            used in 0.0f64..64.0,
            ks in proptest::collection::vec((0.0f64..16.0, 0.0f64..16.0, proptest::option::of(0.0f64..16.0)), 0..12),
        ) {
            let inputs: Vec<FairInput> = ks
                .iter()
                .enumerate()
                .map(|(i, &(quota, usage, demand))| FairInput { keyspace: i as u32, quota, usage, demand })
                .collect();
            let out = fair_allocate(total, used, &inputs);
            let available = (total - used).max(0.0);
            let sum: f64 = out.iter().map(|s| s.can_use).sum();
            proptest::prop_assert!(sum <= available + 1e-9);
            for (i, s) in inputs.iter().zip(&out) {
                proptest::prop_assert!(s.can_use >= 0.0);
                if i.usage >= i.quota {
                    proptest::prop_assert_eq!(s.can_use, 0.0);
                } else {
                    proptest::prop_assert!(s.can_use <= i.quota - i.usage + 1e-9);
                }
                if let Some(d) = i.demand {
                    proptest::prop_assert!(s.can_use <= d + 1e-9);
                }
            }
        }
    }
}
