//! `workload async-server`: a tokio server as a storage engineer writes it
//! from the README: a multi-thread runtime whose workers register through
//! `on_thread_start`, requests admitted by `acquire_async` with a short
//! deadline, and each admitted request's work moved with its (owned) ticket
//! into a task of its own.

use super::{arg, burn, socket};
use anyhow::{Context, Result};
use keyspace_governor::client::{Client, Demand};
use keyspace_governor::sys;
use serde_json::json;
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Default)]
struct Books {
    admitted: AtomicU64,
    completed: AtomicU64,
    refused: AtomicU64,
    fail_open: AtomicU64,
    waited: AtomicU64,
    /// CPU of the work of completed requests, by the thread's clock.
    completed_cpu_ns: AtomicU64,
    /// What the tickets of completed requests were charged (enter mode).
    ticket_consumed_ns: AtomicU64,
    /// Time admitted work waited for top-ups.
    paced_us: AtomicU64,
    /// Admitted requests whose work was dropped at a refused top-up
    /// (`until-deadline` mode).
    dropped: AtomicU64,
}

/// CPU work of `ns` in stretches of `chunk_ns`, yielding between them (the
/// ticket tops up there); returns the CPU it took by the thread clock.
async fn work(ns: u64, chunk_ns: u64) -> u64 {
    let mut done = 0;
    while done < ns {
        let t0 = sys::thread_cputime_ns();
        let end = t0 + chunk_ns.min(ns - done);
        while sys::thread_cputime_ns() < end {
            burn(5);
        }
        done += sys::thread_cputime_ns() - t0;
        tokio::task::yield_now().await;
    }
    done
}

