//! What this crate writes is what UFO's own models accept.
//!
//! `tests/data/ufo-aip.schema.json` is the JSON Schema of UFO's pydantic frame models at
//! `b28183f` (top-level keys `ClientMessage`, `ServerMessage`, `Command`, `Result`,
//! `MCPToolInfo`, each with its own `$defs`). A UFO client that gets a frame outside this
//! schema fails to parse it and, for a `command`, never answers. These tests show that:
//!
//! - every frame the server can send, built with the constructors of [`proto_schemas::server`],
//!   validates against UFO's `ServerMessage`;
//! - our `Command`, `ActionResult` and `McpToolInfo` serialisations validate against UFO's
//!   `Command`, `Result` and `MCPToolInfo`;
//! - our enum strings are exactly the ones in UFO's schema;
//! - every fixture validates against UFO's schema exactly when the manifest says so, and every
//!   valid fixture of a UFO frame type, once parsed and re-serialised by us, validates; so does
//!   any frame `parse_client_frame` accepts (a property test);
//! - the schema does reject what UFO rejects (a bad `tool_type`, a Result status `completed`,
//!   `client_type: null`, an extension frame type), so these checks can fail.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};

use common::{Direction, UFO_CLIENT_TYPES, UFO_SERVER_TYPES};
use proptest::prelude::*;
use proto_schemas::server::{self, CommandTarget};
use proto_schemas::{
    ActionResult, ClientMessageType, ClientType, Command, ErrorCode, Extension, McpToolInfo,
    ResultStatus, ServerMessage, ServerMessageType, TaskStatus, ToolType,
};
use serde_json::{Value, json};

/// Panics with every schema error if `value` is not a valid `model`.
fn assert_valid(model: &str, what: &str, value: &Value) {
    let errors = common::ufo_schema().errors(model, value);
    assert!(
        errors.is_empty(),
        "{what} is not a valid UFO {model}:\n  {}\n{value:#}",
        errors.join("\n  ")
    );
}

fn assert_invalid(model: &str, what: &str, value: &Value) {
    assert!(
        !common::ufo_schema().validator(model).is_valid(value),
        "{what} should be refused by UFO's {model} schema: {value}"
    );
}

fn tool(name: &str, tool_type: ToolType, parameters: Option<Value>) -> Command {
    Command {
        tool_name: name.to_owned(),
        parameters: parameters.map(|p| match p {
            Value::Object(map) => map,
            other => panic!("parameters must be an object, got {other}"),
        }),
        tool_type,
        call_id: None,
    }
}

fn target(agent: &str) -> CommandTarget {
    CommandTarget {
        session_id: "galaxy_task@7f9c2e61-3b1a-4d7e-9a55-1c0b6f2d8e44".to_owned(),
        task_name: Some("galaxy_task".to_owned()),
        agent_name: agent.to_owned(),
        process_name: Some(String::new()),
        root_name: Some("default".to_owned()),
    }
}

