//! Every AIP frame we know of, parsed exactly as the manifest says.
//!
//! `tests/fixtures/` holds one JSON file per frame, from five places:
//!
//! - `seed000/`: every JSON example of seed 000 (Galaxy's "AIP Protocol Integration" page),
//!   verbatim, plus its one Python `ClientMessage(...)` example translated to JSON;
//! - `seed001/`: the pydantic constructor examples of seed 001 (UFO's "AIP Message
//!   Reference"), translated to the JSON pydantic writes (frames in the root, Command / Result /
//!   MCPToolInfo examples in `parts/`);
//! - `captured/`: the 24 frames of `tests/data/ufo-b28183f-flows.jsonl`, real UFO traffic;
//! - `wire/` and `ext/`: every frame the wire contract (`spec/aip-wire.md`) describes, written
//!   out with concrete values, and this project's extension frames;
//! - `variants/`: deliberate edge cases of valid frames, accepted (`valid/`) or refused
//!   (`invalid/`).
//!
//! `tests/fixtures/manifest.json` says for each file its direction, its source, and either the
//! `type`/`status` it must parse as or the exact error it must give, with a note on why. Many
//! seed examples are not valid UFO frames (`payload` instead of real fields, a Result `status` of
//! `completed`, Commands with `action` instead of `tool_name`, ...): the manifest records the
//! error our parser gives for each.
//!
//! The tests check that client frames (through [`proto_schemas::parse_client_frame`]) and server
//! frames (through serde into [`proto_schemas::ServerMessage`]) give exactly the expected
//! outcome, and that every valid frame round-trips without losing meaning: parse, serialise,
//! parse again gives an equal struct, and the serialisation equals the original once `null`
//! values and unknown keys are removed. A changed enum string, a stricter or laxer rule, or a
//! changed error text makes them fail.

mod common;

use std::collections::BTreeSet;

use common::{Direction, Expected, Fixture};
use proto_schemas::{ActionResult, ClientMessage, Command, McpToolInfo, ServerMessage};
use serde_json::Value;

/// Collects failures so that one run reports every broken fixture, then fails.
#[derive(Default)]
struct Failures(Vec<String>);

impl Failures {
    fn push(&mut self, fixture: &str, problem: impl std::fmt::Display) {
        self.0.push(format!("{fixture}: {problem}"));
    }

    fn assert_none(self, what: &str) {
        assert!(
            self.0.is_empty(),
            "{} {what}:\n  {}",
            self.0.len(),
            self.0.join("\n  ")
        );
    }
}

fn client_fixtures() -> impl Iterator<Item = &'static Fixture> {
    common::manifest()
        .fixtures
        .iter()
        .filter(|f| f.direction == Direction::ClientToServer)
}

fn server_fixtures() -> impl Iterator<Item = &'static Fixture> {
    common::manifest()
        .fixtures
        .iter()
        .filter(|f| f.direction == Direction::ServerToClient)
}

/// Deserializes a server frame, naming the field serde blames on failure.
fn parse_server(bytes: &[u8]) -> Result<ServerMessage, (String, String)> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        (
            e.path().to_string(),
            common::without_position(&e.inner().to_string()).to_owned(),
        )
    })
}

#[test]
fn manifest_lists_every_fixture_file_once() {
    let manifest = common::manifest();
    let mut listed = BTreeSet::new();
    for file in manifest
        .fixtures
        .iter()
        .map(|f| &f.file)
        .chain(manifest.parts.iter().map(|p| &p.file))
    {
        assert!(listed.insert(file.clone()), "{file} is listed twice");
        assert!(
            common::fixtures_dir().join(file).is_file(),
            "{file} is listed but missing"
        );
    }
    for f in &manifest.fixtures {
        assert!(!f.source.is_empty(), "{}: no source", f.file);
    }
    let mut on_disk = BTreeSet::new();
    let mut dirs = vec![common::fixtures_dir()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("fixture directory is readable") {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                let relative = path
                    .strip_prefix(common::fixtures_dir())
                    .expect("under the fixture directory")
                    .to_string_lossy()
                    .replace('\\', "/");
                if relative != "manifest.json" {
                    on_disk.insert(relative);
                }
            }
        }
    }
    let unlisted: Vec<_> = on_disk.difference(&listed).collect();
    assert!(
        unlisted.is_empty(),
        "fixture files missing from manifest.json: {unlisted:?}"
    );
}

