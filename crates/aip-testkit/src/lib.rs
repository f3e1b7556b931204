//! # aip-testkit: the whole broker in a test
//!
//! [`Stack::start`] runs the registry, any number of gateways and the session service on a
//! real bus and a real database, each test with its own subject prefix and database:
//! [`Backend::NatsPostgres`] uses the NATS server at `NATS_URL` and a fresh PostgreSQL
//! database on `DATABASE_URL` (the distributed mode); [`Backend::LocalSqlite`] the in-process
//! bus and a temporary SQLite file (the embedded mode). Clients talk to it over real
//! WebSockets and HTTP ([`Client`], [`frames`]).

pub mod frames;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use aip_bus::{LocalBus, NatsBus, SharedBus};
use aip_store::testing::TestDatabase;
use anyhow::{Context, anyhow, bail};
use futures::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// How long a test waits for something that should happen.
pub const WAIT: Duration = Duration::from_secs(15);

/// Bus and database of one test run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// NATS + PostgreSQL.
    NatsPostgres,
    /// In-process bus + SQLite.
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

/// What a test may change.
#[derive(Debug, Clone)]
pub struct Options {
    /// How many gateways.
    pub gateways: usize,
    /// Run the session service.
    pub sessions: bool,
    /// Registry liveness window.
    pub liveness_ms: u64,
    /// Gateway presence interval.
    pub presence_interval_ms: u64,
    /// Gateway client liveness timeout.
    pub client_liveness_ms: u64,
    /// Session service: tasks per agent.
    pub max_tasks_per_agent: i64,
    /// Session service: command timeout.
    pub command_timeout_secs: u64,
    /// Gateway credentials file contents (TOML), if any.
    pub credentials: Option<String>,
    /// Gateway frame limit.
    pub max_frame_bytes: Option<usize>,
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
        }
    }
}

/// A running gateway.
pub struct RunningGateway {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its id.
    pub id: String,
    stop: Option<oneshot::Sender<()>>,
    handle: JoinHandle<()>,
}

impl RunningGateway {
    /// `ws://…/ws`.
    pub fn ws_url(&self) -> String {
        format!("ws://{}/ws", self.addr)
    }

    /// Stops it as SIGTERM would, and waits.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = tokio::time::timeout(WAIT, self.handle).await;
    }

    /// Stops it abruptly (the task is aborted: no goodbye to anyone), like `kill -9`.
    pub fn kill(self) {
        self.handle.abort();
    }
}

/// The broker, started for one test.
pub struct Stack {
    /// Subject prefix of this test.
    pub prefix: String,
    /// The bus.
    pub bus: SharedBus,
    /// The database URL.
    pub database_url: String,
    /// The registry's REST address.
    pub registry_http: SocketAddr,
    /// The gateways.
    pub gateways: Vec<RunningGateway>,
    /// The session service's REST address.
    pub sessions_http: Option<SocketAddr>,
    options: Options,
    credentials_file: Option<std::path::PathBuf>,
    database: Option<TestDatabase>,
    services: Vec<(oneshot::Sender<()>, JoinHandle<()>)>,
}

/// A fresh random subject prefix.
pub fn prefix() -> String {
    format!("t_{}", uuid::Uuid::new_v4().simple())
}

/// The NATS URL tests use.
pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

