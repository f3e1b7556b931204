//! The NATS implementation.

use std::time::Duration;

use async_nats::RequestErrorKind;
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};

use async_nats::jetstream;

use crate::blob::{BlobChunk, BlobRef};
use crate::durable::{Acker, Delivery, DurableSubscription, Retention, StreamSpec, Trimmed};
use crate::nats_settings::{Auth, NatsSettings, NatsSettingsError, redact_url, url_secrets};
use crate::{Bus, BusError, Headers, Message, Subscription};

/// A bus on a NATS server.
#[derive(Clone)]
pub struct NatsBus {
    client: async_nats::Client,
    jetstream: jetstream::Context,
    /// Whether blob chunks are read by direct get ([`DirectGets`]).
    direct_gets: std::sync::Arc<DirectGets>,
    /// Room for blob chunks asked for and not yet received, in KiB: see
    /// [`BLOB_READS_BUDGET_BYTES`].
    blob_reads: std::sync::Arc<tokio::sync::Semaphore>,
}

impl NatsBus {
    /// Connects to `url` (e.g. `nats://127.0.0.1:4222`), naming the connection `name` in the
    /// server's monitoring, with no credentials or TLS beside what the URL says.
    pub async fn connect(url: &str, name: &str) -> Result<Self, BusError> {
        Self::connect_with(url, name, &NatsSettings::default()).await
    }

    /// Connects to `url` with the credentials and TLS of `access`. The files it names are
    /// checked first ([`BusError::Access`]); errors show the URL with its password hidden.
    pub async fn connect_with(
        url: &str,
        name: &str,
        access: &NatsSettings,
    ) -> Result<Self, BusError> {
        let auth = access.check(url)?;
        let mut options = match auth {
            Auth::None => async_nats::ConnectOptions::new(),
            Auth::CredsFile(path) => async_nats::ConnectOptions::new()
                .credentials_file(&path)
                .await
                .map_err(|source| NatsSettingsError::Unreadable {
                    setting: "nats_creds_file",
                    path,
                    source,
                })?,
            Auth::UserPassword { user, password } => {
                async_nats::ConnectOptions::with_user_and_password(user, password)
            }
            Auth::Token(token) => async_nats::ConnectOptions::with_token(token),
        };
        if let Some(ca) = &access.nats_tls_ca_file {
            options = options.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&access.nats_tls_cert_file, &access.nats_tls_key_file) {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        if access.wants_tls() {
            options = options.require_tls(true);
        }
        // Server errors (a permissions violation above all) reach the client only as an
        // event: log them, or a refused publish would go unnoticed.
        let connection = name.to_owned();
        let direct_gets = std::sync::Arc::new(DirectGets::new());
        let reconnected = direct_gets.clone();
        options = options.event_callback(move |event| {
            let connection = connection.clone();
            let direct_gets = reconnected.clone();
            async move {
                match event {
                    async_nats::Event::ServerError(e) => {
                        if DirectGets::is_denial(&e) {
                            direct_gets.denied();
                        }
                        tracing::warn!(%connection, "NATS server error: {e}")
                    }
                    async_nats::Event::ClientError(e) => {
                        tracing::warn!(%connection, "NATS client error: {e}")
                    }
                    async_nats::Event::SlowConsumer(sid) => {
                        tracing::warn!(%connection, sid, "NATS slow consumer: messages dropped")
                    }
                    async_nats::Event::Disconnected => {
                        tracing::warn!(%connection, "disconnected from NATS; reconnecting")
                    }
                    async_nats::Event::Connected => {
                        direct_gets.reconnected();
                        tracing::debug!(%connection, "connected to NATS")
                    }
                    other => tracing::info!(%connection, "NATS: {other}"),
                }
            }
        });
        let client = options
            .name(name)
            .connection_timeout(Duration::from_secs(5))
            .subscription_capacity(65_536)
            .connect(url);
        let shown = redact_url(url);
        let client = tokio::time::timeout(Duration::from_secs(10), client)
            .await
            .map_err(|_| BusError::Connect {
                url: shown.clone(),
                source: "timed out after 10 s".into(),
            })?
            .map_err(|e| {
                // The client's text is not expected to echo credentials; scrub them anyway.
                let mut text = e.to_string();
                for secret in access.secrets().map(str::to_owned).chain(url_secrets(url)) {
                    text = text.replace(&secret, "***");
                }
                BusError::Connect {
                    url: shown.clone(),
                    source: text.into(),
                }
            })?;
        let jetstream = jetstream::new(client.clone());
        Ok(NatsBus {
            client,
            jetstream,
            direct_gets,
            blob_reads: std::sync::Arc::new(tokio::sync::Semaphore::new(BLOB_READS_BUDGET_KIB)),
        })
    }

    /// The underlying client, for JetStream.
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }
}

