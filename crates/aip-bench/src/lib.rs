//! # aip-bench: the measuring instrument behind `aip bench`
//!
//! Loads a running AIP broker (one or more `ws://…/ws` gateways and its REST base, on this
//! machine unless `--allow-remote`) with load clients of its own that speak UFO's AIP over real
//! WebSockets (tokio-tungstenite, one task per client) and REST, and reports throughput,
//! latency percentiles from HDR histograms, failures by reason, and CPU and RSS of the broker's
//! processes (`--server-pid`) and of the generator itself from /proc.
//!
//! Scenarios ([`Scenario`]): `connect` (idle registered devices held; RSS per connection),
//! `heartbeat` (closed-loop round trips), `register` (connect, REGISTER, close), `devinfo`
//! (constellation device-info requests), `tasks` (constellation TASK frames with scripted steps
//! run by the bench's devices, then a check of every task's event log) and `rest` (the same
//! tasks over `POST /api/tasks`).
//!
//! With several gateways (`--url` repeated, or `AIP_URL=URL1,URL2`) the clients are spread
//! over them round robin, and in `devinfo` and `tasks` every constellation is on another
//! gateway than the device it drives, so every request crosses gateways.
//!
//! Every run is bounded: `--max-seconds` ends the load whatever is left, every wait for an
//! answer ends after `--timeout-secs`, the event-log check after `--verify-seconds`.
//!
//! ```no_run
//! # async fn example() -> anyhow::Result<()> {
//! use clap::Parser;
//!
//! #[derive(Parser)]
//! struct Cli {
//!     #[command(flatten)]
//!     bench: aip_bench::BenchArgs,
//! }
//!
//! let cli = Cli::parse_from(["aip-bench", "heartbeat", "--clients", "10", "--count", "1000"]);
//! let json = cli.bench.options.json;
//! let report = aip_bench::run(cli.bench).await?;
//! if json { report.print_json()? } else { report.print_table() }
//! # Ok(())
//! # }
//! ```

mod args;
mod conn;
mod devices;
mod monitor;
mod progress;
mod report;
mod rest;
mod scenario;
mod stats;
mod target;
mod verify;
mod wire;

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

pub use args::{
    BenchArgs, ConnectArgs, DEFAULT_REST_URL, DEFAULT_WS_URL, DevinfoArgs, HeartbeatArgs,
    RegisterArgs, RestArgs, RunOptions, Scenario, TasksArgs,
};
pub use report::{
    ConnectFigures, DeviceFigures, FailureReason, LatencySummary, ProcessUsage, Report,
    UsageSample, Verification,
};
pub use target::TargetError;

use crate::progress::{Printer, Progress};
use crate::scenario::{Ctx, Measured};
use crate::target::Target;

/// File descriptors kept free beyond the run's sockets.
const SPARE_FILES: u64 = 64;
/// Share of the machine's CPU above which the generator may be what limits a run.
const GENERATOR_BOUND_SHARE: f64 = 0.4;
/// Shortest window whose CPU figures mean something (/proc counts in 10 ms ticks).
const CPU_WINDOW_SECS: f64 = 1.0;