#[test]
fn invalid_seed_examples_say_why() {
    for f in &common::manifest().fixtures {
        if !f.is_valid() && f.group().starts_with("seed") {
            assert!(
                f.note.as_deref().is_some_and(|n| !n.is_empty()),
                "{}: an invalid seed example needs a note saying why",
                f.file
            );
        }
    }
}

#[test]
fn captured_fixtures_are_exactly_the_captured_ufo_frames() {
    let path = common::data_dir().join("ufo-b28183f-flows.jsonl");
    let text = std::fs::read_to_string(&path).expect("captured flows are readable");
    let captured: Vec<&Fixture> = common::manifest()
        .fixtures
        .iter()
        .filter(|f| f.group() == "captured")
        .collect();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 24, "the capture has 24 frames");
    assert_eq!(
        captured.len(),
        lines.len(),
        "one fixture per captured frame"
    );
    for (line, fixture) in lines.iter().zip(captured) {
        let record: Value = serde_json::from_str(line).expect("each capture line is JSON");
        assert_eq!(
            fixture.json(),
            record["frame"],
            "{} differs from the capture",
            fixture.file
        );
        let direction = match record["direction"].as_str() {
            Some("client_to_server") => Direction::ClientToServer,
            Some("server_to_client") => Direction::ServerToClient,
            other => panic!("unexpected direction {other:?}"),
        };
        assert_eq!(fixture.direction, direction, "{}", fixture.file);
        assert!(
            fixture.is_valid(),
            "{}: real UFO traffic must parse",
            fixture.file
        );
    }
}

#[test]
fn every_seed_000_json_example_is_a_fixture() {
    // Seed 000 has 17 ```json blocks and one Python ClientMessage(...) example.
    let seed000 = common::manifest()
        .fixtures
        .iter()
        .filter(|f| f.group() == "seed000")
        .count();
    assert_eq!(seed000, 18);
    let seed001 = common::manifest()
        .fixtures
        .iter()
        .filter(|f| f.group() == "seed001")
        .count();
    assert_eq!(seed001, 7, "seed 001's seven frame examples");
    assert_eq!(
        common::manifest().parts.len(),
        4,
        "seed 001's MCPToolInfo, Command and two Result examples"
    );
}

#[test]
fn client_fixtures_parse_as_the_manifest_says() {
    let mut failures = Failures::default();
    let mut checked = 0;
    for f in client_fixtures() {
        checked += 1;
        let outcome = proto_schemas::parse_client_frame(&f.bytes());
        match (f.expected(), outcome) {
            (Expected::Frame { kind, status }, Ok(m)) => {
                if (m.kind.as_str(), m.status.as_str()) != (kind, status) {
                    failures.push(
                        &f.file,
                        format!(
                            "parsed as {}/{}, expected {kind}/{status}",
                            m.kind, m.status
                        ),
                    );
                }
                // The JSON strings, not just the Rust variants, must be the expected ones.
                let raw = f.json();
                if raw["type"] != kind || raw["status"] != status {
                    failures.push(&f.file, "manifest type/status differ from the file");
                }
            }
            (Expected::Frame { .. }, Err(e)) => {
                failures.push(&f.file, format!("must parse, got error: {e}"));
            }
            (Expected::ClientError(expected), Err(e)) => {
                if e.to_string() != expected {
                    failures.push(
                        &f.file,
                        format!("wrong error:\n    got      {e}\n    expected {expected}"),
                    );
                }
            }
            (Expected::ClientError(expected), Ok(m)) => failures.push(
                &f.file,
                format!("must be refused with `{expected}`, but parsed as {m:?}"),
            ),
            (Expected::ServerError { .. }, _) => {
                failures.push(&f.file, "a client frame cannot expect a server error");
            }
        }
    }
    assert!(checked >= 90, "only {checked} client fixtures");
    failures.assert_none("client fixtures do not parse as expected");
}

