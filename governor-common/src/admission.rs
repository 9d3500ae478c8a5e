//! Layouts of the admission regions: what the agent publishes (header,
//! per-keyspace parameters and directory), the token buckets every client
//! takes from, and each client's own ledger of the tickets it holds.
//!
//! Who writes what decides where each field lives, because a region is
//! either writable by every client or by none:
//!
//! - [`HeaderPage`] and [`ParamsCell`]s: agent only; clients map them
//!   read-only (sealed memfds). A client cannot move another keyspace's cell,
//!   fake a heartbeat or change a limit.
//! - [`BucketCell`]s: every client takes and returns tokens here by CAS, so
//!   every client can write them; the agent clamps what it reads back.
//! - [`TicketRecord`]s: one ledger per client connection, writable by that
//!   client alone; the agent reads it to return what a dead client held.

use core::mem::{align_of, size_of};

/// `KnobsCell::flags`: resource control on (off: admit everything).
pub const KNOB_ENABLED: u64 = 1 << 0;
/// CPU token buckets act (`cpu-throttle.enabled`).
pub const KNOB_THROTTLE: u64 = 1 << 1;
/// The global bucket refuses (`enforce-global-limit`, always in cap mode).
pub const KNOB_ENFORCE_GLOBAL: u64 = 1 << 2;
/// Keyspaces may burst on global tokens (`enable-burst`, never in cap mode).
pub const KNOB_BURST: u64 = 1 << 3;
/// Initial estimates are capped and running tickets top up
/// (`enable-runtime-token-management`).
pub const KNOB_RUNTIME_TOPUP: u64 = 1 << 4;
/// Uniform tenant cap (`tenant-max-cpu-ratio > 0`): unknown keyspaces get a
/// cap bucket instead of passing unthrottled.
pub const KNOB_CAP_MODE: u64 = 1 << 5;
/// Count requested µs per keyspace for fair allocation.
pub const KNOB_TRACK_DEMAND: u64 = 1 << 6;
/// Admission control counts in-flight requests and records breaches.
pub const KNOB_ADMISSION_MONITOR: u64 = 1 << 7;
/// Admission control refuses over the limit.
pub const KNOB_ADMISSION_ENFORCED: u64 = 1 << 8;

/// `ParamsCell::flags`: the keyspace has a token bucket (quota or cap);
/// without it a keyspace passes the CPU check unthrottled.
pub const P_THROTTLED: u64 = 1 << 0;
/// The bucket is a uniform tenant-cap bucket (no burst, ever).
pub const P_CAP: u64 = 1 << 1;
/// `keyspace-burst-enabled` for this keyspace.
pub const P_BURST_ENABLED: u64 = 1 << 2;
/// Published each stats interval: the burst conditions hold now.
pub const P_BURST_ALLOWED: u64 = 1 << 3;
/// A quota shrink left more in flight than the new quota: refunds make no
/// tokens available until in-flight drains (the agent lifts it).
pub const P_SHRINK_DEBT: u64 = 1 << 4;

/// Directory states (`ParamsCell::key >> 32`).
pub const DIR_EMPTY: u32 = 0;
pub const DIR_LIVE: u32 = 1;
/// A keyspace was evicted from this cell: probes continue past it.
pub const DIR_TOMBSTONE: u32 = 2;

/// Ticket record states.
pub const TICKET_FREE: u32 = 0;
/// Granted: the agent returns what it holds if the client dies.
pub const TICKET_HELD: u32 = 1;
/// Claimed by a thread that is still filling it in (or still waiting for
/// its grant): holds nothing yet.
pub const TICKET_CLAIMED: u32 = 2;
/// `TicketRecord::flags`: the ticket counts in its keyspace's in-flight
/// requests.
pub const T_COUNTED: u64 = 1 << 0;
/// `TicketRecord::flags`: no ticket, a thread's spare tokens
/// (`tenant_us` = `global_us`, taken from cell `cell − 1` and the global
/// bucket): the agent gives them back when the client dies.
pub const T_SPARE: u64 = 1 << 1;
/// `TicketRecord::flags`: the sleepers counted in the bucket that bits
/// 32–63 name ([`asleep_flags`]) are also counted in its
/// `BucketCell::unslotted`.
pub const T_UNSLOTTED: u64 = 1 << 31;
/// `TicketRecord::flags`, bits 8–30: how many sleepers the record's owner
/// counted in `BucketCell::sleepers` of the bucket named by bits 32–63.
const T_ASLEEP_COUNT_SHIFT: u32 = 8;
const T_ASLEEP_COUNT_MAX: u64 = (1 << 23) - 1;
const T_ASLEEP_BUCKET_SHIFT: u32 = 32;

