//! What the gateway tells the session service: client frames it does not answer itself,
//! and the ends of registered connections the session service may know. Both go into the
//! durable frames stream, stored before the publish returns, so a session service that
//! restarts loses none; frames that come together go in one event, and so do ends.
//!
//! The session service knows a connection only from what passed between them: a frame the
//! connection sent, or a frame sent to it (a task's command names the connection its task
//! was placed on). So the end of a connection is announced when it forwarded a frame or a
//! delivery was queued for it ([`crate::deliveries::Inbox::close`]); the end of a connection
//! that only registered, answered heartbeats and left is not, which spares the frames stream,
//! the bus and the session service a stored event, its delivery and two acknowledgements
//! for each such connection (about a quarter of all the CPU a registration cost, measured
//! at 10 clients: docs/benchmarks.md, session 52). A frame
//! that reaches the gateway for a connection it no longer holds (the session service placed
//! a task on it from the registry's record as it ended) brings that end at once
//! ([`Closings::announce_gone`]), so the task ends as if the end had been announced.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use aip_bus::trace::Operation;
use aip_bus::{BlobStore, BusError, Headers, SharedBus, names};
use proto_schemas::sessions::{
    ConnectionClosed, ConnectionsClosed, GatewayEvent, InboundFrame, MAX_CLOSED_MANY,
    MAX_FRAMES_MANY,
};
use proto_schemas::{ClientType, Subjects, V1};
use tokio::sync::oneshot;
use tracing::Instrument;

use crate::AppState;
use crate::identity::Identity;

/// Why an event was not stored; the text is shown to the client whose frame it carried.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum PublishError {
    /// A bug: events are plain data.
    #[error("internal error: {0}")]
    Encode(#[source] Arc<serde_json::Error>),
    #[error("the session service has not started (no frames stream); try again later")]
    NoStream,
    #[error("the message bus did not store it: {0}")]
    Bus(#[source] Arc<BusError>),
    #[error("the gateway is stopping")]
    Stopping,
}

/// Stores a client's frame for the session service, de-duplicated by the stream on
/// `msg_id`; returns once it is stored (or could not be).
///
/// A frame that needs the blob store is stored on its own, at once, and so is every frame
/// while the session service has not said that it reads gathered frames. Any other goes
/// through [`Frames`]: alone when nothing is on its way, otherwise with the frames that came
/// meanwhile. `frame_bytes` (the frame's size as received) sizes the event's buffer.
pub(crate) async fn publish_frame(
    state: &AppState,
    inbound: &InboundFrame,
    msg_id: String,
    frame_bytes: usize,
) -> Result<(), PublishError> {
    let client_id = &inbound.client_id;
    // Encoded after the event's tag, so that a frame going alone becomes its event in place:
    // a 90 MiB frame is not copied into a second buffer.
    let mut event = Vec::with_capacity(LONE_FRAME_TAG.len() + EVENT_FIELDS_BYTES + frame_bytes);
    event.extend_from_slice(LONE_FRAME_TAG);
    serde_json::to_writer(&mut event, inbound).map_err(|e| {
        tracing::error!(client = %client_id, "gateway event not serialisable: {e}");
        PublishError::Encode(Arc::new(e))
    })?;
    let subject = state.subjects.frames(client_id);
    let span = aip_bus::trace::messaging_span(
        Operation::Publish,
        &state.subjects.template(&subject),
        &subject,
        None,
    );
    if !state.frames.gathering() || BlobStore::needed_for(state.bus.as_ref(), event.len()) {
        frame_event_in_place(&mut event);
        let stream = FramesStream {
            bus: &state.bus,
            blobs: &state.blobs,
        };
        let headers = Headers::new().with(names::MSG_ID, msg_id);
        count_stored(1);
        return stream
            .store(client_id, subject, headers, bytes::Bytes::from(event))
            .instrument(span)
            .await;
    }
    // Gathered with others: the frame's own encoding.
    event.drain(..LONE_FRAME_TAG.len());
    let frame = WaitingFrame {
        client_id: client_id.clone(),
        msg_id,
        traceparent: aip_bus::trace::traceparent_of(&span),
        encoded: event,
    };
    state.frames.store(frame).instrument(span).await
}

/// Turns [`LONE_FRAME_TAG`] followed by an encoded [`InboundFrame`] (an object) into the
/// frame's `frame` event, as [`lone_frame`] builds it.
fn frame_event_in_place(event: &mut Vec<u8>) {
    let opening = LONE_FRAME_TAG.len();
    if event.get(opening + 1) == Some(&b'}') {
        event.remove(opening);
    } else if let Some(brace) = event.get_mut(opening) {
        *brace = b',';
    }
}

/// Room for what an event adds to its frame (ids, the time, extensions), set aside with it.
const EVENT_FIELDS_BYTES: usize = 512;

/// What [`lone_frame`] puts before a frame's fields.
const LONE_FRAME_TAG: &[u8] = br#"{"event":"frame""#;

/// The `frame` event around an encoded [`InboundFrame`] (an object): the event's tag first,
/// then the frame's fields, as `GatewayEvent::Frame` encodes.
fn lone_frame(encoded: &[u8]) -> bytes::Bytes {
    let fields = encoded.strip_prefix(b"{").unwrap_or(encoded);
    let mut body = Vec::with_capacity(LONE_FRAME_TAG.len() + 1 + fields.len());
    body.extend_from_slice(LONE_FRAME_TAG);
    if fields != b"}" {
        body.push(b',');
    }
    body.extend_from_slice(fields);
    bytes::Bytes::from(body)
}

/// Where events are stored: the frames stream on a bus, with the blob store for large ones.
struct FramesStream<'a> {
    bus: &'a SharedBus,
    blobs: &'a BlobStore,
}

