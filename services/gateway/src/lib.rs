//! # aip-gateway: the WebSocket gateway
//!
//! Terminates AIP WebSockets on `/ws`, pins each connection to the identity it registered,
//! answers heartbeats and device-info requests itself, writes what arrives for each client on
//! the gateway's delivery subject to its socket, and reports presence to the registry in batches. It keeps
//! no task state, so any number of gateways run side by side on one NATS.
//!
//! [`Application::build`] binds the listener (port 0 in tests) and
//! [`Application::run_until`] serves until the given shutdown future completes, then closes
//! every socket with 1001 so clients reconnect elsewhere.

pub mod acks;
pub mod auth;
pub mod blob_reads;
mod client;
pub mod connection;
pub mod deliveries;
pub mod devices;
pub mod events;
mod handlers;
mod identity;
pub mod inbound;
pub mod outbound;
pub mod peers;
pub mod presence;
pub mod rate;
pub mod registrations;
pub mod replies;
pub mod settings;
mod traces;
pub mod upgrade;
mod websocket;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use aip_bus::SharedBus;
use aip_runtime::health::Probes;
use aip_runtime::listener::{ConnectionLimits, Listening, ServiceListener};
use aip_runtime::runner::{self, Shutdown};
use aip_runtime::service::{ServiceName, ServiceSettings};
use aip_store::Database;
use axum::Router;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use proto_schemas::{ErrorBody, ErrorCode, Subjects};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use aip_runtime::StartError;
pub use auth::{Credentials, Principal};
pub use settings::{GatewaySettings, Settings};

/// Shared by every connection.
pub struct AppState {
    /// As loaded: connections read their limits and timeouts here.
    pub settings: Settings,
    /// Names this gateway in presence batches and in the registry's records.
    pub gateway_id: String,
    /// Where frames to and from the other services travel.
    pub bus: SharedBus,
    /// Subjects under the configured prefix.
    pub subjects: Subjects,
    /// Device information on other gateways, and the gateway's start.
    pub registry: aip_bus::registry::RegistryClient,
    /// Registrations and unregistrations, gathered while one request is on its way.
    pub registrations: registrations::Registrations,
    /// The ends of connections, for the session service, gathered while one is on its way.
    pub closings: events::Closings,
    /// Client frames for the session service, gathered while one is on its way.
    pub frames: events::Frames,
    /// Where bodies too large for one bus message go.
    pub blobs: aip_bus::BlobStore,
    /// Reads of large bodies shared by the deliveries that want one at once.
    pub blob_reads: blob_reads::BlobReads,
    /// Where connections queue the acknowledgements of the frames they wrote.
    pub acks: acks::DeliveryAcks,
    /// Who may connect.
    pub credentials: Credentials,
    /// Which web pages may open `/ws`.
    pub origins: aip_runtime::origin::OriginPolicy,
    /// Registered connections, for presence.
    pub presence: Arc<presence::PresenceTable>,
    /// Devices registered on this gateway, for device-info requests.
    pub devices: devices::LocalDevices,
    /// The gateways holding devices on other gateways that constellations here asked about.
    pub holders: devices::Holders,
    /// Device-info requests to other gateways, gathered per gateway.
    pub peers: peers::Peers,
    /// The connections deliveries go to, by client.
    pub routes: Arc<deliveries::Routes>,
    /// True once the registry confirmed that this process started (the previous process's
    /// registrations under the same gateway id are over); registrations wait for it.
    pub announced: tokio::sync::watch::Receiver<bool>,
    announce: tokio::sync::watch::Sender<bool>,
    /// Cancelled when the gateway shuts down.
    pub shutdown: CancellationToken,
    /// Bytes of client frames read and not yet handled, across all connections.
    pub inbound: Arc<inbound::InboundBudget>,
    /// Bytes of frames queued for clients and not yet written, across all connections.
    pub outbound: Arc<outbound::OutboundBudget>,
    /// WebSocket connections (`max_connections`); sockets are counted earlier, at accept.
    connections: Arc<Semaphore>,
    tracker: TaskTracker,
}

/// A gateway, bound and ready to serve.
pub struct Application {
    listener: ServiceListener,
    state: Arc<AppState>,
    /// This gateway's delivery subject, subscribed before it serves.
    deliveries: aip_bus::Subscription,
}

impl Application {
    /// Validates settings, loads credentials and binds the listener.
    pub async fn build(settings: Settings, bus: SharedBus) -> Result<Self, StartError> {
        <Self as runner::Service>::build_with(settings, bus, None, Listening::Own).await
    }

