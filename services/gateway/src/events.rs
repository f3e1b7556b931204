//! What the gateway tells the session service: client frames it does not answer itself,
//! and the end of a registered connection (ends that come together, in one event). Both go
//! into the durable frames stream, stored before the publish returns, so a session service
//! that restarts loses none.

use aip_bus::trace::Operation;
use aip_bus::{BlobStore, BusError, Headers, SharedBus, names};
use proto_schemas::sessions::{ConnectionClosed, ConnectionsClosed, GatewayEvent, MAX_CLOSED_MANY};
use proto_schemas::{Subjects, V1};
use tokio::sync::oneshot;
use tracing::Instrument;

use crate::AppState;
use crate::identity::Identity;

/// Why an event was not stored; the text is shown to the client whose frame it carried.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PublishError {
    /// A bug: events are plain data.
    #[error("internal error: {0}")]
    Encode(#[source] serde_json::Error),
    #[error("the session service has not started (no frames stream); try again later")]
    NoStream,
    #[error("the message bus did not store it: {0}")]
    Bus(#[source] BusError),
}

/// Publishes `event` for `client_id`, de-duplicated by the stream on `msg_id`.
pub(crate) async fn publish(
    state: &AppState,
    client_id: &str,
    event: &GatewayEvent,
    msg_id: String,
) -> Result<(), PublishError> {
    let stream = FramesStream {
        bus: &state.bus,
        blobs: &state.blobs,
        subjects: &state.subjects,
    };
    stream.publish(client_id, event, msg_id).await
}

/// Where events are stored: the frames stream on a bus, with the blob store for large ones.
struct FramesStream<'a> {
    bus: &'a SharedBus,
    blobs: &'a BlobStore,
    subjects: &'a Subjects,
}

impl FramesStream<'_> {
    /// Publishes `event` on `client_id`'s subject, de-duplicated by the stream on `msg_id`.
    async fn publish(
        &self,
        client_id: &str,
        event: &GatewayEvent,
        msg_id: String,
    ) -> Result<(), PublishError> {
        let body = serde_json::to_vec(event).map_err(|e| {
            tracing::error!(client = %client_id, "gateway event not serialisable: {e}");
            PublishError::Encode(e)
        })?;
        let headers = Headers::new().with(names::MSG_ID, msg_id);
        let subject = self.subjects.frames(client_id);
        let body = bytes::Bytes::from(body);
        let span = aip_bus::trace::messaging_span(
            Operation::Publish,
            &self.subjects.template(&subject),
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
                Err(e) => return Err(PublishError::Bus(e)),
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
}

impl Closings {
    /// Starts the task storing the ends in the frames stream of `subjects`; it ends once the
    /// queue is dropped and what was queued is stored. Must be called within a Tokio runtime.
    pub fn start(bus: SharedBus, blobs: BlobStore, subjects: Subjects) -> Self {
        let (queue, waiting) = flume::bounded(CLOSINGS_CAPACITY);
        tokio::spawn(store_closings(bus, blobs, subjects, waiting));
        Closings { queue }
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
}

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
            subjects: &subjects,
        };
        let stored_or_why = stream.publish(&client_id, &event, msg_id).await;
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

    /// A frames stream on an in-process bus, and the gathering queue storing into it.
    async fn closings() -> (SharedBus, Subjects, Closings) {
        let bus: SharedBus = Arc::new(LocalBus::new());
        let subjects = Subjects::new("t").expect("prefix");
        bus.ensure_stream(StreamSpec::new(
            subjects.frames_stream(),
            vec![subjects.frames_all()],
        ))
        .await
        .expect("stream");
        let closings = Closings::start(
            bus.clone(),
            BlobStore::for_subjects(&subjects),
            subjects.clone(),
        );
        (bus, subjects, closings)
    }

    /// The next `count` messages of the frames stream: subject, message id and event.
    async fn stored(
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
        let events = stored(&bus, &subjects, 1).await;
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

    #[tokio::test]
    async fn a_lone_end_is_a_closed_event_as_before() {
        let (bus, subjects, closings) = closings().await;
        closings.announce(closed(7)).await;
        closings.announce(closed(8)).await;
        let events = stored(&bus, &subjects, 2).await;
        for ((subject, msg_id, event), i) in events.iter().zip([7, 8]) {
            assert_eq!(subject, &subjects.frames(&format!("d{i}")));
            assert_eq!(msg_id, &format!("conn-{i}:closed"));
            assert_eq!(event, &GatewayEvent::Closed(closed(i)));
        }
    }
}
