//! Waiting in line on a blocking thread: the futex waits for CPU tokens
//! (a new admission, a running ticket's top-up), bounded by a deadline and
//! by the agent's liveness, and the charge of that wait's CPU to its
//! keyspace.

use super::attachment::Attachment;
use super::error::Refused;
use crate::policy::{Grant, Knobs, Progress, Queued};
use crate::region::AdmissionRegions;
use crate::sys;
use keyspace_governor_common::admission::counter;
use keyspace_governor_common::tag_for_cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A heartbeat older than this means no agent runs the policy any more.
pub const FAIL_OPEN_AFTER: Duration = Duration::from_millis(500);

/// Longest single sleep of a waiter: it checks that the agent lives this
/// often (refills and refunds wake it sooner).
pub(crate) const LIVENESS_CHECK: Duration = Duration::from_millis(100);

/// Whether the agent behind `att` runs its policy loop: attached, and its
/// heartbeat fresh. Reads a clock: only on slow paths.
pub(crate) fn agent_alive(att: &Attachment) -> bool {
    att.alive() && heartbeat_fresh(&att.admission)
}

/// Whether the agent publishing `r` beat its heart within
/// [`FAIL_OPEN_AFTER`].
fn heartbeat_fresh(r: &AdmissionRegions) -> bool {
    let hb = r.header().agent.heartbeat_ns.load(Ordering::Relaxed);
    sys::monotonic_ns().saturating_sub(hb) < FAIL_OPEN_AFTER.as_nanos() as u64
}

/// What waiting in line ended with.
pub(crate) enum Waited {
    Granted(Grant),
    Refused(Refused),
    /// The agent went away meanwhile: admit without a check.
    FailOpen,
}

/// Waits on the buckets' futex words until `q` is served, `deadline` (if
/// any) passes, or the agent is found gone; while asleep, ledger record
/// `record` (the request's or its ticket's) says so, so the agent takes the
/// sleep's counts back if the client dies meanwhile. Also returns how long
/// it waited.
pub(crate) fn wait_in_line(
    att: &Attachment,
    k: &Knobs,
    q: Queued,
    deadline: Option<Instant>,
    record: u32,
) -> (Waited, Duration) {
    let flags = att.ledger.get(record).map(|r| &r.flags);
    wait_on(&att.admission, &|| att.alive(), k, q, deadline, flags)
}

/// [`wait_in_line`] on the regions `r` of an agent that `attached` says is
/// still the one they came from.
fn wait_on(
    r: &AdmissionRegions,
    attached: &dyn Fn() -> bool,
    k: &Knobs,
    mut q: Queued,
    deadline: Option<Instant>,
    record: Option<&AtomicU64>,
) -> (Waited, Duration) {
    let start = Instant::now();
    let mut waited_at_all = false;
    let (cell, granted_hist, refused_hist, top_up) = (q.cell(), q.wait_hist(true), q.wait_hist(false), q.is_top_up());
    loop {
        match q.poll(r, k) {
            Progress::Ready(g) => {
                let waited = if waited_at_all { start.elapsed() } else { Duration::ZERO };
                if waited_at_all {
                    count_wait(r, &g, waited, top_up);
                    r.counted_on(cell).observe_wait(granted_hist, waited);
                }
                return (Waited::Granted(g), waited);
            }
            Progress::Waiting { bucket, pos } => {
                let now = Instant::now();
                if deadline.is_some_and(|d| now >= d) {
                    r.counted_on(cell).observe_wait(refused_hist, now - start);
                    let reason = q.cancel(r);
                    return (Waited::Refused(Refused::new(reason, now - start, cell)), now - start);
                }
                if !(attached() && heartbeat_fresh(r)) {
                    let _ = q.cancel(r);
                    return (Waited::FailOpen, now - start);
                }
                waited_at_all = true;
                let sleep = deadline.map_or(LIVENESS_CHECK, |d| (d - now).min(LIVENESS_CHECK));
                r.bucket(bucket).wait_recorded(pos, sleep, record.map(|f| (f, bucket)));
            }
        }
    }
}

/// Runs `f` with the calling thread tagged with keyspace cell `cell`, on
/// its registration with `att`'s agent: the CPU of admission work (a
/// place in line polled, a top-up waited for) goes to the keyspace it
/// admits, as the work itself does. Returns that CPU by the thread clock
/// (0, and no tag, on a thread without such a registration).
pub(crate) fn charged<R>(att: &Attachment, cell: Option<u32>, f: impl FnOnce() -> R) -> (R, u64) {
    let started = cell.and_then(|c| {
        super::with_ctx(|ctx| {
            (ctx.att.epoch == att.epoch).then(|| {
                let th = ctx.thread();
                let (old, t) = th.switch_tag(tag_for_cell(c));
                (old, if t == 0 { th.clock() } else { t })
            })
        })
        .ok()
        .flatten()
        .flatten()
    });
    let out = f();
    let Some((prev, t0)) = started else { return (out, 0) };
    let t1 = super::with_ctx(|ctx| {
        let th = ctx.thread();
        let (_, t) = th.switch_tag(prev);
        if t == 0 { th.clock() } else { t }
    })
    .ok()
    .flatten()
    .unwrap_or(t0);
    (out, t1.saturating_sub(t0))
}

