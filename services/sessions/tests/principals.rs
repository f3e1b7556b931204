//! Issue 21: an API key acts only for its own requesters, targets only its devices, and is held
//! to its quotas; clients are held to the service's. Real REST, WebSockets, NATS and
//! databases, on both backends.

use aip_runtime::api_keys::{ApiKeys, key_sha256 as sha256};
use aip_testkit::frames::{
    command_results_for, constellation_register, constellation_task, device_register, one_step,
};
use aip_testkit::{Backend, Client, Options, Stack, both_backends};
use serde_json::{Value, json};

const CI_KEY: &str = "ci-key";
const OTHER_KEY: &str = "other-key";
const OPERATOR_KEY: &str = "root-key";
const GPU_KEY: &str = "gpu-key";

fn principals() -> String {
    format!(
        r#"
[[principal]]
name = "ci"
key_sha256 = "{}"
targets = ["pc-a*"]
max_live_tasks = 1
max_priority = 2

[[principal]]
name = "other"
key_sha256 = "{}"

[[principal]]
name = "gpu"
key_sha256 = "{}"
targets = ["capability:gpu"]
"#,
        sha256(CI_KEY),
        sha256(OTHER_KEY),
        sha256(GPU_KEY)
    )
}

fn with_operator_key(s: &mut aip_sessions::SessionSettings) {
    s.api_keys = vec![OPERATOR_KEY.to_owned()];
}

/// A REST call with `key`: the status and the JSON body.
async fn call(method: reqwest::Method, url: &str, key: &str, body: Option<&Value>) -> (u16, Value) {
    let mut request = reqwest::Client::new()
        .request(method.clone(), url)
        .header("x-api-key", key);
    if let Some(body) = body {
        request = request.json(body);
    }
    let response = request
        .send()
        .await
        .unwrap_or_else(|e| panic!("{method} {url}: {e}"));
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

fn task_body(from: &str, target: Option<&str>, priority: i32) -> Value {
    let mut body = json!({
        "version": 1, "description": "echo", "originating_agent_id": from, "priority": priority,
        "steps": one_step("echo", json!({ "text": "hi" })),
    });
    match target {
        Some(target) => body["target_id"] = json!(target),
        None => body["required_capabilities"] = json!(["demo"]),
    }
    body
}

async fn a_key_acts_only_for_its_requesters_and_devices(backend: Backend) {
    use reqwest::Method;
    let options = Options {
        principals: Some(principals()),
        sessions_settings: Some(with_operator_key),
        ..Options::default()
    };
    let stack = Stack::start(backend, options).await.expect("stack");
    let _a = Client::registered(&stack.ws_url(0), device_register("pc-a", "linux")).await;
    let _b = Client::registered(&stack.ws_url(0), device_register("pc-b", "linux")).await;
    stack.wait_online("pc-a").await;
    stack.wait_online("pc-b").await;
    let tasks = format!("{}/api/tasks", stack.sessions_url());

    // Its own task, on its own device: accepted, and its requester is the key's.
    let (status, task) = call(
        Method::POST,
        &tasks,
        CI_KEY,
        Some(&task_body("ci", Some("pc-a"), 0)),
    )
    .await;
    assert_eq!(status, 201, "{task}");
    let id = task["task_id"].as_str().expect("id").to_owned();
    let one = format!("{tasks}/{id}");

    // Outside its allowance: refused with FORBIDDEN, saying why.
    for (body, why) in [
        (
            task_body("ci", Some("pc-b"), 0),
            "may not target device `pc-b`",
        ),
        (task_body("ci", None, 0), "give target_id"),
        (
            task_body("other", Some("pc-a"), 0),
            "may not act for requester `other`",
        ),
        (task_body("ci", Some("pc-a"), 5), "ceiling of 2"),
    ] {
        let (status, refusal) = call(Method::POST, &tasks, CI_KEY, Some(&body)).await;
        assert_eq!(status, 403, "{body}: {refusal}");
        assert_eq!(refusal["error_code"], "FORBIDDEN");
        let detail = refusal["detail"].as_str().unwrap_or_default();
        assert!(detail.contains(why), "{detail}");
    }
    // Its quota of one live task.
    let (status, refusal) = call(
        Method::POST,
        &tasks,
        CI_KEY,
        Some(&task_body("ci", Some("pc-a"), 0)),
    )
    .await;
    assert_eq!(status, 429, "{refusal}");
    assert_eq!(refusal["error_code"], "RATE_LIMITED");
    assert!(
        refusal["detail"]
            .as_str()
            .is_some_and(|d| d.contains("quota")),
        "{refusal}"
    );

    // Another key neither reads nor changes it, nor lists it.
    for path in ["", "/events", "/callbacks"] {
        let (status, refusal) = call(Method::GET, &format!("{one}{path}"), OTHER_KEY, None).await;
        assert_eq!(status, 403, "GET {path}: {refusal}");
        assert_eq!(refusal["error_code"], "FORBIDDEN");
    }
    let (status, refusal) = call(
        Method::POST,
        &format!("{one}/cancel"),
        OTHER_KEY,
        Some(&json!({})),
    )
    .await;
    assert_eq!(status, 403, "{refusal}");
    let (status, page) = call(Method::GET, &tasks, OTHER_KEY, None).await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["tasks"], json!([]), "only its own tasks are listed");
    let (status, _) = call(
        Method::GET,
        &format!("{tasks}?requester=ci"),
        OTHER_KEY,
        None,
    )
    .await;
    assert_eq!(status, 403);

    // The key itself sees it, and lists only its own.
    let (status, seen) = call(Method::GET, &one, CI_KEY, None).await;
    assert_eq!(status, 200, "{seen}");
    assert_eq!(seen["state"], "working");
    let (status, page) = call(Method::GET, &tasks, CI_KEY, None).await;
    assert_eq!(status, 200, "{page}");
    let listed: Vec<&str> = page["tasks"]
        .as_array()
        .expect("tasks")
        .iter()
        .filter_map(|t| t["task_id"].as_str())
        .collect();
    assert_eq!(listed, [id.as_str()]);

    // An operator key acts on every task: it cancels the one the other key could not.
    let (status, cancelled) = call(
        Method::POST,
        &format!("{one}/cancel"),
        OPERATOR_KEY,
        Some(&json!({})),
    )
    .await;
    assert_eq!(status, 200, "{cancelled}");
    assert_eq!(cancelled["state"], "canceled");
    // With its task ended, the quota lets the key submit again.
    let (status, again) = call(
        Method::POST,
        &tasks,
        CI_KEY,
        Some(&task_body("ci", Some("pc-a"), 2)),
    )
    .await;
    assert_eq!(status, 201, "{again}");

    // Seed 004's agent registration: a key registers only ids it acts for.
    let register = |id: &str| {
        json!({ "version": 1, "originating_agent_id": "ci",
            "description": format!("register me as an agent id={id} capabilities=x address=h:1") })
    };
    let (status, refusal) = call(Method::POST, &tasks, CI_KEY, Some(&register("someone"))).await;
    assert_eq!(status, 403, "{refusal}");
    let (status, registered) = call(Method::POST, &tasks, CI_KEY, Some(&register("ci"))).await;
    assert_eq!(status, 200, "{registered}");
    assert_eq!(registered["status"], "success", "{registered}");
    stack.stop().await;
}
both_backends!(a_key_acts_only_for_its_requesters_and_devices);

