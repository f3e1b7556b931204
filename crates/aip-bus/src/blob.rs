//! Bodies larger than the bus carries.
//!
//! NATS carries 1 MiB per message by default, and UFO's frames reach 100 MiB (screenshots, UI
//! trees). A body that does not fit is stored in a blob stream, in chunks, and the message
//! carries a reference to it in the `Aip-Blob` header with an empty payload;
//! [`BlobStore::payload_of`] resolves (and checks) it on the receiving side. The in-process bus stores blobs in memory
//! the same way, so the path is exercised in both modes.

use bytes::Bytes;
use futures::StreamExt;
use serde::{Deserialize, Serialize};

use crate::{Bus, BusError, Headers, Message};

/// Header carrying a [`BlobRef`] as JSON.
pub const BLOB_HEADER: &str = "Aip-Blob";

/// Room left in a message for headers and subject.
const HEADROOM: usize = 16 * 1024;

/// Room in a blob for what wraps a frame (the gateway's event around a client's frame, ids
/// and timestamps).
const ENVELOPE_BYTES: usize = 1024 * 1024;

/// Largest body a blob reference may claim by default: the largest frame UFO exchanges
/// ([`proto_schemas::MAX_FRAME_BYTES`]) and its envelope. The receiver reserves the claimed
/// size before reading the chunks, so a corrupt or forged `Aip-Blob` header must not be able
/// to make it reserve more (a claim of many GiB aborts the process when the allocation
/// fails).
pub const MAX_BLOB_BYTES: usize = proto_schemas::MAX_FRAME_BYTES + ENVELOPE_BYTES;

/// Chunks of one blob being read at once.
const CHUNKS_READ_AHEAD: usize = 8;

/// Smallest chunk a blob is stored in (but its last): the bound on how many chunks a
/// reference of a given size may list.
const MIN_CHUNK_BYTES: usize = 1024;

/// What is wrong with a refused `Aip-Blob` reference.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlobRefProblem {
    /// The header is not a reference.
    #[error("not a blob reference: {0}")]
    Unreadable(String),
    /// It names another stream than this deployment's blob stream.
    #[error("it names stream {found}, not this deployment's blob stream {expected}")]
    WrongStream {
        /// The stream it names.
        found: String,
        /// Ours.
        expected: String,
    },
    /// It claims more than a frame can be.
    #[error("it claims {size} bytes, more than the {limit} a frame can be")]
    TooLarge {
        /// The claimed size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// It lists no chunk, or more than its size can fill.
    #[error("{chunks} chunks cannot hold {size} bytes")]
    BadChunks {
        /// How many sequences it lists.
        chunks: usize,
        /// The claimed size.
        size: usize,
    },
    /// A chunk was stored under another subject than this deployment's blobs, or than the
    /// blob's first chunk.
    #[error("a chunk was stored under {found}, not under this blob's subject in {expected}.*")]
    WrongSubject {
        /// Where the chunk was stored.
        found: String,
        /// Our blob subject prefix.
        expected: String,
    },
    /// The chunks do not add up to the claimed size.
    #[error("it claims {claimed} bytes but its chunks hold {actual} or more")]
    SizeMismatch {
        /// The claimed size.
        claimed: usize,
        /// What the chunks held (as far as they were read).
        actual: usize,
    },
}

/// One stored chunk of a blob, as read back.
#[derive(Debug, Clone)]
pub struct BlobChunk {
    /// The subject it was stored under (`<prefix>.blobs.<blob id>`).
    pub subject: String,
    /// Its bytes.
    pub data: Bytes,
}

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

/// The blob stream of a deployment: its name, the subject chunks are stored under, and the
/// largest body a reference to it may claim.
#[derive(Debug, Clone)]
pub struct BlobStore {
    /// Stream name.
    pub stream: String,
    /// Subject prefix of chunks (`<prefix>.blobs`).
    pub subject: String,
    /// Largest body read back ([`MAX_BLOB_BYTES`] unless set lower).
    pub max_body: usize,
}

impl BlobStore {
    /// The blob store of a deployment's subjects.
    pub fn for_subjects(subjects: &proto_schemas::Subjects) -> Self {
        BlobStore {
            stream: subjects.blobs_stream(),
            subject: subjects.blobs(),
            max_body: MAX_BLOB_BYTES,
        }
    }

    /// The stream to create at start-up: chunks kept one hour, at most `max_bytes` in all
    /// (-1: no cap; see [`crate::NatsSettings::nats_blobs_max_bytes`]), read back by direct
    /// gets.
    pub fn stream_spec(&self, max_bytes: i64) -> crate::StreamSpec {
        let mut spec =
            crate::StreamSpec::new(self.stream.clone(), vec![format!("{}.>", self.subject)]);
        spec.max_age = std::time::Duration::from_secs(3600);
        spec.max_bytes = max_bytes;
        spec.allow_direct = true;
        spec
    }

    /// Largest chunk for a bus.
    fn chunk_size(bus: &dyn Bus) -> usize {
        bus.max_payload().saturating_sub(HEADROOM).max(1024)
    }

