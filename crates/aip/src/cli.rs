//! The command line: every subcommand and flag, parsed with clap.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{ArgGroup, Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

use crate::steps::StepSource;

/// Default address of `aip dev`: UFO's default port, so `ws://localhost:5000/ws` works.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:5000";
/// Default WebSocket URL for `aip device`.
pub const DEFAULT_WS_URL: &str = "ws://127.0.0.1:5000/ws";
/// Default REST base URL for the client commands.
pub const DEFAULT_REST_URL: &str = "http://127.0.0.1:5000";

/// The aip broker: run it, connect a device to it, dispatch tasks, look at tasks and agents.
#[derive(Debug, Parser)]
#[command(
    name = "aip",
    version,
    propagate_version = true,
    after_help = "Quick start (three terminals):\n  \
        aip dev\n  \
        aip device --id demo-pc --capability demo\n  \
        aip dispatch --capability demo --tool echo --args '{\"text\":\"hi\"}' \"say hi\"\n\n\
        Exit codes: 0 success; 1 the dispatched task did not complete; 2 bad arguments; \
        3 any other error (e.g. the broker is not reachable)."
)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the whole broker (gateway, registry, session service) in one process on one port.
    Dev(DevArgs),
    /// Run a reference device agent that executes safe built-in tools.
    Device(DeviceArgs),
    /// Submit a task, follow it live until it ends and print its result.
    Dispatch(DispatchArgs),
    /// List tasks, show one, its events, or cancel it.
    Tasks {
        /// What to do with tasks.
        #[command(subcommand)]
        command: TasksCommand,
    },
    /// List agents or show one.
    Agents {
        /// What to do with agents.
        #[command(subcommand)]
        command: AgentsCommand,
    },
    /// Load a running broker with real AIP clients and report rates, latencies and costs.
    Bench(aip_bench::BenchArgs),
}

/// `aip dev`.
#[derive(Debug, Args)]
#[command(
    after_help = "Services can be tuned as in the distributed mode with AIP_GATEWAY__*, \
        AIP_REGISTRY__* and AIP_SESSIONS__* variables or a --config file (e.g. \
        AIP_SESSIONS__COMMAND_TIMEOUT_SECS=60). AIP_NATS_URL and AIP_DATABASE_URL are not read: \
        use --nats-url and --database-url."
)]
pub struct DevArgs {
    /// Address of the one listener: WebSocket /ws and the REST API (port 0: any free port).
    #[arg(long, default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,
    /// Where the embedded SQLite database lives (created when missing; unused with
    /// --database-url).
    #[arg(long, default_value = ".aip-dev")]
    pub data_dir: PathBuf,
    /// Use this NATS server instead of the in-process bus (needed for remote planners and
    /// other processes on the bus).
    #[arg(long)]
    pub nats_url: Option<String>,
    /// Use this database instead of `sqlite://<data-dir>/aip.db` (postgres://… or sqlite://…).
    #[arg(long)]
    pub database_url: Option<String>,
    /// Prefix of every bus subject, so several brokers can share one NATS server.
    #[arg(long, default_value = proto_schemas::subjects::DEFAULT_PREFIX)]
    pub subject_prefix: String,
    /// A key required on /api/* (X-API-Key or Authorization: Bearer); repeatable.
    #[arg(long = "api-key", value_name = "KEY")]
    pub api_keys: Vec<String>,
    /// Gateway credentials file (TOML: tokens and the client ids they may register as).
    #[arg(long)]
    pub credentials_file: Option<PathBuf>,
    /// Principals file (TOML: API keys limited to their own requesters, devices and quotas;
    /// see README "Security"), accepted on the session service's routes beside --api-key.
    #[arg(long)]
    pub principals_file: Option<PathBuf>,
    /// Serve without API keys and credentials on a non-loopback address (trusted networks).
    #[arg(long)]
    pub allow_no_auth: bool,
    /// A web origin allowed to open /ws and call /api (repeatable; `*` for any). Browsers'
    /// requests from any other origin are refused, so a web page cannot drive local devices.
    #[arg(long = "allowed-origin", value_name = "ORIGIN")]
    pub allowed_origins: Vec<String>,
    /// Configuration file (TOML or JSON) with [gateway], [registry] and [sessions] sections.
    #[arg(long, env = "AIP_CONFIG")]
    pub config: Option<PathBuf>,
    /// The planner of tasks without steps that name none (default: `http` with
    /// --planner-url, else `llm` with a model endpoint, else `nats`).
    #[arg(long, value_enum)]
    pub planner: Option<PlannerArg>,
    /// An HTTP planner: each step's PlanRequest is POSTed here, the answer is a PlanReply
    /// (examples/http_planner.py). Sign the requests with AIP_SESSIONS__PLANNER__SECRET.
    #[arg(long, value_name = "URL")]
    pub planner_url: Option<String>,
    /// The built-in agent's OpenAI-compatible endpoint, e.g. http://127.0.0.1:11434/v1
    /// (Ollama); its key comes from OPENAI_API_KEY.
    #[arg(long, value_name = "URL", env = "OPENAI_BASE_URL")]
    pub llm_base_url: Option<String>,
    /// The model the built-in agent asks.
    #[arg(long, value_name = "NAME", env = "AIP_LLM_MODEL")]
    pub llm_model: Option<String>,
    /// Export traces over OTLP (gRPC) to OTEL_EXPORTER_OTLP_ENDPOINT, else
    /// http://localhost:4317 (Jaeger's OTLP port); off by default.
    #[arg(long)]
    pub traces: bool,
}