impl FramesStream<'_> {
    /// Publishes `event` on `client_id`'s subject of `subjects`, de-duplicated by the stream
    /// on `msg_id`.
    async fn publish(
        &self,
        subjects: &Subjects,
        client_id: &str,
        event: &GatewayEvent,
        msg_id: String,
    ) -> Result<(), PublishError> {
        let body = serde_json::to_vec(event).map_err(|e| {
            tracing::error!(client = %client_id, "gateway event not serialisable: {e}");
            PublishError::Encode(Arc::new(e))
        })?;
        let headers = Headers::new().with(names::MSG_ID, msg_id);
        let subject = subjects.frames(client_id);
        let body = bytes::Bytes::from(body);
        let span = aip_bus::trace::messaging_span(
            Operation::Publish,
            &subjects.template(&subject),
            &subject,
            None,
        );
        self.store(client_id, subject, headers, body)
            .instrument(span)
            .await
    }

    /// Stores one event, retrying while the bus is unreachable.
    async fn store(
        &self,
        client_id: &str,
        subject: String,
        headers: Headers,
        body: bytes::Bytes,
    ) -> Result<(), PublishError> {
        let (bus, blobs) = (self.bus, self.blobs);
        let deadline = tokio::time::Instant::now() + PUBLISH_RETRY_WINDOW;
        let mut delay = PUBLISH_RETRY_FIRST_DELAY;
        loop {
            let published =
                blobs.publish_durable(bus.as_ref(), subject.clone(), headers.clone(), body.clone());
            match published.await {
                Ok(()) => return Ok(()),
                Err(BusError::NoStream { .. }) => return Err(PublishError::NoStream),
                Err(e) if is_transient(&e) && tokio::time::Instant::now() + delay < deadline => {
                    tracing::warn!(client = %client_id, "frame not stored yet, retrying in {delay:?}: {e}");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(PUBLISH_RETRY_MAX_DELAY);
                }
                Err(e) => return Err(PublishError::Bus(Arc::new(e))),
            }
        }
    }
}

