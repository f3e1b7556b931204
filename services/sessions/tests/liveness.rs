//! A gateway that dies says nothing: its agents go offline when their liveness expires, and
//! the tasks they execute must end then, not at their command timeout.

use std::time::Duration;

use aip_bus::registry::RegistryClient;
use aip_testkit::{Backend, Options, Stack, both_backends, eventually, get_json, post_json};
use proto_schemas::registry::RegisterAgent;
use proto_schemas::{ClientType, Platform, Subjects, V1};
use serde_json::json;

async fn a_silent_gateways_agent_fails_its_tasks_when_its_liveness_expires(backend: Backend) {
    let stack = Stack::start(
        backend,
        Options {
            liveness_ms: 2_000,
            ..Options::default()
        },
    )
    .await
    .expect("stack");
    // A device registered through a gateway that has never reported presence and never
    // will: what the registry holds of a gateway killed with `kill -9`.
    let subjects = Subjects::new(&stack.prefix).expect("prefix");
    let registry = RegistryClient::new(stack.bus.clone(), subjects, Duration::from_secs(5));
    registry
        .register(&RegisterAgent {
            version: V1,
            agent_id: "orphan".to_owned(),
            client_type: ClientType::Device,
            gateway_id: "gw-killed".to_owned(),
            connection_id: "gw-killed:1".to_owned(),
            principal: "test".to_owned(),
            platform: Platform::Linux,
            target_id: None,
            capabilities: Vec::new(),
            tools: Vec::new(),
            system_info: None,
            metadata: None,
            extensions: Vec::new(),
        })
        .await
        .expect("registered");

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
