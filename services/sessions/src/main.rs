//! `aip-sessions`: the session service as a process.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;

/// AIP session service: durable tasks, command routing, results over REST.
#[derive(Debug, Parser)]
#[command(name = "aip-sessions", version)]
struct Args {
    /// Configuration file (TOML or JSON); environment variables AIP_… override it.
    #[arg(long, env = "AIP_CONFIG")]
    config: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    aip_runtime::install_crypto_provider();
    let args = Args::parse();
    let settings: aip_sessions::Settings = aip_runtime::settings::load(args.config.as_deref())?;
    aip_runtime::telemetry::init(settings.log_format, "info");
    let bus = aip_bus::NatsBus::connect(&settings.nats_url, "aip-sessions").await?;
    let db = aip_store::Database::connect(&settings.database_url).await?;
    let app = aip_sessions::Application::build(settings, Arc::new(bus), db)
        .await
        .context("session service did not start")?;
    app.run_until(aip_runtime::shutdown::signal())
        .await
        .context("session service failed")?;
    tracing::info!("session service stopped");
    Ok(())
}
