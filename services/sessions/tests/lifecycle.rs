//! How tasks end when things go wrong, and what bad input gets: each case over real
//! WebSockets and REST, on both backends.

use aip_bus::Headers;
use aip_testkit::frames::{
    command_results_for, constellation_register, constellation_task, device_register, one_step,
};
use aip_testkit::{
    Backend, Client, Options, Stack, both_backends, eventually, get_json, post_json,
};
use futures::StreamExt;
use serde_json::{Value, json};

/// A device and a constellation bound to it, and a started task whose first command the
/// device has received.
async fn running_task(stack: &Stack, device: &str, session: &str) -> (Client, Client, Value) {
    let mut dev = Client::registered(&stack.ws_url(0), device_register(device, "windows")).await;
    stack.wait_online(device).await;
    let galaxy_id = format!("g@{device}");
    let mut galaxy = Client::registered(
        &stack.ws_url(0),
        constellation_register(&galaxy_id, Some(device)),
    )
    .await;
    let steps = json!([[{ "tool_name": "a", "tool_type": "action" }], [{ "tool_name": "b", "tool_type": "action" }]]);
    galaxy
        .send(&constellation_task(
            &galaxy_id,
            device,
            session,
            "t",
            Some(steps),
        ))
        .await
        .expect("task");
    assert_eq!(galaxy.recv().await.expect("ack")["session_id"], session);
    let command = dev.recv_type("command").await.expect("command");
    assert_eq!(command["agent_name"], "HostAgent");
    (dev, galaxy, command)
}

async fn task(stack: &Stack, id: &str) -> Value {
    get_json(&format!("{}/api/tasks/{id}", stack.sessions_url()))
        .await
        .1
}

async fn executor_disconnect_fails_the_task_with_ufos_text(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let (dev, mut galaxy, _) = running_task(&stack, "pc-a", "s-a").await;
    dev.close().await;
    let end = galaxy.recv_type("task_end").await.expect("task_end");
    assert_eq!(end["status"], "failed");
    assert_eq!(
        end["error"],
        "Task was cancelled because target device disconnected"
    );
    let t = task(&stack, "s-a").await;
    assert_eq!(
        (t["state"].as_str(), t["error_code"].as_str()),
        (Some("failed"), Some("CONNECTION_FAILED")),
        "{t}"
    );
    stack.stop().await;
}
both_backends!(executor_disconnect_fails_the_task_with_ufos_text);

async fn requester_disconnect_cancels_and_tells_the_executor(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let (mut dev, galaxy, _) = running_task(&stack, "pc-b", "s-b").await;
    galaxy.close().await;
    let end = dev
        .recv_type("task_end")
        .await
        .expect("the executor is told");
    assert_eq!(
        (end["status"].as_str(), end["session_id"].as_str()),
        (Some("failed"), Some("s-b"))
    );
    assert!(
        end["error"]
            .as_str()
            .is_some_and(|e| e.contains("requester")),
        "{end}"
    );
    let t = task(&stack, "s-b").await;
    assert_eq!(t["state"], "canceled", "{t}");
    stack.stop().await;
}
both_backends!(requester_disconnect_cancels_and_tells_the_executor);

async fn silent_executor_times_out(backend: Backend) {
    let stack = Stack::start(
        backend,
        Options {
            command_timeout_secs: 1,
            ..Options::default()
        },
    )
    .await
    .expect("stack");
    let (mut dev, mut galaxy, _) = running_task(&stack, "pc-c", "s-c").await;
    let end = galaxy.recv_type("task_end").await.expect("task_end");
    assert_eq!(end["status"], "failed");
    assert!(
        end["error"]
            .as_str()
            .is_some_and(|e| e.contains("no results for command")),
        "{end}"
    );
    assert_eq!(
        dev.recv_type("task_end").await.expect("executor told")["session_id"],
        "s-c"
    );
    let t = task(&stack, "s-c").await;
    assert_eq!(t["error_code"], "TASK_TIMEOUT", "{t}");
    stack.stop().await;
}
both_backends!(silent_executor_times_out);

