//! The real `aip-registry` binary against NATS and PostgreSQL: configured by environment
//! variables, ready on `/readyz`, serving `registry.register` over NATS and REST, and exiting
//! cleanly on SIGTERM.

mod common;

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use aip_bus::{NatsBus, SharedBus};
use aip_store::testing::TestDatabase;
use aip_testkit::eventually_within;
use common::device;
use proto_schemas::Subjects;
use proto_schemas::registry::{Registered, Reply};
use serde_json::Value;

/// How long the binary may take to be ready: it connects to NATS and PostgreSQL and
/// migrates a fresh database, on a machine busy with other tests.
const STARTUP: Duration = Duration::from_secs(60);

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

fn free_port() -> u16 {
    aip_testkit::free_port()
}

fn registry_command(log: &std::path::Path) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_aip-registry"));
    let log = std::fs::File::create(log).expect("log file");
    command
        .env_remove("AIP_CONFIG")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .kill_on_drop(true);
    command
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_serves_nats_and_rest_and_stops_on_sigterm() {
    aip_runtime::install_crypto_provider();
    let test_db = TestDatabase::postgres()
        .await
        .expect("PostgreSQL must be running (DATABASE_URL)");
    let prefix = format!("t_{}", uuid::Uuid::new_v4().simple());
    let port = free_port();
    let log = std::env::temp_dir().join(format!("aip-registry-{prefix}.log"));
    let mut child = registry_command(&log)
        .env("AIP_NATS_URL", nats_url())
        .env("AIP_DATABASE_URL", test_db.url())
        .env("AIP_SUBJECT_PREFIX", &prefix)
        .env("AIP_LOG_FORMAT", "json")
        .env("AIP_WORKER_THREADS", "1")
        .env("AIP_REGISTRY__LISTEN", format!("127.0.0.1:{port}"))
        .env("AIP_REGISTRY__API_KEYS", "key-one,key-two")
        .spawn()
        .expect("the binary starts");
    let logs = || std::fs::read_to_string(&log).unwrap_or_default();

    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    eventually_within(STARTUP, "/readyz answers 200", || async {
        let response = http.get(format!("{base}/readyz")).send().await.ok()?;
        (response.status() == 200).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}; its log:\n{}", logs()));
    assert!(
        logs().contains(r#""worker_threads":1"#),
        "the runtime's threads (AIP_WORKER_THREADS) are not logged at start:\n{}",
        logs()
    );

    let bus: SharedBus = Arc::new(
        NatsBus::connect(&nats_url(), "aip-registry-binary-test")
            .await
            .expect("NATS"),
    );
    let subjects = Subjects::new(&prefix).expect("prefix");
    let request = serde_json::to_vec(&device("bin-pc", "gw-bin", "conn-bin", "lab")).expect("json");
    let reply = bus
        .request(
            subjects.registry_register(),
            aip_bus::Headers::new(),
            request.into(),
            Duration::from_secs(10),
        )
        .await
        .expect("the binary answers registry.register");
    let reply: Reply<Registered> = serde_json::from_slice(&reply.payload).expect("Reply");
    let registered = reply.into_result().expect("registered");
    assert_eq!(registered.agent.agent_id, "bin-pc");

    let clients: Value = http
        .get(format!("{base}/api/clients"))
        .header("X-API-Key", "key-two")
        .send()
        .await
        .expect("request")
        .json()
        .await
        .expect("json");
    assert_eq!(clients, serde_json::json!({"online_clients": ["bin-pc"]}));
    let unauthorised = http
        .get(format!("{base}/api/clients"))
        .send()
        .await
        .expect("request");
    assert_eq!(unauthorised.status(), 401);

    let pid = child.id().expect("running");
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(kill.success());
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the registry did not exit within 20 s of SIGTERM; its log:\n{}",
                logs()
            )
        })
        .expect("wait");
    let text = logs();
    assert!(status.success(), "exit status {status:?}; log:\n{text}");
    assert!(text.contains("SIGTERM received"), "log:\n{text}");
    assert!(text.contains("registry stopped"), "log:\n{text}");
    let _ = std::fs::remove_file(&log);
    test_db.cleanup().await;
}

#[tokio::test]
async fn binary_refuses_an_open_api_on_the_network() {
    let log = std::env::temp_dir().join(format!(
        "aip-registry-open-{}.log",
        uuid::Uuid::new_v4().simple()
    ));
    let status = registry_command(&log)
        .env("AIP_REGISTRY__LISTEN", "0.0.0.0:0")
        .env("AIP_REGISTRY__API_KEYS", "")
        .env("AIP_NATS_URL", "nats://127.0.0.1:1")
        .status();
    let status = tokio::time::timeout(Duration::from_secs(20), status)
        .await
        .expect("exits at once")
        .expect("runs");
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!status.success());
    assert!(
        text.contains("refusing to serve the REST API on 0.0.0.0:0 without API keys"),
        "{text}"
    );
    let _ = std::fs::remove_file(&log);
}
