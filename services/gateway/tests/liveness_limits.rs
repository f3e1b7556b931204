//! Liveness and limits: a registered client that neither sends frames nor answers pings is
//! closed and marked offline, while one that only answers pings stays; a client over the
//! frame rate gets RATE_LIMITED and, if it keeps on, is closed; a client that does not read
//! what it is sent is disconnected (past its outbound queue's frames or bytes, or with others
//! past the gateway's outbound budget) and gives its connection slot back. Others on the same
//! gateway are not disturbed. Both backends.

mod common;

use std::time::Duration;

use aip_bus::Headers;
use aip_testkit::frames::{self, device_register};
use aip_testkit::{Backend, Options, RunningGateway, Stack, both_backends, eventually};
use common::{Ws, agent_status, custom_gateway, registered, until_offline, until_online};
use proto_schemas::Subjects;
use serde_json::json;

/// Reads `ws` for `quiet` (so the gateway's pings get their pongs), failing on any frame.
fn read_quietly(mut ws: Ws, quiet: Duration) -> tokio::task::JoinHandle<anyhow::Result<Ws>> {
    tokio::spawn(async move {
        ws.idle(quiet).await?;
        Ok(ws)
    })
}

/// A stack without a session service, and a gateway of its own with `change` made to its
/// settings, holding two registered devices: `good`, which behaves, and `other`.
async fn gateway_with_two_clients(
    backend: Backend,
    other: &str,
    change: impl FnOnce(&mut aip_gateway::Settings),
) -> (Stack, RunningGateway, Ws, Ws) {
    let stack = Stack::start(
        backend,
        Options {
            sessions: false,
            ..Options::default()
        },
    )
    .await
    .expect("stack");
    let gateway = custom_gateway(&stack, change).await;
    let url = gateway.ws_url();
    let good = registered(&url, &device_register("good", "windows")).await;
    let other_client = registered(&url, &device_register(other, "windows")).await;
    until_online(&stack, other).await;
    (stack, gateway, good, other_client)
}

/// A heartbeat of 256 KiB, as the session service would deliver it to `slow` through
/// `gateway`.
async fn deliver_to_slow(stack: &Stack, gateway: &RunningGateway) {
    deliver_large(stack, gateway, "slow").await;
}

/// A heartbeat of 256 KiB, as the session service would deliver it to `client` through
/// `gateway`.
async fn deliver_large(stack: &Stack, gateway: &RunningGateway, client: &str) {
    static FRAME: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        let padding = "x".repeat(256 * 1024);
        json!({"type": "heartbeat", "status": "ok", "messages": [padding]}).to_string()
    });
    let subjects = Subjects::new(&stack.prefix).expect("prefix");
    stack
        .bus
        .publish(
            subjects.deliver(&gateway.id),
            Headers::new().with(aip_bus::names::CLIENT, client),
            FRAME.clone().into_bytes().into(),
        )
        .await
        .expect("published");
}

async fn a_client_silent_without_pongs_is_closed_and_goes_offline(backend: Backend) {
    let stack = Stack::start(
        backend,
        Options {
            sessions: false,
            client_liveness_ms: 1_500,
            ..Options::default()
        },
    )
    .await
    .expect("stack");
    let url = stack.ws_url(0);

    // Sends no frames but reads its socket, so it answers the gateway's pings.
    let quiet = registered(&url, &device_register("quiet", "windows")).await;
    // Quiet for well over twice the liveness window.
    let quiet_task = read_quietly(quiet, Duration::from_secs(4));
    // Sends no frames and never reads: no pongs either.
    let mut mute = registered(&url, &device_register("mute", "windows")).await;
    until_online(&stack, "mute").await;

    until_offline(&stack, "mute").await;
    let closed = mute.closed().await;
    assert_eq!(closed.code, Some(1001), "{closed:?}");
    assert_eq!(closed.reason, "no frames or pongs for 1500 ms");
    assert!(closed.frames.is_empty(), "{closed:?}");

    // The quiet one, without frames for longer than the window, is still connected.
    let mut quiet = quiet_task
        .await
        .expect("task")
        .expect("the client answering pings was not closed");
    assert_eq!(
        agent_status(&stack.registry_url(), "quiet")
            .await
            .as_deref(),
        Some("available")
    );
    quiet.heartbeat("quiet", "device").await;
    until_online(&stack, "quiet").await;

    // The silent client registers again and works.
    let mut back = registered(&url, &device_register("mute", "windows")).await;
    back.heartbeat("mute", "device").await;
    until_online(&stack, "mute").await;
    stack.stop().await;
}
both_backends!(a_client_silent_without_pongs_is_closed_and_goes_offline);