/// The `TicketRecord::flags` bits that say a record's owner counted
/// `count` sleepers in bucket `bucket` (and in its crowd too, when
/// `unslotted`): what the agent takes back off the bucket's counts when the
/// client dies before it does. Or them into the flags after the counts
/// went up, clear them before they go down (a client killed in between
/// leaves a count behind, never takes one that is not its own).
#[inline]
pub const fn asleep_flags(bucket: u32, count: u64, unslotted: bool) -> u64 {
    let count = if count > T_ASLEEP_COUNT_MAX { T_ASLEEP_COUNT_MAX } else { count };
    ((bucket as u64 + 1) << T_ASLEEP_BUCKET_SHIFT)
        | count << T_ASLEEP_COUNT_SHIFT
        | if unslotted { T_UNSLOTTED } else { 0 }
}

/// The bits of [`asleep_flags`].
pub const T_ASLEEP_MASK: u64 = !((1 << T_ASLEEP_COUNT_SHIFT) - 1);

/// What [`asleep_flags`] wrote: (bucket, count, unslotted), or `None`.
#[inline]
pub const fn asleep_of(flags: u64) -> Option<(u32, u64, bool)> {
    let bucket = (flags >> T_ASLEEP_BUCKET_SHIFT) as u32;
    if bucket == 0 {
        return None;
    }
    Some((bucket - 1, (flags >> T_ASLEEP_COUNT_SHIFT) & T_ASLEEP_COUNT_MAX, flags & T_UNSLOTTED != 0))
}

/// Tickets one client connection can hold at once.
pub const LEDGER_LEN: u32 = 8192;

/// Indexes into `BucketCell::counters`. Every ticket updates the first
/// [`HOT`](counter::HOT): those live in the cell's per-thread shards
/// ([`BucketCell::hot`]), not in `counters`.
pub mod counter {
    /// Counters below this index are sharded.
    pub const HOT: usize = 3;
    pub const GRANTED: usize = 0;
    pub const RELEASED: usize = 1;
    /// Measured CPU of released tickets, µs.
    pub const CONSUMED_US: usize = 2;
    pub const REFUSED_WRITE_KEYSPACE: usize = 3;
    pub const REFUSED_WRITE_GLOBAL: usize = 4;
    pub const REFUSED_CONCURRENCY: usize = 5;
    /// Monitor mode: would have been refused, admitted anyway.
    pub const MONITOR_BREACHES: usize = 6;
    pub const BURST_GRANTED: usize = 7;
    pub const BURST_US: usize = 8;
    pub const TOPUP_GRANTED: usize = 9;
    pub const TOPUP_REFUSED: usize = 10;
    /// Refused by a uniform tenant-cap bucket.
    pub const REFUSED_CAP: usize = 11;
    /// Refused by the global bucket (on the low-priority bucket: by itself).
    pub const REFUSED_GLOBAL: usize = 12;
    /// Estimated µs asked for (granted or not): fair allocation's demand.
    pub const DEMAND_US: usize = 13;
    /// Acquires that had to wait in line before admission, and how long
    /// they waited in all, µs.
    pub const WAITED: usize = 14;
    pub const WAIT_US: usize = 15;
    /// Admitted without a check because the agent was gone.
    pub const FAIL_OPEN: usize = 16;
    /// Overrun charged as debt, µs.
    pub const DEBT_US: usize = 17;
    /// Requests the server's thread pool rejected (reported by the server):
    /// kept apart from admission refusals, and feeding no scaling rule.
    pub const POOL_REJECTED: usize = 18;
    /// Overrun beyond the bucket's debt bound, not charged, µs.
    pub const DEBT_FORGIVEN_US: usize = 19;
    /// Admitted with no bucket (no quota, no cap): legacy skip-throttle.
    pub const SKIPPED: usize = 20;
    /// Returned by the agent from a dead client's ledger.
    pub const RECLAIMED: usize = 21;
    /// Global bucket only: grants that overdrew it in best-effort mode.
    pub const OVERDRAFT: usize = 22;
    /// Refused by a configured (or PD) keyspace quota that could not burst.
    pub const REFUSED_QUOTA: usize = 23;
    /// Given back above capacity and dropped, µs.
    pub const DISCARDED_US: usize = 24;
    /// Taken ahead of the line by running requests' top-ups, µs.
    pub const AHEAD_US: usize = 25;
    /// Waits of running requests for a top-up at a checkpoint (pacing),
    /// and how long they waited in all, µs.
    pub const TOPUP_WAITED: usize = 26;
    pub const TOPUP_WAIT_US: usize = 27;
    pub const COUNT: usize = 32;
}