/// Every kind of frame the server sends, from the constructors the services use.
fn every_server_frame() -> Vec<(String, ServerMessage)> {
    let system_info = json!({
        "device_id": "pc-1", "platform": "windows", "os_version": "10.0.26100", "cpu_count": 8,
        "memory_total_gb": 31.7, "hostname": "PC-1", "ip_address": "192.168.1.20",
        "supported_features": ["gui", "cli"], "platform_type": "computer",
        "schema_version": "1.0", "custom_metadata": {}
    });
    let list_tools = tool(
        "list_tools",
        ToolType::Action,
        Some(json!({"tool_type": "action"})),
    );
    let mut with_call_id = tool(
        "click_input",
        ToolType::Action,
        Some(json!({"id": "7", "button": "left", "double": false, "offset": [1, 2.5]})),
    );
    with_call_id.call_id = Some("preset-call-id".to_owned());
    let screenshot = tool("take_screenshot", ToolType::DataCollection, None);
    let empty_params = tool("get_ui_tree", ToolType::DataCollection, Some(json!({})));

    let mut frames = vec![
        ("registered(&[])".to_owned(), server::registered(&[])),
        (
            "registered(all extensions)".to_owned(),
            server::registered(Extension::ALL),
        ),
        (
            "registered(progress)".to_owned(),
            server::registered(&[Extension::Progress]),
        ),
        ("heartbeat()".to_owned(), server::heartbeat()),
        (
            "task_accepted".to_owned(),
            server::task_accepted("galaxy_task@7f9c2e61"),
        ),
        (
            "session_error".to_owned(),
            server::session_error(
                ErrorCode::DeviceNotFound,
                "Target device 'pc-9' is not connected",
                "galaxy_task@7f9c2e61",
            ),
        ),
        (
            "device_info(Some)".to_owned(),
            server::device_info(Some("device_info_pc-1_1782464400"), system_info.clone()),
        ),
        (
            "device_info(None)".to_owned(),
            server::device_info(None, system_info),
        ),
        (
            "device_info_error(Some)".to_owned(),
            server::device_info_error(
                Some("device_info_pc-9_1782464400"),
                "Device 'pc-9' is not connected",
                ErrorCode::DeviceNotFound,
            ),
        ),
        (
            "device_info_error(None)".to_owned(),
            server::device_info_error(None, "no such device", ErrorCode::DeviceNotFound),
        ),
        (
            "command(list_tools)".to_owned(),
            server::command(
                &target("HostAgent"),
                vec![list_tools.clone()],
                TaskStatus::Continue,
                server::new_id(),
            ),
        ),
        (
            "command(several, completed)".to_owned(),
            server::command(
                &target("LinuxAgent"),
                vec![list_tools, with_call_id, screenshot.clone(), empty_params],
                TaskStatus::Completed,
                server::new_id(),
            ),
        ),
        (
            "command(failed, no optional target fields)".to_owned(),
            server::command(
                &CommandTarget {
                    session_id: "s".to_owned(),
                    agent_name: "MobileAgent".to_owned(),
                    ..CommandTarget::default()
                },
                vec![screenshot],
                TaskStatus::Failed,
                server::new_id(),
            ),
        ),
        (
            "command(no actions)".to_owned(),
            server::command(
                &target("HostAgent"),
                Vec::new(),
                TaskStatus::Continue,
                server::new_id(),
            ),
        ),
        (
            "task_end(completed, result list)".to_owned(),
            server::task_end(
                "galaxy_task@7f9c2e61",
                TaskStatus::Completed,
                Some(
                    json!([{"request": "Say hello", "result": ""}, {"request": "b", "result": {"x": [1, null]}}]),
                ),
                None,
                &server::new_id(),
            ),
        ),
        (
            "task_end(failed, error)".to_owned(),
            server::task_end(
                "galaxy_task@7f9c2e61",
                TaskStatus::Failed,
                None,
                Some("Task was cancelled because target device disconnected".to_owned()),
                &server::new_id(),
            ),
        ),
        (
            "task_end(failed, result and error)".to_owned(),
            server::task_end(
                "s",
                TaskStatus::Failed,
                Some(json!({"failure": "session ended with an error"})),
                Some("COMMAND_FAILED: click_input failed".to_owned()),
                "r",
            ),
        ),
        (
            "dispatch_task".to_owned(),
            server::dispatch_task("list files", "dispatch_demo", &server::new_id()),
        ),
    ];
    for code in ErrorCode::ALL {
        frames.push((
            format!("error({})", code.as_str()),
            server::error(*code, format!("something failed: {}", code.as_str())),
        ));
    }
    frames
}

#[test]
fn every_server_frame_validates_against_ufos_server_message() {
    let frames = every_server_frame();
    assert!(frames.len() >= 25, "{} frames", frames.len());
    for (name, frame) in &frames {
        let value = serde_json::to_value(frame).expect("a ServerMessage serialises");
        assert_valid("ServerMessage", name, &value);
        // And it is a UFO frame type, and reads back as itself.
        assert!(
            UFO_SERVER_TYPES.contains(&frame.kind.as_str()),
            "{name}: `{}` is not one of UFO's server types",
            frame.kind
        );
        let again: ServerMessage = serde_json::from_value(value).expect("reads back");
        assert_eq!(&again, frame, "{name} does not read back as itself");
    }
}

