//! The built-in tool-calling agent in the default mode, run as real processes: `aip dev
//! --llm-base-url` pointed at an OpenAI-compatible server inside the test (scripted answers),
//! the real `aip device`, and `aip dispatch` without steps.

mod common;

use common::{Seen, TempDir, aip, model_server, start_dev, start_device, task_until};

#[test]
fn aip_dev_runs_the_built_in_agent_against_a_real_device() {
    let seen = Seen::default();
    let base_url = model_server(seen.clone());
    let data = TempDir::new("llm");
    let (mut dev, rest, ws) = start_dev(
        data.path(),
        &["--llm-base-url", &base_url, "--llm-model", "local-model"],
    );
    // The banner's later lines may still be on their way when the URLs are read.
    dev.wait_for_stdout("the banner's planner line", |out| {
        out.contains("planner    llm, model local-model at")
            .then_some(())
    });
    let _device = start_device(&ws, &rest, "agent-pc", "demo");

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

#[test]
fn the_agents_question_is_answered_with_aip_tasks_answer() {
    let seen = Seen::default();
    let base_url = model_server(seen.clone());
    let data = TempDir::new("llm-ask");
    let (_dev, rest, ws) = start_dev(data.path(), &["--llm-base-url", &base_url]);
    let _device = start_device(&ws, &rest, "ask-pc", "demo");

    let run = aip(&[
        "dispatch",
        "--rest",
        &rest,
        "--capability",
        "demo",
        "--no-wait",
        "--json",
        "open the file, ask me which",
    ]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let id = run.json()["task_id"].as_str().expect("id").to_owned();
    let waiting = task_until(&rest, &id, "asked", |t| t["state"] == "input_required");
    assert_eq!(waiting["clarification"]["question"], "Which file?");
    let shown = aip(&["tasks", "get", "--rest", &rest, &id]);
    assert!(
        shown.stdout.contains("asked the requester: Which file?"),
        "{shown:?}"
    );

    let answered = aip(&["tasks", "answer", "--rest", &rest, &id, "report.txt"]);
    assert_eq!(answered.code, Some(0), "{answered:?}");
    let again = aip(&["tasks", "answer", "--rest", &rest, &id, "other.txt"]);
    assert_ne!(again.code, Some(0), "answered once: {again:?}");
    let done = task_until(&rest, &id, "completed", |t| t["state"] == "completed");
    assert_eq!(done["result"], "Opened report.txt");
}
