//! The command line of `aip bench`: where the broker is, the bounds of a run, and one
//! subcommand per scenario. The `aip` binary flattens [`BenchArgs`] into its `bench`
//! subcommand; the options are global, so they may follow the scenario's name.

use clap::builder::RangedU64ValueParser;
use clap::{Args, Subcommand};
use serde::Serialize;

/// Default WebSocket URL: `aip dev`'s.
pub const DEFAULT_WS_URL: &str = "ws://127.0.0.1:5000/ws";
/// Default REST base URL: `aip dev`'s.
pub const DEFAULT_REST_URL: &str = "http://127.0.0.1:5000";

/// `aip bench SCENARIO`: load a running broker with AIP clients of its own and measure it.
#[derive(Debug, Clone, Args)]
#[command(
    after_help = "Every scenario runs against a broker that is already running (e.g. \
    `aip dev` in another terminal) and only on this machine unless --allow-remote is given. \
    Runs are bounded: --max-seconds ends the load whatever is left, and every wait \
    for an answer ends after --timeout-secs.\n\n\
    With several gateways (--url repeated), each WebSocket client takes the next one in \
    turn; in `devinfo` and `tasks` a constellation is never on its device's gateway, so every \
    request crosses from one gateway to another. --rest is still one URL.\n\n\
    Pass the broker's process ids with --server-pid (repeatable: gateway, registry, sessions, \
    NATS, Postgres) to sample their CPU and RSS from /proc during the run.\n\n\
    Example:\n  aip bench tasks --devices 10 --clients 100 --count 50 --commands 1 \
    --server-pid \"$(pgrep -f 'aip dev')\""
)]
pub struct BenchArgs {
    /// The scenario to run.
    #[command(subcommand)]
    pub scenario: Scenario,
    /// Where the broker is and how the run is bounded.
    #[command(flatten)]
    pub options: RunOptions,
}

/// Options shared by every scenario.
#[derive(Debug, Clone, Args)]
pub struct RunOptions {
    /// A gateway's WebSocket URL. Repeat it (or give several separated by commas) to spread
    /// the clients over several gateways of one broker: round robin, and in `devinfo` and
    /// `tasks` every constellation on another gateway than its device.
    #[arg(long = "url", value_name = "URL", env = "AIP_URL", default_value = DEFAULT_WS_URL,
          value_delimiter = ',', global = true)]
    pub urls: Vec<String>,
    /// The broker's REST base URL (`aip dev`, or the session service).
    #[arg(long, env = "AIP_REST", default_value = DEFAULT_REST_URL, global = true)]
    pub rest: String,
    /// Gateway token, sent as `?token=` on every WebSocket.
    #[arg(long, env = "AIP_TOKEN", hide_env_values = true, global = true)]
    pub token: Option<String>,
    /// REST API key, sent as X-API-Key.
    #[arg(long, env = "AIP_API_KEY", hide_env_values = true, global = true)]
    pub api_key: Option<String>,
    /// Allow a broker that is not on a loopback address (only for your own test hosts).
    #[arg(long, global = true)]
    pub allow_remote: bool,
    /// End the load (clients' setup and the measured phase) this many seconds after the
    /// start, whatever is left.
    #[arg(long, default_value_t = 120, global = true,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub max_seconds: u64,
    /// The longest wait for any one answer (registration, round trip, task end).
    #[arg(long, default_value_t = 30, global = true,
          value_parser = clap::value_parser!(u64).range(1..=3_600))]
    pub timeout_secs: u64,
    /// After the measured phase, the longest the event-log check of `tasks` and `rest` takes.
    #[arg(long, default_value_t = 60, global = true,
          value_parser = clap::value_parser!(u64).range(1..=3_600))]
    pub verify_seconds: u64,
    /// A broker process to sample (CPU and RSS from /proc); repeatable.
    #[arg(long = "server-pid", value_name = "PID", global = true)]
    pub server_pids: Vec<u32>,
    /// Prefix of every client id the run uses (default: `bench-` and a random suffix, so
    /// runs never collide).
    #[arg(long, value_name = "PREFIX", global = true)]
    pub id_prefix: Option<String>,
    /// Print the report as JSON on stdout instead of the table.
    #[arg(long, global = true)]
    pub json: bool,
    /// No progress line on stderr (it is shown only when stderr is a terminal anyway).
    #[arg(long, global = true)]
    pub quiet: bool,
}

