//! Live configuration: `config set KEY=VALUE`, `config reload` and SIGHUP.
//!
//! A change is validated whole, exactly as a start would validate it, and
//! against the running configuration (restart-only keys are refused with
//! the reason). It is applied entirely or not at all: on any error the
//! running configuration stays, the log records every reason and
//! `governor_config_updates_total{result="rejected"}` counts it. An
//! accepted change reaches the policy (buckets, caps, quotas, estimates,
//! window, admission mode) and the agent's own limits (per-uid quotas, the
//! metrics cardinality guard) at once; the log lists every key it changed.
//!
//! Who may change it: the admin role of `agent.access` (root, the agent's
//! own user, `admins`); the server checks the peer before it gets here.

use super::Shared;
use crate::config::{ConfigDiff, UpdateRejected, ValidatedConfig};
use crate::policy::Settings;
use crate::proto::{ConfigChange, ConfigUpdates, Reply};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// The configuration in force and its history.
pub(crate) struct Running {
    pub(super) config: ValidatedConfig,
    path: Option<PathBuf>,
    accepted: u64,
    rejected: u64,
}

impl Running {
    pub(crate) fn new(config: ValidatedConfig, path: Option<PathBuf>) -> Running {
        Running { config, path, accepted: 0, rejected: 0 }
    }

    /// `agent.access` in force.
    pub(crate) fn access(&self) -> crate::config::Access {
        self.config.agent().access.clone()
    }

    pub(crate) fn counts(&self) -> ConfigUpdates {
        ConfigUpdates {
            accepted: self.accepted,
            rejected: self.rejected,
            path: self.path.as_ref().map(|p| p.display().to_string()),
        }
    }
}

/// Why a change was refused: every reason, one line each.
fn reasons(e: &UpdateRejected) -> Vec<String> {
    e.errors.errors.iter().map(|x| x.to_string()).collect()
}

impl Shared {
    /// Re-reads the configuration file and applies it (`what` names the
    /// trigger in the log).
    pub(crate) fn reload_config(&self, what: &str) -> Result<ConfigDiff, Vec<String>> {
        let mut running = self.lock_config();
        let Some(path) = running.path.clone() else {
            running.rejected += 1;
            let why = "the agent runs on the embedded default configuration (no --config file): \
                       nothing to reload; use `governor config set`"
                .to_string();
            log::warn!("{what}: {why}");
            return Err(vec![why]);
        };
        let next = std::fs::read_to_string(&path)
            .map_err(|e| vec![format!("cannot read {}: {e}", path.display())])
            .and_then(|text| running.config.apply_update(&text).map_err(|e| reasons(&e)));
        self.settle(&mut running, next, &format!("{what} ({})", path.display()))
    }

    /// Changes one key of the running configuration.
    pub(crate) fn set_config(&self, key: &str, value: &str) -> Result<ConfigDiff, Vec<String>> {
        let mut running = self.lock_config();
        let next = running.config.apply_set(key, value).map_err(|e| reasons(&e));
        self.settle(&mut running, next, &format!("config set {key}={value}"))
    }

    /// Adds a rule (its keys as a TOML table) at `position` (default: last).
    pub(crate) fn add_rule(&self, text: &str, position: Option<usize>) -> Result<ConfigDiff, Vec<String>> {
        let mut running = self.lock_config();
        let next = toml::from_str::<crate::config::RawRule>(text)
            .map_err(|e| vec![format!("rule: {}", e.message().trim())])
            .and_then(|rule| {
                let mut raw = running.config.to_raw();
                let at = position.unwrap_or(raw.rules.len()).min(raw.rules.len());
                let what = rule.name.clone();
                raw.rules.insert(at, rule);
                running.config.apply_update_raw(&raw).map_err(|e| {
                    let mut r = reasons(&e);
                    r.insert(0, format!("rule {what:?} refused:"));
                    r
                })
            });
        self.settle(&mut running, next, "rules add")
    }

    /// Removes the rule named `name`.
    pub(crate) fn remove_rule(&self, name: &str) -> Result<ConfigDiff, Vec<String>> {
        let mut running = self.lock_config();
        let mut raw = running.config.to_raw();
        let before = raw.rules.len();
        raw.rules.retain(|r| r.name != name);
        let next = if raw.rules.len() == before {
            let names: Vec<&str> = running.config.rules().iter().map(|r| r.name.as_str()).collect();
            Err(vec![format!(
                "no rule named {name:?} (rules: {})",
                if names.is_empty() { "none".into() } else { names.join(", ") }
            )])
        } else {
            running.config.apply_update_raw(&raw).map_err(|e| reasons(&e))
        };
        self.settle(&mut running, next, &format!("rules remove {name}"))
    }

