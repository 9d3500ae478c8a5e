//! `[pd]`: where the placement driver (PD) answers, for the service-limit
//! quotas of `enable-pd-service-limit`.
//!
//! `endpoints` lists PD members as `host:port` or `http://host:port`, the
//! form a TiKV node's own `[pd] endpoints` uses. The agent asks them in turn,
//! starting with the last one that answered. Plain HTTP only: PD's
//! resource-manager API is read here, never written, and a deployment with
//! TLS towards PD is refused clearly rather than contacted without it.

use serde::{Deserialize, Serialize};

use super::checker::{CT, Checker};

/// `[pd]` as written.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct RawPd {
    /// PD members, `host:port` or `http://host:port`. Empty by default;
    /// required when `enable-pd-service-limit = true`.
    pub endpoints: Vec<String>,
}

/// `[pd]`, validated: every endpoint is `http://host:port`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct Pd {
    pub endpoints: Vec<String>,
}

/// Most PD members worth listing.
const MAX_ENDPOINTS: usize = 16;

/// Why a `pd.endpoints` entry is not a PD member's address.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("{0:?}: https is not supported; governor reads PD over plain HTTP (give the member's http address)")]
    Https(String),
    #[error("{endpoint:?}: unknown scheme {scheme:?} (http, or none)")]
    Scheme { endpoint: String, scheme: String },
    #[error("{0:?}: give host:port only, without a path, user or query")]
    NotAuthority(String),
    #[error("{0:?}: missing the port (host:port, e.g. 127.0.0.1:2379)")]
    NoPort(String),
    #[error("{endpoint:?}: {host:?} is not a host name or address")]
    Host { endpoint: String, host: String },
    #[error("{endpoint:?}: {port:?} is not a port (1..65535)")]
    Port { endpoint: String, port: String },
}

/// `host:port` of one endpoint, or why it is not one.
fn authority(endpoint: &str) -> Result<&str, EndpointError> {
    let e = || endpoint.to_string();
    let rest = match endpoint.split_once("://") {
        None => endpoint,
        Some(("http", rest)) => rest,
        Some(("https", _)) => {
            return Err(EndpointError::Https(e()));
        }
        Some((scheme, _)) => return Err(EndpointError::Scheme { endpoint: e(), scheme: scheme.to_string() }),
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains('/') || rest.contains('@') || rest.contains('?') {
        return Err(EndpointError::NotAuthority(e()));
    }
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| EndpointError::NoPort(e()))?;
    let host_ok = if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        v6.parse::<std::net::Ipv6Addr>().is_ok()
    } else {
        !host.is_empty() && host.chars().all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-')
    };
    if !host_ok {
        return Err(EndpointError::Host { endpoint: e(), host: host.to_string() });
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(rest),
        _ => Err(EndpointError::Port { endpoint: e(), port: port.to_string() }),
    }
}

/// Checks `[pd]`; `needed` says whether PD is used at all.
pub(super) fn check(c: &mut Checker<'_>, raw: &RawPd, needed: bool) -> Pd {
    let mut endpoints = Vec::new();
    for e in &raw.endpoints {
        match authority(e.trim()) {
            Ok(a) => endpoints.push(format!("http://{a}")),
            Err(why) => c.invalid("pd.endpoints".into(), why.to_string()),
        }
    }
    c.check(
        raw.endpoints.len() <= MAX_ENDPOINTS,
        "pd",
        "endpoints",
        format!("lists {} members, at most {MAX_ENDPOINTS}", raw.endpoints.len()),
    );
    c.check(
        !needed || !raw.endpoints.is_empty(),
        CT,
        "enable-pd-service-limit",
        "needs pd.endpoints, the PD members to fetch service limits from",
    );
    Pd { endpoints }
}

#[cfg(test)]
mod tests {
    use super::authority;

    #[test]
    fn endpoints_are_host_port_over_http() {
        assert_eq!(authority("127.0.0.1:2379"), Ok("127.0.0.1:2379"));
        assert_eq!(authority("http://pd-0.pd:2379/"), Ok("pd-0.pd:2379"));
        assert_eq!(authority("[::1]:2379"), Ok("[::1]:2379"));
        for bad in
            ["https://pd:2379", "pd", "pd:0", "pd:99999", "http://pd:2379/pd/api", "ftp://pd:1", ":2379", "p d:1"]
        {
            assert!(authority(bad).is_err(), "{bad} accepted");
        }
        assert!(authority("https://pd:2379").unwrap_err().to_string().contains("https is not supported"));
    }
}
