//! Callbacks: a task's requester told of its end over HTTP, durably.
//!
//! When a task with a `callback_url` ends, the leader writes a CallbackNotification into
//! `task_callbacks` in the same group commit as the state change ([`notification`]), so a
//! crash cannot lose it. The leading replica's worker ([`run_callbacks`]) claims due callbacks,
//! POSTs them, and settles each attempt in the delivery log:
//! - signed as Standard Webhooks sign (`webhook-id` = `<task_id>:<event seq>`, the same on every
//!   attempt so a receiver drops repeats; `webhook-timestamp`; `webhook-signature` with one
//!   `v1,` signature per configured secret, for key rotation);
//! - a 2xx delivers it; 410 stops (`gone`); anything else is tried again after an exponential
//!   backoff with jitter, or the receiver's `Retry-After` if longer, up to the configured
//!   attempts, then the callback is dead-lettered (`dead`); `POST
//!   /api/tasks/{id}/callbacks/redeliver` queues it again;
//! - only to public addresses unless `callback_allow_private` is set: the URL is checked when
//!   the task is submitted, and every address its host resolves to is checked again when it
//!   is delivered (so a name that later points inward is refused too); redirects are not
//!   followed.
//!
//! Delivery is at least once: a receiver that accepts a callback just as the service dies may
//! get it again after the restart, with the same `webhook-id`.
//!
//! A task may name an agent instead of a URL (`callback_agent`): its notifications go to that
//! agent as `callback` frames when it is connected and announced the `callback` extension, and
//! wait while it is not (looked at again every claim period, for at most
//! [`AGENT_WAIT_MS`]); a frame counts as delivered once the agent's gateway acknowledges writing
//! it.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use proto_schemas::V1;
use proto_schemas::flow::{CallbackNotification, CallbackStatus};
use proto_schemas::sessions::TaskState;
use reqwest::StatusCode;
use standardwebhooks::Webhook;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::engine::Engine;
use crate::settings::SessionSettings;
use crate::store::{DueCallback, NewCallback, Settled, now_ms};
use crate::task::Task;

/// The form of a callback URL, checked on submission and published in the OpenAPI document:
/// `http` or `https`, a host name (labels of letters, digits and `-`, the last starting with a
/// letter) or a dotted IPv4 address, an optional port (1 to 65535), an optional path and query
/// of URL characters. No user info, no fragment, no IPv6 literal.
pub const CALLBACK_URL_PATTERN: &str = concat!(
    r"^https?://",
    r"(([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*[A-Za-z]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?",
    r"|((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9]))",
    r"(:(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3}))?",
    r"(/[A-Za-z0-9._~!$&'()*+,;=:@%/-]*)?",
    r"(\?[A-Za-z0-9._~!$&'()*+,;=:@%/?-]*)?$",
);

/// [`CALLBACK_URL_PATTERN`], compiled (a unit test keeps it compiling; were it not, every
/// URL would be refused, and the error logged).
static CALLBACK_URL: std::sync::LazyLock<Option<regex::Regex>> = std::sync::LazyLock::new(|| {
    regex::Regex::new(CALLBACK_URL_PATTERN)
        .inspect_err(|e| tracing::error!("the callback URL pattern does not compile: {e}"))
        .ok()
});

/// Where a task's callbacks go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallbackTarget {
    /// POSTed to this http(s) URL.
    Url(String),
    /// Sent to this agent as `callback` frames.
    Agent(String),
}

/// How an agent target is stored (a URL never starts with it).
const AGENT_PREFIX: &str = "agent:";

/// How long a callback waits for its agent to connect before it is dead-lettered.
pub const AGENT_WAIT_MS: i64 = 24 * 3600 * 1000;

impl CallbackTarget {
    /// The stored text: the URL, or `agent:<id>`.
    pub fn stored(&self) -> String {
        match self {
            CallbackTarget::Url(url) => url.clone(),
            CallbackTarget::Agent(id) => format!("{AGENT_PREFIX}{id}"),
        }
    }

    /// From the stored text.
    pub fn from_stored(text: &str) -> Self {
        match text.strip_prefix(AGENT_PREFIX) {
            Some(id) => CallbackTarget::Agent(id.to_owned()),
            None => CallbackTarget::Url(text.to_owned()),
        }
    }

