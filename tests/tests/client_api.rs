//! The client library against a real agent, in-process: nested tag guards
//! restore the previous tag, the `Tagged` future charges exactly its polls,
//! and the thread clock follows CLOCK_THREAD_CPUTIME_ID.

use governor_tests::Agent;
use keyspace_governor::client::{self, Client, TaggedExt};
use keyspace_governor::sys;
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

fn burn(d: Duration) {
    let t = Instant::now();
    let mut x = 1u64;
    while t.elapsed() < d {
        for i in 0..1000 {
            x = x.rotate_left(3) ^ i;
        }
    }
    std::hint::black_box(x);
}

/// This thread's on-CPU ns spent in `f`, on the thread clock the agent
/// charges by (the same timeline as the charges, so tag bookkeeping is
/// checked without the clocks' own differences; those are checked in
/// `thread_clock_follows_the_cpu_clock` and the measurement tests).
fn cpu_of(f: impl FnOnce()) -> u64 {
    let t = client::thread_cpu_ns().expect("registered");
    f();
    client::thread_cpu_ns().expect("registered") - t
}

fn charged(c: &Client, ks: u32) -> u64 {
    c.keyspace_cpu_ns(ks).unwrap_or(0)
}

/// `a` matches `truth` within `rel` (plus 0.3 ms). Over-charging may also
/// include up to `steal` ns: the eBPF side measures on CLOCK_MONOTONIC, which
/// counts time the hypervisor stole from a running vCPU; thread CPU clocks
/// do not.
fn close(a: u64, truth: u64, rel: f64, steal: u64) -> bool {
    let (a, t) = (a as f64, truth as f64);
    a >= t * (1.0 - rel) - 300_000.0 && a <= t * (1.0 + rel) + 300_000.0 + steal as f64
}

/// This thread's clock now.
fn now() -> u64 {
    client::thread_cpu_ns().expect("registered")
}

/// A keyspace's charge `a` is at least the work measured inside its tag
/// (`inside`) and at most the CPU of the span from before the tag was set
/// to after it was restored (`span`), each within 1 % and 0.3 ms (the
/// kernel corrects the thread clock at each switch-out). Tagging's own
/// cost lies between the two: a slow machine (an emulated CPU) widens the
/// gap, it cannot move a charge out of it.
fn within(a: u64, inside: u64, span: u64) -> bool {
    let (a, lo, hi) = (a as f64, inside as f64, span as f64);
    a >= lo * 0.99 - 300_000.0 && a <= hi * 1.01 + 300_000.0
}

fn nested_guards_restore_the_previous_tag(measure: &str) {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let agent = Agent::start(measure, "").unwrap();
    let c = Client::connect(&agent.socket).unwrap();
    let c2 = c.clone();
    let (outer, inner, span_a, span_b, untagged) = std::thread::spawn(move || {
        c2.register_current_thread().unwrap();
        // Cells looked up before the measured work: a first tag's agent
        // round trip goes to the tag before it (set_tag says so), which is
        // not what this test measures.
        drop(client::tag(11).unwrap());
        drop(client::tag(12).unwrap());
        let mut outer = 0;
        let mut inner = 0;
        let a0 = now();
        let span_b;
        {
            let _a = client::tag(11).unwrap();
            outer += cpu_of(|| burn(Duration::from_millis(60)));
            let b0 = now();
            {
                let _b = client::tag(12).unwrap();
                inner += cpu_of(|| burn(Duration::from_millis(30)));
            }
            span_b = now() - b0;
            // Back on 11, not on "no keyspace".
            outer += cpu_of(|| burn(Duration::from_millis(60)));
        }
        let span_a = now() - a0;
        let untagged = cpu_of(|| burn(Duration::from_millis(40)));
        assert!(client::thread_cpu_ns().is_some());
        client::unregister_current_thread();
        (outer, inner, span_a, span_b, untagged)
    })
    .join()
    .unwrap();
    let (k11, k12) = (charged(&c, 11), charged(&c, 12));
    eprintln!(
        "{measure}: ks11 {k11} (work {outer}, span {span_a}), ks12 {k12} (work {inner}, span {span_b}), untagged {untagged}"
    );
    // 11's span holds 12's: at most what of it is not 12's work.
    assert!(within(k11, outer, span_a - inner), "ks 11: {k11} vs {outer}..{}", span_a - inner);
    assert!(within(k12, inner, span_b), "ks 12: {k12} vs {inner}..{span_b}");
}

