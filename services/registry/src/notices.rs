//! The ends of connections no gateway reports: the registry announces them into the frames
//! stream, as the gateway holding them would have.
//!
//! A gateway that dies (or restarts) never reports its connections closed. The registry learns
//! of their end three ways: the reaper finds them silent past the liveness window, the gateway
//! announces its restart ([`crate::registry::Registry::gateway_started`]), or the client
//! registers again and replaces its old connection. Each time the session service must hear
//! it, or the connection's tasks stay `working` until their command timeout. The event is
//! de-duplicated on `<connection id>:closed`, the id the gateway's own report of a lone end
//! carries. An end the gateway reported inside a `closed_many` (several ends at once, under
//! its first connection's id) is not dropped as a copy, and changes nothing the second time:
//! the session service applies ends by connection and skips tasks that already ended.

use aip_bus::{BusError, Headers, SharedBus, names};
use futures::StreamExt;
use proto_schemas::sessions::{ConnectionClosed, GatewayEvent};
use proto_schemas::{Subjects, V1};

use crate::store::Ended;

/// Announcements published at once when many connections end together (a gateway restart).
const CONCURRENT_ANNOUNCEMENTS: usize = 64;

/// Where the ends of connections are announced.
#[derive(Clone)]
pub struct Notices {
    /// The bus with the frames stream.
    pub bus: SharedBus,
    /// The deployment's subjects.
    pub subjects: Subjects,
}

impl Notices {
    /// Announces the end of one connection. A failure is logged: the connection's tasks then
    /// end at their own deadlines.
    pub async fn announce(&self, ended: &Ended, reason: &str) {
        let event = GatewayEvent::Closed(ConnectionClosed {
            version: V1,
            gateway_id: ended.gateway_id.clone(),
            connection_id: ended.connection_id.clone(),
            client_id: ended.agent_id.clone(),
            client_type: ended.client_type,
            reason: reason.to_owned(),
        });
        let body = match serde_json::to_vec(&event) {
            Ok(body) => body,
            Err(e) => {
                tracing::error!(agent = %ended.agent_id, "the end of a connection could not be encoded: {e}");
                return;
            }
        };
        let headers = Headers::new().with(names::MSG_ID, closed_msg_id(&ended.connection_id));
        let subject = self.subjects.frames(&ended.agent_id);
        match self
            .bus
            .publish_durable(subject, headers, body.into())
            .await
        {
            Ok(()) => {}
            Err(BusError::NoStream { .. }) => {
                tracing::debug!(
                    "no frames stream (no session service has started): nothing to end"
                );
            }
            Err(e) => {
                tracing::warn!(agent = %ended.agent_id, connection = %ended.connection_id, "the end of a connection was not announced: {e}")
            }
        }
    }

    /// Announces the ends of many connections, a few at a time.
    pub async fn announce_all(&self, ended: &[Ended], reason: &str) {
        futures::stream::iter(ended)
            .for_each_concurrent(CONCURRENT_ANNOUNCEMENTS, |e| self.announce(e, reason))
            .await;
    }
}

/// The `Nats-Msg-Id` of a connection's end, whoever reports it (the gateway uses the same).
pub fn closed_msg_id(connection_id: &str) -> String {
    format!("{connection_id}:closed")
}