    /// What a CallbackNotification's `sent_to` says: the URL or the agent id.
    pub fn shown(&self) -> &str {
        match self {
            CallbackTarget::Url(target) | CallbackTarget::Agent(target) => target,
        }
    }
}

/// How often the worker looks for due callbacks.
const SWEEP: Duration = Duration::from_millis(200);
/// Callbacks claimed at once.
const CLAIM_BATCH: i64 = 64;
/// Deliveries in flight at once.
const CONCURRENCY: usize = 32;
/// A claim outlasts an attempt's timeout by this much.
const CLAIM_MARGIN_MS: i64 = 5_000;
/// Bytes of an error body kept in the delivery log.
const QUOTED_BODY_BYTES: usize = 200;

/// The callback of a task's change (its end, or a question for its requester), if it has a
/// callback URL: written with the event whose sequence number is `seq`.
pub fn notification(task: &Task, seq: i64) -> Option<NewCallback> {
    let target = task.callback_url.clone()?;
    let state = task.state();
    let status = match state {
        TaskState::Completed => CallbackStatus::Complete,
        s if s.is_terminal() => CallbackStatus::Failed,
        _ => CallbackStatus::InProgress,
    };
    let payload = CallbackNotification {
        version: V1,
        task_id: task.task_id.clone(),
        result: task.result_value(),
        status,
        sent_to: CallbackTarget::from_stored(&target).shown().to_owned(),
        state: Some(state),
        error: task.error.as_ref().map(|e| e.detail.clone()),
        clarification: task.waiting.question().map(|q| q.request(&task.task_id)),
    };
    let payload = match serde_json::to_string(&payload) {
        Ok(payload) => payload,
        Err(e) => {
            tracing::error!(task = %task.task_id, "the callback cannot be encoded, not sent: {e}");
            return None;
        }
    };
    Some(NewCallback {
        callback_id: format!("{}:{seq}", task.task_id),
        task_id: task.task_id.clone(),
        target,
        payload,
    })
}

/// The delivery side: the HTTP client, the signers and the rules.
pub struct Callbacks {
    client: reqwest::Client,
    signers: Vec<Webhook>,
    allow_private: bool,
    max_attempts: i32,
    timeout_ms: i64,
    backoff: Duration,
    max_backoff: Duration,
}