impl Stack {
    /// Starts registry, gateways and (unless told otherwise) the session service.
    pub async fn start(backend: Backend, options: Options) -> anyhow::Result<Stack> {
        aip_runtime::install_crypto_provider();
        let prefix = prefix();
        let (bus, database): (SharedBus, TestDatabase) = match backend {
            Backend::NatsPostgres => (
                Arc::new(NatsBus::connect(&nats_url(), "aip-testkit").await?),
                TestDatabase::postgres().await.map_err(|e| anyhow!("{e}"))?,
            ),
            Backend::LocalSqlite => (
                Arc::new(LocalBus::new()),
                TestDatabase::sqlite().map_err(|e| anyhow!("{e}"))?,
            ),
        };
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
        let mut stack = Stack {
            prefix: prefix.clone(),
            bus: bus.clone(),
            database_url: database.url().to_owned(),
            registry_http: SocketAddr::from(([127, 0, 0, 1], 0)),
            gateways: Vec::new(),
            sessions_http: None,
            options: options.clone(),
            credentials_file,
            database: Some(database),
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
        stack.spawn(|stop| async move {
            if let Err(e) = app.run_until_stopped(stop).await {
                tracing::error!("registry: {e}");
            }
        });

        if options.sessions {
            let mut settings = aip_sessions::Settings {
                subject_prefix: prefix.clone(),
                ..Default::default()
            };
            settings.sessions.listen = SocketAddr::from(([127, 0, 0, 1], 0));
            settings.sessions.max_tasks_per_agent = options.max_tasks_per_agent;
            settings.sessions.command_timeout_secs = options.command_timeout_secs;
            let db = stack.connect_db().await?;
            let app = aip_sessions::Application::build(settings, bus.clone(), db)
                .await
                .context("sessions")?;
            stack.sessions_http = Some(app.local_addr());
            stack.spawn(|stop| async move {
                if let Err(e) = app.run_until(stop).await {
                    tracing::error!("sessions: {e}");
                }
            });
        }
        for _ in 0..options.gateways {
            stack.add_gateway().await?;
        }
        Ok(stack)
    }

    async fn connect_db(&self) -> anyhow::Result<aip_store::Database> {
        Ok(aip_store::Database::connect(&self.database_url).await?)
    }

    fn spawn<F, Fut>(&mut self, run: F)
    where
        F: FnOnce(futures::future::BoxFuture<'static, ()>) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (tx, rx) = oneshot::channel::<()>();
        let stop: futures::future::BoxFuture<'static, ()> = Box::pin(async move {
            let _ = rx.await;
        });
        let handle = tokio::spawn(run(stop));
        self.services.push((tx, handle));
    }

    /// The gateway settings this stack uses (for starting gateway processes).
    pub fn gateway_settings(&self) -> aip_gateway::Settings {
        let mut settings = aip_gateway::Settings {
            subject_prefix: self.prefix.clone(),
            ..Default::default()
        };
        settings.nats_url = nats_url();
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

    /// Starts one more gateway.
    pub async fn add_gateway(&mut self) -> anyhow::Result<&RunningGateway> {
        let app = aip_gateway::Application::build(self.gateway_settings(), self.bus.clone())
            .await
            .context("gateway")?;
        let addr = app.local_addr();
        let id = app.gateway_id().to_owned();
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(async move {
            let stop = async move {
                let _ = rx.await;
            };
            if let Err(e) = app.run_until(stop).await {
                tracing::error!("gateway: {e}");
            }
        });
        self.gateways.push(RunningGateway {
            addr,
            id,
            stop: Some(tx),
            handle,
        });
        Ok(self.gateways.last().expect("just pushed"))
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

    /// `http://…` of the registry.
    pub fn registry_url(&self) -> String {
        format!("http://{}", self.registry_http)
    }

    /// Stops everything and drops the database.
    pub async fn stop(mut self) {
        for gateway in self.gateways.drain(..) {
            gateway.stop().await;
        }
        for (stop, handle) in self.services.drain(..).rev() {
            let _ = stop.send(());
            let _ = tokio::time::timeout(WAIT, handle).await;
        }
        let subjects = proto_schemas::Subjects::new(&self.prefix).expect("test prefixes are valid");
        for stream in [subjects.frames_stream(), subjects.blobs_stream()] {
            if let Err(e) = self.bus.delete_stream(stream).await {
                tracing::warn!("test stream not deleted: {e}");
            }
        }
        if let Some(path) = self.credentials_file.take() {
            let _ = std::fs::remove_file(path);
        }
        if let Some(db) = self.database.take() {
            db.cleanup().await;
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
}

/// Waits until `check` returns `Some`, polling, at most `WAIT`.
pub async fn eventually<T, F, Fut>(what: &str, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if tokio::time::Instant::now() > deadline {
            bail!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An AIP client over a real WebSocket.
pub struct Client {
    ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
}

/// How a connection ended, as the client saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Closed {
    /// The close code, if the server sent one.
    pub code: Option<u16>,
    /// The close reason.
    pub reason: String,
}

impl Client {
    /// Connects; fails with the HTTP status if the handshake is refused.
    pub async fn connect(url: &str) -> anyhow::Result<Client> {
        let (ws, _) = tokio_tungstenite::connect_async(url).await?;
        Ok(Client { ws })
    }

    /// Connects, sends `register` and expects the registration heartbeat.
    pub async fn registered(url: &str, register: Value) -> Client {
        let mut client = Client::connect(url)
            .await
            .unwrap_or_else(|e| panic!("connect {url}: {e}"));
        client
            .send(&register)
            .await
            .unwrap_or_else(|e| panic!("send register: {e}"));
        let reply = client
            .recv()
            .await
            .unwrap_or_else(|e| panic!("registration answer: {e}"));
        assert_eq!(reply["type"], "heartbeat", "registration refused: {reply}");
        client
    }

    /// Connects and expects the handshake to be refused; returns the HTTP status.
    pub async fn refused(url: &str) -> anyhow::Result<u16> {
        match tokio_tungstenite::connect_async(url).await {
            Ok(_) => bail!("the handshake was accepted"),
            Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
                Ok(response.status().as_u16())
            }
            Err(e) => bail!("unexpected error: {e}"),
        }
    }

    /// Sends a JSON frame.
    pub async fn send(&mut self, frame: &Value) -> anyhow::Result<()> {
        self.send_text(&frame.to_string()).await
    }

    /// Sends raw text.
    pub async fn send_text(&mut self, text: &str) -> anyhow::Result<()> {
        self.ws.send(Message::Text(text.into())).await?;
        Ok(())
    }

    /// Sends a binary frame.
    pub async fn send_binary(&mut self, bytes: Vec<u8>) -> anyhow::Result<()> {
        self.ws.send(Message::Binary(bytes.into())).await?;
        Ok(())
    }

    /// The next JSON frame (pings and pongs skipped), within `WAIT`.
    pub async fn recv(&mut self) -> anyhow::Result<Value> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let next = tokio::time::timeout_at(deadline, self.ws.next())
                .await
                .map_err(|_| anyhow!("no frame within {WAIT:?}"))?;
            match next {
                None => bail!("connection closed"),
                Some(Err(e)) => bail!("connection failed: {e}"),
                Some(Ok(Message::Text(text))) => return Ok(serde_json::from_str(text.as_str())?),
                Some(Ok(Message::Close(frame))) => {
                    bail!(
                        "connection closed: {:?}",
                        frame.map(|f| (u16::from(f.code), f.reason.to_string()))
                    )
                }
                Some(Ok(_)) => {}
            }
        }
    }

    /// The next frame of a given `type` (others skipped).
    pub async fn recv_type(&mut self, kind: &str) -> anyhow::Result<Value> {
        loop {
            let frame = self.recv().await?;
            if frame["type"] == kind {
                return Ok(frame);
            }
        }
    }

    /// Nothing arrives within `quiet`.
    pub async fn expect_silence(&mut self, quiet: Duration) -> anyhow::Result<()> {
        match tokio::time::timeout(quiet, self.ws.next()).await {
            Err(_) => Ok(()),
            Ok(Some(Ok(Message::Ping(_) | Message::Pong(_)))) => Ok(()),
            Ok(other) => bail!("expected nothing, got {other:?}"),
        }
    }

    /// Reads until the server closes; returns the close frame.
    pub async fn closed(&mut self) -> anyhow::Result<Closed> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let next = tokio::time::timeout_at(deadline, self.ws.next())
                .await
                .map_err(|_| anyhow!("not closed within {WAIT:?}"))?;
            match next {
                None | Some(Err(_)) => {
                    return Ok(Closed {
                        code: None,
                        reason: String::new(),
                    });
                }
                Some(Ok(Message::Close(frame))) => {
                    return Ok(Closed {
                        code: frame.as_ref().map(|f| u16::from(f.code)),
                        reason: frame.map(|f| f.reason.to_string()).unwrap_or_default(),
                    });
                }
                Some(Ok(_)) => {}
            }
        }
    }

    /// Closes the connection.
    pub async fn close(mut self) {
        let _ = self.ws.close(None).await;
    }
}
