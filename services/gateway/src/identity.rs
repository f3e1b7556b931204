//! The identity a connection registered with, and the check every later frame passes.
//!
//! A registered connection speaks for one client only: a frame that names another
//! `client_id` or `client_type` is refused, so one client cannot act for another through a
//! connection it holds.

use proto_schemas::{ClientMessage, ClientMessageType, ClientType, Extension, Platform};

/// What the registry confirmed for this connection.
#[derive(Debug, Clone)]
pub(crate) struct Identity {
    pub(crate) client_id: String,
    pub(crate) client_type: ClientType,
    /// For a constellation: the device it registered for (limits device-info requests).
    pub(crate) target_id: Option<String>,
    /// Carried on every forwarded frame, so the session service needs no registry lookup.
    pub(crate) platform: Platform,
    /// Carried on every forwarded frame: what the session service may send this client.
    pub(crate) extensions: Vec<Extension>,
}

/// A frame claiming an identity other than the registered one.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Mismatch {
    #[error("client_id does not match the registered connection")]
    ClientId,
    #[error("client_type does not match the registered connection")]
    ClientType,
}

impl Identity {
    /// Accepts a frame that names no identity or this one. A heartbeat's `client_type` is
    /// not checked: Galaxy's constellation client sends its heartbeats as `device`.
    pub(crate) fn check(&self, frame: &ClientMessage) -> Result<(), Mismatch> {
        if let Some(claimed) = frame.client_id.as_deref()
            && !claimed.is_empty()
            && claimed != self.client_id
        {
            return Err(Mismatch::ClientId);
        }
        if frame.kind != ClientMessageType::Heartbeat
            && let Some(claimed) = frame.client_type
            && claimed != self.client_type
        {
            return Err(Mismatch::ClientType);
        }
        Ok(())
    }
}
