//! A gateway that dies says nothing: its agents go offline when their liveness expires, when
//! it starts again under the same id, or when their clients register again elsewhere, and the
//! tasks they execute must end then, not at their command timeout. The end of an older
//! connection never ends the tasks of a client's newer one. Frames for clients are sent again
//! until a gateway acknowledges writing them.

use std::time::Duration;

use aip_bus::registry::RegistryClient;
use aip_bus::{Headers, names};
use aip_testkit::{
    Backend, Options, Stack, both_backends, eventually, get_json, post_json, within,
};
use futures::StreamExt;
use proto_schemas::registry::RegisterAgent;
use proto_schemas::sessions::{ConnectionClosed, ConnectionsClosed, DeliveryAck, GatewayEvent};
use proto_schemas::{ClientType, Platform, Subjects, V1};
use serde_json::{Value, json};

/// A device registered by `principal` through `gateway` on `connection`, as the gateway
/// holding it would register it.
fn device(id: &str, gateway: &str, connection: &str, principal: &str) -> RegisterAgent {
    RegisterAgent::device(id, gateway, connection, principal, Platform::Linux)
}

fn registry_of(stack: &Stack) -> RegistryClient {
    let subjects = Subjects::new(&stack.prefix).expect("prefix");
    RegistryClient::new(stack.bus.clone(), subjects, Duration::from_secs(5))
}

/// A REST-driven task on `target`; its id.
async fn driven_task(stack: &Stack, target: &str) -> String {
    let body = json!({ "version": 1, "description": "driven", "originating_agent_id": "ops",
        "target_id": target, "driver": true });
    let (status, task) = post_json(&format!("{}/api/tasks", stack.sessions_url()), &body).await;
    assert_eq!(status, 201, "{task}");
    assert_eq!(task["state"], "dispatched", "{task}");
    task["task_id"].as_str().expect("an id").to_owned()
}

async fn task_state(stack: &Stack, id: &str) -> Value {
    get_json(&format!("{}/api/tasks/{id}", stack.sessions_url()))
        .await
        .1
}

