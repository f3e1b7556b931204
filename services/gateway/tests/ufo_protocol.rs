//! UFO device and Galaxy constellation clients against the gateway, frames exactly as UFO's
//! own classes send them (`aip_testkit::frames`): registration, heartbeats, device info,
//! identity pinning, UFO's registration refusals, and two gateways on one bus. Every server
//! frame is checked against UFO's `ServerMessage` schema. Each test runs on NATS +
//! PostgreSQL and on the in-process bus + SQLite.

mod common;

use aip_testkit::frames::{self, constellation_register, device_info_request, device_register};
use aip_testkit::{Backend, Options, Stack, both_backends};
use common::{
    Ws, agent, assert_error, assert_registration_answer, online_clients, refused_registration,
    registered, until_offline, until_online,
};
use futures::StreamExt;
use serde_json::{Value, json};

fn options() -> Options {
    Options {
        sessions: false,
        ..Options::default()
    }
}

/// A stack of `gateways` gateways, the registry and no session service.
async fn with_gateways(backend: Backend, gateways: usize) -> Stack {
    Stack::start(
        backend,
        Options {
            gateways,
            ..options()
        },
    )
    .await
    .expect("stack")
}

/// A device-info request as a device would send it (`client_type` of the caller's choice).
fn device_info_request_as(id: &str, client_type: Value, target: &str, request_id: &str) -> Value {
    let mut frame = device_info_request(id, target, request_id);
    frame["client_type"] = client_type;
    frame
}

async fn devices_and_constellations_register_heartbeat_and_get_device_info(backend: Backend) {
    let stack = Stack::start(backend, options()).await.expect("stack");
    let url = stack.ws_url(0);

    // A UFO device: the first server frame is UFO's registration answer, exactly.
    let pc1_register = device_register("pc-1", "windows");
    let mut pc1 = registered(&url, &pc1_register).await;
    pc1.heartbeat("pc-1", "device").await;
    until_online(&stack, "pc-1").await;
    let mut pc2 = registered(&url, &device_register("pc-2", "linux")).await;
    until_online(&stack, "pc-2").await;

    // Galaxy: `{task_name}@{device}` bound to pc-1; its heartbeats say `client_type: device`.
    let mut galaxy = registered(&url, &constellation_register("galaxy@pc-1", Some("pc-1"))).await;
    galaxy.heartbeat("galaxy@pc-1", "device").await;
    galaxy.heartbeat("galaxy@pc-1", "constellation").await;

    // Device info of its own target: the system_info exactly as the device sent it.
    let request_id = "device_info_pc-1_1782464400";
    galaxy
        .send(&device_info_request("galaxy@pc-1", "pc-1", request_id))
        .await;
    let info = galaxy.recv_kind("device_info_response").await;
    assert_eq!(info["status"], "ok", "{info}");
    assert_eq!(info["response_id"], request_id, "{info}");
    assert_eq!(
        info["result"], pc1_register["metadata"]["system_info"],
        "system_info as the device sent it"
    );
    common::assert_timestamp(&info);

    // Bound to pc-1, asking for pc-2: refused, socket open.
    galaxy
        .send(&device_info_request(
            "galaxy@pc-1",
            "pc-2",
            "device_info_pc-2_1",
        ))
        .await;
    galaxy
        .expect_error(
            "FORBIDDEN",
            "Not authorized to request device info for this device",
        )
        .await;
    galaxy.heartbeat("galaxy@pc-1", "device").await;

    // From a device: refused, socket open; `client_type: null` counts as absent.
    for client_type in [json!("device"), Value::Null] {
        pc2.send(&device_info_request_as(
            "pc-2",
            client_type,
            "pc-1",
            "dev-req-1",
        ))
        .await;
        pc2.expect_error(
            "FORBIDDEN",
            "DEVICE_INFO_REQUEST is permitted only for constellation clients",
        )
        .await;
    }
    pc2.heartbeat("pc-2", "device").await;

    // A constellation without target_id may ask about any device; an unknown one is a
    // device_info_response with status error and the request's id (not a bare ERROR).
    let mut free = registered(&url, &constellation_register("free@any", None)).await;
    free.send(&device_info_request("free@any", "pc-2", "req-pc-2"))
        .await;
    let info = free.recv_kind("device_info_response").await;
    assert_eq!(info["status"], "ok", "{info}");
    assert_eq!(info["response_id"], "req-pc-2");
    assert_eq!(info["result"]["device_id"], "pc-2");
    assert_eq!(info["result"]["platform"], "linux");
    for (target, request_id) in [("ghost", "req-ghost"), ("galaxy@pc-1", "req-constellation")] {
        not_found(&mut free, "free@any", target, request_id).await;
    }

    // A device that left: its info is no longer served.
    pc2.close().await;
    until_offline(&stack, "pc-2").await;
    free.send(&device_info_request("free@any", "pc-2", "req-gone"))
        .await;
    let info = free.recv_kind("device_info_response").await;
    assert_eq!(info["status"], "error", "{info}");
    assert_eq!(info["response_id"], "req-gone");

    let mut online = online_clients(&stack.registry_url()).await;
    online.sort();
    assert_eq!(online, ["free@any", "galaxy@pc-1", "pc-1"]);
    pc1.heartbeat("pc-1", "device").await;
    stack.stop().await;
}
both_backends!(devices_and_constellations_register_heartbeat_and_get_device_info);

