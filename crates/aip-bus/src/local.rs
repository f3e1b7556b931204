//! The in-process bus.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{FutureExt, Stream, StreamExt};
use tokio::sync::mpsc;

use crate::blob::{BlobChunk, BlobRef};
use crate::durable::{Acker, Delivery, DurableSubscription, StreamSpec};
use crate::headers::names;
use crate::{Bus, BusError, Headers, Message, RecentIds, Subscription, subject_matches};

/// Bound of each in-process durable stream's queue; publishers wait when it is full.
const STREAM_CAPACITY: usize = 65_536;
/// How many recent `Nats-Msg-Id`s an in-process stream remembers for de-duplication.
const DEDUP_WINDOW: usize = 65_536;

/// One in-process durable stream: a bounded queue shared by its consumers.
struct LocalStream {
    subjects: Vec<String>,
    tx: mpsc::Sender<(Message, u64)>,
    rx: Arc<tokio::sync::Mutex<mpsc::Receiver<(Message, u64)>>>,
    seen: std::sync::Mutex<RecentIds>,
}

impl LocalStream {
    /// Records a message id; false if it was seen recently (a duplicate).
    fn first_time(&self, id: &str) -> bool {
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .first_time(id)
    }
}

/// In-process blob chunks, oldest first, bounded in total size.
#[derive(Default)]
struct LocalBlobs {
    next: u64,
    bytes: usize,
    chunks: std::collections::BTreeMap<u64, BlobChunk>,
}

/// The payload limit [`LocalBus::for_one_process`] reports: above the largest client frame
/// (100 MiB), so only a message carrying several large results goes through blobs.
pub const ONE_PROCESS_MAX_PAYLOAD: usize = 256 << 20;

/// Most bytes of blobs kept in process; the oldest go first.
const LOCAL_BLOB_BYTES: usize = 1 << 30;

/// Redelivery handle of an in-process durable message.
pub(crate) struct LocalAck {
    tx: mpsc::Sender<(Message, u64)>,
}

impl LocalAck {
    pub(crate) fn redeliver(self, message: Message, delivered: u64, delay: Duration) {
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = self.tx.send((message, delivered)).await;
        });
    }
}

/// Default bound of each subscriber's queue.
const DEFAULT_CAPACITY: usize = 8192;

/// An in-process bus with NATS core semantics, for `aip dev` and tests.
///
/// Each subscription has a bounded queue; when it is full, further messages for it are dropped
/// and a warning is logged (a slow consumer, as NATS would treat it). There is no payload
/// limit, but [`Bus::max_payload`] reports a configurable one so that the large-body path is
/// exercised the same way as on NATS.
#[derive(Clone)]
pub struct LocalBus {
    inner: Arc<Inner>,
}

struct Inner {
    blobs: std::sync::Mutex<LocalBlobs>,
    streams: RwLock<HashMap<String, Arc<LocalStream>>>,
    exact: RwLock<HashMap<String, Vec<Sub>>>,
    wildcard: RwLock<Vec<(String, Sub)>>,
    next_id: AtomicU64,
    round_robin: AtomicUsize,
    capacity: usize,
    max_payload: usize,
}

#[derive(Clone)]
struct Sub {
    id: u64,
    group: Option<String>,
    tx: mpsc::Sender<Message>,
}

impl Default for LocalBus {
    fn default() -> Self {
        Self::new()
    }
}

impl LocalBus {
    /// A bus with default queue bounds and a 1 MiB reported payload limit (NATS's default).
    pub fn new() -> Self {
        Self::with_limits(DEFAULT_CAPACITY, 1024 * 1024)
    }

    /// The bus of a broker that is one process (`aip dev`): a body up to
    /// [`ONE_PROCESS_MAX_PAYLOAD`] travels as itself (a reference to the same bytes) instead of
    /// through the in-process blob store, which kept every large body (up to 1 GiB in all)
    /// after its messages were delivered and acknowledged.
    pub fn for_one_process() -> Self {
        Self::with_limits(DEFAULT_CAPACITY, ONE_PROCESS_MAX_PAYLOAD)
    }

    /// A bus with the given per-subscription queue bound and reported payload limit.
    pub fn with_limits(capacity: usize, max_payload: usize) -> Self {
        LocalBus {
            inner: Arc::new(Inner {
                blobs: std::sync::Mutex::new(LocalBlobs::default()),
                streams: RwLock::new(HashMap::new()),
                exact: RwLock::new(HashMap::new()),
                wildcard: RwLock::new(Vec::new()),
                next_id: AtomicU64::new(1),
                round_robin: AtomicUsize::new(0),
                capacity,
                max_payload,
            }),
        }
    }

