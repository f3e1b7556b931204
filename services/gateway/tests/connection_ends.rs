//! Which connection ends the gateway announces to the session service (the frames stream):
//! the end of a connection that sent a frame on, or was sent one; not the end of one that only
//! registered and left. A frame that comes later for a connection the gateway no longer holds
//! brings that connection's end at once, so a task placed on it ends as if the end had been
//! announced. Both backends; the test reads the frames stream itself (no session service).

mod common;

use std::time::Duration;

use aip_bus::{Headers, StreamSpec, names};
use aip_testkit::frames::{client, device_register};
use aip_testkit::{Backend, Options, Stack, both_backends};
use common::{Ws, agent, registered, until_offline};
use futures::StreamExt;
use proto_schemas::Subjects;
use proto_schemas::sessions::{ConnectionClosed, GatewayEvent};
use serde_json::json;

/// The ends read from the frames stream (alone or gathered), in stream order, by one
/// consumer for the whole test (the in-process bus delivers each message once).
struct Ends {
    stored: aip_bus::DurableSubscription,
    read: Vec<ConnectionClosed>,
}

impl Ends {
    async fn open(stack: &Stack, subjects: &Subjects) -> Ends {
        let stored = stack
            .bus
            .consume(subjects.frames_stream(), "test".to_owned(), 64)
            .await
            .expect("consume");
        Ends {
            stored,
            read: Vec::new(),
        }
    }

    /// Reads until `count` ends were read, then for `more` (anything else that comes).
    async fn read(&mut self, count: usize, more: Duration) -> &[ConnectionClosed] {
        let patience = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            let until = if self.read.len() >= count {
                tokio::time::Instant::now() + more
            } else {
                patience
            };
            let Ok(next) = tokio::time::timeout_at(until, self.stored.next()).await else {
                break;
            };
            let delivery = next.expect("subscribed").expect("delivered");
            match serde_json::from_slice(&delivery.message.payload).expect("an event") {
                GatewayEvent::Closed(closed) => self.read.push(closed),
                GatewayEvent::ClosedMany(many) => self.read.extend(many.connections),
                GatewayEvent::Frame(_) | GatewayEvent::FramesMany(_) => {}
            }
            delivery.ack().await.expect("acked");
        }
        assert!(
            self.read.len() >= count,
            "{} ends of {count}: {:?}",
            self.read.len(),
            self.read
        );
        &self.read
    }
}

/// A gateway and a registry without a session service, the frames stream made, and a reader
/// of the ends stored in it.
async fn gateway_alone(backend: Backend) -> (Stack, Subjects, Ends) {
    let options = Options {
        sessions: false,
        ..Options::default()
    };
    let stack = Stack::start(backend, options).await.expect("stack");
    let subjects = Subjects::new(&stack.prefix).expect("prefix");
    stack
        .bus
        .ensure_stream(StreamSpec::new(
            subjects.frames_stream(),
            vec![subjects.frames_all()],
        ))
        .await
        .expect("frames stream");
    let stored = Ends::open(&stack, &subjects).await;
    (stack, subjects, stored)
}

/// A command for `connection` of `client`, as the session service sends one to the gateway
/// the registry names (no acknowledgement asked).
async fn command_for(
    stack: &Stack,
    subjects: &Subjects,
    gateway: &str,
    client: &str,
    connection: &str,
) {
    stack
        .bus
        .publish(
            subjects.deliver(gateway),
            Headers::new()
                .with(names::CLIENT, client)
                .with(names::CONNECTION, connection),
            r#"{"type":"command"}"#.as_bytes().to_vec().into(),
        )
        .await
        .expect("published");
}

/// The connection id the registry holds for `id`.
async fn connection_of(stack: &Stack, id: &str) -> String {
    let record = agent(&stack.registry_url(), id).await.expect("known");
    record["connection_id"]
        .as_str()
        .expect("a connection id")
        .to_owned()
}

