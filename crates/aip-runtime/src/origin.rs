//! Which web pages may reach a listener: the Origin and Host policy of `/ws` and the REST API.
//!
//! Browsers send `Origin` with every WebSocket handshake and every cross-site POST; the
//! clients this broker serves (UFO's and Galaxy's Python clients, `aip`, scripts) send none.
//! So a request with an `Origin` is refused unless that origin is allowed (`allowed_origins`,
//! `*` for any): a page the developer visits cannot open `/ws` or post to `/api/*` on a broker
//! that runs without authentication on loopback (the `aip dev` default).
//!
//! A page can still reach a loopback listener by DNS rebinding (its own name resolving to
//! 127.0.0.1, so the browser treats the broker as same-origin and sends no `Origin` on a GET).
//! Its requests then carry its own name as `Host`: a loopback listener answers only to
//! loopback names (`localhost`, `*.localhost`, `127.0.0.1`, `[::1]`) and the hosts of the
//! allowed origins.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use proto_schemas::ErrorCode;

use crate::api_error::ApiError;

/// The policy of one listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OriginPolicy {
    /// Allowed origins, lower case, without a trailing `/`; `*` allows any.
    allowed: Vec<String>,
    /// Whether the listener is on a loopback address (then `Host` is checked too).
    loopback: bool,
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OriginRefusal {
    #[error(
        "cross-origin request refused: Origin '{0}' is not allowed (add it to allowed_origins)"
    )]
    Origin(String),
    #[error(
        "Host '{0}' refused: this loopback listener answers only to localhost names (a defence \
         against DNS rebinding); add the origin you use to allowed_origins"
    )]
    Host(String),
}

impl OriginPolicy {
    /// The policy of a listener on `listen` with the configured `allowed_origins`.
    pub fn new<S: AsRef<str>>(allowed_origins: &[S], listen: SocketAddr) -> Self {
        OriginPolicy {
            allowed: allowed_origins
                .iter()
                .map(|o| normalize(o.as_ref()))
                .filter(|o| !o.is_empty())
                .collect(),
            loopback: listen.ip().is_loopback(),
        }
    }

    fn allows_any(&self) -> bool {
        self.allowed.iter().any(|o| o == "*")
    }

    /// Checks a request's headers.
    pub fn check(&self, headers: &HeaderMap) -> Result<(), OriginRefusal> {
        if self.allows_any() {
            return Ok(());
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let origin = String::from_utf8_lossy(origin.as_bytes()).into_owned();
            if !self.allowed.contains(&normalize(&origin)) {
                return Err(OriginRefusal::Origin(origin));
            }
        }
        if self.loopback
            && let Some(host) = headers.get(header::HOST)
        {
            let host = String::from_utf8_lossy(host.as_bytes()).into_owned();
            let name = host_name(&host);
            if !is_loopback_name(&name)
                && !self.allowed.iter().any(|o| host_name_of_origin(o) == name)
            {
                return Err(OriginRefusal::Host(host));
            }
        }
        Ok(())
    }
}

/// An origin as compared: lower case, no trailing `/`.
fn normalize(origin: &str) -> String {
    origin.trim().trim_end_matches('/').to_ascii_lowercase()
}

/// The name part of a `Host` header (`[::1]:5000` → `::1`, `Localhost:5000` → `localhost`).
fn host_name(host: &str) -> String {
    let host = host.trim().to_ascii_lowercase();
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or_default().to_owned();
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.chars().all(|c| c.is_ascii_digit()) => name.to_owned(),
        _ => host,
    }
}

/// The host name of an allowed origin (`https://app.example:8443` → `app.example`).
fn host_name_of_origin(origin: &str) -> String {
    let rest = origin.split_once("://").map_or(origin, |(_, rest)| rest);
    host_name(rest.split('/').next().unwrap_or_default())
}

fn is_loopback_name(name: &str) -> bool {
    name == "localhost"
        || name.ends_with(".localhost")
        || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Middleware: refuses a request the policy does not allow with 403 `FORBIDDEN`.
pub async fn guard(
    State(policy): State<Arc<OriginPolicy>>,
    request: Request,
    next: Next,
) -> Response {
    match policy.check(request.headers()) {
        Ok(()) => next.run(request).await,
        Err(refusal) => ApiError::new(ErrorCode::Forbidden, refusal.to_string()).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn headers(pairs: &[(header::HeaderName, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(name.clone(), HeaderValue::from_str(value).expect("value"));
        }
        map
    }

    fn loopback(allowed: &[&str]) -> OriginPolicy {
        OriginPolicy::new(allowed, "127.0.0.1:5000".parse().expect("addr"))
    }

    #[test]
    fn clients_without_an_origin_pass() {
        let policy = loopback(&[]);
        assert_eq!(
            policy.check(&headers(&[(header::HOST, "127.0.0.1:5000")])),
            Ok(())
        );
        assert_eq!(
            policy.check(&headers(&[(header::HOST, "localhost:5000")])),
            Ok(())
        );
        assert_eq!(
            policy.check(&headers(&[(header::HOST, "[::1]:5000")])),
            Ok(())
        );
        assert_eq!(policy.check(&HeaderMap::new()), Ok(()));
    }

    #[test]
    fn a_page_of_another_site_is_refused() {
        let policy = loopback(&[]);
        let refused = policy.check(&headers(&[
            (header::HOST, "127.0.0.1:5000"),
            (header::ORIGIN, "https://evil.example"),
        ]));
        assert_eq!(
            refused,
            Err(OriginRefusal::Origin("https://evil.example".into()))
        );
        // A sandboxed page's origin is `null`.
        assert!(policy.check(&headers(&[(header::ORIGIN, "null")])).is_err());
    }

    #[test]
    fn dns_rebinding_is_refused_by_its_host() {
        let policy = loopback(&[]);
        assert_eq!(
            policy.check(&headers(&[(header::HOST, "rebind.evil.example:5000")])),
            Err(OriginRefusal::Host("rebind.evil.example:5000".into()))
        );
        // Off loopback (where authentication is required) the host is not checked.
        let public = OriginPolicy::new::<&str>(&[], "0.0.0.0:5000".parse().expect("addr"));
        assert_eq!(
            public.check(&headers(&[(header::HOST, "broker.example:5000")])),
            Ok(())
        );
    }

    #[test]
    fn allowed_origins_pass_with_their_host() {
        let policy = loopback(&["https://Console.Example:8443/"]);
        assert_eq!(
            policy.check(&headers(&[
                (header::HOST, "console.example:8443"),
                (header::ORIGIN, "https://console.example:8443"),
            ])),
            Ok(())
        );
        let any = loopback(&["*"]);
        assert_eq!(
            any.check(&headers(&[
                (header::HOST, "x.example"),
                (header::ORIGIN, "https://x.example"),
            ])),
            Ok(())
        );
    }
}
