//! Seed 004's agent management over TaskRequest: "register me as an agent" and "find an
//! agent" answered with a TaskResponse, backed by the registry's database, over REST
//! (`POST /api/tasks`) and NATS (`sessions.submit`), on both backends.

use std::time::Duration;

use aip_bus::Headers;
use aip_testkit::frames::device_register_with;
use aip_testkit::{Backend, Client, Options, Stack, both_backends, get_json, post_json};
use proto_schemas::Subjects;
use serde_json::{Value, json};

/// A TaskRequest with `description` (and `data`).
fn task_request(task_id: &str, description: &str, data: Option<Value>) -> Value {
    let mut request = json!({
        "version": 1,
        "task_id": task_id,
        "description": description,
        "originating_agent_id": "tester",
    });
    if let Some(data) = data {
        request["data"] = data;
    }
    request
}

/// `POST /api/tasks`: must answer 200 with a TaskResponse and create no task.
async fn over_rest(stack: &Stack, request: Value) -> Value {
    let url = format!("{}/api/tasks", stack.sessions_url());
    let (status, response) = post_json(&url, &request).await;
    assert_eq!(status, 200, "{response}");
    assert_eq!(response["task_id"], request["task_id"], "{response}");
    assert_eq!(response["agent_id"], "aip-registry", "{response}");
    let task = format!(
        "{}/api/tasks/{}",
        stack.sessions_url(),
        request["task_id"].as_str().unwrap_or_default()
    );
    assert_eq!(get_json(&task).await.0, 404, "no task is created");
    response
}

/// `sessions.submit`: the reply is `{"ok": TaskResponse}`.
async fn over_nats(stack: &Stack, request: Value) -> Value {
    let subjects = Subjects::new(&stack.prefix).expect("a valid prefix");
    let reply = stack
        .bus
        .request(
            subjects.sessions_submit(),
            Headers::new(),
            serde_json::to_vec(&request).expect("json").into(),
            Duration::from_secs(10),
        )
        .await
        .expect("a reply");
    let reply: Value = serde_json::from_slice(&reply.payload).expect("JSON reply");
    reply["ok"].clone()
}

