//! The WebSocket opening handshake (RFC 6455, section 4.2), answered by the gateway.
//!
//! The socket it yields is the upgraded connection itself: [`crate::websocket`] reads and
//! writes its frames (axum's `WebSocket` and the library under it keep a large message's
//! buffer for the rest of the connection, and copy every message they write).

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use proto_schemas::{ErrorBody, ErrorCode};
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;

/// An upgraded connection, on which WebSocket frames follow.
pub type Socket = TokioIo<hyper::upgrade::Upgraded>;

/// A request to open a WebSocket, checked: answer it with [`Upgrade::accept`].
pub struct Upgrade {
    accept: HeaderValue,
    on_upgrade: OnUpgrade,
}

/// Why a request to `/ws` is not a WebSocket handshake.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NotAHandshake {
    #[error("a WebSocket handshake is a GET request")]
    NotGet,
    #[error("the `Connection` header does not include `upgrade`")]
    NoConnectionUpgrade,
    #[error("the `Upgrade` header is not `websocket`")]
    NotWebsocket,
    #[error("the `Sec-WebSocket-Version` header is not 13")]
    WrongVersion,
    #[error("the `Sec-WebSocket-Key` header is missing")]
    NoKey,
    #[error("this connection cannot be upgraded (HTTP/1.1 is needed)")]
    NotUpgradable,
}

impl IntoResponse for NotAHandshake {
    fn into_response(self) -> Response {
        let status = match self {
            NotAHandshake::NotGet => StatusCode::METHOD_NOT_ALLOWED,
            NotAHandshake::NotUpgradable => StatusCode::UPGRADE_REQUIRED,
            _ => StatusCode::BAD_REQUEST,
        };
        let body = ErrorBody::new(ErrorCode::ProtocolError, self.to_string());
        (status, axum::Json(body)).into_response()
    }
}

/// Whether a comma-separated header holds `token` (case-insensitively), as `Connection` and
/// `Upgrade` may list several.
fn lists(headers: &HeaderMap, name: header::HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|item| item.trim().eq_ignore_ascii_case(token))
}

impl Upgrade {
    /// Checks a request's handshake headers.
    pub fn check(method: &Method, headers: &HeaderMap) -> Result<HeaderValue, NotAHandshake> {
        if method != Method::GET {
            return Err(NotAHandshake::NotGet);
        }
        if !lists(headers, header::CONNECTION, "upgrade") {
            return Err(NotAHandshake::NoConnectionUpgrade);
        }
        if !lists(headers, header::UPGRADE, "websocket") {
            return Err(NotAHandshake::NotWebsocket);
        }
        if headers
            .get(header::SEC_WEBSOCKET_VERSION)
            .map(HeaderValue::as_bytes)
            != Some(b"13")
        {
            return Err(NotAHandshake::WrongVersion);
        }
        let key = headers
            .get(header::SEC_WEBSOCKET_KEY)
            .ok_or(NotAHandshake::NoKey)?;
        HeaderValue::from_str(&derive_accept_key(key.as_bytes())).map_err(|_| NotAHandshake::NoKey)
    }

    /// Answers the handshake (`101 Switching Protocols`) and, once the connection is
    /// upgraded, hands its socket to `serve` in a task of its own.
    pub fn accept<F, Fut>(self, serve: F) -> Response
    where
        F: FnOnce(Socket) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let Upgrade { accept, on_upgrade } = self;
        tokio::spawn(async move {
            match on_upgrade.await {
                Ok(upgraded) => serve(TokioIo::new(upgraded)).await,
                Err(e) => tracing::debug!("the WebSocket upgrade did not complete: {e}"),
            }
        });
        (
            StatusCode::SWITCHING_PROTOCOLS,
            [
                (header::CONNECTION, HeaderValue::from_static("upgrade")),
                (header::UPGRADE, HeaderValue::from_static("websocket")),
                (header::SEC_WEBSOCKET_ACCEPT, accept),
            ],
        )
            .into_response()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Upgrade {
    type Rejection = NotAHandshake;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let accept = Self::check(&parts.method, &parts.headers)?;
        let on_upgrade = parts
            .extensions
            .remove::<OnUpgrade>()
            .ok_or(NotAHandshake::NotUpgradable)?;
        Ok(Upgrade { accept, on_upgrade })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handshake(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(*name, HeaderValue::from_static(value));
        }
        headers
    }

    const GOOD: [(&str, &str); 4] = [
        ("connection", "keep-alive, Upgrade"),
        ("upgrade", "WebSocket"),
        ("sec-websocket-version", "13"),
        ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
    ];

    #[test]
    fn a_handshake_is_answered_with_the_key_rfc_6455_derives() {
        let accept = Upgrade::check(&Method::GET, &handshake(&GOOD)).expect("a handshake");
        // RFC 6455, section 1.3's example.
        assert_eq!(accept, "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=");
    }

    #[test]
    fn a_request_that_is_not_a_handshake_is_told_why() {
        assert_eq!(
            Upgrade::check(&Method::POST, &handshake(&GOOD)),
            Err(NotAHandshake::NotGet)
        );
        for (skip, problem) in [
            (0, NotAHandshake::NoConnectionUpgrade),
            (1, NotAHandshake::NotWebsocket),
            (2, NotAHandshake::WrongVersion),
            (3, NotAHandshake::NoKey),
        ] {
            let pairs: Vec<_> = GOOD
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != skip)
                .map(|(_, pair)| *pair)
                .collect();
            assert_eq!(
                Upgrade::check(&Method::GET, &handshake(&pairs)),
                Err(problem)
            );
        }
        let mut old = GOOD;
        old[2] = ("sec-websocket-version", "8");
        assert_eq!(
            Upgrade::check(&Method::GET, &handshake(&old)),
            Err(NotAHandshake::WrongVersion)
        );
    }
}
