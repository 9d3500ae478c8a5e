//! [`Policy`]: the agent's side of admission. It owns the admission regions
//! (header, buckets, parameters and directory), decides every bucket's
//! source, rate and capacity, and publishes them; the fast path that takes
//! and returns tokens ([`super::admit`]) runs in whichever process admits a
//! request, on the same memory. `allocate`/`release` here run that same fast
//! path for the agent's own use and for tests.

use crate::ranked::{Rank, Ranked, RankedGuard};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering;

use keyspace_governor_common::admission::{
    KNOB_ADMISSION_ENFORCED, KNOB_ADMISSION_MONITOR, KNOB_BURST, KNOB_CAP_MODE, KNOB_ENABLED, KNOB_ENFORCE_GLOBAL,
    KNOB_RUNTIME_TOPUP, KNOB_THROTTLE, KNOB_TRACK_DEMAND, P_BURST_ENABLED, P_CAP, P_SHRINK_DEBT, P_THROTTLED, counter,
};

use super::AdmissionMode;
use super::admit::{self, Demand, Grant};
use super::error::Refusal;
use super::estimate::EstimateTracker;
use super::keyspace::{BucketBook, KeyspaceState, QuotaSource};
use super::pd::{PdAction, PdFetch, PdParams, PdTracked, PdTracker};
use super::settings::{Settings, millicores_to_us_per_interval};
use super::window::MonitorWindow;
use crate::region::{
    AdmissionMemory, AdmissionRegions, CellRef, GLOBAL, LOW_PRIORITY, OVERFLOW, ParamsView, RegionError,
};

/// Keyspace cells of a policy built by [`Policy::new`].
pub const DEFAULT_CELLS: u32 = keyspace_governor_common::DEFAULT_MAX_KEYSPACES;

/// The agent-side state, behind one mutex the fast path never takes.
#[derive(Debug)]
pub(crate) struct Engine {
    /// By keyspace cell.
    pub cells: Vec<Option<KeyspaceState>>,
    /// The cells that are `Some` above: what the per-tick loops walk.
    pub live: BTreeSet<u32>,
    pub global: BucketBook,
    pub low_priority: BucketBook,
    /// The bucket shared by keyspaces without a cell.
    pub overflow: BucketBook,
    pub last_refill_us: u64,
    pub next_refill_at_us: u64,
    pub window: MonitorWindow,
    pub estimates: EstimateTracker,
    pub pd: PdTracker,
    /// DEMAND_US of each cell at the previous observation.
    pub last_demand: HashMap<u32, u64>,
    pub last_observe_us: u64,
    pub fair_active: bool,
    /// The latency guard's last step (who suffered; factors live in the cells).
    pub guard: super::GuardStep,
    pub global_ratio: f64,
    pub cap_buckets_created: u64,
    pub cap_buckets_evicted: u64,
    /// Counters of cells given up, so node-wide totals never go backwards.
    pub retired: [u64; counter::COUNT],
}

/// The policy engine. The fast path runs on any thread (and in other
/// processes, on the same memory); `tick` and the updates come from the
/// agent's loop.
pub struct Policy {
    pub(crate) memory: AdmissionMemory,
    pub(crate) settings: Ranked<Settings>,
    pub(crate) engine: Ranked<Engine>,
}

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policy").field("settings", &self.settings()).finish_non_exhaustive()
    }
}

impl Policy {
    /// A policy on fresh admission regions of [`DEFAULT_CELLS`] keyspace
    /// cells. Buckets start full; the simulated clock starts at `now_us`.
    pub fn new(settings: Settings, now_us: u64) -> Result<Policy, RegionError> {
        Self::with_cells(settings, DEFAULT_CELLS, now_us)
    }

