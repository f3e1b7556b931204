//! Shared helpers of the integration tests: the fixture manifest, the "same meaning" comparison
//! of a frame with its re-serialisation, UFO's JSON Schema, and a proptest strategy for
//! arbitrary JSON.
//!
//! Every test binary includes this module (`mod common;`) and uses a different part of it.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use proptest::prelude::*;
use serde::Deserialize;
use serde_json::{Map, Value};

/// `tests/fixtures`, where the fixture frames and their manifest live.
pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// `tests/data`, where UFO's schema and the captured UFO traffic live.
pub fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

/// `tests/fixtures/manifest.json`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// What the manifest is.
    pub about: String,
    /// Whole frames.
    pub fixtures: Vec<Fixture>,
    /// Frame parts (Command, Result, MCPToolInfo).
    pub parts: Vec<Part>,
}

/// Which way a frame travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// A `ClientMessage`, parsed with `parse_client_frame`.
    ClientToServer,
    /// A `ServerMessage`, deserialized with serde.
    ServerToClient,
}

/// One fixture frame.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fixture {
    /// Path under `tests/fixtures`.
    pub file: String,
    /// Which way it travels.
    pub direction: Direction,
    /// Where it came from.
    pub source: String,
    /// What parsing it must give.
    pub expect: Expectation,
    /// Whether the raw file validates against UFO's schema for its direction.
    pub ufo_schema: bool,
    /// Why it is valid or invalid.
    #[serde(default)]
    pub note: Option<String>,
}

/// The manifest's `expect`: a frame `type` and `status`, or an error.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expectation {
    /// The frame type it must parse as.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// The status it must parse with.
    pub status: Option<String>,
    /// The exact error (client: `FrameError`'s Display; server: serde's message without position).
    pub error: Option<String>,
    /// Server frames: the path of the field serde blames.
    pub error_field: Option<String>,
}

/// What an [`Expectation`] means.
#[derive(Debug, PartialEq, Eq)]
pub enum Expected<'a> {
    /// Parses as this type with this status.
    Frame { kind: &'a str, status: &'a str },
    /// A client frame refused with exactly this message.
    ClientError(&'a str),
    /// A server frame refused, blaming `field`, with exactly this message.
    ServerError { field: &'a str, message: &'a str },
}

impl Fixture {
    /// The expectation, checked for consistency with the direction.
    pub fn expected(&self) -> Expected<'_> {
        let e = &self.expect;
        match (&e.kind, &e.status, &e.error, &e.error_field, self.direction) {
            (Some(kind), Some(status), None, None, _) => Expected::Frame { kind, status },
            (None, None, Some(error), None, Direction::ClientToServer) => {
                Expected::ClientError(error)
            }
            (None, None, Some(message), Some(field), Direction::ServerToClient) => {
                Expected::ServerError { field, message }
            }
            _ => panic!("{}: malformed expectation {:?}", self.file, self.expect),
        }
    }

    /// Whether this fixture must parse.
    pub fn is_valid(&self) -> bool {
        matches!(self.expected(), Expected::Frame { .. })
    }

    /// The raw bytes of the fixture.
    pub fn bytes(&self) -> Vec<u8> {
        read(&self.file)
    }

    /// The fixture as JSON (panics for the deliberately non-JSON ones).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.bytes())
            .unwrap_or_else(|e| panic!("{} is not JSON: {e}", self.file))
    }

    /// The first directory of its path: `seed000`, `seed001`, `captured`, `wire`, `ext`, `variants`.
    pub fn group(&self) -> &str {
        self.file.split('/').next().unwrap_or_default()
    }
}

/// One fixture part (not a whole frame).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Part {
    /// Path under `tests/fixtures`.
    pub file: String,
    /// `command`, `result` or `mcp_tool_info`.
    pub kind: String,
    /// Where it came from.
    pub source: String,
    /// Whether it validates against UFO's schema for its kind.
    pub ufo_schema: bool,
    /// Remarks.
    #[serde(default)]
    pub note: Option<String>,
}

impl Part {
    /// The part as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&read(&self.file))
            .unwrap_or_else(|e| panic!("{} is not JSON: {e}", self.file))
    }
}

/// Reads a file under `tests/fixtures`.
pub fn read(file: &str) -> Vec<u8> {
    let path = fixtures_dir().join(file);
    std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// The manifest, read once.
pub fn manifest() -> &'static Manifest {
    static MANIFEST: LazyLock<Manifest> = LazyLock::new(|| {
        serde_json::from_slice(&read("manifest.json"))
            .unwrap_or_else(|e| panic!("tests/fixtures/manifest.json: {e}"))
    });
    &MANIFEST
}

