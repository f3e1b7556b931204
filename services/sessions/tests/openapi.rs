//! The checked-in `openapi.json` matches what the service serves, and the document holds
//! together (the test kit's checks, shared with the registry).
//!
//! Regenerate: `AIP_UPDATE_SCHEMAS=1 cargo test -p aip-sessions --test openapi`.

use aip_testkit::openapi;
use serde_json::Value;

fn document() -> Value {
    serde_json::to_value(aip_sessions::http::openapi()).expect("the document serialises")
}

#[test]
fn checked_in_openapi_is_current() {
    openapi::assert_checked_in(env!("CARGO_MANIFEST_DIR"), "aip-sessions", &document());
}

#[test]
fn openapi_references_resolve() {
    openapi::assert_references_resolve(&document());
}

#[test]
fn links_name_operations_that_exist() {
    let doc = document();
    openapi::assert_links_name_operations(&doc);
    assert!(
        doc.pointer("/paths/~1api~1tasks/post/responses/201/links/created_get_task")
            .is_some(),
        "a created task links to its state"
    );
}

#[test]
fn every_api_route_needs_a_key_and_says_so() {
    openapi::assert_api_routes_document_their_refusals(&document());
}
