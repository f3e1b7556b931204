//! What arrives on the client's delivery subject: server frames for it, already serialised
//! by the session service, written to the socket as they are; and the control message
//! telling a replaced connection to close.

use aip_bus::{Message as BusMessage, names};
use proto_schemas::{ErrorCode, server};

use crate::client::{Client, End};
use crate::connection::close;

pub(crate) async fn handle(client: &mut Client, message: BusMessage) -> Result<(), End> {
    if message.headers.get(names::CONTROL) == Some("disconnect") {
        if message.headers.get(names::CONNECTION) == Some(client.connection_id.as_str()) {
            client.connection.close(
                close::POLICY,
                "replaced by a newer connection of the same client",
            );
            return Err(End::Replaced);
        }
        return Ok(());
    }
    if let Some(id) = message.headers.get(names::MSG_ID)
        && !client.recent_deliveries.first_time(id)
    {
        tracing::debug!(id, "duplicate delivery dropped");
        return Ok(());
    }
    let payload = match aip_bus::payload_of(client.state.bus.as_ref(), &message).await {
        Ok(payload) => payload,
        Err(e) => {
            tracing::error!(subject = %message.subject, "a large frame for this client could not be read back: {e}");
            return Ok(client.connection.write(&server::error(
                ErrorCode::Internal,
                format!("a frame for you was lost in transit: {e}"),
            ))?);
        }
    };
    match String::from_utf8(payload.to_vec()) {
        Ok(text) => Ok(client.connection.write_text(text)?),
        Err(_) => {
            tracing::error!(subject = %message.subject, "delivery is not UTF-8 JSON; dropped");
            Ok(())
        }
    }
}
