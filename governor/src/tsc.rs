//! CLOCK_MONOTONIC from the TSC, without the vDSO call.
//!
//! The thread clock must read the timeline `bpf_ktime_get_ns` writes
//! (CLOCK_MONOTONIC). Through the vDSO that read costs ~31 ns on our VMs;
//! `rdtsc` costs ~12. The agent publishes, in the header region, an anchor
//! (TSC, CLOCK_MONOTONIC) taken every [`CALIBRATION_PERIOD`] and the rate
//! between the last two anchors; a thread extrapolates from the newest
//! anchor. The error stays within the clock's rate change over one period
//! (NTP slews by a few ppm: well under a microsecond; a clock being slewed
//! hard can be off by more, and the thread clock then falls back to the
//! vDSO whenever the TSC reading lands before the kernel's last switch),
//! and it never accumulates: the kernel's own timestamps re-anchor every
//! slice. A mapping older than three periods is not used.
//!
//! Used only where the kernel itself keeps time with a stable, synchronised
//! TSC (`clocksource` tsc, `constant_tsc` and `nonstop_tsc`); elsewhere the
//! header says "not valid" and threads use the vDSO.

use crate::region::ClockView;
use crate::sys;
use std::sync::atomic::{Ordering, fence};
use std::time::Duration;

/// How often the agent re-anchors the mapping.
pub const CALIBRATION_PERIOD: Duration = Duration::from_millis(100);

/// Whether the kernel keeps time on a stable, synchronised TSC here.
pub fn usable() -> bool {
    if sys::rdtsc().is_none() {
        return false;
    }
    let source =
        std::fs::read_to_string("/sys/devices/system/clocksource/clocksource0/current_clocksource").unwrap_or_default();
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags = cpuinfo.lines().find(|l| l.starts_with("flags")).unwrap_or("");
    let has = |f: &str| flags.split_whitespace().any(|x| x == f);
    source.trim() == "tsc" && has("constant_tsc") && has("nonstop_tsc")
}

/// CLOCK_MONOTONIC ns now, from the header's mapping; `None` when the
/// agent publishes none (the caller then uses the vDSO).
///
/// It never waits on the agent: a mapping being rewritten, or one older
/// than [`MAX_AGE_NS`] (an agent that died or stalls), reads as `None`.
#[inline]
pub fn now_ns(h: &ClockView) -> Option<u64> {
    let s1 = h.clock_seq.load(Ordering::Acquire);
    if s1 & 1 == 1 || h.clock_valid.load(Ordering::Relaxed) == 0 {
        return None;
    }
    let tsc_base = h.tsc_base.load(Ordering::Relaxed);
    let ns_base = h.ns_base.load(Ordering::Relaxed);
    let mult = h.mult.load(Ordering::Relaxed);
    fence(Ordering::Acquire);
    if h.clock_seq.load(Ordering::Relaxed) != s1 {
        return None;
    }
    let tsc = sys::rdtsc()?;
    // A TSC a few ticks behind the anchor's CPU reads as the anchor.
    let elapsed = ((tsc.saturating_sub(tsc_base) as u128 * mult as u128) >> 32) as u64;
    (elapsed <= MAX_AGE_NS).then_some(ns_base + elapsed)
}

/// Oldest anchor a thread extrapolates from: three calibration periods.
pub const MAX_AGE_NS: u64 = 3 * CALIBRATION_PERIOD.as_nanos() as u64;

/// The agent's side: anchors the mapping and publishes it.
#[derive(Default)]
pub struct Calibrator {
    last: Option<(u64, u64)>,
}

impl Calibrator {
    /// One (TSC, CLOCK_MONOTONIC) pair, from the tightest of a few tries.
    fn anchor() -> Option<(u64, u64)> {
        let mut best: Option<(u64, u64, u64)> = None;
        for _ in 0..5 {
            let a = sys::rdtsc()?;
            let ns = sys::monotonic_ns();
            let b = sys::rdtsc()?;
            let width = b.wrapping_sub(a);
            if best.is_none_or(|(w, _, _)| width < w) {
                best = Some((width, a + width / 2, ns));
            }
        }
        best.map(|(_, tsc, ns)| (tsc, ns))
    }

    /// Takes a new anchor and, from the second one on, publishes the
    /// mapping into `h`. Withdraws it if the kernel stopped keeping time on
    /// the TSC (its clocksource watchdog can switch away at run time).
    pub fn publish(&mut self, h: &ClockView) {
        if !usable() {
            Self::withdraw(h);
            self.last = None;
            return;
        }
        let Some((tsc, ns)) = Self::anchor() else { return };
        if let Some((tsc0, ns0)) = self.last
            && tsc > tsc0
            && ns > ns0
        {
            let mult = (((ns - ns0) as u128) << 32) / (tsc - tsc0) as u128;
            let seq = h.clock_seq.load(Ordering::Relaxed);
            h.clock_seq.store(seq + 1, Ordering::Relaxed);
            fence(Ordering::Release);
            h.tsc_base.store(tsc, Ordering::Relaxed);
            h.ns_base.store(ns, Ordering::Relaxed);
            h.mult.store(mult as u64, Ordering::Relaxed);
            h.clock_valid.store(1, Ordering::Relaxed);
            h.clock_seq.store(seq + 2, Ordering::Release);
        }
        self.last = Some((tsc, ns));
    }

