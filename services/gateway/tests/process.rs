//! The real `aip-gateway` binary beside an in-process stack on NATS + PostgreSQL (a gateway
//! process needs NATS, so there is no in-process-bus variant):
//!
//! - `kill -9`: the process says goodbye to nobody; the registry takes its agents offline
//!   within the liveness window, and they register again on the other gateway;
//! - SIGTERM: every client gets close 1001, the agents go offline at once (the registry's
//!   liveness window is far longer than the test's patience), and the process exits 0.

mod common;

use std::path::PathBuf;
use std::process::Stdio;

use aip_testkit::frames::{constellation_register, device_register};
use aip_testkit::{Backend, Options, Stack, WAIT, eventually, nats_url};
use common::{agent, free_port, registered, until_offline, until_online};

/// A gateway process of `stack`, configured by environment variables.
struct GatewayProcess {
    child: tokio::process::Child,
    id: String,
    port: u16,
    log: PathBuf,
}

impl GatewayProcess {
    async fn start(stack: &Stack, extra: &[(&str, &str)]) -> GatewayProcess {
        let port = free_port();
        let id = format!(
            "proc-gw-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let log = std::env::temp_dir().join(format!("aip-gateway-{id}.log"));
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_aip-gateway"));
        command
            .env_remove("AIP_CONFIG")
            .env("RUST_LOG", "info")
            .env("AIP_LOG_FORMAT", "json")
            .env("AIP_NATS_URL", nats_url())
            .env("AIP_SUBJECT_PREFIX", &stack.prefix)
            .env(
                "AIP_NATS_BLOBS_MAX_BYTES",
                aip_testkit::TEST_BLOBS_MAX_BYTES.to_string(),
            )
            .env("AIP_GATEWAY__LISTEN", format!("127.0.0.1:{port}"))
            .env("AIP_GATEWAY__GATEWAY_ID", &id)
            .env("AIP_GATEWAY__PRESENCE_INTERVAL_MS", "300")
            .env("AIP_GATEWAY__REGISTER_TIMEOUT_MS", "3000")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(&log).expect("log file")))
            .kill_on_drop(true);
        for (k, v) in extra {
            command.env(k, v);
        }
        let child = command.spawn().expect("the gateway binary starts");
        let process = GatewayProcess {
            child,
            id,
            port,
            log,
        };
        let ready = format!("http://127.0.0.1:{port}/readyz");
        eventually("the gateway process is ready", || {
            let ready = ready.clone();
            async move {
                let response = reqwest::get(&ready).await.ok()?;
                (response.status() == 200).then_some(())
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}; log:\n{}", process.logs()));
        process
    }

    fn ws_url(&self) -> String {
        format!("ws://127.0.0.1:{}/ws", self.port)
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.log);
    }
}

async fn held_by(stack: &Stack, id: &str, gateway: &str) {
    let base = stack.registry_url();
    eventually(&format!("`{id}` available on {gateway}"), || {
        let base = base.clone();
        async move {
            let record = agent(&base, id).await?;
            (record["status"] == "available" && record["gateway_id"] == gateway).then_some(())
        }
    })
    .await
    .expect("held");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_a_gateway_process_takes_its_agents_offline() {
    let stack = Stack::start(
        Backend::NatsPostgres,
        Options {
            gateways: 1,
            sessions: false,
            liveness_ms: 2_000,
            ..Options::default()
        },
    )
    .await
    .expect("stack");
    let mut process = GatewayProcess::start(&stack, &[]).await;

    let register = device_register("roamer", "linux");
    let mut device = registered(&process.ws_url(), &register).await;
    let mut galaxy = registered(
        &process.ws_url(),
        &constellation_register("g@roamer", Some("roamer")),
    )
    .await;
    device.heartbeat("roamer", "device").await;
    held_by(&stack, "roamer", &process.id).await;
    held_by(&stack, "g@roamer", &process.id).await;
    until_online(&stack, "roamer").await;

    // SIGKILL: no close frames, no unregister, no last presence batch.
    process.child.kill().await.expect("SIGKILL");
    let closed = device.closed().await;
    assert_eq!(closed.code, None, "a killed process sends no close frame");
    galaxy.closed().await;
    until_offline(&stack, "roamer").await;
    until_offline(&stack, "g@roamer").await;

    // The device reconnects to the other gateway and registers again.
    let mut device = registered(&stack.ws_url(0), &register).await;
    device.heartbeat("roamer", "device").await;
    held_by(&stack, "roamer", &stack.gateways[0].id).await;
    let mut galaxy = registered(
        &stack.ws_url(0),
        &constellation_register("g@roamer", Some("roamer")),
    )
    .await;
    galaxy.heartbeat("g@roamer", "device").await;
    until_online(&stack, "g@roamer").await;
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_closes_clients_with_1001_and_exits_cleanly() {
    let stack = Stack::start(
        Backend::NatsPostgres,
        Options {
            gateways: 1,
            sessions: false,
            liveness_ms: 120_000,
            client_liveness_ms: 120_000,
            ..Options::default()
        },
    )
    .await
    .expect("stack");
    let mut process =
        GatewayProcess::start(&stack, &[("AIP_GATEWAY__SHUTDOWN_GRACE_MS", "5000")]).await;
    let register = device_register("stayer", "windows");
    let mut device = registered(&process.ws_url(), &register).await;
    let mut galaxy = registered(
        &process.ws_url(),
        &constellation_register("g@stayer", Some("stayer")),
    )
    .await;
    held_by(&stack, "stayer", &process.id).await;
    held_by(&stack, "g@stayer", &process.id).await;

    let pid = process.child.id().expect("running");
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(kill.success());

    for client in [&mut device, &mut galaxy] {
        let closed = client.closed().await;
        assert_eq!(closed.code, Some(1001), "{closed:?}");
        assert_eq!(closed.reason, "server shutting down; reconnect");
        assert!(closed.frames.is_empty(), "{closed:?}");
    }
    // Far inside the registry's 120 s liveness window: the gateway said so itself.
    until_offline(&stack, "stayer").await;
    until_offline(&stack, "g@stayer").await;

    let status = tokio::time::timeout(WAIT, process.child.wait())
        .await
        .unwrap_or_else(|_| panic!("no exit after SIGTERM; log:\n{}", process.logs()))
        .expect("wait");
    let logs = process.logs();
    assert!(status.success(), "exit status {status:?}; log:\n{logs}");
    assert!(logs.contains("SIGTERM received"), "log:\n{logs}");
    assert!(logs.contains("gateway stopped"), "log:\n{logs}");
    assert!(
        !logs.contains("still open after the grace period"),
        "log:\n{logs}"
    );

    let mut device = registered(&stack.ws_url(0), &register).await;
    device.heartbeat("stayer", "device").await;
    held_by(&stack, "stayer", &stack.gateways[0].id).await;
    stack.stop().await;
}