    /// Whether `payload` must travel as a blob on `bus`.
    pub fn needed(bus: &dyn Bus, payload: &[u8]) -> bool {
        Self::needed_for(bus, payload.len())
    }

    /// Whether a payload of `len` bytes must travel as a blob on `bus`.
    pub fn needed_for(bus: &dyn Bus, len: usize) -> bool {
        len + HEADROOM > bus.max_payload()
    }

    async fn store(
        &self,
        bus: &dyn Bus,
        headers: &mut Headers,
        payload: Bytes,
    ) -> Result<Bytes, BusError> {
        match self.put(bus, payload.clone()).await? {
            None => Ok(payload),
            Some(reference) => {
                headers.insert(BLOB_HEADER, reference);
                Ok(Bytes::new())
            }
        }
    }

    /// Stores `payload` as a blob ahead of its publish when it is too large for one message:
    /// the reference to give [`BlobStore::publish_stored`], or `None` when it fits in one.
    /// (The session service stores a large frame while the group that sends it commits, and
    /// publishes it after.) A blob nothing refers to expires with the stream's age limit.
    pub async fn put(&self, bus: &dyn Bus, payload: Bytes) -> Result<Option<String>, BusError> {
        if !Self::needed(bus, &payload) {
            return Ok(None);
        }
        let subject = format!("{}.{}", self.subject, uuid::Uuid::new_v4().simple());
        let blob = bus
            .put_blob(self.stream.clone(), subject, payload, Self::chunk_size(bus))
            .await?;
        let reference = serde_json::to_string(&blob).map_err(|source| BusError::Encode {
            what: "a large body's blob reference",
            source,
        })?;
        Ok(Some(reference))
    }

