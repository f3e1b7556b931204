//! Building and running the registry: [`Application`].
//!
//! [`Application::build`] does everything that can fail at start (validates settings,
//! migrates the database, subscribes to the bus, binds the HTTP listener) and returns; requests
//! sent after it returns are not lost. [`Application::run_until_stopped`] serves until the
//! caller's shutdown future completes, then drains within the grace period: it stops taking
//! requests, finishes those in flight, writes pending presence and stops the HTTP server.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use aip_bus::SharedBus;
use aip_runtime::api_keys::ApiKeys;
use aip_runtime::health::Probes;
use aip_runtime::listener::{Listening, ServiceListener};
use aip_runtime::origin::OriginPolicy;
use aip_runtime::runner::{self, Shutdown};
use aip_runtime::service::{ServiceName, ServiceSettings, StartError};
use aip_store::Database;
use proto_schemas::Subjects;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::bus_api::{QUEUE_GROUP, RequestSubscriptions};
use crate::http::{self, AppState};
use crate::notices::Notices;
use crate::presence::{self, PresenceBuffer};
use crate::reaper;
use crate::registry::Registry;
use crate::settings::{RegistrySettings, Settings};
use crate::store::{self, AgentStore, Windows};

/// Why the registry stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The HTTP server failed.
    #[error("the HTTP server failed: {0}")]
    Http(#[source] std::io::Error),
}

/// A built registry, ready to run.
pub struct Application {
    settings: RegistrySettings,
    listener: ServiceListener,
    bus: SharedBus,
    /// The reaper publishes the ends of expired connections on the frames subjects.
    subjects: Subjects,
    store: Arc<dyn AgentStore>,
    probes: Probes,
    requests: RequestSubscriptions,
    presence: aip_bus::Subscription,
}

impl Application {
    /// Validates `settings`, migrates `db`, subscribes on `bus` and binds the HTTP listener.
    /// The binary passes a NATS bus and PostgreSQL; `aip dev` an in-process bus and SQLite.
    pub async fn build(
        settings: Settings,
        bus: SharedBus,
        db: Database,
    ) -> Result<Self, StartError> {
        <Self as runner::Service>::build_with(settings, bus, Some(db), Listening::Own).await
    }

    /// Where the REST API listens (useful with port 0); embedded, the configured address.
    pub fn http_addr(&self) -> SocketAddr {
        self.listener.local_addr()
    }

    /// The REST router (`/api/agents`, `/api/clients`, `/api/health`, `/healthz`, `/readyz`)
    /// over this registry's store, for embedding in another server (`aip dev` serves it on
    /// its one listener).
    pub fn router(&self) -> axum::Router {
        router(&self.settings, self.store.clone(), self.probes.clone())
    }

    /// The liveness windows in force.
    pub fn windows(&self) -> Windows {
        windows(&self.settings)
    }

