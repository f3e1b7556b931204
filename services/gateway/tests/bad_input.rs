//! Bad input gets its documented answer, and nobody else notices.
//!
//! Each malformed frame gets an ERROR with `metadata.error_code` and the precise text of
//! `proto_schemas::parse_client_frame` (before REGISTER: then a close); a frame over the limit
//! a close 1009; ids full of NATS subject characters and emoji work end to end; a client
//! that never registers is closed at the deadline, pings or not. Throughout, a well-behaved
//! client on the same gateway keeps heartbeating. Both backends.

mod common;

use std::time::Duration;

use aip_testkit::frames::{self, constellation_register, device_info_request, device_register};
use aip_testkit::{Backend, Options, Stack, both_backends};
use common::{Ws, refused_registration, registered, until_offline, until_online};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;

const FRAME_LIMIT: usize = 64 * 1024;

fn options() -> Options {
    Options {
        sessions: false,
        max_frame_bytes: Some(FRAME_LIMIT),
        ..Options::default()
    }
}

/// The text `parse_client_frame` gives for `raw` (which must be refused).
fn parse_error(raw: &str) -> String {
    match proto_schemas::parse_client_frame(raw.as_bytes()) {
        Ok(frame) => panic!("expected {raw} to be refused, got {frame:?}"),
        Err(e) => e.to_string(),
    }
}