#[test]
fn server_fixtures_deserialize_as_the_manifest_says() {
    let mut failures = Failures::default();
    for f in server_fixtures() {
        let bytes = f.bytes();
        let plain = serde_json::from_slice::<ServerMessage>(&bytes);
        match (f.expected(), parse_server(&bytes)) {
            (Expected::Frame { kind, status }, Ok(m)) => {
                if (m.kind.as_str(), m.status.as_str()) != (kind, status) {
                    failures.push(
                        &f.file,
                        format!(
                            "parsed as {}/{}, expected {kind}/{status}",
                            m.kind, m.status
                        ),
                    );
                }
                if plain.ok().as_ref() != Some(&m) {
                    failures.push(&f.file, "serde_json::from_slice disagrees");
                }
            }
            (Expected::Frame { .. }, Err((field, message))) => {
                failures.push(
                    &f.file,
                    format!("must parse, got error at {field}: {message}"),
                );
            }
            (Expected::ServerError { field, message }, Err((got_field, got_message))) => {
                if (got_field.as_str(), got_message.as_str()) != (field, message) {
                    failures.push(
                        &f.file,
                        format!(
                            "wrong error:\n    got      {got_field}: {got_message}\n    expected {field}: {message}"
                        ),
                    );
                }
                // The plain serde error says the same, and names the field when serde can.
                match plain {
                    Ok(_) => failures.push(&f.file, "serde_json::from_slice accepts it"),
                    Err(e) if common::without_position(&e.to_string()) != message => {
                        failures.push(&f.file, format!("serde_json::from_slice says {e}"));
                    }
                    Err(_) => {}
                }
                // A missing field is named in the message; any other error is at a path that
                // leads to the offending value.
                let named = match message.strip_prefix("missing field `") {
                    Some(rest) => rest.ends_with('`'),
                    None => field != "." && f.json().pointer(&pointer(field)).is_some(),
                };
                if !named {
                    failures.push(
                        &f.file,
                        format!("the error does not lead to the field `{field}`"),
                    );
                }
            }
            (Expected::ServerError { field, message }, Ok(m)) => failures.push(
                &f.file,
                format!("must be refused ({field}: {message}), but parsed as {m:?}"),
            ),
            (Expected::ClientError(_), _) => {
                failures.push(&f.file, "a server frame expects a server error");
            }
        }
    }
    failures.assert_none("server fixtures do not deserialize as expected");
}

/// `actions[0].tool_type` as a JSON pointer: `/actions/0/tool_type`.
fn pointer(path: &str) -> String {
    let mut out = String::new();
    for segment in path.split(['.', '[']) {
        let segment = segment.trim_end_matches(']');
        if !segment.is_empty() {
            out.push('/');
            out.push_str(segment);
        }
    }
    out
}

#[test]
fn valid_client_fixtures_round_trip_without_losing_meaning() {
    let mut failures = Failures::default();
    let mut checked = 0;
    for f in client_fixtures().filter(|f| f.is_valid()) {
        checked += 1;
        let raw = f.json();
        let Ok(parsed) = proto_schemas::parse_client_frame(&f.bytes()) else {
            continue; // reported by client_fixtures_parse_as_the_manifest_says
        };
        let bytes = serde_json::to_vec(&parsed).expect("a ClientMessage serialises");
        match proto_schemas::parse_client_frame(&bytes) {
            Ok(again) if again == parsed => {}
            Ok(again) => failures.push(&f.file, format!("re-parsed differently: {again:?}")),
            Err(e) => failures.push(&f.file, format!("its serialisation is refused: {e}")),
        }
        let written: Value = serde_json::from_slice(&bytes).expect("serialisation is JSON");
        let meaning = common::client_meaning(&raw);
        if written != meaning {
            failures.push(
                &f.file,
                format!("serialisation lost or changed meaning:\n    wrote    {written}\n    expected {meaning}"),
            );
        }
        // Through a Value too (the path the services use).
        let via_value: Result<ClientMessage, _> = serde_json::from_value(raw);
        if via_value.ok().as_ref() != Some(&parsed) {
            failures.push(&f.file, "serde_json::from_value gives another frame");
        }
    }
    assert!(checked >= 35, "only {checked} valid client fixtures");
    failures.assert_none("valid client fixtures do not round-trip");
}

#[test]
fn valid_server_fixtures_round_trip_without_losing_meaning() {
    let mut failures = Failures::default();
    let mut checked = 0;
    for f in server_fixtures().filter(|f| f.is_valid()) {
        checked += 1;
        let raw = f.json();
        let Ok(parsed) = parse_server(&f.bytes()) else {
            continue; // reported by server_fixtures_deserialize_as_the_manifest_says
        };
        let bytes = serde_json::to_vec(&parsed).expect("a ServerMessage serialises");
        match serde_json::from_slice::<ServerMessage>(&bytes) {
            Ok(again) if again == parsed => {}
            Ok(again) => failures.push(&f.file, format!("re-parsed differently: {again:?}")),
            Err(e) => failures.push(&f.file, format!("its serialisation is refused: {e}")),
        }
        let written: Value = serde_json::from_slice(&bytes).expect("serialisation is JSON");
        let meaning = common::server_meaning(&raw);
        if written != meaning {
            failures.push(
                &f.file,
                format!("serialisation lost or changed meaning:\n    wrote    {written}\n    expected {meaning}"),
            );
        }
    }
    assert!(checked >= 40, "only {checked} valid server fixtures");
    failures.assert_none("valid server fixtures do not round-trip");
}

