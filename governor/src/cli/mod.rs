//! Operator verbs. Each returns a `Serialize` value that `main` prints as
//! a table or, with `--json`, as JSON.

pub mod config_cmd;
pub mod doctor;
pub mod keyspace;
pub mod profile;
pub mod rules;
pub mod status;
pub mod threads;
pub mod top;

use std::path::{Path, PathBuf};

/// Exit code for usage and configuration errors (sysexits EX_USAGE).
pub const EXIT_USAGE: i32 = 64;

/// Errors of the CLI verbs.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Client(#[from] crate::client::ClientError),
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid configuration:\n{errors}")]
    Config { path: PathBuf, errors: crate::config::ConfigErrors },
    #[error("unexpected reply from the agent: {detail}")]
    Reply { detail: String },
    #[error("the agent refused the change; its configuration stays as it was:\n{}", errors.iter().map(|e| format!("  {e}")).collect::<Vec<_>>().join("\n"))]
    Rejected { errors: Vec<String>, file_unreadable: bool },
    #[error("the agent: {message}")]
    Agent { message: String },
    #[error("{0}")]
    Usage(String),
}

impl CliError {
    /// The process exit code for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            // EX_NOINPUT: the file named cannot be read (a reload's too).
            CliError::Read { .. } | CliError::Rejected { file_unreadable: true, .. } => 66,
            CliError::Config { .. } | CliError::Rejected { .. } | CliError::Usage(_) => EXIT_USAGE,
            // The socket's permissions keep this user out.
            CliError::Client(crate::client::ClientError::Connect { source, .. })
                if source.kind() == std::io::ErrorKind::PermissionDenied =>
            {
                77
            }
            // EX_NOPERM: the agent refused the peer itself.
            CliError::Agent { message } if message.starts_with(crate::proto::NOT_PERMITTED) => 77,
            CliError::Client(crate::client::ClientError::Refused { message })
                if message.starts_with(crate::proto::NOT_PERMITTED) =>
            {
                77
            }
            _ => 1,
        }
    }
}

/// Reads and validates a configuration file.
pub fn load_config(path: &Path) -> Result<crate::config::ValidatedConfig, CliError> {
    let text = crate::config::file::read_within(path, crate::config::file::READ_TIMEOUT)
        .map_err(|source| CliError::Read { path: path.into(), source })?;
    // As a reload refuses it: a file cut short (a deploy that failed, an
    // editor between truncating and writing) would put every default in
    // force, every quota and rule gone.
    if text.trim().is_empty() {
        let empty = crate::config::ConfigError::Syntax {
            key: "<file>".into(),
            line: None,
            message: "the file is empty: cut short, or still being written? For the embedded default, give it a \
                      comment, or name no file"
                .into(),
        };
        return Err(CliError::Config { path: path.into(), errors: crate::config::ConfigErrors::one(empty) });
    }
    crate::config::ValidatedConfig::from_toml_str(&text)
        .map_err(|errors| CliError::Config { path: path.into(), errors })
}