#[test]
fn nested_guards_restore_the_previous_tag_ebpf() {
    nested_guards_restore_the_previous_tag("ebpf");
}

#[test]
fn nested_guards_restore_the_previous_tag_thread_clock() {
    nested_guards_restore_the_previous_tag("thread-clock");
}

/// Burns `per_poll` on each poll, `polls` times.
struct Work {
    left: u32,
    per_poll: Duration,
    spent: u64,
}

impl Future for Work {
    type Output = u64;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<u64> {
        let d = self.per_poll;
        self.spent += cpu_of(|| burn(d));
        self.left -= 1;
        if self.left == 0 {
            Poll::Ready(self.spent)
        } else {
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }
}

#[test]
fn tagged_future_charges_exactly_its_polls() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let agent = Agent::start("ebpf", "").unwrap();
    let c = Client::connect(&agent.socket).unwrap();
    let c2 = c.clone();
    let (in_polls, polls, between, span) = std::thread::spawn(move || {
        c2.register_current_thread().unwrap();
        // Cells looked up first (see nested_guards_restore_the_previous_tag).
        drop(client::tag(21).unwrap());
        drop(client::tag(22).unwrap());
        let w0 = now();
        let _worker = client::tag(21).unwrap();
        let mut fut = std::pin::pin!(Work { left: 10, per_poll: Duration::from_millis(5), spent: 0 }.tagged(22));
        let mut cx = Context::from_waker(Waker::noop());
        let (mut between, mut polls) = (0, 0);
        let in_polls = loop {
            let p0 = now();
            let p = fut.as_mut().poll(&mut cx);
            polls += now() - p0;
            match p {
                Poll::Ready(v) => break v,
                // The executor's own work between polls belongs to the worker's tag.
                Poll::Pending => between += cpu_of(|| burn(Duration::from_millis(5))),
            }
        };
        drop(_worker);
        let span = now() - w0;
        client::unregister_current_thread();
        (in_polls, polls, between, span)
    })
    .join()
    .unwrap();
    let (k21, k22) = (charged(&c, 21), charged(&c, 22));
    eprintln!("future ks22 {k22} (work {in_polls}, polls {polls}); worker ks21 {k21} (between {between}, span {span})");
    assert!(within(k22, in_polls, polls), "future keyspace: {k22} vs {in_polls}..{polls}");
    assert!(within(k21, between, span - in_polls), "worker keyspace: {k21} vs {between}..{}", span - in_polls);
}

#[test]
fn thread_clock_follows_the_cpu_clock() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let agent = Agent::start("ebpf", "").unwrap();
    let c = Client::connect(&agent.socket).unwrap();
    let steal0 = governor_tests::steal_ns();
    std::thread::spawn(move || {
        assert_eq!(client::thread_cpu_ns(), None, "unregistered threads have no clock");
        c.register_current_thread().unwrap();
        assert!(matches!(c.register_current_thread(), Err(client::ClientError::AlreadyRegistered)));
        let (a, ta) = (client::thread_cpu_ns().unwrap(), sys::thread_cputime_ns());
        burn(Duration::from_millis(600));
        std::thread::sleep(Duration::from_millis(50)); // off-CPU time is not counted
        burn(Duration::from_millis(400));
        let (b, tb) = (client::thread_cpu_ns().unwrap(), sys::thread_cputime_ns());
        let (ours, truth) = (b - a, tb - ta);
        // /proc/stat counts steal in whole ticks per CPU: allow one more.
        let steal = governor_tests::steal_ns() - steal0 + governor_tests::steal_tick_ns() * 2;
        eprintln!("thread clock {ours} ns vs CLOCK_THREAD_CPUTIME_ID {truth} ns; steal bound {steal}");
        assert!(close(ours, truth, 0.01, steal), "{ours} vs {truth}");
    })
    .join()
    .unwrap();
}

