//! The frames the gateway answers most often, written straight to text.
//!
//! Each function gives byte for byte what serialising the matching constructor of
//! [`proto_schemas::server`] gives (the tests compare them), without building a
//! [`proto_schemas::ServerMessage`] and copying a device's system information into a
//! `serde_json::Value` first: the wire format stays defined by proto-schemas.

use proto_schemas::server::timestamp_now;
use proto_schemas::{ServerMessageType, TaskStatus};
use serde::Serialize;
use serde_json::value::RawValue;

/// `server::device_info`: the fields it sets, in `ServerMessage`'s order.
#[derive(Serialize)]
struct DeviceInfoFrame<'a> {
    #[serde(rename = "type")]
    kind: ServerMessageType,
    status: TaskStatus,
    timestamp: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    response_id: Option<&'a str>,
    result: &'a RawValue,
}

/// The `device_info_response` carrying `system_info` (already serialised), answering the
/// request `request_id`; as `proto_schemas::server::device_info`.
pub fn device_info(
    request_id: Option<&str>,
    system_info: &RawValue,
) -> Result<String, serde_json::Error> {
    device_info_at(&timestamp_now(), request_id, system_info)
}

fn device_info_at(
    timestamp: &str,
    request_id: Option<&str>,
    system_info: &RawValue,
) -> Result<String, serde_json::Error> {
    let frame = DeviceInfoFrame {
        kind: ServerMessageType::DeviceInfoResponse,
        status: TaskStatus::Ok,
        timestamp,
        response_id: request_id,
        result: system_info,
    };
    serde_json::to_string(&frame)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto_schemas::server;
    use serde_json::json;

    #[test]
    fn device_info_is_what_proto_schemas_writes() {
        let info = json!({"os": "Windows 11", "cpu_count": 8, "nested": {"b": [1, 2.5, null], "a": "é\"\\"}});
        let raw = serde_json::value::to_raw_value(&info).expect("JSON");
        for request_id in [Some("device_info_pc-1_1782464400"), None] {
            let mut expected = server::device_info(request_id, info.clone());
            let ours = device_info(request_id, &raw).expect("serialisable");
            let parsed: proto_schemas::ServerMessage =
                serde_json::from_str(&ours).expect("a server frame");
            expected.timestamp = parsed.timestamp.clone();
            assert_eq!(
                ours,
                serde_json::to_string(&expected).expect("JSON"),
                "byte for byte"
            );
        }
    }
}
