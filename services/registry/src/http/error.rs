//! The REST API's error: the shared [`ApiError`], and how a store failure becomes one.
//!
//! Handlers return `Result<_, ApiError>` and use `?`. A store failure is logged and answered
//! without its internals: `UNAVAILABLE` (503) when the database cannot be reached, so a
//! client retries; `INTERNAL` (500) otherwise.

pub use aip_runtime::api_error::ApiError;
use proto_schemas::ErrorCode;

use crate::store::StoreError;

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        if e.is_unavailable() {
            ApiError::failed(
                ErrorCode::Unavailable,
                "the registry's database is unavailable; retry shortly",
                e,
            )
        } else {
            ApiError::failed(
                ErrorCode::Internal,
                "the registry failed to process the request; see its logs",
                e,
            )
        }
    }
}
