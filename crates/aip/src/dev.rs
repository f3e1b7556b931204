//! `aip dev`: the whole broker in one process, on one listener.
//!
//! The gateway, the registry and the session service are built exactly as their own binaries
//! build them, on one bus and one database: by default the in-process bus
//! ([`aip_bus::LocalBus`]) and an SQLite file in the data directory, so nothing else has to
//! run; `--nats-url` and `--database-url` switch to NATS and PostgreSQL. Their routers are
//! served together on one address: [`router`] hands each request to the service that owns its
//! path ([`owner`]):
//!
//! | path | served by |
//! | --- | --- |
//! | `/ws` | gateway |
//! | `/api/agents`, `/api/agents/{id}`, `/api/clients`, `/api/health` | registry |
//! | `/healthz`, `/readyz` | `aip dev` itself: the process, and bus + database |
//! | `/openapi.json` | `aip dev` itself: both services' documents in one ([`openapi`]) |
//! | everything else (`/api/tasks…`, `/api/dispatch`, `/api/task_result/…`) | session service |
//!
//! The services are built embedded (`build_with` and `Listening::Embedded`): none binds a listener of its own; the
//! address clients use is the one printed. Each is told that address, so its own rule about
//! an open listener on the network holds too.
//!
//! Shutdown (Ctrl-C, SIGTERM) stops taking connections, then stops the gateway first (sockets
//! closed with 1001, agents marked offline), then the session service, then the registry, so
//! each one's last messages still find the others.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use aip_bus::{LocalBus, NatsBus, SharedBus};
use aip_runtime::health::Probes;
use aip_runtime::listener::Listening;
use aip_runtime::runner::Service as _;
use aip_runtime::service::Exposure;
use aip_store::Database;
use anyhow::{Context, bail};
use axum::Router;
use axum::extract::{Request, State};
use axum::response::Response;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

use crate::UsageError;
use crate::cli::{DEFAULT_LISTEN, DevArgs};

/// The service that answers a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// `/ws`.
    Gateway,
    /// `/api/agents…`, `/api/clients`, `/api/health`.
    Registry,
    /// Everything else: `/api/tasks…`, `/api/dispatch`, `/api/task_result/…`, `/openapi.json`
    /// (and the 404s).
    Sessions,
}

/// Which service owns `path` (`/healthz` and `/readyz` are answered before this is asked).
pub fn owner(path: &str) -> Owner {
    match path {
        "/ws" => Owner::Gateway,
        "/api/agents" | "/api/clients" | "/api/health" => Owner::Registry,
        p if p.starts_with("/api/agents/") => Owner::Registry,
        _ => Owner::Sessions,
    }
}

/// The SQLite file inside the data directory.
pub const DATABASE_FILE: &str = "aip.db";

/// How long shutdown waits for each service before moving on.
const STOP_WAIT: Duration = Duration::from_secs(15);

/// What `aip dev` tells its user at start.
#[derive(Debug, Clone)]
pub struct DevInfo {
    /// The one address every route is served on.
    pub addr: SocketAddr,
    /// `ws://…/ws`.
    pub ws_url: String,
    /// `http://…`.
    pub rest_url: String,
    /// The data directory (absolute), when the database is the default SQLite file in it.
    pub data_dir: Option<PathBuf>,
    /// The database URL, password masked.
    pub database: String,
    /// The bus, in words.
    pub bus: String,
    /// The default planner, in words.
    pub planner: String,
}

/// A built broker, bound and ready to run.
pub struct DevServer {
    listener: TcpListener,
    router: Router,
    gateway: aip_gateway::Application,
    registry: aip_registry::Application,
    sessions: aip_sessions::Application,
    bus: SharedBus,
    db: Database,
    stopping: CancellationToken,
    info: DevInfo,
}

