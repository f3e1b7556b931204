//! API keys for REST routes: `X-API-Key` (UFO's header) or `Authorization: Bearer`.
//!
//! Keys are kept as sha256 digests and compared without early exit.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use proto_schemas::{ErrorBody, ErrorCode};
use sha2::{Digest, Sha256};

/// The accepted keys. Empty: no authentication.
#[derive(Debug, Clone, Default)]
pub struct ApiKeys {
    digests: Arc<Vec<[u8; 32]>>,
}

/// Why a request's key was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ApiKeyError {
    /// No key was sent.
    #[error("Missing API key: send it in the X-API-Key header or as Authorization: Bearer <key>")]
    Missing,
    /// The key is not one of the configured keys (UFO's text).
    #[error("Invalid API key")]
    Invalid,
}

impl IntoResponse for ApiKeyError {
    fn into_response(self) -> Response {
        let mut response = (
            StatusCode::UNAUTHORIZED,
            axum::Json(ErrorBody::new(ErrorCode::Unauthorized, self.to_string())),
        )
            .into_response();
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        response
    }
}

impl ApiKeys {
    /// Accepts these keys; none means every request is let through.
    pub fn new<S: AsRef<str>>(keys: &[S]) -> Self {
        ApiKeys {
            digests: Arc::new(keys.iter().map(|k| digest(k.as_ref())).collect()),
        }
    }

    /// Whether keys are required.
    pub fn enabled(&self) -> bool {
        !self.digests.is_empty()
    }

    /// Checks a request's headers.
    pub fn check(&self, headers: &HeaderMap) -> Result<(), ApiKeyError> {
        if !self.enabled() {
            return Ok(());
        }
        let presented = digest(presented_key(headers)?);
        let matched = self
            .digests
            .iter()
            .fold(false, |found, d| found | constant_time_eq(d, &presented));
        if matched {
            Ok(())
        } else {
            Err(ApiKeyError::Invalid)
        }
    }
}

/// The key a request presents; an empty one counts as none (it can never be a key).
fn presented_key(headers: &HeaderMap) -> Result<&str, ApiKeyError> {
    let key = presented(headers)?;
    if key.trim().is_empty() {
        return Err(ApiKeyError::Missing);
    }
    Ok(key)
}

fn presented(headers: &HeaderMap) -> Result<&str, ApiKeyError> {
    if let Some(value) = headers.get("x-api-key") {
        return value.to_str().map_err(|_| ApiKeyError::Invalid);
    }
    if let Some(value) = headers.get(header::AUTHORIZATION) {
        let value = value.to_str().map_err(|_| ApiKeyError::Invalid)?;
        if let Some((scheme, token)) = value.split_once(' ')
            && scheme.eq_ignore_ascii_case("bearer")
        {
            return Ok(token.trim());
        }
    }
    Err(ApiKeyError::Missing)
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Middleware refusing requests without a valid key (use with `from_fn_with_state`).
pub async fn require(
    State(keys): State<ApiKeys>,
    request: Request,
    next: Next,
) -> Result<Response, ApiKeyError> {
    keys.check(request.headers())?;
    Ok(next.run(request).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.insert(*k, v.parse().expect("header value"));
        }
        map
    }

    #[test]
    fn keys_by_either_header() {
        let keys = ApiKeys::new(&["k1", "k2"]);
        assert!(keys.check(&headers(&[("x-api-key", "k2")])).is_ok());
        assert!(
            keys.check(&headers(&[("authorization", "Bearer k1")]))
                .is_ok()
        );
        assert_eq!(
            keys.check(&headers(&[("x-api-key", "nope")])),
            Err(ApiKeyError::Invalid)
        );
        assert_eq!(keys.check(&headers(&[])), Err(ApiKeyError::Missing));
        assert!(ApiKeys::default().check(&headers(&[])).is_ok());
    }

    /// Issue 21: an empty key configured by mistake never lets an empty header through.
    #[test]
    fn an_empty_key_is_never_a_key() {
        let keys = ApiKeys::new(&["", "k1"]);
        for presented in [
            ("x-api-key", ""),
            ("x-api-key", "  "),
            ("authorization", "Bearer "),
        ] {
            assert_eq!(
                keys.check(&headers(&[presented])),
                Err(ApiKeyError::Missing),
                "{presented:?}"
            );
        }
        assert!(keys.check(&headers(&[("x-api-key", "k1")])).is_ok());
    }

    #[test]
    fn a_configured_list_with_an_empty_key_is_refused() {
        #[derive(Debug, serde::Deserialize)]
        struct Keys {
            #[serde(deserialize_with = "crate::settings::string_or_list")]
            api_keys: Vec<String>,
        }
        let refused =
            serde_json::from_str::<Keys>(r#"{"api_keys": ["k1", " "]}"#).expect_err("an empty key");
        assert!(refused.to_string().contains("an empty entry"), "{refused}");
        let keys: Keys = serde_json::from_str(r#"{"api_keys": [" k1 "]}"#).expect("keys");
        assert_eq!(keys.api_keys, ["k1"]);
    }
}
