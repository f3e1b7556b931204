//! `connect`: N devices connect and register (spread over the gateways round robin, at most
//! --setup-concurrency at once), then are held S seconds, each heartbeating every
//! --heartbeat-secs and answering pings. Reports the setup rate, connect and register
//! latencies, the connections the broker closed while they were held, and the broker's RSS
//! growth per connection (shared memory aside: PostgreSQL's shared buffers) and CPU over the
//! window (setup and hold), read at the end of the hold while every device is still
//! connected.
//!
//! Each device keeps its two setup latencies as plain numbers (no histogram per device:
//! thousands of them would cost the generator more than the broker).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{Ctx, Measured, Window, out_of_time};
use crate::args::ConnectArgs;
use crate::conn::{Conn, WireError};
use crate::report::ConnectFigures;
use crate::stats::{Failures, Latency};
use crate::wire;

/// How one device's setup went.
enum Setup {
    /// Registered: TCP + handshake time, REGISTER → confirmation time.
    Registered(Duration, Duration),
    /// Refused or failed.
    Failed(String),
    /// The run's time was up before it started.
    NotStarted,
}

pub(crate) async fn run(ctx: &Ctx, args: &ConnectArgs) -> anyhow::Result<Measured> {
    let n = args.n;
    let window = Window::open(ctx);
    ctx.progress
        .phase("connecting and registering devices", n as u64);
    let permits = Arc::new(Semaphore::new(args.setup_concurrency));
    let (setup_tx, mut setup_rx) = mpsc::unbounded_channel::<Setup>();
    let (stop_tx, stop_rx) = watch::channel(false);
    let heartbeats = Arc::new(AtomicU64::new(0));
    let every = Duration::from_secs(args.heartbeat_secs);
    let shared = Shared {
        permits,
        setup: setup_tx,
        stop: stop_rx,
        every,
        heartbeats: heartbeats.clone(),
    };
    let mut set = JoinSet::new();
    for i in 0..n {
        set.spawn(device(
            ctx.clone(),
            i,
            source_address(args.source_addresses, i),
            shared.clone(),
        ));
    }
    // The setup channel closes once every device has reported.
    drop(shared);

    let mut connect_latency = Latency::new();
    let mut register_latency = Latency::new();
    let mut failures = Failures::default();
    let mut connected: u64 = 0;
    let mut stopped = false;
    let mut answered = 0;
    while answered < n {
        let next = tokio::time::timeout_at(ctx.deadline, setup_rx.recv()).await;
        match next {
            Ok(Some(Setup::Registered(connect, register))) => {
                connected += 1;
                connect_latency.record(connect);
                register_latency.record(register);
            }
            Ok(Some(Setup::Failed(reason))) => failures.add(reason),
            Ok(Some(Setup::NotStarted)) => stopped = true,
            Ok(None) => break,
            Err(_) => {
                stopped = true;
                break;
            }
        }
        answered += 1;
    }
    let setup_secs = window.elapsed().as_secs_f64();

    ctx.progress
        .phase("holding devices (failed = dropped)", connected);
    ctx.progress.set_done(connected);
    let hold_started = Instant::now();
    let hold_until = (hold_started + Duration::from_secs(args.hold)).min(ctx.deadline);
    if hold_started + Duration::from_secs(args.hold) > ctx.deadline {
        stopped = true;
    }
    tokio::time::sleep_until(hold_until).await;
    let held_secs = hold_started.elapsed().as_secs_f64();
    // Read the processes while every device is still connected.
    let figures = window.close().await;

    let _ = stop_tx.send(true);
    let mut drops: u64 = 0;
    while let Some(joined) = set.join_next().await {
        match joined {
            Ok(Some(reason)) => {
                drops += 1;
                failures.add(format!("dropped while held: {reason}"));
            }
            Ok(None) => {}
            Err(e) => failures.add(format!("device task failed: {e}")),
        }
    }

    let rss_growth_kb: Option<i64> = (!figures.broker.is_empty())
        .then(|| {
            figures
                .broker
                .iter()
                .map(|p| p.private_growth_kb())
                .sum::<Option<i64>>()
        })
        .flatten();
    let rss_per_connection_bytes = rss_growth_kb
        .filter(|_| connected > 0)
        .map(|kb| kb as f64 * 1024.0 / connected as f64);
    let setup_per_sec = if setup_secs > 0.0 {
        connected as f64 / setup_secs
    } else {
        0.0
    };
    Ok(Measured {
        unit: "connections",
        expected: n as u64,
        completed: connected - drops.min(connected),
        failures,
        window_secs: figures.secs,
        throughput: Some(setup_per_sec),
        latencies: vec![
            register_latency.summary("REGISTER → confirmation"),
            connect_latency.summary("connect (TCP + WebSocket handshake)"),
        ],
        timeline: Vec::new(),
        broker: figures.broker,
        generator: figures.generator,
        connect: Some(ConnectFigures {
            requested: n as u64,
            connected,
            setup_secs,
            setup_per_sec,
            held_secs,
            heartbeats_sent: heartbeats.load(Ordering::Relaxed),
            drops,
            rss_per_connection_bytes,
        }),
        verification: None,
        devices: None,
        stopped_early: out_of_time(ctx, stopped),
    })
}

