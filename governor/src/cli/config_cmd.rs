//! `governor config validate|show`.

use super::{load_config, CliError};
use crate::config::ValidatedConfig;
use std::path::Path;

/// Validates `path`; the validated configuration on success.
pub fn validate(path: &Path) -> Result<ValidatedConfig, CliError> {
    load_config(path)
}

/// The configuration in force for `path`, or the embedded default.
pub fn show(path: Option<&Path>) -> Result<ValidatedConfig, CliError> {
    match path {
        Some(p) => load_config(p),
        None => Ok(ValidatedConfig::embedded_default()),
    }
}