/// One OpenAPI document with every route `aip dev` serves: the session service's and the
/// registry's generated documents merged (their schemas share names only where they are the
/// same proto-schemas type; the probes are in both).
pub fn openapi() -> utoipa::openapi::OpenApi {
    let mut document = aip_sessions::http::openapi();
    document.merge(aip_registry::http::openapi());
    document.info.title = "aip dev".to_owned();
    document.info.description = Some(
        "Every REST route of the aip broker on one address: the session service's tasks and \
         UFO's dispatch, and the registry's agents. `/api/*` needs an API key (`X-API-Key` \
         or `Authorization: Bearer`) when keys are given."
            .to_owned(),
    );
    document
}

/// The three services' routers, each keeping its own authentication.
#[derive(Clone)]
pub struct Services {
    /// `/ws`.
    pub gateway: Router,
    /// `/api/agents…`, `/api/clients`, `/api/health`.
    pub registry: Router,
    /// Everything else.
    pub sessions: Router,
}

/// Hands a request, untouched (WebSocket upgrades included), to the router of its [`owner`].
async fn dispatch(State(services): State<Services>, request: Request) -> Response {
    let router = match owner(request.uri().path()) {
        Owner::Gateway => services.gateway,
        Owner::Registry => services.registry,
        Owner::Sessions => services.sessions,
    };
    match router.oneshot(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// The one router: the probes answered here (`health`: the bus, the database, and not
/// shutting down), every other request handed to its [`owner`]. Each service's router keeps its own authentication (API keys on `/api/*`, tokens
/// on `/ws`). A path-level hand-over rather than `Router::merge`: the services' routers
/// overlap (each has `/healthz`, `/readyz`), and nesting one router's parameters inside
/// another's would confuse their `Path` extractors.
pub fn router(services: Services, health: Router) -> Router {
    health.merge(Router::new().fallback(dispatch).with_state(services))
}

fn display_addr(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        ip if ip.is_unspecified() => SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), addr.port()),
        _ => addr,
    }
}

fn sqlite_url(data_dir: &Path) -> String {
    format!("sqlite://{}", data_dir.join(DATABASE_FILE).display())
}

