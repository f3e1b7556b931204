//! The one start-up sequence of every service binary: load settings, start telemetry, check the
//! settings, connect to NATS and the database (waiting for them, as under docker compose or
//! Kubernetes they may come up later), build, run until SIGINT/SIGTERM.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aip_bus::{NatsBus, SharedBus};
use aip_store::{Database, DatabaseError, PoolOptions};
use anyhow::Context;

use crate::listener::Listening;
use crate::service::{ServiceSettings, StartError};

/// How long start-up waits for the database to accept connections (it may start later than
/// the service under docker compose or Kubernetes).
pub const DATABASE_WAIT: Duration = Duration::from_secs(30);

/// The first pause between connection attempts; it doubles up to [`MAX_RETRY_DELAY`].
const FIRST_RETRY_DELAY: Duration = Duration::from_millis(250);

/// The longest pause between connection attempts: a database that comes up is used within
/// this long.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(4);

/// The shutdown signal a service is given: SIGINT/SIGTERM in the binary, the caller's own
/// future in tests.
pub type Shutdown = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// A service the runner can start: its `Application`.
pub trait Service: Sized + Send + 'static {
    /// What [`run`] loads and checks before connecting to anything.
    type Settings: ServiceSettings;
    /// Why it stops abnormally.
    type RunError: std::error::Error + Send + Sync + 'static;

    /// Builds it on a connected bus and, when its settings name one, an open database:
    /// checks the settings, migrates, subscribes, and opens its listener as `listening` says
    /// (its own for the binary and tests; none embedded in `aip dev`).
    fn build_with(
        settings: Self::Settings,
        bus: SharedBus,
        database: Option<Database>,
        listening: Listening,
    ) -> impl Future<Output = Result<Self, StartError>> + Send;

    /// Serves until `shutdown` completes, then drains.
    fn run_until(
        self,
        shutdown: Shutdown,
    ) -> impl Future<Output = Result<(), Self::RunError>> + Send;
}

/// The database a service that keeps tables needs: [`run`] opens one when the settings name
/// a `database_url`.
pub fn require_database(
    service: crate::service::ServiceName,
    database: Option<Database>,
) -> Result<Database, StartError> {
    database.ok_or_else(|| StartError::invalid(service, "database_url is required"))
}

/// The command line every service binary takes.
#[derive(Debug, clap::Parser)]
#[command(version)]
struct Args {
    /// Configuration file (TOML or JSON); environment variables `AIP_…` override it.
    #[arg(long, short = 'c', env = "AIP_CONFIG")]
    config: Option<std::path::PathBuf>,
}

/// A service binary's `main`: parses the command line (`--config`, `--version`, `--help`
/// with `about`), then [`run`]s service `S`.
pub async fn main<S: Service>(about: &'static str) -> anyhow::Result<()> {
    use clap::{CommandFactory, FromArgMatches};
    let binary = <S::Settings as ServiceSettings>::SERVICE.binary();
    let matches = Args::command().name(binary).about(about).get_matches();
    let args = Args::from_arg_matches(&matches)?;
    run::<S>(args.config.as_deref()).await
}

/// Runs service `S` as a process: settings from `config` (the `--config` file, or none) and
/// the `AIP_…` environment, until SIGINT or SIGTERM.
pub async fn run<S: Service>(config: Option<&Path>) -> anyhow::Result<()> {
    crate::install_crypto_provider();
    let service = <S::Settings as ServiceSettings>::SERVICE;
    let settings: S::Settings = crate::settings::load(config).context("loading settings")?;
    let common = settings.common();
    let telemetry = crate::telemetry::init_with(
        common.log_format,
        "info",
        crate::telemetry::Traces::FromEnvironment,
        service.binary(),
    );
    if telemetry.exporting() {
        tracing::info!("traces are exported over OTLP");
    }
    settings.validate().context("checking settings")?;

    let bus = NatsBus::connect_with(common.nats_url, service.binary(), common.nats).await?;
    tracing::info!(
        nats = %aip_bus::redact_url(common.nats_url),
        "connected to NATS"
    );
    let database = match common.database_url {
        Some(url) => Some(connect_database(url, &settings.pool_options()).await?),
        None => None,
    };
    let app = S::build_with(settings, Arc::new(bus), database.clone(), Listening::Own)
        .await
        .with_context(|| format!("the {service} did not start"))?;
    let result = app.run_until(Box::pin(crate::shutdown::signal())).await;
    if let Some(database) = database {
        database.close().await;
    }
    telemetry.shutdown().await;
    result.with_context(|| format!("the {service} failed"))?;
    tracing::info!("{service} stopped");
    Ok(())
}

/// Opens the database, retrying connection failures until [`DATABASE_WAIT`] is over. Other
/// failures (a bad URL, a missing database) are returned at once.
pub async fn connect_database(url: &str, options: &PoolOptions) -> Result<Database, StartError> {
    let deadline = Instant::now() + DATABASE_WAIT;
    let mut delay = FIRST_RETRY_DELAY;
    loop {
        match Database::connect_with(url, options).await {
            Ok(database) => return Ok(database),
            Err(e @ DatabaseError::Connect { .. }) if Instant::now() + delay < deadline => {
                tracing::warn!("{e}; retrying in {delay:?}");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(MAX_RETRY_DELAY);
            }
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn only_connection_failures_are_retried() {
        let error = connect_database("mysql://db/aip", &PoolOptions::default())
            .await
            .expect_err("unsupported");
        assert!(
            matches!(
                error,
                StartError::Database(DatabaseError::UnsupportedUrl { .. })
            ),
            "{error}"
        );
    }
}
