//! One handler per client frame type, and the checks every frame of a registered client
//! passes first (rate, shape, identity).
//!
//! A handler answers on the client's [`Connection`](crate::connection::Connection) and
//! returns `Err` only when the connection must end (a write failed, the client misbehaves
//! persistently); an error for the client to read is an ERROR frame, not an `Err`.

pub(crate) mod client_error;
pub(crate) mod delivery;
pub(crate) mod device_info;
pub(crate) mod forward;
pub(crate) mod heartbeat;
pub(crate) mod register;

use proto_schemas::{ClientMessage, ClientMessageType, ErrorCode, FrameError, server};

use crate::client::{Client, End};
use crate::connection::close;
use crate::rate::Admission;

/// One text frame from a registered client.
pub(crate) async fn dispatch(
    client: &mut Client,
    frame: Result<Box<ClientMessage>, FrameError>,
) -> Result<(), End> {
    let admission = client.rate.admit();
    if admission != Admission::Allowed {
        metrics::counter!("aip_gateway_frames_refused_total", "reason" => "rate_limited")
            .increment(1);
        let limit = client.rate.per_second();
        let refusal = server::error(
            ErrorCode::RateLimited,
            format!("frame refused: more than {limit} frames per second; slow down"),
        );
        if admission == Admission::RefusedPersistently {
            let end = End::RateLimited;
            client
                .connection
                .write_last(&refusal, close::POLICY, &end.to_string());
            return Err(end);
        }
        return Ok(client.connection.write(&refusal)?);
    }
    let frame = match frame {
        Ok(frame) => *frame,
        Err(e) => {
            metrics::counter!("aip_gateway_frames_refused_total", "reason" => "invalid")
                .increment(1);
            return Ok(client
                .connection
                .write(&server::error(e.code, e.to_string()))?);
        }
    };
    let Some(identity) = client.identity.clone() else {
        return Ok(());
    };
    if let Err(mismatch) = identity.check(&frame) {
        return Ok(client
            .connection
            .write(&server::error(ErrorCode::Forbidden, mismatch.to_string()))?);
    }
    metrics::counter!("aip_gateway_frames_received_total", "type" => frame.kind.as_str())
        .increment(1);
    match frame.kind {
        ClientMessageType::Heartbeat => heartbeat::handle(client),
        ClientMessageType::DeviceInfoRequest => {
            device_info::handle(client, &identity, &frame).await
        }
        // Ignored, as UFO ignores it.
        ClientMessageType::DeviceInfoResponse => Ok(()),
        ClientMessageType::Register => register::already_registered(client),
        ClientMessageType::Error => client_error::handle(client, &frame),
        ClientMessageType::Task
        | ClientMessageType::CommandResults
        | ClientMessageType::TaskEnd
        | ClientMessageType::Progress
        | ClientMessageType::ClarificationRequest
        | ClientMessageType::ClarificationResponse
        | ClientMessageType::Handoff => forward::handle(client, &identity, frame).await,
    }
}