fn one_live_task_per_requester(s: &mut aip_sessions::SessionSettings) {
    s.max_live_tasks_per_requester = 1;
}

/// A task frame's refusal: its `error_code`.
async fn refused_code(galaxy: &mut Client) -> Value {
    let refusal = galaxy.recv().await.expect("refusal");
    let end = galaxy.recv_type("task_end").await.expect("task_end");
    assert_eq!(end["status"], "failed", "{end}");
    refusal["metadata"]["error_code"].clone()
}

async fn clients_are_held_to_the_quota_and_the_priority_ceiling(backend: Backend) {
    let options = Options {
        sessions_settings: Some(one_live_task_per_requester),
        ..Options::default()
    };
    let stack = Stack::start(backend, options).await.expect("stack");
    let mut dev = Client::registered(&stack.ws_url(0), device_register("pc-q", "linux")).await;
    stack.wait_online("pc-q").await;
    let mut galaxy = Client::registered(
        &stack.ws_url(0),
        constellation_register("g-q", Some("pc-q")),
    )
    .await;
    let steps = Some(one_step("echo", json!({})));
    galaxy
        .send(&constellation_task(
            "g-q",
            "pc-q",
            "s1",
            "t1",
            steps.clone(),
        ))
        .await
        .expect("task");
    assert_eq!(galaxy.recv().await.expect("ack")["session_id"], "s1");
    let command = dev.recv_type("command").await.expect("command");

    // A second live task: over the quota of one.
    galaxy
        .send(&constellation_task(
            "g-q",
            "pc-q",
            "s2",
            "t2",
            steps.clone(),
        ))
        .await
        .expect("task");
    assert_eq!(refused_code(&mut galaxy).await, "RATE_LIMITED");

    // A priority above the service's ceiling (0 by default for clients).
    let mut high = constellation_task("g-q", "pc-q", "s3", "t3", steps.clone());
    high["metadata"]["priority"] = json!(7);
    galaxy.send(&high).await.expect("task");
    assert_eq!(refused_code(&mut galaxy).await, "FORBIDDEN");

    // The first ends; the quota has room again.
    dev.send(&command_results_for("pc-q", &command))
        .await
        .expect("results");
    assert_eq!(
        galaxy.recv_type("task_end").await.expect("end")["status"],
        "completed"
    );
    galaxy
        .send(&constellation_task("g-q", "pc-q", "s4", "t4", steps))
        .await
        .expect("task");
    assert_eq!(galaxy.recv().await.expect("ack")["session_id"], "s4");
    stack.stop().await;
}
both_backends!(clients_are_held_to_the_quota_and_the_priority_ceiling);

