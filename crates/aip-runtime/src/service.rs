//! What every service's settings have in common, checked in one place, and the one error a
//! service returns when it cannot start.
//!
//! Each service keeps its own `Settings` struct (so its configuration keys and `AIP_…`
//! variables are plain fields: `nats_url`, `database_url`, `subject_prefix`, `log_format` at the
//! top, its own section below) and implements [`ServiceSettings`], which hands the shared parts
//! to [`ServiceSettings::validate`] and to the runner ([`crate::runner`]).

use std::net::SocketAddr;

use aip_store::PoolOptions;
use proto_schemas::Subjects;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::telemetry::LogFormat;

/// The NATS server a service talks to when nothing else is configured: a local one.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

/// The database a service uses when nothing else is configured: a local PostgreSQL.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/aip";

/// The three services. The name of each one's configuration section, environment variables
/// and binary come from here, so error messages name the right keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServiceName {
    /// `aip-gateway`, section `[gateway]`.
    Gateway,
    /// `aip-registry`, section `[registry]`.
    Registry,
    /// `aip-sessions`, section `[sessions]`.
    Sessions,
}

impl ServiceName {
    /// The configuration section (`AIP_<SECTION>__<KEY>` in the environment).
    pub fn section(self) -> &'static str {
        match self {
            ServiceName::Gateway => "gateway",
            ServiceName::Registry => "registry",
            ServiceName::Sessions => "sessions",
        }
    }

    /// The binary, also the name of its NATS connection in the server's monitoring.
    pub fn binary(self) -> &'static str {
        match self {
            ServiceName::Gateway => "aip-gateway",
            ServiceName::Registry => "aip-registry",
            ServiceName::Sessions => "aip-sessions",
        }
    }

    /// The environment variable of `key` in this service's section.
    pub fn env(self, key: &str) -> String {
        format!(
            "AIP_{}__{}",
            self.section().to_ascii_uppercase(),
            key.to_ascii_uppercase()
        )
    }
}

impl std::fmt::Display for ServiceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ServiceName::Gateway => "gateway",
            ServiceName::Registry => "registry",
            ServiceName::Sessions => "session service",
        })
    }
}

/// The top-level settings every service reads (`AIP_NATS_URL`, the NATS credentials and TLS
/// of [`aip_bus::NatsSettings`] such as `AIP_NATS_CREDS_FILE`, `AIP_DATABASE_URL`,
/// `AIP_SUBJECT_PREFIX`, `AIP_LOG_FORMAT`, `AIP_WORKER_THREADS`).
#[derive(Debug, Clone, Copy)]
pub struct Common<'a> {
    /// Where the bus is.
    pub nats_url: &'a str,
    /// How the service authenticates to NATS and checks its TLS, beside the URL.
    pub nats: &'a aip_bus::NatsSettings,
    /// Where the database is; `None` for a service without one (the gateway).
    pub database_url: Option<&'a str>,
    /// Subject prefix shared by every service of one deployment.
    pub subject_prefix: &'a str,
    /// How logs are written.
    pub log_format: LogFormat,
    /// How many threads run the service's work; `None`: one per CPU the process may use.
    pub worker_threads: Option<usize>,
}

/// What protects a listener from anonymous use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guard {
    /// API keys on `/api/*` (`api_keys`).
    ApiKeys,
    /// Gateway credentials on `/ws` (`credentials_file`).
    Credentials,
}

impl Guard {
    fn what(self) -> &'static str {
        match self {
            Guard::ApiKeys => "the REST API",
            Guard::Credentials => "WebSockets",
        }
    }

    fn without(self) -> &'static str {
        match self {
            Guard::ApiKeys => "API keys",
            Guard::Credentials => "credentials",
        }
    }

    fn key(self) -> &'static str {
        match self {
            Guard::ApiKeys => "api_keys",
            Guard::Credentials => "credentials_file",
        }
    }

    fn example(self) -> &'static str {
        match self {
            Guard::ApiKeys => "key1,key2",
            Guard::Credentials => "/path/credentials.toml",
        }
    }
}

/// A listener's address and protection: the input of the one rule "nothing open to the
/// network unless asked for".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exposure {
    /// The address served.
    pub listen: SocketAddr,
    /// Whether keys or credentials are configured.
    pub secured: bool,
    /// The operator's explicit consent to an open listener on a trusted network.
    pub allow_no_auth: bool,
}

