//! `aip-gateway`: the WebSocket gateway as a process.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;

/// AIP WebSocket gateway: clients connect to /ws; frames travel over NATS.
#[derive(Debug, Parser)]
#[command(name = "aip-gateway", version)]
struct Args {
    /// Configuration file (TOML or JSON); environment variables AIP_… override it.
    #[arg(long, env = "AIP_CONFIG")]
    config: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    aip_runtime::install_crypto_provider();
    let args = Args::parse();
    let settings: aip_gateway::Settings = aip_runtime::settings::load(args.config.as_deref())?;
    aip_runtime::telemetry::init(settings.log_format, "info");
    let bus = aip_bus::NatsBus::connect(&settings.nats_url, "aip-gateway").await?;
    let app = aip_gateway::Application::build(settings, Arc::new(bus))
        .await
        .context("gateway did not start")?;
    app.run_until(aip_runtime::shutdown::signal())
        .await
        .context("gateway server failed")?;
    tracing::info!("gateway stopped");
    Ok(())
}