/// How long a frame is held and offered again while NATS is unreachable (a restart, a
/// failover). UFO clients never resend a frame, so a blip must not lose one; the stream
/// de-duplicates on the message id, so a try that was stored after all is not stored twice.
/// The connection reads no further frame meanwhile, so the hold is bounded per client.
const PUBLISH_RETRY_WINDOW: std::time::Duration = std::time::Duration::from_secs(15);
/// The first pause between tries; it doubles up to [`PUBLISH_RETRY_MAX_DELAY`].
const PUBLISH_RETRY_FIRST_DELAY: std::time::Duration = std::time::Duration::from_millis(100);
/// The longest pause between tries.
const PUBLISH_RETRY_MAX_DELAY: std::time::Duration = std::time::Duration::from_secs(2);

/// Whether another try may succeed: the bus failed or timed out, rather than refusing this
/// frame for what it is.
fn is_transient(error: &BusError) -> bool {
    matches!(error, BusError::Nats { .. } | BusError::Timeout { .. })
}

/// Frames waiting to be stored at most; more wait to be queued (each connection has one
/// frame on its way at a time, so this only bounds memory).
const FRAMES_CAPACITY: usize = 4096;

/// A client's frame waiting for the frames stream.
struct WaitingFrame {
    client_id: String,
    /// Its own message id (the stream's de-duplication when alone, the session service's in
    /// a `frames_many` event).
    msg_id: String,
    /// The trace context of its publish span.
    traceparent: Option<String>,
    /// The [`InboundFrame`], encoded.
    encoded: Vec<u8>,
}

/// Reports whether a frame was stored.
type Stored = oneshot::Sender<Result<(), PublishError>>;

/// The frames of this gateway's clients on their way to the frames stream, gathered.
///
/// Each frame as its own stream message costs a stored message, its acknowledgement, a
/// delivery to the session service and the session service's ack. As for connection ends
/// ([`Closings`]), no delay is added: a frame is stored at once when none is on its way,
/// and otherwise waits for the one on its way; the frames that waited are then stored
/// together as one `frames_many` event (at most [`MAX_FRAMES_MANY`], and at most half a bus
/// message). A lone frame is a `frame` event, as before. A connection has one frame on its
/// way at a time, so a client's frames keep their order.
///
/// A session service of an earlier version cannot read a `frames_many` event, so frames are
/// gathered only while the frames the session service sends say that it reads them
/// ([`names::READS`]); until the first such frame, and after one that does not say so, each
/// frame is stored on its own.
///
/// On the in-process bus (`aip dev`) frames are never gathered: storing one there is an
/// append in memory, and gathering would only add a hand-over to the storing task.
pub struct Frames {
    queue: flume::Sender<(WaitingFrame, Stored)>,
    gathering: AtomicBool,
    /// Whether the bus stores frames on a server ([`aip_bus::Bus::is_remote`]).
    remote: bool,
}

impl Frames {
    /// Starts the task storing the frames in the frames stream of `subjects`; it ends once
    /// the queue is dropped and what was queued is stored. Must be called within a Tokio
    /// runtime.
    pub fn start(bus: SharedBus, blobs: BlobStore, subjects: Subjects) -> Self {
        let (queue, waiting) = flume::bounded(FRAMES_CAPACITY);
        let remote = bus.is_remote();
        tokio::spawn(store_frames(bus, blobs, subjects, waiting));
        Frames {
            queue,
            gathering: AtomicBool::new(false),
            remote,
        }
    }

    /// Records whether the session service that sent the latest frame reads gathered frames.
    pub fn sessions_read_gathered(&self, reads: bool) {
        self.gathering
            .store(reads && self.remote, Ordering::Relaxed);
    }

    /// Whether frames may be gathered.
    fn gathering(&self) -> bool {
        self.gathering.load(Ordering::Relaxed)
    }

