//! `devinfo`: D devices of the bench; C constellations, each registered for one device
//! (round robin), each sending M `device_info_request`s in a closed loop. The answer is the
//! `device_info_response` whose `response_id` is the request's `request_id`. With several
//! gateways every constellation is on another gateway than its device
//! ([`crate::target::Target::peer_gateway`]).

use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{Ctx, Gate, Measured, Outcome, Window, join_all, out_of_time};
use crate::args::DevinfoArgs;
use crate::conn::{Conn, WireError};
use crate::devices::Fleet;
use crate::target::Gateway;
use crate::wire::{self, Inbound};

pub(crate) async fn run(ctx: &Ctx, args: &DevinfoArgs) -> anyhow::Result<Measured> {
    let fleet = Fleet::start(ctx, args.devices).await?;
    ctx.progress
        .phase("registering constellations", args.clients as u64);
    let (mut starter, gate) = Gate::new(args.clients);
    let mut set = JoinSet::new();
    let device_count = fleet.ids().len();
    for c in 0..args.clients {
        // Constellation c drives device d, from another gateway than d's when there are two
        // or more.
        let d = c % device_count;
        let gateway = ctx.target.peer_gateway(d, c / device_count).clone();
        let device = fleet.ids()[d].clone();
        set.spawn(client(
            ctx.clone(),
            c,
            device,
            gateway,
            args.count,
            gate.clone(),
        ));
    }
    drop(gate);
    starter.all_ready(ctx.deadline).await;
    let expected = (args.clients * args.count) as u64;
    let window = Window::open(ctx);
    ctx.progress.phase("device-info requests", expected);
    starter.go();
    let outcome = join_all(set).await;
    let figures = window.close().await;
    let (devices, drops) = fleet.stop().await;
    let mut failures = outcome.failures;
    for drop in drops {
        failures.add(drop);
    }
    Ok(Measured {
        unit: "requests",
        expected,
        completed: outcome.completed,
        failures,
        window_secs: figures.secs,
        throughput: None,
        latencies: vec![outcome.latency.summary("device_info_request → response")],
        timeline: outcome.timeline.figures(),
        broker: figures.broker,
        generator: figures.generator,
        connect: None,
        verification: None,
        devices: Some(devices),
        stopped_early: out_of_time(ctx, outcome.stopped),
    })
}

/// Constellation `c`: registers on `gateway` for `device`, then sends its requests.
async fn client(
    ctx: Ctx,
    c: usize,
    device: String,
    gateway: Gateway,
    count: usize,
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
    'requests: for m in 0..count {
        if ctx.expired() {
            outcome.stopped = true;
            break;
        }
        let request_id = format!("device_info_{c}_{m}");
        let started = Instant::now();
        let frame = wire::device_info_request(&id, &device, &request_id);
        if let Err(e) = conn.send(frame).await {
            outcome.failure(e, &ctx.progress);
            break;
        }
        loop {
            let text = match conn.recv(ctx.timeout, ctx.deadline).await {
                Ok(text) => text,
                Err(WireError::Deadline) => {
                    outcome.stopped = true;
                    break 'requests;
                }
                Err(e) if e.is_fatal() => {
                    outcome.failure(e, &ctx.progress);
                    break 'requests;
                }
                Err(e) => {
                    outcome.failure(e, &ctx.progress);
                    continue 'requests;
                }
            };
            let frame = match Inbound::parse(text.as_str()) {
                Ok(frame) => frame,
                Err(e) => {
                    outcome.failure(e, &ctx.progress);
                    continue 'requests;
                }
            };
            match frame.kind.as_ref() {
                "device_info_response"
                    if frame.response_id.as_deref() == Some(request_id.as_str()) =>
                {
                    if frame.status_is("ok") {
                        outcome.success(started.elapsed(), &ctx);
                    } else {
                        outcome.failure(frame.error_text(), &ctx.progress);
                    }
                    continue 'requests;
                }
                "error" => {
                    outcome.failure(frame.error_text(), &ctx.progress);
                    continue 'requests;
                }
                // A late answer to an earlier request, or a heartbeat: not this one.
                _ => {}
            }
        }
    }
    conn.close().await;
    outcome
}
