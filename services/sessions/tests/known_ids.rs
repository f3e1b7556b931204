//! A task id taken before the session service restarted is still refused after it, although
//! the new leader looks a new task's id up in the database only when its filter of known ids
//! may hold it; brand-new ids are not looked up at all. The service runs as a real process
//! (the `aip-sessions` binary) on the machine's NATS and PostgreSQL.

use aip_testkit::frames::{
    command_results_for, constellation_register, constellation_task, device_register, one_step,
};
use aip_testkit::{Client, post_json};
use serde_json::{Value, json};

mod common;
use common::{free_port, metric, stack_without_sessions, start_ready_sessions};

const DEVICE: &str = "known-device";
const GALAXY: &str = "known-galaxy";
const OTHER: &str = "known-other-galaxy";
const KEPT: &str = "kept-1";

/// `aip_sessions_task_id_lookups_total` with this `outcome`, from the service's metrics.
async fn lookups(base: &str, outcome: &str) -> u64 {
    let series = format!("aip_sessions_task_id_lookups_total{{outcome=\"{outcome}\"}}");
    metric(base, &series).await as u64
}

/// `from` (a constellation) asks for a one-step task on `target` under `session`.
async fn send_task(client: &mut Client, from: &str, target: &str, session: &str) {
    client
        .send(&constellation_task(
            from,
            target,
            session,
            "t",
            Some(one_step("echo", json!({}))),
        ))
        .await
        .expect("task");
}

/// The next frame of `kind`, skipping others.
async fn next_of(client: &mut Client, kind: &str) -> Value {
    loop {
        let frame = client.recv().await.expect("a frame");
        if frame["type"] == kind {
            return frame;
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_id_taken_before_a_restart_is_refused_and_new_ids_are_not_looked_up() {
    let stack = stack_without_sessions().await;
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let first = start_ready_sessions(&stack, port, &[]).await;

    let mut device = Client::registered(&stack.ws_url(0), device_register(DEVICE, "linux")).await;
    stack.wait_online(DEVICE).await;
    let mut galaxy = Client::registered(
        &stack.ws_url(0),
        constellation_register(GALAXY, Some(DEVICE)),
    )
    .await;

    // A task that runs and ends under the first process.
    send_task(&mut galaxy, GALAXY, DEVICE, KEPT).await;
    let command = next_of(&mut device, "command").await;
    device
        .send(&command_results_for(DEVICE, &command))
        .await
        .expect("results");
    let end = next_of(&mut galaxy, "task_end").await;
    assert_eq!(end["status"], "completed", "{end}");
    let _ = next_of(&mut device, "task_end").await;

    // A new process leads: what it knows of ended tasks comes from the database only.
    drop(first);
    let _second = start_ready_sessions(&stack, port, &[]).await;

    // Once its filter is built, a new id is not looked up (here, a task for a device that is
    // not connected, refused without being started).
    let mut attempt = 0;
    while lookups(&base, "skipped").await == 0 {
        attempt += 1;
        assert!(attempt <= 300, "the filter of known ids was never built");
        send_task(
            &mut galaxy,
            GALAXY,
            "ghost",
            &format!("ghost-task-{attempt}"),
        )
        .await;
        let end = next_of(&mut galaxy, "task_end").await;
        assert_eq!(end["status"], "failed", "{end}");
    }
    let asked = lookups(&base, "asked").await;

    // The kept id, from another constellation: refused as UFO does.
    let mut other = Client::registered(
        &stack.ws_url(0),
        constellation_register(OTHER, Some(DEVICE)),
    )
    .await;
    send_task(&mut other, OTHER, DEVICE, KEPT).await;
    let error = next_of(&mut other, "error").await;
    assert_eq!(error["metadata"]["error_code"], "CONFLICT", "{error}");
    assert_eq!(
        error["error"],
        format!("session_id '{KEPT}' is owned by another client"),
        "{error}"
    );
    let end = next_of(&mut other, "task_end").await;
    assert_eq!(end["status"], "failed", "{end}");

    // And over REST.
    let body = json!({ "version": 1, "description": "again", "originating_agent_id": "tester",
        "target_id": DEVICE, "steps": one_step("echo", json!({})), "task_id": KEPT });
    let (status, answer) = post_json(&format!("{base}/api/tasks"), &body).await;
    assert_eq!(status, 409, "{answer}");
    assert_eq!(answer["error_code"], "CONFLICT", "{answer}");

    // Both were looked up in the database; a new id over REST is not, and starts.
    assert_eq!(lookups(&base, "asked").await, asked + 2);
    let skipped = lookups(&base, "skipped").await;
    let fresh = json!({ "version": 1, "description": "new", "originating_agent_id": "tester",
        "target_id": DEVICE, "steps": one_step("echo", json!({})), "task_id": "fresh-1" });
    let (status, answer) = post_json(&format!("{base}/api/tasks"), &fresh).await;
    assert_eq!(status, 201, "{answer}");
    assert_eq!(lookups(&base, "skipped").await, skipped + 1);
    assert_eq!(lookups(&base, "asked").await, asked + 2);

    stack.stop().await;
}
