//! The seam's test double: what this thread's CPU, clocks and TSC read in
//! a unit test, and what its futex waits and wakes do, set by the test; a
//! call the test did not set goes to the kernel as ever.

use std::cell::RefCell;

/// What the faked calls return on this thread.
#[derive(Default)]
pub(crate) struct Fake {
    /// `current_cpu`: called at every read, so a test can move the thread
    /// (or the memory it reads) between two reads.
    pub cpu: Option<Box<dyn FnMut() -> u32>>,
    pub monotonic_ns: Option<u64>,
    pub thread_cputime_ns: Option<u64>,
    /// `rdtsc`: `Some(None)` is a machine without a TSC.
    pub tsc: Option<Option<u64>>,
    /// `futex_wait_bits`, called with (the waiter's bits, its absolute
    /// deadline) instead of sleeping: what happens while the thread would
    /// sleep (a refill, time passing) is the test's to do, as the agent or
    /// the clock would. It may change the other fakes.
    pub futex_wait: Option<Box<dyn FnMut(u32, u64)>>,
    /// When set, every `futex_wake_bits` and `futex_wake` is recorded here
    /// (their bits; `u32::MAX` for a plain wake) instead of made.
    pub wakes: Option<Vec<u32>>,
}

thread_local! {
    static FAKE: RefCell<Option<Fake>> = const { RefCell::new(None) };
}

/// Sets this thread's double until the guard drops.
pub(crate) fn install(f: Fake) -> Installed {
    FAKE.with(|c| *c.borrow_mut() = Some(f));
    Installed(())
}

/// Changes this thread's double (one must be installed).
pub(crate) fn set(f: impl FnOnce(&mut Fake)) {
    FAKE.with(|c| f(c.borrow_mut().as_mut().expect("a fake installed on this thread")));
}

/// Removes the double when dropped.
pub(crate) struct Installed(());

impl Drop for Installed {
    fn drop(&mut self) {
        FAKE.with(|c| *c.borrow_mut() = None);
    }
}

fn read<R>(f: impl FnOnce(&mut Fake) -> Option<R>) -> Option<R> {
    FAKE.with(|c| c.try_borrow_mut().ok()?.as_mut().and_then(f))
}

pub(super) fn cpu() -> Option<u32> {
    // Taken out while it runs, so the closure may read the other fakes.
    let mut f = read(|f| f.cpu.take())?;
    let cpu = f();
    read(|x| {
        x.cpu = Some(f);
        Some(())
    });
    Some(cpu)
}

/// Runs the test's `futex_wait`; `None` when it set none.
pub(super) fn futex_wait(bits: u32, deadline_ns: u64) -> Option<()> {
    // Taken out while it runs, so the closure may read and set the others.
    let mut f = read(|f| f.futex_wait.take())?;
    f(bits, deadline_ns);
    read(|x| {
        x.futex_wait = Some(f);
        Some(())
    });
    Some(())
}

/// Records a wake; `None` when the test records none.
pub(super) fn futex_wake(bits: u32) -> Option<()> {
    read(|f| f.wakes.as_mut().map(|w| w.push(bits)))
}

/// The wakes recorded so far, taken.
pub(crate) fn take_wakes() -> Vec<u32> {
    read(|f| f.wakes.as_mut().map(std::mem::take)).unwrap_or_default()
}

pub(super) fn monotonic_ns() -> Option<u64> {
    read(|f| f.monotonic_ns)
}

pub(super) fn thread_cputime_ns() -> Option<u64> {
    read(|f| f.thread_cputime_ns)
}

pub(super) fn tsc() -> Option<Option<u64>> {
    read(|f| f.tsc)
}
