//! The scenarios, one module each, and what they share: the run's context, the start gate
//! that lets every client set up before the measured window opens, the window itself (time
//! and /proc figures) and the per-client outcome that is merged at the end.

pub(crate) mod connect;
pub(crate) mod devinfo;
pub(crate) mod heartbeat;
pub(crate) mod register;
pub(crate) mod rest;
pub(crate) mod tasks;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::args::Scenario;
use crate::monitor::Monitor;
use crate::progress::Progress;
use crate::report::{
    ConnectFigures, DeviceFigures, LatencySummary, ProcessUsage, SecondFigures, Verification,
};
use crate::rest::Rest;
use crate::stats::{Failures, Latency, Timeline};
use crate::target::Target;

/// What every client of a run shares (cheap to clone: one per client task).
#[derive(Clone)]
pub(crate) struct Ctx {
    pub target: Arc<Target>,
    /// The run's load ends here, whatever is left.
    pub deadline: Instant,
    /// `--max-seconds`, for messages.
    pub max_seconds: u64,
    /// The longest wait for one answer.
    pub timeout: Duration,
    /// Prefix of every client id.
    pub prefix: Arc<str>,
    /// Random per run: makes session ids and task names unique even with a fixed prefix.
    pub nonce: Arc<str>,
    /// Progress counters.
    pub progress: Arc<Progress>,
    /// Broker processes to sample.
    pub pids: Arc<[u32]>,
    /// The REST client, for scenarios that use it.
    pub rest: Option<Rest>,
    /// How long the event-log check may take.
    pub verify_for: Duration,
    /// When the run started (the report's `started_at`; second 0 of its timeline).
    pub started: Instant,
}

impl Ctx {
    /// Whether the run's time is up.
    pub fn expired(&self) -> bool {
        Instant::now() >= self.deadline
    }
}

/// What a scenario measured, before it becomes a [`crate::Report`].
pub(crate) struct Measured {
    pub unit: &'static str,
    pub expected: u64,
    pub completed: u64,
    pub failures: Failures,
    pub window_secs: f64,
    /// Overrides `completed / window_secs`.
    pub throughput: Option<f64>,
    pub latencies: Vec<LatencySummary>,
    pub timeline: Vec<SecondFigures>,
    pub broker: Vec<ProcessUsage>,
    pub generator: ProcessUsage,
    pub connect: Option<ConnectFigures>,
    pub verification: Option<Verification>,
    pub devices: Option<DeviceFigures>,
    pub stopped_early: Option<String>,
}

/// Runs one scenario.
pub(crate) async fn run(ctx: &Ctx, scenario: &Scenario) -> anyhow::Result<Measured> {
    match scenario {
        Scenario::Connect(args) => connect::run(ctx, args).await,
        Scenario::Heartbeat(args) => heartbeat::run(ctx, args).await,
        Scenario::Register(args) => register::run(ctx, args).await,
        Scenario::Devinfo(args) => devinfo::run(ctx, args).await,
        Scenario::Tasks(args) => tasks::run(ctx, args).await,
        Scenario::Rest(args) => rest::run(ctx, args).await,
    }
}

/// One client's results, merged into the run's at the end.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    /// Operations that succeeded.
    pub completed: u64,
    /// Operations (or the client's setup) that failed.
    pub failures: Failures,
    /// The scenario's main latency.
    pub latency: Latency,
    /// The main operation's completions, second by second.
    pub timeline: Timeline,
    /// A second latency some scenarios keep (register: REGISTER alone; tasks: the ack).
    pub second: Latency,
    /// The client stopped because the run's time was up.
    pub stopped: bool,
    /// Ids of what completed (tasks), for the event-log check.
    pub ids: Vec<String>,
}

impl Outcome {
    /// Adds another client's.
    pub fn merge(&mut self, other: Outcome) {
        self.completed += other.completed;
        self.failures.merge(other.failures);
        self.latency.merge(&other.latency);
        self.timeline.merge(&other.timeline);
        self.second.merge(&other.second);
        self.stopped |= other.stopped;
        self.ids.extend(other.ids);
    }

