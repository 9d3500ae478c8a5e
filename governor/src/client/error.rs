//! What can go wrong between a client and its agent, and how a request is
//! refused.

use crate::policy::Refusal;
use crate::region::RegionError;
use std::path::PathBuf;
use std::time::Duration;

/// What can go wrong between a client and its agent.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The control socket could not be opened ([`super::Client::connect`]; from
    /// [`super::Client::new`] only when the error is the operator's, e.g. permission
    /// denied).
    #[error("cannot connect to the governor agent at {path}")]
    Connect {
        /// The socket's path.
        path: PathBuf,
        /// The connect error.
        #[source]
        source: std::io::Error,
    },
    /// Reading or writing the control socket failed.
    #[error("talking to the governor agent failed")]
    Io(#[from] std::io::Error),
    /// The agent answered something this client does not understand
    /// (an agent of another version).
    #[error("the agent sent a malformed reply: {detail}")]
    Protocol {
        /// What was wrong.
        detail: String,
    },
    /// The agent refused the request (e.g. no free thread slot, or this
    /// process may not connect).
    #[error("the agent refused: {message}")]
    Refused {
        /// The agent's reason.
        message: String,
    },
    /// A shared region could not be mapped, or the keyspace table is full.
    #[error(transparent)]
    Region(#[from] RegionError),
    /// [`super::Client::register_current_thread`] on a thread already registered.
    #[error("this thread is already registered")]
    AlreadyRegistered,
    /// The client was created in a parent process; a child must create its own.
    #[error("this client was connected by process {parent}; a forked child must connect its own")]
    Forked {
        /// The process that created the client.
        parent: u32,
    },
    /// No agent answers now: the client re-attaches by itself, and
    /// admission is fail-open meanwhile.
    #[error("the governor agent is gone; this client re-attaches when one is back")]
    AgentGone,
}

impl ClientError {
    /// Connecting to `path` failed with `source`. A path that is there but
    /// not a socket (a wrong `--socket`) is said as such, and is the
    /// operator's to fix: the kernel's "connection refused" would read as
    /// an agent that is not running.
    pub(crate) fn connect(path: &std::path::Path, source: std::io::Error) -> Self {
        use std::os::unix::fs::FileTypeExt;
        let source = match std::fs::metadata(path) {
            Ok(m) if source.kind() == std::io::ErrorKind::ConnectionRefused && !m.file_type().is_socket() => {
                let what = if m.is_dir() { "a directory" } else { "a file" };
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("it is {what}, not a socket: is the path the agent's control socket?"),
                )
            }
            _ => source,
        };
        ClientError::Connect { path: path.to_path_buf(), source }
    }
}

/// A refusal, with how long the request waited before it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{reason}{} (waited {waited:?})", if *.overflow { OVERFLOW_NOTE } else { "" })]
pub struct Refused {
    /// Why.
    pub reason: Refusal,
    /// How long the request waited in line first.
    pub waited: Duration,
    overflow: bool,
}

const OVERFLOW_NOTE: &str = ", in the overflow bucket: the keyspace has no cell of its own and shares one cap with every \
                             keyspace that has none (`governor status`, overflow line)";

impl Refused {
    /// A refusal of a request of a keyspace whose cell is `cell` (`None`:
    /// it has none, the overflow bucket held it).
    pub(crate) fn new(reason: Refusal, waited: Duration, cell: Option<u32>) -> Refused {
        let overflow = cell.is_none() && reason.is_cpu();
        Refused { reason, waited, overflow }
    }

    /// True when the keyspace has no cell of its own (the agent's table is
    /// full, or the server's uid holds its quota of cells) and the CPU
    /// refusal came from the overflow bucket it shares with every keyspace
    /// that has none, not from a cap of its own: the operator's fix is a
    /// larger table (`governor status` says which limit).
    pub fn in_overflow(&self) -> bool {
        self.overflow
    }

    /// The reason as a metrics label (`tenant_admission_control` for the
    /// concurrency limit).
    pub fn code(&self) -> &'static str {
        self.reason.code()
    }
}

#[cfg(test)]
mod tests {
    use super::Refused;
    use crate::policy::Refusal;
    use std::time::Duration;

    #[test]
    fn a_cpu_refusal_without_a_cell_says_the_overflow_bucket_held_it() {
        let cap = Refusal::TenantCpuExhausted { keyspace: 7 };
        let shared = Refused::new(cap.clone(), Duration::ZERO, None);
        assert!(shared.in_overflow());
        assert_eq!(shared.code(), "tenant_cap_exhausted", "the code stays the seed's");
        assert!(shared.to_string().contains("in the overflow bucket: the keyspace has no cell of its own"), "{shared}");
        let own = Refused::new(cap, Duration::ZERO, Some(3));
        assert!(!own.in_overflow() && !own.to_string().contains("overflow"), "{own}");
        // Not a CPU refusal: no bucket held it.
        let tickets = Refused::new(Refusal::TooManyTickets { limit: 4 }, Duration::ZERO, None);
        assert!(!tickets.in_overflow());
    }
}
