//! # aip: the command
//!
//! - `aip dev` ([`dev`]): gateway, registry and session service in one process on one listener,
//!   with the in-process bus and SQLite by default (NATS and PostgreSQL on request);
//! - `aip device` ([`device`]): a reference device agent speaking UFO-format AIP;
//! - `aip dispatch` ([`dispatch`]): submit a task and follow it live until it ends;
//! - `aip tasks …`, `aip agents …` ([`query`]): look at tasks and agents over REST.
//!
//! The REST client ([`rest`]), the Server-Sent Events reader ([`sse`]) and the human output
//! ([`output`]) are shared by the client commands.

pub mod cli;
pub mod dev;
pub mod device;
pub mod dispatch;
pub mod output;
pub mod query;
pub mod rest;
pub mod sse;
pub mod steps;

use std::process::ExitCode;

use cli::{Cli, Command};

/// Exit codes of the `aip` command.
pub mod exit {
    /// Success (for `aip dispatch`: the task completed).
    pub const OK: u8 = 0;
    /// `aip dispatch`: the task ended without completing (failed, canceled, rejected).
    pub const TASK_NOT_COMPLETED: u8 = 1;
    /// Bad arguments (also clap's code).
    pub const USAGE: u8 = 2;
    /// Anything else: the broker is unreachable or refused the request, or `aip dev` failed.
    pub const ERROR: u8 = 3;
}

/// A mistake in the arguments that clap could not catch (e.g. invalid JSON in `--args`).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Runs a parsed command line and says how the process should exit.
pub async fn run(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::Dev(args) => dev::run(args).await.map(|()| exit::OK),
        Command::Device(args) => device::run(args).await.map(|()| exit::OK),
        Command::Dispatch(args) => dispatch::run(args).await,
        Command::Tasks { command } => query::tasks(command).await.map(|()| exit::OK),
        Command::Agents { command } => query::agents(command).await.map(|()| exit::OK),
        Command::Bench(args) => bench(args).await,
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            let code = if e.downcast_ref::<UsageError>().is_some() {
                exit::USAGE
            } else {
                exit::ERROR
            };
            ExitCode::from(code)
        }
    }
}

/// `aip bench`: runs a scenario and prints a table, or JSON with `--json`.
async fn bench(args: aip_bench::BenchArgs) -> anyhow::Result<u8> {
    let json = args.options.json;
    let report = aip_bench::run(args).await?;
    if json {
        report.print_json()?;
    } else {
        report.print_table();
    }
    Ok(exit::OK)
}