async fn malformed_frames_after_register_get_precise_errors(backend: Backend) {
    let stack = Stack::start(backend, options()).await.expect("stack");
    let url = stack.ws_url(0);
    let mut good = registered(&url, &device_register("good", "windows")).await;
    let mut bad = registered(&url, &device_register("bad", "windows")).await;
    until_online(&stack, "bad").await;

    let heartbeat_with = |fields: Value| {
        let mut frame = frames::heartbeat("bad", "device");
        for (k, v) in fields.as_object().expect("object") {
            frame[k] = v.clone();
        }
        frame.to_string()
    };
    let cases: Vec<(String, &str)> = vec![
        // Invalid JSON.
        (
            "{".to_owned(),
            "invalid frame: not valid JSON: EOF while parsing an object at line 1 column 1",
        ),
        (
            "hello there".to_owned(),
            "invalid frame: not valid JSON: expected value at line 1 column 1",
        ),
        (
            "[1]".to_owned(),
            "invalid frame: a frame must be a JSON object, got an array",
        ),
        (
            format!("{} trailing", frames::heartbeat("bad", "device")),
            "",
        ),
        // Wrong field types.
        (
            heartbeat_with(json!({"client_id": 5})),
            "heartbeat frame: field `client_id`: invalid type: integer `5`, expected a string",
        ),
        (
            heartbeat_with(json!({"metadata": "x"})),
            "heartbeat frame: field `metadata`: invalid type: string \"x\", expected a map",
        ),
        (
            heartbeat_with(json!({"type": 7})),
            "invalid frame: field `type`: must be a string, got a number",
        ),
        (
            heartbeat_with(json!({"client_type": "robot"})),
            "heartbeat frame: field `client_type`: unknown variant `robot`, expected `device` or `constellation`",
        ),
        // Unknown or wrongly cased enum values, missing required fields.
        (heartbeat_with(json!({"type": "hello"})), ""),
        (heartbeat_with(json!({"type": "Heartbeat"})), ""),
        (heartbeat_with(json!({"status": "OK"})), ""),
        (heartbeat_with(json!({"status": null})), ""),
        (
            heartbeat_with(json!({"type": "task_end", "status": "ok", "session_id": "s"})),
            "task_end frame: field `status`: must be `completed` or `failed`, got `ok`",
        ),
        (heartbeat_with(json!({"type": "device_info_request"})), ""),
    ];
    for (raw, literal) in &cases {
        let expected = parse_error(raw);
        if !literal.is_empty() {
            assert_eq!(&expected, literal, "parse_client_frame's text for {raw}");
        }
        bad.send_text(raw).await;
        bad.expect_error("PROTOCOL_ERROR", &expected).await;
        good.heartbeat("good", "device").await;
    }
    assert!(
        parse_error(&heartbeat_with(json!({"type": "hello"})))
            .starts_with("invalid frame: field `type`: unknown frame type `hello`; expected one of `task`, `heartbeat`, ")
    );
    bad.heartbeat("bad", "device").await;

    // A binary frame: an ERROR, the socket stays open.
    bad.send_binary(br#"{"type":"heartbeat","status":"ok"}"#.to_vec())
        .await;
    bad.expect_error(
        "PROTOCOL_ERROR",
        "binary frames are not supported: send each AIP frame as JSON in a text frame",
    )
    .await;
    bad.heartbeat("bad", "device").await;
    good.heartbeat("good", "device").await;

    // Just under the limit: an answer. Over it: FRAME_TOO_LARGE and close 1009.
    let mut padded = frames::heartbeat("bad", "device");
    padded["metadata"]["padding"] = json!("");
    let room = FRAME_LIMIT - padded.to_string().len();
    padded["metadata"]["padding"] = json!("x".repeat(room));
    assert_eq!(padded.to_string().len(), FRAME_LIMIT);
    bad.send(&padded).await;
    common::assert_heartbeat_answer(&bad.recv().await.expect("a frame at the limit is read"));
    padded["metadata"]["padding"] = json!("x".repeat(room + 1));
    bad.send(&padded).await;
    let closed = bad.closed().await;
    assert_eq!(closed.code, Some(1009), "{closed:?}");
    assert_eq!(
        closed.reason,
        format!("frame larger than the limit of {FRAME_LIMIT} bytes")
    );
    assert_eq!(closed.frames.len(), 1, "{closed:?}");
    common::assert_error(
        &closed.frames[0],
        "FRAME_TOO_LARGE",
        &format!("frame larger than the limit of {FRAME_LIMIT} bytes"),
    );
    until_offline(&stack, "bad").await;
    good.heartbeat("good", "device").await;
    until_online(&stack, "good").await;
    stack.stop().await;
}
both_backends!(malformed_frames_after_register_get_precise_errors);

async fn the_first_frame_must_be_a_valid_register(backend: Backend) {
    let stack = Stack::start(backend, options()).await.expect("stack");
    let url = stack.ws_url(0);
    let mut good = registered(&url, &device_register("good", "windows")).await;

    let closed = refused_registration(
        &url,
        &frames::heartbeat("early", "device"),
        "PROTOCOL_ERROR",
        "the first frame must be `register`, got `heartbeat`",
    )
    .await;
    assert_eq!(closed.code, Some(1002), "{closed:?}");
    good.heartbeat("good", "device").await;

    let long = "x".repeat(10_000);
    let no_id = frames::client(json!({"type": "register", "status": "ok"}));
    let mut empty_id = device_register("", "windows");
    empty_id["client_id"] = json!("");
    let mut macos = device_register("mac", "windows");
    macos["metadata"]["platform"] = json!("macos");
    let mut bad_info = device_register("info", "windows");
    bad_info["metadata"]["system_info"] = json!("not an object");
    let cases: Vec<(Value, &str)> = vec![
        (
            no_id,
            "registration refused: register frame: field `client_id`: is required and must be a non-empty string",
        ),
        (
            empty_id,
            "registration refused: register frame: field `client_id`: is required and must be a non-empty string",
        ),
        (
            device_register(&long, "windows"),
            "registration refused: register frame: field `client_id`: is 10000 bytes long; ids may be at most 256 bytes",
        ),
        (
            device_register("line\nbreak", "windows"),
            "registration refused: register frame: field `client_id`: must not contain control characters",
        ),
        (macos, ""),
        (
            bad_info,
            "registration refused: register frame: field `metadata.system_info`: must be an object, got a string",
        ),
    ];
    for (frame, literal) in &cases {
        let expected = format!("registration refused: {}", parse_error(&frame.to_string()));
        if !literal.is_empty() {
            assert_eq!(&expected, literal);
        }
        let closed = refused_registration(&url, frame, "PROTOCOL_ERROR", &expected).await;
        assert_eq!(closed.code, Some(1002), "{closed:?}");
        good.heartbeat("good", "device").await;
    }
    refused_registration(
        &url,
        &json!("not an object"),
        "PROTOCOL_ERROR",
        "registration refused: invalid frame: a frame must be a JSON object, got a string",
    )
    .await;

    // A binary first frame: an ERROR, then a close.
    let mut ws = Ws::connect(&url).await;
    ws.send_binary(device_register("bin", "windows").to_string().into_bytes())
        .await;
    ws.expect_error(
        "PROTOCOL_ERROR",
        "binary frames are not supported: send each AIP frame as JSON in a text frame",
    )
    .await;
    let closed = ws.closed().await;
    assert_eq!(closed.code, Some(1002), "{closed:?}");

    // A first frame over the limit: FRAME_TOO_LARGE, close 1009.
    let mut huge = device_register("huge", "windows");
    huge["metadata"]["padding"] = json!("x".repeat(FRAME_LIMIT));
    let mut ws = Ws::connect(&url).await;
    ws.send(&huge).await;
    let closed = ws.closed().await;
    assert_eq!(closed.code, Some(1009), "{closed:?}");
    assert_eq!(closed.frames.len(), 1, "{closed:?}");
    common::assert_error(
        &closed.frames[0],
        "FRAME_TOO_LARGE",
        &format!("frame larger than the limit of {FRAME_LIMIT} bytes"),
    );

    // An id of exactly 256 bytes (here 64 four-byte emoji) is fine.
    let longest = "😀".repeat(64);
    assert_eq!(longest.len(), 256);
    let mut ok = registered(&url, &device_register(&longest, "linux")).await;
    ok.heartbeat(&longest, "device").await;
    until_online(&stack, &longest).await;
    for id in ["early", "mac", "info", "bin", "huge", "line\nbreak"] {
        assert!(
            common::agent(&stack.registry_url(), id).await.is_none(),
            "{id}"
        );
    }
    good.heartbeat("good", "device").await;
    stack.stop().await;
}
both_backends!(the_first_frame_must_be_a_valid_register);

async fn ids_with_subject_characters_and_emoji_work(backend: Backend) {
    let stack = Stack::start(backend, options()).await.expect("stack");
    let url = stack.ws_url(0);
    let mut good = registered(&url, &device_register("good", "windows")).await;
    let ids = [
        "lab.pc.1",
        "pc*",
        "pc>",
        "*",
        ">",
        ".",
        "pc 1",
        "pc/1",
        "task@pc",
        "pc😀",
        "a.b*c>d e/f@g😀",
        "%2E~",
    ];
    let mut devices = Vec::new();
    for id in ids {
        let mut ws = registered(&url, &device_register(id, "linux")).await;
        ws.heartbeat(id, "device").await;
        devices.push(ws);
    }
    for id in ids {
        until_online(&stack, id).await;
        let record = common::agent(&stack.registry_url(), id)
            .await
            .expect("registered");
        assert_eq!(record["agent_id"], id);
    }
    let mut online = common::online_clients(&stack.registry_url()).await;
    online.sort();
    let mut expected: Vec<String> = ids.iter().map(|s| (*s).to_owned()).collect();
    expected.push("good".to_owned());
    expected.sort();
    assert_eq!(online, expected, "ids verbatim in /api/clients");

    // A constellation whose id and target are full of them gets device info.
    let galaxy_id = "galaxy.*>@ 😀/x";
    let target = "a.b*c>d e/f@g😀";
    let mut galaxy = registered(&url, &constellation_register(galaxy_id, Some(target))).await;
    galaxy.heartbeat(galaxy_id, "device").await;
    galaxy
        .send(&device_info_request(galaxy_id, target, "req.*>😀"))
        .await;
    let info = galaxy.recv_kind("device_info_response").await;
    assert_eq!(info["status"], "ok", "{info}");
    assert_eq!(info["response_id"], "req.*>😀");
    assert_eq!(info["result"]["device_id"], target);
    // `pc*` is not a wildcard: a constellation bound to it may not ask for `pc1`-likes.
    let mut bound = registered(&url, &constellation_register("g@star", Some("pc*"))).await;
    bound
        .send(&device_info_request("g@star", "pc>", "req-other"))
        .await;
    bound
        .expect_error(
            "FORBIDDEN",
            "Not authorized to request device info for this device",
        )
        .await;
    // One id's socket closing does not disturb another whose subject token is similar.
    let star = devices.remove(1);
    star.close().await;
    until_offline(&stack, "pc*").await;
    for (ws, id) in devices.iter_mut().zip(ids.iter().filter(|i| **i != "pc*")) {
        ws.heartbeat(id, "device").await;
    }
    good.heartbeat("good", "device").await;
    stack.stop().await;
}
both_backends!(ids_with_subject_characters_and_emoji_work);

async fn a_client_that_never_registers_is_closed_at_the_deadline(backend: Backend) {
    let stack = Stack::start(backend, options()).await.expect("stack");
    let url = stack.ws_url(0);
    let mut good = registered(&url, &device_register("good", "windows")).await;

    // Silent: ERROR, then a close (the test kit's register_timeout_ms is 3000).
    let mut silent = Ws::connect(&url).await;
    silent
        .expect_error(
            "REGISTRATION_FAILED",
            "no register frame within 3000 ms of connecting",
        )
        .await;
    let closed = silent.closed().await;
    assert_eq!(closed.code, Some(1008), "{closed:?}");
    assert_eq!(closed.reason, "registration deadline passed");
    good.heartbeat("good", "device").await;

    // Pings are not a registration: they do not push the deadline back.
    let mut pinging = Ws::connect(&url).await;
    let deadline = tokio::time::Instant::now() + aip_testkit::WAIT;
    let error = loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a client that only pings was never closed"
        );
        pinging.send_ping().await.expect("ping");
        match tokio::time::timeout(Duration::from_millis(200), pinging.recv()).await {
            Err(_) => continue,
            Ok(frame) => break frame.expect("an ERROR before the close"),
        }
    };
    common::assert_error(
        &error,
        "REGISTRATION_FAILED",
        "no register frame within 3000 ms of connecting",
    );
    assert_eq!(pinging.closed().await.code, Some(1008));
    good.heartbeat("good", "device").await;
    stack.stop().await;
}
both_backends!(a_client_that_never_registers_is_closed_at_the_deadline);

