//! The one REST error of every service, the extractors whose refusals are that error, and
//! what every service's OpenAPI document shares.
//!
//! A handler returns `Result<_, ApiError>` and uses `?`. Every refusal is
//! `{"detail": …, "error_code": …}` (`detail` is the key UFO's FastAPI server uses) with the
//! status of its [`ErrorCode`]. An internal failure is logged and answered with a short text
//! saying what to do, never with its internals.
//!
//! axum's own extractors refuse in plain text; [`JsonBody`], [`Query`] and [`Path`] refuse
//! with an [`ApiError`] instead, so a client reads one body shape whatever went wrong. For the
//! same reason every service's router answers a path it does not serve with [`no_such_path`]
//! and a method a route does not answer with [`method_not_allowed`] (axum's own answers have
//! no body).
//! [`document`] adds to a service's generated OpenAPI document the API-key schemes and the
//! refusals that every route can give (401, and 400/415 for input it cannot read).

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, OptionalFromRequest, Request};
use axum::http::request::Parts;
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use proto_schemas::{ErrorBody, ErrorCode};
use serde::de::DeserializeOwned;
use utoipa::openapi::security::{ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, OpenApi, Ref, RefOr, ResponseBuilder, SecurityRequirement};

/// Why a REST request failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Refused with a code; the status is the code's ([`ErrorCode::http_status`]).
    #[error("{0}")]
    Refused(ErrorBody),
    /// Refused with another status than the code's: 415 for a body that is not JSON, UFO's
    /// 422 for a dispatch body that is not an object, 405 for a method a route does not
    /// answer. No [`ErrorCode`] names these cases.
    #[error("{1}")]
    WithStatus(StatusCode, ErrorBody),
    /// The service failed (its database, a bug): `public` is answered, `source` is logged.
    #[error("{public}: {source}")]
    Failed {
        /// What the client reads, with the code (`UNAVAILABLE` or `INTERNAL`).
        public: ErrorBody,
        /// What went wrong, for the logs.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl ApiError {
    /// A refusal with `code` and its status.
    pub fn new(code: ErrorCode, detail: impl Into<String>) -> Self {
        ApiError::Refused(ErrorBody::new(code, detail))
    }

    /// `INVALID_REQUEST` (400).
    pub fn invalid(detail: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::InvalidRequest, detail)
    }

    /// `NOT_FOUND` (404).
    pub fn not_found(detail: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::NotFound, detail)
    }

    /// A failure of the service itself, answered with `code` and `detail` and logged with
    /// `source`.
    pub fn failed(
        code: ErrorCode,
        detail: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        ApiError::Failed {
            public: ErrorBody::new(code, detail),
            source: source.into(),
        }
    }

    /// The body the client reads.
    pub fn body(&self) -> &ErrorBody {
        match self {
            ApiError::Refused(body) | ApiError::WithStatus(_, body) => body,
            ApiError::Failed { public, .. } => public,
        }
    }

    pub fn code(&self) -> ErrorCode {
        self.body().error_code
    }

    /// The HTTP status.
    pub fn status_code(&self) -> StatusCode {
        match self {
            ApiError::WithStatus(status, _) => *status,
            other => status_of(other.code()),
        }
    }
}

/// The fallback of a service's router: 404 `NOT_FOUND` naming the path.
pub async fn no_such_path(uri: Uri) -> ApiError {
    ApiError::not_found(format!("no such path: {}", uri.path()))
}

/// The answer to a method a route does not answer: 405 `INVALID_REQUEST` (axum adds the
/// `Allow` header).
pub async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::WithStatus(
        StatusCode::METHOD_NOT_ALLOWED,
        ErrorBody::new(
            ErrorCode::InvalidRequest,
            format!("{method} is not allowed on {}", uri.path()),
        ),
    )
}

