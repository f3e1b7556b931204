//! # aip-sessions: durable tasks
//!
//! The heart of the broker. It takes task requests from every transport (a constellation's
//! TASK frame through the gateways, REST `POST /api/tasks`, UFO's `POST /api/dispatch`, NATS
//! `sessions.submit`), resolves the executor (explicit target, or a capability lookup in the
//! registry), runs each task as a state machine persisted in the database with a gap-free
//! event log ([`engine`]), routes commands to the executor and results back, and serves
//! everything over REST ([`http`]).
//!
//! Frames from gateways arrive through a JetStream stream with a durable consumer and explicit
//! acks; applying one is idempotent, so a redelivered frame changes nothing twice, and several
//! replicas can share the consumer. Frames to clients are written to an outbox in the same
//! transaction as the state change and published after commit; each stays there until the
//! gateway that wrote it to the client's socket acknowledges it ([`workers`] sends again what
//! nobody acknowledged, from a NATS restart or a crash).

pub mod apart;
pub mod batches;
pub mod callbacks;
pub mod engine;
pub mod http;
pub mod known;
pub mod machine;
pub mod outbox;
pub mod planners;
pub mod routes;
pub mod settings;
pub mod settling;
pub mod store;
pub mod targets;
pub mod task;
pub mod tombstones;
pub mod watch;
pub mod workers;

use std::net::SocketAddr;
use std::time::Duration;

use aip_bus::SharedBus;
use aip_runtime::api_keys::ApiKeys;
use aip_runtime::listener::{Listening, ServiceListener};
use aip_runtime::origin::OriginPolicy;
use aip_runtime::runner::{self, Shutdown};
use aip_runtime::service::{ServiceName, ServiceSettings};
use aip_store::Database;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use aip_runtime::StartError;
pub use engine::Engine;
pub use settings::{SessionSettings, Settings};

/// A session service, bound and ready.
pub struct Application {
    listener: ServiceListener,
    engine: Engine,
    settings: Settings,
    /// The keys accepted on `/api/*`, with the callers they name.
    keys: ApiKeys,
    applier: engine::Applier,
    /// This replica's delivery acknowledgements, subscribed before anything is published.
    acks: aip_bus::Subscription,
}

impl Application {
    /// Migrates the database, creates the frames stream and binds the REST listener.
    pub async fn build(
        settings: Settings,
        bus: SharedBus,
        db: Database,
    ) -> Result<Self, StartError> {
        <Self as runner::Service>::build_with(settings, bus, Some(db), Listening::Own).await
    }

    /// The bound address; embedded, the configured address.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr()
    }

    /// The engine (for embedding).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The REST router (for embedding in `aip dev`).
    pub fn router(&self) -> axum::Router {
        let s = &self.settings.sessions;
        http::router(
            self.engine.clone(),
            self.keys.clone(),
            OriginPolicy::new(&s.allowed_origins, s.listen),
        )
    }

    /// Serves until `shutdown` completes, then stops taking frames and lets work in progress
    /// finish within the grace period. Unacked frames are redelivered to another replica.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let addr = self.local_addr();
        let stop = CancellationToken::new();
        let tracker = TaskTracker::new();
        let s = &self.settings.sessions;
        let engine = self.engine.clone();
        let max_in_flight = s.max_in_flight;
        let leader_tracker = tracker.clone();
        let leader_engine = engine.clone();
        let on_lead = move |term: CancellationToken| {
            tokio::spawn(workers::consume_frames(
                leader_engine.clone(),
                max_in_flight,
                term.clone(),
                leader_tracker.clone(),
            ));
            tokio::spawn(workers::run_outbox_sweeper(
                leader_engine.clone(),
                term.clone(),
            ));
            tokio::spawn(workers::run_frames_trimmer(
                leader_engine.clone(),
                term.clone(),
            ));
            tokio::spawn(callbacks::run_callbacks(
                leader_engine.clone(),
                term.clone(),
            ));
            tokio::spawn(workers::serve_requests(
                leader_engine.clone(),
                term,
                leader_tracker.clone(),
            ));
        };
        tokio::spawn(workers::run_ack_listener(
            engine.clone(),
            self.acks,
            stop.clone(),
        ));
        let applier = tokio::spawn(engine::run_applier(
            engine.clone(),
            self.applier,
            stop.clone(),
            on_lead,
        ));
        tracing::info!(%addr, "session service listening");
        let app = http::router(
            engine,
            self.keys.clone(),
            OriginPolicy::new(&s.allowed_origins, s.listen),
        );
        let token = stop.clone();
        let served = self
            .listener
            .serve(app, async move {
                shutdown.await;
                token.cancel();
            })
            .await;
        stop.cancel();
        tracker.close();
        let grace = Duration::from_millis(s.shutdown_grace_ms);
        if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
            tracing::warn!(
                "work still in progress after the grace period; its frames will be redelivered"
            );
        }
        if tokio::time::timeout(grace, applier).await.is_err() {
            tracing::warn!("the applier did not stop within the grace period");
        }
        served
    }
}

impl runner::Service for Application {
    type Settings = Settings;
    type RunError = std::io::Error;

    async fn build_with(
        settings: Settings,
        bus: SharedBus,
        database: Option<Database>,
        listening: Listening,
    ) -> Result<Self, StartError> {
        aip_runtime::metrics::install();
        let db = runner::require_database(ServiceName::Sessions, database)?;
        let subjects = settings.validate()?;
        let keys = settings.sessions.api_keys()?;
        db.migrate().await?;
        let store = store::TaskStore::new(db);
        let planners =
            planners::Planners::new(&settings.sessions, &|name| std::env::var(name).ok())
                .map_err(|e| StartError::invalid(ServiceName::Sessions, e))?;
        tracing::info!(default = %planners.default_planner(), "planner for tasks without steps");
        let callbacks = callbacks::Callbacks::new(&settings.sessions)
            .map_err(|e| StartError::invalid(ServiceName::Sessions, e))?;
        if !callbacks.signed() {
            tracing::warn!(
                "callbacks go unsigned: set AIP_SESSIONS__CALLBACK_SECRET (whsec_…) to sign them"
            );
        }
        let (engine, applier) = Engine::new(
            store,
            bus,
            subjects,
            settings.sessions.clone(),
            planners,
            callbacks,
        );
        workers::ensure_frames_stream(&engine, &settings.nats).await?;
        let acks = engine.bus().subscribe(engine.ack_subject()).await?;
        let listener =
            ServiceListener::open(ServiceName::Sessions, settings.sessions.listen, listening)
                .await?;
        Ok(Application {
            listener,
            engine,
            settings,
            keys,
            applier,
            acks,
        })
    }

    async fn run_until(self, shutdown: Shutdown) -> std::io::Result<()> {
        Application::run_until(self, shutdown).await
    }
}
