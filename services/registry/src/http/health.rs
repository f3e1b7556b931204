//! Health in UFO's words: `/api/clients` and `/api/health`. The probes `/healthz` and
//! `/readyz` are [`aip_runtime::health`]'s, as on every service.

use axum::Json;
use axum::extract::State;
use serde::Serialize;

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
