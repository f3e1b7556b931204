//! API keys for REST routes: `X-API-Key` (UFO's header) or `Authorization: Bearer`.
//!
//! Keys are kept as sha256 digests and compared without early exit. Each key names a
//! [`Caller`]: a plain key (`api_keys`) is an operator, who may act on every task; a key from a
//! principals file is limited to the requesters it acts for, the devices it may target, and
//! its quotas:
//!
//! ```toml
//! [[principal]]
//! name = "ci"
//! # sha256 of the key, hex: printf %s "$KEY" | sha256sum
//! key_sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
//! # the requester ids it submits as and whose tasks it may read and change (exact ids, or
//! # prefixes ending in `*`); absent: its name only
//! acts_for = ["ci", "ci-*"]
//! # the devices its tasks may run on (ids, prefixes, or `capability:<name>` for any device
//! # with that capability); absent: any
//! targets = ["lab-pc-*", "capability:gpu"]
//! max_live_tasks = 20   # its live tasks at once, per requester id; absent: the service's
//! max_priority = 0      # the highest priority it may ask for; absent: the service's
//!
//! [[principal]]
//! name = "ops"
//! key_sha256 = "…"
//! scope = "operator"    # every task, any device (as a plain api_keys entry)
//! ```

use std::path::Path;
use std::sync::Arc;

use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use proto_schemas::{ErrorBody, ErrorCode};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::api_error::ApiError;
use crate::patterns::{Targets, matches_any};

/// The accepted keys, each with the caller it names. Empty: no authentication (everyone is
/// [`Caller::anonymous`], an operator).
#[derive(Debug, Clone, Default)]
pub struct ApiKeys {
    keys: Arc<Vec<([u8; 32], Arc<Caller>)>>,
}

/// Who a REST request acts as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    name: String,
    scope: Scope,
}

/// What a caller may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Every task, any device, the service's quotas: a plain `api_keys` entry, a principal
    /// with `scope = "operator"`, or anyone when keys are off.
    Operator,
    /// Only what [`Limits`] allows.
    Limited(Limits),
}

/// A limited caller's allowance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Requester ids it submits as and whose tasks it reads and changes (exact or `prefix*`).
    acts_for: Vec<String>,
    /// The devices its tasks may run on; `None`: any.
    targets: Option<Targets>,
    /// Its live tasks per requester id at most; `None`: the service's limit.
    pub max_live_tasks: Option<usize>,
    /// The highest priority it may ask for; `None`: the service's ceiling.
    pub max_priority: Option<i32>,
}

impl Caller {
    /// The caller of a service without keys: an operator.
    pub fn anonymous() -> Self {
        Caller::operator("anonymous")
    }

    /// An operator named `name`.
    pub fn operator(name: impl Into<String>) -> Self {
        Caller {
            name: name.into(),
            scope: Scope::Operator,
        }
    }

    /// The principal's name (`api-key` for a plain key, `anonymous` without keys).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its allowance; `None` for an operator.
    pub fn limits(&self) -> Option<&Limits> {
        match &self.scope {
            Scope::Operator => None,
            Scope::Limited(limits) => Some(limits),
        }
    }

    /// Whether it may submit as `requester` and read and change that requester's tasks.
    pub fn may_act_for(&self, requester: &str) -> bool {
        self.limits()
            .is_none_or(|l| matches_any(&l.acts_for, requester))
    }

    fn targets(&self) -> Option<&Targets> {
        self.limits().and_then(|l| l.targets.as_ref())
    }

    /// Whether [`Caller::check_target`] needs `device`'s capabilities: its id alone does not
    /// allow it, and some targets are capabilities.
    pub fn needs_capabilities_of(&self, device: &str) -> bool {
        self.targets()
            .is_some_and(|t| !t.allows_id(device) && t.by_capability())
    }

    /// The one requester id it acts for, when it acts for exactly one (no prefix).
    pub fn only_requester(&self) -> Option<&str> {
        match self.limits()?.acts_for.as_slice() {
            [one] if !one.ends_with('*') => Some(one),
            _ => None,
        }
    }

