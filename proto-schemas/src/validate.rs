//! Parsing untrusted client frames, with precise errors.
//!
//! [`parse_client_frame`] turns the bytes of one WebSocket text frame into a [`ClientMessage`]
//! that satisfies the rules of its `type`, or a [`FrameError`] that says which frame, which
//! field and what is wrong. It never panics, whatever the input (see the property tests).
//!
//! Tolerant where UFO is tolerant (unknown keys, `null` for optionals, absent optionals,
//! `client_type: null`), strict where a wrong value would be misread: `type`, `status`,
//! `client_type`, `Result.status`, `metadata.platform`, field types, and the fields each frame
//! type needs.

use serde_json::Value;

use crate::enums::{ClientMessageType, Extension, Platform, TaskStatus};
use crate::error::ErrorCode;
use crate::frames::{ClientMessage, McpToolInfo};
use crate::shape::{
    COUNT_FROM_BYTES, CountError, Head, MAX_FRAME_VALUES, Member, count_values, head,
};

/// Longest accepted id (`client_id`, `target_id`, `session_id`, `task_name`, `request_id`),
/// in UTF-8 bytes. Ids become NATS subject tokens, and NATS caps a subject's length.
pub const MAX_ID_BYTES: usize = 256;

/// Why a frame was refused: the frame type (when it could be read), the field, the problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameError {
    /// The frame's `type`, when it could be read.
    pub frame: Option<String>,
    /// The offending field as a path (`action_results[0].status`), when one is to blame.
    pub field: Option<String>,
    /// What is wrong, in words.
    pub problem: String,
    /// The code sent with the error.
    pub code: ErrorCode,
}

impl FrameError {
    fn new(frame: Option<&str>, field: Option<&str>, problem: impl Into<String>) -> Self {
        FrameError {
            frame: frame.map(str::to_owned),
            field: field.map(str::to_owned),
            problem: problem.into(),
            code: ErrorCode::ProtocolError,
        }
    }

    /// An error about `field` of a frame of type `kind`.
    pub fn field(kind: ClientMessageType, field: &str, problem: impl Into<String>) -> Self {
        FrameError::new(Some(kind.as_str()), Some(field), problem)
    }
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.frame {
            Some(frame) => write!(f, "{frame} frame")?,
            None => f.write_str("invalid frame")?,
        }
        if let Some(field) = &self.field {
            write!(f, ": field `{field}`")?;
        }
        write!(f, ": {}", self.problem)
    }
}

impl std::error::Error for FrameError {}

/// Parses and validates one client frame.
///
/// ```
/// let frame = proto_schemas::parse_client_frame(
///     br#"{"type":"heartbeat","status":"ok","client_id":"pc-1"}"#,
/// ).unwrap();
/// assert_eq!(frame.client_id.as_deref(), Some("pc-1"));
///
/// let err = proto_schemas::parse_client_frame(br#"{"type":"register","status":"ok"}"#)
///     .unwrap_err();
/// assert_eq!(err.to_string(), "register frame: field `client_id`: is required and must be a non-empty string");
/// ```
pub fn parse_client_frame(bytes: &[u8]) -> Result<ClientMessage, FrameError> {
    if bytes.len() > COUNT_FROM_BYTES
        && let Err(CountError::TooMany { limit }) = count_values(bytes, MAX_FRAME_VALUES)
    {
        let mut error = FrameError::new(
            None,
            None,
            format!(
                "holds more than {limit} JSON values; send large data as one string (base64 or \
                 text), not as many small values"
            ),
        );
        error.code = ErrorCode::FrameTooLarge;
        return Err(error);
    }
    // serde reads a struct from an array too (`["heartbeat","ok"]`, field by position): a
    // frame is an object, so anything else is refused before that.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(match head(bytes) {
            Err(e) => FrameError::new(None, None, format!("not valid JSON: {e}")),
            Ok(Head::Other(kind)) => FrameError::new(
                None,
                None,
                format!("a frame must be a JSON object, got {kind}"),
            ),
            Ok(Head::Object { .. }) => FrameError::new(None, None, "a frame must be a JSON object"),
        });
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let message: ClientMessage = match serde_path_to_error::deserialize(&mut de) {
        Ok(message) => message,
        Err(err) => return Err(explain_shape_error(bytes, err)),
    };
    if let Err(err) = de.end() {
        return Err(FrameError::new(
            None,
            None,
            format!("trailing data after the JSON object: {err}"),
        ));
    }
    validate_client(&message)?;
    Ok(message)
}

