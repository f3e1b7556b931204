//! The frames the session service handles: TASK, COMMAND_RESULTS, TASK_END, PROGRESS,
//! CLARIFICATION_REQUEST / _RESPONSE and HANDOFF.
//!
//! Each goes into the frames stream with the registered identity attached, stored before
//! this returns. If that fails the client is told at once, and a TASK also gets its
//! `task_end` so that the requester's pending task ends.

use proto_schemas::sessions::{GatewayEvent, InboundFrame};
use proto_schemas::{ClientMessage, ErrorCode, V1, server};
use tracing::Instrument;

use crate::client::{Client, End};
use crate::events;
use crate::identity::Identity;

pub(crate) async fn handle(
    client: &mut Client,
    identity: &Identity,
    frame: ClientMessage,
) -> Result<(), End> {
    client.frames_forwarded += 1;
    let msg_id = format!("{}:{}", client.connection_id, client.frames_forwarded);
    let kind = frame.kind;
    let session_id = frame.session_id.clone();
    let parent = client.command_traces.parent_of(&frame);
    let span = aip_bus::trace::work_span(&format!("receive {kind}"), "server", parent);
    if let Some(id) = &session_id {
        aip_bus::trace::record_session(&span, id);
    }
    let event = GatewayEvent::Frame(InboundFrame {
        version: V1,
        gateway_id: client.state.gateway_id.clone(),
        connection_id: client.connection_id.clone(),
        client_id: identity.client_id.clone(),
        client_type: identity.client_type,
        platform: identity.platform,
        extensions: identity.extensions.clone(),
        received_at: server::timestamp_now(),
        frame,
    });
    let published = events::publish(&client.state, &identity.client_id, &event, msg_id);
    let Err(e) = published.instrument(span).await else {
        return Ok(());
    };
    let text = format!("`{kind}` frame not accepted: {e}");
    for answer in server::refusal(kind, session_id.as_deref(), ErrorCode::Unavailable, &text) {
        client.connection.write(&answer)?;
    }
    Ok(())
}
