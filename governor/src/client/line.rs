//! Waiting in line on a blocking thread: the futex waits for CPU tokens
//! (a new admission, a running ticket's top-up), bounded by a deadline and
//! by the agent's liveness, and the charge of that wait's CPU to its
//! keyspace.

use super::attachment::Attachment;
use super::error::Refused;
use crate::policy::{Grant, Knobs, Progress, Queued};
use crate::sys;
use keyspace_governor_common::admission::counter;
use keyspace_governor_common::tag_for_cell;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// A heartbeat older than this means no agent runs the policy any more.
pub const FAIL_OPEN_AFTER: Duration = Duration::from_millis(500);

/// Longest single sleep of a waiter: it checks that the agent lives this
/// often (refills and refunds wake it sooner).
pub(crate) const LIVENESS_CHECK: Duration = Duration::from_millis(100);

/// Whether the agent behind `att` runs its policy loop: attached, and its
/// heartbeat fresh. Reads a clock: only on slow paths.
pub(crate) fn agent_alive(att: &Attachment) -> bool {
    if !att.alive() {
        return false;
    }
    let hb = att.admission.header().agent.heartbeat_ns.load(Ordering::Relaxed);
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
/// any) passes, or the agent is found gone. Also returns how long it waited.
pub(crate) fn wait_in_line(
    att: &Attachment,
    k: &Knobs,
    mut q: Queued,
    deadline: Option<Instant>,
) -> (Waited, Duration) {
    let r = &att.admission;
    let start = Instant::now();
    let mut waited_at_all = false;
    let (cell, granted_hist, refused_hist) = (q.cell(), q.wait_hist(true), q.wait_hist(false));
    loop {
        match q.poll(r, k) {
            Progress::Ready(g) => {
                let waited = if waited_at_all { start.elapsed() } else { Duration::ZERO };
                if waited_at_all {
                    count_wait(att, &g, waited);
                    r.counted_on(cell).observe_wait(granted_hist, waited);
                }
                return (Waited::Granted(g), waited);
            }
            Progress::Waiting { bucket, pos } => {
                let now = Instant::now();
                if deadline.is_some_and(|d| now >= d) {
                    r.counted_on(cell).observe_wait(refused_hist, now - start);
                    let reason = q.cancel(r);
                    return (Waited::Refused(Refused { reason, waited: now - start }), now - start);
                }
                if !agent_alive(att) {
                    let _ = q.cancel(r);
                    return (Waited::FailOpen, now - start);
                }
                waited_at_all = true;
                let sleep = deadline.map_or(LIVENESS_CHECK, |d| (d - now).min(LIVENESS_CHECK));
                r.bucket(bucket).wait_for(pos, sleep);
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

fn count_wait(att: &Attachment, g: &Grant, waited: Duration) {
    let b = att.admission.counted_on(g.cell());
    b.count(counter::WAITED, 1);
    b.count(counter::WAIT_US, waited.as_micros() as u64);
}