    /// A policy on fresh admission regions of `cells` keyspace cells (a power
    /// of two).
    pub fn with_cells(settings: Settings, cells: u32, now_us: u64) -> Result<Policy, RegionError> {
        let memory = AdmissionMemory::create(cells)?;
        let engine = Engine {
            cells: vec![None; cells as usize],
            live: BTreeSet::new(),
            global: BucketBook::default(),
            low_priority: BucketBook::default(),
            overflow: BucketBook::default(),
            last_refill_us: now_us,
            next_refill_at_us: now_us + settings.refill_interval_us(),
            window: MonitorWindow::new(settings.window_size_us(), settings.max_window_cpu_us()),
            estimates: EstimateTracker::default(),
            pd: PdTracker::default(),
            last_demand: HashMap::new(),
            last_observe_us: now_us,
            fair_active: false,
            guard: Default::default(),
            global_ratio: 0.0,
            cap_buckets_created: 0,
            cap_buckets_evicted: 0,
            retired: [0; counter::COUNT],
        };
        let p = Policy {
            memory,
            settings: Ranked::new(Rank::Settings, settings.clone()),
            engine: Ranked::new(Rank::Engine, engine),
        };
        let a = p.regions().header().agent.instance.load(Ordering::Relaxed);
        debug_assert_eq!(a, 0);
        p.regions().header().agent.now_ms.store(now_us / 1000, Ordering::Relaxed);
        {
            let mut e = p.engine();
            p.publish_knobs(&settings);
            p.setup_node_buckets(&mut e, &settings);
            for (&ks, &mc) in settings.throttle().keyspace_cpu_quotas.map() {
                let us = millicores_to_us_per_interval(mc, settings.refill_interval_us());
                p.set_source(&mut e, &settings, ks, Some((QuotaSource::Config, us)), now_us)?;
            }
        }
        Ok(p)
    }

