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
    #[arg(long, short = 'c', env = "AIP_CONFIG", global = true)]
    config: Option<std::path::PathBuf>,
    /// Check the command line, the configuration file and the environment, print what each
    /// variable sets, and exit without connecting to anything: any AIP_ or OTEL_ variable the
    /// binary does not read, or a setting that cannot work, is an error.
    #[arg(long, global = true)]
    check: bool,
    /// What to do; without a command, serve until SIGINT/SIGTERM.
    #[command(subcommand)]
    command: Option<Command>,
}

/// What a service binary does besides serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::Subcommand)]
enum Command {
    /// Apply the database migrations and exit (the registry and the session service; one
    /// set of migrations for both). Deployments run it once before the services start; a
    /// service also migrates at start, under a lock, so this is never required.
    Migrate,
    /// Ask this process's own listener (its `listen` setting) whether the service is ready
    /// (`/readyz`), or with `--live` whether it answers at all (`/healthz`); exit 0 if so.
    /// For container health checks in images without an HTTP client.
    Probe {
        /// Liveness (`/healthz`) instead of readiness.
        #[arg(long)]
        live: bool,
    },
}

/// A service binary's `main`: parses the command line (`--config`, `--check`, `--version`,
/// `--help` with `about`, the `migrate` and `probe` commands), then [`run`]s service `S` on a
/// runtime of its `worker_threads` ([`runtime`]) or does what the command says.
pub fn main<S: Service>(about: &'static str) -> anyhow::Result<()> {
    use clap::{CommandFactory, FromArgMatches};
    let service = <S::Settings as ServiceSettings>::SERVICE;
    let binary = service.binary();
    let keeps_database = S::Settings::default().common().database_url.is_some();
    let mut command = Args::command().name(binary).about(about);
    if !keeps_database {
        command = command.mut_subcommand("migrate", |c| c.hide(true));
    }
    let args = Args::from_arg_matches(&command.get_matches())?;
    let config = args.config.as_deref();
    if args.command == Some(Command::Migrate) && !keeps_database {
        anyhow::bail!(
            "{binary} keeps no database; run `aip-registry migrate` or `aip-sessions migrate`"
        );
    }
    if args.check {
        return check::<S>(config);
    }
    let one_thread = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the runtime")
    };
    match args.command {
        None => {
            let settings: S::Settings =
                crate::settings::load(config).context("loading settings")?;
            // Zero is refused with the other settings' checks, in `run`.
            let threads = settings.common().worker_threads.filter(|n| *n > 0);
            runtime(threads)
                .context("starting the runtime")?
                .block_on(run::<S>(settings))
        }
        Some(Command::Migrate) => one_thread()?.block_on(migrate::<S>(config)),
        Some(Command::Probe { live }) => one_thread()?.block_on(probe::<S>(config, live)),
    }
}

/// The runtime a service runs on: tokio's scheduler with `worker_threads` threads, one per
/// CPU the process may use when `None`.
///
/// Where the services share a few cores with each other, NATS and PostgreSQL (docker compose,
/// one small host), one thread each leaves more CPU to the others: every message a service
/// handles wakes a thread, and with more threads than it keeps busy the wake-ups cross threads
/// and cores, which costs CPU of its own. On 2 cores shared by all of them, one thread per
/// service cut the services' own CPU per task by about a tenth, for the same throughput
/// (`docs/benchmarks.md`, session 58). A service with cores of its own wants as many threads
/// as it has cores.
pub fn runtime(worker_threads: Option<usize>) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if let Some(threads) = worker_threads {
        builder.worker_threads(threads);
    }
    builder.build()
}

/// `--check`: loads the settings from `config` and the environment as [`run`] would, checks
/// them, and prints what every variable of the environment means to the binary. Fails on a
/// variable it would ignore and on a setting that cannot work.
pub fn check<S: Service>(config: Option<&Path>) -> anyhow::Result<()> {
    let service = <S::Settings as ServiceSettings>::SERVICE;
    let environment = crate::check::Environment::read::<S::Settings>(std::env::vars());
    let unknown: Vec<String> = environment.unknown().map(ToString::to_string).collect();
    if !unknown.is_empty() {
        anyhow::bail!(
            "{} does not read these variables:\n  {}",
            service.binary(),
            unknown.join("\n  ")
        );
    }
    let settings: S::Settings = crate::settings::load(config).context("loading settings")?;
    settings.validate().context("checking settings")?;
    println!(
        "{}: the command line, the configuration and the environment are valid",
        service.binary()
    );
    for variable in &environment.variables {
        println!("  {variable}");
    }
    Ok(())
}

