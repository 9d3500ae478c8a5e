//! The agent: owns the measurement backend, the policy and the shared
//! regions, serves the control socket, runs the policy on live measurements
//! and returns what dead clients held.
//!
//! # Layout
//!
//! - [`run`]: starts everything and serves until the shutdown future
//!   resolves (tests pass their own).
//! - `server`: the control socket, one task per connection.
//! - `slots`: thread-slot allocation and reuse.
//! - `ledgers`: each client's ticket ledger, and what the agent returns from
//!   it when the client goes.
//! - `usage`: per-keyspace CPU from the measurement cells, as the policy's
//!   usage samples.
//! - `rules`: unmodified processes measured by `[[rules]]`.
//! - `autoscale`: the two autoscaling signals of the admission-control seed.
//! - `cgroups`: the kernel holds capped rule keyspaces to their cap.
//! - `pd`: keyspace quotas from PD's service limits.
//! - `status`: what `governor status` shows.

mod autoscale;
mod cells;
mod cgroups;
mod ledgers;
mod live_config;
mod metrics;
mod pd;
pub(crate) mod profile;
mod reconfigure;
mod rules;
mod server;
mod server_cpu;
pub mod slots;
mod status;
mod usage;
mod waits;

use crate::config::ValidatedConfig;
use crate::measure::{MeasureError, MeasureMode, Measurement, Sizing, fallback};
use crate::policy::{Policy, Settings};
use crate::ranked::{Rank, Ranked, RankedGuard};
use crate::region::RegionError;
use crate::sys;
use std::collections::HashSet;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Measure(#[from] MeasureError),
    #[error("creating the admission regions failed")]
    Admission(#[from] RegionError),
    #[error("cannot listen on the control socket {path}")]
    Listen {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "cannot give the control socket {path} group {group} and mode {mode:o} (agent.access socket-group, socket-mode): a group the agent's user is not in takes CAP_CHOWN"
    )]
    SocketAccess {
        path: PathBuf,
        group: String,
        mode: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("another agent is already serving {path}")]
    AlreadyRunning { path: PathBuf },
    #[error(
        "{path} is a socket something listens on, and no agent here holds it (an agent in another network namespace, or another program): the agent takes only a socket nobody answers on; stop that or choose another --socket (agent.control-socket)"
    )]
    SocketInUse { path: PathBuf },
    #[error(
        "{path} is there and is not a socket: the agent removes only a socket a crashed agent left; move the file away or choose another --socket (agent.control-socket)"
    )]
    NotASocket { path: PathBuf },
    #[error("starting the async runtime failed")]
    Runtime(#[source] std::io::Error),
    #[error("starting the housekeeping thread failed")]
    Thread(#[source] std::io::Error),
    #[error("cannot serve /metrics on {addr} (agent.metrics-addr)")]
    Metrics {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// What the agent runs with, from the configuration and the command line.
#[derive(Clone, Debug)]
pub struct AgentOptions {
    pub socket: PathBuf,
    pub measure: MeasureMode,
    pub sizing: Sizing,
    /// Where `/metrics` listens (port 0: any free port; status says which).
    pub metrics_addr: std::net::SocketAddr,
    pub config: ValidatedConfig,
    /// The file the configuration came from: `config reload` and SIGHUP
    /// read it again. None: the embedded default (`config set` still works).
    pub config_path: Option<PathBuf>,
}

impl AgentOptions {
    pub fn from_config(cfg: &ValidatedConfig) -> AgentOptions {
        let a = cfg.agent();
        AgentOptions {
            socket: a.control_socket.clone(),
            measure: a.measure,
            sizing: Sizing {
                max_threads: a.max_threads,
                max_keyspaces: a.max_keyspaces.next_power_of_two(),
                timer_period_ns: a.timer_period.get().as_nanos() as u64,
                cpu_pressure: a.cpu_pressure,
            },
            metrics_addr: a.metrics_socket(),
            config: cfg.clone(),
            config_path: None,
        }
    }
}

/// The agent's state, shared by the control socket, the housekeeping tick
/// and `/metrics`.
///
/// Every lock is a [`Ranked`] one: the order they may be taken in is
/// [`Rank`]'s (`config` → `cell_grants` → `ledgers` → the policy's engine →
/// `measurement` → `slots` → `usage` → `rules`, then the leaves: the
/// policy's settings, `server_cpu`, `autoscale`), checked as each is taken
/// and counted in status when broken. Status and `/metrics` read what needs
/// the engine, the grants or the configuration before they take
/// `measurement`; the tick's idle-cell eviction asks for the pinned cells
/// (`measurement`) under the engine.
pub(crate) struct Shared {
    measurement: Ranked<Measurement>,
    slots: Ranked<slots::Slots>,
    pub(crate) policy: Policy,
    ledgers: Ranked<ledgers::Ledgers>,
    usage: Ranked<usage::Usage>,
    /// Who got each keyspace cell, and the keyspaces that got none.
    cell_grants: Ranked<cells::CellGrants>,
    keyspaces_per_uid: std::sync::atomic::AtomicU32,
    /// `agent.metrics-max-keyspaces`, read at each scrape.
    metrics_max_keyspaces: std::sync::atomic::AtomicUsize,
    /// The running configuration and where it came from.
    config: Ranked<live_config::Running>,
    /// Rule measurement (last in lock order).
    rules: Ranked<rules::Rules>,
    /// Counter samples behind the autoscaling signals.
    autoscale: Ranked<autoscale::History>,
    /// The PD service-limit client's memory and metrics.
    pd: pd::PdClient,
    /// Where `/metrics` is served, as bound.
    metrics_addr: Option<std::net::SocketAddr>,
    /// The control socket's path.
    socket: PathBuf,
    /// Random, non-zero; published in the header.
    instance: u64,
    started: Instant,
    /// The CPU every cap is a fraction of (a leaf: no lock is taken under it).
    server_cpu: Ranked<server_cpu::ServerCpu>,
}

impl Shared {
    fn lock_measurement(&self) -> RankedGuard<'_, Measurement> {
        self.measurement.lock()
    }

    fn lock_slots(&self) -> RankedGuard<'_, slots::Slots> {
        self.slots.lock()
    }

    fn lock_ledgers(&self) -> RankedGuard<'_, ledgers::Ledgers> {
        self.ledgers.lock()
    }

    fn lock_usage(&self) -> RankedGuard<'_, usage::Usage> {
        self.usage.lock()
    }

    fn lock_config(&self) -> RankedGuard<'_, live_config::Running> {
        self.config.lock()
    }

    /// The configuration in force, for `config show --socket`.
    pub(crate) fn config_reply(&self) -> crate::proto::Reply {
        let running = self.lock_config();
        let mut reply = running.reply();
        if let crate::proto::Reply::Config { overridden, .. } = &mut reply {
            let a = running.config.agent();
            if a.control_socket != self.socket {
                overridden.insert("agent.control-socket".into(), self.socket.display().to_string());
            }
            if let Some(m) = self.metrics_addr.filter(|m| a.metrics_addr != m.to_string()) {
                overridden.insert("agent.metrics-addr".into(), m.to_string());
            }
        }
        reply
    }

    /// The configuration in force now.
    fn running_config(&self) -> ValidatedConfig {
        self.lock_config().config.clone()
    }

    /// `tenant_admission_control` refusals since start, and per keyspace the
    /// tickets that waited or were refused: what the autoscaling rules read.
    fn held_back(&self) -> (u64, std::collections::HashMap<u32, u64>) {
        let r = self.policy.regions();
        let per_keyspace = r
            .directory()
            .live()
            .filter_map(|(id, cell)| {
                let (b, _) = r.keyspace_cell(cell)?;
                let c = crate::policy::KeyspaceCounters::of(b);
                Some((id, c.waited + c.refused_keyspace + c.refused_global + c.refused_write + c.refused_concurrency))
            })
            .collect();
        (self.policy.counters().concurrency_refused, per_keyspace)
    }

    /// `agent.access` in force.
    fn access(&self) -> crate::config::Access {
        self.lock_config().access()
    }

    fn lock_rules(&self) -> RankedGuard<'_, rules::Rules> {
        self.rules.lock()
    }

    /// Puts `config`'s rules in force: gives each rule's keyspace a cell,
    /// sets the caps the kernel holds them to, then matches every process
    /// again.
    pub(crate) fn apply_rules(&self, config: &ValidatedConfig) -> Result<(), RegionError> {
        let list = config.rules();
        let mut cells = Vec::with_capacity(list.len());
        for r in list {
            let before = self.policy.regions().directory().find(r.keyspace);
            let crate::region::CellRef { index: cell, generation } =
                self.policy.ensure_keyspace(r.keyspace, now_us())?;
            if before.is_none() {
                let m = self.lock_measurement();
                self.lock_usage().note(&m, cell, r.keyspace, generation);
            }
            cells.push(cell);
        }
        let caps = self.cap_settings(config);
        let mut m = self.lock_measurement();
        self.lock_rules().apply(&mut m, list, &cells, caps);
        Ok(())
    }

    /// The rule caps `config` asks for on this server.
    pub(crate) fn cap_settings(&self, config: &ValidatedConfig) -> cgroups::CapSettings {
        let cores = self.lock_server_cpu().cores_with(config.resource_control().server_cpu_cores);
        cgroups::CapSettings::from_config(config, cores)
    }

    fn lock_cell_grants(&self) -> RankedGuard<'_, cells::CellGrants> {
        self.cell_grants.lock()
    }

    /// Keyspace cells a registered thread is tagged with now: never evicted.
    fn pinned_cells(&self) -> HashSet<u32> {
        let m = self.lock_measurement();
        let slots = self.lock_slots();
        let mut pinned: HashSet<u32> = slots
            .held_slots()
            .filter_map(|s| m.regions.slots.get(s))
            .filter_map(|v| keyspace_governor_common::cell_of_tag(v.tag.load(Ordering::Relaxed)))
            .collect();
        pinned.extend(self.lock_rules().cells());
        pinned
    }
}

