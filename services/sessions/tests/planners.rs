//! Planners other than steps in the task: the built-in tool-calling agent against a real
//! OpenAI-compatible HTTP server inside the test (scripted answers), the HTTP planner against
//! a real HTTP server that checks its signatures, and the NATS planner, each driving UFO-format
//! clients over real WebSockets, on both backends.

use std::sync::{Arc, Mutex};

use aip_bus::Headers;
use aip_sessions::settings::{LlmSettings, PlannerSettings};
use aip_testkit::frames::{
    command_results_for, constellation_register, constellation_task, device_register,
};
use aip_testkit::{Backend, Client, Options, Stack, both_backends, get_json, post_json};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use futures::StreamExt;
use proto_schemas::PlannerName;
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// What a scripted server answers: (status, body) for a request body.
type Script = Arc<dyn Fn(&Value) -> (StatusCode, Value) + Send + Sync>;

/// A request the scripted server received.
#[derive(Debug, Clone)]
struct Seen {
    headers: HeaderMap,
    body: Value,
    raw: String,
}

#[derive(Clone)]
struct Scripted {
    script: Script,
    seen: Arc<Mutex<Vec<Seen>>>,
}

/// An HTTP server on a random loopback port answering POSTs on `path` by `script`.
async fn serve(path: &str, script: Script) -> (String, Arc<Mutex<Vec<Seen>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let state = Scripted {
        script,
        seen: seen.clone(),
    };
    async fn answer(
        State(state): State<Scripted>,
        headers: HeaderMap,
        raw: String,
    ) -> (StatusCode, axum::Json<Value>) {
        let body: Value = serde_json::from_str(&raw).unwrap_or(Value::Null);
        let (status, reply) = (state.script)(&body);
        state
            .seen
            .lock()
            .expect("lock")
            .push(Seen { headers, body, raw });
        (status, axum::Json(reply))
    }
    let app = axum::Router::new()
        .route(path, post(answer))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), seen)
}

/// A chat completion calling tools: (call id, function, arguments as sent).
fn tool_calls(calls: &[(&str, &str, &str)]) -> (StatusCode, Value) {
    let calls: Vec<Value> = calls
        .iter()
        .map(|(id, name, arguments)| {
            json!({ "id": id, "type": "function", "function": { "name": name, "arguments": arguments } })
        })
        .collect();
    (
        StatusCode::OK,
        json!({
            "id": "chatcmpl-1", "object": "chat.completion", "model": "test-model",
            "choices": [{ "index": 0, "finish_reason": "tool_calls",
                "message": { "role": "assistant", "content": null, "tool_calls": calls } }],
            "usage": { "prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120 }
        }),
    )
}

/// A chat completion with a final answer.
fn answer(text: &str) -> (StatusCode, Value) {
    (
        StatusCode::OK,
        json!({
            "id": "chatcmpl-2", "object": "chat.completion", "model": "test-model",
            "choices": [{ "index": 0, "finish_reason": "stop",
                "message": { "role": "assistant", "content": text } }],
            "usage": { "prompt_tokens": 150, "completion_tokens": 10, "total_tokens": 160 }
        }),
    )
}

/// The task's request as the agent told the model (the user message), and how many times the
/// model already answered in this conversation.
fn conversation_of(body: &Value) -> (String, usize) {
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let user = messages
        .iter()
        .find(|m| m["role"] == "user")
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default()
        .to_owned();
    let turns = messages.iter().filter(|m| m["role"] == "assistant").count();
    (user, turns)
}

/// The device's tools, as UFO's `list_tools` returns them.
fn device_tools() -> Value {
    json!([
        { "tool_key": "action::open_app", "tool_name": "open_app", "title": null, "namespace": "LinuxExecutor",
          "tool_type": "action", "description": "Open an application by name",
          "input_schema": { "type": "object", "properties": { "name": { "type": "string" } }, "required": ["name"] },
          "output_schema": null, "meta": null, "annotations": null },
        { "tool_key": "action::type_text", "tool_name": "type_text", "title": null, "namespace": "LinuxExecutor",
          "tool_type": "action", "description": "Type text into the focused window",
          "input_schema": { "type": "object", "properties": { "text": { "type": "string" } }, "required": ["text"] },
          "output_schema": null, "meta": null, "annotations": null }
    ])
}

/// A UFO-format device that answers every command: `list_tools` with [`device_tools`], any other
/// tool with a success echoing its parameters. Each command frame it got comes out of the
/// channel.
fn answering_device(mut dev: Client, id: &'static str) -> mpsc::UnboundedReceiver<Value> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(command) = dev.recv_type("command").await {
            let reply = if command["actions"][0]["tool_name"] == "list_tools" {
                let mut reply = command_results_for(id, &command);
                reply["action_results"][0]["result"] = device_tools();
                reply
            } else {
                command_results_for(id, &command)
            };
            let _ = tx.send(command);
            if dev.send(&reply).await.is_err() {
                break;
            }
        }
    });
    rx
}

