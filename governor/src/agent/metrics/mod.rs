//! `/metrics` on `agent.metrics-addr`: the Prometheus text format, built at
//! each scrape from the agent's status and the policy's snapshot, so it
//! always says what `governor status` says.
//!
//! Names and labels follow the seeds verbatim where they name a metric
//! (`tikv_cpu_usage_monitor_*`, `tikv_cpu_throttle_*`, `tikv_cpu_token_*`,
//! `cpu_throttle_tenant_cap_*`); what governor adds is `governor_*`.
//! Per-keyspace series are bounded: past `agent.metrics-max-keyspaces`
//! keyspaces, the ones with the least CPU are summed into
//! `keyspace_id="other"`, and `governor_metrics_keyspaces_folded` says how
//! many.
//!
//! The listener is small on purpose: HTTP/1.1 `GET /metrics` (and `/`),
//! one response per connection, a request head of at most 8 KiB read within
//! 5 s, at most 16 scrapes at once, each exposition built on the blocking
//! pool.

mod histograms;
mod render;

pub(crate) use render::render;

use super::Shared;
use prometheus::{Encoder, TextEncoder};
use render::render_pd_duration;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Longest request head, bytes.
const MAX_HEAD: usize = 8 * 1024;
/// Scrapes served at once.
const MAX_SCRAPES: usize = 16;
/// Time a scraper has to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

pub(super) async fn serve(listener: TcpListener, shared: Arc<Shared>) {
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_SCRAPES));
    loop {
        let permit = permits.clone().acquire_owned().await.expect("never closed");
        match listener.accept().await {
            Ok((stream, _)) => {
                let shared = shared.clone();
                tokio::spawn(async move {
                    if let Err(e) = scrape(stream, shared).await {
                        log::debug!("metrics scrape: {e}");
                    }
                    drop(permit);
                });
            }
            Err(e) => {
                log::warn!("accept on the metrics listener: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn scrape(mut stream: TcpStream, shared: Arc<Shared>) -> std::io::Result<()> {
    let max_keyspaces = shared.metrics_max_keyspaces.load(std::sync::atomic::Ordering::Relaxed);
    let mut head = Vec::with_capacity(512);
    let read = tokio::time::timeout(READ_TIMEOUT, async {
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_HEAD {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        Ok::<(), std::io::Error>(())
    })
    .await;
    if !matches!(read, Ok(Ok(()))) {
        return Ok(());
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (method, path) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    let (status, content_type, body) = match (method, path) {
        (b"GET", b"/metrics") | (b"GET", b"/") => {
            // Built off the runtime's thread: it waits on the measurement locks.
            let text = tokio::task::spawn_blocking(move || {
                let snap = shared.policy.snapshot();
                let status = shared.status_of(&snap);
                let mut text = render(&status, &snap, max_keyspaces);
                // With the other tikv_service_limit_* series: while PD is on.
                if status.pd.is_some() {
                    text.push_str(&render_pd_duration(&shared.pd.duration));
                }
                text
            })
            .await
            .map_err(std::io::Error::other)?;
            ("200 OK", TextEncoder::new().format_type().to_string(), text)
        }
        (b"GET", _) => ("404 Not Found", "text/plain".into(), "only /metrics here\n".into()),
        _ => ("405 Method Not Allowed", "text/plain".into(), "GET /metrics\n".into()),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}