/// How long acquires waited in line, per bucket: the seed's
/// `tikv_cpu_token_wait_duration_seconds` and
/// `tikv_cpu_token_runtime_wait_duration_seconds`, by result. Each
/// histogram is [`SLOTS`] counters: one per bound, one past the last (+Inf),
/// and the sum of µs. Written by the client when a wait ends (never on the
/// fast path: acquires served at once are the counters' difference).
pub mod hist {
    /// Upper bounds of the wait buckets, µs.
    pub const BOUNDS_US: [u64; 12] =
        [500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000, 2_500_000];
    /// Counters per histogram.
    pub const SLOTS: usize = BOUNDS_US.len() + 2;
    /// Admissions that waited and were granted, or refused at their deadline.
    pub const WAIT_GRANTED: usize = 0;
    pub const WAIT_REFUSED: usize = SLOTS;
    /// Top-ups of running requests that waited, granted or refused.
    pub const RUNTIME_GRANTED: usize = 2 * SLOTS;
    pub const RUNTIME_REFUSED: usize = 3 * SLOTS;
    pub const LEN: usize = 4 * SLOTS;

    /// The bucket a wait of `us` falls in (`BOUNDS_US.len()`: past the last).
    pub const fn bucket(us: u64) -> usize {
        let mut i = 0;
        while i < BOUNDS_US.len() {
            if us <= BOUNDS_US[i] {
                return i;
            }
            i += 1;
        }
        BOUNDS_US.len()
    }
}

/// What each released request cost: the seed's
/// `tikv_cpu_throttle_request_cpu_time_seconds` (its measured CPU) and
/// `tikv_cpu_throttle_request_actual_to_estimated_ratio` (that CPU over the
/// estimate it was admitted with), for requests admitted through a CPU
/// bucket. Written at every such release, so each thread group adds to its
/// own shard (as with the hot counters); readers sum the shards. A
/// histogram is one counter per bound and one past the last (its count is
/// their sum) and a sum.
pub mod request {
    /// Upper bounds of the request CPU buckets, µs.
    pub const CPU_BOUNDS_US: [u64; 12] =
        [50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 100_000, 250_000, 1_000_000];
    /// Upper bounds of the actual-to-estimated buckets, per mille.
    pub const RATIO_BOUNDS_PERMILLE: [u64; 12] =
        [100, 250, 500, 750, 900, 1_000, 1_100, 1_250, 1_500, 2_000, 4_000, 10_000];
    pub const BUCKETS: usize = CPU_BOUNDS_US.len() + 1;
    /// Sum of the CPU observed, µs, and of the ratios, per mille.
    pub const CPU_SUM: usize = 0;
    pub const RATIO_SUM: usize = 1;
    pub const CPU: usize = 2;
    pub const RATIO: usize = CPU + BUCKETS;
    pub const LEN: usize = RATIO + BUCKETS;
    /// Counters per shard (four cache lines).
    pub const SHARD: usize = 32;
    const _: () = assert!(LEN <= SHARD && RATIO_BOUNDS_PERMILLE.len() + 1 == BUCKETS);

    /// The bucket `v` falls in among `bounds` (`bounds.len()`: past the last).
    #[inline]
    pub fn bucket(bounds: &[u64], v: u64) -> usize {
        bounds.iter().position(|&b| v <= b).unwrap_or(bounds.len())
    }
}

/// The agent's header page (memfd; clients read-only).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HeaderPage {
    pub clock: crate::HeaderCell,
    pub agent: AgentCell,
    pub knobs: KnobsCell,
}

/// Who the agent is and whether it is alive.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AgentCell {
    /// Random and non-zero, new at every agent start: a client that sees it
    /// change (or sees 0) is talking to memory no agent serves.
    pub instance: u64,
    /// CLOCK_MONOTONIC ns of the agent's last policy tick. A client that
    /// finds it stale admits without checking (fail-open).
    pub heartbeat_ns: u64,
    /// CLOCK_MONOTONIC ms at the last tick: the coarse clock clients stamp
    /// `BucketCell::last_used_ms` with, so no client reads a clock to do so.
    pub now_ms: u64,
    /// Refill intervals applied so far.
    pub refills: u64,
    /// Non-zero once the agent is shutting down.
    pub stopping: u64,
    pub _pad: [u64; 3],
}

