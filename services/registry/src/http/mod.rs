//! The registry's REST API (axum).
//!
//! - `GET /api/agents`, `GET /api/agents/{id}`: agents as [`AgentRecord`]s;
//! - `GET /api/clients`, `GET /api/health`: UFO's paths and exact shapes;
//! - `GET /healthz`, `GET /readyz`: probes, without authentication, merged in by
//!   [`crate::Application`] ([`aip_runtime::health`]);
//! - `GET /openapi.json`: the OpenAPI document ([`openapi`]), generated from the handlers and
//!   checked in as `services/registry/openapi.json`.
//!
//! `/api/*` needs a key when keys are configured ([`aip_runtime::api_keys`]: `X-API-Key` or
//! `Authorization: Bearer`; 401 `{"detail": "Invalid API key", …}` or "Missing API key …").
//!
//! [`AgentRecord`]: proto_schemas::registry::AgentRecord

pub mod agents;
pub mod error;
pub mod health;

use std::sync::Arc;

use axum::routing::get;
use axum::{Json, Router};
use proto_schemas::ErrorBody;
use tower_http::trace::TraceLayer;
use utoipa::openapi::OpenApi;
use utoipa::openapi::link::LinkBuilder;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use self::error::ApiError;
use crate::store::AgentStore;
use aip_runtime::api_error;
use aip_runtime::api_keys::{self, ApiKeys};

/// What handlers share.
#[derive(Clone)]
pub struct AppState {
    /// The agents.
    pub store: Arc<dyn AgentStore>,
}

/// The `/api` routes with their documentation (paths relative to `/api`).
fn api_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(agents::list))
        .routes(routes!(agents::get))
        .routes(routes!(clients))
        .routes(routes!(ufo_health))
}

/// The whole router.
pub fn router(state: AppState, keys: ApiKeys) -> Router {
    let (api, _) = api_routes()
        .route_layer(axum::middleware::from_fn_with_state(
            keys,
            api_keys::require,
        ))
        .route_layer(axum::middleware::from_fn(
            aip_runtime::telemetry::traced_request,
        ))
        .split_for_parts();
    let document = openapi();
    Router::new()
        .nest("/api", api)
        .route("/openapi.json", get(move || async move { Json(document) }))
        .method_not_allowed_fallback(api_error::method_not_allowed)
        .fallback(api_error::no_such_path)
        .with_state(state)
        .layer(TraceLayer::new_for_http())
}

/// The OpenAPI 3.1 document of this API, generated from the handlers' annotations and types.
pub fn openapi() -> OpenApi {
    let mut document = OpenApiRouter::<AppState>::with_openapi(info())
        .nest("/api", api_routes())
        .into_openapi();
    aip_runtime::api_error::document(&mut document);
    add_links(&mut document);
    document
}

fn info() -> OpenApi {
    let mut document = OpenApi::default();
    document.info.title = "aip-registry".to_owned();
    document.info.version = env!("CARGO_PKG_VERSION").to_owned();
    document.info.description = Some(
        "Agents known to the aip broker: who is registered, with which capabilities and \
         status; UFO's `/api/clients` and `/api/health`. `/api/*` needs an API key \
         (`X-API-Key` or `Authorization: Bearer`) when keys are configured."
            .to_owned(),
    );
    document.info.license = None;
    document.info.contact = None;
    document
}

/// Links from the listing to each listed agent, so a client (or a stateful fuzzer) can follow
/// from one to the other.
fn add_links(document: &mut OpenApi) {
    let Some(list) = document
        .paths
        .paths
        .get_mut("/api/agents")
        .and_then(|item| item.get.as_mut())
    else {
        return;
    };
    if let Some(utoipa::openapi::RefOr::T(ok)) = list.responses.responses.get_mut("200") {
        ok.links.insert(
            "GetFirstAgent".to_owned(),
            LinkBuilder::new()
                .operation_id("get_agent")
                .parameter("id", "$response.body#/0/agent_id")
                .description("the first agent of the page")
                .build()
                .into(),
        );
    }
}

/// The body of UFO's `GET /api/clients`, as documented (`health::clients` answers it).
#[derive(utoipa::ToSchema)]
#[schema(as = OnlineClients)]
#[allow(dead_code)]
struct OnlineClientsBody {
    /// Ids of devices and constellations not offline.
    online_clients: Vec<String>,
}

/// The body of UFO's `GET /api/health`, as documented (`health::health` answers it).
#[derive(utoipa::ToSchema)]
#[schema(as = UfoHealth)]
#[allow(dead_code)]
struct UfoHealthBody {
    /// Always `healthy` when the answer comes at all.
    #[schema(pattern = "^healthy$")]
    status: String,
    /// Ids of devices and constellations not offline.
    online_clients: Vec<String>,
}

/// UFO's list of online clients.
#[utoipa::path(
    get,
    path = "/clients",
    operation_id = "online_clients",
    tag = "ufo",
    responses(
        (status = 200, description = "exactly `{\"online_clients\": [ids]}`", body = OnlineClientsBody),
        (status = 503, description = "the database is unavailable; retry", body = ErrorBody),
    )
)]
async fn clients(
    state: axum::extract::State<AppState>,
) -> Result<Json<health::OnlineClients>, ApiError> {
    health::clients(state).await
}

/// UFO's health answer, with the online clients.
#[utoipa::path(
    get,
    path = "/health",
    operation_id = "ufo_health",
    tag = "ufo",
    responses(
        (status = 200, description = "exactly `{\"status\": \"healthy\", \"online_clients\": [ids]}`", body = UfoHealthBody),
        (status = 503, description = "the database is unavailable; retry", body = ErrorBody),
    )
)]
async fn ufo_health(
    state: axum::extract::State<AppState>,
) -> Result<Json<health::Health>, ApiError> {
    health::health(state).await
}
