//! `register`: C clients (spread over the gateways round robin), each M times: connect,
//! REGISTER as a fresh device id, wait for the confirmation, close. No setup: the window is
//! the whole run.

use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{Ctx, Measured, Outcome, Window, join_all, out_of_time};
use crate::args::RegisterArgs;
use crate::conn::{Conn, WireError};
use crate::wire;

pub(crate) async fn run(ctx: &Ctx, args: &RegisterArgs) -> anyhow::Result<Measured> {
    let expected = (args.clients * args.count) as u64;
    let window = Window::open(ctx);
    ctx.progress.phase("registrations", expected);
    let mut set = JoinSet::new();
    for c in 0..args.clients {
        set.spawn(client(ctx.clone(), c, args.count));
    }
    let outcome = join_all(set).await;
    let figures = window.close().await;
    Ok(Measured {
        unit: "registrations",
        expected,
        completed: outcome.completed,
        failures: outcome.failures,
        window_secs: figures.secs,
        throughput: None,
        latencies: vec![
            outcome.latency.summary("connect + REGISTER → confirmation"),
            outcome.second.summary("REGISTER → confirmation"),
        ],
        timeline: outcome.timeline.figures(),
        broker: figures.broker,
        generator: figures.generator,
        connect: None,
        verification: None,
        devices: None,
        stopped_early: out_of_time(ctx, outcome.stopped),
    })
}

async fn client(ctx: Ctx, c: usize, count: usize) -> Outcome {
    let mut outcome = Outcome::default();
    for m in 0..count {
        if ctx.expired() {
            outcome.stopped = true;
            break;
        }
        let id = format!("{}-reg-{c}-{m}", ctx.prefix);
        let started = Instant::now();
        let connected = tokio::time::timeout_at(
            ctx.deadline.min(started + ctx.timeout),
            Conn::connect(ctx.target.gateway(c)),
        )
        .await;
        let mut conn = match connected {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => {
                outcome.failure(e, &ctx.progress);
                continue;
            }
            Err(_) if ctx.expired() => {
                outcome.stopped = true;
                break;
            }
            Err(_) => {
                outcome.failure(WireError::Timeout(ctx.timeout), &ctx.progress);
                continue;
            }
        };
        let sent = Instant::now();
        match conn
            .register(wire::device_register(&id), ctx.timeout, ctx.deadline)
            .await
        {
            Ok(()) => {
                outcome.second.record(sent.elapsed());
                outcome.success(started.elapsed(), &ctx);
                conn.close().await;
            }
            Err(WireError::Deadline) => {
                outcome.stopped = true;
                break;
            }
            Err(e) => outcome.failure(e, &ctx.progress),
        }
    }
    outcome
}
