//! Handoffs as the parties see them, over real WebSockets, REST and NATS, on both backends: by
//! capability and by id, to nobody, the loop bound, asked by the planner and by the executor;
//! the new executor goes on from where the task was, the old one is told, the requester too.

use aip_bus::Headers;
use aip_testkit::frames::{
    command_results_for, constellation_register, constellation_task, device_register_with,
};
use aip_testkit::{Backend, Client, Options, Stack, both_backends, get_json, post_json};
use futures::StreamExt;
use serde_json::{Value, json};

/// A device on the stack's last gateway (the requesters use the first).
async fn device(stack: &Stack, id: &str, capabilities: &[&str], extensions: bool) -> Client {
    let mut register = device_register_with(id, capabilities);
    if extensions {
        register["metadata"]["aip_extensions"] = json!(["handoff"]);
    }
    let gateway = stack.gateways.len() - 1;
    let client = Client::registered(&stack.ws_url(gateway), register).await;
    stack.wait_online(id).await;
    client
}

fn options() -> Options {
    Options {
        gateways: 2,
        sessions_settings: Some(|s| s.max_handoffs = 2),
        ..Options::default()
    }
}

async fn by_capability_and_by_id_to_nobody_and_the_loop_bound(backend: Backend) {
    let stack = Stack::start(backend, options()).await.expect("stack");
    let mut first = device(&stack, "h-one", &["office"], false).await;
    let mut second = device(&stack, "h-two", &["office", "gpu"], false).await;
    let galaxy_id = "g@h-one";
    let mut register = constellation_register(galaxy_id, Some("h-one"));
    register["metadata"]["aip_extensions"] = json!(["handoff"]);
    let mut galaxy = Client::registered(&stack.ws_url(0), register).await;
    let steps = json!([[{ "tool_name": "render", "tool_type": "action", "parameters": { "page": 1 } }],
                       [{ "tool_name": "render", "tool_type": "action", "parameters": { "page": 2 } }]]);
    galaxy
        .send(&constellation_task(
            galaxy_id,
            "h-one",
            "s-h",
            "t",
            Some(steps),
        ))
        .await
        .expect("task");
    let page_one = first.recv_type("command").await.expect("step 1");
    first
        .send(&command_results_for("h-one", &page_one))
        .await
        .expect("results");
    let page_two = first
        .recv_type("command")
        .await
        .expect("step 2 on the first");
    assert_eq!(page_two["actions"][0]["parameters"]["page"], 2);

    // By capability: only the second device has `gpu`.
    let base = stack.sessions_url();
    let (status, moved) = post_json(
        &format!("{base}/api/tasks/s-h/handoff"),
        &json!({ "required_capabilities": ["gpu"], "reason": "needs a GPU" }),
    )
    .await;
    assert_eq!(status, 200, "{moved}");
    assert_eq!(moved["executor_id"], "h-two");
    // The old executor is told; the new one goes on from the current step.
    let told = first
        .recv_type("task_end")
        .await
        .expect("the old executor is told");
    assert_eq!(told["status"], "failed");
    assert!(
        told["error"]
            .as_str()
            .is_some_and(|e| e.contains("handed off to 'h-two'") && e.contains("needs a GPU")),
        "{told}"
    );
    let again = second
        .recv_type("command")
        .await
        .expect("step 2 on the second");
    assert_eq!(again["actions"][0]["parameters"]["page"], 2);
    assert_eq!(again["session_id"], "s-h");
    // The requester, which announced the extension, gets a HandoffNotification.
    let notice = galaxy.recv_type("handoff").await.expect("a handoff frame");
    assert_eq!(
        notice["metadata"],
        json!({ "version": 1, "task_id": "s-h", "current_agent_id": "h-one",
            "new_agent_id": "h-two", "reason": "needs a GPU" })
    );
    // Results from the old executor are refused now.
    first
        .send(&command_results_for("h-one", &page_two))
        .await
        .expect("late results");
    let refused = first.recv_type("error").await.expect("refused");
    assert_eq!(refused["metadata"]["error_code"], "FORBIDDEN", "{refused}");

    // To nobody: the task stays where it is.
    let (status, nobody) = post_json(
        &format!("{base}/api/tasks/s-h/handoff"),
        &json!({ "required_capabilities": ["quantum"], "reason": "try" }),
    )
    .await;
    assert_eq!(
        (status, nobody["error_code"].as_str()),
        (422, Some("CAPABILITY_MISMATCH")),
        "{nobody}"
    );
    let (status, same) = post_json(
        &format!("{base}/api/tasks/s-h/handoff"),
        &json!({ "target_id": "h-two", "reason": "stay" }),
    )
    .await;
    assert_eq!(status, 409, "already there: {same}");
    assert_eq!(stack.task("s-h").await["executor_id"], "h-two");

    // By id, back to the first; then the bound (2) stops a third.
    let (status, back) = post_json(
        &format!("{base}/api/tasks/s-h/handoff"),
        &json!({ "target_id": "h-one", "reason": "back" }),
    )
    .await;
    assert_eq!(
        (status, back["executor_id"].as_str()),
        (200, Some("h-one")),
        "{back}"
    );
    let (status, bound) = post_json(
        &format!("{base}/api/tasks/s-h/handoff"),
        &json!({ "target_id": "h-two", "reason": "again" }),
    )
    .await;
    assert_eq!(status, 409, "{bound}");
    assert!(
        bound["detail"]
            .as_str()
            .is_some_and(|d| d.contains("max_handoffs")),
        "{bound}"
    );
    let last = first
        .recv_type("command")
        .await
        .expect("step 2, back on the first");
    first
        .send(&command_results_for("h-one", &last))
        .await
        .expect("results");
    let end = galaxy.recv_type("task_end").await.expect("task_end");
    assert_eq!(end["status"], "completed", "{end}");

    let (_, events) = get_json(&format!("{base}/api/tasks/s-h/events")).await;
    let kinds: Vec<&str> = events["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["kind"].as_str())
        .filter(|k| k.starts_with("handoff"))
        .collect();
    assert_eq!(
        kinds,
        [
            "handoff_requested",
            "handoff_accepted",
            "handoff_requested",
            "handoff_accepted"
        ]
    );
    stack.stop().await;
}
both_backends!(by_capability_and_by_id_to_nobody_and_the_loop_bound);

async fn the_planner_and_the_executor_hand_off_and_nats_too(backend: Backend) {
    let stack = Stack::start(backend, options()).await.expect("stack");
    // A planner: a command, then a handoff to `gpu`, then a command, then done.
    let bus = stack.bus.clone();
    let mut requests = bus
        .queue_subscribe(format!("{}.planner.next", stack.prefix), "planners".into())
        .await
        .expect("sub");
    let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel::<Value>();
    let planner_bus = stack.bus.clone();
    tokio::spawn(async move {
        while let Some(m) = requests.next().await {
            let request: Value = serde_json::from_slice(&m.payload).expect("PlanRequest");
            let decision = match request["step"].as_u64() {
                Some(0) | Some(2) => {
                    json!({ "decision": "commands", "actions": [{ "tool_name": "work", "tool_type": "action" }] })
                }
                Some(1) => {
                    json!({ "decision": "handoff", "required_capabilities": ["gpu"], "reason": "the model wants a GPU" })
                }
                _ => {
                    json!({ "decision": "complete", "result": { "finished_on": request["executor_id"] } })
                }
            };
            let _ = seen_tx.send(request);
            aip_bus::respond(
                planner_bus.as_ref(),
                &m,
                Headers::new(),
                json!({ "ok": decision }).to_string().into(),
            )
            .await
            .expect("reply");
        }
    });
    let mut cpu = device(&stack, "p-cpu", &["office"], false).await;
    let mut gpu = device(&stack, "p-gpu", &["gpu"], true).await;
    let base = stack.sessions_url();
    let body = json!({ "version": 1, "description": "train", "originating_agent_id": "ops",
        "target_id": "p-cpu", "planner": "nats" });
    let (status, t) = post_json(&format!("{base}/api/tasks"), &body).await;
    assert_eq!(status, 201, "{t}");
    let id = t["task_id"].as_str().expect("id").to_owned();
    let command = cpu.recv_type("command").await.expect("on the cpu");
    cpu.send(&command_results_for("p-cpu", &command))
        .await
        .expect("results");
    let told = cpu
        .recv_type("task_end")
        .await
        .expect("the cpu is released");
    assert!(
        told["error"].as_str().is_some_and(|e| e.contains("p-gpu")),
        "{told}"
    );
    // The gpu announced the extension: it gets the context first.
    let context = gpu.recv_type("handoff").await.expect("the context");
    assert_eq!(context["metadata"]["new_agent_id"], "p-gpu");
    assert_eq!(context["metadata"]["context"]["request"], "train");
    assert_eq!(
        context["metadata"]["context"]["results"][0]["results"][0]["status"], "success",
        "{context}"
    );
    let command = gpu.recv_type("command").await.expect("on the gpu");
    gpu.send(&command_results_for("p-gpu", &command))
        .await
        .expect("results");
    let done = stack.task_in_state(&id, "completed").await;
    assert_eq!(done["result"], json!({ "finished_on": "p-gpu" }));
    let requests: Vec<Value> = std::iter::from_fn(|| seen.try_recv().ok()).collect();
    let executors: Vec<&str> = requests
        .iter()
        .filter_map(|r| r["executor_id"].as_str())
        .collect();
    assert_eq!(
        executors,
        ["p-cpu", "p-cpu", "p-gpu", "p-gpu"],
        "{requests:?}"
    );

    // The executor asks (it announced the extension): from the gpu to the cpu.
    let body = json!({ "version": 1, "description": "render", "originating_agent_id": "ops",
        "target_id": "p-gpu", "steps": [[{ "tool_name": "draw", "tool_type": "action" }]] });
    let (status, t) = post_json(&format!("{base}/api/tasks"), &body).await;
    assert_eq!(status, 201, "{t}");
    let id = t["task_id"].as_str().expect("id").to_owned();
    let _draw = gpu.recv_type("command").await.expect("on the gpu");
    let ask = json!({ "type": "handoff", "status": "continue", "client_type": "device", "client_id": "p-gpu",
        "session_id": id, "target_id": "p-cpu", "metadata": { "reason": "out of memory" } });
    gpu.send(&ask).await.expect("handoff frame");
    let draw = cpu.recv_type("command").await.expect("now on the cpu");
    assert_eq!(draw["actions"][0]["tool_name"], "draw");
    let moved = stack.task(&id).await;
    assert_eq!(moved["executor_id"], "p-cpu", "{moved}");

    // Over NATS: back to the gpu.
    let request = json!({ "version": 1, "task_id": id, "target_id": "p-gpu",
        "reason": "memory freed", "requested_by": "scheduler" });
    let reply = stack
        .bus
        .request(
            format!("{}.sessions.handoff", stack.prefix),
            Headers::new(),
            request.to_string().into(),
            std::time::Duration::from_secs(5),
        )
        .await
        .expect("a reply");
    let reply: Value = serde_json::from_slice(&reply.payload).expect("json");
    assert_eq!(reply["ok"]["executor_id"], "p-gpu", "{reply}");
    let draw = gpu.recv_type("command").await.expect("back on the gpu");
    gpu.send(&command_results_for("p-gpu", &draw))
        .await
        .expect("results");
    stack.task_in_state(&id, "completed").await;

    // A device without the extension cannot ask.
    let mut plain = device(&stack, "p-plain", &["office"], false).await;
    let mut asked = ask.clone();
    asked["client_id"] = json!("p-plain");
    plain.send(&asked).await.expect("send");
    let refused = plain.recv_type("error").await.expect("refused");
    assert!(
        refused["error"]
            .as_str()
            .is_some_and(|e| e.contains("Unknown message type: handoff")),
        "{refused}"
    );
    stack.stop().await;
}
both_backends!(the_planner_and_the_executor_hand_off_and_nats_too);
