//! Devices registered on this gateway, with the system information they registered with.
//!
//! A constellation's DEVICE_INFO_REQUEST about a device connected to this same gateway is
//! answered from here, without a registry request and a database read; a request about a
//! device on another gateway goes to that gateway ([`Holders`] remembers which one, after the
//! registry named it once). This is what UFO's own server does: it answers from the
//! registrations it holds.
//!
//! An entry lives exactly as long as the device's registration on this gateway: it is added
//! once the registry has confirmed the registration, and removed when the connection ends,
//! before the registry is told, so a device that left is never served from here. A device
//! that registers again (with new system information) does so on a new connection, which
//! replaces the entry; the old connection's end then leaves the new entry alone.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use serde_json::value::RawValue;

/// A device registered on this gateway.
#[derive(Debug)]
pub struct LocalDevice {
    /// The connection holding the registration (only that connection removes the entry).
    pub connection_id: String,
    /// `metadata.system_info` of its REGISTER, serialised once; `None` if it sent none.
    pub system_info: Option<Box<RawValue>>,
}

/// The devices registered on this gateway, by client id.
#[derive(Debug, Default)]
pub struct LocalDevices {
    devices: RwLock<HashMap<String, Arc<LocalDevice>>>,
}

impl LocalDevices {
    /// Records the registration of `device_id` on `connection_id`, replacing any earlier one.
    pub fn insert(&self, device_id: &str, connection_id: &str, system_info: Option<Box<RawValue>>) {
        let device = Arc::new(LocalDevice {
            connection_id: connection_id.to_owned(),
            system_info,
        });
        self.write().insert(device_id.to_owned(), device);
    }

    /// Forgets `device_id` if `connection_id` still holds it.
    pub fn remove(&self, device_id: &str, connection_id: &str) {
        let mut devices = self.write();
        if devices
            .get(device_id)
            .is_some_and(|d| d.connection_id == connection_id)
        {
            devices.remove(device_id);
        }
    }

    /// The device, if it is registered on this gateway.
    pub fn get(&self, device_id: &str) -> Option<Arc<LocalDevice>> {
        self.devices
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(device_id)
            .cloned()
    }

    /// How many devices are registered here.
    pub fn len(&self) -> usize {
        self.devices.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, Arc<LocalDevice>>> {
        self.devices.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// Devices this gateway's holders table keeps at most; when full it starts again empty (each
/// device is then looked up in the registry once more).
const MAX_HOLDERS: usize = 100_000;

/// Which gateway holds each device on another gateway that a constellation here asked about,
/// so the next request goes straight to it. An entry is only a guess: it is forgotten when that
/// gateway answers that it does not hold the device (or no gateway answers), and the registry
/// is asked again.
#[derive(Debug, Default)]
pub struct Holders {
    holders: RwLock<HashMap<String, String>>,
}

impl Holders {
    /// The gateway last known to hold `device_id`.
    pub fn get(&self, device_id: &str) -> Option<String> {
        self.holders
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(device_id)
            .cloned()
    }

    /// Remembers that `gateway_id` holds `device_id`.
    pub fn remember(&self, device_id: &str, gateway_id: &str) {
        let mut holders = self.holders.write().unwrap_or_else(|p| p.into_inner());
        if holders.len() >= MAX_HOLDERS && !holders.contains_key(device_id) {
            holders.clear();
        }
        holders.insert(device_id.to_owned(), gateway_id.to_owned());
    }

    /// Forgets where `device_id` is, if it was thought to be on `gateway_id`.
    pub fn forget(&self, device_id: &str, gateway_id: &str) {
        let mut holders = self.holders.write().unwrap_or_else(|p| p.into_inner());
        if holders.get(device_id).is_some_and(|g| g == gateway_id) {
            holders.remove(device_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(json: &str) -> Option<Box<RawValue>> {
        Some(RawValue::from_string(json.to_owned()).expect("JSON"))
    }

    #[test]
    fn a_new_registration_replaces_the_entry_and_the_old_connection_leaves_it_alone() {
        let devices = LocalDevices::default();
        devices.insert("pc-1", "c1", info(r#"{"os":"old"}"#));
        devices.insert("pc-1", "c2", info(r#"{"os":"new"}"#));
        devices.remove("pc-1", "c1");
        let device = devices.get("pc-1").expect("still registered");
        assert_eq!(device.connection_id, "c2");
        assert_eq!(
            device.system_info.as_deref().map(RawValue::get),
            Some(r#"{"os":"new"}"#)
        );
        devices.remove("pc-1", "c2");
        assert!(devices.get("pc-1").is_none());
        assert!(devices.is_empty());
    }
}
