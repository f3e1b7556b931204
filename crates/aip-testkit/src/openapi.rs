//! Checks every service's OpenAPI document must pass: the checked-in copy is what the service
//! generates, every `$ref` resolves, every link names a real operation, and every `/api/`
//! route documents its 401 (and, with a body, its 400 and 415).

use std::path::Path;

use serde_json::Value;

/// Compares `document` with the checked-in `openapi.json` of the crate at `crate_dir`, or
/// writes it there when `AIP_UPDATE_SCHEMAS=1`; `package` names the crate in the message.
pub fn assert_checked_in(crate_dir: &str, package: &str, document: &Value) {
    let path = Path::new(crate_dir).join("openapi.json");
    let mut generated = serde_json::to_string_pretty(document).expect("the document serialises");
    generated.push('\n');
    if std::env::var_os("AIP_UPDATE_SCHEMAS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &generated).expect("write openapi.json");
    }
    let current = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    assert!(
        current == generated,
        "{} is stale; regenerate with: AIP_UPDATE_SCHEMAS=1 cargo test -p {package} --test openapi",
        path.display()
    );
}

/// Every `$ref` points at something in the document, and nothing refers to itself.
pub fn assert_references_resolve(document: &Value) {
    let text = document.to_string();
    for r in text
        .split("\"$ref\":\"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
    {
        let pointer = r
            .strip_prefix('#')
            .unwrap_or_else(|| panic!("non-local ref {r}"));
        let target = document
            .pointer(pointer)
            .unwrap_or_else(|| panic!("{r} does not resolve"));
        assert!(
            target.get("$ref").and_then(|t| t.as_str()) != Some(r),
            "{r} refers to itself"
        );
    }
}

/// Every link's `operationId` is an operation of the document.
pub fn assert_links_name_operations(document: &Value) {
    let mut operation_ids = Vec::new();
    for item in document["paths"].as_object().expect("paths").values() {
        for operation in item.as_object().expect("item").values() {
            if let Some(id) = operation["operationId"].as_str() {
                operation_ids.push(id.to_owned());
            }
        }
    }
    let text = document.to_string();
    for id in text
        .split("\"operationId\":\"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
    {
        assert!(operation_ids.iter().any(|o| o == id), "link to {id}");
    }
}

/// Every `/api/` route needs a key and documents its 401; every route with a body documents
/// its 400 and 415.
pub fn assert_api_routes_document_their_refusals(document: &Value) {
    for (path, item) in document["paths"].as_object().expect("paths") {
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