async fn rest_cancel_ends_the_task_for_everyone(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let (mut dev, mut galaxy, command) = running_task(&stack, "pc-d", "s-d").await;
    let url = format!("{}/api/tasks/s-d/cancel", stack.sessions_url());
    let (status, t) = post_json(&url, &json!({ "reason": "operator said so" })).await;
    assert_eq!(
        (status, t["state"].as_str()),
        (200, Some("canceled")),
        "{t}"
    );
    for client in [&mut galaxy, &mut dev] {
        let end = client.recv_type("task_end").await.expect("task_end");
        assert_eq!(end["error"], "canceled: operator said so");
    }
    let (status, error) = post_json(&url, &json!({})).await;
    assert_eq!(
        (status, error["error_code"].as_str()),
        (409, Some("CONFLICT")),
        "{error}"
    );
    // Late results for the canceled task are refused, and say why.
    dev.send(&command_results_for("pc-d", &command))
        .await
        .expect("send");
    let refusal = dev.recv_type("error").await.expect("refusal");
    assert!(
        refusal["error"]
            .as_str()
            .is_some_and(|e| e.contains("already ended")),
        "{refusal}"
    );
    stack.stop().await;
}
both_backends!(rest_cancel_ends_the_task_for_everyone);

async fn bad_input_is_refused_and_disturbs_nothing(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let (mut dev, mut galaxy, command) = running_task(&stack, "pc-e", "s-e").await;
    let base = stack.sessions_url();
    let (status, body) = get_json(&format!("{base}/api/tasks/nope")).await;
    assert_eq!(
        (status, body["error_code"].as_str()),
        (404, Some("NOT_FOUND"))
    );
    let (status, _) = get_json(&format!("{base}/api/task_result/.hidden")).await;
    assert_eq!(status, 400);
    let (status, body) = post_json(
        &format!("{base}/api/tasks"),
        &json!({ "version": 1, "description": "x",
        "originating_agent_id": "t", "target_id": "pc-e", "task_name": "bad name" }),
    )
    .await;
    assert_eq!(status, 400, "{body}");

    // Results from someone who is not the executor.
    let mut other =
        Client::registered(&stack.ws_url(0), device_register("intruder", "linux")).await;
    let mut forged = command_results_for("intruder", &command);
    other.send(&forged).await.expect("send");
    let refusal = other.recv_type("error").await.expect("refusal");
    assert_eq!(refusal["metadata"]["error_code"], "FORBIDDEN");
    assert!(
        refusal["error"]
            .as_str()
            .is_some_and(|e| e.contains("not the executor")),
        "{refusal}"
    );
    // Results for a session nobody knows.
    forged["session_id"] = json!("no-such-session");
    other.send(&forged).await.expect("send");
    let refusal = other.recv_type("error").await.expect("refusal");
    assert_eq!(refusal["metadata"]["error_code"], "NOT_FOUND", "{refusal}");
    // A TASK for an offline device: an ERROR and a failed task_end, with UFO's text.
    galaxy
        .send(&constellation_task(
            "g@pc-e",
            "ghost",
            "s-ghost",
            "t2",
            Some(one_step("x", json!({}))),
        ))
        .await
        .expect("send");
    let error = galaxy.recv_type("error").await.expect("error");
    assert_eq!(error["error"], "Target device 'ghost' is not connected");
    let end = galaxy.recv_type("task_end").await.expect("task_end");
    assert_eq!(
        (end["session_id"].as_str(), end["status"].as_str()),
        (Some("s-ghost"), Some("failed"))
    );

    // The real task is undisturbed: the executor answers and the task goes on.
    dev.send(&command_results_for("pc-e", &command))
        .await
        .expect("send");
    let second = dev.recv_type("command").await.expect("next command");
    dev.send(&command_results_for("pc-e", &second))
        .await
        .expect("send");
    assert_eq!(
        galaxy.recv_type("task_end").await.expect("end")["status"],
        "completed"
    );
    stack.stop().await;
}
both_backends!(bad_input_is_refused_and_disturbs_nothing);

