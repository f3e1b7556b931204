//! What the gateway tells the session service: client frames it does not answer itself,
//! and the end of a registered connection. Both go into the durable frames stream, stored
//! before the publish returns, so a session service that restarts loses none.

use aip_bus::{BusError, Headers, names};
use proto_schemas::V1;
use proto_schemas::sessions::{ConnectionClosed, GatewayEvent};

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
    let published = state
        .blobs
        .publish_durable(state.bus.as_ref(), subject, headers, body.into());
    match published.await {
        Ok(()) => Ok(()),
        Err(BusError::NoStream { .. }) => Err(PublishError::NoStream),
        Err(e) => Err(PublishError::Bus(e)),
    }
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