#[test]
fn agent_publishes_the_tsc_clock_where_the_kernel_keeps_time_on_it() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let agent = Agent::start("ebpf", "").unwrap();
    // Published once the agent has two calibration anchors (100 ms apart).
    let want = if keyspace_governor::tsc::usable() { "tsc" } else { "vdso" };
    governor_tests::eventually(&format!("thread clock source {want}"), || {
        agent.status().unwrap().thread_clock_source == want
    });
    let fallback = Agent::start("thread-clock", "").unwrap();
    assert_eq!(fallback.status().unwrap().thread_clock_source, "thread-cputime");
}

#[test]
fn a_forked_child_leaves_the_parents_registration_alone() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let agent = Agent::start("ebpf", "").unwrap();
    let c = Client::connect(&agent.socket).unwrap();
    let c2 = c.clone();
    let socket = agent.socket.clone();
    std::thread::spawn(move || {
        c2.register_current_thread().unwrap();
        let forked_tagged = client::tag(31).unwrap();
        #[allow(unsafe_code)]
        // SAFETY: the child only calls the client library and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // The child has no registration: tags are no-ops, the clock is
            // absent, talking on the parent's connection is refused; its
            // exit (which runs thread-local destructors) must not unregister
            // the parent's thread.
            let ok = client::thread_cpu_ns().is_none()
                && client::tag(32).is_ok()
                && matches!(c2.register_current_thread(), Err(client::ClientError::Forked { .. }));
            std::process::exit(if ok { 0 } else { 3 });
        }
        let mut status = 0;
        #[allow(unsafe_code)]
        // SAFETY: waits for the child just forked.
        unsafe {
            libc::waitpid(pid, &mut status, 0)
        };
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child status {status}");
        // The parent is still registered and still charged. What the fork
        // took, tagged, is settled first (a fork is milliseconds in an
        // emulated guest, and the parent need not have switched out since).
        drop(forked_tagged);
        let before = c2.keyspace_cpu_ns(31).unwrap_or(0);
        let outer = sys::thread_cputime_ns();
        let tagged = client::tag(31).unwrap();
        let spent = cpu_of(|| burn(Duration::from_millis(50)));
        drop(tagged);
        let outer = sys::thread_cputime_ns() - outer;
        let charged = c2.keyspace_cpu_ns(31).unwrap() - before;
        eprintln!("charged {charged} ns: the burn {spent} ns, the thread {outer} ns from before the tag to after it");
        // All of the burn, and no more than the thread ran from before the
        // tag to after it by CLOCK_THREAD_CPUTIME_ID. Bounded by the burn
        // alone, CI read 55.3 ms charged for a 50.1 ms burn in the emulated
        // x86_64 guest, once in many runs (72 runs there read 0.26 ms more
        // at most): the kernel's count of the whole tagged stretch tells a
        // slow stretch around the burn from an overcharge. The millisecond
        // covers the two clocks' reads.
        assert!(
            charged >= spent && charged <= outer + 1_000_000,
            "charged {charged} ns for a {spent} ns burn; the thread ran {outer} ns"
        );
        assert_eq!(c2.keyspace_cpu_ns(32), None, "the child created keyspace 32");
        let status = keyspace_governor::cli::status::run(&socket).unwrap();
        assert_eq!(status.threads.registered, 1, "the parent's slot was given back");
    })
    .join()
    .unwrap();
}
