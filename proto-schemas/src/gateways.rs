//! What gateways ask each other on their delivery subjects (`deliver.{gateway}`).
//!
//! A constellation's device-info request about a device on another gateway is answered by the
//! gateway holding the device. Requests to the same gateway that are on their way at once
//! travel together: a [`DeviceInfoRequest`] naming every device, answered by one
//! [`DeviceInfoReply`] in the same order. (A lone request has no payload and names its device
//! in the `Aip-Client` header; see `aip_bus::names::DEVICE_INFO`.)

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::V1;

/// Devices one [`DeviceInfoRequest`] names at most.
pub const MAX_DEVICE_INFO_BATCH: usize = 256;

/// Several constellations' device-info requests to the gateway thought to hold the devices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DeviceInfoRequest {
    /// Always 1.
    pub version: V1,
    /// The devices asked about, in the order of the answers (at most 256).
    pub device_ids: Vec<String>,
}

/// The answers to a [`DeviceInfoRequest`], one per device named, in its order.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct DeviceInfoReply {
    /// Always 1.
    pub version: V1,
    /// One per device of the request.
    pub devices: Vec<HeldDevice>,
}

/// What the gateway asked knows of one device.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum HeldDevice {
    /// The system information the device registered with.
    Info(#[schemars(with = "serde_json::Value")] Box<RawValue>),
    /// The device is registered here and sent no system information.
    NoSystemInfo,
    /// The device is not registered here: the asker asks the registry where it is.
    NotHeld,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_reads_back_with_each_device_in_its_place() {
        let reply = DeviceInfoReply {
            version: V1,
            devices: vec![
                HeldDevice::Info(
                    RawValue::from_string(r#"{"os":"linux"}"#.to_owned()).expect("JSON"),
                ),
                HeldDevice::NoSystemInfo,
                HeldDevice::NotHeld,
            ],
        };
        let text = serde_json::to_string(&reply).expect("encoded");
        assert_eq!(
            text,
            r#"{"version":1,"devices":[{"info":{"os":"linux"}},"no_system_info","not_held"]}"#
        );
        let back: DeviceInfoReply = serde_json::from_str(&text).expect("read back");
        assert!(
            matches!(&back.devices[0], HeldDevice::Info(info) if info.get() == r#"{"os":"linux"}"#)
        );
        assert!(matches!(back.devices[1], HeldDevice::NoSystemInfo));
        assert!(matches!(back.devices[2], HeldDevice::NotHeld));
    }
}