fn now_us() -> u64 {
    sys::monotonic_ns() / 1000
}

/// FNV-1a: a short stable name from a path.
fn fnv32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(*b)).wrapping_mul(0x0100_0193))
}

/// Runs the agent until `shutdown` resolves.
pub async fn run(opts: AgentOptions, shutdown: impl Future<Output = ()>) -> Result<(), AgentError> {
    // Held to the end: dropped, it removes the socket file.
    let (listener, _claim) = server::bind(&opts.socket, opts.config.access())?;
    let metrics_listener = tokio::net::TcpListener::bind(opts.metrics_addr)
        .await
        .map_err(|source| AgentError::Metrics { addr: opts.metrics_addr, source })?;
    let metrics_addr = metrics_listener.local_addr().ok();
    sys::raise_fd_limit();
    let measurement = Measurement::start(opts.measure, opts.sizing)?;
    let server_cpu = server_cpu::ServerCpu::new(opts.config.resource_control().server_cpu_cores);
    let settings = Settings::from_config(&opts.config, server_cpu.current().cores);
    for notice in opts.config.notices_on(server_cpu.current().cores, "this server's") {
        log::warn!("{notice}");
    }
    let policy = Policy::with_cells(settings, measurement.sizes.keyspaces, now_us())?;
    let instance = sys::random_u64() | 1;
    let header = policy.regions().header();
    header.agent.heartbeat_ns.store(sys::monotonic_ns(), Ordering::Relaxed);
    header.agent.instance.store(instance, Ordering::Release);
    log::info!(
        "measurement backend: {} ({} thread slots, {} keyspace cells); CPU throttle {}; control socket {}",
        measurement.kind.as_str(),
        measurement.sizes.slots,
        measurement.sizes.keyspaces,
        if opts.config.cpu_throttle().enabled { "on" } else { "off (measuring only)" },
        opts.socket.display()
    );
    let shared = Arc::new(Shared {
        slots: Ranked::new(
            Rank::Slots,
            slots::Slots::new(measurement.sizes.slots, opts.config.agent().threads_per_uid()),
        ),
        usage: Ranked::new(Rank::Usage, usage::Usage::new(&opts.config)),
        cell_grants: Ranked::new(Rank::CellGrants, cells::CellGrants::default()),
        keyspaces_per_uid: opts.config.agent().keyspaces_per_uid().into(),
        metrics_max_keyspaces: (opts.config.agent().metrics_max_keyspaces as usize).into(),
        config: Ranked::new(Rank::Config, live_config::Running::new(opts.config.clone(), opts.config_path.clone())),
        rules: Ranked::new(Rank::Rules, rules::Rules::default()),
        autoscale: Ranked::new(Rank::Autoscale, autoscale::History::default()),
        pd: pd::PdClient::default(),
        metrics_addr,
        socket: opts.socket.clone(),
        measurement: Ranked::new(Rank::Measurement, measurement),
        policy,
        ledgers: Ranked::new(Rank::Ledgers, ledgers::Ledgers::default()),
        instance,
        started: Instant::now(),
        server_cpu: Ranked::new(Rank::ServerCpu, server_cpu),
    });
    if let Some(addr) = metrics_addr {
        log::info!("serving /metrics on http://{addr}/metrics");
    }
    {
        // The state file sits beside the control socket: the next agent on
        // it puts back what this one changed, even after a SIGKILL.
        let default_socket = crate::config::ValidatedConfig::embedded_default().agent().control_socket.clone();
        let prefix = if opts.socket == default_socket {
            "governor".to_string()
        } else {
            format!("governor-{:08x}", fnv32(opts.socket.as_os_str().as_encoded_bytes()))
        };
        let state = opts.socket.with_file_name(format!(
            "{}.cgroups.json",
            opts.socket.file_name().map_or("governor".into(), |n| n.to_string_lossy())
        ));
        let enforcer = cgroups::Enforcer::new(state, prefix);
        log::info!("rule caps: {}", enforcer.describe());
        shared.lock_rules().enforcer = Some(enforcer);
    }
    shared.apply_rules(&opts.config)?;
    let stop_housekeeping = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // The autoscaling rules' first sample, before any request can be
    // refused: "recently" starts here.
    shared.autoscale.lock().record(0, std::collections::HashMap::new());
    // Exec reports are decided as they come, on a thread of their own: a
    // process a capped rule matches is in its keyspace's cgroup within the
    // wakeup of that thread, not a tick later (a short-lived process run
    // in a loop would do most of its work before a tick moved it).
    let events = shared.lock_measurement().rules().map(|r| Ok::<_, std::io::Error>((r.events_fd()?, sys::wake_fd()?)));
    let rules_thread = match events {
        Some(Ok((fd, wake))) => {
            let wake = Arc::new(wake);
            let (shared, stop, tick, woken) = (shared.clone(), stop_housekeeping.clone(), tick_of(&opts), wake.clone());
            Some((
                std::thread::Builder::new()
                    .name("governor-rules".into())
                    .spawn(move || decide_reports(&shared, &fd, &woken, tick, &stop))
                    .map_err(AgentError::Thread)?,
                wake,
            ))
        }
        Some(Err(e)) => {
            log::warn!("rules: cannot wait on the exec reports ({e}): they are read at each tick");
            None
        }
        None => None,
    };
    let background = {
        let (shared, opts, stop) = (shared.clone(), opts.clone(), stop_housekeeping.clone());
        let poll_rules = rules_thread.is_none();
        std::thread::Builder::new()
            .name("governor-tick".into())
            .spawn(move || housekeeping(&shared, &opts, &stop, poll_rules))
            .map_err(AgentError::Thread)?
    };
    let exporter = tokio::spawn(metrics::serve(metrics_listener, shared.clone()));
    let reloader = tokio::spawn(reconfigure::on_sighup(shared.clone()));
    let pd_client = tokio::spawn(pd::run(shared.clone()));
    let result = server::serve(listener, shared.clone(), shutdown).await;
    stop_housekeeping.store(true, Ordering::Release);
    let _ = background.join();
    if let Some((t, wake)) = rules_thread {
        sys::wake(&wake);
        let _ = t.join();
    }
    exporter.abort();
    reloader.abort();
    pd_client.abort();
    if let Some(e) = shared.lock_rules().enforcer.as_mut() {
        e.restore_all();
    }
    let header = shared.policy.regions().header();
    // Clients notice at once (their watch connection closes too) and admit
    // without checks until an agent is back; nobody extrapolates a clock
    // nobody anchors.
    header.agent.stopping.store(1, Ordering::Release);
    header.agent.instance.store(0, Ordering::Release);
    crate::tsc::Calibrator::withdraw(&header.clock);
    result
}

