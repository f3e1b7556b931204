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

use aip_bus::{BusError, SharedBus};
use aip_store::{Database, DatabaseError};
use proto_schemas::Subjects;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::bus_api::{QUEUE_GROUP, RequestSubscriptions};
use crate::http::{self, AppState};
use crate::presence::{self, PresenceBuffer};
use crate::reaper;
use crate::registry::Registry;
use crate::settings::{RegistrySettings, Settings, SettingsError};
use crate::store::{self, AgentStore, Windows};
use aip_runtime::api_keys::ApiKeys;

/// Why the registry could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The settings cannot work.
    #[error(transparent)]
    Settings(#[from] SettingsError),
    /// The database could not be migrated.
    #[error(transparent)]
    Database(#[from] DatabaseError),
    /// A subscription failed.
    #[error("cannot subscribe to the registry's subjects: {0}")]
    Bus(#[from] BusError),
    /// The HTTP address could not be bound.
    #[error(
        "cannot listen on {addr}: {source}; is another process using the port? (set registry.listen)"
    )]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
}

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
    listener: TcpListener,
    http_addr: SocketAddr,
    bus: SharedBus,
    /// The reaper publishes the ends of expired connections on the frames subjects.
    subjects: Subjects,
    store: Arc<dyn AgentStore>,
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
        let Settings {
            subject_prefix,
            registry: settings,
            ..
        } = settings;
        settings.validate()?;
        let subjects = Subjects::new(&subject_prefix).map_err(SettingsError::from)?;
        db.migrate().await?;
        let store = store::for_database(&db);
        let requests = RequestSubscriptions::subscribe(&*bus, &subjects).await?;
        let presence = bus
            .queue_subscribe(subjects.presence_all(), QUEUE_GROUP.to_owned())
            .await?;
        let listener =
            TcpListener::bind(settings.listen)
                .await
                .map_err(|source| StartError::Bind {
                    addr: settings.listen,
                    source,
                })?;
        let http_addr = listener.local_addr().map_err(|source| StartError::Bind {
            addr: settings.listen,
            source,
        })?;
        if settings.api_keys.is_empty() {
            tracing::warn!(%http_addr, "no API keys configured: /api/* is open (loopback or allow_no_auth)");
        }
        tracing::info!(
            %http_addr,
            prefix = %subjects.prefix(),
            database = %db.backend(),
            liveness_ms = settings.liveness_ms,
            "registry ready"
        );
        Ok(Application {
            settings,
            listener,
            http_addr,
            bus,
            subjects,
            store,
            requests,
            presence,
        })
    }

    /// Where the REST API listens (useful with port 0).
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// The REST router (`/api/agents`, `/api/clients`, `/api/health`, `/healthz`, `/readyz`)
    /// over this registry's store, for embedding in another server (`aip dev` serves it on
    /// its one listener). The registry's own listener keeps serving the same routes.
    pub fn router(&self) -> axum::Router {
        http::router(
            AppState {
                store: self.store.clone(),
            },
            ApiKeys::new(&self.settings.api_keys),
        )
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
            requests,
            presence,
            ..
        } = self;
        let windows = windows(&settings);
        let stop = CancellationToken::new();
        let registry = Registry::new(store.clone(), windows);
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
            buffer,
            store.clone(),
            settings.presence_flush(),
            flush_stop.clone(),
        ));
        let notices = reaper::Notices {
            bus: bus.clone(),
            subjects: subjects.clone(),
        };
        let reaper_task = tokio::spawn(reaper::run(
            store.clone(),
            notices,
            windows,
            settings.reap_interval(),
            settings.liveness(),
            stop.child_token(),
        ));
        let app = http::router(AppState { store }, ApiKeys::new(&settings.api_keys));
        let http_stop = stop.child_token();
        let mut http_task = tokio::spawn(async move {
            axum::serve(aip_runtime::nodelay(listener), app)
                .with_graceful_shutdown(http_stop.cancelled_owned())
                .await
        });

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
        tracing::info!("registry stopped");
        match http_result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(RunError::Http(e)),
            Err(join) => Err(RunError::Http(std::io::Error::other(join))),
        }
    }
}

fn windows(settings: &RegistrySettings) -> Windows {
    Windows {
        gateway: settings.liveness(),
        agent: settings.agent_liveness(),
    }
}
