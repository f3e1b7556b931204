//! The two frame shapes of AIP, as they travel on the WebSocket.
//!
//! [`ClientMessage`] is what clients send, [`ServerMessage`] what the server sends; each is one
//! JSON object in one WebSocket text frame. Field names and optionality are UFO's pydantic models
//! (`ufo-aip.schema.json`): `type` and `status` are required, everything else is optional, `null`
//! and absent mean the same, and unknown keys are ignored on input.
//!
//! On output this crate omits absent fields instead of writing `null`: UFO's clients are pydantic
//! models whose every optional field defaults to `None`, so an omitted key and a `null` parse to
//! the same model, and frames stay small (a heartbeat answer is 4 keys, not 15). The test
//! `ufo_schema` checks that every frame built here validates against UFO's own schema.

use schemars::JsonSchema;
use serde::de::{DeserializeOwned, IntoDeserializer};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

use crate::enums::{
    ClientMessageType, ClientType, ResultStatus, ServerMessageType, TaskStatus, ToolType,
};

/// A JSON object, as used for `metadata`, `parameters` and schema fields.
pub type JsonObject = Map<String, Value>;

/// Reads an enum field from a JSON string only.
///
/// serde's derived enum `Deserialize` also accepts the externally tagged form (`{"ok": null}`
/// for `"ok"`), which UFO's models reject and which does not survive a round trip: on the wire
/// an enum value is exactly one lowercase string.
fn enum_from_string<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: DeserializeOwned,
{
    let value = String::deserialize(deserializer)?;
    T::deserialize(IntoDeserializer::<D::Error>::into_deserializer(value))
}

/// [`enum_from_string`] for an optional field: `null` (or absent, with `serde(default)`) is `None`.
fn optional_enum_from_string<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: DeserializeOwned,
{
    match Option::<String>::deserialize(deserializer)? {
        None => Ok(None),
        Some(value) => {
            T::deserialize(IntoDeserializer::<D::Error>::into_deserializer(value)).map(Some)
        }
    }
}

/// A frame sent by a client (device or constellation) to the server: UFO's `ClientMessage`.
///
/// Parse untrusted input with [`crate::parse_client_frame`], which also applies the per-frame
/// rules of [`crate::validate`]; plain `serde_json::from_slice` only checks the shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ClientMessage {
    /// What this frame is.
    #[serde(rename = "type", deserialize_with = "enum_from_string")]
    pub kind: ClientMessageType,
    /// The frame's status; its meaning depends on `type`.
    #[serde(deserialize_with = "enum_from_string")]
    pub status: TaskStatus,
    /// Device or constellation; absent or `null` means `device` (UFO's default).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "optional_enum_from_string"
    )]
    pub client_type: Option<ClientType>,
    /// The session this frame belongs to (task, command_results, task_end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// Human-readable task name (task).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_name: Option<String>,
    /// The sender's id; required in `register`, after that absent means "the registered one".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_id: Option<String>,
    /// The device a constellation addresses (register, task, device_info_request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_id: Option<String>,
    /// The task text (task); the question or answer text of clarification extension frames.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<String>,
    /// One Result per Command of the answered `command` frame, in order (command_results).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action_results: Option<Vec<ActionResult>>,
    /// ISO 8601 with offset, e.g. `2026-06-26T09:00:00.123456+00:00`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<String>,
    /// Correlation id of a request (device_info_request, command_results).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// The `response_id` of the `command` frame these results answer (command_results).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prev_response_id: Option<String>,
    /// Human-readable error text (error, task_end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Free-form object: system info and platform at register, extension payloads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<JsonObject>,
    /// Extension (not in UFO's model): the result of an agent-driven task in a client
    /// `task_end`. Accepted only from clients that negotiated `task_end_result`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
}

impl ClientMessage {
    /// A frame of the given type and status with every optional field absent.
    pub fn new(kind: ClientMessageType, status: TaskStatus) -> Self {
        ClientMessage {
            kind,
            status,
            client_type: None,
            session_id: None,
            task_name: None,
            client_id: None,
            target_id: None,
            request: None,
            action_results: None,
            timestamp: None,
            request_id: None,
            prev_response_id: None,
            error: None,
            metadata: None,
            result: None,
        }
    }

    /// The client type this frame claims, with UFO's default (`device`) when absent.
    pub fn client_type_or_default(&self) -> ClientType {
        self.client_type.unwrap_or(ClientType::Device)
    }

    /// A metadata value by key, if `metadata` is an object holding it.
    pub fn metadata_value(&self, key: &str) -> Option<&Value> {
        self.metadata.as_ref().and_then(|m| m.get(key))
    }
}

