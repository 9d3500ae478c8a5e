//! Runtime workers one to a CPU ([`CpuSpread`]), and a watch that lets
//! them go while other processes hold those CPUs.

use super::clock::{clock_ticks_per_second, monotonic_ns, process_cputime_ns};
use super::cpu::{current_thread_cpus, set_current_thread_cpus};
use std::cell::Cell;
use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// How often the watch reads the CPUs' time.
const WATCH_PERIOD: Duration = Duration::from_millis(500);
/// Other processes' CPU, in cores over one [`WATCH_PERIOD`], from which
/// the workers are let go.
const LET_GO_CORES: f64 = 0.5;
/// Other processes' CPU, in cores, at or under which the workers are
/// pinned again after [`CALM_PERIODS`] periods in a row.
const PIN_AGAIN_CORES: f64 = 0.3;
/// Periods in a row under [`PIN_AGAIN_CORES`] before the workers are
/// pinned again.
const CALM_PERIODS: u32 = 2;

/// One CPU for each of a runtime's worker threads, in turn: for a server
/// whose pool has about as many workers as it has CPUs.
///
/// Left to itself, the kernel may place a woken worker on the CPU where
/// another worker runs, when the other CPU is busy for a moment (a network
/// thread's few µs), and an idle CPU does not pull it back while its idle
/// stretches are shorter than the scheduler's migration cost (0.5 ms): two
/// workers then share one core, a slice each in turn, while the other core
/// idles, and a request that arrives waits for a slice. One worker per CPU
/// keeps them apart.
///
/// Pinning also keeps a worker where it is when another process takes its
/// CPU. [`CpuSpread::watch_other_processes`] guards against that: while
/// processes other than this one take half a core or more of the
/// spread's CPUs over a half-second period, the workers run on all of
/// them, as the kernel places them; once the others have stayed at or
/// under 0.3 cores for two periods, each worker goes back to its CPU. A
/// worker follows at its next park (or [`CpuSpread::at_idle`]).
///
/// ```no_run
/// # struct Builder; impl Builder { fn on_thread_park(self, _f: impl Fn() + Send + Sync + 'static) -> Self { self } }
/// # let builder = Builder;
/// let spread = keyspace_governor::client::CpuSpread::new()?;
/// spread.watch_other_processes()?;
/// let builder = builder.on_thread_park(spread.pin_on_park());
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct CpuSpread {
    inner: Arc<SpreadInner>,
}

#[derive(Debug)]
struct SpreadInner {
    cpus: Vec<u32>,
    next: AtomicUsize,
    /// Even: workers keep to their CPU; odd: they run on all of `cpus`. It
    /// moves by one at each change, so a worker that applied a value knows
    /// whether it is still current.
    mode: AtomicU64,
    /// Other processes' CPU on the spread's CPUs over the watch's last
    /// period, in thousandths of a core (`u64::MAX`: not watched yet).
    others_millicores: AtomicU64,
}

thread_local! {
    /// The calling thread's CPU in a spread, and the mode it applied last.
    static PLACE: Cell<Option<(u32, u64)>> = const { Cell::new(None) };
}

impl CpuSpread {
    /// The CPUs the calling thread may run on now (its affinity mask, as
    /// its cgroup's cpuset and `taskset` left it), lowest first.
    pub fn new() -> io::Result<CpuSpread> {
        let cpus = current_thread_cpus()?;
        Ok(CpuSpread {
            inner: Arc::new(SpreadInner {
                cpus,
                next: AtomicUsize::new(0),
                mode: AtomicU64::new(0),
                others_millicores: AtomicU64::new(u64::MAX),
            }),
        })
    }

    /// The CPUs handed out in turn.
    pub fn cpus(&self) -> &[u32] {
        &self.inner.cpus
    }

    /// Whether workers keep to their CPU now (false while the watch has
    /// let them go).
    pub fn pinning(&self) -> bool {
        self.inner.mode.load(Ordering::Relaxed).is_multiple_of(2)
    }

    /// Times the watch let the workers go so far.
    pub fn times_let_go(&self) -> u64 {
        self.inner.mode.load(Ordering::Relaxed).div_ceil(2)
    }

    /// Other processes' CPU on the spread's CPUs over the watch's last
    /// period, in cores; `None` before its first period or without a watch.
    pub fn other_processes_cores(&self) -> Option<f64> {
        let m = self.inner.others_millicores.load(Ordering::Relaxed);
        (m != u64::MAX).then(|| m as f64 / 1000.0)
    }