    pub(crate) fn engine(&self) -> RankedGuard<'_, Engine> {
        self.engine.lock()
    }

    /// A copy of the running settings.
    pub fn settings(&self) -> Settings {
        self.lock_settings().clone()
    }

    pub(crate) fn lock_settings(&self) -> RankedGuard<'_, Settings> {
        self.settings.lock()
    }

    /// The shared regions this policy publishes into.
    pub fn regions(&self) -> &AdmissionRegions {
        &self.memory.regions
    }

    /// The descriptors behind them (header, buckets, parameters).
    pub fn memory(&self) -> &AdmissionMemory {
        &self.memory
    }

    /// The settings the fast path reads, published in the header.
    pub(crate) fn publish_knobs(&self, s: &Settings) {
        let k = &self.regions().header().knobs;
        let cap = s.cap_mode();
        let mut flags = 0;
        for (on, f) in [
            (s.resource.enabled, KNOB_ENABLED),
            (s.throttle().enabled, KNOB_THROTTLE),
            (s.throttle().enforce_global_limit || cap, KNOB_ENFORCE_GLOBAL),
            (s.throttle().enable_burst && !cap, KNOB_BURST),
            (s.throttle().enable_runtime_token_management, KNOB_RUNTIME_TOPUP),
            (cap, KNOB_CAP_MODE),
            (s.throttle().enable_fair_allocation, KNOB_TRACK_DEMAND),
            (s.admission.mode == AdmissionMode::Monitor, KNOB_ADMISSION_MONITOR),
            (s.admission.mode == AdmissionMode::Enforced, KNOB_ADMISSION_ENFORCED),
        ] {
            if on {
                flags |= f;
            }
        }
        k.refill_interval_us.store(s.refill_interval_us(), Ordering::Relaxed);
        k.default_estimate_us.store(s.throttle().estimated_cpu_per_request_us.max(1), Ordering::Relaxed);
        k.topup_threshold_milli
            .store((s.throttle().additional_allocation_threshold * 1000.0) as u64, Ordering::Relaxed);
        k.per_allocation_us.store(s.throttle().per_allocation_us, Ordering::Relaxed);
        k.runtime_check_interval_us.store(s.throttle().runtime_check_interval_us, Ordering::Relaxed);
        k.pending_write_threshold.store(s.pending_write_threshold_bytes(), Ordering::Relaxed);
        k.max_concurrent_per_tenant.store(s.max_concurrent_per_tenant(), Ordering::Relaxed);
        k.flags.store(flags, Ordering::Release);
    }

    /// Writes a bucket's rates into its parameters.
    pub(crate) fn publish_book(p: &ParamsView, book: &BucketBook) {
        p.capacity_us.store(book.capacity_us, Ordering::Relaxed);
        p.refill_us.store(book.refill_us, Ordering::Relaxed);
        p.max_debt_us.store(book.max_debt_us, Ordering::Relaxed);
        let f = p.flags.load(Ordering::Relaxed);
        let f = if book.debt_mode { f | P_SHRINK_DEBT } else { f & !P_SHRINK_DEBT };
        p.flags.store(f, Ordering::Release);
    }

    /// Sizes the node's buckets (global, low-priority, overflow) for `s`,
    /// filling what a bucket gains in capacity. A bucket whose size did not
    /// change is left alone (an online change of another key never disturbs
    /// it, nor the global bucket's dynamic refill).
    pub(crate) fn setup_node_buckets(&self, e: &mut Engine, s: &Settings) {
        let r = self.regions();
        let overflow = self.overflow_source(e, s);
        let overflow_flags = match overflow {
            Some((QuotaSource::TenantCap, _)) => P_THROTTLED | P_CAP,
            Some(_) => P_THROTTLED,
            None => 0,
        };
        for (i, refill, book, flags) in [
            (GLOBAL, s.global_refill_us(), &mut e.global, P_THROTTLED),
            (
                LOW_PRIORITY,
                s.low_priority_refill_us(),
                &mut e.low_priority,
                if s.throttle().low_priority_dag_global_enabled { P_THROTTLED } else { 0 },
            ),
            (OVERFLOW, overflow.map_or(0, |x| x.1), &mut e.overflow, overflow_flags),
        ] {
            let capacity = s.capacity_for(refill);
            let p = r.params.get(i).expect("node bucket parameters");
            let same = book.base_refill_us == refill
                && book.capacity_us == capacity
                && book.max_debt_us == s.max_debt_for(refill)
                && p.flags.load(Ordering::Relaxed) & !P_SHRINK_DEBT == flags
                && book.refilled_us > 0;
            if same {
                continue;
            }
            let fill = capacity.saturating_sub(book.capacity_us);
            *book = BucketBook {
                base_refill_us: refill,
                refill_us: refill,
                capacity_us: capacity,
                max_debt_us: s.max_debt_for(refill),
                refilled_us: book.refilled_us + fill,
                ..*book
            };
            p.flags.store(flags, Ordering::Relaxed);
            Self::publish_book(p, book);
            let b = r.bucket(i);
            book.discarded_us += b.clamp_available(capacity);
            let kept = b.give(fill, capacity);
            book.discarded_us += fill - kept;
            if i == GLOBAL {
                b.burst_budget_us.store(i64::try_from(refill).unwrap_or(i64::MAX), Ordering::Release);
            }
        }
    }

    /// What the overflow bucket (keyspaces without a cell) is held to: the
    /// tenant cap in tenant-cap mode; else the smallest quota in force,
    /// configured or from PD, so a quota'd keyspace that found no cell gets
    /// no more than any quota; without quotas none (a keyspace without a
    /// quota passes the CPU check, as it would with a cell). Concurrency and
    /// write-byte limits hold on it whatever this says.
    pub(crate) fn overflow_source(&self, e: &Engine, s: &Settings) -> Option<(QuotaSource, u64)> {
        if let Some(cap) = s.tenant_cap_refill_us(s.throttle().tenant_max_cpu_ratio) {
            return Some((QuotaSource::TenantCap, cap));
        }
        let configured = s
            .throttle()
            .keyspace_cpu_quotas
            .map()
            .values()
            .map(|&mc| (QuotaSource::Config, millicores_to_us_per_interval(mc, s.refill_interval_us())));
        let pd = e.pd.applied().map(|us| (QuotaSource::Pd, us));
        configured.chain(pd).min_by_key(|x| x.1)
    }

    /// The cell of `keyspace`, giving it one (with the bucket its settings
    /// call for) when it has none.
    pub fn ensure_keyspace(&self, keyspace: u32, now_us: u64) -> Result<CellRef, RegionError> {
        if let Some(found) = self.regions().directory().find(keyspace) {
            return Ok(found);
        }
        let s = self.settings();
        let mut e = self.engine();
        let source = self.source_for(&e, &s, keyspace);
        self.set_source(&mut e, &s, keyspace, source, now_us)
    }

    /// What bucket `keyspace` gets by the settings: its configured (or PD)
    /// quota, the uniform cap, or none.
    pub(crate) fn source_for(&self, e: &Engine, s: &Settings, keyspace: u32) -> Option<(QuotaSource, u64)> {
        let cfg = s
            .throttle()
            .keyspace_cpu_quotas
            .map()
            .get(&keyspace)
            .map(|&mc| millicores_to_us_per_interval(mc, s.refill_interval_us()));
        let pd = if s.throttle().enable_pd_service_limit { e.pd.applied_us(keyspace) } else { None };
        // PD's "unlimited" (service_limit 0) removes a static quota too,
        // unless the static one wins (pd-override-config = false).
        let unlimited =
            s.throttle().enable_pd_service_limit && s.throttle().pd_override_config && e.pd.unlimited(keyspace);
        match (s.tenant_cap_refill_us(s.throttle().tenant_max_cpu_ratio), pd, cfg) {
            (Some(cap), _, _) => Some((QuotaSource::TenantCap, cap)),
            (None, None, Some(_)) if unlimited => None,
            (None, Some(pd), Some(_)) if s.throttle().pd_override_config => Some((QuotaSource::Pd, pd)),
            (None, _, Some(cfg)) => Some((QuotaSource::Config, cfg)),
            (None, Some(pd), None) => Some((QuotaSource::Pd, pd)),
            (None, None, None) => None,
        }
    }

    /// Gives `keyspace` a cell if needed and sets where its quota comes from
    /// (`None`: no bucket). A quota reduced below what is in flight puts the
    /// bucket in debt: no tokens, no refill, refunds kept back, until
    /// in-flight drains to the new quota (the seed's rule is about shrinks
    /// only).
    pub(crate) fn set_source(
        &self,
        e: &mut Engine,
        s: &Settings,
        keyspace: u32,
        source: Option<(QuotaSource, u64)>,
        now_us: u64,
    ) -> Result<CellRef, RegionError> {
        let r = self.regions();
        // A new cell's counters and tokens restart before the entry is
        // published: from then on clients find it and count into it, and a
        // reset after that wiped their counts (seen as lost grants under
        // qemu-aarch64, 6 runs in 60).
        let mut fresh_tail = None;
        let (cell, generation, inserted) = r.directory().insert(keyspace, |c, p| {
            p.flags.store(0, Ordering::Relaxed);
            p.estimate_us.store(s.static_estimate_us(keyspace), Ordering::Relaxed);
            if let Some((bucket, _)) = r.keyspace_cell(c) {
                bucket.reset_counters();
                fresh_tail = Some(bucket.reset_tokens());
            }
        })?;
        let (bucket, params) = r.keyspace_cell(cell).expect("cell from the directory");
        if inserted || e.cells[cell as usize].as_ref().is_none_or(|st| st.id != keyspace) {
            e.live.insert(cell);
            e.cells[cell as usize] = Some(KeyspaceState {
                id: keyspace,
                generation,
                source: None,
                book: BucketBook::default(),
                estimate_us: s.static_estimate_us(keyspace),
                burst_enabled: s.throttle().keyspace_burst_enabled.map().get(&keyspace).copied().unwrap_or(true),
                burst_allowed: false,
                ratio: 0.0,
                fair_allocations: 0,
                last_used_us: now_us,
                guard_factor: 1.0,
                follow: Default::default(),
            });
            // Counters and tokens restart with the new keyspace (nothing was
            // in flight and nobody waited when the last holder went): done
            // above, unpublished, for a new entry.
            let tail = match fresh_tail {
                Some(tail) => tail,
                None => {
                    bucket.reset_counters();
                    bucket.reset_tokens()
                }
            };
            e.cells[cell as usize].as_mut().expect("just set").book.tail_base_us = tail;
            e.last_demand.remove(&cell);
            e.estimates.forget(cell);
        }
        let st = e.cells[cell as usize].as_mut().expect("just set");
        let was = st.source;
        st.source = source.map(|(src, _)| src);
        match source {
            None => {
                // No bucket: no refills; what it holds stays (grants still
                // out settle into it) and is never asked for.
                st.book.base_refill_us = 0;
                st.book.refill_us = 0;
                st.book.debt_mode = false;
                params.flags.store(0, Ordering::Release);
            }
            Some((src, refill)) => {
                if src == QuotaSource::TenantCap && was != Some(QuotaSource::TenantCap) {
                    e.cap_buckets_created += 1;
                }
                let capacity = s.capacity_for(refill);
                let old = st.book.clone();
                let fresh = was.is_none();
                st.book.base_refill_us = refill;
                st.book.refill_us = refill;
                st.book.capacity_us = capacity;
                st.book.max_debt_us = s.max_debt_for(refill);
                let mut flags = P_THROTTLED;
                if src == QuotaSource::TenantCap {
                    flags |= P_CAP;
                }
                if st.burst_enabled {
                    flags |= P_BURST_ENABLED;
                }
                params.flags.store(flags, Ordering::Relaxed);
                if fresh {
                    // Whatever the cell held while it had no bucket cannot
                    // give the new one more than its capacity.
                    st.book.debt_mode = false;
                    st.book.discarded_us += bucket.clamp_available(capacity);
                    let kept = bucket.give(capacity, capacity);
                    st.book.refilled_us += capacity;
                    st.book.discarded_us += capacity - kept;
                } else if refill < old.base_refill_us && bucket.inflight_us() > refill {
                    st.book.debt_mode = true;
                    st.book.discarded_us += bucket.drop_available();
                } else {
                    st.book.discarded_us += bucket.clamp_available(capacity);
                }
            }
        }
        params.estimate_us.store(st.estimate_us, Ordering::Relaxed);
        Self::publish_book(params, &st.book);
        Ok(CellRef { index: cell, generation })
    }

    /// Admits one request without waiting, as a client would, with the
    /// agent's clock at `now_us`.
    pub fn admit(&self, keyspace: u32, demand: &Demand, now_us: u64) -> Result<Grant, Refusal> {
        let r = self.regions();
        r.header().agent.now_ms.store(now_us / 1000, Ordering::Relaxed);
        let cell = self.ensure_keyspace(keyspace, now_us).ok();
        let k = r.header().knobs.snapshot();
        admit::acquire(r, &k, keyspace, cell, demand)
    }

    /// Admits a request of `keyspace` that expects `estimate_us` of CPU
    /// (`None` = the keyspace's estimate). Outside tenant-cap mode a
    /// keyspace with no quota passes unthrottled (a skip grant).
    pub fn allocate(&self, keyspace: u32, estimate_us: Option<u64>, now_us: u64) -> Result<Grant, Refusal> {
        self.admit(keyspace, &Demand { estimate_us, ..Demand::default() }, now_us)
    }

    /// A low-priority DAG request: the low-priority bucket first (when
    /// enabled), then the same cap-aware path.
    pub fn allocate_low_priority(
        &self,
        keyspace: u32,
        estimate_us: Option<u64>,
        now_us: u64,
    ) -> Result<Grant, Refusal> {
        self.admit(keyspace, &Demand { estimate_us, low_priority: true, ..Demand::default() }, now_us)
    }

    /// Runtime top-up: `us` more for a running request.
    pub fn allocate_more(&self, grant: &mut Grant, us: u64, now_us: u64) -> Result<(), Refusal> {
        let r = self.regions();
        r.header().agent.now_ms.store(now_us / 1000, Ordering::Relaxed);
        admit::top_up(r, &r.header().knobs.snapshot(), grant, us)
    }

    /// Closes a grant with the measured CPU.
    pub fn release(&self, grant: Grant, consumed_us: u64) {
        admit::release(self.regions(), &grant, consumed_us);
    }
}