/// `workload async-server --keyspace K --tasks N --workers W --seconds S
/// --deadline-ms D --min-ms A --max-ms B [--mode run|enter|until-deadline]`:
/// N closed-loop clients, each request CPU work drawn log-uniform in [A, B]
/// ms. `run` runs the work with `ticket.run` in a spawned task; `enter` runs
/// each stretch in `ticket.enter()` with `checkpoint_async` between;
/// `until-deadline` with `ticket.run_until_deadline`, which drops the work
/// when a top-up is still refused at the deadline (counted `dropped`). Prints
/// `{"started":true,"workers":[tids]}` once the workers are registered,
/// then waits for a line on stdin before it starts; at the end, after every
/// admitted request finished, prints its books as one JSON line and waits
/// for another line before it exits (the test reads the kernel's count at
/// both edges, with the process stopped).
pub fn async_server(args: &[String]) -> Result<serde_json::Value> {
    let keyspace: u32 = arg(args, "--keyspace", 1);
    let tasks: usize = arg(args, "--tasks", 8);
    let workers: usize = arg(args, "--workers", 2);
    let seconds: f64 = arg(args, "--seconds", 8.0);
    let deadline = Duration::from_millis(arg(args, "--deadline-ms", 50));
    let (min_ms, max_ms): (f64, f64) = (arg(args, "--min-ms", 1.0), arg(args, "--max-ms", 20.0));
    let mode = arg(args, "--mode", "run".to_string());
    anyhow::ensure!(["run", "enter", "until-deadline"].contains(&mode.as_str()), "unknown --mode {mode:?}");
    let (enter_mode, abort_mode) = (mode == "enter", mode == "until-deadline");
    let client = Client::connect(socket(args))?;
    let registered = Arc::new(AtomicU64::new(0));
    let tids = Arc::new(std::sync::Mutex::new(Vec::new()));
    let rt = {
        let (c, n, tids) = (client.clone(), registered.clone(), tids.clone());
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .on_thread_start(move || match c.register_current_thread() {
                Ok(()) => {
                    tids.lock().unwrap().push(sys::gettid());
                    n.fetch_add(1, Ordering::SeqCst);
                }
                Err(e) => eprintln!("registering a worker: {e}"),
            })
            .build()?
    };
    // Workers start with the runtime; wait until each is registered.
    let t0 = Instant::now();
    while registered.load(Ordering::SeqCst) < workers as u64 {
        anyhow::ensure!(t0.elapsed() < Duration::from_secs(10), "workers not registered in 10 s");
        std::thread::sleep(Duration::from_millis(1));
    }
    println!("{}", json!({"started": true, "workers": *tids.lock().unwrap()}));
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).context("waiting for go")?;
    let books = Arc::new(Books::default());
    let started = Instant::now();
    let end = started + Duration::from_secs_f64(seconds);
    rt.block_on(async {
        let clients: Vec<_> = (0..tasks)
            .map(|i| {
                let (client, books) = (client.clone(), books.clone());
                tokio::spawn(async move {
                    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (i as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                    while Instant::now() < end {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        let u = (rng >> 11) as f64 / (1u64 << 53) as f64;
                        let ms = min_ms * (max_ms / min_ms).powf(u);
                        let ns = (ms * 1e6) as u64;
                        let ticket = match client.acquire_async(keyspace, Demand::new().timeout(deadline)).await {
                            Ok(t) => t,
                            Err(_) => {
                                books.refused.fetch_add(1, Ordering::Relaxed);
                                continue;
                            }
                        };
                        books.admitted.fetch_add(1, Ordering::Relaxed);
                        if ticket.is_fail_open() {
                            books.fail_open.fetch_add(1, Ordering::Relaxed);
                        }
                        if ticket.did_wait() {
                            books.waited.fetch_add(1, Ordering::Relaxed);
                        }
                        // The ticket moves into a task of its own (owned,
                        // Send), as a server hands a request to a handler.
                        let books2 = books.clone();
                        let handler = tokio::spawn(async move {
                            if enter_mode {
                                let mut ticket = ticket;
                                let mut done = 0;
                                while done < ns {
                                    {
                                        let _g = ticket.enter();
                                        let t0 = sys::thread_cputime_ns();
                                        let stop = t0 + 1_000_000u64.min(ns - done);
                                        while sys::thread_cputime_ns() < stop {
                                            burn(5);
                                        }
                                        done += sys::thread_cputime_ns() - t0;
                                    }
                                    ticket.checkpoint_async().await;
                                    tokio::task::yield_now().await;
                                }
                                books2.ticket_consumed_ns.fetch_add(ticket.consumed_ns(), Ordering::Relaxed);
                                books2.paced_us.fetch_add(ticket.paced().as_micros() as u64, Ordering::Relaxed);
                                Some(done)
                            } else if abort_mode {
                                ticket.run_until_deadline(work(ns, 1_000_000)).await.ok()
                            } else {
                                Some(ticket.run(work(ns, 1_000_000)).await)
                            }
                        });
                        let Some(cpu) = handler.await.expect("handler panicked") else {
                            books.dropped.fetch_add(1, Ordering::Relaxed);
                            continue;
                        };
                        books.completed.fetch_add(1, Ordering::Relaxed);
                        books.completed_cpu_ns.fetch_add(cpu, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for c in clients {
            c.await.expect("client task panicked");
        }
    });
    let elapsed = started.elapsed().as_secs_f64();
    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let report = json!({
        "loop_seconds": elapsed,
        "admitted": l(&books.admitted),
        "completed": l(&books.completed),
        "refused": l(&books.refused),
        "fail_open": l(&books.fail_open),
        "waited": l(&books.waited),
        "completed_cpu_ns": l(&books.completed_cpu_ns),
        "ticket_consumed_ns": l(&books.ticket_consumed_ns),
        "paced_us": l(&books.paced_us),
        "dropped": l(&books.dropped),
        "fail_open_count": client.fail_open_count(),
    });
    // The workers stay (parked, registered) until the test has read the
    // kernel's count of them at a stopped point.
    println!("{report}");
    std::io::stdout().flush()?;
    std::io::stdin().read_line(&mut line).context("waiting for exit")?;
    drop(rt);
    Ok(json!({"exited": true}))
}
