//! `tasks`: D devices of the bench that answer every command at once; C constellations, each
//! registered for one device (round robin), each running M tasks one after another. With
//! several gateways every constellation is on another gateway than its device
//! ([`crate::target::Target::peer_gateway`]), so every task crosses gateways. A task is a UFO
//! TASK frame whose `metadata.steps` holds K steps of one `echo` Command each (see
//! [`crate::wire::echo_steps`]); it is timed from sending TASK to receiving its `task_end`.
//! Afterwards every completed task's event log is checked over REST.

use std::sync::Arc;

use serde_json::value::RawValue;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{Ctx, Gate, Measured, Outcome, Window, join_all, out_of_time};
use crate::args::TasksArgs;
use crate::conn::{Conn, WireError};
use crate::devices::Fleet;
use crate::target::Gateway;
use crate::verify::verify;
use crate::wire::{self, Inbound};

pub(crate) async fn run(ctx: &Ctx, args: &TasksArgs) -> anyhow::Result<Measured> {
    let fleet = Fleet::start(ctx, args.devices).await?;
    ctx.progress
        .phase("registering constellations", args.clients as u64);
    let metadata: Arc<RawValue> = Arc::from(wire::task_metadata(args.commands));
    let (mut starter, gate) = Gate::new(args.clients);
    let mut set = JoinSet::new();
    let device_count = fleet.ids().len();
    for c in 0..args.clients {
        // Constellation c drives device d, from another gateway than d's when there are two
        // or more.
        let d = c % device_count;
        let gateway = ctx.target.peer_gateway(d, c / device_count).clone();
        set.spawn(client(
            ctx.clone(),
            c,
            fleet.ids()[d].clone(),
            gateway,
            args.count,
            metadata.clone(),
            gate.clone(),
        ));
    }
    drop(gate);
    starter.all_ready(ctx.deadline).await;
    let expected = (args.clients * args.count) as u64;
    let window = Window::open(ctx);
    ctx.progress.phase("tasks", expected);
    starter.go();
    let mut outcome = join_all(set).await;
    let figures = window.close().await;
    let (devices, drops) = fleet.stop().await;
    let mut failures = std::mem::take(&mut outcome.failures);
    for drop in drops {
        failures.add(drop);
    }
    let verification = match (&ctx.rest, args.no_verify) {
        (Some(rest), false) => {
            let ids = std::mem::take(&mut outcome.ids);
            Some(
                verify(
                    rest,
                    ids,
                    args.commands,
                    Instant::now() + ctx.verify_for,
                    &ctx.progress,
                )
                .await,
            )
        }
        _ => None,
    };
    Ok(Measured {
        unit: "tasks",
        expected,
        completed: outcome.completed,
        failures,
        window_secs: figures.secs,
        throughput: None,
        latencies: vec![
            outcome.latency.summary("task (TASK → task_end)"),
            outcome.second.summary("acknowledgement (TASK → heartbeat)"),
        ],
        timeline: outcome.timeline.figures(),
        broker: figures.broker,
        generator: figures.generator,
        connect: None,
        verification,
        devices: Some(devices),
        stopped_early: out_of_time(ctx, outcome.stopped),
    })
}

/// Constellation `c`: registers on `gateway` for `device`, then runs its tasks.
async fn client(
    ctx: Ctx,
    c: usize,
    device: String,
    gateway: Gateway,
    count: usize,
    metadata: Arc<RawValue>,
    gate: Gate,
) -> Outcome {
    let mut outcome = Outcome::default();
    let id = format!("{}-g{c}@{device}", ctx.prefix);
    let frame = wire::constellation_register(&id, &device);
    let mut conn = match Conn::registered(&gateway, frame, ctx.timeout, ctx.deadline).await {
        Ok(conn) => conn,
        Err(e) => {
            outcome.failure(format!("setup of {id}: {e}"), &ctx.progress);
            gate.give_up();
            return outcome;
        }
    };
    if !gate.ready_then_wait().await {
        conn.close().await;
        return outcome;
    }
    for m in 0..count {
        if ctx.expired() {
            outcome.stopped = true;
            break;
        }
        // Galaxy's form: session_id = "{task_name}@{task_id}".
        let task_name = format!("{}-c{c}-t{m}", ctx.prefix);
        let session_id = format!("{task_name}@{}", ctx.nonce);
        let frame = wire::constellation_task(&id, &device, &session_id, &task_name, &metadata);
        let started = Instant::now();
        if let Err(e) = conn.send(frame).await {
            outcome.failure(e, &ctx.progress);
            break;
        }
        match one_task(&ctx, &mut conn, &session_id, started, &mut outcome).await {
            TaskEnd::Completed => {
                outcome.success(started.elapsed(), &ctx);
                outcome.ids.push(session_id);
            }
            TaskEnd::Failed(reason) => outcome.failure(reason, &ctx.progress),
            TaskEnd::OutOfTime => {
                outcome.stopped = true;
                break;
            }
            TaskEnd::ConnectionLost(reason) => {
                outcome.failure(reason, &ctx.progress);
                break;
            }
        }
    }
    conn.close().await;
    outcome
}

/// How one task ended, as its requester saw it.
enum TaskEnd {
    Completed,
    Failed(String),
    OutOfTime,
    ConnectionLost(String),
}

/// Reads frames until this session's `task_end`. Frames of earlier sessions (late answers
/// after a timeout) are skipped; an ERROR about this session is kept as the reason in case no
/// `task_end` follows.
async fn one_task(
    ctx: &Ctx,
    conn: &mut Conn,
    session_id: &str,
    started: Instant,
    outcome: &mut Outcome,
) -> TaskEnd {
    let mut error: Option<String> = None;
    let mut acknowledged = false;
    loop {
        let text = match conn.recv(ctx.timeout, ctx.deadline).await {
            Ok(text) => text,
            Err(WireError::Deadline) => return TaskEnd::OutOfTime,
            Err(WireError::Timeout(t)) => {
                let reason = match error {
                    Some(e) => format!("{e} (and no task_end within {t:?})"),
                    None => format!("no task_end within {t:?}"),
                };
                return TaskEnd::Failed(reason);
            }
            Err(e) if e.is_fatal() => return TaskEnd::ConnectionLost(e.to_string()),
            Err(e) => return TaskEnd::Failed(e.to_string()),
        };
        let frame = match Inbound::parse(text.as_str()) {
            Ok(frame) => frame,
            Err(e) => return TaskEnd::Failed(e),
        };
        let ours = frame.session_id.as_deref() == Some(session_id);
        match frame.kind.as_ref() {
            "task_end" if ours => {
                return if frame.status_is("completed") {
                    TaskEnd::Completed
                } else {
                    TaskEnd::Failed(format!(
                        "task_end {}: {}",
                        frame.status.as_deref().unwrap_or("null"),
                        frame.error_text()
                    ))
                };
            }
            "heartbeat" if ours && !acknowledged => {
                acknowledged = true;
                outcome.second.record(started.elapsed());
            }
            "error" if ours || frame.session_id.is_none() => {
                error = Some(frame.error_text());
            }
            _ => {}
        }
    }
}
