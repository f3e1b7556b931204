//! Outbox frames for one gateway, gathered into one message.
//!
//! A group commit releases the frames of every change it wrote, and under load many of them
//! are for clients of the same gateway. Sent one by one, each frame is a bus message, and the
//! gateway's acknowledgement of it usually another. To a gateway that reads
//! [`DeliveryBatch`]es ([`crate::routes::Routes::takes_batches`]) the frames of one group
//! travel together instead: one message per gateway (split past [`MAX_DELIVERIES`] frames or
//! the size given; a frame larger than that alone travels alone), in their order, which the gateway takes apart into the messages they
//! stand for. Nothing waits to fill a batch: it holds what one group released. A frame stored
//! as a blob, the only frame of its group for its gateway, or a frame sent again by the outbox
//! sweeper travels alone, as before ([`crate::engine`]).

use proto_schemas::V1;
use proto_schemas::sessions::{BatchedFrame, DeliveryBatch, MAX_DELIVERIES};
use serde_json::value::RawValue;

/// Bytes one delivery adds to a batch besides its frame and its ids (field names, quotes,
/// separators), counted generously.
const PER_DELIVERY: usize = 128;

/// The frames gathered for one gateway and not sent yet, with the spans of their publish.
#[derive(Default)]
pub struct Gathered<'a> {
    deliveries: Vec<BatchedFrame<'a>>,
    spans: Vec<tracing::Span>,
    bytes: usize,
}

/// One outbox frame as a delivery of a batch, or `None` when its payload is not one JSON
/// value (it then travels alone, as it is).
pub fn delivery<'a>(
    msg_id: &str,
    client_id: &str,
    connection_id: Option<&str>,
    traceparent: Option<String>,
    payload: &'a [u8],
) -> Option<BatchedFrame<'a>> {
    let frame: &RawValue = serde_json::from_slice(payload).ok()?;
    Some(BatchedFrame {
        msg_id: msg_id.to_owned(),
        client_id: client_id.to_owned(),
        connection_id: connection_id.map(str::to_owned),
        traceparent,
        frame,
    })
}

fn size(delivery: &BatchedFrame<'_>) -> usize {
    PER_DELIVERY
        + delivery.frame.get().len()
        + delivery.msg_id.len()
        + delivery.client_id.len()
        + delivery.connection_id.as_ref().map_or(0, String::len)
        + delivery.traceparent.as_ref().map_or(0, String::len)
}

/// Whether `delivery` is too large for a batch of at most `limit` bytes even alone (it then
/// travels as a message of its own).
pub fn too_large(delivery: &BatchedFrame<'_>, limit: usize) -> bool {
    size(delivery) > limit
}

impl<'a> Gathered<'a> {
    /// Whether `delivery` can join those gathered in a batch of at most `limit` bytes.
    pub fn fits(&self, delivery: &BatchedFrame<'_>, limit: usize) -> bool {
        self.deliveries.len() < MAX_DELIVERIES && self.bytes + size(delivery) <= limit
    }

    /// Adds a delivery, and the span of its publish (ended once the batch is sent).
    pub fn push(&mut self, delivery: BatchedFrame<'a>, span: tracing::Span) {
        self.bytes += size(&delivery);
        self.deliveries.push(delivery);
        self.spans.push(span);
    }

    /// Whether nothing is gathered.
    pub fn is_empty(&self) -> bool {
        self.deliveries.is_empty()
    }

    /// The batch of what is gathered, encoded, with the message ids it carries and the spans
    /// of their publish; empty afterwards.
    pub fn take(&mut self) -> Taken {
        let deliveries = std::mem::take(&mut self.deliveries);
        let msg_ids = deliveries.iter().map(|d| d.msg_id.clone()).collect();
        self.bytes = 0;
        let batch = DeliveryBatch {
            version: V1,
            deliveries,
        };
        Taken {
            payload: serde_json::to_vec(&batch),
            msg_ids,
            spans: std::mem::take(&mut self.spans),
        }
    }
}

/// A batch ready to publish.
pub struct Taken {
    /// The encoded [`DeliveryBatch`].
    pub payload: Result<Vec<u8>, serde_json::Error>,
    /// The outbox ids of its frames, in order.
    pub msg_ids: Vec<String>,
    /// The spans of their publish.
    pub spans: Vec<tracing::Span>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_carries_each_frame_verbatim_with_its_ids() {
        let mut gathered = Gathered::default();
        let first = br#"{"type":"command","session_id":"s1"}"#;
        let second = br#"{"type":"task_end", "status":"completed"}"#;
        for (id, client, connection, payload) in [
            ("m1", "dev-1", Some("c1"), &first[..]),
            ("m2", "const-1", None, &second[..]),
        ] {
            let d = delivery(id, client, connection, None, payload).expect("JSON");
            assert!(gathered.fits(&d, 1 << 20));
            gathered.push(d, tracing::Span::none());
        }
        let taken = gathered.take();
        assert!(gathered.is_empty());
        assert_eq!(taken.msg_ids, ["m1", "m2"]);
        let payload = taken.payload.expect("encoded");
        let read: DeliveryBatch<'_> = serde_json::from_slice(&payload).expect("a batch");
        assert_eq!(read.deliveries.len(), 2);
        assert_eq!(read.deliveries[0].frame.get().as_bytes(), first);
        assert_eq!(read.deliveries[0].connection_id.as_deref(), Some("c1"));
        assert_eq!(read.deliveries[1].frame.get().as_bytes(), second);
        assert_eq!(read.deliveries[1].client_id, "const-1");
        assert_eq!(read.deliveries[1].connection_id, None);
    }

    #[test]
    fn a_batch_stops_at_its_size_or_count_and_text_that_is_not_json_travels_alone() {
        assert!(delivery("m", "c", None, None, b"not json").is_none());
        assert!(delivery("m", "c", None, None, b"{} {}").is_none());
        let frame = br#"{"type":"command"}"#;
        let mut gathered = Gathered::default();
        let one = delivery("m0", "c", None, None, frame).expect("JSON");
        let limit = size(&one) * 2;
        gathered.push(one, tracing::Span::none());
        let two = delivery("m1", "c", None, None, frame).expect("JSON");
        assert!(gathered.fits(&two, limit));
        gathered.push(two, tracing::Span::none());
        let three = delivery("m2", "c", None, None, frame).expect("JSON");
        assert!(!gathered.fits(&three, limit), "over the size");
        assert!(Gathered::default().fits(&three, limit));
        assert!(!too_large(&three, limit));
        assert!(
            too_large(&three, limit / 2 - 1),
            "a frame larger than a batch travels alone"
        );
        let mut full = Gathered::default();
        for i in 0..MAX_DELIVERIES {
            let d = delivery(&format!("m{i}"), "c", None, None, frame).expect("JSON");
            full.push(d, tracing::Span::none());
        }
        let more = delivery("m", "c", None, None, frame).expect("JSON");
        assert!(!full.fits(&more, usize::MAX), "over the count");
    }
}