/// Counts a wait that ended in a grant: an admission's, or a running
/// request's for a top-up (its pacing), apart.
pub(crate) fn count_wait(r: &AdmissionRegions, g: &Grant, waited: Duration, top_up: bool) {
    let b = r.counted_on(g.cell());
    let (n, us) =
        if top_up { (counter::TOPUP_WAITED, counter::TOPUP_WAIT_US) } else { (counter::WAITED, counter::WAIT_US) };
    b.count(n, 1);
    b.count(us, waited.as_micros() as u64);
}

/// Waiting in line through the seam's double: the futex sleeps are the
/// test's (it plays the agent's refills and the clock while the thread
/// would sleep), the regions plain memory with no agent behind them.
#[cfg(test)]
mod tests {
    use super::{FAIL_OPEN_AFTER, LIVENESS_CHECK, Waited, wait_on};
    use crate::policy::{Demand, Knobs, Refusal, acquire_queued};
    use crate::region::{AdmissionMemory, CellRef, GLOBAL};
    use crate::sys::fake::{self, Fake};
    use keyspace_governor_common::admission::{KNOB_ENABLED, KNOB_THROTTLE, P_CAP, P_THROTTLED, counter};
    use std::cell::RefCell;
    use std::rc::Rc;
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    /// CLOCK_MONOTONIC as the double reads it, and the agent's last beat.
    const NOW: u64 = 5_000_000_000;
    /// Keyspace cell 0 as given to the keyspace (generation 0 is no cell's).
    const CELL: CellRef = CellRef { index: 0, generation: 1 };
    const EST: u64 = 1000;
    /// Token µs of the request in line ahead.
    const AHEAD: u64 = 3072;
    /// Where the request's place ends: behind the one ahead.
    const PLACE: u64 = AHEAD + EST;

    /// Regions with keyspace cell 0 capped and empty, `AHEAD` µs of
    /// another request in line ahead, the global bucket full, the agent's
    /// heart beating at `NOW`; knobs that throttle; and the request in line.
    fn in_line() -> (Arc<AdmissionMemory>, Knobs, crate::policy::Queued) {
        let m = Arc::new(AdmissionMemory::create(16).unwrap());
        let (tenant, params) = m.regions.keyspace_cell(0).unwrap();
        params.generation.store(CELL.generation, Ordering::Relaxed);
        params.flags.store(P_THROTTLED | P_CAP, Ordering::Relaxed);
        params.capacity_us.store(100_000, Ordering::Relaxed);
        let _ahead = tenant.reserve(AHEAD);
        m.regions.bucket(GLOBAL).give(1_000_000, 1_000_000);
        m.regions.header().agent.heartbeat_ns.store(NOW, Ordering::Relaxed);
        let k = Knobs { flags: KNOB_ENABLED | KNOB_THROTTLE, default_estimate_us: EST, ..Default::default() };
        let q = acquire_queued(&m.regions, &k, 7, Some(CELL), &Demand::new(), None).unwrap();
        assert_eq!(tenant.available_us(), -(PLACE as i64));
        (m, k, q)
    }

    /// Each sleep the waiter asked for: (its place's bits, its timeout, ns).
    type Sleeps = Rc<RefCell<Vec<(u32, u64)>>>;

    /// Installs the double: `on_sleep(n, timeout)` runs at the waiter's
    /// n-th sleep, instead of the sleep.
    fn installed(mut on_sleep: impl FnMut(usize, Duration) + 'static) -> (fake::Installed, Sleeps) {
        let sleeps: Sleeps = Rc::default();
        let log = sleeps.clone();
        let wait = move |bits: u32, deadline: u64| {
            let timeout = deadline - crate::sys::monotonic_ns();
            log.borrow_mut().push((bits, timeout));
            let n = log.borrow().len();
            on_sleep(n, Duration::from_nanos(timeout));
        };
        let f = Fake {
            monotonic_ns: Some(NOW),
            futex_wait: Some(Box::new(wait)),
            wakes: Some(Vec::new()),
            ..Default::default()
        };
        (fake::install(f), sleeps)
    }

