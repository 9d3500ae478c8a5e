//! A tenant cap in CPU, not in tokens: the refill of a capped keyspace
//! follows what the kernel charged it.
//!
//! Tokens are taken ahead of the CPU they pay for: a ticket holds its
//! estimate and tops up before it runs out, so the tokens a capped tenant's
//! running requests hold unspent rise and fall with how many run and how
//! far each got. A fixed refill makes the *tokens* follow the cap; the CPU
//! of a 1 s window is those tokens less the growth of that inventory, which
//! moved a window by up to 8 % in the goodput workload (8 requests of
//! 1–20 ms at 0.5 core). Tickets also pay by the thread clock, which counts
//! what the hypervisor stole inside a slice, so under steal the kernel's
//! count ran below the cap.
//!
//! [`CpuFollow`] keeps the cumulative gap between the cap and the kernel's
//! charge of the keyspace (`cpu_ns` of its measurement cell, read every
//! refill interval), and adds half of it to the next refill (or takes it
//! away, down to nothing). That is integral control on the CPU: it cancels
//! the inventory's swings (the gap is what the inventory grew by lately)
//! and any steady leak such as steal, so the kernel's count, not the
//! tokens, follows the cap. Bounds:
//! - the gap is counted only while the tenant is held back by its cap (its
//!   bucket below half its capacity, and requests in line or at least half
//!   the refill run); an idle or light tenant, or one living on a full
//!   bucket, forfeits what it did not use (unused cap is not owed), while
//!   CPU it ran beyond its refill (a burst from its bucket) is still paid
//!   back; and what it held back while it started (the first burst window
//!   of refills after it was last not held back) is its working stock of
//!   tokens, not a swing, so not made up: a tenant back from idle takes no
//!   more than its cap plus its bucket in its first second;
//! - the gap stays within one bucket capacity either way, so a client that
//!   scribbles on the (client-writable) counter moves the refill by at most
//!   that.

/// The refill correction of one tenant-capped keyspace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuFollow {
    /// The keyspace's charge at the last refill, ns (`None` until read).
    seen_ns: Option<u64>,
    /// Cap less charged CPU, cumulative while held back, µs.
    gap_us: i64,
    /// Refills since the tenant was last not held back, µs of refill.
    held_us: u64,
}

impl CpuFollow {
    /// The tokens to add for `target_us` of refill (the cap's share of the
    /// elapsed intervals) given the keyspace's charge now (`cpu_ns`, `None`
    /// where it cannot be read: no correction), what its bucket has
    /// available before the refill and its capacity.
    pub fn amount(&mut self, target_us: u64, cpu_ns: Option<u64>, available_us: i64, capacity_us: u64) -> u64 {
        let Some(now) = cpu_ns else {
            *self = CpuFollow::default();
            return target_us;
        };
        let Some(seen) = self.seen_ns.replace(now) else { return target_us };
        let bound = i64::try_from(capacity_us).unwrap_or(i64::MAX);
        let used = i64::try_from(now.saturating_sub(seen) / 1000).unwrap_or(i64::MAX).min(bound.saturating_mul(4));
        let target = i64::try_from(target_us).unwrap_or(i64::MAX);
        let gap = self.gap_us.saturating_add(target).saturating_sub(used);
        // Held back by its cap: its bucket is low, and it waits in line or
        // ran at least half its refill. Otherwise (idle, light, or living
        // on a full bucket) what it left unused is not owed.
        let held_back =
            available_us.saturating_mul(2) < bound && (available_us < 0 || used.saturating_mul(2) >= target);
        // The stock of tokens a tenant builds as it starts (its first burst
        // window of refills held back) is not a swing: not made up.
        self.held_us = if held_back { self.held_us.saturating_add(target_us) } else { 0 };
        let settled = self.held_us > capacity_us;
        self.gap_us = if held_back && settled { gap } else { gap.min(0) }.clamp(-bound, bound);
        target.saturating_add(self.gap_us / 2).max(0) as u64
    }

