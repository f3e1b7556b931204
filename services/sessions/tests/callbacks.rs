//! Callbacks as a receiver sees them: a real HTTP receiver inside the test that fails on
//! purpose, signatures checked with the `standardwebhooks` crate (and Python package), the
//! delivery log over REST, 410, dead letters and redelivery, refused private URLs, and a
//! callback that survives `kill -9` of the session service; on both backends.

use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aip_testkit::frames::{command_results_for, device_register};
use aip_testkit::{
    Backend, Client, Options, Stack, both_backends, eventually, get_json, post_json,
};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use serde_json::{Value, json};

mod common;
use common::{free_port, stack_without_sessions, start_ready_sessions};

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
/// A second secret: the broker signs with both, as while rotating keys.
const NEXT_SECRET: &str = "whsec_c2Vjb25kLXNlY3JldC1mb3Itcm90YXRpb24=";

/// A request the receiver got, and what it answered.
#[derive(Debug, Clone)]
struct Received {
    headers: HeaderMap,
    body: String,
    answered: u16,
    at: std::time::Instant,
}

/// Answers the `n`th request (from 0) with a status and optional `Retry-After`.
type Plan = Arc<dyn Fn(usize) -> (StatusCode, Option<&'static str>) + Send + Sync>;

#[derive(Clone)]
struct Receiver {
    plan: Plan,
    got: Arc<Mutex<Vec<Received>>>,
}

async fn receive(
    State(r): State<Receiver>,
    headers: HeaderMap,
    body: String,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let mut got = r.got.lock().expect("lock");
    let (status, retry_after) = (r.plan)(got.len());
    got.push(Received {
        headers,
        body,
        answered: status.as_u16(),
        at: std::time::Instant::now(),
    });
    match retry_after {
        Some(after) => (status, [("retry-after", after)]).into_response(),
        None => status.into_response(),
    }
}

/// A receiver on a random loopback port: its URL and what it got.
async fn receiver(plan: Plan) -> (String, Arc<Mutex<Vec<Received>>>) {
    let got = Arc::new(Mutex::new(Vec::new()));
    let app = axum::Router::new()
        .route("/hook", post(receive))
        .with_state(Receiver {
            plan,
            got: got.clone(),
        });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}/hook"), got)
}

fn fast_callbacks(s: &mut aip_sessions::SessionSettings) {
    s.callback_allow_private = true;
    s.callback_secret = vec![SECRET.into(), NEXT_SECRET.into()];
    s.callback_backoff_ms = 100;
    // Above the Retry-After of the test, which the longest backoff caps.
    s.callback_max_backoff_ms = 1_500;
    s.callback_max_attempts = 5;
}

fn options() -> Options {
    Options {
        sessions_settings: Some(fast_callbacks),
        ..Options::default()
    }
}

async fn callbacks_of(stack: &Stack, id: &str) -> Value {
    get_json(&format!(
        "{}/api/tasks/{id}/callbacks",
        stack.sessions_url()
    ))
    .await
    .1
}

/// Waits until the task's first callback is in `state`.
async fn callback_in(stack: &Stack, id: &str, state: &str) -> Value {
    eventually(&format!("the callback to be {state}"), || async {
        let log = callbacks_of(stack, id).await;
        (log["callbacks"][0]["state"] == state).then(|| log["callbacks"][0].clone())
    })
    .await
    .expect("the callback settles")
}

/// A device that answers every command; a task with one step and `callback_url`, run to its
/// end. Returns the task id.
async fn run_task(stack: &Stack, device: &str, callback_url: &str) -> String {
    let mut dev = Client::registered(&stack.ws_url(0), device_register(device, "linux")).await;
    stack.wait_online(device).await;
    let body = json!({
        "version": 1, "description": "tell me when done", "originating_agent_id": "caller",
        "target_id": device, "callback_url": callback_url,
        "steps": [[{ "tool_name": "echo", "tool_type": "action", "parameters": { "n": 1 } }]]
    });
    let (status, task) = post_json(&format!("{}/api/tasks", stack.sessions_url()), &body).await;
    assert_eq!(status, 201, "{task}");
    let command = dev.recv_type("command").await.expect("command");
    dev.send(&command_results_for(device, &command))
        .await
        .expect("results");
    task["task_id"].as_str().expect("id").to_owned()
}

