//! Live configuration: `config set KEY=VALUE`, `config reload` and SIGHUP.
//!
//! A change is validated whole, exactly as a start would validate it, and
//! against the running configuration (restart-only keys are refused with
//! the reason). It is applied entirely or not at all: on any error the
//! running configuration stays, the log records every reason and
//! `governor_config_updates_total{result="rejected"}` counts it.
//!
//! This module decides and records; it changes nothing else. A change is
//! first a [`Proposal`]: the next configuration, what differs, and the
//! [`Effects`] it asks of the agent. The agent puts those in force (rule
//! cells and the kernel's caps, the policy's settings, the socket's access,
//! its own limits) and then [`Running::accept`]s or [`Running::refuse`]s it.
//!
//! Who may change it: the admin role of `agent.access` (root, the agent's
//! own user, `admins`); the server checks the peer before it gets here.

use crate::config::{ConfigDiff, RawRule, UpdateRejected, ValidatedConfig};
use crate::proto::ConfigUpdates;
use crate::region::RegionError;
use std::path::PathBuf;

/// The configuration in force and its history.
pub(crate) struct Running {
    pub(super) config: ValidatedConfig,
    path: Option<PathBuf>,
    accepted: u64,
    rejected: u64,
}

/// What a peer (or SIGHUP) asks to change.
pub(crate) enum Change<'a> {
    /// Read the file again; the string names the trigger in the log.
    Reload(String),
    Set(&'a str, &'a str),
    AddRule(&'a str, Option<usize>),
    RemoveRule(&'a str),
}

impl Change<'_> {
    /// The change as the log names it.
    fn describe(&self) -> String {
        match self {
            Change::Reload(what) => what.clone(),
            Change::Set(key, value) => format!("config set {key}={value}"),
            Change::AddRule(..) => "rules add".into(),
            Change::RemoveRule(name) => format!("rules remove {name}"),
        }
    }
}

/// Why a change was refused; the running configuration stays.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refused {
    #[error(
        "the agent runs on the embedded default configuration (no --config file): nothing to reload; \
         use `governor config set`"
    )]
    NoFile,
    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Invalid(UpdateRejected),
    #[error(
        "{} is empty: a file still being written? Reload once it is whole; to go back to the embedded default, give it a comment"
    , path.display())]
    EmptyFile { path: PathBuf },
    #[error("rule: {0}")]
    RuleSyntax(String),
    #[error("rule {name:?} refused")]
    Rule {
        name: String,
        #[source]
        source: UpdateRejected,
    },
    #[error("no rule named {name:?} (rules: {})", if rules.is_empty() { "none".into() } else { rules.join(", ") })]
    NoSuchRule { name: String, rules: Vec<String> },
    #[error("position {position} is past the end: {}", past_the_end(*rules))]
    PastTheEnd { position: usize, rules: usize },
    #[error("the rules' keyspaces get no cell: {0}")]
    RuleCells(#[source] RegionError),
    #[error("the policy could not take it: {0}")]
    Policy(#[source] RegionError),
}

/// What positions there are for a new rule among `rules`.
fn past_the_end(rules: usize) -> String {
    match rules {
        0 => "there are no rules; give 0 or leave --position out".to_string(),
        1 => "there is 1 rule; 0 puts the new one first, 1 (or no --position) last".to_string(),
        n => format!("there are {n} rules; 0 puts the new one first, {n} (or no --position) last"),
    }
}

impl Refused {
    /// Every reason, one line each, as the reply and the log carry them.
    pub(crate) fn reasons(&self) -> Vec<String> {
        let each = |e: &UpdateRejected| e.errors.errors.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        match self {
            Refused::Invalid(e) => each(e),
            Refused::Rule { source, .. } => std::iter::once(self.to_string()).chain(each(source)).collect(),
            Refused::Read { source, .. } => vec![format!("{self}: {source}")],
            _ => vec![self.to_string()],
        }
    }
}

/// What an accepted configuration asks of the rest of the agent, besides
/// the policy's settings and the agent's limits, which it always sets again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Effects {
    /// The rules changed: their keyspaces get cells and the kernel's caps
    /// are set again (as they are when only what the caps are derived from
    /// changed, which the agent decides where it knows the server's cores).
    pub rules: bool,
    /// `agent.access` changed: the control socket's mode and group.
    pub access: bool,
}

/// A change validated against the running configuration, not yet in force.
pub(crate) struct Proposal {
    pub next: ValidatedConfig,
    pub diff: ConfigDiff,
    pub effects: Effects,
    /// The change as the log names it.
    pub what: String,
}

impl Running {
    pub(crate) fn new(config: ValidatedConfig, path: Option<PathBuf>) -> Running {
        Running { config, path, accepted: 0, rejected: 0 }
    }