    /// Pins the calling thread to the next CPU in turn (after the last, the
    /// first again) and returns it. A later [`CpuSpread::at_idle`] keeps
    /// the thread on that CPU, or lets it go while the watch says so.
    pub fn pin_current_thread(&self) -> io::Result<u32> {
        let cpu = self.next_cpu()?;
        // No mode applied yet: the next `at_idle` applies the current one.
        PLACE.with(|p| p.set(Some((cpu, u64::MAX))));
        set_current_thread_cpus(&[cpu])?;
        Ok(cpu)
    }

    fn next_cpu(&self) -> io::Result<u32> {
        let cpus = &self.inner.cpus;
        if cpus.is_empty() {
            return Err(io::Error::new(io::ErrorKind::NotFound, "no CPU in the affinity mask"));
        }
        Ok(cpus[self.inner.next.fetch_add(1, Ordering::Relaxed) % cpus.len()])
    }

    /// Where a worker goes idle: the first call gives the thread its CPU
    /// (the next in turn); later ones follow the watch, onto all of the
    /// spread's CPUs while it has let the workers go, and back to the
    /// thread's own after. A thread-local check and one atomic load when
    /// nothing changed. A failure is logged, not raised (and not tried
    /// again until the watch changes its mind): the thread runs where the
    /// kernel puts it.
    pub fn at_idle(&self) {
        let mode = self.inner.mode.load(Ordering::Relaxed);
        let place = PLACE.with(|p| p.get());
        if place.is_some_and(|(_, applied)| applied == mode) {
            return;
        }
        let result = place.map_or_else(|| self.next_cpu(), |(cpu, _)| Ok(cpu)).and_then(|cpu| {
            PLACE.with(|p| p.set(Some((cpu, mode))));
            if mode.is_multiple_of(2) {
                set_current_thread_cpus(&[cpu])
            } else {
                set_current_thread_cpus(&self.inner.cpus)
            }
        });
        if let Err(e) = result {
            // Not again for this mode.
            PLACE.with(|p| p.set(Some((place.map_or(0, |(cpu, _)| cpu), mode))));
            log::warn!("setting the CPUs of a runtime worker: {e}");
        }
    }

    /// For tokio's `Builder::on_thread_park`: [`CpuSpread::at_idle`] at
    /// each park (a worker parks as soon as it starts idle). A
    /// blocking-pool thread does not park this way and is left alone. To
    /// register the workers too, call both closures from one
    /// `on_thread_park`.
    pub fn pin_on_park(&self) -> impl Fn() + Send + Sync + 'static {
        let spread = self.clone();
        move || spread.at_idle()
    }

    /// Starts a thread that reads, every half second, how much of the
    /// spread's CPUs processes other than this one took (`/proc/stat`'s busy
    /// time on those CPUs less this process's CPU time), and lets the
    /// workers go or pins them again (see [`CpuSpread`]). It ends when the
    /// last clone of the spread is dropped. Changes are logged.
    pub fn watch_other_processes(&self) -> io::Result<()> {
        let cpus = self.inner.cpus.clone();
        let first = Sample::take(&cpus)?;
        let inner = Arc::downgrade(&self.inner);
        std::thread::Builder::new().name("governor-spread".into()).spawn(move || watch(inner, cpus, first))?;
        Ok(())
    }
}

/// Busy time of the spread's CPUs and this process's CPU time, at once.
#[derive(Clone, Copy, Debug)]
struct Sample {
    at_ns: u64,
    busy_ns: u64,
    own_ns: u64,
}

impl Sample {
    fn take(cpus: &[u32]) -> io::Result<Sample> {
        let stat = std::fs::read_to_string("/proc/stat")?;
        let ticks = busy_ticks(&stat, cpus)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "/proc/stat lists none of the spread's CPUs"))?;
        Ok(Sample {
            at_ns: monotonic_ns(),
            busy_ns: ticks.saturating_mul(1_000_000_000) / clock_ticks_per_second(),
            own_ns: process_cputime_ns(),
        })
    }

    /// Other processes' CPU between `self` and `later`, in cores.
    fn others_cores(&self, later: &Sample) -> f64 {
        let wall = later.at_ns.saturating_sub(self.at_ns).max(1) as f64;
        let busy = later.busy_ns.saturating_sub(self.busy_ns);
        let own = later.own_ns.saturating_sub(self.own_ns);
        busy.saturating_sub(own) as f64 / wall
    }
}

