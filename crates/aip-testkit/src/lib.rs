//! # aip-testkit: the whole broker in a test
//!
//! [`Stack::start`] runs the registry, any number of gateways and the session service on a
//! real bus and a real database, each test with its own subject prefix and database
//! ([`Infra`]): [`Backend::NatsPostgres`] uses the NATS server at `NATS_URL` and a fresh
//! PostgreSQL database on `DATABASE_URL` (the distributed mode); [`Backend::LocalSqlite`] the
//! in-process bus and a temporary SQLite file (the embedded mode). Clients talk to it over
//! real WebSockets and HTTP ([`Client`], [`frames`]).
//!
//! Every service runs as a [`Service`]: one that fails, panics or dies during the test fails
//! the test when the stack stops (or is dropped). Every wait has a deadline ([`within`],
//! [`eventually`], [`wait_until`]).

pub mod blobs;
mod client;
pub mod frames;
mod nats_server;
pub mod openapi;
mod service;
mod wait;

use std::net::SocketAddr;
use std::sync::Arc;

use aip_bus::{LocalBus, NatsBus, SharedBus};
use aip_store::testing::TestDatabase;
use anyhow::{Context, anyhow};
use serde_json::Value;

pub use client::{Client, Closed, ConnectError, FrameCheck, Refusal};
pub use nats_server::OwnNatsServer;
pub use service::{STOP_WAIT, Service, Shutdown};
pub use wait::{WAIT, eventually, eventually_within, wait_until, within};

/// Bus and database of one test run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// NATS + PostgreSQL (the distributed mode).
    NatsPostgres,
    /// In-process bus + SQLite (the embedded mode).
    LocalSqlite,
}

/// Runs an async test body once per backend: `both_backends!(my_test);` makes
/// `my_test::nats_postgres` and `my_test::local_sqlite`.
#[macro_export]
macro_rules! both_backends {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn nats_postgres() {
                super::$name($crate::Backend::NatsPostgres).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn local_sqlite() {
                super::$name($crate::Backend::LocalSqlite).await
            }
        }
    )*};
}

pub fn prefix() -> String {
    format!("t_{}", uuid::Uuid::new_v4().simple())
}

/// A free loopback port, never one this test process was given before: the kernel may hand
/// the same free port to two binds in a row, and two services of one test then met on it (the
/// second could not listen, and the first answered the readiness probe meant for it).
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let mut given = GIVEN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if given.insert(port) {
            return port;
        }
    }
}

pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// What the registry answers for an available Linux device with nothing else announced, as
/// tests that stand in for the registry hand it to the session service.
pub fn device_record(id: &str) -> proto_schemas::registry::AgentRecord {
    use proto_schemas::registry::{AgentRecord, AgentStatus};
    use proto_schemas::{ClientType, Platform};
    AgentRecord {
        agent_id: id.to_owned(),
        client_type: ClientType::Device,
        status: AgentStatus::Available,
        platform: Platform::Linux,
        capabilities: Vec::new(),
        tools: Vec::new(),
        system_info: None,
        metadata: None,
        extensions: Vec::new(),
        target_id: None,
        gateway_id: "gw".to_owned(),
        connection_id: "c".to_owned(),
        load: 0,
        connected_at: chrono::Utc::now(),
        last_seen: chrono::Utc::now(),
    }
}

/// A fresh, empty database of `backend`'s kind (not migrated).
pub async fn test_database(backend: Backend) -> anyhow::Result<TestDatabase> {
    aip_runtime::install_crypto_provider();
    match backend {
        Backend::NatsPostgres => Ok(TestDatabase::postgres().await?),
        Backend::LocalSqlite => Ok(TestDatabase::sqlite()?),
    }
}

/// The bus, the database and the subject prefix of one test: what services are started on.
pub struct Infra {
    pub backend: Backend,
    pub prefix: String,
    pub bus: SharedBus,
    /// The NATS connection behind [`Infra::bus`] (NATS backend only), for raw NATS checks.
    pub nats: Option<NatsBus>,
    database: TestDatabase,
}