#[test]
fn command_frames_carry_what_a_ufo_device_needs() {
    let frame = server::command(
        &target("HostAgent"),
        vec![
            tool(
                "list_tools",
                ToolType::Action,
                Some(json!({"tool_type": "action"})),
            ),
            tool("take_screenshot", ToolType::DataCollection, None),
        ],
        TaskStatus::Continue,
        "rid-1".to_owned(),
    );
    let value = serde_json::to_value(&frame).expect("serialises");
    assert_eq!(value["type"], "command");
    assert_eq!(value["status"], "continue");
    assert_eq!(value["agent_name"], "HostAgent");
    assert_eq!(value["response_id"], "rid-1");
    let actions = value["actions"].as_array().expect("actions is a list");
    assert_eq!(actions[0]["tool_type"], "action");
    assert_eq!(actions[1]["tool_type"], "data_collection");
    assert!(actions[1].get("parameters").is_none(), "absent, not null");
    for action in actions {
        assert!(
            action["call_id"].as_str().is_some_and(|id| !id.is_empty()),
            "every Command gets a call_id: {action}"
        );
        assert_valid("Command", "a Command of a command frame", action);
    }
}

#[test]
fn our_parts_validate_against_ufos_models() {
    for tool_type in ToolType::ALL {
        for parameters in [None, Some(json!({})), Some(json!({"a": [1, {"b": null}]}))] {
            for call_id in [None, Some("c-1".to_owned())] {
                let mut command = tool("t", *tool_type, parameters.clone());
                command.call_id = call_id;
                let value = serde_json::to_value(&command).expect("serialises");
                assert_valid("Command", "a Command", &value);
            }
        }
    }
    for status in ResultStatus::ALL {
        let bare = ActionResult {
            status: *status,
            error: None,
            result: None,
            namespace: None,
            call_id: None,
        };
        let full = ActionResult {
            status: *status,
            error: Some("Element not found".to_owned()),
            result: Some(json!({"clicked": false, "items": [1, "two", null]})),
            namespace: Some("HostUIExecutor".to_owned()),
            call_id: Some("c-1".to_owned()),
        };
        for result in [bare, full] {
            let value = serde_json::to_value(&result).expect("serialises");
            assert_valid("Result", "an ActionResult", &value);
        }
    }
    let bare = McpToolInfo {
        tool_key: "action::click_input".to_owned(),
        tool_name: "click_input".to_owned(),
        title: None,
        namespace: "HostUIExecutor".to_owned(),
        tool_type: "action".to_owned(),
        description: None,
        input_schema: None,
        output_schema: None,
        meta: None,
        annotations: None,
    };
    let object = |v: Value| v.as_object().cloned();
    let full = McpToolInfo {
        title: Some("Click".to_owned()),
        description: Some("Click a control".to_owned()),
        input_schema: object(json!({"type": "object", "properties": {"id": {"type": "string"}}})),
        output_schema: object(json!({"type": "object"})),
        meta: object(json!({"version": 2})),
        annotations: object(json!({"readOnlyHint": false})),
        ..bare.clone()
    };
    for info in [bare, full] {
        let value = serde_json::to_value(&info).expect("serialises");
        assert_valid("MCPToolInfo", "an McpToolInfo", &value);
    }
}

#[test]
fn fixture_parts_validate_as_the_manifest_says_and_after_our_round_trip() {
    for part in &common::manifest().parts {
        let model = match part.kind.as_str() {
            "command" => "Command",
            "result" => "Result",
            "mcp_tool_info" => "MCPToolInfo",
            other => panic!("unknown part kind {other}"),
        };
        let raw = part.json();
        assert_eq!(
            common::ufo_schema().validator(model).is_valid(&raw),
            part.ufo_schema,
            "{}: UFO schema validity differs from the manifest",
            part.file
        );
        let ours = match model {
            "Command" => {
                serde_json::to_value(serde_json::from_value::<Command>(raw).expect("valid Command"))
            }
            "Result" => serde_json::to_value(
                serde_json::from_value::<ActionResult>(raw).expect("valid Result"),
            ),
            _ => serde_json::to_value(
                serde_json::from_value::<McpToolInfo>(raw).expect("valid MCPToolInfo"),
            ),
        }
        .expect("serialises");
        assert_valid(model, &part.file, &ours);
    }
}

