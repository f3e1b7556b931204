//! Everything the services decode from bus messages, fed the same bytes.
//!
//! - the session service: `GatewayEvent` from the frames stream, `TaskRequest` on
//!   `sessions.submit`, the planner's `Reply<PlanStep>`, gateways' `DeliveryAck`s;
//! - the registry: its requests (read like `bus_api::parse`, with the field path) and
//!   `PresenceBatch`;
//! - the registry client (gateway, sessions): the registry's replies;
//! - every receiver: the `Aip-Blob` header, resolved by `BlobStore::payload_of`.
//!
//! None may panic, and whatever decodes must re-encode to the same value.

#![no_main]

use std::fmt::Debug;

use aip_bus::{BLOB_HEADER, BlobStore, Headers, LocalBus, Message};
use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use proto_schemas::flow::TaskRequest;
use proto_schemas::registry::{
    AgentRecord, GatewayStarted, GatewayStartedAck, GetAgent, LookupAgents, PresenceBatch,
    RegisterAgent, Registered, Reply, UnregisterAgent, Unregistered,
};
use proto_schemas::sessions::{DeliveryAck, GatewayEvent, PlanStep};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Decodes `bytes` as `T`; if that works, checks that the value survives a round trip.
fn round_trip<T: Serialize + DeserializeOwned + PartialEq + Debug>(bytes: &[u8]) {
    let Ok(value) = serde_json::from_slice::<T>(bytes) else {
        return;
    };
    let written = serde_json::to_vec(&value).expect("a decoded payload serialises");
    let again: T = serde_json::from_slice(&written).unwrap_or_else(|e| {
        panic!(
            "decoded {}, then refused its own serialisation {}: {e}",
            std::any::type_name::<T>(),
            String::from_utf8_lossy(&written)
        )
    });
    assert_eq!(
        again,
        value,
        "{} changed in a round trip",
        std::any::type_name::<T>()
    );
}

/// The registry's request parsing: serde with the path of the offending field.
fn registry_request<T: DeserializeOwned>(bytes: &[u8]) {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    if let Err(e) = serde_path_to_error::deserialize::<_, T>(&mut deserializer) {
        let _ = (e.path().to_string(), e.into_inner().to_string());
    }
}

fuzz_target!(|data: &[u8]| {
    round_trip::<GatewayEvent>(data);
    round_trip::<TaskRequest>(data);
    round_trip::<Reply<PlanStep>>(data);
    round_trip::<PresenceBatch>(data);
    round_trip::<DeliveryAck>(data);
    round_trip::<GatewayStarted>(data);
    round_trip::<Reply<GatewayStartedAck>>(data);
    round_trip::<RegisterAgent>(data);
    round_trip::<UnregisterAgent>(data);
    round_trip::<GetAgent>(data);
    round_trip::<LookupAgents>(data);
    round_trip::<Reply<Registered>>(data);
    round_trip::<Reply<Unregistered>>(data);
    round_trip::<Reply<AgentRecord>>(data);
    round_trip::<Reply<Vec<AgentRecord>>>(data);
    registry_request::<RegisterAgent>(data);
    registry_request::<UnregisterAgent>(data);
    registry_request::<GetAgent>(data);
    registry_request::<LookupAgents>(data);
    registry_request::<GatewayStarted>(data);

    // A header value is text; resolving it against a bus that holds no blob must fail cleanly.
    if let Ok(text) = std::str::from_utf8(data) {
        round_trip::<aip_bus::BlobRef>(data);
        let bus = LocalBus::new();
        let message = Message {
            subject: "aip.frames.x".to_owned(),
            reply: None,
            headers: Headers::new().with(BLOB_HEADER, text),
            payload: Bytes::new(),
        };
        let store = BlobStore::for_subjects(&proto_schemas::Subjects::default());
        let _ = futures::executor::block_on(store.payload_of(&bus, &message));
    }
});