impl Infra {
    /// Connects to the bus and makes a fresh database.
    pub async fn start(backend: Backend) -> anyhow::Result<Infra> {
        aip_runtime::install_crypto_provider();
        let (bus, nats): (SharedBus, Option<NatsBus>) = match backend {
            Backend::NatsPostgres => {
                let nats = NatsBus::connect(&nats_url(), "aip-testkit")
                    .await
                    .context("NATS must be running (NATS_URL)")?;
                (Arc::new(nats.clone()), Some(nats))
            }
            Backend::LocalSqlite => (Arc::new(LocalBus::new()), None),
        };
        Ok(Infra {
            backend,
            prefix: prefix(),
            bus,
            nats,
            database: test_database(backend).await?,
        })
    }

    pub fn database_url(&self) -> &str {
        self.database.url()
    }

    /// A new pool on the database (one per service, as separate processes would have).
    pub async fn connect_db(&self) -> anyhow::Result<aip_store::Database> {
        Ok(self.database.connect().await?)
    }

    /// A bus for one more replica of a service: its own NATS connection, as another
    /// process would have, or the same in-process bus.
    pub async fn replica_bus(&self) -> anyhow::Result<SharedBus> {
        match self.backend {
            Backend::NatsPostgres => Ok(Arc::new(
                NatsBus::connect(&nats_url(), "aip-testkit-replica").await?,
            )),
            Backend::LocalSqlite => Ok(self.bus.clone()),
        }
    }

    /// Deletes this test's streams and drops its database.
    pub async fn cleanup(self) {
        let subjects = proto_schemas::Subjects::new(&self.prefix).expect("test prefixes are valid");
        for stream in [subjects.frames_stream(), subjects.blobs_stream()] {
            if let Err(e) = self.bus.delete_stream(stream).await {
                tracing::warn!("test stream not deleted: {e}");
            }
        }
        self.database.cleanup().await;
    }
}

/// The frames stream's cap in a test stack: NATS reserves a stream's cap on its storage, and
/// tests running at once on one server each have their streams.
pub const TEST_FRAMES_MAX_BYTES: i64 = 256 << 20;
/// The blobs stream's cap in a test stack: room for the largest frame a test sends (100 MiB)
/// twice over.
pub const TEST_BLOBS_MAX_BYTES: i64 = 512 << 20;

/// What a test may change.
#[derive(Debug, Clone)]
pub struct Options {
    pub gateways: usize,
    pub sessions: bool,
    pub liveness_ms: u64,
    pub presence_interval_ms: u64,
    pub client_liveness_ms: u64,
    pub max_tasks_per_agent: i64,
    pub command_timeout_secs: u64,
    /// Gateway credentials file contents (TOML), if any.
    pub credentials: Option<String>,
    pub max_frame_bytes: Option<usize>,
    /// The session service's `[sessions.planner]` and `[sessions.llm]`.
    pub planner: aip_sessions::settings::PlannerSettings,
    pub llm: aip_sessions::settings::LlmSettings,
    /// Any other change to the session service's settings.
    pub sessions_settings: Option<fn(&mut aip_sessions::SessionSettings)>,
    /// The session service's principals file contents (TOML), if any.
    pub principals: Option<String>,
}

impl Options {
    /// The defaults, with `gateways` gateways side by side.
    pub fn with_gateways(gateways: usize) -> Self {
        Options {
            gateways,
            ..Options::default()
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            gateways: 1,
            sessions: true,
            liveness_ms: 3_000,
            presence_interval_ms: 300,
            client_liveness_ms: 60_000,
            max_tasks_per_agent: 1,
            command_timeout_secs: 600,
            credentials: None,
            max_frame_bytes: None,
            planner: aip_sessions::SessionSettings::default().planner,
            llm: aip_sessions::SessionSettings::default().llm,
            sessions_settings: None,
            principals: None,
        }
    }
}

pub struct RunningGateway {
    pub addr: SocketAddr,
    pub id: String,
    /// The gateway's budget of bytes queued for clients (to watch it).
    pub outbound: std::sync::Arc<aip_gateway::outbound::OutboundBudget>,
    service: Service,
}

impl RunningGateway {
    /// Starts a gateway with `settings` on `bus`.
    pub async fn start(
        settings: aip_gateway::Settings,
        bus: SharedBus,
    ) -> anyhow::Result<RunningGateway> {
        let app = aip_gateway::Application::build(settings, bus)
            .await
            .context("gateway")?;
        let addr = app.local_addr();
        let id = app.gateway_id().to_owned();
        let outbound = app.outbound_budget();
        let service = Service::spawn(format!("gateway {id}"), |stop| app.run_until(stop));
        Ok(RunningGateway {
            addr,
            id,
            outbound,
            service,
        })
    }

