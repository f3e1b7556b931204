//! REGISTER: the first frame of every connection, and the registration's end.
//!
//! The registry decides (identity taken, principal allowed); the gateway checks the frame
//! and the credential first. A refused registration gets an ERROR frame and a close.

use std::sync::Arc;

use aip_bus::{Headers, RegistryError, names};
use proto_schemas::registry::{RegisterAgent, UnregisterAgent};
use proto_schemas::{
    ClientMessage, ClientMessageType, ClientType, ErrorCode, FrameError, V1, register_details,
    server,
};
use serde_json::value::RawValue;

use crate::AppState;
use crate::client::{Client, End, Registration};
use crate::connection::close;
use crate::identity::Identity;

/// Registers the client that sent `frame`, or refuses it.
pub(crate) async fn handle(
    client: &mut Client,
    frame: Result<Box<ClientMessage>, FrameError>,
) -> Result<Registration, End> {
    let frame = match frame {
        Ok(frame) => frame,
        Err(e) => {
            let text = format!("registration refused: {e}");
            return Err(refuse(client, e.code, text, close::PROTOCOL));
        }
    };
    if frame.kind != ClientMessageType::Register {
        let text = format!("the first frame must be `register`, got `{}`", frame.kind);
        return Err(refuse(
            client,
            ErrorCode::ProtocolError,
            text,
            close::PROTOCOL,
        ));
    }
    let details = match register_details(&frame) {
        Ok(details) => details,
        Err(e) => {
            let text = format!("registration refused: {e}");
            return Err(refuse(client, e.code, text, close::PROTOCOL));
        }
    };
    let client_id = frame.client_id.clone().unwrap_or_default();
    let client_type = frame.client_type_or_default();
    if !client.principal.may_register(&client_id, client_type) {
        let text = format!(
            "credential `{}` may not register as {} `{client_id}`",
            client.principal.name,
            client_type.as_str()
        );
        return Err(refuse(client, ErrorCode::Forbidden, text, close::POLICY));
    }
    let target_id = frame.target_id.clone().filter(|t| !t.is_empty());
    if client_type == ClientType::Constellation
        && let Some(target) = &target_id
        && !client
            .principal
            .may_target(&client.state.registry, target)
            .await
    {
        let text = format!(
            "credential `{}` may not target device `{target}`",
            client.principal.name
        );
        return Err(refuse(client, ErrorCode::Forbidden, text, close::POLICY));
    }
    let local_info = if client_type == ClientType::Device {
        local_system_info(&client_id, details.system_info.as_ref())
    } else {
        None
    };
    let state = client.state.clone();
    if !started(&state).await {
        return Err(refuse(
            client,
            ErrorCode::Unavailable,
            "the gateway is starting: the registry has not confirmed it yet; try again shortly"
                .to_owned(),
            close::TRY_AGAIN,
        ));
    }
    let request = RegisterAgent {
        version: V1,
        agent_id: client_id.clone(),
        client_type,
        gateway_id: state.gateway_id.clone(),
        connection_id: client.connection_id.clone(),
        principal: client.principal.name.clone(),
        platform: details.platform,
        target_id: if client_type == ClientType::Constellation {
            target_id.clone()
        } else {
            None
        },
        capabilities: details.capabilities,
        tools: details.tools,
        system_info: details.system_info,
        metadata: frame.metadata.clone().map(serde_json::Value::Object),
        extensions: details.extensions.clone(),
    };
    // Open before confirming, so nothing published right after registration is lost.
    let deliveries = match state.routes.open(&client_id, &client.connection_id) {
        Ok(deliveries) => deliveries,
        Err(e) => {
            let text = format!("registration failed: {e}");
            return Err(refuse(
                client,
                ErrorCode::Unavailable,
                text,
                close::TRY_AGAIN,
            ));
        }
    };
    let registered = match state.registrations.register(request).await {
        Ok(registered) => registered,
        Err(RegistryError::Refused(body)) => {
            return Err(refuse(client, body.error_code, body.detail, close::NORMAL));
        }
        Err(ref e) if let Some(too_large) = too_large_for_the_bus(e) => {
            let text = format!(
                "registration refused: the REGISTER is too large to pass to the registry ({too_large}); send less in `metadata`"
            );
            return Err(refuse(
                client,
                ErrorCode::FrameTooLarge,
                text,
                close::TOO_BIG,
            ));
        }
        Err(e) => {
            return Err(refuse(
                client,
                ErrorCode::Unavailable,
                e.to_string(),
                close::TRY_AGAIN,
            ));
        }
    };
    if let Some(old) = registered.replaced_connection {
        close_replaced(&state, &client_id, old, registered.replaced_gateway).await;
    }
    if let Some(info) = local_info {
        state
            .devices
            .insert(&client_id, &client.connection_id, info);
    }
    let liveness = state.presence.insert(&client.connection_id, &client_id);
    tracing::debug!(client = %client_id, kind = client_type.as_str(), connection = %client.connection_id, "registered");
    let confirmation = server::registered(&details.extensions);
    // From here on the connection's end is reported, even if the confirmation below is the
    // write that fails.
    client.identity = Some(Arc::new(Identity {
        client_id,
        client_type,
        target_id,
        platform: details.platform,
        extensions: details.extensions,
    }));
    client.connection.write(&confirmation)?;
    Ok(Registration {
        deliveries,
        liveness,
    })
}