impl DevServer {
    /// Binds the listener, opens the bus and the database, and builds the three services.
    pub async fn build(args: &DevArgs) -> anyhow::Result<Self> {
        let exposure = Exposure {
            listen: args.listen,
            secured: (!args.api_keys.is_empty() || args.principals_file.is_some())
                && args.credentials_file.is_some(),
            allow_no_auth: args.allow_no_auth,
        };
        if args.api_keys.iter().any(|k| k.trim().is_empty()) {
            bail!(UsageError(
                "--api-key must not be empty: an empty key would let requests without one through"
                    .to_owned()
            ));
        }
        if exposure.refused() {
            bail!(UsageError(format!(
                "refusing to serve on {} without API keys and gateway credentials: give \
                 --api-key and --credentials-file, listen on a loopback address, or pass \
                 --allow-no-auth on a trusted network",
                args.listen
            )));
        }
        let listener = aip_runtime::listener::bind_tcp(args.listen).with_context(|| {
            format!(
                "cannot listen on {}: is another `aip dev` (or UFO's server) using it? Stop it, \
                 or pick another address with --listen",
                args.listen
            )
        })?;
        let addr = listener.local_addr().context("reading the bound address")?;

        // The data directory holds the default SQLite database; with --database-url it is unused.
        let (database_url, data_dir) = match &args.database_url {
            Some(url) => (url.clone(), None),
            None => {
                std::fs::create_dir_all(&args.data_dir).with_context(|| {
                    format!(
                        "cannot create the data directory {}",
                        args.data_dir.display()
                    )
                })?;
                let dir = std::fs::canonicalize(&args.data_dir)
                    .with_context(|| format!("cannot resolve {}", args.data_dir.display()))?;
                (sqlite_url(&dir), Some(dir))
            }
        };

        let (bus, bus_text): (SharedBus, String) = match &args.nats_url {
            Some(url) => {
                // Credentials and TLS come from the same settings as the services'
                // (`AIP_NATS_CREDS_FILE`, …); the URL is shown with its password hidden.
                let access: aip_bus::NatsSettings =
                    aip_runtime::settings::load(args.config.as_deref())?;
                let shown = aip_bus::redact_url(url);
                (
                    Arc::new(
                        NatsBus::connect_with(url, "aip-dev", &access)
                            .await
                            .with_context(|| {
                                format!(
                                    "cannot connect to NATS at {shown}: is nats-server running there?"
                                )
                            })?,
                    ),
                    format!("NATS at {shown}, subjects {}.*", args.subject_prefix),
                )
            }
            None => (
                Arc::new(LocalBus::for_one_process()),
                "in-process (remote planners and other processes need --nats-url)".to_owned(),
            ),
        };
        let db = Database::connect(&database_url).await?;
        db.migrate().await?;

        let config = args.config.as_deref();

        let mut registry: aip_registry::Settings = aip_runtime::settings::load(config)?;
        registry.subject_prefix = args.subject_prefix.clone();
        registry.registry.listen = addr;
        registry.registry.api_keys = args.api_keys.clone();
        registry.registry.allow_no_auth = args.allow_no_auth;
        if !args.allowed_origins.is_empty() {
            registry.registry.allowed_origins = args.allowed_origins.clone();
        }
        let registry = aip_registry::Application::build_with(
            registry,
            bus.clone(),
            Some(db.clone()),
            Listening::Embedded,
        )
        .await
        .context("the registry did not start")?;

        let mut sessions: aip_sessions::Settings = aip_runtime::settings::load(config)?;
        sessions.subject_prefix = args.subject_prefix.clone();
        sessions.sessions.listen = addr;
        sessions.sessions.api_keys = args.api_keys.clone();
        if let Some(path) = &args.principals_file {
            sessions.sessions.principals_file = Some(path.clone());
        }
        sessions.sessions.allow_no_auth = args.allow_no_auth;
        if !args.allowed_origins.is_empty() {
            sessions.sessions.allowed_origins = args.allowed_origins.clone();
        }
        if let Some(planner) = args.planner {
            sessions.sessions.planner.default = Some(planner.planner());
        }
        if let Some(url) = &args.planner_url {
            sessions.sessions.planner.url = Some(url.clone());
        }
        if let Some(url) = &args.llm_base_url {
            sessions.sessions.llm.base_url = Some(url.clone());
        }
        if let Some(model) = &args.llm_model {
            sessions.sessions.llm.model = model.clone();
        }
        let sessions = aip_sessions::Application::build_with(
            sessions,
            bus.clone(),
            Some(db.clone()),
            Listening::Embedded,
        )
        .await
        .context("the session service did not start")?;

        let mut gateway: aip_gateway::Settings = aip_runtime::settings::load(config)?;
        gateway.subject_prefix = args.subject_prefix.clone();
        gateway.gateway.listen = addr;
        gateway.gateway.allow_no_auth = args.allow_no_auth;
        if !args.allowed_origins.is_empty() {
            gateway.gateway.allowed_origins = args.allowed_origins.clone();
        }
        if args.credentials_file.is_some() {
            gateway.gateway.credentials_file = args.credentials_file.clone();
        }
        let gateway =
            aip_gateway::Application::build_with(gateway, bus.clone(), None, Listening::Embedded)
                .await
                .context("the gateway did not start")?;

        let stopping = CancellationToken::new();
        let document = openapi();
        let health = Probes::new()
            .bus(bus.clone())
            .database(db.clone())
            .stopping(stopping.clone())
            .routes()
            .route(
                "/openapi.json",
                axum::routing::get(move || async move { axum::Json(document) }),
            );
        let router = router(
            Services {
                gateway: gateway.router(),
                registry: registry.router(),
                sessions: sessions.router(),
            },
            health,
        );
        let shown = display_addr(addr);
        let info = DevInfo {
            addr,
            ws_url: format!("ws://{shown}/ws"),
            rest_url: format!("http://{shown}"),
            data_dir,
            database: aip_store::mask_url(&database_url),
            bus: bus_text,
            planner: sessions.engine().planners().describe(),
        };
        Ok(DevServer {
            listener,
            router,
            gateway,
            registry,
            sessions,
            bus,
            db,
            stopping,
            info,
        })
    }

    /// Addresses and places, for the banner.
    pub fn info(&self) -> &DevInfo {
        &self.info
    }

