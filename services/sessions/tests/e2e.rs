//! The session service end to end: UFO-format clients over real WebSockets, two gateways,
//! the registry and the session service on one bus and database (NATS + PostgreSQL, and the
//! in-process bus + SQLite), results over REST.

use aip_testkit::frames::{
    self, command_results_for, constellation_register, constellation_task, device_register,
    one_step,
};
use aip_testkit::{
    Backend, Client, Options, Stack, both_backends, eventually, get_json, post_json,
};
use serde_json::{Value, json};

async fn constellation_drives_a_device_on_another_gateway(backend: Backend) {
    let stack = Stack::start(backend, Options::with_gateways(2))
        .await
        .expect("stack");
    let mut device = Client::registered(&stack.ws_url(1), device_register("pc-1", "linux")).await;
    stack.wait_online("pc-1").await;
    let mut galaxy = Client::registered(
        &stack.ws_url(0),
        constellation_register("demo@pc-1", Some("pc-1")),
    )
    .await;

    let session = "demo@task-1";
    let steps = json!([
        [{ "tool_name": "list_tools", "tool_type": "action", "parameters": { "tool_type": "action" } }],
        [{ "tool_name": "type_text", "tool_type": "action", "parameters": { "text": "hello" } },
         { "tool_name": "screenshot", "tool_type": "data_collection" }]
    ]);
    galaxy
        .send(&constellation_task(
            "demo@pc-1",
            "pc-1",
            session,
            "demo_task",
            Some(steps),
        ))
        .await
        .expect("send task");
    let ack = galaxy.recv().await.expect("ack");
    assert_eq!(ack["type"], "heartbeat");
    assert_eq!(
        ack["session_id"], session,
        "Galaxy's session id is kept as given"
    );

    for expected in [1, 2] {
        let command = device.recv().await.expect("command");
        assert_eq!(
            command["type"], "command",
            "the executor gets only command frames: {command}"
        );
        assert_eq!(command["session_id"], session);
        assert_eq!(
            command["agent_name"], "LinuxAgent",
            "agent_name follows the device's platform"
        );
        let actions = command["actions"].as_array().expect("actions");
        assert_eq!(actions.len(), expected);
        assert!(
            actions.iter().all(|a| a["call_id"].is_string()),
            "every Command has a call_id"
        );
        device
            .send(&command_results_for("pc-1", &command))
            .await
            .expect("results");
    }

    for client in [&mut galaxy, &mut device] {
        let end = client.recv_type("task_end").await.expect("task_end");
        assert_eq!(end["status"], "completed");
        assert_eq!(end["session_id"], session);
    }

    let base = stack.sessions_url();
    let (status, task) = get_json(&format!("{base}/api/tasks/{}", urlencode(session))).await;
    assert_eq!(status, 200, "{task}");
    assert_eq!(task["state"], "completed");
    assert_eq!(task["executor_id"], "pc-1");
    assert_eq!(task["requester"], "demo@pc-1");
    assert_eq!(
        task["result"].as_array().map(Vec::len),
        Some(2),
        "both steps' results: {task}"
    );
    let (_, log) = get_json(&format!("{base}/api/tasks/{}/events", urlencode(session))).await;
    let kinds: Vec<&str> = log["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["kind"].as_str())
        .collect();
    assert_eq!(
        kinds,
        [
            "submitted",
            "dispatched",
            "command_sent",
            "results_received",
            "command_sent",
            "results_received",
            "completed"
        ]
    );
    let seqs: Vec<i64> = log["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["seq"].as_i64())
        .collect();
    assert_eq!(seqs, (1..=7).collect::<Vec<_>>(), "gap-free");
    // Small data is stored in the events themselves: each step's results, and the result
    // and (absent) error of the end.
    let events = log["events"].as_array().expect("events");
    let received: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "results_received")
        .map(|e| &e["data"])
        .collect();
    assert_eq!(received, [&task["result"][0], &task["result"][1]], "{log}");
    let completed = &events[6]["data"];
    assert_eq!(completed["result"], task["result"], "{log}");
    assert_eq!(
        (&completed["error"], &completed["error_code"]),
        (&Value::Null, &Value::Null),
        "{log}"
    );
    let (status, result) = get_json(&format!("{base}/api/task_result/demo_task")).await;
    assert_eq!(status, 200);
    assert_eq!(result["status"], "done");
    stack.stop().await;
}
both_backends!(constellation_drives_a_device_on_another_gateway);

/// The session service keeps the registry's record of a task's target for a moment
/// (`targets.rs`): a device that left and came back on a new connection gets the next task on
/// it, and once it left for good a task for it is refused at once, not sent to a dead
/// connection.
async fn a_device_that_reconnects_gets_the_next_task_and_one_that_left_is_refused(
    backend: Backend,
) {
    let stack = Stack::start(backend, Options::with_gateways(2))
        .await
        .expect("stack");
    let mut galaxy = None;
    let mut device = Client::registered(&stack.ws_url(1), device_register("pc-1", "linux")).await;
    stack.wait_online("pc-1").await;
    for (round, gateway) in [(1, 0), (2, 1)] {
        let galaxy = match &mut galaxy {
            Some(galaxy) => galaxy,
            None => galaxy.insert(
                Client::registered(
                    &stack.ws_url(0),
                    constellation_register("demo@pc-1", Some("pc-1")),
                )
                .await,
            ),
        };
        let session = format!("demo@round-{round}");
        galaxy
            .send(&constellation_task(
                "demo@pc-1",
                "pc-1",
                &session,
                "demo_task",
                Some(one_step("echo", json!({ "n": 1 }))),
            ))
            .await
            .expect("send task");
        let command = device.recv_type("command").await.expect("command");
        assert_eq!(command["session_id"], session.as_str());
        device
            .send(&command_results_for("pc-1", &command))
            .await
            .expect("results");
        let end = galaxy.recv_type("task_end").await.expect("task_end");
        assert_eq!(end["status"], "completed", "round {round}: {end}");
        // The device leaves and comes back at once, on a new connection elsewhere.
        device.close().await;
        stack.wait_offline("pc-1").await;
        device = Client::registered(&stack.ws_url(gateway), device_register("pc-1", "linux")).await;
        stack.wait_online("pc-1").await;
    }
    // Gone for good: the next task is refused at once.
    device.close().await;
    stack.wait_offline("pc-1").await;
    let galaxy = galaxy.as_mut().expect("galaxy");
    galaxy
        .send(&constellation_task(
            "demo@pc-1",
            "pc-1",
            "demo@round-3",
            "demo_task",
            Some(one_step("echo", json!({ "n": 1 }))),
        ))
        .await
        .expect("send task");
    let answer = galaxy.recv().await.expect("answer");
    assert_eq!(
        answer["error"], "Target device 'pc-1' is not connected",
        "{answer}"
    );
    stack.stop().await;
}
both_backends!(a_device_that_reconnects_gets_the_next_task_and_one_that_left_is_refused);

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

async fn rest_dispatch_by_capability_and_ufo_dispatch(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let mut device = Client::registered(
        &stack.ws_url(0),
        frames::device_register_with("excel-box", &["excel"]),
    )
    .await;
    stack.wait_online("excel-box").await;
    let base = stack.sessions_url();

    // By capability, no target.
    let body = json!({ "version": 1, "description": "make a chart", "originating_agent_id": "tester",
        "required_capabilities": ["excel"], "steps": one_step("echo", json!({ "x": 1 })), "task_name": "chart-1" });
    let (status, task) = post_json(&format!("{base}/api/tasks"), &body).await;
    assert_eq!(status, 201, "{task}");
    assert_eq!(task["executor_id"], "excel-box");
    let command = device.recv_type("command").await.expect("command");
    device
        .send(&command_results_for("excel-box", &command))
        .await
        .expect("results");
    let end = device
        .recv_type("task_end")
        .await
        .expect("the executor is told");
    assert_eq!(end["status"], "completed");
    let id = task["task_id"].as_str().expect("id").to_owned();
    let done = eventually("completed over REST", || async {
        let (_, t) = get_json(&format!("{base}/api/tasks/{id}")).await;
        (t["state"] == "completed").then_some(t)
    })
    .await
    .expect("completed");
    assert_eq!(done["result"][0]["results"][0]["result"]["echo"]["x"], 1);

    // Nobody has the capability.
    let body = json!({ "version": 1, "description": "x", "originating_agent_id": "tester", "required_capabilities": ["quantum"] });
    let (status, error) = post_json(&format!("{base}/api/tasks"), &body).await;
    assert_eq!(
        (status, error["error_code"].as_str()),
        (422, Some("CAPABILITY_MISMATCH")),
        "{error}"
    );

    // UFO's dispatch: server task frame, the device echoes it, the dispatched session goes on.
    let (status, dispatched) = post_json(
        &format!("{base}/api/dispatch"),
        &json!({ "client_id": "excel-box", "request": "say hi", "task_name": "ufo-1", "steps": one_step("echo", json!({})) }),
    )
    .await;
    assert_eq!(status, 200, "{dispatched}");
    assert_eq!(dispatched["status"], "dispatched");
    let session = dispatched["session_id"]
        .as_str()
        .expect("session")
        .to_owned();
    let task_frame = device.recv_type("task").await.expect("server task frame");
    assert_eq!(task_frame["session_id"], session.as_str());
    assert_eq!(task_frame["user_request"], "say hi");
    device
        .send(&frames::client(json!({ "type": "task", "status": "continue", "client_id": "excel-box", "request": "say hi",
            "task_name": "ufo-1", "metadata": { "platform": "linux" } })))
        .await
        .expect("echo");
    let ack = device.recv_type("heartbeat").await.expect("ack");
    assert_eq!(
        ack["session_id"],
        session.as_str(),
        "the echo continues the dispatched session"
    );
    let command = device.recv_type("command").await.expect("command");
    device
        .send(&command_results_for("excel-box", &command))
        .await
        .expect("results");
    let end = device.recv_type("task_end").await.expect("end");
    assert_eq!(end["session_id"], session.as_str());
    let (_, result) = get_json(&format!("{base}/api/task_result/ufo-1")).await;
    assert_eq!(result["status"], "done", "{result}");

    // UFO's dispatch errors, in UFO's order and words.
    for (body, status, detail) in [
        (
            json!({ "client_id": "excel-box", "request": "" }),
            400,
            "Empty task content",
        ),
        (
            json!({ "client_id": "", "request": "x" }),
            400,
            "Empty client ID",
        ),
        (
            json!({ "client_id": "excel-box", "request": "x", "task_name": null }),
            400,
            "Invalid task_name",
        ),
        (
            json!({ "client_id": "ghost", "request": "x" }),
            404,
            "Client not online",
        ),
    ] {
        let (got, error) = post_json(&format!("{base}/api/dispatch"), &body).await;
        assert_eq!(got, status, "{body} → {error}");
        assert!(
            error["detail"]
                .as_str()
                .is_some_and(|d| d.starts_with(detail)),
            "{error}"
        );
    }
    let (status, _) = post_json(&format!("{base}/api/dispatch"), &json!([1, 2])).await;
    assert_eq!(status, 422);
    stack.stop().await;
}
both_backends!(rest_dispatch_by_capability_and_ufo_dispatch);

async fn frames_larger_than_a_bus_message_travel_both_ways(backend: Backend) {
    let stack = Stack::start(backend, Options::with_gateways(2))
        .await
        .expect("stack");
    let mut device =
        Client::registered(&stack.ws_url(1), device_register("cam-1", "windows")).await;
    stack.wait_online("cam-1").await;
    let mut galaxy = Client::registered(
        &stack.ws_url(0),
        constellation_register("g@cam-1", Some("cam-1")),
    )
    .await;
    galaxy
        .send(&constellation_task(
            "g@cam-1",
            "cam-1",
            "big-1",
            "big",
            Some(one_step("screenshot", json!({}))),
        ))
        .await
        .expect("task");
    let command = device.recv_type("command").await.expect("command");
    // A 3 MiB screenshot: three times what one NATS message carries.
    let screenshot = "A".repeat(3 * 1024 * 1024);
    let mut results = command_results_for("cam-1", &command);
    results["action_results"][0]["result"] = json!({ "png_base64": screenshot });
    device.send(&results).await.expect("send 3 MiB");
    let end = galaxy
        .recv_type("task_end")
        .await
        .expect("task_end with the screenshot");
    assert_eq!(end["status"], "completed");
    assert_eq!(
        end["result"][0]["results"][0]["result"]["png_base64"]
            .as_str()
            .map(str::len),
        Some(screenshot.len())
    );
    let (_, task) = get_json(&format!("{}/api/tasks/big-1", stack.sessions_url())).await;
    assert_eq!(
        task["result"][0]["results"][0]["result"]["png_base64"]
            .as_str()
            .map(str::len),
        Some(screenshot.len())
    );
    // The events carry the screenshot too: the step's results and the ended task's result.
    let (_, log) = get_json(&format!("{}/api/tasks/big-1/events", stack.sessions_url())).await;
    let events = log["events"].as_array().expect("events");
    let of_kind = |kind: &str| {
        events
            .iter()
            .find(|e| e["kind"] == kind)
            .unwrap_or_else(|| panic!("a {kind} event in {log}"))
    };
    assert_eq!(
        of_kind("results_received")["data"]["results"][0]["result"]["png_base64"]
            .as_str()
            .map(str::len),
        Some(screenshot.len())
    );
    assert_eq!(of_kind("completed")["data"]["result"], task["result"]);
    assert_eq!(of_kind("results_received")["data"], task["result"][0]);
    // ...but the database holds it once: as the task's history, not in its result or events.
    let db = aip_store::Database::connect(&stack.database_url)
        .await
        .expect("the stack's database");
    let events_bytes = aip_store::Sql::same(
        "SELECT CAST(COALESCE(SUM(LENGTH(CAST(data AS TEXT))), 0) AS BIGINT) FROM task_events \
         WHERE task_id = 'big-1'",
    );
    let (stored,): (i64,) = db
        .query(&events_bytes)
        .fetch_one()
        .await
        .expect("event sizes");
    assert!(stored < 64 * 1024, "events store {stored} bytes");
    let task_bytes = aip_store::Sql::same(
        "SELECT CAST(COALESCE(LENGTH(CAST(result AS TEXT)), 0) + LENGTH(CAST(history AS TEXT)) \
         AS BIGINT) FROM tasks WHERE task_id = 'big-1'",
    );
    let (row,): (i64,) = db.query(&task_bytes).fetch_one().await.expect("task size");
    // On PostgreSQL results over 1 MiB are kept apart, in `task_results`, and the row holds
    // a marker; on SQLite they stay in the row.
    let apart = match backend {
        Backend::NatsPostgres => {
            let parts = aip_store::Sql::same(
                "SELECT CAST(COALESCE(SUM(LENGTH(body)), 0) AS BIGINT) FROM task_results \
                 WHERE task_id = 'big-1'",
            );
            let (apart,): (i64,) = db.query(&parts).fetch_one().await.expect("parts");
            assert!(
                row < 4096,
                "the task's row stores {row} bytes beside its parts"
            );
            apart
        }
        Backend::LocalSqlite => 0,
    };
    let stored = row + apart;
    assert!(
        (screenshot.len()..screenshot.len() + 64 * 1024).contains(&(stored as usize)),
        "the task's row and its parts store {stored} bytes"
    );
    stack.stop().await;
}
both_backends!(frames_larger_than_a_bus_message_travel_both_ways);