async fn identity_is_pinned_to_the_socket(backend: Backend) {
    let stack = Stack::start(backend, options()).await.expect("stack");
    let url = stack.ws_url(0);
    let mut pc = registered(&url, &device_register("pc-1", "windows")).await;
    let mut galaxy = registered(&url, &constellation_register("g@pc-1", Some("pc-1"))).await;

    // Another client's id in a later frame: ERROR, the socket stays open.
    pc.send(&frames::heartbeat("pc-2", "device")).await;
    pc.expect_error(
        "FORBIDDEN",
        "client_id does not match the registered connection",
    )
    .await;
    pc.heartbeat("pc-1", "device").await;
    galaxy
        .send(&device_info_request("pc-1", "pc-1", "spoofed"))
        .await;
    galaxy
        .expect_error(
            "FORBIDDEN",
            "client_id does not match the registered connection",
        )
        .await;

    // Another client_type (on anything but a heartbeat): ERROR, the socket stays open.
    pc.send(&device_info_request("pc-1", "pc-1", "as-constellation"))
        .await;
    pc.expect_error(
        "FORBIDDEN",
        "client_type does not match the registered connection",
    )
    .await;
    pc.heartbeat("pc-1", "device").await;

    // An absent or null client_id means the registered one.
    let mut anonymous = frames::heartbeat("pc-1", "device");
    anonymous["client_id"] = Value::Null;
    pc.send(&anonymous).await;
    common::assert_heartbeat_answer(&pc.recv().await.expect("heartbeat answer"));
    let mut request = device_info_request("g@pc-1", "pc-1", "no-id");
    request.as_object_mut().expect("object").remove("client_id");
    galaxy.send(&request).await;
    let info = galaxy.recv_kind("device_info_response").await;
    assert_eq!(info["status"], "ok", "{info}");
    assert_eq!(info["response_id"], "no-id");

    // A second REGISTER on a registered socket: UFO's `Unknown message type`.
    pc.send(&device_register("pc-1", "windows")).await;
    pc.expect_error(
        "PROTOCOL_ERROR",
        "Unknown message type: register (already registered)",
    )
    .await;
    // A client `error` frame is echoed back as a server ERROR.
    pc.send(&frames::client(json!({
        "type": "error", "status": "error", "client_id": "pc-1", "error": "something broke"
    })))
    .await;
    pc.expect_error("PROTOCOL_ERROR", "something broke").await;
    // A client device_info_response is ignored: the next answer is the heartbeat's.
    pc.send(&frames::client(json!({
        "type": "device_info_response", "status": "ok", "client_id": "pc-1"
    })))
    .await;
    pc.heartbeat("pc-1", "device").await;
    galaxy.heartbeat("g@pc-1", "device").await;
    stack.stop().await;
}
both_backends!(identity_is_pinned_to_the_socket);