async fn events(stack: &Stack, id: &str) -> Vec<Value> {
    let (_, page) = get_json(&format!("{}/api/tasks/{id}/events", stack.sessions_url())).await;
    page["events"]
        .as_array()
        .or_else(|| page.as_array())
        .cloned()
        .unwrap_or_default()
}

fn llm_options(base_url: &str) -> Options {
    Options {
        llm: LlmSettings {
            base_url: Some(format!("{base_url}/v1")),
            api_key: Some("sk-test-key".into()),
            model: "test-model".into(),
            max_steps: 3,
            ..LlmSettings::default()
        },
        planner: PlannerSettings {
            attempts: 1,
            ..PlannerSettings::default()
        },
        max_tasks_per_agent: 10,
        ..Options::default()
    }
}

async fn llm_agent_drives_a_device_for_a_galaxy_task_without_steps(backend: Backend) {
    let script: Script = Arc::new(|body| match conversation_of(body).1 {
        0 => tool_calls(&[
            ("call_open", "open_app", r#"{"name":"notepad"}"#),
            ("call_type", "type_text", r#"{"text":"hello"}"#),
        ]),
        _ => answer("Notepad is open and shows hello."),
    });
    let (model_url, model_seen) = serve("/v1/chat/completions", script).await;
    let stack = Stack::start(backend, llm_options(&model_url))
        .await
        .expect("stack");
    let dev = Client::registered(&stack.ws_url(0), device_register("pc-llm", "linux")).await;
    stack.wait_online("pc-llm").await;
    let mut commands = answering_device(dev, "pc-llm");
    let galaxy_id = "g@pc-llm";
    let mut galaxy = Client::registered(
        &stack.ws_url(0),
        constellation_register(galaxy_id, Some("pc-llm")),
    )
    .await;
    galaxy
        .send(&constellation_task(galaxy_id, "pc-llm", "s-llm", "t", None))
        .await
        .expect("task");

    let end = galaxy.recv_type("task_end").await.expect("task_end");
    assert_eq!(end["status"], "completed", "{end}");
    assert_eq!(end["result"], "Notepad is open and shows hello.");

    // The device got list_tools, then exactly the commands the model asked for.
    let listing = commands.recv().await.expect("list_tools");
    assert_eq!(listing["agent_name"], "LinuxAgent");
    assert_eq!(
        listing["actions"][0],
        json!({ "tool_name": "list_tools", "tool_type": "action", "parameters": { "tool_type": "action" }, "call_id": listing["actions"][0]["call_id"] })
    );
    let work = commands.recv().await.expect("the model's commands");
    assert_eq!(
        work["actions"],
        json!([
            { "tool_name": "open_app", "tool_type": "action", "parameters": { "name": "notepad" }, "call_id": "call_open" },
            { "tool_name": "type_text", "tool_type": "action", "parameters": { "text": "hello" }, "call_id": "call_type" }
        ])
    );
    assert!(commands.try_recv().is_err(), "no other command");

    // What the model was told.
    let seen = model_seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 2, "two model calls");
    assert_eq!(
        seen[0].headers["authorization"], "Bearer sk-test-key",
        "the key goes to the endpoint"
    );
    let first = &seen[0].body;
    assert_eq!(first["model"], "test-model");
    let functions: Vec<&str> = first["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .filter_map(|t| t["function"]["name"].as_str())
        .collect();
    assert_eq!(functions, ["open_app", "type_text", "ask_user"]);
    assert_eq!(
        first["tools"][1]["function"]["parameters"]["required"],
        json!(["text"]),
        "the device's input schema is the function's parameters"
    );
    assert_eq!(first["messages"][0]["role"], "system");
    assert!(
        first["messages"][0]["content"]
            .as_str()
            .is_some_and(|p| p.contains("pc-llm")),
        "{first}"
    );
    assert_eq!(
        first["messages"][1]["content"],
        "open notepad and type hello"
    );
    let tool_messages: Vec<&Value> = seen[1].body["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["role"] == "tool")
        .collect();
    assert_eq!(tool_messages.len(), 2, "{}", seen[1].body);
    assert_eq!(tool_messages[0]["tool_call_id"], "call_open");
    assert_eq!(tool_messages[1]["tool_call_id"], "call_type");
    let content: Value =
        serde_json::from_str(tool_messages[1]["content"].as_str().expect("text")).expect("json");
    assert_eq!(content["status"], "success");
    assert_eq!(content["result"]["echo"]["text"], "hello");

    // The conversation is in the event log, and the REST view has the answer.
    let t = stack.task("s-llm").await;
    assert_eq!(
        (t["state"].as_str(), t["result"].as_str()),
        (Some("completed"), Some("Notepad is open and shows hello.")),
        "{t}"
    );
    let planned: Vec<Value> = events(&stack, "s-llm")
        .await
        .into_iter()
        .filter(|e| e["kind"] == "planned")
        .collect();
    assert_eq!(planned.len(), 2, "one event per model turn");
    assert_eq!(planned[0]["data"]["usage"]["total_tokens"], 120);
    assert_eq!(
        planned[1]["data"]["messages"]
            .as_array()
            .and_then(|m| m.last())
            .map(|m| m["content"].clone()),
        Some(json!("Notepad is open and shows hello."))
    );
    stack.stop().await;
}
both_backends!(llm_agent_drives_a_device_for_a_galaxy_task_without_steps);

async fn llm_agent_failures_fail_the_task_with_a_clear_error(backend: Backend) {
    let script: Script = Arc::new(|body| {
        let (request, turns) = conversation_of(body);
        match (request.as_str(), turns) {
            ("unknown tool", _) => tool_calls(&[("c1", "format_disk", "{}")]),
            ("bad arguments", _) => tool_calls(&[("c1", "type_text", "text=hello")]),
            ("model error", _) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                json!({ "error": { "message": "the model is overloaded" } }),
            ),
            ("endless", _) => tool_calls(&[("c1", "type_text", r#"{"text":"again"}"#)]),
            ("question", 0) => tool_calls(&[(
                "c1",
                "ask_user",
                r#"{"question":"Which file should I open?"}"#,
            )]),
            ("question", _) => {
                // The answer is the ask_user call's result.
                let told = body["messages"]
                    .as_array()
                    .and_then(|m| m.iter().find(|m| m["role"] == "tool"))
                    .and_then(|m| m["content"].as_str())
                    .and_then(|c| serde_json::from_str::<Value>(c).ok())
                    .map(|c| c["result"]["answer"].clone())
                    .unwrap_or_default();
                answer(&format!("Opened {}", told.as_str().unwrap_or("?")))
            }
            _ => answer("unexpected"),
        }
    });
    let (model_url, _) = serve("/v1/chat/completions", script).await;
    let stack = Stack::start(backend, llm_options(&model_url))
        .await
        .expect("stack");
    let dev = Client::registered(&stack.ws_url(0), device_register("pc-bad", "windows")).await;
    stack.wait_online("pc-bad").await;
    let _commands = answering_device(dev, "pc-bad");
    let base = stack.sessions_url();
    let submit = |description: &str, planner: Option<&str>| {
        let mut body = json!({ "version": 1, "description": description, "originating_agent_id": "t", "target_id": "pc-bad" });
        if let Some(planner) = planner {
            body["planner"] = json!(planner);
        }
        let url = format!("{base}/api/tasks");
        async move { post_json(&url, &body).await }
    };

    let cases = [
        ("unknown tool", "PROTOCOL_ERROR", "format_disk"),
        ("bad arguments", "PROTOCOL_ERROR", "not a JSON object"),
        ("model error", "UNAVAILABLE", "the model is overloaded"),
        ("endless", "TASK_TIMEOUT", "3 model calls"),
    ];
    let mut ids = Vec::new();
    for (description, ..) in cases {
        let (status, t) = submit(description, Some("llm")).await;
        assert_eq!(status, 201, "{t}");
        ids.push(t["task_id"].as_str().expect("id").to_owned());
    }
    for ((description, code, text), id) in cases.iter().zip(&ids) {
        let t = stack.task_ended(id).await;
        assert_eq!(
            (t["state"].as_str(), t["error_code"].as_str()),
            (Some("failed"), Some(*code)),
            "{description}: {t}"
        );
        assert!(
            t["error"].as_str().is_some_and(|e| e.contains(text)),
            "{description}: {t}"
        );
    }
    // The conversation so far is kept: the unknown call is in the event log.
    let planned: Vec<Value> = events(&stack, &ids[0])
        .await
        .into_iter()
        .filter(|e| e["kind"] == "planned")
        .collect();
    assert_eq!(planned.len(), 1);
    assert!(
        planned[0]["data"].to_string().contains("format_disk"),
        "{}",
        planned[0]
    );

    // A question to the requester: the task waits, the answer goes back to the model.
    let (status, t) = submit("question", Some("llm")).await;
    assert_eq!(status, 201, "{t}");
    let id = t["task_id"].as_str().expect("id").to_owned();
    let waiting = stack.task_in_state(&id, "input_required").await;
    assert_eq!(
        waiting["clarification"]["question"],
        "Which file should I open?"
    );
    let qid = waiting["clarification"]["clarification_id"]
        .as_str()
        .expect("id");
    let (status, going) = post_json(
        &format!("{base}/api/tasks/{id}/clarifications/{qid}"),
        &json!({ "answer": "report.txt" }),
    )
    .await;
    assert_eq!(
        (status, going["state"].as_str()),
        (200, Some("working")),
        "{going}"
    );
    let done = stack.task_ended(&id).await;
    assert_eq!(
        (done["state"].as_str(), done["result"].as_str()),
        (Some("completed"), Some("Opened report.txt")),
        "{done}"
    );

    // A planner this broker has no settings for is refused at once.
    let (status, refusal) = submit("anything", Some("http")).await;
    assert_eq!(
        (status, refusal["error_code"].as_str()),
        (404, Some("NOT_FOUND")),
        "{refusal}"
    );
    assert!(
        refusal["detail"]
            .as_str()
            .is_some_and(|d| d.contains("AIP_SESSIONS__PLANNER__URL")),
        "{refusal}"
    );
    let (status, refusal) = submit("anything", Some("oracle")).await;
    assert_eq!(status, 400, "an unknown planner name: {refusal}");
    assert!(
        refusal["detail"]
            .as_str()
            .is_some_and(|d| d.contains("oracle") && d.contains("`llm`")),
        "{refusal}"
    );
    stack.stop().await;
}
both_backends!(llm_agent_failures_fail_the_task_with_a_clear_error);

/// A planner's logic, served over NATS and over HTTP alike: type the request, then complete
/// with what the device echoed; refuse a request that says "refuse".
fn decide(request: &Value) -> Value {
    if request["request"] == "refuse" {
        return json!({ "error": { "detail": "cannot plan this", "error_code": "INVALID_REQUEST" } });
    }
    if request["step"] == 0 {
        json!({ "ok": { "decision": "commands", "actions": [
            { "tool_name": "type_text", "tool_type": "action", "parameters": { "text": request["request"] } }
        ] } })
    } else {
        json!({ "ok": { "decision": "complete", "result": {
            "typed": request["last_results"][0]["result"]["echo"]["text"], "steps": request["step"]
        } } })
    }
}

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

async fn http_and_nats_planners_drive_the_same_task_to_the_same_result(backend: Backend) {
    // The HTTP planner checks every signature, and fails each step's first attempt with a 503
    // so that the retry is exercised.
    let attempts: Arc<Mutex<std::collections::HashMap<String, u32>>> = Arc::default();
    let verifier = standardwebhooks::Webhook::new(SECRET).expect("secret");
    let script: Script = {
        let attempts = attempts.clone();
        Arc::new(move |body| {
            let key = format!("{}:{}", body["task_id"], body["step"]);
            let mut attempts = attempts.lock().expect("lock");
            let n = attempts.entry(key).or_insert(0);
            *n += 1;
            if *n == 1 {
                return (StatusCode::SERVICE_UNAVAILABLE, json!({}));
            }
            let reply = decide(body);
            let status = if reply.get("error").is_some() {
                StatusCode::UNPROCESSABLE_ENTITY
            } else {
                StatusCode::OK
            };
            (status, reply)
        })
    };
    let (planner_url, seen) = serve("/plan", script).await;
    let options = Options {
        planner: PlannerSettings {
            url: Some(format!("{planner_url}/plan")),
            secret: Some(SECRET.into()),
            attempts: 3,
            default: None,
        },
        ..Options::default()
    };
    let stack = Stack::start(backend, options).await.expect("stack");

    let mut requests = stack
        .bus
        .queue_subscribe(format!("{}.planner.next", stack.prefix), "planners".into())
        .await
        .expect("sub");
    let bus = stack.bus.clone();
    let nats_planner = tokio::spawn(async move {
        while let Some(m) = requests.next().await {
            let request: Value = serde_json::from_slice(&m.payload).expect("PlanRequest");
            let reply = decide(&request).to_string();
            aip_bus::respond(bus.as_ref(), &m, Headers::new(), reply.into())
                .await
                .expect("reply");
        }
    });

    let dev = Client::registered(&stack.ws_url(0), device_register("pc-plan", "linux")).await;
    stack.wait_online("pc-plan").await;
    let mut commands = answering_device(dev, "pc-plan");
    let base = stack.sessions_url();
    let run = |planner: Option<PlannerName>, description: &'static str| {
        let mut body = json!({ "version": 1, "description": description, "originating_agent_id": "t", "target_id": "pc-plan" });
        if let Some(planner) = planner {
            body["planner"] = json!(planner.as_str());
        }
        let url = format!("{base}/api/tasks");
        let stack = &stack;
        async move {
            let (status, t) = post_json(&url, &body).await;
            assert_eq!(status, 201, "{t}");
            stack.task_ended(t["task_id"].as_str().expect("id")).await
        }
    };

    let over_nats = run(Some(PlannerName::Nats), "hello planners").await;
    let nats_command = commands.recv().await.expect("command");
    let over_http = run(None, "hello planners").await;
    let http_command = commands.recv().await.expect("command");
    assert_eq!(over_nats["state"], "completed", "{over_nats}");
    assert_eq!(over_http["state"], "completed", "{over_http}");
    assert_eq!(over_http["result"], over_nats["result"]);
    assert_eq!(
        over_http["result"],
        json!({ "typed": "hello planners", "steps": 1 })
    );
    let tools = |c: &Value| {
        c["actions"]
            .as_array()
            .expect("actions")
            .iter()
            .map(|a| (a["tool_name"].clone(), a["parameters"].clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(tools(&http_command), tools(&nats_command));

    // Each step was asked twice (503, then the answer), signed both times.
    let http_id = over_http["task_id"].as_str().expect("id");
    let seen = seen.lock().expect("lock").clone();
    let asked: Vec<&Seen> = seen
        .iter()
        .filter(|s| s.body["task_id"] == http_id)
        .collect();
    assert_eq!(asked.len(), 4, "two steps, two attempts each");
    for request in &asked {
        verifier
            .verify(request.raw.as_bytes(), &request.headers)
            .expect("a valid Standard Webhooks signature");
        assert_eq!(
            request.headers["webhook-id"].to_str().expect("text"),
            format!("{http_id}:{}", request.body["step"])
        );
    }

    // A refusal fails the task with the planner's words; NATS and HTTP alike.
    for planner in [PlannerName::Http, PlannerName::Nats] {
        let refused = run(Some(planner), "refuse").await;
        assert_eq!(
            (refused["state"].as_str(), refused["error_code"].as_str()),
            (Some("failed"), Some("COMMAND_FAILED")),
            "{planner}: {refused}"
        );
        assert!(
            refused["error"]
                .as_str()
                .is_some_and(|e| e.contains("cannot plan this")),
            "{planner}: {refused}"
        );
    }
    nats_planner.abort();
    stack.stop().await;
}
both_backends!(http_and_nats_planners_drive_the_same_task_to_the_same_result);
