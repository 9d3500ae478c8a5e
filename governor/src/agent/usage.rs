//! Per-keyspace CPU as the measurement cells hold it, turned into the
//! policy's usage samples (one per stats interval) and the totals status
//! reports; the run-queue waits beside it (`agent::waits`), sampled at the
//! same times.
//!
//! A keyspace cell keeps counting when the agent gives it to another
//! keyspace, so each holder's total starts from the cell's value when it got
//! the cell. Values are checked before use: a client can write the cells
//! (it charges its own intervals there), so a counter that goes backwards or
//! jumps past what the node's cores could run is noticed and clamped, never
//! wrapped into the policy. The global count adds what the servers ran
//! outside any tag (`agent::server_cpu`).

use super::server_cpu::ServersRan;
use crate::config::ValidatedConfig;
use crate::measure::Measurement;
use crate::policy::{Policy, UsageSample};
use crate::sys;
use std::collections::HashMap;
use std::sync::atomic::Ordering;

/// Beside the timer period, what a charge may trail its CPU by: a
/// scheduler tick at HZ=100, and the hypervisor's steal a thread's clock
/// can run ahead by.
const CHARGE_SLACK_NS: u64 = 20_000_000;

#[derive(Clone, Copy, Debug)]
struct Cell {
    id: u32,
    generation: u64,
    /// The cell's value at the last sample.
    last_ns: u64,
    /// What was accepted so far for this keyspace.
    total_ns: u64,
}

pub(crate) struct Usage {
    cells: HashMap<u32, Cell>,
    /// Σ of every accepted delta since start.
    global_ns: u64,
    last_sample_ns: u64,
    cores: u64,
    /// How late a charge may land after the CPU it pays for (see [`Usage::bound`]).
    lag_ns: u64,
    /// Counters found going backwards or jumping (clamped).
    pub(crate) anomalies: u64,
    /// The servers' CPU outside any tag, counted into `global_ns`.
    pub(crate) untagged_ns: u64,
    /// What the servers' coarse counters (clock ticks) fell short of their
    /// tagged CPU by, carried into the next sample (≤ 0, bounded).
    carry_ns: i64,
    /// Run-queue waits by keyspace.
    pub(crate) waits: super::waits::Waits,
}

impl Usage {
    pub(crate) fn new(cfg: &ValidatedConfig) -> Usage {
        Usage {
            cells: HashMap::new(),
            global_ns: 0,
            last_sample_ns: sys::monotonic_ns(),
            cores: sys::logical_cores() as u64,
            lag_ns: cfg.agent.timer_period.get().as_nanos() as u64 + CHARGE_SLACK_NS,
            anomalies: 0,
            untagged_ns: 0,
            carry_ns: 0,
            waits: Default::default(),
        }
    }

    /// The most a keyspace's counter can legitimately gain in `elapsed` ns:
    /// every core running it the whole time, plus what was charged late.
    /// A running thread's charges trail its CPU by up to one timer period
    /// and a scheduler tick (its runtime is brought up to date at ticks),
    /// so a gain can pay for CPU from before the interval began: a 2 s
    /// query read 2 ms after a sample gains the ~10 ms the timer still
    /// owed it.
    fn bound(&self, elapsed: u64) -> u64 {
        elapsed.saturating_add(self.lag_ns).saturating_mul(self.cores)
    }