/// The status of `code` in REST answers.
pub fn status_of(code: ErrorCode) -> StatusCode {
    StatusCode::from_u16(code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

impl From<ErrorBody> for ApiError {
    fn from(body: ErrorBody) -> Self {
        ApiError::Refused(body)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status_code();
        let body = match self {
            ApiError::Refused(body) | ApiError::WithStatus(_, body) => body,
            ApiError::Failed { public, source } => {
                if public.error_code == ErrorCode::Unavailable {
                    tracing::warn!("REST request failed: {source}");
                } else {
                    tracing::error!("REST request failed: {source}");
                }
                public
            }
        };
        (status, axum::Json(body)).into_response()
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        let detail = format!("invalid JSON body: {}", rejection.body_text());
        match rejection {
            JsonRejection::MissingJsonContentType(_) => ApiError::WithStatus(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                ErrorBody::new(
                    ErrorCode::InvalidRequest,
                    "send the body as JSON, with the header Content-Type: application/json",
                ),
            ),
            other if other.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                ApiError::new(ErrorCode::FrameTooLarge, detail)
            }
            _ => ApiError::invalid(detail),
        }
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        ApiError::invalid(format!("invalid query string: {}", rejection.body_text()))
    }
}

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        if rejection.status().is_server_error() {
            // A route whose handler reads parameters the route does not have: a bug.
            let text = rejection.body_text();
            return ApiError::failed(
                ErrorCode::Internal,
                "the service failed to read the path; see its logs",
                text,
            );
        }
        ApiError::invalid(format!("invalid path: {}", rejection.body_text()))
    }
}

/// A JSON body (`Content-Type: application/json`), refused with an [`ApiError`]: 415 without
/// that content type, 413 when too large, 400 when it is not JSON of the handler's type.
/// `Option<JsonBody<T>>` is `None` when the request has no body; a body without a JSON
/// `Content-Type` is refused (415), so a form another site posts is never read as "no body".
#[derive(Debug, Clone, Copy, Default)]
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let axum::Json(value) =
            <axum::Json<T> as FromRequest<S>>::from_request(request, state).await?;
        Ok(JsonBody(value))
    }
}

impl<S: Send + Sync, T: DeserializeOwned> OptionalFromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Option<Self>, Self::Rejection> {
        if !request.headers().contains_key(header::CONTENT_TYPE) {
            if has_body(request.headers()) {
                return Err(ApiError::WithStatus(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    ErrorBody::new(
                        ErrorCode::InvalidRequest,
                        "send the body as JSON, with the header Content-Type: application/json",
                    ),
                ));
            }
            return Ok(None);
        }
        let axum::Json(value) =
            <axum::Json<T> as FromRequest<S>>::from_request(request, state).await?;
        Ok(Some(JsonBody(value)))
    }
}

/// Whether a request announces a body: a non-zero `Content-Length`, or a chunked one.
fn has_body(headers: &axum::http::HeaderMap) -> bool {
    let length = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    match length {
        Some(length) => length > 0,
        None => headers.contains_key(header::TRANSFER_ENCODING),
    }
}

/// The query string as `T`, refused with a 400 [`ApiError`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Query<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let axum::extract::Query(value) =
            axum::extract::Query::<T>::from_request_parts(parts, state).await?;
        Ok(Query(value))
    }
}

/// The path parameters as `T`, refused with a 400 [`ApiError`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Path<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let axum::extract::Path(value) =
            axum::extract::Path::<T>::from_request_parts(parts, state).await?;
        Ok(Path(value))
    }
}

/// Name of the `X-API-Key` security scheme in the documents.
pub const API_KEY_SCHEME: &str = "apiKey";
/// Name of the `Authorization: Bearer` security scheme in the documents.
pub const BEARER_SCHEME: &str = "bearer";
/// Paths under this prefix need an API key (when keys are configured).
pub const SECURED_PREFIX: &str = "/api/";

