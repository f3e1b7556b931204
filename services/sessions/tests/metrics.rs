//! `GET /metrics` on every service after a task: the counters moved, histograms and gauges are
//! there, and `promtool check metrics` (Debian's prometheus package) finds nothing wrong.
//!
//! Without `promtool` the check says so and passes as skipped, unless
//! `AIP_REQUIRE_PROMTOOL=1` (scripts/test.sh installs it and sets that).

use std::io::Write as _;
use std::process::{Command, Stdio};

use aip_testkit::frames::{command_results_for, device_register};
use aip_testkit::{Backend, Client, Options, Stack, both_backends, post_json};
use serde_json::json;

/// The value of the first sample of `name` whose labels include every one of `labels`.
fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .find(|l| labels.iter().all(|label| l.contains(label)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

async fn scrape(base: &str) -> String {
    let response = reqwest::get(format!("{base}/metrics"))
        .await
        .expect("GET /metrics");
    assert_eq!(response.status(), 200);
    let kind = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(kind.starts_with("text/plain"), "{kind}");
    response.text().await.expect("text")
}

fn promtool_check(text: &str) {
    let Ok(mut child) = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    else {
        assert!(
            std::env::var("AIP_REQUIRE_PROMTOOL").is_ok_and(|v| v != "1"),
            "promtool is not installed (Debian: apt-get install prometheus)"
        );
        eprintln!("SKIPPED: promtool check metrics (promtool is not installed)");
        return;
    };
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("promtool ran");
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn every_service_reports_what_a_task_did(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let mut dev = Client::registered(&stack.ws_url(0), device_register("m-pc", "linux")).await;
    stack.wait_online("m-pc").await;
    let body = json!({ "version": 1, "description": "count me", "originating_agent_id": "ops",
        "target_id": "m-pc", "steps": [[{ "tool_name": "echo", "tool_type": "action" }]] });
    let (status, task) = post_json(&format!("{}/api/tasks", stack.sessions_url()), &body).await;
    assert_eq!(status, 201, "{task}");
    let command = dev.recv_type("command").await.expect("command");
    dev.send(&command_results_for("m-pc", &command))
        .await
        .expect("results");
    stack
        .task_in_state(task["task_id"].as_str().expect("id"), "completed")
        .await;

    let sessions = scrape(&stack.sessions_url()).await;
    let registry = scrape(&format!("http://{}", stack.registry_http)).await;
    let gateway = scrape(&format!("http://{}", stack.gateways[0].addr)).await;
    for (name, labels, text) in [
        (
            "aip_sessions_tasks_started_total",
            &["planner=\"scripted\""][..],
            &sessions,
        ),
        (
            "aip_sessions_tasks_ended_total",
            &["state=\"completed\""][..],
            &sessions,
        ),
        (
            "aip_sessions_task_duration_seconds_count",
            &[][..],
            &sessions,
        ),
        (
            "aip_sessions_group_commit_seconds_bucket",
            &["le=\"0.05\""][..],
            &sessions,
        ),
        (
            "aip_sessions_group_commit_changes_count",
            &[][..],
            &sessions,
        ),
        (
            "aip_registry_registrations_total",
            &["outcome=\"registered\""][..],
            &registry,
        ),
        (
            "aip_registry_group_commit_seconds_bucket",
            &["le=\"+Inf\""][..],
            &registry,
        ),
        (
            "aip_registry_group_commit_changes_count",
            &[][..],
            &registry,
        ),
        (
            "aip_gateway_frames_received_total",
            &["type=\"command_results\""][..],
            &gateway,
        ),
        (
            "aip_gateway_deliveries_total",
            &["outcome=\"written\""][..],
            &gateway,
        ),
        ("aip_gateway_connections_total", &[][..], &gateway),
    ] {
        let value = sample(text, name, labels)
            .unwrap_or_else(|| panic!("{name} {labels:?} missing:\n{text}"));
        assert!(value >= 1.0, "{name} {labels:?} = {value}");
    }
    assert!(
        sample(&gateway, "aip_gateway_connections", &[]).is_some_and(|v| v >= 1.0),
        "the device's connection is open:\n{gateway}"
    );
    for text in [&sessions, &registry, &gateway] {
        promtool_check(text);
    }
    stack.stop().await;
}
both_backends!(every_service_reports_what_a_task_did);
