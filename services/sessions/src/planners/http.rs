//! The HTTP planner: each [`PlanRequest`] is POSTed as JSON to a configured URL, and the answer
//! is a PlanReply (`{"ok": PlanStep}` or `{"error": ErrorBody}`), as on NATS.
//!
//! With a secret, every request is signed as Standard Webhooks sign (`webhook-id`:
//! `<task_id>:<step>`, the same on every attempt so the planner can drop repeats;
//! `webhook-timestamp`; `webhook-signature`). A connection error, a timeout, 429 or a 5xx is
//! tried again, waiting longer each time, up to the configured number of attempts; any other
//! answer is final.

use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use proto_schemas::ErrorBody;
use proto_schemas::ErrorCode;
use proto_schemas::registry::Reply;
use proto_schemas::sessions::{PlanRequest, PlanStep};
use reqwest::StatusCode;
use standardwebhooks::Webhook;

use super::PlannerError;

/// The longest wait between two attempts.
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(2);
const MIN_RETRY_DELAY: Duration = Duration::from_millis(200);
/// Bytes of a refusal's body quoted in the task's error.
const QUOTED_BODY_BYTES: usize = 500;

/// A planner behind an HTTP URL.
pub struct HttpPlanner {
    client: reqwest::Client,
    url: reqwest::Url,
    signer: Option<Webhook>,
    attempts: usize,
}

impl HttpPlanner {
    /// Checks the URL and the secret.
    pub fn new(
        url: &str,
        secret: Option<&str>,
        timeout: Duration,
        attempts: u32,
    ) -> Result<Self, String> {
        let url = parse_http_url(url).map_err(|e| format!("[sessions.planner] url: {e}"))?;
        let signer = secret
            .map(|s| {
                Webhook::new(s).map_err(|e| {
                    format!("[sessions.planner] secret must be `whsec_` and base64: {e}")
                })
            })
            .transpose()?;
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| format!("cannot build the HTTP planner's client: {e}"))?;
        Ok(HttpPlanner {
            client,
            url,
            signer,
            attempts: usize::try_from(attempts.max(1)).unwrap_or(1),
        })
    }

    /// Where it is.
    pub fn url(&self) -> &str {
        self.url.as_str()
    }

    /// Asks for one step.
    pub async fn ask(&self, request: &PlanRequest) -> Result<PlanStep, PlannerError> {
        let body = serde_json::to_vec(request).map_err(PlannerError::Encode)?;
        let id = format!("{}:{}", request.task_id, request.step);
        let send = || self.send(&id, &body);
        let retry = ExponentialBuilder::default()
            .with_min_delay(MIN_RETRY_DELAY)
            .with_max_delay(MAX_RETRY_DELAY)
            .with_max_times(self.attempts - 1);
        let reply = send
            .retry(retry)
            .when(Attempt::worth_retrying)
            .notify(|e, wait| {
                tracing::warn!(task = %request.task_id, step = request.step, ?wait, "the HTTP planner failed, trying again: {e}");
            })
            .await
            .map_err(Attempt::into_error)?;
        serde_json::from_slice::<Reply<PlanStep>>(&reply)
            .map_err(|e| PlannerError::BadReply(e.to_string()))?
            .into_result()
            .map_err(PlannerError::Refused)
    }

    async fn send(&self, id: &str, body: &[u8]) -> Result<bytes::Bytes, Attempt> {
        let mut post = self
            .client
            .post(self.url.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_vec());
        if let Some(signer) = &self.signer {
            let timestamp = chrono::Utc::now().timestamp();
            let signature = signer
                .sign(id, timestamp, body)
                .map_err(|e| Attempt::Final(PlannerError::NoAnswer(e.to_string())))?;
            post = post
                .header(standardwebhooks::HEADER_WEBHOOK_ID, id)
                .header(
                    standardwebhooks::HEADER_WEBHOOK_TIMESTAMP,
                    timestamp.to_string(),
                )
                .header(standardwebhooks::HEADER_WEBHOOK_SIGNATURE, signature);
        }
        let response = post
            .send()
            .await
            .map_err(|e| Attempt::Again(e.to_string()))?;
        let status = response.status();
        let body = response
            .bytes()
            .await
            .map_err(|e| Attempt::Again(e.to_string()))?;
        if status.is_success() {
            return Ok(body);
        }
        if status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error() {
            return Err(Attempt::Again(format!("HTTP {status}: {}", quote(&body))));
        }
        // A refusal in the PlanReply shape keeps its code; anything else is quoted.
        let refusal = match serde_json::from_slice::<Reply<PlanStep>>(&body) {
            Ok(Reply::Error(error)) => error,
            _ => ErrorBody::new(
                ErrorCode::CommandFailed,
                format!("HTTP {status}: {}", quote(&body)),
            ),
        };
        Err(Attempt::Final(PlannerError::Refused(refusal)))
    }
}

/// The outcome of one failed attempt.
#[derive(Debug, thiserror::Error)]
enum Attempt {
    /// Worth trying again.
    #[error("{0}")]
    Again(String),
    /// Trying again would not help.
    #[error("{0}")]
    Final(PlannerError),
}

impl Attempt {
    fn worth_retrying(&self) -> bool {
        matches!(self, Attempt::Again(_))
    }

    fn into_error(self) -> PlannerError {
        match self {
            Attempt::Again(why) => PlannerError::NoAnswer(why),
            Attempt::Final(error) => error,
        }
    }
}

/// An `http` or `https` URL with a host.
pub fn parse_http_url(url: &str) -> Result<reqwest::Url, String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("{url:?} is not a URL: {e}"))?;
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host().is_none() {
        return Err(format!("{url:?} is not an http(s) URL with a host"));
    }
    Ok(parsed)
}

/// The start of a body, as text, for an error message.
pub fn quote(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let mut end = text.len().min(QUOTED_BODY_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let cut = if end < text.len() { "…" } else { "" };
    format!("{}{cut}", text[..end].trim())
}