async fn ufo_registration_refusals(backend: Backend) {
    let stack = Stack::start(backend, options()).await.expect("stack");
    let url = stack.ws_url(0);

    // A constellation whose target is not connected (never seen, or gone).
    let closed = refused_registration(
        &url,
        &constellation_register("g@nobody", Some("nobody")),
        "REGISTRATION_FAILED",
        "Target device 'nobody' is not connected",
    )
    .await;
    assert_eq!(closed.code, Some(1000), "{closed:?}");
    let gone = registered(&url, &device_register("gone", "windows")).await;
    until_online(&stack, "gone").await;
    gone.close().await;
    until_offline(&stack, "gone").await;
    refused_registration(
        &url,
        &constellation_register("g@gone", Some("gone")),
        "REGISTRATION_FAILED",
        "Target device 'gone' is not connected",
    )
    .await;
    // A constellation's target must be a device.
    let _free = registered(&url, &constellation_register("free@x", None)).await;
    until_online(&stack, "free@x").await;
    refused_registration(
        &url,
        &constellation_register("g@free", Some("free@x")),
        "REGISTRATION_FAILED",
        "Target device 'free@x' is not connected",
    )
    .await;
    assert!(agent(&stack.registry_url(), "g@nobody").await.is_none());

    // Without credentials nobody proves who they are: a second live connection with the same
    // id is refused with UFO's text, and the first one keeps working.
    let mut first = registered(&url, &device_register("pc-1", "windows")).await;
    until_online(&stack, "pc-1").await;
    let closed = refused_registration(
        &url,
        &device_register("pc-1", "windows"),
        "REGISTRATION_FAILED",
        "client_id 'pc-1' is already registered; duplicate registrations are not allowed",
    )
    .await;
    assert_eq!(closed.code, Some(1000), "{closed:?}");
    first.heartbeat("pc-1", "device").await;
    until_online(&stack, "pc-1").await;
    stack.stop().await;
}
both_backends!(ufo_registration_refusals);

/// A constellation asks about a device on another gateway: the registry names that gateway
/// the first time (and its record answers), then that gateway answers from its own table.
/// When the device moves on, the gateway it left says so and the registry is asked again.
async fn constellation_gets_device_info_across_gateways(backend: Backend) {
    let stack = with_gateways(backend, 3).await;
    let mut gets = registry_gets(&stack).await;
    let register = device_register("far-pc", "linux");
    let device = registered(&stack.ws_url(1), &register).await;
    until_online(&stack, "far-pc").await;
    let record = agent(&stack.registry_url(), "far-pc")
        .await
        .expect("registered");
    assert_eq!(record["gateway_id"], stack.gateways[1].id.as_str());

    let mut galaxy = registered(
        &stack.ws_url(0),
        &constellation_register("galaxy@far-pc", Some("far-pc")),
    )
    .await;
    for round in 1..=2 {
        found(&mut galaxy, "galaxy@far-pc", "far-pc", round, &register).await;
    }

    // The registry was asked about far-pc once: gateway 1 answered the second request from
    // its own table. Ids that are no device here are looked up in the registry (a
    // constellation on gateway 1, an id connected nowhere), and those are the next lookups.
    let mut free = registered(&stack.ws_url(0), &constellation_register("free@any", None)).await;
    let _far_galaxy = registered(&stack.ws_url(1), &constellation_register("g@far", None)).await;
    for (target, request_id) in [("g@far", "req-constellation"), ("ghost", "req-ghost")] {
        not_found(&mut free, "free@any", target, request_id).await;
    }
    for expected in ["far-pc", "g@far", "ghost"] {
        assert_eq!(next_get(&mut gets).await, expected);
    }

    // The id is held on gateway 1: another anonymous connection on gateway 0 is refused.
    let closed = refused_registration(
        &stack.ws_url(0),
        &register,
        "REGISTRATION_FAILED",
        "client_id 'far-pc' is already registered; duplicate registrations are not allowed",
    )
    .await;
    assert_eq!(closed.code, Some(1000), "{closed:?}");
    // Once it leaves gateway 1, it registers on gateway 0.
    let mut again = move_to(&stack, device, 0, &register).await;
    again.heartbeat("far-pc", "device").await;
    galaxy.heartbeat("galaxy@far-pc", "device").await;
    // Now on the constellation's own gateway: answered there.
    found(&mut galaxy, "galaxy@far-pc", "far-pc", 3, &register).await;

    // It moves to gateway 2. Gateway 0 still thinks gateway 1 holds it: gateway 1 says it does
    // not, the registry is asked once, and gateway 2 answers after that.
    let mut moved = move_to(&stack, again, 2, &register).await;
    for round in 4..=5 {
        found(&mut galaxy, "galaxy@far-pc", "far-pc", round, &register).await;
    }
    not_found(&mut free, "free@any", "ghost", "req-ghost-2").await;
    for expected in ["far-pc", "ghost"] {
        assert_eq!(next_get(&mut gets).await, expected);
    }
    moved.heartbeat("far-pc", "device").await;
    stack.stop().await;
}
both_backends!(constellation_gets_device_info_across_gateways);