impl Callbacks {
    /// Checks the settings and builds the client.
    pub fn new(settings: &SessionSettings) -> Result<Self, String> {
        aip_runtime::install_crypto_provider();
        let signers = settings
            .callback_secret
            .iter()
            .filter(|s| !s.trim().is_empty())
            .map(|secret| {
                Webhook::new(secret.trim()).map_err(|e| {
                    format!("callback_secret must be `whsec_` and base64 (each of a list): {e}")
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        if settings.callback_max_attempts == 0 || settings.callback_timeout_ms == 0 {
            return Err("callback_max_attempts and callback_timeout_ms must be at least 1".into());
        }
        let mut client = reqwest::Client::builder()
            .timeout(Duration::from_millis(settings.callback_timeout_ms))
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("aip-sessions/", env!("CARGO_PKG_VERSION")));
        if !settings.callback_allow_private {
            client = client.dns_resolver(Arc::new(PublicOnly));
        }
        let client = client
            .build()
            .map_err(|e| format!("cannot build the callback client: {e}"))?;
        Ok(Callbacks {
            client,
            signers,
            allow_private: settings.callback_allow_private,
            max_attempts: i32::try_from(settings.callback_max_attempts).unwrap_or(i32::MAX),
            timeout_ms: i64::try_from(settings.callback_timeout_ms).unwrap_or(i64::MAX / 4),
            backoff: Duration::from_millis(settings.callback_backoff_ms.max(1)),
            max_backoff: Duration::from_millis(
                settings
                    .callback_max_backoff_ms
                    .max(settings.callback_backoff_ms.max(1)),
            ),
        })
    }

    /// Whether callbacks are signed.
    pub fn signed(&self) -> bool {
        !self.signers.is_empty()
    }

    /// Checks a task's callback URL when it is submitted: http or https, with a host that is
    /// not a loopback or private address (unless allowed).
    pub fn check_url(&self, url: &str) -> Result<(), String> {
        if !CALLBACK_URL.as_ref().is_some_and(|r| r.is_match(url)) {
            return Err(format!(
                "`callback_url` must be an http(s) URL with a host name or IPv4 address, an \
                 optional port, path and query (no user info or fragment): {url:?}"
            ));
        }
        let parsed = reqwest::Url::parse(url)
            .map_err(|e| format!("`callback_url` is not a URL ({e}): {url:?}"))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(format!("`callback_url` must be http or https: {url:?}"));
        }
        let Some(host) = parsed.host() else {
            return Err(format!("`callback_url` has no host: {url:?}"));
        };
        if self.allow_private {
            return Ok(());
        }
        let inward = match host {
            url::Host::Domain(name) => {
                let name = name.trim_end_matches('.').to_ascii_lowercase();
                name == "localhost" || name.ends_with(".localhost")
            }
            url::Host::Ipv4(ip) => !is_public(IpAddr::V4(ip)),
            url::Host::Ipv6(ip) => !is_public(IpAddr::V6(ip)),
        };
        if inward {
            return Err(format!(
                "`callback_url` points at a loopback or private address, which this broker \
                 refuses (AIP_SESSIONS__CALLBACK_ALLOW_PRIVATE allows it): {url:?}"
            ));
        }
        Ok(())
    }

    /// One attempt at a callback.
    async fn attempt(&self, callback: &DueCallback) -> Attempt {
        if let Err(why) = self.check_url(&callback.target) {
            return Attempt::refused(why);
        }
        let timestamp = chrono::Utc::now().timestamp();
        let mut post = self
            .client
            .post(&callback.target)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(standardwebhooks::HEADER_WEBHOOK_ID, &callback.callback_id)
            .header(
                standardwebhooks::HEADER_WEBHOOK_TIMESTAMP,
                timestamp.to_string(),
            );
        if self.signed() {
            let signatures = self
                .signers
                .iter()
                .map(|s| {
                    s.sign(
                        &callback.callback_id,
                        timestamp,
                        callback.payload.as_bytes(),
                    )
                })
                .collect::<Result<Vec<_>, _>>();
            match signatures {
                Ok(signatures) => {
                    post = post.header(
                        standardwebhooks::HEADER_WEBHOOK_SIGNATURE,
                        signatures.join(" "),
                    );
                }
                Err(e) => return Attempt::refused(format!("cannot sign: {e}")),
            }
        }
        let response = match post.body(callback.payload.clone()).send().await {
            Ok(response) => response,
            Err(e) => return Attempt::failed(None, describe(e), None),
        };
        let status = response.status();
        let retry_after = retry_after(response.headers());
        if status.is_success() {
            return Attempt {
                delivered: true,
                status: Some(status),
                error: None,
                retry_after: None,
                stop: false,
            };
        }
        let body = response.bytes().await.unwrap_or_default();
        let error = format!("HTTP {status}: {}", quote(&body));
        Attempt::failed(Some(status), error, retry_after)
    }

    /// What follows an attempt.
    fn settle(&self, callback: &DueCallback, attempt: &Attempt, now: i64) -> Settled {
        let attempts = callback.attempts + 1;
        let status = attempt.status.map(|s| i32::from(s.as_u16()));
        let (state, next_attempt_ms) = match attempt.status {
            _ if attempt.delivered => ("delivered", now),
            Some(StatusCode::GONE) => ("gone", now),
            _ if attempt.stop || attempts - callback.attempts_base >= self.max_attempts => {
                ("dead", now)
            }
            _ => {
                let used = usize::try_from(attempts - callback.attempts_base).unwrap_or(1);
                let wait = self.backoff_after(used).max(
                    attempt
                        .retry_after
                        .unwrap_or_default()
                        .min(self.max_backoff),
                );
                (
                    "pending",
                    now + i64::try_from(wait.as_millis()).unwrap_or(i64::MAX / 4),
                )
            }
        };
        Settled {
            state,
            attempts,
            next_attempt_ms,
            status,
            error: attempt.error.clone(),
        }
    }

    /// The wait after the `n`th failed attempt: `callback_backoff_ms` doubling, with jitter,
    /// at most `callback_max_backoff_ms`.
    fn backoff_after(&self, n: usize) -> Duration {
        ExponentialBuilder::default()
            .with_min_delay(self.backoff)
            .with_max_delay(self.max_backoff)
            .with_factor(2.0)
            .with_jitter()
            .without_max_times()
            .build()
            .nth(n.saturating_sub(1))
            .unwrap_or(self.max_backoff)
            .min(self.max_backoff)
    }
}

/// Sends a callback to its agent as a `callback` frame and waits for the agent's gateway to
/// acknowledge writing it. `None` while the agent is not connected (the callback waits, up to
/// [`AGENT_WAIT_MS`] from its creation, then is dead-lettered).
async fn to_agent(
    engine: &Engine,
    callback: &DueCallback,
    agent: &str,
    callbacks: &Callbacks,
) -> Option<Attempt> {
    let record = match engine.registry().get(agent).await {
        Ok(record) if record.status != proto_schemas::registry::AgentStatus::Offline => record,
        Ok(_) => {
            if now_ms() - callback.created_ms > AGENT_WAIT_MS {
                return Some(Attempt::refused(format!(
                    "agent `{agent}` did not connect within {} h",
                    AGENT_WAIT_MS / 3_600_000
                )));
            }
            return None;
        }
        Err(aip_bus::registry::RegistryError::Refused(body))
            if body.error_code == proto_schemas::ErrorCode::NotFound =>
        {
            if now_ms() - callback.created_ms > AGENT_WAIT_MS {
                return Some(Attempt::refused(format!(
                    "agent `{agent}` did not connect within {} h",
                    AGENT_WAIT_MS / 3_600_000
                )));
            }
            return None;
        }
        Err(e) => return Some(Attempt::failed(None, format!("registry: {e}"), None)),
    };
    if !record
        .extensions
        .contains(&proto_schemas::Extension::Callback)
    {
        return Some(Attempt::refused(format!(
            "agent `{agent}` did not announce the `callback` extension at REGISTER, so it \
             cannot be sent callback frames"
        )));
    }
    let notification: CallbackNotification = match serde_json::from_str(&callback.payload) {
        Ok(notification) => notification,
        Err(e) => return Some(Attempt::refused(format!("the stored notification: {e}"))),
    };
    let frame = match serde_json::to_vec(&proto_schemas::server::callback(&notification)) {
        Ok(frame) => frame,
        Err(e) => {
            return Some(Attempt::refused(format!(
                "the frame cannot be written: {e}"
            )));
        }
    };
    let timeout = Duration::from_millis(u64::try_from(callbacks.timeout_ms).unwrap_or(10_000));
    let written = engine
        .send_acknowledged(&record, &callback.callback_id, frame, timeout)
        .await;
    Some(match written {
        Ok(()) => Attempt::delivered(),
        Err(why) => Attempt::failed(None, why, None),
    })
}

/// How one attempt went.
#[derive(Debug)]
struct Attempt {
    /// Written to the agent (a frame's callback has no HTTP status).
    delivered: bool,
    status: Option<StatusCode>,
    error: Option<String>,
    retry_after: Option<Duration>,
    /// Trying again would not help (a refused address): dead-letter now.
    stop: bool,
}

impl Attempt {
    fn delivered() -> Self {
        Attempt {
            delivered: true,
            status: None,
            error: None,
            retry_after: None,
            stop: false,
        }
    }

    fn failed(status: Option<StatusCode>, error: String, retry_after: Option<Duration>) -> Self {
        Attempt {
            delivered: false,
            status,
            error: Some(error),
            retry_after,
            stop: false,
        }
    }

    fn refused(error: String) -> Self {
        Attempt {
            delivered: false,
            status: None,
            error: Some(error),
            retry_after: None,
            stop: true,
        }
    }
}

/// A request error with its causes (reqwest's own text leaves out why a connection failed,
/// e.g. an address this broker refuses), without the URL.
fn describe(error: reqwest::Error) -> String {
    let error = error.without_url();
    let mut text = error.to_string();
    let mut source = std::error::Error::source(&error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// `Retry-After` in seconds or as an HTTP date.
fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let value = headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = chrono::DateTime::parse_from_rfc2822(value).ok()?;
    let wait = at.timestamp_millis() - now_ms();
    Some(Duration::from_millis(u64::try_from(wait).unwrap_or(0)))
}

fn quote(body: &[u8]) -> String {
    crate::planners::http::quote(&body[..body.len().min(QUOTED_BODY_BYTES)])
}

/// Whether an address is on the public internet: not loopback, private, link-local, shared
/// (CGNAT), unspecified, multicast, broadcast, documentation or reserved.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => {
            let [first, second, ..] = a.octets();
            !(a.is_private()
                || a.is_loopback()
                || a.is_link_local()
                || a.is_unspecified()
                || a.is_broadcast()
                || a.is_multicast()
                || a.is_documentation()
                || first == 0
                || first >= 240
                || (first == 100 && (second & 0xc0) == 64)
                || (first == 198 && (second & 0xfe) == 18)
                || (first == 192 && second == 0))
        }
        IpAddr::V6(a) => {
            if let Some(v4) = a.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let first = a.segments()[0];
            !(a.is_loopback()
                || a.is_unspecified()
                || a.is_multicast()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
                || (first == 0x2001 && a.segments()[1] == 0x0db8)
                || first == 0x0064)
        }
    }
}

