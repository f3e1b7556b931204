//! The checked-in JSON Schemas and AsyncAPI document match what the code generates.
//!
//! Regenerate after changing a wire type: `AIP_UPDATE_SCHEMAS=1 cargo test -p proto-schemas --test generated`.

use std::path::Path;

#[test]
fn checked_in_schemas_and_asyncapi_are_current() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let update = std::env::var_os("AIP_UPDATE_SCHEMAS").is_some_and(|v| v == "1");
    let mut stale = Vec::new();
    let files = proto_schemas::schema::generated_files();
    for (relative, contents) in &files {
        let path = root.join(relative);
        let current = std::fs::read_to_string(&path).unwrap_or_default();
        if current != *contents {
            if update {
                std::fs::create_dir_all(path.parent().expect("has a parent"))
                    .expect("create schema dir");
                std::fs::write(&path, contents).expect("write schema");
            } else {
                stale.push(relative.clone());
            }
        }
    }
    // No stray files: every schema on disk is generated.
    let generated: Vec<_> = files.iter().map(|(p, _)| p.clone()).collect();
    for entry in std::fs::read_dir(root.join("schemas")).expect("proto-schemas/schemas exists") {
        let name = format!(
            "schemas/{}",
            entry.expect("dir entry").file_name().to_string_lossy()
        );
        if !generated.contains(&name) {
            stale.push(format!("{name} (not generated any more: delete it)"));
        }
    }
    assert!(
        stale.is_empty(),
        "stale generated files: {stale:?}\nregenerate with: AIP_UPDATE_SCHEMAS=1 cargo test -p proto-schemas --test generated"
    );
}

#[test]
fn asyncapi_lists_every_subject_with_publishers_and_consumers() {
    let doc = proto_schemas::schema::asyncapi();
    assert_eq!(doc["asyncapi"], "3.0.0");
    assert_eq!(doc["channels"]["websocket"]["address"], "/ws");
    for spec in proto_schemas::subjects::CATALOGUE {
        let channel = doc["channels"]
            .as_object()
            .and_then(|c| {
                c.values()
                    .find(|ch| ch["address"] == format!("aip.{}", spec.template))
            })
            .unwrap_or_else(|| panic!("no channel for subject {}", spec.template));
        assert_eq!(
            channel["x-publishers"].as_array().map(Vec::len),
            Some(spec.publishers.len())
        );
        assert_eq!(
            channel["x-consumers"].as_array().map(Vec::len),
            Some(spec.consumers.len())
        );
        assert!(
            doc["components"]["schemas"][spec.payload].is_object(),
            "payload schema {} missing",
            spec.payload
        );
    }
}

/// Every local `$ref` of a document resolves, and no component is merely a reference to itself.
pub fn assert_refs_resolve(doc: &serde_json::Value) {
    fn walk(doc: &serde_json::Value, node: &serde_json::Value, bad: &mut Vec<String>) {
        match node {
            serde_json::Value::Object(map) => {
                if let Some(serde_json::Value::String(r)) = map.get("$ref")
                    && let Some(pointer) = r.strip_prefix('#')
                {
                    match doc.pointer(pointer) {
                        None => bad.push(format!("{r} does not resolve")),
                        Some(target) if target == node => bad.push(format!("{r} refers to itself")),
                        Some(_) => {}
                    }
                }
                map.values().for_each(|v| walk(doc, v, bad));
            }
            serde_json::Value::Array(items) => items.iter().for_each(|v| walk(doc, v, bad)),
            _ => {}
        }
    }
    let mut bad = Vec::new();
    walk(doc, doc, &mut bad);
    assert!(bad.is_empty(), "broken references: {bad:?}");
}

#[test]
fn asyncapi_references_resolve() {
    assert_refs_resolve(&proto_schemas::schema::asyncapi());
}
