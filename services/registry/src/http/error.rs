//! The REST API's one error type.
//!
//! Handlers return `Result<_, ApiError>` and use `?`. Every error becomes
//! `{"detail": "...", "error_code": "..."}` (`detail` is the key UFO's FastAPI server uses)
//! with the status that goes with its code; internal failures are logged, not shown.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use proto_schemas::{ErrorBody, ErrorCode};

use crate::store::StoreError;

/// Why a REST request failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The addressed agent (or path) does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The request is malformed.
    #[error("{0}")]
    InvalidRequest(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ApiError {
    /// The error code.
    pub fn code(&self) -> ErrorCode {
        match self {
            ApiError::NotFound(_) => ErrorCode::NotFound,
            ApiError::InvalidRequest(_) => ErrorCode::InvalidRequest,
            ApiError::Store(e) if e.is_unavailable() => ErrorCode::Unavailable,
            ApiError::Store(_) => ErrorCode::Internal,
        }
    }

    /// The HTTP status.
    pub fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.code().http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let detail = match &self {
            ApiError::Store(e) if e.is_unavailable() => {
                tracing::warn!("REST request failed: {e}");
                "the registry's database is unavailable; retry shortly".to_owned()
            }
            ApiError::Store(e) => {
                tracing::error!("REST request failed: {e}");
                "the registry failed to process the request; see its logs".to_owned()
            }
            other => other.to_string(),
        };
        (
            self.status_code(),
            Json(ErrorBody::new(self.code(), detail)),
        )
            .into_response()
    }
}
