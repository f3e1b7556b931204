//! The built-in tool-calling agent in the default mode, run as real processes: `aip dev
//! --llm-base-url` pointed at an OpenAI-compatible server inside the test (scripted answers),
//! the real `aip device`, and `aip dispatch` without steps.

mod common;

use std::sync::{Arc, Mutex};

use axum::Json;
use axum::extract::State;
use axum::routing::post;
use common::{Proc, TempDir, aip, start_dev, wait_available};
use serde_json::{Value, json};

type Seen = Arc<Mutex<Vec<Value>>>;

/// Answers like a chat-completions endpoint: first a call of the device's `echo` tool, then,
/// once the tool's result is in the conversation, a final answer quoting it.
async fn complete(State(seen): State<Seen>, Json(body): Json<Value>) -> Json<Value> {
    seen.lock().expect("lock").push(body.clone());
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let echoed = messages
        .iter()
        .find(|m| m["role"] == "tool")
        .and_then(|m| m["content"].as_str())
        .and_then(|c| serde_json::from_str::<Value>(c).ok());
    let message = match echoed {
        None => json!({ "role": "assistant", "content": null, "tool_calls": [
            { "id": "call_echo", "type": "function",
              "function": { "name": "echo", "arguments": "{\"text\":\"hi from the model\"}" } }
        ] }),
        Some(result) => json!({ "role": "assistant",
            "content": format!("The device echoed: {}", result["result"]["text"].as_str().unwrap_or("?")) }),
    };
    Json(json!({
        "id": "chatcmpl-x", "object": "chat.completion", "model": body["model"],
        "choices": [{ "index": 0, "message": message, "finish_reason": "stop" }],
        "usage": { "prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15 }
    }))
}

/// The scripted endpoint on a free port, served from its own thread; its base URL.
fn model_server(seen: Seen) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().expect("runtime");
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            tx.send(listener.local_addr().expect("addr")).expect("send");
            let app = axum::Router::new()
                .route("/v1/chat/completions", post(complete))
                .with_state(seen);
            let _ = axum::serve(listener, app).await;
        });
    });
    let addr = rx.recv().expect("the model server's address");
    format!("http://{addr}/v1")
}

#[test]
fn aip_dev_runs_the_built_in_agent_against_a_real_device() {
    let seen = Seen::default();
    let base_url = model_server(seen.clone());
    let data = TempDir::new("llm");
    let (dev, rest, ws) = start_dev(
        data.path(),
        &["--llm-base-url", &base_url, "--llm-model", "local-model"],
    );
    assert!(
        dev.stdout()
            .contains("planner    llm, model local-model at"),
        "the banner names the planner:\n{}",
        dev.stdout()
    );
    let mut device = Proc::aip(
        "aip device",
        &[
            "device",
            "--url",
            &ws,
            "--id",
            "agent-pc",
            "--capability",
            "demo",
        ],
    );
    device.wait_for_stdout("registration", |out| {
        out.contains("registered as agent-pc").then_some(())
    });
    wait_available(&rest, "agent-pc");

    let run = aip(&[
        "dispatch",
        "--rest",
        &rest,
        "--capability",
        "demo",
        "--json",
        "say hi",
    ]);
    assert_eq!(run.code, Some(0), "{run:?}\n{}", dev.output());
    let task = run.json();
    assert_eq!(task["state"], "completed", "{task}");
    assert_eq!(task["result"], "The device echoed: hi from the model");

    let seen = seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 2, "two model calls");
    assert_eq!(seen[0]["model"], "local-model");
    let functions: Vec<&str> = seen[0]["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .filter_map(|t| t["function"]["name"].as_str())
        .collect();
    assert!(
        functions.contains(&"echo") && functions.contains(&"ask_user"),
        "the device's own tools, from list_tools: {functions:?}"
    );
}
