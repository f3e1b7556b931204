//! Per-client credentials: a token (sha256-hashed in the credentials file) presented as
//! `?token=` (UFO style) or `Authorization: Bearer`; refusals at the handshake (HTTP 403);
//! ids and roles a credential may register; takeover by the same credential and UFO's
//! duplicate refusal for another one. Both backends.

mod common;

use aip_gateway::auth::hash_token;
use aip_testkit::frames::{constellation_register, device_info_request, device_register};
use aip_testkit::{Backend, Options, Stack, both_backends};
use common::{Ws, refused_registration, registered, until_offline, until_online};
use serde_json::json;

const LAB_TOKEN: &str = "lab-secret-token";
const OPS_TOKEN: &str = "ops secret/with+odd&chars";

fn credentials() -> String {
    format!(
        r#"
[[credential]]
name = "lab"
token_sha256 = "{}"
client_ids = ["pc-*", "it's"]
roles = ["device"]

[[credential]]
name = "ops"
token_sha256 = "{}"
client_ids = ["pc-*", "galaxy@*", "it's"]
roles = ["device", "constellation"]
"#,
        hash_token(LAB_TOKEN),
        hash_token(OPS_TOKEN).to_uppercase(),
    )
}

fn with_token(url: &str, token: &str) -> String {
    format!("{url}?token={}", common::urlencode(token))
}

async fn tokens_are_checked_at_the_handshake(backend: Backend) {
    let stack = Stack::start(
        backend,
        Options {
            sessions: false,
            credentials: Some(credentials()),
            ..Options::default()
        },
    )
    .await
    .expect("stack");
    let url = stack.ws_url(0);

    let missing = Ws::refused(&url).await;
    assert_eq!(missing.status, 403);
    assert_eq!(
        missing.body,
        json!({"detail": "a token is required: ws://HOST/ws?token=KEY or Authorization: Bearer KEY", "error_code": "UNAUTHORIZED"})
    );
    for bad in [
        with_token(&url, "wrong"),
        format!("{url}?token="),
        with_token(&url, &hash_token(LAB_TOKEN)),
    ] {
        let refused = Ws::refused(&bad).await;
        assert_eq!(refused.status, 403, "{bad}");
        assert_eq!(
            refused.body,
            json!({"detail": "invalid token", "error_code": "UNAUTHORIZED"}),
            "{bad}"
        );
    }
    let refused = Ws::connect_bearer(&url, "wrong")
        .await
        .err()
        .expect("a wrong bearer token is refused");
    assert_eq!(refused.status, 403);

    // `?token=` (UFO clients put the key in their URL) and `Authorization: Bearer` both work.
    let mut pc = registered(
        &with_token(&url, LAB_TOKEN),
        &device_register("pc-1", "windows"),
    )
    .await;
    let mut galaxy = match Ws::connect_bearer(&url, OPS_TOKEN).await {
        Ok(ws) => ws,
        Err(refusal) => panic!("Bearer refused: {refusal:?}"),
    };
    galaxy
        .send(&constellation_register("galaxy@pc-1", Some("pc-1")))
        .await;
    common::assert_registration_answer(&galaxy.recv().await.expect("answer"));
    pc.heartbeat("pc-1", "device").await;
    galaxy.heartbeat("galaxy@pc-1", "device").await;
    until_online(&stack, "galaxy@pc-1").await;
    stack.stop().await;
}
both_backends!(tokens_are_checked_at_the_handshake);

async fn a_credential_registers_only_its_ids_and_roles(backend: Backend) {
    let stack = Stack::start(
        backend,
        Options {
            sessions: false,
            credentials: Some(credentials()),
            ..Options::default()
        },
    )
    .await
    .expect("stack");
    let lab = with_token(&stack.ws_url(0), LAB_TOKEN);
    let closed = refused_registration(
        &lab,
        &device_register("printer", "windows"),
        "FORBIDDEN",
        "credential `lab` may not register as device `printer`",
    )
    .await;
    assert_eq!(closed.code, Some(1008), "{closed:?}");
    refused_registration(
        &lab,
        &constellation_register("pc-galaxy", None),
        "FORBIDDEN",
        "credential `lab` may not register as constellation `pc-galaxy`",
    )
    .await;
    // The prefix pattern is a prefix, not a glob in the middle.
    refused_registration(
        &lab,
        &device_register("xpc-1", "windows"),
        "FORBIDDEN",
        "credential `lab` may not register as device `xpc-1`",
    )
    .await;
    assert!(
        common::agent(&stack.registry_url(), "printer")
            .await
            .is_none()
    );
    let mut ok = registered(&lab, &device_register("pc-anything", "linux")).await;
    ok.heartbeat("pc-anything", "device").await;
    stack.stop().await;
}
both_backends!(a_credential_registers_only_its_ids_and_roles);