impl Exposure {
    /// Whether the listener would be open to the network without consent: no keys (or
    /// credentials), a non-loopback address, and no `allow_no_auth`.
    pub fn refused(&self) -> bool {
        !self.secured && !self.listen.ip().is_loopback() && !self.allow_no_auth
    }
}

/// Why a service could not start. One type for the three services, so the binaries, the test
/// kit and `aip dev` report start failures the same way.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A listener would be open to the network.
    #[error(
        "refusing to serve {} on {listen} without {}: set {service_section}.{key} ({env}={example}), \
         listen on a loopback address, or set {service_section}.allow_no_auth=true \
         ({allow_env}=true) on a trusted network",
        guard.what(), guard.without(),
        service_section = service.section(),
        key = guard.key(),
        env = service.env(guard.key()),
        example = guard.example(),
        allow_env = service.env("allow_no_auth"),
    )]
    OpenOnNetwork {
        /// Whose keys the message names.
        service: ServiceName,
        /// The non-loopback address.
        listen: SocketAddr,
        /// What is missing.
        guard: Guard,
    },
    /// A value cannot work (a zero duration, sizes out of proportion, an unreadable file).
    #[error("invalid {} setting: {reason}", service.section())]
    Invalid {
        /// Whose section the message names.
        service: ServiceName,
        /// What is wrong, naming the key.
        reason: String,
    },
    /// The subject prefix is not usable.
    #[error(transparent)]
    Prefix(#[from] proto_schemas::subjects::InvalidPrefix),
    /// The bus could not be reached, or a subscription or stream could not be made.
    #[error(transparent)]
    Bus(#[from] aip_bus::BusError),
    /// The database could not be opened or migrated.
    #[error(transparent)]
    Database(#[from] aip_store::DatabaseError),
    /// The listener could not be bound.
    #[error(
        "cannot listen on {addr}: {cause}; is another process using the port? (set {}.listen, \
         {})",
        service.section(), service.env("listen")
    )]
    Bind {
        /// Whose `listen` key the message names.
        service: ServiceName,
        /// What could not be bound.
        addr: SocketAddr,
        /// The cause, in the message (not a `source`, so it is not printed twice).
        cause: std::io::Error,
    },
}

impl StartError {
    /// A value of `service`'s settings that cannot work.
    pub fn invalid(service: ServiceName, reason: impl Into<String>) -> Self {
        StartError::Invalid {
            service,
            reason: reason.into(),
        }
    }
}

/// A service's `Settings`: the shared parts, checked once by [`ServiceSettings::validate`].
pub trait ServiceSettings: Default + Serialize + DeserializeOwned + Send + 'static {
    /// Which service these settings configure.
    const SERVICE: ServiceName;

    /// The top-level settings, for the runner and the shared checks.
    fn common(&self) -> Common<'_>;

    /// What protects the service's listener (named in the refusal).
    const GUARD: Guard;

    /// Environment variables the service reads besides its settings (`AIP_…`) and the ones
    /// every binary reads: name, and what for. `--check` and the start-up warning about
    /// unknown variables take them from here ([`crate::check`]).
    const VARIABLES: &'static [(&'static str, &'static str)] = &[];

    /// The service's listener and whether it is protected.
    fn exposure(&self) -> Exposure;

    /// The database pool the runner opens (the default unless the service sizes it).
    fn pool_options(&self) -> PoolOptions {
        PoolOptions::default()
    }

    /// The service's own checks (durations not zero, sizes in proportion, …).
    fn check_own(&self) -> Result<(), StartError> {
        Ok(())
    }

    /// Checks everything, shared rules first: the subject prefix, the exposure rule, then
    /// [`ServiceSettings::check_own`]. Returns the subjects under the prefix.
    fn validate(&self) -> Result<Subjects, StartError> {
        let subjects = Subjects::new(self.common().subject_prefix)?;
        if self.common().worker_threads == Some(0) {
            return Err(StartError::invalid(
                Self::SERVICE,
                "worker_threads must be at least 1 (unset: one per CPU)",
            ));
        }
        let exposure = self.exposure();
        if exposure.refused() {
            return Err(StartError::OpenOnNetwork {
                service: Self::SERVICE,
                listen: exposure.listen,
                guard: Self::GUARD,
            });
        }
        self.check_own()?;
        Ok(subjects)
    }
}