    /// Withdraws the mapping (threads fall back to the vDSO).
    pub fn withdraw(h: &ClockView) {
        h.clock_valid.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::Table;
    use std::os::fd::AsRawFd;

    #[test]
    fn published_clock_tracks_the_vdso_within_a_microsecond() {
        if !usable() {
            eprintln!("no stable TSC clocksource here; nothing to check");
            return;
        }
        let fd = sys::memfd("h", 4096).unwrap();
        let t: Table<crate::region::HeaderView> = Table::map("header", fd.as_raw_fd(), 1).unwrap();
        let h = &t.get(0).unwrap().clock;
        let mut c = Calibrator::default();
        assert_eq!(now_ns(h), None, "no mapping before two anchors");
        c.publish(h);
        std::thread::sleep(Duration::from_millis(50));
        c.publish(h);
        let mut worst = 0i64;
        for _ in 0..20 {
            std::thread::sleep(Duration::from_millis(5));
            let a = sys::monotonic_ns();
            let ours = now_ns(h).expect("published");
            let b = sys::monotonic_ns();
            // ours should fall within [a, b], give or take the error bound.
            let err = if ours < a { a as i64 - ours as i64 } else { (ours as i64 - b as i64).max(0) };
            worst = worst.max(err);
        }
        assert!(worst < 1_000, "TSC clock off the vDSO by {worst} ns");
    }
}

/// The mapping's arithmetic on a fake TSC (the kernel-free half: no TSC
/// clocksource needed).
#[cfg(test)]
mod mapping {
    use super::*;
    use crate::region::{HeaderView, Table};
    use crate::sys::fake::{self, Fake};

    fn mapping(t: &Table<HeaderView>, tsc_base: u64, ns_base: u64, mult: u64) -> &ClockView {
        let h = &t.get(0).expect("header").clock;
        h.tsc_base.store(tsc_base, Ordering::Relaxed);
        h.ns_base.store(ns_base, Ordering::Relaxed);
        h.mult.store(mult, Ordering::Relaxed);
        h.clock_valid.store(1, Ordering::Relaxed);
        h.clock_seq.store(2, Ordering::Relaxed);
        h
    }

    #[test]
    fn a_thread_extrapolates_from_the_newest_anchor_at_the_published_rate() {
        let t = Table::zeroed(1);
        // 2.5 TSC ticks per ns: mult = 2^32 / 2.5.
        let h = mapping(&t, 1_000_000, 7_000_000_000, (1u64 << 32) * 2 / 5);
        let _f = fake::install(Fake { tsc: Some(Some(1_000_000 + 2_500_000)), ..Default::default() });
        assert_eq!(now_ns(h), Some(7_000_000_000 + 1_000_000 - 1), "2.5 M ticks are 1 ms (rounded down)");
        // A TSC a little behind the anchor's CPU reads as the anchor.
        fake::set(|f| f.tsc = Some(Some(999_990)));
        assert_eq!(now_ns(h), Some(7_000_000_000));
    }

    #[test]
    fn a_mapping_being_rewritten_withdrawn_stale_or_without_a_tsc_is_not_used() {
        let t = Table::zeroed(1);
        let h = mapping(&t, 0, 1_000, 1u64 << 32);
        let _f = fake::install(Fake { tsc: Some(Some(MAX_AGE_NS)), ..Default::default() });
        assert_eq!(now_ns(h), Some(1_000 + MAX_AGE_NS), "three periods old: still used");
        fake::set(|f| f.tsc = Some(Some(MAX_AGE_NS + 1)));
        assert_eq!(now_ns(h), None, "older than three periods: the agent stalls");
        fake::set(|f| f.tsc = Some(Some(10)));
        h.clock_seq.store(3, Ordering::Relaxed);
        assert_eq!(now_ns(h), None, "odd sequence: the agent is rewriting it");
        h.clock_seq.store(4, Ordering::Relaxed);
        assert_eq!(now_ns(h), Some(1_010));
        Calibrator::withdraw(h);
        assert_eq!(now_ns(h), None, "withdrawn");
        h.clock_valid.store(1, Ordering::Relaxed);
        fake::set(|f| f.tsc = Some(None));
        assert_eq!(now_ns(h), None, "no TSC on this machine");
    }
}