    #[test]
    fn a_request_sleeps_in_its_slot_until_a_refill_reaches_its_place() {
        let (m, k, q) = in_line();
        let m2 = m.clone();
        let (_f, sleeps) = installed(move |n, _| {
            // The agent's refills: the first serves those ahead only, the
            // second reaches this place.
            let tenant = m2.regions.keyspace_cell(0).unwrap().0;
            tenant.give(if n == 1 { 2048 } else { AHEAD }, 100_000);
        });
        let (done, waited) = wait_on(&m.regions, &|| true, &k, q, None, None);
        let Waited::Granted(g) = done else { panic!("not granted") };
        assert_eq!((g.tenant_us(), g.global_us()), (EST, EST));
        assert!(waited > Duration::ZERO && waited < Duration::from_secs(1), "{waited:?}");
        // Two sleeps, each on the bit of the first slot alone, each a
        // liveness check long (no deadline was given).
        let place = 1;
        assert_eq!(*sleeps.borrow(), vec![(place, LIVENESS_CHECK.as_nanos() as u64); 2]);
        // The first refill reached no sleeper's place: no wake at all (a
        // real futex leaves the waiter asleep); the second woke this place
        // alone.
        assert_eq!(fake::take_wakes(), vec![place]);
        let tenant = m.regions.keyspace_cell(0).unwrap().0;
        assert_eq!(tenant.sleep_at[0].load(Ordering::Relaxed), 0, "its slot was freed");
        assert_eq!((tenant.counter(counter::WAITED), tenant.sleepers.load(Ordering::Relaxed)), (1, 0));
    }

    #[test]
    fn a_top_up_that_waits_is_counted_apart_from_admissions_that_waited() {
        let (m, k, q) = in_line();
        let m2 = m.clone();
        // Each refill reaches the place of whoever is in line.
        let (_f, _) = installed(move |_, _| {
            m2.regions.keyspace_cell(0).unwrap().0.give(PLACE, 100_000);
        });
        let (done, _) = wait_on(&m.regions, &|| true, &k, q, None, None);
        let Waited::Granted(g) = done else { panic!("not granted") };
        // The running request needs more, and its bucket is empty: its
        // top-up (one that gives up at a deadline, so not served ahead)
        // waits in line too.
        let tenant = m.regions.keyspace_cell(0).unwrap().0;
        let _empty = tenant.reserve(tenant.available_us().max(0) as u64);
        let t = crate::policy::top_up_queued(&m.regions, &k, &g, EST, false);
        let (done, waited) = wait_on(&m.regions, &|| true, &k, t, None, None);
        assert!(matches!(done, Waited::Granted(_)), "the top-up was not granted");
        assert!(waited > Duration::ZERO, "the top-up did not wait");
        assert_eq!((tenant.counter(counter::WAITED), tenant.counter(counter::TOPUP_WAITED)), (1, 1));
        assert!(tenant.counter(counter::TOPUP_WAIT_US) <= waited.as_micros() as u64 + 1);
    }

    #[test]
    fn a_deadline_that_passes_in_line_refuses_and_gives_the_place_back() {
        let (m, k, q) = in_line();
        // No refill comes: each sleep runs to its timeout, as the kernel's.
        let (_f, sleeps) = installed(|_, timeout| std::thread::sleep(timeout));
        let deadline = Instant::now() + Duration::from_millis(30);
        let (done, waited) = wait_on(&m.regions, &|| true, &k, q, Some(deadline), None);
        let Waited::Refused(refused) = done else { panic!("not refused") };
        assert_eq!(refused.reason, Refusal::TenantCpuExhausted { keyspace: 7 });
        assert!(waited >= Duration::from_millis(30) && waited < Duration::from_secs(1), "{waited:?}");
        // One sleep, to the deadline rather than a liveness check.
        let first = sleeps.borrow().first().map(|s| s.1).unwrap_or(0);
        assert!((20_000_000..=30_000_000).contains(&first), "{:?}", sleeps.borrow());
        // Its place left the line: only the request ahead is left in it.
        let tenant = m.regions.keyspace_cell(0).unwrap().0;
        assert_eq!(tenant.available_us(), -((AHEAD) as i64));
        assert_eq!((tenant.counter(counter::WAITED), tenant.sleepers.load(Ordering::Relaxed)), (0, 0));
    }

    #[test]
    fn an_agent_whose_heart_stops_while_one_waits_admits_fail_open() {
        let (m, k, q) = in_line();
        // While the request sleeps, the agent misses its beats.
        let stale = NOW + FAIL_OPEN_AFTER.as_nanos() as u64 + 1_000_000;
        let (_f, sleeps) = installed(move |_, _| fake::set(|f| f.monotonic_ns = Some(stale)));
        let (done, _) = wait_on(&m.regions, &|| true, &k, q, None, None);
        assert!(matches!(done, Waited::FailOpen), "not fail-open");
        assert_eq!(sleeps.borrow().len(), 1);
        let tenant = m.regions.keyspace_cell(0).unwrap().0;
        assert_eq!(tenant.available_us(), -((AHEAD) as i64), "its place left the line");
    }

    #[test]
    fn a_detached_agent_admits_fail_open_without_a_sleep() {
        let (m, k, q) = in_line();
        let (_f, sleeps) = installed(|_, _| panic!("slept on a detached agent's bucket"));
        let (done, _) = wait_on(&m.regions, &|| false, &k, q, None, None);
        assert!(matches!(done, Waited::FailOpen), "not fail-open");
        assert!(sleeps.borrow().is_empty());
        let tenant = m.regions.keyspace_cell(0).unwrap().0;
        assert_eq!(tenant.available_us(), -((AHEAD) as i64), "its place left the line");
    }
}
