//! Registry configuration.
//!
//! Loaded with [`aip_runtime::settings::load`]: defaults, then an optional TOML/JSON file,
//! then environment variables: `AIP_<FIELD>` for the shared top-level fields (e.g.
//! `AIP_DATABASE_URL`, `AIP_NATS_URL`) and `AIP_REGISTRY__<FIELD>` for the `[registry]`
//! section (e.g. `AIP_REGISTRY__LISTEN=0.0.0.0:5001`, `AIP_REGISTRY__API_KEYS=k1,k2`).

use std::net::SocketAddr;
use std::time::Duration;

use aip_runtime::service::{
    Common, DEFAULT_DATABASE_URL, DEFAULT_NATS_URL, Exposure, Guard, ServiceName, ServiceSettings,
    StartError, require_positive,
};
use aip_runtime::telemetry::LogFormat;
use aip_store::{Planner, PoolOptions};
use serde::{Deserialize, Serialize};

/// Upper bound of [`RegistrySettings::max_in_flight`].
pub const MAX_IN_FLIGHT: usize = 100_000;

/// Everything the registry can be told: the settings every service shares (see
/// [`aip_runtime::service`]) at the top, its own in `[registry]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct Settings {
    /// NATS server URL (the binary always talks NATS; `aip dev` passes an in-process bus).
    pub nats_url: String,
    /// NATS credentials and TLS beside the URL (`nats_creds_file`, `nats_user`, …, top level).
    #[serde(flatten)]
    pub nats: aip_bus::NatsSettings,
    /// Database URL: `postgres://…` in the distributed mode, `sqlite://…` embedded.
    pub database_url: String,
    /// Subject prefix shared by every service of one deployment.
    pub subject_prefix: String,
    /// `pretty` for a terminal, `json` for a log collector.
    pub log_format: LogFormat,
    /// Threads that run the service's work (`AIP_WORKER_THREADS`); unset: one per CPU the
    /// process may use. See [`aip_runtime::runner`] for when fewer are faster.
    pub worker_threads: Option<usize>,
    /// The `[registry]` section (`AIP_REGISTRY__…`).
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
    /// Web origins allowed to call the REST API (`*` for any); a browser's request from any
    /// other origin is refused. A list, or one comma-separated string in the environment.
    #[serde(deserialize_with = "aip_runtime::settings::string_or_list")]
    pub allowed_origins: Vec<String>,
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
    /// An agent offline and unseen for this long is deleted (it registers again as a new
    /// id; its tasks stay in the session service). Galaxy names each constellation after its
    /// task (`{task_name}@{device}`), so without this the table grows by a row per task for
    /// ever. 0 keeps every agent. Default 7 days.
    pub forget_offline_after_ms: u64,
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
            nats_url: DEFAULT_NATS_URL.to_owned(),
            nats: aip_bus::NatsSettings::default(),
            database_url: DEFAULT_DATABASE_URL.to_owned(),
            subject_prefix: proto_schemas::subjects::DEFAULT_PREFIX.to_owned(),
            log_format: LogFormat::Pretty,
            worker_threads: None,
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
            allowed_origins: Vec::new(),
            liveness_ms: 15_000,
            // Above the gateway's client liveness timeout (90 s) and its ping interval (20 s):
            // gateways report only connections that showed life since their last batch.
            agent_liveness_ms: Some(100_000),
            presence_flush_ms: 500,
            reap_interval_ms: 1_000,
            forget_offline_after_ms: 7 * 24 * 3600 * 1000,
            max_in_flight: 256,
            db_max_connections: 10,
            shutdown_grace_ms: 10_000,
        }
    }
}

impl ServiceSettings for Settings {
    const SERVICE: ServiceName = ServiceName::Registry;
    const GUARD: Guard = Guard::ApiKeys;

    fn common(&self) -> Common<'_> {
        Common {
            nats_url: &self.nats_url,
            nats: &self.nats,
            database_url: Some(&self.database_url),
            subject_prefix: &self.subject_prefix,
            log_format: self.log_format,
            worker_threads: self.worker_threads,
        }
    }

    fn exposure(&self) -> Exposure {
        Exposure {
            listen: self.registry.listen,
            secured: !self.registry.api_keys.is_empty(),
            allow_no_auth: self.registry.allow_no_auth,
        }
    }

    fn pool_options(&self) -> PoolOptions {
        PoolOptions {
            max_connections: self.registry.db_max_connections,
            // Every statement of the registry names its agents by id or reads an index; the
            // agents table grows from empty by thousands a minute when a deployment starts.
            planner: Planner::KeyedReads,
            ..PoolOptions::default()
        }
    }

    fn check_own(&self) -> Result<(), StartError> {
        self.registry.validate()
    }
}

