//! `governor config validate|show|set|reload`.

use super::{CliError, load_config};
use crate::config::ValidatedConfig;
use crate::proto::{ConfigChange, Reply, Request};
use std::fmt::Write as _;
use std::path::Path;

/// What an accepted change did.
#[derive(Debug, serde::Serialize)]
pub struct Applied {
    pub accepted: bool,
    /// Every key it changed, with both values as TOML.
    pub changes: Vec<ConfigChange>,
    /// What may keep it from acting as meant on this machine now (a rule's
    /// cgroup that does not exist): printed as warnings.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

pub(super) fn applied(reply: Reply) -> Result<Applied, CliError> {
    match reply {
        Reply::ConfigUpdated { changes } => Ok(Applied { accepted: true, changes, warnings: Vec::new() }),
        Reply::ConfigRejected { errors, file_unreadable } => Err(CliError::Rejected { errors, file_unreadable }),
        Reply::Error { message } => Err(CliError::Agent { message }),
        other => Err(CliError::Reply { detail: format!("{other:?}") }),
    }
}

/// `governor config set KEY=VALUE`: one key of the running agent's
/// configuration (VALUE is TOML, or a bare string: `10ms`, `1:100,2:200`).
pub fn set(socket: &Path, assignment: &str) -> Result<Applied, CliError> {
    let usage = |what: &str| {
        CliError::Usage(format!(
            "`{assignment}` {what} (KEY=VALUE, for example resource-control.cpu-throttle.tenant-max-cpu-ratio=0.25)"
        ))
    };
    let Some((key, value)) = assignment.split_once('=') else { return Err(usage("is not KEY=VALUE")) };
    if key.trim().is_empty() {
        return Err(usage("names no key"));
    }
    applied(crate::client::request(socket, &Request::ConfigSet { key: key.trim().into(), value: value.trim().into() })?)
}

/// `governor config reload`: the running agent re-reads its file.
pub fn reload(socket: &Path) -> Result<Applied, CliError> {
    applied(crate::client::request(socket, &Request::ConfigReload)?)
}

/// Human-readable: one line per changed key.
pub fn render_applied(a: &Applied) -> String {
    if a.changes.is_empty() {
        return "accepted; nothing changed\n".into();
    }
    let mut out = String::new();
    for c in &a.changes {
        let _ = match (c.new.is_empty(), c.old.is_empty()) {
            (true, _) => writeln!(out, "{} unset   (was {})", c.key, c.old),
            (false, true) => writeln!(out, "{} = {}   (was unset)", c.key, c.new),
            (false, false) => writeln!(out, "{} = {}   (was {})", c.key, c.new, c.old),
        };
    }
    out
}

/// Validates `path`; the validated configuration on success.
pub fn validate(path: &Path) -> Result<ValidatedConfig, CliError> {
    load_config(path)
}

/// What holds on this machine but may not be what the operator meant
/// (printed as warnings; the file is valid): quotas larger than the
/// server's cores (`server-cpu-cores`, else this machine's: the agent
/// compares with its servers' cgroup limit, which a command does not see).
/// Also rules that can match nothing on this machine as it is now (an `exe`
/// or a `cgroup` that does not exist, a `uid` no user in /etc/passwd has):
/// valid, since each may appear later (a service's cgroup exists while it
/// runs), but worth a look.
pub fn notices(config: &ValidatedConfig) -> Vec<String> {
    let configured = config.resource_control().server_cpu_cores;
    let mut notes = if configured > 0.0 {
        config.notices_on(configured, "resource-control.server-cpu-cores,")
    } else {
        config.notices_on(f64::from(crate::sys::logical_cores()), "this machine's online CPUs,")
    };
    for r in config.rules() {
        notes.extend(rule_notices(&r.name, r.exe.as_deref(), r.cgroup.as_deref(), r.uid.map(i64::from)));
    }
    notes
}

/// What may keep a rule from matching anything on this machine as it is
/// now ([`notices`]; `rules add` says them too).
pub fn rule_notices(name: &str, exe: Option<&str>, cgroup: Option<&str>, uid: Option<i64>) -> Vec<String> {
    let mut notes = Vec::new();
    if let Some(exe) = exe.filter(|e| !Path::new(e).exists()) {
        notes.push(format!("rules.{name}.exe: {exe} does not exist here; the rule matches nothing until it does"));
    }
    if let Some(cg) = cgroup
        .filter(|cg| !crate::config::cgroup_roots().iter().any(|root| root.join(cg.trim_start_matches('/')).is_dir()))
    {
        notes.push(format!("rules.{name}.cgroup: {cg} does not exist here; the rule matches nothing until it does"));
    }
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    let has_uid = |uid: i64| passwd.lines().any(|l| l.split(':').nth(2) == Some(uid.to_string().as_str()));
    if let Some(uid) = uid.filter(|&u| !passwd.is_empty() && !has_uid(u)) {
        notes.push(format!("rules.{name}.uid: no user has uid {uid} in /etc/passwd here"));
    }
    notes
}

/// The configuration a running agent holds.
#[derive(Debug, serde::Serialize)]
pub struct Running {
    /// The file it started from (none: the embedded default).
    pub file: Option<String>,
    /// Changes accepted since it started (`config set`, `config reload`,
    /// rules, SIGHUP).
    pub changes_accepted: u64,
    /// Every key, as a file would write it.
    pub config: toml::Table,
    /// Keys the agent's command line overrides, with the value in force.
    pub overridden: std::collections::BTreeMap<String, String>,
}

/// `governor config show --socket PATH`: the running agent's configuration.
pub fn show_running(socket: &Path) -> Result<Running, CliError> {
    match crate::client::request(socket, &Request::ConfigShow)? {
        Reply::Config { toml, file, changes_accepted, overridden } => {
            let config = toml.parse().map_err(|e| CliError::Reply { detail: format!("the configuration: {e}") })?;
            Ok(Running { file, changes_accepted, config, overridden })
        }
        Reply::Error { message } => Err(CliError::Agent { message }),
        other => Err(CliError::Reply { detail: format!("{other:?}") }),
    }
}

/// Human-readable: a TOML file of the running configuration, its origin in
/// a comment.
pub fn render_running(r: &Running) -> String {
    let from = r.file.as_deref().map_or("the embedded default".to_string(), |f| format!("--config {f}"));
    let over: String = r
        .overridden
        .iter()
        .map(|(k, v)| format!("# {k}: {v} in force (the agent's command line), the configuration's value below\n"))
        .collect();
    format!(
        "# the running agent's configuration: from {from}, {} change{} accepted since it started\n{over}{}",
        r.changes_accepted,
        if r.changes_accepted == 1 { "" } else { "s" },
        toml::to_string(&r.config).unwrap_or_default()
    )
}

/// The configuration in force for `path`, or the embedded default.
pub fn show(path: Option<&Path>) -> Result<ValidatedConfig, CliError> {
    match path {
        Some(p) => load_config(p),
        None => Ok(ValidatedConfig::embedded_default()),
    }
}
