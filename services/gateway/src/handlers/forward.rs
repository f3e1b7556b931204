//! The frames the session service handles: TASK, COMMAND_RESULTS, TASK_END, PROGRESS,
//! CLARIFICATION_REQUEST / _RESPONSE and HANDOFF.
//!
//! Each goes into the frames stream with the registered identity attached, stored before
//! this returns. If that fails the client is told at once, and a TASK also gets its
//! `task_end` so that the requester's pending task ends.

use proto_schemas::sessions::InboundFrame;
use proto_schemas::{ClientMessage, ClientMessageType, ErrorCode, V1, server};
use tracing::Instrument;

use crate::client::{Client, End};
use crate::events;
use crate::identity::Identity;

/// Why a task frame may not go where it asks, when the connection's credential limits the
/// devices it may target (UFO lets any constellation target any device; a credential with
/// `targets` narrows that).
async fn target_refusal(client: &Client, frame: &ClientMessage) -> Option<String> {
    let principal = &client.principal;
    if !principal.targets_limited() {
        return None;
    }
    match frame.target_id.as_deref().filter(|t| !t.is_empty()) {
        Some(target) if principal.may_target(&client.state.registry, target).await => None,
        Some(target) => Some(format!(
            "credential `{}` may not target device `{target}`",
            principal.name
        )),
        None => Some(format!(
            "credential `{}` may target only the devices it names: give target_id",
            principal.name
        )),
    }
}

pub(crate) async fn handle(
    client: &mut Client,
    identity: &Identity,
    frame: ClientMessage,
) -> Result<(), End> {
    if frame.kind == ClientMessageType::Task
        && let Some(refusal) = target_refusal(client, &frame).await
    {
        let session_id = frame.session_id.as_deref();
        for answer in server::refusal(frame.kind, session_id, ErrorCode::Forbidden, &refusal) {
            client.connection.write(&answer)?;
        }
        return Ok(());
    }
    client.frames_forwarded += 1;
    let msg_id = format!("{}:{}", client.connection_id, client.frames_forwarded);
    let kind = frame.kind;
    let session_id = frame.session_id.clone();
    let parent = client.command_traces.parent_of(&frame);
    let span = aip_bus::trace::work_span(&format!("receive {kind}"), "server", parent);
    if let Some(id) = &session_id {
        aip_bus::trace::record_session(&span, id);
    }
    let inbound = InboundFrame {
        version: V1,
        gateway_id: client.state.gateway_id.clone(),
        connection_id: client.connection_id.clone(),
        client_id: identity.client_id.clone(),
        client_type: identity.client_type,
        platform: identity.platform,
        extensions: identity.extensions.clone(),
        received_at: server::timestamp_now(),
        frame,
        delivery_batches: true,
    };
    let published = events::publish_frame(&client.state, &inbound, msg_id, client.frame_bytes);
    let Err(e) = published.instrument(span).await else {
        return Ok(());
    };
    let text = format!("`{kind}` frame not accepted: {e}");
    for answer in server::refusal(kind, session_id.as_deref(), ErrorCode::Unavailable, &text) {
        client.connection.write(&answer)?;
    }
    Ok(())
}
