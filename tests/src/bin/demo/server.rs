//! The reader server as the demo runs it: a child process that lives
//! across all three phases (and across the agent's restart), and a
//! connection for its `stats` requests.

use anyhow::{Context, Result, bail};
use governor_reader::proto::{Reply, Request, ServerStats, read_frame};
use governor_tests::{Scratch, reader_server_bin};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct ReaderServer {
    child: Child,
    pub addr: SocketAddr,
    stats: TcpStream,
    pub log: PathBuf,
    _dir: Scratch,
}

impl ReaderServer {
    /// Starts `reader-server` against the agent at `socket` and waits until
    /// it listens.
    pub fn start(
        socket: &Path,
        keyspaces: &[u32],
        rows: u64,
        chunk_blocks: usize,
        worker_slice_us: u64,
        levels: &str,
        pin_workers: &str,
    ) -> Result<ReaderServer> {
        let dir = Scratch::new("reader");
        let log = dir.0.join("reader-server.log");
        let ks: Vec<String> = keyspaces.iter().map(|k| k.to_string()).collect();
        let mut child = Command::new(reader_server_bin())
            .arg("--socket")
            .arg(socket)
            .args([
                "--keyspaces",
                &ks.join(","),
                "--rows",
                &rows.to_string(),
                "--chunk-blocks",
                &chunk_blocks.to_string(),
            ])
            .args(["--worker-slice-us", &worker_slice_us.to_string(), "--levels", levels, "--pin-workers", pin_workers])
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).context("creating the server log")?)
            .spawn()
            .with_context(|| format!("starting {}", reader_server_bin().display()))?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().context("server stdout")?).read_line(&mut line)?;
        let Some(addr) = line.trim().strip_prefix("listening ") else {
            let _ = child.kill();
            let _ = child.wait();
            bail!("reader-server said {line:?}: {}", std::fs::read_to_string(&log).unwrap_or_default());
        };
        let addr: SocketAddr = addr.parse().with_context(|| format!("reader-server address {addr:?}"))?;
        let stats = TcpStream::connect(addr).context("connecting for stats")?;
        stats.set_nodelay(true)?;
        stats.set_read_timeout(Some(Duration::from_secs(5)))?;
        Ok(ReaderServer { child, addr, stats, log, _dir: dir })
    }

    /// The server's counters now.
    pub fn stats(&mut self) -> Result<ServerStats> {
        let mut buf = Vec::new();
        Request::stats().encode(&mut buf);
        self.stats.write_all(&buf)?;
        read_frame(&mut self.stats, &mut buf)?.context("the server closed the stats connection")?;
        match Reply::decode(&buf)? {
            Reply::Stats(json) => serde_json::from_slice(&json).context("parsing the server's stats"),
            other => bail!("stats request answered {other:?}"),
        }
    }

    /// Waits until the server's client has attached to agent number
    /// `attachments` (the agent's restarts + 1) and that agent answers.
    pub fn wait_attached(&mut self, attachments: u64, within: Duration) -> Result<Duration> {
        let t0 = Instant::now();
        loop {
            let s = self.stats()?;
            if s.attachments >= attachments && s.attached {
                return Ok(t0.elapsed());
            }
            if t0.elapsed() > within {
                bail!("the reader server did not attach to the restarted agent in {within:?}: {s:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for ReaderServer {
    fn drop(&mut self) {
        // SIGTERM: it stops accepting and logs its final counters.
        terminate(self.child.id());
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[allow(unsafe_code)]
fn terminate(pid: u32) {
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
}