    /// `ws://…/ws`.
    pub fn ws_url(&self) -> String {
        format!("ws://{}/ws", self.addr)
    }

    /// Stops it as SIGTERM would, and waits; panics if it failed, panicked or died.
    pub async fn stop(self) {
        self.service.stop().await;
    }

    /// Like [`RunningGateway::stop`], but returns the failure instead of panicking.
    pub async fn try_stop(self) -> anyhow::Result<()> {
        self.service.try_stop().await
    }

    /// Stops it abruptly (the task is aborted: no goodbye to anyone), like `kill -9`;
    /// panics if it had already died.
    pub fn kill(self) {
        self.service.kill();
    }
}

/// The broker, started for one test.
pub struct Stack {
    pub prefix: String,
    pub bus: SharedBus,
    pub database_url: String,
    pub registry_http: SocketAddr,
    pub gateways: Vec<RunningGateway>,
    pub sessions_http: Option<SocketAddr>,
    options: Options,
    credentials_file: Option<std::path::PathBuf>,
    /// `None` once stopped.
    infra: Option<Infra>,
    /// Registry and sessions, in start order.
    services: Vec<Service>,
}

impl Stack {
    /// Starts registry, gateways and (unless told otherwise) the session service.
    pub async fn start(backend: Backend, options: Options) -> anyhow::Result<Stack> {
        let infra = Infra::start(backend).await?;
        let credentials_file = match &options.credentials {
            Some(text) => {
                let path = std::env::temp_dir().join(format!(
                    "aip-credentials-{}.toml",
                    uuid::Uuid::new_v4().simple()
                ));
                std::fs::write(&path, text)?;
                Some(path)
            }
            None => None,
        };
        let prefix = infra.prefix.clone();
        let bus = infra.bus.clone();
        let mut stack = Stack {
            prefix: prefix.clone(),
            bus: bus.clone(),
            database_url: infra.database_url().to_owned(),
            registry_http: SocketAddr::from(([127, 0, 0, 1], 0)),
            gateways: Vec::new(),
            sessions_http: None,
            options: options.clone(),
            credentials_file,
            infra: Some(infra),
            services: Vec::new(),
        };

        let mut registry = aip_registry::Settings {
            subject_prefix: prefix.clone(),
            ..Default::default()
        };
        registry.registry.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        registry.registry.liveness_ms = options.liveness_ms;
        registry.registry.agent_liveness_ms =
            Some(options.client_liveness_ms.max(options.liveness_ms));
        registry.registry.reap_interval_ms = 200;
        registry.registry.presence_flush_ms = 100;
        let db = stack.connect_db().await?;
        let app = aip_registry::Application::build(registry, bus.clone(), db)
            .await
            .context("registry")?;
        stack.registry_http = app.http_addr();
        stack.services.push(Service::spawn("registry", |stop| {
            app.run_until_stopped(stop)
        }));

        if options.sessions {
            let mut settings = aip_sessions::Settings {
                subject_prefix: prefix.clone(),
                ..Default::default()
            };
            settings.sessions.listen = SocketAddr::from(([127, 0, 0, 1], 0));
            settings.nats.nats_frames_max_bytes = TEST_FRAMES_MAX_BYTES;
            settings.nats.nats_blobs_max_bytes = TEST_BLOBS_MAX_BYTES;
            settings.sessions.max_tasks_per_agent = options.max_tasks_per_agent;
            settings.sessions.command_timeout_secs = options.command_timeout_secs;
            settings.sessions.planner = options.planner.clone();
            settings.sessions.llm = options.llm.clone();
            if let Some(configure) = options.sessions_settings {
                configure(&mut settings.sessions);
            }
            if let Some(text) = &options.principals {
                let path = std::env::temp_dir().join(format!(
                    "aip-principals-{}.toml",
                    uuid::Uuid::new_v4().simple()
                ));
                std::fs::write(&path, text)?;
                settings.sessions.principals_file = Some(path);
            }
            let db = stack.connect_db().await?;
            let app = aip_sessions::Application::build(settings, bus.clone(), db)
                .await
                .context("sessions")?;
            let engine = app.engine().clone();
            stack.sessions_http = Some(app.local_addr());
            stack
                .services
                .push(Service::spawn("sessions", |stop| app.run_until(stop)));
            // Leadership is taken in the background: tests start once changes are accepted.
            eventually("the session service to lead", || {
                let leading = engine.is_leading();
                async move { leading.then_some(()) }
            })
            .await?;
        }
        for _ in 0..options.gateways {
            stack.add_gateway().await?;
        }
        Ok(stack)
    }