async fn only_connections_the_session_service_may_know_have_their_end_announced(backend: Backend) {
    let (stack, subjects, mut stored) = gateway_alone(backend).await;
    let url = stack.ws_url(0);
    let gateway = stack.gateways[0].id.clone();

    // Registers, heartbeats, leaves: nothing passed between it and the session service.
    let mut quiet = registered(&url, &device_register("quiet", "linux")).await;
    quiet.heartbeat("quiet", "device").await;
    let quiet_connection = connection_of(&stack, "quiet").await;
    quiet.close().await;
    until_offline(&stack, "quiet").await;

    // Sends a frame on to the session service.
    let mut talker = registered(&url, &device_register("talker", "linux")).await;
    let talker_connection = connection_of(&stack, "talker").await;
    talker
        .send(&client(json!({
            "type": "task_end", "status": "completed", "client_id": "talker",
            "session_id": "s-1", "result": {}
        })))
        .await;
    // Sent one: a frame written to it.
    let mut listener = registered(&url, &device_register("listener", "linux")).await;
    let listener_connection = connection_of(&stack, "listener").await;
    stack
        .bus
        .publish(
            subjects.deliver(&gateway),
            Headers::new().with(names::CLIENT, "listener"),
            r#"{"type":"heartbeat","status":"ok"}"#.as_bytes().to_vec().into(),
        )
        .await
        .expect("published");
    let frame = listener.recv().await.expect("the frame written");
    assert_eq!(frame["type"], "heartbeat", "{frame}");

    // Both close; then their ends are in the stream, and none of `quiet`.
    talker.close().await;
    listener.close().await;
    let ends = stored.read(2, Duration::from_millis(300)).await.to_vec();
    let mut announced: Vec<&str> = ends.iter().map(|e| e.connection_id.as_str()).collect();
    announced.sort_unstable();
    let mut expected = vec![talker_connection.as_str(), listener_connection.as_str()];
    expected.sort_unstable();
    assert_eq!(announced, expected, "{ends:?}");

    // A command for `quiet`'s connection, as if a task had been placed on it as it ended:
    // its end comes now, once however many frames come for it.
    for _ in 0..3 {
        command_for(&stack, &subjects, &gateway, "quiet", &quiet_connection).await;
    }
    let found = stored.read(3, Duration::from_millis(500)).await.to_vec();
    let quiet_ends: Vec<&ConnectionClosed> = found
        .iter()
        .filter(|e| e.connection_id == quiet_connection)
        .collect();
    assert_eq!(quiet_ends.len(), 1, "announced once: {found:?}");
    assert_eq!(quiet_ends[0].client_id, "quiet");
    assert_eq!(quiet_ends[0].gateway_id, gateway);
    stack.stop().await;
}

both_backends!(only_connections_the_session_service_may_know_have_their_end_announced);

/// A frame bound to an earlier connection of a client reaches its newer one: it is not
/// written (it would run a command twice), and the earlier connection's end is announced.
async fn a_frame_for_an_earlier_connection_brings_that_connections_end(backend: Backend) {
    let (stack, subjects, mut stored) = gateway_alone(backend).await;
    let url = stack.ws_url(0);
    let gateway = stack.gateways[0].id.clone();
    let first = registered(&url, &device_register("phone", "linux")).await;
    let earlier = connection_of(&stack, "phone").await;
    first.close().await;
    until_offline(&stack, "phone").await;
    let mut second: Ws = registered(&url, &device_register("phone", "linux")).await;
    command_for(&stack, &subjects, &gateway, "phone", &earlier).await;
    let ends = stored.read(1, Duration::from_millis(300)).await.to_vec();
    assert_eq!(ends.len(), 1, "{ends:?}");
    assert_eq!(ends[0].connection_id, earlier);
    assert_eq!(ends[0].client_id, "phone");
    second
        .idle(Duration::from_millis(300))
        .await
        .expect("nothing written to the newer connection");
    stack.stop().await;
}

both_backends!(a_frame_for_an_earlier_connection_brings_that_connections_end);