/// Completes a service's generated document with what every service shares:
/// - the `ErrorBody` schema and the two API-key schemes (either one is enough);
/// - on every `/api/…` operation: the key requirement, its 401, and the origin policy's 403;
/// - on every operation with parameters or a body: 400 for input it cannot read;
/// - on every operation with a body: 415 for a body that is not `application/json`.
///
/// - the probes `/healthz` and `/readyz`, open to all (their bodies are the probes' own).
///
/// Responses a route already documents keep their own description.
pub fn document(openapi: &mut OpenApi) {
    add_probes(openapi);
    let components = openapi.components.get_or_insert_with(Default::default);
    let mut schemas = Vec::new();
    <ErrorBody as utoipa::ToSchema>::schemas(&mut schemas);
    schemas.push((
        <ErrorBody as utoipa::ToSchema>::name().into_owned(),
        <ErrorBody as utoipa::PartialSchema>::schema(),
    ));
    for (name, schema) in schemas {
        components.schemas.entry(name).or_insert(schema);
    }
    components.security_schemes.insert(
        API_KEY_SCHEME.to_owned(),
        RefOr::T(SecurityScheme::ApiKey(ApiKey::Header(
            ApiKeyValue::with_description(
                "X-API-Key",
                "An API key (UFO's header); required on /api/* when the service has keys.",
            ),
        ))),
    );
    components.security_schemes.insert(
        BEARER_SCHEME.to_owned(),
        RefOr::T(SecurityScheme::Http(
            HttpBuilder::new()
                .scheme(HttpAuthScheme::Bearer)
                .description(Some("The same API key as `Authorization: Bearer <key>`."))
                .build(),
        )),
    );
    let error = |description: &str| {
        RefOr::T(
            ResponseBuilder::new()
                .description(description)
                .content(
                    "application/json",
                    ContentBuilder::new()
                        .schema(Some(Ref::from_schema_name("ErrorBody")))
                        .build(),
                )
                .build(),
        )
    };
    for (path, item) in openapi.paths.paths.iter_mut() {
        let operations = [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.patch,
        ];
        for operation in operations.into_iter().flatten() {
            let responses = &mut operation.responses.responses;
            if path.starts_with(SECURED_PREFIX) {
                operation.security = Some(vec![
                    SecurityRequirement::new(API_KEY_SCHEME, Vec::<String>::new()),
                    SecurityRequirement::new(BEARER_SCHEME, Vec::<String>::new()),
                ]);
                responses
                    .entry("401".to_owned())
                    .or_insert_with(|| error("no API key, or not one of the service's keys"));
                responses.entry("403".to_owned()).or_insert_with(|| {
                    error("a browser's request from an origin not in allowed_origins (or a loopback service reached under another host name)")
                });
            }
            let has_input = operation.parameters.as_ref().is_some_and(|p| !p.is_empty())
                || operation.request_body.is_some();
            if has_input {
                responses
                    .entry("400".to_owned())
                    .or_insert_with(|| error("the request's parameters or body cannot be read"));
            }
            if operation.request_body.is_some() {
                // Also for an optional body: one sent without the JSON content type.
                responses
                    .entry("415".to_owned())
                    .or_insert_with(|| error("the body is not sent as application/json"));
            }
        }
    }
}

/// `GET /healthz` (200 while the process runs) and `GET /readyz` (200 or 503), without a key.
fn add_probes(openapi: &mut OpenApi) {
    use utoipa::openapi::path::{HttpMethod, OperationBuilder, PathItem};
    let probe = |operation_id: &str, summary: &str, answers: &[(&str, &str)]| {
        let mut operation = OperationBuilder::new()
            .operation_id(Some(operation_id))
            .summary(Some(summary))
            .tag("probes")
            .securities(Some(Vec::<SecurityRequirement>::new()));
        for (status, description) in answers {
            operation =
                operation.response(*status, ResponseBuilder::new().description(*description));
        }
        PathItem::new(HttpMethod::Get, operation)
    };
    openapi.paths.paths.insert(
        "/healthz".to_owned(),
        probe("healthz", "The process is up (liveness)", &[("200", "up")]),
    );
    openapi.paths.paths.insert(
        "/readyz".to_owned(),
        probe(
            "readyz",
            "The service can do its work (readiness): its dependencies answer",
            &[("200", "ready"), ("503", "not ready; the body says why")],
        ),
    );
}