/// Checks that none of `values` (named durations, sizes, counts) is zero.
pub fn require_positive(service: ServiceName, values: &[(&str, u64)]) -> Result<(), StartError> {
    match values.iter().find(|(_, value)| *value == 0) {
        Some((name, _)) => Err(StartError::invalid(
            service,
            format!("{name} must be greater than 0"),
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exposure(listen: &str, secured: bool, allow_no_auth: bool) -> Exposure {
        Exposure {
            listen: listen.parse().expect("addr"),
            secured,
            allow_no_auth,
        }
    }

    #[test]
    fn only_an_unsecured_listener_on_the_network_without_consent_is_refused() {
        assert!(exposure("0.0.0.0:5001", false, false).refused());
        assert!(exposure("[::]:5001", false, false).refused());
        assert!(!exposure("0.0.0.0:5001", true, false).refused());
        assert!(!exposure("0.0.0.0:5001", false, true).refused());
        assert!(!exposure("127.0.0.1:5001", false, false).refused());
        assert!(!exposure("[::1]:5001", false, false).refused());
    }

    #[test]
    fn the_refusal_names_the_keys_to_set() {
        let error = StartError::OpenOnNetwork {
            service: ServiceName::Registry,
            listen: "0.0.0.0:0".parse().expect("addr"),
            guard: Guard::ApiKeys,
        };
        let text = error.to_string();
        assert!(
            text.starts_with("refusing to serve the REST API on 0.0.0.0:0 without API keys"),
            "{text}"
        );
        assert!(text.contains("AIP_REGISTRY__API_KEYS=key1,key2"), "{text}");
        assert!(text.contains("AIP_REGISTRY__ALLOW_NO_AUTH=true"), "{text}");
        let error = StartError::OpenOnNetwork {
            service: ServiceName::Gateway,
            listen: "0.0.0.0:5000".parse().expect("addr"),
            guard: Guard::Credentials,
        };
        assert!(
            error
                .to_string()
                .contains("gateway.credentials_file (AIP_GATEWAY__CREDENTIALS_FILE="),
            "{error}"
        );
    }

    /// The top of a service's settings, as the services declare it.
    #[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
    #[serde(default)]
    struct Top {
        nats_url: String,
        #[serde(flatten)]
        nats: aip_bus::NatsSettings,
    }

    #[test]
    fn nats_access_settings_come_from_top_level_variables() {
        let environment = [
            ("AIP_NATS_URL", "nats://bus:4222"),
            ("AIP_NATS_CREDS_FILE", "/run/secrets/aip.creds"),
            ("AIP_NATS_USER", "gateway"),
            ("AIP_NATS_PASSWORD", "123456"),
            ("AIP_NATS_TOKEN", "true"),
            ("AIP_NATS_TLS_CA_FILE", "/etc/nats/ca.pem"),
            ("AIP_NATS_TLS_CERT_FILE", "/etc/nats/cert.pem"),
            ("AIP_NATS_TLS_KEY_FILE", "/etc/nats/key.pem"),
            ("AIP_NATS_REQUIRE_TLS", "true"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let top: Top = crate::settings::load_from(None, environment).expect("loads");
        assert_eq!(top.nats_url, "nats://bus:4222");
        let n = &top.nats;
        assert_eq!(
            n.nats_creds_file.as_deref(),
            Some(std::path::Path::new("/run/secrets/aip.creds"))
        );
        assert_eq!(n.nats_user.as_deref(), Some("gateway"));
        // A password of digits arrives as a number from the environment and is kept as text.
        assert_eq!(n.nats_password.as_deref(), Some("123456"));
        assert_eq!(n.nats_token.as_deref(), Some("true"));
        assert_eq!(
            n.nats_tls_ca_file.as_deref(),
            Some(std::path::Path::new("/etc/nats/ca.pem"))
        );
        assert!(n.nats_tls_cert_file.is_some() && n.nats_tls_key_file.is_some());
        assert!(n.nats_require_tls);

        let defaults: Top = crate::settings::load_from(None, Default::default()).expect("defaults");
        assert_eq!(defaults.nats, aip_bus::NatsSettings::default());
    }

    #[test]
    fn zero_values_are_named() {
        let error = require_positive(ServiceName::Sessions, &[("a", 1), ("max_batch", 0)])
            .expect_err("zero");
        assert_eq!(
            error.to_string(),
            "invalid sessions setting: max_batch must be greater than 0"
        );
        require_positive(ServiceName::Sessions, &[("a", 1)]).expect("positive");
    }
}
