//! What other services send to this gateway's clients, on one subject for the whole gateway.
//!
//! The gateway subscribes to `deliver.{gateway}` once ([`subscribe`]) and [`run`] hands each
//! message to the connection of the client its `Aip-Client` header names, through that
//! connection's [`Inbox`]: a bounded queue that holds memory only while messages wait in it.
//! One subscription per connection would hold a message channel of the bus client's for every
//! idle connection, and cost a SUB and an UNSUB per registration.
//!
//! A message naming a connection (`Aip-Connection`) goes to that connection if this gateway
//! holds it, else to the client's newest connection here (which drops a frame bound to
//! another connection, [`crate::handlers::delivery`]). A message for a client this gateway
//! does not hold is dropped unanswered: the session service sends an unacknowledged frame
//! again, to the gateway the registry then names. A frame bound to a connection that is not
//! here (any more) also brings that connection's end ([`crate::events::Closings::announce_gone`]):
//! the end of a connection the session service had not heard from is not announced when it
//! happens ([`crate::events`]). A connection to which a delivery was queued is marked, and its
//! end is announced ([`Inbox::close`]). Device-info requests from other gateways
//! are answered here, from [`crate::devices`], without reaching the connection. A
//! [`DeliveryBatch`] (`Aip-Control: batch`) is taken apart into the messages it stands for,
//! each routed as if it had come alone.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use aip_bus::{Headers, Message as BusMessage, Subscription, names};
use bytes::Bytes;
use futures::StreamExt;
use proto_schemas::ErrorCode;
use proto_schemas::gateways::{
    DeviceInfoReply, DeviceInfoRequest, HeldDevice, MAX_DEVICE_INFO_BATCH,
};
use proto_schemas::sessions::{DeliveryBatch, MAX_DELIVERIES};

use crate::AppState;

/// Messages one connection's queue holds before more for it are dropped (a frame from the
/// outbox is sent again; a client this far behind is about to be closed as too slow by its
/// outbound queue anyway).
const INBOX_CAPACITY: usize = 256;

/// The connections this gateway holds, by client id, for routing deliveries.
#[derive(Debug, Default)]
pub struct Routes {
    table: Mutex<Table>,
}

#[derive(Debug, Default)]
struct Table {
    /// Per client, its connections here, oldest first (two only while a newer one replaces
    /// an older one).
    clients: HashMap<String, Vec<Held>>,
    /// Set when the gateway's subscription ended: nothing can be delivered any more.
    closed: bool,
}

#[derive(Debug)]
struct Held {
    connection_id: String,
    queue: flume::Sender<BusMessage>,
    /// Whether a delivery was queued for this connection: the session service then knows
    /// the connection, and must hear of its end.
    addressed: bool,
}

/// Why a connection could not be given an inbox.
#[derive(Debug, thiserror::Error)]
#[error("this gateway's delivery subscription ended; reconnect")]
pub struct DeliveriesEnded;

/// Where a connection receives its deliveries; leaving the routes when closed or dropped.
#[derive(Debug)]
pub struct Inbox {
    routes: Arc<Routes>,
    client_id: String,
    connection_id: String,
    queue: flume::Receiver<BusMessage>,
    left: bool,
}

impl Inbox {
    /// The next message; `None` once the gateway's subscription ended.
    pub async fn next(&self) -> Option<BusMessage> {
        self.queue.recv_async().await.ok()
    }

    /// Leaves the routes: a delivery for this connection from now on finds it gone. Returns
    /// whether one was ever queued for it (or whether that is no longer known, once the
    /// gateway's subscription ended), that is, whether the session service may know the
    /// connection.
    pub fn close(&mut self) -> bool {
        if self.left {
            return false;
        }
        self.left = true;
        self.routes.close(&self.client_id, &self.connection_id)
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        self.close();
    }
}

/// Where [`Routes::route`] put a message.
#[derive(Debug, PartialEq, Eq)]
enum Routed {
    Queued,
    /// No `Aip-Client` header, or a client this gateway does not hold.
    NotHeld,
    /// The connection's queue is full.
    Full,
}

