//! What the gateway does with one WebSocket text message from an untrusted client.
//!
//! The gateway parses the text with `parse_client_frame`; a REGISTER is read further with
//! `register_details`; a refusal goes back as an ERROR frame built from the typed error; an
//! accepted frame is forwarded to the session service inside a `GatewayEvent`. Whatever the
//! bytes, none of this may panic, and what is accepted must survive every hop unchanged.

#![no_main]

use libfuzzer_sys::fuzz_target;
use proto_schemas::sessions::{GatewayEvent, InboundFrame};
use proto_schemas::{
    ClientMessageType, ClientType, ErrorCode, Platform, V1, parse_client_frame, register_details,
    server,
};

fuzz_target!(|data: &[u8]| {
    match parse_client_frame(data) {
        Ok(frame) => {
            let written = serde_json::to_vec(&frame).expect("an accepted frame serialises");
            let again = parse_client_frame(&written).unwrap_or_else(|e| {
                panic!(
                    "accepted a frame, then refused its own serialisation {}: {e}",
                    String::from_utf8_lossy(&written)
                )
            });
            assert_eq!(again, frame, "the serialisation parses to another frame");

            let platform = if frame.kind == ClientMessageType::Register {
                // A REGISTER that validated has readable details: the gateway relies on it.
                let details = register_details(&frame)
                    .unwrap_or_else(|e| panic!("a valid REGISTER has no details: {e}"));
                details.platform
            } else {
                Platform::Windows
            };

            // The hop to the session service: the frames stream carries it as JSON.
            let event = GatewayEvent::Frame(InboundFrame {
                version: V1,
                gateway_id: "gw".to_owned(),
                connection_id: "conn".to_owned(),
                client_id: frame.client_id.clone().unwrap_or_default(),
                client_type: frame.client_type.unwrap_or(ClientType::Device),
                platform,
                extensions: Vec::new(),
                received_at: server::timestamp_now(),
                frame,
                delivery_batches: true,
            });
            let payload = serde_json::to_vec(&event).expect("a gateway event serialises");
            let decoded: GatewayEvent = serde_json::from_slice(&payload).unwrap_or_else(|e| {
                panic!(
                    "the session service cannot read {}: {e}",
                    String::from_utf8_lossy(&payload)
                )
            });
            assert_eq!(decoded, event, "the frames stream changed the event");
        }
        Err(error) => {
            // Refusals are typed: a protocol error with a message the client is sent.
            assert_eq!(error.code, ErrorCode::ProtocolError);
            let text = error.to_string();
            assert!(!text.is_empty());
            let reply = server::error(error.code, text);
            serde_json::to_vec(&reply).expect("an ERROR frame serialises");
        }
    }
});