/// A planner by name (`--planner`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PlannerArg {
    /// A planner process on NATS (`planner.next`; needs --nats-url).
    Nats,
    /// The HTTP planner at --planner-url.
    Http,
    /// The built-in tool-calling agent.
    Llm,
}

impl PlannerArg {
    /// The wire value.
    pub fn planner(self) -> proto_schemas::PlannerName {
        match self {
            PlannerArg::Nats => proto_schemas::PlannerName::Nats,
            PlannerArg::Http => proto_schemas::PlannerName::Http,
            PlannerArg::Llm => proto_schemas::PlannerName::Llm,
        }
    }
}

/// The platform a device announces; it decides which UFO agent the broker names in commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PlatformArg {
    /// `LinuxAgent`.
    Linux,
    /// `HostAgent`.
    Windows,
    /// `MobileAgent`.
    Mobile,
}

impl PlatformArg {
    /// The wire value.
    pub fn platform(self) -> proto_schemas::Platform {
        match self {
            PlatformArg::Linux => proto_schemas::Platform::Linux,
            PlatformArg::Windows => proto_schemas::Platform::Windows,
            PlatformArg::Mobile => proto_schemas::Platform::Mobile,
        }
    }

    /// The platform of the machine this runs on (Linux for anything that is not Windows).
    pub fn this_machine() -> Self {
        if cfg!(windows) {
            PlatformArg::Windows
        } else {
            PlatformArg::Linux
        }
    }
}

/// `aip device`.
#[derive(Debug, Args)]
pub struct DeviceArgs {
    /// The broker's WebSocket URL.
    #[arg(long, env = "AIP_URL", default_value = DEFAULT_WS_URL)]
    pub url: String,
    /// The device's client id (default: this machine's host name).
    #[arg(long)]
    pub id: Option<String>,
    /// A capability to announce (REGISTER metadata.capabilities); repeatable.
    #[arg(long = "capability", value_name = "NAME")]
    pub capabilities: Vec<String>,
    /// The platform to announce (default: this machine's).
    #[arg(long, value_enum)]
    pub platform: Option<PlatformArg>,
    /// Token for the gateway (sent as ?token=…).
    #[arg(long, env = "AIP_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Seconds between heartbeats.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub heartbeat_secs: u64,
}

/// Where the broker's REST API is and how to authenticate.
#[derive(Debug, Clone, Args)]
pub struct RestArgs {
    /// The broker's REST base URL.
    #[arg(long, env = "AIP_REST", default_value = DEFAULT_REST_URL)]
    pub rest: String,
    /// API key (sent as X-API-Key).
    #[arg(long, env = "AIP_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
}

