//! Registrations that come together go to the registry together (`registry.write`), unless
//! together they are larger than one bus message: then each goes alone, and still registers.
//! Here every REGISTER carries 300 KB of system information (twice in the registry request:
//! as `system_info` and within `metadata`), so any two of them exceed NATS's 1 MiB; the crowd
//! registers, and leaves, as it would one by one. Both backends (the
//! in-process bus has no size limit: there they go together). A REGISTER too large to go even
//! alone is refused as too large.

mod common;

use std::collections::HashSet;

use aip_testkit::frames::device_register;
use aip_testkit::{Backend, Options, Stack, both_backends, eventually};
use common::{Ws, assert_registration_answer, online_clients, registered};
use serde_json::json;

const CROWD: usize = 20;

async fn registrations_too_large_to_go_together_go_alone(backend: Backend) {
    let options = Options {
        sessions: false,
        ..Options::default()
    };
    let stack = Stack::start(backend, options).await.expect("stack");
    let url = stack.ws_url(0);
    let ids: Vec<String> = (0..CROWD).map(|i| format!("large-{i}")).collect();
    let frames: Vec<_> = ids
        .iter()
        .map(|id| {
            let mut frame = device_register(id, "linux");
            frame["metadata"]["system_info"]["custom_metadata"] =
                json!({ "inventory": "x".repeat(300 * 1024) });
            frame
        })
        .collect();
    let clients =
        futures::future::join_all(frames.iter().map(|frame| registered(&url, frame))).await;
    let base = stack.registry_url();
    let expected: HashSet<String> = ids.iter().cloned().collect();
    eventually("the crowd online", || {
        let (base, expected) = (base.clone(), &expected);
        async move {
            let online: HashSet<String> = online_clients(&base).await.into_iter().collect();
            (expected.is_subset(&online)).then_some(())
        }
    })
    .await
    .expect("every device of the crowd registered");
    drop(clients);
    eventually("the crowd offline", || {
        let (base, expected) = (base.clone(), &expected);
        async move {
            let online: HashSet<String> = online_clients(&base).await.into_iter().collect();
            online.is_disjoint(expected).then_some(())
        }
    })
    .await
    .expect("every device of the crowd unregistered");
    stack.stop().await;
}

both_backends!(registrations_too_large_to_go_together_go_alone);

/// A REGISTER too large to pass to the registry in one bus message is refused for what it is
/// (`FRAME_TOO_LARGE`, close 1009), not as a registry that did not answer: trying again cannot
/// help. The in-process bus of `aip dev` has no such limit: there it registers.
async fn a_registration_larger_than_the_bus_carries_is_refused_as_too_large(backend: Backend) {
    let options = Options {
        sessions: false,
        ..Options::default()
    };
    let stack = Stack::start(backend, options).await.expect("stack");
    let mut frame = device_register("huge", "linux");
    frame["metadata"]["system_info"]["custom_metadata"] =
        json!({ "inventory": "x".repeat(700 * 1024) });
    let mut ws = Ws::connect(&stack.ws_url(0)).await;
    ws.send(&frame).await;
    let answer = ws.recv().await.expect("an answer");
    match backend {
        Backend::LocalSqlite => assert_registration_answer(&answer),
        Backend::NatsPostgres => {
            assert_eq!(answer["type"], "error", "{answer}");
            assert_eq!(
                answer["metadata"]["error_code"], "FRAME_TOO_LARGE",
                "{answer}"
            );
            let text = answer["error"].as_str().expect("a text");
            assert!(
                text.starts_with(
                    "registration refused: the REGISTER is too large to pass to the registry (payload of "
                ) && text.ends_with(
                    " bytes exceeds the bus limit of 1048576 bytes); send less in `metadata`"
                ),
                "{text}"
            );
            let closed = ws.closed().await;
            assert_eq!(closed.code, Some(1009), "{closed:?}");
        }
    }
    stack.stop().await;
}

both_backends!(a_registration_larger_than_the_bus_carries_is_refused_as_too_large);