async fn a_failing_receiver_gets_one_delivery_signed_and_logged(backend: Backend) {
    let plan: Plan = Arc::new(|n| match n {
        0 => (StatusCode::INTERNAL_SERVER_ERROR, None),
        1 => (StatusCode::SERVICE_UNAVAILABLE, Some("1")),
        2 => (StatusCode::BAD_GATEWAY, None),
        _ => (StatusCode::NO_CONTENT, None),
    });
    let (url, got) = receiver(plan).await;
    let stack = Stack::start(backend, options()).await.expect("stack");
    let id = run_task(&stack, "cb-pc", &url).await;

    let callback = callback_in(&stack, &id, "delivered").await;
    let statuses: Vec<Value> = callback["log"]
        .as_array()
        .expect("log")
        .iter()
        .map(|a| a["status"].clone())
        .collect();
    assert_eq!(statuses, [json!(500), json!(503), json!(502), json!(204)]);
    assert_eq!(callback["attempts"], 4);
    assert_eq!(
        callback["callback_id"]
            .as_str()
            .map(|c| c.starts_with(&format!("{id}:"))),
        Some(true)
    );
    assert_eq!(
        callback["log"][0]["error"]
            .as_str()
            .map(|e| e.starts_with("HTTP 500")),
        Some(true),
        "{callback}"
    );

    // `delivered` is final (only pending callbacks are claimed), and the receiver records a
    // request before answering it: what it holds now is everything it will get.
    let got = got.lock().expect("lock").clone();
    assert_eq!(got.len(), 4, "{got:?}");
    assert_eq!(got.iter().filter(|r| r.answered < 300).count(), 1);
    // Retry-After: 1 was honoured between the second and third attempt (the backoff alone
    // waits 200 ms, with jitter at most 400 ms).
    let waited = got[2].at - got[1].at;
    assert!(
        waited >= Duration::from_millis(950),
        "Retry-After: 1 is honoured: {waited:?}"
    );

    // Every attempt is the same message, signed with both secrets.
    let webhook_id = callback["callback_id"].as_str().expect("id");
    for request in &got {
        assert_eq!(request.headers["webhook-id"], webhook_id);
        assert_eq!(request.body, got[0].body, "the same bytes each time");
        for secret in [SECRET, NEXT_SECRET] {
            standardwebhooks::Webhook::new(secret)
                .expect("secret")
                .verify(request.body.as_bytes(), &request.headers)
                .expect("the signature verifies");
        }
    }
    let notification: Value = serde_json::from_str(&got[0].body).expect("json");
    assert_eq!(notification["version"], 1);
    assert_eq!(notification["task_id"], id.as_str());
    assert_eq!(notification["status"], "complete");
    assert_eq!(notification["state"], "completed");
    assert_eq!(notification["sent_to"], url.as_str());
    assert_eq!(
        notification["result"][0]["results"][0]["result"]["echo"]["n"],
        1
    );
    assert_eq!(callback["notification"], notification);
    verify_with_python(&got[3]);
    stack.stop().await;
}
both_backends!(a_failing_receiver_gets_one_delivery_signed_and_logged);

