//! The agent: owns the measurement backend and the shared regions, serves
//! the control socket, reclaims slots and keeps the monitor window.
//!
//! # Layout
//!
//! - [`run`]: starts everything and serves until the shutdown future
//!   resolves (tests pass their own).
//! - `server`: the control socket, one task per connection.
//! - `slots`: thread-slot allocation and reuse.
//! - `window`: per-keyspace ratios over the monitor window.

mod server;
pub mod slots;
pub mod window;

use crate::config::ValidatedConfig;
use crate::measure::{fallback, MeasureError, MeasureMode, Measurement, Sizing};
use crate::proto::{KeyspaceStatus, StatusReport};
use crate::sys;
use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Measure(#[from] MeasureError),
    #[error("cannot listen on the control socket {path}")]
    Listen { path: PathBuf, #[source] source: std::io::Error },
    #[error("another agent is already serving {path}")]
    AlreadyRunning { path: PathBuf },
    #[error("starting the async runtime failed")]
    Runtime(#[source] std::io::Error),
}

/// What the agent runs with, from the configuration and the command line.
#[derive(Clone, Debug)]
pub struct AgentOptions {
    pub socket: PathBuf,
    pub measure: MeasureMode,
    pub sizing: Sizing,
    pub stats_interval: Duration,
    pub window: Duration,
}

impl AgentOptions {
    pub fn from_config(cfg: &ValidatedConfig) -> AgentOptions {
        let a = cfg.agent();
        let rc = cfg.resource_control();
        AgentOptions {
            socket: a.control_socket.clone(),
            measure: a.measure,
            sizing: Sizing {
                max_threads: a.max_threads,
                max_keyspaces: a.max_keyspaces.next_power_of_two(),
                timer_period_ns: a.timer_period.get().as_nanos() as u64,
            },
            stats_interval: rc.stats_interval.get(),
            window: rc.window_size.get(),
        }
    }
}

pub(crate) struct Shared {
    measurement: Mutex<Measurement>,
    slots: Mutex<slots::Slots>,
    window: Mutex<window::Window>,
    started: Instant,
    cores: u32,
}

impl Shared {
    fn lock_measurement(&self) -> MutexGuard<'_, Measurement> {
        self.measurement.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_slots(&self) -> MutexGuard<'_, slots::Slots> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn totals(&self) -> HashMap<u32, u64> {
        let m = self.lock_measurement();
        m.regions.keyspaces.live().map(|(id, _, ns)| (id, ns)).collect()
    }

    pub(crate) fn status(&self) -> StatusReport {
        let m = self.lock_measurement();
        let (span, deltas) = self.window.lock().unwrap_or_else(|p| p.into_inner()).deltas();
        let mut keyspaces: Vec<KeyspaceStatus> = m
            .regions
            .keyspaces
            .live()
            .map(|(id, _, ns)| KeyspaceStatus {
                keyspace_id: id,
                cpu_seconds: ns as f64 / 1e9,
                window_ratio: if span == 0 {
                    0.0
                } else {
                    deltas.get(&id).copied().unwrap_or(0) as f64 / (span as f64 * self.cores as f64)
                },
            })
            .collect();
        keyspaces.sort_by_key(|k| k.keyspace_id);
        let thread_clock_source = if m.is_fallback() {
            "thread-cputime"
        } else if crate::tsc::now_ns(m.regions.header()).is_some() {
            "tsc"
        } else {
            "vdso"
        };
        StatusReport {
            backend: m.kind,
            thread_clock_source: thread_clock_source.to_string(),
            logical_cores: self.cores,
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            window_seconds: span as f64 / 1e9,
            threads: self.lock_slots().stats(),
            keyspaces,
            programs: m.program_stats(),
        }
    }
}

/// Runs the agent until `shutdown` resolves.
pub async fn run(opts: AgentOptions, shutdown: impl Future<Output = ()>) -> Result<(), AgentError> {
    let listener = server::bind(&opts.socket)?;
    let measurement = Measurement::start(opts.measure, opts.sizing)?;
    log::info!(
        "measurement backend: {} ({} thread slots, {} keyspace cells); control socket {}",
        measurement.kind.as_str(),
        measurement.sizes.slots,
        measurement.sizes.keyspaces,
        opts.socket.display()
    );
    let shared = Arc::new(Shared {
        slots: Mutex::new(slots::Slots::new(measurement.sizes.slots)),
        measurement: Mutex::new(measurement),
        window: Mutex::new(window::Window::new(opts.window.as_nanos() as u64)),
        started: Instant::now(),
        cores: sys::logical_cores(),
    });
    let background = tokio::spawn(housekeeping(shared.clone(), opts.clone()));
    let result = server::serve(listener, shared.clone(), shutdown).await;
    background.abort();
    // Clients outlive us: stop them extrapolating a clock nobody anchors.
    crate::tsc::Calibrator::withdraw(shared.lock_measurement().regions.header());
    let _ = std::fs::remove_file(&opts.socket);
    result
}

/// Periodic work: fallback sampling every timer period, slot reclaim, and
/// the monitor window every stats interval.
async fn housekeeping(shared: Arc<Shared>, opts: AgentOptions) {
    let tick = Duration::from_nanos(opts.sizing.timer_period_ns).max(Duration::from_millis(1));
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut last_reclaim = Instant::now();
    let mut last_window = None::<Instant>;
    // The TSC clock only serves the eBPF backend's thread clock.
    let mut tsc = (!shared.lock_measurement().is_fallback() && crate::tsc::usable())
        .then(crate::tsc::Calibrator::default);
    let mut last_calibration = None::<Instant>;
    loop {
        if let Some(cal) = tsc.as_mut() {
            if last_calibration.is_none_or(|t| t.elapsed() >= crate::tsc::CALIBRATION_PERIOD) {
                cal.publish(shared.lock_measurement().regions.header());
                last_calibration = Some(Instant::now());
            }
        }
        interval.tick().await;
        {
            let m = shared.lock_measurement();
            if m.is_fallback() {
                fallback::sample(&m);
            }
        }
        if last_reclaim.elapsed() >= Duration::from_millis(100) {
            let mut m = shared.lock_measurement();
            shared.lock_slots().reclaim(&mut m);
            last_reclaim = Instant::now();
        }
        if last_window.is_none_or(|t| t.elapsed() >= opts.stats_interval) {
            let totals = shared.totals();
            shared.window.lock().unwrap_or_else(|p| p.into_inner()).push(sys::monotonic_ns(), totals);
            last_window = Some(Instant::now());
        }
    }
}
