//! The session service killed (`kill -9`) in the middle of 20 concurrent tasks, and started
//! again: all 20 complete, no command runs twice, every event log is gap-free. The service runs
//! as a real process (the `aip-sessions` binary) on the machine's NATS and PostgreSQL.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aip_testkit::Client;
use aip_testkit::frames::{command_results_for, device_register};

use serde_json::{Value, json};

mod common;
use common::{free_port, stack_without_sessions, start_ready_sessions, start_sessions};

const TASKS: usize = 20;
const STEPS: usize = 4;

async fn wait_for<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn get_json(url: &str) -> Option<Value> {
    reqwest::get(url).await.ok()?.json().await.ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_flight_loses_nothing_and_runs_nothing_twice() {
    let stack = stack_without_sessions().await;
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let mut sessions = start_ready_sessions(&stack, port, &[]).await;

    // 20 devices that answer every command after a short pause, recording what they ran.
    let executed: Arc<Mutex<HashMap<String, Vec<String>>>> = Arc::default();
    let mut devices = Vec::new();
    for i in 0..TASKS {
        let id = format!("dev-{i}");
        let mut client = Client::connect(&stack.ws_url(0)).await.expect("connect");
        client
            .send(&device_register(&id, "linux"))
            .await
            .expect("register");
        assert_eq!(
            client.recv().await.expect("registered")["type"],
            "heartbeat"
        );
        let executed = executed.clone();
        devices.push(tokio::spawn(async move {
            loop {
                let frame = match client.recv().await {
                    Ok(frame) => frame,
                    Err(e) if e.to_string().starts_with("no frame within") => continue,
                    Err(_) => return,
                };
                if frame["type"] != "command" {
                    continue;
                }
                tokio::time::sleep(Duration::from_millis(40)).await;
                let response_id = frame["response_id"].as_str().unwrap_or_default().to_owned();
                executed
                    .lock()
                    .expect("lock")
                    .entry(id.clone())
                    .or_default()
                    .push(response_id);
                if client
                    .send(&command_results_for(&id, &frame))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }));
    }
    let registry = stack.registry_url();
    wait_for("20 devices online", Duration::from_secs(20), || async {
        let clients = get_json(&format!("{registry}/api/clients")).await?;
        (clients["online_clients"].as_array()?.len() >= TASKS).then_some(())
    })
    .await;

    let http = reqwest::Client::new();
    let mut ids = Vec::new();
    for i in 0..TASKS {
        let steps: Vec<Value> = (0..STEPS).map(|s| json!([{ "tool_name": "echo", "tool_type": "action", "parameters": { "s": s } }])).collect();
        let body = json!({ "version": 1, "description": format!("task {i}"), "originating_agent_id": "crash-test",
            "target_id": format!("dev-{i}"), "steps": steps });
        let response = http
            .post(format!("{base}/api/tasks"))
            .json(&body)
            .send()
            .await
            .expect("submit");
        assert_eq!(response.status().as_u16(), 201);
        let task: Value = response.json().await.expect("json");
        ids.push(task["task_id"].as_str().expect("id").to_owned());
    }

    // Kill it while the tasks are half done.
    wait_for("some progress", Duration::from_secs(20), || async {
        let done: usize = executed.lock().expect("lock").values().map(Vec::len).sum();
        (done >= TASKS).then_some(())
    })
    .await;
    sessions.0.kill().expect("kill -9");
    let _ = sessions.0.wait();
    let at_kill: usize = executed.lock().expect("lock").values().map(Vec::len).sum();
    assert!(
        at_kill < TASKS * STEPS,
        "the kill came too late to test anything ({at_kill} commands ran)"
    );

    let _restarted = start_sessions(&stack, port, &[]);
    for id in &ids {
        let task = wait_for(
            &format!("task {id} to complete"),
            Duration::from_secs(90),
            || async {
                let task = get_json(&format!("{base}/api/tasks/{id}")).await?;
                task["state"]
                    .as_str()
                    .filter(|s| *s != "dispatched" && *s != "working" && *s != "submitted")?;
                Some(task)
            },
        )
        .await;
        assert_eq!(task["state"], "completed", "{task}");
        let log = get_json(&format!("{base}/api/tasks/{id}/events"))
            .await
            .expect("events");
        let events = log["events"].as_array().expect("events");
        let seqs: Vec<i64> = events.iter().filter_map(|e| e["seq"].as_i64()).collect();
        assert_eq!(
            seqs,
            (1..=seqs.len() as i64).collect::<Vec<_>>(),
            "gap-free log of {id}"
        );
        let sent = events
            .iter()
            .filter(|e| e["kind"] == "command_sent")
            .count();
        let answered = events
            .iter()
            .filter(|e| e["kind"] == "results_received")
            .count();
        assert_eq!(
            (sent, answered),
            (STEPS, STEPS),
            "one command and one answer per step in {id}"
        );
    }
    for (device, ran) in executed.lock().expect("lock").iter() {
        let mut unique = ran.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(
            unique.len(),
            ran.len(),
            "{device} ran a command twice: {ran:?}"
        );
        assert_eq!(ran.len(), STEPS, "{device} ran {} commands", ran.len());
    }
    // The frames stream is a work queue: every frame the service applied, before the kill and
    // after, has left it (it neither fills up with consumed frames nor keeps one stranded).
    let left = aip_testkit::eventually_within(
        Duration::from_secs(10),
        "an empty frames stream",
        || async { (stack.frames_stream_messages().await == Some(0)).then_some(()) },
    )
    .await;
    assert!(
        left.is_ok(),
        "the frames stream still holds {:?} messages",
        stack.frames_stream_messages().await
    );
    for d in devices {
        d.abort();
    }
    stack.stop().await;
}