    /// `agent.access` in force.
    pub(crate) fn access(&self) -> crate::config::Access {
        self.config.access().clone()
    }

    pub(crate) fn counts(&self) -> ConfigUpdates {
        ConfigUpdates {
            accepted: self.accepted,
            rejected: self.rejected,
            path: self.path.as_ref().map(|p| p.display().to_string()),
        }
    }

    /// The configuration `change` leads to, checked whole, and what it asks
    /// of the agent; on refusal, the change as the log names it and why.
    pub(crate) fn propose(&self, change: Change<'_>) -> Result<Proposal, (String, Refused)> {
        let mut what = change.describe();
        let next = match change {
            Change::Reload(_) => match &self.path {
                None => Err(Refused::NoFile),
                Some(path) => {
                    what = format!("{what} ({})", path.display());
                    crate::config::file::read_within(path, crate::config::file::READ_TIMEOUT)
                        .map_err(|source| Refused::Read { path: path.clone(), source })
                        .and_then(|text| match text.trim().is_empty() {
                            true => Err(Refused::EmptyFile { path: path.clone() }),
                            false => self.config.apply_update(&text).map_err(Refused::Invalid),
                        })
                }
            },
            Change::Set(key, value) => self.config.apply_set(key, value).map_err(Refused::Invalid),
            Change::AddRule(text, position) => toml::from_str::<RawRule>(text)
                .map_err(|e| Refused::RuleSyntax(e.message().trim().to_string()))
                .and_then(|rule| {
                    let mut raw = self.config.to_raw();
                    let rules = raw.rules.len();
                    let at = match position {
                        Some(p) if p > rules => return Err(Refused::PastTheEnd { position: p, rules }),
                        p => p.unwrap_or(rules),
                    };
                    let name = rule.name.clone();
                    raw.rules.insert(at, rule);
                    self.config.apply_update_raw(&raw).map_err(|source| Refused::Rule { name, source })
                }),
            Change::RemoveRule(name) => {
                let mut raw = self.config.to_raw();
                let before = raw.rules.len();
                raw.rules.retain(|r| r.name != name);
                if raw.rules.len() == before {
                    let rules = self.config.rules().iter().map(|r| r.name.clone()).collect();
                    Err(Refused::NoSuchRule { name: name.to_string(), rules })
                } else {
                    self.config.apply_update_raw(&raw).map_err(Refused::Invalid)
                }
            }
        };
        let next = next.map_err(|e| (what.clone(), e))?;
        let diff = self.config.diff(&next);
        let rules = self.config.rules() != next.rules();
        let access = next.access() != self.config.access();
        Ok(Proposal { next, diff, effects: Effects { rules, access }, what })
    }

    /// The configuration in force, as `config show --socket` prints it.
    pub(crate) fn reply(&self) -> crate::proto::Reply {
        crate::proto::Reply::Config {
            toml: self.config.to_toml_string(),
            file: self.path.as_ref().map(|p| p.display().to_string()),
            changes_accepted: self.accepted,
            overridden: Default::default(),
        }
    }

    /// Puts an applied proposal in the record: it is the running
    /// configuration now.
    pub(crate) fn accept(&mut self, p: Proposal) -> ConfigDiff {
        self.accepted += 1;
        if p.diff.changes.is_empty() {
            log::info!("{}: accepted, nothing changed", p.what);
        } else {
            let shown = |v: &str| if v.is_empty() { "(unset)".to_string() } else { v.to_string() };
            // The rules by name (the whole lists would be kilobytes a line
            // with hundreds of rules); every other key with its values.
            let (old_rules, new_rules) = (self.config.rules(), p.next.rules());
            let names = |rs: &[crate::config::Rule], other: &[crate::config::Rule]| -> String {
                let n: Vec<&str> = rs.iter().filter(|r| !other.contains(r)).map(|r| r.name.as_str()).collect();
                if n.is_empty() { "none".into() } else { n.join(", ") }
            };
            let list: Vec<String> = p
                .diff
                .changes
                .iter()
                .map(|c| match c.key.as_str() {
                    "rules" => format!(
                        "rules: {} in force (added or changed: {}; removed or changed: {})",
                        new_rules.len(),
                        names(new_rules, old_rules),
                        names(old_rules, new_rules)
                    ),
                    _ => format!("{} {} -> {}", c.key, shown(&c.old), shown(&c.new)),
                })
                .collect();
            log::info!("{}: accepted: {}", p.what, list.join(", "));
        }
        self.config = p.next;
        p.diff
    }

    /// Records a refusal; the running configuration stays.
    pub(crate) fn refuse(&mut self, what: &str, why: Refused) -> Refused {
        self.rejected += 1;
        log::warn!("{what}: refused, the running configuration stays: {}", why.reasons().join("; "));
        why
    }
}
