//! `parse_client_frame` never panics, whatever a client sends, and what it accepts survives a
//! round trip.
//!
//! The gateway calls [`proto_schemas::parse_client_frame`] on every WebSocket text frame from
//! untrusted clients, so it must turn any input into a frame or an error. Four property tests
//! feed it:
//!
//! - (a) arbitrary bytes, and JSON-looking text made of JSON punctuation and field names;
//! - (b) arbitrary JSON values (a recursive strategy: scalars, arrays, objects, nested);
//! - (c) JSON objects with a valid `type` and `status` and random other fields of random JSON
//!   types (strings, nulls, lists of Results, objects, anything);
//! - (d) the valid client fixtures of `tests/fixtures/`, with one random field (at any depth)
//!   replaced by a random JSON value, removed, or added.
//!
//! Whenever the parser accepts an input, the frame must re-serialise, re-parse to an equal frame,
//! and mean the same as the input (the same JSON once `null` values and unknown keys are removed).
//! (c) and (d) also check that a fair share of their inputs is accepted, so the round-trip check
//! is not vacuous. The case counts keep the whole file to a few seconds in a debug build.

mod common;

use std::sync::LazyLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use proto_schemas::{ClientMessageType, TaskStatus, parse_client_frame};
use serde_json::{Map, Value};

/// Parses `bytes`; if accepted, checks the round trip. Returns whether it was accepted.
fn check(bytes: &[u8]) -> Result<bool, TestCaseError> {
    let Ok(frame) = parse_client_frame(bytes) else {
        return Ok(false);
    };
    let written = serde_json::to_vec(&frame)
        .map_err(|e| TestCaseError::fail(format!("an accepted frame does not serialise: {e}")))?;
    match parse_client_frame(&written) {
        Ok(again) => prop_assert_eq!(&again, &frame, "re-parsed differently"),
        Err(e) => {
            return Err(TestCaseError::fail(format!(
                "accepted {}, but refused its re-serialisation {}: {e}",
                String::from_utf8_lossy(bytes),
                String::from_utf8_lossy(&written)
            )));
        }
    }
    let input: Value = serde_json::from_slice(bytes)
        .map_err(|e| TestCaseError::fail(format!("accepted input is not JSON: {e}")))?;
    let written: Value = serde_json::from_slice(&written)
        .map_err(|e| TestCaseError::fail(format!("serialisation is not JSON: {e}")))?;
    prop_assert_eq!(
        written,
        common::client_meaning(&input),
        "the serialisation does not mean the same as the input"
    );
    Ok(true)
}

#[test]
fn arbitrary_bytes() {
    common::run_property(5000, prop::collection::vec(any::<u8>(), 0..512), |bytes| {
        check(&bytes).map(|_| ())
    });
}

#[test]
fn json_looking_text() {
    // Punctuation, escapes, numbers, literals and field names: mostly almost-JSON.
    let token = prop_oneof![
        prop::sample::select(vec![
            "{",
            "}",
            "[",
            "]",
            ":",
            ",",
            "\"",
            "\\",
            "\\u0000",
            "\\ud800",
            "null",
            "true",
            "1e999",
            "-0",
            "0.5",
            "\"type\"",
            "\"status\"",
            "\"register\"",
            "\"ok\"",
            "\"client_id\"",
            "\"metadata\"",
            "\"action_results\"",
            "\"task_end\"",
            " ",
        ])
        .prop_map(str::to_owned),
        "[a-z_]{1,8}",
    ];
    common::run_property(5000, prop::collection::vec(token, 0..60), |tokens| {
        check(tokens.concat().as_bytes()).map(|_| ())
    });
}

#[test]
fn arbitrary_json_values() {
    common::run_property(5000, common::json_value(), |value| {
        let bytes = serde_json::to_vec(&value).expect("a Value serialises");
        check(&bytes).map(|_| ())
    });
}

#[test]
fn objects_with_a_valid_type_and_status_and_random_fields() {
    let accepted = AtomicUsize::new(0);
    let key = prop_oneof![
        4 => prop::sample::select(common::CLIENT_KEYS[2..].to_vec()).prop_map(str::to_owned),
        1 => common::interesting_key(),
    ];
    let strategy = (
        prop::sample::select(ClientMessageType::ALL.to_vec()),
        prop::sample::select(TaskStatus::ALL.to_vec()),
        prop::collection::btree_map(key, common::field_value(), 0..8),
    );
    common::run_property(5000, strategy, |(kind, status, fields)| {
        let mut object: Map<String, Value> = fields.into_iter().collect();
        object.insert("type".to_owned(), Value::from(kind.as_str()));
        object.insert("status".to_owned(), Value::from(status.as_str()));
        let bytes = serde_json::to_vec(&object).expect("serialises");
        if check(&bytes)? {
            accepted.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    });
    let accepted = accepted.into_inner();
    assert!(
        accepted >= 250,
        "only {accepted} of 5000 objects were accepted"
    );
}

/// The valid client fixtures, as JSON.
fn valid_client_fixtures() -> &'static [Value] {
    static FIXTURES: LazyLock<Vec<Value>> = LazyLock::new(|| {
        common::manifest()
            .fixtures
            .iter()
            .filter(|f| f.direction == common::Direction::ClientToServer && f.is_valid())
            .map(common::Fixture::json)
            .collect()
    });
    &FIXTURES
}