/// Turns a serde error into a message that names the frame type and the field.
fn explain_shape_error(
    bytes: &[u8],
    err: serde_path_to_error::Error<serde_json::Error>,
) -> FrameError {
    let path = err.path().to_string();
    let inner = err.into_inner();
    // Read the frame's `type` and `status` again to say what is wrong with it (error path
    // only; the rest of the frame is skipped, not built).
    let (kind, status) = match head(bytes) {
        Err(e) => return FrameError::new(None, None, format!("not valid JSON: {e}")),
        Ok(Head::Other(kind)) => {
            return FrameError::new(
                None,
                None,
                format!("a frame must be a JSON object, got {kind}"),
            );
        }
        Ok(Head::Object { kind, status }) => (kind, status),
    };
    let frame_name = match &kind {
        Some(Member::Text(t)) => ClientMessageType::from_wire(t).map(ClientMessageType::as_str),
        _ => None,
    };
    match kind {
        None | Some(Member::Null) => {
            return FrameError::new(
                None,
                Some("type"),
                format!(
                    "is required; expected one of {}",
                    ClientMessageType::expected()
                ),
            );
        }
        Some(Member::Text(t)) if ClientMessageType::from_wire(&t).is_none() => {
            return FrameError::new(
                None,
                Some("type"),
                format!(
                    "unknown frame type `{}`; expected one of {}",
                    truncate(&t),
                    ClientMessageType::expected()
                ),
            );
        }
        Some(Member::Text(_)) => {}
        Some(Member::Other(other)) => {
            return FrameError::new(None, Some("type"), format!("must be a string, got {other}"));
        }
    }
    match status {
        None | Some(Member::Null) => {
            return FrameError::new(
                frame_name,
                Some("status"),
                format!("is required; expected one of {}", TaskStatus::expected()),
            );
        }
        Some(Member::Text(s)) if TaskStatus::from_wire(&s).is_none() => {
            return FrameError::new(
                frame_name,
                Some("status"),
                format!(
                    "unknown status `{}`; expected one of {}",
                    truncate(&s),
                    TaskStatus::expected()
                ),
            );
        }
        _ => {}
    }
    let field = if path == "." || path.is_empty() {
        None
    } else {
        Some(path.as_str())
    };
    FrameError::new(frame_name, field, strip_position(&inner.to_string()))
}

/// serde_json appends " at line L column C"; the field path already says where.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(i) => message[..i].to_owned(),
        None => message.to_owned(),
    }
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Shortens user-supplied text quoted back in an error.
fn truncate(s: &str) -> String {
    const MAX: usize = 64;
    if s.chars().count() <= MAX {
        s.to_owned()
    } else {
        format!("{}…", s.chars().take(MAX).collect::<String>())
    }
}

/// Checks an id field: if present, non-empty and at most [`MAX_ID_BYTES`] bytes.
fn check_id(
    kind: ClientMessageType,
    field: &str,
    value: Option<&str>,
    required: bool,
) -> Result<(), FrameError> {
    match value {
        None if required => Err(FrameError::field(
            kind,
            field,
            "is required and must be a non-empty string",
        )),
        None => Ok(()),
        Some("") if required => Err(FrameError::field(
            kind,
            field,
            "is required and must be a non-empty string",
        )),
        Some("") => Ok(()),
        Some(v) if v.len() > MAX_ID_BYTES => Err(FrameError::field(
            kind,
            field,
            format!(
                "is {} bytes long; ids may be at most {MAX_ID_BYTES} bytes",
                v.len()
            ),
        )),
        Some(v) if v.chars().any(char::is_control) => Err(FrameError::field(
            kind,
            field,
            "must not contain control characters",
        )),
        Some(_) => Ok(()),
    }
}

