//! [`Checker`]: the error collector validation runs through. It checks one
//! rule at a time, never stops at the first failure, and attaches each
//! failing key's line from the [`SourceMap`] when there is a file.

use std::time::Duration;

use super::error::{ConfigError, ConfigErrors};
use super::keyspace_list::{KeyspaceList, ListValue};
use super::source::SourceMap;
use super::units::ConfigDuration;

pub(super) const MS: Duration = Duration::from_millis(1);
pub(super) const SEC: Duration = Duration::from_secs(1);
pub(super) const HOUR: Duration = Duration::from_secs(3600);
pub(super) const DAY: Duration = Duration::from_secs(86400);
pub(super) const MONTH: Duration = Duration::from_secs(30 * 86400);

pub(super) const RC: &str = "resource-control";
pub(super) const CT: &str = "resource-control.cpu-throttle";
pub(super) const CAP_KEY: &str = "resource-control.cpu-throttle.tenant-max-cpu-ratio";

/// Collects errors, attaching lines from the source map.
pub(super) struct Checker<'a> {
    pub(super) map: &'a SourceMap,
    pub(super) errors: ConfigErrors,
}

impl Checker<'_> {
    pub(super) fn line(&self, key: &str) -> Option<usize> {
        self.map.line_of(key)
    }

    pub(super) fn invalid(&mut self, key: String, reason: impl Into<String>) {
        let line = self.line(&key);
        self.errors.push(ConfigError::InvalidValue { key, line, reason: reason.into() });
    }

    /// `ok` or an invalid-value error for `section.name`.
    pub(super) fn check(&mut self, ok: bool, section: &str, name: &str, reason: impl Into<String>) {
        if !ok {
            self.invalid(format!("{section}.{name}"), reason);
        }
    }

    pub(super) fn ratio(&mut self, section: &str, name: &str, v: f64, zero_ok: bool) {
        let ok = if zero_ok { (0.0..=1.0).contains(&v) } else { v > 0.0 && v <= 1.0 };
        let range = if zero_ok { "[0, 1]" } else { "(0, 1]" };
        self.check(ok, section, name, format!("must be in {range}, got {v}"));
    }

    pub(super) fn duration(&mut self, section: &str, name: &str, v: ConfigDuration, min: Duration, max: Duration) {
        let ok = v.get() >= min && v.get() <= max;
        let (lo, hi) = (ConfigDuration(min), ConfigDuration(max));
        self.check(ok, section, name, format!("must be between {lo} and {hi}, got {v}"));
    }

    pub(super) fn int(&mut self, section: &str, name: &str, v: u64, min: u64, max: u64) {
        self.check((min..=max).contains(&v), section, name, format!("must be between {min} and {max}, got {v}"));
    }

    /// A per-keyspace list `name` of the throttle table: refused with why
    /// when it does not parse.
    pub(super) fn list<T: ListValue>(&mut self, name: &str, list: &KeyspaceList<T>) {
        if let Some(why) = list.problem() {
            self.invalid(format!("{CT}.{name}"), why.to_string());
        }
    }

    /// An Essential-profile rule: in cap mode `name` must not be `bad`.
    pub(super) fn cap_rule(&mut self, name: &str, violated: bool, reason: &str) {
        if violated {
            let key = format!("{CT}.{name}");
            // A default that conflicts has no line of its own: point at the cap.
            let own_line = self.line(&key);
            let unset = if own_line.is_none() && self.line(CAP_KEY).is_some() {
                " (not set in the file; its default conflicts)"
            } else {
                ""
            };
            self.errors.push(ConfigError::Conflict {
                line: own_line.or_else(|| self.line(CAP_KEY)),
                key,
                reason: format!(
                    "{reason} while tenant-max-cpu-ratio > 0 (essential tenant-cap mode; \
                     profile = \"essential\" sets every such key){unset}"
                ),
            });
        }
    }
}