/// Waits until the task has left `dispatched`, and returns it.
async fn ended(stack: &Stack, id: &str) -> Value {
    eventually("the task to end", || async {
        let task = task_state(stack, id).await;
        (task["state"] != "dispatched").then_some(task)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// A one-step `echo` task on `target` submitted over REST, with the frames for the clients of
/// `target`'s gateway watched on the bus from before: the frames, the body (to submit
/// another) and the task.
async fn echo_task_watched(
    stack: &Stack,
    target: &str,
    gateway: &str,
) -> (aip_bus::Subscription, Value, Value) {
    let subjects = Subjects::new(&stack.prefix).expect("prefix");
    let deliveries = stack
        .bus
        .subscribe(subjects.deliver(gateway))
        .await
        .expect("subscribe");
    let body = json!({ "version": 1, "description": "echo", "originating_agent_id": "ops",
        "target_id": target,
        "steps": [[{ "tool_name": "echo", "tool_type": "action", "parameters": {} }]] });
    let (status, task) = post_json(&format!("{}/api/tasks", stack.sessions_url()), &body).await;
    assert_eq!(status, 201, "{task}");
    (deliveries, body, task)
}

/// A stack whose gateways go dead after 2 s of silence, with device `id` registered through
/// a gateway that has never reported presence and never will (on `connection`, by
/// `principal`): what the registry holds of a gateway killed with `kill -9`.
async fn with_a_killed_gateways_device(
    backend: Backend,
    id: &str,
    connection: &str,
    principal: &str,
) -> Stack {
    let stack = Stack::start(
        backend,
        Options {
            liveness_ms: 2_000,
            ..Options::default()
        },
    )
    .await
    .expect("stack");
    registry_of(&stack)
        .register(&device(id, "gw-killed", connection, principal))
        .await
        .expect("registered");
    stack
}

async fn a_silent_gateways_agent_fails_its_tasks_when_its_liveness_expires(backend: Backend) {
    let stack = with_a_killed_gateways_device(backend, "orphan", "gw-killed:1", "test").await;

    let body = json!({ "version": 1, "description": "driven", "originating_agent_id": "ops",
        "target_id": "orphan", "driver": true });
    let (status, task) = post_json(&format!("{}/api/tasks", stack.sessions_url()), &body).await;
    assert_eq!(status, 201, "{task}");
    let id = task["task_id"].as_str().expect("an id").to_owned();
    assert_eq!(task["state"], "dispatched");

    let url = format!("{}/api/tasks/{id}", stack.sessions_url());
    let ended = eventually("the orphan's task to end", || async {
        let (_, task) = get_json(&url).await;
        (task["state"] != "dispatched").then_some(task)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ended["state"], "failed", "{ended}");
    assert_eq!(ended["error_code"], "CONNECTION_FAILED", "{ended}");

    let (_, events) = get_json(&format!("{url}/events")).await;
    let kinds: Vec<&str> = events["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["kind"].as_str())
        .collect();
    assert_eq!(kinds, ["submitted", "dispatched", "failed"], "{events}");
    stack.stop().await;
}

both_backends!(a_silent_gateways_agent_fails_its_tasks_when_its_liveness_expires);

/// Finding 2 of issue 14, same id: a gateway killed and started again under its configured id
/// tells the registry before it takes registrations. Its old connections end at once (not
/// after the 100 s agent window), their tasks fail, and the clients register again at once
/// instead of being refused as duplicates of themselves.
async fn a_gateway_restarted_under_its_id_ends_the_old_processes_connections(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let registry = registry_of(&stack);
    registry
        .register(&device("dev", "gw-same", "old-process:1", "anonymous"))
        .await
        .expect("registered");
    let id = driven_task(&stack, "dev").await;

    let refused = registry
        .register(&device("dev", "gw-same", "new-process:1", "anonymous"))
        .await
        .expect_err("still live: a duplicate until the gateway says it restarted");
    assert!(
        refused.to_string().contains("already registered"),
        "{refused}"
    );

    let ack = registry
        .gateway_started("gw-same")
        .await
        .expect("the registry answers");
    assert_eq!(ack.ended, 1);
    let task = ended(&stack, &id).await;
    assert_eq!(task["state"], "failed", "{task}");
    assert_eq!(task["error_code"], "CONNECTION_FAILED", "{task}");
    registry
        .register(&device("dev", "gw-same", "new-process:1", "anonymous"))
        .await
        .expect("registers again at once");
    let again = driven_task(&stack, "dev").await;
    assert_eq!(task_state(&stack, &again).await["state"], "dispatched");
    stack.stop().await;
}

both_backends!(a_gateway_restarted_under_its_id_ends_the_old_processes_connections);

/// Finding 2 of issue 14, new id: a client that registers again takes its id from the
/// connection a dead gateway held; that connection's end is announced, so its tasks end. A
/// late report of the old connection's end (a reaper, the old gateway's own) leaves the tasks
/// of the new connection alone.
async fn a_replaced_connections_tasks_end_and_a_late_end_spares_the_new_ones(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let registry = registry_of(&stack);
    registry
        .register(&device("dev", "gw-dead", "dead:1", "lab"))
        .await
        .expect("registered");
    registry
        .register(&device("witness", "gw-dead", "dead:2", "lab"))
        .await
        .expect("registered");
    let old = driven_task(&stack, "dev").await;

    let registered = registry
        .register(&device("dev", "gw-new", "new:1", "lab"))
        .await
        .expect("the same credential takes its id over");
    assert_eq!(registered.replaced_connection.as_deref(), Some("dead:1"));
    assert_eq!(registered.replaced_gateway.as_deref(), Some("gw-dead"));
    let task = ended(&stack, &old).await;
    assert_eq!(task["state"], "failed", "{task}");
    assert_eq!(task["error_code"], "CONNECTION_FAILED", "{task}");

    let new = driven_task(&stack, "dev").await;
    let witness = driven_task(&stack, "witness").await;
    // The old connection's end reported late, then a witness's end behind it in the stream:
    // once the witness's task ended, the late report has been applied.
    let subjects = Subjects::new(&stack.prefix).expect("prefix");
    for (client, connection, msg_id) in [
        ("dev", "dead:1", "late-report"),
        ("witness", "dead:2", "dead:2:closed"),
    ] {
        let event = GatewayEvent::Closed(ConnectionClosed {
            version: V1,
            gateway_id: "gw-dead".to_owned(),
            connection_id: connection.to_owned(),
            client_id: client.to_owned(),
            client_type: ClientType::Device,
            reason: "liveness_expired".to_owned(),
        });
        stack
            .bus
            .publish_durable(
                subjects.frames(client),
                Headers::new().with(names::MSG_ID, msg_id),
                serde_json::to_vec(&event).expect("json").into(),
            )
            .await
            .expect("stored");
    }
    assert_eq!(ended(&stack, &witness).await["state"], "failed");
    let new = task_state(&stack, &new).await;
    assert_eq!(
        new["state"], "dispatched",
        "the new connection keeps its task: {new}"
    );
    stack.stop().await;
}

both_backends!(a_replaced_connections_tasks_end_and_a_late_end_spares_the_new_ones);

/// A gateway reports connections that ended together in one `closed_many` event: the tasks
/// of every connection it names end, as if each end had come alone, and a client it does not
/// name keeps its task.
async fn ends_reported_together_end_each_connections_tasks(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let registry = registry_of(&stack);
    for (id, connection) in [("a", "gw-1:a"), ("b", "gw-1:b"), ("c", "gw-1:c")] {
        registry
            .register(&device(id, "gw-1", connection, "lab"))
            .await
            .expect("registered");
    }
    let tasks: Vec<String> =
        futures::future::join_all(["a", "b", "c"].map(|target| driven_task(&stack, target))).await;
    let closed = |client: &str| ConnectionClosed {
        version: V1,
        gateway_id: "gw-1".to_owned(),
        connection_id: format!("gw-1:{client}"),
        client_id: client.to_owned(),
        client_type: ClientType::Device,
        reason: "client closed the connection".to_owned(),
    };
    let event = GatewayEvent::ClosedMany(ConnectionsClosed {
        version: V1,
        connections: vec![closed("a"), closed("b")],
    });
    let subjects = Subjects::new(&stack.prefix).expect("prefix");
    stack
        .bus
        .publish_durable(
            subjects.frames("a"),
            Headers::new().with(names::MSG_ID, "gw-1:a:closed-many"),
            serde_json::to_vec(&event).expect("json").into(),
        )
        .await
        .expect("stored");
    for task in &tasks[..2] {
        let task = ended(&stack, task).await;
        assert_eq!(task["state"], "failed", "{task}");
        assert_eq!(task["error_code"], "CONNECTION_FAILED", "{task}");
    }
    // The two ends are applied (the tasks above ended): c's task is still on its way.
    let spared = task_state(&stack, &tasks[2]).await;
    assert_eq!(spared["state"], "dispatched", "{spared}");
    stack.stop().await;
}

both_backends!(ends_reported_together_end_each_connections_tasks);

/// Finding 3 of issue 14: a frame for a client leaves the outbox only when a gateway
/// acknowledges writing it. Here no gateway holds the client (as while NATS restarts), so the
/// command comes again, with the same id; once acknowledged, it stops coming.
async fn a_frame_for_a_client_is_sent_again_until_a_gateway_acknowledges_it(backend: Backend) {
    // `gw-1` never reports presence: the registry keeps its device online for the test's
    // length (an offline device's frames are not sent at all).
    let stack = Stack::start(
        backend,
        Options {
            liveness_ms: 120_000,
            ..Options::default()
        },
    )
    .await
    .expect("stack");
    let registry = registry_of(&stack);
    registry
        .register(&device("dev", "gw-1", "gw-1:1", "lab"))
        .await
        .expect("registered");
    let (mut deliveries, _, _) = echo_task_watched(&stack, "dev", "gw-1").await;

    // Every frame sent until one comes a second time: sent again, with the same id.
    let wait = Duration::from_secs(15);
    let mut seen = std::collections::HashMap::new();
    let (msg_id, ack_to) = loop {
        let frame = within(wait, "a frame for the device", deliveries.next())
            .await
            .expect("subscribed");
        assert_eq!(frame.headers.get(names::CLIENT), Some("dev"));
        let msg_id = frame.headers.get(names::MSG_ID).expect("an id").to_owned();
        let ack_to = frame
            .headers
            .get(names::ACK)
            .expect("where to ack")
            .to_owned();
        if let Some(payload) = seen.insert(msg_id.clone(), frame.payload.clone()) {
            assert_eq!(payload, frame.payload, "the same frame");
            break (msg_id, ack_to);
        }
    };
    let command: Value = serde_json::from_slice(&seen[&msg_id]).expect("json");
    assert_eq!(command["type"], "command", "{command}");

    for id in seen.keys() {
        stack.acknowledge_delivery(&ack_to, vec![id.clone()]).await;
    }
    // Copies already on their way may arrive; after the sweeps that follow, none does.
    let quiet = Duration::from_secs(8);
    let deadline = tokio::time::Instant::now() + quiet;
    let mut last_copy = None;
    while let Ok(Some(copy)) = tokio::time::timeout_at(deadline, deliveries.next()).await {
        let id = copy.headers.get(names::MSG_ID).expect("an id");
        assert!(seen.contains_key(id), "no new frame: {id}");
        last_copy = Some(tokio::time::Instant::now());
    }
    if let Some(at) = last_copy {
        assert!(
            deadline - at > Duration::from_secs(5),
            "copies kept coming after the acknowledgement"
        );
    }
    stack.stop().await;
}

both_backends!(a_frame_for_a_client_is_sent_again_until_a_gateway_acknowledges_it);

/// A command for a connection that died with its gateway (never acknowledged, so it is sent
/// again) must not reach the device's next connection, where it would run a second time for a
/// task that has failed: the fault harness's `gateway-kill-new-id` found one. The command names
/// its connection; the gateway holding the new one drops it and acknowledges it, and new
/// commands reach the new connection.
async fn a_command_for_a_dead_connection_never_reaches_the_next_one(backend: Backend) {
    // The device's first connection, on a gateway killed with `kill -9`.
    let stack = with_a_killed_gateways_device(backend, "dev", "killed:1", "anonymous").await;
    let (mut deliveries, body, task) = echo_task_watched(&stack, "dev", "gw-killed").await;
    let old = task["task_id"].as_str().expect("an id").to_owned();
    let first = within(Duration::from_secs(10), "the command", deliveries.next())
        .await
        .expect("subscribed");
    assert_eq!(
        first.headers.get(names::CONNECTION),
        Some("killed:1"),
        "the command names the connection its task is bound to"
    );
    let msg_id = first.headers.get(names::MSG_ID).expect("an id").to_owned();
    let ack_to = first
        .headers
        .get(names::ACK)
        .expect("where to ack")
        .to_owned();

    // The old connection's liveness runs out: the task fails.
    let ended = stack.task_ended(&old).await;
    assert_eq!(ended["error_code"], "CONNECTION_FAILED", "{ended}");

    // The device connects again through a live gateway. The unacknowledged command keeps
    // coming; that gateway drops it and says so.
    let mut acks = stack.bus.subscribe(ack_to).await.expect("subscribe");
    let mut device = aip_testkit::Client::registered(
        &stack.ws_url(0),
        aip_testkit::frames::device_register("dev", "linux"),
    )
    .await;
    within(Duration::from_secs(20), "the copy acknowledged", async {
        while let Some(ack) = acks.next().await {
            let ack: DeliveryAck = serde_json::from_slice(&ack.payload).expect("an ack");
            if ack.msg_ids.contains(&msg_id) {
                return;
            }
        }
    })
    .await;

    // A new task's command is the first command the device sees.
    let (status, task) = post_json(&format!("{}/api/tasks", stack.sessions_url()), &body).await;
    assert_eq!(status, 201, "{task}");
    let command = device.recv_type("command").await.expect("a command");
    assert_eq!(command["session_id"], task["task_id"], "{command}");
    stack.stop().await;
}

both_backends!(a_command_for_a_dead_connection_never_reaches_the_next_one);
