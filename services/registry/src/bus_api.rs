//! The registry's request/reply subjects on the bus.
//!
//! Each subject (`registry.register`, `registry.unregister`, `registry.write`, `registry.get`,
//! `registry.get_many`, `registry.lookup`, `registry.gateway_started`, `registry.agents`) is
//! queue-subscribed in the group [`QUEUE_GROUP`], so replicas share the work. Every request runs in its own task, holding a permit of one semaphore shared by all
//! subjects: at most `max_in_flight` requests at once, and the subscription is not read while
//! none is free (NATS buffers, then drops as a slow consumer; the caller times out and retries).
//!
//! Replies are a JSON [`Reply`]: `{"ok": …}` or `{"error": {"detail", "error_code"}}`; error
//! replies also carry the code in the `Aip-Error-Code` header.

use std::future::Future;
use std::sync::Arc;

use aip_bus::trace::Operation;
use aip_bus::{Bus, Headers, Message, SharedBus, Subscription, names};
use futures::StreamExt;
use proto_schemas::registry::Reply;
use proto_schemas::{ErrorBody, ErrorCode, Subjects};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::registry::Registry;

/// The queue group of every registry subscription.
pub const QUEUE_GROUP: &str = "aip-registry";

/// The request subjects, subscribed (before the application starts serving).
pub struct RequestSubscriptions {
    register: Subscription,
    unregister: Subscription,
    write: Subscription,
    get: Subscription,
    get_many: Subscription,
    lookup: Subscription,
    gateway_started: Subscription,
    agents: Subscription,
}

impl RequestSubscriptions {
    /// Queue-subscribes to every request subject.
    pub async fn subscribe(bus: &dyn Bus, subjects: &Subjects) -> Result<Self, aip_bus::BusError> {
        let group = || QUEUE_GROUP.to_owned();
        Ok(RequestSubscriptions {
            register: bus
                .queue_subscribe(subjects.registry_register(), group())
                .await?,
            unregister: bus
                .queue_subscribe(subjects.registry_unregister(), group())
                .await?,
            write: bus
                .queue_subscribe(subjects.registry_write(), group())
                .await?,
            get: bus
                .queue_subscribe(subjects.registry_get(), group())
                .await?,
            get_many: bus
                .queue_subscribe(subjects.registry_get_many(), group())
                .await?,
            lookup: bus
                .queue_subscribe(subjects.registry_lookup(), group())
                .await?,
            gateway_started: bus
                .queue_subscribe(subjects.registry_gateway_started(), group())
                .await?,
            agents: bus
                .queue_subscribe(subjects.registry_agents(), group())
                .await?,
        })
    }

    /// Serves every subject until `stop` is cancelled (then unsubscribes; requests already
    /// taken are finished, unless `abandon` is cancelled too; wait for them by acquiring all
    /// of `limiter`'s permits).
    pub async fn serve(
        self,
        registry: Registry,
        bus: SharedBus,
        limiter: Arc<Semaphore>,
        stop: CancellationToken,
        abandon: CancellationToken,
    ) {
        let ctx = Ctx {
            bus,
            limiter,
            stop,
            abandon,
        };
        let r = registry.clone();
        let register = serve(
            "registry.register",
            self.register,
            ctx.clone(),
            move |req| {
                let r = r.clone();
                async move { r.register(req).await }
            },
        );
        let r = registry.clone();
        let unregister = serve(
            "registry.unregister",
            self.unregister,
            ctx.clone(),
            move |req| {
                let r = r.clone();
                async move { r.unregister(req).await }
            },
        );
        let r = registry.clone();
        let write = serve("registry.write", self.write, ctx.clone(), move |req| {
            let r = r.clone();
            async move { r.write(req).await }
        });
        let r = registry.clone();
        let get = serve("registry.get", self.get, ctx.clone(), move |req| {
            let r = r.clone();
            async move { r.get(req).await }
        });
        let r = registry.clone();
        let get_many = serve(
            "registry.get_many",
            self.get_many,
            ctx.clone(),
            move |req| {
                let r = r.clone();
                async move { r.get_many(req).await }
            },
        );
        let r = registry.clone();
        let lookup = serve("registry.lookup", self.lookup, ctx.clone(), move |req| {
            let r = r.clone();
            async move { r.lookup(req).await }
        });
        let r = registry.clone();
        let gateway_started = serve(
            "registry.gateway_started",
            self.gateway_started,
            ctx.clone(),
            move |req| {
                let r = r.clone();
                async move { r.gateway_started(req).await }
            },
        );
        let r = registry;
        let agents = serve("registry.agents", self.agents, ctx, move |req| {
            let r = r.clone();
            async move { r.manage(req).await }
        });
        tokio::join!(
            register,
            unregister,
            write,
            get,
            get_many,
            lookup,
            gateway_started,
            agents
        );
    }
}

