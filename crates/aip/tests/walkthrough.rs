//! The README walkthrough, run as real processes: `aip dev`, `aip device`, `aip dispatch`,
//! then a restart of `aip dev` on the same data directory, after which the task, its result
//! and its events are still there.

mod common;

use common::{TempDir, aip, start_dev, start_device, task_until};

#[test]
fn walkthrough_survives_a_restart() {
    let data = TempDir::new("walkthrough");
    let (mut dev, rest, ws) = start_dev(data.path(), &[]);
    // The banner's later lines may still be on their way when the URLs are read.
    dev.wait_for_stdout("the banner's next steps", |out| {
        (out.contains("aip device") && out.contains("aip dispatch")).then_some(())
    });

    let mut device = start_device(&ws, &rest, "demo-pc", "demo");

    let run = aip(&[
        "dispatch",
        "--rest",
        &rest,
        "--capability",
        "demo",
        "--tool",
        "echo",
        "--args",
        r#"{"text":"hi"}"#,
        "say hi",
    ]);
    assert_eq!(run.code, Some(0), "dispatch completes: {run:?}");
    let outcome = run
        .stdout
        .lines()
        .find(|l| l.starts_with("task ") && l.contains(" completed on demo-pc"))
        .unwrap_or_else(|| panic!("no outcome line: {run:?}"));
    let task_id = outcome
        .split_whitespace()
        .nth(1)
        .expect("task id")
        .to_owned();
    assert!(
        run.stdout.contains("step 1: sent echo"),
        "live progress: {run:?}"
    );
    assert!(
        run.stdout.contains(r#"{"text":"hi"}"#),
        "the result: {run:?}"
    );
    device.wait_for_stdout("the device's log of the task", |out| {
        (out.contains("ran echo") && out.contains(&format!("task {task_id}: task_end completed")))
            .then_some(())
    });

    // UFO's POST /api/dispatch: the device echoes the server `task` frame, as UFO's does.
    let dispatched = post_json(
        &format!("{rest}/api/dispatch"),
        serde_json::json!({ "client_id": "demo-pc", "request": "say hi the UFO way",
            "task_name": "ufo-1", "steps": [[{ "tool_name": "echo", "tool_type": "action" }]] }),
    );
    assert_eq!(dispatched["status"], "dispatched", "{dispatched}");
    let session = dispatched["session_id"]
        .as_str()
        .expect("session_id")
        .to_owned();
    device.wait_for_stdout("the dispatched task's end", |out| {
        out.contains(&format!("task {session}: task_end completed"))
            .then_some(())
    });
    let run = aip(&["tasks", "get", &session, "--json", "--rest", &rest]);
    assert_eq!(run.json()["task_name"], "ufo-1", "{run:?}");

    // Unknown tool: the device answers with a failure; the scripted task still completes.
    let run = aip(&[
        "dispatch",
        "--rest",
        &rest,
        "--target",
        "demo-pc",
        "--tool",
        "format_disk",
        "x",
    ]);
    assert_eq!(run.code, Some(0), "{run:?}");
    assert!(run.stdout.contains("unknown tool `format_disk`"), "{run:?}");
    assert!(
        run.stdout.contains("warning: 1 command(s) failed"),
        "{run:?}"
    );

    // Nobody has the capability: refused, with the broker's reason, exit code 3.
    let run = aip(&["dispatch", "--rest", &rest, "--capability", "quantum", "x"]);
    assert_eq!(run.code, Some(3), "{run:?}");
    assert!(run.stderr.contains("CAPABILITY_MISMATCH"), "{run:?}");

    // No steps and no planner on the in-process bus: the task fails, exit code 1.
    let run = aip(&[
        "dispatch",
        "--rest",
        &rest,
        "--target",
        "demo-pc",
        "plan it yourself",
    ]);
    assert_eq!(run.code, Some(1), "{run:?}");
    assert!(run.stdout.contains("no planner is running"), "{run:?}");

    // Graceful stop; the device keeps trying to reconnect.
    let status = dev.terminate();
    assert!(
        status.success(),
        "aip dev exits cleanly on SIGTERM: {status}\n{}",
        dev.output()
    );
    device.wait_for_stdout("the device noticing", |out| {
        out.contains("reconnecting in").then_some(())
    });
    let run = aip(&["tasks", "get", &task_id, "--rest", &rest]);
    assert_eq!(run.code, Some(3), "{run:?}");
    assert!(
        run.stderr.contains("not running") && run.stderr.contains("aip dev"),
        "says the broker is not running and how to start it: {run:?}"
    );
    drop(device);

    let (_dev, rest, _ws) = start_dev(data.path(), &[]);
    let run = aip(&["tasks", "get", &task_id, "--json", "--rest", &rest]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let task = run.json();
    assert_eq!(task["state"], "completed", "{task}");
    assert_eq!(task["executor_id"], "demo-pc");
    assert_eq!(
        task["result"][0]["results"][0]["result"]["text"], "hi",
        "{task}"
    );
    assert!(task["events"].as_i64().is_some_and(|n| n >= 5), "{task}");

    let run = aip(&["tasks", "events", &task_id, "--json", "--rest", &rest]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let kinds: Vec<String> = run.json()["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["kind"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(
        kinds,
        [
            "submitted",
            "dispatched",
            "command_sent",
            "results_received",
            "completed"
        ]
    );

    let run = aip(&["tasks", "get", &task_id, "--rest", &rest]);
    assert_eq!(run.code, Some(0), "{run:?}");
    assert!(
        run.stdout.contains("completed") && run.stdout.contains("echo"),
        "human view: {run:?}"
    );
    let run = aip(&["tasks", "list", "--rest", &rest]);
    assert!(run.stdout.contains(&task_id), "{run:?}");
    let run = aip(&["agents", "get", "demo-pc", "--rest", &rest]);
    assert_eq!(run.code, Some(0), "{run:?}");
    assert!(
        run.stdout.contains("demo") && run.stdout.contains("list_tools"),
        "{run:?}"
    );
}

fn post_json(url: &str, body: serde_json::Value) -> serde_json::Value {
    aip_runtime::install_crypto_provider();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let response = reqwest::Client::new()
            .post(url)
            .json(&body)
            .send()
            .await
            .expect("request");
        response.json().await.expect("a JSON answer")
    })
}

#[test]
fn dispatch_says_when_the_broker_is_not_running() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let rest = format!("http://127.0.0.1:{port}");
    let run = aip(&[
        "dispatch",
        "--rest",
        &rest,
        "--capability",
        "demo",
        "--tool",
        "echo",
        "hi",
    ]);
    assert_eq!(run.code, Some(3), "{run:?}");
    assert!(run.stderr.contains("cannot reach the broker"), "{run:?}");
    assert!(run.stderr.contains("aip dev"), "{run:?}");
    let run = aip(&[
        "dispatch",
        "--rest",
        &rest,
        "--capability",
        "demo",
        "--args",
        "{}",
        "hi",
    ]);
    assert_eq!(run.code, Some(2), "usage error: {run:?}");
}

