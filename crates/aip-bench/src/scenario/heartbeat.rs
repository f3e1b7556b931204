//! `heartbeat`: C registered devices (spread over the gateways round robin), each sending M
//! heartbeats in a closed loop (send, wait for the server's heartbeat, send the next). The
//! server's heartbeat carries no correlation id: in a closed loop the next heartbeat frame is
//! the answer.

use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{Ctx, Gate, Measured, Outcome, Window, join_all, out_of_time};
use crate::args::HeartbeatArgs;
use crate::conn::{Conn, WireError};
use crate::wire::{self, Inbound};

pub(crate) async fn run(ctx: &Ctx, args: &HeartbeatArgs) -> anyhow::Result<Measured> {
    ctx.progress
        .phase("registering clients", args.clients as u64);
    let (mut starter, gate) = Gate::new(args.clients);
    let mut set = JoinSet::new();
    for i in 0..args.clients {
        set.spawn(client(ctx.clone(), i, args.count, gate.clone()));
    }
    drop(gate);
    starter.all_ready(ctx.deadline).await;
    let window = Window::open(ctx);
    ctx.progress
        .phase("heartbeat round trips", (args.clients * args.count) as u64);
    starter.go();
    let outcome = join_all(set).await;
    let figures = window.close().await;
    Ok(Measured {
        unit: "round trips",
        expected: (args.clients * args.count) as u64,
        completed: outcome.completed,
        failures: outcome.failures,
        window_secs: figures.secs,
        throughput: None,
        latencies: vec![outcome.latency.summary("heartbeat round trip")],
        timeline: outcome.timeline.figures(),
        broker: figures.broker,
        generator: figures.generator,
        connect: None,
        verification: None,
        devices: None,
        stopped_early: out_of_time(ctx, outcome.stopped),
    })
}

async fn client(ctx: Ctx, i: usize, count: usize, gate: Gate) -> Outcome {
    let mut outcome = Outcome::default();
    let id = format!("{}-hb-{i}", ctx.prefix);
    let mut conn = match Conn::registered(
        ctx.target.gateway(i),
        wire::device_register(&id),
        ctx.timeout,
        ctx.deadline,
    )
    .await
    {
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
    'rounds: for _ in 0..count {
        if ctx.expired() {
            outcome.stopped = true;
            break;
        }
        let started = Instant::now();
        if let Err(e) = conn.send(wire::heartbeat(&id, "device")).await {
            outcome.failure(e, &ctx.progress);
            break;
        }
        loop {
            let text = match conn.recv(ctx.timeout, ctx.deadline).await {
                Ok(text) => text,
                Err(WireError::Deadline) => {
                    outcome.stopped = true;
                    break 'rounds;
                }
                Err(e) if e.is_fatal() => {
                    outcome.failure(e, &ctx.progress);
                    break 'rounds;
                }
                Err(e) => {
                    outcome.failure(e, &ctx.progress);
                    continue 'rounds;
                }
            };
            match Inbound::parse(text.as_str()) {
                Ok(frame) if frame.kind == "heartbeat" => {
                    outcome.success(started.elapsed(), &ctx);
                    continue 'rounds;
                }
                Ok(frame) if frame.kind == "error" => {
                    outcome.failure(frame.error_text(), &ctx.progress);
                    continue 'rounds;
                }
                // Anything else is not for this loop.
                Ok(_) => {}
                Err(e) => {
                    outcome.failure(e, &ctx.progress);
                    continue 'rounds;
                }
            }
        }
    }
    conn.close().await;
    outcome
}
