//! Delivery acknowledgements, gathered: every frame from the session service's outbox is
//! acknowledged once it is written to its socket ([`DeliveryAck`]), and under load a gateway
//! writes thousands a second. The connections queue their acknowledgements here, and one task
//! sends whatever has queued as one message per session replica. A lone acknowledgement
//! leaves at once; nothing waits to fill a message (the task yields once, so that the
//! connections woken by one delivery batch queue theirs first).

use aip_bus::{Headers, SharedBus};
use proto_schemas::V1;
use proto_schemas::sessions::DeliveryAck;
use tokio::sync::{mpsc, oneshot};

/// Acknowledgements queued before a connection waits for room.
const QUEUE: usize = 8192;

/// Message ids per [`DeliveryAck`] at most (about 40 bytes each: far under any bus limit).
pub const MAX_IDS_PER_ACK: usize = 1000;

/// Queued work for the sending task.
enum Queued {
    Ack { subject: String, msg_id: String },
    Flush(oneshot::Sender<()>),
}

/// Where a gateway's connections queue their delivery acknowledgements.
#[derive(Clone)]
pub struct DeliveryAcks {
    queue: mpsc::Sender<Queued>,
}

impl DeliveryAcks {
    /// Starts the task that sends them; it ends once every handle is dropped, after sending
    /// what is queued.
    pub fn start(bus: SharedBus) -> Self {
        let (queue, queued) = mpsc::channel(QUEUE);
        tokio::spawn(send_gathered(bus, queued));
        DeliveryAcks { queue }
    }

    /// Acknowledges the frame `msg_id` to `subject` (the frame's `Aip-Ack`). A lost
    /// acknowledgement costs a re-send, which the connection drops as a duplicate.
    pub async fn ack(&self, subject: &str, msg_id: &str) {
        let queued = Queued::Ack {
            subject: subject.to_owned(),
            msg_id: msg_id.to_owned(),
        };
        if self.queue.send(queued).await.is_err() {
            tracing::debug!(
                msg_id,
                "delivery acknowledgement not sent: the gateway stops"
            );
        }
    }

    /// Waits until everything queued before this call has been handed to the bus.
    pub async fn flush(&self) {
        let (done, sent) = oneshot::channel();
        if self.queue.send(Queued::Flush(done)).await.is_ok() {
            let _ = sent.await;
        }
    }
}

/// Sends what is queued, gathered by subject, until the queue closes.
async fn send_gathered(bus: SharedBus, mut queued: mpsc::Receiver<Queued>) {
    // Few subjects: one per session replica that sent frames.
    let mut by_subject: Vec<(String, Vec<String>)> = Vec::new();
    let mut flushes = Vec::new();
    while let Some(first) = queued.recv().await {
        // The connections a delivery batch woke write their frames at about the same moment:
        // yielding once lets those already running queue theirs, which then leave in this
        // message. Nothing waits on a timer.
        tokio::task::yield_now().await;
        let mut next = Some(first);
        let mut taken = 0;
        while let Some(item) = next {
            match item {
                Queued::Ack { subject, msg_id } => {
                    match by_subject.iter_mut().find(|(s, _)| *s == subject) {
                        Some((_, ids)) => ids.push(msg_id),
                        None => by_subject.push((subject, vec![msg_id])),
                    }
                }
                Queued::Flush(done) => flushes.push(done),
            }
            taken += 1;
            next = if taken < QUEUE {
                queued.try_recv().ok()
            } else {
                None
            };
        }
        for (subject, ids) in by_subject.drain(..) {
            for chunk in ids.chunks(MAX_IDS_PER_ACK) {
                send(&bus, &subject, chunk).await;
            }
        }
        for done in flushes.drain(..) {
            let _ = done.send(());
        }
    }
}

async fn send(bus: &SharedBus, subject: &str, msg_ids: &[String]) {
    let ack = DeliveryAck {
        version: V1,
        msg_ids: msg_ids.to_vec(),
    };
    let payload = match serde_json::to_vec(&ack) {
        Ok(payload) => payload,
        Err(e) => {
            tracing::error!("delivery acknowledgements could not be encoded: {e}");
            return;
        }
    };
    if let Err(e) = bus
        .publish(subject.to_owned(), Headers::new(), payload.into())
        .await
    {
        tracing::debug!(
            count = msg_ids.len(),
            "delivery acknowledgements not sent (the frames come again): {e}"
        );
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use aip_bus::LocalBus;
    use futures::StreamExt;

    use super::*;

    async fn received(sub: &mut aip_bus::Subscription) -> Vec<String> {
        let mut ids = Vec::new();
        while let Ok(Some(message)) =
            tokio::time::timeout(Duration::from_millis(200), sub.next()).await
        {
            let ack: DeliveryAck = serde_json::from_slice(&message.payload).expect("an ack");
            assert!(ack.msg_ids.len() <= MAX_IDS_PER_ACK);
            ids.extend(ack.msg_ids);
        }
        ids
    }

    #[tokio::test]
    async fn every_acknowledgement_reaches_its_subject_once_in_order() {
        let bus: SharedBus = Arc::new(LocalBus::new());
        let mut a = bus.subscribe("acks.a".into()).await.expect("subscribe");
        let mut b = bus.subscribe("acks.b".into()).await.expect("subscribe");
        let acks = DeliveryAcks::start(bus.clone());
        let expected_a: Vec<String> = (0..2500).map(|i| format!("a-{i}")).collect();
        for (i, id) in expected_a.iter().enumerate() {
            acks.ack("acks.a", id).await;
            if i % 100 == 0 {
                acks.ack("acks.b", &format!("b-{i}")).await;
            }
        }
        acks.flush().await;
        assert_eq!(received(&mut a).await, expected_a);
        let expected_b: Vec<String> = (0..2500).step_by(100).map(|i| format!("b-{i}")).collect();
        assert_eq!(received(&mut b).await, expected_b);
    }

    #[tokio::test]
    async fn acknowledgements_queued_together_leave_in_few_messages() {
        let bus: SharedBus = Arc::new(LocalBus::new());
        let mut a = bus.subscribe("acks.a".into()).await.expect("subscribe");
        let acks = DeliveryAcks::start(bus.clone());
        // Queued while the sending task rarely runs (this test's runtime has one thread).
        for i in 0..1500 {
            acks.ack("acks.a", &format!("{i}")).await;
        }
        acks.flush().await;
        let mut messages = 0usize;
        let mut ids = 0;
        while let Ok(Some(message)) =
            tokio::time::timeout(Duration::from_millis(200), a.next()).await
        {
            let ack: DeliveryAck = serde_json::from_slice(&message.payload).expect("an ack");
            messages += 1;
            ids += ack.msg_ids.len();
        }
        assert_eq!(ids, 1500);
        assert!(
            messages * 10 <= ids,
            "{messages} messages for {ids} acknowledgements"
        );
    }
}