impl Routes {
    /// Opens `connection_id`'s inbox for `client_id`: from now on deliveries for the client go
    /// to it (before any older connection of the client here).
    pub fn open(
        self: &Arc<Self>,
        client_id: &str,
        connection_id: &str,
    ) -> Result<Inbox, DeliveriesEnded> {
        let (queue, receiver) = flume::bounded(INBOX_CAPACITY);
        let mut table = self.lock();
        if table.closed {
            return Err(DeliveriesEnded);
        }
        table
            .clients
            .entry(client_id.to_owned())
            .or_default()
            .push(Held {
                connection_id: connection_id.to_owned(),
                queue,
                addressed: false,
            });
        Ok(Inbox {
            routes: self.clone(),
            client_id: client_id.to_owned(),
            connection_id: connection_id.to_owned(),
            queue: receiver,
            left: false,
        })
    }

    /// How many clients have a connection here.
    pub fn len(&self) -> usize {
        self.lock().clients.len()
    }

    /// Whether no client has.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Removes the connection; whether a delivery was ever queued for it (true once every
    /// inbox ended: that is no longer known).
    fn close(&self, client_id: &str, connection_id: &str) -> bool {
        let mut table = self.lock();
        if table.closed {
            return true;
        }
        let Some(held) = table.clients.get_mut(client_id) else {
            return false;
        };
        let addressed = held
            .iter()
            .any(|h| h.connection_id == connection_id && h.addressed);
        held.retain(|h| h.connection_id != connection_id);
        if held.is_empty() {
            table.clients.remove(client_id);
        }
        addressed
    }

    /// Ends every inbox: the connections see their deliveries end.
    fn close_all(&self) {
        let mut table = self.lock();
        table.closed = true;
        table.clients.clear();
    }