async fn same_credential_takes_over_another_is_refused(backend: Backend) {
    let stack = Stack::start(
        backend,
        Options {
            sessions: false,
            credentials: Some(credentials()),
            ..Options::default()
        },
    )
    .await
    .expect("stack");
    let lab = with_token(&stack.ws_url(0), LAB_TOKEN);
    let ops = with_token(&stack.ws_url(0), OPS_TOKEN);

    for id in ["pc-1", "it's"] {
        let mut first = registered(&lab, &device_register(id, "windows")).await;
        until_online(&stack, id).await;

        // Another principal, same live id: UFO's refusal (Python repr quoting), close 1000.
        let expected = if id.contains('\'') {
            format!(
                "client_id \"{id}\" is already registered; duplicate registrations are not allowed"
            )
        } else {
            format!(
                "client_id '{id}' is already registered; duplicate registrations are not allowed"
            )
        };
        let closed = refused_registration(
            &ops,
            &device_register(id, "windows"),
            "REGISTRATION_FAILED",
            &expected,
        )
        .await;
        assert_eq!(closed.code, Some(1000), "{closed:?}");
        first.heartbeat(id, "device").await;

        // The same credential: takes over, the old socket is closed.
        let mut second = registered(&lab, &device_register(id, "windows")).await;
        let closed = first.closed().await;
        assert_eq!(closed.code, Some(1008), "{closed:?}");
        assert_eq!(
            closed.reason,
            "replaced by a newer connection of the same client"
        );
        second.heartbeat(id, "device").await;
        until_online(&stack, id).await;
        let record = common::agent(&stack.registry_url(), id)
            .await
            .expect("registered");
        assert_eq!(record["status"], "available");
    }
    stack.stop().await;
}
both_backends!(same_credential_takes_over_another_is_refused);

/// Device info is answered by the gateway holding the device; a takeover replaces what it
/// answers with the new registration's system info, and the old connection's end leaves it.
async fn a_takeover_is_described_by_its_new_system_info(backend: Backend) {
    let stack = Stack::start(
        backend,
        Options {
            sessions: false,
            credentials: Some(credentials()),
            ..Options::default()
        },
    )
    .await
    .expect("stack");
    let lab = with_token(&stack.ws_url(0), LAB_TOKEN);
    let ops = with_token(&stack.ws_url(0), OPS_TOKEN);
    let register = |os: &str| {
        let mut frame = device_register("pc-7", "windows");
        frame["metadata"]["system_info"]["os_version"] = json!(os);
        frame
    };
    let mut first = registered(&lab, &register("first")).await;
    until_online(&stack, "pc-7").await;
    let mut galaxy = registered(&ops, &constellation_register("galaxy@pc-7", Some("pc-7"))).await;
    let mut ask = async |request_id: &str| {
        galaxy
            .send(&device_info_request("galaxy@pc-7", "pc-7", request_id))
            .await;
        let info = galaxy.recv_kind("device_info_response").await;
        assert_eq!(info["response_id"], request_id, "{info}");
        info
    };
    assert_eq!(
        ask("r1").await["result"],
        register("first")["metadata"]["system_info"]
    );

    // Asked at once, while the replaced connection may still be open, and after it closed.
    let mut second = registered(&lab, &register("second")).await;
    assert_eq!(
        ask("r2").await["result"],
        register("second")["metadata"]["system_info"]
    );
    let closed = first.closed().await;
    assert_eq!(closed.code, Some(1008), "{closed:?}");
    assert_eq!(
        ask("r3").await["result"],
        register("second")["metadata"]["system_info"]
    );
    second.heartbeat("pc-7", "device").await;

    second.close().await;
    until_offline(&stack, "pc-7").await;
    let gone = ask("r4").await;
    assert_eq!(gone["status"], "error", "{gone}");
    assert_eq!(gone["metadata"]["error_code"], "DEVICE_NOT_FOUND", "{gone}");
    stack.stop().await;
}
both_backends!(a_takeover_is_described_by_its_new_system_info);

