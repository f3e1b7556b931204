//! Bytes of frames queued for clients and not yet written, per connection and across every
//! connection of the gateway.
//!
//! A connection's queue is bounded in frames and in bytes (`outbound_queue`,
//! `outbound_queue_bytes`), but many slow clients, each under its own bound, could still add
//! up to more than the gateway's memory. The gateway's budget (`max_outbound_bytes_queued`)
//! bounds their sum. A frame is refused, and its client disconnected (1008) as for a full
//! queue of its own, when that client already has frames waiting and the frame would pass
//! either bound. A frame for a client with nothing waiting always goes: a client that reads
//! empties its queue as fast as it is filled, so it keeps working however slow the others
//! are, and a frame larger than a bound is still written to it.
//!
//! Every queued frame carries a [`Charge`] of its bytes, given back when the frame is written
//! or dropped (with the queue of a connection that ended), so nothing is counted forever.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// How often the `aip_gateway_outbound_bytes_queued` gauge is set. Set for every frame, it
/// would cost two metric updates on the path every frame to a client takes.
pub const REPORT_INTERVAL: Duration = Duration::from_secs(1);

/// The gateway's budget of queued outbound bytes.
#[derive(Debug)]
pub struct OutboundBudget {
    queued: AtomicUsize,
    limit: usize,
}

impl OutboundBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(OutboundBudget {
            queued: AtomicUsize::new(0),
            limit,
        })
    }

    /// Bytes of frames queued for clients now (the `aip_gateway_outbound_bytes_queued` gauge).
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }
}

/// Sets the `aip_gateway_outbound_bytes_queued` gauge every [`REPORT_INTERVAL`], for as long
/// as it runs.
pub async fn report(budget: Arc<OutboundBudget>) {
    let mut tick = tokio::time::interval(REPORT_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        metrics::gauge!("aip_gateway_outbound_bytes_queued").set(budget.queued() as f64);
    }
}

/// Why a frame was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The connection's own queue would pass `outbound_queue_bytes`.
    Connection { queued: usize, limit: usize },
    /// The gateway's queues together would pass `max_outbound_bytes_queued`.
    Gateway { queued: usize, limit: usize },
}

/// The queued bytes of one connection, and the gateway's budget they also count in.
#[derive(Debug)]
pub(crate) struct QueueBytes {
    queued: AtomicUsize,
    limit: usize,
    gateway: Arc<OutboundBudget>,
}

impl QueueBytes {
    /// A connection's queue of at most `limit` bytes, counted in `gateway` too.
    pub(crate) fn new(limit: usize, gateway: Arc<OutboundBudget>) -> Arc<Self> {
        Arc::new(QueueBytes {
            queued: AtomicUsize::new(0),
            limit,
            gateway,
        })
    }

    /// Counts a frame of `bytes` in, unless the connection has frames waiting and the frame
    /// would pass its bound or the gateway's.
    pub(crate) fn charge(self: &Arc<Self>, bytes: usize) -> Result<Charge, Refused> {
        let queued = self.queued.fetch_add(bytes, Ordering::AcqRel);
        let total = self.gateway.queued.fetch_add(bytes, Ordering::AcqRel);
        // Dropped on refusal: that takes the bytes off again.
        let charge = Charge {
            bytes,
            queue: self.clone(),
        };
        if queued == 0 {
            return Ok(charge);
        }
        if queued + bytes > self.limit {
            return Err(Refused::Connection {
                queued,
                limit: self.limit,
            });
        }
        if total + bytes > self.gateway.limit {
            return Err(Refused::Gateway {
                queued: total,
                limit: self.gateway.limit,
            });
        }
        Ok(charge)
    }

    /// Bytes of frames queued for this connection now.
    #[cfg(test)]
    pub(crate) fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }
}

/// A queued frame's bytes, counted until the frame is written or dropped.
#[derive(Debug)]
pub(crate) struct Charge {
    bytes: usize,
    queue: Arc<QueueBytes>,
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.queue.queued.fetch_sub(self.bytes, Ordering::AcqRel);
        self.queue
            .gateway
            .queued
            .fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_is_refused_only_behind_others_and_past_a_bound() {
        let gateway = OutboundBudget::new(1_000);
        let slow = QueueBytes::new(600, gateway.clone());
        let other = QueueBytes::new(600, gateway.clone());

        // Nothing waits: even a frame over both bounds goes.
        let large = slow.charge(5_000).expect("alone, it goes");
        assert_eq!(
            slow.charge(1).map(drop),
            Err(Refused::Connection {
                queued: 5_000,
                limit: 600
            })
        );
        drop(large);
        assert_eq!((slow.queued(), gateway.queued()), (0, 0), "given back");

        // Within the connection's bound, past the gateway's.
        let first = slow.charge(500).expect("first");
        let behind = other.charge(400).expect("alone on its connection");
        assert_eq!(
            other.charge(200).map(drop),
            Err(Refused::Gateway {
                queued: 900,
                limit: 1_000
            })
        );
        assert_eq!(gateway.queued(), 900, "a refused frame is not counted");
        drop(first);
        let next = other.charge(200).expect("room again");
        drop((behind, next));
        assert_eq!(gateway.queued(), 0);
    }
}