/// The client frame types that are UFO's (the rest are this project's extensions).
pub const UFO_CLIENT_TYPES: [&str; 8] = [
    "task",
    "heartbeat",
    "command_results",
    "error",
    "register",
    "task_end",
    "device_info_request",
    "device_info_response",
];

/// The server frame types that are UFO's.
pub const UFO_SERVER_TYPES: [&str; 7] = [
    "task",
    "heartbeat",
    "task_end",
    "command",
    "error",
    "device_info_request",
    "device_info_response",
];

/// The keys of a `ClientMessage` (UFO's fourteen plus the `result` extension).
pub const CLIENT_KEYS: [&str; 15] = [
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
    "result",
];

/// The keys of a `ServerMessage` (UFO's fourteen plus the `metadata` extension).
pub const SERVER_KEYS: [&str; 15] = [
    "type",
    "status",
    "user_request",
    "agent_name",
    "process_name",
    "root_name",
    "actions",
    "messages",
    "error",
    "session_id",
    "task_name",
    "timestamp",
    "response_id",
    "result",
    "metadata",
];

/// The keys of a `Command`.
pub const COMMAND_KEYS: [&str; 4] = ["tool_name", "parameters", "tool_type", "call_id"];

/// The keys of a `Result`.
pub const RESULT_KEYS: [&str; 5] = ["status", "error", "result", "namespace", "call_id"];

/// The keys of an `MCPToolInfo` (UFO's nine plus `description`).
pub const TOOL_KEYS: [&str; 10] = [
    "tool_key",
    "tool_name",
    "title",
    "namespace",
    "tool_type",
    "description",
    "input_schema",
    "output_schema",
    "meta",
    "annotations",
];

/// Keeps only `keys` of an object and drops those whose value is `null`; for each
/// `(key, item_keys)` in `lists`, does the same to every object in that list. Free-form values
/// (`metadata`, `result`, `parameters`, …) are left exactly as they are.
fn known_non_null(value: &Value, keys: &[&str], lists: &[(&str, &[&str])]) -> Value {
    let Some(object) = value.as_object() else {
        return value.clone();
    };
    let mut out = Map::new();
    for (key, v) in object {
        if v.is_null() || !keys.contains(&key.as_str()) {
            continue;
        }
        let v = match (lists.iter().find(|(k, _)| k == key), v) {
            (Some((_, item_keys)), Value::Array(items)) => Value::Array(
                items
                    .iter()
                    .map(|item| known_non_null(item, item_keys, &[]))
                    .collect(),
            ),
            _ => v.clone(),
        };
        out.insert(key.clone(), v);
    }
    Value::Object(out)
}

/// A client frame as it must come back from parse-then-serialise: without unknown keys and
/// without `null`-valued keys (absent and `null` mean the same), here and in its Results.
pub fn client_meaning(frame: &Value) -> Value {
    known_non_null(frame, &CLIENT_KEYS, &[("action_results", &RESULT_KEYS)])
}

/// A server frame as it must come back from deserialize-then-serialise.
pub fn server_meaning(frame: &Value) -> Value {
    known_non_null(frame, &SERVER_KEYS, &[("actions", &COMMAND_KEYS)])
}

/// A part as it must come back from deserialize-then-serialise.
pub fn part_meaning(kind: &str, part: &Value) -> Value {
    let keys: &[&str] = match kind {
        "command" => &COMMAND_KEYS,
        "result" => &RESULT_KEYS,
        "mcp_tool_info" => &TOOL_KEYS,
        other => panic!("unknown part kind {other}"),
    };
    known_non_null(part, keys, &[])
}

/// Strips serde_json's " at line L column C" suffix.
pub fn without_position(message: &str) -> &str {
    match message.rfind(" at line ") {
        Some(i) => &message[..i],
        None => message,
    }
}

/// UFO's JSON Schema of its frame models (`tests/data/ufo-aip.schema.json`), one validator per
/// model, built once.
pub struct UfoSchema {
    validators: BTreeMap<String, jsonschema::Validator>,
    /// The whole document.
    pub document: Value,
}

impl UfoSchema {
    /// The validator of one model: `ClientMessage`, `ServerMessage`, `Command`, `Result`,
    /// `MCPToolInfo`.
    pub fn validator(&self, model: &str) -> &jsonschema::Validator {
        self.validators
            .get(model)
            .unwrap_or_else(|| panic!("UFO's schema has no model {model}"))
    }