/// The `i`th device's source address: 127.0.0.1 to 127.0.0.`count`, round robin; `None`
/// (the kernel's choice) for one.
fn source_address(count: u8, i: usize) -> Option<std::net::IpAddr> {
    (count > 1).then(|| {
        let last = 1 + (i % usize::from(count)) as u8;
        std::net::IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, last))
    })
}

/// What every device shares with the run.
#[derive(Clone)]
struct Shared {
    /// Setups under way at once at most (`--setup-concurrency`).
    permits: Arc<Semaphore>,
    /// Where each device says how its setup went.
    setup: mpsc::UnboundedSender<Setup>,
    /// True once the hold is over.
    stop: watch::Receiver<bool>,
    /// Between two heartbeats of a device.
    every: Duration,
    /// Heartbeats sent by every device.
    heartbeats: Arc<AtomicU64>,
}

/// One device: set up, report, hold until stopped. `Some(reason)` if the broker closed it
/// while held.
async fn device(
    ctx: Ctx,
    i: usize,
    source: Option<std::net::IpAddr>,
    shared: Shared,
) -> Option<String> {
    let Shared {
        permits,
        setup,
        mut stop,
        every,
        heartbeats,
    } = shared;
    let id = format!("{}-idle-{i}", ctx.prefix);
    let permit = match tokio::time::timeout_at(ctx.deadline, permits.acquire_owned()).await {
        Ok(Ok(permit)) => permit,
        _ => {
            let _ = setup.send(Setup::NotStarted);
            return None;
        }
    };
    let started = Instant::now();
    let connected = tokio::time::timeout_at(
        ctx.deadline.min(started + ctx.timeout),
        Conn::connect_from(ctx.target.gateway(i), source),
    )
    .await;
    let mut conn = match connected {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => {
            ctx.progress.failed();
            let _ = setup.send(Setup::Failed(e.to_string()));
            return None;
        }
        Err(_) => {
            ctx.progress.failed();
            let _ = setup.send(Setup::Failed(WireError::Timeout(ctx.timeout).to_string()));
            return None;
        }
    };
    let handshake = started.elapsed();
    let sent = Instant::now();
    if let Err(e) = conn
        .register(wire::device_register(&id), ctx.timeout, ctx.deadline)
        .await
    {
        ctx.progress.failed();
        let _ = setup.send(match e {
            WireError::Deadline => Setup::NotStarted,
            e => Setup::Failed(e.to_string()),
        });
        return None;
    }
    let _ = setup.send(Setup::Registered(handshake, sent.elapsed()));
    drop(setup);
    drop(permit);
    ctx.progress.done();

    let mut heartbeat = tokio::time::interval(every);
    heartbeat.tick().await;
    loop {
        tokio::select! {
            frame = conn.next_text() => match frame {
                Ok(_) | Err(WireError::Unexpected(_)) => {}
                Err(e) => {
                    if *stop.borrow() {
                        return None;
                    }
                    ctx.progress.failed();
                    return Some(e.to_string());
                }
            },
            _ = heartbeat.tick() => {
                if let Err(e) = conn.send(wire::heartbeat(&id, "device")).await {
                    ctx.progress.failed();
                    return Some(e.to_string());
                }
                heartbeats.fetch_add(1, Ordering::Relaxed);
            }
            _ = stop.changed() => {
                conn.close().await;
                return None;
            }
        }
    }
}