/// Busy time (user, nice, system, irq, softirq; not idle, iowait or
/// steal) of `cpus` in `/proc/stat`, in clock ticks; `None` when none of
/// them is listed.
fn busy_ticks(stat: &str, cpus: &[u32]) -> Option<u64> {
    let mut found = false;
    let mut sum = 0u64;
    for line in stat.lines() {
        let mut fields = line.split_whitespace();
        let Some(cpu) = fields.next().and_then(|n| n.strip_prefix("cpu")).and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if !cpus.contains(&cpu) {
            continue;
        }
        let v: Vec<u64> = fields.map(|f| f.parse().unwrap_or(0)).collect();
        let at = |i: usize| v.get(i).copied().unwrap_or(0);
        sum += at(0) + at(1) + at(2) + at(5) + at(6);
        found = true;
    }
    found.then_some(sum)
}

/// The watch's decision: whether the workers keep to their CPUs.
#[derive(Debug, Default)]
struct Decide {
    calm: u32,
}

impl Decide {
    /// After a period in which other processes took `others` cores: the
    /// new setting when it changes.
    fn step(&mut self, pinning: bool, others: f64) -> Option<bool> {
        if pinning {
            self.calm = 0;
            return (others >= LET_GO_CORES).then_some(false);
        }
        if others > PIN_AGAIN_CORES {
            self.calm = 0;
            return None;
        }
        self.calm += 1;
        (self.calm >= CALM_PERIODS).then(|| {
            self.calm = 0;
            true
        })
    }
}

fn watch(inner: Weak<SpreadInner>, cpus: Vec<u32>, mut last: Sample) {
    let mut decide = Decide::default();
    loop {
        std::thread::sleep(WATCH_PERIOD);
        let Some(inner) = inner.upgrade() else { return };
        let now = match Sample::take(&cpus) {
            Ok(s) => s,
            Err(e) => {
                log::warn!("reading the CPUs' busy time for the spread of workers: {e}; it stops watching");
                return;
            }
        };
        let others = last.others_cores(&now);
        last = now;
        inner.others_millicores.store((others * 1000.0).round() as u64, Ordering::Relaxed);
        let mode = inner.mode.load(Ordering::Relaxed);
        if let Some(pin) = decide.step(mode.is_multiple_of(2), others) {
            inner.mode.store(mode + 1, Ordering::Relaxed);
            if pin {
                log::info!(
                    "other processes took {others:.2} cores of CPUs {cpus:?}: the workers keep to a CPU each again"
                );
            } else {
                log::info!("other processes took {others:.2} cores of CPUs {cpus:?}: the workers run on all of them");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "cpu  500 0 300 9000 10 5 5 40 0 0
cpu0 100 10 100 4500 10 3 2 20 0 0
cpu1 400 0 200 4500 0 2 3 20 0 0
intr 12345
ctxt 999
";

    #[test]
    fn busy_time_counts_the_spreads_cpus_without_idle_iowait_or_steal() {
        assert_eq!(busy_ticks(STAT, &[0]), Some(100 + 10 + 100 + 3 + 2));
        assert_eq!(busy_ticks(STAT, &[0, 1]), Some(215 + 605));
        assert_eq!(busy_ticks(STAT, &[1]), Some(605));
        assert_eq!(busy_ticks(STAT, &[7]), None, "a CPU /proc/stat does not list");
    }

    #[test]
    fn other_processes_are_the_busy_time_less_this_process() {
        let a = Sample { at_ns: 0, busy_ns: 10_000_000_000, own_ns: 3_000_000_000 };
        // Half a second: 0.8 s busy on the CPUs, 0.3 s of it this process's.
        let b = Sample { at_ns: 500_000_000, busy_ns: 10_800_000_000, own_ns: 3_300_000_000 };
        assert!((a.others_cores(&b) - 1.0).abs() < 1e-9, "{}", a.others_cores(&b));
        // This process's precise clock ahead of the ticks: no one else.
        let c = Sample { at_ns: 1_000_000_000, busy_ns: 10_800_000_000, own_ns: 3_400_000_000 };
        assert_eq!(b.others_cores(&c), 0.0);
    }

    #[test]
    fn workers_are_let_go_at_half_a_core_and_pinned_again_after_two_calm_periods() {
        let mut d = Decide::default();
        assert_eq!(d.step(true, 0.49), None, "under half a core: kept");
        assert_eq!(d.step(true, 0.5), Some(false), "half a core: let go");
        assert_eq!(d.step(false, 0.2), None, "one calm period");
        assert_eq!(d.step(false, 0.4), None, "not calm: counted again");
        assert_eq!(d.step(false, 0.3), None);
        assert_eq!(d.step(false, 0.1), Some(true), "two calm periods in a row: pinned again");
        assert_eq!(d.step(true, 0.45), None, "between the two bounds: kept pinned");
    }
}