    /// Reads every live keyspace cell and returns the interval's usage: the
    /// keyspaces' charges, and as global CPU those plus what the servers
    /// (`servers`) ran untagged.
    pub(crate) fn sample(&mut self, m: &Measurement, policy: &Policy, servers: &ServersRan) -> UsageSample {
        let now = sys::monotonic_ns();
        let waits = self.waits.sample(m, policy, now, policy.settings().window_size_us().saturating_mul(1000));
        let elapsed = now.saturating_sub(self.last_sample_ns).max(1);
        self.last_sample_ns = now;
        let bound = self.bound(elapsed);
        let r = policy.regions();
        let mut out = Vec::new();
        let mut seen = Vec::new();
        let mut tagged_by_servers = 0u64;
        for (id, c) in r.directory().live() {
            let Some(value) = m.regions.keyspaces.get(c).map(|k| k.cpu_ns.load(Ordering::Relaxed)) else { continue };
            let generation = r.keyspace_cell(c).map_or(0, |(_, p)| p.generation.load(Ordering::Acquire));
            let entry = self.cells.entry(c).or_insert(Cell { id, generation, last_ns: value, total_ns: 0 });
            if entry.generation != generation || entry.id != id {
                *entry = Cell { id, generation, last_ns: value, total_ns: 0 };
            }
            let delta = match value.checked_sub(entry.last_ns) {
                Some(d) if d <= bound => d,
                _ => {
                    self.anomalies += 1;
                    log::warn!(
                        "keyspace {id}: CPU counter moved from {} to {value} ns in {elapsed} ns; ignored (something wrote the shared cell)",
                        entry.last_ns
                    );
                    0
                }
            };
            entry.last_ns = value;
            entry.total_ns += delta;
            self.global_ns += delta;
            if !servers.rule_cells.contains(&c) {
                tagged_by_servers += delta;
            }
            seen.push(c);
            if delta > 0 {
                out.push((id, delta / 1000));
            }
        }
        self.cells.retain(|c, _| seen.contains(c));
        let untagged = self.untagged(servers, tagged_by_servers);
        self.untagged_ns += untagged;
        self.global_ns += untagged;
        UsageSample {
            global_cpu_cumulative_us: self.global_ns / 1000,
            keyspace_cpu_us: out,
            keyspace_wait_p99_us: waits.p99_us,
            keyspace_wait_behind: waits.behind,
        }
    }

    /// What the servers ran beyond their tagged CPU. Their counters move in
    /// clock ticks, the tags' by the ns: a sample where the ticks trail the
    /// tags carries the shortfall to the next, at most a tick per server
    /// (so a server gone between samples, whose last CPU nobody read,
    /// cannot hide the others' for long).
    fn untagged(&mut self, servers: &ServersRan, tagged: u64) -> u64 {
        let tick = (1_000_000_000 / procfs::ticks_per_second().max(1)) as i64;
        let diff =
            i64::try_from(servers.ns).unwrap_or(i64::MAX) - i64::try_from(tagged).unwrap_or(i64::MAX) + self.carry_ns;
        if diff >= 0 {
            self.carry_ns = 0;
            diff as u64
        } else {
            self.carry_ns = diff.max(-tick * (servers.servers as i64 + 1));
            0
        }
    }

    /// Records where a keyspace's count starts when the agent gives it a cell.
    pub(crate) fn note(&mut self, m: &Measurement, cell: u32, id: u32, generation: u64) {
        let value = m.regions.keyspaces.get(cell).map_or(0, |k| k.cpu_ns.load(Ordering::Relaxed));
        let fresh = Cell { id, generation, last_ns: value, total_ns: 0 };
        let e = self.cells.entry(cell).or_insert(fresh);
        if e.generation != generation || e.id != id {
            *e = fresh;
        }
        self.waits.note(m, cell, id, generation);
    }

    /// CPU charged to `keyspace` now: the last sample's total plus what the
    /// cell gained since (checked the same way).
    pub(crate) fn current_ns(&self, m: &Measurement, cell: u32, keyspace: u32, generation: u64) -> u64 {
        let value = |c: u32| m.regions.keyspaces.get(c).map(|k| k.cpu_ns.load(Ordering::Relaxed));
        let Some(c) = self.cells.get(&cell).filter(|c| c.id == keyspace && c.generation == generation) else {
            // Never sampled: a cell's first holder starts from zero.
            return if generation == 1 { value(cell).unwrap_or(0) } else { 0 };
        };
        let value = value(cell).unwrap_or(c.last_ns);
        let bound = self.bound(sys::monotonic_ns().saturating_sub(self.last_sample_ns));
        c.total_ns + value.checked_sub(c.last_ns).filter(|d| *d <= bound).unwrap_or(0)
    }
}