/// Many constellations on gateway 0 ask at once about devices on gateway 1: each gets its own
/// device's answer, and each request reaches gateway 1 exactly once (requests on their way
/// together travel in one bus message, `DeviceInfoRequest`).
async fn many_constellations_ask_about_devices_on_another_gateway_at_once(backend: Backend) {
    let stack = with_gateways(backend, 2).await;
    let registers: Vec<Value> = ["far-a", "far-b"]
        .iter()
        .map(|id| device_register(id, "linux"))
        .collect();
    let mut devices = Vec::new();
    for register in &registers {
        devices.push(registered(&stack.ws_url(1), register).await);
    }
    for id in ["far-a", "far-b"] {
        until_online(&stack, id).await;
    }
    let mut askers = Vec::new();
    for i in 0..20 {
        let id = format!("c{i}@any");
        askers.push((
            registered(&stack.ws_url(0), &constellation_register(&id, None)).await,
            id,
        ));
    }
    // Gateway 0 learns from the registry that gateway 1 holds both.
    for (i, register) in registers.iter().enumerate() {
        let target = register["client_id"].as_str().expect("id");
        let (first, first_id) = &mut askers[0];
        found(first, first_id, target, i as u32, register).await;
    }

    let subjects = proto_schemas::Subjects::new(&stack.prefix).expect("prefix");
    let mut crossing = stack
        .bus
        .subscribe(subjects.deliver(&stack.gateways[1].id))
        .await
        .expect("subscribed");
    for round in 0..3 {
        for (i, (asker, id)) in askers.iter_mut().enumerate() {
            let target = registers[(i + round) % 2]["client_id"]
                .as_str()
                .expect("id");
            let request_id = format!("{id}-{round}");
            asker
                .send(&device_info_request(id, target, &request_id))
                .await;
        }
        for (i, (asker, id)) in askers.iter_mut().enumerate() {
            let register = &registers[(i + round) % 2];
            let info = asker.recv_kind("device_info_response").await;
            assert_eq!(info["status"], "ok", "{info}");
            assert_eq!(info["response_id"], format!("{id}-{round}"), "{info}");
            assert_eq!(
                info["result"], register["metadata"]["system_info"],
                "{info}"
            );
        }
    }
    let mut asked = 0;
    while let Ok(Some(message)) =
        tokio::time::timeout(std::time::Duration::from_millis(500), crossing.next()).await
    {
        assert_eq!(
            message.headers.get(aip_bus::names::CONTROL),
            Some(aip_bus::names::DEVICE_INFO)
        );
        asked += if message.payload.is_empty() {
            1
        } else {
            let request: proto_schemas::gateways::DeviceInfoRequest =
                serde_json::from_slice(&message.payload).expect("a DeviceInfoRequest");
            request.device_ids.len()
        };
    }
    assert_eq!(asked, 60, "each of the 60 requests crossed once");
    drop(devices);
    stack.stop().await;
}
both_backends!(many_constellations_ask_about_devices_on_another_gateway_at_once);

/// The device registered on `from` leaves it and registers on gateway `to`, and the registry
/// says it is held there.
async fn move_to(stack: &Stack, from: Ws, to: usize, register: &Value) -> Ws {
    let id = register["client_id"]
        .as_str()
        .expect("client_id")
        .to_owned();
    from.close().await;
    until_offline(stack, &id).await;
    let mut moved = Ws::connect(&stack.ws_url(to)).await;
    moved.send(register).await;
    assert_registration_answer(&moved.recv().await.expect("registration answer"));
    eventually_on_gateway(stack, &id, &stack.gateways[to].id).await;
    moved
}

/// `asker` asks about `target` and gets the system info it registered with.
async fn found(asker: &mut Ws, asker_id: &str, target: &str, round: u32, register: &Value) {
    let request_id = format!("device_info_{target}_{round}");
    asker
        .send(&device_info_request(asker_id, target, &request_id))
        .await;
    let info = asker.recv_kind("device_info_response").await;
    assert_eq!(info["status"], "ok", "round {round}: {info}");
    assert_eq!(info["response_id"], request_id.as_str());
    assert_eq!(info["result"], register["metadata"]["system_info"]);
}

