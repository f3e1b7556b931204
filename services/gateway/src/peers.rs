//! Device-info requests to the other gateways, gathered per gateway.
//!
//! A constellation's request about a device on another gateway is asked of the gateway holding
//! the device ([`crate::handlers::device_info`]). Under load many are on their way to the same
//! gateway at once: they go as one bus request naming every device waiting
//! ([`DeviceInfoRequest`]), and come back as one reply. No delay is added to gather them: a
//! request leaves at once when none is on its way to that gateway, and otherwise waits for
//! that one to return, so batches grow with the load and a lone request goes alone, in the
//! form without payload. (Several batches on their way at once were measured slower: each
//! bus message costs both gateways and NATS a wake-up, whatever it carries.) When a gateway
//! does not answer a batch, the requests that gathered meanwhile get the same answer at once
//! rather than waiting as long again.
//!
//! A batch names its first device in `Aip-Client` as well. A gateway of an earlier version
//! answers only that one, without [`names::DEVICE_INFO_BATCH`]: the other devices are then
//! asked one by one, so gateways of two versions side by side (a rolling update) still answer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aip_bus::{BusError, Headers, Message, SharedBus, names};
use bytes::Bytes;
use proto_schemas::gateways::{DeviceInfoReply, DeviceInfoRequest, HeldDevice};
use proto_schemas::{Subjects, V1};
use serde_json::value::RawValue;
use tokio::sync::oneshot;

/// Devices in one batch at most (below [`proto_schemas::gateways::MAX_DEVICE_INFO_BATCH`]).
const MAX_BATCH: usize = 128;
/// Requests waiting for one gateway at most; more wait to be queued (each connection asks one
/// at a time, so this only bounds memory).
const QUEUE_CAPACITY: usize = 4096;
/// A gateway not asked about anything this long has its queue and task ended.
const IDLE: Duration = Duration::from_secs(60);
/// Tries to queue a request: a queue that ended while the request joined it is made again.
const ATTEMPTS: usize = 3;

/// What the gateway holding a device answered.
#[derive(Debug, Clone)]
pub enum Held {
    /// Its system information.
    Info(Box<RawValue>),
    /// Why there is none (the device sent none, or the request was refused).
    Refused(String),
    /// That gateway does not hold it (or no gateway of that id is running).
    NotHeld,
    /// The bus failed, or the holder did not answer in time.
    Failed(String),
}

/// The queues of device-info requests, one per gateway asked.
pub struct Peers {
    exchange: Arc<Exchange>,
    queues: Mutex<HashMap<String, flume::Sender<Ask>>>,
}

/// One request waiting to be sent.
struct Ask {
    device_id: String,
    answer: oneshot::Sender<Held>,
}

/// How requests are sent.
struct Exchange {
    bus: SharedBus,
    subjects: Subjects,
    patience: Duration,
}

impl Peers {
    /// Requests go over `bus`, to `subjects`' delivery subjects, and wait at most `patience`.
    pub fn new(bus: SharedBus, subjects: Subjects, patience: Duration) -> Self {
        Peers {
            exchange: Arc::new(Exchange {
                bus,
                subjects,
                patience,
            }),
            queues: Mutex::new(HashMap::new()),
        }
    }

    /// Asks `gateway` about `device_id`, with whatever else is waiting for it.
    pub async fn ask(&self, gateway: &str, device_id: &str) -> Held {
        for _ in 0..ATTEMPTS {
            let (answer, answered) = oneshot::channel();
            let ask = Ask {
                device_id: device_id.to_owned(),
                answer,
            };
            if self.queue(gateway).send_async(ask).await.is_err() {
                continue;
            }
            // No answer: the queue ended (idle) just as the request joined it.
            if let Ok(held) = answered.await {
                return held;
            }
        }
        Held::Failed(format!(
            "the request to gateway `{gateway}` could not be queued"
        ))
    }

