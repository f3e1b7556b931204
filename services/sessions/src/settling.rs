//! Settling the frames stream's messages: a message carries one event, or (a gateway's
//! `frames_many`) several frames, each applied as if it had come alone. Such a message is
//! acknowledged once every frame it carries is settled, or handed back for redelivery if any
//! of them was not applied; the frames that were are recognised by their ids when it comes
//! again.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use aip_bus::Delivery;

/// How one frame (or event) ended: settled, or to be delivered again for the reason given.
pub type Verdict = Result<(), String>;

/// Where an event was read from.
pub enum Source {
    /// A stream message of its own.
    Alone(Delivery),
    /// One of the frames of a stream message that carried several.
    Shared(std::sync::Arc<Shared>),
}

/// A stream message carrying several frames, settled once all of them are.
pub struct Shared {
    delivery: Mutex<Option<Delivery>>,
    delivered: u64,
    left: AtomicUsize,
    failed: AtomicBool,
}

impl Shared {
    /// `delivery`, whose `frames` frames are each settled on their own.
    pub fn new(delivery: Delivery, frames: usize) -> Self {
        Shared {
            delivered: delivery.delivered,
            delivery: Mutex::new(Some(delivery)),
            left: AtomicUsize::new(frames),
            failed: AtomicBool::new(false),
        }
    }

    /// Records one frame's verdict; the message once its last frame is settled.
    fn settle_one(&self, verdict: &Verdict) -> Option<(Delivery, bool)> {
        if verdict.is_err() {
            self.failed.store(true, Ordering::Release);
        }
        if self.left.fetch_sub(1, Ordering::AcqRel) != 1 {
            return None;
        }
        let delivery = self
            .delivery
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()?;
        Some((delivery, !self.failed.load(Ordering::Acquire)))
    }
}

impl Source {
    /// How many times the message was delivered (1 the first time).
    pub fn delivered(&self) -> u64 {
        match self {
            Source::Alone(delivery) => delivery.delivered,
            Source::Shared(shared) => shared.delivered,
        }
    }

    /// Acknowledges the message, or hands it back to be delivered again after `delay`, once
    /// what it carries is settled.
    pub async fn settle(self, verdict: Verdict, delay: Duration) {
        let (delivery, applied) = match self {
            Source::Alone(delivery) => (delivery, verdict.is_ok()),
            Source::Shared(shared) => match shared.settle_one(&verdict) {
                Some(settled) => settled,
                None => return,
            },
        };
        if applied {
            if let Err(e) = delivery.ack().await {
                tracing::warn!("ack failed (the frame will be redelivered, and skipped): {e}");
            }
        } else {
            let _ = delivery.nak(delay).await;
        }
    }
}
