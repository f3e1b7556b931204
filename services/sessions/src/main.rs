//! `aip-sessions`: the session service as a process, run by [`aip_runtime::runner`] until
//! SIGINT/SIGTERM.

use std::path::PathBuf;

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
    let args = Args::parse();
    aip_runtime::runner::run::<aip_sessions::Application>(args.config.as_deref()).await
}
