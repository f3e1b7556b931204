//! AIP frames as the bench's clients send and read them.
//!
//! Outgoing frames are UFO's: pydantic `ClientMessage`s serialised with every field, unset ones
//! `null`, so the broker parses what it parses in production. They are written from borrowed
//! parts without building a `serde_json::Value`. Incoming frames are read only as far as the
//! bench needs (type, status, ids, error, the Commands' `call_id`s), borrowing from the text.

use std::borrow::Cow;

use proto_schemas::server::timestamp_now;
use proto_schemas::{Command, ToolType};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// A UFO `ClientMessage` with every field present.
#[derive(Debug, Serialize)]
struct ClientFrame<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    status: &'a str,
    client_type: &'a str,
    session_id: Option<&'a str>,
    task_name: Option<&'a str>,
    client_id: Option<&'a str>,
    target_id: Option<&'a str>,
    request: Option<&'a str>,
    action_results: Option<&'a [ResultOut<'a>]>,
    timestamp: String,
    request_id: Option<&'a str>,
    prev_response_id: Option<&'a str>,
    error: Option<&'a str>,
    metadata: Option<&'a RawValue>,
}

impl<'a> ClientFrame<'a> {
    fn new(kind: &'a str, status: &'a str, client_type: &'a str, client_id: &'a str) -> Self {
        ClientFrame {
            kind,
            status,
            client_type,
            session_id: None,
            task_name: None,
            client_id: Some(client_id),
            target_id: None,
            request: None,
            action_results: None,
            timestamp: timestamp_now(),
            request_id: None,
            prev_response_id: None,
            error: None,
            metadata: None,
        }
    }

    fn text(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"unserialisable\":\"{e}\"}}"))
    }
}

/// A UFO `Result` answering one Command.
#[derive(Debug, Serialize)]
struct ResultOut<'a> {
    status: &'static str,
    error: Option<&'a str>,
    result: EchoResult<'a>,
    namespace: &'static str,
    call_id: Option<&'a str>,
}

/// What the bench's `echo` tool returns: its parameters.
#[derive(Debug, Serialize)]
struct EchoResult<'a> {
    echo: Option<&'a RawValue>,
}

fn raw(value: &serde_json::Value) -> Box<RawValue> {
    RawValue::from_string(value.to_string())
        .unwrap_or_else(|_| RawValue::from_string("null".to_owned()).expect("`null` is JSON"))
}

/// A UFO device's REGISTER (platform linux, so commands name `LinuxAgent`).
pub(crate) fn device_register(id: &str) -> String {
    let metadata = raw(&serde_json::json!({
        "system_info": {
            "device_id": id, "platform": "linux", "os_version": "aip-bench", "cpu_count": 2,
            "memory_total_gb": 8.0, "hostname": "aip-bench", "ip_address": "127.0.0.1",
            "supported_features": ["cli"], "platform_type": "computer", "schema_version": "1.0",
            "custom_metadata": {}
        },
        "platform": "linux",
        "registration_time": timestamp_now(),
    }));
    let mut frame = ClientFrame::new("register", "ok", "device", id);
    frame.metadata = Some(&metadata);
    frame.text()
}

/// A Galaxy constellation's REGISTER (`client_id` = `{task_name}@{device}`), bound to `target`.
pub(crate) fn constellation_register(id: &str, target: &str) -> String {
    let metadata = raw(&serde_json::json!({
        "type": "constellation_client", "task_name": "aip_bench", "targeted_device_id": target,
        "capabilities": ["task_distribution"], "version": "2.0",
        "registration_time": timestamp_now(),
    }));
    let mut frame = ClientFrame::new("register", "ok", "constellation", id);
    frame.target_id = Some(target);
    frame.metadata = Some(&metadata);
    frame.text()
}

/// A heartbeat (`metadata.device_id`, as Galaxy sends it).
pub(crate) fn heartbeat(id: &str, client_type: &str) -> String {
    let metadata = raw(&serde_json::json!({ "device_id": id }));
    let mut frame = ClientFrame::new("heartbeat", "ok", client_type, id);
    frame.metadata = Some(&metadata);
    frame.text()
}

/// A constellation's device-info request.
pub(crate) fn device_info_request(id: &str, target: &str, request_id: &str) -> String {
    let mut frame = ClientFrame::new("device_info_request", "ok", "constellation", id);
    frame.target_id = Some(target);
    frame.request_id = Some(request_id);
    frame.text()
}

/// A constellation's TASK; `metadata` carries the scripted steps ([`task_metadata`]).
pub(crate) fn constellation_task(
    id: &str,
    target: &str,
    session_id: &str,
    task_name: &str,
    metadata: &RawValue,
) -> String {
    let mut frame = ClientFrame::new("task", "continue", "constellation", id);
    frame.target_id = Some(target);
    frame.session_id = Some(session_id);
    frame.task_name = Some(task_name);
    frame.request = Some("aip bench: echo");
    frame.metadata = Some(metadata);
    frame.text()
}

/// A device's answer to a `command` frame: one success Result per Command, in order, each
/// echoing its Command's parameters under its `call_id`.
pub(crate) fn command_results(id: &str, command: &Inbound<'_>, request_id: &str) -> String {
    let results: Vec<ResultOut<'_>> = command
        .actions
        .iter()
        .flatten()
        .map(|action| ResultOut {
            status: "success",
            error: None,
            result: EchoResult {
                echo: action.parameters,
            },
            namespace: "aip_bench",
            call_id: action.call_id.as_deref(),
        })
        .collect();
    let mut frame = ClientFrame::new("command_results", "continue", "device", id);
    frame.session_id = command.session_id.as_deref();
    frame.prev_response_id = command.response_id.as_deref();
    frame.action_results = Some(&results);
    frame.request_id = Some(request_id);
    frame.text()
}