    /// Publishes a message whose body [`BlobStore::put`] stored.
    pub async fn publish_stored(
        &self,
        bus: &dyn Bus,
        subject: String,
        headers: Headers,
        reference: String,
    ) -> Result<(), BusError> {
        bus.publish(subject, headers.with(BLOB_HEADER, reference), Bytes::new())
            .await
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

impl BlobStore {
    /// The body of a message: its payload, or the blob its `Aip-Blob` header points to.
    ///
    /// A reference is followed only into this deployment's blob stream, to chunks stored
    /// under one subject of its blob subjects, for a size of at most [`BlobStore::max_body`]
    /// that the chunks exactly fill; anything else is [`BusError::BadBlobRef`], found before
    /// anything is reserved for the claimed size.
    pub async fn payload_of(&self, bus: &dyn Bus, message: &Message) -> Result<Bytes, BusError> {
        let Some(text) = message.headers.get(BLOB_HEADER) else {
            return Ok(message.payload.clone());
        };
        let refuse = |problem| BusError::BadBlobRef {
            subject: message.subject.clone(),
            problem,
        };
        let blob: BlobRef = serde_json::from_str(text)
            .map_err(|e| refuse(BlobRefProblem::Unreadable(e.to_string())))?;
        self.check(&blob).map_err(refuse)?;
        let mut body = bytes::BytesMut::with_capacity(blob.size);
        let mut blob_subject: Option<String> = None;
        let ours = format!("{}.", self.subject);
        // Chunks are asked for several at a time, and joined in order.
        let mut asked = blob.sequences.iter();
        let mut chunks = futures::stream::FuturesOrdered::new();
        loop {
            while chunks.len() < CHUNKS_READ_AHEAD
                && let Some(sequence) = asked.next()
            {
                chunks.push_back(bus.get_blob_chunk(blob.stream.clone(), *sequence));
            }
            let Some(chunk) = chunks.next().await else {
                break;
            };
            let chunk = chunk?;
            let same_blob = match &blob_subject {
                Some(first) => *first == chunk.subject,
                None => chunk.subject.starts_with(&ours),
            };
            if !same_blob {
                return Err(refuse(BlobRefProblem::WrongSubject {
                    found: chunk.subject,
                    expected: self.subject.clone(),
                }));
            }
            blob_subject.get_or_insert(chunk.subject);
            if body.len() + chunk.data.len() > blob.size {
                return Err(refuse(BlobRefProblem::SizeMismatch {
                    claimed: blob.size,
                    actual: body.len() + chunk.data.len(),
                }));
            }
            body.extend_from_slice(&chunk.data);
        }
        if body.len() != blob.size {
            return Err(refuse(BlobRefProblem::SizeMismatch {
                claimed: blob.size,
                actual: body.len(),
            }));
        }
        Ok(body.freeze())
    }

    /// The checks a reference passes before any chunk is read.
    fn check(&self, blob: &BlobRef) -> Result<(), BlobRefProblem> {
        if blob.stream != self.stream {
            return Err(BlobRefProblem::WrongStream {
                found: blob.stream.clone(),
                expected: self.stream.clone(),
            });
        }
        if blob.size > self.max_body {
            return Err(BlobRefProblem::TooLarge {
                size: blob.size,
                limit: self.max_body,
            });
        }
        let most_chunks = blob.size.div_ceil(MIN_CHUNK_BYTES);
        if blob.sequences.is_empty() || blob.sequences.len() > most_chunks {
            return Err(BlobRefProblem::BadChunks {
                chunks: blob.sequences.len(),
                size: blob.size,
            });
        }
        Ok(())
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

    fn store() -> BlobStore {
        BlobStore::for_subjects(&proto_schemas::Subjects::default())
    }

    /// The problem `payload_of` finds with a header, or a panic if it accepts it.
    async fn problem(bus: &LocalBus, header: &str) -> BlobRefProblem {
        match store().payload_of(bus, &with_blob_header(header)).await {
            Err(BusError::BadBlobRef { problem, .. }) => problem,
            other => panic!("{header}: expected a refusal, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_reference_claiming_a_huge_size_is_refused_without_reserving_it() {
        // Found by the `bus_payload` fuzz target: the claimed size was reserved up front,
        // and a forged header aborted the receiving service.
        let bus = LocalBus::new();
        assert_eq!(
            problem(
                &bus,
                r#"{"stream":"aip_blobs","sequences":[1],"size":99999999999}"#
            )
            .await,
            BlobRefProblem::TooLarge {
                size: 99_999_999_999,
                limit: MAX_BLOB_BYTES
            }
        );
        // One byte over a frame and its envelope is already too much.
        let over = format!(
            r#"{{"stream":"aip_blobs","sequences":[1],"size":{}}}"#,
            MAX_BLOB_BYTES + 1
        );
        assert!(matches!(
            problem(&bus, &over).await,
            BlobRefProblem::TooLarge { .. }
        ));
    }

    #[tokio::test]
    async fn references_to_anything_but_our_own_blobs_are_refused() {
        let bus = LocalBus::with_limits(16, 64 * 1024);
        // A blob of another deployment (prefix t1), stored on the same bus.
        let theirs = BlobStore::for_subjects(&proto_schemas::Subjects::new("t1").expect("p"));
        let mut headers = Headers::new();
        theirs
            .store(&bus, &mut headers, Bytes::from(vec![1u8; 100 * 1024]))
            .await
            .expect("stored");
        let their_ref = headers.get(BLOB_HEADER).expect("a reference").to_owned();
        assert_eq!(
            problem(&bus, &their_ref).await,
            BlobRefProblem::WrongStream {
                found: "t1_blobs".into(),
                expected: "aip_blobs".into()
            }
        );
        // The same chunks, named as if in our stream: stored under their subject.
        let forged = their_ref.replace("t1_blobs", "aip_blobs");
        assert!(matches!(
            problem(&bus, &forged).await,
            BlobRefProblem::WrongSubject { .. }
        ));
        assert!(matches!(
            problem(&bus, "not json").await,
            BlobRefProblem::Unreadable(_)
        ));
        assert_eq!(
            problem(&bus, r#"{"stream":"aip_blobs","sequences":[],"size":10}"#).await,
            BlobRefProblem::BadChunks {
                chunks: 0,
                size: 10
            }
        );
        // Two thousand chunks cannot make 2 KiB (chunks are at least 1 KiB).
        let many: Vec<u64> = (1..=2000).collect();
        let header = serde_json::json!({"stream": "aip_blobs", "sequences": many, "size": 2048});
        assert!(matches!(
            problem(&bus, &header.to_string()).await,
            BlobRefProblem::BadChunks { chunks: 2000, .. }
        ));
    }

    #[tokio::test]
    async fn a_reference_whose_chunks_do_not_add_up_is_refused() {
        let bus = LocalBus::with_limits(16, 64 * 1024);
        let store = store();
        let mut headers = Headers::new();
        store
            .store(&bus, &mut headers, Bytes::from(vec![2u8; 100 * 1024]))
            .await
            .expect("stored");
        let mut blob: BlobRef =
            serde_json::from_str(headers.get(BLOB_HEADER).expect("ref")).expect("json");
        let real = blob.size;
        blob.size = real - 1;
        assert_eq!(
            problem(&bus, &serde_json::to_string(&blob).expect("json")).await,
            BlobRefProblem::SizeMismatch {
                claimed: real - 1,
                actual: real
            }
        );
        blob.size = real + 1;
        assert_eq!(
            problem(&bus, &serde_json::to_string(&blob).expect("json")).await,
            BlobRefProblem::SizeMismatch {
                claimed: real + 1,
                actual: real
            }
        );
        // A chunk of another blob of ours, spliced in.
        let mut other = Headers::new();
        store
            .store(&bus, &mut other, Bytes::from(vec![3u8; 100 * 1024]))
            .await
            .expect("stored");
        let other: BlobRef =
            serde_json::from_str(other.get(BLOB_HEADER).expect("ref")).expect("json");
        blob.size = real;
        blob.sequences[1] = other.sequences[1];
        assert!(matches!(
            problem(&bus, &serde_json::to_string(&blob).expect("json")).await,
            BlobRefProblem::WrongSubject { .. }
        ));
    }

    #[tokio::test]
    async fn a_large_body_travels_as_a_blob_and_reads_back() {
        let bus = LocalBus::with_limits(16, 64 * 1024);
        let store = store();
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
        assert_eq!(
            store.payload_of(&bus, &message).await.expect("read back"),
            body
        );
    }
}