/// One change to a frame: to a child of the node reached by following a path of indices
/// (each taken modulo the number of children).
#[derive(Debug, Clone)]
enum Mutation {
    /// Replace the node with this value.
    Replace(Value),
    /// Remove the node from its object or list.
    Remove,
    /// Add (or overwrite) a key of the node's parent object.
    Insert(String, Value),
}

fn mutate(frame: &mut Value, path: &[usize], mutation: Mutation) {
    let Some((last, steps)) = path.split_last() else {
        return;
    };
    // Go down through containers while `steps` last, then change a child of where we stopped.
    let mut node = frame;
    for index in steps {
        let child = match &*node {
            Value::Object(o) if !o.is_empty() => index % o.len(),
            Value::Array(a) if !a.is_empty() => index % a.len(),
            _ => break,
        };
        let is_container = |v: &Value| v.is_object() || v.is_array();
        let descend = match &*node {
            Value::Object(o) => o.values().nth(child).is_some_and(is_container),
            Value::Array(a) => a.get(child).is_some_and(is_container),
            _ => false,
        };
        if !descend {
            break;
        }
        node = match node {
            Value::Object(o) => o.values_mut().nth(child).expect("checked above"),
            Value::Array(a) => &mut a[child],
            _ => return,
        };
    }
    apply(node, *last, mutation);
}

/// Applies `mutation` to the child `index` of `parent`.
fn apply(parent: &mut Value, index: usize, mutation: Mutation) {
    match (parent, mutation) {
        (Value::Object(o), Mutation::Insert(key, value)) => {
            o.insert(key, value);
        }
        (Value::Object(o), Mutation::Replace(value)) if !o.is_empty() => {
            let n = o.len();
            if let Some(child) = o.values_mut().nth(index % n) {
                *child = value;
            }
        }
        (Value::Object(o), Mutation::Remove) if !o.is_empty() => {
            let n = o.len();
            if let Some(key) = o.keys().nth(index % n).cloned() {
                o.remove(&key);
            }
        }
        (Value::Array(a), Mutation::Replace(value)) if !a.is_empty() => {
            let n = a.len();
            a[index % n] = value;
        }
        (Value::Array(a), Mutation::Remove) if !a.is_empty() => {
            let n = a.len();
            a.remove(index % n);
        }
        (Value::Array(a), Mutation::Insert(_, value)) => a.push(value),
        _ => {}
    }
}

#[test]
fn mutated_valid_fixtures() {
    let fixtures = valid_client_fixtures();
    assert!(
        fixtures.len() >= 35,
        "only {} valid client fixtures",
        fixtures.len()
    );
    let accepted = AtomicUsize::new(0);
    let refused = AtomicUsize::new(0);
    let mutation = prop_oneof![
        4 => common::field_value().prop_map(Mutation::Replace),
        1 => Just(Mutation::Remove),
        2 => (common::interesting_key(), common::field_value())
            .prop_map(|(k, v)| Mutation::Insert(k, v)),
    ];
    let strategy = (
        0..fixtures.len(),
        prop::collection::vec(any::<usize>(), 1..5),
        mutation,
    );
    common::run_property(5000, strategy, |(which, path, mutation)| {
        let mut frame = fixtures[which].clone();
        mutate(&mut frame, &path, mutation);
        let bytes = serde_json::to_vec(&frame).expect("serialises");
        if check(&bytes)? {
            accepted.fetch_add(1, Ordering::Relaxed);
        } else {
            refused.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    });
    let (accepted, refused) = (accepted.into_inner(), refused.into_inner());
    assert!(
        accepted >= 500 && refused >= 500,
        "mutations should both keep and break frames: {accepted} accepted, {refused} refused"
    );
}

#[test]
fn mutation_changes_the_frame() {
    // The mutation helper itself: one step down replaces a top-level field.
    let mut frame = serde_json::json!({"type": "heartbeat", "status": "ok"});
    mutate(&mut frame, &[0], Mutation::Replace(Value::from(5)));
    assert_ne!(
        frame,
        serde_json::json!({"type": "heartbeat", "status": "ok"})
    );
    let mut frame = serde_json::json!({"a": {"b": [1, 2]}});
    mutate(&mut frame, &[0, 0, 0], Mutation::Remove);
    assert_ne!(frame, serde_json::json!({"a": {"b": [1, 2]}}));
}