async fn one_task_at_a_time_per_device_in_priority_order(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let mut dev = Client::registered(&stack.ws_url(0), device_register("pc-f", "linux")).await;
    stack.wait_online("pc-f").await;
    let base = stack.sessions_url();
    let mut ids = Vec::new();
    for (name, priority) in [("first", 0), ("low", 1), ("high", 9)] {
        let body = json!({ "version": 1, "description": name, "originating_agent_id": "t", "target_id": "pc-f",
            "priority": priority, "task_name": name, "steps": one_step("echo", json!({ "name": name })) });
        let (status, t) = post_json(&format!("{base}/api/tasks"), &body).await;
        assert_eq!(status, 201, "{t}");
        ids.push(t["task_id"].as_str().expect("id").to_owned());
    }
    assert_eq!(
        task(&stack, &ids[1]).await["state"],
        "submitted",
        "waits while the device is busy"
    );
    let mut order = Vec::new();
    for _ in 0..3 {
        let command = dev.recv_type("command").await.expect("command");
        order.push(
            command["actions"][0]["parameters"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        );
        dev.send(&command_results_for("pc-f", &command))
            .await
            .expect("results");
    }
    assert_eq!(order, ["first", "high", "low"]);
    stack.stop().await;
}
both_backends!(one_task_at_a_time_per_device_in_priority_order);

async fn remote_planner_drives_the_task_and_its_absence_fails_clearly(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let mut dev = Client::registered(&stack.ws_url(0), device_register("pc-g", "mobile")).await;
    stack.wait_online("pc-g").await;
    let base = stack.sessions_url();
    let submit = || {
        let body = json!({ "version": 1, "description": "plan me", "originating_agent_id": "t", "target_id": "pc-g" });
        let url = format!("{base}/api/tasks");
        async move { post_json(&url, &body).await }
    };

    // No planner: failed, and the error says what to do.
    let (_, t) = submit().await;
    let id = t["task_id"].as_str().expect("id").to_owned();
    let failed = eventually("failed", || async {
        let t = task(&stack, &id).await;
        (t["state"] == "failed").then_some(t)
    })
    .await
    .expect("fails");
    assert!(
        failed["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("no planner is running")),
        "{failed}"
    );

    // A planner on the bus: one step, then complete.
    let mut requests = stack
        .bus
        .queue_subscribe(format!("{}.planner.next", stack.prefix), "planners".into())
        .await
        .expect("sub");
    let bus = stack.bus.clone();
    let planner = tokio::spawn(async move {
        while let Some(m) = requests.next().await {
            let request: Value = serde_json::from_slice(&m.payload).expect("PlanRequest");
            let reply = if request["step"] == 0 {
                json!({ "ok": { "decision": "commands", "actions": [{ "tool_name": "tap", "tool_type": "action" }] } })
            } else {
                json!({ "ok": { "decision": "complete", "result": { "saw": request["last_results"][0]["status"] } } })
            };
            aip_bus::respond(bus.as_ref(), &m, Headers::new(), reply.to_string().into())
                .await
                .expect("reply");
        }
    });
    let (_, t) = submit().await;
    let id = t["task_id"].as_str().expect("id").to_owned();
    let command = dev.recv_type("command").await.expect("command");
    assert_eq!(command["agent_name"], "MobileAgent");
    dev.send(&command_results_for("pc-g", &command))
        .await
        .expect("results");
    let done = eventually("completed", || async {
        let t = task(&stack, &id).await;
        (t["state"] == "completed").then_some(t)
    })
    .await
    .expect("completes");
    assert_eq!(done["result"], json!({ "saw": "success" }));
    planner.abort();
    stack.stop().await;
}
both_backends!(remote_planner_drives_the_task_and_its_absence_fails_clearly);

async fn requester_drives_the_task_over_rest(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let mut dev = Client::registered(&stack.ws_url(0), device_register("pc-h", "linux")).await;
    stack.wait_online("pc-h").await;
    let base = stack.sessions_url();
    let body = json!({ "version": 1, "description": "driven", "originating_agent_id": "agent", "target_id": "pc-h", "driver": true });
    let (status, t) = post_json(&format!("{base}/api/tasks"), &body).await;
    assert_eq!(status, 201, "{t}");
    let id = t["task_id"].as_str().expect("id").to_owned();

    let device = tokio::spawn(async move {
        // Answer the first command; ignore the second (it times out).
        let command = dev.recv_type("command").await.expect("command");
        dev.send(&command_results_for("pc-h", &command))
            .await
            .expect("results");
        let _ignored = dev.recv_type("command").await.expect("second command");
        dev
    });
    let call = json!({ "actions": [{ "tool_name": "echo", "tool_type": "action", "parameters": { "v": 7 } }] });
    let (status, answer) = post_json(&format!("{base}/api/tasks/{id}/commands"), &call).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["results"][0]["status"], "success");
    assert_eq!(answer["results"][0]["result"]["echo"]["v"], 7);

    let mut slow = call.clone();
    slow["timeout_secs"] = json!(1);
    let (status, error) = post_json(&format!("{base}/api/tasks/{id}/commands"), &slow).await;
    assert_eq!(
        (status, error["error_code"].as_str()),
        (504, Some("TASK_TIMEOUT")),
        "{error}"
    );
    let (status, error) = post_json(&format!("{base}/api/tasks/{id}/commands"), &call).await;
    assert_eq!(status, 409, "one command at a time: {error}");
    let mut dev = device.await.expect("device");

    let (status, done) = post_json(
        &format!("{base}/api/tasks/{id}/complete"),
        &json!({ "result": { "ok": true } }),
    )
    .await;
    assert_eq!(
        (status, done["state"].as_str()),
        (200, Some("completed")),
        "{done}"
    );
    assert_eq!(
        dev.recv_type("task_end").await.expect("executor told")["status"],
        "completed"
    );

    // A planner-driven task takes no commands over REST.
    let body = json!({ "version": 1, "description": "scripted", "originating_agent_id": "agent", "target_id": "pc-h",
        "steps": one_step("echo", json!({})) });
    let (_, t) = post_json(&format!("{base}/api/tasks"), &body).await;
    let other = t["task_id"].as_str().expect("id");
    let (status, error) = post_json(&format!("{base}/api/tasks/{other}/commands"), &call).await;
    assert_eq!(
        (status, error["error_code"].as_str()),
        (409, Some("CONFLICT")),
        "{error}"
    );
    stack.stop().await;
}
both_backends!(requester_drives_the_task_over_rest);

async fn nats_submission_and_the_event_stream(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let mut dev = Client::registered(&stack.ws_url(0), device_register("pc-i", "linux")).await;
    stack.wait_online("pc-i").await;
    let subject = format!("{}.sessions.submit", stack.prefix);
    let request = json!({ "version": 1, "description": "over nats", "originating_agent_id": "llm-agent",
        "target_id": "pc-i", "steps": one_step("echo", json!({ "n": 1 })) });
    let reply = stack
        .bus
        .request(
            subject.clone(),
            Headers::new(),
            request.to_string().into(),
            std::time::Duration::from_secs(10),
        )
        .await
        .expect("reply");
    let reply: Value = serde_json::from_slice(&reply.payload).expect("json");
    let id = reply["ok"]["task_id"]
        .as_str()
        .unwrap_or_else(|| panic!("accepted: {reply}"))
        .to_owned();
    assert_eq!(reply["ok"]["executor_id"], "pc-i");

    // Follow it as Server-Sent Events while the device works.
    let url = format!("{}/api/tasks/{id}/events/stream", stack.sessions_url());
    let stream = tokio::spawn(async move {
        reqwest::get(url)
            .await
            .expect("sse")
            .text()
            .await
            .expect("body")
    });
    let command = dev.recv_type("command").await.expect("command");
    dev.send(&command_results_for("pc-i", &command))
        .await
        .expect("results");
    let body = tokio::time::timeout(aip_testkit::WAIT, stream)
        .await
        .expect("the stream ends")
        .expect("task");
    let ids: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("id: ").or_else(|| l.strip_prefix("id:")))
        .collect();
    assert_eq!(ids, ["1", "2", "3", "4", "5"], "{body}");
    assert!(body.contains("event: completed"), "{body}");
    // Resuming after sequence 3 gives the rest only.
    let resumed = reqwest::Client::new()
        .get(format!(
            "{}/api/tasks/{id}/events/stream",
            stack.sessions_url()
        ))
        .header("Last-Event-ID", "3")
        .send()
        .await
        .expect("sse")
        .text()
        .await
        .expect("body");
    assert!(
        resumed.contains("id: 4") && resumed.contains("id: 5") && !resumed.contains("id: 3"),
        "{resumed}"
    );

    // A bad submission gets a clear error reply.
    let reply = stack
        .bus
        .request(
            subject,
            Headers::new(),
            "{\"version\":2}".into(),
            std::time::Duration::from_secs(10),
        )
        .await
        .expect("reply");
    assert_eq!(reply.headers.get("Aip-Error-Code"), Some("INVALID_REQUEST"));
    let reply: Value = serde_json::from_slice(&reply.payload).expect("json");
    assert!(
        reply["error"]["detail"]
            .as_str()
            .is_some_and(|d| d.contains("version")),
        "{reply}"
    );
    stack.stop().await;
}
both_backends!(nats_submission_and_the_event_stream);

