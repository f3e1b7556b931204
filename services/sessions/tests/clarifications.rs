//! Clarifications as the parties see them, over real WebSockets, REST and NATS, on both
//! backends: a planner asks three times (answered by frame, over REST and over NATS), a
//! stranger's and a
//! stale answer are refused, an unanswered question fails its task at its deadline, an executor
//! asks in the middle of a command, and a plain UFO requester never sees an extension frame.

use aip_bus::Headers;
use aip_testkit::frames::{
    command_results_for, constellation_register, constellation_task, device_register,
};
use aip_testkit::{Backend, Client, Options, Stack, both_backends, get_json, post_json};
use futures::StreamExt;
use serde_json::{Value, json};

/// A register frame announcing the `clarification` extension.
fn with_clarification(mut register: Value) -> Value {
    register["metadata"]["aip_extensions"] = json!(["clarification"]);
    register
}

/// A NATS planner that asks, for each step, the question its script names, then completes
/// with every answer it got; the requests it got come out of the channel.
fn asking_planner(
    stack: &Stack,
    questions: &'static [&'static str],
) -> tokio::sync::mpsc::UnboundedReceiver<Value> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let bus = stack.bus.clone();
    let subject = format!("{}.planner.next", stack.prefix);
    tokio::spawn(async move {
        let mut requests = bus
            .queue_subscribe(subject, "planners".into())
            .await
            .expect("sub");
        while let Some(m) = requests.next().await {
            let request: Value = serde_json::from_slice(&m.payload).expect("PlanRequest");
            let step = request["step"].as_u64().unwrap_or(0) as usize;
            let decision = match questions.get(step) {
                Some(question) => json!({ "decision": "clarify", "question": question,
                    "data": { "step": step }, "call_id": format!("q{step}") }),
                None => json!({ "decision": "complete", "result": { "done": true } }),
            };
            let _ = tx.send(request);
            aip_bus::respond(
                bus.as_ref(),
                &m,
                Headers::new(),
                json!({ "ok": decision }).to_string().into(),
            )
            .await
            .expect("reply");
        }
    });
    rx
}