    /// The correction the last refill applied, µs (cap less charged CPU,
    /// cumulative while held back).
    pub fn gap_us(&self) -> i64 {
        self.gap_us
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: u64 = 50_000;
    const MS: u64 = 1_000_000;

    /// A tenant held back (a line) that ran exactly its refill for a burst
    /// window and a bit: its charge is `11 × 5 ms`.
    fn settled() -> CpuFollow {
        let mut f = CpuFollow::default();
        f.amount(5_000, Some(0), -1_000, CAP);
        for i in 1..=11 {
            assert_eq!(f.amount(5_000, Some(i * 5 * MS), -1_000, CAP), 5_000);
        }
        f
    }

    #[test]
    fn the_first_reading_only_sets_the_base() {
        let mut f = CpuFollow::default();
        assert_eq!(f.amount(5_000, Some(9_000 * MS), -1_000, CAP), 5_000);
        assert_eq!(f.gap_us(), 0);
    }

    #[test]
    fn cpu_below_the_refill_while_held_back_raises_the_next_refill() {
        let mut f = settled();
        // Held back (a line), but only 3 ms ran for 5 ms of tokens: the
        // inventory grew by 2 ms.
        assert_eq!(f.amount(5_000, Some(58 * MS), -1_000, CAP), 6_000);
        // Then 7 ms ran (the inventory spent): back to the cap.
        assert_eq!(f.amount(5_000, Some(65 * MS), -1_000, CAP), 5_000);
        assert_eq!(f.gap_us(), 0);
    }

    #[test]
    fn a_starting_tenants_stock_is_not_made_up() {
        let mut f = CpuFollow::default();
        f.amount(5_000, Some(0), -1_000, CAP);
        // Starting: 2 ms of each refill go into its tickets' stock.
        for i in 1..=10 {
            assert_eq!(f.amount(5_000, Some(i * 3 * MS), -1_000, CAP), 5_000);
        }
        assert_eq!(f.gap_us(), 0);
        // Past a burst window, a swing is.
        assert_eq!(f.amount(5_000, Some(33 * MS), -1_000, CAP), 6_000);
    }

    #[test]
    fn cpu_above_the_refill_lowers_it_never_below_nothing() {
        let mut f = settled();
        assert_eq!(f.amount(5_000, Some(80 * MS), -1_000, CAP), 0);
        assert_eq!(f.gap_us(), -20_000);
        // Paid back even once the tenant is not held back, and while it
        // starts again.
        assert_eq!(f.amount(5_000, Some(80 * MS), 40_000, CAP), 0);
        assert_eq!(f.gap_us(), -15_000);
        let mut g = CpuFollow::default();
        g.amount(5_000, Some(0), -1_000, CAP);
        assert_eq!(g.amount(5_000, Some(9 * MS), -1_000, CAP), 3_000);
    }

    #[test]
    fn a_tenant_not_held_back_is_owed_nothing() {
        let mut f = settled();
        f.amount(5_000, Some(56 * MS), -1_000, CAP);
        assert_eq!(f.gap_us(), 4_000);
        // Its bucket fills: the gap of the unused cap is dropped.
        assert_eq!(f.amount(5_000, Some(56 * MS), 30_000, CAP), 5_000);
        assert_eq!(f.gap_us(), 0);
        // Idle, its bucket trimmed to one interval (a capped bucket with
        // nothing in flight), or light: never a hoard.
        let (mut idle, mut light) = (CpuFollow::default(), CpuFollow::default());
        idle.amount(5_000, Some(0), 5_000, CAP);
        light.amount(5_000, Some(0), 5_000, CAP);
        for i in 1..=100u64 {
            assert_eq!(idle.amount(5_000, Some(0), 5_000, CAP), 5_000);
            assert_eq!(light.amount(5_000, Some(i * MS), 5_000, CAP), 5_000);
        }
        assert_eq!((idle.gap_us(), light.gap_us()), (0, 0));
    }

    #[test]
    fn the_gap_is_bounded_by_a_capacity_and_unreadable_counters_reset_it() {
        let mut f = settled();
        // A scribbled counter (a jump of hours).
        assert_eq!(f.amount(5_000, Some(u64::MAX / 2), -1_000, CAP), 0);
        assert_eq!(f.gap_us(), -(CAP as i64));
        assert_eq!(f.amount(5_000, None, -1_000, CAP), 5_000);
        assert_eq!(f.gap_us(), 0);
    }
}