/// What to measure.
#[derive(Debug, Clone, Subcommand)]
pub enum Scenario {
    /// N registered idle devices held S seconds, heartbeating: setup rate, register
    /// latency, drops, and (with --server-pid) the broker's RSS per connection and CPU.
    Connect(ConnectArgs),
    /// Closed-loop heartbeat round trips: round trips/s and latency.
    Heartbeat(HeartbeatArgs),
    /// Connect, REGISTER, confirmation, close, again and again: registrations/s.
    Register(RegisterArgs),
    /// Constellations asking for their device's system information: requests/s.
    Devinfo(DevinfoArgs),
    /// Constellations sending UFO TASK frames run by devices of the bench (scripted steps):
    /// tasks/s, latency, failures, and a check of every task's event log.
    Tasks(TasksArgs),
    /// The same tasks submitted with POST /api/tasks and followed to the end over REST.
    Rest(RestArgs),
}

impl Scenario {
    /// The scenario's name, as typed.
    pub fn name(&self) -> &'static str {
        match self {
            Scenario::Connect(_) => "connect",
            Scenario::Heartbeat(_) => "heartbeat",
            Scenario::Register(_) => "register",
            Scenario::Devinfo(_) => "devinfo",
            Scenario::Tasks(_) => "tasks",
            Scenario::Rest(_) => "rest",
        }
    }

    /// Whether it needs the REST API.
    pub fn uses_rest(&self) -> bool {
        matches!(self, Scenario::Tasks(_) | Scenario::Rest(_))
    }

    /// About how many sockets it opens at once.
    pub fn sockets(&self) -> usize {
        match self {
            Scenario::Connect(a) => a.n,
            Scenario::Heartbeat(a) => a.clients,
            Scenario::Register(a) => a.clients,
            Scenario::Devinfo(a) => a.devices + a.clients,
            Scenario::Tasks(a) => a.devices + a.clients,
            Scenario::Rest(a) => a.devices + a.concurrency,
        }
    }
}

/// `aip bench connect`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct ConnectArgs {
    /// How many devices.
    #[arg(long, default_value_t = 1000, value_parser = RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    pub n: usize,
    /// Seconds to hold them once all are registered.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub hold: u64,
    /// Seconds between each device's heartbeats while held (UFO's Galaxy: 30).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3_600))]
    pub heartbeat_secs: u64,
    /// Connections being set up at once.
    #[arg(long, default_value_t = 200, value_parser = RangedU64ValueParser::<usize>::new().range(1..=100_000))]
    pub setup_concurrency: usize,
    /// Loopback addresses the devices connect from, 127.0.0.1 to 127.0.0.N, round robin. Each
    /// brings the kernel's range of ephemeral ports again (about 28,000 by default), so more
    /// devices than that can connect to one gateway. Needs a loopback --url.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=254))]
    pub source_addresses: u8,
}

/// `aip bench heartbeat`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct HeartbeatArgs {
    /// Registered clients, each running its own closed loop.
    #[arg(long, default_value_t = 10, value_parser = RangedU64ValueParser::<usize>::new().range(1..=100_000))]
    pub clients: usize,
    /// Round trips per client.
    #[arg(long, default_value_t = 10_000, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    pub count: usize,
}

/// `aip bench register`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct RegisterArgs {
    /// Clients, each registering in a closed loop.
    #[arg(long, default_value_t = 10, value_parser = RangedU64ValueParser::<usize>::new().range(1..=100_000))]
    pub clients: usize,
    /// Registrations per client (each with a fresh id).
    #[arg(long, default_value_t = 500, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    pub count: usize,
}

/// `aip bench devinfo`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct DevinfoArgs {
    /// Devices registered by the bench.
    #[arg(long, default_value_t = 10, value_parser = RangedU64ValueParser::<usize>::new().range(1..=100_000))]
    pub devices: usize,
    /// Constellations, each bound to one device (round robin), on another gateway than the
    /// device's when there are several.
    #[arg(long, default_value_t = 10, value_parser = RangedU64ValueParser::<usize>::new().range(1..=100_000))]
    pub clients: usize,
    /// Requests per constellation.
    #[arg(long, default_value_t = 10_000, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    pub count: usize,
}

