//! `aip-registry`: the agent registry service (NATS + PostgreSQL), run by
//! [`aip_runtime::runner`] until SIGINT/SIGTERM.

use std::path::PathBuf;

use clap::Parser;

/// The agent registry of the aip broker.
#[derive(Debug, Parser)]
#[command(name = "aip-registry", version, about)]
struct Args {
    /// Configuration file (TOML or JSON); environment variables `AIP_…` override it.
    #[arg(long, short = 'c', env = "AIP_CONFIG")]
    config: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    aip_runtime::runner::run::<aip_registry::Application>(args.config.as_deref()).await
}
