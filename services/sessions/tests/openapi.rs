//! The checked-in `openapi.json` matches what the service serves.
//!
//! Regenerate: `AIP_UPDATE_SCHEMAS=1 cargo test -p aip-sessions --test openapi`.

#[test]
fn checked_in_openapi_is_current() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("openapi.json");
    let mut generated =
        serde_json::to_string_pretty(&aip_sessions::http::openapi()).expect("serialises");
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
    let doc = aip_sessions::http::openapi();
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