/// `aip dispatch`.
#[derive(Debug, Args)]
#[command(
    group(ArgGroup::new("placement").required(true).args(["target", "capabilities"])),
    after_help = "Steps: each --step is one round of Commands sent to the device (a JSON list of \
        Commands, or one Command object); each --tool NAME [--args JSON] is a one-Command step \
        (tool_type action). They run in the order given. Without steps the broker's planner decides \
        them: --planner, or the broker's default (`aip dev --planner-url …`, `--llm-base-url …`, \
        or a planner on NATS).\n\n\
        Exit codes: 0 the task completed; 1 it failed, was canceled or rejected; 2 bad \
        arguments; 3 the broker is not reachable or refused the task; 130 you stopped following \
        with Ctrl-C (the task goes on).\n\n\
        Example:\n  aip dispatch --capability demo --tool echo --args '{\"text\":\"hi\"}' \"say hi\""
)]
pub struct DispatchArgs {
    /// What the task is to achieve, in words.
    pub request: String,
    /// Run on this agent.
    #[arg(long)]
    pub target: Option<String>,
    /// Run on an available agent with this capability; repeatable (all are required).
    #[arg(long = "capability", value_name = "NAME")]
    pub capabilities: Vec<String>,
    /// One step: a JSON list of Commands (or one Command); repeatable.
    #[arg(long = "step", value_name = "JSON")]
    pub steps: Vec<String>,
    /// One step of one Command running this tool; repeatable.
    #[arg(long = "tool", value_name = "NAME")]
    pub tools: Vec<String>,
    /// The parameters (a JSON object) of the --tool before it.
    #[arg(long = "args", value_name = "JSON")]
    pub args: Vec<String>,
    /// The task's name (`[A-Za-z0-9._-]`); UFO's /api/task_result/{name} finds it by it.
    #[arg(long)]
    pub name: Option<String>,
    /// Structured input for the task (JSON), passed to the planner.
    #[arg(long, value_name = "JSON")]
    pub data: Option<String>,
    /// Who plans a task given without steps (default: the broker's).
    #[arg(long, value_enum)]
    pub planner: Option<PlannerArg>,
    /// Higher runs first when the agent is busy.
    #[arg(long)]
    pub priority: Option<i32>,
    /// Fail the task with TASK_TIMEOUT after this many seconds.
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,
    /// Who asks (the task's originating agent id).
    #[arg(long, default_value = "aip-cli")]
    pub from: String,
    /// Print the submitted task and exit without following it.
    #[arg(long)]
    pub no_wait: bool,
    /// Print the final task as JSON (TaskView) instead of a summary.
    #[arg(long)]
    pub json: bool,
    /// REST endpoint and key.
    #[command(flatten)]
    pub rest: RestArgs,
    /// `--step`, `--tool` and `--args` in command-line order (filled by [`parse`]).
    #[arg(skip)]
    pub step_sources: Vec<StepSource>,
}

/// `aip tasks …`.
#[derive(Debug, Subcommand)]
pub enum TasksCommand {
    /// List tasks, newest first.
    List {
        /// Only tasks in this state (submitted, dispatched, working, completed, failed, …).
        #[arg(long)]
        state: Option<String>,
        /// Only tasks run by this agent.
        #[arg(long)]
        executor: Option<String>,
        /// Only tasks with this name.
        #[arg(long)]
        name: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// REST endpoint and key.
        #[command(flatten)]
        rest: RestArgs,
    },
    /// Show one task with its result and event log.
    Get {
        /// The task id.
        id: String,
        /// Print the task as JSON (TaskView).
        #[arg(long)]
        json: bool,
        /// REST endpoint and key.
        #[command(flatten)]
        rest: RestArgs,
    },
    /// Show a task's event log.
    Events {
        /// The task id.
        id: String,
        /// Keep printing new events until the task ends.
        #[arg(long)]
        follow: bool,
        /// Print JSON (one object; with --follow one event per line).
        #[arg(long)]
        json: bool,
        /// REST endpoint and key.
        #[command(flatten)]
        rest: RestArgs,
    },
    /// Cancel a task that has not ended.
    Cancel {
        /// The task id.
        id: String,
        /// Why (recorded in the task).
        #[arg(long)]
        reason: Option<String>,
        /// Print the task as JSON.
        #[arg(long)]
        json: bool,
        /// REST endpoint and key.
        #[command(flatten)]
        rest: RestArgs,
    },
    /// Answer a task's open question (it waits in input_required; `aip tasks get` shows it).
    Answer {
        /// The task id.
        id: String,
        /// The answer.
        answer: String,
        /// The question's id (default: the task's open question).
        #[arg(long)]
        question: Option<String>,
        /// Print the task as JSON.
        #[arg(long)]
        json: bool,
        /// REST endpoint and key.
        #[command(flatten)]
        rest: RestArgs,
    },
    /// Hand a task to another agent: --target, or --capability (repeatable).
    #[command(group(ArgGroup::new("to").required(true).args(["target", "capabilities"])))]
    Handoff {
        /// The task id.
        id: String,
        /// Why.
        #[arg(long)]
        reason: String,
        /// The agent to take it.
        #[arg(long)]
        target: Option<String>,
        /// Otherwise, an available agent with this capability; repeatable.
        #[arg(long = "capability", value_name = "NAME")]
        capabilities: Vec<String>,
        /// Print the task as JSON.
        #[arg(long)]
        json: bool,
        /// REST endpoint and key.
        #[command(flatten)]
        rest: RestArgs,
    },
}