    fn add(&self, subject: String, group: Option<String>) -> Subscription {
        let (tx, rx) = mpsc::channel(self.inner.capacity);
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let sub = Sub { id, group, tx };
        let wildcard = subject.split('.').any(|t| t == "*" || t == ">");
        if wildcard {
            write(&self.inner.wildcard).push((subject.clone(), sub));
        } else {
            write(&self.inner.exact)
                .entry(subject.clone())
                .or_default()
                .push(sub);
        }
        LocalSubscription {
            rx,
            id,
            subject,
            wildcard,
            bus: Arc::downgrade(&self.inner),
        }
        .boxed()
    }

    /// Delivers a message; returns how many subscribers received it.
    fn deliver(&self, message: Message) -> usize {
        let mut targets: Vec<Sub> = Vec::new();
        if let Some(subs) = read(&self.inner.exact).get(&message.subject) {
            targets.extend(subs.iter().cloned());
        }
        for (pattern, sub) in read(&self.inner.wildcard).iter() {
            if subject_matches(pattern, &message.subject) {
                targets.push(sub.clone());
            }
        }
        let mut delivered = 0;
        let mut groups: HashMap<&str, Vec<&Sub>> = HashMap::new();
        for sub in &targets {
            match &sub.group {
                Some(g) => groups.entry(g.as_str()).or_default().push(sub),
                None => delivered += usize::from(self.offer(sub, &message)),
            }
        }
        for members in groups.values() {
            let start = self.inner.round_robin.fetch_add(1, Ordering::Relaxed);
            for i in 0..members.len() {
                let member = members[(start + i) % members.len()];
                if !member.tx.is_closed() {
                    delivered += usize::from(self.offer(member, &message));
                    break;
                }
            }
        }
        delivered
    }

    fn offer(&self, sub: &Sub, message: &Message) -> bool {
        match sub.tx.try_send(message.clone()) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                tracing::warn!(subject = %message.subject, capacity = self.inner.capacity, "slow consumer: its queue is full, message dropped");
                true
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

struct LocalSubscription {
    rx: mpsc::Receiver<Message>,
    id: u64,
    subject: String,
    wildcard: bool,
    bus: Weak<Inner>,
}

impl Stream for LocalSubscription {
    type Item = Message;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Message>> {
        self.rx.poll_recv(cx)
    }
}

impl Drop for LocalSubscription {
    fn drop(&mut self) {
        let Some(inner) = self.bus.upgrade() else {
            return;
        };
        if self.wildcard {
            write(&inner.wildcard).retain(|(_, sub)| sub.id != self.id);
        } else {
            let mut exact = write(&inner.exact);
            if let Some(subs) = exact.get_mut(&self.subject) {
                subs.retain(|sub| sub.id != self.id);
                if subs.is_empty() {
                    exact.remove(&self.subject);
                }
            }
        }
    }
}

impl Bus for LocalBus {
    fn publish(
        &self,
        subject: String,
        headers: Headers,
        payload: Bytes,
    ) -> BoxFuture<'_, Result<(), BusError>> {
        let headers = crate::trace::with_current(headers);
        self.deliver(Message {
            subject,
            reply: None,
            headers,
            payload,
        });
        futures::future::ready(Ok(())).boxed()
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
            let inbox = format!("_INBOX.{}", uuid::Uuid::new_v4().simple());
            let mut replies = self.add(inbox.clone(), None);
            let delivered = self.deliver(Message {
                subject: subject.clone(),
                reply: Some(inbox),
                headers,
                payload,
            });
            if delivered == 0 {
                return Err(BusError::NoResponders { subject });
            }
            match tokio::time::timeout(timeout, replies.next()).await {
                Ok(Some(reply)) => Ok(reply),
                Ok(None) => Err(BusError::Closed),
                Err(_) => Err(BusError::Timeout { subject, timeout }),
            }
        }
        .boxed()
    }