/// A resolver that answers only public addresses, so a callback host that resolves inward
/// (or is rebound to) is refused at connection time.
struct PublicOnly;

impl reqwest::dns::Resolve for PublicOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let found: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let public: Vec<SocketAddr> = found.into_iter().filter(|a| is_public(a.ip())).collect();
            if public.is_empty() {
                return Err(format!(
                    "{host} resolves only to loopback or private addresses, which this broker \
                     refuses (AIP_SESSIONS__CALLBACK_ALLOW_PRIVATE allows them)"
                )
                .into());
            }
            Ok(Box::new(public.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// Delivers due callbacks until `stop` (the end of this replica's leadership).
pub async fn run_callbacks(engine: Engine, stop: CancellationToken) {
    let callbacks = engine.callbacks_arc();
    let permits = Arc::new(Semaphore::new(CONCURRENCY));
    let mut tick = tokio::time::interval(SWEEP);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = stop.cancelled() => return,
        }
        let claim_ms = callbacks.timeout_ms + CLAIM_MARGIN_MS;
        let due = match engine
            .store
            .claim_callbacks(now_ms(), claim_ms, CLAIM_BATCH)
            .await
        {
            Ok(due) => due,
            Err(e) => {
                tracing::warn!("cannot read the due callbacks: {e}");
                continue;
            }
        };
        for callback in due {
            let Ok(permit) = permits.clone().acquire_owned().await else {
                return;
            };
            let engine = engine.clone();
            let callbacks = callbacks.clone();
            tokio::spawn(async move {
                let started = now_ms();
                let attempt = match CallbackTarget::from_stored(&callback.target) {
                    CallbackTarget::Url(_) => callbacks.attempt(&callback).await,
                    CallbackTarget::Agent(agent) => {
                        match to_agent(&engine, &callback, &agent, &callbacks).await {
                            Some(attempt) => attempt,
                            // Not connected: looked at again when the claim lapses; no
                            // attempt is recorded.
                            None => return,
                        }
                    }
                };
                let now = now_ms();
                let settled = callbacks.settle(&callback, &attempt, now);
                metrics::counter!("aip_sessions_callback_attempts_total", "outcome" => settled.state)
                    .increment(1);
                match settled.state {
                    "delivered" => {}
                    "pending" => tracing::info!(
                        callback = %callback.callback_id, attempt = settled.attempts,
                        "callback not delivered, will try again: {}",
                        settled.error.as_deref().unwrap_or("")
                    ),
                    state => tracing::warn!(
                        callback = %callback.callback_id, attempt = settled.attempts,
                        "callback {state}: {}",
                        settled.error.as_deref().unwrap_or("")
                    ),
                }
                if let Err(e) = engine
                    .store
                    .settle_callback(&callback.callback_id, started, now - started, &settled)
                    .await
                {
                    tracing::warn!(callback = %callback.callback_id, "cannot record the attempt (it is tried again after its claim): {e}");
                }
                drop(permit);
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn callbacks(allow_private: bool) -> Callbacks {
        let settings = SessionSettings {
            callback_allow_private: allow_private,
            callback_backoff_ms: 100,
            callback_max_backoff_ms: 1_000,
            callback_max_attempts: 3,
            ..SessionSettings::default()
        };
        Callbacks::new(&settings).expect("settings")
    }

    #[test]
    fn private_and_odd_urls_are_refused_unless_allowed() {
        let c = callbacks(false);
        for url in [
            "http://127.0.0.1:9/x",
            "http://localhost/x",
            "http://api.localhost/x",
            "http://10.1.2.3/",
            "http://192.168.0.1/",
            "http://169.254.169.254/latest/meta-data",
            "http://[::1]/",
            "http://[fd00::1]/",
            "http://[::ffff:127.0.0.1]/",
            "http://100.64.0.1/",
            "ftp://example.com/",
            "not a url",
        ] {
            assert!(c.check_url(url).is_err(), "{url} should be refused");
        }
        assert!(c.check_url("https://example.com/hook").is_ok());
        assert!(
            c.check_url("https://hooks.example.com:8443/a/b?c=d&e=%20")
                .is_ok()
        );
        assert!(c.check_url("http://93.184.216.34/hook").is_ok());
        for odd in [
            "https://user:pw@example.com/",
            "https://example.com/#frag",
            "https://example.com:65536/",
            "https://999.1.1.1/",
            "https://exa mple.com/",
            "https://[2606:4700::1111]/",
        ] {
            assert!(c.check_url(odd).is_err(), "{odd} should be refused");
        }
        assert!(CALLBACK_URL.is_some(), "the pattern compiles");
        let open = callbacks(true);
        assert!(open.check_url("http://127.0.0.1:9/x").is_ok());
        assert!(
            open.check_url("ftp://127.0.0.1/").is_err(),
            "still http(s) only"
        );
    }

    fn due(attempts: i32, base: i32) -> DueCallback {
        DueCallback {
            callback_id: "t:3".into(),
            task_id: "t".into(),
            target: "https://example.com/".into(),
            payload: "{}".into(),
            attempts,
            attempts_base: base,
            created_ms: 0,
        }
    }

    #[test]
    fn outcomes_settle_as_the_scheme_says() {
        let c = callbacks(false);
        let ok = Attempt {
            delivered: true,
            status: Some(StatusCode::NO_CONTENT),
            error: None,
            retry_after: None,
            stop: false,
        };
        assert_eq!(c.settle(&due(0, 0), &ok, 0).state, "delivered");
        let gone = Attempt::failed(Some(StatusCode::GONE), "gone".into(), None);
        assert_eq!(c.settle(&due(0, 0), &gone, 0).state, "gone");
        let busy = Attempt::failed(
            Some(StatusCode::SERVICE_UNAVAILABLE),
            "busy".into(),
            Some(Duration::from_millis(700)),
        );
        let first = c.settle(&due(0, 0), &busy, 0);
        assert_eq!((first.state, first.attempts), ("pending", 1));
        assert!(first.next_attempt_ms >= 700, "Retry-After is honoured");
        let huge = Attempt::failed(None, "x".into(), Some(Duration::from_secs(3_600)));
        assert!(
            c.settle(&due(0, 0), &huge, 0).next_attempt_ms <= 1_000,
            "Retry-After is capped by the longest backoff"
        );
        assert_eq!(
            c.settle(&due(2, 0), &busy, 0).state,
            "dead",
            "the third attempt"
        );
        assert_eq!(
            c.settle(&due(2, 2), &busy, 0).state,
            "pending",
            "a redelivery has a fresh budget"
        );
        assert_eq!(
            c.settle(&due(0, 0), &Attempt::refused("inward".into()), 0)
                .state,
            "dead"
        );
    }

    #[test]
    fn backoff_grows_and_stays_bounded() {
        let c = callbacks(false);
        let waits: Vec<Duration> = (1..=8).map(|n| c.backoff_after(n)).collect();
        assert!(waits[0] >= Duration::from_millis(100), "{waits:?}");
        assert!(
            waits.iter().all(|w| *w <= Duration::from_millis(1_000)),
            "{waits:?}"
        );
        assert!(waits[3] > waits[0], "{waits:?}");
    }

    #[test]
    fn only_public_addresses_are_public() {
        for ip in ["8.8.8.8", "1.1.1.1", "2606:4700::1111"] {
            assert!(is_public(ip.parse().expect("ip")), "{ip}");
        }
        for ip in [
            "127.0.0.1",
            "10.0.0.1",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.1.1",
            "0.0.0.0",
            "100.100.1.1",
            "224.0.0.1",
            "::1",
            "fe80::1",
            "fc00::1",
            "::ffff:10.0.0.1",
        ] {
            assert!(!is_public(ip.parse().expect("ip")), "{ip}");
        }
    }
}
