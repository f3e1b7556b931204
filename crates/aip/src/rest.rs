//! The broker's REST API as the client commands use it, with errors that say what to do.

use std::time::Duration;

use proto_schemas::ErrorBody;
use reqwest::StatusCode;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::cli::RestArgs;

/// Why a REST call failed.
#[derive(Debug, thiserror::Error)]
pub enum RestError {
    /// Nothing answered at the address.
    #[error(
        "cannot reach the broker at {base} ({reason}): it is not running there. Start it with \
         `aip dev` (or `cargo run -p aip -- dev`) in another terminal, or point --rest / AIP_REST \
         at a running broker"
    )]
    Unreachable {
        /// The base URL.
        base: String,
        /// What the connection attempt said.
        reason: String,
    },
    /// The broker answered with an error body.
    #[error("the broker refused: {body}{}", hint(*status))]
    Refused {
        /// The HTTP status.
        status: StatusCode,
        /// Its `{"detail", "error_code"}` body.
        body: ErrorBody,
    },
    /// The broker answered something this command does not understand.
    #[error("unexpected answer from {url}: HTTP {status}: {text}")]
    Unexpected {
        /// The URL called.
        url: String,
        /// The HTTP status.
        status: StatusCode,
        /// The beginning of the body.
        text: String,
    },
    /// The base URL is not usable.
    #[error("invalid --rest URL `{0}`: expected e.g. http://127.0.0.1:5000")]
    InvalidBase(String),
    /// Any other transport failure.
    #[error("request to {url} failed: {reason}")]
    Transport {
        /// The URL called.
        url: String,
        /// What went wrong.
        reason: String,
    },
}

fn hint(status: StatusCode) -> &'static str {
    if status == StatusCode::UNAUTHORIZED {
        ". Pass the broker's key with --api-key or AIP_API_KEY"
    } else {
        ""
    }
}

/// The text of an error and its causes, innermost last (`connection refused`).
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut reason = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !reason.contains(&text) {
            reason = format!("{reason}: {text}");
        }
        source = cause.source();
    }
    reason
}

/// A client of one broker.
#[derive(Debug, Clone)]
pub struct Broker {
    http: reqwest::Client,
    base: String,
    api_key: Option<String>,
}

impl Broker {
    /// A client for `--rest` with `--api-key`.
    pub fn new(args: &RestArgs) -> Result<Self, RestError> {
        let base = args.rest.trim_end_matches('/').to_owned();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(RestError::InvalidBase(args.rest.clone()));
        }
        // The TLS provider is the process's; a library caller (or a test) may not have set it.
        aip_runtime::install_crypto_provider();
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| RestError::Transport {
                url: base.clone(),
                reason: chain(&e),
            })?;
        Ok(Broker {
            http,
            base,
            api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        })
    }

    /// The base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn with_key(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.api_key {
            Some(key) => request.header("X-API-Key", key),
            None => request,
        }
    }

    fn transport_error(&self, url: &str, e: reqwest::Error) -> RestError {
        if e.is_connect() {
            RestError::Unreachable {
                base: self.base.clone(),
                reason: innermost(&e).unwrap_or_else(|| "connection failed".to_owned()),
            }
        } else {
            RestError::Transport {
                url: url.to_owned(),
                reason: chain(&e),
            }
        }
    }

    /// Sends a request; a non-2xx answer becomes an error.
    async fn send(
        &self,
        url: &str,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, RestError> {
        let response = self
            .with_key(request)
            .send()
            .await
            .map_err(|e| self.transport_error(url, e))?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let text = response.text().await.unwrap_or_default();
        Err(match serde_json::from_str::<ErrorBody>(&text) {
            Ok(body) => RestError::Refused { status, body },
            Err(_) => RestError::Unexpected {
                url: url.to_owned(),
                status,
                text: text.chars().take(300).collect(),
            },
        })
    }

    async fn decode<T: DeserializeOwned>(
        url: &str,
        response: reqwest::Response,
    ) -> Result<T, RestError> {
        let status = response.status();
        let bytes = response.bytes().await.map_err(|e| RestError::Transport {
            url: url.to_owned(),
            reason: chain(&e),
        })?;
        serde_json::from_slice(&bytes).map_err(|e| RestError::Unexpected {
            url: url.to_owned(),
            status,
            text: format!(
                "{e}: {}",
                String::from_utf8_lossy(&bytes)
                    .chars()
                    .take(300)
                    .collect::<String>()
            ),
        })
    }

    /// `GET path` with a query, decoded.
    pub async fn get<T: DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, String)],
    ) -> Result<T, RestError> {
        let url = with_query(&self.url(path), query);
        let response = self.send(&url, self.http.get(&url)).await?;
        Self::decode(&url, response).await
    }

    /// `POST path` with a JSON body, decoded.
    pub async fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T, RestError> {
        let url = self.url(path);
        let response = self.send(&url, self.http.post(&url).json(body)).await?;
        Self::decode(&url, response).await
    }

    /// Opens a task's Server-Sent Events stream after sequence number `after`.
    pub async fn event_stream(
        &self,
        task_id: &str,
        after: i64,
    ) -> Result<reqwest::Response, RestError> {
        let url = with_query(
            &self.url(&format!(
                "/api/tasks/{}/events/stream",
                path_segment(task_id)
            )),
            &[("after", after.to_string())],
        );
        let request = self.http.get(&url).header("Accept", "text/event-stream");
        self.send(&url, request).await
    }
}

/// The innermost cause's text (`Connection refused (os error 111)`).
fn innermost(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut source = error.source();
    let mut last = None;
    while let Some(cause) = source {
        last = Some(cause.to_string());
        source = cause.source();
    }
    last
}

/// Percent-encodes an id for one path segment (task ids may contain `@`, `/`, spaces).
pub fn path_segment(id: &str) -> String {
    id.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// `url?k=v&…` with keys and values percent-encoded.
pub fn with_query(url: &str, query: &[(&str, String)]) -> String {
    if query.is_empty() {
        return url.to_owned();
    }
    let pairs: Vec<String> = query
        .iter()
        .map(|(k, v)| format!("{}={}", path_segment(k), path_segment(v)))
        .collect();
    format!("{url}?{}", pairs.join("&"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_are_encoded() {
        assert_eq!(with_query("http://h/x", &[]), "http://h/x");
        assert_eq!(
            with_query(
                "http://h/x",
                &[("state", "a b".into()), ("limit", "5".into())]
            ),
            "http://h/x?state=a%20b&limit=5"
        );
    }

    #[test]
    fn ids_are_encoded_for_paths() {
        assert_eq!(path_segment("demo@task-1"), "demo%40task-1");
        assert_eq!(path_segment("a/b c"), "a%2Fb%20c");
        assert_eq!(path_segment("0193abc"), "0193abc");
    }

    #[tokio::test]
    async fn an_absent_broker_is_reported_with_how_to_start_it() {
        // Bind and drop a listener: its port is (almost certainly) closed now.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let broker = Broker::new(&RestArgs {
            rest: format!("http://127.0.0.1:{port}"),
            api_key: None,
        })
        .expect("valid base");
        let err = broker
            .get::<serde_json::Value>("/api/tasks", &[])
            .await
            .expect_err("nothing listens");
        assert!(matches!(err, RestError::Unreachable { .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains("not running"), "{text}");
        assert!(text.contains("aip dev"), "{text}");
    }

    #[test]
    fn bases_must_be_http() {
        let err = Broker::new(&RestArgs {
            rest: "localhost:5000".into(),
            api_key: None,
        })
        .expect_err("no scheme");
        assert!(matches!(err, RestError::InvalidBase(_)));
    }
}
