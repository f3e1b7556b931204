//! The registry under test: a real registry (and replicas) on the test kit's bus and
//! database ([`aip_testkit::Infra`]), one per test, with helpers to call it over the bus and
//! to stage situations directly in its database. Its run loops are the kit's checked
//! [`Service`]s, so a registry that fails, panics or dies fails the test.

#![allow(dead_code, missing_docs)]

use std::net::SocketAddr;
use std::time::Duration;

use aip_bus::{Headers, NatsBus, SharedBus, names};
use aip_registry::{Application, RegistrySettings, Settings};
use aip_store::Database;
use aip_testkit::{Backend, Infra, Service};
use proto_schemas::registry::{
    AgentRecord, AgentStatus, GetAgent, LookupAgents, PresenceBatch, PresenceEntry, RegisterAgent,
    Registered, Reply, UnregisterAgent, Unregistered,
};
use proto_schemas::{ClientType, ErrorBody, Platform, Subjects, V1};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// What a test may change in the registry's settings.
#[derive(Debug, Clone)]
pub struct Options {
    pub liveness_ms: u64,
    pub reap_interval_ms: u64,
    pub presence_flush_ms: u64,
    pub api_keys: Vec<String>,
    pub forget_offline_after_ms: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            liveness_ms: 15_000,
            reap_interval_ms: 200,
            presence_flush_ms: 100,
            api_keys: vec![],
            forget_offline_after_ms: RegistrySettings::default().forget_offline_after_ms,
        }
    }
}

impl Options {
    /// Short windows, for liveness tests.
    pub fn fast() -> Self {
        Options {
            liveness_ms: 1_500,
            reap_interval_ms: 200,
            presence_flush_ms: 100,
            ..Options::default()
        }
    }

    /// With API keys.
    pub fn with_keys(keys: &[&str]) -> Self {
        Options {
            api_keys: keys.iter().map(|k| (*k).to_owned()).collect(),
            ..Options::default()
        }
    }
}

/// One running registry.
pub struct Running {
    pub http_addr: SocketAddr,
    /// `None` once stopped.
    service: Option<Service>,
    /// A pool of its own, closed when it stops (the main replica shares the test's pool).
    own_db: Option<Database>,
}

impl Running {
    async fn start(
        name: &str,
        settings: Settings,
        bus: SharedBus,
        db: Database,
        owns_db: bool,
    ) -> Running {
        let own_db = owns_db.then(|| db.clone());
        let app = Application::build(settings, bus, db)
            .await
            .expect("registry builds");
        let http_addr = app.http_addr();
        let service = Service::spawn(name, |stop| app.run_until_stopped(stop));
        Running {
            http_addr,
            service: Some(service),
            own_db,
        }
    }

    /// Stops it (as SIGTERM would) and waits for the drain; panics unless it stops cleanly.
    pub async fn stop(&mut self) {
        if let Some(service) = self.service.take() {
            service.stop().await;
        }
        if let Some(db) = self.own_db.take() {
            db.close().await;
        }
    }
}

/// A registry under test, with helpers to talk to it.
pub struct TestApp {
    pub backend: Backend,
    pub bus: SharedBus,
    /// The NATS bus (NATS backend only), for raw NATS checks.
    pub nats: Option<NatsBus>,
    pub subjects: Subjects,
    pub settings: Settings,
    pub http: reqwest::Client,
    pub main: Running,
    pub replicas: Vec<Running>,
    pub db: Database,
    /// `None` once stopped.
    infra: Option<Infra>,
}

impl TestApp {
    /// Starts a registry on `backend`.
    pub async fn spawn(backend: Backend, options: Options) -> TestApp {
        aip_runtime::telemetry::init(aip_runtime::telemetry::LogFormat::Pretty, "error");
        let infra = Infra::start(backend)
            .await
            .expect("NATS and PostgreSQL must be running (NATS_URL, DATABASE_URL)");
        let db = infra.connect_db().await.expect("test database connects");
        let settings = Settings {
            subject_prefix: infra.prefix.clone(),
            registry: RegistrySettings {
                listen: "127.0.0.1:0".parse().expect("addr"),
                api_keys: options.api_keys.clone(),
                liveness_ms: options.liveness_ms,
                // These tests judge an agent's own staleness by the same window as its gateway's.
                agent_liveness_ms: None,
                presence_flush_ms: options.presence_flush_ms,
                reap_interval_ms: options.reap_interval_ms,
                forget_offline_after_ms: options.forget_offline_after_ms,
                shutdown_grace_ms: 5_000,
                ..RegistrySettings::default()
            },
            ..Settings::default()
        };
        let main = Running::start(
            "registry",
            settings.clone(),
            infra.bus.clone(),
            db.clone(),
            false,
        )
        .await;
        TestApp {
            backend,
            bus: infra.bus.clone(),
            nats: infra.nats.clone(),
            subjects: Subjects::new(&infra.prefix).expect("prefix"),
            settings,
            http: reqwest::Client::new(),
            main,
            replicas: Vec::new(),
            db,
            infra: Some(infra),
        }
    }