    /// The requester id a task it submits gets when the request names none: for a limited
    /// caller its name, if it acts for that; otherwise `default`.
    pub fn requester_or<'a>(&'a self, default: &'a str) -> &'a str {
        match self.limits() {
            Some(_) if self.may_act_for(&self.name) => &self.name,
            _ => default,
        }
    }

    /// `Ok` if it may act for `requester`, else the 403 that says so.
    pub fn check_acts_for(&self, requester: &str) -> Result<(), ApiError> {
        if self.may_act_for(requester) {
            return Ok(());
        }
        Err(ApiError::new(
            ErrorCode::Forbidden,
            format!(
                "key `{}` may not act for requester `{requester}`",
                self.name
            ),
        ))
    }

    /// `Ok` if a task may run on `device` (whose capabilities are given when
    /// [`Caller::needs_capabilities_of`] asked for them), or, without a device, wherever its
    /// `required` capabilities place it; else the 403 that says so.
    pub fn check_target(
        &self,
        device: Option<&str>,
        required: &[String],
        device_capabilities: Option<&[String]>,
    ) -> Result<(), ApiError> {
        let Some(targets) = self.targets() else {
            return Ok(());
        };
        let allowed = match device {
            Some(device) => {
                targets.allows_id(device)
                    || device_capabilities.is_some_and(|c| targets.allows_capabilities(c))
            }
            None => targets.covers_required(required),
        };
        if allowed {
            return Ok(());
        }
        let detail = match device {
            Some(device) => format!("key `{}` may not target device `{device}`", self.name),
            None if targets.by_capability() => format!(
                "key `{}` may target only the devices it names or its capabilities: give \
                 target_id, or require one of its target capabilities",
                self.name
            ),
            None => format!(
                "key `{}` may target only the devices it names: give target_id",
                self.name
            ),
        };
        Err(ApiError::new(ErrorCode::Forbidden, detail))
    }
}

/// The caller is an extractor: what [`require`] found (an operator when no keys are set).
impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(parts
            .extensions
            .get::<Arc<Caller>>()
            .map(|caller| Caller::clone(caller))
            .unwrap_or_else(Caller::anonymous))
    }
}

