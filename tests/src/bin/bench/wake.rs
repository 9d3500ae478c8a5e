//! What a wakeup costs in time on this machine, apart from governor: a
//! thread asleep on a CPU that has gone idle, woken from another CPU. The
//! demo's light requests take such wakeups (the request's worker, the
//! client's reader) whenever their threads sit on different CPUs; in a VM
//! whose idle CPUs halt, each one waits for the host to run the vCPU again.

use super::adoption::percentile;
use keyspace_governor::sys;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// The machine's idle-wake figures.
pub struct IdleWake {
    /// From the waker's unpark to the sleeper running, µs (p50, p99);
    /// `None` on a single CPU.
    pub latency_us: Option<(f64, f64)>,
    /// How long an idle CPU of this guest polls before it halts
    /// (`haltpoll`'s `guest_halt_poll_ns`); `None` where there is no such
    /// driver (bare metal, or another cpuidle driver).
    pub halt_poll_ns: Option<u64>,
}

/// `wakes` wakeups, each `gap` after the last was taken (long enough for
/// the sleeper's CPU to go idle): the sleeper on the second online CPU,
/// the waker on the first.
pub fn idle_wake(wakes: u32, gap: Duration) -> IdleWake {
    let halt_poll_ns = std::fs::read_to_string("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
        .ok()
        .and_then(|s| s.trim().parse().ok());
    let cpus = sys::online_cpus().unwrap_or_default();
    let (Some(&waker_cpu), Some(&sleeper_cpu)) = (cpus.first(), cpus.get(1)) else {
        return IdleWake { latency_us: None, halt_poll_ns };
    };
    let go = Arc::new(AtomicU32::new(0));
    let woken_at = Arc::new(AtomicU64::new(0));
    let taken = Arc::new(AtomicU32::new(0));
    let (go2, woken_at2, taken2) = (go.clone(), woken_at.clone(), taken.clone());
    let (tx, rx) = std::sync::mpsc::channel::<std::thread::Thread>();
    let sleeper = std::thread::spawn(move || {
        let _ = sys::pin_current_thread_to(sleeper_cpu);
        tx.send(std::thread::current()).unwrap();
        let mut v = Vec::with_capacity(wakes as usize);
        for i in 1..=wakes {
            while go2.load(Ordering::Acquire) < i {
                std::thread::park();
            }
            let at = sys::monotonic_ns();
            v.push(at.saturating_sub(woken_at2.load(Ordering::Acquire)) as f64 / 1e3);
            taken2.store(i, Ordering::Release);
        }
        v
    });
    let mask = sys::current_thread_cpus().unwrap_or_else(|_| cpus.clone());
    let _ = sys::pin_current_thread_to(waker_cpu);
    let t = rx.recv().unwrap();
    for i in 1..=wakes {
        std::thread::sleep(gap);
        woken_at.store(sys::monotonic_ns(), Ordering::Release);
        go.store(i, Ordering::Release);
        t.unpark();
        while taken.load(Ordering::Acquire) < i {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    let _ = sys::set_current_thread_cpus(&mask);
    let mut v = sleeper.join().unwrap();
    IdleWake { latency_us: Some((percentile(&mut v, 0.5), percentile(&mut v, 0.99))), halt_poll_ns }
}
