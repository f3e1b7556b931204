//! What the gateway tells the session service: client frames it does not answer itself,
//! and the end of a registered connection. Both go into the durable frames stream, stored
//! before the publish returns, so a session service that restarts loses none.

use aip_bus::trace::Operation;
use aip_bus::{BusError, Headers, names};
use proto_schemas::V1;
use proto_schemas::sessions::{ConnectionClosed, GatewayEvent};
use tracing::Instrument;

use crate::AppState;
use crate::identity::Identity;

/// Why an event was not stored; the text is shown to the client whose frame it carried.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PublishError {
    /// A bug: events are plain data.
    #[error("internal error: {0}")]
    Encode(#[source] serde_json::Error),
    #[error("the session service has not started (no frames stream); try again later")]
    NoStream,
    #[error("the message bus did not store it: {0}")]
    Bus(#[source] BusError),
}

/// Publishes `event` for `client_id`, de-duplicated by the stream on `msg_id`.
pub(crate) async fn publish(
    state: &AppState,
    client_id: &str,
    event: &GatewayEvent,
    msg_id: String,
) -> Result<(), PublishError> {
    let body = serde_json::to_vec(event).map_err(|e| {
        tracing::error!(client = %client_id, "gateway event not serialisable: {e}");
        PublishError::Encode(e)
    })?;
    let headers = Headers::new().with(names::MSG_ID, msg_id);
    let subject = state.subjects.frames(client_id);
    let body = bytes::Bytes::from(body);
    let span = aip_bus::trace::messaging_span(
        Operation::Publish,
        &state.subjects.template(&subject),
        &subject,
        None,
    );
    store(state, client_id, subject, headers, body)
        .instrument(span)
        .await
}

/// Stores one event, retrying while the bus is unreachable.
async fn store(
    state: &AppState,
    client_id: &str,
    subject: String,
    headers: Headers,
    body: bytes::Bytes,
) -> Result<(), PublishError> {
    let deadline = tokio::time::Instant::now() + PUBLISH_RETRY_WINDOW;
    let mut delay = PUBLISH_RETRY_FIRST_DELAY;
    loop {
        let published = state.blobs.publish_durable(
            state.bus.as_ref(),
            subject.clone(),
            headers.clone(),
            body.clone(),
        );
        match published.await {
            Ok(()) => return Ok(()),
            Err(BusError::NoStream { .. }) => return Err(PublishError::NoStream),
            Err(e) if is_transient(&e) && tokio::time::Instant::now() + delay < deadline => {
                tracing::warn!(client = %client_id, "frame not stored yet, retrying in {delay:?}: {e}");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(PUBLISH_RETRY_MAX_DELAY);
            }
            Err(e) => return Err(PublishError::Bus(e)),
        }
    }
}

/// How long a frame is held and offered again while NATS is unreachable (a restart, a
/// failover). UFO clients never resend a frame, so a blip must not lose one; the stream
/// de-duplicates on the message id, so a try that was stored after all is not stored twice.
/// The connection reads no further frame meanwhile, so the hold is bounded per client.
const PUBLISH_RETRY_WINDOW: std::time::Duration = std::time::Duration::from_secs(15);
/// The first pause between tries; it doubles up to [`PUBLISH_RETRY_MAX_DELAY`].
const PUBLISH_RETRY_FIRST_DELAY: std::time::Duration = std::time::Duration::from_millis(100);
/// The longest pause between tries.
const PUBLISH_RETRY_MAX_DELAY: std::time::Duration = std::time::Duration::from_secs(2);

/// Whether another try may succeed: the bus failed or timed out, rather than refusing this
/// frame for what it is.
fn is_transient(error: &BusError) -> bool {
    matches!(error, BusError::Nats { .. } | BusError::Timeout { .. })
}

/// Tells the session service that this client is gone, so its sessions end.
pub(crate) async fn announce_closed(
    state: &AppState,
    identity: &Identity,
    connection_id: &str,
    reason: &str,
) {
    let event = GatewayEvent::Closed(ConnectionClosed {
        version: V1,
        gateway_id: state.gateway_id.clone(),
        connection_id: connection_id.to_owned(),
        client_id: identity.client_id.clone(),
        client_type: identity.client_type,
        reason: reason.to_owned(),
    });
    let msg_id = format!("{connection_id}:closed");
    if let Err(e) = publish(state, &identity.client_id, &event, msg_id).await {
        tracing::warn!(client = %identity.client_id, "session service not told of the disconnect: {e}");
    }
}
