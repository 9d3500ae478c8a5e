//! Settings built from the configuration, and a simulated-clock load
//! generator, shared by the integration tests.
#![allow(dead_code)]

use keyspace_governor::policy::{Policy, Refusal, Settings};

pub const SEC: u64 = 1_000_000;
pub const MS: u64 = 1_000;

/// Cores of the simulated node unless a test says otherwise.
pub const CORES: f64 = 8.0;

/// The configuration behind [`base`]: the documented defaults with the CPU
/// throttle on and every optional mechanism off.
pub const BASE_TOML: &str = "\
[resource-control.cpu-throttle]
enabled = true
enable-adaptive-estimated-cpu-per-request-us = false
enable-dynamic-adjustment = false
enable-fair-allocation = false
enable-burst = false
enable-runtime-token-management = false
";

/// Premium defaults with the optional mechanisms (burst, fair allocation,
/// dynamic adjustment, adaptive estimate, runtime top-up, PD, tenant cap)
/// off, on an 8-core node: max-read-cpu-ratio 0.6, 10 ms refill, 100 ms burst
/// window, 1 s stats interval, 60 s window. Tests adjust fields of this value
/// (`Settings { x, ..base() }`) where the configuration has no key for what
/// they need, or forbids it.
pub fn base() -> Settings {
    Settings::from_toml(BASE_TOML, CORES).unwrap_or_else(|e| panic!("base configuration: {e}"))
}

/// The Essential profile of tenant-cpu-cap.md §4.1 (cpu-throttle on,
/// enforce-global-limit, burst / fair / dynamic / PD / low-priority DAG off,
/// runtime token management on, adaptive estimate off) with the given cap
/// ratio, on a node of `cores` cores.
pub fn essential_settings(cores: f64, ratio: f64) -> Settings {
    let text = format!(
        "\
[resource-control]
enabled = true
max-read-cpu-ratio = 0.6

[resource-control.cpu-throttle]
enabled = true
enforce-global-limit = true
tenant-max-cpu-ratio = {ratio:?}
tenant-cap-idle-ttl = \"10m\"
keyspace-cpu-quotas = \"\"
enable-burst = false
enable-fair-allocation = false
enable-dynamic-adjustment = false
enable-pd-service-limit = false
low-priority-dag-global-enabled = false
enable-runtime-token-management = true
enable-adaptive-estimated-cpu-per-request-us = false
"
    );
    Settings::from_toml(&text, cores).unwrap_or_else(|e| panic!("essential profile (ratio {ratio}): {e}"))
}

/// A policy running the Essential profile on an 8-core node.
pub fn essential(ratio: f64) -> Policy {
    Policy::new(essential_settings(CORES, ratio), 0).expect("policy regions")
}

/// A tenant that tries to run `per_step` requests of `cost_us` CPU every step (greedy when large).
#[derive(Debug, Clone, Copy)]
pub struct Load {
    pub keyspace: u32,
    pub cost_us: u64,
    pub per_step: u32,
}

/// Per-tenant outcome of a run.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub consumed_us: Vec<u64>,
    pub granted: Vec<u64>,
    pub refused: Vec<u64>,
    pub last_refusal: Vec<Option<Refusal>>,
}

/// Runs `loads` from `start_us` for `duration_us` in steps of `step_us`; every step the agent
/// ticks, then the tenants take turns (one request each per round) allocating and immediately
/// releasing with truthful consumption, each until refused or `per_step` requests ran. Returns per-tenant consumption in the run.
pub fn run(policy: &Policy, loads: &[Load], start_us: u64, duration_us: u64, step_us: u64) -> Outcome {
    let mut out = Outcome {
        consumed_us: vec![0; loads.len()],
        granted: vec![0; loads.len()],
        refused: vec![0; loads.len()],
        last_refusal: vec![None; loads.len()],
    };
    let mut now = start_us;
    while now < start_us + duration_us {
        policy.tick(now, None);
        // Interleave tenants one request at a time (free competition, no fixed priority).
        let mut active: Vec<usize> = (0..loads.len()).collect();
        let mut done = vec![0u32; loads.len()];
        while !active.is_empty() {
            active.retain(|&i| {
                let l = loads[i];
                if done[i] >= l.per_step {
                    return false;
                }
                match policy.allocate(l.keyspace, Some(l.cost_us), now) {
                    Ok(g) => {
                        policy.release(g, l.cost_us);
                        out.consumed_us[i] += l.cost_us;
                        out.granted[i] += 1;
                        done[i] += 1;
                        true
                    }
                    Err(r) => {
                        out.refused[i] += 1;
                        out.last_refusal[i] = Some(r);
                        false
                    }
                }
            });
        }
        now += step_us;
    }
    out
}

/// 1 s warm-up (drains the initial burst-window capacity), then 1 s measured: the measured
/// per-tenant consumption.
pub fn steady(policy: &Policy, loads: &[Load]) -> Vec<u64> {
    run(policy, loads, 0, SEC, MS);
    run(policy, loads, SEC, SEC, MS).consumed_us
}

/// `|actual / expected − 1| <= tol`.
pub fn assert_close(actual: f64, expected: f64, tol: f64, what: &str) {
    let rel = (actual / expected - 1.0).abs();
    assert!(rel <= tol, "{what}: actual {actual} vs expected {expected} (rel error {rel:.4} > {tol})");
}

/// The seed's full Premium sample (`fixtures/seed_throttle_full.toml`) with
/// the key governor refuses as unsupported (`enable-qps-bytes-limiter`) and
/// `enable-pd-service-limit` (the sample names no PD endpoints) turned off:
/// burst, fair allocation, dynamic adjustment and quotas on.
pub fn throttle_full_supported() -> String {
    include_str!("../fixtures/seed_throttle_full.toml")
        .replace("enable-qps-bytes-limiter = true", "enable-qps-bytes-limiter = false")
        .replace("enable-pd-service-limit = true", "enable-pd-service-limit = false")
}