/// `aip bench tasks`.
#[derive(Debug, Clone, Args, Serialize)]
#[command(
    after_help = "Each task is a UFO TASK frame whose metadata.steps holds K steps of one \
    `echo` Command each ([[{\"tool_name\":\"echo\",\"tool_type\":\"action\",\"parameters\":{...}}], \
    …]); the broker's scripted planner sends each step to the device as a `command` frame, the \
    bench's device answers at once, and the task ends with task_end to both. Latency is from \
    sending TASK to receiving task_end."
)]
pub struct TasksArgs {
    /// Devices registered by the bench; they answer every command at once.
    #[arg(long, default_value_t = 10, value_parser = RangedU64ValueParser::<usize>::new().range(1..=100_000))]
    pub devices: usize,
    /// Constellations, each bound to one device (round robin), on another gateway than the
    /// device's when there are several, each running its tasks one after another.
    #[arg(long, default_value_t = 10, value_parser = RangedU64ValueParser::<usize>::new().range(1..=100_000))]
    pub clients: usize,
    /// Tasks per constellation.
    #[arg(long, default_value_t = 100, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    pub count: usize,
    /// Command rounds per task (K).
    #[arg(long, default_value_t = 1, value_parser = RangedU64ValueParser::<usize>::new().range(1..=10_000))]
    pub commands: usize,
    /// Skip the check of every task's event log over REST.
    #[arg(long)]
    pub no_verify: bool,
}

/// `aip bench rest`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct RestArgs {
    /// Tasks in all.
    #[arg(long, default_value_t = 1000, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    pub count: usize,
    /// Devices registered by the bench (targets, round robin).
    #[arg(long, default_value_t = 10, value_parser = RangedU64ValueParser::<usize>::new().range(1..=100_000))]
    pub devices: usize,
    /// Tasks submitted and followed at once.
    #[arg(long, default_value_t = 10, value_parser = RangedU64ValueParser::<usize>::new().range(1..=100_000))]
    pub concurrency: usize,
    /// Command rounds per task (K).
    #[arg(long, default_value_t = 1, value_parser = RangedU64ValueParser::<usize>::new().range(1..=10_000))]
    pub commands: usize,
    /// Longest pause between two polls of GET /api/tasks/{id} (polls start at 1 ms and
    /// double up to this).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub poll_max_ms: u64,
    /// Skip the check of every task's event log.
    #[arg(long)]
    pub no_verify: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn options_may_follow_the_scenario() {
        let cli = Cli::try_parse_from([
            "bench",
            "tasks",
            "--clients",
            "3",
            "--url",
            "ws://127.0.0.1:1/ws",
            "--server-pid",
            "7",
            "--server-pid",
            "8",
        ])
        .expect("parses");
        assert_eq!(cli.bench.options.urls, ["ws://127.0.0.1:1/ws"]);
        assert_eq!(cli.bench.options.server_pids, [7, 8]);
        match cli.bench.scenario {
            Scenario::Tasks(a) => assert_eq!((a.clients, a.commands), (3, 1)),
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn url_is_repeatable_and_splits_on_commas() {
        let urls = |words: &[&str]| {
            let mut argv = vec!["bench", "heartbeat"];
            argv.extend_from_slice(words);
            Cli::try_parse_from(argv)
                .expect("parses")
                .bench
                .options
                .urls
        };
        assert_eq!(
            urls(&[
                "--url",
                "ws://127.0.0.1:1/ws",
                "--url",
                "ws://127.0.0.1:2/ws"
            ]),
            ["ws://127.0.0.1:1/ws", "ws://127.0.0.1:2/ws"]
        );
        assert_eq!(
            urls(&["--url", "ws://127.0.0.1:1/ws,ws://127.0.0.1:2/ws"]),
            ["ws://127.0.0.1:1/ws", "ws://127.0.0.1:2/ws"]
        );
        if std::env::var_os("AIP_URL").is_none() {
            assert_eq!(urls(&[]), [DEFAULT_WS_URL]);
        }
    }
}