#[test]
fn our_enum_strings_are_ufos() {
    let doc = &common::ufo_schema().document;
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .unwrap_or_else(|| panic!("not an enum list: {v}"))
            .iter()
            .map(|s| s.as_str().expect("enum values are strings").to_owned())
            .collect()
    };
    let ours = |all: Vec<&str>| -> Vec<String> { all.into_iter().map(str::to_owned).collect() };
    let client_defs = &doc["ClientMessage"]["$defs"];
    let server_defs = &doc["ServerMessage"]["$defs"];

    // UFO's types come first, in UFO's order; the rest are extensions that UFO does not know.
    let client: Vec<&str> = ClientMessageType::ALL.iter().map(|t| t.as_str()).collect();
    assert_eq!(
        ours(client[..8].to_vec()),
        strings(&client_defs["ClientMessageType"]["enum"])
    );
    assert_eq!(client[..8], UFO_CLIENT_TYPES);
    assert_eq!(
        client[8..],
        [
            "progress",
            "clarification_request",
            "clarification_response",
            "handoff"
        ]
    );
    let server: Vec<&str> = ServerMessageType::ALL.iter().map(|t| t.as_str()).collect();
    assert_eq!(
        ours(server[..7].to_vec()),
        strings(&server_defs["ServerMessageType"]["enum"])
    );
    assert_eq!(server[..7], UFO_SERVER_TYPES);

    let status = ours(TaskStatus::ALL.iter().map(|t| t.as_str()).collect());
    assert_eq!(status, strings(&client_defs["TaskStatus"]["enum"]));
    assert_eq!(status, strings(&server_defs["TaskStatus"]["enum"]));
    assert_eq!(
        ours(ClientType::ALL.iter().map(|t| t.as_str()).collect()),
        strings(&client_defs["ClientType"]["enum"])
    );
    assert_eq!(
        ours(ResultStatus::ALL.iter().map(|t| t.as_str()).collect()),
        strings(&client_defs["ResultStatus"]["enum"])
    );
    assert_eq!(
        ours(ToolType::ALL.iter().map(|t| t.as_str()).collect()),
        strings(&doc["Command"]["properties"]["tool_type"]["enum"])
    );
}

