//! Generated artefacts: a JSON Schema per frame and subject payload, and the AsyncAPI 3
//! document of the whole broker.
//!
//! [`generated_files`] renders them; the test `tests/generated.rs` compares the result with the
//! files checked in under `proto-schemas/` and fails on any difference. Regenerate with
//! `AIP_UPDATE_SCHEMAS=1 cargo test -p proto-schemas --test generated`.

use schemars::generate::SchemaSettings;
use schemars::{JsonSchema, SchemaGenerator};
use serde_json::{Map, Value, json};

use crate::subjects::{CATALOGUE, DEFAULT_PREFIX, Pattern, SubjectSpec};
use crate::{error, flow, frames, gateways, registry, sessions};

/// One schema per name: every frame and subject payload.
fn schema_entries(generator: &mut SchemaGenerator) -> Vec<(&'static str, Value)> {
    macro_rules! entries {
        ($($name:literal => $ty:ty),+ $(,)?) => {
            vec![$(($name, generator.subschema_for::<$ty>().to_value())),+]
        };
    }
    entries! {
        "ClientMessage" => frames::ClientMessage,
        "ServerMessage" => frames::ServerMessage,
        "Command" => frames::Command,
        "Result" => frames::ActionResult,
        "MCPToolInfo" => frames::McpToolInfo,
        "SystemInfo" => frames::SystemInfo,
        "ErrorBody" => error::ErrorBody,
        "RegisterAgent" => registry::RegisterAgent,
        "RegisterReply" => registry::RegisterReply,
        "UnregisterAgent" => registry::UnregisterAgent,
        "UnregisterReply" => registry::UnregisterReply,
        "RegistryWrites" => registry::RegistryWrites,
        "RegistryWritesReply" => registry::RegistryWritesReply,
        "GetAgent" => registry::GetAgent,
        "GetAgentReply" => registry::GetAgentReply,
        "GetAgents" => registry::GetAgents,
        "GetAgentsReply" => registry::GetAgentsReply,
        "LookupAgents" => registry::LookupAgents,
        "LookupReply" => registry::LookupReply,
        "AgentRecord" => registry::AgentRecord,
        "PresenceBatch" => registry::PresenceBatch,
        "GatewayStarted" => registry::GatewayStarted,
        "GatewayStartedReply" => registry::GatewayStartedReply,
        "ManageAgents" => registry::ManageAgents,
        "ManageAgentsReply" => registry::ManageAgentsReply,
        "DeliveryAck" => sessions::DeliveryAck,
        "DeliveryBatch" => sessions::DeliveryBatch<'static>,
        "DeviceInfoRequest" => gateways::DeviceInfoRequest,
        "DeviceInfoReply" => gateways::DeviceInfoReply,
        "TaskRequest" => flow::TaskRequest,
        "TaskResponse" => flow::TaskResponse,
        "HandoffNotification" => flow::HandoffNotification,
        "ClarificationRequest" => flow::ClarificationRequest,
        "ClarificationResponse" => flow::ClarificationResponse,
        "CallbackNotification" => flow::CallbackNotification,
        "ErrorMessage" => flow::ErrorMessage,
        "GatewayEvent" => sessions::GatewayEvent,
        "BlobChunk" => sessions::BlobChunk,
        "SubmitReply" => registry::Reply<flow::SubmitOutcome>,
        "ClarifyReply" => registry::Reply<sessions::TaskView>,
        "HandoffRequest" => flow::HandoffRequest,
        "HandoffReply" => registry::Reply<sessions::TaskView>,
        "PlanRequest" => sessions::PlanRequest,
        "PlanReply" => registry::Reply<sessions::PlanStep>,
        "TaskEvent" => sessions::TaskEvent,
        "TaskView" => sessions::TaskView,
    }
}