async fn a_flood_of_pings_before_register_is_harmless(backend: Backend) {
    let stack = Stack::start(backend, options()).await.expect("stack");
    let url = stack.ws_url(0);
    let mut good = registered(&url, &device_register("good", "windows")).await;

    let mut flood = Ws::connect(&url).await;
    for _ in 0..50_000 {
        flood
            .try_send(Message::Ping(Default::default()))
            .await
            .expect("the gateway is still there");
    }
    flood.send(&device_register("flooder", "linux")).await;
    common::assert_registration_answer(&flood.recv().await.expect("registered after the pings"));
    flood.heartbeat("flooder", "device").await;
    good.heartbeat("good", "device").await;
    stack.stop().await;
}
both_backends!(a_flood_of_pings_before_register_is_harmless);

/// The gateway's own WebSocket framing: a REGISTER sent in fragments (with a ping between
/// them) is joined and answered; text that is not UTF-8 and an unmasked frame are closed with
/// the codes RFC 6455 names (1007, 1002), and other clients carry on.
async fn websocket_frames_are_joined_and_checked(backend: Backend) {
    use tokio_tungstenite::tungstenite::protocol::frame::Frame;
    use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};

    let stack = Stack::start(backend, options()).await.expect("stack");
    let url = stack.ws_url(0);
    let mut good = registered(&url, &device_register("good", "windows")).await;

    let mut fragmented = Ws::connect(&url).await;
    let register = device_register("fragmented", "linux").to_string();
    let (head, tail) = register.split_at(register.len() / 2);
    for message in [
        Message::Frame(Frame::message(
            head.to_owned(),
            OpCode::Data(Data::Text),
            false,
        )),
        Message::Ping(Default::default()),
        Message::Frame(Frame::message(
            tail.to_owned(),
            OpCode::Data(Data::Continue),
            true,
        )),
    ] {
        fragmented.try_send(message).await.expect("sent");
    }
    common::assert_registration_answer(&fragmented.recv().await.expect("registered"));
    fragmented.heartbeat("fragmented", "device").await;

    let mut garbled = registered(&url, &device_register("garbled", "linux")).await;
    garbled
        .try_send(Message::Frame(Frame::message(
            vec![b'{', 0xff, 0xfe, b'}'],
            OpCode::Data(Data::Text),
            true,
        )))
        .await
        .expect("sent");
    let closed = garbled.closed().await;
    assert_eq!(closed.code, Some(1007), "{closed:?}");

    // An unmasked frame, written on a raw socket after the handshake.
    let mut raw = common::raw_handshake(&url).await;
    tokio::io::AsyncWriteExt::write_all(&mut raw, &[0x81, 0x02, b'{', b'}'])
        .await
        .expect("written");
    let closing = common::read_close_code(&mut raw).await;
    assert_eq!(closing, Some(1002));

    good.heartbeat("good", "device").await;
    fragmented.heartbeat("fragmented", "device").await;
    stack.stop().await;
}
both_backends!(websocket_frames_are_joined_and_checked);
