//! `aip-registry`: the agent registry service (NATS + PostgreSQL).
//!
//! Parses arguments, loads settings, initialises telemetry, connects to NATS and the
//! database, then runs until SIGINT/SIGTERM and drains within the grace period.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aip_bus::NatsBus;
use aip_registry::{Application, Settings};
use aip_store::{Database, PoolOptions};
use anyhow::Context;
use clap::Parser;

/// The agent registry of the aip broker.
#[derive(Debug, Parser)]
#[command(name = "aip-registry", version, about)]
struct Args {
    /// Configuration file (TOML or JSON); environment variables `AIP_…` override it.
    #[arg(long, short = 'c', env = "AIP_CONFIG")]
    config: Option<PathBuf>,
}

/// How long start-up waits for the database to accept connections (it may start later than
/// this service under docker compose or Kubernetes).
const DATABASE_WAIT: Duration = Duration::from_secs(30);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    aip_runtime::install_crypto_provider();
    let args = Args::parse();
    let settings: Settings =
        aip_runtime::settings::load(args.config.as_deref()).context("loading settings")?;
    aip_runtime::telemetry::init(settings.log_format, "info");
    settings.registry.validate().context("checking settings")?;

    let bus = NatsBus::connect(&settings.nats_url, "aip-registry").await?;
    let db = connect_database(&settings).await?;
    let app = Application::build(settings, Arc::new(bus), db.clone()).await?;
    let result = app.run_until_stopped(aip_runtime::shutdown::signal()).await;
    db.close().await;
    result?;
    Ok(())
}

/// Connects to the database, retrying connection failures until [`DATABASE_WAIT`] is over.
async fn connect_database(settings: &Settings) -> anyhow::Result<Database> {
    let options = PoolOptions {
        max_connections: settings.registry.db_max_connections,
        ..PoolOptions::default()
    };
    let deadline = Instant::now() + DATABASE_WAIT;
    let mut delay = Duration::from_millis(250);
    loop {
        match Database::connect_with(&settings.database_url, &options).await {
            Ok(db) => return Ok(db),
            Err(e @ aip_store::DatabaseError::Connect { .. })
                if Instant::now() + delay < deadline =>
            {
                tracing::warn!("{e}; retrying in {delay:?}");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(4));
            }
            Err(e) => return Err(e.into()),
        }
    }
}