fn convert(message: async_nats::Message) -> Message {
    Message {
        subject: message.subject.to_string(),
        reply: message.reply.map(|r| r.to_string()),
        headers: Headers::from_nats(message.headers.as_ref()),
        payload: message.payload,
    }
}

/// A JetStream failure about `stream`.
fn stream_error(
    operation: &'static str,
    stream: &str,
    source: Box<dyn std::error::Error + Send + Sync>,
) -> BusError {
    BusError::Nats {
        operation,
        subject: stream.to_owned(),
        source,
    }
}

/// After a direct get failed, how long blob chunks are read through the stream API before
/// direct gets are tried again (at once if the connection is made again meanwhile).
const DIRECT_GETS_RETRY: Duration = Duration::from_secs(60);

/// Whether blob chunks are read by direct get. A failure other than a missing message turns
/// them off: the user may not be allowed to send them (every read would then wait for a
/// timeout), or the server is restarting or not ready yet after a restart. They are tried
/// again once [`DIRECT_GETS_RETRY`] has passed, and at once when the connection is made
/// again, so that a NATS restart does not leave the slower stream API (its answer is the
/// chunk in base64, encoded by the server) in place for the life of the process.
///
/// A user the server does not let send them is told so at once, as a permissions violation
/// (a server error event), while the direct get itself would only time out: then they are off
/// until the connection is made again (permissions are the connection's), and the direct gets
/// waiting for an answer give up at once and ask the stream API.
#[derive(Debug)]
struct DirectGets {
    since: std::time::Instant,
    /// Milliseconds after `since` before which direct gets are not tried; 0 while they work,
    /// `u64::MAX` once the server refused them.
    off_until_ms: std::sync::atomic::AtomicU64,
    /// Wakes the direct gets waiting for an answer when the server refuses them.
    refused: tokio::sync::Notify,
}