    fn subscribe(&self, subject: String) -> BoxFuture<'_, Result<Subscription, BusError>> {
        futures::future::ready(Ok(self.add(subject, None))).boxed()
    }

    fn queue_subscribe(
        &self,
        subject: String,
        group: String,
    ) -> BoxFuture<'_, Result<Subscription, BusError>> {
        futures::future::ready(Ok(self.add(subject, Some(group)))).boxed()
    }

    fn flush(&self) -> BoxFuture<'_, Result<(), BusError>> {
        futures::future::ready(Ok(())).boxed()
    }

    fn max_payload(&self) -> usize {
        self.inner.max_payload
    }

    fn is_remote(&self) -> bool {
        false
    }

    fn ensure_stream(&self, spec: StreamSpec) -> BoxFuture<'_, Result<(), BusError>> {
        let mut streams = write(&self.inner.streams);
        if let Some(existing) = streams.get(&spec.name)
            && !crate::durable::same_subjects(&existing.subjects, &spec.subjects)
        {
            return futures::future::ready(Err(BusError::StreamConflict {
                stream: spec.name,
                expected: spec.subjects,
                found: existing.subjects.clone(),
            }))
            .boxed();
        }
        streams.entry(spec.name).or_insert_with(|| {
            let (tx, rx) = mpsc::channel(STREAM_CAPACITY);
            Arc::new(LocalStream {
                subjects: spec.subjects,
                tx,
                rx: Arc::new(tokio::sync::Mutex::new(rx)),
                seen: std::sync::Mutex::new(RecentIds::new(DEDUP_WINDOW)),
            })
        });
        futures::future::ready(Ok(())).boxed()
    }

    fn publish_durable(
        &self,
        subject: String,
        headers: Headers,
        payload: Bytes,
    ) -> BoxFuture<'_, Result<(), BusError>> {
        let headers = crate::trace::with_current(headers);
        let stream = read(&self.inner.streams)
            .values()
            .find(|s| s.subjects.iter().any(|p| subject_matches(p, &subject)))
            .cloned();
        async move {
            let Some(stream) = stream else {
                return Err(BusError::NoStream { subject });
            };
            if let Some(id) = headers.get(names::MSG_ID)
                && !stream.first_time(id)
            {
                return Ok(());
            }
            let message = Message {
                subject,
                reply: None,
                headers,
                payload,
            };
            stream
                .tx
                .send((message, 0))
                .await
                .map_err(|_| BusError::Closed)
        }
        .boxed()
    }

    fn consume(
        &self,
        stream: String,
        _consumer: String,
        _max_in_flight: usize,
    ) -> BoxFuture<'_, Result<DurableSubscription, BusError>> {
        let found = read(&self.inner.streams).get(&stream).cloned();
        async move {
            let Some(found) = found else {
                return Err(BusError::NoStream { subject: stream });
            };
            let rx = found.rx.clone();
            let tx = found.tx.clone();
            let deliveries = futures::stream::unfold((rx, tx), |(rx, tx)| async move {
                let next = rx.lock().await.recv().await;
                next.map(|(message, delivered)| {
                    let delivery = Delivery {
                        message,
                        delivered: delivered + 1,
                        acker: Acker::Local(LocalAck { tx: tx.clone() }),
                    };
                    (Ok(delivery), (rx, tx))
                })
            });
            Ok(deliveries.boxed())
        }
        .boxed()
    }

    fn release_pending(
        &self,
        _stream: String,
        _consumer: String,
    ) -> BoxFuture<'_, Result<u64, BusError>> {
        // In process, a message is held only by a consumer of this process, which nacks or
        // acks it; nothing is stranded by a dead consumer.
        async { Ok(0) }.boxed()
    }

    fn trim_acknowledged(
        &self,
        _stream: String,
        _consumer: String,
    ) -> BoxFuture<'_, Result<crate::Trimmed, BusError>> {
        // In process, an acknowledged message leaves its queue at once.
        async { Ok(crate::Trimmed::ByItself) }.boxed()
    }

    fn delete_stream(&self, name: String) -> BoxFuture<'_, Result<(), BusError>> {
        write(&self.inner.streams).remove(&name);
        futures::future::ready(Ok(())).boxed()
    }

    fn put_blob(
        &self,
        stream: String,
        subject: String,
        body: Bytes,
        chunk: usize,
    ) -> BoxFuture<'_, Result<BlobRef, BusError>> {
        let mut blobs = self.inner.blobs.lock().unwrap_or_else(|p| p.into_inner());
        let mut sequences = Vec::new();
        for piece in body.chunks(chunk.max(1)) {
            blobs.next += 1;
            let seq = blobs.next;
            blobs.bytes += piece.len();
            blobs.chunks.insert(
                seq,
                BlobChunk {
                    subject: subject.clone(),
                    data: body.slice_ref(piece),
                },
            );
            sequences.push(seq);
        }
        while blobs.bytes > LOCAL_BLOB_BYTES {
            let Some((_, old)) = blobs.chunks.pop_first() else {
                break;
            };
            blobs.bytes -= old.data.len();
        }
        futures::future::ready(Ok(BlobRef {
            stream,
            sequences,
            size: body.len(),
        }))
        .boxed()
    }

    fn get_blob_chunk(
        &self,
        stream: String,
        sequence: u64,
    ) -> BoxFuture<'_, Result<BlobChunk, BusError>> {
        let blobs = self.inner.blobs.lock().unwrap_or_else(|p| p.into_inner());
        let chunk = blobs
            .chunks
            .get(&sequence)
            .cloned()
            .ok_or_else(|| BusError::NoStream {
                subject: format!("{stream} (blob chunk {sequence} expired)"),
            });
        futures::future::ready(chunk).boxed()
    }
}
