//! HEARTBEAT: answered by the gateway itself, without a bus message. The sign of life it
//! carries has already been recorded for the presence batches.

use proto_schemas::server;

use crate::client::{Client, End};

pub(crate) fn handle(client: &Client) -> Result<(), End> {
    Ok(client.connection.write(&server::heartbeat())?)
}