impl DirectGets {
    fn new() -> Self {
        DirectGets {
            since: std::time::Instant::now(),
            off_until_ms: std::sync::atomic::AtomicU64::new(0),
            refused: tokio::sync::Notify::new(),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether to try a direct get now.
    fn allowed(&self) -> bool {
        let until = self.off_until_ms.load(std::sync::atomic::Ordering::Relaxed);
        until == 0 || self.now_ms() >= until
    }

    /// A direct get failed: off for [`DIRECT_GETS_RETRY`] (unless refused: then until the
    /// connection is made again). Whether they were on until now.
    fn failed(&self) -> bool {
        let until = self
            .now_ms()
            .saturating_add(DIRECT_GETS_RETRY.as_millis() as u64)
            .max(1);
        let before = self
            .off_until_ms
            .fetch_update(
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
                |now| (now != u64::MAX).then_some(until),
            )
            .unwrap_or(u64::MAX);
        before == 0
    }

    /// A direct get worked: on. Whether they were off until now.
    fn worked(&self) -> bool {
        self.off_until_ms
            .swap(0, std::sync::atomic::Ordering::Relaxed)
            != 0
    }

    /// Whether a server error is the refusal of a direct get (the server names the subject
    /// the user may not publish to: `$JS.API.DIRECT.GET.<stream>`).
    fn is_denial(error: &async_nats::ServerError) -> bool {
        let text = error.to_string();
        text.contains("Permissions Violation") && text.contains(".API.DIRECT.GET.")
    }

    /// The server refused a direct get: off until the connection is made again, and those
    /// waiting for an answer ask the stream API now.
    fn denied(&self) {
        let before = self
            .off_until_ms
            .swap(u64::MAX, std::sync::atomic::Ordering::Relaxed);
        if before != u64::MAX {
            tracing::warn!(
                "this NATS user may not send direct gets ($JS.API.DIRECT.GET.<stream>): blob \
                 chunks are read through the stream API until the connection is made again"
            );
        }
        self.refused.notify_waiters();
    }

    /// The connection was made (again): on.
    fn reconnected(&self) {
        self.off_until_ms
            .store(0, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Blob chunks published and not yet acknowledged by the stream, at most.
const BLOB_CHUNKS_IN_FLIGHT: usize = 16;

/// Bytes of blob chunks one connection asks for before they arrive, at most, over every
/// blob it reads. The server cuts a client off as a slow consumer once more than its
/// `max_pending` (64 MiB by default) waits to be written to it: eight chunks of 8 MiB (a
/// server whose `max_payload` is raised to 8 MiB) asked for at once did, and the read then
/// waited for timeouts and a reconnection. Each read sets aside the server's `max_payload`,
/// the most a chunk can be: sixteen chunks at once with the default 1 MiB, two with 8 MiB.
const BLOB_READS_BUDGET_BYTES: usize = 16 << 20;

/// [`BLOB_READS_BUDGET_BYTES`] in the semaphore's units.
const BLOB_READS_BUDGET_KIB: usize = BLOB_READS_BUDGET_BYTES >> 10;

/// Whether the stream refused to store a message (full: `maximum bytes exceeded`, or out of
/// storage), by the server's error code.
fn store_refused(error: &jetstream::context::PublishError) -> bool {
    std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<jetstream::Error>())
        .is_some_and(|e| e.error_code() == jetstream::ErrorCode::STREAM_STORE_FAILED)
}

impl NatsBus {
    /// A stream's handle.
    async fn stream(&self, stream: &str) -> Result<jetstream::stream::Stream, BusError> {
        self.jetstream
            .get_stream(stream)
            .await
            .map_err(|e| stream_error("get stream", stream, Box::new(e)))
    }

    /// A stream and what its named consumer reports, or `None` when there is no such
    /// consumer.
    async fn consumer_of(
        &self,
        stream: &str,
        consumer: &str,
    ) -> Result<Option<(jetstream::stream::Stream, jetstream::consumer::Info)>, BusError> {
        let handle = self.stream(stream).await?;
        match handle.consumer_info(consumer).await {
            Ok(info) => Ok(Some((handle, info))),
            Err(e) if e.to_string().contains("not found") => Ok(None),
            Err(e) => Err(stream_error("read consumer", stream, Box::new(e))),
        }
    }

    /// Refuses a payload the server would not take (its `max_payload`), with the sizes.
    fn check_size(&self, payload: &Bytes) -> Result<(), BusError> {
        let limit = self.client.server_info().max_payload;
        if limit > 0 && payload.len() > limit {
            return Err(BusError::PayloadTooLarge {
                size: payload.len(),
                limit,
            });
        }
        Ok(())
    }
}

impl Bus for NatsBus {
    fn publish(
        &self,
        subject: String,
        headers: Headers,
        payload: Bytes,
    ) -> BoxFuture<'_, Result<(), BusError>> {
        let headers = crate::trace::with_current(headers);
        async move {
            self.check_size(&payload)?;
            let result = if headers.is_empty() {
                self.client.publish(subject.clone(), payload).await
            } else {
                self.client
                    .publish_with_headers(subject.clone(), headers.to_nats(), payload)
                    .await
            };
            result.map_err(|e| BusError::Nats {
                operation: "publish",
                subject,
                source: Box::new(e),
            })
        }
        .boxed()
    }

    fn request(
        &self,
        subject: String,
        headers: Headers,
        payload: Bytes,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<Message, BusError>> {
        let headers = crate::trace::with_current(headers);
        async move {
            self.check_size(&payload)?;
            let request = async_nats::Request::new()
                .payload(payload)
                .headers(headers.to_nats())
                .timeout(Some(timeout));
            match self.client.send_request(subject.clone(), request).await {
                Ok(message) => Ok(convert(message)),
                Err(e) => Err(match e.kind() {
                    RequestErrorKind::NoResponders => BusError::NoResponders { subject },
                    RequestErrorKind::TimedOut => BusError::Timeout { subject, timeout },
                    _ => BusError::Nats {
                        operation: "request",
                        subject,
                        source: Box::new(e),
                    },
                }),
            }
        }
        .boxed()
    }

    fn subscribe(&self, subject: String) -> BoxFuture<'_, Result<Subscription, BusError>> {
        async move {
            let sub = self
                .client
                .subscribe(subject.clone())
                .await
                .map_err(|e| BusError::Nats {
                    operation: "subscribe",
                    subject,
                    source: Box::new(e),
                })?;
            Ok(sub.map(convert).boxed())
        }
        .boxed()
    }

    fn queue_subscribe(
        &self,
        subject: String,
        group: String,
    ) -> BoxFuture<'_, Result<Subscription, BusError>> {
        async move {
            let sub = self
                .client
                .queue_subscribe(subject.clone(), group)
                .await
                .map_err(|e| BusError::Nats {
                    operation: "queue_subscribe",
                    subject,
                    source: Box::new(e),
                })?;
            Ok(sub.map(convert).boxed())
        }
        .boxed()
    }

    fn flush(&self) -> BoxFuture<'_, Result<(), BusError>> {
        async move {
            self.client.flush().await.map_err(|e| BusError::Nats {
                operation: "flush",
                subject: String::new(),
                source: Box::new(e),
            })
        }
        .boxed()
    }

    fn max_payload(&self) -> usize {
        self.client.server_info().max_payload
    }

    fn is_remote(&self) -> bool {
        true
    }

    fn ensure_stream(&self, spec: StreamSpec) -> BoxFuture<'_, Result<(), BusError>> {
        async move {
            let wrap = |operation, e| stream_error(operation, &spec.name, e);
            let config = jetstream::stream::Config {
                name: spec.name.clone(),
                subjects: spec.subjects.clone(),
                max_age: spec.max_age,
                max_bytes: spec.max_bytes,
                duplicate_window: spec.duplicate_window.min(spec.max_age),
                storage: jetstream::stream::StorageType::File,
                discard: jetstream::stream::DiscardPolicy::New,
                allow_direct: spec.allow_direct,
                retention: match spec.retention {
                    Retention::Limits => jetstream::stream::RetentionPolicy::Limits,
                    Retention::WorkQueue => jetstream::stream::RetentionPolicy::WorkQueue,
                },
                ..Default::default()
            };
            let mut stream = self
                .jetstream
                .get_or_create_stream(config.clone())
                .await
                .map_err(|e| wrap("create stream", Box::new(e)))?;
            let existing = stream
                .info()
                .await
                .map_err(|e| wrap("read stream", Box::new(e)))?
                .config
                .clone();
            // A stream of our name that captures other subjects is not ours: refuse it
            // rather than mixing its messages with ours.
            if !crate::durable::same_subjects(&existing.subjects, &spec.subjects) {
                return Err(BusError::StreamConflict {
                    stream: spec.name,
                    expected: spec.subjects,
                    found: existing.subjects,
                });
            }
            // Made by an older version as a stream that keeps what was consumed: the server
            // cannot turn it into a work queue in place, so it stays as it is and its
            // consumer's leader trims it (`trim_acknowledged`).
            if existing.retention != config.retention {
                tracing::warn!(
                    stream = %spec.name,
                    found = ?existing.retention,
                    wanted = ?config.retention,
                    "the stream keeps its retention (a server cannot change it in place); to \
                     have the new one, delete the stream while nothing is in it"
                );
            }
            // Ours, made with other limits (an older version, changed settings): take the
            // configured ones, so a size cap also reaches existing deployments.
            let limits_differ = existing.max_bytes != config.max_bytes
                || existing.max_age != config.max_age
                || existing.discard != config.discard
                || existing.duplicate_window != config.duplicate_window
                || existing.allow_direct != config.allow_direct;
            if limits_differ {
                let updated = jetstream::stream::Config {
                    max_bytes: config.max_bytes,
                    max_age: config.max_age,
                    discard: config.discard,
                    duplicate_window: config.duplicate_window,
                    allow_direct: config.allow_direct,
                    ..existing
                };
                self.jetstream
                    .update_stream(updated)
                    .await
                    .map_err(|e| wrap("update stream limits", Box::new(e)))?;
                tracing::info!(
                    stream = %spec.name,
                    max_bytes = config.max_bytes,
                    "stream limits updated to the configured ones"
                );
            }
            Ok(())
        }
        .boxed()
    }