    /// Stores `frame`, with whatever else is waiting; returns once it is stored (or could
    /// not be).
    async fn store(&self, frame: WaitingFrame) -> Result<(), PublishError> {
        let (stored, done) = oneshot::channel();
        if self.queue.send_async((frame, stored)).await.is_err() {
            return Err(PublishError::Stopping);
        }
        done.await.unwrap_or(Err(PublishError::Stopping))
    }
}

/// Stores the queued frames, one event at a time, until the queue is dropped.
async fn store_frames(
    bus: SharedBus,
    blobs: BlobStore,
    subjects: Subjects,
    waiting: flume::Receiver<(WaitingFrame, Stored)>,
) {
    let room = bus.max_payload() / 2;
    let mut carried = None;
    loop {
        let first = match carried.take() {
            Some(first) => first,
            None => match waiting.recv_async().await {
                Ok(first) => first,
                Err(_) => return,
            },
        };
        let mut size = first.0.encoded.len();
        let mut batch = vec![first];
        while batch.len() < MAX_FRAMES_MANY
            && let Ok(next) = waiting.try_recv()
        {
            size += next.0.encoded.len() + GATHERED_OVERHEAD;
            if size > room {
                carried = Some(next);
                break;
            }
            batch.push(next);
        }
        let (frames, stored): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
        let stream = FramesStream {
            bus: &bus,
            blobs: &blobs,
        };
        let outcome = store_gathered(&stream, &subjects, &frames).await;
        if let Err(e) = &outcome {
            tracing::warn!(frames = frames.len(), "frames not stored: {e}");
        }
        for stored in stored {
            let _ = stored.send(outcome.clone());
        }
    }
}

/// Counts a frames-stream message carrying `frames` frames.
fn count_stored(frames: usize) {
    metrics::counter!("aip_gateway_frame_events_total").increment(1);
    metrics::counter!("aip_gateway_frames_stored_total").increment(frames as u64);
}

/// Room a gathered frame takes beside its encoding (its message id, trace context, keys).
const GATHERED_OVERHEAD: usize = 256;

/// Stores frames taken from the queue: one as its `frame` event, several as one
/// `frames_many` event.
async fn store_gathered(
    stream: &FramesStream<'_>,
    subjects: &Subjects,
    frames: &[WaitingFrame],
) -> Result<(), PublishError> {
    let first = &frames[0];
    let subject = subjects.frames(&first.client_id);
    count_stored(frames.len());
    if let [only] = frames {
        let mut headers = Headers::new().with(names::MSG_ID, only.msg_id.clone());
        if let Some(traceparent) = &only.traceparent {
            headers.insert(aip_bus::trace::TRACEPARENT, traceparent.clone());
        }
        let body = lone_frame(&only.encoded);
        return stream.store(&only.client_id, subject, headers, body).await;
    }
    let body = frames_many(frames).map_err(|e| {
        tracing::error!("frames_many event not serialisable: {e}");
        PublishError::Encode(Arc::new(e))
    })?;
    // The stream drops a copy of an id it stored: a frame is first in one event at most.
    let headers = Headers::new().with(names::MSG_ID, format!("{}:many", first.msg_id));
    stream
        .store(&first.client_id, subject, headers, bytes::Bytes::from(body))
        .await
}