/// The housekeeping period: the timer's, or the refill interval if shorter.
fn tick_of(opts: &AgentOptions) -> Duration {
    let timer = Duration::from_nanos(opts.sizing.timer_period_ns);
    timer.min(opts.config.cpu_throttle().refill_interval.get()).max(Duration::from_millis(1))
}

/// Decides the rule reports (exec, fork, rename) as they arrive, until
/// `stop` (and `wake`). Between reports it wakes once a `tick` while
/// something waits to settle, else once a second (the sweep of lost
/// reports): an agent without rules adds no wakeups of its own.
fn decide_reports(
    shared: &Shared,
    events: &std::os::fd::OwnedFd,
    wake: &std::os::fd::OwnedFd,
    tick: Duration,
    stop: &std::sync::atomic::AtomicBool,
) {
    let mut wait = tick;
    while !stop.load(Ordering::Acquire) {
        sys::ring_buffer_wait(events, wake, wait);
        let mut m = shared.lock_measurement();
        let mut rules = shared.lock_rules();
        rules.poll(&mut m);
        wait = if rules.settling() { tick } else { Duration::from_secs(1) };
    }
}

/// Periodic work: fallback sampling, the TSC clock, the policy's refills
/// and its monitor window, idle eviction, the heartbeat, slot reclaim. It
/// runs on a thread of its own until `stop`: its `/proc` reads (schedstat
/// samples, rule matching) and lock waits never hold up the control
/// socket's runtime.
fn housekeeping(shared: &Shared, opts: &AgentOptions, stop: &std::sync::atomic::AtomicBool, poll_rules: bool) {
    let tick = tick_of(opts);
    // The first tick runs at once; then one per `tick`.
    let mut next = None::<Instant>;
    let mut last_reclaim = Instant::now();
    let mut last_limits = Instant::now();
    let mut last_sample = None::<Instant>;
    // The TSC clock only serves the eBPF backend's thread clock.
    let mut tsc =
        (!shared.lock_measurement().is_fallback() && crate::tsc::usable()).then(crate::tsc::Calibrator::default);
    let mut last_calibration = None::<Instant>;
    loop {
        let header = shared.policy.regions().header();
        if let Some(cal) = tsc.as_mut()
            && last_calibration.is_none_or(|t| t.elapsed() >= crate::tsc::CALIBRATION_PERIOD)
        {
            cal.publish(&header.clock);
            last_calibration = Some(Instant::now());
        }
        // Missed ticks are skipped, not made up in a burst.
        let now = Instant::now();
        let due = next.map_or(now, |n| if n + tick > now { n + tick } else { now });
        next = Some(due);
        std::thread::sleep(due.saturating_duration_since(now));
        if stop.load(Ordering::Acquire) {
            return;
        }
        {
            let mut m = shared.lock_measurement();
            if m.is_fallback() {
                fallback::sample(&m);
            } else if poll_rules {
                shared.lock_rules().poll(&mut m);
            }
        }
        if last_reclaim.elapsed() >= Duration::from_millis(100) {
            let mut m = shared.lock_measurement();
            shared.lock_slots().reclaim(&mut m);
            last_reclaim = Instant::now();
        }
        if last_limits.elapsed() >= Duration::from_secs(1) {
            shared.refresh_server_cpu();
            last_limits = Instant::now();
        }
        let stats = shared.policy.settings().stats_interval_us();
        let sample = if last_sample.is_none_or(|t| t.elapsed() >= Duration::from_micros(stats)) {
            last_sample = Some(Instant::now());
            let servers = shared.servers_ran();
            let m = shared.lock_measurement();
            Some(shared.lock_usage().sample(&m, &shared.policy, &servers))
        } else {
            None
        };
        // Every keyspace cell's charge, for the tenant caps' refills.
        let cpu_ns: Vec<u64> = {
            let m = shared.lock_measurement();
            (0..m.regions.keyspaces.len())
                .map(|c| m.regions.keyspaces.get(c).map_or(0, |k| k.cpu_ns.load(Ordering::Relaxed)))
                .collect()
        };
        shared.policy.tick_with(now_us(), sample.as_ref(), &cpu_ns, || shared.pinned_cells());
        if sample.is_some() {
            // The latency guard's step also scales the rule keyspaces' caps.
            let factors = shared.policy.guard_factors().into_iter().collect();
            shared.lock_rules().guard_caps(&factors, &cpu_ns);
            let (refused, held_back) = shared.held_back();
            shared.autoscale.lock().record(refused, held_back);
        }
        header.agent.heartbeat_ns.store(sys::monotonic_ns(), Ordering::Release);
    }
}