async fn rounds_by_frame_rest_and_nats_and_strangers_are_refused(backend: Backend) {
    // The device and the constellation on two gateways.
    let stack = Stack::start(backend, Options::with_gateways(2))
        .await
        .expect("stack");
    let mut requests = asking_planner(&stack, &["Which file?", "Which folder?", "Which name?"]);
    let _dev = Client::registered(&stack.ws_url(1), device_register("q-pc", "linux")).await;
    stack.wait_online("q-pc").await;
    let galaxy_id = "g@q-pc";
    let mut galaxy = Client::registered(
        &stack.ws_url(0),
        with_clarification(constellation_register(galaxy_id, Some("q-pc"))),
    )
    .await;
    galaxy
        .send(&constellation_task(galaxy_id, "q-pc", "s-q", "t", None))
        .await
        .expect("task");

    // Round 1: the question reaches the requester as a frame; it answers by frame.
    let asked = galaxy
        .recv_type("clarification_request")
        .await
        .expect("the question, by frame");
    assert_eq!(asked["session_id"], "s-q");
    assert_eq!(asked["user_request"], "Which file?");
    assert_eq!(asked["metadata"]["question"], "Which file?");
    assert_eq!(asked["metadata"]["data"], json!({ "step": 0 }));
    assert_eq!(asked["metadata"]["requested_by"], "planner");
    let first = asked["metadata"]["clarification_id"]
        .as_str()
        .expect("id")
        .to_owned();
    let waiting = stack.task_in_state("s-q", "input_required").await;
    assert_eq!(waiting["clarification"]["clarification_id"], first.as_str());

    // A stranger (another constellation) cannot answer.
    let stranger_id = "other@q-pc";
    let mut stranger = Client::registered(
        &stack.ws_url(0),
        with_clarification(constellation_register(stranger_id, Some("q-pc"))),
    )
    .await;
    let answer = |id: &str, session: &str, qid: &str, text: &str| {
        json!({ "type": "clarification_response", "status": "continue", "client_type": "constellation",
            "client_id": id, "session_id": session, "request": text,
            "metadata": { "clarification_id": qid } })
    };
    stranger
        .send(&answer(stranger_id, "s-q", &first, "evil.txt"))
        .await
        .expect("send");
    let refused = stranger.recv_type("error").await.expect("refused");
    assert_eq!(refused["metadata"]["error_code"], "FORBIDDEN", "{refused}");
    assert_eq!(stack.task("s-q").await["state"], "input_required");

    galaxy
        .send(&answer(galaxy_id, "s-q", &first, "report.txt"))
        .await
        .expect("answer");

    // Round 2: answered over REST; the old question's id is refused.
    let asked = galaxy
        .recv_type("clarification_request")
        .await
        .expect("the second question");
    assert_eq!(asked["metadata"]["question"], "Which folder?");
    let second = asked["metadata"]["clarification_id"]
        .as_str()
        .expect("id")
        .to_owned();
    assert_ne!(first, second);
    let base = stack.sessions_url();
    let (status, stale) = post_json(
        &format!("{base}/api/tasks/s-q/clarifications/{first}"),
        &json!({ "answer": "again" }),
    )
    .await;
    assert_eq!(
        (status, stale["error_code"].as_str()),
        (409, Some("CONFLICT")),
        "{stale}"
    );
    let (status, empty) = post_json(
        &format!("{base}/api/tasks/s-q/clarifications/{second}"),
        &json!({ "answer": "  " }),
    )
    .await;
    assert_eq!(status, 400, "{empty}");
    let (status, going) = post_json(
        &format!("{base}/api/tasks/s-q/clarifications/{second}"),
        &json!({ "answer": "/home/me", "provided_by": "ops" }),
    )
    .await;
    assert_eq!(status, 200, "{going}");
    let (status, twice) = post_json(
        &format!("{base}/api/tasks/s-q/clarifications/{second}"),
        &json!({ "answer": "/tmp" }),
    )
    .await;
    assert!(
        matches!(status, 404 | 409),
        "accepted once: {status} {twice}"
    );

    // Round 3: answered over NATS.
    let asked = galaxy
        .recv_type("clarification_request")
        .await
        .expect("the third question");
    let third = asked["metadata"]["clarification_id"].as_str().expect("id");
    let response = json!({ "version": 1, "task_id": "s-q", "clarification_id": third,
        "answer": "notes.md", "provided_by": "assistant" });
    let ask = || {
        stack.bus.request(
            format!("{}.sessions.clarify", stack.prefix),
            Headers::new(),
            response.to_string().into(),
            std::time::Duration::from_secs(5),
        )
    };
    let reply = ask().await.expect("an answer over NATS");
    let reply: Value = serde_json::from_slice(&reply.payload).expect("json");
    assert_eq!(reply["ok"]["state"], "working", "{reply}");
    let reply = ask().await.expect("a reply");
    let reply: Value = serde_json::from_slice(&reply.payload).expect("json");
    assert!(
        reply["error"]["error_code"].is_string(),
        "accepted once: {reply}"
    );

    let end = galaxy.recv_type("task_end").await.expect("task_end");
    assert_eq!(end["status"], "completed", "{end}");

    // The planner saw each answer as the Result of its question, with its call id.
    let asked_requests: Vec<Value> = std::iter::from_fn(|| requests.try_recv().ok()).collect();
    assert_eq!(asked_requests.len(), 4, "{asked_requests:?}");
    let answer_of = |r: &Value| r["last_results"][0].clone();
    assert_eq!(answer_of(&asked_requests[1])["call_id"], "q0");
    assert_eq!(
        answer_of(&asked_requests[1])["result"]["answer"],
        "report.txt"
    );
    assert_eq!(
        answer_of(&asked_requests[1])["result"]["provided_by"],
        galaxy_id
    );
    assert_eq!(
        answer_of(&asked_requests[2])["result"]["answer"],
        "/home/me"
    );
    assert_eq!(
        answer_of(&asked_requests[2])["result"]["provided_by"],
        "rest:ops"
    );
    assert_eq!(
        answer_of(&asked_requests[3])["result"]["provided_by"],
        "nats:assistant"
    );

    let (_, events) = get_json(&format!("{base}/api/tasks/s-q/events")).await;
    let kinds: Vec<&str> = events["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["kind"].as_str())
        .filter(|k| k.starts_with("clarification"))
        .collect();
    assert_eq!(
        kinds,
        [
            "clarification_requested",
            "clarification_answered",
            "clarification_requested",
            "clarification_answered",
            "clarification_requested",
            "clarification_answered"
        ]
    );
    stack.stop().await;
}
both_backends!(rounds_by_frame_rest_and_nats_and_strangers_are_refused);

async fn an_unanswered_question_fails_at_its_deadline_and_ufo_clients_see_no_extension(
    backend: Backend,
) {
    let stack = Stack::start(
        backend,
        Options {
            sessions_settings: Some(|s| s.clarification_timeout_secs = 1),
            ..Options::default()
        },
    )
    .await
    .expect("stack");
    let _planner = asking_planner(&stack, &["Are you there?"]);
    let mut dev = Client::registered(&stack.ws_url(0), device_register("late-pc", "linux")).await;
    stack.wait_online("late-pc").await;
    // A plain UFO constellation: no extensions announced.
    let galaxy_id = "g@late-pc";
    let mut galaxy = Client::registered(
        &stack.ws_url(0),
        constellation_register(galaxy_id, Some("late-pc")),
    )
    .await;
    galaxy
        .send(&constellation_task(
            galaxy_id, "late-pc", "s-late", "t", None,
        ))
        .await
        .expect("task");
    let waiting = stack.task_in_state("s-late", "input_required").await;
    assert!(
        waiting["clarification"]["expires_at"].is_string(),
        "{waiting}"
    );

    // The next frame it gets is the end: no clarification_request in between.
    let mut frames = Vec::new();
    let end = loop {
        let frame = galaxy.recv().await.expect("a frame");
        if frame["type"] == "task_end" {
            break frame;
        }
        frames.push(frame);
    };
    assert!(
        frames.iter().all(|f| f["type"] != "clarification_request"),
        "{frames:?}"
    );
    assert_eq!(end["status"], "failed");
    assert!(
        end["error"]
            .as_str()
            .is_some_and(|e| e.contains("Are you there?") && e.contains("not answered")),
        "{end}"
    );
    let t = stack.task("s-late").await;
    assert_eq!(t["error_code"], "TASK_TIMEOUT", "{t}");
    assert!(
        t.get("clarification").is_none(),
        "no open question once ended: {t}"
    );
    // The executor is told too.
    let told = dev
        .recv_type("task_end")
        .await
        .expect("the executor is told");
    assert_eq!(told["status"], "failed");
    stack.stop().await;
}
both_backends!(an_unanswered_question_fails_at_its_deadline_and_ufo_clients_see_no_extension);

async fn an_executor_asks_mid_command_and_gets_the_answer_by_frame(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let mut dev = Client::registered(
        &stack.ws_url(0),
        with_clarification(device_register("ask-pc", "windows")),
    )
    .await;
    stack.wait_online("ask-pc").await;
    let base = stack.sessions_url();
    let body = json!({ "version": 1, "description": "save the file", "originating_agent_id": "ops",
        "target_id": "ask-pc", "steps": [[{ "tool_name": "save", "tool_type": "action" }]] });
    let (status, t) = post_json(&format!("{base}/api/tasks"), &body).await;
    assert_eq!(status, 201, "{t}");
    let id = t["task_id"].as_str().expect("id").to_owned();
    let command = dev.recv_type("command").await.expect("command");

    let question = json!({ "type": "clarification_request", "status": "continue", "client_type": "device",
        "client_id": "ask-pc", "session_id": id, "request": "Overwrite the existing file?",
        "metadata": { "clarification_id": "overwrite-1", "data": { "path": "C:/a.txt" } } });
    dev.send(&question).await.expect("ask");
    let waiting = stack.task_in_state(&id, "input_required").await;
    assert_eq!(
        waiting["clarification"],
        json!({ "version": 1, "task_id": id, "clarification_id": "overwrite-1",
            "question": "Overwrite the existing file?", "data": { "path": "C:/a.txt" },
            "requested_by": "ask-pc", "expires_at": waiting["clarification"]["expires_at"] })
    );
    let (status, going) = post_json(
        &format!("{base}/api/tasks/{id}/clarifications/overwrite-1"),
        &json!({ "answer": "yes", "data": { "backup": true } }),
    )
    .await;
    assert_eq!(
        (status, going["state"].as_str()),
        (200, Some("working")),
        "{going}"
    );
    let answer = dev
        .recv_type("clarification_response")
        .await
        .expect("the answer, by frame");
    assert_eq!(answer["session_id"], id.as_str());
    assert_eq!(answer["user_request"], "yes");
    assert_eq!(answer["metadata"]["clarification_id"], "overwrite-1");
    assert_eq!(answer["metadata"]["data"], json!({ "backup": true }));
    assert_eq!(answer["metadata"]["provided_by"], "rest:api");

    // The command goes on: its results complete the task.
    dev.send(&command_results_for("ask-pc", &command))
        .await
        .expect("results");
    let done = stack.task_in_state(&id, "completed").await;
    assert!(done.get("clarification").is_none());

    // Without the extension, the frame is refused as UFO refuses an unknown type.
    let mut plain =
        Client::registered(&stack.ws_url(0), device_register("plain-pc", "linux")).await;
    let mut asked = question.clone();
    asked["client_id"] = json!("plain-pc");
    plain.send(&asked).await.expect("send");
    let refused = plain.recv_type("error").await.expect("refused");
    assert!(
        refused["error"]
            .as_str()
            .is_some_and(|e| e.contains("Unknown message type: clarification_request")),
        "{refused}"
    );
    stack.stop().await;
}
both_backends!(an_executor_asks_mid_command_and_gets_the_answer_by_frame);

/// Issue 16: the driver of a requester-driven task asks a question between commands; the
/// answer comes over REST, and the driver goes on with its next command.
async fn a_driver_asks_between_commands(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let mut dev = Client::registered(&stack.ws_url(0), device_register("pc-dq", "linux")).await;
    stack.wait_online("pc-dq").await;
    let base = stack.sessions_url();
    let body = json!({ "version": 1, "description": "driven", "originating_agent_id": "agent",
        "target_id": "pc-dq", "driver": true });
    let (status, t) = post_json(&format!("{base}/api/tasks"), &body).await;
    assert_eq!(status, 201, "{t}");
    let id = t["task_id"].as_str().expect("id").to_owned();
    let ask = format!("{base}/api/tasks/{id}/clarifications");

    // While a command's results are awaited, no question.
    let call =
        json!({ "actions": [{ "tool_name": "echo", "tool_type": "action" }], "timeout_secs": 30 });
    let commands = format!("{base}/api/tasks/{id}/commands");
    let sent = tokio::spawn({
        let (commands, call) = (commands.clone(), call.clone());
        async move { post_json(&commands, &call).await }
    });
    let command = dev.recv_type("command").await.expect("command");
    let (status, refusal) = post_json(&ask, &json!({ "question": "which file?" })).await;
    assert_eq!(status, 409, "{refusal}");
    dev.send(&command_results_for("pc-dq", &command))
        .await
        .expect("results");
    assert_eq!(sent.await.expect("call").0, 200);

    // Between commands: the task waits for the answer.
    let (status, asked) = post_json(
        &ask,
        &json!({ "question": "which file?", "clarification_id": "q1", "data": { "choices": ["a", "b"] } }),
    )
    .await;
    assert_eq!(status, 201, "{asked}");
    assert_eq!(asked["state"], "input_required");
    assert_eq!(asked["clarification"]["clarification_id"], "q1");
    assert_eq!(asked["clarification"]["question"], "which file?");
    let (status, refusal) = post_json(&commands, &call).await;
    assert_eq!(
        status, 409,
        "no command while the question is open: {refusal}"
    );
    let (status, refusal) = post_json(&ask, &json!({ "question": "another?" })).await;
    assert_eq!(status, 409, "one open question at a time: {refusal}");

    let (status, answered) = post_json(
        &format!("{ask}/q1"),
        &json!({ "answer": "b", "provided_by": "operator" }),
    )
    .await;
    assert_eq!(status, 200, "{answered}");
    assert_eq!(answered["state"], "working");
    let (_, events) = get_json(&format!("{base}/api/tasks/{id}/events")).await;
    let answer = events["events"]
        .as_array()
        .expect("events")
        .iter()
        .find(|e| e["kind"] == "clarification_answered")
        .cloned()
        .expect("the answer is in the log");
    assert_eq!(answer["data"]["answer"], "b", "{answer}");

    // And the driver goes on.
    let next = tokio::spawn(async move { post_json(&commands, &call).await });
    let command = dev.recv_type("command").await.expect("the next command");
    dev.send(&command_results_for("pc-dq", &command))
        .await
        .expect("results");
    assert_eq!(next.await.expect("call").0, 200);

    // A task driven by a planner takes no driver's question.
    let body = json!({ "version": 1, "description": "scripted", "originating_agent_id": "agent",
        "target_id": "pc-dq", "steps": aip_testkit::frames::one_step("echo", json!({})) });
    let (_, other) = post_json(&format!("{base}/api/tasks"), &body).await;
    let other = other["task_id"].as_str().expect("id");
    let (status, refusal) = post_json(
        &format!("{base}/api/tasks/{other}/clarifications"),
        &json!({ "question": "?" }),
    )
    .await;
    assert_eq!(status, 409, "{refusal}");
    stack.stop().await;
}
both_backends!(a_driver_asks_between_commands);