/// K steps of one `echo` Command each: the scripted plan of every bench task.
pub(crate) fn echo_steps(k: usize) -> Vec<Vec<Command>> {
    (0..k)
        .map(|i| {
            let mut parameters = serde_json::Map::new();
            parameters.insert("text".to_owned(), "aip bench".into());
            parameters.insert("step".to_owned(), (i + 1).into());
            vec![Command {
                tool_name: "echo".to_owned(),
                parameters: Some(parameters),
                tool_type: ToolType::Action,
                call_id: None,
            }]
        })
        .collect()
}

/// `{"steps": …}` for a TASK frame's metadata, serialised once per run.
pub(crate) fn task_metadata(k: usize) -> Box<RawValue> {
    raw(&serde_json::json!({ "steps": echo_steps(k) }))
}

/// A server frame, read as far as the bench needs.
#[derive(Debug, Deserialize)]
pub(crate) struct Inbound<'a> {
    /// `heartbeat`, `command`, `task_end`, `error`, `device_info_response`, …
    #[serde(rename = "type", borrow)]
    pub kind: Cow<'a, str>,
    /// `ok`, `completed`, `failed`, `error`, …
    #[serde(default, borrow)]
    pub status: Option<Cow<'a, str>>,
    /// The session the frame belongs to.
    #[serde(default, borrow)]
    pub session_id: Option<Cow<'a, str>>,
    /// The server's id of this frame (for device info: the request's id).
    #[serde(default, borrow)]
    pub response_id: Option<Cow<'a, str>>,
    /// Why something failed.
    #[serde(default, borrow)]
    pub error: Option<Cow<'a, str>>,
    /// A command frame's Commands.
    #[serde(default, borrow)]
    pub actions: Option<Vec<ActionRef<'a>>>,
}

/// One Command of a `command` frame.
#[derive(Debug, Deserialize)]
pub(crate) struct ActionRef<'a> {
    /// Correlates the Result.
    #[serde(default, borrow)]
    pub call_id: Option<Cow<'a, str>>,
    /// Echoed back.
    #[serde(default, borrow)]
    pub parameters: Option<&'a RawValue>,
}

impl<'a> Inbound<'a> {
    /// Parses a text frame.
    pub fn parse(text: &'a str) -> Result<Inbound<'a>, String> {
        serde_json::from_str(text).map_err(|e| {
            let start: String = text.chars().take(120).collect();
            format!("unreadable frame from the broker ({e}): {start}")
        })
    }

    /// Whether `status` is this.
    pub fn status_is(&self, status: &str) -> bool {
        self.status.as_deref() == Some(status)
    }

    /// The error text, or a description of the frame when it has none.
    pub fn error_text(&self) -> String {
        match &self.error {
            Some(e) if !e.is_empty() => e.to_string(),
            _ => format!(
                "`{}` frame with status `{}` and no error text",
                self.kind,
                self.status.as_deref().unwrap_or("null")
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    const FIELDS: [&str; 14] = [
        "type",
        "status",
        "client_type",
        "session_id",
        "task_name",
        "client_id",
        "target_id",
        "request",
        "action_results",
        "timestamp",
        "request_id",
        "prev_response_id",
        "error",
        "metadata",
    ];

    fn every_field(text: &str) -> Value {
        let value: Value = serde_json::from_str(text).expect("JSON");
        let object = value.as_object().expect("object");
        assert_eq!(object.len(), FIELDS.len(), "{text}");
        for field in FIELDS {
            assert!(object.contains_key(field), "{field} missing: {text}");
        }
        value
    }

    #[test]
    fn frames_are_ufo_client_messages_with_every_field() {
        let register = every_field(&device_register("d1"));
        assert_eq!(register["metadata"]["system_info"]["device_id"], "d1");
        assert_eq!(register["request"], Value::Null);
        let constellation = every_field(&constellation_register("g@d1", "d1"));
        assert_eq!(constellation["client_type"], "constellation");
        assert_eq!(constellation["target_id"], "d1");
        every_field(&heartbeat("d1", "device"));
        every_field(&device_info_request("g@d1", "d1", "r1"));
        let metadata = task_metadata(2);
        let task = every_field(&constellation_task("g@d1", "d1", "t@1", "t", &metadata));
        let steps = task["metadata"]["steps"].as_array().expect("steps");
        assert_eq!(steps.len(), 2);
        assert_eq!(steps[0][0]["tool_name"], "echo");
        assert_eq!(steps[0][0]["tool_type"], "action");
    }

    #[test]
    fn a_command_is_answered_call_by_call() {
        let command = r#"{"type":"command","status":"continue","session_id":"s\"1","response_id":"r9",
            "agent_name":"LinuxAgent","actions":[
              {"tool_name":"echo","tool_type":"action","parameters":{"text":"x"},"call_id":"c1"},
              {"tool_name":"echo","tool_type":"action","call_id":"c2"}]}"#;
        let inbound = Inbound::parse(command).expect("parses");
        assert_eq!(inbound.kind, "command");
        let answer = every_field(&command_results("d1", &inbound, "q1"));
        assert_eq!(answer["type"], "command_results");
        assert_eq!(answer["session_id"], "s\"1");
        assert_eq!(answer["prev_response_id"], "r9");
        assert_eq!(answer["action_results"][0]["call_id"], "c1");
        assert_eq!(answer["action_results"][0]["result"]["echo"]["text"], "x");
        assert_eq!(answer["action_results"][1]["call_id"], "c2");
        assert_eq!(answer["action_results"][1]["status"], "success");
    }

    #[test]
    fn unreadable_frames_are_described() {
        let error = Inbound::parse("not json").expect_err("fails");
        assert!(error.contains("not json"), "{error}");
    }
}