/// The settings the fast path reads, published by the agent.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct KnobsCell {
    /// `KNOB_*` bits.
    pub flags: u64,
    pub refill_interval_us: u64,
    /// `estimated-cpu-per-request-us`.
    pub default_estimate_us: u64,
    /// `additional-allocation-threshold` × 1000.
    pub topup_threshold_milli: u64,
    pub per_allocation_us: u64,
    pub runtime_check_interval_us: u64,
    /// Global pending-write threshold, bytes; a keyspace may hold 30 %.
    pub pending_write_threshold: u64,
    /// `max-concurrent-per-tenant`; 0 = no limit.
    pub max_concurrent_per_tenant: u64,
}

impl KnobsCell {
    /// Whether `KNOB_*` bit `flag` is set.
    #[inline]
    pub fn has(&self, flag: u64) -> bool {
        self.flags & flag != 0
    }
}

/// One token bucket, with its keyspace's request counters: index 0 is the
/// node's global bucket, index `c + 1` keyspace cell `c`'s. Tokens are CPU
/// µs.
///
/// The tokens are two monotonic rovers: `tail_us` counts every µs taken
/// (grants, top-ups, debt, and waiters' places in line), `head_us` every µs
/// made available (fills, refills, refunds); `head − tail` is what is
/// available, negative when in debt or when waiters queue. A waiter takes
/// its place with one fetch-add on `tail_us` and is served when `head_us`
/// passes it, so waiters of one keyspace are served in arrival order, and a
/// newcomer cannot overtake them: it sees nothing available.
///
/// What every ticket counts (grants, releases, consumed µs, µs in flight)
/// is spread over [`HOT_SHARDS`] cache lines, one per group of threads:
/// two threads admitting on one keyspace then share only the rovers' line,
/// not the counters'. Readers sum the shards (wrapping: a ticket may be
/// granted on one shard and released on another).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BucketCell {
    pub tail_us: u64,
    pub head_us: u64,
    /// Futex word: bumped when `head_us` moves while `sleepers > 0`.
    pub wake_seq: u32,
    pub sleepers: u32,
    /// Requests counted in flight (admission control).
    pub inflight_requests: u64,
    /// Pending write bytes (global in cell 0).
    pub pending_write_bytes: u64,
    /// The agent's coarse ms clock at the last acquire (idle eviction).
    pub last_used_ms: u64,
    /// Global cell only: burst tokens left this refill interval.
    pub burst_budget_us: i64,
    /// Tokens running requests' top-ups took ahead of the line and not yet
    /// paid back, µs: the next tokens made available pay them first.
    pub ahead_owed_us: u64,
    /// Per-thread-group shards: `[counter::GRANTED, RELEASED, CONSUMED_US,
    /// HOT_INFLIGHT_US, unused…]`.
    pub hot: [[u64; 8]; HOT_SHARDS],
    pub counters: [u64; counter::COUNT],
    /// Wait-time histograms ([`hist`]).
    pub hist: [u64; hist::LEN],
    /// Per-thread-group shards of the request histograms ([`request`]).
    pub request: [[u64; request::SHARD]; HOT_SHARDS],
    /// Places in line that blocked waiters sleep for, one per bit of the
    /// futex word's wake mask: entry `i` is the place (a `tail_us` value
    /// past which it is served) of the waiter sleeping under bit `i`, 0 when
    /// the slot is free. A move of `head_us` wakes only the bits whose
    /// places it served.
    pub sleep_at: [u64; SLEEP_SLOTS],
    /// Sleepers that wake at every move of `head_us`, under the last bit
    /// (`1 << SLEEP_SLOTS`): blocked waiters that found every slot taken,
    /// and async registrations (one thread per process sleeps for them in
    /// `futex_waitv`, which matches every bit). Counted in `sleepers` too.
    pub unslotted: u64,
}

/// Entries of [`BucketCell::sleep_at`]: one per bit of the futex word's
/// wake mask but the last.
pub const SLEEP_SLOTS: usize = 31;

/// Cache lines the hot counters are spread over.
pub const HOT_SHARDS: usize = 4;
/// Index of the µs held by tickets not yet released and by threads' spare
/// tokens, in a hot shard.
pub const HOT_INFLIGHT_US: usize = 3;