/// Applies the per-type rules to a frame that already has the right shape.
pub fn validate_client(m: &ClientMessage) -> Result<(), FrameError> {
    use ClientMessageType as T;
    let kind = m.kind;
    check_id(
        kind,
        "client_id",
        m.client_id.as_deref(),
        kind == T::Register,
    )?;
    check_id(
        kind,
        "target_id",
        m.target_id.as_deref(),
        kind == T::DeviceInfoRequest,
    )?;
    let needs_session = matches!(
        kind,
        T::CommandResults
            | T::TaskEnd
            | T::Progress
            | T::ClarificationRequest
            | T::ClarificationResponse
            | T::Handoff
    );
    check_id(kind, "session_id", m.session_id.as_deref(), needs_session)?;
    check_id(kind, "task_name", m.task_name.as_deref(), false)?;
    check_id(kind, "request_id", m.request_id.as_deref(), false)?;
    match kind {
        T::Register => {
            register_details(m)?;
        }
        T::Task => {
            if m.request.as_deref().is_none_or(|r| r.trim().is_empty()) {
                return Err(FrameError::field(
                    kind,
                    "request",
                    "is required and must be a non-empty string (the task text)",
                ));
            }
        }
        T::CommandResults => {
            check_id(
                kind,
                "prev_response_id",
                m.prev_response_id.as_deref(),
                true,
            )?;
        }
        T::TaskEnd => {
            if !matches!(m.status, TaskStatus::Completed | TaskStatus::Failed) {
                return Err(FrameError::field(
                    kind,
                    "status",
                    format!("must be `completed` or `failed`, got `{}`", m.status),
                ));
            }
        }
        T::ClarificationRequest | T::ClarificationResponse => {
            if m.request.as_deref().is_none_or(|r| r.trim().is_empty()) {
                let what = if kind == T::ClarificationRequest {
                    "the question"
                } else {
                    "the answer"
                };
                return Err(FrameError::field(
                    kind,
                    "request",
                    format!("is required and must be a non-empty string ({what})"),
                ));
            }
        }
        T::Handoff => {
            let has_caps = m.metadata_value("required_capabilities").is_some();
            if m.target_id.is_none() && !has_caps {
                return Err(FrameError::field(
                    kind,
                    "target_id",
                    "a handoff needs `target_id` (the new agent) or `metadata.required_capabilities`",
                ));
            }
        }
        T::Heartbeat | T::Error | T::DeviceInfoRequest | T::DeviceInfoResponse | T::Progress => {}
    }
    Ok(())
}

/// What a REGISTER frame says about its sender, beyond the common fields.
#[derive(Debug, Clone, PartialEq)]
pub struct RegisterDetails {
    /// `metadata.platform`; absent means `windows`, UFO's default.
    pub platform: Platform,
    /// Capabilities: `metadata.capabilities` plus `metadata.system_info.supported_features`.
    pub capabilities: Vec<String>,
    /// `metadata.tools`: the tools the client advertises.
    pub tools: Vec<McpToolInfo>,
    /// `metadata.aip_extensions`, the known ones only (unknown names are ignored).
    pub extensions: Vec<Extension>,
    /// `metadata.system_info`, verbatim (returned as is in `device_info_response`).
    pub system_info: Option<Value>,
}