/// The gateway answers device-info requests about its own devices itself, without a registry
/// request, with the system info as registered; about other devices, and once a device has
/// left, it asks the registry.
async fn device_info_of_a_device_on_the_same_gateway_does_not_ask_the_registry(backend: Backend) {
    let stack = Stack::start(backend, options()).await.expect("stack");
    let mut gets = registry_gets(&stack).await;
    let url = stack.ws_url(0);
    let register = device_register("pc-local", "linux");
    let device = registered(&url, &register).await;
    let mut galaxy = registered(&url, &constellation_register("free@any", None)).await;
    let mut ask = async |target: &str, request_id: &str| {
        galaxy
            .send(&device_info_request("free@any", target, request_id))
            .await;
        let info = galaxy.recv_kind("device_info_response").await;
        assert_eq!(info["response_id"], request_id, "{info}");
        info
    };
    for i in 0..3 {
        let info = ask("pc-local", &format!("local-{i}")).await;
        assert_eq!(info["status"], "ok", "{info}");
        assert_eq!(info["result"], register["metadata"]["system_info"]);
        common::assert_timestamp(&info);
    }
    // A device this gateway does not hold: the registry is asked, and that is its first
    // request (requests reach the subscription in the order they were sent).
    let ghost = ask("ghost", "ghost-1").await;
    assert_eq!(ghost["status"], "error", "{ghost}");
    assert_eq!(
        next_get(&mut gets).await,
        "ghost",
        "device info of pc-local came from the gateway"
    );

    device.close().await;
    until_offline(&stack, "pc-local").await;
    let gone = ask("pc-local", "gone-1").await;
    assert_eq!(gone["status"], "error", "{gone}");
    assert_eq!(gone["metadata"]["error_code"], "DEVICE_NOT_FOUND", "{gone}");
    assert_eq!(
        next_get(&mut gets).await,
        "pc-local",
        "after it left, the registry is asked"
    );
    stack.stop().await;
}
both_backends!(device_info_of_a_device_on_the_same_gateway_does_not_ask_the_registry);

/// A copy of every `registry.get` request, in the order they were sent.
async fn registry_gets(stack: &Stack) -> aip_bus::Subscription {
    let subjects = proto_schemas::Subjects::new(&stack.prefix).expect("prefix");
    stack
        .bus
        .subscribe(subjects.registry_get())
        .await
        .expect("subscribed")
}

/// The agent id of the next `registry.get` request.
async fn next_get(gets: &mut aip_bus::Subscription) -> Value {
    let message = tokio::time::timeout(aip_testkit::WAIT, futures::StreamExt::next(gets))
        .await
        .expect("a registry.get request")
        .expect("subscription open");
    let request: Value = serde_json::from_slice(&message.payload).expect("JSON");
    request["agent_id"].clone()
}

/// `asker` asks about `target` and gets UFO's "not found" device-info answer.
async fn not_found(asker: &mut Ws, asker_id: &str, target: &str, request_id: &str) {
    asker
        .send(&device_info_request(asker_id, target, request_id))
        .await;
    let info = asker.recv_kind("device_info_response").await;
    assert_eq!(info["status"], "error", "{info}");
    assert_eq!(info["response_id"], request_id, "{info}");
    assert_eq!(
        info["error"],
        format!("Device {target} not found or no system info available"),
        "{info}"
    );
    assert!(info["result"].is_null(), "{info}");
    assert_eq!(info["metadata"]["error_code"], "DEVICE_NOT_FOUND", "{info}");
}

async fn eventually_on_gateway(stack: &Stack, id: &str, gateway: &str) {
    let base = stack.registry_url();
    aip_testkit::eventually(&format!("{id} held by {gateway}"), || {
        let base = base.clone();
        async move {
            let record = agent(&base, id).await?;
            (record["gateway_id"] == gateway && record["status"] == "available").then_some(())
        }
    })
    .await
    .expect("moved");
}

#[test]
fn error_frames_and_answers_are_valid_ufo_server_messages() {
    // The schema check used on every received frame can fail.
    let bad = json!({"type": "command", "status": "continue", "actions": [{"tool_name": "x", "tool_type": "bogus"}]});
    assert!(std::panic::catch_unwind(|| common::assert_ufo_server_message(&bad)).is_err());
    let frame = serde_json::to_value(proto_schemas::server::error(
        proto_schemas::ErrorCode::Forbidden,
        "x",
    ))
    .expect("json");
    assert_error(&frame, "FORBIDDEN", "x");
    common::assert_ufo_server_message(&frame);
}