impl Policy {
    /// The keyspaces the latency guard holds below their share now, with
    /// the factor it scales their refill by (in (0, 1)): the agent scales
    /// a rule keyspace's cgroup cap by the same factor.
    pub fn guard_factors(&self) -> Vec<(u32, f64)> {
        let e = self.engine();
        e.live
            .iter()
            .filter_map(|&c| e.cells[c as usize].as_ref())
            .filter(|st| st.guard_factor < 1.0)
            .map(|st| (st.id, st.guard_factor))
            .collect()
    }

    /// The PD tracker's view of every keyspace it follows.
    pub fn pd_tracked(&self) -> Vec<PdTracked> {
        self.engine().pd.tracked()
    }

    /// Folds a PD fetch round into the keyspace quotas (when
    /// `enable-pd-service-limit`, never in tenant-cap mode). Returns the
    /// actions the tracker decided (including ones static config overrides).
    pub fn apply_pd_service_limits(&self, now_us: u64, fetch: &PdFetch) -> Vec<PdAction> {
        let s = self.settings();
        if !s.throttle().enable_pd_service_limit || s.cap_mode() {
            return Vec::new();
        }
        let mut e = self.engine();
        let params = PdParams {
            global_refill_us: e.global.base_refill_us,
            update_threshold: s.throttle().pd_service_limit_update_threshold,
            consecutive_404: s.throttle().pd_service_limit_consecutive_404,
            ttl_us: s.pd_service_limit_ttl_us(),
        };
        let actions = e.pd.update(now_us, fetch, params);
        for a in &actions {
            let ks = match *a {
                PdAction::Set { keyspace, .. } | PdAction::Remove { keyspace } => keyspace,
            };
            let wanted = self.source_for(&e, &s, ks);
            if let Err(err) = self.set_source(&mut e, &s, ks, wanted, now_us) {
                log::warn!("PD quota for keyspace {ks} not applied: {err}");
            }
        }
        // The overflow bucket follows the smallest quota in force.
        if !actions.is_empty() {
            self.setup_node_buckets(&mut e, &s);
        }
        actions
    }
}