    /// A success of the main operation, which took `elapsed` and completed now.
    pub fn success(&mut self, elapsed: Duration, ctx: &Ctx) {
        self.completed += 1;
        self.latency.record(elapsed);
        self.timeline.record(ctx.started.elapsed(), elapsed);
        ctx.progress.done();
    }

    pub fn failure(&mut self, reason: impl std::fmt::Display, progress: &Progress) {
        self.failures.add(reason);
        progress.failed();
    }
}

/// Lets clients set up (connect, register) before the measured window opens, then starts
/// them all at once.
#[derive(Clone)]
pub(crate) struct Gate {
    ready: mpsc::UnboundedSender<()>,
    go: watch::Receiver<bool>,
}

/// The scenario's side of the [`Gate`].
pub(crate) struct Starter {
    ready: mpsc::UnboundedReceiver<()>,
    go: watch::Sender<bool>,
    clients: usize,
}

impl Gate {
    /// A gate for `clients` clients.
    pub fn new(clients: usize) -> (Starter, Gate) {
        let (ready_tx, ready_rx) = mpsc::unbounded_channel();
        let (go_tx, go_rx) = watch::channel(false);
        (
            Starter {
                ready: ready_rx,
                go: go_tx,
                clients,
            },
            Gate {
                ready: ready_tx,
                go: go_rx,
            },
        )
    }

    /// Says this client is set up (or gave up), then waits for the start; false if the run
    /// is abandoned.
    pub async fn ready_then_wait(mut self) -> bool {
        let _ = self.ready.send(());
        drop(self.ready);
        self.go.wait_for(|go| *go).await.is_ok()
    }

    /// Says this client gave up (setup failed): it does not wait.
    pub fn give_up(self) {
        let _ = self.ready.send(());
    }
}

impl Starter {
    /// Waits until every client is set up (or the deadline).
    pub async fn all_ready(&mut self, deadline: Instant) {
        let mut seen = 0;
        while seen < self.clients {
            match tokio::time::timeout_at(deadline, self.ready.recv()).await {
                Ok(Some(())) => seen += 1,
                // Every gate is gone, or time is up: start whoever is there.
                Ok(None) | Err(_) => return,
            }
        }
    }

    /// Opens the gate.
    pub fn go(&self) {
        let _ = self.go.send(true);
    }
}

/// The measured window: its length and the processes' figures over it.
pub(crate) struct Window {
    monitor: Monitor,
    started: Instant,
}

/// What a window measured.
pub(crate) struct WindowFigures {
    pub secs: f64,
    pub broker: Vec<ProcessUsage>,
    pub generator: ProcessUsage,
}

impl Window {
    /// Opens the window: first /proc readings, sampling starts.
    pub fn open(ctx: &Ctx) -> Window {
        Window {
            monitor: Monitor::start(&ctx.pids),
            started: Instant::now(),
        }
    }

    /// Time since it opened.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Closes it.
    pub async fn close(self) -> WindowFigures {
        let secs = self.started.elapsed().as_secs_f64();
        let (broker, generator) = self.monitor.finish().await;
        WindowFigures {
            secs,
            broker,
            generator,
        }
    }
}

/// Waits for every client task; a task that panicked counts as one failure.
pub(crate) async fn join_all(mut set: JoinSet<Outcome>) -> Outcome {
    let mut total = Outcome::default();
    while let Some(joined) = set.join_next().await {
        match joined {
            Ok(outcome) => total.merge(outcome),
            Err(e) => total.failures.add(format!("client task failed: {e}")),
        }
    }
    total
}

/// The text of `stopped_early` when the run's time ran out.
pub(crate) fn out_of_time(ctx: &Ctx, stopped: bool) -> Option<String> {
    stopped.then(|| {
        format!(
            "--max-seconds ({} s) reached before every operation was done",
            ctx.max_seconds
        )
    })
}
