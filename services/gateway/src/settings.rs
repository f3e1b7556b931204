//! Gateway configuration.

use std::net::SocketAddr;
use std::path::PathBuf;

use aip_runtime::listener::ConnectionLimits;
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
    /// Threads that run the service's work (`AIP_WORKER_THREADS`); unset: one per CPU the
    /// process may use. See [`aip_runtime::runner`] for when fewer are faster.
    pub worker_threads: Option<usize>,
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
    /// Sustained bytes per second read from one connection (0: no limit). A client that sends
    /// faster is not refused: the gateway stops reading its socket until it is back under the
    /// rate (TCP then slows the client down). Bursts of two seconds' worth are read at full
    /// speed, and a frame of any size up to `max_frame_bytes` is always read whole; its
    /// excess is paid afterwards by a pause.
    pub bytes_per_second: u64,
    /// Most simultaneous WebSocket connections; more are refused at the handshake with 503.
    /// Sockets are also counted before anything is read from them, authenticated or not: at
    /// most this many plus [`ACCEPT_HEADROOM`] are open at once, and a socket over that is
    /// closed at once (the headroom keeps health probes and the 503 answers working on a full
    /// gateway).
    pub max_connections: usize,
    /// Most sockets open at once from one client address (an IPv6 /64 counts as one), counted
    /// when a socket is accepted, before authentication; more are closed at once (0: no
    /// limit). Behind a proxy or load balancer that hides client addresses every connection
    /// comes from the proxy: raise it above the connections the proxy carries, or set 0.
    pub max_connections_per_address: usize,
    /// Bytes of client frames read but not yet handled (published to the bus and stored, or
    /// answered) across all connections. A connection whose frame does not fit waits, reading
    /// nothing more, until earlier frames are through; a frame larger than the whole budget
    /// waits until it is alone.
    pub max_inbound_bytes_in_flight: usize,
    /// Frames waiting to be written to one client; a client that lets more pile up is
    /// disconnected (close code 1008) instead of growing memory.
    pub outbound_queue: usize,
    /// Bytes of frames waiting to be written to one client; a client that lets more pile up
    /// is disconnected (close code 1008), as for `outbound_queue`. A frame larger than this
    /// is still written when nothing else waits for its client.
    pub outbound_queue_bytes: usize,
    /// Bytes of frames waiting to be written to all clients together: past it, a client that
    /// has frames waiting and is sent another is disconnected (1008), as for its own
    /// `outbound_queue_bytes`. A frame for a client with nothing waiting always goes.
    pub max_outbound_bytes_queued: usize,
    /// Timeout of requests to other services (registry).
    pub request_timeout_ms: u64,
    /// On SIGTERM, how long to wait for connections to close before exiting.
    pub shutdown_grace_ms: u64,
}

/// Sockets the gateway accepts beyond `max_connections`, so that a full gateway still answers
/// health probes and tells WebSocket clients it is full (503) instead of closing them unread.
pub const ACCEPT_HEADROOM: usize = 64;

/// The smallest `max_inbound_bytes_in_flight`: less would hold up ordinary result frames
/// (screenshots, logs) of different clients behind each other.
pub const MIN_INBOUND_BYTES_IN_FLIGHT: usize = 1024 * 1024;

/// The smallest `bytes_per_second` other than 0: below it, one ordinary frame of a few
/// hundred KiB would stop its connection's reading for seconds.
pub const MIN_BYTES_PER_SECOND: u64 = 64 * 1024;

const MIB: u64 = 1024 * 1024;

impl GatewaySettings {
    /// The limits of the gateway's listener (or of `aip dev`'s, which embeds the gateway),
    /// checked when a socket is accepted.
    pub fn connection_limits(&self) -> ConnectionLimits {
        ConnectionLimits {
            total: self.max_connections.saturating_add(ACCEPT_HEADROOM),
            per_address: self.max_connections_per_address,
        }
    }
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            nats_url: DEFAULT_NATS_URL.to_owned(),
            nats: aip_bus::NatsSettings::default(),
            subject_prefix: proto_schemas::subjects::DEFAULT_PREFIX.to_owned(),
            log_format: LogFormat::Pretty,
            worker_threads: None,
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
            bytes_per_second: 16 * MIB,
            max_connections: 50_000,
            max_connections_per_address: 20_000,
            max_inbound_bytes_in_flight: 256 * MIB as usize,
            outbound_queue: 256,
            outbound_queue_bytes: 256 * MIB as usize,
            max_outbound_bytes_queued: 512 * MIB as usize,
            request_timeout_ms: 5_000,
            shutdown_grace_ms: 10_000,
        }
    }
}