/// Logs a warning for every `AIP_…` or `OTEL_…` variable the binary does not read.
fn warn_about_unknown_variables<S: ServiceSettings>() {
    let environment = crate::check::Environment::read::<S>(std::env::vars());
    for variable in environment.unknown() {
        tracing::warn!("{variable}");
    }
}

/// `migrate`: opens the database of the settings (waiting for it as [`run`] does), applies
/// every migration not yet applied, and returns.
pub async fn migrate<S: Service>(config: Option<&Path>) -> anyhow::Result<()> {
    crate::install_crypto_provider();
    let service = <S::Settings as ServiceSettings>::SERVICE;
    let settings: S::Settings = crate::settings::load(config).context("loading settings")?;
    crate::telemetry::init(settings.common().log_format, "info");
    warn_about_unknown_variables::<S::Settings>();
    let Some(url) = settings.common().database_url else {
        anyhow::bail!("the {service} keeps no database");
    };
    let database = connect_database(url, &settings.pool_options()).await?;
    let result = database.migrate().await;
    database.close().await;
    result?;
    tracing::info!(
        database = %aip_store::mask_url(url),
        "the database is migrated"
    );
    Ok(())
}

/// `probe`: one `GET` of `/readyz` (or `/healthz`) on the listener the settings name (a
/// wildcard address is asked on loopback); `Ok` only for a 200.
pub async fn probe<S: Service>(config: Option<&Path>, live: bool) -> anyhow::Result<()> {
    let settings: S::Settings = crate::settings::load(config).context("loading settings")?;
    let mut address = settings.exposure().listen;
    if address.ip().is_unspecified() {
        address.set_ip(match address {
            std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    let path = if live { "/healthz" } else { "/readyz" };
    let status = tokio::time::timeout(PROBE_TIMEOUT, http_status(address, path))
        .await
        .with_context(|| format!("{path} on {address} did not answer within {PROBE_TIMEOUT:?}"))?
        .with_context(|| format!("asking {path} on {address}"))?;
    anyhow::ensure!(status == 200, "{path} on {address} answered {status}");
    Ok(())
}

/// How long [`probe`] waits: less than a container health check's usual timeout.
const PROBE_TIMEOUT: Duration = Duration::from_secs(4);

/// The status code of `GET path` on `address` (HTTP/1.1, one request, connection closed).
async fn http_status(address: std::net::SocketAddr, path: &str) -> anyhow::Result<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    let host = match address {
        std::net::SocketAddr::V4(a) => a.ip().to_string(),
        std::net::SocketAddr::V6(a) => format!("[{}]", a.ip()),
    };
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
    let mut head = Vec::new();
    let mut buffer = [0u8; 256];
    while !head.windows(2).any(|w| w == b"\r\n") {
        let n = stream.read(&mut buffer).await?;
        anyhow::ensure!(n > 0, "the connection closed before a status line");
        head.extend_from_slice(&buffer[..n]);
    }
    let line = String::from_utf8_lossy(&head);
    line.split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("not an HTTP status line: {:?}", line.lines().next()))
}

/// Runs service `S` as a process with `settings` (loaded from the `--config` file, or none,
/// and the `AIP_…` environment), until SIGINT or SIGTERM.
pub async fn run<S: Service>(settings: S::Settings) -> anyhow::Result<()> {
    crate::install_crypto_provider();
    let service = <S::Settings as ServiceSettings>::SERVICE;
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
    warn_about_unknown_variables::<S::Settings>();
    settings.validate().context("checking settings")?;
    tracing::info!(
        worker_threads = tokio::runtime::Handle::current().metrics().num_workers(),
        "{} starting",
        service.binary()
    );

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

    #[test]
    fn the_runtime_has_the_threads_asked_for() {
        for threads in [1, 3] {
            let runtime = runtime(Some(threads)).expect("runtime");
            assert_eq!(runtime.metrics().num_workers(), threads);
        }
        if std::env::var_os("TOKIO_WORKER_THREADS").is_some() {
            return; // tokio's own default then
        }
        let default = runtime(None).expect("runtime");
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        assert_eq!(default.metrics().num_workers(), cpus);
    }

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
