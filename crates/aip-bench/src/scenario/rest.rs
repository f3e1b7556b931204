//! `rest`: the tasks of `tasks`, submitted with `POST /api/tasks` (target round robin over
//! the bench's D devices, which are spread over the gateways; `steps` = K `echo` steps) by C
//! workers, each following its task to the end by polling `GET /api/tasks/{id}` (1 ms, then
//! doubling up to --poll-max-ms). Latency is from the POST to seeing the task completed, so
//! it includes up to one polling pause. Afterwards every completed task's event log is
//! checked.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use proto_schemas::sessions::TaskState;
use serde_json::json;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{Ctx, Measured, Outcome, Window, join_all, out_of_time};
use crate::args::RestArgs;
use crate::devices::Fleet;
use crate::rest::Rest;
use crate::verify::verify;
use crate::wire;

pub(crate) async fn run(ctx: &Ctx, args: &RestArgs) -> anyhow::Result<Measured> {
    let rest = ctx
        .rest
        .clone()
        .ok_or_else(|| anyhow::anyhow!("the rest scenario needs --rest"))?;
    let fleet = Fleet::start(ctx, args.devices).await?;
    let devices: Arc<[String]> = Arc::from(fleet.ids().to_vec());
    let next = Arc::new(AtomicUsize::new(0));
    let expected = args.count as u64;
    let window = Window::open(ctx);
    ctx.progress.phase("REST tasks", expected);
    let mut set = JoinSet::new();
    for _ in 0..args.concurrency {
        set.spawn(worker(
            ctx.clone(),
            rest.clone(),
            devices.clone(),
            next.clone(),
            args.clone(),
        ));
    }
    let mut outcome = join_all(set).await;
    let figures = window.close().await;
    let (device_figures, drops) = fleet.stop().await;
    let mut failures = std::mem::take(&mut outcome.failures);
    for drop in drops {
        failures.add(drop);
    }
    let verification = if args.no_verify {
        None
    } else {
        let ids = std::mem::take(&mut outcome.ids);
        let until = Instant::now() + ctx.verify_for;
        Some(verify(&rest, ids, args.commands, until, &ctx.progress).await)
    };
    Ok(Measured {
        unit: "tasks",
        expected,
        completed: outcome.completed,
        failures,
        window_secs: figures.secs,
        throughput: None,
        latencies: vec![
            outcome.latency.summary("task (POST → seen completed)"),
            outcome.second.summary("POST /api/tasks"),
        ],
        timeline: outcome.timeline.figures(),
        broker: figures.broker,
        generator: figures.generator,
        connect: None,
        verification,
        devices: Some(device_figures),
        stopped_early: out_of_time(ctx, outcome.stopped),
    })
}

async fn worker(
    ctx: Ctx,
    rest: Rest,
    devices: Arc<[String]>,
    next: Arc<AtomicUsize>,
    args: RestArgs,
) -> Outcome {
    let mut outcome = Outcome::default();
    let steps = serde_json::to_value(wire::echo_steps(args.commands)).unwrap_or_default();
    let poll_max = Duration::from_millis(args.poll_max_ms);
    loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= args.count {
            break;
        }
        if ctx.expired() {
            outcome.stopped = true;
            break;
        }
        // A TaskRequest (proto_schemas::flow), written as JSON so that fields added to the
        // type later keep their defaults here.
        let request = json!({
            "version": 1,
            "description": "aip bench: echo",
            "originating_agent_id": "aip-bench",
            "target_id": devices[i % devices.len()],
            "task_name": format!("{}-r{i}-{}", ctx.prefix, ctx.nonce),
            "steps": steps,
        });
        let started = Instant::now();
        let created = match rest.submit(&request).await {
            Ok(view) => view,
            Err(e) => {
                outcome.failure(e, &ctx.progress);
                continue;
            }
        };
        outcome.second.record(started.elapsed());
        let give_up = (started + ctx.timeout).min(ctx.deadline);
        let mut view = created;
        let mut pause = Duration::from_millis(1);
        let mut lost = None;
        while !view.state.is_terminal() {
            if Instant::now() + pause > give_up {
                break;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(poll_max);
            match rest.task(&view.task_id).await {
                Ok(v) => view = v,
                Err(e) => {
                    lost = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = lost {
            outcome.failure(format!("following {}: {e}", view.task_id), &ctx.progress);
            continue;
        }
        match view.state {
            TaskState::Completed => {
                outcome.success(started.elapsed(), &ctx);
                outcome.ids.push(view.task_id);
            }
            state if state.is_terminal() => outcome.failure(
                format!(
                    "task {}: {}",
                    state.as_str(),
                    view.error.as_deref().unwrap_or("no error text")
                ),
                &ctx.progress,
            ),
            // The run's end came before the task's: it was cut short, not slow.
            _ if give_up == ctx.deadline || ctx.expired() => {
                outcome.stopped = true;
                break;
            }
            state => outcome.failure(
                format!("task still {} after {:?}", state.as_str(), ctx.timeout),
                &ctx.progress,
            ),
        }
    }
    outcome
}
