//! A tokio server governed by the agent: every request takes a ticket for
//! its keyspace without blocking a worker, and its work runs under that
//! ticket in a spawned task, paced to the keyspace's share.
//!
//! ```text
//! cargo run --release -p keyspace-governor --example tokio_server -- /run/governor/governor.sock 127.0.0.1:7400
//! exec 3<>/dev/tcp/127.0.0.1/7400; printf '7 2000\n' >&3; head -1 <&3  # 2 ms of CPU for keyspace 7
//! ```
//! The request protocol is in `common/mod.rs`.

mod common;

use keyspace_governor::client::{Client, CpuSpread, Demand, set_thread_slice};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let socket = args.next().unwrap_or_else(|| "/run/governor/governor.sock".into());
    let listen = args.next().unwrap_or_else(|| "127.0.0.1:7400".into());
    // Attaches now if the agent runs, else when it starts (admitting
    // fail-open until then).
    let client = Client::new(&socket)?;
    // A CPU of its own for each worker, let go while other processes take
    // half a core or more of them.
    let spread = CpuSpread::new()?;
    spread.watch_other_processes()?;
    let (register, pin) = (client.register_on_park(), spread.pin_on_park());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        // A 100 µs scheduler slice (Linux 6.12+): a long request holds its
        // core against a light one's wakeup for about that long.
        .on_thread_start(|| {
            if let Err(e) = set_thread_slice(Duration::from_micros(100)) {
                eprintln!("no short scheduler slice here: {e}");
            }
        })
        // Each worker registers, and keeps to its CPU, from the first time
        // it parks; a blocking-pool thread registers when it enters a ticket.
        .on_thread_park(move || {
            register();
            pin();
        })
        .build()?;
    runtime.block_on(serve(client, &listen))
}

async fn serve(client: Client, listen: &str) -> Result<(), Box<dyn std::error::Error>> {
    let listener = TcpListener::bind(listen).await?;
    println!("listening on {}", listener.local_addr()?);
    loop {
        let (stream, _) = listener.accept().await?;
        // A Client is a cheap handle: one per connection.
        tokio::spawn(connection(client.clone(), stream));
    }
}

async fn connection(client: Client, stream: TcpStream) -> std::io::Result<()> {
    let (reader, mut writer) = stream.into_split();
    let mut lines = BufReader::new(reader).lines();
    while let Some(line) = lines.next_line().await? {
        let reply = match common::parse(&line) {
            Ok((keyspace, cpu_us)) => handle(&client, keyspace, cpu_us).await,
            Err(e) => format!("error {e}"),
        };
        writer.write_all(format!("{reply}\n").as_bytes()).await?;
    }
    Ok(())
}

async fn handle(client: &Client, keyspace: u32, cpu_us: u64) -> String {
    // Wait up to 50 ms in line for the keyspace's CPU tokens.
    let demand = Demand::new().timeout(Duration::from_millis(50));
    match client.acquire_async(keyspace, demand).await {
        Ok(ticket) => {
            let waited = ticket.waited();
            // The ticket is owned: it moves into the task with the work.
            // Every poll of the work is charged to the keyspace; a poll
            // that finds the ticket past its tokens waits for a top-up first.
            match tokio::spawn(ticket.run(work(cpu_us))).await {
                Ok(digest) => format!("ok {} {digest:x}", waited.as_micros()),
                Err(e) => format!("error {e}"),
            }
        }
        // e.g. "tenant_cap_exhausted": the keyspace is at its cap.
        Err(refused) => format!("busy {}", refused.code()),
    }
}

/// The request's CPU, in stretches of at most 250 µs with a poll boundary
/// between them: the runtime runs a light request's task between two.
async fn work(cpu_us: u64) -> u64 {
    let mut digest = 0;
    let mut left = cpu_us;
    while left > 0 {
        let stretch = left.min(common::STRETCH_US);
        digest ^= common::spin(stretch);
        left -= stretch;
        tokio::task::yield_now().await;
    }
    digest
}