#[test]
fn parts_deserialize_and_round_trip() {
    fn round_trip<T>(raw: &Value) -> Result<Value, String>
    where
        T: serde::de::DeserializeOwned + serde::Serialize + PartialEq + std::fmt::Debug,
    {
        let parsed: T = serde_json::from_value(raw.clone()).map_err(|e| e.to_string())?;
        let written = serde_json::to_value(&parsed).map_err(|e| e.to_string())?;
        let again: T = serde_json::from_value(written.clone()).map_err(|e| e.to_string())?;
        if again != parsed {
            return Err(format!("re-parsed differently: {again:?}"));
        }
        Ok(written)
    }
    let mut failures = Failures::default();
    for part in &common::manifest().parts {
        let raw = part.json();
        let written = match part.kind.as_str() {
            "command" => round_trip::<Command>(&raw),
            "result" => round_trip::<ActionResult>(&raw),
            "mcp_tool_info" => round_trip::<McpToolInfo>(&raw),
            other => Err(format!("unknown part kind {other}")),
        };
        match written {
            Ok(written) if written == common::part_meaning(&part.kind, &raw) => {}
            Ok(written) => failures.push(&part.file, format!("serialisation changed: {written}")),
            Err(e) => failures.push(&part.file, e),
        }
    }
    failures.assert_none("parts do not round-trip");
}

#[test]
fn fixtures_pin_concrete_values() {
    // A few fields read by the services, asserted by value so a rename cannot go unnoticed.
    let read = |file: &str| {
        proto_schemas::parse_client_frame(&common::read(file))
            .unwrap_or_else(|e| panic!("{file}: {e}"))
    };
    let register = read("captured/02_constellation_session_constellation_register.json");
    assert_eq!(
        register.client_type,
        Some(proto_schemas::ClientType::Constellation)
    );
    assert_eq!(
        register.client_id.as_deref(),
        Some("aip_constellation@aip_test_device")
    );
    assert_eq!(register.target_id.as_deref(), Some("aip_test_device"));

    let device = read("captured/00_constellation_session_device_register.json");
    let details = proto_schemas::register_details(&device).expect("valid register");
    assert_eq!(details.platform, proto_schemas::Platform::Linux);
    assert_eq!(details.capabilities, ["gui", "cli"]);

    let results = read("wire/command_results_failure_skipped.json");
    let statuses: Vec<&str> = results
        .action_results
        .iter()
        .flatten()
        .map(|r| r.status.as_str())
        .collect();
    assert_eq!(statuses, ["success", "failure", "skipped", "none"]);

    let extensions = read("ext/register_with_extensions.json");
    let details = proto_schemas::register_details(&extensions).expect("valid register");
    let names: Vec<&str> = details.extensions.iter().map(|e| e.as_str()).collect();
    assert_eq!(
        names,
        ["task_end_result", "progress", "clarification", "handoff"]
    );
    assert_eq!(details.tools[0].tool_key, "action::click_input");

    let command = parse_server(&common::read("wire/command_last_step.json")).expect("valid");
    let tools: Vec<(&str, &str)> = command
        .actions
        .iter()
        .flatten()
        .map(|c| (c.tool_name.as_str(), c.tool_type.as_str()))
        .collect();
    assert_eq!(
        tools,
        [
            ("take_screenshot", "data_collection"),
            ("run_shell", "action"),
            ("get_ui_tree", "data_collection")
        ]
    );
    assert_eq!(command.agent_name.as_deref(), Some("LinuxAgent"));
}

#[test]
fn counts_per_source() {
    // Printed with `--nocapture`; the counts asserted elsewhere are the ones that matter.
    let mut counts: std::collections::BTreeMap<(&str, &str, bool), usize> = Default::default();
    for f in &common::manifest().fixtures {
        let direction = match f.direction {
            Direction::ClientToServer => "client",
            Direction::ServerToClient => "server",
        };
        *counts
            .entry((f.group(), direction, f.is_valid()))
            .or_default() += 1;
    }
    for ((group, direction, valid), n) in &counts {
        let validity = if *valid { "valid" } else { "invalid" };
        println!("{group:>9} {direction} {validity:>7}: {n}");
    }
    assert!(counts.values().sum::<usize>() >= 150);
}
