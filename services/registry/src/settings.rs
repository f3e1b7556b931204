//! Registry configuration.
//!
//! Loaded with [`aip_runtime::settings::load`]: defaults, then an optional TOML/JSON file,
//! then environment variables: `AIP_<FIELD>` for the shared top-level fields (e.g.
//! `AIP_DATABASE_URL`, `AIP_NATS_URL`) and `AIP_REGISTRY__<FIELD>` for the `[registry]`
//! section (e.g. `AIP_REGISTRY__LISTEN=0.0.0.0:5001`, `AIP_REGISTRY__API_KEYS=k1,k2`).

use std::net::SocketAddr;
use std::time::Duration;

use aip_runtime::telemetry::LogFormat;
use serde::{Deserialize, Serialize};

/// Upper bound of [`RegistrySettings::max_in_flight`].
pub const MAX_IN_FLIGHT: usize = 100_000;

/// Everything the registry can be told.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct Settings {
    /// NATS server URL (the binary always talks NATS; `aip dev` passes an in-process bus).
    pub nats_url: String,
    /// Database URL: `postgres://…` in the distributed mode, `sqlite://…` embedded.
    pub database_url: String,
    /// Subject prefix shared by every service of one deployment.
    pub subject_prefix: String,
    /// Log format.
    pub log_format: LogFormat,
    /// The registry's own settings.
    pub registry: RegistrySettings,
}

/// The `[registry]` section.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct RegistrySettings {
    /// Address of the REST API and the health probes (port 0 picks a free port).
    pub listen: SocketAddr,
    /// Keys accepted on `/api/*` (`X-API-Key` or `Authorization: Bearer`). A list, or one
    /// comma-separated string in the environment. Empty: no authentication, which is allowed
    /// only on a loopback address unless `allow_no_auth` is set.
    #[serde(deserialize_with = "aip_runtime::settings::string_or_list")]
    pub api_keys: Vec<String>,
    /// Serve `/api/*` without keys on a non-loopback address (trusted networks only).
    pub allow_no_auth: bool,
    /// An agent whose last sign of life, or whose gateway's last presence batch, is older
    /// than this is offline (and not offered by lookup).
    pub liveness_ms: u64,
    /// An agent whose own last sign of life is older than this is offline, even if its
    /// gateway still reports. Default 100 s: above the gateway's client liveness timeout
    /// (90 s), because gateways list only the connections that showed life since their
    /// previous batch (pongs count; gateways ping every 20 s). Unset: `liveness_ms`.
    pub agent_liveness_ms: Option<u64>,
    /// Presence reports are gathered in memory and written once per this interval, in one
    /// statement, instead of one database write per heartbeat.
    pub presence_flush_ms: u64,
    /// How often expired agents are marked offline. A gateway killed without a word takes its
    /// agents offline within `liveness_ms + reap_interval_ms`.
    pub reap_interval_ms: u64,
    /// Bus requests handled at once by this replica; more wait (backpressure on NATS).
    pub max_in_flight: usize,
    /// Connections in the database pool.
    pub db_max_connections: u32,
    /// On SIGTERM, how long in-flight requests and the last presence flush may take.
    pub shutdown_grace_ms: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            nats_url: "nats://127.0.0.1:4222".to_owned(),
            database_url: "postgres://postgres@127.0.0.1:5432/aip".to_owned(),
            subject_prefix: proto_schemas::subjects::DEFAULT_PREFIX.to_owned(),
            log_format: LogFormat::Pretty,
            registry: RegistrySettings::default(),
        }
    }
}

impl Default for RegistrySettings {
    fn default() -> Self {
        RegistrySettings {
            listen: SocketAddr::from(([127, 0, 0, 1], 5001)),
            api_keys: Vec::new(),
            allow_no_auth: false,
            liveness_ms: 15_000,
            // Above the gateway's client liveness timeout (90 s) and its ping interval (20 s):
            // gateways report only connections that showed life since their last batch.
            agent_liveness_ms: Some(100_000),
            presence_flush_ms: 500,
            reap_interval_ms: 1_000,
            max_in_flight: 256,
            db_max_connections: 10,
            shutdown_grace_ms: 10_000,
        }
    }
}

