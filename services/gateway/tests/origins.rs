//! A web page the developer visits cannot drive a broker that runs without authentication on
//! loopback (the `aip dev` default; issue 21): a browser's WebSocket handshake and REST calls
//! from another origin are refused, and so is a DNS-rebound page (its own name as `Host`).
//! Clients that are not browsers send no `Origin` and are not affected. A form posted to
//! `cancel` is not read as an empty body. Both backends.

use aip_testkit::frames::device_register;
use aip_testkit::{Backend, Client, ConnectError, Options, Stack, both_backends};
use serde_json::Value;

async fn refused_handshake(url: &str, headers: &[(&str, &str)]) -> (u16, Value) {
    match Client::connect_with(url, headers).await {
        Ok(_) => panic!("the handshake with {headers:?} was accepted"),
        Err(ConnectError::Refused(refusal)) => (refusal.status, refusal.body),
        Err(e) => panic!("unexpected: {e}"),
    }
}

async fn cross_origin_requests_are_refused(backend: Backend) {
    let stack = Stack::start(backend, Options::default())
        .await
        .expect("stack");
    let ws = stack.ws_url(0);
    let port = ws
        .trim_start_matches("ws://127.0.0.1:")
        .trim_end_matches("/ws")
        .to_owned();

    // A page of another site opening the socket.
    let (status, body) = refused_handshake(&ws, &[("Origin", "https://evil.example")]).await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(body["error_code"], "FORBIDDEN", "{body}");
    let detail = body["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("https://evil.example") && detail.contains("allowed_origins"),
        "{body}"
    );
    // A sandboxed page (`Origin: null`), and a page reaching 127.0.0.1 by DNS rebinding.
    let (status, _) = refused_handshake(&ws, &[("Origin", "null")]).await;
    assert_eq!(status, 403);
    let rebound = format!("rebind.evil.example:{port}");
    let (status, body) = refused_handshake(&ws, &[("Host", rebound.as_str())]).await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("DNS rebinding"),
        "{body}"
    );

    // UFO's clients send no Origin: unaffected, by address or by `localhost`.
    let _device = Client::registered(&ws, device_register("dev", "linux")).await;
    let by_name = format!("ws://localhost:{port}/ws");
    let _other = Client::registered(&by_name, device_register("dev2", "linux")).await;

    // REST: a page posting a cancel (no body, as a form or fetch would), reading tasks after
    // DNS rebinding; and a form body, which is not JSON.
    let http = reqwest::Client::new();
    let tasks = format!("{}/api/tasks", stack.sessions_url());
    let cancel = format!("{tasks}/some-task/cancel");
    let response = http
        .post(&cancel)
        .header("Origin", "https://evil.example")
        .send()
        .await
        .expect("answered");
    assert_eq!(response.status(), 403);
    let body: Value = response.json().await.expect("json");
    assert_eq!(body["error_code"], "FORBIDDEN", "{body}");
    let sessions_port = stack
        .sessions_url()
        .rsplit(':')
        .next()
        .unwrap_or_default()
        .to_owned();
    let response = http
        .get(&tasks)
        .header("Host", format!("rebind.evil.example:{sessions_port}"))
        .send()
        .await
        .expect("answered");
    assert_eq!(response.status(), 403);
    let response = http
        .post(&cancel)
        .header("Content-Length", "11")
        .body("reason=oops")
        .send()
        .await
        .expect("answered");
    assert_eq!(response.status(), 415, "a body without a JSON content type");
    // The same requests from a client that is not a browser are served.
    let response = http.get(&tasks).send().await.expect("answered");
    assert_eq!(response.status(), 200);
    let response = http.post(&cancel).send().await.expect("answered");
    assert_eq!(response.status(), 404, "no such task: past every guard");
    stack.stop().await;
}

both_backends!(cross_origin_requests_are_refused);