async fn register_find_and_refusals_over_rest(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");

    // Register (text form): success with the registration details.
    let registered = over_rest(
        &stack,
        task_request(
            "r-1",
            "Please register me as an agent id=web-1 capabilities=search,summarize address=https://web-1.example:8443/aip status=available",
            None,
        ),
    )
    .await;
    assert_eq!(registered["status"], "success", "{registered}");
    let details = &registered["result"];
    assert_eq!(details["agent_id"], "web-1");
    assert_eq!(details["capabilities"], json!(["search", "summarize"]));
    assert_eq!(details["address"], "https://web-1.example:8443/aip");
    assert_eq!(details["status"], "available");
    assert_eq!(details["registered_by"], "rest:anonymous", "{details}");

    // Register (data form), busy: registered but never found.
    let busy = over_rest(
        &stack,
        task_request(
            "r-2",
            "register me as an agent",
            Some(json!({ "agent_id": "web-2", "capabilities": ["search"], "address": "10.0.0.2:9000", "status": "busy" })),
        ),
    )
    .await;
    assert_eq!(busy["status"], "success", "{busy}");

    // Duplicate: failed, the seed's words.
    let duplicate = over_rest(
        &stack,
        task_request(
            "r-3",
            "register me as an agent id=web-1 capabilities=other address=h:1",
            None,
        ),
    )
    .await;
    assert_eq!(duplicate["status"], "failed", "{duplicate}");
    assert_eq!(
        duplicate["error"],
        "Agent with ID web-1 is already registered"
    );
    assert!(duplicate.get("result").is_none(), "{duplicate}");

    // The id of a connected WebSocket client is taken too.
    let _device = Client::registered(
        &stack.ws_url(0),
        device_register_with("pc-search", &["search"]),
    )
    .await;
    stack.wait_online("pc-search").await;
    let taken = over_rest(
        &stack,
        task_request(
            "r-4",
            "register me as an agent id=pc-search capabilities=search address=h:1",
            None,
        ),
    )
    .await;
    assert_eq!(
        taken["error"],
        "Agent with ID pc-search is already registered"
    );

    // Find: the available addressed agent with its address, and the connected device.
    let found = over_rest(
        &stack,
        task_request("f-1", "find an agent with capabilities search", None),
    )
    .await;
    assert_eq!(found["status"], "success", "{found}");
    assert_eq!(
        found["result"]["agents"],
        json!([
            { "agent_id": "web-1", "kind": "addressed", "capabilities": ["search", "summarize"],
              "address": "https://web-1.example:8443/aip", "status": "available" },
            // A device's capabilities as its gateway registered them (with the platform's).
            { "agent_id": "pc-search", "kind": "device", "capabilities": ["search", "gui", "cli"],
              "status": "available" },
        ]),
        "{found}"
    );
    // All the capabilities are required.
    let both = over_rest(
        &stack,
        task_request(
            "f-2",
            "find an agent",
            Some(json!({ "capabilities": ["search", "summarize"] })),
        ),
    )
    .await;
    let ids: Vec<&Value> = both["result"]["agents"]
        .as_array()
        .expect("agents")
        .iter()
        .map(|a| &a["agent_id"])
        .collect();
    assert_eq!(ids, [&json!("web-1")], "{both}");

    // Nothing found.
    let none = over_rest(
        &stack,
        task_request("f-3", "find an agent with capabilities translate", None),
    )
    .await;
    assert_eq!(none["status"], "failed", "{none}");
    assert_eq!(none["error"], "No available agents found");

    // Unparseable.
    let bad_register = over_rest(
        &stack,
        task_request("r-5", "register me as an agent id=x capabilities=a", None),
    )
    .await;
    assert_eq!(bad_register["status"], "failed");
    assert_eq!(
        bad_register["error"],
        "Invalid registration request: no address"
    );
    let bad_lookup = over_rest(
        &stack,
        task_request("f-4", "find an agent that can search the web", None),
    )
    .await;
    assert_eq!(bad_lookup["status"], "failed");
    assert!(
        bad_lookup["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("Invalid lookup request: ")),
        "{bad_lookup}"
    );
    stack.stop().await;
}
both_backends!(register_find_and_refusals_over_rest);

async fn register_and_find_over_nats(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let registered = over_nats(
        &stack,
        task_request(
            "n-1",
            "register me as an agent",
            Some(json!({ "agent_id": "nats-1", "capabilities": ["plan"], "address": "planner.internal:7000" })),
        ),
    )
    .await;
    assert_eq!(registered["status"], "success", "{registered}");
    assert_eq!(registered["task_id"], "n-1");
    assert_eq!(registered["result"]["registered_by"], "nats:tester");
    assert_eq!(registered["result"]["status"], "available");

    let duplicate = over_nats(
        &stack,
        task_request(
            "n-2",
            "register me as an agent id=nats-1 capabilities=plan address=h:1",
            None,
        ),
    )
    .await;
    assert_eq!(
        duplicate["error"],
        "Agent with ID nats-1 is already registered"
    );

    let found = over_nats(
        &stack,
        task_request("n-3", "FIND AN AGENT: capabilities=plan", None),
    )
    .await;
    assert_eq!(found["status"], "success", "{found}");
    assert_eq!(
        found["result"]["agents"][0]["address"],
        "planner.internal:7000"
    );

    let none = over_nats(
        &stack,
        task_request("n-4", "find an agent with capability x", None),
    )
    .await;
    assert_eq!(none["error"], "No available agents found");

    let bad = over_nats(&stack, task_request("n-5", "register me as an agent", None)).await;
    assert_eq!(bad["error"], "Invalid registration request: no agent id");
    let bad = over_nats(&stack, task_request("n-6", "find an agent", None)).await;
    assert_eq!(bad["error"], "Invalid lookup request: no capabilities");
    // Submitted over NATS, the task ids of agent management leave no task behind.
    let task = format!("{}/api/tasks/n-1", stack.sessions_url());
    assert_eq!(get_json(&task).await.0, 404);
    stack.stop().await;
}
both_backends!(register_and_find_over_nats);

/// A constellation's TASK frame with `request` (and `metadata`).
fn task_frame(client: &str, session: &str, request: &str, metadata: Option<Value>) -> Value {
    aip_testkit::frames::client(json!({
        "type": "task", "status": "continue", "client_type": "constellation", "client_id": client,
        "session_id": session, "request": request, "metadata": metadata
    }))
}

/// The same requests in `task` frames, from a client that announced `agent_management`: each
/// answered with a `task_end` carrying the TaskResponse; no task starts. A client that did not
/// announce it has its frame taken as a task, as UFO would.
async fn register_and_find_over_frames(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let mut register = aip_testkit::frames::constellation_register("galaxy-am", None);
    register["metadata"]["aip_extensions"] = json!(["agent_management"]);
    let mut galaxy = Client::registered(&stack.ws_url(0), register).await;

    galaxy
        .send(&task_frame(
            "galaxy-am",
            "am-1",
            "register me as an agent id=frame-agent capabilities=plan address=planner.lan:7000",
            None,
        ))
        .await
        .expect("send");
    let end = galaxy.recv_type("task_end").await.expect("answer");
    assert_eq!(end["session_id"], "am-1", "{end}");
    assert_eq!(end["status"], "completed", "{end}");
    assert_eq!(end["result"]["status"], "success", "{end}");
    assert_eq!(end["result"]["result"]["agent_id"], "frame-agent", "{end}");
    assert_eq!(
        end["result"]["result"]["registered_by"], "client:galaxy-am",
        "{end}"
    );

    galaxy
        .send(&task_frame(
            "galaxy-am",
            "am-2",
            "find an agent",
            Some(json!({ "required_capabilities": ["plan"] })),
        ))
        .await
        .expect("send");
    let end = galaxy.recv_type("task_end").await.expect("answer");
    assert_eq!(end["status"], "completed", "{end}");
    let agents = end["result"]["result"]["agents"]
        .as_array()
        .expect("agents");
    assert!(
        agents
            .iter()
            .any(|a| a["agent_id"] == "frame-agent" && a["address"] == "planner.lan:7000"),
        "{end}"
    );

    // A duplicate fails with the seed's words.
    galaxy
        .send(&task_frame(
            "galaxy-am",
            "am-3",
            "register me as an agent id=frame-agent capabilities=plan address=planner.lan:7000",
            None,
        ))
        .await
        .expect("send");
    let end = galaxy.recv_type("task_end").await.expect("answer");
    assert_eq!(end["status"], "failed", "{end}");
    assert_eq!(end["result"]["status"], "failed", "{end}");
    assert!(
        end["error"]
            .as_str()
            .is_some_and(|e| e.contains("already registered")),
        "{end}"
    );
    let task = format!("{}/api/tasks/am-1", stack.sessions_url());
    assert_eq!(get_json(&task).await.0, 404, "no task is created");

    // A plain UFO constellation: the same words are a task (here refused: no target).
    let mut plain = Client::registered(
        &stack.ws_url(0),
        aip_testkit::frames::constellation_register("galaxy-plain", None),
    )
    .await;
    plain
        .send(&task_frame("galaxy-plain", "am-4", "find an agent", None))
        .await
        .expect("send");
    let refusal = plain.recv().await.expect("refusal");
    assert!(
        refusal.to_string().contains("require target_id"),
        "{refusal}"
    );
    stack.stop().await;
}
both_backends!(register_and_find_over_frames);