/// Reads and checks the REGISTER-specific metadata of a frame.
pub fn register_details(m: &ClientMessage) -> Result<RegisterDetails, FrameError> {
    let kind = ClientMessageType::Register;
    let platform = match m.metadata_value("platform") {
        None | Some(Value::Null) => Platform::Windows,
        Some(Value::String(s)) => Platform::from_wire(s).ok_or_else(|| {
            FrameError::field(
                kind,
                "metadata.platform",
                format!(
                    "unknown platform `{}`; expected one of {}",
                    truncate(s),
                    Platform::expected()
                ),
            )
        })?,
        Some(other) => {
            return Err(FrameError::field(
                kind,
                "metadata.platform",
                format!("must be a string, got {}", json_kind(other)),
            ));
        }
    };
    let mut capabilities = string_list(m.metadata_value("capabilities"), "metadata.capabilities")?;
    let system_info = match m.metadata_value("system_info") {
        None | Some(Value::Null) => None,
        Some(v @ Value::Object(info)) => {
            for feature in string_list(
                info.get("supported_features"),
                "metadata.system_info.supported_features",
            )? {
                if !capabilities.contains(&feature) {
                    capabilities.push(feature);
                }
            }
            Some(v.clone())
        }
        Some(other) => {
            return Err(FrameError::field(
                kind,
                "metadata.system_info",
                format!("must be an object, got {}", json_kind(other)),
            ));
        }
    };
    let tools = match m.metadata_value("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => serde_path_to_error::deserialize::<_, Vec<McpToolInfo>>(v).map_err(|e| {
            FrameError::field(
                kind,
                &format!("metadata.tools{}", path_suffix(&e.path().to_string())),
                e.inner().to_string(),
            )
        })?,
    };
    let extensions = string_list(
        m.metadata_value("aip_extensions"),
        "metadata.aip_extensions",
    )?
    .iter()
    .filter_map(|name| Extension::from_wire(name))
    .collect();
    Ok(RegisterDetails {
        platform,
        capabilities,
        tools,
        extensions,
        system_info,
    })
}

fn path_suffix(path: &str) -> String {
    if path == "." {
        String::new()
    } else if path.starts_with('[') {
        path.to_owned()
    } else {
        format!(".{path}")
    }
}

