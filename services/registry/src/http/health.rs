//! Health: UFO's `/api/clients` and `/api/health`, and the probes `/healthz` and `/readyz`.

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::json;

use super::AppState;
use super::error::ApiError;

/// UFO's `GET /api/clients` body.
#[derive(Debug, Serialize)]
pub struct OnlineClients {
    /// Ids of devices and constellations not offline.
    pub online_clients: Vec<String>,
}

/// UFO's `GET /api/health` body.
#[derive(Debug, Serialize)]
pub struct Health {
    /// Always `healthy` when the answer comes at all.
    pub status: &'static str,
    /// Ids of devices and constellations not offline.
    pub online_clients: Vec<String>,
}

/// `GET /api/clients` → exactly `{"online_clients": [ids]}`.
pub async fn clients(State(state): State<AppState>) -> Result<Json<OnlineClients>, ApiError> {
    Ok(Json(OnlineClients {
        online_clients: state.store.online_ids().await?,
    }))
}

/// `GET /api/health` → exactly `{"status": "healthy", "online_clients": [ids]}`.
pub async fn health(State(state): State<AppState>) -> Result<Json<Health>, ApiError> {
    Ok(Json(Health {
        status: "healthy",
        online_clients: state.store.online_ids().await?,
    }))
}

/// `GET /healthz`: the process is up (liveness probe).
pub async fn healthz() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

/// How long `/readyz` waits for the database.
const READY_TIMEOUT: Duration = Duration::from_secs(2);

/// `GET /readyz`: the database answers (readiness probe); 503 with the reason otherwise.
pub async fn readyz(State(state): State<AppState>) -> Response {
    match tokio::time::timeout(READY_TIMEOUT, state.store.ping()).await {
        Ok(Ok(())) => Json(json!({"status": "ready"})).into_response(),
        Ok(Err(e)) => {
            tracing::warn!("not ready: {e}");
            (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "unavailable", "detail": e.to_string()})))
                .into_response()
        }
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "unavailable", "detail": format!("the database did not answer within {READY_TIMEOUT:?}")})),
        )
            .into_response(),
    }
}
