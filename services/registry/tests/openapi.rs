//! The checked-in `openapi.json` matches what the registry serves, and the document holds
//! together (the test kit's checks, shared with the session service).
//!
//! Regenerate: `AIP_UPDATE_SCHEMAS=1 cargo test -p aip-registry --test openapi`.

use aip_testkit::openapi;
use serde_json::Value;

fn document() -> Value {
    serde_json::to_value(aip_registry::http::openapi()).expect("the document serialises")
}

#[test]
fn checked_in_openapi_is_current() {
    openapi::assert_checked_in(env!("CARGO_MANIFEST_DIR"), "aip-registry", &document());
}

#[test]
fn openapi_references_resolve() {
    openapi::assert_references_resolve(&document());
}

#[test]
fn links_name_operations_that_exist() {
    openapi::assert_links_name_operations(&document());
}

#[test]
fn every_api_route_needs_a_key_and_says_so() {
    openapi::assert_api_routes_document_their_refusals(&document());
}
