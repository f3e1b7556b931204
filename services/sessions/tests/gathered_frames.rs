//! A gateway stores the frames its clients send together as one `frames_many` event; the
//! session service applies each frame as if it had come alone, once, whatever event carries
//! it: a frame stored again in another event (a gateway's retry, a redelivery) is skipped.

use std::time::Duration;

use aip_bus::registry::RegistryClient;
use aip_bus::{Headers, names};
use aip_testkit::frames::{constellation_task, one_step};
use aip_testkit::{Backend, Options, Stack, both_backends};
use futures::StreamExt;
use proto_schemas::registry::RegisterAgent;
use proto_schemas::sessions::{GatewayEvent, GatheredFrame, InboundFrame, InboundFrames};
use proto_schemas::{Platform, Subjects, V1};
use serde_json::{Value, json};

const GATEWAY: &str = "gw-gathered";

/// Task `session` of constellation `galaxy@dev`, as a gateway would store it: frame
/// `msg_id` of that constellation's connection.
fn task(session: &str, msg_id: &str) -> GatheredFrame {
    let frame = constellation_task(
        "galaxy@dev",
        "dev",
        session,
        "gathered",
        Some(one_step("echo", json!({ "session": session }))),
    );
    let inbound: InboundFrame = serde_json::from_value(json!({
        "version": 1, "gateway_id": GATEWAY, "connection_id": format!("{GATEWAY}:galaxy"),
        "client_id": "galaxy@dev", "client_type": "constellation", "platform": "linux",
        "received_at": "2026-11-27T00:00:00Z", "frame": frame,
    }))
    .expect("an inbound frame");
    GatheredFrame {
        msg_id: msg_id.to_owned(),
        traceparent: None,
        inbound,
    }
}

/// Stores `frames` in the frames stream as one `frames_many` event with message id `id`.
async fn store_together(stack: &Stack, id: &str, frames: Vec<GatheredFrame>) {
    let subjects = Subjects::new(&stack.prefix).expect("prefix");
    let event = GatewayEvent::FramesMany(InboundFrames {
        version: V1,
        frames,
    });
    stack
        .bus
        .publish_durable(
            subjects.frames("galaxy@dev"),
            Headers::new().with(names::MSG_ID, id),
            serde_json::to_vec(&event).expect("json").into(),
        )
        .await
        .expect("stored");
}

/// Each frame of a `frames_many` event is applied once: the tasks it starts get their
/// commands, and a frame carried again by a later event (with its own message id) is not
/// applied a second time.
async fn each_gathered_frame_is_applied_once(backend: Backend) {
    // `GATEWAY` never reports presence: the registry keeps its device online for the test's
    // length.
    let stack = Stack::start(
        backend,
        Options {
            liveness_ms: 120_000,
            ..Options::default()
        },
    )
    .await
    .expect("stack");
    let subjects = Subjects::new(&stack.prefix).expect("prefix");
    RegistryClient::new(stack.bus.clone(), subjects.clone(), Duration::from_secs(5))
        .register(&RegisterAgent::device(
            "dev",
            GATEWAY,
            &format!("{GATEWAY}:dev"),
            "test",
            Platform::Linux,
        ))
        .await
        .expect("registered");
    let mut deliveries = stack
        .bus
        .subscribe(subjects.deliver(GATEWAY))
        .await
        .expect("subscribe");

    store_together(
        &stack,
        "first:many",
        vec![task("a", "c:1"), task("b", "c:2")],
    )
    .await;
    // The same two frames again, and a new one, in another event.
    let again = vec![task("a", "c:1"), task("b", "c:2"), task("c", "c:3")];
    store_together(&stack, "second:many", again).await;

    // Every frame for the gateway's clients until task c's acknowledgement (the last frame
    // the events cause: their frames are applied in order), and for a moment after. The
    // device runs one task at a time: a's command goes out (again every few seconds, as the
    // test writes nothing), b and c wait for it.
    let mut frames: Vec<Value> = Vec::new();
    let mut c_acknowledged = false;
    loop {
        let wait = if c_acknowledged {
            Duration::from_millis(500)
        } else {
            Duration::from_secs(15)
        };
        let Ok(next) = tokio::time::timeout(wait, deliveries.next()).await else {
            assert!(c_acknowledged, "task c was never acknowledged: {frames:?}");
            break;
        };
        let message = next.expect("subscribed");
        let frame: Value = serde_json::from_slice(&message.payload).expect("a frame");
        c_acknowledged |= frame["session_id"] == "c" && frame["type"] == "heartbeat";
        frames.push(frame);
    }
    let of = |session: &str, kind: &str| -> Vec<&Value> {
        frames
            .iter()
            .filter(|f| f["session_id"] == session && f["type"] == kind)
            .collect()
    };
    for session in ["a", "b", "c"] {
        let all = frames.iter().filter(|f| f["session_id"] == session);
        let acks = of(session, "heartbeat");
        assert_eq!(
            acks.len(),
            1,
            "task {session} acknowledged once: {frames:?}"
        );
        let others: Vec<&Value> = all.filter(|f| f["type"] != "heartbeat").collect();
        let commands = of(session, "command");
        assert_eq!(others.len(), commands.len(), "task {session}: {others:?}");
        let mut distinct: Vec<&Value> = commands.iter().map(|c| &c["response_id"]).collect();
        distinct.dedup();
        let expected = usize::from(session == "a");
        assert_eq!(
            distinct.len(),
            expected,
            "task {session}: {expected} command (sent again maybe): {commands:?}"
        );
    }
    stack.stop().await;
}

both_backends!(each_gathered_frame_is_applied_once);