    fn route(&self, message: BusMessage) -> Routed {
        let mut table = self.lock();
        let Some(held) = message
            .headers
            .get(names::CLIENT)
            .and_then(|client| table.clients.get_mut(client))
        else {
            return Routed::NotHeld;
        };
        let named = message
            .headers
            .get(names::CONNECTION)
            .and_then(|c| held.iter().position(|h| h.connection_id == c));
        let Some(target) = named.or(held.len().checked_sub(1)).map(|i| &mut held[i]) else {
            return Routed::NotHeld;
        };
        match target.queue.try_send(message) {
            Ok(()) => {
                target.addressed = true;
                Routed::Queued
            }
            // A receiver gone is an inbox being dropped: its connection is ending.
            Err(flume::TrySendError::Disconnected(_)) => Routed::NotHeld,
            Err(flume::TrySendError::Full(_)) => Routed::Full,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Subscribes to this gateway's delivery subject: done before the gateway serves, so nothing
/// published for a client it registers is missed.
pub async fn subscribe(
    bus: &aip_bus::SharedBus,
    subjects: &proto_schemas::Subjects,
    gateway_id: &str,
) -> Result<Subscription, aip_bus::BusError> {
    bus.subscribe(subjects.deliver(gateway_id)).await
}

/// Routes the gateway's deliveries until its subscription ends; then every inbox ends, and
/// with it every connection (clients reconnect, to this gateway or another).
pub async fn run(state: Arc<AppState>, mut subscription: Subscription) {
    while let Some(message) = subscription.next().await {
        if message.headers.get(names::ACK).is_some() {
            // A frame from the session service: whether it reads gathered frames.
            let reads = message.headers.get(names::READS) == Some(names::FRAMES_MANY);
            state.frames.sessions_read_gathered(reads);
        }
        if message.headers.get(names::CONTROL) == Some(names::DEVICE_INFO) {
            answer_device_info(&state, &message).await;
            continue;
        }
        if message.headers.get(names::CONTROL) == Some(names::BATCH) {
            match unpack(&message) {
                Ok(deliveries) => {
                    for delivery in deliveries {
                        route(&state, delivery);
                    }
                }
                Err(e) => {
                    // The session service sends each frame again, one by one.
                    tracing::warn!("an unreadable delivery batch, dropped: {e}");
                    metrics::counter!("aip_gateway_deliveries_total", "outcome" => "unreadable")
                        .increment(1);
                }
            }
            continue;
        }
        route(&state, message);
    }
    if !state.shutdown.is_cancelled() {
        tracing::error!("the delivery subscription ended; closing every connection");
    }
    state.routes.close_all();
}

/// Hands one delivery to its client's connection, counting what could not be. A frame bound
/// to a connection this gateway does not hold brings that connection's end (its end may not
/// have been announced: [`crate::events`]).
fn route(state: &AppState, message: BusMessage) {
    let client = message.headers.get(names::CLIENT).map(str::to_owned);
    let connection = message.headers.get(names::CONNECTION).map(str::to_owned);
    match state.routes.route(message) {
        Routed::Queued => {}
        Routed::NotHeld => {
            tracing::debug!(
                client,
                "a delivery for a client this gateway does not hold, dropped"
            );
            metrics::counter!("aip_gateway_deliveries_total", "outcome" => "not_held").increment(1);
            if let (Some(client), Some(connection)) = (client, connection) {
                // Bound frames are an executor's commands: executors are devices.
                state.closings.announce_gone(
                    &state.gateway_id,
                    &client,
                    &connection,
                    proto_schemas::ClientType::Device,
                );
            }
        }
        Routed::Full => {
            tracing::warn!(
                client,
                "a client's delivery queue is full; a delivery for it dropped"
            );
            metrics::counter!("aip_gateway_deliveries_total", "outcome" => "queue_full")
                .increment(1);
        }
    }
}

/// The messages a [`DeliveryBatch`] stands for, in its order: each with the headers it would
/// carry alone and its frame as the payload (a slice of the batch's payload, not a copy).
fn unpack(batch: &BusMessage) -> Result<Vec<BusMessage>, String> {
    let read: DeliveryBatch<'_> =
        serde_json::from_slice(&batch.payload).map_err(|e| e.to_string())?;
    if read.deliveries.len() > MAX_DELIVERIES {
        return Err(format!(
            "{} deliveries; at most {MAX_DELIVERIES} in one batch",
            read.deliveries.len()
        ));
    }
    let ack = batch.headers.get(names::ACK);
    Ok(read
        .deliveries
        .into_iter()
        .map(|delivery| {
            let mut headers = Headers::new()
                .with(names::CLIENT, delivery.client_id)
                .with(names::MSG_ID, delivery.msg_id);
            if let Some(ack) = ack {
                headers.insert(names::ACK, ack);
            }
            if let Some(connection) = delivery.connection_id {
                headers.insert(names::CONNECTION, connection);
            }
            if let Some(traceparent) = delivery.traceparent {
                headers.insert(names::TRACEPARENT, traceparent);
            }
            BusMessage {
                subject: batch.subject.clone(),
                reply: None,
                headers,
                payload: batch.payload.slice_ref(delivery.frame.get().as_bytes()),
            }
        })
        .collect())
}

/// Another gateway asks, for its constellations, about a device or several: answered from
/// this gateway's own table, as for a constellation of its own; [`names::NOT_HELD`] for a
/// device not registered here.
async fn answer_device_info(state: &AppState, message: &BusMessage) {
    let Some(reply) = &message.reply else {
        return;
    };
    let (headers, payload) = if message.payload.is_empty() {
        let device_id = message.headers.get(names::CLIENT).unwrap_or_default();
        answer_one(state, device_id)
    } else {
        answer_many(state, &message.payload)
    };
    if let Err(e) = state.bus.publish(reply.clone(), headers, payload).await {
        tracing::debug!("device info answer not sent: {e}");
    }
}

/// What this gateway knows of `device_id`.
fn held(state: &AppState, device_id: &str) -> HeldDevice {
    match state.devices.get(device_id) {
        Some(device) => match &device.system_info {
            Some(info) => HeldDevice::Info(info.clone()),
            None => HeldDevice::NoSystemInfo,
        },
        None => HeldDevice::NotHeld,
    }
}

/// The answer about one device, in the form of a request without payload.
fn answer_one(state: &AppState, device_id: &str) -> (Headers, Bytes) {
    match held(state, device_id) {
        HeldDevice::Info(info) => (
            Headers::new(),
            Bytes::from(Box::<str>::from(info).into_string()),
        ),
        HeldDevice::NoSystemInfo => (
            Headers::new().with(names::ERROR_CODE, ErrorCode::DeviceNotFound.as_str()),
            Bytes::from(format!("Device {device_id} has no system info")),
        ),
        HeldDevice::NotHeld => (
            Headers::new().with(names::CONTROL, names::NOT_HELD),
            Bytes::new(),
        ),
    }
}

/// The answers about the devices of a [`DeviceInfoRequest`], in its order. A request that
/// cannot be read is answered with the reason, as a refusal.
fn answer_many(state: &AppState, payload: &[u8]) -> (Headers, Bytes) {
    let request = serde_json::from_slice::<DeviceInfoRequest>(payload)
        .map_err(|e| e.to_string())
        .and_then(|request| {
            if request.device_ids.len() > MAX_DEVICE_INFO_BATCH {
                Err(format!(
                    "{} devices named; at most {MAX_DEVICE_INFO_BATCH} in one request",
                    request.device_ids.len()
                ))
            } else {
                Ok(request)
            }
        });
    let request = match request {
        Ok(request) => request,
        Err(e) => {
            tracing::warn!("an unreadable device-info request from another gateway: {e}");
            return (
                Headers::new().with(names::ERROR_CODE, ErrorCode::InvalidRequest.as_str()),
                Bytes::from(format!("unreadable DeviceInfoRequest: {e}")),
            );
        }
    };
    let devices = request
        .device_ids
        .iter()
        .map(|id| held(state, id))
        .collect();
    let answer = DeviceInfoReply {
        version: proto_schemas::V1,
        devices,
    };
    match serde_json::to_vec(&answer) {
        Ok(body) => (
            Headers::new().with(names::CONTROL, names::DEVICE_INFO_BATCH),
            Bytes::from(body),
        ),
        Err(e) => (
            Headers::new().with(names::ERROR_CODE, ErrorCode::Internal.as_str()),
            Bytes::from(format!("device info not serialisable: {e}")),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(client: &str, connection: Option<&str>, text: &str) -> BusMessage {
        let mut headers = Headers::new().with(names::CLIENT, client);
        if let Some(connection) = connection {
            headers.insert(names::CONNECTION, connection);
        }
        BusMessage {
            subject: "aip.deliver.gw".to_owned(),
            reply: None,
            headers,
            payload: Bytes::copy_from_slice(text.as_bytes()),
        }
    }

    fn received(inbox: &Inbox) -> Vec<Bytes> {
        inbox.queue.drain().map(|m| m.payload).collect()
    }

    #[test]
    fn a_delivery_reaches_the_named_connection_else_the_newest() {
        let routes = Arc::new(Routes::default());
        let old = routes.open("pc-1", "c1").expect("open");
        let new = routes.open("pc-1", "c2").expect("open");
        assert_eq!(routes.route(message("pc-1", None, "any")), Routed::Queued);
        assert_eq!(
            routes.route(message("pc-1", Some("c1"), "old")),
            Routed::Queued
        );
        assert_eq!(
            routes.route(message("pc-1", Some("c9"), "gone")),
            Routed::Queued
        );
        assert_eq!(received(&old), ["old"]);
        assert_eq!(received(&new), ["any", "gone"]);
        assert_eq!(routes.route(message("pc-2", None, "x")), Routed::NotHeld);

        drop(new);
        assert_eq!(routes.route(message("pc-1", None, "back")), Routed::Queued);
        assert_eq!(received(&old), ["back"]);
        drop(old);
        assert_eq!(routes.route(message("pc-1", None, "late")), Routed::NotHeld);
        assert!(routes.is_empty());
    }

    #[test]
    fn a_batch_is_taken_apart_into_the_messages_it_stands_for() {
        let batch = r#"{"version":1,"deliveries":[
            {"msg_id":"m1","client_id":"pc-1","connection_id":"c1","frame":{"type":"command"}},
            {"msg_id":"m2","client_id":"pc-2","traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01","frame":{"type":"task_end","status":"completed"}}
        ]}"#;
        let message = BusMessage {
            subject: "aip.deliver.gw".to_owned(),
            reply: None,
            headers: Headers::new()
                .with(names::CONTROL, names::BATCH)
                .with(names::ACK, "aip.sessions.acks.r1"),
            payload: Bytes::from(batch),
        };
        let unpacked = unpack(&message).expect("a batch");
        assert_eq!(unpacked.len(), 2);
        let [first, second] = &unpacked[..] else {
            unreachable!()
        };
        assert_eq!(first.payload, r#"{"type":"command"}"#);
        assert_eq!(first.headers.get(names::CLIENT), Some("pc-1"));
        assert_eq!(first.headers.get(names::MSG_ID), Some("m1"));
        assert_eq!(first.headers.get(names::ACK), Some("aip.sessions.acks.r1"));
        assert_eq!(first.headers.get(names::CONNECTION), Some("c1"));
        assert_eq!(first.headers.get(names::TRACEPARENT), None);
        assert_eq!(
            second.payload,
            r#"{"type":"task_end","status":"completed"}"#
        );
        assert_eq!(second.headers.get(names::CONNECTION), None);
        assert!(second.headers.get(names::TRACEPARENT).is_some());

        // Each goes to its client's connection, as if it had come alone.
        let routes = Arc::new(Routes::default());
        let one = routes.open("pc-1", "c1").expect("open");
        let two = routes.open("pc-2", "c2").expect("open");
        for m in unpacked {
            assert_eq!(routes.route(m), Routed::Queued);
        }
        assert_eq!(received(&one), [r#"{"type":"command"}"#]);
        assert_eq!(received(&two).len(), 1);
    }

    #[test]
    fn an_unreadable_or_oversized_batch_is_refused_whole() {
        let message = |payload: String| BusMessage {
            subject: "aip.deliver.gw".to_owned(),
            reply: None,
            headers: Headers::new().with(names::CONTROL, names::BATCH),
            payload: Bytes::from(payload),
        };
        assert!(unpack(&message("not json".to_owned())).is_err());
        assert!(
            unpack(&message(
                r#"{"version":1,"deliveries":[{"msg_id":"m"}]}"#.to_owned()
            ))
            .is_err()
        );
        let one = r#"{"msg_id":"m","client_id":"c","frame":{}}"#;
        let many = vec![one; MAX_DELIVERIES + 1].join(",");
        let error = unpack(&message(format!(
            r#"{{"version":1,"deliveries":[{many}]}}"#
        )))
        .expect_err("too many");
        assert!(error.contains("at most 256"), "{error}");
    }

    #[test]
    fn a_full_inbox_drops_and_a_closed_gateway_opens_none() {
        let routes = Arc::new(Routes::default());
        let inbox = routes.open("pc-1", "c1").expect("open");
        for _ in 0..INBOX_CAPACITY {
            assert_eq!(routes.route(message("pc-1", None, "x")), Routed::Queued);
        }
        assert_eq!(routes.route(message("pc-1", None, "x")), Routed::Full);
        routes.close_all();
        assert!(routes.open("pc-2", "c2").is_err());
        assert_eq!(
            inbox.queue.len(),
            INBOX_CAPACITY,
            "queued messages are still read"
        );
    }
}