impl ServiceSettings for Settings {
    const SERVICE: ServiceName = ServiceName::Gateway;
    const GUARD: Guard = Guard::Credentials;
    const VARIABLES: &'static [(&'static str, &'static str)] = &[(
        "HOSTNAME",
        "the start of the default gateway_id (a container's or pod's name)",
    )];

    fn common(&self) -> Common<'_> {
        Common {
            nats_url: &self.nats_url,
            nats: &self.nats,
            database_url: None,
            subject_prefix: &self.subject_prefix,
            log_format: self.log_format,
            worker_threads: self.worker_threads,
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
                ("outbound_queue_bytes", g.outbound_queue_bytes as u64),
                (
                    "max_outbound_bytes_queued",
                    g.max_outbound_bytes_queued as u64,
                ),
                ("max_connections", g.max_connections as u64),
                ("ping_interval_ms", g.ping_interval_ms),
                ("liveness_timeout_ms", g.liveness_timeout_ms),
                ("presence_interval_ms", g.presence_interval_ms),
            ],
        )?;
        if g.max_inbound_bytes_in_flight < MIN_INBOUND_BYTES_IN_FLIGHT {
            return Err(StartError::invalid(
                ServiceName::Gateway,
                format!(
                    "max_inbound_bytes_in_flight must be at least {MIN_INBOUND_BYTES_IN_FLIGHT} (1 MiB), got {}",
                    g.max_inbound_bytes_in_flight
                ),
            ));
        }
        if g.max_frame_bytes > proto_schemas::MAX_FRAME_BYTES {
            return Err(StartError::invalid(
                ServiceName::Gateway,
                format!(
                    "max_frame_bytes must be at most {} (100 MiB, UFO's limit): larger frames \
                     would not fit the session service's blob bound; got {}",
                    proto_schemas::MAX_FRAME_BYTES,
                    g.max_frame_bytes
                ),
            ));
        }
        // The credentials are read again when the gateway builds; reading them here makes
        // `aip-gateway --check` refuse a file that would stop it at start.
        if let Some(path) = &g.credentials_file {
            crate::auth::Credentials::load(path)
                .map_err(|e| StartError::invalid(ServiceName::Gateway, e.to_string()))?;
        }
        if g.bytes_per_second != 0 && g.bytes_per_second < MIN_BYTES_PER_SECOND {
            return Err(StartError::invalid(
                ServiceName::Gateway,
                format!(
                    "bytes_per_second must be 0 (no limit) or at least {MIN_BYTES_PER_SECOND} (64 KiB), got {}",
                    g.bytes_per_second
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(change: impl FnOnce(&mut GatewaySettings)) -> String {
        let mut s = Settings::default();
        change(&mut s.gateway);
        s.validate().expect_err("refused").to_string()
    }

    #[test]
    fn a_credentials_file_that_cannot_be_read_is_refused_by_the_check() {
        let err = refused(|g| {
            g.credentials_file = Some(PathBuf::from("/nonexistent/aip-credentials.toml"));
        });
        assert!(err.contains("aip-credentials.toml"), "{err}");
    }

    #[test]
    fn defaults_are_valid() {
        Settings::default().validate().expect("defaults validate");
    }

    #[test]
    fn the_inbound_budget_must_hold_a_mebibyte() {
        let err = refused(|g| g.max_inbound_bytes_in_flight = 0);
        assert!(
            err.contains("max_inbound_bytes_in_flight must be at least"),
            "{err}"
        );
        let err = refused(|g| g.max_inbound_bytes_in_flight = 1024 * 1024 - 1);
        assert!(err.contains("max_inbound_bytes_in_flight"), "{err}");
        let mut s = Settings::default();
        s.gateway.max_inbound_bytes_in_flight = 1024 * 1024;
        s.validate().expect("1 MiB is enough");
    }

    #[test]
    fn the_byte_rate_is_off_or_at_least_64_kib() {
        let err = refused(|g| g.bytes_per_second = 1);
        assert!(
            err.contains("bytes_per_second must be 0 (no limit) or at least"),
            "{err}"
        );
        let mut s = Settings::default();
        s.gateway.bytes_per_second = 0;
        s.validate().expect("0 is no limit");
        s.gateway.bytes_per_second = 64 * 1024;
        s.validate().expect("64 KiB/s");
    }

    #[test]
    fn the_listener_admits_the_headroom_beyond_max_connections() {
        let g = GatewaySettings {
            max_connections: 2,
            max_connections_per_address: 1,
            ..GatewaySettings::default()
        };
        assert_eq!(
            g.connection_limits(),
            ConnectionLimits {
                total: 2 + ACCEPT_HEADROOM,
                per_address: 1
            }
        );
    }

    #[test]
    fn new_limits_come_from_the_environment() {
        let environment = [
            ("AIP_GATEWAY__BYTES_PER_SECOND", "1048576"),
            ("AIP_GATEWAY__MAX_CONNECTIONS_PER_ADDRESS", "0"),
            ("AIP_GATEWAY__MAX_INBOUND_BYTES_IN_FLIGHT", "33554432"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        let loaded: Result<Settings, _> =
            aip_runtime::settings::load_from(None, environment.into());
        let s = loaded.expect("loads");
        assert_eq!(s.gateway.bytes_per_second, 1024 * 1024);
        assert_eq!(s.gateway.max_connections_per_address, 0);
        assert_eq!(s.gateway.max_inbound_bytes_in_flight, 32 * 1024 * 1024);
        s.validate().expect("valid");
    }
}