/// Checks the delivery with the `standardwebhooks` Python package, as a receiver written in
/// Python would. Skipped (with a note) when the package is missing, unless the examples'
/// packages are required.
fn verify_with_python(request: &Received) {
    let has = Command::new("python3")
        .args(["-c", "import standardwebhooks"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has {
        assert!(
            std::env::var("AIP_REQUIRE_PYTHON_EXAMPLES").is_ok_and(|v| v != "1"),
            "python3 cannot import standardwebhooks: pip install -r scripts/python-requirements.txt"
        );
        eprintln!("SKIPPED: the Python check (no standardwebhooks package)");
        return;
    }
    let headers: serde_json::Map<String, Value> =
        ["webhook-id", "webhook-timestamp", "webhook-signature"]
            .iter()
            .map(|h| {
                (
                    (*h).to_owned(),
                    json!(request.headers[*h].to_str().expect("text")),
                )
            })
            .collect();
    let script = "import json, sys\n\
        from standardwebhooks.webhooks import Webhook\n\
        headers = json.loads(sys.argv[2])\n\
        Webhook(sys.argv[1]).verify(sys.stdin.read(), headers)\n\
        print('verified')";
    let mut child = Command::new("python3")
        .args([
            "-c",
            script,
            NEXT_SECRET,
            &Value::Object(headers).to_string(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3");
    use std::io::Write as _;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(request.body.as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("python3 ran");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("verified"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn gone_stops_dead_letters_wait_and_redeliver_starts_over(backend: Backend) {
    let (gone_url, gone_got) = receiver(Arc::new(|_| (StatusCode::GONE, None))).await;
    let (busy_url, busy_got) = receiver(Arc::new(|n| match n {
        0..5 => (StatusCode::SERVICE_UNAVAILABLE, None),
        _ => (StatusCode::OK, None),
    }))
    .await;
    let stack = Stack::start(backend, options()).await.expect("stack");

    let gone = run_task(&stack, "gone-pc", &gone_url).await;
    let settled = callback_in(&stack, &gone, "gone").await;
    assert_eq!(settled["attempts"], 1, "{settled}");

    let busy = run_task(&stack, "busy-pc", &busy_url).await;
    let dead = callback_in(&stack, &busy, "dead").await;
    assert_eq!(
        dead["attempts"], 5,
        "five attempts, then the dead letter: {dead}"
    );
    assert_eq!(busy_got.lock().expect("lock").len(), 5);

    let url = format!(
        "{}/api/tasks/{busy}/callbacks/redeliver",
        stack.sessions_url()
    );
    let (status, answer) = post_json(&url, &json!({})).await;
    assert_eq!(
        (status, answer["requeued"].clone()),
        (202, json!(1)),
        "{answer}"
    );
    let delivered = callback_in(&stack, &busy, "delivered").await;
    assert_eq!(delivered["attempts"], 6, "{delivered}");
    assert_eq!(delivered["log"][5]["status"], 200);

    let (status, answer) = post_json(
        &format!(
            "{}/api/tasks/nope/callbacks/redeliver",
            stack.sessions_url()
        ),
        &json!({}),
    )
    .await;
    assert_eq!(status, 404, "{answer}");
    // `gone` is final: the one attempt is all the receiver gets.
    assert_eq!(gone_got.lock().expect("lock").len(), 1, "410 stops retries");
    stack.stop().await;
}
both_backends!(gone_stops_dead_letters_wait_and_redeliver_starts_over);

async fn callbacks_follow_the_transitions_the_request_asks_for(backend: Backend) {
    let (url, got) = receiver(Arc::new(|_| (StatusCode::OK, None))).await;
    let stack = Stack::start(backend, options()).await.expect("stack");
    let mut dev = Client::registered(&stack.ws_url(0), device_register("on-pc", "linux")).await;
    stack.wait_online("on-pc").await;
    let body = json!({
        "version": 1, "description": "tell me each step", "originating_agent_id": "caller",
        "target_id": "on-pc", "callback_url": url, "callback_on": ["dispatched", "working"],
        "steps": [[{ "tool_name": "a", "tool_type": "action" }], [{ "tool_name": "b", "tool_type": "action" }]]
    });
    let (status, task) = post_json(&format!("{}/api/tasks", stack.sessions_url()), &body).await;
    assert_eq!(status, 201, "{task}");
    let id = task["task_id"].as_str().expect("id").to_owned();
    for _ in 0..2 {
        let command = dev.recv_type("command").await.expect("command");
        dev.send(&command_results_for("on-pc", &command))
            .await
            .expect("results");
    }
    let log = eventually("three delivered callbacks", || async {
        let log = callbacks_of(&stack, &id).await;
        let callbacks = log["callbacks"].as_array().cloned().unwrap_or_default();
        (callbacks.len() == 3 && callbacks.iter().all(|c| c["state"] == "delivered"))
            .then_some(callbacks)
    })
    .await
    .expect("delivered");
    // One per transition asked for (working once, not once per step), then the end.
    let mut told: Vec<(i64, String, String)> = log
        .iter()
        .map(|c| {
            let seq = c["callback_id"]
                .as_str()
                .and_then(|id| id.rsplit(':').next())
                .and_then(|n| n.parse().ok())
                .expect("seq");
            let n = &c["notification"];
            (
                seq,
                n["state"].as_str().unwrap_or_default().to_owned(),
                n["status"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    told.sort();
    let told: Vec<(&str, &str)> = told
        .iter()
        .map(|(_, state, status)| (state.as_str(), status.as_str()))
        .collect();
    assert_eq!(
        told,
        [
            ("dispatched", "in_progress"),
            ("working", "in_progress"),
            ("completed", "complete")
        ]
    );
    assert_eq!(got.lock().expect("lock").len(), 3);
    stack.stop().await;
}
both_backends!(callbacks_follow_the_transitions_the_request_asks_for);

async fn private_callback_urls_are_refused_by_default(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let _dev = Client::registered(&stack.ws_url(0), device_register("priv-pc", "linux")).await;
    stack.wait_online("priv-pc").await;
    for url in [
        "http://127.0.0.1:9/hook",
        "http://169.254.169.254/latest/meta-data",
        "http://localhost/x",
        "file:///etc/passwd",
    ] {
        let body = json!({ "version": 1, "description": "d", "originating_agent_id": "c",
            "target_id": "priv-pc", "driver": true, "callback_url": url });
        let (status, answer) =
            post_json(&format!("{}/api/tasks", stack.sessions_url()), &body).await;
        assert_eq!(
            (status, answer["error_code"].as_str()),
            (400, Some("INVALID_REQUEST")),
            "{url}: {answer}"
        );
        assert!(
            answer["detail"]
                .as_str()
                .is_some_and(|d| d.contains("callback_url")),
            "{answer}"
        );
    }
    stack.stop().await;
}
both_backends!(private_callback_urls_are_refused_by_default);

/// What the killed process is started with: callbacks to the loopback receiver, quickly.
const CALLBACK_ENV: &[(&str, &str)] = &[
    ("AIP_SESSIONS__CALLBACK_ALLOW_PRIVATE", "true"),
    ("AIP_SESSIONS__CALLBACK_SECRET", SECRET),
    ("AIP_SESSIONS__CALLBACK_BACKOFF_MS", "300"),
    ("AIP_SESSIONS__CALLBACK_MAX_BACKOFF_MS", "300"),
    ("AIP_SESSIONS__CALLBACK_MAX_ATTEMPTS", "100"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_callback_survives_kill_9_and_is_delivered_once() {
    let stack = stack_without_sessions().await;
    // The receiver refuses until it is told to accept.
    let accept = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let plan: Plan = {
        let accept = accept.clone();
        Arc::new(move |_| {
            if accept.load(std::sync::atomic::Ordering::SeqCst) {
                (StatusCode::OK, None)
            } else {
                (StatusCode::SERVICE_UNAVAILABLE, None)
            }
        })
    };
    let (url, got) = receiver(plan).await;
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let mut sessions = start_ready_sessions(&stack, port, CALLBACK_ENV).await;

    let _dev = Client::registered(&stack.ws_url(0), device_register("kill-pc", "linux")).await;
    stack.wait_online("kill-pc").await;
    let body = json!({ "version": 1, "description": "driven", "originating_agent_id": "c",
        "target_id": "kill-pc", "driver": true, "callback_url": url });
    let (status, task) = post_json(&format!("{base}/api/tasks"), &body).await;
    assert_eq!(status, 201, "{task}");
    let id = task["task_id"].as_str().expect("id").to_owned();
    let (status, ended) = post_json(
        &format!("{base}/api/tasks/{id}/complete"),
        &json!({ "result": { "answer": 42 } }),
    )
    .await;
    assert_eq!(status, 200, "{ended}");
    eventually("a refused attempt", || async {
        (!got.lock().expect("lock").is_empty()).then_some(())
    })
    .await
    .expect("attempted");

    sessions.0.kill().expect("kill -9");
    let _ = sessions.0.wait();
    accept.store(true, std::sync::atomic::Ordering::SeqCst);
    let refused_before = got.lock().expect("lock").len();
    let _restarted = start_ready_sessions(&stack, port, CALLBACK_ENV).await;
    eventually("the delivery after the restart", || async {
        let log = get_json(&format!("{base}/api/tasks/{id}/callbacks"))
            .await
            .1;
        (log["callbacks"][0]["state"] == "delivered").then_some(())
    })
    .await
    .expect("delivered");
    // `delivered` is final: nothing more is sent.
    let got = got.lock().expect("lock").clone();
    let accepted: Vec<&Received> = got.iter().filter(|r| r.answered == 200).collect();
    assert_eq!(
        accepted.len(),
        1,
        "delivered once after the restart: {got:?}"
    );
    assert!(got.len() > refused_before, "delivered by the new process");
    let notification: Value = serde_json::from_str(&accepted[0].body).expect("json");
    assert_eq!(notification["result"], json!({ "answer": 42 }));
}

fn agent_callbacks(s: &mut aip_sessions::SessionSettings) {
    // A short attempt timeout makes a claim lapse soon: an agent that connects late is found
    // within seconds.
    s.callback_timeout_ms = 1_000;
    s.callback_backoff_ms = 100;
}

/// A device agent that announced `callback` (or not).
async fn agent(stack: &Stack, id: &str, extensions: &[&str]) -> Client {
    let mut register = device_register(id, "linux");
    register["metadata"]["aip_extensions"] = json!(extensions);
    let client = Client::registered(&stack.ws_url(0), register).await;
    stack.wait_online(id).await;
    client
}

/// A completed task whose callback goes to agent `to`.
async fn task_calling_back(stack: &Stack, dev: &mut Client, device: &str, to: &str) -> String {
    let body = json!({ "version": 1, "description": "call an agent back", "originating_agent_id": "t",
        "target_id": device, "callback_agent": to,
        "steps": aip_testkit::frames::one_step("echo", json!({ "n": 1 })) });
    let (status, task) = post_json(&format!("{}/api/tasks", stack.sessions_url()), &body).await;
    assert_eq!(status, 201, "{task}");
    let command = dev.recv_type("command").await.expect("command");
    dev.send(&command_results_for(device, &command))
        .await
        .expect("results");
    task["task_id"].as_str().expect("id").to_owned()
}

/// Issue 16: a callback to an agent id is a `callback` frame when it is connected, and waits
/// for it when it is not; an agent that did not announce the extension never gets one.
async fn callbacks_reach_an_agent_as_frames_and_wait_for_it(backend: Backend) {
    let options = Options {
        sessions_settings: Some(agent_callbacks),
        ..Options::default()
    };
    let stack = Stack::start(backend, options).await.expect("stack");
    let mut dev = agent(&stack, "pc-cb", &[]).await;

    // Connected: the frame comes, with the notification.
    let mut watcher = agent(&stack, "watcher", &["callback"]).await;
    let id = task_calling_back(&stack, &mut dev, "pc-cb", "watcher").await;
    let frame = watcher.recv_type("callback").await.expect("callback frame");
    assert_eq!(frame["session_id"], id.as_str());
    assert_eq!(frame["status"], "completed");
    assert_eq!(frame["metadata"]["task_id"], id.as_str());
    assert_eq!(frame["metadata"]["status"], "complete");
    assert_eq!(frame["metadata"]["sent_to"], "watcher");
    let delivered = eventually("the callback delivered", || {
        let stack = &stack;
        let id = id.clone();
        async move {
            let c = callbacks_of(stack, &id).await;
            (c["callbacks"][0]["state"] == "delivered").then_some(c)
        }
    })
    .await
    .expect("delivered");
    assert_eq!(
        delivered["callbacks"][0]["target"], "agent:watcher",
        "{delivered}"
    );

    // Not connected yet: the callback waits, and reaches the agent once it connects.
    let late_id = task_calling_back(&stack, &mut dev, "pc-cb", "late").await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let waiting = callbacks_of(&stack, &late_id).await;
    assert_eq!(waiting["callbacks"][0]["state"], "pending", "{waiting}");
    assert_eq!(
        waiting["callbacks"][0]["attempts"], 0,
        "waiting for an agent is not an attempt: {waiting}"
    );
    let mut late = agent(&stack, "late", &["callback"]).await;
    let frame = late.recv_type("callback").await.expect("the late callback");
    assert_eq!(frame["session_id"], late_id.as_str());

    // An agent without the extension: dead-lettered, saying why; it sees no extension frame.
    let mut plain = agent(&stack, "plain", &[]).await;
    let plain_id = task_calling_back(&stack, &mut dev, "pc-cb", "plain").await;
    let dead = eventually("the callback dead-lettered", || {
        let stack = &stack;
        let id = plain_id.clone();
        async move {
            let c = callbacks_of(stack, &id).await;
            (c["callbacks"][0]["state"] == "dead").then_some(c)
        }
    })
    .await
    .expect("dead");
    let error = dead["callbacks"][0]["log"][0]["error"]
        .as_str()
        .unwrap_or_default();
    assert!(error.contains("`callback` extension"), "{dead}");
    plain
        .expect_silence(Duration::from_millis(300))
        .await
        .expect("no frame for a plain client");

    // Both kinds at once are refused.
    let both = json!({ "version": 1, "description": "x", "originating_agent_id": "t", "target_id": "pc-cb",
        "callback_agent": "watcher", "callback_url": "http://127.0.0.1:1/hook",
        "steps": aip_testkit::frames::one_step("echo", json!({})) });
    let (status, refusal) = post_json(&format!("{}/api/tasks", stack.sessions_url()), &both).await;
    assert_eq!(status, 400, "{refusal}");
    stack.stop().await;
}
both_backends!(callbacks_reach_an_agent_as_frames_and_wait_for_it);
