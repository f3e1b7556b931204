//! UFO-format frames, as UFO's own clients send them: every field present, unset ones `null`.

use serde_json::{Value, json};

/// Every ClientMessage field set to null, then `fields` over it.
pub fn client(fields: Value) -> Value {
    let mut frame = json!({
        "type": null, "status": null, "client_type": "device", "session_id": null, "task_name": null,
        "client_id": null, "target_id": null, "request": null, "action_results": null, "timestamp": "2026-11-22T02:53:49.028026+00:00",
        "request_id": null, "prev_response_id": null, "error": null, "metadata": null
    });
    if let (Some(base), Some(extra)) = (frame.as_object_mut(), fields.as_object()) {
        for (k, v) in extra {
            base.insert(k.clone(), v.clone());
        }
    }
    frame
}

/// A UFO device's REGISTER.
pub fn device_register(id: &str, platform: &str) -> Value {
    client(json!({
        "type": "register", "status": "ok", "client_type": "device", "client_id": id,
        "metadata": {
            "system_info": {
                "device_id": id, "platform": platform, "os_version": "test", "cpu_count": 4, "memory_total_gb": 8.0,
                "hostname": "aip-test-host", "ip_address": "127.0.0.1", "supported_features": ["gui", "cli"],
                "platform_type": "computer", "schema_version": "1.0", "custom_metadata": {}
            },
            "platform": platform,
            "registration_time": "2026-11-22T02:53:49.027967+00:00"
        }
    }))
}

/// A device REGISTER with extra capabilities.
pub fn device_register_with(id: &str, capabilities: &[&str]) -> Value {
    let mut frame = device_register(id, "linux");
    frame["metadata"]["capabilities"] = json!(capabilities);
    frame
}

/// A Galaxy constellation's REGISTER (`client_id` = `{task_name}@{device}`).
pub fn constellation_register(id: &str, target: Option<&str>) -> Value {
    client(json!({
        "type": "register", "status": "ok", "client_type": "constellation", "client_id": id, "target_id": target,
        "metadata": {
            "task_name": "aip_constellation", "version": "2.0", "capabilities": ["task_distribution"],
            "type": "constellation_client", "targeted_device_id": target,
            "registration_time": "2026-11-22T02:53:49.047812+00:00"
        }
    }))
}

pub fn heartbeat(id: &str, client_type: &str) -> Value {
    client(
        json!({ "type": "heartbeat", "status": "ok", "client_type": client_type, "client_id": id, "metadata": { "device_id": id } }),
    )
}

/// A constellation's device-info request.
pub fn device_info_request(id: &str, target: &str, request_id: &str) -> Value {
    client(json!({
        "type": "device_info_request", "status": "ok", "client_type": "constellation", "client_id": id,
        "target_id": target, "request_id": request_id
    }))
}

/// A constellation's TASK; `steps` (lists of Commands) go in `metadata.steps` for the
/// scripted planner.
pub fn constellation_task(
    id: &str,
    target: &str,
    session_id: &str,
    task_name: &str,
    steps: Option<Value>,
) -> Value {
    client(json!({
        "type": "task", "status": "continue", "client_type": "constellation", "client_id": id, "target_id": target,
        "task_name": task_name, "request": "open notepad and type hello", "session_id": session_id,
        "metadata": steps.map(|s| json!({ "steps": s }))
    }))
}

/// A device's answer to a command frame: one success Result per Command, in order.
pub fn command_results_for(id: &str, command: &Value) -> Value {
    let results: Vec<Value> = command["actions"]
        .as_array()
        .map(|actions| {
            actions
                .iter()
                .map(|a| json!({ "status": "success", "result": { "echo": a["parameters"] }, "namespace": "test", "call_id": a["call_id"] }))
                .collect()
        })
        .unwrap_or_default();
    client(json!({
        "type": "command_results", "status": "continue", "client_type": "device", "client_id": id,
        "session_id": command["session_id"], "prev_response_id": command["response_id"], "action_results": results,
        "request_id": uuid::Uuid::new_v4().to_string()
    }))
}

/// One step with one Command.
pub fn one_step(tool: &str, parameters: Value) -> Value {
    json!([[{ "tool_name": tool, "tool_type": "action", "parameters": parameters }]])
}