#[derive(Clone)]
struct Ctx {
    bus: SharedBus,
    limiter: Arc<Semaphore>,
    stop: CancellationToken,
    abandon: CancellationToken,
}

/// Reads one subscription, running `handler` for each request in its own bounded task.
async fn serve<Req, Resp, F, Fut>(
    name: &'static str,
    mut subscription: Subscription,
    ctx: Ctx,
    handler: F,
) where
    Req: DeserializeOwned + Send + 'static,
    Resp: Serialize + Send + 'static,
    F: Fn(Req) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, ErrorBody>> + Send + 'static,
{
    loop {
        let message = tokio::select! {
            biased;
            () = ctx.stop.cancelled() => break,
            message = subscription.next() => match message {
                Some(message) => message,
                None => {
                    tracing::warn!(subject = name, "subscription ended");
                    break;
                }
            },
        };
        if message.reply.is_none() {
            tracing::warn!(subject = %message.subject, "ignoring a message without reply subject: requests must use request/reply");
            continue;
        }
        // Taken messages are always answered, even if shutdown starts while waiting here.
        let Ok(permit) = ctx.limiter.clone().acquire_owned().await else {
            break;
        };
        let parsed = parse::<Req>(name, &message.payload);
        let work = parsed.map(&handler);
        let bus = ctx.bus.clone();
        let abandon = ctx.abandon.clone();
        let span = aip_bus::trace::continuing(
            Operation::Serve,
            // Registry subjects carry no ids: each is its own template.
            &message.subject,
            &message.subject,
            aip_bus::trace::extract(&message.headers),
        );
        tokio::spawn(
            async move {
                let _permit = permit;
                let result = match work {
                    Ok(future) => tokio::select! {
                        result = future => result,
                        () = abandon.cancelled() => return,
                    },
                    Err(refusal) => Err(refusal),
                };
                reply(&*bus, &message, result).await;
            }
            .instrument(span),
        );
    }
    drop(subscription);
    tracing::debug!(subject = name, "stopped serving");
}

/// Parses a request, or the error that says what is wrong with it.
fn parse<Req: DeserializeOwned>(name: &str, payload: &[u8]) -> Result<Req, ErrorBody> {
    read_payload(payload).map_err(|e| {
        ErrorBody::new(
            ErrorCode::InvalidRequest,
            format!("invalid {name} request{e}"),
        )
    })
}

/// A payload as `T`, its text made storable first: a NUL (U+0000) in any string or key becomes
/// U+FFFD, as the session service stores it. PostgreSQL cannot hold NUL, so an id or a JSON
/// field with one would otherwise fail its statement (and a presence batch with one, every
/// later presence flush) on PostgreSQL only.
///
/// JSON can carry a NUL only as the escape `\u0000`, so a payload without that text is read
/// straight into `T`; anything else, and a payload that does not read as `T` (whose error
/// then names where), goes through a `Value` first.
pub(crate) fn read_payload<T: DeserializeOwned>(payload: &[u8]) -> Result<T, PayloadError> {
    if !payload.windows(NUL_ESCAPE.len()).any(|w| w == NUL_ESCAPE)
        && let Ok(read) = serde_json::from_slice(payload)
    {
        return Ok(read);
    }
    let mut value: serde_json::Value =
        serde_json::from_slice(payload).map_err(|e| PayloadError {
            path: String::new(),
            error: e,
        })?;
    aip_store::text::storable(&mut value);
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        PayloadError {
            path: if path == "." { String::new() } else { path },
            error: e.into_inner(),
        }
    })
}