    /// Applies an accepted configuration, or records the refusal.
    fn settle(
        &self,
        running: &mut Running,
        next: Result<ValidatedConfig, Vec<String>>,
        what: &str,
    ) -> Result<ConfigDiff, Vec<String>> {
        let next = match next {
            Ok(n) => n,
            Err(errors) => {
                running.rejected += 1;
                log::warn!("{what}: refused, the running configuration stays: {}", errors.join("; "));
                return Err(errors);
            }
        };
        let diff = running.config.diff(&next);
        // Rules, and the caps the kernel holds their keyspaces to.
        // Rule caps are fractions of the server's cores: they follow
        // `server-cpu-cores` too.
        let rules_change = running.config.rules() != next.rules()
            || (!next.rules().is_empty()
                && (diff.changed("resource-control.cpu-throttle")
                    || diff.changed("resource-control.server-cpu-cores")));
        if rules_change && let Err(e) = self.apply_rules(&next) {
            running.rejected += 1;
            let why = format!("the rules' keyspaces get no cell: {e}");
            log::warn!("{what}: refused, the running configuration stays: {why}");
            let _ = self.apply_rules(&running.config);
            return Err(vec![why]);
        }
        let server_cpu_cores = next.resource_control().server_cpu_cores;
        let cores = self.lock_server_cpu().cores_with(server_cpu_cores);
        if let Err(e) = self.policy.update_settings_at(Settings::from_config(&next, cores), super::now_us()) {
            running.rejected += 1;
            if rules_change {
                let _ = self.apply_rules(&running.config);
            }
            let why = format!("the policy could not take it: {e}");
            log::warn!("{what}: refused, the running configuration stays: {why}");
            return Err(vec![why]);
        }
        let a = next.agent();
        if a.access != running.config.agent().access
            && let Err(e) = a.access.apply_to_socket(&self.socket)
        {
            log::warn!("{what}: the control socket's mode or group could not be set: {e}");
        }
        self.keyspaces_per_uid.store(a.max_keyspaces_per_uid, Ordering::Relaxed);
        self.metrics_max_keyspaces.store(a.metrics_max_keyspaces as usize, Ordering::Relaxed);
        self.lock_slots().set_per_uid(a.max_threads_per_uid);
        self.lock_server_cpu().set_configured(server_cpu_cores);
        running.config = next;
        running.accepted += 1;
        if diff.changes.is_empty() {
            log::info!("{what}: accepted, nothing changed");
        } else {
            let list: Vec<String> = diff.changes.iter().map(|c| format!("{} {} -> {}", c.key, c.old, c.new)).collect();
            log::info!("{what}: accepted: {}", list.join(", "));
        }
        Ok(diff)
    }
}

/// What a peer asks to change.
pub(crate) enum Change<'a> {
    Reload,
    Set(&'a str, &'a str),
    AddRule(&'a str, Option<usize>),
    RemoveRule(&'a str),
}

/// A configuration change from a peer of uid `uid` (the admin role, which
/// the server checked).
pub(crate) fn request(shared: &Shared, uid: u32, change: Change<'_>) -> Reply {
    let result = match change {
        Change::Reload => shared.reload_config(&format!("config reload by uid {uid}")),
        Change::Set(key, value) => shared.set_config(key, value),
        Change::AddRule(text, position) => shared.add_rule(text, position),
        Change::RemoveRule(name) => shared.remove_rule(name),
    };
    match result {
        Ok(diff) => Reply::ConfigUpdated {
            changes: diff.changes.into_iter().map(|c| ConfigChange { key: c.key, old: c.old, new: c.new }).collect(),
        },
        Err(errors) => Reply::ConfigRejected { errors },
    }
}

/// Reloads the configuration file on every SIGHUP.
pub(crate) async fn on_sighup(shared: Arc<Shared>) {
    let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            log::warn!("no SIGHUP handler ({e}); `governor config reload` still works");
            return;
        }
    };
    while hup.recv().await.is_some() {
        let _ = shared.reload_config("SIGHUP");
    }
}