/// `aip tasks handoff`: a task stuck on a slow device moves to another one and completes there.
#[test]
fn a_task_is_handed_off_from_the_command_line() {
    let data = TempDir::new("handoff");
    let (_dev, rest, ws) = start_dev(data.path(), &[]);
    let _slow = start_device(&ws, &rest, "slow-pc", "render");
    let _fast = start_device(&ws, &rest, "fast-pc", "gpu");

    let run = aip(&[
        "dispatch",
        "--rest",
        &rest,
        "--target",
        "slow-pc",
        "--tool",
        "sleep",
        "--args",
        r#"{"seconds":20}"#,
        "--no-wait",
        "--json",
        "render",
    ]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let id = run.json()["task_id"].as_str().expect("id").to_owned();

    let moved = aip(&[
        "tasks",
        "handoff",
        "--rest",
        &rest,
        &id,
        "--capability",
        "gpu",
        "--reason",
        "too slow",
    ]);
    assert_eq!(moved.code, Some(0), "{moved:?}");
    assert!(moved.stdout.contains("on fast-pc"), "{moved:?}");
    let nobody = aip(&[
        "tasks",
        "handoff",
        "--rest",
        &rest,
        &id,
        "--capability",
        "quantum",
        "--reason",
        "x",
    ]);
    assert_ne!(nobody.code, Some(0), "{nobody:?}");
    assert!(nobody.stderr.contains("CAPABILITY_MISMATCH"), "{nobody:?}");

    // The step runs again on the fast device (20 s of sleep there too would be slow: the
    // task is checked for the move, then canceled).
    task_until(&rest, &id, "moved", |t| {
        t["executor_id"] == "fast-pc" && t["state"] == "working"
    });
    let shown = aip(&["tasks", "get", "--rest", &rest, &id]);
    assert!(
        shown.stdout.contains("handed off from slow-pc to fast-pc"),
        "{shown:?}"
    );
    let canceled = aip(&["tasks", "cancel", "--rest", &rest, &id]);
    assert_eq!(canceled.code, Some(0), "{canceled:?}");
}
