//! Bodies larger than the bus carries.
//!
//! NATS carries 1 MiB per message by default, and UFO's frames reach 100 MiB (screenshots, UI
//! trees). A body that does not fit is stored in a blob stream, in chunks, and the message
//! carries a reference to it in the `Aip-Blob` header with an empty payload;
//! [`payload_of`] resolves it on the receiving side. The in-process bus stores blobs in memory
//! the same way, so the path is exercised in both modes.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::{Bus, BusError, Headers, Message};

/// Header carrying a [`BlobRef`] as JSON.
pub const BLOB_HEADER: &str = "Aip-Blob";

/// Room left in a message for headers and subject.
const HEADROOM: usize = 16 * 1024;

/// Largest body a blob reference may claim: ten times the largest frame UFO exchanges.
/// The receiver reserves the claimed size before reading the chunks, so a corrupt or forged
/// `Aip-Blob` header must not be able to make it reserve more (a claim of many GiB aborts the
/// process when the allocation fails).
pub const MAX_BLOB_BYTES: usize = 10 * proto_schemas::MAX_FRAME_BYTES;

/// Where a stored body is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobRef {
    /// The blob stream.
    pub stream: String,
    /// The chunks, in order (stream sequence numbers).
    pub sequences: Vec<u64>,
    /// Total size in bytes.
    pub size: usize,
}

/// The blob stream of a deployment: its name and the subject chunks are stored under.
#[derive(Debug, Clone)]
pub struct BlobStore {
    /// Stream name.
    pub stream: String,
    /// Subject prefix of chunks (`<prefix>.blobs`).
    pub subject: String,
}

impl BlobStore {
    /// The blob store of a deployment's subjects.
    pub fn for_subjects(subjects: &proto_schemas::Subjects) -> Self {
        BlobStore {
            stream: subjects.blobs_stream(),
            subject: subjects.blobs(),
        }
    }

    /// The stream to create at start-up: chunks kept one hour, at most `max_bytes` in all
    /// (-1: no cap; see [`crate::NatsSettings::nats_blobs_max_bytes`]).
    pub fn stream_spec(&self, max_bytes: i64) -> crate::StreamSpec {
        let mut spec =
            crate::StreamSpec::new(self.stream.clone(), vec![format!("{}.>", self.subject)]);
        spec.max_age = std::time::Duration::from_secs(3600);
        spec.max_bytes = max_bytes;
        spec
    }

    /// Largest chunk for a bus.
    fn chunk_size(bus: &dyn Bus) -> usize {
        bus.max_payload().saturating_sub(HEADROOM).max(1024)
    }

    /// Whether `payload` must travel as a blob on `bus`.
    pub fn needed(bus: &dyn Bus, payload: &[u8]) -> bool {
        payload.len() + HEADROOM > bus.max_payload()
    }

    async fn store(
        &self,
        bus: &dyn Bus,
        headers: &mut Headers,
        payload: Bytes,
    ) -> Result<Bytes, BusError> {
        if !Self::needed(bus, &payload) {
            return Ok(payload);
        }
        let subject = format!("{}.{}", self.subject, uuid::Uuid::new_v4().simple());
        let blob = bus
            .put_blob(self.stream.clone(), subject, payload, Self::chunk_size(bus))
            .await?;
        let reference = serde_json::to_string(&blob).map_err(|source| BusError::Encode {
            what: "a large body's blob reference",
            source,
        })?;
        headers.insert(BLOB_HEADER, reference);
        Ok(Bytes::new())
    }

    /// Publishes, storing the body as a blob if it is too large for one message.
    pub async fn publish(
        &self,
        bus: &dyn Bus,
        subject: String,
        mut headers: Headers,
        payload: Bytes,
    ) -> Result<(), BusError> {
        let payload = self.store(bus, &mut headers, payload).await?;
        bus.publish(subject, headers, payload).await
    }

    /// [`BlobStore::publish`] into a durable stream.
    pub async fn publish_durable(
        &self,
        bus: &dyn Bus,
        subject: String,
        mut headers: Headers,
        payload: Bytes,
    ) -> Result<(), BusError> {
        let payload = self.store(bus, &mut headers, payload).await?;
        bus.publish_durable(subject, headers, payload).await
    }
}

/// The body of a message: its payload, or the blob its `Aip-Blob` header points to.
pub async fn payload_of(bus: &dyn Bus, message: &Message) -> Result<Bytes, BusError> {
    match message.headers.get(BLOB_HEADER) {
        None => Ok(message.payload.clone()),
        Some(text) => {
            let blob: BlobRef = serde_json::from_str(text).map_err(|e| BusError::Nats {
                operation: "read blob reference",
                subject: message.subject.clone(),
                source: Box::new(e),
            })?;
            if blob.size > MAX_BLOB_BYTES {
                return Err(BusError::PayloadTooLarge {
                    size: blob.size,
                    limit: MAX_BLOB_BYTES,
                });
            }
            bus.get_blob(blob).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LocalBus;

    fn with_blob_header(text: &str) -> Message {
        Message {
            subject: "aip.frames.x".to_owned(),
            reply: None,
            headers: Headers::new().with(BLOB_HEADER, text),
            payload: Bytes::new(),
        }
    }

    #[tokio::test]
    async fn a_reference_claiming_a_huge_size_is_refused_without_reserving_it() {
        // Found by the `bus_payload` fuzz target: the claimed size was reserved up front,
        // and a forged header aborted the receiving service.
        let bus = LocalBus::new();
        let message = with_blob_header(r#"{"stream":"s","sequences":[],"size":99999999999}"#);
        let result = payload_of(&bus, &message).await;
        assert!(
            matches!(
                result,
                Err(BusError::PayloadTooLarge {
                    size: 99_999_999_999,
                    ..
                })
            ),
            "{result:?}"
        );
    }

    #[tokio::test]
    async fn a_large_body_travels_as_a_blob_and_reads_back() {
        let bus = LocalBus::with_limits(16, 64 * 1024);
        let store = BlobStore::for_subjects(&proto_schemas::Subjects::default());
        let body = Bytes::from(vec![7u8; 200 * 1024]);
        let mut headers = Headers::new();
        let payload = store
            .store(&bus, &mut headers, body.clone())
            .await
            .expect("stored");
        assert!(payload.is_empty());
        let message = Message {
            subject: "aip.frames.x".to_owned(),
            reply: None,
            headers,
            payload,
        };
        assert_eq!(payload_of(&bus, &message).await.expect("read back"), body);
    }
}