    /// This test's bus and database.
    pub fn infra(&self) -> &Infra {
        self.infra.as_ref().expect("the stack is running")
    }

    /// A new pool on the test's database.
    pub async fn connect_db(&self) -> anyhow::Result<aip_store::Database> {
        self.infra().connect_db().await
    }

    /// The gateway settings this stack uses (for starting gateway processes).
    pub fn gateway_settings(&self) -> aip_gateway::Settings {
        let mut settings = aip_gateway::Settings {
            subject_prefix: self.prefix.clone(),
            ..Default::default()
        };
        settings.nats_url = nats_url();
        settings.nats.nats_blobs_max_bytes = TEST_BLOBS_MAX_BYTES;
        settings.gateway.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        settings.gateway.presence_interval_ms = self.options.presence_interval_ms;
        settings.gateway.liveness_timeout_ms = self.options.client_liveness_ms;
        settings.gateway.register_timeout_ms = 3_000;
        settings.gateway.credentials_file = self.credentials_file.clone();
        if let Some(max) = self.options.max_frame_bytes {
            settings.gateway.max_frame_bytes = max;
        }
        settings
    }

    /// Starts one more gateway, stopped with the stack.
    pub async fn add_gateway(&mut self) -> anyhow::Result<&RunningGateway> {
        let gateway = self.start_gateway(|_| {}).await?;
        self.gateways.push(gateway);
        Ok(self.gateways.last().expect("just pushed"))
    }

    /// Starts a gateway of this stack with changed settings (for knobs [`Options`] lacks);
    /// the test owns it and stops it.
    pub async fn start_gateway(
        &self,
        change: impl FnOnce(&mut aip_gateway::Settings),
    ) -> anyhow::Result<RunningGateway> {
        let mut settings = self.gateway_settings();
        change(&mut settings);
        RunningGateway::start(settings, self.bus.clone()).await
    }

    /// `ws://…/ws` of gateway `i`.
    pub fn ws_url(&self, i: usize) -> String {
        self.gateways[i].ws_url()
    }

    /// `http://…` of the session service.
    pub fn sessions_url(&self) -> String {
        format!(
            "http://{}",
            self.sessions_http
                .expect("the stack runs the session service")
        )
    }

    /// A task as `GET /api/tasks/{id}` shows it (the error body if there is none).
    pub async fn task(&self, id: &str) -> Value {
        get_json(&format!("{}/api/tasks/{id}", self.sessions_url()))
            .await
            .1
    }

