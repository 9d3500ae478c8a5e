//! Puts a configuration change in force: `live_config` proposes it and
//! keeps the record; the state each effect reaches is changed here, where
//! the agent owns it, and undone when a later step refuses the change.

use super::Shared;
use super::live_config::{Change, Proposal, Refused};
use crate::config::{ConfigDiff, ValidatedConfig};
use crate::policy::Settings;
use std::sync::Arc;
use std::sync::atomic::Ordering;

impl Shared {
    /// Validates `change` against the running configuration, applies it
    /// whole or not at all, and records the outcome.
    pub(crate) fn change_config(&self, change: Change<'_>) -> Result<ConfigDiff, Refused> {
        let mut running = self.lock_config();
        let proposal = match running.propose(change) {
            Ok(p) => p,
            Err((what, why)) => return Err(running.refuse(&what, why)),
        };
        match self.put_in_force(&running.config, &proposal) {
            Ok(()) => Ok(running.accept(proposal)),
            Err(why) => Err(running.refuse(&proposal.what, why)),
        }
    }

    /// The effects of `p`, in an order that can be undone: the rules' cells
    /// and caps, then the policy's settings (on refusal the rules of
    /// `current` are put back), then what cannot refuse.
    fn put_in_force(&self, current: &ValidatedConfig, p: &Proposal) -> Result<(), Refused> {
        let next = &p.next;
        // The caps are derived (cgroups::CapSettings): any key they are
        // derived from that changed puts them in force again.
        let rules =
            p.effects.rules || (!next.rules().is_empty() && self.cap_settings(current) != self.cap_settings(next));
        if rules && let Err(e) = self.apply_rules(next) {
            let _ = self.apply_rules(current);
            return Err(Refused::RuleCells(e));
        }
        let server_cpu_cores = next.resource_control().server_cpu_cores;
        let cores = self.lock_server_cpu().cores_with(server_cpu_cores);
        let noticed = [
            "resource-control.server-cpu-cores",
            "resource-control.max-read-cpu-ratio",
            "resource-control.cpu-throttle.tenant-max-cpu-ratio",
        ];
        if p.diff.hot().keyspace_cpu_quotas || noticed.iter().any(|k| p.diff.changed(k)) {
            for notice in next.notices_on(cores, "this server's") {
                log::warn!("{}: {notice}", p.what);
            }
        }
        if let Err(e) = self.policy.update_settings_at(Settings::from_config(next, cores), super::now_us()) {
            if rules {
                let _ = self.apply_rules(current);
            }
            return Err(Refused::Policy(e));
        }
        let a = next.agent();
        if p.effects.access
            && let Err(e) = next.access().apply_to_socket(&self.socket)
        {
            log::warn!("{}: the control socket's mode or group could not be set: {e}", p.what);
        }
        self.keyspaces_per_uid.store(a.keyspaces_per_uid(), Ordering::Relaxed);
        self.metrics_max_keyspaces.store(a.metrics_max_keyspaces as usize, Ordering::Relaxed);
        self.lock_slots().set_per_uid(a.threads_per_uid());
        self.lock_server_cpu().set_configured(server_cpu_cores);
        Ok(())
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
        let _ = shared.change_config(Change::Reload("SIGHUP".into()));
    }
}