    /// Serves until `shutdown` completes (or a service fails), then stops everything in order.
    pub async fn run_until(self, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
        let DevServer {
            listener,
            router,
            gateway,
            registry,
            sessions,
            bus,
            db,
            stopping,
            info: _,
        } = self;
        let gateway_stop = CancellationToken::new();
        let sessions_stop = CancellationToken::new();
        let registry_stop = CancellationToken::new();
        let mut registry_task =
            tokio::spawn(registry.run_until_stopped(registry_stop.clone().cancelled_owned()));
        let mut sessions_task =
            tokio::spawn(sessions.run_until(sessions_stop.clone().cancelled_owned()));
        // The one listener serves the gateway's WebSockets and the REST APIs: the gateway's
        // connection limits (its settings, `AIP_GATEWAY__…`) apply to it.
        let limits = gateway.connection_limits();
        let mut gateway_task =
            tokio::spawn(gateway.run_until(gateway_stop.clone().cancelled_owned()));
        let mut server = tokio::spawn(aip_runtime::listener::serve_http(
            listener,
            router,
            limits,
            stopping.clone().cancelled_owned(),
        ));

        let failure: Option<String> = tokio::select! {
            () = shutdown => None,
            r = &mut server => Some(stopped_early("the listener", r)),
            r = &mut gateway_task => Some(stopped_early("the gateway", r)),
            r = &mut sessions_task => Some(stopped_early("the session service", r)),
            r = &mut registry_task => Some(stopped_early("the registry", r)),
        };
        if let Some(failure) = &failure {
            tracing::error!("{failure}; shutting down");
        }
        stopping.cancel();
        gateway_stop.cancel();
        wait("gateway", &mut gateway_task).await;
        sessions_stop.cancel();
        wait("session service", &mut sessions_task).await;
        registry_stop.cancel();
        wait("registry", &mut registry_task).await;
        // Open event streams (`aip dispatch` following a task) would keep the listener's
        // graceful shutdown waiting: give them a moment, then drop them.
        if tokio::time::timeout(Duration::from_secs(2), &mut server)
            .await
            .is_err()
        {
            server.abort();
        }
        if let Err(e) = bus.flush().await {
            tracing::warn!("could not flush the bus: {e}");
        }
        db.close().await;
        match failure {
            Some(failure) => bail!(failure),
            None => Ok(()),
        }
    }
}

/// Says how a part that should have kept running stopped.
fn stopped_early<E: std::fmt::Display>(
    part: &str,
    result: Result<Result<(), E>, tokio::task::JoinError>,
) -> String {
    match result {
        Ok(Ok(())) => format!("{part} stopped unexpectedly"),
        Ok(Err(e)) => format!("{part} failed: {e}"),
        Err(e) => format!("{part} failed: {e}"),
    }
}

/// Waits for a service's task (already told to stop), at most [`STOP_WAIT`].
async fn wait<T>(name: &str, task: &mut tokio::task::JoinHandle<T>) {
    if task.is_finished() {
        return;
    }
    if tokio::time::timeout(STOP_WAIT, &mut *task).await.is_err() {
        tracing::warn!("the {name} did not stop within {STOP_WAIT:?}; abandoning it");
        task.abort();
    }
}

/// The lines printed at start: where to connect and what to run next.
pub fn banner(info: &DevInfo) -> String {
    let default_ws = format!("ws://{DEFAULT_LISTEN}/ws");
    let default_rest = format!("http://{DEFAULT_LISTEN}");
    let device_url = if info.ws_url == default_ws {
        String::new()
    } else {
        format!(" --url {}", info.ws_url)
    };
    let rest = if info.rest_url == default_rest {
        String::new()
    } else {
        format!(" --rest {}", info.rest_url)
    };
    let ufo = if info.addr.port() == 5000 {
        "  (UFO clients: their default ws://localhost:5000/ws works)\n"
    } else {
        ""
    };
    format!(
        "aip dev: gateway, registry and session service in one process\n\
         \x20 WebSocket  {ws}\n{ufo}\
         \x20 REST       {rest_url}/api  (OpenAPI: {rest_url}/openapi.json)\n\
         \x20 bus        {bus}\n\
         \x20 planner    {planner}\n\
         \x20 database   {database}\n\
         {data_dir}\
         \n\
         Next, in other terminals:\n\
         \x20 aip device{device_url} --id demo-pc --capability demo\n\
         \x20 aip dispatch{rest} --capability demo --tool echo --args '{{\"text\":\"hi\"}}' \"say hi\"\n\
         \x20 aip tasks list{rest}\n\
         Ctrl-C stops the broker; agents, tasks, events and results stay in the database.\n",
        ws = info.ws_url,
        rest_url = info.rest_url,
        bus = info.bus,
        planner = info.planner,
        database = info.database,
        data_dir = info
            .data_dir
            .as_ref()
            .map(|d| format!("  data dir   {}\n", d.display()))
            .unwrap_or_default(),
    )
}