fn one_event_watcher(s: &mut aip_sessions::SessionSettings) {
    s.max_event_watchers = 1;
}

/// Issue 21: requests that wait for events (streams, command waits) are bounded; one more is
/// refused with RATE_LIMITED, and room comes back when a stream ends.
async fn waiting_requests_are_bounded(backend: Backend) {
    let options = Options {
        sessions_settings: Some(one_event_watcher),
        ..Options::default()
    };
    let stack = Stack::start(backend, options).await.expect("stack");
    let mut dev = Client::registered(&stack.ws_url(0), device_register("pc-w", "linux")).await;
    stack.wait_online("pc-w").await;
    let base = stack.sessions_url();
    let body = json!({ "version": 1, "description": "watched", "originating_agent_id": "t",
        "target_id": "pc-w", "steps": one_step("echo", json!({})) });
    let (status, task) = post_json(&format!("{base}/api/tasks"), &body).await;
    assert_eq!(status, 201, "{task}");
    let stream_url = format!(
        "{base}/api/tasks/{}/events/stream",
        task["task_id"].as_str().expect("id")
    );
    let first = reqwest::get(&stream_url).await.expect("first stream");
    assert_eq!(first.status(), 200);
    let (status, refusal) = get_json(&stream_url).await;
    assert_eq!(status, 429, "{refusal}");
    assert_eq!(refusal["error_code"], "RATE_LIMITED");
    assert!(
        refusal["detail"]
            .as_str()
            .is_some_and(|d| d.contains("max_event_watchers")),
        "{refusal}"
    );
    // The task ends; its stream ends with it, and gives its place back.
    let command = dev.recv_type("command").await.expect("command");
    dev.send(&command_results_for("pc-w", &command))
        .await
        .expect("results");
    let text = tokio::time::timeout(aip_testkit::WAIT, first.text())
        .await
        .expect("the stream ends")
        .expect("body");
    assert!(text.contains("event: completed"), "{text}");
    eventually("room for another stream", || {
        let url = stream_url.clone();
        async move { (get_json_status(&url).await == 200).then_some(()) }
    })
    .await
    .expect("a new stream is served");
    stack.stop().await;
}
both_backends!(waiting_requests_are_bounded);

/// The status of a GET (the body is read to its end: a finished task's stream ends).
async fn get_json_status(url: &str) -> u16 {
    let response = reqwest::get(url).await.expect("GET");
    let status = response.status().as_u16();
    let _ = response.text().await;
    status
}