impl Default for BucketCell {
    fn default() -> Self {
        BucketCell {
            tail_us: 0,
            head_us: 0,
            wake_seq: 0,
            sleepers: 0,
            inflight_requests: 0,
            pending_write_bytes: 0,
            last_used_ms: 0,
            burst_budget_us: 0,
            ahead_owed_us: 0,
            hot: [[0; 8]; HOT_SHARDS],
            counters: [0; counter::COUNT],
            hist: [0; hist::LEN],
            request: [[0; request::SHARD]; HOT_SHARDS],
            sleep_at: [0; SLEEP_SLOTS],
            unslotted: 0,
        }
    }
}

/// What the agent publishes per keyspace cell (index `c + 1`; index 0 holds
/// the global bucket's parameters). `key` is the directory entry: the
/// keyspace id in the low half, a `DIR_*` state in the high half; cells are
/// found by open addressing from [`crate::probe_start`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ParamsCell {
    pub key: u64,
    /// Bumped each time the cell is given to a keyspace.
    pub generation: u64,
    pub capacity_us: u64,
    /// Refill per interval now (after dynamic or fair adjustment).
    pub refill_us: u64,
    /// Tokens a ticket takes when its demand names no estimate.
    pub estimate_us: u64,
    /// How far below zero an overrun may drive the bucket.
    pub max_debt_us: u64,
    /// `P_*` bits.
    pub flags: u64,
    pub _pad: u64,
}

/// One ticket a client holds, as its ledger records it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct TicketRecord {
    pub state: u32,
    /// Keyspace cell + 1 (0: the ticket holds no keyspace bucket).
    pub cell: u32,
    /// The cell's generation when the ticket was granted.
    pub generation: u64,
    pub tenant_us: u64,
    pub global_us: u64,
    pub burst_us: u64,
    pub write_bytes: u64,
    /// `T_*` bits; bits 8–63 say what its thread counted asleep
    /// ([`asleep_flags`]).
    pub flags: u64,
    /// CPU the ticket consumed so far, as last recorded by its thread.
    pub consumed_ns: u64,
}

/// `ParamsCell::key` of a live entry.
#[inline]
pub const fn dir_key(keyspace_id: u32, state: u32) -> u64 {
    keyspace_id as u64 | (state as u64) << 32
}

const _: () = assert!(size_of::<AgentCell>() == 64);
const _: () = assert!(size_of::<KnobsCell>() == 64);
const _: () = assert!(size_of::<HeaderPage>() == 192);
const _: () =
    assert!(size_of::<BucketCell>() == 576 + 8 * hist::LEN + 8 * request::SHARD * HOT_SHARDS + 8 * SLEEP_SLOTS + 8);
const _: () = assert!(size_of::<ParamsCell>() == 64);
const _: () = assert!(size_of::<TicketRecord>() == 64);
const _: () = assert!(align_of::<BucketCell>() == 8);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_offsets_are_stable() {
        // Clients and agents of the same release share these; a change is
        // an ABI change of the regions.
        assert_eq!(core::mem::offset_of!(BucketCell, wake_seq), 16);
        assert_eq!(core::mem::offset_of!(BucketCell, hot), 64);
        assert_eq!(core::mem::offset_of!(BucketCell, counters), 320);
        assert_eq!(core::mem::offset_of!(HeaderPage, agent), 64);
        assert_eq!(core::mem::offset_of!(HeaderPage, knobs), 128);
        assert_eq!(core::mem::offset_of!(TicketRecord, consumed_ns), 56);
    }

    #[test]
    fn asleep_flags_round_trip_beside_the_ticket_bits() {
        for (bucket, count, unslotted) in [(0, 1, false), (3, 1, true), (65_535, 200, false), (u32::MAX - 1, 1, true)] {
            let f = asleep_flags(bucket, count, unslotted) | T_COUNTED | T_SPARE;
            assert_eq!(asleep_of(f), Some((bucket, count, unslotted)));
            assert_eq!(f & !T_ASLEEP_MASK, T_COUNTED | T_SPARE);
        }
        assert_eq!(asleep_of(T_COUNTED | T_SPARE), None);
        assert_eq!(asleep_of(asleep_flags(7, u64::MAX, false)), Some((7, (1 << 23) - 1, false)));
    }

    #[test]
    fn directory_keys_keep_id_and_state_apart() {
        let k = dir_key(u32::MAX, DIR_LIVE);
        assert_eq!(k as u32, u32::MAX);
        assert_eq!((k >> 32) as u32, DIR_LIVE);
        assert_ne!(dir_key(0, DIR_LIVE), dir_key(0, DIR_EMPTY));
    }
}
