//! The NATS permissions of `deploy/nats/` against the real services: a throwaway nats-server
//! runs `users.conf` and `permissions.conf` from that folder unchanged (one user per part of
//! aip, passwords from its environment); the registry, the session service and a gateway each
//! log in as their own user (`nats_user`/`nats_password`), start and become ready, and a task
//! flows end to end (constellation → gateway → frames stream → session service → device and
//! back), and a crowd of devices registers and leaves at once (the gateway's gathered registry
//! writes and connection ends). A client holding the gateway's credentials cannot submit a task: the server reports
//! a permissions violation to it and the message reaches nobody, while the submitter's user
//! can. The server's log shows no violation by any service.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use aip_bus::{NatsBus, NatsSettings, SharedBus};
use aip_testkit::frames::{
    command_results_for, constellation_register, constellation_task, device_register, one_step,
};
use aip_testkit::{
    Backend, Client, OwnNatsServer, Service, eventually, get_json, test_database, within,
};
use futures::StreamExt;
use serde_json::json;

/// The users of `deploy/nats/users.conf`.
const USERS: [(&str, &str); 6] = [
    ("aip-gateway", "AIP_NATS_GATEWAY_PASSWORD"),
    ("aip-registry", "AIP_NATS_REGISTRY_PASSWORD"),
    ("aip-sessions", "AIP_NATS_SESSIONS_PASSWORD"),
    ("aip-planner", "AIP_NATS_PLANNER_PASSWORD"),
    ("aip-submitter", "AIP_NATS_SUBMITTER_PASSWORD"),
    ("aip-operator", "AIP_NATS_OPERATOR_PASSWORD"),
];