async fn frames_over_the_rate_are_refused_then_the_client_is_closed(backend: Backend) {
    let (stack, gateway, mut good, mut flood) =
        gateway_with_two_clients(backend, "flood", |s| s.gateway.frames_per_second = 5).await;
    let url = gateway.ws_url();

    let heartbeat = frames::heartbeat("flood", "device").to_string();
    for _ in 0..200 {
        if flood
            .try_send(tokio_tungstenite::tungstenite::Message::Text(
                heartbeat.as_str().into(),
            ))
            .await
            .is_err()
        {
            break;
        }
    }
    let closed = flood.closed().await;
    let refused = "frame refused: more than 5 frames per second; slow down";
    let mut answered = 0;
    let mut limited = 0;
    for frame in &closed.frames {
        if frame["type"] == "heartbeat" {
            common::assert_heartbeat_answer(frame);
            answered += 1;
        } else {
            common::assert_error(frame, "RATE_LIMITED", refused);
            limited += 1;
        }
    }
    // A full bucket holds twice the rate; the close comes after more than 10 refusals in a row.
    assert!(answered >= 10, "the burst is allowed: {closed:?}");
    assert!(limited >= 11, "then frames are refused: {closed:?}");
    assert_eq!(closed.code, Some(1008), "{closed:?}");
    assert_eq!(closed.reason, "rate limit exceeded persistently");
    until_offline(&stack, "flood").await;

    // The limit is per connection: a polite client is unaffected.
    for _ in 0..3 {
        good.heartbeat("good", "device").await;
    }
    let mut again = registered(&url, &device_register("flood", "windows")).await;
    again.heartbeat("flood", "device").await;
    gateway.stop().await;
    stack.stop().await;
}
both_backends!(frames_over_the_rate_are_refused_then_the_client_is_closed);

async fn a_client_that_does_not_read_is_disconnected_and_frees_its_slot(backend: Backend) {
    let (stack, gateway, mut good, mut slow) = gateway_with_two_clients(backend, "slow", |s| {
        // Room for 16 MiB of frames: the socket's buffers fill (the writer is stuck) long
        // before the queue does and the gateway gives up on the client.
        s.gateway.outbound_queue = 64;
        s.gateway.max_connections = 2;
    })
    .await;
    let url = gateway.ws_url();
    let full = Ws::refused(&url).await;
    assert_eq!(full.status, 503, "{full:?}");
    assert_eq!(
        full.body,
        json!({"detail": "connection limit of 2 reached; try another gateway", "error_code": "UNAVAILABLE"})
    );

    // Frames for `slow` pile up: 256 KiB each, until the gateway gives up on it.
    let base = stack.registry_url();
    let mut sent = 0;
    let started = tokio::time::Instant::now();
    loop {
        // Bounded by time, not by a count: on a fast machine the gateway may take in more
        // than the count before it gives up on the client and the registry hears of it.
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "`slow` was never disconnected ({sent} frames sent)"
        );
        if sent >= 2_000 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        deliver_to_slow(&stack, &gateway).await;
        sent += 1;
        if sent % 8 == 0 && agent_status(&base, "slow").await.as_deref() == Some("offline") {
            break;
        }
    }
    good.heartbeat("good", "device").await;

    // Its slot is given back although it still reads nothing.
    eventually(
        "a connection slot after the slow client was dropped",
        || {
            let url = url.clone();
            async move { Ws::try_connect(&url).await.ok() }
        },
    )
    .await
    .expect("the slow client's slot is free");

    // When it finally reads: some frames, then the end of the connection.
    let closed = slow.closed().await;
    if let Some(code) = closed.code {
        assert_eq!(code, 1008, "{closed:?}");
    }
    assert!(
        closed.frames.len() < sent,
        "{} of {sent}",
        closed.frames.len()
    );
    good.heartbeat("good", "device").await;
    until_online(&stack, "good").await;
    gateway.stop().await;
    stack.stop().await;
}
both_backends!(a_client_that_does_not_read_is_disconnected_and_frees_its_slot);