    fn publish_durable(
        &self,
        subject: String,
        headers: Headers,
        payload: Bytes,
    ) -> BoxFuture<'_, Result<(), BusError>> {
        let headers = crate::trace::with_current(headers);
        async move {
            self.check_size(&payload)?;
            let ack = self
                .jetstream
                .publish_with_headers(subject.clone(), headers.to_nats(), payload)
                .await
                .map_err(|e| BusError::Nats {
                    operation: "publish to stream",
                    subject: subject.clone(),
                    source: Box::new(e),
                })?;
            match ack.await {
                Ok(_) => Ok(()),
                Err(e) if e.kind() == jetstream::context::PublishErrorKind::StreamNotFound => {
                    Err(BusError::NoStream { subject })
                }
                Err(e) if store_refused(&e) => Err(BusError::StreamFull { subject }),
                Err(e) => Err(BusError::Nats {
                    operation: "store in stream",
                    subject,
                    source: Box::new(e),
                }),
            }
        }
        .boxed()
    }

    fn consume(
        &self,
        stream: String,
        consumer: String,
        max_in_flight: usize,
    ) -> BoxFuture<'_, Result<DurableSubscription, BusError>> {
        async move {
            let wrap = |operation, e| stream_error(operation, &stream, e);
            let handle = self.stream(&stream).await?;
            let config = jetstream::consumer::pull::Config {
                durable_name: Some(consumer.clone()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(10),
                max_ack_pending: i64::try_from(max_in_flight).unwrap_or(i64::MAX),
                ..Default::default()
            };
            let pull: jetstream::consumer::PullConsumer = handle
                .get_or_create_consumer(&consumer, config)
                .await
                .map_err(|e| wrap("create consumer", Box::new(e)))?;
            let messages = pull
                .messages()
                .await
                .map_err(|e| wrap("consume", Box::new(e)))?;
            let subject = stream.clone();
            Ok(messages
                .map(move |item| match item {
                    Ok(m) => {
                        let delivered = m.info().map(|i| i.delivered as u64).unwrap_or(1);
                        let message = Message {
                            subject: m.subject.to_string(),
                            reply: None,
                            headers: Headers::from_nats(m.headers.as_ref()),
                            payload: m.payload.clone(),
                        };
                        Ok(Delivery {
                            message,
                            delivered,
                            acker: Acker::Nats(Box::new(m)),
                        })
                    }
                    Err(e) => Err(BusError::Nats {
                        operation: "receive from stream",
                        subject: subject.clone(),
                        source: Box::new(e),
                    }),
                })
                .boxed())
        }
        .boxed()
    }

    fn release_pending(
        &self,
        stream: String,
        consumer: String,
    ) -> BoxFuture<'_, Result<u64, BusError>> {
        async move {
            let wrap = |operation, e| stream_error(operation, &stream, e);
            let Some((handle, info)) = self.consumer_of(&stream, &consumer).await? else {
                return Ok(0);
            };
            let held = info.num_ack_pending as u64;
            if held == 0 {
                return Ok(0);
            }
            // The server redelivers a held message only after its ack wait, to whoever pulls.
            // A consumer created again delivers them now; the old one's outstanding pulls and
            // acks die with it. A work queue holds nothing acknowledged, so it starts from
            // its first message (the only start a work queue's consumer may have); another
            // stream from the consumer's ack floor.
            let mut config = info.config.clone();
            config.deliver_policy = match handle.cached_info().config.retention {
                jetstream::stream::RetentionPolicy::WorkQueue => {
                    jetstream::consumer::DeliverPolicy::All
                }
                _ => jetstream::consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: info.ack_floor.stream_sequence + 1,
                },
            };
            handle
                .delete_consumer(&consumer)
                .await
                .map_err(|e| wrap("delete consumer", Box::new(e)))?;
            handle
                .create_consumer(config)
                .await
                .map_err(|e| wrap("create consumer", Box::new(e)))?;
            Ok(held)
        }
        .boxed()
    }

    fn trim_acknowledged(
        &self,
        stream: String,
        consumer: String,
    ) -> BoxFuture<'_, Result<Trimmed, BusError>> {
        async move {
            let Some((handle, info)) = self.consumer_of(&stream, &consumer).await? else {
                return Ok(Trimmed::Removed(0));
            };
            if handle.cached_info().config.retention != jetstream::stream::RetentionPolicy::Limits {
                return Ok(Trimmed::ByItself);
            }
            let server_version = self.client.server_info().version;
            if !purge_keeps_deliveries(&server_version) {
                return Ok(Trimmed::Unsafe { server_version });
            }
            // Everything up to the ack floor is acknowledged; a purge by sequence removes the
            // messages before the one given.
            let floor = info.ack_floor.stream_sequence;
            if floor == 0 {
                return Ok(Trimmed::Removed(0));
            }
            let purged =
                handle.purge().sequence(floor + 1).await.map_err(|e| {
                    stream_error("purge acknowledged messages", &stream, Box::new(e))
                })?;
            Ok(Trimmed::Removed(purged.purged))
        }
        .boxed()
    }

    fn delete_stream(&self, name: String) -> BoxFuture<'_, Result<(), BusError>> {
        async move {
            match self.jetstream.delete_stream(&name).await {
                Ok(_) => Ok(()),
                Err(e) if e.to_string().contains("not found") => Ok(()),
                Err(e) => Err(BusError::Nats {
                    operation: "delete stream",
                    subject: name,
                    source: Box::new(e),
                }),
            }
        }
        .boxed()
    }

    fn put_blob(
        &self,
        stream: String,
        subject: String,
        body: Bytes,
        chunk: usize,
    ) -> BoxFuture<'_, Result<BlobRef, BusError>> {
        async move {
            let wrap = |e: Box<dyn std::error::Error + Send + Sync>| BusError::Nats {
                operation: "store blob chunk",
                subject: subject.clone(),
                source: e,
            };
            // Chunks are published back to back and their acknowledgements awaited
            // [`BLOB_CHUNKS_IN_FLIGHT`] behind, so a large body costs one round trip rather
            // than one per chunk. One connection keeps them in order, so the stream numbers
            // them in order too (checked below).
            let mut pending = std::collections::VecDeque::new();
            let mut sequences = Vec::new();
            let mut pieces = body.chunks(chunk.max(1));
            loop {
                let piece = if pending.len() < BLOB_CHUNKS_IN_FLIGHT {
                    pieces.next()
                } else {
                    None
                };
                if let Some(piece) = piece {
                    let ack = self
                        .jetstream
                        .publish(subject.clone(), body.slice_ref(piece))
                        .await
                        .map_err(|e| wrap(Box::new(e)))?;
                    pending.push_back(ack);
                    continue;
                }
                let Some(ack) = pending.pop_front() else {
                    break;
                };
                let ack = ack.await.map_err(|e| {
                    if store_refused(&e) {
                        BusError::StreamFull {
                            subject: subject.clone(),
                        }
                    } else {
                        wrap(Box::new(e))
                    }
                })?;
                if ack.stream != stream {
                    return Err(wrap(
                        format!("chunk stored in stream {} instead of {stream}", ack.stream).into(),
                    ));
                }
                if sequences.last().is_some_and(|last| *last >= ack.sequence) {
                    return Err(wrap(
                        format!("chunk stored out of order (sequence {})", ack.sequence).into(),
                    ));
                }
                sequences.push(ack.sequence);
            }
            Ok(BlobRef {
                stream,
                sequences,
                size: body.len(),
            })
        }
        .boxed()
    }

    fn get_blob_chunk(
        &self,
        stream: String,
        sequence: u64,
    ) -> BoxFuture<'_, Result<BlobChunk, BusError>> {
        async move {
            let wrap = |e: Box<dyn std::error::Error + Send + Sync>| BusError::Nats {
                operation: "read blob chunk",
                subject: stream.clone(),
                source: e,
            };
            // Held until the chunk has arrived (or the read failed).
            let most = self.client.server_info().max_payload.div_ceil(1024);
            let share = u32::try_from(most.clamp(1, BLOB_READS_BUDGET_KIB)).unwrap_or(1);
            let _room = self
                .blob_reads
                .acquire_many(share)
                .await
                .map_err(|e| wrap(Box::new(e)))?;
            let handle = self
                .jetstream
                .get_stream_no_info(&stream)
                .await
                .map_err(|e| wrap(Box::new(e)))?;
            // A direct get answers with the chunk's bytes as they are; the stream API's
            // answer is JSON with the bytes in base64 (a third larger, encoded by the server
            // and decoded here). A stream made before direct gets were allowed, or a replica
            // that has not caught up, is asked through the stream API instead.
            let direct = if self.direct_gets.allowed() {
                // Made before the request is sent, so that a refusal coming meanwhile wakes it.
                let refused = self.direct_gets.refused.notified();
                let got = tokio::select! {
                    got = handle.direct_get(sequence) => Some(got),
                    () = refused => None,
                };
                match got {
                    None => {
                        tracing::debug!(%stream, sequence, "direct get refused, asking the stream API");
                        None
                    }
                    Some(Ok(message)) => {
                        if self.direct_gets.worked() {
                            tracing::info!(%stream, "direct gets of blob chunks work again");
                        }
                        Some(message)
                    }
                    Some(Err(e)) if e.kind() == jetstream::stream::DirectGetErrorKind::NotFound => {
                        tracing::debug!(%stream, sequence, "direct get found nothing, asking the stream leader");
                        None
                    }
                    Some(Err(e)) => {
                        if self.direct_gets.failed() {
                            tracing::warn!(
                                %stream,
                                "direct gets of blob chunks fail ({e}): reading them through the \
                                 stream API until the connection is made again or for {} s \
                                 (if this NATS user may not send them, allow it \
                                 $JS.API.DIRECT.GET.{stream})",
                                DIRECT_GETS_RETRY.as_secs()
                            );
                        }
                        None
                    }
                }
            } else {
                None
            };
            let message = match direct {
                Some(message) => message,
                None => handle
                    .get_raw_message(sequence)
                    .await
                    .map_err(|e| wrap(Box::new(e)))?,
            };
            Ok(BlobChunk {
                subject: message.subject.to_string(),
                data: message.payload,
            })
        }
        .boxed()
    }
}