    /// The bound address (useful with port 0); embedded, the configured address.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr()
    }

    /// This gateway's id (configured, or the host name and a random suffix).
    pub fn gateway_id(&self) -> &str {
        &self.state.gateway_id
    }

    /// The router, for embedding the gateway in another server (`aip dev`).
    pub fn router(&self) -> Router {
        router(self.state.clone())
    }

    /// The limits of the gateway's listener, for a server that embeds the gateway (`aip dev`).
    pub fn connection_limits(&self) -> ConnectionLimits {
        self.state.settings.gateway.connection_limits()
    }

    /// The budget of inbound bytes in flight (to watch it: tests, diagnostics).
    pub fn inbound_budget(&self) -> Arc<inbound::InboundBudget> {
        self.state.inbound.clone()
    }

    /// The budget of outbound bytes queued (to watch it: tests, diagnostics).
    pub fn outbound_budget(&self) -> Arc<outbound::OutboundBudget> {
        self.state.outbound.clone()
    }

    /// Serves until `shutdown` completes; then stops accepting, closes every socket with 1001,
    /// sends the last presence batch and waits up to the grace period for connections to end.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let addr = self.local_addr();
        let Application {
            listener,
            state,
            deliveries,
        } = self;
        // Ends with this future, however it ends (a test aborts it as a crash would).
        let _routing = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(deliveries::run(
            state.clone(),
            deliveries,
        )));
        let _gauges = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(outbound::report(
            state.outbound.clone(),
        )));
        tokio::spawn(announce_start(state.clone()));
        let presence = tokio::spawn(presence::run(
            state.bus.clone(),
            state.subjects.clone(),
            state.gateway_id.clone(),
            state.presence.clone(),
            Duration::from_millis(state.settings.gateway.presence_interval_ms),
            state.shutdown.child_token(),
        ));
        tracing::info!(%addr, gateway = %state.gateway_id, "gateway listening");
        let token = state.shutdown.clone();
        let stop = async move {
            shutdown.await;
            token.cancel();
        };
        let served = listener.serve(router(state.clone()), stop).await;
        state.shutdown.cancel();
        state.tracker.close();
        let grace = Duration::from_millis(state.settings.gateway.shutdown_grace_ms);
        if tokio::time::timeout(grace, state.tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                "{} connections still open after the grace period; exiting anyway",
                state.tracker.len()
            );
        }
        let _ = tokio::time::timeout(grace, presence).await;
        let _ = tokio::time::timeout(grace, state.acks.flush()).await;
        if let Err(e) = state.bus.flush().await {
            tracing::warn!("could not flush the bus: {e}");
        }
        served
    }
}

/// Tells the registry that this process started, until it confirms: the registrations a
/// previous process left under the same gateway id end at once, instead of staying live (and
/// refusing their clients' reconnections as duplicates) until the liveness window passes.
/// Registrations wait for the confirmation, so it can never end one of this process's own.
async fn announce_start(state: Arc<AppState>) {
    let mut delay = ANNOUNCE_RETRY_FIRST;
    loop {
        match state.registry.gateway_started(&state.gateway_id).await {
            Ok(ack) => {
                if ack.ended > 0 {
                    tracing::info!(
                        ended = ack.ended,
                        "the registry ended the connections of this gateway's previous process"
                    );
                }
                state.announce.send_replace(true);
                return;
            }
            Err(e) => tracing::warn!(
                "the registry has not confirmed this gateway's start (registrations wait), retrying in {delay:?}: {e}"
            ),
        }
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = state.shutdown.cancelled() => return,
        }
        delay = (delay * 2).min(ANNOUNCE_RETRY_MAX);
    }
}

/// Backoff of [`announce_start`].
const ANNOUNCE_RETRY_FIRST: Duration = Duration::from_millis(100);
const ANNOUNCE_RETRY_MAX: Duration = Duration::from_secs(2);

fn default_gateway_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "gateway".to_owned());
    format!("{host}-{}", &uuid::Uuid::new_v4().simple().to_string()[..8])
}

impl runner::Service for Application {
    type Settings = Settings;
    type RunError = std::io::Error;