/// The `frames_many` event of several frames, each carried as it was encoded (it reads as a
/// `GatewayEvent::FramesMany`). Written out rather than serialised: the frames are our own
/// encodings, so they are not parsed again to be embedded.
fn frames_many(frames: &[WaitingFrame]) -> Result<Vec<u8>, serde_json::Error> {
    let size: usize = frames
        .iter()
        .map(|f| f.encoded.len() + GATHERED_OVERHEAD)
        .sum();
    let mut body = Vec::with_capacity(size + 64);
    body.extend_from_slice(br#"{"event":"frames_many","version":"#);
    serde_json::to_writer(&mut body, &V1)?;
    body.extend_from_slice(br#","frames":["#);
    for (i, frame) in frames.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(br#"{"msg_id":"#);
        serde_json::to_writer(&mut body, &frame.msg_id)?;
        if let Some(traceparent) = &frame.traceparent {
            body.extend_from_slice(br#","traceparent":"#);
            serde_json::to_writer(&mut body, traceparent)?;
        }
        body.extend_from_slice(br#","inbound":"#);
        body.extend_from_slice(&frame.encoded);
        body.push(b'}');
    }
    body.extend_from_slice(b"]}");
    Ok(body)
}

/// Tells the session service that this client is gone, so its sessions end; returns once
/// the end is stored (or could not be).
pub(crate) async fn announce_closed(
    state: &AppState,
    identity: &Identity,
    connection_id: &str,
    reason: &str,
) {
    let closed = ConnectionClosed {
        version: V1,
        gateway_id: state.gateway_id.clone(),
        connection_id: connection_id.to_owned(),
        client_id: identity.client_id.clone(),
        client_type: identity.client_type,
        reason: reason.to_owned(),
    };
    state.closings.announce(closed).await;
}

/// Ends waiting to be reported at most; more wait to be queued (each connection reports one
/// end, so this only bounds memory).
const CLOSINGS_CAPACITY: usize = 4096;

/// Connections whose end was announced because a frame came for them after it, remembered so
/// that the frames that follow (a batch for one connection, a frame sent again) do not
/// announce it again.
const GONE_ANNOUNCED: usize = 1024;

/// The ends of this gateway's connections on their way to the frames stream, gathered.
///
/// Under load many connections end at once, and each end as its own stream message costs a
/// stored message, its acknowledgement, a delivery to the session service and its ack. As
/// for registry writes ([`crate::registrations`]), no delay is added: an end is stored at once
/// when none is on its way, and otherwise waits for the one on its way, and the ends that
/// waited are stored together as one `closed_many` event (at most
/// [`MAX_CLOSED_MANY`]). A lone end is a `closed` event, as before.
pub struct Closings {
    queue: flume::Sender<(ConnectionClosed, oneshot::Sender<()>)>,
    gone: std::sync::Mutex<aip_bus::RecentIds>,
}

impl Closings {
    /// Starts the task storing the ends in the frames stream of `subjects`; it ends once the
    /// queue is dropped and what was queued is stored. Must be called within a Tokio runtime.
    pub fn start(bus: SharedBus, blobs: BlobStore, subjects: Subjects) -> Self {
        let (queue, waiting) = flume::bounded(CLOSINGS_CAPACITY);
        tokio::spawn(store_closings(bus, blobs, subjects, waiting));
        Closings {
            queue,
            gone: std::sync::Mutex::new(aip_bus::RecentIds::new(GONE_ANNOUNCED)),
        }
    }

    /// Reports `closed`, with whatever else is waiting; returns once it is stored (or could
    /// not be: that is logged).
    pub async fn announce(&self, closed: ConnectionClosed) {
        let client_id = closed.client_id.clone();
        let (stored, done) = oneshot::channel();
        if self.queue.send_async((closed, stored)).await.is_err() || done.await.is_err() {
            tracing::warn!(client = %client_id, "session service not told of the disconnect: the gateway is stopping");
        }
    }

    /// A frame came for `connection_id` of `client_id`, which this gateway does not hold
    /// (any more): reports its end, without waiting, once per [`GONE_ANNOUNCED`] such
    /// connections. The session service applies an end it already had as a no-op.
    pub fn announce_gone(
        &self,
        gateway_id: &str,
        client_id: &str,
        connection_id: &str,
        client_type: ClientType,
    ) {
        let first = self
            .gone
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .first_time(connection_id);
        if !first {
            return;
        }
        metrics::counter!("aip_gateway_connection_ends_found_total").increment(1);
        tracing::debug!(
            client = client_id,
            connection = connection_id,
            "a frame for a connection that has ended: its end is announced"
        );
        let closed = ConnectionClosed {
            version: V1,
            gateway_id: gateway_id.to_owned(),
            connection_id: connection_id.to_owned(),
            client_id: client_id.to_owned(),
            client_type,
            reason: GONE_REASON.to_owned(),
        };
        // Nobody waits for it to be stored.
        let (stored, _) = oneshot::channel();
        if let Err(e) = self.queue.try_send((closed, stored)) {
            tracing::warn!(
                client = client_id,
                connection = connection_id,
                "the end of a connection a frame came for was not announced ({e}); its task ends at its deadline"
            );
        }
    }
}

/// The reason given with an end announced because a frame came for the connection.
const GONE_REASON: &str = "the connection had ended when a frame came for it";

/// Stores the queued ends, one event at a time, until the queue is dropped.
async fn store_closings(
    bus: SharedBus,
    blobs: BlobStore,
    subjects: Subjects,
    waiting: flume::Receiver<(ConnectionClosed, oneshot::Sender<()>)>,
) {
    while let Ok(first) = waiting.recv_async().await {
        let mut batch = vec![first];
        batch.extend(waiting.try_iter().take(MAX_CLOSED_MANY - 1));
        let (ends, stored): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
        let first = &ends[0];
        // The stream drops a copy of an id it stored: a connection ends once, and is first in
        // one event at most.
        let (client_id, msg_id) = (first.client_id.clone(), closed_msg_id(first, ends.len()));
        let count = ends.len();
        let event = if count == 1 {
            GatewayEvent::Closed(ends.into_iter().next().expect("one end"))
        } else {
            GatewayEvent::ClosedMany(ConnectionsClosed {
                version: V1,
                connections: ends,
            })
        };
        metrics::counter!("aip_gateway_connection_end_events_total").increment(1);
        metrics::counter!("aip_gateway_connection_ends_total").increment(count as u64);
        let stream = FramesStream {
            bus: &bus,
            blobs: &blobs,
        };
        let stored_or_why = stream.publish(&subjects, &client_id, &event, msg_id).await;
        if let Err(e) = stored_or_why {
            tracing::warn!(ends = count, client = %client_id, "session service not told of the disconnects: {e}");
        }
        for stored in stored {
            let _ = stored.send(());
        }
    }
}

/// The stream message id of an event reporting `count` ends, the first being `first`.
fn closed_msg_id(first: &ConnectionClosed, count: usize) -> String {
    if count == 1 {
        format!("{}:closed", first.connection_id)
    } else {
        format!("{}:closed-many", first.connection_id)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use aip_bus::{LocalBus, StreamSpec};
    use futures::StreamExt;
    use proto_schemas::ClientType;

    use super::*;

    fn closed(i: usize) -> ConnectionClosed {
        ConnectionClosed {
            version: V1,
            gateway_id: "gw-1".to_owned(),
            connection_id: format!("conn-{i}"),
            client_id: format!("d{i}"),
            client_type: ClientType::Device,
            reason: "client closed the connection".to_owned(),
        }
    }

    /// A frames stream on an in-process bus carrying messages of `max_payload` bytes.
    async fn frames_stream(max_payload: usize) -> (SharedBus, Subjects, BlobStore) {
        let bus: SharedBus = Arc::new(LocalBus::with_limits(1024, max_payload));
        let subjects = Subjects::new("t").expect("prefix");
        bus.ensure_stream(StreamSpec::new(
            subjects.frames_stream(),
            vec![subjects.frames_all()],
        ))
        .await
        .expect("stream");
        let blobs = BlobStore::for_subjects(&subjects);
        (bus, subjects, blobs)
    }

    /// A frames stream, and the ends' gathering queue storing into it.
    async fn closings() -> (SharedBus, Subjects, Closings) {
        let (bus, subjects, blobs) = frames_stream(1 << 20).await;
        let closings = Closings::start(bus.clone(), blobs, subjects.clone());
        (bus, subjects, closings)
    }

    /// The first `count` messages of the frames stream: subject, message id and event.
    async fn stored_events(
        bus: &SharedBus,
        subjects: &Subjects,
        count: usize,
    ) -> Vec<(String, String, GatewayEvent)> {
        let deliveries = bus
            .consume(subjects.frames_stream(), "test".to_owned(), 16)
            .await
            .expect("consume");
        deliveries
            .take(count)
            .map(|delivery| {
                let message = delivery.expect("delivered").message;
                let msg_id = message
                    .headers
                    .get(names::MSG_ID)
                    .expect("an id")
                    .to_owned();
                let event = serde_json::from_slice(&message.payload).expect("an event");
                (message.subject, msg_id, event)
            })
            .collect()
            .await
    }

    #[tokio::test]
    async fn ends_waiting_together_are_stored_as_one_event_in_their_order() {
        let (bus, subjects, closings) = closings().await;
        // All 30 are queued before the queue is first read.
        futures::future::join_all((0..30).map(|i| closings.announce(closed(i)))).await;
        let events = stored_events(&bus, &subjects, 1).await;
        let (subject, msg_id, event) = &events[0];
        assert_eq!(subject, &subjects.frames("d0"));
        assert_eq!(msg_id, "conn-0:closed-many");
        match event {
            GatewayEvent::ClosedMany(many) => {
                assert_eq!(many.connections, (0..30).map(closed).collect::<Vec<_>>())
            }
            other => panic!("{other:?}"),
        }
    }

    /// Frame `i` of client `c<i>`, with a request of `request_bytes` characters.
    fn inbound(i: usize, request_bytes: usize) -> InboundFrame {
        serde_json::from_value(serde_json::json!({
            "version": 1, "gateway_id": "gw-1", "connection_id": format!("conn-{i}"),
            "client_id": format!("c{i}"), "client_type": "constellation", "platform": "linux",
            "received_at": "2026-11-27T00:00:00Z",
            "frame": { "type": "task", "status": "continue", "client_type": "constellation",
                "client_id": format!("c{i}"),
                "session_id": format!("s{i}"), "request": "r".repeat(request_bytes) },
        }))
        .expect("an inbound frame")
    }

    fn waiting(i: usize, request_bytes: usize) -> WaitingFrame {
        WaitingFrame {
            client_id: format!("c{i}"),
            msg_id: format!("conn-{i}:1"),
            traceparent: Some(format!("00-{:032x}-{:016x}-01", i + 1, i + 1)),
            encoded: serde_json::to_vec(&inbound(i, request_bytes)).expect("json"),
        }
    }

    /// A frames stream carrying messages of `max_payload` bytes, and the frames' gathering
    /// queue storing into it.
    async fn frames(max_payload: usize) -> (SharedBus, Subjects, Frames) {
        let (bus, subjects, blobs) = frames_stream(max_payload).await;
        let frames = Frames::start(bus.clone(), blobs, subjects.clone());
        (bus, subjects, frames)
    }

    #[tokio::test]
    async fn frames_waiting_together_are_stored_as_one_event_in_their_order() {
        let (bus, subjects, frames) = frames(1 << 20).await;
        // All 30 are queued before the queue is first read.
        let stored = futures::future::join_all((0..30).map(|i| frames.store(waiting(i, 10)))).await;
        assert!(stored.iter().all(Result::is_ok), "{stored:?}");
        let events = stored_events(&bus, &subjects, 1).await;
        let (subject, msg_id, event) = &events[0];
        assert_eq!(subject, &subjects.frames("c0"));
        assert_eq!(msg_id, "conn-0:1:many");
        let GatewayEvent::FramesMany(many) = event else {
            panic!("{event:?}")
        };
        assert_eq!(many.frames.len(), 30);
        for (i, gathered) in many.frames.iter().enumerate() {
            let expected = waiting(i, 10);
            assert_eq!(gathered.msg_id, expected.msg_id);
            assert_eq!(gathered.traceparent, expected.traceparent);
            assert_eq!(gathered.inbound, inbound(i, 10));
        }
    }

    #[test]
    fn a_frame_becomes_its_event_in_place_as_lone_frame_builds_it() {
        for encoded in [
            serde_json::to_vec(&inbound(3, 10)).expect("json"),
            b"{}".to_vec(),
        ] {
            let mut event = LONE_FRAME_TAG.to_vec();
            event.extend_from_slice(&encoded);
            frame_event_in_place(&mut event);
            assert_eq!(event, lone_frame(&encoded).to_vec());
            serde_json::from_slice::<serde_json::Value>(&event).expect("JSON");
        }
    }

    #[tokio::test]
    async fn a_lone_frame_is_a_frame_event_as_before() {
        let (bus, subjects, frames) = frames(1 << 20).await;
        frames.store(waiting(7, 10)).await.expect("stored");
        let deliveries = bus
            .consume(subjects.frames_stream(), "test".to_owned(), 16)
            .await
            .expect("consume");
        let message = deliveries
            .take(1)
            .next()
            .await
            .expect("one")
            .expect("delivered")
            .message;
        assert_eq!(message.subject, subjects.frames("c7"));
        assert_eq!(message.headers.get(names::MSG_ID), Some("conn-7:1"));
        assert_eq!(
            message.headers.get(aip_bus::trace::TRACEPARENT),
            waiting(7, 10).traceparent.as_deref()
        );
        // Byte for byte what the event encodes as, tag first.
        let expected = serde_json::to_vec(&GatewayEvent::Frame(inbound(7, 10))).expect("json");
        assert_eq!(message.payload.as_ref(), expected.as_slice());
    }

    #[tokio::test]
    async fn gathered_frames_fill_half_a_bus_message_at_most() {
        // 64 KiB messages; frames of about 5 KiB: six fit in half of one.
        let (bus, subjects, frames) = frames(64 << 10).await;
        let stored =
            futures::future::join_all((0..20).map(|i| frames.store(waiting(i, 5000)))).await;
        assert!(stored.iter().all(Result::is_ok), "{stored:?}");
        let mut deliveries = bus
            .consume(subjects.frames_stream(), "test".to_owned(), 16)
            .await
            .expect("consume");
        let mut next = 0;
        let mut events = 0;
        while next < 20 {
            let message = deliveries
                .next()
                .await
                .expect("one")
                .expect("delivered")
                .message;
            events += 1;
            let carried: Vec<InboundFrame> = match serde_json::from_slice(&message.payload) {
                Ok(GatewayEvent::FramesMany(many)) => {
                    many.frames.into_iter().map(|f| f.inbound).collect()
                }
                Ok(GatewayEvent::Frame(frame)) => vec![frame],
                other => panic!("{other:?}"),
            };
            assert!(carried.len() <= 6, "{} frames in one event", carried.len());
            for frame in carried {
                assert_eq!(frame, inbound(next, 5000), "in their order");
                next += 1;
            }
        }
        assert!(events >= 4, "20 frames of 5 KiB in {events} events");
    }

    #[tokio::test]
    async fn a_lone_end_is_a_closed_event_as_before() {
        let (bus, subjects, closings) = closings().await;
        closings.announce(closed(7)).await;
        closings.announce(closed(8)).await;
        let events = stored_events(&bus, &subjects, 2).await;
        for ((subject, msg_id, event), i) in events.iter().zip([7, 8]) {
            assert_eq!(subject, &subjects.frames(&format!("d{i}")));
            assert_eq!(msg_id, &format!("conn-{i}:closed"));
            assert_eq!(event, &GatewayEvent::Closed(closed(i)));
        }
    }
}
