//! Two session service replicas share one NATS and one PostgreSQL, active/standby: the first
//! leads and applies every change; the second serves reads, refuses changes with a clear
//! UNAVAILABLE, is not ready, and takes over when the leader stops, finishing the tasks the
//! leader left mid-flight. No task is corrupted: every log gap-free, every step run once.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use aip_testkit::frames::{command_results_for, device_register};
use aip_testkit::{Backend, Client, Options, Service, Stack, eventually, get_json, post_json};
use serde_json::{Value, json};

const DEVICES: usize = 6;
const TASKS_PER_DEVICE: usize = 4;
const STEPS: usize = 3;

struct Replica {
    url: String,
    service: Service,
}

async fn replica(stack: &Stack, name: &str) -> Replica {
    let mut settings = aip_sessions::Settings {
        subject_prefix: stack.prefix.clone(),
        ..Default::default()
    };
    settings.sessions.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    settings.sessions.standby_retry_ms = 200;
    let db = aip_store::Database::connect(&stack.database_url)
        .await
        .expect("db");
    let app = aip_sessions::Application::build(settings, stack.bus.clone(), db)
        .await
        .expect("replica");
    let url = format!("http://{}", app.local_addr());
    let service = Service::spawn(name, |stop| app.run_until(stop));
    Replica { url, service }
}

async fn readyz(base: &str) -> (u16, Value) {
    let response = reqwest::get(format!("{base}/readyz"))
        .await
        .expect("readyz");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or_default())
}

fn task_body(n: usize) -> Value {
    let steps: Vec<Value> = (0..STEPS)
        .map(|s| json!([{ "tool_name": "echo", "tool_type": "action", "parameters": { "s": s } }]))
        .collect();
    json!({ "version": 1, "description": format!("t{n}"), "originating_agent_id": "replicas",
        "target_id": format!("r-{}", n % DEVICES), "steps": steps })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_from_the_leader_without_corrupting_a_task() {
    let options = Options {
        sessions: false,
        ..Options::default()
    };
    let stack = Stack::start(Backend::NatsPostgres, options)
        .await
        .expect("stack");
    let first = replica(&stack, "the first replica").await;
    eventually("the first replica leads", || async {
        (readyz(&first.url).await.0 == 200).then_some(())
    })
    .await
    .expect("leader");
    let second = replica(&stack, "the second replica").await;

    // Once it has tried to lead, the second replica is a standby: not ready, saying why.
    let body = eventually("the second replica to find a leader", || async {
        let (status, body) = readyz(&second.url).await;
        (status == 503 && body["role"] == "standby").then_some(body)
    })
    .await
    .expect("standby");
    assert_eq!(body["status"], "not_ready", "{body}");
    let why = body["checks"]["leadership"]["detail"]
        .as_str()
        .unwrap_or_default();
    assert!(why.contains("another replica leads"), "{body}");
    assert_eq!(body["checks"]["database"]["ok"], true, "{body}");
    assert_eq!(
        readyz(&first.url).await.0,
        200,
        "the first replica still leads"
    );

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

    let (status, refused) = post_json(&format!("{}/api/tasks", second.url), &task_body(0)).await;
    assert_eq!(status, 503, "{refused}");
    assert_eq!(refused["error_code"], "UNAVAILABLE", "{refused}");
    assert!(
        refused["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("standby"),
        "{refused}"
    );

    let half = DEVICES * TASKS_PER_DEVICE / 2;
    let mut ids = Vec::new();
    for n in 0..half {
        let (status, task) = post_json(&format!("{}/api/tasks", first.url), &task_body(n)).await;
        assert_eq!(status, 201, "{task}");
        ids.push(task["task_id"].as_str().expect("id").to_owned());
    }
    // Reads work on the standby.
    let (status, task) = get_json(&format!("{}/api/tasks/{}", second.url, ids[0])).await;
    assert_eq!(status, 200, "{task}");

    // The leader stops with tasks mid-flight; the standby takes over and finishes them.
    first.service.stop().await;
    eventually("the second replica leads", || async {
        (readyz(&second.url).await.0 == 200).then_some(())
    })
    .await
    .expect("takeover");
    for n in half..DEVICES * TASKS_PER_DEVICE {
        let (status, task) = post_json(&format!("{}/api/tasks", second.url), &task_body(n)).await;
        assert_eq!(status, 201, "{task}");
        ids.push(task["task_id"].as_str().expect("id").to_owned());
    }

    for id in &ids {
        let url = format!("{}/api/tasks/{id}", second.url);
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
        let (_, log) = get_json(&format!("{}/api/tasks/{id}/events", second.url)).await;
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
    second.service.stop().await;
    stack.stop().await;
}