/// The bus's refusal when the registration could not be sent because it is larger than one
/// bus message: trying again cannot help.
fn too_large_for_the_bus(error: &RegistryError) -> Option<&aip_bus::BusError> {
    match error {
        RegistryError::Unanswered(e @ aip_bus::BusError::PayloadTooLarge { .. }) => Some(e),
        RegistryError::Gathered(error) => too_large_for_the_bus(error),
        _ => None,
    }
}

/// Waits (at most the registry's request timeout) until the registry confirmed this gateway's
/// start; false if it has not.
async fn started(state: &AppState) -> bool {
    let mut announced = state.announced.clone();
    let patience = std::time::Duration::from_millis(state.settings.gateway.request_timeout_ms);
    matches!(
        tokio::time::timeout(patience, announced.wait_for(|started| *started)).await,
        Ok(Ok(_))
    )
}

/// A device's system info, serialised once for the device-info requests this gateway answers
/// itself ([`crate::devices`]). `None`: requests about this client go to the registry.
fn local_system_info(
    client_id: &str,
    system_info: Option<&serde_json::Value>,
) -> Option<Option<Box<RawValue>>> {
    match system_info.map(serde_json::value::to_raw_value).transpose() {
        Ok(info) => Some(info),
        Err(e) => {
            tracing::error!(client = %client_id, "system_info not serialisable; device info comes from the registry: {e}");
            None
        }
    }
}

/// Tells the gateway holding the stale connection of a client that registered again to
/// close it.
async fn close_replaced(
    state: &AppState,
    client_id: &str,
    old_connection: String,
    old_gateway: Option<String>,
) {
    let Some(old_gateway) = old_gateway else {
        tracing::warn!(client = %client_id, connection = %old_connection, "the registry did not say which gateway holds the stale connection; it ends when its gateway finds it silent");
        return;
    };
    let headers = Headers::new()
        .with(names::CONTROL, "disconnect")
        .with(names::CLIENT, client_id)
        .with(names::CONNECTION, old_connection);
    let subject = state.subjects.deliver(&old_gateway);
    if let Err(e) = state
        .bus
        .publish(subject, headers, Default::default())
        .await
    {
        tracing::warn!(client = %client_id, "could not tell the stale connection to close: {e}");
    }
}

/// A refused registration: the ERROR frame saying why, then the close.
fn refuse(client: &Client, code: ErrorCode, text: String, close_code: u16) -> End {
    client.connection.write_last(
        &server::error(code, &text),
        close_code,
        "registration refused",
    );
    End::RegistrationRefused(text)
}

/// REGISTER again on a registered connection: UFO's server answers it as an unknown type.
pub(crate) fn already_registered(client: &Client) -> Result<(), End> {
    Ok(client.connection.write(&server::error(
        ErrorCode::ProtocolError,
        "Unknown message type: register (already registered)",
    ))?)
}

/// Tells the registry that the connection ended. If it does not hear it, it still learns it
/// from the missing presence, within its window.
pub(crate) async fn unregister(
    state: &AppState,
    identity: &Identity,
    connection_id: &str,
    reason: &str,
) {
    let request = UnregisterAgent {
        version: V1,
        agent_id: identity.client_id.clone(),
        connection_id: connection_id.to_owned(),
        reason: reason.to_owned(),
    };
    if let Err(e) = state.registrations.unregister(request).await {
        tracing::warn!(client = %identity.client_id, "unregister not confirmed: {e}");
    }
}
