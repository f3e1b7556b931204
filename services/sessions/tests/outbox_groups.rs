//! The frames one group commit sends are stored in the outbox together, in one row; a frame
//! leaves it only when a gateway acknowledges writing it. Of a group whose frames are not all
//! acknowledged, only those not acknowledged are sent again, each under its own id, and once
//! they are acknowledged nothing of the group is left.

use std::time::Duration;

use aip_bus::registry::RegistryClient;
use aip_bus::{Headers, names};
use aip_testkit::frames::{constellation_task, one_step};
use aip_testkit::{Backend, Options, Stack, both_backends};
use futures::StreamExt;
use proto_schemas::registry::RegisterAgent;
use proto_schemas::sessions::{GatewayEvent, InboundFrame};
use proto_schemas::{ClientType, Platform, Subjects};
use serde_json::{Value, json};

/// A gateway that never reports presence (the registry keeps its clients online for the
/// test's length) and acknowledges only what the test says.
const GATEWAY: &str = "gw-outbox";

/// Outbox rows of each payload kind: (`frames` groups, rows of one frame).
async fn outbox_rows(db: &aip_store::Database) -> (i64, i64) {
    let count = |kind: &str| {
        aip_store::Sql::render(move |_| {
            format!("SELECT COUNT(*) FROM task_outbox WHERE payload_kind = '{kind}'")
        })
    };
    let (groups,): (i64,) = db
        .query(&count("frames"))
        .fetch_one()
        .await
        .expect("counts");
    let (alone,): (i64,) = db.query(&count("frame")).fetch_one().await.expect("counts");
    (groups, alone)
}

/// Waits (up to 10 s) until the outbox holds `expected` rows ([`outbox_rows`]).
async fn until_outbox_holds(db: &aip_store::Database, expected: (i64, i64), what: &str) {
    aip_testkit::eventually_within(Duration::from_secs(10), what, || async {
        (outbox_rows(db).await == expected).then_some(())
    })
    .await
    .expect("the outbox holds what it should");
}

async fn only_unacknowledged_frames_of_a_group_are_sent_again(backend: Backend) {
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
    let registry = RegistryClient::new(stack.bus.clone(), subjects.clone(), Duration::from_secs(5));
    let device = RegisterAgent::device(
        "dev",
        GATEWAY,
        &format!("{GATEWAY}:dev"),
        "test",
        Platform::Linux,
    );
    let constellation = RegisterAgent {
        agent_id: "galaxy@dev".to_owned(),
        client_type: ClientType::Constellation,
        connection_id: format!("{GATEWAY}:galaxy"),
        ..device.clone()
    };
    for agent in [&device, &constellation] {
        registry.register(agent).await.expect("registered");
    }
    let mut deliveries = stack
        .bus
        .subscribe(subjects.deliver(GATEWAY))
        .await
        .expect("subscribe");
    let db = aip_store::Database::connect(&stack.database_url)
        .await
        .expect("the stack's database");

    // The constellation's task: its acknowledgement and the device's command are sent by one
    // group commit.
    let inbound: InboundFrame = serde_json::from_value(json!({
        "version": 1, "gateway_id": GATEWAY, "connection_id": format!("{GATEWAY}:galaxy"),
        "client_id": "galaxy@dev", "client_type": "constellation", "platform": "linux",
        "received_at": "2026-11-28T00:00:00Z",
        "frame": constellation_task("galaxy@dev", "dev", "s1", "grouped",
            Some(one_step("echo", json!({})))),
    }))
    .expect("an inbound frame");
    stack
        .bus
        .publish_durable(
            subjects.frames("galaxy@dev"),
            Headers::new().with(names::MSG_ID, "galaxy:1"),
            serde_json::to_vec(&GatewayEvent::Frame(inbound))
                .expect("json")
                .into(),
        )
        .await
        .expect("stored");

    let mut next = async |what: &str| {
        let message = tokio::time::timeout(Duration::from_secs(15), deliveries.next())
            .await
            .unwrap_or_else(|_| panic!("{what} did not come"))
            .expect("subscribed");
        let frame: Value = serde_json::from_slice(&message.payload).expect("a frame");
        let id = message
            .headers
            .get(names::MSG_ID)
            .expect("an id")
            .to_owned();
        let ack_to = message
            .headers
            .get(names::ACK)
            .expect("where to ack")
            .to_owned();
        (frame, id, ack_to)
    };
    let (first, first_id, ack_to) = next("the first frame").await;
    let (second, second_id, _) = next("the second frame").await;
    let kinds = [&first["type"], &second["type"]];
    let (heartbeat, command) = match kinds {
        [a, b] if a == "heartbeat" && b == "command" => (first_id, second_id),
        [a, b] if a == "command" && b == "heartbeat" => (second_id, first_id),
        _ => panic!("an acknowledgement and a command: {first} {second}"),
    };
    assert_eq!(outbox_rows(&db).await, (1, 0), "both frames in one row");

    // The acknowledgement is written; the command is not (the device's gateway is away).
    stack.acknowledge_delivery(&ack_to, vec![heartbeat]).await;
    let (again, again_id, _) = next("the command, again").await;
    assert_eq!(
        again["type"], "command",
        "only the command comes again: {again}"
    );
    assert_eq!(again_id, command, "under its id");
    until_outbox_holds(
        &db,
        (0, 1),
        "the group is gone; the command waits in a row of its own",
    )
    .await;

    stack
        .acknowledge_delivery(&ack_to, vec![command.clone()])
        .await;
    until_outbox_holds(&db, (0, 0), "everything acknowledged").await;
    // No copy comes after the sweeps that follow.
    if let Ok(Some(copy)) = tokio::time::timeout(Duration::from_secs(7), deliveries.next()).await {
        let id = copy.headers.get(names::MSG_ID).unwrap_or_default();
        assert_eq!(id, command, "nothing but a copy already on its way");
        assert!(
            tokio::time::timeout(Duration::from_secs(7), deliveries.next())
                .await
                .is_err(),
            "copies kept coming after the acknowledgement"
        );
    }
    stack.stop().await;
}

both_backends!(only_unacknowledged_frames_of_a_group_are_sent_again);
