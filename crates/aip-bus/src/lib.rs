//! # aip-bus: the message bus behind aip's services
//!
//! One [`Bus`] trait, two implementations:
//! - [`NatsBus`]: NATS core for publish/subscribe and request/reply, JetStream for messages
//!   that must not be lost (the distributed mode);
//! - [`LocalBus`]: an in-process bus with the same semantics (subject wildcards, queue groups,
//!   request/reply with no-responder detection, bounded subscriber queues), for `aip dev` and
//!   for tests that do not need a broker.
//!
//! Messages carry [`Headers`] from the start: W3C `traceparent` for tracing and `Nats-Msg-Id`
//! for de-duplication travel on every message that has them.

mod blob;
mod dedup;
mod durable;
mod error;
mod headers;
mod local;
mod nats;
mod nats_settings;
pub mod registry;
pub mod trace;

use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::BoxStream;

pub use blob::{BLOB_HEADER, BlobChunk, BlobRef, BlobRefProblem, BlobStore, MAX_BLOB_BYTES};
pub use dedup::RecentIds;
pub use durable::{Delivery, DurableSubscription, Retention, StreamSpec, Trimmed, stream_name};
pub use error::BusError;
pub use headers::{Headers, names};
pub use local::LocalBus;
pub use nats::NatsBus;
pub use nats_settings::{
    DEFAULT_BLOBS_MAX_BYTES, DEFAULT_FRAMES_MAX_BYTES, NatsSettings, NatsSettingsError, redact_url,
};
pub use registry::{RegistryClient, RegistryError};

/// A message as delivered to a subscriber.
#[derive(Debug, Clone)]
pub struct Message {
    /// The subject it was published on.
    pub subject: String,
    /// Where to send the answer, for requests.
    pub reply: Option<String>,
    pub headers: Headers,
    pub payload: Bytes,
}

/// A stream of messages from a subscription. Dropping it unsubscribes.
pub type Subscription = BoxStream<'static, Message>;

/// A handle shared by every part of a service.
pub type SharedBus = std::sync::Arc<dyn Bus>;

