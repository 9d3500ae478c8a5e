//! A thread-pool server governed by the agent: registered worker threads
//! take a blocking ticket per request, run its work inside the ticket, and
//! pace at checkpoints between stretches of work.
//!
//! ```text
//! cargo run --release -p keyspace-governor --example thread_pool_server -- /run/governor/governor.sock 127.0.0.1:7401
//! exec 3<>/dev/tcp/127.0.0.1/7401; printf '7 2000\n' >&3; head -1 <&3  # 2 ms of CPU for keyspace 7
//! ```
//! The request protocol is in `common/mod.rs`. One worker serves one
//! connection at a time; a connection that finds every worker busy and the
//! queue full is turned away, and counted as a pool rejection.

mod common;

use keyspace_governor::client::{Client, Demand};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const WORKERS: usize = 4;
/// Workers that may wait in line for tokens at once: a worker in line
/// serves nobody, so a tenant held at its cap must not take the whole pool.
const MAX_WAITING: usize = WORKERS / 2;
static WAITING: AtomicUsize = AtomicUsize::new(0);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let socket = args.next().unwrap_or_else(|| "/run/governor/governor.sock".into());
    let listen = args.next().unwrap_or_else(|| "127.0.0.1:7401".into());
    let client = Client::new(&socket)?;
    let (queue, jobs) = mpsc::sync_channel::<TcpStream>(WORKERS);
    let jobs = Arc::new(Mutex::new(jobs));
    for _ in 0..WORKERS {
        let (client, jobs) = (client.clone(), jobs.clone());
        std::thread::spawn(move || {
            // Once per thread: from here on the kernel measures it exactly.
            if let Err(e) = client.register_current_thread() {
                eprintln!("worker not registered (its CPU is charged to no keyspace): {e}");
            }
            loop {
                let Ok(stream) = jobs.lock().unwrap().recv() else { return };
                let _ = connection(&client, stream);
            }
        });
    }
    let listener = TcpListener::bind(&listen)?;
    println!("listening on {}", listener.local_addr()?);
    for stream in listener.incoming() {
        if let Err(TrySendError::Full(mut stream)) = queue.try_send(stream?) {
            // No keyspace is known before the first line: read it to count
            // the rejection where it belongs.
            let mut line = String::new();
            let _ = BufReader::new(&stream).read_line(&mut line);
            if let Ok((keyspace, _)) = common::parse(&line) {
                client.report_pool_rejection(keyspace);
            }
            let _ = stream.write_all(b"busy pool_full\n");
        }
    }
    Ok(())
}

fn connection(client: &Client, stream: TcpStream) -> std::io::Result<()> {
    let mut writer = stream.try_clone()?;
    for line in BufReader::new(stream).lines() {
        let reply = match common::parse(&line?) {
            Ok((keyspace, cpu_us)) => handle(client, keyspace, cpu_us),
            Err(e) => format!("error {e}"),
        };
        writer.write_all(format!("{reply}\n").as_bytes())?;
    }
    Ok(())
}

/// The server's request kinds, as `governor profile` shows them apart.
const GET: u8 = 1;
const SCAN: u8 = 2;

fn handle(client: &Client, keyspace: u32, cpu_us: u64) -> String {
    // The work is of a kind (here by its size), which splits the
    // keyspace's profile. Wait up to 50 ms in line for the keyspace's CPU
    // tokens while few workers wait; past that, take them now or be refused.
    let kind = if cpu_us >= 5_000 { SCAN } else { GET };
    let in_line = WAITING.fetch_add(1, Ordering::Relaxed);
    let wait = if in_line < MAX_WAITING { Duration::from_millis(50) } else { Duration::ZERO };
    let admitted = client.acquire(keyspace, Demand::new().timeout(wait).kind(kind));
    WAITING.fetch_sub(1, Ordering::Relaxed);
    match admitted {
        Ok(mut ticket) => {
            let mut digest = 0;
            let mut left = cpu_us;
            while left > 0 {
                let stretch = left.min(common::STRETCH_US);
                {
                    // Charged to the keyspace and to the ticket, exactly.
                    let _work = ticket.enter();
                    digest ^= common::spin(stretch);
                }
                left -= stretch;
                // Past its tokens, the ticket waits here for a top-up: the
                // keyspace stays at its share and the work still finishes.
                ticket.checkpoint();
            }
            format!("ok {} {digest:x}", ticket.waited().as_micros())
        }
        // Dropped: the ticket gives back what it did not use.
        Err(refused) => format!("busy {}", refused.code()),
    }
}
