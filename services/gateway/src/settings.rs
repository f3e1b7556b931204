//! Gateway configuration.

use std::net::SocketAddr;
use std::path::PathBuf;

use aip_runtime::service::{
    Common, DEFAULT_NATS_URL, Exposure, Guard, ServiceName, ServiceSettings, StartError,
    require_positive,
};
use aip_runtime::telemetry::LogFormat;
use serde::{Deserialize, Serialize};

/// Everything the gateway can be told: the settings every service shares (see
/// [`aip_runtime::service`]) at the top, its own in `[gateway]`. Load with
/// [`aip_runtime::settings::load`]; environment variables are `AIP_GATEWAY__<FIELD>` for fields
/// of `gateway` and `AIP_<FIELD>` at the top.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct Settings {
    /// NATS server URL.
    pub nats_url: String,
    /// NATS credentials and TLS beside the URL (`nats_creds_file`, `nats_user`, …, top level).
    #[serde(flatten)]
    pub nats: aip_bus::NatsSettings,
    /// Subject prefix shared by every service of one deployment.
    pub subject_prefix: String,
    /// `pretty` for a terminal, `json` for a log collector.
    pub log_format: LogFormat,
    /// The `[gateway]` section (`AIP_GATEWAY__…`).
    pub gateway: GatewaySettings,
}

/// The `[gateway]` section.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct GatewaySettings {
    /// Address of the WebSocket (and health) listener. UFO clients default to port 5000.
    pub listen: SocketAddr,
    /// This gateway's id in presence and the registry; default: host name plus a random suffix.
    pub gateway_id: Option<String>,
    /// A TOML file of credentials (see README). None: no authentication, which is allowed only
    /// on a loopback address unless `allow_no_auth` is set.
    pub credentials_file: Option<PathBuf>,
    /// Run without credentials on a non-loopback address (for trusted networks only).
    pub allow_no_auth: bool,
    /// Web origins allowed to open `/ws` (`https://console.example`, `*` for any); a browser's
    /// handshake from any other origin is refused. A list, or one comma-separated string in
    /// the environment. Clients that are not browsers send no origin and are not affected.
    #[serde(deserialize_with = "aip_runtime::settings::string_or_list")]
    pub allowed_origins: Vec<String>,
    /// How long a new connection has to send its REGISTER.
    pub register_timeout_ms: u64,
    /// A registered connection silent this long (no frame, no pong) is closed and reported gone.
    pub liveness_timeout_ms: u64,
    /// How often the gateway pings each client.
    pub ping_interval_ms: u64,
    /// How often presence batches go to the registry.
    pub presence_interval_ms: u64,
    /// Largest accepted frame (UFO's limit is 100 MiB).
    pub max_frame_bytes: usize,
    /// Sustained frames per second allowed per connection (bursts of twice that are allowed).
    pub frames_per_second: u32,
    /// Most simultaneous connections; more are refused at the handshake with 503.
    pub max_connections: usize,
    /// Frames waiting to be written to one client; a client that lets more pile up is
    /// disconnected (close code 1008) instead of growing memory.
    pub outbound_queue: usize,
    /// Timeout of requests to other services (registry).
    pub request_timeout_ms: u64,
    /// On SIGTERM, how long to wait for connections to close before exiting.
    pub shutdown_grace_ms: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            nats_url: DEFAULT_NATS_URL.to_owned(),
            nats: aip_bus::NatsSettings::default(),
            subject_prefix: proto_schemas::subjects::DEFAULT_PREFIX.to_owned(),
            log_format: LogFormat::Pretty,
            gateway: GatewaySettings::default(),
        }
    }
}

impl Default for GatewaySettings {
    fn default() -> Self {
        GatewaySettings {
            listen: SocketAddr::from(([127, 0, 0, 1], 5000)),
            gateway_id: None,
            credentials_file: None,
            allow_no_auth: false,
            allowed_origins: Vec::new(),
            register_timeout_ms: 10_000,
            liveness_timeout_ms: 90_000,
            ping_interval_ms: 20_000,
            presence_interval_ms: 1_000,
            max_frame_bytes: proto_schemas::MAX_FRAME_BYTES,
            frames_per_second: 500,
            max_connections: 50_000,
            outbound_queue: 256,
            request_timeout_ms: 5_000,
            shutdown_grace_ms: 10_000,
        }
    }
}

impl ServiceSettings for Settings {
    const SERVICE: ServiceName = ServiceName::Gateway;
    const GUARD: Guard = Guard::Credentials;

    fn common(&self) -> Common<'_> {
        Common {
            nats_url: &self.nats_url,
            nats: &self.nats,
            database_url: None,
            subject_prefix: &self.subject_prefix,
            log_format: self.log_format,
        }
    }

    fn exposure(&self) -> Exposure {
        Exposure {
            listen: self.gateway.listen,
            secured: self.gateway.credentials_file.is_some(),
            allow_no_auth: self.gateway.allow_no_auth,
        }
    }

    fn check_own(&self) -> Result<(), StartError> {
        let g = &self.gateway;
        require_positive(
            ServiceName::Gateway,
            &[
                ("outbound_queue", g.outbound_queue as u64),
                ("max_connections", g.max_connections as u64),
                ("ping_interval_ms", g.ping_interval_ms),
                ("liveness_timeout_ms", g.liveness_timeout_ms),
                ("presence_interval_ms", g.presence_interval_ms),
            ],
        )
    }
}