/// `aip agents …`.
#[derive(Debug, Subcommand)]
pub enum AgentsCommand {
    /// List agents.
    List {
        /// Only agents with this capability; repeatable.
        #[arg(long = "capability", value_name = "NAME")]
        capabilities: Vec<String>,
        /// Only agents in this status (available, busy, offline).
        #[arg(long)]
        status: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// REST endpoint and key.
        #[command(flatten)]
        rest: RestArgs,
    },
    /// Show one agent.
    Get {
        /// The agent id.
        id: String,
        /// Print JSON (AgentRecord).
        #[arg(long)]
        json: bool,
        /// REST endpoint and key.
        #[command(flatten)]
        rest: RestArgs,
    },
}

/// Parses the process's arguments (exits with clap's message on a usage error).
pub fn parse() -> Cli {
    match try_parse_from(std::env::args_os()) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    }
}

/// Parses arguments, keeping the command-line order of `aip dispatch`'s `--step`, `--tool`
/// and `--args` (clap's derive alone loses how they interleave).
pub fn try_parse_from<I, T>(args: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let matches = Cli::command().try_get_matches_from(args)?;
    let mut cli = Cli::from_arg_matches(&matches)?;
    if let (Command::Dispatch(args), Some(("dispatch", sub))) =
        (&mut cli.command, matches.subcommand())
    {
        let indexed = |id: &str, values: &[String]| -> Vec<(usize, String)> {
            sub.indices_of(id)
                .map(|indices| indices.zip(values.iter().cloned()).collect())
                .unwrap_or_default()
        };
        args.step_sources = crate::steps::order(
            indexed("steps", &args.steps),
            indexed("tools", &args.tools),
            indexed("args", &args.args),
        )
        .map_err(|e| {
            Cli::command().error(clap::error::ErrorKind::ArgumentConflict, e.to_string())
        })?;
    }
    Ok(cli)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn dispatch_keeps_steps_and_tools_in_order() {
        let cli = try_parse_from([
            "aip",
            "dispatch",
            "--capability",
            "demo",
            "--tool",
            "echo",
            "--args",
            r#"{"text":"hi"}"#,
            "--step",
            r#"[{"tool_name":"sleep","tool_type":"action"}]"#,
            "--tool",
            "list_tools",
            "say hi",
        ])
        .expect("parses");
        let Command::Dispatch(args) = cli.command else {
            panic!("dispatch expected")
        };
        assert_eq!(args.request, "say hi");
        assert_eq!(
            args.step_sources,
            [
                StepSource::Tool {
                    name: "echo".into(),
                    args: Some(r#"{"text":"hi"}"#.into())
                },
                StepSource::Json(r#"[{"tool_name":"sleep","tool_type":"action"}]"#.into()),
                StepSource::Tool {
                    name: "list_tools".into(),
                    args: None
                },
            ]
        );
    }

    #[test]
    fn dispatch_needs_a_target_or_a_capability() {
        let err = try_parse_from(["aip", "dispatch", "x"]).expect_err("no placement");
        assert_eq!(err.kind(), clap::error::ErrorKind::MissingRequiredArgument);
    }

    #[test]
    fn args_without_a_tool_are_refused() {
        let err = try_parse_from([
            "aip", "dispatch", "--target", "pc", "--args", "{}", "--tool", "echo", "x",
        ])
        .expect_err("--args before any --tool");
        assert!(err.to_string().contains("--args"), "{err}");
    }
}