    fn infra(&self) -> &Infra {
        self.infra.as_ref().expect("running")
    }

    /// Starts another replica on the same database and subject prefix (its own NATS
    /// connection on the NATS backend; the same in-process bus otherwise).
    pub async fn spawn_replica(&mut self) -> SocketAddr {
        let bus = self.infra().replica_bus().await.expect("NATS connects");
        let db = self
            .infra()
            .connect_db()
            .await
            .expect("replica connects to the database");
        let name = format!("registry replica {}", self.replicas.len() + 1);
        let replica = Running::start(&name, self.settings.clone(), bus, db, true).await;
        let addr = replica.http_addr;
        self.replicas.push(replica);
        addr
    }

    /// Stops everything and removes the database.
    pub async fn stop(mut self) {
        for replica in &mut self.replicas {
            replica.stop().await;
        }
        self.main.stop().await;
        self.db.close().await;
        if let Some(infra) = self.infra.take() {
            infra.cleanup().await;
        }
    }

    /// Base URL of the main replica's REST API.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.main.http_addr)
    }

    // ---- bus requests ----

    /// Sends a request and returns the reply and its headers; checks that error replies carry
    /// their code in the `Aip-Error-Code` header.
    pub async fn call<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        subject: String,
        request: &Req,
    ) -> Result<Resp, ErrorBody> {
        let body = serde_json::to_vec(request).expect("request serialises");
        self.call_raw(subject, body).await
    }

    /// Sends raw bytes as a request.
    pub async fn call_raw<Resp: DeserializeOwned>(
        &self,
        subject: String,
        body: Vec<u8>,
    ) -> Result<Resp, ErrorBody> {
        let reply = self
            .bus
            .request(
                subject,
                Headers::new(),
                body.into(),
                Duration::from_secs(10),
            )
            .await
            .expect("the registry answers");
        let parsed: Reply<Resp> = serde_json::from_slice(&reply.payload).unwrap_or_else(|e| {
            panic!(
                "reply is not a Reply: {e}: {}",
                String::from_utf8_lossy(&reply.payload)
            )
        });
        let result = parsed.into_result();
        match &result {
            Err(error) => assert_eq!(
                reply.headers.get(names::ERROR_CODE),
                Some(error.error_code.as_str())
            ),
            Ok(_) => assert_eq!(reply.headers.get(names::ERROR_CODE), None),
        }
        result
    }

    pub async fn register(&self, request: &RegisterAgent) -> Result<Registered, ErrorBody> {
        self.call(self.subjects.registry_register(), request).await
    }

    pub async fn unregister(
        &self,
        agent_id: &str,
        connection_id: &str,
    ) -> Result<Unregistered, ErrorBody> {
        let request = UnregisterAgent {
            version: V1,
            agent_id: agent_id.to_owned(),
            connection_id: connection_id.to_owned(),
            reason: "closed by client".to_owned(),
        };
        self.call(self.subjects.registry_unregister(), &request)
            .await
    }

    pub async fn get(&self, agent_id: &str) -> Result<AgentRecord, ErrorBody> {
        self.call(
            self.subjects.registry_get(),
            &GetAgent {
                version: V1,
                agent_id: agent_id.to_owned(),
            },
        )
        .await
    }

    pub async fn status(&self, agent_id: &str) -> AgentStatus {
        self.get(agent_id).await.expect("agent exists").status
    }

    pub async fn lookup(
        &self,
        capabilities: &[&str],
        client_type: Option<ClientType>,
        limit: Option<u32>,
    ) -> Vec<String> {
        let request = LookupAgents {
            version: V1,
            capabilities: capabilities.iter().map(|c| (*c).to_owned()).collect(),
            client_type,
            limit,
        };
        let agents: Vec<AgentRecord> = self
            .call(self.subjects.registry_lookup(), &request)
            .await
            .expect("lookup succeeds");
        agents.into_iter().map(|a| a.agent_id).collect()
    }

    /// Publishes a presence batch as gateway `gateway_id`.
    pub async fn presence(&self, gateway_id: &str, alive: &[(&str, &str)], stopping: bool) {
        publish_presence(&self.bus, &self.subjects, gateway_id, alive, stopping).await;
    }

    // ---- direct database changes, to stage situations ----

    /// Sets an agent's load.
    pub async fn set_load(&self, agent_id: &str, load: i32) {
        self.exec(
            "UPDATE agents SET load = $1 WHERE agent_id = $2",
            "UPDATE agents SET load = ?1 WHERE agent_id = ?2",
            |q| q.int(load).text(agent_id),
        )
        .await;
    }

    /// Sets an agent's stored status.
    pub async fn set_status(&self, agent_id: &str, status: AgentStatus) {
        self.exec(
            "UPDATE agents SET status = $1 WHERE agent_id = $2",
            "UPDATE agents SET status = ?1 WHERE agent_id = ?2",
            |q| q.text(status.as_str()).text(agent_id),
        )
        .await;
    }

    /// Moves an agent's last sign of life `ms` into the past.
    pub async fn age_agent(&self, agent_id: &str, ms: i64) {
        self.exec(
            "UPDATE agents SET last_seen = last_seen - $1 * interval '1 millisecond' WHERE agent_id = $2",
            "UPDATE agents SET last_seen = last_seen - ?1 WHERE agent_id = ?2",
            |q| q.int64(ms).text(agent_id),
        )
        .await;
    }

    /// Moves a gateway's last report `ms` into the past.
    pub async fn age_gateway(&self, gateway_id: &str, ms: i64) {
        self.exec(
            "UPDATE gateways SET last_seen = last_seen - $1 * interval '1 millisecond' WHERE gateway_id = $2",
            "UPDATE gateways SET last_seen = last_seen - ?1 WHERE gateway_id = ?2",
            |q| q.int64(ms).text(gateway_id),
        )
        .await;
    }

    /// Number of rows in `agents`.
    pub async fn agent_rows(&self) -> i64 {
        match &self.db {
            Database::Postgres(pool) => sqlx::query_scalar("SELECT count(*) FROM agents")
                .fetch_one(pool)
                .await
                .expect("count"),
            Database::Sqlite(pool) => sqlx::query_scalar("SELECT count(*) FROM agents")
                .fetch_one(pool)
                .await
                .expect("count"),
        }
    }

    async fn exec(
        &self,
        postgres: &'static str,
        sqlite: &'static str,
        binds: impl Fn(Binds) -> Binds,
    ) {
        let binds = binds(Binds::default()).0;
        match &self.db {
            Database::Postgres(pool) => {
                let mut q = sqlx::query(postgres);
                for b in &binds {
                    q = match b {
                        Bind::Text(s) => q.bind(s.clone()),
                        Bind::Int(i) => q.bind(*i),
                        Bind::Int64(i) => q.bind(*i as f64),
                    };
                }
                q.execute(pool).await.expect("staging statement");
            }
            Database::Sqlite(pool) => {
                let mut q = sqlx::query(sqlite);
                for b in &binds {
                    q = match b {
                        Bind::Text(s) => q.bind(s.clone()),
                        Bind::Int(i) => q.bind(*i),
                        Bind::Int64(i) => q.bind(*i),
                    };
                }
                q.execute(pool).await.expect("staging statement");
            }
        }
    }
}