const SCOPED_TOKEN: &str = "scoped-token";

/// A credential whose constellations may target only the lab's devices.
fn scoped_credentials() -> String {
    format!(
        r#"
[[credential]]
name = "scoped"
token_sha256 = "{}"
client_ids = ["lab-*", "galaxy@*", "box-*"]
roles = ["device", "constellation"]
targets = ["lab-*", "capability:gpu"]
"#,
        hash_token(SCOPED_TOKEN),
    )
}

/// The next frame of type `kind` (others, such as a task's acceptance, skipped).
async fn next_of_kind(ws: &mut Ws, kind: &str) -> serde_json::Value {
    loop {
        let frame = ws.recv().await.expect("a frame");
        if frame["type"] == kind {
            return frame;
        }
    }
}

/// Issue 21: a credential with `targets` drives only those devices. A constellation may not
/// register for another device, and its TASK frames to another device (or to none named) are
/// refused with FORBIDDEN and a failed `task_end`; tasks to its devices run.
async fn a_credential_targets_only_its_devices(backend: Backend) {
    let stack = Stack::start(
        backend,
        Options {
            credentials: Some(scoped_credentials()),
            ..Options::default()
        },
    )
    .await
    .expect("stack");
    let url = with_token(&stack.ws_url(0), SCOPED_TOKEN);
    refused_registration(
        &url,
        &constellation_register("galaxy@office-1", Some("office-1")),
        "FORBIDDEN",
        "credential `scoped` may not target device `office-1`",
    )
    .await;

    let mut device = registered(&url, &device_register("lab-1", "linux")).await;
    let mut galaxy = registered(&url, &constellation_register("galaxy@lab-1", Some("lab-1"))).await;
    let steps = aip_testkit::frames::one_step("echo", json!({ "text": "hi" }));
    for (target, session, text) in [
        (
            "office-1",
            "s-office",
            "credential `scoped` may not target device `office-1`",
        ),
        (
            "",
            "s-none",
            "credential `scoped` may target only the devices it names: give target_id",
        ),
    ] {
        let mut task = aip_testkit::frames::constellation_task(
            "galaxy@lab-1",
            target,
            session,
            session,
            Some(steps.clone()),
        );
        if target.is_empty() {
            task["target_id"] = serde_json::Value::Null;
        }
        galaxy.send(&task).await;
        galaxy.expect_error("FORBIDDEN", text).await;
        let end = galaxy.recv_kind("task_end").await;
        assert_eq!(end["session_id"], session, "{end}");
        assert_eq!(end["status"], "failed", "{end}");
    }

    let task = aip_testkit::frames::constellation_task(
        "galaxy@lab-1",
        "lab-1",
        "s-lab",
        "s-lab",
        Some(steps),
    );
    galaxy.send(&task).await;
    let command = next_of_kind(&mut device, "command").await;
    device
        .send(&aip_testkit::frames::command_results_for("lab-1", &command))
        .await;
    let end = next_of_kind(&mut galaxy, "task_end").await;
    assert_eq!(end["session_id"], "s-lab", "{end}");
    assert_eq!(end["status"], "completed", "{end}");

    // `capability:gpu`: a device outside the id patterns that has the capability may be
    // driven; one without it may not.
    let mut gpu = registered(
        &url,
        &aip_testkit::frames::device_register_with("box-gpu", &["gpu"]),
    )
    .await;
    let _plain = registered(
        &url,
        &aip_testkit::frames::device_register_with("box-plain", &["cpu"]),
    )
    .await;
    stack.wait_online("box-gpu").await;
    stack.wait_online("box-plain").await;
    let steps = aip_testkit::frames::one_step("echo", json!({}));
    let task = |target: &str, session: &str| {
        aip_testkit::frames::constellation_task(
            "galaxy@lab-1",
            target,
            session,
            session,
            Some(steps.clone()),
        )
    };
    galaxy.send(&task("box-plain", "s-plain")).await;
    galaxy
        .expect_error(
            "FORBIDDEN",
            "credential `scoped` may not target device `box-plain`",
        )
        .await;
    galaxy.send(&task("box-gpu", "s-gpu")).await;
    let command = next_of_kind(&mut gpu, "command").await;
    assert_eq!(command["session_id"], "s-gpu", "{command}");
    stack.stop().await;
}

both_backends!(a_credential_targets_only_its_devices);