/// Runs one scenario against the broker and returns what it measured.
///
/// Fails before loading anything when the target is not usable: a URL that is not loopback
/// (without `--allow-remote`), a broker that does not answer (the error says how to start
/// one), a refused token or API key, an unreadable `--server-pid`, too few file descriptors.
/// Once the load has started, refusals and errors are counted in the report, not returned.
pub async fn run(args: BenchArgs) -> anyhow::Result<Report> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let options = &args.options;
    let target = Target::from_options(options)?;
    if let Some(limit) = target::open_files_limit() {
        let needed = args.scenario.sockets() as u64 + SPARE_FILES;
        if needed > limit {
            return Err(TargetError::TooFewFiles { needed, limit }.into());
        }
    }
    monitor::check_pids(&options.server_pids)?;
    if let Scenario::Connect(a) = &args.scenario
        && a.source_addresses > 1
        && let Some(remote) = target.gateways.iter().find(|g| !g.is_loopback())
    {
        anyhow::bail!(
            "--source-addresses {} connects from 127.0.0.x, which reaches only a loopback \
             --url; {} is not one",
            a.source_addresses,
            remote.shown
        );
    }
    target.probe_ws().await?;
    let timeout = Duration::from_secs(options.timeout_secs);
    let rest = if args.scenario.uses_rest() {
        let pool = match &args.scenario {
            Scenario::Rest(a) => a.concurrency,
            _ => 16,
        };
        let rest = rest::Rest::new(&target, timeout, pool)?;
        target.probe_rest(rest.http()).await?;
        Some(rest)
    } else {
        None
    };

    let nonce = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let prefix = match &options.id_prefix {
        Some(p) if p.is_empty() || p.contains('@') => {
            anyhow::bail!("--id-prefix must be non-empty and without `@`, got {p:?}")
        }
        Some(p) => p.clone(),
        None => format!("bench-{nonce}"),
    };
    let progress = Progress::new();
    let printer = Printer::start(progress.clone(), !options.quiet);
    let started_at = proto_schemas::server::timestamp_now();
    let ctx = Ctx {
        target: Arc::new(target.clone()),
        deadline: Instant::now() + Duration::from_secs(options.max_seconds),
        max_seconds: options.max_seconds,
        timeout,
        prefix: Arc::from(prefix.as_str()),
        nonce: Arc::from(nonce.as_str()),
        progress,
        pids: Arc::from(options.server_pids.as_slice()),
        rest,
        verify_for: Duration::from_secs(options.verify_seconds),
        started: Instant::now(),
    };
    // Every loop stops by itself at the deadline; this only guards against a bug that
    // would keep a run going.
    let longest = Duration::from_secs(
        options.max_seconds + options.verify_seconds + 2 * options.timeout_secs + 60,
    );
    let measured = tokio::time::timeout(longest, scenario::run(&ctx, &args.scenario)).await;
    printer.stop().await;
    let measured = measured
        .map_err(|_| anyhow::anyhow!("the run did not stop within {longest:?}; giving up"))??;
    Ok(report(&args, &target, prefix, started_at, measured))
}

fn report(
    args: &BenchArgs,
    target: &Target,
    id_prefix: String,
    started_at: String,
    m: Measured,
) -> Report {
    let parameters = match &args.scenario {
        Scenario::Connect(a) => serde_json::to_value(a),
        Scenario::Heartbeat(a) => serde_json::to_value(a),
        Scenario::Register(a) => serde_json::to_value(a),
        Scenario::Devinfo(a) => serde_json::to_value(a),
        Scenario::Tasks(a) => serde_json::to_value(a),
        Scenario::Rest(a) => serde_json::to_value(a),
    }
    .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let throughput = m.throughput.unwrap_or(if m.window_secs > 0.0 {
        m.completed as f64 / m.window_secs
    } else {
        0.0
    });
    let failure_reasons = m.failures.reasons();
    let mut notes = Vec::new();
    let share = m.generator.cpu_percent / (100.0 * cores as f64);
    if m.window_secs < CPU_WINDOW_SECS {
        notes.push(format!(
            "the window was shorter than {CPU_WINDOW_SECS} s: CPU figures are too coarse to read"
        ));
    } else if share >= GENERATOR_BOUND_SHARE {
        notes.push(format!(
            "the load generator itself used {:.0}% CPU ({:.0}% of this machine's {cores} \
             cores): the figures may be limited by the generator rather than the broker",
            m.generator.cpu_percent,
            share * 100.0
        ));
    }
    if args.options.server_pids.is_empty() {
        notes.push(
            "pass --server-pid (repeatable) to see the broker's CPU and RSS over the window"
                .to_owned(),
        );
    }
    if failure_reasons
        .iter()
        .any(|f| f.reason.contains("frames per second"))
    {
        notes.push(
            "the gateway rate-limited frames per connection (gateway.frames_per_second, 500 by \
             default): raise or disable it for benchmarks, e.g. AIP_GATEWAY__FRAMES_PER_SECOND=0"
                .to_owned(),
        );
    }
    Report {
        scenario: args.scenario.name().to_owned(),
        parameters,
        urls: target.urls_shown(),
        rest: args.scenario.uses_rest().then(|| target.rest.to_string()),
        id_prefix,
        started_at,
        unit: m.unit.to_owned(),
        expected: m.expected,
        completed: m.completed,
        failures: m.failures.count(),
        failure_reasons,
        window_secs: round3(m.window_secs),
        throughput_per_sec: round3(throughput),
        // A line with nothing timed (e.g. no acknowledgement seen) is noise.
        latencies: m.latencies.into_iter().filter(|l| l.count > 0).collect(),
        timeline: m.timeline,
        connect: m.connect,
        verification: m.verification,
        devices: m.devices,
        broker: m.broker,
        generator: m.generator,
        cores,
        stopped_early: m.stopped_early,
        notes,
    }
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}
