//! Two session service replicas share one NATS and one PostgreSQL: they split the frames
//! stream between them, and no task is corrupted (every log gap-free, every step once).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use aip_testkit::frames::{command_results_for, device_register};
use aip_testkit::{Backend, Client, Options, Stack, eventually, get_json, post_json};
use serde_json::{Value, json};

const DEVICES: usize = 6;
const TASKS_PER_DEVICE: usize = 4;
const STEPS: usize = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_the_work_without_corrupting_a_task() {
    let stack = Stack::start(Backend::NatsPostgres, Options::default())
        .await
        .expect("stack");
    let mut settings = aip_sessions::Settings {
        subject_prefix: stack.prefix.clone(),
        ..Default::default()
    };
    settings.sessions.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    let db = aip_store::Database::connect(&stack.database_url)
        .await
        .expect("db");
    let second = aip_sessions::Application::build(settings, stack.bus.clone(), db)
        .await
        .expect("replica");
    let second_url = format!("http://{}", second.local_addr());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let replica = tokio::spawn(second.run_until(async move {
        let _ = stop_rx.await;
    }));

    let executed: Arc<Mutex<HashMap<String, Vec<String>>>> = Arc::default();
    let mut devices = Vec::new();
    for i in 0..DEVICES {
        let id = format!("r-{i}");
        let mut client = Client::registered(&stack.ws_url(0), device_register(&id, "linux")).await;
        stack.wait_online(&id).await;
        let executed = executed.clone();
        devices.push(tokio::spawn(async move {
            while let Ok(frame) = client.recv().await {
                if frame["type"] == "command" {
                    let rid = frame["response_id"].as_str().unwrap_or_default().to_owned();
                    executed
                        .lock()
                        .expect("lock")
                        .entry(id.clone())
                        .or_default()
                        .push(rid);
                    if client
                        .send(&command_results_for(&id, &frame))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            }
        }));
    }

    let mut ids = Vec::new();
    for n in 0..DEVICES * TASKS_PER_DEVICE {
        let base = if n % 2 == 0 {
            stack.sessions_url()
        } else {
            second_url.clone()
        };
        let steps: Vec<Value> = (0..STEPS).map(|s| json!([{ "tool_name": "echo", "tool_type": "action", "parameters": { "s": s } }])).collect();
        let body = json!({ "version": 1, "description": format!("t{n}"), "originating_agent_id": "replicas",
            "target_id": format!("r-{}", n % DEVICES), "steps": steps });
        let (status, task) = post_json(&format!("{base}/api/tasks"), &body).await;
        assert_eq!(status, 201, "{task}");
        ids.push(task["task_id"].as_str().expect("id").to_owned());
    }
    for id in &ids {
        let url = format!("{}/api/tasks/{id}", stack.sessions_url());
        let task = eventually(&format!("{id} done"), || async {
            let (_, t) = get_json(&url).await;
            t["state"]
                .as_str()
                .filter(|s| ["completed", "failed", "canceled"].contains(s))?;
            Some(t)
        })
        .await
        .expect("ends");
        assert_eq!(task["state"], "completed", "{task}");
        let (_, log) = get_json(&format!("{second_url}/api/tasks/{id}/events")).await;
        let seqs: Vec<i64> = log["events"]
            .as_array()
            .expect("events")
            .iter()
            .filter_map(|e| e["seq"].as_i64())
            .collect();
        assert_eq!(
            seqs,
            (1..=seqs.len() as i64).collect::<Vec<_>>(),
            "gap-free {id}"
        );
        assert_eq!(
            seqs.len(),
            3 + 2 * STEPS,
            "submitted, dispatched, {STEPS} × (command, results), completed"
        );
    }
    for (device, ran) in executed.lock().expect("lock").iter() {
        let mut unique = ran.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(
            (unique.len(), ran.len()),
            (TASKS_PER_DEVICE * STEPS, TASKS_PER_DEVICE * STEPS),
            "{device}"
        );
    }
    for d in devices {
        d.abort();
    }
    let _ = stop_tx.send(());
    let _ = replica.await;
    stack.stop().await;
}