/// What every bus offers.
///
/// Semantics follow NATS core: publishes are fire-and-forget and at most once; a subscriber
/// that cannot keep up loses messages (and a warning is logged) instead of growing memory;
/// a request with nobody subscribed fails at once with [`BusError::NoResponders`], one with a
/// silent responder with [`BusError::Timeout`].
pub trait Bus: Send + Sync + 'static {
    /// Publishes a message.
    fn publish(
        &self,
        subject: String,
        headers: Headers,
        payload: Bytes,
    ) -> BoxFuture<'_, Result<(), BusError>>;

    /// Sends a request and waits for the first reply, at most `timeout`.
    fn request(
        &self,
        subject: String,
        headers: Headers,
        payload: Bytes,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<Message, BusError>>;

    /// Subscribes to a subject (wildcards `*` and `>` allowed).
    fn subscribe(&self, subject: String) -> BoxFuture<'_, Result<Subscription, BusError>>;

    /// Subscribes as a member of a queue group: each message goes to one member.
    fn queue_subscribe(
        &self,
        subject: String,
        group: String,
    ) -> BoxFuture<'_, Result<Subscription, BusError>>;

    /// Waits until everything published so far has reached the server (NATS flush);
    /// used before shutdown.
    fn flush(&self) -> BoxFuture<'_, Result<(), BusError>>;

    /// Largest payload the bus carries; bigger bodies must travel by reference.
    fn max_payload(&self) -> usize;

    /// Whether a publish crosses to a server (NATS), rather than being handed over in this
    /// process (the in-process bus). Gathering messages saves round trips and server work
    /// only on the former; on the latter it adds a hand-over.
    fn is_remote(&self) -> bool;

    /// Creates a durable stream, or keeps the existing one of that name.
    fn ensure_stream(&self, spec: StreamSpec) -> BoxFuture<'_, Result<(), BusError>>;

    /// Publishes into a durable stream and waits until the stream has stored it. A message
    /// with a `Nats-Msg-Id` already seen within the stream's window is dropped as a duplicate
    /// (and still reported as stored). No stream for the subject is an error.
    fn publish_durable(
        &self,
        subject: String,
        headers: Headers,
        payload: Bytes,
    ) -> BoxFuture<'_, Result<(), BusError>>;

    /// Deletes a durable stream and everything in it (tests and administration).
    fn delete_stream(&self, name: String) -> BoxFuture<'_, Result<(), BusError>>;

    /// Stores a body in a blob stream in chunks of at most `chunk` bytes, under `subject`.
    fn put_blob(
        &self,
        stream: String,
        subject: String,
        body: Bytes,
        chunk: usize,
    ) -> BoxFuture<'_, Result<BlobRef, BusError>>;

    /// Reads one stored chunk back (sequence `sequence` of blob stream `stream`), with the
    /// subject it was stored under. [`BlobStore::payload_of`] checks and joins them.
    fn get_blob_chunk(
        &self,
        stream: String,
        sequence: u64,
    ) -> BoxFuture<'_, Result<BlobChunk, BusError>>;

    /// Consumes a stream through the named durable consumer; consumers sharing a name share
    /// the messages. At most `max_in_flight` messages are delivered and not yet acked.
    fn consume(
        &self,
        stream: String,
        consumer: String,
        max_in_flight: usize,
    ) -> BoxFuture<'_, Result<DurableSubscription, BusError>>;

    /// Makes what the named consumer delivered and nobody acked deliverable again at once,
    /// instead of after its ack wait: a new leader takes over the messages a dead or frozen
    /// one held. On a work queue every message the stream holds comes again (none of them
    /// was acknowledged); on a stream that keeps what was consumed, every message after the
    /// consumer's ack floor, acknowledged or not, so its consumers must be idempotent.
    /// Answers how many were held (0: nothing changed; no such consumer: 0).
    fn release_pending(
        &self,
        stream: String,
        consumer: String,
    ) -> BoxFuture<'_, Result<u64, BusError>>;

    /// Removes from a stream that keeps what was consumed ([`Retention::Limits`], as streams
    /// made by aip before work queues were) the messages the named consumer has
    /// acknowledged, all up to its ack floor: it would otherwise fill to its size cap and
    /// then refuse every new message. A work queue removes them itself; and where the server
    /// would lose the consumer's unacknowledged deliveries with them, nothing is removed
    /// ([`Trimmed::Unsafe`]).
    fn trim_acknowledged(
        &self,
        stream: String,
        consumer: String,
    ) -> BoxFuture<'_, Result<Trimmed, BusError>>;
}

/// Answers a request message (publishes to its reply subject). A message without a reply
/// subject is not a request: that is a caller error, reported as [`BusError::NoReplySubject`].
pub async fn respond(
    bus: &dyn Bus,
    request: &Message,
    headers: Headers,
    payload: Bytes,
) -> Result<(), BusError> {
    let reply = request
        .reply
        .clone()
        .ok_or_else(|| BusError::NoReplySubject {
            subject: request.subject.clone(),
        })?;
    bus.publish(reply, headers, payload).await
}

/// Whether `subject` matches `pattern` (`*` one token, `>` one or more trailing tokens).
pub fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut p = pattern.split('.');
    let mut s = subject.split('.');
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(pt), Some(st)) if pt == st => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::subject_matches;

    #[test]
    fn wildcards() {
        assert!(subject_matches("a.b", "a.b"));
        assert!(subject_matches("a.*", "a.b"));
        assert!(!subject_matches("a.*", "a.b.c"));
        assert!(subject_matches("a.>", "a.b.c"));
        assert!(!subject_matches("a.>", "a"));
        assert!(!subject_matches("a.b", "a.c"));
        assert!(!subject_matches("a.b", "a.b.c"));
    }
}