/// Runs `aip dev` until Ctrl-C or SIGTERM.
pub async fn run(args: DevArgs) -> anyhow::Result<()> {
    let traces = if args.traces {
        aip_runtime::telemetry::Traces::On
    } else {
        aip_runtime::telemetry::Traces::Off
    };
    let telemetry = aip_runtime::telemetry::init_with(
        aip_runtime::telemetry::LogFormat::Pretty,
        "info",
        traces,
        "aip",
    );
    let server = DevServer::build(&args).await?;
    {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        let _ = write!(out, "{}", banner(server.info()));
        let _ = out.flush();
    }
    let shutdown = async {
        aip_runtime::shutdown::signal().await;
        eprintln!("aip dev: stopping (press Ctrl-C again to quit at once)");
        tokio::spawn(async {
            aip_runtime::shutdown::signal().await;
            eprintln!("aip dev: quitting without waiting");
            std::process::exit(130);
        });
    };
    let result = server.run_until(shutdown).await;
    telemetry.shutdown().await;
    result?;
    println!("aip dev: stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_banner_says_where_and_what_next() {
        let info = DevInfo {
            addr: "127.0.0.1:5000".parse().expect("addr"),
            ws_url: "ws://127.0.0.1:5000/ws".into(),
            rest_url: "http://127.0.0.1:5000".into(),
            data_dir: Some("/tmp/x".into()),
            database: "sqlite:///tmp/x/aip.db".into(),
            bus: "in-process".into(),
            planner: "llm, model m at http://127.0.0.1:11434/v1/chat/completions".into(),
        };
        let text = banner(&info);
        assert!(text.contains("planner    llm, model m at http://127.0.0.1:11434"));
        assert!(text.contains("ws://127.0.0.1:5000/ws"));
        assert!(text.contains("ws://localhost:5000/ws"));
        assert!(text.contains("data dir   /tmp/x"));
        assert!(text.contains("aip device --id demo-pc --capability demo"));
        assert!(text.contains(
            r#"aip dispatch --capability demo --tool echo --args '{"text":"hi"}' "say hi""#
        ));
        let other = DevInfo {
            addr: "127.0.0.1:6000".parse().expect("addr"),
            ws_url: "ws://127.0.0.1:6000/ws".into(),
            rest_url: "http://127.0.0.1:6000".into(),
            ..info
        };
        let text = banner(&other);
        assert!(text.contains("aip device --url ws://127.0.0.1:6000/ws --id demo-pc"));
        assert!(text.contains("aip dispatch --rest http://127.0.0.1:6000 --capability"));
        assert!(!text.contains("localhost:5000"));
    }

    #[test]
    fn paths_go_to_their_service() {
        assert_eq!(owner("/ws"), Owner::Gateway);
        for path in [
            "/api/agents",
            "/api/agents/pc-1",
            "/api/clients",
            "/api/health",
        ] {
            assert_eq!(owner(path), Owner::Registry, "{path}");
        }
        for path in [
            "/api/tasks",
            "/api/tasks/x/events/stream",
            "/api/dispatch",
            "/api/task_result/t",
            "/openapi.json",
            "/nope",
            "/ws/x",
            "/api/agentsx",
        ] {
            assert_eq!(owner(path), Owner::Sessions, "{path}");
        }
    }

    #[test]
    fn one_document_has_every_route_of_both_services() {
        let document = serde_json::to_value(openapi()).expect("serialises");
        let paths = document["paths"].as_object().expect("paths");
        for path in [
            "/api/tasks",
            "/api/dispatch",
            "/api/agents/{id}",
            "/api/clients",
        ] {
            assert!(paths.contains_key(path), "{path}");
        }
        for name in ["TaskView", "AgentRecord", "ErrorBody"] {
            assert!(
                document["components"]["schemas"].get(name).is_some(),
                "{name}"
            );
        }
    }

    #[test]
    fn unspecified_addresses_are_shown_as_loopback() {
        assert_eq!(
            display_addr("0.0.0.0:5000".parse().expect("addr")).to_string(),
            "127.0.0.1:5000"
        );
        assert_eq!(sqlite_url(Path::new("/d")), "sqlite:///d/aip.db");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_listener_serves_every_service() {
        aip_runtime::install_crypto_provider();
        let dir = std::env::temp_dir().join(format!("aip-dev-{}", uuid::Uuid::new_v4().simple()));
        let args = DevArgs {
            listen: "127.0.0.1:0".parse().expect("addr"),
            data_dir: dir.clone(),
            nats_url: None,
            database_url: None,
            subject_prefix: "aip".into(),
            api_keys: vec!["k".into()],
            credentials_file: None,
            principals_file: None,
            allow_no_auth: false,
            allowed_origins: Vec::new(),
            config: None,
            planner: None,
            planner_url: None,
            llm_base_url: None,
            llm_model: None,
            traces: false,
        };
        let server = DevServer::build(&args).await.expect("builds");
        let base = server.info().rest_url.clone();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn(server.run_until(async {
            let _ = stop_rx.await;
        }));
        let http = reqwest::Client::new();
        let get = |path: &str, key: Option<&str>| {
            let mut request = http.get(format!("{base}{path}"));
            if let Some(key) = key {
                request = request.header("X-API-Key", key);
            }
            async move {
                let response = request.send().await.expect("request");
                let status = response.status().as_u16();
                (
                    status,
                    response
                        .json::<serde_json::Value>()
                        .await
                        .unwrap_or_default(),
                )
            }
        };
        assert_eq!(
            get("/healthz", None).await,
            (200, json!({ "status": "ok" }))
        );
        let (status, ready) = get("/readyz", None).await;
        assert_eq!(
            (status, ready),
            (
                200,
                json!({ "status": "ready", "checks": {
                    "accepting": { "ok": true }, "bus": { "ok": true }, "database": { "ok": true } } })
            ),
        );
        let (status, clients) = get("/api/clients", Some("k")).await;
        assert_eq!(status, 200);
        assert_eq!(
            clients,
            json!({ "online_clients": [] }),
            "registry: UFO's exact shape"
        );
        assert_eq!(get("/api/health", Some("k")).await.1["status"], "healthy");
        assert_eq!(get("/api/agents", Some("k")).await, (200, json!([])));
        assert_eq!(get("/api/agents/nobody", Some("k")).await.0, 404);
        let (status, tasks) = get("/api/tasks", Some("k")).await;
        assert_eq!((status, &tasks["tasks"]), (200, &json!([])), "sessions");
        assert_eq!(get("/api/task_result/none", Some("k")).await.0, 404);
        let (status, openapi) = get("/openapi.json", None).await;
        assert_eq!((status, &openapi["openapi"]), (200, &json!("3.1.0")));
        assert_eq!(
            get("/api/tasks", None).await.0,
            401,
            "API keys hold on every service"
        );
        assert_eq!(get("/api/agents", Some("wrong")).await.0, 401);
        assert_eq!(get("/api/clients", None).await.0, 401);
        let _ = stop_tx.send(());
        tokio::time::timeout(Duration::from_secs(30), running)
            .await
            .expect("stops in time")
            .expect("joins")
            .expect("stops cleanly");
        assert!(
            dir.join(DATABASE_FILE).exists(),
            "the SQLite file is in the data dir"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