/// A setting that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingsError {
    /// `/api/*` would be open to the network.
    #[error(
        "refusing to serve the REST API on {listen} without API keys: set registry.api_keys \
         (AIP_REGISTRY__API_KEYS=key1,key2), listen on a loopback address, or set \
         registry.allow_no_auth=true on a trusted network"
    )]
    NoAuthOnNetwork {
        /// The non-loopback address.
        listen: SocketAddr,
    },
    /// A duration or size is zero, or out of proportion with another.
    #[error("invalid registry setting: {0}")]
    Invalid(String),
    /// The subject prefix is not usable.
    #[error(transparent)]
    Prefix(#[from] proto_schemas::subjects::InvalidPrefix),
}

impl RegistrySettings {
    /// Checks the settings for combinations that cannot work.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if self.api_keys.is_empty() && !self.listen.ip().is_loopback() && !self.allow_no_auth {
            return Err(SettingsError::NoAuthOnNetwork {
                listen: self.listen,
            });
        }
        if self.api_keys.iter().any(|k| k.trim().is_empty()) {
            return Err(SettingsError::Invalid(
                "api_keys must not contain empty keys".to_owned(),
            ));
        }
        for (name, value) in [
            ("liveness_ms", self.liveness_ms),
            (
                "agent_liveness_ms",
                self.agent_liveness_ms.unwrap_or(self.liveness_ms),
            ),
            ("presence_flush_ms", self.presence_flush_ms),
            ("reap_interval_ms", self.reap_interval_ms),
            ("max_in_flight", self.max_in_flight as u64),
            ("db_max_connections", u64::from(self.db_max_connections)),
        ] {
            if value == 0 {
                return Err(SettingsError::Invalid(format!(
                    "{name} must be greater than 0"
                )));
            }
        }
        if self.max_in_flight > MAX_IN_FLIGHT {
            return Err(SettingsError::Invalid(format!(
                "max_in_flight must be at most {MAX_IN_FLIGHT}"
            )));
        }
        if self.presence_flush_ms >= self.liveness_ms {
            return Err(SettingsError::Invalid(format!(
                "presence_flush_ms ({}) must be well below liveness_ms ({}), or live agents expire \
                 before their presence is written",
                self.presence_flush_ms, self.liveness_ms
            )));
        }
        Ok(())
    }

    /// [`RegistrySettings::liveness_ms`] as a duration.
    pub fn liveness(&self) -> Duration {
        Duration::from_millis(self.liveness_ms)
    }

    /// [`RegistrySettings::agent_liveness_ms`] (or `liveness_ms`) as a duration.
    pub fn agent_liveness(&self) -> Duration {
        Duration::from_millis(self.agent_liveness_ms.unwrap_or(self.liveness_ms))
    }

    /// [`RegistrySettings::presence_flush_ms`] as a duration.
    pub fn presence_flush(&self) -> Duration {
        Duration::from_millis(self.presence_flush_ms)
    }

    /// [`RegistrySettings::reap_interval_ms`] as a duration.
    pub fn reap_interval(&self) -> Duration {
        Duration::from_millis(self.reap_interval_ms)
    }

    /// [`RegistrySettings::shutdown_grace_ms`] as a duration.
    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_millis(self.shutdown_grace_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        RegistrySettings::default()
            .validate()
            .expect("defaults validate");
    }

    #[test]
    fn open_api_on_the_network_is_refused_unless_allowed() {
        let mut s = RegistrySettings {
            listen: "0.0.0.0:5001".parse().expect("addr"),
            ..Default::default()
        };
        let err = s.validate().expect_err("no keys on 0.0.0.0");
        assert!(err.to_string().contains("AIP_REGISTRY__API_KEYS"), "{err}");
        s.allow_no_auth = true;
        s.validate().expect("explicitly allowed");
        s.allow_no_auth = false;
        s.api_keys = vec!["k".to_owned()];
        s.validate().expect("keys set");
    }

    #[test]
    fn keys_come_as_a_list_or_a_comma_separated_string() {
        let s: RegistrySettings =
            serde_json::from_str(r#"{"api_keys": "a, b,,c"}"#).expect("string");
        assert_eq!(s.api_keys, ["a", "b", "c"]);
        let s: RegistrySettings = serde_json::from_str(r#"{"api_keys": ["x"]}"#).expect("list");
        assert_eq!(s.api_keys, ["x"]);
    }

    #[test]
    fn flush_must_be_shorter_than_liveness() {
        let s = RegistrySettings {
            liveness_ms: 500,
            presence_flush_ms: 500,
            ..Default::default()
        };
        assert!(s.validate().is_err());
    }
}
