//! `[agent.access]`: who may use the control socket, and for what.
//!
//! The socket file's mode and group decide who can connect at all; the
//! agent then checks each request against the peer's credentials
//! (`SO_PEERCRED`, with the peer's supplementary groups) and three roles:
//!
//! - **admin** — change the configuration and the rules: root, the agent's
//!   own user, and `admins`;
//! - **client** — hello, register threads, keyspace cells, tickets:
//!   `clients` and the admins; everyone who can connect when `clients` is
//!   empty;
//! - **reader** — status, threads: `readers`, the clients and the admins;
//!   everyone who can connect when `readers` is empty.
//!
//! A principal is a user (`"tikv"`, `"1000"`) or a group (`"@storage"`,
//! `"@1001"`). Names come from `/etc/passwd` and `/etc/group`; numbers
//! always work.

use serde::{Deserialize, Serialize};

use super::checker::Checker;

/// `[agent.access]` as written.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct RawAccess {
    /// Octal permission bits of the socket file. Default `"0660"`: owner
    /// and group only.
    pub socket_mode: String,
    /// Group that owns the socket file (name or number). Default: the
    /// agent's own group.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket_group: Option<String>,
    /// May register threads and take tickets (empty: anyone who can connect).
    pub clients: Vec<String>,
    /// May read status and threads (empty: anyone who can connect).
    pub readers: Vec<String>,
    /// May change the configuration and rules, beside root and the agent's user.
    pub admins: Vec<String>,
}

impl Default for RawAccess {
    fn default() -> Self {
        RawAccess {
            socket_mode: "0660".into(),
            socket_group: None,
            clients: Vec::new(),
            readers: Vec::new(),
            admins: Vec::new(),
        }
    }
}

/// A user or a group, resolved to its number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Principal {
    Uid(u32),
    Gid(u32),
}

/// `[agent.access]`, validated: prints back as written.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Access {
    #[serde(flatten)]
    pub written: RawAccess,
    #[serde(skip)]
    pub mode: u32,
    #[serde(skip)]
    pub group: Option<u32>,
    #[serde(skip)]
    resolved: [Vec<Principal>; 3],
}

impl Access {
    /// Gives the socket file at `path` this group and mode. Without a group
    /// of its own the socket belongs to the agent's group (so removing
    /// `socket-group` online puts that back).
    pub fn apply_to_socket(&self, path: &std::path::Path) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let gid = self.group.unwrap_or_else(crate::sys::effective_gid);
        std::os::unix::fs::chown(path, None, Some(gid))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(self.mode))
    }
}

/// What a request needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Admin,
    Client,
    Reader,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Client => "client",
            Role::Reader => "reader",
        }
    }
}

/// A connected peer, as the kernel vouches for it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Peer {
    pub pid: u32,
    pub uid: u32,
    /// Primary and supplementary groups.
    pub gids: Vec<u32>,
}

/// `name` → id from an `/etc/passwd`-like file (`name:x:id:...`).
fn lookup(file: &str, name: &str) -> Option<u32> {
    std::fs::read_to_string(file).ok()?.lines().find_map(|l| {
        let mut f = l.split(':');
        (f.next()? == name).then(|| f.nth(1)?.parse().ok())?
    })
}

/// Why an `agent.access` entry names no one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PrincipalError {
    #[error("unknown group {0:?} (not a number, not in /etc/group)")]
    Group(String),
    #[error("unknown user {0:?} (not a number, not in /etc/passwd); a group is written @name")]
    User(String),
}

fn resolve(p: &str) -> Result<Principal, PrincipalError> {
    match p.strip_prefix('@') {
        Some(g) => g
            .parse()
            .ok()
            .or_else(|| lookup("/etc/group", g))
            .map(Principal::Gid)
            .ok_or_else(|| PrincipalError::Group(g.to_string())),
        None => p
            .parse()
            .ok()
            .or_else(|| lookup("/etc/passwd", p))
            .map(Principal::Uid)
            .ok_or_else(|| PrincipalError::User(p.to_string())),
    }
}

impl Access {
    fn listed(&self, list: usize, peer: &Peer) -> bool {
        self.resolved[list].iter().any(|p| match *p {
            Principal::Uid(u) => u == peer.uid,
            Principal::Gid(g) => peer.gids.contains(&g),
        })
    }

