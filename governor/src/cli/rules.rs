//! `governor rules list|add|remove`: unmodified processes measured by rule.

use super::CliError;
use super::config_cmd::{Applied, applied};
use crate::config::RawRule;
use crate::proto::{Reply, Request, RuleStatus};
use std::fmt::Write as _;
use std::path::Path;

/// The rules in force, with the kernel's report counts.
#[derive(Debug, serde::Serialize)]
pub struct RuleList {
    pub rules: Vec<RuleStatus>,
    /// Where capped rule keyspaces are held to their cap, or why not.
    pub enforcement: String,
    pub events: u64,
    pub events_dropped: u64,
}

pub fn list(socket: &Path) -> Result<RuleList, CliError> {
    match crate::client::request(socket, &Request::Status)? {
        Reply::Status(s) => Ok(RuleList {
            rules: s.rules,
            enforcement: s.rule_enforcement,
            events: s.rule_events,
            events_dropped: s.rule_events_dropped,
        }),
        Reply::Error { message } => Err(CliError::Agent { message }),
        other => Err(CliError::Reply { detail: format!("{other:?}") }),
    }
}

pub fn render_list(l: &RuleList) -> String {
    if l.rules.is_empty() {
        return "no rules\n".into();
    }
    let mut out =
        format!("{:<3} {:<24} {:>10} {:>9} {:>9}  {}\n", "#", "NAME", "KEYSPACE", "MATCHED", "CAP", "MATCHES");
    for (i, r) in l.rules.iter().enumerate() {
        // A cap some of whose processes could not be moved under it: marked.
        let cap = r
            .cap_cores
            .map_or("-".to_string(), |c| format!("{c:.2}{}", if r.processes_not_capped > 0 { "!" } else { "" }));
        // A thread rule matches threads: their count, marked.
        let matched = if r.matches.contains("thread-name-prefix=") {
            format!("{}t", r.threads_matched)
        } else {
            r.processes_matched.to_string()
        };
        let _ = writeln!(out, "{:<3} {:<24} {:>10} {:>9} {:>9}  {}", i, r.name, r.keyspace, matched, cap, r.matches);
    }
    let _ = writeln!(
        out,
        "MATCHED: live processes the rule matched (their children are charged and capped with them, not counted here){}",
        if l.rules.iter().any(|r| r.matches.contains("thread-name-prefix=")) {
            "; Nt: threads a thread rule charges apart from their process"
        } else {
            ""
        }
    );
    let _ = writeln!(out, "caps: {}", l.enforcement);
    for r in l.rules.iter().filter(|r| r.processes_not_capped > 0) {
        let _ = writeln!(
            out,
            "{}! rule {}: {} of its processes could not be moved into the keyspace's cgroup ({}): the kernel does not hold them to the cap",
            r.cap_cores.map_or(String::new(), |c| format!("{c:.2}")),
            r.name,
            r.processes_not_capped,
            r.not_capped_reason.as_deref().unwrap_or("refused")
        );
    }
    if l.rules.iter().any(|r| !r.measured) {
        out.push_str(
            "not measured: the agent runs the thread-clock fallback, which cannot measure unmodified processes\n",
        );
    }
    let _ = writeln!(out, "{} process reports from the kernel, {} dropped", l.events, l.events_dropped);
    out
}

/// `governor rules add`: the rule is validated with the whole configuration
/// (exit 64 with every reason when refused).
pub fn add(socket: &Path, rule: &RawRule, position: Option<usize>) -> Result<Applied, CliError> {
    let text = toml::to_string(rule).map_err(|e| CliError::Usage(format!("rule: {e}")))?;
    applied(crate::client::request(socket, &Request::RuleAdd { rule: text, position })?)
}

pub fn remove(socket: &Path, name: &str) -> Result<Applied, CliError> {
    applied(crate::client::request(socket, &Request::RuleRemove { name: name.into() })?)
}
