//! The registry's REST API (axum).
//!
//! - `GET /api/agents`, `GET /api/agents/{id}`: agents as [`AgentRecord`]s;
//! - `GET /api/clients`, `GET /api/health`: UFO's paths and exact shapes;
//! - `GET /healthz`, `GET /readyz`: probes, without authentication, merged in by
//!   [`crate::Application`] ([`aip_runtime::health`]).
//!
//! `/api/*` needs a key when keys are configured ([`aip_runtime::api_keys`]: `X-API-Key` or
//! `Authorization: Bearer`; 401 `{"detail": "Invalid API key", …}` or "Missing API key …").
//!
//! [`AgentRecord`]: proto_schemas::registry::AgentRecord

pub mod agents;
pub mod error;
pub mod health;

use std::sync::Arc;

use axum::Router;
use axum::http::Uri;
use axum::routing::get;
use tower_http::trace::TraceLayer;

use self::error::ApiError;
use crate::store::AgentStore;
use aip_runtime::api_keys::{self, ApiKeys};

/// What handlers share.
#[derive(Clone)]
pub struct AppState {
    /// The agents.
    pub store: Arc<dyn AgentStore>,
}

/// The whole router.
pub fn router(state: AppState, keys: ApiKeys) -> Router {
    let api = Router::new()
        .route("/agents", get(agents::list))
        .route("/agents/{id}", get(agents::get))
        .route("/clients", get(health::clients))
        .route("/health", get(health::health))
        .route_layer(axum::middleware::from_fn_with_state(
            keys,
            api_keys::require,
        ));
    Router::new()
        .nest("/api", api)
        .fallback(not_found)
        .with_state(state)
        .layer(TraceLayer::new_for_http())
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::NotFound(format!("no such path: {}", uri.path()))
}