#[derive(Default)]
struct Binds(Vec<Bind>);

enum Bind {
    Text(String),
    Int(i32),
    Int64(i64),
}

impl Binds {
    fn text(mut self, s: &str) -> Self {
        self.0.push(Bind::Text(s.to_owned()));
        self
    }
    fn int(mut self, i: i32) -> Self {
        self.0.push(Bind::Int(i));
        self
    }
    fn int64(mut self, i: i64) -> Self {
        self.0.push(Bind::Int64(i));
        self
    }
}

/// Publishes a presence batch.
pub async fn publish_presence(
    bus: &SharedBus,
    subjects: &Subjects,
    gateway_id: &str,
    alive: &[(&str, &str)],
    stopping: bool,
) {
    let batch = PresenceBatch {
        version: V1,
        gateway_id: gateway_id.to_owned(),
        interval_ms: 300,
        alive: alive
            .iter()
            .map(|(a, c)| PresenceEntry {
                agent_id: (*a).to_owned(),
                connection_id: (*c).to_owned(),
            })
            .collect(),
        stopping,
    };
    bus.publish(
        subjects.presence(gateway_id),
        Headers::new(),
        serde_json::to_vec(&batch).expect("batch").into(),
    )
    .await
    .expect("presence published");
}

/// A device registration request.
pub fn device(
    agent_id: &str,
    gateway_id: &str,
    connection_id: &str,
    principal: &str,
) -> RegisterAgent {
    RegisterAgent::device(
        agent_id,
        gateway_id,
        connection_id,
        principal,
        Platform::Windows,
    )
}

/// A constellation registration request.
pub fn constellation(
    agent_id: &str,
    target: Option<&str>,
    gateway_id: &str,
    connection_id: &str,
) -> RegisterAgent {
    RegisterAgent {
        client_type: ClientType::Constellation,
        target_id: target.map(str::to_owned),
        ..device(agent_id, gateway_id, connection_id, "galaxy")
    }
}