    async fn build_with(
        settings: Settings,
        bus: SharedBus,
        _database: Option<Database>,
        listening: Listening,
    ) -> Result<Self, StartError> {
        aip_runtime::metrics::install();
        let subjects = settings.validate()?;
        let credentials = match &settings.gateway.credentials_file {
            Some(path) => Credentials::load(path)
                .map_err(|e| StartError::invalid(ServiceName::Gateway, e.to_string()))?,
            None => Credentials::disabled(),
        };
        let blobs = aip_bus::BlobStore::for_subjects(&subjects);
        if let Err(e) = bus
            .ensure_stream(blobs.stream_spec(settings.nats.nats_blobs_max_bytes))
            .await
        {
            tracing::warn!(
                "cannot create the blob stream (frames over the bus limit will fail): {e}"
            );
        }
        let listener =
            ServiceListener::open(ServiceName::Gateway, settings.gateway.listen, listening)
                .await?
                .with_limits(settings.gateway.connection_limits());
        let gateway_id = settings
            .gateway
            .gateway_id
            .clone()
            .unwrap_or_else(default_gateway_id);
        let registry = aip_bus::registry::RegistryClient::new(
            bus.clone(),
            subjects.clone(),
            std::time::Duration::from_millis(settings.gateway.request_timeout_ms),
        );
        let deliveries = deliveries::subscribe(&bus, &subjects, &gateway_id).await?;
        let (announce, announced) = tokio::sync::watch::channel(false);
        let origins = aip_runtime::origin::OriginPolicy::new(
            &settings.gateway.allowed_origins,
            settings.gateway.listen,
        );
        let peers = peers::Peers::new(
            bus.clone(),
            subjects.clone(),
            std::time::Duration::from_millis(settings.gateway.request_timeout_ms),
        );
        let registrations = registrations::Registrations::start(registry.clone());
        let closings = events::Closings::start(
            bus.clone(),
            aip_bus::BlobStore::for_subjects(&subjects),
            subjects.clone(),
        );
        let frames = events::Frames::start(
            bus.clone(),
            aip_bus::BlobStore::for_subjects(&subjects),
            subjects.clone(),
        );
        let state = Arc::new(AppState {
            origins,
            registry,
            registrations,
            closings,
            frames,
            announce,
            announced,
            connections: Arc::new(Semaphore::new(settings.gateway.max_connections)),
            inbound: inbound::InboundBudget::new(settings.gateway.max_inbound_bytes_in_flight),
            outbound: outbound::OutboundBudget::new(settings.gateway.max_outbound_bytes_queued),
            settings,
            gateway_id,
            blobs: aip_bus::BlobStore::for_subjects(&subjects),
            blob_reads: blob_reads::BlobReads::default(),
            acks: acks::DeliveryAcks::start(bus.clone()),
            peers,
            bus,
            subjects,
            credentials,
            presence: Arc::new(presence::PresenceTable::default()),
            devices: devices::LocalDevices::default(),
            holders: devices::Holders::default(),
            routes: Arc::new(deliveries::Routes::default()),
            shutdown: CancellationToken::new(),
            tracker: TaskTracker::new(),
        });
        Ok(Application {
            listener,
            state,
            deliveries,
        })
    }

    async fn run_until(self, shutdown: Shutdown) -> std::io::Result<()> {
        Application::run_until(self, shutdown).await
    }
}

/// `/ws`, and the probes: ready while the bus answers and the gateway is not shutting down.
fn router(state: Arc<AppState>) -> Router {
    let probes = Probes::new()
        .bus(state.bus.clone())
        .stopping(state.shutdown.clone());
    Router::new()
        .route("/ws", get(websocket))
        .with_state(state)
        .merge(probes.routes())
}

fn refuse(status: StatusCode, code: ErrorCode, detail: impl Into<String>) -> Response {
    (status, axum::Json(ErrorBody::new(code, detail))).into_response()
}

/// The handshake: authenticate, admit within the connection limit, upgrade.
async fn websocket(
    State(state): State<Arc<AppState>>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    upgrade: upgrade::Upgrade,
) -> Response {
    if state.shutdown.is_cancelled() {
        return refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::Unavailable,
            "gateway shutting down; connect to another",
        );
    }
    if let Err(refusal) = state.origins.check(&headers) {
        return refuse(
            StatusCode::FORBIDDEN,
            ErrorCode::Forbidden,
            refusal.to_string(),
        );
    }
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let token = query.get("token").map(String::as_str).or(bearer);
    let Some(principal) = state.credentials.authenticate(token) else {
        let detail = if token.is_some() {
            "invalid token"
        } else {
            "a token is required: ws://HOST/ws?token=KEY or Authorization: Bearer KEY"
        };
        return refuse(StatusCode::FORBIDDEN, ErrorCode::Unauthorized, detail);
    };
    let Ok(permit) = state.connections.clone().try_acquire_owned() else {
        return refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::Unavailable,
            format!(
                "connection limit of {} reached; try another gateway",
                state.settings.gateway.max_connections
            ),
        );
    };
    let tracker = state.tracker.clone();
    upgrade.accept(move |socket| {
        tracker.track_future(connection::serve(socket, state, principal, permit))
    })
}
