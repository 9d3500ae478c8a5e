//! Configuration errors. Every error names the dotted key it is about and,
//! when the configuration came from a file, the line of that key, so an
//! operator can go straight to the offending line.

use std::fmt;

/// One problem with a configuration file, a single setting or an update.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// The text is not valid TOML (or a value has the wrong TOML type).
    #[error("{}{key}: {message}", at(.line))]
    Syntax {
        /// Dotted key nearest to the error, or `<file>` when none applies.
        key: String,
        /// 1-based line, when known.
        line: Option<usize>,
        /// What the parser said.
        message: String,
    },
    /// A key that no section knows, usually a typo.
    #[error("{}{key}: unknown key", at(.line))]
    UnknownKey {
        /// Dotted key as written.
        key: String,
        /// 1-based line, when known.
        line: Option<usize>,
    },
    /// A value out of range or malformed.
    #[error("{}{key}: {reason}", at(.line))]
    InvalidValue {
        /// Dotted key.
        key: String,
        /// 1-based line, when known.
        line: Option<usize>,
        /// Why the value is refused.
        reason: String,
    },
    /// A value that is fine alone but contradicts another setting.
    #[error("{}{key}: {reason}", at(.line))]
    Conflict {
        /// Dotted key of the setting that has to change.
        key: String,
        /// 1-based line, when known.
        line: Option<usize>,
        /// Which rule is broken.
        reason: String,
    },
    /// An online update tried to change a key that only takes effect at start.
    #[error("{}{key}: cannot change online from {old} to {new}; {why}, restart the agent", at(.line))]
    RestartOnly {
        /// Dotted key.
        key: String,
        /// 1-based line in the new source, when known.
        line: Option<usize>,
        /// Running value, printed.
        old: String,
        /// Requested value, printed.
        new: String,
        /// Why the key cannot change online.
        why: &'static str,
    },
}

fn at(line: &Option<usize>) -> String {
    match line {
        Some(n) => format!("line {n}: "),
        None => String::new(),
    }
}

impl ConfigError {
    /// The dotted key the error is about.
    pub fn key(&self) -> &str {
        match self {
            Self::Syntax { key, .. }
            | Self::UnknownKey { key, .. }
            | Self::InvalidValue { key, .. }
            | Self::Conflict { key, .. }
            | Self::RestartOnly { key, .. } => key,
        }
    }

    /// The 1-based line, when the error came from a file.
    pub fn line(&self) -> Option<usize> {
        match self {
            Self::Syntax { line, .. }
            | Self::UnknownKey { line, .. }
            | Self::InvalidValue { line, .. }
            | Self::Conflict { line, .. }
            | Self::RestartOnly { line, .. } => *line,
        }
    }
}

/// Every problem found in one load, never just the first: fixing a config
/// one error per restart is how operators lose an afternoon.
#[derive(Clone, Debug, Default, PartialEq, thiserror::Error)]
pub struct ConfigErrors {
    /// The errors, in file order where lines are known.
    pub errors: Vec<ConfigError>,
}

impl ConfigErrors {
    /// Wraps a single error.
    pub fn one(error: ConfigError) -> Self {
        Self { errors: vec![error] }
    }

    /// True when some error names exactly `key`.
    pub fn names_key(&self, key: &str) -> bool {
        self.errors.iter().any(|e| e.key() == key)
    }

    /// The keys named, in order.
    pub fn keys(&self) -> Vec<&str> {
        self.errors.iter().map(ConfigError::key).collect()
    }

    pub(crate) fn push(&mut self, error: ConfigError) {
        self.errors.push(error);
    }

    /// Orders errors by line; errors without a line keep their order, last.
    pub(crate) fn sorted(mut self) -> Self {
        self.errors.sort_by_key(|e| e.line().unwrap_or(usize::MAX));
        self
    }

    pub(crate) fn into_result<T>(self, ok: T) -> Result<T, Self> {
        if self.errors.is_empty() { Ok(ok) } else { Err(self.sorted()) }
    }
}

impl fmt::Display for ConfigErrors {
    /// One error per line: `line N: key: reason`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.errors.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// An online update (file reload or `config set`) that was refused as a
/// whole; the running configuration is unchanged.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("configuration update rejected, running configuration unchanged:\n{errors}")]
pub struct UpdateRejected {
    /// Every reason, not just the first.
    #[source]
    pub errors: ConfigErrors,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_list_prints_one_line_per_error_with_line_and_key() {
        let errs = ConfigErrors {
            errors: vec![
                ConfigError::InvalidValue {
                    key: "agent.max-threads".into(),
                    line: Some(7),
                    reason: "must be at least 64".into(),
                },
                ConfigError::UnknownKey { key: "agent.bogus".into(), line: None },
            ],
        };
        assert_eq!(errs.to_string(), "line 7: agent.max-threads: must be at least 64\nagent.bogus: unknown key");
        assert!(errs.names_key("agent.bogus"));
        assert_eq!(errs.errors[0].line(), Some(7));
    }
}