/// Whether a server of `version` keeps a consumer's unacknowledged deliveries when the
/// messages before them are purged. nats-server before 2.9.15 forgets all of them on any
/// purge (its consumer's pending list is emptied, and a nak of one is then ignored), so a
/// frame handed back for another try would never come again. An unreadable version is
/// taken for an old one.
fn purge_keeps_deliveries(version: &str) -> bool {
    let mut parts = version
        .trim_start_matches('v')
        .split(['.', '-', '+'])
        .map(|part| part.parse::<u64>().ok());
    match (
        parts.next().flatten(),
        parts.next().flatten(),
        parts.next().flatten(),
    ) {
        (Some(major), Some(minor), Some(patch)) => (major, minor, patch) >= (2, 9, 15),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_servers_from_2_9_15_purge_without_forgetting_deliveries() {
        for old in ["2.9.10", "2.9.14", "2.8.4", "1.4.0", "", "2.x", "2.9"] {
            assert!(!purge_keeps_deliveries(old), "{old}");
        }
        for new in [
            "2.9.15",
            "2.9.25",
            "2.10.0",
            "2.10.22-RC.1",
            "v2.11.3",
            "3.0.0",
        ] {
            assert!(purge_keeps_deliveries(new), "{new}");
        }
    }

    #[tokio::test]
    async fn a_failed_connection_shows_the_url_without_its_password() {
        // Nothing listens on port 1: the connection is refused at once.
        let error = NatsBus::connect("nats://gateway:s3cret-pw@127.0.0.1:1", "test")
            .await
            .err()
            .expect("refused");
        let text = error.to_string();
        assert!(
            matches!(&error, BusError::Connect { url, .. } if url == "nats://gateway:***@127.0.0.1:1"),
            "{text}"
        );
        assert!(!text.contains("s3cret-pw"), "{text}");
        assert!(!format!("{error:?}").contains("s3cret-pw"), "{error:?}");
    }

    #[tokio::test]
    async fn a_missing_creds_file_is_a_start_error_naming_the_setting() {
        let access = NatsSettings {
            nats_creds_file: Some("/nonexistent/aip.creds".into()),
            ..NatsSettings::default()
        };
        let error = NatsBus::connect_with("nats://127.0.0.1:4222", "test", &access)
            .await
            .err()
            .expect("refused");
        assert!(
            matches!(
                &error,
                BusError::Access(NatsSettingsError::Unreadable {
                    setting: "nats_creds_file",
                    ..
                })
            ),
            "{error}"
        );
    }
}