/// How JSON text writes a NUL.
const NUL_ESCAPE: &[u8] = b"\\u0000";

/// Why a payload is not the expected JSON; shown as ` at `path`: error` (or `: error`).
#[derive(Debug)]
pub(crate) struct PayloadError {
    /// Where in the payload (empty: the payload itself).
    path: String,
    error: serde_json::Error,
}

impl std::fmt::Display for PayloadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if !self.path.is_empty() {
            write!(f, " at `{}`", self.path)?;
        }
        write!(f, ": {}", self.error)
    }
}

/// What a request gets when its reply cannot be encoded: a fixed `Reply::Error`, written out so
/// that it needs no encoding itself.
const UNENCODABLE_REPLY: &[u8] =
    br#"{"error":{"detail":"the registry could not encode its reply","error_code":"INTERNAL"}}"#;

/// Sends the reply (the error code also as a header).
pub(crate) async fn reply<T: Serialize>(
    bus: &dyn Bus,
    request: &Message,
    result: Result<T, ErrorBody>,
) {
    let mut headers = Headers::new();
    if let Err(error) = &result {
        headers.insert(names::ERROR_CODE, error.error_code.as_str());
    }
    let body = match serde_json::to_vec(&Reply::from(result)) {
        Ok(body) => body,
        Err(e) => {
            tracing::error!(subject = %request.subject, "reply not serialisable: {e}");
            headers.insert(names::ERROR_CODE, ErrorCode::Internal.as_str());
            UNENCODABLE_REPLY.to_vec()
        }
    };
    if let Err(e) = aip_bus::respond(bus, request, headers, body.into()).await {
        tracing::warn!(subject = %request.subject, "reply not sent: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_are_read_with_nul_as_the_replacement_character() {
        let get: proto_schemas::registry::GetAgent =
            read_payload(br#"{"version": 1, "agent_id": "a\u0000b"}"#).expect("valid");
        assert_eq!(get.agent_id, "a\u{FFFD}b");
        let refusal =
            parse::<proto_schemas::registry::GetAgent>("registry.get", b"{\"version\": 2}")
                .expect_err("version 2");
        assert_eq!(
            refusal.detail,
            "invalid registry.get request at `version`: unsupported payload version 2; this build speaks version 1"
        );
        let refusal =
            parse::<proto_schemas::registry::GetAgent>("registry.get", b"[").expect_err("not JSON");
        assert_eq!(
            refusal.detail,
            "invalid registry.get request: EOF while parsing a list at line 1 column 1"
        );
    }

    #[test]
    fn a_payload_without_nul_reads_as_it_did_through_a_value() {
        let text = br#"{"version": 1, "agent_id": "pc-1", "agent_id": "pc-2"}"#;
        let read: proto_schemas::registry::GetAgent = read_payload(text).expect("valid");
        assert_eq!(
            read.agent_id, "pc-2",
            "of a repeated key the last counts, as before"
        );
        let mut request = proto_schemas::registry::RegisterAgent::device(
            "pc-1",
            "gw",
            "conn",
            "key:ops",
            proto_schemas::Platform::Linux,
        );
        request.metadata = Some(serde_json::json!({ "os": "linux", "cpu": [1, 2.5, null] }));
        request.capabilities = vec!["excel".to_owned()];
        let text = serde_json::to_vec(&request).expect("encoded");
        let read: proto_schemas::registry::RegisterAgent = read_payload(&text).expect("valid");
        assert_eq!(read, request);
    }

    #[test]
    fn the_fixed_reply_is_a_reply_error_with_the_internal_code() {
        let reply: Reply<()> = serde_json::from_slice(UNENCODABLE_REPLY).expect("a Reply");
        match reply {
            Reply::Error(body) => assert_eq!(body.error_code, ErrorCode::Internal),
            Reply::Ok(()) => panic!("not an error"),
        }
    }
}
