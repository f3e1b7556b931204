//! DEVICE_INFO_REQUEST: a constellation asks for a device's system information.
//!
//! Answered from this gateway's own devices ([`crate::devices`]) when the device is one of
//! them; else by the gateway holding the device, asked on its delivery subject
//! ([`aip_bus::names::DEVICE_INFO`]), which answers from its own table: no registry request
//! and no database read. Which gateway that is comes from the registry, the first time (its
//! record answers that request), and is remembered ([`crate::devices::Holders`]) until that
//! gateway no longer holds the device. Only a constellation may ask, and one registered for a
//! device only about that device.

use std::time::Duration;

use aip_bus::{BusError, Headers, RegistryError, names};
use bytes::Bytes;
use proto_schemas::registry::AgentStatus;
use proto_schemas::{ClientMessage, ClientType, ErrorCode, server};
use serde_json::value::RawValue;

use crate::client::{Client, End};
use crate::identity::Identity;
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
        match ask_holder(client, &gateway, &target).await {
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
                    e.to_string(),
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

/// What the gateway holding a device answered.
enum Held {
    /// Its system information.
    Info(Box<RawValue>),
    /// Why there is none (it holds no such device, or the device sent none).
    Refused(String),
    /// That gateway does not hold it (or no gateway of that id is running).
    NotHeld,
    /// The bus failed, or the holder did not answer in time.
    Failed(BusError),
}

/// Asks `gateway`, thought to hold `device`.
async fn ask_holder(client: &Client, gateway: &str, device: &str) -> Held {
    let state = &client.state;
    let subject = state.subjects.deliver(gateway);
    let headers = Headers::new()
        .with(names::CONTROL, names::DEVICE_INFO)
        .with(names::CLIENT, device);
    let patience = Duration::from_millis(state.settings.gateway.request_timeout_ms);
    match state
        .bus
        .request(subject, headers, Bytes::new(), patience)
        .await
    {
        Ok(reply) if reply.headers.get(names::CONTROL) == Some(names::NOT_HELD) => Held::NotHeld,
        Ok(reply) if reply.headers.get(names::ERROR_CODE).is_some() => {
            Held::Refused(String::from_utf8_lossy(&reply.payload).into_owned())
        }
        Ok(reply) => match serde_json::from_slice::<Box<RawValue>>(&reply.payload) {
            Ok(info) => Held::Info(info),
            Err(e) => Held::Refused(format!(
                "Device {device}'s system info could not be read: {e}"
            )),
        },
        Err(BusError::NoResponders { .. }) => Held::NotHeld,
        Err(e) => Held::Failed(e),
    }
}