/// A nats-server of its own, with the deployment's users and permissions.
struct LockedServer {
    nats: OwnNatsServer,
    /// One random password per user.
    passwords: Vec<(&'static str, String)>,
}

impl LockedServer {
    async fn start() -> LockedServer {
        let deploy = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy/nats");
        let passwords: Vec<(&'static str, String)> = USERS
            .iter()
            .map(|(user, _)| (*user, format!("pw{}", uuid::Uuid::new_v4().simple())))
            .collect();
        let env: Vec<(&str, &str)> = USERS
            .iter()
            .zip(&passwords)
            .map(|((_, variable), (_, password))| (*variable, password.as_str()))
            .collect();
        // Only the listener and the store differ from deploy/nats/nats-server.conf.
        let server = OwnNatsServer::start(
            "permissions",
            "include \"users.conf\"",
            |dir| {
                for file in ["users.conf", "permissions.conf"] {
                    std::fs::copy(deploy.join(file), dir.join(file)).expect("deploy/nats file");
                }
            },
            &env,
        )
        .await;
        LockedServer {
            nats: server,
            passwords,
        }
    }

    /// The settings that log in as `user`.
    fn access(&self, user: &str) -> NatsSettings {
        let password = self
            .passwords
            .iter()
            .find(|(u, _)| *u == user)
            .map(|(_, p)| p.clone())
            .expect("a user of users.conf");
        NatsSettings {
            nats_user: Some(user.to_owned()),
            nats_password: Some(password),
            ..NatsSettings::default()
        }
    }

    /// A service's bus: its own user.
    async fn bus(&self, user: &str) -> SharedBus {
        Arc::new(
            NatsBus::connect_with(&self.nats.url, user, &self.access(user))
                .await
                .unwrap_or_else(|e| panic!("{user} logs in: {e}")),
        )
    }

    /// A raw client as `user`, named `name`, whose server errors go to the returned channel.
    async fn raw_client(
        &self,
        user: &str,
        name: &str,
    ) -> (
        async_nats::Client,
        tokio::sync::mpsc::UnboundedReceiver<String>,
    ) {
        let access = self.access(user);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let client = async_nats::ConnectOptions::with_user_and_password(
            user.to_owned(),
            access.nats_password.expect("password"),
        )
        .name(name)
        .event_callback(move |event| {
            let tx = tx.clone();
            async move {
                if let async_nats::Event::ServerError(e) = event {
                    let _ = tx.send(e.to_string());
                }
            }
        })
        .connect(&self.nats.url)
        .await
        .unwrap_or_else(|e| panic!("{user} logs in: {e}"));
        (client, rx)
    }

    fn log_text(&self) -> String {
        self.nats.log_text()
    }
}

async fn ready(what: &str, addr: std::net::SocketAddr) {
    let url = format!("http://{addr}/readyz");
    eventually(&format!("the {what} is ready"), || {
        let url = url.clone();
        async move { (get_json(&url).await.0 == 200).then_some(()) }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_service_runs_with_only_its_own_permissions() {
    let server = LockedServer::start().await;
    let database = test_database(Backend::NatsPostgres)
        .await
        .expect("PostgreSQL at DATABASE_URL");

    // The registry, as user aip-registry.
    let mut registry = aip_registry::Settings {
        nats_url: server.nats.url.clone(),
        nats: server.access("aip-registry"),
        ..Default::default()
    };
    registry.registry.listen = "127.0.0.1:0".parse().expect("addr");
    let app = aip_registry::Application::build(
        registry,
        server.bus("aip-registry").await,
        database.connect().await.expect("db"),
    )
    .await
    .expect("the registry starts with its permissions");
    let registry_http = app.http_addr();
    let registry_service = Service::spawn("registry", |stop| app.run_until_stopped(stop));

    // The session service, as user aip-sessions: it creates both streams and its consumer.
    let mut sessions = aip_sessions::Settings {
        nats_url: server.nats.url.clone(),
        nats: server.access("aip-sessions"),
        ..Default::default()
    };
    sessions.sessions.listen = "127.0.0.1:0".parse().expect("addr");
    let app = aip_sessions::Application::build(
        sessions,
        server.bus("aip-sessions").await,
        database.connect().await.expect("db"),
    )
    .await
    .expect("the session service starts with its permissions");
    let sessions_http = app.local_addr();
    let engine = app.engine().clone();
    let sessions_service = Service::spawn("sessions", |stop| app.run_until(stop));
    eventually("the session service to lead (its consumer made)", || {
        let leading = engine.is_leading();
        async move { leading.then_some(()) }
    })
    .await
    .expect("leading");

    // A gateway, as user aip-gateway.
    let mut gateway = aip_gateway::Settings {
        nats_url: server.nats.url.clone(),
        nats: server.access("aip-gateway"),
        ..Default::default()
    };
    gateway.gateway.listen = "127.0.0.1:0".parse().expect("addr");
    gateway.gateway.gateway_id = Some("gw-locked".to_owned());
    gateway.gateway.presence_interval_ms = 300;
    let app = aip_gateway::Application::build(gateway, server.bus("aip-gateway").await)
        .await
        .expect("the gateway starts with its permissions");
    let gateway_addr = app.local_addr();
    let gateway_service = Service::spawn("gateway", |stop| app.run_until(stop));

    ready("registry", registry_http).await;
    ready("session service", sessions_http).await;
    ready("gateway", gateway_addr).await;

    // A task end to end.
    let ws = format!("ws://{gateway_addr}/ws");
    let mut device = Client::registered(&ws, device_register("pc-1", "linux")).await;
    let clients = format!("http://{registry_http}/api/clients");
    eventually("pc-1 online", || async {
        let (_, body) = get_json(&clients).await;
        body["online_clients"]
            .as_array()?
            .iter()
            .any(|c| c == "pc-1")
            .then_some(())
    })
    .await
    .expect("presence reaches the registry");
    let mut galaxy =
        Client::registered(&ws, constellation_register("demo@pc-1", Some("pc-1"))).await;
    galaxy
        .send(&constellation_task(
            "demo@pc-1",
            "pc-1",
            "demo@task-1",
            "locked_task",
            Some(one_step("type_text", json!({ "text": "hello" }))),
        ))
        .await
        .expect("send task");
    let command = device.recv_type("command").await.expect("command");
    // Results larger than a NATS message: they travel as blobs both ways (stored by the
    // gateway, read back by the session service with direct gets, and the task_end the
    // same way back), which needs the blob stream's API.
    let screenshot = "A".repeat(2 << 20);
    let mut results = command_results_for("pc-1", &command);
    results["action_results"][0]["result"] = json!({ "png": screenshot });
    device.send(&results).await.expect("results");
    for client in [&mut galaxy, &mut device] {
        let end = client.recv_type("task_end").await.expect("task_end");
        assert_eq!(end["status"], "completed", "{end}");
        assert_eq!(
            end["result"][0]["results"][0]["result"]["png"]
                .as_str()
                .map(str::len),
            Some(screenshot.len()),
            "the task_end carries the results"
        );
    }

    // Many devices registering at once, then leaving at once: the gateway sends the writes
    // that gathered as one `registry.write` request, and the ends as one event.
    let many =
        futures::future::join_all(
            (0..40).map(|i| {
                let ws = ws.clone();
                async move {
                    Client::registered(&ws, device_register(&format!("crowd-{i}"), "linux")).await
                }
            }),
        )
        .await;
    eventually("the crowd online", || async {
        let (_, body) = get_json(&clients).await;
        let online = body["online_clients"].as_array()?;
        (0..40)
            .all(|i| online.iter().any(|c| *c == format!("crowd-{i}")))
            .then_some(())
    })
    .await
    .expect("every device of the crowd registered");
    drop(many);
    eventually("the crowd offline", || async {
        let (_, body) = get_json(&clients).await;
        let online = body["online_clients"].as_array()?;
        (!online
            .iter()
            .any(|c| c.as_str().is_some_and(|c| c.starts_with("crowd-"))))
        .then_some(())
    })
    .await
    .expect("every device of the crowd unregistered");

    // An observer (the operator) sees everything published on the submit subject.
    let (operator, _) = server.raw_client("aip-operator", "observer").await;
    let mut observed = operator
        .subscribe("aip.sessions.submit")
        .await
        .expect("operator subscribes");
    operator.flush().await.expect("flush");

    // The submitter may submit: the session service answers, and the observer sees it.
    let (submitter, mut submitter_errors) = server.raw_client("aip-submitter", "submitter").await;
    let reply = submitter
        .request("aip.sessions.submit", "{}".into())
        .await
        .expect("the session service answers the submitter");
    assert!(!reply.payload.is_empty());
    within(
        Duration::from_secs(5),
        "the observer sees the submission",
        observed.next(),
    )
    .await
    .expect("observed");
    assert!(
        submitter_errors.try_recv().is_err(),
        "no violation for the submitter"
    );

    // The gateway's credentials may not: refused by the server, delivered to nobody.
    let (intruder, mut errors) = server.raw_client("aip-gateway", "intruder").await;
    let request = intruder
        .send_request(
            "aip.sessions.submit",
            async_nats::Request::new()
                .payload("{}".into())
                .timeout(Some(Duration::from_secs(1))),
        )
        .await;
    assert!(request.is_err(), "nobody answers a refused submission");
    let error = within(
        Duration::from_secs(5),
        "the violation is reported",
        errors.recv(),
    )
    .await
    .expect("an error event");
    assert!(
        error.to_lowercase().contains("permissions violation")
            && error.contains("aip.sessions.submit"),
        "{error}"
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(500), observed.next())
            .await
            .is_err(),
        "the refused submission reached a subscriber"
    );
    // Nor may it read what clients send (frames are the session service's).
    let mut snoop = intruder.subscribe("aip.frames.>").await.expect("sent");
    let error = within(
        Duration::from_secs(5),
        "the violation is reported",
        errors.recv(),
    )
    .await
    .expect("an error event");
    assert!(
        error.to_lowercase().contains("permissions violation") && error.contains("aip.frames.>"),
        "{error}"
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(300), snoop.next())
            .await
            .map_or(true, |m| m.is_none()),
        "a refused subscription delivers nothing"
    );

    for service in [gateway_service, sessions_service, registry_service] {
        service.stop().await;
    }
    // No service hit a wall: the only violations are the intruder's.
    let log = server.log_text();
    let violations: Vec<&str> = log
        .lines()
        .filter(|l| l.to_lowercase().contains("violation"))
        .collect();
    assert!(!violations.is_empty(), "the server logs violations:\n{log}");
    let by_services: Vec<&&str> = violations
        .iter()
        .filter(|l| !l.contains("intruder"))
        .collect();
    assert!(
        by_services.is_empty(),
        "a service was refused something it needs:\n{}",
        by_services
            .iter()
            .map(|l| l.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    );
    database.cleanup().await;
}
