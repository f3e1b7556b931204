//! ERROR from a client: echoed back as a server ERROR, as UFO's server does.

use proto_schemas::{ClientMessage, ErrorCode, server};

use crate::client::{Client, End};

pub(crate) fn handle(client: &Client, frame: &ClientMessage) -> Result<(), End> {
    let text = frame
        .error
        .clone()
        .unwrap_or_else(|| "client reported an error".to_owned());
    Ok(client
        .connection
        .write(&server::error(ErrorCode::ProtocolError, text))?)
}