    /// Waits until the task is in `state`, and returns it; panics after [`WAIT`].
    pub async fn task_in_state(&self, id: &str, state: &str) -> Value {
        eventually(&format!("task {id} to be {state}"), || async {
            let task = self.task(id).await;
            (task["state"] == state).then_some(task)
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// How many messages the frames stream holds, as the NATS server counts them (`None` on
    /// the in-process bus, or before the session service made the stream).
    pub async fn frames_stream_messages(&self) -> Option<u64> {
        let nats = self.infra.as_ref()?.nats.as_ref()?;
        let subjects = proto_schemas::Subjects::new(&self.prefix).ok()?;
        let mut stream = async_nats::jetstream::new(nats.client().clone())
            .get_stream(subjects.frames_stream())
            .await
            .ok()?;
        Some(stream.info().await.ok()?.state.messages)
    }

    /// Acknowledges delivered frames as the gateway that wrote them would: a `DeliveryAck`
    /// of `msg_ids` on the `Aip-Ack` subject `to` they carried.
    pub async fn acknowledge_delivery(&self, to: &str, msg_ids: Vec<String>) {
        let ack = proto_schemas::sessions::DeliveryAck {
            version: proto_schemas::V1,
            msg_ids,
        };
        self.bus
            .publish(
                to.to_owned(),
                aip_bus::Headers::new(),
                serde_json::to_vec(&ack).expect("json").into(),
            )
            .await
            .expect("acknowledged");
    }

    /// Waits until the task has ended (completed, failed, canceled or rejected), and returns
    /// it; panics after [`WAIT`].
    pub async fn task_ended(&self, id: &str) -> Value {
        eventually(&format!("task {id} to end"), || async {
            let task = self.task(id).await;
            let ended = matches!(
                task["state"].as_str(),
                Some("completed" | "failed" | "canceled" | "rejected")
            );
            ended.then_some(task)
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// `http://…` of the registry.
    pub fn registry_url(&self) -> String {
        format!("http://{}", self.registry_http)
    }

    /// Stops everything and drops the database; panics if a service failed, panicked or
    /// died during the test.
    pub async fn stop(self) {
        if let Err(e) = self.try_stop().await {
            panic!("{e:#}");
        }
    }

    /// Like [`Stack::stop`], but returns the failures instead of panicking.
    pub async fn try_stop(mut self) -> anyhow::Result<()> {
        let mut failures = Vec::new();
        for gateway in self.gateways.drain(..) {
            if let Err(e) = gateway.try_stop().await {
                failures.push(format!("{e:#}"));
            }
        }
        for service in self.services.drain(..).rev() {
            if let Err(e) = service.try_stop().await {
                failures.push(format!("{e:#}"));
            }
        }
        if let Some(path) = self.credentials_file.take() {
            let _ = std::fs::remove_file(path);
        }
        if let Some(infra) = self.infra.take() {
            infra.cleanup().await;
        }
        if failures.is_empty() {
            Ok(())
        } else {
            Err(anyhow!(
                "services failed during the test:\n  {}",
                failures.join("\n  ")
            ))
        }
    }
}

/// GET a URL; the status and the JSON body (`null` if the body is not JSON).
pub async fn get_json(url: &str) -> (u16, Value) {
    let response = reqwest::get(url)
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// POST JSON to a URL; the status and the JSON body (`null` if the body is not JSON).
pub async fn post_json(url: &str, body: &Value) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

impl Stack {
    /// Waits until the registry lists `id` among the online clients.
    pub async fn wait_online(&self, id: &str) {
        let url = format!("{}/api/clients", self.registry_url());
        eventually(&format!("{id} online"), || async {
            let (_, body) = get_json(&url).await;
            body["online_clients"]
                .as_array()?
                .iter()
                .any(|c| c == id)
                .then_some(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }

    /// Waits until the registry no longer lists `id` among the online clients.
    pub async fn wait_offline(&self, id: &str) {
        let url = format!("{}/api/clients", self.registry_url());
        eventually(&format!("{id} offline"), || async {
            let (_, body) = get_json(&url).await;
            (!body["online_clients"].as_array()?.iter().any(|c| c == id)).then_some(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn without_sessions() -> Options {
        Options {
            sessions: false,
            ..Options::default()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_healthy_stack_stops_cleanly() {
        let stack = Stack::start(Backend::LocalSqlite, Options::default())
            .await
            .expect("stack");
        stack.try_stop().await.expect("nothing failed");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stop_reports_a_service_that_failed_and_still_cleans_up() {
        let mut stack = Stack::start(Backend::LocalSqlite, without_sessions())
            .await
            .expect("stack");
        stack
            .services
            .push(Service::spawn("flaky", |stop| async move {
                stop.await;
                Err(std::io::Error::other("lost its database"))
            }));
        let database = stack.database_url.clone();
        let error = stack.try_stop().await.expect_err("the failure is reported");
        let text = format!("{error:#}");
        assert!(text.contains("flaky failed"), "{text}");
        assert!(text.contains("lost its database"), "{text}");
        let file = database.trim_start_matches("sqlite://");
        assert!(
            !std::path::Path::new(file).exists(),
            "the database is removed all the same"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stop_reports_a_service_that_died_during_the_test() {
        let mut stack = Stack::start(Backend::LocalSqlite, without_sessions())
            .await
            .expect("stack");
        // A run loop that returns without being stopped, as one whose listener broke would.
        let dead = Service::spawn("short-lived", |_stop| async {
            Ok::<(), std::io::Error>(())
        });
        wait_until("the service to die", || async { dead.is_finished() }).await;
        stack.services.push(dead);
        let error = stack.try_stop().await.expect_err("the death is reported");
        assert!(
            format!("{error:#}").contains("short-lived ended by itself during the test"),
            "{error:#}"
        );
    }
}
