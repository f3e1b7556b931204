//! The checked-in `openapi.json` matches what the service serves.
//!
//! Regenerate: `AIP_UPDATE_SCHEMAS=1 cargo test -p aip-sessions --test openapi`.

use serde_json::Value;

fn document() -> Value {
    serde_json::to_value(aip_sessions::http::openapi()).expect("the document serialises")
}

#[test]
fn checked_in_openapi_is_current() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("openapi.json");
    let mut generated = serde_json::to_string_pretty(&document()).expect("serialises");
    generated.push('\n');
    if std::env::var_os("AIP_UPDATE_SCHEMAS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &generated).expect("write openapi.json");
    }
    let current = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        current == generated,
        "services/sessions/openapi.json is stale; regenerate with: AIP_UPDATE_SCHEMAS=1 cargo test -p aip-sessions --test openapi"
    );
}

#[test]
fn openapi_references_resolve() {
    let doc = document();
    let text = doc.to_string();
    for r in text
        .split("\"$ref\":\"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
    {
        let pointer = r
            .strip_prefix('#')
            .unwrap_or_else(|| panic!("non-local ref {r}"));
        let target = doc
            .pointer(pointer)
            .unwrap_or_else(|| panic!("{r} does not resolve"));
        assert!(
            target.get("$ref").and_then(|t| t.as_str()) != Some(r),
            "{r} refers to itself"
        );
    }
}

#[test]
fn links_name_operations_that_exist() {
    let doc = document();
    let mut operation_ids = Vec::new();
    for item in doc["paths"].as_object().expect("paths").values() {
        for operation in item.as_object().expect("item").values() {
            if let Some(id) = operation["operationId"].as_str() {
                operation_ids.push(id.to_owned());
            }
        }
    }
    let text = doc.to_string();
    let linked: Vec<&str> = text
        .split("\"operationId\":\"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .collect();
    for id in linked {
        assert!(operation_ids.iter().any(|o| o == id), "link to {id}");
    }
    assert!(
        doc.pointer("/paths/~1api~1tasks/post/responses/201/links/created_get_task")
            .is_some(),
        "a created task links to its state"
    );
}

#[test]
fn every_api_route_needs_a_key_and_says_so() {
    let doc = document();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, operation) in item.as_object().expect("item") {
            let responses = &operation["responses"];
            if path.starts_with("/api/") {
                assert!(responses.get("401").is_some(), "{method} {path}: 401");
                assert!(operation["security"].is_array(), "{method} {path}");
            }
            if operation.get("requestBody").is_some() {
                assert!(responses.get("415").is_some(), "{method} {path}: 415");
                assert!(responses.get("400").is_some(), "{method} {path}: 400");
            }
        }
    }
}
