//! UFO-format clients, unchanged, against `aip dev` as a process: a device and a Galaxy
//! constellation run a scripted task (steps in the TASK frame's `metadata.steps`) through the
//! one listener, and UFO's REST paths answer on the same port.

mod common;

use aip_testkit::frames::{
    command_results_for, constellation_register, constellation_task, device_register,
};
use aip_testkit::{Client, get_json};
use common::{TempDir, start_dev};
use serde_json::{Value, json};

#[test]
fn ufo_device_and_constellation_through_aip_dev() {
    aip_runtime::install_crypto_provider();
    let data = TempDir::new("ufo");
    let (dev, rest, ws) = start_dev(data.path(), &[]);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let mut device = Client::registered(&ws, device_register("pc-1", "windows")).await;
        aip_testkit::eventually("pc-1 online", || async {
            let (_, body) = get_json(&format!("{rest}/api/clients")).await;
            body["online_clients"]
                .as_array()?
                .iter()
                .any(|c| c == "pc-1")
                .then_some(())
        })
        .await
        .expect("the registry sees the device");
        let mut galaxy = Client::registered(&ws, constellation_register("demo@pc-1", Some("pc-1"))).await;

        let session = "demo@task-1";
        let steps = json!([
            [{ "tool_name": "list_tools", "tool_type": "action", "parameters": { "tool_type": "action" } }],
            [{ "tool_name": "type_text", "tool_type": "action", "parameters": { "text": "hello" } }]
        ]);
        galaxy
            .send(&constellation_task("demo@pc-1", "pc-1", session, "demo_task", Some(steps)))
            .await
            .expect("task");
        let ack = galaxy.recv().await.expect("ack");
        assert_eq!((&ack["type"], &ack["session_id"]), (&json!("heartbeat"), &json!(session)));

        for expected in ["list_tools", "type_text"] {
            let command = device.recv().await.expect("command");
            assert_eq!(command["type"], "command", "{command}");
            assert_eq!(command["agent_name"], "HostAgent", "windows → HostAgent");
            assert_eq!(command["actions"][0]["tool_name"], expected);
            device
                .send(&command_results_for("pc-1", &command))
                .await
                .expect("results");
        }
        for client in [&mut galaxy, &mut device] {
            let end = client.recv_type("task_end").await.expect("task_end");
            assert_eq!((&end["status"], &end["session_id"]), (&json!("completed"), &json!(session)));
        }

        let (status, task) = get_json(&format!("{rest}/api/tasks/demo%40task-1")).await;
        assert_eq!((status, &task["state"]), (200, &json!("completed")), "{task}");
        let (status, result) = get_json(&format!("{rest}/api/task_result/demo_task")).await;
        assert_eq!((status, &result["status"]), (200, &json!("done")), "{result}");
        let (status, health) = get_json(&format!("{rest}/api/health")).await;
        assert_eq!(status, 200);
        assert_eq!(health["status"], "healthy");
        let (status, ready) = get_json(&format!("{rest}/readyz")).await;
        assert_eq!((status, &ready["status"]), (200, &json!("ready")));

        // UFO's REST dispatch, answered by the same UFO device over the same port.
        let response = reqwest::Client::new()
            .post(format!("{rest}/api/dispatch"))
            .json(&json!({ "client_id": "pc-1", "request": "say hi", "task_name": "ufo-1",
                "steps": [[{ "tool_name": "echo", "tool_type": "action", "parameters": {} }]] }))
            .send()
            .await
            .expect("dispatch");
        assert_eq!(response.status().as_u16(), 200);
        let dispatched: Value = response.json().await.expect("json");
        let task_frame = device.recv_type("task").await.expect("server task frame");
        assert_eq!(task_frame["session_id"], dispatched["session_id"]);
        galaxy.close().await;
        device.close().await;
    });
    drop(dev);
}