    /// Gateways with a queue.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no gateway has.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The queue for `gateway`, made (with its task) if it has none or its task ended.
    fn queue(&self, gateway: &str) -> flume::Sender<Ask> {
        let mut queues = self.lock();
        if let Some(queue) = queues.get(gateway)
            && !queue.is_disconnected()
        {
            return queue.clone();
        }
        queues.retain(|_, queue| !queue.is_disconnected());
        let (queue, waiting) = flume::bounded(QUEUE_CAPACITY);
        let subject = self.exchange.subjects.deliver(gateway);
        tokio::spawn(send_batches(self.exchange.clone(), subject, waiting));
        queues.insert(gateway.to_owned(), queue.clone());
        queue
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, flume::Sender<Ask>>> {
        self.queues.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Sends one gateway's requests in batches, one batch at a time, until none has come for
/// [`IDLE`].
async fn send_batches(exchange: Arc<Exchange>, subject: String, waiting: flume::Receiver<Ask>) {
    loop {
        let first = match tokio::time::timeout(IDLE, waiting.recv_async()).await {
            Ok(Ok(ask)) => ask,
            // Idle, or the gateway is shutting down: the queue ends with this task.
            _ => return,
        };
        let mut batch = vec![first];
        batch.extend(waiting.try_iter().take(MAX_BATCH - 1));
        if let Some(unanswered) = exchange.send(&subject, batch).await {
            for ask in waiting.try_iter() {
                let _ = ask.answer.send(unanswered.clone());
            }
        }
    }
}

impl Exchange {
    /// Sends `batch` as one request and answers each of its requests. When the gateway did
    /// not answer (none of that id runs, or not in time): that answer, for the requests
    /// waiting now.
    async fn send(&self, subject: &str, mut batch: Vec<Ask>) -> Option<Held> {
        if batch.len() == 1 {
            let ask = batch.remove(0);
            let reply = self.request_one(subject, &ask.device_id).await;
            let (held, unanswered) = match reply {
                Ok(reply) => (one_answer(&ask.device_id, reply), None),
                Err(e) => {
                    let held = failure(e);
                    (held.clone(), Some(held))
                }
            };
            let _ = ask.answer.send(held);
            return unanswered;
        }
        let request = DeviceInfoRequest {
            version: V1,
            device_ids: batch.iter().map(|a| a.device_id.clone()).collect(),
        };
        let payload = match serde_json::to_vec(&request) {
            Ok(payload) => Bytes::from(payload),
            Err(e) => {
                for ask in batch {
                    let _ = ask
                        .answer
                        .send(Held::Failed(format!("internal error: {e}")));
                }
                return None;
            }
        };
        counted("batch", batch.len());
        let headers = request_headers(&batch[0].device_id);
        let reply = self
            .bus
            .request(subject.to_owned(), headers, payload, self.patience)
            .await;
        let reply = match reply {
            Ok(reply) => reply,
            Err(e) => {
                let held = failure(e);
                for ask in batch {
                    let _ = ask.answer.send(held.clone());
                }
                return Some(held);
            }
        };
        if reply.headers.get(names::CONTROL) != Some(names::DEVICE_INFO_BATCH) {
            // A gateway of an earlier version: the answer is about the first device alone.
            let mut asks = batch.into_iter();
            if let Some(first) = asks.next() {
                let _ = first.answer.send(one_answer(&first.device_id, reply));
            }
            let rest = asks.map(|ask| async move {
                let held = match self.request_one(subject, &ask.device_id).await {
                    Ok(reply) => one_answer(&ask.device_id, reply),
                    Err(e) => failure(e),
                };
                let _ = ask.answer.send(held);
            });
            futures::future::join_all(rest).await;
            return None;
        }
        match serde_json::from_slice::<DeviceInfoReply>(&reply.payload) {
            Ok(answers) if answers.devices.len() == batch.len() => {
                for (ask, held) in batch.into_iter().zip(answers.devices) {
                    let held = match held {
                        HeldDevice::Info(info) => Held::Info(info),
                        HeldDevice::NoSystemInfo => {
                            Held::Refused(format!("Device {} has no system info", ask.device_id))
                        }
                        HeldDevice::NotHeld => Held::NotHeld,
                    };
                    let _ = ask.answer.send(held);
                }
            }
            Ok(answers) => {
                let text = format!(
                    "gateway answered {} devices of {} asked about",
                    answers.devices.len(),
                    batch.len()
                );
                tracing::warn!(%subject, "{text}");
                for ask in batch {
                    let _ = ask.answer.send(Held::Failed(text.clone()));
                }
            }
            Err(e) => {
                tracing::warn!(%subject, "an unreadable device-info answer: {e}");
                for ask in batch {
                    let _ = ask
                        .answer
                        .send(Held::Failed(format!("unreadable device-info answer: {e}")));
                }
            }
        }
        None
    }

    /// Asks about one device, in the form without payload.
    async fn request_one(&self, subject: &str, device_id: &str) -> Result<Message, BusError> {
        counted("single", 1);
        let headers = request_headers(device_id);
        self.bus
            .request(subject.to_owned(), headers, Bytes::new(), self.patience)
            .await
    }
}

/// The headers of a device-info request: a batch names its first device, as a lone request
/// names its only one.
fn request_headers(first_device: &str) -> Headers {
    Headers::new()
        .with(names::CONTROL, names::DEVICE_INFO)
        .with(names::CLIENT, first_device)
}

/// Counts a request to another gateway naming `devices` devices.
fn counted(form: &'static str, devices: usize) {
    metrics::counter!("aip_gateway_peer_device_info_requests_total", "form" => form).increment(1);
    metrics::counter!("aip_gateway_peer_device_info_devices_total").increment(devices as u64);
}

/// The answer to a request about one device.
fn one_answer(device_id: &str, reply: Message) -> Held {
    if reply.headers.get(names::CONTROL) == Some(names::NOT_HELD) {
        return Held::NotHeld;
    }
    if reply.headers.get(names::ERROR_CODE).is_some() {
        return Held::Refused(String::from_utf8_lossy(&reply.payload).into_owned());
    }
    match serde_json::from_slice::<Box<RawValue>>(&reply.payload) {
        Ok(info) => Held::Info(info),
        Err(e) => Held::Refused(format!(
            "Device {device_id}'s system info could not be read: {e}"
        )),
    }
}

/// No gateway of that id answers: it holds nothing. Anything else is a failure.
fn failure(error: BusError) -> Held {
    match error {
        BusError::NoResponders { .. } => Held::NotHeld,
        e => Held::Failed(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use aip_bus::LocalBus;
    use futures::StreamExt;

    use super::*;

    fn info_of(device_id: &str) -> String {
        format!(r#"{{"device_id":"{device_id}"}}"#)
    }

    /// A gateway holding `d0`…`d9` (`d9` without system information) that answers as this
    /// version does when `batches`, as an earlier version (the device in `Aip-Client` alone)
    /// otherwise. Counts requests, and those naming several devices.
    async fn holder(bus: &SharedBus, subject: String, batches: bool) -> Arc<[AtomicUsize; 2]> {
        let counts = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
        let mut subscription = bus.subscribe(subject).await.expect("subscribe");
        let (bus, counted) = (bus.clone(), counts.clone());
        tokio::spawn(async move {
            while let Some(message) = subscription.next().await {
                counted[0].fetch_add(1, Ordering::SeqCst);
                if !message.payload.is_empty() {
                    counted[1].fetch_add(1, Ordering::SeqCst);
                }
                let bus = bus.clone();
                tokio::spawn(async move {
                    let answer = |id: &str| match id {
                        "d9" => HeldDevice::NoSystemInfo,
                        id if id.starts_with('d') && id.len() == 2 => {
                            HeldDevice::Info(RawValue::from_string(info_of(id)).expect("JSON"))
                        }
                        _ => HeldDevice::NotHeld,
                    };
                    let (headers, payload) = if batches && !message.payload.is_empty() {
                        let request: DeviceInfoRequest =
                            serde_json::from_slice(&message.payload).expect("a request");
                        let reply = DeviceInfoReply {
                            version: V1,
                            devices: request.device_ids.iter().map(|id| answer(id)).collect(),
                        };
                        (
                            Headers::new().with(names::CONTROL, names::DEVICE_INFO_BATCH),
                            Bytes::from(serde_json::to_vec(&reply).expect("encoded")),
                        )
                    } else {
                        match answer(message.headers.get(names::CLIENT).expect("Aip-Client")) {
                            HeldDevice::Info(info) => {
                                (Headers::new(), Bytes::from(info.get().to_owned()))
                            }
                            HeldDevice::NoSystemInfo => (
                                Headers::new().with(names::ERROR_CODE, "DEVICE_NOT_FOUND"),
                                Bytes::from("no system info"),
                            ),
                            HeldDevice::NotHeld => (
                                Headers::new().with(names::CONTROL, names::NOT_HELD),
                                Bytes::new(),
                            ),
                        }
                    };
                    let reply = message.reply.expect("a request");
                    bus.publish(reply, headers, payload).await.expect("answer");
                });
            }
        });
        counts
    }

    /// 60 requests at once, about `d0`…`d9` and `x1` (held nowhere), each answered with its own
    /// device's answer; returns how many bus requests carried them, and how many of those
    /// named several devices.
    async fn ask_at_once(batches: bool) -> (usize, usize) {
        let bus: SharedBus = Arc::new(LocalBus::new());
        let subjects = Subjects::new("t").expect("prefix");
        let counts = holder(&bus, subjects.deliver("gw-b"), batches).await;
        let peers = Arc::new(Peers::new(bus, subjects, Duration::from_secs(5)));
        let asks = (0..60).map(|i| {
            let peers = peers.clone();
            async move {
                let device = if i % 11 == 10 {
                    "x1".to_owned()
                } else {
                    format!("d{}", i % 11)
                };
                (device.clone(), peers.ask("gw-b", &device).await)
            }
        });
        for (device, held) in futures::future::join_all(asks).await {
            match (device.as_str(), held) {
                ("x1", Held::NotHeld) => {}
                ("d9", Held::Refused(_)) => {}
                (id, Held::Info(info)) if id != "d9" && id != "x1" => {
                    assert_eq!(info.get(), info_of(id))
                }
                (id, held) => panic!("{id}: {held:?}"),
            }
        }
        assert_eq!(peers.len(), 1);
        (
            counts[0].load(Ordering::SeqCst),
            counts[1].load(Ordering::SeqCst),
        )
    }

    #[tokio::test]
    async fn requests_waiting_for_one_gateway_go_together_and_each_gets_its_answer() {
        let (requests, batches) = ask_at_once(true).await;
        // All 60 are queued before the gateway's queue is first read: one bus message.
        assert_eq!((requests, batches), (1, 1));
    }

    #[tokio::test]
    async fn a_gateway_answering_only_the_first_device_of_a_batch_still_answers_every_request() {
        // A batch is answered for its first device; its others are asked one by one.
        let (requests, batches) = ask_at_once(false).await;
        assert_eq!((requests, batches), (60, 1));
    }

    // On a paused clock: time moves only when every task waits (here, for the timeout or
    // the sleep), so the requests gather the same way on every run.
    #[tokio::test(start_paused = true)]
    async fn requests_gathered_while_a_gateway_does_not_answer_are_not_held_as_long_again() {
        let bus: SharedBus = Arc::new(LocalBus::new());
        let subjects = Subjects::new("t").expect("prefix");
        // Subscribed, never answering.
        let mut silent = bus
            .subscribe(subjects.deliver("gw-stuck"))
            .await
            .expect("subscribe");
        let patience = Duration::from_millis(300);
        let peers = Arc::new(Peers::new(bus, subjects, patience));
        let started = tokio::time::Instant::now();
        let ask = |i: usize| {
            let peers = peers.clone();
            tokio::spawn(async move { peers.ask("gw-stuck", &format!("d{i}")).await })
        };
        // The first leaves alone; once it is on its way, the others gather behind it.
        let mut asked = vec![ask(0)];
        silent.next().await.expect("the first request");
        asked.extend((1..20).map(ask));
        for held in futures::future::join_all(asked).await {
            let held = held.expect("asked");
            assert!(matches!(held, Held::Failed(_)), "{held:?}");
        }
        // One wait for the batch on its way, not one more for the requests behind it (the
        // clock is paused: it moves only by the timers it waits for).
        assert_eq!(started.elapsed(), patience);
    }

    #[tokio::test]
    async fn no_gateway_of_that_id_means_it_holds_nothing() {
        let bus: SharedBus = Arc::new(LocalBus::new());
        let peers = Peers::new(
            bus,
            Subjects::new("t").expect("prefix"),
            Duration::from_secs(1),
        );
        assert!(matches!(peers.ask("gw-gone", "d1").await, Held::NotHeld));
    }
}