async fn a_client_that_does_not_read_is_disconnected_past_the_queue_bytes(backend: Backend) {
    let (stack, gateway, mut good, slow) = gateway_with_two_clients(backend, "slow", |s| {
        // Room for 100,000 frames, but for 8 MiB of them only: the bytes are the bound.
        s.gateway.outbound_queue = 100_000;
        s.gateway.outbound_queue_bytes = 8 << 20;
    })
    .await;

    // 1,000 frames of 256 KiB for `slow` (250 MiB, far within the frame count): the socket's
    // buffers take a few MiB, the queue 8 MiB, then the gateway gives up on the client.
    let sent = 1_000;
    for _ in 0..sent {
        deliver_to_slow(&stack, &gateway).await;
    }
    until_offline(&stack, "slow").await;
    good.heartbeat("good", "device").await;

    // When it finally reads: a part of the frames, then the end of the connection.
    closed_early(slow, "slow", sent).await;
    gateway.stop().await;
    stack.stop().await;
}
both_backends!(a_client_that_does_not_read_is_disconnected_past_the_queue_bytes);

/// Reads what `slow` (client `id`) was sent until the gateway closed it, which must have been
/// as too slow (1008, when a close frame got through) and before half of the `sent` frames.
async fn closed_early(mut slow: Ws, id: &str, sent: usize) {
    let closed = slow.closed().await;
    if let Some(code) = closed.code {
        assert_eq!(code, 1008, "{id}: {closed:?}");
    }
    assert!(
        closed.frames.len() < sent / 2,
        "{id}: {} of {sent} frames reached the client before it was closed",
        closed.frames.len()
    );
}

/// The value of `aip_gateway_slow_clients_closed_total{bound="…"}` at `gateway` (0 before the
/// first).
async fn slow_clients_closed(gateway: &RunningGateway, bound: &str) -> f64 {
    let text = reqwest::get(format!("http://{}/metrics", gateway.addr))
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("metrics text");
    let label = format!("bound=\"{bound}\"");
    text.lines()
        .filter(|l| l.starts_with("aip_gateway_slow_clients_closed_total{") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .next()
        .unwrap_or(0.0)
}

async fn slow_clients_together_are_disconnected_past_the_gateway_budget(backend: Backend) {
    let (stack, gateway, mut good, first) = gateway_with_two_clients(backend, "slow-1", |s| {
        // Each client may hold 64 MiB, but all of them together 8 MiB.
        s.gateway.outbound_queue = 100_000;
        s.gateway.outbound_queue_bytes = 64 << 20;
        s.gateway.max_outbound_bytes_queued = 8 << 20;
    })
    .await;
    let second = registered(&gateway.ws_url(), &device_register("slow-2", "windows")).await;
    until_online(&stack, "slow-2").await;

    // 200 frames of 256 KiB for each (50 MiB, within its own bound; 100 MiB together): the
    // sockets' buffers take a few MiB, the queues 8 MiB between them, then the gateway gives
    // up on a client behind, and later on the other.
    let sent = 200;
    for _ in 0..sent {
        for client in ["slow-1", "slow-2"] {
            deliver_large(&stack, &gateway, client).await;
        }
    }
    until_offline(&stack, "slow-1").await;
    until_offline(&stack, "slow-2").await;
    // At least: the metrics are the test process's, which may run the other backend's
    // variant of this test at the same time.
    assert!(
        slow_clients_closed(&gateway, "gateway_bytes").await >= 2.0,
        "both closed over the gateway's budget"
    );
    // What was queued for them is given back.
    eventually("the outbound budget given back", || async {
        (gateway.outbound.queued() == 0).then_some(())
    })
    .await
    .expect("nothing stays counted");
    good.heartbeat("good", "device").await;

    for (id, slow) in [("slow-1", first), ("slow-2", second)] {
        closed_early(slow, id, sent).await;
    }
    gateway.stop().await;
    stack.stop().await;
}
both_backends!(slow_clients_together_are_disconnected_past_the_gateway_budget);