/// Schemas for a document's components (`definitions_path` e.g. `/components/schemas/`):
/// the named entries `add` generates, and every type they refer to, all referring to each
/// other under that path.
pub fn components(
    settings: SchemaSettings,
    definitions_path: &str,
    add: impl FnOnce(&mut SchemaGenerator) -> Vec<(&'static str, Value)>,
) -> Map<String, Value> {
    let mut generator = settings
        .with(|s| s.definitions_path = definitions_path.to_owned().into())
        .into_generator();
    let entries = add(&mut generator);
    let mut definitions = generator.take_definitions(true);
    let mut out = Map::new();
    for (name, schema) in entries {
        // A named type comes back as a reference to its own definition: inline the definition.
        let own_ref = format!("#{definitions_path}{name}");
        let schema = match schema.get("$ref").and_then(Value::as_str) {
            Some(r) if r == own_ref => definitions.remove(name).unwrap_or(schema),
            _ => schema,
        };
        out.insert(name.to_owned(), schema);
    }
    for (name, schema) in definitions {
        out.entry(name).or_insert(schema);
    }
    out
}

/// The standalone JSON Schema (draft 2020-12) of one type.
pub fn standalone_schema<T: JsonSchema>() -> Value {
    SchemaSettings::draft2020_12()
        .into_generator()
        .into_root_schema_for::<T>()
        .to_value()
}

fn pretty(value: &Value) -> String {
    let mut s = serde_json::to_string_pretty(value).unwrap_or_default();
    s.push('\n');
    s
}

/// Every generated file: `(path relative to proto-schemas/, contents)`.
pub fn generated_files() -> Vec<(String, String)> {
    let mut files = Vec::new();
    let mut generator = SchemaSettings::draft2020_12().into_generator();
    for (name, _) in schema_entries(&mut generator) {
        let schema = standalone_by_name(name);
        files.push((format!("schemas/{name}.json"), pretty(&schema)));
    }
    files.push(("asyncapi.json".to_owned(), pretty(&asyncapi())));
    files
}

fn standalone_by_name(name: &str) -> Value {
    macro_rules! by_name {
        ($($lit:literal => $ty:ty),+ $(,)?) => {
            match name { $($lit => standalone_schema::<$ty>(),)+ _ => Value::Null }
        };
    }
    by_name! {
        "ClientMessage" => frames::ClientMessage,
        "ServerMessage" => frames::ServerMessage,
        "Command" => frames::Command,
        "Result" => frames::ActionResult,
        "MCPToolInfo" => frames::McpToolInfo,
        "SystemInfo" => frames::SystemInfo,
        "ErrorBody" => error::ErrorBody,
        "RegisterAgent" => registry::RegisterAgent,
        "RegisterReply" => registry::RegisterReply,
        "UnregisterAgent" => registry::UnregisterAgent,
        "UnregisterReply" => registry::UnregisterReply,
        "RegistryWrites" => registry::RegistryWrites,
        "RegistryWritesReply" => registry::RegistryWritesReply,
        "GetAgent" => registry::GetAgent,
        "GetAgentReply" => registry::GetAgentReply,
        "GetAgents" => registry::GetAgents,
        "GetAgentsReply" => registry::GetAgentsReply,
        "LookupAgents" => registry::LookupAgents,
        "LookupReply" => registry::LookupReply,
        "AgentRecord" => registry::AgentRecord,
        "PresenceBatch" => registry::PresenceBatch,
        "GatewayStarted" => registry::GatewayStarted,
        "GatewayStartedReply" => registry::GatewayStartedReply,
        "ManageAgents" => registry::ManageAgents,
        "ManageAgentsReply" => registry::ManageAgentsReply,
        "DeliveryAck" => sessions::DeliveryAck,
        "DeliveryBatch" => sessions::DeliveryBatch<'static>,
        "DeviceInfoRequest" => gateways::DeviceInfoRequest,
        "DeviceInfoReply" => gateways::DeviceInfoReply,
        "TaskRequest" => flow::TaskRequest,
        "TaskResponse" => flow::TaskResponse,
        "HandoffNotification" => flow::HandoffNotification,
        "ClarificationRequest" => flow::ClarificationRequest,
        "ClarificationResponse" => flow::ClarificationResponse,
        "CallbackNotification" => flow::CallbackNotification,
        "ErrorMessage" => flow::ErrorMessage,
        "GatewayEvent" => sessions::GatewayEvent,
        "BlobChunk" => sessions::BlobChunk,
        "SubmitReply" => registry::Reply<flow::SubmitOutcome>,
        "ClarifyReply" => registry::Reply<sessions::TaskView>,
        "HandoffRequest" => flow::HandoffRequest,
        "HandoffReply" => registry::Reply<sessions::TaskView>,
        "PlanRequest" => sessions::PlanRequest,
        "PlanReply" => registry::Reply<sessions::PlanStep>,
        "TaskEvent" => sessions::TaskEvent,
        "TaskView" => sessions::TaskView,
    }
}

fn camel(name: &str) -> String {
    name.split(['.', '_'])
        .enumerate()
        .map(|(i, part)| {
            let mut chars = part.chars();
            match (i, chars.next()) {
                (0, Some(c)) => c.to_ascii_lowercase().to_string() + chars.as_str(),
                (_, Some(c)) => c.to_ascii_uppercase().to_string() + chars.as_str(),
                (_, None) => String::new(),
            }
        })
        .collect()
}

/// The AsyncAPI 3.0 document: the WebSocket channel with frames both ways, and every NATS
/// subject with its payload, publishers and consumers.
pub fn asyncapi() -> Value {
    let settings = SchemaSettings::draft07();
    let schemas = components(settings, "/components/schemas/", schema_entries);

    let mut messages = Map::new();
    for name in schemas.keys() {
        messages.insert(
            name.clone(),
            json!({ "name": name, "contentType": "application/json", "payload": { "$ref": format!("#/components/schemas/{name}") } }),
        );
    }

    let mut channels = Map::new();
    let mut operations = Map::new();
    channels.insert(
        "websocket".to_owned(),
        json!({
            "address": "/ws",
            "title": "AIP WebSocket",
            "description": "One JSON object per text frame. Clients authenticate with `?token=` or \
                `Authorization: Bearer`; the first frame must be `register`. Frames up to 100 MiB.",
            "servers": [{ "$ref": "#/servers/gateway" }],
            "messages": {
                "ClientMessage": { "$ref": "#/components/messages/ClientMessage" },
                "ServerMessage": { "$ref": "#/components/messages/ServerMessage" }
            }
        }),
    );
    operations.insert(
        "receiveClientFrames".to_owned(),
        json!({
            "action": "receive",
            "title": "aip-gateway receives client frames",
            "channel": { "$ref": "#/channels/websocket" },
            "messages": [{ "$ref": "#/channels/websocket/messages/ClientMessage" }]
        }),
    );
    operations.insert(
        "sendServerFrames".to_owned(),
        json!({
            "action": "send",
            "title": "aip-gateway sends server frames",
            "channel": { "$ref": "#/channels/websocket" },
            "messages": [{ "$ref": "#/channels/websocket/messages/ServerMessage" }]
        }),
    );
    for spec in CATALOGUE {
        add_subject(spec, &mut channels, &mut operations);
    }

    json!({
        "asyncapi": "3.0.0",
        "info": {
            "title": "aip",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "AIP (Agent Interaction Protocol of Microsoft UFO / Galaxy) on the aip broker: \
                the WebSocket channel clients use, and the NATS subjects between aip-gateway, \
                aip-registry and aip-sessions. Subjects are shown with the default prefix `aip`; \
                `{…}` parameters are ids encoded as single subject tokens (bytes outside \
                A-Z a-z 0-9 _ - become ~XX)."
        },
        "defaultContentType": "application/json",
        "servers": {
            "gateway": { "host": "localhost:5000", "protocol": "ws", "description": "aip-gateway (or `aip dev`)" },
            "nats": { "host": "localhost:4222", "protocol": "nats", "description": "NATS with JetStream" }
        },
        "channels": channels,
        "operations": operations,
        "components": { "schemas": schemas, "messages": messages }
    })
}

fn add_subject(
    spec: &SubjectSpec,
    channels: &mut Map<String, Value>,
    operations: &mut Map<String, Value>,
) {
    let address = format!("{DEFAULT_PREFIX}.{}", spec.template);
    let mut parameters = Map::new();
    for part in spec.template.split('.') {
        if let Some(param) = part.strip_prefix('{').and_then(|p| p.strip_suffix('}')) {
            parameters.insert(
                param.to_owned(),
                json!({ "description": format!("the {param} id, encoded as one subject token") }),
            );
        }
    }
    let pattern = match spec.pattern {
        Pattern::Publish => "core NATS publish",
        Pattern::RequestReply => "core NATS request/reply",
        Pattern::JetStream => {
            "JetStream (durable consumer, explicit acks, Nats-Msg-Id de-duplication)"
        }
    };
    let description = format!(
        "{} Transport: {pattern}. Published by: {}. Consumed by: {}.",
        spec.description,
        spec.publishers.join(", "),
        spec.consumers.join(", ")
    );
    let mut channel_messages = Map::new();
    channel_messages.insert(
        spec.payload.to_owned(),
        json!({ "$ref": format!("#/components/messages/{}", spec.payload) }),
    );
    let mut channel = json!({
        "address": address,
        "description": description,
        "servers": [{ "$ref": "#/servers/nats" }],
        "messages": channel_messages,
        "x-publishers": spec.publishers,
        "x-consumers": spec.consumers,
    });
    if !parameters.is_empty() {
        channel["parameters"] = Value::Object(parameters);
    }
    let id = camel(spec.name);
    let mut reply_channel_id = None;
    if let Some(reply) = spec.reply {
        let reply_id = format!("{id}Reply");
        channels.insert(
            reply_id.clone(),
            json!({
                "address": null,
                "description": format!("The reply inbox of `{address}`."),
                "servers": [{ "$ref": "#/servers/nats" }],
                "messages": { reply: { "$ref": format!("#/components/messages/{reply}") } }
            }),
        );
        reply_channel_id = Some((reply_id, reply));
    }
    channels.insert(id.clone(), channel);

    let message_ref = json!([{ "$ref": format!("#/channels/{id}/messages/{}", spec.payload) }]);
    let mut send = json!({
        "action": "send",
        "title": format!("{} publishes", spec.publishers.join(", ")),
        "channel": { "$ref": format!("#/channels/{id}") },
        "messages": message_ref,
    });
    let mut receive = json!({
        "action": "receive",
        "title": format!("{} consumes", spec.consumers.join(", ")),
        "channel": { "$ref": format!("#/channels/{id}") },
        "messages": message_ref,
    });
    if let Some((reply_id, reply)) = reply_channel_id {
        let reply_obj = json!({
            "channel": { "$ref": format!("#/channels/{reply_id}") },
            "messages": [{ "$ref": format!("#/channels/{reply_id}/messages/{reply}") }]
        });
        send["reply"] = reply_obj.clone();
        receive["reply"] = reply_obj;
    }
    operations.insert(format!("{id}Send"), send);
    operations.insert(format!("{id}Receive"), receive);
}