impl RegistrySettings {
    /// Checks the section for values that cannot work.
    fn validate(&self) -> Result<(), StartError> {
        let invalid = |reason: String| StartError::invalid(ServiceName::Registry, reason);
        if self.api_keys.iter().any(|k| k.trim().is_empty()) {
            return Err(invalid("api_keys must not contain empty keys".to_owned()));
        }
        require_positive(
            ServiceName::Registry,
            &[
                ("liveness_ms", self.liveness_ms),
                (
                    "agent_liveness_ms",
                    self.agent_liveness_ms.unwrap_or(self.liveness_ms),
                ),
                ("presence_flush_ms", self.presence_flush_ms),
                ("reap_interval_ms", self.reap_interval_ms),
                ("max_in_flight", self.max_in_flight as u64),
                ("db_max_connections", u64::from(self.db_max_connections)),
            ],
        )?;
        if self.max_in_flight > MAX_IN_FLIGHT {
            return Err(invalid(format!(
                "max_in_flight must be at most {MAX_IN_FLIGHT}"
            )));
        }
        if self.presence_flush_ms >= self.liveness_ms {
            return Err(invalid(format!(
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

    /// [`RegistrySettings::forget_offline_after_ms`] as a duration; `None` for 0 (keep every
    /// agent).
    pub fn forget_offline_after(&self) -> Option<Duration> {
        (self.forget_offline_after_ms > 0)
            .then(|| Duration::from_millis(self.forget_offline_after_ms))
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
        Settings::default().validate().expect("defaults validate");
    }

    #[test]
    fn open_api_on_the_network_is_refused_unless_allowed() {
        let mut s = Settings::default();
        s.registry.listen = "0.0.0.0:5001".parse().expect("addr");
        let err = s.validate().expect_err("no keys on 0.0.0.0");
        assert!(err.to_string().contains("AIP_REGISTRY__API_KEYS"), "{err}");
        s.registry.allow_no_auth = true;
        s.validate().expect("explicitly allowed");
        s.registry.allow_no_auth = false;
        s.registry.api_keys = vec!["k".to_owned()];
        s.validate().expect("keys set");
    }

    #[test]
    fn environment_variables_keep_their_names() {
        let environment = [
            ("AIP_NATS_URL", "nats://bus:4222"),
            ("AIP_DATABASE_URL", "postgres://db/aip"),
            ("AIP_SUBJECT_PREFIX", "envtest"),
            ("AIP_LOG_FORMAT", "json"),
            ("AIP_WORKER_THREADS", "1"),
            ("AIP_REGISTRY__LISTEN", "0.0.0.0:6001"),
            ("AIP_REGISTRY__API_KEYS", "k1,k2"),
            ("AIP_REGISTRY__ALLOW_NO_AUTH", "true"),
            ("AIP_REGISTRY__LIVENESS_MS", "20000"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        let loaded: Result<Settings, _> =
            aip_runtime::settings::load_from(None, environment.into());
        let s = loaded.expect("loads");
        assert_eq!(s.nats_url, "nats://bus:4222");
        assert_eq!(s.database_url, "postgres://db/aip");
        assert_eq!(s.subject_prefix, "envtest");
        assert_eq!(s.log_format, LogFormat::Json);
        assert_eq!(s.worker_threads, Some(1));
        assert_eq!(s.registry.listen, "0.0.0.0:6001".parse().expect("addr"));
        assert_eq!(s.registry.api_keys, ["k1", "k2"]);
        assert!(s.registry.allow_no_auth);
        assert_eq!(s.registry.liveness_ms, 20_000);
        s.validate().expect("valid");
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
    fn no_worker_threads_is_refused() {
        let s = Settings {
            worker_threads: Some(0),
            ..Settings::default()
        };
        let err = s.validate().expect_err("zero threads");
        assert!(err.to_string().contains("worker_threads"), "{err}");
    }

    #[test]
    fn flush_must_be_shorter_than_liveness() {
        let mut s = Settings::default();
        s.registry.liveness_ms = 500;
        s.registry.presence_flush_ms = 500;
        assert!(s.validate().is_err());
    }
}