    /// Whether `peer` may do what `role` covers; `agent_uid` is the agent's own.
    pub fn allows(&self, peer: &Peer, role: Role, agent_uid: u32) -> bool {
        let admin = peer.uid == 0 || peer.uid == agent_uid || self.listed(2, peer);
        let client = admin || self.written.clients.is_empty() || self.listed(0, peer);
        match role {
            Role::Admin => admin,
            Role::Client => client,
            Role::Reader => client || self.written.readers.is_empty() || self.listed(1, peer),
        }
    }

    /// Who holds `role`, for a refusal's message.
    pub fn holders(&self, role: Role) -> String {
        let mut who = vec!["root".to_string(), "the agent's user".to_string()];
        let w = &self.written;
        let lists: &[&Vec<String>] = match role {
            Role::Admin => &[&w.admins],
            Role::Client => &[&w.admins, &w.clients],
            Role::Reader => &[&w.admins, &w.clients, &w.readers],
        };
        who.extend(lists.iter().flat_map(|l| l.iter().cloned()));
        let key = match role {
            Role::Admin => "agent.access.admins",
            Role::Client => "agent.access.clients",
            Role::Reader => "agent.access.readers",
        };
        format!("{} ({key})", who.join(", "))
    }
}

pub(super) fn check(c: &mut Checker<'_>, raw: &RawAccess) -> Access {
    let digits = raw.socket_mode.trim_start_matches("0o");
    let mode = u32::from_str_radix(digits, 8).ok().filter(|m| *m <= 0o777);
    if mode.is_none() {
        c.invalid(
            "agent.access.socket-mode".into(),
            format!("{:?} is not octal permission bits like \"0660\"", raw.socket_mode),
        );
    }
    let group = raw.socket_group.as_ref().and_then(|g| match resolve(&format!("@{}", g.trim_start_matches('@'))) {
        Ok(Principal::Gid(gid)) => Some(gid),
        Ok(Principal::Uid(_)) => None,
        Err(e) => {
            c.invalid("agent.access.socket-group".into(), e.to_string());
            None
        }
    });
    let mut resolved: [Vec<Principal>; 3] = Default::default();
    for (i, (key, list)) in
        [("clients", &raw.clients), ("readers", &raw.readers), ("admins", &raw.admins)].into_iter().enumerate()
    {
        for p in list {
            match resolve(p) {
                Ok(r) => resolved[i].push(r),
                Err(e) => c.invalid(format!("agent.access.{key}"), e.to_string()),
            }
        }
    }
    Access { written: raw.clone(), mode: mode.unwrap_or(0o660), group, resolved }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ValidatedConfig;

    fn access(toml: &str) -> Access {
        ValidatedConfig::from_toml_str(toml).unwrap().access().clone()
    }

    #[test]
    fn roles_follow_the_lists_and_root_is_always_admin() {
        let a = access("[agent.access]\nclients = [\"0\"]\nreaders = [\"@65534\"]\n");
        let nobody = Peer { pid: 1, uid: 65534, gids: vec![65534] };
        let other = Peer { pid: 1, uid: 1, gids: vec![1] };
        let root = Peer { pid: 1, uid: 0, gids: vec![0] };
        assert!(!a.allows(&nobody, Role::Client, 0) && a.allows(&nobody, Role::Reader, 0));
        assert!(!a.allows(&other, Role::Reader, 0) && !a.allows(&other, Role::Admin, 0));
        assert!(a.allows(&root, Role::Admin, 0));
        // The agent's own user is an admin; empty lists let everyone in.
        let open = access("");
        assert!(open.allows(&other, Role::Client, 1) && open.allows(&other, Role::Admin, 1));
        assert!(open.allows(&other, Role::Reader, 0) && !open.allows(&other, Role::Admin, 0));
        assert_eq!(open.mode, 0o660);
    }

    #[test]
    fn unknown_principals_and_bad_modes_are_refused_by_key() {
        let e = ValidatedConfig::from_toml_str(
            "[agent.access]\nsocket-mode = \"0999\"\nclients = [\"no-such-user-here\"]\nadmins = [\"@no-such-group-here\"]\n",
        )
        .unwrap_err();
        assert_eq!(e.keys(), vec!["agent.access.socket-mode", "agent.access.clients", "agent.access.admins"]);
    }
}