/// Why a principals file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum PrincipalsError {
    /// The file could not be read.
    #[error("cannot read principals file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid.
    #[error("invalid principals file {path}: {message}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PrincipalsFile {
    #[serde(default)]
    principal: Vec<PrincipalEntry>,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum ScopeName {
    #[default]
    Requester,
    Operator,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PrincipalEntry {
    name: String,
    key_sha256: String,
    #[serde(default)]
    scope: ScopeName,
    acts_for: Option<Vec<String>>,
    targets: Option<Vec<String>>,
    max_live_tasks: Option<usize>,
    max_priority: Option<i32>,
}

impl PrincipalEntry {
    fn into_caller(self) -> Result<([u8; 32], Caller), String> {
        let name = self.name.trim().to_owned();
        if name.is_empty() {
            return Err("a principal's name must not be empty".to_owned());
        }
        let digest = parse_digest(&self.key_sha256).ok_or_else(|| {
            format!("principal `{name}`: key_sha256 must be 64 hex digits (the sha256 of the key)")
        })?;
        let limited = self.acts_for.is_some()
            || self.targets.is_some()
            || self.max_live_tasks.is_some()
            || self.max_priority.is_some();
        let scope = match self.scope {
            ScopeName::Operator if limited => {
                return Err(format!(
                    "principal `{name}`: an operator acts for everyone; acts_for, targets, \
                     max_live_tasks and max_priority are for scope \"requester\""
                ));
            }
            ScopeName::Operator => Scope::Operator,
            ScopeName::Requester => {
                if let Some(list) = &self.acts_for
                    && (list.is_empty() || list.iter().any(|p| p.trim().is_empty()))
                {
                    return Err(format!(
                        "principal `{name}`: acts_for must not be empty or hold an empty \
                         entry (leave it out for the default)"
                    ));
                }
                let targets = match &self.targets {
                    None => None,
                    Some(list) => {
                        Some(Targets::parse(list).map_err(|e| format!("principal `{name}`: {e}"))?)
                    }
                };
                if self.max_live_tasks == Some(0) {
                    return Err(format!(
                        "principal `{name}`: max_live_tasks must be at least 1"
                    ));
                }
                Scope::Limited(Limits {
                    acts_for: self.acts_for.unwrap_or_else(|| vec![name.clone()]),
                    targets,
                    max_live_tasks: self.max_live_tasks,
                    max_priority: self.max_priority,
                })
            }
        };
        Ok((digest, Caller { name, scope }))
    }
}

/// 64 hex digits as the 32 bytes of a sha256.
fn parse_digest(text: &str) -> Option<[u8; 32]> {
    let text = text.trim().as_bytes();
    if text.len() != 64 {
        return None;
    }
    let mut digest = [0u8; 32];
    for (byte, pair) in digest.iter_mut().zip(text.chunks_exact(2)) {
        let pair = std::str::from_utf8(pair).ok()?;
        *byte = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(digest)
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
    /// Accepts these keys, each an operator; none means every request is let through.
    pub fn new<S: AsRef<str>>(keys: &[S]) -> Self {
        let operator = Arc::new(Caller::operator("api-key"));
        ApiKeys {
            keys: Arc::new(
                keys.iter()
                    .map(|k| (digest(k.as_ref()), operator.clone()))
                    .collect(),
            ),
        }
    }

    /// Accepts `keys` (operators) and the principals of the TOML file at `path`, if any.
    pub fn load<S: AsRef<str>>(keys: &[S], path: Option<&Path>) -> Result<Self, PrincipalsError> {
        let Some(path) = path else {
            return Ok(Self::new(keys));
        };
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| PrincipalsError::Read {
            path: shown.clone(),
            source,
        })?;
        Self::with_principals(keys, &text).map_err(|message| PrincipalsError::Invalid {
            path: shown,
            message,
        })
    }

    /// Accepts `keys` (operators) and the principals of `toml` text.
    pub fn with_principals<S: AsRef<str>>(keys: &[S], toml: &str) -> Result<Self, String> {
        let file: PrincipalsFile = config::Config::builder()
            .add_source(config::File::from_str(toml, config::FileFormat::Toml))
            .build()
            .and_then(config::Config::try_deserialize)
            .map_err(|e| e.to_string())?;
        let mut all = Self::new(keys).keys.as_ref().clone();
        for entry in file.principal {
            let (digest, caller) = entry.into_caller()?;
            if all.iter().any(|(_, c)| c.name == caller.name) {
                return Err(format!(
                    "principal `{}` is listed twice: names must be unique",
                    caller.name
                ));
            }
            if all.iter().any(|(d, _)| d == &digest) {
                return Err(format!(
                    "principal `{}`: its key is already another principal's or an api_keys entry",
                    caller.name
                ));
            }
            all.push((digest, Arc::new(caller)));
        }
        Ok(ApiKeys {
            keys: Arc::new(all),
        })
    }

    /// Whether keys are required.
    pub fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    /// The caller a request's headers name.
    pub fn check(&self, headers: &HeaderMap) -> Result<Arc<Caller>, ApiKeyError> {
        if !self.enabled() {
            return Ok(Arc::new(Caller::anonymous()));
        }
        let presented = digest(presented_key(headers)?);
        // Every entry is compared, so the time taken does not tell which one matched.
        let matched = self.keys.iter().fold(None, |found, (d, caller)| {
            if constant_time_eq(d, &presented) {
                Some(caller)
            } else {
                found
            }
        });
        matched.cloned().ok_or(ApiKeyError::Invalid)
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

/// The sha256 of a key, hex, as a principals file's `key_sha256` holds it.
pub fn key_sha256(key: &str) -> String {
    digest(key).iter().map(|b| format!("{b:02x}")).collect()
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
    let caller = keys.check(request.headers())?;
    let mut request = request;
    request.extensions_mut().insert(caller);
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
