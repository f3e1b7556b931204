//! DEVICE_INFO_REQUEST: a constellation asks for a device's system information.
//!
//! Answered from this gateway's own devices ([`crate::devices`]) when the device is one of
//! them; else by the gateway holding the device, asked on its delivery subject
//! ([`aip_bus::names::DEVICE_INFO`]), which answers from its own table: no registry request
//! and no database read. Requests to the same gateway on their way at once go together
//! ([`crate::peers`]). Which gateway that is comes from the registry, the first time (its
//! record answers that request), and is remembered ([`crate::devices::Holders`]) until that
//! gateway no longer holds the device. Only a constellation may ask, and one registered for a
//! device only about that device.

use aip_bus::RegistryError;
use proto_schemas::registry::AgentStatus;
use proto_schemas::{ClientMessage, ClientType, ErrorCode, server};

use crate::client::{Client, End};
use crate::identity::Identity;
use crate::peers::Held;
use crate::replies;

pub(crate) async fn handle(
    client: &Client,
    identity: &Identity,
    frame: &ClientMessage,
) -> Result<(), End> {
    let connection = &client.connection;
    let request_id = frame.request_id.as_deref();
    if identity.client_type != ClientType::Constellation {
        return Ok(connection.write(&server::error(
            ErrorCode::Forbidden,
            "DEVICE_INFO_REQUEST is permitted only for constellation clients",
        ))?);
    }
    let target = frame.target_id.clone().unwrap_or_default();
    if let Some(bound) = &identity.target_id
        && *bound != target
    {
        return Ok(connection.write(&server::error(
            ErrorCode::Forbidden,
            "Not authorized to request device info for this device",
        ))?);
    }
    let no_system_info = || {
        server::device_info_error(
            request_id,
            format!("Device {target} has no system info"),
            ErrorCode::DeviceNotFound,
        )
    };
    if let Some(device) = client.state.devices.get(&target) {
        let Some(info) = &device.system_info else {
            return Ok(connection.write(&no_system_info())?);
        };
        return match replies::device_info(request_id, info) {
            Ok(text) => Ok(connection.write_text(text)?),
            Err(e) => {
                tracing::error!(device = %target, "device info answer not serialisable: {e}");
                Ok(connection.write(&server::device_info_error(
                    request_id,
                    format!("Device {target}'s system info could not be sent: {e}"),
                    ErrorCode::Internal,
                ))?)
            }
        };
    }
    if let Some(gateway) = client.state.holders.get(&target) {
        match client.state.peers.ask(&gateway, &target).await {
            Held::Info(info) => {
                return match replies::device_info(request_id, &info) {
                    Ok(text) => Ok(connection.write_text(text)?),
                    Err(e) => Ok(connection.write(&server::device_info_error(
                        request_id,
                        format!("Device {target}'s system info could not be sent: {e}"),
                        ErrorCode::Internal,
                    ))?),
                };
            }
            Held::Refused(detail) => {
                return Ok(connection.write(&server::device_info_error(
                    request_id,
                    detail,
                    ErrorCode::DeviceNotFound,
                ))?);
            }
            // The next request asks the registry again.
            Held::Failed(e) => {
                client.state.holders.forget(&target, &gateway);
                return Ok(connection.write(&server::device_info_error(
                    request_id,
                    e,
                    ErrorCode::Unavailable,
                ))?);
            }
            // Not there any more: the registry knows where it is, if anywhere.
            Held::NotHeld => client.state.holders.forget(&target, &gateway),
        }
    }
    let agent = match client.state.registry.get(&target).await {
        Ok(agent) => Some(agent),
        Err(RegistryError::Refused(_)) => None,
        Err(e) => {
            return Ok(connection.write(&server::device_info_error(
                request_id,
                e.to_string(),
                ErrorCode::Unavailable,
            ))?);
        }
    };
    let answer = match agent {
        Some(agent)
            if agent.status != AgentStatus::Offline && agent.client_type == ClientType::Device =>
        {
            if agent.gateway_id != client.state.gateway_id {
                client.state.holders.remember(&target, &agent.gateway_id);
            }
            match agent.system_info {
                Some(info) => server::device_info(request_id, info),
                None => no_system_info(),
            }
        }
        _ => server::device_info_error(
            request_id,
            format!("Device {target} not found or no system info available"),
            ErrorCode::DeviceNotFound,
        ),
    };
    Ok(connection.write(&answer)?)
}