#[test]
fn bad_principals_files_say_what_is_wrong() {
    let key = sha256("k");
    for (text, expected) in [
        (
            "[[principal]]\nname = \"a\"\nkey_sha256 = \"abc\"\n".to_owned(),
            "64 hex digits",
        ),
        (
            format!(
                "[[principal]]\nname = \"a\"\nkey_sha256 = \"{}\"\n[[principal]]\nname = \"a\"\nkey_sha256 = \"{}\"\n",
                sha256("k1"),
                sha256("k2")
            ),
            "listed twice",
        ),
        (
            format!("[[principal]]\nname = \"a\"\nkey_sha256 = \"{key}\"\n"),
            "already another principal's or an api_keys entry",
        ),
        (
            format!(
                "[[principal]]\nname = \"a\"\nkey_sha256 = \"{}\"\nscope = \"operator\"\ntargets = [\"x\"]\n",
                sha256("k3")
            ),
            "an operator acts for everyone",
        ),
        (
            format!(
                "[[principal]]\nname = \"a\"\nkey_sha256 = \"{}\"\nacts_for = []\n",
                sha256("k3")
            ),
            "acts_for must not be empty",
        ),
        (
            format!(
                "[[principal]]\nname = \"a\"\nkey_sha256 = \"{}\"\nmax_live_task = 3\n",
                sha256("k3")
            ),
            "max_live_task",
        ),
    ] {
        let error = ApiKeys::with_principals(&["k"], &text).expect_err(&text);
        assert!(error.contains(expected), "{text}: {error}");
    }
}

/// A key whose targets are a capability: its tasks run on devices that have it, by id or by
/// capability placement, and nowhere else.
async fn a_key_targets_devices_by_capability(backend: Backend) {
    use reqwest::Method;
    let options = Options {
        principals: Some(principals()),
        ..Options::default()
    };
    let stack = Stack::start(backend, options).await.expect("stack");
    let _gpu = Client::registered(
        &stack.ws_url(0),
        aip_testkit::frames::device_register_with("gpu-box", &["gpu"]),
    )
    .await;
    let _cpu = Client::registered(
        &stack.ws_url(0),
        aip_testkit::frames::device_register_with("cpu-box", &["demo"]),
    )
    .await;
    stack.wait_online("gpu-box").await;
    stack.wait_online("cpu-box").await;
    let tasks = format!("{}/api/tasks", stack.sessions_url());
    let by_target = |target: &str| task_body("gpu", Some(target), 0);
    let by_capability = |capability: &str| {
        let mut body = task_body("gpu", None, 0);
        body["required_capabilities"] = json!([capability]);
        body
    };
    let (status, task) = call(Method::POST, &tasks, GPU_KEY, Some(&by_target("gpu-box"))).await;
    assert_eq!(status, 201, "{task}");
    let (status, task) = call(Method::POST, &tasks, GPU_KEY, Some(&by_capability("gpu"))).await;
    assert_eq!(status, 201, "{task}");
    let (status, refusal) = call(Method::POST, &tasks, GPU_KEY, Some(&by_target("cpu-box"))).await;
    assert_eq!(status, 403, "{refusal}");
    assert!(
        refusal["detail"]
            .as_str()
            .is_some_and(|d| d.contains("may not target device `cpu-box`")),
        "{refusal}"
    );
    let (status, refusal) = call(Method::POST, &tasks, GPU_KEY, Some(&by_capability("demo"))).await;
    assert_eq!(status, 403, "{refusal}");
    stack.stop().await;
}
both_backends!(a_key_targets_devices_by_capability);