    /// Serves until `shutdown` completes, then drains within `shutdown_grace_ms`.
    pub async fn run_until_stopped(
        self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), RunError> {
        let Application {
            settings,
            listener,
            bus,
            subjects,
            store,
            probes,
            requests,
            presence,
        } = self;
        let windows = windows(&settings);
        let stop = CancellationToken::new();
        let notices = Notices {
            bus: bus.clone(),
            subjects: subjects.clone(),
        };
        let registry = Registry::new(store.clone(), windows, notices.clone());
        let limiter = Arc::new(Semaphore::new(settings.max_in_flight));

        // Cancelled only when the grace period is over: requests still running are dropped.
        let abandon = CancellationToken::new();
        let requests_task = tokio::spawn(requests.serve(
            registry,
            bus.clone(),
            limiter.clone(),
            stop.child_token(),
            abandon.clone(),
        ));
        let buffer = Arc::new(PresenceBuffer::default());
        let listen_task = tokio::spawn(presence::listen(
            presence,
            buffer.clone(),
            stop.child_token(),
        ));
        // The flusher stops only after the listener, so its last flush holds every batch taken.
        let flush_stop = CancellationToken::new();
        let flush_task = tokio::spawn(presence::flush_periodically(
            buffer.clone(),
            store.clone(),
            settings.presence_flush(),
            flush_stop.clone(),
        ));
        let reaper_task = tokio::spawn(reaper::run(
            store.clone(),
            buffer,
            notices,
            windows,
            reaper::Schedule {
                interval: settings.reap_interval(),
                grace: settings.liveness(),
                forget_offline_after: settings.forget_offline_after(),
            },
            stop.child_token(),
        ));
        let app = router(&settings, store, probes);
        let http_stop = stop.child_token();
        let mut http_task = tokio::spawn(listener.serve(app, http_stop.cancelled_owned()));

        let http_failed = tokio::select! {
            () = shutdown => None,
            result = &mut http_task => Some(result),
        };
        tracing::info!("registry stopping: draining");
        stop.cancel();

        let grace = settings.shutdown_grace();
        let permits = u32::try_from(settings.max_in_flight).unwrap_or(u32::MAX);
        let background = [
            requests_task.abort_handle(),
            listen_task.abort_handle(),
            flush_task.abort_handle(),
            reaper_task.abort_handle(),
        ];
        let drain = async {
            let _ = requests_task.await;
            let _ = listen_task.await;
            flush_stop.cancel();
            // Every permit back: no request in flight.
            let _ = limiter.acquire_many(permits).await;
            let _ = flush_task.await;
            let _ = reaper_task.await;
            let _ = bus.flush().await;
        };
        if tokio::time::timeout(grace, drain).await.is_err() {
            tracing::warn!(
                ?grace,
                "grace period over: abandoning what is still in flight"
            );
            abandon.cancel();
            background.iter().for_each(tokio::task::AbortHandle::abort);
        }
        let http_result = match http_failed {
            Some(result) => result,
            None => match tokio::time::timeout(Duration::from_secs(1).min(grace), &mut http_task)
                .await
            {
                Ok(result) => result,
                Err(_) => {
                    http_task.abort();
                    Ok(Ok(()))
                }
            },
        };
        match http_result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(RunError::Http(e)),
            Err(join) => Err(RunError::Http(std::io::Error::other(join))),
        }
    }
}

impl runner::Service for Application {
    type Settings = Settings;
    type RunError = RunError;

    async fn build_with(
        settings: Settings,
        bus: SharedBus,
        database: Option<Database>,
        listening: Listening,
    ) -> Result<Self, StartError> {
        aip_runtime::metrics::install();
        let db = runner::require_database(ServiceName::Registry, database)?;
        let subjects = settings.validate()?;
        let Settings {
            registry: settings, ..
        } = settings;
        db.migrate().await?;
        let store = store::for_database(&db);
        let requests = RequestSubscriptions::subscribe(&*bus, &subjects).await?;
        let presence = bus
            .queue_subscribe(subjects.presence_all(), QUEUE_GROUP.to_owned())
            .await?;
        let listener =
            ServiceListener::open(ServiceName::Registry, settings.listen, listening).await?;
        let http_addr = listener.local_addr();
        if settings.api_keys.is_empty() {
            tracing::warn!(%http_addr, "no API keys configured: /api/* is open (loopback or allow_no_auth)");
        }
        tracing::info!(
            %http_addr,
            embedded = !listener.is_bound(),
            prefix = %subjects.prefix(),
            database = %db.backend(),
            liveness_ms = settings.liveness_ms,
            "registry ready"
        );
        let probes = Probes::new().bus(bus.clone()).database(db);
        Ok(Application {
            settings,
            listener,
            bus,
            subjects,
            store,
            probes,
            requests,
            presence,
        })
    }

    async fn run_until(self, shutdown: Shutdown) -> Result<(), RunError> {
        self.run_until_stopped(shutdown).await
    }
}

/// The REST routes and the probes.
fn router(settings: &RegistrySettings, store: Arc<dyn AgentStore>, probes: Probes) -> axum::Router {
    let origins = OriginPolicy::new(&settings.allowed_origins, settings.listen);
    http::router(AppState { store }, ApiKeys::new(&settings.api_keys))
        .merge(probes.routes())
        .layer(axum::middleware::from_fn_with_state(
            std::sync::Arc::new(origins),
            aip_runtime::origin::guard,
        ))
}

fn windows(settings: &RegistrySettings) -> Windows {
    Windows {
        gateway: settings.liveness(),
        agent: settings.agent_liveness(),
    }
}
