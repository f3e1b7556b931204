//! Durable streams: messages that must not be lost.
//!
//! On NATS these are JetStream streams with durable pull consumers, explicit acks and
//! `Nats-Msg-Id` de-duplication. In process they are bounded queues with the same API
//! (publishing waits for room instead of dropping; nak redelivers); they do not survive a
//! crash of the process, which holds the only copy anyway.

use std::time::Duration;

use futures::stream::BoxStream;

use crate::{BusError, Message};

/// A stream to create (or keep, if it exists).
#[derive(Debug, Clone)]
pub struct StreamSpec {
    /// Stream name (letters, digits, `_`, `-`).
    pub name: String,
    /// Subjects it captures (wildcards allowed).
    pub subjects: Vec<String>,
    /// Messages older than this are discarded.
    pub max_age: Duration,
    /// Size cap in bytes (-1: none, the age limit bounds it). A cap is reserved on the NATS
    /// server's storage when the stream is created; when full, publishing fails instead of
    /// losing old messages.
    pub max_bytes: i64,
    /// Window in which a repeated `Nats-Msg-Id` is dropped as a duplicate.
    pub duplicate_window: Duration,
    /// Whether messages may be read by sequence with a direct get (raw bytes, answered by
    /// any replica) rather than only through the stream API (base64 in JSON, by the leader).
    pub allow_direct: bool,
    /// What becomes of a message once it is consumed.
    pub retention: Retention,
}

/// What a stream does with a message its consumer acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    /// Kept until a limit (age, size) removes it: a stream read by sequence (the blobs), or
    /// read by several consumers.
    Limits,
    /// Removed when acknowledged: a queue with one consumer (the frames stream). Its consumer
    /// must acknowledge explicitly and start from the first message.
    WorkQueue,
}

/// What trimming a stream of its acknowledged messages did
/// ([`crate::Bus::trim_acknowledged`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trimmed {
    /// The stream removes acknowledged messages itself (a work queue, or in process): there
    /// is never anything to trim.
    ByItself,
    /// This many acknowledged messages were removed (0: none since the last trim, or no such
    /// consumer).
    Removed(u64),
    /// Left in place: the stream keeps what was consumed, and this NATS server forgets every
    /// delivery not yet acknowledged when part of a stream is purged (before 2.9.15), so a
    /// message handed back for redelivery would never come again.
    Unsafe {
        /// The server's version.
        server_version: String,
    },
}

impl StreamSpec {
    /// A stream with a one-day age limit, no size cap, a two-minute de-duplication window, no
    /// direct gets, and messages kept when consumed.
    pub fn new(name: impl Into<String>, subjects: Vec<String>) -> Self {
        StreamSpec {
            name: name.into(),
            subjects,
            max_age: Duration::from_secs(24 * 3600),
            max_bytes: -1,
            duplicate_window: Duration::from_secs(120),
            allow_direct: false,
            retention: Retention::Limits,
        }
    }
}

/// Whether two subject lists are the same set (order does not matter).
pub(crate) fn same_subjects(a: &[String], b: &[String]) -> bool {
    let mut a: Vec<&String> = a.iter().collect();
    let mut b: Vec<&String> = b.iter().collect();
    a.sort();
    a.dedup();
    b.sort();
    b.dedup();
    a == b
}

/// The stream name for a subject prefix and a purpose: `aip` + `frames` → `aip_frames`. The
/// prefix is encoded by [`proto_schemas::subjects::name_token`], so different prefixes never
/// share a stream (`t1.aip` → `t1_aip_frames`, `t1_aip` → `t1-_aip_frames`).
pub fn stream_name(prefix: &str, purpose: &str) -> String {
    format!("{}_{purpose}", proto_schemas::subjects::name_token(prefix))
}

/// A message from a durable consumer; it is redelivered until acked.
pub struct Delivery {
    pub message: Message,
    /// How many times it has been delivered (1 the first time).
    pub delivered: u64,
    pub(crate) acker: Acker,
}

pub(crate) enum Acker {
    Nats(Box<async_nats::jetstream::Message>),
    Local(crate::local::LocalAck),
}

impl Delivery {
    /// Confirms processing; the message is not delivered again.
    pub async fn ack(self) -> Result<(), BusError> {
        match self.acker {
            Acker::Nats(m) => m.ack().await.map_err(|e| BusError::Nats {
                operation: "ack",
                subject: self.message.subject.clone(),
                source: e,
            }),
            Acker::Local(_) => Ok(()),
        }
    }

    /// Asks for redelivery after `delay` (processing failed; try again later).
    pub async fn nak(self, delay: Duration) -> Result<(), BusError> {
        match self.acker {
            Acker::Nats(m) => m
                .ack_with(async_nats::jetstream::AckKind::Nak(Some(delay)))
                .await
                .map_err(|e| BusError::Nats {
                    operation: "nak",
                    subject: self.message.subject.clone(),
                    source: e,
                }),
            Acker::Local(ack) => {
                ack.redeliver(self.message, self.delivered, delay);
                Ok(())
            }
        }
    }
}

/// Deliveries from a durable consumer.
pub type DurableSubscription = BoxStream<'static, Result<Delivery, BusError>>;