    /// The validation errors of `instance` against `model`, as text (empty: valid).
    pub fn errors(&self, model: &str, instance: &Value) -> Vec<String> {
        self.validator(model)
            .iter_errors(instance)
            .map(|e| format!("{} at {}", e, e.instance_path()))
            .collect()
    }
}

/// UFO's schema, loaded once.
pub fn ufo_schema() -> &'static UfoSchema {
    static SCHEMA: LazyLock<UfoSchema> = LazyLock::new(|| {
        let path = data_dir().join("ufo-aip.schema.json");
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let document: Value = serde_json::from_slice(&bytes).expect("UFO's schema is JSON");
        let validators = document
            .as_object()
            .expect("UFO's schema is an object of models")
            .iter()
            .map(|(model, schema)| {
                let validator = jsonschema::validator_for(schema)
                    .unwrap_or_else(|e| panic!("UFO's {model} schema does not compile: {e}"));
                (model.clone(), validator)
            })
            .collect();
        UfoSchema {
            validators,
            document,
        }
    });
    &SCHEMA
}

/// Strings that matter to the parser: enum values (right and wrong case), ids at and past the
/// length limit, blanks, control characters, and arbitrary text.
pub fn interesting_string() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(vec![
            "task", "heartbeat", "command_results", "error", "register", "task_end",
            "device_info_request", "device_info_response", "progress", "clarification_request",
            "clarification_response", "handoff", "continue", "completed", "failed", "ok",
            "success", "failure", "skipped", "none", "device", "constellation", "action",
            "data_collection", "windows", "linux", "mobile", "OK", "Heartbeat", "macos",
            "task_end_result", "", " ", "pc-1", "a.b*c>d", "😀", "\n",
        ])
        .prop_map(str::to_owned),
        1 => Just("x".repeat(256)),
        1 => Just("é".repeat(129)),
        4 => any::<String>(),
    ]
}

/// Keys of generated objects: every field name the frames and their metadata know, and
/// arbitrary ones.
pub fn interesting_key() -> impl Strategy<Value = String> {
    let known: Vec<&str> = CLIENT_KEYS
        .iter()
        .chain(RESULT_KEYS.iter())
        .chain(TOOL_KEYS.iter())
        .chain(
            [
                "platform",
                "system_info",
                "capabilities",
                "tools",
                "aip_extensions",
                "required_capabilities",
                "supported_features",
            ]
            .iter(),
        )
        .copied()
        .collect();
    prop_oneof![
        3 => prop::sample::select(known).prop_map(str::to_owned),
        1 => any::<String>(),
    ]
}

/// Any JSON value, nested up to a few levels.
pub fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_filter_map("JSON has no NaN or infinity", |f| {
            serde_json::Number::from_f64(f).map(Value::Number)
        }),
        interesting_string().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(interesting_key(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A list of Result objects, mostly well-formed.
pub fn result_list() -> impl Strategy<Value = Value> {
    let result = (
        prop::sample::select(vec!["success", "failure", "skipped", "none", "completed"]),
        prop::option::of(interesting_string()),
        prop::option::of(json_value()),
        prop::option::of(interesting_string()),
    )
        .prop_map(|(status, error, result, call_id)| {
            let mut object = Map::new();
            object.insert("status".to_owned(), Value::from(status));
            if let Some(error) = error {
                object.insert("error".to_owned(), Value::from(error));
            }
            if let Some(result) = result {
                object.insert("result".to_owned(), result);
            }
            if let Some(call_id) = call_id {
                object.insert("call_id".to_owned(), Value::from(call_id));
            }
            Value::Object(object)
        });
    prop::collection::vec(result, 0..4).prop_map(Value::Array)
}

/// A value for a frame field: usually of a type some field takes (a string, `null`, a Result
/// list, an object), sometimes a string in serde's externally tagged enum form (`{"ok": null}`,
/// which must be refused), sometimes anything.
pub fn field_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        6 => interesting_string().prop_map(Value::String),
        2 => Just(Value::Null),
        1 => interesting_string().prop_map(|s| {
            let mut tagged = Map::new();
            tagged.insert(s, Value::Null);
            Value::Object(tagged)
        }),
        1 => result_list(),
        1 => prop::collection::btree_map(interesting_key(), json_value(), 0..4)
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        2 => json_value(),
    ]
}

/// Runs `test` on `cases` inputs from `strategy` (no regression files), failing on the first
/// failure with proptest's minimal input.
pub fn run_property<S: Strategy>(
    cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) {
    let config = ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let mut runner = proptest::test_runner::TestRunner::new(config);
    if let Err(e) = runner.run(&strategy, test) {
        panic!("{e}");
    }
}