/// A frame sent by the server to a client: UFO's `ServerMessage`.
///
/// Build one with the constructors in [`crate::server`], which fill the fields each frame type
/// needs (and a timestamp and `response_id`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ServerMessage {
    /// What this frame is.
    #[serde(rename = "type", deserialize_with = "enum_from_string")]
    pub kind: ServerMessageType,
    /// The frame's status; its meaning depends on `type`.
    #[serde(deserialize_with = "enum_from_string")]
    pub status: TaskStatus,
    /// The task text of a server `task` frame.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_request: Option<String>,
    /// The UFO agent that runs the Commands (`HostAgent`, `LinuxAgent`, …). A UFO device
    /// never answers a `command` frame without one it knows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_name: Option<String>,
    /// Passed through to the device's agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process_name: Option<String>,
    /// Sub-configuration of the agent (empty or `default` for the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root_name: Option<String>,
    /// The Commands of a `command` frame.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actions: Option<Vec<Command>>,
    /// Log lines for the client.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages: Option<Vec<String>>,
    /// Human-readable error text (error, failed task_end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The session this frame belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// The task's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_name: Option<String>,
    /// ISO 8601 with offset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<String>,
    /// A fresh id for this frame; command results answer it in `prev_response_id`; a
    /// `device_info_response` carries the request's `request_id` here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_id: Option<String>,
    /// Any JSON: a task's result, a device's system info, negotiated extensions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// Extension (not in UFO's model; UFO's clients drop it): `error_code` on errors, and
    /// extension payloads. Never needed by a UFO client.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<JsonObject>,
}

impl ServerMessage {
    /// A frame of the given type and status with every optional field absent.
    pub fn new(kind: ServerMessageType, status: TaskStatus) -> Self {
        ServerMessage {
            kind,
            status,
            user_request: None,
            agent_name: None,
            process_name: None,
            root_name: None,
            actions: None,
            messages: None,
            error: None,
            session_id: None,
            task_name: None,
            timestamp: None,
            response_id: None,
            result: None,
            metadata: None,
        }
    }

    /// The error code carried in `metadata.error_code`, if any.
    pub fn error_code(&self) -> Option<&str> {
        self.metadata.as_ref()?.get("error_code")?.as_str()
    }
}

/// One tool call in a `command` frame: UFO's `Command`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, utoipa::ToSchema)]
pub struct Command {
    /// The tool to run, e.g. `list_tools`, `click_input`.
    pub tool_name: String,
    /// The tool's arguments.
    #[schema(value_type = Option<Object>)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<JsonObject>,
    /// `action` or `data_collection`; nothing else is valid.
    #[serde(deserialize_with = "enum_from_string")]
    pub tool_type: ToolType,
    /// Correlates this Command with its Result; the server gives each Command a fresh one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call_id: Option<String>,
}

/// The outcome of one Command: UFO's `Result` (renamed so it does not shadow Rust's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, utoipa::ToSchema)]
#[schemars(rename = "Result")]
#[schema(as = Result)]
pub struct ActionResult {
    /// Whether the command ran and how it went.
    #[serde(deserialize_with = "enum_from_string")]
    pub status: ResultStatus,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The tool's output: any JSON.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// The MCP namespace of the tool that ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The `call_id` of the Command this answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call_id: Option<String>,
}

impl ActionResult {
    /// As JSON, moving its `result` rather than copying it (a tool's output can be a
    /// screenshot of tens of MiB).
    pub fn into_value(mut self) -> Value {
        let result = self.result.take();
        let mut value = serde_json::to_value(&self).unwrap_or(Value::Null);
        if let (Some(fields), Some(result)) = (value.as_object_mut(), result) {
            fields.insert("result".to_owned(), result);
        }
        value
    }
}

/// A tool a device offers: UFO's `MCPToolInfo`, the items of a `list_tools` result and of
/// REGISTER `metadata.tools`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, utoipa::ToSchema)]
#[schemars(rename = "MCPToolInfo")]
#[schema(as = MCPToolInfo)]
pub struct McpToolInfo {
    /// `"<tool_type>::<tool_name>"`.
    pub tool_key: String,
    /// The tool's name.
    pub tool_name: String,
    /// Display title.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    /// The MCP namespace (server) the tool comes from.
    pub namespace: String,
    /// `action` or `data_collection` (a free string in UFO's model).
    pub tool_type: String,
    /// What the tool does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON Schema of the parameters.
    #[schema(value_type = Option<Object>)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_schema: Option<JsonObject>,
    /// JSON Schema of the result.
    #[schema(value_type = Option<Object>)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_schema: Option<JsonObject>,
    /// MCP metadata.
    #[schema(value_type = Option<Object>)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meta: Option<JsonObject>,
    /// MCP annotations.
    #[schema(value_type = Option<Object>)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<JsonObject>,
}

/// A device's system information, REGISTER `metadata.system_info`, returned verbatim in
/// `device_info_response`. Every field is optional; unknown ones are kept.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SystemInfo {
    /// The device's id (normally its `client_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_id: Option<String>,
    /// `windows`, `linux`, `mobile`, …
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
    /// Operating system version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub os_version: Option<String>,
    /// Logical CPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_count: Option<u32>,
    /// Memory in GiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_total_gb: Option<f64>,
    /// Host name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Address the device reports for itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_address: Option<String>,
    /// Features such as `gui`, `cli`; used as capabilities for lookup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub supported_features: Option<Vec<String>>,
    /// `computer`, `phone`, …
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform_type: Option<String>,
    /// Version of this structure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema_version: Option<String>,
    /// Anything else the device reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub custom_metadata: Option<JsonObject>,
    /// Unknown keys, kept as sent.
    #[serde(flatten)]
    pub extra: JsonObject,
}
