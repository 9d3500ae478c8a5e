//! The reader server's wire protocol: length-prefixed binary frames on one
//! TCP connection, answered in order (a client may pipeline).
//!
//! A request is `u32 len | u8 op | u32 keyspace | u64 key | u32 count |
//! u32 deadline_ms` (big-endian): `get` one row, `scan` `count` rows from
//! `key`, or `stats`. The deadline is how long the client lets the server
//! wait for CPU before answering busy (a gRPC deadline, in effect). A reply
//! is `u32 len | u8 status | payload`: the row, a scan summary, the server's
//! statistics as JSON, a busy answer with the governor's refusal code and
//! how long the request waited, or an error message.

use crate::store::ScanSummary;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Largest frame either side accepts.
pub const MAX_FRAME: u32 = 1 << 20;
/// Size of a request frame's body.
pub const REQUEST_LEN: u32 = 21;

#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("frame of {len} bytes (at most {max})")]
    TooLong { len: u32, max: u32 },
    #[error("malformed {what}")]
    Malformed { what: &'static str },
    #[error("unknown {what} {code}")]
    Unknown { what: &'static str, code: u8 },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Get,
    Scan,
    Stats,
}

impl Op {
    fn code(self) -> u8 {
        match self {
            Op::Get => 1,
            Op::Scan => 2,
            Op::Stats => 3,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub op: Op,
    pub keyspace: u32,
    pub key: u64,
    pub count: u32,
    pub deadline_ms: u32,
}

impl Request {
    pub fn get(keyspace: u32, row: u64, deadline_ms: u32) -> Request {
        Request { op: Op::Get, keyspace, key: row, count: 1, deadline_ms }
    }

    pub fn scan(keyspace: u32, start: u64, count: u32, deadline_ms: u32) -> Request {
        Request { op: Op::Scan, keyspace, key: start, count, deadline_ms }
    }

    pub fn stats() -> Request {
        Request { op: Op::Stats, keyspace: 0, key: 0, count: 0, deadline_ms: 0 }
    }

    /// Appends the whole frame, length prefix included.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&REQUEST_LEN.to_be_bytes());
        out.push(self.op.code());
        out.extend_from_slice(&self.keyspace.to_be_bytes());
        out.extend_from_slice(&self.key.to_be_bytes());
        out.extend_from_slice(&self.count.to_be_bytes());
        out.extend_from_slice(&self.deadline_ms.to_be_bytes());
    }

    /// Decodes a frame's body.
    pub fn decode(body: &[u8]) -> Result<Request, ProtoError> {
        if body.len() != REQUEST_LEN as usize {
            return Err(ProtoError::Malformed { what: "request length" });
        }
        let op = match body[0] {
            1 => Op::Get,
            2 => Op::Scan,
            3 => Op::Stats,
            code => return Err(ProtoError::Unknown { what: "op", code }),
        };
        let u32_at = |i: usize| u32::from_be_bytes(body[i..i + 4].try_into().expect("4 bytes"));
        Ok(Request {
            op,
            keyspace: u32_at(1),
            key: u64::from_be_bytes(body[5..13].try_into().expect("8 bytes")),
            count: u32_at(13),
            deadline_ms: u32_at(17),
        })
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    Row(Vec<u8>),
    Scanned(ScanSummary),
    Stats(Vec<u8>),
    /// Refused by the governor: its code (`Refused::code`) and how long the
    /// request waited in line first.
    Busy {
        code: String,
        waited_us: u64,
    },
    Error(String),
}

impl Reply {
    fn status(&self) -> u8 {
        match self {
            Reply::Row(_) => 0,
            Reply::Scanned(_) => 1,
            Reply::Stats(_) => 2,
            Reply::Busy { .. } => 3,
            Reply::Error(_) => 4,
        }
    }

    /// Appends the whole frame, length prefix included.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let at = out.len();
        out.extend_from_slice(&[0; 4]);
        out.push(self.status());
        match self {
            Reply::Row(b) | Reply::Stats(b) => out.extend_from_slice(b),
            Reply::Scanned(s) => {
                for v in [s.rows, s.matched, s.amount_sum, s.response_bytes, s.compressed_bytes] {
                    out.extend_from_slice(&v.to_be_bytes());
                }
                out.extend_from_slice(&s.checksum.to_be_bytes());
            }
            Reply::Busy { code, waited_us } => {
                out.extend_from_slice(&waited_us.to_be_bytes());
                out.extend_from_slice(code.as_bytes());
            }
            Reply::Error(m) => out.extend_from_slice(m.as_bytes()),
        }
        let len = (out.len() - at - 4) as u32;
        out[at..at + 4].copy_from_slice(&len.to_be_bytes());
    }

    /// Decodes a frame's body.
    pub fn decode(body: &[u8]) -> Result<Reply, ProtoError> {
        let (&status, rest) = body.split_first().ok_or(ProtoError::Malformed { what: "empty reply" })?;
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        Ok(match status {
            0 => Reply::Row(rest.to_vec()),
            1 => {
                if rest.len() != 44 {
                    return Err(ProtoError::Malformed { what: "scan summary" });
                }
                let u = |i: usize| u64::from_be_bytes(rest[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
                Reply::Scanned(ScanSummary {
                    rows: u(0),
                    matched: u(1),
                    amount_sum: u(2),
                    response_bytes: u(3),
                    compressed_bytes: u(4),
                    checksum: u32::from_be_bytes(rest[40..44].try_into().expect("4 bytes")),
                })
            }
            2 => Reply::Stats(rest.to_vec()),
            3 => {
                if rest.len() < 8 {
                    return Err(ProtoError::Malformed { what: "busy reply" });
                }
                let (w, code) = rest.split_at(8);
                Reply::Busy { code: text(code), waited_us: u64::from_be_bytes(w.try_into().expect("8 bytes")) }
            }
            4 => Reply::Error(text(rest)),
            code => return Err(ProtoError::Unknown { what: "reply status", code }),
        })
    }
}

/// Reads one frame's body from a blocking stream; `None` at a clean EOF.
pub fn read_frame(r: &mut impl std::io::Read, buf: &mut Vec<u8>) -> std::io::Result<Option<()>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes(len);
    if len > MAX_FRAME {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, ProtoError::TooLong { len, max: MAX_FRAME }));
    }
    buf.resize(len as usize, 0);
    r.read_exact(buf)?;
    Ok(Some(()))
}

/// Per-keyspace counters the server keeps, as a `stats` request reports them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KeyspaceStats {
    pub gets: u64,
    pub scans: u64,
    pub rows_read: u64,
    /// Busy replies, by refusal code.
    pub busy: BTreeMap<String, u64>,
    /// Admitted only after waiting in line for CPU.
    pub waited: u64,
    /// Time spent waiting for admission, admitted or not.
    pub wait_us: u64,
    /// The CPU of the keyspace's admitted work by the kernel's count of
    /// the worker thread: CLOCK_THREAD_CPUTIME_ID around each poll of the
    /// work inside its ticket's tag. What the agent charged the keyspace is
    /// at least this...
    pub thread_cpu_ns: u64,
    /// ...and at most this: the same around each poll of the ticket's
    /// future (the tag's set and restore and the ticket's bookkeeping too).
    #[serde(default)]
    pub ticket_poll_cpu_ns: u64,
    /// Admitted without a check because no agent answered.
    pub fail_open: u64,
    /// Time during which at least one of the keyspace's requests waited for
    /// admission (its tokens held it back), µs.
    #[serde(default)]
    pub waiting_us: u64,
}