fn string_list(value: Option<&Value>, field: &str) -> Result<Vec<String>, FrameError> {
    let kind = ClientMessageType::Register;
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => Ok(s.clone()),
                other => Err(FrameError::field(
                    kind,
                    &format!("{field}[{i}]"),
                    format!("must be a string, got {}", json_kind(other)),
                )),
            })
            .collect(),
        Some(other) => Err(FrameError::field(
            kind,
            field,
            format!("must be a list of strings, got {}", json_kind(other)),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(json: &str) -> String {
        match parse_client_frame(json.as_bytes()) {
            Ok(m) => panic!("expected an error for {json}, got {m:?}"),
            Err(e) => e.to_string(),
        }
    }

    /// Issue 21: a frame of many tiny values would take many times its size once parsed; past
    /// the limit it is refused before it is parsed.
    #[test]
    fn a_frame_of_too_many_values_is_refused_unparsed() {
        let zeros = vec!["0"; crate::shape::MAX_FRAME_VALUES].join(",");
        let frame = format!(
            r#"{{"type":"command_results","status":"continue","client_id":"d","session_id":"s","prev_response_id":"r","action_results":[{{"status":"success","result":[{zeros}]}}]}}"#
        );
        let refused = parse_client_frame(frame.as_bytes()).expect_err("too many values");
        assert_eq!(refused.code, ErrorCode::FrameTooLarge);
        assert!(
            refused.problem.contains("more than 1048576 JSON values"),
            "{refused}"
        );
        // The same data as one string is one value.
        let one = format!(
            r#"{{"type":"command_results","status":"continue","client_id":"d","session_id":"s","prev_response_id":"r","action_results":[{{"status":"success","result":"{}"}}]}}"#,
            zeros.replace(',', "")
        );
        parse_client_frame(one.as_bytes()).expect("one large string");
    }

    #[test]
    fn messages_name_frame_field_and_problem() {
        assert_eq!(
            err("{"),
            "invalid frame: not valid JSON: EOF while parsing an object at line 1 column 1"
        );
        assert_eq!(
            err("[1]"),
            "invalid frame: a frame must be a JSON object, got an array"
        );
        // serde would read this array as the struct, field by position.
        assert_eq!(
            err(r#" ["heartbeat", "continue"]"#),
            "invalid frame: a frame must be a JSON object, got an array"
        );
        assert_eq!(
            err(r#"{"status":"ok"}"#),
            "invalid frame: field `type`: is required; expected one of `task`, `heartbeat`, `command_results`, `error`, `register`, `task_end`, `device_info_request`, `device_info_response`, `progress`, `clarification_request`, `clarification_response`, `handoff`"
        );
        assert!(
            err(r#"{"type":"hello","status":"ok"}"#)
                .starts_with("invalid frame: field `type`: unknown frame type `hello`")
        );
        assert!(
            err(r#"{"type":"Heartbeat","status":"ok"}"#).contains("unknown frame type `Heartbeat`")
        );
        assert!(
            err(r#"{"type":"heartbeat","status":"OK"}"#)
                .starts_with("heartbeat frame: field `status`: unknown status `OK`")
        );
        assert_eq!(
            err(r#"{"type":"heartbeat"}"#).split(';').next(),
            Some("heartbeat frame: field `status`: is required")
        );
        assert_eq!(
            err(r#"{"type":"heartbeat","status":"ok","client_id":5}"#),
            "heartbeat frame: field `client_id`: invalid type: integer `5`, expected a string"
        );
        assert!(
            err(r#"{"type":"register","status":"ok","client_id":"a","client_type":"robot"}"#)
                .starts_with("register frame: field `client_type`: unknown variant `robot`")
        );
        assert!(err(r#"{"type":"command_results","status":"continue","session_id":"s","prev_response_id":"r","action_results":[{"status":"ok"}]}"#)
            .starts_with("command_results frame: field `action_results[0].status`: unknown variant `ok`"));
    }

    #[test]
    fn per_type_rules() {
        assert_eq!(
            err(r#"{"type":"register","status":"ok","client_id":""}"#),
            "register frame: field `client_id`: is required and must be a non-empty string"
        );
        let long = "x".repeat(10_000);
        assert_eq!(
            err(&format!(
                r#"{{"type":"register","status":"ok","client_id":"{long}"}}"#
            )),
            "register frame: field `client_id`: is 10000 bytes long; ids may be at most 256 bytes"
        );
        assert!(err(r#"{"type":"register","status":"ok","client_id":"a","metadata":{"platform":"macos"}}"#)
            .starts_with("register frame: field `metadata.platform`: unknown platform `macos`"));
        assert_eq!(
            err(r#"{"type":"command_results","status":"continue","session_id":"s"}"#),
            "command_results frame: field `prev_response_id`: is required and must be a non-empty string"
        );
        assert_eq!(
            err(r#"{"type":"task_end","status":"ok","session_id":"s"}"#),
            "task_end frame: field `status`: must be `completed` or `failed`, got `ok`"
        );
        assert!(
            err(r#"{"type":"task","status":"continue"}"#)
                .starts_with("task frame: field `request`: is required")
        );
        assert!(
            err(r#"{"type":"device_info_request","status":"ok"}"#)
                .starts_with("device_info_request frame: field `target_id`")
        );
        assert!(err(r#"{"type":"register","status":"ok","client_id":"a","metadata":{"tools":[{"tool_name":"x"}]}}"#)
            .starts_with("register frame: field `metadata.tools[0]`: missing field `tool_key`"));
    }

    #[test]
    fn tolerant_of_nulls_unknown_keys_and_tricky_ids() {
        let m = parse_client_frame(
            r#"{"type":"register","status":"ok","client_type":null,"client_id":"a.b*c>d e/f@g😀","extra":{"x":1},"metadata":null}"#.as_bytes(),
        )
        .expect("valid");
        assert_eq!(m.client_type_or_default(), crate::ClientType::Device);
        assert_eq!(m.client_id.as_deref(), Some("a.b*c>d e/f@g😀"));
    }

    #[test]
    fn register_details_merge_capabilities_and_read_extensions() {
        let m = parse_client_frame(
            br#"{"type":"register","status":"ok","client_id":"d","metadata":{"platform":"linux","capabilities":["excel"],
            "system_info":{"supported_features":["gui","excel"]},"aip_extensions":["progress","future_thing"]}}"#,
        )
        .expect("valid");
        let details = register_details(&m).expect("valid");
        assert_eq!(details.platform, Platform::Linux);
        assert_eq!(details.capabilities, ["excel", "gui"]);
        assert_eq!(details.extensions, [Extension::Progress]);
    }
}
