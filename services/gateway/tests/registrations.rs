//! Registrations that come together go to the registry together (`registry.write`), unless
//! together they are larger than one bus message: then each goes alone, and still registers.
//! Here every REGISTER carries 300 KB of system information (twice in the registry request:
//! as `system_info` and within `metadata`), so any two of them exceed NATS's 1 MiB; the crowd
//! registers, and leaves, as it would one by one. Both backends (the
//! in-process bus has no size limit: there they go together).

mod common;

use std::collections::HashSet;

use aip_testkit::frames::device_register;
use aip_testkit::{Backend, Options, Stack, both_backends, eventually};
use common::{online_clients, registered};
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