/// What a `stats` request answers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerStats {
    pub workers: usize,
    /// Agents the client attached to so far (2 after one agent restart).
    pub attachments: u64,
    /// Whether an agent answers now.
    pub attached: bool,
    pub keyspaces: BTreeMap<u32, KeyspaceStats>,
    /// With `--pin-workers auto`: whether the workers keep to a CPU each
    /// now (they are let go while other processes take half a core of the
    /// server's CPUs)...
    #[serde(default)]
    pub workers_pinned: Option<bool>,
    /// ...and what other processes took of those CPUs over the last half
    /// second, in cores.
    #[serde(default)]
    pub other_processes_cores: Option<f64>,
    /// Times the workers were let go so far.
    #[serde(default)]
    pub workers_let_go: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(frame: &[u8]) -> &[u8] {
        let len = u32::from_be_bytes(frame[..4].try_into().unwrap()) as usize;
        assert_eq!(frame.len(), len + 4);
        &frame[4..]
    }

    #[test]
    fn requests_and_replies_round_trip() {
        for r in [Request::get(3, 99, 50), Request::scan(900, 1 << 40, 4096, 1000), Request::stats()] {
            let mut f = Vec::new();
            r.encode(&mut f);
            assert_eq!(Request::decode(body(&f)).unwrap(), r);
        }
        let summary =
            ScanSummary { rows: 1, matched: 2, amount_sum: 3, response_bytes: 4, compressed_bytes: 5, checksum: 6 };
        for r in [
            Reply::Row(b"abc".to_vec()),
            Reply::Scanned(summary),
            Reply::Stats(b"{}".to_vec()),
            Reply::Busy { code: "tenant_cap_exhausted".into(), waited_us: 1234 },
            Reply::Error("boom".into()),
        ] {
            let mut f = Vec::new();
            r.encode(&mut f);
            assert_eq!(Reply::decode(body(&f)).unwrap(), r);
        }
    }

    #[test]
    fn a_malformed_request_is_an_error() {
        assert!(Request::decode(&[1, 2, 3]).is_err());
        let mut f = Vec::new();
        Request::get(1, 2, 3).encode(&mut f);
        f[4] = 77;
        assert!(matches!(Request::decode(&f[4..]), Err(ProtoError::Unknown { code: 77, .. })));
    }
}