#[test]
fn fixtures_validate_against_ufos_schema_exactly_as_the_manifest_says() {
    let mut wrong = Vec::new();
    for f in &common::manifest().fixtures {
        let model = match f.direction {
            Direction::ClientToServer => "ClientMessage",
            Direction::ServerToClient => "ServerMessage",
        };
        let valid = serde_json::from_slice::<Value>(&f.bytes())
            .is_ok_and(|v| common::ufo_schema().validator(model).is_valid(&v));
        if valid != f.ufo_schema {
            wrong.push(format!(
                "{}: UFO's {model} schema says {valid}, manifest says {}",
                f.file, f.ufo_schema
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn every_valid_fixture_of_a_ufo_type_validates_once_we_rewrite_it() {
    let mut checked = 0;
    for f in common::manifest().fixtures.iter().filter(|f| f.is_valid()) {
        let raw = f.json();
        let (model, ours) = match f.direction {
            Direction::ClientToServer => {
                let frame = proto_schemas::parse_client_frame(&f.bytes())
                    .unwrap_or_else(|e| panic!("{}: {e}", f.file));
                if !UFO_CLIENT_TYPES.contains(&frame.kind.as_str()) {
                    // An extension frame: UFO's schema must refuse it (it is not UFO's).
                    assert!(!f.ufo_schema, "{}: extension frame valid for UFO?", f.file);
                    continue;
                }
                ("ClientMessage", serde_json::to_value(frame))
            }
            Direction::ServerToClient => {
                let frame: ServerMessage = serde_json::from_value(raw.clone())
                    .unwrap_or_else(|e| panic!("{}: {e}", f.file));
                ("ServerMessage", serde_json::to_value(frame))
            }
        };
        checked += 1;
        let ours = ours.expect("serialises");
        assert_valid(model, &format!("{} as we rewrite it", f.file), &ours);
        // A valid fixture of a UFO type is valid for UFO as written, with one documented
        // exception: `client_type: null`, which UFO refuses and this project reads as absent.
        if !f.ufo_schema {
            assert_eq!(
                raw.get("client_type"),
                Some(&Value::Null),
                "{}: a valid UFO-type fixture that UFO's schema refuses",
                f.file
            );
        }
    }
    assert!(checked >= 75, "only {checked} fixtures checked");
}

#[test]
fn ufos_schema_refuses_what_ufo_refuses() {
    let command = json!({"tool_name": "click_input", "tool_type": "act", "call_id": "c"});
    assert_invalid("Command", "tool_type `act`", &command);
    assert!(serde_json::from_value::<Command>(command.clone()).is_err());
    assert_invalid(
        "Command",
        "a Command without tool_name",
        &json!({"action": "launch_app", "tool_type": "action"}),
    );

    let mut frame = serde_json::to_value(server::command(
        &target("HostAgent"),
        vec![tool("click_input", ToolType::Action, None)],
        TaskStatus::Continue,
        "r".to_owned(),
    ))
    .expect("serialises");
    assert_valid("ServerMessage", "a command frame", &frame);
    frame["actions"][0]["tool_type"] = json!("act");
    assert_invalid("ServerMessage", "a command with tool_type `act`", &frame);
    assert!(serde_json::from_value::<ServerMessage>(frame).is_err());

    assert_invalid(
        "Result",
        "Result status `completed`",
        &json!({"status": "completed"}),
    );
    assert_invalid(
        "MCPToolInfo",
        "a tool without tool_key",
        &json!({"tool_name": "x", "namespace": "n", "tool_type": "action"}),
    );
    assert_invalid(
        "ClientMessage",
        "client_type null",
        &json!({"type": "heartbeat", "status": "ok", "client_type": null}),
    );
    assert_invalid(
        "ClientMessage",
        "status `OK`",
        &json!({"type": "heartbeat", "status": "OK"}),
    );
    assert_invalid(
        "ClientMessage",
        "an extension frame type",
        &json!({"type": "progress", "status": "continue", "session_id": "s"}),
    );
    let mut heartbeat = serde_json::to_value(server::heartbeat()).expect("serialises");
    heartbeat
        .as_object_mut()
        .expect("an object")
        .remove("status");
    assert_invalid("ServerMessage", "a frame without status", &heartbeat);
}

/// Whatever `parse_client_frame` accepts (of UFO's frame types), we re-serialise as a frame
/// UFO's model accepts.
#[test]
fn every_accepted_client_frame_rewrites_as_a_valid_ufo_frame() {
    let accepted = AtomicUsize::new(0);
    let strategy = (
        prop::sample::select(UFO_CLIENT_TYPES.to_vec()),
        prop::sample::select(TaskStatus::ALL.to_vec()),
        prop::collection::btree_map(
            prop::sample::select(common::CLIENT_KEYS[2..].to_vec()),
            common::field_value(),
            0..6,
        ),
    );
    common::run_property(2000, strategy, |(kind, status, fields)| {
        let mut object: serde_json::Map<String, Value> =
            fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        object.insert("type".to_owned(), json!(kind));
        object.insert("status".to_owned(), json!(status.as_str()));
        let bytes = serde_json::to_vec(&object).expect("serialises");
        if let Ok(frame) = proto_schemas::parse_client_frame(&bytes) {
            accepted.fetch_add(1, Ordering::Relaxed);
            let ours = serde_json::to_value(&frame).expect("serialises");
            let errors = common::ufo_schema().errors("ClientMessage", &ours);
            prop_assert!(errors.is_empty(), "{ours} refused by UFO: {errors:?}");
        }
        Ok(())
    });
    let accepted = accepted.into_inner();
    assert!(
        accepted >= 150,
        "only {accepted} of 2000 generated frames were accepted"
    );
}
